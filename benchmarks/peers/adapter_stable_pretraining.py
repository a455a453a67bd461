"""stable-pretraining (0.1.8): its MAE, SimMIM, MaskFeat and I-JEPA from `stable_pretraining.methods`,
each given the comparison's timm ViT and called as its docs show (`model(images).loss` in training
mode).

Where it has no option for a setting: its SimMIM masks single patches at random (SimMIM's 32-pixel
cells in ssl-vit) and its MaskFeat draws its own masks; its I-JEPA's EMA teacher is updated by a
Lightning callback (`TeacherStudentCallback`), outside the step timed here, as is ssl-vit's (in
`optimizer_step`). Its `Data2Vec` is data2vec (2022), not data2vec 2.0, so it is not compared with
ssl-vit's data2vec2.

Its I-JEPA does less work per step than the paper's, which ssl-vit follows (`src/train.py` and
`src/models/vision_transformer.py` of facebookresearch/ijepa), and no option of it changes that: its
predictor runs once per image on the context and the union of the four target blocks together (S/16:
about 190 tokens, 8 sequences), where the paper's runs once per block on the context and that block
alone (about 100 tokens, 4 x 8 sequences), so a target token also attends to the other blocks' mask
tokens; its blocks are placed once per batch and never overlap, and its context is a random subset of
the tokens outside them, not a block. At S/16 that is about 260 GFLOP per step against ssl-vit's 280 to
350 (the masks' sizes vary; speed.py's GFLOP column), the rest of the step alike. Its predictor has one
head per 64 channels, no option (`Settings.for_method` gives ssl-vit's the same).
"""

from __future__ import annotations

from common import Impl, Settings, mask_ratio, timm_vit
from loguru import logger
from stable_pretraining.methods import IJEPA, MAE, MaskFeat, SimMIM
from torch import nn

PEER = "stable-pretraining"
logger.disable("stable_pretraining")  # its notes on every model built (no hyperparameters given ...)


def build_mae(settings: Settings) -> MAE:
    """Its checkpoint keys are `encoder.vit.*` (ssl_vit.checkpoints.peers)."""
    return MAE(
        timm_vit(settings),
        decoder_embed_dim=settings.decoder_dim,
        decoder_depth=settings.decoder_depth,
        decoder_num_heads=settings.decoder_heads,
        mask_ratio=mask_ratio("mae", settings),
    )


def build_simmim(settings: Settings) -> SimMIM:
    vit = timm_vit(settings)
    return SimMIM(
        vit, patch_size=vit.patch_embed.patch_size[0], mask_ratio=mask_ratio("simmim", settings),
        image_size=settings.img_size,
    )  # fmt: skip


def build_maskfeat(settings: Settings) -> MaskFeat:
    vit = timm_vit(settings)
    return MaskFeat(
        vit, patch_size=vit.patch_embed.patch_size[0], mask_ratio=mask_ratio("maskfeat", settings),
        image_size=settings.img_size,
    )  # fmt: skip


def build_ijepa(settings: Settings) -> IJEPA:
    settings = settings.for_method("ijepa")
    return IJEPA(
        timm_vit(settings), predictor_embed_dim=settings.decoder_dim, predictor_depth=settings.decoder_depth
    )


METHODS = {"mae": build_mae, "simmim": build_simmim, "maskfeat": build_maskfeat, "ijepa": build_ijepa}


def build(method: str, settings: Settings) -> Impl:
    model = METHODS[method](settings).train()
    return Impl(model, lambda images: model(images).loss)


def timm_encoder(model: nn.Module) -> nn.Module:
    """The trained timm ViT inside stable-pretraining's model: its MAE wraps it (`MaskedEncoder.vit`),
    its SimMIM holds it as `encoder`."""
    return getattr(model.encoder, "vit", model.encoder)
