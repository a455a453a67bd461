"""JPEG decoding on the device (`ShardDataModule(decode="device")`): the workers only read the tars,
parse each JPEG's header for its size and draw the random-resized-crop box and the flip; the device
decodes the whole batch in one batched `torchvision.io.decode_jpeg` call, then crops, resizes
(bilinear, antialiased), flips and normalises there.

The draws are the CPU path's (`transforms.RandomResizedCrop.box`, then `HorizontalFlip`'s one
`random.random()`), in the same order from the same per-sample seeds, so a sample gets the same box
and flip whichever side decodes it: exact resume, seeds and the crop distribution do not depend on
`decode`. The CPU path may decode at a JPEG draft scale; the device path always decodes the full
image, so the two agree to within JPEG decoders' and resamplers' differences, not bit for bit.

A sample's segmentation mask (`seg.png`) never goes to the device: the worker crops it with the same
box and flips it with the same draw (NEAREST, `RandomResizedCrop.crop_mask`), and it joins the batch
as `mask` uint8 [B, size, size] like on the CPU path; it is a few bytes per pixel and has no JPEG to
decode.

Per sample, the worker keeps the CPU path for what the device decoder does not take: other formats
(PNG, WebP, and every image read as an array: npy, TIFF, 16-bit PNG, any image when the data module's
`channels` is not 3) and JPEGs in CMYK/YCCK (nvJPEG has no CMYK output). A JPEG the device decoder
refuses anyway (a corrupt body passes a header check) is decoded on the host from the same bytes with
the same box, and one no decoder reads is dropped from its batch and counted as skipped. Every sample
decoded on the host is counted in `decoded_on_cpu` (`data/decoded_on_cpu_train` in W&B).

Written here because no library does it: torchvision decodes on the device but its random crops work
on decoded images, and DALI (which does crop-aware decoding) is a second data pipeline with its own
readers, seeds and resume, not a step inside this one.

On CUDA, two known hazards of torchvision's nvJPEG decoder are avoided: its hardware engine writes its
outputs without waiting for work queued on the stream it is given, so memory that the caching
allocator handed over after a free could still be read by queued kernels (pytorch/vision#9606). The
decode therefore runs on a dedicated stream (its allocations come from that stream's pool, never from
blocks the training stream still uses), drained before each decode, and the training stream waits on
it for the result. The decoder host-synchronises its stream, so the training thread waits for each
batch's decode (milliseconds with the hardware engine); `ssl-vit bench feed --decode device` measures
the rate this gives.
"""

from __future__ import annotations

import contextlib
import io
import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from PIL import Image
from torchvision.io import ImageReadMode, decode_jpeg

from ssl_vit.data.transforms.rgb import (
    HorizontalFlip,
    RandomResizedCrop,
    decode,
    flip,
    mask_tensor,
    to_uint8_tensor,
)

# JPEG colour modes the device decoder turns into RGB (grayscale is expanded as the CPU path does)
DEVICE_MODES = ("RGB", "L")


@dataclass
class JpegCrop:
    """A JPEG left for the device: its bytes (set by `samples.transform_image`), the crop box (left, top,
    width, height) in its full-size pixels and whether to flip the crop."""

    box: tuple[int, int, int, int]
    flip: bool
    data: bytes | None = None


class DeferredCrop:
    """Opened (undecoded) image -> `JpegCrop` for a JPEG the device can decode, else the CPU path's
    uint8 crop (`RandomResizedCrop` + `HorizontalFlip` + `to_uint8_tensor`, same draws)."""

    def __init__(self, crop: RandomResizedCrop, flip: HorizontalFlip):
        self.crop, self.flip = crop, flip

    def __call__(self, img: Image.Image) -> JpegCrop | torch.Tensor:
        if not on_device(img):
            return to_uint8_tensor(self.flip(self.crop(img)))
        box = self.crop.box(*img.size)  # the size comes from the header: nothing is decoded
        return JpegCrop(box, random.random() < self.flip.p)

    def pair(self, img: Image.Image, mask: Image.Image) -> tuple[JpegCrop | torch.Tensor, torch.Tensor]:
        """`self(img)` and the mask (mode L) cropped, resized and flipped with the same draws, in the
        worker: uint8 [size, size]."""
        if not on_device(img):
            img, mask = self.flip.pair(*self.crop.pair(img, mask))
            return to_uint8_tensor(img), mask_tensor(mask)
        box = self.crop.box(*img.size)
        flipped = random.random() < self.flip.p
        mask = self.crop.crop_mask(mask, box)
        return JpegCrop(box, flipped), mask_tensor(flip(mask) if flipped else mask)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.crop!r}, {self.flip!r})"


def on_device(img: Image.Image) -> bool:
    """Whether the device decodes this opened image (a JPEG in a mode it turns into RGB)."""
    return img.format == "JPEG" and img.mode in DEVICE_MODES


def device_transform(size: int, crop_scale: tuple[float, float], draft: bool) -> DeferredCrop:
    """The `pretrain`/`supervised` presets' crop and flip (without RandAugment) for `decode="device"`."""
    return DeferredCrop(RandomResizedCrop(size, scale=crop_scale, draft=draft), HorizontalFlip())


def collate_jpegs(images: list) -> tuple[list, dict]:
    """Split a batch's transform outputs: the uint8 crops decoded in the worker, and the JPEGs left for
    the device as batch entries (`jpeg` bytes, `box` [n,4], `flip` [n], `jpeg_index` and `cpu_index`:
    the positions of each kind in the batch)."""
    jpegs = [(i, x) for i, x in enumerate(images) if isinstance(x, JpegCrop)]
    if not jpegs:
        return images, {}
    decoded = [(i, x) for i, x in enumerate(images) if not isinstance(x, JpegCrop)]
    return [x for _, x in decoded], {
        "jpeg": [x.data for _, x in jpegs],
        "box": torch.tensor([x.box for _, x in jpegs], dtype=torch.int64).reshape(-1, 4),
        "flip": torch.tensor([x.flip for _, x in jpegs], dtype=torch.bool),
        "jpeg_index": torch.tensor([i for i, _ in jpegs], dtype=torch.int64),
        "cpu_index": torch.tensor([i for i, _ in decoded], dtype=torch.int64),
    }


def place_jpegs(batch: dict, size: int) -> dict:
    """A batch from `collate_jpegs`, on its device -> the batch with every image as a uint8 [B,3,size,size]
    crop in `image` (the worker's and the device's, in batch order), `decoded_on_cpu` counting the
    samples decoded on the host, and the samples no decoder reads dropped (counted in `skipped`)."""
    if "jpeg" not in batch:
        return batch
    batch = dict(batch)
    jpegs, boxes, flips = batch.pop("jpeg"), batch.pop("box"), batch.pop("flip")
    jpeg_index, cpu_index = batch.pop("jpeg_index"), batch.pop("cpu_index")
    device = batch["image"].device
    crops, on_host = decode_crops(jpegs, boxes.tolist(), flips.tolist(), size, device)
    n = len(jpeg_index) + len(cpu_index)
    # the workers' images are float32 in model units where one of them is 16-bit or float (`collate`)
    dtype = batch["image"].dtype if len(cpu_index) else torch.uint8
    image = torch.empty(n, 3, size, size, dtype=dtype, device=device)
    if len(cpu_index):
        image[cpu_index.to(device)] = batch["image"]
    read = [j for j, crop in enumerate(crops) if crop is not None]
    if read:  # one stack and one conversion for the batch, written in place at once
        pixels = torch.stack([crops[j] for j in read]).round_().clamp_(0, 255).to(torch.uint8)
        image[jpeg_index[read].to(device)] = pixels if dtype == torch.uint8 else pixels.float().div_(255)
    keep = torch.ones(n, dtype=torch.bool)
    keep[jpeg_index[[j for j, crop in enumerate(crops) if crop is None]]] = False
    batch["image"] = image
    batch["decoded_on_cpu"] = torch.tensor(len(cpu_index) + on_host)
    if not keep.all():
        batch = _keep(batch, keep)
    return batch


def _keep(batch: dict, keep: torch.Tensor) -> dict:
    """The batch without the samples `keep` marks False (their masks too), counted in `skipped`."""
    out = dict(batch)
    out["image"], out["label"] = (
        batch["image"][keep.to(batch["image"].device)],
        batch["label"][keep.to(batch["label"].device)],
    )
    if "mask" in batch:
        out["mask"] = batch["mask"][keep.to(batch["mask"].device)]
    out["key"] = [k for k, kept in zip(batch["key"], keep.tolist(), strict=True) if kept]
    out["skipped"] = batch.get("skipped", torch.tensor(0)) + int((~keep).sum())
    return out


def decode_crops(
    jpegs: list[bytes], boxes: list, flips: list, size: int, device: torch.device
) -> tuple[list[torch.Tensor | None], int]:
    """JPEG bytes -> float [3,size,size] crops (0-255) on `device` (None for one no decoder reads), and
    how many were decoded on the host because the device decoder refused them."""
    # bytearray: torch.frombuffer wants a writable buffer (bytes would warn); a copy of compressed bytes
    data = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in jpegs]
    images = _decode(data, device)
    on_host = 0
    for i, image in enumerate(images):
        if image is None:  # refused by the device decoder: the host's, from the same bytes
            on_host += 1
            images[i] = _decode_on_host(data[i], jpegs[i], device)
    stream = _stream(device)
    with _on(stream):
        crops = [
            None if im is None else _crop(im, box, flip, size)
            for im, box, flip in zip(images, boxes, flips, strict=True)
        ]
    if stream is not None:
        torch.cuda.current_stream(device).wait_stream(stream)
        for crop in crops:
            if crop is not None:
                crop.record_stream(torch.cuda.current_stream(device))
    return crops, on_host


def _decode(data: list[torch.Tensor], device: torch.device) -> list[torch.Tensor | None]:
    """One batched decode; when it fails (one bad image fails the whole call), each image on its own."""
    stream = _stream(device)
    if stream is not None:
        stream.synchronize()  # nothing of ours still queued where the decoder may write (see above)
    with _on(stream):
        try:
            return list(decode_jpeg(data, mode=ImageReadMode.RGB, device=device))
        except RuntimeError:
            out = []
            for d in data:
                try:
                    out.append(decode_jpeg(d, mode=ImageReadMode.RGB, device=device))
                except RuntimeError:
                    out.append(None)
            return out


def _decode_on_host(data: torch.Tensor, raw: bytes, device: torch.device) -> torch.Tensor | None:
    try:
        return decode_jpeg(data, mode=ImageReadMode.RGB).to(device)
    except RuntimeError:
        pass
    try:  # PIL reads some JPEGs libjpeg's strict mode in torchvision does not
        return to_uint8_tensor(decode(Image.open(io.BytesIO(raw)))).contiguous().to(device)
    except Exception:
        return None


def _crop(image: torch.Tensor, box: list[int], flip: bool, size: int) -> torch.Tensor:
    """uint8 [3,H,W] -> the box resized to float [3,size,size] in 0-255 (bilinear, antialiased as PIL's
    resize is), flipped when asked; `place_jpegs` rounds the whole batch to uint8 at once."""
    left, top, w, h = box
    crop = image[:, top : top + h, left : left + w].unsqueeze(0).float()
    out = F.interpolate(crop, size=(size, size), mode="bilinear", antialias=True, align_corners=False)[0]
    return out.flip(-1) if flip else out


_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _stream(device: torch.device):
    """The dedicated decode stream of a CUDA device (None elsewhere)."""
    if device.type != "cuda":
        return None
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]


def _on(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
