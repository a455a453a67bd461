"""`ssl-vit evaluate` and `ssl-vit compare`: argparse front-ends over suite.evaluate and report.compare."""

from __future__ import annotations

import argparse
import json

from ssl_vit.checkpoints.load import SOURCES
from ssl_vit.errors import UserError

CHECKPOINT_HELP = SOURCES


def add_parsers(subparsers) -> None:
    evaluate = subparsers.add_parser("evaluate", help="run an evaluation suite on one checkpoint")
    evaluate.add_argument("checkpoint", metavar="CKPT", help=CHECKPOINT_HELP)
    evaluate.add_argument("--suite", required=True, help="suite YAML (see recipes/eval/)")
    evaluate.add_argument("--out", required=True, help="output directory; results.json goes there")
    evaluate.set_defaults(func=_evaluate)

    compare = subparsers.add_parser("compare", help="the suite on every checkpoint: table, plots, W&B")
    compare.add_argument("checkpoints", metavar="NAME=CKPT", nargs="+", help=f"CKPT: {CHECKPOINT_HELP}")
    compare.add_argument("--suite", required=True, help="suite YAML (see recipes/eval/)")
    compare.add_argument("--out", required=True, help="output directory for results.csv/.md and plots")
    compare.add_argument(
        "--scratch", action="store_true", help="add a row for the suite's backbone from scratch"
    )
    compare.set_defaults(func=_compare)


def _evaluate(args: argparse.Namespace) -> int:
    from ssl_vit.evaluation.suite import evaluate, load_suite

    record = evaluate(args.checkpoint, load_suite(args.suite), args.out)
    print(json.dumps(record["results"], indent=2))
    print(f"wrote {args.out}/results.json")
    return 0


def parse_checkpoints(items: list[str], scratch: bool) -> dict[str, str]:
    checkpoints = {}
    for item in items:
        name, sep, source = item.partition("=")
        if not sep or not name or not source:
            raise UserError(f"{item!r} is not NAME=CKPT (e.g. mpp=runs/mpp/checkpoints/last.ckpt)")
        if name in checkpoints:
            raise UserError(f"checkpoint name {name!r} is given twice; names label the table's rows")
        checkpoints[name] = source
    if scratch:
        checkpoints.setdefault("scratch", "scratch")
    return checkpoints


def _compare(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ssl_vit.evaluation.report import compare
    from ssl_vit.evaluation.suite import load_suite

    checkpoints = parse_checkpoints(args.checkpoints, args.scratch)
    suite = load_suite(args.suite)
    rows = compare(checkpoints, suite, args.out)
    if rows is None:  # a rank other than 0 under torchrun: rank 0 reports
        return 0
    console = Console()
    print(open(f"{args.out}/results.md").read())  # the markdown table as is: columns stay readable
    console.print(f"wrote {args.out}/results.csv, results.md, fewshot.png, bars.png, attention_distance.png")
    failed = [row["name"] for row in rows if row["error"]]
    if failed:
        console.print(f"[red]failed: {', '.join(failed)} (see {args.out}/NAME/error.txt)[/red]")
    return 1 if failed else 0
