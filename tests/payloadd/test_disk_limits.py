"""Disk limits: a cap on this node's bytes (``max_root_bytes``) and a free-space floor
(``min_free_bytes``) refuse appends with 507 before anything is reserved; reads go on."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from payload_client import PayloadClient, PayloadSegment, StorageFullError
from payload_client.protocol import format_size
from payload_client.wire._http import AppendItem, GcRequest
from payloadd import Store
from payloadd.store._gc import GarbageCollector
from tests.conftest import Daemons
from tests.payloadd.disk_accounting import FIELDS, measure

R = "routed_experts"
KiB = 1 << 10


def item(rows: int, *, run: str = "r", step: int = 0) -> AppendItem:
    return AppendItem(R, "uint8", [48, 8], rows, 0, run, step)


def node_bytes(root: Path, node: str) -> int:
    """The files the cap counts: every one of the node but the daemon's own (``@...``)."""
    files = (p for p in (root / node).rglob("*") if p.is_file() and not p.name.startswith("@"))
    return sum(p.stat().st_size for p in files)


def test_the_cap_refuses_before_reserving_and_counts_reservations(tmp_path: Path) -> None:
    store = Store(tmp_path, "n", max_root_bytes=4000)
    store.append([item(5)], bytes(5 * 384))  # 1920 bytes
    store.append([item(5)], bytes(5 * 384))  # 3840
    files = sorted(p.name for p in tmp_path.rglob("*.bin"))
    with pytest.raises(StorageFullError) as err:
        store.begin_append([item(1)])
    msg = str(err.value)
    assert "an append of 384 B does not fit under the cap" in msg
    assert "count 3.8 KiB (3840 bytes), leaving 160 B" in msg
    assert "max_root_bytes = 3.9 KiB (4000 bytes)" in msg
    assert sorted(p.name for p in tmp_path.rglob("*.bin")) == files  # nothing reserved
    assert store.root_bytes == 3840 == node_bytes(tmp_path, "n")
    with pytest.raises(StorageFullError) as err:  # a data-plane lease: the same words
        store.lease("r", 1, R, 384, 1 << 20, owner=1)
    assert str(err.value) == msg
    assert not (tmp_path / "n" / "r" / "1").exists()  # not even a directory
    store.forget_bytes(3840)  # what garbage collection calls after removing files
    lease = store.lease("r", 1, R, 384, 1 << 20, owner=1)
    assert lease.nbytes == 500  # near the cap a lease takes an eighth of the room left
    assert store.stats().appends_refused == 2
    store.close()


def test_a_lease_tail_stops_counting_when_its_file_closes(tmp_path: Path) -> None:
    store = Store(tmp_path, "n", max_root_bytes=1 << 20)
    lease = store.lease("r", 0, R, 384, 10_000, owner=1)
    assert store.root_bytes == 10_000  # the whole range counts from the grant
    with open(tmp_path / lease.file, "r+b") as f:  # the client writes 2 rows of it
        f.write(bytes(768))
    lease.release()
    assert store.root_bytes == 10_000  # the file is still open for appends
    store.close()  # closing it: the unused tail at its end was never written
    assert store.root_bytes == 768 == node_bytes(tmp_path, "n")


def test_a_lease_the_client_says_it_is_done_with_gives_its_tail_back_at_once(
    tmp_path: Path,
) -> None:
    store = Store(tmp_path, "n", max_root_bytes=1 << 20)
    lease = store.lease("r", 0, R, 384, 10_000, owner=1)
    with open(tmp_path / lease.file, "r+b") as f:  # the client writes 2 rows of it
        f.write(bytes(768))
    lease.release(used=768)  # `LeaseRequest.done`: nothing written from 768 on
    assert store.root_bytes == 768  # at once, while the file stays open for the next lease
    nxt = store.lease("r", 0, R, 384, 10_000, owner=1)
    assert (nxt.file, nxt.offset) == (lease.file, 768)  # goes on there: no hole
    # a row claimed below the end the client gives, then never written (its append went
    # another way: the lease it asked for was refused): counted until the file closes...
    nxt.release(used=768 + 384)
    assert store.root_bytes == 768 + 384
    store.close()
    assert store.root_bytes == 768 == node_bytes(tmp_path, "n")  # ...then the file decides


def test_near_the_cap_leases_shrink_and_leave_room_for_other_writers(tmp_path: Path) -> None:
    # 8 writers x 3 fields asking 16 MiB each under a 32 MiB cap: before, the first two
    # leases took it all and every other writer's 384-byte append was refused
    store = Store(tmp_path, "n", max_root_bytes=32 << 20)
    leases = [
        store.lease("r", 0, field, 384, 16 << 20, owner=writer)
        for writer in range(1, 9)
        for field in ("routed_experts", "sampling_mask", "loss_mask")
    ]
    assert all(lease.nbytes >= 384 for lease in leases)
    assert store.root_bytes <= 32 << 20
    assert max(lease.nbytes for lease in leases) == 4 << 20  # an eighth of the room
    store.close()
    assert store.root_bytes == 0


def test_recount_and_a_restart_count_the_files_on_disk(tmp_path: Path) -> None:
    store = Store(tmp_path, "n")
    store.append([item(3)], bytes(3 * 384))
    lease = store.lease("r", 1, R, 384, 5000, owner=1)
    other = tmp_path / "other-node" / "x.bin"  # another node's files never count
    other.parent.mkdir()
    other.write_bytes(bytes(999))
    (tmp_path / "n" / "r" / "0" / "by-hand.bin").write_bytes(bytes(100))
    assert store.recount() == 3 * 384 + 5000 + 100  # files plus the lease, reserved
    lease.release()
    store.close()
    assert Store(tmp_path, "n").root_bytes == 3 * 384 + 100 == node_bytes(tmp_path, "n")


def test_the_gc_ledger_and_its_spare_file_never_count(tmp_path: Path) -> None:
    store = Store(tmp_path, "n", max_root_bytes=4000)
    store.append([item(5)], bytes(5 * 384))
    store.append([item(5, step=1)], bytes(5 * 384))
    GarbageCollector(store).collect(GcRequest(run="r", through_step=0))  # writes both
    assert store.root_bytes == 1920 == store.recount()  # the cap is for rows
    store.close()
    again = Store(tmp_path, "n", max_root_bytes=4000)
    assert again.root_bytes == 1920  # after a restart as well
    again.append([item(5, step=2)], bytes(5 * 384))  # so a full cap stays usable


def test_the_floor_refuses_with_the_free_space_in_the_message(tmp_path: Path) -> None:
    store = Store(tmp_path, "n", min_free_bytes=1 << 62)
    with pytest.raises(StorageFullError) as err:
        store.append([item(1)], bytes(384))
    msg = str(err.value)
    assert "an append of 384 B does not fit above the free-space floor" in msg
    assert "min_free_bytes = 4 EiB (4611686018427387904 bytes)" in msg
    assert f"the payload root {tmp_path} has " in msg and " bytes) free" in msg
    assert "a smaller --min-free-bytes" in msg and "payloadd gc --run RUN" in msg
    assert not (tmp_path / "n").exists()
    free = store.stats().free_bytes
    assert free > 0 and store.stats().min_free_bytes == 1 << 62
    store.close()
    near = Store(tmp_path, "n", min_free_bytes=max(1, free - (1 << 30)))  # ~1 GiB above it
    assert near.lease("r", 0, R, 384, 1 << 40, owner=1).nbytes <= 1 << 30  # a lease shrinks to fit
    near.close()


def _fill(c: PayloadClient, rows: np.ndarray, run: str) -> list[tuple[int, list[PayloadSegment]]]:
    """Append ``rows`` until the daemon refuses; return what was acknowledged."""
    kept: list[tuple[int, list[PayloadSegment]]] = []
    with pytest.raises(StorageFullError, match=r"max_root_bytes = 1 MiB \(1048576 bytes\)") as err:
        for k in range(100):
            kept.append((k, c.append(R, rows + k, 0, run=run, step=0)))
    assert f"an append of 96 KiB ({rows.nbytes} bytes)" in str(err.value)
    return kept


@pytest.mark.parametrize("transport", ["http", "data-plane"])
def test_at_the_cap_appends_fail_507_and_reads_go_on(
    tmp_path: Path, daemons: Daemons, transport: str
) -> None:
    sock, root = tmp_path / "payloadd.sock", tmp_path / "root"
    flags = ("--node", "n", "--max-root-bytes", str(1 << 20), "--lease-bytes", str(256 * KiB))
    rows = np.zeros((256, 48, 8), np.uint8)  # 96 KiB
    with daemons.run(*flags, root=root, socket=sock), PayloadClient(sock) as probe:
        with PayloadClient(sock, data_plane=transport == "data-plane") as c:
            kept = _fill(c, rows, "cap")
            before = c.stats()
            with pytest.raises(StorageFullError) as err:  # again: fast, reserves nothing
                c.append(R, rows, 0, run="cap", step=0)
            after = c.stats()
            assert after.root_bytes == before.root_bytes <= 1 << 20
            assert after.appends_refused == before.appends_refused + 1
            assert after.leases == before.leases and after.appends == before.appends
            # 10 appends fit on both transports: renewed leases give their unused tails
            # back (the client says where its rows end), so the count is the rows
            assert len(kept) == 10 and after.root_bytes == 10 * rows.nbytes
            if transport == "http":  # and the answer was a 507
                assert "(HTTP 507)" in str(err.value)
            else:
                assert "HTTP" not in str(err.value)
            for k, segs in kept:  # reads go on, on both transports
                for reader in (c, probe):
                    np.testing.assert_array_equal(reader.read_field(segs, R, 0, 256, 0), rows + k)
            assert c.health().status == "ok"
        assert probe.stats().root_bytes == node_bytes(root, "n")  # the count: the files


def files_of(root: Path, node: str) -> dict[str, int]:
    """Every file of the node (the daemon's own ``@`` files too) and its size."""
    files = (p for p in (root / node).rglob("*") if p.is_file())
    return {str(p.relative_to(root)): p.stat().st_size for p in files}


@pytest.mark.parametrize("data_plane", [True, False])
def test_the_cap_refusal_names_the_cap_and_what_frees_room(
    tmp_path: Path, daemons: Daemons, data_plane: bool
) -> None:
    sock, root = tmp_path / "payloadd.sock", tmp_path / "root"
    rows = np.full((256, 48, 8), 3, np.uint8)  # 96 KiB
    flags = ("--node", "n", "--max-root-bytes", "1MiB", "--lease-bytes", "256KiB")
    with (
        daemons.run(*flags, root=root, socket=sock),
        PayloadClient(sock, data_plane=data_plane) as c,
    ):
        assert c.stats().max_root_bytes == 1 << 20  # the flag's unit taken
        for step in range(10):  # 960 KiB: the next 96 KiB do not fit
            c.append(R, rows, 0, run="r", step=step)
        before, counted = files_of(root, "n"), c.stats().root_bytes
        with pytest.raises(StorageFullError) as err:
            c.append(R, rows, 0, run="r", step=10)
        msg = str(err.value)
        assert msg.startswith(
            "storage full: an append of 96 KiB (98304 bytes) does not fit under the cap "
            "max_root_bytes = 1 MiB (1048576 bytes): this node's files under "
            f"{root / 'n'} and its appends in progress count 960 KiB (983040 bytes), "
            "leaving 64 KiB. "
        ), msg
        assert "client.gc(run=RUN, through_step=N)" in msg  # what frees room
        assert "payloadd gc --run RUN --through-step N" in msg
        assert "a larger --max-root-bytes" in msg
        assert "lease" not in msg.lower()  # the user asked for an append, not a lease
        assert ("(HTTP 507)" in msg) == (not data_plane)
        assert files_of(root, "n") == before and not (root / "n" / "r" / "10").exists()
        assert c.stats().root_bytes == counted  # nothing written, nothing reserved
        c.gc(run="r", through_step=4)  # as the message says: room for 5 steps again
        segs = c.append(R, rows, 0, run="r", step=10)
        np.testing.assert_array_equal(c.read_field(segs, R, 0, 256, 0), rows)


def test_a_restarted_daemon_counts_what_is_on_disk_and_keeps_the_cap(
    tmp_path: Path, daemons: Daemons
) -> None:
    sock, root = tmp_path / "payloadd.sock", tmp_path / "root"
    rows = np.ones((256, 48, 8), np.uint8)
    with daemons.run("--node", "n", root=root, socket=sock), PayloadClient(sock) as c:
        segs = [c.append(R, rows, 0, run="old", step=s) for s in range(3)]
    on_disk = node_bytes(root, "n")  # three files of 96 KiB (lease tails are holes inside)
    limits = ("--max-root-bytes", str(on_disk + 1000), "--min-free-bytes", str(1 << 62))
    with daemons.run("--node", "n", *limits, root=root, socket=sock), PayloadClient(sock) as c:
        assert c.stats().root_bytes == on_disk
        counted = re.escape(f"count {format_size(on_disk, exact=True)}")
        with pytest.raises(StorageFullError, match=counted):
            c.append(R, rows, 0, run="new", step=0)  # 96 KiB: above the cap
        one = rows[:1]  # 384 bytes fit under the cap, but the floor is above any disk
        for dp in (True, False):
            with (
                PayloadClient(sock, data_plane=dp) as w,
                pytest.raises(StorageFullError, match="above the free-space floor min_free_bytes"),
            ):
                w.append(R, one, 0, run="new", step=0)
        for seg in segs:
            np.testing.assert_array_equal(c.read_field(seg, R, 0, 256, 0), rows)
        assert c.stats().appends_refused == 3
        assert not (root / "n" / "new").exists()


def test_eight_writers_three_fields_the_cap_counts_rows_and_what_leases_hold(
    tmp_path: Path,
) -> None:
    # 8 writer processes x 3 fields released by a barrier, step after step, under a 64 MiB
    # cap. Before leases started small and gave their tails back, the 24 leases of one step
    # reserved 16 MiB each: the cap was full of nothing and writers were refused at once.
    writers, fields = 8, len(FIELDS)
    acct = measure(tmp_path / "root", writers=writers, steps=3, samples=4, cap=64 << 20)
    assert acct.refused == 0
    before = 0
    for s in acct.steps:  # writers idle, connections open
        assert s.file_bytes == s.written  # no holes: the files hold the rows, no more
        assert s.root_bytes == s.file_bytes + s.reserved_bytes  # one definition
        # what the leases of the two open steps hold unwritten: about a step's rows at most
        assert s.reserved_bytes <= 2 * (s.written - before) + 2 * writers * fields * 64 * KiB
        before = s.written
    assert acct.written == acct.steps[-1].written > 0
    # writers gone: the cap's count, the files and the GC report are the rows acknowledged
    assert acct.closed_root_bytes == acct.closed_file_bytes == acct.gc_bytes == acct.written
    assert acct.after_gc_root_bytes == 0


def test_an_append_refused_a_lease_after_its_key_was_renewed_leaves_nothing_counted(
    tmp_path: Path,
    daemons: Daemons,
) -> None:
    # item 0 claims room in its key's lease; item 1, above the rotation size, asks for a
    # lease (the old one ended where item 0's claim ends), is refused, and the whole append
    # goes through a reservation: item 0's claim, never written, must not stay counted
    sock, root = tmp_path / "payloadd.sock", tmp_path / "root"
    with daemons.run("--node", "n", "--max-file-bytes", "65536", root=root, socket=sock):
        with PayloadClient(sock) as c:
            c.append(R, np.ones((1, 48, 8), np.uint8), 0, run="r", step=0)  # the key's lease
            items = [
                (R, np.full((10, 48, 8), 1, np.uint8), 10),
                (R, np.full((200, 48, 8), 2, np.uint8), 20),
            ]
            segs = c.append_many(items, run="r", step=0)
            for (_, rows, pos), s in zip(items, segs, strict=True):
                np.testing.assert_array_equal(c.read_field(s, R, pos, pos + len(rows), 0), rows)
        with PayloadClient(sock) as probe:  # the writer gone: its lease files closed
            assert probe.stats().root_bytes == node_bytes(root, "n")
