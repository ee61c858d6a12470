"""Garbage collection in the storage core: the rules, the ledger, what is never removed."""

from __future__ import annotations

import contextlib
import os
import stat
import time
from pathlib import Path

import numpy as np
import pytest

from payload_client import (
    FileGoneError,
    FileMissingError,
    InvalidRequestError,
    PayloadSegment,
    StepCollectedError,
    StorageFullError,
)
from payload_client.wire._http import AppendItem, Extent, GcRequest
from payloadd import Store
from payloadd.store._gc import GarbageCollector
from payloadd.store._ledger import LEDGER_NAME


def item(rows: int, run: str = "r", step: int = 0, field: str = "f") -> AppendItem:
    return AppendItem(field, "uint8", [4], rows, 0, run, step)


def rows(n: int, seed: int) -> bytes:
    return (np.arange(n * 4, dtype=np.uint8) + seed).tobytes()


def append(store: Store, run: str, step: int, n: int = 3, field: str = "f") -> PayloadSegment:
    (segs,) = store.append([item(n, run, step, field)], rows(n, step))
    return segs[0]


def read(store: Store, s: PayloadSegment) -> bytes:
    return bytes(store.read_extents([Extent(s.file, s.offset, s.rows * 4, s.offset + s.rows * 4)]))


def open_files() -> list[str]:
    """Targets of this process's descriptors (a removed file shows as '... (deleted)')."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):  # the listing's own descriptor
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
    return out


def steps_on_disk(store: Store, run: str) -> list[int]:
    return store.runs().get(run, [])


def test_watermark_removes_steps_up_to_it_and_reads_then_answer_gone(tmp_path: Path) -> None:
    store = Store(tmp_path, "n")
    segs = {step: append(store, "r1", step) for step in range(5)}
    other = append(store, "r2", 1)
    report = GarbageCollector(store).collect(GcRequest(run="r1", through_step=2))
    assert report.steps == [("r1", 0), ("r1", 1), ("r1", 2)]
    assert (report.files, report.bytes, report.by_reason["watermark"].files) == (3, 36, 3)
    assert report.dirs == 3  # the three step directories
    assert steps_on_disk(store, "r1") == [3, 4]
    for step in (0, 1, 2):
        with pytest.raises(FileGoneError, match=rf"step {step} of run 'r1' was garbage-collected"):
            read(store, segs[step])
    assert read(store, segs[3]) == rows(3, 3)
    assert read(store, other) == rows(3, 1)  # another run is untouched


def test_a_file_that_never_existed_is_404_not_410(tmp_path: Path) -> None:
    store = Store(tmp_path, "n")
    seg = append(store, "r", 0)
    GarbageCollector(store).collect(GcRequest(run="r", through_step=0))
    with pytest.raises(FileGoneError):  # the collected file
        store.open_for_read(seg.file, 1)
    for never in (
        "n/r/0/f-00000000-000099.bin",  # in the collected step, but never written
        "n/r/7/f-00000000-000001.bin",  # a step never collected
        "n/q/0/f-00000000-000001.bin",  # another run
    ):
        with pytest.raises(FileMissingError):
            store.open_for_read(never, 1)


def test_the_ledger_survives_a_restart_and_a_torn_last_line(tmp_path: Path) -> None:
    store = Store(tmp_path, "n")
    seg = append(store, "r", 3)
    GarbageCollector(store).collect(GcRequest(run="r", through_step=5))
    store.close()
    with open(tmp_path / "n" / LEDGER_NAME, "ab") as f:
        f.write(b'{"run": "r", "fir')  # a crash while the ledger was written
    again = Store(tmp_path, "n")
    with pytest.raises(FileGoneError, match="step 3 of run 'r'"):
        read(again, seg)


def test_dry_run_reports_the_same_and_removes_nothing(tmp_path: Path) -> None:
    store = Store(tmp_path, "n")
    segs = [append(store, "r", step) for step in range(3)]
    dry = GarbageCollector(store).collect(GcRequest(run="r", through_step=1, dry_run=True))
    assert dry.dry_run and (dry.files, dry.bytes, dry.steps) == (2, 24, [("r", 0), ("r", 1)])
    assert [read(store, s) for s in segs] == [rows(3, i) for i in range(3)]
    assert not (tmp_path / "n" / LEDGER_NAME).exists()  # nothing collected: no 410 either
    real = GarbageCollector(store).collect(GcRequest(run="r", through_step=1))
    assert (real.files, real.bytes, real.steps) == (dry.files, dry.bytes, dry.steps)


def test_a_file_being_appended_to_is_kept_until_its_append_is_done(tmp_path: Path) -> None:
    store = Store(tmp_path, "n")
    done = append(store, "r", 0)
    pending = store.begin_append([item(2, "r", 0)])  # same file, rows not written yet
    report = GarbageCollector(store).collect(GcRequest(run="r", through_step=0))
    assert (report.files, report.in_use) == (0, 1)
    assert read(store, done) == rows(3, 0)
    pending.write(rows(2, 9))
    (segs,) = pending.commit()
    assert read(store, segs[0]) == rows(2, 9)  # the append went through whole
    report = GarbageCollector(store).collect(GcRequest(run="r", through_step=0))
    assert (report.files, report.in_use, steps_on_disk(store, "r")) == (1, 0, [])


def test_later_appends_to_a_collected_step_are_refused_storing_nothing(tmp_path: Path) -> None:
    store = Store(tmp_path, "n")
    append(store, "r", 0)
    GarbageCollector(store).collect(GcRequest(run="r", through_step=0))
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(StepCollectedError, match=r"step 0 of run 'r'.*through step 0"):
        append(store, "r", 0)  # a late writer
    with pytest.raises(StepCollectedError):
        store.lease("r", 0, "f", 100, 1000, owner=1)  # the data plane's way in
    assert store.lease_ahead("r", 0, "f", 0, 1000, owner=1) is None
    assert sorted(tmp_path.rglob("*")) == before  # no file, no directory
    assert read(store, append(store, "r", 1)) == rows(3, 1)  # later steps take appends
    for s in (store, Store(tmp_path, "n")):  # now and after a restart
        with pytest.raises(StepCollectedError):
            append(s, "r", 0)


def test_a_step_the_age_rule_removed_takes_later_appends_in_a_new_file(tmp_path: Path) -> None:
    store = Store(tmp_path, "n")
    old = append(store, "r", 0)
    past = time.time() - 100
    os.utime(tmp_path / old.file, (past, past))
    store.last_used["r"] = time.monotonic() - 100  # idle as long
    report = GarbageCollector(store).collect(GcRequest(ttl_s=50))
    assert report.by_reason["ttl"].files == 1 and not (tmp_path / old.file).exists()
    new = append(store, "r", 0)  # no watermark: the step takes appends again
    assert new.file != old.file and read(store, new) == rows(3, 0)


def test_a_leased_file_is_collected(tmp_path: Path) -> None:
    store = Store(tmp_path, "n")
    lease = store.lease("r", 0, "f", 100, 1000, owner=1)
    report = GarbageCollector(store).collect(GcRequest(run="r", through_step=0))
    assert (report.files, report.in_use) == (1, 0)  # the client re-checks after writing
    assert not (tmp_path / lease.file).exists()
    assert lease.file not in " ".join(open_files())  # the store let go of its space at once
    lease.release()
    with pytest.raises(StepCollectedError):  # the client's next lease of the step
        store.lease("r", 0, "f", 100, 1000, owner=1)
    assert append(store, "r", 1).file != lease.file


def test_delete_run_removes_every_step_and_the_run_directory(tmp_path: Path) -> None:
    store = Store(tmp_path, "n")
    segs = [append(store, "r", step) for step in (0, 5, 9)]
    keep = append(store, "q", 0)
    report = GarbageCollector(store).delete_run("r")
    assert (report.files, report.by_reason["run"].files, report.dirs) == (3, 3, 4)
    assert not (tmp_path / "n" / "r").exists()
    for s in segs:
        with pytest.raises(FileGoneError, match="garbage-collected \\(run"):
            read(store, s)
    assert read(store, keep) == rows(3, 0)
    with pytest.raises(InvalidRequestError, match="run"):
        GarbageCollector(store).delete_run("../x")


def test_bad_requests_are_refused(tmp_path: Path) -> None:
    c = GarbageCollector(Store(tmp_path, "n"))
    with pytest.raises(InvalidRequestError, match="go together"):
        c.collect(GcRequest(run="r"))
    with pytest.raises(InvalidRequestError, match="go together"):
        c.collect(GcRequest(through_step=3))
    with pytest.raises(InvalidRequestError, match="run"):
        c.collect(GcRequest(run="a/b", through_step=3))


def test_orphans_of_a_crashed_daemon_and_empty_directories_go(tmp_path: Path) -> None:
    crashed = Store(tmp_path, "n")
    kept = append(crashed, "r", 0)
    crashed.begin_append([item(2, "r", 1)])  # a file created, its rows never written
    (tmp_path / "n" / "r" / "7").mkdir()  # an empty step directory
    (tmp_path / "n" / "r" / "0" / "notes.txt").write_text("not a data file")
    # the daemon died: a new one starts on the same root
    store = Store(tmp_path, "n")
    own = store.lease("r", 2, "f", 10, 10, owner=1)  # this daemon's empty file is not an orphan
    report = GarbageCollector(store, ttl_s=0).collect(GcRequest())
    assert report.by_reason["orphan"].files == 1 and report.steps == []
    assert sorted(os.listdir(tmp_path / "n" / "r")) == ["0", "2"]  # step 1 and 7 went
    assert read(store, kept) == rows(3, 0)
    assert (tmp_path / "n" / "r" / "0" / "notes.txt").exists()  # not ours: never touched
    assert (tmp_path / own.file).exists()


def test_ttl_removes_old_steps_of_idle_runs_only(tmp_path: Path) -> None:
    store = Store(tmp_path, "n")
    old = [append(store, "idle", step) for step in (0, 1)]
    fresh = append(store, "idle", 2)
    busy = append(store, "busy", 0)
    hour_ago = time.time() - 3600
    for s in (*old, busy):
        os.utime(tmp_path / s.file, (hour_ago, hour_ago))
    collector = GarbageCollector(store, ttl_s=60)
    # the daemon itself started just now: no run counts as idle yet
    assert collector.collect(GcRequest()).files == 0
    store.started -= 120
    store.last_used.clear()  # nothing used in the last two minutes...
    assert collector.collect(GcRequest(ttl_s=0)).files == 0  # 0: no age rule in this call
    os.close(store.open_for_read(busy.file, 1))  # ...but busy is being read
    report = collector.collect(GcRequest())
    assert report.steps == [("idle", 0), ("idle", 1)]
    assert report.by_reason["ttl"].files == 2
    assert read(store, fresh) == rows(3, 2) and read(store, busy) == rows(3, 0)
    with pytest.raises(FileGoneError, match="ttl"):
        read(store, old[0])
    # a request's own TTL overrides the setting (0 in the settings: no age rule)
    store.last_used.clear()
    os.utime(tmp_path / fresh.file, (hour_ago, hour_ago))
    assert GarbageCollector(store, ttl_s=0).collect(GcRequest()).files == 0
    assert GarbageCollector(store, ttl_s=0).collect(GcRequest(ttl_s=60)).steps == [
        ("busy", 0),
        ("idle", 2),
    ]


def test_collected_bytes_no_longer_count_against_the_cap(tmp_path: Path) -> None:
    store = Store(tmp_path, "n", max_root_bytes=100)
    append(store, "r", 0, n=20)  # 80 bytes
    with pytest.raises(StorageFullError, match="max_root_bytes"):
        append(store, "r", 1, n=10)
    lease = store.lease("r", 2, "f", 8, 8, owner=1)  # 88 with a lease
    report = GarbageCollector(store).collect(GcRequest(run="r", through_step=2))
    assert report.files == 2 and store.root_bytes == 0
    assert read(store, append(store, "r", 3, n=20)) == rows(20, 3)  # room again
    lease.release()
    assert store.root_bytes == 80


def test_files_created_after_a_collection_is_planned_stay(tmp_path: Path) -> None:
    store = Store(tmp_path, "n")
    old = append(store, "r", 0)
    planned = store.step_files("r", 0)
    new = append(store, "r", 0, field="g")  # a writer starts a new file meanwhile
    removal = store.remove_step("r", 0, planned)
    assert [rel for rel, _ in removal.files] == [old.file]
    assert read(store, new) == rows(3, 0)


def test_the_sweep_recounts_files_removed_by_hand(tmp_path: Path) -> None:
    store = Store(tmp_path, "n", max_root_bytes=1000)
    seg = append(store, "r", 0, n=50)  # 200 bytes
    store.close()  # a restart: the new store counts what is on disk
    store = Store(tmp_path, "n", max_root_bytes=1000)
    assert store.root_bytes == 200
    os.unlink(tmp_path / seg.file)  # an operator removes it by hand
    assert store.root_bytes == 200
    GarbageCollector(store, ttl_s=0).sweep()
    assert store.root_bytes == 0


def test_a_collection_after_a_torn_ledger_line_still_answers_gone(tmp_path: Path) -> None:
    store = Store(tmp_path, "n")
    seg = append(store, "r", 1)
    with open(tmp_path / "n" / LEDGER_NAME, "ab") as f:
        f.write(b'{"run": "r", "fir')  # a crash while the ledger was written
    GarbageCollector(store).collect(GcRequest(run="r", through_step=1))  # the next collection
    for s in (store, Store(tmp_path, "n")):  # now and after a restart
        with pytest.raises(FileGoneError, match="step 1 of run 'r'"):
            read(s, seg)


def test_a_collection_that_removes_nothing_adds_no_ledger_line(tmp_path: Path) -> None:
    store = Store(tmp_path, "n")
    append(store, "r", 0)
    c = GarbageCollector(store)
    c.collect(GcRequest(run="r", through_step=0))
    c.collect(GcRequest(run="never", through_step=9))  # a watermark over no step: one line
    ledger = (tmp_path / "n" / LEDGER_NAME).read_bytes()
    # r: its watermark (written first), the files it removed, that they went; never: its
    # watermark
    assert ledger.count(b"\n") == 4 and b'"through":9' in ledger
    for _ in range(20):  # a trainer repeating its watermark, an operator deleting twice
        assert c.collect(GcRequest(run="r", through_step=0)).files == 0
        assert c.collect(GcRequest(run="never", through_step=9)).files == 0
        assert c.delete_run("never").files == 0
    assert (tmp_path / "n" / LEDGER_NAME).read_bytes() == ledger


@pytest.mark.parametrize("name", ["²", "٣", "007"])
def test_odd_step_directories_and_paths_are_no_steps(tmp_path: Path, name: str) -> None:
    store = Store(tmp_path, "n")
    seg = append(store, "r", 0)
    (tmp_path / "n" / "r" / name).mkdir()  # made by hand, or by another program
    report = GarbageCollector(store).collect(GcRequest(run="r", through_step=0))
    assert report.steps == [("r", 0)]  # collection goes on
    with pytest.raises(FileGoneError):
        read(store, seg)
    with pytest.raises(FileMissingError):  # not a step: a 404, never a crash (500)
        store.open_for_read(f"n/r/{name}/f-00000000-000001.bin", 1)


def test_the_age_rule_adds_no_ledger_line_for_a_step_it_keeps(tmp_path: Path) -> None:
    store = Store(tmp_path, "n")
    append(store, "r", 0)
    pending = store.begin_append([item(2, "r", 0)])  # a stalled append keeps the file
    hour_ago = time.time() - 3600
    for f in (tmp_path / "n" / "r" / "0").iterdir():
        os.utime(f, (hour_ago, hour_ago))
    store.started -= 120
    store.last_used.clear()
    c = GarbageCollector(store, ttl_s=60)
    for _ in range(5):  # every sweep of the day
        report = c.collect(GcRequest())
        assert (report.files, report.in_use) == (0, 1)
    assert not (tmp_path / "n" / LEDGER_NAME).exists()  # nothing collected: no 410 either
    pending.close()
    assert c.collect(GcRequest()).steps == [("r", 0)]
    lines = (tmp_path / "n" / LEDGER_NAME).read_bytes().splitlines()
    assert len(lines) == 2 and b'"done":0' in lines[1]  # its line, and that it was done


def test_the_ledger_and_its_directory_get_exact_modes_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        store = Store(tmp_path / "root", "n")
        GarbageCollector(store)  # a daemon starts: the spare file beside the ledger is made
        node = tmp_path / "root" / "n"
        assert stat.S_IMODE(node.stat().st_mode) == 0o750
        append(store, "r", 0)
        GarbageCollector(store).collect(GcRequest(run="r", through_step=0))
        for p in node.iterdir():
            assert stat.S_IMODE(p.lstat().st_mode) == 0o640, p.name
    finally:
        os.umask(old)


def test_runs_in_use_are_remembered_only_while_they_exist(tmp_path: Path) -> None:
    store = Store(tmp_path, "n")
    append(store, "r", 0)
    store.touch("no-such-run")  # a client's note naming a run that is not here
    store.touch("../../etc")
    assert set(store.last_used) == {"r"}
    GarbageCollector(store).delete_run("r")
    GarbageCollector(store, ttl_s=0).sweep()
    assert store.last_used == {}


def test_reads_of_made_up_nodes_keep_no_ledger(tmp_path: Path) -> None:
    store = Store(tmp_path, "n")
    for k in range(50):  # a client asking for files of nodes that never wrote here
        with pytest.raises(FileMissingError):
            store.open_for_read(f"node{k}/r/0/f-00000000-000001.bin", 1)
    assert set(store.reads._ledgers) <= {"n"}


def test_another_nodes_prefix_only_when_told_and_never_against_the_cap(tmp_path: Path) -> None:
    a, b = Store(tmp_path, "a"), Store(tmp_path, "b")
    theirs = {step: append(b, "r", step) for step in range(3)}
    mine = append(a, "r", 0)
    used = a.root_bytes
    collect = GarbageCollector(a, ttl_s=1e-9)  # its own node: anything idle goes
    time.sleep(0.01)
    assert collect.collect(GcRequest("r", 5)).steps == [("r", 0)]  # a's own step only
    assert all(read(b, s) for s in theirs.values())
    report = collect.collect(GcRequest("r", 0, node="b"))  # no age rule, no orphans there
    assert report.steps == [("r", 0)] and set(report.by_reason) == {"watermark"}
    assert a.root_bytes == used - 12  # only a's own step counted off
    with pytest.raises(FileGoneError, match="step 0 of run 'r'"):
        read(a, theirs[0])
    assert b.ledger().find(theirs[0].file) is not None  # b's ledger, read by b too
    assert a.ledger().find(theirs[0].file) is None
    solo = append(b, "solo", 0)
    report = collect.collect(GcRequest("solo", 0, node="b"))
    assert report.dirs == 2 and not (tmp_path / "b" / "solo").exists()  # step and run
    with pytest.raises(FileGoneError):
        read(b, solo)
    assert collect.delete_run("r", node="b").steps == [("r", 1), ("r", 2)]
    assert not (tmp_path / "b" / "r").exists()
    with pytest.raises(FileGoneError, match=r"\(run,"):
        read(b, theirs[2])
    with pytest.raises(InvalidRequestError, match="needs run and through_step, or ttl_s"):
        collect.collect(GcRequest(node="b"))
    with pytest.raises(InvalidRequestError, match="node"):
        collect.delete_run("r", node="..")
    with pytest.raises(FileGoneError):
        read(a, mine)


def test_the_ledger_keeps_no_path_in_memory_and_reads_only_what_was_appended(
    tmp_path: Path,
) -> None:
    import tracemalloc

    import msgspec

    from payloadd.store._ledger import Collected, Ledger

    path = tmp_path / "n" / LEDGER_NAME
    path.parent.mkdir()
    steps, per_step = 1000, 50  # 50,000 collected files
    with open(path, "wb") as f:
        for step in range(steps):
            files = [
                f"n/r/{step}/f-00000000-{step * per_step + k:06d}.bin" for k in range(per_step)
            ]
            f.write(msgspec.json.encode(Collected("r", "watermark", 1.0, files, 1)) + b"\n")
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        ledger = Ledger(path)
        hit = ledger.find("n/r/500/f-00000000-025007.bin")
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert hit is not None and hit.run == "r"
    assert held < 1 << 20, held  # not 50,000 paths (several MB): an index of lines by step
    assert ledger.find("n/r/500/f-00000000-999999.bin") is None  # in a collected step, never listed
    assert ledger.find("n/r/5000/f-00000000-000001.bin") is None  # a step never collected
    with open(path, "ab") as f:  # a torn line, then another daemon's next collection
        f.write(b'{"run": "r", "reas')
    assert ledger.find("n/r/7000/f-00000000-000001.bin") is None
    ledger.record("r", "watermark", ["n/r/7000/f-00000000-000001.bin"], 1)
    assert ledger.find("n/r/7000/f-00000000-000001.bin") is not None
    entries, total = ledger.recent(2)
    assert total == steps + 1 and [e.files[0].split("/")[2] for e in entries] == ["999", "7000"]
    path.write_bytes(b"")  # replaced: the index starts over
    assert ledger.find("n/r/500/f-00000000-025007.bin") is None
