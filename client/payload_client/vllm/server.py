"""vLLM's OpenAI-compatible server answering by handle: an ASGI middleware.

Started with ``--middleware payload_client.vllm.server.PayloadMiddleware`` (vLLM's own flag:
the middleware is the server's outermost layer, and a class that cannot be imported stops the
server from starting), it turns a request into a by-handle one when the request says so:

    X-Payloadd-Run: <run>        the run's name, [A-Za-z0-9._-]{1,128}
    X-Payloadd-Step: <step>      the training step, an integer >= 0

on ``POST /v1/completions``, ``/v1/chat/completions`` and ``/inference/v1/generate``
(``--enable-scale-out``), not streamed. vLLM answers as usual; before the answer leaves, every
choice's rows go to the node's daemon in one round trip, and the choice carries their
segments instead of the arrays::

    choices[i].payload = [[field, file, offset, pos, rows, dtype, shape], ...]
    choices[i].routed_experts = null            (and sampling_mask, on /inference/v1/generate)

- ``routed_experts`` rows are at token positions ``[k, k + n)`` of the sample, ``k`` the
  request's ``routed_experts_prompt_start`` (0 by default): a later turn writes its delta.
- ``sampling_mask`` (only ``/inference/v1/generate`` answers it) rows are at the generated
  tokens' positions, ``len(token_ids) + j``, each block of rows one width.
- A request without the two headers is vLLM's own: inline answer, nothing written.

Fails closed: a bad header, a streamed request or one whose answer lacks the rows (the server
was started without ``--enable-return-routed-experts``) is answered 400 before or instead of
its answer; if the daemon cannot take the rows, 503 (``PayloadUnavailable``), never an answer
that silently lacks them. ``PAYLOADD_VLLM_FALLBACK=inline`` opts into the inline answer
instead, marked ``X-Payloadd-Fallback: <why>``.

Settings (environment of the server): ``PAYLOADD_SOCKET`` (the daemon's socket,
``/run/payloadd/payloadd.sock`` by default), ``PAYLOADD_VLLM_FALLBACK`` (``none`` or
``inline``), ``PAYLOADD_VLLM_MAX_BODY`` (largest request body read, bytes; 64 MiB).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import msgspec
import numpy as np

from .._errors import AppendInDoubtError, PayloadError
from ..clients._async import AsyncPayloadClient
from ._outputs import MASK, ROUTED, mask_blocks

__all__ = ["FALLBACK_HEADER", "PATHS", "RUN_HEADER", "STEP_HEADER", "PayloadMiddleware"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

MAX_STEP = 2**63 - 1
RUN_HEADER = b"x-payloadd-run"
STEP_HEADER = b"x-payloadd-step"
FALLBACK_HEADER = b"x-payloadd-fallback"
PATHS = ("/v1/completions", "/v1/chat/completions", "/inference/v1/generate")
DEFAULT_SOCKET = "/run/payloadd/payloadd.sock"
_RUN = re.compile(r"[A-Za-z0-9._-]{1,128}")


class _RefusedError(Exception):
    """A by-handle request that cannot be served: answered ``status`` with ``message``."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status, self.kind = status, kind


class PayloadMiddleware:
    """ASGI middleware of vLLM's server: by-handle answers (see the module's notes).

    Parameters
    ----------
    app : ASGI app
        vLLM's app (vLLM passes it).
    socket : str, optional
        The daemon's Unix socket (default: ``PAYLOADD_SOCKET``, else
        ``/run/payloadd/payloadd.sock``).
    fallback : {"none", "inline"}, optional
        What a request gets when the daemon cannot take its rows (default:
        ``PAYLOADD_VLLM_FALLBACK``, else ``"none"``: 503).
    client : AsyncPayloadClient, optional
        The client to write with (default: one of ``socket``, made on first use).
    """

    def __init__(
        self,
        app: App,
        socket: str | None = None,
        fallback: str | None = None,
        client: AsyncPayloadClient | None = None,
    ) -> None:
        self.app = app
        self.socket = socket or os.environ.get("PAYLOADD_SOCKET") or DEFAULT_SOCKET
        self.fallback = fallback or os.environ.get("PAYLOADD_VLLM_FALLBACK", "none")
        if self.fallback not in ("none", "inline"):
            raise ValueError(
                f"PAYLOADD_VLLM_FALLBACK must be 'none' or 'inline', got {self.fallback!r}"
            )
        self.max_body = int(os.environ.get("PAYLOADD_VLLM_MAX_BODY", 64 << 20))
        self.timeout = float(os.environ.get("PAYLOADD_VLLM_TIMEOUT_S", 30.0))
        self._client = client

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if RUN_HEADER not in headers and STEP_HEADER not in headers:
            await self.app(scope, receive, send)  # vLLM's own request: inline
            return
        path = _path(scope)
        try:
            if path not in PATHS or scope["method"] != "POST":
                raise _RefusedError(400, "BadRequestError", (
                    f"{scope['method']} {path} cannot be answered by handle: send the "
                    f"X-Payloadd-* headers only with POST {', '.join(PATHS)}"
                ))  # fmt: skip
            run, step = _run_step(headers)
            body = await _read_body(receive, self.max_body)
            request = _request(body, path)
            _start_and_prompt(request, path)  # checked before vLLM runs
        except _RefusedError as exc:
            await _answer_error(send, exc)
            return
        await self._by_handle({**scope, "path_no_root": path}, (body, receive), request,
                              (run, step), send)  # fmt: skip

    async def _by_handle(
        self,
        scope: Scope,
        body: tuple[bytes, Receive],
        request: dict[str, Any],
        key: tuple[str, int],
        send: Send,
    ) -> None:
        """Run vLLM on the request, keep its answer, write its rows, answer by handle."""
        run, step = key
        start, answer = await _captured(self.app, scope, *body)
        if start.get("status") != 200:
            await _replay(send, start, answer)  # vLLM's error: as it is
            return
        try:
            doc = json.loads(answer)
            items, where = _items(doc, request, scope["path_no_root"])
        except _RefusedError as exc:
            await _answer_error(send, exc)
            return
        except (PayloadError, ValueError) as exc:  # an answer of another shape than vLLM's
            await _answer_error(send, _RefusedError(502, "PayloadUnavailable", (
                f"vLLM's answer cannot be written by handle: {type(exc).__name__}: {exc}"
            )))  # fmt: skip
            return
        try:
            segments = await self._write(items, run, step) if items else []
        except TimeoutError:  # the daemon took no answer for the request's whole deadline
            late = AppendInDoubtError(
                f"the daemon did not answer within {self.timeout:g} s (PAYLOADD_VLLM_TIMEOUT_S)"
            )
            await self._unavailable(send, start, answer, late, run, step)
            return
        except PayloadError as exc:
            await self._unavailable(send, start, answer, exc, run, step)
            return
        _replace(doc, segments, where)
        await _replay(send, start, json.dumps(doc, separators=(",", ":")).encode())

    async def _unavailable(
        self, send: Send, start: Message, answer: bytes, exc: PayloadError, run: str, step: int
    ) -> None:
        """The daemon did not take the rows: 503, or with the opt-in, the inline answer."""
        if self.fallback == "inline":
            reason = f"{type(exc).__name__}: {exc}"[:200].encode("ascii", "replace")
            await _replay(send, start, answer, extra=[(FALLBACK_HEADER, reason)])
            return
        stored = (
            "Its rows may or may not be stored (the connection failed once they were sent; "
            "rows no answer refers to go with their step's collection)"
            if isinstance(exc, AppendInDoubtError)
            else "Nothing of it is stored"
        )
        await _answer_error(send, _RefusedError(503, "PayloadUnavailable", (
            f"payloadd could not take the rows of this request (run {run!r}, step "
            f"{step}): {type(exc).__name__}: {exc}. {stored}; send it again once the "
            "daemon serves, or set PAYLOADD_VLLM_FALLBACK=inline on the server"
        )))  # fmt: skip

    async def _write(self, items: list[tuple[str, np.ndarray, int]], run: str, step: int) -> Any:
        """The rows written, within the request's deadline (waiting for the client included)."""
        if self._client is None:
            self._client = AsyncPayloadClient(self.socket)
        async with asyncio.timeout(self.timeout):
            return await self._client.append_many(items, run=run, step=step)


def _path(scope: Scope) -> str:
    """The request's path without the server's ``--root-path``."""
    path, root = str(scope["path"]), str(scope.get("root_path") or "")
    return path[len(root) :] if root and path.startswith(root) else path


def _run_step(headers: dict[bytes, bytes]) -> tuple[str, int]:
    raw_run, raw_step = headers.get(RUN_HEADER), headers.get(STEP_HEADER)
    if raw_run is None or raw_step is None:
        raise _RefusedError(400, "BadRequestError", (
            "a by-handle request needs both X-Payloadd-Run and X-Payloadd-Step (one is "
            "missing); send neither for vLLM's inline answer"
        ))  # fmt: skip
    run = raw_run.decode("latin-1")
    if not _RUN.fullmatch(run) or run in (".", ".."):
        raise _RefusedError(400, "BadRequestError",
                      f"X-Payloadd-Run {run!r} must match [A-Za-z0-9._-]{{1,128}}")  # fmt: skip
    if not raw_step.isdigit() or int(raw_step) > MAX_STEP:
        raise _RefusedError(400, "BadRequestError",
                      f"X-Payloadd-Step {raw_step.decode('latin-1')!r} must be an integer in [0, 2**63 - 1]")  # fmt: skip
    return run, int(raw_step)


async def _read_body(receive: Receive, limit: int) -> bytes:
    parts = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _RefusedError(400, "BadRequestError", "the client went away mid-request")
        parts += message.get("body", b"")
        if len(parts) > limit:
            raise _RefusedError(413, "BadRequestError",
                          f"request body above {limit} bytes (PAYLOADD_VLLM_MAX_BODY)")  # fmt: skip
        if not message.get("more_body", False):
            return bytes(parts)


def _request(body: bytes, path: str) -> dict[str, Any]:
    try:
        request = json.loads(body)
    except ValueError:
        raise _RefusedError(400, "BadRequestError", "the request body is not JSON") from None
    if not isinstance(request, dict):
        raise _RefusedError(400, "BadRequestError", "the request body must be a JSON object")
    if request.get("stream"):
        raise _RefusedError(400, "BadRequestError", (
            "a by-handle request cannot be streamed (the rows are written once the answer is "
            "whole): send stream=false, or no X-Payloadd-* headers"
        ))  # fmt: skip
    return request


def _start_and_prompt(request: dict[str, Any], path: str) -> tuple[int, int | None]:
    """The request's ``routed_experts_prompt_start`` and, on ``/inference/v1/generate``, its
    prompt length."""
    params = (request.get("sampling_params") or {}) if path == PATHS[2] else request
    start = params.get("routed_experts_prompt_start") or 0
    if type(start) is not int or start < 0:
        raise _RefusedError(
            400, "BadRequestError", "routed_experts_prompt_start must be an int >= 0"
        )
    prompt = request.get("token_ids") if path == PATHS[2] else None
    return start, len(prompt) if isinstance(prompt, list) else None


def _items(
    doc: Any, request: dict[str, Any], path: str
) -> tuple[list[tuple[str, np.ndarray, int]], list[tuple[int, int]]]:
    """The append items of every choice, and each choice's ``(index, items)`` in order."""
    start, prompt_len = _start_and_prompt(request, path)
    choices = doc.get("choices") if isinstance(doc, dict) else None
    if not isinstance(choices, list):
        raise _RefusedError(
            502, "PayloadUnavailable", f"vLLM's answer has no choices list: {str(doc)[:200]}"
        )
    items: list[tuple[str, np.ndarray, int]] = []
    where: list[tuple[int, int]] = []
    for i, choice in enumerate(choices):
        mine: list[tuple[str, np.ndarray, int]] = []
        encoded = choice.get(ROUTED)
        if encoded is None:
            raise _RefusedError(400, "BadRequestError", (
                f"choices[{i}] has no routed_experts: start vLLM with "
                "--enable-return-routed-experts (a by-handle request writes them)"
            ))  # fmt: skip
        rows = np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)
        if rows.ndim != 3:
            raise _RefusedError(502, "PayloadUnavailable",
                          f"choices[{i}].routed_experts has shape {rows.shape}")  # fmt: skip
        if len(rows):  # none: no token was fed forward past the start (a one-token answer)
            mine.append((ROUTED, rows, start))
        mask = choice.get(MASK)
        if mask is not None and prompt_len is not None:
            mine += [(MASK, b, prompt_len + at) for at, b in mask_blocks(mask, f"choices[{i}]")]
        where.append((i, len(mine)))
        items += mine
    return items, where


def _replace(doc: dict[str, Any], segments: list[list[Any]], where: list[tuple[int, int]]) -> None:
    """Every choice's segments in ``payload``, its arrays gone."""
    at = 0
    for i, n in where:
        choice = doc["choices"][i]
        choice["payload"] = [msgspec.to_builtins(s) for item in segments[at : at + n] for s in item]
        choice[ROUTED] = None
        if MASK in choice:
            choice[MASK] = None
        at += n


async def _captured(
    app: App, scope: Scope, body: bytes, receive_more: Receive
) -> tuple[Message, bytes]:
    """``app``'s answer to ``body``: its start message and its whole body. After the body,
    ``app`` waits on ``receive_more`` (the client's own: a disconnect, when it comes; vLLM
    listens for one to cancel the request)."""
    sent = False
    start: Message = {}
    parts = bytearray()

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive_more()

    async def keep(message: Message) -> None:
        nonlocal start
        if message["type"] == "http.response.start":
            start = message
        elif message["type"] == "http.response.body":
            parts.extend(message.get("body", b""))

    await app(scope, receive, keep)
    return start, bytes(parts)


async def _replay(
    send: Send, start: Message, body: bytes, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
    headers += [(b"content-length", str(len(body)).encode()), *(extra or [])]
    await send({"type": "http.response.start", "status": start.get("status", 200),
                "headers": headers})  # fmt: skip
    await send({"type": "http.response.body", "body": body})


async def _answer_error(send: Send, exc: _RefusedError) -> None:
    body = json.dumps(
        {"error": {"message": str(exc), "type": exc.kind, "param": None, "code": exc.status}}
    ).encode()
    start = {"status": exc.status, "headers": [(b"content-type", b"application/json")]}
    await _replay(send, start, body)
