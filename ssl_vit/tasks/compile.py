"""`--compile.enabled true`: torch.compile of every transformer block, in place.

Regional compilation (PyTorch's recipe for transformers): the blocks hold nearly all the FLOPs and
are identical, so one compiled graph serves every block of a stack, compiling takes seconds rather
than minutes, and the masking code around them (gathers with data-dependent shapes, host-side
choices) stays eager instead of breaking the graph. `Module.compile` keeps the module and its
parameter names, so checkpoints, FSDP sharding (applied after, in the task's `configure_model`) and
`load_backbone` see the same keys as without it.
"""

from __future__ import annotations

from typing import Literal

import pytorch_lightning as pl
from timm.models.vision_transformer import Block
from torch import nn

Mode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]


def compile_blocks(module: nn.Module, mode: Mode = "default") -> int:
    """Compile every timm `Block` inside `module` in place; returns how many."""
    blocks = [m for m in module.modules() if isinstance(m, Block)]
    for block in blocks:
        block.compile(mode=mode)
    return len(blocks)


class CompileBlocks(pl.Callback):
    """Compiles the task's transformer blocks (backbone and MAE decoder) before the run starts.

    Args:
        enabled: compile (off by default: compiling costs time at start, pays on long GPU runs).
        mode: torch.compile's mode; `max-autotune` searches kernels longer for a little more speed.
    """

    def __init__(self, enabled: bool = False, mode: Mode = "default") -> None:
        self.enabled, self.mode = enabled, mode

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.enabled:
            compile_blocks(pl_module, self.mode)
