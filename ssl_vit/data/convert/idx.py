"""`idx:IMAGES[,LABELS]`: MNIST-family IDX files, gzipped or not."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np

from ssl_vit.data.convert.source import SourceKind, labelled_records, register
from ssl_vit.errors import UserError


def _read_idx(path: Path) -> np.ndarray:
    """IDX (MNIST-family) file, gzipped or not: magic 0x0000 TT NN, NN big-endian uint32 sizes, data.
    Only unsigned-byte data (type 0x08) is image data; that is what every MNIST-family set uses."""
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as err:
            raise UserError(f"{path}: corrupt gzip ({err})") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08 or raw[3] == 0:
        raise UserError(f"{path}: not an IDX file of unsigned bytes (bad magic {raw[:4].hex()})")
    ndim = raw[3]
    shape = tuple(int(d) for d in np.frombuffer(raw[4 : 4 + 4 * ndim], dtype=">u4"))
    body = raw[4 + 4 * ndim :]
    if len(shape) != ndim or len(body) != int(np.prod(shape)):
        raise UserError(f"{path}: IDX header says {shape} but holds {len(body)} bytes")
    return np.frombuffer(body, dtype=np.uint8).reshape(shape)


def load(arg: str, split: str) -> tuple[list[str], list]:
    """MNIST-family IDX images, and labels when a second file is given (unlabelled otherwise)."""
    image_path, _, label_path = arg.partition(",")
    images = _read_idx(Path(image_path))
    if images.ndim not in (3, 4):
        raise UserError(
            f"{image_path}: expected IDX images (N, H, W) or (N, H, W, C), got shape {images.shape}"
        )
    labels = _read_idx(Path(label_path)) if label_path else None
    if labels is not None and labels.shape != (len(images),):
        raise UserError(f"{label_path}: expected {len(images)} labels, got shape {labels.shape}")
    return labelled_records(images, labels)


register(SourceKind("idx", load, "IMAGES[,LABELS]"))
