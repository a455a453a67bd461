"""`make study`: the Fashion-MNIST script, the equal budget of its recipes, and the whole pipeline end
to end (data -> eight pretraining runs, two at a time -> compare with the claims) at toy size."""

import gzip
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml
from cli_helpers import script_env

from ssl_vit.cli import main
from ssl_vit.evaluation.suite import load_suite
from ssl_vit.report.verdicts import load_claims

ROOT = Path(__file__).resolve().parents[1]
STUDY = ROOT / "recipes" / "study"
METHODS = ("mpp", "mae", "simmim", "supervised")
FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)


def write_idx(folder: Path, train: int, test: int, gzipped: bool = True) -> Path:
    """Fashion-MNIST's four IDX files with random 28 x 28 images, `train` and `test` of them."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", train), ("t10k", test)):
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        labels = np.arange(n, dtype=np.uint8) % 10
        for kind, array, magic in (("images-idx3", images, 3), ("labels-idx1", labels, 1)):
            header = bytes([0, 0, 8, magic]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
            data = header + array.tobytes()
            name = f"{prefix}-{kind}-ubyte"
            if gzipped:
                (folder / f"{name}.gz").write_bytes(gzip.compress(data))
            else:
                (folder / name).write_bytes(data)
    return folder


def print_config(capsys, *configs) -> dict:
    """The whole configuration `ssl-vit fit --config A --config B ... --print_config` resolves to."""
    with pytest.raises(SystemExit):
        main(["fit"] + [arg for config in configs for arg in ("--config", str(config))] + ["--print_config"])
    return yaml.safe_load(capsys.readouterr().out)


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "gpu"])
def test_every_method_gets_the_same_budget_and_backbone(gpu, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    extra = [STUDY / "gpu.yaml"] if gpu else []
    budgets = {}
    for method in METHODS:
        config = print_config(capsys, STUDY / f"{method}.yaml", *extra)
        budgets[method] = (
            config["trainer"]["max_steps"], config["trainer"]["accelerator"], config["trainer"]["precision"],
            config["data"]["init_args"]["batch_size"], config["data"]["init_args"]["image_size"],
            config["model"]["init_args"]["backbone"],
        )  # fmt: skip
        if gpu:  # as every GPU recipe: bf16 and a fused optimizer
            assert config["model"]["init_args"]["training"]["optimizer"]["init_args"]["fused"] is True
    assert len(set(map(repr, budgets.values()))) == 1, budgets
    steps, accelerator, _, batch, size, backbone = budgets["mae"]
    suite = load_suite(STUDY / ("eval_gpu.yaml" if gpu else "eval.yaml"))
    assert {k: v for k, v in backbone.items() if k in ("width", "depth", "heads", "variant")} == {
        "variant": suite.backbone.variant, "width": suite.backbone.width, "depth": suite.backbone.depth,
        "heads": suite.backbone.heads,
    }  # fmt: skip
    assert size == suite.backbone.img_size == 28 and accelerator == ("gpu" if gpu else "cpu")
    assert (steps, batch) == ((2000, 512) if gpu else (1200, 64))


def test_the_claims_name_the_suites_columns_and_the_studys_rows():
    rows = ["mpp", "mae", "simmim", "supervised", "scratch"]
    for suite in ("eval.yaml", "eval_gpu.yaml"):
        claims = load_claims(STUDY / "claims.yaml", load_suite(STUDY / suite), rows)
        assert len(claims) == 6 and sum(len(c.comparisons()) for c in claims) == 12 + 6 + 6 + 3 + 3 + 3


def test_the_finetune_length_runs_differ_from_the_studys_fine_tune_in_length_alone():
    """recipes/study/finetune_length.yaml, which docs/STUDY.md cites for the fine-tune's augmentation,
    batch and steps: its data and backbone are the study's, every run is the study's 10% fine-tune but
    for augmentation, batch, steps and lrs, and the run it calls the study's is the study's 10% column."""
    study, length = load_suite(STUDY / "eval.yaml"), load_suite(STUDY / "finetune_length.yaml")
    assert length.backbone == study.backbone
    assert length.datasets["fmnist_finetune"] == study.datasets["fmnist_finetune"]
    (finetune,) = [p for p in study.protocols if p.KIND == "finetune"]
    varied = ("name", "augmentation", "batch_size", "steps", "lrs", "label_fractions")
    keys = {k: v for k, v in vars(finetune).items() if k not in varied}
    for run in length.protocols:
        assert run.label_fractions == [0.1]
        assert {k: v for k, v in vars(run).items() if k not in varied} == keys
    (now,) = [run for run in length.protocols if run.name == "plain_b16_s800"]
    assert (now.augmentation, now.batch_size, now.lrs) == (
        finetune.augmentation,
        finetune.batch_size,
        finetune.lrs,
    ) and now.steps == finetune.steps_for(0.1)


def test_missing_fashion_mnist_is_one_line_and_writes_nothing(tmp_path):
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / "train-images-idx3-ubyte.gz").write_bytes(b"")
    for folder in (tmp_path / "nowhere", tmp_path / "partial"):
        proc = subprocess.run(
            ["bash", str(ROOT / "data" / "fashion_mnist.sh"), str(tmp_path / "out")],
            env={**os.environ, "FASHION_MNIST": str(folder)}, capture_output=True, text=True,
        )  # fmt: skip
        assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
        assert "dataset-fashion-mnist" in proc.stderr and "FASHION_MNIST=DIR" in proc.stderr
        assert not (tmp_path / "out").exists()


def test_the_script_reads_plain_or_gzipped_idx_files(tmp_path):
    """The training split's IDX files gzipped (as Debian ships them), the test split's plain."""
    client = script_env()  # the script's `ssl-vit`: each command through the fork server
    idx = write_idx(tmp_path / "idx", 30, 10, gzipped=True)
    for packed in idx.glob("t10k-*.gz"):
        packed.with_suffix("").write_bytes(gzip.decompress(packed.read_bytes()))
        packed.unlink()
    out = tmp_path / "shards"
    proc = subprocess.run(
        ["bash", str(ROOT / "data" / "fashion_mnist.sh"), str(out), client["SSLVIT"]],
        env={**os.environ, **client, "FASHION_MNIST": str(idx)}, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load((out / "train.json").read_text())["num_samples"] == 30
    assert yaml.safe_load((out / "test.json").read_text())["num_samples"] == 10


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_make_study_end_to_end_at_toy_size(tmp_path):
    """`make study` as a user runs it, on 600 + 200 random images with a toy ViT and 3 steps per run
    (an extra config after each recipe, a suite that is the study's with its URLs, backbone and lengths
    shrunk): the shards, eight runs, and a comparison with the claims' verdicts."""
    idx = write_idx(tmp_path / "idx", 600, 200)
    shards = tmp_path / "shards"
    train, test = str(shards / "train-000000.tar"), str(shards / "test-000000.tar")
    toy = {
        "trainer": {"max_steps": 3, "callbacks": [{
            "class_path": "ssl_vit.evaluation.monitor.FewShotMonitor",
            "init_args": {"train_urls": train, "test_urls": test,
                          "every_n_steps": 2, "feature": "mean", "shots": [1], "batch_size": 100}}]},
        "data": {"init_args": {"train_urls": train, "batch_size": 16, "num_workers": 0}},
        "model": {"init_args": {"backbone": {"variant": "S/4", "width": 32, "depth": 1, "heads": 2}}},
    }  # fmt: skip
    (tmp_path / "toy.yaml").write_text(yaml.safe_dump(toy))
    suite = yaml.safe_load((STUDY / "eval.yaml").read_text())
    suite["backbone"].update(width=32, depth=1, heads=2)
    for name in ("fmnist", "fmnist_finetune"):
        suite["datasets"][name].update(train_urls=train, test_urls=test, num_workers=0)
    mosaics = tmp_path / "shards_mosaic"  # the script's, beside its OUTDIR: 150 and 50 toy mosaics
    toy_mosaics = {
        "train_urls": str(mosaics / "train-000000.tar"),
        "test_urls": str(mosaics / "test-000000.tar"),
    }
    suite["datasets"]["mosaics"].update(toy_mosaics, num_workers=0)
    suite["resamples"] = 100
    short = {"linear_probe": {"epochs": 1}, "attentive_probe": {"epochs": 1, "heads": 2},
             "linear_seg": {"epochs": 1}, "finetune": {"steps": 2, "lrs": [1.0e-3]}}  # fmt: skip
    # (one lr: 1% of 600 toy images is one image per class, none to hold out for a choice)
    for protocol in suite["protocols"]:
        protocol.update(short.get(protocol["kind"], {}))
    (tmp_path / "suite.yaml").write_text(yaml.safe_dump(suite))

    runs, client = tmp_path / "study", script_env()  # each `ssl-vit` of make's through the fork server
    proc = subprocess.run(
        ["make", "--no-print-directory", "study", f"STUDY={runs}", f"STUDY_SHARDS={shards}",
         f"STUDY_FIT_ARGS=--config {tmp_path / 'toy.yaml'}", f"STUDY_SUITE={tmp_path / 'suite.yaml'}",
         f"SSLVIT={client['SSLVIT']}"],
        cwd=ROOT, env={**os.environ, **client, "FASHION_MNIST": str(idx), "WANDB_MODE": "offline"},
        capture_output=True, text=True, timeout=880,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for method in METHODS:
        for seed in (0, 1):
            assert (runs / f"{method}_{seed}" / "checkpoints" / "last.ckpt").is_file()
            assert f"pretrained {method}_{seed}" in proc.stdout
            config = yaml.safe_load((runs / f"{method}_{seed}" / "config.yaml").read_text())
            assert config["seed_everything"] == seed and config["trainer"]["max_steps"] == 3
    table = (runs / "compare" / "results.md").read_text()
    for row in ("| mpp (2 runs) |", "| mae (2 runs) |", "| simmim (2 runs) |", "| supervised (2 runs) |",
                "| scratch (2 runs) |"):  # fmt: skip
        assert row in table
    assert (
        "seg_miou" in table and "attentive" in table and (runs / "compare" / "training_curves.png").is_file()
    )
    verdicts = (runs / "compare" / "verdicts.md").read_text()
    assert verdicts.count("\n## ") == 6 and verdicts in proc.stdout
    assert len(re.findall(r"^- .*: (holds beyond noise|within noise|reversed)\.$", verdicts, re.M)) == 33
    assert re.search(r"study: \d+ min \d+ s from shards to verdicts", proc.stdout)
    # A second `make study` skips the finished runs and compares again.
    again = subprocess.run(
        ["make", "--no-print-directory", "study-pretrain", f"STUDY={runs}", f"STUDY_SHARDS={shards}",
         f"STUDY_FIT_ARGS=--config {tmp_path / 'toy.yaml'}", f"SSLVIT={client['SSLVIT']}"],
        cwd=ROOT, env={**os.environ, **client, "FASHION_MNIST": str(idx)}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert again.returncode == 0 and "pretraining" not in again.stdout, again.stdout
