"""FineTune: higher resolution from interpolated position embeddings, zero-initialised head, layer-wise
lr decay in the optimizer, presets, a few real steps."""

import math
from pathlib import Path

import pytest
import torch
from task_helpers import DigitBatches, trainer
from timm.layers import resample_abs_pos_embed

from ssl_vit.models.vit import ViTConfig
from ssl_vit.tasks import FineTune, WarmupDecay
from ssl_vit.tasks.base import Training
from ssl_vit.tasks.finetune import mae_layer_decay

BACKBONE = ViTConfig("S/8", 32, width=64, depth=2, heads=2)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pretrained_ckpt(supervised_ckpt):
    return supervised_ckpt[0]


def test_higher_resolution_starts_from_interpolated_position_embeddings(pretrained_ckpt, digits_batch):
    saved = torch.load(pretrained_ckpt, weights_only=True)["state_dict"]
    at_48 = ViTConfig("S/8", 48, width=64, depth=2, heads=2)
    model = FineTune(at_48, num_classes=10, training=Training(init_from=str(pretrained_ckpt)))
    assert model.backbone.grid_size == (6, 6)
    expected = resample_abs_pos_embed(saved["backbone.pos_embed"], new_size=(6, 6), num_prefix_tokens=1)
    assert expected.shape == (1, 1 + 36, 64)
    torch.testing.assert_close(model.backbone.pos_embed.detach(), expected)
    for name, value in model.backbone.state_dict().items():  # every other weight is the checkpoint's
        if name != "pos_embed":
            assert torch.equal(value, saved[f"backbone.{name}"]), name
    assert model.hparams.backbone["img_size"] == 48
    images = torch.nn.functional.interpolate(digits_batch["image"][:2], size=48, mode="bilinear")
    assert model(images).shape == (2, 10)


def test_new_head_starts_at_zero(pretrained_ckpt, digits_batch):
    for preset in ("vit_paper", "mae"):
        model = FineTune(
            BACKBONE, num_classes=7, training=Training(init_from=str(pretrained_ckpt)), preset=preset
        )
        assert torch.equal(model(digits_batch["image"][:4]), torch.zeros(4, 7))
        assert torch.equal(model.head.weight, torch.zeros(7, 64))


def test_presets_set_feature_and_layer_decay_and_arguments_override_them():
    mae = FineTune(BACKBONE, num_classes=10, preset="mae")
    assert (mae.feature, mae.layer_decay) == ("mean", 0.65)
    assert isinstance(mae.fc_norm, torch.nn.LayerNorm)  # MAE's global pool + fc_norm
    assert mae.hparams.feature == "mean" and mae.hparams.layer_decay == 0.65 and mae.hparams.preset == "mae"
    assert (mae_layer_decay("B/16"), mae_layer_decay("L/16"), mae_layer_decay("H/14")) == (0.65, 0.75, 0.75)
    vit = FineTune(BACKBONE, num_classes=10, preset="vit_paper")
    assert (vit.feature, vit.layer_decay, vit.loss_kind) == ("cls", None, "softmax")
    assert isinstance(vit.fc_norm, torch.nn.Identity)
    mine = FineTune(BACKBONE, num_classes=10, preset="mae", layer_decay=0.9, feature="cls", loss="sigmoid")
    assert (mine.feature, mine.layer_decay, mine.loss_kind) == ("cls", 0.9, "sigmoid")
    with pytest.raises(ValueError, match="valid: vit_paper, mae"):
        FineTune(BACKBONE, num_classes=10, preset="beit")
    with pytest.raises(ValueError, match="layer_decay"):
        FineTune(BACKBONE, num_classes=10, layer_decay=1.5)


def test_layer_decay_scales_lrs_from_the_head_down_and_fine_tunes(pretrained_ckpt, digits_batch, tmp_path):
    model = FineTune(
        BACKBONE, num_classes=10, preset="mae", layer_decay=0.5,
        training=Training(
            init_from=str(pretrained_ckpt), lr_reference_batch=16,
            optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.05),
            lr_scheduler=lambda optimizer, steps: WarmupDecay(optimizer, steps, warmup_steps=1),
        ),
    )  # fmt: skip
    before = {k: v.clone() for k, v in model.backbone.state_dict().items()}
    run = trainer(tmp_path, max_steps=3, num_sanity_val_steps=0)
    run.fit(model, datamodule=DigitBatches(digits_batch))
    assert math.isfinite(float(run.callback_metrics["train/loss"]))
    assert 0 <= float(run.callback_metrics["val/accuracy"]) <= 1
    assert not torch.equal(before["blocks.0.attn.qkv.weight"], model.backbone.blocks[0].attn.qkv.weight)

    groups = run.optimizers[0].param_groups
    group_of = {id(p): g for g in groups for p in g["params"]}
    named = dict(model.named_parameters())
    assert set(group_of) == {id(p) for p in named.values()}  # every parameter, once

    def lr(name):
        return group_of[id(named[name])]["initial_lr"]

    peak = 1e-3 * 8 / 16  # batch 8, lr per 16 images
    # depth 2: patch/position embeddings 0.5^3, blocks.0 0.5^2, blocks.1 0.5, final norm, fc_norm, head 1
    expected = {
        "head.weight": 1, "head.bias": 1, "fc_norm.weight": 1, "backbone.norm.weight": 1,
        "backbone.blocks.1.mlp.fc1.weight": 0.5, "backbone.blocks.0.attn.qkv.weight": 0.25,
        "backbone.patch_embed.proj.weight": 0.125, "backbone.pos_embed": 0.125, "backbone.cls_token": 0.125,
    }  # fmt: skip
    assert {name: lr(name) / peak for name in expected} == pytest.approx(expected)
    decay = {name: group_of[id(named[name])]["weight_decay"] for name in expected}
    assert decay["head.weight"] == decay["backbone.blocks.0.attn.qkv.weight"] == 0.05
    assert decay["head.bias"] == decay["backbone.pos_embed"] == decay["backbone.norm.weight"] == 0.0


def test_checkpoint_loads_safely_and_feeds_load_backbone(pretrained_ckpt, tmp_path, digits_batch):
    from ssl_vit.checkpoints import load_backbone

    model = FineTune(
        BACKBONE, num_classes=10, training=Training(init_from=str(pretrained_ckpt)), preset="mae"
    )
    run = trainer(tmp_path, max_steps=1, limit_val_batches=0)
    run.fit(model, datamodule=DigitBatches(digits_batch, steps=1))
    run.save_checkpoint(tmp_path / "ft.ckpt")
    hparams = torch.load(tmp_path / "ft.ckpt", weights_only=True)["hyper_parameters"]
    assert hparams["preset"] == "mae" and hparams["training"]["init_from"] == str(pretrained_ckpt)
    vit, _ = load_backbone(str(tmp_path / "ft.ckpt"), None)
    assert all(torch.equal(v, model.backbone.state_dict()[k]) for k, v in vit.state_dict().items())


def test_finetune_recipes_are_parsed_by_the_recipe_tests():
    for recipe in ("finetune/vit_paper_b16_384.yaml", "finetune/mae_b16.yaml", "finetune/mae_l16.yaml",
                   "quickstart/finetune.yaml", "quickstart/linear_probe.yaml"):  # fmt: skip
        assert (ROOT / "recipes" / recipe).read_text().startswith("# ssl-vit fit --config"), recipe
