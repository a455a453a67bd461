"""Evaluation suites: a YAML file naming the data and the protocols, run on one checkpoint.

```yaml
backbone: {variant: S/4, img_size: 32, width: 64, depth: 4, heads: 4}  # for `scratch` and plain weights
data:                      # ShardDataModule arguments; train = probe/support set, test = evaluation set
  train_urls: data/shards/digits/train-{000000..000004}.tar
  test_urls: data/shards/digits/val-{000000..000003}.tar
  # val_urls: ...          # optional: where an lr grid chooses (else on images held out of train)
  image_size: 32
# or several datasets by name (`datasets: {cifar10: {...}, pets: {...}}`), each protocol naming its
# `dataset:` (default: the first)
resamples: 1000           # bootstrap resamples of every interval (drawn from `seed`)
protocols:
  - {name: fewshot, kind: fewshot, shots: [1, 5, 10, 25], seeds: [0, 1, 2]}
  - {name: fewshot_heldout, kind: fewshot, classes: [5, 6, 7, 8, 9]}
  - {name: knn, kind: knn, k: 20}
  - {name: linear, kind: linear_probe, epochs: 10, lrs: [0.01, 0.1], optimizer: lars}
  - {name: finetune, kind: finetune, epochs: 5, lr: 1.0e-3, label_fractions: [0.01, 0.1, 1.0]}
```

Each kind has its own keys, typed and checked when the suite loads: a key the kind does not have, a value
of the wrong type, out of range or not among the choices is one line naming the key and what it
should be, before anything runs. Every key of the trained kinds (optimizer, lr grid, schedule, epochs
or steps, batch size, augmentation, weight decay, layer decay, label fractions) has the value the
protocol used before it was a key as its default. docs/SUITES.md lists every key.

Every protocol is explicit and logged with its result (every key, defaults included, in results.json
`protocols`), so two checkpoints are always compared under the same written-down protocol. Every result
carries its 95% interval (`stats`: a bootstrap over test images, and few-shot seeds), and results.json
the checkpoint's pretraining cost when the checkpoint recorded it (`ssl_vit.tasks.base.COST_KEY`).
"""

from __future__ import annotations

import argparse
import inspect
import json
import time
from dataclasses import asdict, fields
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple, get_args

import torch
import yaml
from pydantic import ConfigDict, Field, ValidationError
from pydantic.dataclasses import dataclass
from timm.data.auto_augment import rand_augment_transform

from ssl_vit.checkpoints import load_backbone
from ssl_vit.data import ShardDataModule
from ssl_vit.data.checks import COUNT_MINIMUMS, SECONDS, check_counts, check_seconds
from ssl_vit.data.transforms import Preset
from ssl_vit.errors import UserError
from ssl_vit.evaluation.features import local_device
from ssl_vit.evaluation.protocols import DATA_KEYS
from ssl_vit.evaluation.stats import interval
from ssl_vit.models.vit import FeatureKind, ViTConfig
from ssl_vit.outdir import check_out, staged
from ssl_vit.tasks.base import COST_KEY
from ssl_vit.tasks.linear_probe import Feature

Kind = Literal["fewshot", "knn", "linear_probe", "finetune"]
KINDS = get_args(Kind)
Optimizer = Literal["sgd", "adamw", "lars"]

# Strict: a string is never read as a number, nor a number as a flag (`epochs: true`).
STRICT = ConfigDict(strict=True)
PositiveInt = Annotated[int, Field(gt=0)]
Positive = Annotated[float, Field(gt=0)]
NonNegative = Annotated[float, Field(ge=0)]
Fraction = Annotated[float, Field(gt=0, le=1)]
Momentum = Annotated[float, Field(ge=0, lt=1)]
# The batch size a protocol trains with unless it sets its own: the dataset's, else ShardDataModule's.
DATA_BATCH_SIZE = inspect.signature(ShardDataModule).parameters["batch_size"].default


@dataclass(config=STRICT)
class Protocol:
    """What every kind has; the kinds below add their own keys."""

    name: str
    kind: Kind
    dataset: str | None = None  # a key of the suite's datasets; None: the first
    feature: FeatureKind = "cls"
    classes: list[Annotated[int, Field(ge=0)]] | None = None  # restrict train and test sets to these

    def columns(self) -> list[str]:
        """Its result columns, in the order the report shows them."""
        return [self.name]

    def headline(self) -> str:
        """The one column that stands for it where a picture has room for one."""
        return self.name

    def settle(self, data: dict[str, Any], where: str) -> None:
        """Fill the defaults that depend on other keys or on the dataset block `data`; refuse
        combinations that cannot run (one-line UserError, `where` first)."""


@dataclass(config=STRICT)
class FewShotProtocol(Protocol):
    """The ViT paper's few-shot linear evaluation (big_vision: ridge to {-1, 1}^K, lambda 1024)."""

    shots: Annotated[list[PositiveInt], Field(min_length=1)] = Field(default_factory=lambda: [1, 5, 10, 25])
    seeds: Annotated[list[int], Field(min_length=1)] = Field(default_factory=lambda: [0, 1, 2])
    ridge: Positive = 1024.0

    def columns(self) -> list[str]:
        return [f"{self.name}_{s}shot" for s in self.shots]

    def headline(self) -> str:
        return f"{self.name}_{max(self.shots)}shot"


@dataclass(config=STRICT)
class KNNProtocol(Protocol):
    """DINO's weighted k-NN vote."""

    k: PositiveInt = 20
    temperature: Positive = 0.07


@dataclass(config=STRICT)
class TrainedProtocol(Protocol):
    """What linear probing and fine-tuning share: a Lightning task trained on the train split (or a
    class-balanced part of it per label fraction), scored once on the test split at the end; a protocol
    with several candidates chooses among them first, on images the test split does not hold."""

    epochs: PositiveInt | None = None  # passes over the training (sub)set; 10 unless `steps` is given
    steps: PositiveInt | None = None  # optimizer steps instead of epochs: the same for every fraction
    batch_size: PositiveInt | None = None  # None: the dataset's
    optimizer: Optimizer = "sgd"
    momentum: Momentum | None = None  # sgd and lars: 0.9 unless given
    betas: Annotated[list[Momentum], Field(min_length=2, max_length=2)] | None = None  # adamw: [0.9, 0.999]
    weight_decay: NonNegative = 0.0
    warmup_steps: Annotated[int, Field(ge=0)] = 0  # linear warmup, then `decay` (`WarmupDecay`)
    decay: Literal["cosine", "linear"] = "cosine"
    min_lr_ratio: Annotated[float, Field(ge=0, le=1)] = 0.0
    augmentation: Preset = "pretrain"  # the training transform (`build_transform`'s preset)
    crop_scale: Annotated[list[Fraction], Field(min_length=2, max_length=2)] = Field(
        default_factory=lambda: [0.6, 1.0]
    )
    randaugment: str | None = None  # timm's RandAugment string; augmentation `supervised` only
    label_fractions: Annotated[list[Fraction], Field(min_length=1)] = Field(default_factory=lambda: [1.0])

    def candidates(self) -> int:
        """How many candidates it trains and chooses among (`protocols.selection_split`)."""
        return 1

    def column(self, fraction: float) -> str:
        """The result column of one label fraction: the protocol's name for all labels, else e.g.
        `finetune_10pct`."""
        return self.name if fraction == 1 else f"{self.name}_{100 * fraction:g}pct"

    def columns(self) -> list[str]:
        return [self.column(f) for f in self.label_fractions]

    def headline(self) -> str:
        return self.column(max(self.label_fractions))

    def augment(self) -> dict[str, Any]:
        """The ShardDataModule arguments of the training transform."""
        return dict(
            train_preset=self.augmentation, crop_scale=tuple(self.crop_scale), randaugment=self.randaugment
        )

    def settle(self, data: dict[str, Any], where: str) -> None:
        if self.epochs is not None and self.steps is not None:
            raise UserError(
                f"{where}: epochs and steps are both given: keep one (steps: the same for every fraction)"
            )
        if self.steps is None and self.epochs is None:
            self.epochs = 10
        if self.batch_size is None:
            self.batch_size = data.get("batch_size", DATA_BATCH_SIZE)
        if self.feature not in get_args(Feature):
            raise UserError(
                f"{where}: feature is {self.feature!r}: a trained head reads one token, give one of "
                f"{', '.join(get_args(Feature))}"
            )
        if self.optimizer == "adamw":
            if self.momentum is not None:
                raise UserError(f"{where}: momentum is for sgd and lars; adamw takes betas")
            self.betas = self.betas or [0.9, 0.999]
        else:
            if self.betas is not None:
                raise UserError(f"{where}: betas are adamw's; {self.optimizer} takes momentum")
            self.momentum = 0.9 if self.momentum is None else self.momentum
        if self.crop_scale[0] > self.crop_scale[1]:
            raise UserError(f"{where}: crop_scale is {self.crop_scale}: give [smallest, largest] area")
        if self.randaugment is not None:
            if self.augmentation != "supervised":
                raise UserError(
                    f"{where}: randaugment is part of augmentation 'supervised', not {self.augmentation!r}"
                )
            try:
                rand_augment_transform(self.randaugment, {})
            except Exception:
                raise UserError(
                    f"{where}: randaugment is {self.randaugment!r}: give a timm RandAugment string such "
                    "as 'rand-m9-mstd0.5-inc1'"
                ) from None
        if len(set(self.label_fractions)) != len(self.label_fractions):
            raise UserError(f"{where}: label_fractions {self.label_fractions} repeat a fraction")


@dataclass(config=STRICT)
class LinearProbeProtocol(TrainedProtocol):
    """Linear heads on the frozen backbone, one per lr of the grid (`ssl_vit.tasks.LinearProbe`)."""

    lrs: Annotated[list[Positive], Field(min_length=1)] = Field(
        default_factory=lambda: [0.01, 0.03, 0.1, 0.3]
    )
    batch_norm: bool = True
    # The share of each class's labelled images held out to choose the lr on (unless val_urls is given).
    select_fraction: Annotated[float, Field(gt=0, lt=1)] = 0.1

    def candidates(self) -> int:
        return len(self.lrs)

    def settle(self, data: dict[str, Any], where: str) -> None:
        super().settle(data, where)
        if len(set(self.lrs)) != len(self.lrs):
            raise UserError(f"{where}: lrs {self.lrs} repeat a learning rate: each is one head")


@dataclass(config=STRICT)
class FineTuneProtocol(TrainedProtocol):
    """The whole backbone and a new head trained (`ssl_vit.tasks.FineTune`)."""

    optimizer: Optimizer = "adamw"
    weight_decay: NonNegative = 0.05
    lr: Positive = 1e-3
    layer_decay: Annotated[float, Field(gt=0, le=1)] | None = None  # None or 1: off
    mixup_alpha: NonNegative = 0.0  # timm's Mixup; with cutmix, augmentation `supervised` only
    cutmix_alpha: NonNegative = 0.0
    label_smoothing: Annotated[float, Field(ge=0, lt=1)] = 0.0

    def augment(self) -> dict[str, Any]:
        return dict(
            super().augment(),
            mixup_alpha=self.mixup_alpha,
            cutmix_alpha=self.cutmix_alpha,
            label_smoothing=self.label_smoothing,
        )

    def settle(self, data: dict[str, Any], where: str) -> None:
        super().settle(data, where)
        if (self.mixup_alpha or self.cutmix_alpha) and self.augmentation != "supervised":
            raise UserError(
                f"{where}: mixup_alpha and cutmix_alpha belong to augmentation 'supervised', not "
                f"{self.augmentation!r}"
            )


PROTOCOLS: dict[str, type[Protocol]] = {
    "fewshot": FewShotProtocol,
    "knn": KNNProtocol,
    "linear_probe": LinearProbeProtocol,
    "finetune": FineTuneProtocol,
}


@dataclass
class Suite:
    backbone: ViTConfig
    datasets: dict[str, dict[str, Any]]  # name -> ShardDataModule arguments
    protocols: list[Protocol]
    path: str = ""
    seed: int = 0  # seeds scratch initialisation, the trained protocols, label subsets and the bootstrap
    resamples: int = 1000  # bootstrap resamples per interval

    def feature_kinds(self, dataset: str) -> tuple[str, ...]:
        """The feature kinds the protocols on `dataset` read, in suite order: one pass yields them all."""
        return tuple(dict.fromkeys(p.feature for p in self.protocols if p.dataset == dataset))

    def columns(self) -> list[str]:
        """Result columns, in the order the report shows them."""
        return [column for p in self.protocols for column in p.columns()]


def load_suite(path: str | Path) -> Suite:
    """Parse and check a suite file; every problem is a one-line UserError naming the fix."""
    path = Path(path)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise UserError(f"suite {path} {what}; give a suite file (see recipes/eval/ for examples)")
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
    protocols = [_protocol(p, path, i) for i, p in enumerate(raw["protocols"])]
    names = [p.name for p in protocols]
    if len(set(names)) != len(names):
        raise UserError(f"{path}: protocol names must be unique, got {names}")
    datasets = raw["datasets"] if "datasets" in raw else {"data": raw["data"]}
    if not isinstance(datasets, dict) or not datasets:
        raise UserError(
            f"{path}: datasets should map names to data blocks, e.g. {{cifar10: {{train_urls: ...}}}}"
        )
    data_keys = ("train_urls", "val_urls", "test_urls", *DATA_KEYS)
    for name, data in datasets.items():
        where = f"{path}: {name}" if "datasets" in raw else f"{path}: data"
        if not isinstance(data, dict):
            raise UserError(
                f"{where} is a {type(data).__name__}, not a mapping: give keys among {', '.join(data_keys)}"
            )
        _check_keys(data, data_keys, where)
        _check_data_values(data, backbone, where)
        for key in ("train_urls", "test_urls"):
            if not data.get(key):
                raise UserError(f"{path}: {name}.{key} is missing (train: probe/support, test: evaluation)")
    for p in protocols:
        p.dataset = p.dataset or next(iter(datasets))
        if p.dataset not in datasets:
            valid = ", ".join(datasets)
            raise UserError(f"{path}: protocol {p.name!r} names dataset {p.dataset!r}; valid: {valid}")
        p.settle(datasets[p.dataset], f"{path}: protocol {p.name!r}")
        if isinstance(p, KNNProtocol):
            _check_k(p, datasets[p.dataset], f"{path}: protocol {p.name!r}")
    seed, resamples = raw.get("seed", 0), raw.get("resamples", 1000)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise UserError(f"{path}: seed is {seed!r}: it should be an integer")
    if not isinstance(resamples, int) or isinstance(resamples, bool) or resamples < 100:
        raise UserError(f"{path}: resamples is {resamples!r}: it should be an integer of at least 100")
    return Suite(backbone, datasets, protocols, str(path), seed, resamples)


def _check_k(protocol: KNNProtocol, data: dict, where: str) -> None:
    """k at most the training images it votes among, as their manifest counts them (local shards with a
    manifest): a larger k would quietly become all of them."""
    urls = data["train_urls"] if isinstance(data["train_urls"], list) else [data["train_urls"]]
    if any("://" in str(url) or str(url).startswith("pipe:") for url in urls):
        return  # remote: its manifest is read once, by the evaluation (a second fetch here is not free)
    datamodule = ShardDataModule(
        train_urls=data["train_urls"], test_urls=data["test_urls"],
        **{k: v for k, v in data.items() if k in DATA_KEYS},
    )  # fmt: skip
    try:
        images = datamodule.samples_in("train")
        manifest = datamodule.manifest or {}
    except UserError:  # shards not there (yet): the evaluation names them when it reads them
        return
    if protocol.classes is not None and images == manifest.get("num_samples"):  # the whole split
        counts = manifest.get("class_counts", {})
        images = sum(counts.get(str(c), 0) for c in protocol.classes) if counts else images
    if images is not None and protocol.k > images:
        raise UserError(
            f"{where}: k {protocol.k} is more than the {images} training images it votes among: give k of "
            f"at most {images} (DINO's is 20)"
        )


def _check_data_values(data: dict, backbone: ViTConfig, where: str) -> None:
    """A data block's counts and its image size, which the backbone must take as they are."""
    check_counts({key: value for key, value in data.items() if key in COUNT_MINIMUMS}, f"{where}: ")
    check_seconds({key: value for key, value in data.items() if key in SECONDS}, f"{where}: ")
    size = data.get("image_size", inspect.signature(ShardDataModule).parameters["image_size"].default)
    if size != backbone.img_size:
        raise UserError(
            f"{where}: image_size {size} differs from backbone img_size {backbone.img_size}: set both to the "
            "size to evaluate at (a checkpoint's position embeddings are resampled to the backbone's)"
        )


# Top-level keys of a suite file; a data block's keys are train_urls, val_urls, test_urls and
# protocols.DATA_KEYS.
SUITE_KEYS = ("backbone", "data", "datasets", "protocols", "seed", "resamples")


def _check_keys(values: dict, known: tuple[str, ...], where: str) -> None:
    unknown = sorted(str(k) for k in values if k not in known)
    if unknown:
        raise UserError(f"{where}: unknown keys {unknown}: valid keys are {', '.join(known)}")


def _protocol(values: Any, path: Path, index: int) -> Protocol:
    """The suite file's protocol number `index`, as its kind's dataclass."""
    where = f"{path}: protocol {index}"
    if not isinstance(values, dict):
        raise UserError(f"{where} is a {type(values).__name__}, not a mapping: give at least name and kind")
    if isinstance(values.get("name"), str):
        where = f"{path}: protocol {values['name']!r}"
    kind = values.get("kind")
    if kind not in KINDS:
        raise UserError(f"{where} has kind {kind!r}; valid: {', '.join(KINDS)}")
    cls = PROTOCOLS[kind]
    _check_keys(values, tuple(f.name for f in fields(cls)), f"{where} ({kind})")
    try:
        return cls(**values)
    except ValidationError as err:
        raise UserError(f"{where}: {_problem(err)}") from None


def _problem(err: ValidationError) -> str:
    """The first problem pydantic found, as `KEY is VALUE: what it should be` (`lrs[1]` in a list)."""
    first = err.errors()[0]
    key = "".join(f"[{part}]" if isinstance(part, int) else str(part) for part in first["loc"][:2])
    if first["type"] == "missing_argument":
        return f"{key} is missing"
    value, message = first["input"], first["msg"]
    text = f"{key} is {value!r}: {message[0].lower()}{message[1:]}"
    if isinstance(value, str) and _is_number(value):
        text += " (YAML reads a number without a dot, such as 1e-3, as text: write 1.0e-3)"
    return text


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


class Evaluation(NamedTuple):
    record: dict[str, Any]  # what results.json holds
    correct: dict[str, torch.Tensor]  # column -> (S, M) bool: per seed and test image (protocols.py)


def evaluate(
    source: str, suite: Suite, out_dir: str | Path | None = None, replicate: int = 0, overwrite: bool = False
) -> Evaluation:
    """Run every protocol of `suite` on the checkpoint `source`; the record (also written to
    out_dir/results.json) is {"checkpoint", "backbone", "results": {column: accuracy}, "intervals":
    {column: stats.Interval as a dict}, "cost", "details" (per protocol, or per column of a trained
    protocol: labels used, the last validation pass...), "protocols" (every key of each), ...}.

    replicate: the index of `source` among pretraining runs of one method; it offsets the seed of the
    scratch initialisation and the trained protocols, so `scratch` replicates are distinct draws.

    out_dir is checked before anything runs (`outdir.check_out`: a non-empty one only with `overwrite`)
    and replaced once the record is complete.
    """
    import pytorch_lightning as pl

    from ssl_vit.evaluation import protocols as run

    if out_dir is not None:
        check_out(out_dir, overwrite)
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
        scores, found, hits = run_protocol(protocol, features[protocol.dataset], source, config, suite)
        results.update(scores)
        details.update(found)
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
        "eval_view": {name: cache.eval_views() for name, cache in features.items()},
        "suite": suite.path,
        "seconds": round(time.time() - start, 1),
    }
    if out_dir is not None:
        with staged(out_dir) as temp:
            write_record(record, temp)
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
