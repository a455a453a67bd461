"""`imagefolder:DIR`: image files in class folders, as torchvision's `ImageFolder` reads them."""

from __future__ import annotations

from ssl_vit.data.convert.source import SourceKind, register, source_dir
from ssl_vit.errors import UserError

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".ppm", ".pgm", ".tif", ".tiff"}


def load(arg: str, split: str) -> tuple[list[str], list]:
    """DIR/CLASS/*.jpg (classes are the sorted sub-directory names); images directly in DIR are
    unlabelled. Files are checked when the writer's workers read them; unreadable ones are skipped
    and counted."""
    root = source_dir("imagefolder", arg)
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    records = [(p, -1) for p in sorted(root.iterdir()) if p.suffix.lower() in IMAGE_SUFFIXES]
    for label, name in enumerate(classes):
        files = sorted(p for p in (root / name).rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
        records += [(p, label) for p in files]
    if not records:
        raise UserError(f"imagefolder:{arg}: no image files ({', '.join(sorted(IMAGE_SUFFIXES))}) found")
    return classes, records


register(SourceKind("imagefolder", load, "DIR"))
