"""`ShardDataModule`: WebDataset shards -> batches for Lightning, on one device or many.

    data:
      class_path: ssl_vit.data.ShardDataModule
      init_args:
        train_urls: data/shards/digits/train-{000000..000001}.tar
        val_urls: data/shards/digits/val-000000.tar
        batch_size: 64
        image_size: 32
        augment: {crop_scale: [0.6, 1.0]}

The training and exact-pass streams: `ssl_vit.data.stream.pipeline`. Batches reach the model as dicts:
`image` float32 [B,C,H,W] (C = `channels`, normalised on the device by `prepare_batch`), `label` int64
[B] (-1 where unlabelled), `key` list[str], `mask` uint8 [B,H,W] when the samples carry segmentation
masks (`seg.png`: a class index per pixel of `image`, 255 ignored; cropped, flipped and resized with the
image, nearest-neighbour; passed through untouched), `skipped` (bad samples the batch's worker dropped
since its previous batch), during training `stream` (the position of the batch's worker, which makes the
training DataLoader resumable mid-epoch: `ssl_vit.data.stream.position`), and with mixup/cutmix/label
smoothing also `target` float [B,K] (timm's soft targets, `ssl_vit.data.transforms.mixing`).

Its options come flat (the everyday ones) and in groups (`ssl_vit.data.options`: `augment`, `stream`,
`limits`). The class's other jobs are each a module of their own: the manifests and what is decided
from them (`ssl_vit.data.format.manifest`), the normalisation (`band_stats.normalisation`), the training
stream's position (`position`), the device-side mixing (`mixing`), the DataLoaders (`loaders`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from functools import cached_property
from typing import Any, Literal

import pytorch_lightning as pl
import torch
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from torch.utils.data import DataLoader

from ssl_vit.data.checks import SPLITS, STAGE_SPLITS, check_counts, check_shard_urls
from ssl_vit.data.format import manifest as manifests
from ssl_vit.data.format.band_stats import normalisation
from ssl_vit.data.format.manifest import EvalView, Manifests
from ssl_vit.data.options import DEFAULTS, GROUPS, MOVED, Augment, Limits, Stream
from ssl_vit.data.stream.device_decode import device_transform, place_jpegs
from ssl_vit.data.stream.epoch_order import SampleIndex, build_index, indexable
from ssl_vit.data.stream.identity import check_same_data, identity
from ssl_vit.data.stream.loaders import EpochLoader, ShardLoader
from ssl_vit.data.stream.pipeline import DryShards, ShardStream
from ssl_vit.data.stream.position import TrainingPosition, check_step
from ssl_vit.data.stream.urls import expand
from ssl_vit.data.transforms.bands import build_array_transform
from ssl_vit.data.transforms.mixing import Mixing
from ssl_vit.data.transforms.rgb import RANDAUGMENT_AND_MASKS, Preset, build_transform, normalize
from ssl_vit.errors import BadValue, UserError
from ssl_vit.internals import restart_fetcher

STAGE_OF = {"val": "validate", "test": "test"}  # the stage whose setup expands a split's URLs


class ShardDataModule(pl.LightningDataModule):
    """Streams WebDataset shards: training in the epoch's global order (or resampled segments of remote
    shards), exact validation/test passes.

    Args:
        train_urls, val_urls, test_urls: shard URLs (brace ranges; local paths, `file://`, `http(s)://`,
            `pipe:CMD`, fsspec URLs such as `s3://`), a string or a list.
        batch_size: samples per batch per device.
        num_workers: DataLoader worker processes per device.
        image_size: side of the square crops fed to the model.
        channels: bands of every image (C of the batches' `image`): 3 reads 8-bit images as RGB, as
            always (grey ones expanded); any other count, and 16-bit or float images, are read as
            arrays (npy, tif/tiff, 16-bit PNG; see data/README.md). A sample with another band count,
            or another dtype than its split's manifest records, is skipped and counted.
        mean, std: normalisation, one value per band, in model units (8-bit data / 255, as timm's
            IMAGENET_DEFAULT_MEAN; other dtypes as stored); `auto`: the manifest's `band_stats`
            (`ssl-vit data convert` records them, `ssl-vit data inspect --stats` adds them).
        seed: seed of every training stream: over local shards the epoch's order is a function of (seed,
            epoch, data), over remote ones each worker's stream of (seed, epoch, rank, worker).
        classes: keep only samples with these labels (labels are not renumbered).
        train_keys: keep only the training split's samples with these `__key__`s (a labelled subset,
            drawn within `classes`); the other splits are not filtered. The stream still reads every
            shard and decodes only the kept samples.
        num_classes: overrides the manifest's class count.
        train_batches: batches per rank per epoch; by default the manifest's sample count (after the
            class filter) divided by `batch_size * world_size`.
        decode: where training JPEGs are decoded. `cpu`: in the DataLoader workers. `device`: the workers
            read the tars and draw each crop box and flip (the same draws as `cpu`), and the batch is
            decoded, cropped, resized and flipped on the device it is moved to, which frees the workers'
            cores (`ssl_vit.data.stream.device_decode`: what stays on the CPU, and is counted in
            `data/decoded_on_cpu_train`). Random-resized-crop presets (`pretrain`, `supervised` without
            RandAugment) only; validation and test are decoded on the CPU.
        require_labels: skip and count samples without a label (-1), as every sample whose label is not
            a class. Set by itself when the fit's task trains on labels (its `NEEDS_LABELS`: supervised
            pretraining, fine-tuning, linear probing) and by evaluation's labelled passes; a
            self-supervised task reads unlabelled samples.
        augment: the training transform and the eval framing (`ssl_vit.data.options.Augment`).
        stream: the remote training stream's shuffle and a resume on changed data (`options.Stream`).
        limits: read retries and timeouts, the largest image read (`options.Limits`).
    """

    MOVED_OPTIONS = MOVED  # flat name -> its place in a group, for the CLI (`ssl_vit.cli.moved_options`)

    def __init__(
        self,
        train_urls: str | list[str] | None = None,
        val_urls: str | list[str] | None = None,
        test_urls: str | list[str] | None = None,
        batch_size: int = 64,
        num_workers: int = 4,
        image_size: int = 224,
        channels: int = 3,
        mean: tuple[float, ...] | Literal["auto"] = IMAGENET_DEFAULT_MEAN,
        std: tuple[float, ...] | Literal["auto"] = IMAGENET_DEFAULT_STD,
        seed: int = 0,
        classes: list[int] | None = None,
        train_keys: Collection[str] | None = None,
        num_classes: int | None = None,
        train_batches: int | None = None,
        decode: Literal["cpu", "device"] = "cpu",
        require_labels: bool = False,
        augment: Augment = DEFAULTS["augment"],
        stream: Stream = DEFAULTS["stream"],
        limits: Limits = DEFAULTS["limits"],
    ):
        super().__init__()
        augment, stream, limits = (
            _group(n, v) for n, v in (("augment", augment), ("stream", stream), ("limits", limits))
        )
        # No save_hyperparameters: the CLI logs the whole config (data included) to W&B, and Lightning
        # refuses to log a datamodule's hparams that share a key (num_classes) with the model's.
        check_counts(
            {
                "batch_size": batch_size, "image_size": image_size, "num_workers": num_workers, "seed": seed,
                "train_batches": train_batches, "num_classes": num_classes, "channels": channels,
            }
        )  # fmt: skip
        _check_across_groups(decode, augment, channels)
        self.train_urls, self.val_urls, self.test_urls = train_urls, val_urls, test_urls
        self.batch_size, self.num_workers, self.image_size = batch_size, num_workers, image_size
        self.channels, self.decode, self.require_labels = channels, decode, require_labels
        self.classes = list(classes) if classes is not None else None
        self.train_keys = frozenset(train_keys) if train_keys is not None else None
        self.train_batches = train_batches
        self.augment, self.stream, self.limits = augment, stream, limits
        self.read_policy, self.loader_timeout_s = limits.policy, limits.loader_timeout()
        self.manifests = Manifests(self.read_policy)  # may be shared with another data module of the run
        self._urls: dict[str, list[str]] = {}
        self.batches_per_epoch: int | None = None  # per rank, known at setup
        self.rank, self.world_size = 0, 1
        self.position = TrainingPosition(seed)
        self.mixing = Mixing(augment.mixup_alpha, augment.cutmix_alpha, augment.label_smoothing)
        first = next((u for u in (train_urls, val_urls, test_urls) if u), None)
        shown = first if isinstance(first, str) else "URLS"
        stats = self.manifest if "auto" in (mean, std) else None  # read only when asked for
        self.mean = normalisation("mean", mean, channels, stats, IMAGENET_DEFAULT_MEAN, shown)
        self.std = normalisation("std", std, channels, stats, IMAGENET_DEFAULT_STD, shown)
        # built once to validate the preset/randaugment combination at construction time
        build_transform(
            augment.train_preset,
            image_size,
            mean=self.mean,
            crop_scale=augment.crop_scale,
            randaugment=augment.randaugment,
            crop_pct=augment.eval_crop_pct,
        )
        self._num_classes = num_classes
        if num_classes is not None:
            manifests.check_labels(self.manifest, num_classes)

    @property
    def seed(self) -> int:
        return self.position.seed

    # --- facts for linking (LightningCLI link_arguments) and for evaluation ----------------------------

    @cached_property
    def manifest(self) -> dict | None:
        """The manifest of the first configured split that has one (looked up once: `num_classes` reads
        it on every mixed training batch)."""
        for urls in (self.train_urls, self.val_urls, self.test_urls):
            found = self.manifests.of(expand(urls, "urls")[0]) if urls else None
            if found:
                return found
        return None

    @property
    def num_classes(self) -> int | None:
        if self._num_classes is not None:
            return self._num_classes
        manifest = self.manifest
        return manifest["num_classes"] if manifest else None

    def split_manifest(self, split: str) -> dict | None:
        """The manifest of `split`'s shards (read once per data module), or None when they have none."""
        return self.manifests.of(self._split_urls(split)[0])

    def samples_in(self, split: str) -> int | None:
        """`manifest.samples_in` of the shards of `split`."""
        return manifests.samples_in(self.split_manifest(split), self._split_urls(split))

    def eval_view(self, split: str) -> EvalView:
        """How the `eval` transform frames the images of `split`, chosen from its manifest as read once
        (`manifest.eval_view`): every pass over the split frames it this way, and what a run records is
        what it used."""
        return manifests.eval_view(self.split_manifest(split), self.image_size)

    def has_masks(self, split: str) -> bool:
        """Whether the manifest of `split` says every sample carries a segmentation mask (`"masks":
        true`, written by `ssl-vit data convert` from a source with masks): its batches then hold `mask`,
        and a sample without one is skipped and counted. Shards without such a manifest give `mask`
        when their samples have `seg.png` members."""
        return (self.split_manifest(split) or {}).get("masks") is True

    def _split_urls(self, split: str) -> list[str]:
        if split not in self._urls:
            self.setup(STAGE_OF.get(split, "fit"))
        return self._urls[split]

    # --- Lightning hooks ----------------------------------------------------------------------------

    def setup(self, stage: str | None = None) -> None:
        self.rank, self.world_size = self._rank_and_world_size()
        self._urls.update(
            check_shard_urls(
                stage, {f"{split}_urls": getattr(self, f"{split}_urls") for split in SPLITS}, self.read_policy
            )
        )
        for split in STAGE_SPLITS.get(stage, []):
            if split in self._urls and split != "train" and len(self._urls[split]) < self.world_size:
                raise UserError(
                    f"{split}_urls has {len(self._urls[split])} shards for {self.world_size} ranks: an exact "
                    "pass needs at least one shard per rank; re-convert with a smaller --shard-size"
                )
        if "train" in self._urls:
            self.batches_per_epoch = self.train_batches or self._batches_per_epoch()

    def _rank_and_world_size(self) -> tuple[int, int]:
        """Read in the main process and handed to the workers: a worker cannot be trusted to discover them."""
        if self.trainer is not None:
            return self.trainer.global_rank, self.trainer.world_size
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank(), torch.distributed.get_world_size()
        return 0, 1

    @cached_property
    def train_index(self) -> SampleIndex | None:
        """Where every kept training sample lies, when the training shards are local uncompressed files
        (`ssl_vit.data.stream.epoch_order`): the stream then reads the epoch's global order. None
        otherwise."""
        urls = self._split_urls("train")
        if not indexable(urls):
            return None
        index = build_index(
            urls,
            classes=self.classes,
            keys=self.train_keys,
            num_classes=self.num_classes,
            require_labels=self.require_labels or self._task_needs_labels(),
        )
        if index.total == 0:
            DryShards(urls).fail(urls)
        return index

    def _batches_per_epoch(self) -> int:
        if self.train_index is not None:
            samples = self.train_index.total
        elif self.train_keys is not None:
            samples = len(self.train_keys)
        else:
            first = self._urls["train"][0]
            samples = manifests.epoch_samples(self.manifests.of(first), first, self.classes)
        batches = samples // (self.batch_size * self.world_size)
        if batches == 0:
            raise UserError(
                f"the training set has {samples} samples (after the class filter), fewer than one "
                f"batch per rank ({self.batch_size} x {self.world_size}): lower batch_size or set "
                "train_batches"
            )
        return batches

    def train_dataloader(self) -> DataLoader:
        self._split_urls("train")  # set up: the epoch's length is known from here on
        stream = self._shard_stream("train", self.augment.train_preset, self.batches_per_epoch)
        self.position.loader = EpochLoader(
            stream,
            self._start_epoch,
            self.position.track(stream),
            timeout=self.loader_timeout_s,
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
        )
        return self.position.loader

    def val_dataloader(self) -> DataLoader | list:
        return self.exact_dataloader("val") if self.val_urls is not None else []

    def test_dataloader(self) -> DataLoader:
        return self.exact_dataloader("test")

    def exact_dataloader(self, split: str) -> DataLoader:
        """Exact pass over a split with the eval transform: every sample once across ranks (validation,
        test, feature extraction)."""
        stream = self._shard_stream(split, "eval", batches_per_epoch=None)
        return ShardLoader(
            stream,
            split=split,
            timeout=self.loader_timeout_s,
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
        )

    def _shard_stream(self, split: str, preset: Preset, batches_per_epoch: int | None) -> ShardStream:
        urls = self._split_urls(split)
        masks = self.has_masks(split)
        augment = self.augment
        if masks and preset == "supervised" and augment.randaugment:
            raise UserError(f"{split}_urls: {RANDAUGMENT_AND_MASKS}")
        bands = manifests.bands(self.split_manifest(split), split, self.channels, augment.randaugment)
        randaugment = augment.randaugment if preset == "supervised" else None
        transform, array_transform = self._transforms(split, preset, randaugment)
        return ShardStream(
            urls,
            rank=self.rank,
            world_size=self.world_size,
            batch_size=self.batch_size,
            transform=transform,
            array_transform=array_transform,
            bands=bands,
            array_refusal="an image read as bands (not 8-bit RGB), and randaugment (timm's RandAugment) "
            "works on 8-bit RGB images only",
            classes=self.classes,
            keys=self.train_keys if split == "train" else None,
            seed=self.seed,
            batches_per_epoch=batches_per_epoch,
            shuffle_buffer=self.stream.shuffle_buffer,
            segment_shards=self.stream.segment_shards,
            num_classes=self.num_classes,
            masks=masks,
            require_labels=self.require_labels or self._task_needs_labels(),
            max_image_pixels=self.limits.max_image_pixels,
            read_policy=self.read_policy,
            index=self.train_index if split == "train" else None,
        )

    def _transforms(self, split: str, preset: Preset, randaugment: str | None) -> tuple:
        """The stream's transform of decoded images and of arrays (None: arrays are refused)."""
        augment = self.augment
        # a crop fraction of 1 keeps the whole image: the resize and the crop are both identities
        crop_pct = 1.0 if preset == "eval" and self.eval_view(split) == "whole" else augment.eval_crop_pct
        if self.decode == "device" and preset != "eval":
            transform = device_transform(self.image_size, augment.crop_scale, augment.draft)
        else:
            transform = build_transform(
                preset,
                self.image_size,
                mean=self.mean,
                crop_scale=augment.crop_scale,
                crop_pct=crop_pct,
                randaugment=randaugment,
                draft=augment.draft,
            )
        if randaugment:
            return transform, None
        return transform, build_array_transform(
            preset, self.image_size, crop_scale=augment.crop_scale, crop_pct=crop_pct
        )

    def _task_needs_labels(self) -> bool:
        """Whether the task of the fit this data module serves trains or scores on labels."""
        module = self.trainer.lightning_module if self.trainer is not None else None
        return bool(getattr(module, "NEEDS_LABELS", False))

    def _start_epoch(self) -> tuple[int, Any]:
        """`TrainingPosition.start` of the next training pass, with the trainer's epoch when attached."""
        epoch = self.trainer.current_epoch if self.trainer is not None else None
        return self.position.start(
            epoch,
            self.rank,
            self.world_size,
            self.num_workers,
            self.batches_per_epoch,
            self.batch_size * self.world_size,
        )

    def prepare_batch(self, batch: dict) -> dict:
        """A batch as the DataLoaders give it (`image` uint8 [B,C,H,W], or float32 in model units) -> as
        the model takes it (`image` float32 [B,C,H,W], each band normalised with its `mean`/`std`), on
        the batch's device; every other entry (`label`, `key`, `mask` uint8 [B,H,W]) passes through as
        it is.

        Lightning calls it after moving each batch to the device (`on_after_batch_transfer`); callers
        of the DataLoaders outside Lightning (feature extraction) call it themselves, after `.to(device)`.
        Workers keep images uint8 so that they skip a float conversion per sample and move 4x fewer
        bytes; the conversion runs once per batch where the batch already is. With `decode="device"`,
        the batch's JPEGs are decoded and cropped here first (`device_decode.place_jpegs`)."""
        batch = place_jpegs(batch, self.image_size)
        return {**batch, "image": normalize(batch["image"], self.mean, self.std)}

    def on_after_batch_transfer(self, batch: dict, dataloader_idx: int) -> dict:
        """`prepare_batch`, then mixup/cutmix/label smoothing (timm, `ssl_vit.data.transforms.mixing`) on
        whole training batches, on the device."""
        batch = self.prepare_batch(batch)
        training = self.trainer is not None and self.trainer.training
        if training and "stream" in batch and self.position.loader is not None:
            self.position.loader.record(batch)
        return self.mixing(batch, self.num_classes) if training and self.augment.mixes else batch

    # --- the training stream's position in checkpoints (`ssl_vit.data.stream.position`) --------------------

    def state_dict(self) -> dict[str, Any]:
        """The training stream's position (`TrainingPosition.state`), and what it reads (`identity`)."""
        state = self.position.state()
        if "train" in self._urls:
            state["data"] = identity(self._urls["train"], self.manifests.of(self._urls["train"][0]))
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restored by Lightning before it starts the first training iterator, except under strategies
        that restore after their own setup (FSDP2's ModelParallelStrategy): there the task's
        `configure_optimizers` (Lightning's `estimated_stepping_batches`) has started the epoch's
        iterator already, and it is started again here, from the restored position."""
        self.position.load(state_dict)
        if "data" in state_dict and "train" in self._urls:  # checkpoints from before it was recorded: none
            self._check_same_data(state_dict["data"], self._urls["train"])
        if self.position.started and self.trainer is not None and not self.position.loader.recorded:
            restart_fetcher(self.trainer, fetched=0)  # Lightning counts the restored batches itself

    def skip_batches(self, count: int) -> int:
        """Moves the training stream `count` batches past the last one training consumed, without
        decoding them (each worker passes over its share of their samples: `WorkerPosition.skip`), up
        to the end of the epoch: the next epoch draws and shuffles its segments anew, so nothing of this
        one follows there. Returns the batches skipped; they count as batches of the epoch (its length
        is fixed on every rank, and so stays the steps every rank takes). The training iterator restarts
        at the new position (what the DataLoader had fetched ahead is dropped), unless the epoch is over.
        Every rank skips the same number of its own batches."""
        skipped, restart = self.position.skip(
            count, self.batch_size, self.num_workers, self.batches_per_epoch
        )
        if restart is not None and self.trainer is not None:  # else the loader's next `iter` starts there
            restart_fetcher(self.trainer, fetched=restart)
        return skipped

    def refuse_changed_data(self, state_dict: dict[str, Any], world_size: int = 1) -> None:
        """Before the fit writes anything (the CLI calls it first; Lightning's restore, `load_state_dict`,
        is after config.yaml and the W&B run): the error for a resume on `world_size` ranks that would
        change the run's global batch (`position.check_step`), and with `stream.on_data_change:
        refuse`, for training data that differ from those of the checkpoint whose data-module state is
        `state_dict`."""
        check_step(state_dict.get("position", {}), world_size, self.batch_size)
        if self.stream.on_data_change == "refuse" and "data" in state_dict and self.train_urls is not None:
            self._check_same_data(state_dict["data"], expand(self.train_urls, "train_urls"))

    def _check_same_data(self, saved: dict, urls: list[str]) -> None:
        now = identity(urls, self.manifests.of(urls[0]))
        check_same_data(saved, now, self.stream.on_data_change, say=self.rank == 0)


def _group(name: str, value: Any) -> Any:
    """An option group given as a mapping from Python (as a recipe gives it) made its dataclass; a key
    it does not have is one line."""
    if not isinstance(value, Mapping):
        return value
    try:
        return GROUPS[name](**value)
    except TypeError as err:
        raise BadValue(f"{name}: {err}: give the keys of {GROUPS[name].__name__} ({name}.help)") from None


def _check_across_groups(decode: str, augment: Augment, channels: int) -> None:
    """The options of different groups that must agree: RandAugment takes RGB images; device decoding
    takes the random-resized-crop presets."""
    if augment.randaugment and channels != 3:
        raise BadValue(
            f"randaugment is timm's RandAugment, which works on RGB images: with channels {channels} "
            "leave it out (data.init_args.augment.randaugment null)"
        )
    if decode not in ("cpu", "device"):
        raise BadValue(f"decode must be 'cpu' or 'device', got {decode!r}")
    if decode == "device" and (augment.train_preset == "eval" or augment.randaugment):
        raise BadValue(
            "decode 'device' decodes the random-resized-crop presets ('pretrain', 'supervised' without "
            "randaugment), whose crop it draws before decoding; "
            + ("RandAugment works on PIL images" if augment.randaugment else "'eval' resizes whole images")
            + ": use decode 'cpu'"
        )
