"""`ssl_vit.signals.raises` in the process of a command: a stop signal is raised, noted, and not lost
when it lands in a finalizer."""

import os
import signal
import threading
import time

import pytest

from ssl_vit.signals import Terminated, raises, received


class KilledInItsFinalizer:
    """Its `__del__` is where SIGTERM's handler runs (the signal arrives during its sleep), as it may in
    a DataLoader iterator's shutting down its workers."""

    def __del__(self) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)


def test_a_stop_signal_raised_inside_a_finalizer_is_raised_again_where_it_returns():
    """Python ignores an exception a finalizer raises: the command would go on as if never stopped."""
    reached = []
    with pytest.raises(Terminated), raises(signal.SIGTERM, Terminated):
        KilledInItsFinalizer()  # finalized at once: no reference is kept
        reached.append("after the finalizer")
        time.sleep(5)
        reached.append("not stopped")
    assert reached == ["after the finalizer"] and received(signal.SIGTERM)


def test_other_exceptions_of_finalizers_still_reach_the_hook_before(monkeypatch):
    seen = []
    monkeypatch.setattr("sys.unraisablehook", lambda info: seen.append(type(info.exc_value)))

    class Failing:
        def __del__(self) -> None:
            raise ValueError("not a signal")

    with raises(signal.SIGTERM, Terminated):
        Failing()
    assert seen == [ValueError]


def test_a_signal_sent_again_that_lands_in_the_hook_itself_is_not_lost(monkeypatch):
    """On a busy machine the signal sent again from the hook can arrive before the hook returns, where
    Python ignores what the handler raises too: the first time it is sent again at once, synchronously,
    as if the hook's thread lost the CPU for longer than the delay; it must still stop the block."""
    from ssl_vit import signals

    sent = []

    def at_once_then_later(pid, signum, delay_s):
        if not sent:
            sent.append(signum)
            os.kill(pid, signum)  # handled right here, inside the hook
        else:
            threading.Timer(delay_s, os.kill, (pid, signum)).start()

    monkeypatch.setattr(signals, "_send_again", at_once_then_later)
    with pytest.raises(Terminated), raises(signal.SIGTERM, Terminated):
        KilledInItsFinalizer()
        time.sleep(5)
    assert sent == [signal.SIGTERM]
