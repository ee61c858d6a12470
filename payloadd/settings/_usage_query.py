"""The bound of a usage query (``GET /v1/admin/usage``): shared by the daemon, which refuses a
larger one, and ``payloadd stat``, which checks its flags against it without importing the
storage core.
"""

from __future__ import annotations

__all__ = ["MAX_USAGE_ENTRIES"]

MAX_USAGE_ENTRIES = 100_000
"""Largest ``max_steps`` (steps and runs listed) and ``ledger`` (GC ledger entries returned) a
caller of a usage query may ask for."""
