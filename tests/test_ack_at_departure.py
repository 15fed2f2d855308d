"""A client that leaves with more in its ring than one drain takes: its acknowledgements
are applied before what was sent to it goes back to its group.

When a client's session ends, the daemon applies what the client left in its ring (the
acknowledgements it pushed among them) and only then hands what it had sent the client,
unacknowledged, to another member of the group (daemon/sessions.py,
``_apply_what_it_left``). The whole ring: one drain takes at most 8192 commands, and a
ring handed back after a reboot, replayed from the client's last acknowledged flush,
can hold more. The daemon is stopped (SIGSTOP) while the worker fills its ring, so
nothing of it is applied before the worker dies.
"""

from __future__ import annotations

import os
import signal

import pytest
from test_ack_only_what_was_handed import Worker, collect

import wheeld

N = 5
PUSHED = 9_000  # more than one drain's worth (DRAIN_BATCH, 8192), less than the ring (16384)

pytestmark = pytest.mark.timeout(180)


def test_acks_behind_more_than_one_drain_are_applied_before_a_redelivery(daemon_factory):
    daemon = daemon_factory().start()
    worker = Worker(daemon.socket_path, "g")
    try:
        worker.ask(f"add {N} 50")
        assert worker.ask(f"buffer {N}")["buffered"] == N
        with wheeld.connect(daemon.socket_path, group="g") as other:  # a member from now on
            assert other.poll(0.2) == []
            handed = worker.ask("poll")["keys"]
            assert sorted(handed) == sorted(f"k{i}" for i in range(N))
            os.kill(daemon.pid, signal.SIGSTOP)
            try:
                state = worker.ask(f"push {PUSHED}")
                assert state["acks"] == 0, "the acknowledgements are in the ring, behind the adds"
                worker.kill()  # it leaves: its ring holds PUSHED adds, then N acks
            finally:
                os.kill(daemon.pid, signal.SIGCONT)
            got = collect(other, N, 3.0)
            assert got == [], f"acknowledged, yet sent to another member: {sorted(e.key for e in got)}"
            counters = daemon.counters()
            assert counters["fired_unacked"] == 0 and counters["pending"] == PUSHED, counters
    finally:
        worker.kill()
