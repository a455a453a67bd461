"""What every ssl-vit task shares: the backbone under `backbone.` (timm's key names), hyperparameters
that rebuild it, optimizer groups and schedule, lr scaling by global batch, throughput."""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields

import pytorch_lightning as pl
import torch
from lightning_fabric.utilities.throughput import get_available_flops
from pytorch_lightning.cli import OptimizerCallable
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.models.vision_transformer import Block
from torch import Tensor
from torch.utils.flop_counter import FlopCounterMode

from ssl_vit.checkpoints import load_backbone
from ssl_vit.errors import BadValue, UserError
from ssl_vit.internals import CLASS_PATH_KEY, accumulating
from ssl_vit.models.vit import ViTConfig
from ssl_vit.moved import move
from ssl_vit.tasks.optim import SchedulerCallable, WarmupDecay, weight_decay_groups

Bands = tuple[float, ...]
# The checkpoint key of a task's training cost (`BackboneTask.on_save_checkpoint`): optimizer steps,
# images and training FLOPs summed over ranks, and seconds of `fit`, all cumulative over resumes.
COST_KEY = "ssl_vit_cost"
# What a training step computes on; the batch's other entries (sample keys, skip counts) are bookkeeping
# that changes every step and would make a compiled step recompile.
STEP_INPUTS = ("image", "label", "target", "mask")


def step_inputs(batch: dict) -> dict[str, Tensor]:
    """The tensors of `batch` that `BackboneTask.train_loss` reads."""
    return {key: batch[key] for key in STEP_INPUTS if key in batch}


def step_loss(out) -> Tensor:
    """The scalar loss of what any task's `train_loss` returns (the loss, or a named tuple with it)."""
    return out if isinstance(out, Tensor) else out.loss


@dataclass(frozen=True)
class Training:
    """What every task takes besides its own choices (`model.init_args.training`): where its backbone
    starts, how it learns, and the data's input normalisation.

    Args:
        init_from: the backbone's starting weights: a Lightning .ckpt of any ssl-vit task, an exported
            .safetensors, `timm:NAME` or `scratch` (`ssl_vit.checkpoints.load_backbone`; the
            architecture must match `backbone`, position embeddings follow its img_size).
        optimizer: e.g. `torch.optim.AdamW` with its init args (LightningCLI `OptimizerCallable`).
        lr_scheduler: called with (optimizer, total optimizer steps), e.g. `WarmupDecay`.
        lr_reference_batch: when set, the optimizer's lr is per this many images and is scaled by
            global batch / lr_reference_batch (MAE: lr = base_lr x batch / 256).
        mean: the input normalisation of the data, one value per input band (`backbone.in_chans`; the
            fit CLI takes it from the data module), to recover [0, 1] pixels of RGB images for targets
            and pictures; recorded in checkpoints.
        std: as `mean`.
    """

    init_from: str = "scratch"
    optimizer: OptimizerCallable = torch.optim.AdamW
    lr_scheduler: SchedulerCallable = WarmupDecay
    lr_reference_batch: int | None = None
    mean: Bands = IMAGENET_DEFAULT_MEAN
    std: Bands = IMAGENET_DEFAULT_STD


class BackboneTask(pl.LightningModule):
    """Base of the Lightning tasks. Subclasses build their heads; their `forward(images)` is the
    compute of one training step without the loss (what the FLOPs are counted on).

    Args:
        backbone: the ViT to build; stored as plain hyperparameters so any checkpoint rebuilds it.
        training: its starting weights, optimizer, schedule and the data's normalisation (`Training`).
    """

    # Options that were the tasks' own before `training` grouped them (`ssl_vit.cli.moved_options`).
    MOVED_OPTIONS = {field.name: f"training.{field.name}" for field in fields(Training)}

    def __init__(self, backbone: ViTConfig, training: Training, hparams: dict) -> None:
        super().__init__()
        mean, std = training.mean, training.std
        check_band_stats(mean, std, backbone.in_chans)
        self.backbone, backbone = load_backbone(training.init_from, backbone)
        # Plain values only, so checkpoints load with torch.load(weights_only=True); and constructor
        # arguments only, plus the class (LightningCLI's `CLASS_PATH_KEY`), so `ssl-vit validate/test/fit
        # --ckpt_path` can rebuild the task from them. The variant string ("B/16") carries the patch size.
        self.save_hyperparameters(
            {
                CLASS_PATH_KEY: f"{type(self).__module__}.{type(self).__name__}",
                "backbone": asdict(backbone),
                # the callables are code: a resumed run takes them from its config
                "training": {
                    "init_from": training.init_from,
                    "lr_reference_batch": training.lr_reference_batch,
                    "mean": list(mean),
                    "std": list(std),
                },
                **hparams,
            }
        )
        self.optimizer_factory, self.scheduler_factory = training.optimizer, training.lr_scheduler
        self.register_buffer("mean", torch.tensor(mean).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std).view(1, -1, 1, 1), persistent=False)
        self.flops_per_image: int | None = None
        self.cost = {"images": 0, "flops": 0, "seconds": 0.0}  # this run's so far, resumes included
        self._fit_start: float | None = None

    def configure_model(self) -> None:
        """Under Lightning's ModelParallelStrategy: FSDP2 (`fully_shard`), each transformer block of the
        encoder and decoder the unit whose parameters are gathered, used and freed in turn, then the
        rest of the task. Lightning's device mesh is (data_parallel, tensor_parallel), by default
        (nodes, devices per node); both dimensions are used for data: parameters are sharded over the
        second and replicated over the first (HSDP: the all-gathers stay inside a node). A mesh of
        (1, world size) shards over every device."""
        if self.device_mesh is None:
            return
        from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

        for block in self.modules():
            if isinstance(block, Block):
                fully_shard(block, mesh=self.device_mesh)
        fully_shard(self, mesh=self.device_mesh)
        # Lightning calls the steps, not `forward`: they are what gathers the task's own parameters.
        for step in ("training_step", "validation_step", "test_step"):
            register_fsdp_forward_method(self, step)

    def __getstate__(self) -> dict:
        # A compiled step (`compile_step`) is this instance's own attribute, bound to it: a copy or a
        # pickle gets the plain method, or it would train the original's weights.
        state = super().__getstate__()
        state.pop("train_loss", None)
        return state

    def train_loss(self, batch: dict[str, Tensor]):
        """The compute of one training step, loss included, on `step_inputs(batch)`: what
        `--compile.scope step` compiles as one graph, so no logging in here and nothing read on the
        host (either breaks the graph in two)."""
        raise NotImplementedError

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self.eval_step("val", batch, batch_idx)

    def test_step(self, batch: dict, batch_idx: int) -> None:
        self.eval_step("test", batch, batch_idx)

    def eval_step(self, stage: str, batch: dict, batch_idx: int) -> None:
        """Validation (`stage` val) or test of one batch: the task logs its metrics under `{stage}/`."""
        raise NotImplementedError

    def unnormalize(self, images: Tensor) -> Tensor:
        """Model inputs (B, 3, H, W) of RGB data -> pixels in [0, 1]."""
        return (images * self.std + self.mean).clamp(0, 1)

    def no_weight_decay(self) -> set[str]:
        """Parameter names (fnmatch patterns) without weight decay beyond the 1-D ones."""
        return {f"backbone.{name}" for name in self.backbone.no_weight_decay()}

    def global_batch_size(self) -> int:
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is None or not hasattr(datamodule, "batch_size"):
            raise UserError("lr_reference_batch needs a datamodule with a batch_size to scale the lr by")
        return datamodule.batch_size * self.trainer.world_size * self.trainer.accumulate_grad_batches

    def param_groups(self) -> list[dict]:
        """What the optimizer gets: weight-decay groups by default; tasks override it (a probe's heads,
        fine-tuning's layer-decay groups). A group may carry its own `lr` and an `lr_scale`."""
        return weight_decay_groups(self, self.no_weight_decay())

    def configure_optimizers(self):
        """Each group's lr (its own, or the optimizer's) is scaled by global batch / lr_reference_batch
        when set, then by the group's `lr_scale` (timm's layer decay: timm's schedulers apply it, torch's
        and ours do not, so it is applied here once and the schedule multiplies the result)."""
        optimizer = self.optimizer_factory(self.param_groups())
        reference = self.hparams.training["lr_reference_batch"]
        scale = self.global_batch_size() / reference if reference else 1.0
        for group in optimizer.param_groups:
            group["lr"] *= scale * group.get("lr_scale", 1.0)
            group["initial_lr"] = group["lr"]
        scheduler = self.scheduler_factory(optimizer, int(self.trainer.estimated_stepping_batches))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def measure_flops(self, images: Tensor) -> None:
        """Training FLOPs per image (3 x forward: backward costs about twice the forward), counted once
        by torch's FlopCounterMode on a one-image batch of the task's `forward`, for the model-FLOP
        utilisation."""
        # The forward draws masks: on forked RNGs, so that counting (done again by a resumed run) leaves
        # the run's random stream, which exact resume restores, untouched.
        devices = [images.device] if images.device.type == "cuda" else []
        with (
            torch.random.fork_rng(devices=devices),
            torch.no_grad(),
            # Compiled blocks called under a dispatch mode (the counter) on CUDA stopped running
            # compiled for the rest of the process (torch 2.11, H200): counting would undo --compile.
            torch.compiler.set_stance("force_eager"),
            FlopCounterMode(display=False) as counter,
        ):
            self(images[:1])
        self.flops_per_image = 3 * counter.get_total_flops()

    def on_train_start(self) -> None:
        self._fit_start = time.perf_counter()

    def on_train_batch_start(self, batch: dict, batch_idx: int) -> None:
        # Counted as the batch starts, so a batch a NaN guard skips still counts: its compute was spent.
        if self.flops_per_image is None:  # the Throughput callback, when present, measured it already
            self.measure_flops(batch["image"])
        images = batch["image"].shape[0] * self.trainer.world_size
        self.cost["images"] += images
        self.cost["flops"] += images * self.flops_per_image

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        seconds = self.cost["seconds"] + (time.perf_counter() - self._fit_start if self._fit_start else 0.0)
        checkpoint[COST_KEY] = {**self.cost, "seconds": seconds, "steps": checkpoint.get("global_step", 0)}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        # A resumed run keeps counting from the checkpoint's totals (older checkpoints have none).
        saved = checkpoint.get(COST_KEY)
        if saved:
            self.cost = {key: saved[key] for key in self.cost}


def upgraded_hparams(hparams: dict) -> dict:
    """A checkpoint's hyperparameters with the options it holds flat (written before they moved into
    `training`) moved there, as a run's config.yaml has them moved (`ssl_vit.moved`)."""
    hparams = copy.deepcopy(hparams)
    for old, new in BackboneTask.MOVED_OPTIONS.items():
        if old in hparams:
            move(hparams, old, new, "the checkpoint's hyper_parameters")
    return hparams


def check_band_stats(mean: Bands, std: Bands, bands: int) -> None:
    """One line unless `mean` and `std` give one value per input band (std positive)."""
    for name, values in (("mean", mean), ("std", std)):
        if len(values) != bands:
            raise BadValue(
                f"{name} has {len(values)} values and the backbone reads {bands} input bands: give one per "
                "band (the fit CLI takes mean and std from the data module, whose 'auto' reads them from the "
                "manifest)"
            )
    if any(not value > 0 for value in std):
        raise BadValue(f"std {list(std)}: every band's std must be positive")


class Throughput(pl.Callback):
    """Logs images/s (global), tokens/s and model-FLOP utilisation every `log_every_n_steps`.

    Lightning's ThroughputMonitor synchronises the GPU after every step to time it; here the clock is
    read (and the device synchronised) only when a value is logged: a host sync every step would
    stall the GPU's queue. Validation and evaluations run from training hooks (`off_the_clock`, e.g.
    the few-shot monitor) are left out, so the rate is training's own, data loading and checkpoint
    saves included.
    """

    clock = staticmethod(time.perf_counter)

    def __init__(self) -> None:
        self._start: float | None = None
        self._paused: float | None = None
        self._images = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._start is None:
            if pl_module.flops_per_image is None:
                pl_module.measure_flops(batch["image"])
            self._sync(pl_module)
            self._start, self._images = self.clock(), 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._images += batch["image"].shape[0]
        if (trainer.global_step % trainer.log_every_n_steps) or accumulating(trainer):
            return
        self._sync(pl_module)
        now = self.clock()
        per_second = self._images * trainer.world_size / max(now - self._start, 1e-9)
        metrics = {"perf/images_per_s": per_second}
        tokens = getattr(pl_module, "tokens_per_image", None)
        if tokens:
            metrics["perf/tokens_per_s"] = per_second * tokens
        peak = get_available_flops(pl_module.device, _compute_dtype(trainer))
        if peak and pl_module.flops_per_image:
            metrics["perf/mfu"] = per_second * pl_module.flops_per_image / (peak * trainer.world_size)
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, rank_zero_only=True)
        self._start, self._images = now, 0

    def on_validation_start(self, trainer, pl_module) -> None:
        self.pause(pl_module)

    def on_validation_end(self, trainer, pl_module) -> None:
        self.resume(pl_module)

    def pause(self, pl_module) -> None:
        """Stop the clock (a no-op before training's first batch, e.g. in the sanity check)."""
        if self._start is not None and self._paused is None:
            self._sync(pl_module)
            self._paused = self.clock()

    def resume(self, pl_module) -> None:
        if self._paused is not None:
            self._sync(pl_module)
            self._start += self.clock() - self._paused
            self._paused = None

    @staticmethod
    def _sync(pl_module) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)


@contextmanager
def off_the_clock(trainer: pl.Trainer) -> Iterator[None]:
    """Leave the time of this block out of the images/s `Throughput` logs: for work a callback does
    from a training hook that is not training (an evaluation)."""
    clocks = [callback for callback in trainer.callbacks if isinstance(callback, Throughput)]
    for clock in clocks:
        clock.pause(trainer.lightning_module)
    try:
        yield
    finally:
        for clock in clocks:
            clock.resume(trainer.lightning_module)


def _compute_dtype(trainer) -> torch.dtype:
    precision = str(trainer.precision)
    return torch.bfloat16 if "bf16" in precision else torch.float16 if "16" in precision else torch.float32
