"""Preemption on a real SLURM (one node on 127.0.0.1, started by the test): `scancel --signal=USR1`
makes both ranks of `recipes/slurm/pretrain.sbatch` save at the same step, the job is requeued and
resumes from that checkpoint by itself, and finishes with the losses of an uninterrupted run."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cli_helpers import script_env
from resume_helpers import ROOT, fit_args, read_steps
from slurm_helpers import slurm_cluster_fixture  # noqa: F401 (fixture `slurm_cluster`)

SBATCH = ROOT / "recipes/slurm/pretrain.sbatch"
HERE = Path(__file__).parent


def submit(cluster, tmp_path, name, shards, steps_file, epochs=3) -> str:
    """The shipped sbatch script, on 1 node x 2 CPU tasks instead of its GPU defaults: 3 epochs x 6
    steps of the quickstart MPP recipe (`resume_helpers.fit_args`), every step recorded per rank. Its
    `ssl-vit` is the tests' fork server's client (`cli_helpers.script_env`): each task is that
    command to srun (its signals, its output, its exit status), without importing torch again."""
    args = fit_args(shards, tmp_path / name, steps_file, epochs=epochs)
    at = args.index("--trainer.default_root_dir")
    run_dir, args = args[at + 1], args[3:at] + args[at + 2 :]  # RUN_DIR is the script's 2nd argument
    client = script_env()
    path = f"{Path(client['SSLVIT']).parent}:{Path(sys.executable).parent}:{os.environ['PATH']}"
    served = ",".join(f"{k}={v}" for k, v in client.items() if k != "SSLVIT")
    options = [
        "--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1", "--time=10",
        f"--output={tmp_path / name}.out",
        f"--export=ALL,PATH={path},{served},PYTHONPATH={HERE},WANDB_MODE=offline,OMP_NUM_THREADS=1",
    ]  # fmt: skip
    overrides = [
        "--trainer.accelerator",
        "cpu",
        "--trainer.strategy",
        "ddp",
        "--data.init_args.num_workers",
        "1",
    ]
    proc = subprocess.run(
        ["sbatch", "--parsable", *options, str(SBATCH), str(ROOT / "recipes/quickstart/mpp.yaml"), run_dir,
         *overrides, *args],
        env=cluster.env, cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_usr1_saves_requeues_and_resumes_to_the_same_losses(slurm_cluster, digits_shards, tmp_path):
    cluster = slurm_cluster
    # The uninterrupted reference: the same script, never signalled.
    reference = tmp_path / "reference.jsonl"
    job = submit(cluster, tmp_path, "reference", digits_shards, reference)
    cluster.wait_for_state(job, "COMPLETED", timeout=300)
    expected = {}
    for r in read_steps(reference):
        expected.setdefault(r["step"], {})[r["rank"]] = r["loss"]
    assert sorted(expected) == list(range(1, 19))

    steps_file = tmp_path / "preempted.jsonl"
    job = submit(cluster, tmp_path, "preempted", digits_shards, steps_file)
    timeline = {"submitted": time.monotonic()}
    cluster.wait_for_state(job, "RUNNING", timeout=120)
    deadline = time.monotonic() + 240
    while not (steps_file.exists() and any(r["step"] >= 5 for r in read_steps(steps_file))):
        assert time.monotonic() < deadline, cluster.job_info(job)
        time.sleep(0.05)
    cluster.run("scancel", "--signal=USR1", job)
    timeline["signalled"] = time.monotonic()
    pending = cluster.wait_for_state(job, "PENDING", timeout=120)
    timeline["requeued (pending)"] = time.monotonic()
    assert pending["Restarts"] == "1" and pending["Reason"] == "BeginTime"
    cluster.wait_for_state(job, "RUNNING", timeout=180)
    timeline["running again"] = time.monotonic()
    info = cluster.wait_for_state(job, "COMPLETED", timeout=300)
    timeline["completed"] = time.monotonic()
    assert info["Restarts"] == "1" and info["ExitCode"] == "0:0"
    print("timeline (s after submit):", {k: round(v - timeline["submitted"], 1) for k, v in timeline.items()})

    output = (tmp_path / "preempted.out").read_text()
    saved = torch.load(tmp_path / "preempted/checkpoints/last.ckpt", map_location="cpu", weights_only=True)
    assert saved["global_step"] == 18
    # Rank 0 says where it stopped, then requeues (SLURM then stops the job at once, so rank 1 may or
    # may not get to print its line; if it does, it names the same step).
    lines = [ln for ln in output.splitlines() if ln.startswith("ssl-vit: stopped by the requeue signal")]
    rank0 = [ln for ln in lines if ln.endswith(f"; requeueing SLURM job {job}: it resumes from there")]
    assert len(rank0) == 1 and len({ln.split(";")[0] for ln in lines}) == 1, lines
    stopped = int(rank0[0].split("after step ")[1].split(";")[0])
    assert f"Restored all states from the checkpoint at {tmp_path}/preempted/checkpoints/last.ckpt" in output
    assert "restart 1" in output

    # Both ranks stopped after the same step, and the requeued job continued right after it: no step
    # was run twice or skipped, and every loss is the uninterrupted run's.
    records = read_steps(steps_file)
    got = {}
    for r in records:
        assert r["rank"] not in got.get(r["step"], {}), f"step {r['step']} ran twice on rank {r['rank']}"
        got.setdefault(r["step"], {})[r["rank"]] = r["loss"]
    assert 5 <= stopped < 18 and sorted(got) == sorted(expected)
    for step in expected:
        for rank in (0, 1):
            assert abs(got[step][rank] - expected[step][rank]) < 1e-6, (step, rank)
