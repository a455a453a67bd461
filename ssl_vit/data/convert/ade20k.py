"""`ade20k:DIR`: the ADE20K scene-parsing benchmark (ADEChallengeData2016) for `ssl-vit data convert`:
records `(image path, -1, MaskFile)`, no image-level label, the annotation PNG mapped to class indices
(`ADE_TO_CLASSES`) as the mask.
"""

from __future__ import annotations

import csv
import re
from pathlib import Path

import numpy as np

from ssl_vit.data.convert.payload import MaskFile
from ssl_vit.data.convert.source import SourceKind, check_split, register, source_dir
from ssl_vit.data.format.masks import IGNORE_INDEX
from ssl_vit.errors import UserError

ADE_SPLITS = {"train": "training", "val": "validation"}
ADE_CLASSES = 150
ADE_CLASS_FILES = ("objectInfo150.txt", "objectInfo150.csv")
# ADE20K's annotations hold 0 for "other" (no class) and 1..150 for the classes. The benchmark scores
# 150 classes with "other" ignored: 0 -> 255, k -> k - 1, and 255 stays ignored (mmseg's
# `reduce_zero_label`: `gt[gt == 0] = 255; gt = gt - 1; gt[gt == 254] = 255`).
ADE_TO_CLASSES = (np.arange(256) - 1).clip(0).astype(np.uint8)  # value k -> class k - 1
ADE_TO_CLASSES[0] = ADE_TO_CLASSES[255] = IGNORE_INDEX


def load(arg: str, split: str) -> tuple[list[str], list]:
    """ADEChallengeData2016 (`DIR` itself, or the folder it was extracted into): split `train` reads
    `images/training/*.jpg` with `annotations/training/*.png`, `val` the `validation` folders."""
    check_split("ade20k", split, tuple(ADE_SPLITS))
    top = source_dir("ade20k", arg)
    root = top / "ADEChallengeData2016" if (top / "ADEChallengeData2016").is_dir() else top
    images, annotations = root / "images" / ADE_SPLITS[split], root / "annotations" / ADE_SPLITS[split]
    for folder in (images, annotations):
        if not folder.is_dir():
            raise UserError(
                f"ade20k:{arg}: no folder {folder}: extract ADEChallengeData2016.zip and give its folder "
                "(images/ and annotations/, each with training/ and validation/)"
            )
    paths = sorted(p for p in images.iterdir() if p.suffix.lower() == ".jpg" and p.is_file())
    if not paths:
        raise UserError(f"{images}: no images (*.jpg): extract ADEChallengeData2016.zip again")
    records = []
    for path in paths:
        mask = annotations / f"{path.stem}.png"
        if not mask.is_file():
            raise UserError(
                f"{mask}: missing, the annotation of {path}: extract ADEChallengeData2016.zip again, or "
                "remove the image"
            )
        records.append((path, -1, MaskFile(mask, ADE_TO_CLASSES)))
    return _ade_class_names(root), records


def _ade_class_names(root: Path) -> list[str]:
    """The 150 class names from `objectInfo150.txt` (the challenge zip's: tab-separated `Idx Ratio Train
    Val Name`, the name a list of synonyms such as `building, edifice`) or `objectInfo150.csv` (the CSAIL
    semantic-segmentation repo's: `Idx,Ratio,Train,Val,Stuff,Name`, synonyms joined by `;`): the first
    synonym of each, as mmseg names the classes. "0".."149" without either file."""
    path = next((root / name for name in ADE_CLASS_FILES if (root / name).is_file()), None)
    if path is None:
        return [str(c) for c in range(ADE_CLASSES)]
    fix = f"restore it from ADEChallengeData2016.zip, or remove it to name the classes 0..{ADE_CLASSES - 1}"
    try:
        with open(path, newline="", encoding="utf-8") as f:
            rows = list(csv.reader(f, delimiter="\t" if path.suffix == ".txt" else ","))
        header = [cell.strip() for cell in rows[0]]
        idx, name = header.index("Idx"), header.index("Name")
        names = {int(row[idx]): re.split(r"[,;]", row[name])[0].strip() for row in rows[1:] if row}
    except (OSError, UnicodeDecodeError, csv.Error, IndexError, ValueError) as err:
        raise UserError(f"{path}: not ADE20K's class table ({type(err).__name__}: {err}): {fix}") from None
    if sorted(names) != list(range(1, ADE_CLASSES + 1)) or not all(names.values()):
        raise UserError(f"{path}: expected a name for each of the classes 1..{ADE_CLASSES}: {fix}")
    return [names[c] for c in range(1, ADE_CLASSES + 1)]


register(
    SourceKind(
        "ade20k",
        load,
        "DIR",
        help="ADEChallengeData2016: images/ and annotations/; 150 classes, its 0 'other' ignored as 255",
        splits="train|val",
        masks=True,
    )
)
