"""benchmarks/peers/init_ablation.py at a tiny size: ssl-vit's MAE of the study's recipe trained in the
peers' harness with each start of its encoder, each encoder exported with what that start fixes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from timm.layers import build_sincos2d_pos_embed

from ssl_vit.targets.patches import patchify

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def init_ablation(monkeypatch):
    """benchmarks/peers/init_ablation.py imported, and forgotten again afterwards."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks/peers"))
    import init_ablation

    yield init_ablation
    sys.modules.pop("init_ablation", None)


def test_each_start_trains_and_exports_the_encoder_it_says(digits_shards, tmp_path):
    out = tmp_path / "init"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "benchmarks/peers"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "benchmarks/peers/init_ablation.py", "--steps", "2", "--no-compare",
         "--out", str(out), "--train-urls", str(digits_shards / "train-{000000..000004}.tar")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    sincos = build_sincos2d_pos_embed([7, 7], 96)  # the study's ViT: 28 px in 4-pixel patches, 96 wide
    encoders = {
        init: load_file(out / f"{init}_mae_0/encoder.safetensors")
        for init in ("timm", "mae", "sincos", "xavier")
    }
    for init, weights in encoders.items():
        fixed = torch.equal(weights["pos_embed"][0, 1:], sincos)  # after 2 steps: never trained
        assert fixed == (init in ("mae", "sincos")), init
        assert json.loads((out / f"{init}_mae_0/train.json").read_text())["steps"] == 2
    # xavier-uniform (bound sqrt(6 / (96 + 288)) = 0.125) against timm's normals of std 0.02
    qkv = {init: weights["blocks.0.attn.qkv.weight"] for init, weights in encoders.items()}
    assert qkv["mae"].std() > 0.05 and qkv["xavier"].std() > 0.05
    assert qkv["timm"].std() < 0.03 and qkv["sincos"].std() < 0.03


def test_the_harness_builds_ssl_vits_simmim_with_the_recipes_cells(monkeypatch):
    """ssl-vit's SimMIM in the peers' harness masks the study recipe's 4-pixel cells (the bench's own
    default there would be one 28-pixel cell: the whole image)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks/peers"))
    import quality
    from common import sslvit

    recipe = quality.study_recipe("simmim")
    assert recipe["choices"] == {"cell_size": 4}
    task = sslvit("simmim", recipe["settings"], **recipe["choices"]).model
    assert task.cell_size == 4 and task.mask_shape == "cells"
    assert quality.study_recipe("mae")["choices"] == {}


def test_the_ablation_can_swap_the_target(init_ablation):
    """`--target pixels`: ssl-vit's MAE regressing raw pixels, as lightly's MAE does (its run and row
    named after the target), the rest of the recipe as it is."""
    import quality

    recipe = quality.study_recipe("mae")
    raw = init_ablation.adapter("mae", recipe["choices"], "pixels")
    assert raw.PEER == "ssl-vit-mae-pixels"
    assert raw.build("mae", recipe["settings"]).model.target_kind == "pixels"
    preset = init_ablation.adapter("mae", recipe["choices"])
    assert preset.PEER == "ssl-vit-mae"
    assert preset.build("mae", recipe["settings"]).model.target_kind == "norm_pixels"


def test_the_ablation_regresses_the_seen_image_as_the_simmim_preset_does(init_ablation):
    """`--target seen_pixels` is the package's target (the `simmim` preset's), not one of the harness's:
    the ablation of a MAE on it and the preset's SimMIM predict the same patches of the standardised
    input."""
    import quality

    recipe = quality.study_recipe("mae")
    seen = (
        init_ablation.adapter("mae", recipe["choices"], "seen_pixels").build("mae", recipe["settings"]).model
    )
    simmim = quality.study_recipe("simmim")
    preset = init_ablation.adapter("timm", simmim["choices"]).build("simmim", simmim["settings"]).model
    assert seen.target_kind == preset.target_kind == "seen_pixels"
    images = torch.randn(2, 3, 28, 28)
    for task in (seen, preset):  # the model input's own patches, not RGB in [0, 1] (`pixels`)
        assert torch.equal(task.target.make(task.context, images), patchify(images, 4))


def test_the_ablation_can_start_simmims_head_either_way(init_ablation):
    """`--head xavier` (ssl-vit's SimMIM until 2026-12-07; `PatchHead`'s own start, bound
    sqrt(6 / (96 + 48)) = 0.20, zero bias) against the preset's `torch` (PyTorch's `nn.Linear` start,
    uniform within 1/sqrt(96), as SimMIM's code and stable-pretraining's); the run named after it."""
    import quality

    recipe = quality.study_recipe("simmim")
    xavier = init_ablation.adapter("timm", recipe["choices"], "seen_pixels", "xavier")
    assert xavier.PEER == "ssl-vit-timm-seen_pixels-xavier-head"
    proj = xavier.build("simmim", recipe["settings"]).model.head.proj
    assert proj.weight.abs().max() > 0.15 and not proj.bias.any()
    preset = init_ablation.adapter("timm", recipe["choices"]).build("simmim", recipe["settings"]).model
    assert preset.hparams.head_init == "torch"
    assert preset.head.proj.weight.abs().max() <= 96**-0.5 and preset.head.proj.bias.abs().max() > 0


def test_a_comparison_of_some_peers_keeps_the_claims_of_its_rows(monkeypatch, tmp_path):
    """quality.py with `--peers adapter_stable_pretraining --methods simmim` compares two rows: the claims
    it gives `ssl-vit compare` are those two rows' only (the others name rows not compared, which
    `compare` refuses)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks/peers"))
    import quality
    import yaml

    groups = {"simmim": ["a"], "stable-pretraining_simmim": ["b"]}
    written = yaml.safe_load(quality.claims_of(groups, tmp_path / "claims.yaml").read_text())
    assert [(c["rows"], c["against"]) for c in written["claims"]] == [
        (["simmim"], ["stable-pretraining_simmim"])
    ]
    every = {name: ["x"] for name in ("mae", "simmim", "lightly_mae", "stable-pretraining_mae")}
    every.update(lightly_simmim=["y"], **groups)
    assert len(yaml.safe_load(quality.claims_of(every, tmp_path / "all.yaml").read_text())["claims"]) == 4
    assert quality.claims_of({"mae": ["a"]}, tmp_path / "none.yaml") is None  # no peer: no claim to read
    # a claim may list its rows (`rows: [mae, simmim]`): the compared ones stay
    monkeypatch.setattr(quality, "CLAIMS", tmp_path / "listed.yaml")
    (tmp_path / "listed.yaml").write_text(
        "claims:\n- says: x\n  rows: [mae, simmim]\n  against: [lightly_mae]\n"
    )
    kept = yaml.safe_load(
        quality.claims_of({"simmim": [], "lightly_mae": []}, tmp_path / "k.yaml").read_text()
    )
    assert [(c["rows"], c["against"]) for c in kept["claims"]] == [(["simmim"], ["lightly_mae"])]


@pytest.mark.parametrize("option", ["--seeds", "--peer-seeds"])
def test_quality_refuses_a_run_given_twice(monkeypatch, capsys, option):
    """`--peer-seeds 0 0` would put one encoder in a row twice, and the intervals would count it as two
    runs (falsely narrow): one line, before anything trains."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks/peers"))
    import quality

    with pytest.raises(SystemExit) as exit:
        quality.main([option, "0", "0", "--no-compare"])
    assert exit.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(f"{option} 0 0: give each once")
