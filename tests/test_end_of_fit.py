"""The end of a fit never loses its training: the final checkpoint is written before any end-of-training
callback runs, and the live few-shot probe on a set it cannot fully use skips what it cannot do with one
warning line instead of ending the run with a traceback. Through the CLI, as users run it."""

from pathlib import Path

import numpy as np
import pytest
import torch
from cli_helpers import run_cli, wandb_records
from sklearn.datasets import load_digits

ROOT = Path(__file__).resolve().parents[1]


def fit_args(train_urls: str, val_urls: str, run: Path, *extra: str) -> list[str]:
    """The quickstart's MPP recipe, its live few-shot probe (1, 5 and 10 shots, at the end of training)
    on the data's own shards, one training step."""
    return [
        "fit", "--config", str(ROOT / "recipes/quickstart/mpp.yaml"),
        "--data.init_args.train_urls", train_urls, "--data.init_args.val_urls", val_urls,
        "--data.init_args.num_workers", "0", "--data.init_args.train_batches", "1",
        "--trainer.max_epochs", "1", "--trainer.limit_val_batches", "0",
        "--trainer.default_root_dir", str(run), *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def short_class_shards(tmp_path_factory) -> str:
    """Digits shards (20 images of each digit) in which digit 3 has only 3 images: fewer than the
    probe's 5 and 10 shots."""
    digits = load_digits()
    keep = np.concatenate([np.flatnonzero(digits.target == c)[: 3 if c == 3 else 20] for c in range(10)])
    root = tmp_path_factory.mktemp("short")
    images = (digits.images[keep] * 255 / 16).astype(np.uint8)
    np.savez(root / "set.npz", images=images, labels=digits.target[keep])
    shards = str(root / "shards")
    run_cli("data", "convert", f"npz:{root / 'set.npz'}", shards, "--split", "train", "--no-progress")
    return str(root / "shards" / "train-000000.tar")


def test_a_probe_short_of_images_skips_those_shots_in_one_line_and_the_fit_ends_saved(
    short_class_shards, digits_shards, tmp_path
):
    run = tmp_path / "run"
    val = str(digits_shards / "val-{000000..000001}.tar")
    proc = run_cli(*fit_args(short_class_shards, val, run), cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "FewShotMonitor" in line]
    assert warnings == [
        "ssl-vit: warning: FewShotMonitor: class 3 has 3 training images, too few for 5-shot, 10-shot: "
        "skipped (give shots of at most 3, or train_urls with more images of each class)"
    ], proc.stderr
    last = torch.load(run / "checkpoints/last.ckpt", weights_only=True, map_location="cpu")
    assert last["global_step"] == 1
    # the shot the set can fill is still measured
    [(_, records)] = wandb_records(run)
    logged = {key for r in records if r["type"] == "history" for key in r["history"]["item"]}
    assert "fewshot/1shot" in logged and not {"fewshot/5shot", "fewshot/10shot"} & logged


# A callback of the user's whose end-of-training hook fails, defined in the command's process.
FAILING_CALLBACK = """
import sys, types
import pytorch_lightning as pl

class FailsAtTheEnd(pl.Callback):
    def on_train_end(self, trainer, pl_module):
        raise RuntimeError("the end-of-training callback failed")

sys.modules["end_of_fit_test"] = types.SimpleNamespace(FailsAtTheEnd=FailsAtTheEnd)
"""


def test_a_failing_end_of_training_callback_finds_the_final_checkpoint_saved(digits_shards, tmp_path):
    run = tmp_path / "run"
    args = fit_args(
        str(digits_shards / "train-{000000..000004}.tar"), str(digits_shards / "val-{000000..000001}.tar"),
        run, "--trainer.callbacks+=end_of_fit_test.FailsAtTheEnd",
    )  # fmt: skip
    proc = run_cli(*args, cwd=tmp_path, check=False, prelude=FAILING_CALLBACK)
    assert proc.returncode != 0 and "the end-of-training callback failed" in proc.stderr, proc.stderr[-3000:]
    # One training step, saved only at the end (every 50 steps otherwise): by the final save, which ran
    # before the failing hook.
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["last.ckpt", "step0000001.ckpt"]
    last = torch.load(run / "checkpoints/last.ckpt", weights_only=True, map_location="cpu")
    assert last["global_step"] == 1
