"""Intervals on results and on paired differences: a seeded percentile bootstrap.

Every result of a suite is a metric of per-test-image statistics (`Score`): `values` (R, S, M, F) for
R pretraining runs of one method (replicates; 1 for a single checkpoint), S support draws (a few-shot
protocol's seeds; 1 for the other kinds), M test images and F statistics per image, and a `Metric`
that turns their mean over runs, seeds and images into the number reported. Accuracy is the mean of
one correct flag per image (F = 1); a segmentation's mIoU is computed from per-class intersections
and unions summed over images (F = 2K, `ssl_vit.evaluation.segmentation`). All R runs are scored on the
same S draws and M images, and so is every other checkpoint of a comparison: the three axes are
crossed, not nested.

The interval resamples the three axes independently (a crossed bootstrap, one multinomial weight
vector per axis per resample) and applies the metric to each resample's weighted mean statistics, so
it covers all three sources of noise at once without a model of how they combine, for any metric
(a ratio of sums such as mIoU included); it reduces to the usual bootstrap over test images for
single-run, single-seed results. A paired difference reuses the same seed and image weights for both
checkpoints (the same draws and images score both: their shared difficulty cancels) and independent
run weights (run i of one method has no partner in the other). Caveat: an axis with few levels (2-5
replicates or seeds) is resampled with its variance shrunk by (n - 1) / n and read with normal rather
than Student-t quantiles, so intervals are somewhat narrow there; more pretraining runs are the fix,
not a formula.

Hand-written: torchmetrics' BootStrapper resamples one axis of a metric's inputs; neither it nor
scipy.stats.bootstrap resamples crossed axes with weights shared between two statistics.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from typing import Literal, NamedTuple

import torch
from torch import Tensor

LEVEL = 0.95  # two-sided
CHUNK = 64  # resamples per einsum: the (chunk, M) image weights stay small for large test sets

Verdict = Literal["win", "loss", "noise"]


class Metric(NamedTuple):
    """How a column's per-image statistics become its number: `of` maps mean statistics (..., F) over
    images (and seeds and runs) to the metric (...). A module-level function, so that a `Score` pickles
    (torchrun's ranks gather them)."""

    name: str  # what the number is, for tables and axes: "accuracy", "mIoU", "pixel accuracy"
    of: Callable[[Tensor], Tensor]


def first(means: Tensor) -> Tensor:
    """(..., 1) mean correct flags -> (...) accuracy."""
    return means[..., 0]


ACCURACY = Metric("accuracy", first)


class Score(NamedTuple):
    """One result column before it is a number: `values` (R, S, M, F) float64 per run, seed, test image
    and statistic, and the `metric` they make."""

    values: Tensor
    metric: Metric = ACCURACY

    @classmethod
    def of_correct(cls, correct: Tensor) -> Score:
        """(S, M) or (R, S, M) bool correctness -> an accuracy Score (R = 1 for (S, M))."""
        values = correct.double()
        return cls((values if values.ndim == 3 else values[None])[..., None])

    @classmethod
    def runs(cls, scores: list[Score]) -> Score:
        """Scores of the pretraining runs of one method (each R = 1, same seeds and images) -> (R, ...)."""
        return cls(torch.cat([s.values for s in scores]), scores[0].metric)

    def value(self) -> float:
        """The metric of the mean statistics over runs, seeds and images."""
        return self.metric.of(self.values.mean((0, 1, 2))).item()


class Interval(NamedTuple):
    mean: float  # the result: the metric of the mean statistics over runs, seeds and images
    low: float  # LEVEL percentile interval of the bootstrap
    high: float
    seed_std: float  # population std across seeds of the per-seed result (0 for one seed)
    run_std: float  # population std across pretraining runs of the per-run result (0 for one run)

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2


class Difference(NamedTuple):
    mean: float  # checkpoint minus baseline
    low: float
    high: float
    verdict: Verdict  # win: interval above 0; loss: below 0; noise: it contains 0


def _weights(n: int, resamples: int, generator: torch.Generator) -> Tensor:
    """(resamples, n) float64: how often each of n items is drawn in each resample, divided by n."""
    draws = torch.randint(n, (resamples, n), generator=generator)
    counts = torch.zeros(resamples, n, dtype=torch.float64)
    return counts.scatter_add_(1, draws, torch.ones_like(counts)) / n


def _means(values: Tensor, runs: Tensor, seeds: Tensor, images: Tensor) -> Tensor:
    """values (R, S, M, F); weights (C, R), (C, S), (C, M) -> (C, F) weighted mean statistics."""
    return torch.einsum("rsmf,cr,cs,cm->cf", values, runs, seeds, images)


def _check(score: Score) -> None:
    shape = tuple(score.values.shape)
    if score.values.ndim != 4 or 0 in shape[:2] or shape[3] == 0:
        raise ValueError(f"a score's values must be (runs, seeds, images, stats), got {shape}")


def scored(value: float | Interval | Difference) -> bool:
    """Whether a result has a number: a metric with no test item to score (no test image, no labelled
    pixel) is NaN, written as null and shown as n/a."""
    return not math.isnan(value if isinstance(value, float) else value.mean)


def finite(record: object) -> object:
    """`record` (dicts, lists, tuples, numbers) with every NaN as None: JSON has no NaN, and a reader's
    `json.loads` of a bare `NaN` is Python's extension, not JSON."""
    if isinstance(record, float):
        return None if math.isnan(record) else record
    if isinstance(record, dict):
        return {key: finite(value) for key, value in record.items()}
    if isinstance(record, list | tuple):
        return [finite(value) for value in record]
    return record


def _bounds(samples: Tensor) -> tuple[float, float]:
    samples = samples[~samples.isnan()]  # a resample without a class's pixels has no IoU for it: nan
    if not len(samples):  # no resample has a value (a test split whose every pixel is ignored)
        return math.nan, math.nan
    tail = (1 - LEVEL) / 2
    low, high = torch.quantile(samples, torch.tensor([tail, 1 - tail], dtype=samples.dtype)).tolist()
    return low, high


def interval(score: Score, resamples: int = 1000, seed: int = 0) -> Interval:
    """The result of `score` with its LEVEL interval, from `resamples` crossed resamples drawn from `seed`
    (the same seed gives the same interval): `contrast`'s resamples of the one term `score`."""
    bounds = contrast([(1.0, score, "runs")], resamples, seed)
    if not score.values.shape[2]:  # nothing to score: no test image
        return Interval(math.nan, math.nan, math.nan, math.nan, math.nan)
    of, values = score.metric.of, score.values
    return Interval(
        score.value(),
        bounds.low,
        bounds.high,
        of(values.mean((0, 2))).std(correction=0).item(),
        of(values.mean((1, 2))).std(correction=0).item(),
    )


def paired_difference(score: Score, baseline: Score, resamples: int = 1000, seed: int = 0) -> Difference:
    """The result of `score` (R runs) minus that of `baseline` (R' runs), scored on the same S seeds and
    M images in the same order, with its LEVEL interval from a paired bootstrap (shared seed and image
    weights, independent run weights). A checkpoint against itself gives exactly 0, width 0."""
    return contrast([(1.0, score, "a"), (-1.0, baseline, "b")], resamples, seed)


def contrast(terms: list[tuple[float, Score, Hashable]], resamples: int = 1000, seed: int = 0) -> Difference:
    """sum of coefficient x result over `terms` (coefficient, Score, group), all scored on the same S
    seeds and M images in the same order, with its LEVEL paired-bootstrap interval: seed and image
    weights shared by every term, run weights shared by the terms of one group (the same pretraining
    runs in two columns) and independent between groups; each term's metric applied to its own
    resampled statistics. `paired_difference` is [(1, a, "a"), (-1, b, "b")]; a difference of
    differences (is a's edge over b larger in one column than in another?) is
    [(1, a1, "a"), (-1, b1, "b"), (-1, a2, "a"), (1, b2, "b")]."""
    for _, score, _ in terms:
        _check(score)
    shapes = {tuple(score.values.shape[1:3]) for _, score, _ in terms}
    if len(shapes) != 1:
        raise ValueError(
            f"paired results need the same seeds and test images: (seeds, images) differ, {sorted(shapes)}"
        )
    runs = {}
    for _, score, group in terms:
        if runs.setdefault(group, len(score.values)) != len(score.values):
            raise ValueError(f"group {group!r} has terms with different numbers of runs")
    ((seeds, images),) = shapes
    if not images:  # nothing to score: no test image
        return Difference(math.nan, math.nan, math.nan, "noise")
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for start in range(0, resamples, CHUNK):
        count = min(CHUNK, resamples - start)
        image_w, seed_w = _weights(images, count, generator), _weights(seeds, count, generator)
        run_w = {group: _weights(n, count, generator) for group, n in runs.items()}
        samples.append(
            sum(
                coef * score.metric.of(_means(score.values, run_w[group], seed_w, image_w))
                for coef, score, group in terms
            )
        )
    low, high = _bounds(torch.cat(samples))
    verdict: Verdict = "win" if low > 0 else "loss" if high < 0 else "noise"
    mean = sum(coef * score.value() for coef, score, _ in terms)
    return Difference(mean, low, high, verdict)
