"""`ssl-vit bench scaling`: DDP efficiency from 1 to 2 processes, measured, and the gradient traffic of
the recipes on a cluster, computed.

Measured: `ssl-vit bench step` in one process, then in two (torchrun, gloo, one thread each so both
runs use the same cores per process); efficiency = 2-process images/s / (2 x 1-process images/s).

Computed: DDP all-reduces every gradient once per step. With a ring all-reduce each GPU sends and
receives 2(n-1)/n times the gradient bytes, at the slowest link's bandwidth: NVLink inside a node,
InfiniBand between nodes. DDP overlaps it with the backward pass (about 2/3 of the step), so only
what exceeds that window is exposed; bf16 gradients (DDP's `bf16_compress_hook`) halve the bytes.
HSDP (`base/trainer_fsdp32.yaml`: FSDP2 inside a node, replicas across nodes) all-gathers the
parameters twice and reduce-scatters the gradients over NVLink (overlapped with the whole step, FSDP
prefetches the next block), and only each GPU's 1/8 shard of the gradients crosses InfiniBand. Step
time comes from the training FLOPs per image at the recipes' per-GPU batch and an assumed MFU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ssl_vit.benchmark import model_name

# Assumptions of the computed table, written out so they can be changed and checked.
H200_BF16_PEAK = 989e12  # dense bf16 FLOP/s of an H100/H200 SXM
ASSUMED_MFU = 0.40
NVLINK_BUS_BW = 360e9  # NCCL all-reduce bus bandwidth inside an NVLink-4 node, bytes/s
IB_BUS_BW = 45e9  # per GPU, one 400 Gb/s InfiniBand NIC per GPU (50 GB/s line rate), bytes/s
GRAD_BYTES = 4  # bf16-mixed keeps fp32 parameters, so gradients are fp32
BACKWARD_SHARE = 2 / 3
DEVICE_MEMORY = 141e9  # H200
STATE_BYTES_PER_PARAM = 16  # fp32 weights + gradients + AdamW's two moments
# The recipes: (name, variant, task, per-GPU batch, GPUs)
RECIPES = (
    ("vit_paper/supervised_b16_in21k", "B/16", "supervised", 128, 32),
    ("mae/b16_in1k", "B/16", "mae", 128, 32),
    ("mae/l16_in1k", "L/16", "mae", 128, 32),
    ("mae/h14_in1k (FSDP)", "H/14", "mae", 128, 32),
)


def run_scaling(args) -> dict:
    """The measured 1 -> 2 process efficiency, and the computed table."""
    options = [
        "--variant", args.variant, "--img-size", str(args.img_size), "--batch-size", str(args.batch_size),
        "--tasks", *args.tasks, "--precision", args.precision, "--compile", args.compile,
        "--compile-scope", args.compile_scope, "--compile-mode", args.compile_mode,
        "--rounds", str(args.rounds), "--steps", str(args.steps), "--warmup", str(args.warmup),
        "--threads", "1", *(["--depth", str(args.depth)] if args.depth else []),
    ]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="ssl-vit-bench-scaling-") as tmp:
        one, two = Path(tmp) / "one.json", Path(tmp) / "two.json"
        _run([sys.executable, "-m", "ssl_vit", "bench", "step", *options, "--json", str(one)])
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2"]
        _run([*torchrun, "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
              "-m", "ssl_vit", "bench", "step", *options, "--json", str(two)])  # fmt: skip
        reports = [json.loads(one.read_text())[0], json.loads(two.read_text())[0]]
    single = {row["name"]: row["images_per_s"] for row in reports[0]["rows"]}
    double = {row["name"]: row["images_per_s"] for row in reports[1]["rows"]}
    measured = [
        {"name": name, "one_process": single[name], "two_processes": double[name],
         "efficiency": double[name] / (2 * single[name])}
        for name in single
    ]  # fmt: skip
    return {"config": reports[0]["config"], "measured": measured, "computed": traffic_table()}


def traffic_table() -> list[dict]:
    from ssl_vit.models.cost import mae_cost, vit_cost

    rows = []
    for recipe, variant, task, batch, gpus in RECIPES:
        backbone = vit_cost(variant)
        cost = mae_cost(variant) if task == "mae" else backbone
        params = cost.params + (768 * 21843 if task == "supervised" else 0)  # the 21k-class head
        flops = 3 * cost.flops
        step_s = batch * flops / (ASSUMED_MFU * H200_BF16_PEAK)
        grad = params * GRAD_BYTES
        node_s = 2 * (8 - 1) / 8 * grad / NVLINK_BUS_BW
        cluster_s = 2 * (gpus - 1) / gpus * grad / IB_BUS_BW
        window = BACKWARD_SHARE * step_s
        exposed = max(0.0, cluster_s - window)
        exposed_bf16 = max(0.0, cluster_s / 2 - window)
        nodes = gpus // 8
        hsdp_node_s = 3 * (8 - 1) / 8 * grad / NVLINK_BUS_BW
        hsdp_ib_s = 2 * (nodes - 1) / nodes * (grad / 8) / IB_BUS_BW
        exposed_hsdp = max(0.0, hsdp_node_s - step_s) + max(0.0, hsdp_ib_s - window)
        rows.append({
            "recipe": recipe, "variant": variant, "params_m": params / 1e6, "grad_mb": grad / 1e6,
            "step_ms": 1e3 * step_s, "allreduce_node_ms": 1e3 * node_s,
            "allreduce_cluster_ms": 1e3 * cluster_s,
            "efficiency": step_s / (step_s + exposed),
            "efficiency_bf16_grads": step_s / (step_s + exposed_bf16),
            "hsdp_ib_ms": 1e3 * hsdp_ib_s, "efficiency_hsdp": step_s / (step_s + exposed_hsdp),
            "state_gb": params * STATE_BYTES_PER_PARAM / 1e9,
            "state_share": params * STATE_BYTES_PER_PARAM / DEVICE_MEMORY,
        })  # fmt: skip
    return rows


def _run(cmd: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])} ... failed:\n{proc.stderr[-3000:]}")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def format_scaling(report: dict) -> str:
    c = report["config"]
    lines = [
        f"Measured: {model_name(c)} at {c['img_size']} px, batch {c['batch_size']} per process, "
        f"{c['device']}, 1 thread per process, gloo",
        "",
        "| step | 1 process img/s | 2 processes img/s | efficiency |",
        "|---|---:|---:|---:|",
    ]
    for row in report["measured"]:
        lines.append(
            f"| {row['name']} | {row['one_process']:.1f} | {row['two_processes']:.1f} | "
            f"**{row['efficiency']:.2f}** |"
        )
    lines += [
        "",
        f"Computed for 4 nodes x 8 H200 (bf16 at {ASSUMED_MFU:.0%} MFU, fp32 gradients, NVLink "
        f"{NVLINK_BUS_BW / 1e9:.0f} GB/s, InfiniBand {IB_BUS_BW / 1e9:.0f} GB/s per GPU):",
        "",
        "| recipe | params (M) | gradient MB/step | step ms | all-reduce in a node ms | all-reduce over "
        "32 GPUs ms | DDP efficiency | with bf16 gradients | HSDP: InfiniBand ms | HSDP efficiency "
        "| weights+grads+AdamW GB (share of 141 GB) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in report["computed"]:
        lines.append(
            f"| {row['recipe']} | {row['params_m']:.0f} | {row['grad_mb']:.0f} | {row['step_ms']:.0f} | "
            f"{row['allreduce_node_ms']:.1f} | {row['allreduce_cluster_ms']:.1f} | {row['efficiency']:.2f} | "
            f"{row['efficiency_bf16_grads']:.2f} | {row['hsdp_ib_ms']:.1f} | {row['efficiency_hsdp']:.2f} | "
            f"{row['state_gb']:.1f} ({row['state_share']:.0%}) |"
        )
    return "\n".join(lines)
