"""One `ssl-vit fit` per run directory (`ssl_vit.tasks.run_lock`): a second fit is refused in one line
naming the holder, whether it starts with the first or later; a lock left by a process that ended is
taken over with a warning; the lock is gone after every kind of exit; only a job's rank 0 takes it."""

import errno
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import yaml
from cli_helpers import one_step_fit_args, run_cli, start_cli
from test_errors import error_line, listing
from test_run_dir_safety import stamps

from ssl_vit.checkpoints import integrity
from ssl_vit.errors import UserError
from ssl_vit.run import record
from ssl_vit.storage import lock as run_lock
from ssl_vit.storage.lock import HOST, LOCK_NAME, RunLock, job_leader

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).parent
ENV = {"PYTHONPATH": str(TESTS), "OMP_NUM_THREADS": "1"}

# Holds RUN/fit.lock in a process of its own until its stdin closes; prints "held" once it does.
HOLDER = """
import sys
from ssl_vit.storage.lock import RunLock
with RunLock(sys.argv[1]):
    print("held", flush=True)
    sys.stdin.read()
"""


def hold(run: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline() == "held\n"
    return proc


def dead_pid() -> int:
    """The pid of a process of this host that has ended (and been reaped)."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def write_lock(run: Path, host: str, pid: int) -> Path:
    run.mkdir(parents=True, exist_ok=True)
    path = run / LOCK_NAME
    path.write_text(json.dumps({"host": host, "pid": pid, "since": "2026-01-01T00:00:00+00:00"}) + "\n")
    return path


def warnings_of(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("ssl-vit: warning:")]


# --- the lock itself ---------------------------------------------------------------------------------


def test_a_held_directory_is_refused_naming_the_holder_and_released_at_its_exit(tmp_path):
    run = tmp_path / "a/run"
    holder = hold(run)
    try:
        content = (run / LOCK_NAME).read_text()
        with pytest.raises(UserError) as refused:
            RunLock(run).acquire()
        message = str(refused.value)
        assert f"host {HOST} pid {holder.pid}" in message and "--trainer.default_root_dir" in message
        assert (run / LOCK_NAME).read_text() == content
        assert listing(tmp_path) == ["a", "a/run", f"a/run/{LOCK_NAME}"]  # nothing else written
    finally:
        holder.communicate("")
    assert holder.returncode == 0
    assert not (tmp_path / "a").exists()  # released; the directories it created (empty) removed
    with RunLock(run):
        assert json.loads((run / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert not (tmp_path / "a").exists()


def test_a_lock_of_a_killed_process_is_taken_over_with_a_warning(tmp_path, capsys):
    run = tmp_path / "run"
    holder = hold(run)
    holder.kill()  # SIGKILL: no cleanup; the kernel drops its lock, the file stays
    holder.wait()
    assert json.loads((run / LOCK_NAME).read_text())["pid"] == holder.pid
    with RunLock(run):
        assert json.loads((run / LOCK_NAME).read_text())["pid"] == os.getpid()
    (line,) = warnings_of(capsys.readouterr().err)
    assert f"took over the lock {run / LOCK_NAME} from ssl-vit fit on host {HOST} pid {holder.pid}" in line
    assert not (run / LOCK_NAME).exists() and run.is_dir()  # the directory was there before: it stays


def test_whose_lock_file_is_taken_over(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    # Locks decide: a file whose lock is free has no holder, whatever pid it names (here a live one:
    # a reused pid) and wherever (locks every host sees).
    for host, pid in ((HOST, os.getppid()), ("node-b", 4242)):
        write_lock(run, host, pid)
        with RunLock(run):
            pass
        assert f"host {host} pid {pid}" in warnings_of(capsys.readouterr().err)[0]
    # Locks only this node sees: another host's holder cannot be checked, so its file is respected.
    monkeypatch.setattr(run_lock, "_node_local_locks", lambda directory: "nfs4 mounted with local_lock=all")
    path = write_lock(run, "node-b", 4242)
    with pytest.raises(UserError, match=f"cannot check .nfs4 mounted with local_lock=all.*delete {path}"):
        RunLock(run).acquire()
    assert json.loads(path.read_text())["host"] == "node-b"


def test_without_locks_the_pid_decides_on_this_host(tmp_path, monkeypatch, capsys):
    """Filesystems without POSIX locks (lockf: ENOLCK or ENOSYS): the file alone."""

    def no_locks(fd, operation):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(run_lock.fcntl, "lockf", no_locks)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where takers of this host take turns
    run = tmp_path / "run"
    pid = dead_pid()
    write_lock(run, HOST, pid)
    with RunLock(run):
        assert json.loads((run / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert f"pid {pid}" in warnings_of(capsys.readouterr().err)[0]
    write_lock(run, HOST, os.getppid())
    with pytest.raises(UserError, match=f"pid {os.getppid()}"):
        RunLock(run).acquire()
    write_lock(run, "node-b", 4242)
    with pytest.raises(UserError, match="cannot check .its filesystem has no locks"):
        RunLock(run).acquire()


def test_release_all_frees_the_run_directory_before_a_requeue(tmp_path):
    lock = RunLock(tmp_path / "run")
    with lock:
        run_lock.release_all()  # what rank 0 does before `scontrol requeue`
        assert not (tmp_path / "run").exists()
        with RunLock(tmp_path / "run"):  # the requeued job's
            pass
    # leaving the first `with`: released already, nothing to do


@pytest.mark.parametrize(
    "environ, leader",
    [
        ({}, True),
        ({"RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0"}, True),  # torchrun, rank 0
        ({"RANK": "2", "LOCAL_RANK": "0", "GROUP_RANK": "1"}, False),  # torchrun, node 1
        ({"SLURM_PROCID": "0"}, True),  # srun task 0, or the batch script
        ({"SLURM_PROCID": "5"}, False),
        ({"SLURM_PROCID": "0", "LOCAL_RANK": "1"}, False),  # Lightning's launcher inside one task
        ({"NODE_RANK": "1"}, False),  # Lightning's launcher on node 1, before it sets LOCAL_RANK
        ({"OMPI_COMM_WORLD_RANK": "3"}, False),
    ],
)
def test_only_the_jobs_rank_0_takes_the_lock(environ, leader):
    assert job_leader(environ) is leader


MOUNTINFO = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
40 22 0:50 / /nfs rw,relatime shared:2 - nfs4 srv:/export rw,vers=4.2,local_lock=none,addr=10.0.0.1
41 22 0:51 / /nfs/scratch rw,relatime shared:3 - nfs srv:/scratch rw,vers=3,nolock,local_lock=all
42 22 0:52 / /lustre rw shared:4 - lustre 10.0.0.2@o2ib:/fs rw,flock,lazystatfs
43 22 0:53 / /lustre\\040local rw shared:5 - lustre 10.0.0.2@o2ib:/fs rw,localflock
44 22 0:54 / /beegfs rw shared:6 - beegfs beegfs_nodev rw,cfgFile=/etc/beegfs/beegfs-client.conf
"""


@pytest.mark.parametrize(
    "directory, local",
    [
        ("/home/me/run", None),
        ("/nfs/runs/a", None),
        ("/nfs/scratch/runs/a", "nfs mounted with local_lock=all,nolock"),
        ("/lustre/runs", None),
        ("/lustre local/runs", "lustre mounted with localflock"),
        ("/beegfs/run", "BeeGFS, whose locks are node-local unless tuneUseGlobalFileLocks is set"),
    ],
)
def test_which_filesystems_have_node_local_locks(tmp_path, directory, local):
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(MOUNTINFO)
    assert run_lock._node_local_locks(Path(directory), str(mountinfo)) == local


# --- through the CLI ---------------------------------------------------------------------------------


def fit_args(shards: Path, run: Path, *extra: str) -> list[str]:
    """A one-step quickstart fit whose training waits for `run/../release` (HoldBeforeTraining)."""
    release = str(run.parent / "release")
    hold_args = [
        "--trainer.callbacks+=resume_helpers.HoldBeforeTraining",
        "--trainer.callbacks.release",
        release,
    ]
    return one_step_fit_args(shards, run, *hold_args, *extra)


def wait_for(path: Path, proc) -> None:
    """Until `path` exists; fails if `proc` ends first."""
    while not path.exists():
        assert proc.poll() is None, proc.wait().stderr[-3000:]
        time.sleep(0.02)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_fits_started_together_one_runs_the_other_is_refused(digits_shards, tmp_path):
    """A requeued job whose previous allocation still runs: one fresh fit and one `--ckpt_path last`,
    started at once on one empty directory as separate processes.
    Whichever takes the lock holds before training until the other one has ended, so that one is
    refused rather than run after it."""
    run = tmp_path / "run"
    commands = {
        1: fit_args(digits_shards, run, "--seed_everything", "1"),
        2: fit_args(digits_shards, run, "--seed_everything", "2", "--ckpt_path", "last"),
    }
    procs = {seed: start_cli(*argv, cwd=ROOT, env=ENV) for seed, argv in commands.items()}
    while all(proc.poll() is None for proc in procs.values()):
        time.sleep(0.05)
    refused_seed = next(seed for seed, proc in procs.items() if proc.returncode is not None)
    (seed,) = set(procs) - {refused_seed}
    refused = procs[refused_seed].wait()
    error_line(
        refused,
        f"{run} is in use by ssl-vit fit on host {HOST} pid {procs[seed].pid}",
        "--trainer.default_root_dir",
    )
    (tmp_path / "release").touch()
    winner = procs[seed].wait(timeout=240)
    assert winner.returncode == 0, winner.stderr[-3000:]

    # The directory is the winner's alone: its config, its one W&B run, its checkpoints, which verify.
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["seed_everything"] == seed and config["ckpt_path"] == ("last" if seed == 2 else None)
    (wandb_run,) = (run / "wandb").glob("offline-run-*")
    assert wandb_run.name.endswith((run / "wandb-run-id").read_text().strip())
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["last.ckpt", "step0000001.ckpt"]
    for name in names:
        assert integrity.damage(run / "checkpoints" / name) is None
        assert torch.load(run / "checkpoints" / name, weights_only=True)["global_step"] == 1
    assert sorted(p.name for p in run.iterdir()) == [
        "checkpoints", "config.yaml", "progress.jsonl", "wandb", "wandb-run-id"
    ]  # fmt: skip
    assert {r["pid"] for r in record.read(run) if r["event"] == "start"} == {procs[seed].pid}


@pytest.mark.slow
def test_a_fit_on_a_held_run_directory_is_refused_and_writes_nothing(digits_shards, tmp_path):
    run = tmp_path / "run"
    holder = hold(run)
    try:
        before, written = listing(tmp_path), stamps(tmp_path)
        proc = run_cli(*fit_args(digits_shards, run, "--ckpt_path", "last"), cwd=ROOT, env=ENV, check=False)
        error_line(
            proc, f"{run} is in use by ssl-vit fit on host {HOST} pid {holder.pid}", str(run / LOCK_NAME)
        )
        assert listing(tmp_path) == before and stamps(tmp_path) == written
    finally:
        holder.communicate("")


@pytest.mark.slow
def test_a_fit_takes_over_a_stale_lock_and_leaves_none(digits_shards, tmp_path):
    run, pid = tmp_path / "run", dead_pid()
    write_lock(run, HOST, pid)
    (tmp_path / "release").touch()
    proc = run_cli(*fit_args(digits_shards, run), cwd=ROOT, env=ENV)
    (line,) = warnings_of(proc.stderr)
    assert line.startswith(
        f"ssl-vit: warning: took over the lock {run / LOCK_NAME} from ssl-vit fit on host {HOST} pid {pid}"
    )
    assert not (run / LOCK_NAME).exists()
    assert (run / "checkpoints/last.ckpt").is_file()


@pytest.mark.slow
def test_the_lock_is_gone_after_an_error_exit(digits_shards, tmp_path):
    bad = ("--data.init_args.val_urls", str(digits_shards / "vall-{000000..000003}.tar"))
    used = tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("mine")
    before = listing(tmp_path)
    for run in (used, tmp_path / "fresh/run"):  # after taking it, the fit fails on the missing shard
        proc = run_cli(*fit_args(digits_shards, run, *bad), cwd=ROOT, env=ENV, check=False)
        error_line(proc, "val_urls", "vall-000000.tar")
        assert listing(tmp_path) == before  # no fit.lock; the directories it created removed


@pytest.mark.slow
def test_the_lock_is_gone_after_sigterm(digits_shards, tmp_path):
    run = tmp_path / "run"
    proc = start_cli(*fit_args(digits_shards, run), cwd=ROOT, env=ENV, session=True)
    wait_for(tmp_path / "release.reached", proc)  # holding the run directory, before its first step
    assert json.loads((run / LOCK_NAME).read_text())["pid"] == proc.pid
    os.killpg(proc.pid, signal.SIGTERM)  # as SLURM signals a job step
    result = proc.wait(timeout=120)
    assert result.returncode == 128 + signal.SIGTERM, result.stderr[-3000:]
    saved = re.escape(f"saved {run}/checkpoints/last.ckpt")
    assert re.search(f"ssl-vit: stopped by SIGTERM after step [01]; {saved}", result.stderr), result.stderr
    assert not (run / LOCK_NAME).exists()
