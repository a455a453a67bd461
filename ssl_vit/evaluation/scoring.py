"""Per-image statistics of trained candidates on a split: from cached frozen features, or from a pass
of the images through the model (the frozen backbone of a probe whose features are not cached, or a
fine-tuned model). Every statistic is in key order, the images of the protocol's classes, so that two
checkpoints, two candidates and two columns are scored on the same images in the same order.

Legend: C candidates, M images, F statistics per image, B batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ssl_vit import progress
from ssl_vit.errors import UserError
from ssl_vit.evaluation.cache import data_module
from ssl_vit.evaluation.features import Features, local_device
from ssl_vit.tasks.frozen_probe import FrozenProbe

if TYPE_CHECKING:
    from ssl_vit.evaluation.cache import FeatureCache


def statistics(
    models: list,
    protocol,
    features: FeatureCache,
    split: str,
    keys: list[str] | None,
    head: int | None = None,
    cached: str | None = None,
) -> Tensor:
    """(C, M, F) per-image statistics (`protocol.statistics`) of every candidate on the images of
    `split` (those with `keys` when given, else all; of the protocol's classes), in key order. The
    candidates are the heads of each model in `models` (one model: a probe's heads; several: one per
    fine-tune); only `head` computes when given (the test split is read by the chosen one only).
    `cached`: the feature kind to read from the cache instead of running the backbone (a probe trained
    on cached features). The models run on this process's device (`local_device`): a Lightning trainer
    leaves the module it trained on the CPU."""
    device = local_device()
    for model in models:
        model.to(device).eval()
    if cached is None:
        return _streamed(models, protocol, features, split, keys, head)
    found = restrict(features.get(split, cached), protocol.classes, keys, protocol.TARGET == "label")
    parts = []
    with torch.inference_mode():
        for start in range(0, len(found.y), protocol.batch_size):
            part = found.take(torch.arange(start, min(start + protocol.batch_size, len(found.y))))
            outputs = _outputs(models, part.x.to(device), head, cached=True)
            parts.append(protocol.statistics(outputs, protocol.targets(part).to(device)).cpu())
    return torch.cat(parts, dim=1)


def _streamed(models, protocol, features: FeatureCache, split, keys, head) -> Tensor:
    data = features.data
    datamodule = data_module(
        data,
        **{f"{split}_urls": data[f"{split}_urls"]},
        classes=protocol.classes,
        train_keys=keys if split == "train" else None,
        train_batches=1,  # an exact pass: no training epoch to size from the manifest
        require_labels=protocol.TARGET == "label",  # unlabelled images have no right answer
    )
    datamodule.manifests = features.datamodule.manifests
    parts, order_keys = [], []
    device = local_device()
    total = len(keys) if keys is not None else datamodule.samples_in(split)
    with torch.inference_mode(), progress.step(f"{protocol.name}: scoring {split}", total) as advance:
        for batch in datamodule.exact_dataloader(split):
            if protocol.TARGET not in batch:
                raise UserError(
                    f"protocol {protocol.name!r}: the images of {split}_urls carry no {protocol.TARGET}: "
                    "give shards written by `ssl-vit data convert` from ade20k:, voc: or mosaic:"
                )
            batch = datamodule.prepare_batch({**batch, "image": batch["image"].to(device)})
            outputs = _outputs(models, batch["image"], head, cached=False)
            parts.append(protocol.statistics(outputs, batch[protocol.TARGET].to(device)).cpu())
            order_keys.extend(batch["key"])
            advance(len(batch["key"]))
    order = sorted(range(len(order_keys)), key=order_keys.__getitem__)
    return torch.cat(parts, dim=1)[:, order]


def _outputs(models: list, inputs: Tensor, head: int | None, cached: bool) -> Tensor:
    """(C, B, ...) the candidates' outputs on a batch of cached features or images (only `head`'s when
    given: one model holds the candidates as heads, or one candidate each)."""
    if len(models) > 1:  # one candidate per model (fine-tunes)
        models = models if head is None else [models[head]]
        return torch.cat([model(inputs)[None] for model in models])
    (model,) = models
    if not isinstance(model, FrozenProbe):  # one fine-tuned model: one candidate
        return model(inputs)[None]
    return model.classify(inputs if cached else model.features(inputs), head)


def restrict(
    found: Features, classes: list[int] | None, keys: list[str] | None = None, labelled: bool = True
) -> Features:
    """The samples of `found` whose label is among `classes` (all when None), when given whose key is
    among `keys`, and with `labelled` whose label is a class at all: an unlabelled image (-1) has no
    right or wrong answer, so every classification leaves it out (`FeatureCache.unlabelled` counts
    them)."""
    keep = class_mask(found.y, classes)
    if labelled:
        keep &= found.y >= 0
    if keys is not None:
        wanted = set(keys)
        keep &= torch.tensor([key in wanted for key in found.keys], dtype=torch.bool)
    return found if bool(keep.all()) else found.take(torch.nonzero(keep).flatten())


def class_mask(labels: Tensor, classes: list[int] | None) -> Tensor:
    return (
        torch.ones_like(labels, dtype=torch.bool)
        if classes is None
        else torch.isin(labels, torch.tensor(classes))
    )
