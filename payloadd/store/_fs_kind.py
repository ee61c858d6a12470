"""What file system the payload root is on, and the defaults that make reads across nodes
right on it.

A local file system (ext4, XFS, btrfs, tmpfs…) has one page cache: two daemons on it see
every byte the other wrote, at once. A distributed one (GlusterFS or any FUSE file system,
NFS, Lustre, GPFS, CephFS, SMB…) gives each node its own client caches, so a node may see
another node's file with the size (and pages) it had a moment ago, and a removed file
still readable through a descriptor or a cached name. Measured on GlusterFS 10.3 (two FUSE
mounts of one volume; docs/deployment.md): a file's size as another mount sees it lags by
about a second after an append, and a descriptor of a removed file reads its old bytes.

`detect` tells the kind from ``statfs``'s ``f_type`` (the kernel's magic number) and names it
from ``/proc/self/mountinfo`` (which has FUSE's subtype, ``fuse.glusterfs``);
`RootPolicy.for_kind` picks the defaults for it: how long a read waits for another node's
file to show a segment's bytes, how long garbage collection waits between writing its ledger
line and removing files, whether descriptors of other nodes' files are kept, and whether
two appends may write one file at once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

__all__ = ["LOCAL_POLICY", "FsKind", "RootPolicy", "detect"]

# statfs f_type magic numbers (linux/magic.h and the file systems' own headers)
_LOCAL = {
    0xEF53: "ext4",
    0x58465342: "xfs",
    0x9123683E: "btrfs",
    0x01021994: "tmpfs",
    0x2FC12FC1: "zfs",
    0x794C7630: "overlay",
    0xF2F52010: "f2fs",
    0x858458F6: "ramfs",
    0x3153464A: "jfs",
    0x52654973: "reiserfs",
}
_DISTRIBUTED = {
    0x65735546: "fuse",
    0x6969: "nfs",
    0x0BD00BD0: "lustre",
    0x47504653: "gpfs",
    0x00C36400: "ceph",
    0xFF534D42: "cifs",
    0xFE534D42: "smb2",
    0x01021997: "9p",
    0x19830326: "beegfs",
    0x5346414F: "afs",
    0x6B414653: "afs",
}
_DISTRIBUTED_NAMES = ("fuse", "nfs", "lustre", "gpfs", "ceph", "cifs", "smb", "9p", "beegfs")


@dataclass(frozen=True)
class FsKind:
    """The file system a path is on.

    Attributes
    ----------
    name : str
        Its type as the mount table names it (``ext4``, ``fuse.glusterfs``, ``nfs4``), or
        from its magic number when the mount table does not say.
    magic : int
        ``statfs`` ``f_type``; 0 when unknown.
    mount : str
        The mount point it is on; ``""`` when unknown.
    distributed : bool
        Each node has its own client caches (or the kind is unknown: treated so).
    """

    name: str
    magic: int
    mount: str
    distributed: bool


def _statfs_magic(path: str) -> int:
    """``f_type`` of ``statfs(path)``; 0 when the call is unavailable or fails."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    except OSError:
        return 0

    class _Statfs(ctypes.Structure):  # f_type leads struct statfs on every Linux ABI
        _fields_ = [("f_type", ctypes.c_long), ("_rest", ctypes.c_byte * 256)]

    buf = _Statfs()
    if libc.statfs(os.fsencode(path), ctypes.byref(buf)) != 0:
        return 0
    return int(buf.f_type) & 0xFFFFFFFF


def _mount_of(path: str, mountinfo: str) -> tuple[str, str]:
    """``(mount point, type)`` of the mount ``path`` is on, from the text of a mountinfo
    file; ``("", "")`` when none matches."""
    best = ("", "")
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, rest = left.split(), right.split()
        if not sep or len(fields) < 5 or not rest:
            continue
        point = fields[4].replace("\\040", " ").replace("\\011", "\t").replace("\\134", "\\")
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best[0]):  # the last of equal points is on top
            best = (point, rest[0])
    return best


def detect(path: str | os.PathLike[str], mountinfo: str | None = None) -> FsKind:
    """The file system ``path`` (an existing directory) is on.

    Parameters
    ----------
    path : path
        A directory on it (the payload root).
    mountinfo : str, optional
        The text of a mountinfo file; default: ``/proc/self/mountinfo`` (none where it is
        missing).

    Returns
    -------
    FsKind
        A kind neither the magic number nor the mount table knows is ``distributed``: the
        safe guess.
    """
    real = os.path.realpath(path)
    magic = _statfs_magic(real)
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            mountinfo = ""
    mount, fstype = _mount_of(real, mountinfo)
    if magic in _LOCAL:
        distributed = False
    elif magic in _DISTRIBUTED:
        distributed = True
    else:
        base = fstype.partition(".")[0]
        distributed = not (base in _LOCAL.values() or base in ("ext2", "ext3", "vfat"))
        distributed = distributed or base.startswith(_DISTRIBUTED_NAMES)
    name = fstype or _LOCAL.get(magic) or _DISTRIBUTED.get(magic) or "unknown"
    return FsKind(name, magic, mount, distributed)


@dataclass(frozen=True)
class RootPolicy:
    """How the store treats other nodes' files and its own appends on a root's file system.

    Attributes
    ----------
    foreign_reads : {"cached", "reopen"}
        Keep the daemon's descriptors of other nodes' files, or open them anew for every
        read (on NFS a fresh open revalidates the file's size and pages: close-to-open).
        Data-plane clients keep them only on a local file system (`client_keeps_foreign`).
    foreign_wait_s : float
        Longest wait, in seconds, for another node's file to show a segment's bytes (its
        size as this node sees it lags) before a read fails.
    gc_grace_s : float
        Seconds garbage collection waits between writing its ledger line and removing the
        files, so that every node sees the line before the files go.
    one_writer : bool
        At most one append writes a shared data file at a time, so no other node ever reads
        (and caches) a range of it that is not written yet.
    client_keeps_foreign : bool
        Data-plane clients may keep descriptors of other nodes' files. Never on a
        distributed file system: a descriptor of a file another node removed may still read
        its old bytes there, and only the daemon checks that node's ledger at every read.
    """

    foreign_reads: Literal["cached", "reopen"]
    foreign_wait_s: float
    gc_grace_s: float
    one_writer: bool
    client_keeps_foreign: bool

    FOREIGN_WAIT_S = 5.0
    """Default wait on a distributed file system: the size GlusterFS's FUSE client shows
    another node lagged by up to about 1 s (its attribute and metadata caches, 1 s each by
    default: up to 2 s stacked), NFS's by its ``acregmin`` (3 s) unless a fresh open
    revalidates; 5 s covers both with room."""
    GC_GRACE_S = 2.5
    """Default grace on a distributed file system: beyond the ~2 s a node's view of a ledger
    may lag on GlusterFS (its two 1 s caches)."""

    @classmethod
    def for_kind(
        cls,
        kind: FsKind,
        foreign_reads: Literal["auto", "cached", "reopen"] = "auto",
        foreign_wait_s: float | None = None,
        gc_grace_s: float | None = None,
    ) -> RootPolicy:
        """The defaults for ``kind``, overridden by what was set (``None``/``"auto"``: by
        kind)."""
        d = kind.distributed
        return cls(
            foreign_reads=("reopen" if d else "cached")
            if foreign_reads == "auto"
            else foreign_reads,
            foreign_wait_s=(cls.FOREIGN_WAIT_S if d else 0.0)
            if foreign_wait_s is None
            else foreign_wait_s,
            gc_grace_s=(cls.GC_GRACE_S if d else 0.0) if gc_grace_s is None else gc_grace_s,
            one_writer=d,
            client_keeps_foreign=not d and foreign_reads != "reopen",
        )

    def describe(self, kind: FsKind) -> str:
        """The policy in words, for the log at start."""
        what = "distributed" if kind.distributed else "local"
        reads = "opened anew at every read" if self.foreign_reads == "reopen" else "kept open"
        out = f"{what}; other nodes' files {reads}"
        if self.foreign_wait_s > 0:
            out += f", waited for up to {self.foreign_wait_s:g} s"
        if not self.client_keeps_foreign:
            out += ", never kept by data-plane clients"
        if self.gc_grace_s > 0:
            out += f"; GC removes files {self.gc_grace_s:g} s after its ledger line"
        if self.one_writer:
            out += "; one append at a time writes a shared file"
        return out

    def warnings(self, kind: FsKind) -> list[str]:
        """What this policy does not guarantee on ``kind``, in words (empty: nothing)."""
        if not kind.distributed:
            return []
        out = []
        if self.foreign_wait_s <= 0:
            out.append(
                "foreign_wait_s is 0: a read of another node's file that grew since this "
                "node last saw it fails with SegmentFileError until this node's cache catches up"
            )
        if self.gc_grace_s <= 0:
            out.append(
                "gc_grace_s is 0: for a moment after a collection, other nodes may read its "
                "files' old rows, or answer 404 instead of 410"
            )
        return out


LOCAL_POLICY = RootPolicy(
    foreign_reads="cached",
    foreign_wait_s=0.0,
    gc_grace_s=0.0,
    one_writer=False,
    client_keeps_foreign=True,
)
"""The policy of a local file system with the defaults (one page cache for every daemon)."""
