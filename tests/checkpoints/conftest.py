"""Tiny checkpoints the checkpoint tests train: each task one optimizer step on real digits."""

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F

from ssl_vit.models.vit import ViTConfig
from ssl_vit.tasks import FineTune, MaskedPatchPretraining, SupervisedPretraining

CUSTOM = ViTConfig("S/8", 32, width=64, depth=2, heads=2)  # no timm model: architecture written out


def train(model: pl.LightningModule, batch: dict, path) -> pl.LightningModule:
    """One AdamW step at a high lr (so the zero-initialised heads are not zero), saved to `path`."""
    model.optimizer_factory = lambda params: torch.optim.AdamW(params, lr=0.05)
    trainer = pl.Trainer(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, max_steps=1, default_root_dir=path.parent,
    )  # fmt: skip
    trainer.fit(model, train_dataloaders=torch.utils.data.DataLoader([batch], batch_size=None))
    trainer.save_checkpoint(path)
    return model.eval()


def resized(batch: dict, size: int) -> dict:
    return {**batch, "image": F.interpolate(batch["image"], size=size, mode="bilinear")}


@pytest.fixture(scope="session")
def trained(tmp_path_factory, digits_batch):
    """name -> (checkpoint path, the trained task in eval mode, image size)."""
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("trained")
    tasks = {
        # A paper variant at its native resolution: exported under timm's own name.
        "ti16_supervised": (SupervisedPretraining(ViTConfig("Ti/16", 224), 10), 224),
        "custom_supervised": (SupervisedPretraining(CUSTOM, 10), 32),
        # Global average pooling (timm's global_pool='avg' with fc_norm) and FineTune's head.
        "custom_gap_finetune": (FineTune(ViTConfig("S/8", 32, "gap", 64, 2, 2), 10, feature="mean"), 32),
        # MAE's fine-tuning: mean of the final-norm patch tokens, then its own fc_norm.
        "custom_mae_finetune": (FineTune(CUSTOM, 10, preset="mae"), 32),
        "custom_mpp": (MaskedPatchPretraining(CUSTOM, preset="vit_mpp"), 32),
        # An EMA teacher beside the student (one step: the teacher is 0.4% of the way to it).
        "custom_ijepa": (MaskedPatchPretraining(CUSTOM, preset="ijepa", decoder_dim=64, decoder_depth=1), 32),
    }
    eight = {key: value[:8] for key, value in digits_batch.items()}
    return {
        name: (folder / f"{name}.ckpt", train(task, resized(eight, size), folder / f"{name}.ckpt"), size)
        for name, (task, size) in tasks.items()
    }
