"""vLLM's OpenAI-compatible server with payloadd's middleware (`payload_client.vllm.server`),
against a real daemon: by-handle answers read back bit for bit as the inline ones, on the
three endpoints; a request without the headers untouched; the daemon down: 503, nothing
silently missing."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from payload_client import PayloadClient, PayloadSegment
from tests.conftest import Daemons, free_port
from tests.vllm.engine import ServerURL, api_server, decode_npy, post_json

MIDDLEWARE = "payload_client.vllm.server.PayloadMiddleware"
HEADERS = {"X-Payloadd-Run": "vllm-server", "X-Payloadd-Step": "0"}
SAMPLING = {"temperature": 1.0, "top_k": 5, "seed": 7}


@pytest.fixture(scope="module")
def daemon_socket(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    env = {k: v for k, v in os.environ.items() if k != "PAYLOADD_FIELDS"}  # the default table
    with Daemons(tmp_path_factory.mktemp("payloadd")) as d:
        yield d.start("--node", "vllm", socket=d.folder / "payloadd.sock", env=env).socket


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, daemon_socket: Path) -> Iterator[ServerURL]:
    args = ["--enable-scale-out", "--middleware", MIDDLEWARE, "--served-model-name", "tiny"]
    with api_server(tiny_model_dir, free_port(), args,
                    env={"PAYLOADD_SOCKET": str(daemon_socket)}) as url:  # fmt: skip
        yield url


def read_back(sock: Path, choice: dict[str, Any], field: str, lo: int, hi: int,
              fill: int, dtype: Any) -> np.ndarray:  # fmt: skip
    segs = [PayloadSegment(*s) for s in choice["payload"]]
    with PayloadClient(sock) as c:
        got = c.read_field(segs, field, lo, hi, fill, dtype=dtype)
    assert got is not None
    return got


def dense(masks: list[list[int]]) -> np.ndarray:
    out = np.full((len(masks), max(map(len, masks))), -1, np.int32)
    for j, ids in enumerate(masks):
        out[j, : len(ids)] = ids
    return out


def test_completions_by_handle_are_the_inline_rows(server: ServerURL, daemon_socket: Path) -> None:
    for prompt in ([5, 9, 33, 200, 17], list(range(40, 101))):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, **SAMPLING}
        inline = post_json(f"{server}/v1/completions", body)["choices"][0]
        handle = post_json(f"{server}/v1/completions", body, HEADERS)["choices"][0]
        assert handle["routed_experts"] is None and handle["text"] == inline["text"]
        want = decode_npy(inline["routed_experts"])
        assert want.dtype == np.uint8 and len(want) == len(prompt) + 6 - 1
        got = read_back(daemon_socket, handle, "routed_experts", 0, len(want), 0, np.uint8)
        np.testing.assert_array_equal(got, want)


def test_a_later_turn_writes_its_delta(server: ServerURL, daemon_socket: Path) -> None:
    prompt = list(range(300, 340))
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, **SAMPLING}
    whole = decode_npy(post_json(f"{server}/v1/completions", body)["choices"][0]["routed_experts"])
    delta = {**body, "routed_experts_prompt_start": 25}
    choice = post_json(f"{server}/v1/completions", delta, HEADERS)["choices"][0]
    (seg,) = choice["payload"]
    assert (seg[3], seg[4]) == (25, len(whole) - 25)
    got = read_back(daemon_socket, choice, "routed_experts", 25, len(whole), 0, np.uint8)
    np.testing.assert_array_equal(got, whole[25:])


def test_chat_by_handle_is_the_inline_routing(server: ServerURL, daemon_socket: Path) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "route these tokens"}],
            "max_tokens": 5, **SAMPLING}  # fmt: skip
    inline = post_json(f"{server}/v1/chat/completions", body)["choices"][0]
    handle = post_json(f"{server}/v1/chat/completions", body, HEADERS)["choices"][0]
    want = decode_npy(inline["routed_experts"])
    got = read_back(daemon_socket, handle, "routed_experts", 0, len(want), 0, np.uint8)
    np.testing.assert_array_equal(got, want)


def test_generate_by_handle_carries_masks_too(server: ServerURL, daemon_socket: Path) -> None:
    prompt = list(range(500, 530))
    body = {"model": "tiny", "token_ids": prompt,
            "sampling_params": {"max_tokens": 7, **SAMPLING}}  # fmt: skip
    inline = post_json(f"{server}/inference/v1/generate", body)["choices"][0]
    handle = post_json(f"{server}/inference/v1/generate", body, HEADERS)["choices"][0]
    assert handle["sampling_mask"] is None and handle["token_ids"] == inline["token_ids"]
    want = decode_npy(inline["routed_experts"])
    got = read_back(daemon_socket, handle, "routed_experts", 0, len(want), 0, np.uint8)
    np.testing.assert_array_equal(got, want)
    masks = dense(inline["sampling_mask"])
    lo = len(prompt)
    got = read_back(daemon_socket, handle, "sampling_mask", lo, lo + 7, -1, np.int32)
    np.testing.assert_array_equal(got[:, : masks.shape[1]], masks)
    assert (got[:, masks.shape[1] :] == -1).all()


def test_what_travels(server: ServerURL) -> None:
    """The answer's bytes for a batch, inline against by handle (figures for the docs)."""
    body = {"model": "tiny", "prompt": [list(range(i, i + 200)) for i in range(16)],
            "max_tokens": 16, **SAMPLING}  # fmt: skip
    sizes = {}
    for name, headers in (("inline", None), ("by_handle", HEADERS)):
        req = urllib.request.Request(
            f"{server}/v1/completions", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", **(headers or {})},
        )  # fmt: skip
        with urllib.request.urlopen(req, timeout=120) as r:
            sizes[name] = len(r.read())
    assert sizes["by_handle"] < sizes["inline"]
    print(f"\nwhat travels (16 completions, 215 tokens each, 2 layers x top-2): {sizes}")
    if out_dir := os.environ.get("PAYLOADD_CHECK_OUT"):
        figures = {"what": "POST /v1/completions answer bytes, 16 prompts of 200 tokens, 16 "
                   "generated, tiny Qwen3-MoE (2 layers, top-2), vLLM's server", **sizes}  # fmt: skip
        Path(out_dir, "vllm-server-travel.json").write_text(json.dumps(figures, indent=1) + "\n")


def test_with_the_daemon_down_a_by_handle_request_is_503(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    gone = tmp_path / "no-daemon.sock"
    with api_server(tiny_model_dir, free_port(), ["--middleware", MIDDLEWARE, "--served-model-name", "tiny"],
                    env={"PAYLOADD_SOCKET": str(gone)}) as url:  # fmt: skip
        body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2, **SAMPLING}
        with pytest.raises(urllib.error.HTTPError) as info:
            post_json(f"{url}/v1/completions", body, HEADERS)
        assert info.value.code == 503
        assert "PayloadUnavailable" in str(info.value) and "no payloadd listening" in str(
            info.value
        )
        inline = post_json(f"{url}/v1/completions", body)["choices"][0]  # no headers: inline
        assert inline["routed_experts"] is not None
