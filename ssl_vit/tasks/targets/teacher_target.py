"""`target: teacher`: the features of the uncorrupted image from an EMA copy of the backbone (I-JEPA,
data2vec 2.0; `ssl_vit.tasks.teacher`), D values per patch, any band count. The task keeps the teacher
(in checkpoints under `teacher.`); latents have no picture."""

from __future__ import annotations

import torch
from torch import Tensor

from ssl_vit.tasks.target import Target, register
from ssl_vit.tasks.teacher import teacher_targets


@register
class TeacherFeatures(Target):
    NAME = "teacher"
    TEACHER = True

    def shape(self, task) -> torch.Size:
        return torch.Size([task.backbone.embed_dim])

    def make(self, task, images: Tensor) -> Tensor:
        return teacher_targets(task.teacher, images, task.teacher_features, task.teacher_top_k)  # (B, N, D)
