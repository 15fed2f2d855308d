"""Sealed anonymous shared memory (Linux ``memfd``) for segments a client maps.

A POSIX shared-memory object that a client can open for writing can also be
``ftruncate``-d by that client; the daemon would then take SIGBUS touching the
missing pages. So every segment the daemon shares with a client is a memfd:

* created by the daemon with ``memfd_create(MFD_ALLOW_SEALING | MFD_CLOEXEC)``,
  sized, then sealed with ``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``: its size
  can never change again, whoever holds a descriptor (``memfd_create(2)``,
  "File sealing");
* never named in ``/dev/shm``: it reaches exactly one client, over that client's
  Unix socket as ``SCM_RIGHTS`` ancillary data (``unix(7)``), so no other user
  can open it (only through ``/proc/PID/fd``, which needs ptrace rights over the
  client, i.e. its own uid or root);
* when the daemon must share one page with every client read-only (the status
  page), it hands out a descriptor re-opened ``O_RDONLY`` through
  ``/proc/self/fd``: ``mmap`` with ``PROT_WRITE`` and ``ftruncate`` both fail on it.
  That alone is not enough: a memfd's mode is 0777 and a client can open its own
  ``/proc/self/fd/N`` again with ``O_RDWR``. So once the daemon has mapped the
  page, it adds ``F_SEAL_FUTURE_WRITE`` (Linux 5.1): from then on no descriptor,
  however opened, gives a writable mapping or a ``write(2)``; the daemon's own
  mapping stays writable (``memfd_create(2)``, "File sealing");
* made mode ``0600`` at once, for the same reason and for every segment: whoever
  holds a descriptor of a memfd can open it again through ``/proc/self/fd/N`` with
  the access the *mode* allows; at ``0600`` only the daemon's uid (and root) can.

A descriptor that comes back from a client (a ring handed back after a daemon
restart) is checked with :func:`check_sealed` before it is mapped: the seals
cannot be removed once set, so a descriptor that has them cannot be resized.
"""

from __future__ import annotations

import fcntl
import os
import stat

from wheeld.protocol.errors import ProtocolError

REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x10)  # <linux/fcntl.h>; not in Python 3.11's fcntl
#: seals that would stop the daemon from mapping the segment writable
_WRITE_SEALS = fcntl.F_SEAL_WRITE | F_SEAL_FUTURE_WRITE


def create_sealed(name: str, size: int, final: bool = True) -> int:
    """A new memfd of exactly ``size`` bytes (zero-filled) whose size is sealed; returns the fd.

    ``final=False`` leaves ``F_SEAL_SEAL`` off, for :func:`seal_writes` after mapping."""
    fd = os.memfd_create(name[-249:] or "wheeld", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.fchmod(fd, 0o600)  # born 0777: see "made mode 0600" above
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, REQUIRED_SEALS | (fcntl.F_SEAL_SEAL if final else 0))
    except BaseException:
        os.close(fd)
        raise
    return fd


def seal_writes(fd: int) -> None:
    """After the creator mapped the memfd ``fd`` writable: nobody writes it any more
    but through that mapping (``F_SEAL_FUTURE_WRITE``), and no seal changes. On a
    kernel without that seal (before 5.1) the file is made read-only for everyone
    instead, which stops other uids (not root, not the daemon's own uid)."""
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL)
    except OSError:
        os.fchmod(fd, 0o444)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL)


def check_sealed(fd: int, min_size: int = 0, max_size: int | None = None) -> int:
    """Size of the memfd ``fd`` after checking that it cannot shrink or grow and can be
    mapped writable; ProtocolError otherwise (the descriptor came from a client)."""
    try:
        st = os.fstat(fd)
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        mode = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE
    except OSError as exc:
        raise ProtocolError(f"the descriptor passed is not a sealed memfd: {exc}") from None
    if not stat.S_ISREG(st.st_mode) or seals & REQUIRED_SEALS != REQUIRED_SEALS:
        raise ProtocolError(f"the descriptor passed is not a memfd sealed against resizing (seals {seals:#x})")
    if seals & _WRITE_SEALS or mode != os.O_RDWR:
        raise ProtocolError("the descriptor passed cannot be mapped writable")
    if st.st_size < min_size or (max_size is not None and st.st_size > max_size):
        raise ProtocolError(f"the segment passed is {st.st_size} bytes, outside [{min_size}, {max_size}]")
    return st.st_size


def reopen_readonly(fd: int) -> int:
    """A second descriptor of the memfd ``fd`` that only allows reading (see the module docstring)."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
