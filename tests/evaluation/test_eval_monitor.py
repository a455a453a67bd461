"""FewShotMonitor: logs few-shot accuracy during a real (tiny) fit, and builds from a LightningCLI config."""

import csv
import json

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.loggers import CSVLogger

from ssl_vit.data import ShardDataModule
from ssl_vit.evaluation.features import extract_features
from ssl_vit.evaluation.fewshot import fewshot_accuracy
from ssl_vit.evaluation.monitor import FewShotMonitor
from ssl_vit.models.vit import build_vit


class TinyClassifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.backbone = build_vit("S/8", 32, width=32, depth=1, heads=2)
        self.head = torch.nn.Linear(32, 10)
        self.modes: list[bool] = []  # backbone.training at every step

    def training_step(self, batch, batch_idx):
        self.modes.append(self.backbone.training)
        return F.cross_entropy(self.head(self.backbone.forward_tokens(batch["image"]).pooled), batch["label"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_monitor_logs_fewshot_during_fit(digits_shards, tmp_path):
    # the labelled set: digits val split in two, 2 shards (200 samples) for support, 2 for test
    support = [str(digits_shards / f"val-00000{i}.tar") for i in (0, 1)]
    test = [str(digits_shards / f"val-00000{i}.tar") for i in (2, 3)]
    monitor = FewShotMonitor(support, test, every_n_steps=2, shots=(1, 5), seeds=(0, 1), batch_size=100)
    data = ShardDataModule(
        train_urls=str(digits_shards / "train-{000000..000004}.tar"),
        batch_size=8,
        num_workers=0,
        image_size=32,
        train_batches=6,
    )
    torch.manual_seed(0)
    model = TinyClassifier()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=3,
        accumulate_grad_batches=2,  # 6 batches; global steps 0, 1, 1, 2, 2, 3 at their ends
        callbacks=[monitor],
        logger=CSVLogger(tmp_path),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, data)

    assert model.modes == [True] * 6  # train mode restored after the evaluation at step 2
    with open(tmp_path / "lightning_logs" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("fewshot/5shot")]
    # not at step 0, once at step 2 although two batches end there, and at the end of training
    assert [int(r["step"]) for r in rows] == [2, 3]
    # the last row is the protocol on the final weights
    train, held = (
        extract_features(model.backbone, dm.exact_dataloader("val"), prepare=dm.prepare_batch)
        for dm in (ShardDataModule(val_urls=urls, image_size=32, num_workers=0) for urls in (support, test))
    )
    expected = fewshot_accuracy(train.x, train.y, held.x, held.y, shots=(1, 5), seeds=(0, 1))
    for shots in (1, 5):
        assert abs(float(rows[-1][f"fewshot/{shots}shot"]) - expected[shots][0]) < 1e-6


def test_monitor_builds_from_a_cli_config():
    """LightningCLI instantiates callbacks through jsonargparse from the constructor's type hints."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_argument("--callbacks", type=list[pl.Callback])
    config = {
        "class_path": "ssl_vit.evaluation.monitor.FewShotMonitor",
        "init_args": {"train_urls": "a.tar", "test_urls": ["b.tar"], "every_n_steps": 5, "shots": [1, 10],
                      "feature": "lastk", "classes": [5, 6]},
    }  # fmt: skip
    (monitor,) = parser.instantiate_classes(
        parser.parse_args(["--callbacks", json.dumps([config])])
    ).callbacks
    assert isinstance(monitor, FewShotMonitor)
    assert (monitor.every_n_steps, monitor.shots, monitor.feature, monitor.classes) == (
        5,
        (1, 10),
        "lastk",
        [5, 6],
    )
