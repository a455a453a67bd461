"""`ssl-vit status RUN_DIR`: where a fit is, or was, from what its run directory holds alone.

For a run that is going, has ended or was killed, here or on another machine (a copied directory, a
shared filesystem): its step and epoch, the loss over the last progress records as a text sparkline
(`--plot PNG` draws it), throughput and ETA, its checkpoints and whether each is intact (their CRC-32s,
`ssl_vit.checkpoints.integrity`), skipped samples, rollbacks and preemptions with their times, and whether
its lock (`ssl_vit.storage.lock`) is held by a live process. It reads the progress record
(`ssl_vit.run.record`), the checkpoints' names and bytes and the lock file, and writes nothing in the run
directory: no lock is taken (the kernel is asked who holds it), and `--plot` may not point inside it.

Light to import (`ssl-vit --help` registers its parser): stdlib only, matplotlib for `--plot`.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ssl_vit.checkpoints import integrity
from ssl_vit.errors import UserError
from ssl_vit.progress import clock
from ssl_vit.run import record
from ssl_vit.storage.lock import LOCK_NAME, lock_state
from ssl_vit.storage.outdir import Input, refuse_inputs

SPARKS = "▁▂▃▄▅▆▇█"
STEP_FILE = re.compile(r"step(\d+)\.ckpt$")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "status", help="where a fit is or was: step, loss, throughput, checkpoints, skips, rollbacks, lock"
    )
    parser.add_argument(
        "run_dir", metavar="RUN_DIR", help="a fit's run directory (--trainer.default_root_dir)"
    )
    parser.add_argument(
        "--last", type=int, default=40, metavar="N", help="progress records the loss line spans (default 40)"
    )
    parser.add_argument(
        "--plot", metavar="PNG", help="also draw the loss of every progress record into this picture"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if args.last < 2:
        raise UserError(f"--last {args.last}: give at least 2 records, e.g. 40")
    check_run_dir(run_dir)
    if args.plot:
        refuse_inputs(args.plot, [Input(run_dir, f"the run directory {run_dir}")], "--plot")
    records = record.read(run_dir)
    for line in report(run_dir, records, args.last):
        print(line)
    if args.plot:
        plot(records, Path(args.plot))
        print(f"loss plot: {args.plot}")
    return 0


def check_run_dir(run_dir: Path) -> None:
    """A one-line UserError unless `run_dir` is a directory a fit made (it holds config.yaml,
    checkpoints/, the progress record or the fit's lock)."""
    if not run_dir.is_dir():
        raise UserError(f"{run_dir} is not a directory: give the run directory of a fit")
    marks = ("config.yaml", "checkpoints", record.RECORD_NAME, LOCK_NAME)
    if not any((run_dir / name).exists() for name in marks):
        raise UserError(
            f"{run_dir} is not a fit's run directory (it holds none of {', '.join(marks)}): give the "
            "--trainer.default_root_dir of a fit"
        )


def report(run_dir: Path, records: list[dict[str, Any]], last: int) -> list[str]:
    """The lines `ssl-vit status` prints for `run_dir`, whose progress record is `records`."""
    lock = lock_state(run_dir)
    progress = [r for r in records if r["event"] == "progress"]
    lines = [f"run {run_dir}: {state(records, lock)}"]
    if not records:
        lines.append("no progress record (a fit of an older ssl-vit, or one that never started training)")
    if progress:
        lines += progress_lines(progress, records, last, running=lock.startswith("held"))
    lines += checkpoint_lines(run_dir)
    lines += event_lines(records)
    lines.append(f"lock: {lock}")
    return lines


def state(records: list[dict[str, Any]], lock: str) -> str:
    """Going, ended, preempted, failed or killed: from the record's last event and the lock."""
    ends = [r for r in records if r["event"] in ("ended", "preempted", "failed", "start")]
    last = ends[-1] if ends else None
    if lock.startswith("held"):
        return "going"
    if last is None or last["event"] == "start":
        seen = f", last record at step {records[-1].get('step', '?')} {when(records[-1])}" if records else ""
        return f"killed or lost (it recorded no end, and no live process holds its lock{seen})"
    if last["event"] == "ended":
        return f"ended at step {last['step']} {when(last)}"
    if last["event"] == "preempted":
        requeued = ", requeued" if last.get("requeued") else ""
        return f"stopped by a signal at step {last['step']} {when(last)}, saved{requeued}"
    return f"failed at step {last['step']} {when(last)}: {last.get('why', '?')}"


def progress_lines(progress: list[dict], records: list[dict], last: int, running: bool) -> list[str]:
    latest = progress[-1]
    total = latest.get("total")
    final = next((r for r in reversed(records) if r["event"] in ("ended", "preempted", "failed")), None)
    step = final["step"] if final is not None and final["time"] >= latest["time"] else latest["step"]
    share = f"/{total} ({100 * step / total:.0f}%)" if total else ""
    lines = [f"step {step}{share}, epoch {latest['epoch'] + 1}"]
    losses = [(r["step"], r["loss"]) for r in progress[-last:] if isinstance(r.get("loss"), (int, float))]
    if losses:
        lines.append(
            f"loss, steps {losses[0][0]}-{losses[-1][0]}: {sparkline([v for _, v in losses])} "
            f"{losses[0][1]:.4g} -> {losses[-1][1]:.4g}"
        )
    eta = latest.get("eta_s")
    if running and eta is not None:
        eta = max(0.0, eta - (time.time() - latest["time"]))
    eta_text = f", ETA {clock(eta)}" if running and eta is not None else ""
    lines.append(f"throughput {latest['images_per_s']:,.0f} images/s{eta_text} ({when(latest)})")
    return lines


def checkpoint_lines(run_dir: Path) -> list[str]:
    """The run's checkpoints, oldest step first, each intact or what is wrong with it."""
    folder = run_dir / "checkpoints"
    files = sorted(folder.glob("*.ckpt")) if folder.is_dir() else []
    if not files:
        return ["checkpoints: none"]
    last = folder / "last.ckpt"

    def order(path: Path) -> tuple[int, str]:
        match = STEP_FILE.search(path.name)
        return (int(match[1]) if match else math.inf, path.name)

    lines = [f"checkpoints ({len(files)}):"]
    for path in sorted(files, key=order):
        same = path != last and last.exists() and os.path.samefile(path, last)
        lines.append(f"  {path.name}: {verdict(path)}{' (= last.ckpt)' if same else ''}")
    return lines


def verdict(path: Path) -> str:
    try:
        why = integrity.damage(path)
    except OSError as err:
        return f"unreadable ({err.strerror})"
    if why is not None:
        return f"DAMAGED ({why})"
    return "intact" if integrity.has_checksums(path) else "no checksums to verify"


def event_lines(records: list[dict[str, Any]]) -> list[str]:
    """Skipped samples and steps, rollbacks, preemptions and the jobs that ran, with their times."""
    progress = [r for r in records if r["event"] == "progress"]
    skipped = progress[-1].get("skipped_samples", 0) if progress else 0
    lines = [f"skipped samples: {skipped} (as of the last progress record)"]
    steps = [r for r in records if r["event"] == "skipped_step"]
    if steps:
        shown = ", ".join(f"step {r['step']} {when(r)}" for r in steps[-5:])
        lines.append(f"non-finite steps skipped: {sum(r.get('count', 1) for r in steps)} ({shown})")
    rollbacks = [r for r in records if r["event"] == "rollback"]
    lines.append(f"rollbacks: {len(rollbacks)}")
    lines += [f"  step {r['step']} -> {r['to_step']} ({r.get('reason', '?')}) {when(r)}" for r in rollbacks]
    stops = [r for r in records if r["event"] == "preempted"]
    lines.append(f"preemptions: {len(stops)}")
    lines += [f"  step {r['step']} {when(r)}{', requeued' if r.get('requeued') else ''}" for r in stops]
    starts = [r for r in records if r["event"] == "start"]
    if starts:
        shown = "; ".join(f"{when(r)} at step {r['step']} on {r.get('host', '?')}" for r in starts[-5:])
        lines.append(f"jobs: {len(starts)} (started {shown})")
    return lines


def sparkline(values: list[float]) -> str:
    """`values` as one bar character each, lowest to highest; `!` for a non-finite one."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return "!" * len(values)
    low, high = min(finite), max(finite)
    span = (high - low) or 1.0
    top = len(SPARKS) - 1
    return "".join(SPARKS[round((v - low) / span * top)] if math.isfinite(v) else "!" for v in values)


def when(entry: dict[str, Any]) -> str:
    """A record's time, as `at 2026-12-06 08:04:05 UTC`."""
    stamp = entry.get("time")
    if not isinstance(stamp, (int, float)):
        return "at an unknown time"
    return f"at {datetime.fromtimestamp(stamp, timezone.utc):%Y-%m-%d %H:%M:%S} UTC"


def plot(records: list[dict[str, Any]], out: Path) -> None:
    """The loss of every progress record against its step, as a PNG at `out` (written whole)."""
    from matplotlib.figure import Figure

    points = [
        (r["step"], r["loss"]) for r in records if r["event"] == "progress" and r.get("loss") is not None
    ]
    if not points:
        raise UserError("--plot: the run has no progress record with a loss yet; run status again later")
    figure = Figure(figsize=(6, 3.5), layout="constrained")
    axes = figure.add_subplot()
    axes.plot([s for s, _ in points], [v for _, v in points], marker=".")
    axes.set_xlabel("step")
    axes.set_ylabel("training loss")
    for r in records:
        if r["event"] == "rollback":
            axes.axvline(r["step"], color="tab:red", linewidth=0.8)
    temp = out.with_name(f".{out.name}.tmp")
    figure.savefig(temp, format="png", dpi=100)
    os.replace(temp, out)
