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
import time
import zlib

import pytest
from daemon_harness import wait_until

import wheeld
from hostile_harness import Honest, Raw, counters, cpu_s, fd_targets, rss_kb
from wheeld.protocol import commands as C
from wheeld.protocol import framing
from wheeld.protocol import messages as M
from wheeld.protocol import ring_layout as RL
from wheeld.protocol import status_layout as SL
from wheeld.protocol.keys import encode_key
from wheeld.shm import check as CK
from wheeld.shm import reader as R
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
    report = CK.check(d.name)
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
    wait_until(lambda: counters(d.name)["clients_dropped_total"] == 1, 5, what="the drop counted")
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
    try:
        big.send(framing.HEADER.pack(framing.MAX_FRAME) + bytes(60_000))  # announces 16 MiB
    except OSError:
        pass  # refused before all of it was sent
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
            try:
                raw.send(M.encode_client_frame(M.Hello(M.PROTOCOL_VERSION, f"fd{i % 8}", os.getpid(), "hostile")))
            except OSError:
                pass  # closed at once: beyond the handshake limit
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


# ---------------------------------------------------------------------------- one group fills the arena

QUOTA = 1000


def group_live(name: str, group: str) -> int:
    """Scheduled + fired records of ``group`` in the arena (``wheelctl groups``)."""
    with R.ArenaReader(name) as reader:
        pending, fired = reader.group_counts()
        gid = reader.group_id(group)
        return int(pending[gid] + fired[gid])


def test_a_group_at_its_quota_is_refused_and_other_groups_keep_adding(hostile):
    d, honest = hostile(capacity=5000, extra=["--group-quota", str(QUOTA)])
    with wheeld.connect(d.socket_path, group="hog") as hog:
        refused_by_add = 0
        for i in range(2 * QUOTA):
            try:
                hog.add(f"hog{i}", 600_000)
            except wheeld.QuotaExceeded:
                refused_by_add += 1
        refused_by_flush = False
        try:
            hog.flush()
        except wheeld.QuotaExceeded:
            refused_by_flush = True  # adds pushed before the daemon said so
        assert refused_by_add or refused_by_flush
        assert group_live(d.name, "hog") == QUOTA
        # once the daemon has said so, add refuses at once (nothing reaches the ring)
        wait_until(lambda: hog._segment.group_full, 5, what="the group_full word")
        tail = hog._segment._tail
        with pytest.raises(wheeld.QuotaExceeded):
            hog.add("one-more", 600_000)
        assert hog._segment._tail == tail
        # a hostile hog ignores that word and writes ADDs into its ring: the daemon refuses them
        for i in range(500):
            kb, meta = encode_key(f"raw{i}")
            assert hog._segment.try_push(C.ADD, kb, meta, _now_ms() + 600_000, i + 1)
        with pytest.raises(wheeld.QuotaExceeded, match="500 add"):
            hog.flush()
        assert group_live(d.name, "hog") == QUOTA
        # other groups are untouched: one fills its own quota without a refusal
        with wheeld.connect(d.socket_path, group="neighbour") as neighbour:
            for i in range(QUOTA):
                neighbour.add(i, 600_000)
            neighbour.flush()
        assert group_live(d.name, "neighbour") == QUOTA
        honest.wait_served(50)
        # the hog cancels some: it may add again
        for i in range(100):
            hog.cancel(f"hog{i}")
        hog.flush()
        wait_until(lambda: not hog._segment.group_full, 5, what="the group_full word cleared")
        hog.add("again", 600_000)
        hog.flush()
    unharmed(d, honest)


# ---------------------------------------------------------------------------- a member that never acknowledges


def test_expirations_a_member_never_acknowledges_go_to_another_member(hostile):
    d, honest = hostile(extra=["--ack-timeout-s", "1"])
    silent = wheeld.connect(d.socket_path, group="work")  # never polls: never acknowledges
    try:
        with wheeld.connect(d.socket_path, group="work") as worker:
            for i in range(200):  # 200 deadlines: batches go round robin, the silent member gets some
                worker.add(i, 20 + 10 * i)
            worker.flush()
            got = collect(worker, 200, timeout_s=60)
            assert sorted(e.key for e in got) == list(range(200))
            assert all(e.fired_ms >= e.deadline_ms for e in got)
        wait_until(lambda: counters(d.name)["ack_timeouts_total"] >= 1, 5, what="ack_timeouts_total counted")
        assert counters(d.name)["redelivered_total"] >= 1
        wait_until(lambda: "unacknowledged for over" in d.log(), 5, what="the ack timeout logged")
        assert not peer_closed(silent._sock)  # slow, not hostile: it keeps its session
    finally:
        silent.close()
    unharmed(d, honest)


SILENT_MEMBERS = 16
SILENT_BACKLOG = 20_000  # fired timers waiting for each silent member's group
#: how much the daemon may grow while SILENT_MEMBERS sessions do not read what it sends.
#: What it holds then: the arena pages of the 320,000 timers it touches (64 bytes a
#: record, ~20 MB), their delivery queue entries, and each session's
#: unread frames until the session is closed. Sampled on an idle 2-core host the peak
#: growth was 74-77 MB (on a loaded one the samples miss it: 52-65 MB); sessions that
#: were never closed would add up to their 8 MiB high-water mark each, 128 MB more.
SILENT_RSS_BOUND_KB = 96 * 1024


def test_members_that_never_read_their_socket_are_closed_and_cost_little_memory(hostile):
    """Each expiration a member leaves unacknowledged is sent again every ack timeout;
    to a member that does not read its socket, that piles up in the daemon (up to the
    8 MiB high-water mark per session). A session that has not taken a byte for
    ``--ack-timeout-s`` is closed instead: what it held goes back to its group."""
    d, honest = hostile(capacity=400_000, extra=["--ack-timeout-s", "1", *SMALL_RINGS])
    before_kb = rss_kb(d.pid)
    silent = []
    try:
        for g in range(SILENT_MEMBERS):
            member = wheeld.connect(d.socket_path, group=f"deaf{g}")  # never reads its socket
            silent.append(member)
            for i in range(SILENT_BACKLOG):
                member.add(i, 1000)  # due after its flush was answered, however loaded the machine
            member.flush()
        samples = [rss_kb(d.pid)]

        def closed() -> bool:  # seen from the daemon: reading a silent socket here would drain it
            samples.append(rss_kb(d.pid))
            return counters(d.name)["clients_connected"] == 1  # the honest client alone

        wait_until(closed, 30, what="the members that do not read closed")
        peak_kb = max(samples)
        wait_until(lambda: "has not read its socket" in d.log(), 5, what="the reason logged")
        honest.wait_served(50)
    finally:
        for member in silent:
            abandon(member)
    assert peak_kb - before_kb < SILENT_RSS_BOUND_KB, (before_kb, peak_kb)
    # what they held went back to their groups: a member that reads gets all of it
    with wheeld.connect(d.socket_path, group="deaf0") as reader:
        got = {e.key for e in collect(reader, SILENT_BACKLOG, timeout_s=30)}
    assert got == set(range(SILENT_BACKLOG))
    unharmed(d, honest)


def test_a_flush_applied_while_its_session_was_closed_is_answered_when_it_comes_back(hostile):
    """The daemon closes a session (here: a frame left incomplete) but goes on draining its
    ring; a FLUSH applied then is answered on the session the client opens next."""
    d, honest = hostile(extra=["--frame-timeout-s", "0.5", *SMALL_RINGS])
    with wheeld.connect(d.socket_path, group="cut") as client:
        client.add("before", 60_000)
        client.flush()
        client._sock.send(b"\x10\x00")  # half a frame header: closed after the frame timeout
        wait_until(lambda: "stayed incomplete" in d.log(), 10, what="the session closed")
        seq = client._push_flush()  # the doorbell finds no session; the ring is drained anyway
        seg = client._segment
        wait_until(lambda: seg._words[RL.HEAD_WORD] == seg._tail, 5, what="the FLUSH applied")
        end = time.monotonic() + 10
        while client._applied != seq and time.monotonic() < end:
            client._read(0.05, end)  # sees the end of the session, reconnects, hands the ring back
        assert client._applied == seq, "the FLUSH applied while the client was away was never answered"
        wait_until(lambda: "handed back" in d.log(), 5, what="the ring handed back")
        assert client.cancel("before")
        client.flush()
    unharmed(d, honest)


# ---------------------------------------------------------------------------- garbage on the socket


def _identity(fd: int) -> str:
    """What a descriptor points to, as /proc/PID/fd shows it in any process that holds it."""
    return os.readlink(f"/proc/self/fd/{fd}")


def _memfd(name: str, size: int, seals: int = 0, header_from: bytes = b"") -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if header_from:
        os.pwrite(fd, header_from, 0)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def test_garbage_bytes_frames_and_descriptors_on_the_socket(hostile, tmp_path):
    d, honest = hostile(extra=SMALL_RINGS)
    baseline = len(fd_targets(d.pid))
    rng = random.Random(7)
    # random bytes before and after a Hello; frames that decode to nothing a client may send
    for i in range(40):
        raw = Raw(d.socket_path)
        try:
            if i % 2:
                welcome, fds = raw.hello(f"junk{i % 3}")
                assert isinstance(welcome, M.Welcome)
                for fd in fds:
                    os.close(fd)
            junk = [bytes(rng.randrange(256) for _ in range(rng.randint(1, 300))),
                    framing.encode_frame(bytes(rng.randrange(256) for _ in range(rng.randint(0, 200)))),
                    M.encode_daemon_frame(M.Applied(5)),  # the other direction's message
                    M.encode_client_frame(M.Hello(M.PROTOCOL_VERSION, "again", 1, "x"))][i % 4]
            try:
                raw.send(junk)
            except OSError:
                pass
            if i % 4 != 3 or i % 2:  # a second Hello is an error only after the first
                assert raw.closed_by_peer(5)
        finally:
            raw.close()

    # a Hello carrying descriptors that are not a ring this daemon may adopt
    ring_bytes = RL.segment_size(1024, 1024)
    model = ClientSegment.create("model", 1024, 1024)
    header = bytes(model._mm[: RL.HEADER_SIZE])
    model.close()
    path = tmp_path / "attack-regular-file"
    path.write_bytes(header + bytes(ring_bytes - len(header)))
    read_end, write_end = os.pipe()
    sock_a, sock_b = socket.socketpair()
    sealed = _memfd("attack-sealed", ring_bytes, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW, header)
    cases = {
        "regular file": [os.open(path, os.O_RDWR)],
        "pipe": [read_end, write_end],
        "socket": [sock_a.detach()],
        "directory": [os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)],
        "unsealed memfd": [_memfd("attack-unsealed", ring_bytes, header_from=header)],
        "write-sealed memfd": [_memfd("attack-write-sealed", ring_bytes,
                                      fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE, header)],
        "sealed memfd, read-only descriptor": [os.open(f"/proc/self/fd/{sealed}", os.O_RDONLY)],
        "sealed memfd, wrong size": [_memfd("attack-small", 4096, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW, header)],
        "sealed memfd, not a ring": [_memfd("attack-zeros", ring_bytes, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)],
        "50 descriptors": [_memfd(f"attack-many-{i}", 4096) for i in range(25)] + [read_end] * 25,
    }
    held = []
    try:
        for case, fds in cases.items():
            raw = Raw(d.socket_path)
            held.append(raw)
            welcome, got = raw.hello("fds", fds)
            assert isinstance(welcome, M.Welcome) and not welcome.resumed, case
            assert _identity(got[0]) not in {_identity(fd) for fd in fds}, case
            for fd in got:
                os.close(fd)
            targets = set(fd_targets(d.pid))
            kept = {_identity(fd) for fd in fds} & targets
            assert not kept, f"{case}: the daemon kept {kept}"
        # the control: a sealed memfd with a ring's header is what a restarted daemon adopts
        raw = Raw(d.socket_path)
        held.append(raw)
        welcome, got = raw.hello("fds", [sealed])
        assert welcome.resumed and _identity(got[0]) == _identity(sealed)
        for fd in got:
            os.close(fd)
        # ... but not as another client's ring: naming the honest client's ring without its token
        label = next(line.split("ring ")[1].rstrip(")") for line in d.log().splitlines()
                     if "joined group 'honest'" in line)
        raw = Raw(d.socket_path)
        held.append(raw)
        other = _memfd("attack-hijack", ring_bytes, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW, header)
        welcome, got = raw.hello("honest", [other], resume_segment=label, resume_token=12345)
        assert isinstance(welcome, M.Welcome) and not welcome.resumed and welcome.segment_name != label
        for fd in got + [other]:
            os.close(fd)
        honest.wait_served(50)
    finally:
        for raw in held:
            raw.close()
        for fds in cases.values():
            for fd in set(fds):
                try:
                    os.close(fd)
                except OSError:
                    pass
        os.close(sealed)
        sock_b.close()
    # every session is gone and its ring released: the daemon holds what it held before
    wait_until(lambda: len(fd_targets(d.pid)) == baseline, 15, what=f"the daemon back to {baseline} descriptors")
    unharmed(d, honest)


# ---------------------------------------------------------------------------- garbage in a ring


def _with_field(record: bytes, offset: int, value: bytes) -> bytes:
    """``record`` with bytes at ``offset`` replaced and the check word made right again."""
    raw = bytearray(record)
    raw[offset : offset + len(value)] = value
    check = zlib.crc32(bytes(raw[: C.CHECKED_HEAD_SIZE]) + bytes(raw[C.KEY_OFFSET :]))
    raw[C.CHECK_OFFSET : C.CHECK_OFFSET + 4] = check.to_bytes(4, "little")
    return bytes(raw)


def _garbage_records(touch_capacity: int) -> dict[str, bytes]:
    kb, meta = encode_key("x")
    add = C.encode_add(kb, meta, _now_ms() + 1000, 1)
    bad_crc = bytearray(add)
    bad_crc[C.CHECK_OFFSET] ^= 1
    return {
        "bad check word": bytes(bad_crc),
        "random bytes": random.Random(1).randbytes(64),
        "op 9": C.encode_command(9, kb, meta, 0, 1),
        "op 0": C.encode_command(0),
        "reserved bytes set": _with_field(add, C.RESERVED_OFFSET, b"\x01\x00"),
        "pad bytes set": _with_field(add, C.PAD_OFFSET, b"\x01\x00\x00\x00"),
        "touch index beyond the table": C.encode_add_idle(kb, meta, _now_ms() + 1000, 100, touch_capacity, 1),
        "negative idle_ms": C.encode_add_idle(kb, meta, _now_ms() + 1000, -5, 0, 1),
        "negative ack slot": C.encode_ack(-1, 0),
        "key longer than 32 bytes": _with_field(add, C.KEY_META_OFFSET, bytes([(1 << 6) | 40])),
        "str key not UTF-8": C.encode_command(C.ADD, b"\xff", (1 << 6) | 1, _now_ms() + 1000, 1),
        "bytes after the key": _with_field(add, C.KEY_OFFSET + 5, b"\x07"),
        "deadline on a cancel": _with_field(C.encode_cancel(kb, meta, 1), C.DEADLINE_OFFSET, (5).to_bytes(8, "little")),
    }


def test_garbage_ring_records_disconnect_only_their_client(hostile):
    d, honest = hostile(extra=SMALL_RINGS)
    garbage = _garbage_records(1024)
    for n, (kind, record) in enumerate(garbage.items(), 1):
        attacker = wheeld.connect(d.socket_path, group="garbage")
        attacker.add(f"kept-{n}", 600_000)  # its group's timers stay
        attacker.flush()
        assert attacker._segment.try_push_record(record)
        attacker._ring_doorbell()
        wait_until(lambda: peer_closed(attacker._sock), 10,  # noqa: B023 - called here
                   what=f"{kind}: the attacker disconnected")
        abandon(attacker)
        wait_until(lambda: counters(d.name)["clients_dropped_total"] == n, 5,  # noqa: B023 - called here
                   what=f"{kind}: the drop counted")
    poisoned = [line for line in d.log().splitlines()
                if "invalid command record" in line and "disconnecting it" in line]
    assert len(poisoned) == len(garbage), poisoned
    assert group_live(d.name, "garbage") == len(garbage)
    honest.wait_served(50)
    unharmed(d, honest)


def test_well_formed_records_with_values_the_daemon_must_not_trust(hostile):
    """Records that pass every check of the format but name impossible deadlines or
    records that are not the client's: refused or ignored, the client stays."""
    d, honest = hostile(extra=SMALL_RINGS)
    with wheeld.connect(d.socket_path, group="liar") as liar:
        seg = liar._segment
        for deadline in (2**62, -(2**62), 2**63 - 1, -(2**63)):
            kb, meta = encode_key(f"far{deadline}")
            assert seg.try_push_record(C.encode_add(kb, meta, deadline, 1))
        with pytest.raises(wheeld.InvalidRequest, match="4 command"):
            liar.flush()
        # acknowledge another group's fired records, waiting in its queue for a member: the
        # exact (slot, generation) of each (as if guessed right), stamped and unstamped
        with wheeld.connect(d.socket_path, group="victim") as victim:
            for i in range(300):
                victim.add(i, 10)
            victim.flush()
        with R.ArenaReader(d.name) as reader:
            gid = reader.group_id("victim")
            wait_until(lambda: reader.group_counts()[1][gid] == 300, 10, what="the victim's timers fired")
            slots, _states, groups = reader._live()
            slots = slots[groups == gid]
            generations = reader.records["gen"][slots].tolist()
        for stamp in (0, liar._welcome.arena_epoch):
            for slot, generation in zip(slots.tolist(), generations):
                while not seg.try_push(C.ACK, b"", 0, 0, stamp, slot, generation):
                    liar._ring_doorbell()
        liar.flush()
        with wheeld.connect(d.socket_path, group="victim") as victim:
            assert sorted(e.key for e in collect(victim, 300)) == list(range(300))
        for slot in (2**31 - 1, 10**9):
            assert seg.try_push(C.ACK, b"", 0, 0, 0, slot, 0)
        liar.flush()
        assert not peer_closed(liar._sock)
        liar.add("liar-still-served", 10)
        assert [e.key for e in collect(liar, 1)] == ["liar-still-served"]
    assert counters(d.name)["clients_dropped_total"] == 0
    unharmed(d, honest)


# ---------------------------------------------------------------------------- a client killed mid-write

DYING = """
import sys, wheeld
w = wheeld.connect(sys.argv[1], group="dying")
log = open(sys.argv[2], "w", buffering=1)
print("ready", flush=True)
i = 0
while True:
    w.add(f"{sys.argv[3]}-{i}", 1 + i % 500)
    log.write(f"{sys.argv[3]}-{i}\\n")  # after add returned: the record is published
    i += 1
"""


def test_clients_killed_while_pushing_affect_nobody(hostile, tmp_path):
    d, honest = hostile(extra=SMALL_RINGS)
    logged: set[str] = set()
    for n in range(8):
        log_path = tmp_path / f"dying-{n}.log"
        before = counters(d.name)["commands_total"]
        child = subprocess.Popen([sys.executable, "-c", DYING, d.socket_path, str(log_path), f"d{n}"],
                                 stdout=subprocess.PIPE)
        try:
            assert child.stdout.readline() == b"ready\n"
            wait_until(lambda: counters(d.name)["commands_total"] >= before + 2000 + n * 500, 20,  # noqa: B023
                       what="the child pushing")
        finally:
            os.kill(child.pid, signal.SIGKILL)
            child.wait(10)
        logged.update(log_path.read_text().split())
    honest.wait_served(50)
    # every add a dead client had published is applied and delivered to the group's next member
    with wheeld.connect(d.socket_path, group="dying") as heir:
        got = set()
        end = time.monotonic() + 30
        while not logged <= got and time.monotonic() < end:
            got.update(e.key for e in heir.poll(0.2))
    assert logged <= got, f"{len(logged - got)} published adds of killed clients were lost"
    assert counters(d.name)["clients_dropped_total"] == 0  # nobody read a torn record
    unharmed(d, honest)
