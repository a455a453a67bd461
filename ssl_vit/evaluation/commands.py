"""`ssl-vit evaluate` and `ssl-vit compare`: argparse front-ends over suite.evaluate and report.compare."""

from __future__ import annotations

import argparse
import json

from ssl_vit.checkpoints import SOURCES
from ssl_vit.errors import UserError

CHECKPOINT_HELP = SOURCES


def add_parsers(subparsers) -> None:
    evaluate = subparsers.add_parser("evaluate", help="run an evaluation suite on one checkpoint")
    evaluate.add_argument("checkpoint", metavar="CKPT", help=CHECKPOINT_HELP)
    evaluate.add_argument("--suite", required=True, help="suite YAML (see recipes/eval/)")
    evaluate.add_argument("--out", required=True, help="output directory; results.json goes there")
    evaluate.set_defaults(func=_evaluate)

    compare = subparsers.add_parser("compare", help="the suite on every checkpoint: table, plots, W&B")
    compare.add_argument(
        "checkpoints",
        metavar="NAME=CKPT",
        nargs="+",
        help=f"CKPT: {CHECKPOINT_HELP}; NAME=CKPT1,CKPT2,... groups pretraining runs of one method",
    )
    compare.add_argument("--suite", required=True, help="suite YAML (see recipes/eval/)")
    compare.add_argument("--out", required=True, help="output directory for results.csv/.md and plots")
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
    compare.set_defaults(func=_compare)


def _evaluate(args: argparse.Namespace) -> int:
    from ssl_vit.evaluation.suite import evaluate, load_suite

    record = evaluate(args.checkpoint, load_suite(args.suite), args.out).record
    print(json.dumps(record["results"], indent=2))
    print(f"wrote {args.out}/results.json")
    return 0


def parse_checkpoints(items: list[str], scratch: int, baseline: str | None = None) -> dict[str, list[str]]:
    """NAME=CKPT or NAME=CKPT1,CKPT2,... (pretraining runs of one method) -> {name: [sources]}; `scratch`
    random initialisations make a `scratch` row; `baseline` must name a row."""
    checkpoints = {}
    for item in items:
        name, sep, sources = item.partition("=")
        runs = sources.split(",")
        if not sep or not name or not all(runs):
            raise UserError(
                f"{item!r} is not NAME=CKPT or NAME=CKPT1,CKPT2,... (e.g. mpp=runs/mpp/checkpoints/last.ckpt)"
            )
        if name in checkpoints:
            raise UserError(f"checkpoint name {name!r} is given twice; names label the table's rows")
        checkpoints[name] = runs
    if scratch < 0:
        raise UserError(f"--scratch {scratch}: give a positive number of initialisations")
    if scratch:
        checkpoints.setdefault("scratch", ["scratch"] * scratch)
    if baseline is not None and baseline not in checkpoints:
        raise UserError(f"--baseline {baseline!r} names no checkpoint; valid: {', '.join(checkpoints)}")
    return checkpoints


def _compare(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ssl_vit.evaluation.report import compare, label_efficiency_protocols
    from ssl_vit.evaluation.suite import load_suite

    checkpoints = parse_checkpoints(args.checkpoints, args.scratch, args.baseline)
    suite = load_suite(args.suite)
    rows = compare(checkpoints, suite, args.out, args.baseline)
    if rows is None:  # a rank other than 0 under torchrun: rank 0 reports
        return 0
    console = Console()
    print(open(f"{args.out}/results.md").read())  # the markdown table as is: columns stay readable
    pictures = ["fewshot.png", "bars.png", "compute.png", "attention_distance.png"]
    if label_efficiency_protocols(suite):
        pictures.append("label_efficiency.png")
    if args.baseline:
        pictures.append("differences.png")
    console.print(f"wrote {args.out}/results.csv, results.md, {', '.join(pictures)}")
    failed = [row["name"] for row in rows if row["error"]]
    if failed:
        console.print(f"[red]failed: {', '.join(failed)} (see {args.out}/NAME/error.txt)[/red]")
    return 1 if failed else 0
