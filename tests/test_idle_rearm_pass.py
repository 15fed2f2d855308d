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
