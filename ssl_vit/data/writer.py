"""Source -> WebDataset shards plus a manifest (`ssl-vit data convert`).

Shards are `OUTDIR/{split}-000000.tar ...`, each sample `KEY.png` or `KEY.jpg` plus `KEY.cls` (the
label as ASCII digits, absent when unlabelled), written by `webdataset.ShardWriter` with a fixed mtime
so the same source gives byte-identical shards. Keys are `{source}-{split}-{index:08d}`. The manifest
`OUTDIR/{split}.json` is described in data/README.md.

Everything is written into `OUTDIR/.{split}.partial/` first and moved into place at the end, so a
failed or interrupted run never leaves a half-written set next to (or instead of) a good one. With
--overwrite the old split's files are set aside in `OUTDIR/.{split}.old/` while the new ones move in
(the manifest last), and deleted only then: a failure at any point leaves the old split or the new
one complete, with the manifest that describes it.
"""

from __future__ import annotations

import io
import json
import logging
import multiprocessing
import os
import re
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import webdataset as wds
from PIL import Image

from ssl_vit.data.sources import Source, open_source
from ssl_vit.errors import UserError

log = logging.getLogger(__name__)
MANIFEST_VERSION = 1


def manifest_path(outdir: str | Path, split: str) -> Path:
    return Path(outdir) / f"{split}.json"


def encode_record(record, image_format: str, quality: int):
    """Encode one `(payload, label)` record. Returns `(bytes, (H, W), label)`, or `(None, reason, label)`
    for an image file that cannot be read (it is skipped and counted by the caller)."""
    payload, label = record
    if isinstance(payload, Path):
        try:
            data = payload.read_bytes()
            img = Image.open(io.BytesIO(data))
            img.load()
        except Exception as err:
            return None, f"{payload}: {err}", label
        if image_format == "jpg" and img.format == "JPEG":
            # ImageNet-style sources are JPEG already: keep their bytes instead of re-encoding lossily.
            return data, (img.height, img.width), label
        img = img.convert("L" if img.mode in ("L", "1", "I;16") else "RGB")
    else:
        img = Image.fromarray(np.ascontiguousarray(payload))
    buf = io.BytesIO()
    if image_format == "png":
        img.save(buf, format="PNG", compress_level=6)
    else:
        img.save(buf, format="JPEG", quality=quality)
    return buf.getvalue(), (img.height, img.width), label


def _encode_star(args):
    return encode_record(*args)


def convert(
    spec: str,
    outdir: str | Path,
    *,
    split: str = "train",
    shard_size: int = 1000,
    image_format: str = "png",
    quality: int = 95,
    workers: int = 1,
    overwrite: bool = False,
    progress: bool = True,
) -> dict:
    """Write the shards and manifest for SOURCE `spec`; returns the manifest."""
    check_split_name(split)
    if shard_size <= 0:
        raise UserError(f"--shard-size must be positive, got {shard_size}")
    if image_format not in ("png", "jpg"):
        raise UserError(f"--format must be png or jpg, got {image_format!r}")
    if not 1 <= quality <= 100:
        raise UserError(f"--quality must be in 1..100, got {quality}")
    outdir = Path(outdir)
    if outdir.exists() and not outdir.is_dir():
        raise UserError(f"OUTDIR {outdir} exists and is not a directory: choose another OUTDIR")
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
    source = open_source(spec, split)

    outdir.mkdir(parents=True, exist_ok=True)
    partial = outdir / f".{split}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    try:
        manifest = _write_shards(source, partial, split, shard_size, image_format, quality, workers, progress)
        # The manifest is written into .partial first: while it is there, the swap is not done.
        (partial / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        _swap_in(outdir, split, partial, manifest)
    finally:
        if not (outdir / f".{split}.old").exists():  # else it holds the only copy of some old files
            shutil.rmtree(partial, ignore_errors=True)
    return manifest


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


def _write_shards(
    source: Source,
    partial: Path,
    split: str,
    shard_size: int,
    image_format: str,
    quality: int,
    workers: int,
    progress: bool,
) -> dict:
    jobs = ((record, image_format, quality) for record in source.records)
    counts: dict[str, int] = {}
    class_counts: Counter = Counter()
    sizes: Counter = Counter()
    skipped = 0
    index = 0
    pool = multiprocessing.get_context("fork").Pool(workers) if workers > 1 else None
    encoded = pool.imap(_encode_star, jobs, chunksize=64) if pool else map(_encode_star, jobs)
    try:
        # maxsize is unlimited so that --shard-size alone decides where shards end; mtime fixed for
        # reproducible tar bytes.
        with (
            wds.ShardWriter(
                str(partial / f"{split}-%06d.tar"),
                maxcount=shard_size,
                maxsize=float("inf"),
                verbose=0,
                mtime=0,
            ) as sink,
            _progress(progress, len(source.records), split) as bar,
        ):
            for data, size, label in encoded:
                bar(1)
                if data is None:
                    skipped += 1
                    log.warning("skipping unreadable image %s", size)
                    continue
                sample = {"__key__": f"{source.name}-{split}-{index:08d}", image_format: data}
                if label >= 0:
                    sample["cls"] = str(label)
                sink.write(sample)
                name = os.path.basename(sink.fname)
                counts[name] = counts.get(name, 0) + 1
                class_counts[label] += 1
                sizes[size] += 1
                index += 1
    finally:
        if pool:
            pool.terminate()
    if index == 0:
        raise UserError(f"source {source.spec!r}: none of its {len(source.records)} images could be read")
    if skipped:
        log.warning("skipped %d unreadable images of %d", skipped, len(source.records))
    height, width = sizes.most_common(1)[0][0]
    return {
        "version": MANIFEST_VERSION,
        "source": source.spec,
        "split": split,
        "num_samples": index,
        "skipped": skipped,
        "image_format": image_format,
        "image_size": [height, width] if len(sizes) == 1 else None,
        "num_classes": len(source.class_names),
        "class_names": source.class_names,
        "class_counts": {str(k): v for k, v in sorted(class_counts.items())},
        "shards": [{"url": name, "num_samples": n} for name, n in counts.items()],
    }


class _progress:
    """A rich progress bar on stderr (nothing when `enabled` is false); calling it advances the bar."""

    def __init__(self, enabled: bool, total: int, split: str):
        self.bar = None
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

            self.bar = Progress(
                "[progress.description]{task.description}",
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                console=Console(stderr=True),
            )
            self.task = self.bar.add_task(f"writing {split}", total=total)

    def __enter__(self):
        if self.bar:
            self.bar.start()
        return self

    def __call__(self, n: int):
        if self.bar:
            self.bar.advance(self.task, n)

    def __exit__(self, *exc):
        if self.bar:
            self.bar.stop()
