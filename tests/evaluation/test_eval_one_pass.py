"""One forward pass per split: every feature kind a suite reads comes from it, equal to separate passes."""

import json

import pytest
import torch
import yaml

from ssl_vit.data import ShardDataModule
from ssl_vit.evaluation import cache as cache_module
from ssl_vit.evaluation import suite as suite_module
from ssl_vit.evaluation.features import extract_feature_set, extract_features
from ssl_vit.evaluation.suite import evaluate, load_suite
from ssl_vit.models.vit import build_vit

BACKBONE = {"variant": "S/8", "img_size": 32, "width": 32, "depth": 4, "heads": 2}  # lastk reads 4 blocks


@pytest.mark.parametrize("pooling", ["cls", "gap"])
def test_one_pass_equals_separate_passes(digits_shards, pooling):
    torch.manual_seed(0)
    backbone = build_vit("S/8", 32, width=32, depth=3, heads=2, pooling=pooling)
    kinds = ("mean", "lastk") if pooling == "gap" else ("cls", "mean", "lastk")
    dm = ShardDataModule(val_urls=str(digits_shards / "val-00000{0..1}.tar"), image_size=32, num_workers=0)
    prepare = dm.prepare_batch
    together = extract_feature_set(backbone, dm.exact_dataloader("val"), kinds, last_k=2, prepare=prepare)
    assert list(together) == list(kinds)
    for kind in kinds:
        alone = extract_features(backbone, dm.exact_dataloader("val"), kind, last_k=2, prepare=prepare)
        assert torch.equal(together[kind].x, alone.x), kind
        assert torch.equal(together[kind].y, alone.y) and together[kind].keys == alone.keys
    with pytest.raises(ValueError, match="kinds is empty"):
        extract_feature_set(backbone, dm.exact_dataloader("val"), ())


def test_a_suite_runs_the_backbone_once_per_split(digits_shards, tmp_path, monkeypatch):
    """Few-shot on `cls`, k-NN on `mean` and few-shot on `lastk`: three kinds, and the blocks see each
    image of each split exactly once; the features the protocols read are those of separate passes."""
    seen = []  # images through the patch embedding, per forward
    backbones = []

    def load_and_count(source, config):
        backbone, config = load_backbone(source, config)
        backbone.patch_embed.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[0]))
        backbones.append(backbone)
        return backbone, config

    passes = []  # what every extraction returned

    def recording(*args, **kwargs):
        passes.append(extract_feature_set(*args, **kwargs))
        return passes[-1]

    load_backbone = suite_module.load_backbone
    monkeypatch.setattr(suite_module, "load_backbone", load_and_count)
    monkeypatch.setattr(cache_module, "extract_feature_set", recording)
    train, test = str(digits_shards / "val-00000{0..1}.tar"), str(digits_shards / "val-00000{2..3}.tar")
    data = {"train_urls": train, "test_urls": test, "image_size": 32, "batch_size": 64, "num_workers": 0}
    spec = {
        "backbone": BACKBONE,
        "data": data,
        "protocols": [
            {"name": "fs_cls", "kind": "fewshot", "feature": "cls", "shots": [1, 2], "seeds": [0]},
            {"name": "knn_mean", "kind": "knn", "feature": "mean", "k": 5},
            {"name": "fs_lastk", "kind": "fewshot", "feature": "lastk", "shots": [2], "seeds": [0]},
            {"name": "knn_cls", "kind": "knn", "feature": "cls", "k": 3},
        ],
    }
    (tmp_path / "suite.yaml").write_text(yaml.safe_dump(spec))
    record, scores = evaluate("scratch", load_suite(tmp_path / "suite.yaml"))

    samples = {
        split: json.loads((digits_shards / "val.json").read_text())["shards"][i : i + 2] for split, i in
        (("train", 0), ("test", 2))
    }  # fmt: skip
    expected = sum(shard["num_samples"] for shards in samples.values() for shard in shards)
    assert sum(seen) == expected  # each image once: one pass per split, not one per kind
    assert len(passes) == 2 and all(list(p) == ["cls", "mean", "lastk"] for p in passes)
    assert set(record["results"]) == {"fs_cls_1shot", "fs_cls_2shot", "knn_mean", "fs_lastk_2shot", "knn_cls"}
    # the one pass also yields each column's per-image statistics (1 run, S seeds, M test images, one
    # correct flag each), the intervals' input
    test_images = sum(shard["num_samples"] for shard in samples["test"])
    assert {column: tuple(score.values.shape) for column, score in scores.items()} == {
        column: (1, 1, test_images, 1) for column in record["results"]
    }
    for column, score in scores.items():
        assert score.values.mean().item() == pytest.approx(record["results"][column])

    backbone = backbones[0]
    dm = ShardDataModule(train_urls=train, test_urls=test, image_size=32, batch_size=64, num_workers=0)
    for split, found in zip(("train", "test"), passes):
        for kind, features in found.items():
            alone = extract_features(backbone, dm.exact_dataloader(split), kind, prepare=dm.prepare_batch)
            assert torch.equal(features.x, alone.x) and features.keys == alone.keys, (split, kind)
