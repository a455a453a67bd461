"""`LogSkippedSamples`: the data pipeline's skip counts and unreadable shards as metrics and lines."""

from __future__ import annotations

import logging
from typing import Any

import pytorch_lightning as pl

log = logging.getLogger("ssl_vit.data")


class LogSkippedSamples(pl.Callback):
    """Logs `data/skipped_{train,val,test}`: bad samples dropped by the data pipeline, summed over
    batches and ranks (the pipeline also logs each one as a warning with its key and shard); and at the
    end of each epoch (of training, or a validation or test pass) one line naming the shards that could
    not be opened in it (deleted, or unreachable after their retries), with `data/unreadable_shards_*`:
    a pass that quietly read 3 of its 4 shards would otherwise look like any other."""

    def __init__(self) -> None:
        self.unreadable: dict[str, set[str]] = {"train": set(), "val": set(), "test": set()}

    def _log(self, pl_module: pl.LightningModule, batch: Any, stage: str) -> None:
        if not isinstance(batch, dict):
            return
        for count in ("skipped", "decoded_on_cpu"):  # per batch, summed over the epoch and the ranks
            if count in batch:
                pl_module.log(
                    f"data/{count}_{stage}", batch[count].float(), reduce_fx="sum", on_step=False,
                    on_epoch=True, sync_dist=True, batch_size=1,
                )  # fmt: skip
        self.unreadable[stage].update(batch.get("unreadable") or ())

    def _report(self, trainer, pl_module: pl.LightningModule, stage: str) -> None:
        found, self.unreadable[stage] = sorted(self.unreadable[stage]), set()
        if trainer.sanity_checking:
            return
        pl_module.log(f"data/unreadable_shards_{stage}", float(len(found)), reduce_fx="sum", sync_dist=True)
        if found:
            where = f" on rank {trainer.global_rank}" if trainer.world_size > 1 else ""
            what = {"train": f"training epoch {trainer.current_epoch}", "val": "validation", "test": "test"}
            shown = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
            log.warning(
                "%d shard(s) could not be read in the %s%s and were skipped: %s",
                len(found), what[stage], where, shown,
            )  # fmt: skip

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._log(pl_module, batch, "train")

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._log(pl_module, batch, "val")

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._log(pl_module, batch, "test")

    def on_train_epoch_end(self, trainer, pl_module):
        self._report(trainer, pl_module, "train")

    def on_validation_epoch_end(self, trainer, pl_module):
        self._report(trainer, pl_module, "val")

    def on_test_epoch_end(self, trainer, pl_module):
        self._report(trainer, pl_module, "test")
