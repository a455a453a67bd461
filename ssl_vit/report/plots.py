"""`compare`'s pictures, from the rows `writer.aggregate` makes: fewshot.png, bars.png, compute.png,
label_efficiency.png, differences.png (a grid of paired differences against the baseline) and
training_curves.png (each trained column's training loss, to see whether it levelled off). Each
result is drawn in its own unit (accuracy, mIoU, pixel accuracy: `Suite.unit`); a result with nothing
to score (`stats.scored`) is left out, or marked n/a where it has a place of its own."""

from __future__ import annotations

from pathlib import Path

from matplotlib import colormaps
from matplotlib.colors import TwoSlopeNorm
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.ticker import NullLocator

from ssl_vit.evaluation.stats import ACCURACY, Difference, Interval, scored
from ssl_vit.evaluation.suite import Suite
from ssl_vit.report.tables import NOT_SCORED, label_efficiency_points, label_efficiency_protocols


def _errors(intervals: list[Interval | Difference]) -> list[list[float]]:
    """matplotlib's asymmetric yerr/xerr (2, n), in %, from intervals (0 for one with no number)."""
    return [
        [100 * (i.mean - i.low) if scored(i) else 0.0 for i in intervals],
        [100 * (i.high - i.mean) if scored(i) else 0.0 for i in intervals],
    ]


def _has(row: dict, column: str) -> bool:
    """Whether `row` has a number in `column` (not a failed row, not nothing to score)."""
    return isinstance(row.get(column), float) and scored(row[column])


def _legend(ax) -> None:
    """The panel's legend, where it has something to name (every row's result may be left out)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def _panels(n: int, figsize: tuple[float, float]) -> tuple[Figure, list]:
    """A figure of `n` panels side by side: a `Figure` without pyplot, as `ssl_vit.analysis.pictures`."""
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
    fewshots = [p for p in suite.protocols if p.KIND == "fewshot"]  # this picture is of shots
    trained = [  # trained columns on all the labels, in the few-shot panels' unit
        p for p in suite.protocols
        if 1.0 in p.fractions() and p.metric(p.name) is ACCURACY
    ]  # fmt: skip
    if not fewshots:
        return None
    fig, axes = _panels(len(fewshots), (5 * len(fewshots), 4))
    for ax, protocol in zip(axes, fewshots):
        for row in rows:
            if row["error"]:
                continue
            shots = [s for s in protocol.shots if _has(row, f"{protocol.name}_{s}shot")]
            found = [row["intervals"][f"{protocol.name}_{s}shot"] for s in shots]
            line = ax.errorbar(
                shots,
                [100 * i.mean for i in found],
                yerr=_errors(found),
                marker="o",
                capsize=3,
                label=row["name"],
            ).lines[0]
            for marker, p in zip("s^Dv<>ph" * len(trained), trained):
                if protocol.classes is None and _has(row, p.name):
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
        _legend(ax)
    return _saved(fig, path)


def plot_bars(rows: list[dict], columns: list[str], suite: Suite, path: Path) -> Path | None:
    """A bar chart per result column, one bar per checkpoint, its interval as an error bar."""
    good = [row for row in rows if not row["error"]]
    if not good or not columns:
        return None
    fig, axes = _panels(len(columns), (2.2 * len(columns) + 1, 3.2))
    for ax, column in zip(axes, columns):
        found = [row["intervals"][column] for row in good]
        ax.bar(
            range(len(good)),
            [100 * i.mean if scored(i) else 0.0 for i in found],
            yerr=_errors(found),
            capsize=3,
            color=[f"C{i}" for i in range(len(good))],
        )
        for x, i in enumerate(found):
            if not scored(i):
                ax.text(x, 2, NOT_SCORED, ha="center", fontsize=7)
        ax.set_xticks(range(len(good)), [row["name"] for row in good], rotation=45, ha="right", fontsize=8)
        ax.set_title(column, fontsize=9)
        ax.set_ylim(0, 100)
        ax.set_ylabel(suite.unit(column), fontsize=8)
    return _saved(fig, path)


def plot_compute(rows: list[dict], suite: Suite, path: Path) -> Path | None:
    """Accuracy (with its interval) against training FLOPs of pretraining, one panel per protocol's
    headline column, one point per checkpoint: SSL and supervised compared at equal compute. Rows
    without pretraining (scratch) are a dashed line; rows whose checkpoint recorded no cost are named
    in the title."""
    good = [row for row in rows if not row["error"]]
    if not good:
        return None
    columns = [p.headline() for p in suite.protocols]
    fig, axes = _panels(len(columns), (4.5 * len(columns), 3.8))
    for ax, column in zip(axes, columns):
        for i, row in enumerate(good):
            found, cost = row["intervals"][column], row["cost"]
            if not scored(found):
                continue
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
        ax.set_ylabel(suite.unit(column))
        unknown = [row["name"] for row in good if row["cost"] is None]
        ax.set_title(column + (f"\n(cost not recorded: {', '.join(unknown)})" if unknown else ""), fontsize=9)
        ax.grid(alpha=0.3)
        _legend(ax)
    return _saved(fig, path)


def plot_label_efficiency(rows: list[dict], suite: Suite, path: Path) -> Path | None:
    """Each trained protocol's main result (with its interval) against the labelled training images
    used, one panel per trained protocol with label fractions, one line per checkpoint."""
    protocols = label_efficiency_protocols(suite)
    good = [row for row in rows if not row["error"]]
    if not protocols or not good:
        return None
    fig, axes = _panels(len(protocols), (5 * len(protocols), 4))
    for ax, protocol in zip(axes, protocols):
        for i, row in enumerate(good):
            points = [point for point in label_efficiency_points(row, protocol) if scored(point[2])]
            if not points:
                continue
            _, labels, found = zip(*points)
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
        ax.set_ylabel(suite.unit(protocol.headline()))
        fractions = ", ".join(f"{100 * f:g}%" for f in sorted(protocol.label_fractions))
        ax.set_title(f"{protocol.name} ({protocol.kind}; {fractions} of the labels)", fontsize=9)
        ax.grid(alpha=0.3)
        _legend(ax)
    return _saved(fig, path)


def plot_differences(
    differences: dict[str, dict[str, Difference]], columns: list[str], baseline: str, path: Path
) -> Path:
    """Every row minus the baseline on every column at a glance: a grid, one line per result column, one
    column per checkpoint, each cell coloured by the paired difference (green above the baseline, red
    below; pale within noise) and written out with its verdict; n/a where either row has no number."""
    names = list(differences)
    fig = Figure(figsize=(max(5.5, 1.3 * len(names) + 3.2), 0.32 * len(columns) + 1.6))
    ax = fig.subplots()
    points = [100 * d.mean for name in names for d in differences[name].values()]
    limit = max([abs(v) for v in points] + [1.0])
    norm, cmap = TwoSlopeNorm(0.0, -limit, limit), colormaps["RdYlGn"]
    for r, column in enumerate(columns):
        for c, name in enumerate(names):
            found = differences[name].get(column)
            if found is None:
                ax.text(c, r, NOT_SCORED, ha="center", va="center", fontsize=7, color="grey")
                continue
            beyond = found.verdict != "noise"
            colour = cmap(norm(100 * found.mean))
            ax.add_patch(Rectangle((c - 0.5, r - 0.5), 1, 1, color=colour, alpha=1.0 if beyond else 0.25))
            ax.text(
                c, r, f"{100 * found.mean:+.1f} {found.verdict}", ha="center", va="center", fontsize=7,
                fontweight="bold" if beyond else "normal",
            )  # fmt: skip
    ax.set_xlim(-0.5, len(names) - 0.5)
    ax.set_ylim(len(columns) - 0.5, -0.5)
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.xaxis.tick_top()
    ax.set_yticks(range(len(columns)), columns, fontsize=7)
    ax.set_title(
        f"minus {baseline}, percentage points\nbold: beyond noise (paired 95% interval); pale: within noise",
        fontsize=8,
    )
    return _saved(fig, path)


def plot_training_curves(rows: list[dict], suite: Suite, path: Path) -> Path | None:
    """Each trained column's training loss against its optimizer steps, one panel per column, one line
    per pretraining run (a row's runs in its colour): where the curves flatten, the training was long
    enough."""
    good = [row for row in rows if not row["error"]]
    columns = [
        column for p in suite.protocols for column in dict.fromkeys(p.column(f) for f in p.fractions())
    ]  # fmt: skip
    if not good or not columns:
        return None
    fig, axes = _panels(len(columns), (4.2 * len(columns), 3.4))
    for ax, column in zip(axes, columns):
        for i, row in enumerate(good):
            for run, details in enumerate(row["run_details"]):
                curve = details.get(column, {}).get("loss_curve") or []
                if curve:
                    steps, losses = zip(*curve)
                    ax.plot(
                        steps, losses, color=f"C{i}", linewidth=1, label=row["name"] if run == 0 else None
                    )
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("training loss")
        ax.set_yscale("log")
        ax.set_title(column, fontsize=9)
        ax.grid(alpha=0.3)
        _legend(ax)
    return _saved(fig, path)
