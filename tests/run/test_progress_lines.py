"""A fit's log a person can read (issue 42): with stdout in a file, a progress line every
`trainer.log_every_n_steps` steps and at least every `progress.every_minutes`, and a final line saying
where the run is; in a terminal Lightning's bar, without `/-2` for an unbounded fit. Through the CLI."""

from __future__ import annotations

import json
import re
import shlex

from cli_helpers import one_step_fit_args, run_cli, run_on_terminal

LINE = re.compile(
    r"^fit: step (\d+)/(\d+) \(\d+%\), epoch (\d+)/(\d+), loss [0-9.e+-]+, lr [0-9.e+-]+, [0-9,]+ images/s, "
    r"ETA \d+:\d\d:\d\d, skipped (\d+) samples, (\d+) rollbacks, last checkpoint (.+)$"
)


def test_a_fit_logging_to_a_file_prints_a_line_every_log_every_n_steps_and_where_it_ends(
    digits_shards, tmp_path
):
    run = tmp_path / "run"
    args = one_step_fit_args(
        digits_shards, run, "--data.init_args.train_batches", "3", "--trainer.max_epochs", "2",
        "--trainer.log_every_n_steps", "2", "--checkpoint.every_n_train_steps", "4",
    )  # fmt: skip
    proc = run_cli(*args, cwd=tmp_path)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("fit: ")]
    progress = [LINE.match(line) for line in lines[:-1]]
    assert all(progress), lines
    epochs = [(m[1], m[2], m[3], m[4]) for m in progress]
    assert epochs == [("2", "6", "1", "2"), ("4", "6", "2", "2"), ("6", "6", "2", "2")]
    assert [(m[5], m[6]) for m in progress] == [("0", "0")] * 3
    # Lightning saves a step's checkpoint after every other callback's end of the step
    assert [m[7] for m in progress][:2] == ["none yet"] * 2 and progress[2][7].endswith("step0000004.ckpt")
    final = lines[-1]
    assert final.startswith(f"fit: run {run} at step 6: last checkpoint {run / 'checkpoints'}"), final
    assert "; W&B offline run in " in final
    resume = shlex.split(final.split("resume: ", 1)[1])
    assert resume == ["ssl-vit", "fit", "--config", str(run / "config.yaml"), "--ckpt_path", "last"]
    # the progress record `ssl-vit status` reads: the same values, and how the job ended
    records = [json.loads(line) for line in (run / "progress.jsonl").read_text().splitlines()]
    assert [r["event"] for r in records] == ["start", "progress", "progress", "progress", "ended"]
    assert [r["step"] for r in records] == [0, 2, 4, 6, 6]
    assert all(isinstance(r["loss"], float) and r["images_per_s"] > 0 for r in records[1:4])


def test_a_slow_fit_prints_a_line_at_least_every_few_minutes(digits_shards, tmp_path):
    args = one_step_fit_args(
        digits_shards, tmp_path / "run", "--data.init_args.train_batches", "3",
        "--trainer.log_every_n_steps", "1000", "--progress.every_minutes", "1e-6",
    )  # fmt: skip
    proc = run_cli(*args, cwd=tmp_path)
    steps = [int(m[1]) for m in map(LINE.match, proc.stdout.splitlines()) if m]
    assert steps == [1, 2, 3], proc.stdout


def test_a_terminal_keeps_the_bar_without_minus_two_for_an_unbounded_fit(digits_shards, tmp_path):
    args = one_step_fit_args(
        digits_shards, tmp_path / "run", "--data.init_args.train_batches", "2", "--trainer.max_epochs", "-1",
        "--trainer.max_steps", "3",
    )  # fmt: skip
    status, shown = run_on_terminal(args, tmp_path)
    assert status == 0, shown[-3000:]
    assert "Epoch 1" in shown and "/-2" not in shown, shown[-3000:]
    assert not LINE.search(shown)  # the bar, not the lines
    assert "fit: run " in shown  # where the run is, once at the end
