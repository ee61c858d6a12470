"""What the commands share: flag errors and the one path from an error to an exit status,
where the daemon is, the admin token, and plain-text tables.

A command ends in one of three ways besides success. A flag that cannot be used raises
`FlagError`: `payloadd.cli._main.main` hands it to the command's parser (``parser.error``:
the usage, ``payloadd X: error: ...`` on stderr, exit status 2), as argparse does with a
flag it cannot parse. An input that cannot be used (a file the command reads) raises
`InputError`, and a daemon or connection error ends the command with exit status 1: for
both, `exit_status` prints one line ``payloadd X: ...`` on stderr.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from payload_client import DEFAULT_SOCKET, PayloadClient, PayloadError

__all__ = [
    "FlagError",
    "InputError",
    "add_connection_flags",
    "emit",
    "exit_status",
    "open_client",
    "positive_int",
    "table",
]


class FlagError(ValueError):
    """A flag is unusable: a value out of range, flags that do not go together, a file a flag
    names that cannot be read. The message names the flag; the command's parser reports it
    (exit status 2)."""


class InputError(ValueError):
    """An input of a command (a file it reads) is unusable; the message names what is wrong
    (exit status 2)."""


def exit_status(command: str, run: Callable[[], int], *, error_class: bool = True) -> int:
    """Run a command's body; turn the error it ends with into a line and an exit status.

    Parameters
    ----------
    command : str
        The command's name, as the line starts: ``payloadd {command}: ...``.
    run : callable
        The body; returns the exit status when it ends without an error.
    error_class : bool
        Whether the line of a daemon or connection error names the error's class
        (``payloadd stat: ConnectError: ...``).

    Returns
    -------
    int
        What ``run`` returned; 2 after an `InputError`; 1 after a `PayloadError` or an
        `OSError`.

    Raises
    ------
    FlagError
        Passed on, for the command's parser to report.
    """
    try:
        return run()
    except InputError as exc:
        print(f"payloadd {command}: {exc}", file=sys.stderr)
        return 2
    except (PayloadError, OSError) as exc:
        what = f"{type(exc).__name__}: {exc}" if error_class else str(exc)
        print(f"payloadd {command}: {what}", file=sys.stderr)
        return 1


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


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
            lines = args.token_file.read_text().split()
            token = lines[0] if lines else ""  # the first: while rotating, the new one
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
