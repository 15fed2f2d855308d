"""Which process runs a wheeld instance: the instance lock and the segment locks.

Both are taken by the daemon before it writes anything and held for its whole
life; the kernel drops them when the process dies, however it dies.

* **The instance lock**: an exclusive ``flock(2)`` on
  ``/dev/shm/wheeld-<name>-lock`` (:func:`wheeld.protocol.naming.lock_path`).
  One file for every uid, mode 0644: a daemon of any uid can open it (read-only
  when it is another uid's file) and try the lock, since ``flock`` needs no
  write access; so "one daemon per instance name" holds across users, and a
  daemon that finds the lock held can say who holds it. Its first 32 bytes
  hold the holder's pid in ASCII and a newline, padded with spaces, when the
  holder may write the file. It holds nothing secret.
* **A segment lock**: an open-file-description lock (``fcntl(F_OFD_SETLK)``, a
  write lock on byte 0) on every segment the daemon maps for writing (the
  arena, the client table). A lock file can be unlinked while its daemon runs
  (a ``/dev/shm`` clean-up script, ``RemoveIPC=``); the arena a second daemon
  finds by name is then still locked by the first, so two daemons never write
  one arena. OFD locks, unlike classic POSIX record locks, belong to the open
  file description, so the daemon's other descriptors of the same file
  (``shm_open`` and ``close`` while mapping) cannot drop them, and the
  descriptor ``mmap`` keeps (a ``dup`` of the one the lock was taken on) keeps
  the lock for as long as the segment is mapped: it costs no descriptor of its
  own. A segment made by :meth:`wheeld.shm.arena.Segment.create` is locked by its
  maker that way; one the daemon attaches is locked before it is mapped.

**Who holds it.** Each holder also places read locks far beyond the end of
the file, at offsets that say who it is: ``PID_MARK + pid``, ``UID_MARK +
uid`` and, on the instance lock, ``SPELLING_MARK + 0`` (plain segment names)
or ``+ 1`` (uid-qualified, see :mod:`wheeld.protocol.naming`). Anyone who can open the file, read-only is
enough, reads them with ``F_OFD_GETLK``, which takes no lock
(:func:`read_marks`). The kernel keeps them exactly as long as the holder
lives and the holder needs no write access to leave them (``F_GETLK`` reports
no pid for OFD locks, and a file of another uid cannot be written). They are
what the holder says of itself: right for messages and for finding the arena
of the daemon that runs, not a proof of identity.
"""

from __future__ import annotations

import errno
import fcntl
import glob
import os
import struct
from dataclasses import dataclass

from wheeld.protocol.naming import SHM_DIR, arena_name, clients_name, lock_path, shm_path, shm_prefix

PID_FIELD = 32  # bytes of the pid field at the start of the lock file

PID_MARK = 1 << 40
UID_MARK = 1 << 41
SPELLING_MARK = 1 << 42
_MARK_SPAN = 1 << 32

_F_OFD_GETLK = getattr(fcntl, "F_OFD_GETLK", 36)
_F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)
_FLOCK = struct.Struct("@hhxxxxqqixxxx")  # struct flock: l_type, l_whence, l_start, l_len, l_pid


@dataclass(frozen=True)
class Holder:
    """The daemon holding a lock: its pid (0 when unknown), uid (None when unknown) and
    whether it uses uid-qualified segment names (None when unknown)."""

    pid: int
    uid: int | None = None
    qualified: bool | None = None

    def who(self) -> str:
        uid = f"uid {self.uid}" if self.uid is not None else "an unknown uid"
        return f"{uid}, pid {self.pid or 'unknown'}"

    def describe(self, name: str) -> str:
        return f"instance {name!r} is run by {self.who()}"


def _lk(kind: int, start: int, length: int) -> bytes:
    return _FLOCK.pack(kind, os.SEEK_SET, start, length, 0)


def _getlk(fd: int, start: int, length: int) -> tuple[int, int] | None:
    """(type, start) of a lock of another open file description that a write lock on
    [start, start+length) would meet, or None."""
    kind, _whence, found, _length, _pid = _FLOCK.unpack(
        fcntl.fcntl(fd, _F_OFD_GETLK, _lk(fcntl.F_WRLCK, start, length)))
    return None if kind == fcntl.F_UNLCK else (kind, found)


def lock_segment(fd: int) -> bool:
    """Take the segment lock (``fd`` must be open for writing); False when another holds it."""
    try:
        fcntl.fcntl(fd, _F_OFD_SETLK, _lk(fcntl.F_WRLCK, 0, 1))
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def segment_locked(fd: int) -> bool:
    """Does another open file description hold the segment lock of ``fd``'s file?"""
    return _getlk(fd, 0, 1) is not None


def mark(fd: int, pid: int, uid: int, qualified: bool | None = None) -> None:
    """Leave the holder's marks on ``fd``'s file (``fd`` open for reading is enough); the
    spelling mark only when ``qualified`` is given (the instance lock carries it)."""
    offsets = [PID_MARK + pid, UID_MARK + uid] + ([] if qualified is None else [SPELLING_MARK + int(qualified)])
    for offset in offsets:
        fcntl.fcntl(fd, _F_OFD_SETLK, _lk(fcntl.F_RDLCK, offset, 1))


def read_marks(fd: int) -> Holder | None:
    """The marks another holder left on ``fd``'s file, or None when it has none."""
    pid = _getlk(fd, PID_MARK, _MARK_SPAN)
    if pid is None:
        return None
    uid = _getlk(fd, UID_MARK, _MARK_SPAN)
    spelling = _getlk(fd, SPELLING_MARK, 2)
    return Holder(pid[1] - PID_MARK, None if uid is None else uid[1] - UID_MARK,
                  None if spelling is None else bool(spelling[1] - SPELLING_MARK))


def read_pid(fd, pread=os.pread) -> int:
    """The pid field of an open lock file (0 when it holds none); ``pread`` reads it
    (a shared-memory port's, :class:`wheeld.daemon.host.SharedMemory`)."""
    try:
        return int(pread(fd, PID_FIELD, 0).split()[0])
    except (ValueError, IndexError, OSError):
        return 0


def flock_holder_pid(path: str) -> int | None:
    """The pid holding a ``flock`` on ``path``, from /proc/locks (the kernel records who
    took a flock), read without opening ``path``; 0 when nobody holds one; None when
    /proc/locks cannot be read (``ProcSubset=pid`` hides it)."""
    try:
        st = os.stat(path, follow_symlinks=False)
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return 0 if not os.path.exists(path) else None
    except OSError:
        return None
    wanted = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in lines:
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == wanted:
            return int(fields[4]) if fields[4].lstrip("-").isdigit() and int(fields[4]) > 0 else 0
    return 0


def _proc_uid(pid: int) -> int | None:
    """The uid a process runs as, when /proc shows it to us."""
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def flock_holder(path: str) -> Holder | None:
    """:func:`flock_holder_pid` as a Holder (its uid from /proc when visible); None when
    nobody holds the lock; raises PermissionError when that cannot be told."""
    pid = flock_holder_pid(path)
    if pid is None:
        raise PermissionError(errno.EACCES, "cannot tell who holds the lock: no /proc/locks", path)
    return Holder(pid, _proc_uid(pid)) if pid else None


def lock_file_holder(path: str) -> Holder | None:
    """Who holds the instance lock file at ``path``, or None when nobody does (or the file
    is missing). Takes no lock. Raises PermissionError when that cannot be told: the file
    may not be opened and /proc/locks cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except PermissionError:
        return flock_holder(path)
    try:
        marks = read_marks(fd)
        if marks is not None:
            return marks
        try:  # a holder between its flock and its marks, or an older wheeld
            return flock_holder(path)
        except PermissionError:  # no /proc/locks: the lock itself, shared and at once released
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                pid = read_pid(fd)
                return Holder(pid, _proc_uid(pid) if pid else None)
            return None
    finally:
        os.close(fd)


def lock_paths(name: str) -> list[str]:
    """The instance's lock files: the shared one, then any uid-qualified one."""
    qualified = sorted(glob.glob(os.path.join(glob.escape(SHM_DIR), glob.escape(shm_prefix(name)) + "uid*-lock")))
    return [lock_path(name)] + [p for p in qualified if os.path.basename(p)[len(shm_prefix(name)) + 3:-5].isdigit()]


def holder(name: str) -> Holder | None:
    """The daemon running instance ``name``, or None when none does."""
    denied = None
    for path in lock_paths(name):
        try:
            found = lock_file_holder(path)
        except PermissionError as exc:
            denied = exc
            continue
        if found is not None:
            return found
    if denied is not None:
        raise denied
    return None


def reader_segments(name: str) -> tuple[str, str]:
    """(arena, client table) of instance ``name`` as a reader (``wheelctl``) should look for
    them: those of the daemon running it (its marks say which spelling), else this uid's
    uid-qualified ones when it has them, else the plain ones."""
    try:
        running = holder(name)
    except PermissionError:
        running = None
    if running is not None and running.qualified is not None and running.uid is not None:
        uid = running.uid if running.qualified else None
        return arena_name(name, uid), clients_name(name, uid)
    uid = os.geteuid()
    try:
        if os.stat(shm_path(arena_name(name, uid)), follow_symlinks=False).st_uid == uid:
            return arena_name(name, uid), clients_name(name, uid)
    except FileNotFoundError:
        pass
    return arena_name(name), clients_name(name)
