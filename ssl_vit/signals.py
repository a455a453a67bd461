"""Signals as exceptions, for the commands that clean up after themselves when stopped (every command
but `fit`, whose SIGTERM is a checkpoint: `ssl_vit.run.preemption`).

A scheduler stops a job with SIGTERM, whose default action ends the process at once: no `finally`
block runs, so a half-written shard, a staged `--out` or a temporary directory stays behind. `raises`
makes SIGTERM raise `Terminated` (and Ctrl-C ssl-vit's `Interrupted`, which Lightning's trainers do not
swallow) in the command's process, so that it cleans up on the way out; `ssl_vit.cli.main` ends with
one line and exit status 143 (128 + SIGTERM) or 130."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading


class Terminated(BaseException):
    """SIGTERM in the process of a command (`raises`). A BaseException, as
    KeyboardInterrupt is, so that `except Exception` cleanup that would swallow it does not."""


@contextlib.contextmanager
def raises(signum: int, error: type[BaseException], in_children: type[BaseException] | None = None):
    """Signal `signum` raises `error` in this process while the block runs (and is noted: `received`);
    in processes forked from it (DataLoader workers, encoding workers) it raises `in_children`, or,
    when None, takes the signal's default action. The handler before is put back.

    Raised inside a finalizer (a `__del__`, such as a DataLoader iterator's shutting its workers down),
    the exception would be ignored, Python's rule for finalizers, and the command would go on as if it
    had never been stopped: the signal is sent again, to be raised where the finalizer returns to."""
    main_pid = os.getpid()
    previous_hook = sys.unraisablehook

    in_hook = []  # non-empty while `unraisable` runs: an exception raised there is ignored too

    def unraisable(info) -> None:
        in_hook.append(True)
        try:
            if isinstance(info.exc_value, error) and os.getpid() == main_pid:
                _send_again(main_pid, signum, 0.01)  # sent from here, it would be handled (and ignored) here
                return
            previous_hook(info)
        finally:
            in_hook.clear()

    def handler(received, frame):
        if os.getpid() != main_pid:
            if in_children is not None:
                raise in_children()
            signal.signal(received, signal.SIG_DFL)
            os.kill(os.getpid(), received)
            return
        if in_hook:  # on a busy machine the signal sent again can land before the hook has returned
            _send_again(main_pid, received, 0.01)
            return
        if in_logging(frame):
            # Raised there, it could leave logging's module lock held, and the next log line (the
            # cleanup's, or Lightning's as it tears down) would wait for it for ever: the signal comes
            # again in 50 ms.
            _send_again(main_pid, received, 0.05)
            return
        _RECEIVED.add(received)
        raise error()

    with _handled(signum, handler):
        sys.unraisablehook = unraisable
        try:
            yield
        finally:
            sys.unraisablehook = previous_hook


def _send_again(pid: int, signum: int, delay_s: float) -> None:
    """`signum` to `pid` again in `delay_s`, from another thread."""
    threading.Timer(delay_s, os.kill, (pid, signum)).start()


@contextlib.contextmanager
def _handled(signum: int, handler):
    """`handler` for `signum` while the block runs, then the one before; outside the main thread (an
    embedding program) Python's own handling stays."""
    try:
        previous = signal.signal(signum, handler)
    except ValueError:
        yield
        return
    try:
        yield
    finally:
        signal.signal(signum, previous)


_RECEIVED: set[int] = set()


@contextlib.contextmanager
def recorded(signum: int):
    """Signal `signum` is only noted while the block runs, for a later stage of the command to act on
    (`received`), instead of taking its default action (SIGUSR1's ends the process). The handler before
    is put back."""

    with _handled(signum, lambda received, frame: _RECEIVED.add(received)):
        yield


def received(signum: int) -> bool:
    """Whether `signum` came while `recorded(signum)` or `raises(signum, ...)` was noting it."""
    return signum in _RECEIVED


def in_logging(frame) -> bool:
    """Whether `frame` or a caller of it runs code of the `logging` package (which holds locks)."""
    logging_dir = os.path.dirname(logging.__file__)
    while frame is not None:
        if frame.f_code.co_filename.startswith(logging_dir):
            return True
        frame = frame.f_back
    return False
