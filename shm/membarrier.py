"""membarrier(2): the doorbell's eventcount with the fence paid by the daemon, not by every push.

The eventcount (:mod:`wheeld.daemon.core`, "Parking") is a Dekker pair across two
processes: the client stores its ring's tail and then loads the status page's
``parked`` word; the daemon stores ``parked`` and then loads every tail. x86-64 may
let each load pass the store before it, so each side needs a store-load fence
between the two, or both can miss the other: the client rings no doorbell and the
daemon sleeps with a command in the ring (until its next deadline, at most
``--max-park-ms``). A locked instruction costs little on its own, but it waits for
the store before it to leave the store buffer, and with the daemon reading the ring
on the other core that store is a cache miss: the client would pay it on every push.

``membarrier(MEMBARRIER_CMD_GLOBAL_EXPEDITED)`` moves the whole fence to the rare
side (the technique of userspace RCU's and Folly's asymmetric barriers). A process
that registered for it (:func:`register`) has every one of its running threads pass
a full memory barrier, by an interrupt, before the daemon's call returns; a thread
that is not running has passed one at its last context switch. So with the daemon
issuing it between its store of ``parked`` and its re-check of the rings, a client
needs only to keep the compiler from reordering its tail store and its load of
``parked``:

* if the client's barrier point (the interrupt, or its context switch) comes after
  its tail store, the store is visible before the daemon's re-check, which sees the
  command and does not sleep;
* if it comes before the tail store, the client's later load of ``parked`` comes after
  it too, and so after the daemon's store: the client sees the new epoch and rings.

The daemon issues it at each park a client may ring into, and says so in its status
page (:data:`wheeld.protocol.status_layout.BARRIER_OFFSET`); a client drops its own
fence only when the page says so and its registration succeeded. The call is not
free: about 0.5 us alone, ~10 us when a registered client runs on another core of a
virtual machine (the interrupt), so a park that ends within ``--coalesce-us`` takes
the plain fence instead: its ``quiet_from`` is already past, no client rings into it
whatever it reads, and a push its re-check misses is applied at its end either way. A
kernel without the command (before Linux 4.16) or a seccomp profile that refuses the
system call leaves both sides with their fences, as before.
"""

from __future__ import annotations

import ctypes
import os
import platform

# linux/membarrier.h
CMD_QUERY = 0
CMD_GLOBAL_EXPEDITED = 1 << 1
CMD_REGISTER_GLOBAL_EXPEDITED = 1 << 2
_NR_MEMBARRIER = {"x86_64": 324, "aarch64": 283}.get(platform.machine())

_syscall = None  # libc's syscall(), loaded at the first call
_registered_pid = 0  # the process that registered (a forked child registers again)


def _call(cmd: int) -> int:
    global _syscall
    if _NR_MEMBARRIER is None:
        return -1
    if _syscall is None:
        _syscall = ctypes.CDLL(None, use_errno=True).syscall
        _syscall.restype = ctypes.c_long
    return _syscall(_NR_MEMBARRIER, cmd, 0, 0)


def supported() -> bool:
    """Does this kernel offer the global expedited barrier and its registration?"""
    commands = _call(CMD_QUERY)
    wanted = CMD_GLOBAL_EXPEDITED | CMD_REGISTER_GLOBAL_EXPEDITED
    return commands >= 0 and commands & wanted == wanted


def register() -> bool:
    """Register this process to receive the daemon's barriers; False when the kernel
    refuses (the caller then keeps its own fence). Once per process."""
    global _registered_pid
    pid = os.getpid()
    if _registered_pid != pid:
        if _call(CMD_REGISTER_GLOBAL_EXPEDITED) != 0:
            return False
        _registered_pid = pid
    return True


def barrier() -> None:
    """A full memory barrier in this thread and in every running thread of every
    registered process. OSError if the kernel refused it."""
    if _call(CMD_GLOBAL_EXPEDITED) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"membarrier(GLOBAL_EXPEDITED): {os.strerror(errno)}")


def daemon_barrier():
    """:func:`barrier` when the kernel offers it, else None (the daemon then fences alone
    and its status page tells the clients to keep their fences)."""
    return barrier if supported() else None
