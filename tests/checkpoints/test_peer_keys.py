"""The peers' MAE checkpoints as backbones (`ssl_vit.checkpoints.peers`): state dicts in the key layout
lightly's and stable-pretraining's MAE save, written here by hand from a timm ViT (the peers are not
installed for `make test`; `make peers` round-trips checkpoints the peers themselves saved), read by
`ssl-vit info` and evaluated by `ssl-vit evaluate` exactly as the same weights under timm's own names."""

import json

import pytest
import torch
import yaml
from cli_helpers import run_cli
from test_errors import error_line
from timm.models.vision_transformer import VisionTransformer

from ssl_vit.checkpoints.peers import MAPPINGS

# The quickstart suite's backbone (recipes/eval/quickstart.yaml), so `evaluate` reads the digits.
BACKBONE = {"variant": "S/4", "img_size": 32, "width": 64, "depth": 4, "heads": 4}


def timm_vit() -> VisionTransformer:
    torch.manual_seed(0)
    return VisionTransformer(img_size=32, patch_size=4, embed_dim=64, depth=4, num_heads=4, num_classes=10)


def lightly_layout(vit: VisionTransformer) -> dict:
    """lightly's MAE example: `backbone = MaskedVisionTransformerTIMM(vit=vit)` (the ViT with its head,
    and a mask token) and `decoder = MAEDecoderTIMM(...)`."""
    state = {f"backbone.vit.{k}": v for k, v in vit.state_dict().items()}
    state["backbone.mask_token"] = torch.zeros(1, 1, 64)
    state |= {
        "decoder.mask_token": torch.zeros(1, 1, 32),
        "decoder.decoder_pos_embed": torch.zeros(1, 65, 32),
        "decoder.decoder_embed.weight": torch.randn(32, 64),
        "decoder.decoder_blocks.0.norm1.weight": torch.ones(32),
        "decoder.decoder_norm.weight": torch.ones(32),
        "decoder.decoder_pred.weight": torch.randn(48, 32),
    }
    return state


def stable_pretraining_layout(vit: VisionTransformer) -> dict:
    """stable-pretraining's `methods.MAE`: `encoder = MaskedEncoder(vit)` (timm's ViT without its head as
    `vit`, and its patch embedding again as `patch_embed`) and `decoder = MAEDecoder(...)`."""
    body = {k: v for k, v in vit.state_dict().items() if not k.startswith("head.")}
    state = {f"encoder.vit.{k}": v for k, v in body.items()}
    state |= {f"encoder.{k}": v for k, v in body.items() if k.startswith("patch_embed.")}
    state |= {
        "decoder.mask_token": torch.zeros(1, 1, 32),
        "decoder.transformer.pos_embed": torch.zeros(1, 64, 32),
        "decoder.transformer.context_proj.weight": torch.randn(32, 64),
        "decoder.transformer.output_proj.weight": torch.randn(48, 32),
        "decoder.transformer.final_norm.weight": torch.ones(32),
    }
    return state


LAYOUTS = {"lightly": lightly_layout, "stable-pretraining": stable_pretraining_layout}


def save(state: dict, path, container: str):
    """As `trainer.save_checkpoint` (Lightning) or `torch.save(model.state_dict())` writes it; `wrapped`:
    a LightningModule holding the MAE as `model` (stable-pretraining's Lightning example)."""
    if container == "wrapped":
        state, container = {f"model.{k}": v for k, v in state.items()}, "lightning"
    if container == "lightning":
        hparams = {"model_name": "vit_small_patch16_224", "mask_ratio": 0.75}  # the peer's own, not ssl-vit's
        state = {"state_dict": state, "hyper_parameters": hparams, "epoch": 3, "global_step": 120}
    torch.save(state, path)
    return path


@pytest.mark.parametrize("peer", LAYOUTS)
@pytest.mark.parametrize("container", ["lightning", "state_dict", "wrapped"])
def test_info_reads_the_peers_backbone(tmp_path, cli, peer, container):
    vit = timm_vit()
    path = save(LAYOUTS[peer](vit), tmp_path / f"{peer}.ckpt", container)
    proc = cli("info", str(path))
    assert f"a checkpoint of {peer}'s MAE" in proc.stdout
    # 64 wide and 4 deep is no paper variant: its heads are in no shape (a suite's backbone gives them)
    assert "backbone: its shapes match no paper variant" in proc.stdout
    body = sum(v.numel() for k, v in vit.state_dict().items() if not k.startswith("head."))
    assert f"parameters: {body / 1e6:.2f} M (backbone)" in proc.stdout


@pytest.fixture(scope="module")
def evaluations(tmp_path_factory, digits_shards):
    """`ssl-vit evaluate` (k-NN on the digits) of the same ViT saved by each peer and under timm's names."""
    root = tmp_path_factory.mktemp("peers")
    suite = {
        "backbone": BACKBONE,
        "data": {
            "train_urls": str(digits_shards / "train-{000000..000004}.tar"),
            "test_urls": str(digits_shards / "val-{000000..000003}.tar"),
            "image_size": 32,
            "batch_size": 128,
            "num_workers": 0,
        },
        "protocols": [{"name": "knn", "kind": "knn", "k": 5}],
    }
    (root / "suite.yaml").write_text(yaml.safe_dump(suite))
    vit = timm_vit()
    sources = {
        "timm": save(vit.state_dict(), root / "timm.pth", "state_dict"),
        "lightly": save(lightly_layout(vit), root / "lightly.ckpt", "lightning"),
        "stable-pretraining": save(stable_pretraining_layout(vit), root / "spt.pth", "state_dict"),
    }
    results = {}
    for name, source in sources.items():
        out = root / f"eval_{name}"
        run_cli("evaluate", str(source), "--suite", str(root / "suite.yaml"), "--out", str(out))
        results[name] = json.loads((out / "results.json").read_text())["results"]
    return root, results


@pytest.mark.parametrize("peer", LAYOUTS)
def test_evaluate_scores_a_peers_checkpoint_as_its_timm_weights(evaluations, peer):
    _, results = evaluations
    assert results[peer] == results["timm"]
    print(f"{peer}: {results[peer]}")


def hostile(state: dict, prefix: str, kind: str) -> dict:
    if kind == "wrong_shape":
        return {**state, f"{prefix}blocks.1.attn.qkv.weight": torch.zeros(192, 32)}
    if kind == "missing_block_tensor":
        return {k: v for k, v in state.items() if k != f"{prefix}blocks.2.mlp.fc2.weight"}
    if kind == "no_vit":  # the prefix, and nothing of a ViT under it
        return {f"{prefix}cls_token": torch.zeros(1, 1, 64), "decoder.mask_token": torch.zeros(1, 1, 32)}
    raise ValueError(kind)


@pytest.mark.parametrize("peer, prefix", [(m.peer, m.prefix) for m in MAPPINGS])
@pytest.mark.parametrize(
    "kind, words",
    [
        ("wrong_shape", ["weights do not fit the backbone", "blocks.1.attn.qkv.weight"]),
        ("missing_block_tensor", ["weights do not fit the backbone", "blocks.2.mlp.fc2.weight"]),
        ("no_vit", ["is not a ViT's weights"]),
    ],
)
def test_a_broken_peer_checkpoint_is_one_line(evaluations, cli, tmp_path, peer, prefix, kind, words):
    root, _ = evaluations
    path = save(hostile(LAYOUTS[peer](timm_vit()), prefix, kind), tmp_path / "peer.ckpt", "lightning")
    out = tmp_path / "out"
    proc = cli("evaluate", str(path), "--suite", str(root / "suite.yaml"), "--out", str(out), check=False)
    error_line(proc, f"({peer}'s MAE)", *words)
    assert not out.exists()
