"""The checks on a real distributed file system: run by ``make check-glusterfs`` (as root),
never by ``make test`` (they are skipped unless ``PAYLOADD_GLUSTERFS=1``)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.integration.glusterfs import GlusterVolume


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if os.environ.get("PAYLOADD_GLUSTERFS") == "1":
        return
    skip = pytest.mark.skip(reason="a GlusterFS check: run `make check-glusterfs` (as root)")
    for item in items:
        if "tests/integration/" in item.nodeid:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def gluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GlusterVolume]:
    """A one-brick volume mounted twice (the volume's defaults: every client cache on)."""
    volume = GlusterVolume(tmp_path_factory.mktemp("gluster"))
    with volume.running():
        yield volume
