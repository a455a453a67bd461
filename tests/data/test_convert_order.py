"""`data convert` writes a split in a seeded random order by default (class folders no longer become
shards of one class each), `--order source` keeps the source's order, and `data inspect` reports the
shards' class mix and warns in one line when they are sorted by class."""

import hashlib
import json

import numpy as np
from PIL import Image


def class_folders(root, classes=4, per_class=12):
    rng = np.random.default_rng(0)
    for c in range(classes):
        (root / f"class{c}").mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(
                root / f"class{c}/{i:02d}.png"
            )
    return root


def shard_classes(out):
    manifest = json.loads((out / "train.json").read_text())
    import webdataset as wds

    return manifest, [
        {int(s["cls"]) for s in wds.WebDataset(str(out / shard["url"]), shardshuffle=False)}
        for shard in manifest["shards"]
    ]


def digest(out):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.glob("*.tar"))}


def test_class_folders_are_written_in_a_seeded_random_order(tmp_path, cli):
    folders = class_folders(tmp_path / "folders")
    args = ("data", "convert", f"imagefolder:{folders}")
    cli(*args, str(tmp_path / "a"), "--shard-size", "12", "--no-progress")
    manifest, classes = shard_classes(tmp_path / "a")
    assert manifest["order"] == "random" and manifest["order_seed"] == 0
    assert all(len(c) >= 2 for c in classes)  # no shard of one class
    inspected = cli("data", "inspect", str(tmp_path / "a" / "train-{000000..000003}.tar"))
    assert "class mix:" in inspected.stdout and "sorted by class" not in inspected.stdout
    cli(*args, str(tmp_path / "b"), "--shard-size", "12", "--no-progress")
    assert digest(tmp_path / "a") == digest(tmp_path / "b")  # decided by the seed alone
    cli(*args, str(tmp_path / "c"), "--shard-size", "12", "--seed", "1", "--no-progress")
    assert digest(tmp_path / "c") != digest(tmp_path / "a")

    cli(*args, str(tmp_path / "s"), "--shard-size", "12", "--order", "source", "--no-progress")
    manifest, classes = shard_classes(tmp_path / "s")
    assert manifest["order"] == "source" and "order_seed" not in manifest
    assert classes == [{0}, {1}, {2}, {3}]
    inspected = cli("data", "inspect", str(tmp_path / "s" / "train-{000000..000003}.tar"))
    assert inspected.returncode == 0
    warnings = [line for line in inspected.stdout.splitlines() if "sorted by class" in line]
    assert len(warnings) == 1 and "reconvert with `ssl-vit data convert`" in warnings[0]
    assert "class mix: 1.0 classes per shard" in inspected.stdout


def test_a_negative_seed_is_one_line(tmp_path, cli):
    folders = class_folders(tmp_path / "folders", classes=2, per_class=2)
    proc = cli(
        "data", "convert", f"imagefolder:{folders}", str(tmp_path / "out"), "--seed", "-1", check=False
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "--seed" in proc.stderr
    assert not (tmp_path / "out").exists()
