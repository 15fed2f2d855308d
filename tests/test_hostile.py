"""Hostile clients against a real daemon, with an honest client served throughout.

Every test starts its own ``wheeld`` (with the options the attack needs) and an
honest client in its own process (``honest_worker.py``) that keeps adding timers
with random delays and receiving them. The attack runs; the test checks what the
daemon did about it; then the honest client stops adding and the test asserts
that every honest timer was delivered exactly once and never early (measured
from ``time.monotonic_ns()`` read before the ``add`` call), that the daemon is
the same process it was (``daemon_pid`` in the arena, no restart), and that
``wheelctl check`` finds the arena sound.

Attacks covered elsewhere, not repeated here:

* an arena truncated while the daemon is down (set aside, rebuilt from the
  journal): ``test_instance.py::test_a_truncated_arena_is_set_aside_and_rebuilt_from_the_journal``;
* a second ``wheeld`` of the same name: ``test_instance.py::test_a_second_daemon_of_the_same_name_changes_nothing``;
* a lone-surrogate key (InvalidKey), a delay of exactly the maximum (accepted),
  ArenaFull from ``add`` before any flush: ``test_client_misuse.py``;
* random records in a ring, random bytes and a wrong protocol version on the
  socket: ``test_e2e.py`` (extended here with descriptors and the daemon's fd count);
* many random inputs against one daemon: ``test_fuzz_daemon.py``.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import random
import resource
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

import wheeld
from hostile_harness import Honest, Raw, counters, cpu_s, fd_targets, rss_kb, wait_until
from wheeld.daemon import stats as S
from wheeld.protocol import commands as C
from wheeld.protocol import framing
from wheeld.protocol import messages as M
from wheeld.protocol import ring_layout as RL
from wheeld.protocol import status_layout as SL
from wheeld.protocol.keys import encode_key
from wheeld.shm.ring import ClientSegment

SMALL_RINGS = ["--ring-capacity", "1024", "--touch-capacity", "1024"]


@pytest.fixture
def hostile(tmp_path, daemon_factory):
    """start(extra=..., capacity=...) -> (daemon, honest client); both killed after the test."""
    honest_clients: list[Honest] = []

    def start(extra=(), capacity: int = 200_000, **honest_options):
        d = daemon_factory(capacity=capacity, extra=list(extra)).start()
        honest = Honest(tmp_path, d.socket_path, **honest_options)
        honest_clients.append(honest)
        return d, honest

    try:
        yield start
    finally:
        for honest in honest_clients:
            honest.kill()


def unharmed(d, honest: Honest) -> dict:
    """The end of every attack: the honest client's verdict, the same daemon, a sound arena."""
    result = honest.finish()
    assert d.proc.poll() is None, f"the daemon exited:\n{d.log()[-3000:]}"
    published = counters(d.name)
    assert published["daemon_pid"] == d.pid and published["daemon_restarts_total"] == 0
    report = S.check(d.name)
    assert report.ok, report.problems
    assert "Traceback" not in d.log(), d.log()[-5000:]  # nothing escaped a handler
    return result


def peer_closed(sock: socket.socket) -> bool:
    """Has the daemon closed this client's connection? (reads and drops what is queued)"""
    while select.select([sock], [], [], 0)[0]:
        try:
            if not sock.recv(65536):
                return True
        except BlockingIOError:
            return False
        except OSError:
            return True
    return False


def abandon(client) -> None:
    """Drop a client the daemon disconnected without letting the library reconnect it."""
    client._closed = True
    if client._sock is not None:
        client._sock.close()
        client._sock = None
    client._release_local()


def collect(client, want: int, timeout_s: float = 20.0) -> list:
    got = []
    end = time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < end:
        got.extend(client.poll(0.1))
    return got


# ---------------------------------------------------------------------------- the touch table


def _now_ms() -> int:
    return time.monotonic_ns() // 1_000_000


TOUCH_VALUES = {  # (last_touch_ms, idle_ms) the attacker stores for its idle timer
    "overflow": (lambda now: 2**62 + 5, 2**62),
    "negative-touch": (lambda now: -5, 100),
    "touch-from-the-future": (lambda now: now + 10_000_000, 100),
    "negative-idle": (lambda now: now, -1),
    "idle-beyond-32-bits": (lambda now: now, 1 << 40),
}


@pytest.mark.parametrize("values", sorted(TOUCH_VALUES))
def test_impossible_touch_table_values_poison_only_their_client(hostile, values):
    d, honest = hostile()
    attacker = wheeld.connect(d.socket_path, group="attacker")
    deadline = attacker.add_idle("victim", 300)
    attacker.flush()
    seg = attacker._segment
    index = attacker._touch_by_key["victim"]
    touch, idle = TOUCH_VALUES[values]
    seg._last_touch[index] = touch(_now_ms())
    seg._idle[index] = idle
    # read when the idle timer comes due: the client is disconnected with the reason
    wait_until(lambda: peer_closed(attacker._sock), 10, what="the attacker disconnected")
    abandon(attacker)
    wait_until(lambda: "touch table: touch index" in d.log(), 5, what="the reason logged")
    assert counters(d.name)["clients_dropped_total"] == 1
    honest.wait_served(50)
    # the idle timer fires as a plain timer, for the next member of its group
    with wheeld.connect(d.socket_path, group="attacker") as member:
        (fired,) = collect(member, 1)
        assert fired.key == "victim" and fired.fired_ms >= fired.deadline_ms == deadline
    unharmed(d, honest)


# ---------------------------------------------------------------------------- resizing shared memory


def test_a_client_cannot_resize_its_ring_or_write_the_status_page(hostile):
    d, honest = hostile()
    with wheeld.connect(d.socket_path, group="resizer") as attacker:
        seg = attacker._segment
        size = os.fstat(seg.fd).st_size
        for new_size in (0, size // 2, size * 2):
            with pytest.raises(PermissionError):  # EPERM: F_SEAL_SHRINK / F_SEAL_GROW
                os.ftruncate(seg.fd, new_size)
        with pytest.raises(PermissionError):  # F_SEAL_SEAL: no seal can be added (or removed)
            fcntl.fcntl(seg.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
        assert os.fstat(seg.fd).st_size == size
        attacker.add("still-mine", 10)
        assert [e.key for e in collect(attacker, 1)] == ["still-mine"]

    raw = Raw(d.socket_path)
    try:
        welcome, fds = raw.hello("resizer")
        assert isinstance(welcome, M.Welcome) and welcome.status_page and len(fds) == 2
        ring_fd, status_fd = fds
        with pytest.raises(OSError):
            os.ftruncate(status_fd, 0)
        with pytest.raises(PermissionError):
            mmap.mmap(status_fd, SL.PAGE_BYTES)  # read-only descriptor: no writable mapping
        # The page is a memfd (mode 0777): any client can open it again read-write through
        # /proc. The write seal is what stops it from writing the page every client reads.
        writable = os.open(f"/proc/self/fd/{status_fd}", os.O_RDWR)
        try:
            with pytest.raises(PermissionError):
                mmap.mmap(writable, SL.PAGE_BYTES)
            with pytest.raises(PermissionError):
                os.pwrite(writable, (1 << 40).to_bytes(8, "little"), SL.PENDING_OFFSET)
            with pytest.raises(PermissionError):
                os.ftruncate(writable, 0)
        finally:
            os.close(writable)
        for fd in fds:
            os.close(fd)
    finally:
        raw.close()
    honest.wait_served(20)
    unharmed(d, honest)


# ---------------------------------------------------------------------------- slow and oversized frames

PARTIAL_SESSIONS = 200
#: how much the daemon's RSS may grow while PARTIAL_SESSIONS sessions each hold an
#: incomplete frame (it buffers at most one 4 KiB frame plus one 64 KiB read per session)
PARTIAL_RSS_BOUND_KB = 64 * 1024


def test_partial_and_oversized_frames_after_hello_are_closed_and_cost_little_memory(hostile):
    d, honest = hostile(extra=["--frame-timeout-s", "0.5", *SMALL_RINGS])
    honest.wait_served(20)
    before_kb = rss_kb(d.pid)
    big = Raw(d.socket_path)
    assert isinstance(big.hello("slow")[0], M.Welcome)
    big.send(framing.HEADER.pack(framing.MAX_FRAME) + bytes(60_000))  # announces 16 MiB
    assert big.closed_by_peer(5), "a 16 MiB frame announced after Hello was not refused at once"
    big.close()
    wait_until(lambda: "peer announced a 16777216-byte frame" in d.log(), 5, what="the reason logged")
    slow = []
    try:
        for i in range(PARTIAL_SESSIONS):
            raw = Raw(d.socket_path)
            slow.append(raw)
            welcome, fds = raw.hello(f"slow{i % 4}")
            for fd in fds:
                os.close(fd)
            assert isinstance(welcome, M.Welcome)
        started = time.monotonic()
        for raw in slow:  # a Doorbell-sized frame announced as 4000 bytes, 3000 of them sent
            raw.send(framing.HEADER.pack(4000) + bytes(3000))
        peak_kb = rss_kb(d.pid)
        honest.wait_served(20)
        for raw in slow:
            assert raw.closed_by_peer(10), "a session holding a partial frame was never closed"
        closed_after = time.monotonic() - started
        assert closed_after >= 0.5  # not before the frame timeout
        wait_until(lambda: "stayed incomplete" in d.log(), 5, what="the reason logged")
        peak_kb = max(peak_kb, rss_kb(d.pid))
    finally:
        for raw in slow:
            raw.close()
    assert peak_kb - before_kb < PARTIAL_RSS_BOUND_KB, (before_kb, peak_kb)
    # the sessions' rings are released within a collection period: memory falls back or stays flat
    wait_until(lambda: counters(d.name)["clients_connected"] == 1, 10, what="the slow sessions gone")
    assert rss_kb(d.pid) <= peak_kb + 4096
    unharmed(d, honest)


def test_connections_that_never_say_hello_are_bounded_per_uid(hostile):
    d, honest = hostile(extra=SMALL_RINGS)
    flood = []
    try:
        for _ in range(200):
            raw = Raw(d.socket_path)
            flood.append(raw)
            try:
                raw.send(b"\x10\x00")  # half a frame header, and nothing more
            except OSError:
                pass  # already closed: beyond the limit
        refused = wait_until(lambda: counters(d.name)["clients_refused_total"] >= 200 - 32, 10,
                             what="connections beyond the handshake limit closed")
        assert refused
        held = sum(not raw.closed_by_peer(0.01) for raw in flood)
        assert held <= 32, held  # max_handshakes_per_uid
        honest.wait_served(20)
    finally:
        for raw in flood:
            raw.close()
    assert "connections without a Hello" in d.log()
    unharmed(d, honest)


# ---------------------------------------------------------------------------- out of descriptors

FD_LIMIT = 128


def _answered(raw: Raw):
    """The daemon's first answer on a raw session (descriptors closed), or None if none is queued."""
    if not select.select([raw.sock], [], [], 0)[0]:
        return None
    try:
        message, fds = raw.reply()
    except ConnectionResetError:
        return "closed"  # closed unread (beyond the handshake limit)
    for fd in fds:
        os.close(fd)
    return "closed" if message is None else message


def test_out_of_descriptors_the_daemon_pauses_accept_without_spinning(hostile):
    d, honest = hostile(extra=SMALL_RINGS)
    resource.prlimit(d.pid, resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))
    attackers = []
    try:
        for i in range(FD_LIMIT + 40):  # each session costs the daemon a socket and a ring
            raw = Raw(d.socket_path, timeout_s=5)
            attackers.append(raw)
            raw.send(M.encode_client_frame(M.Hello(M.PROTOCOL_VERSION, f"fd{i % 8}", os.getpid(), "hostile")))
        wait_until(lambda: "accept paused" in d.log(), 20, what="accept paused")
        paused_at = time.monotonic()
        cpu_before = cpu_s(d.pid)
        honest.wait_served(20)  # its session was open before: it is served all along
        wait_until(lambda: time.monotonic() - paused_at >= 2.0, 5, what="2 s")
        cpu_used = cpu_s(d.pid) - cpu_before
        held_s = time.monotonic() - paused_at
        assert cpu_used < 0.5 * held_s, f"the daemon used {cpu_used:.2f} s of CPU in {held_s:.2f} s while paused"
        pauses = d.log().count("accept paused")
        assert pauses <= held_s + 2, f"{pauses} 'accept paused' lines in {held_s:.1f} s"
        assert counters(d.name)["accept_pauses_total"] >= 1
        answers = [_answered(raw) for raw in attackers]
        welcomed = [raw for raw, answer in zip(attackers, answers) if isinstance(answer, M.Welcome)]
        waiting = [raw for raw, answer in zip(attackers, answers) if answer is None]
        assert welcomed and waiting
        assert all(a == "closed" or type(a) in (M.Welcome, M.Refused) for a in answers if a is not None), answers
        # One session ends: its socket is free at once (its ring only at the next collection),
        # so the next connection is accepted but no ring can be made for it: refused, BUSY.
        welcomed[0].close()
        attackers.remove(welcomed[0])

        def refused():
            for raw in waiting:
                answer = _answered(raw)
                if answer is not None:
                    return answer

        answer = wait_until(refused, 3, what="an answer to a Hello the daemon has no descriptor for")
        assert isinstance(answer, M.Refused) and answer.code == M.Refused.BUSY, answer
    finally:
        for raw in attackers:
            raw.close()
    # once the connections close (and their rings are released), a new client connects and is served
    wait_until(lambda: counters(d.name)["clients_connected"] == 1, 20, what="the attacking sessions gone")
    wait_until(lambda: len(fd_targets(d.pid)) < FD_LIMIT // 2, 20, what="the rings of the attackers released")
    with wheeld.connect(d.socket_path, group="late", connect_timeout_s=20) as late:
        late.add("late", 10)
        assert [e.key for e in collect(late, 1)] == ["late"]
    unharmed(d, honest)
