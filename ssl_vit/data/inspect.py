"""`ssl-vit data inspect URLS`: samples and classes per shard, undecodable samples, segmentation masks,
a verdict.

Each sample is decoded the way training decodes it (full size, no draft; with the band count and dtype
its manifest records, else as stored), its label and its mask (`seg.png`) read and checked as training
checks them, against its manifest's class count (`parse_label`, `read_mask`); a set is broken when any
sample or shard fails, or when shard counts disagree with the manifest. Each shard is checked against the
manifest of its own directory and split, so one command can inspect several splits or directories.

`--stats` adds the per-band statistics (`ssl_vit.data.format.band_stats`) to each manifest that has none,
over a bounded, deterministic sample of the inspected images (`plan_stats`).
"""

from __future__ import annotations

import json
import math
import multiprocessing
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from ssl_vit.data.format.band_stats import BandStats, merged
from ssl_vit.data.format.manifest import channel_choices, manifest_url, read_manifest
from ssl_vit.data.format.masks import IGNORE_INDEX, pixel_counts, read_mask
from ssl_vit.data.format.members import MAX_IMAGE_PIXELS, RGB, BadSample, Bands, parse_label
from ssl_vit.data.stream.class_mix import uniform_distinct
from ssl_vit.data.stream.pipeline import iter_samples
from ssl_vit.data.stream.samples import layout, open_image, pixels
from ssl_vit.data.stream.urls import check_urls, expand
from ssl_vit.errors import UserError
from ssl_vit.storage.atomic import write_text
from ssl_vit.storage.remote import local_path


@dataclass
class ShardReport:
    url: str
    samples: int = 0
    classes: Counter = field(default_factory=Counter)
    masks: int = 0  # good samples with a mask
    mask_pixels: Counter = field(default_factory=Counter)  # class (or 255) -> pixels, over those masks
    bad: list[str] = field(default_factory=list)  # "key: reason", one per unusable sample
    errors: list[str] = field(default_factory=list)  # the shard's own failures (unreadable, truncated tar)
    stats: BandStats | None = None  # of the images sampled for `--stats`
    dtypes: set[str] = field(default_factory=set)  # of those images

    def stats_images(self) -> int:
        return self.stats.images if self.stats is not None else 0


@dataclass(frozen=True)
class StatsSample:
    """Which good images of a shard `--stats` reads: every `every`-th, at most `quota`."""

    every: int
    quota: int


def inspect_shard(
    url: str,
    num_classes: int | None = None,
    masks: bool = False,
    bands: Bands = RGB,
    sample: StatsSample | None = None,
) -> ShardReport:
    """Read and decode every sample of `url` as `bands` says (the manifest's channels and dtype); a label
    of `num_classes` or more (the manifest's class count) is a bad sample, as the training stream skips
    it, and so is a mask that training would skip (`masks`: the manifest says every sample has one).
    With `sample`, the statistics of the bands of the good images it picks."""
    report = ShardReport(url)

    def on_error(exn: Exception) -> bool:
        report.errors.append(f"(shard) {' '.join(str(a) for a in exn.args if a is not None)}")
        return True

    for sample_ in iter_samples([url], on_error):
        try:
            label = parse_label(sample_, num_classes)
            opened = open_image(sample_, bands)
            mask = read_mask(sample_, num_classes, masks, opened.size, MAX_IMAGE_PIXELS)
            array = pixels(opened, bands)
        except BadSample as err:
            report.bad.append(f"{sample_['__key__']}: {err}")
            continue
        if sample is not None and report.samples % sample.every == 0 and report.stats_images() < sample.quota:
            report.stats = _merged(report.stats, BandStats.of(array), f"{url}: sample {sample_['__key__']}")
            report.dtypes.add(layout(opened.image, bands)[1])
        report.samples += 1
        report.classes[label] += 1
        if mask is not None:
            report.masks += 1
            report.mask_pixels.update(pixel_counts(mask))
    return report


def manifest_bands(manifest: dict | None) -> Bands:
    """How `inspect` reads the images of a manifest's set: with the channels and dtype it records
    (a grey 8-bit set as RGB, as training reads it by default), else as stored."""
    choices = channel_choices(manifest or {})
    return Bands(max(choices) if choices else None, (manifest or {}).get("dtype"))


def inspect_urls(
    urls: str | list[str], workers: int = 1, stats_images: int | None = None
) -> tuple[list[ShardReport], list[str]]:
    """Reports per shard, and the problems of the whole set (bad samples, broken shards, manifest
    mismatches), each shard checked against the manifest next to it. With `stats_images`, each shard
    whose manifest has no `band_stats` also samples the statistics of its bands (`plan_stats`)."""
    urls = expand(urls, "URLS")
    check_urls(urls, "URLS")
    manifests: dict[str | None, dict | None] = {}  # manifest URL -> manifest, each read once
    for url in urls:
        if manifest_url(url) not in manifests:
            manifests[manifest_url(url)] = read_manifest(url)
    own = [manifests[manifest_url(u)] for u in urls]
    plan = plan_stats(urls, own, stats_images) if stats_images else {}
    jobs = [
        (
            u,
            m and m["num_classes"],
            bool(m and m.get("masks") is True),
            manifest_bands(m),
            plan.get(u),
        )
        for u, m in zip(urls, own)
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


def plan_stats(urls: list[str], own: list[dict | None], images: int) -> dict[str, StatsSample]:
    """`--stats`: for each manifest without `band_stats`, which images of its inspected shards to read:
    `images` at most, spread over the shards (an equal share each) and, within a shard, evenly over its
    samples (every k-th, k from the manifest's count of the shard). Deterministic: the same shards give
    the same statistics."""
    groups: dict[str, list[str]] = {}
    for url, manifest in zip(urls, own):
        if manifest is not None and "band_stats" not in manifest:
            groups.setdefault(manifest_url(url), []).append(url)
    plan = {}
    for shard_urls in groups.values():
        counts = {s["url"]: s["num_samples"] for s in read_manifest(shard_urls[0])["shards"]}
        for i, url in enumerate(shard_urls):
            quota = images // len(shard_urls) + (i < images % len(shard_urls))
            held = counts.get(PurePosixPath(url).name)
            every = max(1, math.ceil(held / quota)) if held and quota else 1
            plan[url] = StatsSample(every, quota)
    return plan


def add_band_stats(reports: list[ShardReport]) -> list[str]:
    """Each sampled manifest with `band_stats` (and `channels` and `dtype` where it has none) added from
    the reports' statistics, rewritten in one step (a temporary file moved over it); a remote one cannot
    be written from here: the line says so and gives the statistics. Returns one line per manifest."""
    lines = []
    groups: dict[str, list[ShardReport]] = {}
    for r in reports:
        if r.stats is not None:
            groups.setdefault(manifest_url(r.url), []).append(r)
    for url, group in groups.items():
        stats = None
        for r in group:
            stats = _merged(stats, r.stats, f"shard {r.url}")
        dtypes = set().union(*(r.dtypes for r in group))
        if len(dtypes) > 1:
            lines.append(
                f"{url}: no band_stats added: its images have several dtypes, {', '.join(sorted(dtypes))}"
            )
            continue
        manifest = read_manifest(group[0].url)
        dtype = manifest.get("dtype", dtypes.pop())
        band_stats = stats.manifest(dtype)
        updated = {**manifest, "channels": manifest.get("channels", stats.channels), "dtype": dtype}
        updated["band_stats"] = band_stats
        path = local_path(url)
        if path is None:
            lines.append(
                f"{url}: a remote manifest, which this command cannot write: its band_stats over "
                f"{stats.images} images are {json.dumps(band_stats)}"
            )
            continue
        _rewrite(path, updated, stats.images)
        lines.append(
            f"{url}: band_stats added, over {stats.images} images ({stats.channels} bands of {dtype})"
        )
    return lines


def _merged(stats: BandStats | None, more: BandStats, what: str) -> BandStats:
    """`stats` and `more` merged (a grey image beside colour ones stands for its bands, as training reads
    it); one line naming `what` (`more`'s images) when their band counts differ otherwise."""
    try:
        return merged([stats, more])
    except ValueError:
        raise UserError(
            f"--stats: {what} has {more.channels} bands where the images before it have {stats.channels}: "
            "band_stats are of one band count: convert the set with one (`ssl-vit data convert`), or add "
            "the manifest's `channels`, which reads the images of another count as bad samples"
        ) from None


def _rewrite(path: Path, manifest: dict, images: int) -> None:
    """`manifest` put in place at `path` whole, or one line (giving the statistics, which took a pass over
    the images) when the folder cannot be written: a read-only mount of a shared dataset, say."""
    try:
        write_text(path, json.dumps(manifest, indent=1) + "\n")
    except OSError as err:
        raise UserError(
            f"{path}: band_stats cannot be added ({err.strerror or err}): copy the shards and their manifest "
            f"to a folder you can write, or add to it by hand the band_stats over {images} images: "
            f"{json.dumps(manifest['band_stats'])}"
        ) from None


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
    lines += class_order(reports, total)
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


def class_order(reports: list[ShardReport], total: Counter) -> list[str]:
    """The shards' class mix: classes per shard against a shard of a uniformly shuffled set of the same
    classes (`class_mix.uniform_distinct`), and one warning line when the shards are sorted by class
    (a mix below half of it), naming the fixes."""
    counts = [v for c, v in total.items() if c >= 0]
    shards = [r for r in reports if sum(v for c, v in r.classes.items() if c >= 0)]
    if len(counts) < 2 or len(shards) < 2:
        return []
    held = sum(len([c for c in r.classes if c >= 0]) for r in shards) / len(shards)
    uniform = sum(uniform_distinct(counts, sum(r.classes.values())) for r in shards) / len(shards)
    line = f"class mix: {held:.1f} classes per shard, {uniform:.1f} in the shards of a shuffled set"
    if held >= 0.5 * uniform:
        return [line]
    return [
        line,
        "warning: the shards are sorted by class: training on local shards mixes them anyway (its epoch is "
        "one random order of every sample), but remote or gzip-compressed shards are read a few at a "
        "time and give batches of a few classes: reconvert with `ssl-vit data convert` (--order random, "
        "its default), or keep the shards local and uncompressed",
    ]


def _classes(counts: Counter) -> str:
    return " ".join(f"{k}:{v}" for k, v in sorted(counts.items())) or "-"
