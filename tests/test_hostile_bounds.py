"""Bounds on what one client, or one uid, can make the daemon hold, with an honest client served throughout.

* **Answers**: a client that fills its ring with commands the daemon refuses and
  reads its socket only a little now and then must not grow the daemon: answers
  are capped (back pressure on its ring, rejections summarised), and a client is
  judged stuck by the progress it makes, not by whether it read anything at all.
* **Client slots**: clients that leave idle timers behind and go do not hold their
  slots (or their rings and touch tables): the timers become plain timers at the
  deadline their last touch gave them, and one uid holds at most
  ``--clients-per-uid`` slots.
* **Group ids**: one uid owns at most ``--groups-per-uid`` groups.

The uid bounds do not apply to root or to the daemon's own uid, which the test
suite runs as: those attacks run in a child process as another uid
(:func:`run_as`), on a socket every uid may reach (:func:`shared_daemon`).
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import pytest
from daemon_harness import mono_ms, wait_for_clock, wait_until

import wheeld
from hostile_harness import Honest, counters, rss_kb
from test_hostile import abandon, collect, hostile, unharmed  # noqa: F401 - hostile: the fixture
from wheeld.daemon import executor as E
from wheeld.daemon.client_table import ClientSlot
from wheeld.protocol import commands as C
from wheeld.protocol import framing
from wheeld.protocol import messages as M
from wheeld.protocol import ring_layout as RL
from wheeld.protocol.keys import encode_key
from wheeld.shm import reader as R
from wheeld.shm.ring import ClientSegment
from wheeld.shm.wheel import TimerWheel

NOBODY = 65534
OTHER_UID = 65533  # a second uid without a passwd entry: SO_PEERCRED reports it all the same


@pytest.fixture
def shared_daemon(tmp_path, daemon_factory):
    """start(extra=...) -> (daemon, honest client), the daemon's socket reachable by every uid."""
    base = tempfile.mkdtemp(prefix="wheeld-bounds-")
    os.chmod(base, 0o755)
    honest_clients: list[Honest] = []

    def start(extra=(), capacity: int = 200_000):
        d = daemon_factory(capacity=capacity, extra=list(extra))
        d.socket_path = os.path.join(base, f"{d.name}.sock")
        d.start()
        os.chmod(d.socket_path, 0o666)
        honest = Honest(tmp_path, d.socket_path)
        honest_clients.append(honest)
        return d, honest

    try:
        yield start
    finally:
        for honest in honest_clients:
            honest.kill()
        shutil.rmtree(base, ignore_errors=True)


OTHER_UID_WORKER = os.path.join(os.path.dirname(__file__), "churn_worker.py")


def run_as(uid: int, code: str, timeout_s: float = 120.0, **args) -> dict:
    """Run ``code`` as ``uid`` (tests/churn_worker.py) with ``args`` as the dict ``ARGS``
    (``json``, ``os``, ``socket``, ``time`` and ``wheeld`` imported); it prints its result
    as one JSON line last. Returns that result."""
    proc = subprocess.run([sys.executable, OTHER_UID_WORKER, json.dumps(dict(args, uid=uid, code=code))],
                          capture_output=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-3000:]
    return json.loads(proc.stdout.decode().strip().splitlines()[-1])


# ---------------------------------------------------------------------------- answers

FLOOD_S = 8.0
TRICKLE_BYTES = 256 * 1024  # what the flooder reads from its socket...
TRICKLE_EVERY_S = 1.0  # ...this often: enough to have looked alive to a "took a byte lately" rule
#: how much the daemon may grow while one client floods it with refused commands and flushes
FLOOD_RSS_BOUND_KB = 32 * 1024
#: how late (fired_ms - deadline_ms) the daemon may fire an honest timer meanwhile (as the fuzz's bound)
LATE_BOUND_MS = 1000


def _flooder(socket_path: str, stop: threading.Event, stats: dict) -> None:
    """Fill a ring with ADDs whose deadline the daemon refuses and FLUSHes, then re-publish its tail over
    the same records as fast as the daemon drains them, reading a trickle of the answers.
    A session the daemon ends is replaced by a new one."""
    kb, meta = encode_key("far")
    refused = C.encode_add(kb, meta, 2**62, 1)  # well-formed; the wheel refuses the deadline: a Rejected
    flush = C.encode_flush(2)  # answered by an Applied each
    while not stop.is_set():
        client = wheeld.connect(socket_path, group="flood", connect_timeout_s=30)
        stats["sessions"] += 1
        seg = client._segment
        capacity = seg.ring_capacity
        for i in range(capacity):
            assert seg.try_push_record(flush if i % 4 == 3 else refused)
        sock = client._sock
        sock.setblocking(False)
        last_read = time.monotonic()
        try:
            while not stop.is_set():
                head = seg._words[RL.HEAD_WORD]
                if seg._tail < head + capacity:
                    stats["republished"] += head + capacity - seg._tail
                    seg._tail = seg._words[RL.TAIL_WORD] = head + capacity  # publish the tail
                    sock.send(M.encode_client_frame(M.Doorbell(urgent=True)))
                if time.monotonic() - last_read >= TRICKLE_EVERY_S:
                    last_read = time.monotonic()
                    try:
                        data = sock.recv(TRICKLE_BYTES)
                    except BlockingIOError:
                        data = None
                    if data == b"":
                        break  # the daemon ended the session
                    stats["read"] += len(data or b"")
                time.sleep(0.001)
        except OSError:
            pass  # ended by the daemon
        finally:
            abandon(client)


def test_a_client_flooding_answers_and_reading_a_trickle_stays_bounded(hostile):
    d, honest = hostile(extra=["--ack-timeout-s", "3"])
    honest.wait_served(20)
    before_kb = rss_kb(d.pid)
    stop = threading.Event()
    stats = {"sessions": 0, "republished": 0, "read": 0}
    flooder = threading.Thread(target=_flooder, args=(d.socket_path, stop, stats), daemon=True)
    flooder.start()
    samples = []
    try:
        end = time.monotonic() + FLOOD_S
        while time.monotonic() < end:
            samples.append(rss_kb(d.pid))
            assert d.proc.poll() is None, d.log()[-3000:]
            time.sleep(0.1)
        honest.wait_served(20)  # served during the flood
    finally:
        stop.set()
        flooder.join(30)
    peak_kb = max(samples)
    print(f"flood: {stats}, daemon RSS {before_kb // 1024} -> peak {peak_kb // 1024} MiB")
    assert stats["republished"] >= 16384 and stats["read"] > 0  # it flooded (a ring's worth at least), and it read
    assert peak_kb - before_kb < FLOOD_RSS_BOUND_KB, (before_kb, peak_kb, stats)
    assert counters(d.name)["rejected_total"] >= 16384 * 3 // 4
    result = unharmed(d, honest)
    print(f"honest: max {result['max_late_ms']} ms late")
    assert result["max_late_ms"] <= LATE_BOUND_MS, result


BACKLOG = 40_000  # expirations waiting for a member: ~3 MB of frames
BACKLOG_DELAY_MS = 5000  # they fire once their adder has gone (it would take any that fired while it is there)


def test_a_member_reading_a_trickle_of_its_backlog_is_judged_by_its_progress(hostile):
    """A member with megabytes of expirations queued that reads 256 KiB a second takes
    bytes off its socket all the time, but what it was sent is still unread
    ``--ack-timeout-s`` later: it is disconnected, and what it held goes to a member
    that reads."""
    d, honest = hostile(extra=["--ack-timeout-s", "3"])
    with wheeld.connect(d.socket_path, group="backlog") as adder:
        for i in range(BACKLOG):
            adder.add(i, BACKLOG_DELAY_MS)
        adder.flush()
    wait_until(lambda: counters(d.name)["undelivered"] == BACKLOG, 30, what="the backlog fired, waiting for a member")
    slow = wheeld.connect(d.socket_path, group="backlog")
    sock, read = slow._sock, 0
    sock.settimeout(1.0)
    started = time.monotonic()
    closed = False
    try:
        while not closed and time.monotonic() - started < 20:
            time.sleep(1.0)
            try:
                data = sock.recv(TRICKLE_BYTES)
            except TimeoutError:
                continue
            except OSError:
                data = b""
            closed = data == b""
            read += len(data)
    finally:
        abandon(slow)
    assert closed and read > 0, read
    assert time.monotonic() - started >= 3.0  # not before the timeout
    wait_until(lambda: "has not read its socket" in d.log(), 5, what="the reason logged")
    with wheeld.connect(d.socket_path, group="backlog") as reader:
        assert {e.key for e in collect(reader, BACKLOG, timeout_s=60)} == set(range(BACKLOG))
    unharmed(d, honest)


def _read_answers(client, until_applied: int, timeout_s: float = 20.0) -> list:
    """The daemon's messages on a library client's socket, read by hand, up to Applied(until_applied)."""
    reader = framing.FrameReader()
    messages = []
    sock = client._sock
    sock.settimeout(timeout_s)
    while True:
        data = sock.recv(1 << 20)
        assert data, "the daemon closed the session"
        for body in reader.feed(data):
            message = M.decode_daemon_message(body)
            messages.append(message)
            if type(message) is M.Applied and message.seq == until_applied:
                return messages


REFUSED_COMMANDS = 20_000


def test_refusals_beyond_what_a_client_reads_are_summarised_and_none_is_lost(hostile):
    """A client that leaves its answers unread while a full ring of refused commands is
    applied gets the first ones one by one and the rest as a summary per code, before the
    Applied of its flush: the counts add up to every command refused."""
    d, honest = hostile()
    with wheeld.connect(d.socket_path, group="refused") as client:
        seg = client._segment
        kb, meta = encode_key("far")
        record = C.encode_add(kb, meta, 2**62, 7)
        pushed = 0
        while pushed < REFUSED_COMMANDS:
            if seg.try_push_record(record):
                pushed += 1
            else:
                client._ring_doorbell()
                time.sleep(0.001)
        client._ring_doorbell()
        wait_until(lambda: seg._words[RL.HEAD_WORD] == seg._tail, 20, what="the ring applied, its answers unread")
        seq = client._push_flush()
        messages = _read_answers(client, seq)
        rejected = [m for m in messages if type(m) is M.Rejected]
        one_by_one = [m for m in rejected if m.seq == 7]
        summaries = [m for m in rejected if m.seq == 0]
        assert one_by_one and summaries, (len(one_by_one), len(summaries))
        assert all(m.code == M.Rejected.INVALID_DEADLINE and m.key is None for m in summaries)
        summarised = sum(int(m.reason.split(" ", 1)[0]) for m in summaries)
        assert len(one_by_one) + summarised == pushed
        assert type(messages[-1]) is M.Applied and messages.index(summaries[-1]) < len(messages) - 1
        client._applied = seq  # read by hand above
        client.add("still-served", 10)
        assert [e.key for e in collect(client, 1)] == ["still-served"]
    unharmed(d, honest)


# ---------------------------------------------------------------------------- one ring's share of the loop

EXPENSIVE_NS = 20_000  # what each command of the costly ring takes (a refusal on a slow machine, say)
CHEAP_NS = 400  # ...and each of the ordinary ring's
#: the most of one loop iteration the costly ring may take (a chunk of 4096 of its commands takes 82 ms)
RING_SHARE_BOUND_NS = 12_000_000


def test_one_ring_gets_a_bounded_share_of_each_loop_iteration():
    """Executor.drain, on a clock that counts what each chunk of commands costs: a ring
    whose commands are expensive gets a small first chunk, then chunks that fit the
    per-ring budget, while an ordinary ring beside it is drained as much as before."""
    clock = [0]
    wheel = TimerWheel.create(100_000, start_ms=1000)
    gid = wheel.group_id("g")
    executor = E.Executor(wheel, {}, 1, 0, collections.Counter(), _never_poisoned, lambda: 1000,
                          clock_ns=lambda: clock[0])
    segments, cost = [], {}
    try:
        for slot, per_command in ((1, EXPENSIVE_NS), (2, CHEAP_NS)):
            consumer = ClientSegment.create(f"/wheeld-test-{os.getpid()}-share-{slot}", 1 << 14, 16)
            producer = ClientSegment.attach(os.dup(consumer.fd), consumer.name)
            segments += [consumer, producer]
            for i in range(1 << 14):
                kb, meta = encode_key(f"{slot}-{i}")
                deadline = 2**62 if per_command == EXPENSIVE_NS else 5000  # refused / armed
                assert producer.try_push_record(C.encode_add(kb, meta, deadline, 1))
            executor.clients[slot] = ClientSlot(slot, consumer, f"share-{slot}", gid, "g", os.getpid(), os.getuid())
            cost[slot] = per_command
        real_apply = executor.apply_ring

        def apply_ring(cs, max_records):
            applied = real_apply(cs, max_records)
            clock[0] += applied * cost[cs.slot]
            return applied

        executor.apply_ring = apply_ring
        depth = {slot: cs.segment.depth for slot, cs in executor.clients.items()}
        taken = []
        for _ in range(4):
            before = {slot: d() for slot, d in depth.items()}
            executor.drain()
            taken.append({slot: before[slot] - depth[slot]() for slot in depth})
        expensive = [t[1] for t in taken]
        assert all(0 < n * EXPENSIVE_NS <= RING_SHARE_BOUND_NS for n in expensive), expensive
        assert expensive[0] == E.FIRST_CHUNK  # its cost was not known yet: a small first chunk
        assert all(n == E.RING_BUDGET_NS // EXPENSIVE_NS for n in expensive[1:]), expensive  # ~5 ms of it each
        assert all(t[2] == E.DRAIN_BATCH for t in taken[:2]), taken  # the ordinary ring: a full batch each time
    finally:
        for segment in segments:
            segment.close()
        wheel.close()


def _never_poisoned(cs, reason):
    raise AssertionError(f"poisoned: {reason}")


# ---------------------------------------------------------------------------- client slots

DEPARTED_SESSIONS = 2100  # more than the 2047 client slots
LONG_IDLE_MS = 2**31 - 1  # ~24.8 days


def test_clients_that_leave_idle_timers_and_go_do_not_hold_the_slots(hostile):
    """Each session arms an idle timer of ~24.8 days and closes: more sessions than there
    are slots. A client connecting afterwards is served, and the timers are all kept."""
    d, honest = hostile(extra=["--ring-capacity", "64", "--touch-capacity", "64"], capacity=10_000)
    for i in range(DEPARTED_SESSIONS):
        with wheeld.connect(d.socket_path, group="departed", connect_timeout_s=30) as w:
            w.add_idle(f"conn-{i}", LONG_IDLE_MS)
            w.flush()
    with wheeld.connect(d.socket_path, group="newcomer", connect_timeout_s=10) as newcomer:
        newcomer.add("served", 10)
        assert [e.key for e in collect(newcomer, 1)] == ["served"]
    with R.ArenaReader(d.name) as reader:
        gid = reader.group_id("departed")
        assert int(reader.group_counts()[0][gid]) == DEPARTED_SESSIONS  # every idle timer still pending
    wait_until(lambda: counters(d.name)["clients_connected"] == 1, 10, what="only the honest client left")
    unharmed(d, honest)


IDLE_MS = 1500


def test_a_departed_clients_idle_timers_fire_after_its_last_touch_never_sooner(hostile):
    """The idle timers of a client that said Bye become plain timers at last touch + idle
    time (a touch made before it left still counts), and the slot is freed."""
    d, honest = hostile()
    with wheeld.connect(d.socket_path, group="toucher") as w:
        w.add_idle("touched", IDLE_MS)
        w.add_idle("untouched", IDLE_MS)
        w.flush()
        wait_for_clock(mono_ms() + 700, "700 ms after the adds")
        w.touch("touched")
        touched_at = mono_ms()
    wait_until(lambda: [r.group for r in _slots_in_use(d)] == ["honest"], 10, what="the slot released")
    with wheeld.connect(d.socket_path, group="toucher") as member:
        fired = {e.key: e for e in collect(member, 2, timeout_s=10)}
    assert set(fired) == {"touched", "untouched"}
    assert fired["touched"].fired_ms >= touched_at + IDLE_MS > fired["untouched"].deadline_ms
    assert fired["touched"].deadline_ms >= touched_at + IDLE_MS
    assert all(e.fired_ms >= e.deadline_ms for e in fired.values())
    unharmed(d, honest)


def test_an_idle_timer_re_armed_by_add_is_a_plain_timer(hostile):
    """``add`` of a key armed by ``add_idle`` makes it a plain timer: the library frees its
    touch index (here taken at once by another key, touched all along), and the daemon
    no longer reads that index for it. It fires with the deadline ``add`` returned."""
    d, honest = hostile()
    with wheeld.connect(d.socket_path, group="rearmed") as w:
        w.add_idle("a", 5000)
        w.flush()
        deadline = w.add("a", 300)
        w.add_idle("b", 5000)  # the index "a" had
        w.flush()
        got = []
        end = time.monotonic() + 10
        while not got and time.monotonic() < end:
            w.touch("b")
            got = [e for e in w.poll(0.05) if e.key == "a"]
        assert got, "the re-armed timer did not fire"
        assert got[0].deadline_ms == deadline and got[0].fired_ms >= deadline
        assert w.cancel("b")
        w.flush()
    unharmed(d, honest)


def _slots_in_use(d) -> list:
    """The client slots in the daemon's client table (wheelctl's view)."""
    with R.ArenaReader(d.name) as reader:
        return reader.rings()


SLOTS_PER_UID = 8

_HOLD_SLOTS = """
held, refused = [], None
for i in range(ARGS["sessions"]):
    try:
        w = wheeld.connect(ARGS["socket"], group=f"slots-{os.getuid()}", connect_timeout_s=10)
    except wheeld.BackPressure as exc:
        refused = str(exc)
        break
    w.add_idle(f"k{i}", 2**31 - 1)
    w.flush()
    held.append(w)
for w in held:  # gone without a Bye, as a crash leaves them: the socket closed, the ring not released
    w._sock.shutdown(socket.SHUT_RDWR)
print(json.dumps({"held": len(held), "refused": refused}))
"""


def test_one_uid_holds_at_most_its_share_of_slots_and_departed_ones_come_back(shared_daemon):
    d, honest = shared_daemon(extra=["--max-clients", "64", "--clients-per-uid", str(SLOTS_PER_UID),
                                     "--resume-grace-s", "2"])
    first = run_as(NOBODY, _HOLD_SLOTS, socket=d.socket_path, sessions=SLOTS_PER_UID + 4)
    assert first["held"] == SLOTS_PER_UID, first
    assert f"uid {NOBODY} holds {SLOTS_PER_UID} client slots" in first["refused"], first
    assert "--clients-per-uid" in first["refused"]
    # another uid is not affected by nobody's slots
    other = run_as(OTHER_UID, _HOLD_SLOTS, socket=d.socket_path, sessions=2)
    assert other == {"held": 2, "refused": None}, other
    # the slots of clients that left without a Bye are freed once the grace has passed,
    # their idle timers kept (as plain timers)
    wait_until(lambda: "idle timers become plain timers" in d.log(), 15, what="the departed slots released")
    again = run_as(NOBODY, _HOLD_SLOTS, socket=d.socket_path, sessions=SLOTS_PER_UID)
    assert again == {"held": SLOTS_PER_UID, "refused": None}, again
    with R.ArenaReader(d.name) as reader:
        gid = reader.group_id(f"slots-{NOBODY}")
        assert int(reader.group_counts()[0][gid]) == SLOTS_PER_UID  # the same keys k0..k7, re-armed
    honest.wait_served(20)
    unharmed(d, honest)


# ---------------------------------------------------------------------------- group ids

MAX_GROUPS = 64  # the default bound per uid is a quarter of them: 16

_TAKE_GROUPS = """
made, refused = 0, None
for i in range(ARGS["groups"]):
    try:
        with wheeld.connect(ARGS["socket"], group=f"{ARGS['prefix']}-{i}", connect_timeout_s=10) as w:
            w.add("hourly", 3_600_000)  # keeps the group in use for an hour
            w.flush()
        made += 1
    except wheeld.GroupLimit as exc:
        refused = str(exc)
        break
print(json.dumps({"made": made, "refused": refused}))
"""


def test_one_uid_cannot_take_every_group_id(shared_daemon):
    d, honest = shared_daemon(extra=["--max-groups", str(MAX_GROUPS)])
    hog = run_as(NOBODY, _TAKE_GROUPS, socket=d.socket_path, groups=MAX_GROUPS, prefix="hog")
    assert hog["made"] == MAX_GROUPS // 4, hog
    assert f"uid {NOBODY} owns {MAX_GROUPS // 4} groups" in hog["refused"] and "--groups-per-uid" in hog["refused"]
    # another user still gets group ids, and so does root
    other = run_as(OTHER_UID, _TAKE_GROUPS, socket=d.socket_path, groups=4, prefix="other")
    assert other == {"made": 4, "refused": None}, other
    with wheeld.connect(d.socket_path, group="root-group") as w:
        w.add("x", 10)
        assert [e.key for e in collect(w, 1)] == ["x"]
    # an existing group of its own is still open to the hog
    joined = run_as(NOBODY, _TAKE_GROUPS, socket=d.socket_path, groups=1, prefix="hog")
    assert joined == {"made": 1, "refused": None}, joined
    honest.wait_served(20)
    unharmed(d, honest)
