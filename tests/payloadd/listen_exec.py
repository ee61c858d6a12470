"""Exec a command with listening sockets passed as systemd passes them (sd_listen_fds).

``python listen_exec.py FD[=NAME] ... -- COMMAND ...``: the descriptors given (inherited
from the caller, e.g. through ``pass_fds``) become 3, 4, ... in order, the others given are
closed, ``LISTEN_FDS`` counts them, ``LISTEN_FDNAMES`` names them (when every one has a
name) and ``LISTEN_PID`` is this process's pid, which the command keeps: it replaces this
process (``execv``), as systemd's own exec does.
"""

from __future__ import annotations

import fcntl
import os
import sys


def main(argv: list[str]) -> None:
    split = argv.index("--")
    specs, command = argv[:split], argv[split + 1 :]
    fds: list[int] = []
    names: list[str] = []
    for spec in specs:
        number, _, name = spec.partition("=")
        fds.append(int(number))
        names.append(name)
    # out of the way first: a descriptor given may itself be 3 or 4
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 100) for fd in fds]
    for fd in fds:
        os.close(fd)
    for i, fd in enumerate(high):
        os.dup2(fd, 3 + i)  # inheritable
        os.close(fd)
    os.environ["LISTEN_FDS"] = str(len(fds))
    os.environ["LISTEN_PID"] = str(os.getpid())
    if all(names):
        os.environ["LISTEN_FDNAMES"] = ":".join(names)
    else:
        os.environ.pop("LISTEN_FDNAMES", None)
    os.execv(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
