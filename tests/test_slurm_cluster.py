"""The one-node SLURM test cluster works the way the preemption test needs: sbatch, a 2-task srun."""

import shlex
import sys

import pytest
from slurm_helpers import slurm_cluster_fixture  # noqa: F401 (fixture `slurm_cluster`)

PRINT_RANK = (
    "import os; e = os.environ; "
    'print("rank", e["SLURM_PROCID"], "of", e["SLURM_NTASKS"], "job", e["SLURM_JOB_ID"], flush=True)'
)


@pytest.mark.slow
def test_sbatch_runs_a_two_task_srun(slurm_cluster, tmp_path):
    out = tmp_path / "job.out"
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\n"
        "#SBATCH --ntasks=2\n"
        "#SBATCH --time=2\n"
        f"#SBATCH --output={out}\n"
        f"srun {shlex.quote(sys.executable)} -c {shlex.quote(PRINT_RANK)}\n"
    )
    job = slurm_cluster.sbatch(script, cwd=tmp_path)

    info = slurm_cluster.wait_for_state(job, "COMPLETED", timeout=60)

    assert (info["ExitCode"], info["NumTasks"], info["Restarts"]) == ("0:0", "2", "0")
    ranks = sorted(line for line in out.read_text().splitlines() if line.startswith("rank "))
    assert ranks == [f"rank 0 of 2 job {job}", f"rank 1 of 2 job {job}"]
