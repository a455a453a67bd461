"""The protocols a suite runs, one function per kind: (protocol, features, ...) -> (scores, details,
correct), `correct` mapping each score's column to which test images were classified correctly,
(S, M) bool for S few-shot seeds (S = 1 for the other kinds) and M test images in key order, the same
images for every checkpoint: what `stats` resamples for intervals and paired differences; `details`
maps the protocol's name (a trained protocol's: each of its columns) to what results.json records.

Frozen-feature protocols (few-shot, k-NN) share one exact pass per split, which yields every feature
kind the suite reads; trained protocols (linear probe, fine-tuning) run the Lightning tasks on the
suite's data, once per label fraction (`label_subset`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from timm.optim import Lars
from torch.optim import SGD, AdamW, Optimizer

from ssl_vit.evaluation.features import Features, extract_feature_set, local_device
from ssl_vit.evaluation.fewshot import fewshot_correct
from ssl_vit.evaluation.knn import knn_correct
from ssl_vit.tasks.optim import SchedulerCallable, WarmupDecay

# ShardDataModule arguments a suite's `data` may set (the rest are the protocols' business).
DATA_KEYS = ("image_size", "batch_size", "num_workers", "mean", "std", "eval_crop_pct", "num_classes", "seed")


class FeatureCache:
    """Frozen features of the suite's train and test splits: every kind the suite reads from one pass
    over each split (`extract_feature_set`), made the first time a split is asked for."""

    def __init__(self, backbone, data: dict[str, Any], kinds: tuple[str, ...]) -> None:
        from ssl_vit.data import ShardDataModule

        self.backbone = backbone
        self.kinds = tuple(kinds)
        self.datamodule = ShardDataModule(
            train_urls=data["train_urls"],
            test_urls=data["test_urls"],
            **{k: v for k, v in data.items() if k in DATA_KEYS},
        )
        self._cache: dict[str, dict[str, Features]] = {}

    def get(self, split: str, feature: str) -> Features:
        if feature not in self.kinds:
            raise ValueError(f"feature {feature!r} is not among this cache's kinds {self.kinds}")
        if split not in self._cache:
            loader = self.datamodule.exact_dataloader(split)
            self._cache[split] = extract_feature_set(
                self.backbone, loader, self.kinds, prepare=self.datamodule.prepare_batch
            )
        return self._cache[split][feature]

    def labels(self, split: str) -> torch.Tensor:
        """Labels of a split: they do not depend on the feature, so the split's one pass serves."""
        return self.get(split, self.kinds[0]).y

    def num_classes(self) -> int:
        return self.datamodule.num_classes or int(self.labels("train").max()) + 1


def _restrict(features: Features, classes: list[int] | None) -> Features:
    if classes is None:
        return features
    keep = torch.isin(features.y, torch.tensor(classes))
    return Features(
        features.x[keep], features.y[keep], [k for k, m in zip(features.keys, keep.tolist()) if m]
    )


def fewshot(protocol, features: FeatureCache, source, config, suite) -> tuple[dict, dict, dict]:
    train, test = features.get("train", protocol.feature), features.get("test", protocol.feature)
    correct = fewshot_correct(
        train.x,
        train.y,
        test.x,
        test.y,
        shots=tuple(protocol.shots),
        seeds=tuple(protocol.seeds),
        ridge=protocol.ridge,
        classes=protocol.classes,
    )
    correct = {f"{protocol.name}_{shots}shot": hits for shots, hits in correct.items()}
    detail = {"test_samples": next(iter(correct.values())).shape[1]}
    return _scores(correct), {protocol.name: detail}, correct


def knn(protocol, features: FeatureCache, source, config, suite) -> tuple[dict, dict, dict]:
    train = _restrict(features.get("train", protocol.feature), protocol.classes)
    test = _restrict(features.get("test", protocol.feature), protocol.classes)
    hits = knn_correct(train.x, train.y, test.x, test.y, k=protocol.k, temperature=protocol.temperature)
    correct = {protocol.name: hits[None]}
    detail = {"train_samples": len(train.y), "test_samples": len(test.y)}
    return _scores(correct), {protocol.name: detail}, correct


def _scores(correct: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each column's accuracy: the mean over seeds and images of its (S, M) correctness."""
    return {column: hits.double().mean().item() for column, hits in correct.items()}


def label_subset(
    labels: torch.Tensor, fraction: float, seed: int, classes: list[int] | None = None
) -> torch.Tensor:
    """The labelled training samples a label fraction keeps: (n,) sorted indices into `labels` (N,).

    Class-balanced: each class (of `classes`, else every label present; -1 is unlabelled) keeps
    max(1, round(fraction x its count)) of its samples, drawn without replacement from `seed` (the
    suite's, so every checkpoint trains on the same images and paired differences stay paired). Each
    class's draw is one permutation whatever the fraction, so one seed's subsets are nested: the 1% lies
    inside the 10%.
    """
    generator = torch.Generator().manual_seed(seed)
    wanted = torch.unique(labels[labels >= 0]) if classes is None else sorted(set(classes))
    chosen = []
    for c in [int(c) for c in wanted]:
        members = torch.nonzero(labels == c).flatten()
        keep = max(1, round(fraction * len(members)))
        chosen.append(members[torch.randperm(len(members), generator=generator)[:keep]])
    return torch.cat(chosen).sort().values


def linear_probe(protocol, features: FeatureCache, source, config, suite) -> tuple[dict, dict, dict]:
    from ssl_vit.tasks import LinearProbe

    test = _restrict(features.get("test", protocol.feature), protocol.classes)

    def build() -> LinearProbe:
        return LinearProbe(
            backbone=config,
            init_from=source,
            num_classes=features.num_classes(),
            feature=protocol.feature,
            lrs=list(protocol.lrs),
            batch_norm=protocol.batch_norm,
            # each head's lr is its own param group's (LinearProbe.param_groups)
            optimizer=optimizer(protocol, protocol.lrs[0]),
            lr_scheduler=schedule(protocol),
        )

    def score(model: LinearProbe, metrics: dict) -> tuple[torch.Tensor, dict]:
        # The best head (on the validation pass, as val/accuracy) scores the cached test features: the
        # probe's frozen backbone is the one they came from (see _train), so no second pass is needed.
        head = min(range(len(model.lrs)), key=lambda i: abs(model.lrs[i] - metrics["val/best_lr"]))
        model.eval()
        with torch.no_grad():
            logits = model.classify(test.x.to(model.device))[head]
        return logits.argmax(1).cpu() == test.y, {"best_lr": metrics.get("val/best_lr")}

    return _per_label_fraction(protocol, features, suite, build, score)


def finetune(protocol, features: FeatureCache, source, config, suite) -> tuple[dict, dict, dict]:
    from ssl_vit.tasks import FineTune

    def build() -> FineTune:
        return FineTune(
            backbone=config,
            init_from=source,
            num_classes=features.num_classes(),
            feature=protocol.feature,
            layer_decay=protocol.layer_decay,
            optimizer=optimizer(protocol, protocol.lr),
            lr_scheduler=schedule(protocol),
        )

    def score(model: FineTune, metrics: dict) -> tuple[torch.Tensor, dict]:
        return _correct(model, features, protocol.classes), {}

    return _per_label_fraction(protocol, features, suite, build, score)


def _per_label_fraction(protocol, features: FeatureCache, suite, build, score) -> tuple[dict, dict, dict]:
    """A trained protocol's columns: for each label fraction, a fresh task from `build()` trained on
    that fraction's samples, then `score(task, metrics)` -> ((M,) bool correct test images, details)."""
    details, correct = {}, {}
    for fraction in protocol.label_fractions:
        column = protocol.column(fraction)
        keys, used = _training_set(protocol, features, fraction, suite.seed)
        model = build()
        metrics = _train(model, protocol, suite, features, keys)
        hits, extra = score(model, metrics)
        correct[column] = hits[None]
        details[column] = {**used, **extra, **metrics}
    return _scores(correct), details, correct


def optimizer(protocol, lr: float) -> Callable[[list[dict]], Optimizer]:
    """The protocol's optimizer over a task's param groups (a group's own lr wins over `lr`)."""
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


def schedule(protocol) -> SchedulerCallable:
    """The protocol's lr schedule: linear warmup, then cosine or linear decay (`WarmupDecay`)."""
    return partial(
        WarmupDecay,
        warmup_steps=protocol.warmup_steps,
        decay=protocol.decay,
        min_lr_ratio=protocol.min_lr_ratio,
    )


def _training_set(
    protocol, features: FeatureCache, fraction: float, seed: int
) -> tuple[list[str] | None, dict]:
    """The keys of the training samples a label fraction keeps (None for all: the datamodule's own
    class filter then reads the whole split, as without fractions) and what results.json records of
    them: the fraction, the labels used and labels per class (the x of its point in the pictures)."""
    labels = features.labels("train")
    chosen = label_subset(labels, fraction, seed, protocol.classes)
    classes = len(labels[chosen].unique())
    used = {"fraction": fraction, "labels": len(chosen), "labels_per_class": len(chosen) / max(1, classes)}
    if fraction == 1:
        return None, used
    keys = features.get("train", features.kinds[0]).keys
    return [keys[i] for i in chosen.tolist()], used


def _correct(model, features: FeatureCache, classes: list[int] | None) -> torch.Tensor:
    """(M,) bool: which test images (of `classes`, in key order, as the cached features) the trained
    `model` (images (B, 3, H, W) -> logits (B, K)) classifies correctly; one pass over the test split."""
    model.eval()
    hits, labels, keys = [], [], []
    with torch.inference_mode():
        for batch in features.datamodule.exact_dataloader("test"):
            batch = features.datamodule.prepare_batch({**batch, "image": batch["image"].to(model.device)})
            hits.append((model(batch["image"]).argmax(1) == batch["label"]).cpu())
            labels.append(batch["label"].cpu())
            keys.extend(batch["key"])
    order = sorted(range(len(keys)), key=keys.__getitem__)
    hits, labels = torch.cat(hits)[order], torch.cat(labels)[order]
    return hits if classes is None else hits[torch.isin(labels, torch.tensor(classes))]


def _train(model, protocol, suite, features: FeatureCache, keys: list[str] | None) -> dict[str, float]:
    """Train `model` on the suite's train split (only the samples `keys` when given) for the protocol's
    epochs or steps, validate once on its test split; returns the validation metrics and the optimizer
    steps taken."""
    import pytorch_lightning as pl

    from ssl_vit.data import ShardDataModule

    # Start from the very backbone the frozen protocols scored: for `scratch`, the task's own random
    # draw would otherwise differ from theirs, and paired differences would compare two backbones.
    model.backbone.load_state_dict(features.backbone.state_dict())

    data = suite.datasets[protocol.dataset]
    # A labelled subset smaller than a batch still trains one batch per epoch: the stream resamples it.
    subset = (
        {} if keys is None else dict(train_keys=keys, train_batches=max(1, len(keys) // protocol.batch_size))
    )
    datamodule = ShardDataModule(
        train_urls=data["train_urls"],
        val_urls=data["test_urls"],
        classes=protocol.classes,
        **protocol.augment(),
        **subset,
        **{k: v for k, v in data.items() if k in DATA_KEYS and k != "batch_size"},
        batch_size=protocol.batch_size,
    )
    # One validation pass, after the last step: the metrics reported are that pass's, and passes
    # before it would change nothing but the time taken.
    if protocol.steps is None:
        length = dict(max_epochs=protocol.epochs, check_val_every_n_epoch=protocol.epochs)
    else:
        length = dict(
            max_epochs=-1,
            max_steps=protocol.steps,
            check_val_every_n_epoch=None,
            val_check_interval=protocol.steps,
        )
    device = local_device()  # under torchrun, this rank's own GPU
    trainer = pl.Trainer(
        accelerator="gpu" if device.type == "cuda" else "auto",
        devices=[device.index] if device.type == "cuda" else 1,
        **length,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, datamodule=datamodule)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
    return {"optimizer_steps": trainer.global_step, **metrics}
