"""`ssl-vit data convert`: every source, end to end through the CLI, round-trips pixel-exactly (png)."""

import gzip
import io
import json
import pickle
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from PIL import Image

from ssl_vit.data.convert.shard_writer import check_split_name, convert
from ssl_vit.data.convert.source import open_source
from ssl_vit.errors import UserError


def read_back(outdir: Path, split: str) -> tuple[dict, list[tuple[str, np.ndarray, int]]]:
    """The manifest and (key, pixels, label) of every sample, read with stock webdataset."""
    manifest = json.loads((outdir / f"{split}.json").read_text())
    urls = [str(outdir / s["url"]) for s in manifest["shards"]]
    samples = []
    for s in wds.WebDataset(urls, shardshuffle=False, empty_check=False).decode("pil"):
        image = s.get("png", s.get("jpg"))
        samples.append((s["__key__"], np.asarray(image), s.get("cls", -1)))
    return manifest, samples


def rgb(rng, n, h=8, w=8):
    return rng.integers(0, 256, (n, h, w, 3), dtype=np.uint8)


def write_idx(path: Path, array: np.ndarray, gz: bool) -> None:
    """MNIST's IDX format: 0x0000, type 0x08 (ubyte), ndim, big-endian uint32 sizes, data."""
    raw = bytes([0, 0, 8, array.ndim]) + np.array(array.shape, dtype=">u4").tobytes() + array.tobytes()
    path.write_bytes(gzip.compress(raw) if gz else raw)


def write_cifar(root: Path, rng, hundred: bool) -> dict[str, np.ndarray]:
    """CIFAR python batches as the originals: protocol-2 pickles of dicts with bytes keys, `data` uint8
    (N, 3072) in CHW order. Returns the images per split as (N, 32, 32, 3)."""
    root.mkdir()
    label_key, names_key = (b"fine_labels", b"fine_label_names") if hundred else (b"labels", b"label_names")
    files = (
        {"train": ["train"], "test": ["test"]}
        if hundred
        else {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]}
    )
    ncls = 100 if hundred else 10
    meta = {names_key: [f"class{c}".encode() for c in range(ncls)]}
    (root / ("meta" if hundred else "batches.meta")).write_bytes(pickle.dumps(meta, protocol=2))
    images = {}
    for split, names in files.items():
        parts = []
        for name in names:
            hwc = rgb(rng, 3, 32, 32)
            batch = {
                b"batch_label": name.encode(),
                b"data": hwc.transpose(0, 3, 1, 2).reshape(3, 3072),
                label_key: [int(v) for v in rng.integers(0, ncls, 3)],
                b"filenames": [b"x.png"] * 3,
            }
            (root / name).write_bytes(pickle.dumps(batch, protocol=2))
            parts.append((hwc, batch[label_key]))
        images[split] = (np.concatenate([p[0] for p in parts]), sum((p[1] for p in parts), []))
    return images


def assert_round_trip(outdir, split, expected_images, expected_labels):
    manifest, samples = read_back(outdir, split)
    assert manifest["num_samples"] == len(samples) == len(expected_images)
    assert sum(s["num_samples"] for s in manifest["shards"]) == len(samples)
    for (key, pixels, label), want, want_label in zip(samples, expected_images, expected_labels):
        want = np.asarray(want)
        if want.ndim == 2:  # grey sources are stored grey; stock webdataset "pil" decodes them as RGB
            pixels = pixels[..., 0] if pixels.ndim == 3 else pixels
        np.testing.assert_array_equal(pixels, want, err_msg=key)
        assert label == want_label
    return manifest, samples


@pytest.mark.slow
def test_digits_fixed_split_round_trips(cli, tmp_path):
    cli(
        "data",
        "convert",
        "--order",
        "source",
        "digits",
        str(tmp_path),
        "--split",
        "train",
        "--shard-size",
        "600",
        "--workers",
        "2",
    )
    cli(
        "data",
        "convert",
        "--order",
        "source",
        "digits",
        str(tmp_path),
        "--split",
        "val",
        "--shard-size",
        "600",
    )
    from sklearn.datasets import load_digits

    digits = load_digits()
    order = np.random.default_rng(0).permutation(len(digits.target))  # the documented split
    chosen = {"val": np.sort(order[:359]), "train": np.sort(order[359:])}
    for split in ("train", "val"):
        src = open_source("digits", split)
        manifest, samples = assert_round_trip(
            tmp_path, split, [r[0] for r in src.records], [r[1] for r in src.records]
        )
        assert manifest["image_size"] == [32, 32] and manifest["class_names"] == [str(c) for c in range(10)]
        assert [s[0] for s in samples] == [f"digits-{split}-{i:08d}" for i in range(len(samples))]
        assert [s[2] for s in samples] == digits.target[chosen[split]].tolist()
        # each stored 32x32 RGB image is its 8x8 original upscaled: 4x4 block means track the original
        for (_, pixels, _), index in zip(samples[:20], chosen[split]):
            blocks = pixels[..., 0].reshape(8, 4, 8, 4).mean(axis=(1, 3))
            assert np.corrcoef(blocks.ravel(), digits.images[index].ravel())[0, 1] > 0.9


@pytest.mark.slow
@pytest.mark.parametrize("hundred", [False, True], ids=["cifar10", "cifar100"])
def test_cifar_pickles_round_trip(cli, tmp_path, hundred):
    images = write_cifar(tmp_path / "raw", np.random.default_rng(1), hundred)
    kind = "cifar100" if hundred else "cifar10"
    for split in ("train", "test"):
        if split == "train" or not hundred:
            cli(
                "data",
                "convert",
                "--order",
                "source",
                f"{kind}:{tmp_path / 'raw'}",
                str(tmp_path / "out"),
                "--split",
                split,
                "--shard-size",
                "4",
                "--no-progress",
            )
        else:  # the library call behind the CLI, to keep the suite fast
            convert(
                f"{kind}:{tmp_path / 'raw'}",
                tmp_path / "out",
                split=split,
                shard_size=4,
                progress=False,
                order="source",
            )
        manifest, _ = assert_round_trip(tmp_path / "out", split, *images[split])
        assert manifest["num_classes"] == (100 if hundred else 10) and manifest["class_names"][1] == "class1"
    assert len(json.loads((tmp_path / "out" / "train.json").read_text())["shards"]) == (1 if hundred else 4)


@pytest.mark.parametrize("gz", [True, False], ids=["gzipped", "plain"])
def test_idx_round_trips(cli, tmp_path, gz):
    rng = np.random.default_rng(2)
    grey = rng.integers(0, 256, (11, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, 11).astype(np.uint8)
    suffix = ".gz" if gz else ""
    write_idx(tmp_path / f"images-idx3-ubyte{suffix}", grey, gz)
    write_idx(tmp_path / f"labels-idx1-ubyte{suffix}", labels, gz)
    source = f"idx:{tmp_path}/images-idx3-ubyte{suffix},{tmp_path}/labels-idx1-ubyte{suffix}"
    if gz:
        cli(
            "data",
            "convert",
            "--order",
            "source",
            source,
            str(tmp_path / "out"),
            "--shard-size",
            "5",
            "--no-progress",
        )
    else:  # the library call behind the CLI, to keep the suite fast
        convert(source, tmp_path / "out", shard_size=5, progress=False, order="source")
    manifest, _ = assert_round_trip(tmp_path / "out", "train", grey, labels.tolist())
    assert manifest["image_size"] == [28, 28] and [s["num_samples"] for s in manifest["shards"]] == [5, 5, 1]


@pytest.mark.slow
def test_imagefolder_round_trips_and_counts_unreadable(cli, tmp_path):
    rng = np.random.default_rng(3)
    expected = []
    for cls in ("cat", "dog"):
        (tmp_path / "folder" / cls).mkdir(parents=True)
        for i in range(3):
            array = rgb(rng, 1, 12, 10)[0]
            Image.fromarray(array).save(tmp_path / "folder" / cls / f"{i}.png")
            expected.append((array, 0 if cls == "cat" else 1))
    (tmp_path / "folder" / "dog" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    proc = cli(
        "data",
        "convert",
        "--order",
        "source",
        f"imagefolder:{tmp_path / 'folder'}",
        str(tmp_path / "out"),
        "--no-progress",
    )
    assert "1 unreadable skipped" in proc.stdout and "broken.png" in proc.stderr
    manifest, _ = assert_round_trip(
        tmp_path / "out", "train", [e[0] for e in expected], [e[1] for e in expected]
    )
    assert (
        manifest["class_names"] == ["cat", "dog"]
        and manifest["skipped"] == 1
        and manifest["image_size"] == [12, 10]
    )


@pytest.mark.slow
def test_npz_and_jpg(cli, tmp_path):
    ramp = np.linspace(0, 255, 16)
    images = np.stack(
        [np.stack(np.broadcast_arrays(ramp[:, None], ramp[None, :], i * 40.0), -1) for i in range(6)]
    ).astype(np.uint8)  # smooth, so JPEG keeps it close
    labels = np.arange(6) % 3
    np.savez(tmp_path / "set.npz", images=images, labels=labels, class_names=np.array(["a", "b", "c"]))
    cli(
        "data",
        "convert",
        "--order",
        "source",
        f"npz:{tmp_path / 'set.npz'}",
        str(tmp_path / "png"),
        "--no-progress",
    )
    manifest, _ = assert_round_trip(tmp_path / "png", "train", images, labels.tolist())
    assert manifest["class_names"] == ["a", "b", "c"] and manifest["class_counts"] == {"0": 2, "1": 2, "2": 2}
    cli(
        "data",
        "convert",
        "--order",
        "source",
        f"npz:{tmp_path / 'set.npz'}",
        str(tmp_path / "jpg"),
        "--format",
        "jpg",
        "--quality",
        "90",
        "--no-progress",
    )
    manifest, samples = read_back(tmp_path / "jpg", "train")
    assert manifest["image_format"] == "jpg" and [s[2] for s in samples] == labels.tolist()
    assert np.abs(samples[5][1].astype(int) - images[5]).mean() < 8  # lossy, but the same picture


def test_synthetic_is_deterministic_and_workers_agree(tmp_path):
    convert("synthetic:50", tmp_path / "a", shard_size=20, progress=False, order="source")
    convert("synthetic:50", tmp_path / "b", shard_size=20, workers=2, progress=False, order="source")
    for name in ("train-000000.tar", "train-000001.tar", "train-000002.tar", "train.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    manifest = json.loads((tmp_path / "a" / "train.json").read_text())
    assert manifest["num_samples"] == 50 and manifest["class_counts"]["0"] == 5


@pytest.mark.slow
def test_refuses_to_overwrite_and_bad_sources_are_one_line_errors(cli, tmp_path):
    convert("synthetic:30", tmp_path, shard_size=10, progress=False, order="source")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    proc = cli("data", "convert", "--order", "source", "synthetic:5", str(tmp_path), check=False)
    assert proc.returncode == 2 and "--overwrite" in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and proc.stderr.startswith("ssl-vit: error:")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before

    cli("data", "convert", "--order", "source", "synthetic:5", str(tmp_path), "--overwrite", "--no-progress")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "train-000000.tar",
        "train.json",
    ]  # stale shards gone

    for source, words in [
        (f"cifar10:{tmp_path / 'nope'}", "no such directory"),
        ("mnist:x", "unknown source"),
    ]:
        proc = cli("data", "convert", "--order", "source", source, str(tmp_path / "new"), check=False)
        assert proc.returncode == 2 and words in proc.stderr, proc.stderr
        assert proc.stderr.strip().count("\n") == 0 and not (tmp_path / "new").exists()


def test_sources_that_do_not_parse(tmp_path):
    (tmp_path / "c10").mkdir()
    (tmp_path / "c10" / "batches.meta").write_bytes(b"garbage")
    with pytest.raises(UserError, match="does not parse as a CIFAR"):
        open_source(f"cifar10:{tmp_path / 'c10'}", "train")
    (tmp_path / "c10" / "batches.meta").write_bytes(pickle.dumps(subprocess.Popen, protocol=2))
    with pytest.raises(UserError, match="refusing to load .*Popen"):  # no arbitrary unpickling
        open_source(f"cifar10:{tmp_path / 'c10'}", "train")
    (tmp_path / "bad.idx").write_bytes(b"\x00\x00\x0d\x03" + b"\x00" * 12)
    with pytest.raises(UserError, match="not an IDX file of unsigned bytes"):
        open_source(f"idx:{tmp_path / 'bad.idx'}", "train")
    write_idx(tmp_path / "short.idx", np.zeros((3, 4, 4), np.uint8), gz=False)
    (tmp_path / "short.idx").write_bytes((tmp_path / "short.idx").read_bytes()[:-5])
    with pytest.raises(UserError, match="IDX header says"):
        open_source(f"idx:{tmp_path / 'short.idx'}", "train")
    np.savez(tmp_path / "f.npz", images=np.zeros((2, 4, 4), np.float32))
    with pytest.raises(UserError, match="'images' of uint8"):
        open_source(f"npz:{tmp_path / 'f.npz'}", "train")
    with pytest.raises(UserError, match="positive integer"):
        open_source("synthetic:-3", "train")
    with pytest.raises(UserError, match="splits 'train' and 'val'"):
        open_source("digits", "test")
    buf = io.BytesIO()
    np.save(buf, np.zeros(3))
    (tmp_path / "not.npz").write_bytes(buf.getvalue()[:10])
    with pytest.raises(UserError, match="does not parse as .npz"):
        open_source(f"npz:{tmp_path / 'not.npz'}", "train")


# --- --overwrite replaces a split without ever losing it; --split is a plain name ------------------------

# `ssl-vit data convert ARGS` with os.replace (or shutil.rmtree) failing with OSError, or the process dying
# (os._exit, as a kill would), the first time it moves a file to (removes) a path ending in FAIL_ON.
CONVERT_WITH_FAULT = """
import os, shutil, sys
fail_on, how = sys.argv[1], sys.argv[2]
def faulty(real, target_arg):
    def call(*args, **kwargs):
        global fail_on
        target = str(args[target_arg])
        if fail_on and target.endswith(fail_on):
            if how == "kill":
                os._exit(9)
            fail_on = None
            raise OSError(28, "No space left on device (injected)", target)
        return real(*args, **kwargs)
    return call
os.replace, shutil.rmtree = faulty(os.replace, 1), faulty(shutil.rmtree, 0)
from ssl_vit.cli import main
sys.exit(main(sys.argv[3:]))
"""


def convert_with_fault(fail_on: str, how: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-c",
            CONVERT_WITH_FAULT,
            fail_on,
            how,
            "data",
            "convert",
            "--order",
            "source",
            *args,
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )


def snapshot(directory: Path) -> dict[str, bytes | None]:
    """Every entry of `directory` (hidden ones too): file bytes, None for a directory."""
    return {p.name: p.read_bytes() if p.is_file() else None for p in sorted(directory.iterdir())}


def assert_one_line_error(proc, *words: str) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("ssl-vit: error: "), proc.stderr
    for word in words:
        assert word in proc.stderr, proc.stderr
    return proc.stderr.strip()


def assert_inspect_passes(cli, outdir: Path, split: str, samples: int) -> None:
    manifest = json.loads((outdir / f"{split}.json").read_text())
    assert manifest["num_samples"] == samples
    urls = [str(outdir / s["url"]) for s in manifest["shards"]]
    proc = cli("data", "inspect", *urls)
    assert f"{samples} good samples in {len(urls)} shards" in proc.stdout and "0 problems" in proc.stdout
    shards = sorted(
        p.name for p in outdir.iterdir() if re.fullmatch(rf"{split}-\d+\.tar", p.name) and p.is_file()
    )
    assert shards == sorted(s["url"] for s in manifest["shards"])  # no stray shard beside the manifest


@pytest.fixture
def old_split(tmp_path) -> tuple[Path, dict[str, bytes | None]]:
    """OUTDIR holding split train: 30 samples in 3 shards, and split val, which must never be touched."""
    convert("synthetic:30", tmp_path / "out", shard_size=10, progress=False, order="source")
    convert("synthetic:7", tmp_path / "out", split="val", shard_size=10, progress=False, order="source")
    return tmp_path / "out", snapshot(tmp_path / "out")


@pytest.mark.parametrize(
    "fail_on",
    [".train.old/train-000001.tar", "out/train-000003.tar", "out/train.json"],
    ids=["setting-old-aside", "between-new-shards", "final-manifest-move"],
)
def test_overwrite_that_fails_at_any_move_keeps_the_old_split(cli, old_split, fail_on):
    """The new set (50 samples, 5 shards) replaces the old one (30, 3): a failure while the old files
    are set aside, after some new shards went in under the old ones' names, or at the last move (the
    manifest) leaves exactly the old split and its manifest, and nothing else."""
    outdir, before = old_split
    proc = convert_with_fault(
        fail_on, "raise", "synthetic:50", str(outdir), "--shard-size", "10", "--overwrite"
    )
    assert_one_line_error(proc, "moving the new split 'train'", "injected", "the old split is kept")
    assert snapshot(outdir) == before  # same files, same bytes; no .train.partial or .train.old left
    assert_inspect_passes(cli, outdir, "train", 30)


def test_a_directory_in_the_way_is_refused_before_anything_is_written(cli, old_split):
    outdir, _ = old_split
    (outdir / "train-000003.tar").mkdir()  # where the new set's 4th shard would go
    before = snapshot(outdir)
    proc = cli(
        "data", "convert", "--order", "source", "synthetic:50", str(outdir), "--shard-size", "10",
        "--overwrite", "--no-progress",
        check=False,
    )  # fmt: skip
    assert_one_line_error(proc, f"{outdir / 'train-000003.tar'} is in the way", "move it out")
    assert snapshot(outdir) == before
    assert_inspect_passes(cli, outdir, "train", 30)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kill_on, survivor",
    [("out/train-000003.tar", 30), ("out/train.json", 30), ("out/.train.old", 50)],
    ids=["between-new-shards", "at-the-manifest", "deleting-the-old-set"],
)
def test_a_conversion_killed_mid_swap_is_finished_by_the_next_one(cli, old_split, kill_on, survivor):
    """A kill leaves the old files in .train.old; the next conversion into OUTDIR first restores the old
    split (new manifest not in yet) or keeps the new one (manifest in), then does its own work."""
    outdir, before = old_split
    proc = convert_with_fault(
        kill_on, "kill", "synthetic:50", str(outdir), "--shard-size", "10", "--overwrite"
    )
    assert proc.returncode == 9, proc.stderr
    assert (outdir / ".train.old").is_dir()

    proc = cli(
        "data", "convert", "--order", "source", "synthetic:5", str(outdir), "--no-progress", check=False
    )
    assert proc.returncode == 2 and "finished the interrupted conversion of split 'train'" in proc.stderr
    assert (
        proc.stderr.strip().splitlines()[-1].startswith("ssl-vit: error: ") and "--overwrite" in proc.stderr
    )
    if survivor == 30:
        assert snapshot(outdir) == before
    assert not (outdir / ".train.old").exists() and not (outdir / ".train.partial").exists()
    assert_inspect_passes(cli, outdir, "train", survivor)
    assert_inspect_passes(cli, outdir, "val", 7)


def test_overwrite_with_fewer_shards_leaves_no_stale_shard_and_other_splits_alone(cli, old_split):
    outdir, before = old_split
    (outdir / "train-extra-000000.tar").write_bytes(b"a split called train-extra")
    cli(
        "data",
        "convert",
        "--order",
        "source",
        "synthetic:12",
        str(outdir),
        "--shard-size",
        "10",
        "--overwrite",
        "--no-progress",
    )
    assert_inspect_passes(cli, outdir, "train", 12)
    after = snapshot(outdir)
    assert sorted(after) == sorted(
        [
            "train-000000.tar",
            "train-000001.tar",
            "train.json",
            "train-extra-000000.tar",
            *[n for n in before if n.startswith("val")],
        ]
    )
    assert {n: after[n] for n in before if n.startswith("val")} == {
        n: before[n] for n in before if n.startswith("val")
    }


@pytest.mark.parametrize("split", ["../x", "a/b", "/tmp/x"])
def test_split_must_be_a_plain_name(cli, tmp_path, split):
    proc = cli(
        "data",
        "convert",
        "--order",
        "source",
        "synthetic:5",
        str(tmp_path / "out"),
        "--split",
        split,
        check=False,
    )
    assert_one_line_error(proc, f"--split {split!r} is not a plain name", "letters, digits")
    assert list(tmp_path.iterdir()) == []  # not even OUTDIR


def test_split_names_that_are_not_plain(tmp_path):
    for split in (".hidden", "x/../../y", "..", "a..b", "", "tr ain", "x\\y", "val\n"):
        with pytest.raises(UserError, match="is not a plain name"):
            convert("synthetic:5", tmp_path / "out", split=split, progress=False, order="source")
    assert list(tmp_path.iterdir()) == []
    for split in ("train", "val", "test-2", "in1k_train.v2"):
        check_split_name(split)
