"""Writers can only damage their own rows: every write descriptor a data-plane client gets
is of a file private to it.

A hostile client does its worst through every descriptor the daemon hands it (pwrite over
every byte, truncate, punch holes); everyone else's acknowledged rows read back bit for bit.
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
from pathlib import Path

import msgspec
import numpy as np
import pytest

from payload_client import PayloadClient, PayloadSegment
from payload_client.wire._dataplane import OpenRequest, ReserveRequest
from payload_client.wire._frames import FRAME_PREFIX
from payload_client.wire._http import AppendItem
from tests.conftest import Daemons

R = "routed_experts"
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_libc = ctypes.CDLL(None, use_errno=True)


def _punch(fd: int, length: int) -> None:
    mode = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
    _libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    if _libc.fallocate(fd, mode, 0, length) != 0:
        raise OSError(ctypes.get_errno(), "fallocate")


def _vandalise(fd: int) -> None:
    """Everything a writer can do to a file through its descriptor."""
    junk = b"\xee" * (1 << 20)
    for offset in range(0, 8 << 20, len(junk)):
        os.pwrite(fd, junk, offset)
    _punch(fd, 4 << 20)
    os.ftruncate(fd, 0)


def _ask(sock: socket.socket, request: object) -> tuple[list[object], list[int]]:
    body = msgspec.msgpack.encode(request)
    sock.sendall(FRAME_PREFIX.pack(len(body)) + body)
    msg, anc, _, _ = sock.recvmsg(1 << 16, socket.CMSG_SPACE(64 * 4))
    fds = [
        int(fd)
        for _level, _kind, data in anc
        for fd in np.frombuffer(data[: len(data) - len(data) % 4], np.int32)
    ]
    return msgspec.msgpack.decode(msg[FRAME_PREFIX.size :]), fds


def test_a_hostile_writer_reaches_nobody_elses_rows(tmp_path: Path, daemons: Daemons) -> None:
    sock = tmp_path / "s.sock"
    with daemons.run("--node", "n", socket=sock):
        rng = np.random.default_rng(9)
        honest: list[tuple[np.ndarray, list[PayloadSegment]]] = []
        with (
            PayloadClient(sock) as a,  # a writer on the data plane (leases)
            PayloadClient(sock, data_plane=False) as h,  # and one over HTTP
            PayloadClient(sock) as hostile,
        ):
            for k in range(20):
                for c in (a, h):
                    rows = rng.integers(0, 128, (int(rng.integers(1, 30)), 48, 8), np.uint8)
                    honest.append((rows, c.append(R, rows, 100 * k, run="r", step=0)))
            mine = hostile.append(R, np.ones((5, 48, 8), np.uint8), 0, run="r", step=0)
            assert hostile._data_plane is not None
            (lease,) = hostile._data_plane.leases.items.values()  # its write descriptor
            assert lease.file == mine[0].file
            assert all(s.file != lease.file for _, segs in honest for s in segs)
            _vandalise(lease.fd)
            raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # and by hand:
            raw.connect(f"{sock}.data")
            item = AppendItem(R, "uint8", [48, 8], 20_000, 0, "r", 0)  # a reservation
            reply, fds = _ask(raw, ReserveRequest([item]))
            assert reply[0] == "reserved" and fds
            for fd in fds:
                _vandalise(fd)
                os.close(fd)
            others = sorted({s.file for _, segs in honest for s in segs})
            reply, fds = _ask(raw, OpenRequest([(f, 1) for f in others]))  # read descriptors
            assert reply[0] == "opened" and len(fds) == len(others)
            for fd in fds:
                with pytest.raises(OSError) as info:
                    os.pwrite(fd, b"\xee", 0)
                assert info.value.errno == errno.EBADF
                with pytest.raises(OSError):
                    os.ftruncate(fd, 0)
                os.close(fd)
            raw.close()
            for c in (a, h):
                for rows, segs in honest:
                    pos = segs[0].pos
                    got = c.read_field(segs, R, pos, pos + len(rows), 0)
                    np.testing.assert_array_equal(got, rows)
