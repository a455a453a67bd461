"""The 13-band recipe (recipes/mae/eurosat_ms.yaml) through the same CLI as RGB, on a tree in EuroSAT_MS's
layout: `data convert eurosat:` -> `fit` of the recipe itself (its data, trainer and few-shot monitor,
with only the sizes, the device and the paths overridden) -> `evaluate` of its checkpoint with a 13-band
suite -> `export` -> `info` of the export. What it checks is the plumbing of 13 bands at 16 bits, not
accuracy (the 5-band end-to-end test checks that a model reads every band)."""

import json
from pathlib import Path

import pytest
import torch
import yaml
from bands_helpers import fake_eurosat
from cli_helpers import run_cli
from safetensors import safe_open

ROOT = Path(__file__).resolve().parents[2]
TINY = {"variant": "S/8", "img_size": 32, "width": 32, "depth": 2, "heads": 2}


@pytest.mark.slow
def test_the_13_band_recipe_pretrains_evaluates_and_exports(tmp_path):
    fake_eurosat(tmp_path / "EuroSAT", per_class=4)
    shards = tmp_path / "shards"
    for split in ("train", "val"):
        run_cli("data", "convert", f"eurosat:{tmp_path / 'EuroSAT'}", str(shards), "--split", split,
                "--shard-size", "16", "--no-progress")  # fmt: skip
    manifest = json.loads((shards / "train.json").read_text())
    assert manifest["channels"] == 13 and manifest["dtype"] == "uint16"
    train, val = (
        str(shards / f"{split}-{{000000..{len(list(shards.glob(f'{split}-*.tar'))) - 1:06d}}}.tar")
        for split in ("train", "val")
    )

    run = tmp_path / "run"
    run_cli(
        "fit", "--config", str(ROOT / "recipes/mae/eurosat_ms.yaml"),
        "--data.init_args.train_urls", train, "--data.init_args.val_urls", val,
        "--data.init_args.image_size", "32", "--data.init_args.batch_size", "8",
        "--data.init_args.num_workers", "0", "--data.init_args.stream.shuffle_buffer", "16",
        "--trainer.callbacks.init_args.train_urls", train, "--trainer.callbacks.init_args.test_urls", val,
        "--trainer.callbacks.init_args.shots", "[1]", "--trainer.callbacks.init_args.batch_size", "16",
        "--model.init_args.backbone", json.dumps(TINY),
        "--model.init_args.decoder_dim", "32", "--model.init_args.decoder_depth", "1",
        "--model.init_args.decoder_heads", "2",
        "--model.init_args.training.optimizer.init_args.fused", "false",
        "--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.strategy", "auto",
        "--trainer.precision", "32-true", "--trainer.max_epochs", "1", "--trainer.max_steps", "2",
        "--trainer.limit_val_batches", "1", "--trainer.logger", "false",
        "--trainer.default_root_dir", str(run), cwd=tmp_path,
    )  # fmt: skip
    ckpt = run / "checkpoints" / "last.ckpt"
    assert ckpt.exists()
    weights = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    (patch_embed,) = [v for k, v in weights.items() if k.endswith("patch_embed.proj.weight")]
    assert patch_embed.shape[1] == 13  # the backbone's in_chans, linked from data.channels

    suite = tmp_path / "suite.yaml"
    suite.write_text(yaml.safe_dump({
        "backbone": TINY,
        "data": {"train_urls": train, "test_urls": val, "image_size": 32, "batch_size": 16,
                 "num_workers": 0, "channels": 13, "mean": "auto", "std": "auto"},
        "protocols": [{"name": "knn", "kind": "knn", "feature": "mean", "k": 1}],
        "resamples": 100,
    }))  # fmt: skip
    run_cli("evaluate", str(ckpt), "--suite", str(suite), "--out", str(tmp_path / "eval"))
    results = json.loads((tmp_path / "eval" / "results.json").read_text())["results"]
    # Every band of the fake carries 1000 * band + class, so 1-NN on 13 standardised bands finds the class.
    assert results["knn"] > 0.5, results

    exported = tmp_path / "vit13.safetensors"
    run_cli("export", str(ckpt), str(exported), "--format", "timm")
    with safe_open(str(exported), "pt") as f:
        assert f.get_slice("patch_embed.proj.weight").get_shape()[1] == 13
    info = run_cli("info", str(exported))
    assert "32 px, 13 bands, cls pooling" in info.stdout, info.stdout
