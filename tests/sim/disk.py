"""A simulated disk: files whose writes sit in a page cache until they are synced.

The journal's engine does its file I/O through a small port with the names and
signatures of the ``os`` functions it uses (``open``, ``write``, ``fsync``,
``ftruncate``, ``replace``, ``scandir``...). The real daemon passes the ``os``
module itself; the simulator passes a :class:`SimDisk`, which keeps everything in
memory and models what a power cut and a failing device do to it:

* **The page cache.** A write changes the file at once for every reader, but only
  ``fsync(fd)`` makes its bytes *durable*. A directory change (a create, a
  rename, an unlink) is durable once the directory is fsynced
  (``open(dir, O_DIRECTORY)`` + ``fsync``), as POSIX requires of a careful
  writer; until then it may or may not survive a power cut.
* **A power cut** (:meth:`SimDisk.power_cut`) keeps, per file, the durable bytes
  plus a random prefix of the bytes written since, the last part of which may be
  torn (replaced by garbage or zeros, a sector half written); and of the
  directory changes made since the last directory fsync, a random prefix in
  order (a journaling file system commits metadata in order).
* **Overwrites in place** (``pwrite`` below the durable end, as the durable
  mark's slots are written): durable once synced; at a power cut each one not
  synced survives whole, not at all, or in part (a torn sector).
* **Faults on demand** (:meth:`SimDisk.fail_next`): ``ENOSPC``, ``EIO``,
  ``EDQUOT``... on the next ``write``/``pwrite``/``fsync``/``fdatasync``/``open``.
  An ``fsync`` (or ``fdatasync``) that fails with ``EIO`` drops the dirty bytes
  it could not write: they stay readable until the power goes, but a later
  ``fsync`` succeeds without making them durable (Linux's behaviour since 4.13,
  which PostgreSQL met as "fsyncgate"): a writer must treat a failed fsync as
  the loss of everything unsynced. Bytes written again after the failure are
  dirty again, and a later ``fsync`` does write those (rewritten in place); bytes
  appended behind the ones it dropped are not made durable either (the file's
  durable content ends where the dropped bytes begin).
* **What was made durable** (``on_durable``): each ``write`` that appends bytes is
  numbered (0, 1, ...; ``on_write`` says its number), and a successful ``fsync`` of
  its file that makes all of its bytes durable reports that number, once. A write
  cut off by a truncation, dropped by a failed fsync or caught by a power cut is
  never reported.
* **A small disk** (``capacity``): a write that does not fit writes what fits
  and returns a short count; the next one raises ``ENOSPC``. Deleting files
  gives room back. ``statvfs`` reports the room left, in 1-byte blocks, exactly
  what the next writes may take.
* **Damage at rest** (:meth:`SimDisk.flip_bit`, :meth:`SimDisk.truncate_file`):
  media or operator damage to a file's durable content, applied between runs.

Deterministic: every random choice comes from the ``random.Random`` the caller
passes, so one seed gives one history.
"""

from __future__ import annotations

import errno
import os
import posixpath
import random
import stat as stat_module
from dataclasses import dataclass, field

__all__ = ["SimDisk", "SimStat", "SimStatvfs", "SimDirEntry"]

_DIR = object()


@dataclass
class _Inode:
    data: bytearray = field(default_factory=bytearray)
    durable: bytes = b""
    mode: int = 0o600
    #: bytes appended but lost by a failed fsync: readable, never made durable
    lost_from: int | None = None
    #: offset -> the durable byte, for bytes rewritten in place whose write a failed fsync
    #: dropped: the disk keeps the old byte until they are written again
    lost: dict = field(default_factory=dict)
    #: in-place rewrites below the durable end since the last sync: (offset, length), in order
    dirty: list = field(default_factory=list)
    #: cut below its durable end since the last sync (ftruncate, O_TRUNC)
    shrunk: bool = False
    #: appends not yet durable: (the file's length after it, its number), in order
    appends: list = field(default_factory=list)


@dataclass
class _Open:
    path: str
    inode: object  # _Inode, or _DIR for a directory
    append: bool
    writable: bool
    readable: bool


@dataclass(frozen=True)
class SimStat:
    st_size: int
    st_mode: int
    st_uid: int = 0


@dataclass(frozen=True)
class SimStatvfs:
    f_bfree: int
    f_bavail: int
    f_frsize: int = 1
    f_bsize: int = 1


@dataclass(frozen=True)
class SimDirEntry:
    name: str
    path: str
    disk: SimDisk | None = field(default=None, compare=False, repr=False)

    def is_file(self, follow_symlinks: bool = True) -> bool:
        return True  # a simulated directory lists its files (subdirectories are not entries)

    def is_dir(self, follow_symlinks: bool = True) -> bool:
        return False

    def stat(self, follow_symlinks: bool = True) -> SimStat:
        return self.disk.stat(self.path)


class SimDisk:
    """An in-memory file system for one simulated host (see the module docstring).

    Paths are absolute POSIX strings. ``capacity`` bounds the bytes held in
    files (None: unbounded). ``uid`` is what ``stat`` reports as the owner."""

    def __init__(self, rng: random.Random, capacity: int | None = None, uid: int = 0):
        self.rng = rng
        self.capacity = capacity
        self.uid = uid
        self._dirs: dict[str, dict[str, _Inode]] = {"/": {}}
        self._dir_modes: dict[str, int] = {"/": 0o755}
        # directory changes not yet made durable, in order: (dir, name, inode or None)
        self._meta_log: list[tuple[str, str, _Inode | None]] = []
        self._durable_dirs: dict[str, dict[str, _Inode]] = {"/": {}}
        self._fds: dict[int, _Open] = {}
        self._next_fd = 1000
        self._faults: dict[str, list[int]] = {}
        self._full = False  # the last write hit the capacity: the next one raises ENOSPC
        self.counts: dict[str, int] = {}  # what was done and injected, for the run's report
        self.on_failure = None  # called with no argument whenever a call fails (an injected fault, ENOSPC)
        self.on_sync = None  # called with the file's path whenever its fsync or fdatasync succeeds
        # called with the file's path and the append's number whenever a write() appends bytes
        # (not pwrite: below)
        self.on_write = None
        # called with the file's path and the numbers of its appends (those on_write gave) that
        # a successful fsync or fdatasync made durable, after its on_sync
        self.on_durable = None
        self.appends_made = 0

    # ------------------------------------------------------------------ faults
    def fail_next(self, operation: str, error: int = errno.EIO, times: int = 1) -> None:
        """The next ``times`` calls of ``operation`` ("write", "pwrite", "fsync",
        "fdatasync", "open", "replace", "ftruncate") raise ``OSError(error)``."""
        self._faults.setdefault(operation, []).extend([error] * times)

    def _fault(self, operation: str) -> None:
        queue = self._faults.get(operation)
        if queue:
            error = queue.pop(0)
            self._count(f"fault_{operation}_{errno.errorcode.get(error, error)}")
            self._failed()
            raise OSError(error, os.strerror(error))

    def _failed(self) -> None:
        if self.on_failure is not None:
            self.on_failure()

    def _count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def used_bytes(self) -> int:
        return sum(len(inode.data) for entries in self._dirs.values() for inode in entries.values())

    # ------------------------------------------------------------------ paths
    def _split(self, path) -> tuple[str, str]:
        path = posixpath.normpath(os.fspath(path))
        if not path.startswith("/"):
            raise OSError(errno.EINVAL, f"the simulated disk takes absolute paths, not {path!r}")
        return posixpath.dirname(path), posixpath.basename(path)

    def _dir(self, directory: str) -> dict[str, _Inode]:
        entries = self._dirs.get(directory)
        if entries is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), directory)
        return entries

    def _lookup(self, path) -> _Inode:
        directory, name = self._split(path)
        inode = self._dir(directory).get(name)
        if inode is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), os.fspath(path))
        return inode

    def _set_entry(self, directory: str, name: str, inode: _Inode | None) -> None:
        entries = self._dir(directory)
        if inode is None:
            entries.pop(name, None)
        else:
            entries[name] = inode
        self._meta_log.append((directory, name, inode))

    # ------------------------------------------------------------------ the os port
    def open(self, path, flags: int, mode: int = 0o777) -> int:
        self._fault("open")
        path = posixpath.normpath(os.fspath(path))
        if flags & os.O_DIRECTORY:
            if path not in self._dirs:
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
            return self._new_fd(_Open(path, _DIR, False, False, True))
        directory, name = self._split(path)
        entries = self._dir(directory)
        inode = entries.get(name)
        if inode is None:
            if not flags & os.O_CREAT:
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
            inode = _Inode(mode=mode & 0o777)
            self._set_entry(directory, name, inode)
        elif flags & os.O_CREAT and flags & os.O_EXCL:
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), path)
        access = flags & (os.O_RDONLY | os.O_WRONLY | os.O_RDWR)
        writable = access in (os.O_WRONLY, os.O_RDWR)
        if flags & os.O_TRUNC and writable:
            del inode.data[:]
            inode.lost_from = None
            inode.lost.clear()
            inode.dirty.clear()
            inode.appends.clear()
            inode.shrunk = inode.shrunk or bool(inode.durable)
        return self._new_fd(_Open(path, inode, bool(flags & os.O_APPEND), writable, access != os.O_WRONLY))

    def _new_fd(self, entry: _Open) -> int:
        fd = self._next_fd
        self._next_fd += 1
        self._fds[fd] = entry
        return fd

    def _file(self, fd: int) -> _Open:
        entry = self._fds.get(fd)
        if entry is None:
            raise OSError(errno.EBADF, os.strerror(errno.EBADF))
        return entry

    def close(self, fd: int) -> None:
        self._file(fd)
        del self._fds[fd]

    def write(self, fd: int, data) -> int:
        entry = self._file(fd)
        if not entry.writable or entry.inode is _DIR:
            raise OSError(errno.EBADF, os.strerror(errno.EBADF))
        self._fault("write")
        data = bytes(data)
        if not data:
            return 0
        room = len(data) if self.capacity is None else self.capacity - self.used_bytes()
        if room <= 0 or (self._full and room < len(data)):
            self._full = False
            self._count("enospc")
            self._failed()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written = data[:room]
        self._full = len(written) < len(data)
        entry.inode.data += written  # the journal only appends (O_APPEND)
        number = self.appends_made
        self.appends_made += 1
        entry.inode.appends.append((len(entry.inode.data), number))
        self._count("write")
        # (pwrite() does not call it: the journal only rewrites its durable mark's slot in
        # place with it, which carries no event and may be written while the journal is stalled)
        if self.on_write is not None:
            self.on_write(entry.path, number)
        return len(written)

    def pwrite(self, fd: int, data, offset: int) -> int:
        """Write ``data`` at ``offset`` (the file grows, zero-filled, if it ends before);
        the fd's position and ``O_APPEND`` play no part (the journal uses it only to
        rewrite a slot of its mark in place)."""
        entry = self._file(fd)
        if not entry.writable or entry.inode is _DIR:
            raise OSError(errno.EBADF, os.strerror(errno.EBADF))
        self._fault("pwrite")
        data = bytes(data)
        inode = entry.inode
        growth = max(0, offset + len(data) - len(inode.data))
        if growth and self.capacity is not None and self.capacity - self.used_bytes() < growth:
            self._count("enospc")
            self._failed()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if offset > len(inode.data):
            inode.data.extend(bytes(offset - len(inode.data)))
        inode.data[offset:offset + len(data)] = data
        if inode.lost:
            for at in range(offset, offset + len(data)):
                inode.lost.pop(at, None)  # written again: dirty again
        below = min(len(data), len(inode.durable) - offset)
        if below > 0:
            inode.dirty.append((offset, below))
        self._count("pwrite")
        return len(data)

    def pread(self, fd: int, length: int, offset: int) -> bytes:
        entry = self._file(fd)
        if entry.inode is _DIR:
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR))
        return bytes(entry.inode.data[offset:offset + length])

    def fsync(self, fd: int, _operation: str = "fsync") -> None:
        entry = self._file(fd)
        self._count(_operation)
        if entry.inode is _DIR:
            self._fault(_operation)
            self._sync_directory(entry.path)
            return
        inode = entry.inode
        try:
            self._fault(_operation)
        except OSError as exc:
            if exc.errno == errno.EIO:  # the dirty pages are dropped, marked clean
                if inode.lost_from is None and len(inode.data) > len(inode.durable):
                    inode.lost_from = len(inode.durable)
                for offset, length in inode.dirty:
                    for at in range(offset, min(offset + length, len(inode.durable))):
                        inode.lost.setdefault(at, inode.durable[at])
                inode.dirty.clear()
            raise
        end = len(inode.data) if inode.lost_from is None else inode.lost_from
        if inode.lost:
            synced = bytearray(inode.data[:end])
            for at, old in inode.lost.items():
                if at < len(synced):
                    synced[at] = old
            inode.durable = bytes(synced)
        else:
            inode.durable = bytes(inode.data[:end])
        inode.dirty.clear()
        inode.shrunk = False
        if self.on_sync is not None:
            self.on_sync(entry.path)
        made = [number for length, number in inode.appends if length <= end]
        if made:
            inode.appends = [append for append in inode.appends if append[0] > end]
            if self.on_durable is not None:
                self.on_durable(entry.path, made)

    def fdatasync(self, fd: int) -> None:
        """As :meth:`fsync` (a file's size and bytes; its timestamps are not modelled);
        its faults are queued under "fdatasync"."""
        self.fsync(fd, "fdatasync")

    def _sync_directory(self, directory: str) -> None:
        self._durable_dirs[directory] = dict(self._dirs[directory])
        self._meta_log = [change for change in self._meta_log if change[0] != directory]

    def ftruncate(self, fd: int, length: int) -> None:
        entry = self._file(fd)
        self._fault("ftruncate")
        inode = entry.inode
        if length > len(inode.data):
            inode.data.extend(bytes(length - len(inode.data)))
        del inode.data[length:]
        if inode.lost_from is not None and inode.lost_from >= length:
            inode.lost_from = None
        inode.lost = {at: old for at, old in inode.lost.items() if at < length}
        inode.dirty = [(offset, min(size, length - offset)) for offset, size in inode.dirty if offset < length]
        inode.appends = [append for append in inode.appends if append[0] <= length]
        if length < len(inode.durable):
            inode.shrunk = True
        self._full = False

    def fstat(self, fd: int) -> SimStat:
        entry = self._file(fd)
        if entry.inode is _DIR:
            return SimStat(0, stat_module.S_IFDIR | self._dir_modes[entry.path], self.uid)
        return SimStat(len(entry.inode.data), stat_module.S_IFREG | entry.inode.mode, self.uid)

    def fchmod(self, fd: int, mode: int) -> None:
        entry = self._file(fd)
        if entry.inode is not _DIR:
            entry.inode.mode = mode & 0o777

    def stat(self, path, follow_symlinks: bool = True) -> SimStat:
        path = posixpath.normpath(os.fspath(path))
        if path in self._dirs:
            return SimStat(0, stat_module.S_IFDIR | self._dir_modes[path], self.uid)
        inode = self._lookup(path)
        return SimStat(len(inode.data), stat_module.S_IFREG | inode.mode, self.uid)

    def statvfs(self, path) -> SimStatvfs:
        """The room left on the disk, in 1-byte blocks (what writes may still take)."""
        self.stat(path)
        free = (1 << 50) if self.capacity is None else max(0, self.capacity - self.used_bytes())
        return SimStatvfs(free, free)

    def chmod(self, path, mode: int) -> None:
        path = posixpath.normpath(os.fspath(path))
        if path in self._dirs:
            self._dir_modes[path] = mode & 0o777
        else:
            self._lookup(path).mode = mode & 0o777

    def mkdir(self, path, mode: int = 0o777) -> None:
        path = posixpath.normpath(os.fspath(path))
        if path in self._dirs:
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), path)
        parent = posixpath.dirname(path)
        if parent not in self._dirs:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), parent)
        self._dirs[path] = {}
        self._durable_dirs[path] = {}  # directories themselves are taken as durable
        self._dir_modes[path] = mode & 0o777

    def makedirs(self, path, mode: int = 0o777, exist_ok: bool = False) -> None:
        path = posixpath.normpath(os.fspath(path))
        if path in self._dirs:
            if not exist_ok:
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), path)
            return
        parent = posixpath.dirname(path)
        if parent not in self._dirs:
            self.makedirs(parent, mode, exist_ok=True)
        self.mkdir(path, mode)

    def exists(self, path) -> bool:
        path = posixpath.normpath(os.fspath(path))
        if path in self._dirs:
            return True
        directory, name = self._split(path)
        return name in self._dirs.get(directory, {})

    def unlink(self, path) -> None:
        directory, name = self._split(path)
        if name not in self._dir(directory):
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), os.fspath(path))
        self._set_entry(directory, name, None)

    def replace(self, source, target) -> None:
        self._fault("replace")
        inode = self._lookup(source)
        source_dir, source_name = self._split(source)
        target_dir, target_name = self._split(target)
        self._dir(target_dir)
        self._set_entry(target_dir, target_name, inode)
        self._set_entry(source_dir, source_name, None)

    rename = replace

    def scandir(self, directory) -> list[SimDirEntry]:
        directory = posixpath.normpath(os.fspath(directory))
        return [SimDirEntry(name, posixpath.join(directory, name), self) for name in sorted(self._dir(directory))]

    def listdir(self, directory) -> list[str]:
        return [entry.name for entry in self.scandir(directory)]

    def read_file(self, path) -> bytes:
        """The whole file as every process sees it now (``open(path, "rb").read()``)."""
        return bytes(self._lookup(path).data)

    # ------------------------------------------------------------------ power and damage
    def power_cut(self) -> None:
        """The host loses power: what was not durable is lost, partly (see the module docstring).
        Open descriptors are gone with the processes that held them."""
        self._count("power_cut")
        rng = self.rng
        keep = rng.randint(0, len(self._meta_log))
        survivors: dict[str, dict[str, _Inode]] = {d: dict(entries) for d, entries in self._durable_dirs.items()}
        for directory, name, inode in self._meta_log[:keep]:
            if inode is None:
                survivors.get(directory, {}).pop(name, None)
            else:
                survivors.setdefault(directory, {})[name] = inode
        seen: set[int] = set()
        for entries in survivors.values():
            for inode in entries.values():
                if id(inode) in seen:
                    continue
                seen.add(id(inode))
                self._cut_file(inode)
        self._dirs = survivors
        self._durable_dirs = {d: dict(entries) for d, entries in survivors.items()}
        self._meta_log = []
        self._fds.clear()
        self._faults.clear()
        self._full = False

    def _cut_file(self, inode: _Inode) -> None:
        rng = self.rng
        durable = inode.durable
        end = len(inode.data) if inode.lost_from is None else inode.lost_from
        current = bytes(inode.data[:end])
        dirty, inode.dirty, inode.lost = inode.dirty, [], {}
        inode.appends = []  # what the cut keeps of them is the next boot's, not made durable by a sync
        if inode.shrunk or len(current) < len(durable):  # cut below its durable end, not synced
            inode.data = bytearray(durable)
            inode.lost_from = None
            inode.shrunk = False
            return
        if dirty:  # rewrites in place not synced: each kept whole, not at all, or its first part
            base = bytearray(durable)
            for offset, length in dirty:
                kept = rng.choice((0, length, rng.randint(0, length)))
                base[offset:offset + kept] = current[offset:offset + kept]
                if 0 < kept < length:
                    self._count("torn_write")
            durable = bytes(base)
        extra = current[len(durable):]
        kept = extra[: rng.randint(0, len(extra))] if extra else b""
        if kept and rng.random() < 0.5:  # the last write torn: its end is garbage or zeros
            torn = rng.randint(1, min(len(kept), 512))
            filler = bytes(rng.getrandbits(8) for _ in range(torn)) if rng.random() < 0.5 else bytes(torn)
            kept = kept[:-torn] + filler
            self._count("torn_write")
        inode.data = bytearray(durable + kept)
        inode.durable = bytes(inode.data)
        inode.lost_from = None

    def files(self, directory) -> list[str]:
        """The paths of the files in ``directory`` (sorted)."""
        return [entry.path for entry in self.scandir(directory)]

    def flip_bit(self, path, offset: int | None = None) -> int:
        """Flip one bit of a file (media damage at rest); returns the byte offset."""
        inode = self._lookup(path)
        if not inode.data:
            return -1
        at = self.rng.randrange(len(inode.data)) if offset is None else offset
        inode.data[at] ^= 1 << self.rng.randrange(8)
        inode.durable = bytes(inode.data)
        self._count("bit_flip")
        return at

    def truncate_file(self, path, length: int | None = None) -> int:
        """Cut a file short (an operator or a file system repair did it); returns the new length."""
        inode = self._lookup(path)
        length = self.rng.randint(0, len(inode.data)) if length is None else length
        del inode.data[length:]
        inode.durable = bytes(inode.data)
        self._count("truncation")
        return length
