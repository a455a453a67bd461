"""`ssl-vit data inspect URLS`: samples and classes per shard, undecodable samples, a verdict.

Each sample is decoded the way training decodes it (full size, no draft) and its label parsed; a
set is broken when any sample or shard fails, or when shard counts disagree with the manifest.
"""

from __future__ import annotations

import multiprocessing
from collections import Counter
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from ssl_vit.data.samples import BadSample, decode_image, parse_label
from ssl_vit.data.stream import iter_samples
from ssl_vit.data.transforms import decode
from ssl_vit.data.urls import check_urls, expand, read_manifest


@dataclass
class ShardReport:
    url: str
    samples: int = 0
    classes: Counter = field(default_factory=Counter)
    bad: list[str] = field(default_factory=list)  # "key: reason"


def inspect_shard(url: str) -> ShardReport:
    report = ShardReport(url)

    def on_error(exn: Exception) -> bool:
        report.bad.append(f"(shard) {' '.join(str(a) for a in exn.args if a is not None)}")
        return True

    for sample in iter_samples([url], on_error):
        try:
            label = parse_label(sample)
            decode_image(sample, decode)
        except BadSample as err:
            report.bad.append(f"{sample['__key__']}: {err}")
            continue
        report.samples += 1
        report.classes[label] += 1
    return report


def inspect_urls(urls: str | list[str], workers: int = 1) -> tuple[list[ShardReport], list[str]]:
    """Reports per shard, and the problems of the whole set (bad samples, manifest mismatches)."""
    urls = expand(urls, "URLS")
    check_urls(urls, "URLS")
    if workers > 1:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            reports = pool.map(inspect_shard, urls)
    else:
        reports = [inspect_shard(u) for u in urls]
    problems = [f"{r.url}: {bad}" for r in reports for bad in r.bad]
    manifest = read_manifest(urls[0])
    if manifest:
        expected = {s["url"]: s["num_samples"] for s in manifest["shards"]}
        for r in reports:
            name = PurePosixPath(r.url).name
            if name in expected and expected[name] != r.samples + len(r.bad):
                problems.append(
                    f"{r.url}: {r.samples + len(r.bad)} samples, the manifest says {expected[name]}"
                )
    return reports, problems


def format_report(reports: list[ShardReport], problems: list[str]) -> str:
    width = max(len(r.url) for r in reports)
    lines = [f"{'shard':<{width}}  {'samples':>7}  {'bad':>4}  classes (label:count)"]
    total = Counter()
    for r in reports:
        total += r.classes
        lines.append(f"{r.url:<{width}}  {r.samples:>7}  {len(r.bad):>4}  {_classes(r.classes)}")
    n = sum(r.samples for r in reports)
    labelled = len([c for c in total if c >= 0])
    lines.append(f"{n} good samples in {len(reports)} shards, {labelled} classes, {len(problems)} problems")
    if problems:
        lines.append("problems:")
        lines += [f"  {p}" for p in problems]
    return "\n".join(lines)


def _classes(counts: Counter) -> str:
    return " ".join(f"{k}:{v}" for k, v in sorted(counts.items())) or "-"
