"""The DataLoaders of a `ShardStream`: `ShardLoader` (exact passes; one line when its workers stall)
and `EpochLoader` (training: hands the stream its epoch and resume position, tracks what training
consumed). How their workers take job signals and die is `ssl_vit.data.stream.workers`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader

from ssl_vit.data.stream.pipeline import ShardStream
from ssl_vit.data.stream.workers import DeadWorkers, Workers
from ssl_vit.errors import UserError


class ShardLoader(DataLoader):
    """A DataLoader of a `ShardStream` (`batch_size=None`) that ends the run with one line naming the
    split's shards when its workers deliver no batch for `timeout` seconds, rather than wait for ever
    on a stalled server or a stuck worker.

    The wait is torch's DataLoader `timeout`, which applies with workers only; its RuntimeError becomes
    a UserError here, and the workers are stopped at once (`Workers`), not left to outlive the run.
    Without workers the main process reads the shards itself, and every remote read times out on its
    own (`read_timeout_s`)."""

    def __init__(self, stream: ShardStream, *, split: str, timeout: float, num_workers: int, **kwargs):
        workers = Workers(num_workers)
        super().__init__(
            stream,
            batch_size=None,
            num_workers=num_workers,
            timeout=timeout if num_workers else 0,
            # A generator of its own: creating an iterator draws the workers' base seed from it rather
            # than from the global torch RNG, which belongs to the model (masks, dropout) and is part of
            # exact resume. The workers seed every random choice themselves (`ssl_vit.data.stream.pipeline`).
            generator=torch.Generator().manual_seed(0),
            worker_init_fn=workers.start,
            **kwargs,
        )
        self.split, self.wait_s, self.workers = split, timeout, workers

    def __iter__(self):
        self.workers.reset()
        iterator = super().__iter__()
        DeadWorkers.watch()
        return _Watched(iterator, self)

    def timed_out(self) -> UserError:
        """The one line for no batch in `timeout` seconds; the workers are stopped first."""
        self.workers.stop()
        urls = self.dataset.urls
        shown = ", ".join(urls[:3]) + (f" and {len(urls) - 3} more" if len(urls) > 3 else "")
        return UserError(
            f"no batch from the {self.num_workers} DataLoader worker(s) in {self.wait_s:g} s while reading "
            f"{self.split}_urls ({shown}): their server stalls or cannot be reached, or a worker is stuck; "
            "check the shards (`ssl-vit data inspect`) or raise data.init_args.limits.loader_timeout_s"
        )


class _Watched:
    """A DataLoader iterator whose timeout is its loader's one-line error (`ShardLoader`)."""

    def __init__(self, iterator, loader: ShardLoader):
        self.iterator, self.loader = iterator, loader

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return DeadWorkers.fetch(self.iterator)
        except RuntimeError as err:
            if not str(err).startswith("DataLoader timed out"):
                raise
            raise self.loader.timed_out() from None

    def __len__(self) -> int:
        return len(self.iterator)


class EpochLoader(ShardLoader):
    """The training DataLoader: hands its stream the epoch (and, once after a resume, where each worker
    stands) before starting workers, and keeps track of the batches training consumed.

    With non-persistent workers the dataset is copied into fresh workers on every `iter()`, so this is
    where the main process can tell them; Lightning only calls `set_epoch` on samplers, which a
    DataLoader over an IterableDataset does not have. What is tracked is the position of the batches
    training consumed (`record`, called by the datamodule for every training batch), not of those
    fetched: Lightning fetches one batch ahead.
    """

    def __init__(self, stream: ShardStream, start: Callable[[], tuple[int, Any]], track: Track, **kwargs):
        super().__init__(stream, split="train", persistent_workers=False, **kwargs)
        self.start, self.track = start, track
        self.epoch: int | None = None
        self.recorded = False  # whether training consumed a batch of this pass

    def __iter__(self):
        epoch, plan = self.start()
        self.dataset.epoch, self.dataset.resume = epoch, plan
        self.epoch, self.recorded = epoch, False
        self.track.begin(plan)
        return super().__iter__()

    def record(self, batch: dict) -> None:
        """Note that training consumed `batch` (it carries where the stream stands after it in `stream`)."""
        self.recorded = True
        self.track.record(batch["stream"])

    # Lightning's Stateful-loader protocol: it warns that a resume in the middle of an epoch is not
    # exact unless the training loader has these. Where the stream stands is the data module's state
    # (`ShardDataModule.state_dict`), which makes the resume exact, or says why it cannot be.
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass

    def position(self) -> dict[str, Any]:
        return {"epoch": self.epoch, **self.track.position(self)}


class Track(Protocol):
    """What training consumed of a pass, in the terms of the stream's kind
    (`ssl_vit.data.stream.position`)."""

    def begin(self, plan: Any) -> None:
        """A pass starts, afresh (`plan` None) or where `plan` says."""

    def record(self, stream: torch.Tensor) -> None:
        """Training consumed a batch whose `stream` entry says where the stream stands after it."""

    def position(self, loader: EpochLoader) -> dict[str, Any]:
        """Where the pass stands, as a checkpoint saves it."""
