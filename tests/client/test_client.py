"""The clients without a daemon: argument checks before any I/O, error mapping, light import."""

from __future__ import annotations

import asyncio
import collections.abc
import inspect
import subprocess
import sys
import typing
from pathlib import Path

import numpy as np
import pytest

from payload_client import (
    STATUS_BY_ERROR,
    AsyncPayloadClient,
    BusyError,
    ConnectError,
    FileGoneError,
    FileMissingError,
    InvalidRequestError,
    InvalidSegmentError,
    PayloadClient,
    PayloadError,
    PayloadSegment,
    ProtocolError,
    ServerError,
    StepCollectedError,
    TransportError,
    UnauthorizedError,
)
from payload_client._errors import error_from_wire, status_of
from payload_client.transports._call import _Sink
from tests.conftest import Daemons


def test_importing_the_client_loads_no_server_stack() -> None:
    code = (
        "import sys, payload_client\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('fastapi', 'uvicorn', 'starlette', 'pydantic', 'pydantic_settings', 'payloadd'))\n"
        "assert not heavy, heavy\n"
        "from payload_client import (PayloadSegment, clip_segments, shift_segments,"
        " merge_pd_segments, row_nbytes, PayloadClient, AsyncPayloadClient, PayloadError)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.fixture
def offline(tmp_path: Path) -> PayloadClient:
    """A client of a socket nobody listens on: any I/O would raise ConnectError."""
    return PayloadClient(tmp_path / "nobody.sock")


def test_connect_error_names_the_socket(offline: PayloadClient) -> None:
    with pytest.raises(ConnectError, match=r"nobody\.sock") as info:
        offline.stats()
    assert isinstance(info.value, TransportError)
    assert info.value.__cause__ is not None  # translated once, with raise ... from


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("routed_experts", [[1, 2]], 0), "numpy.ndarray"),
        (("routed_experts", np.zeros(4, np.uint8), 0), "row shape"),
        (("routed_experts", np.zeros((4, 2), np.int64), 0), "dtype"),
        (("routed_experts", np.zeros((4, 2), np.float64), 0), "dtype"),
        (("routed_experts", np.ma.masked_equal(np.eye(2, dtype=np.uint8), 0), 0), "masked"),
        (("routed_experts", np.zeros((4, 0), np.uint8), 0), "> 0"),
        (("routed_experts", np.zeros((4, 2), np.uint8), -1), "pos"),
        (("routed_experts", np.zeros((4, 2), np.uint8), 1.0), "pos"),
        (("routed_experts", np.zeros((4, 2), np.uint8), 2**63 - 2), "overflow"),
        (("bad/field", np.zeros((4, 2), np.uint8), 0), "field"),
        (("", np.zeros((4, 2), np.uint8), 0), "field"),
    ],
)
def test_bad_append_is_refused_before_any_io(
    offline: PayloadClient, args: tuple[object, ...], match: str
) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        offline.append(*args, run="r", step=0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("run", "step"),
    [("..", 0), (".", 0), ("a/b", 0), ("x" * 129, 0), ("", 0), ("r", -1), ("r", 1.0)],
)
def test_bad_run_or_step_is_refused(offline: PayloadClient, run: str, step: int) -> None:
    with pytest.raises(InvalidRequestError):
        offline.append("f", np.zeros((1, 1), np.uint8), 0, run=run, step=step)


def test_bad_read_is_refused_before_any_io(offline: PayloadClient) -> None:
    s = PayloadSegment("f", "a.bin", 0, 0, 1, "uint8", [1])
    with pytest.raises(InvalidRequestError, match="lo <= hi"):
        offline.read_field([s], "f", 2, 1, 0)
    with pytest.raises(InvalidSegmentError, match="pos"):
        half = PayloadSegment("g", "a.bin", 0, 1.5, 1, "uint8", [1])  # type: ignore[arg-type]
        offline.read_field([s, half], "f", 0, 1, 0)
    absolute = PayloadSegment("f", "/abs", 0, 0, 1, "uint8", [1])
    with pytest.raises(InvalidSegmentError, match="window 1: segment 0: file") as info:
        offline.read_many([([s], "f", 0, 1, 0), ([absolute], "f", 0, 1, 0)])
    assert (info.value.index, info.value.field) == (0, "file")


def test_reads_that_need_no_bytes_ask_the_daemon_only_for_its_fields_table(
    offline: PayloadClient, tmp_path: Path, daemons: Daemons
) -> None:
    s = PayloadSegment("f", "a.bin", 0, 10, 1, "uint8", [3])
    with pytest.raises(ConnectError, match="no payloadd listening"):  # its table first
        offline.read_field([s], "f", 0, 5, -1)
    sock = tmp_path / "s.sock"
    with PayloadClient(sock) as c:
        with daemons.run(socket=sock):
            assert c.read_field([s], "m", 0, 5, 0) is None  # the first read: the table
        # the daemon is gone: later reads that need no bytes are answered all the same
        assert c.read_field([s], "m", 0, 5, 0) is None
        got = c.read_field([s], "f", 0, 5, -1)  # no segment intersects [0, 5)
        assert got is not None and got.shape == (5, 3) and (got == -1).all()
        with pytest.raises(InvalidRequestError, match="unknown field 'other'"):
            c.read_field([s], "other", 0, 5, 0)  # in no table, in no segment: a typo


def test_status_table_and_wire_errors() -> None:
    assert STATUS_BY_ERROR[FileGoneError] == 410
    assert STATUS_BY_ERROR[FileMissingError] == 404
    assert status_of(InvalidSegmentError("x")) == 422
    # a status is shared only by a class and its subclass (the base answers for both)
    bases = [c for c in STATUS_BY_ERROR if not any(b in STATUS_BY_ERROR for b in c.__mro__[1:])]
    assert len({STATUS_BY_ERROR[c] for c in bases}) == len(bases)
    assert type(error_from_wire(400, None, "bad")) is InvalidRequestError
    assert type(error_from_wire(400, "StepCollectedError", "gone")) is StepCollectedError
    err = error_from_wire(404, "FileMissingError", "payload file 'a' does not exist")
    assert type(err) is FileMissingError and "'a'" in str(err) and "404" in str(err)
    assert type(error_from_wire(410, None, "gone")) is FileGoneError
    assert type(error_from_wire(418, "NoSuchError", "teapot")) is InvalidRequestError
    assert type(error_from_wire(404, "HTTPError", "Not Found")) is InvalidRequestError  # a route
    assert type(error_from_wire(502, None, "bad gateway")) is ServerError
    assert type(error_from_wire(503, None, "busy")) is BusyError  # the daemon at a limit
    assert STATUS_BY_ERROR[UnauthorizedError] == 401
    assert type(error_from_wire(401, None, "no token")) is UnauthorizedError
    assert type(error_from_wire(401, "UnauthorizedError", "wrong")) is UnauthorizedError
    assert all(issubclass(cls, PayloadError) for cls in STATUS_BY_ERROR)


def test_socket_and_base_url_are_exclusive(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequestError, match="not both"):
        PayloadClient(tmp_path / "s.sock", base_url="http://127.0.0.1:1")


@pytest.mark.asyncio
async def test_async_client_checks_before_io(tmp_path: Path) -> None:
    async with AsyncPayloadClient(tmp_path / "nobody.sock") as c:
        with pytest.raises(InvalidRequestError, match="numpy"):
            await c.append("f", [1], 0, run="r", step=0)  # type: ignore[arg-type]
        with pytest.raises(ConnectError):
            await c.stats()


def test_a_window_too_large_to_allocate_fails_before_io(offline: PayloadClient) -> None:
    s = PayloadSegment("f", "a.bin", 0, 0, 1, "uint8", [48, 8])
    with pytest.raises(InvalidRequestError, match="cannot be allocated"):
        offline.read_field([s], "f", 0, 2**50, 0)


@pytest.mark.parametrize("chunk", [1, 3, 5, 7, 100])
def test_http_bodies_land_in_their_targets_in_order_whatever_the_chunking(chunk: int) -> None:
    a, b, c = bytearray(3), bytearray(4), bytearray(2)
    seen: list[bytes] = []
    targets = [(memoryview(a), None), (memoryview(b), lambda: seen.append(bytes(b))),
               (memoryview(c), lambda: seen.append(bytes(c)))]  # fmt: skip
    sink = _Sink(9, targets)
    body = b"abcdefghi"
    for i in range(0, len(body), chunk):
        assert not seen or seen[0] == b"defg"  # a target is handed on as soon as it is full
        sink.write(body[i : i + chunk])
    sink.result()
    assert (bytes(a), seen) == (b"abc", [b"defg", b"hi"])
    with pytest.raises(ProtocolError, match="longer than the 9 bytes"):
        sink.write(b"x")
    short = _Sink(9, [(memoryview(bytearray(9)), None)])
    short.write(b"abc")
    with pytest.raises(ProtocolError, match="has 3 bytes, expected 9"):
        short.result()


@pytest.mark.parametrize(
    "ttl_s",
    [float("inf"), float("nan"), -1.0, True, "60", 10**400],
    ids=["inf", "nan", "negative", "bool", "str", "int-beyond-float"],
)
def test_gc_refuses_a_ttl_that_is_no_finite_number_of_seconds(
    tmp_path: Path, ttl_s: object
) -> None:
    # inf went out as JSON null: the daemon's own TTL then applied instead
    with (
        PayloadClient(tmp_path / "none.sock") as c,  # refused before any connection
        pytest.raises(InvalidRequestError, match="ttl_s"),
    ):
        c.gc(ttl_s=ttl_s)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["append", "append_many", "read_field", "read_many", "stats"])
def test_the_methods_read_as_methods_when_looked_at(name: str) -> None:
    """Each operation is written once for both clients: introspection still sees what a
    method takes and returns (`typing.get_type_hints`, `inspect.signature`), and the async
    client's methods are coroutine functions."""
    sync, aio = getattr(PayloadClient, name), getattr(AsyncPayloadClient, name)
    assert asyncio.iscoroutinefunction(aio) and not asyncio.iscoroutinefunction(sync)
    assert inspect.signature(sync) == inspect.signature(aio)
    returns = typing.get_type_hints(sync)["return"]
    assert typing.get_type_hints(aio)["return"] == returns
    assert typing.get_origin(returns) is not collections.abc.Generator
