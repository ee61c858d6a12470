"""The removal generation: a counter the store makes odd while it removes data files and even
again once they are gone, in a shared page its data-plane clients map read-only.

A data-plane client writes rows through descriptors of its leases and must not acknowledge
rows that went into a file removed meanwhile. Instead of asking the kernel after every write
(``fstat(fd).st_nlink == 0``), it reads this counter after its ``pwrite``: when it reads the
same even value as when it last saw its lease's file linked, no removal began since, so the
rows are in a live file; any other value (a removal under way, or done), it checks its file's
link count as before, and remembers the value only when it is even.

Why both ends: a client that read the value after a removal began but saw its file linked
(before the ``unlink``) must not take that value for "checked", or an ``unlink`` right after
would go unseen; so values read during a removal (odd) are never remembered, and the value
moves again once the removal is over.

The page is a sealed memfd (`GenerationPage`): the daemon writes it through the one mapping
it made before sealing; every descriptor of it is read-only for good (``F_SEAL_FUTURE_WRITE``,
Linux 5.1), so no client can freeze or rewind another's view. The counter is a little-endian
``u64`` at offset 0, naturally aligned, written only under the store's lock. Without memfd or
the seal the store has no page (`GenerationPage.create` gives ``None``) and clients check
the link count after every write.

Ordering: the store makes the counter odd before the ``unlink``; a client reads it after its
``pwrite`` into the same file. Both system calls take the file's inode lock, so an unlink
done before the write is seen with its change of the counter after the write; a write done
before the unlink is a write into a file that was live (the rows go with their step, as for
any append to a step being collected).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import struct
from collections.abc import Iterator

__all__ = ["PAGE_BYTES", "GenerationPage"]

PAGE_BYTES = 4096
"""Size of the page (the counter is its first 8 bytes; the rest is zero, for later use)."""
_U64 = struct.Struct("<Q")
_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)


class GenerationPage:
    """The removal generation of one daemon, in a sealed memfd.

    Use `create`; remove data files only inside `removing` (store lock held); hand clients
    `reader` descriptors.

    Attributes
    ----------
    value : int
        The generation now: odd while files are being removed, else even.
    """

    def __init__(self, fd: int, page: mmap.mmap) -> None:
        self._fd = fd
        self._page = page
        self.value = 0

    @classmethod
    def create(cls) -> GenerationPage | None:
        """A new page, or ``None`` where memfd or its write seal is missing (then clients
        check the link count after every write)."""
        memfd_create = getattr(os, "memfd_create", None)
        if memfd_create is None:
            return None
        try:
            fd = memfd_create(
                "payloadd-generation", os.MFD_CLOEXEC | getattr(os, "MFD_ALLOW_SEALING", 2)
            )
        except OSError:
            return None
        try:
            os.ftruncate(fd, PAGE_BYTES)
            page = mmap.mmap(fd, PAGE_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | _SEAL_FUTURE_WRITE
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals | fcntl.F_SEAL_SEAL)
        except (OSError, ValueError):
            os.close(fd)
            return None
        return cls(fd, page)

    @contextlib.contextmanager
    def removing(self) -> Iterator[None]:
        """Remove data files in the block: the value is odd through it, even after (store
        lock held: one writer)."""
        self._set(self.value + 1)
        try:
            yield
        finally:
            self._set(self.value + 1)

    def _set(self, value: int) -> None:
        self.value = value
        _U64.pack_into(self._page, 0, value)

    def reader(self) -> int:
        """A new descriptor of the page for a client (the caller's to pass and close); it
        can only be mapped read-only.

        Raises
        ------
        OSError
            No descriptor is left (``EMFILE``).
        """
        return os.dup(self._fd)

    def close(self) -> None:
        """Close the daemon's descriptor and mapping (at shutdown; clients keep theirs)."""
        with contextlib.suppress(OSError):
            os.close(self._fd)
        self._page.close()
