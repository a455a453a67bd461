"""`ssl-vit analyze`: argparse front-end over `analyze.analyze`."""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> None:
    analyze = subparsers.add_parser(
        "analyze", help="the ViT paper's look inside a checkpoint: attention distance, embeddings, rollout"
    )
    analyze.add_argument(
        "checkpoint", metavar="CKPT", help="a Lightning .ckpt, an exported .safetensors or timm:MODEL_NAME"
    )
    analyze.add_argument(
        "--data",
        required=True,
        metavar="URLS",
        help="shard URLs (brace ranges allowed), read with the eval transform",
    )
    analyze.add_argument("--out", required=True, help="output directory: pictures (PNG) and analysis.json")
    analyze.add_argument("--images", type=int, default=256, help="images averaged over (default 256)")
    analyze.add_argument("--batch-size", type=int, default=64, help="images per forward pass (default 64)")
    analyze.add_argument("--overwrite", action="store_true", help="replace a non-empty --out directory")
    analyze.add_argument(
        "--display-bands",
        metavar="R,G,B",
        type=_bands,
        help="checkpoints of other than 3 bands: the three bands (0-based) drawn as red, green, blue "
        "(default: a masked-pretraining checkpoint's display_bands, else the first three)",
    )
    analyze.set_defaults(func=_analyze)


def _analyze(args: argparse.Namespace) -> int:
    from ssl_vit.analysis.analyze import analyze

    record = analyze(
        args.checkpoint, args.data, args.out, args.images, args.batch_size, args.overwrite, args.display_bands
    )
    distances = ", ".join(f"{d:.1f}" for d in record["attention_distance"]["mean_per_layer"])
    print(f"mean attention distance per block (pixels, over {record['images']} images): {distances}")
    if "skipped" in record["masked_prediction"]:
        print(f"masked predictions: skipped ({record['masked_prediction']['skipped']})")
    print(f"wrote {args.out}: {', '.join(record['pictures'])}, analysis.json")
    return 0


def _bands(text: str) -> tuple[int, int, int]:
    """`--display-bands 3,2,1` -> (3, 2, 1)."""
    parts = text.split(",")
    if len(parts) != 3 or not all(part.strip().isdigit() for part in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: give three band indices, e.g. 3,2,1")
    return tuple(int(part) for part in parts)
