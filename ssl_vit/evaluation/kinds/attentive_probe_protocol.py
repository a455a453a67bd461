"""`kind: attentive_probe`: learned queries cross-attend over a frozen backbone's tokens, a linear head
classifies them (AIM's attentive probe, `ssl_vit.tasks.AttentiveProbe`), one probe per (lr, weight
decay) of a grid, trained in one pass and chosen on held-out training images, as CAPI chooses among
its 10 x 3 grid on 10% of the training set."""

from __future__ import annotations

from itertools import product
from typing import Annotated, ClassVar

from pydantic import Field
from pydantic.dataclasses import dataclass

from ssl_vit.errors import UserError
from ssl_vit.evaluation.kinds.probe_protocol import ProbeProtocol
from ssl_vit.evaluation.protocol import STRICT, NonNegative, Positive, PositiveInt, check_unique, register
from ssl_vit.evaluation.trained import OptimizerName, task_training
from ssl_vit.models.vit import parse_variant
from ssl_vit.tasks.attentive_probe import AttentiveProbe, TokenFeature


@register
@dataclass(config=STRICT)
class AttentiveProbeProtocol(ProbeProtocol):
    """One attentive probe per pair of `lrs` x `weight_decays`, on the frozen `tokens` (every output
    token) or `patches`."""

    feature: TokenFeature = "tokens"
    optimizer: OptimizerName = "adamw"
    lrs: Annotated[list[Positive], Field(min_length=1)] = Field(
        default_factory=lambda: [1e-4, 3e-4, 1e-3, 3e-3]
    )
    weight_decays: Annotated[list[NonNegative], Field(min_length=1)] = Field(
        default_factory=lambda: [1e-4, 1e-2]
    )
    queries: PositiveInt = 1  # learned queries, their outputs averaged (AIM: 1)
    heads: PositiveInt = 8  # attention heads; the backbone's width must divide by them

    KIND: ClassVar[str] = "attentive_probe"
    TITLE: ClassVar[str] = "attentive probe"

    def grid(self) -> list[tuple[float, float]]:
        """(lr, weight decay) of every probe, lr-major."""
        return list(product(self.lrs, self.weight_decays))

    def candidates(self) -> list[str]:
        return [f"lr{lr:g}_wd{wd:g}" for lr, wd in self.grid()]

    def grid_axes(self) -> dict[str, list[float]]:
        return {"lr": [lr for lr, _ in self.grid()], "weight_decay": [wd for _, wd in self.grid()]}

    def settle(self, data, backbone, where) -> None:
        width = backbone.width or parse_variant(backbone.variant).dims[0]
        if width % self.heads:
            raise UserError(
                f"{where}: heads {self.heads} does not divide the backbone's width {width}: give a divisor "
                "of it"
            )
        if self.weight_decay:
            raise UserError(
                f"{where}: weight_decay is one value; an attentive probe takes a grid: weight_decays: "
                f"[{self.weight_decay:g}]"
            )
        super().settle(data, backbone, where)
        check_unique(self.weight_decays, "weight_decays", where)

    def build(self, features, config):
        grid = self.grid()
        return AttentiveProbe(
            backbone=config,
            num_classes=features.num_classes(),
            feature=self.feature,
            queries=self.queries,
            heads=self.heads,
            lrs=[lr for lr, _ in grid],
            weight_decays=[wd for _, wd in grid],
            training=task_training(self, grid[0][0], features),
        )
