"""`ssl-vit data convert` from sources with segmentation masks (ade20k, voc, mosaic), through the CLI:
samples, `seg.png` masks and manifests; ADE20K's 0 -> 255 and k -> k - 1, VOC's 255 borders kept;
every bad input one line, nothing written."""

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from PIL import Image
from test_convert import assert_one_line_error
from test_convert_reshard import convert_killed, files

from ssl_vit.data.convert.shard_writer import convert
from ssl_vit.data.convert.source import open_source

ADE_NAMES = ["wall", "building, edifice", "sky", "floor, flooring"] + [f"thing{c}" for c in range(5, 151)]


def save(array: np.ndarray, path: Path, **kwargs) -> bytes:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path, **kwargs)
    return path.read_bytes()


def samples_of(outdir: Path, split: str) -> tuple[dict, list[dict]]:
    """The manifest and the raw samples (bytes per member) of a converted split, in order."""
    manifest = json.loads((outdir / f"{split}.json").read_text())
    urls = [str(outdir / shard["url"]) for shard in manifest["shards"]]
    return manifest, list(wds.WebDataset(urls, shardshuffle=False, empty_check=False))


def pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)))


@pytest.fixture
def ade(tmp_path) -> tuple[Path, dict]:
    """ADEChallengeData2016 with 3 training images (one grey) and 1 validation image, annotations
    holding 0 ("other"), 1, 2, 5 and 150, and objectInfo150.txt as the challenge zip has it."""
    root = tmp_path / "sets" / "ADEChallengeData2016"  # (OUTDIR, tmp_path/out, is never inside a source)
    rng = np.random.default_rng(0)
    truth = {}
    for folder, stem, grey in [
        ("training", "ADE_train_00000001", False), ("training", "ADE_train_00000002", True),
        ("training", "ADE_train_00000003", False), ("validation", "ADE_val_00000001", False),
    ]:  # fmt: skip
        image = rng.integers(0, 256, (20, 24) if grey else (20, 24, 3), dtype=np.uint8)
        data = save(image, root / "images" / folder / f"{stem}.jpg", quality=90)
        annotation = rng.choice(np.array([0, 1, 2, 5, 150], dtype=np.uint8), (20, 24))
        save(annotation, root / "annotations" / folder / f"{stem}.png")
        truth[stem] = (data, annotation)
    rows = ["Idx\tRatio\tTrain\tVal\tName"] + [f"{c}\t0.01\t10\t1\t{n}" for c, n in enumerate(ADE_NAMES, 1)]
    (root / "objectInfo150.txt").write_text("\n".join(rows) + "\n")
    return root, truth


def test_ade20k_maps_other_to_ignored_and_shifts_the_classes(cli, ade, tmp_path):
    root, truth = ade
    out = tmp_path / "out"
    args = ["--format", "jpg", "--shard-size", "2", "--no-progress"]
    cli(
        "data", "convert", "--order", "source", f"ade20k:{root.parent}", str(out), *args
    )  # DIR: the folder holding the set
    manifest, samples = samples_of(out, "train")
    assert [s["__key__"] for s in samples] == [f"ade20k-train-{i:08d}" for i in range(3)]
    stems = [f"ADE_train_0000000{i}" for i in (1, 2, 3)]
    expected_pixels = {}
    for sample, stem in zip(samples, stems):
        data, annotation = truth[stem]
        assert sample["jpg"] == data and "cls" not in sample  # the JPEG as it was; no image label
        mask = pixels(sample["seg.png"])
        assert Image.open(io.BytesIO(sample["seg.png"])).mode == "L"
        # mmseg's reduce_zero_label: 0 ("other") -> 255, k -> k - 1
        expected = np.select([annotation == 0], [255], annotation.astype(np.int64) - 1).astype(np.uint8)
        assert np.array_equal(mask, expected), stem
        for value, count in zip(*np.unique(mask, return_counts=True)):
            expected_pixels[str(value)] = expected_pixels.get(str(value), 0) + int(count)
    assert manifest["masks"] is True and manifest["ignore_index"] == 255
    assert manifest["num_classes"] == 150
    assert manifest["class_names"][:4] == ["wall", "building", "sky", "floor"]  # the first synonyms
    assert manifest["class_names"][149] == "thing150" and manifest["class_counts"] == {"-1": 3}
    assert manifest["mask_pixels"] == dict(sorted(expected_pixels.items(), key=lambda kv: int(kv[0])))
    assert set(manifest["mask_pixels"]) == {"0", "1", "4", "149", "255"}

    convert(f"ade20k:{root}", out, split="val", progress=False, order="source")  # DIR the folder itself; val
    manifest, (sample,) = samples_of(out, "val")
    assert sample["__key__"] == "ade20k-val-00000000" and manifest["num_samples"] == 1
    assert np.array_equal(pixels(sample["png"]), pixels(truth["ADE_val_00000001"][0]))  # decoded, as PNG
    proc = cli("data", "inspect", str(out / "train-{000000..000001}.tar"), str(out / "val-000000.tar"))
    assert "4 of them with a mask (seg.png), 4 classes in the masks" in proc.stdout


def test_ade20k_class_names_from_the_csv_or_numbers(ade):
    root, _ = ade
    (root / "objectInfo150.txt").unlink()
    assert open_source(f"ade20k:{root}", "train").class_names == [str(c) for c in range(150)]
    rows = ["Idx,Ratio,Train,Val,Stuff,Name"] + [
        f"{c},0.01,10,1,0,{n.replace(', ', ';')}" for c, n in enumerate(ADE_NAMES, 1)
    ]
    (root / "objectInfo150.csv").write_text("\n".join(rows) + "\n")  # the CSAIL repository's table
    assert open_source(f"ade20k:{root}", "train").class_names[:3] == ["wall", "building", "sky"]


def test_masks_that_do_not_fit_are_skipped_and_counted_and_max_side_shrinks_them(cli, ade, tmp_path):
    root, _ = ade
    save(np.ones((10, 12), np.uint8), root / "annotations/training/ADE_train_00000002.png")  # half size
    save(np.full((20, 24), 200, np.uint8), root / "annotations/training/ADE_train_00000003.png")  # 199
    proc = cli(
        "data",
        "convert",
        "--order",
        "source",
        f"ade20k:{root}",
        str(tmp_path / "out"),
        "--max-side",
        "12",
        "--no-progress",
    )
    assert "wrote 1 samples (2 unreadable skipped)" in proc.stdout
    warnings = proc.stderr.splitlines()
    assert any("ADE_train_00000002.png is 12x10 pixels, its image 24x20" in line for line in warnings)
    assert any("ADE_train_00000003.png holds class 199, beyond num_classes 150" in line for line in warnings)
    manifest, (sample,) = samples_of(tmp_path / "out", "train")
    assert manifest["skipped"] == 2 and manifest["image_size"] == [10, 12]
    mask = pixels(sample["seg.png"])  # shrunk with its image, NEAREST: only values the original had
    assert mask.shape == (10, 12) and set(np.unique(mask)) <= {255, 0, 1, 4, 149}


@pytest.fixture
def voc(tmp_path) -> tuple[Path, dict]:
    """VOCdevkit/VOC2012 with train (2 images) and val (1) lists, palette masks with 255 borders."""
    root = tmp_path / "VOCdevkit" / "VOC2012"
    rng = np.random.default_rng(1)
    palette = list(rng.integers(0, 256, 768, dtype=np.uint8))
    truth = {}
    save(np.zeros((2, 2), np.uint8), root / "SegmentationClass" / "x.png")  # a file no list names
    for name in ("2007_000032", "2007_000039", "2008_000002"):
        save(rng.integers(0, 256, (18, 22, 3), dtype=np.uint8), root / "JPEGImages" / f"{name}.jpg")
        indices = rng.choice(np.array([0, 1, 15, 20], dtype=np.uint8), (18, 22))
        indices[:, 10] = 255  # an object border
        mask = Image.fromarray(indices, mode="P")
        mask.putpalette(palette)
        mask.save(root / "SegmentationClass" / f"{name}.png")
        truth[name] = indices
    lists = root / "ImageSets" / "Segmentation"
    lists.mkdir(parents=True)
    (lists / "train.txt").write_text("2007_000032\n2008_000002\n")
    (lists / "val.txt").write_text("2007_000039\n")
    return root, truth


def test_voc_keeps_the_palette_indices_and_the_255_border(cli, voc, tmp_path):
    root, truth = voc
    assert Image.open(root / "SegmentationClass/2007_000032.png").mode == "P"
    cli(
        "data", "convert", "--order", "source", f"voc:{root.parent}", str(tmp_path / "out"), "--no-progress"
    )  # DIR = VOCdevkit
    manifest, samples = samples_of(tmp_path / "out", "train")
    assert [s["__key__"] for s in samples] == ["voc-train-00000000", "voc-train-00000001"]
    for sample, name in zip(samples, ("2007_000032", "2008_000002")):
        assert np.array_equal(pixels(sample["seg.png"]), truth[name])  # indices as they were, 255 kept
        assert np.array_equal(
            pixels(sample["png"]), pixels((root / "JPEGImages" / f"{name}.jpg").read_bytes())
        )
    assert manifest["num_classes"] == 21 and manifest["class_names"][:3] == [
        "background",
        "aeroplane",
        "bicycle",
    ]
    assert manifest["class_names"][20] == "tvmonitor" and manifest["masks"] is True
    assert manifest["mask_pixels"]["255"] == 2 * 18
    convert(f"voc:{root}", tmp_path / "out", split="val", progress=False, order="source")  # DIR = VOC2012
    _, (sample,) = samples_of(tmp_path / "out", "val")
    assert np.array_equal(pixels(sample["seg.png"]), truth["2007_000039"])


def tile_shards(root: Path, images: np.ndarray, labels: np.ndarray, cli) -> str:
    names = np.array(["t-shirt", "trouser", "pullover"])
    np.savez(root / "tiles.npz", images=images, labels=labels, class_names=names)
    cli(
        "data",
        "convert",
        "--order",
        "source",
        f"npz:{root / 'tiles.npz'}",
        str(root / "tiles"),
        "--shard-size",
        "6",
        "--no-progress",
    )
    return str(root / "tiles/train-{000000..000001}.tar")


def test_mosaic_tiles_row_by_row_with_their_classes_and_a_background(cli, tmp_path):
    """11 grey 6x6 tiles, --grid 2: two 12x12 mosaics of tiles 0-3 and 4-7, the last 3 left out;
    the mask is each tile's class, and the background class (3) where the grey level is below 60."""
    rng = np.random.default_rng(2)
    tiles = rng.integers(0, 256, (11, 6, 6), dtype=np.uint8)
    labels = np.array([0, 1, 2, 0, 2, 2, 1, 0, 1, 1, 0])
    urls = tile_shards(tmp_path, tiles, labels, cli)
    proc = cli(
        "data", "convert", "--order", "source", f"mosaic:{urls}", str(tmp_path / "out"), "--grid", "2",
        "--background-threshold", "60", "--no-progress",
    )  # fmt: skip
    assert "the last 3 tiles do not fill a 2x2 grid and are left out" in proc.stderr
    manifest, samples = samples_of(tmp_path / "out", "train")
    assert len(samples) == 2 and manifest["image_size"] == [12, 12]
    for sample, first in zip(samples, (0, 4)):
        image, mask = pixels(sample["png"]), pixels(sample["seg.png"])
        assert image.ndim == 2  # grey tiles make a grey mosaic
        for i in range(4):
            rows, cols = slice(i // 2 * 6, i // 2 * 6 + 6), slice(i % 2 * 6, i % 2 * 6 + 6)
            tile = tiles[first + i]
            assert np.array_equal(image[rows, cols], tile)
            assert np.array_equal(mask[rows, cols], np.where(tile < 60, 3, labels[first + i]))
    assert manifest["class_names"] == ["t-shirt", "trouser", "pullover", "background"]
    assert manifest["num_classes"] == 4 and manifest["masks"] is True
    assert manifest["mosaic"] == {"grid": 2, "background_threshold": 60, "remainder": 3}
    assert sum(manifest["mask_pixels"].values()) == 2 * 144


def test_mosaic_grey_level_is_the_brightest_channel_and_conversions_resume(cli, tmp_path):
    """RGB tiles: a dark pure red (200, 0, 0; mean 67) is object, not background, at threshold 100.
    A conversion killed after its first shard continues to the same bytes; another threshold starts over."""
    tiles = np.zeros((8, 4, 4, 3), dtype=np.uint8)
    tiles[:, :2, :, 0] = 200  # top half dark red, bottom half black
    urls = tile_shards(tmp_path, tiles, np.arange(8) % 3, cli)
    args = ["--grid", "1", "--background-threshold", "100", "--shard-size", "3"]
    cli(
        "data",
        "convert",
        "--order",
        "source",
        f"mosaic:{urls}",
        str(tmp_path / "whole"),
        *args,
        "--no-progress",
    )
    manifest, samples = samples_of(tmp_path / "whole", "train")
    for i, sample in enumerate(samples):
        assert pixels(sample["png"]).shape == (4, 4, 3)
        assert np.array_equal(
            pixels(sample["seg.png"]), np.repeat([[i % 3], [3]], 2, axis=0).repeat(4, axis=1)
        )
    assert manifest["mosaic"]["remainder"] == 0 and manifest["num_samples"] == 8

    convert_killed(2, f"mosaic:{urls}", str(tmp_path / "out"), *args)
    shutil.copytree(tmp_path / "out", tmp_path / "other")  # the same interrupted conversion, twice
    proc = cli(
        "data",
        "convert",
        "--order",
        "source",
        f"mosaic:{urls}",
        str(tmp_path / "out"),
        *args,
        "--no-progress",
    )
    assert "continuing the interrupted conversion after its 1 finished shards" in proc.stderr
    assert files(tmp_path / "out") == files(tmp_path / "whole")  # manifest and masks included
    args[3] = "50"  # the same records, other masks: the finished shard is of no use
    proc = cli(
        "data",
        "convert",
        "--order",
        "source",
        f"mosaic:{urls}",
        str(tmp_path / "other"),
        *args,
        "--no-progress",
    )
    assert "interrupted conversion with other background_threshold is discarded" in proc.stderr


def break_ade(root: Path) -> str:
    (root / "annotations/training/ADE_train_00000002.png").unlink()
    return str(root / "annotations/training/ADE_train_00000002.png")


def break_voc_list(root: Path) -> str:
    (root / "ImageSets/Segmentation/train.txt").write_bytes(b"2007_000032\n\xff\xfe\x00garbage\n")
    return str(root / "ImageSets/Segmentation/train.txt")


@pytest.mark.parametrize(
    "case",
    ["ade-no-folder", "ade-missing-annotation", "ade-bad-class-table", "voc-missing-list",
     "voc-unreadable-list", "voc-missing-mask", "grid-elsewhere", "threshold-elsewhere",
     "mosaic-without-grid", "mosaic-without-names"],
)  # fmt: skip
def test_bad_inputs_are_one_line_and_write_nothing(cli, ade, voc, tmp_path, case):
    ade_root, _ = ade
    voc_root, _ = voc
    extra = []
    if case == "ade-no-folder":
        (ade_root / "annotations/training").rename(ade_root / "annotations/elsewhere")
        source, words = f"ade20k:{ade_root}", [f"no folder {ade_root}/annotations/training", "extract"]
    elif case == "ade-missing-annotation":
        source, words = f"ade20k:{ade_root}", [break_ade(ade_root), "missing", "ADE_train_00000002.jpg"]
    elif case == "ade-bad-class-table":
        (ade_root / "objectInfo150.txt").write_text("Idx\tRatio\tTrain\tVal\tName\n1\t0.1\t1\t1\twall\n")
        source, words = f"ade20k:{ade_root}", ["objectInfo150.txt: expected a name for each", "remove it"]
    elif case == "voc-missing-list":
        source, words = f"voc:{voc_root}", ["no split list", "test.txt", "the lists there are train, val"]
        extra = ["--split", "test"]
    elif case == "voc-unreadable-list":
        source, words = f"voc:{voc_root}", [break_voc_list(voc_root), "cannot be read", "restore it"]
    elif case == "voc-missing-mask":
        (voc_root / "SegmentationClass/2008_000002.png").unlink()
        source, words = (
            f"voc:{voc_root}",
            ["SegmentationClass/2008_000002.png: missing, listed in", "train.txt"],
        )
    elif case == "grid-elsewhere":
        source, words, extra = (
            f"voc:{voc_root}",
            ["--grid: only for the mosaic:URLS source", "leave it out"],
            ["--grid", "2"],
        )
    elif case == "threshold-elsewhere":
        source, words = "synthetic:4", ["--background-threshold: only for the mosaic:URLS source"]
        extra = ["--background-threshold", "9"]
    elif case == "mosaic-without-grid":
        convert("synthetic:4", tmp_path / "tiles", progress=False, order="source")
        source, words = f"mosaic:{tmp_path}/tiles/train-000000.tar", ["needs --grid K"]
    else:
        convert("synthetic:4", tmp_path / "tiles", progress=False, order="source")
        (tmp_path / "tiles/train.json").unlink()
        source = f"mosaic:{tmp_path}/tiles/train-000000.tar"
        words, extra = [f"{tmp_path}/tiles/train.json is missing", "ssl-vit data convert"], ["--grid", "2"]
    proc = cli(
        "data",
        "convert",
        "--order",
        "source",
        source,
        str(tmp_path / "out"),
        *extra,
        "--no-progress",
        check=False,
    )
    assert_one_line_error(proc, *words)
    assert not (tmp_path / "out").exists()
