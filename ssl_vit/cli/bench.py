"""`ssl-vit bench step|parts|loop|scaling|feed`: the training-step (whole, and piece by piece),
training-loop, scaling and input-path benchmarks."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ssl_vit.benchmark import COMPILE_MODES, PRECISIONS, TASKS, model_name
from ssl_vit.cli.data import add_jpeg_options, check_jpeg_options
from ssl_vit.cli.info import patch_size
from ssl_vit.errors import UserError, check_at_least


def add_bench_parsers(bench_subparsers) -> None:
    step = bench_subparsers.add_parser(
        "step", help="img/s and MFU of each task's training step vs a plain timm loop"
    )
    _step_options(step)
    step.set_defaults(func=_step)

    loop = bench_subparsers.add_parser(
        "loop", help="a whole `ssl-vit fit` of N steps on synthetic shards vs a bare in-memory loop"
    )
    loop.add_argument("--steps", type=int, default=1000, help="optimizer steps (default 1000)")
    loop.add_argument("--batch-size", type=int, default=32)
    loop.add_argument(
        "--threads", type=int, help="torch threads of both sides (default: every core but the loader's)"
    )
    _json_options(loop)
    loop.set_defaults(func=_loop)

    scaling = bench_subparsers.add_parser(
        "scaling", help="DDP efficiency from 1 to 2 processes (gloo), and gradient traffic per recipe"
    )
    _step_options(scaling, variant="Ti/16", tasks=("mae",))
    scaling.set_defaults(func=_scaling)

    parts = bench_subparsers.add_parser(
        "parts", help="a masked task's step, piece by piece (blocks, decoder, the rest), vs supervised's"
    )
    _model_options(parts)
    parts.add_argument(
        "--task", choices=[t for t in TASKS if t != "supervised"], default="mae", help="default: mae"
    )
    _run_options(parts, steps=2)
    parts.set_defaults(func=_parts)

    feed = bench_subparsers.add_parser(
        "feed", help="img/s of the whole input path (shards, workers, device) per worker count vs the step"
    )
    _step_options(feed, tasks=("mae",), steps=2)  # with one round (below): about a minute on 2 CPU cores
    add_jpeg_options(feed, stored=(500, 375))
    feed.add_argument(
        "--workers", help="DataLoader worker counts, e.g. 0,1,2 (0: the main process decodes; default 1, 2, "
        "4, ... up to the cores)",
    )  # fmt: skip
    feed.add_argument(
        "--decode", choices=("cpu", "device"), default="cpu", help="where JPEGs are decoded (default cpu)"
    )
    feed.add_argument(
        "--shards", metavar="URLS",
        help="feed these shards (e.g. what `ssl-vit data convert --max-side` wrote) instead of photos "
        "made at --stored size and --quality",
    )  # fmt: skip
    feed.add_argument(
        "--batches", type=int, default=16, help="timed batches per worker, after 2 untimed (default 16)"
    )
    feed.add_argument(
        "--step-json", type=Path,
        help="the step's side from this `bench step --json` report (same variant, depth, size, batch and "
        "device) instead of measuring it",
    )  # fmt: skip
    feed.set_defaults(func=_feed, rounds=1)


def _step_options(
    parser, variant: str = "B/16", tasks: tuple[str, ...] | None = None, steps: int = 3
) -> None:
    _model_options(parser, variant)
    parser.add_argument(
        "--tasks", nargs="+", choices=TASKS, default=list(tasks or TASKS), help="default: all"
    )
    parser.add_argument("--compile", choices=("off", "on", "both"), default="off", help="torch.compile")
    parser.add_argument(
        "--compile-scope", choices=("blocks", "step"), default="blocks",
        help="compile every transformer block (default) or each side's whole step",
    )  # fmt: skip
    parser.add_argument(
        "--compile-mode", choices=COMPILE_MODES, default="default",
        help="torch.compile's mode (reduce-overhead: CUDA graphs)",
    )  # fmt: skip
    _run_options(parser, steps)


def _model_options(parser, variant: str = "B/16") -> None:
    parser.add_argument("--variant", default=variant, help=f"ViT variant (default {variant})")
    parser.add_argument(
        "--depth", type=int,
        help="blocks of the encoder and of each task's decoder instead of the variant's and the recipes' "
        "(a quick look at the pipeline, e.g. on a CPU: compiling a whole step takes minutes at full depth)",
    )  # fmt: skip
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=8, help="per process (default 8)")
    parser.add_argument("--precision", choices=list(PRECISIONS), default="32-true")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")


def _run_options(parser, steps: int) -> None:
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; medians are reported")
    parser.add_argument("--steps", type=int, default=steps, help=f"timed steps per round (default {steps})")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before them, per round")
    parser.add_argument("--threads", type=int, help="torch threads per process (default: torch's)")
    _json_options(parser)


def _json_options(parser) -> None:
    parser.add_argument("--json", type=Path, help="also write the report(s) here")
    parser.add_argument("--overwrite", action="store_true", help="replace the --json file if it exists")


def _check_json(args) -> None:
    """Refused before anything is measured: a --json file that cannot be written, or that exists."""
    if args.json is None:
        return
    if args.json.is_dir() or not args.json.parent.is_dir():
        where = "is a directory" if args.json.is_dir() else f"directory {args.json.parent} does not exist"
        raise UserError(f"--json {args.json}: {where}; give a file in an existing directory")
    if args.json.exists() and not args.overwrite:
        raise UserError(f"--json {args.json} exists: pass --overwrite to replace it, or give another file")


def _shown(args, table: str, report) -> int:
    """A bench command's end: `table` printed, `report` written to --json when one is given."""
    print(table)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


def _check(args) -> None:
    import torch

    from ssl_vit.benchmark.step import available_memory, batch_memory

    patch_size(args.variant, args.img_size)
    check_at_least(args, 1, "batch_size", "depth", "rounds", "steps", "threads")
    check_at_least(args, 0, "warmup")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise UserError(f"--device {args.device}: use cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is visible here; use --device cpu")
    needed = batch_memory(args.variant, args.img_size, args.batch_size, args.depth)
    free = available_memory(device)
    if needed > free:
        raise UserError(
            f"--batch-size {args.batch_size}: a {model_name(vars(args))} step at {args.img_size} px needs at "
            f"least {needed / 2**30:,.1f} GiB for its images and activations, and {device.type} has "
            f"{free / 2**30:,.1f} GiB free: give a smaller --batch-size"
        )
    _check_json(args)


def _step_reports(args, progress=print) -> list[dict]:
    import torch

    from ssl_vit.benchmark.step import StepBench

    _check(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    reports = []
    for compiled in {"off": [False], "on": [True], "both": [False, True]}[args.compile]:
        bench = StepBench(
            args.variant, args.img_size, args.batch_size, tuple(args.tasks), args.precision, compiled,
            args.device, args.rounds, args.steps, args.warmup,
            compile_scope=args.compile_scope, compile_mode=args.compile_mode, depth=args.depth,
        )  # fmt: skip
        reports.append(bench.run(progress))
    return reports


def _step(args) -> int:
    import torch.distributed as dist

    from ssl_vit.benchmark.step import format_table

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:  # under torchrun: the plain loop needs the process group before Lightning starts
        dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo")
    rank_zero = not distributed or dist.get_rank() == 0
    reports = _step_reports(args, progress=print if rank_zero else lambda _: None)
    if rank_zero:
        return _shown(args, "\n".join("\n" + format_table(report) + "\n" for report in reports), reports)
    return 0


def _loop(args) -> int:
    from ssl_vit.benchmark.loop import format_loop, run_loop_bench

    if args.steps < 1 or args.batch_size < 1 or (args.threads is not None and args.threads < 1):
        raise UserError("--steps, --batch-size and --threads must be at least 1")
    _check_json(args)
    report = run_loop_bench(args.steps, args.batch_size, args.threads)
    return _shown(args, format_loop(report), report)


def _parts(args) -> int:
    import torch

    from ssl_vit.benchmark.parts import PartsBench, format_parts
    from ssl_vit.benchmark.step import StepBench

    _check(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    bench = StepBench(
        args.variant, args.img_size, args.batch_size, precision=args.precision, device=args.device,
        rounds=args.rounds, steps=args.steps, warmup=args.warmup, depth=args.depth,
    )  # fmt: skip
    report = PartsBench(bench, args.task).run(print)
    return _shown(args, "\n" + format_parts(report), report)


def _scaling(args) -> int:
    from ssl_vit.benchmark.scaling import format_scaling, run_scaling

    _check(args)
    report = run_scaling(args)
    return _shown(args, format_scaling(report), report)


def _feed(args) -> int:
    from ssl_vit.benchmark.feed import default_workers, format_feed, run_feed, step_rates
    from ssl_vit.benchmark.step import format_table

    workers = _worker_counts(args.workers) if args.workers is not None else default_workers()
    check_at_least(args, 1, "batches")
    check_jpeg_options(args)
    _check(args)
    if args.shards is not None:
        from ssl_vit.data.stream.urls import check_urls, expand

        check_urls(expand(args.shards, "--shards"), "--shards")
    if args.step_json is not None:
        steps = _read_step_reports(args)
    else:
        steps = _step_reports(args)
        for step in steps:
            print("\n" + format_table(step) + "\n")
    report = run_feed(
        workers, stored=args.stored, quality=args.quality, img_size=args.img_size, batch_size=args.batch_size,
        batches=args.batches, device=args.device, decode=args.decode, shards=args.shards, progress=print,
    )  # fmt: skip
    report = step_rates(report, steps)
    return _shown(args, "\n" + format_feed(report), report)


def _worker_counts(text: str) -> list[int]:
    try:
        counts = [int(n) for n in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 0:
        raise UserError(f"--workers {text}: give worker counts of 0 or more separated by commas, e.g. 1,2,4")
    return counts


def _read_step_reports(args) -> list[dict]:
    """The reports of `bench step --json` in `args.step_json`, refused unless measured at the variant,
    depth, image size, batch and device the feed runs at."""
    import torch

    try:
        reports = json.loads(args.step_json.read_text())
        measured = {(r["config"]["variant"], r["config"].get("depth"), r["config"]["img_size"],
                     r["config"]["batch_size"], torch.device(r["config"]["device"]).type)
                    for r in reports}  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as err:
        raise UserError(f"--step-json {args.step_json}: not a `bench step --json` report ({err})") from None
    wanted = (args.variant, args.depth, args.img_size, args.batch_size, torch.device(args.device).type)
    if measured != {wanted}:

        def said(variant, depth, size, batch, device) -> str:
            model = model_name({"variant": variant, "depth": depth})
            return f"{model} at {size} px, batch {batch} on {device}"

        found = ", ".join(said(*config) for config in sorted(measured, key=str)) or "nothing"
        raise UserError(
            f"--step-json {args.step_json}: measured {found}, not {said(*wanted)}: give the feed the step's "
            "--variant, --depth, --img-size, --batch-size and --device"
        )
    return reports
