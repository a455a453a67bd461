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
    analyze.set_defaults(func=_analyze)


def _analyze(args: argparse.Namespace) -> int:
    from ssl_vit.analysis.analyze import analyze

    record = analyze(args.checkpoint, args.data, args.out, args.images, args.batch_size, args.overwrite)
    distances = ", ".join(f"{d:.1f}" for d in record["attention_distance"]["mean_per_layer"])
    print(f"mean attention distance per block (pixels, over {record['images']} images): {distances}")
    if "skipped" in record["masked_prediction"]:
        print(f"masked predictions: skipped ({record['masked_prediction']['skipped']})")
    print(f"wrote {args.out}: {', '.join(record['pictures'])}, analysis.json")
    return 0
