"""`kind: fewshot`: the ViT paper's few-shot linear evaluation (big_vision: closed-form ridge
regression from frozen features to {-1, 1}^K, lambda 1024), per shot count and support draw."""

from __future__ import annotations

from typing import Annotated, ClassVar

from pydantic import Field
from pydantic.dataclasses import dataclass

from ssl_vit.errors import NoUsableData
from ssl_vit.evaluation.fewshot import fewshot_correct
from ssl_vit.evaluation.protocol import STRICT, Outcome, Positive, PositiveInt, Protocol, Seed, register
from ssl_vit.evaluation.scoring import restrict
from ssl_vit.evaluation.stats import Score


@register
@dataclass(config=STRICT)
class FewShotProtocol(Protocol):
    """Ridge regression on `shots` labelled images per class, drawn once per seed of `seeds`."""

    shots: Annotated[list[PositiveInt], Field(min_length=1)] = Field(default_factory=lambda: [1, 5, 10, 25])
    seeds: Annotated[list[Seed], Field(min_length=1)] = Field(default_factory=lambda: [0, 1, 2])
    ridge: Positive = 1024.0

    KIND: ClassVar[str] = "fewshot"
    TITLE: ClassVar[str] = "few-shot"

    def columns(self) -> list[str]:
        return [f"{self.name}_{s}shot" for s in self.shots]

    def headline(self) -> str:
        return f"{self.name}_{max(self.shots)}shot"

    def support_draws(self) -> tuple:
        return tuple(self.seeds)

    def run(self, features, config, seed, where) -> Outcome:
        train = restrict(features.get("train", self.feature), self.classes)
        test = restrict(features.get("test", self.feature), self.classes)
        try:
            correct = fewshot_correct(
                train.x, train.y, test.x, test.y,
                shots=tuple(self.shots), seeds=tuple(self.seeds), ridge=self.ridge, classes=self.classes,
            )  # fmt: skip
        except ValueError as err:  # too few images of a class for a shot count: the data's, not the model's
            raise NoUsableData(f"{where}: {err}") from None
        scores = {f"{self.name}_{shots}shot": Score.of_correct(hits) for shots, hits in correct.items()}
        detail = {"test_samples": next(iter(correct.values())).shape[1]}
        return Outcome(scores, {self.name: detail})
