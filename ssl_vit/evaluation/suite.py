"""Evaluation suites: a YAML file naming the data and the protocols, run on one checkpoint.

```yaml
backbone: {variant: S/4, img_size: 32, width: 64, depth: 4, heads: 4}  # for `scratch` and plain weights
data:                      # ShardDataModule arguments; train = probe/support set, test = evaluation set
  train_urls: data/shards/digits/train-{000000..000004}.tar
  test_urls: data/shards/digits/val-{000000..000003}.tar
  image_size: 32
# or several datasets by name (`datasets: {cifar10: {...}, pets: {...}}`), each protocol naming its
# `dataset:` (default: the first)
resamples: 1000           # bootstrap resamples of every interval (drawn from `seed`)
protocols:
  - {name: fewshot, kind: fewshot, shots: [1, 5, 10, 25], seeds: [0, 1, 2]}
  - {name: fewshot_heldout, kind: fewshot, classes: [5, 6, 7, 8, 9]}
  - {name: knn, kind: knn, k: 20}
  - {name: linear, kind: linear_probe, epochs: 10, lrs: [0.01, 0.1]}
  - {name: finetune, kind: finetune, epochs: 5, lr: 1.0e-3}
```

Every protocol is explicit and logged with its result (feature, shots, seeds, lrs...), so two
checkpoints are always compared under the same written-down protocol. Every result carries its 95%
interval (`stats`: a bootstrap over test images, and few-shot seeds), and results.json the checkpoint's
pretraining cost when the checkpoint recorded it (`ssl_vit.tasks.base.COST_KEY`).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch
import yaml

from ssl_vit.checkpoints import load_backbone
from ssl_vit.errors import UserError
from ssl_vit.evaluation.features import local_device
from ssl_vit.evaluation.protocols import DATA_KEYS
from ssl_vit.evaluation.stats import interval
from ssl_vit.models.vit import ViTConfig
from ssl_vit.tasks.base import COST_KEY

Kind = Literal["fewshot", "knn", "linear_probe", "finetune"]
KINDS = ("fewshot", "knn", "linear_probe", "finetune")


@dataclass
class Protocol:
    name: str
    kind: Kind
    dataset: str | None = None  # a key of the suite's datasets; None: the first
    feature: Literal["cls", "mean", "lastk"] = "cls"
    classes: list[int] | None = None  # restrict support and test sets to these classes
    # fewshot (ViT paper / big_vision: ridge to {-1, 1}^K, lambda 1024)
    shots: list[int] = field(default_factory=lambda: [1, 5, 10, 25])
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    ridge: float = 1024.0
    # knn (DINO's weighted vote)
    k: int = 20
    temperature: float = 0.07
    # linear_probe / finetune (trained with Lightning on the suite's data)
    epochs: int = 10
    lrs: list[float] = field(default_factory=lambda: [0.01, 0.03, 0.1, 0.3])
    lr: float = 1e-3
    batch_norm: bool = True


@dataclass
class Suite:
    backbone: ViTConfig
    datasets: dict[str, dict[str, Any]]  # name -> ShardDataModule arguments
    protocols: list[Protocol]
    path: str = ""
    seed: int = 0  # seeds scratch initialisation, the trained protocols and the bootstrap, so reruns agree
    resamples: int = 1000  # bootstrap resamples per interval

    def feature_kinds(self, dataset: str) -> tuple[str, ...]:
        """The feature kinds the protocols on `dataset` read, in suite order: one pass yields them all."""
        return tuple(dict.fromkeys(p.feature for p in self.protocols if p.dataset == dataset))

    def columns(self) -> list[str]:
        """Result columns, in the order the report shows them."""
        names = []
        for p in self.protocols:
            names += [f"{p.name}_{s}shot" for s in p.shots] if p.kind == "fewshot" else [p.name]
        return names


def load_suite(path: str | Path) -> Suite:
    """Parse and check a suite file; every problem is a one-line UserError naming the fix."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"suite {path} does not exist; see recipes/eval/ for examples")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise UserError(f"suite {path} is not valid YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(raw, dict) or "protocols" not in raw or ("data" in raw) == ("datasets" in raw):
        raise UserError(f"suite {path} needs 'protocols' and one of 'data' or 'datasets' (and 'backbone')")
    _check_keys(raw, SUITE_KEYS, f"{path}")
    backbone = ViTConfig.from_dict(raw.get("backbone") or {}, f"{path}: backbone")
    if not isinstance(raw["protocols"], list) or not raw["protocols"]:
        raise UserError(f"{path}: protocols should be a non-empty list of {{name: ..., kind: ...}} mappings")
    protocols = [_build(Protocol, p, f"{path}: protocol {i}") for i, p in enumerate(raw["protocols"])]
    for p in protocols:
        if p.kind not in KINDS:
            raise UserError(f"{path}: protocol {p.name!r} has kind {p.kind!r}; valid: {', '.join(KINDS)}")
    names = [p.name for p in protocols]
    if len(set(names)) != len(names):
        raise UserError(f"{path}: protocol names must be unique, got {names}")
    datasets = raw["datasets"] if "datasets" in raw else {"data": raw["data"]}
    if not isinstance(datasets, dict) or not datasets:
        raise UserError(
            f"{path}: datasets should map names to data blocks, e.g. {{cifar10: {{train_urls: ...}}}}"
        )
    data_keys = ("train_urls", "test_urls", *DATA_KEYS)
    for name, data in datasets.items():
        where = f"{path}: {name}" if "datasets" in raw else f"{path}: data"
        if not isinstance(data, dict):
            raise UserError(
                f"{where} is a {type(data).__name__}, not a mapping: give keys among {', '.join(data_keys)}"
            )
        _check_keys(data, data_keys, where)
        for key in ("train_urls", "test_urls"):
            if not data.get(key):
                raise UserError(f"{path}: {name}.{key} is missing (train: probe/support, test: evaluation)")
    for p in protocols:
        p.dataset = p.dataset or next(iter(datasets))
        if p.dataset not in datasets:
            valid = ", ".join(datasets)
            raise UserError(f"{path}: protocol {p.name!r} names dataset {p.dataset!r}; valid: {valid}")
    seed, resamples = raw.get("seed", 0), raw.get("resamples", 1000)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise UserError(f"{path}: seed is {seed!r}: it should be an integer")
    if not isinstance(resamples, int) or isinstance(resamples, bool) or resamples < 100:
        raise UserError(f"{path}: resamples is {resamples!r}: it should be an integer of at least 100")
    return Suite(backbone, datasets, protocols, str(path), seed, resamples)


# Top-level keys of a suite file; a data block's keys are train_urls, test_urls and protocols.DATA_KEYS.
SUITE_KEYS = ("backbone", "data", "datasets", "protocols", "seed", "resamples")


def _check_keys(values: dict, known: tuple[str, ...], where: str) -> None:
    unknown = sorted(str(k) for k in values if k not in known)
    if unknown:
        raise UserError(f"{where}: unknown keys {unknown}: valid keys are {', '.join(known)}")


def _build(cls, values: dict, where: str):
    known = tuple(f.name for f in fields(cls))
    if not isinstance(values, dict):
        raise UserError(
            f"{where} is a {type(values).__name__}, not a mapping: give keys among {', '.join(known)}"
        )
    _check_keys(values, known, where)
    try:
        return cls(**values)
    except TypeError as err:
        raise UserError(f"{where}: {err}") from None


class Evaluation(NamedTuple):
    record: dict[str, Any]  # what results.json holds
    correct: dict[str, torch.Tensor]  # column -> (S, M) bool: per seed and test image (protocols.py)


def evaluate(source: str, suite: Suite, out_dir: str | Path | None = None, replicate: int = 0) -> Evaluation:
    """Run every protocol of `suite` on the checkpoint `source`; the record (also written to
    out_dir/results.json) is {"checkpoint", "backbone", "results": {column: accuracy}, "intervals":
    {column: stats.Interval as a dict}, "cost", "protocols", ...}.

    replicate: the index of `source` among pretraining runs of one method; it offsets the seed of the
    scratch initialisation and the trained protocols, so `scratch` replicates are distinct draws.
    """
    import pytorch_lightning as pl

    from ssl_vit.evaluation import protocols as run

    start = time.time()
    pl.seed_everything(suite.seed + replicate, verbose=False)
    backbone, config = load_backbone(source, suite.backbone)
    backbone.to(local_device())
    results: dict[str, float] = {}
    details: dict[str, Any] = {}
    correct: dict[str, torch.Tensor] = {}
    features = {
        name: run.FeatureCache(backbone, data, suite.feature_kinds(name))
        for name, data in suite.datasets.items()
    }
    for protocol in suite.protocols:
        run_protocol = getattr(run, protocol.kind)
        scores, detail, hits = run_protocol(protocol, features[protocol.dataset], source, config, suite)
        results.update(scores)
        details[protocol.name] = detail
        correct.update(hits)
    record = {
        "checkpoint": source,
        "backbone": asdict(config),
        "results": results,
        "intervals": {
            column: interval(hits[None], suite.resamples, suite.seed)._asdict()
            for column, hits in correct.items()
        },
        "cost": pretraining_cost(source),
        "details": details,
        "protocols": [asdict(p) for p in suite.protocols],
        # how the eval transform framed each split (whole image or resize + centre crop), from its manifest
        "eval_view": {
            name: {split: cache.datamodule.eval_view(split) for split in ("train", "test")}
            for name, cache in features.items()
        },
        "suite": suite.path,
        "seconds": round(time.time() - start, 1),
    }
    if out_dir is not None:
        write_record(record, out_dir)
    return Evaluation(record, correct)


def write_record(record: dict[str, Any], out_dir: str | Path) -> None:
    """`evaluate`'s record as out_dir/results.json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(record, indent=2) + "\n")


def pretraining_cost(source: str) -> dict[str, float] | None:
    """What the task that trained a Lightning checkpoint counted (`BackboneTask.on_save_checkpoint`):
    {"steps", "images", "flops", "seconds"}; zeros for `scratch` (no pretraining); None when the source
    did not record it (exported weights, timm:, checkpoints saved before the count existed)."""
    if source == "scratch":
        return {"steps": 0, "images": 0, "flops": 0, "seconds": 0.0}
    path = Path(source)
    if not path.is_file() or path.suffix == ".safetensors":
        return None
    try:
        # mmap: only the small dicts are read, not the tensors (the weights loaded already).
        with torch.serialization.safe_globals([argparse.Namespace]):
            checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # a legacy (non-zip) torch file cannot be mapped; such files predate the count
        return None
    cost = checkpoint.get(COST_KEY) if isinstance(checkpoint, dict) else None
    return dict(cost) if isinstance(cost, dict) else None
