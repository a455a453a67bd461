"""Helpers shared by the task tests: real digits as Lightning batches, a quiet CPU trainer."""

import pytorch_lightning as pl
import torch


class DigitBatches(pl.LightningDataModule):
    """The 16 real digits as a few training batches of 8 and one validation batch."""

    def __init__(self, batch, batch_size=8, steps=3):
        super().__init__()
        self.batch, self.batch_size, self.steps = batch, batch_size, steps

    def train_dataloader(self):
        size = self.batch_size
        halves = [{k: v[i : i + size] for k, v in self.batch.items()} for i in (0, size)]
        return torch.utils.data.DataLoader((halves * self.steps)[: self.steps], batch_size=None)

    def val_dataloader(self):
        return torch.utils.data.DataLoader([self.batch], batch_size=None)


def trainer(tmp_path, **kwargs) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, **kwargs,
    )  # fmt: skip
