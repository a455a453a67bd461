"""`ssl-vit data inspect URLS`: samples and classes per shard, undecodable samples, segmentation masks,
a verdict.

Each sample is decoded the way training decodes it (full size, no draft), its label parsed and its
mask (`seg.png`) read and checked as training checks it; a set is broken when any sample or shard
fails, when a label is beyond its manifest's class count, when a mask does not decode, does not match
its image's size, holds a class beyond the manifest's count (other than 255, ignored) or is missing
where the manifest says every sample has one, or when shard counts disagree with the manifest. Each
shard is checked against the manifest of its own directory and split, so one command can inspect
several splits or directories.
"""

from __future__ import annotations

import multiprocessing
from collections import Counter
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from ssl_vit.data.masks import IGNORE_INDEX, pixel_counts
from ssl_vit.data.samples import BadSample, check_mask_size, decode_image, parse_label, read_mask
from ssl_vit.data.stream import iter_samples
from ssl_vit.data.transforms import decode
from ssl_vit.data.urls import check_urls, expand, manifest_url, read_manifest


@dataclass
class ShardReport:
    url: str
    samples: int = 0
    classes: Counter = field(default_factory=Counter)
    masks: int = 0  # good samples with a mask
    mask_pixels: Counter = field(default_factory=Counter)  # class (or 255) -> pixels, over those masks
    bad: list[str] = field(default_factory=list)  # "key: reason", one per unusable sample
    errors: list[str] = field(default_factory=list)  # the shard's own failures (unreadable, truncated tar)


def inspect_shard(url: str, num_classes: int | None = None, masks: bool = False) -> ShardReport:
    """Read and decode every sample of `url`; a label of `num_classes` or more (the manifest's class
    count) is a bad sample, as the training stream skips it, and so is a mask that training would skip
    (`masks`: the manifest says every sample has one)."""
    report = ShardReport(url)

    def on_error(exn: Exception) -> bool:
        report.errors.append(f"(shard) {' '.join(str(a) for a in exn.args if a is not None)}")
        return True

    for sample in iter_samples([url], on_error):
        try:
            label = parse_label(sample, num_classes)
            image = decode_image(sample, decode)
            mask = read_mask(sample, num_classes, required=masks)
            if mask is not None:
                check_mask_size(image.size, mask)
        except BadSample as err:
            report.bad.append(f"{sample['__key__']}: {err}")
            continue
        report.samples += 1
        report.classes[label] += 1
        if mask is not None:
            report.masks += 1
            report.mask_pixels.update(pixel_counts(mask))
    return report


def inspect_urls(urls: str | list[str], workers: int = 1) -> tuple[list[ShardReport], list[str]]:
    """Reports per shard, and the problems of the whole set (bad samples, broken shards, manifest
    mismatches), each shard checked against the manifest next to it."""
    urls = expand(urls, "URLS")
    check_urls(urls, "URLS")
    manifests: dict[str | None, dict | None] = {}  # manifest URL -> manifest, each read once
    for url in urls:
        if manifest_url(url) not in manifests:
            manifests[manifest_url(url)] = read_manifest(url)
    own = [manifests[manifest_url(u)] for u in urls]
    jobs = [
        (u, m["num_classes"] if m else None, bool(m and m.get("masks") is True)) for u, m in zip(urls, own)
    ]
    if workers > 1:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            reports = pool.starmap(inspect_shard, jobs)
    else:
        reports = [inspect_shard(*job) for job in jobs]
    problems = [f"{r.url}: {bad}" for r in reports for bad in r.errors + r.bad]
    for r, manifest in zip(reports, own):
        expected = {s["url"]: s["num_samples"] for s in manifest["shards"]} if manifest else {}
        name = PurePosixPath(r.url).name
        read = r.samples + len(r.bad)  # samples in the shard, usable or not; a shard error is none
        if name in expected and expected[name] != read:
            problems.append(f"{r.url}: {read} samples, the manifest says {expected[name]}")
    return reports, problems


def format_report(reports: list[ShardReport], problems: list[str]) -> str:
    width = max(len(r.url) for r in reports)
    lines = [f"{'shard':<{width}}  {'samples':>7}  {'bad':>4}  classes (label:count)"]
    total = Counter()
    for r in reports:
        total += r.classes
        bad = len(r.bad) + len(r.errors)
        lines.append(f"{r.url:<{width}}  {r.samples:>7}  {bad:>4}  {_classes(r.classes)}")
    n = sum(r.samples for r in reports)
    labelled = len([c for c in total if c >= 0])
    lines.append(f"{n} good samples in {len(reports)} shards, {labelled} classes, {len(problems)} problems")
    masks = sum(r.masks for r in reports)
    if masks:
        pixels = sum((r.mask_pixels for r in reports), Counter())
        classes = len([c for c in pixels if c != IGNORE_INDEX])
        lines.append(
            f"{masks} of them with a mask (seg.png), {classes} classes in the masks (class:pixels, "
            f"{IGNORE_INDEX} ignored): {_classes(pixels)}"
        )
    if problems:
        lines.append("problems:")
        lines += [f"  {p}" for p in problems]
    return "\n".join(lines)


def _classes(counts: Counter) -> str:
    return " ".join(f"{k}:{v}" for k, v in sorted(counts.items())) or "-"
