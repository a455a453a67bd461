"""LinearProbe: frozen backbone (bit-identical after training), one forward for many learning rates,
the best head reported with its lr, MAE's BatchNorm, loading real checkpoints."""

import pytest
import torch
import torch.nn.functional as F
from task_helpers import DigitBatches, trainer

from ssl_vit.errors import UserError
from ssl_vit.models.vit import ViTConfig
from ssl_vit.tasks import LinearProbe, WarmupDecay
from ssl_vit.tasks.base import Training

BACKBONE = ViTConfig("S/8", 32, width=64, depth=2, heads=2)
LRS = (0.01, 0.1, 1.0)


def probe(**kwargs) -> LinearProbe:
    return LinearProbe(BACKBONE, num_classes=10, lrs=LRS, **kwargs)


def test_every_lr_trains_from_one_backbone_forward(digits_batch):
    model = LinearProbe(ViTConfig("S/8", 32, width=64, depth=2, heads=2, drop_path_rate=0.5), 10, lrs=LRS)
    calls = []
    model.backbone.patch_embed.register_forward_hook(lambda *_: calls.append(1))
    model.train()
    assert not model.backbone.training and model.norm.training  # the backbone stays in eval mode
    images = digits_batch["image"][:4]
    assert torch.equal(model.features(images), model.features(images))  # so drop path does not act
    calls.clear()
    loss = model.training_step({k: v[:8] for k, v in digits_batch.items()}, 0)
    assert len(calls) == 1
    assert model(digits_batch["image"][:4]).shape == (len(LRS), 4, 10)
    loss.backward()
    assert all(head.weight.grad is not None and head.weight.grad.abs().sum() > 0 for head in model.heads)
    assert all(not p.requires_grad and p.grad is None for p in model.backbone.parameters())


def test_batch_norm_without_affine_only_when_asked():
    with_bn, without = probe(), probe(batch_norm=False)
    assert isinstance(with_bn.norm, torch.nn.BatchNorm1d) and not with_bn.norm.affine
    assert isinstance(without.norm, torch.nn.Identity)
    assert {n for n, p in with_bn.named_parameters() if p.requires_grad} == {
        f"heads.{i}.{w}" for i in range(len(LRS)) for w in ("weight", "bias")
    }


def test_training_leaves_the_backbone_bit_identical_and_each_head_gets_its_lr(
    supervised_ckpt, digits_batch, tmp_path
):
    path, _ = supervised_ckpt
    model = probe(
        training=Training(
            init_from=str(path), lr_reference_batch=16,
            optimizer=lambda p: torch.optim.SGD(p, lr=123.0, momentum=0.9),  # its lr is overridden per head
            lr_scheduler=lambda opt, steps: WarmupDecay(opt, steps, warmup_steps=0, decay="linear"),
        )
    )  # fmt: skip
    before = {k: v.clone() for k, v in model.backbone.state_dict().items()}
    heads_before = [head.weight.clone() for head in model.heads]
    run = trainer(tmp_path, max_steps=3, num_sanity_val_steps=0)
    run.fit(model, datamodule=DigitBatches(digits_batch))

    after = model.backbone.state_dict()
    assert before.keys() == after.keys()
    assert [k for k in before if not torch.equal(before[k], after[k])] == []
    assert all(not torch.equal(b, head.weight) for b, head in zip(heads_before, model.heads))

    groups = run.optimizers[0].param_groups
    assert [g["initial_lr"] for g in groups] == pytest.approx([lr * 8 / 16 for lr in LRS])  # batch 8, ref 16
    assert [set(map(id, g["params"])) for g in groups] == [set(map(id, h.parameters())) for h in model.heads]

    metrics = run.callback_metrics
    per_lr = {lr: float(metrics[f"val/accuracy_lr{lr:g}"]) for lr in LRS}
    assert float(metrics["val/accuracy"]) == max(per_lr.values())
    best = min(LRS, key=lambda lr: abs(lr - float(metrics["val/best_lr"])))  # logged as float32
    assert per_lr[best] == max(per_lr.values()) and float(metrics["val/best_lr"]) == pytest.approx(best)


def test_the_best_head_is_reported_with_its_lr(digits_batch):
    model = probe()
    labels = digits_batch["label"]
    right, wrong = F.one_hot(labels, 10).float(), F.one_hot((labels + 1) % 10, 10).float()
    half = torch.where(torch.arange(16)[:, None] < 8, right, wrong)
    for metric, logits in zip(model.val_accuracy, [wrong, right, half]):
        metric.update(logits, labels)
    logged = {}
    model.log = lambda name, value, **kwargs: logged.__setitem__(name, float(value))
    model.on_validation_epoch_end()
    assert logged == {"val/accuracy_lr0.01": 0.0, "val/accuracy_lr0.1": 1.0, "val/accuracy_lr1": 0.5,
                      "val/accuracy": 1.0, "val/best_lr": pytest.approx(0.1)}  # fmt: skip


def test_loads_a_supervised_checkpoint_and_rejects_another_architecture(supervised_ckpt):
    path, weights = supervised_ckpt
    model = probe(training=Training(init_from=str(path)))
    assert all(torch.equal(weights[k], v) for k, v in model.backbone.state_dict().items())
    assert model.hparams.training["init_from"] == str(path) and model.hparams.lrs == list(LRS)
    deeper = ViTConfig("S/8", 32, width=64, depth=3, heads=2)
    with pytest.raises(UserError, match="depth 2 \\(asked for 3\\)") as error:
        LinearProbe(deeper, num_classes=10, training=Training(init_from=str(path)))
    assert "\n" not in str(error.value)


def test_bad_arguments():
    with pytest.raises(ValueError, match="distinct positive"):
        LinearProbe(BACKBONE, num_classes=10, lrs=(0.1, 0.1))
    with pytest.raises(ValueError, match="use one of cls, mean$"):
        probe(feature="avg")
    with pytest.raises(ValueError, match="use 'mean'"):
        LinearProbe(ViTConfig("S/8", 32, pooling="gap", width=64, depth=2, heads=2), num_classes=10)
