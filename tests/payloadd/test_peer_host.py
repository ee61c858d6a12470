"""Where the peer port listens: other nodes' clients look for it at the host of the node's
HTTP URL, so it binds ``tcp_host`` unless told otherwise (a peer port on another address
would be refused by every other node, and their reads would go over HTTP unseen)."""

from __future__ import annotations

import os
import socket

import httpx
import numpy as np

from payload_client import PayloadClient
from tests.conftest import Daemons, free_port
from tests.payloadd.test_metrics import delta, scrape

TOKEN = "peer-host-token-" + "q" * 20
HOST = "127.0.0.2"
"""A loopback address that is not 127.0.0.1 (Linux answers all of 127.0.0.0/8)."""


def test_the_peer_port_listens_on_tcp_host_unless_told_otherwise(daemons: Daemons) -> None:
    http, port = free_port(), free_port()
    env = dict(os.environ, PAYLOADD_ADMIN_TOKEN=TOKEN)
    d = daemons.start("--node", "ph", "--tcp-host", HOST, "--tcp-port", str(http),
                      "--peer-port", str(port), env=env)  # fmt: skip
    rows = np.arange(64 * 384, dtype=np.uint8).reshape(64, 48, 8)
    with PayloadClient(d.socket) as local:
        segs = local.append("routed_experts", rows, 0, run="ph", step=0)
    with socket.create_connection((HOST, port), timeout=10):
        pass  # the peer port answers where other nodes look for it
    url = f"http://{HOST}:{http}"
    with (
        httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}) as h,
        PayloadClient(base_url=url, token=TOKEN) as c,
    ):
        assert c.health().peer_port == port  # the answer names the port: reads try it
        before = scrape(h)
        got = c.read_field(segs, "routed_experts", 0, 64, 0)
        after = scrape(h)
    assert got is not None and np.array_equal(got, rows)
    field = {"field": "routed_experts"}
    assert delta(before, after, "payloadd_read_bytes_total", transport="peer", **field) == rows.size
    assert delta(before, after, "payloadd_read_bytes_total", transport="http", **field) == 0
