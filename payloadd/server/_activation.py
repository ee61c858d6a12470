"""Listening sockets passed by systemd: socket activation, the ``sd_listen_fds`` protocol.

systemd (or any supervisor that follows sd_listen_fds(3)) passes listening sockets as
descriptors 3, 4, ... and sets ``LISTEN_PID`` (the pid they are meant for),
``LISTEN_FDS`` (how many) and optionally ``LISTEN_FDNAMES`` (colon-separated names, from
the socket unit's ``FileDescriptorName=``). `passed_sockets` takes them and unsets the
three variables; `match_sockets` tells the HTTP socket from the data socket and checks
them against the ``socket`` setting.

A socket is recognised by its name, ``http`` or ``data``, when the unit gives those names
(two socket units), otherwise by the path it is bound to: one socket unit names all its
sockets alike, so the path is what tells them apart. Either way the path must be the
``socket`` setting (``http``) or that path plus ``.data`` (``data``): clients find the
data socket, and the daemon its lock, beside the HTTP socket.
"""

from __future__ import annotations

import os
import socket
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path

from payload_client.protocol import DATA_SOCKET_SUFFIX
from payloadd.server._sockets import StartError

__all__ = ["LISTEN_FDS_START", "Inherited", "match_sockets", "passed_sockets"]

LISTEN_FDS_START = 3
"""The first passed descriptor (``SD_LISTEN_FDS_START``)."""

ROLES = ("http", "data")


@dataclass(frozen=True)
class Inherited:
    """The listening sockets systemd passed: the HTTP socket and, if passed, the data one."""

    http: socket.socket
    data: socket.socket | None


def passed_sockets(
    environ: MutableMapping[str, str] | None = None,
) -> list[tuple[socket.socket, str]]:
    """Take the sockets passed to this process, with their names (``""`` when unnamed).

    ``LISTEN_PID``, ``LISTEN_FDS`` and ``LISTEN_FDNAMES`` are removed from ``environ``
    (default `os.environ`) in every case, so that no child process takes them for its own.
    Variables meant for another process (``LISTEN_PID`` is not this pid) are ignored.
    The descriptors are made close-on-exec.

    Raises
    ------
    StartError
        ``LISTEN_FDS`` is not a number, or a descriptor it counts is not open.
    """
    env = os.environ if environ is None else environ
    pid = env.pop("LISTEN_PID", None)
    count = env.pop("LISTEN_FDS", None)
    names = env.pop("LISTEN_FDNAMES", None)
    if pid is None or count is None or not _number(pid) or int(pid) != os.getpid():
        return []
    if not _number(count):
        raise StartError(f"LISTEN_FDS={count!r} (socket activation) is not a number")
    n = int(count)
    labels = names.split(":") if names is not None else []
    if len(labels) != n:
        labels = [""] * n
    passed = []
    for i in range(n):
        fd = LISTEN_FDS_START + i
        try:
            os.set_inheritable(fd, False)
            passed.append((socket.socket(fileno=fd), labels[i]))
        except OSError as exc:
            raise StartError(
                f"descriptor {fd} of LISTEN_FDS={n} (socket activation) is not a usable "
                f"socket: {exc.strerror}"
            ) from None
    return passed


def _number(text: str) -> bool:
    # ASCII digits only: str.isdigit() also takes "³", which int() refuses
    return text.isascii() and text.isdigit()


def _bound_path(sock: socket.socket) -> str:
    name = sock.getsockname()
    return name if isinstance(name, str) else repr(name)  # bytes: an abstract address


def _same(bound: str, path: Path) -> bool:
    if bound == os.fspath(path):
        return True
    try:
        return os.path.samefile(bound, path)
    except (OSError, ValueError):
        return False


def match_sockets(
    passed: list[tuple[socket.socket, str]], socket_path: Path, data_plane: bool
) -> Inherited:
    """Tell the passed HTTP socket from the data socket, and check both.

    Parameters
    ----------
    passed : list of (socket, name)
        What `passed_sockets` returned (not empty).
    socket_path : Path
        The ``socket`` setting: where the HTTP socket must be bound.
    data_plane : bool
        The ``data_plane`` setting. A passed data socket with the data plane off is an error
        (its clients would wait forever); a data socket not passed is bound by the daemon.

    Raises
    ------
    StartError
        A passed descriptor is not a listening Unix stream socket; is bound to neither
        ``socket_path`` nor ``socket_path`` plus ``.data`` (or has a name other than
        ``http``/``data`` and such a path, or the wrong path for its name); two are for
        the same role; none is the HTTP socket; a data socket with ``data_plane`` off.
    """
    paths = {"http": socket_path, "data": Path(f"{socket_path}{DATA_SOCKET_SUFFIX}")}
    found: dict[str, socket.socket] = {}
    for sock, name in passed:
        fd = sock.fileno()
        what = f"descriptor {fd}" + (f" ({name})" if name else "") + " passed by systemd"
        try:
            listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
        except OSError:
            listening = 0
        if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM or not listening:
            raise StartError(f"{what} is not a listening Unix stream socket")
        bound = _bound_path(sock)
        if name in ROLES:
            role = name
        else:
            role = next((r for r in ROLES if _same(bound, paths[r])), "")
            if not role:
                raise StartError(
                    f"{what} is bound to {bound}, neither the socket setting {paths['http']} "
                    f"nor its data socket {paths['data']}: make ListenStream= and --socket agree"
                )
        if not _same(bound, paths[role]):
            raise StartError(
                f"{what} is the {role} socket but is bound to {bound}, not {paths[role]}: "
                "make ListenStream= and --socket agree"
            )
        if role in found:
            raise StartError(f"systemd passed two {role} sockets ({what} is the second)")
        found[role] = sock
    if "http" not in found:
        raise StartError(
            f"systemd passed sockets, but none bound to the socket setting {paths['http']}"
        )
    if "data" in found and not data_plane:
        raise StartError(
            f"systemd passed the data socket {paths['data']} but data_plane is false: its "
            "clients would wait forever; remove it from the socket unit or turn the data plane on"
        )
    return Inherited(found["http"], found.get("data"))
