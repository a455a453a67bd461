"""`ssl-vit data convert` for training-sized shards, through the CLI: `--max-side`, the `wds:` source
(re-sharding keeps keys, labels and JPEG bytes; corrupt samples are skipped and counted), and an
interrupted conversion that continues where it stopped."""

import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from cli_helpers import start_cli
from PIL import Image


def jpeg(rng, width: int, height: int, quality: int = 90) -> bytes:
    """A smooth random picture (so JPEG sizes stay small) as JPEG bytes."""
    small = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(small).resize((width, height), Image.BILINEAR).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def samples(outdir: Path, split: str = "train") -> list[dict]:
    """Every sample of the split's shards, raw bytes, in manifest order, read with stock webdataset."""
    manifest = json.loads((outdir / f"{split}.json").read_text())
    urls = [str(outdir / s["url"]) for s in manifest["shards"]]
    return list(wds.WebDataset(urls, shardshuffle=False, empty_check=False))


def test_max_side_shrinks_large_images_and_keeps_small_ones_byte_for_byte(cli, tmp_path):
    rng = np.random.default_rng(0)
    (tmp_path / "folder").mkdir()
    big, small = jpeg(rng, 300, 200), jpeg(rng, 60, 80)
    (tmp_path / "folder" / "a.jpg").write_bytes(big)
    (tmp_path / "folder" / "b.jpg").write_bytes(small)
    Image.fromarray(rng.integers(0, 256, (50, 40, 3), dtype=np.uint8)).save(tmp_path / "folder" / "c.png")
    cli(
        "data", "convert", f"imagefolder:{tmp_path / 'folder'}", str(tmp_path / "out"),
        "--format", "jpg", "--max-side", "100", "--no-progress",
    )  # fmt: skip
    a, b, c = samples(tmp_path / "out")
    assert Image.open(io.BytesIO(a["jpg"])).size == (100, 67)  # aspect kept
    assert np.abs(np.asarray(Image.open(io.BytesIO(a["jpg"])), int) - np.asarray(
        Image.open(io.BytesIO(big)).resize((100, 67)), int
    )).mean() < 6  # fmt: skip
    assert b["jpg"] == small  # fits and is JPEG already: stored as it is
    assert Image.open(io.BytesIO(c["jpg"])).format == "JPEG"  # fits, but another format: re-encoded
    manifest = json.loads((tmp_path / "out" / "train.json").read_text())
    assert manifest["max_side"] == 100 and manifest["image_size"] is None

    proc = cli("data", "convert", "synthetic:3", str(tmp_path / "x"), "--max-side", "0", check=False)
    assert proc.returncode == 2 and "--max-side must be at least 1" in proc.stderr


def test_wds_shards_are_shrunk_on_the_way_in(cli, tmp_path):
    """Existing shards re-sharded with `--max-side`: large images shrunk, labels and keys kept."""
    rng = np.random.default_rng(1)
    (tmp_path / "in").mkdir()
    images = {f"k{i}": (jpeg(rng, 320 - 40 * i, 240), i % 3) for i in range(4)}
    with wds.TarWriter(str(tmp_path / "in" / "part-000000.tar")) as sink:
        for key, (data, label) in images.items():
            sink.write({"__key__": key, "jpg": data, "cls": str(label)})
    cli(
        "data", "convert", f"wds:{tmp_path / 'in' / 'part-000000.tar'}", str(tmp_path / "out"),
        "--format", "jpg", "--max-side", "160", "--no-progress",
    )  # fmt: skip
    out = {s["__key__"]: s for s in samples(tmp_path / "out")}
    assert sorted(out) == sorted(images)
    for key, (data, label) in images.items():
        width, height = Image.open(io.BytesIO(data)).size
        scale = 160 / max(width, height)
        assert Image.open(io.BytesIO(out[key]["jpg"])).size == (round(width * scale), round(height * scale))
        assert int(out[key]["cls"]) == label


def write_foreign_shard(path: Path, rng) -> dict:
    """A shard as another tool writes it (no manifest): labels in cls or json, an unlabelled png, a
    truncated JPEG and a sample without an image (both to be skipped). Returns key -> (bytes, label)."""
    good = {"k0": (jpeg(rng, 40, 30), 1), "k2": (jpeg(rng, 30, 40), 2)}
    png = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (8, 8), dtype=np.uint8)).save(png, "PNG")
    with wds.TarWriter(str(path)) as sink:
        sink.write({"__key__": "k0", "jpg": good["k0"][0], "cls": b"1"})
        sink.write({"__key__": "k1", "jpg": jpeg(rng, 40, 30)[:200], "cls": b"0"})  # corrupt
        sink.write({"__key__": "k2", "jpeg": good["k2"][0], "json": json.dumps({"label": 2}).encode()})
        sink.write({"__key__": "k3", "png": png.getvalue()})
        sink.write({"__key__": "k4", "txt": b"no image here"})
    return {**good, "k3": (png.getvalue(), -1)}


def test_wds_reshards_keys_labels_and_bytes_unchanged(cli, tmp_path):
    cli(
        "data", "convert", "synthetic:23", str(tmp_path / "a"), "--format", "jpg", "--shard-size", "5",
        "--no-progress",
    )  # fmt: skip
    cli(
        "data", "convert", f"wds:{tmp_path / 'a'}/train-{{000000..000004}}.tar", str(tmp_path / "b"),
        "--format", "jpg", "--shard-size", "7", "--workers", "2", "--no-progress",
    )  # fmt: skip
    before, after = samples(tmp_path / "a"), samples(tmp_path / "b")
    assert [(s["__key__"], s["cls"], s["jpg"]) for s in after] == [
        (s["__key__"], s["cls"], s["jpg"]) for s in before
    ]
    a, b = (json.loads((tmp_path / d / "train.json").read_text()) for d in "ab")
    assert [s["num_samples"] for s in b["shards"]] == [7, 7, 7, 2]
    for key in ("num_samples", "class_names", "class_counts", "image_size", "skipped"):
        assert a[key] == b[key], key


def test_wds_skips_and_counts_corrupt_samples(cli, tmp_path):
    rng = np.random.default_rng(1)
    (tmp_path / "in").mkdir()
    expected = write_foreign_shard(tmp_path / "in" / "shard-0.tar", rng)
    (tmp_path / "in" / "shard-1.tar").write_bytes((tmp_path / "in" / "shard-0.tar").read_bytes()[:1000])
    proc = cli(
        "data", "convert", f"wds:{tmp_path}/in/shard-{{0..1}}.tar", str(tmp_path / "out"),
        "--format", "jpg", "--no-progress",
    )  # fmt: skip
    # k1 (truncated JPEG), k4 (no image), and the second shard, which breaks off in its first member
    assert "wrote 3 samples (3 unreadable skipped)" in proc.stdout, proc.stdout + proc.stderr
    assert "k1" in proc.stderr and "shard-1.tar" in proc.stderr
    written = samples(tmp_path / "out")
    assert [s["__key__"] for s in written] == ["k0", "k2", "k3"]
    assert [int(s.get("cls", b"-1")) for s in written] == [expected[k][1] for k in ("k0", "k2", "k3")]
    assert written[0]["jpg"] == expected["k0"][0] and written[1]["jpg"] == expected["k2"][0]
    assert Image.open(io.BytesIO(written[2]["jpg"])).mode == "L"  # the png, re-encoded as jpg
    manifest = json.loads((tmp_path / "out" / "train.json").read_text())
    assert manifest["skipped"] == 3 and manifest["class_names"] == ["0", "1", "2"]
    assert manifest["class_counts"] == {"-1": 1, "1": 1, "2": 1}


def test_wds_keys_that_name_places_outside_the_shard_are_written_as_relative_names(cli, tmp_path):
    """Member names with `..` or a leading `/` are copied as relative names: `tar -x` of a shard written
    here never writes outside its folder. A warning counts them; the samples and labels are kept."""
    rng = np.random.default_rng(0)
    names = ["../../escape/s0", "/etc/s1", "./ok/./s2", "s3"]
    (tmp_path / "in").mkdir()  # OUTDIR, tmp_path/out, never inside the source shards' directory
    with tarfile.open(tmp_path / "in/in-000000.tar", "w") as tar:
        for label, name in enumerate(names):
            for ext, data in (("jpg", jpeg(rng, 8, 8)), ("cls", str(label).encode())):
                info = tarfile.TarInfo(f"{name}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    source, out = f"wds:{tmp_path / 'in/in-000000.tar'}", str(tmp_path / "out")
    proc = cli("data", "convert", source, out, "--format", "jpg", "--no-progress")
    assert "3 sample key(s) named a place outside their shard, written as relative names " \
        "('../../escape/s0' -> 'escape/s0', ...)" in proc.stderr, proc.stderr  # fmt: skip
    with tarfile.open(tmp_path / "out" / "train-000000.tar") as tar:
        written = tar.getnames()
    assert written == [
        f"{key}.{ext}" for key in ("escape/s0", "etc/s1", "ok/s2", "s3") for ext in ("cls", "jpg")
    ]
    assert [int(s["cls"]) for s in samples(tmp_path / "out")] == [0, 1, 2, 3]


def test_wds_shards_that_do_not_exist_are_one_line_errors(cli, tmp_path):
    proc = cli("data", "convert", f"wds:{tmp_path}/in/none-{{0..1}}.tar", str(tmp_path / "out"), check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "none-0.tar is no such file" in proc.stderr and not (tmp_path / "out").exists()


# `ssl-vit data convert ARGS` killed (os._exit, as SIGKILL would) just before it records its
# STOP_AT-th finished shard: that shard's tar is complete but not in the progress record yet.
CONVERT_KILLED = """
import os, sys
stop_at, seen = int(sys.argv[1]), 0
real = os.replace
def replace(src, dst, *args, **kwargs):
    global seen
    if str(dst).endswith("progress.json"):
        seen += 1
        if seen == stop_at:
            os._exit(9)
    return real(src, dst, *args, **kwargs)
os.replace = replace
from ssl_vit.cli import main
sys.exit(main(sys.argv[2:]))
"""


def convert_killed(stop_at: int, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-c", CONVERT_KILLED, str(stop_at), "data", "convert", *args, "--no-progress"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 9, proc.stderr
    return proc


def files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.mark.parametrize("kind", ["synthetic", "wds"])
def test_an_interrupted_conversion_continues_and_equals_an_uninterrupted_one(cli, tmp_path, kind):
    if kind == "synthetic":
        source = "synthetic:57"
    else:  # a lazily read source: resuming skips the records of the finished shards in the stream
        cli("data", "convert", "synthetic:57", str(tmp_path / "in"), "--shard-size", "20", "--no-progress")
        source = f"wds:{tmp_path}/in/train-{{000000..000002}}.tar"
    args = [source, "--shard-size", "10", "--workers", "2"]
    proc = cli("data", "convert", source, str(tmp_path / "whole"), *args[1:])  # with progress lines
    assert [line.split(":")[0] for line in proc.stderr.splitlines()] == [
        f"train-{i:06d}.tar" for i in range(6)
    ]
    assert "(100%)" in proc.stderr.splitlines()[-1]

    out = tmp_path / "out"
    convert_killed(4, source, str(out), *args[1:])
    # Nothing in place yet; the killed conversion's lock on its split is left, as a kill leaves it.
    assert sorted(p.name for p in out.iterdir()) == [".train.lock", ".train.partial"]
    proc = cli("data", "convert", source, str(out), *args[1:], "--no-progress")
    assert f"took over the lock {out}/.train.lock from ssl-vit data convert" in proc.stderr
    assert "continuing the interrupted conversion after its 3 finished shards (30 of 57" in proc.stderr
    assert files(out) == files(tmp_path / "whole")  # the same bytes, manifest included

    # other options: the finished shards are of no use, it starts over
    convert_killed(2, source, str(tmp_path / "other"), *args[1:])
    proc = cli("data", "convert", source, str(tmp_path / "other"), "--shard-size", "20", "--no-progress")
    assert "interrupted conversion with other shard_size is discarded; starting over" in proc.stderr
    assert [s["num_samples"] for s in json.loads((tmp_path / "other/train.json").read_text())["shards"]] == [
        20, 20, 17
    ]  # fmt: skip
    assert sorted(p.name for p in (tmp_path / "other").iterdir()) == [
        "train-000000.tar", "train-000001.tar", "train-000002.tar", "train.json"
    ]  # fmt: skip


@pytest.mark.parametrize(("signum", "line"), [(signal.SIGINT, "interrupted"), (signal.SIGTERM, "terminated")])
def test_a_stopped_conversion_keeps_the_finished_shards_for_the_next_run(cli, tmp_path, signum, line):
    """Ctrl-C or SIGTERM (to the whole process group, as a scheduler sends it) while shards are being
    written: 128 + the signal, a line saying how to continue, then the command's; the finished shards
    and their record kept, the shard being written deleted."""
    out = tmp_path / "out"
    args = (
        "data",
        "convert",
        "synthetic:3000",
        str(out),
        "--shard-size",
        "50",
        "--workers",
        "2",
        "--no-progress",
    )
    running = start_cli(*args, session=True)
    partial = out / ".train.partial"
    deadline = time.monotonic() + 120
    while (
        not (partial / "train-000001.tar").exists() and running.poll() is None and time.monotonic() < deadline
    ):
        time.sleep(0.02)
    os.killpg(running.pid, signum)
    proc = running.wait(120)
    assert proc.returncode == 128 + signum, proc.stderr
    kept = json.loads((partial / "progress.json").read_text())["shards"]
    assert proc.stderr.splitlines() == [
        f"kept the {len(kept)} finished shards in {partial}: run the same command again to continue",
        f"ssl-vit: {line}",
    ]
    assert sorted(p.name for p in out.iterdir()) == [".train.partial"]
    assert sorted(p.name for p in partial.iterdir()) == ["progress.json", *(entry["url"] for entry in kept)]
    assert all(len(list(wds.WebDataset(str(partial / e["url"]), shardshuffle=False))) == 50 for e in kept)
    proc = cli(*args)
    assert "continuing the interrupted conversion after its" in proc.stderr
    assert json.loads((out / "train.json").read_text())["num_samples"] == 3000
    assert not partial.exists()


def test_a_signal_right_after_a_shard_is_recorded_keeps_that_shard(monkeypatch, tmp_path):
    """The narrowest window of the test above, placed on purpose: Ctrl-C arrives just after the
    progress record names a new shard, before the writer lets go of it. The record and the files
    agree (the shard is kept), and the next run continues after it."""
    from ssl_vit.data.convert import shard_writer

    saved = shard_writer._save_progress
    calls = []

    def save_then_interrupt(*args):
        saved(*args)
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(shard_writer, "_save_progress", save_then_interrupt)
    out, partial = tmp_path / "out", tmp_path / "out/.train.partial"
    with pytest.raises(KeyboardInterrupt):
        shard_writer.convert("synthetic:30", out, shard_size=10, progress=False)
    kept = json.loads((partial / "progress.json").read_text())["shards"]
    assert [entry["url"] for entry in kept] == ["train-000000.tar", "train-000001.tar"]
    assert sorted(p.name for p in partial.iterdir()) == [
        "progress.json",
        "train-000000.tar",
        "train-000001.tar",
    ]
    monkeypatch.setattr(shard_writer, "_save_progress", saved)
    assert shard_writer.convert("synthetic:30", out, shard_size=10, progress=False)["num_samples"] == 30
    assert not partial.exists()
