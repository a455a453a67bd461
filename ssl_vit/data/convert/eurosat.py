"""`eurosat:DIR` for `ssl-vit data convert`: EuroSAT's multispectral release (Helber et al., 2019):
27,000 Sentinel-2 patches of 64 x 64 pixels, 13 bands of uint16, in 10 class folders
(`AnnualCrop/AnnualCrop_1.tif`, ...). DIR is the folder holding the class folders, or one above it as
the archives extract: `EuroSAT_MS/` or `ds/images/remote_sensing/otherDatasets/sentinel_2/tif/`
(EuroSATallBands.zip).

Splits (`--split train|val|test`): the lists `eurosat-{split}.txt` of "In-domain representation
learning for remote sensing" (Neumann et al., 2019; what torchgeo uses) when they are in DIR (one file
name per line; the lists name the RGB release's `.jpg` files, matched here by name without the
extension); otherwise each class's files, sorted by name, permuted with a seed of (0, class index),
the first 60% `train`, the next 20% `val`, the rest `test` (the lists' proportions: 16,200 / 5,400 /
5,400).

The model for other remote-sensing sets: find the files, choose a split, and hand `(path, label)` pairs
to `tiff.array_records` with the band names.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ssl_vit.data.convert.source import SourceKind, check_split, register
from ssl_vit.data.convert.tiff import TIFF_SUFFIXES, ArrayRecords, array_records
from ssl_vit.errors import UserError

# The order of the bands in the files: B8A is the 13th (phelber/EuroSAT#7; torchgeo corrected its own
# order, which had B8A after B08, in torchgeo/torchgeo#2480 for torchgeo#2458).
BAND_NAMES = ("B01", "B02", "B03", "B04", "B05", "B06", "B07", "B08", "B09", "B10", "B11", "B12", "B8A")
CLASSES = (
    "AnnualCrop", "Forest", "HerbaceousVegetation", "Highway", "Industrial", "Pasture", "PermanentCrop",
    "Residential", "River", "SeaLake",
)  # fmt: skip
NESTED = ("EuroSAT_MS", "ds/images/remote_sensing/otherDatasets/sentinel_2/tif")
SPLITS = {"train": (0.0, 0.6), "val": (0.6, 0.8), "test": (0.8, 1.0)}  # fractions of each class
SPLIT_SEED = 0


def load(arg: str, split: str) -> tuple[list[str], ArrayRecords]:
    check_split("eurosat", split, tuple(SPLITS))
    top = Path(arg)
    root = next((top / n for n in ("", *NESTED) if all((top / n / c).is_dir() for c in CLASSES)), None)
    if root is None:
        raise UserError(
            f"eurosat:{arg}: no folder with EuroSAT's 10 class folders ({', '.join(CLASSES[:3])}, ...) here "
            f"or in {' or '.join(NESTED)}: give the folder EuroSAT_MS.zip or EuroSATallBands.zip extracted to"
        )
    files = [sorted(p for p in (root / c).iterdir() if p.suffix.lower() in TIFF_SUFFIXES) for c in CLASSES]
    listed = top / f"eurosat-{split}.txt"
    if listed.is_file():
        chosen = _listed(listed, files)
    else:
        low, high = SPLITS[split]
        chosen = []
        for label, paths in enumerate(files):
            order = np.random.default_rng([SPLIT_SEED, label]).permutation(len(paths))
            start, end = round(low * len(paths)), round(high * len(paths))
            chosen += [(paths[i], label) for i in sorted(order[start:end])]
    if not chosen:
        raise UserError(
            f"eurosat:{arg}: no TIFF files for split {split!r} in {root}: "
            + (f"name them in {listed}" if listed.is_file() else "give each class folder at least 4 files")
        )
    records = array_records(chosen, {"band_names": list(BAND_NAMES)})
    first = records[0][0]
    if first.channels != len(BAND_NAMES):
        raise UserError(
            f"{first.path}: {first.channels} bands, EuroSAT's multispectral files have {len(BAND_NAMES)}: "
            "give the folder of EuroSAT_MS (the RGB release's JPEGs convert with imagefolder:)"
        )
    return list(CLASSES), records


def _listed(listed: Path, files: list[list[Path]]) -> list[tuple[Path, int]]:
    """The files a split list names (by name without extension), in the list's order."""
    where = {p.stem: (p, label) for label, paths in enumerate(files) for p in paths}
    try:
        names = [line.strip() for line in listed.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"{listed}: cannot be read ({err})") from None
    missing = [n for n in names if Path(n).stem not in where]
    if missing:
        raise UserError(
            f"{listed}: names {len(missing)} files not in the class folders, e.g. {missing[0]}: extract the "
            "archive again, or remove the list to split by the seed"
        )
    stems = [Path(n).stem for n in names]
    if len(set(stems)) < len(stems):  # a file twice would be a duplicate sample, weighted twice
        again = next(n for i, n in enumerate(names) if stems[i] in stems[:i])
        raise UserError(
            f"{listed}: names {again} twice: name each file once, or remove the list to split by the seed"
        )
    return [where[stem] for stem in stems]


register(
    SourceKind(
        "eurosat", load, "DIR", help="EuroSAT's 13-band Sentinel-2 tifs", splits="train|val|test", arrays=True
    )
)
