"""`ssl-vit info`: parameters and forward FLOPs of every variant, and of MAE's encoder + decoder, alone
and with an EMA teacher (data2vec 2.0 with one view: MAE's student plus the teacher's forward over the
whole image), counted by `ssl_vit.models.cost`. The teacher has no backward: a training step costs 3 x
the student's forward + 1 x the teacher's, as the tasks count it (`MaskedPatchPretraining.measure_flops`).
Or, given a checkpoint, what it holds.

Light to import (`ssl-vit --help` registers its parser): torch and the models load when it runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ssl_vit.errors import UserError


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "info", help="parameters and GFLOPs of the ViT variants and of MAE, or what a checkpoint holds"
    )
    parser.add_argument(
        "checkpoint",
        nargs="?",
        metavar="CKPT",
        help="a checkpoint file or exported folder to describe instead: its kind, its backbone, the "
        "checksum that verified its bytes (or that none did), and for a fit's checkpoint the steps its "
        "non-finite guard skipped and its loss-spike rollbacks",
    )
    parser.add_argument("--img-size", type=int, default=224, help="input resolution (default 224)")
    parser.add_argument(
        "--variants", nargs="+", metavar="VARIANT", help="default: Ti/16 S/16 B/16 ... R50+B/16"
    )
    parser.add_argument("--mask-ratio", type=float, default=0.75, help="MAE mask ratio (default 0.75)")
    parser.add_argument("--decoder-dim", type=int, default=512)
    parser.add_argument("--decoder-depth", type=int, default=8)
    parser.set_defaults(func=run)


def _check_mae(args: argparse.Namespace, patches: int) -> None:
    """MAE's options, before any model is built: one line each instead of a traceback from inside.
    `patches`: the fewest patches of the variants asked for, of which the mask must keep one."""
    import inspect

    from ssl_vit.models.heads import MAEDecoder

    if not 0 <= args.mask_ratio < 1 or round(args.mask_ratio * patches) >= patches:
        raise UserError(
            f"--mask-ratio {args.mask_ratio}: give a fraction in [0, 1) that keeps a patch, e.g. 0.75"
        )
    heads = inspect.signature(MAEDecoder).parameters["heads"].default  # what mae_cost builds
    if args.decoder_dim < heads or args.decoder_dim % heads:
        raise UserError(
            f"--decoder-dim {args.decoder_dim}: give a multiple of the decoder's {heads} heads, e.g. 512"
        )
    if args.decoder_depth < 1:
        raise UserError(f"--decoder-depth {args.decoder_depth}: give at least 1 block, e.g. MAE's 8")


def patch_size(variant: str, img_size: int) -> int:
    """`variant`'s patch size, which `img_size` (--img-size) must be a multiple of: one line otherwise, or
    for a variant that is not one."""
    from ssl_vit.models.vit import parse_variant

    try:
        patch = parse_variant(variant).patch_size
    except ValueError as err:
        raise UserError(str(err)) from None
    if img_size < patch or img_size % patch:
        raise UserError(f"--img-size {img_size}: give a multiple of {variant}'s {patch}-pixel patches")
    return patch


def describe(source: str) -> list[str]:
    """What the checkpoint `source` holds, in a few lines: its kind, its backbone and parameter count,
    and what verified its bytes (a damaged one is refused in one line by the loader)."""
    from ssl_vit.checkpoints.load import architecture, mapped_checkpoint, read_weights

    if source == "scratch" or source.startswith("timm:"):
        raise UserError(f"info {source}: info describes a checkpoint file or an exported folder")
    weights = read_weights(source)
    path = Path(source)
    kind = (
        f"a checkpoint of {weights.peer}'s MAE (its ViT read by ssl_vit.checkpoints.peers' key mapping)"
        if weights.peer
        else "a folder in timm's local Hub layout (model.safetensors)"
        if path.is_dir()
        else "safetensors weights"
        if path.suffix == ".safetensors"
        else "a Lightning checkpoint"
        if weights.hparams
        else "a torch file of weights"
    )
    lines = [f"{source}: {kind}"]
    config = weights.config
    if config is None:
        lines.append("backbone: its shapes match no paper variant (heads unknown)")
    else:
        dims = architecture(config)
        shape = ", ".join(f"{key} {dims[key]}" for key in ("width", "depth", "heads", "mlp_dim"))
        bands = "" if config.in_chans == 3 else f", {config.in_chans} bands"
        lines.append(
            f"backbone: {config.variant} ({shape}), {config.img_size} px{bands}, {config.pooling} pooling"
        )
    lines.append(f"parameters: {sum(t.numel() for t in weights.backbone.values()) / 1e6:.2f} M (backbone)")
    if weights.verified:
        lines.append(f"verified by {weights.verified}")
    else:
        lines.append(
            "not verified: it carries no checksum (not written by ssl-vit export or torch's zip format); "
            "its bytes load as they are"
        )
    if weights.hparams:  # a fit's checkpoint: the steps its non-finite guard skipped, its rollbacks
        from ssl_vit.run.nonfinite import NonFiniteGuard, history

        checkpoint = mapped_checkpoint(source) or {}  # verified above
        lines += history(checkpoint.get("callbacks", {}).get(NonFiniteGuard.__qualname__))
    return lines


def run(args: argparse.Namespace) -> int:
    if args.checkpoint is not None:
        print("\n".join(describe(args.checkpoint)))
        return 0
    from rich.console import Console
    from rich.table import Table

    from ssl_vit.models.cost import mae_cost, vit_cost
    from ssl_vit.models.vit import EXAMPLE_VARIANTS

    args.variants = args.variants or list(EXAMPLE_VARIANTS)
    patches = []
    for variant in args.variants:
        patches.append((args.img_size // patch_size(variant, args.img_size)) ** 2)
    _check_mae(args, min(patches))
    table = Table(title=f"ViT variants at {args.img_size}px (forward, per image; FLOPs = 2 x MACs)")
    for column in (
        "variant",
        "params (M)",
        "GFLOPs",
        f"MAE {args.mask_ratio:.0%} params (M)",
        "MAE GFLOPs",
        "supervised / MAE",
        "MAE + EMA teacher GFLOPs",
    ):
        table.add_column(column, justify="right")
    for variant in args.variants:
        vit = vit_cost(variant, args.img_size)
        row = [variant, f"{vit.params / 1e6:.1f}", f"{vit.flops / 1e9:.1f}"]
        if variant.startswith("R50+"):  # MAE masks patches of pixels; a ResNet stem sees them all.
            row += ["-", "-", "-", "-"]
        else:
            mae = mae_cost(variant, args.img_size, args.mask_ratio, args.decoder_dim, args.decoder_depth)
            row += [f"{mae.params / 1e6:.1f}", f"{mae.flops / 1e9:.1f}", f"{vit.flops / mae.flops:.2f}x"]
            row += [f"{(mae.flops + vit.flops) / 1e9:.1f}"]  # the teacher: the plain forward
        table.add_row(*row)
    Console().print(table)
    return 0
