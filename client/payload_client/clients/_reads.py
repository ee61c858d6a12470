"""The reads of a client, written once for both kinds and for one daemon or many.

`Reads` holds ``read_field`` and ``read_many`` (and the operation of ``read_cp``, which
only the clients of one daemon have) over one hook, `Reads._read`: the windows of one call
read, as `PayloadClient` reads them from its daemon and `ClusterClient` from many. Each is
an I/O-free operation (`payload_client.clients._shells`), a method of both kinds of client.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, TypeVar, overload

import numpy as np

from ..reads._cp import CPRank, Spans, cp_read
from ..reads._windows import CoveredRead, ReadResult, Window, WindowLike
from ..segments._segment import PayloadSegment
from ._shells import Dual, Effects, awaitable, blocking

__all__ = ["Reads"]

OutT = TypeVar("OutT")


class Reads:
    """``read_field``, ``read_many`` and the operation of ``read_cp``, over `_read`."""

    def _read(
        self, windows: Sequence[WindowLike | Spans], cover: bool | None = None
    ) -> Effects[list[ReadResult]]:
        """The results of ``windows`` read in one call (``cover``: as `read_many`'s
        ``coverage``; ``None``: each window as it asks)."""
        raise NotImplementedError

    @overload
    def _read_field(self, segments: Sequence[PayloadSegment], field: str, lo: int,
                   hi: int, fill: int | float, *, out: None = None,
                   dtype: Any = None, required: bool = False, coverage: Literal[False] = False) -> Effects[np.ndarray | None]: ...  # fmt: skip

    @overload
    def _read_field(self, segments: Sequence[PayloadSegment], field: str, lo: int,  # type: ignore[overload-overlap]
                   hi: int, fill: int | float, *, out: OutT,
                   dtype: Any = None, required: bool = False, coverage: Literal[False] = False) -> Effects[OutT | None]: ...  # fmt: skip

    @overload
    def _read_field(self, segments: Sequence[PayloadSegment], field: str, lo: int,
                   hi: int, fill: int | float, *, out: Any = None,
                   dtype: Any = None, required: bool = False, coverage: Literal[True]) -> Effects[CoveredRead]: ...  # fmt: skip

    @overload
    def _read_field(self, segments: Sequence[PayloadSegment], field: str, lo: int,
                   hi: int, fill: int | float, *, out: Any = None,
                   dtype: Any = None, required: bool = False, coverage: bool) -> Effects[ReadResult]: ...  # fmt: skip

    def _read_field(
        self,
        segments: Sequence[PayloadSegment],
        field: str,
        lo: int,
        hi: int,
        fill: int | float,
        *,
        out: Any = None,
        dtype: Any = None,
        required: bool = False,
        coverage: bool = False,
    ) -> Effects[Any]:
        """Read ``field`` over token positions ``[lo, hi)`` (docs/contract.md, "Reading a window").

        Parameters
        ----------
        segments : sequence of PayloadSegment
            Segments of any fields; only ``field``'s count, later ones win row by row.
        field : str
            Field to read.
        lo, hi : int
            Window of token positions, ``0 <= lo <= hi``, end exclusive.
        fill : int or float
            Value of entries no row covers; must fit the output dtype.
        out : numpy.ndarray or torch.Tensor, optional
            Array to read into instead of a new one, e.g. a view of a pinned buffer reused
            every step: shape ``[hi - lo, *dims]`` with ``dims`` at least the row shape
            (entries beyond it are set to ``fill``), dtype that of the read. A CPU
            ``torch.Tensor`` (pinned or not; not one that requires grad) is read into
            through its numpy view (the same memory) and returned itself.
        dtype : numpy dtype, optional
            Output dtype instead of ``int32``/``float32``: any integer or float dtype that
            holds every stored dtype of the field without loss, e.g. the stored ``uint8``
            (compact transfer to the GPU) or ``int64`` (indexing). Default: ``out.dtype``
            when ``out`` is given.
        required : bool, default False
            Raise `InvalidRequestError` when no segment of the list has ``field``, instead
            of returning ``None`` (a typo in a field name, a writer that never wrote it).
        coverage : bool, default False
            Also return which positions hold real rows rather than fill (e.g. to keep
            padding, replayed as expert 0, out of a router's load).

        Returns
        -------
        numpy.ndarray, torch.Tensor or None
            Without ``coverage``: ``out``, or a fresh C-contiguous ``[hi - lo, *row_shape]``
            array, ``int32`` (``float32`` for float fields) unless ``dtype`` says otherwise;
            ``None`` when no segment has ``field``.
        CoveredRead
            With ``coverage=True``: ``(array, covered)``, ``array`` as above and ``covered``
            a fresh ``bool`` ``[hi - lo]`` array, ``True`` where some segment of ``field``
            has a row; all ``False`` when ``array`` is ``None``. Computed from the segments
            alone, the same on both transports.

        Raises
        ------
        InvalidRequestError
            ``lo > hi``, ``lo < 0``; a ``fill``, ``dtype`` or ``out`` that does not fit;
            a torch ``out`` on another device than the CPU, or one that requires grad; a
            ``coverage`` that is not a bool; with ``required``, no segment of ``field``.
        InvalidSegmentError
            Any invalid segment in the list.
        FileMissingError, FileGoneError, SegmentFileError
            A segment intersecting the window points to a missing or collected file, one
            outside the root, or one shorter than the segment.
        TimeoutError
            The daemon did not answer within the read timeout.
        ConnectionLostError
            The connection dropped, and again on the one retry.
        TransportError
            The daemon cannot be reached or answered badly.
        """
        window = Window(segments, field, lo, hi, fill, out, dtype, coverage, required)
        return (yield from self._read([window]))[0]

    read_field = Dual(blocking(_read_field), awaitable(_read_field))  # type: ignore[arg-type]

    @overload
    def _read_many(self, windows: Sequence[WindowLike], *, coverage: Literal[False] = False) -> Effects[list[np.ndarray | None]]: ...  # fmt: skip

    @overload
    def _read_many(self, windows: Sequence[WindowLike], *, coverage: Literal[True]) -> Effects[list[CoveredRead]]: ...  # fmt: skip

    @overload
    def _read_many(self, windows: Sequence[WindowLike], *, coverage: None) -> Effects[list[ReadResult]]: ...  # fmt: skip

    def _read_many(
        self, windows: Sequence[WindowLike], *, coverage: bool | None = False
    ) -> Effects[list[Any]]:
        """Read several windows in one round trip (e.g. a rank's routing and mask windows).

        Parameters
        ----------
        windows : sequence of Window or (segments, field, lo, hi, fill[, out, dtype, coverage])
            As the arguments of `read_field`.
        coverage : bool or None, default False
            ``False``: each result is the array or ``None`` (a window that asks for
            coverage itself is refused, so that the results are what the type says);
            ``True``: each result is a `CoveredRead`; ``None``: each window as it asks
            (`Window.coverage`), a list of both kinds.

        Returns
        -------
        list of numpy.ndarray or None, list of CoveredRead, or a list of both
            One per window, as `read_field` returns it.

        Raises
        ------
        As `read_field`, errors of one window naming its index; `InvalidRequestError` for a
        window with ``coverage=True`` when ``coverage`` is ``False``.
        """
        return (yield from self._read(windows, coverage))

    read_many = Dual(blocking(_read_many), awaitable(_read_many))  # type: ignore[arg-type]

    @overload
    def _read_cp(self, segments: Sequence[PayloadSegment], field: str, length: int,
                cp_size: int, rank: int, fill: int | float, *, labels: bool = False,
                load_balanced: bool = False, out: None = None, dtype: Any = None) -> Effects[np.ndarray | None]: ...  # fmt: skip

    @overload
    def _read_cp(self, segments: Sequence[PayloadSegment], field: str, length: int,
                cp_size: int, rank: int, fill: int | float, *, labels: bool = False,
                load_balanced: bool = False, out: OutT, dtype: Any = None) -> Effects[OutT | None]: ...  # fmt: skip

    def _read_cp(
        self,
        segments: Sequence[PayloadSegment],
        field: str,
        length: int,
        cp_size: int,
        rank: int,
        fill: int | float,
        *,
        labels: bool = False,
        load_balanced: bool = False,
        out: Any = None,
        dtype: Any = None,
    ) -> Effects[Any]:
        """Read ``field`` at a context-parallel rank's positions into one array, in one round
        trip (docs/contract.md, "Context-parallel windows").

        The rank's ranges are `cp_chunks` ``(length, cp_size, rank, load_balanced)``, in that
        order; with ``labels`` each ``[a, b)`` is read at ``[a + 1, b + 1)``: the inline mask
        shifted left by one (fill last) and cut to the rank's chunks, bit for bit, once both
        have the same width. Contiguous, it is `read_field` of ``[lo, hi)`` (``labels``:
        ``[lo + 1, hi + 1)``).

        Parameters
        ----------
        segments, field, fill, dtype
            As `read_field` (``segments``: the micro batch's, packed with `shift_segments`).
        length : int
            ``L``, the micro batch's token positions, padded to a multiple of ``cp_size``
            (of ``2 * cp_size`` when ``load_balanced``).
        cp_size : int
            Ranks of the CP group, >= 1.
        rank : int
            This rank within its CP group, in ``[0, cp_size)``.
        labels : bool, default False
            Read at label positions (one later): ``True`` for sampling masks.
        load_balanced : bool, default False
            The load-balanced layout of Megatron-LM / Transformer Engine (chunks ``rank`` and
            ``2 * cp_size - 1 - rank`` of ``2 * cp_size``); else the contiguous one.
        out : numpy.ndarray or torch.Tensor, optional
            ``[length // cp_size, *dims]`` to read into, as `read_field`'s ``out`` (a CPU
            torch tensor too): each chunk goes into its consecutive rows.

        Returns
        -------
        numpy.ndarray, torch.Tensor or None
            ``out`` itself, or a fresh ``[length // cp_size, *row_shape]`` array, with
            ``row_shape`` the element-wise maximum of its chunks' row shapes (each that of a
            window: `read_field`'s rule), of `read_field`'s dtype. ``None`` when no segment
            has ``field`` (``out`` is not touched).

        Raises
        ------
        InvalidRequestError
            What `cp_chunks` refuses (``length`` not a multiple of ``cp_size``, or of ``2 *
            cp_size``; ``rank`` outside ``[0, cp_size)``, ...); an ``out`` of another number of
            rows; `read_field`'s errors (``out``: for the widest row of the rank's chunks).
        InvalidSegmentError, FileMissingError, FileGoneError, SegmentFileError, TransportError
            As `read_field`.
        """
        at = CPRank(length, cp_size, rank, load_balanced, labels)
        cp = cp_read(segments, field, fill, at, out, dtype)
        return cp.result((yield from self._read(cp.windows)))
