"""`ssl-vit bench step|loop|scaling` and benchmarks/gpu.sh run end to end (tiny sizes, CPU) and count
FLOPs as `ssl-vit info` does. Only correctness: no timing is asserted."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_helpers import run_cli

from ssl_vit.benchmark.scaling import traffic_table
from ssl_vit.benchmark.step import NUM_CLASSES, build_task, task_flops
from ssl_vit.info import mae_cost, vit_cost
from ssl_vit.models.vit import ViTConfig

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--variant", "Ti/8", "--img-size", "32", "--batch-size", "2", "--rounds", "2", "--steps", "1"]


def test_step_flops_of_b16_are_those_of_ssl_vit_info():
    config = ViTConfig("B/16", 224)
    with torch.device("meta"):
        supervised, mae = build_task("supervised", config), build_task("mae", config)
    head = 2 * 768 * NUM_CLASSES
    assert task_flops(supervised, 224) == 3 * (vit_cost("B/16").flops + head)
    assert task_flops(mae, 224) == 3 * mae_cost("B/16").flops
    assert vit_cost("B/16").flops / mae_cost("B/16").flops == pytest.approx(1.80, abs=0.01)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--variant", "X/16"], "unknown ViT variant 'X/16'"),
        (["--device", "cuda"], "--device cuda: no CUDA device is visible here"),
        (["--rounds", "0"], "--rounds must be at least 1"),
        (["--json", "/nonexistent/dir/out.json"], "--json /nonexistent/dir/out.json: directory"),
    ],
)
def test_bench_step_mistakes_are_one_line(args, message, tmp_path):
    if args[0] == "--device" and torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    proc = run_cli("bench", "step", *TINY, *args, cwd=tmp_path, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and message in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_bench_loop_mistakes_are_one_line(tmp_path):
    proc = run_cli("bench", "loop", "--threads", "0", cwd=tmp_path, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "ssl-vit: error: --steps, --batch-size and --threads must be at least 1"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_bench_loop_runs_ssl_vit_fit_on_shards_against_a_bare_loop(tmp_path):
    out = tmp_path / "loop.json"
    proc = run_cli("bench", "loop", "--steps", "6", "--batch-size", "4", "--threads", "1", "--json", str(out))
    report = json.loads(out.read_text())
    assert report["steps"] == 6
    assert report["threads"] == report["fit_threads"] == 1  # the fit's child computed on one thread too
    assert report["fit_process_s"] > report["fit_loop_s"] > 0 and report["bare_loop_s"] > 0
    assert report["overhead"] == pytest.approx(report["fit_loop_s"] / report["bare_loop_s"])
    assert "whole-loop time / bare loop" in proc.stdout


@pytest.mark.slow
def test_bench_scaling_measures_one_and_two_processes(tmp_path):
    out = tmp_path / "scaling.json"
    run_cli("bench", "scaling", *TINY, "--json", str(out))
    report = json.loads(out.read_text())
    (row,) = report["measured"][1:]  # plain, then mae
    assert row["name"] == "mae" and row["one_process"] > 0 and row["two_processes"] > 0
    assert row["efficiency"] == pytest.approx(row["two_processes"] / (2 * row["one_process"]))


def test_gradient_traffic_grows_with_the_variant_and_fsdp_is_for_the_largest():
    rows = {row["variant"] + row["recipe"][:3]: row for row in traffic_table()}
    b16, l16, h14 = rows["B/16mae"], rows["L/16mae"], rows["H/14mae"]
    assert b16["grad_mb"] < l16["grad_mb"] < h14["grad_mb"]
    assert h14["params_m"] == pytest.approx(632 + 26, abs=5)  # H/14 encoder + the 8 x 512 decoder
    assert all(0 < row["efficiency"] <= 1 for row in rows.values())


def assert_step_report(report: dict) -> None:
    """A `bench step` report of supervised and MAE against the plain loop, over 2 rounds."""
    rows = {row["name"]: row for row in report["rows"]}
    assert list(rows) == ["plain", "supervised", "mae"]
    for row in rows.values():
        assert len(row["rounds"]) == 2 and all(r > 0 for r in row["rounds"])
        assert row["images_per_s"] == pytest.approx(sum(row["rounds"]) / 2)  # the median of two
        assert 0 < row["mfu"] and row["gflops_per_image"] > 0
    assert rows["plain"]["vs_plain"] == 1.0
    mae = rows["mae"]
    supervised_flops = rows["supervised"]["gflops_per_image"]
    assert mae["flop_ratio"] == pytest.approx(supervised_flops / mae["gflops_per_image"])
    assert mae["of_flop_ratio"] == pytest.approx(mae["vs_supervised"] / mae["flop_ratio"])
    assert report["config"]["fused_attention"] is True and report["peak_flops"]["used"] > 0


@pytest.mark.slow
def test_gpu_script_runs_bench_step_on_the_cpu_with_small_settings(tmp_path):
    """benchmarks/gpu.sh: `ssl-vit bench step` of supervised and MAE, compile off, per block, and the
    whole step under CUDA graphs' mode (inductor without CUDA graphs on the CPU); tables printed and
    every report in its JSON."""
    env = {
        **os.environ, "SSLVIT": f"{sys.executable} -m ssl_vit", "VARIANT": "Ti/8", "IMG_SIZE": "32",
        "BATCH": "2", "DEVICE": "cpu", "PRECISION": "32-true", "ROUNDS": "2", "STEPS": "1", "WARMUP": "1",
        "JSON": str(tmp_path / "gpu.json"), "WANDB_MODE": "offline",
    }  # fmt: skip
    proc = subprocess.run(["bash", "benchmarks/gpu.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = json.loads((tmp_path / "gpu.json").read_text())
    reports += json.loads((tmp_path / "gpu-step.json").read_text())
    compiled = [tuple(r["config"][k] for k in ("compile", "compile_scope", "compile_mode")) for r in reports]
    assert compiled == [(False, None, None), (True, "blocks", "default"), (True, "step", "reduce-overhead")]
    for report in reports:
        assert_step_report(report)
    assert proc.stdout.count("| mae |") == 3 and proc.stdout.count("of FLOP ratio") == 3
    assert "compile on (step, reduce-overhead)" in proc.stdout
    skips = [r["config"]["cudagraph_skips"] for r in reports]
    assert skips[:2] == [None, None] and skips[2] > 0  # inductor has no CUDA graphs for the CPU
    assert f"{skips[2]} compiled graphs ran without CUDA graphs" in proc.stdout
