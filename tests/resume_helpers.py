"""Callbacks tests add to `ssl-vit fit` (`--trainer.callbacks+=resume_helpers.StepRecorder`): one JSON
line per training step with what the resume tests compare; NaN gradients on one rank; a hold before
training; the learning rate each optimizer step applied, every rank's weights at the end. And a prelude
that makes chosen losses spike, and bytes of a checkpoint overwritten."""

import hashlib
import json
import os
import struct
import time
import zipfile

import pytorch_lightning as pl
import torch


class StepRecorder(pl.Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        record = {
            "step": trainer.global_step,
            "epoch": trainer.current_epoch,
            "loss": float(outputs["loss"]),
            "lr": trainer.optimizers[0].param_groups[0]["lr"],
            "keys": list(batch["key"]),
            "rank": trainer.global_rank,
        }
        with open(self.path, "a") as f:  # one write per line: a SIGKILL leaves whole lines
            f.write(json.dumps(record) + "\n")


class PoisonGradients(pl.Callback):
    """Makes the gradients of optimizer steps `steps` NaN on `rank` only, after DDP has averaged them:
    one rank sees a non-finite gradient, the others do not (an overflow in one rank's backward)."""

    def __init__(self, steps: list[int], rank: int = 0) -> None:
        self.steps, self.rank = set(steps), rank

    def on_after_backward(self, trainer, pl_module) -> None:
        if trainer.global_step in self.steps and trainer.global_rank == self.rank:
            next(p for p in pl_module.parameters() if p.grad is not None).grad.fill_(float("nan"))


class HoldBeforeTraining(pl.Callback):
    """Holds the fit before its first training step until the file `release` exists or a SIGTERM came,
    after creating `release + ".reached"`: a test decides when the fit may go on (while it holds its run
    directory), with no timing of its own."""

    def __init__(self, release: str) -> None:
        self.release = release

    def on_train_start(self, trainer, pl_module) -> None:
        open(self.release + ".reached", "w").close()
        while not os.path.exists(self.release) and not trainer.received_sigterm:
            time.sleep(0.02)


class HoldAt(pl.Callback):
    """Holds the fit at a moment a test chooses (`where`: `build`, as the CLI builds the trainer's
    callbacks, before any hook runs; `sanity`, the first validation batch of the sanity check; `step`,
    the end of training step `step`), after creating `release + ".reached"`, until the file `release`
    exists or a SIGTERM came: the test acts (a signal, a kill) while the fit is there."""

    def __init__(self, release: str, where: str = "step", step: int = 1, occurrence: int = 1) -> None:
        self.release, self.where, self.step = release, where, step
        self.occurrence, self.seen = (
            occurrence,
            0,
        )  # `step`: the how-manieth end of that step (a rollback repeats it)
        if where == "build":
            self._hold(None)

    def _hold(self, trainer) -> None:
        open(self.release + ".reached", "w").close()
        while not os.path.exists(self.release) and not (trainer and trainer.received_sigterm):
            time.sleep(0.02)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if self.where == "sanity" and trainer.sanity_checking and batch_idx == 0:
            self._hold(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.where == "step" and trainer.global_step == self.step:
            self.seen += 1
            if self.seen == self.occurrence:
                self._hold(trainer)


class AppliedLr(pl.Callback):
    """One JSON line per optimizer step in `path`: the step and the learning rate the optimizer applied
    (read by a hook on its `step`, registered before the non-finite guard's, which scales it after a
    rollback and puts it back after the step)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_fit_start(self, trainer, pl_module) -> None:
        def record(optimizer, args, kwargs) -> None:
            with open(self.path, "a") as f:
                f.write(
                    json.dumps({"step": trainer.global_step, "lr": optimizer.param_groups[0]["lr"]}) + "\n"
                )

        for optimizer in trainer.optimizers:
            optimizer.register_step_post_hook(record)


class WeightsDigest(pl.Callback):
    """At the end of training, each rank writes `path.RANK`: its step and a SHA-256 of its parameters
    (whole tensors: under DDP every rank holds them all)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module) -> None:
        digest = hashlib.sha256()
        for name, value in sorted(pl_module.state_dict().items()):
            digest.update(name.encode() + value.detach().cpu().contiguous().numpy().tobytes())
        with open(f"{self.path}.{trainer.global_rank}", "w") as f:
            json.dump({"step": trainer.global_step, "sha256": digest.hexdigest()}, f)


class StateAtStep(pl.Callback):
    """At the start of the second batch that starts at optimizer step `step` (a rollback has returned to
    it), writes to `path` which states equal those of the checkpoint `checkpoint` as it was at the first
    (the rollback saves over it): the weights (an EMA teacher's included), the optimizer's state, the
    schedules, this rank's torch RNG."""

    def __init__(self, path: str, checkpoint: str, step: int) -> None:
        self.path, self.checkpoint, self.step, self.saved = path, checkpoint, step, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step != self.step:
            return
        if self.saved is None:
            self.saved = torch.load(self.checkpoint, map_location="cpu", weights_only=True)
            return
        saved = self.saved
        weights = pl_module.state_dict()
        optimizer = trainer.optimizers[0].state_dict()
        same = {
            "weights": weights.keys() == saved["state_dict"].keys()
            and all(value.cpu().equal(saved["state_dict"][name]) for name, value in weights.items()),
            "teacher": any(name.startswith("teacher.") for name in weights),
            "optimizer": _equal(optimizer, saved["optimizer_states"][0]),
            "schedules": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs]
            == saved["lr_schedulers"],
            "rng": torch.get_rng_state().equal(saved["callbacks"]["RandomState"]["ranks"][0]["torch"]),
        }
        with open(self.path, "w") as f:
            json.dump(same, f)


def _equal(a, b) -> bool:
    """Nested dicts, lists and tensors, equal value for value."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_equal, a, b))
    if hasattr(a, "equal"):
        return hasattr(b, "equal") and a.cpu().equal(b.cpu())
    return a == b


def spike_prelude(spikes: dict[int, float], rank: int | None = None, record: str = "") -> str:
    """Python for a command's `prelude` (or torchrun's `cli_client.PRELUDE_ENV`): the masked task's
    `training_step` multiplies the loss of its N-th call in this process (1-based) by `spikes[N]`
    (`float("nan")`: NaN), on `rank` only (None: every rank); with `record`, one JSON line per call
    there: the call, whether autocast was on for it (CPU), the loss returned."""
    factors = {call: str(float(factor)) for call, factor in spikes.items()}
    return f"""
import json as _json
import torch as _torch
import ssl_vit.tasks.masked as _masked
_step, _count = _masked.MaskedPatchPretraining.training_step, [0]
_factors = {{call: float(factor) for call, factor in {factors!r}.items()}}
def _spiked(self, batch, batch_idx):
    out = _step(self, batch, batch_idx)
    _count[0] += 1
    if _count[0] in _factors and {rank!r} in (None, self.global_rank):
        out["loss"] = out["loss"] * _factors[_count[0]]
    if {record!r}:
        with open({record!r}, "a") as f:
            f.write(_json.dumps({{"call": _count[0], "autocast": _torch.is_autocast_enabled("cpu"),
                                  "loss": float(out["loss"].detach())}}) + "\\n")
    return out
_masked.MaskedPatchPretraining.training_step = _spiked
"""


def read_steps(path) -> list[dict]:
    """The recorded steps, in the order they were written (a resumed run appends after the first)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def fit_args(
    shards, run_dir, record, *extra: str, epochs: int = 2, batches: int = 6, small_monitor: bool = True
) -> list[str]:
    """`ssl-vit fit` of the quickstart MPP recipe, small: `epochs` x `batches` steps, two DataLoader
    workers, a checkpoint every 4 steps, every step logged and recorded in `record`. `small_monitor`:
    its few-shot probe on 800 of the digits (`cli_helpers.small_fewshot_monitor`), not the data's own."""
    from cli_helpers import small_fewshot_monitor  # here: the callbacks above run in fits, without pytest

    return [
        "fit", "--config", str(ROOT / "recipes/quickstart/mpp.yaml"),
        *(small_fewshot_monitor(shards) if small_monitor else []),
        "--data.init_args.train_urls", f"{shards}/train-{{000000..000004}}.tar",
        "--data.init_args.val_urls", f"{shards}/val-{{000000..000003}}.tar",
        "--data.init_args.num_workers", "2",
        "--data.init_args.batch_size", "32",
        "--data.init_args.train_batches", str(batches),
        "--trainer.max_epochs", str(epochs),
        "--checkpoint.every_n_train_steps", "4",
        "--trainer.log_every_n_steps", "1",
        "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", str(run_dir),
        "--model.init_args.picture_every_n_steps", "0",
        "--trainer.callbacks+=resume_helpers.StepRecorder", "--trainer.callbacks.path", str(record),
        *extra,
    ]  # fmt: skip


def flip(path, count: int = 32) -> None:
    """Overwrite `count` bytes in the middle of the largest record's data (a tensor's storage), in place."""
    with zipfile.ZipFile(path) as archive:
        record = max(archive.infolist(), key=lambda r: r.file_size)
    with open(path, "r+b") as f:
        f.seek(record.header_offset + 26)
        name_length, extra_length = struct.unpack("<HH", f.read(4))
        f.seek(record.header_offset + 30 + name_length + extra_length + record.file_size // 2)
        data = f.read(count)
        f.seek(-len(data), os.SEEK_CUR)
        f.write(bytes(b ^ 0xFF for b in data))
