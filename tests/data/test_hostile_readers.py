"""Property tests (hypothesis) of the readers of untrusted shard bytes: tar members and their names,
`json`/`cls` labels, and manifests with their consumers. One invariant: a bad item is skipped and
counted with its reason (`BadSample`, a shard's `tarfile.ReadError`, a `LinkMember`), or the reader
raises one UserError, the CLI's one line; nothing else escapes, nothing hangs. Most generated cases run
in-process on the function the CLI calls; a few of them go through `ssl-vit data inspect` as well.

Bounded: derandomized (the same cases on every run), a few hundred cases in all, no deadline."""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
from pathlib import Path

import pytest
import webdataset as wds
from cli_helpers import run_cli
from hostile_helpers import HOSTILE, WRONG, bounded, one_line_or_read, places, replaced
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image
from test_tar_reader import stock
from webdataset.tariterators import group_by_keys

from ssl_vit.data import ShardDataModule
from ssl_vit.data.convert import wds as wds_source
from ssl_vit.data.format.manifest import read_manifest
from ssl_vit.data.format.members import MAX_CLASSES, BadSample, parse_label
from ssl_vit.data.inspect import inspect_urls
from ssl_vit.data.stream.identity import identity
from ssl_vit.data.stream.tar_reader import LinkMember, UnkeyedMember, tar_file_members, tar_files
from ssl_vit.errors import UserError


def png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, "PNG")
    return buf.getvalue()


# --- json and cls labels ----------------------------------------------------------------------------------

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
LABEL_VALUES = st.one_of(
    JSON_VALUES,
    st.integers(-3, 30),
    st.integers().map(str),
    st.sampled_from(["7", " 7 ", "+3", "-1", "-2", "1e3", "\u0663", "0x10", "1_0", "", "9" * 30]),
)


def with_label(value: object, field: str) -> bytes:
    return json.dumps({field: value, "caption": "x"}).encode()


JSON_MEMBERS = st.one_of(
    st.builds(with_label, LABEL_VALUES, st.sampled_from(["label", "cls", "other"])),
    JSON_VALUES.map(lambda value: json.dumps(value).encode()),
    st.binary(max_size=120),
    st.integers(1, 300_000).map(lambda n: b"[" * n),  # 300 KB of brackets: deeper than any recursion limit
    st.integers(1, 3000).map(lambda n: b'{"label": ' + b"[" * n + b"]" * n + b"}"),
    st.sampled_from([b'{"label": 1e400}', b'{"label": NaN}', b'{"label": -Infinity}', b"\xff\xfe{", b""]),
)
CLS_MEMBERS = st.one_of(
    st.binary(max_size=30), st.integers().map(lambda n: str(n).encode()), st.text(max_size=8).map(str.encode)
)
SAMPLES = st.fixed_dictionaries({}, optional={"cls": CLS_MEMBERS, "json": JSON_MEMBERS})


def written_label(sample: dict) -> object:
    """The label value `sample` holds, as its writer meant it (None: none)."""
    if "cls" in sample:
        return sample["cls"].decode("ascii", "replace")
    meta = json.loads(sample["json"])
    return meta.get("label", meta.get("cls")) if isinstance(meta, dict) else None


def check_label(sample: dict, num_classes: int | None) -> bool:
    """The invariant of `parse_label`: a class index below the bound, -1 for none, or a BadSample;
    True when the sample is bad."""
    try:
        label = parse_label(sample, num_classes)
    except BadSample as err:
        assert str(err), sample
        return True
    assert isinstance(label, int) and not isinstance(label, bool), (sample, label)
    assert -1 <= label < (num_classes or MAX_CLASSES), (sample, label)
    if label >= 0:  # an integer, or a string of one, exactly as written: never a bool or a float cut down
        value = written_label(sample)
        assert not isinstance(value, bool | float), (sample, label)
        assert int(value) == label, (sample, label)
    return False


def test_every_label_is_a_class_index_none_or_a_counted_bad_sample(tmp_path):
    """`parse_label`, which the training stream, `data inspect`, `data convert wds:` and `mosaic:` all
    call, on generated `cls` and `json` members; a few of the samples go through `data inspect` too."""
    kept: list[tuple[dict, bool]] = []

    @bounded(300)
    @given(SAMPLES, st.none() | st.integers(1, 20))
    def labels(sample, num_classes):
        bad = check_label(sample, num_classes)
        if num_classes is None and len(kept) < 40:
            kept.append((sample, bad))

    labels()
    assert any(bad for _, bad in kept) and not all(bad for _, bad in kept)
    with wds.TarWriter(str(tmp_path / "labels-000000.tar")) as sink:
        for i, (sample, _) in enumerate(kept):
            sink.write({"__key__": f"s{i:03d}", "png": png(), **sample})
    proc = run_cli("data", "inspect", str(tmp_path / "labels-000000.tar"), check=False)
    one_line_or_read(proc)
    bad = sum(bad for _, bad in kept)
    assert f"{len(kept) - bad} good samples" in proc.stdout and f"{bad} problems" in proc.stdout, proc.stdout


def test_well_formed_labels_read_as_written():
    @bounded(100)
    @given(st.integers(-1, 50), st.sampled_from(["cls", "label", "json-cls", "text"]))
    def read_back(label, how):
        member = {
            "cls": {"cls": str(label).encode()},
            "label": {"json": with_label(label, "label")},
            "json-cls": {"json": with_label(label, "cls")},
            "text": {"json": with_label(f" {label} ", "label")},
        }[how]
        assert parse_label(member, 51) == label

    read_back()


# --- tar members and their names --------------------------------------------------------------------------

NAMES = st.text(
    st.characters(exclude_categories=("Cs",), exclude_characters="\x00"), min_size=1, max_size=140
)
MEMBERS = st.tuples(
    NAMES
    | st.sampled_from(["../../etc/x.png", "/abs/y.cls", "a/./b.png", "__meta__.json", "k.png/", "c.cls"]),
    st.binary(max_size=300),
    st.sampled_from(["file", "file", "symlink", "hardlink", "pax"]),
)
MUTATIONS = st.one_of(
    st.none(),
    st.tuples(st.just("cut"), st.integers(0, 1 << 20)),
    st.tuples(st.just("flip"), st.integers(0, 1 << 20), st.integers(1, 255)),
    st.tuples(st.just("insert"), st.integers(0, 1 << 20), st.binary(min_size=1, max_size=700)),
)


def archive(members: list[tuple[str, bytes, str]], fmt: int) -> bytes | None:
    """The members as Python's tarfile writes them in `fmt` (links to the member before; `pax`: a
    regular file with pax records of its own); None where `fmt` cannot hold a name."""
    out = io.BytesIO()
    try:
        with tarfile.open(fileobj=out, mode="w", format=fmt) as tar:
            for i, (name, data, kind) in enumerate(members):
                info = tarfile.TarInfo(name)
                if kind in ("symlink", "hardlink"):
                    info.type = tarfile.SYMTYPE if kind == "symlink" else tarfile.LNKTYPE
                    info.linkname = members[i - 1][0] if i else "/etc/passwd"
                    tar.addfile(info)
                    continue
                if kind == "pax":
                    info.pax_headers = {"comment": name[:20], "mtime": "1.5", "hdrcharset": "BINARY"}
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    except (ValueError, UnicodeError, tarfile.HeaderError):
        return None
    return out.getvalue()


def mutated(data: bytes, mutation) -> bytes:
    if mutation is None or not data:
        return data
    kind, at, *rest = mutation
    at %= len(data)
    if kind == "cut":
        return data[:at]
    if kind == "flip":
        return data[:at] + bytes([data[at] ^ rest[0]]) + data[at + 1 :]
    return data[:at] + rest[0] + data[at:]


def read_shard(data: bytes) -> tuple[list[dict], list[Exception]]:
    """The samples the stream makes of a shard held in memory, and every error its handler counted."""
    errors: list[Exception] = []
    handler = lambda exn: errors.append(exn) or True  # noqa: E731
    members = tar_file_members([{"stream": io.BytesIO(data), "url": "shard.tar"}], handler)
    return list(group_by_keys(members, handler=handler)), errors


# `tar_files` raises on these where tarfile reads on: a pax record that does not parse (tarfile takes
# "03 comment=0\n" as an empty comment and drops the records after it), a negative size, a size in a
# global pax header.
REFUSED = ("bad pax record", "negative member size", "size in a global pax header")


def check_tar(data: bytes, intact: bool) -> int:
    """The reader's invariant on `data`: its errors are counted (a shard's ReadError at most once, a
    link's sample each, a sample's name given twice), it never raises; a member it yields is a whole
    file, exactly what Python's tarfile reads where tarfile reads the bytes cleanly. The number of
    errors counted."""
    samples, errors = read_shard(data)
    # counted with their reasons: a broken shard, a link, a member name given twice in a sample
    assert all(
        isinstance(e, tarfile.ReadError | LinkMember | ValueError | UnkeyedMember) and str(e) for e in errors
    ), errors
    assert sum(isinstance(e, tarfile.ReadError) for e in errors) <= 1 - intact, errors
    got, refused = [], False
    try:
        got = list(tar_files(io.BytesIO(data)))
    except tarfile.ReadError as err:
        assert not intact
        # what `tar_files` refuses where tarfile makes do without a word (its docstring lists them)
        refused = any(why in str(err) for why in REFUSED)
    expected = stock(data)
    if (expected is not None and not refused) or intact:
        assert got == expected, (got, expected)
    assert all(isinstance(s["__key__"], str) for s in samples)
    return len(errors)


@pytest.mark.timeout(300)
def test_generated_and_damaged_tars_yield_whole_members_or_a_counted_error(tmp_path):
    """Archives of generated member names (any Unicode, `..`, absolute, long enough for pax or GNU
    long-name headers), data, links and pax records, intact or cut, flipped or with bytes inserted; a
    few of them go through `data inspect` too."""
    kept: list[bytes] = []

    @bounded(400)
    @given(
        st.lists(MEMBERS, max_size=6),
        st.sampled_from([tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT]),
        MUTATIONS,
    )
    def tars(members, fmt, mutation):
        data = archive(members, fmt)
        if data is None:
            return
        check_tar(mutated(data, mutation), intact=mutation is None)
        if len(kept) < 4 and mutation is not None and len(members) > 2:
            kept.append(mutated(data, mutation))

    tars()
    for i, data in enumerate(kept):
        (tmp_path / f"gen-{i:06d}.tar").write_bytes(data)
    proc = run_cli("data", "inspect", str(tmp_path / f"gen-{{000000..{len(kept) - 1:06d}}}.tar"), check=False)
    one_line_or_read(proc)


# --- manifests and their consumers -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_split(tmp_path_factory) -> tuple[Path, dict]:
    """Two shards of 4 digits each, as `data convert` writes them, and their manifest with the optional
    keys too (masks, mask_pixels)."""
    root = tmp_path_factory.mktemp("tiny")
    source = tmp_path_factory.mktemp("digits")
    run_cli("data", "convert", "digits", str(source), "--split", "val", "--shard-size", "4", "--no-progress")
    for i in range(2):
        shutil.copy(source / f"val-{i:06d}.tar", root / f"train-{i:06d}.tar")
    manifest = json.loads((source / "val.json").read_text())
    manifest.update(num_samples=8, shards=manifest["shards"][:2], masks=False, mask_pixels={"0": 4, "255": 2})
    return root, manifest


def consume(folder: Path) -> None:
    """Everything that reads a split's manifest, on the split in `folder`: the data module (epoch size,
    class count and the check of labels against it, eval view, masks, identity), `data convert wds:`
    and `data inspect`."""
    urls = str(folder / "train-{000000..000001}.tar")
    read_manifest(str(folder / "train-000000.tar"))
    for num_classes in (None, 10):
        datamodule = ShardDataModule(train_urls=urls, batch_size=2, num_workers=0, image_size=32,
                                     num_classes=num_classes)  # fmt: skip
        datamodule.setup("fit")
        datamodule.samples_in("train"), datamodule.num_classes, datamodule.eval_view("train")
        datamodule.has_masks("train")
        identity(datamodule._urls["train"], datamodule.split_manifest("train"))
    wds_source.load(urls, "train")
    inspect_urls(urls)


@pytest.mark.timeout(300)
def test_hostile_manifests_are_one_line_or_read(tiny_split, tmp_path):
    """Manifests with any value of any type at any place, or not JSON at all (cut, nested 100,000
    deep): every consumer reads them or raises a UserError; a few go through `data inspect` too."""
    shards, valid = tiny_split
    folder = tmp_path / "split"
    folder.mkdir()
    for shard in sorted(shards.glob("*.tar")):
        os.symlink(shard, folder / shard.name)
    kept: list[str] = []

    # every place, and new labels and mask classes: beyond the class count, beyond a uint8 mask
    where = places(valid) + [("class_counts", "12"), ("class_counts", "-1"), ("mask_pixels", "300")]
    for at in where:  # a sweep of each place and each kind of wrong value first
        for value in WRONG:
            (folder / "train.json").write_text(json.dumps(replaced(valid, at, value)))
            try:
                consume(folder)
            except UserError:
                pass
    # values of any type, or of the right type for most places but out of the way (counts of 0 or up to
    # 2^53, a list of small numbers), which the consumers then meet
    typed = st.one_of(st.integers(0, 20), st.integers(0, 2**53), st.lists(st.integers(0, 9), max_size=3))
    edits = st.one_of(
        st.lists(st.tuples(st.sampled_from(where), HOSTILE), min_size=1, max_size=2),
        st.lists(st.tuples(st.sampled_from(where), typed), min_size=1, max_size=3),
    )

    @bounded(200)
    @given(edits, st.sampled_from(["json", "json", "json", "cut", "deep"]))
    def manifests(edits, form):
        manifest = valid
        for at, value in edits:
            manifest = replaced(manifest, at, value)
        text = json.dumps(manifest)
        text = {"json": text, "cut": text[: len(text) // 2], "deep": "[" * 100_000}[form]
        (folder / "train.json").write_text(text)
        try:
            consume(folder)
        except UserError:
            pass
        if len(kept) < 3 and form == "json":
            kept.append(text)

    manifests()
    for text in kept:
        (folder / "train.json").write_text(text)
        one_line_or_read(run_cli("data", "inspect", str(folder / "train-{000000..000001}.tar"), check=False))
