"""Output directories of the commands that write one (`evaluate`, `compare`, `analyze`): checked before
any work, written complete or not at all.

`check_out` refuses, in one line, an --out that is a file, lies under one, cannot be written, or is a
non-empty directory without --overwrite. `staged` gives a temporary directory next to it to write
into, renamed into place at the end; an old --out is removed only once the new one is complete.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ssl_vit.errors import UserError


def check_out(out: str | Path, overwrite: bool = False) -> Path:
    """`out` as a Path after checking that the command may write it; a one-line UserError if not.
    Writes nothing (a directory made and removed at once tests that the parent is writable)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file: give a directory")
    where = Path(os.path.abspath(out))  # `..` resolved: the parent the staging directory goes in
    if Path.cwd().is_relative_to(where):  # `--out .` or above: it would be renamed away
        raise UserError(f"--out {out} holds the current directory: give a directory of its own")
    existing = next(p for p in (where, *where.parents) if p.exists())
    if not existing.is_dir():
        raise UserError(f"--out {out} lies under the file {existing}: give a directory")
    # The staging directory goes next to `out`, in its parent: try making one where it would be
    # (permissions alone do not tell, e.g. root under /proc or a read-only mount).
    parent = where.parent if where.parent.exists() else existing
    try:
        Path(tempfile.mkdtemp(prefix=f".{where.name}.", dir=parent)).rmdir()
    except OSError as err:
        raise UserError(
            f"--out {out} cannot be written ({err.strerror}): give a writable directory"
        ) from None
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise UserError(
            f"--out {out} exists and is not empty: give a new directory, or --overwrite to replace it"
        )
    return out


@contextmanager
def staged(out: str | Path) -> Iterator[Path]:
    """A temporary directory next to `out` to write into: put at `out` when the block ends (an old
    `out`, from --overwrite, is removed only then), removed when it raises."""
    out = Path(os.path.abspath(out))  # a real `out.name` and `out.parent` for paths such as `runs/..` too
    out.parent.mkdir(parents=True, exist_ok=True)
    temp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    # mkdtemp makes it 0700 whatever the umask; the finished --out gets what mkdir would have given it.
    temp.chmod(0o777 & ~_umask())
    try:
        yield temp
        _replace(temp, out)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise


def _umask() -> int:
    """The process's umask (reading it means setting it: set back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _replace(temp: Path, out: Path) -> None:
    """Put the finished `temp` directory at `out`; an old `out` is moved aside and removed after."""
    if not out.exists():
        temp.rename(out)
        return
    old = out.with_name(f".{out.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    out.rename(old)
    temp.rename(out)
    shutil.rmtree(old)
