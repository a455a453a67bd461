"""`--compile.enabled true`: torch.compile of the task, per transformer block or as one training step.

- `scope: blocks` (default): regional compilation (PyTorch's recipe for transformers). The blocks hold
  nearly all the FLOPs and are identical, so one compiled graph serves every block of a stack,
  compiling takes seconds rather than minutes, and the code around them stays eager. Each block's
  backward is its own graph, so DDP's and FSDP's per-bucket communication still overlaps the backward.
- `scope: step`: the task's whole `train_loss` (patch embedding, mask drawing, gathers, encoder,
  decoder, targets and loss) as one graph, forward and backward. Inductor then fuses the element-wise
  work between the blocks too, and with `mode: reduce-overhead` the step runs as CUDA graphs: one
  launch instead of thousands, for steps too short to keep the GPU fed (MAE's encoder sees a quarter
  of the tokens). Compiling takes minutes for a large model. Under DDP, torch's DDPOptimizer splits
  the compiled step at DDP's gradient buckets, so each bucket's all-reduce still starts while the rest
  of the backward runs (under CUDA graphs, each piece is a graph of its own).

Both keep the module and its parameter names, so checkpoints, FSDP sharding (applied after, in the
task's `configure_model`) and `load_backbone` see the same keys as without it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import pytorch_lightning as pl
import torch
from lightning_utilities import apply_to_collection
from pytorch_lightning.utilities import rank_zero_info
from timm.models.vision_transformer import Block
from torch import Tensor, nn

from ssl_vit.errors import UserError
from ssl_vit.tasks.base import BackboneTask

Mode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
Scope = Literal["blocks", "step"]
Backend = Literal["inductor", "aot_eager", "eager"]
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def _options(mode: Mode, backend: Backend) -> dict:
    """torch.compile's arguments: a mode is inductor's, the other backends take none."""
    _check_backend(mode, backend)
    return {"mode": mode} if backend == "inductor" else {"backend": backend}


def _check_backend(mode: Mode, backend: Backend) -> None:
    """The one check that a mode goes with its backend: the CLI's, before anything is built, and every
    caller's in Python."""
    if backend != "inductor" and mode != "default":
        raise UserError(
            f"--compile.mode {mode} is a setting of inductor, not of --compile.backend {backend}: "
            "use --compile.mode default, or --compile.backend inductor"
        )


def compile_blocks(module: nn.Module, mode: Mode = "default", backend: Backend = "inductor") -> int:
    """Compile every timm `Block` inside `module` in place; returns how many."""
    blocks = [m for m in module.modules() if isinstance(m, Block)]
    for block in blocks:
        block.compile(**_options(mode, backend))
    return len(blocks)


def compile_step(task: BackboneTask, mode: Mode = "default", backend: Backend = "inductor") -> bool:
    """Replace `task.train_loss` by its compiled self (one graph for the step's forward and backward);
    False if it is compiled already (a second `fit` or a `test` before it set the task up again)."""
    if "train_loss" in vars(task):
        return False
    task.train_loss = compiled_step(task.train_loss, mode, backend)
    return True


def compiled_step(fn: Callable, mode: Mode = "default", backend: Backend = "inductor") -> Callable:
    """`fn` compiled; under CUDA graphs, each call starts a new step and returns copies of its outputs.

    CUDA graphs replay into the same output memory every step, so an output still referenced after the
    next step (a logged loss Lightning keeps in `callback_metrics`, the pictures' predictions) would
    read the next step's values or fail; copying them costs a few small kernels.
    """
    compiled = torch.compile(fn, **_options(mode, backend))
    if mode not in CUDA_GRAPH_MODES:  # (only inductor takes them: `_options`)
        return compiled

    def step(*args, **kwargs):
        torch.compiler.cudagraph_mark_step_begin()
        return apply_to_collection(compiled(*args, **kwargs), Tensor, torch.clone)

    return step


def check_compile(
    mode: Mode, accumulate_grad_batches: int, strategy: str, backend: Backend = "inductor"
) -> None:
    """Refuse a mode without inductor (the modes are its settings), and CUDA graphs (of the step or
    of the blocks) where they would train wrongly or fail deep inside torch, before anything is built:
    - with gradient accumulation: a backward's replay writes the parameters' gradients into the
      graphs' own memory, and the next micro-batch's replay overwrites them before the optimizer has
      seen the sum (pytorch/pytorch#169545);
    - with FSDP (`strategy`, a strategy's name or class path): its per-block all-gathers and frees
      run in hooks that CUDA graphs cannot capture (pytorch/pytorch#127225).
    """
    _check_backend(mode, backend)
    if mode not in CUDA_GRAPH_MODES:
        return
    if accumulate_grad_batches > 1:
        raise UserError(
            f"--compile.mode {mode} replays CUDA graphs, which cannot accumulate gradients "
            f"(--trainer.accumulate_grad_batches {accumulate_grad_batches}): each micro-batch would "
            "overwrite the last one's; use --compile.mode default or max-autotune-no-cudagraphs"
        )
    name = strategy.rsplit(".", 1)[-1].lower().replace("_", "")
    if name.startswith(("fsdp", "modelparallel")):
        raise UserError(
            f"--compile.mode {mode} replays CUDA graphs, which cannot capture FSDP's sharded "
            f"parameters (--trainer.strategy {strategy}); use --compile.mode default or "
            "max-autotune-no-cudagraphs"
        )


class CompileTask(pl.Callback):
    """Compiles the task before the run starts.

    Args:
        enabled: compile (off by default: compiling costs time at start, pays on long GPU runs).
        mode: torch.compile's mode; `max-autotune` searches kernels longer for a little more speed,
            `reduce-overhead` replays CUDA graphs (with `scope: step`: the whole step).
        scope: `blocks` (every transformer block of the encoder and decoder) or `step` (the task's
            whole training computation as one graph).
        backend: `inductor` (generated kernels), or `eager` (dynamo's graphs on PyTorch's kernels) and
            `aot_eager` (the same after AOTAutograd), which compile in seconds instead of minutes:
            PyTorch's ladder for finding which of the three a compile problem comes from.
    """

    def __init__(
        self,
        enabled: bool = False,
        mode: Mode = "default",
        scope: Scope = "blocks",
        backend: Backend = "inductor",
    ) -> None:
        self.enabled, self.mode, self.scope, self.backend = enabled, mode, scope, backend

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not self.enabled:
            return
        strategy = type(trainer.strategy).__name__
        check_compile(self.mode, trainer.accumulate_grad_batches, strategy, self.backend)
        how = self.mode if self.backend == "inductor" else f"{self.backend} backend"
        if self.scope == "blocks":
            count = compile_blocks(pl_module, self.mode, self.backend)
            rank_zero_info(f"torch.compile ({how}): {count} transformer blocks")
        elif isinstance(pl_module, BackboneTask):
            if compile_step(pl_module, self.mode, self.backend):
                name = type(pl_module).__name__
                rank_zero_info(f"torch.compile ({how}): the whole training step of {name}")
        else:
            raise UserError(
                f"--compile.scope step needs an ssl-vit task, got {type(pl_module).__name__}; "
                "use --compile.scope blocks"
            )
