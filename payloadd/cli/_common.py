"""What the client-side commands (``payloadd stat``, ``payloadd inspect``) share: where the
daemon is, the admin token, and plain-text tables."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from payload_client import DEFAULT_SOCKET, InvalidRequestError, PayloadClient

__all__ = ["FlagError", "add_connection_flags", "emit", "human_bytes", "open_client", "table"]


class FlagError(InvalidRequestError):
    """A flag or an input file of a command is unusable; the message names what is wrong
    (exit status 2). Raised by the command itself, never by the daemon."""


def add_connection_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``--socket`` / ``--base-url`` (one or the other) and ``--token-file``."""
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--socket",
        help=f"the daemon's Unix socket [default: $PAYLOADD_SOCKET or {DEFAULT_SOCKET}]",
    )
    where.add_argument("--base-url", help="the daemon's TCP listener, http://host:port")
    parser.add_argument(
        "--token-file",
        type=Path,
        help="file holding the admin token [default: $PAYLOADD_ADMIN_TOKEN, if set]",
    )


def open_client(args: argparse.Namespace, *, data_plane: bool) -> PayloadClient:
    """A client of the daemon the flags name, with the admin token if one is given.

    Raises
    ------
    FlagError
        The token file cannot be read.
    """
    token = os.environ.get("PAYLOADD_ADMIN_TOKEN") or None
    if args.token_file is not None:
        try:
            token = args.token_file.read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise FlagError(f"cannot read --token-file {args.token_file}: {exc}") from None
    return PayloadClient(args.socket, base_url=args.base_url, token=token, data_plane=data_plane)


def emit(text: str) -> None:
    """Print ``text`` to standard output; a reader that went away (``| head``) is no error."""
    try:
        print(text, flush=True)
    except BrokenPipeError:  # as the Python docs advise: no second error at exit
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def human_bytes(n: float) -> str:
    """``n`` bytes with a binary unit: ``512 B``, ``3.8 KiB``, ``16.0 MiB``, ``1.0 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def table(header: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[bool]) -> str:
    """A plain-text table: columns two spaces apart, each padded to its widest cell,
    right-aligned where ``right`` says (numbers), no trailing spaces."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = []
    for r in [header, *rows]:
        cells = [
            c.rjust(w) if ra else c.ljust(w) for c, w, ra in zip(r, widths, right, strict=True)
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)
