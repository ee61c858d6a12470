"""Fail closed under production conditions: data-plane clients that hold leases, collections
and deletions racing them, a torn record, refusals that must fix nothing.

Each test is a race or an edge a review found where a wrong row was stored or a refusal
fixed a shape; real daemons, clients released together.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from payload_client import (
    AsyncPayloadClient,
    InvalidRequestError,
    PayloadClient,
    PayloadError,
    StepCollectedError,
    StorageFullError,
)

from ..conftest import Daemons, default_env

RE, MASK = "routed_experts", "sampling_mask"


def _ids(n: int, shape: tuple[int, ...] = (48, 8), value: int = 1) -> np.ndarray:
    return np.full((n, *shape), value, np.uint8)


def _run() -> str:
    return f"race-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def sock(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with Daemons(tmp_path_factory.mktemp("races")) as d:
        yield d.start("--node", "n0", env=default_env()).socket


def test_one_client_s_concurrent_appends_of_two_shapes_store_one(sock: Path) -> None:
    """Two appends of one async client into a new run at once: the second must not ride the
    first one's lease with rows of another shape."""

    async def both(run: str) -> Sequence[object]:
        async with AsyncPayloadClient(sock) as c:
            got = await asyncio.gather(
                c.append(RE, _ids(2), 0, run=run, step=0),
                c.append(RE, _ids(2, (8, 48)), 2, run=run, step=0),
                return_exceptions=True,
            )
        return got

    for _ in range(10):
        got = asyncio.run(both(_run()))
        stored = [g for g in got if isinstance(g, list)]
        assert len(stored) == 1, got
        (refused,) = [g for g in got if not isinstance(g, list)]
        assert isinstance(refused, InvalidRequestError) and "got [" in str(refused)


def test_a_collection_racing_leases_leaves_no_file_and_takes_no_later_append(
    sock: Path,
) -> None:
    """Data-plane clients take their first lease of step 0 while ``gc(through_step=1)``
    runs: once gc returned, the step has no file, and no append into it is acknowledged."""
    run, n = _run(), 24
    with PayloadClient(sock, data_plane=False) as admin:
        admin.append(RE, _ids(1), 0, run=run, step=1)
        clients = [PayloadClient(sock) for _ in range(n)]
        try:
            for c in clients:
                c.append(RE, _ids(1), 0, run=_run(), step=0)  # connected, fields known
            go = threading.Barrier(3)
            errors: list[BaseException] = []

            def writer(cs: list[PayloadClient]) -> None:
                go.wait(30)
                for c in cs:
                    time.sleep(0.0005)
                    try:
                        c.append(RE, _ids(1, value=3), 0, run=run, step=0)
                    except StepCollectedError:
                        continue  # after the watermark: refused, as it must be
                    except BaseException as exc:  # pragma: no cover - reported below
                        errors.append(exc)

            threads = [threading.Thread(target=writer, args=(clients[i::2],)) for i in range(2)]
            for t in threads:
                t.start()
            go.wait(30)
            time.sleep(0.005)
            admin.gc(run=run, through_step=1)
            for t in threads:
                t.join(60)
            assert not errors, errors
            assert not list((sock.parent / "root" / "n0" / run).glob("0/*.bin"))
            for c in clients:  # their leases (if any) are gone with the step
                with pytest.raises(StepCollectedError):
                    c.append(RE, _ids(1, value=9), 7, run=run, step=0)
        finally:
            for c in clients:
                c.close()


def test_refused_data_plane_appends_fix_no_shape(tmp_path: Path, daemons: Daemons) -> None:
    cap = ("--max-root-bytes", "200000", "--min-free-bytes", "0")
    s = tmp_path / "s.sock"
    with daemons.run(*cap, socket=s, env=default_env()), PayloadClient(s) as c:
        late, full = _run(), _run()
        c.gc(run=late, through_step=5)
        with pytest.raises(StepCollectedError):
            c.append(RE, _ids(1, (8, 48)), 0, run=late, step=3)
        assert c.append(RE, _ids(1), 0, run=late, step=6)[0].shape == [48, 8]
        with pytest.raises(StorageFullError):
            c.append(RE, _ids(781, (8, 48)), 0, run=full, step=0)
        assert c.append(RE, _ids(1), 0, run=full, step=0)[0].shape == [48, 8]


def test_a_client_s_old_shapes_do_not_fix_a_deleted_run_s(sock: Path) -> None:
    """After ``delete_run``, leases a client asks ahead of need carry the shapes it knew of
    the old run: they fix nothing, so the new run's first append of a field fixes its own."""
    run = _run()
    with PayloadClient(sock) as a, PayloadClient(sock, data_plane=False) as b:
        mask = np.ones((4, 16), np.int32)
        a.append_many([(RE, _ids(4), 0), (MASK, mask, 0)], run=run, step=0)
        b.delete_run(run)
        a.append(MASK, np.ones((4, 32), np.int32), 0, run=run, step=1)  # asks RE ahead
        b.append(RE, _ids(4, (8, 48)), 0, run=run, step=1)  # the new run's first RE
        with pytest.raises(InvalidRequestError, match=r"\[8, 48\].*got \[48, 8\]"):
            a.append(RE, _ids(4), 4, run=run, step=1)


def test_a_torn_shape_record_keeps_the_next_one_after_a_restart(
    tmp_path: Path, daemons: Daemons
) -> None:
    root, s = tmp_path / "root", tmp_path / "s.sock"
    env = default_env()
    with daemons.run("--node", "n0", root=root, socket=s, env=env), PayloadClient(s) as c:
        c.append(RE, _ids(1), 0, run="r0", step=0)
    record = root / "n0" / "@run-shapes.jsonl"
    record.write_bytes(record.read_bytes()[:-8])  # a crash in the middle of its line
    with daemons.run("--node", "n0", root=root, socket=s, env=env), PayloadClient(s) as c:
        c.append(RE, _ids(1), 0, run="r1", step=0)
    assert record.read_bytes().endswith(b'\n["r1","routed_experts",[48,8]]\n')  # own line
    with daemons.run("--node", "n0", root=root, socket=s, env=env):
        for dp in (True, False):
            with PayloadClient(s, data_plane=dp) as c, pytest.raises(InvalidRequestError):
                c.append(RE, _ids(1, (8, 48)), 1, run="r1", step=0)


def test_deleting_a_gone_node_s_run_forgets_its_shapes(tmp_path: Path, daemons: Daemons) -> None:
    root, env = tmp_path / "root", default_env()
    a, b = tmp_path / "a.sock", tmp_path / "b.sock"
    with daemons.run("--node", "b", root=root, socket=b, env=env), PayloadClient(b) as c:
        c.append(RE, _ids(1), 0, run="r", step=0)
    with daemons.run("--node", "a", root=root, socket=a, env=env), PayloadClient(a) as c:
        assert c.delete_run("r", node="b").files == 1  # b is gone: a deletes its run
    with daemons.run("--node", "b", root=root, socket=b, env=env), PayloadClient(b) as c:
        try:  # b back: a new run of the name fixes its own shape
            assert c.append(RE, _ids(1, (8, 48)), 0, run="r", step=0)[0].shape == [8, 48]
        except PayloadError as exc:  # pragma: no cover - the failure said plainly
            pytest.fail(f"the deleted run's shape stayed fixed: {exc}")
