"""Row shapes fixed per run: the first append of a field in a run fixes its row shape.

A field's rows must agree within a run on every dimension but a ragged last one
(`payload_client.protocol.row_pattern`): router-replay ids of ``[48, 8]`` next to
``[8, 48]`` would read as garbage. The first append (or data-plane declaration) of a
``(run, field)`` on this node fixes its pattern; any other is refused naming both.

Kept on disk so that a restarted daemon still knows them: one JSON line a fixed pattern in
``<root>/<node>/@run-shapes.jsonl`` (``@`` is outside the run-name alphabet), appended and
fsync'd before the append that fixed it is placed; a line with ``pattern`` null forgets the
run (its deletion). A torn last line (a crash while writing it) is skipped on load. Each
``(run, field)`` costs one line of about 60 bytes, once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

import msgspec

from payload_client import InvalidRequestError
from payload_client.protocol import (
    FieldsTable,
    check_field,
    check_name,
    is_ragged,
    row_pattern,
    shape_mismatch,
)

__all__ = ["SHAPES_NAME", "RunShapes"]

SHAPES_NAME = "@run-shapes.jsonl"

log = logging.getLogger("payloadd.store")


class _Line(msgspec.Struct, array_like=True):
    run: str
    field: str
    pattern: list[int] | None


_decoder = msgspec.json.Decoder(_Line)
_encoder = msgspec.json.Encoder()

Key = tuple[str, str]
"""``(run, field)``."""
Entry = tuple[int | None, str, str, Sequence[int]]
"""``(item index or None, run, field, row shape)``: what `RunShapes.take` checks."""


class RunShapes:
    """The row pattern fixed for each ``(run, field)`` of one node.

    Parameters
    ----------
    path : pathlib.Path
        The file (``<root>/<node>/@run-shapes.jsonl``); loaded now when it exists.
    fields : FieldsTable
        Which fields are ragged (`payload_client.protocol.is_ragged`).
    """

    def __init__(self, path: Path, fields: FieldsTable) -> None:
        self.path = path
        self.fields = fields
        self._lock = threading.Lock()
        self._fixed: dict[Key, tuple[int, ...]] = {}
        self._load()

    def _load(self) -> None:
        try:
            with open(self.path, "rb") as f:
                for line in f:
                    if not line.endswith(b"\n"):
                        break  # torn: the append it came with was never acknowledged
                    try:
                        got = _decoder.decode(line)
                    except msgspec.DecodeError:
                        continue
                    if got.pattern is None:
                        for key in [k for k in self._fixed if k[0] == got.run]:
                            del self._fixed[key]
                    else:
                        self._fixed[(got.run, got.field)] = tuple(got.pattern)
        except FileNotFoundError:
            return

    def pattern(self, field: str, shape: Sequence[int]) -> tuple[int, ...]:
        """The pattern rows of ``shape`` have for ``field``."""
        return row_pattern(tuple(shape), is_ragged(self.fields.fields.get(field)))

    def fixed(self, run: str, field: str) -> tuple[int, ...] | None:
        """The pattern fixed for ``(run, field)``, or ``None``."""
        return self._fixed.get((run, field))

    def take(self, entries: Iterable[Entry]) -> None:
        """Check ``entries`` against the patterns fixed, and fix those they are the first of
        (written and fsync'd before this returns); all or nothing.

        Parameters
        ----------
        entries : iterable of (index, run, field, shape)
            The row shape of each item of an append (``index``: the item's, for messages;
            ``None``: a data-plane declaration, which names no item).

        Raises
        ------
        InvalidRequestError
            An entry whose rows disagree with its run's pattern for its field, or with an
            earlier entry of the same ``(run, field)``: naming both shapes. Nothing is fixed.
        OSError
            The file cannot be written: nothing is fixed.
        """
        with self._lock:
            new: dict[Key, tuple[int, ...]] = {}
            for index, run, field, shape in entries:
                key = (run, field)
                got = self.pattern(field, shape)
                have = self._fixed.get(key)
                first = have is None
                if have is None:
                    have = new.setdefault(key, got)
                if got != have:
                    raise _mismatch(index, run, field, shape, have, first)
            if new:
                lines = [_encoder.encode(_Line(r, f, list(p))) + b"\n" for (r, f), p in new.items()]
                self._append(b"".join(lines))
                self._fixed.update(new)

    def declare(self, shapes: Sequence[tuple[str, str, list[int]]]) -> None:
        """`take` the row shapes ``(run, field, shape)`` a data-plane client declares for
        its leased appends, once their names and dimensions are checked.

        Raises
        ------
        InvalidRequestError
            A bad run or field name, a field the table refuses, a dimension that is not an
            integer > 0, or a shape other than the one fixed (naming both).
        OSError
            The file cannot be written.
        """
        for run, field, shape in shapes:
            check_name(run, "run")
            check_name(field, "field")
            check_field(self.fields, field)
            if not shape or any(type(d) is not int or d <= 0 for d in shape):
                raise InvalidRequestError(
                    f"row shape {shape!r} of field {field!r}: every dimension must be an "
                    "integer > 0"
                )
        self.take((None, run, field, shape) for run, field, shape in shapes)

    def forget(self, run: str) -> None:
        """Forget every pattern of ``run`` (it was deleted); quietly nothing on an error of
        the file (the patterns then stay fixed)."""
        with self._lock:
            if not any(k[0] == run for k in self._fixed):
                return
            try:
                self._append(_encoder.encode(_Line(run, "", None)) + b"\n")
            except OSError as exc:
                log.warning("the row shapes of deleted run %r stay fixed: %s", run, exc)
                return
            for key in [k for k in self._fixed if k[0] == run]:
                del self._fixed[key]

    def _append(self, data: bytes) -> None:
        with contextlib.suppress(FileExistsError):
            os.mkdir(self.path.parent, 0o750)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)
        try:
            view = memoryview(data)
            while view.nbytes:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)


def _mismatch(
    index: int | None,
    run: str,
    field: str,
    shape: Sequence[int],
    have: tuple[int, ...],
    first: bool,
) -> InvalidRequestError:
    """The refusal of rows of ``shape`` where pattern ``have`` is fixed."""
    where = "" if index is None else f"item {index}: "
    whose = "an earlier item of this append" if first else "the run's first append of it"
    return shape_mismatch(where, run, field, have, shape, whose)
