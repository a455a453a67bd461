"""Helpers for the data tests: tiny shards written with webdataset's own TarWriter."""

import io
import sys
from pathlib import Path

import numpy as np
import webdataset as wds
from cli_helpers import free_port  # noqa: F401  (re-exported for the data tests)
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))  # helper modules next to the tests, for spawned processes


def image_bytes(rng: np.random.Generator, fmt: str = "png", size: tuple[int, int] = (16, 16)) -> bytes:
    """A random RGB image, `size` (W, H), encoded as `fmt`."""
    array = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="JPEG" if fmt == "jpg" else "PNG")
    return buf.getvalue()


def write_shards(
    root: Path, sizes: list[int], prefix: str = "part", fmt: str = "png", seed: int = 0, num_classes: int = 10
) -> tuple[str, list[str]]:
    """One shard per entry of `sizes` (`{prefix}-NNNNNN.tar`, `KEY.{fmt}` + `KEY.cls`), written with
    webdataset's TarWriter. Returns the brace URL and the keys in order."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    keys = []
    for shard, n in enumerate(sizes):
        with wds.TarWriter(str(root / f"{prefix}-{shard:06d}.tar")) as sink:
            for i in range(n):
                key = f"{prefix}-s{shard}-{i:04d}"
                sink.write({"__key__": key, fmt: image_bytes(rng, fmt), "cls": str(len(keys) % num_classes)})
                keys.append(key)
    return f"{root}/{prefix}-{{000000..{len(sizes) - 1:06d}}}.tar", keys


def write_broken_shard(path, rng) -> tuple[list[str], int]:
    """A shard with good samples and 4 bad ones. Returns the good keys and the bad count."""
    jpeg = image_bytes(rng, "jpg", (64, 48))
    with wds.TarWriter(str(path)) as sink:
        good = []
        for i, member in enumerate(
            [
                {"png": image_bytes(rng), "cls": "1"},
                {"jpg": jpeg[: len(jpeg) // 2], "cls": "2"},  # truncated JPEG
                {"png": b"this is not an image", "cls": "3"},  # image member that is not an image
                {"png": image_bytes(rng), "cls": "seven"},  # label that does not parse
                {"cls": "4"},  # no image member at all
                {"jpg": jpeg, "cls": "5"},
                {"png": image_bytes(rng)},  # unlabelled: fine, label -1
            ]
        ):
            key = f"broken-{i}"
            sink.write({"__key__": key, **member})
            if i in (0, 5, 6):
                good.append(key)
    return good, 4
