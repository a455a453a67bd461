"""Shards of five-band uint16 images for the tests of what reads them (tasks, evaluation, analysis),
written as users write them: TIFF class folders converted by `ssl-vit data convert tiff:`
(`convert_band_tiffs`), and for segmentation, shards of `.npy` images beside their `seg.png` masks with a
manifest, the members and manifest `data convert` writes for a source with masks (`write_band_masks`;
no convert source makes multispectral masks yet).

Band b of an image of class c holds 1000 b + 300 c plus noise: bands in units far apart, classes a
linear probe separates."""

import io
import json
from pathlib import Path

import numpy as np
import tifffile
import webdataset as wds
from cli_helpers import run_cli
from PIL import Image

BANDS, CLASSES = 5, 4


def band_image(rng: np.random.Generator, label: int, size: int) -> np.ndarray:
    """(size, size, BANDS) uint16."""
    noise = rng.integers(0, 200, (size, size, BANDS))
    return (1000 * np.arange(BANDS) + 300 * label + noise).astype(np.uint16)


def convert_band_tiffs(root: Path, per_class: dict[str, int], size: int = 32) -> Path:
    """`per_class` images of each class in each split (`{"train": 12, "val": 4}`), as TIFF class folders
    converted to `root/shards/{split}-NNNNNN.tar` (24 a shard)."""
    rng = np.random.default_rng(0)
    for split, count in per_class.items():
        for label in range(CLASSES):
            folder = root / "tifs" / split / f"class{label}"
            folder.mkdir(parents=True)
            for i in range(count):
                tifffile.imwrite(folder / f"{i}.tif", band_image(rng, label, size), photometric="minisblack")
        run_cli(
            "data", "convert", f"tiff:{root / 'tifs' / split}", str(root / "shards"), "--split", split,
            "--shard-size", "24", "--no-progress",
        )  # fmt: skip
    return root / "shards"


def write_band_masks(root: Path, per_split: dict[str, int], size: int = 32) -> Path:
    """Mosaics of 2 x 2 tiles of `size / 2` pixels, each tile one class's image, the mask its class:
    `per_split` images a split (`{"train": 40, "test": 20}`), 20 a shard, `root/{split}-NNNNNN.tar`."""
    rng, half = np.random.default_rng(1), size // 2
    for split, count in per_split.items():
        shards = []
        for start in range(0, count, 20):
            samples = []
            for i in range(start, min(count, start + 20)):
                labels = rng.integers(0, CLASSES, (2, 2))
                mask = np.kron(labels, np.ones((half, half), dtype=np.int64)).astype(np.uint8)
                image = band_image(rng, 0, size) + 300 * mask[..., None].astype(np.uint16)  # class c: +300 c
                png = io.BytesIO()
                Image.fromarray(mask).save(png, format="PNG")
                array = io.BytesIO()
                np.save(array, image)
                samples.append(
                    {"__key__": f"{split}{i:04d}", "npy": array.getvalue(), "seg.png": png.getvalue()}
                )
            name = f"{split}-{len(shards):06d}.tar"
            with wds.TarWriter(str(root / name)) as sink:
                for sample in samples:
                    sink.write(sample)
            shards.append({"url": name, "num_samples": len(samples)})
        manifest = {
            "version": 1, "num_samples": count, "shards": shards, "num_classes": CLASSES,
            "class_names": [f"class{c}" for c in range(CLASSES)], "masks": True, "channels": BANDS,
            "dtype": "uint16", "image_size": [size, size],
        }  # fmt: skip
        (root / f"{split}.json").write_text(json.dumps(manifest))
    return root
