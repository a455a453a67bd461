"""The protocols a suite runs, one function per kind: (protocol, features, ...) -> (scores, details,
correct), `correct` mapping each score's column to which test images were classified correctly,
(S, M) bool for S few-shot seeds (S = 1 for the other kinds) and M test images in key order, the same
images for every checkpoint: what `stats` resamples for intervals and paired differences.

Frozen-feature protocols (few-shot, k-NN) share one exact pass per split, which yields every feature
kind the suite reads; trained protocols (linear probe, fine-tuning) run the Lightning tasks on the
suite's data.
"""

from __future__ import annotations

from typing import Any

import torch

from ssl_vit.evaluation.features import Features, extract_feature_set, local_device
from ssl_vit.evaluation.fewshot import fewshot_correct
from ssl_vit.evaluation.knn import knn_correct

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
    return _scores(correct), {"test_samples": next(iter(correct.values())).shape[1]}, correct


def knn(protocol, features: FeatureCache, source, config, suite) -> tuple[dict, dict, dict]:
    train = _restrict(features.get("train", protocol.feature), protocol.classes)
    test = _restrict(features.get("test", protocol.feature), protocol.classes)
    hits = knn_correct(train.x, train.y, test.x, test.y, k=protocol.k, temperature=protocol.temperature)
    correct = {protocol.name: hits[None]}
    return _scores(correct), {"train_samples": len(train.y), "test_samples": len(test.y)}, correct


def _scores(correct: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each column's accuracy: the mean over seeds and images of its (S, M) correctness."""
    return {column: hits.double().mean().item() for column, hits in correct.items()}


def linear_probe(protocol, features: FeatureCache, source, config, suite) -> tuple[dict, dict, dict]:
    from ssl_vit.tasks import LinearProbe

    num_classes = features.num_classes()
    model = LinearProbe(
        backbone=config,
        init_from=source,
        num_classes=num_classes,
        feature=protocol.feature,
        lrs=list(protocol.lrs),
        batch_norm=protocol.batch_norm,
        optimizer=lambda params: torch.optim.SGD(params, lr=protocol.lrs[0], momentum=0.9),
    )
    metrics = _train(model, protocol, suite, features)
    # The best head (on the last validation pass, as val/accuracy) scores the cached test features:
    # the probe's frozen backbone is the one they came from (see _train), so no second pass is needed.
    head = min(range(len(model.lrs)), key=lambda i: abs(model.lrs[i] - metrics["val/best_lr"]))
    test = _restrict(features.get("test", protocol.feature), protocol.classes)
    model.eval()
    with torch.no_grad():
        logits = model.classify(test.x.to(model.device))[head]
    correct = {protocol.name: (logits.argmax(1).cpu() == test.y)[None]}
    detail = {
        "best_lr": metrics.get("val/best_lr"),
        "labels_per_class": _labels_per_class(features),
        **metrics,
    }
    return _scores(correct), detail, correct


def finetune(protocol, features: FeatureCache, source, config, suite) -> tuple[dict, dict, dict]:
    from ssl_vit.tasks import FineTune

    model = FineTune(
        backbone=config,
        init_from=source,
        num_classes=features.num_classes(),
        optimizer=lambda params: torch.optim.AdamW(params, lr=protocol.lr, weight_decay=0.05),
    )
    metrics = _train(model, protocol, suite, features)
    correct = {protocol.name: _correct(model, features, protocol.classes)[None]}
    return (
        _scores(correct),
        {"labels_per_class": _labels_per_class(features), **metrics},
        correct,
    )


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


def _labels_per_class(features: FeatureCache) -> float:
    """How many labelled training images per class a trained protocol saw (the x of its point on the
    comparison plot)."""
    labels = features.labels("train")
    labels = labels[labels >= 0]
    return len(labels) / max(1, len(labels.unique()))


def _train(model, protocol, suite, features: FeatureCache) -> dict[str, float]:
    """Train `model` on the suite's train split for `protocol.epochs`, validate on its test split."""
    import pytorch_lightning as pl

    from ssl_vit.data import ShardDataModule

    # Start from the very backbone the frozen protocols scored: for `scratch`, the task's own random
    # draw would otherwise differ from theirs, and paired differences would compare two backbones.
    model.backbone.load_state_dict(features.backbone.state_dict())

    data = suite.datasets[protocol.dataset]
    datamodule = ShardDataModule(
        train_urls=data["train_urls"],
        val_urls=data["test_urls"],
        classes=protocol.classes,
        train_preset="pretrain",
        crop_scale=(0.6, 1.0),
        **{k: v for k, v in data.items() if k in DATA_KEYS},
    )
    device = local_device()  # under torchrun, this rank's own GPU
    trainer = pl.Trainer(
        accelerator="gpu" if device.type == "cuda" else "auto",
        devices=[device.index] if device.type == "cuda" else 1,
        max_epochs=protocol.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, datamodule=datamodule)
    return {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
