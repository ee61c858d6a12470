"""The daemon's counters of appends, reads, leases and data-plane requests: the one place they
live.

`Counts` keeps the totals that ``GET /v1/stats`` answers (`Store.stats`) and the same events
by field and transport, which the Prometheus collector of the server reads at scrape time
(``payloadd.server._metrics.StoreMetrics``): the store counts, nobody else does. Labels have
bounded values only: a field is labelled by its name when it is in the fields table and as
`OTHER` otherwise (field names come from clients).

A leaf of `payloadd.store`, free of ``prometheus_client``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from payload_client.protocol import INT64_MAX, AppendItem, Extent, NoteRequest

__all__ = [
    "DATA_PLANE",
    "HTTP",
    "PEER",
    "OTHER",
    "TOTALS",
    "Counts",
    "Sample",
    "Series",
    "field_of_file",
]

HTTP = "http"
DATA_PLANE = "data_plane"
PEER = "peer"
OTHER = "@other"
"""Label of every field that is not in the fields table (no field name can contain ``@``)."""
TOTALS = (
    "appends", "rows_appended", "bytes_appended", "data_plane_requests", "data_plane_fds",
    "leases", "leased_bytes", "reads", "bytes_read", "prefetches", "bytes_prefetched",
)  # fmt: skip
"""The counters of `payload_client.Stats` that `Counts` keeps (their names there)."""

_itemsize = {name: np.dtype(name).itemsize for name in ("uint8", "int8", "uint16", "int16",
             "int32", "float16", "float32")}  # fmt: skip


def _row_nbytes(item: AppendItem) -> int:
    n = _itemsize.get(item.dtype) or np.dtype(item.dtype).itemsize
    for d in item.shape:
        n *= d
    return n


def field_of_file(rel: str) -> str:
    """The field a data file holds, from its name ``<field>-<instance>-<seq>.bin``."""
    return rel.rpartition("/")[2].rsplit("-", 2)[0]


@dataclass(frozen=True)
class Sample:
    """One value of a labelled counter: its label values and its value."""

    labels: tuple[str, ...]
    value: int


class Series:
    """One counter by label values (lock held by its `Counts`)."""

    def __init__(self) -> None:
        self._values: dict[tuple[str, ...], int] = {}

    def add(self, labels: tuple[str, ...], n: int = 1) -> None:
        """Add ``n`` to the value of ``labels`` (a new one starts at 0)."""
        self._values[labels] = self._values.get(labels, 0) + n

    def samples(self) -> list[Sample]:
        """Every value, in the order their labels were first counted."""
        return [Sample(k, v) for k, v in self._values.items()]


class Counts:
    """Counters of appends (HTTP and data plane), reads, leases and data-plane requests;
    thread-safe.

    Parameters
    ----------
    fields : iterable of str
        The fields table's names: the values the ``field`` label takes besides `OTHER`.

    Attributes
    ----------
    appends : Series
        Appends acknowledged, by transport (`HTTP`, `DATA_PLANE`).
    appended_rows, appended_bytes : Series
        Their rows and row bytes, by field and transport.
    read_extents, read_bytes : Series
        Byte ranges the daemon read (answers of reads over HTTP and the peer port) and
        their bytes, by field and transport (`HTTP`, `PEER`: data-plane clients read the
        files themselves).
    leases, leased_bytes : Series
        Data-plane leases granted and their bytes, by field.
    fds : Series
        Descriptors handed to data-plane clients, by mode (``read``, ``write``) and field.
    """

    def __init__(self, fields: Iterable[str]) -> None:
        self._fields = frozenset(fields)
        self._lock = threading.Lock()
        self._totals = dict.fromkeys(TOTALS, 0)
        self.appends, self.appended_rows, self.appended_bytes = Series(), Series(), Series()
        self.leases, self.leased_bytes, self.fds = Series(), Series(), Series()
        self.read_extents, self.read_bytes = Series(), Series()
        for transport in (HTTP, DATA_PLANE):  # known series start at 0, so rates work at once
            self.appends.add((transport,), 0)
        for transport in (HTTP, DATA_PLANE):
            for label in (*sorted(self._fields), OTHER):
                self.appended_rows.add((label, transport), 0)
                self.appended_bytes.add((label, transport), 0)
        for label in (*sorted(self._fields), OTHER):
            for transport in (HTTP, PEER):
                self.read_extents.add((label, transport), 0)
                self.read_bytes.add((label, transport), 0)

    def field(self, name: str) -> str:
        """The ``field`` label of field ``name``: itself if in the fields table, else `OTHER`."""
        return name if name in self._fields else OTHER

    def _total(self, name: str, n: int) -> None:
        """Add ``n`` to the total ``name``; it stops at ``INT64_MAX``. Lock held."""
        self._totals[name] = min(self._totals[name] + n, INT64_MAX)

    def add(self, name: str, n: int = 1) -> None:
        """Add ``n`` to the total ``name`` (one of `TOTALS`); it stops at ``INT64_MAX``.

        Data-plane clients report their own appends (notes): a client that reports absurd
        counts must not push a counter past what ``GET /v1/stats`` can encode (msgpack:
        64 bits) or its readers decode.
        """
        with self._lock:
            self._total(name, n)

    def appended(self, items: Sequence[AppendItem], transport: str) -> None:
        """Count one acknowledged append of ``items`` (validated) over ``transport``: an HTTP
        append or a committed data-plane reservation."""
        sizes = [(it.rows, it.rows * _row_nbytes(it)) for it in items]
        with self._lock:
            self._total("appends", 1)
            self._total("rows_appended", sum(rows for rows, _ in sizes))
            self._total("bytes_appended", sum(nbytes for _, nbytes in sizes))
            self.appends.add((transport,))
            for it, (rows, nbytes) in zip(items, sizes, strict=True):
                key = (self.field(it.field), transport)
                self.appended_rows.add(key, rows)
                self.appended_bytes.add(key, nbytes)

    def noted(self, note: NoteRequest) -> None:
        """Count the lease appends a data-plane client reports in ``note``; rows and bytes
        it does not attribute to a field (an older client) count as `OTHER`."""
        with self._lock:
            self._total("appends", note.appends)
            self._total("rows_appended", note.rows)
            self._total("bytes_appended", note.nbytes)
            if not note.appends:
                return
            self.appends.add((DATA_PLANE,), note.appends)
            rows_left, bytes_left = note.rows, note.nbytes
            for name, rows, nbytes in note.fields:
                key = (self.field(name), DATA_PLANE)
                self.appended_rows.add(key, rows)
                self.appended_bytes.add(key, nbytes)
                rows_left, bytes_left = rows_left - rows, bytes_left - nbytes
            if rows_left > 0 or bytes_left > 0:
                self.appended_rows.add((OTHER, DATA_PLANE), max(0, rows_left))
                self.appended_bytes.add((OTHER, DATA_PLANE), max(0, bytes_left))

    def read(self, extents: Sequence[Extent], transport: str = HTTP) -> None:
        """Count one read of ``extents`` answered in full over ``transport`` (`HTTP`,
        `PEER`: the daemon read their bytes)."""
        by_file: dict[str, list[int]] = {}
        for e in extents:
            n = by_file.setdefault(e.file, [0, 0])
            n[0] += 1
            n[1] += e.nbytes
        with self._lock:
            self._total("reads", 1)
            self._total("bytes_read", sum(nbytes for _, nbytes in by_file.values()))
            for rel, (count, nbytes) in by_file.items():
                key = (self.field(field_of_file(rel)), transport)
                self.read_extents.add(key, count)
                self.read_bytes.add(key, nbytes)

    def leased(self, field: str, nbytes: int) -> None:
        """Count one lease of ``nbytes`` bytes granted for ``field``."""
        label = self.field(field)
        with self._lock:
            self._total("leases", 1)
            self._total("leased_bytes", nbytes)
            self.leases.add((label,))
            self.leased_bytes.add((label,), nbytes)

    def handed_out(self, mode: str, files: Sequence[str]) -> None:
        """Count descriptors of ``files`` handed to a data-plane client (``read``/``write``)."""
        labels = [(mode, self.field(field_of_file(rel))) for rel in files]
        with self._lock:
            self._total("data_plane_fds", len(files))
            for key in labels:
                self.fds.add(key)

    def totals(self) -> dict[str, int]:
        """The totals by their names in `payload_client.Stats` (`TOTALS`)."""
        with self._lock:
            return dict(self._totals)

    def samples(self, series: Series) -> list[Sample]:
        """The values of ``series`` (one of this object's), taken under the lock."""
        with self._lock:
            return series.samples()
