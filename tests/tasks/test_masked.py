"""MaskedPatchPretraining: every corruption x target, the presets, what the encoder sees."""

import itertools

import pytest
import torch

from ssl_vit.models.vit import ViTConfig
from ssl_vit.tasks import MaskedPatchPretraining
from ssl_vit.tasks.masked import PRESETS

BACKBONE = ViTConfig("S/8", 32, width=64, depth=2, heads=2)
SMALL = {"cell_size": 16, "decoder_dim": 64, "decoder_depth": 2, "decoder_heads": 4}
# What the presets take from a 12-block backbone, at this one's size.
TINY = {"data2vec2": {"teacher_top_k": 2, "views": 2}}


def task(**kwargs):
    torch.manual_seed(0)
    return MaskedPatchPretraining(BACKBONE, **{**SMALL, **kwargs})


@pytest.mark.parametrize(
    "corruption, target",
    list(
        itertools.product(
            ["bert", "drop", "mask_token"], ["color3bit", "color3bit_4x4", "pixels", "norm_pixels"]
        )
    ),
)
def test_every_corruption_and_target_trains_a_step(corruption, target, digits_batch):
    model = task(corruption=corruption, target=target, mask_ratio=0.5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = model.backbone.patch_embed.proj.weight.detach().clone()
    out = model.forward_loss(digits_batch["image"][:4])
    assert out.idx.shape == (4, 8)  # half of the 16 patches carry the loss
    if target.startswith("color"):
        assert out.target.dtype == torch.long and 0 <= out.accuracy <= 1
        assert out.pred.shape[-1] == 512
    else:
        assert out.pred.shape == out.target.shape == (4, 8, 8 * 8 * 3)
    optimizer.zero_grad()
    out.loss.backward()
    optimizer.step()
    assert torch.isfinite(out.loss)
    assert not torch.equal(before, model.backbone.patch_embed.proj.weight)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_each_preset_overfits_one_batch(preset, digits_batch):
    model = task(preset=preset, **TINY.get(preset, {}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    images, losses = digits_batch["image"][:8], []
    for _ in range(50):
        out = model.forward_loss(images, torch.Generator().manual_seed(0))  # one fixed batch, one fixed mask
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        losses.append(out.loss.item())
    assert losses[-1] < losses[0] / 2, f"{preset}: {losses[0]:.3f} -> {losses[-1]:.3f}"


def _tokens_through_blocks(model, images):
    seen = []
    model.backbone.blocks[0].register_forward_hook(lambda m, inputs, output: seen.append(inputs[0].shape[1]))
    model(images)
    return seen[0]


@pytest.mark.parametrize("ratio", [0.75, 0.6, 0.3])
def test_drop_runs_only_the_kept_tokens_and_bert_runs_all(ratio, digits_batch):
    images = digits_batch["image"][:2]
    drop = task(corruption="drop", target="pixels", mask_ratio=ratio)
    assert _tokens_through_blocks(drop, images) == 1 + round((1 - ratio) * 16)
    assert drop.tokens_per_image == 1 + round((1 - ratio) * 16)
    bert = task(corruption="bert", target="color3bit", mask_ratio=ratio)
    assert _tokens_through_blocks(bert, images) == 1 + 16


def test_presets_fill_choices_and_arguments_override_them():
    mae = task(preset="mae")
    assert (mae.corruption, mae.target_kind, mae.mask_ratio, mae.pixel_loss) == (
        "drop",
        "norm_pixels",
        0.75,
        "mse",
    )
    simmim = task(preset="simmim", mask_ratio=0.5)
    assert (simmim.corruption, simmim.mask_shape, simmim.mask_ratio, simmim.pixel_loss) == (
        "mask_token",
        "cells",
        0.5,
        "l1",
    )
    assert task(preset="vit_mpp").hparams["target"] == "color3bit"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "corruption must be one of"),
        ({"preset": "beit"}, "valid: vit_mpp, mae, simmim"),
        ({"preset": "mae", "mask_ratio": 1.0}, "mask_ratio"),
        ({"preset": "vit_mpp", "mask_shape": "block"}, "bert"),
        ({"preset": "simmim", "cell_size": 12}, "cell_size"),
    ],
)
def test_bad_choices_name_the_valid_ones(kwargs, message):
    with pytest.raises(ValueError, match=message):
        task(**kwargs)


@pytest.mark.parametrize("shape", ["random", "block", "cells"])
def test_mask_shapes_mask_the_ratio(shape, digits_batch):
    model = task(corruption="mask_token", target="pixels", mask_ratio=0.5, mask_shape=shape)
    out = model.forward_loss(digits_batch["image"][:3])
    assert out.idx.shape == (3, 8)


def test_mask_embedding_and_decoder_token_get_no_weight_decay():
    from ssl_vit.tasks.optim import weight_decay_groups

    for model in (task(preset="vit_mpp"), task(preset="mae")):
        groups = weight_decay_groups(model, model.no_weight_decay())
        no_decay = {id(p) for g in groups if g.get("weight_decay") == 0.0 for p in g["params"]}
        names = {n for n, p in model.named_parameters() if id(p) in no_decay}
        assert {"backbone.pos_embed", "backbone.cls_token", "backbone.norm.weight"} <= names
        assert ("mask_embedding" in names) or ("decoder.mask_token" in names)
        assert "backbone.blocks.0.attn.qkv.weight" not in names


def test_pretraining_can_start_from_any_checkpoint(supervised_ckpt):
    """`init_from` is the base task's: masked pretraining continues from a supervised checkpoint."""
    path, weights = supervised_ckpt
    model = task(preset="mae", init_from=str(path))
    assert all(torch.equal(model.backbone.state_dict()[k], v) for k, v in weights.items())
    assert model.hparams["init_from"] == str(path) and model.hparams["backbone"]["width"] == 64
