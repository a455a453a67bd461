"""`kind: knn`: DINO's weighted k-NN vote on frozen features (Caron et al. 2021, `eval_knn.py`)."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic.dataclasses import dataclass

from ssl_vit.data.stream.urls import local
from ssl_vit.errors import UserError
from ssl_vit.evaluation.cache import data_module
from ssl_vit.evaluation.knn import knn_correct
from ssl_vit.evaluation.protocol import STRICT, Outcome, Positive, PositiveInt, Protocol, register
from ssl_vit.evaluation.scoring import restrict
from ssl_vit.evaluation.stats import Score


@register
@dataclass(config=STRICT)
class KNNProtocol(Protocol):
    """Each test image's class: the vote of its `k` nearest training images (cosine similarity), each
    weighted by exp(similarity / temperature)."""

    k: PositiveInt = 20
    temperature: Positive = 0.07

    KIND: ClassVar[str] = "knn"
    TITLE: ClassVar[str] = "k-NN"

    def settle(self, data: dict[str, Any], backbone, where: str) -> None:
        """k at most the training images it votes among, as their manifest counts them (local shards with
        a manifest): a larger k would quietly become all of them."""
        if not local(data["train_urls"]):
            return  # remote: its manifest is read once, by the evaluation (a second fetch here is not free)
        datamodule = data_module(data, train_urls=data["train_urls"], test_urls=data["test_urls"])
        try:
            images = datamodule.samples_in("train")
            manifest = datamodule.manifest or {}
        except UserError:  # shards not there (yet): the evaluation names them when it reads them
            return
        if self.classes is not None and images == manifest.get("num_samples"):  # the whole split
            counts = manifest.get("class_counts", {})
            images = sum(counts.get(str(c), 0) for c in self.classes) if counts else images
        if images is not None and self.k > images:
            raise UserError(
                f"{where}: k {self.k} is more than the {images} training images it votes among: give k of "
                f"at most {images} (DINO's is 20)"
            )

    def run(self, features, config, seed, where) -> Outcome:
        train = restrict(features.get("train", self.feature), self.classes)
        test = restrict(features.get("test", self.feature), self.classes)
        hits = knn_correct(train.x, train.y, test.x, test.y, k=self.k, temperature=self.temperature)
        detail = {"train_samples": len(train.y), "test_samples": len(test.y)}
        return Outcome({self.name: Score.of_correct(hits[None])}, {self.name: detail})
