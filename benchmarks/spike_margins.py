"""How far above its running median a normal training loss goes: the measurement behind the defaults of
`nonfinite.policy: rollback` (`window`, `spike_factor`).

Fits each of the study's pretraining recipes (`recipes/study/*.yaml`: the ViT paper's MPP, MAE, SimMIM and
supervised on Fashion-MNIST) for `--steps` steps with the loss logged at every step, then replays the
spike detector's test on those curves: for each window, the largest ratio of a step's loss to the median
of the `window` steps before it, and how many steps each factor would have called spikes. None of these
runs has a spike, so every step a factor flags is a false alarm (a needless rollback).

    .venv/bin/python benchmarks/spike_margins.py [--steps 1200] [--methods mpp,mae,simmim,supervised]

Needs the study's shards (`bash data/fashion_mnist.sh`); two fits at a time, one thread each; the runs are
written in a temporary directory, removed at the end. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WINDOWS = (20, 50, 100)
FACTORS = (1.5, 2.0, 3.0, 5.0)


def loss_curve(method: str, steps: int, tmp: Path) -> list[float]:
    """The training loss of every step of `method`'s study recipe, seed 0."""
    run = tmp / method
    subprocess.run(
        [sys.executable, "-m", "ssl_vit", "fit", "--config", f"recipes/study/{method}.yaml",
         "--trainer.default_root_dir", str(run), "--trainer.max_steps", str(steps),
         "--trainer.log_every_n_steps", "1", "--trainer.callbacks", "null",
         "--trainer.logger", "pytorch_lightning.loggers.CSVLogger", "--trainer.logger.save_dir", str(run)],
        cwd=ROOT, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    (metrics,) = run.glob("lightning_logs/version_*/metrics.csv")
    with metrics.open() as f:
        return [float(row["train/loss"]) for row in csv.DictReader(f) if row.get("train/loss")]


def margins(losses: list[float]) -> dict:
    """For each window: the highest loss / running median, and the false alarms of each factor."""
    out = {}
    for window in (w for w in WINDOWS if w < len(losses)):
        ratios = [losses[t] / statistics.median(losses[t - window : t]) for t in range(window, len(losses))]
        out[str(window)] = {
            "max_ratio": round(max(ratios), 3),
            "p999_ratio": round(sorted(ratios)[int(0.999 * (len(ratios) - 1))], 3),
            "false_alarms": {str(f): sum(r > f for r in ratios) for f in FACTORS},
            "steps_judged": len(ratios),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1200, help="steps per fit (default 1200, the study's)")
    parser.add_argument("--methods", default="mpp,mae,simmim,supervised")
    args = parser.parse_args()
    methods = args.methods.split(",")
    with tempfile.TemporaryDirectory(prefix="ssl-vit-spikes-") as tmp:
        with ThreadPoolExecutor(2) as pool:
            curves = dict(zip(methods, pool.map(lambda m: loss_curve(m, args.steps, Path(tmp)), methods)))
    report = {
        method: {"steps": len(curve), "first_loss": curve[0], "last_loss": curve[-1], **margins(curve)}
        for method, curve in curves.items()
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
