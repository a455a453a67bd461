"""Loss spikes through the CLI, injected from outside the package (a prelude that multiplies the loss of
chosen calls of the task's training_step by 1e4, or makes it NaN). With `nonfinite.policy rollback` every
rank returns to the last good checkpoint, steps over the batches since and `skip_batches` more, prints one
line, and the run reaches max_steps: no batch is trained on twice, W&B keeps every step once, the state
returned to is the checkpoint's (an EMA teacher's included), a kill or a SIGTERM after or during the
rollback resumes exactly with its history. `skip` says every step it drops; a normal quickstart fit never
rolls back."""

import json
import re
import time
from pathlib import Path

import pytest
import torch
from cli_client import PRELUDE_ENV
from cli_helpers import run_cli, small_fewshot_monitor, start_cli, torchrun_fit, wandb_records
from resume_helpers import ROOT, fit_args, read_steps, spike_prelude
from test_errors import error_line
from test_errors import fit as fast_fit
from test_fsdp import strategy_file

ENV = {"PYTHONPATH": str(Path(__file__).parent), "OMP_NUM_THREADS": "1"}
LINE = re.compile(
    r"ssl-vit: rollback: step (\d+) \(loss (\S+), median (\S+)\) -> checkpoint at step (\d+), "
    r"skipped batches (\d+)-(\d+)$"
)
NAN = float("nan")


def rollback_args(shards, run, record, *extra: str, steps: int = 16, batches: int = 16) -> list[str]:
    """`fit_args` (the quickstart MPP recipe, small; a checkpoint every 4 steps) for `steps` steps of
    `batches` an epoch, no validation, `policy: rollback` with a window of 5 steps."""
    return fit_args(
        shards, run, record, "--trainer.max_epochs", "-1", "--trainer.max_steps", str(steps),
        "--trainer.limit_val_batches", "0", "--nonfinite.policy", "rollback", "--nonfinite.window", "5",
        *extra, batches=batches,
    )  # fmt: skip


def rollback_lines(stderr: str) -> list[re.Match]:
    return [m for m in map(LINE.match, stderr.splitlines()) if m]


def guard_state(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)["callbacks"]["NonFiniteGuard"]


def same_rollbacks(a: list[dict], b: list[dict]) -> bool:
    """Rollback records alike but for their timings and the run directory they name."""
    drop = ("seconds", "checkpoint")
    return [{k: v for k, v in r.items() if k not in drop} for r in a] == [
        {k: v for k, v in r.items() if k not in drop} for r in b
    ]


def assert_continues(got: list[dict], want: list[dict]) -> None:
    """The same steps with the same losses, batches and learning rates."""
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        assert abs(g["loss"] - w["loss"]) < 1e-6 and g["keys"] == w["keys"] and g["lr"] == w["lr"], g["step"]


# 8 a batch, 24 batches an epoch: the 21 batches of the reference are all in epoch 0, whose order holds
# every sample once, so a sample of a skipped batch has no reason to come back but a rollback's mistake.
SPIKED = ["--nonfinite.skip_batches", "2", "--data.init_args.batch_size", "8",
          "--data.init_args.num_workers", "1"]  # fmt: skip
SPIKED_BATCHES = 24


@pytest.fixture(scope="module")
def spiked(digits_shards, tmp_path_factory):
    """A 16-step fit whose 11th loss (step 10) is 1e4 times too large, rolled back to its step-8
    checkpoint with 2 more batches skipped, and the same fit without the spike for 21 steps: the stream
    it continues on."""
    tmp = tmp_path_factory.mktemp("rollback")
    reference = tmp / "reference.jsonl"
    args = rollback_args(
        digits_shards, tmp / "reference", reference, *SPIKED, steps=21, batches=SPIKED_BATCHES
    )
    proc = run_cli(*args, cwd=ROOT, env=ENV)
    assert not rollback_lines(proc.stderr)
    record = tmp / "spiked.jsonl"
    args = rollback_args(digits_shards, tmp / "spiked", record, *SPIKED, batches=SPIKED_BATCHES)
    proc = run_cli(*args, cwd=ROOT, env=ENV, prelude=spike_prelude({11: 1e4}))
    return {
        "reference": read_steps(reference),
        "run": tmp / "spiked",
        "steps": read_steps(record),
        "stderr": proc.stderr,
    }


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_loss_spike_rolls_back_once_steps_over_its_batches_and_the_run_reaches_max_steps(spiked):
    (line,) = rollback_lines(spiked["stderr"])
    # Checkpoint at step 8 (batches 0-7 read); the spike's batch is batch 10; 8-10 and 2 more skipped.
    assert line.group(1, 4, 5, 6) == ("10", "8", "8", "12")
    assert float(line[2]) > 1000 * float(line[3])
    steps, reference = spiked["steps"], {r["step"]: r for r in spiked["reference"]}
    assert [r["step"] for r in steps] == [*range(1, 12), *range(9, 17)]
    assert (
        torch.load(spiked["run"] / "checkpoints/last.ckpt", weights_only=True, mmap=True)["global_step"] == 16
    )
    # Up to the spike, the reference's steps (its schedule is longer: losses and batches only); after
    # it, the stream goes on at batch 13 (the reference's step 14), the schedule at step 9 again.
    for got, want in zip(steps[:10], spiked["reference"]):
        assert abs(got["loss"] - want["loss"]) < 1e-6 and got["keys"] == want["keys"], got["step"]
    after = steps[11:]
    assert [r["keys"] for r in after] == [reference[s]["keys"] for s in range(14, 22)]
    assert [r["lr"] for r in after[:3]] == [r["lr"] for r in steps[8:11]]
    assert len({k for r in spiked["reference"] for k in r["keys"]}) == 21 * 8  # (see SPIKED)
    skipped = {k for s in range(9, 14) for k in reference[s]["keys"]}  # batches 8-12
    assert skipped and not skipped & {k for r in after for k in r["keys"]}

    # W&B: rewound to step 7 (the checkpoint of step 8 holds the metrics of steps 0-7), every step once.
    (_, first), (_, second) = wandb_records(spiked["run"])
    run = next(r["run"] for r in second if r["type"] == "run")
    assert run["branch_point"]["value"] == 7
    history = [r["history"]["item"] for r in second if r["type"] == "history"]
    assert [h["_step"] for h in history] == list(range(8, 17))
    rollback = {k: v for k, v in history[0].items() if k.startswith("rollback/")}
    assert rollback == {
        "rollback/count": 1, "rollback/from_step": 10, "rollback/to_step": 8, "rollback/skipped_batches": 5
    }  # fmt: skip
    kept = [r["history"]["item"]["_step"] for r in first if r["type"] == "history"]
    assert sorted(s for s in kept if s <= 7) + [h["_step"] for h in history] == list(range(17))

    # The checkpoint and `ssl-vit info` keep the history.
    (record,) = guard_state(spiked["run"] / "checkpoints/last.ckpt")["rollbacks"]
    assert (record["step"], record["to_step"], record["batches"]) == (10, 8, [8, 12])
    info = run_cli("info", str(spiked["run"] / "checkpoints/last.ckpt")).stdout
    assert "rollbacks: 1" in info and line[0].removeprefix("ssl-vit: ") in info


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_kill_after_a_rollback_resumes_exactly_with_its_history(spiked, digits_shards, tmp_path):
    run, record, release = tmp_path / "run", tmp_path / "run.jsonl", tmp_path / "release"
    args = rollback_args(digits_shards, run, record, *SPIKED, batches=SPIKED_BATCHES)
    hold = ["--trainer.callbacks+=resume_helpers.HoldAt", "--trainer.callbacks.release", str(release),
            "--trainer.callbacks.step", "9", "--trainer.callbacks.occurrence", "2"]  # fmt: skip
    proc = start_cli(*args, *hold, cwd=ROOT, env=ENV, session=True, prelude=spike_prelude({11: 1e4}))
    deadline = time.monotonic() + 300
    while not Path(f"{release}.reached").exists():
        assert proc.poll() is None, proc.wait().stderr[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.kill()  # SIGKILL one step after the rollback, before the next periodic checkpoint
    proc.wait()
    saved = guard_state(run / "checkpoints/last.ckpt")  # the state the rollback returned to, saved at once
    assert torch.load(run / "checkpoints/last.ckpt", weights_only=True, mmap=True)["global_step"] == 8
    assert len(saved["rollbacks"]) == 1

    run_cli(*args, "--ckpt_path", "last", cwd=ROOT, env=ENV)  # nothing spikes in this process
    steps = read_steps(record)
    assert [r["step"] for r in steps[:12]] == [*range(1, 12), 9]  # the killed job's
    assert_continues(steps[12:], spiked["steps"][11:])  # steps 9-16 as the job that was not killed
    assert same_rollbacks(guard_state(run / "checkpoints/last.ckpt")["rollbacks"], saved["rollbacks"])
    assert same_rollbacks(
        saved["rollbacks"], guard_state(spiked["run"] / "checkpoints/last.ckpt")["rollbacks"]
    )


# A SIGTERM from the scheduler in the middle of a rollback: after the learner is restored, before the data
# stream, W&B and the checkpoint follow.
SIGTERM_IN_ROLLBACK = """
import os as _os, signal as _signal
import ssl_vit.run.nonfinite as _guard
_restore = _guard.restore_learner
def _restore_then_sigterm(trainer, path):
    out = _restore(trainer, path)
    _os.kill(_os.getpid(), _signal.SIGTERM)
    return out
_guard.restore_learner = _restore_then_sigterm
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_sigterm_during_a_rollback_saves_the_whole_rolled_back_state_and_resumes(
    spiked, digits_shards, tmp_path
):
    run, record = tmp_path / "run", tmp_path / "run.jsonl"
    args = rollback_args(digits_shards, run, record, *SPIKED, batches=SPIKED_BATCHES)
    prelude = spike_prelude({11: 1e4}) + SIGTERM_IN_ROLLBACK
    proc = start_cli(*args, cwd=ROOT, env=ENV, session=True, prelude=prelude).wait(300)
    assert proc.returncode == 143, proc.stderr[-3000:]
    assert len(rollback_lines(proc.stderr)) == 1
    assert f"ssl-vit: stopped by SIGTERM after step 8; saved {run}/checkpoints/last.ckpt" in proc.stderr
    saved = torch.load(run / "checkpoints/last.ckpt", map_location="cpu", weights_only=True)
    assert saved["global_step"] == 8 and len(saved["callbacks"]["NonFiniteGuard"]["rollbacks"]) == 1
    (rank,) = saved["ShardDataModule"]["position"]["ranks"]
    assert rank["samples"] == 13 * 8  # batches 0-12 read or stepped over

    run_cli(*args, "--ckpt_path", "last", cwd=ROOT, env=ENV)
    steps = read_steps(record)
    assert [r["step"] for r in steps[:11]] == list(range(1, 12))
    assert_continues(steps[11:], spiked["steps"][11:])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_nan_rolls_back_and_a_spike_past_max_rollbacks_stops_with_one_line(digits_shards, tmp_path):
    run, record = tmp_path / "run", tmp_path / "run.jsonl"
    args = rollback_args(digits_shards, run, record, "--nonfinite.max_rollbacks", "1")
    # NaN at step 6: back to the checkpoint of step 4; then a spike at step 7, one rollback too many.
    proc = run_cli(*args, cwd=ROOT, env=ENV, check=False, prelude=spike_prelude({7: NAN, 11: 1e4}))
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = rollback_lines(proc.stderr)
    # Twice the batches 4-6 skipped beyond them: batches 4-12.
    assert (line[1], line[2], line[4], line[5], line[6]) == ("6", "non-finite", "4", "4", "12")
    errors = [x for x in proc.stderr.splitlines() if x.startswith("ssl-vit: error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr
    assert re.match(
        r"ssl-vit: error: a loss spike at step 7 \(loss \S+, median \S+\) after 1 rollback\(s\), "
        r"nonfinite.max_rollbacks; nothing was saved after it "
        rf"\(last good checkpoint: {run}/checkpoints/last.ckpt\)",
        errors[0],
    ), errors[0]
    assert [r["step"] for r in read_steps(record)] == [1, 2, 3, 4, 5, 6, 7, 5, 6, 7, 8]
    assert len(guard_state(run / "checkpoints/last.ckpt")["rollbacks"]) == 1


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_policy_skip_says_every_step_it_drops_in_one_line_and_a_metric(digits_shards, tmp_path):
    run, record = tmp_path / "run", tmp_path / "run.jsonl"
    args = fit_args(
        digits_shards,
        run,
        record,
        "--trainer.max_epochs",
        "-1",
        "--trainer.max_steps",
        "16",
        "--trainer.limit_val_batches",
        "0",
        "--trainer.log_every_n_steps",
        "5",
        batches=16,
    )  # fmt: skip  (the quickstart's policy: skip)
    proc = run_cli(*args, cwd=ROOT, env=ENV, prelude=spike_prelude({11: NAN}))
    skips = [x for x in proc.stderr.splitlines() if x.startswith("ssl-vit: skip:")]
    assert skips == ["ssl-vit: skip: step 10 not applied: non-finite loss or gradients (1 of at most 10)"]
    # A metric at its step, though step 10 is not one that log_every_n_steps 5 logs.
    (_, records), = wandb_records(run)  # fmt: skip
    logged = {r["history"]["item"]["_step"]: r["history"]["item"] for r in records if r["type"] == "history"}
    assert logged[10]["train/skipped_steps"] == 1
    info = run_cli("info", str(run / "checkpoints/last.ckpt")).stdout
    assert "skipped steps: 1" in info and "rollbacks: 0" in info


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_spike_on_one_rank_rolls_every_rank_back_at_the_same_step_under_ddp_and_fsdp(
    digits_shards, tmp_path
):
    env = {PRELUDE_ENV: spike_prelude({7: 1e4}, rank=1)}  # rank 1's step 6 only

    def fit(name: str, *extra: str, strategy: str | None) -> list[dict]:
        record = tmp_path / f"{name}.jsonl"
        args = rollback_args(
            digits_shards, tmp_path / name, record, "--nonfinite.window", "3", *extra, steps=12, batches=8
        )
        proc = torchrun_fit(args, strategy=strategy, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        (line,) = rollback_lines(proc.stderr)  # printed once, by rank 0
        assert line.group(1, 4, 5) == ("6", "4", "4")
        steps = read_steps(record)
        for rank in (0, 1):  # both ranks went back to step 4 after step 7
            assert [r["step"] for r in steps if r["rank"] == rank] == [*range(1, 8), *range(5, 13)]
        return steps

    digest = tmp_path / "ddp.digest"
    weights = ["--trainer.callbacks+=resume_helpers.WeightsDigest", "--trainer.callbacks.path", str(digest)]
    ddp = fit("ddp", *weights, strategy="ddp")
    digests = [json.loads(Path(f"{digest}.{rank}").read_text()) for rank in (0, 1)]
    assert digests[0] == digests[1] and digests[0]["step"] == 12  # equal weights on both ranks
    # FSDP2: the sharded model and optimizer restored from the one checkpoint file: DDP's losses.
    fsdp = strategy_file(tmp_path, data_parallel_size=1, tensor_parallel_size=2)
    sharded = fit("fsdp", "--config", fsdp, strategy=None)
    for a, b in zip(sorted(ddp, key=lambda r: r["rank"]), sorted(sharded, key=lambda r: r["rank"])):
        assert a["step"] == b["step"] and a["keys"] == b["keys"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-5), (a["rank"], a["step"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_ema_teacher_preset_returns_to_every_state_of_the_checkpoint(digits_shards, tmp_path):
    """I-JEPA: after the rollback, the weights (the teacher's too), the optimizer, the schedule and the
    RNG equal the step-4 checkpoint's."""
    run, report = tmp_path / "run", tmp_path / "state.json"
    ijepa = ["--model.init_args.preset", "ijepa", "--model.init_args.decoder_dim", "64",
             "--model.init_args.decoder_depth", "2", "--model.init_args.decoder_heads", "4"]  # fmt: skip
    check = ["--trainer.callbacks+=resume_helpers.StateAtStep", "--trainer.callbacks.path", str(report),
             "--trainer.callbacks.checkpoint", str(run / "checkpoints/step0000004.ckpt"),
             "--trainer.callbacks.step", "4"]  # fmt: skip
    args = rollback_args(
        digits_shards, run, tmp_path / "steps.jsonl", *ijepa, *check, "--nonfinite.window", "3", steps=7
    )
    proc = run_cli(*args, cwd=ROOT, env=ENV, prelude=spike_prelude({7: 1e4}))
    (line,) = rollback_lines(proc.stderr)
    assert line.group(1, 4) == ("6", "4")
    assert json.loads(report.read_text()) == {
        "weights": True, "teacher": True, "optimizer": True, "schedules": True, "rng": True
    }  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_safe_steps_after_a_rollback_run_in_32_bit_at_the_scaled_learning_rate(digits_shards, tmp_path):
    calls, applied = tmp_path / "calls.jsonl", tmp_path / "lr.jsonl"
    args = rollback_args(
        digits_shards, tmp_path / "run", tmp_path / "steps.jsonl", "--trainer.precision", "bf16-mixed",
        "--nonfinite.window", "3", "--nonfinite.safe_steps", "2", "--nonfinite.safe_fp32", "true",
        "--nonfinite.lr_scale", "0.1", "--trainer.callbacks+=resume_helpers.AppliedLr",
        "--trainer.callbacks.path", str(applied), steps=8,
    )  # fmt: skip
    proc = run_cli(*args, cwd=ROOT, env=ENV, prelude=spike_prelude({7: 1e4}, record=str(calls)))
    assert len(rollback_lines(proc.stderr)) == 1  # step 6 -> checkpoint at step 4
    autocast = [r["autocast"] for r in read_steps(calls)]
    assert autocast == [True] * 7 + [False, False] + [True] * 2  # calls 8 and 9: steps 4 and 5 again
    lrs = [(r["step"], r["lr"]) for r in read_steps(applied)]
    before, after = dict(lrs[:7]), lrs[7:]
    assert [step for step, _ in after] == [4, 5, 6, 7]  # step 6 before: the spike's, its update dropped
    assert [lr for _, lr in after[:3]] == pytest.approx([0.1 * before[4], 0.1 * before[5], before[6]])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_normal_quickstart_fit_never_rolls_back(digits_shards, tmp_path):
    """The quickstart's MPP recipe at half its batch (32: a noisier loss than the recipe's own, so a
    harder case for the detector) with its schedule, the rollback policy and its defaults, for 100
    steps: the median window fills at step 50, and no step is a spike."""
    run = tmp_path / "run"
    proc = run_cli(
        "fit", "--config", str(ROOT / "recipes/quickstart/mpp.yaml"), *small_fewshot_monitor(digits_shards),
        "--data.init_args.train_urls", str(digits_shards / "train-{000000..000004}.tar"),
        "--data.init_args.val_urls", str(digits_shards / "val-{000000..000003}.tar"),
        "--data.init_args.batch_size", "32", "--trainer.max_steps", "100", "--trainer.limit_val_batches", "0",
        "--trainer.enable_progress_bar", "false", "--model.init_args.picture_every_n_steps", "0",
        "--trainer.default_root_dir", str(run),
        "--nonfinite.policy", "rollback", cwd=ROOT, env=ENV,
    )  # fmt: skip
    assert "rollback:" not in proc.stderr and "skip:" not in proc.stderr
    state = guard_state(run / "checkpoints/last.ckpt")
    assert state["rollbacks"] == [] and state["skipped"] == 0
    assert len(state["detector"]["losses"]) == 50  # the window was full: steps 51-100 were judged


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--trainer.enable_checkpointing", "false"], "checkpointing is off"),
        (["--nonfinite.safe_steps", "3"], "safe_steps 3 changes nothing"),
        (
            [
                "--trainer.precision",
                "bf16-true",
                "--nonfinite.safe_steps",
                "2",
                "--nonfinite.safe_fp32",
                "true",
            ],
            "keeps the weights themselves in 16 bits",
        ),
        (["--nonfinite.spike_factor", "0.5"], "spike_factor must be above 1"),
    ],
)
def test_rollback_options_that_cannot_work_are_one_line_and_nothing_is_written(
    digits_shards, tmp_path, extra, words
):
    proc = fast_fit(digits_shards, tmp_path, "--nonfinite.policy", "rollback", *extra)
    error_line(proc, words)
    assert not (tmp_path / "run").exists()
