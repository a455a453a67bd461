"""Weights from outside ssl-vit: facebookresearch/mae checkpoints (encoder and decoder) and timm state
dicts, built here with their exact names and shapes from tiny configs."""

import argparse
from functools import partial

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from timm.models.vision_transformer import Block, VisionTransformer
from torch import nn

from ssl_vit.checkpoints import load_backbone
from ssl_vit.errors import UserError
from ssl_vit.masking import random_keep
from ssl_vit.models.vit import ViTConfig
from ssl_vit.tasks import MaskedPatchPretraining
from ssl_vit.tasks.base import Training

CONFIG = ViTConfig("S/8", 32, width=64, depth=2, heads=2)
DECODER = dict(decoder_dim=32, decoder_depth=1, decoder_heads=4)


def mae_sincos(dim: int, side: int) -> np.ndarray:
    """facebookresearch/mae util/pos_embed.py, get_2d_sincos_pos_embed(dim, side, cls_token=True)."""

    def one_d(d, pos):
        omega = 1.0 / 10000 ** (np.arange(d // 2, dtype=np.float64) / (d / 2.0))
        out = np.einsum("m,d->md", pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    grid = np.stack(np.meshgrid(np.arange(side, dtype=np.float32), np.arange(side, dtype=np.float32)))
    emb = np.concatenate([one_d(dim // 2, grid[0]), one_d(dim // 2, grid[1])], axis=1)
    return np.concatenate([np.zeros([1, dim]), emb], axis=0)


class MAEReferenceDecoder(nn.Module):
    """MAE's decoder with MAE's attribute names and forward_decoder (models_mae.py)."""

    def __init__(self, encoder_dim, side, out_dim, dim, depth, heads):
        super().__init__()
        norm = partial(nn.LayerNorm, eps=1e-6)  # MAE's norm_layer
        self.mask_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.decoder_embed = nn.Linear(encoder_dim, dim)
        pos = torch.from_numpy(mae_sincos(dim, side)).float().unsqueeze(0)
        self.decoder_pos_embed = nn.Parameter(pos, requires_grad=False)
        self.decoder_blocks = nn.ModuleList(
            Block(dim, heads, 4.0, qkv_bias=True, norm_layer=norm) for _ in range(depth)
        )
        self.decoder_norm = norm(dim)
        self.decoder_pred = nn.Linear(dim, out_dim)
        for p in self.parameters():  # away from the default init, so every tensor's place matters
            if p.requires_grad:
                nn.init.normal_(p, std=0.3)

    def forward(self, x, ids_restore):
        """x: (B, 1+K, D) encoder output with [class] first; ids_restore: (B, N)."""
        x = self.decoder_embed(x)
        mask_tokens = self.mask_token.repeat(x.shape[0], ids_restore.shape[1] + 1 - x.shape[1], 1)
        x_ = torch.cat([x[:, 1:, :], mask_tokens], dim=1)
        x_ = torch.gather(x_, dim=1, index=ids_restore.unsqueeze(-1).repeat(1, 1, x.shape[2]))
        x = torch.cat([x[:, :1, :], x_], dim=1) + self.decoder_pos_embed
        for block in self.decoder_blocks:
            x = block(x)
        return self.decoder_pred(self.decoder_norm(x))[:, 1:, :]


@pytest.fixture(scope="module")
def mae_checkpoint(tmp_path_factory):
    """A facebookresearch/mae training checkpoint (checkpoint-N.pth): `model` with the encoder (timm's
    names, MAE's shapes) and the decoder, plus MAE's argparse `args` and `epoch`."""
    torch.manual_seed(0)
    encoder = VisionTransformer(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2, num_classes=0)
    decoder = MAEReferenceDecoder(64, 4, 8 * 8 * 3, 32, 1, 4)
    path = tmp_path_factory.mktemp("mae") / "checkpoint-799.pth"
    args = argparse.Namespace(model="mae_vit_tiny", norm_pix_loss=True, mask_ratio=0.75)
    torch.save({"model": {**encoder.state_dict(), **decoder.state_dict()}, "args": args, "epoch": 799}, path)
    return path, encoder.eval(), decoder.eval()


def test_mae_encoder_gives_timm_features(mae_checkpoint):
    path, encoder, _ = mae_checkpoint
    vit, config = load_backbone(str(path), CONFIG)
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(vit.eval().forward_tokens(images).pooled, encoder(images))
    with pytest.raises(UserError, match="match no paper variant") as info:  # heads are not in MAE's file
        load_backbone(str(path))
    assert "\n" not in str(info.value)


def test_continuing_mae_pretraining_loads_its_decoder(mae_checkpoint):
    path, encoder, reference = mae_checkpoint
    task = MaskedPatchPretraining(
        CONFIG, preset="mae", training=Training(init_from=str(path)), **DECODER
    ).eval()
    torch.testing.assert_close(task.decoder.pred.bias, reference.decoder_pred.bias)
    images = torch.randn(2, 3, 32, 32)
    idx_keep, idx_mask = random_keep(2, 16, 0.75)
    ids_restore = torch.argsort(torch.cat([idx_keep, idx_mask], dim=1), dim=1)
    with torch.no_grad():
        encoded = task.backbone.encode(task.backbone.embed_patches(images), idx_keep=idx_keep)
        ours = task.decoder(encoded, idx_keep)
        theirs = reference(torch.cat([encoded.cls[:, None], encoded.patches], dim=1), ids_restore)
    print(f"MAE decoder: max |ssl-vit - MAE| = {(ours - theirs).abs().max():.3g}")
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_a_decoder_of_another_size_is_a_one_line_error(mae_checkpoint):
    path, _, _ = mae_checkpoint
    with pytest.raises(
        UserError,
        match=r"mask_token \(1, 1, 32\) \(ours \(1, 1, 512\)\); set decoder_dim 32 and decoder_depth 1",
    ) as info:
        # the default 8 x 512 decoder
        MaskedPatchPretraining(CONFIG, preset="mae", training=Training(init_from=str(path)))
    assert "\n" not in str(info.value)


def test_a_decoder_pos_embed_that_is_not_mae_sincos_is_refused(mae_checkpoint, tmp_path):
    path, _, _ = mae_checkpoint
    checkpoint = torch.load(path, weights_only=False)
    checkpoint["model"]["decoder_pos_embed"] = torch.randn_like(checkpoint["model"]["decoder_pos_embed"])
    torch.save({"model": checkpoint["model"]}, tmp_path / "odd.pth")
    with pytest.raises(UserError, match="not MAE's fixed 2-D sin-cos"):
        MaskedPatchPretraining(
            CONFIG, preset="mae", training=Training(init_from=str(tmp_path / "odd.pth")), **DECODER
        )


def test_mae_global_pool_finetuned_norm_becomes_the_final_norm(tmp_path):
    encoder = VisionTransformer(
        img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2, num_classes=5, global_pool="avg"
    )
    state = encoder.state_dict()
    assert "fc_norm.weight" in state and "norm.weight" not in state and "cls_token" in state
    torch.save({"model": state}, tmp_path / "mae_finetuned.pth")
    vit, _ = load_backbone(str(tmp_path / "mae_finetuned.pth"), CONFIG)
    torch.testing.assert_close(vit.norm.weight, state["fc_norm.weight"])


@pytest.mark.parametrize("suffix", [".pth", ".bin", ".safetensors"])
def test_timm_weights_infer_a_paper_variant_and_ignore_the_head(tmp_path, suffix):
    timm_vit = VisionTransformer(
        img_size=32, patch_size=16, embed_dim=192, depth=12, num_heads=3, num_classes=7
    )  # Ti/16 at 32 px, with a classifier
    state = {k: v.contiguous() for k, v in timm_vit.state_dict().items()}
    path = tmp_path / f"weights{suffix}"
    save_file(state, path) if suffix == ".safetensors" else torch.save(state, path)
    vit, config = load_backbone(str(path))
    assert config == ViTConfig("Ti/16", 32)
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected = timm_vit.eval().forward_head(timm_vit.forward_features(images), pre_logits=True)
        torch.testing.assert_close(vit.eval().forward_tokens(images).pooled, expected)
