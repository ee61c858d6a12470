"""A full file system answers 507 and loses nothing (a real daemon on a 1 MiB tmpfs)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from payload_client import (
    FileGoneError,
    PayloadClient,
    PayloadSegment,
    StorageFullError,
)
from payload_client.transports.dataplane import _descriptors
from payload_client.wire._http import AppendItem
from payloadd import Store
from tests.conftest import Daemons


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs mounted for the test (needs root and mount rights, else skipped)."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                          capture_output=True)  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


@pytest.mark.parametrize("transport", ["http", "data-plane"])
def test_enospc_is_507_and_earlier_segments_still_read(
    small_fs: Path, tmp_path: Path, daemons: Daemons, transport: str
) -> None:
    sock = tmp_path / "payloadd.sock"
    no_floor = ("--min-free-bytes", "0")  # the file system itself runs full
    with daemons.run(*no_floor, root=small_fs / "root", socket=sock), PayloadClient(sock) as c:
        kept: list[tuple[np.ndarray, list[PayloadSegment]]] = []
        rng = np.random.default_rng(0)
        w = PayloadClient(sock, data_plane=transport == "data-plane")
        with w, pytest.raises(StorageFullError, match="full") as err:
            for _ in range(100):  # 100 x 100 KiB > 1 MiB
                rows = rng.integers(0, 255, (256, 400)).astype(np.uint8)
                kept.append((rows, w.append("f", rows, 0, run="full", step=0)))
        # over the data plane the client's own pwrite met ENOSPC; over HTTP the daemon's
        assert ("(HTTP 507)" in str(err.value)) == (transport == "http")
        assert 3 <= len(kept) < 100
        for rows, segs in kept:  # everything acknowledged reads back, bit for bit
            np.testing.assert_array_equal(c.read_field(segs, "f", 0, len(rows), 0), rows)
        assert c.health().status == "ok"


@pytest.mark.parametrize("transport", ["http", "data-plane"])
def test_the_floor_refuses_before_the_file_system_is_full(
    small_fs: Path, tmp_path: Path, daemons: Daemons, transport: str
) -> None:
    sock = tmp_path / "payloadd.sock"
    floor = ("--min-free-bytes", str(512 << 10), "--lease-bytes", str(64 << 10))
    with daemons.run(*floor, root=small_fs / "root", socket=sock), PayloadClient(sock) as c:
        kept: list[tuple[np.ndarray, list[PayloadSegment]]] = []
        w = PayloadClient(sock, data_plane=transport == "data-plane")
        with w, pytest.raises(StorageFullError, match=r"min_free_bytes = 512 KiB \(524288 bytes\)"):
            for k in range(100):
                rows = np.full((256, 100), k, np.uint8)  # 25 KiB
                kept.append((rows, w.append("f", rows, 0, run="floor", step=0)))
        assert 5 <= len(kept) < 21  # stopped at about half of 1 MiB, never at ENOSPC
        free = os.statvfs(small_fs).f_bavail * os.statvfs(small_fs).f_frsize
        assert free >= (512 << 10) - (64 << 10)  # a lease's unwritten tail at most below it
        for rows, segs in kept:
            np.testing.assert_array_equal(c.read_field(segs, "f", 0, len(rows), 0), rows)


def test_gc_frees_a_file_system_that_others_filled(
    small_fs: Path, tmp_path: Path, daemons: Daemons, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_descriptors, "DROP_REMOVED_S", 0.0)  # the client lets go at once
    sock = tmp_path / "payloadd.sock"
    with (
        daemons.run("--min-free-bytes", "0", root=small_fs / "root", socket=sock),
        PayloadClient(sock) as c,
    ):
        rows = np.full((256, 400), 7, np.uint8)  # 100 KiB a step
        segs = [c.append("f", rows, 0, run="full", step=step) for step in range(3)]
        fd = os.open(small_fs / "checkpoint", os.O_WRONLY | os.O_CREAT)
        with pytest.raises(OSError, match="space"):
            while True:  # another program takes every block left
                os.write(fd, bytes(4096))
        os.close(fd)
        report = c.gc("full", 1)  # what an operator does about a full disk: it must work
        assert report.steps == [("full", 0), ("full", 1)]
        with pytest.raises(FileGoneError, match="step 0 of run 'full'"):
            c.read_field(segs[0], "f", 0, 256, 0)
        np.testing.assert_array_equal(c.read_field(segs[2], "f", 0, 256, 0), rows)
        again = c.append("f", rows, 0, run="full", step=3)  # room again
        np.testing.assert_array_equal(c.read_field(again, "f", 0, 256, 0), rows)


def test_an_append_refused_when_no_inode_is_left_keeps_nothing(tmp_path: Path) -> None:
    """Item 0 goes to an existing file, item 1 needs a new step directory the file system has
    no inode for: 507, and item 0's range is given back (the next append lands right after
    the last one stored) and its file released (GC can still remove it)."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,nr_inodes=16", "tmpfs",
                           str(mnt)], capture_output=True)  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    store = Store(mnt / "root", "n")
    try:

        def item(step: int, pos: int) -> AppendItem:
            return AppendItem("f", "uint8", [4], 1, pos, "r", step)

        ((last,),) = store.append([item(0, 0)], b"aaaa")
        with pytest.raises(StorageFullError, match="full"):
            for step in range(1, 100):  # a new step directory and file each time
                ((last,), _) = store.append([item(0, step), item(step, 0)], b"bbbbcccc")
        ((nxt,),) = store.append([item(0, 100)], b"dddd")
        assert (nxt.file, nxt.offset) == (last.file, last.offset + 4)
        removal = store.remove_step("r", 0, store.step_files("r", 0))
        assert removal.in_use == 0 and [rel for rel, _ in removal.files] == [last.file]
    finally:
        store.close()
        subprocess.run(["umount", "-l", str(mnt)], check=True)
