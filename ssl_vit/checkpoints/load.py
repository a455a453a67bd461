"""One loader for every place that takes a checkpoint (`--model.init_args.init_from`, `evaluate`, `compare`):

- a Lightning `.ckpt` of any ssl-vit task (backbone under `backbone.`, its `ViTConfig` in the hparams),
- an exported `.safetensors` (timm key names; the config in the file's metadata when ssl-vit wrote it),
- `timm:MODEL_NAME` (timm's pretrained weights, fetched by timm),
- `scratch` (random init of the given config).

Loading is safe: `torch.load(weights_only=True)` or safetensors, never unrestricted unpickling.
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import torch
from timm.models.vision_transformer import checkpoint_filter_fn

from ssl_vit.errors import UserError
from ssl_vit.models.vit import VARIANTS, ViT, ViTConfig, parse_variant

METADATA_KEY = "ssl_vit.backbone"  # the ViTConfig, as JSON, in exported .safetensors
SOURCES = "a Lightning .ckpt, an exported .safetensors, timm:MODEL_NAME or scratch"
# What must agree between a checkpoint and the config it is loaded into; img_size, drop path and
# activation checkpointing may differ (position embeddings are resampled in 2-D, ViT paper sec 3.2).
ARCHITECTURE = ("width", "depth", "heads", "mlp_dim", "pooling", "hybrid", "patch_size")


def load_backbone(source: str, config: ViTConfig | None = None) -> tuple[ViT, ViTConfig]:
    """Build the backbone `source` describes and load its weights.

    config: what the caller needs (a recipe's backbone). Its img_size and drop_path_rate win; the
    architecture must match the checkpoint's, else a one-line error says which to change. Needed for
    `scratch` and for .safetensors without ssl-vit metadata.
    """
    if source == "scratch":
        if config is None:
            raise UserError("'scratch' needs a backbone config (variant, img_size) to initialise")
        return config.build(), config
    if source.startswith("timm:"):
        return _from_timm(source.removeprefix("timm:"), config)
    path = Path(source)
    if not path.is_file():
        raise UserError(f"checkpoint {source!r} does not exist; give {SOURCES}")
    if path.suffix == ".safetensors":
        state, saved = _read_safetensors(path)
    else:
        state, saved = _read_lightning(path)
    if saved is None and config is None:
        raise UserError(f"{source} carries no backbone config; give the variant it was trained with")
    target = _reconcile(source, saved, config)
    vit = target.build()
    _load_state(vit, state, source)
    return vit, target


def _read_lightning(path: Path) -> tuple[dict, ViTConfig | None]:
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a non-checkpoint file fails in many ways; all mean the same to the user
        raise UserError(
            f"{path} is not a checkpoint torch can load safely ({type(err).__name__}); give {SOURCES}"
        ) from None
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        raise UserError(f"{path} is not a Lightning checkpoint (no state_dict); give {SOURCES}")
    state = {
        k.removeprefix("backbone."): v
        for k, v in checkpoint["state_dict"].items()
        if k.startswith("backbone.")
    }
    if not state:
        raise UserError(f"{path} has no backbone.* weights: not an ssl-vit checkpoint")
    hparams = checkpoint.get("hyper_parameters") or {}
    saved = hparams.get("backbone") if isinstance(hparams, dict) else None
    return state, ViTConfig.from_dict(saved, f"{path}: hyper_parameters.backbone") if saved else None


def _read_safetensors(path: Path) -> tuple[dict, ViTConfig | None]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            state = {key: f.get_tensor(key) for key in f.keys()}
            metadata = f.metadata() or {}
    except (SafetensorError, OSError) as err:
        raise UserError(f"{path} is not a readable .safetensors file ({err}); give {SOURCES}") from None
    saved = metadata.get(METADATA_KEY)
    if not saved:
        return state, None
    try:
        values = json.loads(saved)
    except ValueError as err:
        raise UserError(
            f"{path}: metadata {METADATA_KEY!r} is not JSON ({err}): re-export the file with ssl-vit, or "
            "drop that metadata and set the backbone in the suite"
        ) from None
    return state, ViTConfig.from_dict(values, f"{path}: metadata {METADATA_KEY!r}")


def _describe(config: ViTConfig) -> dict:
    parsed = parse_variant(config.variant)
    width, depth, heads, mlp = parsed.dims
    width_ = config.width or width
    return {
        "width": width_,
        "depth": config.depth or depth,
        "heads": config.heads or heads,
        "mlp_dim": config.mlp_dim or mlp * width_ // width,
        "pooling": config.pooling,
        "hybrid": parsed.hybrid,
        "patch_size": parsed.patch_size,
    }


def _reconcile(source: str, saved: ViTConfig | None, wanted: ViTConfig | None) -> ViTConfig:
    if saved is None:
        return wanted
    if wanted is None:
        return saved
    have, need = _describe(saved), _describe(wanted)
    differ = [f"{key} {have[key]} (asked for {need[key]})" for key in ARCHITECTURE if have[key] != need[key]]
    if differ:
        raise UserError(
            f"{source} holds a {saved.variant} backbone with {', '.join(differ)}; set the backbone to "
            f"variant {saved.variant} with its overrides, or pick a matching checkpoint"
        )
    return replace(
        saved,
        img_size=wanted.img_size,
        drop_path_rate=wanted.drop_path_rate,
        grad_checkpointing=wanted.grad_checkpointing,
    )


def _load_state(vit: ViT, state: dict, source: str) -> None:
    # timm's filter resamples position embeddings in 2-D when the resolution differs.
    state = checkpoint_filter_fn(state, vit)
    try:
        vit.load_state_dict(state, strict=True)
    except RuntimeError as err:
        first = str(err).strip().splitlines()[1:2] or [str(err)]
        raise UserError(f"{source}: weights do not fit the backbone: {first[0].strip()}") from None


def _from_timm(name: str, wanted: ViTConfig | None) -> tuple[ViT, ViTConfig]:
    import timm

    try:
        model = timm.create_model(name, pretrained=True, num_classes=0)
    except Exception as err:  # unknown name, no network, no cached copy: each is one user-facing line
        raise UserError(
            f"timm:{name}: could not create it with pretrained weights ({type(err).__name__}: "
            f"{str(err).splitlines()[0][:200]}); check the name, or export the weights to a "
            ".safetensors file and pass that"
        ) from None
    config = config_of_timm_model(model, name)
    if wanted is not None:
        config = _reconcile(f"timm:{name}", config, wanted)
    vit = config.build()
    _load_state(vit, model.state_dict(), f"timm:{name}")
    return vit, config


def config_of_timm_model(model, name: str) -> ViTConfig:
    """The ViTConfig that rebuilds a timm VisionTransformer (plain ones; ssl-vit's hybrids come as .ckpt)."""
    from timm.models.vision_transformer import VisionTransformer

    plain = isinstance(model, VisionTransformer) and type(model.patch_embed).__name__ == "PatchEmbed"
    if not plain or model.num_reg_tokens or model.no_embed_class or model.global_pool not in ("token", "avg"):
        raise UserError(f"timm:{name} is not a plain ViT (class token or GAP, learned position embeddings)")
    block = model.blocks[0]
    width, depth, heads = model.embed_dim, len(model.blocks), block.attn.num_heads
    mlp_dim, patch = block.mlp.fc1.out_features, model.patch_embed.patch_size[0]
    size = next((s for s, dims in VARIANTS.items() if dims == (width, depth, heads, mlp_dim)), "B")
    overrides = (
        {}
        if size != "B" or VARIANTS["B"] == (width, depth, heads, mlp_dim)
        else dict(width=width, depth=depth, heads=heads, mlp_dim=mlp_dim)
    )
    return ViTConfig(
        variant=f"{size}/{patch}",
        img_size=model.patch_embed.img_size[0],
        pooling="cls" if model.global_pool == "token" else "gap",
        **overrides,
    )


def config_metadata(config: ViTConfig) -> dict[str, str]:
    """safetensors metadata that lets `load_backbone` rebuild the backbone of an exported file."""
    return {METADATA_KEY: json.dumps(asdict(config))}


__all__ = ["config_metadata", "config_of_timm_model", "load_backbone"]
