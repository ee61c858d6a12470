"""The daemon's one flat settings object.

Every field is also a CLI flag of ``payloadd serve`` (``max_file_bytes`` ->
``--max-file-bytes``), an environment variable (``PAYLOADD_MAX_FILE_BYTES``) and a key of
the optional TOML config file (``max_file_bytes = 1073741824``; see ``_config_file``). A
size (a ``*_bytes`` setting) takes bytes or a number with a unit, ``"1GiB"`` (`Size`).
Precedence: flag > environment > config file > default. The exceptions: ``admin_token``
is an environment variable only (a command line is visible to every user, a config file
often to many), and ``config``, the file itself, is not a key of it.
"""

from __future__ import annotations

import json
import math
import re
import socket as _socket
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from payload_client import SUPPORTED_DTYPES, InvalidRequestError
from payload_client.protocol import (
    DEFAULT_FIELDS,
    DEFAULT_SOCKET,
    INT64_MAX,
    FieldSpec,
    FieldsTable,
    check_name,
)
from payloadd.settings._config_file import ConfigFileSource, config_path
from payloadd.settings._sizes import Size

__all__ = ["FieldRule", "Settings", "default_node"]

GiB = 1 << 30
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38
"""Largest finite ``float32``."""


def default_node() -> str:
    """This host's name, made a safe path component (the default node prefix)."""
    name = re.sub(r"[^A-Za-z0-9._-]", "-", _socket.gethostname())[:128]
    return name if name not in ("", ".", "..") else "node"


class FieldRule(BaseModel):
    """What one field takes: ``dtypes`` (all integer or all float), ``fill`` (the value of
    uncovered positions: an integer that fits ``int32``, or a finite number that fits
    ``float32``: what reads return), ``max_width`` (largest last row dimension; 0: no
    limit), ``ragged`` (whether the last row dimension may differ from append to append;
    default: when ``max_width`` is set; every other dimension is fixed for a run by the
    field's first append in it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dtypes: list[str] = Field(min_length=1)
    fill: int | float = 0
    max_width: int = Field(0, ge=0, le=INT64_MAX)
    ragged: bool | None = None

    @field_validator("fill", "max_width", mode="before")
    @classmethod
    def _not_bool(cls, value: object) -> object:
        if isinstance(value, bool):  # JSON true would pass as 1
            raise ValueError(f"must be a number, not a boolean ({json.dumps(value)})")
        return value

    @model_validator(mode="after")
    def _dtypes_fit(self) -> FieldRule:
        bad = [d for d in self.dtypes if d not in SUPPORTED_DTYPES]
        if bad:
            raise ValueError(f"dtypes {bad} are not among {sorted(SUPPORTED_DTYPES)}")
        floats = {d.startswith("float") for d in self.dtypes}
        if len(floats) > 1:
            raise ValueError(f"dtypes {self.dtypes} mix integer and float")
        fill = self.fill  # compared as it is: a large int never goes through float
        if isinstance(fill, float) and not math.isfinite(fill):  # JSON carries no NaN or inf
            raise ValueError(f"fill must be a finite number, got {fill}")
        if floats.pop():
            if abs(fill) > FLOAT32_MAX:
                raise ValueError(f"a float field's fill must fit float32, got {str(fill)[:40]}")
        elif isinstance(fill, float) and not fill.is_integer():
            raise ValueError(f"an integer field's fill must be an integer, got {fill}")
        elif not INT32_MIN <= fill <= INT32_MAX:
            raise ValueError(f"an integer field's fill must fit int32, got {str(fill)[:40]}")
        return self

    @property
    def is_ragged(self) -> bool:
        """``ragged``, or when not said, whether ``max_width`` is set."""
        return self.ragged if self.ragged is not None else self.max_width > 0

    @property
    def read_dtype(self) -> str:
        """``float32`` for a float field, ``int32`` for an integer one (what reads return)."""
        return "float32" if self.dtypes[0].startswith("float") else "int32"


def _default_fields() -> dict[str, FieldRule]:
    return {
        name: FieldRule(dtypes=list(s.dtypes), fill=s.fill, max_width=s.max_width, ragged=s.ragged)
        for name, s in DEFAULT_FIELDS.items()
    }


class Settings(BaseSettings):
    """Configuration of one payloadd daemon. Sizes (``*_bytes``) are bytes, given as bytes or
    as a number with a unit (``512MiB``, ``1GiB``, ``1.5GB``: `Size`)."""

    model_config = SettingsConfigDict(env_prefix="PAYLOADD_", extra="forbid", frozen=True)

    config: Path | None = Field(
        None,
        description="TOML file of settings, keys named as the settings (a flag or environment "
        "variable wins over it). Default: /etc/payloadd/payloadd.toml when it exists; an "
        "empty value reads no file; a named file that does not exist stops the start (exit "
        "status 2). Not a key of the file.",
    )
    root: Path = Field(
        Path("/var/lib/payloadd"),
        description="Payload root: the daemon owns everything below it. Created with mode 0750 "
        "if missing; must be a directory the daemon can write.",
    )
    socket: Path = Field(
        Path(DEFAULT_SOCKET),
        description="Unix socket of the HTTP API; the data plane listens on this path plus "
        ".data, the lock is this path plus .lock. Its directory is created if missing.",
    )
    socket_mode: int = Field(
        0o660,
        description="File mode of both sockets, in octal (0660 or 660, at most 0777): who may "
        "connect.",
    )
    socket_group: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9._][A-Za-z0-9._-]{0,63}$",
        description="Group given to both sockets: a name, or a number taken as a gid; default: "
        "the daemon's group.",
        json_schema_extra={"shown_default": "none (the daemon's group)"},
    )
    admin_token_file: Path | None = Field(
        None,
        description="File holding the admin token (surrounding whitespace stripped), read at "
        "start: admin calls must send it; the TCP listener needs it on every call.",
    )
    admin_token: SecretStr | None = Field(
        None,
        description="The admin token itself. Environment variable only: a command line is "
        "visible to every user (--admin-token is refused, exit status 2), and the config file "
        "refuses it too. Give it or admin_token_file, not both.",
    )
    tcp_host: str = Field(
        "127.0.0.1",
        description="Address the TCP listener binds (when tcp_port is set): a host name, an "
        "IPv4 or IPv6 address (0.0.0.0: every interface).",
    )
    tcp_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Also serve the HTTP API (never the data plane) on TCP at this port, "
        "1-65535, every call needing the admin token. Default: off.",
        json_schema_extra={"shown_default": "none (no TCP listener)"},
    )
    peer_host: str | None = Field(
        None,
        description="Address the peer port binds (when peer_port is set). Other nodes' clients "
        "connect to it at the host of this node's HTTP URL, so it must resolve to tcp_host's "
        "address or a wildcard of its family (0.0.0.0 for IPv4, ::); anything else is refused "
        "at start. Default: tcp_host's.",
        json_schema_extra={"shown_default": "tcp_host"},
    )
    peer_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Serve reads of this node's files to other nodes on TCP at this port, "
        "1-65535, without HTTP (ClusterClient; GET /healthz names it). Needs the admin token, "
        "which every connection must send first. Default: off.",
        json_schema_extra={"shown_default": "none (no peer port)"},
    )
    max_peer_connections: int = Field(
        256,
        gt=0,
        description="Most peer-port connections at once; one more is closed at once (its "
        "client reads over HTTP). Capped like max_connections.",
    )
    max_peer_connections_per_host: int = Field(
        16,
        gt=0,
        description="Most peer-port connections at once from one address; one more is closed "
        "at once.",
    )
    node: str = Field(
        default_factory=default_node,
        pattern=r"^[A-Za-z0-9._-]{1,128}$",
        description="Node prefix under the root this daemon writes to, [A-Za-z0-9._-]{1,128}, "
        "not '.' or '..'. Default: the host name with other characters replaced by -, cut to "
        "128 characters.",
    )
    max_file_bytes: Size = Field(
        1 * GiB,
        gt=0,
        description="Rotation size: a data file is rotated before it would exceed it (a single "
        "row larger than it gets a file of its own).",
    )
    max_request_bytes: Size = Field(
        4 * GiB,
        gt=0,
        description="Largest HTTP append body (and row bytes of one append or data-plane "
        "reservation), and largest HTTP read answer. Above: 413.",
    )
    max_control_bytes: Size = Field(
        16 << 20,
        gt=0,
        description="Largest msgpack header of an HTTP append, largest body of a read or GC "
        "request, and largest data-plane request frame. Above: 413 (PayloadTooLargeError; on "
        "the data plane the connection is then dropped).",
    )
    max_append_items: int = Field(
        65536,
        gt=0,
        description="Most items (blocks of rows) in one HTTP append or data-plane reservation. "
        "Above: 413.",
    )
    max_connections: int = Field(
        1024,
        gt=0,
        description="Most HTTP connections at once on the Unix socket (the node's own clients "
        "and its health probe; TCP has a share of its own, max_tcp_connections). One more is "
        "answered 503 (BusyError, Retry-After: 1) without its request being read: what it "
        "sends is dropped unparsed, so a refused append, GC or run deletion is never carried "
        "out; then it is closed. Capped by the daemon's share of descriptors (RLIMIT_NOFILE: "
        "an eighth of what is free at start).",
    )
    max_tcp_connections: int = Field(
        1024,
        gt=0,
        description="Most HTTP connections at once over TCP, a share of their own, so that "
        "nothing arriving over TCP refuses a client of the Unix socket. Of them, an eighth at "
        "most (at least 2; a quarter of that from one address) may be connections that have "
        "not yet sent a request head with the admin token, which they must within 5 s of "
        "connecting (else they are closed); a head without the token is answered 401 and its "
        "connection closed. One more is answered 503 and closed, like max_connections. Capped "
        "like max_connections.",
    )
    max_data_connections: int = Field(
        1024,
        gt=0,
        description="Most data-plane connections at once; one more is closed at once (its "
        "client falls back to HTTP). Capped like max_connections.",
    )
    max_inflight_bytes: Size = Field(
        256 << 20,
        gt=0,
        description="Most bytes of request frames and control bodies (read requests, append "
        "headers) being received at once, every transport together; requests over the network "
        "(TCP, the peer port) hold at most half of it, one host an eighth (local before "
        "remote). Beyond, a data-plane or peer-port frame waits up to request_timeout_s and an "
        "HTTP request is answered 503 (BusyError). Row bytes of large appends and reads stream "
        "a chunk at a time and do not count.",
    )
    request_timeout_s: float = Field(
        30.0,
        gt=0,
        le=86400,
        description="Seconds a request may stall (> 0, at most 86400): an HTTP connection that "
        "sends no complete request head, a request body or a data-plane frame that stops "
        "arriving mid-way, or a read answer the client stops taking, for this long, is dropped "
        "(a body: answered 408, RequestTimeoutError, where an answer is still possible), and "
        "what it held (reserved bytes, files, descriptors) is given back.",
    )
    reservation_timeout_s: float = Field(
        600.0,
        gt=0,
        le=86400,
        description="Seconds a data-plane reservation (an append larger than a lease, which "
        "the client writes itself) may stay uncommitted (> 0, at most 86400); then it is given "
        "back and its commit answers InvalidRequestError.",
    )
    data_plane: bool = Field(
        True,
        description="Also serve file descriptors on <socket>.data, so clients on this node "
        "pread/pwrite rows themselves instead of sending them over HTTP. false: no data "
        "socket; every client uses HTTP.",
    )
    lease_bytes: Size = Field(
        16 << 20,
        gt=0,
        description="Most bytes of one lease: a byte range a data-plane client places appends "
        "of a (run, step, field) in itself, without a round trip, until it is used up. A "
        "key's first lease on a connection is 64 KiB, each after it twice the last, up to "
        "this. A larger item gets a lease of its own size; no lease passes max_file_bytes.",
    )
    fsync: Literal["never", "interval", "always"] = Field(
        "never",
        description="never: bytes reach the page cache before a segment is returned (survives "
        "a daemon crash, not a node crash); interval: also fsync'd by a background flusher "
        "every fsync_interval_s (a node crash loses at most about that much); always: fsync'd "
        "before a segment is returned (survives a node crash).",
    )
    fsync_interval_s: float = Field(
        1.0,
        gt=0,
        le=86400,  # the flusher's wait overflows far beyond
        description="Seconds (> 0, at most 86400) between two flushes under fsync=interval: "
        "every data file written since the last flush (and every file with a data-plane lease) "
        "is fsync'd.",
    )
    root_fs: Literal["auto", "local", "distributed"] = Field(
        "auto",
        description="What the root's file system is taken for: auto: told at start from statfs "
        "and the mount table (ext4, XFS, btrfs, tmpfs, ZFS... local; FUSE, NFS, Lustre, GPFS, "
        "CephFS, SMB, 9p and any kind not known distributed); local: one cache for every node "
        "(two daemons on one disk); distributed: each node has its own caches. It sets the "
        "defaults of foreign_reads, foreign_wait_s and gc_grace_s, and on a distributed one at "
        "most one append writes a shared file at a time.",
    )
    foreign_reads: Literal["auto", "cached", "reopen"] = Field(
        "auto",
        description="Reads of files under another node's prefix (a shared root): cached: the "
        "daemon keeps their descriptors (and data-plane clients do, on a local file system); "
        "reopen: each read opens the file anew (NFS: close-to-open consistency), and "
        "data-plane clients close it after the read; auto: reopen on a distributed file "
        "system, else cached. Either way another node's ledger is checked at every read.",
    )
    foreign_wait_s: float | None = Field(
        None,
        ge=0,
        le=600,
        description="Longest wait (seconds, at most 600) for another node's file to show a "
        "segment's bytes, opening it anew, before a read fails with 409: this node's view of "
        "its size may lag the writer's. Default: 5 on a distributed file system, 0 on a local "
        "one.",
        json_schema_extra={"shown_default": "by the file system: `5` distributed, `0` local"},
    )
    gc_grace_s: float | None = Field(
        None,
        ge=0,
        le=600,
        description="Seconds (at most 600) a collection waits between writing its ledger line "
        "and removing files, so that other nodes' daemons answer 410 before the files go. "
        "Default: 2.5 on a distributed file system, 0 on a local one.",
        json_schema_extra={"shown_default": "by the file system: `2.5` distributed, `0` local"},
    )
    max_root_bytes: Size = Field(
        0,
        ge=0,
        description="Cap on the bytes of this daemon's files under <root>/<node> (apparent "
        "sizes, reserved bytes included); an append past it fails with 507. 0: no cap.",
        json_schema_extra={"shown_default": "`0` (no cap)"},
    )
    min_free_bytes: Size = Field(
        1 * GiB,
        ge=0,
        description="Free-space floor of the root's file system: an append that would leave "
        "less free fails with 507. 0: no floor (only a real ENOSPC fails appends).",
    )
    ttl_s: float = Field(
        86400.0,
        ge=0,
        description="GC age rule (seconds): the background sweep removes a step whose files are "
        "all older than this, of a run not appended to or read for as long; 0 turns the rule "
        "off. See Garbage collection in docs/operations.md.",
        json_schema_extra={"shown_default": "`86400.0` (one day)"},
    )
    gc_interval_s: float = Field(
        600.0,
        gt=0,
        description="Seconds (> 0) between background GC sweeps (age rule, orphans, empty "
        "directories); the first runs at start.",
    )
    keep_alive_s: float = Field(
        5.0,
        gt=0,
        le=3600,
        description="Seconds an idle HTTP connection stays open before the daemon closes it "
        "(> 0, at most 3600). Keep it above the clients' own idle limit (payload_client's "
        "Timeout.keepalive, 2 s), so that a client never sends on a connection the daemon is "
        "closing.",
    )
    fields: Annotated[dict[str, FieldRule], NoDecode] = Field(  # JSON read by _json_fields
        default_factory=_default_fields,
        description="The fields table, JSON: name -> {dtypes, fill, max_width, ragged}. It "
        "replaces the default table (routed_experts: uint8/uint16, fill 0, every dimension "
        "fixed; sampling_mask: int32, fill -1, ragged, max_width 65536): list every field your "
        "writers use. dtypes: supported dtypes, all integer or all float. fill: the value "
        "readers should pass for uncovered positions (read_field uses the fill its caller "
        "passes, not this one): an integer that fits int32 for an integer field, a finite "
        "number that fits float32 for a float field. max_width: the largest last dimension of "
        "a row, 0 (default): no limit. ragged: whether the last row dimension may differ from "
        "append to append (default: when max_width is set); every other dimension, and the "
        "number of dimensions, is fixed for a run by the field's first append in it "
        '(docs/contract.md, "Row shapes within a run"). An append whose dtype is not among '
        "its field's, whose rows are wider than max_width, or whose row shape is not the one "
        "its run fixed, is refused before anything is reserved (400 over HTTP; on the data "
        "plane the client refuses the dtype and width with the same InvalidRequestError, from "
        "the table it fetched, and the daemon the shape, which the client declares once a "
        "run); values are never cast, so never wrapped, and rows never cut. A field whose "
        "dtypes are float reads as float32, others as int32. GET /v1/fields shows the table. "
        "A table that is not valid JSON or breaks a rule above (NaN or infinity included) "
        "stops payloadd serve with exit status 2.",
    )
    unknown_fields: Literal["allow", "refuse"] = Field(
        "refuse",
        description="refuse: appends of a field not in the fields table are refused (400, "
        "InvalidRequestError naming the table's fields and how to declare one), and so are "
        "data-plane leases of it, and reads of it (its rows would be read by nobody, or a "
        "typo would read as nothing; the client fetches the table on its first read); allow "
        "(an explicit opt-in): such a field takes any supported dtype, its rows' every "
        "dimension fixed per run by its first append, unless its name is within two typing "
        "errors of a table field's (refused as a typo, 400, naming the field meant).",
    )
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field(
        "info",
        description="critical, error, warning, info or debug: log level of the daemon and uvicorn.",
    )
    log_format: Literal["text", "json"] = Field(
        "text",
        description="Log lines on stderr: text ('LEVEL logger: message [request <id>]') or "
        "json (one object a line: time, level, logger, message, request_id, exception).",
    )
    access_log: bool = Field(
        False,
        description="Log one line per HTTP request (logger payloadd.access, level info): "
        "method, path, route, status, duration, bytes sent, request id. See Logs in "
        "docs/operations.md.",
    )

    @field_validator("socket_mode", mode="before")
    @classmethod
    def _octal(cls, value: object) -> object:
        if isinstance(value, str):
            try:
                return int(value, 8)
            except ValueError:
                raise ValueError(f"socket_mode must be octal like 0660, got {value!r}") from None
        return value

    @field_validator("socket_mode")
    @classmethod
    def _permission_bits(cls, value: int) -> int:
        if not 0 <= value <= 0o777:
            raise ValueError(f"socket_mode must be permission bits 0000..0777, got {value:o}")
        return value

    @field_validator("fields", mode="before")
    @classmethod
    def _json_fields(cls, value: object) -> object:
        if isinstance(value, str):
            try:
                return json.loads(value)
            except ValueError as exc:
                raise ValueError(f"fields must be a JSON object: {exc}") from None
        return value

    @field_validator("fields")
    @classmethod
    def _field_names(cls, value: dict[str, FieldRule]) -> dict[str, FieldRule]:
        for name in value:
            try:
                check_name(name, "field name")
            except InvalidRequestError as exc:
                raise ValueError(str(exc)) from None
        return value

    @property
    def peer_address(self) -> str:
        """The address the peer port binds: ``peer_host``, else ``tcp_host``."""
        return self.tcp_host if self.peer_host is None else self.peer_host

    def fields_table(self) -> FieldsTable:
        """The fields table as the wire carries it (``GET /v1/fields``)."""
        return FieldsTable(
            {
                name: FieldSpec(list(r.dtypes), r.fill, r.max_width, r.read_dtype, r.is_ragged)
                for name, r in self.fields.items()
            },
            self.unknown_fields,
        )

    @field_validator("node")
    @classmethod
    def _not_dots(cls, value: str) -> str:
        if value in (".", ".."):
            raise ValueError("node must not be '.' or '..'")
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Flags (init arguments), then ``PAYLOADD_*`` variables, then the config file.

        Raises
        ------
        ConfigFileError
            The config file is missing (when named), unreadable, or invalid.
        """
        given = {**env_settings(), **init_settings()}
        source = ConfigFileSource(settings_cls, config_path(given), set(given))
        return (init_settings, env_settings, source)

    @field_validator("config", mode="before")
    @classmethod
    def _empty_is_none(cls, value: object) -> object:
        return None if value == "" else value

    @field_validator("root", "socket", "admin_token_file", mode="before")
    @classmethod
    def _not_empty(cls, value: object) -> object:
        # Path("") is ".": an empty PAYLOADD_ROOT would make the working directory the root
        if isinstance(value, str) and not value.strip():
            raise ValueError("must not be empty (an empty path is the working directory)")
        return value
