"""MaskedPatchPretraining: every corruption x target, the presets, what the encoder sees."""

import itertools

import pytest
import torch

from ssl_vit.models.vit import ViTConfig
from ssl_vit.tasks import MaskedPatchPretraining
from ssl_vit.tasks.base import Training
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
            ["bert", "drop", "mask_token"],
            ["color3bit", "color3bit_4x4", "pixels", "norm_pixels", "seen_pixels"],
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
    chosen = (simmim.corruption, simmim.target_kind, simmim.mask_shape, simmim.mask_ratio, simmim.pixel_loss)
    assert chosen == ("mask_token", "seen_pixels", "cells", 0.5, "l1")
    assert task(preset="simmim", target="pixels").target_kind == "pixels"
    assert task(preset="vit_mpp").hparams["target"] == "color3bit"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "corruption must be one of"),
        ({"preset": "beit"}, "unknown preset 'beit': use one of vit_mpp, mae, simmim"),
        ({"preset": "mae", "mask_ratio": 1.0}, "mask_ratio"),
        ({"preset": "vit_mpp", "mask_shape": "block"}, "bert"),
        ({"preset": "simmim", "cell_size": 12}, "cell_size"),
        ({"preset": "mae", "encoder_init": "jax"}, "encoder_init must be one of timm, mae"),
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

    for model in (task(preset="vit_mpp"), task(preset="mae", encoder_init="timm"), task(preset="mae")):
        groups = weight_decay_groups(model, model.no_weight_decay())
        no_decay = {id(p) for g in groups if g.get("weight_decay") == 0.0 for p in g["params"]}
        names = {n for n, p in model.named_parameters() if id(p) in no_decay}
        trained = {id(p) for g in groups for p in g["params"]}
        # MAE's position embeddings are fixed: in no group at all
        fixed = model.hparams["encoder_init"] == "mae"
        assert ("backbone.pos_embed" in names) != fixed
        assert (id(model.backbone.pos_embed) in trained) != fixed
        assert {"backbone.cls_token", "backbone.norm.weight"} <= names
        assert ("mask_embedding" in names) or ("decoder.mask_token" in names)
        assert "backbone.blocks.0.attn.qkv.weight" not in names


def test_pretraining_can_start_from_any_checkpoint(supervised_ckpt):
    """`init_from` is the base task's: masked pretraining continues from a supervised checkpoint."""
    path, weights = supervised_ckpt
    model = task(preset="mae", training=Training(init_from=str(path)))
    assert all(torch.equal(model.backbone.state_dict()[k], v) for k, v in weights.items())
    assert model.hparams["training"]["init_from"] == str(path) and model.hparams["backbone"]["width"] == 64


def test_mae_starts_its_encoder_as_maes_code_does_and_never_trains_its_position_embeddings(digits_batch):
    from timm.layers import build_sincos2d_pos_embed

    model = task(preset="mae")
    vit = model.backbone
    assert model.hparams["encoder_init"] == "mae" and not vit.pos_embed.requires_grad
    sincos = build_sincos2d_pos_embed([4, 4], 64)
    assert torch.equal(vit.pos_embed[0, 1:], sincos) and not vit.pos_embed[0, 0].any()
    # xavier-uniform linears: bound sqrt(6 / (fan_in + fan_out)), zero biases; timm's std is 0.02
    qkv = vit.blocks[0].attn.qkv
    bound = (6 / (64 + 192)) ** 0.5
    assert qkv.weight.abs().max() <= bound and qkv.weight.abs().max() > 0.9 * bound
    assert not qkv.bias.any() and vit.cls_token.std() > 0.01  # timm's [class] starts at 1e-6
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    before = vit.pos_embed.detach().clone()
    model.forward_loss(digits_batch["image"][:4]).loss.backward()
    optimizer.step()
    assert torch.equal(before, vit.pos_embed) and vit.pos_embed.grad is None
    # the other presets, and MAE told otherwise, keep timm's start: learned position embeddings
    for other in (task(preset="simmim"), task(preset="mae", encoder_init="timm")):
        assert other.backbone.pos_embed.requires_grad and other.hparams["encoder_init"] == "timm"
        assert other.backbone.blocks[0].attn.qkv.weight.std() < 0.025


def test_mae_from_a_checkpoint_keeps_its_weights_and_fixes_its_position_embeddings(supervised_ckpt):
    path, weights = supervised_ckpt
    model = task(preset="mae", training=Training(init_from=str(path)))
    assert (
        torch.equal(model.backbone.pos_embed, weights["pos_embed"])
        and not model.backbone.pos_embed.requires_grad
    )


def test_mae_init_needs_a_width_for_sin_cos():
    with pytest.raises(
        ValueError, match="width divisible by 4.*got 6: pick another width or encoder_init: timm"
    ):
        MaskedPatchPretraining(ViTConfig("S/8", 32, width=6, depth=1, heads=2), preset="mae", **SMALL)
    assert MaskedPatchPretraining(
        ViTConfig("S/8", 32, width=6, depth=1, heads=2), preset="mae", encoder_init="timm", **SMALL
    ).backbone.pos_embed.requires_grad


def test_an_mae_run_begun_with_learned_position_embeddings_resumes_as_it_began(digits_batch, tmp_path):
    """A checkpoint from before `encoder_init` was a choice (no such hyperparameter) trained its position
    embeddings: resumed under today's MAE preset, they stay trained, and its optimizer state loads."""
    from task_helpers import DigitBatches, trainer

    def optimizer(params):
        return torch.optim.AdamW(params, lr=1e-2)

    def constant(optimizer, total_steps):  # the lr of the resumed steps is not 0 (a cosine to 2 steps)
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)

    optimizer = dict(training=Training(optimizer=optimizer, lr_scheduler=constant))
    old = task(preset="mae", encoder_init="timm", **optimizer)
    run = trainer(tmp_path, max_steps=2)
    run.fit(old, datamodule=DigitBatches(digits_batch))
    saved = tmp_path / "old.ckpt"
    run.save_checkpoint(saved)
    checkpoint = torch.load(saved, weights_only=True)
    del checkpoint["hyper_parameters"]["encoder_init"]
    torch.save(checkpoint, saved)

    resumed = task(preset="mae", **optimizer)
    assert not resumed.backbone.pos_embed.requires_grad
    again = trainer(tmp_path, max_steps=4)
    again.fit(resumed, datamodule=DigitBatches(digits_batch, steps=2), ckpt_path=saved)
    assert again.global_step == 4 and resumed.backbone.pos_embed.requires_grad
    assert not torch.equal(resumed.backbone.pos_embed, checkpoint["state_dict"]["backbone.pos_embed"])


def test_simmims_head_starts_as_simmims_code_leaves_it_and_the_others_xavier():
    """`head_init`: the `simmim` preset's `torch` (PyTorch's start of a linear layer, as SimMIM's 1x1
    convolution: weights within 1/sqrt(D), a nonzero bias), `xavier` elsewhere (a zero bias, weights
    up to sqrt(6 / (D + out))); an explicit choice overrides the preset's."""
    torch.manual_seed(0)
    simmim, mpp = task(preset="simmim"), task(preset="vit_mpp")
    width = simmim.backbone.embed_dim
    assert simmim.hparams["head_init"] == "torch" and mpp.hparams["head_init"] == "xavier"
    assert simmim.head.proj.weight.abs().max() <= width**-0.5 and simmim.head.proj.bias.abs().max() > 0
    assert not mpp.head.proj.bias.any()
    override = task(preset="simmim", head_init="xavier")
    assert override.hparams["head_init"] == "xavier" and not override.head.proj.bias.any()
