"""Evaluation suites: a YAML file naming the data and the protocols, run on one checkpoint.

```yaml
backbone: {variant: S/4, img_size: 32, width: 64, depth: 4, heads: 4}  # for `scratch` and plain weights
data:                      # ShardDataModule arguments; train = probe/support set, test = evaluation set
  train_urls: data/shards/digits/train-{000000..000004}.tar
  test_urls: data/shards/digits/val-{000000..000003}.tar
  # val_urls: ...          # optional: where an lr grid chooses (else on images held out of train)
  image_size: 32
  # channels: 13           # input bands (default 3); mean/std: one per band, or auto (from the manifest)
# or several datasets by name (`datasets: {cifar10: {...}, pets: {...}}`), each protocol naming its
# `dataset:` (default: the first)
resamples: 1000           # bootstrap resamples of every interval (drawn from `seed`)
protocols:
  - {name: fewshot, kind: fewshot, shots: [1, 5, 10, 25], seeds: [0, 1, 2]}
  - {name: fewshot_heldout, kind: fewshot, classes: [5, 6, 7, 8, 9]}
  - {name: knn, kind: knn, k: 20}
  - {name: linear, kind: linear_probe, epochs: 10, lrs: [0.01, 0.1], optimizer: lars}
  - {name: attentive, kind: attentive_probe, epochs: 10, lrs: [1.0e-4, 1.0e-3], weight_decays: [0.0, 0.01]}
  - {name: finetune, kind: finetune, epochs: 5, lrs: [1.0e-3], label_fractions: [0.01, 0.1, 1.0]}
```

Each kind (`ssl_vit.evaluation.kinds`, one module each) has its own keys, checked when the suite loads,
before anything runs (`protocol`); docs/SUITES.md lists every key. A dataset whose `image_size` differs
from the backbone's `img_size` is read with the backbone's position embeddings resampled to it
(`dataset_backbone`). The data's `channels` is the backbone's `in_chans` (`_with_bands`): `scratch` is
built with it, RGB checkpoints are adapted to it (timm's `adapt_input_conv`, said in one line) and
checkpoints of another band count refused (`ssl_vit.checkpoints.load_backbone`).

Every protocol is explicit and logged with its result (every key, defaults included, in results.json
`protocols`), so two checkpoints are always compared under the same written-down protocol. Every result
carries its 95% interval (`stats`: a bootstrap over test images, and few-shot seeds) and names its
metric (accuracy, mIoU, pixel accuracy), and results.json the checkpoint's pretraining cost when the
checkpoint recorded it (`ssl_vit.tasks.base.COST_KEY`).
"""

from __future__ import annotations

import contextlib
import copy
import json
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, NamedTuple

from pydantic import TypeAdapter, ValidationError
from pydantic.dataclasses import dataclass

from ssl_vit.analysis.attention import attention_distance
from ssl_vit.analysis.images import read_images
from ssl_vit.checkpoints.load import load_backbone, mapped_checkpoint
from ssl_vit.data.stream.urls import shard_directories
from ssl_vit.errors import UserError
from ssl_vit.evaluation.cache import FeatureCache
from ssl_vit.evaluation.features import local_device
from ssl_vit.evaluation.protocol import Protocol
from ssl_vit.evaluation.scorable import check_classes, check_classes_seen, check_scorable
from ssl_vit.evaluation.stats import Score, finite, interval, scored
from ssl_vit.evaluation.suite_file import SuiteFile, file_problem, read_yaml
from ssl_vit.models.vit import ViTConfig, parse_variant
from ssl_vit.storage.outdir import Input, Output, checkpoint_inputs
from ssl_vit.tasks.base import COST_KEY

IMAGE_SIZE = 224  # ShardDataModule's default image_size, which a data block without one is read at
SUITE_FILE = TypeAdapter(SuiteFile)


@dataclass
class Suite:
    backbone: ViTConfig
    datasets: dict[str, dict[str, Any]]  # name -> its data block (`suite_file.DataBlock`)
    protocols: list[Protocol]
    path: str = ""
    seed: int = 0  # seeds scratch initialisation, the trained protocols, label subsets and the bootstrap
    resamples: int = 1000  # bootstrap resamples per interval

    def feature_kinds(self, dataset: str) -> tuple[str, ...]:
        """The feature kinds the protocols on `dataset` read, in suite order: one pass yields them all
        (none: its protocols train on the stream, and read only labels and keys, `FeatureCache.index`)."""
        found = [kind for p in self.protocols if p.dataset == dataset for kind in p.cache_kinds()]
        return tuple(dict.fromkeys(found))

    def columns(self) -> list[str]:
        """Result columns, in the order the report shows them."""
        return [column for p in self.protocols for column in p.columns()]

    def protocol_of(self, column: str) -> Protocol:
        """The protocol whose result `column` is."""
        return next(p for p in self.protocols if column in p.columns())

    def unit(self, column: str) -> str:
        """What the number of `column` is, for an axis: `accuracy (%)`, `mIoU (%)`."""
        return f"{self.protocol_of(column).metric(column).name} (%)"


def load_suite(path: str | Path) -> Suite:
    """Parse and check a suite file (`suite_file.SuiteFile`); every problem is a one-line UserError
    naming the fix."""
    raw = read_yaml(path, "suite", "give a suite file (see recipes/eval/ for examples)")
    if not isinstance(raw, dict) or "protocols" not in raw or ("data" in raw) == ("datasets" in raw):
        raise UserError(f"suite {path} needs 'protocols' and one of 'data' or 'datasets' (and 'backbone')")
    try:
        found = SUITE_FILE.validate_python(raw)
    except ValidationError as err:
        raise UserError(f"{path}: {file_problem(err)}") from None
    datasets = found["datasets"] if "datasets" in found else {"data": found["data"]}
    backbone = found.get("backbone", ViTConfig())
    for name, data in datasets.items():
        _check_patches(data, backbone, f"{path}: {name}")
    backbone = _with_bands(backbone, datasets, raw.get("backbone") or {}, path)
    for p in found["protocols"]:
        p.dataset = p.dataset or next(iter(datasets))
        if p.dataset not in datasets:
            valid = ", ".join(datasets)
            raise UserError(f"{path}: protocol {p.name!r} names dataset {p.dataset!r}; valid: {valid}")
        p.settle(datasets[p.dataset], backbone, f"{path}: protocol {p.name!r}")
        check_classes(p, datasets[p.dataset], f"{path}: protocol {p.name!r}")
    seed, resamples = found.get("seed", 0), found.get("resamples", 1000)
    return Suite(backbone, datasets, found["protocols"], str(path), seed, resamples)


def check_inputs(checkpoints: dict[str, list[str]], suite: Suite) -> None:
    """What `evaluate` and `compare` check before evaluating anything, so that a mistake in the last
    input stops the command at once rather than after the first ones' evaluations: every checkpoint
    loads and fits the suite's backbone (`load_backbone`: it exists, is intact, its architecture matches
    or converts), every dataset's shards are there or reachable, and a trained protocol that sizes its
    epochs from a manifest has one. One line naming the row or the dataset and the fix."""
    for name, sources in checkpoints.items():
        for source in dict.fromkeys(sources):
            if source != "scratch":
                try:
                    load_backbone(source, suite.backbone)
                except UserError as err:  # a compare row's name first (`evaluate`'s names the source)
                    raise UserError(str(err) if name == source else f"{name}: {err}") from None
    for name, data in suite.datasets.items():
        _check_dataset(name, data, suite)


def _check_dataset(name: str, data: dict[str, Any], suite: Suite) -> None:
    """`check_inputs` of one dataset: its shards, and what its protocols need of their manifests."""
    from ssl_vit.data.checks import check_shard_urls, read_policy

    urls = {f"{split}_urls": data.get(f"{split}_urls") for split in ("train", "val", "test")}
    check_shard_urls(None, urls, read_policy(data))
    datamodule = FeatureCache.datamodule_of(data)
    protocols = [p for p in suite.protocols if p.dataset == name]
    dense = [p for p in protocols if p.TARGET == "mask"]
    for split in ("train", "test") if dense else ():
        manifest = datamodule.split_manifest(split)
        if manifest is not None and manifest.get("masks") is not True:
            raise UserError(
                f"{suite.path}: protocol {dense[0].name!r}: the {split} shards of {name} carry no "
                "segmentation masks (their manifest says so): give shards written by `ssl-vit data "
                "convert` from ade20k:, voc: or mosaic:"
            )
    for p in protocols:
        check_scorable(p, datamodule, name, f"{suite.path}: protocol {p.name!r}")
    sized = [p for p in protocols if p.needs_epoch_size()]
    if sized and datamodule.samples_in("train") is None:
        raise UserError(
            f"{suite.path}: protocol {sized[0].name!r}: train_urls of {name} have no manifest to size an "
            "epoch by: give the protocol steps (optimizer steps instead of epochs), or shards written by "
            "`ssl-vit data convert`"
        )


def _with_bands(backbone: ViTConfig, datasets: dict, given: dict, path: Path) -> ViTConfig:
    """The suite's backbone reading its data's bands: `in_chans` = the datasets' `channels` (3 unless
    given), which every dataset of a suite shares (a checkpoint reads one band count)."""
    bands = {name: data.get("channels", 3) for name, data in datasets.items()}
    if len(set(bands.values())) > 1:
        listed = ", ".join(f"{name} {count}" for name, count in bands.items())
        raise UserError(
            f"{path}: the datasets have different band counts ({listed}) and a checkpoint reads one: give "
            "each band count its own suite"
        )
    channels = next(iter(bands.values()))
    if "in_chans" in given and given["in_chans"] != channels:
        raise UserError(
            f"{path}: backbone in_chans {given['in_chans']} and the data's channels {channels} differ: give "
            "the data's channels (the backbone reads what the data has) and leave in_chans out"
        )
    return replace(backbone, in_chans=channels)


def _check_patches(data: dict, backbone: ViTConfig, where: str) -> None:
    """A data block's image size, which the backbone's patches must tile."""
    size = data.get("image_size", IMAGE_SIZE)
    patch = parse_variant(backbone.variant).patch_size
    if size % patch:
        raise UserError(
            f"{where}: image_size {size} is not a multiple of the backbone's patch size {patch}: give one "
            f"such as {max(patch, size // patch * patch)}"
        )


class Evaluation(NamedTuple):
    record: dict[str, Any]  # what results.json holds
    scores: dict[str, Score]  # column -> per-test-image statistics (R = 1) and their metric


def evaluate(
    source: str,
    suite: Suite,
    out_dir: str | Path | None = None,
    replicate: int = 0,
    overwrite: bool = False,
    attention_images: int = 0,
) -> Evaluation:
    """Run every protocol of `suite` on the checkpoint `source`; the record (also written to
    out_dir/results.json) is {"checkpoint", "backbone", "results": {column: accuracy}, "intervals":
    {column: stats.Interval as a dict}, "cost", "details" (per protocol, or per column of a trained
    protocol: labels used, the last validation pass...), "protocols" (every key of each), ...}.

    replicate: the index of `source` among pretraining runs of one method; it offsets the seed of the
    scratch initialisation and the trained protocols, so `scratch` replicates are distinct draws.

    attention_images: with a number, the record holds "attention_distance" too (`attention_distances`
    on that many images): `compare` draws it from the records, and loads no checkpoint a second time.

    out_dir: checked and locked before anything runs, replaced once the record is complete (`outdir.Output`).
    """
    with contextlib.ExitStack() as stack:
        if out_dir is not None:
            inputs = evaluation_inputs({source: [source]}, suite)
            output = stack.enter_context(Output(out_dir, "evaluate", inputs, overwrite))
        evaluation = _run_protocols(source, suite, replicate, attention_images)
        if out_dir is not None:
            with output.staged() as temp:
                write_record(evaluation.record, temp)
    return evaluation


def _run_protocols(source: str, suite: Suite, replicate: int, attention_images: int) -> Evaluation:
    import pytorch_lightning as pl

    start = time.time()
    pl.seed_everything(suite.seed + replicate, verbose=False)
    backbone, config = load_backbone(source, suite.backbone)
    backbone.to(local_device())
    details: dict[str, Any] = {}
    scores: dict[str, Score] = {}
    features = {
        name: FeatureCache(*dataset_backbone(backbone, config, data), data, suite.feature_kinds(name))
        for name, data in suite.datasets.items()
    }
    for protocol in suite.protocols:
        cache = features[protocol.dataset]
        where = f"{suite.path}: protocol {protocol.name!r}"
        check_classes_seen(protocol, cache, where)
        outcome = protocol.run(cache, cache.config, suite.seed, where)
        scores.update(outcome.scores)
        details.update(outcome.details)
    first = next(iter(features.values()))  # the first dataset's, which `compare`'s picture shows
    attention = attention_distances(first, attention_images) if attention_images else None
    results = {column: score.value() for column, score in scores.items()}
    record = {
        "checkpoint": source,
        "backbone": asdict(config),
        "results": results,
        "metrics": {column: score.metric.name for column, score in scores.items()},
        "intervals": {
            column: interval(score, suite.resamples, suite.seed)._asdict() for column, score in scores.items()
        },
        "cost": pretraining_cost(source),
        "details": details,
        "protocols": [asdict(p) for p in suite.protocols],
        # how the eval transform framed each split (whole image or resize + centre crop), from its manifest
        "eval_view": {name: cache.eval_views() for name, cache in features.items()},
        # the size each dataset was read at (the backbone's position embeddings resampled to it)
        "image_size": {name: cache.config.img_size for name, cache in features.items()},
        # images without a label (-1), left out of every classification protocol on their dataset
        "unlabelled": unlabelled(suite, features),
        # columns with no test item to score (null above), and why
        "unscored": {
            column: suite.protocol_of(column).NOTHING_TO_SCORE
            for column, value in results.items()
            if not scored(value)
        },
        **({"attention_distance": attention} if attention else {}),
        "suite": suite.path,
        "seconds": round(time.time() - start, 1),
    }
    return Evaluation(record, scores)


def attention_distances(cache: FeatureCache, images: int) -> dict[str, Any]:
    """The ViT paper's mean attention distance (sec 4.5) of every head of the cache's backbone, on the
    first `images` images of its dataset's test split as the protocols read them (its image size, its
    normalisation): {"images": the number read, "per_head": (L, H) pixels as nested lists}."""
    found = read_images(cache.datamodule, "test", images)[0]
    cache.backbone.eval()
    per_head = attention_distance(cache.backbone, found, batch_size=images)
    return {"images": len(found), "per_head": per_head.tolist()}


def evaluation_inputs(checkpoints: dict[str, list[str]], suite: Suite) -> list[Input]:
    """What `evaluate` or `compare` reads on this machine, which its --out must keep out of: every
    checkpoint (and its run directory), the suite file, and the directories of its local shards."""
    found = [Input(Path(suite.path), f"the suite {suite.path}")] if suite.path else []
    for source in dict.fromkeys(source for sources in checkpoints.values() for source in sources):
        found += checkpoint_inputs(source)
    for name, data in suite.datasets.items():
        for key in ("train_urls", "val_urls", "test_urls"):
            if data.get(key):
                what = f"a shard directory of the suite's {name}.{key}"
                found += [Input(folder, f"{what} ({folder})") for folder in shard_directories(data[key], key)]
    return found


def unlabelled(suite: Suite, features: dict[str, FeatureCache]) -> dict[str, dict[str, int]]:
    """Per dataset a classification protocol read, the images of each split it read without a label."""
    classified = {p.dataset for p in suite.protocols if p.TARGET == "label"}
    found = {name: cache.unlabelled() for name, cache in features.items() if name in classified}
    return {name: counts for name, counts in found.items() if counts}


def dataset_backbone(backbone, config: ViTConfig, data: dict[str, Any]) -> tuple[Any, ViTConfig]:
    """The backbone (and its config) a dataset is read with: `backbone` itself at its own image size; at
    another, a copy whose position embeddings are resampled in 2-D to that size (timm's
    `set_input_size`), e.g. a 28 px backbone on 56 px mosaics, or a 224 px one on ADE20K's 512 px."""
    size = data.get("image_size", IMAGE_SIZE)
    if size == config.img_size:
        return backbone, config
    resized = copy.deepcopy(backbone)
    resized.set_input_size(img_size=size)
    return resized, replace(config, img_size=size)


def write_record(record: dict[str, Any], out_dir: str | Path) -> None:
    """`evaluate`'s record as out_dir/results.json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(finite(record), indent=2, allow_nan=False) + "\n")


def pretraining_cost(source: str) -> dict[str, float] | None:
    """What the task that trained a Lightning checkpoint counted (`BackboneTask.on_save_checkpoint`):
    {"steps", "images", "flops", "seconds"}; zeros for `scratch` (no pretraining); None when the source
    did not record it (exported weights, timm:, checkpoints saved before the count existed)."""
    if source == "scratch":
        return {"steps": 0, "images": 0, "flops": 0, "seconds": 0.0}
    cost = (mapped_checkpoint(source) or {}).get(COST_KEY)  # mapped: the tensors are not read again
    return dict(cost) if isinstance(cost, dict) else None
