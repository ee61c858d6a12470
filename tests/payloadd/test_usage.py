"""Usage of the node's directory in the storage core (no HTTP): what `node_usage` counts,
its bounds, and the GC ledger entries it reports."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import numpy as np
import pytest

from payload_client.wire._http import AppendItem, GcRequest
from payloadd import Store
from payloadd.store._gc import GarbageCollector
from payloadd.store._ledger import LEDGER_NAME
from payloadd.store._usage import node_usage, step_usage


def append(store: Store, run: str, step: int, n: int, field: str = "f", width: int = 4) -> None:
    rows = np.arange(n * width, dtype=np.uint8).tobytes()
    store.append([AppendItem(field, "uint8", [width], n, 0, run, step)], rows)


def on_disk(path: Path) -> tuple[int, int, int, float]:
    """Files, apparent bytes, bytes on disk and newest mtime of a step directory, by os.stat."""
    stats = [os.stat(p) for p in path.iterdir()]
    return (
        len(stats),
        sum(s.st_size for s in stats),
        sum(s.st_blocks * 512 for s in stats),
        max((s.st_mtime for s in stats), default=0.0),
    )


def test_usage_counts_the_files_of_every_run_and_step(tmp_path: Path) -> None:
    store = Store(tmp_path, "n")
    append(store, "a", 0, 3)
    append(store, "a", 0, 5, field="g", width=8)
    append(store, "a", 2, 1)
    append(store, "b", 7, 1000, width=100)
    u = node_usage(store)
    assert (u.node, u.root) == ("n", str(tmp_path))
    assert [r.run for r in u.runs] == ["a", "b"]
    a, b = u.runs
    assert [s.step for s in a.steps] == [0, 2] and [s.step for s in b.steps] == [7]
    a0 = a.steps[0]
    assert (a0.files, a0.bytes) == (2, 3 * 4 + 5 * 8)  # the row bytes appended
    assert b.steps[0].bytes == 1000 * 100
    for run in u.runs:
        for s in run.steps:
            assert (s.files, s.bytes, s.disk_bytes, s.mtime) == on_disk(
                tmp_path / "n" / run.run / str(s.step)
            )
        assert run.bytes == sum(s.bytes for s in run.steps)
        assert run.disk_bytes == sum(s.disk_bytes for s in run.steps)
        assert run.mtime == max(s.mtime for s in run.steps)
    assert (u.files, u.steps, u.bytes) == (4, 3, 3 * 4 + 5 * 8 + 4 + 100_000)
    assert u.disk_bytes == a.disk_bytes + b.disk_bytes >= 100_000
    assert u.more_runs == u.more_steps == 0
    assert u.root_bytes == store.root_bytes and u.ledger == [] and u.ledger_entries == 0


def test_usage_lists_at_most_max_steps_and_counts_the_rest(tmp_path: Path) -> None:
    store = Store(tmp_path, "n")
    for run in ("a", "b", "c"):
        for step in range(3):
            append(store, run, step, 1)
    u = node_usage(store, max_steps=4)
    assert [(r.run, [s.step for s in r.steps], r.more_steps) for r in u.runs] == [
        ("a", [0, 1, 2], 0),
        ("b", [0], 2),
        ("c", [], 3),  # listed (runs are capped apart), its steps are not
    ]
    assert (u.steps, u.files, u.more_steps, u.more_runs) == (9, 9, 5, 0)
    assert all(r.files == 3 for r in u.runs)  # run totals cover unlisted steps
    u = node_usage(store, max_steps=2)
    assert [r.run for r in u.runs] == ["a", "b"] and u.more_runs == 1
    assert (u.more_steps, u.files) == (7, 9)
    u = node_usage(store, max_steps=0)
    assert (u.runs, u.more_runs, u.more_steps, u.files) == ([], 3, 9, 9)
    with pytest.raises(ValueError, match="max_steps"):
        node_usage(store, max_steps=-1)


def test_usage_follows_gc_and_reports_the_ledger(tmp_path: Path) -> None:
    store = Store(tmp_path, "n")
    collector = GarbageCollector(store)
    for step in range(4):
        append(store, "r", step, 2 + step)
    append(store, "x", 0, 1)
    before = node_usage(store)
    assert [s.step for s in before.runs[0].steps] == [0, 1, 2, 3]
    gone = sum(s.bytes for s in before.runs[0].steps[:3])
    assert gone == (2 + 3 + 4) * 4
    report = collector.collect(GcRequest("r", 2))
    assert report.bytes == gone
    collector.delete_run("x")
    after = node_usage(store)
    assert [(r.run, [s.step for s in r.steps]) for r in after.runs] == [("r", [3])]
    assert after.bytes == before.bytes - gone - 4 and after.files == 1
    assert after.ledger_entries == 2
    watermark, run = after.ledger
    assert (watermark.reason, watermark.run, watermark.steps) == ("watermark", "r", [0, 1, 2])
    assert (watermark.files, watermark.bytes) == (3, gone)
    assert (run.reason, run.run, run.steps, run.files, run.bytes) == ("run", "x", [0], 1, 4)
    assert watermark.at <= run.at <= after.now
    assert after.ledger_bytes == (tmp_path / "n" / LEDGER_NAME).stat().st_size
    (last,) = node_usage(store, ledger=1).ledger
    assert last == run
    assert node_usage(store, ledger=0).ledger == []


def test_ledger_lines_without_bytes_are_reported_as_unknown(tmp_path: Path) -> None:
    store = Store(tmp_path, "n")
    ledger = tmp_path / "n" / LEDGER_NAME
    old = {"run": "r", "reason": "ttl", "at": 1.0e9, "files": ["n/r/4/f-00000000-000001.bin"]}
    ledger.parent.mkdir()
    ledger.write_bytes(msgspec.json.encode(old) + b"\n" + b'{"run": "r", "tor')  # a torn line
    u = node_usage(store)
    (entry,) = u.ledger
    assert (entry.run, entry.reason, entry.steps, entry.files, entry.bytes) == (
        "r",
        "ttl",
        [4],
        1,
        None,
    )
    assert u.ledger_entries == 1


def test_step_usage_of_a_missing_directory_is_empty(tmp_path: Path) -> None:
    s = step_usage(tmp_path / "nope", 3)
    assert (s.step, s.files, s.bytes, s.disk_bytes, s.mtime) == (3, 0, 0, 0, 0.0)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "sub").mkdir()  # not a file
    (tmp_path / "d" / "link").symlink_to(tmp_path / "nope")  # not followed
    (tmp_path / "d" / "f").write_bytes(b"x" * 10)
    s = step_usage(tmp_path / "d", 0)
    assert (s.files, s.bytes) == (1, 10)
