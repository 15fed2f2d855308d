"""daemon.alarm: the daemon's precise park wake-up (a timerfd at an absolute deadline)."""

from __future__ import annotations

import select
import time

from wheeld.daemon.alarm import Alarm


def test_alarm_fires_at_its_deadline_not_before_and_rearming_replaces_it():
    alarm = Alarm.create()
    assert alarm is not None, "Linux has timerfd"
    try:
        at = time.monotonic_ns() + 30_000_000
        alarm.arm(at)
        assert not alarm.consume(), "not readable before its deadline"
        readable, _, _ = select.select([alarm], [], [], 2.0)
        assert readable and time.monotonic_ns() >= at
        assert alarm.consume() and not alarm.consume(), "one expiry, consumed once"

        alarm.arm(time.monotonic_ns() + 10_000_000_000)
        alarm.arm(time.monotonic_ns() + 5_000_000)  # the later deadline is replaced
        readable, _, _ = select.select([alarm], [], [], 2.0)
        assert readable and alarm.consume()

        alarm.arm(time.monotonic_ns() - 1_000_000)  # already past: fires at once
        readable, _, _ = select.select([alarm], [], [], 0.5)
        assert readable and alarm.consume()
        alarm.arm(0)  # the epoch of the clock: past, not "disarm"
        readable, _, _ = select.select([alarm], [], [], 0.5)
        assert readable and alarm.consume()
    finally:
        alarm.close()


def _ctypes_gettime(fd: int) -> tuple[int, int]:
    """(tv_sec, tv_nsec) of the timerfd's armed time left (timerfd_gettime)."""
    import ctypes

    from wheeld.daemon.alarm import _Itimerspec

    libc = ctypes.CDLL(None, use_errno=True)
    spec = _Itimerspec()
    assert libc.timerfd_gettime(fd, ctypes.byref(spec)) == 0
    return spec.it_value.tv_sec, spec.it_value.tv_nsec


def test_the_compiled_arm_sets_what_the_ctypes_arm_sets(monkeypatch):
    """``executor.timerfd_arm`` (the compiled build's settime) against the ctypes call
    ``Alarm.create`` makes on the Python path: the same absolute time left on the fd, an
    armed fd for a time at or before 0, and the errno of a bad descriptor."""
    import errno

    import pytest

    from wheeld.daemon import alarm as alarm_module
    from wheeld.daemon import executor

    if executor.__file__.endswith(".py"):
        pytest.skip("the compiled build is not in use")
    compiled = Alarm.create()
    monkeypatch.setattr(alarm_module, "_compiled_arm", lambda: None)
    reference = Alarm.create()
    try:
        assert compiled._settime is not reference._settime
        for ahead_ns in (10_000_000_000, 123_456_789_012, 7):
            at = time.monotonic_ns() + ahead_ns
            compiled.arm(at)
            reference.arm(at)
            (cs, cn), (rs, rn) = _ctypes_gettime(compiled.fileno()), _ctypes_gettime(reference.fileno())
            left_c, left_r = cs * 10**9 + cn, rs * 10**9 + rn
            assert abs(left_c - left_r) < 50_000_000 and (left_c > 0) == (left_r > 0)  # read a moment apart
        for at in (0, -5):
            compiled.arm(at)
            reference.arm(at)
            readable, _, _ = select.select([compiled, reference], [], [], 0.5)
            assert len(readable) == 2 and compiled.consume() and reference.consume()
        assert executor.timerfd_arm(-1, 1) == errno.EBADF
    finally:
        compiled.close()
        reference.close()
