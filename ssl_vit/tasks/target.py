"""What a masked-prediction target is: what `MaskedPatchPretraining` predicts at each masked patch, its
shape, how it is made from the batch, which band counts it takes and how the task's pictures draw it,
in one class.

A target is a subclass of `Target`, decorated with `@register`; its module lives in
`ssl_vit.tasks.targets` (a plugin's anywhere: `ssl_vit.plugins`). The computations of the built-in ones
are `ssl_vit.targets`' batched functions; `target: NAME` (or a preset's) selects it, and the task builds
its head or decoder for `shape` outputs per patch. A target made of class ids (int64) is learnt with
softmax cross-entropy over the last dimension of its shape, any other with the task's `pixel_loss`.

The methods read what they need from the task: `patch_size` (p), `grid`, `bands` (C),
`backbone.embed_dim` (D), `target_images(images)` (the pixels targets are computed on: RGB in [0, 1],
other band counts standardised), and for a target the EMA teacher makes (`TEACHER`), `teacher`,
`teacher_features`, `teacher_top_k`.

Legend: B batch, C bands, N patches, M masked patches, T the target's shape per patch, n pictured images.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from ssl_vit.errors import BadValue, shown
from ssl_vit.registry import Registry

if TYPE_CHECKING:
    import torch
    from torch import Tensor


class Target:
    NAME: ClassVar[str] = ""  # the `target:` value that selects it (`register`)
    BANDS: ClassVar[int | None] = None  # the one band count it takes (3: it reads RGB colours); None: any
    REFUSES: ClassVar[str] = ""  # with BANDS: why another band count cannot have it, as a message says
    # "target 'color3bit' <REFUSES>, and the data has 5" (unset: "takes images of <BANDS> bands only")
    TEACHER: ClassVar[bool] = False  # made by an EMA teacher of the backbone, which the task then keeps

    @classmethod
    def accepts(cls, bands: int) -> bool:
        """Whether a backbone of `bands` input bands can predict it."""
        return cls.BANDS is None or cls.BANDS == bands

    def shape(self, task) -> torch.Size:
        """T: what the task predicts per patch."""
        raise NotImplementedError

    def make(self, task, images: Tensor) -> Tensor:
        """images: (B, C, H, W) normalised model inputs -> the target of every patch (B, N, *T), float,
        or (B, N[, ...]) int64 class ids for a shape (..., classes)."""
        raise NotImplementedError

    # How `ssl_vit.tasks.pictures.masked_prediction_picture` draws it: a method (task, scene) -> rows, each
    # (n, 3, H, W) in [0, 1]; None: it has no picture (an EMA teacher's latents), the task draws none.
    picture = None


TARGETS = Registry("target", key="NAME")  # name -> the Target class, which the task makes one of
register = TARGETS.add  # class decorator: `target: cls.NAME` selects `cls`


def checked_shape(target: Target, shape: object) -> torch.Size:
    """`target.shape(task)` as given, when it is one: sizes the task builds its head or decoder for. A
    plugin's target that gets it wrong is one line naming it, not a traceback from the head's layers."""
    import torch

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
    import torch

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


__all__ = ["TARGETS", "Target", "check_made", "checked_shape", "register"]
