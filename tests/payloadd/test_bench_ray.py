"""The RL job on Ray's object store and on payloadd (the Ray tests only where Ray is installed)."""

from __future__ import annotations

import os
import sys

import pytest

from payloadd.bench._ray import PAYLOADD, RAY, bench_ray, ray_available
from payloadd.bench._rl_batch import RLBatch
from tests.conftest import Daemon


def test_ray_available_says_how_to_install_ray_when_it_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    assert ray_available() == "ray is not installed: pip install 'payloadd[ray]'"


def _ray_for_tests() -> None:
    """Ray starts servers on every network interface: its tests run only when asked to."""
    if os.environ.get("PAYLOADD_TEST_RAY") != "1":
        pytest.skip("Ray listens on every interface; set PAYLOADD_TEST_RAY=1 to run it")
    pytest.importorskip("ray")


def test_ray_available_is_none_when_ray_imports() -> None:
    pytest.importorskip("ray")
    assert ray_available() is None


def test_bench_ray_times_both_systems_and_their_outputs_match(daemon: Daemon) -> None:
    _ray_for_tests()
    spec = RLBatch(samples=4, tokens=2048, turns=4, seq_len=4096)
    times = bench_ray(spec, daemon.socket, 1)  # raises if any rank's outputs differ
    assert list(times) == [RAY, PAYLOADD]
    for seconds in times.values():
        assert len(seconds) == 1 and seconds[0] > 0
