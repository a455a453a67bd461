"""What keeps a fit alive, apart from the learning methods in `ssl_vit.tasks`: `last.ckpt` linked to the
newest checkpoint (`last_link`), the RNG state of an exact resume (`resume`), SIGTERM/SLURM requeue
(`preemption`), the non-finite and loss-spike policies (`nonfinite`, `spikes`, `rollback`) and the
collapse watch (`health`), and the checks of a fit's run directory and config before anything is
written (`preflight`). The fit CLI (`ssl_vit.cli.fit`) wires them in as callbacks and plugins."""
