"""What a loss-spike rollback (`nonfinite.policy: rollback`) costs, side by side in one process:

1. `restore`: the learner of MAE ViT-B/16 (encoder, 8 x 512 decoder, AdamW with its moments) put back
   from the checkpoint file, as the rollback does (checksums verified, `torch.load`, `load_state_dict` of
   the model and the optimizer), against from a copy kept in memory, which every save would have to
   make (a copy of the weights and moments) and every process to hold.
2. `guard`: the non-finite guard's own work per optimizer step at B/16 (its hooks on the B/16 gradients:
   the gradient norm, the reduction, the host read, the running median), for `stop`, `skip` and
   `rollback`, interleaved.
3. `loop`: whole fits of `ssl-vit bench loop`'s small MAE on synthetic shards, with each policy in turn,
   interleaved in this process: seconds per step.

    .venv/bin/python benchmarks/rollback.py [--variant B/16] [--repeats 3] [--steps 200]

Everything is written in a temporary directory, removed at the end.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytorch_lightning as pl
import torch

from ssl_vit.benchmark.loop import BACKBONE, MAE, TRAIN_IMAGES, StepClock
from ssl_vit.checkpoints.store import SafeCheckpointIO
from ssl_vit.data import ShardDataModule
from ssl_vit.models.vit import ViTConfig
from ssl_vit.run.last_link import LastLinkCheckpoint
from ssl_vit.run.nonfinite import NonFiniteGuard
from ssl_vit.tasks import MaskedPatchPretraining
from ssl_vit.tasks.optim import weight_decay_groups

POLICIES = ("stop", "skip", "rollback")


def b16_learner(variant: str) -> tuple[MaskedPatchPretraining, torch.optim.Optimizer]:
    """MAE at `variant`, 224 px, after one AdamW step on two random images: its moments exist."""
    torch.manual_seed(0)
    task = MaskedPatchPretraining(ViTConfig(variant=variant, img_size=224), preset="mae")
    optimizer = torch.optim.AdamW(weight_decay_groups(task, task.no_weight_decay()), lr=1e-4)
    task.forward_loss(torch.randn(2, 3, 224, 224)).loss.backward()
    optimizer.step()
    return task, optimizer


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def restore_costs(variant: str, repeats: int, tmp: Path) -> dict:
    task, optimizer = b16_learner(variant)
    checkpoint = {"state_dict": task.state_dict(), "optimizer_states": [optimizer.state_dict()]}
    io, path = SafeCheckpointIO(), tmp / "learner.ckpt"
    rows: dict[str, list[float]] = {"save": [], "file_restore": [], "memory_copy": [], "memory_restore": []}
    for _ in range(repeats):
        rows["save"].append(timed(lambda: io.save_checkpoint(checkpoint, path)))

        def from_file():
            loaded = io.load_checkpoint(path)  # CRC-32 of every record, then torch.load
            task.load_state_dict(loaded["state_dict"])
            optimizer.load_state_dict(loaded["optimizer_states"][0])

        rows["file_restore"].append(timed(from_file))
        kept = {}

        def copy_at_save(kept=kept):  # what an in-memory anchor costs at every save
            kept["state_dict"] = {k: v.detach().to("cpu", copy=True) for k, v in task.state_dict().items()}
            kept["optimizer"] = copy.deepcopy(optimizer.state_dict())

        rows["memory_copy"].append(timed(copy_at_save))

        def from_memory(kept=kept):
            task.load_state_dict(kept["state_dict"])
            optimizer.load_state_dict(kept["optimizer"])

        rows["memory_restore"].append(timed(from_memory))
    held = sum(t.numel() * t.element_size() for t in kept["state_dict"].values())
    held += sum(
        t.numel() * t.element_size()
        for state in kept["optimizer"]["state"].values()
        for t in state.values()
        if isinstance(t, torch.Tensor)
    )
    return {
        "file_bytes": path.stat().st_size,
        "memory_bytes": held,
        **{k: statistics.median(v) for k, v in rows.items()},
    }


def guard_costs(variant: str, repeats: int, steps: int) -> dict:
    """Seconds per step of the guard's hooks on `variant`'s gradients, each policy, interleaved."""
    task, optimizer = b16_learner(variant)
    for p in task.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    strategy = SimpleNamespace(
        reduce=lambda tensor, reduce_op: tensor, reduce_boolean_decision=lambda decision, all: decision
    )
    trainer = SimpleNamespace(
        precision="32-true", global_step=0, strategy=strategy, log_every_n_steps=50, is_global_zero=True,
        fit_loop=SimpleNamespace(_should_accumulate=lambda: False), loggers=[],
    )  # fmt: skip
    loss = torch.tensor(1.0)
    rows: dict[str, list[float]] = {policy: [] for policy in POLICIES}
    for _ in range(repeats):
        for policy in POLICIES:
            guard = NonFiniteGuard(policy=policy)

            def run(guard=guard, policy=policy):
                for step in range(steps):
                    trainer.global_step = step
                    guard.on_before_backward(trainer, task, loss)
                    guard.on_before_optimizer_step(trainer, task, optimizer)
                    if policy != "stop":  # stop reads its flag every log_every_n_steps only
                        guard.on_train_batch_end(trainer, task, {}, None, step)

            rows[policy].append(timed(run) / steps)
    return {policy: statistics.median(values) for policy, values in rows.items()}


def loop_costs(repeats: int, steps: int, tmp: Path) -> dict:
    """Seconds per step of whole fits of bench loop's MAE, each policy, interleaved in this process."""
    shards = tmp / "shards"
    subprocess.run(
        [sys.executable, "-m", "ssl_vit", "data", "convert", f"synthetic:{TRAIN_IMAGES}", str(shards),
         "--split", "train", "--shard-size", str(TRAIN_IMAGES // 2), "--no-progress"],
        check=True, capture_output=True,
    )  # fmt: skip
    rows: dict[str, list[float]] = {policy: [] for policy in POLICIES}
    for repeat in range(repeats):
        for policy in POLICIES:
            run = tmp / f"{policy}-{repeat}"
            clock = run / "clock.json"
            run.mkdir()
            data = ShardDataModule(
                train_urls=str(shards / "train-{000000..000001}.tar"), image_size=BACKBONE["img_size"],
                batch_size=32, num_workers=1,
            )  # fmt: skip
            backbone = ViTConfig(**BACKBONE)
            task = MaskedPatchPretraining(backbone, **MAE)
            trainer = pl.Trainer(
                accelerator="cpu", max_steps=steps, logger=False, enable_progress_bar=False,
                enable_model_summary=False, default_root_dir=run, limit_val_batches=0,
                callbacks=[
                    NonFiniteGuard(policy=policy), StepClock(str(clock)),
                    LastLinkCheckpoint(dirpath=run / "checkpoints", every_n_train_steps=10_000),
                ],
            )  # fmt: skip
            trainer.fit(task, datamodule=data)
            rows[policy].append(json.loads(clock.read_text())["loop_s"] / steps)
    return {policy: statistics.median(values) for policy, values in rows.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", default="B/16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200, help="steps of each `loop` fit (default 200)")
    parser.add_argument("--parts", default="restore,guard,loop")
    args = parser.parse_args()
    parts = args.parts.split(",")
    report = {"variant": args.variant, "threads": torch.get_num_threads()}
    with tempfile.TemporaryDirectory(prefix="ssl-vit-rollback-") as tmp:
        if "restore" in parts:
            report["restore"] = restore_costs(args.variant, args.repeats, Path(tmp))
        if "guard" in parts:
            report["guard_s_per_step"] = guard_costs(args.variant, args.repeats, steps=20)
        if "loop" in parts:
            report["loop_s_per_step"] = loop_costs(args.repeats, args.steps, Path(tmp))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
