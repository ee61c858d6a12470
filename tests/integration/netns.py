"""Hosts of their own network stacks on one machine (as root): each a network namespace with
one address on a bridge that lives in a namespace of its own, so nothing of the machine's own
network is touched; a host's link can be set down (its packets dropped, not refused) and up
again. Everything made is removed when the `Hosts` block ends, whatever failed in it."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

__all__ = ["Host", "Hosts"]

SUBNET = "10.77.0"
"""The hosts' addresses are ``SUBNET.1`` to ``SUBNET.N`` (/24), inside their namespaces."""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _bits(rate: str) -> int:
    """Bits a second of a ``tc`` rate (``"10gbit"``, ``"1gbit"``, ``"100mbit"``)."""
    units = {"gbit": 10**9, "mbit": 10**6, "kbit": 10**3, "bit": 1}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return int(float(rate[: -len(unit)]) * scale)
    raise ValueError(f"a rate like 10gbit or 100mbit, not {rate!r}")


@dataclass(frozen=True)
class Host:
    """One host: its namespace, its address, and its port on the bridge."""

    netns: str
    address: str
    port: str  # the bridge's end of its veth pair, in the switch namespace

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host's network stack."""
        return ["ip", "netns", "exec", self.netns, *argv]


@dataclass
class Hosts:
    """``n`` hosts on one bridge (a context manager: made on entry, removed on exit)."""

    n: int
    prefix: str = field(default_factory=lambda: f"pd{os.getpid() % 100000}")
    hosts: list[Host] = field(default_factory=list)
    _made: list[str] = field(default_factory=list)

    @property
    def switch(self) -> str:
        return f"{self.prefix}sw"

    def __enter__(self) -> Hosts:
        try:
            self._add(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i in range(self.n):
                self.hosts.append(self._host(i))
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _add(self, netns: str) -> None:
        _ip("netns", "add", netns)
        self._made.append(netns)
        _ip("-n", netns, "link", "set", "lo", "up")

    def _host(self, i: int) -> Host:
        host = Host(f"{self.prefix}h{i}", f"{SUBNET}.{i + 1}", f"p{i}")
        self._add(host.netns)
        _ip("link", "add", "eth0", "netns", host.netns, "type", "veth",
            "peer", "name", host.port, "netns", self.switch)  # fmt: skip
        _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
        _ip("-n", host.netns, "link", "set", "eth0", "up")
        _ip("-n", self.switch, "link", "set", host.port, "master", "br0")
        _ip("-n", self.switch, "link", "set", host.port, "up")
        return host

    def link(self, host: Host, up: bool) -> None:
        """Set ``host``'s port on the bridge up or down (down: its packets are dropped)."""
        _ip("-n", self.switch, "link", "set", host.port, "up" if up else "down")

    @contextlib.contextmanager
    def shaped(self, rate: str) -> Iterator[None]:
        """Every host's link at ``rate`` (``"1gbit"``) each way for the block: a token bucket
        on its end (what it sends) and on the bridge's end (what it receives)."""
        ends = [(h.netns, "eth0") for h in self.hosts] + [(self.switch, h.port) for h in self.hosts]
        burst = max(1 << 20, _bits(rate) // 8 // 1000)  # at least a millisecond of the rate
        for netns, dev in ends:
            subprocess.run(["tc", "-n", netns, "qdisc", "replace", "dev", dev, "root", "tbf",
                            "rate", rate, "burst", str(burst), "latency", "50ms"],
                           check=True, capture_output=True)  # fmt: skip
        try:
            yield
        finally:
            for netns, dev in ends:
                subprocess.run(["tc", "-n", netns, "qdisc", "del", "dev", dev, "root"],
                               check=False, capture_output=True)  # fmt: skip

    @contextlib.contextmanager
    def link_down(self, host: Host) -> Iterator[None]:
        """``host`` cut off for the block, its link up again after it."""
        self.link(host, up=False)
        try:
            yield
        finally:
            self.link(host, up=True)

    def __exit__(self, *_: object) -> None:
        for netns in reversed(self._made):  # its veth ends go with it
            subprocess.run(["ip", "netns", "del", netns], check=False, capture_output=True)
        self._made.clear()
