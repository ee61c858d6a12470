"""The segment model and its pure operations: what an orchestrator needs, with no I/O.

- `._segment`: `PayloadSegment`, its checks (`validate_segment`), row sizes, names.
- `._columns` (checks in `._columns_check`): `SegmentList`, a validated list as numpy columns.
- `._ops`: `clip_segments`, `shift_segments`, `merge_pd_segments` on lists of either form.
- `._router`: prefill/decode stitching of whole generate responses.
- `._codec`: `encode_segments` / `decode_segments` / `decode_columns`, the lists' wire forms.
- `._dtypes`: the output dtype and fill of a window from its segments' row kinds.

Imports numpy and msgspec only; public names are exported by `payload_client`.
"""
