"""``payloadd gc``: garbage-collect on a running daemon, from a shell or a cron job."""

from __future__ import annotations

import argparse

import msgspec

from payload_client import InvalidRequestError
from payloadd.cli._common import (
    FlagError,
    InputError,
    add_connection_flags,
    exit_status,
    open_client,
)

__all__ = ["add_gc_flags", "run_gc"]


def add_gc_flags(parser: argparse.ArgumentParser) -> None:
    """Add the flags of ``payloadd gc`` to ``parser``."""
    add_connection_flags(parser)
    parser.add_argument("--run", help="with --through-step: the run whose steps go")
    parser.add_argument(
        "--through-step", type=int, metavar="STEP", help="remove the run's steps <= STEP"
    )
    parser.add_argument("--before-step", type=int, help=argparse.SUPPRESS)  # refused: renamed
    parser.add_argument(
        "--ttl-s",
        type=float,
        metavar="SECONDS",
        help="also remove steps older than this, of runs idle as long [default: the daemon's]",
    )
    parser.add_argument(
        "--delete-run", metavar="RUN", help="remove every step of RUN (instead of the rules)"
    )
    parser.add_argument(
        "--node",
        help="collect this node's prefix of a shared payload root instead of the daemon's own "
        "(e.g. a node that is gone): with --run and --through-step, --ttl-s or --delete-run; "
        "the daemon does not see that node's appends in flight [default: the daemon's node]",
    )
    parser.add_argument("--dry-run", action="store_true", help="report only, remove nothing")


def _check_flags(args: argparse.Namespace) -> None:
    if args.before_step is not None:
        raise FlagError(
            f"--before-step is now --through-step (the watermark includes its step): "
            f"--through-step {args.before_step} removes the steps <= {args.before_step}"
        )
    if (args.run is None) != (args.through_step is None):
        raise FlagError("--run and --through-step go together")
    if args.delete_run is not None and (args.run is not None or args.ttl_s is not None):
        raise FlagError("--delete-run goes alone (not with --run, --ttl-s)")
    if args.node is not None and args.run is None and args.ttl_s is None and not args.delete_run:
        raise FlagError("--node needs --run and --through-step, --ttl-s, or --delete-run")


def _collect(args: argparse.Namespace) -> int:
    try:
        with open_client(args, data_plane=True) as c:
            if args.delete_run is not None:
                report = c.delete_run(args.delete_run, dry_run=args.dry_run, node=args.node)
            else:
                report = c.gc(
                    args.run,
                    args.through_step,
                    ttl_s=args.ttl_s,
                    dry_run=args.dry_run,
                    node=args.node,
                )
    except InvalidRequestError as exc:  # a bad name or number, refused by the client or daemon
        raise InputError(str(exc)) from None
    print(msgspec.json.format(msgspec.json.encode(report)).decode())
    return 0


def run_gc(args: argparse.Namespace) -> int:
    """Run ``payloadd gc``: print the report as JSON; exit status 1 on an error, 2 on a value
    the client or the daemon refuses.

    Raises
    ------
    FlagError
        Flags that do not go together, or a token file that cannot be read.
    """
    _check_flags(args)
    return exit_status("gc", lambda: _collect(args), error_class=False)
