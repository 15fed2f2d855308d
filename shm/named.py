"""Named shared memory on Linux: the real port the daemon's start-up goes through.

:class:`RealShm` implements :class:`wheeld.daemon.host.SharedMemory` with the
system calls start-up always made: POSIX shared memory is a file in ``/dev/shm``
(``shm_open`` is ``open`` there with ``O_NOFOLLOW | O_CLOEXEC``), opened never
through a symlink and never blocking on a FIFO; the instance lock is a
``flock(2)``; the segment locks and the marks are the open-file-description
locks of :mod:`wheeld.shm.instance_lock`; a mapping is an ``mmap`` whose own
descriptor shares the locked open file description (:class:`wheeld.shm.arena.Segment`).

It decides nothing: which file may be trusted, what is set aside and who runs
the instance are :mod:`wheeld.daemon.instance`'s questions. A handle is a file
descriptor.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import time

from wheeld.shm import instance_lock
from wheeld.protocol.errors import CorruptArena

from .arena import Segment, close_mapping, normalize_name

_OPEN = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # never a symlink; never block on a FIFO
_MARKS_WAIT_S = 0.5  # a holder marks its lock right after taking it


class RealShm:
    """``/dev/shm`` through ``os``, ``fcntl`` and ``mmap`` (see the module docstring)."""

    def open(self, path: str, write: bool) -> int:
        return os.open(path, (os.O_RDWR if write else os.O_RDONLY) | _OPEN)

    def create(self, path: str, mode: int) -> int:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _OPEN, mode)
        try:
            os.fchmod(fd, mode)  # exactly: the umask filtered it
        except BaseException:
            os.close(fd)
            raise
        return fd

    close = staticmethod(os.close)
    fstat = staticmethod(os.fstat)
    fchmod = staticmethod(os.fchmod)
    ftruncate = staticmethod(os.ftruncate)
    pread = staticmethod(os.pread)
    pwrite = staticmethod(os.pwrite)
    chown = staticmethod(os.chown)
    chmod = staticmethod(os.chmod)
    rename = staticmethod(os.rename)
    unlink = staticmethod(os.unlink)

    @staticmethod
    def stat(path: str) -> os.stat_result | None:
        try:
            return os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            return None

    @staticmethod
    def flock(fd: int) -> bool:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    lock = staticmethod(instance_lock.lock_segment)
    mark = staticmethod(instance_lock.mark)
    read_marks = staticmethod(instance_lock.read_marks)
    flock_holder_pid = staticmethod(instance_lock.flock_holder_pid)
    flock_holder = staticmethod(instance_lock.flock_holder)

    @staticmethod
    def wait_marks(fd: int) -> instance_lock.Holder | None:
        end = time.monotonic() + _MARKS_WAIT_S
        while True:
            found = instance_lock.read_marks(fd)
            if found is not None or time.monotonic() >= end:
                return found
            time.sleep(0.01)

    def map(self, fd: int, name: str, size: int | None = None) -> Segment:
        if size is None:
            size = os.fstat(fd).st_size
            if size == 0:
                raise CorruptArena(f"segment {name} is empty")
        buf = mmap.mmap(fd, size)  # its descriptor shares the locked open file description
        return Segment(buf, normalize_name(name), size, shm=self)

    @staticmethod
    def unmap(segment: Segment) -> None:
        close_mapping(segment.buf)
