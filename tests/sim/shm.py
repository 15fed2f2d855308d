"""Simulated named shared memory: ``/dev/shm`` of one simulated host.

The daemon's start-up and its instance lock reach named shared memory only
through the host's ``shm`` port (:class:`wheeld.daemon.host.SharedMemory`). The
simulator gives each simulated process a :class:`SimShmPort` of one
:class:`SimShm`, which models what the daemon relies on:

* **Named segments** are private anonymous ``mmap`` objects kept in a dict by
  path, so a segment the daemon maps is real memory (the wheel runs over it as
  over a real arena), and it **survives a simulated daemon crash**
  (:meth:`SimShm.crash`: the simulator keeps the :class:`SimShm` and starts a
  new daemon core over it) and is **gone at** :meth:`SimShm.reboot`, as tmpfs is.
* **Open files, locks and marks** follow Linux: a lock (the instance lock's
  ``flock``, a segment lock, the marks) belongs to an *open file*, which lives
  as long as a handle or a mapping of it does; a crash closes every open file of
  the process, so its locks go with it. A second process finds them held and
  reads the holder's marks.
* **Owners and modes**: every file has a uid and a mode; a port has the uid (and
  groups) of its process; ``/dev/shm`` is sticky (only a file's owner or root
  renames or removes it); opening checks the mode bits. Files another uid left,
  directories and symlinks in the way are made with :meth:`SimShm.plant`, so
  ownership checks answer as a test configures them.
  ``proc_locks=False`` hides who holds a ``flock`` (``ProcSubset=pid``).
* **Crashes at any call**: :meth:`SimShm.crash_after` kills a process at its
  n-th port call (:class:`SimCrashed`), so a test can stop a start-up between
  any two of its shared-memory steps.
* **Faults on demand**: :meth:`SimShm.truncate`, :meth:`SimShm.remove`,
  :meth:`SimShm.damage`, :meth:`SimShm.flip_bit` change a segment under (or
  between) daemons; :meth:`SimShm.fail_next` makes the next ``open``,
  ``create``, ``ftruncate``, ``map`` or ``rename`` fail with an errno (tmpfs
  full: ``ENOSPC``).

Not modelled: a mapping made before its file changed size keeps the memory it
had (Linux raises ``SIGBUS`` when a page past the new end is touched: the
daemon would die there); there is no size limit unless a fault is injected.

Deterministic: no choice depends on anything but the calls made and the
``random.Random`` passed for the random faults (:meth:`SimShm.flip_bit`,
:meth:`SimShm.truncate` without an offset or length).
"""

from __future__ import annotations

import errno
import mmap
import os
import random
import stat as stat_module
from dataclasses import dataclass, field

from wheeld.protocol.errors import CorruptArena
from wheeld.shm.instance_lock import Holder
from wheeld.shm.arena import Segment, normalize_name

__all__ = ["SimCrashed", "SimShm", "SimShmPort"]

_DEV = 0x19  # st_dev of every simulated file: one tmpfs
_KINDS = {"file": stat_module.S_IFREG, "dir": stat_module.S_IFDIR, "symlink": stat_module.S_IFLNK,
          "fifo": stat_module.S_IFIFO}


class SimCrashed(BaseException):
    """The simulated process died at a port call (:meth:`SimShm.crash_after`), or a dead
    process made one. A BaseException, like the signal that kills a real daemon: no
    ``except Exception`` of the daemon takes it for a failure it could handle, and its
    ``except BaseException`` clean-ups find every call failing, as a killed process does
    nothing more."""


def _error(code: int, path: str | None = None) -> OSError:
    return OSError(code, os.strerror(code), path) if path is not None else OSError(code, os.strerror(code))


@dataclass(eq=False)
class _File:
    ino: int
    uid: int
    gid: int
    mode: int  # permission bits
    kind: str = "file"
    size: int = 0
    mem: mmap.mmap | None = None  # exactly ``size`` bytes (None when empty)
    opens: list = field(default_factory=list)  # its open files (_Open), oldest first

    def resize(self, size: int) -> None:
        """A new memory of ``size`` bytes, the old one's prefix kept, the rest zero."""
        if size == self.size:
            return
        mem = mmap.mmap(-1, size) if size else None
        keep = min(size, self.size)
        if keep:
            mem[:keep] = self.mem[:keep]
        self.mem, self.size = mem, size

    def read(self, offset: int, length: int) -> bytes:
        if self.mem is None or offset >= self.size:
            return b""
        return self.mem[offset:min(self.size, offset + length)]

    def write(self, offset: int, data: bytes) -> int:
        end = offset + len(data)
        if end > self.size:
            self.resize(end)
        if data:
            self.mem[offset:end] = data
        return len(data)


@dataclass(eq=False)
class _Open:
    """An open file (Linux's open file description): what locks and marks belong to."""

    file: _File
    port: SimShmPort
    write: bool
    refs: int = 1  # handles and mappings that keep it open
    flocked: bool = False
    locked: bool = False
    marks: tuple[int, int, bool | None] | None = None

    def drop(self) -> None:
        self.refs -= 1
        if self.refs <= 0:
            self.close()

    def close(self) -> None:
        self.refs = 0
        if self in self.file.opens:
            self.file.opens.remove(self)
        if self in self.port.opens:
            self.port.opens.remove(self)


@dataclass(eq=False)
class _Handle:
    open: _Open
    closed: bool = False


class SimShm:
    """``/dev/shm`` of one simulated host (see the module docstring)."""

    def __init__(self, rng: random.Random | None = None, proc_locks: bool = True):
        self.rng = rng if rng is not None else random.Random(0)
        self.proc_locks = proc_locks
        self.files: dict[str, _File] = {}
        self.ports: list[SimShmPort] = []
        self.boots = 0
        self._next_ino = 1
        self._faults: dict[str, list[int]] = {}
        self.counts: dict[str, int] = {}  # what was done and injected, for the run's report

    # ------------------------------------------------------------------ processes
    def port(self, pid: int, uid: int, gids: tuple[int, ...] = ()) -> SimShmPort:
        """The shared-memory port of a process ``pid`` running as ``uid`` (``gids``: its
        supplementary groups; its primary group is taken to be ``uid``)."""
        port = SimShmPort(self, pid, uid, frozenset(gids) | {uid})
        self.ports.append(port)
        return port

    def crash_after(self, port: SimShmPort, calls: int) -> None:
        """``port``'s process dies at its call after the next ``calls`` (0: the next one):
        that call does nothing and raises :class:`SimCrashed` (its locks are gone)."""
        port.crash_in = calls

    def crash(self, port: SimShmPort) -> None:
        """The process dies: its open files close, their locks and marks go; the segments stay."""
        self._count("crash")
        self.exit(port)

    def exit(self, port: SimShmPort) -> None:
        """The process ends (after a clean stop, or killed): as :meth:`crash`, uncounted."""
        port.alive = False
        for opened in list(port.opens):
            opened.close()

    def reboot(self) -> None:
        """The host restarts: every process is gone and ``/dev/shm`` is empty."""
        self._count("reboot")
        self.boots += 1
        for port in self.ports:
            port.alive = False
            port.opens.clear()
        self.ports.clear()
        self.files.clear()
        self._faults.clear()

    # ------------------------------------------------------------------ the files, for the simulator
    def names(self) -> list[str]:
        """The paths of every file, sorted."""
        return sorted(self.files)

    def exists(self, path: str) -> bool:
        return path in self.files

    def read(self, path: str) -> bytes:
        """A file's bytes as every process sees them now."""
        file = self._file(path)
        return file.read(0, file.size)

    def owner(self, path: str) -> int:
        return self._file(path).uid

    def holder(self, path: str) -> int | None:
        """The pid of the process holding the file's segment lock or flock, or None."""
        for opened in self._file(path).opens:
            if opened.locked or opened.flocked:
                return opened.port.pid
        return None

    def plant(self, path: str, data: bytes = b"", uid: int = 0, mode: int = 0o600, kind: str = "file") -> None:
        """Put a file there as another process (of ``uid``) would have: a segment another user
        left, a directory or a symlink in the way. Replaces what the path named."""
        if kind not in _KINDS:
            raise ValueError(f"kind is one of {sorted(_KINDS)}")
        file = self._new_file(uid, uid, mode, kind)
        if kind == "file" and data:
            file.write(0, bytes(data))
        self.files[path] = file

    def set_owner(self, path: str, uid: int | None = None, mode: int | None = None) -> None:
        """Change a file's owner or mode behind the daemon's back (as root would)."""
        file = self._file(path)
        if uid is not None:
            file.uid = file.gid = uid
        if mode is not None:
            file.mode = mode & 0o7777

    # ------------------------------------------------------------------ faults
    def fail_next(self, operation: str, error: int = errno.ENOSPC, times: int = 1) -> None:
        """The next ``times`` calls of ``operation`` ("open", "create", "ftruncate", "map",
        "rename") by any process raise ``OSError(error)``."""
        self._faults.setdefault(operation, []).extend([error] * times)

    def _fault(self, operation: str, path: str | None = None) -> None:
        queue = self._faults.get(operation)
        if queue:
            code = queue.pop(0)
            self._count(f"fault_{operation}_{errno.errorcode.get(code, code)}")
            raise _error(code, path)

    def truncate(self, path: str, size: int | None = None) -> int:
        """Cut a file to ``size`` bytes (random when None); returns the new size."""
        file = self._file(path)
        size = self.rng.randint(0, file.size) if size is None else size
        file.resize(size)
        self._count("shm_truncation")
        return size

    def remove(self, path: str) -> None:
        """Remove a name (a clean-up script, ``RemoveIPC=``); open files and mappings stay."""
        self._file(path)
        del self.files[path]
        self._count("shm_removal")

    def damage(self, path: str, offset: int, data: bytes) -> None:
        """Overwrite bytes of a file (a stray writer)."""
        file = self._file(path)
        if offset + len(data) > file.size:
            raise ValueError(f"{path} holds {file.size} bytes")
        file.mem[offset:offset + len(data)] = data
        self._count("shm_damage")

    def flip_bit(self, path: str, offset: int | None = None) -> int:
        """Flip one bit of a file; returns its byte offset (-1 for an empty file)."""
        file = self._file(path)
        if not file.size:
            return -1
        at = self.rng.randrange(file.size) if offset is None else offset
        file.mem[at] ^= 1 << self.rng.randrange(8)
        self._count("shm_bit_flip")
        return at

    # ------------------------------------------------------------------ internals
    def _count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def _file(self, path: str) -> _File:
        file = self.files.get(path)
        if file is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        return file

    def _new_file(self, uid: int, gid: int, mode: int, kind: str = "file") -> _File:
        file = _File(self._next_ino, uid, gid, mode & 0o7777, kind)
        self._next_ino += 1
        return file

    @staticmethod
    def _stat(file: _File) -> os.stat_result:
        return os.stat_result((_KINDS[file.kind] | file.mode, file.ino, _DEV, 1, file.uid, file.gid, file.size,
                               0, 0, 0))


class SimShmPort:
    """One process's view of a :class:`SimShm`: :class:`wheeld.daemon.host.SharedMemory`."""

    def __init__(self, machine: SimShm, pid: int, uid: int, gids: frozenset[int]):
        self.machine = machine
        self.pid = pid
        self.uid = uid
        self.gids = gids
        self.alive = True
        self.opens: list[_Open] = []  # every open file of this process (a crash closes them)
        self.calls = 0  # port calls made (crash points: SimShm.crash_after)
        self.crash_in: int | None = None

    # ------------------------------------------------------------------ helpers
    def _live(self) -> None:
        """Every call of the port passes here once: a dead process makes none, and a crash
        point set with :meth:`SimShm.crash_after` is reached here."""
        if not self.alive:
            raise SimCrashed(f"simulated process {self.pid} is dead")
        if self.crash_in is not None:
            if self.crash_in <= 0:
                self.crash_in = None
                self.machine.crash(self)
                raise SimCrashed(f"simulated process {self.pid} crashed at its port call {self.calls}")
            self.crash_in -= 1
        self.calls += 1

    def _may(self, file: _File, want: int) -> bool:
        if self.uid == 0:
            return True
        if self.uid == file.uid:
            bits = file.mode >> 6
        elif file.gid in self.gids:
            bits = file.mode >> 3
        else:
            bits = file.mode
        return bits & want == want

    def _owns(self, file: _File) -> bool:
        return self.uid in (0, file.uid)

    def _handle(self, handle: _Handle) -> _Open:
        self._live()
        if not isinstance(handle, _Handle) or handle.closed or handle.open.refs <= 0:
            raise _error(errno.EBADF)
        return handle.open

    def _opened(self, file: _File, write: bool) -> _Handle:
        opened = _Open(file, self, write)
        file.opens.append(opened)
        self.opens.append(opened)
        return _Handle(opened)

    # ------------------------------------------------------------------ files
    def open(self, path: str, write: bool) -> _Handle:
        self._live()
        self.machine._fault("open", path)
        file = self.machine._file(path)
        if file.kind == "symlink":
            raise _error(errno.ELOOP, path)
        if file.kind == "dir" and write:
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        if not self._may(file, 6 if write else 4):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        return self._opened(file, write)

    def create(self, path: str, mode: int) -> _Handle:
        self._live()
        self.machine._fault("create", path)
        if path in self.machine.files:
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), path)
        file = self.machine._new_file(self.uid, self.uid, mode)
        self.machine.files[path] = file
        return self._opened(file, True)

    def close(self, handle: _Handle) -> None:
        opened = self._handle(handle)
        handle.closed = True
        opened.drop()

    def stat(self, path: str) -> os.stat_result | None:
        self._live()
        file = self.machine.files.get(path)
        return None if file is None else SimShm._stat(file)

    def fstat(self, handle: _Handle) -> os.stat_result:
        return SimShm._stat(self._handle(handle).file)

    def fchmod(self, handle: _Handle, mode: int) -> None:
        opened = self._handle(handle)
        if not self._owns(opened.file):
            raise PermissionError(errno.EPERM, os.strerror(errno.EPERM))
        opened.file.mode = mode & 0o7777

    def ftruncate(self, handle: _Handle, size: int) -> None:
        opened = self._handle(handle)
        if not opened.write:
            raise _error(errno.EINVAL)
        self.machine._fault("ftruncate")
        opened.file.resize(size)

    def pread(self, handle: _Handle, size: int, offset: int) -> bytes:
        opened = self._handle(handle)
        if opened.file.kind == "dir":
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR))
        return opened.file.read(offset, size)

    def pwrite(self, handle: _Handle, data: bytes, offset: int) -> int:
        opened = self._handle(handle)
        if not opened.write:
            raise _error(errno.EBADF)
        return opened.file.write(offset, bytes(data))

    def chown(self, path: str, uid: int, gid: int) -> None:
        self._live()
        file = self.machine._file(path)
        if self.uid != 0 and (not self._owns(file) or uid not in (-1, file.uid) or
                              (gid != -1 and gid not in self.gids)):
            raise PermissionError(errno.EPERM, os.strerror(errno.EPERM), path)
        if uid != -1:
            file.uid = uid
        if gid != -1:
            file.gid = gid

    def chmod(self, path: str, mode: int) -> None:
        self._live()
        file = self.machine._file(path)
        if not self._owns(file):
            raise PermissionError(errno.EPERM, os.strerror(errno.EPERM), path)
        file.mode = mode & 0o7777

    def rename(self, source: str, target: str) -> None:
        self._live()
        self.machine._fault("rename", source)
        files = self.machine.files
        file = self.machine._file(source)
        replaced = files.get(target)
        if not self._owns(file) or (replaced is not None and not self._owns(replaced)):  # sticky /dev/shm
            raise PermissionError(errno.EPERM, os.strerror(errno.EPERM), source)
        del files[source]
        files[target] = file

    def unlink(self, path: str) -> None:
        self._live()
        file = self.machine._file(path)
        if not self._owns(file):
            raise PermissionError(errno.EPERM, os.strerror(errno.EPERM), path)
        del self.machine.files[path]

    # ------------------------------------------------------------------ locks and marks
    def flock(self, handle: _Handle) -> bool:
        opened = self._handle(handle)
        if any(o.flocked for o in opened.file.opens if o is not opened):
            return False
        opened.flocked = True
        return True

    def lock(self, handle: _Handle) -> bool:
        opened = self._handle(handle)
        if not opened.write:
            raise _error(errno.EBADF)
        if any(o.locked for o in opened.file.opens if o is not opened):
            return False
        opened.locked = True
        return True

    def mark(self, handle: _Handle, pid: int, uid: int, qualified: bool | None = None) -> None:
        self._handle(handle).marks = (pid, uid, qualified)

    def read_marks(self, handle: _Handle) -> Holder | None:
        opened = self._handle(handle)
        for other in opened.file.opens:
            if other is not opened and other.marks is not None:
                return Holder(*other.marks)
        return None

    wait_marks = read_marks  # a simulated holder locks and marks in one step of the simulation

    def flock_holder_pid(self, path: str) -> int | None:
        self._live()
        file = self.machine.files.get(path)
        if file is None:
            return 0
        if not self.machine.proc_locks:
            return None
        for opened in file.opens:
            if opened.flocked:
                return opened.port.pid
        return 0

    def flock_holder(self, path: str) -> Holder | None:
        pid = self.flock_holder_pid(path)
        if pid is None:
            raise PermissionError(errno.EACCES, "cannot tell who holds the lock: no /proc/locks", path)
        if not pid:
            return None
        owner = next((p.uid for p in self.machine.ports if p.pid == pid and p.alive), None)
        return Holder(pid, owner)

    # ------------------------------------------------------------------ mappings
    def map(self, handle: _Handle, name: str, size: int | None = None) -> Segment:
        opened = self._handle(handle)
        self.machine._fault("map")
        file = opened.file
        if not opened.write or file.kind != "file":
            raise _error(errno.EACCES)
        if size is None:
            size = file.size
            if size == 0:
                raise CorruptArena(f"segment {name} is empty")
        if size > file.size or file.mem is None:
            raise ValueError("mmap length is greater than file size")
        opened.refs += 1
        segment = Segment(file.mem, normalize_name(name), size, shm=self)
        segment.sim_open = opened
        return segment

    def unmap(self, segment: Segment) -> None:
        opened = getattr(segment, "sim_open", None)
        if opened is not None and self.alive:
            segment.sim_open = None
            opened.drop()
