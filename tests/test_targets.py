"""Contracts of ssl_vit.targets: known colours give known classes, patch order is timm's, MAE's pixels."""

import pytest
import torch

from ssl_vit.targets import (
    decode_mean_color_3bit,
    mean_color_3bit,
    mean_color_3bit_4x4,
    patchify,
    pixel_targets,
    unpatchify,
)


def paint(colours: torch.Tensor, size: int) -> torch.Tensor:
    """Colours [rows, cols, 3] -> image [1, 3, rows*size, cols*size], each colour a size x size square."""
    return colours.permute(2, 0, 1).repeat_interleave(size, 1).repeat_interleave(size, 2)[None]


@pytest.mark.parametrize(
    "colour,cls",
    [
        ((1, 0, 0), 7),
        ((0, 1, 0), 56),
        ((0, 0, 1), 448),
        ((0, 0, 0), 0),
        ((1, 1, 1), 511),
        ((0.3, 0.3, 0.3), 146),
    ],
)
def test_known_colours_give_known_classes(colour, cls):  # 0.3 -> bin 2: 2 + 8*2 + 64*2 = 146
    image = paint(torch.tensor([[colour]], dtype=torch.float32), 4)
    assert mean_color_3bit(image, 4).tolist() == [[cls]]


def test_class_is_the_mean_over_the_patch():
    image = torch.zeros(1, 3, 4, 4)
    image[:, 0, :2] = 1.0  # top half red: mean red 0.5 -> bin 4
    assert mean_color_3bit(image, 4).tolist() == [[4]]


def test_patch_order_is_row_major():
    colours = torch.zeros(2, 3, 3)  # grid 2 rows x 3 columns
    colours[0, 2] = torch.tensor([1.0, 0, 0])  # top-right red
    colours[1, 0] = torch.tensor([0, 1.0, 0])  # bottom-left green
    assert mean_color_3bit(paint(colours, 4), 4).tolist() == [[0, 0, 7, 56, 0, 0]]


def test_4x4_target_reads_sub_blocks_row_major():
    # Sub-block k of an 8-pixel patch: red level k % 8, blue level k // 8 (bin centres),
    # so its class is k % 8 + 64 (k // 8).
    k = torch.arange(16).view(4, 4)
    sub = torch.stack([(k % 8 + 0.5) / 8, torch.zeros(4, 4), (k // 8 + 0.5) / 8], dim=-1)
    patch = paint(sub, 2)  # [1, 3, 8, 8]
    image = torch.cat([torch.zeros_like(patch), patch], dim=-1)  # grid 1 x 2: black, then the pattern
    target = mean_color_3bit_4x4(image, 8)
    assert target.shape == (1, 2, 16)
    assert target[0, 0].tolist() == [0] * 16
    assert target[0, 1].tolist() == (k.flatten() % 8 + 64 * (k.flatten() // 8)).tolist()


def test_4x4_target_needs_patch_divisible_by_4():
    with pytest.raises(ValueError, match="divisible by 4"):
        mean_color_3bit_4x4(torch.rand(1, 3, 12, 12), 6)


def test_decode_gives_bin_centres_and_round_trips():
    classes = torch.arange(512)
    colours = decode_mean_color_3bit(classes)
    assert colours.shape == (512, 3)
    assert decode_mean_color_3bit(torch.tensor(7)).tolist() == [0.9375, 0.0625, 0.0625]
    assert torch.equal(mean_color_3bit(paint(colours.view(16, 32, 3), 2), 2).flatten(), classes)


def test_patchify_order_and_round_trip():
    images = torch.rand(2, 3, 8, 12)
    patches = patchify(images, 4)
    assert patches.shape == (2, 6, 48)
    # patch 5 is row 1, column 2; pixels ordered (row, column, channel) as in MAE
    assert torch.equal(patches[:, 5], images[:, :, 4:8, 8:12].permute(0, 2, 3, 1).flatten(1))
    assert torch.equal(unpatchify(patches, 4, (2, 3)), images)


def test_pixel_targets_raw_and_normalised():
    images = torch.rand(2, 3, 8, 8)
    assert torch.equal(pixel_targets(images, 4), patchify(images, 4))
    target = pixel_targets(images, 4, normalize=True)
    assert torch.allclose(target.mean(dim=-1), torch.zeros(2, 4), atol=1e-4)
    assert torch.allclose(target.var(dim=-1), torch.ones(2, 4), atol=1e-4)


@pytest.mark.parametrize("fn", [mean_color_3bit, mean_color_3bit_4x4, patchify, pixel_targets])
def test_indivisible_image_is_a_value_error(fn):
    with pytest.raises(ValueError, match="not divisible by the patch size 8"):
        fn(torch.rand(1, 3, 16, 20), 8)
