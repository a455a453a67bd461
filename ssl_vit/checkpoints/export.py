"""`ssl-vit export`: a checkpoint's backbone, and optionally its classifier, as weights timm loads.

- `timm`: one .safetensors file for `timm.create_model(NAME, pretrained=True,
  pretrained_cfg_overlay=dict(file=OUT, ...), ...)`, NAME the timm model of the paper variant (B/16 at
  224 px: `vit_base_patch16_224`), with the architecture written out as keyword arguments where no
  timm model matches (custom width/depth/heads, another image size).
- `hf`: a folder (`config.json`, `model.safetensors`) in timm's local Hub layout, written by timm's
  `save_for_hf`: `timm.create_model("local-dir:OUT", pretrained=True)`.

Either carries in its .safetensors metadata the `ViTConfig`, so `load_backbone` reads it back, and the
SHA-256s ssl-vit's loader checks (`export_metadata`): a file damaged on disk or in a copy is refused.

Legend: D width, K classes.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Literal, NamedTuple

import timm
from safetensors.torch import save_file
from timm.models import get_pretrained_cfg, save_for_hf
from torch import Tensor, nn

from ssl_vit.checkpoints.load import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    Weights,
    WeightsKind,
    architecture,
    export_metadata,
    read_weights,
)
from ssl_vit.errors import UserError
from ssl_vit.models.vit import ViTConfig, parse_variant
from ssl_vit.storage.outdir import checkpoint_inputs, commit, current_umask, out_lock, refuse_inputs

Format = Literal["timm", "hf"]
TIMM_SIZES = {"Ti": "tiny", "S": "small", "M": "medium", "B": "base", "L": "large", "H": "huge"}
# timm's hybrids carry the ResNet-50 of one stride each (ViT paper sec 3.1); other sizes override dims.
HYBRID_CARRIERS = {16: "vit_base_r50_s16", 32: "vit_large_r50_s32"}
PLAIN_CARRIER = "vit_base_patch16_224"  # any registered ViT; every architecture argument is given


class TimmModel(NamedTuple):
    """What `timm.create_model` needs to rebuild a backbone: a registered name and the keyword
    arguments where the architecture differs from that name's."""

    name: str
    kwargs: dict


def export(source: str, out: str, fmt: Format, with_head: bool, weights: WeightsKind = "student") -> str:
    """Write `source`'s backbone (and classifier with `with_head`) to `out` in `fmt`; returns the
    Python call that loads it. `out` must not exist; it appears whole or not at all. `weights`:
    `teacher` writes the EMA teacher of a latent-target checkpoint (I-JEPA, data2vec 2.0) instead."""
    target = Path(out).absolute()
    refuse_inputs(out, checkpoint_inputs(source), "OUT")
    if target.exists() or target.is_symlink():
        raise UserError(f"{out} already exists; give a new path, or remove it first")
    if not target.parent.is_dir():
        raise UserError(f"{target.parent} is not a directory; create it first or give another OUT")
    if fmt == "timm" and target.suffix != ".safetensors":
        # timm chooses its loader by the file's suffix: any other name fails in `timm.create_model`.
        raise UserError(
            f"{out} does not end in .safetensors, which timm needs to load it: name OUT "
            f"{target.with_suffix('.safetensors').name}, or give --format hf for a folder"
        )
    with out_lock(target, "export", "OUT"):
        written = _write(source, target, fmt, with_head, weights)
    if fmt == "hf":
        return f'timm.create_model("local-dir:{target}", pretrained=True)'
    overlay = dict(file=str(target), num_classes=written.num_classes)
    defaults = get_pretrained_cfg(written.carrier.name)
    config, (mean, std) = written.config, written.normalisation
    size = (config.in_chans, config.img_size, config.img_size)
    if tuple(defaults.input_size) != size:
        overlay["input_size"] = size
    for key, value in (("mean", mean), ("std", std)):
        if value is not None and tuple(getattr(defaults, key)) != tuple(value):
            overlay[key] = tuple(value)
    arguments = {"pretrained": True, "pretrained_cfg_overlay": overlay, "num_classes": written.num_classes}
    arguments.update(written.carrier.kwargs)
    return f'timm.create_model("{written.carrier.name}", {_python_arguments(arguments)})'


class Written(NamedTuple):
    carrier: TimmModel
    config: ViTConfig
    num_classes: int
    normalisation: tuple  # (mean, std) the checkpoint recorded, or Nones


def _write(source: str, target: Path, fmt: Format, with_head: bool, weights: WeightsKind) -> Written:
    """`source`'s weights written to `target` in `fmt`: beside it first, then put in place by `commit`."""
    if target.exists() or target.is_symlink():  # again, under the lock: another export's
        raise UserError(f"{target} already exists; give a new path, or remove it first")
    weights = read_weights(source, weights)
    if weights.config is None:
        raise UserError(
            f"{source} carries no backbone config and its shapes match no paper variant; export it from "
            "a Lightning checkpoint or a file ssl-vit exported"
        )
    head = classifier_state(weights, source) if with_head else {}
    num_classes = head["head.weight"].shape[0] if head else 0
    carrier = timm_model(weights.config)
    model = timm_module(carrier, num_classes, {**weights.backbone, **head})
    training = weights.hparams.get("training", weights.hparams)  # flat in checkpoints before the group
    mean, std = training.get("mean"), training.get("std")
    try:
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    except OSError as err:
        raise UserError(f"cannot write in {target.parent} ({err.strerror}); give a writable OUT") from None
    try:
        written = staging / target.name
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if fmt == "timm":
            save_file(state, written, metadata=export_metadata(weights.config, state))
        else:
            data = {k: tuple(v) for k, v in (("mean", mean), ("std", std)) if v is not None}
            # The carrier's tag (e.g. `dino`) would name weights these are not.
            config = dict(pretrained_cfg=dict(tag="ssl_vit"))
            save_for_hf(model, str(written), config, safe_serialization=True, data_config=data)
            # timm writes no metadata: written again with ours (the module's docstring).
            config_json = (written / CONFIG_FILE).read_bytes()
            metadata = export_metadata(weights.config, state, config_json)
            save_file(state, written / WEIGHTS_FILE, metadata=metadata)
        _default_permissions(written)
        commit(written, target, label="OUT")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return Written(carrier, weights.config, num_classes, (mean, std))


def timm_model(config: ViTConfig) -> TimmModel:
    """The timm model of `config`: the paper variant's own name at its image size when timm registers
    one (`vit_base_patch16_224`, `vit_large_r50_s32_384`), else a registered carrier with every
    argument that differs written out."""
    parsed, dims = parse_variant(config.variant), architecture(config)
    size = TIMM_SIZES[parsed.size]
    if parsed.hybrid:
        family = f"vit_{size}_r50_s{parsed.patch_size}"
        candidates = [f"{family}_{config.img_size}", f"{HYBRID_CARRIERS[parsed.patch_size]}_224"]
    else:
        family = f"vit_{size}_patch{parsed.patch_size}"
        candidates = [f"{family}_{config.img_size}", f"{family}_224", PLAIN_CARRIER]
    name = next(n for n in candidates if timm.is_model(n))
    if int(dims["width"] * (dims["mlp_dim"] / dims["width"])) != dims["mlp_dim"]:
        raise UserError(f"MLP width {dims['mlp_dim']} is not width x a ratio timm rebuilds exactly")
    wanted = dict(
        img_size=config.img_size,
        embed_dim=dims["width"],
        depth=dims["depth"],
        num_heads=dims["heads"],
        mlp_ratio=dims["mlp_dim"] / dims["width"],
        class_token=config.pooling == "cls",
        global_pool="token" if config.pooling == "cls" else "avg",
        in_chans=config.in_chans,
    )
    if not parsed.hybrid:
        wanted["patch_size"] = parsed.patch_size
    have = _architecture_of(_meta_model(name, num_classes=0))
    return TimmModel(name, {k: v for k, v in wanted.items() if have[k] != v})


def classifier_state(weights: Weights, source: str) -> dict[str, Tensor]:
    """The classifier of a supervised or fine-tuned checkpoint, as timm's `head.weight` (K, D) and
    `head.bias` (K,), after the features timm's head sees (the pooled output)."""
    if "head.weight" not in weights.rest or "head.bias" not in weights.rest:
        raise UserError(
            f"--with-head: {source} has no classifier (head.weight); only supervised and fine-tuned "
            "checkpoints have one: export without --with-head"
        )
    if "fc_norm.weight" in weights.rest:
        raise UserError(
            f"--with-head: {source} was fine-tuned on the mean of the normalised patch tokens, normalised "
            "again (fc_norm); timm's ViT normalises before pooling or after, not both: export without "
            "--with-head, or fine-tune a gap backbone or with feature cls"
        )
    return {"head.weight": weights.rest["head.weight"], "head.bias": weights.rest["head.bias"]}


def timm_module(model: TimmModel, num_classes: int, state: dict[str, Tensor]) -> nn.Module:
    """The timm model holding `state`, built on the meta device and given the tensors (no random init):
    its state dict must match key for key and shape for shape, as the printed call will need."""
    module = _meta_model(model.name, num_classes=num_classes, **model.kwargs)
    module.load_state_dict(state, strict=True, assign=True)
    return module.eval()


def _meta_model(name: str, **kwargs) -> nn.Module:
    """timm's model `name` on the meta device, where only its names and shapes are read. Without its
    initialisation: there are no values to write, and its truncated normals still run through Python
    there (about a second for a ViT-H)."""
    return timm.create_model(name, device="meta", weight_init="skip", **kwargs)


def _architecture_of(model: nn.Module) -> dict:
    block = model.blocks[0]
    return dict(
        img_size=model.patch_embed.img_size[0],
        patch_size=model.patch_embed.patch_size[0],
        embed_dim=model.embed_dim,
        depth=len(model.blocks),
        num_heads=block.attn.num_heads,
        mlp_ratio=block.mlp.fc1.out_features / model.embed_dim,
        class_token=model.has_class_token,
        global_pool=model.global_pool,
        in_chans=model.in_chans,
    )


def _default_permissions(path: Path) -> None:
    """0o666 (0o777 for folders) less the umask, as `open` gives: safetensors and mkdtemp make 0o600."""
    umask = current_umask()
    for item in [path, *path.rglob("*")]:
        item.chmod((0o777 if item.is_dir() else 0o666) & ~umask)


def _python_arguments(arguments: dict) -> str:
    def python(value) -> str:
        if isinstance(value, dict):
            return f"dict({_python_arguments(value)})"
        return repr(value)

    return ", ".join(f"{key}={python(value)}" for key, value in arguments.items())


__all__ = ["TimmModel", "classifier_state", "export", "timm_model", "timm_module"]
