"""Position-embedding similarity and patch-embedding principal components on hand-built embeddings."""

import torch
from timm.layers import build_sincos2d_pos_embed

from ssl_vit.analysis.embeddings import patch_filter_components, position_similarity
from ssl_vit.models.vit import ViTConfig


def test_similarity_of_a_sincos_table_peaks_at_the_patch_and_falls_with_distance():
    vit = ViTConfig("S/4", 32, width=64, depth=1, heads=2).build()  # 8 x 8 patches
    with torch.no_grad():
        vit.pos_embed[0, 1:] = build_sincos2d_pos_embed([8, 8], 64)
        vit.pos_embed[0, 0] = 100.0  # the [class] token's embedding must play no part
    similarity = position_similarity(vit)
    assert similarity.shape == (64, 64)
    assert torch.allclose(similarity.diagonal(), torch.ones(64))
    assert torch.equal(similarity.argmax(1), torch.arange(64))
    # Farther along either axis, never nearer along the other: strictly less similar. Within 3 patches:
    # beyond, the table's fastest frequency (1 radian per patch) has wrapped around.
    rows, cols = torch.arange(64) // 8, torch.arange(64) % 8
    dr, dc = (rows[:, None] - rows[None]).abs(), (cols[:, None] - cols[None]).abs()  # (query, key)
    for query in range(64):
        farther = (dr[query][None] >= dr[query][:, None]) & (dc[query][None] >= dc[query][:, None])
        farther &= (dr[query][None] + dc[query][None]) > (dr[query][:, None] + dc[query][:, None])
        farther &= (dr[query] <= 3)[None] & (dc[query] <= 3)[None]
        near, far = farther.nonzero(as_tuple=True)
        assert (similarity[query, near] > similarity[query, far]).all()


def test_filter_components_recover_the_filters_principal_directions():
    vit = ViTConfig("S/4", 32, width=64, depth=1, heads=2).build()
    torch.manual_seed(0)
    directions = torch.linalg.qr(torch.randn(48, 2)).Q.T  # two orthonormal 3 x 4 x 4 patterns
    weights = torch.randn(64, 2) * torch.tensor([3.0, 1.0])  # the first varies most
    with torch.no_grad():
        vit.patch_embed.proj.weight.copy_(
            (weights @ directions + 1e-4 * torch.randn(64, 48)).view(64, 3, 4, 4)
        )
    components, ratio = patch_filter_components(vit)
    assert components.shape == (28, 3, 4, 4) and ratio.shape == (28,)
    assert ratio[:2].sum() > 0.999 and ratio[0] > ratio[1] and (ratio[:-1] >= ratio[1:]).all()
    assert torch.allclose(components.amin((1, 2, 3)), torch.zeros(28))
    assert torch.allclose(components.amax((1, 2, 3)), torch.ones(28))
    # The first shown component is the first direction, up to sign and the [0, 1] rescaling.
    first = components[0].flatten() - components[0].mean()
    cosine = torch.nn.functional.cosine_similarity(first, directions[0] - directions[0].mean(), dim=0)
    assert cosine.abs() > 0.999

    small = ViTConfig("S/4", 32, width=16, depth=1, heads=2).build()
    assert patch_filter_components(small)[0].shape == (15, 3, 4, 4)  # rank of 16 centred filters
    hybrid = ViTConfig("R50+S/16", 32, width=32, depth=1, heads=2).build()
    assert patch_filter_components(hybrid) is None


def test_filter_components_of_five_bands_are_over_all_bands_and_drawn_in_the_display_bands():
    """The filters vary along one direction that lives in band 4 only: the first component (over all five
    bands) is it, shown in the display bands (4, 0, 4): red and blue its pattern, green (band 0) flat."""
    vit = ViTConfig("S/4", 32, width=64, depth=1, heads=2, in_chans=5).build()
    torch.manual_seed(0)
    pattern = torch.randn(4, 4)
    with torch.no_grad():
        vit.patch_embed.proj.weight.copy_(1e-4 * torch.randn(64, 5, 4, 4))
        vit.patch_embed.proj.weight[:, 4] += torch.randn(64, 1, 1) * pattern
    components, ratio = patch_filter_components(vit, display_bands=(4, 0, 4))
    assert components.shape == (28, 3, 4, 4) and ratio[0] > 0.999
    red, green, blue = components[0]
    assert torch.equal(red, blue) and green.std() < 1e-3 * red.std()
    shown = red - red.mean()
    cosine = torch.nn.functional.cosine_similarity(shown.flatten(), pattern.flatten() - pattern.mean(), dim=0)
    assert cosine.abs() > 0.999
    rgb = patch_filter_components(ViTConfig("S/4", 32, width=64, depth=1, heads=2).build())
    assert rgb[0].shape == (28, 3, 4, 4)
