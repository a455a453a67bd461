"""One loader for every place that takes a checkpoint (`--model.init_args.training.init_from`, `evaluate`,
`compare`):

- a Lightning `.ckpt` of any ssl-vit task (backbone under `backbone.`, its `ViTConfig` in the hparams;
  with `weights="teacher"`, the EMA teacher of a latent-target task under `teacher.` instead),
- a `.safetensors` file with timm's key names: exported by `ssl-vit export` (the config in its metadata)
  or any other (the config inferred from the shapes, or given),
- a folder `ssl-vit export --format hf` wrote (timm's local Hub layout: `model.safetensors`),
- a torch file of timm-named weights (`.pth`, `.bin`): a plain state dict, or one under `model` as
  facebookresearch/mae writes them (its decoder is ignored here; `load_mae_decoder` reads it),
- a checkpoint of a peer's MAE, lightly's or stable-pretraining's (a Lightning checkpoint or the model's
  state dict): its timm ViT under the peer's prefix, read by that peer's key mapping (`peers`),
- `timm:MODEL_NAME` (timm's pretrained weights, fetched by timm),
- `scratch` (random init of the given config).

Files without ssl-vit's config: it comes from the shapes (`infer_config`); a classifier `head.*` is
ignored. A config the caller gives wins (the shapes must fit it).

Input bands: RGB weights (3 bands) load into a backbone of any other band count through timm's own
`adapt_input_conv` (the convolution that reads the bands, `patch_embed.proj` or a hybrid's ResNet stem,
repeated over the bands and scaled by 3 / C; summed for C = 1), said in one line. Weights of any other
band count load only into a backbone of that count.

Loading is safe: `torch.load(weights_only=True)` or safetensors, never unrestricted unpickling; a torch
file's CRC-32s are checked first (`integrity`), and so are the SHA-256s `ssl-vit export` writes
(`export_metadata`): a damaged checkpoint is refused, not loaded. Files without either load as they are
(`Weights.verified` None).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import sys
import warnings
from dataclasses import asdict, replace
from functools import cache
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch
from timm.models import adapt_input_conv, clean_state_dict
from timm.models.vision_transformer import checkpoint_filter_fn
from torch import Tensor, nn

from ssl_vit.checkpoints import SOURCES, integrity, mae, peers
from ssl_vit.errors import UserError, first_line
from ssl_vit.models.vit import HYBRID_STEM_CONV, VARIANTS, ViT, ViTConfig, input_conv_key, parse_variant

METADATA_KEY = "ssl_vit.backbone"  # the ViTConfig, as JSON, in exported .safetensors
# What must agree between a checkpoint and the config it is loaded into; img_size, drop path and
# activation checkpointing may differ (position embeddings are resampled in 2-D, ViT paper sec 3.2).
ARCHITECTURE = ("width", "depth", "heads", "mlp_dim", "pooling", "hybrid", "patch_size")
WEIGHTS_FILE = "model.safetensors"  # in an exported folder (timm's name for a local Hub model)
CONFIG_FILE = "config.json"  # beside it, timm's pretrained config
# The SHA-256s in an exported .safetensors' metadata (`export_metadata`).
DIGEST_KEY, CONFIG_DIGEST_KEY = "ssl_vit.sha256", "ssl_vit.config_json_sha256"
EXPORTED_DAMAGED_FIX = "export it again from its checkpoint, or restore it from a copy"
_BLOCK = re.compile(r"^blocks\.(\d+)\.")
# Which backbone of a Lightning checkpoint: the trained one, or the EMA teacher of I-JEPA / data2vec 2.0
# (`MaskedPatchPretraining.teacher`), each under its prefix with timm's key names.
WeightsKind = Literal["student", "teacher"]
PREFIXES: dict[str, str] = {"student": "backbone.", "teacher": "teacher."}
RGB_BANDS = 3  # the band count whose weights adapt to any other (timm's `adapt_input_conv` base_chans)


class Weights(NamedTuple):
    """What a checkpoint file holds, read once."""

    backbone: dict[str, Tensor]  # timm's key names
    config: ViTConfig | None  # saved by ssl-vit, else inferred from the shapes (None: not inferable)
    rest: dict[str, Tensor]  # the other tensors under their own names (a task's heads, MAE's decoder)
    hparams: dict  # a Lightning checkpoint's hyperparameters; {} for other files
    verified: str | None = None  # the checksum that vouched for the bytes read; None: the file had none
    peer: str | None = None  # the peer whose MAE saved it (`peers`: its key mapping read it); None: not one


def load_backbone(
    source: str, config: ViTConfig | None = None, weights: WeightsKind = "student"
) -> tuple[ViT, ViTConfig]:
    """Build the backbone `source` describes and load its weights.

    config: what the caller needs (a recipe's backbone). Its img_size and drop_path_rate win; the
    architecture must match the checkpoint's, else a one-line error says which to change. Needed for
    `scratch` and for files whose architecture cannot be told from the shapes.
    weights: `teacher` takes a latent-target checkpoint's EMA teacher instead of its student.
    """
    if weights == "teacher" and (source == "scratch" or source.startswith("timm:")):
        raise _no_teacher(source)
    if source == "scratch":
        if config is None:
            raise UserError("'scratch' needs a backbone config (variant, img_size) to initialise")
        return config.build(), config
    if source.startswith("timm:"):
        return _from_timm(source.removeprefix("timm:"), config)
    found = read_weights(source, weights)
    named = f"{source} ({found.peer}'s MAE)" if found.peer else source
    if found.config is None and config is None:
        raise UserError(
            f"{named} carries no backbone config and its shapes match no paper variant (heads unknown); "
            "give the variant it was trained with"
        )
    target = _reconcile(named, found.config, config)
    vit = target.build()
    _load_state(vit, found.backbone, named)
    return vit, target


def load_mae_decoder(decoder: nn.Module, source: str) -> None:
    """Load MAE's decoder from `source` into `decoder` (an `MAEDecoder`) when the file has one
    (facebookresearch/mae pretraining checkpoints); other sources leave it as initialised."""
    if source == "scratch" or source.startswith("timm:"):
        return
    weights = read_weights(source)
    state = mae.decoder_state(weights.rest, source)
    if not state:
        return
    ours = decoder.state_dict()
    prediction = ("pred.weight", "pred.bias")
    wanted = ours["pred.bias"].shape[0]
    values = state["pred.bias"].shape[0] if all(key in state for key in prediction) else wanted
    fresh = values != wanted and state["pred.weight"].shape[1:] == ours["pred.weight"].shape[1:]
    if fresh:
        # Another target (MAE's p*p*3 pixels; here p*p*C of C bands, or HOG): the rest of the decoder
        # continues, its last layer, which maps onto the target, starts afresh.
        state = {key: value for key, value in state.items() if key not in prediction}
        ours = {key: value for key, value in ours.items() if key not in prediction}
        _note(
            f"the MAE decoder of {source} predicts {values} values per patch and this task {wanted}: "
            "its prediction layer (pred) starts afresh"
        )
    differ = [
        f"{key} {tuple(value.shape)} (ours {tuple(ours[key].shape) if key in ours else 'absent'})"
        for key, value in state.items()
        if key not in ours or ours[key].shape != value.shape
    ]
    missing = sorted(set(ours) - set(state))
    if differ or missing:
        what = differ[0] if differ else f"no {missing[0]}"
        width, depth = (
            state["embed.weight"].shape[0],
            len({k.split(".")[1] for k in state if k.startswith("blocks.")}),
        )
        raise UserError(
            f"{source}: its MAE decoder does not fit this one: {what}; set decoder_dim {width} and "
            f"decoder_depth {depth} (decoder_heads: MAE's default is 16)"
        )
    decoder.load_state_dict(state, strict=not fresh)


def read_weights(source: str, weights: WeightsKind = "student") -> Weights:
    """The tensors and config of a checkpoint file or exported folder (not `timm:` or `scratch`);
    `weights="teacher"`: a Lightning checkpoint's EMA teacher as the backbone."""
    path = Path(source)
    if path.is_dir() and (path / WEIGHTS_FILE).is_file():
        path = path / WEIGHTS_FILE
    if not path.is_file():
        what = f"is a folder without {WEIGHTS_FILE}" if path.is_dir() else "does not exist"
        raise UserError(f"checkpoint {source!r} {what}; give {SOURCES}")
    if path.suffix == ".safetensors":
        if weights == "teacher":
            raise _no_teacher(source)
        return _read_safetensors(path, source)
    return _read_torch(path, weights)


def _no_teacher(source) -> UserError:
    return UserError(
        f"{source} has no EMA teacher (teacher.* weights): only Lightning checkpoints of a teacher target "
        "(presets ijepa, data2vec2) have one; take its student (the default)"
    )


# torch's weights-only unpickler warns (two lines) before it reads a pickle of another protocol than its own
# (2): files that `pickle.dump` wrote, never `torch.save`. Either it reads the file, and the warning was
# needless, or it refuses it and ssl-vit says so in one line (a pickle that needs code, or not a
# checkpoint): the warning only pushes that line down.
PICKLE_PROTOCOL_WARNING = (
    r"Detected pickle protocol \d+ in the checkpoint, which was not the default pickle protocol used by "
    + re.escape("`torch.load`")
)


def torch_load(file, **kwargs) -> Any:
    """`torch.load(file, weights_only=True, **kwargs)`, the one way ssl-vit reads a torch file whole,
    without torch's warning about the pickle protocol (`PICKLE_PROTOCOL_WARNING`)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=PICKLE_PROTOCOL_WARNING, category=UserWarning)
        return torch.load(file, weights_only=True, **kwargs)


def mapped_checkpoint(source: str) -> dict | None:
    """The torch checkpoint file `source` as a dict, its tensors memory-mapped (only what is used is
    read); None for other sources (`scratch`, `timm:`, .safetensors, a folder) and for a file that
    cannot be mapped (torch's legacy format) or loaded: `read_weights` says what is wrong with it."""
    path = Path(source)
    if not path.is_file() or path.suffix == ".safetensors":
        return None
    try:
        # MAE's training checkpoints keep their argparse.Namespace of arguments: plain data.
        with torch.serialization.safe_globals([argparse.Namespace]):
            checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        return None
    return checkpoint if isinstance(checkpoint, dict) else None


def _read_torch(path: Path, weights: WeightsKind = "student") -> Weights:
    integrity.check(path, "restore it from a copy, or give another checkpoint")
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):  # as `mapped_checkpoint`
            checkpoint = torch_load(path, map_location="cpu")
    except Exception as err:  # a non-checkpoint file fails in many ways; all mean the same to the user
        raise UserError(
            f"{path} is not a checkpoint torch can load safely ({type(err).__name__}); give {SOURCES}"
        ) from None
    if not isinstance(checkpoint, dict):
        raise UserError(f"{path} holds a {type(checkpoint).__name__}, not a dict of weights; give {SOURCES}")
    lightning = checkpoint.get("state_dict")
    verified = "the CRC-32 of every record" if integrity.has_checksums(path) else None
    # A peer's Lightning checkpoint: its model under `state_dict` too, the ViT under the peer's prefix
    # (lightly's `backbone.vit.`, which ssl-vit's own `backbone.` would otherwise claim).
    peer = isinstance(lightning, dict) and peers.match(lightning) is not None
    if isinstance(lightning, dict) and not peer and any(str(k).startswith("backbone.") for k in lightning):
        return _lightning_weights(path, checkpoint, weights)._replace(verified=verified)
    if weights == "teacher":
        raise _no_teacher(path)
    # facebookresearch/mae (and DeiT) nest the state dict under `model`.
    state = lightning if peer else checkpoint.get("model", checkpoint)
    if not isinstance(state, dict) or not state or not all(isinstance(v, Tensor) for v in state.values()):
        raise UserError(
            f"{path} is neither a Lightning checkpoint with backbone.* weights nor a state dict of timm "
            f"names; give {SOURCES}"
        )
    state = clean_state_dict(state)
    mapping = peers.match(state)
    if mapping is None:
        return _timm_weights(state, None)._replace(verified=verified)
    backbone, rest = peers.split(state, mapping.prefix)
    found = _timm_weights(backbone, None)
    return found._replace(rest={**found.rest, **rest}, verified=verified, peer=mapping.peer)


def _lightning_weights(path: Path, checkpoint: dict, weights: WeightsKind = "student") -> Weights:
    backbone, rest = peers.split(checkpoint["state_dict"], PREFIXES[weights])
    hparams = checkpoint.get("hyper_parameters") or {}
    hparams = hparams if isinstance(hparams, dict) else {}
    if not backbone:
        raise _no_teacher(path)
    saved = hparams.get("backbone")
    config = ViTConfig.from_dict(saved, f"{path}: hyper_parameters.backbone") if saved else None
    return Weights(backbone, config, rest, hparams)


def _timm_weights(state: dict[str, Tensor], saved: ViTConfig | None) -> Weights:
    """Split timm- or MAE-named tensors into the backbone and the rest (classifier, MAE decoder)."""
    encoder = mae.encoder_state(state)
    backbone = {k: v for k, v in encoder.items() if not k.startswith(("head.", "head_dist."))}
    rest = {k: v for k, v in state.items() if k not in backbone}
    return Weights(backbone, saved or infer_config(backbone), rest, {})


def _read_safetensors(path: Path, source: str) -> Weights:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            state = {key: f.get_tensor(key) for key in f.keys()}
            metadata = f.metadata() or {}
    except (SafetensorError, OSError) as err:
        raise UserError(f"{path} is not a readable .safetensors file ({err}); give {SOURCES}") from None
    verified = _verify_export(path, source, state, metadata)
    saved = metadata.get(METADATA_KEY)
    if not saved:
        return _timm_weights(state, None)._replace(verified=verified)
    try:
        values = json.loads(saved)
    except ValueError as err:
        raise UserError(
            f"{path}: metadata {METADATA_KEY!r} is not JSON ({err}): re-export the file with ssl-vit, or "
            "drop that metadata and set the backbone in the suite"
        ) from None
    config = ViTConfig.from_dict(values, f"{path}: metadata {METADATA_KEY!r}")
    return _timm_weights(state, config)._replace(verified=verified)


def _verify_export(path: Path, source: str, state: dict[str, Tensor], metadata: dict) -> str | None:
    """The SHA-256s `ssl-vit export` wrote into `metadata` checked against what was read: what they
    vouch for, None when there are none (another tool's file); `integrity.DamagedCheckpoint` (named as
    the user gave it, `source`) when one does not match. safetensors checks no checksum of its own."""
    recorded = metadata.get(DIGEST_KEY)
    if recorded is None:
        return None
    if weights_digest(metadata, state) != recorded:
        why = f"{path.name}'s tensors do not match the SHA-256 ssl-vit export wrote into it"
        raise integrity.DamagedCheckpoint(source, why, EXPORTED_DAMAGED_FIX)
    config_recorded = metadata.get(CONFIG_DIGEST_KEY)
    if config_recorded is None:
        return "the SHA-256 ssl-vit export wrote into it"
    try:
        config_bytes = (path.parent / CONFIG_FILE).read_bytes()
    except OSError as err:
        raise integrity.DamagedCheckpoint(
            source, f"its {CONFIG_FILE} cannot be read ({err.strerror})", EXPORTED_DAMAGED_FIX
        ) from None
    if hashlib.sha256(config_bytes).hexdigest() != config_recorded:
        why = f"its {CONFIG_FILE} does not match the SHA-256 ssl-vit export wrote"
        raise integrity.DamagedCheckpoint(source, why, EXPORTED_DAMAGED_FIX)
    return f"the SHA-256s ssl-vit export wrote of {path.name} and {CONFIG_FILE}"


def weights_digest(metadata: dict[str, str], state: dict[str, Tensor]) -> str:
    """The SHA-256 an exported .safetensors carries (`DIGEST_KEY`): of its backbone config (the
    metadata `METADATA_KEY`) and of every tensor, name, dtype, shape and bytes, in name order. Over the
    tensors, not the file: the digest goes into the file's own header, before safetensors lays out the
    data after it."""
    digest = hashlib.sha256(metadata.get(METADATA_KEY, "").encode())
    for name in sorted(state):
        tensor = state[name].detach().cpu().contiguous()
        digest.update(f"\0{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def infer_config(state: dict[str, Tensor]) -> ViTConfig | None:
    """The ViTConfig of timm-named backbone weights, from their shapes: width, input bands and patch size
    from `patch_embed.proj.weight` (D, C, p, p), depth from the `blocks.N` count, MLP width from `fc1`, the
    image size from `pos_embed` (1, P+N, D) (a square grid), pooling from `cls_token`. Heads are not
    in any shape: they come from the paper variant of that width and depth, else None (not inferable)."""
    proj, pos = state.get("patch_embed.proj.weight"), state.get("pos_embed")
    blocks = {int(m[1]) for k in state if (m := _BLOCK.match(k))}
    fc1 = state.get("blocks.0.mlp.fc1.weight")
    hybrid = any(k.startswith("patch_embed.backbone.") for k in state)
    if hybrid or proj is None or pos is None or fc1 is None or proj.ndim != 4 or pos.ndim != 3:
        return None
    width, patch, depth, mlp_dim = proj.shape[0], proj.shape[-1], len(blocks), fc1.shape[0]
    with_cls = "cls_token" in state
    side = math.isqrt(pos.shape[1] - with_cls)
    size = next((s for s, (w, d, _, _) in VARIANTS.items() if (w, d) == (width, depth)), None)
    if size is None or side * side != pos.shape[1] - with_cls:
        return None
    return ViTConfig(
        variant=f"{size}/{patch}",
        img_size=side * patch,
        pooling="cls" if with_cls else "gap",
        mlp_dim=None if mlp_dim == VARIANTS[size][3] else mlp_dim,
        in_chans=proj.shape[1],
    )


def architecture(config: ViTConfig) -> dict:
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
    have, need = architecture(saved), architecture(wanted)
    differ = [f"{key} {have[key]} (asked for {need[key]})" for key in ARCHITECTURE if have[key] != need[key]]
    if differ:
        raise UserError(
            f"{source} holds a {saved.variant} backbone with {', '.join(differ)}; set the backbone to "
            f"variant {saved.variant} with its overrides, or pick a matching checkpoint"
        )
    check_bands(source, saved.in_chans, wanted.in_chans)
    return replace(
        saved,
        in_chans=wanted.in_chans,  # RGB weights adapt (`_adapt_bands`)
        img_size=wanted.img_size,
        drop_path_rate=wanted.drop_path_rate,
        grad_checkpointing=wanted.grad_checkpointing,
    )


def check_bands(source: str, have: int, need: int) -> None:
    """One line unless weights of `have` input bands load into a backbone of `need`: the same count, or
    RGB weights, which `adapt_input_conv` adapts to any count."""
    if have != need and have != RGB_BANDS:
        raise UserError(
            f"{source} holds weights for {have} input bands and the backbone reads {need}: only RGB (3-band) "
            f"weights adapt to another band count; give data of {have} bands (channels: {have}), or "
            + ("an RGB checkpoint" if need == RGB_BANDS else f"a checkpoint of {need} or 3 bands")
        )


def _adapt_bands(vit: ViT, state: dict[str, Tensor], source: str) -> dict[str, Tensor]:
    """`state` with the convolution that reads the input bands adapted from RGB to `vit`'s band count as
    the module's docstring says (as `timm.create_model(..., pretrained=True, in_chans=C)` does)."""
    key = input_conv_key(state)
    weight = state.get(key)
    if weight is None or weight.ndim != 4 or weight.shape[1] == vit.in_chans:
        return state
    check_bands(source, weight.shape[1], vit.in_chans)
    what = "ResNet stem" if key == HYBRID_STEM_CONV else "patch embedding"
    _note(
        f"adapted the {what} of {source} from {weight.shape[1]} to {vit.in_chans} input bands "
        "(timm's adapt_input_conv)"
    )
    return {**state, key: adapt_input_conv(vit.in_chans, weight, base_chans=RGB_BANDS)}


@cache
def _note(message: str) -> None:
    """`ssl-vit: note: MESSAGE` on stderr, once per process (a suite loads a checkpoint twice)."""
    print(f"ssl-vit: note: {message}", file=sys.stderr, flush=True)


def _load_state(vit: ViT, state: dict, source: str) -> None:
    # timm's filter resamples position embeddings in 2-D when the resolution differs.
    state = checkpoint_filter_fn(_adapt_bands(vit, state, source), vit)
    mine = vit.state_dict()
    missing = [k for k in mine if k not in state]
    unexpected = [k for k in state if k not in mine]
    if missing and len(missing) > len(mine) // 2:
        # Most of a ViT's names absent: another architecture (a ResNet, a ConvNeXt...). Its names, not the
        # hundreds of missing ones, say what the file holds.
        shown = ", ".join(unexpected[:3]) + (", ..." if len(unexpected) > 3 else "")
        raise UserError(
            f"{source} is not a ViT's weights: {len(missing)} of the backbone's {len(mine)} tensors are "
            f"missing and it holds {len(unexpected)} others ({shown}); give a ViT checkpoint"
        )
    try:
        vit.load_state_dict(state, strict=True)
    except RuntimeError as err:
        first = str(err).strip().splitlines()[1:2] or [str(err)]
        problem = first[0].strip()
        if len(problem) > 300:  # the key lists: their start says enough
            problem = problem[:300].rsplit(",", 1)[0] + ", ..."
        raise UserError(f"{source}: weights do not fit the backbone: {problem}") from None


def _from_timm(name: str, wanted: ViTConfig | None) -> tuple[ViT, ViTConfig]:
    try:
        model = _pretrained_timm(name)
    except UserError:
        raise
    except Exception as err:  # unknown name, a failed download: each is one user-facing line
        raise UserError(
            f"timm:{name}: could not create it with pretrained weights ({first_line(err)}); check the name, "
            "or export the weights to a .safetensors file and pass that"
        ) from None
    config = config_of_timm_model(model, name)
    if wanted is not None:
        config = _reconcile(f"timm:{name}", config, wanted)
    vit = config.build()
    _load_state(vit, model.state_dict(), f"timm:{name}")
    return vit, config


def _pretrained_timm(name: str) -> nn.Module:
    """timm's model `name` with its pretrained weights: from the Hugging Face cache when they are there,
    else downloaded. Where they are not cached and the Hub cannot be reached at all, one line at once:
    the Hub client would retry each file timm asks for 5 times, backing off 1 to 8 s (about 45 s for the
    two it tries), in silence since the retry lines are dropped (`quiet.HUB_RETRY_LINES`)."""
    import timm
    from huggingface_hub import constants, get_session
    from huggingface_hub.errors import LocalEntryNotFoundError

    fix = "export the weights to a .safetensors file and pass that"
    offline = constants.HF_HUB_OFFLINE
    try:
        constants.HF_HUB_OFFLINE = True  # the cache only: `huggingface_hub.is_offline_mode` reads it
        return timm.create_model(name, pretrained=True, num_classes=0)
    except LocalEntryNotFoundError:
        if offline:
            raise UserError(
                f"timm:{name}: its weights are not in the Hugging Face cache and HF_HUB_OFFLINE is set: "
                f"unset it to download them, or {fix}"
            ) from None
    finally:
        constants.HF_HUB_OFFLINE = offline
    try:
        get_session().head(constants.ENDPOINT, timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except Exception as err:  # no answer at all (any answer, even an error status, is a Hub to ask)
        raise UserError(
            f"timm:{name}: its weights are not in the Hugging Face cache and the Hub ({constants.ENDPOINT}) "
            f"cannot be reached ({first_line(err)}): connect to the network, or {fix}"
        ) from None
    return timm.create_model(name, pretrained=True, num_classes=0)


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
        in_chans=model.patch_embed.proj.in_channels,
        **overrides,
    )


def config_metadata(config: ViTConfig) -> dict[str, str]:
    """safetensors metadata that lets `load_backbone` rebuild the backbone of an exported file."""
    return {METADATA_KEY: json.dumps(asdict(config))}


def export_metadata(config: ViTConfig, state: dict[str, Tensor], config_json: bytes | None = None) -> dict:
    """The metadata of a .safetensors `ssl-vit export` writes: the backbone config and the SHA-256s the
    loader checks (`weights_digest`; of an exported folder's `config_json` too)."""
    metadata = config_metadata(config)
    metadata[DIGEST_KEY] = weights_digest(metadata, state)
    if config_json is not None:
        metadata[CONFIG_DIGEST_KEY] = hashlib.sha256(config_json).hexdigest()
    return metadata
