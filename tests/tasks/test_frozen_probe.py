"""What every frozen probe shares: a validation and a test pass log each head's accuracy, the best
head's with its lr, and the heads' mean loss (a segmentation's accuracy is of its mask's pixels)."""

import pytest
import torch
from task_helpers import trainer

from ssl_vit.data.format.masks import IGNORE_INDEX
from ssl_vit.models.vit import ViTConfig
from ssl_vit.tasks.attentive_probe import AttentiveProbe
from ssl_vit.tasks.linear_probe import LinearProbe
from ssl_vit.tasks.seg_probe import LinearSegProbe

BACKBONE = ViTConfig("S/8", 32, width=32, depth=1, heads=2)
LRS = (0.01, 0.1)


def batches(target: str) -> list[dict]:
    """Two batches of four random images with labels of 4 classes, or masks with an unlabelled band."""
    torch.manual_seed(0)
    out = []
    for _ in range(2):
        batch = {"image": torch.randn(4, 3, 32, 32), "label": torch.randint(0, 4, (4,))}
        if target == "mask":
            mask = torch.randint(0, 4, (4, 32, 32), dtype=torch.uint8)
            mask[:, :4] = IGNORE_INDEX
            batch = {"image": batch["image"], "mask": mask}
        out.append(batch)
    return out


@pytest.mark.parametrize(
    "probe",
    [
        lambda: LinearProbe(BACKBONE, num_classes=4, lrs=LRS),
        lambda: AttentiveProbe(BACKBONE, num_classes=4, lrs=LRS, weight_decays=(0.0, 0.0)),
        lambda: LinearSegProbe(BACKBONE, num_classes=4, lrs=LRS),
    ],
    ids=["linear", "attentive", "segmentation"],
)
def test_every_probe_validates_and_tests_each_head(probe, tmp_path):
    model = probe()
    data = torch.utils.data.DataLoader(batches(model.TARGET), batch_size=None)
    run = trainer(tmp_path, max_epochs=1)
    run.fit(model, data, data)
    for stage, metrics in (("val", run.callback_metrics), ("test", run.test(model, data, verbose=False)[0])):
        per_lr = [float(metrics[f"{stage}/accuracy_lr{lr:g}"]) for lr in LRS]
        assert all(0 <= accuracy <= 1 for accuracy in per_lr)
        assert float(metrics[f"{stage}/accuracy"]) == max(per_lr)
        assert float(metrics[f"{stage}/best_lr"]) == pytest.approx(LRS[per_lr.index(max(per_lr))])
        assert torch.isfinite(torch.as_tensor(metrics[f"{stage}/loss"]))
