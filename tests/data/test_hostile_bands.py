"""Mistaken and hostile input to the multi-band sources and commands, through the CLI: a `labels.csv`
with a byte-order mark, rows naming files outside its folder or twice, labels that are no class
index; EuroSAT split lists naming a file twice or nothing; a parquet file with two columns of one
name; `data inspect --stats` on a folder it cannot write or shards without a manifest; `mean: auto` on
shards of another band count than `channels`; 16-bit PNGs given to 8-bit sources. Each is read as
meant, skipped and counted, or refused in one line with nothing written; `labels.csv` content is
generated too (hypothesis)."""

import io
import json
import string
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from bands_helpers import fake_eurosat, png16, write_tiff
from cli_helpers import LIMITED, billion_laughs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
from test_errors import error_line

from ssl_vit.data.convert import tiff
from ssl_vit.errors import UserError

ROOT = Path(__file__).resolve().parents[2]


def tiff_folder(root, names=("a.tif", "b.tif")):
    rng = np.random.default_rng(0)
    for name in names:
        write_tiff(root / name, rng.integers(0, 60000, (8, 8, 4), dtype=np.uint16))
    return root


def convert(cli, source: str, out, *extra: str, check: bool = True, prelude: str = ""):
    return cli("data", "convert", source, str(out), "--no-progress", *extra, check=check, prelude=prelude)


def test_a_labels_csv_saved_by_excel_with_a_byte_order_mark_is_read(cli, tmp_path):
    root = tiff_folder(tmp_path / "tifs")
    (root / "labels.csv").write_bytes(b"\xef\xbb\xbffilename,label\r\na.tif,water\r\nb.tif,sand\r\n")
    convert(cli, f"tiff:{root}", tmp_path / "out")
    manifest = json.loads((tmp_path / "out" / "train.json").read_text())
    assert manifest["num_samples"] == 2 and manifest["class_names"] == ["sand", "water"]


@pytest.mark.parametrize(
    "rows, words",
    [
        ("../outside.tif,x\nb.tif,y\n", ["labels.csv:2: '../outside.tif' is outside", "relative to it"]),
        ("{outside},x\nb.tif,y\n", ["labels.csv:2: '{outside}' is outside", "relative to it"]),
        ("a.tif,x\nb.tif,y\n./a.tif,y\n", ["labels.csv:4: './a.tif' names 'a.tif' again (first on line 2)"]),
        ("a.tif,99999999999999\nb.tif,1\n", ["label '99999999999999' is not a class index in 0..999,999"]),
        ("a.tif," + "9" * 5000 + "\nb.tif,1\n", ["label '9999", "... is not a class index in 0..999,999"]),
        ("a.tif,-2\nb.tif,1\n", ["label '-2' is not a class index"]),
    ],
)
def test_labels_csv_rows_outside_the_folder_twice_or_beyond_every_class_are_one_line(
    cli, tmp_path, rows, words
):
    """Before: `../x.tif` and absolute paths were read from outside DIR, a file named twice became two
    samples, and a label of 10^14 built 10^14 class names (the process was killed for memory)."""
    tiff_folder(tmp_path, ["outside.tif"])
    root = tiff_folder(tmp_path / "tifs")
    outside = str(tmp_path / "outside.tif")
    (root / "labels.csv").write_text("filename,label\n" + rows.replace("{outside}", outside))
    proc = convert(cli, f"tiff:{root}", tmp_path / "out", check=False, prelude=LIMITED)
    error_line(proc, *[w.replace("{outside}", outside) for w in words])
    assert not (tmp_path / "out").exists()


def test_labels_that_look_like_numbers_but_are_not_are_class_names(cli, tmp_path):
    """Before: `str.isdigit` took "²" and `lstrip("-")` took "--1" for integers, and `int` raised. `-1`
    stays unlabelled beside class names."""
    root = tiff_folder(tmp_path / "tifs", ["a.tif", "b.tif", "c.tif"])
    (root / "labels.csv").write_text("filename,label\na.tif,--1\nb.tif,²\nc.tif,-1\n", encoding="utf-8")
    convert(cli, f"tiff:{root}", tmp_path / "out")
    manifest = json.loads((tmp_path / "out" / "train.json").read_text())
    assert manifest["class_names"] == ["--1", "²"] and manifest["num_samples"] == 3
    assert manifest["class_counts"]["-1"] == 1


# Integers up to a few million only: the reader must refuse those of 1,000,000 and more, and one that did
# not would build that many class names in the test's own process. Larger ones go through the CLI above,
# under a memory limit.
LABELS = st.one_of(
    st.integers(-3, 3 * 10**6).map(str),
    st.text(string.digits + "-+ ²٣", max_size=6),
    st.text(max_size=6),
)


NAMES = st.sampled_from(["a.tif", "b.tif", "./b.tif", "../a.tif", "/a.tif", "", "x", "a\n.tif"])


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rows=st.lists(st.tuples(NAMES, LABELS), max_size=5),
    bom=st.booleans(),
)
def test_any_labels_csv_is_read_or_refused_in_one_line(tmp_path_factory, rows, bom):
    """Generated rows: names inside, outside, missing, repeated; labels of any text or size. The
    reader returns one index per row, each below its class names' count, or raises a UserError of one
    line; never another exception."""
    root = tmp_path_factory.getbasetemp() / "csv" / "tifs"
    if not root.exists():
        tiff_folder(root)
    lines = ["filename,label"] + [f'"{name}","{label.replace(chr(34), "")}"' for name, label in rows]
    (root / "labels.csv").write_text(("\ufeff" if bom else "") + "\n".join(lines) + "\n", encoding="utf-8")
    try:
        class_names, labelled = tiff._from_csv(root)
    except UserError as err:
        assert "\n" not in str(err) and "\r" not in str(err).strip()
        return
    assert len(labelled) == len(rows) and len(class_names) <= 10**6
    assert all(-1 <= label < len(class_names) for _, label in labelled)
    assert all(path.resolve().is_relative_to(root.resolve()) for path, _ in labelled)


def test_eurosat_split_lists_naming_a_file_twice_or_none_are_one_line(cli, tmp_path):
    root = tmp_path / "eurosat"
    fake_eurosat(root, per_class=1)
    (root / "eurosat-train.txt").write_text("Forest_1.jpg\nRiver_1.jpg\nForest_1.jpg\n")
    proc = convert(cli, f"eurosat:{root}", tmp_path / "out", "--split", "train", check=False)
    error_line(proc, "eurosat-train.txt: names Forest_1.jpg twice", "name each file once")
    (root / "eurosat-train.txt").write_text("\n")
    proc = convert(cli, f"eurosat:{root}", tmp_path / "out", "--split", "train", check=False)
    error_line(proc, "no TIFF files for split 'train'", "name them in", "eurosat-train.txt")
    proc = convert(cli, f"eurosat:{root}", tmp_path / "out", "--split", "val", check=False)
    error_line(proc, "no TIFF files for split 'val'", "give each class folder at least 4 files")
    assert not (tmp_path / "out").exists()


def test_a_parquet_file_with_two_columns_of_one_name_is_one_line(cli, tmp_path):
    """Before: pyarrow's `Schema.field` raised KeyError for the name, a traceback."""
    path = tmp_path / "snap" / "data" / "train-00000-of-00001.parquet"
    path.parent.mkdir(parents=True)
    table = pa.Table.from_arrays(
        [pa.array([b"x", b"y"]), pa.array([0, 1]), pa.array([1, 0])], names=["image", "label", "label"]
    )
    pq.write_table(table, path)
    proc = convert(cli, f"hf:{tmp_path / 'snap'}", tmp_path / "out", "--image-column", "image",
                   "--label-column", "label", check=False)  # fmt: skip
    error_line(proc, "2 columns are named 'label'", "--label-column", "distinct column names")
    assert not (tmp_path / "out").exists()


# The folder refuses writes as a read-only mount would (the tests may run as root, whom a chmod does not
# stop): opening a file in it for writing, or renaming one into it, fails with EACCES.
READ_ONLY = """
import builtins, io, os
folder = {folder!r}
def _inside(path):
    return os.path.dirname(os.path.abspath(path)) == folder
def _refuse(path):
    raise PermissionError(13, "Permission denied", path)
_os_open, _open, _replace = os.open, builtins.open, os.replace
def os_open(path, flags, *args, **kwargs):
    writes = flags & (os.O_CREAT | os.O_WRONLY | os.O_RDWR)
    return _refuse(path) if writes and _inside(path) else _os_open(path, flags, *args, **kwargs)
def open_(file, mode="r", *args, **kwargs):
    writes = isinstance(file, (str, os.PathLike)) and set(mode) & set("wax+")
    return _refuse(file) if writes and _inside(file) else _open(file, mode, *args, **kwargs)
def replace(src, dst, *args, **kwargs):
    return _refuse(dst) if _inside(dst) else _replace(src, dst, *args, **kwargs)
os.open, builtins.open, io.open, os.replace = os_open, open_, open_, replace
"""


def test_inspect_stats_on_a_folder_it_cannot_write_is_one_line_giving_the_stats(cli, tmp_path):
    """Before: the temporary manifest's write raised PermissionError, a traceback, and the pass over
    the images was lost."""
    root = tiff_folder(tmp_path / "tifs")
    convert(cli, f"tiff:{root}", tmp_path / "out")
    manifest_path = tmp_path / "out" / "train.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["band_stats"]
    manifest_path.write_text(json.dumps(manifest))
    before = sorted(p.name for p in (tmp_path / "out").iterdir())
    shard = str(tmp_path / "out" / "train-000000.tar")
    proc = cli("data", "inspect", "--stats", shard, check=False,
               prelude=READ_ONLY.format(folder=str(tmp_path / "out")))  # fmt: skip
    line = error_line(
        proc, "train.json: band_stats cannot be added (Permission denied)", "a folder you can write"
    )
    stats = json.loads(line.split("band_stats over 2 images: ", 1)[1])
    assert len(stats["mean"]) == 4 and stats["images"] == 2
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == before
    assert json.loads(manifest_path.read_text()) == manifest


def test_inspect_stats_says_why_it_added_nothing(cli, tmp_path):
    """Before: shards without a manifest (or whose manifest has band_stats) gave no word about --stats."""
    root = tiff_folder(tmp_path / "tifs")
    convert(cli, f"tiff:{root}", tmp_path / "out")
    (tmp_path / "out" / "train.json").unlink()
    proc = cli("data", "inspect", "--stats", str(tmp_path / "out" / "train-000000.tar"))
    assert "--stats: nothing written" in proc.stdout and "no manifest beside them" in proc.stdout


def test_auto_mean_of_shards_of_another_band_count_names_the_channels_to_set(cli, tmp_path):
    """Before: `mean has 4 values for channels 3: give one per band ..., or 'auto'`, to a user who gave
    'auto' and whose mistake is channels."""
    root = tiff_folder(tmp_path / "tifs")
    convert(cli, f"tiff:{root}", tmp_path / "out")
    proc = cli(
        "fit", "--config", str(ROOT / "recipes/quickstart/supervised.yaml"),
        "--data.init_args.train_urls", str(tmp_path / "out" / "train-000000.tar"),
        "--data.init_args.val_urls", "null", "--data.init_args.mean", "auto", "--data.init_args.std", "auto",
        "--trainer.default_root_dir", str(tmp_path / "run"), cwd=ROOT, check=False,
    )  # fmt: skip
    error_line(
        proc, "mean 'auto': the manifest's band_stats are of 4 bands", "channels is 3", "set channels to 4"
    )
    assert not (tmp_path / "run").exists()


def test_16_bit_pngs_of_8_bit_sources_are_stored_exactly_or_skipped_never_clipped(cli, tmp_path):
    """imagefolder: and hf: store L or RGB. Before: a 16-bit PNG's 300 was stored as 255 without a word
    (PIL's convert clips); now one whose values fit in 0..255 is stored exactly, another is skipped and
    counted, naming tiff:."""
    root = tmp_path / "pngs" / "class"
    root.mkdir(parents=True)
    (root / "fits.png").write_bytes(png16(np.arange(64, dtype=np.uint16).reshape(8, 8) * 4))
    (root / "wide.png").write_bytes(png16(np.full((8, 8), 300, dtype=np.uint16)))
    proc = convert(cli, f"imagefolder:{tmp_path / 'pngs'}", tmp_path / "out", "--format", "png")
    manifest = json.loads((tmp_path / "out" / "train.json").read_text())
    assert manifest["num_samples"] == 1 and manifest["skipped"] == 1
    assert "wide.png: I;16 image with values in 300..300, which 8-bit storage would clip" in proc.stderr
    assert "convert them with tiff:DIR" in proc.stderr
    with tarfile.open(tmp_path / "out" / "train-000000.tar") as tar:
        (member,) = [m for m in tar.getmembers() if m.name.endswith(".png")]
        stored = np.asarray(Image.open(io.BytesIO(tar.extractfile(member).read())))
    assert stored.dtype == np.uint8 and np.array_equal(stored, np.arange(64).reshape(8, 8) * 4)


def test_a_readme_whose_yaml_aliases_make_billions_of_items_is_one_line(cli, tmp_path):
    """Before: the message quoted `data_files!r:.80`, whose full repr (9^9 strings, from 600 bytes of
    YAML aliases) took all the memory there was."""
    snap = tmp_path / "snap"
    path = snap / "data" / "train-00000-of-00001.parquet"
    path.parent.mkdir(parents=True)
    pq.write_table(pa.table({"image": [b"x"], "label": [0]}), path)
    config = ["configs:", "- config_name: default", "  data_files: [*a8]"]
    card = "\n".join(["---", *billion_laughs(), *config, "---"])
    (snap / "README.md").write_text(card + "\n")
    proc = convert(cli, f"hf:{snap}", tmp_path / "out", check=False, prelude=LIMITED)
    error_line(proc, "README.md: data_files [[[[...]", "is not a glob", "fix it or download it again")
    assert not (tmp_path / "out").exists()
