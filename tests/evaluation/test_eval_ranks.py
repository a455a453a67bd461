"""`ssl-vit compare` under torchrun (2 gloo processes): the checkpoints are spread over the ranks, and the
table is the one a single process writes."""

import re
import subprocess
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
import yaml
from cli_client import PRELUDE_ENV
from cli_helpers import failing_evaluation, free_port, run_cli, torchrun, torchrun_env

from ssl_vit.models.vit import ViTConfig
from ssl_vit.tasks import MaskedPatchPretraining, SupervisedPretraining

ROOT = Path(__file__).resolve().parents[2]
BACKBONE = {"variant": "S/8", "img_size": 32, "width": 32, "depth": 1, "heads": 2}


def save(model, path) -> str:
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, max_steps=0)
    trainer.strategy.connect(model)
    trainer.save_checkpoint(path)
    return str(path)


FAIL_BROKEN = failing_evaluation("broken.ckpt")


def ssl_vit(args: list[str], ranks: int) -> subprocess.CompletedProcess:
    """`ssl-vit ARGS` alone or as `ranks` processes through torchrun; one thread each, so both see the same
    arithmetic."""
    if ranks == 1:
        return run_cli(*args, cwd=ROOT, env={"OMP_NUM_THREADS": "1"}, check=False, prelude=FAIL_BROKEN)
    env = {**torchrun_env(), PRELUDE_ENV: FAIL_BROKEN}
    launch = torchrun("--nnodes", "1", "--nproc_per_node", str(ranks), "--master_addr", "127.0.0.1",
                      "--master_port", str(free_port()))  # fmt: skip
    return subprocess.run([*launch, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_ranks_share_the_checkpoints_and_write_the_same_table(digits_shards, tmp_path):
    torch.manual_seed(0)
    config = ViTConfig(**BACKBONE)
    checkpoints = {
        "mpp": save(MaskedPatchPretraining(config, preset="vit_mpp"), tmp_path / "mpp.ckpt"),
        "broken": save(MaskedPatchPretraining(config, preset="vit_mpp"), tmp_path / "broken.ckpt"),
        "sup": save(SupervisedPretraining(config, num_classes=10), tmp_path / "sup.ckpt"),
    }
    data = {"train_urls": str(digits_shards / "val-00000{0..1}.tar"),
            "test_urls": str(digits_shards / "val-00000{2..3}.tar"),
            "image_size": 32, "num_workers": 0}  # fmt: skip
    suite = {
        "backbone": BACKBONE,
        "data": data,
        "protocols": [
            {"name": "fewshot", "kind": "fewshot", "feature": "mean", "shots": [1, 5], "seeds": [0, 1]},
            {"name": "knn", "kind": "knn", "k": 5},
            {"name": "linear", "kind": "linear_probe", "epochs": 1, "lrs": [0.1]},
        ],
    }
    (tmp_path / "suite.yaml").write_text(yaml.safe_dump(suite))
    given = [f"{k}={v}" for k, v in checkpoints.items()]
    group = f"group={checkpoints['mpp']},{checkpoints['sup']}"  # its two runs land on different ranks
    suite_file = str(tmp_path / "suite.yaml")
    args = ["compare", *given, group, "--scratch", "--baseline", "mpp", "--suite", suite_file]

    alone = ssl_vit([*args, "--out", str(tmp_path / "alone")], ranks=1)
    spread = ssl_vit([*args, "--out", str(tmp_path / "spread")], ranks=2)
    assert alone.returncode == 1 and spread.returncode == 1, spread.stderr[-3000:]  # `broken` failed

    # runs dealt round-robin: mpp, sup and group/2 to rank 0, broken, group/1 and scratch to rank 1
    # (each rank's progress lines say which run it is on; `broken` fails before its first step)
    for name, rank in (("mpp", 0), ("sup", 0), ("group/1", 1), ("group/2", 0), ("scratch", 1)):
        assert re.search(rf"compare \(rank {rank} of 2\) \[\d/3\] {name}: ", spread.stdout), name
    assert "(rank " not in alone.stdout
    # rank 0 wrote everything, once: the same tables (intervals and paired differences, from the
    # per-image correctness gathered from both ranks), the attention distances each rank measured on
    # its checkpoints, every checkpoint's results and the failure
    for name in ("results.csv", "results.md", "attention_distance.json"):
        assert (tmp_path / "spread" / name).read_text() == (tmp_path / "alone" / name).read_text(), name
    assert spread.stdout.count("| checkpoint |") == 1, spread.stdout[-4000:] + spread.stderr[-4000:]
    assert (tmp_path / "spread/broken/error.txt").is_file()
    assert "Paired differences against mpp" in (tmp_path / "spread/results.md").read_text()
    for name in ("mpp", "sup", "group/1", "group/2", "scratch"):
        assert (tmp_path / "spread" / name / "results.json").is_file()
