"""What a checkpoint records of its training data, and each way a resume's data can differ from it."""

import json
import os

from ssl_vit.data.stream.identity import changes, identity


def shards(tmp_path, sizes: dict[str, int]) -> list[str]:
    for name, size in sizes.items():
        (tmp_path / name).write_bytes(b"\0" * size)
    return [str(tmp_path / name) for name in sizes]


MANIFEST = {"num_samples": 30, "shards": [{"url": "a.tar", "num_samples": 10}]}


def test_the_same_data_read_the_same(tmp_path):
    urls = shards(tmp_path, {"a.tar": 10240, "b.tar": 20480})
    saved = json.loads(json.dumps(identity(urls, MANIFEST)))  # as a checkpoint keeps it
    assert saved["sizes"] == [10240, 20480] and saved["num_samples"] == 30
    assert changes(saved, identity(urls, dict(MANIFEST))) == []


def test_every_kind_of_change_is_named(tmp_path):
    a, b, c = shards(tmp_path, {"a.tar": 10240, "b.tar": 20480, "c.tar": 10240})
    saved = identity([a, b], MANIFEST)
    assert changes(saved, identity([a], MANIFEST)) == ["1 shard(s) no longer given (b.tar)"]
    assert changes(saved, identity([a, b, c], MANIFEST)) == ["1 shard(s) added (c.tar)"]
    assert changes(saved, identity([b, a], MANIFEST)) == ["the shards are given in another order"]
    (tmp_path / "b.tar").write_bytes(b"\0" * 30720)
    assert changes(saved, identity([a, b], MANIFEST)) == ["1 shard(s) changed (b.tar 20480 -> 30720 bytes)"]
    (tmp_path / "b.tar").write_bytes(b"\0" * 20480)
    os.utime(b, ns=(saved["mtimes"][1], saved["mtimes"][1]))  # the same bytes, as `cp -p` copies them
    assert changes(saved, identity([a, b], {**MANIFEST, "num_samples": 29})) == [
        "the manifest counts 29 samples, the checkpoint's 30"
    ]
    assert changes(saved, identity([a, b], {**MANIFEST, "class_names": ["x"]})) == ["the manifest changed"]


def test_remote_and_missing_shards_have_no_size_and_are_not_compared_by_it(tmp_path):
    (a,) = shards(tmp_path, {"a.tar": 10240})
    remote = "http://127.0.0.1:1/b.tar"
    saved = identity([a, remote, str(tmp_path / "gone.tar")], None)
    assert saved["sizes"] == [10240, None, None] and saved["manifest_sha256"] is None
    assert saved["fingerprints"][1:] == saved["mtimes"][1:] == [None, None]
    assert changes(saved, identity([a, remote, str(tmp_path / "gone.tar")], None)) == []


def test_a_shard_rewritten_at_the_same_size_is_named(tmp_path):
    """Contents that changed at the ends (samples reordered: other tar headers first and last), and a
    change in the middle alone, which the modification time shows; none when only the time was kept."""
    edge = 64 << 10
    (a,) = shards(tmp_path, {"a.tar": 4 * edge})
    saved = json.loads(json.dumps(identity([a], None)))
    assert len(saved["fingerprints"][0]) == 16
    same_time = (saved["mtimes"][0], saved["mtimes"][0])
    (tmp_path / "a.tar").write_bytes(b"\1" + b"\0" * (4 * edge - 1))
    os.utime(a, ns=same_time)  # only the contents tell
    assert changes(saved, identity([a], None)) == [
        "1 shard(s) rewritten with other contents of the same size (a.tar)"
    ]
    (tmp_path / "a.tar").write_bytes(b"\0" * 2 * edge + b"\1" + b"\0" * (2 * edge - 1))
    os.utime(a, ns=(same_time[0] + 10**9, same_time[1] + 10**9))  # a change in the middle, a second later
    assert changes(saved, identity([a], None)) == [
        "1 shard(s) modified since, with the same size and first and last 64 KiB (a.tar; a copy that "
        "keeps modification times, cp -p or rsync -a, is no change)"
    ]
    os.utime(a, ns=same_time)
    assert changes(saved, identity([a], None)) == []  # the middle is not read: the time stands for it


def test_a_checkpoint_from_before_fingerprints_compares_sizes_only(tmp_path):
    (a,) = shards(tmp_path, {"a.tar": 10240})
    saved = {k: v for k, v in identity([a], None).items() if k not in ("mtimes", "fingerprints")}
    (tmp_path / "a.tar").write_bytes(b"\1" * 10240)
    assert changes(saved, identity([a], None)) == []
