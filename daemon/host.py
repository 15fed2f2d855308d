"""The ports through which the daemon's core reaches the world, and their real implementations.

The core of the daemon (:mod:`wheeld.daemon.core` and the modules it drives:
sessions, executor, delivery, recorder, start-up) makes every decision about a
timer, a client or a byte on disk, and performs no I/O of its own: it reads the
time, the disk, named shared memory, the user database and randomness only
through the :class:`Host` it is given, and talks to clients only through one
:class:`Transport` per connection. This is the "sans-I/O" shape of h11 (a
protocol that never touches a socket) applied to a whole service:

* the real daemon (:mod:`wheeld.daemon.server`, the *shell*) gives it
  :func:`real_host` (``time``, ``os``, ``posix_ipc``, ``pwd``/``grp``, ``secrets``)
  and socket transports driven by a uvloop event loop;
* the simulator (``tests/sim``) gives it a simulated clock, disk, shared memory and
  network, all driven by one seeded random generator, so that one seed is one
  exactly reproducible history of clients, crashes, reboots and disk faults.

What stays real in a simulation: the memory behind segments (a simulated
"shared" segment is private memory the simulator keeps across a simulated
daemon crash and drops at a simulated reboot) and the sealed memfds of client
rings and the status page (in-process memory either way).

**The events** the core takes are its methods (a connection accepted, bytes
received, the socket writable, the loop's iteration, the once-a-second
maintenance, stop); **the actions** it takes are calls on these ports: send
these bytes (:meth:`Transport.send`), close, write and sync journal bytes
(``host.fs``), end the park now or at T (:class:`Shell`). A port that fails
raises ``OSError`` with the errno, as the system call would: that is the "write
failed with ENOSPC" event, and the core decides what it means.
"""

from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from wheeld.protocol import clock


class Transport(Protocol):
    """One client connection, as the core sees it (the shell owns the socket)."""

    def send(self, data: bytes | bytearray | memoryview) -> int:
        """Bytes of ``data`` taken now (0 when the peer's buffer is full). Raises ``OSError``
        when the connection is broken."""

    def send_with_fds(self, data: bytes, fds: list[int]) -> int:
        """As :meth:`send`, with ``fds`` passed along with the first byte (SCM_RIGHTS).
        Raises ``BlockingIOError`` when nothing could be taken (the descriptors not sent)."""

    def want_writable(self, wanted: bool) -> None:
        """Tell the core (``DaemonCore.writable``) when the connection can take more bytes."""

    def peer_gone(self) -> bool:
        """Has the peer closed its end (an end of stream waits to be read)?"""

    def close(self) -> None:
        """Close the connection (idempotent); the core has forgotten it."""


class Shell(Protocol):
    """What the core asks of the loop that drives it (it parks as the core says:
    ``DaemonCore.park`` returns until when)."""

    def wake(self) -> None:
        """End the current park now (a doorbell that someone waits on, a closed session)."""

    def wake_at(self, at_ns: int) -> None:
        """End the current park at ``at_ns`` (the host's ``clock_ns``) instead, if sooner."""

    def resume_accept(self) -> None:
        """A session closed: accept again if accepting was paused (out of descriptors)."""

    def status_changed(self) -> None:
        """Something the status line says changed (``DaemonCore.status_line``)."""


class Users(Protocol):
    """The user database, as far as the core needs it."""

    def groups_of(self, uid: int, primary_gid: int) -> frozenset[int]:
        """The uid's supplementary groups and ``primary_gid``."""


class RealUsers:
    def groups_of(self, uid: int, primary_gid: int) -> frozenset[int]:
        try:
            import pwd

            entry = pwd.getpwuid(uid)
            gids = frozenset(os.getgrouplist(entry.pw_name, entry.pw_gid))
        except (KeyError, OSError):
            gids = frozenset()
        return gids | {primary_gid}


class SharedMemory(Protocol):
    """Named shared memory (``/dev/shm`` on Linux), as start-up and the instance lock use it.

    Everything is named by its path (:func:`wheeld.protocol.naming.shm_path`,
    :func:`~wheeld.protocol.naming.lock_path`). An open file is a *handle* (the real
    port's are file descriptors; the core never looks inside one). The methods are
    the system calls of today's code, one each, with their errors (``OSError`` with
    the errno): the core keeps every decision (who may be trusted, what is set
    aside, who runs the instance), the port only does what it is told. The real
    implementation is :class:`wheeld.shm.named.RealShm`; the simulator's is
    ``tests/sim/shm.py``.

    *Segment lock* and *marks* are those of :mod:`wheeld.shm.instance_lock`:
    the lock and the marks belong to the open file (not to the handle number) and
    last as long as a handle or a mapping of it does; the *instance lock* is an
    exclusive ``flock`` on the handle's open file."""

    def open(self, path: str, write: bool) -> Any:
        """An existing file, read-write or read-only, never through a symlink (``ELOOP``) and
        never blocking; ``FileNotFoundError``, ``PermissionError``, ``IsADirectoryError``..."""

    def create(self, path: str, mode: int) -> Any:
        """A new, empty file open read-write with exactly ``mode`` (the umask does not
        apply); ``FileExistsError`` when the name is taken."""

    def close(self, handle: Any) -> None: ...

    def stat(self, path: str) -> os.stat_result | None:
        """The file's status, not following a symlink; None when there is no such file."""

    def fstat(self, handle: Any) -> os.stat_result: ...

    def fchmod(self, handle: Any, mode: int) -> None: ...

    def ftruncate(self, handle: Any, size: int) -> None: ...

    def pread(self, handle: Any, size: int, offset: int) -> bytes: ...

    def pwrite(self, handle: Any, data: bytes, offset: int) -> int: ...

    def chown(self, path: str, uid: int, gid: int) -> None:
        """As ``os.chown`` (-1 keeps an id)."""

    def chmod(self, path: str, mode: int) -> None: ...

    def rename(self, source: str, target: str) -> None:
        """Atomically, replacing ``target``; ``PermissionError`` for another uid's file
        (``/dev/shm`` is sticky), ``FileNotFoundError`` when ``source`` is gone."""

    def unlink(self, path: str) -> None:
        """``FileNotFoundError`` when missing."""

    def flock(self, handle: Any) -> bool:
        """Take the instance lock (exclusive, non-blocking); False when another holds it."""

    def lock(self, handle: Any) -> bool:
        """Take the segment lock (``handle`` open for writing); False when another holds it."""

    def mark(self, handle: Any, pid: int, uid: int, qualified: bool | None = None) -> None:
        """Leave the holder's marks (:func:`wheeld.shm.instance_lock.mark`)."""

    def read_marks(self, handle: Any) -> Any:
        """The marks another open file left (a ``Holder``), or None."""

    def wait_marks(self, handle: Any) -> Any:
        """:meth:`read_marks`, allowing a holder that has just locked a moment to mark."""

    def flock_holder_pid(self, path: str) -> int | None:
        """The pid holding a ``flock`` on ``path`` without opening it; 0 when nobody does;
        None when that cannot be told (:func:`wheeld.shm.instance_lock.flock_holder_pid`)."""

    def flock_holder(self, path: str) -> Any:
        """:meth:`flock_holder_pid` as a ``Holder`` (None: nobody); ``PermissionError``
        when that cannot be told."""

    def map(self, handle: Any, name: str, size: int | None = None) -> Any:
        """A read-write :class:`wheeld.shm.arena.Segment` named ``name`` over the file open on
        ``handle`` (``size`` bytes, default the file's; ``CorruptArena`` when it is empty).
        The mapping keeps the handle's open file, and so its segment lock, after
        :meth:`close`. The segment's ``close``, ``rename`` and ``unlink`` come back here."""

    def unmap(self, segment: Any) -> None:
        """Unmap ``segment`` (:meth:`wheeld.shm.arena.Segment.close`)."""


class RealRandom:
    """Secrets and labels from the operating system's CSPRNG."""

    token_bytes = staticmethod(secrets.token_bytes)
    token_hex = staticmethod(secrets.token_hex)


def _real_shm() -> SharedMemory:
    from wheeld.shm.named import RealShm

    return RealShm()


def process_alive(pid: int) -> bool:
    """Does process ``pid`` exist? ``kill(pid, 0)``: ESRCH says it does not; EPERM (another
    uid's process) says it does. A pid this daemon cannot name (0: the client is in a pid
    namespace the daemon does not see) counts as alive: nothing is concluded from it. A
    pid used again by another process also counts as alive (the caller then waits as it
    would have anyway)."""
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


@dataclass
class Host:
    """The world as the core may see it (see the module docstring).

    ``clock_ms`` is the arena's clock (CLOCK_MONOTONIC ms, floored), ``clock_ns``
    the same clock in ns, ``wall_ms``/``wall_ns`` the wall clock in ms (the
    journal's) and ns. ``runner`` runs the journal's background fsyncs and mark
    writes (:class:`wheeld.journal.files.ThreadRunner`, a helper thread,
    when None; a simulation runs them when it decides). ``fs``
    offers the ``os`` functions the journal's engine uses (``open``, ``write``,
    ``fsync``, ``ftruncate``, ``replace``, ``unlink``, ``scandir``, ``stat``,
    ``mkdir``, ``chmod``...). ``shm`` creates, attaches, renames and removes named
    shared-memory segments and takes their locks (:class:`SharedMemory`). ``rng``
    makes labels and secrets. ``pid`` and ``euid`` are the daemon's, as its marks
    and its ownership checks use them. ``process_alive(pid)`` says whether a client's
    process still exists (:func:`process_alive`)."""

    clock_ms: Callable[[], int] = clock.mono_ms
    clock_ns: Callable[[], int] = clock.mono_ns
    wall_ms: Callable[[], int] = clock.wall_ms
    wall_ns: Callable[[], int] = clock.wall_ns
    fs: Any = os
    runner: Any = None
    shm: SharedMemory = field(default_factory=_real_shm)
    users: Users = field(default_factory=RealUsers)
    rng: Any = field(default_factory=RealRandom)
    pid: int = field(default_factory=os.getpid)
    euid: int = field(default_factory=os.geteuid)
    hostname: str = field(default_factory=socket.gethostname)
    process_alive: Callable[[int], bool] = process_alive


def real_host(clock_ms: Callable[[], int] = clock.mono_ms) -> Host:
    """The host a real daemon runs on. ``clock_ms`` replaces the arena's clock (tests)."""
    return Host(clock_ms=clock_ms)
