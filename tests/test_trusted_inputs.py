"""Recipes and suites are trusted (they may run commands through `pipe:` URLs); manifests and
checkpoints are data: nothing in them reaches a shell or chooses code to run. And a checkpoint that is
resumed decides the model: a command-line model option it would silently override is refused."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from cli_helpers import one_step_fit_args, run_cli
from test_errors import error_line, listing

ROOT = Path(__file__).resolve().parents[1]


def fit_args(shards: Path, run: Path, *extra: str) -> list[str]:
    return one_step_fit_args(shards, run, "--trainer.logger", "false", *extra)


@pytest.fixture(scope="module")
def checkpoint(digits_shards, tmp_path_factory) -> Path:
    """A real one-step quickstart MPP checkpoint (width 64)."""
    run = tmp_path_factory.mktemp("trusted") / "run"
    run_cli(*fit_args(digits_shards, run), cwd=ROOT)
    return run / "checkpoints" / "last.ckpt"


@pytest.mark.slow
def test_resume_refuses_a_model_option_the_checkpoint_would_override(digits_shards, checkpoint, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(checkpoint.parent, run / "checkpoints")
    before = listing(tmp_path)
    for ckpt in (str(run / "checkpoints/last.ckpt"), "last"):
        proc = run_cli(
            *fit_args(digits_shards, run, "--model.init_args.backbone.width", "32", "--ckpt_path", ckpt),
            cwd=ROOT, check=False,
        )  # fmt: skip
        error_line(
            proc, "--model.init_args.backbone.width 32 contradicts --ckpt_path", "whose model has 64",
            "--model.init_args.training.init_from",
        )  # fmt: skip
        assert listing(tmp_path) == before  # nothing written, the checkpoints untouched
    # The same option with the checkpoint's own value is not a contradiction: the run resumes.
    run_cli(*fit_args(digits_shards, run, "--model.init_args.backbone.width", "64", "--ckpt_path", "last",
                      "--trainer.max_epochs", "2"), cwd=ROOT)  # fmt: skip
    assert torch.load(run / "checkpoints/last.ckpt", weights_only=True)["global_step"] == 2


@pytest.mark.slow
def test_a_checkpoint_never_chooses_the_class_to_run(digits_shards, checkpoint, tmp_path):
    marker = tmp_path / "MARKER"
    state = torch.load(checkpoint, weights_only=True)
    state["hyper_parameters"]["_class_path"] = "subprocess.Popen"
    state["hyper_parameters"]["args"] = ["touch", str(marker)]
    evil = tmp_path / "evil.ckpt"
    torch.save(state, evil)
    proc = run_cli(
        *fit_args(digits_shards, tmp_path / "run", "--ckpt_path", str(evil)),
        cwd=ROOT,
        check=False,
    )
    error_line(proc, "names the model class 'subprocess.Popen'", "ssl_vit.tasks")
    assert not marker.exists() and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_manifest_never_reaches_a_shell(digits_shards, tmp_path):
    """URLs come from the recipe only: a manifest's shard names (`pipe:...`) are never opened."""
    shards = tmp_path / "shards"
    shutil.copytree(digits_shards, shards)
    marker = tmp_path / "MARKER"
    for split in ("train", "val"):
        manifest = json.loads((shards / f"{split}.json").read_text())
        for shard in manifest["shards"]:
            shard["url"] = f"pipe:touch {marker}; cat {shards / shard['url']}"
        (shards / f"{split}.json").write_text(json.dumps(manifest))
    run_cli("data", "inspect", str(shards / "val-{000000..000003}.tar"), cwd=tmp_path, check=False)
    run_cli(*fit_args(shards, tmp_path / "run", "--trainer.fast_dev_run", "1"), cwd=ROOT)
    assert not marker.exists()
