"""The stream: shard URLs -> webdataset stages -> batches `{"image", "label", "key", "skipped"}`.

Two kinds of stream (DESIGN.md section 4):

- training: shards resampled per rank and worker, a shuffle buffer over raw bytes, a fixed number of
  batches per rank per epoch so every rank steps together;
- exact pass: shards split by rank and worker so every sample is seen exactly once across ranks.

Rank and world size are arguments of `ShardStream`, read by the datamodule in the main process: a
DataLoader worker has no process group, so webdataset's own `split_by_node` would see rank 0 in every
worker of every rank and duplicate the data. Every random choice is seeded from
`(seed, epoch, rank, worker)`, so a stream's position is a function of those and of the batches
consumed (what a checkpoint needs to resume it).

Bad samples (undecodable image, missing image member, unparsable label, unreadable shard) are skipped,
logged with their key and shard, and counted; each batch carries in `skipped` how many its worker
dropped since its previous batch, so the count reaches the main process and can be logged as a metric
(`ssl_vit.data.datamodule.LogSkippedSamples`).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import islice

import numpy as np
import torch
import webdataset as wds
from PIL import Image
from torch.utils.data import IterableDataset, get_worker_info
from webdataset.utils import make_seed

from ssl_vit.data import samples
from ssl_vit.data.samples import BadSample, SkipCounter, decode_image, parse_label
from ssl_vit.data.tar_reader import tar_samples

log = logging.getLogger("ssl_vit.data")


class ShardStream(IterableDataset):
    """One rank's stream of batches over `urls`; a training stream when `batches_per_epoch` is set,
    otherwise an exact pass. Load it with `DataLoader(stream, batch_size=None, num_workers=...)`.

    The webdataset pipeline is built inside each worker (in `__iter__`), where the worker id is known;
    `epoch` is set from the main process before each pass (see `EpochLoader`).
    """

    def __init__(
        self,
        urls: list[str],
        *,
        rank: int,
        world_size: int,
        batch_size: int,
        transform: Callable[[Image.Image], torch.Tensor],
        classes: Sequence[int] | None = None,
        seed: int = 0,
        batches_per_epoch: int | None = None,
        shuffle_buffer: int = 1000,
    ):
        super().__init__()
        self.urls = list(urls)
        self.rank, self.world_size = rank, world_size
        self.batch_size = batch_size
        self.transform = transform
        self.classes = frozenset(classes) if classes is not None else None
        self.seed = seed
        self.batches_per_epoch = batches_per_epoch
        self.shuffle_buffer = shuffle_buffer
        self.epoch = 0

    def __len__(self) -> int:
        if self.batches_per_epoch is None:
            raise TypeError("an exact pass has no length known in advance")
        return self.batches_per_epoch

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info else (0, 1)
        seed = make_seed(self.seed, self.epoch, self.rank, worker)
        if info is not None:
            # Augmentations (torchvision, timm) draw from the global RNGs; in a worker process those are
            # ours to seed, which makes a training stream a function of (seed, epoch, rank, worker).
            torch.manual_seed(seed)
            random.seed(seed)
            np.random.seed(seed)
        counter = SkipCounter(limit=samples.MAX_SKIPS_IN_A_ROW if self.batches_per_epoch else None)
        stages = (
            self._training_stages(seed, worker, num_workers, counter)
            if self.batches_per_epoch
            else self._exact_stages(counter)
        )
        for batch in wds.DataPipeline(*stages):
            batch["skipped"] = torch.tensor(counter.take())
            yield batch
        if counter.pending:
            log.warning(
                "%d bad samples at the end of a stream with no batch left to report them", counter.pending
            )

    def _training_stages(self, seed: int, worker: int, num_workers: int, counter: SkipCounter) -> list:
        # This worker's share of the rank's batches; the DataLoader interleaves workers and moves on when
        # one is done, so the rank yields exactly batches_per_epoch.
        n = self.batches_per_epoch
        share = n // num_workers + (worker < n % num_workers)
        return [
            # an endless, seeded draw of shards, different for every (epoch, rank, worker)
            wds.ResampledShards(self.urls, seed=seed, worker_seed=lambda: 0, deterministic=True),
            *tar_samples(counter),
            # shuffle raw bytes before decoding: cheap to buffer, and decoding is the expensive part
            wds.shuffle(self.shuffle_buffer, initial=min(self.shuffle_buffer, 100), seed=seed),
            wds.map(self.decode, handler=counter),
            counter.passed,
            wds.batched(self.batch_size, collation_fn=self.collate, partial=False),
            lambda batches: islice(batches, share),
        ]

    def _exact_stages(self, counter: SkipCounter) -> list:
        return [
            wds.SimpleShardList(self.urls),
            lambda shards: islice(shards, self.rank, None, self.world_size),  # rank from the main process
            wds.split_by_worker,
            *tar_samples(counter),
            wds.map(self.decode, handler=counter),
            counter.passed,
            wds.batched(self.batch_size, collation_fn=self.collate, partial=True),
        ]

    def collate(self, samples: list[dict]) -> dict:
        """Samples -> batch: `image` [B,3,H,W] uint8, `label` [B] int64, `key` list[str]. The datamodule
        turns `image` into normalised floats on the device (`ShardDataModule.prepare_batch`)."""
        images = [s["image"] for s in samples]
        # The transforms give channel-first views of HWC pixels (`transforms.to_uint8_tensor`): stack
        # the HWC memory (one plain copy per image) rather than transpose every image into CHW; the
        # batch is then a channels-last [B,3,H,W] view, made contiguous by `normalize` on the device.
        hwc = all(i.dim() == 3 and i.permute(1, 2, 0).is_contiguous() for i in images)
        if hwc:
            images = [i.permute(1, 2, 0) for i in images]
        out = None
        if get_worker_info() is not None:
            # as torch's default_collate: stack straight into shared memory, so handing the batch to
            # the main process costs no extra copy
            storage = images[0]._typed_storage()._new_shared(len(images) * images[0].numel())
            out = images[0].new(storage).resize_(len(images), *images[0].shape)
        stacked = torch.stack(images, out=out)
        return {
            "image": stacked.permute(0, 3, 1, 2) if hwc else stacked,
            "label": torch.tensor([s["label"] for s in samples], dtype=torch.int64),
            "key": [s["__key__"] for s in samples],
        }

    def decode(self, sample: dict) -> dict | None:
        """Raw sample -> `{"__key__", "image", "label"}`; None (dropped, not an error) when the class
        filter rejects its label. Raises BadSample for anything unusable."""
        try:
            label = parse_label(sample)
            if self.classes is not None and label not in self.classes:
                return None
            image = decode_image(sample, self.transform)
        except BadSample as err:
            raise BadSample(f"{sample.get('__key__')} in {sample.get('__url__')}: {err}") from None
        return {"image": image, "label": label}


def iter_samples(urls: Iterable[str], handler: Callable[[Exception], bool]) -> Iterator[dict]:
    """Raw samples of `urls` in order, one process (for `inspect`)."""
    return iter(wds.DataPipeline(wds.SimpleShardList(list(urls)), *tar_samples(handler)))
