"""What a fit says when its own files go wrong under it, through the CLI: every checkpoint a rollback could
return to damaged, a checkpoint directory that stops taking files, another model's checkpoint where a
rollback returns, a pickled file given as a checkpoint, a validation loss that is not finite. Each is one
line (a warning, or `ssl-vit: error:` and exit status 2), and nothing is lost: last.ckpt stays the newest
good checkpoint."""

import pickle
from pathlib import Path

import pytest
import torch
from cli_helpers import run_cli, wandb_records
from resume_helpers import ROOT, fit_args, spike_prelude
from test_errors import error_line
from test_errors import fit as fast_fit
from test_rollback import ENV, SPIKED, guard_state, rollback_args, rollback_lines

from ssl_vit.checkpoints import integrity

NAN = float("nan")


def at_call(call: int, code: str) -> str:
    """A prelude: `code` runs in the fit's process right before the masked task's `call`-th training step
    (1-based; `run`, the run directory's Path, and `checkpoints`, its checkpoint folder, are defined)."""
    body = "\n".join(f"        {line}" for line in code.strip().splitlines())
    return f"""
import sys as _sys
from pathlib import Path as _Path
import ssl_vit.tasks.masked as _masked_at
_inner, _calls = _masked_at.MaskedPatchPretraining.training_step, [0]
def _at_call(self, batch, batch_idx):
    _calls[0] += 1
    if _calls[0] == {call}:
        run = _Path(self.trainer.default_root_dir)
        checkpoints = run / "checkpoints"
{body}
    return _inner(self, batch, batch_idx)
_masked_at.MaskedPatchPretraining.training_step = _at_call
"""


# Overwrites 32 bytes in the middle of a checkpoint's largest record (ENV puts tests/ on the fit's path).
FLIP = "from resume_helpers import flip as _flip\n"

# Root ignores permission bits (CAP_DAC_OVERRIDE): without that capability it meets them as any user
# does, so a folder made read-only refuses it files (an ACL, a read-only remount, NFS root squash).
AS_A_USER = """
import ctypes as _ctypes
class _Header(_ctypes.Structure):
    _fields_ = [("version", _ctypes.c_uint32), ("pid", _ctypes.c_int)]
class _Caps(_ctypes.Structure):
    _fields_ = [(name, _ctypes.c_uint32) for name in ("effective", "permitted", "inheritable")]
_libc = _ctypes.CDLL(None, use_errno=True)
_header, _caps = _Header(0x20080522, 0), (_Caps * 2)()
assert _libc.capget(_ctypes.byref(_header), _caps) == 0
_caps[0].effective &= ~((1 << 1) | (1 << 2))  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
assert _libc.capset(_ctypes.byref(_header), _caps) == 0, _ctypes.get_errno()
"""


def step_of(path: Path) -> int:
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)["global_step"]


def errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("ssl-vit: error:")]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("damaged", ["every", "newest"])
def test_a_rollback_names_the_damaged_checkpoints_it_passes_over(damaged, digits_shards, tmp_path):
    """A spike at step 10, checkpoints at steps 4 and 8 (last.ckpt: step 8) damaged just before it."""
    run, record = tmp_path / "run", tmp_path / "run.jsonl"
    args = rollback_args(digits_shards, run, record, *SPIKED, steps=12)
    # Each file once (last.ckpt and the newest step file are one file: flipped twice, it would be whole).
    which = "checkpoints.glob('*.ckpt')" if damaged == "every" else "[checkpoints / 'step0000008.ckpt']"
    which = f"{{p.stat().st_ino: p for p in {which}}}.values()"
    prelude = spike_prelude({11: 1e4}) + FLIP + at_call(11, f"for path in {which}:\n    _flip(path)")
    proc = run_cli(*args, cwd=ROOT, env=ENV, prelude=prelude)
    assert "Traceback" not in proc.stderr
    if damaged == "newest":  # (as before) said, and passed over for the checkpoint of step 4
        (line,) = rollback_lines(proc.stderr)
        assert line[4] == "4"
        assert any(
            f"{run}/checkpoints/last.ckpt is damaged" in x and "step0000004.ckpt" in x
            for x in proc.stderr.splitlines()
        ), proc.stderr
        return
    # Nothing to return to: the step is skipped, and the line says why, naming every damaged file.
    (skip,) = [x for x in proc.stderr.splitlines() if x.startswith("ssl-vit: skip:")]
    assert skip.startswith("ssl-vit: skip: step 10 not applied: loss ")
    assert "no checkpoint to roll back to: every one saved by step 10 is damaged (" in skip
    for name in ("last.ckpt", "step0000004.ckpt", "step0000008.ckpt"):
        assert f"{name}: record " in skip and "fails its CRC-32 check" in skip, skip
    assert not rollback_lines(proc.stderr) and step_of(run / "checkpoints/last.ckpt") == 12


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("save", ["periodic", "rollback"])
def test_a_checkpoint_folder_that_stops_taking_files_is_one_line_and_last_stays_good(
    save, digits_shards, tmp_path
):
    """The folder made read-only after the checkpoint of step 4 (`periodic`: the save of step 8 fails)
    or of step 8 (`rollback`: the save of the state a spike at step 10 returned to fails)."""
    run, record = tmp_path / "run", tmp_path / "run.jsonl"
    args = rollback_args(digits_shards, run, record, *SPIKED, steps=12)
    call, spikes, kept = (6, {}, 4) if save == "periodic" else (11, {11: 1e4}, 8)
    prelude = AS_A_USER + spike_prelude(spikes) + at_call(call, "checkpoints.chmod(0o555)")
    try:
        proc = run_cli(*args, cwd=ROOT, env=ENV, prelude=prelude, check=False)
    finally:
        (run / "checkpoints").chmod(0o755)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert errors(proc.stderr) == [
        f"ssl-vit: error: cannot write checkpoints in {run}/checkpoints (Permission denied): its last.ckpt "
        "is the newest good checkpoint; make the directory writable again (permissions, the mount) and "
        "resume with --ckpt_path last"
    ]
    last = run / "checkpoints/last.ckpt"
    assert step_of(last) == kept and integrity.damage(last) is None
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == sorted(
        ["last.ckpt", "step0000004.ckpt", *(["step0000008.ckpt"] if kept == 8 else [])]
    )  # no temporary file left


# Another run's checkpoint of half the width, saved as this run's step 9 (between the checkpoint of step 8
# and the spike at step 10, where a rollback returns).
FOREIGN = """
import torch as _torch
_foreign = _torch.load(checkpoints / "step0000008.ckpt", map_location="cpu", weights_only=True)
_foreign["state_dict"] = {
    key: value[..., : value.shape[-1] // 2].clone() if value.ndim and value.shape[-1] % 2 == 0 else value
    for key, value in _foreign["state_dict"].items()
}
_foreign["global_step"] = 9
_torch.save(_foreign, checkpoints / "step0000009.ckpt")
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_another_models_checkpoint_where_a_rollback_returns_is_one_line(digits_shards, tmp_path):
    run, record = tmp_path / "run", tmp_path / "run.jsonl"
    args = rollback_args(digits_shards, run, record, *SPIKED, steps=12)
    prelude = spike_prelude({11: 1e4}) + at_call(11, FOREIGN)
    proc = run_cli(*args, cwd=ROOT, env=ENV, prelude=prelude, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = errors(proc.stderr)
    assert line.startswith(
        f"ssl-vit: error: {run}/checkpoints/step0000009.ckpt, the checkpoint a rollback returns to, holds "
        "another model than this run's ("
    ), line
    assert " is [" in line and "] there, [" in line and f"move it out of {run}/checkpoints" in line
    last = run / "checkpoints/last.ckpt"
    assert step_of(last) == 8 and integrity.damage(last) is None and not rollback_lines(proc.stderr)


class RunsCode:
    def __reduce__(self):
        return (print, ("this ran",))


@pytest.mark.slow
def test_a_pickled_checkpoint_is_refused_in_one_line_without_torchs_warning(digits_shards, tmp_path):
    """A file `pickle.dump` wrote (protocol 4, not torch's 2): torch warns in two lines before it refuses."""
    path = tmp_path / "pickled.ckpt"
    path.write_bytes(pickle.dumps({"state_dict": {}, "payload": RunsCode()}, protocol=4))
    work = tmp_path / "work"
    work.mkdir()
    for proc in (
        run_cli("info", str(path), check=False),
        run_cli("export", str(path), str(tmp_path / "out.safetensors"), check=False),
        fast_fit(digits_shards, work, "--ckpt_path", str(path)),
    ):
        error_line(proc, str(path), "is not a checkpoint torch can load safely")
        assert "this ran" not in proc.stdout


# The validation loss of every pass NaN: the training goes on.
NAN_VALIDATION = """
import ssl_vit.tasks.masked as _masked_val
_log_metrics = _masked_val.MaskedPatchPretraining.log_metrics
def _nan_validation(self, stage, out, on_step):
    if stage == "val":
        out = out._replace(loss=out.loss * float("nan"))
    return _log_metrics(self, stage, out, on_step)
_masked_val.MaskedPatchPretraining.log_metrics = _nan_validation
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_nonfinite_validation_loss_is_one_warning_per_pass_and_recorded(digits_shards, tmp_path):
    run, record = tmp_path / "run", tmp_path / "run.jsonl"
    args = fit_args(digits_shards, run, record, "--trainer.limit_val_batches", "2", epochs=2, batches=3)
    proc = run_cli(*args, cwd=ROOT, env=ENV, prelude=NAN_VALIDATION)
    warnings = [x for x in proc.stderr.splitlines() if x.startswith("ssl-vit: warning: validation at step")]
    assert warnings == [
        f"ssl-vit: warning: validation at step {step}: val/loss nan; training goes on (a validation sample "
        f"or the precision gives a non-finite loss: {count} such pass(es) in this run)"
        for count, step in ((1, 3), (2, 6))
    ]  # once per pass, not in the sanity check
    assert step_of(run / "checkpoints/last.ckpt") == 6
    recorded = guard_state(run / "checkpoints/last.ckpt")["nonfinite_validations"]
    assert [(r["step"], list(r["metrics"])) for r in recorded] == [(3, ["val/loss"]), (6, ["val/loss"])]
    ((_, records),) = wandb_records(run)
    logged = [r["history"]["item"] for r in records if r["type"] == "history"]
    passes = [h["_step"] for h in logged if "val/loss" in h]  # where the validation passes were logged
    assert len(passes) == 2
    assert [(h["_step"], h["val/nonfinite_passes"]) for h in logged if "val/nonfinite_passes" in h] == [
        (passes[0], 1),
        (passes[1], 2),
    ]
    info = run_cli("info", str(run / "checkpoints/last.ckpt")).stdout
    assert "validation passes with a non-finite loss: 2 (at steps 3, 6)" in info
