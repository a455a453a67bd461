"""One progress display for a whole `evaluate` or `compare`: which checkpoint of how many, which split or
protocol, images (or steps) per second, and an ETA for the step and for the job.

On a terminal it is a rich display of two bars on stderr (the job, the current step), as `data convert`
shows; elsewhere (a log file, a batch job's output, each rank under torchrun) one line per finished
step on stdout. The
evaluation code reports through the module functions (`step`), which do nothing outside a `job`, so
library callers of `evaluate` see nothing.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator

_current: _Job | None = None


@contextlib.contextmanager
def job(command: str, runs: int, lines: bool | None = None) -> Iterator[_Job]:
    """The display of `command` over `runs` checkpoints (this process's share under torchrun). `lines`:
    one line per step on stdout instead of bars on stderr; by default when stdout is not a terminal
    (a log file, CI), so that stderr keeps only warnings and errors."""
    global _current
    current = _Job(command, runs, (not sys.stdout.isatty()) if lines is None else lines)
    _current = current
    try:
        yield current
    finally:
        _current = None
        current.close()


def run(index: int, name: str) -> None:
    """The job moves to its `index`-th checkpoint (from 0), shown as `name`."""
    if _current is not None:
        _current.run(index, name)


@contextlib.contextmanager
def step(what: str, total: int | None = None, unit: str = "images") -> Iterator[Callable[[int], None]]:
    """A step of the current checkpoint (a split's feature pass, a protocol's training); yields
    `advance(n)`, to call as `n` more images (or steps) are done."""
    if _current is None:
        yield lambda n: None
        return
    with _current.step(what, total, unit) as advance:
        yield advance


class _Job:
    def __init__(self, command: str, runs: int, lines: bool):
        self.command, self.runs, self.lines = command, max(1, runs), lines
        self.start = time.monotonic()
        self.index, self.name = 0, ""
        self.steps_done = 0  # of the current checkpoint
        self.steps_per_run: int | None = None  # known once the first checkpoint is done
        self.bar = None
        if not lines:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(
                "[progress.description]{task.description}",
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[rate]}"),
                TimeRemainingColumn(),
                console=Console(stderr=True),
                transient=True,
            )
            self.job_task = self.bar.add_task(command, total=self.runs, rate="")
            self.step_task = self.bar.add_task("", total=None, rate="", visible=False)
            self.bar.start()

    def run(self, index: int, name: str) -> None:
        if index > 0 and self.steps_per_run is None:
            self.steps_per_run = max(1, self.steps_done)
        self.index, self.name, self.steps_done = index, name, 0
        self._show_job()

    def _fraction(self) -> float:
        within = min(1.0, self.steps_done / self.steps_per_run) if self.steps_per_run else 0.0
        return (self.index + within) / self.runs

    def _eta(self) -> str:
        fraction = self._fraction()
        if fraction <= 0:
            return "?"
        elapsed = time.monotonic() - self.start
        return clock(elapsed / fraction - elapsed)

    def _prefix(self) -> str:
        return f"{self.command} [{self.index + 1}/{self.runs}] {self.name}"

    def _show_job(self) -> None:
        if self.bar is not None:
            self.bar.update(self.job_task, completed=self._fraction() * self.runs, description=self._prefix())

    @contextlib.contextmanager
    def step(self, what: str, total: int | None, unit: str):
        start, done = time.monotonic(), 0

        def advance(n: int) -> None:
            nonlocal done
            done += n
            if self.bar is not None:
                rate = done / max(time.monotonic() - start, 1e-9)
                self.bar.update(self.step_task, completed=done, rate=f"{rate:,.0f} {unit}/s")

        if self.bar is not None:
            self.bar.reset(self.step_task, total=total, description=f"  {what}", rate="", visible=True)
        try:
            yield advance
        finally:
            self.steps_done += 1
            self._show_job()
            if self.lines:
                seconds = time.monotonic() - start
                rate = f" ({done / seconds:,.0f} {unit}/s)" if done and seconds > 0 else ""
                count = f", {done:,} {unit}" if done else ""
                print(
                    f"{self._prefix()}: {what}{count} in {seconds:.1f} s{rate}; ETA {self._eta()}", flush=True
                )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def clock(seconds: float) -> str:
    """Seconds as H:MM:SS."""
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}"
