"""`ssl-vit data inspect` and `ssl-vit bench data`, end to end through the CLI."""

import shutil

import numpy as np
import pytest
from data_helpers import write_broken_shard

from ssl_vit.data.inspect import inspect_urls


@pytest.mark.slow
def test_inspect_good_broken_and_missing(cli, digits_shards, tmp_path):
    good = cli("data", "inspect", f"{digits_shards}/val-{{000000..000003}}.tar")
    lines = good.stdout.splitlines()
    assert "359 good samples in 4 shards, 10 classes, 0 problems" in good.stdout
    assert lines[1].split()[1:3] == ["100", "0"]  # first shard: 100 samples, 0 bad
    assert lines[4].split()[1] == "59"

    broken = tmp_path / "set"
    shutil.copytree(digits_shards, broken)
    write_broken_shard(broken / "val-000004.tar", np.random.default_rng(0))
    proc = cli("data", "inspect", f"{broken}/val-{{000000..000004}}.tar", "--workers", "2", check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    for key in ("broken-1", "broken-2", "broken-3", "broken-4"):
        assert f"val-000004.tar: {key}:" in proc.stdout
    assert "broken-0" not in proc.stdout.split("problems:")[1]

    proc = cli("data", "inspect", f"{tmp_path}/nothing-000000.tar", check=False)
    assert (
        proc.returncode == 2 and proc.stderr.startswith("ssl-vit: error:") and "no such file" in proc.stderr
    )


def test_inspect_checks_counts_against_the_manifest(digits_shards, tmp_path):
    shutil.copytree(digits_shards, tmp_path / "set")
    manifest = tmp_path / "set" / "val.json"
    manifest.write_text(manifest.read_text().replace('"num_samples": 59', '"num_samples": 60'))
    reports, problems = inspect_urls(f"{tmp_path}/set/val-{{000000..000003}}.tar")
    assert [r.samples for r in reports] == [100, 100, 100, 59]
    assert problems == [f"{tmp_path}/set/val-000003.tar: 59 samples, the manifest says 60"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_data_smoke(cli):
    proc = cli(
        "bench",
        "data",
        "--images",
        "8",
        "--samples",
        "64",
        "--memory-samples",
        "160",
        "--image-size",
        "32",
        "--stored",
        "128x96",
        "--batch-size",
        "8",
    )
    out = proc.stdout
    assert "bare PIL loop (reference)" in out
    rows = [line for line in out.splitlines() if "(target >=" in line]
    assert [("draft on" in r, "in-process" in r) for r in rows] == [
        (False, True),
        (True, True),
        (False, False),
        (True, False),
    ]
    ratios = [float(row.split("(target")[0].split()[-1]) for row in rows]
    assert all(r > 0 for r in ratios)  # numbers are printed, not judged: no thresholds in tests
    assert "worker RSS" in out and "growth" in out
