"""How mixed a training stream's batches are: distinct classes per batch against what a uniform shuffle
of the epoch gives, and how often a sample's class repeats the one before it along the stream (the
lag-1 label autocorrelation, as a probability) against the same for a uniform shuffle. What
`ssl-vit bench feed --mix` and the stream's tests measure, and what `data inspect` judges shards by."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np


def uniform_distinct(counts: Sequence[int], batch: int) -> float:
    """Expected distinct classes in `batch` samples drawn without replacement from a set with
    `counts[c]` samples of class c (a batch of a uniform shuffle):
    sum over c of 1 - C(N - n_c, B) / C(N, B)."""
    n = np.asarray(counts, dtype=np.float64)
    total = n.sum()
    batch = int(min(batch, total))
    i = np.arange(batch, dtype=np.float64)
    # C(N - n, B) / C(N, B) = prod_i (N - n - i) / (N - i), 0 once a factor is
    missing = np.prod(np.clip((total - n[:, None] - i) / (total - i), 0, None), axis=1)
    return float(np.sum(1 - missing))


def uniform_repeat(counts: Sequence[int]) -> float:
    """The probability that two neighbours of a uniform shuffle share their class."""
    n = np.asarray(counts, dtype=np.float64)
    total = n.sum()
    return float(np.sum(n * (n - 1)) / (total * (total - 1))) if total > 1 else 0.0


def batch_mix(batches: Iterable[Sequence[int]], counts: Sequence[int] | None = None) -> dict:
    """The mix of `batches` (each a list of labels, in stream order; -1 ignored), against a uniform
    shuffle of a set with class counts `counts` (by default those of the labels seen): `distinct` the
    mean distinct classes per batch, `first` the first batch's, `uniform` the expectation, `ratio`
    distinct / uniform; `repeat` how often neighbours share a class, `uniform_repeat` its
    expectation."""
    batches = [[label for label in b if label >= 0] for b in batches]
    if counts is None:
        counts = list(Counter(label for b in batches for label in b).values())
    size = max((len(b) for b in batches), default=0)
    distinct = [len(set(b)) for b in batches]
    stream = [label for b in batches for label in b]
    pairs = list(zip(stream, stream[1:]))
    uniform = uniform_distinct(counts, size) if size else 0.0
    mean = float(np.mean(distinct)) if distinct else 0.0
    return {
        "batches": len(batches),
        "batch_size": size,
        "distinct": mean,
        "first": distinct[0] if distinct else 0,
        "min": min(distinct, default=0),
        "uniform": uniform,
        "ratio": mean / uniform if uniform else 0.0,
        "repeat": sum(a == b for a, b in pairs) / len(pairs) if pairs else 0.0,
        "uniform_repeat": uniform_repeat(counts),
    }


def format_mix(mix: dict) -> str:
    return (
        f"{mix['distinct']:.1f} distinct classes per batch of {mix['batch_size']} (first {mix['first']}, "
        f"min {mix['min']}) against {mix['uniform']:.1f} for a uniform shuffle ({mix['ratio']:.2f}x); "
        f"neighbours share their class {mix['repeat']:.3f} of the time against {mix['uniform_repeat']:.3f}"
    )
