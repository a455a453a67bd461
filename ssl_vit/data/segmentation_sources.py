"""Segmentation sets for `ssl-vit data convert`: `ade20k:DIR` (ADEChallengeData2016) and `voc:DIR`
(PASCAL VOC 2012). Each record is `(image path, -1, MaskFile)`: the image, no image-level label, and
the annotation PNG, which the writer's workers decode, map to class indices and store as the sample's
`seg.png` (`ssl_vit.data.encode`). The layout is checked before anything is written: a missing folder,
split list or annotation is one line naming the file and the fix.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ssl_vit.data.masks import IGNORE_INDEX, decode_mask
from ssl_vit.errors import UserError

ADE_SPLITS = {"train": "training", "val": "validation"}
ADE_CLASSES = 150
ADE_CLASS_FILES = ("objectInfo150.txt", "objectInfo150.csv")
# ADE20K's annotations hold 0 for "other" (no class) and 1..150 for the classes. The benchmark scores
# 150 classes with "other" ignored: 0 -> 255, k -> k - 1, and 255 stays ignored (mmseg's
# `reduce_zero_label`: `gt[gt == 0] = 255; gt = gt - 1; gt[gt == 254] = 255`).
ADE_TO_CLASSES = (np.arange(256) - 1).clip(0).astype(np.uint8)  # value k -> class k - 1
ADE_TO_CLASSES[0] = ADE_TO_CLASSES[255] = IGNORE_INDEX

# PASCAL VOC 2012's 20 object classes after its background (index 0), in the devkit's order
# (VOCdevkit/devkit_doc, `VOCopts.classes`); 255 marks object borders and difficult regions.
VOC_CLASSES = (
    "background", "aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair",
    "cow", "diningtable", "dog", "horse", "motorbike", "person", "pottedplant", "sheep", "sofa",
    "train", "tvmonitor",
)  # fmt: skip
VOC_ID = re.compile(r"[\w-]+")


@dataclass(frozen=True)
class MaskFile:
    """An annotation PNG and the lookup table from its values to class indices (None: they are)."""

    path: Path
    to_classes: np.ndarray | None = None

    def load(self) -> np.ndarray:
        """uint8 [H, W] class indices (255 ignored); ValueError naming the file when it does not decode."""
        try:
            mask = decode_mask(self.path.read_bytes())
        except Exception as err:
            raise ValueError(f"mask {self.path} does not decode: {err}") from None
        return mask if self.to_classes is None else self.to_classes[mask]


def ade20k(arg: str, split: str) -> tuple[list[str], list]:
    """ADEChallengeData2016 (`DIR` itself, or the folder it was extracted into): split `train` reads
    `images/training/*.jpg` with `annotations/training/*.png`, `val` the `validation` folders."""
    if split not in ADE_SPLITS:
        raise UserError(f"ade20k has splits 'train' and 'val', not {split!r}: pass --split train|val")
    top = Path(arg)
    if not top.is_dir():
        raise UserError(f"ade20k:{arg}: no such directory")
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


def voc(arg: str, split: str) -> tuple[list[str], list]:
    """VOC2012 (`DIR` is `VOCdevkit/VOC2012` or `VOCdevkit`): the image ids of
    `ImageSets/Segmentation/{split}.txt`, each `JPEGImages/ID.jpg` with `SegmentationClass/ID.png`
    (palette PNGs whose indices are the 21 classes, 255 on object borders, kept as 255)."""
    top = Path(arg)
    if not top.is_dir():
        raise UserError(f"voc:{arg}: no such directory")
    root = top / "VOC2012" if (top / "VOC2012").is_dir() else top
    lists = root / "ImageSets" / "Segmentation"
    listed = lists / f"{split}.txt"
    if not listed.is_file():
        found = sorted(p.stem for p in lists.glob("*.txt")) if lists.is_dir() else []
        have = f"the lists there are {', '.join(found)}" if found else f"there is no {lists}"
        raise UserError(
            f"voc:{arg}: no split list {listed} ({have}): give VOCdevkit/VOC2012 as extracted from "
            "VOCtrainval_11-May-2012.tar and --split train, val or trainval"
        )
    try:
        lines = listed.read_text(encoding="ascii").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"{listed}: cannot be read ({err}): restore it from the VOC tar") from None
    records = []
    for number, line in enumerate(lines, start=1):
        name = line.strip()
        if not name:
            continue
        if not VOC_ID.fullmatch(name):
            raise UserError(f"{listed}:{number}: expected one image id per line, got {line!r}: restore it")
        image, mask = root / "JPEGImages" / f"{name}.jpg", root / "SegmentationClass" / f"{name}.png"
        for path in (image, mask):
            if not path.is_file():
                raise UserError(f"{path}: missing, listed in {listed}: extract the VOC tar again")
        records.append((image, -1, MaskFile(mask)))
    if not records:
        raise UserError(f"{listed}: lists no image: restore it from the VOC tar")
    return list(VOC_CLASSES), records
