"""A run directory's checkpoints and W&B run survive the commands that could overwrite them: a fresh
fit into a used directory, a resume whose last.ckpt is gone, a start that fails on bad input, and a
checkpoint resumed under the config of another model."""

import os
import shutil
from pathlib import Path

import pytest
import torch
from cli_helpers import one_step_fit_args as fit_args
from cli_helpers import run_cli
from test_errors import error_line, listing

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def trained_run(digits_shards, tmp_path_factory) -> Path:
    """The run directory of a one-step MPP fit: checkpoints/, config.yaml, wandb/, wandb-run-id."""
    run = tmp_path_factory.mktemp("used") / "run"
    run_cli(*fit_args(digits_shards, run), cwd=ROOT)
    return run


@pytest.fixture
def run(trained_run, tmp_path) -> Path:
    """A copy of `trained_run` under tmp_path, for a test to try to spoil."""
    copy = tmp_path / "run"
    shutil.copytree(trained_run, copy)
    return copy


def stamps(directory: Path) -> dict[str, int]:
    return {str(p.relative_to(directory)): p.stat().st_mtime_ns for p in directory.rglob("*") if p.is_file()}


def global_step(path: Path) -> int:
    return torch.load(path, weights_only=True)["global_step"]


@pytest.mark.slow
def test_a_fresh_fit_refuses_a_run_directory_that_holds_checkpoints(digits_shards, run, tmp_path):
    before, written = listing(tmp_path), stamps(tmp_path)
    proc = run_cli(*fit_args(digits_shards, run, "--seed_everything", "1"), cwd=ROOT, check=False)
    error_line(proc, str(run / "checkpoints"), "--ckpt_path last", "--trainer.default_root_dir")
    assert listing(tmp_path) == before and stamps(tmp_path) == written  # nothing written or replaced
    # What the line suggests works: the run resumes.
    run_cli(*fit_args(digits_shards, run, "--ckpt_path", "last", "--trainer.max_epochs", "2"), cwd=ROOT)
    assert global_step(run / "checkpoints/last.ckpt") == 2


@pytest.mark.slow
def test_ckpt_path_last_without_last_ckpt_resumes_the_newest_checkpoint(digits_shards, run):
    (run / "checkpoints/last.ckpt").unlink()
    step = run / "checkpoints/step0000001.ckpt"
    written = step.stat().st_mtime_ns
    proc = run_cli(
        *fit_args(digits_shards, run, "--ckpt_path", "last", "--trainer.max_epochs", "2"), cwd=ROOT
    )
    assert f"Restored all states from the checkpoint at {step}" in proc.stdout + proc.stderr
    assert step.stat().st_mtime_ns == written and global_step(step) == 1  # not trained again from step 0
    assert global_step(run / "checkpoints/last.ckpt") == 2


@pytest.mark.slow
def test_ckpt_path_last_resumes_the_highest_step_whatever_the_clock_said(digits_shards, tmp_path):
    """last.ckpt missing and an older step file with a modification time ahead of the newest's (written
    on a node whose clock was ahead, or restored from a copy): the intact highest step is resumed."""
    run = tmp_path / "run"
    every_step = ("--checkpoint.every_n_train_steps", "1", "--data.init_args.train_batches", "2")
    run_cli(*fit_args(digits_shards, run, *every_step), cwd=ROOT)
    checkpoints = run / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "last.ckpt",
        "step0000001.ckpt",
        "step0000002.ckpt",
    ]
    (checkpoints / "last.ckpt").unlink()
    ahead = (checkpoints / "step0000002.ckpt").stat().st_mtime + 86400
    os.utime(checkpoints / "step0000001.ckpt", (ahead, ahead))
    proc = run_cli(
        *fit_args(digits_shards, run, *every_step, "--ckpt_path", "last", "--trainer.max_epochs", "2"),
        cwd=ROOT,
    )
    assert (
        f"Restored all states from the checkpoint at {checkpoints / 'step0000002.ckpt'}"
        in proc.stdout + proc.stderr
    )
    assert global_step(checkpoints / "last.ckpt") == 4  # steps 3 and 4 on top of step 2, none repeated


@pytest.mark.slow
def test_a_start_failing_on_a_missing_shard_leaves_the_run_directory_as_it_was(digits_shards, run, tmp_path):
    bad = ("--data.init_args.val_urls", str(digits_shards / "vall-{000000..000003}.tar"))
    run_id = (run / "wandb-run-id").read_text()
    before, written = listing(tmp_path), stamps(tmp_path)
    for directory, ckpt in ((run, ("--ckpt_path", "last")), (tmp_path / "fresh", ())):
        proc = run_cli(*fit_args(digits_shards, directory, *bad, *ckpt), cwd=tmp_path, check=False)
        error_line(proc, "val_urls", "vall-000000.tar")  # the only line: no W&B output before it
        assert listing(tmp_path) == before and stamps(tmp_path) == written  # no wandb/, no new run id
    assert (run / "wandb-run-id").read_text() == run_id


@pytest.mark.slow
def test_resume_refuses_a_config_whose_model_the_checkpoint_contradicts(digits_shards, run, tmp_path):
    # An MPP checkpoint resumed under the MAE recipe would silently train MPP (config.yaml: preset vit_mpp).
    other = tmp_path / "mae"
    before, written = listing(tmp_path), stamps(tmp_path)
    for ckpt in (str(run / "checkpoints/last.ckpt"), "last"):
        target = other if ckpt != "last" else run
        proc = run_cli(
            *fit_args(digits_shards, target, "--ckpt_path", ckpt, config="mae"), cwd=ROOT, check=False
        )
        error_line(
            proc, "--ckpt_path", "preset mae (checkpoint: vit_mpp)", "--model.init_args.training.init_from"
        )
        assert listing(tmp_path) == before and stamps(tmp_path) == written


@pytest.mark.slow
def test_a_wandb_folder_that_cannot_be_written_is_one_line_and_the_checkpoints_stay(
    digits_shards, run, tmp_path
):
    # `wandb` made a regular file: W&B cannot create its run folder in it, for root too (a chmod'ed
    # read-only directory would not stop root, who runs these tests in containers).
    shutil.rmtree(run / "wandb")
    (run / "wandb").write_text("")
    resume = fit_args(digits_shards, run, "--ckpt_path", "last", "--trainer.max_epochs", "2")
    before, written = listing(tmp_path), stamps(tmp_path)
    proc = run_cli(*resume, cwd=tmp_path, check=False)
    error_line(proc, f"W&B cannot write its run in {run / 'wandb'} (NotADirectoryError", "WANDB_DIR=DIR",
               "--trainer.logger false")  # fmt: skip
    assert listing(tmp_path) == before and stamps(tmp_path) == written  # checkpoints, config as they were
    # What the line suggests works: W&B's own directory setting.
    elsewhere = tmp_path / "wandb_dir"
    elsewhere.mkdir()
    run_cli(*resume, cwd=tmp_path, env={"WANDB_DIR": str(elsewhere)})
    assert global_step(run / "checkpoints/last.ckpt") == 2
    assert len(list((elsewhere / "wandb").glob("offline-run-*"))) == 1


# A callback of the user's that fails as training starts, defined in the command's process.
FAILS_AT_THE_START = """
import sys, types
import pytorch_lightning as pl

class FailsAtTheStart(pl.Callback):
    def on_train_start(self, trainer, pl_module):
        raise RuntimeError("the start-of-training callback failed")

sys.modules["run_dir_safety_test"] = types.SimpleNamespace(FailsAtTheStart=FailsAtTheStart)
"""


@pytest.mark.slow
def test_a_fit_failing_before_its_first_step_removes_the_run_directory_it_made(digits_shards, tmp_path):
    """After W&B started and config.yaml was written: the run directory (and the parent the fit made)
    is gone, W&B's folder and run id with it, once the command has ended."""
    run = tmp_path / "new" / "run"
    args = fit_args(digits_shards, run, "--trainer.callbacks+=run_dir_safety_test.FailsAtTheStart")
    proc = run_cli(*args, cwd=tmp_path, check=False, prelude=FAILS_AT_THE_START)
    assert proc.returncode != 0 and "the start-of-training callback failed" in proc.stderr, proc.stderr[
        -3000:
    ]
    assert "W&B: offline run in" in proc.stderr  # W&B had started
    assert listing(tmp_path) == []
