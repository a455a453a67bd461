"""The tasks on images of other band counts: every masked preset that works on them and supervised
pretraining fit five bands, their checkpoints record the bands and their normalisation, and the colour
targets are refused in one line, in the task and through `ssl-vit fit` on five-band shards."""

import json
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from cli_helpers import run_cli
from PIL import Image
from task_helpers import trainer

from ssl_vit.errors import BadValue
from ssl_vit.models.vit import ViTConfig
from ssl_vit.tasks import MaskedPatchPretraining, SupervisedPretraining
from ssl_vit.tasks.base import Training

ROOT = Path(__file__).resolve().parents[2]
BANDS = 5
BACKBONE = ViTConfig("S/8", 32, width=64, depth=2, heads=2, in_chans=BANDS)
# Per-band statistics of bands in different units, as a multispectral manifest gives them.
MEAN, STD = (0.1, 0.2, 3.0, 40.0, 500.0), (0.05, 0.1, 1.5, 20.0, 250.0)
SMALL = {"cell_size": 16, "decoder_dim": 64, "decoder_depth": 1, "decoder_heads": 4}
TINY = {"data2vec2": {"teacher_top_k": 2, "views": 2}}


class RandomBands(pl.LightningDataModule):
    """Batches of 8 random five-band images, normalised as the data module gives them, and 4 classes."""

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        batches = [
            {"image": torch.randn(8, BANDS, 32, 32, generator=generator), "label": torch.arange(8) % 4}
            for _ in range(3)
        ]
        return torch.utils.data.DataLoader(batches, batch_size=None)


def fit(task: pl.LightningModule, tmp_path: Path) -> dict:
    """Three steps; the saved checkpoint."""
    run = trainer(tmp_path, max_steps=3, limit_val_batches=0)
    before = task.backbone.patch_embed.proj.weight.detach().clone()
    run.fit(task, datamodule=RandomBands())
    assert not torch.equal(before, task.backbone.patch_embed.proj.weight)
    run.save_checkpoint(tmp_path / "last.ckpt")
    return torch.load(tmp_path / "last.ckpt", weights_only=True, map_location="cpu")


@pytest.mark.parametrize(
    "preset, values",
    [
        ("mae", 8 * 8 * BANDS),
        ("simmim", 8 * 8 * BANDS),
        ("maskfeat", BANDS * 9),
        ("ijepa", 64),
        ("data2vec2", 64),
    ],
)
def test_every_masked_preset_but_mpp_fits_five_bands(preset, values, tmp_path):
    torch.manual_seed(0)
    task = MaskedPatchPretraining(
        BACKBONE,
        preset=preset,
        training=Training(mean=MEAN, std=STD),
        picture_every_n_steps=1,
        **SMALL,
        **TINY.get(preset, {}),
    )
    assert task.target_shape == (values,)  # p*p*C pixels, C x 9 HOG bins of one 8-pixel cell, D latents
    out = task.forward_loss(torch.randn(2, BANDS, 32, 32))
    assert out.pred.shape[-1] == values and torch.isfinite(out.loss)
    checkpoint = fit(task, tmp_path)
    hparams = checkpoint["hyper_parameters"]
    assert hparams["backbone"]["in_chans"] == BANDS
    assert hparams["training"]["mean"] == list(MEAN) and hparams["training"]["std"] == list(STD)
    assert checkpoint["state_dict"]["backbone.patch_embed.proj.weight"].shape == (64, BANDS, 8, 8)
    pictures = sorted((tmp_path / "pictures").glob("*.png"))
    if preset in ("ijepa", "data2vec2"):  # latent targets have no picture
        assert pictures == []
    else:  # one after every step: three rows of eight false-colour images
        assert [p.name for p in pictures] == [f"train_predictions_000000{step}.png" for step in range(3)]
        with Image.open(pictures[-1]) as picture:
            assert picture.mode == "RGB" and picture.size == (8 * 33 + 1, 3 * 33 + 1)


def test_supervised_pretraining_fits_five_bands(tmp_path):
    torch.manual_seed(0)
    task = SupervisedPretraining(BACKBONE, num_classes=4, training=Training(mean=MEAN, std=STD))
    checkpoint = fit(task, tmp_path)
    assert checkpoint["hyper_parameters"]["backbone"]["in_chans"] == BANDS
    assert checkpoint["hyper_parameters"]["training"]["mean"] == list(MEAN)


@pytest.mark.parametrize("preset, target", [("vit_mpp", None), (None, "color3bit_4x4")])
def test_colour_targets_on_five_bands_are_one_line_naming_what_works(preset, target):
    with pytest.raises(BadValue) as error:
        MaskedPatchPretraining(
            BACKBONE,
            preset=preset,
            target=target,
            corruption="bert",
            training=Training(mean=MEAN, std=STD),
            mask_ratio=0.5,
        )
    given = "preset 'vit_mpp''s target 'color3bit'" if preset else "target 'color3bit_4x4'"
    assert str(error.value) == (
        f"{given} quantises the mean colour of 3 RGB bands, and the data has 5: use target pixels, "
        "norm_pixels, seen_pixels, hog, teacher (presets mae, simmim, maskfeat, ijepa, data2vec2)"
    )


@pytest.mark.parametrize(
    "mean, std, what", [((0.5,) * 3, STD, "mean has 3"), (MEAN, (1.0,) * 4, "std has 4")]
)
def test_normalisation_of_another_band_count_is_one_line(mean, std, what):
    with pytest.raises(
        BadValue, match=f"{what} values and the backbone reads 5 input bands: give one per band"
    ):
        SupervisedPretraining(BACKBONE, num_classes=4, training=Training(mean=mean, std=std))


def test_display_bands_are_checked():
    with pytest.raises(BadValue, match=r"display_bands \[0, 1, 5\]: give three band indices in \[0, 4\]"):
        MaskedPatchPretraining(
            BACKBONE, preset="mae", training=Training(mean=MEAN, std=STD), display_bands=(0, 1, 5), **SMALL
        )
    task = MaskedPatchPretraining(
        BACKBONE, preset="mae", training=Training(mean=MEAN, std=STD), display_bands=(3, 2, 1), **SMALL
    )
    assert task.context.display_bands == (3, 2, 1) and task.hparams.display_bands == (3, 2, 1)
    default = MaskedPatchPretraining(BACKBONE, preset="mae", training=Training(mean=MEAN, std=STD), **SMALL)
    assert default.context.display_bands == (0, 1, 2)


def bands_fit(shards: Path, run: Path, *options: str, recipe: str = "mae", check: bool = True):
    """`ssl-vit fit` of a quickstart recipe on the five-band shards (`band_shards`), their own per-band
    normalisation (`auto`: the manifest's band statistics)."""
    return run_cli(
        "fit", "--config", str(ROOT / f"recipes/quickstart/{recipe}.yaml"),
        "--data.init_args.channels", "5", "--data.init_args.mean", "auto", "--data.init_args.std", "auto",
        "--data.init_args.train_urls", str(shards / "train-{000000..000001}.tar"),
        "--data.init_args.val_urls", str(shards / "val-000000.tar"), "--data.init_args.batch_size", "8",
        "--data.init_args.num_workers", "0", "--trainer.limit_val_batches", "1", "--trainer.logger", "false",
        "--model.init_args.backbone.width", "32", "--model.init_args.backbone.depth", "1",
        "--trainer.default_root_dir", str(run), *options, check=check, cwd=ROOT,
    )  # fmt: skip


@pytest.mark.slow
def test_fit_links_the_data_bands_into_the_task_and_resumes_them(band_shards, digits_shards, tmp_path):
    """The data module's `channels` becomes the backbone's `in_chans` and its per-band mean and std (read
    from the manifest) the task's; a resume rebuilds that task; the same run directory with the digits'
    three bands is one line."""
    run = tmp_path / "run"
    bands_fit(band_shards, run, "--trainer.max_steps", "2", "--model.init_args.picture_every_n_steps", "1")
    checkpoint = torch.load(run / "checkpoints/last.ckpt", weights_only=True, map_location="cpu")
    hparams = checkpoint["hyper_parameters"]
    stats = json.loads((band_shards / "train.json").read_text())["band_stats"]
    assert hparams["backbone"]["in_chans"] == 5
    training = hparams["training"]
    assert training["mean"] == pytest.approx(stats["mean"]) and training["std"] == pytest.approx(stats["std"])
    assert 1000 < training["mean"][1] - training["mean"][0] < 1001  # band b holds 1000 b + ...
    assert checkpoint["state_dict"]["backbone.patch_embed.proj.weight"].shape[1] == 5
    assert len(list((run / "pictures").glob("train_predictions_*.png"))) == 2
    proc = bands_fit(band_shards, run, "--trainer.max_steps", "3", "--ckpt_path", "last")
    assert "Restored all states" in proc.stdout + proc.stderr
    assert (
        torch.load(run / "checkpoints/last.ckpt", weights_only=True, map_location="cpu")["global_step"] == 3
    )
    rgb = run_cli(
        "fit", "--config", str(ROOT / "recipes/quickstart/mae.yaml"),
        "--data.init_args.train_urls", str(digits_shards / "train-{000000..000004}.tar"),
        "--trainer.default_root_dir", str(run), "--ckpt_path", "last", check=False, cwd=ROOT,
    )  # fmt: skip
    assert rgb.returncode == 2
    assert rgb.stderr.splitlines() == [
        f"ssl-vit: error: --ckpt_path {run / 'checkpoints/last.ckpt'} holds a model of 5 input bands and the "
        "data has 3: give it the data it was trained on (--data.init_args.channels 5)"
    ]


@pytest.mark.slow
def test_mpp_on_five_bands_is_one_line_through_the_cli(band_shards, tmp_path):
    proc = bands_fit(band_shards, tmp_path / "run", "--trainer.max_steps", "1", recipe="mpp", check=False)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "ssl-vit: error: preset 'vit_mpp''s target 'color3bit' quantises the mean colour of 3 RGB bands, and "
        "the data has 5: use target pixels, norm_pixels, seen_pixels, hog, teacher (presets mae, simmim, "
        "maskfeat, ijepa, data2vec2)"
    ]
    assert not (tmp_path / "run").exists()
