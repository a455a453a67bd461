"""Masked patch prediction: the ViT paper's MPP (sec 4.6), MAE, SimMIM and MaskFeat as independent choices
of corruption, target and mask, so each can be swapped alone; I-JEPA and data2vec 2.0 are the same matrix
with an EMA teacher's features as the target (`ssl_vit.tasks.teacher`).

Legend: B batch, N patches, M tokens the loss is on, D width, T the target's shape per patch.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from ssl_vit import masking
from ssl_vit.checkpoints import load_mae_decoder
from ssl_vit.errors import BadValue
from ssl_vit.models.heads import HeadInit, MAEDecoder, PatchHead
from ssl_vit.models.init import mae_init
from ssl_vit.models.vit import ViTConfig
from ssl_vit.presets import PRESETS
from ssl_vit.targets import TARGETS, TargetContext
from ssl_vit.targets.masked_picture import masked_prediction_picture
from ssl_vit.targets.target import check_made, checked_shape
from ssl_vit.targets.teacher_target import TeacherFeatures, teacher_targets
from ssl_vit.tasks.base import BackboneTask, Training, step_inputs
from ssl_vit.tasks.teacher import MomentumSchedule, ema_update, make_teacher, momentum_at
from ssl_vit.tracking import log_picture

Corruption = Literal["bert", "drop", "mask_token"]
# Registries a plugin may add to after this module is imported (`Registry.choice`).
PresetName = PRESETS.choice("PresetName")
TargetName = TARGETS.choice("TargetName")
MaskShape = Literal["random", "block", "cells", "jepa"]
PixelLoss = Literal["mse", "l1", "smooth_l1"]
EncoderInit = Literal["timm", "mae"]

# Choices left unset by the arguments and the preset.
DEFAULTS: dict = dict(
    mask_shape="random",
    pixel_loss="mse",
    teacher_features="final_norm",
    teacher_top_k=1,
    views=1,
    ema_momentum=0.996,
    ema_momentum_end=1.0,
    ema_schedule="cosine",
    encoder_init="timm",
    head_init="xavier",
)
PIXEL_LOSSES = {"mse": F.mse_loss, "l1": F.l1_loss, "smooth_l1": F.smooth_l1_loss}


class MaskedOutput(NamedTuple):
    loss: Tensor
    pred: Tensor  # (B, M, *T) predictions at the loss positions
    target: Tensor  # (B, M, *T) or (B, M[, 16]) class ids
    idx: Tensor  # (B, M) positions of the loss tokens
    accuracy: Tensor | None  # colour targets only
    # What `ssl_vit.run.health` watches (`student`; with a teacher, `teacher` and `target`): it says what.
    monitor_features: dict[str, Tensor] | None = None
    teacher: Tensor | None = None  # (B, D) the teacher's targets pooled over every patch; teacher only


class MaskedPatchPretraining(BackboneTask):
    """Self-supervised pretraining by masked patch prediction.

    Args:
        preset: a registered preset's name (`ssl_vit.presets`: one module per published method, or a
            plugin's; a name not registered is refused with the valid ones); fills every choice below
            left unset.
        corruption: `bert` replaces patch embeddings (80% [mask], 10% another patch, 10% kept) and runs
            the full sequence; `drop` runs only kept tokens and an MAE decoder fills the rest;
            `mask_token` puts a learned token in the encoder (SimMIM).
        target: what is predicted at each masked patch: a registered target's name
            (`ssl_vit.targets`, or a plugin's), whose module says what it is (3-bit mean colours,
            raw or normalised pixels, HOG, an EMA teacher's features, ...) and which band counts it
            takes (`ssl_vit.targets.target`).
        mask_ratio: fraction of patches corrupted/masked; the loss is on those only.
        mask_shape: `random`, `block` (BEiT), `cells` (SimMIM: aligned squares of `cell_size` pixels) or
            `jepa` (I-JEPA: four target blocks, the encoder sees a context block less them; `drop` only).
        pixel_loss: `mse`, `l1` or `smooth_l1` for pixel, HOG and teacher targets.
        encoder_init: how a `scratch` encoder starts: `timm` (timm's truncated normals, learned position
            embeddings) or `mae` (MAE's: xavier-uniform linears, fixed 2-D sin-cos position embeddings
            that are not trained; `ssl_vit.models.init`). From a checkpoint (`training.init_from`) the encoder
            starts from its weights either way; `mae` still keeps the position embeddings fixed.
        head_init: how the linear head of `bert` and `mask_token` starts (`PatchHead`): `xavier`
            (xavier-uniform, zero bias) or `torch` (PyTorch's start of a linear layer, as SimMIM's code
            leaves its 1x1 convolution: the `simmim` preset's choice).
        decoder_dim, decoder_depth, decoder_heads: the MAE decoder (`drop` only), I-JEPA's predictor.
        teacher_features: what the teacher gives (`ssl_vit.targets.teacher_target.teacher_targets`):
            `final_norm` (I-JEPA) or `top_k_mean` of its top `teacher_top_k` blocks (data2vec).
        views: masked views of each image per step (data2vec 2.0's `clone_batch`); the targets are
            computed once per image, the student runs on every view.
        ema_momentum, ema_momentum_end, ema_schedule: the teacher's EMA momentum, from the first to the
            second over `ema_anneal_steps` optimizer steps (unset: the whole run), cosine or linear.
        picture_every_n_steps: log reconstructions / predicted colours to the logger this often (0: never;
            a target without a picture, an EMA teacher's latents, has none).
        display_bands: the three bands (0-based) drawn as red, green and blue in the pictures of images of
            C != 3 bands, each stretched between its 2nd and 98th percentile; unset: the first three
            (`ssl_vit.targets.masked_picture.false_colour`). RGB images are drawn as they are.
        training: see `Training`; `training.init_from` continues pretraining from a checkpoint, and a
            facebookresearch/mae one starts the decoder (`drop`) from its own as well.
    """

    def __init__(
        self,
        backbone: ViTConfig,
        preset: PresetName | None = None,
        corruption: Corruption | None = None,
        target: TargetName | None = None,
        mask_ratio: float | None = None,
        mask_shape: MaskShape | None = None,
        cell_size: int = 32,
        pixel_loss: PixelLoss | None = None,
        encoder_init: EncoderInit | None = None,
        head_init: HeadInit | None = None,
        decoder_dim: int = 512,
        decoder_depth: int = 8,
        decoder_heads: int = 16,
        teacher_features: TeacherFeatures | None = None,
        teacher_top_k: int | None = None,
        views: int | None = None,
        ema_momentum: float | None = None,
        ema_momentum_end: float | None = None,
        ema_schedule: MomentumSchedule | None = None,
        ema_anneal_steps: int | None = None,
        picture_every_n_steps: int = 500,
        display_bands: tuple[int, int, int] | None = None,
        training: Training = Training(),
    ) -> None:
        choices = resolve_choices(
            preset, corruption, target, mask_ratio, mask_shape, pixel_loss,
            teacher_features=teacher_features, teacher_top_k=teacher_top_k, views=views,
            ema_momentum=ema_momentum, ema_momentum_end=ema_momentum_end, ema_schedule=ema_schedule,
            encoder_init=encoder_init, head_init=head_init,
        )  # fmt: skip
        check_target_bands(choices["target"], preset, backbone.in_chans)
        super().__init__(
            backbone,
            training,
            hparams=dict(
                preset=preset,
                **choices,
                cell_size=cell_size,
                display_bands=display_bands,
                decoder_dim=decoder_dim,
                decoder_depth=decoder_depth,
                decoder_heads=decoder_heads,
                ema_anneal_steps=ema_anneal_steps,
            ),
        )
        if choices["encoder_init"] == "mae":
            if training.init_from == "scratch":
                mae_init(self.backbone)
            self.backbone.pos_embed.requires_grad_(False)
        self.corruption, self.target_kind = choices["corruption"], choices["target"]
        self.target = TARGETS[self.target_kind]()
        self.mask_ratio, self.mask_shape = choices["mask_ratio"], choices["mask_shape"]
        self.pixel_loss = choices["pixel_loss"]
        self.picture_every_n_steps = picture_every_n_steps if self.target.picture is not None else 0
        self.bands = self.backbone.in_chans
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
        width = self.backbone.embed_dim
        shown = check_display_bands(display_bands, self.bands)
        self.context = TargetContext(self.patch_size, self.grid, self.bands, width, shown, self.target_images)
        self.target_shape = checked_shape(self.target, self.target.shape(self.context))  # T
        if self.corruption == "drop":
            self.decoder = MAEDecoder(
                width, self.grid, self.target_shape.numel(), decoder_dim, decoder_depth, decoder_heads
            )
            load_mae_decoder(self.decoder, training.init_from)  # an MAE checkpoint's decoder continues too
        else:
            self.head = PatchHead(width, tuple(self.target_shape), choices["head_init"])
            self.mask_embedding = nn.Parameter(torch.zeros(width))
            nn.init.normal_(self.mask_embedding, std=0.02)
        self.views = choices["views"]
        self.teacher = self.build_teacher(choices, ema_anneal_steps)
        if self.teacher is not None:
            features, top_k = choices["teacher_features"], choices["teacher_top_k"]
            latents = partial(teacher_targets, self.teacher, features=features, top_k=top_k)
            self.context = replace(self.context, latents=latents)
        if self.mask_shape == "jepa":
            self.tokens_per_image = None  # the context's size is drawn with each batch
        else:
            kept = self.num_patches - round(self.mask_ratio * self.num_patches)
            encoded = kept if self.corruption == "drop" else self.num_patches
            self.tokens_per_image = (1 + encoded) * self.views

    def build_teacher(self, choices: dict, anneal_steps: int | None) -> nn.Module | None:
        """The EMA teacher of a target it makes (None otherwise), starting as a copy of the backbone."""
        if not self.target.TEACHER:
            return None
        depth = len(self.backbone.blocks)
        if choices["teacher_features"] == "top_k_mean" and choices["teacher_top_k"] > depth:
            raise BadValue(
                f"teacher_top_k {choices['teacher_top_k']} is more blocks than the backbone's {depth}: "
                f"give at most {depth}"
            )
        self.ema = (choices["ema_momentum"], choices["ema_momentum_end"], choices["ema_schedule"])
        self.ema_anneal_steps = anneal_steps
        return make_teacher(self.backbone, ViTConfig(**self.hparams.backbone))

    def no_weight_decay(self) -> set[str]:
        return super().no_weight_decay() | {"mask_embedding", "decoder.mask_token"}

    # --- the objective, as named stages -------------------------------------------------------------

    def forward(self, images: Tensor) -> Tensor:
        """images: (B, C, H, W) -> predictions at the masked tokens (V*B, M, *T) under fresh random masks,
        `views` per image: the student's compute of a step."""
        return self.predict_masked(images, None)[0]

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        # A run begun before `encoder_init` was a choice trained its position embeddings: it resumes as it
        # began (before the optimizer is built, so its saved state matches the parameters again).
        if "encoder_init" not in checkpoint.get("hyper_parameters", {}):
            self.backbone.pos_embed.requires_grad_(True)

    def forward_loss(self, images: Tensor, generator: torch.Generator | None = None) -> MaskedOutput:
        """images: (B, C, H, W) normalised model inputs, each seen under `views` masks (see `views`)."""
        pred, idx, features = self.predict_masked(images, generator)  # (V*B, M, *T), (V*B, M), (V*B, D)
        target = self.target.make(self.context, images)  # (B, N, ...)
        check_made(self.target, target, len(images), self.num_patches, self.target_shape)
        out = self.compare(pred, masking.gather_tokens(self.repeat_views(target), idx), idx)
        monitor = {"student": features.detach()}
        if self.teacher is None:
            return out._replace(monitor_features=monitor)
        monitor.update(teacher=target.mean(1).detach(), target=out.target.detach())
        return out._replace(teacher=target.mean(1), monitor_features=monitor)

    def repeat_views(self, x: Tensor) -> Tensor:
        """(B, ...) -> (V*B, ...), view-major, as `predict_masked` repeats the images."""
        return x.repeat(self.views, *[1] * (x.dim() - 1)) if self.views > 1 else x

    def predict_masked(
        self, images: Tensor, generator: torch.Generator | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Each image under `views` masks -> (predictions at the loss tokens (V*B, M, *T), idx (V*B, M),
        the mean of the encoded patch tokens (V*B, D))."""
        images = self.repeat_views(images)
        if self.mask_shape == "jepa":
            return self.predict_blocks(images, generator)
        pred, idx, features = self.predict(images, generator)
        return masking.gather_tokens(pred, idx), idx, features

    def predict_blocks(
        self, images: Tensor, generator: torch.Generator | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """I-JEPA (sec 3): the encoder sees the context block only, the predictor each target block
        (`MAEDecoder.predict_at`). Returns (pred (B, T*M, *T), idx (B, T*M), the mean of the encoded
        context tokens (B, D)), block after block: a token two blocks share is predicted, and counted,
        twice, as in the paper."""
        batch = images.shape[0]
        mask = masking.jepa_blocks(batch, self.grid, generator=generator, device=images.device)
        encoded = self.backbone.encode(self.backbone.embed_patches(images), idx_keep=mask.idx_context)
        pred = self.decoder.predict_at(encoded, mask.idx_context, mask.idx_targets)  # (B, T, M, D)
        pred = pred.flatten(1, 2)  # (B, T*M, D), block after block
        return pred.unflatten(-1, self.target_shape), mask.idx_targets.flatten(1), encoded.patches.mean(1)

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
            pred = self.decoder(encoded, idx_keep).unflatten(-1, self.target_shape)
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

    def target_images(self, images: Tensor) -> Tensor:
        """Model inputs (B, C, H, W) -> what the targets are made of (`ssl_vit.targets.target`)."""
        return self.unnormalize(images) if self.bands == 3 else images

    def compare(self, pred: Tensor, target: Tensor, idx: Tensor) -> MaskedOutput:
        """Loss over the masked tokens only: softmax cross-entropy for colour classes (ViT paper), MSE
        (MAE, data2vec 2.0), L1 (SimMIM) or smooth L1 (I-JEPA) for pixels and latents."""
        if target.dtype == torch.long:
            loss = F.cross_entropy(pred.flatten(0, -2), target.flatten())
            accuracy = (pred.argmax(-1) == target).float().mean()
            return MaskedOutput(loss, pred, target, idx, accuracy)
        loss = PIXEL_LOSSES[self.pixel_loss](pred, target)
        return MaskedOutput(loss, pred, target, idx, None)

    # --- Lightning ------------------------------------------------------------------------------------

    def train_loss(self, batch: dict[str, Tensor]) -> MaskedOutput:
        return self.forward_loss(batch["image"])

    def training_step(self, batch: dict, batch_idx: int) -> dict:
        out = self.train_loss(step_inputs(batch))
        self.log_metrics("train", out, on_step=True)
        return {"loss": out.loss, "output": out, "monitor_features": out.monitor_features}

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer, optimizer_closure=None) -> None:
        """The optimizer's step, then the teacher's EMA step towards the updated student: once per
        optimizer step, whatever the gradient accumulation (I-JEPA updates it after `optimizer.step()`;
        no collective of its own: `ssl_vit.tasks.teacher`)."""
        step = self.trainer.global_step
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        if self.teacher is not None:
            ema_update(self.teacher, self.backbone, self.ema_momentum(step))

    def ema_momentum(self, step: int) -> float:
        """The teacher's EMA momentum after optimizer step `step` (0-based)."""
        total = self.ema_anneal_steps or int(self.trainer.estimated_stepping_batches)
        return momentum_at(step, total, *self.ema)

    def measure_flops(self, images: Tensor) -> None:
        """`BackboneTask.measure_flops` of the student (3 x its forward, every view), plus the teacher's
        forward once: it has no backward."""
        super().measure_flops(images)
        if self.teacher is None:
            return
        # Eager, as the student's count is (compiled blocks under a dispatch mode stop running compiled).
        with torch.compiler.set_stance("force_eager"), FlopCounterMode(display=False) as counter:
            self.context.latents(images[:1])
        self.flops_per_image += counter.get_total_flops()

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
        # (no `output`: a loss-spike rollback has voided the step)
        if (
            every
            and "output" in outputs
            and self.trainer.global_step % every == 0
            and self.trainer.is_global_zero
        ):
            picture = masked_prediction_picture(self.target, self.context, batch["image"], outputs["output"])
            log_picture(self, "train/predictions", picture)


def check_target_bands(target: str, preset: str | None, bands: int) -> None:
    """One line for a target that does not take the backbone's band count (the colour targets quantise 3
    RGB bands), naming the targets and presets that do."""
    chosen = TARGETS[target]
    if chosen.accepts(bands):
        return
    working = [name for name, other in TARGETS.items() if other.accepts(bands)]
    presets = [name for name, chosen in PRESETS.items() if chosen.choices.get("target") in working]
    given = f"preset {preset!r}'s target" if preset else "target"
    why = chosen.REFUSES or f"takes images of {chosen.BANDS} bands only"
    raise BadValue(
        f"{given} {target!r} {why}, and the data has {bands}: use target {', '.join(working)} "
        f"(presets {', '.join(presets)})"
    )


def check_display_bands(display_bands: tuple[int, ...] | None, bands: int) -> tuple[int, int, int]:
    """The three bands pictures draw as red, green and blue: `display_bands`, checked, or the first three
    (the one or two there are, repeated, for fewer)."""
    if display_bands is None:
        return tuple(min(i, bands - 1) for i in range(3))
    if len(display_bands) != 3 or not all(0 <= band < bands for band in display_bands):
        raise BadValue(
            f"display_bands {list(display_bands)}: give three band indices in [0, {bands - 1}] (red, green, "
            "blue of the pictures)"
        )
    return tuple(display_bands)


def resolve_choices(preset, corruption, target, mask_ratio, mask_shape, pixel_loss, **others) -> dict:
    """Fill unset choices from the preset (then `DEFAULTS`) and check they form a method; `others`: the
    EMA teacher's choices (`teacher_features`, `teacher_top_k`, `views`, `ema_*`), `encoder_init` and
    `head_init`."""
    given = dict(
        corruption=corruption,
        target=target,
        mask_ratio=mask_ratio,
        mask_shape=mask_shape,
        pixel_loss=pixel_loss,
        **others,
    )
    chosen = PRESETS.pick(preset).choices if preset is not None else {}
    base = {**DEFAULTS, **chosen}
    unknown = [key for key in base if key not in given]
    if unknown:  # a plugin's preset, written for another version
        raise BadValue(
            f"preset {preset!r} sets {', '.join(unknown)}, which MaskedPatchPretraining does not take: a "
            f"preset sets {', '.join(given)}"
        )
    choices = {key: base.get(key) if value is None else value for key, value in given.items()}
    valid = {"corruption": Corruption.__args__, "target": tuple(TARGETS), "mask_shape": MaskShape.__args__}
    valid.update(pixel_loss=PixelLoss.__args__, teacher_features=TeacherFeatures.__args__)
    valid.update(ema_schedule=MomentumSchedule.__args__, encoder_init=EncoderInit.__args__)
    valid.update(head_init=HeadInit.__args__)
    for key, names in valid.items():
        if choices[key] not in names:
            by = f"set by preset {preset!r}" if given[key] is None and key in chosen else "or set a preset"
            raise BadValue(f"{key} must be one of {', '.join(names)} ({by}), got {choices[key]!r}")
    jepa = choices["mask_shape"] == "jepa"  # its blocks set how much is masked
    if not jepa and (choices["mask_ratio"] is None or not 0 < choices["mask_ratio"] < 1):
        raise BadValue(f"mask_ratio must be in (0, 1) (or set a preset), got {choices['mask_ratio']}")
    if jepa and choices["corruption"] != "drop":
        raise BadValue("mask_shape 'jepa' feeds the encoder the context block only: use corruption 'drop'")
    for key in ("teacher_top_k", "views"):
        if choices[key] < 1:
            raise BadValue(f"{key} must be at least 1, got {choices[key]}")
    for key in ("ema_momentum", "ema_momentum_end"):
        if not 0 <= choices[key] <= 1:
            raise BadValue(f"{key} must be in [0, 1], got {choices[key]}")
    if choices["corruption"] == "bert" and choices["mask_shape"] != "random":
        raise BadValue("corruption 'bert' draws its own random positions: use mask_shape 'random'")
    return choices
