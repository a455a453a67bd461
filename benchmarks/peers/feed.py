"""The data feed side by side: images/s that reach the model from the same JPEGs through ssl-vit's
`ShardDataModule`, a plain webdataset pipeline, litdata's `StreamingDataset` and mosaicml-streaming's
`StreamingDataset`, each with the same 224 px random-resized crop and flip, batch 64.

    python benchmarks/peers/feed.py --images 5000 --workers 1 2 --batches 30 --rounds 3

The images are written once under ROOT/jpg: real photos (scikit-image's samples), resized and cropped at
random to 400-800 px a side, JPEG quality 90, one class per source photo, in class order. Each feed then
writes its own format from them in that order (ssl-vit's converter permutes the split, its default;
the others keep the order they are given). Per feed and worker count, `--rounds` times, the feeds'
order rotated each round: images/s over `--batches` batches after two untimed ones (the workers'
start); the median over rounds with the slowest and fastest round (the noise), images/s per worker,
and the batch mix: distinct classes per batch against a uniform shuffle's expectation (1.00: as mixed
as a uniform shuffle).

Mid-epoch resume, at the largest worker count: the first `RESUME_AT` batches of an epoch, the feed's
state saved through its library's own API (ssl-vit: the data module's `state_dict`, as a checkpoint
holds it; litdata: `StreamingDataLoader.state_dict`; mosaicml-streaming: its `StreamingDataLoader`'s;
webdataset has none), a new loader started from that state; its next batches against an uninterrupted
epoch's: the same samples in the same order (by key), and the same pixels (the augmentation too).
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from feed_datasets import SIZE, TRANSFORM
from PIL import Image

PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field", "immunohistochemistry",
          "retina", "colorwheel", "cat", "logo")  # fmt: skip
BATCH = 64


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


# The feeds: each writes its format once, then gives a loader of batches (images uint8 (B, 3, 224, 224),
# labels (B,), keys (B,)) and `save`, the state to resume from after the batches taken so far (None where
# the library keeps none); `state` starts the loader from such a state.

RESUME_AT, RESUME_BATCHES = 3, 6


def sslvit_feed(samples, root: Path, workers: int, batch: int = BATCH, state=None):
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
        train_urls=sorted(str(p) for p in out.glob("train-*.tar")), image_size=SIZE, batch_size=batch,
        num_workers=workers,
    )  # fmt: skip
    module.setup("fit")
    if state is not None:
        module.load_state_dict(state)  # as Lightning restores a checkpoint, before the first iterator
    loader = module.train_dataloader()
    return _batches(loader, lambda b: (b["image"], b["label"], b["key"]), loader.record), module.state_dict


def webdataset_feed(samples, root: Path, workers: int, batch: int = BATCH, state=None):
    """A plain webdataset pipeline, as its README writes one."""
    import webdataset as wds

    out = root / "wds"
    if not out.exists():
        out.mkdir()
        shard = max(1, min(500, len(samples) // 4))  # at least 4 shards: one or more per worker
        with wds.ShardWriter(str(out / "train-%06d.tar"), maxcount=shard) as sink:
            for i, (path, label) in enumerate(samples):
                sink.write({"__key__": f"{i:06d}", "jpg": path.read_bytes(), "cls": label})
    urls = sorted(str(p) for p in out.glob("train-*.tar"))
    dataset = (
        wds.WebDataset(urls, shardshuffle=len(urls), nodesplitter=wds.split_by_node)
        .shuffle(1000).decode("pil").to_tuple("jpg", "cls", "__key__").map_tuple(TRANSFORM, int, str)
        .batched(batch)
    )  # fmt: skip
    return _batches(wds.WebLoader(dataset, batch_size=None, num_workers=workers)), None


def _litdata_sample(item):
    key, path, label = item
    return {"jpg": Path(path).read_bytes(), "cls": label, "key": key}


def litdata_feed(samples, root: Path, workers: int, batch: int = BATCH, state=None):
    import litdata

    out = root / "litdata"
    if not out.exists():
        litdata.optimize(
            fn=_litdata_sample, inputs=[(i, str(p), c) for i, (p, c) in enumerate(samples)],
            output_dir=str(out), chunk_bytes="32MB", num_workers=1,
        )  # fmt: skip

    from feed_datasets import LitdataImages

    dataset = LitdataImages(str(out), shuffle=True, seed=0)
    loader = litdata.StreamingDataLoader(dataset, batch_size=batch, num_workers=workers)
    if state is not None:
        loader.load_state_dict(state)
    return _batches(loader), loader.state_dict


def mosaic_feed(samples, root: Path, workers: int, batch: int = BATCH, state=None):
    import streaming

    out = root / "mds"
    if not out.exists():
        columns = {"jpg": "bytes", "cls": "int", "key": "int"}
        with streaming.MDSWriter(out=str(out), columns=columns, size_limit="32mb") as writer:
            for key, (path, label) in enumerate(samples):
                writer.write({"jpg": path.read_bytes(), "cls": label, "key": key})

    from feed_datasets import MosaicImages

    dataset = MosaicImages(local=str(out), shuffle=True, shuffle_seed=0, batch_size=batch)
    loader = streaming.StreamingDataLoader(dataset, batch_size=batch, num_workers=workers)
    if state is not None:
        loader.load_state_dict(state)
    return _batches(loader), loader.state_dict


FEEDS = {"ssl-vit": sslvit_feed, "webdataset": webdataset_feed, "litdata": litdata_feed,
         "mosaicml-streaming": mosaic_feed}  # fmt: skip


def _batches(loader, parts=tuple, record=None):
    """The loader's batches as (images, labels, keys), epoch after epoch; `record(batch)`: what a
    training loop tells ssl-vit's loader of each batch it consumed (`EpochLoader.record`)."""
    for _ in itertools.count():
        for batch in loader:
            if record is not None:
                record(batch)
            images, labels, keys = parts(batch)
            yield images, torch.as_tensor(labels), [str(k) for k in keys]


def uniform_distinct(classes: int, batch: int) -> float:
    """Expected distinct classes in a batch drawn uniformly from `classes` equally frequent ones."""
    return classes * (1 - (1 - 1 / classes) ** batch)


def measure(batches_of, batches: int, classes: int) -> dict:
    """Images/s and batch mix over `batches` batches of `batches_of` (epoch after epoch)."""
    for _ in range(2):  # the workers' start
        next(batches_of)
    distinct, images_seen, start = [], 0, time.perf_counter()
    for _ in range(batches):
        images, labels, _ = next(batches_of)
        assert images.shape[1:] == (3, SIZE, SIZE), images.shape
        distinct.append(len(set(labels.tolist())) / uniform_distinct(classes, len(labels)))
        images_seen += len(labels)
    return {"img_s": images_seen / (time.perf_counter() - start), "mix": float(np.mean(distinct))}


def resumes_exactly(feed, samples, root: Path, workers: int, batch: int = BATCH) -> str:
    """Whether the feed, stopped after `RESUME_AT` batches and started again from its saved state,
    gives the batches an uninterrupted epoch gives: "yes" (same keys and pixels), "order only" (same
    samples in the same order, other augmentations), or "no" and why."""
    whole, _ = feed(samples, root, workers, batch)
    expected = [next(whole) for _ in range(RESUME_BATCHES)][RESUME_AT:]
    del whole
    first, save = feed(samples, root, workers, batch)
    if save is None:
        return "no: no state to save"
    for _ in range(RESUME_AT):
        next(first)
    state = save()
    del first
    again, _ = feed(samples, root, workers, batch, state=state)
    got = [next(again) for _ in range(RESUME_BATCHES - RESUME_AT)]
    del again
    if [k for _, _, k in got] != [k for _, _, k in expected]:
        return "no: other samples after the resume"
    if all(torch.equal(a, b) for (a, _, _), (b, _, _) in zip(got, expected)):
        return "yes"
    return "order only: other augmentations"


def table(rows: list[dict], resumes: dict[str, str]) -> str:
    lines = [
        "| feed | workers | img/s: median (slowest, fastest round) | img/s per worker "
        "| batch mix (1.00 = uniform) | exact mid-epoch resume |",
        "|---|---:|---|---:|---:|---|",
    ]
    for r in rows:
        rates = r["img_s"]
        median = float(np.median(rates))
        lines.append(
            f"| {r['feed']} | {r['workers']} | {median:.1f} ({min(rates):.1f}, {max(rates):.1f}) "
            f"| {median / r['workers']:.1f} | {np.mean(r['mix']):.2f} | {resumes.get(r['feed'], '')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=5000)
    parser.add_argument("--workers", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=BATCH)
    parser.add_argument("--feeds", nargs="+", default=list(FEEDS), choices=FEEDS)
    parser.add_argument("--root", type=Path, default=Path("runs/peers/feed"))
    parser.add_argument("--results", type=Path, help="append the table to this page (RESULTS.md)")
    args = parser.parse_args(argv)
    samples = write_jpegs(args.root / "jpg", args.images)
    rows = {(name, workers): {"feed": name, "workers": workers, "img_s": [], "mix": []}
            for workers in args.workers for name in args.feeds}  # fmt: skip
    for round_ in range(args.rounds):
        order = args.feeds[round_ % len(args.feeds) :] + args.feeds[: round_ % len(args.feeds)]
        for workers in args.workers:
            for name in order:
                batches_of, _ = FEEDS[name](samples, args.root, workers, args.batch_size)
                result = measure(batches_of, args.batches, len(PHOTOS))
                del batches_of  # its workers stop before the next feed's start
                rows[name, workers]["img_s"].append(result["img_s"])
                rows[name, workers]["mix"].append(result["mix"])
                print(f"round {round_} {name} workers {workers}: {result['img_s']:.1f} img/s, "
                      f"mix {result['mix']:.2f}", flush=True)  # fmt: skip
    resumes = {}
    for name in args.feeds:
        resumes[name] = resumes_exactly(FEEDS[name], samples, args.root, max(args.workers), args.batch_size)
        print(f"{name} resume at {max(args.workers)} workers: {resumes[name]}", flush=True)
    text = table(list(rows.values()), resumes)
    print(text)
    if args.results:  # after speed.py's page, as `make peers` runs them
        command = " ".join(["python", *sys.argv])
        section = f"""
## The data feed

- command: `{command}`
- {args.images} JPEGs, {args.batches} timed batches of {args.batch_size} after two untimed ones, per feed
  and worker count, {args.rounds} round(s), the feeds' order rotated each round
- load average (1 min) at the end: {os.getloadavg()[0]:.2f}
- batch mix: distinct classes per batch over a uniform shuffle's expectation ({len(PHOTOS)} classes)
- exact mid-epoch resume, at {max(args.workers)} workers: {RESUME_AT} batches, the state saved with the
  library's own API, a new loader from it, {RESUME_BATCHES - RESUME_AT} batches against an
  uninterrupted epoch's ("order only": the same samples in the same order, other random crops)

{text}
"""
        with args.results.open("a") as page:
            page.write(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
