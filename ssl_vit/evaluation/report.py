"""`ssl-vit compare`: one suite on many checkpoints, one table and a few pictures.

A row is one checkpoint, or a group of pretraining runs of one method (`NAME=CKPT1,CKPT2,...`: its
values are means over the runs, its intervals cover the spread between runs too, see `stats`).

Writes results.csv and results.md (one row per checkpoint, one column per protocol result as
mean ± half-width of its 95% interval, the best per column marked only when it is beyond the others'
intervals, and the pretraining cost each checkpoint recorded), with a baseline also a table of paired
differences marked win / loss / noise, differences.png and verdicts.md (or, with claims, the verdict on
each claim: `verdicts`), fewshot.png (accuracy against labelled
examples per class, one line per checkpoint), bars.png (a bar chart per protocol), compute.png
(accuracy against pretraining FLOPs), with label fractions in a trained protocol label_efficiency.png
and .csv (accuracy against the labelled training images used, one line per checkpoint, one row per
checkpoint and fraction), attention_distance.png and .json (the ViT paper's mean attention
distance against depth, sec 4.5, one curve per checkpoint, on `ATTENTION_IMAGES` images of the first
dataset's test split), each checkpoint's own results.json (a group's runs under NAME/1, NAME/2, ...),
and an offline W&B run with the table and the pictures. A checkpoint that fails gets its error in its
row; the others' results are never lost. The files are written beside the output directory and moved
into place at the end (`ssl_vit.outdir`): it holds one comparison, complete.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import torch
from matplotlib.figure import Figure
from matplotlib.ticker import NullLocator

from ssl_vit.analysis.attention import attention_distance
from ssl_vit.analysis.images import read_images
from ssl_vit.analysis.pictures import attention_distance_curves
from ssl_vit.checkpoints import load_backbone
from ssl_vit.data import ShardDataModule
from ssl_vit.evaluation.protocols import DATA_KEYS, grid_edge_notes
from ssl_vit.evaluation.ranks import Failed, evaluate_checkpoints, failure
from ssl_vit.evaluation.stats import LEVEL, Difference, Interval, interval, paired_difference
from ssl_vit.evaluation.suite import Suite, TrainedProtocol, write_record
from ssl_vit.evaluation.verdicts import Claim, baseline_text, claims_text
from ssl_vit.outdir import check_out, staged

# A few images suffice: a head's mean attention distance varies little from image to image.
ATTENTION_IMAGES = 64


COST = ("steps", "images", "flops", "seconds")  # pretraining cost columns, as the checkpoint records them

# What `compare` writes at the top of its output directory beside one folder per row: no row is named so.
OUTPUTS = (
    "results.csv", "results.md", "fewshot.png", "bars.png", "compute.png", "label_efficiency.png",
    "label_efficiency.csv", "differences.png", "attention_distance.png", "attention_distance.json", "wandb",
    "wandb-run.json", "verdicts.md",
)  # fmt: skip


def compare(
    checkpoints: dict[str, list[str]],
    suite: Suite,
    out_dir: str | Path,
    baseline: str | None = None,
    overwrite: bool = False,
    claims: list[Claim] | None = None,
) -> list[dict] | None:
    """checkpoints: name -> sources (path, timm:NAME or scratch), several for replicate pretraining runs
    of one method. baseline: a name; adds the paired differences of every other row against it.
    claims: `verdicts.Claim`s (checked against the rows and columns) to give verdicts on in
    verdicts.md; without them a baseline's differences are the verdicts.
    out_dir is checked before anything runs (`outdir.check_out`: a non-empty one only with `overwrite`)
    and replaced whole once every file is written, so it never mixes two comparisons.
    Returns the rows written; under torchrun the runs are spread over the ranks (`ranks.py`) and only
    rank 0 writes and returns them (None on the others); every rank checks out_dir alike."""
    out = check_out(out_dir, overwrite)
    outcomes = evaluate_checkpoints(checkpoints, suite)
    if outcomes is None:
        return None
    with staged(out) as temp:
        rows, pictures, columns, differences = write_comparison(
            outcomes, checkpoints, suite, temp, baseline, claims
        )
    log_to_wandb(rows, columns, [out / p.name for p in pictures], out, differences)
    return rows


def write_comparison(
    outcomes: dict[str, list],
    checkpoints: dict[str, list[str]],
    suite: Suite,
    out: Path,
    baseline: str | None,
    claims: list[Claim] | None = None,
) -> tuple[list[dict], list[Path], list[str], dict | None]:
    """`compare`'s files in `out` from the runs' outcomes: (rows, pictures drawn, columns, differences)."""
    rows = []
    curves: dict[str, torch.Tensor] = {}  # name -> (L, H) mean attention distance in pixels
    images = None
    for name, sources in checkpoints.items():
        row = {"name": name, "checkpoint": ",".join(sources), "runs": len(sources), "error": ""}
        runs = outcomes[name]
        for i, run in enumerate(runs):
            if not isinstance(run, Failed):
                write_record(run.record, out / name / (str(i + 1) if len(sources) > 1 else ""))
        failed = next((run for run in runs if isinstance(run, Failed)), None)
        if failed is None:
            try:
                for i, source in enumerate(sources):
                    if images is None:
                        images = attention_images(suite)
                    # A group's heads side by side: (L, H x runs); heads do not correspond across runs.
                    curve = attention_curve(source, suite, images, i)
                    curves[name] = torch.cat([curves[name], curve], 1) if name in curves else curve
                row.update(aggregate(runs, suite))
            except Exception as err:
                failed = failure(err)
                curves.pop(name, None)
        if failed is not None:  # one broken checkpoint must not lose the others' results
            row["error"] = failed.error
            (out / name).mkdir(parents=True, exist_ok=True)
            (out / name / "error.txt").write_text(failed.traceback)
        rows.append(row)
    columns = suite.columns()
    differences = paired(rows, columns, baseline, suite) if baseline else None
    write_csv(rows, columns, out / "results.csv")
    records = [run.record for runs in outcomes.values() for run in runs if not isinstance(run, Failed)]
    notes = "".join(f"- {note}\n" for note in grid_edge_notes(records))
    table = markdown_table(rows, columns, suite, baseline, differences)
    (out / "results.md").write_text(table + (f"\nNotes:\n\n{notes}" if notes else ""))
    if claims:
        (out / "verdicts.md").write_text(claims_text(claims, rows, suite))
    elif differences:
        (out / "verdicts.md").write_text(baseline_text(differences, baseline, suite))
    pictures = [
        plot_fewshot(rows, suite, out / "fewshot.png"),
        plot_bars(rows, columns, out / "bars.png"),
        plot_compute(rows, suite, out / "compute.png"),
    ]
    if label_efficiency_protocols(suite):
        write_label_efficiency(rows, suite, out / "label_efficiency.csv")
        pictures.append(plot_label_efficiency(rows, suite, out / "label_efficiency.png"))
    if differences:
        pictures.append(plot_differences(differences, columns, baseline, out / "differences.png"))
    if curves:
        write_attention_distance(curves, len(images), out / "attention_distance.json")
        attention_distance_curves(curves, out / "attention_distance.png")
        pictures.append(out / "attention_distance.png")
    return rows, [p for p in pictures if p is not None], columns, differences


def attention_images(suite: Suite) -> torch.Tensor:
    """(n, 3, H, W): the first `ATTENTION_IMAGES` images of the first dataset's test split, normalised."""
    data = next(iter(suite.datasets.values()))
    datamodule = ShardDataModule(
        test_urls=data["test_urls"], **{k: v for k, v in data.items() if k in DATA_KEYS}
    )
    return read_images(datamodule, "test", ATTENTION_IMAGES)[0]


def attention_curve(source: str, suite: Suite, images: torch.Tensor, replicate: int = 0) -> torch.Tensor:
    """(L, H) mean attention distance (pixels) of every head of the checkpoint's backbone on `images`."""
    torch.manual_seed(suite.seed + replicate)  # `scratch` is the same random backbone `evaluate` drew
    backbone, _ = load_backbone(source, suite.backbone)
    backbone.eval()
    return attention_distance(backbone, images, batch_size=ATTENTION_IMAGES)


def write_attention_distance(curves: dict[str, torch.Tensor], images: int, path: Path) -> None:
    """The numbers of attention_distance.png: per checkpoint, per block, mean over heads and per head."""
    record = {
        "images": images,
        "unit": "pixels",
        "checkpoints": {
            name: {
                "mean_per_layer": [round(v, 4) for v in per_head.mean(1).tolist()],
                "per_head": [[round(v, 4) for v in heads] for heads in per_head.tolist()],
            }
            for name, per_head in curves.items()
        },
    }
    path.write_text(json.dumps(record, indent=1) + "\n")


def aggregate(runs: list, suite: Suite) -> dict:
    """One row's values from the `suite.Evaluation` of each of its pretraining runs: per column the
    mean over runs, seeds and images and its interval over all three (`stats.interval` on the runs'
    correctness stacked to (R, S, M)); the cost as the mean over runs (None unless every run has one)."""
    row: dict = {"details": runs[0].record["details"], "intervals": {}, "correct": {}}
    for column in runs[0].correct:
        correct = torch.stack([run.correct[column] for run in runs])  # (R, S, M)
        row["correct"][column] = correct
        row["intervals"][column] = interval(correct, suite.resamples, suite.seed)
        row[column] = row["intervals"][column].mean
    costs = [run.record["cost"] for run in runs]
    row["cost"] = None if None in costs else {key: sum(c[key] for c in costs) / len(costs) for key in COST}
    return row


def paired(rows: list[dict], columns: list[str], baseline: str, suite: Suite) -> dict[str, dict]:
    """name -> column -> `stats.Difference` of that row minus the baseline row (rows that did not fail)."""
    base = next(row for row in rows if row["name"] == baseline)
    if base["error"]:
        return {}
    return {
        row["name"]: {
            column: paired_difference(
                row["correct"][column], base["correct"][column], suite.resamples, suite.seed
            )
            for column in columns
        }
        for row in rows
        if row is not base and not row["error"]
    }


STAT_SUFFIXES = ("", "_low", "_high", "_seed_std", "_run_std")


def stat_columns(columns: list[str]) -> list[str]:
    """A results table's columns: per protocol column the accuracy, its interval (low, high), the std
    across few-shot seeds and across pretraining runs; then the pretraining cost."""
    stats = [f"{c}{suffix}" for c in columns for suffix in STAT_SUFFIXES]
    return ["name", "checkpoint", "runs", *stats, *COST, "error"]


def stat_values(row: dict) -> dict:
    """One row of the `stat_columns` table (missing keys: no result, or no recorded cost)."""
    values = {k: row[k] for k in ("name", "checkpoint", "runs", "error")}
    for column, found in row.get("intervals", {}).items():
        values.update({column: found.mean, f"{column}_low": found.low, f"{column}_high": found.high})
        values.update({f"{column}_seed_std": found.seed_std, f"{column}_run_std": found.run_std})
    values.update(row.get("cost") or {})
    return values


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
    found = {row["name"]: row["intervals"][column] for row in rows if column in row.get("intervals", {})}
    if not found:
        return set(), False
    best = max(found.values(), key=lambda i: i.mean).mean
    tied = {name for name, i in found.items() if i.mean == best or i.high >= best}
    return tied, len(tied) == 1


def _cell(value: Interval) -> str:
    return f"{100 * value.mean:.1f} ± {100 * value.half_width:.1f}"


def _difference_cell(value: Difference) -> str:
    """The mean difference, its interval's bounds and the verdict read from them. The bounds rather
    than a half-width: a percentile interval need not be centred on the mean, and `mean ± half-width`
    could then contain 0 while the interval does not (or the other way round)."""
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
        f"Accuracy in %: mean ± half-width of its {level} interval (bootstrap over test images, few-shot "
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
            cells = [_difference_cell(found[c]) for c in columns]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        if not differences:
            lines.append(f"| (none: {baseline} failed or is the only row) |" + " |" * len(columns))
        lines += ["", "win: interval above 0; loss: below 0; noise: it contains 0."]
    return "\n".join(lines) + "\n"


def _errors(intervals: list[Interval | Difference]) -> list[list[float]]:
    """matplotlib's asymmetric yerr/xerr (2, n), in %, from intervals."""
    return [[100 * (i.mean - i.low) for i in intervals], [100 * (i.high - i.mean) for i in intervals]]


def _panels(n: int, figsize: tuple[float, float]) -> tuple[Figure, list]:
    """A figure of `n` panels side by side. matplotlib's `Figure` without pyplot: no global figure
    registry to close, and no interactive backend to choose."""
    fig = Figure(figsize=figsize)
    return fig, list(fig.subplots(1, n, squeeze=False)[0])


def _saved(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def plot_fewshot(rows: list[dict], suite: Suite, path: Path) -> Path | None:
    """Accuracy against labelled examples per class with its interval, one line per checkpoint, one
    panel per few-shot protocol; trained protocols (linear probe, fine-tune) as points at the full
    training set."""
    fewshots = [p for p in suite.protocols if p.kind == "fewshot"]
    trained = [p for p in suite.protocols if p.kind in ("linear_probe", "finetune")]
    if not fewshots:
        return None
    fig, axes = _panels(len(fewshots), (5 * len(fewshots), 4))
    for ax, protocol in zip(axes, fewshots):
        for row in rows:
            if row["error"]:
                continue
            shots = [s for s in protocol.shots if isinstance(row.get(f"{protocol.name}_{s}shot"), float)]
            found = [row["intervals"][f"{protocol.name}_{s}shot"] for s in shots]
            line = ax.errorbar(
                shots,
                [100 * i.mean for i in found],
                yerr=_errors(found),
                marker="o",
                capsize=3,
                label=row["name"],
            ).lines[0]
            for marker, p in zip("s^", trained):
                if protocol.classes is None and isinstance(row.get(p.name), float):
                    ax.errorbar(
                        [row["details"][p.name]["labels_per_class"]],
                        [100 * row[p.name]],
                        yerr=_errors([row["intervals"][p.name]]),
                        fmt=marker,
                        capsize=3,
                        color=line.get_color(),
                        label=f"{row['name']} {p.name} (all labels)",
                    )
        ax.set_xscale("log")
        ax.set_xlabel("labelled examples per class")
        ax.set_ylabel("accuracy (%)")
        classes = "all classes" if protocol.classes is None else f"classes {protocol.classes}"
        ax.set_title(f"{protocol.name} ({classes})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _saved(fig, path)


def plot_bars(rows: list[dict], columns: list[str], path: Path) -> Path | None:
    """A bar chart per result column, one bar per checkpoint, its interval as an error bar."""
    good = [row for row in rows if not row["error"]]
    if not good or not columns:
        return None
    fig, axes = _panels(len(columns), (2.2 * len(columns) + 1, 3.2))
    for ax, column in zip(axes, columns):
        found = [row["intervals"][column] for row in good]
        ax.bar(
            range(len(good)),
            [100 * i.mean for i in found],
            yerr=_errors(found),
            capsize=3,
            color=[f"C{i}" for i in range(len(good))],
        )
        ax.set_xticks(range(len(good)), [row["name"] for row in good], rotation=45, ha="right", fontsize=8)
        ax.set_title(column, fontsize=9)
        ax.set_ylim(0, 100)
    axes[0].set_ylabel("accuracy (%)")
    return _saved(fig, path)


def headline(suite: Suite) -> list[str]:
    """One column per protocol: a few-shot protocol's largest shot count, a trained protocol's largest
    label fraction, the others' only column."""
    return [p.headline() for p in suite.protocols]


def plot_compute(rows: list[dict], suite: Suite, path: Path) -> Path | None:
    """Accuracy (with its interval) against training FLOPs of pretraining, one panel per protocol's
    headline column, one point per checkpoint: SSL and supervised compared at equal compute. Rows
    without pretraining (scratch) are a dashed line; rows whose checkpoint recorded no cost are named
    in the title."""
    good = [row for row in rows if not row["error"]]
    if not good:
        return None
    columns = headline(suite)
    fig, axes = _panels(len(columns), (4.5 * len(columns), 3.8))
    for ax, column in zip(axes, columns):
        for i, row in enumerate(good):
            found, cost = row["intervals"][column], row["cost"]
            if cost and cost["flops"] > 0:
                ax.errorbar(
                    [cost["flops"]], [100 * found.mean], yerr=_errors([found]), fmt="o", capsize=3,
                    color=f"C{i}", label=row["name"],
                )  # fmt: skip
            elif cost:
                ax.axhline(
                    100 * found.mean, linestyle="--", color=f"C{i}", label=f"{row['name']} (no pretraining)"
                )
        ax.set_xscale("log")
        ax.set_xlabel("pretraining compute (training FLOPs)")
        ax.set_ylabel("accuracy (%)")
        unknown = [row["name"] for row in good if row["cost"] is None]
        ax.set_title(column + (f"\n(cost not recorded: {', '.join(unknown)})" if unknown else ""), fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _saved(fig, path)


def label_efficiency_protocols(suite: Suite) -> list[TrainedProtocol]:
    """The trained protocols that train on part of the labels too: label_efficiency.png's panels."""
    return [p for p in suite.protocols if isinstance(p, TrainedProtocol) and min(p.label_fractions) < 1]


def label_efficiency_points(row: dict, protocol: TrainedProtocol) -> list[tuple[float, int, Interval]]:
    """(fraction, labels used, accuracy interval) of each label fraction of `protocol` in `row`, by
    labels used."""
    points = [
        (f, row["details"][protocol.column(f)]["labels"], row["intervals"][protocol.column(f)])
        for f in protocol.label_fractions
    ]
    return sorted(points, key=lambda point: point[1])


def write_label_efficiency(rows: list[dict], suite: Suite, path: Path) -> None:
    """One row per checkpoint, protocol and label fraction: the labels it trained on and its accuracy
    with its interval (the numbers of label_efficiency.png)."""
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["name", "protocol", "fraction", "labels", "accuracy", "low", "high"])
        for row in rows:
            if row["error"]:
                continue
            for protocol in label_efficiency_protocols(suite):
                for fraction, labels, found in label_efficiency_points(row, protocol):
                    writer.writerow(
                        [row["name"], protocol.name, fraction, labels, found.mean, found.low, found.high]
                    )


def plot_label_efficiency(rows: list[dict], suite: Suite, path: Path) -> Path | None:
    """Accuracy (with its interval) against the labelled training images used, one panel per trained
    protocol with label fractions, one line per checkpoint."""
    protocols = label_efficiency_protocols(suite)
    good = [row for row in rows if not row["error"]]
    if not protocols or not good:
        return None
    fig, axes = _panels(len(protocols), (5 * len(protocols), 4))
    for ax, protocol in zip(axes, protocols):
        for i, row in enumerate(good):
            _, labels, found = zip(*label_efficiency_points(row, protocol))
            ax.errorbar(
                labels, [100 * f.mean for f in found], yerr=_errors(found), marker="o", capsize=3,
                color=f"C{i}", label=row["name"],
            )  # fmt: skip
        ax.set_xscale("log")
        # Ticks at the counts used, written out: a log axis's own labels (2 x 10^1) overlap there.
        used = sorted({labels for row in good for _, labels, _ in label_efficiency_points(row, protocol)})
        ax.set_xticks(used, [str(n) for n in used])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel("labelled training images used")
        ax.set_ylabel("accuracy (%)")
        fractions = ", ".join(f"{100 * f:g}%" for f in sorted(protocol.label_fractions))
        ax.set_title(f"{protocol.name} ({protocol.kind}; {fractions} of the labels)", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _saved(fig, path)


def plot_differences(
    differences: dict[str, dict[str, Difference]], columns: list[str], baseline: str, path: Path
) -> Path:
    """Each checkpoint minus the baseline per column with its paired interval (a forest plot): green a
    win, red a loss, grey within noise."""
    colours = {"win": "tab:green", "loss": "tab:red", "noise": "tab:gray"}
    names = list(differences)
    fig, (ax,) = _panels(1, (6, 0.4 * len(columns) * max(1, len(names)) + 1.2))
    for n, name in enumerate(names):
        for c, column in enumerate(columns):
            found = differences[name][column]
            y = c * (len(names) + 1) + n
            ax.errorbar(
                [100 * found.mean], [y], xerr=_errors([found]), fmt="os^Dv"[n % 5], capsize=3,
                color=colours[found.verdict], label=name if c == 0 else None,
            )  # fmt: skip
    ax.axvline(0, color="black", linewidth=0.8)
    ticks = [c * (len(names) + 1) + (len(names) - 1) / 2 for c in range(len(columns))]
    ax.set_yticks(ticks, columns, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"accuracy minus {baseline} (percentage points)")
    ax.set_title("paired differences: green win, red loss, grey within noise", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="x")
    return _saved(fig, path)


def log_to_wandb(
    rows: list[dict],
    columns: list[str],
    pictures: list[Path],
    out: Path,
    differences: dict[str, dict[str, Difference]] | None = None,
) -> None:
    """The tables and pictures as one W&B run (offline unless the user opted in): `results` with the
    columns of results.csv (intervals and cost included) and, with a baseline, `paired_differences`: per row
    and column the paired difference, its interval and the verdict."""
    import wandb

    from ssl_vit.tracking import wandb_opted_in

    run = wandb.init(
        project="ssl-vit-compare",
        dir=str(out),
        mode=None if wandb_opted_in() else "offline",
        job_type="compare",
        config={"columns": columns},
    )
    names = stat_columns(columns)
    results = wandb.Table(columns=names)
    for row in rows:
        values = stat_values(row)
        results.add_data(*[values.get(name) for name in names])
    tables = {"results": results}
    if differences:
        diff_names = ["name", *[f"{c}{s}" for c in columns for s in ("", "_low", "_high", "_verdict")]]
        tables["paired_differences"] = wandb.Table(columns=diff_names)
        for name, by_column in differences.items():
            cells = [[d.mean, d.low, d.high, d.verdict] for d in (by_column[c] for c in columns)]
            tables["paired_differences"].add_data(name, *[cell for group in cells for cell in group])
    run.log({**tables, **{p.stem: wandb.Image(str(p)) for p in pictures}})
    run.finish()
    (out / "wandb-run.json").write_text(json.dumps({"id": run.id, "dir": str(run.dir)}) + "\n")
