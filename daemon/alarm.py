"""A one-shot wake-up at an absolute CLOCK_MONOTONIC time, with microsecond precision.

The daemon parks until the start of the millisecond in which the next timer is
due. uvloop's ``call_later`` works in whole milliseconds of a cached loop clock:
a delay under 0.5 ms fires at once (the daemon spun through the rest of every
millisecond: ~1 core at 25k expirations/s) and 0.6 ms sleeps ~1.15 ms (up to a
millisecond of lateness). A Linux ``timerfd`` armed with an absolute deadline
and watched by the loop like any socket wakes it 40-80 us after the deadline
(timer slack), never before, for one system call per park
(``python -m bench.daemon_paths`` measures both). The compiled build makes that call
in C (:func:`wheeld.daemon.executor.timerfd_arm`); the Python path through ctypes.

``Alarm.create()`` returns None where timerfd is unavailable; the caller then
falls back to the loop's own timer.
"""

from __future__ import annotations

import ctypes
import os
import time

_CLOCK_MONOTONIC = 1
_TFD_TIMER_ABSTIME = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


def _compiled_arm():
    """The compiled ``timerfd_settime`` (:func:`wheeld.daemon.executor.timerfd_arm`, a
    fraction of the ctypes call's cost), or None on the Python path."""
    from . import executor

    return None if executor.__file__.endswith(".py") else executor.timerfd_arm


class Alarm:
    """``arm(at_ns)`` (re)sets the one deadline; the fd becomes readable when it passes;
    ``consume()`` makes it unreadable again. Arming a time already past fires at once."""

    def __init__(self, fd: int, settime):
        self._fd = fd
        self._settime = settime

    @classmethod
    def create(cls) -> "Alarm | None":
        if hasattr(os, "timerfd_create"):  # Python 3.13+
            try:
                fd = os.timerfd_create(time.CLOCK_MONOTONIC, flags=os.TFD_NONBLOCK | os.TFD_CLOEXEC)
            except OSError:
                return None

            def settime(at_ns: int) -> None:
                os.timerfd_settime_ns(fd, flags=os.TFD_TIMER_ABSTIME, initial=max(at_ns, 1))  # 0 would disarm

            return cls(fd, settime)
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            create = libc.timerfd_create
            settime_c = libc.timerfd_settime
        except (OSError, AttributeError):
            return None
        create.argtypes = [ctypes.c_int, ctypes.c_int]
        settime_c.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(_Itimerspec), ctypes.c_void_p]
        fd = create(_CLOCK_MONOTONIC, os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            return None
        arm_c = _compiled_arm()
        if arm_c is not None:

            def settime(at_ns: int) -> None:
                err = arm_c(fd, at_ns)
                if err:
                    raise OSError(err, f"timerfd_settime: {os.strerror(err)}")

            return cls(fd, settime)
        spec = _Itimerspec()
        value = spec.it_value
        spec_ref = ctypes.byref(spec)

        def settime(at_ns: int) -> None:
            # it_value all zero would disarm: a deadline at 0 ns means "now"
            value.tv_sec, value.tv_nsec = divmod(max(at_ns, 1), 1_000_000_000)
            if settime_c(fd, _TFD_TIMER_ABSTIME, spec_ref, None) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"timerfd_settime: {os.strerror(err)}")

        return cls(fd, settime)

    def fileno(self) -> int:
        return self._fd

    def arm(self, at_ns: int) -> None:
        self._settime(at_ns)

    def consume(self) -> bool:
        """True if the alarm had fired (the fd was readable)."""
        try:
            os.read(self._fd, 8)
        except (BlockingIOError, InterruptedError):
            return False
        return True

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
