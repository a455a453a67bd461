"""A fit's progress record, `RUN/progress.jsonl`: what `ssl-vit status` reads of a run that is going, has
ended or was killed, on this machine or another, without Lightning, W&B or the checkpoints' contents.

One JSON object a line, appended by the job's rank 0 (`ssl_vit.run.progress.ProgressLines`), each with its
`time` (seconds since the epoch) and `event`:

- `start`: a job began training (`step`, `host`, `pid`, `resumed`: the checkpoint it resumed or null);
- `progress`: a progress line (`step`, `total`, `epoch`, `loss`, `lr`, `images_per_s`, `eta_s`,
  `skipped_samples`, `skipped_steps`, `rollbacks`, `checkpoint`);
- `rollback`, `skipped_step`: a decision of the non-finite guard, at its `step`;
- `preempted` (SIGTERM or SLURM's requeue signal: saved and stopped, `requeued`), `failed` (`why`),
  `ended`: how the job ended. A job killed outright (SIGKILL, a node lost) writes none.

Appended whole lines only, each a single `write` of well under a pipe buffer: a reader sees every line
complete but, after a kill mid-write, perhaps the last; `read` drops a line that does not parse. Stdlib
only: `ssl-vit status` imports it without torch.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

RECORD_NAME = "progress.jsonl"


def append(run_dir: str | os.PathLike, event: str, **fields: Any) -> None:
    """One record of `event` (with the current time) at the end of `run_dir`'s progress record."""
    line = json.dumps({"time": round(time.time(), 3), "event": event, **fields}, default=str) + "\n"
    with open(Path(run_dir) / RECORD_NAME, "a", encoding="utf-8") as f:
        f.write(line)


def read(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Every complete record of `run_dir`'s progress record, oldest first ([] when it has none)."""
    try:
        text = (Path(run_dir) / RECORD_NAME).read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return []
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # the line a kill cut short
            continue
        if isinstance(record, dict) and isinstance(record.get("event"), str):
            records.append(record)
    return records
