"""A 2-process DDP `fit` (CPU, gloo) on ShardDataModule, run by test_ddp_fit.py as
`python ddp_fit.py TRAIN_URLS VAL_URLS OUT [DECODE[,DECODE...]]`.

Lightning's DDP launcher re-runs this script for rank 1. For each decode (`cpu` by default; several:
one fit after the other in the same two processes, whose process group the second fit finds set up)
each rank writes OUT/rankN-DECODE.json with the training batches it ran per epoch, the validation keys
it saw and the synced metrics.
"""

import faulthandler
import json
import sys
from datetime import timedelta
from pathlib import Path

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
import torchmetrics
from pytorch_lightning.strategies import DDPStrategy

from ssl_vit.data import LogSkippedSamples, ShardDataModule
from ssl_vit.data.options import Augment, Limits, Stream

TRAIN_BATCHES = 4


class PooledLinear(pl.LightningModule):
    """A linear layer on mean-pooled pixels: just enough model to step DDP."""

    def __init__(self, num_classes: int):
        super().__init__()
        self.head = torch.nn.Linear(3, num_classes)
        self.val_samples = torchmetrics.SumMetric()
        self.train_batches: list[int] = []
        self.train_keys: list[str] = []
        self.val_keys: list[str] = []

    def forward(self, images):
        return self.head(images.mean(dim=(2, 3)))

    def on_train_epoch_start(self):
        self.train_batches.append(0)

    def training_step(self, batch, batch_idx):
        self.train_batches[-1] += 1
        self.train_keys.extend(batch["key"])
        return F.cross_entropy(self(batch["image"]), batch["label"])

    def validation_step(self, batch, batch_idx):
        self.val_samples.update(torch.tensor(float(len(batch["key"]))))
        self.log("val/samples", self.val_samples, on_epoch=True, batch_size=len(batch["key"]))
        self.val_keys.extend(batch["key"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main(urls: str, val_urls: str, out: str, decodes: str = "cpu") -> None:
    # A run that hangs shows where: each rank's threads after 240 s (the tests wait 280-300 s).
    faulthandler.dump_traceback_later(240, exit=False)
    for decode in decodes.split(","):
        fit(urls, val_urls, out, decode)


def fit(urls: str, val_urls: str, out: str, decode: str) -> None:
    pl.seed_everything(0, verbose=False)
    dm = ShardDataModule(
        train_urls=urls,
        val_urls=val_urls,
        batch_size=3,
        num_workers=2,
        image_size=16,
        augment=Augment(eval_crop_pct=1.0),
        train_batches=TRAIN_BATCHES,
        stream=Stream(shuffle_buffer=8),
        decode=decode,
        limits=Limits(loader_timeout_s=60),  # a worker that delivers nothing fails the run with its reason
    )
    model = PooledLinear(num_classes=10)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        # A rank whose peer died fails in a minute, with its reason, instead of waiting half an hour.
        strategy=DDPStrategy(timeout=timedelta(seconds=60)),
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[LogSkippedSamples()],
    )
    trainer.fit(model, datamodule=dm)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    Path(out, f"rank{trainer.global_rank}-{decode}.json").write_text(
        json.dumps(
            {
                "train_batches": model.train_batches,
                "train_keys": model.train_keys,
                "val_keys": model.val_keys,
                "metrics": metrics,
                "world_size": trainer.world_size,
            }
        )
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
