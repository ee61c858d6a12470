"""What a writer or a reader gets wrong is refused, never stored or read silently.

Through the public client against real daemons, on the data plane and over HTTP: row shapes
fixed per run, unknown fields refused, appends into collected steps refused (also after a
restart and from another node of a shared root), the GC watermark named ``through_step``,
unknown format names refused. Each refusal leaves the daemon's files and counters as they
were.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from payload_client import (
    InvalidRequestError,
    InvalidSegmentError,
    PayloadClient,
    StepCollectedError,
    encode_segments,
)

from ..conftest import TRANSPORTS, Daemons, default_env, wait_until

RE = "routed_experts"
MASK = "sampling_mask"


def _run() -> str:
    return f"fc-{uuid.uuid4().hex[:8]}"


def _ids(n: int, shape: tuple[int, ...] = (48, 8)) -> np.ndarray:
    return (np.arange(n * int(np.prod(shape))) % 251).astype(np.uint8).reshape(n, *shape)


def _files(root: Path) -> dict[str, int]:
    """Every data file under the root with its size (the ledgers and shape records too)."""
    return {
        os.path.join(d, f): os.path.getsize(os.path.join(d, f))
        for d, _, fs in os.walk(root)
        for f in fs
    }


@pytest.fixture(scope="module")
def strict(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A daemon with the default settings (the default fields, unknown ones refused); its
    socket, beside its root ``root``."""
    with Daemons(tmp_path_factory.mktemp("strict")) as d:
        yield d.start(node="s", socket=d.folder / "payloadd.sock", env=default_env()).socket


@pytest.fixture(params=TRANSPORTS)
def c(strict: Path, request: pytest.FixtureRequest) -> Iterator[PayloadClient]:
    with PayloadClient(strict, data_plane=request.param == "data-plane") as client:
        yield client
        # its data-plane appends counted before it goes: closing tells the daemon without
        # waiting, and the next test's counters must not take them in between its snapshots
        client.stats()


def _unchanged(c: PayloadClient, root: Path) -> tuple[dict[str, int], int, int]:
    stats = c.stats()
    return _files(root), stats.appends, stats.bytes_appended


# -- 1. a field's row shape is fixed per run ---------------------------------------------------


@pytest.mark.parametrize("shape", [(8, 48), (384,), (48, 4), (48, 8, 1)])
def test_another_row_shape_in_a_run_is_refused_naming_both(
    c: PayloadClient, strict: Path, shape: tuple[int, ...]
) -> None:
    run = _run()
    c.append(RE, _ids(4), 0, run=run, step=0)
    before = _unchanged(c, strict.parent / "root")
    with pytest.raises(
        InvalidRequestError, match=r"\[48, 8\].*got \[" + ", ".join(map(str, shape))
    ):
        c.append(RE, _ids(4, shape), 4, run=run, step=0)
    with pytest.raises(InvalidRequestError, match=r"\[48, 8\]"):  # in any step of the run
        c.append(RE, _ids(4, shape), 4, run=run, step=1)
    assert _unchanged(c, strict.parent / "root") == before  # nothing written, nothing counted
    other = c.append(RE, _ids(2, shape), 0, run=_run(), step=0)  # another run: its own shape
    assert other[0].shape == list(shape)


def test_one_append_mixing_two_shapes_of_a_field_is_refused_whole(
    c: PayloadClient, strict: Path
) -> None:
    run = _run()
    before = _unchanged(c, strict.parent / "root")
    with pytest.raises(InvalidRequestError, match=r"\[48, 8\].*earlier item.*got \[8, 48\]"):
        c.append_many([(RE, _ids(2), 0), (RE, _ids(2, (8, 48)), 2)], run=run, step=0)
    assert _unchanged(c, strict.parent / "root") == before
    c.append(RE, _ids(2, (8, 48)), 0, run=run, step=0)  # nothing was fixed by the refusal


def test_masks_keep_ragged_widths_but_not_ragged_ranks(c: PayloadClient) -> None:
    run = _run()
    a = c.append(MASK, np.full((2, 3), 7, np.int32), 0, run=run, step=0)
    b = c.append(MASK, np.full((2, 5), 9, np.int32), 2, run=run, step=0)
    got = c.read_field(a + b, MASK, 0, 4, -1)
    want = np.array([[7, 7, 7, -1, -1]] * 2 + [[9] * 5] * 2, np.int32)
    np.testing.assert_array_equal(got, want)  # narrower rows fill the leading entries
    with pytest.raises(InvalidRequestError, match=r"\[\*\].*got \[2, 3\]"):
        c.append(MASK, np.zeros((2, 2, 3), np.int32), 4, run=run, step=0)


def test_a_read_over_disagreeing_shapes_is_refused_naming_the_two_segments(
    c: PayloadClient,
) -> None:
    good = c.append(RE, _ids(4), 0, run=_run(), step=0)
    bad = c.append(RE, _ids(4, (8, 48)), 4, run=_run(), step=0)  # another run's shape
    many = good + [s for _ in range(6) for s in bad]  # a list planned over columns too
    for segs in (good + bad, many):
        with pytest.raises(InvalidSegmentError, match=r"segments 0 and 1 .*\[48, 8\].*\[8, 48\]"):
            c.read_field(segs, RE, 0, 8, 0)
    np.testing.assert_array_equal(c.read_field(good, RE, 0, 4, 0), _ids(4))


def test_writers_released_at_once_with_two_shapes_fix_exactly_one(strict: Path) -> None:
    run, n = _run(), 8
    barrier = threading.Barrier(n)
    got: list[tuple[tuple[int, ...], str]] = []

    def writer(i: int) -> None:
        shape = (48, 8) if i % 2 else (8, 48)
        with PayloadClient(strict, data_plane=i % 4 < 2) as c:
            barrier.wait(30)
            for k in range(5):
                try:
                    c.append(RE, _ids(2, shape), 2 * k, run=run, step=0)
                    got.append((shape, "stored"))
                except InvalidRequestError as exc:
                    got.append((shape, "refused" if "got [" in str(exc) else str(exc)))

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(got) == 5 * n
    stored = {shape for shape, what in got if what == "stored"}
    refused = {shape for shape, what in got if what == "refused"}
    assert len(stored) == 1 and refused == {(48, 8), (8, 48)} - stored, got
    with PayloadClient(strict) as c:  # and every later writer meets the winner
        (winner,) = stored
        other = (8, 48) if winner == (48, 8) else (48, 8)
        with pytest.raises(InvalidRequestError, match=re.escape(str(list(winner)))):
            c.append(RE, _ids(1, other), 0, run=run, step=1)


def test_a_deleted_run_fixes_its_shapes_anew_for_every_client(strict: Path) -> None:
    run = _run()
    with PayloadClient(strict) as dp, PayloadClient(strict, data_plane=False) as http:
        dp.append(RE, _ids(2), 0, run=run, step=0)
        http.delete_run(run)
        dp.append(RE, _ids(2), 0, run=run, step=1)  # the same shape: fixed again
        with pytest.raises(InvalidRequestError, match=r"\[48, 8\].*got \[8, 48\]"):
            http.append(RE, _ids(2, (8, 48)), 0, run=run, step=1)
        http.delete_run(run)
        http.append(RE, _ids(2, (8, 48)), 0, run=run, step=2)  # the other shape first now
        with pytest.raises(InvalidRequestError, match=r"\[8, 48\].*got \[48, 8\]"):
            dp.append(RE, _ids(2), 0, run=run, step=2)  # the client's memory is not the rule


def test_shapes_stay_fixed_after_a_restart(daemons: Daemons) -> None:
    run = _run()
    with daemons.run(node="r", env=default_env()) as d, PayloadClient(d.socket) as c:
        c.append(RE, _ids(2), 0, run=run, step=0)
    with daemons.run(node="r", env=default_env()) as d:
        sock = d.socket
        for dp in (True, False):
            with (
                PayloadClient(sock, data_plane=dp) as c,
                pytest.raises(InvalidRequestError, match=r"\[48, 8\]"),
            ):
                c.append(RE, _ids(2, (8, 48)), 2, run=run, step=1)
        with PayloadClient(sock) as c:
            c.delete_run(run)  # a deleted run's name starts over
            c.append(RE, _ids(2, (8, 48)), 0, run=run, step=0)


# -- 2. unknown fields refused by default -------------------------------------------------------


def test_unknown_fields_are_refused_by_default_naming_the_table(
    c: PayloadClient, strict: Path
) -> None:
    run = _run()
    segs = c.append(RE, _ids(2), 0, run=run, step=0)
    before = _unchanged(c, strict.parent / "root")
    for name in ("sample_mask", "weights"):
        with pytest.raises(InvalidRequestError, match=r"unknown field.*\['routed_experts', "
                           r"'sampling_mask'\].*--fields.*config file"):  # fmt: skip
            c.append(name, np.zeros((2, 3), np.int32), 0, run=run, step=0)
    assert _unchanged(c, strict.parent / "root") == before
    with pytest.raises(InvalidRequestError, match="did you mean 'routed_experts'"):
        c.read_field(segs, "routed_expert", 0, 2, 0)
    assert c.read_field(segs, MASK, 0, 2, -1) is None  # a table field with no segment


def test_unknown_fields_over_raw_http_are_refused(strict: Path) -> None:
    transport = httpx.HTTPTransport(uds=str(strict))
    with httpx.Client(transport=transport, base_url="http://payloadd") as http:
        table = http.get("/v1/fields").json()
        assert table["unknown_fields"] == "refuse"
        assert table["fields"][RE]["ragged"] is False and table["fields"][MASK]["ragged"]


def test_unknown_fields_allowed_as_an_explicit_opt_in(daemons: Daemons) -> None:
    sock = daemons.start("--unknown-fields", "allow", env=default_env()).socket
    for dp in (True, False):
        with PayloadClient(sock, data_plane=dp) as c:
            run = _run()
            segs = c.append("weights", np.ones((3, 2), np.float32), 0, run=run, step=0)
            np.testing.assert_array_equal(c.read_field(segs, "weights", 0, 3, 0.0), 1.0)
            with pytest.raises(InvalidRequestError, match=r"\[2\].*got \[3\]"):  # fixed
                c.append("weights", np.ones((3, 3), np.float32), 3, run=run, step=0)
            with pytest.raises(InvalidRequestError, match="unknown field 'other'"):
                c.read_field(segs, "other", 0, 3, 0)  # in no table and no segment


# -- 3. appends into collected steps refused ----------------------------------------------------


def test_an_append_into_a_collected_step_is_refused(c: PayloadClient, strict: Path) -> None:
    run = _run()
    c.append(RE, _ids(2), 0, run=run, step=3)
    assert c.gc(run=run, through_step=3).steps == [(run, 3)]
    before = _unchanged(c, strict.parent / "root")
    for step in (0, 3):
        with pytest.raises(StepCollectedError, match=f"step {step} of run '{run}'.*through step 3"):
            c.append(RE, _ids(2), 0, run=run, step=step)
    assert _unchanged(c, strict.parent / "root") == before
    c.append(RE, _ids(2), 0, run=run, step=4)
    c.gc(run=_run(), through_step=7)  # a watermark over no step is kept too
    other = _run()
    assert c.gc(run=other, through_step=2).files == 0
    with pytest.raises(StepCollectedError, match="through step 2"):
        c.append(RE, _ids(2), 0, run=other, step=2)


def test_the_watermark_holds_after_a_restart_and_across_nodes_of_a_shared_root(
    daemons: Daemons,
) -> None:
    run, env = _run(), default_env()
    with daemons.run(node="a", env=env) as first, PayloadClient(first.socket) as c:
        c.append(RE, _ids(2), 0, run=run, step=1)
        c.gc(run=run, through_step=1)
    a, b = daemons.start_all(["a", "b"], env=env).values()  # a restarted, and another node
    for sock in (a.socket, b.socket):
        for dp in (True, False):
            with (
                PayloadClient(sock, data_plane=dp) as c,
                pytest.raises(StepCollectedError, match="through step 1"),
            ):
                c.append(RE, _ids(2), 0, run=run, step=1)
    with PayloadClient(b.socket) as c:
        c.append(RE, _ids(2), 0, run=run, step=5)
        c.gc(run=run, through_step=5)  # collected on node b: node a refuses too
    with PayloadClient(a.socket, data_plane=False) as c:  # each append asks the daemon

        def refusal() -> str:
            try:
                c.append(RE, _ids(2), 0, run=run, step=4)
            except StepCollectedError as exc:
                return str(exc)
            return ""

        said = wait_until(refusal, 10, "node a seeing node b's watermark", every=0.2)
        assert "through step 5" in said
    with PayloadClient(a.socket) as c, pytest.raises(StepCollectedError, match="through step 5"):
        c.append(RE, _ids(2), 0, run=run, step=4)  # a new lease of a collected step


# -- 4. the watermark is named through_step -----------------------------------------------------


def test_through_step_includes_its_step_and_before_step_is_refused(
    c: PayloadClient, strict: Path
) -> None:
    run = _run()
    for step in range(3):
        c.append(RE, _ids(1), 0, run=run, step=step)
    with pytest.raises(InvalidRequestError, match="through_step"):
        c.gc(run=run, before_step=1)
    assert c.gc(run=run, through_step=1).steps == [(run, 0), (run, 1)]
    transport = httpx.HTTPTransport(uds=str(strict))
    with httpx.Client(transport=transport, base_url="http://payloadd") as http:
        old = http.post("/v1/admin/gc", json={"run": run, "before_step": 2})
        assert old.status_code == 400 and "through_step" in old.json()["message"]
    cli = subprocess.run(
        [sys.executable, "-m", "payloadd", "gc", "--socket", str(strict), "--run", run,
         "--before-step", "2"], capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert cli.returncode == 2 and "--through-step" in cli.stderr
    assert c.gc(run=run, through_step=2).steps == [(run, 2)]  # step 2 was still there


# -- 5. format names -------------------------------------------------------------------------


def test_encode_segments_refuses_an_unknown_format(c: PayloadClient) -> None:
    segs = c.append(RE, _ids(1), 0, run=_run(), step=0)
    with pytest.raises(InvalidRequestError, match="did you mean 'msgpack'"):
        encode_segments(segs, "msgpak")  # type: ignore[arg-type]
