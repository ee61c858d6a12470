"""Row shapes fixed per run: the first append of a field in a run fixes its row shape.

A field's rows must agree within a run on every dimension but a ragged last one
(`payload_client.protocol.row_pattern`): router-replay ids of ``[48, 8]`` next to
``[8, 48]`` would read as garbage. The first append (or data-plane lease) of a
``(run, field)`` on this node fixes its shape; rows of another pattern are refused naming
both. What is kept is the first row shape itself, compared under the fields table in force:
a field the table makes ragged later compares its leading dimensions only.

Kept on disk so that a restarted daemon still knows them: one JSON line a fixed shape in
``<root>/<node>/@run-shapes.jsonl`` (``@`` is outside the run-name alphabet), appended and
fsync'd before the append that fixed it is placed; a line with ``shape`` null forgets the
run (its deletion). A torn line (a crash while writing it) is skipped on load and never
glued to the next (`payloadd.store._lines.append_line`). Each ``(run, field)`` costs one
line of about 60 bytes, once.
"""

from __future__ import annotations

import logging
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
from payloadd.store._lines import append_line

__all__ = ["SHAPES_NAME", "RunShapes"]

SHAPES_NAME = "@run-shapes.jsonl"

log = logging.getLogger("payloadd.store")


class _Line(msgspec.Struct, array_like=True):
    run: str
    field: str
    shape: list[int] | None


_decoder = msgspec.json.Decoder(_Line)
_encoder = msgspec.json.Encoder()

Key = tuple[str, str]
"""``(run, field)``."""
Entry = tuple[int | None, str, str, Sequence[int]]
"""``(item index or None, run, field, row shape)``: what `RunShapes.take` checks."""


class RunShapes:
    """The row shape fixed for each ``(run, field)`` of one node.

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
                    if got.shape is None:
                        for key in [k for k in self._fixed if k[0] == got.run]:
                            del self._fixed[key]
                    else:
                        self._fixed[(got.run, got.field)] = tuple(got.shape)
        except FileNotFoundError:
            return

    def _pattern(self, field: str, shape: Sequence[int]) -> tuple[int, ...]:
        return row_pattern(tuple(shape), is_ragged(self.fields.fields.get(field)))

    def fixed(self, run: str, field: str) -> tuple[int, ...] | None:
        """The row shape fixed for ``(run, field)`` (its first), or ``None``."""
        return self._fixed.get((run, field))

    def take(self, entries: Iterable[Entry]) -> None:
        """Check ``entries`` against the shapes fixed, and fix those they are the first of
        (written and fsync'd before this returns); all or nothing.

        Parameters
        ----------
        entries : iterable of (index, run, field, shape)
            The row shape of each item of an append (``index``: the item's, for messages;
            ``None``: a data-plane request, which names no item).

        Raises
        ------
        InvalidRequestError
            An entry whose rows disagree with its run's shape for its field, or with an
            earlier entry of the same ``(run, field)``: naming both shapes. Nothing is fixed.
        OSError
            The file cannot be written: nothing is fixed.
        """
        with self._lock:
            new: dict[Key, tuple[int, ...]] = {}
            for index, run, field, shape in entries:
                key = (run, field)
                have = self._fixed.get(key)
                first = have is None
                if have is None:
                    have = new.setdefault(key, tuple(shape))
                if self._pattern(field, shape) != self._pattern(field, have):
                    raise self._mismatch(index, run, field, shape, have, first)
            if new:
                lines = [_encoder.encode(_Line(r, f, list(s))) + b"\n" for (r, f), s in new.items()]
                append_line(self.path, b"".join(lines))
                self._fixed.update(new)

    def lease(self, run: str, field: str, shape: Sequence[int], fix: bool) -> bool:
        """Whether a lease of ``(run, field)`` for rows of ``shape`` may be granted; with
        ``fix``, the shape is fixed when it is the first (call it under the lock that
        grants the lease, after every other check: a refused lease fixes nothing).
        ``False`` (without ``fix``: a lease asked ahead of need): no shape fixed yet, or
        another; such a lease is left out.

        Raises
        ------
        InvalidRequestError
            With ``fix``: a shape other than the one fixed, naming both.
        OSError
            The file cannot be written: nothing is fixed.
        """
        have = self._fixed.get((run, field))
        if have is not None and self._pattern(field, shape) == self._pattern(field, have):
            return True
        if not fix:
            return False
        self.take([(None, run, field, shape)])
        return True

    def declare(self, shapes: Sequence[tuple[str, str, list[int]]]) -> None:
        """`take` the row shapes ``(run, field, shape)`` a data-plane client asks about
        (`ShapesRequest`), once their names and dimensions are checked.

        Raises
        ------
        InvalidRequestError
            A bad run or field name, a field the table refuses, a dimension that is not an
            integer > 0, or a shape other than the one fixed (naming both).
        OSError
            The file cannot be written.
        """
        check_shapes(self.fields, shapes)
        self.take((None, run, field, shape) for run, field, shape in shapes)

    def forget(self, run: str) -> None:
        """Forget every shape of ``run`` (it is being deleted): a line on disk first.

        Raises
        ------
        OSError
            When the file cannot be written (the shapes then stay fixed).
        """
        with self._lock:
            if not any(k[0] == run for k in self._fixed):
                return
            append_line(self.path, _encoder.encode(_Line(run, "", None)) + b"\n")
            for key in [k for k in self._fixed if k[0] == run]:
                del self._fixed[key]

    def _mismatch(
        self,
        index: int | None,
        run: str,
        field: str,
        shape: Sequence[int],
        have: tuple[int, ...],
        first: bool,
    ) -> InvalidRequestError:
        """The refusal of rows of ``shape`` where ``have`` is fixed."""
        where = "" if index is None else f"item {index}: "
        whose = "an earlier item of this append" if first else "the run's first append of it"
        return shape_mismatch(where, run, field, self._pattern(field, have), shape, whose)


def check_shapes(table: FieldsTable, shapes: Sequence[tuple[str, str, list[int]]]) -> None:
    """Check the names, fields and dimensions of row shapes ``(run, field, shape)`` a
    data-plane client sends.

    Raises
    ------
    InvalidRequestError
        A bad run or field name, a field the table refuses, or a dimension that is not an
        integer > 0.
    """
    for run, field, shape in shapes:
        check_name(run, "run")
        check_name(field, "field")
        check_field(table, field)
        if not shape or any(type(d) is not int or d <= 0 for d in shape):
            raise InvalidRequestError(
                f"row shape {shape!r} of field {field!r}: every dimension must be an integer > 0"
            )
