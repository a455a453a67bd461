"""A damaged checkpoint (truncated, bits flipped: `ssl_vit.checkpoints.integrity`) is never loaded as if it
were intact: resuming, evaluating, exporting or initialising from it is refused in one line naming the
file, and `--ckpt_path last` resumes from the newest checkpoint that verifies instead, exactly as an
uninterrupted run continues from there."""

import os
import subprocess
from pathlib import Path

import pytest
import torch
from cli_helpers import run_cli
from resume_helpers import ROOT, fit_args, flip, read_steps
from test_errors import error_line, listing
from test_run_dir_safety import stamps

from ssl_vit.checkpoints import integrity, read_weights
from ssl_vit.checkpoints.store import SafeCheckpointIO, check_ckpt_path, load_checkpoint, resumable
from ssl_vit.errors import UserError
from ssl_vit.storage.lock import LOCK_NAME

ENV = {"PYTHONPATH": str(Path(__file__).parent), "OMP_NUM_THREADS": "1"}


def truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


DAMAGE = {"truncated": truncate, "bit-flipped": flip}


def save(path: Path, step: int = 1) -> Path:
    SafeCheckpointIO().save_checkpoint({"state_dict": {"w": torch.arange(4096.0)}, "global_step": step}, path)
    return path


# --- the check -----------------------------------------------------------------------------------------


def test_damage_names_what_is_wrong(tmp_path):
    path = save(tmp_path / "a.ckpt")
    assert integrity.damage(path) is None
    flip(path)
    assert "fails its CRC-32 check" in integrity.damage(path)
    assert torch.load(path, weights_only=True)["global_step"] == 1  # what torch alone would have loaded
    truncate(save(path))
    assert "zip directory is missing: truncated at" in integrity.damage(path)
    path.write_bytes(b"")
    assert integrity.damage(path) == "it is empty"


def test_files_without_checksums_load_unchecked(tmp_path):
    legacy = tmp_path / "legacy.ckpt"  # torch's pre-zip format, and other tools' files: nothing to verify
    torch.save({"state_dict": {}}, legacy, _use_new_zipfile_serialization=False)
    assert integrity.damage(legacy) is None
    torch.serialization.set_crc32_options(False)
    try:
        torch.save({"state_dict": {"w": torch.ones(8)}}, tmp_path / "no_crc.ckpt")
    finally:
        torch.serialization.set_crc32_options(True)
    assert integrity.damage(tmp_path / "no_crc.ckpt") is None


def test_every_loader_refuses_a_damaged_checkpoint(tmp_path):
    path = save(tmp_path / "a.ckpt")
    flip(path)
    loaders = (SafeCheckpointIO().load_checkpoint, load_checkpoint, check_ckpt_path, read_weights)
    for load in loaders:
        with pytest.raises(UserError, match=f"{path} is damaged .record .* fails its CRC-32 check"):
            load(str(path))


def test_last_resumes_the_newest_checkpoint_that_verifies(tmp_path, capsys):
    assert resumable(tmp_path) is None  # no checkpoint: a fresh start
    for step in (2, 4, 6):
        save(tmp_path / f"step{step:07d}.ckpt", step)
        os.utime(tmp_path / f"step{step:07d}.ckpt", (step, step))  # written in step order
    os.link(tmp_path / "step0000006.ckpt", tmp_path / "last.ckpt")  # as LastLinkCheckpoint links it
    assert resumable(tmp_path) == tmp_path / "last.ckpt"
    flip(tmp_path / "last.ckpt")  # and so step0000006.ckpt, the same file
    assert resumable(tmp_path) == tmp_path / "step0000004.ckpt"
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"ssl-vit: warning: {tmp_path / 'last.ckpt'} is damaged (record ")
    assert line.endswith(
        f"resuming from {tmp_path / 'step0000004.ckpt'}, the newest checkpoint that verifies "
        "(also damaged: step0000006.ckpt)"
    )
    for step in (2, 4):
        truncate(tmp_path / f"step{step:07d}.ckpt")
    with pytest.raises(integrity.DamagedCheckpoint, match=f"no other checkpoint in {tmp_path} verifies"):
        resumable(tmp_path)


def test_last_is_chosen_by_the_step_a_file_records_not_by_its_modification_time(tmp_path, capsys):
    for step in (4, 8, 12):
        save(tmp_path / f"step{step:07d}.ckpt", step)
    os.utime(tmp_path / "step0000008.ckpt", (4e9, 4e9))  # written under a clock 60 years ahead
    assert resumable(tmp_path) == tmp_path / "step0000012.ckpt"
    truncate(tmp_path / "step0000012.ckpt")  # its step unreadable: passed over, and named
    assert resumable(tmp_path) == tmp_path / "step0000008.ckpt"
    assert (
        f"{tmp_path / 'step0000012.ckpt'} is damaged (its zip directory is missing" in capsys.readouterr().err
    )


# --- through the CLI -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def six_steps(digits_shards, tmp_path_factory) -> tuple[Path, dict[int, dict]]:
    """A 6-step MPP run (checkpoints at steps 4 and 6, last.ckpt the latter) and its steps' records."""
    tmp = tmp_path_factory.mktemp("six")
    run, record = tmp / "run", tmp / "steps.jsonl"
    run_cli(*args(digits_shards, run, record), cwd=ROOT, env=ENV)
    return run, {r["step"]: r for r in read_steps(record)}


def args(shards: Path, run: Path, record: Path, *extra: str) -> list[str]:
    return fit_args(shards, run, record, "--data.init_args.num_workers", "0", *extra, epochs=1, batches=6)


@pytest.fixture
def run(six_steps, tmp_path) -> Path:
    """A copy of the 6-step run, hard links kept (last.ckpt and step0000006.ckpt stay one file)."""
    copy = tmp_path / "run"
    subprocess.run(["cp", "-a", str(six_steps[0]), str(copy)], check=True)
    return copy


@pytest.mark.slow
@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_last_ckpt_resumes_from_the_newest_intact_checkpoint(
    damage, digits_shards, six_steps, run, tmp_path
):
    checkpoints = run / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "last.ckpt",
        "step0000004.ckpt",
        "step0000006.ckpt",
    ]
    assert (checkpoints / "last.ckpt").samefile(checkpoints / "step0000006.ckpt")
    DAMAGE[damage](checkpoints / "last.ckpt")
    kept = (checkpoints / "step0000004.ckpt").stat().st_mtime_ns

    record = tmp_path / "resumed.jsonl"
    proc = run_cli(*args(digits_shards, run, record, "--ckpt_path", "last"), cwd=ROOT, env=ENV)
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("ssl-vit: warning:")]
    assert line.startswith(f"ssl-vit: warning: {checkpoints / 'last.ckpt'} is damaged (")
    assert f"resuming from {checkpoints / 'step0000004.ckpt'}, the newest checkpoint that verifies" in line
    assert f"Restored all states from the checkpoint at {checkpoints / 'step0000004.ckpt'}" in proc.stderr

    # Steps 5 and 6 again, as the uninterrupted run had them; then a new, intact step 6 and last.ckpt.
    expected, resumed = six_steps[1], {r["step"]: r for r in read_steps(record)}
    assert sorted(resumed) == [5, 6]
    for step, got in resumed.items():
        assert abs(got["loss"] - expected[step]["loss"]) < 1e-6, (step, got["loss"], expected[step]["loss"])
        assert got["keys"] == expected[step]["keys"] and got["lr"] == expected[step]["lr"]
    for name in ("last.ckpt", "step0000006.ckpt"):
        assert integrity.damage(checkpoints / name) is None
        assert torch.load(checkpoints / name, weights_only=True)["global_step"] == 6
    assert (checkpoints / "step0000004.ckpt").stat().st_mtime_ns == kept  # the good one left as it was
    assert not (run / LOCK_NAME).exists()


@pytest.mark.slow
def test_a_damaged_checkpoint_without_an_intact_one_is_refused(digits_shards, run, tmp_path):
    checkpoints = run / "checkpoints"
    (checkpoints / "step0000004.ckpt").unlink()
    flip(checkpoints / "last.ckpt")
    before, written = listing(tmp_path), stamps(tmp_path)
    record = tmp_path / "resumed.jsonl"
    for ckpt, words in (
        (
            "last",
            [f"{checkpoints / 'last.ckpt'} is damaged (record", f"no other checkpoint in {checkpoints}"],
        ),
        (
            str(checkpoints / "step0000006.ckpt"),
            [f"--ckpt_path {checkpoints / 'step0000006.ckpt'} is damaged"],
        ),
    ):
        proc = run_cli(*args(digits_shards, run, record, "--ckpt_path", ckpt), cwd=ROOT, env=ENV, check=False)
        error_line(proc, *words)
        assert listing(tmp_path) == before and stamps(tmp_path) == written  # nothing written or replaced


@pytest.mark.slow
def test_evaluate_export_and_init_from_refuse_a_damaged_checkpoint(digits_shards, run, tmp_path):
    damaged = run / "checkpoints/step0000004.ckpt"
    truncate(damaged)
    suite, out = str(ROOT / "recipes/eval/quickstart.yaml"), tmp_path / "out"
    for command in (
        ("evaluate", str(damaged), "--suite", suite, "--out", str(out)),
        ("export", str(damaged), str(out.with_suffix(".safetensors"))),
    ):
        proc = run_cli(*command, cwd=tmp_path, check=False)
        error_line(proc, f"{damaged} is damaged (its zip directory is missing")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no output, no temp folder
    fresh = tmp_path / "fresh"
    proc = run_cli(
        *args(
            digits_shards, fresh, tmp_path / "r.jsonl", "--model.init_args.training.init_from", str(damaged)
        ),
        cwd=ROOT, env=ENV, check=False,
    )  # fmt: skip
    error_line(proc, f"{damaged} is damaged")
    assert not fresh.exists()
