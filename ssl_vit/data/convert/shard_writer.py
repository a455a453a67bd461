"""Source -> WebDataset shards plus a manifest (`ssl-vit data convert`).

Shards are `OUTDIR/{split}-000000.tar ...`, each sample `KEY.png` or `KEY.jpg` (from an array source,
`KEY.npy`) plus `KEY.cls` (the label as ASCII digits, absent when unlabelled) and, from a source with
masks, `KEY.seg.png` (its segmentation mask, `ssl_vit.data.format.masks`), written by `webdataset.TarWriter`
with a fixed mtime so the same source gives byte-identical shards. Keys are
`{source}-{split}-{index:08d}`, or for `wds:` the samples' own keys. Records are encoded by
`--workers` processes (`ssl_vit.data.convert.encode`). The manifest `OUTDIR/{split}.json` is described in
data/README.md.

Everything is written into `OUTDIR/.{split}.partial/` first and moved into place at the end, so a
failed or interrupted run never leaves a half-written set next to (or instead of) a good one. Each
finished shard is recorded there in `progress.json` (with the conversion's options): a rerun of the
same conversion after a kill, SIGTERM, Ctrl-C or a crash keeps the finished shards and continues with
the next one, skipping the source records they hold without encoding them again; a rerun with other
options (or a source with another record count) starts over, saying so. SIGTERM and Ctrl-C delete
the shard being written, and `.partial` itself when no shard was finished. With
--overwrite the old split's files are set aside in `OUTDIR/.{split}.old/` while the new ones move in
(the manifest last), and deleted only then: a failure at any point leaves the old split or the new
one complete, with the manifest that describes it.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import logging
import multiprocessing
import os
import re
import shutil
import signal
from collections import Counter
from pathlib import Path

import numpy as np
import webdataset as wds

from ssl_vit import progress
from ssl_vit.data.convert.encode import encode_record
from ssl_vit.data.convert.payload import Encoded, EncodeOptions
from ssl_vit.data.convert.source import SOURCES, Source, open_source, source_inputs
from ssl_vit.data.format.band_stats import BandStats, merged
from ssl_vit.data.format.masks import IGNORE_INDEX, MASK_MEMBER
from ssl_vit.errors import UserError
from ssl_vit.storage.atomic import write_text
from ssl_vit.storage.outdir import refuse_inputs, split_lock

log = logging.getLogger(__name__)
MANIFEST_VERSION = 1
PROGRESS = "progress.json"  # in .{split}.partial/: the options and the shards finished so far


def manifest_path(outdir: str | Path, split: str) -> Path:
    return Path(outdir) / f"{split}.json"


def convert(
    spec: str,
    outdir: str | Path,
    *,
    split: str = "train",
    shard_size: int = 1000,
    image_format: str | None = None,
    quality: int | None = None,
    max_side: int | None = None,
    workers: int = 1,
    overwrite: bool = False,
    progress: bool = True,
    order: str = "random",
    seed: int = 0,
    **source_options: int | str | None,
) -> dict:
    """Write the shards and manifest for SOURCE `spec`, images shrunk to `max_side` pixels on their
    longer side where larger; returns the manifest. `source_options` are the sources' own
    (`ssl_vit.data.convert.source.source_flags`: `grid=` of `mosaic:`, `subset=` of `hf:`, ...).
    `image_format` (default png) and `quality` (default 95) are those of 8-bit sources; an array
    source (`tiff:`, `eurosat:`) stores `.npy` members at their size, and refuses them and `max_side`."""
    check_split_name(split)
    if shard_size <= 0:
        raise UserError(f"--shard-size must be positive, got {shard_size}")
    image_format, quality = _image_options(spec, image_format, quality, max_side)
    outdir = Path(outdir)
    if outdir.exists() and not outdir.is_dir():
        raise UserError(f"OUTDIR {outdir} exists and is not a directory: choose another OUTDIR")
    refuse_inputs(outdir, source_inputs(spec), "OUTDIR")
    with split_lock(outdir, split):  # the rest under it: one conversion of a split at a time
        _check_outdir(outdir, split, overwrite)
        source = open_source(spec, split, **source_options)
        order = _shuffle(source, order, seed)
        options = {
            "source": spec,
            "split": split,
            "shard_size": shard_size,
            "image_format": image_format,
            "quality": quality,
            "max_side": max_side,
            "source_records": source.total,
            "order": order,
            **({"order_seed": seed} if order == "random" else {}),
            **source.options,
        }
        outdir.mkdir(parents=True, exist_ok=True)
        partial = outdir / f".{split}.partial"
        manifest = _write_partial(source, partial, options, workers, progress)
        # The manifest is written into .partial first: while it is there, the swap is not done.
        (partial / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        _swap_in(outdir, split, partial, manifest)
        shutil.rmtree(partial, ignore_errors=True)  # what is left: the progress record
        return manifest


def _shuffle(source: Source, order: str, seed: int) -> str:
    """`--order`: the records of a listed source (every one but `wds:` and `hf:`, read lazily) in a
    random order seeded by `seed`, decided from the list before any image is read, so that a resumed
    conversion writes the same shards; returns the order written. Class-folder sources list their
    records class by class: shards in that order hold one class or a few, which a stream of shards read
    one after another cannot mix (the training stream's global order can: `data/README.md`)."""
    if order not in ("random", "source"):
        raise UserError(f"--order must be random or source, got {order!r}")
    if order == "source":
        return order
    if not isinstance(source.records, list):
        log.info("%s is read lazily: its records keep the source's order", source.spec)
        return "source"
    rng = np.random.default_rng([seed, 0x0DE])
    source.records = [source.records[i] for i in rng.permutation(len(source.records))]
    return order


def _image_options(
    spec: str, image_format: str | None, quality: int | None, max_side: int | None
) -> tuple[str, int]:
    """The members' format and JPEG quality: as given (png and 95 by default) for 8-bit sources; `npy`
    for an array source, which refuses `--format`, `--quality` and `--max-side`."""
    kind = spec.partition(":")[0]
    if kind in SOURCES and SOURCES[kind].arrays:
        given = {"--format": image_format, "--quality": quality, "--max-side": max_side}
        if named := [flag for flag, value in given.items() if value is not None]:
            raise UserError(
                f"{', '.join(named)}: for 8-bit PNG/JPEG sources; {kind}: stores its arrays losslessly as "
                ".npy members at their own size: leave it out"
            )
        image_format = "npy"
    image_format, quality = image_format or "png", 95 if quality is None else quality
    if image_format not in ("png", "jpg", "npy"):
        raise UserError(f"--format must be png or jpg, got {image_format!r}")
    if not 1 <= quality <= 100:
        raise UserError(f"--quality must be in 1..100, got {quality}")
    if max_side is not None and max_side <= 0:
        raise UserError(f"--max-side must be a positive number of pixels, got {max_side}")
    return image_format, quality


def _check_outdir(outdir: Path, split: str, overwrite: bool) -> None:
    """Under the split's lock: an interrupted swap finished, and one line for what is in the way of the
    split's files, or for an existing split without `overwrite`."""
    if outdir.is_dir():
        if _finish_interrupted_swap(outdir, split):
            log.warning("%s: finished the interrupted conversion of split %r found there", outdir, split)
        ours = [outdir / f".{split}.partial", outdir / f".{split}.old"]
        in_the_way = [p for p in _split_entries(outdir, split) if not p.is_file()]
        in_the_way += [p for p in ours if (p.exists() or p.is_symlink()) and not p.is_dir()]
        if in_the_way:
            raise UserError(
                f"{in_the_way[0]} is in the way of split {split!r} (not a regular file): move it out of "
                f"{outdir} or choose another OUTDIR or --split"
            )
    old = _split_files(outdir, split)
    if old and not overwrite:
        raise UserError(
            f"{outdir} already holds split {split!r} ({len(old)} files): pass --overwrite to replace it, "
            "or choose another OUTDIR or --split"
        )


def _write_partial(source: Source, partial: Path, options: dict, workers: int, progress: bool) -> dict:
    """The shards of `source` written into `partial`, after those an interrupted run of the same
    conversion finished there; their manifest. A refused conversion removes `partial`; an interrupted
    one (SIGTERM, Ctrl-C, out of disk) keeps exactly the shards its progress record names."""
    finished = _finished_shards(partial, options)
    try:
        return _write_shards(source, partial, options, finished, workers, progress)
    except UserError:
        shutil.rmtree(partial, ignore_errors=True)  # nothing worth continuing from
        raise
    except BaseException:
        recorded = {entry.get("url") for entry in _read_progress(partial).get("shards", [])}
        # Whatever the record does not name goes: the progress record's temporary file, and a shard the
        # signal caught between its file's creation and the record (even before `_write_shards` knew it)
        for path in partial.iterdir() if partial.is_dir() else ():
            if path.name not in recorded and path.name != PROGRESS:
                shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
        if recorded:
            kept = len(recorded)
            log.warning(
                "kept the %d finished shards in %s: run the same command again to continue", kept, partial
            )
        else:
            shutil.rmtree(partial, ignore_errors=True)
        raise


SPLIT_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")


def check_split_name(split: str) -> None:
    """A split names files in OUTDIR (`{split}-NNNNNN.tar`, `{split}.json`): a plain name, no path."""
    if not SPLIT_NAME.fullmatch(split) or ".." in split:
        raise UserError(
            f"--split {split!r} is not a plain name: use letters, digits, '-', '_' and '.', not starting "
            "with '.' (e.g. train, val, test)"
        )


def _split_entries(outdir: Path, split: str) -> list[Path]:
    """Whatever in OUTDIR has the name of one of the split's shards or of its manifest."""
    shard = re.compile(rf"{re.escape(split)}-\d+\.tar")
    names = sorted(p.name for p in outdir.iterdir()) if outdir.is_dir() else []
    return [outdir / n for n in names if shard.fullmatch(n) or n == f"{split}.json"]


def _split_files(outdir: Path, split: str) -> list[Path]:
    """The split's shard files and manifest in OUTDIR: what --overwrite replaces."""
    return [p for p in _split_entries(outdir, split) if p.is_file()]


def _swap_in(outdir: Path, split: str, partial: Path, manifest: dict) -> None:
    """Replace the split's files in OUTDIR by the new set in `partial`, the new manifest last.

    The old files go to `OUTDIR/.{split}.old/` first and are deleted only once the new manifest is in
    place; on any failure the old set is moved back (`_finish_interrupted_swap`), and a run killed half
    way is finished the same way by the next conversion into OUTDIR."""
    backup = outdir / f".{split}.old"
    backup.mkdir()
    try:
        for path in _split_files(outdir, split):
            os.replace(path, backup / path.name)
        for shard in manifest["shards"]:
            os.replace(partial / shard["url"], outdir / shard["url"])
        os.replace(partial / "manifest.json", manifest_path(outdir, split))
    except BaseException as err:
        try:
            _finish_interrupted_swap(outdir, split)
        except OSError as again:
            raise UserError(
                f"moving the new split {split!r} into {outdir} failed ({err}) and restoring the old one "
                f"failed too ({again}): the old files are in {backup}, the new ones in {partial}; fix the "
                "cause and re-run `ssl-vit data convert`, which restores the old split first"
            ) from None
        if isinstance(err, OSError):
            raise UserError(
                f"moving the new split {split!r} into {outdir} failed ({err}); the old split is kept as it "
                "was: fix the cause and re-run"
            ) from None
        raise
    shutil.rmtree(backup)


def _finish_interrupted_swap(outdir: Path, split: str) -> bool:
    """Bring OUTDIR back to one complete split after a swap that failed or was killed half way;
    returns whether there was one. Safe to run again if interrupted itself.

    `.{split}.partial/manifest.json` still there: the new manifest never went in, so the old set is
    the complete one: new shards that went in go back to `.partial`, old files come back from `.old`.
    `.partial` there without it: the new set and its manifest are all in place; `.old` is deleted."""
    backup, partial = outdir / f".{split}.old", outdir / f".{split}.partial"
    if not backup.is_dir():
        return False
    if partial.is_dir():
        committed = not (partial / "manifest.json").is_file()
    else:  # no marker left: the set in OUTDIR wins only if its manifest describes it
        committed = _is_complete(outdir, split)
    if not committed:
        if (partial / "manifest.json").is_file():
            new = json.loads((partial / "manifest.json").read_text())
            for name in (shard["url"] for shard in new["shards"]):
                if (outdir / name).is_file() and not (partial / name).exists():
                    os.replace(outdir / name, partial / name)
        for path in sorted(backup.iterdir()):
            os.replace(path, outdir / path.name)
    shutil.rmtree(backup)
    shutil.rmtree(partial, ignore_errors=True)  # the set that lost, or an empty directory
    return True


def _is_complete(outdir: Path, split: str) -> bool:
    try:
        manifest = json.loads(manifest_path(outdir, split).read_text())
        return all((outdir / shard["url"]).is_file() for shard in manifest["shards"])
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _finished_shards(partial: Path, options: dict) -> list[dict]:
    """The shards an interrupted run of the same conversion finished in `partial` (their progress
    entries, in order), everything else there deleted; [] and an empty `partial` to start afresh."""
    record = _read_progress(partial)
    if record.get("options") != options:
        if record:
            changed = sorted(k for k in options if record.get("options", {}).get(k) != options[k])
            log.warning(
                "%s: an interrupted conversion with other %s is discarded; starting over",
                partial,
                ", ".join(changed) or "options",
            )
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        return []
    finished = []
    for entry in record["shards"]:  # a shard that is gone or has another size ends the usable prefix
        path = partial / str(entry.get("url")) if isinstance(entry, dict) else None
        if path is None or not path.is_file() or path.stat().st_size != entry.get("bytes"):
            break
        if "band_stats" not in entry:  # recorded by an ssl-vit that did not compute them
            break
        finished.append(entry)
    keep = {entry["url"] for entry in finished}
    for path in partial.iterdir():
        if path.name in keep:
            continue
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    if finished:
        _save_progress(partial, options, finished)
        total = options["source_records"]
        log.warning(
            "%s: continuing the interrupted conversion after its %d finished shards (%d of %s source "
            "records)",
            partial,
            len(finished),
            finished[-1]["records"],
            total if total is not None else "the",
        )
    return finished


def _read_progress(partial: Path) -> dict:
    try:
        record = json.loads((partial / PROGRESS).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) and isinstance(record.get("shards"), list) else {}


def _save_progress(partial: Path, options: dict, shards: list[dict]) -> None:
    """Replace the progress record in one step, so that a kill leaves the old one or the new one."""
    write_text(partial / PROGRESS, json.dumps({"options": options, "shards": shards}) + "\n")


class _Shard:
    """One output shard being written, and what the progress record and manifest say of it.

    `webdataset.TarWriter` per shard rather than `ShardWriter`, which opens the next shard only when
    the next sample arrives: a shard must be closed and recorded as soon as it is full, so that a
    kill right after it does not lose it."""

    def __init__(self, partial: Path, name: str):
        self.path = partial / name
        # unlimited size (--shard-size alone decides where shards end); mtime fixed: reproducible bytes
        self.tar = wds.TarWriter(str(self.path), mtime=0)
        self.samples = 0
        self.class_counts: Counter = Counter()
        self.sizes: Counter = Counter()
        self.mask_pixels: Counter = Counter()
        self.stats: BandStats | None = None

    def write(self, key: str, image_format: str, encoded: Encoded, label: int) -> None:
        """The image as `KEY.{image_format}`, its mask (if any) as `KEY.seg.png`; its bands' statistics
        merged into the shard's."""
        sample = {"__key__": key, image_format: encoded.data}
        if label >= 0:
            sample["cls"] = str(label)
        if encoded.mask is not None:
            sample[MASK_MEMBER] = encoded.mask[0]
            self.mask_pixels.update(encoded.mask[1])
        self.tar.write(sample)
        self.samples += 1
        self.class_counts[label] += 1
        self.sizes[encoded.size] += 1
        self.stats = encoded.stats if self.stats is None else self.stats.merge(encoded.stats)

    def abandon(self) -> None:
        """Close the tar, whatever state a signal left it in. Not deleted here: a signal right after
        the progress record named this shard, before the writer let go of it, would delete a finished
        shard the record keeps; `convert` deletes exactly the files the record does not name."""
        with contextlib.suppress(Exception):
            self.tar.close()

    def close(self, records: int, skipped: int) -> dict:
        """Close the tar; its progress entry. `records`: source records consumed up to its end;
        `skipped`: unreadable ones among them since the previous shard."""
        self.tar.close()
        return {
            "url": self.path.name,
            "num_samples": self.samples,
            "bytes": self.path.stat().st_size,
            "records": records,
            "skipped": skipped,
            "class_counts": {str(k): v for k, v in self.class_counts.items()},
            "sizes": [[h, w, n] for (h, w), n in self.sizes.items()],
            "mask_pixels": {str(k): v for k, v in self.mask_pixels.items()},
            "band_stats": self.stats.to_json(),
        }


def _write_shards(
    source: Source, partial: Path, options: dict, finished: list[dict], workers: int, show: bool
) -> dict:
    """Encode the records after those of the `finished` shards and write the rest of the shards;
    returns the manifest of all of them."""
    split, shard_size, image_format = options["split"], options["shard_size"], options["image_format"]
    shards = list(finished)
    consumed = shards[-1]["records"] if shards else 0
    index = sum(entry["num_samples"] for entry in shards)  # samples written: the next key's number
    mask_classes = len(source.class_names) if source.masks else None
    asked = EncodeOptions(image_format, options["quality"], options["max_side"], mask_classes)
    encode = functools.partial(encode_record, options=asked)
    records = itertools.islice(source.records, consumed, None)
    pool = multiprocessing.get_context("fork").Pool(workers, _worker_start) if workers > 1 else None
    samples = pool.imap(encode, records, chunksize=16) if pool else map(encode, records)
    shard, skipped = None, 0  # skipped: unreadable records since the last shard closed
    said = None  # the last reason a skipped record gave
    try:
        with progress.count(f"writing {split}", source.total, consumed, enabled=show) as shown:
            for encoded, label in samples:
                consumed += 1
                shown.advance()
                if isinstance(encoded, str):
                    skipped += 1
                    if encoded != said:  # the rows of an unreadable parquet row group share theirs: said once
                        log.warning("skipping unreadable image %s", encoded)
                    said = encoded
                    continue
                if shard is None:
                    shard = _Shard(partial, f"{split}-{len(shards):06d}.tar")
                shard.write(encoded.key or f"{source.name}-{split}-{index:08d}", image_format, encoded, label)
                index += 1
                if shard.samples == shard_size:
                    shards.append(shard.close(consumed, skipped))
                    _save_progress(partial, options, shards)
                    shown.part_done(shards[-1]["url"])
                    shard, skipped = None, 0
            if shard is not None:
                shards.append(shard.close(consumed, skipped))
                _save_progress(partial, options, shards)
                shown.part_done(shards[-1]["url"])
                skipped = 0
    except BaseException:
        if shard is not None:  # `convert` deletes it unless the progress record names it
            shard.abandon()
        raise
    finally:
        if pool:
            pool.terminate()
    return _manifest(source, options, shards, trailing_skipped=skipped)


def _worker_start() -> None:
    """An encoding worker's first step: a process group of its own, so that a signal sent to the
    command's group (Ctrl-C at a terminal, a scheduler's SIGTERM) reaches only the main process, which
    then stops the workers with `Pool.terminate`. A worker stopped by the signal itself could die
    half way through writing a result to the pool's pipe, and the shutdown would wait for the rest of
    it for ever."""
    os.setpgid(0, 0)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # how `Pool.terminate` stops it


def _manifest(source: Source, options: dict, shards: list[dict], trailing_skipped: int) -> dict:
    """The manifest of a split from its shards' progress entries."""
    num_samples = sum(entry["num_samples"] for entry in shards)
    skipped = sum(entry["skipped"] for entry in shards) + trailing_skipped
    if num_samples == 0:
        raise UserError(f"source {source.spec!r}: none of its {skipped} images could be read")
    if skipped:
        log.warning("skipped %d unreadable images of %d", skipped, num_samples + skipped)
    class_counts: Counter = Counter()
    sizes: Counter = Counter()
    for entry in shards:
        class_counts.update({int(k): v for k, v in entry["class_counts"].items()})
        sizes.update({(h, w): n for h, w, n in entry["sizes"]})
    class_names = source.class_names
    if class_names is None:  # from the labels written
        class_names = [str(c) for c in range(max(class_counts) + 1)]
    height, width = sizes.most_common(1)[0][0]
    stats = merged(BandStats.from_json(entry["band_stats"]) for entry in shards)
    dtype = source.manifest.get("dtype", "uint8")
    manifest = {
        "version": MANIFEST_VERSION,
        "source": source.spec,
        "split": options["split"],
        "num_samples": num_samples,
        "skipped": skipped,
        "image_format": options["image_format"],
        "max_side": options["max_side"],
        "image_size": [height, width] if len(sizes) == 1 else None,
        "channels": stats.channels,
        "dtype": dtype,
        "band_stats": stats.manifest(dtype),
        "num_classes": len(class_names),
        "class_names": class_names,
        "class_counts": {str(k): v for k, v in sorted(class_counts.items())},
        "shards": [{"url": entry["url"], "num_samples": entry["num_samples"]} for entry in shards],
        "order": options.get("order", "source"),
    }
    if "order_seed" in options:
        manifest["order_seed"] = options["order_seed"]
    if source.masks:  # every sample has a seg.png; its classes are class_names
        pixels: Counter = Counter()
        for entry in shards:
            pixels.update({int(k): v for k, v in entry["mask_pixels"].items()})
        manifest.update(
            masks=True,
            ignore_index=IGNORE_INDEX,
            mask_pixels={str(k): v for k, v in sorted(pixels.items())},
        )
    manifest.update(source.manifest)  # mosaic's options, hf's columns, an array source's dtype and band names
    return manifest
