"""Image sources that `ssl-vit data convert` turns into shards.

A source is parsed from a SOURCE string (`ssl-vit data convert SOURCE`) into a `Source`: a name, class names
and its records. A record is `(payload, label)` where `payload` is a uint8 array `(H, W)` or
`(H, W, 3)`, a path to an image file (read in the writer's worker processes, so the parent never
holds a whole image folder in memory), or an image file's bytes read from a shard (`wds:`, see
`ssl_vit.data.wds_source`) or a parquet row (`hf:`, `ssl_vit.data.hf_source`). `label` is -1 for
unlabelled images. Records are a list, or for `wds:` and `hf:` an iterable read lazily (a large set of
shards or parquet files is never held in memory).

Sources with segmentation masks (`ade20k:`, `voc:`, `mosaic:`; `Source.masks`) give each record a
third element, its mask (`ssl_vit.data.segmentation_sources`), or a payload that composes image and
mask (`ssl_vit.data.mosaic.Tiles`); their class names are the mask's classes.

Each loader validates what it reads and raises `UserError` with a one-line message naming the file
and what is wrong with it, before anything is written.
"""

from __future__ import annotations

import gzip
import pickle
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ssl_vit.data import arrays_source, eurosat, imagenet, segmentation_sources
from ssl_vit.errors import UserError
from ssl_vit.outdir import Input

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".ppm", ".pgm", ".tif", ".tiff"}
DIGITS_SIZE = 32
DIGITS_VAL_FRACTION = 0.2
DIGITS_SPLIT_SEED = 0
SOURCES_HELP = (
    "digits, synthetic:N, imagefolder:DIR, cifar10:DIR, cifar100:DIR, idx:IMAGES[,LABELS], npz:FILE, "
    "wds:URLS (existing WebDataset shards, re-sharded: image jpg/jpeg/png/webp, label from cls or a json "
    "member's label/cls, keys kept), imagenet:DIR (ILSVRC-2012: DIR/train/nXXXXXXXX/*.JPEG; DIR/val in "
    "class folders or flat with LOC_val_solution.csv or ILSVRC2012_validation_ground_truth.txt plus the "
    "devkit's meta.mat in DIR); with segmentation masks (stored as each sample's seg.png): ade20k:DIR "
    "(ADEChallengeData2016: images/ and annotations/, --split train|val; 150 classes, its 0 'other' "
    "ignored as 255), voc:DIR (VOCdevkit/VOC2012: ImageSets/Segmentation/SPLIT.txt, JPEGImages, "
    "SegmentationClass; 21 classes, 255 borders kept), mosaic:URLS --grid K [--background-threshold T] "
    "(K x K grids of a labelled shard set's images, read like wds:, each tile's pixels labelled with its "
    "class: a dense task built from real images); hf:DIR [--subset NAME] [--image-column NAME] "
    "[--label-column NAME] (a local snapshot of a Hugging Face Hub dataset repository in parquet, as "
    "`huggingface-cli download --repo-type dataset ORG/NAME --local-dir DIR` leaves it: the image and "
    "label columns found from its `datasets` Image and ClassLabel features, or named); "
    "of any band count and bit depth (stored as npy): "
    "tiff:DIR (DIR/CLASS/*.tif, or DIR/*.tif with DIR/labels.csv of filename,label; any bands, uint8, "
    "uint16, int16 or float32), eurosat:DIR (EuroSAT's 13-band Sentinel-2 tifs, --split train|val|test)"
)
MASK_SOURCES = ("ade20k", "voc", "mosaic")
ARRAY_SOURCES = ("tiff", "eurosat")  # stored as .npy arrays, not 8-bit PNG/JPEG
# The `ssl-vit data convert` flags that belong to one source each (argument name -> that source)
SOURCE_OPTIONS = {
    "grid": "mosaic:URLS",
    "background_threshold": "mosaic:URLS",
    "subset": "hf:DIR",
    "image_column": "hf:DIR",
    "label_column": "hf:DIR",
}


@dataclass
class Source:
    name: str  # the SOURCE string's kind, used in sample keys and the manifest
    spec: str  # the SOURCE string as given
    class_names: list[str] | None  # None: "0" ... "K-1" from the labels written (wds: without a manifest)
    records: Iterable  # of (payload, label); payload: uint8 array (H, W[, 3]), image file path, or
    # `wds_source.ShardImage` / `wds_source.Broken`
    total: int | None  # the number of records, where known before reading them (progress, resume)
    masks: bool = False  # every record has a segmentation mask; `class_names` are its classes
    arrays: bool = False  # records are `arrays_source.ArrayFile`s, stored as .npy
    manifest: dict = field(default_factory=dict)  # more to record in the manifest, complete once the
    # records have been read to their end
    options: dict = field(default_factory=dict)  # the source's own options (a rerun with others starts over)


def open_source(spec: str, split: str, **options: int | str | None) -> Source:
    """Parse a SOURCE string and load its records for `split`. `options` are the sources' own
    (`SOURCE_OPTIONS`: `grid` and `background_threshold` of `mosaic:`; `subset`, `image_column` and
    `label_column` of `hf:`), each refused with any other source."""
    kind, _, arg = spec.partition(":")
    own = {name: options.get(name) for name, owner in SOURCE_OPTIONS.items() if owner.startswith(f"{kind}:")}
    wrong = [name for name, value in options.items() if value is not None and name not in own]
    if wrong:
        owner = SOURCE_OPTIONS[wrong[0]]
        flags = ", ".join(f"--{name.replace('_', '-')}" for name in wrong if SOURCE_OPTIONS[name] == owner)
        raise UserError(f"{flags}: only for the {owner} source, not {spec!r}: leave it out")
    loaders = {
        "digits": _digits,
        "synthetic": _synthetic,
        "imagefolder": _imagefolder,
        "cifar10": _cifar10,
        "cifar100": _cifar100,
        "idx": _idx,
        "npz": _npz,
        "wds": _wds,
        "imagenet": imagenet.load,
        "ade20k": segmentation_sources.ade20k,
        "voc": segmentation_sources.voc,
        "mosaic": lambda arg, split: _mosaic(arg, split, **own),
        "hf": lambda arg, split: _hf(arg, split, **own),
        "tiff": arrays_source.load,
        "eurosat": eurosat.load,
    }
    if kind not in loaders:
        raise UserError(f"unknown source {spec!r}: use one of {SOURCES_HELP}")
    if kind == "digits" and arg:
        raise UserError(f"source 'digits' takes no argument (got {spec!r})")
    if kind != "digits" and not arg:
        raise UserError(f"source {kind!r} needs an argument: use one of {SOURCES_HELP}")
    class_names, records = loaders[kind](arg, split)
    total = len(records) if isinstance(records, list) else records.total
    if total == 0:
        raise UserError(f"source {spec!r} has no images for split {split!r}")
    return Source(
        kind,
        spec,
        class_names,
        records,
        total,
        masks=kind in MASK_SOURCES,
        arrays=kind in ARRAY_SOURCES,
        manifest=getattr(records, "manifest", {}),  # what mosaic: and hf: record of themselves
        options=own,
    )


def source_inputs(spec: str) -> list[Input]:
    """The local files and folders a SOURCE string reads (`wds:`/`mosaic:` shards: their directories),
    which OUTDIR must keep out of (`ssl_vit.outdir`); none for `digits` and `synthetic:N`."""
    kind, _, arg = spec.partition(":")
    if kind in ("digits", "synthetic") or not arg:
        return []
    if kind in ("wds", "mosaic"):
        from ssl_vit.data.urls import shard_directories  # (see `_wds`)

        return [
            Input(folder, f"the directory of the source's shards {folder}")
            for folder in shard_directories(arg, spec)
        ]
    # DIR, FILE, or IMAGES,LABELS
    return [Input(Path(part), f"the source {part}") for part in arg.split(",") if part]


def _wds(arg: str, split: str):
    # imported here: webdataset imports torch, and `ssl-vit --help` imports this module
    from ssl_vit.data import wds_source

    return wds_source.load(arg, split)


def _mosaic(arg: str, split: str, grid: int | None, background_threshold: int | None):
    from ssl_vit.data import mosaic  # imported here, as `wds_source` is (see `_wds`)

    return mosaic.load(arg, split, grid, background_threshold)


def _hf(arg: str, split: str, subset: str | None, image_column: str | None, label_column: str | None):
    from ssl_vit.data import hf_source  # imported here, as `wds_source` is (see `_wds`)

    return hf_source.load(arg, split, image_column, label_column, subset)


def _digits(_: str, split: str):
    """scikit-learn's 8x8 handwritten digits (1797 images, values 0-16), upscaled to 32x32 RGB.

    The train/val split is fixed: a permutation seeded with 0, the first 20% (360 images) is `val`,
    the rest (1437) is `train`. Upscaling is bilinear on the 0-255 rescaled values, so ViT patches of
    4 or 8 pixels see smooth strokes rather than hard 4x4 blocks.
    """
    from PIL import Image
    from sklearn.datasets import load_digits

    if split not in ("train", "val"):
        raise UserError(
            f"source 'digits' has splits 'train' and 'val', not {split!r}: pass --split train|val"
        )
    digits = load_digits()
    order = np.random.default_rng(DIGITS_SPLIT_SEED).permutation(len(digits.images))
    n_val = int(round(len(order) * DIGITS_VAL_FRACTION))
    chosen = np.sort(order[:n_val] if split == "val" else order[n_val:])
    records = []
    for i in chosen:
        small = Image.fromarray(np.round(digits.images[i] * (255 / 16)).astype(np.uint8))
        big = np.asarray(small.resize((DIGITS_SIZE, DIGITS_SIZE), Image.BILINEAR))
        records.append((np.repeat(big[:, :, None], 3, axis=2), int(digits.target[i])))
    return [str(c) for c in range(10)], records


def _synthetic(arg: str, split: str):
    """N deterministic 32x32 RGB images in 10 classes: class c is a gradient at angle c*36 degrees in
    its own colour, plus noise; seeded by the split name so train and val differ."""
    try:
        n = int(arg)
    except ValueError:
        n = 0
    if n <= 0:
        raise UserError(f"synthetic:{arg}: N must be a positive integer, e.g. synthetic:1000")
    rng = np.random.default_rng(zlib.crc32(split.encode()))
    yy, xx = np.mgrid[0:32, 0:32] / 31.0
    records = []
    for i in range(n):
        c = i % 10
        angle = np.deg2rad(36 * c)
        ramp = np.cos(angle) * xx + np.sin(angle) * yy
        colour = np.array([(c * 97) % 256, (c * 53 + 80) % 256, (c * 29 + 160) % 256]) / 255.0
        img = ramp[:, :, None] * colour + rng.normal(0, 0.08, (32, 32, 3))
        records.append((np.clip(img * 255, 0, 255).astype(np.uint8), c))
    return [str(c) for c in range(10)], records


def _imagefolder(arg: str, split: str):
    """DIR/CLASS/*.jpg (classes are the sorted sub-directory names); images directly in DIR are
    unlabelled. Files are checked when the writer's workers read them; unreadable ones are skipped
    and counted."""
    root = Path(arg)
    if not root.is_dir():
        raise UserError(f"imagefolder:{arg}: no such directory")
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    records = [(p, -1) for p in sorted(root.iterdir()) if p.suffix.lower() in IMAGE_SUFFIXES]
    for label, name in enumerate(classes):
        files = sorted(p for p in (root / name).rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
        records += [(p, label) for p in files]
    if not records:
        raise UserError(f"imagefolder:{arg}: no image files ({', '.join(sorted(IMAGE_SUFFIXES))}) found")
    return classes, records


class _ArrayUnpickler(pickle.Unpickler):
    """CIFAR's python batches are pickles; load them allowing only numpy arrays, never arbitrary
    classes (an untrusted pickle can otherwise run code)."""

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy.core.numeric", "_frombuffer"),
        ("numpy._core.numeric", "_frombuffer"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),  # how protocol-2 pickles written by Python 3 store bytes
    }

    def find_class(self, module, name):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        return super().find_class(module, name)


def _load_cifar_pickle(path: Path) -> dict:
    if not path.is_file():
        raise UserError(
            f"{path}: missing; expected the CIFAR python batches (cifar-*-python.tar.gz, extracted)"
        )
    try:
        with open(path, "rb") as f:
            raw = _ArrayUnpickler(f, encoding="bytes").load()
        if not isinstance(raw, dict):
            raise ValueError("not a dict")
    except Exception as err:
        raise UserError(f"{path}: does not parse as a CIFAR python batch ({err})") from None
    return {(k.decode() if isinstance(k, bytes) else k): v for k, v in raw.items()}


def _cifar(root: Path, batch_names: list[str], meta_name: str, label_key: str, names_key: str):
    if (root / "cifar-10-batches-py").is_dir() or (root / "cifar-100-python").is_dir():
        root = next(p for p in (root / "cifar-10-batches-py", root / "cifar-100-python") if p.is_dir())
    if not root.is_dir():
        raise UserError(f"{root}: no such directory")
    meta = _load_cifar_pickle(root / meta_name)
    class_names = [n.decode() if isinstance(n, bytes) else str(n) for n in meta.get(names_key, [])]
    records = []
    for name in batch_names:
        batch = _load_cifar_pickle(root / name)
        data, labels = np.asarray(batch.get("data")), batch.get(label_key)
        if (
            data.ndim != 2
            or data.shape[1] != 3072
            or data.dtype != np.uint8
            or labels is None
            or len(labels) != len(data)
        ):
            raise UserError(
                f"{root / name}: expected 'data' uint8 (N, 3072) and '{label_key}' with N entries"
            )
        images = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
        records += [(img, int(lab)) for img, lab in zip(images, labels)]
    return class_names, records


def _cifar10(arg: str, split: str):
    if split not in ("train", "test"):
        raise UserError(f"cifar10 has splits 'train' and 'test', not {split!r}: pass --split train|test")
    batches = [f"data_batch_{i}" for i in range(1, 6)] if split == "train" else ["test_batch"]
    return _cifar(Path(arg), batches, "batches.meta", "labels", "label_names")


def _cifar100(arg: str, split: str):
    if split not in ("train", "test"):
        raise UserError(f"cifar100 has splits 'train' and 'test', not {split!r}: pass --split train|test")
    return _cifar(Path(arg), [split], "meta", "fine_labels", "fine_label_names")


def _read_idx(path: Path) -> np.ndarray:
    """IDX (MNIST-family) file, gzipped or not: magic 0x0000 TT NN, NN big-endian uint32 sizes, data.
    Only unsigned-byte data (type 0x08) is image data; that is what every MNIST-family set uses."""
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as err:
            raise UserError(f"{path}: corrupt gzip ({err})") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08 or raw[3] == 0:
        raise UserError(f"{path}: not an IDX file of unsigned bytes (bad magic {raw[:4].hex()})")
    ndim = raw[3]
    shape = tuple(int(d) for d in np.frombuffer(raw[4 : 4 + 4 * ndim], dtype=">u4"))
    body = raw[4 + 4 * ndim :]
    if len(shape) != ndim or len(body) != int(np.prod(shape)):
        raise UserError(f"{path}: IDX header says {shape} but holds {len(body)} bytes")
    return np.frombuffer(body, dtype=np.uint8).reshape(shape)


def _idx(arg: str, split: str):
    image_path, _, label_path = arg.partition(",")
    images = _read_idx(Path(image_path))
    if images.ndim not in (3, 4):
        raise UserError(
            f"{image_path}: expected IDX images (N, H, W) or (N, H, W, C), got shape {images.shape}"
        )
    if label_path:
        labels = _read_idx(Path(label_path))
        if labels.shape != (len(images),):
            raise UserError(f"{label_path}: expected {len(images)} labels, got shape {labels.shape}")
        class_names = [str(c) for c in range(int(labels.max()) + 1)]
    else:
        labels, class_names = np.full(len(images), -1), []
    return class_names, [(img, int(lab)) for img, lab in zip(images, labels)]


def _npz(arg: str, split: str):
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
    if labels is None:
        labels, class_names = np.full(len(images), -1), []
    else:
        if labels.shape != (len(images),) or labels.dtype.kind not in "iu":
            raise UserError(
                f"npz:{arg}: 'labels' must be integers of shape ({len(images)},), got {labels.shape}"
            )
        names = arrays.get("class_names")
        class_names = (
            [str(n) for n in names] if names is not None else [str(c) for c in range(int(labels.max()) + 1)]
        )
    return class_names, [(img, int(lab)) for img, lab in zip(images, labels)]
