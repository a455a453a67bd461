"""`FeatureCache`: one exact pass per split of a suite's dataset yields every frozen feature its
protocols read, kept in memory for all of them.

Pooled features (`cls`, `mean`, `lastk`) cost a few KB per image. Token features (`tokens`,
`patches`, `patches_lastk`: what attentive and dense probes read when their augmentation is `eval`)
cost tokens x width x 4 bytes per image: 50 x 96 x 4 = 19 KB for the study's 28 px images, but 197 x 768
x 4 = 605 KB at ImageNet's 224 px on a B/16, 775 GB for its 1.28M training images. A split whose token
cache would take more than half of the memory free now is refused before its pass, in one line that
names the fix: a training augmentation other than `eval`, with which the probe runs the frozen backbone
on every batch instead of caching (as MAE's linear probe does on ImageNet).
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import torch

from ssl_vit.errors import UserError
from ssl_vit.evaluation import progress
from ssl_vit.evaluation.features import Features, extract_feature_set
from ssl_vit.models.vit import TokenKind, ViT, ViTConfig

# ShardDataModule arguments a suite's `data` may set (the rest are the protocols' business).
DATA_KEYS = (
    "image_size", "batch_size", "num_workers", "mean", "std", "eval_crop_pct", "num_classes", "seed",
    "read_retries", "read_timeout_s", "loader_timeout_s", "max_image_pixels",
)  # fmt: skip
LAST_K = 4  # the blocks `lastk` and `patches_lastk` read (DINO's linear evaluation: the last 4)
CACHE_SHARE = 0.5  # the share of free memory a split's token cache may take


class Index(NamedTuple):
    y: torch.Tensor  # (N,) int64 labels, -1 where unlabelled
    keys: list[str]  # the samples' __key__, sorted


def datamodule_args(data: dict[str, Any]) -> dict[str, Any]:
    """The ShardDataModule arguments of a suite's data block (its splits' URLs aside)."""
    return {key: value for key, value in data.items() if key in DATA_KEYS}


class FeatureCache:
    """Frozen features of a dataset's splits (train, test, and val when the data block gives
    `val_urls`): every kind the suite reads from one pass over each split (`extract_feature_set`), made
    the first time a split is asked for. `backbone` is the checkpoint's at the dataset's image size
    (`config`; position embeddings resampled when it differs from the suite's backbone)."""

    def __init__(
        self, backbone: ViT, config: ViTConfig, data: dict[str, Any], kinds: tuple[str, ...]
    ) -> None:
        from ssl_vit.data import ShardDataModule

        self.backbone, self.config, self.data = backbone, config, data
        self.kinds = tuple(kinds)
        self.datamodule = ShardDataModule(
            train_urls=data["train_urls"],
            val_urls=data.get("val_urls"),
            test_urls=data["test_urls"],
            train_batches=1,  # exact passes only: no training epoch to size from a manifest
            **datamodule_args(data),
        )
        self._cache: dict[str, dict[str, Features]] = {}
        self._index: dict[str, Index] = {}  # labels and keys of splits read without features

    @staticmethod
    def manifest_count(data: dict[str, Any]) -> int | None:
        """The training images of a data block as its manifest counts them; None without a manifest."""
        from ssl_vit.data import ShardDataModule

        # train_batches: the count is asked for, not an epoch sized from it
        datamodule = ShardDataModule(train_urls=data["train_urls"], train_batches=1, **datamodule_args(data))
        return datamodule.samples_in("train")

    def get(self, split: str, feature: str) -> Features:
        if feature not in self.kinds:
            raise ValueError(f"feature {feature!r} is not among this cache's kinds {self.kinds}")
        if split not in self._cache:
            self._check_memory(split)
            loader = self.datamodule.exact_dataloader(split)
            with progress.step(f"features of {split}", self.datamodule.samples_in(split)) as advance:
                self._cache[split] = extract_feature_set(
                    self.backbone, loader, self.kinds, LAST_K, self.datamodule.prepare_batch, advance
                )
        return self._cache[split][feature]

    def splits(self) -> tuple[str, ...]:
        """The splits its data block gives."""
        return ("train", "test") if self.datamodule.val_urls is None else ("train", "val", "test")

    def index(self, split: str) -> Index:
        """The labels and keys of a split, in key order: from its features when a protocol read them,
        else from a pass that decodes the images but runs no backbone (a protocol that trains on the
        stream needs only these, and at ImageNet scale a forward pass over the split costs hours)."""
        if split in self._cache:
            found = next(iter(self._cache[split].values()))
            return Index(found.y, found.keys)
        if split not in self._index:
            labels, keys = [], []
            with progress.step(f"labels of {split}", self.datamodule.samples_in(split)) as advance:
                for batch in self.datamodule.exact_dataloader(split):
                    labels.append(batch["label"])
                    keys.extend(batch["key"])
                    advance(len(batch["key"]))
            order = sorted(range(len(keys)), key=keys.__getitem__)
            self._index[split] = Index(torch.cat(labels)[order], [keys[i] for i in order])
        return self._index[split]

    def labels(self, split: str) -> torch.Tensor:
        """Labels of a split (`index`)."""
        return self.index(split).y

    def unlabelled(self) -> dict[str, int]:
        """Per split read so far, its images without a label (-1), where it has some: every
        classification protocol leaves them out."""
        counts = {split: int((self.labels(split) < 0).sum()) for split in [*self._cache, *self._index]}
        return {split: n for split, n in counts.items() if n}

    def num_classes(self) -> int:
        """The manifest's class count, else one more than the largest label (or mask class) of train."""
        found = self.datamodule.num_classes
        if found:
            return found
        if not self.kinds:
            return int(self.labels("train").max()) + 1
        train = self.get("train", self.kinds[0])
        return int(max(train.y.max(), -1 if train.mask is None else _mask_max(train.mask))) + 1

    def eval_views(self) -> dict[str, str]:
        """How the eval transform framed each split: the data module chooses once per split, from the
        manifest as it read it once, so this is the view every pass over the split used."""
        return {split: self.datamodule.eval_view(split) for split in self.splits()}

    def token_bytes(self) -> int:
        """Bytes of the token kinds this cache holds, per image (float32)."""
        tokens, width = self.backbone.patch_embed.num_patches, self.backbone.embed_dim
        per_kind = {
            "tokens": (tokens + self.backbone.num_prefix_tokens) * width,
            "patches": tokens * width,
            "patches_lastk": tokens * width * LAST_K,
        }
        return 4 * sum(per_kind[kind] for kind in self.kinds if kind in TokenKind.__args__)

    def _check_memory(self, split: str) -> None:
        images = self.datamodule.samples_in(split)
        need = (images or 0) * self.token_bytes()
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        if need > CACHE_SHARE * free:
            raise UserError(
                f"caching the tokens of the {images} images of {split}_urls takes {need / 2**30:.1f} GiB, "
                f"more than half of the {free / 2**30:.1f} GiB free: give the token protocols on this data "
                "an augmentation other than 'eval' (the frozen backbone then runs on every batch, nothing "
                "is cached), or fewer images"
            )


def _mask_max(masks: torch.Tensor) -> int:
    """The largest class in uint8 masks, 255 (ignored) left out; -1 when every pixel is ignored."""
    labelled = masks[masks != 255]
    return int(labelled.max()) if labelled.numel() else -1
