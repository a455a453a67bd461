"""`npz:FILE`: images (and labels) as numpy arrays in one `.npz` file."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ssl_vit.data.convert.source import SourceKind, labelled_records, register
from ssl_vit.errors import UserError


def load(arg: str, split: str) -> tuple[list[str], list]:
    """The arrays `images` and, when present, `labels` and `class_names` of a `.npz` file (no pickles)."""
    path = Path(arg)
    if not path.is_file():
        raise UserError(f"npz:{arg}: no such file")
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except Exception as err:
        raise UserError(f"npz:{arg}: does not parse as .npz ({err})") from None
    images = arrays.get("images")
    if (
        images is None
        or images.dtype != np.uint8
        or images.ndim not in (3, 4)
        or (images.ndim == 4 and images.shape[-1] not in (1, 3))
    ):
        raise UserError(f"npz:{arg}: needs an array 'images' of uint8, shape (N, H, W) or (N, H, W, 1|3)")
    if images.ndim == 4 and images.shape[-1] == 1:
        images = images[..., 0]
    labels = arrays.get("labels")
    if labels is not None and (labels.shape != (len(images),) or labels.dtype.kind not in "iu"):
        raise UserError(f"npz:{arg}: 'labels' must be integers of shape ({len(images)},), got {labels.shape}")
    return labelled_records(images, labels, arrays.get("class_names"))


register(SourceKind("npz", load, "FILE", help="arrays images (N, H, W[, 1|3]) uint8 and labels"))
