"""Samples a task cannot use are skipped and counted, never fatal: an image without a label (-1) where
the task trains or scores on labels (self-supervised tasks read it), and an image larger than
`max_image_pixels`, skipped from its header without being decoded."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from cli_helpers import one_step_fit_args

ROOT = Path(__file__).resolve().parents[2]
UNLABELLED = [3, 10, 17, 24, 31]  # positions of the images written without a label


def write_npz(path: Path, n: int, seed: int, size: int = 32, unlabelled=()) -> Path:
    """`n` random images with labels 0-9 in turn, -1 at the positions `unlabelled`."""
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8)
    labels = np.arange(n) % 10
    labels[list(unlabelled)] = -1
    np.savez(path, images=images, labels=labels)
    return path


@pytest.fixture(scope="module")
def partly_labelled(tmp_path_factory, digits_shards):
    """The digits' shards beside 40 + 40 images of which 5 per split have no label, and the same 35 + 35
    without those."""
    from cli_helpers import run_cli

    root = tmp_path_factory.mktemp("partly")
    for split, seed in (("train", 0), ("test", 1)):
        write_npz(root / f"{split}.npz", 40, seed, unlabelled=UNLABELLED)
        run_cli("data", "convert", "--order", "source", f"npz:{root / f'{split}.npz'}", str(root / "mixed"),
                "--split", split, "--shard-size", "20", "--no-progress")  # fmt: skip
        data = np.load(root / f"{split}.npz")
        keep = data["labels"] >= 0
        np.savez(root / f"{split}_labelled.npz", images=data["images"][keep], labels=data["labels"][keep])
    return root


def test_a_supervised_fit_skips_and_counts_unlabelled_images_and_a_masked_one_reads_them(
    partly_labelled, digits_shards, tmp_path, cli
):
    manifest = json.loads((partly_labelled / "mixed" / "train.json").read_text())
    assert manifest["class_counts"]["-1"] == len(UNLABELLED)
    urls = str(partly_labelled / "mixed" / "train-{000000..000001}.tar")
    common = ["--data.init_args.train_urls", urls, "--data.init_args.train_batches", "4",
              "--data.init_args.batch_size", "16", "--trainer.logger", "false"]  # fmt: skip
    supervised = cli(*one_step_fit_args(digits_shards, tmp_path / "sup", *common, config="supervised"))
    skipped = [line for line in supervised.stderr.splitlines() if "skipping bad sample" in line]
    assert skipped and all("no label, and the task trains or scores on labels" in line for line in skipped)
    assert (tmp_path / "sup" / "checkpoints" / "last.ckpt").exists()
    checkpoint = torch.load(tmp_path / "sup" / "checkpoints" / "last.ckpt", weights_only=False)
    assert checkpoint["global_step"] == 4
    masked = cli(*one_step_fit_args(digits_shards, tmp_path / "mpp", *common))
    assert "no label" not in masked.stderr, masked.stderr  # self-supervised: unlabelled images are data


def write_suite(path, shards, protocols):
    suite = {
        "backbone": {"variant": "S/8", "img_size": 32, "width": 32, "depth": 1, "heads": 2},
        "data": {"train_urls": str(shards / "train-{000000..000001}.tar"),
                 "test_urls": str(shards / "test-{000000..000001}.tar"), "image_size": 32, "batch_size": 16,
                 "num_workers": 0, "num_classes": 10},
        "resamples": 100,
        "protocols": protocols,
    }  # fmt: skip
    path.write_text(yaml.safe_dump(suite))
    return path


def test_every_evaluation_kind_leaves_unlabelled_images_out_and_says_how_many(partly_labelled, tmp_path, cli):
    """The same suite on the partly labelled shards and on shards without the unlabelled images: the
    frozen-feature kinds give the same numbers (the unlabelled images neither vote, train, nor count as
    wrong), results.json and a note say how many were left out, and a fine-tune trains on the labelled."""
    from cli_helpers import run_cli

    for split in ("train", "test"):
        run_cli("data", "convert", "--order", "source", f"npz:{partly_labelled / f'{split}_labelled.npz'}",
                str(partly_labelled / "labelled"), "--split", split, "--shard-size", "20",
                "--no-progress")  # fmt: skip
    protocols = [
        {"name": "fewshot", "kind": "fewshot", "feature": "mean", "shots": [1, 2], "seeds": [0]},
        {"name": "knn", "kind": "knn", "feature": "mean", "k": 3},
        {"name": "linear", "kind": "linear_probe", "feature": "mean", "augmentation": "eval", "epochs": 2,
         "lrs": [0.1]},
        {"name": "ft", "kind": "finetune", "steps": 1, "batch_size": 8},
    ]  # fmt: skip
    records, notes = {}, {}
    for name in ("mixed", "labelled"):
        suite = write_suite(tmp_path / f"{name}.yaml", partly_labelled / name, protocols)
        proc = cli("evaluate", "scratch", "--suite", str(suite), "--out", str(tmp_path / name))
        records[name] = json.loads((tmp_path / name / "results.json").read_text())
        notes[name] = [line for line in proc.stderr.splitlines() if "without a label" in line]
    mixed, labelled = records["mixed"], records["labelled"]
    for column in ("fewshot_1shot", "fewshot_2shot", "knn", "linear"):
        assert mixed["results"][column] == labelled["results"][column], column
    assert mixed["details"]["knn"]["test_samples"] == 40 - len(UNLABELLED)
    assert mixed["unlabelled"] == {"data": {"train": 5, "test": 5}} and labelled["unlabelled"] == {}
    assert notes["mixed"] == [
        "ssl-vit: note: data: 5 train image(s) without a label were left out of every classification "
        "protocol (give them labels, or drop them from the shards)",
        "ssl-vit: note: data: 5 test image(s) without a label were left out of every classification "
        "protocol (give them labels, or drop them from the shards)",
    ]
    assert notes["labelled"] == []
    assert 0 <= mixed["results"]["ft"] <= 1 and mixed["details"]["ft"]["optimizer_steps"] == 1


def test_an_image_beyond_max_image_pixels_is_skipped_without_decoding(tmp_path, cli):
    """32 x 32 images and one of 48 x 48 (2,304 pixels) under a limit of 1,100: the large one is one
    warning line and one skipped sample, the others are read; a limit below 1 is one line."""
    for name, size in (("small", 32), ("large", 48)):
        write_npz(tmp_path / f"{name}.npz", 4 if name == "small" else 1, 0, size)
        cli("data", "convert", "--order", "source", f"npz:{tmp_path / f'{name}.npz'}", str(tmp_path / name),
            "--split", "val", "--no-progress")  # fmt: skip
    urls = f"{tmp_path}/small/val-000000.tar,{tmp_path}/large/val-000000.tar"
    validate = ["validate", "--config", str(ROOT / "recipes/quickstart/mpp.yaml"), "--ckpt_path", "scratch",
                "--data.init_args.val_urls", f"[{urls}]", "--data.init_args.num_workers", "0",
                "--trainer.logger", "false", "--model.init_args.backbone.width", "32",
                "--model.init_args.backbone.depth", "1"]  # fmt: skip
    proc = cli(*validate, "--data.init_args.limits.max_image_pixels", "1100", cwd=tmp_path)
    (line,) = [line for line in proc.stderr.splitlines() if "skipping bad sample" in line]
    assert "png is 48x48 (2,304 pixels), more than max_image_pixels 1,100: skipped without decoding" in line
    (row,) = [line for line in proc.stdout.splitlines() if "data/skipped_val" in line]
    assert row.split()[-2] == "1.0"
    refused = cli(*validate, "--data.init_args.limits.max_image_pixels", "0", cwd=tmp_path, check=False)
    assert refused.returncode != 0 and refused.stderr.count("\n") == 1, refused.stderr
    assert "max_image_pixels is 0: it should be an integer of at least 1" in refused.stderr
