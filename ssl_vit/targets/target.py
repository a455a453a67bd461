"""What a masked-prediction target is, in one class: what `MaskedPatchPretraining` predicts at each
masked patch, its shape, how it is made, which band counts it takes and how its picture is drawn. Each
is a `Target` subclass decorated with `@register` (a plugin's too: `ssl_vit.plugins`), selected by
`target: NAME`; one made of class ids (int64) is learnt with softmax cross-entropy over the last
dimension of its shape, any other with the task's `pixel_loss`.

A target knows of the task only its `TargetContext`. It is made of RGB pixels in [0, 1] (the input
normalisation undone, `TargetContext.pixels`; `seen_pixels` alone reads the standardised input itself),
or of images of any other band count C as the model sees them, each band standardised: raw units
(reflectances in the thousands) would make a pixel loss of 1e7, and the targets that work for them
(pixels per band, HOG) are the same on any per-band scale. Patches are numbered as in `patches`; a
target is made for a whole batch.

Legend (the package's): B batch, C bands, N patches (H/p * W/p), p patch size, D width, M masked
patches, T a target's shape per patch, n pictured images.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ssl_vit.errors import BadValue, shown
from ssl_vit.registry import Registry


@dataclass(frozen=True)
class TargetContext:
    """What a target knows of the task it serves; the task builds it once."""

    patch_size: int  # p, pixels per patch side
    grid: tuple[int, int]  # (rows, columns) of patches; N = rows * columns
    bands: int  # C, input bands
    width: int  # D, the backbone's width
    display_bands: tuple[int, int, int]  # drawn as red, green and blue for C != 3 (`masked_picture`)
    pixels: Callable[[Tensor], Tensor]  # (B, C, H, W) model inputs -> pixels (RGB in [0, 1]), as drawn
    latents: Callable[[Tensor], Tensor] | None = None  # (B, C, H, W) -> (B, N, D), the EMA teacher's


class Target:
    NAME: ClassVar[str] = ""  # the `target:` value that selects it (`register`)
    BANDS: ClassVar[int | None] = None  # the one band count it takes (3: it reads RGB colours); None: any
    REFUSES: ClassVar[str] = ""  # with BANDS: why another band count cannot have it, as a message says
    # "target 'color3bit' <REFUSES>, and the data has 5" (unset: "takes images of <BANDS> bands only")
    TEACHER: ClassVar[bool] = False  # made by an EMA teacher of the backbone, which the task keeps

    @classmethod
    def accepts(cls, bands: int) -> bool:
        """Whether a backbone of `bands` input bands can predict it."""
        return cls.BANDS is None or cls.BANDS == bands

    def shape(self, ctx: TargetContext) -> torch.Size:
        """T: what the task predicts per patch."""
        raise NotImplementedError

    def make(self, ctx: TargetContext, images: Tensor) -> Tensor:
        """images: (B, C, H, W) normalised model inputs -> the target of every patch (B, N, *T), float,
        or (B, N[, ...]) int64 class ids for a shape (..., classes)."""
        raise NotImplementedError

    # How `masked_picture.masked_prediction_picture` draws it: a method (ctx, scene) -> rows, each
    # (n, 3, H, W) in [0, 1]; None: it has no picture (an EMA teacher's latents), the task draws none.
    picture = None


TARGETS = Registry("target", key="NAME")  # name -> the Target class, which the task makes one of
register = TARGETS.add  # class decorator: `target: cls.NAME` selects `cls`


def checked_shape(target: Target, shape: object) -> torch.Size:
    """`target.shape(ctx)` as given, when it is one: sizes the task builds its head or decoder for. A
    plugin's target that gets it wrong is one line naming it, not a traceback from the head's layers."""
    sizes = shape if isinstance(shape, tuple) else (None,)
    if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sizes):
        raise BadValue(
            f"target {target.NAME!r} ({type(target).__module__}): shape() gave {shown(shape)}: give a "
            "torch.Size of positive sizes, what the task predicts per patch"
        )
    return torch.Size(sizes)


def check_made(target: Target, made: object, batch: int, patches: int, shape: torch.Size) -> None:
    """One line when `target.make` gave other than (B, N, *T) floats or (B, N, *T[:-1]) int64 class ids
    (a plugin's target): the step would fail in the loss, in a traceback."""
    if isinstance(made, torch.Tensor):
        want = (batch, patches, *(shape[:-1] if made.dtype == torch.long else shape))
        if tuple(made.shape) == want:
            return
        given = f"a {made.dtype} tensor of shape {tuple(made.shape)}, not {want}"
    else:
        given = f"{shown(made)}, not a tensor"
    raise BadValue(
        f"target {target.NAME!r} ({type(target).__module__}): make() gave {given} (B, N, *shape()): fix "
        "its make()"
    )
