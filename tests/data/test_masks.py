"""Segmentation masks (`seg.png`) in streams: aligned with their images through crop, flip and resize,
bad ones skipped and counted and reported by `data inspect`, and streams without masks unchanged."""

import hashlib
import io
import json

import numpy as np
import pytest
import torch
import webdataset as wds
from cli_helpers import run_cli
from PIL import Image
from test_errors import ROOT

from ssl_vit.data import ShardDataModule
from ssl_vit.data.options import Augment, grouped
from ssl_vit.errors import UserError

THRESHOLD, TILE_CLASS, CLASSES = 128, 7, 10  # masks: 7 where the image is bright, 10 (background) elsewhere


def smooth_images(rng, n: int, height: int, width: int) -> np.ndarray:
    """(n, height, width, 3) uint8: a left-to-right ramp plus large random blobs, so that a mask
    thresholded from it is far from mirror-symmetric; its red channel is the brightest."""
    ramp = np.linspace(0, 255, width)[None, :]
    out = []
    for _ in range(n):
        blobs = Image.fromarray((rng.random((5, 5)) * 255).astype(np.uint8)).resize(
            (width, height), Image.BICUBIC
        )
        grey = 0.55 * ramp + 0.45 * np.asarray(blobs, dtype=np.float64)
        out.append(np.stack([grey, 0.8 * grey, 0.5 * grey], -1).astype(np.uint8))
    return np.stack(out)


def threshold_shards(root, n: int, height: int, width: int, image_format: str = "png"):
    """Shards whose masks are their images' own threshold, written by the CLI: tiles of one class (7 of
    10) as `npz:`, then `mosaic: --grid 1 --background-threshold 128`, so each mask is 7 where the
    image's grey level (its red channel) is >= 128 and 10 (background) elsewhere. Returns the split's
    URL pattern."""
    root.mkdir(parents=True)
    images = smooth_images(np.random.default_rng(0), n, height, width)
    names = np.array([str(c) for c in range(CLASSES)])
    np.savez(root / "tiles.npz", images=images, labels=np.full(n, TILE_CLASS), class_names=names)
    run_cli("data", "convert", f"npz:{root / 'tiles.npz'}", str(root / "tiles"), "--no-progress")
    run_cli(
        "data", "convert", f"mosaic:{root / 'tiles/train-000000.tar'}", str(root / "masked"), "--grid", "1",
        "--background-threshold", str(THRESHOLD), "--format", image_format, "--shard-size", str(n // 2),
        "--no-progress",
    )  # fmt: skip
    return str(root / "masked/train-{000000..000001}.tar")


@pytest.fixture(scope="module")
def jpeg_set(tmp_path_factory):
    """16 images of 96x72 px stored as JPEGs (so the random crops decode at a draft scale)."""
    return threshold_shards(tmp_path_factory.mktemp("masks") / "jpg", 16, 72, 96, "jpg")


def expected_mask(images: torch.Tensor) -> torch.Tensor:
    """uint8 [B,3,H,W] images -> the mask their threshold gives, [B,H,W]."""
    return torch.where(images[:, 0] >= THRESHOLD, TILE_CLASS, CLASSES).to(torch.uint8)


def assert_aligned(images: torch.Tensor, masks: torch.Tensor) -> None:
    """Each mask agrees with its own image's threshold on nearly every pixel (bilinear resampling moves
    the image's threshold line by a fraction of a pixel; a mask left unflipped agrees on far fewer),
    and holds only the two classes (a bilinear mask would hold the values between them)."""
    assert masks.dtype == torch.uint8 and masks.shape == (images.shape[0], *images.shape[2:])
    assert set(masks.unique().tolist()) <= {TILE_CLASS, CLASSES}
    agreement = (masks == expected_mask(images)).float().mean(dim=(1, 2))
    assert agreement.min() >= 0.9 and agreement.mean() >= 0.95, agreement


def train_batches(urls, **kwargs):
    dm = ShardDataModule(**grouped(dict(
        train_urls=urls, batch_size=4, num_workers=0, image_size=16, train_batches=4, shuffle_buffer=8,
        crop_scale=(0.08, 1.0), **kwargs,
    )))  # fmt: skip
    dm.setup("fit")
    return dm, list(dm.train_dataloader())


def test_masks_follow_random_crops_and_flips(jpeg_set, tmp_path):
    dm, batches = train_batches(jpeg_set)
    assert dm.has_masks("train") and dm.num_classes == CLASSES + 1
    for batch in batches:
        assert_aligned(batch["image"], batch["mask"])
        ready = dm.prepare_batch(batch)  # what the model gets: the mask untouched
        assert ready["mask"] is batch["mask"] and ready["image"].dtype == torch.float32

    # the same shards without their masks: the same samples, the same crops and flips, bit for bit
    bare = tmp_path / "bare"
    bare.mkdir()
    for shard in wds.shardlists.expand_urls(jpeg_set):
        with wds.TarWriter(str(bare / shard.rsplit("/", 1)[-1])) as sink:
            for sample in wds.WebDataset(shard, shardshuffle=False, empty_check=False):
                sink.write({k: v for k, v in sample.items() if k in ("__key__", "jpg")})
    _, plain = train_batches(str(bare / "train-{000000..000001}.tar"))
    assert all("mask" not in b for b in plain)
    assert [b["key"] for b in plain] == [b["key"] for b in batches]
    assert all(torch.equal(a["image"], b["image"]) for a, b in zip(plain, batches))


def test_masks_follow_the_device_decoders_crops(jpeg_set):
    """`decode: device`: the worker crops and flips the mask with the box and flip it draws from the
    JPEG header, and the device's decode of the image lands on it (here the CPU is the device)."""
    dm, batches = train_batches(jpeg_set, decode="device", draft=False)
    mean = torch.tensor(dm.mean).view(1, 3, 1, 1)
    std = torch.tensor(dm.std).view(1, 3, 1, 1)
    for batch in batches:
        assert "jpeg" in batch and batch["mask"].shape == (4, 16, 16)  # masks ready in the worker
        ready = dm.prepare_batch(batch)
        pixels = ((ready["image"] * std + mean) * 255).round().clamp(0, 255).to(torch.uint8)
        assert_aligned(pixels, ready["mask"])


def test_eval_frames_masks_like_images(jpeg_set, tmp_path):
    crop = ShardDataModule(val_urls=jpeg_set, batch_size=4, num_workers=2, image_size=16)
    assert crop.eval_view("val") == "crop"  # 96x72 stored: shorter side to 18, centre 16x16
    batches = list(crop.exact_dataloader("val"))
    assert sum(len(b["key"]) for b in batches) == 16
    for batch in batches:
        assert_aligned(batch["image"], batch["mask"])

    # stored at the model's resolution: image and mask pass whole, pixel for pixel as stored
    urls = threshold_shards(tmp_path / "px16", 6, 16, 16)
    whole = ShardDataModule(val_urls=urls, batch_size=6, num_workers=0, image_size=16)
    assert whole.eval_view("val") == "whole"
    stored = {}
    for shard in wds.shardlists.expand_urls(urls):
        for sample in wds.WebDataset(shard, shardshuffle=False, empty_check=False):
            stored[sample["__key__"]] = (
                np.asarray(Image.open(io.BytesIO(sample["png"]))),
                np.asarray(Image.open(io.BytesIO(sample["seg.png"]))),
            )
    for batch in whole.exact_dataloader("val"):
        for key, image, mask in zip(batch["key"], batch["image"], batch["mask"]):
            assert np.array_equal(image.permute(1, 2, 0).numpy(), stored[key][0])
            assert np.array_equal(mask.numpy(), stored[key][1])
    assert len(stored) == 6

    # a crop larger than the resized image (crop_pct 2: 96x72 to 10x8, centre 16x16) pads the image with
    # black and the mask with 255, ignored
    padded = ShardDataModule(
        val_urls=jpeg_set, batch_size=8, num_workers=0, image_size=16, augment=Augment(eval_crop_pct=2.0)
    )
    for batch in padded.exact_dataloader("val"):
        assert (batch["mask"][:, :4] == 255).all() and (batch["image"][:, :, :4] == 0).all()
        assert set(batch["mask"][:, 4:12, 3:13].unique().tolist()) <= {TILE_CLASS, CLASSES}


def test_shards_without_a_manifest_may_mix_samples_with_and_without_masks(tmp_path, caplog):
    """Shards from other tools, no manifest: a sample without seg.png among samples with one gets a
    mask of 255 (no pixel scored), said once; the others keep theirs."""
    rng = np.random.default_rng(4)
    masks = rng.integers(0, 3, (4, 16, 16), dtype=np.uint8)
    with wds.TarWriter(str(tmp_path / "theirs.tar")) as sink:
        for i in range(4):
            image = encoded(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8), "PNG")
            sink.write({"__key__": f"k{i}", "png": image, **({} if i == 2 else {"seg.png": png(masks[i])})})
    dm = ShardDataModule(
        val_urls=str(tmp_path / "theirs.tar"),
        batch_size=2,
        num_workers=0,
        image_size=16,
        augment=Augment(eval_crop_pct=1.0),
    )  # stored at 16 px, no manifest to say so: crop_pct 1 keeps them whole
    assert not dm.has_masks("val")
    with caplog.at_level("WARNING", logger="ssl_vit.data"):
        batches = list(dm.exact_dataloader("val"))
    got = torch.cat([b["mask"] for b in batches])
    assert [k for b in batches for k in b["key"]] == ["k0", "k1", "k2", "k3"] and got.shape == (4, 16, 16)
    assert (got[2] == 255).all() and all(torch.equal(got[i], torch.from_numpy(masks[i])) for i in (0, 1, 3))
    (said,) = [r.getMessage() for r in caplog.records if "without seg.png" in r.getMessage()]
    assert said.startswith("k2 and other samples without seg.png") and "all 255 (ignored)" in said


def test_randaugment_mixup_and_too_few_classes_are_refused_with_masks(jpeg_set):
    with pytest.raises(UserError, match="counts mask classes up to 10, beyond num_classes 8: set data.init"):
        ShardDataModule(train_urls=jpeg_set, num_classes=8)  # every mask holds class 10 (background)
    dm = ShardDataModule(
        train_urls=jpeg_set, image_size=16, num_workers=0, train_batches=1,
        augment=Augment(train_preset="supervised", randaugment="rand-m9-mstd0.5"),
    )  # fmt: skip
    with pytest.raises(UserError, match="RandAugment moves pixels"):
        dm.train_dataloader()
    dm = ShardDataModule(
        train_urls=jpeg_set, image_size=16, num_workers=0, train_batches=1, batch_size=4,
        augment=Augment(train_preset="supervised", cutmix_alpha=1.0),
    )  # fmt: skip
    batch = next(iter(dm.train_dataloader()))
    dm.trainer = type("Trainer", (), {"training": True})()
    with pytest.raises(UserError, match="blend images but not their segmentation masks"):
        dm.on_after_batch_transfer(batch, 0)


# --- bad masks --------------------------------------------------------------------------------------


def png(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


# key -> (what the one line says, how the sample's seg.png is changed)
BAD_MASKS = {
    "bad-size": ("seg.png is 16x15 pixels, its image 16x16", lambda mask: png(mask[:15])),
    "bad-class": (
        "seg.png holds class 12, beyond num_classes 11",
        lambda mask: png(np.where(mask == 7, 12, mask)),
    ),
    "bad-bytes": ("seg.png does not decode", lambda mask: b"\x89PNG\r\n\x1a\n not a mask"),
    "bad-mode": (
        "seg.png does not decode (ValueError: a mode RGB image",
        lambda m: png(np.stack([m] * 3, -1)),
    ),
    "bad-missing": ("no seg.png member, and its split's manifest says every sample has a mask", None),
}


@pytest.fixture(scope="module")
def bad_masks(tmp_path_factory):
    """A split of 6 good 16 px samples with masks, and one shard of 2 good ones plus one of each kind
    of bad mask (the manifest counts them); 255 (ignored) in one good mask is fine."""
    root = tmp_path_factory.mktemp("bad_masks")
    urls = threshold_shards(root / "set", 8, 16, 16)
    shards = root / "set/masked"
    good = list(wds.WebDataset(str(shards / "train-000001.tar"), shardshuffle=False, empty_check=False))
    with wds.TarWriter(str(shards / "train-000001.tar")) as sink:
        for i, sample in enumerate(good[:2]):
            mask = np.asarray(Image.open(io.BytesIO(sample["seg.png"]))).copy()
            mask[0, 0] = 255 if i == 0 else mask[0, 0]
            sink.write({"__key__": sample["__key__"], "png": sample["png"], "seg.png": png(mask)})
        mask = np.asarray(Image.open(io.BytesIO(good[2]["seg.png"])))
        for key, (_, change) in BAD_MASKS.items():
            sink.write(
                {"__key__": key, "png": good[2]["png"], **({"seg.png": change(mask)} if change else {})}
            )
    manifest = json.loads((shards / "train.json").read_text())
    manifest["shards"][1]["num_samples"] = 2 + len(BAD_MASKS)
    manifest["num_samples"] = 6 + len(BAD_MASKS)
    (shards / "train.json").write_text(json.dumps(manifest))
    return shards, urls


def test_bad_masks_are_problems_for_inspect(cli, bad_masks):
    shards, urls = bad_masks
    proc = cli("data", "inspect", urls, check=False)
    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    assert "6 good samples in 2 shards, 0 classes, 5 problems" in lines
    assert (
        "6 of them with a mask (seg.png), 2 classes in the masks (class:pixels, 255 ignored): 7:"
        in proc.stdout
    )
    problems = [line.strip() for line in proc.stdout.split("problems:\n")[1].splitlines()]
    assert len(problems) == len(BAD_MASKS)
    for (key, (words, _)), problem in zip(BAD_MASKS.items(), problems):
        assert problem.startswith(f"{shards}/train-000001.tar: {key}: ") and words in problem, problem

    proc = cli("data", "inspect", str(shards / "train-000000.tar"))  # the good shard alone
    assert "4 good samples in 1 shards, 0 classes, 0 problems" in proc.stdout


def test_bad_masks_are_skipped_and_counted_with_one_line_each(cli, bad_masks, tmp_path):
    """`ssl-vit validate` over the bad split: every bad mask skipped with one warning naming the
    sample, its shard and what is wrong, counted in data/skipped_val; the run goes on."""
    shards, urls = bad_masks
    proc = cli(
        "validate", "--config", str(ROOT / "recipes/quickstart/mpp.yaml"), "--ckpt_path", "scratch",
        "--data.init_args.val_urls", urls, "--data.init_args.num_workers", "0",
        "--data.init_args.image_size", "16", "--model.init_args.backbone.img_size", "16",
        "--trainer.logger", "false", "--model.init_args.backbone.width", "32",
        "--model.init_args.backbone.depth", "1", cwd=tmp_path,
    )  # fmt: skip
    (row,) = [line for line in proc.stdout.splitlines() if "data/skipped_val" in line]
    assert row.split()[-2] == "5.0"
    warnings = [line for line in proc.stderr.splitlines() if "skipping bad sample" in line]
    assert len(warnings) == len(BAD_MASKS)
    for (key, (words, _)), line in zip(BAD_MASKS.items(), warnings):
        assert f"{key} in {shards}/train-000001.tar: {words}" in line, line


# --- streams without masks: bit for bit what they were --------------------------------------------------

# sha256 (first 16 hex digits) of the batches each stream below gave with the code as it was before
# masks existed (torch 2.14.1, Pillow 13.0): the draws, draft decoding and framing of images are theirs.
BEFORE_MASKS = {
    # training batches as the epoch's global order reads them (`ssl_vit.data.stream.epoch_order`)
    "pretrain": "a0e6c66ea78f68de",
    "randaugment": "c993e3b69a3fdb9e",
    "device": "e598fca0c94015d2",
    "eval_crop": "29aa45bdc325be98",
    "eval_whole": "9a40cab9306b6674",
}


def encoded(array: np.ndarray, fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format=fmt)
    return buf.getvalue()


def digest(tensors) -> str:
    h = hashlib.sha256()
    for tensor in tensors:
        h.update(tensor.contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def test_streams_without_masks_give_the_batches_they_gave_before(tmp_path):
    rng = np.random.default_rng(11)
    with wds.TarWriter(str(tmp_path / "train-000000.tar")) as sink:
        for i in range(12):
            if i % 2:
                sample = {"png": encoded(rng.integers(0, 256, (30, 40, 3), dtype=np.uint8), "PNG")}
            else:
                sample = {"jpg": encoded(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8), "JPEG")}
            sink.write({"__key__": f"s{i:02d}", **sample, "cls": str(i % 3)})
    with wds.TarWriter(str(tmp_path / "val-000000.tar")) as sink:
        for i in range(6):
            image = encoded(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8), "PNG")
            sink.write({"__key__": f"v{i:02d}", "png": image, "cls": str(i % 3)})
    (tmp_path / "val.json").write_text(
        json.dumps({"num_samples": 6, "num_classes": 3, "image_size": [16, 16],
                    "shards": [{"url": "val-000000.tar", "num_samples": 6}]})
    )  # fmt: skip
    common = {"batch_size": 4, "num_workers": 0, "image_size": 16, "shuffle_buffer": 8, "seed": 3}

    def train(**kwargs):
        dm = ShardDataModule(**grouped(dict(
            train_urls=str(tmp_path / "train-000000.tar"), train_batches=3, crop_scale=(0.3, 1.0), **common,
            **kwargs,
        )))  # fmt: skip
        dm.setup("fit")
        return dm, list(dm.train_dataloader())

    got = {}
    _, batches = train()
    got["pretrain"] = digest([b["image"] for b in batches] + [b["label"] for b in batches])
    _, batches = train(train_preset="supervised", randaugment="rand-m9-mstd0.5")
    got["randaugment"] = digest([b["image"] for b in batches])
    dm, batches = train(decode="device")
    got["device"] = digest([dm.prepare_batch(b)["image"] for b in batches])
    dm = ShardDataModule(**grouped(dict(val_urls=str(tmp_path / "train-000000.tar"), **common)))
    got["eval_crop"] = digest([b["image"] for b in dm.exact_dataloader("val")])
    dm = ShardDataModule(**grouped(dict(val_urls=str(tmp_path / "val-000000.tar"), **common)))
    assert dm.eval_view("val") == "whole"
    got["eval_whole"] = digest([b["image"] for b in dm.exact_dataloader("val")])
    assert got == BEFORE_MASKS
    assert all("mask" not in b for b in dm.exact_dataloader("val"))
