"""What the trained protocols share: their keys (`TrainedProtocol`), the labelled images each label
fraction trains on, the images a protocol with several candidates chooses on, training (a Lightning
trainer streaming the shards, or a loop over cached frozen features), and scoring per test image.

A protocol with candidates (a grid of learning rates, weight decays) chooses among them on held-out
images (`training_set`), never on the test split: the test split is read after the choice, by the chosen
candidate only. Every trained column records its training loss every few steps (`loss_curve` in
results.json, `compare`'s training_curves.png), so that whether its loss levelled off can be seen.

Legend: C candidates, M test images, F statistics per image, B batch.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Annotated, Any, Literal, NamedTuple

import torch
from pydantic import Field
from pydantic.dataclasses import dataclass
from timm.data.auto_augment import rand_augment_transform
from timm.optim import Lars
from torch import Tensor
from torch.optim import SGD, AdamW, Optimizer

from ssl_vit import progress
from ssl_vit.data import ShardDataModule
from ssl_vit.data.transforms.rgb import Preset
from ssl_vit.errors import UserError
from ssl_vit.evaluation.cache import data_module
from ssl_vit.evaluation.features import Features, local_device
from ssl_vit.evaluation.fewshot import draw_per_class
from ssl_vit.evaluation.protocol import (
    STRICT,
    Fraction,
    Momentum,
    NonNegative,
    Outcome,
    Positive,
    PositiveInt,
    Protocol,
    check_unique,
)
from ssl_vit.evaluation.scoring import class_mask
from ssl_vit.evaluation.stats import ACCURACY, Metric, Score
from ssl_vit.models.vit import WidthFeature
from ssl_vit.quiet import lightning_info_dropped
from ssl_vit.tasks.base import Training
from ssl_vit.tasks.optim import SchedulerCallable, WarmupDecay

if TYPE_CHECKING:
    from ssl_vit.evaluation.cache import FeatureCache

OptimizerName = Literal["sgd", "adamw", "lars"]
# The batch size a protocol trains with unless it sets its own: the dataset's, else ShardDataModule's.
DATA_BATCH_SIZE = inspect.signature(ShardDataModule).parameters["batch_size"].default
CURVE_POINTS = 50  # training-loss points a column records, evenly spaced over its steps
# A training loss whose mean over the last fifth of its recorded points is this much below the fifth
# before had not levelled off (`levelling`, noted by `tables.falling_loss_notes`).
STILL_FALLING = 0.1


class Selection(NamedTuple):
    """Where a protocol chooses among its candidates: the images of `split` with these `keys` (None:
    the whole split, of the protocol's classes)."""

    split: str
    keys: list[str] | None


class TrainingSet(NamedTuple):
    """What one label fraction of a trained protocol trains and chooses on, and for how long."""

    keys: list[str] | None  # training images (None: the whole train split, of the protocol's classes)
    selection: Selection | None  # None: one candidate, nothing to choose
    used: dict[str, Any]  # what results.json records of them
    steps: int | None  # optimizer steps; None: the protocol's epochs


@dataclass(config=STRICT)
class TrainedProtocol(Protocol):
    """What the trained kinds share: a Lightning task trained on the train split (or a class-balanced
    part of it per label fraction), scored once on the test split at the end (by its chosen candidate)."""

    feature: WidthFeature = "cls"
    epochs: PositiveInt | None = None  # passes over the training (sub)set; 10 unless `steps` is given
    # optimizer steps instead of epochs: one number for every label fraction, or one per fraction
    steps: PositiveInt | Annotated[list[PositiveInt], Field(min_length=1)] | None = None
    batch_size: PositiveInt | None = None  # None: the dataset's
    optimizer: OptimizerName = "sgd"
    momentum: Momentum | None = None  # sgd and lars: 0.9 unless given
    betas: Annotated[list[Momentum], Field(min_length=2, max_length=2)] | None = None  # adamw: [0.9, 0.999]
    weight_decay: NonNegative = 0.0
    warmup_steps: Annotated[int, Field(ge=0)] = 0  # linear warmup, then `decay` (`WarmupDecay`)
    decay: Literal["cosine", "linear"] = "cosine"
    min_lr_ratio: Annotated[float, Field(ge=0, le=1)] = 0.0
    augmentation: Preset = "pretrain"  # the training transform (`build_transform`'s preset)
    crop_scale: Annotated[list[Fraction], Field(min_length=2, max_length=2)] = Field(
        default_factory=lambda: [0.6, 1.0]
    )
    randaugment: str | None = None  # timm's RandAugment string; augmentation `supervised` only
    label_fractions: Annotated[list[Fraction], Field(min_length=1)] = Field(default_factory=lambda: [1.0])
    # The share of each class's labelled images held out to choose a candidate on (unless val_urls is
    # given); used only with several candidates.
    select_fraction: Annotated[float, Field(gt=0, lt=1)] = 0.1
    lrs: Annotated[list[Positive], Field(min_length=1)] = Field(
        default_factory=lambda: [0.01, 0.03, 0.1, 0.3]
    )  # the lr grid: one candidate (a head, or a model) per lr

    def candidates(self) -> list[str]:
        """The names of the candidates it trains and chooses among (one: nothing to choose)."""
        return [f"{lr:g}" for lr in self.lrs]

    def grid_axes(self) -> dict[str, list[float]]:
        """Each candidate's value on each axis of its grid."""
        return {"lr": list(self.lrs)}

    def needs_epoch_size(self) -> bool:
        # a fraction below 1, or the images left when some are held out to choose on, are counted; steps
        # need no epoch; only all of the split, streamed, is sized by its manifest
        whole = 1.0 in self.label_fractions and len(self.candidates()) == 1
        return self.steps is None and whole and self.cached_kind() is None

    def cached_kind(self) -> str | None:
        """The cache's feature kind it trains on (a frozen-backbone probe with the `eval` augmentation);
        None when it trains on the stream."""
        return None

    def steps_for(self, fraction: float) -> int | None:
        """The optimizer steps one label fraction trains for; None: `epochs` say."""
        if isinstance(self.steps, list):
            return self.steps[self.label_fractions.index(fraction)]
        return self.steps

    def column(self, fraction: float) -> str:
        """The result column of one label fraction: the protocol's name for all labels, else e.g.
        `finetune_10pct`."""
        return self.name if fraction == 1 else f"{self.name}_{100 * fraction:g}pct"

    def fractions(self) -> list[float]:
        return list(self.label_fractions)

    def result_column(self, fraction: float) -> str:
        """The column that stands for one label fraction (a segmentation's mIoU among its two)."""
        return self.column(fraction)

    def columns(self) -> list[str]:
        return [self.column(f) for f in self.label_fractions]

    def headline(self) -> str:
        return self.result_column(max(self.label_fractions))

    def augment(self) -> dict[str, Any]:
        """The ShardDataModule arguments of the training transform."""
        return dict(
            train_preset=self.augmentation, crop_scale=tuple(self.crop_scale), randaugment=self.randaugment
        )

    def settle(self, data: dict[str, Any], backbone, where: str) -> None:
        self._settle_length(where)
        if self.batch_size is None:
            self.batch_size = data.get("batch_size", DATA_BATCH_SIZE)
        self._settle_optimizer(where)
        self._check_augmentation(where)
        if len(set(self.label_fractions)) != len(self.label_fractions):
            raise UserError(f"{where}: label_fractions {self.label_fractions} repeat a fraction")
        check_unique(self.lrs, "lrs", where)

    def _settle_length(self, where: str) -> None:
        """Epochs or steps, not both (10 epochs when neither); steps as one number or one per fraction."""
        if self.epochs is not None and self.steps is not None:
            raise UserError(
                f"{where}: epochs and steps are both given: keep one (steps: the same for every fraction)"
            )
        if self.steps is None and self.epochs is None:
            self.epochs = 10
        if isinstance(self.steps, list) and len(self.steps) != len(self.label_fractions):
            raise UserError(
                f"{where}: steps {self.steps} gives {len(self.steps)} numbers for "
                f"{len(self.label_fractions)} label_fractions: give one per fraction, or one number for all"
            )

    def _settle_optimizer(self, where: str) -> None:
        """adamw takes betas ([0.9, 0.999] unless given), sgd and lars momentum (0.9)."""
        if self.optimizer == "adamw":
            if self.momentum is not None:
                raise UserError(f"{where}: momentum is for sgd and lars; adamw takes betas")
            self.betas = self.betas or [0.9, 0.999]
        else:
            if self.betas is not None:
                raise UserError(f"{where}: betas are adamw's; {self.optimizer} takes momentum")
            self.momentum = 0.9 if self.momentum is None else self.momentum

    def _check_augmentation(self, where: str) -> None:
        """A crop scale of [smallest, largest] area; a RandAugment string timm reads, with `supervised`."""
        if self.crop_scale[0] > self.crop_scale[1]:
            raise UserError(f"{where}: crop_scale is {self.crop_scale}: give [smallest, largest] area")
        if self.randaugment is None:
            return
        if self.augmentation != "supervised":
            raise UserError(
                f"{where}: randaugment is part of augmentation 'supervised', not {self.augmentation!r}"
            )
        try:
            rand_augment_transform(self.randaugment, {})
        except Exception:
            raise UserError(
                f"{where}: randaugment is {self.randaugment!r}: give a timm RandAugment string such "
                "as 'rand-m9-mstd0.5-inc1'"
            ) from None

    # --- what it is scored on: classification by default (a segmentation overrides these) ---

    def targets(self, found: Features) -> Tensor:
        """The targets of cached samples: (N,) labels."""
        return found.y

    def statistics(self, outputs: Tensor, targets: Tensor) -> Tensor:
        """(C, B, K) candidates' logits, (B,) labels -> (C, B, 1) correct flags."""
        return (outputs.argmax(-1) == targets).double()[..., None]

    def selection_metric(self) -> Metric:
        """What its candidates are chosen by, from `statistics` averaged over the selection images."""
        return ACCURACY

    def test_scores(self, found: Tensor) -> dict[str | None, Score]:
        """The chosen candidate's test statistics (1, M, F) -> its Scores by column suffix (None: the
        column itself)."""
        return {None: Score(found[None])}

    def run(self, features: FeatureCache, config, seed: int, where: str) -> Outcome:
        """For each label fraction: train on its images (`training_set`), choose a candidate when there
        are several, score the test split with it (`fit_fraction`)."""
        scores, details = {}, {}
        for fraction in self.label_fractions:
            column = self.column(fraction)
            plan = training_set(self, features, fraction, seed)
            found, detail = self.fit_fraction(plan, features, config, seed)
            scores.update({(column if key is None else f"{column}_{key}"): s for key, s in found.items()})
            details[column] = {**plan.used, **detail}
        return Outcome(scores, details)

    def fit_fraction(
        self, plan: TrainingSet, features: FeatureCache, config, seed: int
    ) -> tuple[dict[str | None, Score], dict]:
        """Train on `plan`, choose, score the test split: ({column suffix: Score} (None: the column
        itself), details); `seed` orders the batches of cached features (`train_cached`)."""
        raise NotImplementedError


# --- the labelled images ------------------------------------------------------------------------------


def label_subset(
    labels: torch.Tensor, fraction: float, seed: int, classes: list[int] | None = None
) -> torch.Tensor:
    """The labelled training samples a label fraction keeps: (n,) sorted indices into `labels` (N,).

    Class-balanced: each class (of `classes`, else every label present; -1 is unlabelled) keeps
    max(1, round(fraction x its count)) of its samples, drawn without replacement from `seed` (the
    suite's). Each class's draw is one permutation whatever the fraction, so one seed's subsets are
    nested: the 1% lies inside the 10%.
    """
    wanted = torch.unique(labels[labels >= 0]).tolist() if classes is None else sorted(set(classes))
    return draw_per_class(labels, wanted, seed, lambda n: max(1, round(fraction * n))).sort().values


def selection_split(labels: torch.Tensor, fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Labelled images (N,) -> (train, select): sorted positions into `labels` to train on and to hold out
    for choosing among a protocol's candidates.

    Class-balanced: each class of c images holds out min(c - 1, max(1, round(fraction x c))) of them, so
    every class keeps at least one image to train on (a class of one image holds none out). Drawn from
    `seed` (the suite's: every checkpoint is selected on the same images), one permutation per class.
    """
    classes = torch.unique(labels).tolist()
    select = (
        draw_per_class(labels, classes, seed, lambda n: min(n - 1, max(1, round(fraction * n)))).sort().values
    )
    train = torch.ones(len(labels), dtype=torch.bool)
    train[select] = False
    return torch.nonzero(train).flatten(), select


def training_set(
    protocol: TrainedProtocol, features: FeatureCache, fraction: float, seed: int
) -> TrainingSet:
    """What one label fraction of a trained protocol trains on and chooses on.

    The selection images come out of the fraction's labelled images (`selection_split`), so a 1% column
    never sees more than 1% of the labels, unless the data block gives `val_urls`: then the whole val
    split (of `classes`) is the selection set. `labels` counts every labelled image used, selection
    images included; `labels_per_class` is that over the classes (the x of its point in the pictures).
    A segmentation trains on fractions of all the images, whatever their image labels."""
    labels, keys = features.index("train")
    if protocol.TARGET == "mask":  # one class, as far as the balance goes
        labels = torch.zeros_like(labels)
        chosen = label_subset(labels, fraction, seed)
    else:
        chosen = label_subset(labels, fraction, seed, protocol.classes)
    if not len(chosen):
        raise UserError(
            f"protocol {protocol.name!r}: train_urls hold no labelled image of its classes "
            f"({protocol.classes or 'any'}): give classes the training images have"
        )
    several = len(protocol.candidates()) > 1
    selection, used = None, {}
    if several and features.datamodule.val_urls is not None:
        images = int(class_mask(features.labels("val"), protocol.classes).sum())
        selection, used = Selection("val", None), {"selected_on": "val_urls", "selection_images": images}
    elif several:
        kept, held = selection_split(labels[chosen], protocol.select_fraction, seed)
        held, chosen = chosen[held], chosen[kept]
        if len(held) == 0:
            raise UserError(
                f"protocol {protocol.name!r}: {fraction:g} of the labels leaves one image per class, none "
                f"to choose among its {len(protocol.candidates())} candidates on: give one candidate, a "
                "larger label fraction, or val_urls in the data block"
            )
        selection = Selection("train", [keys[i] for i in held.tolist()])
        used = {"selected_on": "train_urls (held out)", "selection_images": len(held)}
    classes = len(labels[chosen].unique())
    held_out = used.get("selection_images", 0)
    used = {
        "fraction": fraction, "labels": len(chosen) + held_out,
        "labels_per_class": (len(chosen) + held_out) / max(1, classes), "training_images": len(chosen),
        **used,
    }  # fmt: skip
    whole = fraction == 1 and selection is None
    keys = None if whole else [keys[i] for i in chosen.tolist()]
    return TrainingSet(keys, selection, used, protocol.steps_for(fraction))


# --- optimizers -----------------------------------------------------------------------------------------


def optimizer(protocol: TrainedProtocol, lr: float) -> Callable[[list[dict]], Optimizer]:
    """The protocol's optimizer over a task's param groups (a group's own lr and weight decay win)."""
    if protocol.optimizer == "adamw":
        return partial(AdamW, lr=lr, betas=tuple(protocol.betas), weight_decay=protocol.weight_decay)
    if protocol.optimizer == "sgd":
        return partial(SGD, lr=lr, momentum=protocol.momentum, weight_decay=protocol.weight_decay)
    # LARS (You et al. 2017; MAE's linear probe, appendix A.2) is timm's. `always_adapt`: MAE's scales
    # every weight's step by its trust ratio, while timm's would scale only groups with weight decay,
    # and a probe has none.
    return partial(
        Lars, lr=lr, momentum=protocol.momentum, weight_decay=protocol.weight_decay, always_adapt=True
    )


def schedule(protocol: TrainedProtocol) -> SchedulerCallable:
    """The protocol's lr schedule: linear warmup, then cosine or linear decay (`WarmupDecay`)."""
    return partial(
        WarmupDecay,
        warmup_steps=protocol.warmup_steps,
        decay=protocol.decay,
        min_lr_ratio=protocol.min_lr_ratio,
    )


def task_training(protocol: TrainedProtocol, lr: float, features: FeatureCache) -> Training:
    """The `training` of a task the protocol trains: its optimizer at `lr`, its schedule and the data's
    normalisation, from a scratch backbone (the scored backbone's weights come next:
    `start_from_scored_backbone`)."""
    return Training(
        optimizer=optimizer(protocol, lr), lr_scheduler=schedule(protocol), **features.normalisation()
    )


# --- training ---------------------------------------------------------------------------------------------


class _Curve:
    """Training losses at about CURVE_POINTS evenly spaced steps of `total` (all of them when unknown)."""

    def __init__(self, total: int | None) -> None:
        self.every = max(1, (total or CURVE_POINTS) // CURVE_POINTS)
        self.points: list[list[float]] = []

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def add(self, step: int, loss: float | list[float]) -> None:
        """One step's loss, or each head's."""
        self.points.append([step, round(loss, 5) if isinstance(loss, float) else [round(x, 5) for x in loss]])


def levelling(points: list[list[float]]) -> dict:
    """What results.json keeps of one model's loss curve ([step, loss] points): the points, and when
    there are ten or more, the relative change of the mean loss from the second-to-last fifth of them
    to the last (under a decaying lr a loss still falling there by STILL_FALLING or more wanted more
    steps)."""
    found: dict = {"loss_curve": points}
    fifth = len(points) // 5
    if fifth >= 2:
        before, last = (
            sum(loss for _, loss in points[start : start + fifth]) / fifth
            for start in (len(points) - 2 * fifth, len(points) - fifth)
        )
        found["loss_change_last_fifth"] = round((last - before) / before, 4) if before > 0 else 0.0
    return found


def train_streamed(model, protocol: TrainedProtocol, features: FeatureCache, plan: TrainingSet) -> dict:
    """Train `model` on the dataset's train split (only the samples `plan.keys` when given) for the
    protocol's epochs or the plan's steps, through its training transform; the test split is never read
    here. Returns the optimizer steps taken, the last training loss and the loss curve."""
    import pytorch_lightning as pl

    start_from_scored_backbone(model, features)
    data = features.data
    # An epoch of a labelled subset is its images in whole batches, at least one (the stream resamples a
    # subset smaller than a batch); with `steps`, one epoch of all the steps: the stream reads the whole
    # split to find a subset's images, and an epoch per batch would start its workers and read again.
    keys, steps = plan.keys, plan.steps
    batches = steps or max(1, len(keys or ()) // protocol.batch_size)
    subset = {} if keys is None else dict(train_keys=keys)
    if keys is not None or steps:  # an epoch of its own size: the manifest's count is not needed
        subset["train_batches"] = batches
    datamodule = data_module(
        data,
        train_urls=data["train_urls"],
        classes=protocol.classes,
        **protocol.augment(),
        **subset,
        batch_size=protocol.batch_size,
    )
    # the manifests as the frozen protocols' data module read them: the same epoch size and eval view
    datamodule.manifests = features.datamodule.manifests
    if steps is None:
        length = dict(max_epochs=protocol.epochs)
    else:
        length = dict(max_epochs=-1, max_steps=steps)
    device = local_device()  # under torchrun, this rank's own GPU
    trainer = pl.Trainer(
        accelerator="gpu" if device.type == "cuda" else "auto",
        devices=[device.index] if device.type == "cuda" else 1,
        **length,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    # the steps of `epochs` of the whole split, from its manifest's count (unknown without one)
    whole = None if keys is not None or steps else features.datamodule.samples_in("train")
    if steps or keys is not None:
        total = steps or batches * protocol.epochs
    else:
        total = protocol.epochs * max(1, whole // protocol.batch_size) if whole else None
    curve = _Curve(total)
    with progress.step(f"{protocol.name}: training", total, unit="steps") as advance:
        trainer.callbacks.append(_following(advance, curve))
        with lightning_info_dropped("`Trainer.fit` stopped"):  # the end of one protocol, not the command's
            trainer.fit(model, datamodule=datamodule)
    loss = float(trainer.callback_metrics["train/loss"])
    found = {"optimizer_steps": trainer.global_step, "train_loss": loss}
    if getattr(model, "num_heads", 1) > 1:  # the logged loss is the heads' mean: no one model's curve
        return {**found, "loss_curve": curve.points}
    return {**found, **levelling(curve.points)}


def _following(advance: Callable[[int], None], curve: _Curve):
    """A Lightning callback: `advance(1)` after each training step (the progress display), and the
    step's logged `train/loss` into `curve` when due (read on the host only then)."""
    import pytorch_lightning as pl

    class Following(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            advance(1)
            step = trainer.global_step
            if curve.due(step) and "train/loss" in trainer.callback_metrics:
                curve.add(step, float(trainer.callback_metrics["train/loss"]))

    return Following()


def train_cached(
    model, protocol: TrainedProtocol, features: FeatureCache, train: Features, steps: int | None, seed: int
) -> dict:
    """`train_streamed` for a frozen-backbone probe whose training transform is `eval` (`ProbeProtocol`):
    its heads train on the cached features `train` (pooled or token features and their labels or masks)
    instead of a forward pass per step, for `steps` (None: the protocol's epochs), in an order drawn from
    `seed`. Same optimizer, schedule, batch size and epochs (an epoch: the training images in whole
    batches, at least one batch). Hand-written: a Lightning Trainer would add a DataLoader and device
    handling around a few hundred steps on tensors already in memory."""
    start_from_scored_backbone(model, features)
    device = local_device()
    model.to(device).train()
    targets = protocol.targets(train)
    size, count = protocol.batch_size, len(train.y)
    steps = steps or protocol.epochs * max(1, count // size)
    generator = torch.Generator().manual_seed(seed)
    # Consecutive shuffles of the training images, cut into batches (a set smaller than a batch repeats).
    order = torch.cat([torch.randperm(count, generator=generator) for _ in range(-(-steps * size // count))])
    optim = optimizer(protocol, protocol.lrs[0])(model.param_groups())  # each head's group has its lr
    scheduler = schedule(protocol)(optim, steps)
    curve = _Curve(steps)
    with progress.step(f"{protocol.name}: training", steps, unit="steps") as advance:
        for step in range(1, steps + 1):
            batch = order[(step - 1) * size : step * size]
            losses = model.head_losses(model.classify(train.x[batch].to(device)), targets[batch].to(device))
            optim.zero_grad(set_to_none=True)
            losses.sum().backward()
            optim.step()
            scheduler.step()
            if curve.due(step):
                curve.add(step, losses.tolist())
            advance(1)
    # every head's: `for_head` keeps the chosen head's
    return {"optimizer_steps": steps, "train_loss": losses.tolist(), "loss_curve": curve.points}


def for_head(found: dict, head: int) -> dict:
    """`train_cached`'s record of its heads -> that of head `head` (the chosen candidate): its last loss,
    its loss curve and whether that levelled off."""
    points = [[step, losses[head]] for step, losses in found["loss_curve"]]
    return {**found, "train_loss": found["train_loss"][head], **levelling(points)}


def start_from_scored_backbone(model, features: FeatureCache) -> None:
    """Start from the very backbone the frozen protocols scored: for `scratch`, the task's own random
    draw would otherwise differ from theirs, and paired differences would compare two backbones."""
    model.backbone.load_state_dict(features.backbone.state_dict())
