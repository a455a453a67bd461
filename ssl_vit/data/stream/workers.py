"""DataLoader workers under a cluster's signals: what a worker does on SIGUSR1/SIGTERM, how the main
process stops them at once, and when a dead worker's error is raised (between two steps, never in
the middle of one)."""

from __future__ import annotations

import functools
import multiprocessing
import os
import signal
import sys
import threading
import weakref

from ssl_vit.internals import is_dataloader_sigchld_handler


class DeadWorkers:
    """When torch reports a dead DataLoader worker: from inside `next`, between two steps.

    Torch's SIGCHLD handler (set by the first iterator with workers) raises a dead worker's error
    wherever the main thread is when the worker dies: in the middle of a step, between an optimizer's
    updates, where the run's state cannot be saved. Wrapped here (`watch`), it raises at once only while
    the main thread waits in a loader's `next` (a batch of the dead worker would never come), and
    otherwise keeps the error for the next `next`, which raises it before fetching (`_Watched`). Either
    way the error leaves `next` marked `at_batch_boundary`, and `ssl_vit.run.preemption` saves there."""

    in_next = False
    pending: BaseException | None = None

    @classmethod
    def watch(cls) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        torch_handler = signal.getsignal(signal.SIGCHLD)
        if not is_dataloader_sigchld_handler(torch_handler):
            return  # not set (no workers), or wrapped already

        def handler(signum, frame):
            try:
                torch_handler(signum, frame)
            except RuntimeError as err:
                if cls.in_next:
                    raise
                cls.pending = err

        signal.signal(signal.SIGCHLD, handler)

    @classmethod
    def fetch(cls, iterator):
        """`next(iterator)`, or the error of a worker that died since the last fetch."""
        try:
            if cls.pending is not None:
                err, cls.pending = cls.pending, None
                raise err
            cls.in_next = True
            try:
                return next(iterator)
            finally:
                cls.in_next = False
        except RuntimeError as err:
            err.at_batch_boundary = True
            raise


# How long a DataLoader worker outlives a SIGTERM: long enough for its main process to finish the step
# and save (it stops its workers itself), bounded so that a worker whose main process never stops it
# (e.g. a leaked iterator at interpreter exit, which terminates daemonic children with SIGTERM) ends.
# SSL_VIT_WORKER_GRACE_S sets it (a cluster whose jobs need longer between SIGTERM and SIGKILL; tests).
WORKER_SIGTERM_GRACE_S = int(os.environ.get("SSL_VIT_WORKER_GRACE_S", "60"))


class Workers:
    """How a DataLoader's workers take job signals, and how its main process stops them at once.

    SLURM signals every process of a job step, DataLoader workers included. A worker killed by SIGUSR1
    or SIGTERM would make the main process fail at once (torch raises from its SIGCHLD handler) before
    it could save; the main process decides what the signal means (`ssl_vit.run.preemption`) and
    stops its workers itself. So a worker (`start`, its `worker_init_fn`) ignores SIGUSR1, and ends
    WORKER_SIGTERM_GRACE_S seconds after a SIGTERM (SIGALRM's default action) unless it was stopped
    before; but once its main process has given up on it (`stop`: no batch within the timeout), a
    SIGTERM ends it at once, with status 0 (which torch's SIGCHLD handler takes for a normal end), so
    that a worker stuck in a read does not keep the ending process alive for the grace period.

    Shared memory (the workers' pids, the flag) because a worker's signal handler cannot ask its main
    process anything, and torch gives no public way to the pids of an iterator's workers."""

    def __init__(self, num_workers: int):
        self.pids = multiprocessing.RawArray("i", max(1, num_workers))
        self.stopping = multiprocessing.RawValue("b", 0)
        _LIVE.add(self)

    def reset(self) -> None:
        """Before an iterator starts its workers."""
        self.pids[:] = [0] * len(self.pids)
        self.stopping.value = 0

    def start(self, worker_id: int) -> None:
        self.pids[worker_id] = os.getpid()
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, self._on_sigterm)
        sys.excepthook = functools.partial(self._excepthook, sys.excepthook)

    def _on_sigterm(self, signum, frame) -> None:
        self.terminated = True
        if self.stopping.value:
            os._exit(0)
        signal.alarm(WORKER_SIGTERM_GRACE_S)

    def _excepthook(self, previous, kind, value, traceback) -> None:
        """In a worker: a connection its main process has closed, which multiprocessing's
        file-descriptor sharing thread (`multiprocessing.resource_sharer`) reports through
        `sys.excepthook`, is a consequence of the main process stopping (a SIGTERM, a dead sibling
        worker, a user error), which says so itself: not news. That thread can see the reset before
        `stop` marks the job stopping, so its own connection errors are dropped whenever they come."""
        stopping = self.stopping.value or getattr(self, "terminated", False)
        lost = issubclass(kind, (ConnectionError, EOFError))
        if not (lost and (stopping or _in_resource_sharer(traceback))):
            previous(kind, value, traceback)

    def stop(self) -> None:
        """In the main process: end the current iterator's workers now (only processes that are still
        this process's children: a finished iterator's pids may belong to anyone by now)."""
        self.stopping.value = 1
        children = {child.pid for child in multiprocessing.active_children()}
        for pid in self.pids:
            if pid in children:
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass


# Every data loader's workers of this process, for `stop_all_workers`.
_LIVE: weakref.WeakSet[Workers] = weakref.WeakSet()


def stop_all_workers() -> None:
    """End every DataLoader worker of this process now: for a run that has saved and is stopping
    (SIGTERM), whose workers would otherwise sit out their grace period, the process waiting for them
    at exit."""
    for workers in list(_LIVE):
        workers.stop()


def _in_resource_sharer(traceback) -> bool:
    """Whether `traceback` passes through multiprocessing's file-descriptor sharing thread."""
    while traceback is not None:
        if traceback.tb_frame.f_globals.get("__name__") == "multiprocessing.resource_sharer":
            return True
        traceback = traceback.tb_next
    return False
