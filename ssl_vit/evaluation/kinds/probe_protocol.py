"""What the frozen-backbone probes share (`kind: linear_probe`, `attentive_probe`, `linear_seg`): one
task whose heads are the candidates of a grid, trained on cached frozen features when the training
transform is `eval` (the backbone would see exactly the images the cache holds), else on the stream."""

from __future__ import annotations

from pydantic.dataclasses import dataclass

from ssl_vit.evaluation.protocol import STRICT
from ssl_vit.evaluation.scoring import restrict, statistics
from ssl_vit.evaluation.selection import choose
from ssl_vit.evaluation.stats import Score
from ssl_vit.evaluation.trained import TrainedProtocol, TrainingSet, for_head, train_cached, train_streamed


@dataclass(config=STRICT)
class ProbeProtocol(TrainedProtocol):
    """A grid of candidates (`lrs`, ...), one head each, on one frozen backbone."""

    def cached_kind(self) -> str | None:
        return self.feature if self.augmentation == "eval" else None

    def scored_kind(self) -> str | None:
        """The cache's feature kind its heads are scored on (the eval transform's features); None when
        the scoring passes run the frozen backbone themselves (tokens too large to cache)."""
        return self.cached_kind()

    def cache_kinds(self) -> tuple[str, ...]:
        kind = self.cached_kind()
        return () if kind is None else (kind,)

    def build(self, features, config):
        """The task: a backbone of `config` (the dataset's image size; `fit_fraction` gives it the
        scored checkpoint's weights), one head per candidate."""
        raise NotImplementedError

    def fit_fraction(
        self, plan: TrainingSet, features, config, seed: int
    ) -> tuple[dict[str | None, Score], dict]:
        model = self.build(features, config)
        kind = self.cached_kind()
        if kind is None:
            found = train_streamed(model, self, features, plan)
        else:
            train = restrict(features.get("train", kind), self.classes, plan.keys, self.TARGET == "label")
            found = train_cached(model, self, features, train, plan.steps, seed)
        head = 0
        chosen = {f"best_{axis}": values[0] for axis, values in self.grid_axes().items()}
        scored = self.scored_kind()
        if plan.selection is not None:
            selected = statistics([model], self, features, *plan.selection, cached=scored)
            head, chosen = choose(self, selected, self.selection_metric(), self.grid_axes())
        test = statistics([model], self, features, "test", None, head=head, cached=scored)
        if kind is not None:  # every head's curve: keep the chosen one's
            found = for_head(found, head)
        return self.test_scores(test), {**chosen, **found}
