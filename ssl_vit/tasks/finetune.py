"""Fine-tuning a pretrained backbone with a new zero-initialised head: the ViT paper's transfer protocol
(sec 3.2, appendix B.1.1) and MAE's (appendix A.1), as presets.

Legend: B batch, D width, K classes.
"""

from __future__ import annotations

from typing import Literal

from torch import Tensor, nn

from ssl_vit.errors import BadValue
from ssl_vit.models.vit import ViTConfig, WidthFeature, parse_variant
from ssl_vit.tasks.base import Training
from ssl_vit.tasks.optim import weight_decay_groups
from ssl_vit.tasks.supervised import SupervisedPretraining

Preset = Literal["vit_paper", "mae"]
Loss = Literal["softmax", "sigmoid"]

# What a preset sets among the task's own choices (`FineTune` says what each is, and what its recipe
# sets); any explicit argument overrides it, and without a preset `vit_paper`'s are the defaults.
PRESETS: dict[str, dict] = {
    "vit_paper": dict(feature="cls", layer_decay=None, loss="softmax"),
    "mae": dict(feature="mean", loss="softmax"),  # layer decay by size (mae_layer_decay)
}


def mae_layer_decay(variant: str) -> float:
    """MAE's layer decay by model size (appendix A.1: 0.65 for ViT-B; 0.75 for ViT-L and ViT-H)."""
    return 0.75 if parse_variant(variant).size in ("L", "H") else 0.65


def resolve_choices(preset: str | None, variant: str, feature, layer_decay, loss) -> dict:
    """Fill unset choices from the preset (else `vit_paper`'s) and check them."""
    if preset is not None and preset not in PRESETS:
        raise BadValue(f"unknown preset {preset!r}; valid: {', '.join(PRESETS)}")
    base = {**PRESETS["vit_paper"], **PRESETS.get(preset, {})}
    if preset == "mae":
        base["layer_decay"] = mae_layer_decay(variant)
    given = dict(feature=feature, layer_decay=layer_decay, loss=loss)
    choices = {key: base[key] if value is None else value for key, value in given.items()}
    if choices["layer_decay"] is not None and not 0 < choices["layer_decay"] <= 1:
        raise BadValue(f"layer_decay must be in (0, 1] (1: off), got {choices['layer_decay']}")
    return choices


class FineTune(SupervisedPretraining):
    """Supervised training of a pretrained backbone under a new zero-initialised head (the loss, soft
    mixup/cutmix targets and validation accuracy are `SupervisedPretraining`'s).

    Higher-resolution fine-tuning is `data.image_size` (linked into `backbone.img_size`) above the
    checkpoint's: the patch size is kept and the position embeddings are interpolated in 2-D when the
    checkpoint is loaded (ViT paper sec 3.2; `load_backbone`).

    Presets (each sets only what this class owns; the optimizer, schedule, clipping, drop path and
    augmentation are its recipe's in recipes/finetune/, whose header lists them):
    - `vit_paper`: [class] token, softmax, no layer decay.
    - `mae`: global average pooling of the patch tokens + a LayerNorm (`fc_norm`), layer decay 0.65
      (B and smaller) / 0.75 (L, H), softmax.

    Args:
        num_classes: classes of the new head (linked from the data).
        preset: `vit_paper` or `mae`; fills the choices below that are left unset.
        feature: `cls`, the [class] token, or `mean`, the average of the patch tokens followed by a new
            LayerNorm (MAE's `global_pool` with `fc_norm`; MAE also drops the backbone's final norm, we
            keep it so the backbone's keys stay timm's).
        layer_decay: layer-wise lr decay (BEiT, MAE): `blocks.i` of L gets lr x layer_decay^(L - i), patch
            and position embeddings and [class] token x layer_decay^(L + 1), final norm and head x 1 (timm's
            `param_groups_layer_decay`, applied by `BackboneTask.configure_optimizers`). None or 1: off.
        loss, head_bias_init: as in `SupervisedPretraining` (`softmax` unless set).
        training: see `Training`; the pretrained checkpoint is `training.init_from` (`backbone`'s
            img_size and drop_path_rate win over its own).
    """

    def __init__(
        self,
        backbone: ViTConfig,
        num_classes: int,
        preset: Preset | None = None,
        feature: WidthFeature | None = None,
        layer_decay: float | None = None,
        loss: Loss | None = None,
        head_bias_init: float | None = None,
        training: Training = Training(),
    ) -> None:
        choices = resolve_choices(preset, backbone.variant, feature, layer_decay, loss)
        super().__init__(
            backbone, num_classes, loss=choices["loss"], head_bias_init=head_bias_init, training=training
        )
        self.backbone.check_feature(choices["feature"], kinds=WidthFeature.valid())
        self.save_hyperparameters({**self.hparams, "preset": preset, **choices})  # both saved and logged copy
        self.feature, self.layer_decay = choices["feature"], choices["layer_decay"]
        # A gap backbone's pooled output already ends in timm's fc_norm.
        with_fc_norm = self.feature == "mean" and self.backbone.cls_token is not None
        self.fc_norm = nn.LayerNorm(self.backbone.embed_dim, eps=1e-6) if with_fc_norm else nn.Identity()

    def forward(self, images: Tensor) -> Tensor:
        return self.head(self.fc_norm(self.backbone.features(images, self.feature)))  # features (B, D)

    def group_matcher(self, coarse: bool = False) -> dict:
        """Layer ids for timm's `param_groups_layer_decay`, numbered as MAE's util/lr_decay.py does:
        embeddings and [class] token 0, `blocks.i` i + 1, all after the blocks (final norm, fc_norm,
        head; unmatched, so timm puts them last) the top layer at scale 1. timm's own ViT matcher would
        merge the final norm into the last block's layer, one decay step away from MAE's numbers."""
        return dict(stem=r"^backbone\.(?:cls_token|reg_token|pos_embed|patch_embed|norm_pre)",
                    blocks=r"^backbone\.blocks\.(\d+)")  # fmt: skip

    def param_groups(self) -> list[dict]:
        """Weight-decay groups, split by layer with an `lr_scale` each when layer decay is on."""
        return weight_decay_groups(self, self.no_weight_decay(), self.layer_decay)


__all__ = ["PRESETS", "FineTune", "mae_layer_decay"]
