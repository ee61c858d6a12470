"""The ``payloadd`` command: ``serve``, ``demo``, ``bench``, ``soak``, ``gc``, ``stat``,
``inspect`` and ``health``.

One table of commands (`_commands`): each its help and description (`_ABOUT`), flags and
handler; `main` parses and calls the handler. A flag a handler cannot use (`FlagError`) is
reported by the command's parser, as argparse reports one it cannot parse: the usage,
``payloadd X: error: ...``, exit status 2.

``health`` (run by probes every few seconds) is handed over before anything heavy is
imported: this module imports only the standard library and `payloadd.cli._health` at the
top; the table, and with it pydantic, numpy and the client, is imported where it is built.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import NamedTuple

from payloadd._version import __version__
from payloadd.cli._health import DESCRIPTION, add_health_flags, run_health
from payloadd.cli._health import main as health_main

__all__ = ["Command", "Handler", "main"]

Handler = Callable[[argparse.Namespace], int]
"""A command's run: its parsed flags in, its exit status out."""


class Command(NamedTuple):
    """One subcommand of ``payloadd``: what its help says, its flags, its handler."""

    name: str
    help: str
    description: str
    add_flags: Callable[[argparse.ArgumentParser], None]
    handler: Handler
    allow_abbrev: bool = True


class _Registered(NamedTuple):
    """A command's parser (for its errors) and handler."""

    parser: argparse.ArgumentParser
    handler: Handler


_ABOUT = {
    "serve": (
        "run the daemon on a Unix socket",
        "Run the daemon: own the payload root, serve the HTTP API on a Unix socket. "
        "Every flag is also a PAYLOADD_* environment variable and a key of the TOML config "
        "file (--config); a flag wins over the environment, which wins over the file. Sizes "
        "are in bytes. "
        "The admin token itself is only an environment variable, PAYLOADD_ADMIN_TOKEN (or "
        "a file: --admin-token-file).",
    ),
    "demo": (
        "run one RL step end to end on a temporary root",
        "Start a daemon on a temporary root and socket, write router-replay ids and "
        "sampling masks, pack them into micro batches, read every DP x CP window and check "
        "it bit for bit against the inline path. Exits 1 on any mismatch.",
    ),
    "bench": (
        "measure throughput and latency against raw I/O on this machine",
        "Start a daemon on a temporary root and measure append and window-read "
        "throughput (data plane and HTTP), one-row round trips and concurrent writers, as "
        "ratios to raw os.pwrite/os.preadv on the same file system. Prints a table; writes "
        "bench.json and bench.png.",
    ),
    "soak": (
        "run a daemon under load for a while; fail on wrong data or growing resources",
        "Start a daemon on a temporary root and run a busy node for --duration "
        "seconds: writers (threads and processes, sync and async, data plane and HTTP) "
        "append multi-turn samples step by step, trainer ranks released by one barrier read "
        "their CP windows of each new micro batch and compare them bit for bit, GC collects "
        "the steps read and collected segments must answer 410; optionally SIGKILL and "
        "restart the daemon under load (--kill-every). Samples the daemon's RSS, threads and "
        "descriptors, writes soak.json and soak.png, prints a verdict. Exit status 0 when "
        "every check passed, 1 when one failed, 2 for bad flags.",
    ),
    "gc": (
        "garbage-collect on a running daemon",
        "Ask a running daemon to remove a run's steps up to a watermark "
        "(--run, --through-step), a whole run (--delete-run), steps older than a TTL "
        "(--ttl-s), orphans and empty directories; with --node, under another node's prefix "
        "of a shared root. Prints the report as JSON. An admin call: give the "
        "token with --token-file or $PAYLOADD_ADMIN_TOKEN when the daemon has one.",
    ),
    "stat": (
        "summary of a running daemon: disk, rates, runs and steps, GC ledger",
        "Sample a running daemon's counters (GET /v1/stats) and usage "
        "(GET /v1/admin/usage) twice --interval seconds apart and print the daemon, its "
        "disk and limits, rates, its runs and steps (files, bytes, bytes on disk, age) and "
        "the last GC collections. Usage is an admin call: give the token with --token-file "
        "or $PAYLOADD_ADMIN_TOKEN when the daemon has one.",
    ),
    "inspect": (
        "print the rows a list of segments points to",
        "Read a JSON list of segments ([field, file, offset, pos, rows, dtype, "
        "shape] arrays) and print each one's metadata and first rows, read through a "
        "running daemon; with --lo/--hi, the window [lo, hi) of each field, fill positions "
        "marked. Exit status 2 for bad flags or JSON, 1 when a read fails.",
    ),
    "health": (
        "check that a daemon answers on its socket (for probes)",
        DESCRIPTION,
    ),
}
"""Each command's help and description, in the order ``payloadd --help`` lists them."""
_NO_ABBREV = ("serve", "health")
"""Commands whose flags are not abbreviated: ``--admin-token`` must not pass for
``--admin-token-file``."""


def _commands() -> list[Command]:
    """Every subcommand, in the order ``payloadd --help`` lists them (`_ABOUT`'s)."""
    from payloadd.cli import _bench, _demo, _gc, _inspect, _serve, _soak, _stat

    flags_and_run = {
        "serve": (_serve.add_serve_flags, _serve.run_serve),
        "demo": (_demo.add_demo_flags, _demo.run_demo),
        "bench": (_bench.add_bench_flags, _bench.run_bench),
        "soak": (_soak.add_soak_flags, _soak.run_soak),
        "gc": (_gc.add_gc_flags, _gc.run_gc),
        "stat": (_stat.add_stat_flags, _stat.run_stat),
        "inspect": (_inspect.add_inspect_flags, _inspect.run_inspect),
        "health": (add_health_flags, run_health),  # `main` runs it before this: see above
    }
    return [
        Command(name, short, description, *flags_and_run[name], name not in _NO_ABBREV)
        for name, (short, description) in _ABOUT.items()
    ]


def _command_line() -> tuple[argparse.ArgumentParser, dict[str, _Registered]]:
    """The parser of ``payloadd`` and, by command, its parser and handler."""
    parser = argparse.ArgumentParser(
        prog="payloadd",
        description="Per-node daemon for per-token side data of LLM RL, passed by handle.",
    )
    parser.add_argument("--version", action="version", version=f"payloadd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    registered: dict[str, _Registered] = {}
    for command in _commands():
        p = sub.add_parser(
            command.name,
            help=command.help,
            description=command.description,
            allow_abbrev=command.allow_abbrev,
        )
        command.add_flags(p)
        registered[command.name] = _Registered(p, command.handler)
    return parser, registered


def _parser() -> argparse.ArgumentParser:
    """The parser of ``payloadd`` and every command."""
    return _command_line()[0]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status.

    Raises
    ------
    SystemExit
        Status 2 on bad flags (the command's parser prints the usage and the error), 0 after
        ``--help`` or ``--version``.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["health"]:  # here, before the imports below: probes run it often
        return health_main(argv[1:])
    from payloadd.cli._common import FlagError
    from payloadd.cli._serve import env_only_flag

    parser, registered = _command_line()
    if argv[:1] == ["serve"] and (why := env_only_flag(argv[1:])) is not None:
        registered["serve"].parser.error(why)  # before parsing: argparse would echo the secret
    args = parser.parse_args(argv)
    command = registered[args.command]
    try:
        return command.handler(args)
    except FlagError as exc:
        command.parser.error(str(exc))
