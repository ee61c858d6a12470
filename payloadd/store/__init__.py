"""The storage core: append-only data files under the payload root; sync, no HTTP.

`_store.Store` is the entry point; `_files` (files open for appends), `_appends` (pending
appends, leases), `_readers` (checked opens, extent reads), `_removal` and `_gc` (removal and
its rules), `_ledger` (what GC removed), `_disk_limits`, `_durability`, `_usage`, `_counts`
and `_budget` (descriptors and memory in flight) are its parts; `_records` holds what they
share. Imports nothing of `payloadd.server` or `payloadd.cli`."""

__all__: list[str] = []
