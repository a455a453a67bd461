"""A copied or a moved run directory resumes from its own checkpoints and never writes into the original
(issue 42: config.yaml pinned `checkpoint.dirpath` to the original's absolute path). Through the CLI."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch
from cli_helpers import one_step_fit_args, run_cli


def tree(root: Path) -> dict[str, str]:
    """Every file under `root` and its SHA-256; W&B's own debug logs by name only (its service may
    append to them after the fit has ended)."""
    return {
        str(p.relative_to(root)): "log" if "logs" in p.parts else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def step(path: Path) -> int:
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)["global_step"]


@pytest.fixture
def trained(digits_shards, tmp_path) -> Path:
    """A run of 2 steps with a checkpoint at each, run with an absolute run directory."""
    run = tmp_path / "runA"
    args = one_step_fit_args(digits_shards, run, "--data.init_args.train_batches", "2",
                             "--checkpoint.every_n_train_steps", "1")  # fmt: skip
    run_cli(*args, cwd=tmp_path)
    assert step(run / "checkpoints" / "last.ckpt") == 2
    return run


@pytest.mark.parametrize("how", ["copy, --trainer.default_root_dir", "copy", "move"])
def test_a_copied_or_moved_run_resumes_from_its_own_checkpoints(how, trained, tmp_path):
    other = tmp_path / "elsewhere" / "runB"
    other.parent.mkdir()
    if how == "move":
        shutil.move(trained, other)
    else:
        shutil.copytree(trained, other, symlinks=True)
    before = tree(trained) if trained.exists() else None
    given = ["--trainer.default_root_dir", str(other)] if "default_root_dir" in how else []
    proc = run_cli("fit", "--config", str(other / "config.yaml"), *given, "--ckpt_path", "last",
                   "--trainer.max_epochs", "2", cwd=tmp_path, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert step(other / "checkpoints" / "last.ckpt") == 4
    assert sorted(p.name for p in (other / "checkpoints").glob("*.ckpt")) == [
        "last.ckpt", "step0000003.ckpt", "step0000004.ckpt"
    ]  # fmt: skip
    restored = [line for line in proc.stderr.splitlines() if line.startswith("Restored all states from")]
    assert restored == [f"Restored all states from the checkpoint at {other / 'checkpoints' / 'last.ckpt'}"]
    if how == "move":
        assert not trained.exists()  # not made again
    else:
        assert tree(trained) == before  # the original untouched
    if not given:  # the run directory followed, in one warning line
        warnings = [line for line in proc.stderr.splitlines() if "names the run directory" in line]
        assert warnings == [
            f"ssl-vit: warning: {other / 'config.yaml'} names the run directory {trained}, but lies in "
            f"{other}: the run in {other} is run (give --trainer.default_root_dir to choose another)"
        ], proc.stderr
