"""Elastic exact resume: a fit over local shards killed mid-epoch on 2 processes x 2 DataLoader workers
(torchrun, gloo on 127.0.0.1), resumed as 1 process x 0 workers, killed again, resumed as 3 processes x
1 worker, trains on every sample of the epoch exactly once, step by step the same samples in the same
global order as the uninterrupted run; a resume that would change the global batch is one line."""

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from cli_helpers import free_port, run_cli, start_cli, torchrun, torchrun_env
from resume_helpers import ROOT, read_steps

ENV = {"PYTHONPATH": str(Path(__file__).parent), "OMP_NUM_THREADS": "1"}
SAMPLES, GLOBAL_BATCH = 120, 12  # 10 steps of 12: 6 per rank on 2 ranks, 12 on 1, 4 on 3


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    out = tmp_path_factory.mktemp("elastic")
    run_cli("data", "convert", f"synthetic:{SAMPLES}", str(out), "--shard-size", "25", "--no-progress")
    return out


def fit_args(shards, run_dir, record, batch_size, workers, *extra):
    return [
        "fit", "--config", str(ROOT / "recipes/quickstart/mpp.yaml"),
        # the recipe's few-shot monitor, on these shards (before the callbacks added below)
        "--trainer.callbacks.init_args.train_urls", f"{shards}/train-{{000000..000002}}.tar",
        "--trainer.callbacks.init_args.test_urls", f"{shards}/train-{{000002..000004}}.tar",
        "--data.init_args.train_urls", f"{shards}/train-{{000000..000004}}.tar",
        "--data.init_args.val_urls", f"{shards}/train-{{000000..000004}}.tar",
        "--data.init_args.num_workers", str(workers),
        "--data.init_args.batch_size", str(batch_size),
        "--data.init_args.image_size", "16",
        "--model.init_args.backbone.img_size", "16",
        "--trainer.max_epochs", "1", "--trainer.limit_val_batches", "0",
        "--checkpoint.every_n_train_steps", "3",
        "--trainer.enable_progress_bar", "false", "--trainer.logger", "false",
        "--trainer.default_root_dir", str(run_dir),
        "--model.init_args.picture_every_n_steps", "0",
        "--trainer.callbacks+=resume_helpers.StepRecorder", "--trainer.callbacks.path", str(record),
        *extra,
    ]  # fmt: skip


def hold_at(release: Path, step: int) -> list[str]:
    return [
        "--trainer.callbacks+=resume_helpers.HoldAt", "--trainer.callbacks.release", str(release),
        "--trainer.callbacks.step", str(step),
    ]  # fmt: skip


def start_torchrun(nprocs, args):
    cmd = [
        *torchrun("--nnodes", "1", "--nproc_per_node", str(nprocs), "--master_addr", "127.0.0.1",
                  "--master_port", str(free_port())),
        *args, "--trainer.devices", str(nprocs), "--trainer.strategy", "ddp",
    ]  # fmt: skip
    env = {**torchrun_env(), **ENV}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip


def wait_for(path: Path, proc, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} not reached"
        if proc.poll() is not None:
            err = proc.communicate()[1] if isinstance(proc, subprocess.Popen) else proc.wait().stderr
            raise AssertionError(err[-3000:])
        time.sleep(0.05)


def kill_group(proc, run_dir: Path) -> None:
    """SIGKILL to a job's process group, then wait until its processes are gone: the run's lock free
    (the ranks under torchrun are the CLI fork server's children, killed as their clients die)."""
    for pid in [proc.pid, *descendants(proc.pid)]:  # torchrun starts its ranks in sessions of their own
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 60
    with open(run_dir / "fit.lock", "a") as f:
        while True:
            try:
                fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.lockf(f, fcntl.LOCK_UN)
                return
            except OSError:
                assert time.monotonic() < deadline, "the killed job's lock is still held"
                time.sleep(0.1)


def descendants(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            for child in map(int, (task / "children").read_text().split()):
                found += [child, *descendants(child)]
    return found


def global_steps(record: Path) -> dict[int, list[str]]:
    """Each recorded step's keys over all ranks, rank by rank: the step's slice of the global order."""
    by_step: dict[int, dict[int, list[str]]] = {}
    for r in read_steps(record):
        by_step.setdefault(r["step"], {})[r["rank"]] = r["keys"]
    return {step: [k for rank in sorted(ranks) for k in ranks[rank]] for step, ranks in by_step.items()}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_killed_on_2x2_resumed_on_1x0_then_3x1_trains_every_sample_once_in_the_same_order(shards, tmp_path):
    # the uninterrupted run, 2 processes x 2 workers
    reference = tmp_path / "reference.jsonl"
    proc = start_torchrun(2, fit_args(shards, tmp_path / "reference", reference, 6, 2))
    out, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err[-3000:]
    expected = global_steps(reference)
    assert sorted(expected) == list(range(1, SAMPLES // GLOBAL_BATCH + 1))

    run = tmp_path / "run"
    # 2 x 2, held at step 5 and killed: the last checkpoint is step 3
    first = tmp_path / "first.jsonl"
    proc = start_torchrun(2, fit_args(shards, run, first, 6, 2, *hold_at(tmp_path / "release1", 5)))
    wait_for(tmp_path / "release1.reached", proc)
    kill_group(proc, run)

    # 1 x 0 with the same batch per rank: the global batch would change, refused in one line
    refused = run_cli(*fit_args(shards, run, tmp_path / "no.jsonl", 6, 0), "--ckpt_path", "last",
                      cwd=ROOT, env=ENV, check=False)  # fmt: skip
    errors = [line for line in refused.stderr.splitlines() if line.startswith("ssl-vit: error:")]
    assert refused.returncode == 2 and len(errors) == 1, refused.stderr  # (after the lock's takeover)
    assert "6 per rank on 1 rank would make it 6" in errors[0]
    assert "this run's global batch is 12 (6 per rank on 2 ranks)" in refused.stderr
    assert "set --data.init_args.batch_size 12" in refused.stderr
    assert not (tmp_path / "no.jsonl").exists()

    # 1 x 0 with 12 per rank, held at step 8 and killed: the last checkpoint is step 6
    second = tmp_path / "second.jsonl"
    proc = start_cli(*fit_args(shards, run, second, 12, 0, *hold_at(tmp_path / "release2", 8)),
                     "--ckpt_path", "last", cwd=ROOT, env=ENV, session=True)  # fmt: skip
    wait_for(tmp_path / "release2.reached", proc)
    proc.kill()
    err2 = proc.wait(timeout=60).stderr
    assert "resuming on 1 rank(s) x 0 DataLoader worker(s), saved on 2 x 2" in err2, err2[-3000:]
    assert "the resume is exact" in err2

    # 3 x 1 with 4 per rank, to the end of the epoch
    third = tmp_path / "third.jsonl"
    proc = start_torchrun(3, [*fit_args(shards, run, third, 4, 1), "--ckpt_path", "last"])
    _, err3 = proc.communicate(timeout=400)
    assert proc.returncode == 0, err3[-3000:]
    assert "resuming on 3 rank(s) x 1 DataLoader worker(s), saved on 1 x 0" in err3

    trained = {}
    for record in (first, second, third):  # a step run again after a kill: the later run's counts
        trained.update(global_steps(record))
    assert sorted(trained) == sorted(expected)
    for step in expected:
        assert trained[step] == expected[step], step  # the same samples, in the same global order
    keys = [k for step in sorted(trained) for k in trained[step]]
    assert len(keys) == SAMPLES and len(set(keys)) == SAMPLES  # every sample of the epoch exactly once
    assert min(global_steps(second)) == 4 and min(global_steps(third)) == 7  # each resumed at its checkpoint
    assert json.loads((shards / "train.json").read_text())["num_samples"] == SAMPLES
