"""`ssl-vit data convert|inspect` and `ssl-vit bench data`: argparse front-ends, nothing more."""

from __future__ import annotations

import argparse

from ssl_vit.data.convert.source import SOURCES, source_flags, sources_help, split_help
from ssl_vit.errors import UserError, check_at_least

# `bench data` and `bench feed` hold their generated JPEGs in memory; larger sides only exhaust it
MAX_STORED = 8192


def add_parser(subparsers) -> None:
    data = subparsers.add_parser("data", help="convert image sources to WebDataset shards, inspect shards")
    sub = data.add_subparsers(dest="data_command", required=True, metavar="ACTION")

    convert = sub.add_parser(
        "convert",
        help="write OUTDIR/{split}-NNNNNN.tar shards and OUTDIR/{split}.json",
        description="An interrupted conversion (SIGTERM, Ctrl-C, a kill, a crash) keeps its finished shards: "
        "the same command again continues from the next one; with other options it starts over. Sources "
        f"with segmentation masks ({_names(masks=True)}) store each sample's mask as its seg.png member "
        '(uint8, one class index per pixel, 255 ignored) and mark the manifest "masks": true.',
    )
    convert.add_argument("source", metavar="SOURCE", help=sources_help().replace("%", "%%"))
    convert.add_argument("outdir", metavar="OUTDIR")
    convert.add_argument("--split", default="train", help=split_help().replace("%", "%%"))
    convert.add_argument("--shard-size", type=int, default=1000, help="samples per shard (default 1000)")
    convert.add_argument(
        "--format",
        dest="image_format",
        choices=["png", "jpg"],
        help=f"png (lossless, default) or jpg; array sources ({_names(arrays=True)}) store .npy, refuse it",
    )
    convert.add_argument("--quality", type=int, help="JPEG quality (default 95)")
    convert.add_argument(
        "--max-side",
        type=int,
        metavar="N",
        help="shrink images whose longer side exceeds N pixels to N (aspect kept, never enlarged) and "
        "re-encode them in --format; smaller images in that format are stored byte for byte (8-bit "
        "sources only)",
    )
    convert.add_argument("--workers", type=int, default=1, help="encoding processes (default 1)")
    convert.add_argument(
        "--order",
        choices=["random", "source"],
        default="random",
        help="random (default): the split's records in a seeded random order, decided before any image is "
        "read (a resumed conversion writes the same shards), so no shard holds one class; source: the "
        "source's own order (class folders: class by class). wds: and hf: read lazily keep their order",
    )
    convert.add_argument("--seed", type=int, default=0, help="seed of --order random (default 0)")
    for kind, flag in source_flags():  # each source's own flags, as its module registers them
        convert.add_argument(
            flag.option,
            dest=flag.name,
            type=flag.type,
            metavar=flag.metavar,
            help=f"{kind.form} only: {flag.help}".replace("%", "%%"),  # argparse formats help with %
        )
    convert.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing split in OUTDIR (the old one stays until the new one is complete)",
    )
    convert.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="no progress (default: a bar on a terminal, else a line per finished shard, on stderr)",
    )
    convert.set_defaults(func=_convert)

    inspect = sub.add_parser(
        "inspect", help="samples/classes per shard, undecodable samples; exit 1 if broken"
    )
    inspect.add_argument("urls", metavar="URLS", nargs="+", help="shard URLs, brace ranges allowed")
    inspect.add_argument("--workers", type=int, default=1, help="shards inspected in parallel (default 1)")
    inspect.add_argument(
        "--stats",
        action="store_true",
        help="for each manifest without band_stats (per-band mean, std, min, max in model units), compute "
        "them over the inspected shards' good images, at most --stats-images, and add them to it",
    )
    inspect.add_argument(
        "--stats-images",
        type=int,
        default=10_000,
        metavar="N",
        help="--stats reads at most N images per manifest, spread evenly over its shards (default 10000)",
    )
    inspect.set_defaults(func=_inspect)


def _names(**kind) -> str:
    """The registered sources with `masks` or `arrays` true, by name."""
    return ", ".join(SOURCES.names(**kind))


def add_bench_parser(bench_subparsers) -> None:
    bench = bench_subparsers.add_parser("data", help="decode+augment img/s per worker vs a bare PIL loop")
    bench.add_argument("--images", type=int, default=512, help="distinct JPEGs in the bench shards")
    bench.add_argument("--samples", type=int, default=3000, help="samples per throughput measurement")
    bench.add_argument(
        "--memory-samples", type=int, default=20000, help="samples for the worker memory check"
    )
    # Defaults: the imagenet1k pretraining recipe's crop (224, MAE's scale 0.2-1) on stored JPEGs at
    # least twice the crop with margin, where draft decoding can pay (500x375, ImageNet's
    # typical size, is below 2x224); see benchmarks/RESULTS.md for the other settings.
    bench.add_argument("--image-size", type=int, default=224, help="crop size (default 224)")
    add_jpeg_options(bench, stored=(1000, 750))
    bench.add_argument(
        "--crop-scale",
        type=float,
        nargs=2,
        default=(0.2, 1.0),
        metavar=("MIN", "MAX"),
        help="area range of the random resized crop (default 0.2 1.0, MAE's pretraining crop)",
    )
    bench.add_argument("--batch-size", type=int, default=32)
    bench.add_argument(
        "--repeats", type=int, default=1, help="repeat every measurement, report median ratios (default 1)"
    )
    bench.set_defaults(func=_bench)


def add_jpeg_options(parser, stored: tuple[int, int]) -> None:
    """`--stored` and `--quality` of the JPEGs a benchmark generates (`ssl_vit.benchmark.data.make_jpegs`);
    `check_jpeg_options` checks them."""
    parser.add_argument(
        "--stored",
        type=_size,
        default=stored,
        help=f"stored JPEG size WxH (default {stored[0]}x{stored[1]}; ImageNet's typical size is 500x375)",
    )
    parser.add_argument(
        "--quality",
        type=int,
        default=90,
        help="JPEG quality of the stored images (default 90: ImageNet's files are mostly 75-90)",
    )


def check_jpeg_options(args) -> None:
    if not all(1 <= side <= MAX_STORED for side in args.stored):
        raise UserError(f"--stored {args.stored[0]}x{args.stored[1]}: give sides of 1 to {MAX_STORED} pixels")
    if not 1 <= args.quality <= 100:
        raise UserError(f"--quality {args.quality}: give a JPEG quality of 1 to 100")


def _size(text: str) -> tuple[int, int]:
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WxH such as 500x375, got {text!r}") from None
    return w, h


def _convert(args) -> int:
    from ssl_vit.data.convert.shard_writer import convert, manifest_path

    check_at_least(args, 1, "workers", "max_side")
    check_at_least(args, 0, "seed")

    manifest = convert(
        args.source,
        args.outdir,
        split=args.split,
        shard_size=args.shard_size,
        image_format=args.image_format,
        quality=args.quality,
        max_side=args.max_side,
        workers=args.workers,
        overwrite=args.overwrite,
        progress=args.progress,
        order=args.order,
        seed=args.seed,
        **{flag.name: getattr(args, flag.name) for _, flag in source_flags()},
    )
    print(
        f"wrote {manifest['num_samples']} samples ({manifest['skipped']} unreadable skipped) in "
        f"{len(manifest['shards'])} shards; manifest {manifest_path(args.outdir, args.split)}"
    )
    return 0


def _inspect(args) -> int:
    from ssl_vit.data.inspect import add_band_stats, format_report, inspect_urls

    check_at_least(args, 1, "workers", "stats_images")

    reports, problems = inspect_urls(
        args.urls, workers=args.workers, stats_images=args.stats_images if args.stats else None
    )
    print(format_report(reports, problems))
    lines = add_band_stats(reports) if args.stats else []
    if args.stats and not lines:  # --stats asked for something: say why nothing came of it
        lines = [
            "--stats: nothing written: the manifests of these shards hold band_stats already, or there is "
            "no manifest beside them (the SPLIT.json that `ssl-vit data convert` writes)"
        ]
    for line in lines:
        print(line)
    return 1 if problems else 0


def _bench(args) -> int:
    from ssl_vit.benchmark.data import format_results, run

    check_at_least(args, 1, "images", "samples", "memory_samples", "image_size", "batch_size", "repeats")
    check_jpeg_options(args)
    low, high = args.crop_scale
    if not 0 < low <= high <= 1:
        raise UserError(f"--crop-scale {low} {high}: give MIN MAX with 0 < MIN <= MAX <= 1, e.g. 0.2 1.0")

    results = run(
        args.images,
        args.samples,
        args.memory_samples,
        args.image_size,
        args.stored,
        args.batch_size,
        quality=args.quality,
        crop_scale=tuple(args.crop_scale),
        repeats=args.repeats,
    )
    print(format_results(results, args))
    return 0
