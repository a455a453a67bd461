"""What a feature is: one of a backbone's outputs that heads and frozen-feature protocols read
(`ViT.feature_set`), by name (`feature: mean` in a suite, `--model.init_args.feature`). SSL papers
differ on it, so it is always an explicit, logged choice.

A feature is a `Feature` registered by its own module in `ssl_vit.models.features` (its fields say what
it holds). The choices tasks and suites take (`ssl_vit.models.vit.FeatureKind`, ...) are
`FEATURES.choice`s of its flags (`Registry.choice`: a plugin's feature is valid wherever a built-in one is).

Legend: B batch, N patches, P prefix ([class]) tokens, T tokens, D width, F feature width.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from ssl_vit.registry import Registry

if TYPE_CHECKING:
    from torch import Tensor


class Tokens(NamedTuple):
    """Named outputs of `ViT.encode`."""

    cls: Tensor | None  # (B, D) final-norm [class] token; None without one
    patches: Tensor  # (B, N or K, D) final-norm patch tokens, in the order they were given
    pooled: Tensor  # (B, D) what timm's head would see: [class] token or normalised mean of patches


class Readout(NamedTuple):
    """One forward pass's outputs, as every feature of it is read from (`ViT.feature_set`)."""

    tokens: Tokens  # the final layer's named outputs
    blocks: list[Tensor] | None  # the last k blocks' outputs through the final norm, each (B, P+N, D); or
    # None when no feature read asks for blocks
    pooled: list[Tensor] | None  # each of `blocks` pooled as the final layer's `pooled` is, each (B, D)
    prefix: int  # P


@dataclass(frozen=True)
class Feature:
    name: str
    words: str  # what it is, as tables and verdicts name it ("[class] token"): the one a result rests on
    read: Callable[[Readout], Tensor]  # -> (B, F) pooled, (B, T, F) per token
    pooled: bool = True  # one vector per image; else one per token
    blocks: bool = False  # reads the last k blocks (F = k x D), not the final layer alone
    grid: bool = False  # per token: the patch tokens only, in grid order (what a dense probe classifies)
    needs_cls: bool = False  # only a backbone with a [class] token has it

    def size(self, patches: int, prefix: int, width: int, last_k: int) -> tuple[int, int]:
        """(T, F) of one image's feature from a backbone of `patches` patch tokens, `prefix` [class]
        tokens and width D: T vectors (1 for a pooled one) of F values."""
        tokens = 1 if self.pooled else patches + (0 if self.grid else prefix)
        return tokens, width * (last_k if self.blocks else 1)


FEATURES = Registry("feature")
register = FEATURES.add
