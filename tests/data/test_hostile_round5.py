"""The fifth round's hostile data, through the CLI: `labels.csv` ambiguities, NaN in a float member,
members without a sample key, and option groups given as mappings from Python."""

import io
import json
import tarfile

import numpy as np
import pytest
import webdataset as wds
from bands_helpers import write_tiff
from PIL import Image
from test_errors import error_line

from ssl_vit.data import ShardDataModule
from ssl_vit.errors import UserError


def tiffs(root, names):
    rng = np.random.default_rng(0)
    for name in names:
        write_tiff(root / name, rng.integers(0, 60000, (8, 8, 4), dtype=np.uint16))
    return root


def convert(cli, root, out, check=True):
    return cli("data", "convert", f"tiff:{root}", str(out), "--order", "source", "--no-progress", check=check)


def test_a_labels_csv_naming_a_column_twice_is_one_line(cli, tmp_path):
    """Before: the last `label` column was used without a word (`hf:` refuses the same ambiguity)."""
    root = tiffs(tmp_path / "tifs", ["a.tif", "b.tif"])
    (root / "labels.csv").write_text("filename,label,label\na.tif,x,y\nb.tif,y,x\n")
    proc = convert(cli, root, tmp_path / "out", check=False)
    error_line(proc, "labels.csv: the header names the column 'label' twice: keep one")
    assert not (tmp_path / "out").exists()


def test_minus_one_is_unlabelled_beside_names_and_signed_or_padded_integers_are_classes(cli, tmp_path):
    """Before: `-1` beside class names became a class called "-1" (data/README.md: -1 is unlabelled),
    and `+1` or `007` made the whole file class names."""
    root = tiffs(tmp_path / "names", ["a.tif", "b.tif", "c.tif"])
    (root / "labels.csv").write_text("filename,label\na.tif,water\nb.tif,-1\nc.tif,sand\n")
    convert(cli, root, tmp_path / "out1")
    manifest = json.loads((tmp_path / "out1" / "train.json").read_text())
    assert manifest["class_names"] == ["sand", "water"] and manifest["class_counts"] == {
        "-1": 1,
        "0": 1,
        "1": 1,
    }
    root = tiffs(tmp_path / "numbers", ["a.tif", "b.tif", "c.tif"])
    (root / "labels.csv").write_text("filename,label\na.tif,+1\nb.tif,007\nc.tif,0\n")
    convert(cli, root, tmp_path / "out2")
    manifest = json.loads((tmp_path / "out2" / "train.json").read_text())
    assert manifest["class_names"] == [str(c) for c in range(8)]
    assert manifest["class_counts"] == {"0": 1, "1": 1, "7": 1}


def npy(array) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def test_nan_in_a_float_member_is_a_bad_sample_for_inspect_and_training(cli, tmp_path):
    """Before: `inspect --stats` wrote NaN band statistics, and training read the NaN image."""
    rng = np.random.default_rng(0)
    with wds.TarWriter(str(tmp_path / "train-000000.tar")) as sink:
        for i in range(4):
            array = rng.normal(size=(8, 8, 2)).astype(np.float32)
            if i == 2:
                array[3, 3, 1] = np.nan
            sink.write({"__key__": f"s{i}", "npy": npy(array), "cls": "0"})
    proc = cli("data", "inspect", str(tmp_path / "train-000000.tar"), check=False)
    assert proc.returncode == 1 and "s2" in proc.stdout and "holds NaN or infinite values" in proc.stdout
    assert "3 good samples" in proc.stdout
    dm = ShardDataModule(val_urls=str(tmp_path / "train-000000.tar"), channels=2, mean=(0.0, 0.0),
                         std=(1.0, 1.0), image_size=8, num_workers=0, batch_size=8)  # fmt: skip
    dm.setup("validate")
    (batch,) = list(dm.exact_dataloader("val"))
    assert batch["key"] == ["s0", "s1", "s3"] and int(batch["skipped"]) == 1
    assert torch_finite(batch["image"])


def torch_finite(images) -> bool:
    return bool(np.isfinite(images.numpy()).all())


def test_members_without_a_sample_key_are_counted_not_lost(cli, tmp_path):
    """Before: members named `..\\..\\w.png` or `.hidden.png` vanished without a count."""
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, format="PNG")
    with tarfile.open(tmp_path / "x-000000.tar", "w") as archive:
        for key in ("good", "..\\..\\w", ".hidden"):
            for ext, data in (("png", buf.getvalue()), ("cls", b"1")):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
    proc = cli("data", "inspect", str(tmp_path / "x-000000.tar"), check=False)
    assert proc.returncode == 1 and "1 good samples" in proc.stdout, proc.stdout
    assert proc.stdout.count("has no sample key") == 2  # one per sample, not per member


def test_option_groups_from_python_may_be_mappings(tmp_path):
    """Before: `ShardDataModule(stream={...})` failed later with an AttributeError."""
    dm = ShardDataModule(train_urls="x-{000000..000001}.tar", stream={"shuffle_buffer": 10},
                         augment={"crop_scale": [0.5, 1.0]}, limits={"read_retries": 1})  # fmt: skip
    assert (
        dm.stream.shuffle_buffer == 10 and dm.augment.crop_scale == (0.5, 1.0) and dm.limits.read_retries == 1
    )
    with pytest.raises(UserError, match="stream: .*unexpected keyword argument 'nosuch'"):
        ShardDataModule(stream={"nosuch": 1})


def test_a_band_first_stack_is_read_band_first_and_a_cube_is_refused_unless_told(cli, tmp_path):
    """Before: a 200-band 16 x 16 TIFF written band-first by tifffile (axes QYX) was stored as 16 bands of
    200 x 16 pixels, and a 32 x 32 x 32 cube read band-last, both without a word."""
    import tifffile

    rng = np.random.default_rng(0)
    stack = rng.integers(0, 60000, (200, 16, 16), dtype=np.uint16)  # bands first
    (tmp_path / "stack" / "a").mkdir(parents=True)
    tifffile.imwrite(tmp_path / "stack" / "a" / "x.tif", stack)
    convert(cli, tmp_path / "stack", tmp_path / "out1")
    manifest = json.loads((tmp_path / "out1" / "train.json").read_text())
    assert manifest["channels"] == 200 and manifest["image_size"] == [16, 16]
    sample = next(iter(wds.WebDataset(str(tmp_path / "out1" / "train-000000.tar"), shardshuffle=False)))
    assert np.array_equal(np.load(io.BytesIO(sample["npy"])), stack.transpose(1, 2, 0))

    cube = rng.integers(0, 60000, (32, 32, 32), dtype=np.uint16)
    (tmp_path / "cube" / "a").mkdir(parents=True)
    tifffile.imwrite(tmp_path / "cube" / "a" / "x.tif", cube)
    proc = convert(cli, tmp_path / "cube", tmp_path / "out2", check=False)
    error_line(proc, "does not say which axis holds its bands", "--band-axis first")
    assert not (tmp_path / "out2").exists()
    cli("data", "convert", f"tiff:{tmp_path / 'cube'}", str(tmp_path / "out3"), "--band-axis", "first",
        "--no-progress")  # fmt: skip
    sample = next(iter(wds.WebDataset(str(tmp_path / "out3" / "train-000000.tar"), shardshuffle=False)))
    assert np.array_equal(np.load(io.BytesIO(sample["npy"])), cube.transpose(1, 2, 0))
    cube_dir = f"tiff:{tmp_path / 'cube'}"
    proc = cli("data", "convert", cube_dir, str(tmp_path / "out4"), "--band-axis", "middle", check=False)
    error_line(proc, "--band-axis must be first or last")


def test_inspect_stats_reads_band_last_arrays_as_band_last(cli, tmp_path):
    """Before: band-last (8, 8, 13) npy members under a manifest without `channels` got channels 8 and
    the statistics of the wrong axis."""
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 1000, (8, 8, 13)).astype(np.uint16) for _ in range(3)]
    with wds.TarWriter(str(tmp_path / "train-000000.tar")) as sink:
        for i, array in enumerate(arrays):
            sink.write({"__key__": f"s{i}", "npy": npy(array), "cls": "0"})
    manifest = {"num_samples": 3, "num_classes": 1, "shards": [{"url": "train-000000.tar", "num_samples": 3}]}
    (tmp_path / "train.json").write_text(json.dumps(manifest))
    cli("data", "inspect", str(tmp_path / "train-000000.tar"), "--stats")
    written = json.loads((tmp_path / "train.json").read_text())
    assert written["channels"] == 13
    mean = np.stack(arrays).astype(np.float64).mean(axis=(0, 1, 2))
    assert written["band_stats"]["mean"] == pytest.approx(mean.tolist(), rel=1e-9)


def test_a_reshard_may_write_into_a_folder_beside_its_shards_but_not_over_them(cli, tmp_path):
    """Before: `data convert wds:D/x.tar D/out` was refused because D/out "lies inside the directory of
    the source's shards", although the output cannot be read back as the input."""
    rng = np.random.default_rng(0)
    with wds.TarWriter(str(tmp_path / "x-000000.tar")) as sink:
        for i in range(4):
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(buf, format="PNG")
            sink.write({"__key__": f"s{i}", "png": buf.getvalue(), "cls": "0"})
    source = f"wds:{tmp_path / 'x-000000.tar'}"
    cli("data", "convert", source, str(tmp_path / "out"), "--no-progress")
    assert json.loads((tmp_path / "out" / "train.json").read_text())["num_samples"] == 4
    before = (tmp_path / "x-000000.tar").read_bytes()
    proc = cli("data", "convert", source, str(tmp_path), "--no-progress", check=False)
    error_line(proc, f"OUTDIR {tmp_path} holds the source's shard {tmp_path / 'x-000000.tar'}")
    assert (tmp_path / "x-000000.tar").read_bytes() == before


def test_a_readme_glob_over_folders_linked_into_each_other_ends(cli, tmp_path):
    """Before: `data_files: "**/*.parquet"` over two folder links in a loop printed nothing and never
    ended (`glob.glob` follows links for `**`)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    snap = tmp_path / "snap"
    (snap / "data" / "a").mkdir(parents=True)
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, format="PNG")
    table = pa.table({"image": [{"bytes": buf.getvalue(), "path": None}] * 2, "label": [0, 1]})
    pq.write_table(table, snap / "data" / "train-00000-of-00001.parquet")
    (snap / "data" / "a" / "up").symlink_to("../..")
    (snap / "data" / "loop").symlink_to(".")
    (snap / "README.md").write_text(
        "---\nconfigs:\n- config_name: default\n  data_files:\n"
        '  - split: train\n    path: "**/*.parquet"\n---\n'
    )
    proc = cli("data", "convert", f"hf:{snap}", str(tmp_path / "out"), "--image-column", "image",
               "--label-column", "label", "--no-progress", timeout=120)  # fmt: skip
    assert proc.returncode == 0
    assert json.loads((tmp_path / "out" / "train.json").read_text())["num_samples"] == 2


def test_an_image_bomb_is_judged_from_its_header_and_never_decoded(cli, tmp_path):
    """Before: a 12,000 x 12,000 PNG of 270 KB in a parquet row was decoded in full (about 2.1 GB) and
    stored, where max_image_pixels judges it from its header."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    bomb, small = io.BytesIO(), io.BytesIO()
    Image.new("L", (12000, 12000)).save(bomb, format="PNG")
    Image.new("RGB", (8, 8)).save(small, format="PNG")
    snap = tmp_path / "snap" / "data"
    snap.mkdir(parents=True)
    rows = [{"bytes": small.getvalue(), "path": None}, {"bytes": bomb.getvalue(), "path": None}]
    pq.write_table(pa.table({"image": rows, "label": [0, 1]}), snap / "train-00000-of-00001.parquet")
    from cli_helpers import LIMITED

    proc = cli("data", "convert", f"hf:{tmp_path / 'snap'}", str(tmp_path / "out"), "--image-column", "image",
               "--label-column", "label", "--no-progress", prelude=LIMITED)  # fmt: skip
    assert "12000x12000 (144,000,000 pixels), more than max_image_pixels" in proc.stderr
    manifest = json.loads((tmp_path / "out" / "train.json").read_text())
    assert manifest["num_samples"] == 1 and manifest["skipped"] == 1
