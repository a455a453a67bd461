"""SIGTERM for the commands that clean up after themselves when stopped (`data convert`, `bench loop`).

A scheduler stops a job with SIGTERM, whose default action ends the process at once: no `finally`
block runs, so a half-written shard or a temporary directory stays behind. `stops_on_sigterm` makes
the signal raise `Terminated` in the command's process instead, so that it cleans up as it does for
Ctrl-C, and ends with one line and exit status 143 (128 + SIGTERM). `fit` needs none of this:
Lightning turns SIGTERM into a checkpoint there (`ssl_vit.tasks.preemption`)."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable


class Terminated(BaseException):
    """SIGTERM in the process of a command run by `stops_on_sigterm`. A BaseException, as
    KeyboardInterrupt is, so that `except Exception` cleanup that would swallow it does not."""


def stops_on_sigterm(command: Callable[..., int]) -> Callable[..., int]:
    """`command(args)` with SIGTERM raising `Terminated` while it runs; a Terminated that reaches the
    top is the line `ssl-vit: terminated` and exit status 143."""

    @functools.wraps(command)
    def run(args) -> int:
        try:
            with _raises(signal.SIGTERM, Terminated):
                return command(args)
        except Terminated:
            print("ssl-vit: terminated", file=sys.stderr)
            return 128 + signal.SIGTERM

    return run


@contextlib.contextmanager
def _raises(signum: int, error: type[BaseException]):
    """Signal `signum` raises `error` in this process while the block runs; processes forked from it
    keep the signal's default action. The handler before is put back."""
    main_pid = os.getpid()

    def handler(received, frame):
        if os.getpid() != main_pid:
            signal.signal(received, signal.SIG_DFL)
            os.kill(os.getpid(), received)
            return
        if _in_logging(frame):
            # Raised there, it could leave logging's module lock held, and the cleanup's own log line
            # would wait for it for ever: the signal comes again in 50 ms (as `ssl_vit.cli` does for Ctrl-C).
            threading.Timer(0.05, os.kill, (main_pid, received)).start()
            return
        raise error()

    try:
        previous = signal.signal(signum, handler)
    except ValueError:  # not the main thread (an embedding program): the default action stays
        yield
        return
    try:
        yield
    finally:
        signal.signal(signum, previous)


def _in_logging(frame) -> bool:
    """Whether `frame` or a caller of it runs code of the `logging` package (which holds locks)."""
    logging_dir = os.path.dirname(logging.__file__)
    while frame is not None:
        if frame.f_code.co_filename.startswith(logging_dir):
            return True
        frame = frame.f_back
    return False
