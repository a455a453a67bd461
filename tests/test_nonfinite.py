"""A NaN gradient on one rank of two: the step is skipped on both (policy skip) or both stop together at once
with one line and a non-zero exit (policy stop, or skip past max_skips); no non-finite state is saved."""

from pathlib import Path

import pytest
import torch
from cli_helpers import torchrun_fit
from resume_helpers import fit_args, read_steps

HERE = Path(__file__).parent


def poisoned_fit(shards, tmp_path, steps: str, *options: str):
    """2-rank fit of 8 steps, a checkpoint after each, rank 1's gradients NaN at global `steps`; returns
    the run directory, the recorded steps and the one error line (every rank raises at the same step;
    torchrun stops the other as soon as one exits, so one or two ranks get to print the same line)."""
    run, record = tmp_path / "run", tmp_path / "steps.jsonl"
    args = fit_args(
        shards, run, record, "--checkpoint.every_n_train_steps", "1",
        "--trainer.callbacks+=resume_helpers.PoisonGradients", "--trainer.callbacks.steps", steps,
        "--trainer.callbacks.rank", "1", *options, epochs=1, batches=8,
    )  # fmt: skip
    proc = torchrun_fit(args)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("ssl-vit: error:")]
    assert lines and len(set(lines)) == 1, proc.stderr[-4000:]
    return run, read_steps(record), lines[0]


def weights(path):
    state = torch.load(path, map_location="cpu", weights_only=True)
    return state["global_step"], state["state_dict"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_nan_on_one_rank_is_skipped_then_stops_every_rank(digits_shards, tmp_path):
    # rank 1's gradients of global steps 3 and 5 are NaN; one skip allowed; every checkpoint kept
    run, steps, line = poisoned_fit(
        digits_shards, tmp_path, "[3, 5]", "--checkpoint.save_top_k", "-1",
        "--nonfinite.policy", "skip", "--nonfinite.max_skips", "1",
    )  # fmt: skip
    assert "non-finite loss or gradients at step 5 after skipping 1 such steps" in line
    assert f"last good checkpoint: {run}/checkpoints/last.ckpt" in line
    # Both ranks completed 5 optimizer steps and stopped together in the 6th (global step 5).
    assert sorted({r["step"] for r in steps}) == [1, 2, 3, 4, 5] and len(steps) == 10
    # The 4th step (global step 3) was skipped on both ranks: its update was not applied.
    _, before = weights(run / "checkpoints/step0000003.ckpt")
    _, skipped = weights(run / "checkpoints/step0000004.ckpt")
    assert all(torch.equal(before[k], skipped[k]) for k in before if k.startswith("backbone."))
    # Nothing non-finite was saved: last.ckpt holds the weights after step 5, all finite.
    step, last = weights(run / "checkpoints/last.ckpt")
    assert step == 5
    assert all(torch.isfinite(t).all() for t in last.values() if t.is_floating_point())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_policy_stop_stops_both_ranks_and_never_saves_the_nan(digits_shards, tmp_path):
    run, steps, line = poisoned_fit(
        digits_shards, tmp_path, "[2]", "--nonfinite.policy", "stop", "--nonfinite.check_every_n_steps", "4"
    )
    assert "non-finite loss or gradients at step 2;" in line
    # The NaN of global step 2 (rank 1's 3rd update) is found without a host sync per step, at the
    # save that follows it: nothing was written from it, last.ckpt holds the 2 steps before, finite.
    step, last = weights(run / "checkpoints/last.ckpt")
    assert step == 2
    # both ranks completed that 3rd step, and neither started a 4th
    assert sorted(r["step"] for r in steps) == [1, 1, 2, 2, 3, 3]
    assert all(torch.isfinite(t).all() for t in last.values() if t.is_floating_point())
