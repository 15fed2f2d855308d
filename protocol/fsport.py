"""File operations through a port that has the names of the :mod:`os` functions.

The journal's engine (:mod:`wheeld.journal.files`,
:mod:`wheeld.journal.recovery`, and the daemon modules that read or
write journal files) performs every file operation through an ``fs`` object:
``fs.open``, ``fs.write``, ``fs.pwrite``, ``fs.fsync``, ``fs.fdatasync``,
``fs.ftruncate``, ``fs.close``, ``fs.fstat``, ``fs.fchmod``, ``fs.stat``,
``fs.chmod``, ``fs.mkdir``, ``fs.makedirs``, ``fs.unlink``, ``fs.replace``,
``fs.rename``, ``fs.scandir``, ``fs.statvfs``. The real port is the :mod:`os`
module itself, so code written against it runs unchanged for real; a simulation
passes an object with the same methods (``tests/sim/disk.py``), which keeps the
files in memory and decides what a power cut or a failing device does to them.

The few operations the :mod:`os` module has no function for (reading a whole
file, whether a path exists) are the functions below, which take the port as
their first argument: for the real port they do what :mod:`pathlib` does; for
another they call its method of the same name where it has one, and otherwise
build the answer from its ``os``-named methods.

Paths: the real port takes :class:`pathlib.Path` or ``str``; the simulated one
absolute POSIX paths (a ``Path`` converts through ``os.fspath``).
"""

from __future__ import annotations

import os
import stat as stat_module

__all__ = ["read_file", "read_line", "exists", "is_dir", "file_size", "unlink", "fsync_dir", "write_all",
           "free_bytes"]


def read_file(fs, path, limit: int | None = None) -> bytes:
    """The file's bytes as every process sees them now (the first ``limit`` only, if given)."""
    if fs is os:
        with open(path, "rb") as file:
            return file.read() if limit is None else file.read(limit)
    data = fs.read_file(path)
    return data if limit is None else data[:limit]


def read_line(fs, path) -> bytes:
    """The file's first line, with its newline (``open(path, "rb").readline()``)."""
    if fs is os:
        with open(path, "rb") as file:
            return file.readline()
    data = fs.read_file(path)
    end = data.find(b"\n")
    return data if end < 0 else data[: end + 1]


def exists(fs, path) -> bool:
    """``Path(path).exists()``: False for a path that is not there (or under a non-directory)."""
    method = getattr(fs, "exists", None) if fs is not os else None
    if method is not None:
        return method(path)
    try:
        fs.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    return True


def is_dir(fs, path) -> bool:
    """``Path(path).is_dir()``."""
    try:
        return stat_module.S_ISDIR(fs.stat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False


def file_size(fs, path) -> int:
    return fs.stat(path).st_size


def unlink(fs, path, missing_ok: bool = False) -> None:
    """``Path(path).unlink(missing_ok=...)``."""
    try:
        fs.unlink(path)
    except FileNotFoundError:
        if not missing_ok:
            raise


def fsync_dir(fs, directory) -> None:
    """Make the directory's entries (a create, a rename, an unlink) durable."""
    fd = fs.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fs.fsync(fd)
    finally:
        fs.close(fd)


def write_all(fs, fd: int, data) -> None:
    """``write(2)`` until every byte is taken (a short write is followed by the rest)."""
    view = memoryview(data)
    while view:
        written = fs.write(fd, view)
        view = view[written:]


def free_bytes(fs, directory) -> int:
    """Bytes this process may still write on the filesystem of ``directory`` (root may
    use the blocks reserved for it)."""
    info = fs.statvfs(directory)
    return (info.f_bfree if os.geteuid() == 0 else info.f_bavail) * info.f_frsize
