"""The daemon's status page (layout: :mod:`wheeld.protocol.status_layout`).

The daemon creates it (:meth:`StatusPage.create`) and writes it; each client maps
the read-only descriptor it received at the handshake (:meth:`StatusPage.attach`).
A client that maps it cannot write it (not even through a descriptor it opens
again read-write: the page is write-sealed, see :mod:`wheeld.shm.memfd`), resize
it, or learn anything about other clients from it.
"""

from __future__ import annotations

import mmap
import os

from wheeld.protocol import status_layout as layout
from wheeld.protocol.errors import ProtocolError

from . import memfd


class StatusPage:
    """``words`` is the page as 8-byte signed words (index with ``layout.*_WORD``)."""

    def __init__(self, buf: mmap.mmap, fd: int | None, readonly_fd: int | None):
        self._buf = buf
        self.fd = fd
        self.readonly_fd = readonly_fd
        self.words = memoryview(buf).cast("q")

    @classmethod
    def create(cls, name: str) -> StatusPage:
        """Daemon side: a sealed page and a read-only descriptor of it to hand to clients."""
        fd = memfd.create_sealed(name, layout.PAGE_BYTES, final=False)
        buf = mmap.mmap(fd, layout.PAGE_BYTES)
        layout.HEADER.pack_into(buf, 0, layout.MAGIC, layout.LAYOUT_VERSION)
        memfd.seal_writes(fd)  # a client re-opening its descriptor O_RDWR still cannot write
        try:
            readonly_fd = memfd.reopen_readonly(fd)
        except OSError:
            readonly_fd = None  # no /proc: clients get no page and ring the doorbell every time
        return cls(buf, fd, readonly_fd)

    @classmethod
    def attach(cls, fd: int) -> StatusPage:
        """Client side: map the read-only page the daemon passed; closes ``fd``."""
        try:
            if os.fstat(fd).st_size < layout.PAGE_BYTES:
                raise ProtocolError("the daemon's status page is too small")
            buf = mmap.mmap(fd, layout.PAGE_BYTES, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        magic, version = layout.HEADER.unpack_from(buf, 0)
        if magic != layout.MAGIC or version != layout.LAYOUT_VERSION:
            buf.close()
            raise ProtocolError(f"not a wheeld status page of layout {layout.LAYOUT_VERSION}")
        return cls(buf, None, None)

    def publish(self, capacity: int, pending: int, fired_unacked: int) -> None:
        words = self.words
        words[layout.CAPACITY_WORD] = capacity
        words[layout.PENDING_WORD] = pending
        words[layout.FIRED_UNACKED_WORD] = fired_unacked

    def close(self) -> None:
        self.words.release()
        try:
            self._buf.close()
        except BufferError:
            pass  # a view is still held; the mapping goes with it
        for fd in (self.fd, self.readonly_fd):
            if fd is not None:
                os.close(fd)
        self.fd = self.readonly_fd = None
