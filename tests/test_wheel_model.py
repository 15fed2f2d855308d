"""The timing wheel against a reference model (hypothesis stateful tests).

The model is what a user expects from a timer service, written the obvious
way: a dict (group, key) -> deadline and a heap of deadlines. Every rule applies
the same step to the wheel and to the model; after every step ``check()`` must
find no broken invariant and the pending timers must be the model's.

What an advance may return, for ``F(d) = ceil(d / tick_ms) * tick_ms`` (the end
of the tick the deadline falls in):

* nothing with ``d > now`` (never early);
* everything with ``F(d) <= now`` (at most one tick late when advanced on time;
  with ``tick_ms = 1`` this makes the expired set exactly the model's due set);
* a timer with ``d <= now < F(d)`` may come out now or at the next advance.

Groups: the wheel has four group ids; timers go to ``default`` (0) or to
``other``, and rules register and forget names. The model keeps the group
table (id -> name) and derives the live records per group (scheduled + fired)
from its timers; after every step ``group_counts()`` and ``groups()`` must be
the model's. A forgotten id that timers still carry is not handed to a new
name while they live.

A second machine runs the batch methods (``schedule_many``, ``cancel_many``,
``expire_many``, ``release_many``) on one wheel and the scalar methods item by
item on another, and requires the same results and the same final state.

Shapes: several (tick_ms, wheel_size, levels), small enough that cascades and
the clamp beyond the top level happen within a few steps. Each machine has a
``...Long`` twin marked ``slow`` (``make test-long``) that runs many more examples.
"""

from __future__ import annotations

import heapq
import os
import uuid
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from wheeld.protocol.errors import ArenaFull, GroupLimit
from wheeld.shm import TimerWheel
from wheeld.shm.arena import unlink
from wheeld.shm.wheel import encode_ident

CAPACITY = 8
MAX_GROUPS = 4
NAMES = st.sampled_from(["other", "x", "y", "z"])

KEYS = st.sampled_from(["a", "b", b"a", 1, -7, "long" * 8, "é"])
DELTAS = st.one_of(
    st.integers(-3, 3),
    st.integers(0, 40),
    st.integers(0, 5_000),
    st.integers(0, 10**7),
    st.just(10**12),
)
JUMPS = st.one_of(
    st.just(0),
    st.just(1),
    st.integers(1, 10),
    st.integers(0, 300),
    st.integers(0, 100_000),
    st.just(10**12),
)


class WheelMachine(RuleBasedStateMachine):
    tick_ms = 1
    wheel_size = 4
    levels: int | None = 3

    def __init__(self) -> None:
        super().__init__()
        self.name = f"/wheeld-test-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.wheel: TimerWheel | None = None

    @initialize(start=st.integers(0, 10**6))
    def create(self, start):
        self.wheel = TimerWheel.create(
            CAPACITY, tick_ms=self.tick_ms, wheel_size=self.wheel_size, levels=self.levels,
            name=self.name, start_ms=start, max_groups=MAX_GROUPS,
        )
        self.group = self.wheel.group_id("other")
        self.names = {0: "default", self.group: "other"}  # the model's group table
        self.now = start
        self.scheduled: dict[tuple[int, object], tuple[int, int]] = {}  # (group, key) -> (deadline, tag)
        self.handles: dict[tuple[int, object], tuple[int, int]] = {}  # live handle per scheduled key
        self.fired: dict[int, tuple[object, int, int, int, int]] = {}  # slot -> key, deadline, group, tag, gen
        self.old_handles: list[tuple[int, int]] = []
        # the due order: a heap of (deadline, seq, (group, key)), lazily deleted (seq_of)
        self.heap: list[tuple[int, int, tuple]] = []
        self.seq_of: dict[tuple, int] = {}
        self.seq = 0

    def model_add(self, gk, deadline: int, tag: int) -> None:
        self.scheduled[gk] = (deadline, tag)
        self.seq += 1
        self.seq_of[gk] = self.seq
        heapq.heappush(self.heap, (deadline, self.seq, gk))

    def model_remove(self, gk) -> None:
        del self.scheduled[gk]
        del self.seq_of[gk]
        self.handles.pop(gk, None)

    def model_due(self, now: int) -> list[tuple[int, int, tuple]]:
        """Pop every live heap entry with deadline <= now (the caller pushes back what stays)."""
        due = []
        while self.heap and self.heap[0][0] <= now:
            entry = heapq.heappop(self.heap)
            if self.seq_of.get(entry[2]) == entry[1]:
                due.append(entry)
        return due

    def teardown(self) -> None:
        try:
            if self.wheel is not None:
                self.wheel.close()
        finally:
            unlink(self.name)

    def last_tick(self, deadline: int) -> int:
        return -(-deadline // self.tick_ms) * self.tick_ms

    def used(self) -> int:
        return len(self.scheduled) + len(self.fired)

    # ------------------------------------------------------------------ rules
    @rule(key=KEYS, other_group=st.booleans(), delta=DELTAS, tag=st.integers(0, 2**32 - 1))
    def schedule(self, key, other_group, delta, tag):
        group = self.group if other_group else 0
        gk = (group, key)
        deadline = self.now + delta
        if gk not in self.scheduled and self.used() == CAPACITY:
            with pytest.raises(ArenaFull):
                self.wheel.schedule(key, deadline, group=group, tag=tag)
            return
        handle = self.wheel.schedule(key, deadline, group=group, tag=tag)
        if gk in self.handles:
            assert handle == self.handles[gk]  # a re-arm keeps its record
        self.handles[gk] = handle
        self.old_handles.append(handle)
        self.model_add(gk, deadline, tag)

    @rule(key=KEYS, other_group=st.booleans())
    def cancel(self, key, other_group):
        gk = (self.group if other_group else 0, key)
        assert self.wheel.cancel(key, group=gk[0]) is (gk in self.scheduled)
        if gk in self.scheduled:
            self.model_remove(gk)

    @precondition(lambda self: self.old_handles)
    @rule(data=st.data())
    def cancel_handle(self, data):
        handle = data.draw(st.sampled_from(self.old_handles))
        live = [gk for gk, h in self.handles.items() if h == handle]
        assert self.wheel.cancel_handle(handle) is bool(live)
        for gk in live:
            self.model_remove(gk)

    @rule(jump=JUMPS, use_expire=st.booleans())
    def advance(self, jump, use_expire):
        self.now += jump
        now = self.now
        due = self.model_due(now)
        certain = Counter(gk[1] for d, _seq, gk in due if self.last_tick(d) <= now)
        maybe = Counter(gk[1] for _d, _seq, gk in due)
        if use_expire:
            slots = self.wheel.expire(now)
            records = {s: self.wheel.fired(s) for s in slots}
            assert len(records) == len(slots)
            out = Counter()
            for s, (key, deadline, group, tag, _aux, gen) in records.items():
                assert s not in self.fired
                assert self.scheduled[(group, key)] == (deadline, tag)
                self.model_remove((group, key))
                self.fired[s] = (key, deadline, group, tag, gen)
                out[key] += 1
        else:
            result = self.wheel.advance(now)
            out = Counter(k for k, _d in result)
            for key, deadline in result:
                # advance names no group: of two groups' timers with this key and deadline, the
                # one that fired is the one the wheel no longer has pending
                matches = [gk for gk, (d, _t) in self.scheduled.items() if gk[1] == key and d == deadline]
                gk = next((gk for gk in matches if self.wheel.lookup(key, group=gk[0]) is None), matches[0])
                self.model_remove(gk)
        assert out & certain == certain, f"late: {certain - out} at {now}"
        assert out & maybe == out, f"early: {out - maybe} at {now}"
        assert self.wheel.current_ms == now
        for entry in due:  # due but not out yet (tick_ms > 1): stays in the model's heap
            if self.seq_of.get(entry[2]) == entry[1]:
                heapq.heappush(self.heap, entry)

    @rule(key=KEYS, offset=st.integers(0, 10**6), tag=st.integers(0, 2**32 - 1))
    def schedule_next_level1_bucket(self, key, offset, tag):
        """A deadline in the level-1 bucket that comes due next (what cascade_ahead moves)."""
        tick1 = self.tick_ms * self.wheel_size
        start = (self.now // tick1 + 1) * tick1
        self.schedule(key, False, start + offset % tick1 - self.now, tag)

    @rule(jump=st.one_of(st.just(0), st.integers(1, 10), st.integers(0, 300)), budget=st.integers(0, 6),
          before_due=st.booleans())
    def cascade_ahead(self, jump, budget, before_due):
        """Timers of the next level-1 bucket move to level 0 early; the clock moves
        to ``now`` only if nothing is due then. ``check()`` (the invariant) verifies
        the placement; the model's timers must not change (none fires)."""
        now = self.now + jump
        due = self.wheel.next_deadline()
        if before_due and due is not None and due > self.now:  # as the daemon does: just before a bucket
            now = min(now, due - 1)
        moved = self.wheel.cascade_ahead(now, budget)
        assert 0 <= moved <= budget
        if due is None or due > now:
            assert self.wheel.current_ms == now
            self.now = now
        else:
            assert self.wheel.current_ms == self.now
        if moved:
            assert self.levels != 1

    @precondition(lambda self: self.fired)
    @rule(data=st.data())
    def release(self, data):
        slot = data.draw(st.sampled_from(sorted(self.fired)))
        gen = self.fired[slot][4]
        assert self.wheel.release(slot, gen + 1) is False  # wrong generation: no-op
        assert self.wheel.release(slot, gen) is True
        del self.fired[slot]

    @precondition(lambda self: self.fired)
    @rule(data=st.data(), delta=DELTAS)
    def rearm_fired(self, data, delta):
        slot = data.draw(st.sampled_from(sorted(self.fired)))
        key, _deadline, group, tag, gen = self.fired[slot]
        taken = (group, key) in self.scheduled
        assert self.wheel.rearm_fired(slot, gen, self.now + delta) is (not taken)
        if not taken:
            del self.fired[slot]
            self.model_add((group, key), self.now + delta, tag)
            self.handles[(group, key)] = (slot, gen)

    def model_live(self) -> list[int]:
        live = [0] * MAX_GROUPS
        for group, _key in self.scheduled:
            live[group] += 1
        for _key, _deadline, group, _tag, _gen in self.fired.values():
            live[group] += 1
        return live

    @rule(name=NAMES)
    def register(self, name):
        known = [gid for gid, n in self.names.items() if n == name]
        live = self.model_live()
        free = [gid for gid in range(MAX_GROUPS) if gid not in self.names and not live[gid]]
        if known:
            assert self.wheel.group_id(name) == known[0]
        elif not free:
            with pytest.raises(GroupLimit):
                self.wheel.group_id(name)
        else:
            assert self.wheel.group_id(name) == free[0]  # the lowest free id
            self.names[free[0]] = name

    @rule(gid=st.integers(0, MAX_GROUPS - 1))
    def forget(self, gid):
        """Timers keep using ``self.group`` after it is forgotten (a raw id, no name)."""
        expected = gid != 0 and gid in self.names and not self.model_live()[gid]
        assert self.wheel.forget_group(gid) is expected
        if expected:
            del self.names[gid]

    @rule()
    def reattach(self):
        """The daemon restarts: unmap, map again, rebuild everything from the records."""
        self.wheel.close()
        self.wheel = None
        self.wheel = TimerWheel.attach(self.name)
        assert self.wheel.repairs == []
        assert self.wheel.current_ms == self.now

    @rule()
    def next_deadline(self):
        nd = self.wheel.next_deadline()
        if not self.scheduled:
            assert nd is None
            return
        assert nd is not None
        while self.seq_of.get(self.heap[0][2]) != self.heap[0][1]:  # drop deleted entries
            heapq.heappop(self.heap)
        earliest = self.last_tick(self.heap[0][0])
        assert nd <= max(earliest, self.now)  # a bucket comes due no later than its earliest timer

    # ------------------------------------------------------------------ invariants
    @invariant()
    def sound(self):
        if self.wheel is None:
            return
        assert self.wheel.check() == []
        assert len(self.wheel) == len(self.scheduled)
        pending = Counter((k, d, g) for k, d, g in self.wheel.pending())
        assert pending == Counter((k, d, g) for (g, k), (d, _t) in self.scheduled.items())
        assert set(self.wheel.fired_slots()) == set(self.fired)
        c = self.wheel.counters()
        assert c["pending"] == len(self.scheduled) and c["fired_unacked"] == len(self.fired)

    @invariant()
    def group_counts_and_names(self):
        if self.wheel is None:
            return
        live = self.model_live()
        assert self.wheel.group_counts().tolist() == live
        assert [self.wheel.group_live(g) for g in range(MAX_GROUPS)] == live
        assert self.wheel.groups() == self.names


SHAPES = [  # tick_ms, wheel_size, levels (None: enough levels for ~35 years)
    (1, 2, 3),
    (1, 4, 1),
    (7, 3, 1),
    (1, 3, 2),
    (1, 4, 3),
    (1, 256, None),
    (7, 2, 4),
    (7, 3, 2),
    (7, 4, 3),
    (7, 256, 2),
]

# examples per machine (make test-fast asks for fewer: WHEELD_MODEL_EXAMPLES)
EXAMPLES = int(os.environ.get("WHEELD_MODEL_EXAMPLES", "75"))
SETTINGS = settings(max_examples=EXAMPLES, stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
LONG_SETTINGS = settings(SETTINGS, max_examples=1000, stateful_step_count=100)


def _long_twin(case: type) -> type:
    """``case`` with many more examples, for ``make test-long``."""
    return pytest.mark.slow(type(f"{case.__name__}Long", (case,), {"settings": LONG_SETTINGS}))


def _machine(tick_ms: int, wheel_size: int, levels: int | None):
    cls = type(f"Wheel_t{tick_ms}_w{wheel_size}_l{levels}", (WheelMachine,),
               {"tick_ms": tick_ms, "wheel_size": wheel_size, "levels": levels})
    cls.TestCase.settings = SETTINGS
    return cls


for _shape in SHAPES:
    _cls = _machine(*_shape)
    globals()[f"Test{_cls.__name__}"] = _cls.TestCase
    globals()[f"Test{_cls.__name__}Long"] = _long_twin(_cls.TestCase)


# ----------------------------------------------------------------------------- batches
class BatchMachine(RuleBasedStateMachine):
    """The ``*_many`` batch methods on one wheel, the scalar methods item by item on
    another: results and final states must be the same (slot numbers may differ)."""

    def __init__(self) -> None:
        super().__init__()
        shape = {"tick_ms": 1, "wheel_size": 4, "levels": 3}
        self.batch = TimerWheel.create(CAPACITY, **shape)
        self.scalar = TimerWheel.create(CAPACITY, **shape)
        self.group = self.batch.group_id("other")
        assert self.scalar.group_id("other") == self.group
        self.now = 0

    @rule(items=st.lists(st.tuples(KEYS, st.booleans(), DELTAS, st.integers(0, 2**32 - 1)), max_size=12))
    def schedule_many(self, items):
        idents = [encode_ident(k) for k, _g, _d, _t in items]
        groups = np.array([self.group if g else 0 for _k, g, _d, _t in items], dtype=np.int64)
        deadlines = np.array([self.now + d for _k, _g, d, _t in items], dtype=np.int64)
        tags = np.array([t for *_x, t in items], dtype=np.int64)
        as_array = np.array(idents, dtype="S33") if len(idents) % 2 else idents  # both input forms
        slots, gens = self.batch.schedule_many(as_array, deadlines, groups, tags)
        for j, ident in enumerate(idents):
            try:
                self.scalar.schedule_ident(ident, int(deadlines[j]), int(groups[j]), int(tags[j]))
                refused = False
            except ArenaFull:
                refused = True
            assert bool(slots[j] == -1) is refused
            if not refused:
                assert self.batch.records["gen"][slots[j]] == gens[j]
                assert self.batch.records["state"][slots[j]] & 0x0F == 1  # scheduled

    @rule(items=st.lists(st.tuples(KEYS, st.booleans()), max_size=12))
    def cancel_many(self, items):
        idents = [encode_ident(k) for k, _g in items]
        groups = np.array([self.group if g else 0 for _k, g in items], dtype=np.int64)
        got = self.batch.cancel_many(idents, groups)
        expected = [self.scalar.cancel_ident(i, int(g)) for i, g in zip(idents, groups)]
        assert got.tolist() == expected

    @rule(jump=JUMPS)
    def expire_many(self, jump):
        self.now += jump
        got = self.batch.expire_many(self.now)
        expected = self.scalar.expire(self.now)
        assert Counter(self.batch.fired(int(s))[:4] for s in got) == Counter(self.scalar.fired(s)[:4] for s in expected)

    @rule(data=st.data())
    def release_many(self, data):
        fired = sorted((self.scalar.fired(s)[:4] for s in self.scalar.fired_slots()), key=repr)
        if not fired:
            return
        picks = data.draw(st.lists(st.tuples(st.sampled_from(fired), st.booleans()), max_size=8))
        for wheel, many in ((self.batch, True), (self.scalar, False)):
            by_record = {wheel.fired(s)[:4]: (s, wheel.fired(s)[5]) for s in wheel.fired_slots()}
            handles = [(by_record[r][0], by_record[r][1] + (1 if stale else 0)) for r, stale in picks]
            if many:
                got = wheel.release_many([h[0] for h in handles], [h[1] for h in handles]).tolist()
            else:
                assert got == [wheel.release(*h) for h in handles]

    @invariant()
    def same_state(self):
        assert self.batch.check() == []
        assert self.scalar.check() == []
        assert Counter(self.batch.pending()) == Counter(self.scalar.pending())
        def tags(w):
            live = (w._entry(s) for s in range(w.first_entry, w.n_records) if w.records["state"][s] & 0x0F)
            return Counter((k, g, t) for k, _d, g, t, _a, _gen in live)

        assert tags(self.batch) == tags(self.scalar)
        assert self.batch.counters() == self.scalar.counters()
        assert self.batch.group_counts().tolist() == self.scalar.group_counts().tolist()
        assert self.batch.next_deadline() == self.scalar.next_deadline()


BatchMachine.TestCase.settings = settings(SETTINGS, max_examples=EXAMPLES + 25)
TestBatchMatchesScalar = BatchMachine.TestCase
TestBatchMatchesScalarLong = _long_twin(BatchMachine.TestCase)
