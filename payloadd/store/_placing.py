"""Where an append's rows go: the one placement rule of the store, and one append's placement.

`split_rows` is the rule: how rows fill the current file of their ``(run, step, field)``
and the next ones, at the rotation size. `Placing` applies it to the files of a
`payloadd.store._files.FileTable` under its lock, for `payloadd.store._store.Store.begin_append`
(and undoes it when a new file fails half-way); `files_needed` applies it to nothing but
counts, for the descriptor budget.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

from payload_client.protocol import AppendItem
from payloadd.store._appends import item_nbytes
from payloadd.store._files import FileTable
from payloadd.store._records import AppendFile, Placement

__all__ = ["Placing", "files_needed", "split_rows"]

Key = tuple[str, int, str]
"""``(run, step, field)``: the rows of one key go to its files."""


def split_rows(size: int, rows: int, row_nb: int, cap: int) -> Iterator[tuple[bool, int]]:
    """The placement rule: the pieces ``(new, n)`` of ``rows`` rows of ``row_nb`` bytes, the
    first placed in a file of ``size`` bytes, at the rotation size ``cap``: ``n`` rows each,
    in a new (empty) file when ``new``, else where the piece before went.

    Rows that fit go where they are; so do no rows, and one row into an empty file whatever
    its size. Rows that do not fit start a new file when the file holds bytes already; an
    empty file is filled with as many as fit (at least one), and the rest go on after it.
    """
    new = False
    while True:
        if size + rows * row_nb <= cap or rows == 0 or (size == 0 and rows == 1):
            yield new, rows
            return
        if size > 0:
            new, size = True, 0
            continue
        take = max(1, cap // row_nb)
        yield new, take
        new, size, rows = False, take * row_nb, rows - take


def files_needed(items: Sequence[AppendItem], cap: int) -> int:
    """At most how many data files an append of ``items`` holds open at once (for the
    descriptor budget, `payloadd.store._budget`): the files `split_rows` fills for each
    (run, step, field), from an empty one, plus one (a current file partly full).

    Raises
    ------
    InvalidRequestError
        An item is invalid (`item_nbytes`).
    """
    state: dict[Key, list[int]] = {}  # key -> [files, bytes in the last]
    for i, it in enumerate(items):
        row_nb = item_nbytes(it, i)[0]
        f = state.setdefault((it.run, it.step, it.field), [1, 0])
        for new, rows in split_rows(f[1], it.rows, row_nb, cap):
            if new:
                f[0], f[1] = f[0] + 1, 0
            f[1] += rows * row_nb
    return sum(files + 1 for files, _ in state.values())


class Placing:
    """One append's placement in the files of ``table``; every method with its lock held.

    Parameters
    ----------
    table : FileTable
        The files open for appends.
    private : bool
        Place the rows in new files of this append's own (sealed: nobody else's current
        file, each closes when the append ends) instead of the shared current files.

    Attributes
    ----------
    held : dict
        The files the append writes to (kept open until it ends), each counted as used once.
    placements : list of Placement
        Where each piece of each item's rows goes, in order.
    created : list of AppendFile
        The files the placement created.
    """

    def __init__(self, table: FileTable, private: bool) -> None:
        self.table, self.private = table, private
        self.held: dict[int, AppendFile] = {}
        self.placements: list[Placement] = []
        self.created: list[AppendFile] = []
        self._own: dict[Key, AppendFile] = {}

    def new(self, key: Key) -> AppendFile:
        """A new file of ``key`` for the rows that go on."""
        t = self.table
        if self.private:
            f = t.new_file(*key)
            f.sealed = True  # nobody else's current file: it closes when this append ends
            self._own[key] = f
        else:
            f = t.new_shared(key)
        self.created.append(f)
        return f

    def current(self, key: Key) -> AppendFile:
        """The file the rows of ``key`` are placed in first."""
        if self.private:
            return self._own.get(key) or self.new(key)
        t = self.table
        f = t.shared.get(key)
        if f is None or t.removed(f):
            return self.new(key)
        if t.one_writer and f.users and id(f) not in self.held:  # written now
            return t.take_idle(key, f) or self.new(key)
        t.shared.move_to_end(key)
        return f

    def place(self, index: int, item: AppendItem, row_nb: int) -> None:
        """Reserve room for one item's rows (`split_rows`), adding its placements."""
        key = (item.run, item.step, item.field)
        f = self.current(key)
        pos = item.pos
        for new, rows in split_rows(f.size, item.rows, row_nb, self.table.max_file_bytes):
            if new:
                f = self.new(key)
            if id(f) not in self.held:
                self.held[id(f)] = f
                f.users += 1
            self.placements.append(Placement(index, f, f.size, pos, rows, rows * row_nb))
            f.size += rows * row_nb
            pos += rows

    def place_all(self, items: Sequence[AppendItem], row_nbytes: Sequence[int]) -> None:
        """`place` every item (``row_nbytes``: the size of a row of each); when one fails
        (e.g. no room for a new file), `undo` what was placed, then raise."""
        try:
            for i, it in enumerate(items):
                self.place(i, it, row_nbytes[i])
        except BaseException:
            self.undo(items)
            raise

    def undo(self, items: Sequence[AppendItem]) -> None:
        """Give back a placement of ``items`` that failed half-way, leaving no debris: the
        files it created (only its own rows were placed in them) are removed, and so are
        directories it leaves empty."""
        t = self.table
        for e in reversed(self.placements):
            if e.file.size == e.offset + e.nbytes:
                e.file.size = e.offset
        mine = {id(f) for f in self.created}
        for f in self.held.values():
            f.users -= 1
        for f in self.created:
            if t.shared.get(f.key) is f:
                del t.shared[f.key]
            if f.open:
                t.discard(f)
        for f in self.held.values():
            if id(f) not in mine and f.sealed and f.users == 0 and f.open:
                t.close_file(f)
        for run, step in {(it.run, it.step) for it in items}:  # made before a file failed
            for d in (t.root / t.node / run / str(step), t.root / t.node / run):
                try:
                    os.rmdir(d)
                except OSError:
                    break
