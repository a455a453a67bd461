"""Fixtures shared by the task tests."""

import pytest
import torch
from task_helpers import DigitBatches, trainer

from ssl_vit.models.vit import ViTConfig
from ssl_vit.tasks import SupervisedPretraining
from ssl_vit.tasks.base import Training

BACKBONE = ViTConfig("S/8", 32, width=64, depth=2, heads=2)


@pytest.fixture(scope="module")
def supervised_ckpt(tmp_path_factory, digits_batch):
    """A real Lightning checkpoint of a SupervisedPretraining trained for 2 steps."""
    torch.manual_seed(0)
    model = SupervisedPretraining(
        BACKBONE, num_classes=10, training=Training(optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    )
    run = trainer(tmp_path_factory.mktemp("sup"), max_steps=2, limit_val_batches=0)
    run.fit(model, datamodule=DigitBatches(digits_batch))
    path = tmp_path_factory.mktemp("ckpt") / "sup.ckpt"
    run.save_checkpoint(path)
    return path, {k: v.clone() for k, v in model.backbone.state_dict().items()}
