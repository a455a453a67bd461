"""A command prints its own lines, the progress bar and final metrics, and where its W&B run is, once;
library lines that do not apply are dropped by their exact text, and `--verbose` shows everything."""

import re
from pathlib import Path

import pytest
from cli_helpers import run_cli

ROOT = Path(__file__).parents[1]
# Lines a fit, a resumed fit or a compare printed before, none of which a user can act on.
LISTED = (
    "The `srun` command is available",
    "Tip: For seamless cloud logging",
    "The anonymous setting has no effect",
    "git root",
    "LeafSpec",
    "Your `IterableDataset` has `__len__` defined",
    "module(s) in eval mode at the start of training",
    "GPU available:",
    "Seed set to",
    "Loading `train_dataloader` to estimate",
    "dataloader is not resumable",
    "Checkpoint directory",
    "wandb: ",
)
PYTHON_WARNING = re.compile(r"\.py:\d+: |Warning: ")  # a warning as Python or Lightning prints it


def fit_args(shards: Path, *extra: str) -> list[str]:
    """One epoch of 4 steps of the quickstart MPP recipe with 2 DataLoader workers, checkpoints every step,
    into the relative directory `run` (W&B looked for a git root there before it existed)."""
    return [
        "fit", "--config", str(ROOT / "recipes/quickstart/mpp.yaml"),
        "--data.init_args.train_urls", str(shards / "train-{000000..000004}.tar"),
        "--data.init_args.val_urls", str(shards / "val-{000000..000003}.tar"),
        "--data.init_args.num_workers", "2", "--data.init_args.train_batches", "4",
        "--checkpoint.every_n_train_steps", "1", "--trainer.enable_progress_bar", "false",
        "--trainer.log_every_n_steps", "1",
        "--trainer.default_root_dir", "run", *extra,
    ]  # fmt: skip


def printed(proc) -> list[str]:
    return [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]


def assert_quiet(proc) -> None:
    lines = printed(proc)
    for line in lines:
        assert not any(listed in line for listed in LISTED), line
        assert not PYTHON_WARNING.search(line), line


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fit_resumed_fit_and_compare_print_only_their_own_lines(digits_shards, tmp_path):
    first = run_cli(*fit_args(digits_shards, "--trainer.max_steps", "2"), cwd=tmp_path)
    assert_quiet(first)
    where = [line for line in printed(first) if line.startswith("W&B: ")]
    assert len(where) == 1 and "offline run in run/wandb/offline-run-" in where[0]
    assert "wandb sync run/wandb/offline-run-" in where[0]

    # in the middle of the epoch: Lightning warned that the loader is not resumable, and it is
    resumed = fit_args(digits_shards, "--trainer.max_steps", "3", "--ckpt_path", "last")
    resumed = run_cli(*resumed, cwd=tmp_path)
    assert_quiet(resumed)
    assert sum(line.startswith("W&B: ") for line in printed(resumed)) == 1
    assert any(line.startswith("Restored all states from the checkpoint at") for line in printed(resumed))

    suite = tmp_path / "suite.yaml"
    suite.write_text(
        "backbone: {variant: S/4, img_size: 32, width: 64, depth: 4, heads: 4}\n"
        f"data: {{train_urls: '{digits_shards}/train-{{000000..000001}}.tar', "
        f"test_urls: '{digits_shards}/val-000000.tar', image_size: 32, batch_size: 128, num_workers: 1}}\n"
        "protocols:\n"
        "  - {name: fewshot, kind: fewshot, feature: mean, shots: [1], seeds: [0]}\n"
        "  - {name: linear, kind: linear_probe, feature: mean, epochs: 1, lrs: [0.1]}\n"
    )
    compare = run_cli(
        "compare", "mpp=run/checkpoints/last.ckpt", "--suite", str(suite), "--out", "compare", cwd=tmp_path
    )
    assert_quiet(compare)
    assert not any("Trainer.fit` stopped" in line for line in printed(compare))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_verbose_shows_everything(digits_shards, tmp_path):
    proc = run_cli(*fit_args(digits_shards, "--trainer.max_steps", "1"), "--verbose", cwd=tmp_path)
    lines = printed(proc)
    assert any("GPU available:" in line for line in lines)
    assert any(line.startswith("wandb: ") for line in lines)
    assert any("Your `IterableDataset` has `__len__` defined" in line for line in lines)
    proc = run_cli(*fit_args(digits_shards, "--trainer.max_steps", "2", "--ckpt_path", "last"), cwd=tmp_path,
                   env={"SSL_VIT_VERBOSE": "1"})  # fmt: skip
    assert any("Seed set to" in line for line in printed(proc))


def test_hub_retry_lines_are_dropped_and_other_hub_warnings_kept(monkeypatch):
    """`evaluate timm:NAME` without a network: the Hub logs every retry of the download before the
    command's one line; those go, any other Hub warning stays."""
    import logging

    from ssl_vit.quiet import quiet

    monkeypatch.setenv("WANDB_QUIET", "false")  # quiet() only sets what is unset: nothing leaks
    monkeypatch.setenv("WANDB_SHOW_INFO", "true")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("huggingface_hub.utils._http")
    logger.addHandler(handler)
    try:
        quiet(verbose=False)
        logger.warning("'[Errno -2] Name or service not known' thrown while requesting HEAD https://hf.co/x")
        logger.warning("Retrying in 8s [Retry 5/5].")
        logger.warning("the token in HF_TOKEN is not valid")
    finally:
        logger.removeHandler(handler)
        for f in list(logger.filters):
            logger.removeFilter(f)
    assert [r.getMessage() for r in records] == ["the token in HF_TOKEN is not valid"]


def test_a_quiet_command_drops_wandbs_info_lines_and_keeps_its_warnings(tmp_path):
    """W&B's informational lines go (where the run is, `tracking.WandbLogger` says in one line); a W&B
    warning reports something the user may need to act on, and still shows."""
    import os
    import subprocess
    import sys

    script = (
        "from ssl_vit.quiet import quiet; quiet(False)\n"
        "import wandb; from wandb.errors import term\n"
        "wandb.setup(); term.termlog('an info line'); term.termwarn('a real problem')\n"
    )
    ours = ("WANDB_SHOW", "WANDB_QUIET", "WANDB_SILENT", "SSL_VIT_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(ours)}
    proc = subprocess.run([sys.executable, "-c", script], env={**env, "WANDB_MODE": "offline"}, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "wandb: WARNING a real problem" in proc.stderr
    assert "an info line" not in proc.stderr + proc.stdout
