"""What making a client costs: every HTTP pool of a process shares one TLS context (httpx
would make one a client, 0.8 MiB and 18 ms each, the CA bundle loaded again), so a rank that
makes a client a node of a large cluster, or a writer a client a thread, pays kilobytes."""

from __future__ import annotations

import asyncio
from pathlib import Path

from payload_client import AsyncPayloadClient, PayloadClient

TOKEN = "cost-token-" + "c" * 24


def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS in /proc/self/status")


def test_three_hundred_clients_take_megabytes_not_hundreds(tmp_path: Path) -> None:
    PayloadClient(base_url="http://127.0.0.1:1").close()  # the shared context, made once
    before = _rss_kib()
    tcp = [PayloadClient(base_url=f"http://127.0.0.1:{1 + i}", token=TOKEN) for i in range(100)]
    unix = [PayloadClient(tmp_path / f"{i}.sock") for i in range(100)]

    async def made() -> list[AsyncPayloadClient]:
        return [AsyncPayloadClient(base_url=f"http://127.0.0.1:{1 + i}") for i in range(100)]

    aio = asyncio.run(made())
    grew = _rss_kib() - before
    for c in [*tcp, *unix]:
        c.close()

    async def close() -> None:
        for a in aio:
            await a.close()

    asyncio.run(close())
    assert grew < 32 << 10, f"300 clients grew RSS by {grew} KiB (a TLS context each: ~250 MiB)"
