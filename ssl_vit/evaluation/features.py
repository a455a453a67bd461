"""Frozen features of a backbone over an exact pass of a dataset, for the frozen-backbone protocols.

Under `torch.distributed` every rank extracts its own share of an exact pass, and all ranks return
the features of all samples, sorted by key, so the result does not depend on the world size.

Legend: B batch, N samples, T tokens, D width, F feature width, H x W mask pixels.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from ssl_vit.models.vit import FeatureKind, ViT


def local_device() -> torch.device:
    """Where this process extracts: its own GPU under torchrun (cuda:LOCAL_RANK; cuda:0 alone), else
    the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


class Features(NamedTuple):
    x: Tensor  # (N, F) float32, on CPU; (N, T, F) for token kinds
    y: Tensor  # (N,) int64 labels, -1 where unlabelled
    keys: list[str]  # the samples' __key__, sorted
    mask: Tensor | None = None  # (N, H, W) uint8 segmentation masks (255 ignored), when the samples have them

    def take(self, rows: Tensor) -> Features:
        """The samples at positions `rows` (n,), in that order."""
        mask = None if self.mask is None else self.mask[rows]
        return Features(self.x[rows], self.y[rows], [self.keys[i] for i in rows.tolist()], mask)


def extract_features(
    backbone: ViT,
    loader: Iterable[dict],
    feature: FeatureKind = "cls",
    last_k: int = 4,
    prepare: Callable[[dict], dict] | None = None,
) -> Features:
    """Run `backbone` in eval mode without gradients over `loader` and collect one feature per sample.

    loader: yields batch dicts with `image` (B, C, H, W), `label` (B,) int64, `key` list[str]; under
        `torch.distributed`, each rank's loader must be its own share of an exact pass (each sample on
        exactly one rank), such as `ShardDataModule.exact_dataloader`.
    prepare: applied to each batch, on the backbone's device, before the forward pass: typically
        `ShardDataModule.prepare_batch`, which turns the loaders' uint8 images into normalised floats.
        Without it, images must already be floats.
    Returns Features with x (N, F): F = D for `cls`/`mean`, last_k * D for `lastk`.
    """
    return extract_feature_set(backbone, loader, (feature,), last_k, prepare)[feature]


def extract_feature_set(
    backbone: ViT,
    loader: Iterable[dict],
    kinds: tuple[str, ...],
    last_k: int = 4,
    prepare: Callable[[dict], dict] | None = None,
    on_batch: Callable[[int], None] | None = None,
) -> dict[str, Features]:
    """`extract_features` for several kinds from one pass over `loader` (one forward per batch,
    `ViT.feature_set`): {kind: Features}, equal to separate passes, sharing labels, keys and the
    batches' segmentation masks (`mask`, when they carry one). `on_batch(n)` is called after each batch
    of n images (a progress display)."""
    if not kinds:
        raise ValueError("kinds is empty: name at least one feature kind")
    for kind in kinds:
        backbone.check_feature(kind, last_k)
    device = next(backbone.parameters()).device
    was_training = backbone.training
    backbone.eval()
    xs: dict[str, list[Tensor]] = {kind: [] for kind in kinds}
    ys, keys, masks = [], [], []
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
                for kind, x in backbone.feature_set(images, kinds, last_k).items():
                    xs[kind].append(x.float().cpu())
                ys.append(batch["label"].cpu())
                keys.extend(batch["key"])
                # None where a batch has none: shards without a manifest may mix samples with and without
                masks.append(batch["mask"].cpu() if "mask" in batch else None)
                if on_batch is not None:
                    on_batch(len(batch["key"]))
    finally:
        backbone.train(was_training)
    if dist.is_available() and dist.is_initialized():
        xs, ys, keys, masks = _gather(xs, ys, keys, masks)
    if not keys:
        raise ValueError("the loader yielded no samples")
    order = sorted(range(len(keys)), key=keys.__getitem__)
    y, sorted_keys = torch.cat(ys)[order], [keys[i] for i in order]
    mask = _masks(masks, ys)[order] if any(m is not None for m in masks) else None
    return {kind: Features(torch.cat(xs[kind])[order], y, sorted_keys, mask) for kind in kinds}


def _masks(masks: list[Tensor | None], ys: list[Tensor]) -> Tensor:
    """The batches' masks (B, H, W) as one (N, H, W), a batch without masks all ignored (255), as the
    stream fills the masks a batch with some lacks."""
    shape = next(m for m in masks if m is not None).shape[1:]
    return torch.cat(
        [
            m if m is not None else torch.full((len(y), *shape), 255, dtype=torch.uint8)
            for m, y in zip(masks, ys)
        ]
    )


def _gather(
    xs: dict[str, list[Tensor]], ys: list[Tensor], keys: list[str], masks: list[Tensor]
) -> tuple[dict[str, list[Tensor]], list[Tensor], list[str], list[Tensor]]:
    """Every rank's features to every rank. `all_gather_object` pickles through the process group:
    evaluation sets are small (10^4-10^5 features of a few KB), and unlike `all_gather` it takes a
    different sample count on each rank, which an exact pass produces when shards are uneven."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (xs, ys, keys, masks))
    return (
        {kind: [x for g in gathered for x in g[0][kind]] for kind in xs},
        [y for g in gathered for y in g[1]],
        [k for g in gathered for k in g[2]],
        [m for g in gathered for m in g[3]],
    )
