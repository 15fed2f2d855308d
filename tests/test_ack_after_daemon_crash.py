"""A daemon crash between the hand-over and the acknowledgement hands nothing twice.

The client library hands an expiration to the application and pushes the
acknowledgement into its ring at its next poll; a daemon SIGKILLed in between never
reads it. The restarted daemon finds the record still FIRED, and the client slot it
was sent to in the record's aux word (daemon/delivery.py, "Recipients"): it keeps
the record for that client, which resumes its slot, recognises the copy (by key
and arming tag), and acknowledges it without handing it again. Another member of
the group is not sent it meanwhile. Only when that slot is freed (here: its client
died while the daemon was down, and ``--resume-grace-s`` passed) does the record
go to the group.

The worker whose library holds the expirations is tests/buffering_worker.py (it
polls only when told); the other member is a client in this process.
"""

from __future__ import annotations

import time

import pytest
from daemon_harness import wait_until
from test_ack_only_what_was_handed import Worker, collect

import wheeld

N = 20

pytestmark = pytest.mark.timeout(180)


def _holding(daemon) -> Worker:
    """A worker of group "g" whose library holds N expirations its application never had."""
    worker = Worker(daemon.socket_path, "g")
    try:
        worker.ask(f"add {N} 50")
        assert worker.ask(f"buffer {N}")["buffered"] == N  # sent to it, never handed
    except BaseException:
        worker.kill()
        raise
    return worker


def _restart_and_collect(daemon) -> tuple[list, float]:
    """Start the daemon again; what another member of "g" is handed (up to N, 20 s at most,
    then 0.3 s more for repeats) and how long the first N took."""
    daemon.start()
    started = time.monotonic()
    with wheeld.connect(daemon.socket_path, group="g") as other:
        got = collect(other, N, 20)
        waited = time.monotonic() - started
        got += other.poll(0.3)
    return got, waited


def test_a_restarted_daemon_sends_what_it_had_sent_to_the_same_client_not_to_another(daemon_factory):
    daemon = daemon_factory().start()
    worker = _holding(daemon)  # all sent to it: the only member
    try:
        handed = worker.ask("poll")["keys"]
        assert sorted(handed) == sorted(f"k{i}" for i in range(N))
        assert worker.ask("state")["acks"] == N, "acknowledgements queued, pushed at the next poll"
        with wheeld.connect(daemon.socket_path, group="g") as other:
            assert other.poll(0.2) == []
            daemon.kill()  # SIGKILL: the acknowledgements never reached it
            daemon.start()
            # the other member reconnects at once; the worker says nothing for a while
            got = collect(other, N, 2.0)
            assert got == [], f"handed to another member while its recipient's slot waits: {[e.key for e in got]}"
            assert daemon.counters()["fired_unacked"] == N
            # the worker resumes its slot, receives the copies and acknowledges them: handed once
            assert worker.ask("poll")["keys"] == []
            assert worker.ask("poll")["keys"] == []  # pushes the acknowledgements of the copies
            worker.ask("flush")
            wait_until(lambda: daemon.counters()["fired_unacked"] == 0, 10, "the copies acknowledged",
                       detail=lambda: str(daemon.counters()))
            assert other.poll(0.3) == []
    finally:
        worker.kill()


def test_what_waits_for_a_client_that_never_comes_back_goes_to_the_group_once_its_slot_is_freed(daemon_factory):
    daemon = daemon_factory(extra=["--resume-grace-s", "1"]).start()
    worker = _holding(daemon)
    try:
        daemon.kill()
        worker.kill()  # dies while the daemon is down: its slot waits, then is freed
        got, waited = _restart_and_collect(daemon)
        assert sorted(e.key for e in got) == sorted(f"k{i}" for i in range(N)), "each once, to the other member"
        assert waited >= 0.9, "sent to the group before the slot was freed"
        assert "expirations it was sent before the restart go to group" in daemon.log()
    finally:
        worker.kill()


def test_what_a_dead_client_had_in_flight_is_not_held_for_it_by_a_restarted_daemon(daemon_factory):
    """The worker dies while the daemon runs: what it was sent goes back to its group's
    queue. With no other member to take it, the daemon is then SIGKILLed: the restarted
    one must queue those records for the group (their recipient was cleared when they
    were queued again), not hold them for the dead client's slot for ``--resume-grace-s``."""
    daemon = daemon_factory(extra=["--resume-grace-s", "60"]).start()
    worker = _holding(daemon)
    try:
        worker.kill()
        wait_until(lambda: "left:" in daemon.log(), 10, "the daemon saw the worker go")
        daemon.kill()
        daemon.start()
        with wheeld.connect(daemon.socket_path, group="g") as other:
            got = collect(other, N, 10)
            got += other.poll(0.3)
        assert sorted(e.key for e in got) == sorted(f"k{i}" for i in range(N)), (
            f"{len(got)} of {N} within 10 s: held for a client that had gone?")
        assert "expirations it was sent before the restart go to group" not in daemon.log()
    finally:
        worker.kill()


def test_a_client_that_died_while_the_daemon_was_down_is_not_waited_for(daemon_factory):
    """Its slot is found in the client table, waiting for its ring; its process is gone
    (``kill(pid, 0)``: ESRCH), so the slot is freed at the next collection instead of
    after ``--resume-grace-s``, and what was sent to it goes to the group."""
    daemon = daemon_factory(extra=["--resume-grace-s", "60"]).start()
    worker = _holding(daemon)
    try:
        daemon.kill()
        worker.kill()
        got, waited = _restart_and_collect(daemon)
        assert sorted(e.key for e in got) == sorted(f"k{i}" for i in range(N)), f"{len(got)} of {N} within 20 s"
        assert waited < 20
        assert "its process (pid" in daemon.log()
    finally:
        worker.kill()
