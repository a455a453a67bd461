"""Remote reads (`ssl_vit.storage.remote`) against a server that fails on purpose (`faulty_http`), `pipe:`
commands and an fsspec filesystem that fail: a fault a retry can mend gives the file's exact bytes,
resumed where it broke off; one it cannot is one error after the tries; a missing file is not an error
of the server. And what the data module builds on them: manifests read once and never taken for absent
when they cannot be read, shards whose close fails counted once, the options checked."""

import gzip
import json
import os
import sys
import tarfile

import fsspec
import pytest
import torch
import yaml
from fsspec.implementations.memory import MemoryFileSystem
from webdataset.gopen import gopen_pipe

from ssl_vit.checkpoints.store import SafeCheckpointIO
from ssl_vit.data import ShardDataModule
from ssl_vit.data.options import Limits
from ssl_vit.data.stream.samples import SkipCounter
from ssl_vit.data.stream.tar_reader import tar_file_members
from ssl_vit.errors import UserError
from ssl_vit.evaluation.suite import load_suite
from ssl_vit.storage import remote
from ssl_vit.storage.remote import ReadPolicy

pytest_plugins = ["server_helpers"]  # the `faulty_http` fixture

QUICK = ReadPolicy(retries=2, timeout_s=1, backoff_s=0.05)
DATA = os.urandom(1_000_003)


@pytest.fixture
def served(faulty_http):
    (faulty_http.root / "file.bin").write_bytes(DATA)
    return faulty_http, f"{faulty_http.url}/file.bin"


@pytest.mark.parametrize("fault", ["503", "half", "stall", "stall_body"])
@pytest.mark.parametrize("ranges", [True, False], ids=["ranges", "no-ranges"])
def test_a_read_continues_where_it_broke_off(served, fault, ranges):
    """A first response that fails (an error status, a body cut half way, nothing, half then nothing)
    is followed by a second that gives the rest: with a Range request where the server takes them,
    else the whole file again with what was already read dropped."""
    server, url = served
    server.ranges = ranges
    server.fail("file.bin", fault, 1)
    assert remote.read_url(url, QUICK) == DATA
    assert [fault for _, _, fault in server.requests] == [fault, None]


def test_what_a_retry_cannot_mend_is_one_error_after_the_tries(served, caplog):
    server, url = served
    server.fail("file.bin", "503")
    with pytest.raises(remote.ReadFailed, match=r"file.bin: HTTP 503 .* \(tried 3 times\)$"):
        remote.read_url(url, QUICK)
    assert server.count("file.bin") == 3
    assert len([r for r in caplog.records if "file.bin failed (HTTP 503" in r.message]) == 2  # each retry
    server.reset()
    server.fail("file.bin", "stall")
    with pytest.raises(remote.ReadFailed, match=r"no byte for 1 s \(tried 3 times\)$"):
        remote.read_url(url, QUICK)
    server.reset()
    server.fail("file.bin", "half", then=lambda: (server.root / "file.bin").write_bytes(DATA[:-1]))
    with pytest.raises(remote.ReadFailed, match="changed between two tries"):  # never two versions stitched
        remote.read_url(url, QUICK)
    assert server.count("file.bin") == 2


def test_a_missing_file_is_an_answer_not_a_failure(served):
    server, url = served
    for call in (remote.read_url, remote.probe):
        with pytest.raises(remote.Missing, match="HTTP 404"):
            call(url.replace("file.bin", "gone.bin"), QUICK)
    assert server.count("gone.bin", "GET") + server.count("gone.bin", "HEAD") == 2  # never retried
    server.fail("file.bin", "503", 1, method="HEAD")
    remote.probe(url, QUICK)
    assert server.count("file.bin", "HEAD") == 2


def test_pipe_commands_are_run_again_and_time_out(tmp_path):
    """A `pipe:` command that exits non-zero is run again with what it wrote before dropped; one that
    writes nothing for the read timeout is ended (its process group killed) and, after the tries, fails."""
    data, marker, pids = tmp_path / "file.bin", tmp_path / "failed-once", tmp_path / "pids"
    data.write_bytes(DATA)
    flaky = f"if [ -e {marker} ]; then cat {data}; else touch {marker}; head -c 4000 {data}; exit 18; fi"
    assert remote.read_url(f"pipe:{flaky}", QUICK) == DATA
    with pytest.raises(remote.ReadFailed, match=r"wrote nothing for 1 s \(tried 3 times\)"):
        remote.read_url(f"pipe:echo $$ >> {pids}; exec sleep 60", QUICK)
    started = [int(pid) for pid in pids.read_text().split()]
    assert len(started) == 3
    for pid in started:  # each try's command was killed and reaped, not left to sleep
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


class FlakyMemory(MemoryFileSystem):
    """An in-memory fsspec filesystem whose first open of each file fails as a network error would."""

    protocol = "flakymem"
    failed: set = set()

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(path.replace("flakymem://", "memory://", 1))

    def _open(self, path, mode="rb", **kwargs):
        if mode == "rb" and path not in self.failed:
            self.failed.add(path)
            raise ConnectionResetError("connection reset by the object store")
        return super()._open(path, mode, **kwargs)


def test_fsspec_reads_are_retried():
    fsspec.register_implementation("flakymem", FlakyMemory, clobber=True)
    fsspec.filesystem("flakymem").pipe("/flaky-bucket/file.bin", DATA)
    assert remote.read_url("flakymem://flaky-bucket/file.bin", QUICK) == DATA
    with pytest.raises(remote.Missing):
        remote.read_url("flakymem://flaky-bucket/gone.bin", QUICK)


def test_a_checkpoint_download_resumes(served, tmp_path):
    server, _ = served
    state = {"state_dict": {"w": torch.arange(100_000.0)}, "epoch": 3}
    torch.save(state, server.root / "last.ckpt")
    server.fail("last.ckpt", "half", 1)
    loaded = SafeCheckpointIO(read_retries=1, read_timeout_s=1).load_checkpoint(f"{server.url}/last.ckpt")
    assert torch.equal(loaded["state_dict"]["w"], state["state_dict"]["w"]) and loaded["epoch"] == 3
    with pytest.raises(UserError, match="gone.ckpt does not exist"):
        SafeCheckpointIO().load_checkpoint(f"{server.url}/gone.ckpt")


# --- shards --------------------------------------------------------------------------------------------


def shard_members(tmp_path, n: int = 6) -> str:
    path = tmp_path / "s-000000.tar"
    with tarfile.open(path, "w") as tar:
        for i in range(n):
            (tmp_path / f"{i}.cls").write_text(str(i))
            tar.add(tmp_path / f"{i}.cls", arcname=f"{i:03d}.cls")
    return str(path)


@pytest.mark.parametrize("cut", [False, True])
def test_a_stream_whose_close_fails_is_one_counted_failure(tmp_path, cut):
    """webdataset's `Pipe` raises the command's exit status from `close()` (or from a read, when the
    command has ended by then): the shard's failure, counted once through the handler (not a crash);
    when the data was also cut short, still once."""
    shard = shard_members(tmp_path)
    command = f"head -c 2000 {shard}; exit 18" if cut else f"cat {shard}; exit 18"
    counter = SkipCounter()
    out = list(tar_file_members([{"url": "u", "stream": gopen_pipe(f"pipe:{command}")}], counter))
    names = [m["fname"] for m in out if m and not m["fname"].endswith("__bad__")]
    assert counter.take() == 1
    every = [f"{i:03d}.cls" for i in range(6)]
    assert names == every[: len(names)]  # the members read before the failure, in order
    assert len(names) < 6 or not cut


# --- the data module -----------------------------------------------------------------------------------


def test_manifests_are_read_once_and_never_taken_for_absent(faulty_http, digits_shards):
    for name in ("val.json", "val-000000.tar", "val-000001.tar"):
        (faulty_http.root / name).write_bytes((digits_shards / name).read_bytes())
    urls = f"{faulty_http.url}/val-{{000000..000001}}.tar"
    tiny = dict(image_size=32, num_workers=0, limits=Limits(read_retries=1, read_timeout_s=1))

    faulty_http.fail("val.json", "503", 1)
    dm = ShardDataModule(val_urls=urls, **tiny)
    assert dm.num_classes == 10 and dm.eval_view("val") == "whole"
    assert sum(len(b["key"]) for b in dm.exact_dataloader("val")) == 200
    assert faulty_http.count("val.json") == 2  # the 503 and its retry; never again

    faulty_http.reset()
    faulty_http.fail("val.json", "503")
    with pytest.raises(UserError, match=r"manifest http://\S+/val.json exists but cannot be read \(HTTP 503"):
        ShardDataModule(val_urls=urls, **tiny).eval_view("val")

    faulty_http.reset()
    (faulty_http.root / "val.json").unlink()  # no manifest: the data decides nothing
    dm = ShardDataModule(val_urls=urls, **tiny)
    assert dm.num_classes is None and dm.eval_view("val") == "crop"


def test_no_manifest_to_size_an_epoch_names_the_manifest(digits_shards, tmp_path):
    """Local shards are sized by their index (`epoch_order`); compressed or remote ones need the
    manifest."""
    for i in range(2):
        data = (digits_shards / f"train-00000{i}.tar").read_bytes()
        (tmp_path / f"train-00000{i}.tar").write_bytes(data)
        (tmp_path / f"gz-00000{i}.tar").write_bytes(gzip.compress(data))
    dm = ShardDataModule(train_urls=str(tmp_path / "train-{000000..000001}.tar"), image_size=32, batch_size=8)
    dm.setup("fit")
    manifest = json.loads((digits_shards / "train.json").read_text())
    assert dm.batches_per_epoch == sum(s["num_samples"] for s in manifest["shards"][:2]) // 8
    dm = ShardDataModule(train_urls=str(tmp_path / "gz-{000000..000001}.tar"), image_size=32)
    with pytest.raises(UserError, match=f"no manifest \\({tmp_path}/gz.json does not exist\\)"):
        dm.setup("fit")
    dm = ShardDataModule(train_urls=f"pipe:cat {tmp_path}/train-000000.tar", image_size=32)
    with pytest.raises(UserError, match="only shards named SPLIT-NNNNNN.tar"):
        dm.setup("fit")


@pytest.mark.parametrize(
    "key, value, words",
    [
        ("read_retries", -1, "read_retries is -1: it should be an integer of at least 0"),
        ("read_timeout_s", 0, "read_timeout_s is 0: it should be a positive number of seconds"),
        ("loader_timeout_s", "soon", "loader_timeout_s is 'soon': it should be a positive number of seconds"),
    ],
)
def test_read_options_are_checked(digits_shards, tmp_path, key, value, words):
    with pytest.raises(UserError, match=words):
        ShardDataModule(val_urls=str(digits_shards / "val-000000.tar"), limits=Limits(**{key: value}))
    suite = {
        "backbone": {"variant": "S/8", "img_size": 32, "width": 32, "depth": 1, "heads": 2},
        "data": {"train_urls": "a-000000.tar", "test_urls": "b-000000.tar", "image_size": 32, key: value},
        "protocols": [{"name": "knn", "kind": "knn"}],
    }
    (tmp_path / "suite.yaml").write_text(yaml.safe_dump(suite))
    with pytest.raises(UserError, match=f"suite.yaml: data: {words}"):
        load_suite(tmp_path / "suite.yaml")


def test_the_default_loader_timeout_outlasts_a_shards_tries():
    dm = ShardDataModule()
    assert dm.read_policy == ReadPolicy(retries=5, timeout_s=60.0)
    assert dm.loader_timeout_s == 2 * (6 * 60 + 1 + 2 + 4 + 8 + 16) == 782
    assert ShardDataModule(limits=Limits(read_retries=0, read_timeout_s=5)).loader_timeout_s == 10
    assert (
        sys.modules["webdataset.gopen"].gopen_schemes["https"]
        is sys.modules["ssl_vit.data.stream.tar_reader"]._gopen
    )  # webdataset reads as we do
