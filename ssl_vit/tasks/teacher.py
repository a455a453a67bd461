"""The EMA teacher of the latent-target objectives (I-JEPA, data2vec 2.0): a copy of the student backbone
whose weights follow the student's as an exponential moving average, never trained. The features of the
uncorrupted image it gives as targets are `ssl_vit.targets.teacher_target`.

The teacher is a plain `ViT` the task holds as `teacher` beside `backbone`, so a checkpoint carries it
under `teacher.` with timm's key names (`ssl_vit.checkpoints` loads and exports either). Its parameters
do not require gradients: no optimizer group takes them (timm's weight-decay groups skip them), DDP
neither reduces nor broadcasts them after the start (every rank applies the same update to the same,
already synchronised, student weights), and FSDP2 shards its blocks like the student's.

timm's `ModelEmaV3` performs the same update, but it keeps the copy as `module` (its keys would not be
timm's under `teacher.`), cannot be built on the meta device where FLOPs are counted (its private
rounding generator), and its decay warmup is not the papers' momentum ramp (`momentum_at`).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Literal

import torch
from torch.optim.swa_utils import get_ema_multi_avg_fn

from ssl_vit.models.vit import ViT, ViTConfig

MomentumSchedule = Literal["cosine", "linear"]


def make_teacher(student: ViT, config: ViTConfig) -> ViT:
    """A frozen copy of `student`, built without drop path or activation checkpointing: the targets come
    from the whole network in every mode Lightning puts the task in, and nothing is kept for a backward."""
    teacher = replace(config, drop_path_rate=0.0, grad_checkpointing=False).build()
    teacher.load_state_dict(student.state_dict())
    return teacher.requires_grad_(False)


def momentum_at(step: int, total: int, start: float, end: float, schedule: MomentumSchedule) -> float:
    """The EMA momentum after optimizer step `step` of `total`: from `start` to `end`, cosine (BYOL, Grill
    et al. 2020: 1 - (1 - start)(cos(pi k / K) + 1) / 2 for end 1) or linear (I-JEPA's momentum
    scheduler; data2vec's annealed EMA decay), then held at `end`."""
    progress = min(1.0, step / max(1, total))
    shape = (1 - math.cos(math.pi * progress)) / 2 if schedule == "cosine" else progress
    return start + (end - start) * shape


@torch.no_grad()
def ema_update(teacher: ViT, student: ViT, momentum: float) -> None:
    """teacher = momentum * teacher + (1 - momentum) * student, every parameter in one fused kernel
    (torch's multi-tensor lerp, through its public `get_ema_multi_avg_fn`)."""
    get_ema_multi_avg_fn(momentum)(list(teacher.parameters()), list(student.parameters()), None)
