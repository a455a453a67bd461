"""lightly (1.6.0): its MAE, SimMIM and I-JEPA on the comparison's timm ViT, built from lightly's public
modules the way its examples do (examples/pytorch/mae.py, simmim.py, ijepa.py): `MaskedVisionTransformerTIMM`
around the ViT, `MAEDecoderTIMM` (MAE) or one linear layer (SimMIM), `utils.random_token_mask`, MSE (MAE)
or L1 (SimMIM) on the raw pixels of the masked patches; for I-JEPA `IJEPAPredictorTIMM`, an EMA copy of
the encoder, `IJEPAMaskCollator`, smooth L1 on the teacher's layer-normed features.

Where lightly has no option for a setting: its MAE target is raw pixels (ssl-vit's preset and
stable-pretraining normalise each patch), its SimMIM masks single patches at random (SimMIM's 32-pixel
cells in ssl-vit).

Its I-JEPA: 1.6 has no timm encoder for it (the example's `IJEPABackbone` wraps torchvision's ViT and
gathers the mask's patch indices from a sequence that starts with [class], so every token it takes is
its neighbour's); the context encoder here is the masked timm ViT of its MAE, given the mask's patches
after [class], which it keeps, as ssl-vit's does. The example draws the masks in the data loader
(`collate_fn=IJEPAMaskCollator(...)`); here the loss calls the collator on the batch, so drawing them
(a Python loop per image and block) is inside the timed step, as ssl-vit's and stable-pretraining's
drawing is. The example keeps the collator's defaults, not the paper's (context 0.2-0.8 of the
patches, two targets of 0.2-0.8, aspect 0.3-3); it is given the paper's (`PAPER_BLOCKS`). Like the
paper's, it draws a block again, forever, until it holds more than `min_keep` (10) tokens, so it needs
targets of 11 tokens: 10 x 10 patches at least (test_adapters.py). Otherwise it computes what the paper's
code does (facebookresearch/ijepa, `src/masks/multiblock.py`, `src/train.py`), more than
stable-pretraining's: the predictor runs once per target block, on the context and that block (4 x B
sequences); block sizes are drawn once per batch and the contexts cut to the batch's smallest, keeping
the first tokens in raster order (ssl-vit drops at random). Its predictor's heads come from the
comparison (`Settings.for_method`). The teacher's EMA step (the example's `update_target_encoder`)
follows `optimizer.step()` in its loop, outside the step timed here, as ssl-vit's and
stable-pretraining's do.
"""

from __future__ import annotations

import copy
import warnings

import torch
from common import Impl, Settings, mask_ratio, timm_vit
from lightly.data import IJEPAMaskCollator
from lightly.models import utils
from lightly.models.modules import IJEPAPredictorTIMM, MAEDecoderTIMM, MaskedVisionTransformerTIMM
from torch import Tensor, nn
from torch.nn import functional as F

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


# The paper's blocks (facebookresearch/ijepa, configs/in1k_vith14_ep300.yaml; ssl-vit's `jepa_blocks` and
# stable-pretraining's defaults), as lightly's collator names them.
PAPER_BLOCKS = dict(
    enc_mask_scale=(0.85, 1.0),
    pred_mask_scale=(0.15, 0.2),
    aspect_ratio=(0.75, 1.5),
    nenc=1,
    npred=4,
    min_keep=10,
)


class IJEPA(nn.Module):
    """lightly's I-JEPA example on the timm ViT: the context encoder is `backbone`, as in its MAE, so the
    checkpoint keys are `backbone.vit.*` (the example's `encoder`); its EMA copy is `target_backbone`."""

    def __init__(self, settings: Settings) -> None:
        super().__init__()
        settings = settings.for_method("ijepa")
        vit = timm_vit(settings)
        self.backbone = MaskedVisionTransformerTIMM(vit=vit)
        self.prefix = vit.num_prefix_tokens
        self.predictor = IJEPAPredictorTIMM(
            num_patches=vit.patch_embed.num_patches,
            depth=settings.decoder_depth,
            mlp_dim=vit.embed_dim,  # the encoder's width, in and out of the predictor
            predictor_embed_dim=settings.decoder_dim,
            num_heads=settings.decoder_heads,
        )
        # The example leaves the teacher in the optimizer, where it gets no gradient; frozen, it is not
        # counted as trained.
        self.target_backbone = copy.deepcopy(self.backbone).requires_grad_(False)
        self.collator = IJEPAMaskCollator(
            input_size=settings.img_size, patch_size=vit.patch_embed.patch_size[0], **PAPER_BLOCKS
        )
        self.criterion = nn.SmoothL1Loss()

    def forward(self, images: Tensor) -> Tensor:
        """images (B, C, H, W) -> the loss; masks_enc: [(B, K)], masks_pred: 4 x [(B, M)] patch indices."""
        # the example's collate_fn, given the batch as the data loader's list of samples
        images, masks_enc, masks_pred = self.collator(list(images))
        masks_enc = [m.to(images.device) for m in masks_enc]
        masks_pred = [m.to(images.device) for m in masks_pred]
        return self.criterion(
            self.forward_context(images, masks_enc, masks_pred), self.forward_target(images, masks_pred)
        )

    def forward_context(self, images: Tensor, masks_enc: list[Tensor], masks_pred: list[Tensor]) -> Tensor:
        """-> the predictions (4B, M, D), block after block."""
        (mask,) = masks_enc
        prefix = torch.arange(self.prefix, device=mask.device).expand(len(mask), -1)
        z = self.backbone.encode(images, idx_keep=torch.cat([prefix, mask + self.prefix], dim=1))
        return self.predictor(z[:, self.prefix :], masks_enc, masks_pred)  # (B, K, D) in

    @torch.no_grad()
    def forward_target(self, images: Tensor, masks_pred: list[Tensor]) -> Tensor:
        """-> the teacher's layer-normed features at each block (4B, M, D)."""
        h = self.target_backbone.encode(images)[:, self.prefix :]  # (B, N, D)
        h = F.layer_norm(h, (h.size(-1),))
        return utils.apply_masks(h, masks_pred)


METHODS = {"mae": MAE, "simmim": SimMIM, "ijepa": IJEPA}


def build(method: str, settings: Settings) -> Impl:
    model = METHODS[method](settings)
    return Impl(model, model)


def timm_encoder(model: nn.Module) -> nn.Module:
    """The trained timm ViT inside lightly's model (I-JEPA's context encoder, not its EMA copy)."""
    return model.backbone.vit
