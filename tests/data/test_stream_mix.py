"""Batches as mixed as a uniform shuffle of the epoch whatever order the shards were written in: shards
of one class each (as class-folder converters write them with `--order source`), read through the
training stream with 0, 1 and 2 workers and on 2 ranks; the stream of segments that remote and
compressed shards keep is measured beside them, and does not mix."""

import gzip
from collections import Counter

import numpy as np
import pytest
import webdataset as wds
from data_helpers import image_bytes

from ssl_vit.data import ShardDataModule
from ssl_vit.data.options import Augment
from ssl_vit.data.stream.class_mix import batch_mix, uniform_distinct

CLASSES, PER_CLASS, BATCH = 20, 24, 24  # one shard per class: 480 samples, 20 batches of 24


@pytest.fixture(scope="module")
def sorted_shards(tmp_path_factory):
    """One shard per class, classes in order, samples in order: the worst layout there is."""
    root = tmp_path_factory.mktemp("sorted")
    rng = np.random.default_rng(0)
    for c in range(CLASSES):
        with wds.TarWriter(str(root / f"train-{c:06d}.tar")) as sink:
            for i in range(PER_CLASS):
                sink.write(
                    {"__key__": f"c{c:02d}-{i:03d}", "png": image_bytes(rng, size=(8, 8)), "cls": str(c)}
                )
    return str(root / f"train-{{000000..{CLASSES - 1:06d}}}.tar")


def epoch(urls, num_workers=0, rank=0, world_size=1, batch_size=BATCH, **kwargs):
    dm = ShardDataModule(
        train_urls=urls, batch_size=batch_size, num_workers=num_workers, image_size=8,
        augment=Augment(crop_scale=(0.5, 1.0)), **kwargs,
    )  # fmt: skip
    dm._rank_and_world_size = lambda: (rank, world_size)  # what the trainer says on a rank of a DDP run
    dm.setup("fit")
    return [(b["label"].tolist(), b["key"]) for b in dm.train_dataloader()]


def check_mixed(batches, counts):
    mix = batch_mix([labels for labels, _ in batches], counts)
    assert mix["ratio"] >= 0.9, mix
    assert mix["first"] >= 0.75 * mix["uniform"], mix  # from the first batch on
    assert mix["repeat"] <= 2 * mix["uniform_repeat"] + 0.02, mix
    return mix


@pytest.mark.parametrize("num_workers", [0, 1, 2])
def test_class_sorted_shards_give_batches_as_mixed_as_a_uniform_shuffle(sorted_shards, num_workers):
    batches = epoch(sorted_shards, num_workers)
    assert len(batches) == CLASSES * PER_CLASS // BATCH
    keys = Counter(k for _, ks in batches for k in ks)
    assert len(keys) == CLASSES * PER_CLASS and set(keys.values()) == {1}  # every sample once
    check_mixed(batches, [PER_CLASS] * CLASSES)
    assert batches == epoch(sorted_shards, 0)  # the order does not depend on the workers


def test_two_ranks_each_get_mixed_batches_and_together_the_epoch_once(sorted_shards):
    ranks = [epoch(sorted_shards, 1, rank, 2, BATCH // 2) for rank in range(2)]
    for batches in ranks:
        check_mixed(batches, [PER_CLASS] * CLASSES)
    keys = Counter(k for batches in ranks for _, ks in batches for k in ks)
    assert len(keys) == CLASSES * PER_CLASS and set(keys.values()) == {1}
    # a data step of the two ranks is a global batch of one rank with the whole batch: same samples
    one = epoch(sorted_shards, 0)
    for step, (_, keys_) in enumerate(one):
        assert keys_ == ranks[0][step][1] + ranks[1][step][1]


def test_the_stream_of_segments_of_compressed_shards_does_not_mix_them(sorted_shards, tmp_path):
    """What the global order replaces, kept for remote and compressed shards: a worker reads a segment's
    shards one after another through a shuffle buffer, so class-sorted shards give batches of a few
    classes (data/README.md says so)."""
    from ssl_vit.data.stream.urls import expand

    for url in expand(sorted_shards, "urls"):
        (tmp_path / url.rsplit("/", 1)[1]).write_bytes(gzip.compress(open(url, "rb").read()))
    urls = str(tmp_path / f"train-{{000000..{CLASSES - 1:06d}}}.tar")
    mix = batch_mix([labels for labels, _ in epoch(urls, 0, train_batches=20)], [PER_CLASS] * CLASSES)
    assert mix["ratio"] < 0.5, mix


def test_the_uniform_expectation():
    assert uniform_distinct([200] * 100, 64) == pytest.approx(47.49, abs=0.01)  # the layout
    assert uniform_distinct([1, 1], 2) == 2.0 and uniform_distinct([5], 3) == 1.0
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(10), [50, 40, 30, 30, 20, 10, 10, 5, 3, 2])
    draws = [len(set(rng.permutation(labels)[:16])) for _ in range(4000)]
    assert np.mean(draws) == pytest.approx(uniform_distinct(np.bincount(labels), 16), abs=0.05)
