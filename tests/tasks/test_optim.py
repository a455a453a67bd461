"""The schedule, weight-decay groups and lr scaling by global batch, through a real Trainer."""

import math

import pytest
import pytorch_lightning as pl
import torch

from ssl_vit.models.vit import ViTConfig
from ssl_vit.tasks import SupervisedPretraining, WarmupDecay
from ssl_vit.tasks.base import Training


def lrs(decay, steps=10, warmup=4, floor=0.0):
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=2.0)
    scheduler = WarmupDecay(
        optimizer, total_steps=steps, warmup_steps=warmup, decay=decay, min_lr_ratio=floor
    )
    values = []
    for _ in range(steps):
        values.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return values


def test_linear_warmup_then_cosine_or_linear_decay():
    cosine = lrs("cosine")
    assert cosine[:4] == pytest.approx([0.5, 1.0, 1.5, 2.0])
    assert cosine[4] == pytest.approx(2.0)  # the peak, then decay
    assert cosine[7] == pytest.approx(2.0 * 0.5 * (1 + math.cos(math.pi * 3 / 6)))
    assert all(a >= b for a, b in zip(cosine[3:], cosine[4:]))
    linear = lrs("linear", floor=0.1)
    assert linear[7] == pytest.approx(2.0 * (0.1 + 0.9 * (1 - 3 / 6)))
    with pytest.raises(ValueError, match="valid: 'cosine', 'linear'"):
        WarmupDecay(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1), 10, decay="step")


class Batches(pl.LightningDataModule):
    def __init__(self, batch_size=4):
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self):
        data = [
            {"image": torch.randn(self.batch_size, 3, 16, 16), "label": torch.zeros(self.batch_size).long()}
        ]
        return torch.utils.data.DataLoader(data * 3, batch_size=None)


def test_lr_is_scaled_by_global_batch_and_follows_the_schedule(tmp_path):
    model = SupervisedPretraining(
        ViTConfig("S/8", 16, width=32, depth=1, heads=2),
        num_classes=2,
        training=Training(
            optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.3),
            lr_scheduler=lambda optimizer, steps: WarmupDecay(optimizer, steps, warmup_steps=2),
            lr_reference_batch=256,
        ),
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=1,
        accumulate_grad_batches=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, datamodule=Batches(batch_size=4))
    optimizer = trainer.optimizers[0]
    peak = 1e-3 * 4 / 256
    assert all(group["initial_lr"] == pytest.approx(peak) for group in optimizer.param_groups)
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.total_steps == 3 and scheduler.warmup_steps == 2
    decays = sorted(group["weight_decay"] for group in optimizer.param_groups)
    assert decays == [0.0, 0.3]  # norms/biases/tokens off, the rest at the optimizer's value
