"""Transform presets, one per use, from an opened (not yet decoded) PIL image to a uint8 tensor
[3, H, W] in the DataLoader workers (torchvision v2, timm).

- `pretrain`: random resized crop + horizontal flip (MAE's recipe; the ViT paper's masked patch
  prediction also trains on random crops);
- `supervised`: the same plus timm's RandAugment when a config string is given (mixup/cutmix act on
  whole batches on the device, see `ShardDataModule.on_after_batch_transfer`);
- `eval`: resize the shorter side to `image_size / crop_pct`, centre crop (timm's eval transform);
  with `crop_pct=1` an image stored at `image_size` passes whole (`ShardDataModule.eval_view`).

Every preset decodes the image itself (its first step), because only the crop knows how small the
JPEG may be decoded (PIL draft mode). Images stay uint8 in the workers (`normalize`, on the device:
see `ShardDataModule.prepare_batch`).

A segmentation mask (a sample's `seg.png`: one class index per pixel) goes through the same steps with
`Compose.pair`: each step applies its one random draw (crop box, flip) to the image and the mask, and
resamples the mask with NEAREST, so that no class is invented between two others. The steps are this
module's own classes rather than torchvision's `tv_tensors.Mask` route, which would decode before
cropping (losing the JPEG draft decode), draw from torch's RNG instead of the draws every existing
seed and resume depends on, and add the dispatch cost `Compose` avoids; an image without a mask takes
exactly the path it took before.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np
import torch
import torchvision.transforms.v2 as v2
from PIL import Image, ImageOps
from timm.data.auto_augment import rand_augment_transform

from ssl_vit.errors import BadValue, UserError, shown

Preset = Literal["pretrain", "supervised", "eval"]
DRAFT_SCALES = (8, 4, 2)  # the reductions a JPEG decoder does in the DCT (PIL `Image.draft`)
RANDAUGMENT_AND_MASKS = (
    "timm's RandAugment moves pixels with draws a segmentation mask (seg.png) cannot follow: for shards "
    "with masks use train_preset 'pretrain', or 'supervised' without randaugment"
)


def build_transform(
    preset: Preset,
    image_size: int,
    *,
    mean: tuple[float, float, float],
    crop_scale: tuple[float, float] = (0.08, 1.0),
    randaugment: str | None = None,
    crop_pct: float = 0.875,
    draft: bool = True,
) -> Compose:
    """Opened PIL image -> uint8 tensor [3, image_size, image_size] (a view of an HWC array, which
    `ShardStream.collate` stacks without a transposing copy). With `draft`, JPEGs are decoded at the
    smallest DCT scale that loses no pixel the output needs."""
    if preset not in ("pretrain", "supervised", "eval"):
        raise BadValue(f"preset must be one of 'pretrain', 'supervised', 'eval', got {preset!r}")
    if randaugment and preset != "supervised":
        raise BadValue(f"randaugment is part of the 'supervised' preset, not {preset!r}")
    if preset == "eval":
        resize = eval_resize(image_size, crop_pct)
        steps = [Decode(resize if draft else None), ResizeCentreCrop(resize, image_size)]
    else:
        steps = [RandomResizedCrop(image_size, scale=crop_scale, draft=draft), HorizontalFlip()]
    if randaugment:
        # timm's RandAugment works on PIL images; hparams as timm's create_transform sets them.
        hparams = {"translate_const": int(image_size * 0.45), "img_mean": tuple(round(255 * m) for m in mean)}
        steps.append(_rand_augment(randaugment, hparams))
    return Compose([*steps, ToTensor()])


def _rand_augment(config: str, hparams: dict) -> Callable:
    """timm's RandAugment of `config`; one line for a config timm does not parse (it asserts, or fails
    on a section's number, which would be a traceback)."""
    try:
        return rand_augment_transform(config, hparams)
    except (AssertionError, ValueError, KeyError, IndexError) as err:
        why = str(err).splitlines()[0][:80] if str(err) else "it does not start with 'rand'"
        raise BadValue(
            f"randaugment {shown(config)}: not a timm RandAugment config ({why}): give one such as "
            "rand-m9-mstd0.5-inc1"
        ) from err


class Compose:
    """Apply `steps` in order. torchvision's `v2.Compose`, `RandomHorizontalFlip` and `PILToTensor`
    cost about 0.1-0.2 ms per image on top of the work itself (pytree flattening, type dispatch,
    `nn.Module` calls, two copies to a tensor): 5-10% of decoding and cropping a 500x375 JPEG, which
    is what `ssl-vit bench data` measures against a bare PIL loop."""

    def __init__(self, steps: Sequence[Callable]):
        self.transforms = list(steps)

    def __call__(self, img):
        for step in self.transforms:
            img = step(img)
        return img

    def pair(self, img: Image.Image, mask: Image.Image) -> tuple:
        """An opened image and its mask (mode L, the image's size) -> (uint8 [3, H, W], uint8 [H, W]):
        every step's `pair`, which draws once for both. A step without one (timm's RandAugment) is a
        UserError: the mask would no longer match its image."""
        for step in self.transforms:
            if not hasattr(step, "pair"):
                raise UserError(RANDAUGMENT_AND_MASKS)
            img, mask = step.pair(img, mask)
        return img, mask

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(map(repr, self.transforms))})"


class HorizontalFlip:
    """PIL image -> mirrored with probability `p`; drawn from Python's `random`, which the workers
    seed like torch's (see `ShardStream.__iter__`)."""

    def __init__(self, p: float = 0.5):
        self.p = p

    def __call__(self, img: Image.Image) -> Image.Image:
        return flip(img) if random.random() < self.p else img

    def pair(self, img: Image.Image, mask: Image.Image) -> tuple[Image.Image, Image.Image]:
        return (flip(img), flip(mask)) if random.random() < self.p else (img, mask)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(p={self.p})"


def flip(img: Image.Image) -> Image.Image:
    return img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)


def to_uint8_tensor(img: Image.Image) -> torch.Tensor:
    """RGB PIL image -> uint8 tensor [3, H, W]: a channel-first view of one HWC copy of the pixels
    (torchvision's `PILToTensor` copies twice)."""
    if img.mode != "RGB":
        img = img.convert("RGB")
    return torch.from_numpy(np.array(img)).permute(2, 0, 1)


def mask_tensor(mask: Image.Image) -> torch.Tensor:
    """Mode-L mask -> uint8 tensor [H, W] of class indices."""
    return torch.from_numpy(np.array(mask))


class ToTensor:
    """The presets' last step: image -> `to_uint8_tensor`; with `pair`, the mask -> `mask_tensor`."""

    def __call__(self, img: Image.Image) -> torch.Tensor:
        return to_uint8_tensor(img)

    def pair(self, img: Image.Image, mask: Image.Image) -> tuple[torch.Tensor, torch.Tensor]:
        return to_uint8_tensor(img), mask_tensor(mask)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def draft_scale(short_side: int, target: int) -> int:
    """The largest JPEG draft reduction (8, 4, 2 or 1) that keeps `short_side` >= `target` pixels."""
    return next((s for s in DRAFT_SCALES if short_side >= s * target), 1)


def decode(img: Image.Image, scale: int = 1) -> Image.Image:
    """Decode an opened image to RGB; a JPEG at 1/`scale` of its size (DCT scaling, PIL draft mode)."""
    if scale > 1 and img.format == "JPEG":
        # draft picks the largest scale leaving the image at least the requested size
        img.draft("RGB", (img.width // scale, img.height // scale))
    img.load()
    # `convert` to the mode an image already has is a copy (about 5% of a 500x375 JPEG's decode)
    return img if img.mode == "RGB" else img.convert("RGB")


class Decode:
    """Opened image -> RGB image whose shorter side stays >= `short_side` (JPEG draft), or at full
    size when `short_side` is None. The first step of the `eval` preset, which resizes whole images."""

    def __init__(self, short_side: int | None):
        self.short_side = short_side

    def __call__(self, img: Image.Image) -> Image.Image:
        scale = draft_scale(min(img.size), self.short_side) if self.short_side else 1
        return decode(img, scale)

    def pair(self, img: Image.Image, mask: Image.Image) -> tuple[Image.Image, Image.Image]:
        return self(img), mask


class ResizeCentreCrop:
    """The `eval` framing: shorter side to `resize` (torchvision's `v2.Resize`, antialiased), then the
    centre `size` x `size` (`v2.CenterCrop`). With `pair`, the mask is resized with NEAREST to exactly
    the resized image's size (not to `resize` on its own: a JPEG decoded at a draft scale has sides
    rounded up, so its aspect ratio, and with it the longer side after the resize, can differ by a
    pixel from the full-size mask's) and cropped with it. Where the crop is larger than the resized
    image (`crop_pct` above 1), `v2.CenterCrop` pads with 0: there the mask is cropped as its complement
    (255 - class), so that its padding comes out as 255, ignored, rather than class 0."""

    def __init__(self, resize: int, size: int):
        self.resize, self.crop = v2.Resize(resize, antialias=True), v2.CenterCrop(size)

    def __call__(self, img: Image.Image) -> Image.Image:
        return self.crop(self.resize(img))

    def pair(self, img: Image.Image, mask: Image.Image) -> tuple[Image.Image, Image.Image]:
        img = self.resize(img)
        mask = mask.resize(img.size, Image.Resampling.NEAREST)
        height, width = self.crop.size
        if img.width >= width and img.height >= height:
            return self.crop(img), self.crop(mask)
        return self.crop(img), ImageOps.invert(self.crop(ImageOps.invert(mask)))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.resize.size}, {self.crop.size})"


class RandomResizedCrop:
    """Opened image -> decoded RGB crop (size, size): torchvision's RandomResizedCrop, drawing the box
    before decoding.

    Written here rather than taken from torchvision because torchvision decodes first: knowing the box
    first lets the JPEG be decoded at the largest draft reduction that still leaves the box's shorter
    side >= `size` (never upsampling pixels the full decode would have had), and the crop + resize run
    as one PIL call (`resize(box=...)`, sub-pixel box in the reduced image) instead of a copy + a
    resize. The box distribution is torchvision's (`RandomResizedCrop.get_params`, fallback included),
    drawn from Python's `random` (seeded per worker like torch's) because ten tiny torch ops per image
    cost more than the draw is worth.
    """

    def __init__(
        self,
        size: int,
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        draft: bool = True,
    ):
        self.size, self.scale, self.draft = size, tuple(scale), draft
        self.log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
        self.ratio = ratio

    def box(self, width: int, height: int) -> tuple[int, int, int, int]:
        """(left, top, w, h) of a random box with area in `scale` and aspect ratio in `ratio`."""
        area = width * height
        for _ in range(10):
            target_area = area * random.uniform(*self.scale)
            aspect = math.exp(random.uniform(*self.log_ratio))
            w = round(math.sqrt(target_area * aspect))
            h = round(math.sqrt(target_area / aspect))
            if 0 < w <= width and 0 < h <= height:
                return random.randint(0, width - w), random.randint(0, height - h), w, h
        # fallback: the centre crop with the aspect ratio clamped to `ratio` (as torchvision)
        in_ratio = width / height
        if in_ratio < self.ratio[0]:
            w, h = width, round(width / self.ratio[0])
        elif in_ratio > self.ratio[1]:
            w, h = round(height * self.ratio[1]), height
        else:
            w, h = width, height
        return (width - w) // 2, (height - h) // 2, w, h

    def __call__(self, img: Image.Image) -> Image.Image:
        return self.crop_image(img, self.box(*img.size))  # the size from the header: nothing decoded yet

    def pair(self, img: Image.Image, mask: Image.Image) -> tuple[Image.Image, Image.Image]:
        box = self.box(*img.size)
        return self.crop_image(img, box), self.crop_mask(mask, box)

    def crop_image(self, img: Image.Image, box: tuple[int, int, int, int]) -> Image.Image:
        """The opened image's `box` (full-size pixels) decoded and resized to (size, size), bilinear."""
        width, height = img.size
        left, top, w, h = box
        img = decode(img, draft_scale(min(w, h), self.size) if self.draft else 1)
        fx, fy = img.width / width, img.height / height
        box = (left * fx, top * fy, (left + w) * fx, (top + h) * fy)
        return img.resize((self.size, self.size), Image.Resampling.BILINEAR, box=box)

    def crop_mask(self, mask: Image.Image, box: tuple[int, int, int, int]) -> Image.Image:
        """The mask's `box` resized to (size, size) with NEAREST. PIL samples NEAREST and BILINEAR at
        the same pixel centres of the box, so each mask pixel is the class under its image pixel."""
        left, top, w, h = box
        size, box = (self.size, self.size), (left, top, left + w, top + h)
        return mask.resize(size, Image.Resampling.NEAREST, box=box)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(size={self.size}, scale={self.scale}, draft={self.draft})"


def normalize(images: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """Images [B,C,H,W] (any memory layout) -> contiguous float32 (x - mean) / std per band, on the
    images' device; `mean`/`std` in model units, one per band. uint8 images are 8-bit pixels (model
    units: / 255, folded into the shift and scale); float32 images are in model units already."""
    if images.dtype != torch.uint8:
        shift = torch.tensor(mean, device=images.device).view(1, -1, 1, 1)
        scale = torch.tensor(std, device=images.device).view(1, -1, 1, 1)
        return (images.to(torch.float32, memory_format=torch.contiguous_format) - shift).div_(scale)
    shift = torch.tensor(mean, device=images.device).view(1, -1, 1, 1) * 255
    scale = 1 / (torch.tensor(std, device=images.device).view(1, -1, 1, 1) * 255)
    return (images.to(torch.float32, memory_format=torch.contiguous_format) - shift).mul_(scale)


def eval_resize(image_size: int, crop_pct: float) -> int:
    return math.floor(image_size / crop_pct)
