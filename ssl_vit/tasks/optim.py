"""Optimisation every task shares: weight-decay groups, the step-based schedule, lr scaling by batch."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

from timm.optim import param_groups_layer_decay, param_groups_weight_decay
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from ssl_vit.errors import BadValue

# What recipes give as `lr_scheduler`: the optimizer and the run's total optimizer steps come from the
# task at `configure_optimizers`, everything else from the YAML (jsonargparse skips the first two).
SchedulerCallable = Callable[[Optimizer, int], LRScheduler]


class WarmupDecay(LambdaLR):
    """Linear warmup from 0 over `warmup_steps`, then cosine or linear decay to `min_lr_ratio` x peak
    at `total_steps`: the ViT paper's (10k warmup steps, cosine or linear decay) and MAE's schedule.

    Written as one LambdaLR because torch's SequentialLR(LinearLR, CosineAnnealingLR) cannot decay to a
    floor set relative to the peak, and timm's schedulers are not `torch.optim` LRSchedulers Lightning
    steps by itself.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_steps: int,
        warmup_steps: int = 0,
        decay: Literal["cosine", "linear"] = "cosine",
        min_lr_ratio: float = 0.0,
    ) -> None:
        if decay not in ("cosine", "linear"):
            raise BadValue(f"unknown decay {decay!r}; valid: 'cosine', 'linear'")
        self.total_steps, self.warmup_steps = max(1, total_steps), max(0, warmup_steps)
        self.decay, self.min_lr_ratio = decay, min_lr_ratio
        super().__init__(optimizer, self.factor)

    def factor(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if self.decay == "cosine" else 1 - progress
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * shape


def weight_decay_groups(
    module: nn.Module, no_decay: set[str], layer_decay: float | None = None
) -> list[dict]:
    """Parameter groups with weight decay off for norms, biases (every 1-D parameter) and the names in
    `no_decay` (position embeddings, [class] and mask tokens; fnmatch patterns), as in the ViT and MAE
    code; with `layer_decay` (None or 1: off) split by layer too, each with an `lr_scale` (timm's
    `param_groups_layer_decay`, by the module's `group_matcher`). The decaying groups carry no
    `weight_decay` key, so the optimizer's configured value applies."""
    if layer_decay in (None, 1.0):
        groups = param_groups_weight_decay(module, weight_decay=1.0, no_weight_decay_list=no_decay)
    else:
        groups = param_groups_layer_decay(
            module, weight_decay=1.0, no_weight_decay_list=no_decay, layer_decay=layer_decay
        )
    for group in groups:
        if group["weight_decay"]:
            del group["weight_decay"]
    return groups
