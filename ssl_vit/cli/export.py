"""`ssl-vit export`: argparse front-end over `ssl_vit.checkpoints.export`."""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> None:
    export = subparsers.add_parser(
        "export", help="a checkpoint's backbone (and classifier) as timm weights; prints how to load them"
    )
    export.add_argument(
        "checkpoint",
        metavar="CKPT",
        help="a Lightning .ckpt, a .safetensors, an exported folder, or a .pth/.bin of timm or MAE weights",
    )
    export.add_argument(
        "out", metavar="OUT", help="the .safetensors file (--format timm) or folder (--format hf) to make"
    )
    export.add_argument(
        "--format",
        dest="fmt",
        choices=["timm", "hf"],
        default="timm",
        help="timm: one .safetensors for timm.create_model(NAME, pretrained=True, pretrained_cfg_overlay="
        "dict(file=OUT)) (default); hf: a folder for timm.create_model('local-dir:OUT', pretrained=True)",
    )
    export.add_argument(
        "--with-head",
        action="store_true",
        help="also the classifier of a supervised or fine-tuned checkpoint (timm's head, num_classes=K); "
        "without it num_classes=0",
    )
    export.add_argument(
        "--weights",
        choices=["student", "teacher"],
        default="student",
        help="student: the trained backbone (default); teacher: the EMA teacher of an I-JEPA or "
        "data2vec 2.0 checkpoint (I-JEPA evaluates its teacher)",
    )
    export.set_defaults(func=_export)


def _export(args: argparse.Namespace) -> int:
    from ssl_vit.checkpoints.export import export

    call = export(args.checkpoint, args.out, args.fmt, args.with_head, args.weights)
    print(f"wrote {args.out}; load it with:\nimport timm\nmodel = {call}")
    return 0
