"""W&B defaults (offline, one run per job directory) and the pictures tasks log."""

from pathlib import Path

import pytest
import torch
from cli_helpers import run_cli, wandb_records
from pytorch_lightning.loggers import WandbLogger as LightningWandbLogger
from torchvision.utils import make_grid

from ssl_vit.masking import token_index
from ssl_vit.models.vit import ViTConfig
from ssl_vit.targets.color3bit_target import _colour_image
from ssl_vit.targets.masked_picture import band_stretch, false_colour, masked_prediction_picture
from ssl_vit.targets.patches import patchify, unpatchify
from ssl_vit.tasks import MaskedPatchPretraining
from ssl_vit.tasks.base import Training
from ssl_vit.tracking import RUN_ID_FILE, WandbLogger, wandb_opted_in

ROOT = Path(__file__).resolve().parents[1]


def test_offline_unless_opted_in(monkeypatch, tmp_path):
    for var in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert not wandb_opted_in()
    assert WandbLogger(save_dir=str(tmp_path / "a"))._offline
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password x\n")
    assert wandb_opted_in()
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_opted_in()


def test_a_restarted_job_continues_its_run(tmp_path, monkeypatch):
    first = WandbLogger(save_dir=str(tmp_path / "job"))
    assert not (tmp_path / "job" / RUN_ID_FILE).exists()  # the id is kept once the run has started
    # Starting the run (not wandb.init in this process: its service would outlive the test).
    monkeypatch.setattr(LightningWandbLogger, "experiment", property(lambda self: "run"))
    assert first.experiment == "run"
    again = WandbLogger(save_dir=str(tmp_path / "job"))
    other = WandbLogger(save_dir=str(tmp_path / "other"))
    assert first.init_options["id"] == again.init_options["id"] != other.init_options["id"]
    assert (tmp_path / "job" / RUN_ID_FILE).read_text().strip() == first.init_options["id"]
    assert again.init_options["resume"] == "allow"


def _picture(preset, digits_batch, bands=3, **kwargs):
    torch.manual_seed(0)
    normalisation = {} if bands == 3 else {"training": Training(mean=(0.5,) * bands, std=(0.25,) * bands)}
    model = MaskedPatchPretraining(
        ViTConfig("S/8", 32, width=64, depth=2, heads=2, in_chans=bands),
        preset=preset,
        cell_size=16,
        decoder_dim=32,
        decoder_depth=1,
        decoder_heads=2,
        **normalisation,
        **kwargs,
    )
    images = digits_batch["image"][:4]
    if bands != 3:  # five bands in units far apart: the digits' bands, then two of them scaled
        images = torch.cat([images, 100 * images[:, :1], -7 * images[:, 1:2]], dim=1)
    out = model.forward_loss(images)
    return model, images, out, masked_prediction_picture(model.target, model.context, images, out)


@torch.no_grad()
def rgb_picture_before_bands(task, images, out, count=8):
    """`masked_prediction_picture` as it was before other band counts: RGB pictures must not change."""
    p, grid = task.patch_size, task.grid
    pixels = task.unnormalize(images[:count]).float()
    idx = out.idx[:count]
    if out.target.dtype == torch.long:
        true = task.target.make(task.context, images[:count])
        pred = true.clone().scatter_(1, token_index(idx, true), out.pred[:count].argmax(-1))
        rows = [pixels, _colour_image(true, p, grid), _colour_image(pred, p, grid)]
    else:
        patches = patchify(pixels, p)
        pred = out.pred[:count].float()
        if task.target_kind == "norm_pixels":
            true = torch.gather(patches, 1, token_index(idx, patches))
            pred = pred * (true.var(-1, keepdim=True) + 1e-6).sqrt() + true.mean(-1, keepdim=True)
        if task.target_kind == "seen_pixels":  # standardised values, in MAE's (row, column, band) order
            pred = (pred.unflatten(-1, (-1, 3)) * task.std.view(3) + task.mean.view(3)).flatten(-2)
        masked = patches.scatter(1, token_index(idx, patches), 0.5)
        if task.target_kind == "hog":
            agreement = torch.nn.functional.cosine_similarity(pred, out.target[:count].float(), dim=-1).clamp(
                0, 1
            )
            pred = agreement[..., None].expand(-1, -1, patches.shape[-1])
        recon = patches.scatter(1, token_index(idx, patches), pred.clamp(0, 1))
        rows = [pixels, unpatchify(masked, p, grid), unpatchify(recon, p, grid)]
    return make_grid(torch.cat(rows), nrow=pixels.shape[0], padding=1, pad_value=1.0)


@pytest.mark.parametrize(
    "preset, target",
    [("mae", None), ("simmim", None), ("simmim", "pixels"), ("maskfeat", None), ("vit_mpp", None)],
)
def test_rgb_pictures_are_as_before_bit_for_bit(preset, target, digits_batch):
    model, images, out, picture = _picture(preset, digits_batch, **({"target": target} if target else {}))
    assert torch.equal(picture, rgb_picture_before_bands(model, images, out))


@pytest.mark.parametrize("target", ["pixels", "norm_pixels", "seen_pixels"])
def test_a_perfect_pixel_prediction_pictures_the_input_again(target, digits_batch):
    """Each pixel target's picture maps its prediction back to the input's RGB (`seen_pixels`: the
    standardisation undone): the true targets as the prediction redraw the input row."""
    model, images, out, _ = _picture("simmim", digits_batch, target=target)
    perfect = out._replace(pred=out.target)
    picture = masked_prediction_picture(model.target, model.context, images, perfect)
    rows = [picture[:, 1 + 33 * row : 33 * (row + 1)] for row in range(3)]  # 32-pixel rows, 1 of padding
    assert torch.allclose(rows[2], rows[0], atol=1e-5)
    assert not torch.allclose(rows[1], rows[0], atol=1e-2)  # the masked row differs


def test_five_band_pictures_are_false_colour_of_the_display_bands(digits_batch):
    """Bands 3 (the first, x100) and 4 (the second, x-7) and 0 as red, green and blue, each stretched
    between its 2nd and 98th percentile in its image: the input row; the reconstruction shows the visible
    patches as the input row does (the same stretch), the masked row greys the masked patches."""
    model, images, out, picture = _picture("mae", digits_batch, bands=5, display_bands=(3, 4, 0))
    assert picture.shape == (3, 3 * 33 + 1, 4 * 33 + 1)
    shown = false_colour(images, (3, 4, 0))  # standardised or raw bands: the same stretched picture
    low, high = band_stretch(images[:, [3, 4, 0]])
    assert torch.equal(low[:, 1], torch.quantile(images[:, 4].flatten(1), 0.02, dim=1)[:, None, None])
    assert (shown == 0).any() and (shown == 1).any() and shown.min() >= 0 and shown.max() <= 1
    first = picture[:, 1:33, 1:33]
    torch.testing.assert_close(first, shown[0])
    # red is band 3, 100 x the digit's first band: the same picture as that band alone, stretched
    torch.testing.assert_close(first[0], false_colour(images[:, :1], (0, 0, 0))[0, 0])
    masked_row, recon_row = picture[:, 34:66, 1:33], picture[:, 67:99, 1:33]
    r, c = divmod(int(out.idx[0, 0]), 4)
    assert torch.all(masked_row[:, r * 8 : r * 8 + 8, c * 8 : c * 8 + 8] == 0.5)
    r, c = divmod(sorted(set(range(16)) - set(out.idx[0].tolist()))[0], 4)
    torch.testing.assert_close(
        recon_row[:, r * 8 : r * 8 + 8, c * 8 : c * 8 + 8], shown[0, :, r * 8 : r * 8 + 8, c * 8 : c * 8 + 8]
    )


@pytest.mark.parametrize("preset", ["simmim", "maskfeat"])
def test_five_band_pictures_of_raw_pixels_and_hog(preset, digits_batch):
    model, images, out, picture = _picture(preset, digits_batch, bands=5)
    assert picture.shape == (3, 3 * 33 + 1, 4 * 33 + 1) and 0 <= picture.min() and picture.max() <= 1
    torch.testing.assert_close(picture[:, 1:33, 1:33], false_colour(images, (0, 1, 2))[0])


def test_reconstruction_picture_keeps_visible_patches_and_greys_masked_ones(digits_batch):
    model, images, out, picture = _picture("mae", digits_batch)
    assert picture.shape == (3, 3 * 33 + 1, 4 * 33 + 1)  # rows: input, masked, reconstruction; 1-px padding
    pixels = model.unnormalize(images)
    first = picture[:, 1:33, 1:33]  # image 0, input row
    torch.testing.assert_close(first, pixels[0])
    masked_row = picture[:, 34:66, 1:33]
    recon_row = picture[:, 67:99, 1:33]
    patch = int(out.idx[0, 0])  # a masked patch of image 0: grey in the masked row
    r, c = divmod(patch, 4)
    assert torch.all(masked_row[:, r * 8 : r * 8 + 8, c * 8 : c * 8 + 8] == 0.5)
    visible = sorted(set(range(16)) - set(out.idx[0].tolist()))[0]
    r, c = divmod(visible, 4)
    torch.testing.assert_close(
        recon_row[:, r * 8 : r * 8 + 8, c * 8 : c * 8 + 8], pixels[0, :, r * 8 : r * 8 + 8, c * 8 : c * 8 + 8]
    )


def test_colour_picture_shows_true_and_predicted_mean_colours(digits_batch):
    model, images, out, picture = _picture("vit_mpp", digits_batch)
    assert picture.shape == (3, 3 * 33 + 1, 4 * 33 + 1)
    true_row = picture[:, 34:66, 1:33]
    true = model.target.make(model.context, images)[0]  # (16,) classes of image 0
    colours = torch.stack([true % 8, true // 8 % 8, true // 64], -1).float().add(0.5).div(8)
    torch.testing.assert_close(true_row[:, 0, 0], colours[0])  # top-left patch, its true mean colour


@pytest.mark.slow
def test_pictures_and_fewshot_scores_leave_every_step_in_the_wandb_run(digits_shards, tmp_path):
    """W&B's steps only go forward: a picture or a few-shot score logged ahead of Lightning's step for
    the batch that just ended would make it drop that batch's loss, throughput and learning rate."""
    run_dir = tmp_path / "run"
    proc = run_cli(
        "fit", "--config", str(ROOT / "recipes/quickstart/mpp.yaml"),
        "--data.init_args.train_urls", str(digits_shards / "train-{000000..000004}.tar"),
        "--data.init_args.val_urls", str(digits_shards / "val-000000.tar"),
        "--data.init_args.num_workers", "0", "--data.init_args.batch_size", "16",
        "--model.init_args.backbone.width", "32", "--model.init_args.backbone.depth", "2",
        "--model.init_args.backbone.heads", "2",
        "--model.init_args.picture_every_n_steps", "2",
        "--trainer.callbacks.init_args.every_n_steps", "2",
        "--trainer.callbacks.init_args.train_urls", str(digits_shards / "train-000000.tar"),
        "--trainer.max_steps", "5", "--trainer.limit_val_batches", "0", "--trainer.log_every_n_steps", "1",
        "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(run_dir),
        cwd=ROOT,
    )  # fmt: skip
    assert "Tried to log to step" not in proc.stderr + proc.stdout
    ((_, records),) = wandb_records(run_dir)
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    assert all(h["_step"] == h["trainer/global_step"] for h in history)

    def steps_with(key: str) -> list[int]:
        return [h["_step"] for h in history if any(k == key or k.startswith(key + ".") for k in h)]

    # Each of the 5 optimizer steps has its row (Lightning logs the batch that makes update k at k - 1).
    for key in ("train/loss", "perf/images_per_s", "lr-AdamW/pg1"):
        assert steps_with(key) == [0, 1, 2, 3, 4], key
    # The picture of a batch goes beside that batch's loss: the batches that make updates 2 and 4.
    assert steps_with("train/predictions") == [1, 3]
    assert sorted(p.name for p in (run_dir / "pictures").iterdir()) == [
        "train_predictions_0000001.png",
        "train_predictions_0000003.png",
    ]
    # The scores of the weights after k updates go to step k, beside the loss of the batch that starts
    # from them; the last at the end of training.
    assert steps_with("fewshot/5shot") == [2, 4, 5]
