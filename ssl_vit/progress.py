"""Progress of the long commands, one display for all: on a terminal rich bars on stderr (`_bars`);
elsewhere (a log file, a batch job's output, each rank under torchrun) one line per finished part, with
the rate and an ETA.

- `job`: a whole `evaluate` or `compare`: which checkpoint of how many, which split or protocol, images
  (or steps) per second, and an ETA for the step and for the job; a line per finished step on stdout.
  The evaluation code reports through the module functions (`step`), which do nothing outside a `job`,
  so library callers of `evaluate` see nothing.
- `count`: one counted pass, such as `data convert` writing a split; a line per finished part (a
  shard) on stderr.
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
            self.bar = _bars(transient=True)
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
                self.bar.update(self.step_task, completed=done, rate=f"{_rate(done, start):,.0f} {unit}/s")

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


@contextlib.contextmanager
def count(
    what: str, total: int | None, done: int = 0, unit: str = "images", enabled: bool = True
) -> Iterator[_Count]:
    """The display of one counted pass (`what`, of `total` items where known, `done` of them before this
    run: a resumed conversion); nothing when not `enabled`. Lines go to stderr when it is not a
    terminal (stdout keeps the command's result)."""
    current = _Count(what, total, done, unit, enabled and not sys.stderr.isatty(), enabled)
    try:
        yield current
    finally:
        current.close()


class _Count:
    def __init__(self, what: str, total: int | None, done: int, unit: str, lines: bool, enabled: bool):
        self.total, self.first, self.done, self.unit, self.lines = total, done, done, unit, lines
        self.start = time.monotonic()
        self.bar = _bars(transient=False) if enabled and not lines else None
        if self.bar is not None:
            self.task = self.bar.add_task(what, total=total, completed=done, rate="")
            self.bar.start()

    def advance(self, n: int = 1) -> None:
        self.done += n
        if self.bar is not None:
            rate = _rate(self.done - self.first, self.start)
            self.bar.update(self.task, completed=self.done, rate=f"{rate:,.0f} {self.unit}/s")

    def part_done(self, name: str) -> None:
        """A part of the pass is finished (a shard written): its line, when the display is lines."""
        if not self.lines:
            return
        rate = _rate(self.done - self.first, self.start)
        line = f"{name}: {self.done}"
        if self.total:
            line += f"/{self.total} {self.unit} ({100 * self.done / self.total:.0f}%)"
            if rate > 0:
                line += f", ETA {clock((self.total - self.done) / rate)}"
        else:
            line += f" {self.unit}"
        print(f"{line}, {rate:.0f} {self.unit}/s", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _bars(transient: bool):
    """The rich display every progress bar is drawn in, on stderr: description, bar, done/total, rate
    (the task's `rate` field), time remaining. `transient`: erased when it stops."""
    from rich.console import Console  # rich only when a bar is drawn
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]}"),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=transient,
    )


def _rate(done: int, start: float) -> float:
    """Items per second since `start` (a `time.monotonic()`)."""
    return done / max(time.monotonic() - start, 1e-9)


def clock(seconds: float) -> str:
    """Seconds as H:MM:SS."""
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}"
