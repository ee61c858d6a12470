"""A full file system answers 507 and loses nothing (a real daemon on a 1 MiB tmpfs)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from payload_client import PayloadClient, PayloadSegment, StorageFullError
from payloadd._process import start_daemon


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


def test_enospc_is_507_and_earlier_segments_still_read(small_fs: Path, tmp_path: Path) -> None:
    sock = tmp_path / "payloadd.sock"
    with start_daemon(small_fs / "root", sock), PayloadClient(sock) as c:
        kept: list[tuple[np.ndarray, list[PayloadSegment]]] = []
        rng = np.random.default_rng(0)
        with pytest.raises(StorageFullError, match="full"):
            for _ in range(100):  # 100 x 100 KiB > 1 MiB
                rows = rng.integers(0, 255, (256, 400)).astype(np.uint8)
                kept.append((rows, c.append("f", rows, 0, run="full", step=0)))
        assert 3 <= len(kept) < 100
        for rows, segs in kept:  # everything acknowledged reads back, bit for bit
            np.testing.assert_array_equal(c.read_field(segs, "f", 0, len(rows), 0), rows)
        assert c.health().status == "ok"
