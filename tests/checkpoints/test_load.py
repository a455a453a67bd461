"""Every checkpoint form loads into the backbone, safely, and bad ones are one-line errors."""

import pytest
import pytorch_lightning as pl
import timm
import torch
from safetensors.torch import save_file

from ssl_vit.checkpoints import config_metadata, load_backbone
from ssl_vit.checkpoints import load as checkpoints
from ssl_vit.errors import UserError
from ssl_vit.models.vit import ViTConfig
from ssl_vit.tasks import MaskedPatchPretraining

CONFIG = ViTConfig("S/8", 32, width=64, depth=2, heads=2)


@pytest.fixture(scope="module")
def lightning_ckpt(tmp_path_factory):
    torch.manual_seed(0)
    model = MaskedPatchPretraining(CONFIG, preset="vit_mpp")
    path = tmp_path_factory.mktemp("ckpt") / "mpp.ckpt"
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, max_steps=0)
    trainer.strategy.connect(model)
    trainer.save_checkpoint(path)
    return path, model


def assert_same_backbone(a, b, size=32):
    images = torch.randn(2, 3, size, size)
    a.eval(), b.eval()
    torch.testing.assert_close(a.forward_tokens(images).pooled, b.forward_tokens(images).pooled)


def test_lightning_checkpoint_rebuilds_its_backbone(lightning_ckpt):
    path, model = lightning_ckpt
    vit, config = load_backbone(str(path))
    assert config == CONFIG
    assert_same_backbone(vit, model.backbone)


def test_higher_resolution_resamples_position_embeddings(lightning_ckpt):
    path, model = lightning_ckpt
    vit, config = load_backbone(str(path), ViTConfig("S/8", 48, width=64, depth=2, heads=2))
    assert config.img_size == 48 and vit.grid_size == (6, 6)
    expected = timm.layers.resample_abs_pos_embed(
        model.backbone.pos_embed.detach(), (6, 6), num_prefix_tokens=1
    )
    torch.testing.assert_close(vit.pos_embed.detach(), expected)


def test_another_architecture_is_a_one_line_error(lightning_ckpt):
    path, _ = lightning_ckpt
    with pytest.raises(UserError, match=r"holds a S/8 backbone with width 64 \(asked for 768\)") as info:
        load_backbone(str(path), ViTConfig("B/8", 32))
    assert "\n" not in str(info.value)


def test_exported_safetensors_with_and_without_metadata(lightning_ckpt, tmp_path):
    _, model = lightning_ckpt
    state = {k: v.contiguous() for k, v in model.backbone.state_dict().items()}
    save_file(state, tmp_path / "with.safetensors", metadata=config_metadata(CONFIG))
    vit, config = load_backbone(str(tmp_path / "with.safetensors"))
    assert config == CONFIG
    assert_same_backbone(vit, model.backbone)
    save_file(state, tmp_path / "plain.safetensors")
    with pytest.raises(UserError, match="carries no backbone config"):
        load_backbone(str(tmp_path / "plain.safetensors"))
    vit, _ = load_backbone(str(tmp_path / "plain.safetensors"), CONFIG)
    assert_same_backbone(vit, model.backbone)


def test_scratch_builds_the_given_config():
    vit, config = load_backbone("scratch", CONFIG)
    assert config == CONFIG and vit.embed_dim == 64
    with pytest.raises(UserError, match="needs a backbone config"):
        load_backbone("scratch")


def test_timm_pretrained_weights_become_our_backbone(monkeypatch, tmp_path):
    """timm:NAME goes through timm.create_model(pretrained=True); here the 'pretrained' file is local."""
    source = timm.create_model("vit_tiny_patch16_224", num_classes=0)
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, tmp_path / "tiny.safetensors")
    real = timm.create_model

    def offline_create(name, pretrained=False, **kwargs):
        overlay = {"file": str(tmp_path / "tiny.safetensors")} if pretrained else None
        return real(name, pretrained=pretrained, pretrained_cfg_overlay=overlay, **kwargs)

    monkeypatch.setattr(timm, "create_model", offline_create)
    vit, config = load_backbone("timm:vit_tiny_patch16_224")
    assert config == ViTConfig("Ti/16", 224)
    images = torch.randn(1, 3, 224, 224)
    source.eval(), vit.eval()
    torch.testing.assert_close(vit(images), source(images))


@pytest.mark.parametrize(
    "content, error",
    [
        (b"not a checkpoint at all", "not a checkpoint torch can load safely"),
        (b"PK\x03\x04garbage", "is damaged .its zip directory is missing"),  # the start of a zip archive
    ],
)
def test_a_file_that_is_not_a_checkpoint_is_a_one_line_error(tmp_path, content, error):
    path = tmp_path / "weights.ckpt"
    path.write_bytes(content)
    with pytest.raises(UserError, match=error):
        load_backbone(str(path))
    with pytest.raises(UserError, match="does not exist"):
        load_backbone(str(tmp_path / "missing.ckpt"))


def test_unknown_timm_name_is_a_one_line_error():
    with pytest.raises(UserError, match="timm:no_such_model"):
        load_backbone("timm:no_such_model")


def test_pickled_code_is_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    path = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "payload": Evil()}, path)
    with pytest.raises(UserError, match="safely"):
        load_backbone(str(path))
    assert checkpoints.METADATA_KEY == "ssl_vit.backbone"
