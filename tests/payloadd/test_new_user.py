"""What a new user trips on (mistakes a first user makes), against a real daemon on both
transports: a field name one typo away from the table's, a field absent from every segment, a
closed client, the data-plane socket given as the daemon's, rows of a dtype payloadd does not
store, results of `read_many` that need a cast."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import assert_type

import numpy as np
import pytest

from payload_client import (
    AsyncPayloadClient,
    CoveredRead,
    InvalidRequestError,
    PayloadClient,
    PayloadError,
    ReadResult,
    Window,
)
from tests.conftest import Daemon, Daemons, default_env

ROWS = np.zeros((4, 48, 8), np.uint8)


@pytest.fixture(scope="module")
def lax_socket(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A daemon with the default fields table that allows unknown fields: its socket."""
    tmp = tmp_path_factory.mktemp("lax")
    sock = tmp / "payloadd.sock"
    flags = ("--node", "lax", "--unknown-fields", "allow")
    with Daemons(tmp) as d:
        yield d.start(*flags, socket=sock, env=default_env()).socket


@pytest.fixture
def lax(lax_socket: Path, request: pytest.FixtureRequest) -> Iterator[PayloadClient]:
    """A client of the `lax_socket` daemon, on the transport of the test's `client`."""
    data_plane = request.node.callspec.params["client"] == "data-plane"
    with PayloadClient(lax_socket, data_plane=data_plane) as c:
        yield c


@pytest.mark.parametrize(
    "typo", ["routed_expert", "rotued_experts", "routed_experts_", "sampling_masks"]
)
def test_a_field_one_typo_away_is_refused_naming_the_field_meant(
    client: PayloadClient, lax: PayloadClient, lax_socket: Path, typo: str
) -> None:
    run = f"typo-{uuid.uuid4().hex[:8]}"
    meant = "sampling_mask" if typo.startswith("sampling") else "routed_experts"
    rows = np.zeros((4, 3), np.int32) if meant == "sampling_mask" else ROWS
    far = np.zeros((4, 1), np.float32)
    # unknown fields refused (the default): the typo names the field meant, and a name far
    # from the table's is refused too, saying how to declare it
    with pytest.raises(
        InvalidRequestError, match=f"unknown field '{typo}': did you mean '{meant}'"
    ):
        client.append(typo, rows, 0, run=run, step=0)
    with pytest.raises(InvalidRequestError, match="unknown field 'logprobs_custom': this "
                       r"daemon's fields are \[.*\]; to use another, declare it"):  # fmt: skip
        client.append("logprobs_custom", far, 0, run=run, step=0)
    # unknown fields allowed: the typo is still refused, naming the field meant; a name far
    # from the table's is stored
    with pytest.raises(InvalidRequestError, match=f"unknown field '{typo}': did you mean "
                       f"'{meant}'\\? A name this close .* is refused as a typo"):  # fmt: skip
        lax.append(typo, rows, 0, run=run, step=0)
    assert not (lax_socket.parent / "root" / "lax" / run).exists()  # nothing was written
    segs = lax.append("logprobs_custom", far, 0, run=run, step=0)
    assert segs[0].field == "logprobs_custom"
    got = lax.read_field(segs, "logprobs_custom", 0, 4, 0.0)
    assert got is not None and got.dtype == np.float32 and (got == 0).all()


def test_required_raises_for_a_field_no_segment_has(client: PayloadClient, run_name: str) -> None:
    segs = client.append("routed_experts", ROWS, 0, run=run_name, step=0)
    # docs/contract.md, "Reading a window": a field of the table with no segment reads as None
    assert client.read_field(segs, "sampling_mask", 0, 4, -1) is None
    with pytest.raises(InvalidRequestError, match=r"no segment of field 'sampling_mask' in the"
                       r" list \(its fields: \['routed_experts'\]\)"):  # fmt: skip
        client.read_field(segs, "sampling_mask", 0, 4, -1, required=True)
    with pytest.raises(InvalidRequestError, match="window 1: no segment of field 'weights'"):
        client.read_many([Window(segs, "routed_experts", 0, 4, 0),
                          Window(segs, "weights", 0, 4, 0.0, required=True)])  # fmt: skip
    # a field in no table is refused, required or not (it would read as None)
    with pytest.raises(InvalidRequestError, match="window 1: unknown field 'x': did you mean"):
        client.read_many([Window(segs, "routed_experts", 0, 4, 0),
                          Window(segs, "x", 0, 4, 0)])  # fmt: skip
    got = client.read_field(segs, "routed_experts", 0, 4, 0, required=True)
    assert got is not None and got.shape == (4, 48, 8)


def test_a_closed_client_raises_a_payload_error(daemon: Daemon, run_name: str) -> None:
    c = PayloadClient(daemon.socket)
    segs = c.append("routed_experts", ROWS, 0, run=run_name, step=0)
    c.close()
    c.close()  # again: nothing
    for call in (
        lambda: c.read_field(segs, "routed_experts", 0, 4, 0),
        lambda: c.append("routed_experts", ROWS, 0, run=run_name, step=0),
        c.stats,
        c.health,
    ):
        with pytest.raises(InvalidRequestError, match="is closed: make a new one"):
            call()

    async def main() -> None:
        ac = AsyncPayloadClient(daemon.socket)
        await ac.close()
        with pytest.raises(PayloadError, match="is closed"):
            await ac.read_field(segs, "routed_experts", 0, 4, 0)

    asyncio.run(main())


def test_the_data_plane_socket_given_as_the_daemons_is_named(daemon: Daemon) -> None:
    with pytest.raises(InvalidRequestError, match=rf"is the data-plane socket; give the daemon's "
                       rf"socket {daemon.socket}"):  # fmt: skip
        PayloadClient(f"{daemon.socket}.data")


@pytest.mark.parametrize(
    ("field", "dtype", "message"),
    [
        (
            "routed_experts",
            np.int64,
            "field 'routed_experts' takes dtype uint8 or uint16, got int64",
        ),
        ("sampling_mask", np.int64, "field 'sampling_mask' takes dtype int32, got int64"),
        ("my_field", np.float64, r"rows dtype must be one of \[.*\], got float64"),
    ],
)
def test_rows_of_a_dtype_not_stored_get_a_hint_for_their_field(
    client: PayloadClient, field: str, dtype: type, message: str, run_name: str
) -> None:
    rows: np.ndarray = np.zeros((4, 48, 8) if field == "routed_experts" else (4, 3), dtype)
    with pytest.raises(InvalidRequestError, match=message) as err:
        client.append(field, rows, 0, run=run_name, step=0)
    assert "cast them yourself" in str(err.value)


def test_collecting_a_run_that_is_not_there_says_so_and_names_the_close_one(
    daemons: Daemons,
) -> None:
    """A daemon of its own: the note is built from every run the daemon has."""
    with PayloadClient(daemons.start(node="test").socket) as c:
        c.append("routed_experts", ROWS, 0, run="grpo-run-7", step=0)
        report = c.gc(run="grpo-run7", through_step=0, dry_run=True)
        assert report.files == 0
        assert report.note.startswith("no run 'grpo-run7' on node 'test'; did you mean "
                                      "'grpo-run-7'?")  # fmt: skip
        assert "its runs: " in report.note
        gone = c.delete_run("nothing-like-it", dry_run=True)
        assert gone.note.startswith("no run 'nothing-like-it' on node 'test' (its runs:")
        assert c.gc(run="grpo-run-7", through_step=0, dry_run=True).note == ""  # it is there


def test_usage_of_one_run_and_more_said_plainly(daemon: Daemon, run_name: str) -> None:
    a, b = f"{run_name}-a", f"{run_name}-b"
    with PayloadClient(daemon.socket) as c:
        for step in range(3):
            c.append("routed_experts", ROWS, 0, run=a, step=step)
        c.append("routed_experts", ROWS, 0, run=b, step=0)
        every = c.usage()
        one = c.usage(run=b, max_steps=1)
        assert [r.run for r in one.runs] == [b] and len(one.runs[0].steps) == 1
        assert one.more_runs == len(every.runs) - 1  # the others, counted not listed
        assert one.files == every.files  # totals of every run
        with pytest.raises(InvalidRequestError, match="run"):
            c.usage(run="../x")
    out = subprocess.run(
        [sys.executable, "-m", "payloadd", "stat", "--socket", str(daemon.socket),
         "--max-steps", "1", "--interval", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert re.search(r"\d+ more runs? not listed \(--max-steps N, or --run RUN\)", out.stdout)


def test_read_many_is_typed_by_its_coverage(client: PayloadClient, run_name: str) -> None:
    # `assert_type` is checked by mypy (make test): the common case is arrays, no cast
    rows = np.arange(2 * 48 * 8, dtype=np.uint8).reshape(2, 48, 8)
    segs = client.append("routed_experts", rows, 0, run=run_name, step=0)
    windows = [Window(segs, "routed_experts", 0, 3, 0), Window(segs, "sampling_mask", 0, 3, -1)]
    arrays = assert_type(client.read_many(windows), list[np.ndarray | None])
    assert arrays[0] is not None and arrays[0].shape == (3, 48, 8) and arrays[1] is None
    covered = assert_type(client.read_many(windows, coverage=True), list[CoveredRead])
    assert [c.covered.tolist() for c in covered] == [[True, True, False], [False] * 3]
    asking = [windows[0], windows[1]._replace(coverage=True)]
    mixed = assert_type(client.read_many(asking, coverage=None), list[ReadResult])
    assert isinstance(mixed[0], np.ndarray) and isinstance(mixed[1], CoveredRead)
    with pytest.raises(InvalidRequestError, match="window 1: this window asks for coverage"):
        client.read_many(asking)  # the type says arrays: refused, not a CoveredRead


@pytest.mark.asyncio
async def test_async_read_many_is_typed_by_its_coverage(
    aclient: AsyncPayloadClient, run_name: str
) -> None:
    rows = np.ones((2, 48, 8), np.uint8)
    segs = await aclient.append("routed_experts", rows, 0, run=run_name, step=0)
    windows = [Window(segs, "routed_experts", 0, 2, 0)]
    (array,) = assert_type(await aclient.read_many(windows), list[np.ndarray | None])
    assert array is not None and (array == 1).all()
    (cov,) = assert_type(await aclient.read_many(windows, coverage=True), list[CoveredRead])
    assert cov.covered.all()
