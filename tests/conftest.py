"""Shared test fixtures. Sub-areas keep their own fixtures next to their tests."""

import os

# `make test` runs two test processes (pytest-xdist) on as many cores. OpenMP's threads otherwise spin
# while they wait for work, taking the core the other process needs: a 5 s fit took 11 s beside one
# busy core, 6 s with passive waiting. Set before torch (libgomp reads it when it loads); the commands
# and ranks the tests start inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
from cli_helpers import RUNNING, run_cli, skip_or_fail  # noqa: E402, F401  (skip_or_fail: re-exported for older imports)


@pytest.fixture(autouse=True)
def no_command_left_running():
    """A command a test started and did not wait for (it failed first) is killed at its end, not left
    to compete with the next tests for the CPU (or to hold a run directory's lock)."""
    yield
    for command in list(RUNNING):
        command.kill()
        command.wait()


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture(scope="session")
def digits_shards(tmp_path_factory):
    """The bundled digits as shards, written once per session by the CLI: train (5 shards) and val (4), in
    scikit-learn's order (digits 0-9 in turn; the tests' expected numbers were measured on it)."""
    out = tmp_path_factory.mktemp("digits")
    order = ("--order", "source")
    run_cli(
        "data",
        "convert",
        "digits",
        str(out),
        "--split",
        "train",
        "--shard-size",
        "300",
        *order,
        "--no-progress",
    )
    run_cli(
        "data",
        "convert",
        "digits",
        str(out),
        "--split",
        "val",
        "--shard-size",
        "100",
        *order,
        "--no-progress",
    )
    return out


@pytest.fixture(scope="session")
def band_shards(tmp_path_factory):
    """Five-band uint16 shards of 4 classes, 32 px, by `ssl-vit data convert tiff:`: train (48 images, 2
    shards) and val (16, 1 shard); see `band_shards.py`."""
    from band_shards import convert_band_tiffs

    return convert_band_tiffs(tmp_path_factory.mktemp("bands"), {"train": 12, "val": 4})


@pytest.fixture(scope="session")
def band_masks(tmp_path_factory):
    """Five-band mosaics with segmentation masks: train (40 images, 2 shards) and test (20, 1 shard)."""
    from band_shards import write_band_masks

    return write_band_masks(tmp_path_factory.mktemp("band_masks"), {"train": 40, "test": 20})


@pytest.fixture(scope="session")
def digits_batch():
    """16 real digit images as a normalised model batch (B, 3, 32, 32), ImageNet mean/std."""
    import torch
    import torch.nn.functional as F
    from sklearn.datasets import load_digits
    from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

    digits = load_digits()
    pixels = torch.tensor(digits.images[:16], dtype=torch.float32)[:, None] / 16
    pixels = F.interpolate(pixels, size=32, mode="bilinear").clamp(0, 1)
    pixels = pixels * torch.tensor([1.0, 0.6, 0.3]).view(1, 3, 1, 1)  # some colour, so colour classes vary
    mean, std = (
        torch.tensor(IMAGENET_DEFAULT_MEAN).view(1, 3, 1, 1),
        torch.tensor(IMAGENET_DEFAULT_STD).view(1, 3, 1, 1),
    )
    return {"image": (pixels - mean) / std, "label": torch.tensor(digits.target[:16])}
