"""What `ssl-vit compare` writes from the evaluations its ranks made: one table and a few pictures.

A row is one checkpoint, or a group of pretraining runs of one method (`NAME=CKPT1,CKPT2,...`: its
values are means over the runs, its intervals cover the spread between runs too, see `stats`).

Writes results.csv and results.md (one row per checkpoint, one column per protocol result as
mean ± half-width of its 95% interval, the best per column marked only when it is beyond the others'
intervals, and the pretraining cost each checkpoint recorded), with a baseline also a table of paired
differences marked win / loss / noise, differences.png and verdicts.md (or, with claims, the verdict on
each claim: `verdicts`), fewshot.png (accuracy against labelled examples per class, one line per
checkpoint), bars.png (a bar chart per protocol), compute.png (each result against pretraining FLOPs),
with label fractions in a trained protocol label_efficiency.png and .csv (each result against the
labelled training images used, one line per checkpoint, one row per checkpoint and fraction), with
trained protocols training_curves.png (their training losses), attention_distance.png and .json (the
ViT paper's mean attention distance against depth, sec 4.5, one curve per checkpoint), each
checkpoint's own results.json (a group's runs under NAME/1, NAME/2, ...), and an offline W&B run with
the table and the pictures: the numbers first, then the rest (`write_report`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import torch

from ssl_vit.analysis.pictures import attention_distance_curves
from ssl_vit.evaluation.ranks import Failed
from ssl_vit.evaluation.stats import Difference, Score, finite, interval, paired_difference, scored
from ssl_vit.evaluation.suite import Evaluation, Suite, write_record
from ssl_vit.report.plots import (
    plot_bars,
    plot_compute,
    plot_differences,
    plot_fewshot,
    plot_label_efficiency,
    plot_training_curves,
)
from ssl_vit.report.tables import (
    COST,
    all_notes,
    label_efficiency_protocols,
    markdown_table,
    stat_columns,
    stat_values,
    write_csv,
    write_label_efficiency,
)
from ssl_vit.report.verdicts import Claim, baseline_text, claims_text
from ssl_vit.storage.outdir import Output

# What `compare` writes at the top of its output directory beside one folder per row: no row is named so.
OUTPUTS = (
    "results.csv", "results.md", "fewshot.png", "bars.png", "compute.png", "label_efficiency.png",
    "label_efficiency.csv", "differences.png", "training_curves.png", "attention_distance.png",
    "attention_distance.json", "wandb", "wandb-run.json", "verdicts.md",
)  # fmt: skip


class Report(NamedTuple):
    """What `compare` computed, as `write_results` wrote it: the pictures are drawn from it."""

    rows: list[dict]
    columns: list[str]
    differences: dict | None
    curves: dict[str, torch.Tensor]  # name -> (L, H x runs) mean attention distance in pixels
    notes: list[str]  # the runs' notes (`tables.all_notes`)


def write_report(
    outcomes: dict[str, list[Evaluation | Failed]],
    checkpoints: dict[str, list[str]],
    suite: Suite,
    output: Output,
    baseline: str | None = None,
    claims: list[Claim] | None = None,
) -> Report:
    """`compare`'s output directory from the runs' outcomes (`ranks.evaluate_checkpoints`): the numbers
    first, staged and moved into place whole; then the pictures and the W&B run, each of which may fail
    as a warning and a note in results.md (`Output.optional`)."""
    with output.staged() as temp:
        report = write_results(outcomes, checkpoints, suite, temp, baseline, claims)
    pictures = draw_pictures(report, suite, baseline, output)
    output.optional(
        "the W&B run",
        lambda: log_to_wandb(report.rows, report.columns, pictures, output.path, report.differences),
    )
    if output.notes:  # what failed above, said where the numbers are
        output.rewrite("results.md", results_markdown(report, suite, baseline, output.notes))
    return report


def write_results(
    outcomes: dict[str, list[Evaluation | Failed]],
    checkpoints: dict[str, list[str]],
    suite: Suite,
    out: Path,
    baseline: str | None,
    claims: list[Claim] | None = None,
) -> Report:
    """`compare`'s numbers in `out` from the runs' outcomes: each run's results.json, results.csv,
    results.md, verdicts.md, label_efficiency.csv and attention_distance.json."""
    rows = [write_row(name, sources, outcomes[name], suite, out) for name, sources in checkpoints.items()]
    columns = suite.columns()
    differences = paired(rows, columns, baseline, suite) if baseline else None
    write_csv(rows, columns, out / "results.csv")
    records = [run.record for runs in outcomes.values() for run in runs if not isinstance(run, Failed)]
    curves = {row["name"]: attention_curve(outcomes[row["name"]]) for row in rows if not row["error"]}
    report = Report(rows, columns, differences, curves, all_notes(records))
    (out / "results.md").write_text(results_markdown(report, suite, baseline))
    if claims:
        (out / "verdicts.md").write_text(claims_text(claims, rows, suite))
    elif differences:
        (out / "verdicts.md").write_text(baseline_text(differences, baseline, suite))
    if label_efficiency_protocols(suite):
        write_label_efficiency(rows, suite, out / "label_efficiency.csv")
    if curves:
        images = records[0]["attention_distance"]["images"]  # the same images for every run
        write_attention_distance(curves, images, out / "attention_distance.json")
    return report


def write_row(
    name: str, sources: list[str], runs: list[Evaluation | Failed], suite: Suite, out: Path
) -> dict:
    """One row of the table from its runs (`aggregate`), each run's results.json in out/NAME (a group's in
    out/NAME/1, ...); a row with a failed run is that failure, its traceback in out/NAME/error.txt (one
    broken checkpoint must not lose the others' results)."""
    row = {"name": name, "checkpoint": ",".join(sources), "runs": len(sources), "error": ""}
    for i, run in enumerate(runs):
        if not isinstance(run, Failed):
            write_record(run.record, out / name / (str(i + 1) if len(runs) > 1 else ""))
    failed = next((run for run in runs if isinstance(run, Failed)), None)
    if failed is None:
        return {**row, **aggregate(runs, suite)}
    (out / name).mkdir(parents=True, exist_ok=True)
    (out / name / "error.txt").write_text(failed.traceback)
    return {**row, "error": failed.error}


def attention_curve(runs: list[Evaluation]) -> torch.Tensor:
    """(L, H x runs): the mean attention distances (pixels) of a row's runs, as their records hold them,
    a group's heads side by side (heads do not correspond across runs)."""
    return torch.cat([torch.tensor(run.record["attention_distance"]["per_head"]) for run in runs], 1)


def results_markdown(report: Report, suite: Suite, baseline: str | None, more: Iterable[str] = ()) -> str:
    """results.md: the table, then the notes of the runs and `more` (what failed after it was written)."""
    table = markdown_table(report.rows, report.columns, suite, baseline, report.differences)
    notes = "".join(f"- {note}\n" for note in [*report.notes, *more])
    return table + (f"\nNotes:\n\n{notes}" if notes else "")


def draw_pictures(report: Report, suite: Suite, baseline: str | None, output: Output) -> list[Path]:
    """`compare`'s pictures from the numbers written, into the committed output; each one that fails is
    a warning and a note (`Output.picture`). The pictures drawn."""
    rows, columns = report.rows, report.columns
    drawings = {
        "fewshot.png": lambda path: plot_fewshot(rows, suite, path),
        "bars.png": lambda path: plot_bars(rows, columns, suite, path),
        "compute.png": lambda path: plot_compute(rows, suite, path),
        "training_curves.png": lambda path: plot_training_curves(rows, suite, path),
    }
    if label_efficiency_protocols(suite):
        drawings["label_efficiency.png"] = lambda path: plot_label_efficiency(rows, suite, path)
    if report.differences:
        drawings["differences.png"] = lambda path: plot_differences(
            report.differences, columns, baseline, path
        )
    if report.curves:
        drawings["attention_distance.png"] = lambda path: attention_distance_curves(report.curves, path)
    drawn = [output.picture(name, draw) for name, draw in drawings.items()]
    return [path for path in drawn if path is not None]


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
    path.write_text(json.dumps(finite(record), indent=1, allow_nan=False) + "\n")


def aggregate(runs: list, suite: Suite) -> dict:
    """One row's values from the `suite.Evaluation` of each of its pretraining runs: per column the
    result over runs, seeds and images and its interval over all three (`stats.interval` on the runs'
    statistics stacked to (R, S, M, F)); the cost as the mean over runs (None unless every run has one)."""
    row: dict = {
        "details": runs[0].record["details"],
        "run_details": [run.record["details"] for run in runs],
        "intervals": {},
        "scores": {},
    }
    for column in runs[0].scores:
        score = Score.runs([run.scores[column] for run in runs])
        row["scores"][column] = score
        row["intervals"][column] = interval(score, suite.resamples, suite.seed)
        row[column] = row["intervals"][column].mean
    costs = [run.record["cost"] for run in runs]
    row["cost"] = None if None in costs else {key: sum(c[key] for c in costs) / len(costs) for key in COST}
    return row


def paired(rows: list[dict], columns: list[str], baseline: str, suite: Suite) -> dict[str, dict]:
    """name -> column -> `stats.Difference` of that row minus the baseline row (rows that did not fail;
    a column either row has no number in is left out: nothing to score, `stats.scored`)."""
    base = next(row for row in rows if row["name"] == baseline)
    if base["error"]:
        return {}
    return {
        row["name"]: {
            column: paired_difference(
                row["scores"][column], base["scores"][column], suite.resamples, suite.seed
            )
            for column in columns
            if scored(row["scores"][column].value()) and scored(base["scores"][column].value())
        }
        for row in rows
        if row is not base and not row["error"]
    }


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
    try:  # finished whatever fails: the run is not left open for the rest of the process
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
                cells = [
                    [d.mean, d.low, d.high, d.verdict] if d else [None] * 4
                    for d in (by_column.get(c) for c in columns)
                ]
                tables["paired_differences"].add_data(name, *[cell for group in cells for cell in group])
        run.log({**tables, **{p.stem: wandb.Image(str(p)) for p in pictures}})
    finally:
        run.finish()
    (out / "wandb-run.json").write_text(json.dumps({"id": run.id, "dir": str(run.dir)}) + "\n")
