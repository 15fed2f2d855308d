"""The instance lock file: which process runs a wheeld instance.

``/dev/shm/wheeld-<name>-lock`` (:func:`wheeld.protocol.naming.lock_path`) is
held with an exclusive ``flock(2)`` by the daemon of that instance for its
whole life (:class:`wheeld.daemon.instance.InstanceLock` takes it). Its bytes::

    0 .. 31   the holder's pid in ASCII, a newline, padded with spaces
    32 .. 63  a random secret that outlives restarts (the daemon's own)

``wheelctl destroy`` reads the holder here to refuse removing a running
daemon's segments.
"""

from __future__ import annotations

import fcntl
import os

from .naming import lock_path

PID_FIELD = 32  # bytes of the pid field; the secret follows it
SECRET_BYTES = 32


def holder(name: str) -> int | None:
    """The pid of the daemon holding instance ``name``'s lock, 0 if the holder is
    unknown, or None when nobody holds it (or there is no lock file)."""
    try:
        fd = os.open(lock_path(name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return read_pid(fd)
        return None
    finally:
        os.close(fd)


def read_pid(fd: int) -> int:
    """The pid field of an open lock file (0 when it holds none)."""
    try:
        return int(os.pread(fd, PID_FIELD, 0).split()[0])
    except (ValueError, IndexError, OSError):
        return 0
