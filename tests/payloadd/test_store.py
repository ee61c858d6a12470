"""The storage core without HTTP: placement, rotation, concurrent writers, read checks."""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from payload_client import (
    FileMissingError,
    InvalidRequestError,
    InvalidSegmentError,
    PayloadSegment,
    PayloadTooLargeError,
    SegmentFileError,
    assemble,
    plan_window,
)
from payload_client.wire._http import AppendItem, Extent
from payloadd import Store


def item(rows: int, pos: int = 0, *, field: str = "routed_experts", shape: list[int] | None = None,
         dtype: str = "uint8", run: str = "r", step: int = 0) -> AppendItem:  # fmt: skip
    return AppendItem(field, dtype, [48, 8] if shape is None else shape, rows, pos, run, step)


def test_layout_and_bytes_on_disk(tmp_path: Path) -> None:
    store = Store(tmp_path / "root", "node-a")
    data = np.arange(3 * 384, dtype=np.uint8) % 251
    (segs,) = store.append([item(3, pos=7, run="run1", step=4)], data)
    (s,) = segs
    assert s.file.startswith("node-a/run1/4/routed_experts-")
    assert (s.offset, s.pos, s.rows, s.dtype, s.shape) == (0, 7, 3, "uint8", [48, 8])
    assert (tmp_path / "root" / s.file).read_bytes() == data.tobytes()
    assert oct((tmp_path / "root").stat().st_mode & 0o777) == oct(0o750)


def test_appends_share_a_file_until_rotation(tmp_path: Path) -> None:
    store = Store(tmp_path, "n", max_file_bytes=1000)
    a = store.append([item(1)], bytes(384))[0]  # 384 bytes
    b = store.append([item(1)], bytes(384))[0]  # 768: same file
    c = store.append([item(1)], bytes(384))[0]  # would be 1152: a new file
    assert a[0].file == b[0].file != c[0].file
    assert (a[0].offset, b[0].offset, c[0].offset) == (0, 384, 0)


def test_append_larger_than_a_file_splits_into_contiguous_segments(tmp_path: Path) -> None:
    store = Store(tmp_path, "n", max_file_bytes=1000)  # 2 rows of 384 bytes per file
    data = np.random.default_rng(0).integers(0, 255, 7 * 384, dtype=np.uint8)
    (segs,) = store.append([item(7, pos=100)], data)
    assert [s.rows for s in segs] == [2, 2, 2, 1]
    assert [s.pos for s in segs] == [100, 102, 104, 106]
    assert len({s.file for s in segs}) == 4
    plan = plan_window(segs, "routed_experts", 100, 107, 0)
    assert plan is not None
    got = assemble(
        plan, store.read_extents([Extent(p.file, p.offset, p.nbytes, p.end) for p in plan.pieces])
    )
    np.testing.assert_array_equal(got, data.reshape(7, 48, 8))


def test_a_restarted_store_never_appends_to_old_files(tmp_path: Path) -> None:
    first = Store(tmp_path, "n").append([item(1)], bytes(384))[0][0]
    second = Store(tmp_path, "n").append([item(1)], bytes(384))[0][0]
    assert first.file != second.file and second.offset == 0
    assert (tmp_path / first.file).stat().st_size == 384


def test_concurrent_writers_get_disjoint_ranges(tmp_path: Path) -> None:
    store = Store(tmp_path, "n", max_file_bytes=64 * 1024)
    results: dict[int, list[tuple[np.ndarray, list[PayloadSegment]]]] = {}

    def writer(w: int) -> None:
        out = []
        for k in range(40):
            rows = np.full((3, 48, 8), (w * 40 + k) % 256, np.uint8)
            out.append((rows, store.append([item(3, pos=k * 3, run="c")], rows)[0]))
        results[w] = out

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ranges = sorted(
        (s.file, s.offset, s.offset + 3 * 384)
        for out in results.values()
        for _, segs in out
        for s in segs
    )
    assert len(ranges) == 16 * 40
    for (f1, _, end1), (f2, start2, _) in itertools.pairwise(ranges):
        assert f1 != f2 or end1 <= start2
    for out in results.values():
        for rows, segs in out:
            (s,) = segs
            assert (tmp_path / s.file).read_bytes()[s.offset : s.offset + 1152] == rows.tobytes()


def test_two_phase_append_writes_in_any_chunking(tmp_path: Path) -> None:
    store = Store(tmp_path, "n")
    rows_a = np.arange(2 * 384, dtype=np.uint8)
    rows_b = np.arange(5 * 3, dtype="<i4")
    pending = store.begin_append(
        [item(2), item(5, field="sampling_mask", shape=[3], dtype="int32")]
    )
    stream = rows_a.tobytes() + rows_b.tobytes()
    for i in range(0, len(stream), 7):
        pending.write(stream[i : i + 7])
    a, b = pending.commit()
    assert (tmp_path / a[0].file).read_bytes() == rows_a.tobytes()
    assert (tmp_path / b[0].file).read_bytes() == rows_b.tobytes()
    assert store.stats().rows_appended == 7


def test_short_or_long_bodies_are_refused(tmp_path: Path) -> None:
    store = Store(tmp_path, "n")
    with pytest.raises(InvalidRequestError, match="early"):
        store.append([item(2)], bytes(383))
    with pytest.raises(InvalidRequestError, match="more row bytes"):
        store.append([item(1)], bytes(385))


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (item(1, run=".."), "run"),
        (item(1, run="a/b"), "run"),
        (item(1, field="a/b"), "field"),
        (item(1, dtype="int64"), "dtype"),
        (item(1, shape=[]), "shape"),
        (item(1, shape=[0]), "shape"),
        (item(1, shape=[2**62, 8]), "overflow"),
        (item(2, pos=2**63 - 2), "overflow"),
    ],
)
def test_bad_items_reserve_nothing(tmp_path: Path, bad: AppendItem, match: str) -> None:
    store = Store(tmp_path, "n")
    with pytest.raises(InvalidRequestError, match=match):
        store.begin_append([item(1), bad])
    assert not (tmp_path / "n").exists()


def test_read_checks(tmp_path: Path) -> None:
    root = tmp_path / "root"
    store = Store(root, "n")
    (s,) = store.append([item(2)], bytes(768))[0]
    assert store.read_extents([Extent(s.file, 384, 384, 768)]) == bytes(384)
    with pytest.raises(FileMissingError, match=r"nope\.bin"):
        store.read_extents([Extent("n/nope.bin", 0, 1, 1)])
    with pytest.raises(SegmentFileError, match="768 bytes but a segment ends at byte 1152"):
        store.read_extents([Extent(s.file, 0, 384, 1152)])  # the range exists, the segment doesn't
    (root / "n" / "r" / "0" / "dir").mkdir(parents=True)
    with pytest.raises(SegmentFileError, match="not a regular file"):
        store.read_extents([Extent("n/r/0/dir", 0, 0, 0)])
    with pytest.raises(FileMissingError, match="no data file"):  # not where data files lie
        store.read_extents([Extent("n", 0, 0, 0)])
    (tmp_path / "outside.bin").write_bytes(bytes(10))
    os.symlink(tmp_path / "outside.bin", root / "n" / "escape.bin")
    with pytest.raises(SegmentFileError, match="outside the payload root"):
        store.read_extents([Extent("n/escape.bin", 0, 1, 1)])
    os.symlink(root / s.file, root / "n" / "inside.bin")  # a symlink inside the root is fine
    assert len(store.read_extents([Extent("n/inside.bin", 0, 384, 768)])) == 384
    os.symlink("../..", root / "n" / "r" / "0" / "up")  # to a data file, never another one
    with pytest.raises(FileMissingError, match="no data file"):
        store.read_extents([Extent("n/r/0/up/n/r/0/dir", 0, 0, 0)])
    with pytest.raises(InvalidSegmentError, match="file"):
        store.read_extents([Extent("../outside.bin", 0, 1, 1)])
    with pytest.raises(InvalidRequestError, match="past end"):
        store.read_extents([Extent(s.file, 0, 800, 768)])


def test_read_limit(tmp_path: Path) -> None:
    store = Store(tmp_path, "n", max_read_bytes=100)
    (s,) = store.append([item(1)], bytes(384))[0]
    with pytest.raises(PayloadTooLargeError):
        store.read_extents([Extent(s.file, 0, 384, 384)])


def test_checks_come_before_any_allocation_or_reservation(tmp_path: Path) -> None:
    store = Store(tmp_path, "n", max_read_bytes=2**62, max_append_bytes=1 << 20)
    (s,) = store.append([item(1)], bytes(384))[0]
    with pytest.raises(SegmentFileError, match="ends at byte"):  # no 1 TiB buffer first
        store.read_extents([Extent(s.file, 0, 2**40, 2**40)])
    with pytest.raises(PayloadTooLargeError, match="row bytes"):
        store.begin_append([item(2**40)])
    with pytest.raises(InvalidRequestError, match="overflows"):
        store.begin_append([item(2**63 - 1, shape=[2])])
    assert len(list((tmp_path / "n" / "r" / "0").iterdir())) == 1


def test_zero_row_items_never_open_a_new_file(tmp_path: Path) -> None:
    store = Store(tmp_path, "n", max_file_bytes=384)
    (full,) = store.append([item(1)], bytes(384))[0]
    (placeholder,) = store.append([item(0, pos=9)], b"")[0]
    assert placeholder.file == full.file and placeholder.rows == 0
    assert len(list((tmp_path / "n" / "r" / "0").iterdir())) == 1


def test_a_fifo_in_the_root_is_refused_without_blocking(tmp_path: Path) -> None:
    store = Store(tmp_path, "n")
    (tmp_path / "n" / "r" / "0").mkdir(parents=True)
    os.mkfifo(tmp_path / "n" / "r" / "0" / "x.fifo")
    with pytest.raises(SegmentFileError, match="not a regular file"):
        store.read_extents([Extent("n/r/0/x.fifo", 0, 1, 1)])


def test_directories_are_0750_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        store = Store(tmp_path / "root", "n")
        (s,) = store.append([item(1, run="modes", step=3)], bytes(384))[0]
    finally:
        os.umask(old)
    for d in ("", "n", "n/modes", "n/modes/3"):
        assert (tmp_path / "root" / d).stat().st_mode & 0o777 == 0o750, d
    assert (tmp_path / "root" / s.file).stat().st_mode & 0o777 == 0o640


def test_appends_never_go_to_a_removed_file(tmp_path: Path) -> None:
    store = Store(tmp_path, "n")
    (s,) = store.append([item(1)], bytes(384))[0]
    os.unlink(tmp_path / s.file)  # by hand, under the daemon
    (t,) = store.append([item(1)], bytes(384))[0]
    assert t.file != s.file and (tmp_path / t.file).stat().st_size == 384


def test_cached_read_descriptors_never_serve_a_removed_or_replaced_file(tmp_path: Path) -> None:
    store = Store(tmp_path, "n")
    (s,) = store.append([item(2)], bytes(768))[0]
    assert store.read_extents([Extent(s.file, 0, 384, 768)]) == bytes(384)  # now cached
    os.unlink(tmp_path / s.file)
    with pytest.raises(FileMissingError):
        store.read_extents([Extent(s.file, 0, 384, 768)])
    (tmp_path / s.file).write_bytes(b"\x07" * 100)  # another file under the same name
    with pytest.raises(SegmentFileError, match="100 bytes"):
        store.read_extents([Extent(s.file, 0, 384, 768)])


def test_files_are_closed_when_sealed_and_unused(tmp_path: Path) -> None:
    store = Store(tmp_path, "n", max_file_bytes=384)
    before = len(os.listdir("/proc/self/fd"))
    pending = store.begin_append([item(1)])
    first = store._open[pending.files[0]].fd
    for _ in range(5):  # each append rotates: the earlier files are sealed
        store.append([item(1)], bytes(384))
    os.fstat(first)  # still open: a pending append writes to it
    pending.write(bytes(384))
    pending.commit()
    with pytest.raises(OSError):
        os.fstat(first)  # closed now that nobody uses it
    assert len(os.listdir("/proc/self/fd")) <= before + 1  # only the current file's
    store.close()


@pytest.mark.parametrize("size", [1, 7, 384, 1000, 10_000])
def test_chunked_reads_give_the_same_bytes_as_whole_ones(tmp_path: Path, size: int) -> None:
    store = Store(tmp_path / "root", "n")
    rng = np.random.default_rng(size)
    data = rng.integers(0, 256, 20 * 384).astype(np.uint8)
    segs = [s for group in store.append([item(12), item(8, run="other")], data) for s in group]
    a, b = segs
    extents = [Extent(b.file, 384, 3 * 384, b.offset + 8 * 384), Extent(a.file, 5, 2000, 12 * 384),
               Extent(a.file, 0, 0, 12 * 384), Extent(b.file, 0, 384, 8 * 384)]  # fmt: skip
    whole = store.read_extents(extents)
    before = store.stats().reads
    reader = store.open_extents(extents)
    try:
        chunks = list(reader.chunks(size))
    finally:
        reader.close()
    assert b"".join(chunks) == whole and len(whole) == reader.total == 3 * 384 + 2000 + 384
    assert all(len(c) == size for c in chunks[:-1]) and 0 < len(chunks[-1]) <= size
    assert store.stats().reads == before + 1  # counted once, when the last chunk is read


def test_a_read_that_cannot_be_answered_fails_before_a_byte_is_read(tmp_path: Path) -> None:
    store = Store(tmp_path / "root", "n")
    (s,) = store.append([item(2)], bytes(768))[0]
    path = str(tmp_path / "root" / s.file)

    def open_on_file() -> int:  # this process's descriptors of the data file
        fds = []
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):  # closed meanwhile (the listing's own)
                fds.append(os.readlink(f"/proc/self/fd/{fd}"))
        return fds.count(path)

    store.read_extents([Extent(s.file, 0, 768, 768)])  # the store's own caches are warm
    held = open_on_file()
    with pytest.raises(FileMissingError):  # the second file is checked before the first is read
        store.open_extents([Extent(s.file, 0, 768, 768), Extent("n/nope.bin", 0, 1, 1)])
    assert open_on_file() == held  # the descriptor opened for the first file is closed


def test_a_reader_dropped_unread_closes_its_descriptors(tmp_path: Path) -> None:
    # an HTTP client that goes away before its streamed answer starts leaves such a reader
    store = Store(tmp_path / "root", "n")
    (s,) = store.append([item(2)], bytes(768))[0]
    store.read_extents([Extent(s.file, 0, 768, 768)])  # the store's own caches are warm
    path = str(tmp_path / "root" / s.file)

    def open_on_file() -> int:
        links = []
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                links.append(os.readlink(f"/proc/self/fd/{fd}"))
        return links.count(path)

    held = open_on_file()
    reader = store.open_extents([Extent(s.file, 0, 768, 768)])
    assert open_on_file() == held + 1
    del reader
    assert open_on_file() == held
    reader = store.open_extents([Extent(s.file, 0, 768, 768)])
    reader.close()
    reader.close()  # closing twice closes nothing else
    assert open_on_file() == held


def test_symlinked_directories_out_of_the_root_are_refused_even_after_a_cached_read(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    store = Store(root, "n")
    (s,) = store.append([item(1)], bytes(range(128)) * 3)[0]
    outside = tmp_path / "outside"
    outside.mkdir()
    name = s.file.split("/")[-1]
    (outside / name).write_bytes(b"\xff" * 384)
    os.symlink(outside, root / "n" / "d")
    with pytest.raises(SegmentFileError, match="outside the payload root"):
        store.read_extents([Extent(f"n/d/{name}", 0, 1, 1)])
    assert store.read_extents([Extent(s.file, 0, 4, 384)]) == bytes(range(4))  # now cached
    step = root / s.file.rsplit("/", 1)[0]
    step.rename(tmp_path / "moved")
    os.symlink(outside, step)  # the step directory now leads out of the root
    with pytest.raises(SegmentFileError, match="outside the payload root"):
        store.read_extents([Extent(s.file, 0, 4, 384)])


@pytest.mark.parametrize(
    "sizes",
    [[600] * 40, [1] * 100, [3000, 1, 3000], [0, 5000, 0], [1024, 1024, 1], [4096] * 3],
)
@pytest.mark.parametrize("private", [False, True])
def test_files_needed_bounds_the_files_an_append_holds(
    tmp_path: Path, sizes: list[int], private: bool
) -> None:
    store = Store(tmp_path, "n", max_file_bytes=1024)
    store.append([AppendItem("f", "uint8", [1], 700, 0, "r", 0)], bytes(700))  # a current file
    for key in ("f", "g"):
        items = [AppendItem(key, "uint8", [1], n, 0, "r", 0) for n in sizes]
        pending = store.begin_append(items, private=private)
        try:
            assert len(pending.files) <= store.files_needed(items)
        finally:
            pending.close()
