"""`ssl-vit bench loop`: what the whole training loop costs on top of the model's own work.

A real `ssl-vit fit` (its own process, as users run it) of MAE on a small ViT for N steps, on
synthetic shards written by `ssl-vit data convert`: streaming and decoding in a DataLoader worker,
validation every epoch, a checkpoint every 250 steps, the offline W&B logger, the throughput and
non-finite callbacks. Against it, in this process, a bare PyTorch loop of the same task on one batch
held in memory: `forward_loss`, `backward`, AdamW. The fit is timed from its first training batch to
its end (`StepClock`), so the ratio is the loop's overhead, not the interpreter's start-up, which is
reported on its own.

Both sides compute on `threads` torch threads, by default every core but the one the fit's DataLoader
worker decodes on: as on a GPU node, where the loader has cores of its own. With the model's threads
on every core, the worker's decoding would take turns with them, and the ratio would measure the
machine's shortage of cores rather than the loop.

Everything is written in a temporary directory, deleted at the end, also when the command is stopped
(SIGTERM, Ctrl-C).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytorch_lightning as pl
import torch

from ssl_vit.models.vit import ViTConfig
from ssl_vit.tasks import MaskedPatchPretraining

# A small ViT on 32-pixel images (the synthetic set's size): Ti's width at depth 6, 4x4 patches.
BACKBONE = {"variant": "Ti/4", "img_size": 32, "depth": 6}
MAE = {"preset": "mae", "decoder_dim": 96, "decoder_depth": 2, "decoder_heads": 3, "picture_every_n_steps": 0}
TRAIN_IMAGES, VAL_IMAGES = 2000, 200


class StepClock(pl.Callback):
    """Writes to `path` the seconds from the first training batch's start to the end of training, the
    steps, and the torch threads the fit computed on."""

    def __init__(self, path: str) -> None:
        self.path, self.first = path, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.first is None:
            self.first = time.perf_counter()

    def on_train_end(self, trainer, pl_module) -> None:
        seconds = time.perf_counter() - self.first
        report = {"loop_s": seconds, "steps": trainer.global_step, "threads": torch.get_num_threads()}
        Path(self.path).write_text(json.dumps(report))


def fit_args(shards: Path, run_dir: Path, clock: Path, steps: int, batch_size: int) -> list[str]:
    model = [f"--model.init_args.{k}={v}" for k, v in MAE.items()]
    model += [f"--model.init_args.backbone.{k}={v}" for k, v in BACKBONE.items() if k != "img_size"]
    return [
        "fit", "--model", "ssl_vit.tasks.MaskedPatchPretraining", *model,
        "--data", "ssl_vit.data.ShardDataModule",
        "--data.init_args.train_urls", str(shards / "train-{000000..000001}.tar"),
        "--data.init_args.val_urls", str(shards / "val-000000.tar"),
        "--data.init_args.image_size", str(BACKBONE["img_size"]),
        "--data.init_args.batch_size", str(batch_size),
        "--data.init_args.num_workers", "1",
        "--trainer.max_steps", str(steps),
        "--trainer.accelerator", "cpu",
        "--trainer.enable_progress_bar", "false",
        "--trainer.logger", "ssl_vit.tracking.WandbLogger",
        "--trainer.default_root_dir", str(run_dir),
        "--checkpoint.every_n_train_steps", "250",
        "--trainer.callbacks+=ssl_vit.benchmark.loop.StepClock", "--trainer.callbacks.path", str(clock),
    ]  # fmt: skip


def bare_loop(steps: int, batch_size: int) -> float:
    """Seconds of `steps` steps of the same task on one in-memory batch."""
    torch.manual_seed(0)
    task = MaskedPatchPretraining(ViTConfig(**BACKBONE), **MAE)
    optimizer = torch.optim.AdamW(task.parameters(), lr=1e-3)
    size = BACKBONE["img_size"]
    images = torch.randn(batch_size, 3, size, size)
    start = time.perf_counter()
    for _ in range(steps):
        task.forward_loss(images).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def _ssl_vit(*args: str, cwd: Path, threads: int | None = None) -> float:
    # TMPDIR: what the command leaves in temporary directories (W&B's) goes when `cwd` does
    env = {**os.environ, "WANDB_MODE": os.environ.get("WANDB_MODE", "offline"), "TMPDIR": str(cwd)}
    if threads is not None:  # torch's intra-op threads in the child, read when torch starts
        env["OMP_NUM_THREADS"] = str(threads)
    start = time.perf_counter()
    # A session of its own, so that stopping this command stops it, its DataLoader worker and all,
    # before the temporary directory it works in is deleted.
    proc = subprocess.Popen(
        [sys.executable, "-m", "ssl_vit", *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        _, stderr = proc.communicate()
    except BaseException:  # SIGTERM, Ctrl-C
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"ssl-vit {args[0]} failed:\n{stderr[-3000:]}")
    return time.perf_counter() - start


def run_loop_bench(steps: int, batch_size: int, threads: int | None = None) -> dict:
    threads = threads or max(1, (os.cpu_count() or 2) - 1)  # every core but the DataLoader worker's
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory(prefix="ssl-vit-bench-loop-") as tmp:
        tmp = Path(tmp)
        for split, count in (("train", TRAIN_IMAGES), ("val", VAL_IMAGES)):
            _ssl_vit(
                "data", "convert", f"synthetic:{count}", "shards", "--split", split,
                "--shard-size", str(TRAIN_IMAGES // 2), "--no-progress", cwd=tmp,
            )  # fmt: skip
        clock = tmp / "clock.json"
        args = fit_args(tmp / "shards", tmp / "run", clock, steps, batch_size)
        process_s = _ssl_vit(*args, cwd=tmp, threads=threads)
        fit = json.loads(clock.read_text())
        bare_s = bare_loop(steps, batch_size)
    return {
        "steps": fit["steps"],
        "batch_size": batch_size,
        "backbone": BACKBONE,
        "fit_loop_s": fit["loop_s"],
        "fit_process_s": process_s,
        "bare_loop_s": bare_s,
        "overhead": fit["loop_s"] / bare_s,
        "threads": threads,
        "fit_threads": fit["threads"],
    }


def format_loop(report: dict) -> str:
    return (
        f"MAE, {report['backbone']}, {report['steps']} steps of batch {report['batch_size']}, "
        f"{report['threads']} torch thread(s) on each side, 1 DataLoader worker\n"
        f"ssl-vit fit (shards, validation, checkpoints, W&B): {report['fit_loop_s']:.1f} s from its first "
        f"step ({report['fit_process_s']:.1f} s with start-up)\n"
        f"bare in-memory PyTorch loop: {report['bare_loop_s']:.1f} s\n"
        f"whole-loop time / bare loop: {report['overhead']:.2f}x"
    )
