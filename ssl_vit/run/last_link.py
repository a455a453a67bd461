"""The fit's checkpoint callback, `LastLinkCheckpoint`: `last.ckpt` a hard link to the newest checkpoint,
the previous one kept, the final state saved first (the files are `ssl_vit.checkpoints.store`'s)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pytorch_lightning.callbacks import Callback, ModelCheckpoint

from ssl_vit.checkpoints import store
from ssl_vit.internals import ModelCheckpointHooks


class LastLinkCheckpoint(ModelCheckpointHooks):
    """Lightning's ModelCheckpoint whose `last.ckpt` is a hard link to the newest checkpoint.

    `save_last="link"` (the default here) in Lightning removes `last.ckpt` and then makes a symlink: a
    kill between the two leaves no last.ckpt, and the symlink dangles once the checkpoint it points to is
    rotated away (save_top_k). A hard link is put in place by `os.replace` and keeps the data alive on
    its own. `save_last=True` (a second full write) is used where links cannot help: a monitored metric
    (Lightning would link last.ckpt to the best checkpoint, not the newest state) and remote dirpaths.
    """

    def __init__(self, *args: Any, save_last: bool | Literal["link"] | None = "link", **kwargs: Any) -> None:
        super().__init__(*args, save_last=save_last, **kwargs)
        self._previous_path = ""  # with save_top_k 1: the checkpoint before best_model_path, kept
        if self.save_last == "link" and self.monitor is not None:  # (the class's docstring)
            self.save_last = True

    @property
    def state_key(self) -> str:
        # Lightning keys callback state by class name; ModelCheckpoint's keeps the state of checkpoints
        # written before this class existed (best/last paths) restorable, and vice versa.
        return super().state_key.replace(type(self).__qualname__, ModelCheckpoint.__qualname__, 1)

    def setup(self, trainer, pl_module, stage: str) -> None:
        link = self.save_last == "link"
        if link:
            # Lightning raises for save_last="link" on a remote dirpath, known only once setup resolves it.
            self.save_last = True
        super().setup(trainer, pl_module, stage)
        if link and store.is_local(self.dirpath):
            self.save_last = "link"
        if stage == "fit" and trainer.is_global_zero and store.is_local(self.dirpath):
            # Only a fit owns its checkpoint directory (a validate may run beside a fit that is saving).
            store.remove_stale_temp_files(store.local_file(self.dirpath))
        if stage == "fit" and not any(getattr(c, "checkpoint", None) is self for c in trainer.callbacks):
            # A new list: Lightning is iterating over the current one to call this hook.
            trainer.callbacks = [_SaveFinalFirst(self), *trainer.callbacks]

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if getattr(self, "_linked_as", None):
            state["last_model_path"] = self._linked_as
        state["previous_model_path"] = self._previous_path
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved_in = state_dict.get("dirpath", self.dirpath)
        if saved_in != self.dirpath and saved_in and self.dirpath and store.is_local(self.dirpath):
            # A copied or moved run directory: its checkpoints are followed where they now are, so the
            # rotation goes on among them (Lightning keeps only best_model_path, the original's file).
            state_dict = _rebased(state_dict, store.local_file(saved_in), store.local_file(self.dirpath))
        super().load_state_dict(state_dict)
        if state_dict.get("dirpath", self.dirpath) == self.dirpath:  # as Lightning restores its paths
            self._previous_path = state_dict.get("previous_model_path", "")

    def save_unmonitored(self, trainer, candidates) -> None:
        """Lightning's, except that `save_top_k: 1` keeps the previous checkpoint until the next one is
        written: Lightning's deletes it at once, and the newest step file and `last.ckpt` are one file,
        so a single damaged file would leave nothing intact to resume (`--ckpt_path last` falls back to
        the newest checkpoint that verifies). `save_top_k: -1` keeps every checkpoint anyway."""
        if self.save_top_k != 1:
            super().save_unmonitored(trainer, candidates)
            return
        filepath = self.interpolated_name(candidates, trainer, self.best_model_path)
        older, previous = self._previous_path, self.best_model_path
        # Set before saving, as Lightning sets best_model_path: both are part of the saved state.
        self.best_model_path = filepath
        if previous and previous != filepath:
            self._previous_path = previous
        self.write_checkpoint(trainer, filepath)
        if older and older not in (previous, filepath) and self.should_remove(trainer, older, filepath):
            self.remove_checkpoint(trainer, older)

    def write_checkpoint(self, trainer, filepath: str) -> None:
        # Lightning sets last_model_path in _save_last_checkpoint, after the periodic checkpoint was
        # written; with "link" that checkpoint *is* last.ckpt, so its state would name the previous (or
        # no) last path, and a run resumed from it would link last-v1.ckpt next and keep the old one.
        self._linked_as = None
        if self.save_last == "link" and self.save_top_k != 0:
            last = self._last_path(trainer)
            if os.path.abspath(last) != os.path.abspath(filepath):
                self._linked_as = last
        try:
            super().write_checkpoint(trainer, filepath)
        finally:
            self._linked_as = None

    def on_train_end(self, trainer, pl_module) -> None:
        self.save_final(trainer)  # done already, first of the end-of-training hooks (`_SaveFinalFirst`)
        super().on_train_end(trainer, pl_module)

    def save_final(self, trainer) -> None:
        """The state at the end of training (periodic checkpoint + last), unless saved at this step.

        With step- or time-based saving, Lightning saves nothing at the end of training and writes
        last.ckpt there only if nothing was saved at all: the steps after the last periodic save would
        be missing from last.ckpt."""
        if self.save_last and not self.skips_saving(trainer):
            candidates = self.monitor_candidates(trainer)
            if self.monitor is None and self.save_top_k != 0:
                self.save_topk(trainer, candidates)
            self.save_last_checkpoint(trainer, candidates)

    def save_rolled_back(self, trainer) -> None:
        """Saves the state of a fit that a loss-spike rollback (`ssl_vit.run.nonfinite`) has returned to
        the step of one of its checkpoints: over the checkpoint of that step, under its name, and
        `last.ckpt` with it. The periodic saves, the rotation and the link Lightning makes again at the
        end of an epoch then go on from it as from the checkpoint it replaces (a file beside it, which
        Lightning knows nothing of, would be replaced by a link to the old one at the epoch's end)."""
        candidates = self.monitor_candidates(trainer)
        if self.save_top_k != 0:
            self.write_checkpoint(trainer, self.format_checkpoint_name(candidates))
        self.save_last_checkpoint(trainer, candidates)

    def _last_path(self, trainer) -> str:
        """The name `save_last_checkpoint` will give the link (Lightning's version counter included)."""
        candidates = self.monitor_candidates(trainer)
        filepath = self.format_checkpoint_name(candidates, self.CHECKPOINT_NAME_LAST)
        if self.version_counter:
            version = self.STARTING_VERSION
            while self.file_exists(filepath, trainer) and filepath != self.last_model_path:
                filepath = self.format_checkpoint_name(candidates, self.CHECKPOINT_NAME_LAST, ver=version)
                version += 1
        return filepath

    def find_last_checkpoints(self, trainer) -> set[str]:
        # What `ckpt_path="last"` resumes: `resumable` (the newest checkpoint that verifies). Lightning's
        # finds only last*.ckpt: without one (deleted, or a kill before the link) it would start afresh
        # and overwrite the step checkpoints, and it takes a damaged one as it is.
        if self.dirpath is None or not store.is_local(self.dirpath):
            return super().find_last_checkpoints(trainer)
        found = store.resumable(Path(store.local_file(self.dirpath)))
        return {os.path.normpath(found)} if found is not None else set()

    def link_checkpoint(self, trainer, filepath: str, linkpath: str) -> None:
        if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):
            if os.path.isdir(filepath):
                # Sharded (directory) checkpoints cannot be hard-linked: Lightning's symlink.
                super().link_checkpoint(trainer, filepath, linkpath)
                return
            with store.writable(os.path.dirname(linkpath)):
                store.link_atomically(filepath, linkpath)
        trainer.strategy.barrier()


class _SaveFinalFirst(Callback):
    """The final save of a `LastLinkCheckpoint`, as the first `on_train_end` hook of the trainer (its
    setup puts it first). Lightning calls every checkpoint callback's hooks after all other callbacks'
    (`_reorder_callbacks`): an end-of-training callback that failed (a monitor's last evaluation) would
    otherwise end the fit before the steps since the last periodic save were saved."""

    def __init__(self, checkpoint: LastLinkCheckpoint) -> None:
        self.checkpoint = checkpoint

    def on_train_end(self, trainer, pl_module) -> None:
        self.checkpoint.save_final(trainer)


def _rebased(state: dict[str, Any], old: str, new: str) -> dict[str, Any]:
    """A ModelCheckpoint state saved in the folder `old`, its paths moved to `new`: each file of `old`
    that `new` holds under the same name, the others dropped (never a path into `old`)."""

    def moved(path: Any) -> str:
        if not isinstance(path, str) or not path or os.path.dirname(path) != old.rstrip(os.sep):
            return ""
        there = os.path.join(new, os.path.basename(path))
        return there if os.path.isfile(there) else ""

    state = {**state, "dirpath": new}
    for key in ("best_model_path", "last_model_path", "kth_best_model_path", "previous_model_path"):
        if key in state:
            state[key] = moved(state[key])
    if isinstance(state.get("best_k_models"), dict):
        state["best_k_models"] = {moved(k): v for k, v in state["best_k_models"].items() if moved(k)}
    return state
