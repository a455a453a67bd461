"""Whether a protocol asks a question its data can answer: `classes` that name two classes or more,
each with images in the train and the test split, and a train and test split with something labelled to
train on and score (a labelled image; a segmentation's labelled pixel).

Checked from the split's manifest where it tells, before anything runs (`check_scorable`; of local
shards: a remote manifest is read once, by the evaluation), else from the labels of the pass the protocol
reads anyway, before it trains or scores (`check_classes_seen`). Before, a protocol of one class, or of a
class the data lack, scored 1.0 for a question never asked, and a test split without a labelled pixel an
mIoU of NaN."""

from __future__ import annotations

from typing import Any

from ssl_vit.data import ShardDataModule
from ssl_vit.data.format.masks import IGNORE_INDEX
from ssl_vit.data.stream.urls import local
from ssl_vit.errors import NoUsableData, UserError
from ssl_vit.evaluation.cache import FeatureCache
from ssl_vit.evaluation.protocol import Protocol


def check_classes(protocol: Protocol, data: dict[str, Any], where: str) -> None:
    """When the suite loads: a protocol's `classes` name two classes or more, each once, below the data
    block's num_classes: one class makes every answer right (k-NN and the probes scored 1.0)."""
    classes = protocol.classes
    if classes is None:
        return
    if len(set(classes)) != len(classes):
        raise UserError(f"{where}: classes {classes} repeat a class: name each once")
    if len(classes) < 2:
        raise UserError(
            f"{where}: classes {classes} names one class, and a classification among one class is always "
            "right: give two or more, or leave classes out for every class"
        )
    num_classes = data.get("num_classes")
    beyond = [c for c in classes if isinstance(num_classes, int) and c >= num_classes]
    if beyond:
        raise UserError(f"{where}: classes {beyond} are beyond the data's num_classes {num_classes}")


def check_scorable(protocol: Protocol, datamodule: ShardDataModule, dataset: str, where: str) -> None:
    """Before anything runs, from the manifests of the protocol's train and test splits (local ones):
    its classes each have images there, and each split holds something labelled."""
    if not (local(datamodule.train_urls) and local(datamodule.test_urls)):
        return  # `check_classes_seen` reads them as the evaluation does
    for split in ("train", "test"):
        if protocol.classes is not None:
            found = classes_in_manifest(protocol.classes, datamodule, split)
            if found is not None:
                _refuse_missing(protocol, split, *found, where)
        if nothing_labelled(protocol, datamodule, split):
            what, key = ("pixel", "mask_pixels") if protocol.TARGET == "mask" else ("image", "class_counts")
            use = "train on" if split == "train" else "score"
            raise NoUsableData(
                f"{where}: the {split} shards of {dataset} hold no labelled {what} (their manifest's {key}): "
                f"nothing to {use}; give {split} shards with labels"
            )


def classes_in_manifest(
    classes: list[int], datamodule: ShardDataModule, split: str
) -> tuple[list[int], str] | None:
    """`(classes of `classes` the split holds no image of, how that is known)` from the split's manifest:
    a class at or beyond its class count, or one its per-class counts miss where the split's URLs are
    the whole of it; None where the manifest cannot tell (none, or a part of its shards)."""
    manifest = datamodule.split_manifest(split)
    if manifest is None:
        return None
    beyond = [c for c in classes if c >= manifest["num_classes"]]
    if beyond:
        return beyond, f"their manifest counts {manifest['num_classes']} classes"
    counts = manifest.get("class_counts")
    if not counts or datamodule.samples_in(split) != manifest["num_samples"]:
        return None
    return [c for c in classes if not counts.get(str(c))], "their manifest's class_counts"


def nothing_labelled(protocol: Protocol, datamodule: ShardDataModule, split: str) -> bool:
    """Whether the split's manifest says it holds nothing the protocol is scored on: no pixel of a class
    (`mask_pixels`: every one 255, ignored) for a segmentation, no labelled image (`class_counts`: only
    -1) for a classification. False where it cannot tell (no manifest, no counts, part of its shards)."""
    manifest = datamodule.split_manifest(split)
    key = "mask_pixels" if protocol.TARGET == "mask" else "class_counts"
    counts = (manifest or {}).get(key)
    if not counts or datamodule.samples_in(split) != manifest["num_samples"]:
        return False
    empty = str(IGNORE_INDEX) if protocol.TARGET == "mask" else "-1"
    return not any(n for c, n in counts.items() if c != empty)


def check_classes_seen(protocol: Protocol, features: FeatureCache, where: str) -> None:
    """Before a protocol runs: its `classes` each have an image in the train and the test split, from the
    manifests as the evaluation read them where they tell, else from the labels of the pass the protocol
    reads anyway (its frozen features', or the labels-only pass of a trained protocol)."""
    if protocol.classes is None:
        return
    for split in ("train", "test"):
        found = classes_in_manifest(protocol.classes, features.datamodule, split)
        if found is None:
            read = protocol.cache_kinds()
            labels = features.get(split, read[0]).y if read else features.labels(split)
            present = set(labels.unique().tolist())
            found = (
                [c for c in protocol.classes if c not in present],
                f"none among their {len(labels)} images",
            )
        _refuse_missing(protocol, split, *found, where)


def _refuse_missing(protocol: Protocol, split: str, missing: list[int], how: str, where: str) -> None:
    if missing:
        raise NoUsableData(
            f"{where}: classes {protocol.classes}: {split}_urls hold no image of class "
            f"{', '.join(map(str, missing))} ({how}): give classes the data have"
        )
