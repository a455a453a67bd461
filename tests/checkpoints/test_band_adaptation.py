"""Input bands: RGB weights of every kind adapt to any band count through timm's `adapt_input_conv`
(and say so), weights of another band count are one line, and a C-band backbone exports and loads back
as one (ssl-vit and timm)."""

import argparse
import json

import pytest
import pytorch_lightning as pl
import timm
import torch
from cli_helpers import run_cli
from safetensors.torch import save_file
from test_export import printed_model
from test_import import DECODER, MAEReferenceDecoder

from ssl_vit.checkpoints import load_backbone
from ssl_vit.checkpoints.export import export
from ssl_vit.checkpoints.mae import decoder_state
from ssl_vit.errors import UserError
from ssl_vit.models.vit import ViTConfig
from ssl_vit.tasks import MaskedPatchPretraining, SupervisedPretraining
from ssl_vit.tasks.base import Training

RGB = ViTConfig("S/8", 32, width=64, depth=2, heads=2)


def bands(config: ViTConfig, count: int) -> ViTConfig:
    return ViTConfig(**{**config.__dict__, "in_chans": count})


def saved(task: pl.LightningModule, path) -> str:
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, max_steps=0)
    trainer.strategy.connect(task)
    trainer.save_checkpoint(path)
    return str(path)


@pytest.fixture(scope="module")
def rgb_ckpt(tmp_path_factory):
    torch.manual_seed(0)
    task = SupervisedPretraining(RGB, num_classes=10)
    return saved(task, tmp_path_factory.mktemp("rgb") / "rgb.ckpt"), task.backbone.eval()


@pytest.fixture(scope="module")
def five_band_ckpt(tmp_path_factory):
    torch.manual_seed(0)
    mean, std = (0.1, 0.2, 0.3, 0.4, 0.5), (1.0, 2.0, 3.0, 4.0, 5.0)
    task = SupervisedPretraining(bands(RGB, 5), num_classes=10, training=Training(mean=mean, std=std))
    with torch.no_grad():  # a trained head, so that --with-head exports something other than zeros
        task.head.weight.normal_()
    return saved(task, tmp_path_factory.mktemp("five") / "five.ckpt"), task.eval()


def adapted_line(source: str, count: int) -> str:
    return (
        f"ssl-vit: note: adapted the patch embedding of {source} from 3 to {count} input bands "
        "(timm's adapt_input_conv)"
    )


def as_copies(rgb: torch.Tensor, count: int) -> torch.Tensor:
    """The C-band image on which RGB weights adapted by timm's `adapt_input_conv` compute exactly what
    they compute on `rgb` (B, 3, H, W). adapt_input_conv repeats the RGB filters over the C bands
    (band c gets the filter of RGB band c % 3) and scales them all by 3 / C, so band c's contribution is
    (3 / C) W[c % 3] x_c: with n_b copies of RGB band b, x_c = rgb[c % 3] * C / (3 n_b) sums to the RGB
    convolution. Six bands [R, G, B, R, G, B]: plain copies (n_b = 2, factor 1); five [R, G, B, R, G]:
    R and G x 5/6, B x 5/3."""
    copies = [sum(1 for c in range(count) if c % 3 == b) for b in range(3)]
    factors = torch.tensor([count / (3 * copies[c % 3]) for c in range(count)]).view(1, -1, 1, 1)
    return rgb[:, [c % 3 for c in range(count)]] * factors


@pytest.mark.parametrize("count", [6, 5, 1])
def test_rgb_weights_adapted_compute_the_rgb_model_on_copies_of_its_bands(rgb_ckpt, count, capsys):
    path, rgb_model = rgb_ckpt
    vit, config = load_backbone(path, bands(RGB, count))
    assert config.in_chans == vit.in_chans == count
    assert capsys.readouterr().err.splitlines() == [adapted_line(path, count)]
    torch.manual_seed(1)
    images = torch.randn(2, 3, 32, 32)
    if count == 1:  # one band: the RGB filters summed, exact on a grey image (R = G = B)
        images, adapted = images[:, :1].expand(-1, 3, -1, -1), images[:, :1]
    else:
        adapted = as_copies(images, count)
    vit.eval()
    with torch.no_grad():
        expected, got = rgb_model(images), vit(adapted)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    if count == 6:  # plain copies: the scaling is 3 / 6 on each of two copies, nothing else
        with torch.no_grad():
            torch.testing.assert_close(vit(images.repeat(1, 2, 1, 1)), expected, rtol=1e-5, atol=1e-5)


def test_every_rgb_source_adapts(rgb_ckpt, tmp_path, monkeypatch, capsys):
    """An export (.safetensors), MAE's .pth and timm:NAME: the same adaptation, the same line."""
    path, rgb_model = rgb_ckpt
    exported = tmp_path / "rgb.safetensors"
    export(path, str(exported), "timm", with_head=False)
    torch.manual_seed(0)
    decoder = MAEReferenceDecoder(64, 4, 8 * 8 * 3, 32, 1, 4)
    mae = tmp_path / "checkpoint-799.pth"
    state = {**rgb_model.state_dict(), **decoder.state_dict()}
    torch.save({"model": state, "args": argparse.Namespace(model="mae"), "epoch": 799}, mae)
    timm_file = tmp_path / "tiny.safetensors"
    source = timm.create_model("vit_tiny_patch16_224", num_classes=0)
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, timm_file)
    real = timm.create_model

    def offline_create(name, pretrained=False, **kwargs):  # timm's 'pretrained' file is local
        overlay = {"file": str(timm_file)} if pretrained else None
        return real(name, pretrained=pretrained, pretrained_cfg_overlay=overlay, **kwargs)

    monkeypatch.setattr(timm, "create_model", offline_create)
    for name, reference, config in [
        (str(exported), rgb_model, bands(RGB, 6)),
        (str(mae), rgb_model, bands(RGB, 6)),
        ("timm:vit_tiny_patch16_224", source.eval(), ViTConfig("Ti/16", 224, in_chans=6)),
    ]:
        vit, loaded = load_backbone(name, config)
        assert loaded.in_chans == 6
        assert capsys.readouterr().err.splitlines() == [adapted_line(name, 6)]
        images = torch.randn(2, 3, config.img_size, config.img_size)
        with torch.no_grad():
            got, expected = vit.eval()(images.repeat(1, 2, 1, 1)), reference(images)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_mae_pretraining_continues_in_five_bands_with_a_fresh_pixel_layer(rgb_ckpt, tmp_path, capsys):
    path, rgb_model = rgb_ckpt
    torch.manual_seed(0)
    decoder = MAEReferenceDecoder(64, 4, 8 * 8 * 3, DECODER["decoder_dim"], 1, DECODER["decoder_heads"])
    mae = tmp_path / "checkpoint-799.pth"
    torch.save({"model": {**rgb_model.state_dict(), **decoder.state_dict()}}, mae)
    task = MaskedPatchPretraining(
        bands(RGB, 5),
        preset="mae",
        training=Training(init_from=str(mae), mean=(0.5,) * 5, std=(0.2,) * 5),
        **DECODER,
    )
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"ssl-vit: note: the MAE decoder of {mae} predicts 192 values per patch and this task 320: its "
        "prediction layer (pred) starts afresh"
    )
    mapped = decoder_state(decoder.state_dict(), str(mae))  # MAE's decoder in ours, what continues
    ours = task.decoder.state_dict()
    assert ours["pred.weight"].shape == (8 * 8 * 5, DECODER["decoder_dim"])
    for key, value in mapped.items():
        if not key.startswith("pred."):
            assert torch.equal(ours[key], value), key
    images = torch.randn(2, 5, 32, 32)
    assert task.forward_loss(images).pred.shape[-1] == 8 * 8 * 5


@pytest.mark.parametrize("count", [3, 4])
def test_weights_of_other_bands_are_one_line(five_band_ckpt, count):
    path, _ = five_band_ckpt
    with pytest.raises(UserError) as error:
        load_backbone(path, bands(RGB, count))
    message = str(error.value)
    assert "\n" not in message
    assert f"holds weights for 5 input bands and the backbone reads {count}" in message
    assert "channels: 5" in message


def test_a_five_band_checkpoint_into_an_rgb_suite_is_one_line_and_writes_nothing(
    five_band_ckpt, digits_shards, tmp_path
):
    path, _ = five_band_ckpt
    suite = tmp_path / "suite.yaml"
    suite.write_text(
        json.dumps(
            {
                "backbone": {"variant": "S/8", "img_size": 32, "width": 64, "depth": 2, "heads": 2},
                "data": {
                    "train_urls": str(digits_shards / "train-000000.tar"),
                    "test_urls": str(digits_shards / "val-000000.tar"),
                    "image_size": 32,
                },
                "protocols": [{"name": "knn", "kind": "knn", "k": 5}],
            }
        )
    )
    proc = run_cli("evaluate", path, "--suite", str(suite), "--out", str(tmp_path / "out"), check=False)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"ssl-vit: error: {path} holds weights for 5 input bands and the backbone reads 3: only RGB (3-band) "
        "weights adapt to another band count; give data of 5 bands (channels: 5), or an RGB checkpoint"
    ]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fmt", ["timm", "hf"])
def test_a_five_band_export_loads_back_as_five_bands_in_ssl_vit_and_timm(five_band_ckpt, tmp_path, fmt):
    path, task = five_band_ckpt
    out = tmp_path / ("five.safetensors" if fmt == "timm" else "five")
    proc = run_cli("export", path, str(out), "--format", fmt, "--with-head")
    model = printed_model(proc.stdout)
    assert model.in_chans == 5
    images = torch.randn(2, 5, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(model(images), task(images), rtol=1e-5, atol=1e-6)
    vit, config = load_backbone(str(out))
    assert config.in_chans == 5 and config == ViTConfig(**task.hparams["backbone"])
    if fmt == "hf":
        saved_config = json.loads((out / "config.json").read_text())
        assert saved_config["pretrained_cfg"]["input_size"][0] == 5
        assert saved_config["pretrained_cfg"]["mean"] == [0.1, 0.2, 0.3, 0.4, 0.5]
    else:  # the file alone, as a timm user builds it: in_chans=5 and the architecture
        overlay = dict(file=str(out), input_size=(5, 32, 32), num_classes=10)
        plain = timm.create_model(
            "vit_small_patch8_224", img_size=32, embed_dim=64, depth=2, num_heads=2, in_chans=5,
            num_classes=10, pretrained=True, pretrained_cfg_overlay=overlay,
        )  # fmt: skip
        with torch.no_grad():
            torch.testing.assert_close(plain.eval()(images), task(images), rtol=1e-5, atol=1e-6)


def test_a_hybrids_resnet_stem_is_what_adapts(tmp_path, capsys):
    """The paper's hybrid reads the bands with its ResNet stem (its patch embedding reads ResNet
    features): the stem's weights are the ones adapted, by the same function."""
    torch.manual_seed(0)
    hybrid = ViTConfig("R50+S/16", 32, width=32, depth=1, heads=2)
    path = saved(SupervisedPretraining(hybrid, num_classes=10), tmp_path / "hybrid.ckpt")
    vit, config = load_backbone(path, bands(hybrid, 5))
    assert config.in_chans == 5
    assert capsys.readouterr().err.splitlines() == [
        f"ssl-vit: note: adapted the ResNet stem of {path} from 3 to 5 input bands (timm's adapt_input_conv)"
    ]
    rgb = torch.load(path, weights_only=True)["state_dict"]["backbone.patch_embed.backbone.stem.conv.weight"]
    stem = vit.state_dict()["patch_embed.backbone.stem.conv.weight"]
    assert torch.equal(stem, rgb[:, [0, 1, 2, 0, 1]] * (3 / 5))
    assert vit(torch.randn(1, 5, 32, 32)).shape == (1, 32)
