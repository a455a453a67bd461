"""ShardDataModule streams: exactly-once exact passes, lockstep training streams, seeds, robustness."""

import io
import json
import logging
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import webdataset as wds
from cli_helpers import start_ranks
from data_helpers import free_port, image_bytes, write_broken_shard
from PIL import Image
from torch.utils.data import DataLoader

from ssl_vit.data import ShardDataModule
from ssl_vit.data.options import Augment, Limits, Stream
from ssl_vit.data.stream.pipeline import ShardStream, _stack
from ssl_vit.data.stream.samples import open_image, transform_image
from ssl_vit.data.transforms.rgb import Decode, RandomResizedCrop, build_transform, decode
from ssl_vit.errors import UserError

TINY = {"image_size": 16, "augment": Augment(eval_crop_pct=1.0)}


def decode_image(sample: dict, transform):
    """`transform` applied to the sample's image, opened from its header as the stream opens it."""
    return transform_image(open_image(sample), transform)


def keys_of(loader) -> list[str]:
    return [k for batch in loader for k in batch["key"]]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_ranks_two_workers_see_every_key_once_and_step_together(unequal_shards, tmp_path):
    from dist_helpers import exact_and_training_pass

    urls, keys = unequal_shards
    start_ranks(exact_and_training_pass, 2, free_port(), urls, str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    seen = Counter(k for r in ranks for k in r["exact"])
    assert sorted(seen) == sorted(keys) and set(seen.values()) == {1}  # 31 keys, each exactly once
    assert all(r["exact"] for r in ranks)
    for r in ranks:  # lockstep: exactly train_batches full batches on each rank
        assert len(r["train"]) == 5 and all(len(b) == 2 for b in r["train"])
    assert ranks[0]["train"] != ranks[1]["train"]  # ranks draw different streams


@pytest.mark.parametrize("num_workers", [0, 3])
def test_exact_pass_single_process(unequal_shards, num_workers):
    urls, keys = unequal_shards
    dm = ShardDataModule(val_urls=urls, batch_size=4, num_workers=num_workers, **TINY)
    dm.setup("validate")
    batches = list(dm.val_dataloader())
    assert sorted(k for b in batches for k in b["key"]) == sorted(keys)
    b = batches[0]
    assert b["image"].dtype == torch.uint8 and b["image"].shape[1:] == (3, 16, 16)  # uint8 from workers
    assert b["label"].dtype == torch.int64 and len(b["key"]) == len(b["label"]) == b["image"].shape[0]
    ready = dm.prepare_batch(b)  # what the model gets: normalised floats, same keys and labels
    assert ready["image"].dtype == torch.float32 and ready["image"].shape == b["image"].shape
    assert ready["key"] == b["key"] and torch.equal(ready["label"], b["label"])
    mean, std = torch.tensor(dm.mean).view(1, 3, 1, 1), torch.tensor(dm.std).view(1, 3, 1, 1)
    assert torch.allclose(ready["image"], (b["image"].float() / 255 - mean) / std, atol=1e-5)


@pytest.mark.parametrize("num_workers,batches", [(0, 5), (2, 5), (3, 7)])
def test_training_stream_yields_exactly_the_configured_batches(unequal_shards, num_workers, batches):
    urls, _ = unequal_shards
    transform = build_transform("pretrain", 16, mean=(0.5,) * 3)
    for rank in (0, 1):
        stream = ShardStream(
            wds.shardlists.expand_urls(urls),
            rank=rank,
            world_size=2,
            batch_size=3,
            transform=transform,
            batches_per_epoch=batches,
            shuffle_buffer=10,
        )
        loader = DataLoader(stream, batch_size=None, num_workers=num_workers)
        got = list(loader)
        assert len(loader) == batches and len(got) == batches and all(len(b["key"]) == 3 for b in got)


def test_training_stream_is_a_function_of_seed_epoch_and_resumable(digits_shards):
    def datamodule():
        dm = ShardDataModule(
            train_urls=f"{digits_shards}/train-{{000000..000004}}.tar",
            batch_size=8,
            num_workers=2,
            image_size=16,
            train_batches=3,
            stream=Stream(shuffle_buffer=64),
            seed=7,
        )
        dm.setup("fit")
        return dm

    first = datamodule()
    loader = first.train_dataloader()
    epoch0 = [batch for batch in loader if loader.record(batch) is None]  # as training records them
    state = first.state_dict()
    epoch1 = keys_of(first.train_dataloader())
    assert state["seed"] == 7 and state["epoch"] == 1 and state["position"]["ranks"][0]["epoch"] == 0
    assert keys_of(epoch0) != epoch1  # a new epoch draws a new stream

    again = datamodule()
    replay = list(again.train_dataloader())
    assert keys_of(replay) == keys_of(epoch0)
    assert all(torch.equal(a["image"], b["image"]) for a, b in zip(epoch0, replay))  # augmentations too

    resumed = datamodule()
    resumed.load_state_dict(state)
    assert keys_of(resumed.train_dataloader()) == epoch1


def test_class_filter_and_epoch_length_from_manifest(digits_shards):
    manifest = json.loads((digits_shards / "train.json").read_text())
    dm = ShardDataModule(
        train_urls=f"{digits_shards}/train-{{000000..000004}}.tar",
        val_urls=f"{digits_shards}/val-{{000000..000003}}.tar",
        classes=[0, 1, 2, 3, 4],
        batch_size=16,
        num_workers=0,
        image_size=16,
    )
    assert dm.num_classes == 10 and dm.image_size == 16
    dm.setup("fit")
    kept = sum(manifest["class_counts"][str(c)] for c in range(5))
    assert dm.batches_per_epoch == kept // 16
    train_labels = torch.cat([b["label"] for b in dm.train_dataloader()])
    assert len(train_labels) == dm.batches_per_epoch * 16 and train_labels.max() <= 4
    val = json.loads((digits_shards / "val.json").read_text())
    val_labels = torch.cat([b["label"] for b in dm.val_dataloader()])
    assert len(val_labels) == sum(val["class_counts"][str(c)] for c in range(5)) and val_labels.max() <= 4


def test_train_keys_keep_those_training_samples_and_size_the_epoch(digits_shards):
    """A labelled subset: training and the train split's exact pass see only its keys, the epoch counts
    its samples, the other splits are whole."""
    urls = f"{digits_shards}/val-{{000000..000001}}.tar"
    every = ShardDataModule(train_urls=urls, batch_size=16, num_workers=0, image_size=16)
    keys = [k for b in every.exact_dataloader("train") for k in b["key"]][::5]  # 40 of 200
    dm = ShardDataModule(
        train_urls=urls, val_urls=urls, train_keys=keys, batch_size=16, num_workers=0, image_size=16
    )
    dm.setup("fit")
    assert dm.batches_per_epoch == len(keys) // 16
    trained = [k for b in dm.train_dataloader() for k in b["key"]]
    assert len(trained) == dm.batches_per_epoch * 16 and set(trained) <= set(keys)
    assert sorted(k for b in dm.exact_dataloader("train") for k in b["key"]) == sorted(keys)
    assert len([k for b in dm.val_dataloader() for k in b["key"]]) == 200


@pytest.mark.parametrize("num_workers", [0, 2])
def test_bad_samples_are_skipped_counted_and_logged(tmp_path, unequal_shards, caplog, num_workers):
    good, bad = write_broken_shard(tmp_path / "broken-000000.tar", np.random.default_rng(0))
    urls, keys = unequal_shards
    dm = ShardDataModule(
        val_urls=[str(tmp_path / "broken-000000.tar"), urls], batch_size=2, num_workers=num_workers, **TINY
    )
    dm.setup("validate")
    with caplog.at_level(logging.WARNING, logger="ssl_vit.data"):
        batches = list(dm.val_dataloader())
    assert sorted(k for b in batches for k in b["key"]) == sorted(good + keys)
    assert sum(int(b["skipped"]) for b in batches) == bad
    labels = {k: int(lab) for b in batches for k, lab in zip(b["key"], b["label"])}
    assert labels["broken-0"] == 1 and labels["broken-6"] == -1
    if num_workers == 0:  # in-process, so the warnings are visible to caplog
        text = caplog.text
        assert "broken-1" in text and "broken-2" in text and "label does not parse" in text
        assert "no image member" in text


def test_training_stream_counts_bad_samples(tmp_path):
    _, bad = write_broken_shard(tmp_path / "broken-000000.tar", np.random.default_rng(1))
    dm = ShardDataModule(
        train_urls=str(tmp_path / "broken-000000.tar"),
        batch_size=3,
        num_workers=0,
        train_batches=4,
        stream=Stream(shuffle_buffer=4),
        **TINY,
    )
    dm.setup("fit")
    batches = list(dm.train_dataloader())
    assert len(batches) == 4
    # every pass over the shard drops its 4 bad samples; 12 good samples need 4 passes over 3 good
    assert sum(int(b["skipped"]) for b in batches) >= bad * 3


def test_only_bad_samples_is_an_error_in_training_not_a_hang(tmp_path, monkeypatch):
    import ssl_vit.data.stream.samples

    with wds.TarWriter(str(tmp_path / "bad-000000.tar")) as sink:
        sink.write({"__key__": "x", "png": b"nope", "cls": "1"})
    dm = ShardDataModule(
        train_urls=str(tmp_path / "bad-000000.tar"), batch_size=2, num_workers=0, train_batches=1, **TINY
    )
    dm.setup("fit")
    with pytest.raises(UserError, match="bad samples in a row and none usable"):
        list(dm.train_dataloader())
    # an exact pass is finite: a long run of bad samples is skipped and counted, never fatal
    monkeypatch.setattr(ssl_vit.data.stream.samples, "MAX_SKIPS_IN_A_ROW", 2)
    good, bad = write_broken_shard(tmp_path / "broken-000000.tar", np.random.default_rng(0))
    dm = ShardDataModule(val_urls=str(tmp_path / "broken-000000.tar"), batch_size=8, num_workers=0, **TINY)
    dm.setup("validate")
    (batch,) = dm.val_dataloader()
    assert batch["key"] == good and int(batch["skipped"]) == bad


@pytest.mark.timeout(60)
def test_missing_shard_empty_list_and_unreachable_url_fail_at_setup(unequal_shards, tmp_path):
    urls, _ = unequal_shards
    cases = [
        ([urls, str(tmp_path / "gone-000000.tar")], "gone-000000.tar is no such file"),
        ([], "val_urls is empty"),
        (f"http://127.0.0.1:{free_port()}/val-000000.tar", "is unreachable"),
        (f"file://{tmp_path}/nothing.tar", "no such file"),
    ]
    for val_urls, message in cases:
        # read_retries 0: a refused connection is tried once (the retries are tests/data/test_remote.py's)
        dm = ShardDataModule(val_urls=val_urls, num_workers=0, limits=Limits(read_retries=0), **TINY)
        with pytest.raises(UserError, match=message) as err:
            dm.setup("validate")
        assert "\n" not in str(err.value)
    with pytest.raises(UserError, match="val_urls is not set"):
        ShardDataModule(train_urls=urls, **TINY).setup("validate")


def test_exact_pass_needs_a_shard_per_rank(unequal_shards, monkeypatch):
    urls, _ = unequal_shards
    dm = ShardDataModule(val_urls=urls.replace("{000000..000006}", "000000"), **TINY)
    monkeypatch.setattr(dm, "_rank_and_world_size", lambda: (0, 2))
    with pytest.raises(UserError, match="1 shards for 2 ranks"):
        dm.setup("validate")


def test_labels_from_json_and_raw_array_members(tmp_path):
    array = np.arange(16 * 16 * 3, dtype=np.uint8).reshape(16, 16, 3)
    buf = io.BytesIO()
    np.save(buf, array)
    with wds.TarWriter(str(tmp_path / "mixed-000000.tar")) as sink:
        sink.write({"__key__": "a", "npy": buf.getvalue(), "json": json.dumps({"label": 3}).encode()})
        sink.write(
            {"__key__": "b", "png": image_bytes(np.random.default_rng(0)), "json": b'{"caption": "x"}'}
        )
    dm = ShardDataModule(
        val_urls=str(tmp_path / "mixed-000000.tar"), num_workers=0, mean=(0, 0, 0), std=(1, 1, 1), **TINY
    )
    dm.setup("validate")
    (batch,) = dm.val_dataloader()
    assert batch["key"] == ["a", "b"] and batch["label"].tolist() == [3, -1]
    assert torch.equal(batch["image"][0], torch.from_numpy(array).permute(2, 0, 1))  # pixel-exact
    expected = torch.from_numpy(array).permute(2, 0, 1).float() / 255
    assert torch.allclose(dm.prepare_batch(batch)["image"][0], expected)


def test_draft_decodes_large_jpegs_at_reduced_size():
    sample = {"jpg": image_bytes(np.random.default_rng(0), "jpg", (128, 96))}
    assert decode_image(sample, Decode(32)).size == (64, 48)  # 1/2: both sides stay >= 32
    assert decode_image(sample, Decode(20)).size == (32, 24)  # 1/4
    assert decode_image(sample, Decode(None)).size == (128, 96)
    assert decode_image(sample, decode).size == (128, 96)
    png = {"png": image_bytes(np.random.default_rng(0), "png", (128, 96))}
    assert decode_image(png, Decode(32)).size == (128, 96)  # only JPEG has a draft mode


@pytest.mark.parametrize("box,scale", [((0, 0, 128, 96), 4), ((10, 20, 70, 50), 2), ((5, 5, 40, 30), 1)])
def test_random_crop_drafts_only_what_keeps_the_box_at_least_the_output_size(box, scale, monkeypatch):
    """The draft reduction depends on the crop box, never leaving it smaller than the output (24 px),
    and the crop equals the full decode cropped and resized (up to the DCT-domain downscale)."""
    sample = {"jpg": image_bytes(np.random.default_rng(0), "jpg", (128, 96))}
    crop = RandomResizedCrop(24)
    monkeypatch.setattr(crop, "box", lambda width, height: box)
    from PIL.JpegImagePlugin import JpegImageFile

    drafted, draft = [], JpegImageFile.draft
    monkeypatch.setattr(JpegImageFile, "draft", lambda img, *a: (draft(img, *a), drafted.append(img.size)))
    out = decode_image(sample, crop)
    assert out.size == (24, 24) and out.mode == "RGB"
    assert drafted == ([] if scale == 1 else [(128 // scale, 96 // scale)])  # the size decoded
    left, top, w, h = box
    full = decode_image(sample, decode).resize((24, 24), Image.BILINEAR, box=(left, top, left + w, top + h))
    if scale == 1:
        assert np.array_equal(np.asarray(out), np.asarray(full))


def test_random_crop_boxes_follow_torchvision():
    import random

    random.seed(0)
    crop = RandomResizedCrop(16, scale=(0.08, 1.0))
    boxes = [crop.box(500, 375) for _ in range(2000)]
    areas = np.array([w * h / (500 * 375) for _, _, w, h in boxes])
    ratios = np.array([w / h for _, _, w, h in boxes])
    assert all(0 <= x and 0 <= y and x + w <= 500 and y + h <= 375 for x, y, w, h in boxes)
    assert 0.07 < areas.min() and areas.max() <= 1.0 and 0.35 < areas.mean() < 0.55
    assert 0.7 < ratios.min() and ratios.max() < 1.4
    assert RandomResizedCrop(16, scale=(0.999, 1.0)).box(1000, 100) == (433, 0, 133, 100)  # fallback


def test_supervised_preset_randaugment_and_mixup(digits_shards):
    dm = ShardDataModule(
        train_urls=f"{digits_shards}/train-{{000000..000004}}.tar",
        batch_size=8,
        num_workers=0,
        image_size=16,
        train_batches=2,
        augment=Augment(
            train_preset="supervised",
            randaugment="rand-m9-mstd0.5",
            mixup_alpha=0.8,
            cutmix_alpha=1.0,
            label_smoothing=0.1,
        ),
    )
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch["image"].shape == (8, 3, 16, 16)
    dm.trainer = SimpleNamespace(training=False)
    plain = dm.on_after_batch_transfer(dict(batch), 0)
    assert "target" not in plain and plain["image"].dtype == torch.float32
    assert torch.equal(plain["image"], dm.prepare_batch(batch)["image"])  # normalised, not mixed
    dm.trainer = SimpleNamespace(training=True)
    mixed = dm.on_after_batch_transfer(dict(batch), 0)
    assert mixed["target"].shape == (8, 10) and torch.allclose(mixed["target"].sum(1), torch.ones(8))
    assert mixed["image"].dtype == torch.float32 and not torch.equal(mixed["image"], plain["image"])
    assert batch["image"].dtype == torch.uint8  # the loader's batch is left as it was
    smooth = ShardDataModule(
        train_urls="x.tar", augment=Augment(train_preset="supervised", label_smoothing=0.1), num_classes=10
    )
    smooth.trainer = SimpleNamespace(training=True)
    target = smooth.on_after_batch_transfer(dict(batch), 0)["target"]  # no mixup: timm's Mixup refuses
    assert torch.allclose(target.max(1).values, torch.full((8,), 0.91))
    with pytest.raises(ValueError, match="supervised"):
        ShardDataModule(train_urls="x.tar", augment=Augment(randaugment="rand-m9"))
    with pytest.raises(ValueError, match="'pretrain', 'supervised', 'eval'"):
        ShardDataModule(train_urls="x.tar", augment=Augment(train_preset="fancy"))


def test_constructible_from_yaml_like_lightning_cli(digits_shards):
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(ShardDataModule, "data")
    cfg = parser.parse_string(f"""
data:
  train_urls: {digits_shards}/train-{{000000..000004}}.tar
  val_urls: [{digits_shards}/val-000000.tar, {digits_shards}/val-000001.tar]
  batch_size: 4
  image_size: 16
  classes: [0, 1, 2, 3, 4]
  augment:
    train_preset: supervised
    crop_scale: [0.2, 1.0]
  stream:
    shuffle_buffer: 16
""")
    dm = parser.instantiate_classes(cfg).data
    assert isinstance(dm, ShardDataModule) and dm.classes == [0, 1, 2, 3, 4] and dm.num_classes == 10
    assert dm.augment == Augment(train_preset="supervised", crop_scale=(0.2, 1.0))
    assert dm.stream == Stream(shuffle_buffer=16) and dm.limits == Limits()  # the groups' defaults
    with pytest.raises(Exception, match="fancy"):
        parser.parse_string("data:\n  augment:\n    train_preset: fancy\n")


def test_interop_with_stock_webdataset_and_tar(digits_shards, tmp_path):
    import subprocess

    shard = digits_shards / "val-000000.tar"
    samples = list(wds.WebDataset(str(shard), shardshuffle=False).decode("pil"))
    assert len(samples) == 100 and isinstance(samples[0]["png"], Image.Image)
    assert samples[0]["__key__"] == "digits-val-00000000" and isinstance(samples[0]["cls"], int)
    listing = subprocess.run(
        ["tar", "-tf", str(shard)], capture_output=True, text=True, check=True
    ).stdout.split()
    assert (
        sorted(listing[:2]) == ["digits-val-00000000.cls", "digits-val-00000000.png"] and len(listing) == 200
    )

    # shards someone else wrote with webdataset.ShardWriter (.jpg/.cls) read by ShardDataModule
    rng = np.random.default_rng(5)
    with wds.ShardWriter(str(tmp_path / "theirs-%06d.tar"), maxcount=4, verbose=0) as sink:
        for i in range(10):
            sink.write({"__key__": f"img{i:03d}", "jpg": image_bytes(rng, "jpg", (40, 30)), "cls": i % 3})
    dm = ShardDataModule(
        val_urls=f"{tmp_path}/theirs-{{000000..000002}}.tar", batch_size=4, num_workers=2, **TINY
    )
    dm.setup("validate")
    batches = list(dm.val_dataloader())
    got = {k: int(lab) for b in batches for k, lab in zip(b["key"], b["label"])}
    assert got == {f"img{i:03d}": i % 3 for i in range(10)}


class _StackedInAWorker(torch.utils.data.Dataset):
    """A worker stacks two channel-first views of HWC images (as the transforms give them) and says whether
    the batch it hands over already lies in shared memory."""

    images = [(torch.arange(48, dtype=torch.uint8).reshape(4, 4, 3) + i).permute(2, 0, 1) for i in range(2)]

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int):
        batch = _stack(self.images)
        return batch, batch.is_shared()


def test_a_workers_batch_is_stacked_straight_into_shared_memory():
    ((batch, shared),) = DataLoader(_StackedInAWorker(), batch_size=None, num_workers=1)
    assert shared and torch.equal(batch, torch.stack(_StackedInAWorker.images))
