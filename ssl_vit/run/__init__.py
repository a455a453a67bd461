"""What keeps a fit alive, apart from the learning methods in `ssl_vit.tasks`: checkpoint writing and
safe loading (`checkpointing`), the RNG state of an exact resume (`resume`), SIGTERM/SLURM requeue
(`preemption`), the non-finite and loss-spike policies (`nonfinite`, `spikes`, `rollback`) and the
collapse watch (`health`), and the checks of a fit's `--ckpt_path` and run directory before anything is
written (`checks`). The fit CLI (`ssl_vit.cli.fit`) wires them in as callbacks and plugins."""
