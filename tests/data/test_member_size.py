"""A tar member too large for any image within `max_image_pixels` is judged from its tar header: read
past in chunks, never held, its sample skipped and counted. The case: a 20,000 x 20,000 `.npy` of zeros
is 400 MB, but gzip makes its shard a few hundred KB."""

import io
import tarfile
import tracemalloc

import numpy as np
import pytest
from cli_helpers import run_cli

from ssl_vit.data.datamodule import ShardDataModule
from ssl_vit.data.format.members import MAX_IMAGE_PIXELS, max_member_bytes
from ssl_vit.data.stream.tar_reader import OversizeMember, tar_file_members, tar_files

SIDE = 20_000  # 400 Mpx: above the default limit (89.5 Mpx), and 400 MB more than its member limit


class Zeros(io.RawIOBase):
    """`size` zero bytes, read in chunks: a member body that never exists in memory whole."""

    def __init__(self, size: int):
        self.left = size

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        count = min(len(buffer), self.left)
        buffer[:count] = bytes(count)
        self.left -= count
        return count


def npy_header(shape: tuple[int, ...]) -> bytes:
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(out, {"descr": "|u1", "fortran_order": False, "shape": shape})
    return out.getvalue()


def add(tar: tarfile.TarFile, name: str, data: bytes | None = None, size: int = 0, body=None) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data) if data is not None else size
    tar.addfile(info, io.BytesIO(data) if data is not None else body)


def huge_npy_shard(path, side: int = SIDE) -> None:
    """A .tar.gz of three samples: a small good one, the huge `.npy` (header, then zeros), a good one."""
    header = npy_header((side, side))
    small = io.BytesIO()
    np.save(small, np.full((8, 8, 3), 7, np.uint8))
    with tarfile.open(path, "w:gz", compresslevel=1) as tar:
        add(tar, "a.npy", small.getvalue())
        add(tar, "a.cls", b"0")
        body = io.BufferedReader(Zeros(side * side), buffer_size=1 << 20)
        add(tar, "big.npy", size=len(header) + side * side, body=io.BufferedReader(_Chain(header, body)))
        add(tar, "big.cls", b"1")
        add(tar, "c.npy", small.getvalue())
        add(tar, "c.cls", b"0")


class _Chain(io.RawIOBase):
    def __init__(self, head: bytes, rest):
        self.head, self.rest = head, rest

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if self.head:
            count = min(len(buffer), len(self.head))
            buffer[:count], self.head = self.head[:count], self.head[count:]
            return count
        data = self.rest.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


@pytest.fixture(scope="module")
def huge_shard(tmp_path_factory):
    path = tmp_path_factory.mktemp("huge") / "huge-000000.tar.gz"
    huge_npy_shard(path)
    assert path.stat().st_size < 2 << 20  # a few hundred KB holding 400 MB
    return path


def test_the_limit_admits_every_image_within_max_image_pixels():
    """An array is held to 4 bytes per pixel of the limit: the largest it may be, and an RGBA PNG of
    noise at the limit, fit under the member limit; the 400 MB `.npy` does not."""
    limit = max_member_bytes(MAX_IMAGE_PIXELS)
    assert 4 * MAX_IMAGE_PIXELS < limit < SIDE * SIDE
    assert max_member_bytes(None) is None


def test_a_huge_member_is_read_past_without_being_held(huge_shard):
    """Only its header is judged: the member's 400 MB never take memory (tracemalloc sees every bytes
    object); the samples before and after it are read whole, and its sample is counted once."""
    errors = []
    tracemalloc.start()
    with open(huge_shard, "rb") as stream:
        members = list(
            tar_file_members(
                [{"stream": stream, "url": "huge.tar.gz"}],
                lambda exn: errors.append(exn) or True,
                max_member_bytes(MAX_IMAGE_PIXELS),
            )
        )
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 64 << 20, f"{peak:,} bytes"
    names = [m["fname"] for m in members if m]
    assert names == ["a.npy", "a.cls", "big.__bad__", "big.cls", "c.npy", "c.cls"]
    assert len(errors) == 1 and isinstance(errors[0], OversizeMember)
    assert errors[0].args[0].startswith("big.npy: 400,000,128 bytes, more than the")


def test_without_a_limit_the_member_is_read_as_before():
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w") as tar:
        add(tar, "x.bin", b"y" * 5000)
    assert list(tar_files(io.BytesIO(data.getvalue()))) == [("x.bin", b"y" * 5000)]
    dropped = []
    assert list(tar_files(io.BytesIO(data.getvalue()), dropped.append, max_member_bytes=4999)) == []
    assert [str(d) for d in dropped] == [
        "x.bin: 5,000 bytes, more than the 4,999 an image within max_image_pixels takes "
        "(its sample is dropped)"
    ]


PEAK_RSS = """
import atexit, resource
_start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
def _report():
    with open({path!r}, "w") as f:
        f.write(f"{{_start}} {{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}}")
atexit.register(_report)
"""


@pytest.mark.slow
def test_data_inspect_counts_the_huge_member_without_its_memory(huge_shard, tmp_path):
    """Through the CLI: the huge sample is named with its reason and counted, the other two are read,
    and the command's peak memory grows by far less than the member's 400 MB (it grew by 0.6 GB when
    the member was read before its size was judged)."""
    rss = tmp_path / "rss"
    proc = run_cli("data", "inspect", str(huge_shard), check=False, prelude=PEAK_RSS.format(path=str(rss)))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    row = next(line for line in proc.stdout.splitlines() if line.startswith(str(huge_shard)))
    assert row.split()[1:3] == ["2", "1"]  # 2 good samples, 1 bad
    assert "big.npy: 400,000,128 bytes, more than the" in proc.stdout
    start, peak = map(int, rss.read_text().split())
    assert (peak - start) * 1024 < 200 << 20, f"peak RSS grew by {(peak - start) / 1024:.0f} MB"


def test_a_data_module_pass_skips_the_huge_member_and_counts_it(huge_shard):
    """The stream training and evaluation read: its batches hold the two good samples and count the
    huge one among `skipped`."""
    dm = ShardDataModule(test_urls=str(huge_shard), batch_size=4, num_workers=0, image_size=8)
    batches = list(dm.exact_dataloader("test"))
    assert sorted(k for b in batches for k in b["key"]) == ["a", "c"]
    assert sum(int(b["skipped"]) for b in batches) == 1
