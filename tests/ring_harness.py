"""An executor over one client's ring, in this process: a wheel, the ring (the daemon's
end and the client's), its client slot and an Executor, for tests that push records
and call ``apply_ring`` themselves."""

from __future__ import annotations

import collections
import contextlib
import os
import uuid
from dataclasses import dataclass

from wheeld.daemon import executor as E
from wheeld.daemon.client_table import ClientSlot
from wheeld.shm import TimerWheel
from wheeld.shm.ring import ClientSegment


@dataclass
class RingExecutor:
    wheel: TimerWheel
    gid: int
    cs: ClientSlot  # its segment is the daemon's end of the ring
    producer: ClientSegment  # the client's end
    executor: E.Executor


def never_poisoned(cs, reason):
    raise AssertionError(f"poisoned: {reason}")


@contextlib.contextmanager
def ring_executor(capacity: int, start_ms: int = 1000, ring: int = 64, touch: int = 16):
    """A wheel of ``capacity`` records at ``start_ms``, group "g", one client's ring; every
    segment closed (and the ring unlinked) on the way out, even on failure."""
    wheel = TimerWheel.create(capacity, start_ms=start_ms)
    try:
        gid = wheel.group_id("g")
        consumer = ClientSegment.create(f"/wheeld-test-{os.getpid()}-{uuid.uuid4().hex[:8]}", ring, touch)
        try:
            producer = ClientSegment.attach(os.dup(consumer.fd), consumer.name)
            try:
                cs = ClientSlot(1, consumer, "ring", gid, "g", os.getpid(), os.getuid())
                executor = E.Executor(wheel, {1: cs}, 1, 0, collections.Counter(), never_poisoned, lambda: start_ms)
                yield RingExecutor(wheel, gid, cs, producer, executor)
            finally:
                producer.close()
        finally:
            consumer.close()
    finally:
        wheel.close()
