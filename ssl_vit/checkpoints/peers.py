"""The peers' MAE checkpoints read as a timm backbone: one key mapping per peer, a prefix to strip.

Both peers wrap timm's own `VisionTransformer`, so below the prefix the names are already timm's (and
ssl-vit's, which keeps them):

- lightly (1.6): `MaskedVisionTransformerTIMM(vit=...)` holds the ViT as `vit`, and lightly's MAE
  examples (examples/pytorch*/mae.py) keep it as the model's `backbone`: `backbone.vit.*` -> `*`.
  Beside it: `backbone.mask_token` and the `MAEDecoderTIMM` under `decoder.*`.
- stable-pretraining (0.1.8): `methods.MAE` (a LightningModule) holds a `MaskedEncoder` as `encoder`,
  which holds the ViT as `vit`: `encoder.vit.*` -> `*`. Beside it: `encoder.patch_embed.*` (the same
  module again, under its second name) and the `MAEDecoder` under `decoder.*`.

The state dict is a Lightning checkpoint's `state_dict` (`trainer.save_checkpoint`) or the model's own
(`torch.save(model.state_dict(), ...)`), the MAE at its top or inside a module that wraps it.
Everything outside the prefix (decoders, mask tokens) is left aside as the checkpoint's `rest`; the
backbone's config comes from the shapes, as for any timm file.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


class Mapping(NamedTuple):
    peer: str
    prefix: str  # where the peer's MAE keeps the timm ViT; stripped, the names are timm's


MAPPINGS = (Mapping("lightly", "backbone.vit."), Mapping("stable-pretraining", "encoder.vit."))


def match(state: dict) -> Mapping | None:
    """The mapping whose prefix `state`'s keys carry, None when no peer's does. The prefix may sit below
    a module that wraps the peer's MAE (stable-pretraining's Lightning example keeps it as `model`:
    `model.encoder.vit.*`); the mapping returned strips the wrapper's path too."""
    keys = [key for key in state if isinstance(key, str)]
    for mapping in MAPPINGS:
        for key in keys:
            if key.startswith(mapping.prefix):
                return mapping
            if (at := key.find("." + mapping.prefix)) >= 0:
                return mapping._replace(prefix=key[: at + 1] + mapping.prefix)
    return None


def split(state: dict[str, Tensor], prefix: str) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """(the tensors under `prefix`, without it: the timm-named backbone, the rest under their own names)
    of a state dict: a peer's (its mapping's prefix) or a Lightning checkpoint's (`backbone.`, `teacher.`)."""
    backbone = {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
    rest = {k: v for k, v in state.items() if not k.startswith(prefix)}
    return backbone, rest


__all__ = ["MAPPINGS", "Mapping", "match", "split"]
