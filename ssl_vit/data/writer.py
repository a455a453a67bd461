"""Source -> WebDataset shards plus a manifest (`ssl-vit data convert`).

Shards are `OUTDIR/{split}-000000.tar ...`, each sample `KEY.png` or `KEY.jpg` plus `KEY.cls` (the
label as ASCII digits, absent when unlabelled), written by `webdataset.ShardWriter` with a fixed mtime
so the same source gives byte-identical shards. Keys are `{source}-{split}-{index:08d}`. The manifest
`OUTDIR/{split}.json` is described in data/README.md.

Everything is written into `OUTDIR/.{split}.partial/` first and moved into place at the end, so a
failed or interrupted run never leaves a half-written set next to (or instead of) a good one.
"""

from __future__ import annotations

import io
import json
import logging
import multiprocessing
import os
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
    if shard_size <= 0:
        raise UserError(f"--shard-size must be positive, got {shard_size}")
    if image_format not in ("png", "jpg"):
        raise UserError(f"--format must be png or jpg, got {image_format!r}")
    if not 1 <= quality <= 100:
        raise UserError(f"--quality must be in 1..100, got {quality}")
    outdir = Path(outdir)
    if outdir.exists() and not outdir.is_dir():
        raise UserError(f"OUTDIR {outdir} exists and is not a directory: choose another OUTDIR")
    old = sorted(outdir.glob(f"{split}-*.tar")) + [p for p in [manifest_path(outdir, split)] if p.exists()]
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
        for path in old:
            path.unlink()
        for shard in manifest["shards"]:
            os.replace(partial / shard["url"], outdir / shard["url"])
        (partial / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        os.replace(partial / "manifest.json", manifest_path(outdir, split))
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return manifest


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
