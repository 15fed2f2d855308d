"""An acknowledgement leaves the client library only for an expiration the application was handed.

Expirations the library has read off its socket but the application has not
polled yet are the library's to keep: when the daemon sends one of them again (a
daemon restart, a reboot recovered from the journal, an ack timeout), the copy is
neither handed twice nor acknowledged. Were it acknowledged, a worker that dies
before it polls would take the timer with it: the daemon frees what was
acknowledged, and no other member of the group ever receives it. After a reboot
the copy's handle (new arena, new epoch) is the one acknowledged once the
application is handed the expiration: an acknowledgement stamped with the old
epoch is ignored.

The daemon tests run a worker process that never polls (tests/buffering_worker.py),
SIGKILL it, and count what another member of its group receives.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from daemon_harness import unlink_segments, wait_until

import wheeld
from wheeld.core import ClientCore, decode_daemon_body
from wheeld.protocol import messages as M

WORKER = os.path.join(os.path.dirname(__file__), "buffering_worker.py")
N = 50

pytestmark = pytest.mark.timeout(180)


# ---------------------------------------------------------------------------- the library alone


def _core(epoch: int) -> ClientCore:
    core = ClientCore("/nonexistent", "g", 1.0, 1.0, "")
    core._welcome = M.Welcome(M.PROTOCOL_VERSION, 1, "seg", 1024, 0, "", 1, 1 << 40, 1, epoch)
    return core


def _deliver(core: ClientCore, armings, slot_base: int) -> None:
    """One Expirations frame: arming (key, tag) i in record slot_base + i, generation 1."""
    items = [M.Expiry.for_key(key, 10, 12, tag, slot_base + i, 1) for i, (key, tag) in enumerate(armings)]
    core._on_message(decode_daemon_body(M.encode_daemon_message(M.Expirations(items))))


def _acks(core: ClientCore) -> list:
    return list(core._to_ack) + list(core._acks_pending)


def test_a_copy_of_a_buffered_expiration_is_not_acknowledged_and_renews_its_handle():
    other = 5 << 21  # armings of another member of the group (tags of client slot 5)
    armings = [(f"k{i}", other | i) for i in range(20)]
    core = _core(epoch=77)
    _deliver(core, armings, 100)
    _deliver(core, armings, 100)  # a daemon restart: the same records sent again
    assert _acks(core) == [], "nothing was handed: nothing may be acknowledged"
    core._welcome = M.Welcome(M.PROTOCOL_VERSION, 1, "seg", 1024, 0, "", 1, 1 << 40, 1, 78)
    _deliver(core, armings, 300)  # a reboot: the journal's armings in new records of a new arena
    assert _acks(core) == []
    handed = [core._take_one().key, core._take_one().key]  # the asyncio iterator hands one at a time
    assert core._to_ack == [(300, 1, 78), (301, 1, 78)], "acknowledged under the copy's handle"
    _deliver(core, armings[:4], 500)  # two handed, two still buffered (new records of this arena)
    assert core._acks_pending[:2] == [(500, 1, 78), (501, 1, 78)], "copies of what was handed: acknowledged"
    assert core._acks_pending[2:] == [(302, 1, 78), (303, 1, 78)], "the records they replace: released"
    handed += [e.key for e in core._take_ready()]
    assert handed == [key for key, _tag in armings], "each handed once, in order"
    assert core._to_ack[2:] == [(502, 1, 78), (503, 1, 78)] + [(300 + i, 1, 78) for i in range(4, 20)]
    core._to_ack.clear()
    core._acks_pending.clear()
    _deliver(core, armings, 700)  # once handed, every copy is acknowledged and dropped
    assert core._take_ready() == [] and core._acks_pending == [(700 + i, 1, 78) for i in range(20)]


def test_a_second_record_of_a_buffered_arming_in_the_same_arena_releases_the_first():
    """After a reboot, the ring a client hands back is replayed from its last acknowledged
    flush: a re-arm the journal already held is applied again after the journal's arming
    fired, so one arming goes out in two records of the same arena. The first record is
    acknowledged at once (were the client to die, it would go to another member); the
    second, the one the application is handed, when it is handed."""
    other = 5 << 21
    core = _core(epoch=77)
    _deliver(core, [("k", other | 1)], 100)
    _deliver(core, [("k", other | 1)], 200)  # the same arming, another record of this arena
    assert _acks(core) == [(100, 1, 77)], "the first record is released, the arming still held"
    assert [e.key for e in core._take_ready()] == ["k"], "handed once"
    assert core._to_ack == [(200, 1, 77)]


def test_a_copy_of_an_expiration_of_our_own_arming_still_buffered_is_not_acknowledged():
    core = _core(epoch=9)
    core._tag_base = 3 << 21
    core._latest[hash("mine") & 63]["mine"] = (3 << 21) | 7  # our arming of "mine", tag 7
    _deliver(core, [("mine", (3 << 21) | 7)], 40)
    _deliver(core, [("mine", (3 << 21) | 7)], 40)
    assert _acks(core) == []
    assert [e.key for e in core._take_ready()] == ["mine"] and core._to_ack == [(40, 1, 9)]


def test_an_arming_the_application_replaced_is_dropped_even_after_the_replacement_was_received():
    """The key was re-armed after its first arming fired, while that expiration sat with
    another member (which died) or in the daemon: once the re-arm's expiration was
    received, the first one is dropped (and acknowledged) when it comes."""
    core = _core(epoch=9)
    mine = 3 << 21
    core._tag_base = mine
    core._former_slots.add(2)
    latest = core._latest[hash("k") & 63]
    latest["k"] = mine | 20  # the re-arm replaced mine | 10 before its expiration came
    _deliver(core, [("k", mine | 20)], 40)
    assert [e.key for e in core._take_ready()] == ["k"]
    _deliver(core, [("k", mine | 10), ("k", (2 << 21) | 99)], 41)  # the replaced one, and one of a former session
    assert core._take_ready() == [] and core._acks_pending == [(41, 1, 9), (42, 1, 9)]
    latest["k"] = mine | 30
    _deliver(core, [("k", mine | 30)], 50)  # a later arming is handed as always
    assert [e.key for e in core._take_ready()] == ["k"]
    wrapped = mine | ((1 << 21) - 2)  # sequence numbers compare modulo 2**21
    assert core._superseded("k", wrapped, 3) and not core._superseded("k", mine | 31, 3)
    assert not core._superseded("other", mine | 1, 3)


# ---------------------------------------------------------------------------- against a daemon


class Worker:
    """tests/buffering_worker.py: one command a line, one JSON answer a line."""

    def __init__(self, socket_path: str, group: str, aio: bool = False):
        args = {"socket": socket_path, "group": group, "aio": aio}
        self.proc = subprocess.Popen([sys.executable, WORKER, json.dumps(args)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def ask(self, command: str) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the worker died on {command!r} (exit {self.proc.wait()})"
        return json.loads(line)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def collect(client, want: int, timeout_s: float) -> list:
    got = []
    end = time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < end:
        got.extend(client.poll(0.1))
    return got


def _restart(daemon) -> None:
    daemon.kill()
    daemon.start()


def _reboot(daemon) -> None:
    daemon.kill()
    unlink_segments(daemon.name)  # the shared memory is gone; the journal is kept
    daemon.start()


@pytest.mark.parametrize("fault,aio", [("restart", False), ("restart", True), ("reboot", False),
                                       ("ack_timeout", False)])
def test_a_worker_that_dies_without_polling_leaves_its_expirations_to_the_group(daemon_factory, tmp_path, fault, aio):
    """50 expirations wait in the worker's buffer; the daemon sends them again; the
    worker flushes (which pushes every acknowledgement the library queued) and dies
    without polling: another member of the group receives all 50, once each."""
    extra = ["--journal", str(tmp_path / "journal"), "--fsync", "always"]
    if fault == "ack_timeout":
        extra += ["--ack-timeout-s", "1"]
    daemon = daemon_factory(extra=extra).start()
    worker = Worker(daemon.socket_path, "g", aio=aio)
    try:
        worker.ask(f"add {N} 100")
        assert worker.ask(f"buffer {N}")["buffered"] == N
        if fault == "restart":
            _restart(daemon)
        elif fault == "reboot":
            _reboot(daemon)
        # the copies arrive (on the session the worker opens again, or sent again on the
        # same one after the ack timeout); one more flush pushes what the library queued
        state = worker.ask(f"copies {2 * N}")
        assert state["buffered"] == N, "a copy is not handed (nor buffered) twice"
        assert state["acks"] == 0, "nothing was handed, so nothing is acknowledged"
        worker.kill()
        with wheeld.connect(daemon.socket_path, group="g") as other:
            got = collect(other, N, 20)
            got += other.poll(0.3)
        assert sorted(e.key for e in got) == sorted(f"k{i}" for i in range(N))
    finally:
        worker.kill()


def test_after_a_reboot_the_copy_is_acknowledged_once_the_application_is_handed_it(daemon_factory, tmp_path):
    """The buffered expirations carry handles of the arena the reboot erased; the
    worker polls after the copies came: each key once, and the acknowledgements free
    the records of the new arena (an ack with the old epoch would be ignored, and the
    group would get the timers again once the worker is gone)."""
    daemon = daemon_factory(extra=["--journal", str(tmp_path / "journal"), "--fsync", "always"]).start()
    worker = Worker(daemon.socket_path, "g")
    try:
        worker.ask(f"add {N} 100")
        worker.ask(f"buffer {N}")
        _reboot(daemon)
        worker.ask(f"copies {2 * N}")
        assert sorted(worker.ask("poll")["keys"]) == sorted(f"k{i}" for i in range(N))
        assert worker.ask("poll")["keys"] == []  # pushes the acknowledgements of what was handed
        worker.ask("flush")  # ...and they were applied
        wait_until(lambda: daemon.counters()["fired_unacked"] == 0, 10, "the handed expirations acknowledged",
                   detail=lambda: str(daemon.counters()))
        worker.kill()
        with wheeld.connect(daemon.socket_path, group="g") as other:
            assert other.poll(1.0) == [], "acknowledged: not delivered again"
    finally:
        worker.kill()
