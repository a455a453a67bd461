"""Intervals on accuracies and on paired differences: a seeded percentile bootstrap.

Every result of a suite is the mean of a 0/1 tensor `correct` (R, S, M): R pretraining runs of one
method (replicates; 1 for a single checkpoint), S few-shot support draws (its seeds; 1 for k-NN, linear
probe, fine-tune), M test images. All R runs are scored on the same S draws and M images, and so is
every other checkpoint of a comparison: the three axes are crossed, not nested.

The interval resamples the three axes independently (a crossed bootstrap, one multinomial weight
vector per axis per resample), so it covers all three sources of noise at once without a model of how
they combine; it reduces to the usual bootstrap over test images for single-run, single-seed results.
A paired difference reuses the same seed and image weights for both checkpoints (the same draws and
images score both: their shared difficulty cancels) and independent run weights (run i of one method
has no partner in the other). Caveat: an axis with few levels (2-5 replicates or seeds) is resampled
with its variance shrunk by (n - 1) / n and read with normal rather than Student-t quantiles, so
intervals are somewhat narrow there; more pretraining runs are the fix, not a formula.

Hand-written: torchmetrics' BootStrapper resamples one axis of a metric's inputs; neither it nor
scipy.stats.bootstrap resamples crossed axes with weights shared between two statistics.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Literal, NamedTuple

import torch
from torch import Tensor

LEVEL = 0.95  # two-sided
CHUNK = 64  # resamples per einsum: the (chunk, M) image weights stay small for large test sets

Verdict = Literal["win", "loss", "noise"]


class Interval(NamedTuple):
    mean: float  # the accuracy: mean over runs, seeds and images
    low: float  # LEVEL percentile interval of the bootstrap
    high: float
    seed_std: float  # population std across seeds of the per-seed accuracy (0 for one seed)
    run_std: float  # population std across pretraining runs of the per-run accuracy (0 for one run)

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2


class Difference(NamedTuple):
    mean: float  # checkpoint minus baseline
    low: float
    high: float
    verdict: Verdict  # win: interval above 0; loss: below 0; noise: it contains 0

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2


def _weights(n: int, resamples: int, generator: torch.Generator) -> Tensor:
    """(resamples, n) float64: how often each of n items is drawn in each resample, divided by n."""
    draws = torch.randint(n, (resamples, n), generator=generator)
    counts = torch.zeros(resamples, n, dtype=torch.float64)
    return counts.scatter_add_(1, draws, torch.ones_like(counts)) / n


def _means(correct: Tensor, runs: Tensor, seeds: Tensor, images: Tensor) -> Tensor:
    """correct (R, S, M); weights (C, R), (C, S), (C, M) -> (C,) weighted means."""
    return torch.einsum("rsm,cr,cs,cm->c", correct.double(), runs, seeds, images)


def _check(correct: Tensor) -> None:
    if correct.ndim != 3 or 0 in correct.shape:
        raise ValueError(f"correct must be (runs, seeds, images) and non-empty, got {tuple(correct.shape)}")


def _bounds(samples: Tensor) -> tuple[float, float]:
    tail = (1 - LEVEL) / 2
    low, high = torch.quantile(samples, torch.tensor([tail, 1 - tail], dtype=samples.dtype)).tolist()
    return low, high


def interval(correct: Tensor, resamples: int = 1000, seed: int = 0) -> Interval:
    """The accuracy of `correct` (R, S, M) with its LEVEL interval, from `resamples` crossed resamples
    drawn from `seed` (the same seed gives the same interval)."""
    _check(correct)
    runs, seeds, images = correct.shape
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for start in range(0, resamples, CHUNK):
        count = min(CHUNK, resamples - start)
        image_w, seed_w = _weights(images, count, generator), _weights(seeds, count, generator)
        samples.append(_means(correct, _weights(runs, count, generator), seed_w, image_w))
    low, high = _bounds(torch.cat(samples))
    values = correct.double()
    return Interval(
        values.mean().item(),
        low,
        high,
        values.mean((0, 2)).std(correction=0).item(),
        values.mean((1, 2)).std(correction=0).item(),
    )


def paired_difference(correct: Tensor, baseline: Tensor, resamples: int = 1000, seed: int = 0) -> Difference:
    """Accuracy of `correct` (R, S, M) minus that of `baseline` (R', S, M), scored on the same S seeds
    and M images in the same order, with its LEVEL interval from a paired bootstrap (shared seed and
    image weights, independent run weights). A checkpoint against itself gives exactly 0, width 0."""
    return contrast([(1.0, correct, "a"), (-1.0, baseline, "b")], resamples, seed)


def contrast(terms: list[tuple[float, Tensor, Hashable]], resamples: int = 1000, seed: int = 0) -> Difference:
    """sum of coefficient x accuracy over `terms` (coefficient, correct (R, S, M), group), all scored on
    the same S seeds and M images in the same order, with its LEVEL paired-bootstrap interval: seed and
    image weights shared by every term, run weights shared by the terms of one group (the same
    pretraining runs in two columns) and independent between groups. `paired_difference` is
    [(1, a, "a"), (-1, b, "b")]; a difference of differences (is a's edge over b larger in one column
    than in another?) is [(1, a1, "a"), (-1, b1, "b"), (-1, a2, "a"), (1, b2, "b")]."""
    for _, correct, _ in terms:
        _check(correct)
    shapes = {tuple(correct.shape[1:]) for _, correct, _ in terms}
    if len(shapes) != 1:
        raise ValueError(
            f"paired results need the same seeds and test images: (seeds, images) differ, {sorted(shapes)}"
        )
    runs = {}
    for _, correct, group in terms:
        if runs.setdefault(group, len(correct)) != len(correct):
            raise ValueError(f"group {group!r} has terms with different numbers of runs")
    ((seeds, images),) = shapes
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for start in range(0, resamples, CHUNK):
        count = min(CHUNK, resamples - start)
        image_w, seed_w = _weights(images, count, generator), _weights(seeds, count, generator)
        run_w = {group: _weights(n, count, generator) for group, n in runs.items()}
        samples.append(
            sum(coef * _means(correct, run_w[group], seed_w, image_w) for coef, correct, group in terms)
        )
    low, high = _bounds(torch.cat(samples))
    verdict: Verdict = "win" if low > 0 else "loss" if high < 0 else "noise"
    mean = sum(coef * correct.double().mean().item() for coef, correct, _ in terms)
    return Difference(mean, low, high, verdict)
