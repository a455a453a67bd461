"""`FewShotMonitor`: the ViT paper's few-shot probe as a live signal during pretraining.

The ViT paper tracks 5-shot linear accuracy during pretraining because fine-tuning every checkpoint
is too costly (sec 4.1 "Metrics"); big_vision runs its `fewshot_lsr` evaluator every N steps.

    trainer:
      callbacks:
        - class_path: ssl_vit.evaluation.monitor.FewShotMonitor
          init_args:
            train_urls: data/shards/digits/train-{000000..000004}.tar
            test_urls: data/shards/digits/val-{000000..000003}.tar
            every_n_steps: 500
"""

from __future__ import annotations

import logging

import pytorch_lightning as pl
import torch
from torch import Tensor
from torch.distributed.fsdp import FSDPModule

from ssl_vit.errors import BadValue, UserError
from ssl_vit.evaluation.features import extract_features
from ssl_vit.evaluation.fewshot import fewshot_accuracy
from ssl_vit.internals import logging_step
from ssl_vit.models.vit import FeatureKind, ViTConfig
from ssl_vit.tasks.base import off_the_clock

log = logging.getLogger("ssl_vit")


class FewShotMonitor(pl.Callback):
    """Every `every_n_steps` optimizer steps and at the end of training, extract frozen features of
    `pl_module.backbone` on a small labelled set and log `fewshot/{shots}shot` (mean accuracy over
    seeds, in [0, 1]) to the trainer's loggers, at step k for the weights after k optimizer steps.

    Args:
        train_urls: shards the support sets are sampled from; by default the training data's own
            (`trainer.datamodule.train_urls`), for sets as small as the quickstart's.
        test_urls: shards the accuracy is measured on; by default the training data's `val_urls`.
        every_n_steps: evaluation interval in optimizer steps.
        shots, seeds, ridge, classes: as in `ssl_vit.evaluation.fewshot.fewshot_correct`.
        feature: which frozen feature (`ssl_vit.evaluation.features`).
        image_size: evaluation resolution; by default the backbone's.
        batch_size: images per forward pass.

    The labelled set is read as the training data is (a `ShardDataModule`'s read limits, bands and their
    `mean` and `std`), so a multispectral run is monitored on its own bands.

    A shot count the labelled set cannot fill (a class with fewer training images than the shots) is
    skipped with a one-line warning, the others are logged; a set the probe cannot run on at all (one
    class, no test image of its classes) skips the probe with such a line: a live signal never stops a
    run, nor loses its end.

    Every rank extracts its share of both sets and all ranks get the same scores; rank zero logs them.
    The scores go straight to the loggers (`pl_module.log` is not allowed in `on_train_end`), so they
    are not in `trainer.callback_metrics` and a checkpoint callback cannot monitor them.
    """

    def __init__(
        self,
        train_urls: str | list[str] | None = None,
        test_urls: str | list[str] | None = None,
        every_n_steps: int = 1000,
        shots: tuple[int, ...] = (1, 5, 10),
        seeds: tuple[int, ...] = (0, 1, 2),
        ridge: float = 1024.0,
        classes: list[int] | None = None,
        feature: FeatureKind = "cls",
        image_size: int | None = None,
        batch_size: int = 64,
    ) -> None:
        if every_n_steps < 1:
            raise BadValue(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.train_urls, self.test_urls = train_urls, test_urls
        self.every_n_steps = every_n_steps
        self.shots, self.seeds, self.ridge, self.classes = tuple(shots), tuple(seeds), ridge, classes
        self.feature, self.image_size, self.batch_size = feature, image_size, batch_size
        self._last_step: int | None = None
        self._warned: set[str] = set()

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Built here, not in __init__: the process group exists by now, so the exact passes below are
        # split by rank (ShardDataModule reads it from torch.distributed when no trainer is attached).
        from ssl_vit.data import ShardDataModule
        from ssl_vit.data.options import Augment

        if stage != "fit":  # `ssl-vit validate/test` with a pretraining recipe: nothing to monitor
            return
        data = trainer.datamodule
        train_urls = self.train_urls or getattr(data, "train_urls", None)
        test_urls = self.test_urls or getattr(data, "val_urls", None)
        if not train_urls or not test_urls:
            raise UserError(
                "FewShotMonitor has no labelled set: give its train_urls and test_urls (or train with a "
                "ShardDataModule that has train_urls and val_urls)"
            )
        self.datamodule = ShardDataModule(
            train_urls=train_urls,
            val_urls=test_urls,
            image_size=self.image_size or pl_module.backbone.patch_embed.img_size[0],
            batch_size=self.batch_size,
            # decoding a small set in the training process: no worker processes to start every time
            num_workers=0,
            augment=Augment(train_preset="eval"),
            # an exact pass does not use the training epoch length; setting it spares the manifest lookup
            train_batches=1,
            **(
                {"limits": data.limits, "channels": data.channels, "mean": data.mean, "std": data.std}
                if isinstance(data, ShardDataModule)
                else {}
            ),
        )
        if isinstance(data, ShardDataModule):  # one reading of each manifest, for training's decisions too
            self.datamodule.manifests = data.manifests
        # A missing shard fails now, in one line, not at the first evaluation hours into the run.
        self.datamodule.setup("fit")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # Here, not at the end of step k's batch: that batch's loss is logged at step k - 1 after its end
        # (`ssl_vit.internals.logging_step`), while the weights after k updates belong at step k, with the
        # loss and learning rate of the next batch, which starts from them.
        if trainer.global_step and trainer.global_step % self.every_n_steps == 0:
            with off_the_clock(trainer):  # the logged images/s stays training's own
                self._evaluate(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._evaluate(trainer, pl_module)

    def _evaluate(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Once per optimizer step: with gradient accumulation several batches share a global step, and
        # training may end on a step that was just evaluated.
        # fast_dev_run swaps the loggers for a dummy: nothing would record the scores.
        if trainer.global_step == self._last_step or trainer.fast_dev_run:
            return
        self._last_step = trainer.global_step
        backbone = _unsharded_backbone(pl_module) if isinstance(pl_module, FSDPModule) else pl_module.backbone
        train, test = (
            extract_features(
                backbone,
                self.datamodule.exact_dataloader(split),
                self.feature,
                prepare=self.datamodule.prepare_batch,
            )
            for split in ("train", "val")
        )
        shots = self._shots_possible(train.y, test.y, trainer)
        if not shots:
            return
        options = dict(shots=shots, seeds=self.seeds, ridge=self.ridge, classes=self.classes)
        accuracy = fewshot_accuracy(train.x, train.y, test.x, test.y, **options)
        if trainer.is_global_zero:
            metrics = {f"fewshot/{shots}shot": mean for shots, (mean, _) in accuracy.items()}
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=logging_step(trainer))

    def _shots_possible(self, train_y: Tensor, test_y: Tensor, trainer: pl.Trainer) -> tuple[int, ...]:
        """The shot counts of `self.shots` the labelled set can fill (train_y: (n,), test_y: (m,) labels,
        -1 unlabelled), as `fewshot_accuracy` chooses its classes; a warning, once, for those it cannot
        (which `fewshot_accuracy` would raise for)."""
        train_y, test_y = train_y.cpu(), test_y.cpu()
        labelled = train_y[train_y >= 0]
        classes = labelled.unique() if self.classes is None else torch.tensor(sorted(set(self.classes)))
        counts = {int(c): int((labelled == c).sum()) for c in classes}
        tested = torch.isin(test_y, classes).any()
        if len(counts) < 2 or not tested:
            what = (
                f"{len(counts)} class(es)"
                if len(counts) < 2
                else f"no test image of classes {sorted(counts)}"
            )
            self._warn(
                f"its labelled set has {what}: skipped (give it 2 or more classes to tell apart)", trainer
            )
            return ()
        fewest = min(counts, key=counts.get)
        possible = tuple(k for k in self.shots if k <= counts[fewest])
        if len(possible) < len(self.shots):
            skipped = ", ".join(f"{k}-shot" for k in self.shots if k not in possible)
            self._warn(
                f"class {fewest} has {counts[fewest]} training images, too few for {skipped}: skipped (give "
                f"shots of at most {counts[fewest]}, or train_urls with more images of each class)",
                trainer,
            )
        return possible

    def _warn(self, message: str, trainer: pl.Trainer) -> None:
        if message not in self._warned and trainer.is_global_zero:
            log.warning("ssl-vit: warning: FewShotMonitor: %s", message)
        self._warned.add(message)


def _unsharded_backbone(pl_module: pl.LightningModule):
    """Under FSDP2 every block gathers its weights with a collective in each forward, so every rank
    would have to run the same number of forwards, but an exact pass gives ranks unequal shares. Each
    rank builds a plain copy of the backbone from the full weights instead (gathered once per
    evaluation; one more copy of the backbone in memory while it runs)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(pl_module, options=StateDictOptions(full_state_dict=True))
    backbone = ViTConfig(**pl_module.hparams.backbone).build().to(pl_module.device)
    backbone.load_state_dict(
        {k.removeprefix("backbone."): v for k, v in state.items() if k.startswith("backbone.")}
    )
    return backbone.eval()
