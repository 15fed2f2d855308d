"""The blocking client's wait for room in a full ring (wheeld.sync.Client._wait_for_room).

A full ring means the daemon is a whole ring of commands behind. The client rings the
doorbell and sleeps (50 us, doubling up to 1 ms) until an eighth of the ring is free,
so that it refills the ring in one go and leaves the cores to the daemon meanwhile
(polling with sched_yield took half of a pushing client's CPU on 2 cores). Past
``ring_timeout_s`` it returns with whatever room came, or raises RingFull with none.
The rule is checked on a scripted segment and clock; the last test pushes many rings'
worth through a real daemon.
"""

from __future__ import annotations

import os
import signal
import threading

import pytest

import wheeld
from wheeld import sync
from wheeld.protocol.errors import RingFull


class _Clock:
    """time.monotonic and time.sleep for sync.py: the sleeps are recorded and pass at once."""

    def __init__(self):
        self.now = 1000.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class _Segment:
    def __init__(self, capacity: int, free: list[int]):
        self.ring_capacity = capacity
        self.looks = free  # what each free_slots() call returns; the last one from then on

    def free_slots(self) -> int:
        return self.looks.pop(0) if len(self.looks) > 1 else self.looks[0]


class _Waiter:
    """The attributes _wait_for_room uses, on nothing else."""

    def __init__(self, segment: _Segment, ring_timeout_s: float = 5.0):
        self._segment = segment
        self.ring_timeout_s = ring_timeout_s
        self.doorbells = 0

    def _ring_doorbell(self, urgent: bool = True) -> None:
        assert urgent
        self.doorbells += 1


@pytest.fixture
def clock(monkeypatch):
    fake = _Clock()
    monkeypatch.setattr(sync, "time", fake)
    return fake


def test_it_rings_then_sleeps_until_an_eighth_of_the_ring_is_free(clock):
    waiter = _Waiter(_Segment(1024, [0, 0, 1, 64, 127, 128, 0]))
    sync.Client._wait_for_room(waiter)
    assert waiter.doorbells == 1  # urgent: a parked daemon wakes at once
    assert clock.sleeps == [0.00005, 0.0001, 0.0002, 0.0004, 0.0008]  # one per look short of 128
    assert waiter._segment.looks == [0]  # it stopped at the first look with an eighth free (128)


def test_the_sleeps_double_up_to_a_millisecond(clock):
    waiter = _Waiter(_Segment(64, [0] * 12 + [8]))
    sync.Client._wait_for_room(waiter)
    assert clock.sleeps[:6] == [0.00005, 0.0001, 0.0002, 0.0004, 0.0008, 0.001]
    assert set(clock.sleeps[5:]) == {0.001} and len(clock.sleeps) == 12


def test_a_tiny_ring_waits_for_one_slot(clock):
    waiter = _Waiter(_Segment(4, [0, 1]))
    sync.Client._wait_for_room(waiter)
    assert clock.sleeps == [0.00005]


def test_past_the_timeout_some_room_is_enough_and_none_is_ring_full(clock):
    some = _Waiter(_Segment(1024, [3]), ring_timeout_s=0.5)
    sync.Client._wait_for_room(some)
    assert 0.5 <= sum(clock.sleeps) < 0.502

    clock.sleeps.clear()
    none = _Waiter(_Segment(1024, [0]), ring_timeout_s=0.5)
    with pytest.raises(RingFull, match="stayed full for 0.5 s"):
        sync.Client._wait_for_room(none)
    assert 0.5 <= sum(clock.sleeps) < 0.502


def test_a_client_pushing_many_rings_through_a_stopped_then_running_daemon_loses_nothing(daemon_factory):
    d = daemon_factory(extra=["--ring-capacity", "256"]).start()
    with wheeld.connect(d.socket_path, group="ringwait", ring_timeout_s=20.0) as w:
        w.flush()
        pushed = []
        os.kill(d.pid, signal.SIGSTOP)  # the ring fills; the pushing thread waits, asleep
        try:
            worker = threading.Thread(target=lambda: [pushed.append(w.add(f"k{i}", 3_600_000))
                                                      for i in range(256 * 20)])
            worker.start()
            worker.join(0.3)
            assert worker.is_alive() and len(pushed) == 256  # a full ring, then the wait
        finally:
            os.kill(d.pid, signal.SIGCONT)
        worker.join(20)
        assert not worker.is_alive() and len(pushed) == 256 * 20
        w.flush()
    # (the counters as published at the daemon's next park: they may lag a flush by ~10 ms)
    assert d.wait_parked()["pending"] == 256 * 20
