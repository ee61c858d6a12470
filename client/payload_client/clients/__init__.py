"""The clients: `BaseClient` decides, without I/O; the sync and async shells only do I/O.

- `._base`: `BaseClient`, building calls, choosing the transport, deciding retries.
- `._plans`: `plan_reads`, a read's windows planned before any I/O (every client's).
- `._shells`: the effects an operation yields, and how each kind of client runs them
  (`Blocking`, `Awaiting`); `Dual`, `op`: one operation, a method of both kinds.
- `._reads`, `._ops`: every public method, written once as an I/O-free operation.
- `._sync`, `._async`: `PayloadClient`, `AsyncPayloadClient`.
- `._cluster`: `ClusterClient`, `AsyncClusterClient`, one plan split by node.
- `._ready`: waiting for a daemon that is starting.
"""
