"""One daemon per instance name, and an arena the daemon can trust.

**The instance lock.** Two daemons on one arena corrupt it: the second one's
attach "repairs" records the first is in the middle of changing, and both drain
the same rings. So before anything is mapped for writing, ``wheeld`` takes an
exclusive ``flock(2)`` on ``/dev/shm/wheeld-<name>-lock`` and keeps it for its
whole life; the kernel drops it when the process dies, however it dies. A second
``wheeld --name NAME`` fails at once with the pid that holds the lock, having
changed nothing. The file holds that pid (for this message and for ``wheelctl
destroy``) and a random secret that outlives restarts (clients' resume tokens
are HMACs under it); it is created 0600 and must belong to the daemon's uid: a
lock file another user created is refused, since that user could hold the lock
forever or know the secret.

**Trusting the arena.** ``/dev/shm`` is writable by everyone (sticky), so the
arena's name can be squatted and the daemon checks what it attaches: the
segment must belong to the daemon's uid and give nobody else write access. A
segment that fails that check, or whose contents are not a usable arena (a
truncated file, another layout version, broken invariants), is *set aside*:
renamed ``wheeld-<name>-arena.unusable-<wall ms>`` so an operator can look at it,
logged at error level, and replaced by a new arena (rebuilt from the journal when
there is one). A restart therefore never refuses to come up because of what a
client or an accident did to the arena; only a segment the daemon may not even
rename (another user's, in the sticky directory) stops it, with a message that
says so.
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import stat
import time

from wheeld.protocol.errors import WheeldError
from wheeld.protocol.instance_lock import PID_FIELD, SECRET_BYTES, read_pid
from wheeld.protocol.naming import lock_path, shm_path


class AlreadyRunning(WheeldError):
    """Another daemon holds the instance lock of this name."""


class UntrustedSegment(WheeldError):
    """A segment of this instance belongs to another user and cannot be set aside."""


class InstanceLock:
    """The exclusive lock of one instance name, held until :meth:`release` or exit."""

    def __init__(self, name: str, fd: int, secret: bytes):
        self.name = name
        self._fd = fd
        self.secret = secret

    @classmethod
    def acquire(cls, name: str) -> InstanceLock:
        path = lock_path(name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            owner = os.fstat(fd).st_uid
            if owner != os.geteuid():
                raise UntrustedSegment(
                    f"{path} belongs to uid {owner}, not to this daemon's uid {os.geteuid()}: another user "
                    f"created it (and could hold the lock forever); remove it as root and start again")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pid = read_pid(fd)
                holder = f"pid {pid}" if pid else "another process"
                raise AlreadyRunning(
                    f"another wheeld ({holder}) is running instance {name!r} (lock {path}); nothing was changed. "
                    f"Stop it first, or pick another --name") from None
            os.fchmod(fd, 0o600)
            secret = os.pread(fd, SECRET_BYTES, PID_FIELD)
            if len(secret) != SECRET_BYTES:
                secret = secrets.token_bytes(SECRET_BYTES)
                os.pwrite(fd, secret, PID_FIELD)
            os.pwrite(fd, f"{os.getpid()}\n".encode().ljust(PID_FIELD, b" "), 0)
        except BaseException:
            os.close(fd)
            raise
        return cls(name, fd, secret)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None


def check_owned(segment_name: str) -> str | None:
    """Why the segment may not be trusted (another owner, writable by others), or None."""
    try:
        st = os.stat(shm_path(segment_name), follow_symlinks=False)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return "it is not a regular file"
    if st.st_uid != os.geteuid():
        return f"it belongs to uid {st.st_uid}, not to this daemon's uid {os.geteuid()}"
    if st.st_mode & 0o022:
        return f"its mode {stat.S_IMODE(st.st_mode):04o} lets other users write it"
    return None


def set_aside(segment_name: str) -> str:
    """Rename an unusable segment out of the way; returns the new name.

    Raises UntrustedSegment when the daemon may not rename it (another user's file
    in the sticky /dev/shm)."""
    source = shm_path(segment_name)
    target = f"{source}.unusable-{time.time_ns() // 1_000_000}"
    try:
        os.rename(source, target)
    except FileNotFoundError:
        return ""
    except OSError as exc:
        if exc.errno in (errno.EPERM, errno.EACCES):
            raise UntrustedSegment(
                f"{source} is unusable and this daemon may not move it ({exc.strerror}); "
                f"remove it as root and start again") from None
        raise
    return os.path.basename(target)
