"""`ssl-vit evaluate` and `ssl-vit compare`: argparse front-ends over `evaluation.suite.evaluate` and
`report.compare.compare`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ssl_vit.checkpoints import SOURCES
from ssl_vit.errors import UserError

OVERWRITE_HELP = "replace a non-empty --out directory (once the new results are complete)"


def add_parsers(subparsers) -> None:
    evaluate = subparsers.add_parser("evaluate", help="run an evaluation suite on one checkpoint")
    evaluate.add_argument("checkpoint", metavar="CKPT", help=SOURCES)
    evaluate.add_argument("--suite", required=True, help="suite YAML (see recipes/eval/)")
    evaluate.add_argument("--out", required=True, help="output directory; results.json goes there")
    evaluate.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    evaluate.set_defaults(func=_evaluate)

    compare = subparsers.add_parser("compare", help="the suite on every checkpoint: table, plots, W&B")
    compare.add_argument(
        "checkpoints",
        metavar="NAME=CKPT",
        nargs="+",
        help=f"CKPT: {SOURCES}; NAME=CKPT1,CKPT2,... groups pretraining runs of one method",
    )
    compare.add_argument("--suite", required=True, help="suite YAML (see recipes/eval/)")
    compare.add_argument("--out", required=True, help="output directory for results.csv/.md and plots")
    compare.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    compare.add_argument(
        "--scratch",
        type=int,
        nargs="?",
        const=1,
        default=0,
        metavar="N",
        help="add a row for the suite's backbone from scratch: N random initialisations (default 1)",
    )
    compare.add_argument(
        "--baseline", metavar="NAME", help="add paired differences of every checkpoint against NAME"
    )
    compare.add_argument(
        "--claims",
        metavar="FILE",
        help="YAML claims (rows that should beat other rows on some columns) to write verdicts.md on",
    )
    compare.set_defaults(func=_compare)


def _evaluate(args: argparse.Namespace) -> int:
    from ssl_vit import progress
    from ssl_vit.evaluation.stats import finite
    from ssl_vit.evaluation.suite import check_inputs, evaluate, load_suite
    from ssl_vit.report.tables import all_notes

    suite = load_suite(args.suite)
    check_inputs({args.checkpoint: [args.checkpoint]}, suite)
    with progress.job("evaluate", 1):
        progress.run(0, args.checkpoint)
        record = evaluate(args.checkpoint, suite, args.out, overwrite=args.overwrite).record
    print(json.dumps(finite(record["results"]), indent=2, allow_nan=False))
    for note in all_notes([record]):
        print(f"ssl-vit: note: {note}", file=sys.stderr)
    print(f"wrote {args.out}/results.json")
    return 0


def parse_checkpoints(items: list[str], scratch: int, baseline: str | None = None) -> dict[str, list[str]]:
    """NAME=CKPT or NAME=CKPT1,CKPT2,... (pretraining runs of one method) -> {name: [sources]}; `scratch`
    random initialisations make a `scratch` row; `baseline` must name a row. A name is a folder of
    --out: one path component, none of the files compare writes there (`report.OUTPUTS`)."""
    from ssl_vit.report.writer import OUTPUTS

    checkpoints = {}
    for item in items:
        name, sep, sources = item.partition("=")
        runs = sources.split(",")
        if not sep or not name or not all(runs):
            raise UserError(
                f"{item!r} is not NAME=CKPT or NAME=CKPT1,CKPT2,... (e.g. mpp=runs/mpp/checkpoints/last.ckpt)"
            )
        if name in (".", "..") or any(sep and sep in name for sep in (os.sep, os.altsep, "/")):
            raise UserError(
                f"checkpoint name {name!r} is not a plain name: each row is a folder of --out, give one "
                "without '/' such as mpp_1"
            )
        if name.lower() in OUTPUTS:
            raise UserError(f"checkpoint name {name!r} is a file compare writes in --out: give another name")
        if name in checkpoints:
            raise UserError(f"checkpoint name {name!r} is given twice; names label the table's rows")
        checkpoints[name] = runs
    if scratch < 0:
        raise UserError(f"--scratch {scratch}: give a positive number of initialisations")
    if scratch and "scratch" in checkpoints:
        raise UserError("checkpoint name 'scratch' is the row --scratch adds: rename it, or drop --scratch")
    if scratch:
        checkpoints["scratch"] = ["scratch"] * scratch
    if baseline is not None and baseline not in checkpoints:
        raise UserError(f"--baseline {baseline!r} names no checkpoint; valid: {', '.join(checkpoints)}")
    return checkpoints


def repeated_checkpoints(checkpoints: dict[str, list[str]]) -> list[str]:
    """One line per checkpoint given more than once (scratch aside: its runs are distinct draws): it is
    evaluated each time, and rows of it are not independent."""
    places: dict[str, list[str]] = {}
    for name, sources in checkpoints.items():
        for i, source in enumerate(sources):
            if source != "scratch":
                where = name if len(sources) == 1 else f"{name}/{i + 1}"
                places.setdefault(str(Path(source)), []).append(where)
    return [
        f"{source} is given {len(names)} times ({', '.join(names)}): it is evaluated each time, and its "
        "rows are one checkpoint, not independent runs"
        for source, names in places.items()
        if len(names) > 1
    ]


def _compare(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ssl_vit.evaluation.suite import load_suite
    from ssl_vit.report.compare import compare
    from ssl_vit.report.verdicts import load_claims
    from ssl_vit.report.writer import OUTPUTS
    from ssl_vit.storage.outdir import Input

    checkpoints = parse_checkpoints(args.checkpoints, args.scratch, args.baseline)
    for line in repeated_checkpoints(checkpoints):
        print(f"ssl-vit: warning: {line}", file=sys.stderr)
    suite = load_suite(args.suite)
    claims = load_claims(args.claims, suite, list(checkpoints)) if args.claims else None
    read = [Input(Path(args.claims), f"the claims file {args.claims}")] if args.claims else []
    rows = compare(checkpoints, suite, args.out, args.baseline, args.overwrite, claims, read)
    if rows is None:
        return 0
    console = Console()
    print(open(f"{args.out}/results.md").read())  # the markdown table as is: columns stay readable
    if (Path(args.out) / "verdicts.md").is_file():
        print(open(f"{args.out}/verdicts.md").read())
    # --out holds this comparison only: its files are what was written (no picture without its data).
    written = [name for name in OUTPUTS if (Path(args.out) / name).is_file()]
    print(f"wrote {args.out}/{', '.join(written)}")
    failed = [row["name"] for row in rows if row["error"]]
    if failed:
        console.print(f"[red]failed: {', '.join(failed)} (see {args.out}/NAME/error.txt)[/red]")
    return 1 if failed else 0
