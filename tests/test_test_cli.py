"""`ssl-vit test --ckpt_path CKPT` for every task, the way users run it: a tiny checkpoint of each kind
trained by `ssl-vit fit` on a quickstart recipe, then tested on one digits shard. The metrics are read
back from a CSV logger's file."""

import csv
import math
from pathlib import Path

import pytest
from cli_helpers import run_cli

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "recipes" / "quickstart"
# Every checkpoint shares one tiny backbone, so the probe and fine-tune start from the MPP checkpoint.
TINY = ["--model.init_args.backbone.width", "32", "--model.init_args.backbone.depth", "1",
        "--model.init_args.backbone.heads", "2"]  # fmt: skip
RECIPES = {
    "mpp": "mpp.yaml",
    "supervised": "supervised.yaml",
    "linear_probe": "linear_probe.yaml",
    "finetune": "finetune.yaml",
}


def fit(recipe: str, shards: Path, run_dir: Path, *extra: str) -> Path:
    """Two training steps of a quickstart recipe, no validation; returns its checkpoint."""
    run_cli(
        "fit", "--config", str(QUICKSTART / recipe),
        "--data.init_args.train_urls", str(shards / "train-{000000..000004}.tar"),
        "--data.init_args.val_urls", str(shards / "val-{000000..000003}.tar"),
        "--data.init_args.num_workers", "0", "--data.init_args.batch_size", "16",
        "--data.init_args.train_batches", "2", "--trainer.max_epochs", "1",
        "--trainer.limit_val_batches", "0",
        "--trainer.logger", "false", "--trainer.default_root_dir", str(run_dir), *TINY, *extra,
        cwd=run_dir.parent,
    )  # fmt: skip
    return run_dir / "checkpoints" / "last.ckpt"


@pytest.fixture(scope="module")
def checkpoints(digits_shards, tmp_path_factory) -> dict[str, Path]:
    runs = tmp_path_factory.mktemp("runs")
    mpp = fit(RECIPES["mpp"], digits_shards, runs / "mpp")
    from_mpp = ["--model.init_args.training.init_from", str(mpp)]
    return {
        "mpp": mpp,
        "supervised": fit(RECIPES["supervised"], digits_shards, runs / "supervised"),
        "linear_probe": fit(RECIPES["linear_probe"], digits_shards, runs / "probe", *from_mpp),
        "finetune": fit(RECIPES["finetune"], digits_shards, runs / "finetune", *from_mpp),
    }


def run_test(kind: str, ckpt: Path, shards: Path, out: Path, *extra: str) -> dict[str, float]:
    """`ssl-vit test` of CKPT on one shard of the digits (2 batches), run in OUT; the metrics it logged."""
    out.mkdir()
    proc = run_cli(
        "test", "--config", str(QUICKSTART / RECIPES[kind]), "--ckpt_path", str(ckpt),
        "--data.init_args.test_urls", str(shards / "val-000000.tar"),
        "--data.init_args.num_workers", "0", "--data.init_args.batch_size", "64",
        "--trainer.logger", "pytorch_lightning.loggers.CSVLogger",
        "--trainer.logger.init_args.save_dir", str(out), "--trainer.logger.init_args.name", "test",
        "--trainer.default_root_dir", str(out), *extra, cwd=out,
    )  # fmt: skip
    (metrics_file,) = out.glob("test/version_*/metrics.csv")
    (row,) = csv.DictReader(metrics_file.open())
    metrics = {key: float(value) for key, value in row.items() if key.startswith("test/")}
    for key in metrics:  # Lightning prints what it returns
        assert key in proc.stdout, (key, proc.stdout)
    return metrics


def test_masked_prediction_test_is_the_same_whatever_the_seed(checkpoints, digits_shards, tmp_path):
    first = run_test("mpp", checkpoints["mpp"], digits_shards, tmp_path / "a")
    again = run_test("mpp", checkpoints["mpp"], digits_shards, tmp_path / "b", "--seed_everything", "7")
    assert set(first) == {"test/loss", "test/masked_accuracy"}
    # 512 colour classes after two steps: about log(512) = 6.2, and the same masks both times.
    assert 0 < first["test/loss"] < 2 * math.log(512) and 0 <= first["test/masked_accuracy"] <= 1
    assert again == first


@pytest.mark.parametrize("kind", ["supervised", "finetune"])
def test_classifiers_report_accuracy_and_loss(kind, checkpoints, digits_shards, tmp_path):
    metrics = run_test(kind, checkpoints[kind], digits_shards, tmp_path / "test")
    assert set(metrics) == {"test/loss", "test/accuracy"}
    assert 0 <= metrics["test/accuracy"] <= 1 and 0 < metrics["test/loss"] < 2 * math.log(10)


def test_linear_probe_reports_every_head_and_the_best(checkpoints, digits_shards, tmp_path):
    metrics = run_test("linear_probe", checkpoints["linear_probe"], digits_shards, tmp_path / "test")
    lrs = [0.1, 0.3, 1.0, 3.0, 10.0]  # recipes/quickstart/linear_probe.yaml
    per_head = {lr: metrics[f"test/accuracy_lr{lr:g}"] for lr in lrs}
    assert set(metrics) == {f"test/accuracy_lr{lr:g}" for lr in lrs} | {
        "test/accuracy", "test/best_lr", "test/loss"
    }  # fmt: skip
    assert metrics["test/accuracy"] == max(per_head.values())
    assert per_head[min(lrs, key=lambda lr: abs(lr - metrics["test/best_lr"]))] == metrics["test/accuracy"]
    assert metrics["test/loss"] > 0


def test_test_without_test_urls_is_one_line(checkpoints, tmp_path):
    proc = run_cli(
        "test", "--config", str(QUICKSTART / RECIPES["mpp"]), "--ckpt_path", str(checkpoints["mpp"]),
        "--trainer.default_root_dir", str(tmp_path / "run"), cwd=tmp_path, check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("Seed set to")]
    assert lines == ["ssl-vit: error: test_urls is not set: give the URLs of the test shards "
                     "(data.init_args.test_urls)"]  # fmt: skip
    assert list(tmp_path.iterdir()) == []
