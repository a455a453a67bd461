"""Checks of a data module's arguments, usable before anything heavy is imported (the CLI before the
trainer starts, suite files, checkpoint I/O): split URLs, counts, seconds, the read policy."""

from __future__ import annotations

from typing import Any

from ssl_vit.data.stream.urls import check_urls, expand
from ssl_vit.errors import UserError, check_count, check_positive_seconds
from ssl_vit.storage.remote import MAX_RETRIES, ReadPolicy, checked_policy

SPLITS = ("train", "val", "test")
# The split each stage cannot run without.
REQUIRED_SPLIT = {"fit": "train", "validate": "val", "test": "test"}
# The splits each stage reads.
STAGE_SPLITS = {"fit": ["train", "val"], "validate": ["val"], "test": ["test"], None: list(SPLITS)}


def check_required_urls(stage: str | None, urls: dict[str, Any]) -> None:
    """One line if the split `stage` reads has no URLs. `urls`: `train_urls`, `val_urls`, `test_urls` as
    configured (a datamodule's own, or the command line's, checked before the trainer starts)."""
    split = REQUIRED_SPLIT.get(stage)
    if split is not None and f"{split}_urls" in urls and urls[f"{split}_urls"] is None:
        raise UserError(
            f"{split}_urls is not set: give the URLs of the {split} shards (data.init_args.{split}_urls)"
        )


def check_shard_urls(
    stage: str | None, urls: dict[str, Any], policy: ReadPolicy | None = None
) -> dict[str, list[str]]:
    """The brace-expanded URLs of the splits `stage` reads, each shard checked (`check_urls`, remote ones
    with `policy`; by default the one of `urls`' `limits`, a data module's arguments as a dict, see
    `read_policy`): one line for a split without URLs or a shard that is missing. `urls` as for
    `check_required_urls`."""
    check_required_urls(stage, urls)
    policy = policy or read_policy(urls.get("limits") or {})
    expanded = {}
    for split in STAGE_SPLITS.get(stage, []):
        if urls.get(f"{split}_urls") is not None:
            expanded[split] = expand(urls[f"{split}_urls"], f"{split}_urls")
            check_urls(expanded[split], f"{split}_urls", policy)
    return expanded


def read_policy(args: dict[str, Any]) -> ReadPolicy:
    """The `ReadPolicy` of a data module's arguments (`read_retries`, `read_timeout_s`; the defaults
    for those `args` leaves out), checked first (`checked_policy`)."""
    return checked_policy(args.get("read_retries"), args.get("read_timeout_s"))


# The integer settings of a `ShardDataModule` and their smallest values (None: the default applies).
COUNT_MINIMUMS = {
    "batch_size": 1, "image_size": 1, "num_workers": 0, "segment_shards": 1, "train_batches": 1,
    "num_classes": 1, "seed": 0, "read_retries": 0, "max_image_pixels": 1, "channels": 1, "shuffle_buffer": 0,
}  # fmt: skip
# The largest values of those that size memory, processes or work before anything is read: beyond them
# a value is a mistake (a typo, a number pasted into the wrong key), not a setting; 65,536 px is 3x
# the largest ViT input trained, 1,024 workers 4x the cores of the largest node.
COUNT_MAXIMUMS = {
    "image_size": 1 << 16,
    "num_workers": 1 << 10,
    "segment_shards": 1 << 20,
    "read_retries": MAX_RETRIES,
}


def check_counts(values: dict[str, Any]) -> None:
    """One line for an integer setting (`COUNT_MINIMUMS`) that is not an integer, is too small or too
    large (`COUNT_MAXIMUMS`)."""
    for key, value in values.items():
        check_count(key, value, COUNT_MINIMUMS[key], COUNT_MAXIMUMS.get(key))


def check_seconds(values: dict[str, Any]) -> None:
    """One line for a setting in seconds that is not a positive, finite number (None: the default applies)."""
    for key, value in values.items():
        check_positive_seconds(key, value)
