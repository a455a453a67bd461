"""Images of any band count and bit depth through `ssl-vit data convert` and `ShardDataModule`: 16-bit
values survive exactly, N-band shards stream in the train and eval presets with and without masks,
each band is normalised by its own mean and std (given, or `auto` from the manifest), the array path
draws the PIL path's crops and flips, members of another band count or dtype are skipped and counted,
and a class carried by one band alone is there, in that band, in the batches."""

import io
import json
import logging
import shutil

import numpy as np
import pytest
import torch
from bands_helpers import npy, write_array_shard, write_manifest, write_tiff
from PIL import Image
from timm.data import Mixup

from ssl_vit.data import ShardDataModule
from ssl_vit.data.options import grouped
from ssl_vit.errors import BadValue, UserError

SIGNAL_BAND = 3  # the 4th of 5 bands carries the class in `signal_set`, and nothing else does
PER_CLASS = 12


def convert(cli, source: str, out, *extra: str, split: str = "train") -> dict:
    cli("data", "convert", source, str(out), "--split", split, "--order", "source", "--no-progress", *extra)
    return json.loads((out / f"{split}.json").read_text())


def one_pass(dm: ShardDataModule, split: str = "val") -> dict:
    """Every sample of an exact pass as one normalised batch (batch_size above the sample count)."""
    (batch,) = list(dm.exact_dataloader(split))
    return dm.prepare_batch(batch)


def module(urls: str, channels: int, **args) -> ShardDataModule:
    defaults = {"batch_size": 64, "num_workers": 0, "image_size": 16}
    return ShardDataModule(
        **grouped({"train_urls": urls, "val_urls": urls, "channels": channels, **defaults, **args})
    )


@pytest.fixture(scope="module")
def signal_set(tmp_path_factory):
    """24 images of 5 uint16 bands, 16 x 16, in a flat folder with labels.csv (class names `low`,
    `high`): band 3 is about 1000 for `low` and 3000 for `high`; every other band is drawn alike for
    both. Converted by the CLI into 3 shards; returns (OUTDIR, manifest, {key: (array, label)})."""
    from cli_helpers import run_cli

    root = tmp_path_factory.mktemp("signal")
    rng = np.random.default_rng(0)
    rows, arrays = ["filename,label"], []
    for i in range(2 * PER_CLASS):
        label = i % 2
        array = rng.normal(2000, 500, (16, 16, 5)).clip(0, 65535).astype(np.uint16)
        array[:, :, SIGNAL_BAND] = rng.normal(1000 + 2000 * label, 50, (16, 16)).astype(np.uint16)
        write_tiff(root / "tifs" / f"{i:02d}.tif", array, band_first=i % 3 == 0)
        rows.append(f"{i:02d}.tif,{('low', 'high')[label]}")
        arrays.append((array, ("high", "low").index(("low", "high")[label])))  # class names sort: high, low
    (root / "tifs" / "labels.csv").write_text("\n".join(rows) + "\n")
    out = root / "shards"
    run_cli(
        "data",
        "convert",
        f"tiff:{root / 'tifs'}",
        str(out),
        "--shard-size",
        "8",
        "--order",
        "source",
        "--no-progress",
    )
    manifest = json.loads((out / "train.json").read_text())
    return out, manifest, {f"tiff-train-{i:08d}": pair for i, pair in enumerate(arrays)}


def test_16_bit_values_above_255_survive_convert_shards_and_batches_exactly(cli, tmp_path):
    """13 bands of uint16 up to 65535, TIFFs band-last and band-first in class folders -> shards -> an
    eval pass of whole images with mean 0 and std 1: the batch is the files' values, exactly."""
    rng = np.random.default_rng(1)
    arrays = []
    for label, name in enumerate(("forest", "sea")):
        for i in range(3):
            array = rng.integers(0, 65536, (16, 16, 13), dtype=np.uint16)
            array[0, 0] = 65535
            write_tiff(tmp_path / "tifs" / name / f"{i}.tif", array, band_first=i == 1)
            arrays.append((array, label))
    manifest = convert(cli, f"tiff:{tmp_path / 'tifs'}", tmp_path / "out", "--shard-size", "4")
    assert manifest["channels"] == 13 and manifest["dtype"] == "uint16" and manifest["image_format"] == "npy"
    assert manifest["num_samples"] == 6 and manifest["class_names"] == ["forest", "sea"]
    assert manifest["band_stats"]["max"] == [65535.0] * 13 and manifest["band_stats"]["images"] == 6
    whole = np.stack([a for a, _ in arrays]).astype(np.float64)
    assert manifest["band_stats"]["mean"] == pytest.approx(whole.mean(axis=(0, 1, 2)), rel=1e-12)
    assert manifest["band_stats"]["std"] == pytest.approx(whole.std(axis=(0, 1, 2)), rel=1e-12)

    dm = module(str(tmp_path / "out" / "train-{000000..000001}.tar"), 13, mean=(0.0,) * 13, std=(1.0,) * 13)
    batch = one_pass(dm)
    assert batch["image"].dtype == torch.float32 and batch["image"].shape == (6, 13, 16, 16)
    for key, image, label in zip(batch["key"], batch["image"], batch["label"], strict=True):
        array, expected = arrays[int(key.rsplit("-", 1)[1])]
        assert torch.equal(image, torch.from_numpy(array.astype(np.float32)).permute(2, 0, 1))
        assert label == expected


def test_each_band_is_normalised_by_its_own_mean_and_std_and_auto_reads_the_manifest(signal_set):
    out, manifest, arrays = signal_set
    dm = module(str(out / "train-{000000..000002}.tar"), 5, mean="auto", std="auto")
    stats = manifest["band_stats"]
    assert dm.channels == 5 and dm.mean == tuple(stats["mean"]) and dm.std == tuple(stats["std"])
    batch = one_pass(dm)
    mean, std = torch.tensor(stats["mean"]).view(5, 1, 1), torch.tensor(stats["std"]).view(5, 1, 1)
    for key, image in zip(batch["key"], batch["image"], strict=True):
        raw = torch.from_numpy(arrays[key][0].astype(np.float32)).permute(2, 0, 1)
        torch.testing.assert_close(image, (raw - mean) / std, rtol=1e-5, atol=1e-5)
    assert abs(batch["image"].mean(dim=(0, 2, 3))).max() < 1e-4  # the stats are over these very images


def test_a_class_carried_by_one_band_alone_separates_in_that_band(signal_set):
    """Training batches (random crops and flips) of the set whose class only band 3 carries: in band 3
    every `high` image's mean is above every `low` image's, far beyond the spread between the classes in
    any other band."""
    out, _, _ = signal_set
    dm = module(str(out / "train-{000000..000002}.tar"), 5, mean="auto", std="auto", batch_size=8)
    dm.setup("fit")
    means, labels = [], []
    for batch in dm.train_dataloader():
        batch = dm.prepare_batch(batch)
        means.append(batch["image"].mean(dim=(2, 3)))
        labels.append(batch["label"])
    means, labels = torch.cat(means), torch.cat(labels)
    high, low = means[labels == 0], means[labels == 1]
    assert len(high) and len(low)
    assert high[:, SIGNAL_BAND].min() > low[:, SIGNAL_BAND].max()
    gaps = (high.mean(0) - low.mean(0)).abs()
    others = torch.cat([gaps[:SIGNAL_BAND], gaps[SIGNAL_BAND + 1 :]])
    assert gaps[SIGNAL_BAND] > 10 * others.max(), gaps


def smooth(seed: int, size: int = 32) -> np.ndarray:
    """An asymmetric smooth uint8 RGB image (gradients), where a crop or flip elsewhere shows."""
    yy, xx = np.mgrid[0:size, 0:size] / (size - 1)
    a, b = 40 + 7 * seed, 20 + 5 * seed
    image = np.stack([a * xx + b * yy, 200 * xx, 60 + 150 * yy * xx], axis=2) + 20
    return image.clip(0, 255).astype(np.uint8)


@pytest.mark.parametrize("preset", ["pretrain", "eval"])
def test_the_array_path_draws_the_pil_paths_crops_and_flips(tmp_path, preset):
    """The same pixels as 8-bit PNGs (PIL path) and as uint16 npy arrays (array path, torchvision):
    with one seed the training batches hold the same crops, flips and keys, to within the resamplers'
    rounding; a different box or flip would be off by tens of levels."""
    urls = {}
    for kind in ("png", "npy"):
        for shard in range(2):
            samples = []
            for i in range(4):
                pixels = smooth(4 * shard + i)
                if kind == "png":
                    buf = io.BytesIO()
                    Image.fromarray(pixels).save(buf, format="PNG")
                    member = buf.getvalue()
                else:
                    member = npy(pixels.astype(np.uint16))
                samples.append({"__key__": f"s{shard}-{i}", kind: member, "cls": str(i % 2)})
            write_array_shard(tmp_path / kind / f"train-{shard:06d}.tar", samples)
        urls[kind] = str(tmp_path / kind / "train-{000000..000001}.tar")
    batches = {}
    for kind, url in urls.items():
        dm = module(url, 3, mean=(0.0,) * 3, std=(1.0,) * 3, batch_size=4, train_batches=2,
                    train_preset=preset, crop_scale=(0.3, 1.0), seed=7)  # fmt: skip
        dm.setup("fit")
        batches[kind] = [dm.prepare_batch(b) for b in dm.train_dataloader()]
    for pil, array in zip(batches["png"], batches["npy"], strict=True):
        assert pil["key"] == array["key"]
        assert (pil["image"] * 255 - array["image"]).abs().max() < 3
    flipped = batches["npy"][0]["image"].flip(-1)
    assert (batches["png"][0]["image"] * 255 - flipped).abs().max() > 20


def mask_shards(root, with_masks: bool) -> str:
    """2 shards of 5-band uint16 images, 24 x 20, whose band 0 is 1000 x (class + 1) of the mask beside
    them (blocks of classes 0, 1, 2; 255 in one corner)."""
    rng = np.random.default_rng(3)
    for shard in range(2):
        samples = []
        for i in range(3):
            mask = np.zeros((20, 24), np.uint8)
            mask[:, 8:] = 1
            mask[10:, 16:] = 2
            mask[:4, :4] = 255
            image = rng.integers(0, 4000, (20, 24, 5), dtype=np.uint16)
            image[:, :, 0] = np.where(mask == 255, 0, 1000 * (mask.astype(np.uint16) + 1))
            sample = {"__key__": f"m{shard}-{i}", "npy": npy(image), "cls": "1"}
            if with_masks:
                buf = io.BytesIO()
                Image.fromarray(mask).save(buf, format="PNG")
                sample["seg.png"] = buf.getvalue()
            samples.append(sample)
        write_array_shard(root / f"train-{shard:06d}.tar", samples)
    return str(root / "train-{000000..000001}.tar")


@pytest.mark.parametrize("preset", ["pretrain", "eval"])
def test_masks_follow_n_band_images_and_leave_them_as_they_are_without_masks(tmp_path, preset):
    """Wherever a crop's band 0 is one class's value (inside a block, to within float rounding), the
    mask holds that class; the images are those of the same shards without masks, seed for seed."""
    batches = {}
    for with_masks in (True, False):
        urls = mask_shards(tmp_path / str(with_masks), with_masks)
        dm = module(urls, 5, mean=(0.0,) * 5, std=(1.0,) * 5, batch_size=3, train_batches=2,
                    train_preset=preset, image_size=12, crop_scale=(0.3, 1.0))  # fmt: skip
        dm.setup("fit")
        batches[with_masks] = [dm.prepare_batch(b) for b in dm.train_dataloader()]
    inside = 0
    for masked, plain in zip(batches[True], batches[False], strict=True):
        assert torch.equal(masked["image"], plain["image"]) and "mask" not in plain
        band, mask = masked["image"][:, 0], masked["mask"]
        assert mask.dtype == torch.uint8 and mask.shape == band.shape
        for cls in (0, 1, 2):
            exact = (band - 1000 * (cls + 1)).abs() < 0.01  # bilinear weights sum to 1 within rounding
            inside += int(exact.sum())
            assert (mask[exact] == cls).all()
        assert (mask[band.abs() < 0.01] == 255).all()
    assert inside > 0.5 * batches[True][0]["mask"].numel() * len(batches[True])


def test_members_of_another_band_count_or_dtype_are_skipped_and_counted(tmp_path, caplog):
    """A split whose manifest says 5 bands of uint16: a 4-band member and a float32 one are bad
    samples, named with their reason; the 5-band uint16 ones (npy and band-first tif) pass."""
    rng = np.random.default_rng(4)
    good = rng.integers(0, 9000, (16, 16, 5), dtype=np.uint16)
    tif = io.BytesIO()
    import tifffile

    tifffile.imwrite(tif, np.moveaxis(good, 2, 0), photometric="minisblack", planarconfig="separate")
    samples = [
        {"__key__": "good-npy", "npy": npy(good), "cls": "0"},
        {"__key__": "good-fortran", "npy": npy(good, fortran=True), "cls": "1"},
        {"__key__": "good-tif", "tif": tif.getvalue(), "cls": "0"},
        {"__key__": "four-bands", "npy": npy(good[:, :, :4]), "cls": "1"},
        {"__key__": "float", "npy": npy(good.astype(np.float32)), "cls": "0"},
    ]
    write_array_shard(tmp_path / "val-000000.tar", samples)
    write_manifest(tmp_path, "val", [5], channels=5, dtype="uint16", image_size=[16, 16])
    dm = module(str(tmp_path / "val-000000.tar"), 5, mean=(0.0,) * 5, std=(1.0,) * 5)
    with caplog.at_level(logging.WARNING, logger="ssl_vit.data"):
        (batch,) = list(dm.exact_dataloader("val"))
    assert sorted(batch["key"]) == ["good-fortran", "good-npy", "good-tif"] and int(batch["skipped"]) == 2
    for image in dm.prepare_batch(batch)["image"]:
        assert torch.equal(image, torch.from_numpy(good.astype(np.float32)).permute(2, 0, 1))
    text = caplog.text
    assert "four-bands" in text and "npy has 4 bands, the data module reads channels 5" in text
    assert "float" in text and "npy is float32, its split's manifest says dtype uint16" in text


def test_timm_mixup_and_cutmix_blend_every_band(signal_set):
    """timm's Mixup, which the data module applies on the device, on a 5-band batch: mixup blends all
    bands with one lambda, cutmix pastes one box through all of them."""
    out, _, _ = signal_set
    batch = one_pass(module(str(out / "train-{000000..000002}.tar"), 5, mean="auto", std="auto"))
    x, y = batch["image"][:8].clone(), batch["label"][:8]
    mixed, target = Mixup(mixup_alpha=1.0, cutmix_alpha=0.0, label_smoothing=0.0, num_classes=2)(x.clone(), y)
    lam = float(target[0, y[0]]) if y[0] != y.flip(0)[0] else None
    assert mixed.shape == (8, 5, 16, 16)
    if lam is not None:
        torch.testing.assert_close(mixed, lam * x + (1 - lam) * x.flip(0), rtol=1e-5, atol=1e-5)
    cut, _ = Mixup(mixup_alpha=0.0, cutmix_alpha=1.0, label_smoothing=0.0, num_classes=2)(x.clone(), y)
    pasted = (cut != x).any(dim=0)  # [5, H, W]: where some image changed
    assert torch.equal(pasted[0], pasted[SIGNAL_BAND]) and torch.equal(pasted[0], pasted[4])


def test_data_module_mistakes_about_bands_are_one_line(signal_set, tmp_path):
    out, _, _ = signal_set
    urls = str(out / "train-{000000..000002}.tar")
    mistakes = [
        (dict(channels=5, randaugment="rand-m9-mstd0.5"), BadValue, "randaugment is timm's RandAugment"),
        (dict(channels=5), BadValue, "mean has 3 values (the default: ImageNet's RGB) for channels 5"),
        (dict(channels=5, mean=(0.0,) * 5, std=(1.0,) * 4), BadValue, "std has 4 values for channels 5"),
        (dict(channels=5, mean=(0.0,) * 5, std=(1.0, 1.0, 0.0, 1.0, 1.0)), BadValue, "all above 0"),
        (dict(channels=5, mean="mean", std=(1.0,) * 5), BadValue, "give 5 numbers (one per band) or 'auto'"),
    ]
    for args, kind, words in mistakes:
        with pytest.raises(kind, match=None) as err:
            module(urls, **args)
        assert words in str(err.value) and "\n" not in str(err.value), err.value
    bare = tmp_path / "bare"
    shutil.copytree(out, bare)
    manifest = json.loads((bare / "train.json").read_text())
    del manifest["band_stats"]
    (bare / "train.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match="mean 'auto' reads the manifest's band_stats, and their manifest"):
        module(str(bare / "train-{000000..000002}.tar"), 5, mean="auto", std="auto")
    rgb = module(urls, 3)  # ImageNet's defaults fit 3 channels, but the shards hold 5
    with pytest.raises(
        UserError, match="their manifest says 5 channels of uint16, data.init_args.channels is 3"
    ):
        rgb.exact_dataloader("val")


def test_bench_feed_streams_n_band_shards_and_says_they_were_decoded_on_the_cpu(cli, signal_set, tmp_path):
    """`ssl-vit bench feed --shards` over 5-band uint16 shards (channels, mean and std from their
    manifest) with `--decode device`: arrays take the CPU path, and each row says so (100%). The step's
    side comes from a `bench step` report given with `--step-json`, so nothing of the model runs."""
    out, _, _ = signal_set
    config = {
        "variant": "Ti/8",
        "depth": None,
        "img_size": 16,
        "batch_size": 2,
        "device": "cpu",
        "compile": False,
    }
    rows = [{"name": "plain", "images_per_s": 1.0}, {"name": "mae", "images_per_s": 50.0}]
    (tmp_path / "step.json").write_text(json.dumps([{"config": config, "rows": rows}]))
    shards, files = (
        str(out / "train-{000000..000002}.tar"),
        [str(tmp_path / "step.json"), str(tmp_path / "feed.json")],
    )
    proc = cli("bench", "feed", "--shards", shards, "--workers", "0", "--decode", "device", "--variant",
               "Ti/8", "--img-size", "16", "--batch-size", "2", "--batches", "2", "--step-json", files[0],
               "--json", files[1])  # fmt: skip
    (row,) = json.loads((tmp_path / "feed.json").read_text())["rows"]
    assert row["on_cpu"] == 1.0 and row["images_per_s"] > 0
    assert "| workers | img/s | per worker | decoded on the CPU | feed / step (mae) |" in proc.stdout
    assert "| 0 (in-process) |" in proc.stdout and "| 100% |" in proc.stdout


def test_device_decoding_places_jpegs_beside_16_bit_arrays_in_model_units(tmp_path):
    """`decode: device` (here on the CPU) with JPEGs and 3-band uint16 arrays in one batch: the JPEGs are
    decoded where the batch lands, the arrays in the workers; the batch is float32 in model units, the
    JPEGs' crops in [0, 1] and the arrays' at their stored 40,000, each at its place."""
    samples = []
    for i in range(4):
        if i % 2:
            samples.append(
                {"__key__": f"a{i}", "npy": npy(np.full((24, 24, 3), 40_000, np.uint16)), "cls": "0"}
            )
        else:
            buf = io.BytesIO()
            Image.fromarray(smooth(i, 24)).save(buf, format="JPEG")
            samples.append({"__key__": f"j{i}", "jpg": buf.getvalue(), "cls": "1"})
    write_array_shard(tmp_path / "train-000000.tar", samples)
    dm = module(str(tmp_path / "train-000000.tar"), 3, mean=(0.0,) * 3, std=(1.0,) * 3, batch_size=4,
                train_batches=1, decode="device", shuffle_buffer=1)  # fmt: skip
    dm.setup("fit")
    (batch,) = [dm.prepare_batch(b) for b in dm.train_dataloader()]
    assert int(batch["decoded_on_cpu"]) == 2 and batch["image"].dtype == torch.float32
    for key, image in zip(batch["key"], batch["image"], strict=True):
        if key.startswith("a"):
            torch.testing.assert_close(image, torch.full_like(image, 40_000.0))  # float resampling
        else:
            assert 0 <= image.min() and image.max() <= 1 and image.max() > 0.2
