"""The spike test on its own: the running median over the last `window` normal steps, the ratio to it,
non-finite steps, the gradient scaler's run of skips; and the safe steps after a rollback (the learning
rate scaled for the optimizer's step only, options that change nothing refused)."""

import pytest
import torch

from ssl_vit.errors import BadValue
from ssl_vit.run.nonfinite import NonFiniteGuard
from ssl_vit.run.rollback import SafeSteps
from ssl_vit.run.spikes import NON_FINITE, SPIKE, SpikeDetector


def test_a_spike_is_measured_against_the_median_of_the_last_window_normal_steps():
    detector = SpikeDetector(window=4, spike_factor=3.0, patience=2)
    for loss in (10.0, 8.0, 100.0):  # the window is not full yet: no ratio test, every loss joins it
        assert detector.judge(loss, finite=True, scaler=False) is None
    assert detector.median is None
    assert detector.judge(6.0, finite=True, scaler=False) is None
    assert detector.median == 9.0  # (8 + 10) / 2 of 6, 8, 10, 100: one outlier moves it little
    assert detector.judge(27.5, finite=True, scaler=False) == SPIKE  # above 3 x 9
    assert list(detector.losses) == [10.0, 8.0, 100.0, 6.0]  # a spike does not join the window
    assert detector.judge(26.9, finite=True, scaler=False) is None
    assert list(detector.losses) == [8.0, 100.0, 6.0, 26.9]  # the oldest leaves it
    off = SpikeDetector(window=1, spike_factor=0, patience=1)
    assert off.judge(1.0, True, False) is None and off.judge(1e9, True, False) is None


def test_non_finite_steps_are_spikes_unless_the_gradient_scaler_skips_them_patience_in_a_row():
    detector = SpikeDetector(window=2, spike_factor=3.0, patience=3)
    assert detector.judge(0.0, finite=False, scaler=False) == NON_FINITE
    assert detector.judge(0.0, finite=False, scaler=True) is None
    assert detector.judge(0.0, finite=False, scaler=True) is None
    assert detector.judge(1.0, finite=True, scaler=True) is None  # a finite step ends the run
    for _ in range(2):
        assert detector.judge(0.0, finite=False, scaler=True) is None
    assert "3 steps in a row" in detector.judge(0.0, finite=False, scaler=True)
    assert detector.scaler_skips == 0  # counted afresh after the spike it made


def test_the_detector_state_survives_a_checkpoint():
    detector = SpikeDetector(window=3, spike_factor=2.0, patience=4)
    for loss in (1.0, 2.0, 3.0, 4.0):
        detector.judge(loss, True, False)
    detector.judge(0.0, False, True)
    again = SpikeDetector(window=3, spike_factor=2.0, patience=4)
    again.load_state_dict(detector.state_dict())
    assert list(again.losses) == [2.0, 3.0, 4.0] and again.scaler_skips == 1 and again.median == 3.0


def test_safe_steps_scale_the_learning_rate_of_the_optimizer_step_only():
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([parameter], lr=0.5)
    seen = []  # what the step applied: a hook that runs before SafeSteps' own puts the lr back
    optimizer.register_step_post_hook(lambda opt, args, kwargs: seen.append(opt.param_groups[0]["lr"]))
    safe = SafeSteps(steps=2, fp32=False, lr_scale=0.1)
    safe.attach(type("Trainer", (), {"optimizers": [optimizer]})())
    safe.start()
    for _ in range(3):
        parameter.grad = torch.ones(1)
        optimizer.step()
        assert optimizer.param_groups[0]["lr"] == 0.5  # the schedule's value again right after the step
        if safe.left:
            safe.left -= 1  # what after_step does at the end of a training step
    assert seen == [pytest.approx(0.05), pytest.approx(0.05), 0.5]
    assert parameter.item() == pytest.approx(-(0.05 + 0.05 + 0.5))


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"safe_steps": 3}, "safe_steps 3 changes nothing"),
        ({"safe_steps": 3, "lr_scale": 0.0}, "lr_scale must be > 0"),
        ({"spike_factor": 0.5}, "spike_factor must be above 1"),
        ({"window": 0}, "window must be at least 1"),
        ({"skip_batches": -1}, "skip_batches must be >= 0"),
        ({"max_rollbacks": -1}, "max_rollbacks must be >= 0"),
        ({"policy": "rewind"}, "'skip', 'stop' or 'rollback'"),
    ],
)
def test_options_that_cannot_work_are_refused(kwargs, words):
    with pytest.raises(BadValue, match=words):
        NonFiniteGuard(**kwargs)
