"""A refusal is counted under the limit the daemon named when it raised it
(`BusyError.reason`), not under what its message happens to say."""

from __future__ import annotations

import pytest

from payload_client import BusyError, InvalidRequestError, RequestTimeoutError
from payloadd.server._errors import refusal
from payloadd.store._budget import InFlight


def test_a_refusal_is_counted_under_its_reason_not_its_words() -> None:
    # a message that mentions the in-flight cap does not make a descriptor refusal one
    assert refusal(BusyError("max_inflight_bytes is not it", reason="descriptors")) == "descriptors"
    assert refusal(BusyError("daemon busy", reason="inflight")) == "inflight"
    assert refusal(BusyError("rebuilt from an answer")) == "descriptors"
    assert refusal(RequestTimeoutError("stalled request")) == "stalled"
    assert refusal(InvalidRequestError("no refusal")) is None
    assert refusal(ValueError("not ours")) is None


def test_the_in_flight_cap_names_its_reason() -> None:
    inflight = InFlight(cap=100)
    inflight.try_acquire(60)
    with pytest.raises(BusyError) as got:
        inflight.try_acquire(60)
    assert got.value.reason == "inflight" and refusal(got.value) == "inflight"
    assert "try again" in str(got.value)
