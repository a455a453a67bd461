"""The stream: shard URLs -> webdataset stages -> batches `{"image", "label", "key", "skipped",
"unreadable"}`, plus `"mask"` when the samples carry segmentation masks (`seg.png`).

Two kinds of stream (every rank must run the same number of steps, or DDP hangs):

- training, a fixed number of batches per rank per epoch so every rank steps together: over local
  uncompressed shards, the rank's slices of the epoch's one random order of every sample, read back
  sample by sample (`ssl_vit.data.stream.epoch_order`: the order, the slots, the elastic resume); over remote
  or compressed shards, which cannot be read at random, shards resampled per rank and worker through a
  shuffle buffer over raw bytes (what the rest of this docstring describes);
- exact pass: shards split by rank and worker so every sample is seen exactly once across ranks.

Rank and world size are arguments of `ShardStream`, read by the datamodule in the main process: a
DataLoader worker has no process group, so webdataset's own `split_by_node` would see rank 0 in every
worker of every rank and duplicate the data.

A training stream can be resumed exactly where a checkpoint left it. Each worker's stream is cut into
segments of `segment_shards` shards; a segment's shard draw and shuffle are seeded by
`(seed, epoch, rank, worker, segment)`, and each sample's augmentation by its position
`(segment, index)` in the shuffled segment. So a worker's position is three numbers (batches delivered,
segment, samples of the segment consumed), carried by every batch in `stream`, and a resumed worker
rebuilds its segment and skips the consumed samples before decoding them: resuming costs reading at
most one segment's raw bytes per worker, never decoding them again. Stepping over batches that were
never consumed (a loss-spike rollback) works the same way (`WorkerPosition.skip`).

Bad samples (an image `samples.open_image` refuses, a label `parse_label` refuses, a mask `read_mask`
refuses, an unreadable shard) are skipped, logged with their key and shard, and counted; each batch
carries in `skipped` how many its worker dropped since its previous batch (and in `unreadable` the
shards it could not open since then, by URL), so the count reaches the main process and can be logged
as a metric (`ssl_vit.data.skip_log.LogSkippedSamples`). A stream without a usable sample: `DryShards`.
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import count, islice

import numpy as np
import torch
import webdataset as wds
from PIL import Image
from torch.utils.data import IterableDataset, get_worker_info

from ssl_vit.data.format.masks import IGNORE_INDEX, MASK_MEMBER, read_mask
from ssl_vit.data.format.members import MAX_IMAGE_PIXELS, RGB, BadSample, Bands, max_member_bytes, parse_label
from ssl_vit.data.stream import samples
from ssl_vit.data.stream.device_decode import DeferredCrop, collate_jpegs
from ssl_vit.data.stream.epoch_order import EpochOrder, SampleIndex, SampleReader, UnreadableShard
from ssl_vit.data.stream.samples import SkipCounter, open_image, transform_image
from ssl_vit.data.stream.tar_reader import tar_samples
from ssl_vit.errors import NoUsableData
from ssl_vit.storage.remote import DEFAULT, ReadPolicy

log = logging.getLogger("ssl_vit.data")


@dataclass(frozen=True)
class WorkerPosition:
    """Where one training worker's stream stands: `batches` it delivered that training consumed, and
    the `offset` of the next sample in its shuffled `segment`; `skip`: samples it still passes over,
    without decoding them, before its next batch (batches a rollback stepped over, counted in
    `batches` already)."""

    batches: int = 0
    segment: int = 0
    offset: int = 0
    skip: int = 0


@dataclass(frozen=True)
class OrderStart:
    """Where a training pass over an indexed epoch (`ssl_vit.data.stream.epoch_order`) starts: the samples of
    the epoch's order that training consumed before it, on all ranks together."""

    samples: int = 0


@dataclass(frozen=True)
class ResumePlan:
    """How to continue a partly consumed epoch: each logical worker's position, and the rotation that
    makes the DataLoader's round robin continue with the worker that was next (`first`)."""

    workers: dict[int, WorkerPosition]
    first: int = 0


def stream_seed(*parts: int) -> int:
    """A 63-bit seed mixing integers (numpy's SeedSequence: unlike webdataset's `make_seed`, nearby
    tuples such as (0, 1, 0) and (0, 0, 31) do not collide, and nothing depends on PYTHONHASHSEED)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(2, np.uint64)[0] >> 1)


class ShardStream(IterableDataset):
    """One rank's stream of batches over `urls`; a training stream when `batches_per_epoch` is set,
    otherwise an exact pass. Load it with `DataLoader(stream, batch_size=None, num_workers=...)`.

    The webdataset pipeline is built inside each worker (in `__iter__`), where the worker id is known;
    `epoch` and `resume` are set from the main process before each pass (see
    `ssl_vit.data.stream.loaders.EpochLoader`).
    `classes` and `keys` keep only the samples with these labels and these `__key__`s. Remote shards
    are read with `read_policy` (`ssl_vit.storage.remote`: retries, read timeout). A sample's `seg.png`
    is read whenever it has one; with `masks` (its split's manifest says `"masks": true`) a sample
    without one is a bad sample. With `require_labels` (a task that trains or scores on labels) so is a
    sample without a label (-1). An image of more than `max_image_pixels` is one too, from its header.
    """

    def __init__(
        self,
        urls: list[str],
        *,
        rank: int,
        world_size: int,
        batch_size: int,
        transform: Callable[[Image.Image], torch.Tensor],
        array_transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
        bands: Bands = RGB,
        array_refusal: str = "",
        classes: Sequence[int] | None = None,
        keys: Collection[str] | None = None,
        num_classes: int | None = None,
        masks: bool = False,
        require_labels: bool = False,
        max_image_pixels: int | None = MAX_IMAGE_PIXELS,
        seed: int = 0,
        batches_per_epoch: int | None = None,
        shuffle_buffer: int = 1000,
        segment_shards: int = 4,
        read_policy: ReadPolicy = DEFAULT,
        index: SampleIndex | None = None,
    ):
        super().__init__()
        self.urls = list(urls)
        self.rank, self.world_size = rank, world_size
        self.batch_size = batch_size
        self.transform, self.array_transform = transform, array_transform
        self.bands, self.array_refusal = bands, array_refusal
        self.classes = frozenset(classes) if classes is not None else None
        self.keys = frozenset(keys) if keys is not None else None
        self.num_classes = num_classes
        self.masks = masks
        self.require_labels, self.max_image_pixels = require_labels, max_image_pixels
        self.said_filled = False  # whether this worker has said it filled in missing masks (`_masks`)
        self.seed = seed
        self.batches_per_epoch = batches_per_epoch
        self.shuffle_buffer = shuffle_buffer
        self.segment_shards = segment_shards
        self.read_policy = read_policy
        self.index = index
        self.epoch = 0
        self.resume: ResumePlan | OrderStart | None = None

    def __len__(self) -> int:
        if self.batches_per_epoch is None:
            raise TypeError("an exact pass has no length known in advance")
        return self.batches_per_epoch

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        physical, num_workers = (info.id, info.num_workers) if info else (0, 1)
        counter = SkipCounter(limit=samples.MAX_SKIPS_IN_A_ROW if self.batches_per_epoch else None)
        if self.batches_per_epoch and self.index is not None:
            start = self.resume or OrderStart()
            batches = self._ordered_batches(start.samples, physical, num_workers, counter, info is not None)
        elif self.batches_per_epoch:
            first = self.resume.first if self.resume else 0
            worker = (physical + first) % num_workers  # see ResumePlan
            batches = self._training_batches(worker, num_workers, counter, in_worker=info is not None)
        else:
            batches = wds.DataPipeline(*self._exact_stages(counter))
        for batch in batches:
            batch["skipped"] = torch.tensor(counter.take())
            batch["unreadable"] = counter.take_unreadable()
            yield batch
        counter.end_run()
        if counter.pending:
            log.warning(
                "%d bad samples at the end of a stream with no batch left to report them", counter.pending
            )

    # --- training ---------------------------------------------------------------------------------

    def share(self, worker: int, num_workers: int) -> int:
        """Batches of this rank's epoch that `worker` delivers: the DataLoader takes one batch from each
        worker in turn and moves on when one is done, so the rank yields exactly batches_per_epoch."""
        n = self.batches_per_epoch
        return n // num_workers + (worker < n % num_workers)

    def _ordered_batches(
        self, start: int, worker: int, num_workers: int, counter: SkipCounter, in_worker: bool
    ) -> Iterator[dict]:
        """This worker's batches of the rest of the epoch's order (`ssl_vit.data.stream.epoch_order`) after
        the `start` samples consumed: data steps `worker, worker + num_workers, ...` from there, this rank's
        slice of each. `stream` in each batch: the samples of the order consumed once it is."""
        step = self.batch_size * self.world_size
        steps = (self.batches_per_epoch * step - start) // step
        order = EpochOrder(self.index, self.seed, self.epoch)
        reader = SampleReader(self.index, max_member_bytes(self.max_image_pixels))
        try:
            for t in range(worker, steps, num_workers):
                first = start + t * step + self.rank * self.batch_size
                batch = self.collate(
                    [
                        self._ordered_sample(order, reader, g, counter, in_worker)
                        for g in range(first, first + self.batch_size)
                    ]
                )
                batch["stream"] = torch.tensor(start + (t + 1) * step)
                yield batch
        finally:
            reader.close()

    def _ordered_sample(
        self, order: EpochOrder, reader: SampleReader, g: int, counter: SkipCounter, in_worker: bool
    ) -> dict:
        """The sample at position `g`, decoded and augmented with the seed of `g`. One that cannot be used
        is skipped and counted, and the next usable one of the order takes its place (so the batch keeps
        its size, and that sample comes twice in the epoch); the SkipCounter's limit ends a stream of
        nothing but bad samples."""
        with _seeded_rngs(stream_seed(self.seed, self.epoch, g, 3), restore=not in_worker):
            for later in count(g):
                try:
                    raw = reader.read(*order.locate(later))
                    raw["__label__"] = self.label_of(raw)
                    out = self.decode(raw)
                except BadSample as err:  # a shard gone since it was indexed is also named
                    (counter.shard_failed if isinstance(err, UnreadableShard) else counter)(err)
                    continue
                counter.end_run()
                return out
        raise AssertionError("unreachable: count() does not end")

    def _training_batches(
        self, worker: int, num_workers: int, counter: SkipCounter, in_worker: bool
    ) -> Iterator[dict]:
        start = self.resume.workers.get(worker, WorkerPosition()) if self.resume else WorkerPosition()
        base = (self.seed, self.epoch, self.rank, worker)
        samples_ = islice(self._segments(base, start, counter), start.skip, None)  # raw: nothing decoded
        decoded = (
            out
            for sample in samples_
            if (out := self._decode_seeded(sample, base, counter, in_worker)) is not None
        )
        batches = wds.batched(self.batch_size, collation_fn=self.collate, partial=False)(
            counter.passed(decoded)
        )
        for done, batch in enumerate(islice(batches, self.share(worker, num_workers) - start.batches), 1):
            segment, offset = batch.pop("last_position")
            batch["stream"] = (worker, start.batches + done, segment, offset)
            yield batch

    def _segments(self, base: tuple, start: WorkerPosition, counter: SkipCounter) -> Iterator[dict]:
        """Raw samples (label parsed and filtered, image still bytes) of segments start.segment, ...,
        each shuffled on its own, with `__position__` = (segment, index) added; the first
        `start.offset` samples of the first segment are skipped before anything is decoded."""
        dry = DryShards(self.urls)
        for segment in count(start.segment):
            draw = random.Random(stream_seed(*base, segment, 0))
            shards = [{"url": url} for url in draw.choices(self.urls, k=self.segment_shards)]
            raw = dry.source(shards)
            for stage in tar_samples(counter, self.read_policy, max_member_bytes(self.max_image_pixels)):
                raw = stage(raw)
            raw = dry.passed(self._labelled(raw, counter))
            # shuffle raw bytes before decoding: cheap to buffer, and decoding is the expensive part
            shuffle = wds.shuffle(
                self.shuffle_buffer,
                initial=min(self.shuffle_buffer, 100),
                seed=stream_seed(*base, segment, 1),
            )
            shuffled = shuffle(iter(raw))
            skip = start.offset if segment == start.segment else 0
            for index, sample in enumerate(shuffled):
                if index >= skip:
                    sample["__position__"] = (segment, index)
                    yield sample

    def _decode_seeded(self, sample: dict, base: tuple, counter: SkipCounter, in_worker: bool) -> dict | None:
        """Decode and augment one sample with the global RNGs seeded by its position, so that a resumed
        stream augments it exactly as the uninterrupted one did. Torchvision and timm transforms draw
        from the global RNGs (they take no generator); outside a worker those belong to the training
        loop, so they are saved and restored around the sample."""
        segment, index = sample["__position__"]
        with _seeded_rngs(stream_seed(*base, segment, index + 2), restore=not in_worker):
            try:
                out = self.decode(sample)
            except BadSample as err:
                counter(err)
                return None
        out["__position__"] = (segment, index + 1)
        return out

    def _labelled(self, raw: Iterable[dict], counter: SkipCounter) -> Iterator[dict]:
        """Stage: parse labels before the shuffle; drop samples the class or key filter rejects
        (cheaply, before they take buffer space) and count those whose label is unusable."""
        for sample in raw:
            try:
                label = self.label_of(sample)
            except BadSample as err:
                counter(err)
                continue
            if (self.classes is None or label in self.classes) and (
                self.keys is None or sample["__key__"] in self.keys
            ):
                sample["__label__"] = label
                yield sample

    # --- exact pass --------------------------------------------------------------------------------

    def _exact_stages(self, counter: SkipCounter) -> list:
        dry = DryShards(self.urls)
        return [
            wds.SimpleShardList(self.urls),
            lambda shards: islice(shards, self.rank, None, self.world_size),  # rank from the main process
            wds.split_by_worker,
            lambda shards: dry.source(shards, exhaustive=True),
            *tar_samples(counter, self.read_policy, max_member_bytes(self.max_image_pixels)),
            lambda raw: self._labelled(raw, counter),
            wds.map(self.decode, handler=counter),
            dry.passed,  # a sample passed when it decoded: shards of undecodable images deliver nothing
            counter.passed,
            wds.batched(self.batch_size, collation_fn=self.collate, partial=True),
        ]

    # --- samples and batches -----------------------------------------------------------------------

    def label_of(self, sample: dict) -> int:
        """The sample's label; BadSample naming its key and shard when it does not parse or is beyond
        `num_classes` (a corrupt sample, skipped and counted like the others: a `num_classes` below the
        manifest's labels is refused before anything runs, by `ShardDataModule`)."""
        try:
            label = parse_label(sample, self.num_classes)
            if self.require_labels and label < 0:
                raise BadSample("no label, and the task trains or scores on labels")
        except BadSample as err:
            raise BadSample(f"{sample.get('__key__')} in {sample.get('__url__')}: {err}") from None
        return label

    def decode(self, sample: dict) -> dict:
        """Raw sample (label parsed by `_labelled`) -> `{"__key__", "image", "label"}`, and `"mask"`
        uint8 [H, W] when it has a `seg.png`. Raises BadSample for an image or mask that cannot be
        used."""
        try:
            opened = open_image(sample, self.bands, self.max_image_pixels)
            mask = read_mask(sample, self.num_classes, self.masks, opened.size, self.max_image_pixels)
            image = transform_image(
                opened, self.transform, self.array_transform, self.bands, mask, self.array_refusal
            )
        except BadSample as err:
            raise BadSample(f"{sample.get('__key__')} in {sample.get('__url__')}: {err}") from None
        out = {"__key__": sample["__key__"], "label": sample["__label__"]}
        if mask is None:
            out["image"] = image
        else:
            out["image"], out["mask"] = image
        return out

    def collate(self, samples_: list[dict]) -> dict:
        """Samples -> batch: `image` [B,C,H,W] uint8 (8-bit pixels) or, when any sample is 16-bit or
        float, float32 in model units (8-bit ones divided by 255), `label` [B] int64, `key` list[str],
        and `mask` [B,H,W] uint8 (pixel for pixel with `image`; 255 ignored) when the samples carry
        masks. JPEGs left for the device (`decode="device"`) come as bytes and crop boxes instead
        (`device_decode`), and `image` holds only the others; `mask` always holds every sample's,
        cropped in the worker."""
        images, jpegs = collate_jpegs([s["image"] for s in samples_])
        if any(i.dtype != torch.uint8 for i in images):
            images = [i.float().div_(255) if i.dtype == torch.uint8 else i for i in images]
        empty = torch.empty(0, self.bands.channels, 0, 0, dtype=torch.uint8)
        batch = {
            "image": _stack(images) if images else empty,
            "label": torch.tensor([s["label"] for s in samples_], dtype=torch.int64),
            "key": [s["__key__"] for s in samples_],
            **jpegs,
        }
        if not jpegs and isinstance(self.transform, DeferredCrop):  # decode="device", nothing for it
            batch["decoded_on_cpu"] = torch.tensor(len(images))
        if any("mask" in s for s in samples_):
            batch["mask"] = _stack(self._masks(samples_))
        if "__position__" in samples_[-1]:
            batch["last_position"] = samples_[-1]["__position__"]
        return batch

    def _masks(self, samples_: list[dict]) -> list[torch.Tensor]:
        """The batch's masks. A split whose manifest does not say `"masks": true` may mix samples with
        and without `seg.png` (shards from other tools): those without get a mask of IGNORE_INDEX (no
        pixel scored), said once per worker; with the manifest's word they are bad samples instead."""
        shape = next(s["mask"].shape for s in samples_ if "mask" in s)
        missing = [s["__key__"] for s in samples_ if "mask" not in s]
        if missing and not self.said_filled:
            self.said_filled = True
            log.warning(
                "%s and other samples without %s are read beside samples with one: their masks are all %d "
                "(ignored); a manifest saying \"masks\": true would skip them as bad samples instead",
                missing[0], MASK_MEMBER, IGNORE_INDEX,
            )  # fmt: skip
        ignored = torch.full(shape, IGNORE_INDEX, dtype=torch.uint8)
        return [s.get("mask", ignored) for s in samples_]


def _stack(images: list[torch.Tensor]) -> torch.Tensor:
    """Images [C,H,W] -> [B,C,H,W].

    The transforms give channel-first views of HWC pixels (`transforms.to_uint8_tensor`): stack the HWC
    memory (one plain copy per image) rather than transpose every image into CHW; the batch is then a
    channels-last [B,3,H,W] view, made contiguous by `normalize` on the device."""
    hwc = all(i.dim() == 3 and i.permute(1, 2, 0).is_contiguous() for i in images)
    if hwc:
        images = [i.permute(1, 2, 0) for i in images]
    out = None
    if get_worker_info() is not None:
        # as torch's default_collate: stack straight into shared memory, so handing the batch to the
        # main process costs no extra copy (default_collate allocates it through a private storage
        # method; `share_memory_` of an empty tensor measured as fast: 15.5 ms for 128 224px images)
        out = torch.empty((len(images), *images[0].shape), dtype=images[0].dtype).share_memory_()
    stacked = torch.stack(images, out=out)
    return stacked.permute(0, 3, 1, 2) if hwc else stacked


class DryShards:
    """Fails a stream that reads every one of its shards to the end without a sample passing (empty tars,
    a class filter that keeps nothing, labels all broken; in an exact pass also images or masks that
    never decode): a resampled training stream would otherwise spin for ever, and an exact pass would
    deliver nothing, which its reader then fails on. A training stream counts the label stage (the
    shuffle buffer sits between it and decoding); its images that never decode are its SkipCounter's
    `limit`."""

    def __init__(self, urls: Sequence[str]):
        self.urls = set(urls)
        self.since: set[str] = set()  # shards read since the last sample that passed

    def source(self, shards: Iterable[dict | str], exhaustive: bool = False) -> Iterator[dict]:
        """Stage: hands shards to the opener; asked for the next one, the previous one has been read
        to its end. `exhaustive`: a finite list (exact pass) that must yield something."""
        handed = []
        for shard in shards:
            self._check()
            url = shard["url"] if isinstance(shard, dict) else shard
            self.since.add(url)
            handed.append(url)
            yield {"url": url}
        if exhaustive and handed and self.since >= set(handed):
            self.fail(handed)
        self._check()

    def passed(self, raw: Iterable[dict]) -> Iterator[dict]:
        for sample in raw:
            self.since.clear()
            yield sample

    def _check(self) -> None:
        if self.since and self.since >= self.urls:
            self.fail(sorted(self.urls))

    def fail(self, urls: list[str]) -> None:
        shown = ", ".join(urls[:3]) + (f" and {len(urls) - 3} more" if len(urls) > 3 else "")
        raise NoUsableData(
            f"no usable sample in a whole pass over {len(urls)} shard(s) ({shown}): they are empty or "
            "unreadable, none of their samples decodes (see the warnings above), or the class filter "
            "(data.init_args.classes) keeps none of their labels; check them with `ssl-vit data inspect`"
        )


@contextlib.contextmanager
def _seeded_rngs(seed: int, restore: bool):
    """The global torch, numpy and Python RNGs seeded with `seed`; with `restore`, put back afterwards."""
    saved = (torch.get_rng_state(), np.random.get_state(), random.getstate()) if restore else None
    torch.default_generator.manual_seed(seed)  # the CPU generator only: CUDA's belongs to the model
    np.random.seed(seed % 2**32)
    random.seed(seed)
    try:
        yield
    finally:
        if saved is not None:
            torch.set_rng_state(saved[0])
            np.random.set_state(saved[1])
            random.setstate(saved[2])


def iter_samples(
    urls: Iterable[str],
    handler: Callable[[Exception], bool],
    policy: ReadPolicy = DEFAULT,
    max_pixels: int | None = MAX_IMAGE_PIXELS,
) -> Iterator[dict]:
    """Raw samples of `urls` in order, one process (for `inspect`); members too large for an image of
    `max_pixels` are skipped unread (`max_member_bytes`)."""
    stages = tar_samples(handler, policy, max_member_bytes(max_pixels))
    return iter(wds.DataPipeline(wds.SimpleShardList(list(urls)), *stages))
