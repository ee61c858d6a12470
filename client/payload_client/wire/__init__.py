"""What crosses the wire: msgspec Structs of every transport, and the fields table.

- `._http`: the HTTP control plane's Structs and the append body's framing.
- `._dataplane`: the data plane's tagged messages (``<socket>.data``).
- `._peer`: the peer port's messages (reads between nodes over TCP).
- `._fields`: the daemon's fields table and its checks, shared with the daemon.
- `._rows`: rows of an append checked and put in their wire form.

The daemon imports these through `payload_client.protocol`; Structs only gain defaulted
fields at their end (docs/http-api.md, "Wire evolution").
"""
