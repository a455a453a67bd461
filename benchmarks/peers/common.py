"""What every implementation in the side-by-side shares: the settings of one comparison, the timm ViT
each one wraps, and ssl-vit's own side (the task a recipe builds).

An implementation is a model and its loss on a batch of images; the step around it (backward, AdamW,
zero_grad) is the same for all (`speed.py`). Legend: B batch, C bands, H = W image size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple

import timm
import torch
from torch import Tensor, nn

from ssl_vit.benchmark.step import DECODERS, simmim_cell
from ssl_vit.checkpoints.export import timm_model
from ssl_vit.models.vit import ViTConfig
from ssl_vit.tasks import MaskedPatchPretraining


@dataclass(frozen=True)
class Settings:
    """One comparison: the backbone, and the decoder (or predictor) and mask ratio every side uses
    where it has the option; `None` keeps each method's paper default (ssl-vit's preset)."""

    variant: str = "S/16"
    img_size: int = 224
    decoder_dim: int = 512
    decoder_depth: int = 8
    decoder_heads: int = 16
    mask_ratio: float | None = None
    width: int | None = None  # a backbone of the variant's patch but its own size (the study's ViT)
    depth: int | None = None
    heads: int | None = None

    def config(self) -> ViTConfig:
        return ViTConfig(self.variant, self.img_size, width=self.width, depth=self.depth, heads=self.heads)

    def for_method(self, method: str) -> Settings:
        """I-JEPA's predictor is its own: 384 wide and 6 deep (ssl-vit's recipe and stable-pretraining's
        default), with stable-pretraining's one head per 64 channels (6; it has no option), not the
        recipe's 12 (the encoder's heads at B/16, as the paper's code takes them): more, narrower heads
        are slower on the CPU for the same FLOPs. The other methods take the comparison's decoder."""
        if method != "ijepa":
            return self
        dim = DECODERS["ijepa"]["decoder_dim"]
        return replace(
            self, decoder_dim=dim, decoder_depth=DECODERS["ijepa"]["decoder_depth"], decoder_heads=dim // 64
        )


# The paper's mask ratio of each method (ssl-vit's presets), given to every side that has the option;
# I-JEPA's blocks are drawn by scale and aspect instead.
MASK_RATIOS = {"mae": 0.75, "simmim": 0.6, "maskfeat": 0.4}


def mask_ratio(method: str, settings: Settings) -> float:
    return settings.mask_ratio if settings.mask_ratio is not None else MASK_RATIOS[method]


class Impl(NamedTuple):
    """One implementation of one method: its whole model (every trained parameter, teachers too) and
    its training loss on a batch of images (B, C, H, W)."""

    model: nn.Module
    loss: Callable[[Tensor], Tensor]


def timm_vit(settings: Settings, num_classes: int = 0) -> nn.Module:
    """timm's VisionTransformer of the variant at the comparison's image size, as each peer's docs
    create it (`timm.create_model(name)`)."""
    carrier = timm_model(settings.config())
    return timm.create_model(carrier.name, num_classes=num_classes, **carrier.kwargs)


def sslvit(method: str, settings: Settings, **choices) -> Impl:
    """ssl-vit's task as a recipe builds it (`ssl-vit bench step`'s `build_task`), with the comparison's
    decoder and mask ratio; `choices`: more of the task's arguments (`encoder_init`)."""
    settings = settings.for_method(method)
    config = settings.config()
    task = MaskedPatchPretraining(
        config,
        preset=method,
        mask_ratio=settings.mask_ratio,  # None: the preset's (MASK_RATIOS)
        cell_size=choices.pop("cell_size", simmim_cell(config) if method == "simmim" else 32),
        decoder_dim=settings.decoder_dim,
        decoder_depth=settings.decoder_depth,
        decoder_heads=settings.decoder_heads,
        picture_every_n_steps=0,
        **choices,
    )
    return Impl(task, lambda images: task.forward_loss(images).loss)


def trainable(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def one_step(impl: Impl, optimizer: torch.optim.Optimizer, images: Tensor) -> Tensor:
    """forward, loss, backward, AdamW step: the step every implementation is timed on."""
    loss = impl.loss(images)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()
