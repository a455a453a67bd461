"""Choosing among a trained protocol's candidates on held-out images: the best by the protocol's metric,
and whether the choice ends its grid (the best value may lie beyond it).

Legend: C candidates, M images, F statistics per image.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ssl_vit.evaluation.stats import Metric


def choose(protocol, selection: Tensor, metric: Metric, axes: dict[str, list[float]]) -> tuple[int, dict]:
    """The candidate with the best `metric` of its `selection` statistics (C, M, F) (of equals, the first
    in the grid's order) and what results.json records: each candidate's value there, and for each grid
    axis (`axes`: name -> each candidate's value on it, e.g. {"lr": [...]}) whether the choice ends it
    (`grid_edge`)."""
    values = metric.of(selection.mean(1)).tolist()
    best = max(range(len(values)), key=lambda i: (values[i], -i))
    record: dict[str, Any] = {
        "selected_by": metric.name,
        "selection": dict(zip(protocol.candidates(), values)),
    }
    for axis, along in axes.items():
        record[f"best_{axis}"] = along[best]
        # the candidates that differ from the chosen one on this axis only
        others = {a: v for a, v in axes.items() if a != axis}
        line = [i for i in range(len(values)) if all(v[i] == v[best] for v in others.values())]
        edge = grid_edge([along[i] for i in line], [values[i] for i in line], line.index(best))
        if edge:
            record[f"{axis}_at_grid_edge"] = edge
    return best, record


def grid_edge(grid: list[float], scores: list[float], chosen: int) -> str | None:
    """The grid's end, "largest" or "smallest", when the chosen value `grid[chosen]` ends a grid of
    several and beats its neighbour in the grid on the held-out images (`scores`, one per value): the
    best value may lie beyond the grid (`grid_edge_notes`)."""
    order = sorted(range(len(grid)), key=lambda i: grid[i])
    if len(grid) < 2 or chosen not in (order[0], order[-1]):
        return None
    neighbour = order[1] if chosen == order[0] else order[-2]
    if scores[chosen] <= scores[neighbour]:
        return None
    return "largest" if chosen == order[-1] else "smallest"
