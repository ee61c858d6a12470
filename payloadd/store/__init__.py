"""The storage core: append-only data files under the payload root; sync, no HTTP.

`_store.Store` is the entry point; `_files` (files open for appends), `_placing` (where an
append's rows go), `_appends` (pending appends, leased ranges), `_leases` (the data-plane
connections' lease files), `_generation` (the removal generation clients map), `_readers`
(checked opens, extent reads), `_removal` and `_gc` (removal and its rules), `_ledger` (what
GC removed), `_disk_limits`, `_durability`, `_usage`, `_counts`, `_budget` (descriptors and
memory in flight), `_fs_kind` (the root's file system and the rules for other nodes' files on
it) and `_prefetch` (read-ahead) are its parts; `_records` holds what they share. Imports
nothing of `payloadd.server` or `payloadd.cli`."""

__all__: list[str] = []
