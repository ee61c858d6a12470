"""The by-handle middleware of vLLM's server, on an app that answers as vLLM's does (the
JSON shapes of ``/v1/completions``, ``/v1/chat/completions`` and ``/inference/v1/generate``),
with a real daemon: what the headers switch on, what a choice then carries, and every way it
fails closed. ``make check-vllm`` runs it on vLLM's own server."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest
import pytest_asyncio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from payload_client import AppendInDoubtError, PayloadClient, PayloadSegment
from payload_client.vllm.server import FALLBACK_HEADER, PayloadMiddleware
from tests.conftest import Daemon

LAYERS, TOP_K = 2, 2


def b64npy(a: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()


def routing(prompt_len: int, gen_len: int, start: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    whole = rng.integers(0, 8, (prompt_len + gen_len - 1, LAYERS, TOP_K)).astype(np.uint8)
    return whole[start:]


def masks(gen_len: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed + 1000)
    return [sorted(rng.choice(1024, 1 + j % 3, replace=False).tolist()) for j in range(gen_len)]


RAN: list[int] = []


async def completions(request: Request) -> JSONResponse:
    RAN.append(1)
    body = await request.json()
    if await request.is_disconnected():  # vLLM cancels a request whose client went away
        return JSONResponse(None)
    p, g, start = (
        len(body["prompt"]),
        body["max_tokens"],
        body.get("routed_experts_prompt_start", 0),
    )
    if body.get("no_routing"):  # a server started without --enable-return-routed-experts
        return JSONResponse({"choices": [{"index": 0, "text": "x", "routed_experts": None}]})
    choices = [
        {"index": i, "text": "x", "finish_reason": "length",
         "routed_experts": b64npy(routing(p, g, start, seed=p * 10 + i))}
        for i in range(body.get("n", 1))
    ]  # fmt: skip
    return JSONResponse({"id": "cmpl-1", "object": "text_completion", "choices": choices,
                         "usage": {"prompt_tokens": p}})  # fmt: skip


async def generate(request: Request) -> JSONResponse:
    body = await request.json()
    p, sp = len(body["token_ids"]), body["sampling_params"]
    g, start = sp["max_tokens"], sp.get("routed_experts_prompt_start", 0)
    choice = {"index": 0, "token_ids": list(range(g)), "sampling_mask": masks(g, p),
              "routed_experts": b64npy(routing(p, g, start, seed=p * 10))}  # fmt: skip
    return JSONResponse({"request_id": "r", "choices": [choice]})


async def failing(request: Request) -> JSONResponse:
    return JSONResponse({"error": {"message": "model not found", "type": "NotFound"}}, 404)


VLLM = Starlette(routes=[
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/chat/completions", failing, methods=["POST"]),
    Route("/inference/v1/generate", generate, methods=["POST"]),
])  # fmt: skip


@pytest_asyncio.fixture
async def server(daemon: Daemon) -> AsyncIterator[httpx.AsyncClient]:
    app = PayloadMiddleware(VLLM, socket=str(daemon.socket))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://v") as c:
        yield c


def segments(choice: dict[str, Any]) -> list[PayloadSegment]:
    return [PayloadSegment(*s) for s in choice["payload"]]


BY_HANDLE = {"X-Payloadd-Run": "vs", "X-Payloadd-Step": "0"}


@pytest.mark.asyncio
async def test_a_request_without_the_headers_is_answered_inline(
    server: httpx.AsyncClient, daemon: Daemon
) -> None:
    with PayloadClient(daemon.socket) as c:
        before = c.stats().appends
    r = await server.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4})
    choice = r.json()["choices"][0]
    assert "payload" not in choice and choice["routed_experts"] is not None
    with PayloadClient(daemon.socket) as c:
        assert c.stats().appends == before


@pytest.mark.asyncio
async def test_completions_by_handle_read_back_as_the_inline_rows(
    server: httpx.AsyncClient, daemon: Daemon
) -> None:
    body = {"prompt": list(range(7)), "max_tokens": 5, "n": 2}
    inline = (await server.post("/v1/completions", json=body)).json()
    r = await server.post("/v1/completions", json=body, headers=BY_HANDLE)
    assert r.status_code == 200 and int(r.headers["content-length"]) == len(r.content)
    doc = r.json()
    assert doc["usage"] == inline["usage"] and doc["id"] == inline["id"]  # the rest: vLLM's
    with PayloadClient(daemon.socket) as c:
        for mine, theirs in zip(doc["choices"], inline["choices"], strict=True):
            assert mine["routed_experts"] is None
            want = np.load(io.BytesIO(base64.b64decode(theirs["routed_experts"])))
            got = c.read_field(segments(mine), "routed_experts", 0, len(want), 0, dtype=np.uint8)
            np.testing.assert_array_equal(got, want)
    assert len(r.content) < len(json.dumps(inline))


@pytest.mark.asyncio
async def test_a_later_turn_writes_its_delta_where_its_tokens_are(
    server: httpx.AsyncClient, daemon: Daemon
) -> None:
    body = {"prompt": list(range(9)), "max_tokens": 3, "routed_experts_prompt_start": 6}
    r = await server.post("/v1/completions", json=body, headers=BY_HANDLE)
    (seg,) = segments(r.json()["choices"][0])
    assert (seg.pos, seg.rows) == (6, 9 + 3 - 1 - 6)
    with PayloadClient(daemon.socket) as c:
        got = c.read_field([seg], "routed_experts", 6, 11, 0, dtype=np.uint8)
    np.testing.assert_array_equal(got, routing(9, 3, 6, seed=90))


@pytest.mark.asyncio
async def test_generate_writes_the_masks_at_the_generated_tokens(
    server: httpx.AsyncClient, daemon: Daemon
) -> None:
    body = {"token_ids": list(range(5)), "sampling_params": {"max_tokens": 6}}
    r = await server.post("/inference/v1/generate", json=body, headers=BY_HANDLE)
    choice = r.json()["choices"][0]
    assert choice["sampling_mask"] is None and choice["routed_experts"] is None
    segs = segments(choice)
    want = np.full((6, 3), -1, np.int32)
    for j, ids in enumerate(masks(6, 5)):
        want[j, : len(ids)] = ids
    with PayloadClient(daemon.socket) as c:
        got = c.read_field(segs, "sampling_mask", 5, 11, -1)
        np.testing.assert_array_equal(got, want)
        routed = c.read_field(segs, "routed_experts", 0, 10, 0, dtype=np.uint8)
    np.testing.assert_array_equal(routed, routing(5, 6, 0, seed=50))


@pytest.mark.parametrize(
    ("headers", "body", "status", "message"),
    [
        ({"X-Payloadd-Run": "vs"}, {}, 400, "needs both"),
        ({"X-Payloadd-Run": "a b", "X-Payloadd-Step": "0"}, {}, 400, "must match"),
        ({"X-Payloadd-Run": "vs", "X-Payloadd-Step": "-1"}, {}, 400, "in [0, 2**63 - 1]"),
        ({"X-Payloadd-Run": "vs", "X-Payloadd-Step": "9" * 30}, {}, 400, "in [0, 2**63 - 1]"),
        (BY_HANDLE, {"routed_experts_prompt_start": True}, 400, "int >= 0"),
        (BY_HANDLE, {"stream": True}, 400, "cannot be streamed"),
        (BY_HANDLE, {"no_routing": True}, 400, "--enable-return-routed-experts"),
    ],
)
@pytest.mark.asyncio
async def test_what_cannot_be_written_by_handle_is_refused_in_words(
    server: httpx.AsyncClient,
    daemon: Daemon,
    headers: dict[str, str],
    body: dict[str, Any],
    status: int,
    message: str,
) -> None:
    with PayloadClient(daemon.socket) as c:
        before = c.stats().appends
    RAN.clear()
    r = await server.post(
        "/v1/completions", json={"prompt": [1], "max_tokens": 2, **body}, headers=headers
    )
    vllm_ran = bool(RAN)
    assert r.status_code == status and message in r.json()["error"]["message"]
    assert body.get("no_routing") or not vllm_ran  # refused before vLLM ran
    with PayloadClient(daemon.socket) as c:
        assert c.stats().appends == before


@pytest.mark.asyncio
async def test_vllms_own_error_passes_as_it_is(server: httpx.AsyncClient) -> None:
    r = await server.post("/v1/chat/completions", json={"messages": []}, headers=BY_HANDLE)
    assert r.status_code == 404 and r.json()["error"]["message"] == "model not found"


@pytest.mark.asyncio
async def test_no_daemon_is_a_503_or_with_the_opt_in_the_inline_answer(tmp_path: Path) -> None:
    body = {"prompt": [1, 2], "max_tokens": 2}
    for fallback, status in (("none", 503), ("inline", 200)):
        app = PayloadMiddleware(VLLM, socket=str(tmp_path / "none.sock"), fallback=fallback)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://v") as c:
            r = await c.post("/v1/completions", json=body, headers=BY_HANDLE)
        assert r.status_code == status
        if status == 503:
            assert r.json()["error"]["type"] == "PayloadUnavailable"
            assert "no payloadd listening" in r.json()["error"]["message"]
        else:
            assert r.json()["choices"][0]["routed_experts"] is not None
            assert "ConnectError" in r.headers[FALLBACK_HEADER.decode()]


def test_a_wrong_fallback_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match="'none' or 'inline'"):
        PayloadMiddleware(VLLM, fallback="maybe")


def test_segments_travel_as_their_array_form() -> None:
    s = PayloadSegment("routed_experts", "n/r/0/a.bin", 0, 0, 4, "uint8", [2, 2])
    assert PayloadSegment(*msgspec.to_builtins(s)) == s


class _InDoubt:
    """A client whose append failed after its rows were sent (a daemon killed then)."""

    async def append_many(self, *args: Any, **kw: Any) -> Any:
        raise AppendInDoubtError("connection lost after the append was sent")


@pytest.mark.asyncio
async def test_an_append_in_doubt_is_a_503_that_says_so() -> None:
    app = PayloadMiddleware(VLLM, client=_InDoubt())  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://v") as c:
        r = await c.post(
            "/v1/completions", json={"prompt": [1], "max_tokens": 2}, headers=BY_HANDLE
        )
    assert r.status_code == 503
    message = r.json()["error"]["message"]
    assert "may or may not be stored" in message and "Nothing of it is stored" not in message


@pytest.mark.asyncio
async def test_the_headers_elsewhere_are_refused_not_ignored(server: httpx.AsyncClient) -> None:
    for method, path in (("POST", "/v1/responses"), ("POST", "/invocations"),
                         ("GET", "/v1/completions")):  # fmt: skip
        r = await server.request(method, path, json={}, headers=BY_HANDLE)
        assert (
            r.status_code == 400 and "cannot be answered by handle" in r.json()["error"]["message"]
        )


@pytest.mark.asyncio
async def test_behind_a_root_path_the_endpoints_are_known(daemon: Daemon) -> None:
    app = PayloadMiddleware(VLLM, socket=str(daemon.socket))
    transport = httpx.ASGITransport(app=app, root_path="/api")
    async with httpx.AsyncClient(transport=transport, base_url="http://v") as c:
        r = await c.post("/api/v1/completions", json={"prompt": [1, 2], "max_tokens": 2},
                         headers=BY_HANDLE)  # fmt: skip
    assert r.status_code == 200 and r.json()["choices"][0]["payload"]


@pytest.mark.asyncio
async def test_a_delta_with_no_new_row_is_an_empty_payload(server: httpx.AsyncClient) -> None:
    """The start at the last token fed forward: vLLM gives no row, nothing is written."""
    body = {"prompt": [1, 2, 3], "max_tokens": 1, "routed_experts_prompt_start": 3}
    r = await server.post("/v1/completions", json=body, headers=BY_HANDLE)
    assert r.status_code == 200 and r.json()["choices"][0]["payload"] == []


class _Hung:
    """A client whose daemon never answers."""

    async def append_many(self, *args: Any, **kw: Any) -> Any:
        await asyncio.sleep(3600)


@pytest.mark.asyncio
async def test_a_daemon_that_never_answers_is_a_503_within_the_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PAYLOADD_VLLM_TIMEOUT_S", "0.5")
    app = PayloadMiddleware(VLLM, client=_Hung())  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://v") as c:
        r = await c.post(
            "/v1/completions", json={"prompt": [1], "max_tokens": 2}, headers=BY_HANDLE
        )
    assert r.status_code == 503
    assert "did not answer within 0.5 s" in r.json()["error"]["message"]
    assert "may or may not be stored" in r.json()["error"]["message"]
