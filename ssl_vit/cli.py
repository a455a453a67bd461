"""The `ssl-vit` command.

`fit`, `validate` and `test` are LightningCLI (`SslVitCLI`): the model and data are chosen in YAML by
`class_path`, every constructor argument is an option. Every other subcommand is an argparse subparser
registered by the module that owns the concept, so this file only dispatches.
"""

from __future__ import annotations

import argparse
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
    from pytorch_lightning.callbacks import LearningRateMonitor, ModelCheckpoint
    from pytorch_lightning.cli import LightningCLI, SaveConfigCallback

    from ssl_vit.data.datamodule import LogSkippedSamples
    from ssl_vit.tasks.base import Throughput

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
            parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
            parser.set_defaults(
                {
                    "checkpoint.save_last": True,
                    "checkpoint.filename": "step{step:07d}",
                    "checkpoint.auto_insert_metric_name": False,
                }
            )
            # Values that must agree between data and model are given once, on the data side.
            parser.link_arguments("data.init_args.image_size", "model.init_args.backbone.img_size")
            parser.link_arguments("data.init_args.mean", "model.init_args.mean")
            parser.link_arguments("data.init_args.std", "model.init_args.std")
            parser.link_arguments("data.num_classes", "model.init_args.num_classes", apply_on="instantiate")

        def before_instantiate_classes(self) -> None:
            config = self.config[self.subcommand]
            root = Path(config.trainer.default_root_dir or "runs/default")
            config.trainer.default_root_dir = str(root)
            if config.checkpoint.dirpath is None:
                config.checkpoint.dirpath = str(root / "checkpoints")
            logger = config.trainer.logger
            for spec in logger if isinstance(logger, list) else [logger]:
                init_args = getattr(spec, "init_args", None)
                if (
                    init_args is not None
                    and "save_dir" in init_args
                    and init_args.save_dir in (None, "runs/default")
                ):
                    init_args.save_dir = str(root)

    return SslVitCLI(
        args=None if argv == sys.argv[1:] else argv,  # None: LightningCLI reads sys.argv itself
        subclass_mode_model=True,
        subclass_mode_data=True,
        auto_configure_optimizers=False,
        save_config_callback=SaveAndLogConfig,
        save_config_kwargs={"overwrite": True},  # a resumed job rewrites its run's config.yaml
        trainer_defaults={"callbacks": [Throughput(), LogSkippedSamples(), LearningRateMonitor("step")]},
        parser_kwargs={"prog": "ssl-vit"},
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv and argv[0] in LIGHTNING_COMMANDS:
            lightning_cli(argv)
            return 0
        args = build_parser().parse_args(argv)
        return args.func(args) or 0
    except UserError as err:
        print(f"ssl-vit: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
