"""`ssl-vit data convert tiff:DIR|eurosat:DIR` (any band count, 16-bit), the options that do not apply
to them, per-band statistics in every manifest, and `ssl-vit data inspect --stats` adding them where a
manifest has none."""

import json
import shutil

import numpy as np
import pytest
from bands_helpers import fake_eurosat, write_tiff
from test_errors import error_line

from ssl_vit.data.convert.eurosat import BAND_NAMES, CLASSES

pytest_plugins = ["server_helpers"]  # the `faulty_http` fixture


def convert(cli, source: str, out, *extra: str, split: str = "train") -> dict:
    cli("data", "convert", source, str(out), "--split", split, "--no-progress", *extra)
    return json.loads((out / f"{split}.json").read_text())


def test_tiff_class_folders_skip_and_count_a_file_of_another_layout(cli, tmp_path):
    rng = np.random.default_rng(0)
    for name, n in (("cloud", 3), ("field", 2)):
        for i in range(n):
            write_tiff(
                tmp_path / "tifs" / name / f"{i}.tif", rng.integers(-900, 900, (8, 8, 4), dtype=np.int16)
            )
    write_tiff(tmp_path / "tifs" / "field" / "odd.tif", rng.integers(0, 9, (8, 8, 3), dtype=np.int16))
    write_tiff(tmp_path / "tifs" / "loose.tiff", rng.integers(-5, 5, (8, 8, 4), dtype=np.int16))
    proc = cli("data", "convert", f"tiff:{tmp_path / 'tifs'}", str(tmp_path / "out"), "--no-progress")
    manifest = json.loads((tmp_path / "out" / "train.json").read_text())
    assert manifest["num_samples"] == 6 and manifest["skipped"] == 1
    assert manifest["class_names"] == ["cloud", "field"] and manifest["class_counts"] == {
        "-1": 1,
        "0": 3,
        "1": 2,
    }
    assert manifest["channels"] == 4 and manifest["dtype"] == "int16" and manifest["image_size"] == [8, 8]
    assert "odd.tif: 3 bands of int16, the split's are 4 of int16 (set by its first file" in proc.stderr


def test_tiff_with_a_labels_csv_of_names_or_indices(cli, tmp_path):
    rng = np.random.default_rng(1)
    for i in range(5):
        write_tiff(tmp_path / "flat" / f"img{i}.tif", rng.random((6, 6, 2), dtype=np.float32))
    write_tiff(tmp_path / "flat" / "unnamed.tif", rng.random((6, 6, 2), dtype=np.float32))
    (tmp_path / "flat" / "labels.csv").write_text(
        "filename,label\nimg0.tif,3\nimg1.tif,0\nimg2.tif,\nimg3.tif,1\n"
    )
    proc = cli("data", "convert", f"tiff:{tmp_path / 'flat'}", str(tmp_path / "a"), "--no-progress")
    manifest = json.loads((tmp_path / "a" / "train.json").read_text())
    assert manifest["num_samples"] == 4 and manifest["class_names"] == ["0", "1", "2", "3"]
    assert manifest["class_counts"] == {"-1": 1, "0": 1, "1": 1, "3": 1} and manifest["dtype"] == "float32"
    assert "2 TIFF files in" in proc.stderr and "are not named in labels.csv" in proc.stderr
    (tmp_path / "flat" / "labels.csv").write_text(
        "filename,label\nimg0.tif,water\nimg4.tif,sand\nimg1.tif,water\n"
    )
    named = convert(cli, f"tiff:{tmp_path / 'flat'}", tmp_path / "b")
    assert named["class_names"] == ["sand", "water"] and named["class_counts"] == {"0": 1, "1": 2}
    (tmp_path / "flat" / "labels.csv").write_text("filename,label\ngone.tif,water\n")
    proc = cli("data", "convert", f"tiff:{tmp_path / 'flat'}", str(tmp_path / "c"), check=False)
    error_line(proc, "labels.csv:2:", "'gone.tif' is not a TIFF file")
    assert not (tmp_path / "c").exists()


def test_eurosat_splits_by_seed_or_by_its_lists_with_band_names(cli, tmp_path):
    from ssl_vit.data.format.arrays import open_npy
    from ssl_vit.data.stream.pipeline import iter_samples

    fake_eurosat(tmp_path / "eurosat")
    counts = {}
    for split in ("train", "val", "test"):
        manifest = convert(cli, f"eurosat:{tmp_path / 'eurosat'}", tmp_path / "out", split=split)
        assert manifest["class_names"] == list(CLASSES) and manifest["band_names"] == list(BAND_NAMES)
        assert (
            manifest["channels"] == 13
            and manifest["dtype"] == "uint16"
            and manifest["image_size"] == [64, 64]
        )
        assert manifest["band_stats"]["min"][1:] == [1000.0 * k for k in range(1, 13)]
        counts[split] = manifest["class_counts"]
    assert counts == {"train": {str(c): 3 for c in range(10)}, "val": {str(c): 1 for c in range(10)},
                      "test": {str(c): 1 for c in range(10)}}  # fmt: skip
    seen = {}
    for split in ("train", "val", "test"):
        for sample in iter_samples([str(tmp_path / "out" / f"{split}-000000.tar")], lambda e: False):
            array = open_npy(sample["npy"]).read()
            label = int(sample["cls"])
            assert (array[1:, 1:, 5] == 5000 + label).all()  # band 5, the class's offset
            seen.setdefault(split, set()).add((label, int(array[0, 0, 0])))
    assert sum(map(len, seen.values())) == 50 and not seen["train"] & seen["val"]

    (tmp_path / "eurosat" / "eurosat-val.txt").write_text("Forest_2.jpg\nRiver_5.jpg\n")
    listed = convert(cli, f"eurosat:{tmp_path / 'eurosat'}", tmp_path / "listed", split="val")
    assert listed["num_samples"] == 2 and listed["class_counts"] == {"1": 1, "8": 1}
    (tmp_path / "eurosat" / "eurosat-test.txt").write_text("Forest_99.jpg\n")
    proc = cli("data", "convert", f"eurosat:{tmp_path / 'eurosat'}", str(tmp_path / "x"), "--split", "test",
               check=False)  # fmt: skip
    error_line(proc, "eurosat-test.txt: names 1 files not in the class folders, e.g. Forest_99.jpg")


@pytest.mark.parametrize(
    "extra, words",
    [
        (
            ["--max-side", "32"],
            ["--max-side: for 8-bit PNG/JPEG sources; tiff: stores its arrays losslessly"],
        ),
        (["--format", "jpg"], ["--format: for 8-bit PNG/JPEG sources"]),
        (["--quality", "80", "--format", "png"], ["--format, --quality: for 8-bit"]),
    ],
)
def test_rgb_options_are_refused_for_array_sources_in_one_line(cli, tmp_path, extra, words):
    write_tiff(tmp_path / "tifs" / "a" / "0.tif", np.zeros((4, 4, 2), np.uint16))
    proc = cli("data", "convert", f"tiff:{tmp_path / 'tifs'}", str(tmp_path / "out"), *extra, check=False)
    error_line(proc, *words)
    assert not (tmp_path / "out").exists()


def test_every_manifest_records_channels_dtype_and_exact_band_stats_and_inspect_adds_missing_ones(
    cli, tmp_path, digits_shards
):
    """The digits' manifest (RGB, 8-bit) records its stats in model units (/255) over every image; a
    copy without them gets them back from `data inspect --stats` over all its images, equal to
    convert's, and over a bounded sample spread across the shards."""
    manifest = json.loads((digits_shards / "train.json").read_text())
    stats = manifest["band_stats"]
    assert manifest["channels"] == 3 and manifest["dtype"] == "uint8" and stats["images"] == 1438
    assert all(0 <= low <= m <= high <= 1 for low, m, high in zip(stats["min"], stats["mean"], stats["max"]))
    copy = tmp_path / "copy"
    shutil.copytree(digits_shards, copy)
    for bound, images in (("5000", 1438), ("7", 7)):
        bare = {k: v for k, v in manifest.items() if k not in ("band_stats", "channels", "dtype")}
        (copy / "train.json").write_text(json.dumps(bare))
        proc = cli(
            "data", "inspect", str(copy / "train-{000000..000004}.tar"), "--stats", "--stats-images", bound
        )
        assert f"train.json: band_stats added, over {images} images (3 bands of uint8)" in proc.stdout
        added = json.loads((copy / "train.json").read_text())
        assert (
            added["channels"] == 3 and added["dtype"] == "uint8" and added["band_stats"]["images"] == images
        )
    full = json.loads((copy / "train.json").read_text())
    proc = cli("data", "inspect", str(copy / "train-{000000..000004}.tar"), "--stats")
    assert "band_stats added" not in proc.stdout  # it has them now
    (copy / "train.json").write_text(json.dumps({k: v for k, v in manifest.items() if k != "band_stats"}))
    cli("data", "inspect", str(copy / "train-{000000..000004}.tar"), "--stats")
    again = json.loads((copy / "train.json").read_text())["band_stats"]
    for key in ("mean", "std", "min", "max"):
        assert again[key] == pytest.approx(stats[key], rel=1e-9, abs=1e-12), key
    assert full["band_stats"]["images"] == 7


def test_inspect_stats_of_a_remote_manifest_are_printed_not_written(cli, tmp_path, faulty_http):
    rng = np.random.default_rng(2)
    for i in range(4):
        write_tiff(tmp_path / "tifs" / "a" / f"{i}.tif", rng.integers(0, 5000, (8, 8, 3), dtype=np.uint16))
    convert(cli, f"tiff:{tmp_path / 'tifs'}", faulty_http.root, "--shard-size", "2")
    manifest = json.loads((faulty_http.root / "train.json").read_text())
    bare = {k: v for k, v in manifest.items() if k != "band_stats"}
    (faulty_http.root / "train.json").write_text(json.dumps(bare))
    proc = cli("data", "inspect", f"{faulty_http.url}/train-{{000000..000001}}.tar", "--stats")
    line = next(line for line in proc.stdout.splitlines() if "band_stats" in line)
    assert line.startswith(
        f"{faulty_http.url}/train.json: a remote manifest, which this command cannot write"
    )
    assert json.loads(line.split(" images are ", 1)[1]) == manifest["band_stats"]
    assert json.loads((faulty_http.root / "train.json").read_text()) == bare


def test_inspect_names_every_hostile_array_member_and_mask_with_its_reason(cli, tmp_path):
    """A shard of members that lie in their headers, through `ssl-vit data inspect`: each a problem with
    its reason, exit 1, no traceback; the good one counted."""
    import io
    import struct

    import tifffile
    from bands_helpers import npy, png16, write_array_shard
    from PIL import Image

    good = np.zeros((8, 8, 3), np.uint8)
    tif = io.BytesIO()
    tifffile.imwrite(tif, np.zeros((8, 8, 4), np.uint16), photometric="minisblack", planarconfig="contig")
    header = repr({"descr": "<u2", "fortran_order": False, "shape": (30_000, 30_000, 4)}).encode()
    header += b" " * (63 - (len(header) + 10) % 64) + b"\n"
    huge_npy = b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header + bytes(64)
    big_mask = io.BytesIO()
    Image.new("L", (3000, 3000)).save(big_mask, format="PNG")
    samples = [
        {"__key__": "good", "npy": npy(good), "cls": "0"},
        {"__key__": "huge", "npy": huge_npy, "cls": "0"},
        {"__key__": "cut-header", "npy": huge_npy[:20], "cls": "0"},
        {"__key__": "cut-tif", "tif": tif.getvalue()[:60], "cls": "0"},
        {"__key__": "rgb48", "png": png16(np.zeros((4, 4, 3), np.uint16)), "cls": "0"},
        {"__key__": "big-mask", "npy": npy(good), "seg.png": big_mask.getvalue(), "cls": "0"},
    ]
    write_array_shard(tmp_path / "train-000000.tar", samples)
    proc = cli("data", "inspect", str(tmp_path / "train-000000.tar"), check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "1 good samples in 1 shards" in proc.stdout
    for key, reason in [
        ("huge", "npy body holds 64 bytes"),
        ("cut-header", "npy header does not parse"),
        ("cut-tif", "tif "),
        ("rgb48", "png is a 48-bit RGB PNG, which is not read"),
        ("big-mask", "seg.png is 3000x3000 pixels, its image 8x8"),
    ]:
        assert f"train-000000.tar: {key}: {reason}" in proc.stdout, (key, proc.stdout)
