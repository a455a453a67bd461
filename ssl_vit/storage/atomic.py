"""Files put in place whole or not at all: written under a temporary name beside their target, synced,
then renamed (or linked) onto it, and the directory synced.

A reader (a resumed job, Lightning's `ckpt_path="last"` search, another fit looking at a run
directory's lock) then sees the old file or the new one, never a half-written one, whatever kills the
writer; a failed write leaves the target as it was. Temporary names are `.NAME.HEX.tmp` (`TEMP_NAME`):
hidden, and never ending in the target's suffix, so neither Lightning's `ckpt_path="last"` search nor a
`*.ckpt` glob takes a half-written one for a checkpoint.
"""

from __future__ import annotations

import os
import re
import secrets
from contextlib import suppress

TEMP_NAME = re.compile(r"^\..+\.[0-9a-f]{16}\.tmp$")


class Staged:
    """`with Staged(target) as staged:` a temporary name beside `target` (`staged.path`; same directory,
    so same filesystem: a rename is atomic). Make the file there (`create()`, or hard-link another file
    to `staged.path`), write and `sync()` it, then put it in place with `replace()` or `link()`. At
    exit the temporary name is removed (gone already after a rename) and the file descriptor closed,
    unless `keep()` took it."""

    def __init__(self, target: str | os.PathLike, mode: int = 0o666) -> None:
        self.target = os.path.abspath(target)
        self.directory, name = os.path.split(self.target)
        self.path = os.path.join(self.directory, f".{name}.{secrets.token_hex(8)}.tmp")
        self.mode = mode
        self.fd: int | None = None

    def __enter__(self) -> Staged:
        return self

    def __exit__(self, *exc) -> None:
        with suppress(FileNotFoundError):
            os.unlink(self.path)
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def create(self) -> int:
        """The temporary file, created and opened read-write; its descriptor. O_EXCL: never writing
        through an existing name; `mode` & ~umask like any file the process writes (tempfile.mkstemp
        would make it 0o600)."""
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, self.mode)
        return self.fd

    def sync(self) -> None:
        """The data on disk before a name points at it."""
        os.fsync(self.fd)

    def replace(self) -> None:
        """The file becomes `target`, replacing whatever was there."""
        os.replace(self.path, self.target)
        fsync_directory(self.directory)

    def link(self) -> bool:
        """The file becomes `target` unless `target` exists: False then, and nothing changed."""
        try:
            os.link(self.path, self.target)
        except FileExistsError:
            # NFS: a retried link(2) whose first try succeeded answers EEXIST; the file then has two names.
            if self.fd is None or os.fstat(self.fd).st_nlink != 2:
                return False
        fsync_directory(self.directory)
        return True

    def keep(self) -> int:
        """The descriptor, left open at exit (a POSIX lock lives as long as every descriptor of its file
        in the process: closing any one drops it)."""
        fd, self.fd = self.fd, None
        return fd


def write_text(target: str | os.PathLike, text: str) -> None:
    """`target` replaced whole by `text`, as the module's docstring says."""
    with Staged(target) as staged, open(staged.create(), "w", closefd=False) as f:
        f.write(text)
        f.flush()
        staged.sync()
        staged.replace()


def fsync_directory(directory: str) -> None:
    """A rename or link in `directory` survives a power loss."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # platforms without directory handles (Windows): the rename is done, nothing to sync
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems (FUSE, NFS) refuse fsync on directories
        pass
    finally:
        os.close(fd)


__all__ = ["TEMP_NAME", "Staged", "fsync_directory"]
