"""Heads: zero-initialised classifier, per-patch heads, MAE's decoder."""

import pytest
import torch

from ssl_vit import build_vit
from ssl_vit.models.heads import MAEDecoder, PatchHead, zero_linear


def test_zero_linear_starts_at_its_bias_and_learns():
    head = zero_linear(8, 5, bias_init=-2.0)
    x = torch.randn(4, 8)
    torch.testing.assert_close(head(x), torch.full((4, 5), -2.0))
    head(x).sum().backward()
    assert head.weight.grad.abs().sum() > 0


def test_patch_heads_have_one_output_block_per_patch():
    tokens = torch.randn(2, 9, 32)
    assert PatchHead(32, (512,))(tokens).shape == (2, 9, 512)
    assert PatchHead(32, (16, 512))(tokens).shape == (2, 9, 16, 512)
    assert PatchHead(32, (8 * 8 * 3,))(tokens).shape == (2, 9, 192)


def _encoder_and_decoder():
    torch.manual_seed(0)
    vit = build_vit("S/8", 32, width=64, depth=2, heads=2).eval()
    decoder = MAEDecoder(vit.embed_dim, vit.grid_size, out_dim=8 * 8 * 3, dim=32, depth=2, heads=4).eval()
    return vit, decoder


def test_mae_decoder_defaults_are_the_papers():
    decoder = MAEDecoder(768, (14, 14), out_dim=768)
    assert len(decoder.blocks) == 8 and decoder.embed.out_features == 512
    assert decoder.blocks[0].attn.num_heads == 16
    assert "pos_embed" not in decoder.state_dict()  # fixed sin-cos, rebuilt from the grid
    assert decoder.pos_embed.shape == (1, 196, 512) and not decoder.pos_embed.requires_grad


def test_mae_decoder_predicts_every_patch_in_patch_order():
    vit, decoder = _encoder_and_decoder()
    images = torch.randn(2, 3, 32, 32)
    idx_keep = torch.stack([torch.randperm(16)[:4] for _ in range(2)])
    with torch.no_grad():
        encoded = vit.encode(vit.embed_patches(images), idx_keep)
        pred = decoder(encoded, idx_keep)
        assert pred.shape == (2, 16, 192)
        # The same visible tokens listed in another order land in the same places.
        order = torch.stack([torch.randperm(4) for _ in range(2)])
        shuffled = encoded._replace(
            patches=torch.gather(encoded.patches, 1, order.unsqueeze(-1).expand(-1, -1, 64))
        )
        torch.testing.assert_close(
            decoder(shuffled, torch.gather(idx_keep, 1, order)), pred, atol=1e-5, rtol=1e-5
        )
        # Masked positions hold the one shared mask token, so only position tells them apart.
        assert not torch.allclose(pred[0, 0], pred[0, 1])


def test_mae_gradients_reach_encoder_decoder_and_mask_token():
    vit, decoder = _encoder_and_decoder()
    idx_keep = torch.stack([torch.randperm(16)[:4] for _ in range(2)])
    pred = decoder(vit.encode(vit.embed_patches(torch.randn(2, 3, 32, 32)), idx_keep), idx_keep)
    pred.square().mean().backward()
    assert decoder.mask_token.grad.abs().sum() > 0
    assert vit.patch_embed.proj.weight.grad.abs().sum() > 0
    assert all(torch.isfinite(p.grad).all() for p in decoder.parameters())


def test_a_patch_heads_start_is_xavier_or_torch():
    with pytest.raises(ValueError, match="head init 'zeros': give xavier or torch"):
        PatchHead(32, (48,), "zeros")
