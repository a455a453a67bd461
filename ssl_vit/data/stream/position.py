"""Where a data module's training stream stands, as a checkpoint saves it, and where its next training
pass starts: afresh, where a resumed checkpoint stopped (`load`), or past batches a rollback skips
(`skip`).

Over local shards the stream reads the epoch's global order (`ssl_vit.data.stream.epoch_order`), a function of
the seed, the epoch and the data only: a position is the epoch and the samples of its order consumed,
the same on every rank, and a resume continues there on any number of ranks and workers, exactly, as
long as a data step (batch_size x ranks) keeps its size. Over remote or compressed shards every worker's
stream is a function of (seed, epoch, rank, worker, segment), so a position is the epoch and, per rank
and worker, the batches consumed and where in its segment they ended (`stream.WorkerPosition`): exact
with the run's own ranks and workers only."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import torch

from ssl_vit.data.stream.loaders import EpochLoader
from ssl_vit.data.stream.pipeline import OrderStart, ResumePlan, ShardStream, WorkerPosition
from ssl_vit.errors import UserError

log = logging.getLogger("ssl_vit.data")


class TrainingPosition:
    """The seed, the next epoch, the training loader (`EpochLoader`, which tracks the batches training
    consumed), and a position to start the next pass from: restored (`load`) or moved (`skip`)."""

    def __init__(self, seed: int) -> None:
        self.seed, self.epoch = seed, 0
        self.loader: EpochLoader | None = None
        self._resume: dict | None = None  # a restored position, used by the next training pass
        self._moved: tuple[int, ResumePlan | OrderStart] | None = None  # where `skip` restarts the pass

    @staticmethod
    def track(stream: ShardStream) -> OrderTrack | SegmentTrack:
        """The training loader's record of what training consumed, in the terms of `stream`'s kind."""
        return OrderTrack() if stream.index is not None else SegmentTrack()

    @property
    def started(self) -> bool:
        """Whether a training pass has started (its loader has an epoch)."""
        return self.loader is not None and self.loader.epoch is not None

    def start(
        self, epoch: int | None, rank: int, world_size: int, workers: int, batches: int, step: int
    ) -> tuple:
        """`(epoch, ResumePlan or None)` of the training pass about to start: `epoch` (the trainer's;
        None: a count of passes) and, once after a resume or a skip, where each worker stands in it.
        `workers`: the DataLoader's (0: the main process), `batches`: per rank per epoch, `step`: the
        samples of a data step (batch_size x ranks).

        Lightning starts the first training iterator before it restores its loops (to count the steps
        for the schedule), so after a resume the epoch comes from the restored position, not from the
        trainer."""
        saved, self._resume = self._resume, None
        moved, self._moved = self._moved, None
        if moved is not None:
            epoch, plan = moved
        elif saved is not None:
            epoch, plan = self.loader.track.resume(saved, rank, world_size, workers, batches, step)
        else:
            epoch, plan = (self.epoch if epoch is None else epoch), None
        self.epoch = epoch + 1
        return epoch, plan

    def state(self) -> dict[str, Any]:
        """The seed, the next epoch, and where every rank's workers stand in the current one (gathered:
        only rank 0 writes the checkpoint, every rank resumes from it; Lightning builds the checkpoint on
        every rank, so the collective is matched)."""
        state: dict[str, Any] = {"seed": self.seed, "epoch": self.epoch}
        if self.started:
            local = self.loader.position()
            ranks = [local]
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                ranks = [None] * torch.distributed.get_world_size()
                torch.distributed.all_gather_object(ranks, local)
            state["position"] = {"ranks": ranks}
        return state

    def load(self, state: dict[str, Any]) -> None:
        self.seed, self.epoch = state["seed"], state["epoch"]
        self._resume = state.get("position")

    def skip(self, count: int, batch_size: int, workers: int, batches: int) -> tuple[int, int | None]:
        """Moves the stream `count` batches past the last one training consumed, up to the end of the
        epoch (`ShardDataModule.skip_batches`); `(batches skipped, where the epoch's next pass restarts
        (its batches fetched so far) or None when the epoch is over)`."""
        step = batch_size * self.loader.dataset.world_size
        count, plan, restart = self.loader.track.skip(count, batch_size, step, max(1, workers), batches)
        if plan is None:
            return count, None
        self._moved = (self.loader.epoch, plan)
        return count, restart


class OrderTrack:
    """A stream that reads the epoch's global order: the samples of the order consumed (all ranks)."""

    def __init__(self) -> None:
        self.samples = 0

    def begin(self, plan: OrderStart | None) -> None:
        self.samples = plan.samples if plan is not None else 0

    def record(self, stream: torch.Tensor) -> None:
        self.samples = int(stream)

    def position(self, loader: EpochLoader) -> dict[str, Any]:
        stream = loader.dataset
        return {
            "order": "global",
            "samples": self.samples,
            "step": stream.batch_size * stream.world_size,
            "world": [stream.world_size, loader.num_workers],
        }

    @staticmethod
    def resume(saved: dict, rank: int, world_size: int, workers: int, batches: int, step: int) -> tuple:
        """`(epoch, OrderStart or None)` from a checkpoint's position `saved`, for a stream that reads the
        epoch's global order: exact on any number of ranks and workers (one line says so when they
        changed); None at the end of an epoch. A position saved by a stream of segments (a run from
        before, or over remote shards) cannot be placed in the order: its epoch starts again, said in one
        warning."""
        mine = saved["ranks"][0]
        epoch = mine["epoch"]
        if mine.get("order") != "global":
            log.warning(
                "the checkpoint's training position was saved by a stream of shard segments (remote or "
                "compressed shards, or an older ssl-vit): epoch %d starts again from its first sample",
                epoch,
            )
            return epoch, None
        check_step(saved, world_size, step // world_size)
        if mine["samples"] + step > batches * step:
            return epoch + 1, None  # saved at the end of the epoch: the next one starts afresh
        if mine["world"] != [world_size, workers]:
            log.warning(
                "resuming on %d rank(s) x %d DataLoader worker(s), saved on %d x %d: the epoch's order does "
                "not depend on them, so the resume is exact (epoch %d continues after its %d samples trained "
                "on)",
                world_size, workers, *mine["world"], epoch, mine["samples"],
            )  # fmt: skip
        return epoch, OrderStart(mine["samples"])

    def skip(self, count: int, batch_size: int, step: int, workers: int, batches: int) -> tuple:
        """`(data steps skipped, OrderStart or None at the epoch's end, batches done)`: `count` data
        steps further in the order."""
        done = self.samples
        count = max(0, min(count, (batches * step - done) // step))
        self.samples = done + count * step
        if self.samples + step > batches * step:
            return count, None, None
        return count, OrderStart(self.samples), self.samples // step


class SegmentTrack:
    """A stream of shard segments: per DataLoader worker, the batches consumed and where in its segment
    they ended."""

    def __init__(self) -> None:
        self.consumed: dict[int, WorkerPosition] = {}

    def begin(self, plan: ResumePlan | None) -> None:
        self.consumed = dict(plan.workers) if plan is not None else {}

    def record(self, stream: torch.Tensor) -> None:
        worker, batches, segment, offset = (int(v) for v in stream)
        self.consumed[worker] = WorkerPosition(batches, segment, offset)

    def position(self, loader: EpochLoader) -> dict[str, Any]:
        return {
            "num_workers": max(1, loader.num_workers),
            "workers": {w: [p.batches, p.segment, p.offset, p.skip] for w, p in self.consumed.items()},
        }

    @staticmethod
    def resume(saved: dict, rank: int, world_size: int, workers: int, batches: int, step: int) -> tuple:
        """`(epoch, ResumePlan or None)` from a checkpoint's position `saved` for this rank: exact with the
        run's ranks and workers; with others, the rest of the epoch reads new segments (said in a warning);
        None at the end of an epoch (the next one starts afresh)."""
        workers = max(1, workers)
        ranks = saved["ranks"]
        mine = ranks[rank] if len(ranks) == world_size else ranks[0]
        epoch = mine["epoch"]
        positions = {int(w): WorkerPosition(*p) for w, p in mine["workers"].items()}
        consumed = sum(p.batches for p in positions.values())
        if consumed >= batches:
            return epoch + 1, None  # saved at the end of the epoch: the next one starts afresh
        if len(ranks) != world_size or mine["num_workers"] != workers:
            log.warning(
                "exact resume needs the run's number of ranks and DataLoader workers (saved %d x %d, now "
                "%d x %d): the rest of epoch %d reads new segments of the shards, so some samples of this "
                "epoch may repeat",
                len(ranks), mine["num_workers"], world_size, workers, epoch,
            )  # fmt: skip
            after = 1 + max((p.segment for p in positions.values()), default=0)
            return epoch, ResumePlan({w: WorkerPosition(0, after, 0) for w in range(workers)})
        return epoch, ResumePlan(positions, first=consumed % workers)

    def skip(self, count: int, batch_size: int, step: int, workers: int, batches: int) -> tuple:
        """`(batches skipped, ResumePlan or None at the epoch's end, batches done)`: each worker passes
        over its share of the skipped batches' samples (`WorkerPosition.skip`)."""
        positions = dict(self.consumed)
        consumed = sum(p.batches for p in positions.values())
        count = max(0, min(count, batches - consumed))
        for index in range(consumed, consumed + count):  # the DataLoader's round robin: batch i, worker i % W
            p = positions.get(index % workers, WorkerPosition())
            positions[index % workers] = replace(p, batches=p.batches + 1, skip=p.skip + batch_size)
        self.consumed = positions  # what a checkpoint saved before the next batch records
        if consumed + count >= batches:
            return count, None, None
        return count, ResumePlan(positions, first=(consumed + count) % workers), consumed + count


def check_step(saved: dict, world_size: int, batch_size: int) -> None:
    """One line when a resume would change the samples of a data step (batch_size x ranks) of a run
    that reads the global order: its global batch is the run's own, so the same size, split over the
    ranks there are now, is what the user sets."""
    mine = saved.get("ranks", [{}])[0] if isinstance(saved, dict) else {}
    if not isinstance(mine, dict) or mine.get("order") != "global" or mine["step"] == batch_size * world_size:
        return
    step, (ranks, _) = mine["step"], mine["world"]
    fix = (
        f"set --data.init_args.batch_size {step // world_size}"
        if step % world_size == 0
        else f"run on a number of ranks that divides {step}"
    )
    raise UserError(
        f"this run's global batch is {step} ({step // ranks} per rank on {_ranks(ranks)}), and "
        f"{batch_size} per rank on {_ranks(world_size)} would make it {batch_size * world_size}: {fix}, "
        "so that the resume continues the epoch exactly"
    )


def _ranks(n: int) -> str:
    return f"{n} rank" + ("s" if n != 1 else "")
