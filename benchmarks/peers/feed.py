"""The data feed side by side: images/s that reach the model from the same JPEGs through ssl-vit's
`ShardDataModule`, a plain webdataset pipeline, litdata's `StreamingDataset` and mosaicml-streaming's
`StreamingDataset`, each with the same 224 px random-resized crop and flip, batch 64.

    python benchmarks/peers/feed.py --images 5000 --workers 1 2 --batches 30

The images are written once under ROOT/jpg: real photos (scikit-image's samples), resized and cropped at
random to 400-800 px a side, JPEG quality 90, one class per source photo, in class order. Each feed then
writes its own format from them in that order (ssl-vit's converter permutes the split, its default;
the others keep the order they are given). Per feed and worker count: images/s over `--batches` batches
after two untimed ones (the workers' start), images/s per worker, and the batch mix: distinct classes per
batch against a uniform shuffle's expectation (1.00: as mixed as a uniform shuffle). Whether a mid-epoch
resume is exact is not measured yet.
"""

from __future__ import annotations

import argparse
import io
import itertools
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torchvision.transforms import v2

PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field", "immunohistochemistry",
          "retina", "colorwheel", "cat", "logo")  # fmt: skip
SIZE, BATCH = 224, 64
TRANSFORM = v2.Compose(
    [v2.PILToTensor(), v2.RandomResizedCrop(SIZE, antialias=True), v2.RandomHorizontalFlip()]
)


def write_jpegs(root: Path, count: int, seed: int = 0) -> list[tuple[Path, int]]:
    """(path, class) of `count` JPEGs, in class order; written once (kept when already there)."""
    import skimage.data

    rng = np.random.default_rng(seed)
    out, per_class = [], -(-count // len(PHOTOS))
    for label, name in enumerate(PHOTOS):
        photo = Image.fromarray(np.asarray(getattr(skimage.data, name)())[..., :3])
        folder = root / f"{label:02d}_{name}"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(min(per_class, count - len(out))):
            path = folder / f"{i:05d}.jpg"
            if not path.exists():
                w, h = rng.integers(400, 801, size=2)
                scale = max(w / photo.width, h / photo.height) * rng.uniform(1.0, 1.5)
                big = photo.resize((int(photo.width * scale) + 1, int(photo.height * scale) + 1))
                x, y = rng.integers(0, big.width - w + 1), rng.integers(0, big.height - h + 1)
                big.crop((x, y, x + w, y + h)).save(path, quality=90)
            out.append((path, label))
    return out


def decode(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data)).convert("RGB")


# The feeds: each writes its format once, then loads (images uint8 (B, 3, 224, 224), labels (B,)).


def sslvit_feed(samples, root: Path, workers: int):
    from ssl_vit.data import ShardDataModule

    out = root / "sslvit"
    if not (out / "train.json").exists():
        # --format jpg keeps the JPEGs' bytes (the default, png, would hand ssl-vit 5x the bytes to decode)
        folder = samples[0][0].parents[1]
        subprocess.run(
            [sys.executable, "-m", "ssl_vit", "data", "convert", f"imagefolder:{folder}", str(out),
             "--split", "train", "--shard-size", "500", "--format", "jpg", "--no-progress"], check=True,
        )  # fmt: skip
    module = ShardDataModule(
        train_urls=sorted(str(p) for p in out.glob("train-*.tar")), image_size=SIZE, batch_size=BATCH,
        num_workers=workers,
    )  # fmt: skip
    module.setup("fit")
    return module.train_dataloader()  # batches are dicts: `image`, `label`, ...


def webdataset_feed(samples, root: Path, workers: int):
    """A plain webdataset pipeline, as its README writes one."""
    import webdataset as wds

    out = root / "wds"
    if not out.exists():
        out.mkdir()
        with wds.ShardWriter(str(out / "train-%06d.tar"), maxcount=500) as sink:
            for i, (path, label) in enumerate(samples):
                sink.write({"__key__": f"{i:06d}", "jpg": path.read_bytes(), "cls": label})
    urls = sorted(str(p) for p in out.glob("train-*.tar"))
    dataset = (
        wds.WebDataset(urls, shardshuffle=len(urls), nodesplitter=wds.split_by_node)
        .shuffle(1000).decode("pil").to_tuple("jpg", "cls").map_tuple(TRANSFORM, int).batched(BATCH)
    )  # fmt: skip
    return wds.WebLoader(dataset, batch_size=None, num_workers=workers)


def _litdata_sample(item):
    path, label = item
    return {"jpg": Path(path).read_bytes(), "cls": label}


def litdata_feed(samples, root: Path, workers: int):
    import litdata

    out = root / "litdata"
    if not out.exists():
        litdata.optimize(
            fn=_litdata_sample, inputs=[(str(p), c) for p, c in samples], output_dir=str(out),
            chunk_bytes="32MB", num_workers=1,
        )  # fmt: skip

    from feed_datasets import LitdataImages

    dataset = LitdataImages(str(out), shuffle=True, seed=0)
    return litdata.StreamingDataLoader(dataset, batch_size=BATCH, num_workers=workers)


def mosaic_feed(samples, root: Path, workers: int):
    from streaming import MDSWriter

    out = root / "mds"
    if not out.exists():
        with MDSWriter(out=str(out), columns={"jpg": "bytes", "cls": "int"}, size_limit="32mb") as writer:
            for path, label in samples:
                writer.write({"jpg": path.read_bytes(), "cls": label})

    from feed_datasets import MosaicImages

    dataset = MosaicImages(local=str(out), shuffle=True, shuffle_seed=0, batch_size=BATCH)
    return torch.utils.data.DataLoader(dataset, batch_size=BATCH, num_workers=workers)


FEEDS = {"ssl-vit": sslvit_feed, "webdataset": webdataset_feed, "litdata": litdata_feed,
         "mosaicml-streaming": mosaic_feed}  # fmt: skip


def uniform_distinct(classes: int, batch: int) -> float:
    """Expected distinct classes in a batch drawn uniformly from `classes` equally frequent ones."""
    return classes * (1 - (1 - 1 / classes) ** batch)


def measure(loader, batches: int, classes: int) -> dict:
    """Images/s and batch mix over `batches` batches of `loader` (epoch after epoch)."""
    stream = (batch for _ in itertools.count() for batch in loader)
    for _ in range(2):  # the workers' start
        next(stream)
    distinct, start = [], time.perf_counter()
    for _ in range(batches):
        batch = next(stream)
        images, labels = (batch["image"], batch["label"]) if isinstance(batch, dict) else batch
        assert images.shape[1:] == (3, SIZE, SIZE), images.shape
        distinct.append(len(set(torch.as_tensor(labels).tolist())))
    seconds = time.perf_counter() - start
    return {
        "img_s": batches * BATCH / seconds,
        "mix": float(np.mean(distinct)) / uniform_distinct(classes, BATCH),
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| feed | workers | img/s | img/s per worker | batch mix (1.00 = uniform) |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        per_worker = r["img_s"] / r["workers"]
        lines.append(
            f"| {r['feed']} | {r['workers']} | {r['img_s']:.1f} | {per_worker:.1f} | {r['mix']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=5000)
    parser.add_argument("--workers", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--feeds", nargs="+", default=list(FEEDS), choices=FEEDS)
    parser.add_argument("--root", type=Path, default=Path("runs/peers/feed"))
    parser.add_argument("--results", type=Path, help="append the table to this page (RESULTS.md)")
    args = parser.parse_args(argv)
    samples = write_jpegs(args.root / "jpg", args.images)
    rows = []
    for workers in args.workers:
        for name in args.feeds:
            result = measure(FEEDS[name](samples, args.root, workers), args.batches, len(PHOTOS))
            rows.append({"feed": name, "workers": workers, **result})
            print(
                f"{name} workers {workers}: {result['img_s']:.1f} img/s, mix {result['mix']:.2f}", flush=True
            )
    text = table(rows)
    print(text)
    if args.results:  # after speed.py's page, as `make peers` runs them
        command = " ".join(["python", *sys.argv])
        section = f"""
## The data feed

- command: `{command}`
- {args.images} JPEGs, {args.batches} timed batches of {BATCH} after two untimed ones, per feed and worker
  count, one pass each: no spread measured yet, so a difference below about 20% is not one
- batch mix: distinct classes per batch over a uniform shuffle's expectation ({len(PHOTOS)} classes)

{text}
"""
        with args.results.open("a") as page:
            page.write(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
