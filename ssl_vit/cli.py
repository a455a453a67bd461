"""The `ssl-vit` command.

`fit`, `validate` and `test` are LightningCLI (`SslVitCLI`): the model and data are chosen in YAML by
`class_path`, every constructor argument is an option. Every other subcommand is an argparse subparser
registered by the module that owns the concept, so this file only dispatches.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from ssl_vit.errors import UserError

LIGHTNING_COMMANDS = ("fit", "validate", "test")


def build_parser() -> argparse.ArgumentParser:
    from ssl_vit import info
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
    bench = sub.add_parser("bench", help="throughput benchmarks, as ratios against a reference run")
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="WHAT")
    data_commands.add_bench_parser(bench_sub)
    return parser


def lightning_cli(argv: list[str]):
    """Build and run the LightningCLI for `fit/validate/test ARGS`."""
    from pytorch_lightning.callbacks import LearningRateMonitor
    from pytorch_lightning.cli import LightningCLI, SaveConfigCallback

    from ssl_vit.data.datamodule import LogSkippedSamples
    from ssl_vit.tasks.base import Throughput
    from ssl_vit.tasks.checkpointing import LastLinkCheckpoint, load_checkpoint, with_safe_io
    from ssl_vit.tasks.nonfinite import NonFiniteGuard
    from ssl_vit.tasks.preemption import Preemption
    from ssl_vit.tasks.resume import RandomState

    class SaveAndLogConfig(SaveConfigCallback):
        """config.yaml in the run directory (Lightning's), and the whole resolved config, data and
        trainer included, in the W&B run's config under `cli`."""

        def save_config(self, trainer, pl_module, stage) -> None:
            if trainer.logger is not None:
                trainer.logger.log_hyperparams({"cli": self.config.as_dict()})

    class SslVitCLI(LightningCLI):
        """One run directory per job (`trainer.default_root_dir`): config.yaml, checkpoints/,
        wandb/ and pictures/ all land there, and a restarted job finds them again."""

        def add_arguments_to_parser(self, parser) -> None:
            # last.ckpt: a hard link to the newest checkpoint, not a second full write (checkpointing.py).
            parser.add_lightning_class_args(LastLinkCheckpoint, "checkpoint")
            parser.set_defaults(
                {
                    "checkpoint.save_last": "link",
                    "checkpoint.filename": "step{step:07d}",
                    "checkpoint.auto_insert_metric_name": False,
                }
            )
            # What a NaN or inf loss does: `nonfinite.policy` skip (up to `max_skips`) or stop.
            parser.add_lightning_class_args(NonFiniteGuard, "nonfinite")
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
            # LightningCLI reads a local --ckpt_path's hyperparameters with torch.load(weights_only=True)
            # and lets a refusal or a corrupt file through as a traceback; re-read it for the one-line error.
            try:
                super()._parse_ckpt_path()
            except Exception:
                ckpt_path = self.config[self.config.subcommand].get("ckpt_path")
                if ckpt_path:
                    load_checkpoint(ckpt_path)  # raises the UserError when the file is the problem
                raise

        def before_instantiate_classes(self) -> None:
            config = self.config[self.subcommand]
            if config.get("weights_only") is False:
                raise UserError(
                    "--weights_only false: ssl-vit never unpickles code from a checkpoint; drop the option "
                    "(checkpoints written by ssl-vit load with weights only)"
                )
            root = Path(config.trainer.default_root_dir or "runs/default")
            config.trainer.default_root_dir = str(root)
            if config.checkpoint.dirpath is None:
                config.checkpoint.dirpath = str(root / "checkpoints")
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
                    and init_args.save_dir in (None, "runs/default")
                ):
                    init_args.save_dir = str(root)

        def instantiate_trainer(self, **kwargs):
            # A recipe's `trainer.plugins` replaces the default list (LightningCLI merges only callbacks
            # with trainer_defaults), so the checkpoint IO is (re)added here.
            plugins = self._get(self.config_init, "trainer", default={}).get("plugins")
            return super().instantiate_trainer(plugins=with_safe_io(plugins), **kwargs)

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
    way up, ends as one line, `ssl-vit: error: WHAT: FIX`, and exit status 2. jsonargparse's own
    parse errors (usage message, exit 2) pass through as they are."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv and argv[0] in LIGHTNING_COMMANDS:
            ckpt_path = ckpt_path_argument(argv)
            if ckpt_path is not None:
                check_ckpt_path(ckpt_path)
            lightning_cli(argv)
            return 0
        args = build_parser().parse_args(argv)
        return args.func(args) or 0
    except Exception as err:
        message = user_error_message(err)
        if message is None:
            raise
        print(f"ssl-vit: error: {message}", file=sys.stderr)
        return 2
    except SystemExit as stop:
        if type(stop).__name__ != "SIGTERMException":  # Lightning's, raised on every rank at one step
            raise
        # `ssl_vit.tasks.preemption` saved last.ckpt and wrote what happened into the exception.
        print(f"ssl-vit: {stop}", file=sys.stderr)
        return 0 if getattr(stop, "requeued", False) else 128 + signal.SIGTERM


def resumed_checkpoint(ckpt_path: str | None, checkpoint_dir: Path) -> Path | None:
    """The checkpoint `--ckpt_path` makes this job continue from: `last` as Lightning resolves it (the
    newest `last*.ckpt`; none yet: the job starts afresh), a local path as it is; None otherwise."""
    if not ckpt_path:
        return None
    if str(ckpt_path) == "last":
        found = sorted(checkpoint_dir.glob("last*.ckpt"), key=lambda p: p.stat().st_mtime)
        return found[-1] if found else None
    return Path(ckpt_path) if "://" not in str(ckpt_path) else None


def checkpoint_step(path: Path) -> int | None:
    """The optimizer step a Lightning checkpoint was saved at (read lazily: tensors stay on disk)."""
    import torch

    try:
        return int(torch.load(path, map_location="cpu", weights_only=True, mmap=True)["global_step"])
    except Exception:  # not ours to judge here: loading it for real reports what is wrong
        return None


# The worker's exception line at the end of a DataLoader re-raise: `ssl_vit.errors.UserError: MESSAGE`.
_WORKER_LINE = r"(?P<name>[A-Za-z_][\w.]*): (?P<message>.*)"


def user_error_message(err: BaseException) -> str | None:
    """The one-line message of the UserError behind `err`, or None when there is none.

    Finds it where libraries put it: `err` itself, its `__cause__`/`__context__` chain (jsonargparse
    and Lightning re-raise constructor and hook errors, e.g. as MisconfigurationException), the last
    line of a DataLoader worker's re-raised exception (`Caught UserError in DataLoader worker process
    0. Original Traceback ...`), or, by its text, a recent UserError pasted into another exception's
    message (jsonargparse's Union errors)."""
    chain, seen, todo = [], set(), [err]
    while todo:
        exc = todo.pop(0)
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        chain.append(exc)
        todo += [exc.__cause__, None if exc.__suppress_context__ else exc.__context__]
    for exc in chain:
        text = str(exc)
        worker = _worker_user_error(text) if "Original Traceback" in text else None
        if worker is not None:
            return worker
        if isinstance(exc, UserError):
            return text.strip().splitlines()[-1] if "Original Traceback" in text else text
    texts = [str(exc) for exc in chain]
    for message in reversed(UserError.recent):
        if message and any(message in text for text in texts):
            return message
    return None


def _worker_user_error(text: str) -> str | None:
    """The message of a DataLoader worker's UserError, from the traceback text torch re-raises."""
    import re

    lines = [line for line in text.strip().splitlines() if line.strip()]
    match = re.fullmatch(_WORKER_LINE, lines[-1]) if lines else None
    if match is None:
        return None
    module, _, name = match["name"].rpartition(".")
    cls = getattr(sys.modules.get(module), name, None)
    if isinstance(cls, type) and issubclass(cls, UserError):
        return match["message"]
    return None


# --ckpt_path values Lightning resolves itself (a checkpoint of the run, the model registry).
CKPT_KEYWORDS = ("last", "best", "hpc", "null", "none", "registry")


def ckpt_path_argument(argv: list[str]) -> str | None:
    """The local file a `fit/validate/test` command line gives as `--ckpt_path X` (or `=X`; the last one
    wins, as in any parser), or None for none, a keyword (last, best, ...) or a URL."""
    value = None
    for i, arg in enumerate(argv):
        if arg == "--ckpt_path" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--ckpt_path="):
            value = arg.partition("=")[2]
    if not value or value.lower() in CKPT_KEYWORDS or value.lower().startswith("registry:") or "://" in value:
        return None
    return value


def check_ckpt_path(path: str | Path) -> None:
    """Raise a one-line UserError unless `path` is a Lightning checkpoint that loads with weights only.

    For `--ckpt_path` (resume or evaluate a run's state): LightningCLI itself reads a local checkpoint's
    hyperparameters with torch.load before anything else, and a file that is not a checkpoint fails
    there with whatever torch's unpickler happened to hit. Cheap: tensors are memory-mapped, not read."""
    import torch

    path = Path(path)
    fix = (
        "give a .ckpt written by ssl-vit (RUN/checkpoints/last.ckpt) or `last` to resume the run in "
        "--trainer.default_root_dir; to start from other weights use --model.init_args.init_from"
    )
    if not path.exists():
        raise UserError(f"--ckpt_path {path} does not exist: {fix}")
    if not path.is_file():
        raise UserError(f"--ckpt_path {path} is not a file: {fix}")
    try:
        try:
            checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception:  # not torch's zip format, or a filesystem without mmap: read it whole
            checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # text, random bytes, a zip that is not torch's, pickled code: all one line
        raise UserError(
            f"--ckpt_path {path} is not a checkpoint torch can load safely ({type(err).__name__}): {fix}"
        ) from None
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        raise UserError(f"--ckpt_path {path} is not a Lightning checkpoint (no state_dict): {fix}")
    if not isinstance(checkpoint.get("hyper_parameters", {}), dict):
        raise UserError(f"--ckpt_path {path} has hyper_parameters that are not a mapping: {fix}")


if __name__ == "__main__":
    sys.exit(main())
