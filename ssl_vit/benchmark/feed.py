"""`ssl-vit bench feed`: images/s of a training job's whole input path, per number of DataLoader
workers, against the training step's own rate (`ssl-vit bench step`) on the same device.

The input path as `ssl-vit fit` runs it: JPEG shards in a temporary local directory (scikit-image's
photos, randomly cropped and re-encoded at `--stored` size and `--quality`, `ssl_vit.benchmark.data`), or
the user's own (`--shards`, e.g. what `ssl-vit data convert --max-side` wrote) ->
`ShardDataModule`'s training stream (tar reading, shuffle, decode, random resized crop with the
imagenet1k recipes' scale (0.2, 1), flip, uint8 batches) through its DataLoader workers -> each batch
moved to the device as Lightning moves it and passed through the data module's
`on_after_batch_transfer` (normalised, as training gets it). Each row says which path its images took:
the share decoded on the CPU (all of them with `--decode cpu`; with `--decode device`, the PNGs, CMYK
JPEGs and the images read as arrays: npy, TIFF, 16-bit PNG, other band counts than 3, whose channels,
mean and std come from the shards' manifest). The step is not run meanwhile: this is
what the workers can deliver, to be read against what the step consumes.

Each worker's first `WARMUP_BATCHES` batches are not timed (process start-up, first shards opened,
shuffle buffer primed); then `batches` per worker are, the device synchronised at both ends. The
DataLoader takes batches from its workers in turn, so the timed window holds whole rounds of them.

Each row also gives the batches' class mix when the shards are labelled (`ssl_vit.data.stream.class_mix`:
distinct classes per batch from the first batch on, against a uniform shuffle of the classes the
manifest counts; how often neighbours share a class, against the same): what the order the shards were
written in does to the batches, which `benchmarks/stream_mix.py` measures on class-sorted layouts.

`feed / step` above 1: the workers deliver faster than the step consumes, the accelerator never waits
for data. Each side is timed alone: on a CPU device, where a training run's step and workers share
the cores, the ratio only says which of the two is far the slower.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable

import torch
from lightning_fabric.utilities.apply_func import move_data_to_device

from ssl_vit.benchmark.data import make_jpegs, write_shards
from ssl_vit.data import ShardDataModule
from ssl_vit.data.format.manifest import channel_choices, read_manifest
from ssl_vit.data.options import Augment
from ssl_vit.data.stream.class_mix import batch_mix, format_mix
from ssl_vit.data.stream.urls import expand

CROP_SCALE = (0.2, 1.0)  # the imagenet1k recipes' (MAE's pretraining crop)
IMAGES, SHARDS = 256, 8  # distinct JPEGs, and the tars holding them (the stream resamples them)
WARMUP_BATCHES = 2  # per worker


def default_workers() -> list[int]:
    """1, 2, 4, ... up to the cores this process may run on, and that number itself."""
    cores = len(os.sched_getaffinity(0))
    counts = [2**k for k in range(cores.bit_length()) if 2**k <= cores]
    return counts + ([cores] if counts[-1] != cores else [])


def feed_rate(
    urls: str, workers: int, batch_size: int, img_size: int, batches: int, device: torch.device, decode: str
) -> tuple[float, float, dict | None]:
    """Images/s from `workers` DataLoader workers (0: the main process decodes) to normalised batches
    on `device`, over `batches` timed batches per worker; the share of those images decoded on the
    CPU; and the class mix of all the batches (None for shards of fewer than 2 labelled classes)."""
    rounds = max(1, workers)  # batches per round of the DataLoader over its workers
    data = ShardDataModule(
        **band_args(urls),
        train_urls=urls,
        batch_size=batch_size,
        num_workers=workers,
        image_size=img_size,
        augment=Augment(crop_scale=CROP_SCALE),
        train_batches=(WARMUP_BATCHES + batches) * rounds,
        # only when asked for: decoding on the CPU is what a ShardDataModule without `decode` does
        decode=decode,
    )
    data.setup("fit")
    on_cpu, labels = 0, []
    for i, batch in enumerate(data.train_dataloader()):
        labels.append(batch["label"].tolist())
        batch = data.on_after_batch_transfer(move_data_to_device(batch, device), 0)
        if i >= WARMUP_BATCHES * rounds:  # every image on the CPU unless the device decoded some
            on_cpu += int(batch.get("decoded_on_cpu", len(batch["key"])))
        if i == WARMUP_BATCHES * rounds - 1:
            _sync(device)
            start = time.perf_counter()
    _sync(device)
    images = batches * rounds * batch_size
    return images / (time.perf_counter() - start), on_cpu / images, _mix(labels, data.manifest)


def _mix(labels: list[list[int]], manifest: dict | None) -> dict | None:
    counts = [n for c, n in (manifest or {}).get("class_counts", {}).items() if int(c) >= 0] or None
    if len({label for batch in labels for label in batch if label >= 0}) < 2:
        return None
    return batch_mix(labels, counts)


def band_args(urls: str) -> dict:
    """The data module's `channels`, `mean` and `std` for shards of another band count than RGB's, from
    their manifest (the manifest's band_stats, else 0 and 1: the rate does not depend on them)."""
    manifest = read_manifest(expand(urls, "--shards")[0]) or {}
    choices = channel_choices(manifest)
    if not choices or 3 in choices:
        return {}
    channels, auto = choices[0], "band_stats" in manifest
    return {
        "channels": channels,
        "mean": "auto" if auto else (0.0,) * channels,
        "std": "auto" if auto else (1.0,) * channels,
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_feed(
    workers: list[int],
    *,
    stored: tuple[int, int],
    quality: int,
    img_size: int,
    batch_size: int,
    batches: int,
    device: str,
    decode: str,
    shards: str | None = None,
    progress: Callable[[str], None] = lambda _: None,
) -> dict:
    """The feed rate for each number of `workers`, as a report (`step_rates` adds the step's side): over
    `shards` when given, else over JPEGs made at `stored` size and `quality`."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="ssl-vit-bench-feed-") as tmp:
        urls = shards or write_shards(make_jpegs(IMAGES, stored, quality=quality), tmp, SHARDS)
        for n in workers:
            rate, on_cpu, mix = feed_rate(
                urls, n, batch_size, img_size, batches, torch.device(device), decode
            )
            rows.append(
                {
                    "workers": n,
                    "images_per_s": rate,
                    "per_worker": rate / max(1, n),
                    "on_cpu": on_cpu,
                    "mix": mix,
                }
            )
            progress(f"{n} workers: {rate:.1f} img/s, {100 * on_cpu:.0f}% decoded on the CPU")
            if mix is not None:
                progress(f"{n} workers: {format_mix(mix)}")
    source = {"shards": shards} if shards else {"stored": list(stored), "quality": quality, "images": IMAGES}
    config = {
        **source, "img_size": img_size,
        "crop_scale": list(CROP_SCALE), "batch_size": batch_size, "decode": decode, "device": device,
        "batches": batches, "warmup_batches": WARMUP_BATCHES, "cores": len(os.sched_getaffinity(0)),
    }  # fmt: skip
    return {"config": config, "rows": rows}


def step_rates(report: dict, step_reports: list[dict]) -> dict:
    """`report` with the step's side: the rate of every task of `step_reports` (`bench step`'s
    reports, one per compile setting) and each row's `vs_step`, its feed rate over each."""
    steps = {}
    for step in step_reports:
        compiled = ", compiled" if step["config"]["compile"] else ""
        for row in step["rows"]:
            if row["name"] != "plain":
                steps[row["name"] + compiled] = row["images_per_s"]
    rows = [
        {**row, "vs_step": {name: row["images_per_s"] / rate for name, rate in steps.items()}}
        for row in report["rows"]
    ]
    return {**report, "step": steps, "step_reports": step_reports, "rows": rows}


def format_feed(report: dict) -> str:
    """The report as a Markdown table (also what `ssl-vit bench feed` prints)."""
    c = report["config"]
    source = (
        f"shards {c['shards']}"
        if "shards" in c
        else f"{c['images']} JPEGs {c['stored'][0]}x{c['stored'][1]} quality {c['quality']}"
    )
    steps = report["step"]
    head = (
        f"{source}, crop {c['img_size']} scale "
        f"({c['crop_scale'][0]:g}, {c['crop_scale'][1]:g}), batch {c['batch_size']}, decode {c['decode']}, "
        f"normalised on {c['device']}; {c['batches']} timed batches per worker after "
        f"{c['warmup_batches']}; {c['cores']} cores\n"
        f"step (bench step, img/s): " + ", ".join(f"{name} {rate:.1f}" for name, rate in steps.items())
    )
    lines = [
        head,
        "",
        "| workers | img/s | per worker | decoded on the CPU | "
        + " | ".join(f"feed / step ({name})" for name in steps)
        + " |",
        "|---:|---:|---:|---:|" + "---:|" * len(steps),
    ]
    for row in report["rows"]:
        workers = "0 (in-process)" if row["workers"] == 0 else str(row["workers"])
        cells = [
            workers,
            f"{row['images_per_s']:.1f}",
            f"{row['per_worker']:.1f}",
            f"{100 * row['on_cpu']:.0f}%",
        ]
        cells += [f"{ratio:.2f}" for ratio in row["vs_step"].values()]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "feed / step above 1: the step never waits for data"]
    return "\n".join(lines)
