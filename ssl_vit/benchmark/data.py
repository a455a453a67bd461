"""`ssl-vit bench data`: decode + augment throughput of the pipeline against a bare PIL loop.

Everything is measured in one process, on the same JPEG bytes, so only ratios are reported (the
throughput targets in benchmarks/RESULTS.md are ratios against the same reference):

- `bare` (the reference, 1.00): a hand-written Python loop over the bytes: `PIL.Image.open`, full
  decode (no draft), the same random resized crop (box drawn as torchvision does, crop + bilinear
  resize in one `Image.resize(box=...)` call), the same random flip, to a uint8 tensor; one image at a
  time, no framework in between (what a hand-written map-style Dataset does);
- `pipeline`: `ShardDataModule`'s training stream (tar reading, shuffle, decode, crop, flip, collate
  of uint8 batches; float conversion and normalisation happen later, per batch, on the device), with
  draft decoding off (target >= 0.9x the bare loop) and on (target >= 1.3x the *same* full-decode
  bare loop, when the stored JPEGs are at least twice the crop); run in-process (`num_workers=0`:
  the work of one worker, without inter-process transfer) and through one DataLoader worker process
  (adds the transfer of each batch to the main process, and on a small machine the two processes
  compete for cores);
- worker memory: RSS of that worker after a warm-up and after `--memory-samples` samples.

Neither side normalises on the host. Images are scikit-image's photos, randomly cropped and
re-encoded at `--stored` size (1000x750 by default; ImageNet's typical size is 500x375) and JPEG
`--quality` (90 by default: ImageNet's files are mostly saved at quality 75-90 by cameras and web
software; 90 is at the top of that range, the conservative choice for draft decoding, whose gain
shrinks as the entropy-coded data it cannot skip grows with quality). With
`--repeats`, every measurement is repeated and the median ratio reported (the machine this was
written on is shared and noisy).
"""

from __future__ import annotations

import io
import multiprocessing
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import webdataset as wds
from PIL import Image

PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "immunohistochemistry", "hubble_deep_field", "retina")


def make_jpegs(n: int, size: tuple[int, int], seed: int = 0, quality: int = 90) -> list[bytes]:
    """`n` distinct JPEGs of `size` (W, H): random crops of the photos, resized, at `quality`."""
    import skimage.data

    photos = [Image.fromarray(getattr(skimage.data, name)()) for name in PHOTOS]
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        photo = photos[i % len(photos)]
        w, h = photo.size
        cw, ch = int(w * rng.uniform(0.6, 1.0)), int(h * rng.uniform(0.6, 1.0))
        x, y = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
        buf = io.BytesIO()
        image = photo.crop((x, y, x + cw, y + ch)).resize(size, Image.BILINEAR)
        image.save(buf, format="JPEG", quality=quality)
        out.append(buf.getvalue())
    return out


def write_shards(jpegs: list[bytes], directory: str | Path, shards: int = 4) -> str:
    """`jpegs` as about `shards` tars in `directory` (labels 0-9 in turn); their URLs as one brace range."""
    per_shard = max(1, len(jpegs) // shards)
    with wds.ShardWriter(f"{directory}/bench-%06d.tar", maxcount=per_shard, verbose=0) as sink:
        for i, data in enumerate(jpegs):
            sink.write({"__key__": f"{i:08d}", "jpg": data, "cls": str(i % 10)})
    written = len(list(Path(directory).glob("bench-*.tar")))
    return f"{directory}/bench-{{000000..{written - 1:06d}}}.tar"


def _worker_rss_kib() -> int:
    """Resident memory of the (single) DataLoader worker, from /proc (Linux)."""
    (child,) = multiprocessing.active_children()
    for line in Path(f"/proc/{child.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc status")


def _bare_loop(jpegs: list[bytes], samples: int, image_size: int, crop_scale: tuple[float, float]) -> float:
    """Images/s of a hand-written loop: full decode + the pipeline's crop, flip and tensor, nothing else."""
    from ssl_vit.data.transforms.rgb import RandomResizedCrop

    size = (image_size, image_size)
    crop = RandomResizedCrop(image_size, scale=crop_scale, draft=False)  # only its box(): torchvision's
    start = time.perf_counter()
    for i in range(samples):
        img = Image.open(io.BytesIO(jpegs[i % len(jpegs)]))
        img.load()  # full decode, no draft
        if img.mode != "RGB":
            img = img.convert("RGB")
        left, top, w, h = crop.box(*img.size)
        img = img.resize(size, Image.Resampling.BILINEAR, box=(left, top, left + w, top + h))
        if random.random() < 0.5:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        torch.from_numpy(np.array(img)).permute(2, 0, 1)
    return samples / (time.perf_counter() - start)


def _pipeline(
    urls: str,
    samples: int,
    image_size: int,
    crop_scale: tuple[float, float],
    batch_size: int,
    draft: bool,
    num_workers: int,
    memory: bool = False,
) -> tuple[float, tuple[int, int] | None]:
    """Images/s (clock started after the first batch, so worker start-up is excluded); with `memory`,
    the worker's RSS after the first 10% of batches and at the last batch."""
    from ssl_vit.data import ShardDataModule
    from ssl_vit.data.options import Augment, Stream

    batches = max(2, samples // batch_size)
    dm = ShardDataModule(
        train_urls=urls,
        batch_size=batch_size,
        num_workers=num_workers,
        image_size=image_size,
        augment=Augment(crop_scale=crop_scale, draft=draft),
        train_batches=batches,
        stream=Stream(shuffle_buffer=256),
    )
    dm.setup("fit")
    rss = None
    it = iter(dm.train_dataloader())
    next(it)
    warm = max(1, batches // 10)
    start = time.perf_counter()
    for i, _ in enumerate(it, start=1):
        # read the worker's memory while it is alive: the DataLoader stops it after the last batch
        if memory and i == warm:
            rss_warm = _worker_rss_kib()
        if memory and i == batches - 1:
            rss = (rss_warm, _worker_rss_kib())
    rate = (batches - 1) * batch_size / (time.perf_counter() - start)
    del it
    return rate, rss


def run(
    images: int,
    samples: int,
    memory_samples: int,
    image_size: int,
    stored: tuple[int, int],
    batch_size: int,
    quality: int = 90,
    crop_scale: tuple[float, float] = (0.08, 1.0),
    repeats: int = 1,
) -> dict:
    torch.set_num_threads(1)  # one worker's worth of compute, as in a DataLoader worker
    jpegs = make_jpegs(images, stored, quality=quality)
    ratios: dict[tuple[int, bool], list[float]] = {}
    rates: dict[tuple[int, bool], list[float]] = {}
    references = []
    with tempfile.TemporaryDirectory() as tmp:
        urls = write_shards(jpegs, tmp)
        for _ in range(repeats):
            # the reference is measured before, between and after the pipeline runs; each pipeline rate
            # is divided by the mean of the two bare-loop measurements around it
            bare = [_bare_loop(jpegs, samples, image_size, crop_scale)]
            for num_workers in (0, 1):
                got = {}
                for draft in (False, True):
                    got[draft], _ = _pipeline(
                        urls, samples, image_size, crop_scale, batch_size, draft, num_workers
                    )
                bare.append(_bare_loop(jpegs, samples, image_size, crop_scale))
                reference = (bare[-2] + bare[-1]) / 2
                for draft, rate in got.items():
                    rates.setdefault((num_workers, draft), []).append(rate)
                    ratios.setdefault((num_workers, draft), []).append(rate / reference)
            references.append(statistics.fmean(bare))
        _, (rss_warm, rss_end) = _pipeline(
            urls, memory_samples, image_size, crop_scale, batch_size, True, 1, memory=True
        )
    return {
        "bare_img_s": statistics.median(references),
        "rates": {
            key: (statistics.median(rates[key]), statistics.median(ratios[key]), ratios[key]) for key in rates
        },
        "rss_warm_mib": rss_warm / 1024,
        "rss_end_mib": rss_end / 1024,
        "rss_growth": rss_end / rss_warm - 1,
    }


def format_results(r: dict, args) -> str:
    w, h = args.stored
    lo, hi = args.crop_scale
    repeats = f", median of {args.repeats} repeats" if args.repeats > 1 else ""
    twice = "yes" if min(w, h) >= 2 * args.image_size else "no"
    lines = [
        f"bench data: {args.images} JPEGs {w}x{h} quality {args.quality}, crop {args.image_size} "
        f"scale ({lo:g}, {hi:g}), batch {args.batch_size}, {args.samples} samples per measurement"
        f"{repeats}; stored >= 2x crop: {twice}",
        f"{'':<52}{'img/s':>9}{'ratio':>7}",
        f"{'bare PIL loop (reference)':<52}{r['bare_img_s']:>9.1f}{1.0:>7.2f}",
    ]
    for (num_workers, draft), (rate, ratio, each) in r["rates"].items():
        where = "in-process (one worker's work)" if num_workers == 0 else "1 DataLoader worker process"
        target = "target >= 1.30" if draft else "target >= 0.90"
        name = f"pipeline, draft {'on ' if draft else 'off'}, {where}"
        runs = f" [{', '.join(f'{x:.2f}' for x in each)}]" if len(each) > 1 else ""
        lines.append(f"{name:<52}{rate:>9.1f}{ratio:>7.2f}   ({target}){runs}")
    lines.append(
        f"worker RSS: {r['rss_warm_mib']:.1f} MiB after warm-up, {r['rss_end_mib']:.1f} MiB after "
        f"{args.memory_samples} samples: growth {100 * r['rss_growth']:+.2f}%   (target <= +5%)"
    )
    return "\n".join(lines)
