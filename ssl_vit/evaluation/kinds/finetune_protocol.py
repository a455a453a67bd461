"""`kind: finetune`: the whole backbone and a new zero-initialised head trained (`ssl_vit.tasks.FineTune`),
one model per learning rate of `lrs`, chosen on held-out training images."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

import torch
from pydantic import Field
from pydantic.dataclasses import dataclass

from ssl_vit.errors import UserError
from ssl_vit.evaluation.features import local_device
from ssl_vit.evaluation.protocol import STRICT, NonNegative, Positive, register
from ssl_vit.evaluation.scoring import statistics
from ssl_vit.evaluation.selection import choose
from ssl_vit.evaluation.stats import Score
from ssl_vit.evaluation.trained import (
    OptimizerName,
    TrainedProtocol,
    TrainingSet,
    task_training,
    train_streamed,
)
from ssl_vit.tasks import FineTune


@register
@dataclass(config=STRICT)
class FineTuneProtocol(TrainedProtocol):
    """Fine-tuning: one model per lr of `lrs`, each the whole of its training."""

    optimizer: OptimizerName = "adamw"
    weight_decay: NonNegative = 0.05
    lrs: Annotated[list[Positive], Field(min_length=1)] = Field(default_factory=lambda: [1e-3])
    layer_decay: Annotated[float, Field(gt=0, le=1)] | None = None  # None or 1: off
    mixup_alpha: NonNegative = 0.0  # timm's Mixup; with cutmix, augmentation `supervised` only
    cutmix_alpha: NonNegative = 0.0
    label_smoothing: Annotated[float, Field(ge=0, lt=1)] = 0.0

    KIND: ClassVar[str] = "finetune"
    TITLE: ClassVar[str] = "fine-tuned"

    def cache_kinds(self) -> tuple[str, ...]:
        return ()  # it trains and scores on the stream

    def augment(self) -> dict[str, Any]:
        return dict(
            super().augment(),
            mixup_alpha=self.mixup_alpha,
            cutmix_alpha=self.cutmix_alpha,
            label_smoothing=self.label_smoothing,
        )

    def settle(self, data: dict[str, Any], backbone, where: str) -> None:
        super().settle(data, backbone, where)
        if (self.mixup_alpha or self.cutmix_alpha) and self.augmentation != "supervised":
            raise UserError(
                f"{where}: mixup_alpha and cutmix_alpha belong to augmentation 'supervised', not "
                f"{self.augmentation!r}"
            )

    def fit_fraction(
        self, plan: TrainingSet, features, config, seed: int
    ) -> tuple[dict[str | None, Score], dict]:
        models, found, selected = [], [], []
        for lr in self.lrs:
            model = FineTune(
                backbone=config,
                num_classes=features.num_classes(),
                feature=self.feature,
                layer_decay=self.layer_decay,
                training=task_training(self, lr, features),
            )
            found.append(train_streamed(model, self, features, plan))
            if plan.selection is not None:
                selected.append(statistics([model], self, features, *plan.selection))
            models.append(model.cpu())  # one candidate on the device at a time
        best, chosen = 0, {"best_lr": self.lrs[0]}
        if plan.selection is not None:
            best, chosen = choose(self, torch.cat(selected), self.selection_metric(), self.grid_axes())
        test = statistics([models[best].to(local_device())], self, features, "test", None)
        return self.test_scores(test), {**chosen, **found[best]}
