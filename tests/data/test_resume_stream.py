"""The training DataLoader resumes mid-epoch exactly; streams that can never deliver fail with one line."""

import gzip
import logging
import traceback

import pytest
import torch
import webdataset as wds
from data_helpers import write_shards

from ssl_vit.data import ShardDataModule
from ssl_vit.data.options import grouped


def datamodule(urls, num_workers, **kwargs):
    args = dict(
        train_urls=urls,
        batch_size=4,
        num_workers=num_workers,
        image_size=16,
        train_batches=11,
        shuffle_buffer=8,
        segment_shards=2,
        crop_scale=(0.3, 1.0),  # random crops: the augmentation's random state is part of the position
    )
    dm = ShardDataModule(**grouped({**args, **kwargs}))
    dm.setup("fit")
    return dm


def consume(loader, stop_after=None):
    """(keys, pixels) of each batch, recording each as training does; stops after `stop_after`."""
    out = []
    for batch in loader:
        loader.record(batch)
        out.append((batch["key"], batch["image"].clone()))
        if len(out) == stop_after:
            break
    return out


def same(a, b) -> bool:
    return len(a) == len(b) and all(ka == kb and torch.equal(ia, ib) for (ka, ia), (kb, ib) in zip(a, b))


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_shards(tmp_path_factory.mktemp("resume"), [13, 7, 11, 9, 5], prefix="train")


@pytest.mark.parametrize("num_workers", [0, 3])
def test_training_loader_resumes_mid_epoch_as_if_never_stopped(shards, num_workers):
    urls, _ = shards
    full = consume(datamodule(urls, num_workers).train_dataloader())
    assert len(full) == 11
    for stop in (1, 4, 5, 10):  # 3 workers: every rotation of the round robin, and the last batch
        first = datamodule(urls, num_workers)
        part = consume(first.train_dataloader(), stop)
        again = datamodule(urls, num_workers)
        again.load_state_dict(first.state_dict())  # as Lightning does, before the first iterator
        rest = consume(again.train_dataloader())
        assert same(part + rest, full), f"stopped after {stop}"
        seen = [k for keys, _ in part + rest for k in keys]
        assert seen == [k for keys, _ in full for k in keys]  # nothing twice, nothing skipped


@pytest.mark.parametrize("num_workers", [0, 3])
def test_skipped_batches_are_passed_over_undecoded_and_the_skip_survives_a_checkpoint(shards, num_workers):
    """A rollback's skip: the stream continues with the batches an uninterrupted stream gives after the
    skipped ones, at once and from a checkpoint saved before the next batch."""
    urls, _ = shards
    full = consume(datamodule(urls, num_workers).train_dataloader())
    for stop, skip in ((4, 2), (1, 3), (5, 4)):  # 3 workers: skips that start and end on every worker
        dm = datamodule(urls, num_workers)
        loader = dm.train_dataloader()
        part = consume(loader, stop)
        assert dm.skip_batches(skip) == skip
        saved = dm.state_dict()
        assert same(part + consume(loader), full[:stop] + full[stop + skip :]), (stop, skip)
        again = datamodule(urls, num_workers)
        again.load_state_dict(saved)
        assert same(consume(again.train_dataloader()), full[stop + skip :]), (stop, skip)
    # A skip past the epoch's end stops at it: the next pass is the next epoch, from its start.
    dm = datamodule(urls, num_workers)
    consume(dm.train_dataloader(), 8)
    assert dm.skip_batches(5) == 3
    again = datamodule(urls, num_workers)
    again.load_state_dict(dm.state_dict())
    next_epoch = consume(again.train_dataloader())
    assert again.position.loader.epoch == 1 and len(next_epoch) == 11


def test_in_process_and_worker_streams_agree_and_leave_the_main_rng_alone(shards):
    urls, _ = shards
    torch.manual_seed(123)
    in_process = consume(datamodule(urls, 0).train_dataloader())
    after = torch.rand(3)
    torch.manual_seed(123)
    assert torch.equal(torch.rand(3), after)  # the augmentations drew from their own seeds
    assert same(in_process, consume(datamodule(urls, 1).train_dataloader()))


@pytest.mark.parametrize(("before", "after"), [(0, 2), (3, 0), (2, 1)])
def test_resume_with_other_worker_count_is_exact_and_says_so(shards, caplog, before, after):
    """The epoch's order depends on the seed, the epoch and the data only (`epoch_order`): a resume
    with other DataLoader workers continues with exactly the batches the uninterrupted run gives."""
    urls, _ = shards
    full = consume(datamodule(urls, before).train_dataloader())
    first = datamodule(urls, before)
    part = consume(first.train_dataloader(), 3)
    again = datamodule(urls, after)
    again.load_state_dict(first.state_dict())
    with caplog.at_level(logging.WARNING, logger="ssl_vit.data"):
        rest = consume(again.train_dataloader())
    assert f"resuming on 1 rank(s) x {after} DataLoader worker(s), saved on 1 x {before}" in caplog.text
    assert "the resume is exact" in caplog.text
    assert same(part + rest, full)
    assert same(full, consume(datamodule(urls, after).train_dataloader()))  # workers change nothing


def test_a_stream_of_segments_resumed_with_other_workers_warns_and_reads_new_segments(tmp_path, caplog):
    """Compressed (or remote) shards are read as streams of segments, exact with the run's own workers
    only: another count is said in one warning."""
    write_shards(tmp_path, [13, 7, 11, 9, 5], prefix="train")
    zipped = []
    for path in sorted(tmp_path.glob("train-*.tar")):
        (tmp_path / f"gz{path.name}").write_bytes(gzip.compress(path.read_bytes()))
        zipped.append(str(tmp_path / f"gz{path.name}"))
    first = datamodule(zipped, 0)
    assert first.train_index is None
    part = consume(first.train_dataloader(), 3)
    again = datamodule(zipped, 2)
    again.load_state_dict(first.state_dict())
    with caplog.at_level(logging.WARNING, logger="ssl_vit.data"):
        rest = consume(again.train_dataloader())
    assert "exact resume needs the run's number of ranks and DataLoader workers" in caplog.text
    assert len(rest) == 11 and not same(rest[:3], part)  # the loop stops at the epoch's count itself


def test_state_saved_at_the_end_of_an_epoch_starts_the_next_afresh(shards):
    urls, _ = shards
    dm = datamodule(urls, 0)
    loader = dm.train_dataloader()
    consume(loader)  # epoch 0, complete
    state = dm.state_dict()
    epoch1 = consume(loader)  # what the uninterrupted run reads next
    resumed = datamodule(urls, 0)
    resumed.load_state_dict(state)
    assert same(consume(resumed.train_dataloader()), epoch1)


def empty_tars(root, n=3):
    root.mkdir()
    for i in range(n):
        wds.TarWriter(str(root / f"empty-{i:06d}.tar")).close()
    return str(root / f"empty-{{000000..{n - 1:06d}}}.tar")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 1])
def test_streams_that_can_never_deliver_fail_with_one_line(tmp_path, shards, num_workers):
    urls, _ = shards
    empty = empty_tars(tmp_path / "empty")
    cases = [
        (dict(train_urls=empty), "fit", "train_dataloader"),
        (dict(train_urls=urls, classes=[42]), "fit", "train_dataloader"),  # the filter keeps nothing
        (dict(train_urls=None, val_urls=empty), "validate", "val_dataloader"),
    ]
    for kwargs, stage, loader in cases:
        dm = ShardDataModule(batch_size=2, num_workers=num_workers, image_size=16, train_batches=2, **kwargs)
        dm.setup(stage)
        with pytest.raises(Exception, match="no usable sample in a whole pass over") as info:
            list(getattr(dm, loader)())
        assert "ssl-vit data inspect" in str(info.value)
        # Its traceback holds the DataLoader iterator in a reference cycle. Broken here, the iterator is
        # freed at once and stops its workers; left to the garbage collector, its queues are finalized
        # before it, the workers never get the stop message, and its shutdown waits for them in vain
        # (10 s per loader).
        traceback.clear_frames(info.tb)
        del info


def test_a_label_beyond_num_classes_is_a_skipped_sample(shards, caplog):
    urls, keys = shards  # labels 0-9 in turn; 20 of the 45 are 5 or more
    dm = ShardDataModule(val_urls=urls, batch_size=4, num_workers=0, image_size=16, num_classes=5)
    dm.setup("validate")
    with caplog.at_level(logging.WARNING, logger="ssl_vit.data"):
        batches = list(dm.val_dataloader())
    assert sum(int(b["skipped"]) for b in batches) == 20
    assert sorted(k for b in batches for k in b["key"]) == sorted(k for i, k in enumerate(keys) if i % 10 < 5)
    assert "label 9 is beyond num_classes 5" in caplog.text
