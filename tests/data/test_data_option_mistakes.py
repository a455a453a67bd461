"""Out-of-range options of `ssl-vit data convert|inspect` and `ssl-vit bench data`: one line each, exit
2, before anything is generated or written; and Ctrl-C in the middle of a conversion."""

import os
import signal
import time

import pytest
from cli_helpers import start_cli
from test_errors import error_line

BENCH = ["bench", "data", "--images", "4", "--samples", "8", "--memory-samples", "8", "--batch-size", "4"]
BENCH += ["--stored", "64x48", "--image-size", "32"]


@pytest.mark.parametrize(
    "arguments, words",
    [
        (["--images", "0"], ["--images must be at least 1, got 0"]),
        (["--samples", "0"], ["--samples must be at least 1, got 0"]),
        (["--memory-samples", "0"], ["--memory-samples must be at least 1, got 0"]),
        (["--batch-size", "-1"], ["--batch-size must be at least 1, got -1"]),
        (["--image-size", "0"], ["--image-size must be at least 1, got 0"]),
        (["--repeats", "0"], ["--repeats must be at least 1, got 0"]),
        (["--stored", "0x0"], ["--stored 0x0", "1 to 8192"]),
        (["--stored", "100000x100000"], ["--stored 100000x100000", "1 to 8192"]),
        (["--quality", "500"], ["--quality 500", "1 to 100"]),
        (["--quality", "-3"], ["--quality -3", "1 to 100"]),
        (["--crop-scale", "-1", "0.5"], ["--crop-scale -1.0 0.5", "0 < MIN <= MAX <= 1"]),
        (["--crop-scale", "2", "1"], ["--crop-scale 2.0 1.0", "0 < MIN <= MAX <= 1"]),
    ],
)
def test_bench_data_mistakes_are_one_line(cli, arguments, words):
    proc = cli(*BENCH, *arguments, check=False)
    error_line(proc, *words)
    assert proc.stdout == ""


@pytest.mark.parametrize("workers", ["0", "-2"])
def test_convert_and_inspect_need_a_worker(cli, tmp_path, workers):
    out = tmp_path / "shards"
    proc = cli("data", "convert", "synthetic:8", str(out), "--workers", workers, check=False)
    error_line(proc, f"--workers must be at least 1, got {workers}")
    assert not out.exists()
    proc = cli("data", "inspect", str(tmp_path / "x-000000.tar"), "--workers", workers, check=False)
    error_line(proc, f"--workers must be at least 1, got {workers}")


@pytest.mark.parametrize(("signum", "line"), [(signal.SIGINT, "interrupted"), (signal.SIGTERM, "terminated")])
def test_a_stop_before_the_first_shard_is_one_line_and_leaves_nothing(tmp_path, signum, line):
    """Ctrl-C or SIGTERM reaches the command's whole process group while its first shard is being
    written: exit 128 + the signal, one line, no traceback, and nothing left: the OUTDIR it made is gone."""
    out = tmp_path / "shards"
    args = ("data", "convert", "synthetic:20000", str(out), "--shard-size", "20000", "--no-progress")
    running = start_cli(*args, session=True)
    first = out / ".train.partial" / "train-000000.tar"
    deadline = time.monotonic() + 120
    while not first.exists() and running.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running.poll() is None, running.wait().stderr
    os.killpg(running.pid, signum)
    proc = running.wait(120)
    assert proc.returncode == 128 + signum and proc.stderr == f"ssl-vit: {line}\n", proc.stderr
    assert not out.exists()
