"""``payloadd serve``: its flags, one per field of `Settings`, and the run of the daemon.

A flag, a ``PAYLOADD_*`` variable and a settings field never drift apart: the flags are
generated from the fields. Secrets are not flags (`ENV_ONLY`): every user can read a
process's command line.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Literal, get_args, get_origin

from pydantic import ValidationError
from pydantic_core import to_jsonable_python
from pydantic_settings import SettingsError

from payload_client.protocol import format_size
from payloadd.settings._config_file import DEFAULT_CONFIG, ConfigFileError
from payloadd.settings._settings import Settings

__all__ = ["ENV_ONLY", "add_serve_flags", "env_only_flag", "run_serve"]

ENV_ONLY = frozenset({"admin_token"})
"""Settings that are not flags: secrets, since every user can read a process's command line."""
ENV_ONLY_FLAGS = frozenset(f"--{name.replace('_', '-')}" for name in ENV_ONLY)
"""The flags `ENV_ONLY` settings would have."""
SIZE_HELP = " Bytes, or a number with a unit: 512MiB, 1GiB, 1.5GB."
"""Added to the help of a size flag (``--max-root-bytes``)."""


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """Add one flag per field of `Settings` (but `ENV_ONLY`) to ``parser``: ``--max-file-bytes``
    for ``max_file_bytes``, no default of its own (a flag not given leaves the field to the
    environment, the config file, the default)."""
    for name, info in Settings.model_fields.items():
        if name in ENV_ONLY:
            continue
        default = info.get_default(call_default_factory=True)
        size = name.endswith("_bytes")  # a `Size`: bytes or a number with a unit
        if size:
            default = format_size(default) if default else 0
        elif name == "socket_mode":
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
            help=f"{info.description}{SIZE_HELP if size else ''} [env PAYLOADD_{name.upper()}; "
            f"default {default}]",
        )


def env_only_flag(argv: Sequence[str]) -> str | None:
    """Why ``argv`` (the arguments of ``payloadd serve``) must be refused before it is parsed:
    it gives a secret as a flag (``--admin-token``, ``--admin_token=...``); ``None`` when it
    does not. The reason names the flag, never its value (argparse would echo it)."""
    for arg in argv:
        if arg.replace("_", "-").split("=")[0] in ENV_ONLY_FLAGS:
            return (
                f"{arg.split('=')[0]} is not a flag: every user can read a command line. Set "
                "PAYLOADD_ADMIN_TOKEN or --admin-token-file instead."
            )
    return None


def _settings_error(exc: ValidationError) -> str:
    lines = []
    for e in exc.errors(include_url=False):
        where = ".".join(map(str, e["loc"])) or "settings"
        said = e["msg"].startswith(repr(e["input"]))  # a size's message quotes it
        got = "" if "token" in where or said else f" (got {e['input']!r})"  # never a secret
        lines.append(f"  {where}: {e['msg']}{got}")
    return "invalid settings:\n" + "\n".join(lines)


def run_serve(args: argparse.Namespace) -> int:
    """Build the settings from the flags (then the environment, the config file) and serve.

    Returns
    -------
    int
        0 after a clean shutdown; 1 when the daemon cannot start (the socket, the lock, the
        root); 2 for invalid settings, from a flag, a variable or the config file (they need
        not come from the command line, so they are no argparse error: one message, no
        usage).
    """
    values = {k: v for k, v in vars(args).items() if k != "command"}
    try:
        settings = Settings(**values)
    except ValidationError as exc:
        print(f"payloadd serve: {_settings_error(exc)}", file=sys.stderr)
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
