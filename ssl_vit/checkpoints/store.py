"""The Lightning checkpoint files of a run: how ssl-vit writes, reads and checks them.

- `SafeCheckpointIO` saves atomically (`ssl_vit.storage.atomic`) and loads with
  `torch.load(weights_only=True)` only, local paths and URLs alike: a checkpoint never runs code.
  `link_atomically` puts a hard link (`last.ckpt`, `ssl_vit.run.last_link`) in place the same way.
- Every load checks the archive's CRC-32s first (`ssl_vit.checkpoints.integrity`): a damaged checkpoint is
  refused in one line, and `--ckpt_path last` resumes from the newest one that verifies (`resumable`).
- `--ckpt_path` as a file (`check_ckpt_path`), and a checkpoint that names a model class outside
  ssl-vit's tasks (`refuse_foreign_model`), are refused before Lightning reads them.
"""

from __future__ import annotations

import errno
import math
import os
import pickle
import re
import shutil
import tempfile
from collections.abc import Callable
from contextlib import contextmanager, suppress
from functools import cache
from pathlib import Path
from typing import Any

import torch
from fsspec.utils import get_protocol
from lightning_fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning_fabric.utilities.cloud_io import get_filesystem
from lightning_fabric.utilities.rank_zero import rank_zero_only

from ssl_vit.checkpoints import integrity
from ssl_vit.checkpoints.load import torch_load
from ssl_vit.errors import NO_ROOM, UserError, first_line, warn
from ssl_vit.internals import CLASS_PATH_KEY, wraps_checkpoint_io
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
        super().__init__()
        self.read_policy = remote.checked_policy(read_retries, read_timeout_s)

    def save_checkpoint(self, checkpoint: dict, path: str | Path, storage_options: Any = None) -> None:
        if storage_options is not None or not is_local(path):
            # Remote targets (s3://, gs://, ...) keep Lightning's fs.transaction / multipart upload: an
            # object store has no rename-over or fsync, and an upload is all-or-nothing already.
            # storage_options: Lightning's TypeError, unchanged.
            return super().save_checkpoint(checkpoint, path, storage_options)
        # Lightning's _atomic_save serialises to memory, then (fsspec transaction) writes a
        # tempfile.mkstemp() file in $TMPDIR and shutil.move()s it onto the target: a rename only when
        # $TMPDIR is on the same filesystem, else a copy written into the target in place (a kill leaves
        # it truncated, and the full-size temp file in $TMPDIR); nothing is fsynced. Here: `Staged`.
        target = local_file(path)
        with writable(os.path.dirname(target)):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            _write_atomically(target, lambda f: torch.save(checkpoint, f))

    def remove_checkpoint(self, path: Path | str) -> None:
        with writable(os.path.dirname(local_file(path))):
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
                        f"checkpoint {text} cannot be read ({remote.without_url(err, text)}): check the "
                        "server, or raise the checkpoint plugin's read_retries / read_timeout_s"
                    ) from None
                integrity.check(local, DAMAGED_FIX, name=text)  # damaged on the server, or cut off
                return torch_load(local, map_location=map_location)
        fs = get_filesystem(text)
        if not fs.exists(text):
            raise UserError(f"checkpoint {text} does not exist; give the path of a .ckpt file")
        if is_local(text):
            # Remote (fsspec) files are not checked: that would download them twice.
            integrity.check(local_file(text), DAMAGED_FIX)
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
                "ssl_vit.checkpoints.store.SafeCheckpointIO (atomic saves, weights-only loads); remove it, "
                "or subclass SafeCheckpointIO"
            )
    return plugins


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
def writable(directory: str):
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
        staged.replace()


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


def is_local(path: Path | str) -> bool:
    """Whether `path` is on the local filesystem (a plain path or `file://`), as Lightning judges it."""
    return get_protocol(str(path)) == "file"


def local_file(path: Path | str) -> str:
    """The file name of a local `path` (`is_local`): without its `file://`."""
    return str(path).removeprefix("file://")


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
    """`resumable`'s order. A file whose step cannot be read
    (damaged, or a dangling link) is placed by its name (`last*.ckpt` first of all, `stepN.ckpt` at N):
    it is passed over all the same, and the warning then names it where it belongs."""
    last = path.name.startswith("last")
    step = checkpoint_step(path)
    if step is None:
        named = re.fullmatch(r"step(\d+)\.ckpt", path.name)
        step = math.inf if last else int(named[1]) if named else -1
    return (-step, not last, path.name)


@cache
def _warn_once(message: str) -> None:
    # The CLI and Lightning both resolve `last` (same files, same answer): one line, on rank 0 only (the
    # rank the launcher's environment gives, before the trainer exists).
    if rank_zero_only.rank == 0:
        warn(message)


def checkpoint_step(path: Path) -> int | None:
    """The optimizer step a Lightning checkpoint was saved at (read lazily: tensors stay on disk)."""
    try:
        return int(torch.load(path, map_location="cpu", weights_only=True, mmap=True)["global_step"])
    except Exception:  # not ours to judge here: loading it for real reports what is wrong
        return None


# --- --ckpt_path as a file, and the model class a checkpoint names ------------------------------------


# --ckpt_path values Lightning resolves itself (a checkpoint of the run, the model registry).
CKPT_KEYWORDS = ("last", "best", "hpc", "null", "none", "registry")


def local_ckpt_path(value) -> str | None:
    """`value` when it names a local checkpoint file for `--ckpt_path`; None for none, a keyword Lightning
    resolves itself (last, best, ...) or a URL."""
    value = str(value) if value is not None else ""
    if not value or value.lower() in CKPT_KEYWORDS or value.lower().startswith("registry:") or "://" in value:
        return None
    return value


def check_ckpt_path(path: str | Path) -> dict:
    """The Lightning checkpoint `path`, its tensors memory-mapped; a one-line UserError unless it is one
    that loads with weights only.

    For `--ckpt_path` (resume or evaluate a run's state): LightningCLI itself reads a local checkpoint's
    hyperparameters with torch.load before anything else, and a file that is not a checkpoint fails
    there with whatever torch's unpickler happened to hit."""
    path = Path(path)
    fix = (
        "give a .ckpt written by ssl-vit (RUN/checkpoints/last.ckpt) or `last` to resume the run in "
        "--trainer.default_root_dir; to start from other weights use --model.init_args.training.init_from"
    )
    if not path.exists():
        raise UserError(f"--ckpt_path {path} does not exist: {fix}")
    if not path.is_file():
        raise UserError(f"--ckpt_path {path} is not a file: {fix}")
    integrity.check(path, DAMAGED_FIX, name=f"--ckpt_path {path}")
    try:
        try:
            checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception:  # not torch's zip format, or a filesystem without mmap: read it whole
            checkpoint = torch_load(path, map_location="cpu")
    except Exception as err:  # text, random bytes, a zip that is not torch's, pickled code: all one line
        raise UserError(
            f"--ckpt_path {path} is not a checkpoint torch can load safely ({type(err).__name__}): {fix}"
        ) from None
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        raise UserError(f"--ckpt_path {path} is not a Lightning checkpoint (no state_dict): {fix}")
    if not checkpoint["state_dict"]:
        raise UserError(f"--ckpt_path {path} holds no weights (its state_dict is empty): {fix}")
    if not isinstance(checkpoint.get("hyper_parameters", {}), dict):
        raise UserError(f"--ckpt_path {path} has hyper_parameters that are not a mapping: {fix}")
    return checkpoint


def refuse_foreign_model(hparams: dict, path) -> None:
    """A checkpoint whose hyperparameters name a model class outside ssl-vit's tasks: a checkpoint is
    data, it never chooses code to run."""
    class_path = hparams.get(CLASS_PATH_KEY)
    if class_path is not None and not str(class_path).startswith("ssl_vit.tasks."):
        raise UserError(
            f"--ckpt_path {path} names the model class {class_path!r}: ssl-vit only rebuilds its own "
            "tasks (ssl_vit.tasks.*) from a checkpoint; give a checkpoint written by ssl-vit"
        )


def unparsable_model(path, what: str) -> UserError:
    """The line for a `--ckpt_path` whose recorded model (its hyperparameters) this version cannot build."""
    return UserError(
        f"--ckpt_path {path}: the model its hyperparameters describe does not parse here ({what}); give a "
        "checkpoint this version of ssl-vit wrote"
    )


__all__ = [
    "CKPT_KEYWORDS", "NothingIntact", "SafeCheckpointIO", "check_ckpt_path", "checkpoint_step",
    "link_atomically", "load_checkpoint", "local_ckpt_path", "refuse_foreign_model", "refused",
    "remove_stale_temp_files", "resumable", "unparsable_model", "with_safe_io", "writable",
]  # fmt: skip
