"""The ``payloadd`` command: ``serve``, ``demo``, ``bench``, ``soak``, ``gc``, ``stat``,
``inspect`` and ``health``.

``serve``'s flags are generated from `Settings`, one per field, so a flag, an environment
variable and a settings field never drift apart. ``health`` (run by probes every few seconds)
is handed over before anything heavy is imported: `Settings` and pydantic are imported where
they are used.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Literal, get_args, get_origin

from payloadd import __version__
from payloadd.cli._health import DESCRIPTION, add_health_flags
from payloadd.cli._health import main as health_main

__all__ = ["main"]


ENV_ONLY = frozenset({"admin_token"})
"""Settings that are not flags: secrets, since every user can read a process's command line."""
ENV_ONLY_FLAGS = frozenset(f"--{name.replace('_', '-')}" for name in ENV_ONLY)


def _add_settings_flags(parser: argparse.ArgumentParser) -> None:
    from pydantic_core import to_jsonable_python

    from payloadd.settings._config_file import DEFAULT_CONFIG
    from payloadd.settings._settings import Settings

    for name, info in Settings.model_fields.items():
        if name in ENV_ONLY:
            continue
        default = info.get_default(call_default_factory=True)
        if name == "socket_mode":
            default = f"{default:04o}"
        elif name == "config":
            default = f"{DEFAULT_CONFIG} if it exists"
        elif default is None:
            default = "none"
        elif isinstance(default, bool):
            default = str(default).lower()  # as the flag and the config file take it
        elif isinstance(default, dict):
            default = json.dumps(to_jsonable_python(default))  # as --fields takes it, not a repr
        choices = get_args(info.annotation) if get_origin(info.annotation) is Literal else None
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            dest=name,
            default=argparse.SUPPRESS,
            choices=choices,
            metavar=name.upper() if choices is None else None,
            help=f"{info.description} [env PAYLOADD_{name.upper()}; default {default}]",
        )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="payloadd",
        description="Per-node daemon for per-token side data of LLM RL, passed by handle.",
    )
    parser.add_argument("--version", action="version", version=f"payloadd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        allow_abbrev=False,  # "--admin-token" must not pass for "--admin-token-file"
        help="run the daemon on a Unix socket",
        description="Run the daemon: own the payload root, serve the HTTP API on a Unix socket. "
        "Every flag is also a PAYLOADD_* environment variable and a key of the TOML config file "
        "(--config); a flag wins over the environment, which wins over the file. Sizes are in "
        "bytes. "
        "The admin token itself is only an environment variable, PAYLOADD_ADMIN_TOKEN (or "
        "a file: --admin-token-file).",
    )
    _add_settings_flags(serve)
    demo = sub.add_parser(
        "demo",
        help="run one RL step end to end on a temporary root",
        description="Start a daemon on a temporary root and socket, write router-replay ids and "
        "sampling masks, pack them into micro batches, read every DP x CP window and check it "
        "bit for bit against the inline path. Exits 1 on any mismatch.",
    )
    from payloadd.bench._demo import add_demo_flags

    add_demo_flags(demo)
    bench = sub.add_parser(
        "bench",
        help="measure throughput and latency against raw I/O on this machine",
        description="Start a daemon on a temporary root and measure append and window-read "
        "throughput (data plane and HTTP), one-row round trips and concurrent writers, as "
        "ratios to raw os.pwrite/os.preadv on the same file system. Prints a table; writes "
        "bench.json and bench.png.",
    )
    from payloadd.bench._bench import add_bench_flags

    add_bench_flags(bench)
    soak = sub.add_parser(
        "soak",
        help="run a daemon under load for a while; fail on wrong data or growing resources",
        description="Start a daemon on a temporary root and run a busy node for --duration "
        "seconds: writers (threads and processes, sync and async, data plane and HTTP) append "
        "multi-turn samples step by step, trainer ranks released by one barrier read their CP "
        "windows of each new micro batch and compare them bit for bit, GC collects the steps "
        "read and collected segments must answer 410; optionally SIGKILL and restart the "
        "daemon under load (--kill-every). Samples the daemon's RSS, threads and descriptors, "
        "writes soak.json and soak.png, prints a verdict. Exit status 0 when every check "
        "passed, 1 when one failed, 2 for bad flags.",
    )
    from payloadd.cli._soak import add_soak_flags

    add_soak_flags(soak)
    gc = sub.add_parser(
        "gc",
        help="garbage-collect on a running daemon",
        description="Ask a running daemon to remove a run's steps up to a watermark "
        "(--run, --before-step), a whole run (--delete-run), steps older than a TTL (--ttl-s), "
        "orphans and empty directories; with --node, under another node's prefix of a shared "
        "root. Prints the report as JSON. An admin call: give the "
        "token with --token-file or $PAYLOADD_ADMIN_TOKEN when the daemon has one.",
    )
    from payloadd.cli._gc import add_gc_flags

    add_gc_flags(gc)
    stat = sub.add_parser(
        "stat",
        help="summary of a running daemon: disk, rates, runs and steps, GC ledger",
        description="Sample a running daemon's counters (GET /v1/stats) and usage "
        "(GET /v1/admin/usage) twice --interval seconds apart and print the daemon, its disk "
        "and limits, rates, its runs and steps (files, bytes, bytes on disk, age) and the last "
        "GC collections. Usage is an admin call: give the token with --token-file or "
        "$PAYLOADD_ADMIN_TOKEN when the daemon has one.",
    )
    from payloadd.cli._stat import add_stat_flags

    add_stat_flags(stat)
    inspect = sub.add_parser(
        "inspect",
        help="print the rows a list of segments points to",
        description="Read a JSON list of segments ([field, file, offset, pos, rows, dtype, "
        "shape] arrays) and print each one's metadata and first rows, read through a running "
        "daemon; with --lo/--hi, the window [lo, hi) of each field, fill positions marked. "
        "Exit status 2 for bad flags or JSON, 1 when a read fails.",
    )
    from payloadd.cli._inspect import add_inspect_flags

    add_inspect_flags(inspect)
    health = sub.add_parser(
        "health",
        allow_abbrev=False,
        help="check that a daemon answers on its socket (for probes)",
        description=DESCRIPTION,
    )
    add_health_flags(health)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["health"]:  # here, before the imports below: probes run it often
        return health_main(argv[1:])
    for arg in argv if argv[:1] == ["serve"] else ():
        if arg.replace("_", "-").split("=")[0] in ENV_ONLY_FLAGS:
            print(
                f"payloadd serve: {arg.split('=')[0]} is not a flag: every user can read a "
                "command line. Set PAYLOADD_ADMIN_TOKEN or --admin-token-file instead.",
                file=sys.stderr,
            )
            return 2
    args = _parser().parse_args(argv)
    if args.command == "serve":
        from pydantic import ValidationError
        from pydantic_settings import SettingsError

        from payloadd.settings._config_file import ConfigFileError
        from payloadd.settings._settings import Settings

        values = {k: v for k, v in vars(args).items() if k != "command"}
        try:
            settings = Settings(**values)
        except ValidationError as exc:
            lines = []
            for e in exc.errors(include_url=False):
                where = ".".join(map(str, e["loc"])) or "settings"
                got = "" if "token" in where else f" (got {e['input']!r})"  # never echo a secret
                lines.append(f"  {where}: {e['msg']}{got}")
            print("payloadd serve: invalid settings:\n" + "\n".join(lines), file=sys.stderr)
            return 2
        except (ConfigFileError, SettingsError) as exc:  # the file; a PAYLOADD_* not JSON
            print(f"payloadd serve: {exc}", file=sys.stderr)
            return 2
        from payloadd.server._serve import serve
        from payloadd.server._sockets import StartError

        try:
            serve(settings)
        except (StartError, OSError) as exc:
            print(f"payloadd serve: {exc}", file=sys.stderr)
            return 1
        return 0
    if args.command == "gc":
        from payloadd.cli._gc import run_gc

        return run_gc(args)
    if args.command == "stat":
        from payloadd.cli._stat import run_stat

        return run_stat(args)
    if args.command == "inspect":
        from payloadd.cli._inspect import run_inspect

        return run_inspect(args)
    if args.command == "bench":
        from payloadd.bench._bench import run_bench

        return run_bench(args)
    if args.command == "soak":
        from payloadd.cli._soak import run_soak

        return run_soak(args)
    from payloadd.bench._demo import run_demo

    return run_demo(args)
