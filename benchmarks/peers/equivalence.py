"""Whether ssl-vit's task and a peer's model compute the same thing: both started from the same weights
and given the same images and the same mask, their losses and gradients are compared.

    python benchmarks/peers/equivalence.py

- MAE against lightly's: ssl-vit's task with MAE's encoder start (`encoder_init: mae`, as lightly's
  masked ViT starts the ViT it wraps) on lightly's target (the patches of the image as the model sees
  it, `target: seen_pixels`);
- SimMIM against stable-pretraining's: ssl-vit's task as its `simmim` preset makes it (the same target,
  its head as PyTorch starts a linear layer).

The weights are ssl-vit's, copied into the peer's model under its names. Two layouts differ by a fixed
permutation, which is copied across: the decoder's sin-cos position embeddings (lightly puts (sin x, cos
x) first, timm's builder (sin y, cos y)), and SimMIM's head outputs (stable-pretraining orders a patch's
pixels band first, ssl-vit band last). Neither changes what a randomly started model can learn.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import adapter_lightly
import adapter_stable_pretraining
import torch
from common import Settings, sslvit
from torch import nn

from ssl_vit import masking

TINY = Settings("Ti/16", 32, decoder_dim=32, decoder_depth=1, decoder_heads=4)
DECODER_NAMES = {"embed.": "decoder_embed.", "blocks.": "decoder_blocks.", "norm.": "decoder_norm.",
                 "pred.": "decoder_pred.", "mask_token": "mask_token"}  # fmt: skip


def copy_mae(ours: nn.Module, theirs: nn.Module) -> None:
    """ssl-vit's MAE task's weights into lightly's MAE model."""
    theirs.backbone.vit.load_state_dict(ours.backbone.state_dict())
    decoder = {}
    for name, value in ours.decoder.state_dict().items():
        prefix = next(p for p in DECODER_NAMES if name.startswith(p))
        decoder[DECODER_NAMES[prefix] + name[len(prefix) :]] = value
    missing = theirs.decoder.load_state_dict(decoder, strict=False).missing_keys
    assert missing == ["decoder_pos_embed"], missing  # ssl-vit's is rebuilt, not saved
    with torch.no_grad():
        theirs.decoder.decoder_pos_embed[:, 1:] = ours.decoder.pos_embed  # after [class]'s zeros


def copy_simmim(ours: nn.Module, theirs: nn.Module) -> None:
    """ssl-vit's SimMIM task's weights into stable-pretraining's SimMIM model."""
    theirs.encoder.load_state_dict(ours.backbone.state_dict())
    p, bands = ours.patch_size, ours.bands
    rows = torch.arange(p * p * bands).view(p, p, bands).permute(2, 0, 1).flatten()  # theirs <- ours
    with torch.no_grad():
        theirs.mask_token.copy_(ours.mask_embedding.view(1, 1, -1))
        theirs.decoder.weight.copy_(ours.head.proj.weight[rows])
        theirs.decoder.bias.copy_(ours.head.proj.bias[rows])


@contextmanager
def same_mask(method: str, ours: nn.Module, theirs: nn.Module, batch: int) -> Iterator[None]:
    """Both sides draw the mask ssl-vit's task draws once here."""
    idx_keep, idx_mask = ours.draw_mask(batch, torch.Generator().manual_seed(1), "cpu")
    with mock.patch.object(ours, "draw_mask", lambda *args, **kwargs: (idx_keep, idx_mask)):
        if method == "mae":  # lightly's indices count [class] first, which it always keeps
            cls = torch.zeros(batch, 1, dtype=torch.long)
            drawn = (torch.cat([cls, idx_keep + 1], 1), idx_mask + 1)
            with mock.patch.object(adapter_lightly.utils, "random_token_mask", lambda **_: drawn):
                yield
        else:
            mask = masking.indices_to_mask(idx_mask, ours.num_patches).float()
            with mock.patch.object(theirs, "_random_mask", lambda *args, **kwargs: mask):
                yield


PEERS = {
    "mae": (adapter_lightly, dict(encoder_init="mae"), copy_mae, lambda model: model.backbone.vit),
    "simmim": (adapter_stable_pretraining, {}, copy_simmim, lambda model: model.encoder),
}


def compare(method: str, settings: Settings = TINY, batch: int = 4) -> dict[str, float]:
    """-> both losses, the largest difference of an encoder gradient relative to the largest gradient of
    that tensor, and how many encoder tensors had gradients compared, from the same weights, images and
    mask."""
    adapter, choices, copy, encoder = PEERS[method]
    torch.manual_seed(0)
    ours = sslvit(method, settings, target="seen_pixels", **choices).model
    impl = adapter.build(method, settings)
    theirs = impl.model
    copy(ours, theirs)
    size = settings.img_size
    images = torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(2))
    with same_mask(method, ours, theirs, batch):
        loss_ours = ours.forward_loss(images).loss
        loss_theirs = impl.loss(images)
    loss_ours.backward()
    loss_theirs.backward()
    grads = dict(encoder(theirs).named_parameters())
    worst, compared = 0.0, 0
    for name, param in ours.backbone.named_parameters():
        mine, its = param.grad, grads[name].grad
        if mine is None and its is None:  # frozen on both sides (MAE's fixed position embeddings)
            continue
        worst = max(worst, float((mine - its).abs().max() / its.abs().max().clamp_min(1e-12)))
        compared += 1
    return dict(ours=loss_ours.item(), theirs=loss_theirs.item(), grad_rel_diff=worst, tensors=compared)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=list(PEERS), choices=PEERS)
    args = parser.parse_args(argv)
    for method in args.methods:
        result = compare(method)
        print(
            f"{method}: ssl-vit loss {result['ours']:.6f}, {PEERS[method][0].PEER} {result['theirs']:.6f}; "
            f"{result['tensors']} encoder gradients, the largest difference {result['grad_rel_diff']:.1e} "
            "of the gradient"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
