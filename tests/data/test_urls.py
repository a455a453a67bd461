"""Shard URLs other than local paths: HTTP (nginx), `pipe:`, `file://` and fsspec URLs give the same keys."""

import os
import shutil

import pytest

from ssl_vit.data import ShardDataModule
from ssl_vit.data.options import Augment
from ssl_vit.data.stream import urls as urls_module
from ssl_vit.data.stream.urls import check_urls
from ssl_vit.errors import UserError

pytest_plugins = ["server_helpers"]  # the `nginx` fixture

TINY = {"image_size": 16, "augment": Augment(eval_crop_pct=1.0), "batch_size": 4}


def exact_keys(urls, num_workers=0) -> list[str]:
    dm = ShardDataModule(val_urls=urls, num_workers=num_workers, **TINY)
    dm.setup("validate")
    return [k for batch in dm.val_dataloader() for k in batch["key"]]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_http_shards_stream_like_local_ones(nginx, unequal_shards, digits_shards):
    base, www = nginx
    urls, keys = unequal_shards
    local_dir = os.path.dirname(urls)
    for name in os.listdir(local_dir):
        shutil.copy(os.path.join(local_dir, name), www / name)
    shutil.copy(digits_shards / "val.json", www / "val.json")  # a manifest, read over HTTP
    http_urls = f"{base}/{os.path.basename(urls)}"
    assert exact_keys(http_urls, num_workers=2) == exact_keys(urls, num_workers=2)
    assert sorted(exact_keys(http_urls)) == sorted(keys)
    assert ShardDataModule(val_urls=http_urls).num_classes == 10
    with pytest.raises(UserError, match="val-000099.tar is missing"):
        exact_keys(f"{base}/val-000099.tar")


def test_pipe_file_and_fsspec_urls(unequal_shards):
    import fsspec

    urls, keys = unequal_shards
    local = exact_keys(urls)
    assert sorted(local) == sorted(keys)
    directory, pattern = os.path.split(urls)
    assert exact_keys(f"file://{urls}") == local
    assert exact_keys(f"pipe:cat {directory}/{pattern}") == local
    memory = fsspec.filesystem("memory")
    for shard in sorted(os.listdir(directory)):
        memory.pipe(f"/shards/{shard}", open(os.path.join(directory, shard), "rb").read())
    assert exact_keys(f"memory://shards/{pattern}") == local
    with pytest.raises(UserError, match="no such object"):
        exact_keys("memory://shards/missing-000000.tar")


def test_a_shard_found_readable_is_not_asked_again(monkeypatch):
    """The CLI checks a run's shards before its logger starts, the data module again in its setup:
    each readable shard is asked for once per process; a missing one each time."""
    asked = []
    monkeypatch.setattr(urls_module, "_readable", set())

    def problem(url: str, policy=None) -> str | None:
        asked.append(url)
        return "no such file" if "gone" in url else None

    monkeypatch.setattr(urls_module, "_problem", problem)
    shards = [f"https://example.org/train-{i:06d}.tar" for i in range(3)]
    check_urls(shards, "train_urls")
    check_urls(shards, "train_urls")
    assert sorted(asked) == shards
    for _ in range(2):
        with pytest.raises(UserError, match="gone-000000.tar is no such file"):
            check_urls([*shards, "https://example.org/gone-000000.tar"], "train_urls")
    assert asked.count("https://example.org/gone-000000.tar") == 2 and len(asked) == 5
