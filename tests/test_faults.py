"""Faults a cluster produces, each through the CLI: data that changed under a checkpoint, shards that
disappear mid-run, a full disk, exhausted memory, a DataLoader worker killed, SIGTERM during the sanity
check, Ctrl-C in a trained protocol of `evaluate`, and the permissions of what a command writes."""

import io
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch
import yaml
from cli_helpers import run_cli, skip_or_fail, start_cli
from resume_helpers import ROOT, fit_args, read_steps
from test_errors import NOISE

ENV = {"PYTHONPATH": str(Path(__file__).parent), "OMP_NUM_THREADS": "1"}


def lines(stderr: str) -> list[str]:
    """stderr without Lightning's seed line and W&B's own lines."""
    return [
        line
        for line in stderr.splitlines()
        if line and not NOISE.fullmatch(line) and not line.startswith("wandb:")
    ]


def steps_of(path: Path) -> int:
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)["global_step"]


def wait_for(path: Path, proc, timeout: float = 180) -> None:
    """Until `path` exists (a `HoldAt` callback reached its point); fails if the command ended first."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.wait().stderr[-3000:]
        assert time.monotonic() < deadline, f"{path} not reached in {timeout} s"
        time.sleep(0.02)


def hold(release: Path, where: str = "step", step: int = 1) -> list[str]:
    return ["--trainer.callbacks+=resume_helpers.HoldAt", "--trainer.callbacks.release", str(release),
            "--trainer.callbacks.where", where, "--trainer.callbacks.step", str(step)]  # fmt: skip


@pytest.fixture
def shards(digits_shards, tmp_path) -> Path:
    """A copy of the digits shards that a test may change."""
    return Path(shutil.copytree(digits_shards, tmp_path / "shards"))


# --- data that changed between a checkpoint and its resume ------------------------------------------------


def drop_last_samples(shard: Path, n: int) -> None:
    """Rewrite `shard` without its last `n` samples (two members each: image and label)."""
    with tarfile.open(shard) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    keep = sorted({Path(m.name).stem for m, _ in members})[:-n]
    with tarfile.open(shard, "w") as tar:
        for member, data in members:
            if Path(member.name).stem in keep:
                member.size = len(data)
                tar.addfile(member, io.BytesIO(data))


def written(run: Path) -> dict[str, int]:
    """When each file of the run directory was last written. W&B's service process of a fit may still
    append to its own debug logs (`logs/debug*.log`) after the fit has exited, on a loaded machine: those
    are not the next command's writes, and are left out."""
    return {
        str(p.relative_to(run)): p.stat().st_mtime_ns
        for p in run.rglob("*")
        if p.is_file() and not (p.parent.name == "logs" and p.name.startswith("debug"))
    }


@pytest.mark.slow
def test_a_resume_on_changed_shards_says_it_is_not_exact_or_refuses(shards, tmp_path):
    run, record = tmp_path / "run", tmp_path / "steps.jsonl"
    run_cli(*fit_args(shards, run, record, epochs=1), cwd=ROOT, env=ENV)
    size = (shards / "train-000002.tar").stat().st_size
    drop_last_samples(shards / "train-000002.tar", 10)
    new_size = (shards / "train-000002.tar").stat().st_size

    # --data.init_args.stream.on_data_change refuse: one line, nothing trained or written.
    before = written(run)
    args = fit_args(shards, run, record, "--ckpt_path", "last", epochs=2)
    proc = run_cli(*args, "--data.init_args.stream.on_data_change", "refuse", cwd=ROOT, env=ENV, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = [line for line in lines(proc.stderr) if line.startswith("ssl-vit: error:")]
    assert f"1 shard(s) changed (train-000002.tar {size} -> {new_size} bytes)" in line
    assert "--data.init_args.stream.on_data_change warn" in line
    assert written(run) == before  # checkpoints, config.yaml and the W&B run as they were

    # The default warns in one line and resumes.
    proc = run_cli(*args, cwd=ROOT, env=ENV)
    (warning,) = [line for line in lines(proc.stderr) if "the training data differ" in line]
    assert f"train-000002.tar {size} -> {new_size} bytes" in warning and "not exact" in warning
    assert steps_of(run / "checkpoints/last.ckpt") == 12


def reverse_samples(shard: Path) -> None:
    """Rewrite `shard` with its samples in reverse order, byte for byte the same members: same size."""
    data = shard.read_bytes()
    with tarfile.open(shard) as tar:
        members = tar.getmembers()
    samples: dict[str, list[bytes]] = {}
    for m in members:  # a member's bytes: its headers (pax ones included) to the end of its padded data
        end = m.offset_data + -(-m.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
        samples.setdefault(Path(m.name).stem, []).append(data[m.offset : end])
    body = b"".join(b"".join(parts) for parts in reversed(samples.values()))
    shard.write_bytes(body + data[len(body) :])
    assert len(shard.read_bytes()) == len(data)


@pytest.mark.slow
def test_a_resume_on_shards_reordered_at_the_same_size_says_it_is_not_exact_or_refuses(shards, tmp_path):
    run, record = tmp_path / "run", tmp_path / "steps.jsonl"
    run_cli(*fit_args(shards, run, record, epochs=1), cwd=ROOT, env=ENV)
    sizes = {p.name: p.stat().st_size for p in shards.glob("train-*.tar")}
    for name in ("train-000001.tar", "train-000002.tar", "train-000003.tar"):
        reverse_samples(shards / name)
    assert {p.name: p.stat().st_size for p in shards.glob("train-*.tar")} == sizes
    what = "3 shard(s) rewritten with other contents of the same size (train-000001.tar, train-000002.tar, "
    args = fit_args(shards, run, record, "--ckpt_path", "last", epochs=2)
    before = written(run)
    proc = run_cli(*args, "--data.init_args.stream.on_data_change", "refuse", cwd=ROOT, env=ENV, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = [line for line in lines(proc.stderr) if line.startswith("ssl-vit: error:")]
    assert what in line and "--data.init_args.stream.on_data_change warn" in line
    assert written(run) == before
    proc = run_cli(*args, cwd=ROOT, env=ENV)
    (warning,) = [line for line in lines(proc.stderr) if "the training data differ" in line]
    assert what in warning and "not exact" in warning
    assert steps_of(run / "checkpoints/last.ckpt") == 12


# --- shards that disappear mid-run ----------------------------------------------------------------------


@pytest.mark.slow
def test_shards_deleted_during_a_run_are_named_at_the_end_of_their_epoch(tmp_path):
    small = tmp_path / "small"  # shards of 20 digits: a training worker opens one every few batches
    run_cli(
        "data", "convert", "digits", str(small), "--split", "train", "--shard-size", "20", "--no-progress"
    )
    run_cli("data", "convert", "digits", str(small), "--split", "val", "--shard-size", "100", "--no-progress")
    release, run = tmp_path / "release", tmp_path / "run"
    args = [
        *fit_args(small, run, tmp_path / "steps.jsonl", *hold(release, step=1), epochs=2,
                  small_monitor=False),
        "--data.init_args.train_urls", str(small / "train-{000000..000071}.tar"),
        "--data.init_args.train_batches", "6", "--data.init_args.batch_size", "16",
        "--data.init_args.stream.shuffle_buffer", "10",
    ]  # fmt: skip
    proc = start_cli(*args, cwd=ROOT, env=ENV)
    wait_for(Path(f"{release}.reached"), proc)
    gone = [small / f"train-{i:06d}.tar" for i in range(10, 40)]  # 30 of 72: the next shards drawn hit them
    for shard in [*gone, small / "val-000003.tar"]:
        shard.unlink()
    release.touch()
    result = proc.wait(timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = [line for line in lines(result.stderr) if "could not be read" in line]
    val = str(small / "val-000003.tar")
    assert any("in the validation" in line and line.endswith(val) for line in reports), reports
    training = [line for line in reports if "the training epoch" in line]
    named = {shard for line in training for shard in gone if str(shard) in line}
    assert named, reports
    assert "Traceback" not in result.stderr


# --- a full disk ----------------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of a chosen size, mounted by the test (root only); unmounted afterwards."""
    mounted = []

    def mount(size_kib: int) -> Path:
        where = tmp_path / f"disk{len(mounted)}"
        where.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(where)],
                              capture_output=True, text=True)  # fmt: skip
        if done.returncode != 0:
            skip_or_fail(f"cannot mount a tmpfs to fill ({done.stderr.strip() or 'not root'})")
        mounted.append(where)
        return where

    if os.geteuid() != 0 or shutil.which("mount") is None:
        skip_or_fail("filling a disk needs root to mount a small tmpfs")
    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


@pytest.mark.slow
def test_a_full_disk_while_saving_is_one_line_and_the_previous_checkpoint_survives(
    shards, small_disk, tmp_path
):
    # One checkpoint's size, from a run on a roomy disk.
    reference = tmp_path / "reference"
    run_cli(*fit_args(shards, reference, tmp_path / "ref.jsonl", epochs=1), cwd=ROOT, env=ENV)
    size = (reference / "checkpoints/last.ckpt").stat().st_size
    disk = small_disk(int(1.5 * size / 1024) + 64)  # room for one checkpoint, not for two
    run, record = tmp_path / "run", tmp_path / "steps.jsonl"
    args = fit_args(shards, run, record, "--checkpoint.dirpath", str(disk), epochs=1)
    proc = run_cli(*args, cwd=ROOT, env=ENV, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = [line for line in lines(proc.stderr) if line.startswith("ssl-vit: error:")]
    assert "no space left" in line and str(disk) in line and "free space" in line
    assert sorted(p.name for p in disk.iterdir()) == ["last.ckpt", "step0000004.ckpt"]  # no temp file left
    assert steps_of(disk / "last.ckpt") == 4
    # Once there is room, the run resumes from the checkpoint that survived and finishes.
    roomy = tmp_path / "roomy"
    shutil.copytree(disk, roomy)
    extra = ("--checkpoint.dirpath", str(roomy), "--ckpt_path", "last")
    run_cli(*fit_args(shards, run, record, *extra, epochs=1), cwd=ROOT, env=ENV)
    assert steps_of(roomy / "last.ckpt") == 6


# --- memory ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_running_out_of_memory_is_one_line_naming_the_batch_size(digits_shards, tmp_path):
    """A batch far too large for the memory the process may use (RLIMIT_AS): one line, exit 1."""
    # 1.5 GiB more than the process has mapped when the command starts (its libraries, about 4 GiB here)
    limited = """
import re, resource
mapped = int(re.search(r"VmSize:\\s+(\\d+) kB", open("/proc/self/status").read())[1]) << 10
resource.setrlimit(resource.RLIMIT_AS, (mapped + (3 << 29), mapped + (3 << 29)))
"""
    args = [
        *fit_args(digits_shards, tmp_path / "run", tmp_path / "steps.jsonl", epochs=1, batches=1),
        "--data.init_args.batch_size", "12000", "--data.init_args.num_workers", "0",
    ]  # fmt: skip
    proc = run_cli(*args, cwd=ROOT, env=ENV, check=False, prelude=limited)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = [line for line in lines(proc.stderr) if line.startswith("ssl-vit: error:")]
    assert line.startswith("ssl-vit: error: out of memory") and "data.init_args.batch_size" in line


# --- a DataLoader worker killed -------------------------------------------------------------------------


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


@pytest.mark.slow
def test_a_killed_dataloader_worker_saves_and_the_run_resumes_exactly(digits_shards, tmp_path):
    reference = tmp_path / "reference.jsonl"
    run_cli(*fit_args(digits_shards, tmp_path / "reference", reference, epochs=2), cwd=ROOT, env=ENV)
    expected = {r["step"]: r for r in read_steps(reference)}

    run, record, release = tmp_path / "run", tmp_path / "steps.jsonl", tmp_path / "release"
    args = fit_args(digits_shards, run, record, epochs=2)
    # The surviving worker's SIGTERM grace is 900 s: the run ends by the timeout only if it stops its
    # workers itself once it has saved.
    proc = start_cli(*args, *hold(release, step=5), cwd=ROOT, env={**ENV, "SSL_VIT_WORKER_GRACE_S": "900"})
    wait_for(Path(f"{release}.reached"), proc)
    me = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
    workers = [c for c in children(proc.pid) if Path(f"/proc/{c}/cmdline").read_bytes() == me]
    assert workers, "no DataLoader worker found"
    os.kill(workers[0], signal.SIGKILL)
    release.touch()
    result = proc.wait(timeout=300)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    (line,) = [line for line in lines(result.stderr) if line.startswith("ssl-vit: error:")]
    assert "a DataLoader worker" in line and "num_workers" in line
    assert f"saved {run}/checkpoints/last.ckpt" in line and "--ckpt_path last" in line
    stopped = steps_of(run / "checkpoints/last.ckpt")
    assert (
        stopped >= 5 and max(r["step"] for r in read_steps(record)) == stopped
    )  # saved at the step it reached

    run_cli(*args, "--ckpt_path", "last", cwd=ROOT, env=ENV)
    steps = read_steps(record)
    for r in steps:
        assert r["loss"] == pytest.approx(expected[r["step"]]["loss"], abs=1e-6), r["step"]
        assert r["keys"] == expected[r["step"]]["keys"], r["step"]
    assert sorted({r["step"] for r in steps}) == sorted(expected)


# --- signals --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_sigterm_during_the_sanity_check_saves_and_exits_without_waiting_for_the_workers(
    digits_shards, tmp_path
):
    """The DataLoader workers outlive a SIGTERM by a grace period (900 s here, so that waiting it out
    would fail the test by its timeout); once the run has saved, nothing is pending and it ends now."""
    run, release = tmp_path / "run", tmp_path / "release"
    args = [*fit_args(digits_shards, run, tmp_path / "steps.jsonl", *hold(release, where="sanity"), epochs=1),
            "--trainer.num_sanity_val_steps", "2"]  # fmt: skip
    proc = start_cli(*args, cwd=ROOT, env={**ENV, "SSL_VIT_WORKER_GRACE_S": "900"}, session=True)
    wait_for(Path(f"{release}.reached"), proc)
    os.killpg(proc.pid, signal.SIGTERM)  # the main process and its DataLoader workers, as SLURM does
    result = proc.wait(timeout=300)
    assert result.returncode == 128 + signal.SIGTERM, result.stderr[-3000:]
    assert f"ssl-vit: stopped by SIGTERM after step 0; saved {run}/checkpoints/last.ckpt" in result.stderr
    assert steps_of(run / "checkpoints/last.ckpt") == 0


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_signals_before_the_trainer_starts_end_or_defer_the_run_cleanly(digits_shards, tmp_path):
    """Before the trainer's handlers exist: SIGTERM ends the fit with its one line, nothing written and
    the lock released; SLURM's requeue signal (SIGUSR1, whose default action would kill the job unsaved
    and unrequeued) is kept, and the run saves at its first step's end."""
    run, release = tmp_path / "run", tmp_path / "release"
    proc = start_cli(*fit_args(digits_shards, run, tmp_path / "steps.jsonl", *hold(release, where="build")),
                     cwd=ROOT, env=ENV, session=True)  # fmt: skip
    wait_for(Path(f"{release}.reached"), proc)
    os.kill(proc.pid, signal.SIGTERM)
    result = proc.wait(timeout=120)
    assert result.returncode == 128 + signal.SIGTERM, result.stderr[-3000:]
    assert lines(result.stderr)[-1] == "ssl-vit: terminated" and "Traceback" not in result.stderr
    assert not run.exists()  # the lock and the run directory it made are gone; nothing else was written

    release.unlink(missing_ok=True)
    Path(f"{release}.reached").unlink()
    proc = start_cli(*fit_args(digits_shards, run, tmp_path / "steps.jsonl", *hold(release, where="build")),
                     cwd=ROOT, env=ENV, session=True)  # fmt: skip
    wait_for(Path(f"{release}.reached"), proc)
    os.kill(proc.pid, signal.SIGUSR1)
    release.touch()
    result = proc.wait(timeout=300)
    assert result.returncode == 128 + signal.SIGTERM, result.stderr[-3000:]
    saved = f"stopped by the requeue signal (SIGUSR1) after step 1; saved {run}/checkpoints/last.ckpt"
    assert saved in result.stderr, result.stderr[-1500:]
    assert steps_of(run / "checkpoints/last.ckpt") == 1 and not (run / "fit.lock").exists()


INTERRUPT_AT_TRAINING = """
import os, sys
from ssl_vit.evaluation.kinds import finetune_protocol as finetune
real = finetune.train_streamed
def train(*args):
    open(os.environ["REACHED"], "w").close()
    return real(*args)
finetune.train_streamed = train
from ssl_vit.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "signum, status, line",
    [(signal.SIGINT, 130, "ssl-vit: interrupted"), (signal.SIGTERM, 143, "ssl-vit: terminated")],
    ids=["ctrl-c", "sigterm"],
)
def test_a_signal_during_a_trained_protocol_of_evaluate_is_one_line_and_nothing_left(
    digits_shards, tmp_path, signum, status, line
):
    suite = tmp_path / "suite.yaml"
    suite.write_text(yaml.safe_dump({
        "backbone": {"variant": "S/8", "img_size": 32, "width": 32, "depth": 1, "heads": 2},
        "data": {"train_urls": str(digits_shards / "train-{000000..000004}.tar"),
                 "test_urls": str(digits_shards / "val-{000000..000003}.tar"), "image_size": 32,
                 "batch_size": 64, "num_workers": 1},
        "protocols": [{"name": "ft", "kind": "finetune", "steps": 100000}],
    }))  # fmt: skip
    out, reached = tmp_path / "out", tmp_path / "reached"
    proc = subprocess.Popen(
        [sys.executable, "-c", INTERRUPT_AT_TRAINING, "evaluate", "scratch", "--suite", str(suite),
         "--out", str(out)],
        cwd=tmp_path, env={**os.environ, **ENV, "WANDB_MODE": "offline", "REACHED": str(reached)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while not reached.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    time.sleep(1)  # into the Lightning fit: its trainer and DataLoader are up
    os.killpg(proc.pid, signum)  # Ctrl-C reaches the whole foreground group, as a scheduler's SIGTERM
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == status, err[-3000:]
    assert lines(err)[-1] == line and "Traceback" not in err
    assert "Detected KeyboardInterrupt" not in err
    assert not out.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []


# --- what commands write --------------------------------------------------------------------------------


@pytest.mark.parametrize("umask, mode", [(0o022, 0o755), (0o027, 0o750)])
def test_out_directories_get_the_permissions_the_umask_gives(umask, mode, tmp_path):
    from ssl_vit.storage.outdir import Output

    previous = os.umask(umask)
    try:
        with Output(tmp_path / "out", "evaluate") as output, output.staged() as temp:
            (temp / "results.json").write_text("{}")
    finally:
        os.umask(previous)
    assert (tmp_path / "out").stat().st_mode & 0o777 == mode


@pytest.mark.slow
def test_evaluate_writes_its_out_directory_as_mkdir_would(digits_shards, tmp_path, cli):
    suite = tmp_path / "suite.yaml"
    suite.write_text(yaml.safe_dump({
        "backbone": {"variant": "S/8", "img_size": 32, "width": 32, "depth": 1, "heads": 2},
        "data": {"train_urls": str(digits_shards / "val-000000.tar"),
                 "test_urls": str(digits_shards / "val-000001.tar"), "image_size": 32, "num_workers": 0},
        "protocols": [{"name": "knn", "kind": "knn", "k": 5}],
    }))  # fmt: skip
    cli("evaluate", "scratch", "--suite", str(suite), "--out", str(tmp_path / "out"))
    mask = os.umask(0)
    os.umask(mask)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o777 & ~mask
