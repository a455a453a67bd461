"""`ShardDataModule`: WebDataset shards -> batches for Lightning, on one device or many.

    data:
      class_path: ssl_vit.data.ShardDataModule
      init_args:
        train_urls: data/shards/digits/train-{000000..000001}.tar
        val_urls: data/shards/digits/val-000000.tar
        batch_size: 64
        image_size: 32

Training reads a resampled stream with a fixed number of batches per rank per epoch; validation and
test are exact passes (see `ssl_vit.data.stream`). Batches reach the model as dicts: `image` float32
[B,C,H,W] (C = `channels`, each band normalised by its own mean and std; the DataLoaders give uint8 for
8-bit images, float32 in model units for 16-bit and float ones, converted on the device by
`prepare_batch`),
`label` int64 [B] (-1 where unlabelled), `key` list[str], `mask` uint8 [B,H,W] when the samples carry
segmentation masks (`seg.png`: a class index per pixel of `image`, 255 ignored; cropped, flipped and
resized with the image, nearest-neighbour; passed through untouched), `skipped` (bad samples the
batch's worker dropped since its previous batch), during training `stream` (the position of the batch's
worker, which makes the training DataLoader resumable mid-epoch: `EpochLoader`), and with
mixup/cutmix/label smoothing also `target` float [B,K] (timm's soft targets).

Remote shards and manifests are read with retries and a read timeout (`read_retries`,
`read_timeout_s`: `ssl_vit.data.remote`); a DataLoader whose workers deliver no batch for
`loader_timeout_s` ends the run with one line naming the split's shards (`ShardLoader`). Each split's
manifest is read once per data module (`manifests`), so the epoch size, the class count and the eval
view all come from one reading.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection
from dataclasses import replace
from typing import Any, Literal

import pytorch_lightning as pl
import torch
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, Mixup
from timm.data.mixup import mixup_target
from torch.utils.data import DataLoader

from ssl_vit.data.band_transforms import build_array_transform
from ssl_vit.data.checks import (
    SPLITS,
    STAGE_SPLITS,
    check_counts,
    check_seconds,
    check_shard_urls,
    read_policy,
)
from ssl_vit.data.device_decode import device_transform, place_jpegs
from ssl_vit.data.identity import changes, identity
from ssl_vit.data.loaders import EpochLoader, ShardLoader
from ssl_vit.data.manifest import channel_choices, manifest_url, read_manifest
from ssl_vit.data.masks import IGNORE_INDEX
from ssl_vit.data.samples import MAX_IMAGE_PIXELS, Bands
from ssl_vit.data.stream import ResumePlan, ShardStream, WorkerPosition
from ssl_vit.data.transforms import RANDAUGMENT_AND_MASKS, EvalView, Preset, build_transform, normalize
from ssl_vit.data.urls import expand
from ssl_vit.errors import BadValue, UserError

log = logging.getLogger("ssl_vit.data")


class ShardDataModule(pl.LightningDataModule):
    """Streams WebDataset shards: resampled training streams, exact validation/test passes.

    Args:
        train_urls, val_urls, test_urls: shard URLs (brace ranges; local paths, `file://`, `http(s)://`,
            `pipe:CMD`, fsspec URLs such as `s3://`), a string or a list.
        batch_size: samples per batch per device.
        num_workers: DataLoader worker processes per device.
        image_size: side of the square crops fed to the model.
        train_preset: training transform (`pretrain`, `supervised` or `eval`); val/test always use `eval`.
        crop_scale: area range of the random resized crop.
        randaugment: timm RandAugment config such as `rand-m9-mstd0.5-inc1` (`supervised` preset only).
        mixup_alpha, cutmix_alpha, label_smoothing: timm `Mixup` on training batches, on the device;
            they add a soft `target` [B, num_classes] to the batch.
        eval_crop_pct: `eval` resizes the shorter side to `image_size / eval_crop_pct`, then centre-crops,
            unless the split's images are stored at `image_size` (`eval_view`): those are taken whole.
        train_batches: batches per rank per epoch; by default the manifest's sample count (after the
            class filter) divided by `batch_size * world_size`.
        shuffle_buffer: samples in the raw-bytes shuffle buffer of each training worker.
        segment_shards: a training worker draws its shards in segments of this many, each shuffled on
            its own; a resumed run re-reads (without decoding) at most one segment per worker to get
            back to where it stopped (`ssl_vit.data.stream`).
        seed: seed of every training stream; the stream is a function of (seed, epoch, rank, worker).
        classes: keep only samples with these labels (labels are not renumbered).
        train_keys: keep only the training split's samples with these `__key__`s (a labelled subset,
            drawn within `classes`); the other splits are not filtered. The stream still reads every
            shard and decodes only the kept samples.
        num_classes: overrides the manifest's class count.
        channels: bands of every image (C of the batches' `image`): 3 reads 8-bit images as RGB, as
            always (grey ones expanded); any other count, and 16-bit or float images, are read as
            arrays (npy, tif/tiff, 16-bit PNG; see data/README.md). A sample with another band count,
            or another dtype than its split's manifest records, is skipped and counted.
        mean, std: normalisation, one value per band, in model units (8-bit data / 255, as timm's
            IMAGENET_DEFAULT_MEAN; other dtypes as stored); `auto`: the manifest's `band_stats`
            (`ssl-vit data convert` records them, `ssl-vit data inspect --stats` adds them).
        draft: decode JPEGs at a reduced scale (1/2, 1/4, 1/8) when the crop's source region, or for
            `eval` the whole image, stays at least the size it is resized to.
        decode: where training JPEGs are decoded. `cpu`: in the DataLoader workers. `device`: the workers
            read the tars and draw each crop box and flip from the JPEG's header (the same draws as
            `cpu`), and the batch is decoded, cropped, resized and flipped on the device it is moved to
            (`ssl_vit.data.device_decode`), which frees the workers' cores; other formats, CMYK JPEGs and
            JPEGs the device refuses are decoded on the CPU, counted (`data/decoded_on_cpu_train`);
            segmentation masks are cropped and flipped in the workers with the same box and flip.
            Random-resized-crop presets (`pretrain`, `supervised` without RandAugment) only;
            validation and test are decoded on the CPU.
        read_retries: a remote shard, manifest or shard check (http(s), fsspec, `pipe:`) that fails is
            tried this many more times, waiting 1 s, 2 s, 4 s, ... (at most 30 s) between tries; a shard
            that still fails is skipped and counted, a manifest that still fails stops the run.
        read_timeout_s: a remote read that gets no byte for this long has failed (and is retried).
        on_data_change: a resume whose training shards or manifest differ from the checkpoint's
            (`ssl_vit.data.identity`) cannot be exact: `warn` says so in one line and goes on, `refuse`
            stops with that line.
        loader_timeout_s: with DataLoader workers, no batch for this long ends the run with one line
            naming the split's shards; by default twice the longest a shard read can take before it
            gives up (every try timing out: 782 s with the defaults above).
        require_labels: skip and count samples without a label (-1), as every sample whose label is not
            a class. Set by itself when the fit's task trains on labels (its `NEEDS_LABELS`: supervised
            pretraining, fine-tuning, linear probing) and by evaluation's labelled passes; a
            self-supervised task reads unlabelled samples.
        max_image_pixels: an image of more pixels (width x height, from its header) is skipped and
            counted without being decoded; null: no limit. The default is PIL's own warning threshold
            (89.5 Mpx), beyond which PIL decodes with a warning; PIL refuses twice as many anyway.
    """

    def __init__(
        self,
        train_urls: str | list[str] | None = None,
        val_urls: str | list[str] | None = None,
        test_urls: str | list[str] | None = None,
        batch_size: int = 64,
        num_workers: int = 4,
        image_size: int = 224,
        train_preset: Preset = "pretrain",
        crop_scale: tuple[float, float] = (0.08, 1.0),
        randaugment: str | None = None,
        mixup_alpha: float = 0.0,
        cutmix_alpha: float = 0.0,
        label_smoothing: float = 0.0,
        eval_crop_pct: float = 0.875,
        train_batches: int | None = None,
        shuffle_buffer: int = 2000,
        segment_shards: int = 4,
        seed: int = 0,
        classes: list[int] | None = None,
        train_keys: Collection[str] | None = None,
        num_classes: int | None = None,
        channels: int = 3,
        mean: tuple[float, ...] | Literal["auto"] = IMAGENET_DEFAULT_MEAN,
        std: tuple[float, ...] | Literal["auto"] = IMAGENET_DEFAULT_STD,
        draft: bool = True,
        decode: Literal["cpu", "device"] = "cpu",
        read_retries: int = 5,
        read_timeout_s: float = 60.0,
        loader_timeout_s: float | None = None,
        on_data_change: Literal["warn", "refuse"] = "warn",
        require_labels: bool = False,
        max_image_pixels: int | None = MAX_IMAGE_PIXELS,
    ):
        super().__init__()
        # No save_hyperparameters: the CLI logs the whole config (data included) to W&B, and Lightning
        # refuses to log a datamodule's hparams that share a key (num_classes) with the model's.
        check_counts(
            {
                "batch_size": batch_size, "image_size": image_size, "num_workers": num_workers,
                "segment_shards": segment_shards, "train_batches": train_batches, "num_classes": num_classes,
                "seed": seed, "max_image_pixels": max_image_pixels, "channels": channels,
            }
        )  # fmt: skip
        if randaugment and channels != 3:
            raise BadValue(
                f"randaugment is timm's RandAugment, which works on RGB images: with channels {channels} "
                "leave it out (data.init_args.randaugment null)"
            )
        check_seconds({"loader_timeout_s": loader_timeout_s})
        low, high = crop_scale
        if not 0 < low <= high <= 1:
            raise BadValue(
                f"crop_scale {list(crop_scale)}: give the random crop's area range as two fractions of the "
                "image, 0 < min <= max <= 1 (e.g. [0.2, 1.0])"
            )
        if decode not in ("cpu", "device"):
            raise BadValue(f"decode must be 'cpu' or 'device', got {decode!r}")
        if decode == "device" and (train_preset == "eval" or randaugment):
            raise BadValue(
                "decode 'device' decodes the random-resized-crop presets ('pretrain', 'supervised' without "
                "randaugment), whose crop it draws before decoding; "
                + ("RandAugment works on PIL images" if randaugment else "'eval' resizes whole images")
                + ": use decode 'cpu'"
            )
        self.read_policy = read_policy({"read_retries": read_retries, "read_timeout_s": read_timeout_s})
        self.loader_timeout_s = loader_timeout_s or 2 * self.read_policy.worst_case_s()
        if (mixup_alpha or cutmix_alpha) and train_preset != "supervised":
            raise BadValue(f"mixup/cutmix belong to train_preset 'supervised', not {train_preset!r}")
        self.train_urls, self.val_urls, self.test_urls = train_urls, val_urls, test_urls
        self.channels = channels
        self.manifests: dict[str, dict | None] = {}
        self.mean, self.std = self._normalisation("mean", mean), self._normalisation("std", std)
        # build once to validate the preset/randaugment combination at construction time
        build_transform(
            train_preset,
            image_size,
            mean=self.mean,
            crop_scale=crop_scale,
            randaugment=randaugment,
            crop_pct=eval_crop_pct,
        )
        self.batch_size, self.num_workers, self.image_size = batch_size, num_workers, image_size
        self.train_preset, self.crop_scale, self.randaugment = train_preset, tuple(crop_scale), randaugment
        self.mixup_args = {
            "mixup_alpha": mixup_alpha,
            "cutmix_alpha": cutmix_alpha,
            "label_smoothing": label_smoothing,
        }
        self.eval_crop_pct = eval_crop_pct
        self.train_batches = train_batches
        self.batches_per_epoch: int | None = None  # per rank, known at setup
        self.shuffle_buffer = shuffle_buffer
        self.segment_shards = segment_shards
        self._train_loader: EpochLoader | None = None
        self._resume: dict | None = None  # a restored position, used by the next training pass
        self._moved: tuple[int, ResumePlan] | None = None  # where `skip_batches` restarts the pass
        self.seed = seed
        self.classes = list(classes) if classes is not None else None
        self.train_keys = frozenset(train_keys) if train_keys is not None else None
        self._num_classes = num_classes
        self.draft, self.decode = draft, decode
        self.epoch = 0
        self.rank, self.world_size = 0, 1
        self._urls: dict[str, list[str]] = {}
        # `manifests`: read, by URL (None: there is none), each once: another data module of the same
        # run may share this dict (evaluation's trained protocols, the few-shot monitor) so that both
        # decide from one reading.
        self._views: dict[str, EvalView] = {}
        self.on_data_change = on_data_change
        self.require_labels, self.max_image_pixels = require_labels, max_image_pixels
        self._mixup: Mixup | None = None
        self._check_labels()

    def _normalisation(self, name: str, given: tuple[float, ...] | str) -> tuple[float, ...]:
        """`mean` or `std` as one float per band: as given, or with "auto" the manifest's `band_stats`
        (a grey 8-bit set's one band standing for the three it is read as with channels 3). One line
        for a wrong count, a std that is not positive, or "auto" without stats."""
        if given == "auto":
            values = self._auto(name)
        elif isinstance(given, str):
            raise BadValue(f"{name} {given!r}: give {self.channels} numbers (one per band) or 'auto'")
        else:
            values = tuple(float(v) for v in given)
        if len(values) != self.channels:
            imagenet = given in (tuple(IMAGENET_DEFAULT_MEAN), tuple(IMAGENET_DEFAULT_STD))
            default = " (the default: ImageNet's RGB)" if imagenet else ""
            raise BadValue(
                f"{name} has {len(values)} values{default} for channels {self.channels}: give one per band "
                "in model units (8-bit data / 255, other dtypes as stored), or 'auto' for the manifest's "
                "band_stats"
            )
        if not all(math.isfinite(v) for v in values) or (name == "std" and min(values) <= 0):
            raise BadValue(f"{name} {list(values)}: give finite numbers{', all above 0' * (name == 'std')}")
        return values

    def _auto(self, name: str) -> tuple[float, ...]:
        manifest = self.manifest
        stats = (manifest or {}).get("band_stats")
        if not isinstance(stats, dict) or not isinstance(stats.get(name), list):
            first = next((u for u in (self.train_urls, self.val_urls, self.test_urls) if u), None)
            where = "the shards have no manifest" if manifest is None else "their manifest has no band_stats"
            raise UserError(
                f"{name} 'auto' reads the manifest's band_stats, and {where}: add them with `ssl-vit data "
                f"inspect --stats {first if isinstance(first, str) else 'URLS'}`, or give "
                f"data.init_args.{name} as {self.channels} numbers"
            )
        values = [float(v) for v in stats[name]]
        if len(values) == 1 and self.channels == 3 and manifest.get("dtype", "uint8") == "uint8":
            values *= 3  # a grey 8-bit set, read as RGB: three equal bands
        if name == "std" and 0 in values:
            log.warning(
                "band(s) %s are constant over the manifest's band_stats (std 0): normalised with std 1",
                ", ".join(str(i) for i, v in enumerate(values) if v == 0),
            )
            values = [v or 1.0 for v in values]
        return tuple(values)

    # --- facts for linking (LightningCLI link_arguments) --------------------------------------------

    @property
    def manifest(self) -> dict | None:
        """The manifest of the first configured split that has one."""
        for urls in (self.train_urls, self.val_urls, self.test_urls):
            found = self._manifest_of(expand(urls, "urls")[0]) if urls else None
            if found:
                return found
        return None

    def _manifest_of(self, first_url: str) -> dict | None:
        """The manifest beside the shard `first_url` (`read_manifest`), read once per data module."""
        url = manifest_url(first_url)
        if url is None:
            return None
        if url not in self.manifests:
            self.manifests[url] = read_manifest(first_url, self.read_policy)
        return self.manifests[url]

    def samples_in(self, split: str) -> int | None:
        """The samples in the shards of `split` (before any class filter), as their manifest counts them
        shard by shard; None when a shard is not in it or there is none."""
        if split not in self._urls:
            self.setup({"val": "validate", "test": "test"}.get(split, "fit"))
        urls = self._urls[split]
        counts = {
            entry["url"].rsplit("/", 1)[-1]: entry["num_samples"]
            for entry in (self._manifest_of(urls[0]) or {}).get("shards", [])
        }
        names = [url.rsplit("/", 1)[-1] for url in urls]
        return sum(counts[name] for name in names) if all(name in counts for name in names) else None

    def _check_labels(self) -> None:
        """Labels the manifest counts beyond `num_classes` would fail the first training step (an index
        error in the loss): refused here, before anything runs. A sample whose label is beyond
        the class count anyway is a corrupt sample: the stream skips and counts it. So are mask
        classes (`mask_pixels`): a sample whose mask holds one beyond `num_classes` would be skipped,
        and with a class count below the manifest's, most would."""
        manifest = (self.manifest or {}) if self._num_classes is not None else {}
        for what, counts in (
            ("labels", manifest.get("class_counts")),
            ("mask classes", manifest.get("mask_pixels")),
        ):
            values = [int(v) for v in counts or {} if int(v) != IGNORE_INDEX or what == "labels"]
            beyond = sorted(v for v in values if v >= self._num_classes)
            if beyond:
                raise UserError(
                    f"the shards' manifest counts {what} up to {beyond[-1]}, beyond num_classes "
                    f"{self._num_classes}: set data.init_args.num_classes to at least {beyond[-1] + 1} (the "
                    "manifest's num_classes), or leave it unset"
                )

    @property
    def num_classes(self) -> int | None:
        if self._num_classes is not None:
            return self._num_classes
        return self.manifest["num_classes"] if self.manifest else None

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
            self.batches_per_epoch = self.train_batches or self._batches_from_manifest()

    def _rank_and_world_size(self) -> tuple[int, int]:
        """Read in the main process and handed to the workers: a worker cannot be trusted to discover them."""
        if self.trainer is not None:
            return self.trainer.global_rank, self.trainer.world_size
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank(), torch.distributed.get_world_size()
        return 0, 1

    def _batches_from_manifest(self) -> int:
        samples = len(self.train_keys) if self.train_keys is not None else self._samples_from_manifest()
        batches = samples // (self.batch_size * self.world_size)
        if batches == 0:
            raise UserError(
                f"the training set has {samples} samples (after the class filter), fewer than one "
                f"batch per rank ({self.batch_size} x {self.world_size}): lower batch_size or set "
                "train_batches"
            )
        return batches

    def _samples_from_manifest(self) -> int:
        first = self._urls["train"][0]
        manifest = self._manifest_of(first)
        if manifest is None:
            url = manifest_url(first)
            where = (
                f"{url} does not exist"
                if url
                else f"only shards named SPLIT-NNNNNN.tar, not {first}, have one beside them: SPLIT.json"
            )
            raise UserError(
                f"train_urls have no manifest ({where}) to size an epoch: set data.init_args.train_batches"
            )
        if self.classes is None:
            return manifest["num_samples"]
        counts = manifest.get("class_counts", {})
        return sum(counts.get(str(c), 0) for c in self.classes)

    def train_dataloader(self) -> DataLoader:
        if "train" not in self._urls:
            self.setup("fit")
        stream = self._stream("train", self.train_preset, batches_per_epoch=self.batches_per_epoch)
        self._train_loader = EpochLoader(
            stream,
            self._start_epoch,
            timeout=self.loader_timeout_s,
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
        )
        return self._train_loader

    def val_dataloader(self) -> DataLoader | list:
        return self.exact_dataloader("val") if self.val_urls is not None else []

    def test_dataloader(self) -> DataLoader:
        return self.exact_dataloader("test")

    def exact_dataloader(self, split: str) -> DataLoader:
        """Exact pass over a split with the eval transform: every sample once across ranks (validation,
        test, feature extraction)."""
        if split not in self._urls:
            self.setup({"val": "validate", "test": "test"}.get(split, "fit"))
        stream = self._stream(split, "eval", batches_per_epoch=None)
        return ShardLoader(
            stream,
            split=split,
            timeout=self.loader_timeout_s,
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
        )

    def eval_view(self, split: str) -> EvalView:
        """How the `eval` transform frames the images of `split`, chosen from the data: `whole` when its
        manifest records every image at `image_size` x `image_size` (CIFAR-style sets stored at the model's
        resolution: nothing to resize, and a centre crop would only throw the border away); otherwise
        `crop`, ImageNet's resize to `image_size / eval_crop_pct` and centre crop. Chosen once per split
        (from the manifest as read once, `manifests`): every pass over the split frames it this way, and
        what a run records is what it used."""
        if split not in self._views:
            if split not in self._urls:
                self.setup({"val": "validate", "test": "test"}.get(split, "fit"))
            stored = (self._manifest_of(self._urls[split][0]) or {}).get("image_size")
            self._views[split] = "whole" if stored == [self.image_size, self.image_size] else "crop"
        return self._views[split]

    def has_masks(self, split: str) -> bool:
        """Whether the manifest of `split` says every sample carries a segmentation mask (`"masks":
        true`, written by `ssl-vit data convert` from a source with masks): its batches then hold `mask`,
        and a sample without one is skipped and counted. Shards without such a manifest give `mask`
        when their samples have `seg.png` members."""
        return (self.split_manifest(split) or {}).get("masks") is True

    def split_manifest(self, split: str) -> dict | None:
        """The manifest of `split`'s shards (read once per data module), or None when they have none."""
        if split not in self._urls:
            self.setup({"val": "validate", "test": "test"}.get(split, "fit"))
        return self._manifest_of(self._urls[split][0])

    def _bands(self, split: str) -> Bands:
        """What the stream of `split` reads: `channels` bands, of the dtype its manifest records. One line
        when the manifest records another band count (a grey 8-bit set is read as RGB with channels 3),
        or a dtype RandAugment cannot take."""
        manifest = self.split_manifest(split) or {}
        dtype, stored = manifest.get("dtype"), manifest.get("channels")
        if stored is not None and self.channels not in channel_choices(manifest):
            raise UserError(
                f"{split}_urls: their manifest says {stored} channels of {dtype}, data.init_args.channels is "
                f"{self.channels}: set channels to {stored} (with mean and std per band, or 'auto')"
            )
        if self.randaugment and dtype not in (None, "uint8"):
            raise UserError(
                f"{split}_urls: their manifest says dtype {dtype}, and randaugment (timm's RandAugment) "
                "works on 8-bit RGB images: leave it out (data.init_args.randaugment null)"
            )
        return Bands(self.channels, dtype)

    def _stream(self, split: str, preset: Preset, batches_per_epoch: int | None) -> ShardStream:
        masks = self.has_masks(split)
        if masks and preset == "supervised" and self.randaugment:
            raise UserError(f"{split}_urls: {RANDAUGMENT_AND_MASKS}")
        bands = self._bands(split)
        # a crop fraction of 1 keeps the whole image: the resize and the crop are both identities
        crop_pct = 1.0 if preset == "eval" and self.eval_view(split) == "whole" else self.eval_crop_pct
        randaugment = self.randaugment if preset == "supervised" else None
        transform = (
            device_transform(self.image_size, self.crop_scale, self.draft)
            if (self.decode == "device" and preset != "eval")
            else build_transform(
                preset,
                self.image_size,
                mean=self.mean,
                crop_scale=self.crop_scale,
                crop_pct=crop_pct,
                randaugment=randaugment,
                draft=self.draft,
            )
        )
        array_transform = (
            None
            if randaugment
            else build_array_transform(preset, self.image_size, crop_scale=self.crop_scale, crop_pct=crop_pct)
        )
        return ShardStream(
            self._urls[split],
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
            shuffle_buffer=self.shuffle_buffer,
            segment_shards=self.segment_shards,
            num_classes=self.num_classes,
            masks=masks,
            require_labels=self.require_labels or self._task_needs_labels(),
            max_image_pixels=self.max_image_pixels,
            read_policy=self.read_policy,
        )

    def _task_needs_labels(self) -> bool:
        """Whether the task of the fit this data module serves trains or scores on labels."""
        module = self.trainer.lightning_module if self.trainer is not None else None
        return bool(getattr(module, "NEEDS_LABELS", False))

    def _start_epoch(self) -> tuple[int, ResumePlan | None]:
        """The epoch of the training pass about to start and, once after a resume, where each worker
        stands in it. Without a resume: the trainer's epoch when attached, else a count of passes.

        Lightning starts the first training iterator before it restores its loops (to count the steps
        for the schedule), so after a resume the epoch comes from the restored position, not from the
        trainer."""
        saved, self._resume = self._resume, None
        moved, self._moved = self._moved, None
        if moved is not None:
            epoch, plan = moved
        elif saved is not None:
            epoch, plan = self._plan(saved)
        else:
            epoch, plan = (self.trainer.current_epoch if self.trainer is not None else self.epoch), None
        self.epoch = epoch + 1
        return epoch, plan

    def _plan(self, saved: dict) -> tuple[int, ResumePlan | None]:
        ranks, workers_now = saved["ranks"], max(1, self.num_workers)
        mine = ranks[self.rank] if len(ranks) == self.world_size else ranks[0]
        epoch = mine["epoch"]
        workers = {int(w): WorkerPosition(*p) for w, p in mine["workers"].items()}
        consumed = sum(p.batches for p in workers.values())
        if consumed >= self.batches_per_epoch:
            return epoch + 1, None  # saved at the end of the epoch: the next one starts afresh
        if len(ranks) != self.world_size or mine["num_workers"] != workers_now:
            log.warning(
                "exact resume needs the run's number of ranks and DataLoader workers (saved %d x %d, now "
                "%d x %d): the rest of epoch %d reads new segments of the shards, so some samples of this "
                "epoch may repeat",
                len(ranks), mine["num_workers"], self.world_size, workers_now, epoch,
            )  # fmt: skip
            after = 1 + max((p.segment for p in workers.values()), default=0)
            return epoch, ResumePlan({w: WorkerPosition(0, after, 0) for w in range(workers_now)})
        return epoch, ResumePlan(workers, first=consumed % workers_now)

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
        """`prepare_batch`, then mixup/cutmix/label smoothing (timm) on whole training batches, on the
        device."""
        batch = self.prepare_batch(batch)
        training = self.trainer is not None and self.trainer.training
        if training and "stream" in batch and self._train_loader is not None:
            self._train_loader.record(batch)
        if not any(self.mixup_args.values()) or not training:
            return batch
        if "mask" in batch and (self.mixup_args["mixup_alpha"] or self.mixup_args["cutmix_alpha"]):
            raise UserError(
                "mixup/cutmix blend images but not their segmentation masks (seg.png): set "
                "data.init_args.mixup_alpha and cutmix_alpha to 0 for shards with masks"
            )
        if not self.num_classes:
            raise UserError("mixup/cutmix/label_smoothing need num_classes: set data.init_args.num_classes")
        if not (self.mixup_args["mixup_alpha"] or self.mixup_args["cutmix_alpha"]):
            # label smoothing alone: timm's Mixup asserts that one of its alphas is set
            smoothing = self.mixup_args["label_smoothing"]
            batch["target"] = mixup_target(batch["label"], self.num_classes, smoothing=smoothing)
            return batch
        if self._mixup is None:
            self._mixup = Mixup(**self.mixup_args, num_classes=self.num_classes)
        batch["image"], batch["target"] = self._mixup(batch["image"], batch["label"])
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The training stream's position: the seed, the next epoch, and where every rank's workers
        stand in the current one (gathered: only rank 0 writes the checkpoint, every rank resumes from
        it; Lightning builds the checkpoint on every rank, so the collective is matched)."""
        state = {"seed": self.seed, "epoch": self.epoch}
        if "train" in self._urls:
            state["data"] = identity(self._urls["train"], self._manifest_of(self._urls["train"][0]))
        if self._train_loader is not None and self._train_loader.epoch is not None:
            local = self._train_loader.position()
            ranks = [local]
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                ranks = [None] * torch.distributed.get_world_size()
                torch.distributed.all_gather_object(ranks, local)
            state["position"] = {"ranks": ranks}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restored by Lightning before it starts the first training iterator, except under strategies
        that restore after their own setup (FSDP2's ModelParallelStrategy): there the task's
        `configure_optimizers` (Lightning's `estimated_stepping_batches`) has started the epoch's
        iterator already, and it is started again here, from the restored position."""
        self.seed, self.epoch = state_dict["seed"], state_dict["epoch"]
        self._resume = state_dict.get("position")
        if "data" in state_dict and "train" in self._urls:  # checkpoints from before it was recorded: none
            self._check_same_data(state_dict["data"], self._urls["train"])
        started = self._train_loader is not None and self._train_loader.epoch is not None
        if started and self.trainer is not None and not self._train_loader.consumed:
            self._restart_training_iterator(fetched=0)  # Lightning counts the restored batches itself

    def skip_batches(self, count: int) -> int:
        """Moves the training stream `count` batches past the last one training consumed, without
        decoding them (each worker passes over its share of their samples: `WorkerPosition.skip`), up
        to the end of the epoch: the next epoch draws and shuffles its segments anew, so nothing of this
        one follows there. Returns the batches skipped; they count as batches of the epoch (its length
        is fixed on every rank, and so stays the steps every rank takes). The training iterator restarts
        at the new position (what the DataLoader had fetched ahead is dropped), unless the epoch is over.
        Every rank skips the same number of its own batches."""
        loader = self._train_loader
        workers = max(1, self.num_workers)
        positions = dict(loader.consumed)
        consumed = sum(p.batches for p in positions.values())
        count = max(0, min(count, self.batches_per_epoch - consumed))
        for index in range(consumed, consumed + count):  # the DataLoader's round robin: batch i, worker i % W
            p = positions.get(index % workers, WorkerPosition())
            positions[index % workers] = replace(p, batches=p.batches + 1, skip=p.skip + self.batch_size)
        loader.consumed = positions  # what a checkpoint saved before the next batch records
        if consumed + count < self.batches_per_epoch:
            self._moved = (loader.epoch, ResumePlan(positions, first=(consumed + count) % workers))
            if self.trainer is not None:  # else the loader's next `iter` starts there
                self._restart_training_iterator(fetched=consumed + count)
        return count

    def _restart_training_iterator(self, fetched: int) -> None:
        """A new training iterator for Lightning's fetcher, which has no public way to restart it; its
        count of the epoch's batches fetched (which tells the epoch's last batch) is set to `fetched`,
        as Lightning sets it when a pass starts."""
        fetcher = self.trainer.fit_loop._data_fetcher
        iter(fetcher)
        fetcher.fetched = fetched

    def refuse_changed_data(self, state_dict: dict[str, Any]) -> None:
        """With `on_data_change: refuse`, the error for training data that differ from those of the
        checkpoint whose data-module state is `state_dict`, before the fit writes anything (the CLI
        calls it first; Lightning's restore, `load_state_dict`, is after config.yaml and the W&B run)."""
        if self.on_data_change == "refuse" and "data" in state_dict and self.train_urls is not None:
            self._check_same_data(state_dict["data"], expand(self.train_urls, "train_urls"))

    def _check_same_data(self, saved: dict, urls: list[str]) -> None:
        """One line when the training data over `urls` differ from the checkpoint's: a warning, or with
        `on_data_change: refuse` the error that stops the resume."""
        found = changes(saved, identity(urls, self._manifest_of(urls[0])))
        if not found:
            return
        text = (
            f"the training data differ from the checkpoint's ({'; '.join(found)}), so this resume is not "
            "exact: the epoch's remaining samples are drawn from the data as they are now"
        )
        if self.on_data_change == "refuse":
            raise UserError(
                f"{text}: give the shards the run was trained on, or resume anyway with "
                "--data.init_args.on_data_change warn"
            )
        if self.rank == 0:
            log.warning("%s (--data.init_args.on_data_change refuse stops instead)", text)
