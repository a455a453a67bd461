"""Is this training step a loss spike? The running median of the loss over the last `window` steps, and
the step's loss against it.

What the detector sees is one number per optimizer step, the same on every rank: the highest loss of the
ranks (so that a spike on one rank is a spike of the step), read from the device in the one host read
the non-finite guard makes per step (`ssl_vit.run.nonfinite`). The median, over the steps that were not
spikes, is kept on the host: a few floats, and the window is part of the guard's checkpoint state, so a
resumed run judges its next steps as the uninterrupted one would.

Why a median and a ratio: the loss falls by an order of magnitude over a run and jumps from batch to
batch; a median of the recent past follows the first and ignores single outliers of the second, and a
ratio to it means the same on every objective (cross-entropy over 512 colours, MSE on normalised pixels,
smooth L1 on latents). How the defaults were chosen from measured loss curves: docs/RELIABILITY.md, "Loss
spikes".
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Any

NON_FINITE = "non-finite loss or gradients"
SPIKE = "loss spike"


class SpikeDetector:
    """Judges each optimizer step from its loss (reduced over the ranks) and whether it was finite;
    `window`, `spike_factor` and `patience` as `NonFiniteGuard`'s."""

    def __init__(self, window: int, spike_factor: float, patience: int) -> None:
        self.window, self.spike_factor, self.patience = window, spike_factor, patience
        self.losses: deque[float] = deque(maxlen=window)
        self.scaler_skips = 0  # non-finite steps in a row the gradient scaler skipped

    @property
    def median(self) -> float | None:
        """The median loss of the last `window` steps that were not spikes; None until there are as many."""
        return statistics.median(self.losses) if len(self.losses) == self.window else None

    def judge(self, loss: float, finite: bool, scaler: bool) -> str | None:
        """Why a step whose loss is `loss` (meaningless unless `finite`) is a spike, or None: then a
        finite loss joins the window. `scaler`: AMP's gradient scaler skips non-finite steps."""
        if not finite:
            if not scaler:
                return NON_FINITE
            self.scaler_skips += 1
            if self.scaler_skips < self.patience:
                return None
            self.scaler_skips = 0
            return f"{self.patience} steps in a row with non-finite gradients, skipped by the gradient scaler"
        self.scaler_skips = 0
        median = self.median
        if self.spike_factor and median is not None and median > 0 and loss > self.spike_factor * median:
            return SPIKE
        self.losses.append(loss)
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"losses": list(self.losses), "scaler_skips": self.scaler_skips}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.losses = deque(state.get("losses", []), maxlen=self.window)
        self.scaler_skips = state.get("scaler_skips", 0)
