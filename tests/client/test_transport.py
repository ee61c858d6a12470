"""Client robustness against real daemons: keep-alive, restarts, cut answers, timeouts.

Reads are retried once on a dropped connection; appends never are, and say whether they
may be stored; timeouts fire over HTTP and on the data plane.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import dataclasses
import os
import re
import select
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from payload_client import (
    AppendInDoubtError,
    AsyncPayloadClient,
    ConnectError,
    ConnectionLostError,
    InvalidRequestError,
    PayloadClient,
    PayloadError,
    Timeout,
    TimeoutError,
    TransportError,
)
from payload_client.transports._http import translate
from payload_client.transports.dataplane._descriptors import NOTE_EVERY
from payload_client.transports.dataplane._steps import Exchange
from payload_client.wire._dataplane import CommitRequest, NoteRequest
from tests.conftest import Daemon, Daemons, await_until, wait_until

R = "routed_experts"


def _rows(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, 48, 8)).astype(np.uint8)


def _copies(root: Path, rows: np.ndarray) -> int:
    """How many times ``rows``' bytes are stored anywhere under ``root``."""
    pattern = rows.tobytes()
    return sum(p.read_bytes().count(pattern) for p in root.rglob("*") if p.is_file())


def _stack(thread: threading.Thread) -> set[str]:
    frame = sys._current_frames().get(thread.ident or 0)
    names = set()
    while frame is not None:
        names.add(frame.f_code.co_name)
        frame = frame.f_back
    return names


def _stop(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until every thread of it has stopped (a signal is not
    delivered synchronously: a thread on another CPU could still answer)."""
    os.kill(pid, signal.SIGSTOP)

    def stopped() -> bool:
        states = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(FileNotFoundError):  # a thread that just ended
                states.append((task / "stat").read_text().rpartition(")")[2].split()[0])
        return all(state in "tT" for state in states)

    wait_until(stopped, 30, f"every thread of {pid} stopped", every=0.005)


async def _until(done: Callable[[], bool]) -> None:
    await await_until(done, 30, "the client getting there")


# -- timeouts as values -------------------------------------------------------------------


def test_timeouts_are_checked_immutable_values() -> None:
    assert Timeout.of(5) == Timeout(connect=5, read=5, write=5, pool=5)
    assert Timeout.of(httpx.Timeout(3.0, read=None)) == Timeout(
        connect=3.0, read=None, write=3.0, pool=3.0
    )
    t = Timeout(read=0.5)
    assert Timeout.of(t) is t and (t.connect, t.keepalive) == (60.0, 2.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.read = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        Timeout(5.0)  # type: ignore[call-arg]  # which limit would it be? keywords only
    bads: list[tuple[dict[str, Any], str]] = [
        ({"read": 0}, "read must be finite and > 0"),
        ({"connect": -1.0}, "connect must be finite and > 0"),
        ({"pool": float("inf")}, "pool must be finite"),
        ({"write": "5"}, "write must be a number"),
        ({"read": True}, "read must be a number"),
        ({"keepalive": -0.5}, "keepalive must be finite and >= 0"),
        ({"keepalive": None}, "keepalive must be a number"),
    ]
    for bad, match in bads:
        with pytest.raises(InvalidRequestError, match=match):
            Timeout(**bad)
    assert Timeout(keepalive=0).keepalive == 0
    with pytest.raises(InvalidRequestError, match="timeout must be seconds or a Timeout"):
        PayloadClient("/nowhere.sock", timeout="60")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="connect must be finite"):
        AsyncPayloadClient("/nowhere.sock", timeout=float("nan"))


def test_what_a_failed_call_means() -> None:
    req = httpx.Request("POST", "http://payloadd/v1/append")
    drop = httpx.RemoteProtocolError("Server disconnected", request=req)

    def of(exc: httpx.HTTPError, **kw: bool) -> TransportError:
        return translate(
            exc, "s.sock", **{"idempotent": False, "sent": False, "retried": False, **kw}
        )

    assert type(of(drop, sent=True)) is AppendInDoubtError
    assert type(of(httpx.ReadTimeout("t", request=req), sent=True)) is AppendInDoubtError
    not_stored = [drop, httpx.WriteError("w"), httpx.WriteTimeout("t"), httpx.PoolTimeout("p")]
    for exc in [*not_stored, httpx.ConnectError("refused")]:
        err = of(exc)
        assert "nothing was stored" in str(err) and not isinstance(err, AppendInDoubtError)
    read = of(drop, idempotent=True, sent=True, retried=True)
    assert type(read) is ConnectionLostError and "also on the one retry" in str(read)
    assert "stored" not in str(read)
    assert type(of(httpx.ReadTimeout("t"), idempotent=True)) is TimeoutError


# -- keep-alive ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def brief(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon that closes HTTP connections idle for 0.3 s."""
    with Daemons(tmp_path_factory.mktemp("keepalive")) as d:
        started = d.start("--keep-alive-s", "0.3", socket=d.folder / "payloadd.sock")
        yield Daemon(started.root, started.socket)


def _idle_connection(path: Path) -> socket.socket:
    """A raw connection that made one request and read its whole answer."""
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.connect(str(path))
    raw.sendall(b"GET /healthz HTTP/1.1\r\nHost: payloadd\r\n\r\n")
    data = b""
    while b"\r\n\r\n" not in data:
        data += raw.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = re.search(rb"content-length: *(\d+)", head, re.IGNORECASE)
    assert head.startswith(b"HTTP/1.1 200") and length is not None
    while len(body) < int(length[1]):
        body += raw.recv(65536)
    return raw


def test_the_daemon_closes_connections_idle_for_keep_alive_s(brief: Daemon, daemon: Daemon) -> None:
    with _idle_connection(brief.socket) as short, _idle_connection(daemon.socket) as default:
        readable, _, _ = select.select([short], [], [], 3.0)  # 0.3 s here; 5 s by default
        assert readable and short.recv(1) == b""
        assert not select.select([default], [], [], 0)[0]  # keep_alive_s 5: still open


@pytest.mark.asyncio
async def test_clients_idle_past_the_daemons_keep_alive_then_work(brief: Daemon) -> None:
    rows = _rows(1, 10)
    with (
        PayloadClient(brief.socket, data_plane=False) as h,
        PayloadClient(brief.socket) as d,
    ):
        async with (
            AsyncPayloadClient(brief.socket, data_plane=False) as ah,
            AsyncPayloadClient(brief.socket) as ad,
        ):
            before = h.stats()
            segs = [h.append(R, rows, 0, run="idle", step=0)]
            segs.append(d.append(R, rows, 10, run="idle", step=0))
            segs.append(await ah.append(R, rows, 20, run="idle", step=0))
            segs.append(await ad.append(R, rows, 30, run="idle", step=0))
            d.health()
            await ad.health()
            await asyncio.sleep(1.0)  # every pooled connection was closed by the daemon
            # an append is never retried: one sent on a closed connection would fail
            segs.append(h.append(R, rows, 40, run="idle", step=0))
            segs.append(d.append(R, rows, 50, run="idle", step=0))
            segs.append(await ah.append(R, rows, 60, run="idle", step=0))
            segs.append(await ad.append(R, rows, 70, run="idle", step=0))
            flat = [s for seg in segs for s in seg]
            want = np.concatenate([rows] * 8)
            np.testing.assert_array_equal(h.read_field(flat, R, 0, 80, 0), want)
            np.testing.assert_array_equal(d.read_field(flat, R, 0, 80, 0), want)
            np.testing.assert_array_equal(await ah.read_field(flat, R, 0, 80, 0), want)
            np.testing.assert_array_equal(await ad.read_field(flat, R, 0, 80, 0), want)
            d.stats()  # the data-plane clients tell the daemon's counters
            await ad.stats()
            assert h.stats().appends - before.appends == 8


# -- restarts and cut answers: reads retried once ------------------------------------------


@pytest.mark.asyncio
async def test_reads_survive_restarts_and_answers_cut_midway(
    tmp_path: Path, daemons: Daemons
) -> None:
    sock = tmp_path / "payloadd.sock"
    rows = _rows(3, 8192)  # 3 MiB answers: far more than a socket buffer holds
    async with contextlib.AsyncExitStack() as stack:
        procs = [stack.enter_context(daemons.run(socket=sock)).proc]

        def kill() -> None:
            procs[-1].kill()
            procs[-1].wait()

        def restart() -> None:
            kill()
            procs.append(stack.enter_context(daemons.run(socket=sock)).proc)

        h = stack.enter_context(PayloadClient(sock, data_plane=False))
        d = stack.enter_context(PayloadClient(sock))
        ah = await stack.enter_async_context(AsyncPayloadClient(sock, data_plane=False))
        ad = await stack.enter_async_context(AsyncPayloadClient(sock))
        segs = d.append(R, rows, 0, run="cut", step=0)

        def check(got: Any) -> None:
            np.testing.assert_array_equal(got, rows[100:8000])

        for c in (h, d):
            check(c.read_field(segs, R, 100, 8000, 0, dtype=np.uint8))
            c.health()
        for a in (ah, ad):
            check(await a.read_field(segs, R, 100, 8000, 0, dtype=np.uint8))
            await a.health()

        # killed once the answer's head arrived, restarted: the read goes again, once
        sent: list[str] = []
        cut: list[Callable[[], None]] = [restart]
        h._http.client.event_hooks["request"].append(lambda r: sent.append(r.url.path))

        def on_answer(r: httpx.Response) -> None:
            if r.url.path == "/v1/read" and cut:
                cut.pop()()

        h._http.client.event_hooks["response"].append(on_answer)
        check(h.read_field(segs, R, 100, 8000, 0, dtype=np.uint8))
        assert sent == ["/v1/read", "/v1/read"] and len(procs) == 2

        # restarted between two requests of clients holding pooled connections: they work
        check(d.read_field(segs, R, 100, 8000, 0, dtype=np.uint8))
        d.health()
        for a in (ah, ad):
            await a.health()
            check(await a.read_field(segs, R, 100, 8000, 0, dtype=np.uint8))
            more = await a.append(R, rows[:5], 0, run="cut", step=1)
            np.testing.assert_array_equal(await a.read_field(more, R, 0, 5, 0), rows[:5])

        # the same on the async client
        asent: list[str] = []
        acut: list[Callable[[], None]] = [restart]

        async def alog(r: httpx.Request) -> None:
            asent.append(r.url.path)

        async def aon_answer(r: httpx.Response) -> None:
            if r.url.path == "/v1/read" and acut:
                await asyncio.to_thread(acut.pop())

        ah._http.client.event_hooks["request"].append(alog)
        ah._http.client.event_hooks["response"].append(aon_answer)
        check(await ah.read_field(segs, R, 100, 8000, 0, dtype=np.uint8))
        assert asent == ["/v1/read", "/v1/read"] and len(procs) == 3

        # exactly once: killed again and not restarted, the one retry is refused
        sent.clear()
        cut.append(kill)
        with pytest.raises(ConnectError, match="no payloadd listening on"):
            h.read_field(segs, R, 100, 8000, 0, dtype=np.uint8)
        assert sent == ["/v1/read", "/v1/read"]
        with pytest.raises(ConnectError, match="nothing was stored") as info:
            h.append(R, rows[:5], 0, run="cut", step=2)
        assert not isinstance(info.value, AppendInDoubtError)


# -- appends: never re-sent, and the error says whether they may be stored ----------------


@pytest.mark.asyncio
async def test_an_append_cut_off_says_whether_it_may_be_stored(
    tmp_path: Path, daemons: Daemons
) -> None:
    root, sock = tmp_path / "root", tmp_path / "payloadd.sock"
    small, big = _rows(4, 2), _rows(5, 12000)  # 768 bytes; 4.4 MiB: more than a socket holds
    errors: dict[str, PayloadError] = {}

    def append(name: str, c: PayloadClient, rows: np.ndarray) -> None:
        try:
            c.append(R, rows, 0, run="doubt", step=0)
        except PayloadError as exc:
            errors[name] = exc

    with (
        daemons.run(root=root, socket=sock) as d,
        PayloadClient(sock, data_plane=False) as c1,
        PayloadClient(sock, data_plane=False) as c2,
    ):
        async with AsyncPayloadClient(sock, data_plane=False) as ac:
            sent = asyncio.Event()

            async def on_request(r: httpx.Request) -> None:
                sent.set()

            ac._http.client.event_hooks["request"].append(on_request)
            _stop(d.pid)
            try:
                whole = threading.Thread(target=append, args=("whole", c1, small))
                part = threading.Thread(target=append, args=("part", c2, big))
                whole.start()
                part.start()
                task = asyncio.create_task(ac.append(R, small, 0, run="doubt", step=1))
                await _until(lambda: "_receive_event" in _stack(whole))  # all sent, waiting
                await _until(lambda: "_send_request_body" in _stack(part))  # stuck sending
                await sent.wait()
                await asyncio.sleep(0.2)  # its 1 KiB goes out at once, then it waits
            finally:
                os.kill(d.pid, signal.SIGKILL)
                d.proc.wait()
            await asyncio.to_thread(whole.join, 30)
            await asyncio.to_thread(part.join, 30)
            with pytest.raises(AppendInDoubtError, match="may or may not have been stored"):
                await task
    assert isinstance(errors["whole"], AppendInDoubtError)
    assert "appending the rows again may store them twice" in str(errors["whole"])
    assert type(errors["part"]) is ConnectionLostError
    assert "nothing was stored" in str(errors["part"])
    assert _copies(root, big) == 0


@pytest.mark.asyncio
async def test_timeouts_fire_over_http_and_on_the_data_plane(
    tmp_path: Path, daemons: Daemons, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, sock = tmp_path / "root", tmp_path / "payloadd.sock"
    rows = _rows(6, 4)
    t = Timeout(read=0.3)
    with daemons.run("--max-file-bytes", "65536", root=root, socket=sock) as dm:
        with PayloadClient(sock) as setup:
            seg = setup.append(R, rows, 0, run="stuck", step=0)  # no client below opened it
        with (
            PayloadClient(sock, data_plane=False, timeout=t) as h,
            PayloadClient(sock, timeout=t) as d,
        ):
            async with (
                AsyncPayloadClient(sock, data_plane=False, timeout=t) as ah,
                AsyncPayloadClient(sock, timeout=t) as ad,
            ):
                _stop(dm.pid)
                try:
                    with pytest.raises(TimeoutError, match="timed out") as info:
                        h.read_field(seg, R, 0, 4, 0)
                    assert isinstance(info.value, builtins.TimeoutError)
                    with pytest.raises(TimeoutError):
                        await ah.read_field(seg, R, 0, 4, 0)
                    with pytest.raises(TimeoutError):
                        h.health()
                    with pytest.raises(TimeoutError):
                        await ah.stats()
                    # sent whole, unanswered: in doubt (the daemon may store it once resumed)
                    with pytest.raises(AppendInDoubtError, match="timed out waiting"):
                        h.append(R, rows, 0, run="stuck", step=1)
                    with pytest.raises(AppendInDoubtError, match="timed out waiting"):
                        await ah.append(R, rows, 0, run="stuck", step=1)
                    # the data socket honours the read timeout too; no HTTP detour after it
                    dp = "data plane at .* gave no answer within 0.3 s"
                    with pytest.raises(TimeoutError, match=dp):
                        d.read_field(seg, R, 0, 4, 0)
                    with pytest.raises(TimeoutError, match=dp):
                        await ad.read_field(seg, R, 0, 4, 0)
                    with pytest.raises(TimeoutError, match=dp):  # a lease: nothing written
                        d.append(R, rows, 0, run="stuck", step=2)
                    with pytest.raises(TimeoutError, match=dp):
                        await ad.append(R, rows, 0, run="stuck", step=2)
                finally:
                    os.kill(dm.pid, signal.SIGCONT)
                np.testing.assert_array_equal(d.read_field(seg, R, 0, 4, 0), rows)
                np.testing.assert_array_equal(await ad.read_field(seg, R, 0, 4, 0), rows)

            # a reservation (rows above the file size) whose commit gets no answer is in doubt
            assert d._data_plane is not None
            exchange = d._data_plane._exchange

            def stop_at_commit(step: Exchange) -> Any:
                if isinstance(step.request, CommitRequest):
                    _stop(dm.pid)
                return exchange(step)

            monkeypatch.setattr(d._data_plane, "_exchange", stop_at_commit)
            big = _rows(7, 200)  # 76800 bytes > --max-file-bytes: reserved, not leased
            try:
                with pytest.raises(AppendInDoubtError, match=r"commit .* may or may not"):
                    d.append(R, big, 0, run="stuck", step=3)
            finally:
                os.kill(dm.pid, signal.SIGCONT)
            monkeypatch.undo()
            again = d.append(R, big, 0, run="stuck", step=3)  # a new connection: works
            np.testing.assert_array_equal(d.read_field(again, R, 0, 200, 0), big)


# -- the data plane: an append written through a descriptor is never sent again -----------


@pytest.mark.asyncio
async def test_data_plane_appends_around_a_daemon_death_are_stored_once(
    tmp_path: Path, daemons: Daemons, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, sock = tmp_path / "root", tmp_path / "payloadd.sock"
    blocks = [_rows(100 + k, 16) for k in range(NOTE_EVERY + 3)]  # the last two: async
    with contextlib.ExitStack() as stack:
        procs = [stack.enter_context(daemons.run(socket=sock)).proc]
        c = stack.enter_context(PayloadClient(sock))
        async with AsyncPayloadClient(sock) as ac:
            first = await ac.append(R, blocks[-1], 0, run="die", step=0)
            segs = [
                c.append(R, b, 16 * k, run="die", step=0)
                for k, b in enumerate(blocks[: NOTE_EVERY - 1])
            ]
            # this append's rows are written, then its counters note finds the daemon dead
            assert c._data_plane is not None
            exchange = c._data_plane._exchange

            def die_before_note(step: Exchange) -> Any:
                if isinstance(step.request, NoteRequest):
                    procs[0].kill()
                    procs[0].wait()
                return exchange(step)

            monkeypatch.setattr(c._data_plane, "_exchange", die_before_note)
            last = NOTE_EVERY - 1
            segs.append(c.append(R, blocks[last], 16 * last, run="die", step=0))
            monkeypatch.undo()
            assert procs[0].returncode is not None  # it did die mid-append

            # the daemon is gone: an append says nothing was stored, and nothing was
            with PayloadClient(sock) as fresh, pytest.raises(ConnectError, match="nothing was"):
                fresh.append(R, blocks[NOTE_EVERY], 0, run="die", step=0)
            assert _copies(root, blocks[NOTE_EVERY]) == 0

            procs.append(stack.enter_context(daemons.run(socket=sock)).proc)
            segs.append(c.append(R, blocks[NOTE_EVERY], 16 * NOTE_EVERY, run="die", step=0))
            second = await ac.append(R, blocks[-2], 0, run="die", step=1)
            assert segs[-1][0].file != segs[-2][0].file  # a lease of the new daemon
            assert second[0].file != first[0].file
            for block, seg in [*zip(blocks, segs, strict=False), (blocks[-1], first)]:  # 0..64, 66
                got = c.read_field(seg, R, seg[0].pos, seg[0].pos + 16, 0)
                np.testing.assert_array_equal(got, block)
            np.testing.assert_array_equal(await ac.read_field(second, R, 0, 16, 0), blocks[-2])
            for block in blocks:
                assert _copies(root, block) == 1
            c.stats()
            stats = await ac.stats()
            assert stats.appends == 2 and stats.reads == 0  # the new daemon: nothing over HTTP
