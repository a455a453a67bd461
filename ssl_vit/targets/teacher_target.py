"""`target: teacher`: the features of the uncorrupted image from an EMA copy of the backbone (I-JEPA,
data2vec 2.0), D values per patch, any band count: `TargetContext.latents`, `teacher_targets` of the
task's choices, which keeps the teacher (in checkpoints under `teacher.`). Latents have no picture."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from ssl_vit.models.vit import ViT
from ssl_vit.targets.target import Target, TargetContext, register

TeacherFeatures = Literal["final_norm", "top_k_mean"]


@torch.no_grad()
def teacher_targets(teacher: ViT, images: Tensor, features: TeacherFeatures, top_k: int) -> Tensor:
    """images: (B, C, H, W) uncorrupted model inputs -> regression targets for every patch (B, N, D).

    - `final_norm` (I-JEPA, sec 3 "Targets"): the last block's output after the encoder's final norm,
      then a LayerNorm without affine parameters, as the paper's `forward_target` applies.
    - `top_k_mean` (data2vec, Baevski et al. 2022 sec 3.3; data2vec 2.0's image config): the outputs
      of the top `top_k` blocks, each instance-normalised (per channel over the patches), averaged and
      layer-normalised (`instance_norm_target_layer`, `layer_norm_targets`). The block outputs are
      timm's `forward_intermediates`; data2vec reads the FFN output before the last residual instead.
    """
    if features == "final_norm":
        patches = teacher.forward_tokens(images).patches.float()
        return F.layer_norm(patches, patches.shape[-1:])
    blocks = teacher.forward_intermediates(
        images, indices=top_k, output_fmt="NLC", intermediates_only=True
    )  # top_k x (B, N, D), patch tokens only
    normed = [F.instance_norm(x.float().transpose(1, 2)).transpose(1, 2) for x in blocks]
    average = torch.stack(normed).mean(0)
    return F.layer_norm(average, average.shape[-1:])


@register
class TeacherLatents(Target):
    NAME = "teacher"
    TEACHER = True

    def shape(self, ctx: TargetContext) -> torch.Size:
        return torch.Size([ctx.width])

    def make(self, ctx: TargetContext, images: Tensor) -> Tensor:
        return ctx.latents(images)  # (B, N, D)
