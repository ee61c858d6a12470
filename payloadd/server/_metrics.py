"""Prometheus metrics of one daemon (``GET /metrics``), in a registry of its own.

`Metrics` holds the counters and histograms that the request paths move (HTTP routes and
reads, data-plane request latencies, errors, refusals, garbage collection); `StoreMetrics`
reads the rest from the store at scrape time: the counters of appends, leases and data-plane
descriptors, which live in the store (`payloadd.store._counts.Counts`, also what
``GET /v1/stats`` answers), and the gauges (disk usage and free space, open files,
durability counters). Names start with ``payloadd_`` and use base units (bytes, seconds).
Labels have bounded values only: a field is labelled by its name when it is in the fields
table and as `OTHER` otherwise (field names come from clients); routes by their template;
errors by class name. docs/metrics.md lists every metric.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from operator import attrgetter
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from payload_client import STATUS_BY_ERROR
from payload_client.protocol import GcReport
from payloadd.store._counts import DATA_PLANE, HTTP, PEER, Series

if TYPE_CHECKING:
    from payload_client.protocol import Stats
    from payloadd.store._budget import Descriptors, InFlight
    from payloadd.store._store import Store

__all__ = ["LATENCY_BUCKETS", "REFUSALS", "STORE_METRICS", "Metrics", "StoreMetrics"]

LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
"""Upper bounds (seconds) of the latency histograms: a one-row append takes about 0.1 ms to
1 ms, a large read seconds."""
REFUSALS = tuple(
    (transport, reason)
    for transport in (HTTP, DATA_PLANE, PEER)
    for reason in ("connections", "descriptors", "inflight", "stalled")
)
"""The ``(transport, reason)`` label pairs of ``payloadd_refused_total``."""
ERRORS = frozenset({c.__name__ for c in STATUS_BY_ERROR} | {"HTTPError", "ServerError"})
"""Error classes counted by name; any other is counted as ``PayloadError``."""


class Metrics:
    """The counters and histograms of one daemon, in `registry` (never the global one).

    The counters of appends, reads, leases and descriptors live in the store
    (`payloadd.store._counts.Counts`); `StoreMetrics` reads them at scrape time.

    Parameters
    ----------
    node, version : str
        For ``payloadd_build_info``.

    Attributes
    ----------
    registry : prometheus_client.CollectorRegistry
        What ``GET /metrics`` exposes (`render`); also ``process_*`` metrics of this process.
    """

    def __init__(self, node: str, version: str) -> None:
        self.registry = r = CollectorRegistry()
        self.http_seconds = Histogram(
            "payloadd_http_request_duration_seconds",
            "HTTP requests: seconds from the request's start to its answer's last byte.",
            ["route", "status_class"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.errors = Counter(
            "payloadd_errors", "Requests answered with an error, by error class.",
            ["error", "transport"], registry=r,
        )  # fmt: skip
        self.dp_requests = Histogram(
            "payloadd_dataplane_request_duration_seconds",
            "Data-plane requests: seconds the daemon spent on each (its reply included).",
            ["kind"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.peer_requests = Histogram(
            "payloadd_peer_request_duration_seconds",
            "Peer-port requests (hello, read): seconds the daemon spent on each (a read's "
            "bytes sent included).",
            ["kind"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.gc_runs = Counter(
            "payloadd_gc_runs", "Garbage collections run (dry runs aside).", ["trigger"],
            registry=r,
        )  # fmt: skip
        self.gc_failures = Counter(
            "payloadd_gc_failures", "Garbage collections that failed.", ["trigger"], registry=r
        )
        self.gc_last = Gauge(
            "payloadd_gc_last_run_timestamp_seconds",
            "Unix time at which the last garbage collection ended.", ["trigger"], registry=r,
        )  # fmt: skip
        self.gc_files = Counter(
            "payloadd_gc_removed_files", "Data files removed by GC.", ["rule"], registry=r
        )
        self.gc_bytes = Counter(
            "payloadd_gc_removed_bytes", "Bytes (file sizes) removed by GC.", ["rule"], registry=r
        )
        self.gc_dirs = Counter(
            "payloadd_gc_removed_dirs", "Step and run directories removed by GC.", registry=r
        )
        self.refused = Counter(
            "payloadd_refused",
            "Connections and requests refused at a limit of the daemon (not of the disk): "
            "reason connections (beyond the share of descriptors), descriptors (EMFILE at "
            "accept, or a request short of per-request descriptors), inflight "
            "(max_inflight_bytes), stalled (a body or frame timed out, request_timeout_s).",
            ["transport", "reason"], registry=r,
        )  # fmt: skip
        for transport, reason in REFUSALS:
            self.refused.labels(transport, reason)
        Info("payloadd_build", "Version and node of this daemon.", registry=r).info(
            {"version": version, "node": node}
        )
        ProcessCollector(registry=r)
        self._http_children: dict[tuple[str, int], Histogram] = {}
        self._dp_children: dict[str, Histogram] = {}
        for trigger in ("sweep", "call"):
            self.gc_runs.labels(trigger)
            self.gc_failures.labels(trigger)

    # -- requests and errors -----------------------------------------------------------------

    def http_request(self, route: str, status: int, seconds: float) -> None:
        """Observe one HTTP request of route template ``route``, answered ``status``."""
        key = (route, status // 100)
        h = self._http_children.get(key)
        if h is None:
            h = self.http_seconds.labels(route, f"{status // 100}xx")
            self._http_children[key] = h
        h.observe(seconds)

    def dataplane_request(self, kind: str, seconds: float) -> None:
        """Observe one data-plane request of ``kind`` (``lease``, ``open``, ...)."""
        h = self._dp_children.get(kind)
        if h is None:
            h = self._dp_children[kind] = self.dp_requests.labels(kind)
        h.observe(seconds)

    def peer_request(self, kind: str, seconds: float) -> None:
        """Observe one peer-port request of ``kind`` (``hello``, ``read``)."""
        self.peer_requests.labels(kind).observe(seconds)

    def error(self, name: str, transport: str) -> None:
        """Count an error answer of class ``name``."""
        self.errors.labels(name if name in ERRORS else "PayloadError", transport).inc()

    def refused_one(self, transport: str, reason: str) -> None:
        """Count one connection or request refused at a limit (see `REFUSALS`)."""
        self.refused.labels(transport, reason).inc()

    # -- garbage collection ------------------------------------------------------------------

    def collected(self, report: GcReport, trigger: str) -> None:
        """Count one garbage collection (``trigger``: ``sweep`` or ``call``); a dry run
        removes nothing and is not counted."""
        if report.dry_run:
            return
        self.gc_runs.labels(trigger).inc()
        self.gc_last.labels(trigger).set(time.time())
        for rule, count in report.by_reason.items():
            self.gc_files.labels(rule).inc(count.files)
            self.gc_bytes.labels(rule).inc(count.bytes)
        self.gc_dirs.inc(report.dirs)

    def gc_failed(self, trigger: str) -> None:
        """Count a garbage collection that raised."""
        self.gc_failures.labels(trigger).inc()

    def render(self) -> bytes:
        """The registry in the Prometheus text exposition format (computes the gauges)."""
        return generate_latest(self.registry)


@dataclasses.dataclass(frozen=True)
class _Scrape:
    """What one scrape reads once: the store's stats and open descriptors, and the
    collector (its optional parts)."""

    stats: Stats
    append_fds: int
    read_fds: int
    leases: int
    of: StoreMetrics


_Value = float | list[tuple[str, float]] | None
"""A metric's value at a scrape: one number; or one a ``use`` label value; ``None``: the
metric is not served (its part is off)."""


def _shares(x: _Scrape) -> _Value:
    fds = x.of.fds
    return None if fds is None else [(u, n) for u, n in asdict(fds.shares).items() if u != "limit"]


def _called(part: str) -> Callable[[_Scrape], _Value]:
    """Read the count the collector's ``part`` returns (``None`` where it is off)."""

    def read(x: _Scrape) -> _Value:
        count: Callable[[], int] | None = getattr(x.of, part)
        return None if count is None else count()

    return read


def _of(part: str, attr: str) -> Callable[[_Scrape], _Value]:
    """Read ``attr`` of the collector's ``part`` (``None`` where it is off)."""

    def read(x: _Scrape) -> _Value:
        got = getattr(x.of, part)
        if got is None:
            return None
        value: float = getattr(got, attr)
        return value

    return read


_Family = type[GaugeMetricFamily] | type[CounterMetricFamily]
_G, _C = GaugeMetricFamily, CounterMetricFamily
STORE_METRICS: tuple[tuple[str, _Family, str, Callable[[_Scrape], _Value]], ...] = (
    ("payloadd_uptime_seconds", _G, "Seconds since this daemon started.", attrgetter("stats.uptime_s")),
    ("payloadd_root_bytes", _G, "Bytes of this node's files under the root, as counted against max_root_bytes.", attrgetter("stats.root_bytes")),
    ("payloadd_max_root_bytes", _G, "The cap max_root_bytes (0: none).", attrgetter("stats.max_root_bytes")),
    ("payloadd_free_bytes", _G, "Free bytes of the root's file system for an unprivileged writer (statvfs).", attrgetter("stats.free_bytes")),
    ("payloadd_min_free_bytes", _G, "The floor min_free_bytes (0: none).", attrgetter("stats.min_free_bytes")),
    ("payloadd_appends_refused", _C, "Appends, reservations and leases refused by a disk limit (507).", attrgetter("stats.appends_refused")),
    ("payloadd_open_files", _G, "Descriptors of data files the daemon holds.", lambda x: [("append", x.append_fds), ("read_cache", x.read_fds)]),
    ("payloadd_files_open_for_append", _G, "Files taking appends: shared (run, step, field) files (beyond the append_files "
     "share the least recent is sealed) and data-plane connections' lease files.", attrgetter("stats.files_open_for_append")),
    ("payloadd_dataplane_leases_active", _G, "Leases held by data-plane clients.", attrgetter("leases")),
    ("payloadd_dataplane_connections", _G, "Open data-plane connections.", _called("connections")),
    ("payloadd_peer_connections", _G, "Open peer-port connections.", _called("peer_connections")),
    ("payloadd_descriptor_share", _G, "The daemon's shares of RLIMIT_NOFILE (process_max_fds), by use.", _shares),
    ("payloadd_request_descriptors", _G, "Descriptors held by requests now (of the per_request share).", _of("fds", "taken")),
    ("payloadd_inflight_bytes", _G, "Bytes of request frames and control bodies being received now.", _of("inflight", "used")),
    ("payloadd_max_inflight_bytes", _G, "The cap max_inflight_bytes.", _of("inflight", "cap")),
    ("payloadd_fsync_flushes", _C, "Flushes that fsync'd something (fsync interval).", attrgetter("stats.flushes")),
    ("payloadd_fsync_files_flushed", _C, "Data files fsync'd by flushes.", attrgetter("stats.files_flushed")),
    ("payloadd_fsync_errors", _C, "fsyncs of flushes that failed.", attrgetter("stats.flush_errors")),
    ("payloadd_fsync_files_dirty", _G, "Data files the next flush will fsync.", attrgetter("stats.files_dirty")),
)  # fmt: skip
"""The gauges and counters `StoreMetrics` reads at each scrape, in their order:
(name, family type, help, how to read the value at a scrape)."""


def _family(family: _Family, name: str, doc: str, value: float | list[tuple[str, float]]) -> Metric:
    """The family of one metric: of one sample, or of one a ``use``."""
    if not isinstance(value, list):
        return family(name, doc, value=value)
    labelled = family(name, doc, labels=["use"])
    for use, n in value:
        labelled.add_metric([use], n)
    return labelled


@dataclasses.dataclass(eq=False)  # a collector is registered by identity
class StoreMetrics(Collector):
    """Gauges and counters read from the store (and data plane) at scrape time.

    Parameters
    ----------
    store : Store
        Its counters (`Store.counts`), disk budget, open descriptors, durability counters
        and uptime.
    connections : callable, optional
        Returns the data plane's open connections (absent without a data plane).
    fds : Descriptors, optional
        The daemon's descriptor shares (`payloadd.store._budget`).
    inflight : InFlight, optional
        The bytes of requests in flight.
    peer_connections : callable, optional
        Returns the peer port's open connections (absent without a peer port).
    """

    store: Store
    connections: Callable[[], int] | None = None
    fds: Descriptors | None = None
    inflight: InFlight | None = None
    peer_connections: Callable[[], int] | None = None

    def collect(self) -> Iterator[Metric]:
        """One sample of every metric (a ``statvfs`` of the root included)."""
        scrape = _Scrape(self.store.stats(), *self.store.open_descriptors(), of=self)
        yield from self._counters()
        for name, family, doc, read in STORE_METRICS:
            value = read(scrape)
            if value is not None:
                yield _family(family, name, doc, value)

    def _counters(self) -> Iterator[CounterMetricFamily]:
        """The counters that live in the store (`payloadd.store._counts.Counts`)."""
        counts = self.store.counts
        fh = ["field", "transport"]
        families: list[tuple[str, str, list[str], Series]] = [
            ("payloadd_appends", "Appends acknowledged (calls; one may carry many items).",
             ["transport"], counts.appends),
            ("payloadd_appended_rows", "Rows appended.", fh, counts.appended_rows),
            ("payloadd_appended_bytes", "Row bytes appended.", fh, counts.appended_bytes),
            ("payloadd_read_bytes", "Bytes read (answers of reads over HTTP and the peer port).", fh, counts.read_bytes),
            ("payloadd_read_extents", "Byte ranges read (reads over HTTP and the peer port).", fh, counts.read_extents),
            ("payloadd_dataplane_fds", "File descriptors handed out on the data plane.",
             ["mode", "field"], counts.fds),
            ("payloadd_dataplane_leases", "Leases granted.", ["field"], counts.leases),
            ("payloadd_dataplane_leased_bytes", "Bytes of the leases granted.", ["field"],
             counts.leased_bytes),
        ]  # fmt: skip
        for name, doc, labels, series in families:
            family = CounterMetricFamily(name, doc, labels=labels)
            for sample in counts.samples(series):
                family.add_metric(list(sample.labels), sample.value)  # no *_created: see serve
            yield family
