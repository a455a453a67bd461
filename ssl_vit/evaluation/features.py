"""Frozen features of a backbone over an exact pass of a dataset, for the few-shot, k-NN and
linear-probe protocols.

Feature kinds (which token is an explicit, logged choice; SSL papers differ on it):
- `cls`: the [class] token after the final norm (ViT paper; MAE's linear probe).
- `mean`: the mean of the patch tokens after the final norm. For global-average-pooling backbones timm
  normalises after pooling instead (`fc_norm`), so this is exactly what their head sees.
- `lastk`: the pooled token ([class] token, or normalised mean patch token for GAP backbones) of each
  of the last k blocks, each through the final norm, concatenated: DINO's linear evaluation
  ("concatenation of the [class] tokens of the last 4 blocks", `eval_linear.py`, n_last_blocks=4).

Under `torch.distributed` every rank extracts its own share of an exact pass, and all ranks return
the features of all samples, sorted by key, so the result does not depend on the world size.

Legend: B batch, N samples, P prefix ([class]) tokens, T tokens (P + patches), D width, F feature width.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Literal, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from ssl_vit.models.vit import ViT

FeatureKind = Literal["cls", "mean", "lastk"]


class Features(NamedTuple):
    x: Tensor  # (N, F) float32, on CPU
    y: Tensor  # (N,) int64 labels, -1 where unlabelled
    keys: list[str]  # the samples' __key__, sorted


def extract_features(
    backbone: ViT,
    loader: Iterable[dict],
    feature: FeatureKind = "cls",
    last_k: int = 4,
    prepare: Callable[[dict], dict] | None = None,
) -> Features:
    """Run `backbone` in eval mode without gradients over `loader` and collect one feature per sample.

    loader: yields batch dicts with `image` (B, 3, H, W), `label` (B,) int64, `key` list[str]; under
        `torch.distributed`, each rank's loader must be its own share of an exact pass (each sample on
        exactly one rank), such as `ShardDataModule.exact_dataloader`.
    prepare: applied to each batch, on the backbone's device, before the forward pass: typically
        `ShardDataModule.prepare_batch`, which turns the loaders' uint8 images into normalised floats.
        Without it, images must already be floats.
    Returns Features with x (N, F): F = D for `cls`/`mean`, last_k * D for `lastk`.
    """
    if feature not in ("cls", "mean", "lastk"):
        raise ValueError(f"unknown feature {feature!r}; valid: 'cls', 'mean', 'lastk'")
    if feature == "cls" and backbone.cls_token is None:
        raise ValueError(
            "feature 'cls' needs a [class] token, but this backbone pools by global average; "
            "use feature 'mean' or 'lastk'"
        )
    if feature == "lastk" and not 1 <= last_k <= len(backbone.blocks):
        raise ValueError(
            f"last_k must be in [1, {len(backbone.blocks)}] (the backbone's depth), got {last_k}"
        )
    device = next(backbone.parameters()).device
    was_training = backbone.training
    backbone.eval()
    xs, ys, keys = [], [], []
    try:
        with torch.inference_mode():
            for batch in loader:
                # to the device first: `prepare` converts uint8 images there, moving 4x fewer bytes
                batch = {**batch, "image": batch["image"].to(device, non_blocking=True)}
                if prepare is not None:
                    batch = prepare(batch)
                images = batch["image"]
                if not images.is_floating_point():
                    raise ValueError(
                        f"images are {images.dtype}, not normalised floats: pass the datamodule's "
                        "`prepare_batch` as `prepare`"
                    )
                xs.append(_features(backbone, images, feature, last_k).float().cpu())
                ys.append(batch["label"].cpu())
                keys.extend(batch["key"])
    finally:
        backbone.train(was_training)
    if dist.is_available() and dist.is_initialized():
        xs, ys, keys = _gather(xs, ys, keys)
    if not keys:
        raise ValueError("the loader yielded no samples")
    order = sorted(range(len(keys)), key=keys.__getitem__)
    x, y = torch.cat(xs), torch.cat(ys)
    return Features(x[order], y[order], [keys[i] for i in order])


def _features(backbone: ViT, images: Tensor, feature: FeatureKind, last_k: int) -> Tensor:
    """images: (B, 3, H, W) -> (B, F)."""
    if feature == "cls":
        return backbone.forward_tokens(images).cls
    if feature == "mean":
        tokens = backbone.forward_tokens(images)
        # [class]-token models normalise every token (`norm`); GAP models normalise the mean (`fc_norm`),
        # which timm's head computes as `pooled`.
        return tokens.patches.mean(1) if backbone.cls_token is not None else tokens.pooled
    # timm's forward_intermediates returns the last k blocks' outputs, un-normalised and split into
    # (patches, prefix) pairs when there is a [class] token; forward_head(norm(.)) then pools each
    # exactly as the final layer's `pooled` is (token or fc_norm(mean)), so lastk with k=1 == pooled.
    blocks = backbone.forward_intermediates(
        images, indices=last_k, output_fmt="NLC", intermediates_only=True, return_prefix_tokens=True
    )
    pooled = []
    for out in blocks:
        tokens = torch.cat([out[1], out[0]], dim=1) if isinstance(out, tuple) else out  # (B, T, D)
        pooled.append(backbone.forward_head(backbone.norm(tokens), pre_logits=True))
    return torch.cat(pooled, dim=1)  # (B, last_k * D)


def _gather(
    xs: list[Tensor], ys: list[Tensor], keys: list[str]
) -> tuple[list[Tensor], list[Tensor], list[str]]:
    """Every rank's features to every rank. `all_gather_object` pickles through the process group:
    evaluation sets are small (10^4-10^5 features of a few KB), and unlike `all_gather` it takes a
    different sample count on each rank, which an exact pass produces when shards are uneven."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (xs, ys, keys))
    return (
        [x for g in gathered for x in g[0]],
        [y for g in gathered for y in g[1]],
        [k for g in gathered for k in g[2]],
    )
