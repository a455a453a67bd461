"""Contracts of ssl_vit.targets: known colours give known classes, patch order is timm's, MAE's pixels,
MaskFeat's HOG is the textbook HOG; other band counts: pixels and HOG per band, colours refused."""

import itertools
import math

import numpy as np
import pytest
import skimage.data
import skimage.feature
import torch

from ssl_vit.errors import BadValue
from ssl_vit.targets import TARGETS, TargetContext
from ssl_vit.targets.color3bit_4x4_target import mean_color_3bit_4x4
from ssl_vit.targets.color3bit_target import decode_mean_color_3bit, mean_color_3bit
from ssl_vit.targets.hog_target import hog
from ssl_vit.targets.patches import patchify, unpatchify
from ssl_vit.targets.pixels_target import pixel_targets


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


def test_seen_pixels_are_the_standardised_input_where_pixels_are_rgb():
    """`seen_pixels` (SimMIM's code: L1 on its normalised input) regresses the patches of the model input
    as it is; `pixels` of RGB maps it back to [0, 1] first, so the two differ by the data's mean and std
    per band. Other band counts are standardised bands for both: the same target."""
    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    rgb = torch.rand(2, 3, 8, 8)
    images = (rgb - mean.view(3, 1, 1)) / std.view(3, 1, 1)

    def context(bands, pixels):
        return TargetContext(4, (2, 2), bands, 8, (0, 1, 2), pixels)

    ctx = context(3, lambda x: x * std.view(1, 3, 1, 1) + mean.view(1, 3, 1, 1))
    seen, raw = TARGETS["seen_pixels"](), TARGETS["pixels"]()
    assert seen.shape(ctx) == raw.shape(ctx) == (4 * 4 * 3,)
    assert torch.equal(seen.make(ctx, images), patchify(images, 4))
    by_band = (raw.make(ctx, images).unflatten(-1, (16, 3)) - mean) / std  # (row, column, band) order
    assert torch.allclose(seen.make(ctx, images), by_band.flatten(-2), atol=1e-5)
    bands = torch.randn(2, 5, 8, 8)
    assert torch.equal(seen.make(context(5, lambda x: x), bands), raw.make(context(5, lambda x: x), bands))


def test_rgb_normalised_pixels_are_mae_norm_pix_loss_bit_for_bit():
    """RGB keeps MAE's formula exactly (models_mae.py `forward_loss`): one mean and variance per patch over
    all its values, whatever the per-band option does for other band counts."""
    images = torch.rand(4, 3, 16, 16)
    patches = patchify(images, 4)
    mean, var = patches.mean(dim=-1, keepdim=True), patches.var(dim=-1, keepdim=True)
    assert torch.equal(pixel_targets(images, 4, normalize=True), (patches - mean) / (var + 1.0e-6) ** 0.5)


def test_per_band_normalised_pixels_normalise_each_band_of_each_patch():
    """Five bands in units a thousand apart: each band of each patch has mean 0 and variance 1, and a
    band scaled by 1000 changes no other band's target (nor its own, up to the epsilon)."""
    images = torch.rand(2, 5, 16, 16, dtype=torch.float64)
    images[:, 3] *= 1000
    target = pixel_targets(images, 8, normalize=True, per_band=True)  # (2, 4, 8*8*5)
    assert target.shape == (2, 4, 320)
    per_band = target.unflatten(-1, (64, 5))  # pixels in (row, column, band) order
    torch.testing.assert_close(
        per_band.mean(-2), torch.zeros(2, 4, 5, dtype=torch.float64), rtol=0, atol=1e-9
    )
    torch.testing.assert_close(per_band.var(-2), torch.ones(2, 4, 5, dtype=torch.float64), rtol=0, atol=1e-4)
    scaled = images.clone()
    scaled[:, 1] *= 1000
    again = pixel_targets(scaled, 8, normalize=True, per_band=True).unflatten(-1, (64, 5))
    others = [0, 2, 3, 4]
    assert torch.equal(again[..., others], per_band[..., others])
    torch.testing.assert_close(again[..., 1], per_band[..., 1], rtol=0, atol=1e-4)
    # Over the whole patch instead (RGB's formula), the scaled band would swamp the others.
    joint = pixel_targets(scaled, 8, normalize=True).unflatten(-1, (64, 5))
    assert not torch.allclose(joint[..., others], per_band[..., others], atol=0.1)


def test_hog_of_many_bands_is_each_bands_hog_concatenated():
    """13 bands (Sentinel-2's count): 13 x 9 x 4 values per 16-pixel patch, band after band, each band's
    block what `hog` gives for that band alone (the same histograms whatever the band's units)."""
    images = torch.rand(2, 13, 32, 32, dtype=torch.float64)
    images[:, 5] *= 10000
    found = hog(images, 16)
    assert found.shape == (2, 4, 13 * 9 * 4)
    for band in range(13):
        alone = hog(images[:, band : band + 1].expand(-1, 3, -1, -1), 16)[..., : 9 * 4]  # one band's block
        torch.testing.assert_close(found[..., band * 36 : (band + 1) * 36], alone, rtol=0, atol=1e-9)


@pytest.mark.parametrize("fn", [mean_color_3bit, mean_color_3bit_4x4])
@pytest.mark.parametrize("bands", [1, 5])
def test_colour_targets_refuse_other_band_counts(fn, bands):
    with pytest.raises(BadValue, match=f"quantise 3 RGB bands; these images have {bands}: use pixel or HOG"):
        fn(torch.rand(1, bands, 16, 16), 8)


@pytest.mark.parametrize("fn", [mean_color_3bit, mean_color_3bit_4x4, patchify, pixel_targets])
def test_indivisible_image_is_a_value_error(fn):
    with pytest.raises(ValueError, match="not divisible by the patch size 8"):
        fn(torch.rand(1, 3, 16, 20), 8)


def loop_hog(channel: np.ndarray, cell: int) -> np.ndarray:
    """MaskFeat's HOG of one channel [H, W] -> [H/cell, W/cell, 9], spelled out pixel by pixel: Sobel
    gradients with reflected borders, each pixel's magnitude into the 20-degree bin of its unsigned
    orientation, summed per cell, each cell L2-normalised."""
    padded = np.pad(channel, 1, mode="reflect")  # edge not repeated, as torch's "reflect"
    height, width = channel.shape
    cells = np.zeros((height // cell, width // cell, 9))
    for r, c in itertools.product(range(height), range(width)):
        window = padded[r : r + 3, c : c + 3]
        gx = (window[:, 2] - window[:, 0]) @ [1, 2, 1]
        gy = (window[2, :] - window[0, :]) @ [1, 2, 1]
        degrees = math.degrees(math.atan2(gy, gx)) % 180
        cells[r // cell, c // cell, int(degrees // 20)] += math.hypot(gx, gy)
    return cells / np.maximum(np.linalg.norm(cells, axis=-1, keepdims=True), 1e-12)


@pytest.mark.parametrize("patch, cell", [(16, 8), (4, 4)])
def test_hog_is_the_pixel_by_pixel_recipe_on_photos(patch, cell):
    """Two photos, 48 x 64 crops, as 0-255 integers in float64: every gradient is then an exact integer
    on both sides, so every pixel falls into the same bin (a gradient that is 0 exactly in one and 1e-17
    in the other would flip from bin 0 to bin 8), and what is left is float64 rounding of the sums,
    around 1e-13; 1e-9 is far above it and far below any misplaced vote (over 1e-3 on these photos)."""
    crops = [skimage.data.astronaut()[200:248, 180:244], skimage.data.coffee()[150:198, 300:364]]
    images = torch.tensor(np.stack(crops), dtype=torch.float64).permute(0, 3, 1, 2)  # (2, 3, 48, 64)
    got = hog(images, patch)
    per = patch // cell
    assert got.shape == (2, (48 // patch) * (64 // patch), 3 * 9 * per * per)
    for b, image in enumerate(images.numpy()):
        channels = [loop_hog(channel, cell) for channel in image]  # each (H/cell, W/cell, 9)
        patches = itertools.product(range(48 // patch), range(64 // patch))
        expected = [  # (channel, bin, cell row, cell column) within each row-major patch
            [channels[c][h * per + i, w * per + j, k] for c in range(3) for k in range(9)
             for i in range(per) for j in range(per)]
            for h, w in patches
        ]  # fmt: skip
        np.testing.assert_allclose(got[b].numpy(), np.array(expected), rtol=0, atol=1e-9)


def test_hog_ignores_a_scale_and_offset_per_channel():
    """Computed on [0, 1] pixels, the target is MaskFeat's, which is computed on mean/std-normalised
    inputs. Random float64 images: no gradient cancels exactly, so none sits on a bin edge."""
    images = torch.rand(2, 3, 32, 32, dtype=torch.float64)
    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    normalised = (images - mean.view(1, 3, 1, 1).double()) / std.view(1, 3, 1, 1).double()
    torch.testing.assert_close(hog(normalised, 16), hog(images, 16), rtol=0, atol=1e-9)


@pytest.mark.parametrize("degrees", [edge + offset for edge in range(0, 360, 20) for offset in (1, 10, 19)])
def test_hog_bins_are_scikit_image_bins(degrees):
    """On a ramp, Sobel and scikit-image's central differences give the same gradient direction at every
    pixel (4 times the length inside, on the borders both keep only the component along the border),
    so the per-cell L2-normalised histograms agree: orientation measured the same way, same bin edges."""
    theta = math.radians(degrees)
    rows, cols = np.mgrid[0:32, 0:32].astype(np.float64)
    ramp = math.cos(theta) * cols + math.sin(theta) * rows
    reference = skimage.feature.hog(
        ramp, orientations=9, pixels_per_cell=(8, 8), cells_per_block=(1, 1), block_norm="L2",
        feature_vector=False,
    )[:, :, 0, 0]  # (4, 4, 9)  # fmt: skip
    got = hog(torch.tensor(ramp).expand(1, 3, 32, 32), 8)  # (1, 16, 27): 3 equal channels x 9 bins
    np.testing.assert_allclose(got[0, :, :9].numpy(), reference.reshape(16, 9), atol=1e-6)


@pytest.mark.parametrize("patch, values", [(16, 108), (8, 27), (4, 27), (14, 27)])
def test_hog_cells_are_8_pixels_where_they_tile_the_patch(patch, values):
    assert hog(torch.rand(2, 3, 2 * patch, 3 * patch), patch).shape == (2, 6, values)
