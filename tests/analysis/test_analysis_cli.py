"""`ssl-vit analyze` the way users run it: on a masked-pretraining checkpoint trained by `ssl-vit fit`
(the quickstart recipe, shrunk), on a supervised GAP checkpoint, on the digits shards."""

import json
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from cli_helpers import run_cli
from PIL import Image

from ssl_vit.analysis.analyze import analyze
from ssl_vit.models.vit import ViTConfig
from ssl_vit.storage.outdir import MARKER, is_ours, mark
from ssl_vit.tasks import MaskedPatchPretraining, SupervisedPretraining
from ssl_vit.tasks.base import Training

ROOT = Path(__file__).resolve().parents[2]
DEPTH, HEADS, GRID, PATCH = 2, 2, 8, 4  # the quickstart's S/4 at 32 px, narrowed and shortened
PLOT = (600, 450)  # matplotlib pictures: 6 x 4.5 inches at 100 dpi


@pytest.fixture(scope="module")
def mpp_ckpt(digits_shards, tmp_path_factory):
    run = tmp_path_factory.mktemp("mpp")
    run_cli(
        "fit", "--config", str(ROOT / "recipes/quickstart/mpp.yaml"),
        "--data.init_args.train_urls", str(digits_shards / "train-{000000..000004}.tar"),
        "--data.init_args.val_urls", str(digits_shards / "val-{000000..000003}.tar"),
        "--data.init_args.num_workers", "0",
        "--model.init_args.backbone.width", "32",
        "--model.init_args.backbone.depth", str(DEPTH),
        "--model.init_args.backbone.heads", str(HEADS),
        "--trainer.max_steps", "20", "--trainer.limit_val_batches", "0", "--trainer.logger", "false",
        "--trainer.default_root_dir", str(run),
    )  # fmt: skip
    return run / "checkpoints/last.ckpt"


@pytest.fixture(scope="module")
def gap_ckpt(tmp_path_factory):
    """An untrained supervised checkpoint pooling by global average (no [class] token)."""
    torch.manual_seed(0)
    model = SupervisedPretraining(
        ViTConfig("S/8", 32, width=32, depth=1, heads=2, pooling="gap"), num_classes=10
    )
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, max_steps=0)
    trainer.strategy.connect(model)
    path = tmp_path_factory.mktemp("gap") / "sup.ckpt"
    trainer.save_checkpoint(path)
    return path


def val(shards: Path) -> str:
    return str(shards / "val-{000000..000003}.tar")


def size(path: Path) -> tuple[int, int]:
    with Image.open(path) as image:
        image.verify()  # a complete, valid PNG
        assert image.format == "PNG"
        return image.size


def grid_size(count: int, columns: int, tile: int, padding: int) -> tuple[int, int]:
    """torchvision's make_grid of `count` square tiles."""
    rows = -(-count // columns)
    return columns * (tile + padding) + padding, rows * (tile + padding) + padding


def test_analyze_a_masked_pretraining_checkpoint(mpp_ckpt, digits_shards, tmp_path, cli):
    out = tmp_path / "analysis" / "mpp"
    proc = cli("analyze", str(mpp_ckpt), "--data", val(digits_shards), "--out", str(out), "--images", "100")
    assert "mean attention distance per block" in proc.stdout and f"wrote {out}" in proc.stdout
    record = json.loads((out / "analysis.json").read_text())
    assert record["images"] == 100 and record["backbone"]["variant"] == "S/4"

    expected = {
        "attention_distance.png": PLOT,
        "position_embeddings.png": PLOT,
        # 28 components of 4 x 4 pixels, enlarged 16 times, 7 a row, 2-pixel gaps
        "patch_embedding_pcs.png": grid_size(28, 7, 64, 2),
        # 8 images of 32 pixels enlarged twice, above their rollout
        "attention_rollout.png": grid_size(16, 8, 64, 2),
        # masked_prediction_picture (inputs, true and predicted colours, 1-pixel gaps) enlarged twice
        "masked_predictions.png": tuple(2 * side for side in grid_size(24, 8, 32, 1)),
    }
    assert sorted(p.name for p in out.iterdir()) == sorted([*expected, "analysis.json", MARKER])
    assert record["pictures"] == sorted(expected)
    for name, wanted in expected.items():
        assert size(out / name) == wanted, name

    distance = record["attention_distance"]
    per_head = torch.tensor(distance["per_head"])
    assert per_head.shape == (DEPTH, HEADS) and distance["pixels_per_token"] == PATCH
    farthest = PATCH * (GRID - 1) * 2**0.5
    assert (per_head > 0).all() and (per_head < farthest).all()
    assert torch.allclose(torch.tensor(distance["mean_per_layer"]), per_head.mean(1), atol=1e-3)
    similarity = torch.tensor(record["position_embedding_similarity"]["matrix"])
    assert similarity.shape == (GRID * GRID,) * 2
    assert torch.allclose(similarity.diagonal(), torch.ones(GRID * GRID), atol=1e-3)
    assert torch.allclose(similarity, similarity.T)
    ratio = record["patch_embedding_pca"]["explained_variance_ratio"]
    assert len(ratio) == 28 and sorted(ratio, reverse=True) == ratio and 0 < sum(ratio) <= 1.0001
    rollout = torch.tensor(record["attention_rollout"]["maps"])
    assert rollout.shape == (8, GRID, GRID) and record["attention_rollout"]["token"] == "[class]"
    assert len(record["attention_rollout"]["keys"]) == 8 and (rollout.sum((1, 2)) < 1).all()
    masked = record["masked_prediction"]
    assert masked["task"] == "vit_mpp" and masked["mask_seed"] == 0 and 0 <= masked["masked_accuracy"] <= 1

    # The masks are drawn from a fixed seed: a rerun draws the same picture.
    again = tmp_path / "again"
    cli("analyze", str(mpp_ckpt), "--data", val(digits_shards), "--out", str(again), "--images", "100")
    assert (again / "masked_predictions.png").read_bytes() == (out / "masked_predictions.png").read_bytes()
    assert json.loads((again / "analysis.json").read_text())["masked_prediction"] == masked


def test_analyze_a_gap_checkpoint_skips_masked_predictions(gap_ckpt, digits_shards, tmp_path, cli):
    out = tmp_path / "sup"
    cli("analyze", str(gap_ckpt), "--data", val(digits_shards), "--out", str(out), "--images", "20")
    record = json.loads((out / "analysis.json").read_text())
    assert "SupervisedPretraining" in record["masked_prediction"]["skipped"]
    assert not (out / "masked_predictions.png").exists()
    assert record["attention_rollout"]["token"] == "mean of the patch tokens (GAP backbone)"
    assert torch.tensor(record["attention_distance"]["per_head"]).shape == (1, 2)
    assert len(record["patch_embedding_pca"]["explained_variance_ratio"]) == 28
    assert size(out / "attention_rollout.png") == grid_size(16, 8, 64, 2)


def test_mistakes_are_one_line_and_write_nothing(gap_ckpt, digits_shards, tmp_path, cli):
    def refused(*args, match):
        proc = cli("analyze", *args, check=False)
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("ssl-vit: error:") and match in lines[0], lines
        return proc

    data = ["--data", val(digits_shards)]
    used = tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("mine")
    refused(str(gap_ckpt), *data, "--out", str(used), match="exists and is not empty")
    assert [p.name for p in used.iterdir()] == ["notes.txt"]

    broken = tmp_path / "broken.ckpt"
    broken.write_text("not a checkpoint")
    refused(str(broken), *data, "--out", str(tmp_path / "a" / "out"), match="is not a checkpoint")
    refused(
        str(tmp_path / "missing.ckpt"), *data, "--out", str(tmp_path / "a" / "out"), match="does not exist"
    )

    (tmp_path / "shards").mkdir()  # not where --out goes: an --out inside the shards' directory is refused
    with tarfile.open(tmp_path / "shards/empty-000000.tar", "w"):
        pass
    empty = ["--data", str(tmp_path / "shards/empty-000000.tar")]
    refused(str(gap_ckpt), *empty, "--out", str(tmp_path / "a" / "out"), match="no usable sample")
    none = ["--data", str(tmp_path / "shards/none-{0..1}.tar")]
    refused(str(gap_ckpt), *none, "--out", str(tmp_path / "a" / "out"), match="none-0.tar")
    refused(str(gap_ckpt), *data, "--out", str(tmp_path / "a" / "out"), "--images", "0", match="--images 0")
    assert not (tmp_path / "a").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.ckpt", "shards", "used"]

    # --overwrite replaces only an earlier output of ssl-vit (one holding the marker), as a whole.
    refused(str(gap_ckpt), *data, "--out", str(used), "--images", "4", "--overwrite", match="did not write")
    assert [p.name for p in used.iterdir()] == ["notes.txt"]
    mark(used, "analyze")  # now as an earlier output of analyze, with a file added since
    cli("analyze", str(gap_ckpt), *data, "--out", str(used), "--images", "4", "--overwrite")
    assert not (used / "notes.txt").exists() and (used / "analysis.json").is_file() and is_ours(used)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.ckpt", "shards", "used"]


def test_pictures_go_to_the_active_wandb_run(gap_ckpt, digits_shards, tmp_path):
    import wandb

    run = wandb.init(mode="offline", dir=str(tmp_path), project="ssl-vit-test")
    try:
        analyze(str(gap_ckpt), val(digits_shards), tmp_path / "out", images=4)
    finally:
        run.finish()
        # wandb.init started a W&B service for this test process and told the environment about it;
        # later `ssl-vit` processes would inherit and share it (a killed job's run id stays "in use").
        wandb.teardown()
        os.environ.pop("WANDB_SERVICE", None)
    media = Path(run.dir) / "media"
    logged = [p.name for p in (media / "images/analysis").iterdir()]
    pictures = ("attention_distance", "attention_rollout", "patch_embedding_pcs", "position_embeddings")
    assert len(logged) == 4 and all(any(n.startswith(f"{p}_") for n in logged) for p in pictures), logged
    assert list((media / "table/analysis").glob("attention_distance_per_head_*.table.json"))


@pytest.fixture(scope="module")
def five_band_mae_ckpt(tmp_path_factory):
    """An MAE checkpoint of five input bands whose bands differ in units, trained one step."""
    torch.manual_seed(0)
    mean, std = (0.5, 0.5, 0.5, 50.0, -3.0), (0.25, 0.25, 0.25, 25.0, 1.5)
    model = MaskedPatchPretraining(
        ViTConfig("S/4", 32, width=32, depth=DEPTH, heads=HEADS, in_chans=5), preset="mae",
        training=Training(mean=mean, std=std), decoder_dim=32, decoder_depth=1, decoder_heads=2,
        display_bands=(3, 1, 0),
    )  # fmt: skip
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, max_steps=0)
    trainer.strategy.connect(model)
    path = tmp_path_factory.mktemp("five") / "mae5.ckpt"
    trainer.save_checkpoint(path)
    return path


def test_analyze_a_five_band_checkpoint_in_false_colour(five_band_mae_ckpt, band_shards, tmp_path, cli):
    """Five-band shards, drawn in the checkpoint's display bands or those `--display-bands` gives; the
    filter components over all bands."""
    out = tmp_path / "five"
    data = ["--data", str(band_shards / "val-000000.tar"), "--images", "16"]
    cli("analyze", str(five_band_mae_ckpt), *data, "--out", str(out))
    record = json.loads((out / "analysis.json").read_text())
    assert record["backbone"]["in_chans"] == 5 and record["display_bands"] == [3, 1, 0]
    pca = record["patch_embedding_pca"]
    assert pca["over"] == "all 5 bands; drawn in the display bands"
    assert len(pca["explained_variance_ratio"]) == 28
    assert record["masked_prediction"]["target"] == "norm_pixels"
    assert record["pictures"] == sorted(
        f"{name}.png" for name in ("attention_distance", "attention_rollout", "masked_predictions",
                                   "patch_embedding_pcs", "position_embeddings")
    )  # fmt: skip
    assert size(out / "masked_predictions.png") == tuple(2 * side for side in grid_size(24, 8, 32, 1))
    with Image.open(out / "attention_rollout.png") as rollout:
        first = torch.tensor(np.asarray(rollout.convert("RGB")))[2:66:2, 2:66:2].permute(2, 0, 1) / 255
    # red is band 3, stretched between its 2nd and 98th percentile in each image: black to white
    assert first[0].min() == 0 and first[0].max() == 1

    again = tmp_path / "again"
    cli("analyze", str(five_band_mae_ckpt), *data, "--out", str(again), "--display-bands", "0,1,2")
    assert json.loads((again / "analysis.json").read_text())["display_bands"] == [0, 1, 2]
    assert (again / "patch_embedding_pcs.png").read_bytes() != (out / "patch_embedding_pcs.png").read_bytes()
    bad = ["--out", str(tmp_path / "bad"), "--display-bands", "0,1,7"]
    proc = cli("analyze", str(five_band_mae_ckpt), *data, *bad, check=False)
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        "ssl-vit: error: display_bands [0, 1, 7]: give three band indices in [0, 4] (red, green, blue of the "
        "pictures)"
    ]
    assert not (tmp_path / "bad").exists()
