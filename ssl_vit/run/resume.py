"""Exact resume, the model's half: every rank's global random state goes into the checkpoint and comes
back when training resumes, so masks, corruptions, dropout, drop path and mixup continue as if the run
had never stopped. (The data half is the training DataLoader's own state: `ssl_vit.data.datamodule`.)

Lightning restores the model, optimizer, schedule, step counters and loops, but not the RNGs: a resumed
run would otherwise draw its masks from the seed the CLI sets at start-up, not from where it stopped.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch


def rng_state() -> dict[str, Any]:
    """This process's global RNG states, in types `torch.load(weights_only=True)` reads back."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
        "numpy": [torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
        "python": random.getstate(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state(("MT19937", keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))


class RandomState(pl.Callback):
    """Saves every rank's RNG states with each checkpoint and restores them when training starts again.

    They are restored at `on_train_start`, after the sanity check and after the training DataLoader
    started (whose workers' seeds come from a generator of its own, not the global one), so what the
    resumed run draws next is exactly what the uninterrupted run drew after the checkpoint's step.
    """

    def __init__(self) -> None:
        self._to_restore: list[dict] | None = None

    def state_dict(self) -> dict[str, Any]:
        # Lightning builds the checkpoint on every rank (only rank 0 writes it), so the gather is matched.
        local = rng_state()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            ranks = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(ranks, local)
            return {"ranks": ranks}
        return {"ranks": [local]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._to_restore = state_dict["ranks"]

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.restore(trainer)

    def restore(self, trainer: pl.Trainer, state_dict: dict[str, Any] | None = None) -> None:
        """Sets this rank's RNGs now to those of `state_dict` (this callback's state in a checkpoint; by
        default the state loaded last): a loss-spike rollback restores them mid-run."""
        if state_dict is not None:
            self.load_state_dict(state_dict)
        ranks, self._to_restore = self._to_restore, None
        if ranks and len(ranks) == trainer.world_size:
            set_rng_state(ranks[trainer.global_rank])
