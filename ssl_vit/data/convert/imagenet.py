"""The `imagenet:DIR` source: ILSVRC-2012 (ImageNet-1k) as distributed, no re-sorting needed.

- `DIR/train/nXXXXXXXX/*.JPEG`: one folder per synset (the official train tar with each class tar
  extracted). Class index = position of the wnid in sorted order, the order timm and torchvision use.
- `DIR/val/`: either sorted into the same class folders, or flat (`ILSVRC2012_val_00000001.JPEG` ...)
  with its ground truth next to it in DIR, one of:
  - `LOC_val_solution.csv` (the Kaggle download): `ImageId,PredictionString`, the first token of the
    prediction string is the wnid;
  - `ILSVRC2012_validation_ground_truth.txt` (the devkit, `ILSVRC2012_devkit_t12.tar.gz`): one
    ILSVRC2012_ID (1-1000) per line in file-number order, mapped to wnids by the devkit's
    `data/meta.mat`. Put both files in DIR, or extract the devkit into DIR (`DIR/ILSVRC2012_devkit_t12/`).
- The Kaggle download's top folder also works as DIR: its images are in `ILSVRC/Data/CLS-LOC/`.

The classes are the wnids of `DIR/train`; without a train folder, those of `LOC_synset_mapping.txt`
(Kaggle), of the devkit's meta.mat, or the val class folders. Every problem is a one-line UserError
naming the file and the fix, raised before anything is written.
"""

from __future__ import annotations

import csv
import re
from pathlib import Path

from ssl_vit.data.convert.source import SourceKind, check_split, register, source_dir
from ssl_vit.errors import UserError

WNID = re.compile(r"n\d{8}")
DEVKIT = "ILSVRC2012_devkit_t12/data"
SOLUTION = "LOC_val_solution.csv"
GROUND_TRUTH = "ILSVRC2012_validation_ground_truth.txt"
SUFFIXES = {".jpeg", ".jpg", ".png"}


def load(arg: str, split: str) -> tuple[list[str], list]:
    """`(class_names, [(path, label)])` of split `train` or `val` of the ILSVRC-2012 tree at `arg`."""
    check_split("imagenet", split, ("train", "val"))
    top = source_dir("imagenet", arg)
    images = top / "ILSVRC/Data/CLS-LOC" if (top / "ILSVRC/Data/CLS-LOC").is_dir() else top
    folder = images / split
    if not folder.is_dir():
        raise UserError(
            f"imagenet:{arg}: no folder {folder}: extract ILSVRC2012_img_{split}.tar there "
            "(train: one nXXXXXXXX/ folder per class)"
        )
    classes = _classes(top, images)
    index = {wnid: i for i, wnid in enumerate(classes)}
    if _class_folders(folder):
        return classes, _from_class_folders(folder, index)
    if split == "train":
        raise UserError(f"{folder}: no class folders (nXXXXXXXX/): extract each class tar into one")
    return classes, _flat_val(top, folder, index)


def _classes(top: Path, images: Path) -> list[str]:
    for source in (
        lambda: _class_folders(images / "train"),
        lambda: _synset_mapping(top / "LOC_synset_mapping.txt"),
        lambda: sorted(_devkit_wnids(top).values()),
        lambda: _class_folders(images / "val"),
    ):
        classes = source()
        if classes:
            return classes
    raise UserError(
        f"imagenet:{top}: cannot tell the 1000 classes: no {images / 'train'}/nXXXXXXXX/ folders, no "
        f"LOC_synset_mapping.txt, no {DEVKIT}/meta.mat and no val class folders in {top}"
    )


def _class_folders(folder: Path) -> list[str]:
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if p.is_dir() and WNID.fullmatch(p.name))


def _images(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in SUFFIXES and p.is_file())


def _from_class_folders(folder: Path, index: dict[str, int]) -> list:
    records = []
    for wnid in _class_folders(folder):
        if wnid not in index:
            raise UserError(
                f"{folder / wnid}: not one of the {len(index)} training classes: remove it or fix the tree"
            )
        records += [(p, index[wnid]) for p in _images(folder / wnid)]
    return records


def _synset_mapping(path: Path) -> list[str]:
    """Kaggle's `LOC_synset_mapping.txt`: `n01440764 tench, Tinca tinca` per line."""
    if not path.is_file():
        return []
    wnids = [line.split(maxsplit=1)[0] for line in path.read_text().splitlines() if line.strip()]
    bad = next((w for w in wnids if not WNID.fullmatch(w)), None)
    if bad is not None:
        raise UserError(f"{path}: {bad!r} is not a wnid (nXXXXXXXX): restore the file from the download")
    return sorted(wnids)


def _devkit_file(top: Path, name: str) -> Path | None:
    return next((p for p in (top / name, top / DEVKIT / name) if p.is_file()), None)


def _devkit_wnids(top: Path) -> dict[int, str]:
    """ILSVRC2012_ID -> wnid of the 1000 classes, from the devkit's meta.mat (the leaf synsets, IDs
    1-1000, as torchvision's `ImageNet` reads them); {} without one."""
    path = _devkit_file(top, "meta.mat")
    if path is None:
        return {}
    from scipy.io import loadmat  # a MATLAB file; scipy is only needed for this layout

    try:
        synsets = loadmat(path, squeeze_me=True)["synsets"]
        ids = {int(s["ILSVRC2012_ID"]): str(s["WNID"]) for s in synsets}
    except Exception as err:
        raise UserError(f"{path}: not the devkit's meta.mat ({err}): extract it again") from None
    return {i: w for i, w in ids.items() if 1 <= i <= 1000}


def _flat_val(top: Path, folder: Path, index: dict[str, int]) -> list:
    """Flat val images labelled from LOC_val_solution.csv or the devkit's ground-truth file."""
    solution, truth = top / SOLUTION, _devkit_file(top, GROUND_TRUTH)
    if solution.is_file():
        labels, named = _solution(solution), solution
    elif truth is not None:
        labels, named = _ground_truth(top, truth), truth
    else:
        raise UserError(
            f"{folder} is flat and there is no ground truth: put {SOLUTION} (Kaggle) or {GROUND_TRUTH} "
            f"with the devkit's meta.mat (or the extracted {DEVKIT.split('/')[0]}/) in {top}, or sort "
            "val into nXXXXXXXX/ class folders"
        )
    images = _images(folder)
    if not images:
        raise UserError(f"{folder}: no images (*.JPEG): extract ILSVRC2012_img_val.tar there")
    records = []
    for path in images:
        wnid = labels.get(path.stem)
        if wnid is None:
            raise UserError(f"{path}: no label in {named}: use the complete file or remove the image")
        if wnid not in index:
            raise UserError(f"{named}: {path.stem} is labelled {wnid}, not one of the {len(index)} classes")
        records.append((path, index[wnid]))
    return records


def _solution(path: Path) -> dict[str, str]:
    """Kaggle's `ImageId,PredictionString` (`n01751748 72 1 499 349 ...`): image id -> wnid."""
    labels = {}
    with open(path, newline="") as f:
        rows = csv.reader(f)
        if next(rows, None) != ["ImageId", "PredictionString"]:
            raise UserError(f"{path}: first line is not 'ImageId,PredictionString': restore the Kaggle file")
        for line, row in enumerate(rows, start=2):
            wnid = row[1].split(maxsplit=1)[0] if len(row) == 2 and row[1].strip() else ""
            if not WNID.fullmatch(wnid):
                raise UserError(f"{path}:{line}: expected 'IMAGE_ID,nXXXXXXXX ...', got {','.join(row)!r}")
            labels[row[0]] = wnid
    return labels


def _ground_truth(top: Path, path: Path) -> dict[str, str]:
    """The devkit's one ILSVRC2012_ID per line, line k for `ILSVRC2012_val_{k:08d}`: image id -> wnid."""
    wnids = _devkit_wnids(top)
    if not wnids:
        raise UserError(
            f"{path} needs the devkit's meta.mat to map its class IDs to wnids: put meta.mat in {top} "
            f"or extract ILSVRC2012_devkit_t12.tar.gz there"
        )
    labels = {}
    for line, text in enumerate(path.read_text().splitlines(), start=1):
        if not (text.strip().isdigit() and int(text) in wnids):
            raise UserError(f"{path}:{line}: expected a class ID 1-1000, got {text!r}")
        labels[f"ILSVRC2012_val_{line:08d}"] = wnids[int(text)]
    return labels


register(
    SourceKind(
        "imagenet",
        load,
        "DIR",
        help="ILSVRC-2012: DIR/train/nXXXXXXXX/*.JPEG; DIR/val in class folders or flat with "
        "LOC_val_solution.csv or ILSVRC2012_validation_ground_truth.txt plus the devkit's meta.mat in DIR",
        splits="train|val",
    )
)
