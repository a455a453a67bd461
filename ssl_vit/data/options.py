"""The option groups of `ShardDataModule`: what belongs together in a recipe, one dataclass each
(`Augment`, `Stream`, `Limits`), read by LightningCLI (jsonargparse) as nested options
(`data.init_args.augment.crop_scale`):

    data:
      class_path: ssl_vit.data.ShardDataModule
      init_args:
        train_urls: ...
        batch_size: 64
        augment: {train_preset: supervised, crop_scale: [0.08, 1.0], label_smoothing: 0.1}
        stream: {shuffle_buffer: 5000}
        limits: {read_timeout_s: 120}

The everyday options stay flat (URLs, batch size, workers, image size, bands and normalisation, seed,
classes, epoch length, where JPEGs are decoded). Flat keys are kept where the data module's options are
written without groups: suites' `data:` blocks (docs/SUITES.md) and the run configs written before the
groups, both read through `grouped`, the one place that maps flat keys onto the groups (`MOVED`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

from ssl_vit.data.checks import check_counts, check_seconds, read_policy
from ssl_vit.data.format.members import MAX_IMAGE_PIXELS
from ssl_vit.data.transforms.rgb import Preset
from ssl_vit.errors import BadValue, shown
from ssl_vit.storage.remote import ReadPolicy


@dataclass(frozen=True)
class Augment:
    """The training transform, and how `eval` (validation, test) frames an image.

    Args:
        train_preset: training transform (`pretrain`, `supervised` or `eval`); val/test always use `eval`.
        crop_scale: area range of the random resized crop.
        randaugment: timm RandAugment config such as `rand-m9-mstd0.5-inc1` (`supervised` preset only).
        mixup_alpha: timm `Mixup`'s mixup on training batches, on the device (`supervised` preset only).
        cutmix_alpha: timm `Mixup`'s cutmix, as `mixup_alpha`.
        label_smoothing: soft targets of smoothed labels; mixup, cutmix and label smoothing add a soft
            `target` [B, num_classes] to the batch.
        eval_crop_pct: `eval` resizes the shorter side to `image_size / eval_crop_pct`, then centre-crops,
            unless the split's images are stored at `image_size` (`eval_view`): those are taken whole.
        draft: decode JPEGs at a reduced scale (1/2, 1/4, 1/8) when the crop's source region, or for
            `eval` the whole image, stays at least the size it is resized to.
    """

    train_preset: Preset = "pretrain"
    crop_scale: tuple[float, float] = (0.08, 1.0)
    randaugment: str | None = None
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    label_smoothing: float = 0.0
    eval_crop_pct: float = 0.875
    draft: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "crop_scale", tuple(self.crop_scale))  # a list, from YAML or a suite
        low, high = self.crop_scale
        if not 0 < low <= high <= 1:
            raise BadValue(
                f"crop_scale {list(self.crop_scale)}: give the random crop's area range as two fractions of "
                "the image, 0 < min <= max <= 1 (e.g. [0.2, 1.0])"
            )
        self._check_numbers()
        if (self.mixup_alpha or self.cutmix_alpha) and self.train_preset != "supervised":
            raise BadValue(f"mixup/cutmix belong to train_preset 'supervised', not {self.train_preset!r}")

    def _check_numbers(self) -> None:
        """One line for a number out of its range (NaN included): a Beta distribution's alpha (mixup,
        cutmix), a share of the label mass (label smoothing), of the image's side (eval_crop_pct); timm
        would fail on them at the first batch, or train on negative targets."""
        checks = {
            "mixup_alpha": (0 <= self.mixup_alpha < math.inf, "at least 0 (0: off)"),
            "cutmix_alpha": (0 <= self.cutmix_alpha < math.inf, "at least 0 (0: off)"),
            "label_smoothing": (0 <= self.label_smoothing < 1, "in [0, 1) (0: off)"),
            "eval_crop_pct": (
                0 < self.eval_crop_pct < math.inf,
                "above 0 (1: the whole image; more pads it)",
            ),
        }
        for name, (ok, bounds) in checks.items():
            if not ok:
                raise BadValue(f"{name} {getattr(self, name)}: give a number {bounds}")

    @property
    def mixes(self) -> bool:
        """Whether training batches get soft targets (mixup, cutmix or label smoothing)."""
        return bool(self.mixup_alpha or self.cutmix_alpha or self.label_smoothing)


@dataclass(frozen=True)
class Stream:
    """The training stream: its shuffle, and a resume on other data. Over local uncompressed shards the
    stream reads the epoch's one random order of every sample (`ssl_vit.data.stream.epoch_order`), and the two
    shuffle options do not apply; they shape the stream of remote and compressed shards.

    Args:
        shuffle_buffer: samples in the raw-bytes shuffle buffer of each training worker (remote shards).
        segment_shards: a training worker draws its remote shards in segments of this many, each shuffled
            on its own; a resumed run re-reads (without decoding) at most one segment per worker to get
            back to where it stopped (`ssl_vit.data.stream.pipeline`).
        on_data_change: a resume whose training shards or manifest differ from the checkpoint's
            (`ssl_vit.data.stream.identity`) cannot be exact: `warn` says so in one line and goes on, `refuse`
            stops with that line.
    """

    shuffle_buffer: int = 2000
    segment_shards: int = 4
    on_data_change: Literal["warn", "refuse"] = "warn"

    def __post_init__(self) -> None:
        check_counts({"segment_shards": self.segment_shards, "shuffle_buffer": self.shuffle_buffer})
        if self.on_data_change not in ("warn", "refuse"):
            raise BadValue(f"on_data_change must be 'warn' or 'refuse', got {self.on_data_change!r}")


@dataclass(frozen=True)
class Limits:
    """How long reads may take, how often they are retried, and the largest image read.

    Args:
        read_retries: a remote shard, manifest or shard check (http(s), fsspec, `pipe:`) that fails is
            tried this many more times, waiting 1 s, 2 s, 4 s, ... (at most 30 s) between tries; a shard
            that still fails is skipped and counted, a manifest that still fails stops the run.
        read_timeout_s: a remote read that gets no byte for this long has failed (and is retried).
        loader_timeout_s: with DataLoader workers, no batch for this long ends the run with one line
            naming the split's shards; by default twice the longest a shard read can take before it
            gives up (every try timing out: 782 s with the defaults above).
        max_image_pixels: an image of more pixels (width x height, from its header) is skipped and
            counted without being decoded; null: no limit. The default is PIL's own warning threshold
            (89.5 Mpx), beyond which PIL decodes with a warning; PIL refuses twice as many anyway.
    """

    read_retries: int = 5
    read_timeout_s: float = 60.0
    loader_timeout_s: float | None = None
    max_image_pixels: int | None = MAX_IMAGE_PIXELS

    def __post_init__(self) -> None:
        check_counts({"max_image_pixels": self.max_image_pixels})
        check_seconds({"loader_timeout_s": self.loader_timeout_s})
        read_policy(asdict(self))  # one line for a bad read_retries or read_timeout_s

    @property
    def policy(self) -> ReadPolicy:
        """What remote reads retry and wait (`ssl_vit.storage.remote`)."""
        return read_policy(asdict(self))

    def loader_timeout(self) -> float:
        return self.loader_timeout_s or 2 * self.policy.worst_case_s()


GROUPS = {"augment": Augment, "stream": Stream, "limits": Limits}
DEFAULTS = {group: cls() for group, cls in GROUPS.items()}  # frozen: one instance serves every default
# Each grouped option's flat name -> its place: `crop_scale` -> `augment.crop_scale`.
MOVED = {field.name: f"{group}.{field.name}" for group, cls in GROUPS.items() for field in fields(cls)}


def grouped(flat: Mapping[str, Any]) -> dict[str, Any]:
    """`ShardDataModule` arguments from flat keys (a suite's `data:` block, a protocol's transform, a run
    config written before the groups): each group's keys gathered into its dataclass, the rest as given.
    A group given whole (`augment=Augment(...)`) is refused beside its flat keys: one would be lost."""
    out = {key: value for key, value in flat.items() if key not in MOVED}
    for group, cls in GROUPS.items():
        given = {field.name: flat[field.name] for field in fields(cls) if field.name in flat}
        if given and group in flat:
            raise BadValue(f"{', '.join(given)} and {group} are both given: give {group} alone")
        if given:
            out[group] = cls(**given)
    return out


def check_groups(args: Mapping[str, Any]) -> None:
    """One line for a group given as something other than its options (`augment: null`, a list): the
    CLI's parser takes such a value for a dataclass and fails only when it builds the data module, in a
    traceback (a word, `augment: pretrain`, it refuses as it parses)."""
    for group, cls in GROUPS.items():
        value = args.get(group, {})
        if not isinstance(value, (Mapping, cls)):
            example = f"{group}: {{{fields(cls)[0].name}: ...}}"
            raise BadValue(
                f"{group}: {shown(value)} is not a group of options: give its keys as a mapping ({example}) "
                "or leave it out for the defaults"
            )
