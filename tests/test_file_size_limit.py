"""A file size limit (`ulimit -f`, EFBIG) while a command writes is one line, as a full disk is (it was an
18-75-line traceback), and nothing half-written is left. Through the CLI; `data convert`'s case is a row
of tests/test_hostile_inputs.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_helpers import one_step_fit_args, run_cli

# A prelude: files of this process may not grow past 64 KB (Python ignores SIGXFSZ: the write fails).
LIMITED = """
import resource
resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))
"""


def one_error_line(proc) -> str:
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ssl-vit: error:")]
    assert len(errors) == 1 and proc.stderr.rstrip().endswith(errors[0]), proc.stderr[-3000:]
    assert "file too large" in errors[0] and "ulimit -f" in errors[0], errors[0]
    return errors[0]


@pytest.fixture(scope="module")
def checkpoint(digits_shards, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("limit") / "run"
    run_cli(*one_step_fit_args(digits_shards, run, "--trainer.logger", "false"))
    return run / "checkpoints" / "last.ckpt"


def test_export_past_the_file_size_limit_is_one_line(checkpoint, tmp_path):
    out = tmp_path / "model.safetensors"
    proc = run_cli("export", str(checkpoint), str(out), check=False, prelude=LIMITED)
    one_error_line(proc)
    assert list(tmp_path.iterdir()) == []  # nothing half-written


def test_a_checkpoint_past_the_file_size_limit_is_one_line(digits_shards, tmp_path):
    run = tmp_path / "run"
    args = one_step_fit_args(digits_shards, run, "--trainer.logger", "false")
    proc = run_cli(*args, check=False, prelude=LIMITED)
    line = one_error_line(proc)
    assert str(run / "checkpoints") in line
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.endswith(".tmp")]
