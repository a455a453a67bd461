"""The host memory a new allocation can have: Linux's MemAvailable, page cache included."""

import os
from pathlib import Path

import pytest

from ssl_vit import memory


@pytest.mark.skipif(not Path("/proc/meminfo").exists(), reason="MemAvailable is Linux's")
def test_host_available_is_the_kernels_memavailable_not_its_free_pages():
    fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    available = int(fields["MemAvailable"].split()[0]) * 1024
    assert abs(memory.host_available() - available) < 256 * 2**20  # read a moment apart
    free_pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert memory.host_available() >= free_pages - 256 * 2**20
