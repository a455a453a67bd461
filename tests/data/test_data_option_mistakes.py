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


def test_ctrl_c_is_one_line_and_leaves_no_partial_split(tmp_path):
    """Ctrl-C reaches the command's whole process group: exit 130, one line, no traceback, and the
    split being written is neither left half-written nor published."""
    out = tmp_path / "shards"
    running = start_cli("data", "convert", "synthetic:200000", str(out), "--no-progress", session=True)
    deadline = time.monotonic() + 120
    while not (out / ".train.partial").exists() and running.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running.poll() is None, running.wait().stderr
    os.killpg(running.pid, signal.SIGINT)
    proc = running.wait(120)
    assert proc.returncode == 130 and proc.stderr == "ssl-vit: interrupted\n", proc.stderr
    assert sorted(p.name for p in out.iterdir()) == []
