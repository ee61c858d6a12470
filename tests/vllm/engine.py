"""A real vLLM engine on a CPU-only machine: in-process (`offline_engine`) and as vLLM's
OpenAI-compatible HTTP server in a child process on 127.0.0.1 (`api_server`).

Needs the ``.venv-vllm`` environment (``tests/vllm/setup.sh``), whose scaffold package
(``tests/vllm/scaffold``) lets Model Runner V2, the only runner that returns routed experts,
run without ``triton-cpu``. Call `apply_env` before anything imports vLLM (the package's
``conftest.py`` does): Triton reads ``TRITON_INTERPRET`` when a kernel is defined.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "SCAFFOLD_ENV",
    "ENGINE_ARGS",
    "SERVER_ARGS",
    "ServerStartError",
    "ServerURL",
    "apply_env",
    "offline_engine",
    "server_command",
    "api_server",
    "post_json",
    "decode_npy",
    "tree_rss",
]

SCAFFOLD_ENV: Mapping[str, str] = {
    "TRITON_INTERPRET": "1",  # Model Runner V2's Triton kernels run in Triton's interpreter
    "VLLM_USE_V2_MODEL_RUNNER": "1",  # the runner that returns routed experts
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache (the default takes far more)
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in the caller's process
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
"""The environment every engine here runs under (the server's child process too)."""

ENGINE_ARGS: Mapping[str, Any] = {
    "dtype": "float32",
    "enforce_eager": True,
    "block_size": 32,  # the CPU attention takes multiples of 32
    "enable_prefix_caching": True,
    "enable_return_routed_experts": True,
    "return_sampling_mask": True,  # masks need temperature > 0 and top_k > 0
    "logprobs_mode": "processed_logprobs",
    "max_model_len": 2048,
    "seed": 0,
}
"""`offline_engine`'s keyword arguments to ``vllm.LLM`` (each may be overridden)."""

SERVER_ARGS: Sequence[str] = (
    "--dtype",
    "float32",
    "--enforce-eager",
    "--block-size",
    "32",
    "--enable-prefix-caching",
    "--enable-return-routed-experts",
    "--return-sampling-mask",
    "--logprobs-mode",
    "processed_logprobs",
    "--max-model-len",
    "2048",
    "--seed",
    "0",
)
"""`ENGINE_ARGS` as the server's command line (`api_server` adds ``extra_args`` after them)."""


class ServerStartError(RuntimeError):
    """The HTTP server exited, or was not ready in time; the message ends with its log's tail."""


class ServerURL(str):
    """The server's base URL, ``http://127.0.0.1:<port>``, with its child's ``pid`` and ``log``."""

    pid: int
    log: Path

    def __new__(cls, url: str, pid: int, log: Path) -> ServerURL:
        self = super().__new__(cls, url)
        self.pid = pid
        self.log = log
        return self


def apply_env(env: dict[str, str] | None = None) -> None:
    """Set `SCAFFOLD_ENV` in ``env``, or in ``os.environ`` when ``env`` is None (overriding
    what is there): before vLLM is first imported in this process."""
    target: Any = os.environ if env is None else env
    target.update(SCAFFOLD_ENV)


def offline_engine(model_dir: str | Path, **overrides: Any) -> Any:
    """An in-process ``vllm.LLM`` on ``model_dir`` with `ENGINE_ARGS` (then ``overrides``).

    Sets `SCAFFOLD_ENV` in ``os.environ`` first. 14 to 22 s and 1.7 GB resident on two cores.
    With masks on (the default) every request needs temperature > 0 and ``top_k > 0``, or
    ``generate`` raises ``ValueError``; pass ``return_sampling_mask=False`` for greedy. Shut it down with ``llm.llm_engine.engine_core.shutdown()`` or let the process end; two
    engines in one process work (the KV cache is 1 GiB each).

    Returns
    -------
    vllm.LLM
        Its ``generate(prompts, SamplingParams(...))`` gives ``RequestOutput``s whose
        ``outputs[i].routed_experts`` is ``uint8 (prompt + generated - 1, layers, top_k)`` and
        ``outputs[i].sampling_mask.token_ids`` one id list per generated token.
    """
    apply_env()
    from vllm import LLM  # type: ignore[import-not-found, unused-ignore]

    return LLM(model=str(model_dir), **{**ENGINE_ARGS, **overrides})


def server_command(model_dir: str | Path, port: int, extra_args: Sequence[str] = ()) -> list[str]:
    """The command line `api_server` runs (this interpreter, vLLM's OpenAI server module)."""
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *SERVER_ARGS,
        *extra_args,
    ]


def _ready(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/v1/models", timeout=2) as reply:
            return bool(reply.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _tail(log: Path, lines: int = 40) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _stop(child: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM to the child's own process group (it is its leader), SIGKILL after ``grace``."""
    if child.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGTERM)
    try:
        child.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        child.wait(timeout=30)


@contextlib.contextmanager
def api_server(
    model_dir: str | Path,
    port: int,
    extra_args: Sequence[str] = (),
    *,
    log: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    ready_timeout: float = 300.0,
) -> Iterator[ServerURL]:
    """vLLM's OpenAI-compatible server on ``127.0.0.1:port`` in a child process.

    Parameters
    ----------
    model_dir
        The model folder (`tests.vllm.tiny_model.make_tiny_model`).
    port
        A free TCP port on loopback.
    extra_args
        More command-line arguments after `SERVER_ARGS`, which they override
        (``--enable-scale-out``, ``--middleware pkg.mod.fn``, ``--no-return-sampling-mask``:
        with masks on, a request without temperature > 0 and ``top_k > 0`` gets a 500).
    log
        Where the child's stdout and stderr go (a temporary file beside the model by default).
    env
        More environment for the child, over this process's and `SCAFFOLD_ENV` (e.g.
        ``{"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}`` for an engine core process of its own).
    ready_timeout
        Seconds until ``GET /v1/models`` answers 200 (about 20 s on two cores, 30 s with an
        engine core process of its own).

    Yields
    ------
    ServerURL
        The base URL, ``http://127.0.0.1:<port>`` (a ``str``; the API under ``/v1``), with
        the child's ``pid`` (`tree_rss` of it: the server's memory) and ``log``.

    Raises
    ------
    ServerStartError
        The child exited before it was ready, or was not ready in time (it is killed).

    The child is the leader of its own process group, and only that group is signalled at exit
    (SIGTERM, then SIGKILL after 20 s).
    """
    log_path = Path(log) if log is not None else Path(model_dir).parent / f"vllm-server-{port}.log"
    child_env = {**os.environ, **SCAFFOLD_ENV, **(env or {})}
    with open(log_path, "wb") as out:
        child = subprocess.Popen(
            server_command(model_dir, port, extra_args),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=child_env,
            start_new_session=True,
        )
    base_url = ServerURL(f"http://127.0.0.1:{port}", child.pid, log_path)
    try:
        deadline = time.monotonic() + ready_timeout
        while not _ready(base_url):
            if child.poll() is not None:
                raise ServerStartError(
                    f"vLLM's server exited ({child.returncode}):\n{_tail(log_path)}"
                )
            if time.monotonic() > deadline:
                raise ServerStartError(
                    f"vLLM's server not ready in {ready_timeout:.0f} s:\n{_tail(log_path)}"
                )
            time.sleep(0.5)
        yield base_url
    finally:
        _stop(child, grace=20.0)


def post_json(
    url: str, body: Mapping[str, Any], headers: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """POST ``body`` as JSON to ``url`` (120 s at most) and return the JSON answer.

    Raises
    ------
    urllib.error.HTTPError
        Any status but 2xx; its message ends with the answer's body.
    """
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            answer: dict[str, Any] = json.loads(reply.read())
            return answer
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")
        raise urllib.error.HTTPError(e.url, e.code, f"{e.reason}: {detail}", e.headers, None) from e


def decode_npy(b64: str) -> Any:
    """A base64 ``.npy`` of vLLM's answer (``choices[i].routed_experts``) as a NumPy array."""
    import numpy as np

    return np.load(io.BytesIO(base64.b64decode(b64)), allow_pickle=False)


def tree_rss(pid: int) -> int:
    """Resident bytes of process ``pid`` and all its descendants (Linux ``/proc``)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    page = os.sysconf("SC_PAGE_SIZE")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            statm = Path(f"/proc/{entry}/statm").read_text()
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()
        children.setdefault(int(fields[1]), []).append(int(entry))
        rss[int(entry)] = int(statm.split()[1]) * page
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += rss.get(p, 0)
        todo.extend(children.get(p, []))
    return total
