"""The one error type the CLI turns into a one-line message and a non-zero exit."""

from __future__ import annotations

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
