"""No daemon there, and waiting for one that starts: what the client says when nothing listens
(a Unix socket or a TCP URL), ``wait_ready`` against real daemons, and its I/O-free decision
(`payload_client.clients._ready.ready_steps`) step by step."""

from __future__ import annotations

import asyncio
import errno
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from payload_client import (
    AsyncPayloadClient,
    BusyError,
    ConnectError,
    ConnectionLostError,
    Health,
    InvalidRequestError,
    PayloadClient,
    ProtocolError,
    TimeoutError,
    UnauthorizedError,
)
from payload_client.clients._ready import MAX_PAUSE_S, MIN_ATTEMPT_S, ready_steps
from payload_client.transports import Call
from tests.conftest import Daemon, Daemons


def nobody(where: object) -> str:
    return f"no payloadd listening on {where}: is `payloadd serve` running?"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture
def stale(tmp_path: Path) -> Iterator[Path]:
    """A socket file nobody listens on: what a killed daemon leaves."""
    path = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))
        yield path


# -- nothing listens: one message ----------------------------------------------------------


@pytest.mark.parametrize("where", ["absent", "stale", "tcp"])
def test_nothing_listening_says_so(tmp_path: Path, stale: Path, where: str) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    ways: dict[str, dict[str, Any]] = {
        "absent": {"socket_path": tmp_path / "absent" / "payloadd.sock"},
        "stale": {"socket_path": stale},
        "tcp": {"base_url": url, "token": "t"},
    }
    kw = ways[where]
    shown = kw.get("socket_path", url)
    with PayloadClient(**kw) as c:
        with pytest.raises(ConnectError) as info:
            c.health()
        assert str(info.value) == nobody(shown)
        assert isinstance(info.value.__cause__, httpx.ConnectError)  # raised from httpx's
        with pytest.raises(ConnectError) as info:
            c.append("routed_experts", np.zeros((1, 8), np.uint8), 0, run="r", step=0)
        assert str(info.value) == (
            f"{nobody(shown)} (nothing was stored: the append never fully reached the daemon; "
            "appending again is safe)"
        )

    async def main() -> None:
        async with AsyncPayloadClient(**kw) as a:
            with pytest.raises(ConnectError) as info:
                await a.stats()
            assert str(info.value) == nobody(shown)

    asyncio.run(main())


def test_a_data_plane_that_is_missing_too_names_the_daemon_s_socket(tmp_path: Path) -> None:
    # the data plane is tried first for reads and appends, then HTTP: the error is HTTP's
    sock = tmp_path / "payloadd.sock"
    with PayloadClient(sock) as c:
        assert c.data_socket == f"{sock}.data"
        with pytest.raises(ConnectError) as info:
            c.append("routed_experts", np.zeros((1, 8), np.uint8), 0, run="r", step=0)
    assert str(info.value).startswith(nobody(sock) + " (nothing was stored")


def test_a_daemon_without_its_data_plane_still_serves(tmp_path: Path, daemons: Daemons) -> None:
    # no <socket>.data: HTTP carries the rows, as before (no error about the data socket)
    sock = tmp_path / "s.sock"
    with daemons.run("--data-plane", "false", socket=sock), PayloadClient(sock) as c:
        rows = np.arange(8, dtype=np.uint8).reshape(1, 8)
        segs = c.append("routed_experts", rows, 0, run="r", step=0)
        np.testing.assert_array_equal(c.read_field(segs, "routed_experts", 0, 1, 0), rows)


def test_another_connect_error_keeps_its_reason(tmp_path: Path) -> None:
    with PayloadClient(tmp_path / ("x" * 120)) as c, pytest.raises(ConnectError) as info:
        c.health()
    assert "cannot connect to" in str(info.value) and "listening" not in str(info.value)


# -- wait_ready against real daemons ---------------------------------------------------------


def test_wait_ready_of_a_running_daemon_returns_its_health(daemon: Daemon) -> None:
    with PayloadClient(daemon.socket) as c:
        health = c.wait_ready()
        assert health.status == "ok" and health.node == "test"
        assert c.wait_ready(0) == health


def test_wait_ready_waits_for_a_daemon_that_starts_later(tmp_path: Path, daemons: Daemons) -> None:
    sock = tmp_path / "late.sock"
    got: list[Health | BaseException] = []

    def wait() -> None:
        try:
            with PayloadClient(sock) as c:
                got.append(c.wait_ready(60))
        except BaseException as exc:
            got.append(exc)

    async def wait_async() -> Health:
        async with AsyncPayloadClient(sock) as a:
            return await a.wait_ready(timeout_s=60)

    async def main() -> None:
        waiter = asyncio.create_task(wait_async())
        thread = threading.Thread(target=wait)
        thread.start()
        await asyncio.sleep(1.0)  # both find no daemon for a while
        assert not waiter.done() and not got
        with daemons.run("--node", "late", socket=sock):
            health = await asyncio.wait_for(waiter, 60)
            await asyncio.to_thread(thread.join, 60)
        assert health.status == "ok" and health.node == "late"
        assert len(got) == 1 and isinstance(got[0], Health) and got[0].node == "late"

    asyncio.run(main())


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_wait_ready_gives_up_with_the_no_daemon_message(tmp_path: Path, kind: str) -> None:
    sock = tmp_path / "never.sock"
    t0 = time.monotonic()
    with pytest.raises(ConnectError) as info:
        if kind == "sync":
            with PayloadClient(sock) as c:
                c.wait_ready(timeout_s=1.0)
        else:

            async def main() -> None:
                async with AsyncPayloadClient(sock) as a:
                    await a.wait_ready(timeout_s=1.0)

            asyncio.run(main())
    took = time.monotonic() - t0
    assert str(info.value) == f"{nobody(sock)} (waited 1 s)"
    assert isinstance(info.value.__cause__, ConnectError)
    assert 1.0 <= took < 1.0 + MIN_ATTEMPT_S + 5


def test_wait_ready_keeps_an_attempt_within_the_time_left(tmp_path: Path) -> None:
    # a socket that takes connections and never answers: the client's 60 s are not waited
    sock = tmp_path / "mute.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(sock))
        s.listen(16)
        with PayloadClient(sock, timeout=60) as c:
            t0 = time.monotonic()
            with pytest.raises(TimeoutError, match=r"\(waited 1 s\)$"):
                c.wait_ready(1.0)
            assert time.monotonic() - t0 < 1.0 + MIN_ATTEMPT_S + 5


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), True, "3", None])
def test_wait_ready_checks_its_timeout(tmp_path: Path, bad: Any) -> None:
    with (
        PayloadClient(tmp_path / "s.sock") as c,
        pytest.raises(InvalidRequestError, match="timeout_s"),
    ):
        c.wait_ready(bad)


def test_wait_ready_of_a_closed_client_fails_at_once(tmp_path: Path) -> None:
    c = PayloadClient(tmp_path / "s.sock")
    c.close()
    t0 = time.monotonic()
    with pytest.raises(InvalidRequestError, match="closed"):
        c.wait_ready(30)
    assert time.monotonic() - t0 < 1


# -- the decision alone -----------------------------------------------------------------------


class Clock:
    """A clock that moves only when the steps sleep (or a test says so)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _health_call() -> Call[Health]:
    return Call("GET", "/healthz", decode=lambda b: b)


OK = Health("ok", "n", "0.1.0", "serving")
DEGRADED = Health("degraded", "n", "0.1.0", "stopped: its accept thread ended")


def refused() -> ConnectError:
    """A `ConnectError` as the client raises it when nothing listens (raised from the OSError)."""
    try:
        try:
            raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
        except OSError as os_error:
            raise ConnectError("no payloadd listening on s.sock: ...") from os_error
    except ConnectError as exc:
        return exc


def play(answers: list[Any], timeout_s: float = 5.0, attempt_s: float = 0.0) -> list[Any]:
    """Run `ready_steps`, answering its calls with ``answers`` in order (an exception is
    thrown in); each attempt takes ``attempt_s``. Returns what it did: ``("ask", limit)``
    and ``("sleep", s)`` in order, then ``("ok", health)`` or ``("raised", exc)``."""
    clock = Clock()
    steps = ready_steps(_health_call, "s.sock", timeout_s, clock)
    done: list[Any] = []
    value: Any = None
    throw: BaseException | None = None
    while True:
        try:
            effect = steps.throw(throw) if throw is not None else steps.send(value)
        except StopIteration as stop:
            done.append(("ok", stop.value))
            return done
        except Exception as exc:
            done.append(("raised", exc))
            return done
        value, throw = None, None
        if isinstance(effect, Call):
            assert effect.path == "/healthz" and effect.timeout is not None
            done.append(("ask", round(effect.timeout, 3)))
            clock.now += attempt_s
            answer = answers.pop(0)
            if isinstance(answer, BaseException):
                throw = answer
            else:
                value = answer
        else:
            done.append(("sleep", round(effect, 3)))
            clock.now += effect


def test_ready_at_the_first_answer() -> None:
    assert play([OK]) == [("ask", 5.0), ("ok", OK)]


def test_what_is_asked_again_with_growing_pauses() -> None:
    again = [refused(), TimeoutError("t"), ConnectionLostError("l"), BusyError("b"), DEGRADED]
    done = play([*again, OK], timeout_s=30)
    assert done[-1] == ("ok", OK)
    sleeps = [s for kind, s in done if kind == "sleep"]
    assert sleeps == [0.05, 0.1, 0.2, 0.4, MAX_PAUSE_S]
    asks = [s for kind, s in done if kind == "ask"]
    assert asks == [30.0, 29.95, 29.85, 29.65, 29.25, 28.75]  # each: the time left


def test_the_time_up_raises_the_last_error_with_the_wait() -> None:
    done = play([refused()] * 100, timeout_s=2.0)
    kind, exc = done[-1]
    assert kind == "raised" and type(exc) is ConnectError
    assert str(exc) == "no payloadd listening on s.sock: ... (waited 2 s)"
    # the last attempt is made when the time is up, with at least MIN_ATTEMPT_S
    assert done[-2] == ("ask", MIN_ATTEMPT_S) and done[-3][0] == "sleep"
    assert sum(s for k, s in done if k == "sleep") == pytest.approx(2.0)


def test_a_daemon_degraded_until_the_time_is_up_is_busy() -> None:
    kind, exc = play([DEGRADED] * 100, timeout_s=1.0)[-1]
    assert kind == "raised" and isinstance(exc, BusyError)
    assert str(exc) == (
        "s.sock answered status 'degraded', not 'ok' (data plane: stopped: its accept thread "
        "ended); waited 1 s"
    )


def test_slow_attempts_use_up_the_time() -> None:
    done = play([TimeoutError("slow")] * 10, timeout_s=3.0, attempt_s=3.0)
    assert done[0] == ("ask", 3.0) and done[1][0] == "raised"  # no time left after one


@pytest.mark.parametrize(
    "error",
    [
        ConnectError("cannot connect to s.sock: [Errno 13] Permission denied"),
        UnauthorizedError("calls over TCP need the admin token"),
        ProtocolError("malformed answer from /healthz"),
        InvalidRequestError("this client is closed"),
    ],
)
def test_what_waiting_would_not_change_is_raised_at_once(error: Exception) -> None:
    assert play([error]) == [("ask", 5.0), ("raised", error)]


def test_zero_asks_once() -> None:
    assert play([refused()], timeout_s=0)[0] == ("ask", MIN_ATTEMPT_S)
    assert play([refused()], timeout_s=0)[1][0] == "raised"
