"""SupervisedPretraining: zero-initialised head, softmax and sigmoid losses, mixup targets."""

import math

import pytest
import torch

from ssl_vit.models.vit import ViTConfig
from ssl_vit.tasks import SupervisedPretraining

BACKBONE = ViTConfig("S/8", 32, width=64, depth=2, heads=2)


def test_head_starts_at_zero_and_sigmoid_head_at_a_low_prior(digits_batch):
    images = digits_batch["image"][:4]
    softmax = SupervisedPretraining(BACKBONE, num_classes=10)
    assert torch.equal(softmax(images), torch.zeros(4, 10))
    sigmoid = SupervisedPretraining(BACKBONE, num_classes=10, loss="sigmoid")
    torch.testing.assert_close(sigmoid(images), torch.full((4, 10), -math.log(10)))
    assert "head.weight" in dict(softmax.named_parameters()) and softmax.backbone.num_classes == 0


@pytest.mark.parametrize("loss", ["softmax", "sigmoid"])
def test_overfits_one_batch(loss, digits_batch):
    torch.manual_seed(0)
    model = SupervisedPretraining(BACKBONE, num_classes=10, loss=loss)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = {k: v[:8] for k, v in digits_batch.items()}
    losses = []
    for _ in range(50):
        value = model.forward_loss(model(batch["image"]), batch)
        optimizer.zero_grad()
        value.backward()
        optimizer.step()
        losses.append(value.item())
    assert losses[-1] < 0.6 * losses[0], losses
    assert (model(batch["image"]).argmax(-1) == batch["label"]).float().mean() >= 0.5  # chance is 0.1


def test_soft_targets_and_unlabelled_samples(digits_batch):
    model = SupervisedPretraining(BACKBONE, num_classes=10)
    logits = torch.randn(4, 10)
    labels = torch.tensor([1, -1, 3, -1])
    hard = model.forward_loss(logits, {"label": labels})
    expected = torch.nn.functional.cross_entropy(logits[[0, 2]], labels[[0, 2]])
    torch.testing.assert_close(hard, expected)  # -1 (unlabelled) samples carry no loss
    sigmoid = SupervisedPretraining(BACKBONE, num_classes=10, loss="sigmoid")
    onehot = torch.nn.functional.one_hot(labels[[0, 2]], 10).float()
    bce = torch.nn.functional.binary_cross_entropy_with_logits(logits[[0, 2]], onehot, reduction="sum") / 2
    torch.testing.assert_close(sigmoid.forward_loss(logits, {"label": labels}), bce)
    soft = torch.softmax(torch.randn(4, 10), -1)
    torch.testing.assert_close(
        model.forward_loss(logits, {"label": labels, "target": soft}),
        -(soft * logits.log_softmax(-1)).sum(-1).mean(),
    )


def test_bad_arguments():
    with pytest.raises(ValueError, match="valid: 'softmax', 'sigmoid'"):
        SupervisedPretraining(BACKBONE, num_classes=3, loss="hinge")
    with pytest.raises(ValueError, match="num_classes"):
        SupervisedPretraining(BACKBONE, num_classes=0)
