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
        "empty value reads no file; a named file that does not exist is an error.",
    )
    root: Path = Field(
        Path("/var/lib/payloadd"), description="Payload root: the daemon owns everything below it."
    )
    socket: Path = Field(Path(DEFAULT_SOCKET), description="Unix socket the HTTP API listens on.")
    socket_mode: int = Field(
        0o660, description="File mode of both sockets (octal, e.g. 0660): who may connect."
    )
    socket_group: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9._][A-Za-z0-9._-]{0,63}$",
        description="Group (name or gid) given to both sockets; default: the daemon's group.",
    )
    admin_token_file: Path | None = Field(
        None,
        description="File holding the admin token (surrounding whitespace stripped): admin "
        "calls must send it; the TCP listener needs it on every call.",
    )
    admin_token: SecretStr | None = Field(
        None,
        description="The admin token itself. Environment variable only (a flag would show it "
        "to every user in the process list); give it or admin_token_file, not both.",
    )
    tcp_host: str = Field(
        "127.0.0.1", description="Address the TCP listener binds (when tcp_port is set)."
    )
    tcp_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Also serve the HTTP API (not the data plane) on TCP at this port, every "
        "call needing the admin token. Default: off.",
    )
    peer_host: str = Field(
        "127.0.0.1",
        description="Address the peer port binds (when peer_port is set): the interface other "
        "nodes reach this one on.",
    )
    peer_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Serve reads of this node's files to other nodes on TCP at this port, "
        "without HTTP (ClusterClient; GET /healthz names it). Needs the admin token, which "
        "every connection must send first. Default: off.",
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
        description="Node prefix under the root this daemon writes to (default: host name).",
    )
    max_file_bytes: Size = Field(
        1 * GiB, gt=0, description="A data file is rotated before it would exceed this size."
    )
    max_request_bytes: Size = Field(
        4 * GiB, gt=0, description="Largest append body or read answer; above: 413."
    )
    max_control_bytes: Size = Field(
        16 << 20, gt=0, description="Largest append header or read request body; above: 413."
    )
    max_append_items: int = Field(
        65536, gt=0, description="Most items (blocks of rows) in one append; above: 413."
    )
    max_connections: int = Field(
        1024,
        gt=0,
        description="Most HTTP connections at once on the Unix socket; one more is answered "
        "503 and closed. Capped by the daemon's share of RLIMIT_NOFILE (an eighth of what is "
        "free at start).",
    )
    max_tcp_connections: int = Field(
        1024,
        gt=0,
        description="Most HTTP connections at once over TCP (a share of their own: nothing "
        "over TCP refuses a client of the Unix socket); of them, an eighth at most (a quarter "
        "of that from one address) before showing the admin token, which they must within "
        "5 s. One more is answered 503 and closed. Capped like max_connections.",
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
        "headers) being received at once, every transport together (requests over the "
        "network: half of it at most, one host an eighth); beyond, a request waits on the "
        "data plane and the peer port (up to request_timeout_s) and is answered 503 over "
        "HTTP. Row bytes stream and do not count.",
    )
    request_timeout_s: float = Field(
        30.0,
        gt=0,
        le=86400,
        description="Seconds a request may stall: an HTTP request head or body, or a "
        "data-plane frame, that stops arriving mid-way, or an HTTP answer the client stops "
        "taking, for this long is dropped (408 where an answer is still possible) and "
        "what it held (its reserved bytes, its files) is given back.",
    )
    reservation_timeout_s: float = Field(
        600.0,
        gt=0,
        le=86400,
        description="Seconds a data-plane reservation (an append larger than a lease, "
        "written by the client itself) may stay uncommitted; then it is given back.",
    )
    data_plane: bool = Field(
        True,
        description="Also serve file descriptors on <socket>.data, so clients on this node "
        "pread/pwrite rows themselves instead of sending them over HTTP.",
    )
    lease_bytes: Size = Field(
        16 << 20,
        gt=0,
        description="Most bytes of one data-plane lease (a client places appends in its lease "
        "itself, without a round trip, until it is used up): a key's first lease is 64 KiB, "
        "each after it twice the last, up to this.",
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
        description="Seconds between two flushes under fsync=interval: every data file written "
        "since the last flush (and every file with a data-plane lease) is fsync'd.",
    )
    root_fs: Literal["auto", "local", "distributed"] = Field(
        "auto",
        description="What the root's file system is taken for: auto: told at start from statfs "
        "and the mount table (ext4, XFS, tmpfs... local; FUSE, NFS, Lustre, GPFS, CephFS, SMB "
        "and unknown kinds distributed); local: one cache for every node (two daemons on one "
        "disk); distributed: each node has its own caches. It sets the defaults of "
        "foreign_reads, foreign_wait_s and gc_grace_s, and on a distributed one at most one "
        "append writes a shared file at a time.",
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
        description="Longest wait (seconds) for another node's file to show a segment's "
        "bytes, opening it anew, before a read fails: this node's view of its size may lag "
        "the writer's. Default: 5 on a distributed file system, 0 on a local one.",
    )
    gc_grace_s: float | None = Field(
        None,
        ge=0,
        le=600,
        description="Seconds a collection waits between writing its ledger line and removing "
        "files, so that other nodes' daemons answer 410 before the files go. Default: 2.5 "
        "on a distributed file system, 0 on a local one.",
    )
    max_root_bytes: Size = Field(
        0,
        ge=0,
        description="Cap on the bytes of this daemon's files under <root>/<node> (apparent "
        "sizes, reserved bytes included); an append past it fails with 507. 0: no cap.",
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
        description="GC age rule (seconds): a step whose files are all older, of a run not "
        "appended to or read for as long, is removed by the background sweep; 0 turns it off.",
    )
    gc_interval_s: float = Field(
        600.0,
        gt=0,
        description="Seconds between background GC sweeps (age rule, orphans, empty "
        "directories); the first runs at start.",
    )
    keep_alive_s: float = Field(
        5.0,
        gt=0,
        le=3600,
        description="Seconds an idle HTTP connection is kept open before the daemon closes it; "
        "keep it above clients' keep-alive (payload_client: 2 s) so they never send on a "
        "connection being closed.",
    )
    fields: Annotated[dict[str, FieldRule], NoDecode] = Field(  # JSON read by _json_fields
        default_factory=_default_fields,
        description="The fields table, JSON: name -> {dtypes, fill, max_width, ragged}. An "
        "append whose dtype is not among the field's dtypes, whose rows are wider than "
        "max_width (0: no limit), or whose row shape is not the one the field's first append "
        "in the run fixed (all dimensions but a ragged last one) is refused (400). Replaces "
        "the default table: routed_experts (uint8/uint16, fill 0, every dimension fixed), "
        "sampling_mask (int32, fill -1, ragged, max_width 65536).",
    )
    unknown_fields: Literal["allow", "refuse"] = Field(
        "refuse",
        description="refuse: appends of a field not in the fields table are refused (400), "
        "and so are reads of one (its rows would be read by nobody, or a typo would read "
        "as nothing); allow: such a field takes any supported dtype, its rows' shape fixed "
        "per run by its first append.",
    )
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field(
        "info", description="Log level of the daemon and uvicorn."
    )
    log_format: Literal["text", "json"] = Field(
        "text",
        description="Log lines on stderr: text ('LEVEL logger: message [request <id>]') or "
        "json (one object a line: time, level, logger, message, request_id, exception).",
    )
    access_log: bool = Field(
        False,
        description="Log one line per HTTP request (logger payloadd.access, level info): "
        "method, path, route, status, duration, bytes sent, request id.",
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
