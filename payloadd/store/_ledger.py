"""The GC ledger: which files garbage collection removed, and why, kept on disk.

A read of a file that does not exist answers 404 (`FileMissingError`) unless the ledger of
the file's node lists it as collected: then 410 (`FileGoneError`) naming its run and step.
One JSON line per collection, appended and fsync'd *before* any of its files is removed, so
the answer survives restarts and a crash in the middle of a GC:

    {"run": "r1", "reason": "watermark", "at": 1764412800.0,
     "files": ["node0/r1/3/routed_experts-1a2b3c4d-000007.bin", ...], "bytes": 1536}

A watermark collection that raises its run's watermark writes a line of it first, before it
plans anything (appends at or below it are refused from then on, `payloadd.store._watermarks`):

    {"run": "r1", "reason": "watermark", "at": 1764412800.0, "files": [], "bytes": 0,
     "through": 3}

A file is listed only when the collection removes it (a file that never existed stays 404,
even in a collected step). The file is ``<root>/<node>/@gc-ledger.jsonl``: ``@`` is outside
the run-name alphabet, so no run directory can ever have its name. A torn last line (a crash
while writing it) is skipped when the ledger is loaded. Each collected file costs one path
(about 60 bytes) on disk.

In memory the daemon keeps no path: it indexes where each line lies, by the (run, step)
its files are in, and reads the lines of a step back from the file when a read of a missing
file of that step asks (then a line is decoded; a read of an existing file never looks). It
reads the file incrementally: only what was appended since it last looked (another node's
daemon appends to its own ledger on a shared root). So the daemon's memory grows by about
100 bytes a collected step and 16 a collection, not by the paths of every file it ever
removed, and a collection costs the same after a million as after the first.

Beside it, ``@gc-reserve`` holds `RESERVE_BYTES` of spare space: when the file system is
full (another program filled it), a collection removes it to write its line, so GC still
frees space when it is needed most. Collections make it again once there is room.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from array import array
from pathlib import Path

import msgspec

from payloadd.store._lines import append_line, make_node_dir

__all__ = ["LEDGER_NAME", "RESERVE_BYTES", "RESERVE_NAME", "Collected", "Ledger"]

LEDGER_NAME = "@gc-ledger.jsonl"
RESERVE_NAME = "@gc-reserve"
RESERVE_BYTES = 64 << 10
"""Size of the spare file kept beside the ledger: on a full file system it is removed, so
that the ledger line of the collection that makes room can still be written."""

log = logging.getLogger("payloadd.gc")


class Collected(msgspec.Struct, forbid_unknown_fields=False, omit_defaults=True):
    """One collection: the files of ``run`` it removed.

    Attributes
    ----------
    run : str
        The run.
    reason : str
        ``watermark``, ``run`` or ``ttl``.
    at : float
        When, in seconds since the epoch.
    files : list of str
        The removed files, relative to the root.
    bytes : int or None
        Sum of their sizes when the collection was planned, in bytes; ``None`` in lines
        written before this was recorded.
    through : int or None
        The watermark of a ``watermark`` collection: steps ``<= through`` of ``run`` are
        gone, and appends into them are refused. ``None`` in other lines (and in lines
        written before this was recorded: their files' steps stand for it).
    tracked : bool
        Its removals are followed by a ``done`` line when they all happened: a line with
        files and no ``done`` line after it was cut (a crash), and the daemon's next start
        finishes it (`Ledger.unfinished`). ``False`` in lines written before this.
    done : int or None
        On a ``done`` line: the byte offset of the line whose removals all happened.
    """

    run: str
    reason: str
    at: float
    files: list[str]
    bytes: int | None = None
    through: int | None = None
    tracked: bool = False
    done: int | None = None


_decoder = msgspec.json.Decoder(Collected)
_encoder = msgspec.json.Encoder()


class Ledger:
    """The collections of one node, loaded from and appended to its ledger file.

    Parameters
    ----------
    path : pathlib.Path
        The ledger file; missing means nothing was collected.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.reserve = path.with_name(RESERVE_NAME)
        self._lock = threading.Lock()
        self._reset(None)

    def _reset(self, ident: tuple[int, int] | None) -> None:
        """Forget the index (the file is new, was replaced, or is gone)."""
        self._ident = ident  # (st_dev, st_ino) of the file indexed
        self._loaded = 0  # bytes of it indexed: whole lines only
        self._steps: dict[tuple[str, str], list[int]] = {}  # (run, step) -> its lines
        self._starts = array("q")  # byte offset of each line (collection), in file order
        self._ends = array("q")
        self._marks: dict[str, int] = {}  # run -> its collected watermark
        self._removals = array("q")  # the lines that removed files (not a watermark alone)
        self._unfinished: dict[int, int] = {}  # offset -> line number, of lines not done

    def _load(self) -> None:
        """Index what was appended since the last look (another node's daemon may append
        to its own ledger); start over when the file was replaced or cut.

        The file is opened, not only looked at: on NFS an open revalidates the file's
        attributes and cached pages with the server (close-to-open consistency), where a
        ``stat`` may answer from the client's attribute cache. A node prefix that does not
        exist, or is not a directory, has no ledger. A last line without its newline (torn,
        or being written) is read again next time: the next line written ends it.
        """
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            self._reset(None)
            return
        with open(fd, "rb") as f:
            st = os.fstat(fd)
            ident = (st.st_dev, st.st_ino)
            if ident != self._ident or st.st_size < self._loaded:
                self._reset(ident)
            if st.st_size == self._loaded:
                return
            f.seek(self._loaded)
            at = self._loaded
            for line in f:
                if not line.endswith(b"\n"):
                    break
                self._index(line, at)
                at += len(line)
            self._loaded = at

    def _index(self, line: bytes, at: int) -> None:
        try:
            c = _decoder.decode(line)
        except msgspec.DecodeError:
            return  # a torn line
        n = len(self._starts)
        if c.files:
            self._removals.append(n)
            if c.tracked:
                self._unfinished[at] = n
        if c.done is not None:
            self._unfinished.pop(c.done, None)
        self._starts.append(at)
        self._ends.append(at + len(line))
        for key in {tuple(f.split("/")[1:3]) for f in c.files}:
            if len(key) == 2:
                self._steps.setdefault((key[0], key[1]), []).append(n)
        if c.reason == "watermark":
            steps = [
                int(k[1])
                for k in (f.split("/")[1:3] for f in c.files)
                if len(k) == 2 and k[1].isdigit()
            ]
            mark = max(steps + ([c.through] if c.through is not None else []), default=None)
            if mark is not None and mark > self._marks.get(c.run, -1):
                self._marks[c.run] = mark

    def _read(self, lines: list[int]) -> list[Collected]:
        """Decode lines ``lines`` (their numbers) from the file; lock held."""
        out: list[Collected] = []
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return out
        try:
            for n in lines:
                raw = os.pread(fd, self._ends[n] - self._starts[n], self._starts[n])
                with contextlib.suppress(msgspec.DecodeError):
                    out.append(_decoder.decode(raw))
        finally:
            os.close(fd)
        return out

    def record(
        self,
        run: str,
        reason: str,
        files: list[str],
        nbytes: int | None = None,
        through: int | None = None,
    ) -> Collected:
        """Append one collection of ``files`` (relative paths, ``nbytes`` bytes in all) and
        fsync it; return it. ``through``: the watermark of a ``watermark`` collection.

        On a full file system the spare file (`keep_reserve`) is removed to make room.

        Raises
        ------
        OSError
            When the ledger cannot be written (the caller then removes nothing).
        """
        c = Collected(run, reason, time.time(), files, nbytes, through)
        self._write(c)
        return c

    def begin(self, run: str, reason: str, files: list[str], nbytes: int) -> int:
        """`record` a collection of ``files`` whose removals `finish` will say happened;
        return the offset of its line (for `finish`).

        Raises
        ------
        OSError
            When the ledger cannot be written (the caller then removes nothing).
        """
        return self._write(Collected(run, reason, time.time(), files, nbytes, tracked=True))

    def finish(self, offset: int) -> None:
        """Say that every removal of the collection at ``offset`` (`begin`) happened.

        Raises
        ------
        OSError
            When the ledger cannot be written (the next start then removes what is left,
            nothing, and says it).
        """
        self._write(Collected("", "done", time.time(), [], None, done=offset))

    def unfinished(self) -> list[tuple[int, Collected]]:
        """The collections begun and not finished (cut by a crash), oldest first, with the
        offsets of their lines."""
        with self._lock:
            self._load()
            items = sorted(self._unfinished.items())
            return list(
                zip((at for at, _ in items), self._read([n for _, n in items]), strict=False)
            )

    def _write(self, c: Collected) -> int:
        """Append line ``c`` (on a full file system, after the spare file is removed); index
        it; return its offset."""
        line = _encoder.encode(c) + b"\n"
        with self._lock:
            try:
                at = self._append(line)
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or not self._spend_reserve():
                    raise
                at = self._append(line)
            self._load()
        return at

    def _mkdir(self) -> None:
        make_node_dir(self.path.parent)

    def _append(self, line: bytes) -> int:
        return append_line(self.path, line)

    def _spend_reserve(self) -> bool:
        try:
            os.unlink(self.reserve)
        except FileNotFoundError:
            return False
        log.warning("payload root full: spare file %s removed to write the GC ledger", self.reserve)
        return True

    def keep_reserve(self) -> None:
        """Create the spare file beside the ledger if it is missing; quietly nothing when
        there is no room for it (the next collection tries again)."""
        if os.path.lexists(self.reserve):
            return
        tmp = self.reserve.with_name(f"{RESERVE_NAME}.tmp")
        try:
            self._mkdir()
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o640)
            try:
                view = memoryview(os.urandom(RESERVE_BYTES))  # written: really allocated
                while view.nbytes:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
            os.chmod(tmp, 0o640)  # whatever the umask
            os.replace(tmp, self.reserve)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    def mark(self, run: str, *, load: bool = False) -> int | None:
        """The collected watermark of ``run`` (steps ``<= mark`` are gone), or ``None``; as
        last loaded, unless ``load`` (what was appended since is read first)."""
        if load:
            with self._lock:
                self._load()
        return self._marks.get(run)

    def recent(self, n: int) -> tuple[list[Collected], int]:
        """The last ``n`` collections that removed files, oldest first, and the number of
        them in all (a line that only raised a watermark is no collection of files)."""
        with self._lock:
            self._load()
            total = len(self._removals)
            return self._read(list(self._removals[max(0, total - n) :])), total

    def find(self, rel: str) -> Collected | None:
        """The collection that removed file ``rel``, or ``None``."""
        key = tuple(rel.split("/")[1:3])
        with self._lock:
            self._load()
            lines = self._steps.get((key[0], key[1])) if len(key) == 2 else None
            if not lines:
                return None
            for c in reversed(self._read(lines)):  # the latest collection of it
                if rel in c.files:
                    return c
        return None
