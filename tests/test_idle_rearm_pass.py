"""The wheel's lazy re-arm of idle timers, in its expire pass (``TimerWheel.expire(now,
sources, rearmed)``), against a model of the rule the daemon applies one timer at a
time (``Delivery.idle_check`` over ``ClientSegment.read_activity``):

* a due idle timer (aux = client slot << TOUCH_INDEX_BITS | touch index) whose client's
  touch table holds a last touch in ``1 .. now + 1`` and an idle time in
  ``1 .. MAX_IDLE_MS`` with last touch + idle time later than ``now`` stays scheduled
  at that new deadline (its key still indexed, its tag kept), and is reported in
  ``rearmed`` as (slot, old deadline, new deadline, idle time);
* every other due timer fires, for the daemon to decide: no touch or idle word, words
  a client could not honestly have written (the daemon poisons it), a client with no
  table in reach (a source returning None, an unknown client, a table whose views
  were released when its segment closed, an index beyond it), a record whose group
  or key meta is impossible (the daemon frees it as damaged).

Both paths are held to the model: the compiled wheel and its ``.py`` source.
"""

from __future__ import annotations

from array import array

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from python_source import load

from wheeld.protocol import accel
from wheeld.protocol import arena_layout as L
from wheeld.protocol import clients_layout as CL
from wheeld.shm.ring import MAX_IDLE_MS

START_MS = 10_000
TABLE = 8  # touch indices per client
CLIENTS = 3


def _wheel_classes():
    from wheeld.shm.wheel import TimerWheel

    classes = [pytest.param(load("wheeld.shm.wheel").TimerWheel, id="python")]
    if accel.compiled("wheeld.shm.wheel"):
        classes.append(pytest.param(TimerWheel, id="compiled"))
    return classes


class _Client:
    """A client slot as the wheel sees it: its touch table's two int64 views, or None."""

    def __init__(self, touched: list[int], idle: list[int], reachable: bool, released: bool):
        self.touched, self.idle = array("q", touched), array("q", idle)
        self.reachable, self.released = reachable, released

    def touch_views(self):
        if not self.reachable:
            return None
        views = memoryview(self.touched), memoryview(self.idle)
        if self.released:  # a segment closed meanwhile: reading its views raises ValueError
            for view in views:
                view.release()
        return views


def _model(aux: int, now: int, clients: dict[int, _Client], group: int, meta_ok: bool) -> tuple[int, int] | None:
    """(new deadline, idle time) when the timer is re-armed, None when it fires."""
    if aux < 0 or group >= 2 or not meta_ok:
        return None
    client = clients.get(aux >> CL.TOUCH_INDEX_BITS)
    if client is None or not client.reachable or client.released:
        return None
    index = aux & CL.TOUCH_INDEX_MASK
    if index >= TABLE:
        return None
    touched, idle = client.touched[index], client.idle[index]
    if not (0 < touched <= now + 1) or not (0 < idle <= MAX_IDLE_MS):
        return None
    return (touched + idle, idle) if touched + idle > now else None


_WORD = st.one_of(st.integers(-3, 3), st.integers(START_MS - 50, START_MS + 400),
                  st.sampled_from([MAX_IDLE_MS, MAX_IDLE_MS + 1, -(1 << 63), (1 << 63) - 1]))
_TIMER = st.tuples(
    st.integers(1, 300),  # delay from START_MS
    st.one_of(st.just(-1), st.tuples(st.integers(0, CLIENTS + 1), st.integers(0, TABLE + 2))),  # aux
    st.integers(0, 9),  # 0: its group id overwritten out of range, 1: its key meta overwritten
)
_CLIENT = st.tuples(st.lists(_WORD, min_size=TABLE, max_size=TABLE), st.lists(_WORD, min_size=TABLE, max_size=TABLE),
                    st.booleans() | st.just(True), st.integers(0, 9))


@pytest.mark.parametrize("wheel_class", _wheel_classes())
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(timers=st.lists(_TIMER, min_size=1, max_size=40), client_specs=st.lists(_CLIENT, min_size=CLIENTS,
                                                                               max_size=CLIENTS),
       steps=st.lists(st.integers(1, 120), min_size=1, max_size=6), journal=st.booleans())
def test_the_expire_pass_rearms_what_the_daemons_rule_rearms(wheel_class, timers, client_specs, steps, journal):
    clients = {c: _Client(t, i, reachable, released == 0) for c, (t, i, reachable, released) in enumerate(client_specs)}
    wheel = wheel_class.create(len(timers) + 8, tick_ms=1, wheel_size=8, start_ms=START_MS, max_groups=2)
    try:
        expected_deadline, fired, rearm_count = {}, set(), 0
        for n, (delay, aux_spec, damage) in enumerate(timers):
            aux = -1 if aux_spec == -1 else aux_spec[0] << CL.TOUCH_INDEX_BITS | aux_spec[1]
            slot, _gen = wheel.schedule(f"k{n}", START_MS + delay, group=n % 2, tag=n, aux=aux)
            if damage == 0:
                wheel._h[slot * (L.RECORD_BYTES // 2) + L.R_GROUP // 2] = 7  # beyond max_groups
            elif damage == 1:
                wheel._b[slot * L.RECORD_BYTES + L.R_KEY_META] = 0xFF  # a meta byte encode_key never writes
            expected_deadline[slot] = (START_MS + delay, aux, n, damage)
        now = START_MS
        for step in steps:
            now += step
            rearmed = [] if journal else None
            out = wheel.expire(now, clients, rearmed)
            reported = {entry[0]: entry for entry in rearmed or []}
            due = {s: v for s, v in expected_deadline.items() if s not in fired and v[0] <= now}
            # a timer re-armed earlier in this pass may come due again only in a later call
            for slot, (deadline, aux, n, damage) in sorted(due.items()):
                decision = _model(aux, now, clients, 7 if damage == 0 else n % 2, damage != 1)
                if decision is None:
                    assert slot in out, (slot, aux, now)
                    fired.add(slot)
                else:
                    new_deadline, idle = decision
                    assert slot not in out
                    assert wheel.records["deadline"][slot] == new_deadline
                    assert wheel.records["state"][slot] & L.STATE_MASK == L.SCHEDULED
                    assert wheel.records["tag"][slot] == n
                    assert wheel.lookup(f"k{n}", n % 2) == new_deadline  # its key still indexed
                    if journal:
                        assert reported.pop(slot) == (slot, deadline, new_deadline, idle)
                    expected_deadline[slot] = (new_deadline, aux, n, damage)
                    rearm_count += 1
            assert sorted(out) == sorted(s for s in due if s in fired)
            assert not reported
        counters = wheel.counters()
        assert counters["idle_rearms_total"] == rearm_count
        assert counters["pending"] == len(timers) - len(fired)
    finally:
        wheel.close()


@pytest.mark.parametrize("wheel_class", _wheel_classes())
def test_without_sources_every_due_timer_fires(wheel_class):
    """``expire(now)`` alone (the purgatory, recovery) fires idle timers as before."""
    clients = {0: _Client([START_MS] * TABLE, [500] * TABLE, True, False)}
    wheel = wheel_class.create(16, tick_ms=1, wheel_size=8, start_ms=START_MS, max_groups=2)
    try:
        slot, _gen = wheel.schedule("idle", START_MS + 5, aux=0 << CL.TOUCH_INDEX_BITS | 3)
        assert wheel.expire(START_MS + 5) == [slot]
        other, _gen = wheel.schedule("idle2", START_MS + 10, aux=3)
        assert wheel.expire(START_MS + 10, clients) == []  # touched at START_MS, idle 500: re-armed
        assert wheel.lookup("idle2") == START_MS + 500
    finally:
        wheel.close()


_NOW = START_MS + 100


@pytest.mark.parametrize("wheel_class", _wheel_classes())
@pytest.mark.parametrize(("touched", "idle", "rearm_at"), [
    (_NOW - 10, 50, _NOW + 40),           # touched since: re-armed at last touch + idle
    (_NOW + 1, 50, _NOW + 51),            # a touch stores the clock rounded up: now + 1 is honest
    (_NOW + 2, 50, None),                 # later than that: fires (the daemon reads its clock again)
    (_NOW - 50, 50, None),                # last touch + idle == now: idle, fires
    (_NOW - 49, 50, _NOW + 1),
    (0, 50, None), (-5, 50, None),        # no touch, an impossible one
    (_NOW - 10, 0, None), (_NOW - 10, -1, None),
    (_NOW - 10, MAX_IDLE_MS, _NOW - 10 + MAX_IDLE_MS), (_NOW - 10, MAX_IDLE_MS + 1, None),
])
def test_the_edges_of_the_rule(wheel_class, touched, idle, rearm_at):
    clients = {1: _Client([0, touched], [0, idle], True, False)}
    wheel = wheel_class.create(16, tick_ms=1, wheel_size=8, start_ms=START_MS, max_groups=2)
    try:
        slot, _gen = wheel.schedule("idle", _NOW - 3, tag=9, aux=1 << CL.TOUCH_INDEX_BITS | 1)
        rearmed = []
        out = wheel.expire(_NOW, clients, rearmed)
        if rearm_at is None:
            assert (out, rearmed) == ([slot], [])
        else:
            assert (out, rearmed) == ([], [(slot, _NOW - 3, rearm_at, idle)])
            assert wheel.lookup("idle") == rearm_at
    finally:
        wheel.close()


@pytest.mark.parametrize("wheel_class", _wheel_classes())
@pytest.mark.parametrize("damage", ["group", "meta", "unreachable", "released", "unknown client", "beyond table"])
def test_what_the_pass_cannot_trust_fires(wheel_class, damage):
    clients = {1: _Client([0, _NOW - 10], [0, 50], damage != "unreachable", damage == "released")}
    wheel = wheel_class.create(16, tick_ms=1, wheel_size=8, start_ms=START_MS, max_groups=2)
    try:
        client = 2 if damage == "unknown client" else 1
        index = TABLE + 1 if damage == "beyond table" else 1
        slot, _gen = wheel.schedule("idle", _NOW - 3, aux=client << CL.TOUCH_INDEX_BITS | index)
        if damage == "group":
            wheel._h[slot * (L.RECORD_BYTES // 2) + L.R_GROUP // 2] = 7
        elif damage == "meta":
            wheel._b[slot * L.RECORD_BYTES + L.R_KEY_META] = 0xFF
        assert wheel.expire(_NOW, clients, []) == [slot]
    finally:
        wheel.close()


# touch words near the clock (offsets from it, or a few impossible values), idle times near the delays
_NEAR_TOUCH = st.one_of(st.tuples(st.integers(-70, 2), st.just(False)),
                        st.tuples(st.sampled_from([0, -5, (1 << 63) - 1]), st.just(True)))
_NEAR_CLIENT = st.tuples(st.lists(_NEAR_TOUCH, min_size=TABLE, max_size=TABLE),
                         st.lists(st.integers(-1, 80) | st.sampled_from([MAX_IDLE_MS + 1]), min_size=TABLE,
                                  max_size=TABLE),
                         st.integers(0, 9).map(bool), st.integers(0, 19))  # mostly reachable, seldom released
# timers due from now on, mostly idle ones of the clients above
_NEAR_TIMER = st.tuples(st.integers(1, 50),
                        st.just(-1) | st.tuples(st.integers(0, CLIENTS - 1), st.integers(0, TABLE - 1))
                        | st.tuples(st.integers(0, CLIENTS - 1), st.integers(0, TABLE - 1))
                        | st.tuples(st.integers(0, CLIENTS), st.integers(0, TABLE + 1)),
                        st.integers(0, 19))


def _ahead_model(aux: int, now: int, deadline: int, clients: dict[int, _Client], group: int,
                 meta_ok: bool) -> int | None:
    """The deadline a look-ahead moves a timer to, or None (it stays)."""
    decision = _model(aux, now, clients, group, meta_ok)
    if decision is None or decision[0] <= deadline:
        return None
    return decision[0]


@pytest.mark.parametrize("wheel_class", _wheel_classes())
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(timers=st.lists(_NEAR_TIMER, min_size=1, max_size=40), client_specs=st.lists(_NEAR_CLIENT, min_size=CLIENTS,
                                                                               max_size=CLIENTS),
       elapsed=st.integers(0, 200), horizon=st.integers(0, 40), budget=st.sampled_from([0, 3, 1000]))
def test_the_look_ahead_moves_only_what_its_bucket_would_move(wheel_class, timers, client_specs, elapsed, horizon,
                                                              budget):
    """``rearm_touched_ahead(now, horizon, max_entries, sources)`` moves an idle timer due in
    ``(now, now + horizon]`` (and within level 0) to last touch + idle_ms when that is later
    than its deadline, by the same rule as the expire pass; it fires nothing and moves
    nothing earlier; with a budget it looks at no more records than that."""
    now = START_MS + elapsed
    clients = {c: _Client([w if special else now + w for w, special in t], i, reachable, released == 0)
               for c, (t, i, reachable, released) in enumerate(client_specs)}
    size = 64
    wheel = wheel_class.create(len(timers) + 8, tick_ms=1, wheel_size=size, start_ms=START_MS, max_groups=2)
    try:
        wheel.expire(now)  # the clock at now (anything due by then has fired)
        live = {}
        for n, (delay, aux_spec, damage) in enumerate(timers):
            aux = -1 if aux_spec == -1 else aux_spec[0] << CL.TOUCH_INDEX_BITS | aux_spec[1]
            slot, _gen = wheel.schedule(f"k{n}", now + delay, group=n % 2, tag=n, aux=aux)
            if damage == 0:
                wheel._h[slot * (L.RECORD_BYTES // 2) + L.R_GROUP // 2] = 7
            elif damage == 1:
                wheel._b[slot * L.RECORD_BYTES + L.R_KEY_META] = 0xFF
            live[slot] = (now + delay, aux, n, damage)  # (the delay counts from now here)
        before = {slot: int(wheel.records["deadline"][slot]) for slot in live}
        rearmed = []
        moved = wheel.rearm_touched_ahead(now, horizon, budget, clients, rearmed)
        assert moved == len(rearmed) and (budget or moved == 0)
        expected = {}
        for slot, (deadline, aux, n, damage) in live.items():
            if deadline - now <= min(horizon, size - 1):
                target = _ahead_model(aux, now, deadline, clients, 7 if damage == 0 else n % 2, damage != 1)
                if target is not None:
                    expected[slot] = target
        after = {slot: int(wheel.records["deadline"][slot]) for slot in live}
        for slot, deadline in after.items():
            assert deadline in (before[slot], expected.get(slot, before[slot])), slot
            assert wheel.records["state"][slot] & L.STATE_MASK == L.SCHEDULED
        changed = {slot for slot in live if after[slot] != before[slot]}
        assert changed == {entry[0] for entry in rearmed}
        if budget >= len(timers):
            assert changed == set(expected)
        for slot, old, new, idle in rearmed:
            assert (old, new) == (before[slot], expected[slot]) and new - idle <= now + 1
            assert wheel.lookup(f"k{live[slot][2]}", live[slot][2] % 2) == new
        assert wheel.counters()["idle_rearms_total"] == moved
        if all(damage >= 2 for *_, damage in live.values()):  # (check() refuses a damaged record)
            assert wheel.check() == []
    finally:
        wheel.close()


@pytest.mark.parametrize("wheel_class", _wheel_classes())
@pytest.mark.parametrize(("delay", "touched", "idle", "horizon", "moved_to"), [
    (5, -10, 20, 10, 10),       # touched since: later than its deadline, moves
    (5, -10, 15, 10, None),     # last touch + idle == its deadline: stays (it fires then, if untouched)
    (5, -10, 16, 10, 6),
    (10, -10, 30, 10, 20),      # due at the horizon: looked at
    (11, -10, 30, 10, None),    # one past it: left for later
    (5, 2, 30, 10, None),       # a touch after the clock + 1: left for the due pass to decide
    (5, 1, 30, 10, 31),
    (5, -10, 20, 0, None),      # no horizon, nothing looked at
])
def test_the_edges_of_the_look_ahead(wheel_class, delay, touched, idle, horizon, moved_to):
    now = START_MS + 7
    clients = {0: _Client([now + touched], [idle], True, False)}
    wheel = wheel_class.create(16, tick_ms=1, wheel_size=64, start_ms=START_MS, max_groups=2)
    try:
        wheel.expire(now)
        slot, _gen = wheel.schedule("idle", now + delay, tag=3, aux=0)
        rearmed = []
        assert wheel.rearm_touched_ahead(now, horizon, 100, clients, rearmed) == (moved_to is not None)
        want = now + delay if moved_to is None else now + moved_to
        assert wheel.lookup("idle") == want
        assert rearmed == ([] if moved_to is None else [(slot, now + delay, want, idle)])
    finally:
        wheel.close()


@pytest.mark.parametrize("wheel_class", _wheel_classes())
def test_the_look_ahead_stays_within_level_0_and_its_budget(wheel_class):
    """A level-0 bucket is reused every wheel_size ticks: the look-ahead stops short of the
    one that holds the current tick's next round, and looks at max_entries records."""
    now = START_MS
    clients = {0: _Client([now] * TABLE, [500] * TABLE, True, False)}
    wheel = wheel_class.create(32, tick_ms=1, wheel_size=8, start_ms=START_MS, max_groups=2)
    try:
        slots = [wheel.schedule(f"k{d}", now + d, aux=d % TABLE)[0] for d in range(1, 9)]
        assert wheel.rearm_touched_ahead(now, 100, 3, clients) == 3  # the budget
        assert [wheel.lookup(f"k{d}") for d in range(1, 4)] == [now + 500] * 3
        assert wheel.rearm_touched_ahead(now, 100, 100, clients) == 4  # deadlines now+4 .. now+7 (level 0)
        assert wheel.lookup("k8") == now + 8  # in level 1 yet: left
        assert len(slots) == 8 and wheel.check() == []
    finally:
        wheel.close()


@pytest.mark.parametrize("wheel_class", _wheel_classes())
def test_a_walked_bucket_is_skipped_until_something_joins_it(wheel_class):
    """The look-ahead remembers a bucket it walked to its end without an idle timer in it,
    and skips it while its tail is the same record; an idle timer appended to it later
    (or into a slot freed and reused at the tail) is found by the next call."""
    now = START_MS
    clients = {0: _Client([now] * TABLE, [500] * TABLE, True, False)}
    wheel = wheel_class.create(32, tick_ms=1, wheel_size=64, start_ms=START_MS, max_groups=2)
    try:
        plain = [wheel.schedule(f"p{n}", now + 5)[0] for n in range(3)]
        assert wheel.rearm_touched_ahead(now, 10, 100, clients) == 0
        b = (now + 5) % 64  # the level-0 bucket of the deadline
        memo = list(wheel._ahead_memo[3 * b : 3 * b + 3])
        assert memo == [now + 5, plain[-1], int(wheel.records["gen"][plain[-1]])]
        wheel.schedule("idle", now + 5, aux=1)  # appended: a new tail
        assert wheel.rearm_touched_ahead(now, 10, 100, clients) == 1
        assert wheel.lookup("idle") == now + 500
        # the tail freed and its slot reused by an idle timer: a new generation
        assert wheel.rearm_touched_ahead(now, 10, 100, clients) == 0
        assert wheel.cancel(f"p{len(plain) - 1}")
        reused, gen = wheel.schedule("idle2", now + 5, aux=2)
        assert (reused, gen) == (plain[-1], memo[2] + 1)  # the same tail slot, a new generation
        assert wheel.rearm_touched_ahead(now, 10, 100, clients) == 1
        assert wheel.lookup("idle2") == now + 500
        assert wheel.check() == []
    finally:
        wheel.close()
