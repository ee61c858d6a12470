"""Coverage of a window (which rows are real, which are fill), against the dense model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from payload_client import (
    ConnectError,
    CoveredRead,
    InvalidRequestError,
    PayloadClient,
    PayloadSegment,
    Window,
    coverage,
    plan_window,
)
from tests.client.test_read import FIELDS, local_read, stored
from tests.conftest import Daemons
from tests.reference import dense_coverage, dense_read


def seg(pos: int, rows: int, field: str = "m", width: int = 1) -> PayloadSegment:
    return PayloadSegment(field, "a.bin", 0, pos, rows, "int32", [width])


def covered_of(segs: list[PayloadSegment], field: str, lo: int, hi: int) -> np.ndarray:
    got = coverage(plan_window(segs, field, lo, hi, 0), lo, hi)
    want = dense_coverage(segs, field, lo, hi)
    assert got.dtype == np.bool_ and got.shape == (hi - lo,)
    np.testing.assert_array_equal(got, want)
    return got


def test_overlapping_segments_cover_their_union_whoever_wins() -> None:
    segs = [seg(2, 3), seg(4, 3, width=2), seg(3, 1)]  # later ones win rows 3, 4
    got = covered_of(segs, "m", 0, 9)
    assert got.tolist() == [False, False, True, True, True, True, True, False, False]


def test_a_straddling_window_marks_only_its_own_positions() -> None:
    segs = [seg(0, 4), seg(8, 4)]
    assert covered_of(segs, "m", 2, 10).tolist() == [True, True] + [False] * 4 + [True, True]
    assert covered_of(segs, "m", 4, 8).tolist() == [False] * 4  # the gap between them


def test_empty_windows_and_placeholders_cover_nothing() -> None:
    assert covered_of([seg(0, 4)], "m", 2, 2).shape == (0,)
    placeholder = seg(1, 0, width=5)  # keeps the field present, holds no row
    assert not covered_of([placeholder], "m", 0, 3).any()
    assert covered_of([placeholder, seg(2, 1)], "m", 0, 3).tolist() == [False, False, True]


def test_other_fields_do_not_count_and_an_absent_field_covers_nothing() -> None:
    assert covered_of([seg(0, 3, field="x"), seg(1, 1)], "m", 0, 3).tolist() == [0, 1, 0]
    none = coverage(plan_window([seg(0, 3, field="x")], "m", 0, 3, 0), 0, 3)
    assert none.tolist() == [False, False, False]


def test_coverage_is_a_fresh_array_each_time() -> None:
    plan = plan_window([seg(0, 3)], "m", 0, 3, 0)
    a, b = coverage(plan, 0, 3), coverage(plan, 0, 3)
    assert a.flags.writeable and not np.shares_memory(a, b)


def test_a_bad_window_is_a_clear_error() -> None:
    with pytest.raises(InvalidRequestError, match="lo <= hi"):
        coverage(None, 3, 2)


@given(stored(), st.sampled_from(sorted(FIELDS)), st.integers(0, 40), st.integers(0, 12))
def test_coverage_matches_dense_model_and_marks_exactly_the_non_fill_rows(
    data: tuple[dict[str, bytes], list[PayloadSegment]], field: str, lo: int, n: int
) -> None:
    files, segs = data
    hi = lo + n
    got = coverage(plan_window(segs, field, lo, hi, 0), lo, hi)
    np.testing.assert_array_equal(got, dense_coverage(segs, field, lo, hi))
    # an uncovered row is all fill, whichever fill is chosen; a covered row is the data's
    for fill in (-7, 9):
        arr = local_read(files, segs, field, lo, hi, fill)
        assert arr is None or arr.shape[0] == n
        if arr is not None:
            np.testing.assert_array_equal(arr, dense_read(files, segs, field, lo, hi, fill))
            assert (arr[~got] == fill).all()


# -- the clients' API, before any I/O ---------------------------------------------------


@pytest.fixture
def offline(tmp_path: Path, daemons: Daemons) -> Iterator[PayloadClient]:
    """A client whose daemon is gone after its first read, which fetched the daemon's fields
    table (once, as every client's first read does): any I/O now would raise ConnectError."""
    sock = tmp_path / "payloadd.sock"
    with PayloadClient(sock) as c:
        with daemons.run(socket=sock):
            assert c.read_field([], "f", 0, 0, 0) is None  # no segment of a table field
        yield c


def test_a_first_read_fetches_the_fields_table_even_without_bytes(tmp_path: Path) -> None:
    s = PayloadSegment("f", "a.bin", 0, 10, 1, "uint8", [3])
    with PayloadClient(tmp_path / "nobody.sock") as c:
        for _ in range(2):  # not kept when it failed
            with pytest.raises(ConnectError, match="no payloadd listening on"):
                c.read_field([s], "f", 0, 5, -1, coverage=True)  # no row intersects


def test_reads_without_bytes_return_coverage_without_io(offline: PayloadClient) -> None:
    s = PayloadSegment("f", "a.bin", 0, 10, 1, "uint8", [3])
    absent = offline.read_field([s], "a", 0, 5, 0, coverage=True)  # no segment of it
    assert isinstance(absent, CoveredRead) and absent.array is None
    assert absent.covered.tolist() == [False] * 5
    arr, covered = offline.read_field([s], "f", 0, 5, -1, coverage=True)  # no row intersects
    assert arr is not None and arr.shape == (5, 3) and (arr == -1).all()
    assert covered.dtype == np.bool_ and not covered.any()
    plain = offline.read_field([s], "f", 0, 5, -1)
    assert isinstance(plain, np.ndarray)


@pytest.mark.parametrize("bad", [None, 1, "yes"])
def test_coverage_must_be_a_bool(offline: PayloadClient, bad: object) -> None:
    s = PayloadSegment("f", "a.bin", 0, 10, 1, "uint8", [3])
    with pytest.raises(InvalidRequestError, match="window 1: coverage must be True or False"):
        offline.read_many(
            [Window([s], "f", 0, 5, 0), Window([s], "f", 0, 5, 0, coverage=bad)],  # type: ignore[arg-type]
            coverage=None,
        )


def test_plain_tuples_take_coverage_as_their_eighth_item(offline: PayloadClient) -> None:
    s = PayloadSegment("f", "a.bin", 0, 10, 1, "uint8", [3])
    eight = ([s], "f", 0, 4, 0, None, None, True)
    got = offline.read_many([eight, ([s], "f", 0, 4, 0)], coverage=None)  # type: ignore[list-item]
    assert isinstance(got[0], CoveredRead) and not got[0].covered.any()
    assert isinstance(got[1], np.ndarray)
    (numpy_bool,) = offline.read_many(
        [Window([s], "f", 0, 4, 0, coverage=np.True_)],  # type: ignore[arg-type]
        coverage=None,
    )
    assert isinstance(numpy_bool, CoveredRead) and numpy_bool.covered.shape == (4,)
