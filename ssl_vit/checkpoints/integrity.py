"""Is a checkpoint file still what was written? Checked before anything loads it.

A checkpoint saved by `torch.save` is a zip archive whose every record (the pickle, each tensor's
storage) carries the CRC-32 of its bytes, computed by torch while it writes them and stored in the
archive itself. `torch.load` never checks them (it memory-maps or copies the records as they are), so
a file truncated by a full disk or a killed copy, or with bits flipped on disk or in transfer, loads
without a word: the weights are whatever the damaged bytes say. `damage` reads the archive once, the
way `zipfile` checks an archive, and says what is wrong.

Why the archive's own checksums and not a separate hash file: they are written with the data, in the
same atomic rename, so a checkpoint and its checksums can never disagree (a `last.ckpt` hard link
carries them too; a sidecar file would have to be relinked alongside it, and a kill between the two
renames would leave a good checkpoint with a wrong hash); they cost nothing at save time; and every
checkpoint torch has written in its zip format has them, including those written before this check
existed. CRC-32 catches every error burst up to 32 bits and misses a random damage with probability
2^-32 per record: this guards against accidents, not against someone who rewrites a checkpoint on
purpose (they could rewrite a hash file next to it as easily).

Files without checksums load unchecked: torch's legacy (pre-zip) format, files of other tools, and zip
archives written with torch's CRC computation switched off (`torch.serialization.set_crc32_options`).

Stdlib only: the loaders of backbones (`ssl_vit.checkpoints.load`) and of a run's checkpoints
(`ssl_vit.checkpoints.store`) both use it.
"""

from __future__ import annotations

import os
import struct
import zipfile
import zlib
from pathlib import Path

from ssl_vit.errors import UserError

ZIP_MAGIC = b"PK\x03\x04"
CHUNK = 1 << 22
# (device, inode, size, mtime) of files already checked in this process -> damage (None: intact). A
# resumed fit checks its checkpoint in the CLI and Lightning loads it again: it is read once for this.
_checked: dict[tuple[int, int, int, int], str | None] = {}


class DamagedCheckpoint(UserError):
    """A checkpoint file whose bytes are not those that were written (truncated, overwritten, bit-flipped):
    `NAME is damaged (WHY): FIX`, NAME being how the user gave the file."""

    def __init__(self, name: str | os.PathLike, why: str, fix: str) -> None:
        super().__init__(f"{name} is damaged ({why}): {fix}")


def damage(path: str | os.PathLike) -> str | None:
    """What is wrong with the checkpoint file `path`, in a few words, or None when its checksums verify
    or it has none to verify (see the module's docstring). A directory (a sharded checkpoint of
    torch.distributed.checkpoint) is not checked here. A file that cannot be opened (missing, no
    permission) raises its OSError; an I/O error while reading it is damage."""
    path = Path(path)
    if path.is_dir():
        return None
    st = path.stat()
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _checked:
        _checked[key] = _read(path, st.st_size)
    return _checked[key]


def check(path: str | os.PathLike, fix: str, name: str | None = None) -> None:
    """A `DamagedCheckpoint` naming `name` (else `path`) unless `path` verifies; a UserError if it
    cannot be opened."""
    try:
        why = damage(path)
    except OSError as err:
        raise unreadable(name or path, err) from None
    if why is not None:
        raise DamagedCheckpoint(name or path, why, fix)


def has_checksums(path: str | os.PathLike) -> bool:
    """Whether `damage` has checksums to verify in `path` (a zip archive whose records carry CRC-32s):
    only its directory is read."""
    try:
        with zipfile.ZipFile(path) as archive:
            return any(r.CRC for r in archive.infolist() if r.file_size)
    except (OSError, zipfile.BadZipFile):
        return False


def unreadable(name: str | os.PathLike, err: OSError) -> UserError:
    return UserError(
        f"{name} cannot be read ({type(err).__name__}: {err.strerror or err}): give a checkpoint file this "
        "user can read"
    )


def _read(path: Path, size: int) -> str | None:
    if size == 0:
        return "it is empty"
    with open(path, "rb") as f:
        try:
            return _verify(f, size)
        except OSError as err:  # EIO and the like: the storage under the file is damaged
            return f"reading it failed ({type(err).__name__}: {err.strerror or err})"


def _verify(f, size: int) -> str | None:
    if f.read(len(ZIP_MAGIC)) != ZIP_MAGIC:
        # Not a zip archive: no checksums to verify; torch.load judges whether it is a checkpoint at all
        # (a file cut inside its first bytes is refused there).
        return None
    f.seek(0)
    try:
        with zipfile.ZipFile(f) as archive:
            records = archive.infolist()
            if not any(r.CRC for r in records if r.file_size):
                return None  # written without CRCs (all zero): nothing to verify
            for record in records:
                # ZipExtFile checks the record's header against the directory, and its CRC-32 once the
                # last byte is read.
                with archive.open(record) as data:
                    while data.read(CHUNK):
                        pass
    except zipfile.BadZipFile as err:
        return _why(str(err), size)
    except (EOFError, struct.error, zlib.error, ValueError, NotImplementedError) as err:
        # A record whose header or length points past the end of the file, or garbage where a header
        # should be.
        return f"unreadable archive structure: {type(err).__name__}: {str(err)[:120]}"
    return None


def _why(message: str, size: int) -> str:
    if message.startswith("Bad CRC-32 for file"):
        name = message.removeprefix("Bad CRC-32 for file").strip()
        return f"record {name} fails its CRC-32 check: its bytes changed after they were written"
    if message == "File is not a zip file":
        return f"its zip directory is missing: truncated at {size} bytes, or its end overwritten"
    return message[:200]


__all__ = ["DamagedCheckpoint", "check", "damage", "has_checksums", "unreadable"]
