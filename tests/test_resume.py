"""A killed or stopped `ssl-vit fit` resumes as if it had never stopped: same losses at the same steps,
every sample of an epoch once, the schedule where it was, the same W&B run."""

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from cli_helpers import run_cli, start_cli, wandb_records
from resume_helpers import ROOT, fit_args, read_steps

ENV = {"PYTHONPATH": str(Path(__file__).parent), "OMP_NUM_THREADS": "1"}


def start_fit(args):
    # its own process group, as a job step: signals reach its workers too
    return start_cli(*args, cwd=ROOT, env=ENV, session=True)


def wait_for_step(record: Path, step: int, proc, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if record.exists() and any(r["step"] >= step for r in read_steps(record)):
            return
        assert proc.poll() is None, proc.wait().stderr[-3000:]
        time.sleep(0.02)
    raise AssertionError(f"step {step} not reached in {timeout} s")


def checkpoint_step(path: Path) -> int:
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)["global_step"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_kill_9_and_sigterm_then_resume_equal_an_uninterrupted_run(digits_shards, tmp_path):
    # 3 epochs x 6 steps, checkpoints every 4 steps: the uninterrupted reference.
    reference = tmp_path / "reference.jsonl"
    run_cli(*fit_args(digits_shards, tmp_path / "reference", reference, epochs=3), cwd=ROOT, env=ENV)
    expected = {r["step"]: r for r in read_steps(reference)}
    assert sorted(expected) == list(range(1, 19))

    # The same run, killed with SIGKILL at step 10 (last checkpoint: step 8), resumed with
    # `--ckpt_path last`, stopped by SIGTERM (sent to its workers too) at step 14, resumed to the end.
    run_dir, record = tmp_path / "run", tmp_path / "run.jsonl"
    args = fit_args(digits_shards, run_dir, record, epochs=3)
    proc = start_fit(args)
    wait_for_step(record, 10, proc)
    proc.kill()
    proc.wait()
    killed_at = max(r["step"] for r in read_steps(record))
    assert checkpoint_step(run_dir / "checkpoints/last.ckpt") == 8 < killed_at

    proc = start_fit([*args, "--ckpt_path", "last"])
    wait_for_step(record, 14, proc)
    os.killpg(proc.pid, signal.SIGTERM)  # the main process and its DataLoader workers, as SLURM does
    err = proc.wait(timeout=120).stderr
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    stopped = checkpoint_step(run_dir / "checkpoints/last.ckpt")
    line = f"ssl-vit: stopped by SIGTERM after step {stopped}; saved {run_dir}/checkpoints/last.ckpt: resume"
    assert line in err, err[-3000:]
    assert stopped >= 14

    run_cli(*args, "--ckpt_path", "last", cwd=ROOT, env=ENV)
    steps = read_steps(record)
    got = {}
    for r in steps:  # a step run twice (after the kill) must have given the same result both times
        if r["step"] in got:
            assert abs(got[r["step"]]["loss"] - r["loss"]) < 1e-6, r["step"]
        got[r["step"]] = r
    assert sorted(got) == sorted(expected)
    for step, want in expected.items():
        assert abs(got[step]["loss"] - want["loss"]) < 1e-6, (step, got[step]["loss"], want["loss"])
        assert got[step]["keys"] == want["keys"] and got[step]["lr"] == want["lr"], step
    # The steps after the SIGTERM checkpoint were not run twice; those after the kill's were.
    assert [r["step"] for r in steps].count(stopped + 1) == 1
    assert [r["step"] for r in steps].count(killed_at) == 2
    # Within each epoch every sample once (the stream draws with replacement across shards, so a key
    # may come back in a later segment; within the uninterrupted run that is the reference).
    for epoch in range(3):
        keys = [k for r in got.values() if r["epoch"] == epoch for k in r["keys"]]
        assert keys == [k for r in expected.values() if r["epoch"] == epoch for k in r["keys"]]
    assert checkpoint_step(run_dir / "checkpoints/last.ckpt") == 18

    # W&B: one run id across the three jobs; each resumed job rewinds the run to the last step its
    # checkpoint holds (W&B's resume_from; a checkpoint of step k holds the metrics logged at W&B steps
    # 0 ... k-1), and its history steps are the trainer's, after that point only. What the rewinds keep
    # of the two resumed jobs is every step from the first resume on, once: none lost at the SIGTERM's
    # resume. (The job killed with SIGKILL took W&B's writer with it: its history may be empty.)
    runs = wandb_records(run_dir)
    run_id = (run_dir / "wandb-run-id").read_text().strip()
    assert len(runs) == 3 and all(name.endswith(run_id) for name, _ in runs)
    histories, branch_points = [], []
    for _, records in runs[1:]:
        run = next(r["run"] for r in records if r["type"] == "run")
        branch_points.append(run["branch_point"]["value"])
        histories.append([r["history"]["item"] for r in records if r["type"] == "history"])
        assert histories[-1] and all(
            h["_step"] == h["trainer/global_step"] > branch_points[-1] for h in histories[-1]
        )
    assert branch_points == [7, stopped - 1]
    kept = [h["_step"] for h in histories[0] if h["_step"] <= branch_points[1]] + [
        h["_step"] for h in histories[1]
    ]
    assert sorted(kept) == list(range(8, 19))  # 18: what the end of the run logs


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_killed_teacher_preset_resumes_with_its_teacher_and_the_same_losses(digits_shards, tmp_path):
    """I-JEPA on the quickstart's tiny ViT: the EMA teacher is in the checkpoint, so a run killed (SIGKILL)
    after its step-4 checkpoint and resumed with `--ckpt_path last` gives the uninterrupted run's losses."""
    ijepa = ["--model.init_args.preset", "ijepa", "--model.init_args.decoder_dim", "64",
             "--model.init_args.decoder_depth", "2", "--model.init_args.decoder_heads", "4"]  # fmt: skip
    reference = tmp_path / "reference.jsonl"
    run_cli(*fit_args(digits_shards, tmp_path / "reference", reference, *ijepa, epochs=1), cwd=ROOT, env=ENV)
    expected = {r["step"]: r["loss"] for r in read_steps(reference)}
    assert sorted(expected) == list(range(1, 7))

    run_dir, record, release = tmp_path / "run", tmp_path / "run.jsonl", tmp_path / "release"
    args = fit_args(digits_shards, run_dir, record, *ijepa, epochs=1)
    hold = ["--trainer.callbacks+=resume_helpers.HoldAt", "--trainer.callbacks.release", str(release),
            "--trainer.callbacks.step", "5"]  # fmt: skip
    proc = start_fit([*args, *hold])
    wait_for_step(record, 5, proc)
    deadline = time.monotonic() + 60
    while not Path(f"{release}.reached").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    saved = torch.load(run_dir / "checkpoints/last.ckpt", map_location="cpu", weights_only=True)
    assert saved["global_step"] == 4
    assert any(k.startswith("teacher.blocks.") for k in saved["state_dict"])

    run_cli(*args, "--ckpt_path", "last", cwd=ROOT, env=ENV)
    steps = read_steps(record)
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 5, 6]
    for r in steps:
        assert abs(r["loss"] - expected[r["step"]]) < 1e-6, (r["step"], r["loss"], expected[r["step"]])


def test_a_simmim_run_begun_on_rgb_pixels_resumes_on_them(digits_shards, tmp_path):
    """The `simmim` preset's target became `seen_pixels` (the standardised input); a run begun when it was
    `pixels` (RGB in [0, 1]) recorded the target it resolved, and resumes on it under today's preset: a
    run never changes its loss half way."""
    from cli_helpers import one_step_fit_args

    run = tmp_path / "run"
    simmim = ("--model.init_args.preset", "simmim", "--model.init_args.cell_size", "4")
    begun = one_step_fit_args(digits_shards, run, *simmim, "--model.init_args.target", "pixels", config="mae")
    run_cli(*begun)
    resumed = one_step_fit_args(digits_shards, run, *simmim, config="mae")
    run_cli(*resumed, "--trainer.max_epochs", "2", "--ckpt_path", "last")
    last = torch.load(run / "checkpoints/last.ckpt", map_location="cpu", weights_only=False)
    assert last["global_step"] == 2 and last["hyper_parameters"]["target"] == "pixels"
    assert last["hyper_parameters"]["preset"] == "simmim"  # today's `simmim` is seen_pixels (test_masked)
