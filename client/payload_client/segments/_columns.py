"""Segment lists as columns: `SegmentList`, validated once, no Python object a segment.

A trainer rank receives a new segment list every micro batch and reads two windows of it; an
orchestrator clips, shifts and packs thousands of segments a step. As `PayloadSegment`
objects, decoding, checking and planning such a list costs Python work per segment. A
`SegmentList` holds the same segments as numpy columns (offsets, positions and row counts as
``int64``; fields, files and row kinds as codes into small tables): it is checked once, on
construction, column by column (the rules and the error of `validate_segment`, for the first
invalid segment); its operations (`SegmentList.clip`, `SegmentList.shift`,
`SegmentList.merge_pd`, `SegmentList.concat`) are array operations; reads plan on its columns
directly (`payload_client.reads._plan`).

On the wire (`SegmentListWire`, ``encode_segments(..., "columns")``) a list is a msgpack map
whose columns are little-endian binary arrays: decoding it is a handful of copies, whatever
its length. The array-of-arrays form of `PayloadSegment` stays the default and decodes into a
`SegmentList` too (`payload_client.decode_columns`).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, SupportsIndex, TypeVar, overload

import msgspec
import numpy as np

from .._errors import InvalidRequestError, InvalidSegmentError
from ._columns_check import Kind, check_columns, int_column, kinds_table
from ._segment import (
    INT64_MAX,
    SUPPORTED_DTYPES,
    FirstSeen,
    PayloadSegment,
    check_int,
    check_shift,
    check_window,
    segment_columns,
)

__all__ = ["COLUMNS_VERSION", "SegmentList", "SegmentListWire"]

COLUMNS_VERSION = 1
"""Version of the columnar wire form (`SegmentListWire.columns`)."""

_ITEMSIZE = {name: np.dtype(name).itemsize for name in SUPPORTED_DTYPES}
_STR = frozenset((str,))
_CODE = np.dtype("<i4")
_INT = np.dtype("<i8")
T = TypeVar("T")


class SegmentListWire(msgspec.Struct):
    """A segment list on the wire as columns: a msgpack map (new keys only appended).

    Attributes
    ----------
    columns : int
        `COLUMNS_VERSION`; its key tells this form from the array of segment arrays.
    fields, files : list of str
        The tables the codes index.
    kinds : list of (str, tuple of int)
        The row kinds ``(dtype, shape)`` the codes index.
    field, file, kind : bytes
        ``int32`` little-endian ``[n]``: each segment's codes.
    offset, pos, rows : bytes
        ``int64`` little-endian ``[n]``.
    """

    columns: int
    fields: list[str]
    files: list[str]
    kinds: list[tuple[str, tuple[int, ...]]]
    field: bytes
    file: bytes
    kind: bytes
    offset: bytes
    pos: bytes
    rows: bytes


class SegmentList(Sequence[PayloadSegment]):
    """A validated, immutable segment list held as columns.

    Parameters
    ----------
    segments : iterable of PayloadSegment, optional
        The segments, in order (a `SegmentList` is taken as it is).

    Attributes
    ----------
    fields, files : tuple of str
        The distinct fields and files the codes index.
    kinds : tuple of (str, tuple of int)
        The distinct row kinds ``(dtype, shape)``.
    field, file, kind : numpy.ndarray
        ``intp [n]``, read-only: each segment's index into ``fields``, ``files``, ``kinds``.
    offset, pos, rows, row_nbytes : numpy.ndarray
        ``int64 [n]``, read-only: byte offset, first token position, row count and row size
        (bytes) of each segment.

    Raises
    ------
    InvalidSegmentError
        As `payload_client.validate_segments`: for the first invalid segment, naming its
        index and attribute.

    Notes
    -----
    It is a sequence of `PayloadSegment` (indexing makes the object; a slice is a
    `SegmentList`) and compares equal to a list of the same segments. Every read, operation
    and encoding of the package takes it where it takes a list; the operations return a
    `SegmentList` for one. What readers work out of it (per field: its segments sorted by
    file and offset) is kept with it, once.

    Examples
    --------
    >>> a = PayloadSegment("routed_experts", "n0/r/0/a.bin", 0, 0, 4, "uint8", [48, 8])
    >>> b = PayloadSegment("sampling_mask", "n0/r/0/b.bin", 0, 1, 4, "int32", [3])
    >>> sl = SegmentList([a, b])
    >>> len(sl), sl.fields, sl[1] == b
    (2, ('routed_experts', 'sampling_mask'), True)
    >>> sl.shift(8).clip(9, 12).pos.tolist()
    [9, 9]
    """

    __slots__ = ("_derived", "field", "fields", "file", "files", "kind", "kinds", "offset",
                 "pos", "row_nbytes", "rows")  # fmt: skip

    fields: tuple[str, ...]
    files: tuple[str, ...]
    kinds: tuple[Kind, ...]
    field: np.ndarray
    file: np.ndarray
    kind: np.ndarray
    offset: np.ndarray
    pos: np.ndarray
    rows: np.ndarray
    row_nbytes: np.ndarray

    def __init__(self, segments: Iterable[PayloadSegment] = ()) -> None:
        if isinstance(segments, SegmentList):
            for name in SegmentList.__slots__:
                setattr(self, name, getattr(segments, name))
            return
        if isinstance(segments, Iterable) and not isinstance(
            segments, Sequence | PayloadSegment | bytes | str
        ):
            segments = list(segments)  # (anything else: refused by segment_columns)
        cols = segment_columns(segments)  # validates (the errors of validate_segments)
        fields, files = FirstSeen(), FirstSeen()
        n = len(cols.field)
        field = np.fromiter(map(fields.__getitem__, cols.field), np.intp, n)
        file = np.fromiter(map(files.__getitem__, cols.file), np.intp, n)
        self._set(tuple(fields), field, tuple(files), file, tuple(cols.kinds), cols.kind,
                  cols.offset, cols.pos, cols.rows)  # fmt: skip

    def _set(
        self,
        fields: tuple[str, ...],
        field: np.ndarray,
        files: tuple[str, ...],
        file: np.ndarray,
        kinds: tuple[Kind, ...],
        kind: np.ndarray,
        offset: np.ndarray,
        pos: np.ndarray,
        rows: np.ndarray,
        row_nbytes: np.ndarray | None = None,
    ) -> None:
        self.fields, self.files, self.kinds = fields, files, kinds
        if row_nbytes is None:
            sizes = [_ITEMSIZE[d] * math.prod(s) for d, s in kinds]
            row_nbytes = np.array(sizes or [0], np.int64)[kind]
        for name, a in (("field", field), ("file", file), ("kind", kind), ("offset", offset),
                        ("pos", pos), ("rows", rows), ("row_nbytes", row_nbytes)):  # fmt: skip
            a.flags.writeable = False
            setattr(self, name, a)
        self._derived: dict[Any, Any] = {}

    @classmethod
    def _of(cls, *columns: Any) -> SegmentList:
        """A list of columns already valid (no check)."""
        sl = cls.__new__(cls)
        sl._set(*columns)
        return sl

    @classmethod
    def from_columns(
        cls,
        fields: Sequence[str],
        field: Any,
        files: Sequence[str],
        file: Any,
        kinds: Sequence[tuple[str, Sequence[int]]],
        kind: Any,
        offset: Any,
        pos: Any,
        rows: Any,
    ) -> SegmentList:
        """A list from its columns, checked column by column.

        Parameters
        ----------
        fields, files : sequence of str
            Tables of field names and files.
        field, file, kind : array_like of int
            ``[n]``: each segment's index into ``fields``, ``files``, ``kinds``.
        kinds : sequence of (str, sequence of int)
            Table of row kinds ``(dtype, shape)``.
        offset, pos, rows : array_like of int
            ``[n]``: byte offset, first token position, row count of each segment (held as
            ``int64``).

        Raises
        ------
        InvalidSegmentError
            Columns of different lengths or not integers; a code outside its table; else
            the error of `validate_segment` for the first invalid segment.
        """
        codes = [int_column(c, np.intp) for c in (field, file, kind)]
        ints = [int_column(c, np.int64) for c in (offset, pos, rows)]
        n = ints[0].size
        if any(c.ndim != 1 or c.size != n for c in (*codes, *ints)):
            got = [c.shape for c in (*codes, *ints)]
            raise InvalidSegmentError(f"segment columns must be 1-d, one entry a segment: {got}")
        for name, table in (("fields", fields), ("files", files), ("kinds", kinds)):
            if not isinstance(table, Sequence) or isinstance(table, str | bytes):
                raise InvalidSegmentError(
                    f"the {name} of segment columns must be a list, got {type(table).__name__}"
                )
        fields, files = tuple(fields), tuple(files)
        if not set(map(type, fields)) | set(map(type, files)) <= _STR:
            raise InvalidSegmentError("the fields and files of segment columns must be strings")
        table, sizes = kinds_table(kinds, typed=isinstance(kinds, _TypedKinds))
        rb = check_columns(fields, files, table, sizes, codes, ints)
        if None in sizes:  # an entry no segment uses: kept harmless
            table = [("uint8", (1,)) if n is None else k for k, n in zip(table, sizes, strict=True)]
        return cls._of(fields, codes[0], files, codes[1], tuple(table), codes[2], *ints, rb)

    @classmethod
    def from_wire(cls, wire: SegmentListWire) -> SegmentList:
        """A list from its columnar wire form (checked as `from_columns`).

        Raises
        ------
        InvalidSegmentError
            Another `COLUMNS_VERSION`, a column whose bytes are not whole entries, or as
            `from_columns`.
        """
        if wire.columns != COLUMNS_VERSION:
            raise InvalidSegmentError(
                f"segment columns of version {wire.columns}; this client reads version "
                f"{COLUMNS_VERSION} (upgrade payload_client)"
            )
        arrays = []
        for name, dtype in (("field", _CODE), ("file", _CODE), ("kind", _CODE),
                            ("offset", _INT), ("pos", _INT), ("rows", _INT)):  # fmt: skip
            data = getattr(wire, name)
            if len(data) % dtype.itemsize:
                raise InvalidSegmentError(
                    f"segment column {name!r} has {len(data)} bytes, not whole "
                    f"{dtype.itemsize}-byte entries"
                )
            arrays.append(np.frombuffer(data, dtype))
        f, fi, k, o, p, r = arrays
        kinds = _TypedKinds(wire.kinds)  # msgspec checked their types: (str, tuple of int)
        return cls.from_columns(wire.fields, f, wire.files, fi, kinds, k, o, p, r)

    def to_wire(self) -> SegmentListWire:
        """The columnar wire form (`SegmentListWire`)."""
        return SegmentListWire(
            COLUMNS_VERSION,
            list(self.fields),
            list(self.files),
            list(self.kinds),
            *(getattr(self, c).astype(_CODE).tobytes() for c in ("field", "file", "kind")),
            *(getattr(self, c).astype(_INT).tobytes() for c in ("offset", "pos", "rows")),
        )

    # -- a sequence of PayloadSegment ----------------------------------------------------

    def __len__(self) -> int:
        return int(self.offset.size)

    @overload
    def __getitem__(self, index: SupportsIndex) -> PayloadSegment: ...
    @overload
    def __getitem__(self, index: slice) -> SegmentList: ...
    def __getitem__(self, index: SupportsIndex | slice) -> PayloadSegment | SegmentList:
        if isinstance(index, slice):
            return self.take(np.arange(len(self))[index])
        i = operator.index(index)
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"segment {i} of a list of {n}")
        i %= n
        d, shape = self.kinds[self.kind[i]]
        return PayloadSegment(self.fields[self.field[i]], self.files[self.file[i]],
                              int(self.offset[i]), int(self.pos[i]), int(self.rows[i]), d,
                              list(shape))  # fmt: skip

    def __iter__(self) -> Iterator[PayloadSegment]:
        return iter(self.to_list())

    def to_list(self) -> list[PayloadSegment]:
        """The segments as `PayloadSegment` objects (those of one row kind share a ``shape``
        list: never change one in place)."""
        kinds = [(d, list(s)) for d, s in self.kinds]
        fields, files = self.fields, self.files
        return [
            PayloadSegment(fields[f], files[fi], o, p, r, *kinds[k])
            for f, fi, o, p, r, k in zip(
                self.field.tolist(), self.file.tolist(), self.offset.tolist(),
                self.pos.tolist(), self.rows.tolist(), self.kind.tolist(), strict=True,
            )
        ]  # fmt: skip

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SegmentList | list | tuple):
            return len(self) == len(other) and self.to_list() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (f"SegmentList({len(self)} segments, fields {list(self.fields)}, "
                f"{len(self.files)} files)")  # fmt: skip

    def derived(self, key: Any, make: Callable[[SegmentList], T]) -> T:
        """``make(self)``, made once and kept with the list (what a reader works out of it)."""
        got = self._derived.get(key)
        if got is None:
            got = self._derived[key] = make(self)
        return got

    # -- operations (docs/contract.md, "Pure segment operations") ----------------------

    def take(self, index: np.ndarray, *, offset: Any = None, pos: Any = None,
             rows: Any = None) -> SegmentList:  # fmt: skip
        """The segments ``index`` (``intp [m]``), in that order, with new offsets, positions
        or row counts where given (``int64 [m]``; not checked: the operations' own)."""
        return SegmentList._of(
            self.fields, self.field[index], self.files, self.file[index], self.kinds,
            self.kind[index],
            self.offset[index] if offset is None else offset,
            self.pos[index] if pos is None else pos,
            self.rows[index] if rows is None else rows,
            self.row_nbytes[index],
        )  # fmt: skip

    def clip(self, lo: int, hi: int) -> SegmentList:
        """`payload_client.clip_segments` on columns (same rules, same errors)."""
        lo, hi = check_window(lo, hi)
        pos, end = self.pos, self.pos + self.rows  # no overflow: validated
        start, stop = np.maximum(pos, lo), np.minimum(end, hi)
        keep = np.where(self.rows == 0, (pos >= lo) & (pos <= hi), start < stop)
        if keep.all() and (start == pos).all() and (stop == end).all():
            return self
        idx = np.flatnonzero(keep)
        a, b = start[idx], stop[idx]
        moved = self.offset[idx] + (a - pos[idx]) * self.row_nbytes[idx]
        return self.take(idx, offset=moved, pos=a, rows=b - a)

    def shift(self, delta: int) -> SegmentList:
        """`payload_client.shift_segments` on columns (same rules, same errors)."""
        delta = check_int(delta, "delta", minimum=-INT64_MAX)
        pos = self.pos
        if pos.size and delta < 0 and int(pos.min()) + delta < 0:
            i = int(np.argmax(pos < -delta))
            check_shift(int(pos[i]), int(pos[i] + self.rows[i]), delta, i)
        if pos.size and delta > 0:
            end = pos + self.rows
            if int(end.max()) > INT64_MAX - delta:
                i = int(np.argmax(end > INT64_MAX - delta))
                check_shift(int(pos[i]), int(end[i]), delta, i)
        return self.take(np.arange(len(self)), pos=pos + delta)

    def indices_of(self, field: str) -> np.ndarray:
        """``intp``: the indices of the segments of ``field``, in list order."""
        try:
            code = self.fields.index(field)
        except ValueError:
            return np.zeros(0, np.intp)
        if len(self.fields) == 1:
            return np.arange(len(self))
        return np.flatnonzero(self.field == code)

    @staticmethod
    def concat(parts: Iterable[Sequence[PayloadSegment]]) -> SegmentList:
        """The segments of ``parts`` one after another (a micro batch packed of samples).

        Raises
        ------
        InvalidSegmentError
            A part that is not a valid list (as `SegmentList`).
        """
        if not isinstance(parts, Iterable):
            raise InvalidSegmentError(
                f"parts must be lists of segments, got {type(parts).__name__}"
            )
        lists = [p if isinstance(p, SegmentList) else SegmentList(p) for p in parts]
        fields, files, kinds = FirstSeen(), FirstSeen(), FirstSeen()
        cols: list[list[np.ndarray]] = [[] for _ in range(6)]
        for sl in lists:
            for c, table, names, codes in ((0, fields, sl.fields, sl.field),
                                           (1, files, sl.files, sl.file),
                                           (2, kinds, sl.kinds, sl.kind)):  # fmt: skip
                remap = np.fromiter(map(table.__getitem__, names), np.intp, len(names))
                cols[c].append(remap[codes] if remap.size else codes)
            for c, a in ((3, sl.offset), (4, sl.pos), (5, sl.rows)):
                cols[c].append(a)
        f, fi, k, o, p, r = (
            np.concatenate(c) if c else np.zeros(0, np.intp if i < 3 else np.int64)
            for i, c in enumerate(cols)
        )
        return SegmentList._of(tuple(fields), f, tuple(files), fi, tuple(kinds), k, o, p, r)

    @staticmethod
    def merge_pd(
        prefill: Sequence[PayloadSegment],
        decode: Sequence[PayloadSegment],
        field: str = "routed_experts",
    ) -> SegmentList:
        """`payload_client.merge_pd_segments` on columns (same rules, same errors)."""
        if not isinstance(field, str) or not field:
            raise InvalidRequestError("field must be a non-empty string")
        pre, dec = _side(prefill, "prefill"), _side(decode, "decode")
        head = pre.indices_of(field)
        ours = dec.indices_of(field)
        if not head.size:
            if ours.size:
                raise InvalidRequestError(
                    f"decode carries {field!r} segments but prefill has none to stitch onto"
                )
            return dec
        cut = int((pre.pos[head] + pre.rows[head]).max())
        mine = np.zeros(len(dec), bool)
        mine[ours] = True
        end = dec.pos + dec.rows
        keep = np.flatnonzero(~(mine & (end <= cut)))
        start = np.where(mine[keep], np.maximum(dec.pos[keep], cut), dec.pos[keep])
        moved = dec.offset[keep] + (start - dec.pos[keep]) * dec.row_nbytes[keep]
        tail = dec.take(keep, offset=moved, pos=start, rows=end[keep] - start)
        return SegmentList.concat([pre.take(head), tail])


class _TypedKinds(list[Kind]):
    """Kinds whose types msgspec checked (`SegmentListWire`)."""


def _side(segments: Sequence[PayloadSegment], side: str) -> SegmentList:
    """``segments`` as a `SegmentList`, an error's message prefixed with ``side``."""
    if isinstance(segments, SegmentList):
        return segments
    try:
        return SegmentList(segments)
    except InvalidSegmentError as exc:
        err = InvalidSegmentError(f"{side} {exc}", field=exc.field)
        err.index = exc.index
        raise err from None
