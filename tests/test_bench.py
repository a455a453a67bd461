"""`ssl-vit bench step|parts|loop|scaling|feed` and benchmarks/gpu.sh run end to end (tiny sizes, CPU)
and count FLOPs as `ssl-vit info` does. Only correctness: no timing is asserted."""

import json
import os
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import torch
from cli_helpers import run_cli, script_env, start_cli
from timm.models.vision_transformer import Block
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from ssl_vit.benchmark.parts import PartsBench
from ssl_vit.benchmark.scaling import traffic_table
from ssl_vit.benchmark.step import (
    DECODERS,
    NUM_CLASSES,
    StepBench,
    batch_memory,
    build_task,
    simmim_cell,
    task_flops,
)
from ssl_vit.models.cost import mae_cost, vit_cost
from ssl_vit.models.vit import ViTConfig
from ssl_vit.tasks import MaskedPatchPretraining
from ssl_vit.tasks.base import step_loss

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


def test_depth_sets_the_blocks_of_every_encoder_and_decoder_of_the_bench():
    """`--depth 2`: the plain timm model, the tasks' encoders and their decoders (MAE's 8, I-JEPA's 6
    predictor blocks) are 2 blocks deep, and the FLOPs counted follow."""
    bench = StepBench("Ti/8", 32, depth=2)
    assert len(bench.plain_model().blocks) == 2
    assert batch_memory("B/16", 224, 256, depth=2) < batch_memory("B/16", 224, 256) / 4  # checked as built
    blocks = lambda module: sum(isinstance(m, Block) for m in module.modules())  # noqa: E731
    for name, decoder in [("supervised", 0), ("mae", 8), ("ijepa", 6)]:
        with torch.device("meta"):
            full, shallow = build_task(name, ViTConfig("Ti/8", 32)), build_task(name, bench.config)
        assert blocks(full.backbone) == 12 and blocks(shallow.backbone) == 2
        if decoder:
            assert blocks(full.decoder) == decoder and blocks(shallow.decoder) == 2
        assert task_flops(shallow, 32) < task_flops(full, 32) / 2


MISTAKES = [
    (["--variant", "X/16"], "unknown ViT variant 'X/16'"),
    (["--device", "cuda"], "--device cuda: no CUDA device is visible here"),
    (["--rounds", "0"], "--rounds must be at least 1"),
    (["--json", "/nonexistent/dir/out.json"], "--json /nonexistent/dir/out.json: directory"),
    (["--json", "."], "--json .: is a directory; give a file in an existing directory"),
    (["--threads", "0"], "--threads must be at least 1"),
    (["--warmup", "-1"], "--warmup must be at least 0"),
    (["--img-size", "30"], "--img-size 30: give a multiple of Ti/8's 8-pixel patches"),
    (["--device", "mps"], "--device mps: use cpu or cuda"),
    (["--device", "gpu0"], "--device gpu0: use cpu or cuda"),
    (["--batch-size", "100000000"], "--batch-size 100000000: a Ti/8 step at 32 px needs at least"),
    (["--depth", "0"], "--depth must be at least 1"),
    (
        ["--batch-size", "100000000", "--depth", "2"],
        "a Ti/8 (2 blocks deep) step at 32 px needs at least",
    ),
]


# `parts` checks its options with `step`'s function (`cli/bench.py` `_check`): its own run of the rows
# that reach the model (the variant, its image size, the memory a batch needs) is enough.
@pytest.mark.parametrize(
    "command, args, message",
    [("step", *row) for row in MISTAKES]
    + [("parts", *row) for row in MISTAKES if row[0][0] in ("--variant", "--img-size", "--batch-size")],
)
def test_bench_step_and_parts_mistakes_are_one_line(command, args, message, tmp_path):
    if args == ["--device", "cuda"] and torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    proc = run_cli("bench", command, *TINY, *args, cwd=tmp_path, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and message in proc.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["step", "parts", "scaling", "feed", "loop"])
def test_bench_keeps_an_existing_json_report_unless_told_to_overwrite_it(command, tmp_path):
    report = tmp_path / "report.json"
    report.write_text("{}")
    args = ["--steps", "1"] if command == "loop" else TINY
    proc = run_cli("bench", command, *args, "--json", str(report), cwd=tmp_path, check=False)
    assert proc.returncode == 2 and proc.stderr == (
        f"ssl-vit: error: --json {report} exists: pass --overwrite to replace it, or give another file\n"
    )
    assert report.read_text() == "{}" and list(tmp_path.iterdir()) == [report]
    if command == "step":
        run_cli("bench", command, *TINY, "--tasks", "supervised", "--json", str(report), "--overwrite")
        assert json.loads(report.read_text())[0]["rows"][1]["name"] == "supervised"


def test_bench_loop_mistakes_are_one_line(tmp_path):
    proc = run_cli("bench", "loop", "--threads", "0", cwd=tmp_path, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "ssl-vit: error: --steps, --batch-size and --threads must be at least 1"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("signum", "line", "stage"),
    [
        (signal.SIGINT, "interrupted", "shards"),
        (signal.SIGTERM, "terminated", "shards"),
        pytest.param(signal.SIGTERM, "terminated", "run", marks=pytest.mark.slow),
    ],
)
def test_a_stopped_bench_loop_leaves_no_temporary_directory(signum, line, stage):
    """Ctrl-C or SIGTERM (to the whole process group, as a scheduler sends it) while it writes its
    shards or while its fit runs: 128 + the signal, one line, and its temporary directory gone."""
    temp = Path(tempfile.gettempdir())  # where the CLI's fork server makes temporary directories
    before = set(temp.glob("ssl-vit-bench-loop-*"))
    running = start_cli("bench", "loop", "--steps", "100000", "--threads", "1", session=True)
    deadline, ours = time.monotonic() + 240, []
    while not ours and running.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
        ours = [d for d in set(temp.glob("ssl-vit-bench-loop-*")) - before if (d / stage).exists()]
    assert ours and running.poll() is None, running.wait().stderr
    os.killpg(running.pid, signum)
    proc = running.wait(120)
    assert proc.returncode == 128 + signum and proc.stderr == f"ssl-vit: {line}\n", proc.stderr
    assert not ours[0].exists()


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
    proc = run_cli("bench", "scaling", *TINY, "--depth", "2", "--json", str(out))
    report = json.loads(out.read_text())
    assert report["config"]["depth"] == 2 and "Measured: Ti/8 (2 blocks deep) at 32 px" in proc.stdout
    (row,) = report["measured"][1:]  # plain, then mae
    assert row["name"] == "mae" and row["one_process"] > 0 and row["two_processes"] > 0
    assert row["efficiency"] == pytest.approx(row["two_processes"] / (2 * row["one_process"]))


def test_gradient_traffic_grows_with_the_variant_and_fsdp_is_for_the_largest():
    rows = {row["variant"] + row["recipe"][:3]: row for row in traffic_table()}
    b16, l16, h14 = rows["B/16mae"], rows["L/16mae"], rows["H/14mae"]
    assert b16["grad_mb"] < l16["grad_mb"] < h14["grad_mb"]
    assert h14["params_m"] == pytest.approx(632 + 26, abs=5)  # H/14 encoder + the 8 x 512 decoder
    assert all(0 < row["efficiency"] <= 1 for row in rows.values())


def forward_flops(module: torch.nn.Module, shape: tuple[int, ...]) -> int:
    """FLOPs of one forward on the meta device, attention included, as `ssl-vit info` counts them."""
    with FlopCounterMode(display=False) as counter:
        module(torch.empty(shape, device="meta"))
    return counter.get_total_flops()


def flops_without_blocks(name: str, config: ViTConfig) -> int:
    """FLOPs of a task's step (forward and backward) with its block stacks swapped for identities."""
    task = build_task(name, config)
    task.backbone.blocks = torch.nn.Identity()
    if name == "mae":
        task.decoder.blocks = torch.nn.Identity()
    images = torch.randn(2, 3, config.img_size, config.img_size)
    with FlopCounterMode(display=False) as counter:
        out = task.train_loss({"image": images, "label": torch.tensor([0, 1])})
        step_loss(out).backward()
    return counter.get_total_flops()


@pytest.mark.slow
def test_bench_parts_times_each_piece_of_mae_against_supervised_blocks(tmp_path):
    """`ssl-vit bench parts`: the block stacks on the token shapes MAE's own step feeds them (Ti/8 at
    32 px: 16 patches, 4 kept), forward and backward, each with its FLOPs (attention counted on the
    CPU too), the whole step, and the rest between them."""
    out = tmp_path / "parts.json"
    proc = run_cli("bench", "parts", *TINY, "--json", str(out))
    report = json.loads(out.read_text())
    rows = {(row["task"], row["piece"]): row for row in report["rows"]}
    assert list(rows) == [
        ("supervised", "blocks"), ("supervised", "rest"), ("supervised", "step"),
        ("mae", "blocks"), ("mae", "decoder blocks"), ("mae", "rest"), ("mae", "step"),
    ]  # fmt: skip
    stacks = {("supervised", "blocks"): [1 + 16, 192], ("mae", "blocks"): [1 + 4, 192]}
    stacks["mae", "decoder blocks"] = [1 + 16, 512]
    config = ViTConfig("Ti/8", 32)
    with torch.device("meta"):
        mae = build_task("mae", config)
    modules = {"blocks": mae.backbone.blocks, "decoder blocks": mae.decoder.blocks}
    for (task, piece), tokens in stacks.items():
        assert rows[task, piece]["tokens"] == tokens
        # The backward too (2 x the forward), as in a step.
        flops = 3 * forward_flops(modules[piece], (2, *tokens))
        assert rows[task, piece]["gflops"] * 1e9 == pytest.approx(flops, rel=1e-9)
    for task in ("supervised", "mae"):
        rest, step = rows[task, "rest"], rows[task, "step"]
        assert rest["gflops"] * 1e9 == pytest.approx(flops_without_blocks(task, config), rel=1e-9)
        assert rest["vs_reference"] is None and step["share"] == 1.0
        assert 0 < step["seconds"] and 0 < rows[task, "blocks"]["vs_reference"]
    # Every ratio pairs the pieces round by round (a slow spell of the machine cancels).
    reference = rows["supervised", "blocks"]
    assert reference["vs_reference"] == 1.0
    for (task, piece), row in rows.items():
        step_rounds = rows[task, "step"]["rounds"]
        if piece == "rest":
            stack_rounds = [
                rows[task, p]["rounds"] for p in ("blocks", "decoder blocks") if (task, p) in rows
            ]
            rest = [step - sum(stacks) for step, *stacks in zip(step_rounds, *stack_rounds)]
            assert row["rounds"] == pytest.approx(rest)
            continue
        rates = [
            (row["gflops"] / t) / (reference["gflops"] / r)
            for t, r in zip(row["rounds"], reference["rounds"])
        ]
        assert row["vs_reference"] == pytest.approx(statistics.median(rates))
    supervised, mae = rows["supervised", "step"], rows["mae", "step"]
    speedups = [s / m for s, m in zip(supervised["rounds"], mae["rounds"])]
    assert report["speedup"] == pytest.approx(statistics.median(speedups))
    assert report["flop_ratio"] == pytest.approx(supervised["gflops"] / mae["gflops"])
    assert report["of_flop_ratio"] == pytest.approx(report["speedup"] / report["flop_ratio"])
    assert "| mae | decoder blocks | 17 x 512 |" in proc.stdout and "of its FLOP ratio" in proc.stdout


class MatmulDtypes(TorchDispatchMode):
    """The dtypes of every matrix product dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: set[torch.dtype] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
            self.dtypes.add(out.dtype)
        return out


def test_bench_parts_runs_every_piece_under_the_precision_it_is_given():
    """Under bf16-mixed every piece's matrix products, forward and backward, run in bf16, as in a
    Lightning step; the stacks' inputs are what the step feeds them (fp32 after the position embedding)."""
    parts = PartsBench(StepBench("Ti/8", 32, 2, precision="bf16-mixed"), "mae")
    pieces = parts.pieces("mae")
    assert [(p.name, p.shape) for p in pieces] == [
        ("blocks", (2, 5, 192)), ("decoder blocks", (2, 17, 512)), ("step", ()),
    ]  # fmt: skip
    for piece in pieces:
        with MatmulDtypes() as seen:
            piece.run()
        assert seen.dtypes == {torch.bfloat16}, piece.name


def test_bench_parts_refuses_blocks_it_cannot_time_alone():
    """Under activation checkpointing the blocks run one by one, never as their stack: refused,
    rather than their time counted as the rest's."""
    parts = PartsBench(StepBench("Ti/8", 32, 2), "mae")
    task = build_task("mae", ViTConfig("Ti/8", 32, grad_checkpointing=True))
    stacks = {"blocks": task.backbone.blocks, "decoder blocks": task.decoder.blocks}
    with pytest.raises(RuntimeError, match="MaskedPatchPretraining's step: blocks ran 0 times, not once"):
        parts._stack_inputs(task, stacks, {"image": torch.randn(2, 3, 32, 32)})


@pytest.mark.parametrize(
    "variant, img_size, cell", [("B/16", 224, 32), ("H/14", 224, 28), ("Ti/16", 48, 16), ("Ti/8", 16, 16)]
)
def test_simmim_cells_tile_the_patch_grid(variant, img_size, cell):
    """SimMIM's 32-pixel cells where they tile the grid, else the largest smaller cell that does."""
    assert simmim_cell(ViTConfig(variant, img_size)) == cell
    with torch.device("meta"):
        build_task("simmim", ViTConfig(variant, img_size))  # the task accepts it


@pytest.mark.slow
@pytest.mark.parametrize("task", ["vit_mpp", "simmim"])
def test_bench_parts_of_the_full_sequence_tasks(task, tmp_path):
    """MPP and SimMIM run the encoder on every patch and have no decoder."""
    out = tmp_path / "parts.json"
    run_cli("bench", "parts", *TINY, "--task", task, "--rounds", "1", "--json", str(out))
    rows = {(row["task"], row["piece"]): row for row in json.loads(out.read_text())["rows"]}
    assert list(rows)[3:] == [(task, "blocks"), (task, "rest"), (task, "step")]
    assert rows[task, "blocks"]["tokens"] == [1 + 16, 192]
    assert rows[task, "blocks"]["gflops"] == rows["supervised", "blocks"]["gflops"]


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
    whole step under CUDA graphs' mode (inductor without CUDA graphs on the CPU), then `bench parts` of
    MAE, then `bench feed` against the first steps (decoding in the workers, then on the device: here
    the CPU); tables printed and every report in its JSON. Two blocks deep: Ti/8's 12 + MAE's 8 decoder
    blocks took two minutes to compile as one step on 2 CPU cores."""
    env = {
        **os.environ, **script_env(), "VARIANT": "Ti/8", "DEPTH": "2", "IMG_SIZE": "32",
        "BATCH": "2", "DEVICE": "cpu", "PRECISION": "32-true", "ROUNDS": "2", "STEPS": "1", "WARMUP": "1",
        "JSON": str(tmp_path / "gpu.json"), "WANDB_MODE": "offline",
        "STORED": "64x48", "FEED_WORKERS": "1", "FEED_BATCHES": "1", "DEVICE_WORKERS": "1",
    }  # fmt: skip
    proc = subprocess.run(["bash", "benchmarks/gpu.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = json.loads((tmp_path / "gpu.json").read_text())
    reports += json.loads((tmp_path / "gpu-step.json").read_text())
    compiled = [tuple(r["config"][k] for k in ("compile", "compile_scope", "compile_mode")) for r in reports]
    assert compiled == [(False, None, None), (True, "blocks", "default"), (True, "step", "reduce-overhead")]
    with torch.device("meta"):
        full_depth = task_flops(build_task("supervised", ViTConfig("Ti/8", 32)), 32) / 1e9
    for report in reports:
        assert_step_report(report)
        assert report["config"]["depth"] == 2
        supervised = next(row for row in report["rows"] if row["name"] == "supervised")
        assert supervised["gflops_per_image"] < full_depth / 3  # the model that ran was 2 blocks deep
    assert proc.stdout.count("Ti/8 (2 blocks deep) at 32 px") == 4  # three step tables and the parts'
    step_tables, parts_table = proc.stdout.split("forward + backward without the optimizer")
    assert step_tables.count("| mae |") == 3 and step_tables.count("of FLOP ratio") == 3
    assert "compile on (step, reduce-overhead)" in proc.stdout
    skips = [r["config"]["cudagraph_skips"] for r in reports]
    assert skips[:2] == [None, None] and skips[2] > 0  # inductor has no CUDA graphs for the CPU
    assert f"{skips[2]} compiled graphs ran without CUDA graphs" in proc.stdout
    parts = json.loads((tmp_path / "gpu-parts.json").read_text())
    assert parts["config"]["task"] == "mae" and parts["config"]["depth"] == 2 and len(parts["rows"]) == 7
    assert "| mae | decoder blocks |" in parts_table
    feed = json.loads((tmp_path / "gpu-feed.json").read_text())
    assert feed["step_reports"] == json.loads((tmp_path / "gpu.json").read_text())  # not measured again
    assert list(feed["step"]) == ["supervised", "mae", "supervised, compiled", "mae, compiled"]
    assert [row["workers"] for row in feed["rows"]] == [1] and feed["config"]["stored"] == [64, 48]
    assert "| feed / step (supervised) |" in parts_table
    device = json.loads((tmp_path / "gpu-feed-device.json").read_text())
    assert device["config"]["decode"] == "device" and [row["workers"] for row in device["rows"]] == [1]


FEED = ["--stored", "64x48", "--img-size", "32", "--variant", "Ti/8", "--batch-size", "2", "--batches", "2"]


def feed_shards() -> set[Path]:
    """`bench feed`'s temporary shard directories now present."""
    return set(Path(tempfile.gettempdir()).glob("ssl-vit-bench-feed-*"))


@pytest.mark.slow
def test_bench_feed_times_the_input_path_against_the_step(tmp_path):
    """`ssl-vit bench feed`: the step measured as `bench step` measures it, then shards streamed
    through 0 and 1 DataLoader workers to normalised batches; a table and the JSON report, and no
    shards left behind."""
    before, out = feed_shards(), tmp_path / "feed.json"
    proc = run_cli("bench", "feed", *FEED, "--workers", "0,1", "--steps", "1", "--json", str(out))
    report = json.loads(out.read_text())
    assert feed_shards() == before
    config = report["config"]
    assert config["stored"] == [64, 48] and config["img_size"] == 32 and config["decode"] == "cpu"
    assert config["batch_size"] == 2 and config["batches"] == 2 and config["device"] == "cpu"
    (step,) = report["step_reports"]
    assert [row["name"] for row in step["rows"]] == ["plain", "mae"]
    assert report["step"] == {"mae": step["rows"][1]["images_per_s"]}
    assert [row["workers"] for row in report["rows"]] == [0, 1]
    for row in report["rows"]:
        assert row["images_per_s"] > 0 and row["per_worker"] == row["images_per_s"]
        assert row["vs_step"]["mae"] == pytest.approx(row["images_per_s"] / report["step"]["mae"])
    assert "| workers | img/s | per worker | decoded on the CPU | feed / step (mae) |" in proc.stdout
    assert "| 0 (in-process) |" in proc.stdout and "| mae |" in proc.stdout  # and the step's own table


@pytest.mark.slow
def test_bench_feed_takes_the_step_from_a_bench_step_report(tmp_path):
    """With `--step-json`, every task and compile setting of the report is a `feed / step` column,
    and nothing is measured again; a report of another batch is refused."""
    step_json, out = tmp_path / "step.json", tmp_path / "feed.json"
    run_cli("bench", "step", *TINY, "--tasks", "supervised", "mae", "--json", str(step_json))
    proc = run_cli(
        "bench", "feed", *FEED, "--workers", "1", "--step-json", str(step_json), "--json", str(out)
    )
    report = json.loads(out.read_text())
    steps = json.loads(step_json.read_text())
    assert report["step_reports"] == steps and "round 1/" not in proc.stdout
    assert list(report["step"]) == ["supervised", "mae"]
    (row,) = report["rows"]
    assert row["workers"] == 1 and set(row["vs_step"]) == {"supervised", "mae"}
    assert "| feed / step (supervised) | feed / step (mae) |" in proc.stdout
    wrong = run_cli("bench", "feed", *FEED, "--batch-size", "4", "--step-json", str(step_json), check=False)
    assert wrong.returncode == 2 and wrong.stderr.strip() == (
        f"ssl-vit: error: --step-json {step_json}: measured Ti/8 at 32 px, batch 2 on cpu, not Ti/8 at 32 "
        "px, batch 4 on cpu: give the feed the step's --variant, --depth, --img-size, --batch-size and "
        "--device"
    )
    shallow = run_cli("bench", "feed", *FEED, "--depth", "2", "--step-json", str(step_json), check=False)
    assert shallow.returncode == 2 and "not Ti/8 (2 blocks deep) at 32 px, batch 2 on cpu" in shallow.stderr


@pytest.mark.slow
def test_bench_feed_reads_the_shards_it_is_given(digits_shards, tmp_path):
    """`--shards`: the feed of shards the user wrote (`data convert`), not of photos made for it."""
    step_json, out = tmp_path / "step.json", tmp_path / "feed.json"
    run_cli("bench", "step", *TINY, "--tasks", "mae", "--json", str(step_json))
    shards = str(digits_shards / "train-{000000..000004}.tar")
    proc = run_cli("bench", "feed", *FEED, "--workers", "1", "--shards", shards,
                   "--step-json", str(step_json), "--json", str(out))  # fmt: skip
    report = json.loads(out.read_text())
    assert report["config"]["shards"] == shards and "stored" not in report["config"]
    (row,) = report["rows"]
    assert row["workers"] == 1 and row["images_per_s"] > 0
    assert f"shards {shards}, crop 32" in proc.stdout
    missing = run_cli("bench", "feed", *FEED, "--shards", str(tmp_path / "nope-{000000..000001}.tar"),
                      "--step-json", str(step_json), check=False)  # fmt: skip
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1
    assert "--shards" in missing.stderr and "nope-000000.tar" in missing.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--workers", "0,x"], "--workers 0,x: give worker counts of 0 or more separated by commas"),
        (["--workers=-1"], "--workers -1: give worker counts of 0 or more"),
        (["--stored=-64x48"], "--stored -64x48: give sides of 1 to 8192 pixels"),
        (["--quality", "0"], "--quality 0: give a JPEG quality of 1 to 100"),
        (["--batches", "0"], "--batches must be at least 1, got 0"),
        (["--variant", "X/16"], "unknown ViT variant 'X/16'"),
        (["--step-json", "missing.json"], "--step-json missing.json: not a `bench step --json` report"),
    ],
)
def test_bench_feed_mistakes_are_one_line(args, message, tmp_path):
    before = feed_shards()
    proc = run_cli("bench", "feed", *FEED, *args, cwd=tmp_path, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and message in proc.stderr
    assert list(tmp_path.iterdir()) == [] and feed_shards() == before


@pytest.mark.parametrize("preset", ["ijepa", "data2vec2"])
def test_teacher_presets_count_the_teachers_forward_once(preset):
    """B/16's pixel target (16 x 16 x 3) is as wide as its latent one (768): the students cost the same,
    and the teacher adds one plain forward (`ssl-vit info`'s), with no backward."""
    config = ViTConfig("B/16", 224)
    with torch.device("meta"):
        latents = build_task(preset, config)
        pixels = MaskedPatchPretraining(config, preset=preset, target="norm_pixels", **DECODERS[preset])
    assert task_flops(latents, 224) == task_flops(pixels, 224) + vit_cost("B/16").flops


@pytest.mark.slow
def test_bench_step_runs_the_latent_and_hog_presets(tmp_path):
    out = tmp_path / "step.json"
    tasks = ("maskfeat", "ijepa", "data2vec2")
    run_cli("bench", "step", *TINY, "--tasks", *tasks, "--rounds", "1", "--json", str(out))
    (report,) = json.loads(out.read_text())
    rows = {row["name"]: row for row in report["rows"]}
    assert list(rows) == ["plain", "maskfeat", "ijepa", "data2vec2"]
    assert all(row["images_per_s"] > 0 and row["gflops_per_image"] > 0 for row in rows.values())


def test_bench_feed_reports_the_class_mix_of_class_sorted_shards(tmp_path):
    """`--shards` written class by class (one class per shard, no manifest): the feed's rows say how
    mixed the batches are, against a uniform shuffle, from the first batch on."""
    import io

    import numpy as np
    import webdataset as wds
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in range(8):
        with wds.TarWriter(str(tmp_path / f"train-{c:06d}.tar")) as sink:
            for i in range(16):
                png = io.BytesIO()
                Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(png, format="PNG")
                sink.write({"__key__": f"c{c}-{i:02d}", "png": png.getvalue(), "cls": str(c)})
    out = tmp_path / "feed.json"
    args = ["--img-size", "16", "--variant", "Ti/8", "--batch-size", "16", "--batches", "2", "--steps", "1"]
    shards = str(tmp_path / "train-{000000..000007}.tar")
    proc = run_cli("bench", "feed", *args, "--workers", "0", "--shards", shards, "--json", str(out))
    (row,) = json.loads(out.read_text())["rows"]
    mix = row["mix"]
    assert mix["batches"] == 4 and mix["ratio"] >= 0.85 and mix["first"] >= 6, mix  # 7.6 for a uniform draw
    assert "distinct classes per batch of 16" in proc.stdout
