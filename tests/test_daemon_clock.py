"""The daemon's core on an injected clock: its loop iteration run by hand, time passed by the test.

The daemon's own counters (late_total, journal_lsn, journal_durable_lsn) are checked
in the arena header, where wheelctl and the metrics endpoint read them.
"""

from __future__ import annotations

import os

import pytest

from daemon_harness import unique_name, unlink_segments
from wheeld.daemon.config import Config
from wheeld.daemon.core import PUBLISH_EVERY_MS, DaemonCore
from wheeld.daemon.host import real_host
from wheeld.protocol import arena_layout as AL


class QuietShell:
    """A shell that is never asked to do anything the tests look at."""

    def wake(self) -> None:
        pass

    def wake_at(self, at_ns: int) -> None:
        pass

    def resume_accept(self) -> None:
        pass

    def status_changed(self) -> None:
        pass


class FakeClock:
    def __init__(self, ms: int):
        self.ms = ms

    def __call__(self) -> int:
        return self.ms


@pytest.fixture
def daemon_on_a_fake_clock(tmp_path):
    """A core whose arena is open (no socket, no loop) and whose clock the test moves."""
    name = unique_name()
    config = Config(socket_path=str(tmp_path / "w.sock"), name=name, capacity=1000,
                    journal_dir=str(tmp_path / "journal"), fsync="always")
    clock = FakeClock(10_000_000)
    daemon = DaemonCore(config, real_host(clock), QuietShell())
    try:
        daemon.acquire()
        daemon.open()
        yield daemon, clock
    finally:
        if daemon.lock is not None:
            daemon.lock.release()
        if daemon.recorder is not None:
            daemon.recorder.close()
        if daemon.status is not None:
            daemon.status.close()
        if daemon.wheel is not None:
            daemon.wheel.close()
        unlink_segments(name)


def _counter(daemon: DaemonCore, name: str) -> int:
    return daemon.wheel.header_words()[AL.H_COUNTERS // 8 + AL.COUNTER[name]]


def test_time_passes_when_the_test_says_so_and_late_fires_are_counted(daemon_on_a_fake_clock):
    daemon, clock = daemon_on_a_fake_clock
    start = clock.ms
    gid = daemon.wheel.group_id("g")
    daemon.wheel.schedule("on-time", start + 5, gid)
    daemon.wheel.schedule("late", start + 6, gid)
    clock.ms = start + 4
    daemon.iterate()
    assert len(daemon.wheel) == 2 and daemon.delivery.undelivered() == 0, "nothing fires early"
    clock.ms = start + 5
    daemon.iterate()
    assert daemon.delivery.undelivered() == 1
    clock.ms = start + 10  # the loop was held up: "late" fires 4 ms (more than a tick) after its deadline
    daemon.iterate()
    assert daemon.delivery.undelivered() == 2 and len(daemon.wheel) == 0
    # counters go out at most every PUBLISH_EVERY_MS while the loop wakes each ms (the
    # last time at start + 4), and always before a longer park
    clock.ms = start + 4 + PUBLISH_EVERY_MS
    daemon.iterate()
    assert _counter(daemon, "late_total") == 1
    assert _counter(daemon, "daemon_heartbeat_ms") == clock.ms
    assert _counter(daemon, "daemon_pid") == os.getpid()


def test_counters_go_out_every_publish_interval_and_before_a_longer_park(daemon_on_a_fake_clock):
    daemon, clock = daemon_on_a_fake_clock
    start = clock.ms
    daemon.wheel.schedule("later", start + 1000, daemon.wheel.group_id("g"))
    daemon.iterate()
    assert _counter(daemon, "daemon_heartbeat_ms") == start
    clock.ms = start + 1
    daemon.iterate()  # a wake-up 1 ms later: not published again yet
    assert _counter(daemon, "daemon_heartbeat_ms") == start
    assert daemon.park() is not None  # a park of ~999 ms: the counters go out first
    assert _counter(daemon, "daemon_heartbeat_ms") == start + 1
    daemon.unpark()
    clock.ms = start + 1 + PUBLISH_EVERY_MS
    daemon.iterate()
    assert _counter(daemon, "daemon_heartbeat_ms") == clock.ms


def test_the_journal_positions_are_published(daemon_on_a_fake_clock):
    daemon, clock = daemon_on_a_fake_clock
    gid = daemon.wheel.group_id("g")
    daemon.wheel.schedule("k", clock.ms + 1, gid)
    clock.ms += 2
    daemon.iterate()  # the fire is journaled (fsync always: durable at once)
    journal = daemon.recorder.journal
    assert journal.last_lsn >= 1
    assert _counter(daemon, "journal_lsn") == journal.last_lsn
    assert _counter(daemon, "journal_durable_lsn") == journal.durable_lsn == journal.last_lsn
