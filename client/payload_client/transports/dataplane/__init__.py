"""The data plane: row bytes through file descriptors the daemon passes over ``<socket>.data``.

- `._transport`: `SyncDataPlane`, `AsyncDataPlane`, the connection and its shells.
- `._steps`: the operations as I/O-free steps (reads, the fields table, notes).
- `._appends`: appends, leases and their commits, as steps.
- `._descriptors`: the caches of descriptors, scratch buffers and leases.
"""
