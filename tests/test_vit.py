"""The backbone: timm's weights and outputs, variants, token-level entry points, resolution changes."""

import pytest
import timm
import torch

from ssl_vit import build_vit
from ssl_vit.models.feature import FEATURES
from ssl_vit.models.vit import EXAMPLE_VARIANTS, ViTConfig, parse_variant

TINY = dict(width=64, depth=2, heads=2)


def n_params(model):
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("variant, paper_millions", [("B/16", 86), ("L/16", 307), ("H/14", 632)])
def test_parameter_counts_match_vit_paper_table_1(variant, paper_millions):
    vit = build_vit(variant, device="meta")  # shapes only: H/14 costs no memory or init time
    assert abs(n_params(vit) / 1e6 - paper_millions) / paper_millions < 0.015


def test_variant_dims_come_from_the_table():
    vit = build_vit("L/32", device="meta")
    assert (vit.embed_dim, len(vit.blocks), vit.blocks[0].attn.num_heads) == (1024, 24, 16)
    assert vit.blocks[0].mlp.fc1.out_features == 4096
    assert vit.patch_embed.patch_size == (32, 32)
    assert parse_variant("R50+B/16").hybrid and not parse_variant("M/8").hybrid


@pytest.mark.parametrize("bad", ["X/16", "B16", "B/0", "R50+B/8", "", "b/16/2"])
def test_unknown_variant_lists_the_valid_ones(bad):
    with pytest.raises(ValueError, match=r"valid: .*B/16"):
        build_vit(bad)


def assert_same_outputs(a, b, images):
    a.eval(), b.eval()
    with torch.no_grad():
        torch.testing.assert_close(a(images), b(images), rtol=0, atol=1e-6)


def test_b16_round_trips_with_timm_both_ways():
    images = torch.randn(1, 3, 224, 224)
    ours = build_vit("B/16")
    theirs = timm.create_model("vit_base_patch16_224", pretrained=False, num_classes=0)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    assert_same_outputs(ours, theirs, images)

    theirs = timm.create_model("vit_base_patch16_224", pretrained=False, num_classes=0)  # fresh weights
    ours.load_state_dict(theirs.state_dict(), strict=True)
    assert_same_outputs(ours, theirs, images)


def test_gap_pooling_and_hybrid_match_timm_models():
    images = torch.randn(2, 3, 64, 64)
    gap = build_vit("S/16", 64, pooling="gap", **TINY)
    assert gap.cls_token is None
    theirs = timm.create_model(
        "vit_small_patch16_224",
        img_size=64,
        embed_dim=64,
        depth=2,
        num_heads=2,
        num_classes=0,
        class_token=False,
        global_pool="avg",
    )
    theirs.load_state_dict(gap.state_dict(), strict=True)
    assert_same_outputs(gap, theirs, images)

    hybrid = build_vit("R50+B/16", 64, **TINY)
    theirs = timm.create_model(
        "vit_base_r50_s16_224", img_size=64, embed_dim=64, depth=2, num_heads=2, num_classes=0
    )
    theirs.load_state_dict(hybrid.state_dict(), strict=True)
    assert_same_outputs(hybrid, theirs, images)
    assert hybrid.grid_size == (4, 4) and hybrid.pixels_per_token == 16


@pytest.fixture
def tiny():
    torch.manual_seed(0)
    return build_vit("S/8", 32, **TINY).eval()


def test_encode_with_every_token_is_the_plain_forward(tiny):
    images = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        features = tiny.forward_features(images)
        tokens = tiny.forward_tokens(images)
        all_kept = tiny.encode(tiny.embed_patches(images), idx_keep=torch.arange(16).expand(3, 16))
    torch.testing.assert_close(tokens.cls, features[:, 0])
    torch.testing.assert_close(tokens.patches, features[:, 1:])
    torch.testing.assert_close(tokens.pooled, tiny(images))
    torch.testing.assert_close(all_kept.patches, features[:, 1:])


def test_feature_kinds_pool_as_the_papers_do(tiny):
    images = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        final = tiny.forward_features(images)  # (B, 1 + N, D) after the final norm
        first_block = tiny.blocks[0](tiny.norm_pre(tiny._pos_embed(tiny.patch_embed(images))))
        torch.testing.assert_close(tiny.features(images, "cls"), final[:, 0])
        torch.testing.assert_close(tiny.features(images, "mean"), final[:, 1:].mean(1))
        lastk = tiny.features(images, "lastk", last_k=2)  # DINO: each block's [class] token, normalised
        torch.testing.assert_close(lastk, torch.cat([tiny.norm(first_block)[:, 0], final[:, 0]], 1))
        gap = build_vit("S/8", 32, pooling="gap", **TINY).eval()
        # a GAP backbone's mean is its own head input: fc_norm after pooling, not norm before
        torch.testing.assert_close(gap.features(images, "mean"), gap(images))
        torch.testing.assert_close(gap.features(images, "lastk", last_k=1), gap(images))
    tiny.check_feature("lastk", last_k=2)
    with pytest.raises(ValueError, match=r"^unknown feature 'avg': use one of cls, mean, lastk, tokens"):
        tiny.check_feature("avg")
    with pytest.raises(ValueError, match=r"^unknown feature 'lastk': use one of cls, mean$"):
        tiny.check_feature("lastk", kinds=("cls", "mean"))
    with pytest.raises(ValueError, match=r"last_k must be in \[1, 2\]"):
        tiny.check_feature("lastk", last_k=3)
    with pytest.raises(ValueError, match=r"needs a \[class\] token.*use 'mean' or 'lastk'$"):
        gap.check_feature("cls")


@pytest.mark.parametrize("pooling", ["cls", "gap"])
def test_every_registered_feature_has_the_size_it_declares(pooling):
    """Each feature of `ssl_vit.models.features`, read from one pass with the others, is (B, F) pooled or
    (B, T, F) per token as its `size` says (what the evaluation's token cache is sized by)."""
    vit = build_vit("S/8", 32, pooling=pooling, **TINY).eval()
    kinds = tuple(name for name, f in FEATURES.items() if vit.cls_token is not None or not f.needs_cls)
    with torch.no_grad():
        found = vit.feature_set(torch.randn(3, 3, 32, 32), kinds, last_k=2)
    assert tuple(found) == kinds and ("cls" in kinds) == (pooling == "cls")
    for name in kinds:
        tokens, width = FEATURES[name].size(16, vit.num_prefix_tokens, 64, 2)
        assert found[name].shape == ((3, width) if FEATURES[name].pooled else (3, tokens, width)), name


def test_kept_tokens_keep_their_own_position(tiny):
    """Gathering happens after position embeddings: a permuted keep order permutes the outputs."""
    images = torch.randn(2, 3, 32, 32)
    perm = torch.stack([torch.randperm(16) for _ in range(2)])
    with torch.no_grad():
        plain = tiny.forward_tokens(images)
        permuted = tiny.encode(tiny.embed_patches(images), idx_keep=perm)
    expected = torch.gather(plain.patches, 1, perm.unsqueeze(-1).expand(-1, -1, 64))
    torch.testing.assert_close(permuted.patches, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(permuted.cls, plain.cls, atol=1e-5, rtol=1e-5)


def test_subset_runs_exactly_that_many_tokens_through_the_blocks(tiny):
    seen = []
    for block in tiny.blocks:
        block.register_forward_hook(lambda module, inputs, output: seen.append(inputs[0].shape[1]))
    idx_keep = torch.stack([torch.randperm(16)[:4] for _ in range(5)])
    out = tiny.encode(tiny.embed_patches(torch.randn(5, 3, 32, 32)), idx_keep=idx_keep)
    assert seen == [1 + 4, 1 + 4]  # [class] + kept, in each of the 2 blocks
    assert out.patches.shape == (5, 4, 64) and out.cls.shape == (5, 64)


def test_mask_token_replaces_patches_before_position_embeddings(tiny):
    images = torch.randn(2, 3, 32, 32)
    mask = torch.zeros(2, 16, dtype=torch.bool)
    mask[:, :6] = True
    token = torch.randn(64)
    embedded = tiny.embed_patches(images)
    with torch.no_grad():
        masked = tiny.encode(embedded, mask=mask, mask_token=token)
        by_hand = embedded.clone()
        by_hand[:, :6] = token
        torch.testing.assert_close(masked.patches, tiny.encode(by_hand).patches)
        # What was under the mask no longer matters ...
        other = embedded.clone()
        other[:, :6] = torch.randn(2, 6, 64)
        torch.testing.assert_close(tiny.encode(other, mask=mask, mask_token=token).patches, masked.patches)
    # ... but positions still do: masked tokens at different places give different outputs.
    assert not torch.allclose(masked.patches[:, 0], masked.patches[:, 1])


def test_pos_embed_resampling_same_size_is_identity_and_larger_grid_runs(tiny):
    before = tiny.pos_embed.detach().clone()
    tiny.set_input_size(img_size=(32, 32))
    torch.testing.assert_close(tiny.pos_embed, before, rtol=0, atol=0)

    tiny.set_input_size(img_size=(48, 48))
    assert tiny.grid_size == (6, 6)
    assert tiny.pos_embed.shape == (1, 1 + 36, 64)
    torch.testing.assert_close(tiny.pos_embed[:, 0], before[:, 0])  # [class] position untouched
    out = tiny.forward_tokens(torch.randn(1, 3, 48, 48))
    assert out.patches.shape == (1, 36, 64)


def _tiny_args(variant):
    patch = parse_variant(variant).patch_size
    return dict(img_size=2 * patch if patch >= 16 else 4 * patch, **TINY)


@pytest.mark.parametrize("variant", [*EXAMPLE_VARIANTS, "M/16", "R50+L/32"])
@pytest.mark.parametrize("pooling", ["cls", "gap"])
def test_every_variant_runs_forward_and_backward_with_finite_gradients(variant, pooling):
    args = _tiny_args(variant)
    vit = build_vit(variant, pooling=pooling, num_classes=3, **args)
    images = torch.randn(2, 3, args["img_size"], args["img_size"])
    tokens = vit.forward_tokens(images)
    loss = vit.head(tokens.pooled).square().mean() + tokens.patches.square().mean()
    loss.backward()
    grads = {name: p.grad for name, p in vit.named_parameters()}
    missing = [name for name, g in grads.items() if g is None]
    assert not missing, f"no gradient for {missing}"
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert vit.variant == variant


def test_overrides_validate_heads():
    with pytest.raises(ValueError, match="divisible"):
        build_vit("B/16", width=50, heads=3)


@pytest.mark.parametrize(
    "variant, timm_name, conv",
    [
        ("S/16", "vit_small_patch16_224", "patch_embed.proj.weight"),
        ("R50+B/16", "vit_base_r50_s16_224", "patch_embed.backbone.stem.conv.weight"),  # the ResNet stem
    ],
)
def test_in_chans_is_timms_for_plain_vits_and_hybrids(variant, timm_name, conv):
    """Five input bands: timm's `in_chans`, the same state dict and outputs as timm's model of them."""
    ours = ViTConfig(variant, 64, width=64, depth=2, heads=2, in_chans=5).build()
    assert ours.in_chans == 5 and ours.state_dict()[conv].shape[1] == 5
    theirs = timm.create_model(
        timm_name, img_size=64, embed_dim=64, depth=2, num_heads=2, num_classes=0, in_chans=5
    )
    theirs.load_state_dict(ours.state_dict(), strict=True)
    assert_same_outputs(ours, theirs, torch.randn(2, 5, 64, 64))
    assert ours.forward_tokens(torch.randn(1, 5, 64, 64)).patches.shape == (1, 16, 64)


@pytest.mark.parametrize("value", [0, -1, 2.5, True, "5"])
def test_in_chans_must_be_a_positive_integer(value):
    with pytest.raises(ValueError, match=f"in_chans is {value!r}"):
        ViTConfig.from_dict({"variant": "S/16", "in_chans": value}, "suite.yaml: backbone")
    with pytest.raises(ValueError, match="give the number of input bands, a positive integer"):
        build_vit("S/16", 32, in_chans=value, **TINY)
