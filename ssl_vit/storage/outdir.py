"""What the commands that write a directory or a file for the user (`evaluate`, `compare`, `analyze`,
`export`, `data convert`) may write, and how: the rules are here, once.

- An output that is, holds or lies inside one of the command's inputs (a checkpoint, the run directory
  around it, a shard's directory, the suite or claims file, a data source) is refused in one line,
  `--overwrite` or not: a results directory renamed over a run directory would delete its checkpoints.
  Input and output trees are disjoint. `check_out` also refuses a file, a path under a file, a place that
  cannot be written, the current directory or one above it, and a non-empty directory without
  `--overwrite`.
- A job holds a lock on its output while it writes (`out_lock`, `split_lock`: the lock `fit` holds on its
  run directory), so a second job is refused in one line naming the holder, before it computes anything.
- Everything is written beside the output and renamed into place at the end (`Output.staged`). The
  rename never replaces what another job put there meanwhile (`commit`). Only `--overwrite` replaces an
  output, once the new one is complete, and under the lock no two jobs do so at once.
- `--overwrite` replaces only *our output*: a directory that holds the marker file `MARKER`, which every
  output committed here carries (written into the staging directory when it is made). A non-empty
  directory without it (a thesis, a dataset, the results of another tool, an output of a version before
  the marker) is refused in one line naming what it holds; nothing is deleted.
- The replacement is one atomic exchange of the two directories (Linux `renameat2(RENAME_EXCHANGE)`),
  so a signal, or a kill, at any moment leaves the output holding the old result or the new one. Where
  the filesystem cannot exchange, the old output is renamed aside to `.NAME.old` and the new one renamed
  in, with SIGTERM and SIGINT held off between the two renames; only a SIGKILL there leaves `.NAME.old`
  and no output, which the next command on that output puts back (`recover`).
- What was computed is written and committed before anything optional (pictures, the W&B run,
  `Output.optional`): a picture that fails costs that picture, one warning line and a note, never the
  numbers.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import re
import secrets
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import NamedTuple, TypeVar

from ssl_vit.errors import UserError, first_line, warn
from ssl_vit.storage.atomic import write_text
from ssl_vit.storage.lock import HOST, RunLock, alive, job_leader

T = TypeVar("T")
MARKER = ".ssl-vit-output"  # in every output committed here: what `--overwrite` may replace


class Input(NamedTuple):
    """A path a command reads, and what it is for the messages (`the checkpoint runs/a/last.ckpt`)."""

    path: Path
    what: str


def checkpoint_inputs(source: str) -> list[Input]:
    """What a checkpoint source reads on this machine: the file (or exported folder) and, for a file in a
    run directory (`RUN/checkpoints/NAME.ckpt`, or beside a `config.yaml`), the run directory, whose
    checkpoints, config.yaml and W&B run are a fit's. None for `scratch`, `timm:NAME` and URLs."""
    if source == "scratch" or source.startswith("timm:") or "://" in source:
        return []
    path = Path(source)
    found = [Input(path, f"the checkpoint {source}")]
    parent = path.parent
    if parent.name == "checkpoints":
        found.append(Input(parent.parent, f"the run directory of {source}"))
    elif path.is_file() and ((parent / "config.yaml").is_file() or (parent / "checkpoints").is_dir()):
        found.append(Input(parent, f"the run directory of {source}"))
    return found


def refuse_inputs(out: str | Path, inputs: Iterable[Input], label: str = "--out") -> None:
    """A one-line UserError when `out` is, holds or lies inside one of `inputs` (symbolic links followed:
    two names of one directory are one directory)."""
    target = Path(os.path.realpath(out))
    found = []  # (closeness, relation, what): the input itself first, then the outermost one held, then
    # the innermost one around it (`holds the run directory of X` rather than `holds the checkpoint X`)
    for path, what in inputs:
        place = Path(os.path.realpath(path))
        if target == place:
            found.append(((0, 0), "is", what))
        elif place.is_relative_to(target):
            found.append(((1, len(place.parts)), "holds", what))
        elif target.is_relative_to(place):
            found.append(((2, -len(place.parts)), "lies inside", what))
    if found:
        _, relation, what = min(found, key=lambda item: item[0])
        raise UserError(
            f"{label} {out} {relation} {what}, which this command reads: give an {label} outside every input"
        )


def check_out(
    out: str | Path,
    overwrite: bool = False,
    inputs: Iterable[Input] = (),
    label: str = "--out",
    used: bool = True,
) -> Path:
    """`out` as a Path after checking that the command may write it; a one-line UserError if not.
    Leaves nothing written. `used`: also whether it may replace what is there (`refuse_used`; `Output`
    checks that under its lock, after `recover`)."""
    out = Path(out)
    refuse_inputs(out, inputs, label)
    if out.exists() and not out.is_dir():
        raise UserError(f"{label} {out} is a file: give a directory")
    where = Path(os.path.abspath(out))  # `..` resolved: the parent the staging directory goes in
    if Path.cwd().is_relative_to(where):  # `--out .` or above: it would be renamed away
        raise UserError(f"{label} {out} holds the current directory: give a directory of its own")
    existing = next(p for p in (where, *where.parents) if p.exists())
    if not existing.is_dir():
        raise UserError(f"{label} {out} lies under the file {existing}: give a directory")
    # The staging directory goes next to `out`, in its parent: try making one where it would be
    # (permissions alone do not tell, e.g. root under /proc or a read-only mount).
    parent = where.parent if where.parent.exists() else existing
    try:
        Path(tempfile.mkdtemp(prefix=f".{where.name}.", dir=parent)).rmdir()
    except OSError as err:
        raise UserError(
            f"{label} {out} cannot be written ({err.strerror}): give a writable directory"
        ) from None
    if used:
        refuse_used(out, overwrite, label)
    return out


def refuse_used(out: Path, overwrite: bool, label: str = "--out") -> None:
    """A one-line UserError when `out` is a non-empty directory and `overwrite` is not given, or it is
    given but the directory is not an output of ours (no `MARKER`): what it holds is named."""
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if not held:
        return
    if not overwrite:
        raise UserError(
            f"{label} {out} exists and is not empty: give a new directory, or --overwrite to replace it"
        )
    if not is_ours(out):
        shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
        raise UserError(
            f"{label} {out} holds {shown}, which ssl-vit did not write (no {MARKER}): --overwrite replaces "
            f"only an earlier output of ssl-vit; give a new {label}, or move those files away"
        )


def is_ours(directory: Path) -> bool:
    """Whether `directory` is an output this module committed (it holds the marker file)."""
    marker = directory / MARKER
    return marker.is_file() and not marker.is_symlink()


def mark(directory: Path, command: str) -> None:
    """`directory` (a staging directory) marked as an output of `command`."""
    made = datetime.now(timezone.utc).isoformat("T", "seconds")
    record = {"command": command, "host": HOST, "pid": os.getpid(), "made": made}
    (directory / MARKER).write_text(json.dumps(record) + "\n")


def _maker(directory: Path) -> dict:
    """What `directory`'s marker says of the job that made it ({} when it says nothing)."""
    try:
        record = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def recover(out: Path, label: str = "--out") -> None:
    """What a job stopped during its commit left beside `out` (this process holds `out`'s lock): the old
    output set aside as `.NAME.old` is put back where `out` is missing, else removed; the staging
    directories of ours whose job has ended are removed (whether `out` holds the old result or the new, a
    staging directory is never the only copy of one). One warning line each; a folder that is not ours,
    or another host's, is only reported."""
    out = Path(os.path.realpath(out))  # as `Output.staged` names its staging directory
    old = out.with_name(f".{out.name}.old")
    if old.is_dir() and not old.is_symlink():
        if not is_ours(old):
            warn(f"{label} {out}: {old} is left beside it and is not an output of ssl-vit; remove it")
        elif not out.exists():
            old.rename(out)
            warn(f"{label} {out}: put back the earlier result a job stopped mid-replacement left in {old}")
        else:
            shutil.rmtree(old)
            warn(f"{label} {out}: removed {old}, the earlier result a job stopped after replacing it left")
    staging = re.compile(rf"\.{re.escape(out.name)}\.[a-z0-9_]{{8}}")
    for path in sorted(out.parent.iterdir()) if out.parent.is_dir() else []:
        if not staging.fullmatch(path.name) or not path.is_dir() or path.is_symlink():
            continue
        maker = _maker(path)
        if not any(path.iterdir()):  # an empty one: nothing to lose
            path.rmdir()
        elif maker.get("host") == HOST and not alive(maker.get("pid")):
            shutil.rmtree(path)
            warn(f"{label} {out}: removed {path}, the unfinished results of a job that was stopped")
        else:  # another host's job, which may still be writing it (where locks are not shared), or not ours
            warn(f"{label} {out}: {path} is left beside it by another job; remove it once that job has ended")


def out_lock(out: str | Path, command: str, label: str = "--out") -> contextlib.AbstractContextManager:
    """The lock of one job on `out`: `.NAME.lock` beside it, taken by the job's leader only (`job_leader`)."""
    if not job_leader():
        return contextlib.nullcontext()
    where = Path(os.path.abspath(out))
    return RunLock(
        where.parent, name=f".{where.name}.lock", command=command, subject=f"{label} {out}",
        rule="one job per output", alternative=f"give another {label}",
    )  # fmt: skip


def split_lock(outdir: Path, split: str) -> RunLock:
    """The lock of one `data convert` on one split of OUTDIR, `OUTDIR/.SPLIT.lock`: conversions of other
    splits into OUTDIR run beside it."""
    return RunLock(
        outdir, name=f".{split}.lock", command="data convert", subject=f"split {split!r} of OUTDIR {outdir}",
        rule="one conversion per split", alternative="give another OUTDIR or --split",
    )  # fmt: skip


def commit(staged: Path, out: Path, replace: bool = False, label: str = "--out") -> None:
    """Put the finished `staged` (a directory or a file beside `out`, same filesystem) at `out`.

    Never over what another job put there meanwhile: a directory is renamed, which POSIX refuses onto a
    directory holding files (onto an empty one it succeeds: nothing is lost); a file is hard-linked,
    which fails if the name exists. Then `staged` is kept beside `out` under a visible name, and the
    line says where. With `replace` an old `out` is moved aside and removed once the new one is in."""
    if replace and out.is_dir() and any(out.iterdir()):
        if _exchange(staged, out):  # one step: `out` holds the old or the new, whatever stops the job
            shutil.rmtree(staged)  # the old output now
            return
        old = out.with_name(f".{out.name}.old")  # (`recover` put back or removed an earlier one)
        with _signals_held():
            out.rename(old)
            staged.rename(out)
        shutil.rmtree(old)
        return
    try:
        if staged.is_dir():
            staged.rename(out)
        else:
            os.link(staged, out)
            staged.unlink()
    except OSError as err:
        if err.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
            raise
        token = secrets.token_hex(4)
        kept = out.with_name(f"{out.name}.{token}" if staged.is_dir() else f"{out.stem}.{token}{out.suffix}")
        staged.rename(kept)
        raise UserError(
            f"{label} {out} was written by another job while this one ran (its files are kept): this job's "
            f"results are in {kept}; move them, or run again with another {label} or --overwrite"
        ) from None


RENAME_EXCHANGE = 2  # renameat2's flag (linux/fs.h)
AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """`a` and `b` swapped in one atomic step (Linux `renameat2(RENAME_EXCHANGE)`); False where the
    system or the filesystem cannot (then nothing changed)."""
    function = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)  # the C library
    if function is None:
        return False
    if function(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGTERM and SIGINT held off, and delivered when the block ends.

    Blocking them in this thread alone (`pthread_sigmask`) does not hold them: the kernel hands a signal
    sent to the process to any thread that does not block it (torch's, W&B's, a timer's), and Python
    runs its handler in the main thread at its next instruction, between the two renames. So in the main
    thread their Python handlers are swapped for one that only notes them, and the signals noted are
    raised again once the handlers are back; elsewhere (no handler can be set there) they are blocked."""
    held = (signal.SIGTERM, signal.SIGINT)
    if threading.current_thread() is not threading.main_thread():
        previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, held)
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)
        return
    caught: list[int] = []
    handlers = {signum: signal.getsignal(signum) for signum in held}
    swapped = {signum: h for signum, h in handlers.items() if h is not None}  # None: not set from Python
    blocked = [signum for signum in held if signum not in swapped]
    previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, blocked) if blocked else None
    try:
        for signum in swapped:
            signal.signal(signum, lambda received, frame: caught.append(received))
        yield
    finally:
        for signum, handler in swapped.items():
            signal.signal(signum, handler)
        if previous_mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)
        for signum in dict.fromkeys(caught):
            signal.raise_signal(signum)  # its handler runs here (raising Terminated or Interrupted)


class Output:
    """`with Output(out, command, inputs, overwrite) as output:` an output directory checked (`check_out`)
    and locked (`out_lock`) from the start of the job to its end; `with output.staged() as temp:` the
    directory to write the computed results into, committed at the end of the block (`commit`); then
    `output.optional` for what may fail without costing them (pictures, W&B), whose failures are collected
    as `notes`. Under torchrun every rank checks, rank 0 locks and writes."""

    def __init__(
        self, out: str | Path, command: str, inputs: Iterable[Input] = (), overwrite: bool = False
    ) -> None:
        self.path = Path(out)
        self.command, self.inputs, self.overwrite = command, list(inputs), overwrite
        self.notes: list[str] = []
        self._held = contextlib.ExitStack()

    def __enter__(self) -> Output:
        check_out(self.path, self.overwrite, self.inputs, used=False)
        with contextlib.ExitStack() as held:
            held.enter_context(out_lock(self.path, self.command))
            if job_leader():  # the lock's holder: what a job stopped during its commit left
                recover(self.path)
            # Under the lock: a job that held it until now may have filled it.
            refuse_used(self.path, self.overwrite)
            self._held = held.pop_all()
        return self

    def __exit__(self, *exc) -> None:
        self._held.close()

    @contextlib.contextmanager
    def staged(self) -> Iterator[Path]:
        """A temporary directory next to the output to write into, committed when the block ends (an old
        output, from --overwrite, is removed only then), removed when it raises."""
        # A real name and parent for paths such as `runs/..` too; an --out that is a symbolic link to an
        # earlier output: that output is replaced, the link kept.
        out = Path(os.path.realpath(self.path))
        out.parent.mkdir(parents=True, exist_ok=True)
        temp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        # mkdtemp makes it 0700 whatever the umask; the finished output gets what mkdir would have given it.
        temp.chmod(0o777 & ~current_umask())
        mark(temp, self.command)
        try:
            yield temp
            commit(temp, out, self.overwrite)
        except BaseException:
            shutil.rmtree(temp, ignore_errors=True)
            raise

    def optional(self, what: str, make: Callable[[], T]) -> T | None:
        """`make()`'s result; when it raises (an Exception: a signal still ends the command), one warning
        line and a note naming `what`, and None: the results committed before stay as they are."""
        try:
            return make()
        except Exception as err:
            self.notes.append(f"{what} failed ({first_line(err)}); the results are complete without it")
            warn(self.notes[-1])
            return None

    def rewrite(self, name: str, text: str) -> None:
        """The committed output's file `name` replaced whole by `text` (a reader sees the old or the new)."""
        write_text(Path(self.path) / name, text)

    def picture(self, name: str, draw: Callable[[Path], object]) -> Path | None:
        """`draw(path)` writes the picture `name` (or decides there is none to draw: nothing at `path`);
        drawn beside the committed output and renamed into it, so a failed drawing leaves no half file.
        The picture's path in the output, or None."""
        out = Path(os.path.abspath(self.path))
        with tempfile.TemporaryDirectory(prefix=f".{out.name}.", dir=out.parent) as scratch:
            drawn = Path(scratch) / name

            def make() -> bool:
                draw(drawn)
                return drawn.is_file()  # False: nothing to draw (no few-shot protocol for fewshot.png)

            if not self.optional(name, make):
                return None
            os.replace(drawn, out / name)
        return out / name


def current_umask() -> int:
    """The process's umask (reading it means setting it: set back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


__all__ = [
    "MARKER", "Input", "Output", "check_out", "checkpoint_inputs", "commit", "is_ours", "mark", "out_lock",
    "recover", "refuse_inputs", "refuse_used", "split_lock",
]  # fmt: skip
