"""The checks on a real distributed file system: run by ``make check-glusterfs`` (as root),
never by ``make test`` (they are skipped unless ``PAYLOADD_GLUSTERFS=1``)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.integration.glusterfs import GlusterVolume

CHECKS = {
    "tests/integration/test_hosts.py": ("PAYLOADD_HOSTS", "make check-hosts"),
    "tests/integration/": ("PAYLOADD_GLUSTERFS", "make check-glusterfs"),
}
"""Each check's tests (the first prefix that matches), the variable that runs them, and the
make target that sets it."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for prefix, (variable, target) in CHECKS.items():
            if item.nodeid.startswith(prefix):
                if os.environ.get(variable) != "1":
                    what = "a many-hosts" if "HOSTS" in variable else "a GlusterFS"
                    reason = f"{what} check: run `{target}` (as root)"
                    item.add_marker(pytest.mark.skip(reason=reason))
                break


@pytest.fixture(scope="session")
def gluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GlusterVolume]:
    """A one-brick volume mounted twice (the volume's defaults: every client cache on)."""
    volume = GlusterVolume(tmp_path_factory.mktemp("gluster"))
    with volume.running():
        yield volume
