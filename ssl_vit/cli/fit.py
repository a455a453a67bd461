"""`ssl-vit fit`, `validate` and `test`: LightningCLI (`SslVitCLI`) with what a run directory needs.

The model and data are chosen in YAML by `class_path`, every constructor argument is an option. Around
Lightning's parsing and run:

- one run directory per job (`trainer.default_root_dir`): config.yaml, checkpoints/, wandb/ and
  pictures/ all land there, a restarted job finds them again, and a fit holds its lock
  (`ssl_vit.tasks.run_lock`) from before it reads anything there to its end;
- `--ckpt_path` resolved (`last`: the newest intact checkpoint) and checked before Lightning reads it,
  and a checkpoint's model never replaced silently by the config's or the command line's;
- checks of the values that would fail only after the run directory, config.yaml and the W&B run exist
  (optimizer values, compile options, shard URLs), made before anything is written;
- a mistake in the config (an unknown key, a wrong type, a `class_path` that names no class, a file that
  is not YAML) as one line `KEY: WHAT` with the closest valid key (`config_error`).

Imported by `ssl_vit.cli` only when one of these commands runs: it imports Lightning and every task,
which `ssl-vit --help` and the other commands do not need.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import importlib
import re
import shutil
import sys
from argparse import ArgumentError
from pathlib import Path
from typing import NamedTuple

import torch
import yaml
from jsonargparse import ArgumentParser
from pytorch_lightning.callbacks import LearningRateMonitor
from pytorch_lightning.cli import LightningCLI, SaveConfigCallback

from ssl_vit.checkpoints import integrity
from ssl_vit.checkpoints.load import torch_load
from ssl_vit.data.checks import check_shard_urls
from ssl_vit.data.skip_log import LogSkippedSamples
from ssl_vit.errors import UserError, user_error_message
from ssl_vit.lock import LOCK_NAME, RunLock, job_leader
from ssl_vit.run.checkpointing import (
    DAMAGED_FIX,
    LastLinkCheckpoint,
    checkpoint_step,
    resumable,
    with_safe_io,
)
from ssl_vit.run.health import HealthMonitor
from ssl_vit.run.nonfinite import NonFiniteGuard, check_rollback
from ssl_vit.run.preemption import Preemption
from ssl_vit.run.resume import RandomState
from ssl_vit.run.rollback import SafeSteps
from ssl_vit.tasks.base import Throughput
from ssl_vit.tasks.compile import CompileTask, check_compile

DEFAULT_ROOT = "runs/default"  # the run directory without --trainer.default_root_dir
# What the model takes from the data module once that is built (`link_arguments(..., apply_on=
# "instantiate")`): the per-band normalisation the data module resolved (`auto`: from the manifest's band
# statistics) and the number of classes. Until then the config holds the model's defaults there, not
# values anyone gave: a resumed checkpoint's differing values contradict nothing.
FROM_DATA = {
    "data.mean": "model.init_args.mean",
    "data.std": "model.init_args.std",
    "data.num_classes": "model.init_args.num_classes",
}


class SaveAndLogConfig(SaveConfigCallback):
    """config.yaml in the run directory (Lightning's), and the whole resolved config, data and
    trainer included, in the W&B run's config under `cli`."""

    def save_config(self, trainer, pl_module, stage) -> None:
        if trainer.logger is not None:
            trainer.logger.log_hyperparams({"cli": self.config.as_dict()})


class SslVitCLI(LightningCLI):
    """One run directory per job (`trainer.default_root_dir`): config.yaml, checkpoints/,
    wandb/ and pictures/ all land there, and a restarted job finds them again."""

    resumed: dict | None = None  # a resumed fit's checkpoint, memory-mapped, until `before_fit`

    def __init__(self, argv: list[str]) -> None:
        """Parse `argv` (`fit/validate/test ARGS`) and run the command."""
        self.argv = argv
        self._held = contextlib.ExitStack()  # the run directory's lock, released however the command ends
        with self._held:
            super().__init__(
                args=None if argv == sys.argv[1:] else argv,  # None: LightningCLI reads sys.argv itself
                subclass_mode_model=True,
                subclass_mode_data=True,
                auto_configure_optimizers=False,
                save_config_callback=SaveAndLogConfig,
                save_config_kwargs={"overwrite": True},  # a resumed job rewrites its run's config.yaml
                trainer_defaults={
                    "callbacks": [
                        Throughput(),
                        LogSkippedSamples(),
                        LearningRateMonitor("step"),
                        RandomState(),  # exact resume: every rank's RNGs in the checkpoint
                        Preemption(),  # SIGTERM / SLURM's SIGUSR1: save at the step's end (and requeue)
                    ],
                    # Atomic saves, weights-only loads (also of http(s) checkpoints).
                    "plugins": [{"class_path": "ssl_vit.run.checkpointing.SafeCheckpointIO"}],
                },
                # A mistake in the config raises, for `parse_arguments` to say in one line, instead of
                # jsonargparse's usage message and nested union report (80 lines for a typo)
                parser_kwargs={"prog": "ssl-vit", "exit_on_error": False},
            )

    def parse_arguments(self, parser, args) -> None:
        moved = with_moved_options(self.argv)  # a run's own config.yaml written before options moved
        try:
            if moved is None:
                super().parse_arguments(parser, args)
            else:
                self.config = parser.parse_args(moved)
        except ArgumentError as err:
            if user_error_message(err) is not None:  # a value a constructor refused, its own line
                raise
            raise UserError(config_error(str(err), self.argv, self._parser(self.argv[0]), err)) from None

    def subcommands(self) -> dict[str, set[str]]:
        # Only the command being run gets a parser: each is built from the signatures of the
        # Trainer and every class in the config, a few tenths of a second of every start.
        return {self.argv[0]: LightningCLI.subcommands()[self.argv[0]]}

    def add_arguments_to_parser(self, parser) -> None:
        # last.ckpt: a hard link to the newest checkpoint, not a second full write (checkpointing.py).
        parser.add_lightning_class_args(LastLinkCheckpoint, "checkpoint")
        parser.set_defaults(
            {
                "checkpoint.save_last": "link",
                "checkpoint.filename": "step{step:07d}",
                "checkpoint.auto_insert_metric_name": False,
                # A resumed run writes last.ckpt and a recomputed step's file again under their own
                # names (atomically), rather than next to them as last-v1.ckpt, stepN-v1.ckpt.
                "checkpoint.enable_version_counter": False,
            }
        )
        # What a NaN or inf loss, or a loss spike, does: `nonfinite.policy` skip (up to `max_skips`), stop or
        # rollback (to the last checkpoint, up to `max_rollbacks`).
        parser.add_lightning_class_args(NonFiniteGuard, "nonfinite")
        # Collapse: feature std and effective rank logged as health/*, and a stop below `health.min_std`.
        parser.add_lightning_class_args(HealthMonitor, "health")
        # torch.compile of the blocks or the step: `compile.enabled`, `.mode`, `.scope`, `.backend`.
        parser.add_lightning_class_args(CompileTask, "compile")
        # Values that must agree between data and model are given once, on the data side: the image size
        # and the input bands (a data module without `channels` reads RGB: the backbone keeps in_chans 3).
        parser.link_arguments("data.init_args.image_size", "model.init_args.backbone.img_size")
        parser.link_arguments("data.init_args.channels", "model.init_args.backbone.in_chans")
        for source, target in FROM_DATA.items():
            parser.link_arguments(source, target, apply_on="instantiate")

    def _prepare_subcommand_parser(self, klass, subcommand: str, **kwargs):
        # `--weights_only` comes from the Trainer method's signature (default None, which Lightning's
        # _load turns into weights_only=False for http(s) checkpoints); it exists only from here on.
        parser = super()._prepare_subcommand_parser(klass, subcommand, **kwargs)
        if "weights_only" in self._subcommand_method_arguments[subcommand]:
            parser.set_defaults(weights_only=True)
        return parser

    def _parse_ckpt_path(self) -> None:
        """LightningCLI rebuilds the model from a local checkpoint's hyperparameters, over the config.
        Here first: the file is checked (one line if it is not a checkpoint that loads safely),
        `last` is resolved as Lightning will resolve it so its model is rebuilt the same way, the
        class it names must be an ssl-vit task (a checkpoint is data: it never chooses code to run),
        and a model option given on the command line (or, for a fit, a model value of the config)
        that the checkpoint overrides is refused."""
        if not self.config.get("subcommand"):
            return
        config = self.config[self.config.subcommand]
        root = str(config.trainer.default_root_dir or DEFAULT_ROOT)
        local = "://" not in root  # an object store (s3://...) has no files to check and no locks
        if local:
            check_run_dir(root)
        if self.config.subcommand == "fit" and job_leader() and local:
            # The first thing done with the run directory, before the checkpoint below is read and
            # before the used-directory check, config.yaml, W&B and checkpoints: one fit at a time.
            # Only the job's rank 0 (every rank of a torchrun/srun job runs this command).
            if self._held.enter_context(RunLock(root)).made_run_dir:
                # Unwound before the lock is released (and the emptied directory with it).
                self._held.push(self._remove_if_failed)
        given = check_ckpt_choice(self.config.subcommand, config.get("ckpt_path"))
        if given == "scratch":  # validate/test of the freshly initialised model, asked for by name
            config.ckpt_path = given = None
        path = resumed_checkpoint(given, checkpoint_dir(config)) if given == "last" else given
        if path is None or local_ckpt_path(path) is None:
            return  # nothing yet to resume, or a URL: the checkpoint IO checks it when loading
        checkpoint = check_ckpt_path(path)
        if self.config.subcommand == "fit":
            self.resumed = checkpoint
        hparams = checkpoint.get("hyper_parameters", {})
        class_path = hparams.get("_class_path")
        if class_path is not None and not str(class_path).startswith("ssl_vit.tasks."):
            raise UserError(
                f"--ckpt_path {path} names the model class {class_path!r}: ssl-vit only rebuilds its own "
                "tasks (ssl_vit.tasks.*) from a checkpoint; give a checkpoint written by ssl-vit"
            )
        before = copy.deepcopy(config.as_dict()) if hparams else None
        config.ckpt_path = str(path)
        try:
            super()._parse_ckpt_path()
        except ArgumentError as err:  # the model the checkpoint records, refused by this version's parser
            what = config_error(str(err), [self.config.subcommand], self._parser(self.config.subcommand), err)
            raise unparsable_model(path, what) from None
        finally:
            config = self.config[self.config.subcommand]
            config.ckpt_path = given
        unknown = config.model.get("dict_kwargs") if config.get("model") else None
        if unknown:  # hyperparameters the class does not take: its constructor would raise a TypeError
            raise unparsable_model(
                path, f"{', '.join(sorted(unknown))}: no such option of {config.model.class_path}"
            )
        refuse_other_bands(hparams, config, path)
        if before is not None:
            refuse_overridden_options(self.argv, before, config, path)
            if self.config.subcommand == "fit":  # validate/test evaluate the checkpoint's model
                refuse_contradicting_config(before, config, path)

    def _remove_if_failed(self, failed: type | None, *_) -> None:
        """After a fit that made its run directory failed before its first training step: what it wrote
        there (config.yaml, W&B's folder and run id) is removed, so that the directory is left as the
        fit found it: absent. A fit that trained keeps everything, its checkpoints and the W&B run that
        shows how it ended (a collapse, a non-finite stop) included."""
        config = self.config[self.config.subcommand]
        trainer = getattr(self, "trainer", None)
        trained = trainer is not None and trainer.global_step > 0
        saved = any(checkpoint_dir(config).glob("*.ckpt"))  # at step 0 too: SIGTERM in the sanity check
        if failed is None or trained or saved:
            return
        wandb = sys.modules.get("wandb")
        if wandb is not None and wandb.run is not None:  # finished first: it writes nothing after
            wandb.finish(exit_code=1)
        for path in Path(config.trainer.default_root_dir or DEFAULT_ROOT).iterdir():
            if path.name == LOCK_NAME:  # the lock's to remove, when it is released
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand]
        if config.get("weights_only") is False:
            raise UserError(
                "--weights_only false: ssl-vit never unpickles code from a checkpoint; drop the option "
                "(checkpoints written by ssl-vit load with weights only)"
            )
        if config.compile.enabled:  # CompileTask checks again at setup, after the trainer's banner
            strategy = config.trainer.strategy
            strategy = str(getattr(strategy, "class_path", strategy))  # a name, or class_path + init_args
            accumulate = config.trainer.accumulate_grad_batches
            check_compile(config.compile.mode, accumulate, strategy, config.compile.backend)
        check_optimizer(config)
        if self.subcommand == "fit" and config.nonfinite.policy == "rollback":  # the guard again at setup
            nonfinite = config.nonfinite
            data = getattr(config.get("data"), "class_path", None)
            check_rollback(
                config.trainer.enable_checkpointing is not False,
                _import(data) if data else None,
                str(config.trainer.precision),
                SafeSteps(nonfinite.safe_steps, nonfinite.safe_fp32, nonfinite.lr_scale),
            )
        # The datamodule checks the shards again in its setup, after the trainer has printed its
        # banner and the logger has started its run; here first, the error is the command's only
        # output and the run directory is left as it was.
        data_args = getattr(config.get("data"), "init_args", None)
        if data_args is not None:
            check_shard_urls(self.subcommand, data_args.as_dict())
        root = Path(config.trainer.default_root_dir or DEFAULT_ROOT)
        config.trainer.default_root_dir = str(root)
        if config.checkpoint.dirpath is None:
            config.checkpoint.dirpath = str(root / "checkpoints")
        if self.subcommand == "fit" and not config.get("ckpt_path"):
            refuse_used_run_dir(Path(config.checkpoint.dirpath))
        # A job that resumes a checkpoint continues the run directory's W&B run; one that starts
        # afresh in a used run directory starts a new W&B run (its steps start again at 0).
        resumed = resumed_checkpoint(config.get("ckpt_path"), Path(config.checkpoint.dirpath))
        logger = config.trainer.logger
        for spec in logger if isinstance(logger, list) else [logger]:
            init_args = getattr(spec, "init_args", None)
            if getattr(spec, "class_path", None) == "ssl_vit.tracking.WandbLogger":
                init_args.continue_run = resumed is not None
                if self.subcommand == "fit" and resumed is not None:
                    init_args.resume_step = checkpoint_step(resumed)
            if (
                init_args is not None
                and "save_dir" in init_args
                and init_args.save_dir in (None, DEFAULT_ROOT)
            ):
                init_args.save_dir = str(root)

    def before_fit(self) -> None:
        # `on_data_change: refuse` before config.yaml, the W&B run or a checkpoint is written; Lightning
        # restores the data module's state (and checks it again) only inside the fit.
        refuse = getattr(self.datamodule, "refuse_changed_data", None)
        resumed, self.resumed = self.resumed, None  # the file's map is let go
        if resumed is not None and refuse is not None:
            refuse(resumed.get(type(self.datamodule).__qualname__, {}))

    def instantiate_trainer(self, **kwargs):
        # A recipe's `trainer.plugins` replaces the default list (LightningCLI merges only callbacks
        # with trainer_defaults), so the checkpoint IO is (re)added here.
        plugins = self._get(self.config_init, "trainer", default={}).get("plugins")
        trainer = super().instantiate_trainer(plugins=with_safe_io(plugins), **kwargs)
        if not trainer.loggers:  # --trainer.logger false: the LR monitor has nowhere to log, and raises
            trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, LearningRateMonitor)]
        return trainer


def unparsable_model(path, what: str) -> UserError:
    """The line for a `--ckpt_path` whose recorded model (its hyperparameters) this version cannot build."""
    return UserError(
        f"--ckpt_path {path}: the model its hyperparameters describe does not parse here ({what}); give a "
        "checkpoint this version of ssl-vit wrote"
    )


def check_optimizer(config) -> None:
    """The model's optimizer built once on a dummy parameter, before anything is written: torch checks
    its values (a negative learning rate, betas outside [0, 1), ...) only when the task builds it, after
    the run directory, config.yaml and the W&B run exist."""
    spec = getattr(getattr(config.get("model"), "init_args", None), "optimizer", None)
    class_path = getattr(spec, "class_path", None)
    if class_path is None:
        return
    init_args = spec.init_args.as_dict() if hasattr(spec.init_args, "as_dict") else dict(spec.init_args or {})
    try:
        optimizer = _import(class_path)
        optimizer([torch.nn.Parameter(torch.zeros(1))], **init_args)
    except (ValueError, TypeError) as err:
        raise UserError(
            f"model.init_args.optimizer ({class_path.rsplit('.', 1)[-1]}): {err}: give a valid value in the "
            "recipe or on the command line (--model.init_args.optimizer.init_args.NAME VALUE)"
        ) from None


def _import(class_path: str) -> type:
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def check_ckpt_choice(subcommand: str, given: str | None) -> str | None:
    """`--ckpt_path` as given, refused in one line where Lightning would raise from deep inside: `best`
    (ssl-vit saves by steps and monitors no metric, so there is no best checkpoint), an empty path, and
    `validate`/`test` without one (which would score a randomly initialised model): `scratch` asks for
    that on purpose."""
    fix = "give last, or the path of a .ckpt"
    if given == "best":
        raise UserError(
            f"--ckpt_path best: ssl-vit saves checkpoints by steps and monitors no metric, so none is the "
            f"best: {fix}"
        )
    if given is not None and not str(given).strip():
        raise UserError(f"--ckpt_path is empty: {fix}")
    if subcommand in ("validate", "test") and given is None:
        raise UserError(
            f"{subcommand} needs --ckpt_path (without one it would score a randomly initialised model): "
            f"{fix}, or scratch to score the initialisation on purpose"
        )
    if given == "scratch" and subcommand == "fit":
        raise UserError("--ckpt_path scratch: a fit starts from scratch without --ckpt_path; drop it")
    return given


def check_run_dir(root: str) -> None:
    """`--trainer.default_root_dir` refused in one line where it is a file or lies under one, before
    anything is written: the run directory's lock (fit) or the W&B run (validate, test) would fail to
    make it, the latter with a traceback."""
    path = Path(root).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        where = "is a file" if existing == path else f"lies under the file {existing}"
        raise UserError(
            f"--trainer.default_root_dir {root} {where}: give a directory for the run to write in"
        )


def checkpoint_dir(config) -> Path:
    """Where the run's ModelCheckpoint writes (as `SslVitCLI.before_instantiate_classes` sets it)."""
    if config.checkpoint.dirpath:
        return Path(config.checkpoint.dirpath)
    return Path(config.trainer.default_root_dir or DEFAULT_ROOT) / "checkpoints"


def refuse_overridden_options(argv: list[str], before: dict, config, path) -> None:
    """A `--model...` option given on the command line whose value the checkpoint replaced: resuming
    would silently train the checkpoint's model instead of the one asked for."""
    after = config.as_dict()
    for arg in argv:
        if not arg.startswith("--model."):
            continue
        keys = arg[2:].split("=", 1)[0].split(".")
        old, new = _lookup(before, keys), _lookup(after, keys)
        if old is not _MISSING and old != new:
            raise UserError(
                f"--{'.'.join(keys)} {old} contradicts --ckpt_path {path}, whose model has {new}: drop the "
                "option to resume that model, or start a new run from its weights with "
                f"--model.init_args.init_from {path}"
            )


def refuse_other_bands(hparams: dict, config, path) -> None:
    """A checkpoint's backbone of other input bands than the data's `channels` (3 unless given): the
    link would build the model for the data's bands, and the checkpoint's weights would not load."""
    backbone = hparams.get("backbone")
    if not isinstance(backbone, dict):  # not an ssl-vit task's checkpoint: Lightning says what is wrong
        return
    saved = backbone.get("in_chans", 3)  # checkpoints from before other band counts: RGB
    data = getattr(config.get("data"), "init_args", None)
    channels = (data.get("channels") if data is not None else None) or 3
    if saved != channels:
        raise UserError(
            f"--ckpt_path {path} holds a model of {saved} input bands and the data has {channels}: give it "
            f"the data it was trained on (--data.init_args.channels {saved})"
        )


def refuse_contradicting_config(before: dict, config, path) -> None:
    """A model value of the config file that the checkpoint being resumed replaced (another task's
    recipe, another size): the fit would silently train the checkpoint's model instead. A value the
    config leaves unset (None: the task's preset or default decides) is the checkpoint's, and so is one
    the data module sets (`FROM_DATA`)."""
    after = config.as_dict()
    differing = [
        f"{key} {old} (checkpoint: {new})"
        for key, old in _leaves(before.get("model"), "model")
        if old is not None
        and key not in FROM_DATA.values()
        and (new := _lookup(after, key.split("."))) != old
        and not _same_class(key, old, new)
    ]
    if differing:
        raise UserError(
            f"the config's model contradicts --ckpt_path {path}, whose model differs in "
            f"{'; '.join(differing)}: "
            "resume it with the config and --model options it was trained with, or start a new run from its "
            f"weights with --model.init_args.init_from {path}"
        )


class _Missing:
    def __repr__(self) -> str:
        return "unset"


_MISSING = _Missing()


def _lookup(tree, keys: list[str]):
    for key in keys:
        if not isinstance(tree, dict) or key not in tree:
            return _MISSING
        tree = tree[key]
    return tree


def _same_class(key: str, old, new) -> bool:
    """Two `class_path`s that name one class the way configs spell it (`ssl_vit.tasks.X` and
    `ssl_vit.tasks.module.X`, `AdamW` and `torch.optim.AdamW`): the same class name. Compared as text,
    never imported: the checkpoint's side is data and does not choose code to run."""
    return key.endswith("class_path") and str(old).rsplit(".", 1)[-1] == str(new).rsplit(".", 1)[-1]


def _leaves(tree, prefix: str):
    """(dotted key, value) of every non-mapping value under `tree`."""
    if not isinstance(tree, dict):
        yield prefix, tree
        return
    for key, value in tree.items():
        yield from _leaves(value, f"{prefix}.{key}")


# --- --ckpt_path: which checkpoint a job resumes, checked before Lightning reads it -------------------


def resumed_checkpoint(ckpt_path: str | None, checkpoint_dir: Path) -> Path | None:
    """The checkpoint `--ckpt_path` makes this job continue from: for `last`, `resumable(checkpoint_dir)`
    (as `LastLinkCheckpoint` resolves it for Lightning); a local path as it is; None otherwise."""
    if not ckpt_path:
        return None
    if str(ckpt_path) == "last":
        return resumable(checkpoint_dir)
    return Path(ckpt_path) if "://" not in str(ckpt_path) else None


def refuse_used_run_dir(checkpoint_dir: Path) -> None:
    """A fit that starts afresh would write its checkpoints under the same names as the ones already in
    `checkpoint_dir` (`step{step:07d}.ckpt`, `last.ckpt`): refused, before anything is written."""
    found = min(checkpoint_dir.glob("*.ckpt"), default=None) if checkpoint_dir.is_dir() else None
    if found is not None:
        raise UserError(
            f"{checkpoint_dir} already holds checkpoints of an earlier run ({found.name}), which a fresh "
            "start would overwrite: resume it with --ckpt_path last, or give another "
            "--trainer.default_root_dir"
        )


# --ckpt_path values Lightning resolves itself (a checkpoint of the run, the model registry).
CKPT_KEYWORDS = ("last", "best", "hpc", "null", "none", "registry")


def local_ckpt_path(value) -> str | None:
    """`value` when it names a local checkpoint file for `--ckpt_path`; None for none, a keyword Lightning
    resolves itself (last, best, ...) or a URL."""
    value = str(value) if value is not None else ""
    if not value or value.lower() in CKPT_KEYWORDS or value.lower().startswith("registry:") or "://" in value:
        return None
    return value


def check_ckpt_path(path: str | Path) -> dict:
    """The Lightning checkpoint `path`, its tensors memory-mapped; a one-line UserError unless it is one
    that loads with weights only.

    For `--ckpt_path` (resume or evaluate a run's state): LightningCLI itself reads a local checkpoint's
    hyperparameters with torch.load before anything else, and a file that is not a checkpoint fails
    there with whatever torch's unpickler happened to hit. Cheap: tensors are memory-mapped, not read."""
    path = Path(path)
    fix = (
        "give a .ckpt written by ssl-vit (RUN/checkpoints/last.ckpt) or `last` to resume the run in "
        "--trainer.default_root_dir; to start from other weights use --model.init_args.init_from"
    )
    if not path.exists():
        raise UserError(f"--ckpt_path {path} does not exist: {fix}")
    if not path.is_file():
        raise UserError(f"--ckpt_path {path} is not a file: {fix}")
    # Before torch reads it: a damaged checkpoint would load silently (torch checks no CRC). A file
    # without checksums (another tool's, torch's legacy format) goes on to torch.load unchecked.
    integrity.check(path, DAMAGED_FIX, name=f"--ckpt_path {path}")
    try:
        try:
            checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception:  # not torch's zip format, or a filesystem without mmap: read it whole
            checkpoint = torch_load(path, map_location="cpu")
    except Exception as err:  # text, random bytes, a zip that is not torch's, pickled code: all one line
        raise UserError(
            f"--ckpt_path {path} is not a checkpoint torch can load safely ({type(err).__name__}): {fix}"
        ) from None
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        raise UserError(f"--ckpt_path {path} is not a Lightning checkpoint (no state_dict): {fix}")
    if not checkpoint["state_dict"]:
        raise UserError(f"--ckpt_path {path} holds no weights (its state_dict is empty): {fix}")
    if not isinstance(checkpoint.get("hyper_parameters", {}), dict):
        raise UserError(f"--ckpt_path {path} has hyper_parameters that are not a mapping: {fix}")
    return checkpoint


# --- config errors: one line ----------------------------------------------------------------------------
# jsonargparse reports a mistake in a config (a file or the command line) as a tree: each nested class's
# parser, each alternative of a Union type ("Expected a <class 'NoneType'>"), the value as it was given.
# It has no structured form of it (its exceptions carry text), so the tree's lines are read here: each
# line's indentation says which `Parser key "K"` and `class_path` it lies under, and the deepest, most
# specific finding is the mistake. A message of a kind not read here still ends as one line.

_PARSER_KEY = re.compile(r'Parser key "([^"]+)":?\s*(.*)')
_CLASS_PATH = re.compile(r"Problem with given class_path '([^']+)':?")
_CALLABLE = re.compile(r"expects a function or a callable class:\s*(.*)")  # an optimizer: init_args follow
_KINDS = (  # (kind, pattern), the more specific first
    ("unknown", re.compile(r"Option '([^']+)' is not accepted")),
    ("unknown", re.compile(r"Subcommand '[^']+' does not accept option '([^']+)'")),
    ("unknown", re.compile(r"unrecognized arguments: --?([^\s=]+)")),
    ("no_class", re.compile(r"module '([^']+)' has no attribute '([^']+)'")),
    ("no_file", re.compile(r"Expected a path but (\S+) either not accessible or invalid")),
    ("no_file", re.compile(r"(?:File|Path) does not exist: '([^']+)'")),
    ("no_module", re.compile(r"No module named '([^']+)'")),
    ("required", re.compile(r"the following arguments are required: (.*)")),
    ("no_value", re.compile(r"argument --(\S+): expected one argument")),
    ("yaml", re.compile(r"Problems parsing config")),
    ("type", re.compile(r"Expected a (typing\.Literal\[.*\]|<class '[\w.]+'>|dot import path)")),
)
_IMPORT_PATH = "class's import path (package.module.Name)"
_GIVEN = re.compile(r"(?:Given|Got) value: (.*?)(?:\. Got value: .*)?$")
_CONFIG_FILE = re.compile(r"\.(ya?ml|json|jsonnet)$|/")


class _Finding(NamedTuple):
    rank: int  # of its kind in _KINDS
    depth: int  # minus the number of keys: deeper first
    line: int
    kind: str
    keys: tuple[str, ...]  # the dotted key it lies under, `init_args` included
    cls: str | None  # the class_path of the innermost class it lies under
    match: re.Match
    given: str | None  # the value as given, where the message says it


def config_error(message: str, argv: list[str], parser, err: BaseException) -> str:
    """`KEY: WHAT` for jsonargparse's `message` about a config of the command `argv`, with the closest
    valid key (or class, or choice) where there is one; `parser` is the subcommand's parser, whose
    options are the valid keys at the top."""
    findings = sorted(_findings(message))
    if not findings:
        lines = [line.strip(" -") for line in message.splitlines() if line.strip(" -")]
        return " ... ".join(dict.fromkeys([lines[0], lines[-1]]))[:400] if lines else type(err).__name__
    kind, keys, cls, match, given = findings[0][3:]
    key = ".".join(keys)
    if kind == "unknown":
        return _unknown_key(argv, keys, match[1], cls, parser)
    if kind == "no_class":
        module, name = match[1], match[2]
        imported = importlib.import_module(module)
        close = difflib.get_close_matches(name, getattr(imported, "__all__", dir(imported)), n=1)
        hint = f"; did you mean {module}.{close[0]}?" if close else ""
        return f"{_where(argv, _class_key(keys))}: {module} has no class {name}{hint}"
    if kind == "no_module":
        return f"{_where(argv, _class_key(keys))}: {cls or match[1]} is not a class: {match[0]}"
    if kind == "no_file":
        if keys in ((), ("config",)):
            return f"--config {match[1]}: no such file"
        return f"{_where(argv, key)}: no such file {match[1]} (a config names files relative to itself)"
    if kind == "required":
        missing = ", ".join(name.split(".", 1)[-1] for name in match[1].split(", "))
        return f"{missing}: required: give --config RECIPE.yaml (recipes/) or --{missing}.class_path CLASS"
    if kind == "no_value":
        return f"--{match[1]}: expected a value"
    if kind == "yaml":
        return _yaml_error(argv, err)
    types = [f.match[1] for f in findings if f.kind == "type" and f.keys == keys]
    return _type_error(argv, key, types, given)


def _findings(message: str) -> list[_Finding]:
    """What jsonargparse's `message` reports, each under the keys and class it lies under."""
    stack: list[tuple[int, str, str | None]] = []  # (indentation, key, class_path) of enclosing lines
    found = []
    lines = message.splitlines()
    for number, line in enumerate(lines):
        body = line.lstrip(" -")
        if not body.strip():
            continue
        indent = len(line) - len(body)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        while body:
            if match := _PARSER_KEY.match(body):
                stack.append((indent, match[1], None))
                body = match[2]
            elif match := _CLASS_PATH.match(body):
                stack.append((indent, "init_args", match[1]))
                body = body[match.end() :].strip()
            elif match := _CALLABLE.search(body):
                named = re.search(r"class_path='([^']+)'", "\n".join(lines[number:]))
                stack.append((indent, "init_args", named[1] if named else None))
                body = match[1]
            else:
                found += _kind(body, lines[number:], stack, number)
                body = ""
    return found


def _kind(body: str, rest: list[str], stack: list, number: int) -> list[_Finding]:
    """The finding the text `body` states, if any; `rest`: the message from its line on."""
    for rank, (kind, pattern) in enumerate(_KINDS):
        match = pattern.search(body)
        # jsonargparse offers every nested value a file to read it from: a mistake only if it names one
        if match and not (
            kind == "no_file" and "Expected a path" in body and not _CONFIG_FILE.search(match[1])
        ):
            given = next(filter(None, (_GIVEN.search(text) for text in rest)), None)
            keys = tuple(key for _, key, _ in stack)
            cls = next((c for _, _, c in reversed(stack) if c), None)
            return [_Finding(rank, -len(keys), number, kind, keys, cls, match, given and given[1])]
    return []


def _unknown_key(argv: list[str], keys: tuple[str, ...], name: str, cls: str | None, parser) -> str:
    """`KEY: no such option`, with the closest of the options of the class (or command) it was given to;
    `KEY: moved to NEW` for an option the class moved (its `MOVED_OPTIONS`, old name -> new dotted)."""
    where = _where(argv, ".".join([*keys, name]))
    moved = _moved_options(cls).get(name) if cls else None
    if moved is not None:
        return f"{where}: moved to {where.split(' (in ')[0].removesuffix(name)}{moved}"
    options = _class_options(cls) if cls else [action.dest for action in parser._actions]
    close = difflib.get_close_matches(name, [o for o in options if not o.endswith("help")], n=1)
    dash = "--" if where.startswith("--") else ""
    hint = f"; did you mean {dash}{'.'.join([*keys, close[0]])}?" if close else ""
    command = f"ssl-vit {argv[0] if argv else 'fit'}"
    lists = f"{command} --{'.'.join(keys[:-1])}.help {cls}" if cls else f"{command} --help"
    return f"{where}: no such option{f' of {cls}' if cls else ''}{hint} ({lists} lists them)"


def _moved_options(class_path: str) -> dict[str, str]:
    """The options the class `class_path` names moved (`MOVED_OPTIONS`: old name -> new dotted name)."""
    try:
        return dict(getattr(_import(class_path), "MOVED_OPTIONS", {}))
    except (ImportError, AttributeError, ValueError):
        return {}


def with_moved_options(argv: list[str]) -> list[str] | None:
    """`argv` with each `--config` file that is a run's own config.yaml (the one in its
    `trainer.default_root_dir`, which a resume reads) given as its text with the options its classes
    moved read at their new places (`MOVED_OPTIONS`: `data.init_args.crop_scale` ->
    `data.init_args.augment.crop_scale`), so that a run written before they moved resumes; None when
    no such file has one. A recipe or the command line with an old option is refused, naming the new one
    (`_unknown_key`): only a run's own file, which the run writes anew, is read this way."""
    files = set(_config_files(argv))
    out, changed = list(argv), False
    for i, arg in enumerate(argv):
        path = argv[i + 1] if arg in ("--config", "-c") and i + 1 < len(argv) else None
        if path not in files:
            continue
        tree = _run_config(path)
        if tree is not None and _move_options(tree):
            out[i + 1], changed = yaml.safe_dump(tree, sort_keys=False), True
    return out if changed else None


def _run_config(path: str) -> dict | None:
    """The config at `path` when it is `config.yaml` in its own run directory; None otherwise."""
    if Path(path).name != "config.yaml":
        return None
    try:
        tree = yaml.safe_load(Path(path).read_text())
        root = tree["trainer"]["default_root_dir"] or DEFAULT_ROOT
        own = Path(root).resolve() == Path(path).resolve().parent
    except (OSError, yaml.YAMLError, TypeError, KeyError):
        return None  # what is wrong with it is said when it is parsed
    return tree if own else None


def _move_options(node) -> bool:
    """Moves, in the config tree `node`, each class's moved options to their new places; whether any."""
    if isinstance(node, list):
        return any([_move_options(item) for item in node])
    if not isinstance(node, dict):
        return False
    moved = False
    init_args = node.get("init_args")
    if isinstance(node.get("class_path"), str) and isinstance(init_args, dict):
        for old, new in _moved_options(node["class_path"]).items():
            if old in init_args:
                *groups, name = new.split(".")
                place = init_args
                for group in groups:
                    place = place.setdefault(group, {})
                place[name] = init_args.pop(old)
                moved = True
    return any([_move_options(value) for value in node.values()]) or moved


def _class_options(class_path: str) -> list[str]:
    """The options of the class `class_path` names (its constructor's parameters, nested ones dotted),
    as jsonargparse builds them."""
    options = ArgumentParser(exit_on_error=False)
    options.add_class_arguments(_import(class_path), fail_untyped=False)
    return [action.dest for action in options._actions]


def _class_key(keys: tuple[str, ...]) -> str:
    """The `class_path` key of the class whose `init_args` are `keys`."""
    return ".".join([*(keys[:-1] if keys and keys[-1] == "init_args" else keys), "class_path"])


def _where(argv: list[str], key: str) -> str:
    """`key` as the user gave it: `--KEY` on the command line (where init_args may be left out), else
    `KEY (in FILE)` for the `--config` file that holds it."""
    short = key.replace(".init_args.", ".")
    for arg in argv:
        option = arg.split("=", 1)[0].removesuffix("+")  # `--trainer.callbacks+=CLASS` appends
        if option[2:] in (key, short) and arg.startswith("--"):
            return option
    for path in reversed(_config_files(argv)):
        try:
            tree = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError):
            continue
        for dotted in (key, short):
            node = tree
            for part in dotted.split("."):
                node = node.get(part, _MISSING) if isinstance(node, dict) else _MISSING
            if node is not _MISSING:
                return f"{key} (in {path})"
    return key


def _config_files(argv: list[str]) -> list[str]:
    """The files given as `--config FILE` / `-c FILE` / `--config=FILE`, in order."""
    files = []
    for arg, value in zip(argv, [*argv[1:], ""]):
        if arg in ("--config", "-c"):
            files.append(value)
        elif arg.startswith("--config="):
            files.append(arg.split("=", 1)[1])
    return files


def _type_error(argv: list[str], key: str, expected: list[str], given: str | None) -> str:
    """`KEY: VALUE is not TYPE` (the types a Union allows but None, which is never the mistake), the
    choices and the closest one for a Literal."""
    value = repr(given) if given is not None else "the value"
    where = _where(argv, key)
    for text in expected:
        if text.startswith("typing.Literal"):
            choices = re.findall(r"'([^']*)'", text)
            close = difflib.get_close_matches(str(given), choices, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            return f"{where}: {value} is not one of {', '.join(choices)}{hint}"
    names = [_type_name(text) for text in expected]
    names = [name for name in dict.fromkeys(names) if name != "NoneType"]
    if len(names) > 1 and _IMPORT_PATH in names:  # a Tensor's, a callable's: not what a value is meant as
        names.remove(_IMPORT_PATH)
    if not names:
        return f"{where}: {value} is not a value it takes (ssl-vit {argv[0] if argv else 'fit'} --help)"
    return f"{where}: {value} is not {' or '.join(('an ' if n[0] in 'aeiou' else 'a ') + n for n in names)}"


def _type_name(expected: str) -> str:
    """`int` for jsonargparse's `<class 'int'>`."""
    if expected == "dot import path":
        return _IMPORT_PATH
    return re.search(r"'([\w.]+)'", expected)[1].rsplit(".", 1)[-1]


def _yaml_error(argv: list[str], err: BaseException) -> str:
    """`--config FILE: not YAML: line L, column C: PROBLEM`; the file is found by reading each `--config`
    file again (jsonargparse's message names none)."""
    for path in _config_files(argv):
        try:
            yaml.safe_load(Path(path).read_text())
        except yaml.MarkedYAMLError as bad:
            mark = bad.problem_mark
            return f"--config {path}: not YAML: line {mark.line + 1}, column {mark.column + 1}: {bad.problem}"
        except (OSError, yaml.YAMLError):
            continue
    cause = next((c for c in _causes(err) if isinstance(c, yaml.YAMLError)), err)
    return f"a config is not YAML: {' '.join(line.strip() for line in str(cause).splitlines()[:4])}"


def _causes(err: BaseException | None):
    while err is not None:
        yield err
        err = err.__cause__ or err.__context__
