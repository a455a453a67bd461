"""The `wds:URLS` source: existing WebDataset shards, re-sharded (another shard size, `--max-side`).

URLS are what the training stream reads (`ssl_vit.data.stream.urls`), read with the same tar reader and
retries (`ssl_vit.data.stream.tar_reader`). Of each sample the first image member among `jpg`, `jpeg`,
`png`, `webp` is kept, its bytes unchanged unless the output format or `--max-side` asks for a new
encoding, under the sample's own key; the label is read as training reads it (`members.parse_label`).
A sample without an image member or with a label that does not parse or is beyond the manifest's
classes, and a shard that cannot be read or breaks off, become `Broken` records, which the writer skips
and counts.

A key is written as a relative name inside the shard: `..` and `.` components and a leading `/` are
dropped (`member_key`), so that no member of a shard written here names a place outside the folder it
is extracted in (`tar -x`); a warning counts the keys that changed.

Class names come from an ssl-vit manifest next to the shards (`{split}.json`) when there is one, else
from the labels seen (`"0"` ... `"K-1"`); the same manifest gives the sample count for the progress ETA.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from ssl_vit.data.convert.encode import ImageBytes
from ssl_vit.data.convert.payload import Broken
from ssl_vit.data.convert.source import SourceKind, register
from ssl_vit.data.format.manifest import read_manifest, samples_in
from ssl_vit.data.format.members import (
    CONVERTIBLE_IMAGES,
    MAX_IMAGE_PIXELS,
    BadSample,
    max_member_bytes,
    parse_label,
)
from ssl_vit.storage.outdir import Input
from ssl_vit.storage.remote import local_path

log = logging.getLogger("ssl_vit.data")


class ShardRecords:
    """The `(payload, label)` records of `urls` in order, read afresh by each iteration. `total` is the
    sample count the manifest gives for exactly these shards, or None; `labelled`, how many of them
    have a label, where the manifest's counts are of exactly these shards, or None; `num_classes`, the
    class count its labels must be below (the manifest's), or None."""

    def __init__(
        self,
        urls: list[str],
        total: int | None,
        num_classes: int | None = None,
        labelled: int | None = None,
    ):
        self.urls, self.total, self.num_classes, self.labelled = urls, total, num_classes, labelled

    def __iter__(self) -> Iterator[tuple[ImageBytes | Broken, int]]:
        import webdataset as wds  # (see `load`)

        from ssl_vit.data.stream.tar_reader import tar_samples

        failures: list[str] = []

        def failed(exn: Exception) -> bool:
            failures.append(" ".join(str(a) for a in exn.args if a is not None))
            return True

        renamed: list[str] = []  # "KEY -> NAME" of the keys that were paths outside their shard
        stages = tar_samples(failed, max_member_bytes=max_member_bytes(MAX_IMAGE_PIXELS))
        for sample in wds.DataPipeline(wds.SimpleShardList(self.urls), *stages):
            while failures:
                yield Broken(failures.pop(0)), -1
            key = member_key(sample["__key__"])
            if key != sample["__key__"]:
                renamed.append(f"{sample['__key__']!r} -> {key!r}")
            yield _record({**sample, "__key__": key}, self.num_classes)
        while failures:
            yield Broken(failures.pop(0)), -1
        if renamed:
            log.warning(
                "%d sample key(s) named a place outside their shard, written as relative names (%s%s)",
                len(renamed), renamed[0], ", ..." if len(renamed) > 1 else "",
            )  # fmt: skip


def member_key(key: str) -> str:
    """`key` as a relative member name: without `..`, `.` and empty components (a leading `/`);
    backslashes count as separators. Empty when nothing is left (the writer then numbers the sample)."""
    return "/".join(part for part in key.replace("\\", "/").split("/") if part not in ("", ".", ".."))


def _record(sample: dict, num_classes: int | None) -> tuple[ImageBytes | Broken, int]:
    where = f"{sample['__url__']}: {sample['__key__']}"
    ext = next((e for e in CONVERTIBLE_IMAGES if e in sample), None)
    if ext is None:
        return Broken(f"{where}: no image member ({', '.join(CONVERTIBLE_IMAGES)})"), -1
    try:
        label = parse_label(sample, num_classes)
    except BadSample as err:
        return Broken(f"{where}: {err}"), -1
    return ImageBytes(sample[ext], where, sample["__key__"]), label


def shard_inputs(spec: str) -> list[Input]:
    """The local shards among the URLS of `spec`: OUTDIR must not be one or hold one (its shards and
    manifest would land on or beside them); a folder beside them, or inside their directory, is fine,
    since the URLS name their files."""
    from ssl_vit.data.stream.urls import expand  # (see `load`)

    paths = (local_path(url) for url in expand(spec.partition(":")[2], spec))
    return [Input(path, f"the source's shard {path}") for path in paths if path is not None]


def load(arg: str, split: str, what: str = "wds:URLS") -> tuple[list[str] | None, ShardRecords]:
    """`(class_names or None for "from the labels seen", records)` of the shards URLS in `arg`; every
    shard is checked to exist before anything is written (messages name the source as `what`)."""
    # The stream's URL handling imports webdataset (and torch), here and in the reader, not at the top:
    # `ssl-vit --help` lists this source without them (tests/test_cli_imports.py).
    from ssl_vit.data.stream.urls import check_urls, expand

    urls = expand(arg, what)
    check_urls(urls, what)
    manifest = read_manifest(urls[0])
    if manifest is None:
        return None, ShardRecords(urls, None)
    total = samples_in(manifest, urls)
    labelled = None
    if total is not None and total == manifest["num_samples"]:  # the whole split: its class counts
        labelled = sum(n for label, n in manifest.get("class_counts", {}).items() if int(label) >= 0)
    names = manifest.get("class_names") or None  # optional: labels without names
    return names, ShardRecords(urls, total, len(names) if names else None, labelled)


register(
    SourceKind(
        "wds",
        load,
        "URLS",
        help="existing WebDataset shards, re-sharded: image jpg/jpeg/png/webp, label from cls or a json "
        "member's label/cls, keys kept",
        inputs=shard_inputs,
    )
)
