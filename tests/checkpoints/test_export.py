"""`ssl-vit export`: timm loads what it writes, by the call it prints, and computes the same features
and logits as ssl-vit; every mistake is one line, with nothing written."""

import os
import pickle

import pytest
import timm
import torch
from cli_helpers import run_cli

from ssl_vit.checkpoints import load_backbone
from ssl_vit.checkpoints.export import timm_model, timm_module
from ssl_vit.models.vit import VARIANTS, ViTConfig

CASES = [
    (name, fmt, with_head)
    for name in ("ti16_supervised", "custom_supervised", "custom_gap_finetune")
    for fmt in ("timm", "hf")
    for with_head in (False, True)
]


def export(checkpoint, out, *options):
    proc = run_cli("export", str(checkpoint), str(out), *options, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc


def printed_model(stdout: str) -> torch.nn.Module:
    """Runs the `model = timm.create_model(...)` line the command printed, as a user pastes it."""
    (line,) = [line for line in stdout.splitlines() if line.startswith("model = timm.create_model(")]
    namespace = {"timm": timm}
    exec(line, namespace)
    return namespace["model"].eval()


@pytest.mark.parametrize("name, fmt, with_head", CASES)
def test_timm_computes_what_ssl_vit_computes(trained, tmp_path, name, fmt, with_head):
    checkpoint, task, size = trained[name]
    out = tmp_path / ("backbone.safetensors" if fmt == "timm" else "backbone")
    proc = export(checkpoint, out, "--format", fmt, *(["--with-head"] if with_head else []))
    model = printed_model(proc.stdout)
    images = torch.randn(2, 3, size, size)
    with torch.no_grad():
        expected = task(images) if with_head else task.backbone.forward_tokens(images).pooled
        got = model(images)
    assert got.shape == expected.shape == (2, 10 if with_head else task.backbone.embed_dim)
    assert expected.abs().max() > 0.1  # trained heads, not the zero initialisation
    print(f"{name} {fmt} head={with_head}: max |timm - ssl-vit| = {(got - expected).abs().max():.3g}")
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    # ... and ssl-vit reads the export back as the backbone it was.
    vit, config = load_backbone(str(out))
    assert config == ViTConfig(**task.hparams["backbone"])
    with torch.no_grad():
        features = task.backbone.forward_tokens(images).pooled
        torch.testing.assert_close(vit.forward_tokens(images).pooled, features)


def test_paper_variants_use_timm_names():
    assert timm_model(ViTConfig("B/16", 224)) == ("vit_base_patch16_224", {})
    assert timm_model(ViTConfig("L/32", 384)) == ("vit_large_patch32_384", {})
    assert timm_model(ViTConfig("H/14", 224, "gap")) == (
        "vit_huge_patch14_224",
        {"class_token": False, "global_pool": "avg"},
    )
    assert timm_model(ViTConfig("R50+B/16", 384)) == ("vit_base_r50_s16_384", {})
    assert timm_model(ViTConfig("S/16", 96)) == ("vit_small_patch16_224", {"img_size": 96})


@pytest.mark.parametrize(
    "variant",
    [f"{size}/{patch}" for size in VARIANTS for patch in (8, 14, 16, 32)]
    + ["R50+B/16", "R50+L/32", "R50+S/16"],  # timm's two hybrids, and one it has under another width
)
def test_every_variant_rebuilds_in_timm_key_for_key(variant):
    """The state dict of each paper variant (and R50 hybrid), with either pooling, loads strictly into
    the timm model export names; built on the meta device, so no weights are allocated."""
    for pooling in ("cls", "gap"):
        config = ViTConfig(variant, 224, pooling)
        with torch.device("meta"):
            state = config.build().state_dict()
        module = timm_module(timm_model(config), 0, state)  # strict: raises on a missing or extra key
        theirs = module.state_dict()
        assert list(theirs) == list(state)
        assert all(theirs[k].shape == v.shape for k, v in state.items())
        assert (module.global_pool == "token") == (pooling == "cls")


def error_line(proc) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ssl-vit: error: "), proc.stderr
    return lines[0]


def listing(folder):
    return sorted(p.name for p in folder.iterdir())


class TouchesMarker:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mknod, (str(self.marker),))


def test_mistakes_are_one_line_and_write_nothing(trained, tmp_path):
    mpp, _, _ = trained["custom_mpp"]
    mae_finetuned, _, _ = trained["custom_mae_finetune"]
    supervised, _, _ = trained["custom_supervised"]
    (tmp_path / "notes.ckpt").write_text("epoch: 3\n")
    marker = tmp_path / "pwned"
    torch.save({"state_dict": {}, "payload": TouchesMarker(marker)}, tmp_path / "evil.ckpt")
    (tmp_path / "taken.safetensors").write_bytes(b"keep me")
    (tmp_path / "a_file").write_text("")
    cases = [
        ((tmp_path / "notes.ckpt", "out.safetensors"), "not a checkpoint torch can load safely"),
        ((tmp_path / "evil.ckpt", "out.safetensors"), "not a checkpoint torch can load safely"),
        ((tmp_path / "missing.ckpt", "out.safetensors"), "does not exist"),
        ((supervised, "taken.safetensors"), "already exists"),
        ((supervised, "no_such_dir/out.safetensors"), "is not a directory"),
        ((supervised, "a_file/out.safetensors"), "is not a directory"),
        ((mpp, "out.safetensors", "--with-head"), "has no classifier"),
        ((mpp, "out.safetensors", "--weights", "teacher"), "has no EMA teacher"),
        ((mae_finetuned, "out", "--format", "hf", "--with-head"), "normalises before pooling or after"),
        # timm picks its loader by the suffix: safetensors bytes under another name do not load.
        ((supervised, "out.pth"), "does not end in .safetensors"),
        ((supervised, "out", "--format", "timm"), "does not end in .safetensors"),
    ]
    before = listing(tmp_path)
    for (checkpoint, out, *options), words in cases:
        proc = run_cli("export", str(checkpoint), str(tmp_path / out), *options, check=False)
        assert words in error_line(proc)
        assert listing(tmp_path) == before  # no OUT, no temporary file or folder
    assert not marker.exists()
    assert (tmp_path / "taken.safetensors").read_bytes() == b"keep me"
    pickle.loads(pickle.dumps(TouchesMarker(marker)))  # the payload does run code when unpickled unsafely
    assert marker.exists()


def test_weights_teacher_exports_the_ema_teacher_and_the_loader_takes_it_too(trained, tmp_path):
    from safetensors.torch import load_file

    path, task, _ = trained["custom_ijepa"]
    for which, module in (("teacher", task.teacher), ("student", task.backbone)):
        out = tmp_path / f"{which}.safetensors"
        run_cli("export", str(path), str(out), "--weights", which)
        saved, expected = load_file(out), module.state_dict()
        assert saved.keys() == expected.keys()
        assert all(torch.equal(saved[key], expected[key]) for key in expected), which
        loaded, _ = load_backbone(str(path), weights=which)
        assert all(torch.equal(value, expected[key]) for key, value in loaded.state_dict().items())
    qkv = "blocks.0.attn.qkv.weight"
    assert not torch.equal(task.teacher.state_dict()[qkv], task.backbone.state_dict()[qkv])
