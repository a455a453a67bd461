"""Frozen features: kinds and their values, eval mode and no grad, key order, and a 2-rank exact pass."""

import json

import pytest
import torch
from cli_helpers import free_port, start_ranks
from eval_dist_helpers import extract_on_rank  # next to this file; pytest puts its folder on sys.path

from ssl_vit.evaluation.features import Features, extract_features
from ssl_vit.models.vit import build_vit

DEPTH, WIDTH = 3, 32


@pytest.fixture(params=["cls", "gap"])
def backbone(request):
    torch.manual_seed(0)
    return build_vit("S/8", 32, width=WIDTH, depth=DEPTH, heads=2, pooling=request.param)


def batches(images: torch.Tensor, labels: torch.Tensor, keys: list[str], size: int = 5) -> list[dict]:
    return [
        {"image": images[i : i + size], "label": labels[i : i + size], "key": keys[i : i + size]}
        for i in range(0, len(keys), size)
    ]


def block_outputs(backbone, images) -> list[torch.Tensor]:
    """Every block's output (B, T, D) of the plain forward, captured with hooks (independent of timm's
    forward_intermediates)."""
    outputs = []
    hooks = [blk.register_forward_hook(lambda m, i, o: outputs.append(o)) for blk in backbone.blocks]
    with torch.no_grad():
        backbone.forward_tokens(images)
    for h in hooks:
        h.remove()
    return outputs


def test_feature_kinds(backbone, digits_batch):
    images, labels = digits_batch["image"][:12], digits_batch["label"][:12]
    keys = [f"k{i:02d}" for i in range(12)]
    loader = batches(images, labels, keys)
    backbone.eval()
    with torch.no_grad():
        tokens = backbone.forward_tokens(images)
    outs = block_outputs(backbone, images)  # each (B, T, D), un-normalised
    gap = backbone.cls_token is None

    mean = extract_features(backbone, loader, "mean")
    with torch.no_grad():  # [class] models normalise each token; GAP models normalise the mean (fc_norm)
        expected_mean = backbone.fc_norm(outs[-1].mean(1)) if gap else backbone.norm(outs[-1])[:, 1:].mean(1)
    torch.testing.assert_close(mean.x, expected_mean, rtol=1e-5, atol=1e-5)
    if gap:
        with pytest.raises(ValueError, match=r"needs a \[class\] token"):
            extract_features(backbone, loader, "cls")
    else:
        cls = extract_features(backbone, loader, "cls")
        assert cls.x.shape == (12, WIDTH) and cls.x.dtype == torch.float32
        torch.testing.assert_close(cls.x, tokens.cls, rtol=1e-5, atol=1e-5)

    lastk = extract_features(backbone, loader, "lastk", last_k=2)
    assert lastk.x.shape == (12, 2 * WIDTH)
    # DINO's recipe by hand: each of the last 2 blocks through the final norm, then pooled as the head
    # pools ([class] token, or fc_norm of the patch mean), concatenated in block order
    with torch.no_grad():
        if gap:
            manual = [backbone.fc_norm(o.mean(1)) for o in outs[-2:]]
        else:
            manual = [backbone.norm(o)[:, 0] for o in outs[-2:]]
    torch.testing.assert_close(lastk.x, torch.cat(manual, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lastk.x[:, WIDTH:], tokens.pooled, rtol=1e-5, atol=1e-5)
    assert torch.equal(mean.y, labels) and mean.keys == keys


@pytest.mark.parametrize("training", [True, False])
def test_eval_mode_no_grad_and_mode_restored(training):
    backbone = build_vit("S/8", 32, width=WIDTH, depth=1, heads=2).train(training)
    seen = []
    backbone.blocks[0].register_forward_pre_hook(
        lambda m, i: seen.append((m.training, torch.is_grad_enabled(), torch.is_inference_mode_enabled()))
    )
    features = extract_features(backbone, batches(torch.randn(6, 3, 32, 32), torch.zeros(6, dtype=torch.long),
                                                  [str(i) for i in range(6)]))  # fmt: skip
    assert seen and all(s == (False, False, True) for s in seen)
    assert backbone.training is training and not features.x.requires_grad


def test_sorted_by_key_and_prepare():
    backbone = build_vit("S/8", 32, width=WIDTH, depth=1, heads=2)
    images = torch.randint(0, 256, (6, 3, 32, 32), dtype=torch.uint8)
    keys, labels = ["f", "b", "d", "a", "e", "c"], torch.tensor([5, 1, 3, 0, 4, 2])
    loader = batches(images, labels, keys, size=4)
    with pytest.raises(ValueError, match="prepare"):
        extract_features(backbone, loader)

    def prepare(batch):
        return {**batch, "image": batch["image"].float() / 255}

    features = extract_features(backbone, loader, prepare=prepare)
    assert features.keys == sorted(keys) and features.y.tolist() == [0, 1, 2, 3, 4, 5]
    backbone.eval()
    with torch.no_grad():
        expected = backbone.forward_tokens(images.float() / 255).cls
    torch.testing.assert_close(features.x, expected[labels.argsort()], rtol=1e-5, atol=1e-5)


def test_invalid_arguments():
    backbone = build_vit("S/8", 32, width=WIDTH, depth=2, heads=2)
    loader = batches(torch.randn(2, 3, 32, 32), torch.zeros(2, dtype=torch.long), ["a", "b"])
    with pytest.raises(ValueError, match=r"last_k must be in \[1, 2\]"):
        extract_features(backbone, loader, "lastk", last_k=3)
    with pytest.raises(ValueError, match="use one of cls, mean, lastk"):
        extract_features(backbone, loader, "avg")
    with pytest.raises(ValueError, match="no samples"):
        extract_features(backbone, [])


@pytest.fixture(scope="module")
def seven_val_shards(tmp_path_factory):
    """digits val (359 samples) in 7 shards (6 x 55 + 29): an odd count, so the ranks' shares differ."""
    from cli_helpers import run_cli

    out = tmp_path_factory.mktemp("digits7")
    run_cli("data", "convert", "digits", str(out), "--split", "val", "--shard-size", "55", "--no-progress")
    return out


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_ranks_see_every_sample_once(seven_val_shards, tmp_path):
    from ssl_vit.data import ShardDataModule

    urls = str(seven_val_shards / "val-{000000..000006}.tar")
    start_ranks(extract_on_rank, 2, free_port(), urls, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]

    # each rank extracted its own share, and together they cover the split exactly once
    local = [r["local_keys"] for r in ranks]
    assert local[0] and local[1] and not set(local[0]) & set(local[1])
    num_samples = json.loads((seven_val_shards / "val.json").read_text())["num_samples"]
    assert len(local[0]) + len(local[1]) == num_samples
    # every rank returns all of them, once each, identically
    gathered = [Features(*r["features"]) for r in ranks]
    assert gathered[0].keys == sorted(local[0] + local[1])
    assert gathered[1].keys == gathered[0].keys
    assert torch.equal(gathered[0].x, gathered[1].x) and torch.equal(gathered[0].y, gathered[1].y)
    # and the result does not depend on the world size
    torch.manual_seed(0)
    backbone = build_vit("S/8", 32, width=32, depth=1, heads=2)
    dm = ShardDataModule(val_urls=urls, image_size=32, batch_size=16, num_workers=0)
    single = extract_features(backbone, dm.exact_dataloader("val"), prepare=dm.prepare_batch)
    assert single.keys == gathered[0].keys and torch.equal(single.y, gathered[0].y)
    torch.testing.assert_close(single.x, gathered[0].x, rtol=1e-5, atol=1e-5)
