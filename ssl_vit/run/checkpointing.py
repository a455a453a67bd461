"""How ssl-vit writes and reads Lightning checkpoints.

- `SafeCheckpointIO` saves atomically (temp file in the target's directory, fsync, `os.replace`) and
  loads with `torch.load(weights_only=True)` only, local paths and URLs alike: a checkpoint never runs code.
- `LastLinkCheckpoint` makes `last.ckpt` a hard link to the newest checkpoint: no second write. With
  `save_top_k: 1` (the default) it keeps the previous checkpoint too, so that one damaged file (the newest
  and `last.ckpt` are one file) never leaves the run without an intact state to resume. It saves the
  final state first of all the end-of-training hooks, so a callback that fails there cannot lose it.
- Every load checks the archive's CRC-32s first (`ssl_vit.checkpoints.integrity`): a damaged checkpoint is
  refused in one line, and `--ckpt_path last` resumes from the newest checkpoint that verifies.
- A remote checkpoint (http(s), fsspec) is downloaded with retries and a read timeout
  (`ssl_vit.storage.remote`; `read_retries`, `read_timeout_s` of the plugin).

Temporary files are `.NAME.HEX.tmp`: hidden, and never ending in `.ckpt`, so neither Lightning's
`ckpt_path="last"` search nor a `*.ckpt` glob takes a half-written one for a checkpoint.
"""

from __future__ import annotations

import errno
import math
import os
import pickle
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, Literal

import torch
from fsspec.utils import get_protocol
from lightning_fabric.plugins import TorchCheckpointIO
from lightning_fabric.utilities.cloud_io import get_filesystem
from lightning_fabric.utilities.rank_zero import rank_zero_only
from pytorch_lightning.callbacks import Callback, ModelCheckpoint

from ssl_vit.checkpoints import integrity
from ssl_vit.checkpoints.load import torch_load
from ssl_vit.errors import NO_ROOM, UserError, first_line
from ssl_vit.internals import ModelCheckpointHooks, wraps_checkpoint_io
from ssl_vit.storage import remote
from ssl_vit.storage.atomic import TEMP_NAME, Staged
from ssl_vit.storage.remote import DEFAULT, ReadPolicy

# Where os.link cannot make a hard link but a copy works: another filesystem (EXDEV), one without hard
# links (EPERM on FAT/some FUSE, ENOTSUP), a file at the link limit (EMLINK).
NO_HARD_LINK = {errno.EXDEV, errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK}


class SafeCheckpointIO(TorchCheckpointIO):
    """Lightning's TorchCheckpointIO with atomic local saves and weights-only loads.

    Args:
        read_retries, read_timeout_s: how hard a remote checkpoint's download tries (as the data
            module's options of the same names; `trainer.plugins` in a recipe sets them).
    """

    def __init__(self, read_retries: int = DEFAULT.retries, read_timeout_s: float = DEFAULT.timeout_s):
        from ssl_vit.data.checks import read_policy

        super().__init__()
        self.read_policy = read_policy({"read_retries": read_retries, "read_timeout_s": read_timeout_s})

    def save_checkpoint(self, checkpoint: dict, path: str | Path, storage_options: Any = None) -> None:
        if storage_options is not None or not _is_local(path):
            # Remote targets (s3://, gs://, ...) keep Lightning's fs.transaction / multipart upload: an
            # object store has no rename-over or fsync, and an upload is all-or-nothing already.
            # storage_options: Lightning's TypeError, unchanged.
            return super().save_checkpoint(checkpoint, path, storage_options)
        # Lightning's _atomic_save serialises to memory, then (fsspec transaction) writes a
        # tempfile.mkstemp() file in $TMPDIR and shutil.move()s it onto the target: a rename only when
        # $TMPDIR is on the same filesystem, else a copy written into the target in place (a kill leaves
        # it truncated, and the full-size temp file in $TMPDIR); nothing is fsynced. Here the temp file is
        # next to the target, synced, and renamed over it: the target is only ever a whole checkpoint.
        target = _local(path)
        with _writable(os.path.dirname(target)):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            _write_atomically(target, lambda f: torch.save(checkpoint, f))

    def remove_checkpoint(self, path: Path | str) -> None:
        with _writable(os.path.dirname(_local(path))):
            super().remove_checkpoint(path)

    def load_checkpoint(
        self,
        path: Path | str,
        map_location: Callable | None = lambda storage, loc: storage,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        # `weights_only` is ignored: Lightning passes None by default, and its `_load` turns None into
        # weights_only=False for http(s) URLs, i.e. unpickles whatever a server sends.
        return load_checkpoint(path, map_location, self.read_policy)


def load_checkpoint(path: str | Path, map_location: Any = "cpu", policy: ReadPolicy = DEFAULT) -> dict:
    """A Lightning checkpoint (local path, fsspec or http(s) URL) read with `torch.load(weights_only=True)`;
    a file that is missing, damaged (`integrity.damage`), unreadable or needs code to unpickle is a
    UserError. A remote one is downloaded first (torch.load needs a file it can seek in) with `policy`'s
    retries and read timeout."""
    text = str(path)
    try:
        if remote.is_remote(text) and not text.startswith("pipe:"):
            # Not torch.hub.load_state_dict_from_url: it caches by file name under ~/.cache/torch/hub, so
            # a new checkpoint served under an old name would be ignored; and it neither retries nor
            # times out a stalled read.
            with tempfile.TemporaryDirectory(prefix="ssl-vit-ckpt-") as tmp:
                local = os.path.join(tmp, "download.ckpt")
                try:
                    remote.download(text, local, policy)
                except remote.Missing:
                    raise UserError(
                        f"checkpoint {text} does not exist; give the URL of a .ckpt file"
                    ) from None
                except remote.ReadFailed as err:
                    raise UserError(
                        f"checkpoint {text} cannot be read ({str(err).removeprefix(f'{text}: ')}): check the "
                        "server, or raise the checkpoint plugin's read_retries / read_timeout_s"
                    ) from None
                integrity.check(local, DAMAGED_FIX, name=text)  # damaged on the server, or cut off
                return torch_load(local, map_location=map_location)
        fs = get_filesystem(text)
        if not fs.exists(text):
            raise UserError(f"checkpoint {text} does not exist; give the path of a .ckpt file")
        if _is_local(text):
            # Remote (fsspec) files are not checked: that would download them twice.
            integrity.check(_local(text), DAMAGED_FIX)
        with fs.open(text, "rb") as f:
            return torch_load(f, map_location=map_location)
    except UserError:
        raise
    except pickle.UnpicklingError as err:
        raise refused(text, err) from None
    except Exception as err:  # HTTP errors, truncated or non-zip files, permissions: one line each
        raise UserError(
            f"{text} is not a readable checkpoint ({first_line(err)}); give a .ckpt written by ssl-vit"
        ) from None


DAMAGED_FIX = (
    "restore it from a copy, or give an older checkpoint (`--ckpt_path last` resumes from the newest "
    "checkpoint of the run that verifies)"
)


def refused(path: str, err: Exception) -> UserError:
    """The one-line error for a checkpoint whose pickle names globals outside torch's weights-only set."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    reason = next((line for line in lines if "GLOBAL" in line or "global" in line), first_line(err))
    return UserError(
        f"{path} is not a checkpoint ssl-vit loads safely (it needs to run code to unpickle: "
        f"{reason[:200]}); re-save it with weights only or give a checkpoint written by ssl-vit"
    )


def with_safe_io(plugins: Any) -> list:
    """`trainer.plugins` with a SafeCheckpointIO: added when none is there, set as the base of a wrapping
    IO (AsyncCheckpointIO) that has none; any other CheckpointIO is a UserError."""
    from lightning_fabric.plugins import CheckpointIO

    plugins = [] if plugins is None else list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
    ios = [p for p in plugins if isinstance(p, CheckpointIO)]
    if not ios:
        return [*plugins, SafeCheckpointIO()]
    for io in ios:
        while wraps_checkpoint_io(io) and io.checkpoint_io is not None:
            io = io.checkpoint_io
        if wraps_checkpoint_io(io):
            io.checkpoint_io = SafeCheckpointIO()  # else the strategy would give it a TorchCheckpointIO
        elif not isinstance(io, SafeCheckpointIO):
            raise UserError(
                f"trainer.plugins holds {type(io).__name__}, but ssl-vit reads and writes checkpoints with "
                "ssl_vit.run.checkpointing.SafeCheckpointIO (atomic saves, weights-only loads); remove it, "
                "or subclass SafeCheckpointIO"
            )
    return plugins


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
        if self.save_last == "link" and self.monitor is not None:
            # With a monitor, Lightning links last.ckpt to the last *top-k* checkpoint, which can be
            # older than the current state; `ckpt_path="last"` must resume from the newest state.
            self.save_last = True

    @property
    def state_key(self) -> str:
        # Lightning keys callback state by class name; ModelCheckpoint's keeps the state of checkpoints
        # written before this class existed (best/last paths) restorable, and vice versa.
        return super().state_key.replace(type(self).__qualname__, ModelCheckpoint.__qualname__, 1)

    def setup(self, trainer, pl_module, stage: str) -> None:
        link = self.save_last == "link"
        if link:
            # Lightning raises for save_last="link" on a remote dirpath, which is only known after
            # resolving it in setup; there, a full copy (save_last=True) is the fallback.
            self.save_last = True
        super().setup(trainer, pl_module, stage)
        if link and _is_local(self.dirpath):
            self.save_last = "link"
        if stage == "fit" and trainer.is_global_zero and _is_local(self.dirpath):
            # Only a fit owns its checkpoint directory (a validate may run beside a fit that is saving).
            remove_stale_temp_files(_local(self.dirpath))
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
        if saved_in != self.dirpath and saved_in and self.dirpath and _is_local(self.dirpath):
            # A copied or moved run directory: its checkpoints are followed where they now are, so the
            # rotation goes on among them (Lightning keeps only best_model_path, the original's file).
            state_dict = _rebased(state_dict, _local(saved_in), _local(self.dirpath))
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
        if self.dirpath is None or not _is_local(self.dirpath):
            return super().find_last_checkpoints(trainer)
        found = resumable(Path(_local(self.dirpath)))
        return {os.path.normpath(found)} if found is not None else set()

    def link_checkpoint(self, trainer, filepath: str, linkpath: str) -> None:
        if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):
            if os.path.isdir(filepath):
                # Sharded (directory) checkpoints cannot be hard-linked: Lightning's symlink.
                super().link_checkpoint(trainer, filepath, linkpath)
                return
            with _writable(os.path.dirname(linkpath)):
                link_atomically(filepath, linkpath)
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


def link_atomically(source: str, target: str) -> None:
    """`target` becomes a hard link to `source` (a copy where hard links are impossible), atomically."""
    if os.path.exists(target) and os.path.samefile(source, target):
        # Lightning relinks at epoch/validation end without a new checkpoint; and rename(2) of one hard
        # link onto another of the same file does nothing, which would leave the temporary name behind.
        return
    with Staged(target) as staged:
        try:
            os.link(source, staged.path)
        except OSError as err:
            if err.errno not in NO_HARD_LINK:
                raise
            with suppress(FileNotFoundError):
                os.unlink(staged.path)
            with open(source, "rb") as src, open(staged.create(), "wb", closefd=False) as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
                dst.flush()
                staged.sync()
        # After a race that made `target` another link of `source`, the rename does nothing and the
        # temporary name is removed at exit.
        staged.replace()


# A checkpoint directory that stopped taking files: its permissions or ACLs changed, its filesystem went
# read-only (an error remount, a full NFS server), root squashed on an NFS export.
UNWRITABLE = {errno.EACCES, errno.EPERM, errno.EROFS}


@contextmanager
def _writable(directory: str):
    """An OSError that says `directory` does not take files any more, as one line naming it and the fix.
    A failed save leaves the checkpoints there as they were (`_write_atomically`): last.ckpt stays the
    newest good state."""
    try:
        yield
    except OSError as err:
        if err.errno not in UNWRITABLE:
            raise
        raise UserError(
            f"cannot write checkpoints in {directory} ({err.strerror}): its last.ckpt is the newest good "
            "checkpoint; make the directory writable again (permissions, the mount) and resume with "
            "--ckpt_path last"
        ) from None


def remove_stale_temp_files(directory: str) -> list[str]:
    """Temporary files a killed save left in `directory` (saves of this run have not started)."""
    if not os.path.isdir(directory):
        return []
    stale = [name for name in os.listdir(directory) if TEMP_NAME.match(name)]
    for name in stale:
        with suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, name))
    return stale


def _write_atomically(target: str, write: Callable[[Any], None]) -> None:
    with Staged(target) as staged, open(staged.create(), "wb", closefd=False) as f:
        recording = _Recording(f)
        try:
            write(recording)
            f.flush()
            staged.sync()
        except Exception as err:
            full = recording.error or (err if isinstance(err, OSError) else None)
            if full is not None and full.errno in NO_ROOM:
                # torch's zip writer reports a failed write as "unexpected pos": say what it was.
                raise OSError(full.errno, os.strerror(full.errno), target) from err
            raise
        staged.replace()  # a failed save leaves the previous checkpoint untouched


class _Recording:
    """A file for torch.save that remembers the OSError a write raised (ENOSPC, EDQUOT, EFBIG), which torch's
    zip writer turns into a RuntimeError about positions."""

    def __init__(self, file) -> None:
        self.file, self.error = file, None

    def write(self, data) -> int:
        try:
            return self.file.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self.file.flush()


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


def _is_local(path: Path | str) -> bool:
    """Whether `path` is on the local filesystem (a plain path or `file://`), as Lightning judges it."""
    return get_protocol(str(path)) == "file"


def _local(path: Path | str) -> str:
    text = str(path)
    return text.removeprefix("file://") if text.startswith("file://") else text


# --- `last`: which checkpoint of a run directory a job resumes -----------------------------------------


def resumable(checkpoint_dir: Path, max_step: int | None = None) -> Path | None:
    """What `--ckpt_path last` resumes: the checkpoint of the directory whose recorded step is the
    highest (`last*.ckpt` first among equals: it is a link to the newest); a damaged one
    (`integrity.damage`) is passed over for the next, with one warning naming both. None when the
    directory holds no checkpoint (the job starts afresh); a `NothingIntact` when it holds only
    damaged ones. `max_step`: only checkpoints of that step or before (what a loss-spike rollback
    returns to).

    By the step the file records, not by modification time (as Lightning picks among `last*.ckpt`): a
    file written under a clock that was ahead (another node's, a copy's) would be resumed over a later
    step, and the steps between lost without a word."""
    if not checkpoint_dir.is_dir():
        return None
    damaged: list[tuple[Path, str]] = []
    ordered = sorted((_resume_order(path), path) for path in checkpoint_dir.glob("*.ckpt"))
    for (minus_step, *_), path in ordered:
        if max_step is not None and -minus_step > max_step:  # (the step each file was ordered by)
            continue
        if path.is_symlink() and not path.exists():  # a link whose checkpoint was deleted or moved
            damaged.append((path, f"a link to {os.readlink(path)}, which does not exist"))
            continue
        try:
            why = integrity.damage(path)  # last.ckpt and the newest step file are one file: read once
        except FileNotFoundError:  # deleted since it was listed
            continue
        except OSError as err:  # not damaged, not readable either: the user's to fix, not to skip
            raise integrity.unreadable(path, err) from None
        if why is None:
            if damaged:
                others = ", ".join(p.name for p, _ in damaged[1:])
                _warn_once(
                    f"{damaged[0][0]} is damaged ({damaged[0][1]}); resuming from {path}, the newest "
                    f"checkpoint that verifies" + (f" (also damaged: {others})" if others else "")
                )
            return path
        damaged.append((path, why))
    if damaged:
        raise NothingIntact(checkpoint_dir, damaged)
    return None


class NothingIntact(integrity.DamagedCheckpoint):
    """Every checkpoint `resumable` looked at is damaged: `damaged`, (path, what is wrong) each."""

    def __init__(self, checkpoint_dir: Path, damaged: list[tuple[Path, str]]) -> None:
        self.damaged = damaged
        super().__init__(
            damaged[0][0], damaged[0][1],
            f"no other checkpoint in {checkpoint_dir} verifies; restore the run's checkpoints from a copy, "
            "or start afresh with another --trainer.default_root_dir",
        )  # fmt: skip


def _resume_order(path: Path) -> tuple:
    """Highest recorded step first, `last*.ckpt` first among equals. A file whose step cannot be read
    (damaged, or a dangling link) is placed by its name (`last*.ckpt` first of all, `stepN.ckpt` at N):
    it is passed over all the same, and the warning then names it where it belongs."""
    last = path.name.startswith("last")
    step = checkpoint_step(path)
    if step is None:
        named = re.fullmatch(r"step(\d+)\.ckpt", path.name)
        step = math.inf if last else int(named[1]) if named else -1
    return (-step, not last, path.name)


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    # The CLI and Lightning both resolve `last` (same files, same answer): one line, on rank 0 only (the
    # rank the launcher's environment gives, before the trainer exists).
    if message not in _warned and rank_zero_only.rank == 0:
        print(f"ssl-vit: warning: {message}", file=sys.stderr, flush=True)
    _warned.add(message)


def checkpoint_step(path: Path) -> int | None:
    """The optimizer step a Lightning checkpoint was saved at (read lazily: tensors stay on disk)."""
    try:
        return int(torch.load(path, map_location="cpu", weights_only=True, mmap=True)["global_step"])
    except Exception:  # not ours to judge here: loading it for real reports what is wrong
        return None


__all__ = [
    "LastLinkCheckpoint", "NothingIntact", "SafeCheckpointIO", "checkpoint_step", "link_atomically",
    "load_checkpoint", "refused", "remove_stale_temp_files", "resumable", "with_safe_io",
]  # fmt: skip
