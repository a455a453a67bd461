"""What a protocol kind is: its keys, checked when a suite loads, and its run, in one class.

A kind is a pydantic dataclass deriving from `Protocol` (or `TrainedProtocol`), decorated with
`@register`; its module lives in `ssl_vit.evaluation.kinds`. Its fields are the suite keys it takes
(typed: a key it does not have, a value of the wrong type, out of range or not among the choices is one
line naming the key, before anything runs), `settle` checks what types cannot, and `run` evaluates one
checkpoint: per result column a `stats.Score` (per-test-image statistics and the metric they make) and
what results.json records. Intervals, paired differences, verdicts, tables and plots read every kind
through those alone, so a new kind is its keys and its run, in its own module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, ClassVar, NamedTuple

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass

from ssl_vit.data.format.members import MAX_CLASSES
from ssl_vit.errors import UserError
from ssl_vit.evaluation.stats import ACCURACY, Metric, Score
from ssl_vit.models.feature import FEATURES
from ssl_vit.models.vit import FeatureKind
from ssl_vit.registry import Registry

if TYPE_CHECKING:
    from ssl_vit.evaluation.cache import FeatureCache
    from ssl_vit.models.vit import ViTConfig

# Strict: a string is never read as a number, nor a number as a flag (`epochs: true`).
STRICT = ConfigDict(strict=True)
PositiveInt = Annotated[int, Field(gt=0)]
Positive = Annotated[float, Field(gt=0)]
NonNegative = Annotated[float, Field(ge=0)]
Fraction = Annotated[float, Field(gt=0, le=1)]
Momentum = Annotated[float, Field(ge=0, lt=1)]
Seed = Annotated[int, Field(ge=0, lt=2**32)]  # torch's and numpy's generators take these


class Outcome(NamedTuple):
    """What a protocol's run gives for one checkpoint."""

    scores: dict[str, Score]  # result column -> per-test-image statistics (R = 1) and their metric
    details: dict[str, Any]  # protocol name (a trained protocol: each column) -> what results.json records


@dataclass(config=STRICT)
class Protocol:
    """What every kind has; the kinds add their own keys (`ssl_vit.evaluation.kinds`)."""

    name: str
    kind: str
    dataset: str | None = None  # a key of the suite's datasets; None: the first
    feature: FeatureKind = "cls"
    classes: list[Annotated[int, Field(ge=0, lt=MAX_CLASSES)]] | None = None  # train and test on these only

    KIND: ClassVar[str] = ""  # the `kind:` value that selects the class (`register`)
    TITLE: ClassVar[str] = ""  # the kind in words, as verdicts name it ("few-shot")
    TARGET: ClassVar[str] = "label"  # what it is scored on: image labels, or a segmentation's `mask`
    # why a column of it has no number (`stats.scored`)
    NOTHING_TO_SCORE: ClassVar[str] = "no labelled test image (of its classes) to score"

    def columns(self) -> list[str]:
        """Its result columns, in the order the report shows them."""
        return [self.name]

    def headline(self) -> str:
        """The one column that stands for it where a picture has room for one."""
        return self.name

    def metric(self, column: str) -> Metric:
        """What the number of `column` is."""
        return ACCURACY

    def fractions(self) -> list[float]:
        """The label fractions it trains on, one column each (none: a frozen-feature protocol)."""
        return []

    def support_draws(self) -> tuple:
        """The support draws its results are scored on (a few-shot protocol's seeds; one for the
        others): two columns pair only when these, the dataset and the classes agree."""
        return (None,)

    def cache_kinds(self) -> tuple[str, ...]:
        """The frozen features it reads from the dataset's one pass per split (`FeatureCache`)."""
        return (self.feature,)

    def describe(self, column: str) -> str:
        """`fewshot_mean_5shot (few-shot, mean patch token)`: a column and what it rests on."""
        classes = f", classes {_classes(self.classes)}" if self.classes else ""
        return f"{column} ({self.TITLE}, {FEATURES[self.feature].words}{classes})"

    def needs_epoch_size(self) -> bool:
        """Whether it trains for epochs of the whole train split, whose size only a manifest knows."""
        return False

    def settle(self, data: dict[str, Any], backbone: ViTConfig, where: str) -> None:
        """Fill the defaults that depend on other keys, on the dataset block `data` or on the suite's
        `backbone`; refuse combinations that cannot run (one-line UserError, `where` first)."""

    def run(self, features: FeatureCache, config: ViTConfig, seed: int, where: str) -> Outcome:
        """Evaluate the checkpoint whose frozen features (and backbone, `features.backbone`) `features`
        holds on the suite's dataset; `config`: its architecture at the dataset's image size. `seed`:
        the suite's, the same for every checkpoint (label subsets, held-out images, the order of cached
        batches), so paired differences stay paired; `where` names the protocol in a one-line error."""
        raise NotImplementedError


PROTOCOLS = Registry("protocol kind", key="KIND")  # KIND -> its class
register = PROTOCOLS.add  # class decorator: `kind: cls.KIND` in a suite selects `cls`


def check_unique(values: list, what: str, where: str) -> None:
    """One line when a grid repeats a value (`lrs`, `weight_decays`): each value is one candidate."""
    if len(set(values)) != len(values):
        raise UserError(f"{where}: {what} {values} repeat a value: each is one candidate")


def _classes(classes: list[int]) -> str:
    ordered = sorted(classes)
    if ordered == list(range(ordered[0], ordered[-1] + 1)) and len(ordered) > 2:
        return f"{ordered[0]}-{ordered[-1]}"
    return ", ".join(str(c) for c in ordered)
