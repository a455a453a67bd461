"""`tiff:DIR` for `ssl-vit data convert`: TIFF images of any band count and dtype
(`ssl_vit.data.format.arrays`), stored losslessly as `.npy` members, band-last `(H, W, C)`.

- class folders: `DIR/CLASS/**/*.tif` (or `.tiff`), classes the sorted sub-folders, as `imagefolder:`;
  images directly in DIR are unlabelled;
- or a flat folder with `DIR/labels.csv`: a header row `filename,label`, then one row per image
  (`filename` relative to DIR, inside it, each named once; `label` a class name, or a class index below
  1,000,000 when every label is an integer; empty or -1: unlabelled; a byte-order mark is allowed).
  Class names are the sorted names, or "0".."K-1" for indices. TIFFs in DIR that the file does not
  name are left out, said in one line.

Every image of a split has the band count and dtype of its first file (in the order above), read
from that file's header before anything is written; an image that differs is skipped and counted, a
warning naming it and both layouts (a conversion must not stop at image 90,000 of 100,000, and the
first file is named in every such warning, in case it is the odd one).

`.npy` rather than TIFF members: reading one in a training worker is a header parse and a copy
(no codec, no IFD walk in Python), any dtype and band count, exact, judged before its body is read.
"""

from __future__ import annotations

import csv
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ssl_vit.data.convert.payload import Encoded, EncodeOptions
from ssl_vit.data.convert.source import Flag, SourceKind, register, source_dir
from ssl_vit.data.format.arrays import BadArray, npy_bytes, open_tiff
from ssl_vit.data.format.band_stats import BandStats
from ssl_vit.data.format.members import MAX_CLASSES, MAX_IMAGE_PIXELS
from ssl_vit.errors import UserError, shown

log = logging.getLogger(__name__)
TIFF_SUFFIXES = (".tif", ".tiff")
LABELS_CSV = "labels.csv"
CSV_FIX = "give a header row 'filename,label' and one row per image (see data/README.md)"
INTEGER = re.compile(r"[+-]?[0-9]+")  # "+1" and "007" are 1 and 7


@dataclass(frozen=True)
class ArrayFile:
    """A TIFF to store as an array, and the band count and dtype of its split (set by `first`)."""

    path: Path
    channels: int
    dtype: str
    first: Path
    band_axis: str | None = None  # where the bands are when the TIFF's axes do not say (--band-axis)

    @property
    def where(self) -> str:
        return str(self.path)

    def encode(self, options: EncodeOptions, mask: None) -> Encoded:
        """Stored as a `.npy` member, its header judged before its pixels are decoded."""
        member = open_tiff(self.path.read_bytes(), self.channels, self.band_axis)
        if member.width * member.height > MAX_IMAGE_PIXELS or member.nbytes > 4 * MAX_IMAGE_PIXELS:
            raise ValueError(
                f"{member.shape_text()}: larger than {MAX_IMAGE_PIXELS:,} pixels or 4 bytes each"
            )
        if (member.bands, member.dtype) != (self.channels, self.dtype):
            raise ValueError(
                f"{member.bands} bands of {member.dtype}, the split's are {self.channels} of {self.dtype} "
                f"(set by its first file, {self.first})"
            )
        array = member.read()
        return Encoded(npy_bytes(array), (member.height, member.width), BandStats.of(array))


class ArrayRecords(list):
    """A split's records, with what the manifest records about them (`dtype`, and `band_names` where
    the source knows them)."""

    def __init__(self, records, manifest: dict):
        super().__init__(records)
        self.manifest = manifest


def load(arg: str, split: str, band_axis: str | None = None) -> tuple[list[str], ArrayRecords]:
    root = source_dir("tiff", arg)
    if band_axis not in (None, "first", "last"):
        raise UserError(f"--band-axis must be first or last, got {shown(band_axis)}")
    if (root / LABELS_CSV).is_file():
        class_names, labelled = _from_csv(root)
    else:
        classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
        labelled = [(p, -1) for p in _tiffs(root, recursive=False)]
        for label, name in enumerate(classes):
            labelled += [(p, label) for p in _tiffs(root / name, recursive=True)]
        class_names = classes
    if not labelled:
        raise UserError(f"tiff:{arg}: no TIFF files (*.tif, *.tiff) in class folders or in {LABELS_CSV}")
    return class_names, array_records(labelled, band_axis=band_axis)


def array_records(
    labelled: list[tuple[Path, int]], manifest: dict | None = None, band_axis: str | None = None
) -> ArrayRecords:
    """`(path, label)` pairs -> records whose band count and dtype are their first file's."""
    first = labelled[0][0]
    try:
        header = open_tiff(first.read_bytes(), told=band_axis)
    except (OSError, BadArray) as err:
        raise UserError(
            f"{first}: the first TIFF of the split, which sets its band count and dtype, cannot be read "
            f"({err}): fix or remove it"
        ) from None
    records = [
        (ArrayFile(path, header.bands, header.dtype, first, band_axis), label) for path, label in labelled
    ]
    return ArrayRecords(records, {"dtype": header.dtype, **(manifest or {})})


def _tiffs(folder: Path, recursive: bool) -> list[Path]:
    found = folder.rglob("*") if recursive else folder.iterdir()
    return sorted(p for p in found if p.suffix.lower() in TIFF_SUFFIXES and p.is_file())


def _from_csv(root: Path) -> tuple[list[str], list[tuple[Path, int]]]:
    path = root / LABELS_CSV
    try:  # utf-8-sig: the byte-order mark that Excel's "CSV UTF-8" writes is not part of the header
        with open(path, newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f)
            rows = list(reader)
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise UserError(f"{path}: cannot be read ({err}): {CSV_FIX}") from None
    for column in ("filename", "label"):  # DictReader would keep the last of two silently
        if (reader.fieldnames or []).count(column) > 1:
            raise UserError(f"{path}: the header names the column {column!r} twice: keep one; {CSV_FIX}")
    if not rows or not {"filename", "label"} <= set(rows[0]):
        raise UserError(f"{path}: no rows with the columns filename and label: {CSV_FIX}")
    class_names, indices = _csv_labels([(row["label"] or "").strip() for row in rows], path)
    labelled, rows_of = [], {}
    for number, (row, label) in enumerate(zip(rows, indices, strict=True), start=2):
        image = _csv_image(root, (row["filename"] or "").strip(), f"{path}:{number}")
        if image in rows_of:
            raise UserError(
                f"{path}:{number}: {row['filename'].strip()!r} names {image.name!r} again (first on line "
                f"{rows_of[image]}): {CSV_FIX}"
            )
        rows_of[image] = number
        labelled.append((image, label))
    named = {image.resolve() for image, _ in labelled}
    left_out = [p for p in _tiffs(root, recursive=True) if p.resolve() not in named]
    if left_out:
        log.warning("%d TIFF files in %s are not named in %s and are left out, e.g. %s", len(left_out), root,
                    LABELS_CSV, left_out[0])  # fmt: skip
    return class_names, labelled


def _csv_labels(labels: list[str], path: Path) -> tuple[list[str], list[int]]:
    """(class names, an index per row, -1 for an empty label or -1, unlabelled in either mode): indices
    when every other label is a decimal integer (ASCII digits, a sign allowed: "+1" and "007" are 1 and 7;
    `str.isdigit` also takes "²", which `int` refuses), else names."""
    given = [label for label in labels if label and label != "-1"]
    if not all(INTEGER.fullmatch(label) for label in given):
        class_names = sorted(set(given))
        index = {name: i for i, name in enumerate(class_names)}
        return class_names, [index[label] if label in index else -1 for label in labels]
    for label in given:  # judged by their digits first: `int` refuses more than 4,300 of them
        digits = label.lstrip("+").lstrip("0") or "0"
        if label.startswith("-") or len(digits) > len(str(MAX_CLASSES)) or int(digits) >= MAX_CLASSES:
            raise UserError(
                f"{path}: label {shown(label)} is not a class index in 0..{MAX_CLASSES - 1:,}: {CSV_FIX}"
            )
    indices = [int(label.lstrip("+").lstrip("0") or "0") if label in given else -1 for label in labels]
    return [str(c) for c in range(max(indices, default=-1) + 1)], indices


def _csv_image(root: Path, name: str, where: str) -> Path:
    """The TIFF a row names, a path inside `root` (judged by its text, so that a TIFF inside that is a
    link to a file elsewhere is still read, and `../x.tif` or `/x.tif` are not)."""
    relative = Path(os.path.normpath(name)) if name else Path()
    image = root / relative
    if relative.is_absolute() or relative.parts[:1] == ("..",):
        raise UserError(f"{where}: {name!r} is outside {root}: name files relative to it, inside it")
    if image.suffix.lower() not in TIFF_SUFFIXES or not image.is_file():
        raise UserError(f"{where}: {name!r} is not a TIFF file (*.tif, *.tiff) in {root}: {CSV_FIX}")
    return image


register(
    SourceKind(
        "tiff",
        load,
        "DIR",
        help="DIR/CLASS/*.tif, or DIR/*.tif with DIR/labels.csv of filename,label; any bands, uint8, uint16, "
        "int16 or float32",
        arrays=True,
        flags=(
            Flag(
                "band_axis",
                "which axis holds the bands of TIFFs whose axes do not say (a cube, or a rectangle whose "
                "band axis cannot be told from its shape): first or last",
                metavar="first|last",
            ),
        ),
    )
)
