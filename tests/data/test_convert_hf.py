"""`ssl-vit data convert hf:DIR` through the CLI, on Hub-style snapshots the tests write: parquet from the
`datasets` library itself (an Image feature of PNG bytes, a ClassLabel) and from plain pyarrow (a binary
column, an integer label, no `datasets` features: columns named with the flags); several files and row
groups per split; the README's `configs:` and subsets; the one-line refusals; a resumed conversion; and
hostile parquet content (hypothesis): each bad row skipped and counted, or one error line."""

import io
import json
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from cli_helpers import run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
from test_convert import read_back
from test_convert_reshard import convert_killed, files, samples
from test_remote_faults import one_line_failure

from ssl_vit.data.convert import hf
from ssl_vit.data.convert.encode import ImageBytes, encode_record
from ssl_vit.data.convert.hf import MAX_UNNAMED_LABEL
from ssl_vit.data.convert.payload import Encoded, EncodeOptions
from ssl_vit.errors import UserError

datasets.disable_progress_bars()
NAMES = ["cat", "dog", "owl"]


def encoded(rng, side: int, kind: str = "PNG") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (side, side + 2, 3), dtype=np.uint8)).save(buf, kind)
    return buf.getvalue()


def write_datasets(path: Path, images: list, labels: list, row_group: int, names=NAMES) -> None:
    """A parquet file as `datasets` writes it: an Image column ({bytes, path} structs), a ClassLabel."""
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=names)})
    rows = [None if b is None else {"bytes": b, "path": None} for b in images]
    path.parent.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_dict({"image": rows, "label": labels}, features=features).to_parquet(
        str(path), batch_size=row_group
    )


def convert(cli, source: str, out: Path, *args: str, check: bool = True):
    return cli("data", "convert", source, str(out), "--no-progress", *args, check=check)


def test_a_snapshot_written_by_datasets_converts_with_its_class_names(cli, tmp_path):
    """Two files of a train split in `data/` (row groups of 4), one of test: every decodable row in
    order, its PNG bytes kept, its label (null and -1: unlabelled); a null image and bytes that are no
    image skipped and counted, each named in a warning; the ClassLabel's names in the manifest."""
    rng = np.random.default_rng(0)
    snap = tmp_path / "snap"
    pngs = [encoded(rng, 8 + i % 9) for i in range(17)]
    images, labels = list(pngs), [i % 3 for i in range(17)]
    images[3], images[11] = None, b"\x89PNG\r\n\x1a\n but no image"
    labels[5], labels[12] = -1, None
    write_datasets(snap / "data/train-00000-of-00002.parquet", images[:9], labels[:9], row_group=4)
    write_datasets(snap / "data/train-00001-of-00002.parquet", images[9:], labels[9:], row_group=4)
    write_datasets(snap / "data/test-00000-of-00001.parquet", pngs[:5], [2, 1, 0, 1, 2], row_group=4)
    assert pq.ParquetFile(snap / "data/train-00000-of-00002.parquet").metadata.num_row_groups == 3

    proc = convert(cli, f"hf:{snap}", tmp_path / "out", "--shard-size", "6")
    kept = [i for i in range(17) if i not in (3, 11)]
    manifest = json.loads((tmp_path / "out/train.json").read_text())
    written = samples(tmp_path / "out")
    assert [s["__key__"] for s in written] == [f"hf-train-{i:08d}" for i in range(15)]
    assert [s["png"] for s in written] == [pngs[i] for i in kept]  # stored byte for byte
    expected = [-1 if labels[i] is None else labels[i] for i in kept]
    assert [int(s["cls"]) if "cls" in s else -1 for s in written] == expected
    assert manifest["class_names"] == NAMES and manifest["num_classes"] == 3
    assert manifest["num_samples"] == 15 and manifest["skipped"] == 2
    assert [s["num_samples"] for s in manifest["shards"]] == [6, 6, 3]
    assert manifest["class_counts"] == {str(k): n for k, n in sorted(Counter(expected).items())}
    assert manifest["hf"] == {
        "subset": "default", "image_column": "image", "label_column": "label",
        "files": ["data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet"],
    }  # fmt: skip
    assert "data/train-00000-of-00002.parquet row 3: no image bytes" in proc.stderr
    assert "data/train-00001-of-00002.parquet row 2" in proc.stderr  # the bytes that are no image

    convert(cli, f"hf:{snap}", tmp_path / "out", "--split", "test")
    test_manifest, test_samples = read_back(tmp_path / "out", "test")
    assert [label for _, _, label in test_samples] == [2, 1, 0, 1, 2]
    assert test_manifest["class_names"] == NAMES


def plain_table(rng, labels: list, offset: int = 0) -> pa.Table:
    """A table pyarrow writes with no `datasets` features: JPEG bytes, int16 labels, a caption."""
    jpegs = [encoded(rng, 12, "JPEG") for _ in labels]
    captions = [f"picture {offset + i}" for i in range(len(labels))]
    return pa.table(
        {"caption": captions, "jpeg": pa.array(jpegs, pa.binary()), "y": pa.array(labels, pa.int16())}
    )


def test_plain_pyarrow_parquet_with_its_columns_named(cli, tmp_path):
    """The Hub's parquet-conversion layout (SPLIT/0000.parquet) written by plain pyarrow: without
    `datasets` features the image column must be named; without --label-column the samples are
    unlabelled, with it their labels are the column's and the class names are numbers; JPEG bytes are
    kept with --format jpg."""
    rng = np.random.default_rng(1)
    snap = tmp_path / "snap"
    (snap / "train").mkdir(parents=True)
    (snap / "validation").mkdir()
    first, second = plain_table(rng, [0, 4, 1, 1, 2]), plain_table(rng, [3, -1, 0], offset=5)
    pq.write_table(first, snap / "train/0000.parquet", row_group_size=2)
    pq.write_table(second, snap / "train/0001.parquet", row_group_size=2)
    pq.write_table(plain_table(rng, [1, 2]), snap / "validation/0000.parquet")

    proc = convert(cli, f"hf:{snap}", tmp_path / "none", check=False)
    one_line_failure(proc, "train/0000.parquet: no column is marked as an image", "--image-column NAME",
                     "(columns: caption, jpeg, y)")  # fmt: skip
    assert not (tmp_path / "none").exists()

    proc = convert(cli, f"hf:{snap}", tmp_path / "unlabelled", "--image-column", "jpeg")
    assert "no label column" in proc.stderr and "--label-column NAME" in proc.stderr
    manifest = json.loads((tmp_path / "unlabelled/train.json").read_text())
    assert manifest["class_counts"] == {"-1": 8} and manifest["hf"]["label_column"] is None

    args = ["--image-column", "jpeg", "--label-column", "y", "--format", "jpg", "--shard-size", "3"]
    convert(cli, f"hf:{snap}", tmp_path / "out", *args)
    written = samples(tmp_path / "out")
    jpegs = first.column("jpeg").to_pylist() + second.column("jpeg").to_pylist()
    assert [s["jpg"] for s in written] == jpegs
    assert [int(s["cls"]) if "cls" in s else -1 for s in written] == [0, 4, 1, 1, 2, 3, -1, 0]
    manifest = json.loads((tmp_path / "out/train.json").read_text())
    assert manifest["class_names"] == ["0", "1", "2", "3", "4"] and manifest["skipped"] == 0
    convert(cli, f"hf:{snap}", tmp_path / "out", *args, "--split", "validation")
    assert json.loads((tmp_path / "out/validation.json").read_text())["num_samples"] == 2
    (snap / "data").mkdir()  # a split name with dots, as the Hub allows (train.clean.100)
    pq.write_table(plain_table(rng, [0, 1, 0]), snap / "data/train.other-00000-of-00001.parquet")
    convert(cli, f"hf:{snap}", tmp_path / "out", *args, "--split", "train.other")
    assert json.loads((tmp_path / "out/train.other.json").read_text())["num_samples"] == 3


CARD = """---
license: other
configs:
- config_name: small
  data_files:
  - split: train
    path: small/train-*
  default: true
- config_name: big
  data_files: "big/*.parquet"
---
# A dataset
"""


def test_the_readmes_configs_choose_the_files_and_subset_picks_one(cli, tmp_path):
    rng = np.random.default_rng(2)
    snap = tmp_path / "snap"
    write_datasets(snap / "small/train-00000-of-00001.parquet", [encoded(rng, 8)] * 3, [0, 1, 2], 2)
    write_datasets(snap / "big/anything.parquet", [encoded(rng, 8)] * 5, [2, 2, 1, 0, 0], 2)
    write_datasets(snap / "data/train-00000-of-00001.parquet", [encoded(rng, 8)] * 7, [0] * 7, 2)  # unlisted
    (snap / "README.md").write_text(CARD)

    convert(cli, f"hf:{snap}", tmp_path / "default")
    manifest = json.loads((tmp_path / "default/train.json").read_text())
    assert manifest["num_samples"] == 3 and manifest["hf"]["subset"] == "small"
    convert(cli, f"hf:{snap}", tmp_path / "big", "--subset", "big")
    manifest = json.loads((tmp_path / "big/train.json").read_text())
    assert manifest["num_samples"] == 5 and manifest["hf"]["files"] == ["big/anything.parquet"]

    proc = convert(cli, f"hf:{snap}", tmp_path / "x", "--subset", "huge", check=False)
    one_line_failure(proc, "no subset 'huge' (subsets: big, small): pass --subset NAME")
    (snap / "README.md").write_text(CARD.replace("  default: true\n", ""))
    proc = convert(cli, f"hf:{snap}", tmp_path / "x", check=False)
    one_line_failure(proc, "holds several subsets (big, small), none the default: pass --subset NAME")

    (snap / "README.md").write_text("---\nlicense: mit\n---\n")  # no configs: the file layouts
    write_datasets(snap / "other/train/0000.parquet", [encoded(rng, 8)] * 2, [1, 1], 2)
    convert(cli, f"hf:{snap}", tmp_path / "data")  # data/ at the top: the default
    assert json.loads((tmp_path / "data/train.json").read_text())["hf"]["subset"] == "default"
    convert(cli, f"hf:{snap}", tmp_path / "other", "--subset", "other")
    assert json.loads((tmp_path / "other/train.json").read_text())["num_samples"] == 2
    shutil.rmtree(snap / "data")
    proc = convert(cli, f"hf:{snap}", tmp_path / "x", check=False)
    one_line_failure(proc, "several subsets (big, other, small), none the default")
    assert not (tmp_path / "x").exists()


def test_a_file_that_changes_during_a_conversion_stops_it(tmp_path):
    """The records were counted from the footers (what a resumed conversion skips): a file whose row
    groups differ when it is read is a one-line error, not records shifted against that count."""
    rng = np.random.default_rng(7)
    path = tmp_path / "snap/data/train-00000-of-00001.parquet"
    write_datasets(path, [encoded(rng, 8) for _ in range(4)], [0, 1, 2, 0], row_group=2)
    _, records = hf.load(str(tmp_path / "snap"), "train", None, None, None)
    assert records.total == 4
    write_datasets(path, [encoded(rng, 8) for _ in range(4)], [0, 1, 2, 0], row_group=3)
    with pytest.raises(UserError, match="train-00000-of-00001.parquet changed while it was being converted"):
        list(records)


def corrupt_second_file(snap: Path) -> None:
    path = snap / "data/train-00001-of-00002.parquet"
    path.write_bytes(path.read_bytes()[:-20])  # the footer's end, and the magic bytes, gone


def two_image_columns(snap: Path) -> None:
    table = pq.read_table(snap / "data/train-00000-of-00002.parquet")
    meta = json.loads(table.schema.metadata[b"huggingface"])
    meta["info"]["features"]["thumb"] = {"_type": "Image"}
    table = table.append_column("thumb", table.column("image"))
    table = table.replace_schema_metadata({b"huggingface": json.dumps(meta)})
    pq.write_table(table, snap / "data/train-00000-of-00002.parquet")


REFUSALS = [
    ("missing", [], lambda snap: None, "no such directory: download the dataset with `huggingface-cli"),
    ("empty", [], lambda snap: (snap / "README.md").write_text("# nothing\n"),
     "no parquet files found; expected a README.md whose front matter lists configs: with data_files"),
    ("split", ["--split", "val"], None, "no parquet files for split 'val' (splits: test, train)"),
    ("column", ["--label-column", "labels"], None, "no column 'labels' (columns: image, label)"),
    ("image type", ["--image-column", "label"], None,
     "column 'label' holds int64, not binary image files, or the `datasets` Image struct"),
    ("label type", ["--label-column", "image"], None,
     "column 'image' holds struct<bytes: binary, path: string>, not integers (a ClassLabel or an integer"),
    ("corrupt", [], corrupt_second_file, "train-00001-of-00002.parquet: not a readable parquet file"),
    ("card", [], lambda snap: (snap / "README.md").write_text("---\nconfigs: [unclosed\n---\n"),
     "the front matter of"),
    ("outside", [], lambda snap: (snap / "README.md").write_text(
        "---\nconfigs:\n- config_name: default\n  data_files: ../../*.parquet\n---\n"), "outside"),
    ("two images", [], two_image_columns, "several Image columns (image, thumb): pass --image-column NAME"),
    ("other source", ["--label-column", "y"], None, "--label-column: only for the hf:DIR source"),
]  # fmt: skip


@pytest.mark.parametrize("case, args, setup, words", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refusals_are_one_line_and_write_nothing(cli, tmp_path, case, args, setup, words):
    rng = np.random.default_rng(3)
    snap = tmp_path / "snap"
    if case != "missing":
        pngs = [encoded(rng, 8) for _ in range(4)]
        write_datasets(snap / "data/train-00000-of-00002.parquet", pngs, [0, 1, 2, 0], 2)
        write_datasets(snap / "data/train-00001-of-00002.parquet", pngs, [0, 1, 2, 0], 2)
        write_datasets(snap / "data/test-00000-of-00001.parquet", pngs, [0, 1, 2, 0], 2)
    if case == "empty":
        for path in (snap / "data").iterdir():
            path.unlink()
    if setup is not None:
        setup(snap)
    source = "synthetic:4" if case == "other source" else f"hf:{snap}"
    proc = convert(cli, source, tmp_path / "out", *args, check=False)
    one_line_failure(proc, words)
    assert not (tmp_path / "out").exists()


def test_an_interrupted_conversion_continues_where_it_stopped(cli, tmp_path):
    """Killed after its third shard: the same command continues after 30 of the 57 rows (the total
    from the footers) and gives the bytes of an uninterrupted conversion."""
    rng = np.random.default_rng(4)
    snap = tmp_path / "snap"
    pngs = [encoded(rng, 8) for _ in range(57)]
    labels = [i % 3 for i in range(57)]
    for k, part in enumerate((slice(0, 20), slice(20, 57))):
        write_datasets(snap / f"data/train-0000{k}-of-00002.parquet", pngs[part], labels[part], 6)
    args = ["--shard-size", "10", "--workers", "2"]
    proc = cli("data", "convert", f"hf:{snap}", str(tmp_path / "whole"), *args)  # with progress lines
    assert "train-000005.tar: 57/57 images (100%)" in proc.stderr
    convert_killed(4, f"hf:{snap}", str(tmp_path / "out"), *args)
    proc = convert(cli, f"hf:{snap}", tmp_path / "out", *args)
    assert "continuing the interrupted conversion after its 3 finished shards (30 of 57" in proc.stderr
    assert files(tmp_path / "out") == files(tmp_path / "whole")


# --- hostile parquet content ---------------------------------------------------------------------------

GOOD_PNG = encoded(np.random.default_rng(5), 8)
# Each strategy leans to what parses, so that most examples write something and skip the bad rows;
# the rest hold a structure that is refused (a column of the wrong type, no image column found).
IMAGES = st.one_of(
    st.just(GOOD_PNG), st.just(GOOD_PNG), st.just(GOOD_PNG), st.binary(max_size=48), st.none(),
    st.just(GOOD_PNG[: len(GOOD_PNG) // 2]), st.just(b"\x89PNG\r\n\x1a\n" + bytes(40)), st.just("path only"),
)  # fmt: skip
LABELS = st.one_of(st.none(), st.integers(-3, 5), st.integers(-3, 5), st.integers(-(2**40), 2**40))
METADATA = st.one_of(
    st.just("features"), st.just("features"), st.just("features"), st.just(None), st.binary(max_size=30),
    st.sampled_from([
        b"[]", b'{"info": 3}', b'{"info": {"features": []}}', b'{"info": {"features": {"image": 1}}}',
        b"\xff\xfe", b"[" * 5000 + b"]" * 5000,
    ]),
)  # fmt: skip
NAMES_VALUES = st.one_of(
    st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=4),
    st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=4),
    st.just(3), st.just([]), st.just(["a", 1]), st.none(),
)  # fmt: skip


@st.composite
def hostile_tables(draw):
    rows = draw(st.lists(st.tuples(IMAGES, LABELS), min_size=0, max_size=10))
    image_kind = draw(st.sampled_from(["struct"] * 4 + ["binary"] * 3 + ["string"]))
    label_kind = draw(st.sampled_from(["int64"] * 6 + ["string", "float", "absent"]))
    return {
        "rows": rows, "image_kind": image_kind, "label_kind": label_kind,
        "metadata": draw(METADATA), "names": draw(NAMES_VALUES), "row_group": draw(st.integers(1, 4)),
        "image_flag": draw(st.booleans()), "label_flag": draw(st.booleans()) and label_kind != "absent",
    }  # fmt: skip


def write_hostile(path: Path, case: dict) -> None:
    images, labels = zip(*case["rows"]) if case["rows"] else ((), ())
    if case["image_kind"] == "struct":
        kind = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
        values = [
            None
            if b is None
            else {"bytes": None, "path": b}
            if isinstance(b, str)
            else {"bytes": b, "path": None}
            for b in images
        ]
        columns = {"image": pa.array(values, kind)}
    elif case["image_kind"] == "binary":
        columns = {"image": pa.array([b if not isinstance(b, str) else None for b in images], pa.binary())}
    else:
        columns = {"image": pa.array([None if b is None else repr(b) for b in images], pa.string())}
    if case["label_kind"] == "int64":
        columns["label"] = pa.array(labels, pa.int64())
    elif case["label_kind"] == "string":
        columns["label"] = pa.array([None if v is None else str(v) for v in labels], pa.string())
    elif case["label_kind"] == "float":
        columns["label"] = pa.array([None if v is None else float(v) for v in labels], pa.float64())
    table = pa.table(columns)
    metadata = case["metadata"]
    if metadata == "features":
        features = {"image": {"_type": "Image"}}
        if case["label_kind"] != "absent":
            features["label"] = {"_type": "ClassLabel", "names": case["names"]}
        metadata = json.dumps({"info": {"features": features}}).encode()
    if metadata is not None:
        table = table.replace_schema_metadata({b"huggingface": metadata})
    path.parent.mkdir(parents=True)
    pq.write_table(table, path, row_group_size=case["row_group"])


def expected(case: dict) -> tuple[list[int], list[int]] | None:
    """(labels written, in order; indices of the rows skipped), or None for a one-line refusal."""
    features = case["metadata"] == "features"
    names = case["names"] if isinstance(case["names"], list) and case["names"] else None
    names = names if names and all(isinstance(n, str) for n in names) else None
    label_used = case["label_flag"] or (features and case["label_kind"] != "absent")
    if not (case["image_flag"] or features) or case["image_kind"] == "string":
        return None
    if label_used and case["label_kind"] != "int64":
        return None
    written, skipped = [], []
    for i, (image, label) in enumerate(case["rows"]):
        label = label if label_used else None
        data = None if isinstance(image, str) or case["image_kind"] == "string" else image
        named = features and names is not None
        bad_label = label is not None and (
            label < -1 or (named and label >= len(names)) or (not named and label > MAX_UNNAMED_LABEL)
        )
        decodes = data is not None and isinstance(
            encode_record((ImageBytes(data, "x"), 0), EncodeOptions("png", 95, None, None))[0], Encoded
        )
        if bad_label or not decodes:
            skipped.append(i)
        else:
            written.append(-1 if label is None else label)
    return (written, skipped) if written else None  # nothing to write: refused


# Each example is a whole `data convert` (about a second): 25 tables
@settings(max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=hostile_tables())
def test_hostile_parquet_content_is_skipped_and_counted_or_refused_in_one_line(case):
    """Random bytes, truncated PNGs, nulls and path-only structs in the image column; labels null,
    negative, huge or beyond the names; label and image columns of the wrong type; schema metadata that
    is no JSON, JSON of other shapes, ClassLabel names that are no list of strings; with and without
    the flags. Either every bad row is skipped and counted (the rest written with their labels), or one
    error line and exit 2 with nothing written; never a traceback."""
    with tempfile.TemporaryDirectory() as tmp:
        snap, out = Path(tmp) / "snap", Path(tmp) / "out"
        write_hostile(snap / "data/train-00000-of-00001.parquet", case)
        flags = ["--image-column", "image"] * case["image_flag"]
        flags += ["--label-column", "label"] * case["label_flag"]
        proc = run_cli("data", "convert", f"hf:{snap}", str(out), "--no-progress", *flags, check=False)
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
        outcome = expected(case)
        if outcome is None:
            one_line_failure(proc, "")
            assert not out.exists()
            return
        assert proc.returncode == 0, proc.stderr[-3000:]
        written, skipped = outcome
        manifest, read = read_back(out, "train")
        assert manifest["num_samples"] == len(written) and manifest["skipped"] == len(skipped)
        assert [int(label) for _, _, label in read] == written
        assert proc.stderr.count("skipping unreadable image") == len(skipped)
        for i in skipped:
            assert f"row {i}:" in proc.stderr
