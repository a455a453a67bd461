"""How mixed the training stream's batches are on shards written class by class, against a uniform
shuffle of the epoch: the epoch's global order (local uncompressed shards) beside the stream of
segments that remote and gzip-compressed shards keep (the same shards gzipped), for each number of
DataLoader workers given.

    .venv/bin/python benchmarks/stream_mix.py [--classes 100 --per-class 200 --shards-per-class 1]
        [--batch-size 64] [--workers 0 2]

The default layout is 100 classes in 100 shards of 200 samples, one class each, as `imagenet:` (or any
class-folder source with `--order source`) writes them; `--classes 10 --per-class 800
--shards-per-class 0.4` is the `tiff:` class-folder layout of 4 shards of 2,000. Images are 8x8 PNGs:
the mix does not depend on what the images hold. Prints one line per stream and worker count
(`ssl_vit.data.stream.class_mix.format_mix`) and the raw-bytes memory each worker holds (the stream of
segments: `shuffle_buffer` samples; the global order: one batch in flight).
"""

import argparse
import gzip
import io
import tempfile
import time
from pathlib import Path

import numpy as np
import webdataset as wds
from PIL import Image

from ssl_vit.data import ShardDataModule
from ssl_vit.data.options import Augment, Stream
from ssl_vit.data.stream.class_mix import batch_mix, format_mix


def write_sorted(root: Path, classes: int, per_class: int, shards_per_class: float) -> int:
    """Class-sorted shards; returns how many."""
    rng = np.random.default_rng(0)
    per_shard = max(1, round(per_class / shards_per_class))
    labels = np.repeat(np.arange(classes), per_class)
    count = 0
    for start in range(0, len(labels), per_shard):
        with wds.TarWriter(str(root / f"train-{count:06d}.tar")) as sink:
            for i, label in enumerate(labels[start : start + per_shard], start):
                buf = io.BytesIO()
                Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(buf, format="PNG")
                sink.write({"__key__": f"s{i:07d}", "png": buf.getvalue(), "cls": str(int(label))})
        count += 1
    return count


def measure(urls: str, workers: int, batch: int, counts: list[int]) -> dict:
    dm = ShardDataModule(
        train_urls=urls, batch_size=batch, num_workers=workers, image_size=8,
        train_batches=sum(counts) // batch, augment=Augment(crop_scale=(0.5, 1.0)), stream=Stream(),
    )  # fmt: skip
    dm.setup("fit")
    return batch_mix([b["label"].tolist() for b in dm.train_dataloader()], counts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--per-class", type=int, default=200)
    parser.add_argument("--shards-per-class", type=float, default=1.0)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "gz").mkdir()
        shards = write_sorted(root, args.classes, args.per_class, args.shards_per_class)
        for path in root.glob("train-*.tar"):
            (root / "gz" / path.name).write_bytes(gzip.compress(path.read_bytes()))
        span = f"train-{{000000..{shards - 1:06d}}}.tar"
        print(
            f"{args.classes} classes x {args.per_class} samples in {shards} class-sorted shards, "
            f"batch {args.batch_size}"
        )
        for name, urls in (
            ("global order (local .tar)", root / span),
            ("segments (.tar gzipped)", root / "gz" / span),
        ):
            for workers in args.workers:
                start = time.perf_counter()
                mix = measure(str(urls), workers, args.batch_size, [args.per_class] * args.classes)
                print(f"{name}, {workers} workers: {format_mix(mix)} [{time.perf_counter() - start:.0f} s]")
        print(f"raw bytes per worker: segments {Stream().shuffle_buffer} samples (shuffle_buffer); "
              f"global order {args.batch_size} samples (one batch)")  # fmt: skip


if __name__ == "__main__":
    main()
