"""The admin tokens: loading them from the settings (`load_admin_token`), and comparing a
sent one with them (`Tokens`), for HTTP (`payloadd.server.http._auth`) and the peer port
alike.

A token is compared in constant time. Its value never appears in a log line, an error
message, a ``repr`` or ``--help``.
"""

from __future__ import annotations

import hmac
import logging
import os
import re
from collections.abc import Sequence

from payloadd.server._sockets import StartError
from payloadd.settings._settings import Settings

__all__ = ["MAX_TOKENS", "MIN_TOKEN_CHARS", "Tokens", "load_admin_token"]

log = logging.getLogger("payloadd")

MIN_TOKEN_CHARS = 16
"""Shortest admin token accepted (e.g. ``openssl rand -hex 32`` gives 64)."""
MAX_TOKENS = 8
"""Most tokens a token file may hold (one a line: the new and the old one, while rotating)."""
_TOKEN = re.compile(rb"[\x21-\x7e]+")  # what an HTTP header can carry after "Bearer "


class Tokens:
    """The admin tokens a daemon accepts: one, or while one is rotated, several (the lines of
    the token file). `accepts` compares a sent token with each in constant time.

    Parameters
    ----------
    tokens : sequence of bytes
        The tokens, the one clients of the file send first.
    """

    def __init__(self, tokens: Sequence[bytes]) -> None:
        self._tokens = tuple(tokens)

    def accepts(self, sent: bytes) -> bool:
        """Whether ``sent`` is one of the tokens (every one is compared, whatever matched)."""
        ok = False
        for token in self._tokens:
            ok |= hmac.compare_digest(sent, token)
        return ok

    def __len__(self) -> int:
        return len(self._tokens)

    def __repr__(self) -> str:  # never the values
        return f"Tokens({len(self._tokens)})"


def load_admin_token(settings: Settings, *, warn: bool = True) -> Tokens | None:
    """Return the configured admin tokens, or ``None`` when there are none; with ``warn``,
    log a warning when the token file is readable by every user.

    ``PAYLOADD_ADMIN_TOKEN`` holds one token; ``admin_token_file`` one a line (empty lines
    ignored), at most `MAX_TOKENS`: every one is accepted, so that a token is rotated without
    a refused call (docs/deployment.md, "Many nodes").

    Raises
    ------
    StartError
        Both ``admin_token`` and ``admin_token_file`` are set; the file cannot be read or
        holds no token, or too many; a token is shorter than `MIN_TOKEN_CHARS` or holds
        characters other than visible ASCII. Messages never include a token.
    """
    if settings.admin_token is not None and settings.admin_token_file is not None:
        raise StartError("give admin_token (PAYLOADD_ADMIN_TOKEN) or admin_token_file, not both")
    if settings.admin_token is not None:
        where = "PAYLOADD_ADMIN_TOKEN"
        tokens = [settings.admin_token.get_secret_value().strip().encode()]
    elif settings.admin_token_file is not None:
        path = settings.admin_token_file
        where = f"admin_token_file {path}"
        try:
            with open(path, "rb") as f:
                tokens = [line.strip() for line in f.read(64 << 10).splitlines() if line.strip()]
            mode = os.stat(path).st_mode
        except OSError as exc:
            raise StartError(f"cannot read {where}: {exc.strerror}") from None
        if warn and mode & 0o004:
            log.warning("%s is readable by every user; make it 0600 or 0640", where)
        if len(tokens) > MAX_TOKENS:
            raise StartError(f"{where} holds {len(tokens)} tokens; at most {MAX_TOKENS}")
        tokens = tokens or [b""]
    else:
        return None
    for token in tokens:
        if len(token) < MIN_TOKEN_CHARS:
            raise StartError(
                f"the admin token in {where} is shorter than {MIN_TOKEN_CHARS} characters"
            )
        if not _TOKEN.fullmatch(token):
            raise StartError(
                f"the admin token in {where} must be visible ASCII characters only (no spaces)"
            )
    return Tokens(tokens)
