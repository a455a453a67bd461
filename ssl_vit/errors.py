"""The one error type the CLI turns into a one-line message and a non-zero exit, and how the CLI finds
it behind the wrappers libraries put around it."""

from __future__ import annotations

import errno
import math
import os
import re
import reprlib
import sys
from collections import deque


class UserError(Exception):
    """Bad input from the user: the message names the problem and the fix, no traceback is shown.

    The messages of the last few UserErrors are kept (`recent`): a library that catches one and raises
    its own error with the message pasted in (jsonargparse, for a Union-typed argument) loses the
    exception object, and `ssl_vit.cli.main` still finds the line by its text."""

    recent: deque[str] = deque(maxlen=16)

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        UserError.recent.append(str(self))


class NoUsableData(UserError):
    """Data nothing can be trained or scored on, whatever the checkpoint (a split without a usable
    sample, a protocol's class without an image): `compare` stops with its one line rather than fail
    every row alike. Raised in a DataLoader worker it keeps its type (torch re-raises a worker's
    exception as its own type, with the worker's traceback as the message)."""


class Interrupted(BaseException):
    """Ctrl-C during a command other than fit/validate/test (`ssl_vit.cli.main`), raised instead of
    KeyboardInterrupt: the Lightning trainers of evaluate's and compare's trained protocols turn a
    KeyboardInterrupt into a printed line and exit status 1, but re-raise any other exception after
    tearing down, so the command still ends with one line and 130."""


class BadValue(UserError, ValueError):
    """A UserError raised where callers (and tests) expect a ValueError: a bad argument value."""


def shown(value: object, limit: int = 60) -> str:
    """`repr(value)` for a one-line message, cut to `limit` characters: a hostile value (200 KB of text, a
    number of thousands of digits, YAML aliases that make a few hundred bytes a list of billions of shared
    items) must not become the line, nor take the memory a full `repr` would before it is cut. Values of
    at most `_SHOWN`'s sizes read as their plain `repr`."""
    try:
        text = _SHOWN.repr(value)
    except ValueError:  # an int past Python's 4,300-digit limit for str()
        return "an integer too long to show"
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


# reprlib bounds what a repr builds (depth, items, long strings), not only what it shows. Attributes, not
# arguments: Python 3.11's Repr takes none.
_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxlist, _SHOWN.maxtuple, _SHOWN.maxdict, _SHOWN.maxset = 3, 12, 12, 12, 12
_SHOWN.maxstring = _SHOWN.maxother = _SHOWN.maxlong = 400


def first_line(err: BaseException, limit: int = 200) -> str:
    """`Type: the first non-empty line of its message` for a one-line error that quotes an exception (a
    library's message may run to pages), cut to `limit` characters; `Type` alone for an empty message."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    text = lines[0] if len(lines[0]) <= limit else f"{lines[0][: limit - 3]}..."
    return f"{type(err).__name__}: {text}"


def warn(text: str) -> None:
    """`ssl-vit: warning: TEXT` on stderr, the one line a command warns in."""
    print(f"ssl-vit: warning: {text}", file=sys.stderr, flush=True)


def check_at_least(args, low: int, *names: str) -> None:
    """One line for an integer command-line option below `low` (argparse's `type=int` takes any):
    `names` are attributes of `args`, None meaning the option was not given."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < low:
            raise UserError(f"--{name.replace('_', '-')} must be at least {low}, got {value}")


def check_count(key: str, value: object, low: int, high: int | None = None) -> None:
    """One line for an integer setting `key` (None: its default applies) that is not an integer, is below
    `low` or above `high`."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
        raise BadValue(f"{key} is {shown(value)}: it should be an integer of at least {low}")
    if value is not None and high is not None and value > high:
        raise BadValue(f"{key} is {shown(value)}: it should be an integer of at most {high:,}")


def check_positive_seconds(key: str, value: object) -> None:
    """One line for a setting in seconds (None: its default applies) that is not a positive, finite number."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if value is not None and not (number and 0 < value < math.inf):
        raise BadValue(f"{key} is {shown(value)}: it should be a positive number of seconds")


# The worker's exception line at the end of a DataLoader re-raise: `ssl_vit.errors.UserError: MESSAGE`.
_WORKER_LINE = r"(?P<name>[A-Za-z_][\w.]*): (?P<message>.*)"


def _chain(err: BaseException) -> list[BaseException]:
    """`err` and the exceptions behind it (`__cause__`, `__context__`), each once, `err` first."""
    chain, seen, todo = [], set(), [err]
    while todo:
        exc = todo.pop(0)
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        chain.append(exc)
        todo += [exc.__cause__, None if exc.__suppress_context__ else exc.__context__]
    return chain


# How torch words running out of memory: the CPU allocator's RuntimeError, CUDA's OutOfMemoryError.
_OUT_OF_MEMORY = ("can't allocate memory", "CUDA out of memory", "out of memory")
# How torch's DataLoader reports a worker that died (killed by the kernel's OOM killer, or by hand).
_WORKER_DIED = re.compile(
    r"DataLoader worker \(pid(?:\(s\))? [\d, ]+\) (?:exited unexpectedly|is killed by signal: (?P<sig>[^.]+))"
)
# A write the disk refused for want of room: full (ENOSPC), over quota (EDQUOT), or past the file size
# limit, `ulimit -f` or the filesystem's own (EFBIG; Python ignores SIGXFSZ, so the write fails instead).
NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
RESOURCE_FIXES = {
    "memory": "lower the batch size (data.init_args.batch_size, a suite's batch_size, bench's "
    "--batch-size) or the number of DataLoader workers, or turn on "
    "--model.init_args.backbone.grad_checkpointing",
    "space": "free space there, or give a --trainer.default_root_dir / --out / OUTDIR on a disk with room",
    "size": "raise the limit (ulimit -f), or give a --trainer.default_root_dir / --out / OUTDIR on a "
    "filesystem that takes files this large",
    "worker": "it is usually the kernel's out-of-memory killer: use fewer data.init_args.num_workers or a "
    "smaller shuffle_buffer, or give the job more memory",
}


# How Rust libraries (safetensors) word the OSError behind their own error: `I/O error: ... (os error 28)`.
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def _os_error(exc: BaseException) -> tuple[int | None, str | None]:
    """The errno and file name of an OSError, or of one a library's own error quotes."""
    if isinstance(exc, OSError):
        return exc.errno, exc.filename
    found = _RUST_OS_ERROR.search(str(exc))
    return (int(found[1]), None) if found else (None, None)


def worker_died(err: BaseException) -> bool:
    """Whether `err` is torch's report of a DataLoader worker that died."""
    return any(_WORKER_DIED.search(str(exc)) for exc in _chain(err))


def resource_error_message(err: BaseException) -> str | None:
    """One line naming the resource behind `err` and the fix, when it is the machine that ran out (memory,
    disk space) or a DataLoader worker that died, however deep it was wrapped; else None. Not a mistake
    of the user's input, so the CLI exits 1, not 2."""
    for exc in _chain(err):
        text = str(exc)
        code, filename = _os_error(exc)
        if code == errno.EFBIG:
            where = f" for {filename}" if filename else ""
            return (
                f"file too large{where} ({os.strerror(code)}: the file size limit): {RESOURCE_FIXES['size']}"
            )
        if code in NO_ROOM:
            where = f" on the disk of {filename}" if filename else ""
            return f"no space left{where} ({os.strerror(code)}): {RESOURCE_FIXES['space']}"
        if (
            isinstance(exc, MemoryError)
            or type(exc).__name__ == "OutOfMemoryError"
            or any(words in text for words in _OUT_OF_MEMORY)
        ):
            first = next((line.strip() for line in text.splitlines() if line.strip()), type(exc).__name__)
            return f"out of memory ({first[:160]}): {RESOURCE_FIXES['memory']}"
        found = _WORKER_DIED.search(text)
        if found:
            how = f"was killed by signal {found['sig'].strip()}" if found["sig"] else "exited unexpectedly"
            return f"a DataLoader worker {how}: {RESOURCE_FIXES['worker']}"
    return None


def user_error_message(err: BaseException) -> str | None:
    """The one-line message of the UserError behind `err`, or None when there is none.

    Finds it where libraries put it: `err` itself, its `__cause__`/`__context__` chain (jsonargparse
    and Lightning re-raise constructor and hook errors, e.g. as MisconfigurationException), the last
    line of a DataLoader worker's re-raised exception (`Caught UserError in DataLoader worker process
    0. Original Traceback ...`), or, by its text, a recent UserError pasted into another exception's
    message (jsonargparse's Union errors)."""
    chain = _chain(err)
    for exc in chain:
        text = str(exc)
        worker = _worker_user_error(text) if "Original Traceback" in text else None
        if worker is not None:
            return worker
        if isinstance(exc, UserError):
            return text.strip().splitlines()[-1] if "Original Traceback" in text else text
    for exc in chain:
        # Lightning's own word for a value it refuses (`every_n_train_steps=-3`, ...), raised as the
        # trainer or a callback is built: a user's value, before anything is written
        if type(exc).__name__ == "MisconfigurationException":
            first = str(exc).strip().splitlines()[0]
            return f"{first}: give a valid value in the recipe or on the command line"
    texts = [str(exc) for exc in chain]
    for message in reversed(UserError.recent):
        if message and any(message in text for text in texts):
            return message
    return None


def _worker_user_error(text: str) -> str | None:
    """The message of a DataLoader worker's UserError, from the traceback text torch re-raises."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    match = re.fullmatch(_WORKER_LINE, lines[-1]) if lines else None
    if match is None:
        return None
    module, _, name = match["name"].rpartition(".")
    cls = getattr(sys.modules.get(module), name, None)
    if isinstance(cls, type) and issubclass(cls, UserError):
        return match["message"]
    return None
