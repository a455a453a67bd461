"""Code that runs inside the 2-rank compiled-step test's processes (`cli_helpers.start_ranks`)."""

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch._dynamo.utils import counters
from torch.nn.parallel import DistributedDataParallel

from ssl_vit.models.vit import ViTConfig
from ssl_vit.tasks import SupervisedPretraining
from ssl_vit.tasks.compile import compile_step

# 3.5 MB of fp32 weights: several of DDP's 1 MB gradient buckets.
TINY = ViTConfig("S/8", 32, width=192, depth=2, heads=3)


class Step(nn.Module):
    """What Lightning's DDP wrapper does: the task's training computation as the module's forward."""

    def __init__(self, task: SupervisedPretraining) -> None:
        super().__init__()
        self.task = task

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.task.train_loss(batch)


def batch_of(rank: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(rank)
    return {"image": torch.randn(4, 3, 32, 32, generator=generator), "label": torch.arange(4) + 4 * rank}


def compiled_ddp_gradients(rank: int, world_size: int, port: int, out: str) -> None:
    """One rank: its gradients after a DDP backward through the compiled step, saved to out/rankN.pt."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    task = SupervisedPretraining(TINY, num_classes=10)
    compile_step(task, backend="aot_eager")  # DDPOptimizer splits what dynamo captures, for any backend
    # Buckets of 1 MB (the default is 25): this small model's gradients in several all-reduces, as a
    # real model's are; DDPOptimizer compiles one graph per bucket so each starts while the rest runs.
    ddp = DistributedDataParallel(Step(task), bucket_cap_mb=1)
    ddp(batch_of(rank)).backward()
    grads = {name: p.grad for name, p in task.named_parameters() if p.grad is not None}
    graphs = counters["aot_autograd"]["total"]  # DDPOptimizer splits the one graph dynamo captures
    torch.save({"grads": grads, "compiled_graphs": graphs}, Path(out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
