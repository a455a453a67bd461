"""The `ssl-vit` command.

`fit`, `validate` and `test` are LightningCLI (`SslVitCLI`): the model and data are chosen in YAML by
`class_path`, every constructor argument is an option. Every other subcommand is an argparse subparser
registered by the module that owns the concept, so this file only dispatches.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import signal
import sys
import threading
from pathlib import Path

from ssl_vit.errors import Interrupted, UserError, resource_error_message, user_error_message
from ssl_vit.quiet import quiet, verbose_requested
from ssl_vit.signals import Terminated, raises, received, recorded

LIGHTNING_COMMANDS = ("fit", "validate", "test")
DEFAULT_ROOT = "runs/default"  # the run directory without --trainer.default_root_dir


def build_parser() -> argparse.ArgumentParser:
    from ssl_vit import info
    from ssl_vit.analysis import commands as analysis_commands
    from ssl_vit.benchmark import commands as bench_commands
    from ssl_vit.checkpoints import commands as checkpoint_commands
    from ssl_vit.data import commands as data_commands
    from ssl_vit.evaluation import commands as evaluation_commands

    parser = argparse.ArgumentParser(prog="ssl-vit", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in LIGHTNING_COMMANDS:
        sub.add_parser(
            name, help=f"LightningCLI {name}: ssl-vit {name} --config RECIPE.yaml [--key value ...]"
        )
    info.add_parser(sub)
    data_commands.add_parser(sub)
    evaluation_commands.add_parsers(sub)
    checkpoint_commands.add_parser(sub)
    analysis_commands.add_parser(sub)
    bench = sub.add_parser("bench", help="throughput benchmarks, as ratios against a reference run")
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="WHAT")
    data_commands.add_bench_parser(bench_sub)
    bench_commands.add_bench_parsers(bench_sub)
    return parser


def lightning_cli(argv: list[str]):
    """Build and run the LightningCLI for `fit/validate/test ARGS`."""
    from pytorch_lightning.callbacks import LearningRateMonitor
    from pytorch_lightning.cli import LightningCLI, SaveConfigCallback

    from ssl_vit.data.checks import check_shard_urls
    from ssl_vit.data.skip_log import LogSkippedSamples
    from ssl_vit.tasks.base import Throughput
    from ssl_vit.tasks.checkpointing import (
        LastLinkCheckpoint,
        check_ckpt_path,
        checkpoint_step,
        local_ckpt_path,
        refuse_used_run_dir,
        resumed_checkpoint,
        with_safe_io,
    )
    from ssl_vit.tasks.compile import CompileTask, check_compile
    from ssl_vit.tasks.health import HealthMonitor
    from ssl_vit.tasks.nonfinite import NonFiniteGuard
    from ssl_vit.tasks.preemption import Preemption
    from ssl_vit.tasks.resume import RandomState
    from ssl_vit.tasks.run_lock import RunLock, job_leader

    held = contextlib.ExitStack()  # the run directory's lock, released however the command ends

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

        def subcommands(self) -> dict[str, set[str]]:
            # Only the command being run gets a parser: each is built from the signatures of the
            # Trainer and every class in the config, a few tenths of a second of every start.
            return {argv[0]: LightningCLI.subcommands()[argv[0]]}

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
            # What a NaN or inf loss does: `nonfinite.policy` skip (up to `max_skips`) or stop.
            parser.add_lightning_class_args(NonFiniteGuard, "nonfinite")
            # Collapse: feature std and effective rank logged as health/*, and a stop below `health.min_std`.
            parser.add_lightning_class_args(HealthMonitor, "health")
            # torch.compile of the blocks or the step: `compile.enabled`, `.mode`, `.scope`, `.backend`.
            parser.add_lightning_class_args(CompileTask, "compile")
            # Values that must agree between data and model are given once, on the data side.
            parser.link_arguments("data.init_args.image_size", "model.init_args.backbone.img_size")
            parser.link_arguments("data.init_args.mean", "model.init_args.mean")
            parser.link_arguments("data.init_args.std", "model.init_args.std")
            parser.link_arguments("data.num_classes", "model.init_args.num_classes", apply_on="instantiate")

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
                held.enter_context(RunLock(root))
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
            finally:
                config = self.config[self.config.subcommand]
                config.ckpt_path = given
            if before is not None:
                refuse_overridden_options(argv, before, config, path)
                if self.config.subcommand == "fit":  # validate/test evaluate the checkpoint's model
                    refuse_contradicting_config(before, config, path)

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

    with held:
        return SslVitCLI(
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
                "plugins": [{"class_path": "ssl_vit.tasks.checkpointing.SafeCheckpointIO"}],
            },
            parser_kwargs={"prog": "ssl-vit"},
        )


def main(argv: list[str] | None = None) -> int:
    """Run one command. A user's mistake, however deep it was raised and however it was wrapped on the
    way up, ends as one line, `ssl-vit: error: WHAT: FIX`, and exit status 2; the machine running out
    of memory or disk space, or a DataLoader worker dying, as one such line and exit status 1.
    jsonargparse's own parse errors (usage message, exit 2) pass through as they are."""
    verbose, argv = verbose_requested(sys.argv[1:] if argv is None else argv)
    quiet(verbose)
    try:
        if argv and argv[0] in LIGHTNING_COMMANDS:
            # Until the trainer's own handlers take over (a fit's from its setup on: a checkpoint at the
            # step's end, `ssl_vit.tasks.preemption`), SIGTERM ends the command with its one line, the run
            # directory's lock released, and SLURM's requeue signal (SIGUSR1, whose default action would
            # end the job unsaved and never requeued) is kept for the training to act on when it starts.
            with raises(signal.SIGTERM, Terminated), recorded(signal.SIGUSR1):
                lightning_cli(argv)
            return 0
        args = build_parser().parse_args(argv)
        # Ctrl-C and a scheduler's SIGTERM end a command by exceptions, so that what it cleans up on the way
        # out (a staged --out, a half-written shard, a temporary directory) is cleaned up; `fit` has its
        # own meaning for SIGTERM (a checkpoint, `ssl_vit.tasks.preemption`).
        with (
            raises(signal.SIGINT, Interrupted, in_children=KeyboardInterrupt),
            raises(signal.SIGTERM, Terminated),
        ):
            return args.func(args) or 0
    except Exception as err:
        message = user_error_message(err)
        if message is not None:
            print(f"ssl-vit: error: {message}", file=sys.stderr)
            return 2
        message = resource_error_message(err)
        if message is None:
            raise
        stop = next((s for s in (signal.SIGINT, signal.SIGTERM) if received(s)), None)
        if stop is not None:
            # The stop came first: a DataLoader worker killed by the same signal (Ctrl-C and a
            # scheduler's SIGTERM reach the whole process group) is its consequence, not news.
            return _stopped(stop, _saved(err))
        _end_early()
        message += _saved(err)
        print(f"ssl-vit: error: {message}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, Interrupted):
        # Ctrl-C: every command writes its outputs whole or not at all, so there is nothing to show.
        return _stopped(signal.SIGINT)
    except Terminated:
        return _stopped(signal.SIGTERM)
    except SystemExit as stop:
        if type(stop).__name__ != "SIGTERMException":  # Lightning's, raised on every rank at one step
            raise
        # `ssl_vit.tasks.preemption` saved last.ckpt and wrote what happened into the exception (rank 0
        # of a requeued job has printed it already: SLURM may stop the job any moment).
        if str(stop):
            print(f"ssl-vit: {stop}", file=sys.stderr)
        return 0 if getattr(stop, "requeued", False) else 128 + signal.SIGTERM


def _saved(err: Exception) -> str:
    """What the line of a run ended by `err` adds when `ssl_vit.tasks.preemption` saved its state."""
    saved = getattr(err, "saved", None)
    return f"; saved {saved}: resume with the same command and --ckpt_path last" if saved else ""


def _stopped(signum: int, saved: str = "") -> int:
    """A command ended by Ctrl-C or SIGTERM: its one line and exit status (128 + the signal)."""
    _end_early()
    print(f"ssl-vit: {'interrupted' if signum == signal.SIGINT else 'terminated'}{saved}", file=sys.stderr)
    return 128 + signum


def _end_early() -> None:
    """A command stopped by a signal or by the machine (a dead DataLoader worker, memory, disk): its
    DataLoaders are torn down now, not after its last line (a surviving worker, left to the exit,
    would sit out its SIGTERM grace, `WORKER_SIGTERM_GRACE_S`, before the process could end), and what
    that raises where nothing can catch it (a worker's connection reset while it was handing over a
    batch, in `__del__` or in the pin-memory thread) is a consequence of the stop, not news."""
    consequences = (ConnectionError, EOFError, BrokenPipeError)

    def unraisable(info) -> None:
        if not isinstance(info.exc_value, consequences):
            sys.__unraisablehook__(info)

    def in_thread(info) -> None:
        if not isinstance(info.exc_value, consequences):
            threading.__excepthook__(info)

    sys.unraisablehook, threading.excepthook = unraisable, in_thread
    workers = sys.modules.get("ssl_vit.data.workers")
    if workers is not None:  # workers end now, not after their grace (nor after this process)
        workers.stop_all_workers()
    gc.collect()


def check_optimizer(config) -> None:
    """The model's optimizer built once on a dummy parameter, before anything is written: torch checks
    its values (a negative learning rate, betas outside [0, 1), ...) only when the task builds it, after
    the run directory, config.yaml and the W&B run exist."""
    spec = getattr(getattr(config.get("model"), "init_args", None), "optimizer", None)
    class_path = getattr(spec, "class_path", None)
    if class_path is None:
        return
    import importlib

    import torch

    module, _, name = class_path.rpartition(".")
    init_args = spec.init_args.as_dict() if hasattr(spec.init_args, "as_dict") else dict(spec.init_args or {})
    try:
        optimizer = getattr(importlib.import_module(module), name)
        optimizer([torch.nn.Parameter(torch.zeros(1))], **init_args)
    except (ValueError, TypeError) as err:
        raise UserError(
            f"model.init_args.optimizer ({class_path.rsplit('.', 1)[-1]}): {err}: give a valid value in the "
            "recipe or on the command line (--model.init_args.optimizer.init_args.NAME VALUE)"
        ) from None


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


def refuse_contradicting_config(before: dict, config, path) -> None:
    """A model value of the config file that the checkpoint being resumed replaced (another task's
    recipe, another size): the fit would silently train the checkpoint's model instead. A value the
    config leaves unset (None: the task's preset or default decides) is the checkpoint's."""
    after = config.as_dict()
    differing = [
        f"{key} {old} (checkpoint: {new})"
        for key, old in _leaves(before.get("model"), "model")
        if old is not None
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


if __name__ == "__main__":
    sys.exit(main())
