"""What a DataLoader worker's `sys.excepthook` reports: a connection error of multiprocessing's
file-descriptor sharing thread is the main process going away (it says why itself), never news; any other
error is reported as before."""

import sys

import pytest

from ssl_vit.data.stream.workers import Workers


def raised_in(module: str, error: BaseException):
    """`sys.exc_info()` of `error` raised by code whose module is `module`."""
    namespace = {"__name__": module, "error": error}
    exec("def serve():\n    raise error\n", namespace)
    try:
        namespace["serve"]()
    except BaseException:
        return sys.exc_info()


@pytest.mark.parametrize(
    ("module", "error", "reported"),
    [
        ("multiprocessing.resource_sharer", ConnectionResetError(104, "Connection reset by peer"), False),
        ("multiprocessing.resource_sharer", EOFError(), False),
        ("multiprocessing.resource_sharer", ValueError("a real bug"), True),
        ("somewhere.else", ConnectionResetError(104, "Connection reset by peer"), True),
    ],
)
def test_only_the_sharing_threads_lost_connections_are_dropped(module, error, reported):
    seen = []
    Workers(1)._excepthook(lambda *info: seen.append(info), *raised_in(module, error))
    assert bool(seen) == reported
