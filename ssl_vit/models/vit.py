"""The one backbone: timm's `VisionTransformer`, built from a variant string, with token-level entry points.

`ViT` subclasses timm's class only to add methods; it adds no parameters, so its state dict is exactly
timm's (`patch_embed.proj.weight`, `blocks.0.attn.qkv.weight`, `cls_token`, `pos_embed`, ...) and
weights move between ssl-vit and `timm.create_model` without a mapping table. Objectives (MPP, MAE,
SimMIM) wrap it and own their own parameters, such as the learned `[mask]` embedding.

Legend for tensor shapes: B batch, C input bands (`in_chans`: 3 for RGB, any other count for multispectral
data), N patch tokens, K kept tokens, D width, P prefix ([class]) tokens, T tokens (P + patches), F feature
width.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from dataclasses import fields as dataclass_fields
from functools import partial
from typing import Literal, NamedTuple

import torch
from timm.layers import StdConv2dSame
from timm.models import ResNetV2, checkpoint_seq
from timm.models.vision_transformer import VisionTransformer
from timm.models.vision_transformer_hybrid import HybridEmbed
from torch import Tensor

from ssl_vit.errors import BadValue, shown
from ssl_vit.models import features as _features  # noqa: F401  (registers the features)
from ssl_vit.models.feature import FEATURES, Readout, Tokens

# name -> (width, depth, heads, mlp_dim). B/L/H: ViT paper Table 1; Ti/S: DeiT; M: big_vision.
VARIANTS: dict[str, tuple[int, int, int, int]] = {
    "Ti": (192, 12, 3, 768),
    "S": (384, 12, 6, 1536),
    "M": (512, 12, 8, 2048),
    "B": (768, 12, 12, 3072),
    "L": (1024, 24, 16, 4096),
    "H": (1280, 32, 16, 5120),
}
# The paper's hybrids: a ResNet-50 (v2, group norm, weight-standardised convs) whose stages up to
# stride 16 (3, 4, 9 blocks) or stride 32 (3, 4, 6, 3) feed 1x1 "patches" to the transformer
# (ViT paper sec 3.1 "Hybrid Architecture"; timm's vit_base_r50_s16_224 / vit_large_r50_s32_224).
HYBRID_STAGES: dict[int, tuple[int, ...]] = {16: (3, 4, 9), 32: (3, 4, 6, 3)}
_VARIANT_RE = re.compile(r"^(?:(?P<hybrid>R50)\+)?(?P<size>[A-Za-z]+)/(?P<patch>\d+)$")
EXAMPLE_VARIANTS = ("Ti/16", "S/16", "B/16", "B/32", "L/16", "L/32", "H/14", "R50+B/16")
# Choices of features (`ssl_vit.models.feature`): pooled, one vector per image (`ViT.features`), and of
# those the ones of the backbone's width D (what a head of that width takes: not `lastk`'s k x D); one
# vector per token (`ViT.feature_set`).
FeatureKind = FEATURES.choice("FeatureKind", pooled=True)
WidthFeature = FEATURES.choice("WidthFeature", pooled=True, blocks=False)
TokenKind = FEATURES.choice("TokenKind", pooled=False)
# The largest image side, width, depth, head count or MLP width a config may give: 3x the largest
# ViT trained (ViT-22B: width 6,144, MLP 24,576, depth 48); a larger number is a mistake that would only
# fail in an allocation.
MAX_SIZE = 1 << 16
LAST_K = 4  # the blocks `lastk` and `patches_lastk` read by default (DINO's linear evaluation: the last 4)
# The convolution that reads the input bands, by its key in timm's state dict: the patch embedding's, or
# for hybrids the ResNet stem's (their `patch_embed.proj` is a 1x1 convolution over ResNet features).
PATCH_CONV, HYBRID_STEM_CONV = "patch_embed.proj.weight", "patch_embed.backbone.stem.conv.weight"


def input_conv_key(names) -> str:
    """The key of the convolution that reads the input bands among a timm ViT's state-dict `names`."""
    return HYBRID_STEM_CONV if HYBRID_STEM_CONV in names else PATCH_CONV


class Variant(NamedTuple):
    size: str
    patch_size: int
    hybrid: bool

    @property
    def dims(self) -> tuple[int, int, int, int]:
        return VARIANTS[self.size]


def parse_variant(variant: str) -> Variant:
    """`"B/16"` -> Variant("B", 16, hybrid=False); `"R50+B/16"` -> hybrid.

    A bad one raises `BadValue` (a UserError and a ValueError) naming the valid sizes: one line."""
    match = _VARIANT_RE.match(variant.strip()) if isinstance(variant, str) else None
    valid = (
        f"give SIZE/PATCH with SIZE one of {', '.join(VARIANTS)} (hybrids: R50+SIZE/16 or R50+SIZE/32); "
        f"valid: e.g. {', '.join(EXAMPLE_VARIANTS)}"
    )
    if match is None or match["size"] not in VARIANTS or int(match["patch"]) < 1:
        raise BadValue(f"unknown ViT variant {variant!r}: {valid}")
    parsed = Variant(match["size"], int(match["patch"]), match["hybrid"] is not None)
    if parsed.hybrid and parsed.patch_size not in HYBRID_STAGES:
        raise BadValue(f"hybrid {variant!r} needs a ResNet stride of {sorted(HYBRID_STAGES)}: {valid}")
    return parsed


class ViT(VisionTransformer):
    """timm's VisionTransformer plus the entry points masked pretraining needs: `embed_patches`, then
    `encode` of those tokens, corrupted (ViT paper), a subset of them (MAE) or some masked (SimMIM)."""

    def __init__(self, *, variant: str, **timm_kwargs) -> None:
        super().__init__(**timm_kwargs)
        self.variant = variant

    @property
    def grid_size(self) -> tuple[int, int]:
        return tuple(self.patch_embed.grid_size)

    @property
    def pixels_per_token(self) -> int:
        """Pixels per side of one token: the patch size, or the ResNet stride for hybrids."""
        return self.patch_embed.feat_ratio(as_scalar=True)

    def embed_patches(self, images: Tensor) -> Tensor:
        """images: (B, C, H, W) -> patch embeddings (B, N, D), no position embeddings yet."""
        return self.patch_embed(images)

    def encode(
        self,
        patch_tokens: Tensor,
        idx_keep: Tensor | None = None,
        mask: Tensor | None = None,
        mask_token: Tensor | None = None,
    ) -> Tokens:
        """patch_tokens: (B, N, D) from `embed_patches`, possibly already corrupted (ViT-paper MPP
        replaces embeddings before position embeddings are added, appendix B.1.2).

        idx_keep: (B, K) int64: only those K tokens (plus [class]) run through the blocks, each with its
        own position embedding (MAE, He et al. 2021 sec 3: "the encoder is applied only on visible patches").
        mask: (B, N) bool with mask_token (D,): masked patches are replaced by the learned token before
        position embeddings are added, and all N run through the blocks (SimMIM, Xie et al. 2022 sec 3.1).
        """
        if mask is not None:
            patch_tokens = torch.where(mask.unsqueeze(-1), mask_token.to(patch_tokens.dtype), patch_tokens)
        prefix_pos, patch_pos = (
            self.pos_embed[:, : self.num_prefix_tokens],
            self.pos_embed[:, self.num_prefix_tokens :],
        )
        x = patch_tokens + patch_pos  # (B, N, D)
        if idx_keep is not None:
            x = torch.gather(x, 1, idx_keep.unsqueeze(-1).expand(-1, -1, x.shape[-1]))  # (B, K, D)
        if self.cls_token is not None:
            x = torch.cat([(self.cls_token + prefix_pos).expand(x.shape[0], -1, -1), x], dim=1)  # (B, P+K, D)
        x = self.norm_pre(self.pos_drop(x))
        x = checkpoint_seq(self.blocks, x) if self.grad_checkpointing else self.blocks(x)
        return self.named_tokens(self.norm(x))

    def named_tokens(self, x: Tensor) -> Tokens:
        """x: (B, P+N, D) tokens after the final norm -> their `Tokens` ([class], patches, pooled)."""
        return Tokens(
            cls=x[:, 0] if self.cls_token is not None else None,
            patches=x[:, self.num_prefix_tokens :],
            pooled=self.forward_head(x, pre_logits=True),
        )

    def forward_tokens(self, images: Tensor) -> Tokens:
        """images: (B, C, H, W) -> all named outputs of the plain (uncorrupted) forward."""
        return self.encode(self.embed_patches(images))

    def check_feature(self, feature: str, last_k: int = 4, kinds: tuple[str, ...] | None = None) -> None:
        """Raise ValueError (one line) unless `features(images, feature, last_k)` can run; `kinds` narrows
        the valid ones (default: every registered feature) for callers whose heads take width D (no
        `lastk`) or read tokens."""
        kinds = tuple(FEATURES) if kinds is None else kinds
        chosen = FEATURES.pick(feature, kinds)
        if chosen.needs_cls and self.cls_token is None:
            # its alternatives are the valid ones of its sort (pooled, or per token) that need none
            others = " or ".join(
                repr(name)
                for name, other in FEATURES.items()
                if name in kinds and other.pooled == chosen.pooled and not other.needs_cls
            )
            raise ValueError(
                f"feature {feature!r} needs a [class] token, but this backbone pools by global average "
                f"('gap'): use {others}"
            )
        if chosen.blocks and not 1 <= last_k <= len(self.blocks):
            raise ValueError(
                f"last_k must be in [1, {len(self.blocks)}] (the backbone's depth), got {last_k}"
            )

    def features(self, images: Tensor, feature: FeatureKind, last_k: int = 4) -> Tensor:
        """images: (B, C, H, W) -> one feature per image (B, F): F = D for `cls`/`mean`, last_k x D for
        `lastk` (check it first with `check_feature`; each feature's module in `ssl_vit.models.features`
        says what it is)."""
        return self.feature_set(images, (feature,), last_k)[feature]

    def feature_set(
        self, images: Tensor, kinds: tuple[FeatureKind | TokenKind, ...], last_k: int = 4
    ) -> dict[str, Tensor]:
        """images: (B, C, H, W) -> {kind: features} for every kind in `kinds`, all from one forward pass:
        a suite that reads several kinds pays for the blocks once. Pooled kinds are (B, F), token kinds
        (B, T, F) (each kind's module in `ssl_vit.models.features` says what it is)."""
        if any(FEATURES[kind].blocks for kind in kinds):
            readout = self.read_blocks(images, last_k)
        else:
            readout = Readout(self.forward_tokens(images), None, None, self.num_prefix_tokens)
        return {kind: FEATURES[kind].read(readout) for kind in kinds}

    def read_blocks(self, images: Tensor, last_k: int) -> Readout:
        """images: (B, C, H, W) -> the final layer's outputs and the last `last_k` blocks', each through
        the final norm, from one forward pass."""
        # timm's forward_intermediates returns the last k blocks' outputs, un-normalised and split
        # into (patches, prefix) pairs when there is a [class] token; forward_head(norm(.)) then pools
        # each exactly as the final layer's `pooled` is (token or fc_norm(mean)), so lastk with k=1 ==
        # pooled, and the last of them is the final layer itself.
        blocks = self.forward_intermediates(
            images, indices=last_k, output_fmt="NLC", intermediates_only=True, return_prefix_tokens=True
        )
        normed = [
            self.norm(torch.cat([out[1], out[0]], dim=1) if isinstance(out, tuple) else out) for out in blocks
        ]  # each (B, T, D)
        tokens = self.named_tokens(normed[-1])
        pooled = [self.forward_head(x, pre_logits=True) for x in normed[:-1]] + [tokens.pooled]
        return Readout(tokens, normed, pooled, self.num_prefix_tokens)


def build_vit(
    variant: str,
    img_size: int = 224,
    *,
    pooling: Literal["cls", "gap"] = "cls",
    width: int | None = None,
    depth: int | None = None,
    heads: int | None = None,
    mlp_dim: int | None = None,
    num_classes: int = 0,
    in_chans: int = 3,
    **timm_kwargs,
) -> ViT:
    """Build a ViT from a variant string (`"B/16"`, `"R50+B/16"`, ...).

    width/depth/heads/mlp_dim override the table (tiny test models); `pooling` is the paper's
    `[class]` token or global average pooling (no [class] token, ViT paper appendix D.3); `in_chans` the
    input bands (timm's argument: the input channels of the patch embedding, or of a hybrid's ResNet
    stem). Other keyword arguments go to timm's VisionTransformer (`drop_path_rate`, `device`, ...).
    """
    parsed = parse_variant(variant)
    if pooling not in ("cls", "gap"):
        raise BadValue(f"unknown pooling {pooling!r}: give 'cls' or 'gap'")
    base_width, base_depth, base_heads, base_mlp = parsed.dims
    width, depth, heads = width or base_width, depth or base_depth, heads or base_heads
    mlp_dim = mlp_dim or (base_mlp * width // base_width)
    if not isinstance(in_chans, int) or isinstance(in_chans, bool) or in_chans < 1:
        raise BadValue(f"in_chans is {in_chans!r}: give the number of input bands, a positive integer")
    if width % heads:
        raise BadValue(f"width {width} is not divisible by heads {heads}: pick heads that divide it")
    patch = parsed.patch_size
    if img_size % patch:
        raise BadValue(
            f"image size {img_size} is not divisible by the patch size {patch} of {variant}: give a multiple "
            f"of {patch} (data.init_args.image_size), e.g. {max(patch, img_size - img_size % patch)}"
        )
    kwargs = dict(
        img_size=img_size,
        patch_size=parsed.patch_size,
        embed_dim=width,
        depth=depth,
        num_heads=heads,
        mlp_ratio=mlp_dim / width,
        num_classes=num_classes,
        in_chans=in_chans,
        class_token=pooling == "cls",
        global_pool="token" if pooling == "cls" else "avg",
    )
    device = timm_kwargs.get("device")
    if torch.device(device or torch.get_default_device()).type == "meta":
        # Shapes only (FLOP counts, state-dict layouts): timm's initialisation has no values to write,
        # and its truncated normals still run through Python there, about 0.4 s for a ViT-L.
        kwargs["weight_init"] = "skip"
    if parsed.hybrid:
        backbone = hybrid_resnet(HYBRID_STAGES[parsed.patch_size], in_chans, device)
        kwargs.update(patch_size=1, embed_layer=partial(HybridEmbed, backbone=backbone))
    return ViT(variant=variant, **{**kwargs, **timm_kwargs})


def hybrid_resnet(stages: tuple[int, ...], in_chans: int, device=None) -> ResNetV2:
    """The ResNet of a hybrid ViT (R50+B/16): stages of bottleneck blocks, no head, weight-standardised
    convolutions with TF "same" padding, as timm builds it for `vit_base_r50_s16_224` (with a private
    helper; `ResNetV2` itself is public), so the weights and parameter names are timm's."""
    conv = partial(StdConv2dSame, eps=1e-8)
    return ResNetV2(
        layers=stages, num_classes=0, global_pool="", in_chans=in_chans, preact=False, stem_type="same",
        conv_layer=conv, device=device,
    )  # fmt: skip


@dataclass
class ViTConfig:
    """What a task needs to build its backbone, as plain values: LightningCLI exposes each field
    (`--model.backbone.variant S/16`), and checkpoints store it as hyperparameters, so a backbone can
    be rebuilt from any ssl-vit checkpoint."""

    variant: str = "B/16"
    img_size: int = 224
    pooling: Literal["cls", "gap"] = "cls"
    width: int | None = None
    depth: int | None = None
    heads: int | None = None
    mlp_dim: int | None = None
    # Input bands (timm's `in_chans`): 3 for RGB; a multispectral data module's `channels` (the fit CLI
    # links them). Part of the architecture: RGB weights adapt to other counts (`ssl_vit.checkpoints`).
    in_chans: int = 3
    drop_path_rate: float = 0.0
    # Activation checkpointing (timm's `set_grad_checkpointing`): every block's activations are
    # recomputed in the backward instead of kept, about a third more compute for a fraction of the
    # memory; for the large variants' batches. Not part of the architecture: any checkpoint loads.
    grad_checkpointing: bool = False

    def build(self) -> ViT:
        fields = asdict(self)
        checkpointing = fields.pop("grad_checkpointing")
        vit = build_vit(fields.pop("variant"), fields.pop("img_size"), **fields)
        vit.set_grad_checkpointing(checkpointing)
        return vit

    @classmethod
    def from_dict(cls, values: object, where: str) -> ViTConfig:
        """A checked ViTConfig from plain values (a suite's `backbone:`, a checkpoint's saved config).

        Every problem is one line (`BadValue`) naming `where`, the key and what it should be."""
        known = [f.name for f in dataclass_fields(cls)]
        if not isinstance(values, dict):
            raise BadValue(
                f"{where} is a {type(values).__name__}, not a mapping of backbone fields: "
                f"give keys among {', '.join(known)}"
            )
        unknown = sorted(str(k) for k in values if k not in known)
        if unknown:
            raise BadValue(f"{where}: unknown keys {unknown}: valid keys are {', '.join(known)}")
        config = cls(**values)
        if not isinstance(config.variant, str):
            raise BadValue(f"{where}: variant is {config.variant!r}, not a string: give e.g. 'S/16'")
        try:
            parse_variant(config.variant)
        except BadValue as err:
            raise BadValue(f"{where}: {err}") from None
        for key in ("img_size", "width", "depth", "heads", "mlp_dim", "in_chans"):
            value = getattr(config, key)
            if (value is not None or key in ("img_size", "in_chans")) and (
                not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_SIZE
            ):
                raise BadValue(
                    f"{where}: {key} is {shown(value)}: it should be a positive integer of at most "
                    f"{MAX_SIZE:,}"
                )
        if config.pooling not in ("cls", "gap"):
            raise BadValue(f"{where}: pooling is {config.pooling!r}: it should be 'cls' or 'gap'")
        if not isinstance(config.grad_checkpointing, bool):
            value = config.grad_checkpointing
            raise BadValue(f"{where}: grad_checkpointing is {shown(value)}: it should be true or false")
        rate = config.drop_path_rate
        if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not 0 <= rate < 1:
            raise BadValue(f"{where}: drop_path_rate is {rate!r}: it should be a number in [0, 1)")
        return config
