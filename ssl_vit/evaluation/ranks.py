"""`ssl-vit compare` under `torchrun`: the checkpoints (each run of a group on its own) dealt out to
the ranks, each evaluated whole on its rank's device, the evaluations gathered on rank 0.

A checkpoint's evaluation is its forward passes (one per split, `FeatureCache`), its trained
protocols and its heads' mean attention distances (`suite.evaluate`'s attention_images); dealing whole
checkpoints keeps every evaluation exactly what it is in one process (same seeds, same full passes, a
Lightning trainer of its own), so the table does not depend on the number of ranks, and the ranks need
no collective until the end.

    torchrun --nproc-per-node 4 -m ssl_vit compare a=A.ckpt b=B.ckpt c=C.ckpt d=D.ckpt --suite S --out OUT
"""

from __future__ import annotations

import os
import traceback
from datetime import timedelta
from typing import NamedTuple

import torch.distributed as dist

from ssl_vit import progress
from ssl_vit.errors import NoUsableData, user_error_message
from ssl_vit.evaluation.suite import Evaluation, Suite, evaluate

# The images each checkpoint's mean attention distances are measured on: a few suffice, a head's mean
# attention distance varies little from image to image.
ATTENTION_IMAGES = 64
# Ranks reach the final gather when their last checkpoint is done, hours apart when fine-tuning
# protocols differ; the rendezvous waits that long rather than fail the finished ranks.
GATHER_TIMEOUT = timedelta(hours=24)


class Failed(NamedTuple):
    """A checkpoint whose evaluation raised: the error in one line, and its traceback for error.txt;
    `unusable`: the line of a NoUsableData, which every checkpoint would fail on alike."""

    error: str
    traceback: str
    unusable: str = ""


def failure(err: Exception) -> Failed:
    line = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300]
    unusable = (user_error_message(err) or "") if isinstance(err, NoUsableData) else ""
    return Failed(line, traceback.format_exc(), unusable)


def rank_and_world_size() -> tuple[int, int]:
    """This process's place among torchrun's (RANK, WORLD_SIZE); (0, 1) when run alone."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def evaluate_checkpoints(
    checkpoints: dict[str, list[str]], suite: Suite
) -> dict[str, list[Evaluation | Failed]] | None:
    """checkpoints: name -> sources (a group's pretraining runs). The runs, in order, are dealt out:
    rank r evaluates runs r, r + W, r + 2W, ... (W ranks), each with its replicate index within its
    group. Returns name -> each run's `Evaluation` (record, with its attention distances, and per-image
    correctness, which rank 0's intervals and paired differences need) or its Failed, on rank 0, and
    None on the other ranks. One broken run never loses the others' results; data no run can be
    evaluated on (NoUsableData) stops every rank at its first such run, and rank 0 with the one line,
    before anything is written."""
    runs = [(name, i, source) for name, sources in checkpoints.items() for i, source in enumerate(sources)]
    grouped = {name for name, sources in checkpoints.items() if len(sources) > 1}
    rank, world_size = rank_and_world_size()
    mine: dict[tuple[str, int], Evaluation | Failed] = {}
    assigned = [(name, i, source) for j, (name, i, source) in enumerate(runs) if j % world_size == rank]
    command = "compare" if world_size == 1 else f"compare (rank {rank} of {world_size})"
    # under torchrun the ranks share a terminal: lines, not bars
    with progress.job(command, len(assigned), lines=True if world_size > 1 else None):
        for k, (name, i, source) in enumerate(assigned):
            progress.run(k, f"{name}/{i + 1}" if name in grouped else name)  # as its results.json folder
            try:
                mine[name, i] = evaluate(source, suite, replicate=i, attention_images=ATTENTION_IMAGES)
            except Exception as err:
                mine[name, i] = failure(err)
                if mine[name, i].unusable:
                    break
    if world_size > 1:
        # gloo: records and per-image statistics (CPU tensors), gathered on the CPU whatever the devices
        dist.init_process_group("gloo", timeout=GATHER_TIMEOUT)
        try:
            gathered: list | None = [None] * world_size if rank == 0 else None
            dist.gather_object(mine, gathered, dst=0)
        finally:
            dist.destroy_process_group()
        if rank != 0:
            return None
        mine = {run: outcome for part in gathered for run, outcome in part.items()}
    unusable = next((o.unusable for o in mine.values() if isinstance(o, Failed) and o.unusable), None)
    if unusable:
        raise NoUsableData(unusable)
    return {name: [mine[name, i] for i in range(len(sources))] for name, sources in checkpoints.items()}
