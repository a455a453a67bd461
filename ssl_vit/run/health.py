"""Is the representation collapsing? Statistics of the features a task trains, logged every N steps, and
a stop when they say every image has come to look the same.

A task hands its features over with each training step: `training_step` returns them under
`monitor_features` (`MaskedPatchPretraining` does): `student` (B, D), one vector per image of the
step's (corrupted) input (the masked tasks: the mean of the encoder's patch tokens, which the loss
trains; their [class] token gets no gradient and drifts towards a constant whatever the patches
learn); where a teacher computes the targets, also `teacher` (B, D), the same of the teacher, and
`target` (B, M, *T), the targets themselves. A task that hands over none is not watched.

Legend: B batch (per device), D width.
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import Tensor

from ssl_vit.errors import BadValue, UserError

# The logged names of each watched feature set's std and effective rank.
METRICS = {
    "student": ("health/feature_std", "health/effective_rank"),
    "teacher": ("health/teacher_std", "health/teacher_effective_rank"),
}


class CollapseError(UserError):
    """Training stopped on collapsed features; the message names the step, the value and the fix."""


def feature_std(features: Tensor) -> Tensor:
    """features (B, D) -> the per-dimension standard deviation across the batch of the L2-normalised
    features, averaged over the dimensions: about 1/sqrt(D) for features spread over the sphere, 0 when
    every image maps to the same direction (SimSiam's collapse check, Chen & He 2021, sec 4.1).
    Normalised, it needs no scale of its own: one threshold serves every width and normalisation. NaN
    (never below a threshold) for a batch of one image, whose spread says nothing (and for which torch's
    std warns in two lines at every look)."""
    if features.shape[0] < 2:
        return torch.full((), float("nan"), device=features.device)
    return F.normalize(features.float(), dim=-1).std(dim=0).mean()


def effective_rank(features: Tensor, eps: float = 1e-7) -> Tensor:
    """features (B, D) -> exp of the entropy of the singular values normalised to sum 1 (Roy & Vetterli
    2007), uncentred and with RankMe's epsilon (Garrido et al. 2023): from 1 (every feature on one line)
    to min(B, D) (all directions used alike)."""
    singular = torch.linalg.svdvals(features.float())
    p = singular / singular.sum().clamp_min(torch.finfo(singular.dtype).tiny) + eps
    return torch.exp(-(p * p.log()).sum())


def target_variance(target: Tensor) -> Tensor:
    """target (B, M, *T) -> the variance across the batch's target vectors, averaged over their entries:
    a teacher whose targets stop varying has collapsed with it (data2vec logs and guards the same,
    Baevski et al. 2022)."""
    return target.flatten(0, 1).flatten(1).float().var(dim=0).mean()


class HealthMonitor(pl.Callback):
    """Logs `health/feature_std` and `health/effective_rank` of the student's features (and
    `health/teacher_std`, `health/teacher_effective_rank`, `health/target_var` where a teacher makes the
    targets) every `every_n_steps` steps, and stops the run when the student's or the teacher's collapse.

    Args:
        every_n_steps: how often to look (the trainer's log_every_n_steps if unset). Cost per look: the
            singular values of each B x D feature matrix (3 ms for 128 x 768 on one CPU core), a
            reduction over the ranks (so they stop together) and one host read; nothing at the steps in
            between. The features are the step's own: no extra forward pass.
        min_std: the `feature_std` below which features count as collapsed (0: never stop). Features
            spread over the sphere give about 1/sqrt(D): 0.036 for D = 768, 0.125 for D = 64.
        patience: consecutive looks below `min_std` before the run stops.

    The stop raises `CollapseError`: `ssl-vit fit` ends with one line `ssl-vit: error: ...` and exit
    status 2, as for the non-finite guard's stop; the checkpoints written before stay as they are.
    """

    def __init__(self, every_n_steps: int | None = None, min_std: float = 1e-4, patience: int = 3) -> None:
        if every_n_steps is not None and every_n_steps < 1:
            raise BadValue(f"every_n_steps must be at least 1, got {every_n_steps}")
        if min_std < 0:
            raise BadValue(f"min_std must be >= 0, got {min_std}")
        if patience < 1:
            raise BadValue(f"patience must be at least 1, got {patience}")
        self.every, self.min_std, self.patience = every_n_steps, min_std, patience
        self.low = 0  # consecutive looks below min_std
        self._last_step = -1

    def state_dict(self) -> dict[str, Any]:
        return {"low": self.low}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.low = state_dict["low"]

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module, outputs, batch, batch_idx) -> None:
        features = outputs.get("monitor_features") if isinstance(outputs, dict) else None
        step = trainer.global_step
        if not features or step == self._last_step or step % (self.every or trainer.log_every_n_steps or 1):
            return
        self._last_step = step  # once per optimizer step, also with gradient accumulation
        stds = {}
        logged = {}
        for name, (std_key, rank_key) in METRICS.items():
            if features.get(name) is not None:
                stds[name] = trainer.strategy.reduce(feature_std(features[name]), reduce_op="mean")
                logged[std_key], logged[rank_key] = stds[name], effective_rank(features[name])
        if features.get("target") is not None:
            logged["health/target_var"] = target_variance(features["target"])
        pl_module.log_dict(logged, on_step=True, on_epoch=False)
        if self.min_std > 0 and stds:
            self._check(trainer, step, stds)

    def _check(self, trainer: pl.Trainer, step: int, stds: dict[str, Tensor]) -> None:
        name, lowest = min(((name, float(std)) for name, std in stds.items()), key=lambda item: item[1])
        self.low = self.low + 1 if lowest < self.min_std else 0
        if self.low < self.patience:
            return
        callback = trainer.checkpoint_callback
        saved = getattr(callback, "last_model_path", None) or getattr(callback, "best_model_path", None)
        raise CollapseError(
            f"collapsed features at step {step}: the {name}'s feature std was below --health.min_std "
            f"{self.min_std:g} at {self.patience} consecutive checks (now {lowest:.2e}; spread-out features "
            f"give about 1/sqrt(width)), last checkpoint: {saved or 'none yet'}: lower the learning rate or "
            "lengthen the warmup (with a teacher, raise its EMA momentum), then start again or resume an "
            "earlier checkpoint with --ckpt_path"
        )
