"""One daemon per instance name and per arena, and segments the daemon can trust.

**The instance lock.** Before anything is written, ``wheeld`` takes the
instance lock, ``/dev/shm/wheeld-<name>-lock`` (:mod:`wheeld.shm.instance_lock`
describes it), and keeps it for its whole life. The file is shared by every
uid (mode 0644): the lock is *tried* first, whoever owns the file, so a daemon
of the same name finds out who runs the instance, whatever its uid, and exits
with one line, ``instance NAME is run by uid U, pid P``, having changed
nothing. A lock file another uid made that this uid may not even open (an
older wheeld made them 0600) is judged by ``/proc/locks``: held, the same
refusal; free, the daemon takes a lock of its own uid instead
(``wheeld-<name>-uid<U>-lock``).

**The segment locks.** A lock file can be unlinked under a running daemon (a
``/dev/shm`` clean-up script, ``RemoveIPC=``). So the daemon also locks every
segment it maps for writing (arena, client table: an OFD lock on the segment's
open file description, which its mapping keeps) before it writes it; a second
daemon that got past a removed lock file finds the arena locked and exits
naming the holder. While it runs,
the daemon looks once a second whether the lock file and its segments still
have their names (:meth:`InstanceLock.check`, :class:`HeldSegment`): a removed
lock file is made again; a removed or replaced arena or client table cannot be
(Linux cannot give an unlinked file its name back), so the daemon says so at
error level and in its sd_notify status, and keeps serving from the segment it
has mapped. Its timers then end with the process, unless a journal rebuilds
them at the next start.

**Names across users.** The plain segment names belong to whoever made them.
A daemon whose uid does not own the plain segments it finds (a root ``wheeld``
run by hand left its arena, say), or that already has uid-qualified ones, uses
the uid-qualified names (:func:`choose_names`, :mod:`wheeld.protocol.naming`),
and its marks on the instance lock say so, so ``wheelctl`` finds its arena. A
restart therefore never refuses, nor removes anything, because of what another
uid left.

**Trusting a segment.** ``/dev/shm`` is writable by everyone (sticky), so the
daemon checks what it attaches: the segment must belong to the daemon's uid and
give nobody else write access. A segment that fails that check, or whose
contents are not a usable arena (a truncated file, another layout version,
broken invariants), is *set aside*: renamed
``wheeld-<name>-arena.unusable-<wall ms>`` so an operator can look at it,
logged at error level, and replaced by a new one (rebuilt from the journal when
there is one). Only a segment the daemon may not even rename (another user's,
in the sticky directory, under a name only an attacker makes) stops it, with a
message that says so.

**The secret.** Resume tokens are HMACs under a random secret that outlives
restarts: ``/dev/shm/wheeld-<name>-secret`` (or its uid-qualified spelling),
mode 0600, the daemon's own.

A start that is refused removes what it created (:meth:`InstanceLock.abandon`).

**The host.** Every file operation, lock and mark goes through ``host.shm``
(:class:`wheeld.daemon.host.SharedMemory`), the daemon's uid and pid are
``host.euid`` and ``host.pid``, a new secret comes from ``host.rng`` and the
stamp of a set-aside copy from ``host.wall_ms``: the real daemon passes
:func:`~wheeld.daemon.host.real_host`, the simulator its simulated shared memory
(``tests/sim/shm.py``). Entry points: :meth:`InstanceLock.acquire` ``(name, host)``,
:func:`take_segment`, :func:`create_segment`, :func:`set_aside` ``(host, ...)``,
:class:`HeldSegment` ``(kind, segment_name, identity, shm)``.
"""

from __future__ import annotations

import errno
import logging
import os
import stat

from wheeld.protocol.errors import WheeldError
from wheeld.shm.instance_lock import PID_FIELD, Holder, read_pid
from wheeld.protocol.naming import arena_name, lock_path, secret_name, segment_names, shm_path

from .host import Host, SharedMemory, real_host

log = logging.getLogger("wheeld")

SECRET_BYTES = 32


class AlreadyRunning(WheeldError):
    """Another daemon holds the instance lock of this name, or one of its segments."""


class UntrustedSegment(WheeldError):
    """A segment of this instance belongs to another user and cannot be set aside."""


class Unusable(Exception):
    """A segment that exists but may not be used (its reason is the message)."""


def _same_file(shm: SharedMemory, fd, path: str) -> bool:
    st = shm.stat(path)
    if st is None:
        return False
    own = shm.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _owner(shm: SharedMemory, path: str) -> int | None:
    st = shm.stat(path)
    return None if st is None else st.st_uid


def choose_names(shm: SharedMemory, name: str, uid: int) -> int | None:
    """The uid qualifying the segment names a daemon of ``uid`` uses (None: the plain names).

    Qualified when this uid already has qualified segments (they hold its timers),
    or when a plain segment exists that another uid owns; else plain."""
    qualified = [shm_path(n) for n in segment_names(name, uid)]
    if any(_owner(shm, p) == uid for p in qualified):
        return uid
    plain = [shm_path(n) for n in segment_names(name)] + [shm_path(arena_name(name)) + ".new"]
    if any(_owner(shm, p) not in (None, uid) for p in plain):
        return uid
    return None


def _held_by(shm: SharedMemory, path: str) -> Holder | None:
    """The marks of whoever holds a segment or lock file (read without locking anything)."""
    try:
        fd = shm.open(path, write=False)
    except OSError:
        return None
    try:
        return shm.read_marks(fd)
    finally:
        shm.close(fd)


def _unmarked_holder(shm: SharedMemory, path: str, fd) -> Holder:
    """Who holds a lock file without marks (an older wheeld, or not a wheeld at all)."""
    try:
        found = shm.flock_holder(path)
    except PermissionError:
        found = None
    return found or Holder(read_pid(fd, shm.pread))


def _running(name: str, holder: Holder | None, path: str, detail: str = "") -> AlreadyRunning:
    who = holder.describe(name) if holder is not None else f"instance {name!r} is run by another process"
    return AlreadyRunning(f"{who} ({detail or 'it holds ' + path}); nothing was changed: stop it first, "
                          f"or pick another --name")


# ---------------------------------------------------------------------------- the instance lock
def _open_lock(shm: SharedMemory, path: str) -> tuple[object, bool, bool] | None:
    """(fd, created, writable) of the lock file at ``path``, made (0644) when missing;
    None when this uid cannot use that file as a lock (it may not open it, or it is not
    a regular file)."""
    while True:
        try:
            return shm.create(path, 0o644), True, True
        except FileExistsError:
            pass
        try:
            fd, writable = shm.open(path, write=True), True
        except FileNotFoundError:
            continue  # removed meanwhile: make it
        except PermissionError:
            try:
                fd, writable = shm.open(path, write=False), False
            except FileNotFoundError:
                continue
            except OSError:
                return None
        except OSError:  # a symlink (ELOOP), a directory (EISDIR)...
            return None
        if not stat.S_ISREG(shm.fstat(fd).st_mode):
            shm.close(fd)
            return None
        return fd, False, writable


class InstanceLock:
    """The instance lock of ``name``, held until :meth:`release` or exit; ``qualifier`` is
    the uid of the segment names this daemon uses (None: plain); ``secret`` its secret.
    Take it with :meth:`acquire`."""

    def __init__(self, name: str, path: str, fd, writable: bool, host: Host):
        self.name = name
        self.path = path
        self._fd = fd
        self._writable = writable
        self.host = host
        self._shm = host.shm
        self.uid = host.euid
        self.qualifier: int | None = None
        self.secret = b""
        self.created: list[str] = []  # files this start made (a refused start removes them)
        self._problem: str | None = None

    @classmethod
    def acquire(cls, name: str, host: Host | None = None) -> InstanceLock:
        """Take the instance lock of ``name`` on ``host`` (default: the real one), choose the
        segment names and load the secret; raises AlreadyRunning (another daemon runs the
        instance) or UntrustedSegment, having changed nothing."""
        if host is None:
            host = real_host()
        lock, created = cls._take(name, host)
        try:
            if created:
                lock.created.append(lock.path)
            lock.qualifier = choose_names(host.shm, name, lock.uid)
            host.shm.mark(lock._fd, host.pid, lock.uid, lock.qualifier is not None)
            lock.secret = lock._load_secret()
            lock._write_pid()
        except BaseException:
            lock.abandon()
            raise
        if lock.qualifier is not None:
            log.info("instance %r: segments of another uid have the plain names; this daemon (uid %d) uses "
                     "/dev/shm/wheeld-%s-uid%d-*", name, lock.uid, name, lock.uid)
        return lock

    @classmethod
    def _take(cls, name: str, host: Host) -> tuple[InstanceLock, bool]:
        shm, uid = host.shm, host.euid
        path = lock_path(name)
        for _ in range(100):
            opened = _open_lock(shm, path)
            if opened is None:
                if path != lock_path(name):
                    raise UntrustedSegment(f"{path} cannot be used as this daemon's lock (it is another user's or "
                                           f"not a regular file, and no process holds it): remove it and start again")
                pid = shm.flock_holder_pid(path)
                owner = _owner(shm, path)
                if pid:
                    raise _running(name, shm.flock_holder(path) or Holder(pid), path,
                                   f"it holds {path}, a lock file this uid {uid} may not open")
                log.warning("%s belongs to uid %s and this daemon (uid %d) may not open it; %s: taking %s instead",
                            path, owner, uid, "no process holds it" if pid == 0 else
                            "whether a process holds it cannot be told (no /proc/locks)", lock_path(name, uid))
                path = lock_path(name, uid)
                continue
            fd, created, writable = opened
            if not shm.flock(fd):
                holder = shm.wait_marks(fd) or _unmarked_holder(shm, path, fd)
                shm.close(fd)
                raise _running(name, holder, path, f"lock {path}")
            if not _same_file(shm, fd, path):  # removed or replaced between open and flock: the new one counts
                shm.close(fd)
                continue
            return cls(name, path, fd, writable, host), created
        raise AlreadyRunning(f"instance {name!r}: its lock file {path} keeps being replaced; is something "
                             f"removing /dev/shm/wheeld-{name}-lock in a loop?")

    def _write_pid(self) -> None:
        if self._writable:
            self._shm.pwrite(self._fd, f"{self.host.pid}\n".encode().ljust(PID_FIELD, b" "), 0)

    def _load_secret(self) -> bytes:
        """The secret of this daemon's names, made (0600) when missing; an older wheeld kept
        it in its 0600 lock file, after the pid: moved from there once, then removed."""
        shm = self._shm
        legacy = None
        own_file = self._writable and shm.fstat(self._fd).st_uid == self.uid
        if own_file and shm.fstat(self._fd).st_size >= PID_FIELD + SECRET_BYTES:
            legacy = shm.pread(self._fd, SECRET_BYTES, PID_FIELD)
        segment = secret_name(self.name, self.qualifier)
        path = shm_path(segment)
        for _ in range(10):
            try:
                fd = shm.create(path, 0o600)
            except FileExistsError:
                secret = self._read_secret(segment, path)
                if secret is not None:
                    break
                continue
            try:
                secret = legacy or self.host.rng.token_bytes(SECRET_BYTES)
                shm.pwrite(fd, secret, 0)
            finally:
                shm.close(fd)
            self.created.append(path)
            break
        else:
            raise UntrustedSegment(f"{path} keeps being replaced")
        if own_file:
            shm.ftruncate(self._fd, PID_FIELD)  # nothing secret in a file everybody may read
            shm.fchmod(self._fd, 0o644)
        return secret

    def _read_secret(self, segment: str, path: str) -> bytes | None:
        """The secret in an existing file, or None after setting aside one that may not be trusted."""
        shm = self._shm
        try:
            fd = shm.open(path, write=False)
        except FileNotFoundError:
            return None
        except OSError as exc:
            reason = exc.strerror
        else:
            try:
                st = shm.fstat(fd)
                reason = _untrusted(st, self.uid) or (st.st_mode & 0o077 and "other users may read it")
                if not reason:
                    secret = shm.pread(fd, SECRET_BYTES, 0)
                    if len(secret) == SECRET_BYTES:
                        return secret
                    reason = f"it holds {len(secret)} bytes, not {SECRET_BYTES}"
            finally:
                shm.close(fd)
        moved = set_aside(self.host, segment, reason)
        log.error("secret %s set aside as /dev/shm/%s because %s; a new one is made (clients of the previous "
                  "daemon get new rings)", path, moved, reason)
        return None

    # ------------------------------------------------------------------ while it runs
    def check(self) -> str | None:
        """Is the lock file still this daemon's? A removed or replaced one is made again and
        taken; returns what stays wrong (another process holds the new file), else None."""
        shm = self._shm
        if self._fd is None or _same_file(shm, self._fd, self.path):
            self._problem = None
            return None
        problem = None
        opened = _open_lock(shm, self.path)
        if opened is None:
            problem = f"the instance lock {self.path} was replaced by a file this daemon cannot use"
        else:
            fd, _created, writable = opened
            if not shm.flock(fd):
                holder = shm.read_marks(fd)
                shm.close(fd)
                problem = (f"the instance lock {self.path} was replaced while this daemon ran, and "
                           f"{holder.describe(self.name) if holder else 'another process'} holds the new one")
            else:
                shm.mark(fd, self.host.pid, self.uid, self.qualifier is not None)
                shm.close(self._fd)
                self._fd, self._writable = fd, writable
                self._write_pid()
                log.warning("the instance lock %s was removed while this daemon ran; it is made and held again",
                            self.path)
        if problem is not None and problem != self._problem:
            log.error("%s", problem)
        self._problem = problem
        return problem

    def release(self) -> None:
        if self._fd is not None:
            self._shm.close(self._fd)  # closing the last descriptor drops the flock and the marks
            self._fd = None

    def abandon(self, more: list[str] = ()) -> None:
        """A refused start: remove what it created (``more``: segments made after the lock),
        the lock file last, while it is still held, then release."""
        for path in [*more, *self.created[1:], *self.created[:1]]:
            if path == self.path and (self._fd is None or not _same_file(self._shm, self._fd, path)):
                continue
            try:
                self._shm.unlink(path)
            except FileNotFoundError:
                pass
        self.created.clear()
        self.release()


# ---------------------------------------------------------------------------- segments
def _untrusted(st: os.stat_result, uid: int) -> str | None:
    if not stat.S_ISREG(st.st_mode):
        return "it is not a regular file"
    if st.st_uid != uid:
        return f"it belongs to uid {st.st_uid}, not to this daemon's uid {uid}"
    if st.st_mode & 0o022:
        return f"its mode {stat.S_IMODE(st.st_mode):04o} lets other users write it"
    return None


def take_segment(host: Host, segment_name: str, instance: str):
    """A handle of an existing segment of this daemon, open for writing, with its
    segment lock taken (before anything is written) and marked; None when there is no
    such segment. Map it (``host.shm.map``), then close it: the mapping keeps the lock.

    Raises AlreadyRunning when another process holds it, Unusable when it may not be
    trusted (another owner, writable by others, not a regular file)."""
    shm = host.shm
    path = shm_path(segment_name)
    try:
        fd = shm.open(path, write=True)
    except FileNotFoundError:
        return None
    except OSError as exc:
        holder = _held_by(shm, path)
        if holder is not None:
            raise _running(instance, holder, path) from None
        raise Unusable(exc.strerror) from None
    try:
        if not shm.lock(fd):
            raise _running(instance, shm.wait_marks(fd), path)
        reason = _untrusted(shm.fstat(fd), host.euid)
        if reason:
            raise Unusable(reason)
        shm.mark(fd, host.pid, host.euid)
    except BaseException:
        shm.close(fd)
        raise
    return fd


def create_segment(host: Host, segment_name: str, mode: int):
    """A new, empty segment of this daemon, open for writing, locked and marked (map it,
    then close it: the mapping keeps the lock); FileExistsError when the name is taken."""
    shm = host.shm
    fd = shm.create(shm_path(segment_name), mode)
    try:
        if not shm.lock(fd):
            raise AlreadyRunning(f"{shm_path(segment_name)} was locked by another process as it was made")
        shm.mark(fd, host.pid, host.euid)
    except BaseException:
        shm.close(fd)
        raise
    return fd


def file_identity(shm: SharedMemory, fd) -> tuple[int, int]:
    """(device, inode) of the file open on ``fd``: what :class:`HeldSegment` compares."""
    st = shm.fstat(fd)
    return st.st_dev, st.st_ino


class HeldSegment:
    """A segment the daemon holds (mapped, locked; ``identity``: its (device, inode)):
    does its name still name it?"""

    def __init__(self, kind: str, segment_name: str, identity: tuple[int, int], shm: SharedMemory):
        self.kind = kind
        self.path = shm_path(segment_name)
        self.identity = identity
        self._shm = shm
        self._problem: str | None = None

    def _named(self) -> bool:
        st = self._shm.stat(self.path)
        return st is not None and (st.st_dev, st.st_ino) == self.identity

    def check(self) -> str | None:
        """What is wrong with the segment's name (logged once, at error level, when it
        starts being wrong), else None."""
        if self._named():
            if self._problem is not None:
                log.warning("%s names this daemon's %s again", self.path, self.kind)
            self._problem = None
            return None
        if self._shm.stat(self.path) is not None:
            holder = _held_by(self._shm, self.path)
            now = f"another file ({'held by ' + holder.who() if holder else 'held by no daemon'})"
            what = f"{self.path} was replaced by {now}"
        else:
            what = f"{self.path} was removed"
        problem = (f"{what} while this daemon runs: it keeps serving its timers from the {self.kind} it has "
                   f"mapped, but wheelctl no longer sees them, and they end with this process unless a journal "
                   f"rebuilds them at the next start")
        if problem != self._problem:
            log.error("%s", problem)
        self._problem = problem
        return problem


def check_owned(host: Host, segment_name: str) -> str | None:
    """Why the segment may not be trusted (another owner, writable by others), or None."""
    st = host.shm.stat(shm_path(segment_name))
    return None if st is None else _untrusted(st, host.euid)


def set_aside(host: Host, segment_name: str, reason: str = "it is unusable") -> str:
    """Rename an unusable segment out of the way (``<name>.unusable-<wall ms>``, with a
    ``-<n>`` when that name is taken); returns the new name ("" when it vanished).

    Raises UntrustedSegment when the daemon may not rename it (another user's file
    in the sticky /dev/shm). Callers have made sure no process holds it."""
    shm = host.shm
    source = shm_path(segment_name)
    target = stamp = f"{source}.unusable-{host.wall_ms()}"
    copies = 1
    while shm.stat(target) is not None:  # set aside twice in one ms: keep both copies
        copies += 1
        target = f"{stamp}-{copies}"
    try:
        shm.rename(source, target)
    except FileNotFoundError:
        return ""
    except OSError as exc:
        if exc.errno in (errno.EPERM, errno.EACCES):
            owner = _owner(shm, source)
            raise UntrustedSegment(
                f"{source} cannot be used ({reason}) and this daemon (uid {host.euid}) may not move it "
                f"({exc.strerror}): it belongs to uid {owner} and no process holds it; remove it (as root or "
                f"uid {owner}) and start again") from None
        raise
    return os.path.basename(target)
