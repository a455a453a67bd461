"""The one error type the CLI turns into a one-line message and a non-zero exit, and how the CLI finds
it behind the wrappers libraries put around it."""

from __future__ import annotations

import re
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


class BadValue(UserError, ValueError):
    """A UserError raised where callers (and tests) expect a ValueError: a bad argument value."""


def check_at_least(args, low: int, *names: str) -> None:
    """One line for an integer command-line option below `low` (argparse's `type=int` takes any):
    `names` are attributes of `args`, None meaning the option was not given."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < low:
            raise UserError(f"--{name.replace('_', '-')} must be at least {low}, got {value}")


# The worker's exception line at the end of a DataLoader re-raise: `ssl_vit.errors.UserError: MESSAGE`.
_WORKER_LINE = r"(?P<name>[A-Za-z_][\w.]*): (?P<message>.*)"


def user_error_message(err: BaseException) -> str | None:
    """The one-line message of the UserError behind `err`, or None when there is none.

    Finds it where libraries put it: `err` itself, its `__cause__`/`__context__` chain (jsonargparse
    and Lightning re-raise constructor and hook errors, e.g. as MisconfigurationException), the last
    line of a DataLoader worker's re-raised exception (`Caught UserError in DataLoader worker process
    0. Original Traceback ...`), or, by its text, a recent UserError pasted into another exception's
    message (jsonargparse's Union errors)."""
    chain, seen, todo = [], set(), [err]
    while todo:
        exc = todo.pop(0)
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        chain.append(exc)
        todo += [exc.__cause__, None if exc.__suppress_context__ else exc.__context__]
    for exc in chain:
        text = str(exc)
        worker = _worker_user_error(text) if "Original Traceback" in text else None
        if worker is not None:
            return worker
        if isinstance(exc, UserError):
            return text.strip().splitlines()[-1] if "Original Traceback" in text else text
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
