"""The progress display of `evaluate` (and `compare`, which shares it): one line per finished step on a
non-terminal stdout, a rich display with rates and an ETA on a terminal. Through the CLI, as users run it."""

import json
import re
from pathlib import Path

import pytest
from cli_helpers import run_cli, run_on_terminal

ROOT = Path(__file__).resolve().parents[2]
BACKBONE = {"variant": "S/8", "img_size": 32, "width": 32, "depth": 1, "heads": 2}
LINEAR_STEPS, FT_STEPS = 3, 6


def write_suite(path: Path, shards: Path) -> Path:
    """A suite of every kind of step: the two splits' feature passes (k-NN), a linear probe trained on
    cached features (augmentation `eval`) at two label fractions, and a fine-tuning with its test pass."""
    suite = {
        "backbone": BACKBONE,
        "data": {
            "train_urls": str(shards / "train-{000000..000004}.tar"),
            "test_urls": str(shards / "val-{000000..000003}.tar"),
            "image_size": 32,
            "batch_size": 64,
            "num_workers": 0,
        },
        "protocols": [
            {"name": "knn", "kind": "knn", "k": 5},
            {
                "name": "linear", "kind": "linear_probe", "augmentation": "eval", "steps": LINEAR_STEPS,
                "lrs": [0.1, 0.3], "label_fractions": [0.5, 1.0],
            },
            {"name": "ft", "kind": "finetune", "steps": FT_STEPS},
        ],
    }  # fmt: skip
    path.write_text(json.dumps(suite))  # JSON is YAML
    return path


def expected_steps(shards: Path) -> list[tuple[str, int, str]]:
    """(what, how many, unit) of each step the suite runs, in order."""
    train, test = (
        json.loads((shards / f"{split}.json").read_text())["num_samples"] for split in ("train", "val")
    )
    return [
        ("features of train", train, "images"),
        ("features of test", test, "images"),
        ("linear: training", LINEAR_STEPS, "steps"),  # label fraction 0.5
        ("linear: training", LINEAR_STEPS, "steps"),  # label fraction 1.0
        ("ft: training", FT_STEPS, "steps"),
        ("ft: scoring test", test, "images"),
    ]


def test_evaluate_prints_one_line_per_finished_step_when_stdout_is_not_a_terminal(digits_shards, tmp_path):
    suite = write_suite(tmp_path / "suite.yaml", digits_shards)
    proc = run_cli("evaluate", "scratch", "--suite", str(suite), "--out", str(tmp_path / "out"), check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("evaluate ")]
    steps = expected_steps(digits_shards)
    assert len(lines) == len(steps), proc.stdout
    for line, (what, count, unit) in zip(lines, steps):
        pattern = (
            rf"evaluate \[1/1\] scratch: {re.escape(what)}, {count:,} {unit} in \d+\.\d s "
            rf"\([\d,]+ {unit}/s\); ETA (\?|\d+:\d\d:\d\d)"
        )
        assert re.fullmatch(pattern, line), (line, pattern)
    assert "\x1b" not in proc.stdout + proc.stderr  # no bar drawn into a log
    assert not [line for line in proc.stderr.splitlines() if "ETA" in line or "images/s" in line], proc.stderr
    assert (tmp_path / "out" / "results.json").is_file()


@pytest.mark.slow
def test_evaluate_shows_a_progress_display_on_a_terminal(digits_shards, tmp_path):
    suite = write_suite(tmp_path / "suite.yaml", digits_shards)
    status, shown = run_on_terminal(
        ["evaluate", "scratch", "--suite", str(suite), "--out", str(tmp_path / "out")], cwd=tmp_path
    )
    assert status == 0, shown[-3000:]
    train = expected_steps(digits_shards)[0][1]
    assert "evaluate [1/1] scratch" in shown, shown[-3000:]  # which checkpoint of how many
    assert "0/1" in shown  # the job's bar: checkpoints done
    assert re.search(rf"\b\d+/{train}\b", shown), shown[-3000:]  # the step's bar: images of the split
    for what in ("features of train", "features of test", "linear: training", "ft: training"):
        assert what in shown, what
    assert re.search(r"[\d,]+ images/s", shown) and re.search(r"[\d,]+ steps/s", shown), shown[-3000:]
    assert re.search(r"\b\d+:\d\d:\d\d\b", shown), shown[-3000:]  # an ETA
    assert "━" in shown  # a bar, not lines
    assert "; ETA " not in shown  # the lines of a log are not printed on a terminal
    assert (tmp_path / "out" / "results.json").is_file()
