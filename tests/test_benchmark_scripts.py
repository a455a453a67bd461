"""The loss-spike benchmarks of benchmarks/ run end to end at tiny sizes and measure what they say they
measure (no timing is asserted): rollback.py's restore, guard and whole-fit parts, and spike_margins.py's
replay of the spike detector's test on a loss curve."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(600)
def test_rollback_benchmark_restores_from_the_file_and_memory_and_fits_with_every_policy():
    proc = subprocess.run(
        [sys.executable, "benchmarks/rollback.py", "--variant", "Ti/16", "--repeats", "1", "--steps", "3"],
        cwd=ROOT, capture_output=True, text=True, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    restore = report["restore"]
    # The file holds what the in-memory copy holds (weights and AdamW moments), plus its framing.
    assert restore["memory_bytes"] > 5_000_000
    assert restore["memory_bytes"] <= restore["file_bytes"] < 1.01 * restore["memory_bytes"]
    for part in ("save", "file_restore", "memory_copy", "memory_restore"):
        assert restore[part] > 0
    assert set(report["guard_s_per_step"]) == set(report["loop_s_per_step"]) == {"stop", "skip", "rollback"}
    assert all(v > 0 for v in [*report["guard_s_per_step"].values(), *report["loop_s_per_step"].values()])


def test_spike_margins_replays_the_detectors_test_on_a_curve():
    margins = load_script("spike_margins").margins
    # A loss falling slowly, with a 4x spike at step 150: only the factors below 4 call it a spike.
    curve = [2.0 * 0.999**t * (1.05 if t % 2 else 1.0) for t in range(200)]
    curve[150] *= 4
    report = margins(curve)
    assert set(report) == {"20", "50", "100"}
    for window, found in report.items():
        assert found["steps_judged"] == 200 - int(window)
        assert found["false_alarms"] == {"1.5": 1, "2.0": 1, "3.0": 1, "5.0": 0}
        assert 3.7 < found["max_ratio"] < 4.3
    # A curve shorter than a window is judged by the windows it fills.
    assert set(margins(curve[:60])) == {"20", "50"}
