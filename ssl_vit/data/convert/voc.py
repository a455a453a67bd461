"""`voc:DIR`: PASCAL VOC 2012's segmentation set for `ssl-vit data convert`: records `(image path, -1,
MaskFile)`, no image-level label, the palette PNG of its classes as the mask.
"""

from __future__ import annotations

import re

from ssl_vit.data.convert.payload import MaskFile
from ssl_vit.data.convert.source import SourceKind, register, source_dir
from ssl_vit.errors import UserError

# PASCAL VOC 2012's 20 object classes after its background (index 0), in the devkit's order
# (VOCdevkit/devkit_doc, `VOCopts.classes`); 255 marks object borders and difficult regions.
VOC_CLASSES = (
    "background", "aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair",
    "cow", "diningtable", "dog", "horse", "motorbike", "person", "pottedplant", "sheep", "sofa",
    "train", "tvmonitor",
)  # fmt: skip
VOC_ID = re.compile(r"[\w-]+")


def load(arg: str, split: str) -> tuple[list[str], list]:
    """VOC2012 (`DIR` is `VOCdevkit/VOC2012` or `VOCdevkit`): the image ids of
    `ImageSets/Segmentation/{split}.txt`, each `JPEGImages/ID.jpg` with `SegmentationClass/ID.png`
    (palette PNGs whose indices are the 21 classes, 255 on object borders, kept as 255)."""
    top = source_dir("voc", arg)
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


register(
    SourceKind(
        "voc",
        load,
        "DIR",
        help="VOCdevkit/VOC2012: ImageSets/Segmentation/SPLIT.txt, JPEGImages, SegmentationClass; 21 "
        "classes, 255 borders kept",
        splits="train|val|trainval, its lists in ImageSets/Segmentation",
        masks=True,
    )
)
