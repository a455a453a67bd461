"""Shard URLs other than local paths: HTTP (nginx), `pipe:`, `file://` and fsspec URLs give the same keys."""

import os
import shutil

import pytest

from ssl_vit.data import ShardDataModule
from ssl_vit.errors import UserError

pytest_plugins = ["server_helpers"]  # the `nginx` fixture

TINY = {"image_size": 16, "eval_crop_pct": 1.0, "batch_size": 4}


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
    with pytest.raises(UserError, match="val-000099.tar is unreachable"):
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
