"""Checkpoints and run configs written before the package's modules moved (tests/fixtures/before_refactor:
one tiny run of each task kind, two steps each, written by `ssl-vit fit` of the quickstart recipes before
the move; their config.yaml names `ssl_vit.tasks.checkpointing.SafeCheckpointIO` and the tasks by their
old paths) still load, export, show in `info` and resume from their own config.yaml."""

import shutil
from pathlib import Path

import pytest
import torch
import yaml
from cli_helpers import run_cli

from ssl_vit.checkpoints import load_backbone

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "before_refactor"
KINDS = ["mpp", "supervised", "linear_probe", "finetune"]


@pytest.mark.parametrize("kind", KINDS)
def test_an_old_checkpoint_loads_shows_and_exports(kind, tmp_path):
    ckpt = FIXTURES / kind / "last.ckpt"
    backbone, config = load_backbone(str(ckpt))
    assert config.width == 32 and config.depth == 1
    state = torch.load(ckpt, weights_only=True, map_location="cpu")["state_dict"]
    torch.testing.assert_close(backbone.state_dict()["pos_embed"], state["backbone.pos_embed"])
    info = run_cli("info", str(ckpt))
    assert "backbone: S/4 (width 32, depth 1" in info.stdout, info.stdout
    assert "skipped steps: 0" in info.stdout, info.stdout
    run_cli("export", str(ckpt), str(tmp_path / "vit.safetensors"), "--format", "timm")
    assert (tmp_path / "vit.safetensors").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_an_old_run_resumes_from_its_own_config(kind, digits_shards, tmp_path):
    """The old runs as they were laid out (`runs/before_refactor/KIND/{config.yaml,checkpoints/}`, the
    digits at `data/shards/digits`), resumed by the command a user types: `ssl-vit fit --config
    runs/before_refactor/KIND/config.yaml --ckpt_path last`, one more epoch. Its class paths resolve,
    the task is rebuilt from the checkpoint, and training goes on from step 2 to step 4. Its data options
    written flat are read in their groups (`ssl_vit.cli.moved_options`), and written so anew."""
    for name in KINDS:
        (tmp_path / "runs/before_refactor" / name / "checkpoints").mkdir(parents=True)
        shutil.copy(FIXTURES / name / "last.ckpt", tmp_path / "runs/before_refactor" / name / "checkpoints")
        shutil.copy(FIXTURES / name / "config.yaml", tmp_path / "runs/before_refactor" / name)
    (tmp_path / "data/shards").mkdir(parents=True)
    (tmp_path / "data/shards/digits").symlink_to(digits_shards)
    config = f"runs/before_refactor/{kind}/config.yaml"
    run_cli("fit", "--config", config, "--trainer.max_epochs", "2", "--ckpt_path", "last", cwd=tmp_path)
    last = tmp_path / "runs/before_refactor" / kind / "checkpoints/last.ckpt"
    assert torch.load(last, weights_only=True, map_location="cpu")["global_step"] == 4
    data = yaml.safe_load((tmp_path / config).read_text())["data"]["init_args"]
    old = yaml.safe_load((FIXTURES / kind / "config.yaml").read_text())["data"]["init_args"]
    assert data["augment"]["train_preset"] == old["train_preset"] and "train_preset" not in data


@pytest.mark.parametrize("old", sorted(__import__("ssl_vit._aliases", fromlist=["MOVED"]).MOVED))
def test_every_old_module_path_is_the_new_module(old):
    """Each old path imports the module now at its new path, the same object (so a class has one
    identity whichever path named it), and its attributes through `from OLD import NAME`."""
    import importlib

    from ssl_vit._aliases import MOVED

    module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED[old])
    public = [name for name in vars(module) if not name.startswith("_")]
    exec(f"from {old} import {public[0]}", {})


@pytest.mark.parametrize("old", ["ssl_vit.tasks.checkpointing", "ssl_vit.run.checkpointing"])
def test_the_checkpoint_plugin_keeps_its_old_class_paths(old):
    """Run configs name the checkpoint plugin by the path it had when they were written (the fixtures'
    config.yaml: ssl_vit.tasks.checkpointing; every run's before it moved: ssl_vit.run.checkpointing)."""
    from ssl_vit.checkpoints.store import SafeCheckpointIO
    from ssl_vit.cli.config_errors import import_class

    assert import_class(f"{old}.SafeCheckpointIO") is SafeCheckpointIO


@pytest.mark.parametrize(
    "old",
    [
        "ssl_vit.outdir", "ssl_vit.lock", "ssl_vit.data.remote", "ssl_vit.run_lock", "ssl_vit.data.samples",
        "ssl_vit.run.checkpointing",
    ],
)  # fmt: skip
def test_an_old_path_imported_from_code_warns_naming_the_new_one(old, monkeypatch):
    """Code that imports a module by its old path is told where it went (a `DeprecationWarning` naming
    the new path, attributed to the importing line), and still gets the module."""
    import importlib
    import sys

    from ssl_vit._aliases import MOVED

    monkeypatch.delitem(sys.modules, old, raising=False)  # imported once already: no second import
    script: dict = {}
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {MOVED[old]}: import {MOVED[old]}") as seen:
        exec(compile(f"import {old} as module", "script.py", "exec"), script)
    assert script["module"] is importlib.import_module(MOVED[old])
    assert [(w.filename, w.lineno) for w in seen if w.category is DeprecationWarning] == [("script.py", 1)]
