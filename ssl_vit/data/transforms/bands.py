"""Transform presets for images read as arrays (any band count; 8-bit, 16-bit or float: see
`samples.transform_image`): tensor [C, H, W] -> tensor [C, size, size]. 8-bit images stay uint8
(resampled by torchvision's uint8 kernels, and converted to model units on the device, as RGB batches
are); every other dtype leaves as float32 in its stored units (int16 and uint16 values are exact in
float32), which spares the device a conversion per dtype.

The crop boxes and flips are the PIL presets' draws (`transforms.RandomResizedCrop.box`, then
`HorizontalFlip`'s one `random.random()`), in the same order from the same per-sample seeds: a seed,
an exact resume and the crop distribution mean the same whatever an image is stored as. Resampling is
torchvision v2's functional ops on tensors: antialiased bilinear for images, NEAREST_EXACT for masks
(which samples the pixel centres bilinear samples, so that each mask pixel is the class under its
image pixel; torchvision's NEAREST floors the source index instead). timm's RandAugment works on RGB PIL
images and has no array counterpart here.
"""

from __future__ import annotations

import random

import torch
import torchvision.transforms.v2.functional as F
from torchvision.transforms.v2 import InterpolationMode

from ssl_vit.data.format.masks import IGNORE_INDEX
from ssl_vit.data.transforms.rgb import HorizontalFlip, Preset, RandomResizedCrop, eval_resize


def build_array_transform(
    preset: Preset, image_size: int, *, crop_scale: tuple[float, float] = (0.08, 1.0), crop_pct: float = 0.875
):
    """The array counterpart of `transforms.build_transform` (without RandAugment)."""
    if preset == "eval":
        return ArrayResizeCentreCrop(eval_resize(image_size, crop_pct), image_size)
    return ArrayCropFlip(RandomResizedCrop(image_size, scale=crop_scale), HorizontalFlip())


def _values(image: torch.Tensor) -> torch.Tensor:
    """uint8 as it is, every other dtype as float32."""
    return image if image.dtype in (torch.uint8, torch.float32) else image.float()


class ArrayCropFlip:
    """`pretrain`/`supervised`: the random resized crop (`crop.box`, drawn from the header's size) and
    the horizontal flip, with the PIL presets' draws."""

    def __init__(self, crop: RandomResizedCrop, flip: HorizontalFlip):
        self.crop, self.flip = crop, flip

    def _draw(self, image: torch.Tensor) -> tuple[tuple[int, int, int, int], bool]:
        box = self.crop.box(image.shape[-1], image.shape[-2])
        return box, random.random() < self.flip.p

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        box, flipped = self._draw(image)
        return self._resized(_values(image), box, flipped, InterpolationMode.BILINEAR)

    def pair(self, image: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Image [C, H, W] and mask [H, W] -> both cropped with one box and flipped with one draw."""
        box, flipped = self._draw(image)
        out = self._resized(_values(image), box, flipped, InterpolationMode.BILINEAR)
        return out, self._resized(mask[None], box, flipped, InterpolationMode.NEAREST_EXACT)[0]

    def _resized(self, image: torch.Tensor, box, flipped: bool, mode: InterpolationMode) -> torch.Tensor:
        left, top, w, h = box
        size = [self.crop.size, self.crop.size]
        out = F.resized_crop(image, top, left, h, w, size, interpolation=mode, antialias=True)
        return out.flip(-1) if flipped else out

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.crop!r}, {self.flip!r})"


class ArrayResizeCentreCrop:
    """`eval`: the shorter side to `resize` (antialiased bilinear), then the centre `size` x `size`; an
    image already at `resize` is not resampled (the `whole` view passes it untouched). The mask is
    resized (NEAREST_EXACT) to the resized image's size and cropped with it; where the crop is larger
    than the image, its padding is IGNORE_INDEX (the image's is 0)."""

    def __init__(self, resize: int, size: int):
        self.resize, self.size = resize, size

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        resized = F.resize(_values(image), [self.resize], antialias=True)
        return F.center_crop(resized, [self.size, self.size])

    def pair(self, image: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        resized = F.resize(_values(image), [self.resize], antialias=True)
        mask = F.resize(mask[None], list(resized.shape[-2:]), interpolation=InterpolationMode.NEAREST_EXACT)
        crop = [self.size, self.size]
        # center_crop pads with 0: crop the complement, so that the padding comes out as IGNORE_INDEX
        mask = IGNORE_INDEX - F.center_crop(IGNORE_INDEX - mask, crop)
        return F.center_crop(resized, crop), mask[0]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.resize}, {self.size})"
