"""`kind: linear_probe`: linear heads on one frozen pooled feature, one per learning rate
(`ssl_vit.tasks.LinearProbe`; the ViT paper's linear evaluation, MAE's protocol with LARS and a
BatchNorm)."""

from __future__ import annotations

from typing import ClassVar

from pydantic.dataclasses import dataclass

from ssl_vit.evaluation.kinds.probe_protocol import ProbeProtocol
from ssl_vit.evaluation.protocol import STRICT, register
from ssl_vit.evaluation.trained import task_training
from ssl_vit.tasks import LinearProbe


@register
@dataclass(config=STRICT)
class LinearProbeProtocol(ProbeProtocol):
    """Linear heads on the frozen `cls` or `mean` feature."""

    batch_norm: bool = True

    KIND: ClassVar[str] = "linear_probe"
    TITLE: ClassVar[str] = "linear probe"

    def cache_kinds(self) -> tuple[str, ...]:
        return (self.feature,)  # a pooled feature costs little: cached even when the heads stream

    def scored_kind(self) -> str | None:
        return self.feature  # the frozen backbone's eval-transform features: the cache holds them

    def build(self, features, config):
        return LinearProbe(
            backbone=config,
            num_classes=features.num_classes(),
            feature=self.feature,
            lrs=list(self.lrs),
            batch_norm=self.batch_norm,
            # each head's lr is its own param group's (FrozenProbe.param_groups)
            training=task_training(self, self.lrs[0], features),
        )
