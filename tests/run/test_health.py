"""The collapse watch: its statistics on known features, the stop after `patience` looks, and fits
whose features (the student's, or a teacher's targets) are constant stopped with one line and exit
status 2."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from cli_helpers import one_step_fit_args, run_cli, wandb_records

from ssl_vit.run.health import CollapseError, HealthMonitor, effective_rank, feature_std, target_variance


def test_feature_std_is_zero_when_collapsed_and_one_over_sqrt_width_when_spread():
    torch.manual_seed(0)
    assert feature_std(torch.ones(256, 64) * 3.0) == 0
    assert abs(feature_std(torch.randn(4096, 64)) - 64**-0.5) < 0.005
    assert abs(feature_std(100 * torch.randn(4096, 64)) - 64**-0.5) < 0.005  # scale-free


def test_effective_rank_counts_the_directions_used():
    torch.manual_seed(0)
    assert effective_rank(torch.eye(16)) == pytest.approx(16, rel=1e-4)
    line = torch.randn(64, 1) * torch.randn(1, 32)  # rank 1
    assert effective_rank(line) == pytest.approx(1, abs=1e-3)
    spread = torch.diag(torch.tensor([4.0, 2.0, 1.0, 1.0]))  # p = (1/2, 1/4, 1/8, 1/8): entropy 1.75 bits
    assert effective_rank(spread) == pytest.approx(2**1.75, rel=1e-4)


def test_target_variance_is_the_mean_variance_over_entries():
    target = torch.stack([torch.zeros(3, 2), torch.ones(3, 2) * 2])  # (B 2, M 3, T 2)
    assert target_variance(target) == pytest.approx(torch.tensor([0.0] * 3 + [2.0] * 3).var().item())


def fake_run(monitor: HealthMonitor, looks: list[torch.Tensor]) -> list[dict]:
    """Feeds `monitor` one step per feature matrix; returns what it logged at each step."""
    logged = []
    module = SimpleNamespace(log_dict=lambda metrics, **kwargs: logged.append(dict(metrics)))
    trainer = SimpleNamespace(
        global_step=0, log_every_n_steps=1, checkpoint_callback=None,
        strategy=SimpleNamespace(reduce=lambda value, reduce_op: value),
    )  # fmt: skip
    for step, features in enumerate(looks, start=1):
        trainer.global_step = step
        monitor.on_train_batch_end(trainer, module, {"monitor_features": {"student": features}}, None, 0)
    return logged


def test_stops_after_patience_consecutive_looks_below_min_std():
    torch.manual_seed(0)
    healthy, flat = torch.randn(32, 16), torch.ones(32, 16)
    logged = fake_run(HealthMonitor(min_std=1e-4, patience=3), [flat, flat, healthy, flat, flat])
    assert [set(m) for m in logged] == [{"health/feature_std", "health/effective_rank"}] * 5
    with pytest.raises(CollapseError, match="collapsed features at step 6: the student's feature std"):
        fake_run(HealthMonitor(min_std=1e-4, patience=3), [flat, flat, healthy, flat, flat, flat])
    fake_run(HealthMonitor(min_std=0, patience=1), [flat] * 3)  # min_std 0: logs, never stops


def assert_stopped_at_step_6_by(proc, side: str) -> None:
    """The fit ended with exit status 2 and one line: the `side`'s features collapsed at step 6."""
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ssl-vit: error:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(errors) == 1 and f"collapsed features at step 6: the {side}'s feature std" in errors[0]
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_a_fit_whose_features_collapse_is_stopped_with_one_line(digits_shards, tmp_path, cli):
    """Constant features from the first step (`ConstantFeatures`); looks every 2 steps, patience 3: the
    run stops at step 6 of 12, every rank at once, exit status 2."""
    run = tmp_path / "run"
    args = one_step_fit_args(
        digits_shards, run, "--model.init_args.preset", "maskfeat", "--data.init_args.train_batches", "12",
        "--trainer.callbacks+=health_helpers.ConstantFeatures", "--health.every_n_steps", "2",
        "--health.min_std", "1e-4", "--health.patience", "3", config="mae",
    )  # fmt: skip
    assert_stopped_at_step_6_by(cli(*args, cwd=Path(__file__).resolve().parents[2], check=False), "student")


@pytest.mark.slow
def test_a_teacher_preset_with_constant_targets_is_stopped_by_its_teacher_check(digits_shards, tmp_path, cli):
    """I-JEPA whose EMA teacher gives one target for every patch (`ConstantTargets`, momentum 1 so it
    stays so) and whose predictor is frozen: the student's features stay spread, so only the teacher's
    side can stop the run. Its std, effective rank and target variance are in W&B at every look (every 2
    steps, and the trainer logs as often); the teacher's std below min_std at 3 looks stops the run at
    step 6 of 12, exit status 2."""
    run = tmp_path / "run"
    args = one_step_fit_args(
        digits_shards, run, "--model.init_args.preset", "ijepa", "--data.init_args.train_batches", "12",
        "--model.init_args.ema_momentum", "1", "--model.init_args.ema_momentum_end", "1",
        "--trainer.callbacks+=health_helpers.ConstantTargets", "--trainer.log_every_n_steps", "2",
        "--health.every_n_steps", "2", "--health.min_std", "1e-4", "--health.patience", "3", config="mae",
    )  # fmt: skip
    assert_stopped_at_step_6_by(cli(*args, cwd=Path(__file__).resolve().parents[2], check=False), "teacher")
    [(_, records)] = wandb_records(run)
    looks = [r["history"]["item"] for r in records if r["type"] == "history"]
    looks = [h for h in looks if "health/teacher_std" in h]
    assert len(looks) == 2, looks  # steps 2 and 4: the look at step 6 stops the run before W&B has it
    for h in looks:
        assert h["health/feature_std"] > 5e-3 and h["health/effective_rank"] > 2, h  # the student: spread
        assert h["health/teacher_std"] == 0 and h["health/target_var"] == 0, h
        assert h["health/teacher_effective_rank"] == pytest.approx(1, abs=1e-3), h


def test_a_batch_of_one_image_is_looked_at_without_warnings_and_never_counts_as_collapsed(
    digits_shards, tmp_path
):
    """Issue 42: torch's two-line `std(): degrees of freedom is <= 0` warning at every look with batch 1."""
    assert feature_std(torch.randn(1, 8)).isnan()
    args = one_step_fit_args(
        digits_shards, tmp_path / "run", "--data.init_args.batch_size", "1", "--data.init_args.train_batches",
        "4", "--trainer.log_every_n_steps", "1", "--trainer.logger", "false",
    )  # fmt: skip
    proc = run_cli(*args, cwd=tmp_path)
    assert "degrees of freedom" not in proc.stderr and "UserWarning" not in proc.stderr, proc.stderr[-3000:]
