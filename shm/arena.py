"""Create, attach and unlink the shared-memory segments wheeld lives in.

Segments are POSIX shared memory (``posix_ipc`` + ``mmap``), never
``multiprocessing.shared_memory``: the standard library's resource tracker
unlinks a segment when any process that attached it exits (Python 3.11-3.13),
which would delete a live arena under the daemon's feet.

A segment created with ``name=None`` is private anonymous memory: the same code
runs in-process (tests, the in-process purgatory) without touching /dev/shm.

A segment the daemon maps through its shared-memory port
(:class:`wheeld.daemon.host.SharedMemory`: :class:`wheeld.shm.named.RealShm`, or the
simulator's) carries that port in ``shm``: its ``close``, ``rename`` and ``unlink``
go through it.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from typing import Any

import posix_ipc

from wheeld.protocol.errors import CorruptArena, InvalidRequest
from wheeld.shm.instance_lock import lock_segment, mark
from wheeld.protocol.naming import shm_path


def normalize_name(name: str) -> str:
    """POSIX shm names start with one slash and contain no other."""
    if not name or not isinstance(name, str):
        raise InvalidRequest("a shared-memory name must be a non-empty string")
    name = "/" + name.lstrip("/")
    if "/" in name[1:] or len(name) > 250:
        raise InvalidRequest(f"invalid shared-memory name {name!r}")
    return name


@dataclass
class Segment:
    """A mapped segment: ``buf`` is the mmap, ``name`` None for private memory; ``shm``
    the port that mapped it (None: ``posix_ipc`` and ``/dev/shm`` directly)."""

    buf: mmap.mmap
    name: str | None
    size: int
    readonly: bool = False
    shm: Any = None

    @classmethod
    def create(cls, name: str | None, size: int, mode: int = 0o600) -> "Segment":
        """A new segment ``name`` (private memory when None). A named one is locked by its
        maker, with its marks, before anything is written (a segment lock of
        :mod:`wheeld.shm.instance_lock`), for as long as it is mapped."""
        if name is None:
            return cls(mmap.mmap(-1, size), None, size)
        name = normalize_name(name)
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=mode, size=size)
        try:
            os.fchmod(shm.fd, mode)  # exactly ``mode``: shm_open filters it through the umask
            if not lock_segment(shm.fd):
                raise FileExistsError(f"segment {name} was locked by another process as it was made")
            mark(shm.fd, os.getpid(), os.geteuid())
            buf = mmap.mmap(shm.fd, size)  # its descriptor shares the locked open file description
        except BaseException:
            shm.close_fd()
            posix_ipc.unlink_shared_memory(name)
            raise
        shm.close_fd()
        return cls(buf, name, size)

    @classmethod
    def attach(cls, name: str, readonly: bool = False, fd: int | None = None) -> "Segment":
        """Map segment ``name``; or, with ``fd``, the file open on that descriptor (it stays
        the caller's; the mapping's own descriptor shares its open file description, and
        with it a segment lock taken on it)."""
        name = normalize_name(name)
        shm = None
        if fd is None:
            try:
                shm = posix_ipc.SharedMemory(name, flags=0, read_only=readonly)
            except posix_ipc.ExistentialError as exc:
                raise FileNotFoundError(f"no shared-memory segment {name}") from exc
            fd = shm.fd
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                raise CorruptArena(f"segment {name} is empty")
            prot = mmap.PROT_READ if readonly else mmap.PROT_READ | mmap.PROT_WRITE
            buf = mmap.mmap(fd, size, prot=prot)
        finally:
            if shm is not None:
                shm.close_fd()
        return cls(buf, name, size, readonly)

    def close(self) -> None:
        if self.shm is not None:
            self.shm.unmap(self)
            return
        close_mapping(self.buf)

    def unlink(self) -> None:
        if self.name is None:
            return
        if self.shm is None:
            unlink(self.name)
            return
        try:
            self.shm.unlink(shm_path(self.name))
        except FileNotFoundError:
            pass

    def rename(self, new_name: str) -> None:
        """Give the segment another name, atomically (Linux keeps POSIX shared memory as
        files in /dev/shm, and a rename there replaces any segment of that name). The
        mapping stays valid."""
        new_name = normalize_name(new_name)
        (os if self.shm is None else self.shm).rename(shm_path(self.name), shm_path(new_name))
        self.name = new_name


def close_mapping(buf: mmap.mmap) -> None:
    """Unmap ``buf``, unless views of it are still alive somewhere (it goes with them)."""
    try:
        buf.close()
    except BufferError:
        pass


def unlink(name: str) -> bool:
    """Remove a segment by name; True if it existed."""
    try:
        posix_ipc.unlink_shared_memory(normalize_name(name))
        return True
    except posix_ipc.ExistentialError:
        return False


def remove_instance_segments(name: str) -> list[str]:
    """Remove every shared-memory file of daemon instance ``name`` (lock, arena, client
    table, secret, in plain and uid-qualified spelling, and set-aside copies:
    :func:`wheeld.protocol.naming.instance_entries`); the names removed, sorted. A file
    that vanishes meanwhile is skipped; PermissionError (with its ``filename``) stops at
    the first file this process may not remove."""
    from wheeld.protocol.naming import SHM_DIR, instance_entries

    removed = []
    for entry in sorted(instance_entries(name, os.listdir(SHM_DIR))):
        try:
            os.unlink(os.path.join(SHM_DIR, entry))
        except FileNotFoundError:
            continue
        removed.append(entry)
    return removed
