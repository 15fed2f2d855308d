"""Delivery in process, on private-memory wheels: expiry, idle re-arms, queues,
lateness and the frames it builds, without a daemon or a socket."""

from __future__ import annotations

import collections
import os
import random

from wheel_state import wheel_state

from wheeld.daemon.client_table import ClientSlot
from wheeld.daemon.config import Config
from wheeld.daemon.delivery import Delivery, Lateness
from wheeld.protocol import arena_layout as AL
from wheeld.protocol import clients_layout as CL
from wheeld.protocol import messages as M
from wheeld.protocol.framing import FrameReader
from wheeld.shm.wheel import TimerWheel


class _TouchTable:
    """What delivery reads of a client segment when an idle timer comes due."""

    def __init__(self):
        self.touched, self.idle = {}, {}

    def read_activity(self, index, now_ms, clock=None):
        touched, idle_ms = self.touched.get(index, 0), self.idle.get(index, 0)
        return (touched, idle_ms) if touched and idle_ms else None

    def touch_views(self):
        """The two words by index, as the wheel's lazy re-arm reads them (0: never written)."""
        return _Words(self.touched), _Words(self.idle)


class _Words:
    def __init__(self, words):
        self.words = words

    def __getitem__(self, index):
        return self.words.get(index, 0)


class _Journal:
    """Stands in for the Recorder: what delivery journals of the rows it expires."""

    def __init__(self):
        self.events = []

    def begin(self):
        pass

    def commit(self, now_ms):
        pass

    def fired(self, group, key, deadline, tag, now, late, idle_ms):
        self.events.append(("fired", group, key, deadline, tag, now, late))

    def idle_rearmed(self, group, key, deadline, new_deadline, tag, idle_ms):
        self.events.append(("idle", group, key, new_deadline))


class _Member:
    congested = closed = False

    def __init__(self, client):
        self.client = client
        self.reader = FrameReader()
        self.items = []

    def send(self, frame):
        for body in self.reader.feed(bytes(frame)):
            message = M.decode_daemon_message(body)  # the checked decoder accepts the frame
            self.items.extend(tuple(getattr(e, f) for f in e.__struct_fields__) for e in message.items)


def _poison(cs, reason):
    raise AssertionError(f"poisoned: {reason}")


def _delivery(capacity: int, recorder=None) -> tuple[Delivery, ClientSlot]:
    wheel = TimerWheel.create(capacity, start_ms=1000)
    cs = ClientSlot(3, _TouchTable(), "test", wheel.group_id("g"), "g", os.getpid(), os.getuid())
    config = Config(socket_path="/nonexistent/wheeld.sock", name="delivery")
    delivery = Delivery(wheel, {3: cs}, config, collections.Counter(), 1000, _poison, lambda: 1000, recorder)
    return delivery, cs


def test_expiry_by_columns_delivers_what_expiry_by_rows_delivers():
    """Cascades, backlogs, idle timers touched or not, several groups, an ack racing the
    queue: the column path (no journal) and the row path (journaled) deliver the same
    frames, in-flight tables, lateness and wheel, and the journal sees every fire."""
    rng = random.Random(5)
    setups = []
    for journal in (None, _Journal()):
        d, cs = _delivery(60_000, journal)
        groups = [cs.group, d.wheel.group_id("other")]
        members = {}
        for gid in groups:
            other = cs if gid == cs.group else ClientSlot(4, _TouchTable(), "other", gid, "other", 1, 0)
            d.clients[other.slot] = other
            members[gid] = _Member(other)
            d.members[gid].append(members[gid])
        setups.append((d, cs, members))
    idents = [bytes((0x40 | 9,)) + f"key-{i:05d}".encode().ljust(32, b"\0") for i in range(40_000)]
    for d, cs, members in setups:
        r = random.Random(9)
        for j, ident in enumerate(idents):
            gid = list(members)[j % 2]
            aux = (cs.slot << CL.TOUCH_INDEX_BITS | j % 1000) if j % 7 == 0 and gid == cs.group else -1
            d.wheel.schedule_ident(ident, 1001 + r.randrange(3000), gid, j, aux)
        for index in range(0, 1000, 3):  # touched idle timers come back on the wheel
            cs.segment.touched[index] = 2500
            cs.segment.idle[index] = 400
    now, acked = 1000, None
    while now < 4200:
        now += rng.choice([1, 1, 1, 2, 5, 40])  # sometimes a backlog
        for d, cs, _members in setups:
            d.expire(now)
            if acked is None and d.queues[cs.group]:  # an entry released before it is sent: dropped
                acked = d.queues[cs.group][0][:2]
            if acked is not None:
                d.wheel.release(*acked)
            d.dispatch()
    (a, _, ma), (b, _, mb) = setups
    for gid in ma:
        assert ma[gid].items == mb[gid].items
        assert ma[gid].client.unacked == mb[gid].client.unacked
    la, lb = a.lateness, b.lateness
    assert (la.counts, la.sum_us, la.beyond_tick) == (lb.counts, lb.sum_us, lb.beyond_tick)
    assert wheel_state(a.wheel) == wheel_state(b.wheel)
    assert acked is not None and acked not in {(item[5], item[6]) for m in ma.values() for item in m.items}
    delivered = sum(len(m.items) for m in ma.values())
    assert delivered > 30_000 and a.wheel.counters()["idle_rearms_total"] > 100
    assert all(item[3] >= item[2] for m in ma.values() for item in m.items), "fired before its deadline"
    fires = [e for e in b.recorder.events if e[0] == "fired"]
    assert len(fires) == delivered + 1  # the entry released before it was sent fired too
    assert sum(1 for e in b.recorder.events if e[0] == "idle") == a.wheel.counters()["idle_rearms_total"]


def test_lateness_counts_buckets_like_prometheus_le_and_what_is_over_a_tick_late():
    import numpy as np

    for as_array in (False, True):
        lateness = Lateness(tick_ms=1)
        values = [0, 50, 51, 1_000, 1_001, 99_999_999]
        lateness.add(np.array(values, dtype=np.int64) if as_array else values)
        bounds = AL.LATENESS_BOUNDS_US
        assert lateness.counts[0] == 2 and lateness.counts[1] == 1  # <= 50 us, then <= 100 us
        assert lateness.counts[bounds.index(1_000)] == 1 and lateness.counts[bounds.index(2_000)] == 1
        assert lateness.counts[-1] == 1 and lateness.sum_us == sum(values)
        assert lateness.beyond_tick == 2  # more than 1 ms late
        words = [0] * (AL.H_LATENESS_SUM_US // 8 + 1)
        totals = {"late_total": 5}
        lateness.publish(words, totals)
        assert totals["late_total"] == 7 and words[AL.H_LATENESS_SUM_US // 8] == sum(values)
        assert lateness.beyond_tick == 0 and not any(lateness.counts)


def test_a_timer_expired_more_than_a_tick_late_counts_as_late():
    d, cs = _delivery(1000)
    d.members[cs.group].append(_Member(cs))
    d.wheel.schedule("on-time", 1005, cs.group)
    d.wheel.schedule("late", 1006, cs.group)
    d.expire(1005)
    d.expire(1010)  # 4 ms after the second deadline: the loop was held up
    d.dispatch()
    assert d.lateness.beyond_tick == 1
    assert d.undelivered() == 0


def test_requeued_expirations_go_to_the_front_and_count_as_redelivered():
    d, cs = _delivery(1000)
    d.queues[cs.group].append((50, 1, 1000, False))
    d.requeue([(7, 2), (8, 3)], cs.group)
    assert [entry[:2] for entry in d.queues[cs.group]] == [(7, 2), (8, 3), (50, 1)]
    assert d.totals["redelivered_total"] == 2


class _Recipient(_Member):
    """A member that reads, as each frame is sent, the recipient its records name in the arena."""

    def __init__(self, client, wheel):
        super().__init__(client)
        self.wheel = wheel
        self.named = []

    def send(self, frame):
        before = len(self.items)
        super().send(frame)
        self.named += [AL.recipient_of(self.wheel.fired(item[5])[4]) for item in self.items[before:]]


def test_each_record_names_the_client_it_is_sent_to_before_the_frame_leaves():
    d, cs = _delivery(1000)
    other = ClientSlot(9, _TouchTable(), "other", cs.group, "g", 1, 0)
    d.clients[other.slot] = other
    mine, theirs = _Recipient(cs, d.wheel), _Recipient(other, d.wheel)
    d.members[cs.group] += [mine, theirs]
    d.config = Config(socket_path="/nonexistent/wheeld.sock", name="delivery", delivery_batch=4)
    for i in range(16):
        d.wheel.schedule(f"k{i}", 1001 + i % 3, cs.group, aux=(cs.slot << CL.TOUCH_INDEX_BITS | i) if i % 2 else -1)
    d.expire(1005)
    d.dispatch()
    assert len(mine.items) + len(theirs.items) == 16 and mine.items and theirs.items
    assert mine.named == [cs.slot] * len(mine.items) and theirs.named == [other.slot] * len(theirs.items)
    # an ack timeout sends one again, to another member: it names that one from then on
    slot, gen = theirs.items[0][5], theirs.items[0][6]
    del other.unacked[slot]
    d.members[cs.group].remove(theirs)
    d.requeue([(slot, gen)], cs.group)
    d.dispatch()
    assert mine.items[-1][5] == slot and mine.named[-1] == cs.slot
    assert d.wheel.check() == []


def test_what_is_held_for_a_client_waits_for_it_and_goes_to_the_group_when_its_slot_is_freed():
    """After a restart, fired records sent to a client whose slot the table still holds
    are held for it (DaemonCore._redeliver_fired): not sent to another member; sent to
    that client once it has a session again; to the group, in order, once the slot is freed."""
    for freed in (False, True):
        d, cs = _delivery(1000)
        other = ClientSlot(9, _TouchTable(), "other", cs.group, "g", 1, 0)
        d.clients[other.slot] = other
        theirs = _Member(other)
        other.session = theirs
        d.members[cs.group].append(theirs)
        handles = [d.wheel.schedule(f"k{i}", 1001, cs.group) for i in range(5)]
        d.expire(1001)
        entries = list(d.queues[cs.group])
        d.queues[cs.group].clear()
        d.queues[cs.group].append(entries[0])  # one with no recipient: to the group
        for entry in entries[1:]:
            d.hold(cs.slot, cs.group, entry)
        d.dispatch()
        assert [item[5] for item in theirs.items] == [handles[0][0]]
        assert d.undelivered() == 4 and cs.session is None
        d.wheel.release(*handles[2])  # acknowledged meanwhile (an ack left in the ring): dropped
        if freed:
            assert d.release_held(cs.slot) == 4
            d.dispatch()
            assert [item[5] for item in theirs.items] == [handles[i][0] for i in (0, 1, 3, 4)]
        else:
            mine = _Member(cs)
            cs.session = mine
            d.members[cs.group].append(mine)
            d.dispatch()
            assert [item[5] for item in mine.items] == [handles[i][0] for i in (1, 3, 4)]
            assert len(theirs.items) == 1 and set(cs.unacked) == {handles[i][0] for i in (1, 3, 4)}
            assert d.release_held(cs.slot) == 0
        assert d.held == {} and d.undelivered() == 0


def test_a_restart_checks_again_an_idle_timer_expired_but_never_sent():
    """A daemon killed between the wheel's expire and the idle check leaves an idle timer
    FIRED with its touch reference still in its aux word, its touches never read (sim seed
    17766: a touch made while the daemon was down, the copy handed to another member 14.9 ms
    early). The restarted daemon (DaemonCore._redeliver_fired) checks it again as expire
    does: back on the wheel while its client has not handed its ring back, or at last touch
    + idle_ms; delivered at once only when that is not ahead."""
    from types import SimpleNamespace

    from wheeld.daemon.core import DaemonCore
    from wheeld.daemon.delivery import IDLE_WAIT_MS

    for case, expected in (("away", 1001 + IDLE_WAIT_MS), ("touched", 1040), ("idle", None)):
        d, cs = _delivery(1000)
        ident = bytes((0x40 | 4,)) + b"idle".ljust(32, b"\0")
        idle = d.wheel.schedule_ident(ident, 1001, cs.group, 7, cs.slot << CL.TOUCH_INDEX_BITS | 5)
        plain = d.wheel.schedule("plain", 1001, cs.group)
        assert sorted(d.wheel.expire(1001)) == sorted([idle[0], plain[0]])  # killed here: nothing queued
        cs.segment.touched[5], cs.segment.idle[5] = (900 if case == "idle" else 1000), 40
        if case == "away":  # a slot restored from the client table: its ring not handed back yet
            cs.segment, cs.orphan_since = None, 1001
        DaemonCore._redeliver_fired(SimpleNamespace(wheel=d.wheel, delivery=d, clients=d.clients), 1001)
        queued = [entry[0] for entry in d.queues[cs.group]]
        assert sorted(queued) == sorted([plain[0]] if expected else [plain[0], idle[0]]), case
        assert d.wheel.next_deadline() == expected, case
        assert d.wheel.check() == []


def test_the_idle_time_a_snapshot_writes_is_the_touch_tables_while_it_is_in_reach():
    """``Delivery.idle_ms_of`` (the Recorder's ``idle_source``): an idle timer's idle time as
    its client's touch table holds it, or None while that table is out of reach (a slot
    waiting for its client after a restart, a poisoned client, a freed slot) or holds no
    sound value at that row; a snapshot then falls back on the journal read at start."""
    from wheeld.shm.ring import MAX_IDLE_MS

    d, cs = _delivery(100)
    row = cs.slot << CL.TOUCH_INDEX_BITS
    cs.segment.idle.update({1: 30_000, 2: MAX_IDLE_MS + 1, 3: -5})
    assert [d.idle_ms_of(row | index) for index in (1, 2, 3, 4)] == [30_000, None, None, None]
    assert d.idle_ms_of(7 << CL.TOUCH_INDEX_BITS | 1) is None  # no such slot
    cs.poisoned = True
    assert d.idle_ms_of(row | 1) is None
    cs.poisoned, cs.segment = False, None  # its ring not handed back yet
    assert d.idle_ms_of(row | 1) is None
