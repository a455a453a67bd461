"""A NaN or inf in the loss or the gradients, or a loss spike, on any rank: skip the step, stop the run, or
roll back to the last good checkpoint and step over the batches that led there; every rank at the same
step, each time one line and a W&B metric, recorded in the checkpoint; and never a non-finite state
written over a checkpoint.

Under DDP the gradients are all-reduced before the optimizer step, so a NaN on one rank's loss reaches
every rank's gradients; with FSDP each rank holds a shard; a loss spike can be one rank's alone. Either
way every decision is reduced over the ranks, so they skip, stop or roll back together and none waits
for the others in a collective.

A rollback (`policy: rollback`): `ssl_vit.run.spikes` judges each step's loss (`RollbackPolicy.read`)
against the running median. A spike's update is not applied (its gradients are dropped before the
optimizer step), and at the end of its step every rank restores the newest intact checkpoint of the run
saved at or before it (`ssl_vit.run.rollback`), moves its data stream past the batches read since that
checkpoint, the spike's included, plus `skip_batches` more (`ShardDataModule.skip_batches`: positions
only move forward, so no batch between the checkpoint and the spike is trained on twice, and the data of
a spike never comes back after its rollback), rewinds W&B to the checkpoint's step as a resume does, and
saves the rolled-back state at once, over that checkpoint (`LastLinkCheckpoint.save_rolled_back`): a
kill or a SIGTERM after it resumes from the rolled-back state, with its history, and never replays the
batches it stepped over. All of it runs inside one training hook, where a SIGTERM is only noted: the
save it causes comes after the rollback is complete.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any, ClassVar, Literal

import pytorch_lightning as pl
import torch

from ssl_vit.checkpoints.store import NothingIntact, resumable
from ssl_vit.errors import BadValue, UserError
from ssl_vit.internals import accumulating, count_skipped, logging_step, loss_scale, total_batch_idx
from ssl_vit.run.preemption import last_path
from ssl_vit.run.rollback import SafeSteps, restore_learner
from ssl_vit.run.spikes import NON_FINITE, SPIKE, SpikeDetector


class NonFiniteError(UserError):
    """Training stopped on a non-finite loss or gradient, or a loss spike it may no longer roll back; the
    message names the step and the fix."""


# --- the policies: what differs between skip, stop and rollback --------------------------------------


class NonFinitePolicy:
    """What a policy does at the guard's hooks where the policies differ; here: nothing. A policy acts
    through its guard (`skip`, `stop`) and keeps there what a checkpoint records of it (so a run may
    resume under another policy); what it holds itself lasts one step, or until the next check."""

    name: ClassVar[str]  # the `nonfinite.policy` value that chooses it (`POLICIES`)
    judges_scaled_steps: ClassVar[bool] = False  # under 16-mixed (the end of `NonFiniteGuard`'s docstring)

    def __init__(self, guard: NonFiniteGuard) -> None:
        self.guard = guard

    def setup(self, trainer: pl.Trainer) -> None:
        """At the fit's setup."""

    def on_fit_start(self, trainer: pl.Trainer) -> None:
        pass

    def on_train_batch_start(self, trainer: pl.Trainer) -> None:
        pass

    def on_before_backward(self, loss: torch.Tensor) -> None:
        """`loss`: a micro-batch's, already divided by the micro-batches of the step."""

    def on_gradients(self, trainer: pl.Trainer, optimizer, norm: torch.Tensor, scaler: bool) -> None:
        """Before the optimizer step: `norm` is this rank's gradient norm (0-dim, on the device); `scaler`:
        the gradients are the gradient scaler's (16-mixed). Zeroing `optimizer`'s gradients drops the
        step's update."""

    def on_train_batch_end(self, trainer: pl.Trainer, outputs) -> None:
        pass

    def on_save_checkpoint(self, trainer: pl.Trainer) -> None:
        pass


class SkipPolicy(NonFinitePolicy):
    """`skip` (`NonFiniteGuard`'s Args)."""

    name = "skip"

    def on_gradients(self, trainer: pl.Trainer, optimizer, norm: torch.Tensor, scaler: bool) -> None:
        if trainer.strategy.reduce_boolean_decision(not bool(torch.isfinite(norm)), all=False):
            optimizer.zero_grad(set_to_none=True)  # torch optimizers leave parameters without grad untouched
            self.guard.skip(trainer, trainer.global_step, NON_FINITE)


class StopPolicy(NonFinitePolicy):
    """`stop` (`NonFiniteGuard`'s Args): the first bad step is kept on the device until a check reads it."""

    name = "stop"

    def __init__(self, guard: NonFiniteGuard) -> None:
        super().__init__(guard)
        self.first_bad: torch.Tensor | None = None  # the first bad step, -1 while none, on the device

    def on_gradients(self, trainer: pl.Trainer, optimizer, norm: torch.Tensor, scaler: bool) -> None:
        bad = ~torch.isfinite(norm)
        if self.first_bad is None:
            self.first_bad = torch.full((), -1, dtype=torch.long, device=bad.device)
        self.first_bad = torch.where(bad & (self.first_bad < 0), trainer.global_step, self.first_bad)

    def on_train_batch_end(self, trainer: pl.Trainer, outputs) -> None:
        if accumulating(trainer):  # the step is not done: its micro-batches would each check again
            return
        every = self.guard.check_every or trainer.log_every_n_steps
        if trainer.global_step % max(1, every) == 0:
            self.check(trainer)

    def on_save_checkpoint(self, trainer: pl.Trainer) -> None:
        self.check(trainer)

    def check(self, trainer: pl.Trainer) -> None:
        """Stops the run if any rank has seen a bad step: one reduction and one host read."""
        first = self.first_bad
        if first is None:
            first = torch.full((), -1, dtype=torch.long, device=trainer.strategy.root_device)
        # Reduced where it lives (NCCL reduces only device tensors), then read once.
        first = int(trainer.strategy.reduce(first.to(torch.float64), reduce_op="max"))
        if first >= 0:
            self.guard.stop(trainer, f"{NON_FINITE} at step {first}")


class RollbackPolicy(NonFinitePolicy):
    """`rollback` (`NonFiniteGuard`'s Args, and the module's docstring)."""

    name = "rollback"
    judges_scaled_steps = True

    def __init__(self, guard: NonFiniteGuard) -> None:
        super().__init__(guard)
        self.loss: torch.Tensor | None = None  # the step's loss so far, on the device
        self.spike: dict[str, Any] | None = None  # this step's, found before its update

    def setup(self, trainer: pl.Trainer) -> None:
        checkpointing = trainer.checkpoint_callback is not None
        check_rollback(checkpointing, trainer.datamodule, str(trainer.precision), self.guard.safe)

    def on_fit_start(self, trainer: pl.Trainer) -> None:
        self.guard.safe.attach(trainer)

    def on_train_batch_start(self, trainer: pl.Trainer) -> None:
        self.guard.safe.before_batch(trainer)

    def on_before_backward(self, loss: torch.Tensor) -> None:
        loss = loss.detach()  # summed over the step's micro-batches (each already divided by them)
        self.loss = loss if self.loss is None else self.loss + loss

    def on_gradients(self, trainer: pl.Trainer, optimizer, norm: torch.Tensor, scaler: bool) -> None:
        detector = self.guard.detector
        loss, finite = self.read(trainer, norm, scaler)
        reason = detector.judge(loss, finite, scaler)
        if reason is not None:
            optimizer.zero_grad(set_to_none=True)  # (16-mixed: the scaler skips it then too)
            self.spike = {"step": trainer.global_step, "loss": loss if finite else None}
            self.spike.update(median=detector.median, reason=reason)

    def on_train_batch_end(self, trainer: pl.Trainer, outputs) -> None:
        if accumulating(trainer):
            return
        guard = self.guard
        spike, self.spike = self.spike, None
        if spike is None:
            guard.safe.after_step(trainer)
            return
        anchor, none = self.anchor(trainer, spike["step"])
        if anchor is None:
            guard.skip(trainer, spike["step"], f"{spike_detail(spike)}; {none}")
        elif len(guard.rollbacks) >= guard.max_rollbacks:
            what = "a " if spike["reason"] == SPIKE else ""
            guard.stop(
                trainer,
                f"{what}{spike['reason']} at step {spike['step']} ({spike_detail(spike)}) after "
                f"{guard.max_rollbacks} rollback(s), nonfinite.max_rollbacks",
            )
        else:
            self.roll_back(trainer, anchor, spike)
            if isinstance(outputs, dict):
                # The hooks after this one (health, pictures) would take the spike's outputs for those
                # of the rolled-back step.
                outputs.clear()

    def read(self, trainer: pl.Trainer, norm: torch.Tensor, scaler: bool) -> tuple[float, bool]:
        """The step's loss, highest over the ranks, and whether every rank's loss and gradient norm are
        finite: one reduction and one host read."""
        loss, self.loss = self.loss, None
        if loss is None:
            loss = torch.zeros((), device=norm.device)
        elif scaler:  # on_before_backward saw it multiplied by the scale (torch has no public async getter)
            loss = loss / loss_scale(trainer.precision_plugin.scaler)
        bad = ~(torch.isfinite(loss) & torch.isfinite(norm))
        stats = torch.stack([torch.where(bad, torch.zeros_like(loss), loss).float(), bad.float()])
        high, worst = trainer.strategy.reduce(stats, reduce_op="max").tolist()
        return high, not worst

    def anchor(self, trainer: pl.Trainer, step: int) -> tuple[str | None, str]:
        """The newest intact checkpoint of the run saved at or before `step` (rank 0 looks, every rank
        gets its answer), or None and why there is none."""
        found, none = None, "no checkpoint to roll back to yet"
        if trainer.is_global_zero:
            try:
                found = resumable(last_path(trainer).parent, max_step=step)
            except NothingIntact as err:  # every one damaged: nothing good to return to, and they are said
                damaged = "; ".join(f"{path.name}: {why}" for path, why in err.damaged)
                none = f"no checkpoint to roll back to: every one saved by step {step} is damaged ({damaged})"
        found, none = trainer.strategy.broadcast((str(found) if found is not None else None, none))
        return found, none

    def roll_back(self, trainer: pl.Trainer, anchor: str, spike: dict[str, Any]) -> None:
        guard = self.guard
        seconds, clock = {}, time.perf_counter()
        to_step, first = restore_learner(trainer, anchor)
        seconds["restore"], clock = time.perf_counter() - clock, time.perf_counter()
        last = total_batch_idx(trainer)  # the spike's batch, counted from the run's first
        wanted = guard.skip_batches if guard.skip_batches is not None else 2 * (last + 1 - first)
        accumulate = trainer.accumulate_grad_batches  # whole optimizer steps, so accumulation stays in phase
        skipped = trainer.datamodule.skip_batches(math.ceil(wanted / accumulate) * accumulate)
        count_skipped(trainer, skipped)
        guard.safe.start()
        seconds["data"], clock = time.perf_counter() - clock, time.perf_counter()
        record = {
            "step": spike["step"], "to_step": to_step, "loss": spike["loss"], "median": spike["median"],
            "reason": spike["reason"], "batches": [first, last + skipped], "checkpoint": anchor,
            "seconds": seconds,
        }  # fmt: skip
        guard.rollbacks.append(record)
        for logger in trainer.loggers:
            if callable(getattr(logger, "rewind", None)):
                logger.rewind(to_step)
        _log(
            trainer,
            {
                "rollback/count": float(len(guard.rollbacks)),
                "rollback/from_step": float(spike["step"]),
                "rollback/to_step": float(to_step),
                "rollback/skipped_batches": float(last + skipped - first + 1),
            },
            to_step,
        )
        seconds["wandb"], clock = time.perf_counter() - clock, time.perf_counter()
        save = getattr(trainer.checkpoint_callback, "save_rolled_back", None)  # ssl-vit's LastLinkCheckpoint
        if save is not None:
            save(trainer)
        else:
            trainer.save_checkpoint(last_path(trainer), weights_only=False)
        seconds["save"] = time.perf_counter() - clock
        _say(trainer, rollback_line(record))


POLICIES: dict[str, type[NonFinitePolicy]] = {p.name: p for p in (SkipPolicy, StopPolicy, RollbackPolicy)}
Policy = Literal[tuple(POLICIES)]  # `nonfinite.policy`: the CLI lists these choices


# --- the guard ------------------------------------------------------------------------------------------


class NonFiniteGuard(pl.Callback):
    """Watches the loss and gradient norm of every optimizer step.

    Args:
        policy: `skip` drops a step whose gradients are not finite (its update is not applied, the
            schedule and the step count move on, as with AMP's loss scaling) and stops after `max_skips`
            of them; deciding before the optimizer step costs one host read per step. `stop` stops at
            the first one, checked every `check_every_n_steps` steps and before every checkpoint save,
            with no host synchronisation in between (the steps after the bad one are wasted, nothing is
            saved from them). `rollback` also watches for loss spikes (`window`, `spike_factor`,
            `patience`), and on a spike or a non-finite step returns every rank to the last good
            checkpoint and steps over the batches since (one host read per step, as `skip`); before the
            run's first checkpoint such a step is skipped instead.
        max_skips: steps `skip` (or `rollback`, before the first checkpoint) may drop over the whole run
            before it stops.
        check_every_n_steps: how often `stop` reads the flag (the trainer's log_every_n_steps if unset).
        window: steps of the running median of the loss that a spike is measured against (no finite
            step is a spike before that many were seen).
        spike_factor: a step whose loss is above this many times that median is a spike (0: only
            non-finite steps are).
        patience: with `16-mixed`, whose gradient scaler skips non-finite steps itself, this many of them
            in a row are a spike (with other precisions, one is).
        skip_batches: batches a rollback steps over beyond the spike's, whose data it never trains on;
            by default twice as many as it returns over (the batches from the checkpoint to the spike).
        max_rollbacks: rollbacks over the whole run; the next spike stops it.
        safe_steps, safe_fp32, lr_scale: the steps after a rollback, `safe_steps` of them, run in 32-bit
            (`safe_fp32`: mixed precision's autocast off) and/or at `lr_scale` times the scheduled
            learning rate.

    With `16-mixed` precision, AMP's GradScaler already skips overflowing steps and lowers its scale:
    `skip` and `stop` then leave the steps to it and only keep non-finite states out of checkpoints.
    The policy, chosen once from `policy` (`POLICIES`), acts at the hooks; the guard keeps what a
    checkpoint records (`state_dict`) and the refusal to save a non-finite state, the same for all.
    """

    def __init__(
        self,
        policy: Policy = "skip",
        max_skips: int = 10,
        check_every_n_steps: int | None = None,
        window: int = 50,
        spike_factor: float = 3.0,
        patience: int = 16,
        skip_batches: int | None = None,
        max_rollbacks: int = 5,
        safe_steps: int = 0,
        safe_fp32: bool = False,
        lr_scale: float = 1.0,
    ) -> None:
        if policy not in POLICIES:
            raise BadValue(f"policy must be {_choices(POLICIES)}, got {policy!r}")
        for name, value in (("max_skips", max_skips), ("max_rollbacks", max_rollbacks)):
            if value < 0:
                raise BadValue(f"{name} must be >= 0, got {value}")
        for name, value in (("window", window), ("patience", patience)):
            if value < 1:
                raise BadValue(f"{name} must be at least 1, got {value}")
        if spike_factor != 0 and not spike_factor > 1:
            raise BadValue(f"spike_factor must be above 1 (or 0: no spike test), got {spike_factor}")
        if skip_batches is not None and skip_batches < 0:
            raise BadValue(
                f"skip_batches must be >= 0 (or unset: twice the batches rolled back), got {skip_batches}"
            )
        self.max_skips, self.check_every = max_skips, check_every_n_steps
        self.skip_batches, self.max_rollbacks = skip_batches, max_rollbacks
        self.detector = SpikeDetector(window, spike_factor, patience)
        self.safe = SafeSteps(safe_steps, safe_fp32, lr_scale)
        self.skipped = 0
        self.rollbacks: list[dict[str, Any]] = []  # one record per rollback (`RollbackPolicy.roll_back`)
        self.bad_validations: list[dict[str, Any]] = []  # passes with a non-finite loss (`on_validation_end`)
        self.policy: NonFinitePolicy = POLICIES[policy](self)

    def state_dict(self) -> dict[str, Any]:
        return {
            "skipped": self.skipped,
            "rollbacks": self.rollbacks,
            "nonfinite_validations": self.bad_validations,
            "detector": self.detector.state_dict(),
            "safe_steps_left": self.safe.left,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped = state_dict["skipped"]
        self.rollbacks = list(state_dict.get("rollbacks", []))
        self.bad_validations = list(state_dict.get("nonfinite_validations", []))
        self.detector.load_state_dict(state_dict.get("detector", {}))
        self.safe.left = state_dict.get("safe_steps_left", 0)

    # --- hooks: the policy's, then what every policy shares ------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.policy.setup(trainer)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.policy.on_fit_start(trainer)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.safe.detach(trainer)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module, batch, batch_idx) -> None:
        self.policy.on_train_batch_start(trainer)

    def on_before_backward(self, trainer: pl.Trainer, pl_module, loss: torch.Tensor) -> None:
        self.policy.on_before_backward(loss)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        scaler = "16-mixed" == str(trainer.precision)
        if scaler and not self.policy.judges_scaled_steps:
            return
        # This rank's gradients (its shards under FSDP2): whether any rank's is not finite is reduced by
        # the policy.
        grads = [
            _local(p.grad) for group in optimizer.param_groups for p in group["params"] if p.grad is not None
        ]
        if grads:
            norm = torch.nn.utils.get_total_norm(grads)  # one fused pass over the gradients
            self.policy.on_gradients(trainer, optimizer, norm, scaler)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.policy.on_train_batch_end(trainer, outputs)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A validation loss that is not finite decides nothing (training goes on: the training loss and
        the weights are watched above), but is said in one line per pass and recorded like a skip: in the
        checkpoint (`ssl-vit info`) and as `val/nonfinite_passes`."""
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        metrics = trainer.callback_metrics  # the pass's values, reduced over the ranks (sync_dist)
        bad = {k: float(v) for k, v in sorted(metrics.items()) if k.startswith("val/") and "loss" in k}
        bad = {k: v for k, v in bad.items() if not math.isfinite(v)}
        if not bad:
            return
        step = trainer.global_step
        self.bad_validations.append({"step": step, "metrics": bad})
        values = ", ".join(f"{k} {v}" for k, v in bad.items())
        _say(
            trainer,
            f"warning: validation at step {step}: {values}; training goes on (a validation sample or the "
            f"precision gives a non-finite loss: {len(self.bad_validations)} such pass(es) in this run)",
        )
        _log(trainer, {"val/nonfinite_passes": float(len(self.bad_validations))}, logging_step(trainer))

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint) -> None:
        """Refuse to save a non-finite state: it would replace the last good checkpoint."""
        self.policy.on_save_checkpoint(trainer)
        finite = torch.stack([torch.isfinite(p).all() for p in pl_module.parameters()]).all()
        if trainer.strategy.reduce_boolean_decision(not bool(finite), all=False):
            step = trainer.global_step
            self.stop(trainer, f"{NON_FINITE} at step {step} (the weights are no longer finite)")

    # --- where the policies' decisions end ---------------------------------------------------------------

    def skip(self, trainer: pl.Trainer, step: int, why: str) -> None:
        """Counts the step `step`, whose update was not applied, in one line; past `max_skips`, stops."""
        self.skipped += 1
        if self.skipped > self.max_skips:
            self.stop(trainer, f"{why} at step {step} after skipping {self.max_skips} such steps")
        _say(trainer, f"skip: step {step} not applied: {why} ({self.skipped} of at most {self.max_skips})")
        _log(trainer, {"train/skipped_steps": float(self.skipped)}, logging_step(trainer))

    def stop(self, trainer: pl.Trainer, what: str) -> None:
        """Ends the fit with one line: `what`, and the last good checkpoint to resume from."""
        saved = _last_checkpoint(trainer)
        raise NonFiniteError(
            f"{what}; nothing was saved after it (last good checkpoint: {saved or 'none yet'}): lower the "
            "learning rate or check the data, then resume with --ckpt_path last"
        )


def check_rollback(checkpointing: bool, data: object, precision: str, safe: SafeSteps) -> None:
    """One line when a fit cannot roll back: without checkpoints (`checkpointing`), with a data module
    (`data`, its class or instance) whose stream cannot skip batches, or safe steps in 32-bit that the
    trainer's `precision` cannot give. The CLI asks before anything is written, the guard at setup."""
    if not checkpointing:
        raise UserError(
            "nonfinite.policy rollback returns to the run's last checkpoint, and checkpointing is off "
            "(--trainer.enable_checkpointing false): turn it on, or use --nonfinite.policy skip"
        )
    if not callable(getattr(data, "skip_batches", None)):
        name = data.__name__ if isinstance(data, type) else type(data).__name__
        raise UserError(
            "nonfinite.policy rollback steps the training stream over the batches that led to a spike, which "
            f"{name} cannot do: use ssl_vit.data.ShardDataModule, or --nonfinite.policy skip"
        )
    safe.check(precision)


def spike_detail(spike: dict[str, Any]) -> str:
    """`loss L, median M` of a spike (or rollback record), as its line says it."""
    loss = "non-finite" if spike["loss"] is None else f"{spike['loss']:.4g}"
    median = "not yet known" if spike["median"] is None else f"{spike['median']:.4g}"
    if spike["reason"] not in (SPIKE, NON_FINITE):  # the gradient scaler's run of skipped steps
        return f"{spike['reason']}, loss {loss}, median {median}"
    return f"loss {loss}, median {median}"


def rollback_line(record: dict[str, Any]) -> str:
    first, last = record["batches"]
    return (
        f"rollback: step {record['step']} ({spike_detail(record)}) -> checkpoint at step "
        f"{record['to_step']}, skipped batches {first}-{last}"
    )


def history(state: dict[str, Any] | None) -> list[str]:
    """What a checkpoint's guard state (`NonFiniteGuard.state_dict`) says of the run's skips and
    rollbacks, one line each (for `ssl-vit info`)."""
    state = state or {}
    lines = [f"skipped steps: {state.get('skipped', 0)}"]
    rollbacks = state.get("rollbacks", [])
    lines.append(f"rollbacks: {len(rollbacks)}")
    for record in rollbacks:
        took = record.get("seconds", {})
        parts = ", ".join(f"{name} {value:.1f} s" for name, value in took.items())
        lines.append(f"  {rollback_line(record)}" + (f" ({parts})" if parts else ""))
    validations = state.get("nonfinite_validations", [])
    if validations:
        steps = ", ".join(str(record["step"]) for record in validations)
        lines.append(f"validation passes with a non-finite loss: {len(validations)} (at steps {steps})")
    return lines


def _say(trainer: pl.Trainer, text: str) -> None:
    if trainer.is_global_zero:
        print(f"ssl-vit: {text}", file=sys.stderr, flush=True)


def _log(trainer: pl.Trainer, metrics: dict[str, float], step: int) -> None:
    """To every logger at `step`, whatever log_every_n_steps says (Lightning's `log` drops the values of
    the steps it does not log): a skip or rollback is never lost."""
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)


def _local(grad: torch.Tensor) -> torch.Tensor:
    """This rank's part of a gradient (an FSDP2 DTensor's local shard)."""
    return grad.to_local() if hasattr(grad, "to_local") else grad


def _last_checkpoint(trainer: pl.Trainer) -> str | None:
    callback = trainer.checkpoint_callback
    return getattr(callback, "last_model_path", None) or getattr(callback, "best_model_path", None) or None


def _choices(names) -> str:
    """`'a', 'b' or 'c'`, as a message lists choices."""
    quoted = [repr(name) for name in names]
    return f"{', '.join(quoted[:-1])} or {quoted[-1]}"
