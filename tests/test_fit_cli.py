"""`ssl-vit fit` the way users run it: recipes, the quickstart, two-node DDP through torchrun."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch
import yaml
from cli_helpers import free_port, run_cli, torchrun, torchrun_env, wandb_records

from ssl_vit.cli import main

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(p for p in (ROOT / "recipes").rglob("*.yaml") if p.read_text().startswith("# ssl-vit fit"))


def test_there_are_recipes_for_every_method():
    names = {p.relative_to(ROOT / "recipes").as_posix() for p in RECIPES}
    assert {
        "quickstart/mpp.yaml",
        "quickstart/mae.yaml",
        "quickstart/supervised.yaml",
        "vit_paper/mpp_b16.yaml",
        "vit_paper/supervised_b16_in21k.yaml",
        "mae/b16_in1k.yaml",
        "mae/l16_in1k.yaml",
        "simmim/b16_in1k.yaml",
        "maskfeat/b16_in1k.yaml",
        "ijepa/b16_in1k.yaml",
        "data2vec2/b16_in1k.yaml",
    } <= names


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.relative_to(ROOT / "recipes").as_posix())
def test_every_recipe_parses_with_print_config(recipe, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(recipe), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = capsys.readouterr().out
    assert "class_path: ssl_vit.tasks." in printed
    # The image size is given once, by the data, and linked into the backbone.
    assert "image_size:" in printed


PRETRAINING = [p for p in RECIPES if "Pretraining" in p.read_text()]


@pytest.mark.parametrize("recipe", PRETRAINING, ids=lambda p: p.relative_to(ROOT / "recipes").as_posix())
def test_every_pretraining_recipe_checkpoints_by_steps_and_guards_nans(recipe, capsys, monkeypatch):
    """A preemption loses minutes, not an epoch: the periodic checkpoint is step-based. A loss spike or a
    NaN rolls a long run back to its last checkpoint; the CPU recipes of minutes skip a NaN step."""
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(recipe), "--print_config"])
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["checkpoint"]["every_n_train_steps"] > 0
    assert config["checkpoint"]["save_last"] == "link"
    short = recipe.parent.name in ("quickstart", "study")
    assert config["nonfinite"]["policy"] == ("skip" if short else "rollback")


def quickstart_overrides(shards: Path) -> list[str]:
    return [
        "--data.init_args.train_urls",
        str(shards / "train-{000000..000004}.tar"),
        "--data.init_args.val_urls",
        str(shards / "val-{000000..000003}.tar"),
        "--data.init_args.num_workers",
        "0",
    ]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", [f"quickstart/{name}.yaml" for name in ("mpp", "mae", "supervised")])
def test_quickstart_recipes_run_fast_dev_run(recipe, digits_shards, tmp_path, cli):
    proc = cli(
        "fit",
        "--config",
        str(ROOT / "recipes" / recipe),
        *quickstart_overrides(digits_shards),
        "--trainer.fast_dev_run",
        "2",
        "--trainer.default_root_dir",
        str(tmp_path / "run"),
        cwd=ROOT,
    )
    assert "fast_dev_run" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_maskfeat_learns_the_hog_of_digits_and_its_features_stay_healthy(digits_shards, tmp_path, cli):
    """MaskFeat (HOG targets of 4-pixel patches: one cell each) on the quickstart's tiny ViT, 16 steps:
    the loss falls, the collapse watch logs its statistics every 2 steps and lets the run finish."""
    run = tmp_path / "run"
    cli(
        "fit", "--config", str(ROOT / "recipes/quickstart/mae.yaml"), *quickstart_overrides(digits_shards),
        "--model.init_args.preset", "maskfeat", "--data.init_args.train_batches", "16",
        "--trainer.max_epochs", "1", "--trainer.limit_val_batches", "0", "--trainer.log_every_n_steps", "2",
        "--model.init_args.picture_every_n_steps", "8", "--trainer.default_root_dir", str(run), cwd=ROOT,
    )  # fmt: skip
    [(_, records)] = wandb_records(run)
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    losses = [h["train/loss"] for h in history if "train/loss" in h]
    assert len(losses) == 8 and all(map(math.isfinite, losses))
    assert max(losses[-2:]) < min(losses[:2]) / 2, losses
    health = [h for h in history if "health/feature_std" in h]
    assert len(health) == 8
    # 0.039 -> 0.021 and 6.6 -> 2.5 (erank of uncentred features: their shared mean dominates) here
    assert all(h["health/feature_std"] > 5e-3 and h["health/effective_rank"] > 2 for h in health), health


@pytest.mark.slow
@pytest.mark.parametrize(
    "scope, backend, line",
    [
        ("blocks", "inductor", "torch.compile (default): 6 transformer blocks"),
        ("step", "aot_eager", "torch.compile (aot_eager backend): the whole training step of MaskedPatch"),
    ],
)
def test_fit_compiles_the_blocks_or_the_whole_step(scope, backend, line, digits_shards, tmp_path, cli):
    """Inductor's kernels for a whole step are checked against eager in `tasks/test_gpu_path.py`; here
    the step runs through aot_eager, whose graphs are the same (inductor took 40 s to compile the
    quickstart MAE step on 2 CPU cores)."""
    proc = cli(
        "fit", "--config", str(ROOT / "recipes/quickstart/mae.yaml"), *quickstart_overrides(digits_shards),
        "--compile.enabled", "true", "--compile.scope", scope, "--compile.backend", backend,
        "--trainer.fast_dev_run", "2", "--trainer.default_root_dir", str(tmp_path / "run"), cwd=ROOT,
    )  # fmt: skip
    assert line in proc.stderr
    assert "fast_dev_run" in proc.stdout + proc.stderr


def test_bad_recipe_value_is_a_clear_error(cli, tmp_path):
    proc = cli(
        "fit",
        "--config",
        str(ROOT / "recipes/quickstart/mpp.yaml"),
        "--model.init_args.preset",
        "beit",
        "--trainer.default_root_dir",
        str(tmp_path),
        check=False,
        cwd=ROOT,
    )
    assert proc.returncode != 0
    assert "beit" in proc.stderr and "vit_mpp" in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_torchrun_two_nodes_ddp_fit_writes_one_checkpoint_and_one_wandb_run(digits_shards, tmp_path):
    run_dir, port = tmp_path / "run", free_port()
    env = torchrun_env()
    args = [
        "fit",
        "--config",
        str(ROOT / "recipes/quickstart/mpp.yaml"),
        *quickstart_overrides(digits_shards),
        "--trainer.num_nodes",
        "2",
        "--trainer.devices",
        "1",
        "--trainer.strategy",
        "ddp",
        "--trainer.max_epochs",
        "1",
        "--data.init_args.train_batches",
        "3",
        "--trainer.log_every_n_steps",
        "1",
        "--trainer.default_root_dir",
        str(run_dir),
        "--model.init_args.picture_every_n_steps",
        "2",
    ]
    options = ["--nnodes", "2", "--nproc_per_node", "1", "--master_addr", "127.0.0.1"]
    options += ["--master_port", str(port)]
    nodes = [
        subprocess.Popen(
            [*torchrun(*options, "--node_rank", str(rank)), *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=400)[0] for node in nodes]
    for node, output in zip(nodes, outputs):
        assert node.returncode == 0, output[-4000:]

    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert "last.ckpt" in checkpoints and len(checkpoints) == 2  # last + the epoch's, written once (rank 0)
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    assert runs[0].name.endswith((run_dir / "wandb-run-id").read_text().strip())

    # The checkpoint's backbone is timm's, loaded safely.
    checkpoint = torch.load(run_dir / "checkpoints/last.ckpt", weights_only=True, map_location="cpu")
    assert checkpoint["hyper_parameters"]["backbone"]["variant"] == "S/4"
    assert checkpoint["hyper_parameters"]["_class_path"] == "ssl_vit.tasks.masked.MaskedPatchPretraining"
    backbone = {
        k.removeprefix("backbone."): v
        for k, v in checkpoint["state_dict"].items()
        if k.startswith("backbone.")
    }
    vit = timm.create_model(
        "vit_small_patch16_224", num_classes=0, img_size=32, patch_size=4, embed_dim=64, depth=4, num_heads=4
    )
    vit.load_state_dict(backbone, strict=True)

    # The offline run holds the config and the metrics, read back with wandb's own reader.
    summary = subprocess.run(
        [str(Path(sys.executable).parent / "wandb"), "leet", "inspect", "--summary", "--json", str(runs[0])],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    summary = json.loads(summary)
    text = json.dumps(summary)
    for key in ("train/loss", "val/loss", "perf/images_per_s", "lr-AdamW"):
        assert key in text, key
    assert "S/4" in text and "vit_mpp" in text

    # `ssl-vit validate --ckpt_path` rebuilds the task from the checkpoint's hyperparameters.
    recipe = str(ROOT / "recipes/quickstart/mpp.yaml")
    proc = run_cli(
        "validate", "--config", recipe, *quickstart_overrides(digits_shards),
        "--ckpt_path", str(run_dir / "checkpoints/last.ckpt"), "--trainer.logger", "false",
        "--trainer.default_root_dir", str(tmp_path / "validate"), cwd=ROOT,
    )  # fmt: skip
    assert "val/masked_accuracy" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_quickstart_pretrains_three_ways_and_compares_against_three_scratch_inits(
    digits_shards, tmp_path, cli
):
    """`make quickstart`, shrunk: the three quickstart recipes (2 blocks, 4 steps), then `compare` with
    the quickstart suite (fewer shots and seeds, one probe epoch), 3 scratch inits, `--baseline scratch`."""
    tiny = ["--model.init_args.backbone.depth", "2", "--trainer.max_steps", "4", "--trainer.max_epochs", "1"]
    ckpts = {}
    for name in ("mpp", "mae", "supervised"):
        run = tmp_path / name
        cli(
            "fit", "--config", str(ROOT / f"recipes/quickstart/{name}.yaml"),
            *quickstart_overrides(digits_shards), *tiny, "--trainer.default_root_dir", str(run),
            "--trainer.logger", "false", "--trainer.callbacks", "[]", "--trainer.limit_val_batches", "0",
            cwd=ROOT,
        )  # fmt: skip
        ckpts[name] = run / "checkpoints" / "last.ckpt"
    suite = yaml.safe_load((ROOT / "recipes/eval/quickstart.yaml").read_text())
    suite["backbone"]["depth"] = 2
    suite["data"].update(
        train_urls=str(digits_shards / "train-{000000..000004}.tar"),
        test_urls=str(digits_shards / "val-{000000..000003}.tar"),
        num_workers=0,
    )
    for protocol in suite["protocols"]:
        protocol.update({"shots": [1, 5], "seeds": [0, 1]} if protocol["kind"] == "fewshot" else {})
        protocol.update({"epochs": 1} if protocol["kind"] == "linear_probe" else {})
    (tmp_path / "suite.yaml").write_text(yaml.safe_dump(suite))
    out = tmp_path / "compare"
    proc = cli(
        "compare", *[f"{name}={path}" for name, path in ckpts.items()], "--scratch", "3",
        "--baseline", "scratch", "--suite", str(tmp_path / "suite.yaml"), "--out", str(out),
    )  # fmt: skip
    table = (out / "results.md").read_text()
    assert table in proc.stdout
    main_table, differences = table.split("Paired differences against scratch")
    assert [line.split(" | ")[0] for line in main_table.splitlines()[2:6]] == [
        "| mpp", "| mae", "| supervised", "| scratch (3 runs)",
    ]  # fmt: skip
    columns = [f"fewshot_{k}shot" for k in (1, 5)] + [f"fewshot_heldout_{k}shot" for k in (1, 5)]
    columns += ["knn", "linear"]
    header = "| checkpoint | " + " | ".join(columns) + " | steps | images | FLOPs | time |"
    assert main_table.splitlines()[0] == header
    diff_rows = [line for line in differences.splitlines() if line.startswith("| ") and " [" in line]
    assert [row.split(" | ")[0] for row in diff_rows] == ["| mpp", "| mae", "| supervised"]
    for row in diff_rows:
        cells = row.strip("| ").split(" | ")[1:]
        assert len(cells) == len(columns) and all(c.split()[-1] in ("win", "loss", "noise") for c in cells)
    assert len(list((out / "scratch").glob("*/results.json"))) == 3
    assert "4 | " in main_table.splitlines()[2]  # mpp's cost: the 4 steps it trained


# The teacher presets on the quickstart's tiny backbone (4 blocks): data2vec 2.0's top 10 of 12 blocks
# become the top 3, its 16 views 2.
TEACHER_TINY = {
    "ijepa": [],
    "data2vec2": ["--model.init_args.teacher_top_k", "3", "--model.init_args.views", "2"],
}


def teacher_fit_args(shards: Path, run: Path, record: Path, preset: str, *extra: str) -> list[str]:
    """`ssl-vit fit` of a teacher preset on the quickstart MAE recipe, a few steps, each recorded."""
    return [
        "fit", "--config", str(ROOT / "recipes/quickstart/mae.yaml"), *quickstart_overrides(shards),
        "--model.init_args.preset", preset, *TEACHER_TINY[preset],
        "--data.init_args.batch_size", "32", "--trainer.limit_val_batches", "0",
        "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", str(run),
        "--trainer.callbacks+=resume_helpers.StepRecorder", "--trainer.callbacks.path", str(record), *extra,
    ]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["ijepa", "data2vec2"])
def test_teacher_presets_train_with_a_finite_falling_loss_and_checkpoint_the_teacher(
    preset, digits_shards, tmp_path, cli
):
    from resume_helpers import read_steps

    record, run = tmp_path / "steps.jsonl", tmp_path / "run"
    args = teacher_fit_args(digits_shards, run, record, preset)
    cli(*args, "--data.init_args.train_batches", "12", "--trainer.max_epochs", "1", cwd=ROOT)
    losses = [r["loss"] for r in read_steps(record)]
    assert len(losses) == 12 and all(map(math.isfinite, losses))
    assert sum(losses[-3:]) < sum(losses[:3]), losses
    checkpoint = torch.load(run / "checkpoints/last.ckpt", weights_only=True, map_location="cpu")
    state = checkpoint["state_dict"]
    teacher = {k.removeprefix("teacher."): v for k, v in state.items() if k.startswith("teacher.")}
    student = {k.removeprefix("backbone."): v for k, v in state.items() if k.startswith("backbone.")}
    assert teacher.keys() == student.keys()
    assert not torch.equal(teacher["blocks.0.attn.qkv.weight"], student["blocks.0.attn.qkv.weight"])
