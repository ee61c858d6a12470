"""The daemon's count of its node's bytes stays the files' sizes under every interleaving of
one client's threads: stragglers finish an old step while another thread moves on to newer
ones (asynchronous RL), threads of one key go on while its file rotates.

A lease whose file closed while a claimed row was still being written never counted that
row: the count fell below the files, and the cap let the files pass it. Every test shares
one `PayloadClient` (the data plane, the default) between threads released by a barrier, and
looks with `payloadd.bench._root_bytes.root_bytes` at quiet points: the count less what is
reserved and unwritten is the files' sizes, exactly.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np

from payload_client import PayloadClient, StorageFullError
from payloadd.bench._root_bytes import file_bytes, root_bytes
from tests.conftest import Daemons

R = "routed_experts"
ROW = 48 * 8  # bytes of a row of R (uint8 [48, 8])


def _together(workers: list[Callable[[], None]]) -> None:
    """Run ``workers`` in threads released together by a barrier; re-raise the first error."""
    go = threading.Barrier(len(workers))
    errors: list[BaseException] = []

    def run(work: Callable[[], None]) -> None:
        try:
            go.wait(30)
            work()
        except BaseException as exc:  # re-raised in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]


def _stragglers_and_a_leader(
    c: PayloadClient,
    stragglers: int,
    appends: int,
    rows: int,
    refused: list[int],
    run: str = "r",
) -> list[Callable[[], None]]:
    """``stragglers`` threads appending ``appends`` appends of ``rows`` rows each to step 0
    of ``run``, and one thread moving on to a new step every 4 appends until they are done
    (at most ``4 * appends`` steps); a `StorageFullError` counts in ``refused`` and the
    thread goes on (near a cap)."""
    done = threading.Event()
    left = [stragglers]
    lock = threading.Lock()

    def append(value: int, pos: int, step: int) -> None:
        try:
            c.append(R, np.full((rows, 48, 8), value, np.uint8), pos, run=run, step=step)
        except StorageFullError:
            with lock:
                refused[0] += 1

    def straggler(i: int) -> None:
        for n in range(appends):
            append(i, (i * appends + n) * rows, 0)
        with lock:
            left[0] -= 1
            if not left[0]:
                done.set()

    def leader() -> None:
        for step in range(1, 4 * appends):
            if done.is_set():
                return
            for n in range(4):
                append(9, n * rows, step)

    return [*(functools.partial(straggler, i) for i in range(stragglers)), leader]


def test_stragglers_on_an_old_step_while_one_thread_moves_on_leave_the_count_the_files(
    tmp_path: Path,
    daemons: Daemons,
) -> None:
    # the leader's lease requests end step 0's lease (a step before its two latest) while
    # the stragglers write rows they claimed in it: their file must stay open until then
    root, sock = tmp_path / "root", tmp_path / "payloadd.sock"
    with daemons.run("--node", "n", root=root, socket=sock):
        refused = [0]
        with PayloadClient(sock) as c:
            _together(_stragglers_and_a_leader(c, 3, 120, 256, refused))
            seen = root_bytes(c)  # the threads done, the client's leases still held
            assert seen.quiet and seen.drift == 0, seen.describe()
            assert seen.files >= 3 * 120 * 256 * ROW
        with PayloadClient(sock) as probe:  # the client gone: its lease files closed
            seen = root_bytes(probe)
            assert seen.reserved == 0
            assert seen.counted == seen.files == file_bytes(root / "n"), seen.describe()
        assert refused == [0]


def test_threads_of_one_key_while_its_file_rotates_leave_the_count_the_files(
    tmp_path: Path,
    daemons: Daemons,
) -> None:
    # six threads on one key, its file rotating every 256 KiB: a renewal that starts a new
    # file seals the old one while the other threads still write rows claimed in it
    root, sock = tmp_path / "root", tmp_path / "payloadd.sock"
    rows, appends = 256, 200
    with daemons.run("--node", "n", "--max-file-bytes", str(256 << 10), root=root, socket=sock):
        with PayloadClient(sock) as c:

            def writer(i: int) -> None:
                block = np.full((rows, 48, 8), i, np.uint8)
                for n in range(appends):
                    c.append(R, block, (i * appends + n) * rows, run="r", step=0)

            _together([functools.partial(writer, i) for i in range(6)])
            seen = root_bytes(c)
            assert seen.quiet and seen.drift == 0, seen.describe()
            assert seen.files == 6 * appends * rows * ROW  # no hole: each lease went on
        with PayloadClient(sock) as probe:  # where the last one ended
            seen = root_bytes(probe)
            assert seen.counted == seen.files == 6 * appends * rows * ROW, seen.describe()


def test_under_a_cap_stragglers_and_a_leader_never_take_the_files_past_it(
    tmp_path: Path,
    daemons: Daemons,
) -> None:
    # appends go on past the point where the cap refuses them, then everything is
    # collected, round after round (a drift outlives the files it was made in): the files
    # stay under the cap
    cap = 6 << 20
    root, sock = tmp_path / "root", tmp_path / "payloadd.sock"
    with daemons.run("--node", "n", "--max-root-bytes", str(cap), root=root, socket=sock):
        for rnd in range(4):
            refused = [0]
            with PayloadClient(sock) as c:
                _together(_stragglers_and_a_leader(c, 3, 40, 256, refused, run=f"r{rnd}"))
                files = file_bytes(root / "n")
                assert refused[0] > 0  # the cap was reached
                c.gc(run=f"r{rnd}", through_step=1 << 20)  # every step collected
            assert files <= cap, f"round {rnd}: the files {files:,} bytes, over the cap"
            with PayloadClient(sock) as probe:
                seen = root_bytes(probe)
                assert seen.counted == seen.files == 0, f"round {rnd}: {seen.describe()}"
