"""A 2-process DDP `fit` on unequal shards completes; every rank steps the configured batches."""

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import run_lightning_ddp
from data_helpers import write_broken_shard, write_shards

SCRIPT = Path(__file__).parent / "ddp_fit.py"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_process_ddp_fit_on_unequal_shards(tmp_path):
    train_urls, _ = write_shards(tmp_path / "train", [7, 2, 5], prefix="train")
    val_urls, val_keys = write_shards(tmp_path / "val", [4, 1, 6], prefix="val", seed=1)
    good, bad = write_broken_shard(tmp_path / "val" / "val-000003.tar", np.random.default_rng(2))
    val_urls = val_urls.replace("000002}", "000003}")
    run_lightning_ddp(SCRIPT, train_urls, val_urls, str(tmp_path), timeout=280)

    ranks = [json.loads((tmp_path / f"rank{r}-cpu.json").read_text()) for r in range(2)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    for r in ranks:
        assert r["train_batches"] == [4, 4]  # both epochs, both ranks: lockstep
        # metrics sync across ranks and count each validation sample once; skips are a metric too
        assert r["metrics"]["val/samples"] == len(val_keys) + len(good)
        assert r["metrics"]["data/skipped_val"] == bad
    seen = Counter(k for r in ranks for k in r["val_keys"])
    assert sorted(seen) == sorted(val_keys + good) and set(seen.values()) == {2}  # once per epoch


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_device_decoding_keeps_ddp_in_lockstep_on_the_samples_of_cpu_decoding(tmp_path):
    train_urls, _ = write_shards(tmp_path / "train", [9, 4, 7], prefix="train", fmt="jpg")
    val_urls, _ = write_shards(tmp_path / "val", [4, 3], prefix="val", seed=1)
    run_lightning_ddp(SCRIPT, train_urls, val_urls, str(tmp_path), "cpu,device", timeout=300)
    runs = {
        decode: [json.loads((tmp_path / f"rank{r}-{decode}.json").read_text()) for r in range(2)]
        for decode in ("cpu", "device")
    }
    for cpu, device in zip(runs["cpu"], runs["device"], strict=True):
        assert device["train_batches"] == [4, 4]  # both epochs, both ranks: lockstep
        assert device["train_keys"] == cpu["train_keys"]  # the same samples in the same order
        assert device["metrics"]["data/decoded_on_cpu_train"] == 0  # every JPEG decoded on the device
        assert "data/decoded_on_cpu_train" not in cpu["metrics"]
