"""`FeatureCache`: one exact pass per split of a suite's dataset yields every frozen feature its
protocols read, kept in memory for all of them.

Pooled features (`cls`, `mean`, `lastk`) cost a few KB per image. Token features (`tokens`,
`patches`, `patches_lastk`: what attentive and dense probes read when their augmentation is `eval`)
cost tokens x width x 4 bytes per image: 50 x 96 x 4 = 19 KB for the study's 28 px images, but 197 x 768
x 4 = 605 KB at ImageNet's 224 px on a B/16, 775 GB for its 1.28M training images. A split whose token
cache would take more than `CACHE_SHARE` of the memory free now, or whose size is unknown (no
manifest), is refused before its pass, in one line that names the fix: a training augmentation other
than `eval`, with which the probe runs the frozen backbone on every batch instead of caching (as MAE's
linear probe does on ImageNet).
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import torch

from ssl_vit import memory, progress
from ssl_vit.data import ShardDataModule
from ssl_vit.data.options import grouped
from ssl_vit.errors import UserError
from ssl_vit.evaluation.features import Features, extract_feature_set
from ssl_vit.models.feature import FEATURES
from ssl_vit.models.vit import LAST_K, ViT, ViTConfig

# The share of free memory a split's token cache may take: building it holds the batches, their
# concatenation and the copy in key order at once, about three times the cache itself.
CACHE_SHARE = 0.3


class Index(NamedTuple):
    y: torch.Tensor  # (N,) int64 labels, -1 where unlabelled
    keys: list[str]  # the samples' __key__, sorted


def data_module(data: dict[str, Any], **args: Any) -> ShardDataModule:
    """A ShardDataModule of a suite's data block (`suite_file.DataBlock`, flat as the suite writes it,
    gathered by `ssl_vit.data.options.grouped`): the block's keys but its splits' URLs, then `args` (the
    URLs of the splits it reads among them) over those."""
    block = {key: value for key, value in data.items() if not key.endswith("_urls")}
    return ShardDataModule(**grouped({**block, **args}))


def with_normalisation(data: dict[str, Any], datamodule: ShardDataModule) -> dict[str, Any]:
    """A data block with its `mean` and `std` as `datamodule` (its own) resolved them: `auto` becomes
    the band statistics of the manifest of its first split, the training split's. Data modules built
    for one split alone (a scoring pass over the test split, a trained protocol's training split,
    compare's attention images) then normalise every split alike, as the frozen features are."""
    return {**data, "mean": list(datamodule.mean), "std": list(datamodule.std)}


class FeatureCache:
    """Frozen features of a dataset's splits (train, test, and val when the data block gives
    `val_urls`): every kind the suite reads from one pass over each split (`extract_feature_set`), made
    the first time a split is asked for. `backbone` is the checkpoint's at the dataset's image size
    (`config`, `suite.dataset_backbone`)."""

    def __init__(
        self, backbone: ViT, config: ViTConfig, data: dict[str, Any], kinds: tuple[str, ...]
    ) -> None:
        self.backbone, self.config = backbone, config
        self.kinds = tuple(kinds)
        self.datamodule = self.datamodule_of(data)
        self.data = with_normalisation(data, self.datamodule)
        self._cache: dict[str, dict[str, Features]] = {}
        self._index: dict[str, Index] = {}  # labels and keys of splits read without features

    @staticmethod
    def datamodule_of(data: dict[str, Any]) -> ShardDataModule:
        """A data module of a suite's data block, for exact passes (no training epoch to size)."""
        return data_module(
            data,
            train_urls=data["train_urls"],
            val_urls=data.get("val_urls"),
            test_urls=data["test_urls"],
            train_batches=1,  # exact passes only: no training epoch to size from a manifest
        )

    def normalisation(self) -> dict[str, tuple[float, ...]]:
        """The data's per-band `mean` and `std` (`with_normalisation`), for the tasks a protocol trains."""
        return {"mean": tuple(self.datamodule.mean), "std": tuple(self.datamodule.std)}

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
            _check_unique_keys(next(iter(self._cache[split].values())).keys, split)
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
            _check_unique_keys(self._index[split].keys, split)
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
        if not self.kinds:  # labels only: a segmentation's classes are its masks', which need a manifest
            found = int(self.labels("train").max()) + 1
            if found < 2:
                raise UserError(
                    f"{self.data['train_urls']} have no manifest to count the classes by: give num_classes "
                    "in the suite's data block"
                )
            return found
        train = self.get("train", self.kinds[0])
        return int(max(train.y.max(), -1 if train.mask is None else _mask_max(train.mask))) + 1

    def eval_views(self) -> dict[str, str]:
        """How the eval transform framed each split: the data module chooses once per split, from the
        manifest as it read it once, so this is the view every pass over the split used."""
        return {split: self.datamodule.eval_view(split) for split in self.splits()}

    def token_bytes(self) -> int:
        """Bytes of the token kinds this cache holds per image (float32), and of a mask (uint8, at the
        image size) where the split has masks: 0 without token kinds."""
        vit = self.backbone
        sizes = [
            FEATURES[kind].size(vit.patch_embed.num_patches, vit.num_prefix_tokens, vit.embed_dim, LAST_K)
            for kind in self.kinds
            if not FEATURES[kind].pooled
        ]
        found = 4 * sum(tokens * width for tokens, width in sizes)
        return found + (self.datamodule.image_size**2 if found and self.datamodule.has_masks("train") else 0)

    def _check_memory(self, split: str) -> None:
        """The refusal before the pass (the module's docstring), its size from the manifest's image count,
        against this process's share of the memory the host can give now (the ranks of a node share it)."""
        per_image = self.token_bytes()
        if not per_image:
            return
        images = self.datamodule.samples_in(split)
        fix = (
            "give the token protocols on this data an augmentation other than 'eval' (the frozen backbone "
            "then runs on every batch, nothing is cached)"
        )
        if images is None:
            raise UserError(f"{split}_urls have no manifest to size the token cache of 'eval' by: {fix}")
        need = images * per_image
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        free = memory.host_available() / ranks
        if need > CACHE_SHARE * free:
            raise UserError(
                f"caching the tokens of the {images} images of {split}_urls takes {need / 2**30:.1f} GiB, "
                f"more than {CACHE_SHARE:.0%} of the {free / 2**30:.1f} GiB this process can have "
                f"(building it holds about 3 copies): {fix}, or fewer images"
            )


def _check_unique_keys(keys: list[str], split: str) -> None:
    """One line when two samples of a split share a key (`keys` sorted): the protocols pair images, and
    hold some out for choosing, by key."""
    repeated = next((a for a, b in zip(keys, keys[1:]) if a == b), None)
    if repeated is not None:
        raise UserError(
            f"two samples of {split}_urls share the key {repeated!r}: keys must be unique within a split "
            "(the protocols pair and hold out images by key); re-shard with `ssl-vit data convert wds:`"
        )


def _mask_max(masks: torch.Tensor) -> int:
    """The largest class in uint8 masks, 255 (ignored) left out; -1 when every pixel is ignored."""
    labelled = masks[masks != 255]
    return int(labelled.max()) if labelled.numel() else -1
