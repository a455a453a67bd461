"""`tiff:DIR` for `ssl-vit data convert`: TIFF images of any band count and dtype (`ssl_vit.data.arrays`),
stored losslessly as `.npy` members, band-last `(H, W, C)`.

- class folders: `DIR/CLASS/**/*.tif` (or `.tiff`), classes the sorted sub-folders, as `imagefolder:`;
  images directly in DIR are unlabelled;
- or a flat folder with `DIR/labels.csv`: a header row `filename,label`, then one row per image
  (`filename` relative to DIR; `label` a class name, or a class index when every label is an integer;
  empty: unlabelled). Class names are the sorted names, or "0".."K-1" for indices. TIFFs in DIR that
  the file does not name are left out, said in one line.

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
from dataclasses import dataclass
from pathlib import Path

from ssl_vit.data.arrays import BadArray, open_tiff
from ssl_vit.data.sources import register
from ssl_vit.errors import UserError

log = logging.getLogger(__name__)
TIFF_SUFFIXES = (".tif", ".tiff")
LABELS_CSV = "labels.csv"


@dataclass(frozen=True)
class ArrayFile:
    """A TIFF to store as an array, and the band count and dtype of its split (set by `first`)."""

    path: Path
    channels: int
    dtype: str
    first: Path

    @property
    def where(self) -> Path:
        """What a warning about it names (`encode.encode_record`)."""
        return self.path


class ArrayRecords(list):
    """A split's records, with what the manifest records about them (`dtype`, and `band_names` where
    the source knows them)."""

    def __init__(self, records, manifest: dict):
        super().__init__(records)
        self.manifest = manifest


@register(
    "tiff",
    argument="DIR",
    help="DIR/CLASS/*.tif, or DIR/*.tif with DIR/labels.csv of filename,label; any bands, uint8, uint16, "
    "int16 or float32",
    arrays=True,
)
def load(arg: str, split: str) -> tuple[list[str], ArrayRecords]:
    root = Path(arg)
    if not root.is_dir():
        raise UserError(f"tiff:{arg}: no such directory")
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
    return class_names, array_records(labelled)


def array_records(labelled: list[tuple[Path, int]], manifest: dict | None = None) -> ArrayRecords:
    """`(path, label)` pairs -> records whose band count and dtype are their first file's."""
    first = labelled[0][0]
    try:
        header = open_tiff(first.read_bytes())
    except (OSError, BadArray) as err:
        raise UserError(
            f"{first}: the first TIFF of the split, which sets its band count and dtype, cannot be read "
            f"({err}): fix or remove it"
        ) from None
    records = [(ArrayFile(path, header.bands, header.dtype, first), label) for path, label in labelled]
    return ArrayRecords(records, {"dtype": header.dtype, **(manifest or {})})


def _tiffs(folder: Path, recursive: bool) -> list[Path]:
    found = folder.rglob("*") if recursive else folder.iterdir()
    return sorted(p for p in found if p.suffix.lower() in TIFF_SUFFIXES and p.is_file())


def _from_csv(root: Path) -> tuple[list[str], list[tuple[Path, int]]]:
    path = root / LABELS_CSV
    fix = "give a header row 'filename,label' and one row per image (see data/README.md)"
    try:
        with open(path, newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise UserError(f"{path}: cannot be read ({err}): {fix}") from None
    if not rows or not {"filename", "label"} <= set(rows[0]):
        raise UserError(f"{path}: no rows with the columns filename and label: {fix}")
    labels = [(row["label"] or "").strip() for row in rows]
    given = [label for label in labels if label]
    if all(label.lstrip("-").isdigit() for label in given):
        indices = [int(label) if label else -1 for label in labels]
        if min(indices, default=0) < -1:
            raise UserError(f"{path}: label {min(indices)} is negative: {fix}")
        class_names = [str(c) for c in range(max(indices, default=-1) + 1)]
    else:
        class_names = sorted(set(given))
        indices = [class_names.index(label) if label else -1 for label in labels]
    labelled = []
    for number, (row, label) in enumerate(zip(rows, indices, strict=True), start=2):
        image = root / (row["filename"] or "").strip()
        if image.suffix.lower() not in TIFF_SUFFIXES or not image.is_file():
            raise UserError(f"{path}:{number}: {image} is not a TIFF file (*.tif, *.tiff) in {root}: {fix}")
        labelled.append((image, label))
    named = {image.resolve() for image, _ in labelled}
    left_out = [p for p in _tiffs(root, recursive=True) if p.resolve() not in named]
    if left_out:
        log.warning("%d TIFF files in %s are not named in %s and are left out, e.g. %s", len(left_out), root,
                    LABELS_CSV, left_out[0])  # fmt: skip
    return class_names, labelled
