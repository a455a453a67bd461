"""The eval view follows the data: images stored at the model's resolution pass whole; larger ones are
resized and centre-cropped (ImageNet's convention); `results.json` records which."""

import json

import numpy as np
import pytest
import torch
import torchvision.transforms.v2 as v2
import yaml
from cli_helpers import run_cli
from PIL import Image

from ssl_vit.data import ShardDataModule


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """Shards of 6 random RGB images stored at 32 px and of 6 stored at 48 px: (dir, images) each."""
    root = tmp_path_factory.mktemp("eval_view")
    rng = np.random.default_rng(0)
    out = {}
    for size in (32, 48):
        images = rng.integers(0, 256, (6, size, size, 3), dtype=np.uint8)
        np.savez(root / f"px{size}.npz", images=images, labels=np.arange(6) % 2)
        run_cli("data", "convert", f"npz:{root}/px{size}.npz", str(root / f"px{size}"), "--split", "val",
                "--shard-size", "3", "--order", "source", "--no-progress")  # fmt: skip
        out[size] = (root / f"px{size}", images)
    return out


def read_all(datamodule: ShardDataModule) -> torch.Tensor:
    """(N, 3, H, W) uint8 images of the val split's exact pass, in the order the shards store them."""
    return torch.cat([batch["image"] for batch in datamodule.exact_dataloader("val")])


def test_images_at_the_model_resolution_pass_whole(stored):
    shards, images = stored[32]
    dm = ShardDataModule(val_urls=str(shards / "val-00000{0..1}.tar"), image_size=32, num_workers=0)
    assert dm.augment.eval_crop_pct == 0.875 and dm.eval_view("val") == "whole"
    seen = read_all(dm)
    assert torch.equal(seen, torch.from_numpy(images).permute(0, 3, 1, 2))  # not one pixel changed
    # normalisation is the only step left, on the device
    batch = dm.prepare_batch({"image": seen, "label": torch.zeros(6), "key": [""] * 6})
    mean, std = torch.tensor(dm.mean).view(1, 3, 1, 1), torch.tensor(dm.std).view(1, 3, 1, 1)
    torch.testing.assert_close(batch["image"], (seen / 255 - mean) / std)


def test_larger_images_are_resized_and_centre_cropped_as_before(stored):
    shards, images = stored[48]
    dm = ShardDataModule(val_urls=str(shards / "val-00000{0..1}.tar"), image_size=32, num_workers=0)
    assert dm.eval_view("val") == "crop"
    # ImageNet's eval: shorter side to floor(32 / 0.875) = 36, centre crop 32
    imagenet = v2.Compose([v2.Resize(36, antialias=True), v2.CenterCrop(32), v2.PILToTensor()])
    expected = torch.stack([imagenet(Image.fromarray(image)) for image in images])
    assert torch.equal(read_all(dm), expected)
    # the same 48 px images read at 48 px are stored at the model's resolution again
    assert ShardDataModule(val_urls=str(shards / "val-000000.tar"), image_size=48).eval_view("val") == "whole"


def test_results_json_records_the_eval_view(stored, digits_shards, tmp_path):
    suite = {
        "backbone": {"variant": "S/8", "img_size": 32, "width": 32, "depth": 1, "heads": 2},
        "datasets": {
            "digits": {
                "train_urls": str(digits_shards / "val-000000.tar"),
                "test_urls": str(digits_shards / "val-000001.tar"),
            },
            "px48": {
                "train_urls": str(stored[48][0] / "val-000000.tar"),
                "test_urls": str(stored[48][0] / "val-000001.tar"),
                "batch_size": 2,
            },
        },  # fmt: skip
        "protocols": [
            {"name": "knn", "kind": "knn", "k": 3, "dataset": "digits"},
            {"name": "knn48", "kind": "knn", "k": 1, "dataset": "px48"},
        ],
    }
    for data in suite["datasets"].values():
        data.update(image_size=32, num_workers=0)
    (tmp_path / "suite.yaml").write_text(yaml.safe_dump(suite))
    run_cli("evaluate", "scratch", "--suite", str(tmp_path / "suite.yaml"), "--out", str(tmp_path / "out"))
    record = json.loads((tmp_path / "out" / "results.json").read_text())
    assert record["eval_view"] == {
        "digits": {"train": "whole", "test": "whole"},
        "px48": {"train": "crop", "test": "crop"},
    }
