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
