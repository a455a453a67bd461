"""The EMA teacher of `target: teacher` (I-JEPA, data2vec 2.0): its update, what trains it (nothing),
what it sees, what it gives, what it costs."""

import math

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from task_helpers import DigitBatches, trainer
from torch.utils.flop_counter import FlopCounterMode

from ssl_vit.models.vit import ViTConfig
from ssl_vit.tasks import MaskedPatchPretraining
from ssl_vit.tasks.teacher import momentum_at

BACKBONE = ViTConfig("S/8", 32, width=64, depth=2, heads=2)
SMALL = {"decoder_dim": 64, "decoder_depth": 2, "decoder_heads": 4}


def task(**kwargs):
    torch.manual_seed(0)
    return MaskedPatchPretraining(BACKBONE, **{**SMALL, **kwargs})


def teacher_params(model):
    return [p.detach().clone() for p in model.teacher.parameters()]


@pytest.mark.parametrize(
    "schedule, halfway", [("cosine", 0.998), ("linear", 0.998)]
)  # both pass through the middle value at the middle step
def test_momentum_goes_from_start_to_end_and_stays(schedule, halfway):
    assert momentum_at(0, 10, 0.996, 1.0, schedule) == 0.996
    assert momentum_at(5, 10, 0.996, 1.0, schedule) == pytest.approx(halfway)
    assert momentum_at(10, 10, 0.996, 1.0, schedule) == momentum_at(50, 10, 0.996, 1.0, schedule) == 1.0
    quarter = momentum_at(2.5, 10, 0.996, 1.0, schedule)
    expected = 0.996 + 0.004 * (0.25 if schedule == "linear" else (1 - math.cos(math.pi / 4)) / 2)
    assert quarter == pytest.approx(expected)


class CheckEMA(pl.Callback):
    """Around every batch: unchanged while gradients accumulate; after an optimizer step,
    teacher == m * teacher_before + (1 - m) * student_after with the scheduled m of that step."""

    def __init__(self):
        self.updates, self.unchanged = 0, 0

    def on_train_batch_start(self, trainer, task, batch, batch_idx):
        self.before, self.step = teacher_params(task), trainer.global_step

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx):
        now = teacher_params(task)
        if trainer.global_step == self.step:
            assert all(torch.equal(a, b) for a, b in zip(self.before, now))
            self.unchanged += 1
            return
        m = momentum_at(self.step, 3, 0.9, 0.99, "cosine")
        assert task.ema_momentum(self.step) == m
        for before, after, student in zip(self.before, now, task.backbone.parameters()):
            torch.testing.assert_close(after, m * before + (1 - m) * student.detach())
        self.updates += 1


def test_ema_update_follows_the_formula_once_per_optimizer_step_and_no_optimizer_holds_the_teacher(
    digits_batch, tmp_path
):
    model = task(preset="ijepa", ema_momentum=0.9, ema_momentum_end=0.99, ema_schedule="cosine")
    student_start = [p.detach().clone() for p in model.backbone.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(teacher_params(model), student_start))  # starts as a copy
    check = CheckEMA()
    run = trainer(tmp_path, max_steps=3, accumulate_grad_batches=2, limit_val_batches=0, callbacks=[check])
    run.fit(model, datamodule=DigitBatches(digits_batch, steps=6))
    assert (check.updates, check.unchanged) == (3, 3)
    teacher = {id(p) for p in model.teacher.parameters()}
    grouped = {id(p) for group in run.optimizers[0].param_groups for p in group["params"]}
    assert grouped and not teacher & grouped
    assert not any(p.requires_grad for p in model.teacher.parameters())
    assert not any(p.grad is not None for p in model.teacher.parameters())
    # The teacher moved, and lags the student.
    teacher_now, student_now = teacher_params(model), list(model.backbone.parameters())
    assert not torch.equal(teacher_now[2], student_start[2])
    assert not torch.equal(teacher_now[2], student_now[2].detach())


@pytest.mark.parametrize("preset", ["ijepa", "data2vec2"])
def test_teacher_sees_the_whole_uncorrupted_image_without_gradients(preset, digits_batch):
    model = task(preset=preset, teacher_top_k=2, views=2)
    images = digits_batch["image"][:4]
    seen = {}
    model.teacher.patch_embed.register_forward_hook(lambda m, inputs, out: seen.update(image=inputs[0]))
    model.teacher.blocks[0].register_forward_hook(lambda m, inputs, out: seen.update(tokens=inputs[0]))
    model.backbone.blocks[0].register_forward_hook(lambda m, inputs, out: seen.update(student=inputs[0]))
    out = model.forward_loss(images, torch.Generator().manual_seed(0))
    assert torch.equal(seen["image"], images)  # the images themselves, once, not their masked views
    assert seen["tokens"].shape[1] == 1 + 16 > seen["student"].shape[1]  # every patch; the student fewer
    assert not out.target.requires_grad and not seen["tokens"].requires_grad
    assert out.pred.requires_grad
    out.loss.backward()
    assert all(p.grad is None for p in model.teacher.parameters())
    assert out.teacher.shape == (4, 64)
    if preset == "data2vec2":  # two views per image, the same targets for both
        assert out.pred.shape[0] == out.target.shape[0] == 8


def test_targets_are_the_papers_features(digits_batch):
    images = digits_batch["image"][:4]
    ijepa = task(preset="ijepa")
    with torch.no_grad():
        last = ijepa.teacher.forward_tokens(images).patches
    out = ijepa.forward_loss(images, torch.Generator().manual_seed(0))
    every = F.layer_norm(last, (64,))
    torch.testing.assert_close(out.target, torch.gather(every, 1, out.idx[..., None].expand(-1, -1, 64)))

    d2v = task(preset="data2vec2", teacher_top_k=2, views=1)
    outputs = []
    for block in d2v.teacher.blocks:
        block.register_forward_hook(lambda m, inputs, output: outputs.append(output[:, 1:]))
    out = d2v.forward_loss(images, torch.Generator().manual_seed(0))
    normed = [
        (x - x.mean(1, keepdim=True)) / (x.var(1, unbiased=False, keepdim=True) + 1e-5).sqrt()
        for x in outputs
    ]
    expected = F.layer_norm(sum(normed) / 2, (64,))
    torch.testing.assert_close(out.target, torch.gather(expected, 1, out.idx[..., None].expand(-1, -1, 64)))


def test_the_flop_count_adds_the_teachers_forward_once(digits_batch):
    image = digits_batch["image"][:1]
    latents = task(preset="data2vec2", teacher_top_k=2, views=2)
    pixels = task(preset="data2vec2", target="pixels", views=2)  # the same student, no teacher
    latents.measure_flops(image)
    pixels.measure_flops(image)
    with FlopCounterMode(display=False) as counter:
        latents.teacher.forward_tokens(image)
    # The decoders' last linear maps all 16 patches of both views to D = 64 values, not p*p*3 = 192.
    head = 3 * 2 * 16 * 2 * 64 * (192 - 64)  # (fwd + bwd) x views x patches x 2 x D x the difference
    assert latents.flops_per_image == pixels.flops_per_image - head + counter.get_total_flops()


def test_teacher_choices_are_checked():
    with pytest.raises(ValueError, match="teacher_top_k 3 is more blocks than the backbone's 2"):
        task(preset="data2vec2", teacher_top_k=3)
    with pytest.raises(ValueError, match="mask_shape 'jepa' .* corruption 'drop'"):
        task(preset="ijepa", corruption="mask_token")
    with pytest.raises(ValueError, match="ema_momentum must be in"):
        task(preset="ijepa", ema_momentum=1.5)
    with pytest.raises(ValueError, match="teacher_features must be one of final_norm, top_k_mean"):
        task(preset="ijepa", teacher_features="cls")
