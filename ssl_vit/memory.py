"""How much of the host's memory a new allocation can have."""

from __future__ import annotations

import contextlib
import os


def host_available() -> int:
    """Bytes the host can give new allocations without swapping: Linux's `MemAvailable`, which counts
    the page cache the kernel drops on demand. Free pages alone (`SC_AVPHYS_PAGES`, `MemFree`) leave
    that cache out, and on a node that has just read its shards most of the memory is cache: they
    would call a machine with gigabytes to spare full. Elsewhere, the free pages."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
