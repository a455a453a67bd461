"""Image members PIL cannot read exactly, as numpy arrays `(H, W, C)` of any band count C in one of
`ARRAY_DTYPES`: `.npy` (numpy's format), `.tif`/`.tiff` (tifffile; a GeoTIFF is read as a plain array,
its georeferencing ignored) and 16-bit grey PNGs (`open_png16`, which says why 16-bit colour PNGs are
refused).

Every reader parses the header first (`open_array`): height, width, bands and dtype are known, and
judged by the caller (pixels against `max_image_pixels`, bands against the data module's `channels`,
dtype against the manifest's), before `ArrayMember.read` decodes a single pixel. Whatever the bytes
make the parsers raise becomes `BadArray`, whose message says what is wrong.

Where the band axis is (`band_axis`): tifffile's series axes when they name it (`S` samples or `C`
channels: `YXS` band-last, `SYX`/`CYX` band-first); otherwise (a `.npy`, or axes such as `QYX`/`IYX`,
which tifffile also gives a band-last array written as pages of rows) the axis whose length is the
expected band count when only one is; else the one beside a square image (`(8, 8, 13)`: band-last;
`(200, 16, 16)`: band-first); else the shorter of the first and the last (the last on a tie). A TIFF
decided by that last rule, a cube (`(32, 32, 32)`) or a rectangle whose axes do not say, is refused
unless told (`band_axis="first"|"last"`, `data convert tiff:DIR --band-axis`): a guess there reads
the wrong axis without a word. A `.npy` takes the guess (ssl-vit writes them band-last). A 2-D array
is one band.
"""

from __future__ import annotations

import contextlib
import io
import logging
import logging.handlers
import math
import re
from dataclasses import dataclass

import numpy as np

from ssl_vit.errors import first_line

ARRAY_DTYPES = ("uint8", "uint16", "int16", "float32")
ARRAY_MEMBERS = ("npy", "tif", "tiff")  # members that are always arrays (a PNG is one when 16-bit)
# More bands than any hyperspectral sensor records (AVIRIS 224, EnMAP 242): an array claiming more is
# refused from its header, before its pixels take memory.
MAX_BANDS = 1024
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class BadArray(ValueError):
    """An array member that cannot be used; the message says why."""


@dataclass
class ArrayMember:
    """An array member whose header is parsed: `height`, `width`, `bands`, `dtype` (a name in
    ARRAY_DTYPES), and `read()` -> `(height, width, bands)` native-endian array."""

    height: int
    width: int
    bands: int
    dtype: str
    _read: object  # () -> the array in its stored layout, shaped as the header says

    @property
    def size(self) -> tuple[int, int]:
        """(width, height), as PIL gives an image's size."""
        return self.width, self.height

    def read(self) -> np.ndarray:
        try:
            array = self._read()
        except Exception as err:
            raise BadArray(f"does not decode ({first_line(err)})") from None
        if array.shape != (self.height, self.width, self.bands):
            raise BadArray(f"decodes to shape {array.shape}, its header says {self.shape_text()}")
        if array.dtype.kind == "f" and not np.isfinite(array).all():
            raise BadArray("holds NaN or infinite values")
        return array.astype(array.dtype.newbyteorder("="), copy=False)

    @property
    def nbytes(self) -> int:
        return self.height * self.width * self.bands * np.dtype(self.dtype).itemsize

    def shape_text(self) -> str:
        return f"{self.width}x{self.height} with {self.bands} band{'s' * (self.bands != 1)} of {self.dtype}"


def band_axis(shape: tuple[int, int, int], channels: int | None = None) -> tuple[int, bool]:
    """`(0 or 2, guessed)`: the band axis of a 3-D array whose axes are not named, and whether only the
    last rule of the module docstring decided it."""
    if channels is not None and (shape[0] == channels) != (shape[2] == channels):
        return (2 if shape[2] == channels else 0), False
    if shape[0] == shape[1] != shape[2]:
        return 2, False
    if shape[1] == shape[2] != shape[0]:
        return 0, False
    return (0 if shape[0] < shape[2] else 2), True


def dtype_name(dtype: np.dtype) -> str:
    """The name of a plain numeric dtype in native byte order; BadArray for anything not in
    ARRAY_DTYPES (object, structured, sub-array, other widths)."""
    if dtype.hasobject or dtype.fields is not None or dtype.shape:
        raise BadArray(f"dtype {dtype.str} is not a plain number: use one of {', '.join(ARRAY_DTYPES)}")
    name = dtype.newbyteorder("=").name
    if name not in ARRAY_DTYPES:
        raise BadArray(f"dtype {name}: use one of {', '.join(ARRAY_DTYPES)}")
    return name


def open_array(ext: str, data: bytes, channels: int | None = None) -> ArrayMember:
    """The header of an `npy`, `tif` or `tiff` member (`channels`: the band count expected, for
    `band_axis`)."""
    return open_npy(data, channels) if ext == "npy" else open_tiff(data, channels)


def _member(shape: tuple[int, ...], dtype: np.dtype, axis: int | None, read) -> ArrayMember:
    """An ArrayMember of an array of `shape` whose bands lie along `axis` (None: 2-D, one band)."""
    name = dtype_name(dtype)
    if axis is None:
        height, width, bands = shape[0], shape[1], 1
    else:
        bands = shape[axis]
        height, width = (shape[1], shape[2]) if axis == 0 else (shape[0], shape[1])
    if min(height, width, bands) <= 0:
        raise BadArray(f"shape {shape} is empty")
    if bands > MAX_BANDS:
        raise BadArray(f"{bands} bands, more than {MAX_BANDS}")

    def layout() -> np.ndarray:
        array = read()
        if axis is None:
            return array[:, :, None]
        return np.moveaxis(array, 0, 2) if axis == 0 else array

    return ArrayMember(height, width, bands, name, layout)


def open_npy(data: bytes, channels: int | None = None) -> ArrayMember:
    """A `.npy` member: magic, version and header parsed by numpy's own `read_magic` and
    `read_array_header_*` (header length bounded by numpy), dtype, shape and the body's length
    checked against them before the body is read. Fortran order is read as such."""
    stream = io.BytesIO(data)
    try:
        version = np.lib.format.read_magic(stream)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(stream)
        else:  # 3.0 only adds utf-8 field names, which a plain numeric array has none of
            raise BadArray(f"format version {version[0]}.{version[1]}: write it with numpy.save")
    except BadArray:
        raise
    except Exception as err:
        raise BadArray(f"header does not parse ({first_line(err)})") from None
    if len(shape) not in (2, 3) or any(not isinstance(d, int) or d < 0 for d in shape):
        raise BadArray(f"shape {shape}: an image is (H, W), (H, W, C) or (C, H, W)")
    axis = None if len(shape) == 2 else band_axis(shape, channels)[0]
    offset, count = stream.tell(), math.prod(shape)
    member = _member(
        shape,
        dtype,
        axis,
        lambda: np.frombuffer(data, dtype, count=count, offset=offset).reshape(
            shape, order="F" if fortran else "C"
        ),
    )
    if len(data) - offset != count * dtype.itemsize:
        raise BadArray(
            f"body holds {len(data) - offset:,} bytes, its header ({member.shape_text()}) says "
            f"{count * dtype.itemsize:,}"
        )
    return member


def open_tiff(data: bytes, channels: int | None = None, told: str | None = None) -> ArrayMember:
    """A `.tif`/`.tiff` member: its first series (tifffile), shape, axes and dtype from the tags;
    `told`: where the bands are when the axes do not say (`first`, `last`)."""
    import tifffile  # imported here: `ssl-vit --help` imports this module's importers

    try:
        with _tifffile_complaints():
            tif = tifffile.TiffFile(io.BytesIO(data))
            series = tif.series[0]
            shape, axes, dtype = tuple(series.shape), series.axes, np.dtype(series.dtype)
    except BadArray:
        raise
    except Exception as err:
        raise BadArray(f"does not parse as TIFF ({first_line(err)})") from None
    if len(shape) not in (2, 3):
        raise BadArray(f"TIFF series of shape {shape} (axes {axes}): an image is 2-D or 3-D")
    if len(shape) == 2:
        axis = None
    elif axes[-1] in "SC":
        axis = 2
    elif axes[0] in "SC":
        axis = 0
    elif told is not None:
        axis = 0 if told == "first" else 2
    else:
        axis, guessed = band_axis(shape, channels)
        if guessed:
            raise BadArray(
                f"TIFF of shape {shape} (axes {axes}) does not say which axis holds its bands: convert it "
                "with `ssl-vit data convert tiff:DIR --band-axis first` (or `last`)"
            )
    return _member(shape, dtype, axis, _tifffile_complaints()(series.asarray))


@contextlib.contextmanager
def _tifffile_complaints():
    """tifffile logs what it works around in a damaged file (an IFD chain that loops back, a tag of the
    wrong size) and goes on: its records are kept from the terminal while the block (or the function it
    decorates) parses or reads a TIFF, and the first one becomes the file's BadArray, one line, so that
    the file is skipped and counted as any bad sample is."""
    logger, kept = logging.getLogger("tifffile"), logging.handlers.BufferingHandler(capacity=1_000_000)
    kept.setLevel(logging.WARNING)
    logger.addHandler(kept)
    propagate, logger.propagate = logger.propagate, False
    try:
        yield
    finally:
        logger.removeHandler(kept)
        logger.propagate = propagate
    if kept.buffer:
        said = " ".join(kept.buffer[0].getMessage().split())
        raise BadArray(f"is a damaged TIFF (tifffile: {_OBJECT.sub('', said)})")


_OBJECT = re.compile(r"^<[^>]*> ")  # tifffile's messages start with the repr of the object they are of


def png_bit_depth(data: bytes) -> int | None:
    """The bit depth in a PNG's IHDR chunk (PNG spec 11.2.2: it is the first chunk, its fields at fixed
    offsets), or None for bytes that are not a PNG."""
    if data[:8] != PNG_SIGNATURE or data[12:16] != b"IHDR" or len(data) < 26:
        return None
    return data[24]


def open_png16(data: bytes) -> ArrayMember:
    """A 16-bit PNG, its size and colour type from its IHDR. Grey is read exactly by PIL (mode I;16).
    Colour ones (48-bit RGB, 64-bit RGBA, 32-bit grey + alpha) are refused: PIL keeps only the high
    byte of each of their samples, and torchvision's `decode_png`, which keeps 16 bits, crashed the
    process (a segmentation fault) on a truncated one here (torchvision 0.29), which a worker reading
    untrusted shards must never do. Store such images as `.tif` or `.npy`."""
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    colour = data[25]
    if colour != 0:
        kind = {2: "48-bit RGB", 4: "32-bit grey + alpha", 6: "64-bit RGBA"}.get(
            colour, f"colour type {colour}"
        )
        raise BadArray(
            f"is a {kind} PNG, which is not read (PIL keeps 8 of its 16 bits per sample): store it as "
            ".tif or .npy"
        )

    def read() -> np.ndarray:
        from PIL import Image

        with Image.open(io.BytesIO(data)) as image:
            return np.array(image)[:, :, None]

    return ArrayMember(height, width, 1, "uint16", read)


def npy_bytes(array: np.ndarray) -> bytes:
    """An array as `.npy` member bytes (numpy.save, version 1.0 for any shape this reads)."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(array), allow_pickle=False)
    return buf.getvalue()
