"""W&B defaults (offline, one run per job directory) and the pictures tasks log."""

import torch

from ssl_vit.models.vit import ViTConfig
from ssl_vit.tasks import MaskedPatchPretraining
from ssl_vit.tasks.pictures import masked_prediction_picture
from ssl_vit.tracking import RUN_ID_FILE, WandbLogger, wandb_opted_in


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


def test_a_restarted_job_continues_its_run(tmp_path):
    first = WandbLogger(save_dir=str(tmp_path / "job"))
    again = WandbLogger(save_dir=str(tmp_path / "job"))
    other = WandbLogger(save_dir=str(tmp_path / "other"))
    assert first._wandb_init["id"] == again._wandb_init["id"] != other._wandb_init["id"]
    assert (tmp_path / "job" / RUN_ID_FILE).read_text().strip() == first._wandb_init["id"]
    assert again._wandb_init["resume"] == "allow"


def _picture(preset, digits_batch):
    torch.manual_seed(0)
    model = MaskedPatchPretraining(
        ViTConfig("S/8", 32, width=64, depth=2, heads=2),
        preset=preset,
        cell_size=16,
        decoder_dim=32,
        decoder_depth=1,
        decoder_heads=2,
    )
    images = digits_batch["image"][:4]
    out = model.forward_loss(images)
    return model, images, out, masked_prediction_picture(model, images, out)


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
    true = model.make_targets(model.unnormalize(images))[0]  # (16,) classes of image 0
    colours = torch.stack([true % 8, true // 8 % 8, true // 64], -1).float().add(0.5).div(8)
    torch.testing.assert_close(true_row[:, 0, 0], colours[0])  # top-left patch, its true mean colour
