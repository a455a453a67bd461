"""Probes on a frozen backbone: one head per candidate of a grid (learning rates, weight decays), all
trained together on the same frozen features, so a whole sweep costs one backbone forward per batch.

The kinds differ in what their heads read and return: `LinearProbe` one pooled feature per image,
`AttentiveProbe` all tokens pooled by learned queries, `LinearSegProbe` every patch token (a class map).

Legend: B batch, T tokens, D width, K classes, H heads (one per candidate).
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode
from torchmetrics.classification import MulticlassAccuracy

from ssl_vit.errors import BadValue, UserError
from ssl_vit.models.vit import LAST_K, ViTConfig
from ssl_vit.tasks.base import BackboneTask, Training, step_inputs


class FrozenProbe(BackboneTask):
    """Heads (`self.heads`, built by the subclass, one per candidate) on a frozen backbone.

    The backbone is loaded from `training.init_from`, frozen (`requires_grad=False`, outside the
    optimizer) and kept in eval mode even while training, so drop path never acts; its features are
    computed without gradients. Head i trains with `lrs[i]` (and `weight_decays[i]` when given; else
    the optimizer's), each head one param group whose gradient is its own loss's (`forward_loss`).

    Subclasses set `self.feature` (the heads' frozen input, `features`), define `classify(features, head)`
    (every head's output, (H, B, ...), or one head's) and `head_loss(outputs (B, ...), targets)`;
    `TARGET` names the batch entry the loss reads (`label`, or `mask` for a segmentation).

    Validation and test log `{val,test}/accuracy_lr{lr}` per head (a segmentation's: of its pixels),
    `/accuracy` (the best head on that pass, as MAE reports its lr sweep), `/best_lr` and `/loss` (the
    heads' mean loss).
    """

    TARGET = "label"
    IGNORED = -1  # the target of what has no class (an unlabelled image): left out of the accuracy
    NEEDS_LABELS = True  # the data module skips and counts unlabelled samples (label -1)

    def __init__(
        self,
        backbone: ViTConfig,
        num_classes: int,
        lrs: list[float],
        weight_decays: list[float] | None,
        training: Training,
        hparams: dict,
    ) -> None:
        lrs = [float(lr) for lr in lrs]
        if not lrs or min(lrs) <= 0:
            raise BadValue(f"lrs must be positive learning rates, got {lrs}")
        if weight_decays is not None and len(weight_decays) != len(lrs):
            raise BadValue(f"weight_decays {weight_decays} must give one per lr of {lrs}")
        if num_classes < 1:
            raise BadValue(f"num_classes must be positive, got {num_classes}")
        super().__init__(backbone, training, hparams=dict(num_classes=num_classes, lrs=lrs, **hparams))
        self.backbone.requires_grad_(False).eval()
        self.lrs = lrs
        self.weight_decays = None if weight_decays is None else [float(wd) for wd in weight_decays]
        self.heads = nn.ModuleList()
        # One per head and evaluation stage, computed and reset at the end of that stage's pass.
        accuracy = partial(MulticlassAccuracy, num_classes, average="micro", ignore_index=self.IGNORED)
        self.val_accuracy = nn.ModuleList(accuracy() for _ in lrs)
        self.test_accuracy = nn.ModuleList(accuracy() for _ in lrs)

    @property
    def num_heads(self) -> int:
        return len(self.heads)

    def train(self, mode: bool = True) -> FrozenProbe:
        """Lightning puts the module in train mode every epoch; the frozen backbone stays in eval mode."""
        super().train(mode)
        self.backbone.eval()
        return self

    @torch.no_grad()
    def features(self, images: Tensor) -> Tensor:
        """images: (B, C, H, W) -> the frozen input of the heads, `self.feature`: (B, D) pooled or (B, T, D)
        per token, no graph."""
        return self.backbone.feature_set(images, (self.feature,), LAST_K)[self.feature]

    def classify(self, features: Tensor, head: int | None = None) -> Tensor:
        raise NotImplementedError

    def chosen(self, head: int | None) -> list[nn.Module]:
        """Every head, or only head `head` (a chosen candidate scoring the test split alone)."""
        return list(self.heads) if head is None else [self.heads[head]]

    def head_loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        """One head's mean loss: cross-entropy over its classes, unlabelled targets (-1) ignored."""
        return F.cross_entropy(outputs, targets, ignore_index=-1)

    def forward(self, images: Tensor) -> Tensor:
        """images: (B, 3, H, W) -> every head's output (H, B, ...)."""
        return self.classify(self.features(images))

    def head_losses(self, outputs: Tensor, targets: Tensor) -> Tensor:
        """Every head's mean loss (H,)."""
        return torch.stack([self.head_loss(out, targets) for out in outputs])

    def forward_loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        """Sum over heads of each head's mean loss, so each head's gradient is its own loss's."""
        return self.head_losses(outputs, targets).sum()

    def train_loss(self, batch: dict[str, Tensor]) -> Tensor:
        return self.forward_loss(self(batch["image"]), batch[self.TARGET])

    def training_step(self, batch: dict, batch_idx: int) -> Tensor:
        if self.TARGET not in batch:
            raise UserError(
                f"the training images carry no {self.TARGET}: give shards written by `ssl-vit data convert` "
                "from ade20k:, voc: or mosaic:"
            )
        loss = self.train_loss(step_inputs(batch))
        size = batch["image"].shape[0]
        self.log("train/loss", loss / self.num_heads, on_step=True, prog_bar=True, batch_size=size)
        return loss

    def eval_step(self, stage: str, batch: dict, batch_idx: int) -> None:
        outputs, targets = self(batch["image"]), batch[self.TARGET]
        for metric, scored in zip(getattr(self, f"{stage}_accuracy"), self.scored(outputs, targets)):
            metric.update(scored, targets)
        loss = self.forward_loss(outputs, targets) / self.num_heads
        self.log(f"{stage}/loss", loss, on_epoch=True, sync_dist=True, batch_size=batch["image"].shape[0])

    def scored(self, outputs: Tensor, targets: Tensor) -> Iterable[Tensor]:
        """Each head's output (H, B, ...) as its accuracy reads it against `targets`."""
        return outputs

    def on_validation_epoch_end(self) -> None:
        self.log_accuracies("val")

    def on_test_epoch_end(self) -> None:
        self.log_accuracies("test")

    def log_accuracies(self, stage: str) -> None:
        """Each head's accuracy over the pass, and the best head's with its lr."""
        # compute() gathers every rank's counts, so each sample counts once across ranks.
        metrics = getattr(self, f"{stage}_accuracy")
        accuracies = torch.stack([metric.compute() for metric in metrics])
        for lr, accuracy, metric in zip(self.lrs, accuracies, metrics):
            self.log(f"{stage}/accuracy_lr{lr:g}", accuracy)
            metric.reset()
        best = accuracies.argmax()
        self.log(f"{stage}/accuracy", accuracies[best], prog_bar=True)
        self.log(f"{stage}/best_lr", torch.tensor(self.lrs, device=accuracies.device)[best])

    def param_groups(self) -> list[dict]:
        """One group per head, with that head's lr (and weight decay); the frozen backbone is in none."""
        decays = self.weight_decays or [None] * len(self.lrs)
        return [
            {"params": list(head.parameters()), "lr": lr, **({} if wd is None else {"weight_decay": wd})}
            for head, lr, wd in zip(self.heads, self.lrs, decays)
        ]

    def measure_flops(self, images: Tensor) -> None:
        """Training FLOPs per image: one forward of the frozen backbone, forward and backward (3x) of the
        heads."""
        training = self.training
        self.eval()  # BatchNorm in train mode would take the one image as a batch and update its statistics
        try:
            with torch.no_grad(), FlopCounterMode(display=False) as backbone:
                features = self.features(images[:1])
            # with gradients: the counter's module tracker hooks the inputs that require grad, and a
            # parameter's view made without them (timm's latent query, expanded) has no grad_fn to hook
            with torch.enable_grad(), FlopCounterMode(display=False) as heads:
                self.classify(features)
        finally:
            self.train(training)
        self.flops_per_image = backbone.get_total_flops() + 3 * heads.get_total_flops()
