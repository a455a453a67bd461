"""`compare`'s tables: results.csv, results.md (with paired differences against a baseline) and
label_efficiency.csv, from the rows `writer.aggregate` makes."""

from __future__ import annotations

import csv
from pathlib import Path

from ssl_vit.evaluation.protocol import Protocol
from ssl_vit.evaluation.stats import LEVEL, Difference, Interval, finite, scored
from ssl_vit.evaluation.suite import Suite
from ssl_vit.evaluation.trained import STILL_FALLING

COST = ("steps", "images", "flops", "seconds")  # pretraining cost columns, as the checkpoint records them


STAT_SUFFIXES = ("", "_low", "_high", "_seed_std", "_run_std")


def stat_columns(columns: list[str]) -> list[str]:
    """A results table's columns: per protocol column its result, its interval (low, high), the std
    across few-shot seeds and across pretraining runs; then the pretraining cost."""
    stats = [f"{c}{suffix}" for c in columns for suffix in STAT_SUFFIXES]
    return ["name", "checkpoint", "runs", *stats, *COST, "error"]


def stat_values(row: dict) -> dict:
    """One row of the `stat_columns` table (missing keys: no result, or no recorded cost; None: nothing to
    score, an empty cell)."""
    values = {k: row[k] for k in ("name", "checkpoint", "runs", "error")}
    for column, found in row.get("intervals", {}).items():
        values.update({column: found.mean, f"{column}_low": found.low, f"{column}_high": found.high})
        values.update({f"{column}_seed_std": found.seed_std, f"{column}_run_std": found.run_std})
    values.update(row.get("cost") or {})
    return finite(values)


def write_csv(rows: list[dict], columns: list[str], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, stat_columns(columns), extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow(stat_values(row))


def leaders(rows: list[dict], column: str) -> tuple[set[str], bool]:
    """The names marked in `column` and whether the best is clear: the best mean alone when it lies
    above every other row's interval (clear), else the best and every row whose interval reaches the
    best mean (tied)."""
    found = {
        row["name"]: row["intervals"][column]
        for row in rows
        if column in row.get("intervals", {}) and scored(row["intervals"][column])
    }
    if not found:
        return set(), False
    best = max(found.values(), key=lambda i: i.mean).mean
    tied = {name for name, i in found.items() if i.mean == best or i.high >= best}
    return tied, len(tied) == 1


# A cell with no number: its metric had no test item to score (a note says why).
NOT_SCORED = "n/a"


def _cell(value: Interval) -> str:
    return f"{100 * value.mean:.1f} ± {100 * value.half_width:.1f}" if scored(value) else NOT_SCORED


def _difference_cell(value: Difference | None) -> str:
    """The mean difference, its interval's bounds and the verdict read from them. The bounds rather
    than a half-width: a percentile interval need not be centred on the mean, and `mean ± half-width`
    could then contain 0 while the interval does not (or the other way round). None: a column either row
    has no number in."""
    if value is None:
        return NOT_SCORED
    return f"{100 * value.mean:+.1f} [{100 * value.low:+.1f}, {100 * value.high:+.1f}] {value.verdict}"


def _amount(value: float, unit: str = "") -> str:
    """1234567 -> '1.23M' (SI prefixes, for images and FLOPs)."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g}{prefix}{unit}"
    return f"{value:.3g}{unit}"


def cost_cells(cost: dict | None) -> list[str]:
    if cost is None:
        return ["n/a"] * len(COST)
    minutes = cost["seconds"] / 60
    time_text = (
        f"{cost['seconds']:.0f} s"
        if minutes < 2
        else f"{minutes:.1f} min"
        if minutes < 120
        else f"{minutes / 60:.1f} h"
    )
    return [f"{cost['steps']:.0f}", _amount(cost["images"]), _amount(cost["flops"]), time_text]


def metric_names(suite: Suite, columns: list[str]) -> str:
    """What the numbers of `columns` are, in words: `Accuracy`, or e.g. `Accuracy (mIoU: seg_miou)`
    when some columns hold another metric."""
    other: dict[str, list[str]] = {}
    for column in columns:
        name = suite.protocol_of(column).metric(column).name
        if name != "accuracy":
            other.setdefault(name, []).append(column)
    found = "; ".join(f"{name}: {', '.join(names)}" for name, names in other.items())
    return "Accuracy" + (f" ({found})" if found else "")


def markdown_table(
    rows: list[dict],
    columns: list[str],
    suite: Suite,
    baseline: str | None = None,
    differences: dict[str, dict[str, Difference]] | None = None,
) -> str:
    """One row per checkpoint, one column per result (mean ± half-width), then the pretraining cost;
    with a baseline, a second table of paired differences against it."""
    header = ["checkpoint", *columns, "steps", "images", "FLOPs", "time"]
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    marks = {column: leaders(rows, column) for column in columns}
    for row in rows:
        if row["error"]:
            cells = [f"failed: {row['error']}"] + [""] * (len(header) - 2)
        else:
            cells = []
            for column in columns:
                text = _cell(row["intervals"][column])
                names, clear = marks[column]
                cells.append(
                    text if row["name"] not in names else f"**{text}**" if clear else f"_{text}_ (tie)"
                )
            cells += cost_cells(row["cost"])
        runs = f" ({row['runs']} runs)" if row["runs"] > 1 else ""
        lines.append(f"| {row['name']}{runs} | " + " | ".join(cells) + " |")
    level = f"{LEVEL:.0%}"
    lines += [
        "",
        f"{metric_names(suite, columns)} in %: mean ± half-width of its {level} interval (bootstrap over "
        "test images, few-shot "
        f"seeds and pretraining runs; {suite.resamples} resamples). Bold: best, above every other "
        f"interval; (tie): the best mean lies inside these intervals. Pretraining cost as recorded by "
        f"the checkpoint (training FLOPs; n/a: not recorded).",
    ]
    if differences is not None:
        lines += [
            "",
            f"Paired differences against {baseline} (percentage points: mean [{level} paired bootstrap "
            "interval]):",
            "",
        ]
        lines += [
            f"| checkpoint - {baseline} | " + " | ".join(columns) + " |",
            "|---|" + "---:|" * len(columns),
        ]
        for name, found in differences.items():
            cells = [_difference_cell(found.get(c)) for c in columns]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        if not differences:
            lines.append(f"| (none: {baseline} failed or is the only row) |" + " |" * len(columns))
        lines += ["", "win: interval above 0; loss: below 0; noise: it contains 0."]
    return "\n".join(lines) + "\n"


def label_efficiency_protocols(suite: Suite) -> list[Protocol]:
    """The trained protocols that train on part of the labels too: label_efficiency.png's panels."""
    return [p for p in suite.protocols if p.fractions() and min(p.fractions()) < 1]


def label_efficiency_points(row: dict, protocol: Protocol) -> list[tuple[float, int, Interval]]:
    """(fraction, labels used, interval of its main result) of each label fraction of `protocol` in `row`,
    by labels used."""
    points = [
        (f, row["details"][protocol.column(f)]["labels"], row["intervals"][protocol.result_column(f)])
        for f in protocol.label_fractions
    ]
    return sorted(points, key=lambda point: point[1])


def write_label_efficiency(rows: list[dict], suite: Suite, path: Path) -> None:
    """One row per checkpoint, protocol and label fraction: the labels it trained on and its result
    with its interval (the numbers of label_efficiency.png)."""
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["name", "protocol", "fraction", "labels", "metric", "value", "low", "high"])
        for row in rows:
            if row["error"]:
                continue
            for protocol in label_efficiency_protocols(suite):
                for fraction, labels, found in label_efficiency_points(row, protocol):
                    metric = protocol.metric(protocol.result_column(fraction)).name
                    writer.writerow(
                        [
                            row["name"],
                            protocol.name,
                            fraction,
                            labels,
                            metric,
                            *finite([found.mean, found.low, found.high]),
                        ]
                    )


def _details_with(records: list[dict], key: str) -> tuple[list[tuple[str, dict]], dict[str, int]]:
    """Every column's details that hold `key`, in `records`, and in how many runs each column holds it."""
    found: list[tuple[str, dict]] = []
    runs: dict[str, int] = {}
    for record in records:
        for column, details in record.get("details", {}).items():
            if isinstance(details, dict) and key in details:
                runs[column] = runs.get(column, 0) + 1
                found.append((column, details))
    return found, runs


def grid_edge_notes(records: list[dict]) -> list[str]:
    """One line per trained column and grid axis whose choice ended its grid in any of `records`: how
    often, and what to do."""
    edges: dict[tuple[str, str, str], list[float]] = {}
    chosen, runs = _details_with(records, "selection")
    for column, found in chosen:
        for key, edge in found.items():
            if key.endswith("_at_grid_edge") and edge:
                axis = key.removesuffix("_at_grid_edge")
                edges.setdefault((column, axis, edge), []).append(found[f"best_{axis}"])
    direction = {"largest": "above", "smallest": "below"}
    return [
        f"{column}: the {axis} chosen on the held-out images is the grid's {edge} ({values[0]:g}) in "
        f"{len(values)} of {runs[column]} run(s); a better one may lie {direction[edge]} it: extend the "
        f"protocol's {axis}s"
        for (column, axis, edge), values in edges.items()
    ]


def falling_loss_notes(records: list[dict]) -> list[str]:
    """One line per trained column whose training loss had not levelled off (`loss_change_last_fifth`
    at or below -STILL_FALLING) in any of `records`: how often, by how much, and what to do."""
    falling: dict[str, list[float]] = {}
    judged, runs = _details_with(records, "loss_change_last_fifth")
    for column, found in judged:
        if found["loss_change_last_fifth"] <= -STILL_FALLING:
            falling.setdefault(column, []).append(found["loss_change_last_fifth"])

    def span(changes: list[float]) -> str:  # "12%-30%", or "30%" when they round alike
        return "-".join(dict.fromkeys(f"{-change:.0%}" for change in (max(changes), min(changes))))

    return [
        f"{column}: the training loss still fell by {span(changes)} over the last fifth of its steps in "
        f"{len(changes)} of {runs[column]} run(s): it had not levelled off; give it more steps (or epochs)"
        for column, changes in falling.items()
    ]


def all_notes(records: list[dict]) -> list[str]:
    """Every note on `records` (results.json records of one suite) that asks the suite's author to act."""
    notes = grid_edge_notes(records) + falling_loss_notes(records) + unlabelled_notes(records)
    return notes + unscored_notes(records)


def unscored_notes(records: list[dict]) -> list[str]:
    """One line per column with nothing to score (`stats.scored`) in any of `records`: in how many runs,
    and why."""
    found: dict[str, list[str]] = {}
    for record in records:
        for column, why in record.get("unscored", {}).items():
            found.setdefault(column, []).append(why)
    return [
        f"{column}: {why[0]} in {len(why)} of {len(records)} run(s): no number (null in results.json, "
        f"{NOT_SCORED} in the tables), left out of differences, verdicts and pictures"
        for column, why in found.items()
    ]


def unlabelled_notes(records: list[dict]) -> list[str]:
    """One line per dataset and split whose images without a label (-1) the classification protocols left
    out, in any of `records`."""
    found: dict[tuple[str, str], set[int]] = {}
    for record in records:
        for dataset, counts in record.get("unlabelled", {}).items():
            for split, count in counts.items():
                found.setdefault((dataset, split), set()).add(count)
    return [
        f"{dataset}: {'/'.join(map(str, sorted(counts)))} {split} image(s) without a label were left out of "
        "every classification protocol (give them labels, or drop them from the shards)"
        for (dataset, split), counts in found.items()
    ]
