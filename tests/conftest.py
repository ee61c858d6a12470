"""Shared fixtures: a real ``payloadd serve`` process on a Unix socket in a temporary folder."""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from payload_client import AsyncPayloadClient, PayloadClient
from tests._daemons import Daemon, Daemons, Started, await_until, wait_until

__all__ = [
    "TEST_FIELDS",
    "Daemon",
    "Daemons",
    "Started",
    "await_until",
    "default_env",
    "free_port",
    "wait_until",
]

INTEGERS = ["uint8", "int8", "uint16", "int16", "int32"]
TEST_FIELDS = {
    "routed_experts": {"dtypes": ["uint8", "uint16"], "fill": 0, "ragged": False},
    "sampling_mask": {"dtypes": ["int32"], "fill": -1, "max_width": 1 << 16, "ragged": True},
    # the tests' own fields: rows of any integer dtype (any float for "weights"), a ragged
    # last dimension (the number of dimensions and the others fixed per run)
    **{name: {"dtypes": INTEGERS, "ragged": True} for name in ("f", "a", "b", "c", "g", "m")},
    "weights": {"dtypes": ["float16", "float32"], "fill": 0.0, "ragged": True},
}
"""The fields every daemon the tests start declares (``PAYLOADD_FIELDS``, inherited by the
child processes): unknown fields are refused by default. A test of the default table starts
its daemon without it (`default_env`)."""
os.environ["PAYLOADD_FIELDS"] = json.dumps(TEST_FIELDS)


def default_env() -> dict[str, str]:
    """This process's environment without the tests' fields table: a daemon started with it
    has the default table."""
    return {k: v for k, v in os.environ.items() if k != "PAYLOADD_FIELDS"}


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now (for a daemon's TCP listener)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[Daemons]:
    """Start real daemons on the test's ``tmp_path`` (``daemons.start(*flags, node=...)``,
    ``daemons.start_all(nodes, *flags)``); every one is stopped at the test's end."""
    with Daemons(tmp_path) as d:
        yield d


@pytest.fixture
def run_name(request: pytest.FixtureRequest) -> str:
    """A run name of this test's own, from its node id (tests share session daemons)."""
    return run_name_of(request.node.nodeid)


def run_name_of(nodeid: str) -> str:
    """A valid run name (``[A-Za-z0-9._-]``, at most 128 characters) unique to ``nodeid``."""
    digest = hashlib.blake2b(nodeid.encode(), digest_size=4).hexdigest()
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", nodeid.rsplit("::", 1)[-1]).strip("-.")
    return f"{name[:100]}-{digest}"


@pytest.fixture(scope="session")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One real daemon for the session (default settings, node ``test``)."""
    with Daemons(tmp_path_factory.mktemp("daemon")) as d:
        started = d.start(node="test", socket=d.folder / "payloadd.sock")
        yield Daemon(started.root, started.socket)


@pytest.fixture(scope="session")
def small_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A real daemon that rotates files at 4096 bytes and takes bodies of at most 1 MiB."""
    extra = ("--max-file-bytes", "4096", "--max-request-bytes", str(1 << 20))
    with Daemons(tmp_path_factory.mktemp("small")) as d:
        started = d.start(*extra, node="small", socket=d.folder / "payloadd.sock")
        yield Daemon(started.root, started.socket)


TRANSPORTS = ["data-plane", "http"]


@pytest.fixture(params=TRANSPORTS)
def client(daemon: Daemon, request: pytest.FixtureRequest) -> Iterator[PayloadClient]:
    """A sync client of the session daemon: rows by descriptor (data plane), or over HTTP."""
    with PayloadClient(daemon.socket, data_plane=request.param == "data-plane") as c:
        yield c


@pytest_asyncio.fixture(params=TRANSPORTS)
async def aclient(
    daemon: Daemon, request: pytest.FixtureRequest
) -> AsyncIterator[AsyncPayloadClient]:
    """An async client of the session daemon, on either transport."""
    async with AsyncPayloadClient(daemon.socket, data_plane=request.param == "data-plane") as c:
        yield c
