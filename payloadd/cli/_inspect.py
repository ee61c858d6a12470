"""``payloadd inspect SEGMENTS.json``: print what a list of segments points to.

For each segment its metadata, then its first rows in the stored dtype, read through the
daemon with the client; with ``--lo``/``--hi``, instead of the rows of each segment, the
window ``[lo, hi)`` of each field as ``read_field`` returns it, fill positions marked.

Accepted JSON (segments are arrays ``[field, file, offset, pos, rows, dtype, shape]``, as
`PayloadSegment` encodes; longer arrays of a newer version are accepted):

- a list of segments (the canonical form), or one segment;
- an HTTP append answer, ``{"segments": [[segment, ...], ...]}`` (or its inner list);
- a generate response carrying segments, ``{"choices": [{"payload": [segment, ...]}]}``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from payload_client import (
    CoveredRead,
    InvalidRequestError,
    InvalidSegmentError,
    PayloadClient,
    PayloadError,
    PayloadSegment,
    plan_window,
    row_nbytes,
    validate_segment,
)
from payloadd.cli._common import (
    FlagError,
    InputError,
    add_connection_flags,
    emit,
    exit_status,
    open_client,
)

__all__ = ["add_inspect_flags", "load_segments", "run_inspect"]


def add_inspect_flags(parser: argparse.ArgumentParser) -> None:
    """Add the arguments of ``payloadd inspect`` to ``parser``."""
    parser.add_argument(
        "segments",
        metavar="SEGMENTS.json",
        help="file holding a JSON list of segments ('-': standard input)",
    )
    add_connection_flags(parser)
    parser.add_argument("--field", help="only the segments of this field")
    parser.add_argument("--lo", type=int, help="with --hi: read the window [lo, hi) of each field")
    parser.add_argument("--hi", type=int, help="end of the window (exclusive)")
    parser.add_argument(
        "--dtype",
        help="output dtype (one that holds the stored dtype without loss) [default: the "
        "stored dtype of each segment; with --lo/--hi, int32 or float32]",
    )
    parser.add_argument(
        "--fill",
        type=float,
        help="fill value of a window [default: the field's, from the daemon's fields table; "
        "else 0]",
    )
    parser.add_argument(
        "--max-rows",
        type=int,
        default=8,
        metavar="K",
        help="rows printed per segment or window, the first ones [default: 8]",
    )
    parser.add_argument("--json", action="store_true", help="print the data as JSON")


def _segment_arrays(doc: Any) -> Iterator[tuple[str, Any]]:
    """``(where, raw segment)`` of each segment in a decoded JSON document."""
    if isinstance(doc, dict):
        if "segments" in doc:
            yield from _segment_arrays(doc["segments"])
            return
        if "choices" in doc:
            choices = doc["choices"]
            if not isinstance(choices, list):
                raise InputError("'choices' must be a list of objects with a 'payload'")
            for i, choice in enumerate(choices):
                payload = choice.get("payload") if isinstance(choice, dict) else None
                if payload is None:
                    continue
                if not isinstance(payload, list):
                    raise InputError(f"choices[{i}].payload must be a list of segments")
                yield from ((f"choices[{i}].payload[{j}]", s) for j, s in enumerate(payload))
            return
        raise InputError(
            'expected a list of segments, {"segments": ...} or {"choices": ...}; got an '
            f"object with keys {sorted(doc)[:5]}"
        )
    if not isinstance(doc, list):
        raise InputError(f"expected a list of segments, got {type(doc).__name__}")
    if doc and isinstance(doc[0], str):  # one segment
        yield "[0]", doc
        return
    if doc and all(isinstance(x, list) and x and isinstance(x[0], list) for x in doc):
        for i, inner in enumerate(doc):  # an append answer's lists, one per item
            yield from ((f"[{i}][{j}]", s) for j, s in enumerate(inner))
        return
    yield from ((f"[{i}]", s) for i, s in enumerate(doc))


def load_segments(data: bytes) -> list[tuple[str, PayloadSegment]]:
    """Decode and check the segments of a JSON document (see the module's forms).

    Returns
    -------
    list of (str, PayloadSegment)
        Each segment with where it was in the document (``[2]``, ``choices[0].payload[1]``).

    Raises
    ------
    InputError
        Not JSON, not one of the forms, or a segment that is not a valid 7-element array
        (the message names it and what is wrong).
    """
    try:
        doc = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise InputError(f"not JSON: {exc}") from None
    out = []
    for where, raw in _segment_arrays(doc):
        if not isinstance(raw, list):
            raise InputError(
                f"segment {where} must be an array [field, file, offset, pos, rows, dtype, "
                f"shape], got {type(raw).__name__}"
            )
        try:
            seg = msgspec.convert(raw, PayloadSegment)
        except msgspec.ValidationError as exc:
            raise InputError(f"segment {where}: {exc}") from None
        try:
            validate_segment(seg)
        except InvalidSegmentError as exc:
            raise InputError(f"segment {where}: {exc}") from None
        out.append((where, seg))
    return out


def _row_text(label: str, row: np.ndarray) -> str:
    text = np.array2string(row, max_line_width=100, threshold=64, edgeitems=3, prefix=label)
    return label + text


def _meta(where: str, s: PayloadSegment) -> dict[str, Any]:
    return {
        "segment": where,
        "field": s.field,
        "file": s.file,
        "offset": s.offset,
        "dtype": s.dtype,
        "shape": s.shape,
        "pos": s.pos,
        "rows": s.rows,
        "positions": [s.pos, s.pos + s.rows],
        "row_nbytes": row_nbytes(s),
    }


def _meta_text(m: dict[str, Any]) -> str:
    lo, hi = m["positions"]
    return (
        f"segment {m['segment']}: {m['field']}  {m['file']}\n"
        f"  offset {m['offset']}, dtype {m['dtype']}, shape {m['shape']}, positions "
        f"[{lo}, {hi}) ({m['rows']} rows of {m['row_nbytes']} bytes)"
    )


def _more(n: int, what: str) -> str:
    return f"{n} more {what}{'' if n == 1 else 's'}"


def _error(exc: PayloadError) -> dict[str, str]:
    return {"error": type(exc).__name__, "message": str(exc)}


def _plan(
    what: str, segs: list[PayloadSegment], field: str, lo: int, hi: int, fill: Any, dtype: Any
) -> None:
    """Check a read's arguments without I/O (bad ones come from the flags: exit 2)."""
    try:
        plan_window(segs, field, lo, hi, fill, dtype)
    except (InvalidRequestError, InvalidSegmentError) as exc:
        raise InputError(f"{what}: {exc}") from None


def _inspect(
    c: PayloadClient, args: argparse.Namespace, segs: list[tuple[str, PayloadSegment]]
) -> tuple[dict[str, Any], list[str], bool]:
    """Read what the segments point to; the JSON document, its text, and whether every
    read succeeded."""
    dtype = None if args.dtype is None else np.dtype(args.dtype)
    window = args.lo is not None
    metas = [_meta(where, s) for where, s in segs]
    jobs = []  # every read is checked before the first one is made
    for m, (where, s) in zip(metas, segs, strict=True):
        n = 0 if window else min(s.rows, args.max_rows)
        d = dtype if dtype is not None else np.dtype(s.dtype)
        if n:
            _plan(f"segment {where}", [s], s.field, s.pos, s.pos + n, 0, d)
        jobs.append((m, s, n, d))
    lines: list[str] = []
    ok = True
    for m, s, n, d in jobs:
        lines.append(_meta_text(m))
        if window:
            continue
        if s.rows == 0:
            lines.append("  placeholder: no rows")
        if not n:
            m["read"] = {"positions": [], "rows": []}
            continue
        try:
            arr = c.read_field([s], s.field, s.pos, s.pos + n, 0, dtype=d)
        except PayloadError as exc:
            m["read"] = _error(exc)
            lines.append(f"  error: {type(exc).__name__}: {exc}")
            ok = False
            continue
        assert arr is not None
        m["read"] = {"positions": list(range(s.pos, s.pos + n)), "rows": arr.tolist()}
        lines += [_row_text(f"  pos {s.pos + i}: ", arr[i]) for i in range(n)]
        if s.rows > n:
            lines.append(f"  ... {_more(s.rows - n, 'row')} (--max-rows)")
    doc: dict[str, Any] = {"segments": metas}
    if window:
        ok = _windows(c, args, [s for _, s in segs], dtype, doc, lines) and ok
    return doc, lines, ok


def _windows(
    c: PayloadClient,
    args: argparse.Namespace,
    segs: list[PayloadSegment],
    dtype: np.dtype[Any] | None,
    doc: dict[str, Any],
    lines: list[str],
) -> bool:
    """Read the window ``[lo, hi)`` of each field with coverage; add to ``doc`` and
    ``lines``."""
    lo, hi, k = args.lo, args.hi, args.max_rows
    fields = list(dict.fromkeys(s.field for s in segs))
    fills: dict[str, Any] = {}
    if args.fill is None and fields:
        fields_table = c.fields()  # a failure ends the command (exit 1)
        fills = {name: spec.fill for name, spec in fields_table.fields.items()}
    plans = []
    for f in fields:
        fill = args.fill if args.fill is not None else fills.get(f, 0)
        if isinstance(fill, float) and fill.is_integer():
            fill = int(fill)
        _plan(f"window [{lo}, {hi}) of {f}", segs, f, lo, hi, fill, dtype)
        plans.append((f, fill))
    doc["windows"] = []
    ok = True
    for f, fill in plans:
        w: dict[str, Any] = {"field": f, "lo": lo, "hi": hi, "fill": fill}
        doc["windows"].append(w)
        lines.append("")
        try:
            got = c.read_field(segs, f, lo, hi, fill, dtype=dtype, coverage=True)
        except PayloadError as exc:
            w |= _error(exc)
            lines.append(f"window [{lo}, {hi}) of {f}: error: {type(exc).__name__}: {exc}")
            ok = False
            continue
        assert isinstance(got, CoveredRead) and got.array is not None
        arr, covered = got.array, got.covered
        n = min(hi - lo, k)
        w |= {"dtype": str(arr.dtype), "shape": list(arr.shape), "real": int(covered.sum())}
        w |= {"positions": list(range(lo, lo + n)), "covered": covered[:n].tolist()}
        w["rows"] = arr[:n].tolist()
        lines.append(
            f"window [{lo}, {hi}) of {f}: {w['real']} positions hold rows, "
            f"{hi - lo - w['real']} fill ({fill}); {arr.dtype} {list(arr.shape)}"
        )
        for i in range(n):
            label = f"  pos {lo + i}: "
            lines.append(_row_text(label, arr[i]) if covered[i] else f"{label}fill")
        if hi - lo > n:
            lines.append(f"  ... {_more(hi - lo - n, 'position')} (--max-rows)")
    return ok


def _check_flags(args: argparse.Namespace) -> None:
    if (args.lo is None) != (args.hi is None):
        raise FlagError("--lo and --hi go together")
    if args.lo is not None and not 0 <= args.lo <= args.hi:
        raise FlagError(f"the window needs 0 <= lo <= hi, got --lo {args.lo} --hi {args.hi}")
    if args.max_rows < 0:
        raise FlagError(f"--max-rows must be >= 0, got {args.max_rows}")
    if args.dtype is not None:
        try:
            np.dtype(args.dtype)
        except (TypeError, ValueError):
            raise FlagError(f"--dtype {args.dtype!r} is not a numpy dtype") from None


def _read_and_print(args: argparse.Namespace) -> int:
    name = "standard input" if args.segments == "-" else args.segments
    try:
        data = sys.stdin.buffer.read() if args.segments == "-" else Path(name).read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read {name}: {exc.strerror}") from None
    try:
        segs = load_segments(data)
    except InputError as exc:
        raise InputError(f"{name}: {exc}") from None
    if args.field is not None:
        fields = sorted({s.field for _, s in segs})
        segs = [(where, s) for where, s in segs if s.field == args.field]
        if not segs:
            raise InputError(f"{name} has no segment of field {args.field!r} (it has {fields})")
    with open_client(args, data_plane=True) as c:
        doc, lines, ok = _inspect(c, args, segs)
    if args.json:  # one line: rows of thousands of numbers stay readable with jq
        emit(msgspec.json.encode(doc).decode())
    else:
        emit("\n".join(lines) if lines else "no segments")
    if not ok:
        failed = [m["segment"] for m in doc["segments"] if "error" in m.get("read", {})]
        failed += [f"window of {w['field']}" for w in doc.get("windows", []) if "error" in w]
        print(f"payloadd inspect: reads failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    """Run ``payloadd inspect``: exit status 0, 1 when a read or the daemon failed (the
    other segments are still shown), 2 for a bad segment file or a window it cannot give.

    Raises
    ------
    FlagError
        A flag out of range or flags that do not go together, or a token file that cannot
        be read.
    """
    _check_flags(args)
    return exit_status("inspect", lambda: _read_and_print(args))
