"""`ssl-vit compare` as a function: the ranks evaluate (`evaluation.ranks`), then the report is written
from their records (`writer`); here, above evaluation, so that evaluation knows nothing of the report."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from ssl_vit.evaluation.ranks import evaluate_checkpoints
from ssl_vit.evaluation.suite import Suite, check_inputs, evaluation_inputs
from ssl_vit.report.verdicts import Claim
from ssl_vit.report.writer import write_report
from ssl_vit.storage.outdir import Input, Output


def compare(
    checkpoints: dict[str, list[str]],
    suite: Suite,
    out_dir: str | Path,
    baseline: str | None = None,
    overwrite: bool = False,
    claims: list[Claim] | None = None,
    inputs: Iterable[Input] = (),
) -> list[dict] | None:
    """The suite on every checkpoint, then the report: checkpoints: name -> sources (path, timm:NAME or
    scratch), several for replicate pretraining runs of one method. baseline: a name; adds the paired
    differences of every other row against it. claims: `verdicts.Claim`s (checked against the rows and
    columns) to give verdicts on in verdicts.md; without them a baseline's differences are the verdicts.
    inputs: files read besides the checkpoints and the suite (the claims file), which out_dir must keep out
    of. out_dir is checked and locked before anything is evaluated, as `evaluate`'s is (`outdir.Output`),
    and written by `writer.write_report`. Returns the rows written; under torchrun the runs are spread over
    the ranks (`evaluation.ranks`) and only rank 0 writes and returns them (None on the others)."""
    check_inputs(checkpoints, suite)
    inputs = [*evaluation_inputs(checkpoints, suite), *inputs]
    with Output(out_dir, "compare", inputs, overwrite) as output:
        outcomes = evaluate_checkpoints(checkpoints, suite)
        if outcomes is None:  # a rank other than 0 under torchrun: rank 0 reports
            return None
        return write_report(outcomes, checkpoints, suite, output, baseline, claims).rows
