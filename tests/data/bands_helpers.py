"""Helpers for the tests of images of any band count and bit depth: TIFF folders, hand-made shards of
array members, and 16-bit PNG bytes."""

import io
import json
import struct
import zlib
from pathlib import Path

import numpy as np
import tifffile
import webdataset as wds

from ssl_vit.data.convert.eurosat import CLASSES as EUROSAT_CLASSES


def write_tiff(path: Path, array: np.ndarray, band_first: bool = False) -> None:
    """An (H, W, C) array as a TIFF with its bands as samples: band-last (`YXS`, contiguous) or band-first
    (`SYX`, planar), as tifffile's series axes then say."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if band_first:
        tifffile.imwrite(path, np.moveaxis(array, 2, 0), photometric="minisblack", planarconfig="separate")
    else:
        tifffile.imwrite(path, array, photometric="minisblack", planarconfig="contig")


def npy(array: np.ndarray, fortran: bool = False) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.asfortranarray(array) if fortran else array)
    return buf.getvalue()


def png16(array: np.ndarray) -> bytes:
    """A 16-bit PNG of a uint16 (H, W) or (H, W, C) array, C in 1-4 (grey, grey+alpha, RGB, RGBA):
    written by hand because PIL writes 16 bits only for grey images."""
    height, width = array.shape[:2]
    bands = 1 if array.ndim == 2 else array.shape[2]
    colour = {1: 0, 2: 4, 3: 2, 4: 6}[bands]
    rows = b"".join(b"\x00" + array[y].astype(">u2").tobytes() for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 16, colour, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )


def write_array_shard(path: Path, samples: list[dict]) -> list[str]:
    """A shard of `samples` (`{"__key__", "npy" | "tif" | "png", "cls", "seg.png"}`); returns the keys."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with wds.TarWriter(str(path)) as sink:
        for sample in samples:
            sink.write(sample)
    return [s["__key__"] for s in samples]


def write_manifest(root: Path, split: str, counts: list[int], **fields) -> None:
    """A manifest beside hand-made shards `{split}-NNNNNN.tar` of `counts` samples."""
    manifest = {
        "version": 1, "num_samples": sum(counts), "num_classes": 2, "class_names": ["0", "1"],
        "shards": [{"url": f"{split}-{i:06d}.tar", "num_samples": n} for i, n in enumerate(counts)], **fields,
    }  # fmt: skip
    (root / f"{split}.json").write_text(json.dumps(manifest))


def fake_eurosat(root, per_class: int = 5) -> None:
    """EuroSAT_MS's layout: 10 class folders of 64 x 64 x 13 uint16 tifs, `Class_N.tif`; band k of
    every file is 1000 * k + the class index, so band order and labels show in the shards."""
    for label, name in enumerate(EUROSAT_CLASSES):
        for n in range(1, per_class + 1):
            array = np.broadcast_to(1000 * np.arange(13, dtype=np.uint16) + label, (64, 64, 13)).copy()
            array[0, 0, 0] = n
            write_tiff(root / "EuroSAT_MS" / name / f"{name}_{n}.tif", array)
