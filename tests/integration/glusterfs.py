"""A one-brick GlusterFS volume on this machine, mounted twice: two "nodes" with their own
client caches over one shared payload root (``make check-glusterfs``).

Everything listens on 127.0.0.1 only: glusterd by ``transport.socket.bind-address`` in a
glusterd.vol of its own (with a working directory, socket and logs of its own, under the
check's temporary folder), and the brick process inherits the address. The brick's host
name is one that resolves to 127.0.0.1 (``gluster volume create`` refuses ``localhost``
and ``127.0.0.1`` as written). Needs root (glusterd, FUSE mounts); installs the Debian
packages ``glusterfs-server`` and ``glusterfs-client`` when ``glusterd`` is missing.

Every step has a time limit, and `GlusterVolume.stop` undoes what `GlusterVolume.start`
did, in reverse, whatever failed: mounts, volume, processes (by their pids), files.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

__all__ = ["GlusterVolume", "ensure_installed", "loopback_name"]

T = TypeVar("T")
PACKAGES = ("glusterfs-server", "glusterfs-client")
GLUSTERD_PORT = 24007


def ensure_installed() -> None:
    """Install the GlusterFS packages with apt-get when ``glusterd`` is missing.

    Raises
    ------
    RuntimeError
        Not root, or apt-get failed (its output in the message).
    """
    if shutil.which("glusterd") and shutil.which("mount.glusterfs"):
        return
    if os.geteuid() != 0:
        raise RuntimeError("GlusterFS is not installed and only root can install it")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", *PACKAGES]):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}{done.stderr}")


def loopback_name() -> str:
    """A host name of this machine that resolves to 127.0.0.1 and is neither ``localhost``
    nor an address (what a brick may be named).

    Raises
    ------
    RuntimeError
        None does: add one to /etc/hosts (``127.0.0.1 <hostname>``).
    """
    for name in (socket.gethostname(), "localhost.localdomain", "localhost4", "ip6-localhost"):
        with contextlib.suppress(OSError):
            if name and name != "localhost" and socket.gethostbyname(name) == "127.0.0.1":
                return name
    raise RuntimeError(
        "no host name of this machine resolves to 127.0.0.1: add one to /etc/hosts "
        f"(e.g. '127.0.0.1 {socket.gethostname()}')"
    )


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


class GlusterVolume:
    """A one-brick volume under ``base``, mounted at ``base/mount-a`` and ``base/mount-b``.

    Parameters
    ----------
    base : pathlib.Path
        A local directory of the check's own (not on the volume).
    name : str
        The volume's name.
    options : dict, optional
        ``gluster volume set`` options, applied before the volume starts.
    """

    def __init__(
        self, base: Path, name: str = "payloadd-check", options: dict[str, str] | None = None
    ) -> None:
        self.base, self.name = base, name
        self.options = options or {}
        self.workdir, self.brick = base / "glusterd", base / "brick"
        self.logs = base / "logs"
        self.sock = base / "glusterd.socket"
        self.mounts = (base / "mount-a", base / "mount-b")
        self.glusterd_pid: int | None = None
        self.created = False
        self.mounted: list[Path] = []

    # -- start -----------------------------------------------------------------------------

    def start(self) -> None:
        """glusterd, the volume, both mounts.

        Raises
        ------
        RuntimeError
            A step failed or timed out (its output in the message); what was started is
            stopped again by `stop`.
        """
        ensure_installed()
        if _listening(GLUSTERD_PORT):
            raise RuntimeError(
                f"port {GLUSTERD_PORT} is taken (another glusterd?): the check runs its own"
            )
        for d in (self.workdir, self.brick, self.logs, *self.mounts):
            d.mkdir(parents=True, exist_ok=True)
        vol = self.base / "glusterd.vol"
        vol.write_text(
            "volume management\n"
            "    type mgmt/glusterd\n"
            f"    option working-directory {self.workdir}\n"
            "    option transport-type socket\n"
            "    option transport.socket.bind-address 127.0.0.1\n"
            f"    option transport.socket.listen-port {GLUSTERD_PORT}\n"
            "    option ping-timeout 0\n"
            "    option event-threads 1\n"
            "end-volume\n"
        )
        pidfile = self.base / "glusterd.pid"
        self._run(
            "glusterd",
            "-f", str(vol),
            "-p", str(pidfile),
            "-l", str(self.logs / "glusterd.log"),
            "--xlator-option", f"*.glusterd-sockfile={self.sock}",
        )  # fmt: skip
        self.glusterd_pid = int(self._wait_for(lambda: pidfile.read_text().strip(), "pid file"))
        self._wait_for(lambda: _listening(GLUSTERD_PORT) or None, "glusterd to listen")
        self._wait_for(lambda: self.sock.exists() or None, "glusterd's socket")
        host = loopback_name()
        self._gluster("volume", "create", self.name, f"{host}:{self.brick}", "force")
        self.created = True
        for key, value in self.options.items():
            self._gluster("volume", "set", self.name, key, value)
        self._gluster("volume", "start", self.name)
        for m in self.mounts:
            opts = f"log-file={self.logs / (m.name + '.log')}"
            self._run("mount", "-t", "glusterfs", "-o", opts, f"{host}:/{self.name}", str(m))
            self.mounted.append(m)
        self._wait_for(self._both_see_each_other, "both mounts to see one volume")

    def _both_see_each_other(self) -> bool | None:
        probe = self.mounts[0] / ".probe"
        probe.write_bytes(b"x")
        try:
            return (self.mounts[1] / ".probe").exists() or None
        finally:
            probe.unlink()

    def listeners(self) -> list[str]:
        """``address:port`` of every TCP socket the volume's processes listen on."""
        pids = self.pids()
        inodes: set[str] = set()
        for pid in pids:
            with contextlib.suppress(OSError):
                for fd in os.listdir(f"/proc/{pid}/fd"):
                    with contextlib.suppress(OSError):
                        target = os.readlink(f"/proc/{pid}/fd/{fd}")
                        if target.startswith("socket:["):
                            inodes.add(target[8:-1])
        out = []
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with contextlib.suppress(OSError):
                for line in Path(table).read_text().splitlines()[1:]:
                    f = line.split()
                    if f[3] == "0A" and f[9] in inodes:  # LISTEN
                        addr, port = f[1].split(":")
                        v4 = len(addr) == 8
                        ip = socket.inet_ntoa(bytes.fromhex(addr)[::-1]) if v4 else addr
                        out.append(f"{ip}:{int(port, 16)}")
        return out

    def pids(self) -> list[int]:
        """glusterd, the brick process, and the two FUSE clients of this volume."""
        out = [] if self.glusterd_pid is None else [self.glusterd_pid]
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            with contextlib.suppress(OSError):
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
                text = b" ".join(cmd).decode(errors="replace")
                if str(self.brick) in text or any(str(m) in text for m in self.mounts):
                    out.append(int(entry))
        return sorted(set(out))

    # -- stop ------------------------------------------------------------------------------

    def stop(self) -> None:
        """Unmount, stop and delete the volume, end the processes it started (by pid) and
        remove its files; each step goes on when an earlier one failed."""
        for m in reversed(self.mounted):
            if subprocess.run(["umount", str(m)], capture_output=True, timeout=60).returncode:
                subprocess.run(["umount", "-l", str(m)], capture_output=True, timeout=60)
        self.mounted.clear()
        started = self.pids()
        if self.created:
            with contextlib.suppress(RuntimeError):
                self._gluster("volume", "stop", self.name, "force")
            with contextlib.suppress(RuntimeError):
                self._gluster("volume", "delete", self.name)
            self.created = False
        for pid in started:  # what is left of what this volume started
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(_alive(p) for p in started):
            time.sleep(0.1)
        for pid in started:
            if _alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self.glusterd_pid = None
        shutil.rmtree(self.base, ignore_errors=True)

    @contextlib.contextmanager
    def running(self) -> Iterator[GlusterVolume]:
        """`start`, yield, then `stop` whatever happened."""
        try:
            self.start()
            yield self
        finally:
            self.stop()

    def set(self, key: str, value: str) -> None:
        """``gluster volume set`` on the running volume (its clients switch to the new graph
        within a moment)."""
        self._gluster("volume", "set", self.name, key, value)

    def reset(self, key: str) -> None:
        """``gluster volume reset``: the option's default again."""
        self._gluster("volume", "reset", self.name, key)

    # -- helpers ---------------------------------------------------------------------------

    def _gluster(self, *args: str) -> str:
        return self._run("gluster", "--mode=script", f"--glusterd-sock={self.sock}", *args)

    def drop_caches(self, *paths: Path) -> None:
        """Make the next reads of ``paths`` (files through a mount) cold: the pages of each
        dropped on the mount and on the brick (``POSIX_FADV_DONTNEED``), and the kernel's
        clean caches (``/proc/sys/vm/drop_caches``)."""
        for p in paths:
            rel = os.path.relpath(p, next(m for m in self.mounts if str(p).startswith(str(m))))
            for q in (p, self.brick / rel):
                fd = os.open(q, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
        os.sync()
        with contextlib.suppress(OSError), open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")

    @staticmethod
    def _run(*cmd: str) -> str:
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{' '.join(cmd)} did not finish in 120 s") from None
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr}")
        return done.stdout

    @staticmethod
    def _wait_for(probe: Callable[[], T | None], what: str, timeout: float = 60.0) -> T:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError, ValueError):
                got = probe()
                if got:
                    return got
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}")
            time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):  # a zombie is not alive
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    return False
