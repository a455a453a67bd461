"""lightly (1.6.0): its MAE and SimMIM on the comparison's timm ViT, built from lightly's public modules
the way its examples do (examples/pytorch/mae.py, simmim.py): `MaskedVisionTransformerTIMM` around the
ViT, `MAEDecoderTIMM` (MAE) or one linear layer (SimMIM), `utils.random_token_mask`, MSE (MAE) or L1
(SimMIM) on the raw pixels of the masked patches.

Where lightly has no option for a setting: its MAE target is raw pixels (ssl-vit's preset and
stable-pretraining normalise each patch), its SimMIM masks single patches at random (SimMIM's 32-pixel
cells in ssl-vit). lightly's I-JEPA is not here yet.
"""

from __future__ import annotations

import warnings

from common import Impl, Settings, mask_ratio, timm_vit
from lightly.models import utils
from lightly.models.modules import MAEDecoderTIMM, MaskedVisionTransformerTIMM
from torch import Tensor, nn

PEER = "lightly"


class MAE(nn.Module):
    """lightly's MAE example: the checkpoint keys are `backbone.vit.*` (ssl_vit.checkpoints.peers)."""

    def __init__(self, settings: Settings) -> None:
        super().__init__()
        vit = timm_vit(settings)
        self.mask_ratio = mask_ratio("mae", settings)
        self.patch_size = vit.patch_embed.patch_size[0]
        self.backbone = MaskedVisionTransformerTIMM(vit=vit)
        self.sequence_length = self.backbone.sequence_length
        with warnings.catch_warnings():  # deprecated for MaskedVisionTransformerDecoderTIMM in 1.6
            warnings.simplefilter("ignore", FutureWarning)
            self.decoder = MAEDecoderTIMM(
                num_patches=vit.patch_embed.num_patches,
                patch_size=self.patch_size,
                embed_dim=vit.embed_dim,
                decoder_embed_dim=settings.decoder_dim,
                decoder_depth=settings.decoder_depth,
                decoder_num_heads=settings.decoder_heads,
            )
        self.criterion = nn.MSELoss()

    def forward(self, images: Tensor) -> Tensor:
        """images (B, C, H, W) -> the loss."""
        batch_size = images.shape[0]
        idx_keep, idx_mask = utils.random_token_mask(
            size=(batch_size, self.sequence_length), mask_ratio=self.mask_ratio, device=images.device
        )
        x_encoded = self.backbone.encode(images=images, idx_keep=idx_keep)
        x_decode = self.decoder.embed(x_encoded)
        x_masked = utils.repeat_token(self.decoder.mask_token, (batch_size, self.sequence_length))
        x_masked = utils.set_at_index(x_masked, idx_keep, x_decode.type_as(x_masked))
        x_decoded = self.decoder.decode(x_masked)
        x_pred = self.decoder.predict(utils.get_at_index(x_decoded, idx_mask))
        target = utils.get_at_index(utils.patchify(images, self.patch_size), idx_mask - 1)  # no [class]
        return self.criterion(x_pred, target)


class SimMIM(nn.Module):
    """lightly's SimMIM example, on the timm ViT (`MaskedVisionTransformerTIMM`, lightly's timm twin of
    the example's torchvision one)."""

    def __init__(self, settings: Settings) -> None:
        super().__init__()
        vit = timm_vit(settings)
        self.mask_ratio = mask_ratio("simmim", settings)
        self.patch_size = vit.patch_embed.patch_size[0]
        self.backbone = MaskedVisionTransformerTIMM(vit=vit)
        self.sequence_length = self.backbone.sequence_length
        self.decoder = nn.Linear(vit.embed_dim, self.patch_size**2 * 3)
        self.criterion = nn.L1Loss()

    def forward(self, images: Tensor) -> Tensor:
        batch_size = images.shape[0]
        _, idx_mask = utils.random_token_mask(
            size=(batch_size, self.sequence_length), mask_ratio=self.mask_ratio, device=images.device
        )
        x_encoded = self.backbone.encode(images=images, idx_mask=idx_mask)
        x_out = self.decoder(utils.get_at_index(x_encoded, idx_mask))
        target = utils.get_at_index(utils.patchify(images, self.patch_size), idx_mask - 1)
        return self.criterion(x_out, target)


METHODS = {"mae": MAE, "simmim": SimMIM}


def build(method: str, settings: Settings) -> Impl:
    model = METHODS[method](settings)
    return Impl(model, model)


def timm_encoder(model: nn.Module) -> nn.Module:
    """The trained timm ViT inside lightly's model."""
    return model.backbone.vit
