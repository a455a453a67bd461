"""`ssl-vit status RUN_DIR` (issue 42) for a run that is going, was stopped by a signal, was killed, has
ended, and for a directory that is not a run; it changes nothing in the run directory. Through the CLI."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from pathlib import Path

import torch
from cli_helpers import one_step_fit_args, run_cli, start_cli


def tree_hash(root: Path) -> str:
    """Every name, file content and modification time under `root`."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        digest.update(f"{path.relative_to(root)}:{st.st_mode}:{st.st_mtime_ns}".encode())
        if path.is_file() and not path.is_symlink():
            digest.update(path.read_bytes())
    return digest.hexdigest()


def status(run: Path, *extra: str) -> str:
    before = tree_hash(run)
    proc = run_cli("status", str(run), *extra, check=False)
    assert proc.returncode == 0 and not proc.stderr, proc.stderr
    assert tree_hash(run) == before  # read only
    return proc.stdout


def records(run: Path) -> list[dict]:
    path = run / "progress.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for_records(run: Path, proc, event: str, count: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sum(r["event"] == event for r in records(run)) >= count:
            return
        assert proc.poll() is None, proc.wait().stderr[-3000:]
        time.sleep(0.05)
    raise AssertionError(f"{count} {event} record(s) not written in {timeout} s")


def test_status_of_a_going_a_preempted_and_a_killed_run(digits_shards, tmp_path):
    run = tmp_path / "run"
    args = one_step_fit_args(
        digits_shards, run, "--data.init_args.train_batches", "4", "--trainer.max_epochs", "-1",
        "--trainer.max_steps", "100000", "--trainer.log_every_n_steps", "1",
    )  # fmt: skip
    fit = start_cli(*args, cwd=tmp_path, session=True)
    wait_for_records(run, fit, "progress", 2)
    shown = run_cli("status", str(run)).stdout
    lines = shown.splitlines()
    assert lines[0] == f"run {run}: going", shown
    assert f"lock: held by ssl-vit fit on host {os.uname().nodename} pid {fit.pid}" in shown
    assert any(line.startswith("loss, steps ") for line in lines) and "images/s" in shown

    os.killpg(fit.pid, signal.SIGTERM)  # saved at the step's end, then stopped
    assert fit.wait(120).returncode == 143
    stopped = status(run)
    [last] = [r for r in records(run) if r["event"] == "preempted"]
    assert stopped.splitlines()[0].startswith(f"run {run}: stopped by a signal at step {last['step']} at 20")
    assert "preemptions: 1\n" in stopped and "lock: not held (no lock file)" in stopped
    assert "  last.ckpt: intact" in stopped

    resumed = start_cli(*args, "--ckpt_path", "last", cwd=tmp_path, session=True)
    wait_for_records(run, resumed, "start", 2)
    wait_for_records(run, resumed, "progress", sum(r["event"] == "progress" for r in records(run)) + 1)
    os.killpg(resumed.pid, signal.SIGKILL)
    resumed.wait(60)
    killed = status(run)
    assert killed.splitlines()[0].startswith(f"run {run}: killed or lost (it recorded no end"), killed
    assert f"lock: not held: left by ssl-vit fit on host {os.uname().nodename} pid {resumed.pid}" in killed
    assert "jobs: 2 (started at " in killed and "preemptions: 1\n" in killed


def test_status_of_an_ended_run_with_its_rollbacks_skips_and_damaged_checkpoint(digits_shards, tmp_path):
    run = tmp_path / "run"
    run_cli(*one_step_fit_args(digits_shards, run, "--trainer.log_every_n_steps", "1",
                               "--data.init_args.train_batches", "3"), cwd=tmp_path)  # fmt: skip
    # what the non-finite guard and a damaged disk would have left: a rollback and a skipped step
    # recorded, a checkpoint whose bytes changed
    with open(run / "progress.jsonl", "a") as f:
        f.write(
            json.dumps({"time": 1.8e9, "event": "rollback", "step": 2, "to_step": 1, "reason": "spike"})
            + "\n"
        )
        f.write(json.dumps({"time": 1.8e9, "event": "skipped_step", "step": 3, "count": 1}) + "\n")
        f.write('{"time": 1.8e9, "event": "progr')  # a line a kill cut short
    damaged = run / "checkpoints" / "step0000001.ckpt"
    torch.save({"weights": torch.arange(1000.0)}, damaged)
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    picture = tmp_path / "loss.png"
    shown = status(run, "--plot", str(picture))
    lines = shown.splitlines()
    assert lines[0].startswith(f"run {run}: ended at step 3 at 20"), shown
    assert lines[1] == "step 3/3 (100%), epoch 1"
    assert lines[2].startswith("loss, steps 1-3: ") and len(lines[2].split(": ")[1].split()[0]) == 3
    assert "  step0000001.ckpt: DAMAGED (" in shown
    assert "  step0000003.ckpt: intact (= last.ckpt)" in shown and "  last.ckpt: intact" in shown
    assert "rollbacks: 1\n  step 2 -> 1 (spike) at 2027-01-15 08:00:00 UTC" in shown
    assert "non-finite steps skipped: 1 (step 3 at 2027-01-15 08:00:00 UTC)" in shown
    assert "skipped samples: 0" in shown and "preemptions: 0" in shown
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a picture inside the run directory would change it
    inside = run_cli("status", str(run), "--plot", str(run / "loss.png"), check=False)
    assert inside.returncode == 2 and inside.stderr.count("\n") == 1 and not (run / "loss.png").exists()


def test_status_of_what_is_not_a_run_is_one_line(tmp_path):
    (tmp_path / "thesis").mkdir()
    (tmp_path / "thesis" / "chapter1.tex").write_text("x")
    for target, says in (("thesis", "is not a fit's run directory"), ("missing", "is not a directory")):
        proc = run_cli("status", str(tmp_path / target), check=False)
        assert proc.returncode == 2 and not proc.stdout, proc
        assert proc.stderr.startswith("ssl-vit: error: ") and says in proc.stderr
        assert proc.stderr.count("\n") == 1, proc.stderr
