"""Fixtures for the data tests."""

import pytest
from data_helpers import write_shards


@pytest.fixture(scope="session")
def unequal_shards(tmp_path_factory) -> tuple[str, list[str]]:
    """7 shards of unequal sizes, 31 samples."""
    return write_shards(tmp_path_factory.mktemp("unequal"), [5, 1, 9, 3, 7, 2, 4], prefix="val")
