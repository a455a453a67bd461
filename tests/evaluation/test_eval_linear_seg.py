"""`kind: linear_seg`: per-patch linear heads on frozen patch tokens, scored by mIoU and pixel accuracy
with bootstrap intervals over test images, chosen on held-out training images; masks from
`ssl-vit data convert mosaic:`; a dataset at another image size than the backbone's read through
resampled position embeddings."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from cli_helpers import run_cli

from ssl_vit.models.vit import ViTConfig
from ssl_vit.tasks.seg_probe import LinearSegProbe, upsample

BACKBONE = {"variant": "S/8", "img_size": 16, "width": 32, "depth": 1, "heads": 2}
SEG = {"name": "seg", "kind": "linear_seg", "epochs": 30, "batch_size": 32, "lrs": [0.1, 1.0],
       "augmentation": "eval"}  # fmt: skip
COLOURS = np.array([[230, 30, 30], [30, 230, 30], [30, 30, 230], [230, 230, 30]], dtype=np.uint8)


@pytest.fixture(scope="module")
def mosaics(tmp_path_factory):
    """A separable dense task: 16 px tiles of one solid colour per class (4 classes, a little noise),
    in 2 x 2 mosaics of 32 px whose masks give each tile's class: train (40 mosaics) and test (20)."""
    root = tmp_path_factory.mktemp("mosaics")
    rng = np.random.default_rng(0)
    for split, n in (("train", 160), ("test", 80)):
        labels = rng.integers(0, 4, n)
        noise = rng.integers(-20, 21, (n, 16, 16, 3))
        images = np.clip(COLOURS[labels][:, None, None, :] + noise, 0, 255).astype(np.uint8)
        np.savez(root / f"{split}.npz", images=images, labels=labels)
        run_cli("data", "convert", f"npz:{root / f'{split}.npz'}", str(root / "tiles"), "--split", split,
                "--shard-size", "80", "--format", "png", "--no-progress")  # fmt: skip
        tiles = str(root / "tiles" / f"{split}-{{000000..{n // 80 - 1:06d}}}.tar")
        run_cli("data", "convert", f"mosaic:{tiles}", str(root / "mosaics"), "--split", split, "--grid", "2",
                "--shard-size", "20", "--format", "png", "--no-progress")  # fmt: skip
    return root / "mosaics"


def write_suite(path, mosaics, protocols, image_size=32, backbone=BACKBONE):
    suite = {
        "backbone": backbone,
        "data": {"train_urls": str(mosaics / "train-{000000..000001}.tar"),
                 "test_urls": str(mosaics / "test-000000.tar"), "image_size": image_size, "batch_size": 20,
                 "num_workers": 0},
        "resamples": 200,
        "protocols": protocols,
    }  # fmt: skip
    path.write_text(yaml.safe_dump(suite))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("augmentation", ["eval", "pretrain"])
def test_a_separable_toy_reaches_an_miou_near_1_through_resampled_position_embeddings(
    augmentation, mosaics, tmp_path
):
    """A 16 px backbone reads the 32 px mosaics (position embeddings resampled from 2 x 2 to 4 x 4): the
    per-patch heads separate the tiles' colours, mIoU and pixel accuracy near 1, each with its interval;
    the lr is chosen on held-out mosaics by mIoU."""
    protocol = {**SEG, "augmentation": augmentation, **({} if augmentation == "eval" else {"epochs": 10})}
    suite = write_suite(tmp_path / "s.yaml", mosaics, [protocol])
    run_cli("evaluate", "scratch", "--suite", str(suite), "--out", str(tmp_path / "out"))
    record = json.loads((tmp_path / "out" / "results.json").read_text())
    results, intervals = record["results"], record["intervals"]
    assert set(results) == {"seg_miou", "seg_pixel_acc"}
    assert record["metrics"] == {"seg_miou": "mIoU", "seg_pixel_acc": "pixel accuracy"}
    assert results["seg_miou"] > 0.85 and results["seg_pixel_acc"] > 0.9, results
    for column, value in results.items():
        assert intervals[column]["low"] <= value <= intervals[column]["high"]
        assert intervals[column]["high"] - intervals[column]["low"] < 0.2
    detail = record["details"]["seg"]
    assert detail["selected_by"] == "mIoU" and detail["selected_on"] == "train_urls (held out)"
    assert set(detail["selection"]) == {"0.1", "1"} and detail["best_lr"] in (0.1, 1.0)
    assert detail["training_images"] + detail["selection_images"] == 40


@pytest.mark.slow
def test_compare_gives_mious_their_paired_differences_and_names_the_metric(mosaics, tmp_path):
    suite = write_suite(tmp_path / "s.yaml", mosaics, [{**SEG, "lrs": [1.0], "epochs": 5}])
    out = tmp_path / "out"
    run_cli("compare", "a=scratch", "--scratch", "2", "--baseline", "scratch", "--suite", str(suite),
            "--out", str(out))  # fmt: skip
    table = (out / "results.md").read_text()
    assert "Accuracy (mIoU: seg_miou; pixel accuracy: seg_pixel_acc) in %" in table, table
    assert "| a - scratch |" not in table and "| checkpoint - scratch | seg_miou | seg_pixel_acc |" in table
    verdicts = (out / "verdicts.md").read_text()
    assert "seg_miou (linear segmentation, mIoU, patch tokens)" in verdicts, verdicts
    assert (out / "differences.png").is_file() and (out / "training_curves.png").is_file()


@pytest.mark.parametrize(
    "keys, words",
    [
        ({"classes": [0, 1]}, ["classes keeps images by label", "drop it"]),
        ({"feature": "cls"}, ["feature is 'cls'", "'patches' or 'lastk'"]),
        ({"lrs": [0.1, 0.1]}, ["lrs [0.1, 0.1] repeat"]),
        ({"augmentation": "supervised", "randaugment": "rand-m9-mstd0.5"}, ["randaugment changes an image"]),
    ],
    ids=["classes", "feature", "lrs", "randaugment"],
)
def test_linear_seg_key_mistakes_are_one_line_and_write_nothing(keys, words, mosaics, tmp_path, cli):
    suite = write_suite(tmp_path / "s.yaml", mosaics, [{**SEG, **keys}])
    out = tmp_path / "out"
    proc = cli("evaluate", "scratch", "--suite", str(suite), "--out", str(out), check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"ssl-vit: error: {suite}: protocol 'seg'"), proc.stderr
    for word in words:
        assert word in proc.stderr, proc.stderr
    assert not out.exists()


def test_a_dataset_without_masks_is_one_line(digits_shards, tmp_path, cli):
    suite = tmp_path / "s.yaml"
    suite.write_text(yaml.safe_dump({
        "backbone": {**BACKBONE, "img_size": 32},
        "data": {"train_urls": str(digits_shards / "val-000000.tar"),
                 "test_urls": str(digits_shards / "val-000001.tar"), "image_size": 32, "batch_size": 50,
                 "num_workers": 0},
        "protocols": [{**SEG, "lrs": [0.1], "epochs": 1}],
    }))  # fmt: skip
    out = tmp_path / "out"
    proc = cli("evaluate", "scratch", "--suite", str(suite), "--out", str(out), check=False)
    assert proc.returncode != 0 and proc.stderr.count("\n") == 1, proc.stderr
    assert "the train shards of data carry no segmentation masks (their manifest says so)" in proc.stderr
    assert "mosaic:" in proc.stderr and "features of" not in proc.stdout and not out.exists()


def test_each_head_of_the_segmentation_probe_has_its_own_loss_and_the_training_loss_is_their_sum():
    """`head_losses` (every head's upsampled cross-entropy in one call, 255 ignored) equals each head's
    own cross-entropy; `forward_loss`, which trains them, is their sum."""
    probe = LinearSegProbe(
        ViTConfig(variant="S/8", img_size=32, width=32, depth=1, heads=2), 5, lrs=(0.1, 1.0, 3.0)
    )
    torch.manual_seed(0)
    outputs = torch.randn(3, 4, 5, 4, 4)  # (heads, batch, classes, patch grid)
    masks = torch.randint(0, 5, (4, 32, 32), dtype=torch.uint8)
    masks[0, :10] = 255
    own = torch.stack(
        [F.cross_entropy(upsample(o, (32, 32)), masks.long(), ignore_index=255) for o in outputs]
    )
    torch.testing.assert_close(probe.head_losses(outputs, masks), own)
    torch.testing.assert_close(probe.forward_loss(outputs, masks), own.sum())
