"""Window reads, from a list of segments to filled outputs; no I/O.

A read goes one way: `._windows` (the request, `plan_window`, the output) -> `._checks` (the
field's checks, once a list) -> `._plan` (the planner over numpy columns; `._few` gives the
same pieces for short lists) -> `._layout` (one call's coalesced extents and their buffers,
for every transport). `._cp` splits a sequence for context parallelism on top of them.
"""
