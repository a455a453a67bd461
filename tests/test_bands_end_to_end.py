"""Five bands, end to end through the CLI, as a user of a multispectral set runs it: TIFFs whose class
only the 4th band carries (the other four are drawn alike for both classes, so a model that reads three
bands has nothing to go on) -> `ssl-vit data convert tiff:` -> `ssl-vit fit` of supervised pretraining
with `channels: 5` and `mean/std: auto` (its few-shot monitor on the same bands) -> `ssl-vit test` of its
classifier and `ssl-vit evaluate` with a linear probe and k-NN on the frozen backbone -> `ssl-vit
export`. Each beats chance (0.5) by far."""

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import tifffile
import yaml
from cli_helpers import run_cli
from safetensors import safe_open

ROOT = Path(__file__).resolve().parents[1]
SIGNAL_BAND = 3  # the 4th of 5
BANDS = 5
TINY = {"variant": "S/4", "img_size": 16, "width": 32, "depth": 2, "heads": 2}


def write_split(folder: Path, count: int, rng: np.random.Generator) -> None:
    """`count` 16 x 16 uint16 images of 5 bands, alternately `low` and `high`: band 3 near 1000 or 3000,
    the others drawn from one distribution for both classes; a flat folder with labels.csv."""
    folder.mkdir(parents=True)
    rows = ["filename,label"]
    for i in range(count):
        label = ("low", "high")[i % 2]
        image = rng.normal(2000, 500, (16, 16, BANDS)).clip(0, 65535)
        image[:, :, SIGNAL_BAND] = rng.normal(1000 if label == "low" else 3000, 300, (16, 16))
        tifffile.imwrite(folder / f"{i:03d}.tif", image.astype(np.uint16), photometric="minisblack")
        rows.append(f"{i:03d}.tif,{label}")
    (folder / "labels.csv").write_text("\n".join(rows) + "\n")


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("signal")
    rng = np.random.default_rng(0)
    for split, count in (("train", 96), ("test", 48)):
        write_split(root / "tifs" / split, count, rng)
        run_cli(
            "data", "convert", f"tiff:{root / 'tifs' / split}", str(root / "shards"), "--split", split,
            "--shard-size", "32", "--no-progress",
        )  # fmt: skip
    return root / "shards"


def fit_args(shards: Path, run: Path) -> list[str]:
    return [
        "--config", str(ROOT / "recipes/quickstart/supervised.yaml"),
        "--data.init_args.train_urls", str(shards / "train-{000000..000002}.tar"),
        "--data.init_args.val_urls", str(shards / "test-{000000..000001}.tar"),
        "--data.init_args.classes", "null",
        "--data.init_args.channels", "5", "--data.init_args.mean", "auto", "--data.init_args.std", "auto",
        "--data.init_args.image_size", "16", "--data.init_args.batch_size", "16",
        "--data.init_args.num_workers", "0", "--data.init_args.augment.label_smoothing", "0.0",
        "--model.init_args.backbone", json.dumps(TINY), "--trainer.logger", "false",
        "--trainer.default_root_dir", str(run),
    ]  # fmt: skip


@pytest.mark.slow
def test_five_bands_fit_test_probe_and_export_beat_chance(shards, tmp_path):
    run = tmp_path / "run"
    run_cli("fit", *fit_args(shards, run), "--trainer.max_steps", "60", cwd=ROOT)
    ckpt = run / "checkpoints" / "last.ckpt"

    # the supervised classifier itself, on the test split
    out = tmp_path / "test"
    out.mkdir()
    run_cli(
        "test", *fit_args(shards, run), "--ckpt_path", str(ckpt),
        "--data.init_args.test_urls", str(shards / "test-{000000..000001}.tar"),
        "--trainer.logger", "pytorch_lightning.loggers.CSVLogger",
        "--trainer.logger.init_args.save_dir", str(out), "--trainer.logger.init_args.name", "test", cwd=out,
    )  # fmt: skip
    (metrics,) = csv.DictReader(next(out.glob("test/version_*/metrics.csv")).open())
    assert float(metrics["test/accuracy"]) > 0.9, metrics

    # frozen features of the 5-band backbone: a linear probe and k-NN
    suite = tmp_path / "suite.yaml"
    suite.write_text(
        yaml.safe_dump(
            {
                "backbone": TINY,
                "data": {
                    "train_urls": str(shards / "train-{000000..000002}.tar"),
                    "test_urls": str(shards / "test-{000000..000001}.tar"),
                    "image_size": 16, "batch_size": 32, "num_workers": 0,
                    "channels": 5, "mean": "auto", "std": "auto",
                },
                "protocols": [
                    {"name": "linear", "kind": "linear_probe", "feature": "mean", "epochs": 10,
                     "lrs": [0.1, 1.0]},
                    {"name": "knn", "kind": "knn", "feature": "mean", "k": 5},
                ],
            }
        )
    )  # fmt: skip
    run_cli("evaluate", str(ckpt), "--suite", str(suite), "--out", str(tmp_path / "eval"))
    results = json.loads((tmp_path / "eval" / "results.json").read_text())["results"]
    assert results["linear"] > 0.9 and results["knn"] > 0.9, results

    # the export keeps the five bands
    exported = tmp_path / "vit5.safetensors"
    proc = run_cli("export", str(ckpt), str(exported), "--format", "timm")
    assert "in_chans=5" in proc.stdout or "5, 16, 16" in proc.stdout, proc.stdout
    with safe_open(str(exported), "pt") as f:
        assert f.get_slice("patch_embed.proj.weight").get_shape()[1] == BANDS
