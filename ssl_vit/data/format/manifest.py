"""The manifest beside a split's shards (`{split}.json`, written by `ssl-vit data convert`, described in
data/README.md): where it is, reading it, checking every key a reader relies on, and what a data module
decides from it (`Manifests`, read once each; the epoch size, the eval view, the bands, the labels).

Every reader (the data module, `data inspect`, `wds:` and `mosaic:` sources, `bench feed`) reads it
through `read_manifest`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Literal
from urllib.parse import urlparse

from ssl_vit.data.format.arrays import ARRAY_DTYPES
from ssl_vit.data.format.masks import IGNORE_INDEX
from ssl_vit.data.format.members import MAX_CLASSES, Bands
from ssl_vit.errors import UserError, shown
from ssl_vit.storage import remote
from ssl_vit.storage.remote import DEFAULT, ReadPolicy, local_path, without_url

BAND_STATS_KEYS = ("mean", "std", "min", "max")
_FIX = "fix the file or re-run `ssl-vit data convert`"
_MISSING = object()
EvalView = Literal["whole", "crop"]  # how `eval` frames an image (`eval_view`)


def manifest_url(shard_url: str) -> str | None:
    """The URL of the manifest `{split}.json` next to a shard named `{split}-NNNNNN.tar`, or None
    for other names and `pipe:` URLs."""
    match = re.match(r"^(.*)-\d+\.tar$", shard_url)
    if not match or urlparse(shard_url).scheme == "pipe":
        return None
    return match.group(1) + ".json"


def read_manifest(first_url: str, policy: ReadPolicy = DEFAULT) -> dict | None:
    """The manifest `{split}.json` next to shards named `{split}-NNNNNN.tar`, or None if there is none
    (no such file; HTTP 404 or 410; no such object).

    A manifest that exists but cannot be read (a server error or a timeout after `policy`'s retries, a
    refused connection, a permission) is a UserError naming it, never "no manifest": the readers size
    epochs, count classes and choose the eval view from it. So is one that is not JSON, or whose keys
    have the wrong types (naming the file and the key)."""
    url = manifest_url(first_url)
    if url is None:
        return None
    path = local_path(url)
    try:
        if path is not None:
            if not path.is_file():
                return None
            text = path.read_bytes()
        else:
            text = remote.read_url(url, policy)
    except remote.Missing:
        return None
    except (OSError, ImportError, ValueError) as err:
        reason = (
            without_url(err, url) if isinstance(err, remote.ReadFailed) else f"{type(err).__name__}: {err}"
        )
        raise UserError(
            f"manifest {url} exists but cannot be read ({reason}): fix the server or the file, or raise "
            "data.init_args.limits.read_retries / read_timeout_s"
        ) from None
    try:
        manifest = json.loads(text)
    except (ValueError, RecursionError) as err:  # RecursionError: nested deeper than the parser goes
        raise UserError(
            f"manifest {url} is not JSON ({err}): re-run `ssl-vit data convert`, or delete it and set "
            "data.init_args.train_batches and num_classes"
        ) from None
    check_manifest(manifest, url)
    return manifest


def check_manifest(manifest: object, where: str) -> None:
    """Raise a one-line UserError naming `where` and the key when `manifest` does not have the types
    data/README.md documents (the keys ssl-vit reads are required; the others are checked when present)."""
    if not isinstance(manifest, dict):
        raise UserError(f"manifest {where} is a JSON {type(manifest).__name__}, not an object: {_FIX}")

    def bad(key: str, should: str, element: str = "", value: object = _MISSING) -> UserError:
        value = manifest.get(key, _MISSING) if value is _MISSING else value
        text = "missing" if value is _MISSING else shown(value)
        return UserError(f"manifest {where}: {key!r}{element} is {text}, it should be {should}: {_FIX}")

    for check in (_check_scalars, _check_classes, _check_shards, _check_bands):
        check(manifest, bad)


def _count(value: object) -> bool:
    """A non-negative JSON integer that most readers hold exactly (at most 2^53)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 2**53


_Bad = Callable[..., UserError]


def _check_scalars(manifest: dict, bad: _Bad) -> None:
    """The counts, flags and strings: `num_samples`, `num_classes` (required), `masks`, `version`,
    `skipped`, `source`, `split`, `image_format`, `image_size`."""
    for key in ("num_samples", "num_classes"):
        if not _count(manifest.get(key)):
            raise bad(key, "a non-negative integer")
    if manifest["num_classes"] > MAX_CLASSES:
        raise bad("num_classes", f"at most {MAX_CLASSES:,}")
    if "masks" in manifest and not isinstance(manifest["masks"], bool):
        raise bad("masks", "true or false")
    for key in ("version", "skipped", "order_seed"):
        if key in manifest and not _count(manifest[key]):
            raise bad(key, "a non-negative integer")
    for key in ("source", "split", "image_format", "order"):
        if key in manifest and not isinstance(manifest[key], str):
            raise bad(key, "a string")
    size = manifest.get("image_size")
    if size is not None and not (isinstance(size, list) and len(size) == 2 and all(map(_count, size))):
        raise bad("image_size", "[height, width] or null")


def _check_classes(manifest: dict, bad: _Bad) -> None:
    """`class_names`, and the per-class counts `class_counts` and `mask_pixels`."""
    names = manifest.get("class_names", [])
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise bad("class_names", "a list of strings")
    for key, example in (("class_counts", '{"0": 150, "1": 148}'), ("mask_pixels", '{"0": 9000, "255": 12}')):
        counts = manifest.get(key, {})
        if not isinstance(counts, dict):
            raise bad(key, f"an object of class -> count, such as {example}")
        for label, n in counts.items():
            if not re.fullmatch(r"-?[0-9]{1,20}", label):
                raise bad(key, f'keyed by classes such as "0" or "-1", not {label[:40]!r}')
            if not _count(n):
                raise bad(key, "a non-negative integer", f"[{label!r}]", n)


def _check_shards(manifest: dict, bad: _Bad) -> None:
    shards = manifest.get("shards")
    shard = '{"url": NAME, "num_samples": COUNT}'
    if not isinstance(shards, list):
        raise bad("shards", f"a list of {shard}")
    for i, entry in enumerate(shards):
        if not (
            isinstance(entry, dict) and isinstance(entry.get("url"), str) and _count(entry.get("num_samples"))
        ):
            raise bad("shards", shard, f"[{i}]", entry)


def _check_bands(manifest: dict, bad: _Bad) -> None:
    """The keys of the images' bands, when present: `channels`, `dtype`, `band_names`, `band_stats`."""
    channels = manifest.get("channels")
    if channels is not None and not (_count(channels) and channels > 0):
        raise bad("channels", "a positive integer")
    if "dtype" in manifest and manifest["dtype"] not in ARRAY_DTYPES:
        raise bad("dtype", f"one of {', '.join(ARRAY_DTYPES)}")
    names = manifest.get("band_names")
    if names is not None and not (
        isinstance(names, list) and all(isinstance(n, str) for n in names) and len(names) == channels
    ):
        raise bad("band_names", "a list of strings, one per channel")
    stats = manifest.get("band_stats")
    if stats is None:
        return
    per_band = "{" + ", ".join(f'"{k}": [one number per band]' for k in BAND_STATS_KEYS) + ', "images": K}'
    if not isinstance(stats, dict) or not _count(stats.get("images")):
        raise bad("band_stats", per_band)
    for key in BAND_STATS_KEYS:
        values = stats.get(key)
        numbers = isinstance(values, list) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values
        )
        if not numbers or len(values) != (channels or len(values)) or not values:
            raise bad("band_stats", "one finite number per band", f"[{key!r}]", values)


def channel_choices(manifest: dict) -> tuple[int, ...]:
    """The `channels` a data module may read a manifest's images with (none recorded: any): its
    `channels`, and for a grey 8-bit set also 3, which reads grey images as RGB, as it always has."""
    channels = manifest.get("channels")
    if channels is None:
        return ()
    return (1, 3) if channels == 1 and manifest.get("dtype", "uint8") == "uint8" else (channels,)


# --- what a data module decides from a split's manifest --------------------------------------------------


class Manifests:
    """The manifests of a data module's splits, by URL (None: there is none), each read once with
    `policy`. Another data module of the same run may share this object (evaluation's trained protocols,
    the few-shot monitor) so that both decide from one reading: the epoch size, the class count, the
    eval view."""

    def __init__(self, policy: ReadPolicy = DEFAULT) -> None:
        self.policy = policy
        self.read: dict[str, dict | None] = {}

    def of(self, first_url: str) -> dict | None:
        """The manifest beside the shard `first_url` (`read_manifest`)."""
        url = manifest_url(first_url)
        if url is None:
            return None
        if url not in self.read:
            self.read[url] = read_manifest(first_url, self.policy)
        return self.read[url]


def samples_in(manifest: dict | None, urls: list[str]) -> int | None:
    """The samples in the shards `urls` (before any class filter), as their manifest counts them shard by
    shard; None when a shard is not in it or there is none."""
    counts = {
        entry["url"].rsplit("/", 1)[-1]: entry["num_samples"] for entry in (manifest or {}).get("shards", [])
    }
    names = [url.rsplit("/", 1)[-1] for url in urls]
    return sum(counts[name] for name in names) if all(name in counts for name in names) else None


def epoch_samples(manifest: dict | None, first_url: str, classes: list[int] | None) -> int:
    """The training samples an epoch is sized by: the manifest's count, of `classes` when given; one line
    when the shards have no manifest."""
    if manifest is None:
        url = manifest_url(first_url)
        where = (
            f"{url} does not exist"
            if url
            else f"only shards named SPLIT-NNNNNN.tar, not {first_url}, have one beside them: SPLIT.json"
        )
        raise UserError(
            f"train_urls have no manifest ({where}) to size an epoch: set data.init_args.train_batches"
        )
    if classes is None:
        return manifest["num_samples"]
    counts = manifest.get("class_counts", {})
    return sum(counts.get(str(c), 0) for c in classes)


def check_labels(manifest: dict | None, num_classes: int | None) -> None:
    """Labels the manifest counts beyond `num_classes` would fail the first training step (an index
    error in the loss): refused here, before anything runs. A sample whose label is beyond the class
    count anyway is a corrupt sample: the stream skips and counts it. So are mask classes (`mask_pixels`):
    a sample whose mask holds one beyond `num_classes` would be skipped, and with a class count below the
    manifest's, most would."""
    if num_classes is None or manifest is None:
        return
    for what, counts in (
        ("labels", manifest.get("class_counts")),
        ("mask classes", manifest.get("mask_pixels")),
    ):
        values = [int(v) for v in counts or {} if int(v) != IGNORE_INDEX or what == "labels"]
        beyond = sorted(v for v in values if v >= num_classes)
        if beyond:
            raise UserError(
                f"the shards' manifest counts {what} up to {beyond[-1]}, beyond num_classes "
                f"{num_classes}: set data.init_args.num_classes to at least {beyond[-1] + 1} (the "
                "manifest's num_classes), or leave it unset"
            )


def eval_view(manifest: dict | None, image_size: int) -> EvalView:
    """How the `eval` transform frames a split's images: `whole` when its manifest records every image at
    `image_size` x `image_size` (CIFAR-style sets stored at the model's resolution: nothing to resize,
    and a centre crop would only throw the border away); otherwise `crop`, ImageNet's resize to
    `image_size / eval_crop_pct` and centre crop."""
    return "whole" if (manifest or {}).get("image_size") == [image_size, image_size] else "crop"


def bands(manifest: dict | None, split: str, channels: int, randaugment: str | None) -> Bands:
    """What the stream of `split` reads: `channels` bands, of the dtype its manifest records. One line
    when the manifest records another band count (a grey 8-bit set is read as RGB with channels 3), or a
    dtype RandAugment cannot take."""
    manifest = manifest or {}
    dtype, stored = manifest.get("dtype"), manifest.get("channels")
    if stored is not None and channels not in channel_choices(manifest):
        raise UserError(
            f"{split}_urls: their manifest says {stored} channels of {dtype}, data.init_args.channels is "
            f"{channels}: set channels to {stored} (with mean and std per band, or 'auto')"
        )
    if randaugment and dtype not in (None, "uint8"):
        raise UserError(
            f"{split}_urls: their manifest says dtype {dtype}, and randaugment (timm's RandAugment) works on "
            "8-bit RGB images: leave it out (data.init_args.augment.randaugment null)"
        )
    return Bands(channels, dtype)
