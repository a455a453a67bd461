"""Masked patch prediction: the ViT paper's MPP (sec 4.6), MAE, SimMIM and MaskFeat as independent choices of
corruption, target and mask, so each can be swapped alone.

Legend: B batch, N patches, M tokens the loss is on, D width, T the target's shape per patch.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from pytorch_lightning.cli import OptimizerCallable
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from torch import Tensor, nn

from ssl_vit import masking, targets
from ssl_vit.checkpoints import load_mae_decoder
from ssl_vit.errors import BadValue
from ssl_vit.models.heads import MAEDecoder, PatchHead
from ssl_vit.models.vit import ViTConfig
from ssl_vit.tasks.base import RGB, BackboneTask, step_inputs
from ssl_vit.tasks.optim import SchedulerCallable, WarmupDecay
from ssl_vit.tasks.pictures import masked_prediction_picture
from ssl_vit.tracking import log_picture

Corruption = Literal["bert", "drop", "mask_token"]
Target = Literal["color3bit", "color3bit_4x4", "pixels", "norm_pixels", "hog"]
MaskShape = Literal["random", "block", "cells"]
PixelLoss = Literal["mse", "l1"]

# One word for the common cases; any explicit argument overrides its preset's value.
PRESETS: dict[str, dict] = {
    # ViT paper appendix B.1.2: corrupt 50% of patch embeddings 80/10/10, predict 3-bit mean colours.
    "vit_mpp": dict(corruption="bert", target="color3bit", mask_ratio=0.5, mask_shape="random"),
    # MAE: 75% random masking, encoder on visible tokens, 8 x 512 decoder, normalised pixels, MSE.
    "mae": dict(
        corruption="drop", target="norm_pixels", mask_ratio=0.75, mask_shape="random", pixel_loss="mse"
    ),
    # SimMIM: mask token in the encoder, 60% of 32-pixel cells, raw pixels, L1, linear head.
    "simmim": dict(
        corruption="mask_token", target="pixels", mask_ratio=0.6, mask_shape="cells", pixel_loss="l1"
    ),
    # MaskFeat (Wei et al. 2022): mask token in the encoder, 40% BEiT block masks, HOG of the masked
    # patches regressed with MSE by a linear head.
    "maskfeat": dict(
        corruption="mask_token", target="hog", mask_ratio=0.4, mask_shape="block", pixel_loss="mse"
    ),
}
COLOR_CLASSES = targets.LEVELS**3  # 512


class MaskedOutput(NamedTuple):
    loss: Tensor
    pred: Tensor  # (B, M, *T) predictions at the loss positions
    target: Tensor  # (B, M, *T) or (B, M[, 16]) class ids
    idx: Tensor  # (B, M) positions of the loss tokens
    accuracy: Tensor | None  # colour targets only
    # What `ssl_vit.tasks.health.HealthMonitor` watches: `student` (B, D), the mean of the encoder's patch
    # tokens on the corrupted input (what the loss trains: the [class] token gets no gradient from it); a
    # target computed by a teacher adds `teacher` (B, D), the same of the teacher, and `target` (B, M, *T).
    monitor_features: dict[str, Tensor] | None = None


class MaskedPatchPretraining(BackboneTask):
    """Self-supervised pretraining by masked patch prediction.

    Args:
        preset: `vit_mpp`, `mae`, `simmim` or `maskfeat`; fills every choice below that is left unset.
        corruption: `bert` replaces patch embeddings (80% [mask], 10% another patch, 10% kept) and runs
            the full sequence; `drop` runs only kept tokens and an MAE decoder fills the rest;
            `mask_token` puts a learned token in the encoder (SimMIM).
        target: 3-bit mean colour (512 classes), its 4x4-downsized variant (16 x 512), raw pixels,
            per-patch normalised pixels, or `hog`: histograms of oriented gradients of the patch's cells
            (MaskFeat; `ssl_vit.targets.hog`, 8-pixel cells, or the whole patch when 8 does not divide it).
        mask_ratio: fraction of patches corrupted/masked; the loss is on those only.
        mask_shape: `random`, `block` (BEiT) or `cells` (SimMIM: aligned squares of `cell_size` pixels).
        pixel_loss: `mse` or `l1` for pixel and HOG targets.
        decoder_dim, decoder_depth, decoder_heads: the MAE decoder (`drop` only).
        picture_every_n_steps: log reconstructions / predicted colours to the logger this often (0: never).
        init_from: starting weights of the backbone (see `BackboneTask`), e.g. to continue pretraining;
            a facebookresearch/mae checkpoint starts the decoder (`drop`) from its own as well.
    """

    def __init__(
        self,
        backbone: ViTConfig,
        preset: Literal["vit_mpp", "mae", "simmim", "maskfeat"] | None = None,
        corruption: Corruption | None = None,
        target: Target | None = None,
        mask_ratio: float | None = None,
        mask_shape: MaskShape | None = None,
        cell_size: int = 32,
        pixel_loss: PixelLoss | None = None,
        decoder_dim: int = 512,
        decoder_depth: int = 8,
        decoder_heads: int = 16,
        picture_every_n_steps: int = 500,
        init_from: str = "scratch",
        optimizer: OptimizerCallable = torch.optim.AdamW,
        lr_scheduler: SchedulerCallable = WarmupDecay,
        lr_reference_batch: int | None = None,
        mean: RGB = IMAGENET_DEFAULT_MEAN,
        std: RGB = IMAGENET_DEFAULT_STD,
    ) -> None:
        choices = resolve_choices(preset, corruption, target, mask_ratio, mask_shape, pixel_loss)
        super().__init__(
            backbone,
            init_from,
            optimizer,
            lr_scheduler,
            lr_reference_batch,
            mean,
            std,
            hparams=dict(
                preset=preset,
                **choices,
                cell_size=cell_size,
                decoder_dim=decoder_dim,
                decoder_depth=decoder_depth,
                decoder_heads=decoder_heads,
            ),
        )
        self.corruption, self.target_kind = choices["corruption"], choices["target"]
        self.mask_ratio, self.mask_shape = choices["mask_ratio"], choices["mask_shape"]
        self.pixel_loss, self.picture_every_n_steps = choices["pixel_loss"], picture_every_n_steps
        self.patch_size = self.backbone.pixels_per_token
        self.grid = self.backbone.grid_size
        self.num_patches = self.grid[0] * self.grid[1]
        if self.mask_shape == "cells" and (
            cell_size % self.patch_size or self.grid[0] % (cell_size // self.patch_size)
        ):
            raise BadValue(
                f"cell_size {cell_size} must be a multiple of the patch size {self.patch_size} that divides "
                f"the {self.grid[0]}x{self.grid[1]} patch grid; pick another cell_size"
            )
        self.cell_size = cell_size
        target_shape = self.target_shape()
        width = self.backbone.embed_dim
        if self.corruption == "drop":
            self.decoder = MAEDecoder(
                width, self.grid, target_shape.numel(), decoder_dim, decoder_depth, decoder_heads
            )
            load_mae_decoder(self.decoder, init_from)  # an MAE checkpoint's decoder continues too
        else:
            self.head = PatchHead(width, tuple(target_shape))
            # The learned [mask] embedding lives here, not in the backbone: its keys stay timm's.
            self.mask_embedding = nn.Parameter(torch.zeros(width))
            nn.init.normal_(self.mask_embedding, std=0.02)
        kept = self.num_patches - round(self.mask_ratio * self.num_patches)
        self.tokens_per_image = 1 + (kept if self.corruption == "drop" else self.num_patches)

    def target_shape(self) -> torch.Size:
        """T: the prediction per patch."""
        if self.target_kind == "color3bit":
            return torch.Size([COLOR_CLASSES])
        if self.target_kind == "color3bit_4x4":
            return torch.Size([16, COLOR_CLASSES])
        if self.target_kind == "hog":
            cells = (self.patch_size // targets.hog_cell_size(self.patch_size)) ** 2
            return torch.Size([3 * targets.HOG_BINS * cells])
        return torch.Size([self.patch_size**2 * 3])

    def no_weight_decay(self) -> set[str]:
        return super().no_weight_decay() | {"mask_embedding", "decoder.mask_token"}

    # --- the objective, as named stages -------------------------------------------------------------

    def forward(self, images: Tensor) -> Tensor:
        """images: (B, 3, H, W) -> predictions for every patch (B, N, *T) under a fresh random mask."""
        return self.predict(images, None)[0]

    def forward_loss(self, images: Tensor, generator: torch.Generator | None = None) -> MaskedOutput:
        """images: (B, 3, H, W) normalised model inputs."""
        pred, idx, features = self.predict(images, generator)  # (B, N, *T), (B, M), (B, D)
        target = self.make_targets(self.unnormalize(images))  # (B, N, ...)
        pred, target = masking.gather_tokens(pred, idx), masking.gather_tokens(target, idx)
        return self.compare(pred, target, idx)._replace(monitor_features={"student": features.detach()})

    def predict(self, images: Tensor, generator: torch.Generator | None) -> tuple[Tensor, Tensor, Tensor]:
        """Corrupt, encode, predict every patch. Returns (pred (B, N, *T), idx of the loss tokens (B, M),
        the mean of the encoded patch tokens (B, D))."""
        tokens = self.backbone.embed_patches(images)  # (B, N, D)
        batch, device = images.shape[0], images.device
        if self.corruption == "bert":
            c = masking.bert_corruption(
                batch, self.num_patches, self.mask_ratio, generator=generator, device=device
            )
            encoded = self.backbone.encode(masking.apply_bert_corruption(tokens, self.mask_embedding, c))
            return self.head(encoded.patches), c.idx_corrupt, encoded.patches.mean(1)
        idx_keep, idx_mask = self.draw_mask(batch, generator, device)
        if self.corruption == "drop":
            encoded = self.backbone.encode(tokens, idx_keep=idx_keep)
            pred = self.decoder(encoded, idx_keep).unflatten(-1, self.target_shape())
            return pred, idx_mask, encoded.patches.mean(1)
        mask = masking.indices_to_mask(idx_mask, self.num_patches)
        encoded = self.backbone.encode(tokens, mask=mask, mask_token=self.mask_embedding)
        return self.head(encoded.patches), idx_mask, encoded.patches.mean(1)

    def draw_mask(self, batch: int, generator, device) -> tuple[Tensor, Tensor]:
        """(idx_keep (B, K), idx_mask (B, M)) of the configured shape."""
        if self.mask_shape == "random":
            return masking.random_keep(
                batch, self.num_patches, self.mask_ratio, generator=generator, device=device
            )
        if self.mask_shape == "block":
            return masking.block_mask(batch, self.grid, self.mask_ratio, generator=generator, device=device)
        cell = self.cell_size // self.patch_size
        return masking.simmim_mask(
            batch, self.grid, self.mask_ratio, cell, generator=generator, device=device
        )

    def make_targets(self, pixels: Tensor) -> Tensor:
        """pixels: (B, 3, H, W) in [0, 1] -> targets for every patch (B, N[, 16]) classes, (B, N, p*p*3)
        pixels or (B, N, 27 * cells) HOG."""
        if self.target_kind == "color3bit":
            return targets.mean_color_3bit(pixels, self.patch_size)
        if self.target_kind == "color3bit_4x4":
            return targets.mean_color_3bit_4x4(pixels, self.patch_size)
        if self.target_kind == "hog":
            return targets.hog(pixels, self.patch_size)
        return targets.pixel_targets(pixels, self.patch_size, normalize=self.target_kind == "norm_pixels")

    def compare(self, pred: Tensor, target: Tensor, idx: Tensor) -> MaskedOutput:
        """Loss over the masked tokens only: softmax cross-entropy for colour classes (ViT paper), MSE
        (MAE) or L1 (SimMIM) for pixels."""
        if target.dtype == torch.long:
            loss = F.cross_entropy(pred.flatten(0, -2), target.flatten())
            accuracy = (pred.argmax(-1) == target).float().mean()
            return MaskedOutput(loss, pred, target, idx, accuracy)
        loss = F.mse_loss(pred, target) if self.pixel_loss == "mse" else F.l1_loss(pred, target)
        return MaskedOutput(loss, pred, target, idx, None)

    # --- Lightning ------------------------------------------------------------------------------------

    def train_loss(self, batch: dict[str, Tensor]) -> MaskedOutput:
        return self.forward_loss(batch["image"])

    def training_step(self, batch: dict, batch_idx: int) -> dict:
        out = self.train_loss(step_inputs(batch))
        self.log_metrics("train", out, on_step=True)
        return {"loss": out.loss, "output": out, "monitor_features": out.monitor_features}

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self.eval_step("val", batch, batch_idx)

    def test_step(self, batch: dict, batch_idx: int) -> None:
        self.eval_step("test", batch, batch_idx)

    def eval_step(self, stage: str, batch: dict, batch_idx: int) -> None:
        """Masked loss (and accuracy) under a mask fixed by the batch index, drawn from its own generator
        whatever the global RNG state: validation losses of different epochs compare, and two tests of
        one checkpoint on the same shards print the same numbers."""
        generator = torch.Generator().manual_seed(batch_idx)
        self.log_metrics(stage, self.forward_loss(batch["image"], generator), on_step=False)

    def log_metrics(self, stage: str, out: MaskedOutput, on_step: bool) -> None:
        metrics = {f"{stage}/loss": out.loss}
        if out.accuracy is not None:
            metrics[f"{stage}/masked_accuracy"] = out.accuracy
        self.log_dict(
            metrics,
            on_step=on_step,
            on_epoch=not on_step,
            prog_bar=True,
            sync_dist=not on_step,
            batch_size=out.idx.shape[0],
        )

    def on_train_batch_end(self, outputs: dict, batch: dict, batch_idx: int) -> None:
        every = self.picture_every_n_steps
        if every and self.trainer.global_step % every == 0 and self.trainer.is_global_zero:
            log_picture(
                self, "train/predictions", masked_prediction_picture(self, batch["image"], outputs["output"])
            )


def resolve_choices(preset, corruption, target, mask_ratio, mask_shape, pixel_loss) -> dict:
    """Fill unset choices from the preset and check they form a method."""
    if preset is not None and preset not in PRESETS:
        raise BadValue(f"unknown preset {preset!r}; valid: {', '.join(PRESETS)}")
    given = dict(
        corruption=corruption,
        target=target,
        mask_ratio=mask_ratio,
        mask_shape=mask_shape,
        pixel_loss=pixel_loss,
    )
    base = {"mask_shape": "random", "pixel_loss": "mse", **PRESETS.get(preset, {})}
    choices = {key: base.get(key) if value is None else value for key, value in given.items()}
    valid = {"corruption": Corruption, "target": Target, "mask_shape": MaskShape, "pixel_loss": PixelLoss}
    for key, kind in valid.items():
        if choices[key] not in kind.__args__:
            raise BadValue(
                f"{key} must be one of {', '.join(kind.__args__)} (or set a preset), got {choices[key]!r}"
            )
    if choices["mask_ratio"] is None or not 0 < choices["mask_ratio"] < 1:
        raise BadValue(f"mask_ratio must be in (0, 1) (or set a preset), got {choices['mask_ratio']}")
    if choices["corruption"] == "bert" and choices["mask_shape"] != "random":
        raise BadValue("corruption 'bert' draws its own random positions: use mask_shape 'random'")
    return choices
