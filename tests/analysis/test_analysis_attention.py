"""Attention probabilities, mean attention distance and rollout against values computed independently."""

import itertools
import math

import pytest
import torch

from ssl_vit.analysis.attention import (
    AttentionRecorder,
    attention_distance,
    attention_rollout,
    mean_attention_distance,
    patch_distances,
    rollout_maps,
)
from ssl_vit.models.vit import ViTConfig


def brute_force_uniform_distance(grid: int, patch: int) -> float:
    """Mean over query patches of the mean pixel distance to every patch (itself included)."""
    cells = list(itertools.product(range(grid), repeat=2))
    total = sum(math.hypot(patch * (a[0] - b[0]), patch * (a[1] - b[1])) for a in cells for b in cells)
    return total / len(cells) ** 2


@pytest.mark.parametrize("grid, patch", [(2, 16), (3, 4)])
def test_attention_distance_of_hand_set_attention(grid, patch):
    tokens, heads = 1 + grid * grid, 3
    distances = patch_distances((grid, grid), patch)
    only_self = torch.eye(tokens).expand(2, heads, -1, -1)
    assert torch.equal(mean_attention_distance(only_self, distances, 1), torch.zeros(2, heads))

    uniform = torch.full((2, heads, tokens, tokens), 1 / tokens)
    expected = brute_force_uniform_distance(grid, patch)
    assert torch.allclose(mean_attention_distance(uniform, distances, 1), torch.full((2, heads), expected))
    # Attention paid to [class] is dropped and the rest renormalised: the same distance however much.
    to_class = uniform.clone()
    to_class[..., 0] = 50.0
    to_class = to_class / to_class.sum(-1, keepdim=True)
    assert torch.allclose(mean_attention_distance(to_class, distances, 1), torch.full((2, heads), expected))
    # Without a [class] token (global average pooling) every token is a patch.
    patches_only = torch.full((1, heads, tokens - 1, tokens - 1), 1 / (tokens - 1))
    assert torch.allclose(
        mean_attention_distance(patches_only, distances, 0), torch.full((1, heads), expected)
    )


@pytest.fixture(scope="module")
def vit():
    torch.manual_seed(0)
    return ViTConfig("S/8", 32, width=32, depth=2, heads=2).build().eval()


def test_recorded_probabilities_are_timms_own_and_leave_the_outputs_unchanged(vit):
    images = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        before = vit.forward_tokens(images)
        with AttentionRecorder(vit) as recorder:
            during = vit.forward_tokens(images)
        after = vit.forward_tokens(images)
    for name in ("cls", "patches", "pooled"):
        assert torch.equal(getattr(before, name), getattr(during, name))
        assert torch.equal(getattr(before, name), getattr(after, name))  # the hooks are gone
    assert len(recorder.probs) == 2 and recorder.probs[0].shape == (3, 2, 17, 17)
    for probs in recorder.probs:
        assert torch.allclose(probs.sum(-1), torch.ones(3, 2, 17))

    # Reference: timm's explicit (non-fused) attention, whose attn_drop receives softmax(q k^T scale).
    reference = []
    hooks = [block.attn.attn_drop.register_forward_hook(lambda m, a, out: reference.append(out))
             for block in vit.blocks]  # fmt: skip
    for block in vit.blocks:
        block.attn.fused_attn = False
    try:
        with torch.no_grad():
            vit.forward_tokens(images)
    finally:
        for block, hook in zip(vit.blocks, hooks):
            block.attn.fused_attn = True
            hook.remove()
    assert len(reference) == 2
    for ours, timms in zip(recorder.probs, reference):
        assert torch.allclose(ours, timms, atol=1e-6)


def test_attention_distance_of_a_model_averages_images_whatever_the_batches(vit):
    images = torch.randn(5, 3, 32, 32)
    whole = attention_distance(vit, images, batch_size=5)
    assert whole.shape == (2, 2)
    assert torch.allclose(whole, attention_distance(vit, images, batch_size=2), atol=1e-5)
    one_by_one = torch.stack([attention_distance(vit, image[None], batch_size=1) for image in images])
    assert torch.allclose(whole, one_by_one.mean(0), atol=1e-5)
    assert (whole > 0).all() and (whole <= patch_distances((4, 4), 8).max()).all()


def test_rollout_of_identity_attention_is_the_identity_and_otherwise_the_product():
    eye = torch.eye(5).expand(2, 3, 5, 5)
    assert torch.allclose(attention_rollout([eye, eye, eye]), torch.eye(5).expand(2, 5, 5))

    torch.manual_seed(0)
    layers = [torch.rand(1, 3, 5, 5).softmax(-1) for _ in range(2)]
    expected = torch.eye(5, dtype=torch.float64)
    for layer in layers:  # Abnar & Zuidema: 0.5 * mean-head attention + 0.5 * identity, then compose
        expected = (0.5 * layer[0].double().mean(0) + 0.5 * torch.eye(5, dtype=torch.float64)) @ expected
    assert torch.allclose(attention_rollout(layers)[0].double(), expected, atol=1e-6)
    assert torch.allclose(attention_rollout(layers).sum(-1), torch.ones(1, 5))


def test_rollout_maps_of_class_token_and_gap_backbones(vit):
    images = torch.randn(2, 3, 32, 32)
    maps = rollout_maps(vit, images)
    assert maps.shape == (2, 4, 4) and (maps > 0).all() and (maps.sum((1, 2)) < 1).all()
    torch.manual_seed(0)
    gap = ViTConfig("S/8", 32, width=32, depth=2, heads=2, pooling="gap").build().eval()
    maps = rollout_maps(gap, images)
    assert maps.shape == (2, 4, 4) and torch.allclose(maps.sum((1, 2)), torch.ones(2))
