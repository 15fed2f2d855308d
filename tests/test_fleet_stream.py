"""The fleet's stream format and the core's held answers, without a cluster: a journal's
appends and snapshots, as a replicator receives them, read back into the same timers;
the outbox's bounds; flush answers held until the stream stored what they cover."""

from __future__ import annotations

import asyncio
import zlib
from types import SimpleNamespace

import pytest

from wheeld.daemon.replication import Replication
from wheeld.fleet import stream as S
from wheeld.fleet.replicator import Outbox
from wheeld.journal.files import FiredTimer, Journal, PendingTimer
from wheeld.journal.recovery import recover
from wheeld.protocol.journal import Ack, Add, Cancel, Fire, Rearm

T0 = 1_700_000_000_000


class Tap:
    """What a replicator is told, as the messages it would publish (split into parts)."""

    def __init__(self, host="h1", epoch=1, deflate=True):
        self.host, self.epoch, self.messages, self.deflate = host, epoch, [], deflate

    def _publish(self, kind, first, last, payload):
        data, encoding = S.deflate(payload) if self.deflate else (payload, None)
        parts = S.split(data)
        for i, part in enumerate(parts, 1):
            label = (i, len(parts)) if len(parts) > 1 else None
            hdrs = S.headers(kind, self.host, self.epoch, first, last, len(self.messages), label, encoding)
            self.messages.append((hdrs, part, len(self.messages) + 1))

    def appended(self, first, last, data):
        self._publish(S.BATCH, first, last, data)

    def snapshotted(self, lsn, data):
        self._publish(S.SNAP, lsn, lsn, data)

    def records(self, messages=None):
        joiner = S.Reassembler()
        out = [joiner.feed(h, d, seq) for h, d, seq in (self.messages if messages is None else messages)]
        return [r for r in out if r is not None]


def _history(journal: Journal):
    journal.append([Add(t=T0, g="g", k=f"k{i}", d=T0 + 1000 + i, s=i) for i in range(50)])
    journal.append([Cancel(t=T0, g="g", k="k3", s=60, hit=True, pd=T0 + 1003),
                    Rearm(t=T0, g="g", k="k4", d=T0 + 9000, pd=T0 + 1004, s=61)])
    journal.append([Fire(t=T0 + 1005, g="g", k="k5", d=T0 + 1005, s=5, f=T0 + 1005, late=False, lat=0),
                    Fire(t=T0 + 1006, g="g", k="k6", d=T0 + 1006, s=6, f=T0 + 1006, late=False, lat=0),
                    Ack(t=T0 + 1007, g="g", k="k6", s=6)])


def _same(a, b):
    assert a.pending == b.pending
    assert sorted((t.group, str(t.key), t.seq) for t in a.unacked) == \
        sorted((t.group, str(t.key), t.seq) for t in b.unacked)


@pytest.mark.parametrize("deflate_min", [1, 10**9], ids=["deflated", "plain"])
@pytest.mark.parametrize("part", [None, 97])
def test_the_stream_recovers_the_timers_the_journal_does(tmp_path, monkeypatch, part, deflate_min):
    if part:
        monkeypatch.setattr(S, "MAX_PART", part)  # every message in many parts
    monkeypatch.setattr(S, "DEFLATE_MIN", deflate_min)
    tap = Tap()
    journal = Journal(tmp_path / "j", fsync="off", host="h1", wall_ms=lambda: T0, mono_ms=lambda: 0)
    journal.tap = tap
    _history(journal)
    state = recover(tmp_path / "j", repair=False, quiet=True)
    journal.write_snapshot(journal.last_lsn, state.pending.values(), state.unacked)
    journal.append([Add(t=T0, g="g2", k=7, d=T0 + 5, s=70, i=300), Ack(t=T0, g="g", k="k5", s=5)])
    journal.close()
    deflated = [h.get(S.H_ENCODING) == S.DEFLATE for h, _, _ in tap.messages]
    assert all(deflated) if deflate_min == 1 else not any(deflated)
    kept, fence = S.tail(tap.records())
    assert fence is None and kept[0].kind == S.SNAP and [r.kind for r in kept[1:]] == [S.BATCH]
    last = S.write_directory(kept, tmp_path / "copy", "h1")
    assert last == journal.last_lsn
    _same(recover(tmp_path / "copy", repair=False, quiet=True), recover(tmp_path / "j", repair=False, quiet=True))
    copy = recover(tmp_path / "copy", repair=False, quiet=True)
    assert ("g2", 7) in copy.pending and copy.pending[("g2", 7)].idle_ms == 300
    assert ("g", "k3") not in copy.pending and copy.pending[("g", "k4")].deadline_ms == T0 + 9000
    assert not copy.unacked  # k5 and k6 were acknowledged


def test_a_message_whose_parts_stop_short_is_dropped(tmp_path, monkeypatch):
    monkeypatch.setattr(S, "MAX_PART", 200)
    tap = Tap()
    journal = Journal(tmp_path / "j", fsync="off", host="h1", wall_ms=lambda: T0, mono_ms=lambda: 0)
    journal.tap = tap
    journal.write_snapshot(0, [])
    journal.append([Add(t=T0, g="g", k="a", d=T0 + 10, s=1)])
    whole = len(tap.messages)
    journal.append([Add(t=T0, g="g", k=f"b{i}", d=T0 + 10, s=2 + i) for i in range(5)])  # several parts
    assert len(tap.messages) - whole > 1
    cut = tap.messages[:-1]  # its writer died before the last part
    kept, _ = S.tail(tap.records(cut))
    assert [r.kind for r in kept] == [S.SNAP, S.BATCH] and kept[-1].last == 1
    S.write_directory(kept, tmp_path / "copy", "h1")
    assert set(recover(tmp_path / "copy", repair=False, quiet=True).pending) == {("g", "a")}


def test_journal_lines_are_deflated_and_short_payloads_go_as_they_are():
    lines = b"".join(b'{"ev":"add","v":1,"n":%d,"t":1,"g":"g","k":"k%d","d":9,"s":%d,"crc":1}\n' % (i, i, i)
                     for i in range(200))
    data, encoding = S.deflate(lines)
    assert encoding == S.DEFLATE and len(data) < len(lines) / 3
    assert S.inflate(data, encoding) == lines
    assert S.deflate(lines[:100]) == (lines[:100], None)


@pytest.mark.parametrize("damage", ["flipped", "cut", "unknown", "too-large"])
def test_a_deflated_message_that_cannot_be_read_is_dropped_and_named(monkeypatch, caplog, damage):
    monkeypatch.setattr(S, "DEFLATE_MIN", 1)
    tap = Tap()
    tap.snapshotted(0, b"s" * 50)
    tap.appended(1, 2, b"x" * 5000)
    tap.appended(3, 3, b"y" * 5000)
    hdrs, data, seq = tap.messages[1]
    if damage == "flipped":
        data = data[:4] + bytes([data[4] ^ 0xFF]) + data[5:]
    elif damage == "cut":
        data = data[:len(data) // 2]
    elif damage == "unknown":
        hdrs = dict(hdrs, **{S.H_ENCODING: "zstd"})
    else:  # a bomb: more than the reader takes
        data = zlib.compress(b"\0" * (S.INFLATE_FLOOR + 1), 9)
    tap.messages[1] = (hdrs, data, seq)
    records = tap.records()
    assert [(r.kind, r.first, r.payload[:1]) for r in records] == [(S.SNAP, 0, b"s"), (S.BATCH, 3, b"y")]
    assert "batch lsn 1-2 of host h1 (stream sequence 2) cannot be read" in caplog.text


def test_a_fence_ends_the_stream_and_a_snapshot_replaces_what_came_before():
    tap = Tap()
    tap.appended(1, 3, b"x")
    tap.snapshotted(3, b"s")
    tap.appended(4, 4, b"y")
    tap.appended(4, 4, b"y")  # sent again (its acknowledgement lost): kept once
    tap.messages.append((S.headers(S.FENCE, "h2", 2, 0, 0, 4), b"", 5))
    kept, fence = S.tail(tap.records())
    assert [(r.kind, r.first, r.last) for r in kept] == [(S.SNAP, 3, 3), (S.BATCH, 4, 4)]
    assert fence is not None and fence.host == "h2" and fence.epoch == 2


def test_the_outbox_drops_what_a_snapshot_covers_and_asks_for_one_past_its_bound():
    box = Outbox(limit=100)
    box.appended(1, 1, b"a" * 10)
    assert not box.items and box.dropped == 1  # nothing before the first snapshot
    box.snapshotted(1, b"s")
    box.appended(2, 5, b"b" * 40)
    box.appended(6, 9, b"c" * 40)
    assert [it[:3] for it in box.items] == [(S.SNAP, 1, 1), (S.BATCH, 2, 5), (S.BATCH, 6, 9)]
    box.snapshotted(5, b"t")  # covers the first batch and the older snapshot
    assert [it[:3] for it in box.items] == [(S.BATCH, 6, 9), (S.SNAP, 5, 5)]
    box.appended(10, 12, b"d" * 80)  # past the bound: batches dropped, a snapshot wanted
    assert box.want_snapshot and all(it[0] == S.SNAP for it in box.items) and box.size <= 100
    box.appended(13, 13, b"e")  # covered by the snapshot to come
    assert all(it[0] == S.SNAP for it in box.items)
    box.snapshotted(13, b"u")
    assert not box.want_snapshot and [it[:3] for it in box.items] == [(S.SNAP, 13, 13)]


def test_host_ids_are_checked():
    assert S.check_host_id("web-3_a") == "web-3_a"
    for bad in ("", "a.b", "a b", "x" * 65, "a>"):
        with pytest.raises(ValueError):
            S.check_host_id(bad)
    assert S.check_host_id(S.default_host_id())


class FakeReplicator:
    def __init__(self):
        self.replicated_lsn = 0
        self.state = "behind"
        self.config = SimpleNamespace(urls=("nats://127.0.0.1:1",))
        self.hurried: list[int] = []

    def hurry(self, lsn):
        self.hurried.append(lsn)


def _replication(durability="replicated", timeout_ms=1000):
    now = [0]
    sent = []
    rep = FakeReplicator()
    r = Replication(rep, durability, timeout_ms, lambda: now[0], {"journal_flushes_refused_total": 0},
                    lambda cs, flushes, rejects, cuts, unsynced, code: sent.append((cs.slot, flushes, code)))
    return r, rep, now, sent


def test_a_flush_is_answered_once_the_stream_stored_what_it_covers():
    r, rep, now, sent = _replication()
    a, b = SimpleNamespace(slot=0, session="a1"), SimpleNamespace(slot=1, session="b1")
    r.answer(a, 10, [1], [], None, None)
    r.answer(b, 11, [], ["refusal"], None, None)  # b has nothing held: at once
    r.answer(a, 12, [], ["refusal"], None, None)  # behind a's held flush: in order
    assert sent == [(1, [], None)]
    assert rep.hurried == [10]  # a flush waits: the outbox sends without lingering (not for a's refusal)
    rep.replicated_lsn = 10
    r.release(now[0])
    assert sent[1:] == [(0, [1], None), (0, [], None)]
    rep.replicated_lsn = 12
    r.answer(a, 12, [2], [], None, None)  # already stored: at once
    assert sent[-1] == (0, [2], None) and not r.held


def test_a_flush_the_stream_does_not_store_in_time_fails_as_replication_behind():
    r, rep, now, sent = _replication(timeout_ms=500)
    a = SimpleNamespace(slot=0, session="a1")
    r.answer(a, 5, [1], [], None, None)
    assert r.next_timeout_ms() == 500
    now[0] = 499
    r.release(now[0])
    assert not sent
    now[0] = 500
    r.release(now[0])
    assert sent == [(0, [1], "replication_behind")] and r.totals["journal_flushes_refused_total"] == 1


def test_held_answers_go_to_the_session_they_were_made_for_or_to_none():
    """A client whose session ended while its answers were held reads them back from its
    ring when its next session opens (the FLUSHes are marked replication_behind): sent on
    that session as well, they would be told twice (a refusal raised by a later flush)."""
    r, rep, now, sent = _replication()
    a = SimpleNamespace(slot=0, session="a1")
    r.answer(a, 10, [1], ["refusal"], [0], None)
    a.session = "a2"  # the session ended, the client opened another
    r.answer(a, 11, [2], [], None, None)  # behind the held one, for the new session
    rep.replicated_lsn = 11
    r.release(now[0])
    assert sent == [(0, [2], None)] and not r.held


def test_local_durability_answers_at_once():
    r, rep, now, sent = _replication(durability="local")
    r.answer(SimpleNamespace(slot=0, session="a1"), 99, [1], [], None, None)
    assert sent == [(0, [1], None)]


def test_timer_structs_are_what_recovery_returns():
    # the adoption reads PendingTimer/FiredTimer from recover(): their fields are what it uses
    assert {"group", "key", "deadline_ms", "seq", "idle_ms"} <= set(PendingTimer.__struct_fields__)
    assert {"group", "key", "deadline_ms", "seq"} <= set(FiredTimer.__struct_fields__)


def test_batches_queued_behind_a_message_in_flight_go_out_as_one():
    box = Outbox()
    box.snapshotted(0, b"s")
    assert box.next_message()[:3] == (S.SNAP, 0, 0)
    box.sent(S.SNAP, 0, 1)
    for lsn in range(1, 6):
        box.appended(lsn, lsn, b"%d" % lsn)
    kind, first, last, payload, taken = box.next_message()
    assert (kind, first, last, payload, taken) == (S.BATCH, 1, 5, b"12345", 5)
    box.appended(6, 6, b"6")  # arrives while that message is in flight
    box.sent(kind, first, taken)
    assert box.next_message()[:4] == (S.BATCH, 6, 6, b"6") and box.size == 1


def test_a_snapshot_that_replaced_a_message_in_flight_is_not_dropped_with_it():
    box = Outbox()
    box.snapshotted(0, b"s")
    box.sent(S.SNAP, 0, 1)
    box.appended(12, 12, b"x")
    kind, first, _, _, taken = box.next_message()
    box.snapshotted(12, b"snap")  # covers the batch in flight
    box.sent(kind, first, taken)
    assert [it[:3] for it in box.items] == [(S.SNAP, 12, 12)]


def test_joined_batches_stay_within_a_message(monkeypatch):
    monkeypatch.setattr(S, "MAX_PART", 10)
    box = Outbox()
    box.snapshotted(0, b"")
    box.sent(S.SNAP, 0, 1)
    for lsn in range(1, 5):
        box.appended(lsn, lsn, b"abcd")
    assert box.next_message()[1:3] == (1, 2)  # 8 bytes; a third would pass 10


class _Recorder:
    """What adopt_timers journals (a Recorder's begin/armed/commit)."""

    def __init__(self):
        self.armed_calls, self.batches = [], 0

    def begin(self, client_slot=None):
        self.batches += 1

    def armed(self, gid, key, deadline_ms, seq, previous_ms, idle_ms):
        self.armed_calls.append((gid, key, deadline_ms, seq, previous_ms, idle_ms))

    def commit(self, now_ms):
        return 0


def test_adopted_timers_keep_their_groups_and_deadlines_and_a_taken_key_is_renamed():
    from wheeld.daemon.replication import adopt_timers
    from wheeld.journal.files import read_clocks
    from wheeld.journal.recovery import RecoveredState
    from wheeld.shm.wheel import TimerWheel

    wall_ns, mono_ns = read_clocks()
    now_mono, now_wall = mono_ns // 1_000_000, wall_ns // 1_000_000
    wheel = TimerWheel.create(1000, tick_ms=1, wheel_size=8, levels=5, start_ms=now_mono)
    try:
        gid = wheel.group_id("orders")
        wheel.schedule("taken", now_mono + 50_000, gid, 1)  # this host's own timer of that key
        state = RecoveredState(
            pending={("orders", "a"): PendingTimer("orders", "a", now_wall + 20_000, 7),
                     ("orders", "taken"): PendingTimer("orders", "taken", now_wall + 30_000, 8),
                     ("jobs", 5): PendingTimer("jobs", 5, now_wall - 4_000, 9, idle_ms=1000)},
            unacked=[FiredTimer("orders", "b", now_wall - 1_000, 10, now_wall - 900, False, 100)],
            last_lsn=40, snapshot_lsn=0, problems=[])
        rec = _Recorder()
        marks: set = set()
        adopted, renamed, lost = adopt_timers(wheel, rec, lambda: now_mono, "hostA", state, marks)
        assert (adopted, renamed, lost) == (4, 1, 0)
        assert len(marks) == 2  # the past-due one and the fired one: they fire marked late
        orders, jobs = wheel.group_id("orders"), wheel.group_id("jobs")
        assert wheel.lookup("taken", orders) is not None and wheel.lookup("taken@hostA", orders) is not None
        deadlines = {key: d for _g, key, d, *_ in rec.armed_calls}
        assert deadlines["a"] >= now_mono + 20_000 - 5  # its wall-clock deadline, never sooner
        assert deadlines["taken@hostA"] >= now_mono + 30_000 - 5
        assert deadlines[5] <= now_mono and deadlines["b"] <= now_mono  # past: due at once, late
        assert wheel.lookup(5, jobs) is not None and rec.batches == 1
        fired = wheel.expire(now_mono)
        assert sorted(fired) == sorted(slot for slot, _gen in marks)  # the two past ones, at once, marked late
    finally:
        wheel.close()
        wheel.unlink()


def test_lag_counts_from_when_the_oldest_waiting_event_was_queued():
    from wheeld.fleet.replicator import FleetConfig, Replicator

    now = [5_000_000]  # a monotonic clock far from 0 (uptime)
    r = Replicator(FleetConfig(urls=("nats://127.0.0.1:1",), host_id="h"), clock_ms=lambda: now[0])
    assert r.stats()["fleet_lag_ms"] == 0
    r.snapshotted(5, b"s")  # the first snapshot, not stored yet
    now[0] += 30
    assert r.stats()["fleet_lag_ms"] == 30 and r.stats()["fleet_lag_records"] == 5
    r.appended(6, 8, b"abc")
    now[0] += 20
    stats = r.stats()
    assert stats["fleet_lag_records"] == 8 and stats["fleet_lag_ms"] == 50


class _FakeJetStream:
    """Stores what a Replicator publishes (its stream's sequence numbers, at once)."""

    def __init__(self):
        self.messages: list[tuple[str, str, bytes]] = []
        self.encodings: list[str | None] = []

    async def publish(self, subject, data, headers=None, stream=None):
        self.messages.append((headers[S.H_KIND], headers[S.H_LSN], data))
        self.encodings.append(headers.get(S.H_ENCODING))
        return SimpleNamespace(seq=len(self.messages))


def _publishing(linger_ms: int):
    from wheeld.fleet.replicator import FleetConfig, Replicator

    r = Replicator(FleetConfig(urls=("nats://127.0.0.1:1",), host_id="h", linger_ms=linger_ms))
    r._js = _FakeJetStream()
    return r


async def _until(predicate, timeout_s: float = 5.0) -> None:
    end = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < end, "timed out"
        await asyncio.sleep(0.002)


async def _replicating(linger_ms: int):
    """A replicator publishing to a :class:`_FakeJetStream`, its first snapshot stored."""
    r = _publishing(linger_ms)
    r._tasks.append(asyncio.ensure_future(r._publish_loop()))
    r.snapshotted(0, b"s")
    await _until(lambda: len(r._js.messages) == 1 and r.state == "replicating")  # a snapshot goes at once
    return r


def test_appends_linger_into_one_message_until_a_flush_hurries_them():
    async def scenario():
        r = await _replicating(linger_ms=60_000)
        sent = r._js.messages
        for lsn in (1, 2, 3):
            r.appended(lsn, lsn, b"%d" % lsn)
            await asyncio.sleep(0.01)  # the publish loop runs in between
        assert len(sent) == 1 and r.replicated_lsn == 0  # lingering
        r.hurry(2)  # a flush waits for lsn 2: everything queued goes, in one message
        await _until(lambda: len(sent) == 2)
        assert sent[1] == (S.BATCH, "1 3", b"123") and r.replicated_lsn == 3
        r.appended(4, 4, b"4")
        await asyncio.sleep(0.02)
        assert len(sent) == 2  # the hurry was for lsn 2, stored: lingering again
        r._tasks[0].cancel()

    asyncio.run(scenario())


def test_a_large_message_is_deflated_in_a_worker_thread_and_a_short_one_is_sent_as_it_is(monkeypatch):
    import threading

    from wheeld.fleet import replicator

    threads = []
    plain = S.deflate
    monkeypatch.setattr(S, "deflate", lambda payload: threads.append(threading.current_thread()) or plain(payload))
    lines = b"".join(b'{"ev":"pending","g":"g","k":"k%d","d":%d,"s":%d,"crc":7}\n' % (i, 10**12 + i, i)
                     for i in range(replicator.DEFLATE_OFF_LOOP // 40))

    async def scenario():
        r = await _replicating(linger_ms=0)  # its first snapshot, b"s": as it is, on the loop
        r.snapshotted(1, lines)
        await _until(lambda: len(r._js.messages) == 2)
        r._tasks[0].cancel()
        return r._js

    js = asyncio.run(scenario())
    assert js.encodings == [None, S.DEFLATE] and js.messages[0][2] == b"s"
    assert S.inflate(js.messages[1][2], S.DEFLATE) == lines and len(js.messages[1][2]) < len(lines) / 3
    assert threads[0] is threading.main_thread() and threads[1] is not threading.main_thread()


def test_a_linger_ends_on_time():
    async def scenario():
        r = await _replicating(linger_ms=40)
        sent = r._js.messages
        t0 = asyncio.get_running_loop().time()
        r.appended(1, 1, b"1")
        await _until(lambda: len(sent) == 2)
        assert asyncio.get_running_loop().time() - t0 >= 0.035  # not sooner than the linger (a ms of slack)
        assert sent[1] == (S.BATCH, "1 1", b"1")
        r._tasks[0].cancel()

    asyncio.run(scenario())


def test_a_stop_sends_what_lingers():
    async def scenario():
        r = await _replicating(linger_ms=60_000)
        r.appended(1, 2, b"ab")
        await r.close()
        assert r._js.messages[-1] == (S.BATCH, "1 2", b"ab") and r.state == "stopped"

    asyncio.run(scenario())
