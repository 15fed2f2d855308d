"""Fake-clock unit tests of the timing wheel (shm/wheel.py).

The wheel never reads a clock: these tests drive it with ``advance(now_ms)``
millisecond by millisecond (or in jumps) and check the exact tick each timer
fires on, the level it sits in between, and that refused input changes nothing.
"""

from __future__ import annotations

import math
import os
import uuid

import numpy as np
import posix_ipc
import pytest

from wheeld.protocol import arena_layout as L
from wheeld.protocol.errors import (
    ArenaFull,
    CorruptArena,
    GroupLimit,
    InvalidDelay,
    InvalidKey,
    InvalidRequest,
)
from wheeld.shm import MAX_DELAY_MS, TimerWheel
from wheeld.shm.arena import unlink
from wheeld.shm.wheel import encode_ident


def segment_name() -> str:
    return f"/wheeld-test-{os.getpid()}-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def shm_name():
    name = segment_name()
    try:
        yield name
    finally:
        unlink(name)


def fire_times(wheel: TimerWheel, until_ms: int, step_ms: int = 1) -> dict[object, int]:
    """Advance from the wheel's clock to ``until_ms``; key -> the now_ms it came out at."""
    out: dict[object, int] = {}
    now = wheel.current_ms
    while now < until_ms:
        now = min(now + step_ms, until_ms)
        for key, deadline in wheel.advance(now):
            assert key not in out, f"{key!r} fired twice"
            assert deadline <= now, f"{key!r} fired early: deadline {deadline} at {now}"
            out[key] = now
        assert wheel.check() == []
    return out


def pending_set(wheel: TimerWheel) -> set:
    return set(wheel.pending())


# ----------------------------------------------------------------------------- exact ticks
def test_tick_1_fires_exactly_at_the_deadline():
    wheel = TimerWheel.create(1000, tick_ms=1, wheel_size=8, levels=4)
    deadlines = {f"t{d}": d for d in (1, 2, 7, 8, 9, 63, 64, 65, 100, 511, 512, 513, 1000, 4095)}
    for key, d in deadlines.items():
        wheel.schedule(key, d)
    assert wheel.check() == []
    assert fire_times(wheel, 5000) == deadlines
    assert len(wheel) == 0


def test_tick_10_fires_on_the_first_tick_at_or_after_the_deadline():
    wheel = TimerWheel.create(1000, tick_ms=10, wheel_size=4, levels=3, start_ms=3)
    deadlines = {f"t{d}": d for d in range(4, 900, 7)}
    for key, d in deadlines.items():
        wheel.schedule(key, d)
    fired = fire_times(wheel, 1000)
    assert fired == {key: math.ceil(d / 10) * 10 for key, d in deadlines.items()}
    for key, d in deadlines.items():
        assert d <= fired[key] < d + 10  # never early, at most one tick late


def test_tick_10_deadline_in_the_last_tick_of_a_level_1_tick():
    """Regression: level 0 rejected ceil(d/tick) - cur//tick == wheel_size, level 1
    then put the timer in a bucket whose expiration had already passed."""
    wheel = TimerWheel.create(10, tick_ms=10, wheel_size=4, levels=3)
    wheel.schedule("a", 35)
    assert wheel.check() == []
    assert wheel.next_deadline() == 40
    assert wheel.advance(39) == []
    assert wheel.advance(40) == [("a", 35)]


def test_cascade_through_three_levels():
    # tick 1, wheel 4: levels span 4, 16, 64 and 256 ms.
    wheel = TimerWheel.create(10, tick_ms=1, wheel_size=4, levels=4)
    wheel.schedule("x", 191)
    # level 3 (tick 64): bucket 191 // 64 = 2, expiration 128
    # at 128: level 2 (tick 16): 191 // 16 = 11, expiration 176
    # at 176: level 1 (tick 4): 191 // 4 = 47, expiration 188
    # at 188: level 0: expiration 191
    expected_level = [(0, 3), (128, 2), (176, 1), (188, 0)]
    levels_seen = []
    fired_at = None
    for now in range(1, 200):
        counters = wheel.counters()
        level = next((lv for lv in range(4) if counters[f"pending_level_{lv}"]), None)
        if level is not None and (not levels_seen or levels_seen[-1][1] != level):
            levels_seen.append((now - 1, level))
        out = wheel.advance(now)
        assert wheel.check() == []
        if out:
            assert out == [("x", 191)]
            fired_at = now
    assert levels_seen == expected_level
    assert fired_at == 191
    counters = wheel.counters()
    assert counters["cascades_total"] == 3
    assert counters["expirations_total"] == 1
    assert counters["pending"] == 0


def test_cascade_with_one_jump_lands_on_the_right_level():
    wheel = TimerWheel.create(10, tick_ms=1, wheel_size=4, levels=4)
    wheel.schedule("x", 191)
    assert wheel.counters()["pending_level_3"] == 1
    assert wheel.advance(180) == []  # bucket 128 cascades straight to level 1 (176..191 relative to 180)
    c = wheel.counters()
    assert c["pending_level_0"] + c["pending_level_1"] == 1 and c["cascades_total"] == 1
    assert wheel.next_deadline() <= 191
    assert wheel.advance(190) == []
    assert wheel.advance(191) == [("x", 191)]


# ----------------------------------------------------------------------------- clamp
def test_deadline_beyond_the_top_level_is_clamped_and_fires_exactly():
    wheel = TimerWheel.create(10, tick_ms=1, wheel_size=4, levels=2)  # range: 16 ms
    wheel.schedule("far", 1000)
    wheel.schedule("farther", 123_457)
    assert wheel.counters()["pending_level_1"] == 2
    fired = fire_times(wheel, 1100)
    assert fired == {"far": 1000}
    assert wheel.lookup("farther") == 123_457


def test_clamped_deadline_with_big_jumps():
    wheel = TimerWheel.create(10, tick_ms=1, wheel_size=4, levels=2)
    wheel.schedule("far", 1000)
    for now in (1, 17, 500, 990, 999):
        assert wheel.advance(now) == []
        assert wheel.check() == []
        assert wheel.next_deadline() <= 1000
    assert wheel.advance(1000) == [("far", 1000)]
    wheel.schedule("huge", 10**12)
    assert wheel.advance(10**12 - 1) == []
    assert wheel.advance(10**12 + 5) == [("huge", 10**12)]
    assert wheel.check() == []


def test_single_level_wheel_clamps_too():
    """Regression: with levels=1, placing beyond level 0 raised NameError and check()
    judged a clamped level-0 record misplaced."""
    for tick_ms in (1, 7):
        wheel = TimerWheel.create(10, tick_ms=tick_ms, wheel_size=4, levels=1)
        wheel.schedule("far", 100)
        wheel.schedule("near", 3)
        assert wheel.check() == []
        fired = fire_times(wheel, 120)
        assert fired == {"far": math.ceil(100 / tick_ms) * tick_ms, "near": math.ceil(3 / tick_ms) * tick_ms}


# ----------------------------------------------------------------------------- next_deadline
def test_next_deadline():
    wheel = TimerWheel.create(10, tick_ms=1, wheel_size=256)
    assert wheel.next_deadline() is None
    wheel.schedule("a", 100)
    assert wheel.next_deadline() == 100
    wheel.schedule("b", 50)
    assert wheel.next_deadline() == 50
    wheel.cancel("b")
    assert wheel.next_deadline() == 100  # the emptied bucket is skipped
    wheel.schedule("c", 100_000)  # level 1 bucket: its expiration, at or before the deadline
    wheel.cancel("a")
    nd = wheel.next_deadline()
    assert nd is not None and 0 < nd <= 100_000
    assert wheel.advance(nd - 1) == []
    while (nd := wheel.next_deadline()) is not None:
        out = wheel.advance(nd)
    assert out == [("c", 100_000)]
    assert wheel.next_deadline() is None


def test_next_deadline_of_a_past_deadline_is_the_clock():
    wheel = TimerWheel.create(10, start_ms=500)
    wheel.schedule("late", 400)
    assert wheel.next_deadline() == 500
    assert wheel.advance(500) == [("late", 400)]


# ----------------------------------------------------------------------------- re-arm, cancel
def test_rearm_earlier_and_later():
    wheel = TimerWheel.create(10, tick_ms=1, wheel_size=8, levels=3)
    h1 = wheel.schedule("early", 100)
    h2 = wheel.schedule("early", 40)
    assert h1 == h2  # re-armed in place: same record, same handle
    wheel.schedule("later", 30)
    wheel.schedule("later", 300)
    assert len(wheel) == 2
    assert wheel.counters()["rearms_total"] == 2
    assert fire_times(wheel, 400) == {"early": 40, "later": 300}


def test_cancel_is_exact():
    wheel = TimerWheel.create(10, tick_ms=1, wheel_size=8, levels=3)
    wheel.schedule("a", 10)
    wheel.schedule("b", 10)
    wheel.schedule("c", 500)
    assert wheel.cancel("a") is True
    assert wheel.cancel("a") is False
    assert wheel.cancel("c") is True
    assert wheel.cancel("never") is False
    c = wheel.counters()
    assert c["cancels_total"] == 2 and c["cancel_misses_total"] == 2 and c["pending"] == 1
    assert fire_times(wheel, 1000) == {"b": 10}
    assert wheel.check() == []


def test_stale_handles_are_no_ops():
    wheel = TimerWheel.create(2)
    old = wheel.schedule("a", 10)
    assert wheel.cancel_handle(old) is True
    assert wheel.cancel_handle(old) is False
    new = wheel.schedule("b", 20)  # reuses the slot with a new generation
    assert new[0] == old[0] and new[1] != old[1]
    assert wheel.cancel_handle(old) is False
    assert wheel.lookup("b") == 20
    assert wheel.release(*old) is False
    assert wheel.rearm_fired(old[0], old[1], 50) is False
    assert wheel.cancel_handle((0, 0)) is False  # a sentinel, not an entry
    assert wheel.cancel_handle((10**6, 1)) is False
    slots = wheel.expire(20)
    assert slots == [new[0]]
    assert wheel.cancel_handle(new) is False  # fired: not cancellable by handle
    assert wheel.release(new[0], new[1] + 1) is False
    assert wheel.release(*new) is True
    assert wheel.release(*new) is False
    assert wheel.check() == []


# ----------------------------------------------------------------------------- expire path
def test_expire_fired_release_rearm_fired():
    wheel = TimerWheel.create(10, tick_ms=1, wheel_size=8, levels=3)
    g = wheel.group_id("workers")
    ha = wheel.schedule("a", 10, group=g, tag=7, aux=3)
    hb = wheel.schedule(b"b", 12, tag=8)
    wheel.schedule(3, 100)
    assert wheel.expire(9) == []
    assert set(wheel.expire(12)) == {ha[0], hb[0]}
    assert set(wheel.fired_slots()) == {ha[0], hb[0]}
    assert wheel.fired(ha[0]) == ("a", 10, g, 7, 3, ha[1])
    assert wheel.fired(hb[0]) == (b"b", 12, 0, 8, -1, hb[1])
    c = wheel.counters()
    assert c["fired_unacked"] == 2 and c["pending"] == 1 and c["expirations_total"] == 2
    assert wheel.lookup("a", group=g) is None  # a fired key is no longer scheduled
    with pytest.raises(InvalidRequest):
        wheel.fired(wheel.first_entry + 9)  # never used
    assert wheel.release(*hb) is True
    assert wheel.rearm_fired(ha[0], ha[1], 50) is True
    assert wheel.lookup("a", group=g) == 50
    assert wheel.fired_slots() == []
    c = wheel.counters()
    assert c["fired_unacked"] == 0 and c["pending"] == 2 and c["acks_total"] == 1 and c["idle_rearms_total"] == 1
    assert wheel.check() == []
    assert wheel.expire(50) == [ha[0]]
    assert wheel.fired(ha[0])[:2] == ("a", 50)
    # the key was scheduled again meanwhile: rearm_fired refuses, the old record is released
    wheel.schedule("a", 70, group=g)
    assert wheel.rearm_fired(ha[0], ha[1], 60) is False
    assert wheel.release(*ha) is True
    assert wheel.lookup("a", group=g) == 70
    assert wheel.check() == []


def test_mark_fired_writes_the_aux_of_fired_records_only_and_attach_keeps_it(shm_name):
    """The daemon notes in a fired record's aux word the client it was sent to: only FIRED
    records take it, the arena stays sound (the fired list is untouched), and attach
    (which rebuilds every link) leaves the word as it was."""
    wheel = TimerWheel.create(16, tick_ms=1, wheel_size=8, levels=3, name=shm_name, start_ms=0)
    fired_idle = wheel.schedule("idle", 5, tag=1, aux=(4 << 20) | 2)
    fired = wheel.schedule("plain", 6, tag=2)
    pending = wheel.schedule("later", 500, tag=3)
    assert sorted(wheel.expire(10)) == sorted([fired_idle[0], fired[0]])
    slots = [fired_idle[0], fired[0], pending[0], wheel.first_entry + 15, -1, 10**6]
    assert wheel.mark_fired(slots, L.recipient_aux(7)) == 2
    assert wheel.fired(fired_idle[0])[4] == wheel.fired(fired[0])[4] == L.recipient_aux(7)
    assert L.recipient_of(wheel.fired(fired[0])[4]) == 7
    assert int(wheel.records["aux"][pending[0]]) == -1, "a scheduled record is not written"
    with pytest.raises(InvalidRequest):
        wheel.mark_fired(slots, 1 << 31)
    assert wheel.check() == []
    wheel.close()
    again = TimerWheel.attach(shm_name)
    try:
        assert again.repairs == [] and again.check() == []
        assert [L.recipient_of(again.fired(s)[4]) for s in sorted(again.fired_slots())] == [7, 7]
        assert again.mark_fired([fired[0]], -1) == 1 and L.recipient_of(again.fired(fired[0])[4]) is None
        assert again.release(*fired_idle) and again.release(*fired) and again.check() == []
    finally:
        again.close()


def test_recipient_words_are_below_every_other_aux_value():
    assert L.recipient_of(-1) is None and L.recipient_of(0) is None and L.recipient_of((2046 << 20) | 5) is None
    for client_slot in (0, 1, 2046):
        aux = L.recipient_aux(client_slot)
        assert aux <= -2 and L.recipient_of(aux) == client_slot and -(1 << 31) <= aux


def test_batch_methods():
    wheel = TimerWheel.create(4, tick_ms=1, wheel_size=4, levels=3)
    idents = [encode_ident(k) for k in ("a", "b", "c", "d", "e")]
    slots, gens = wheel.schedule_many(idents, [10, 20, 300, 40, 50], tags=[1, 2, 3, 4, 5])
    assert slots[:4].tolist() == sorted(slots[:4].tolist()) and slots[4] == -1  # full: "e" refused
    assert wheel.counters()["arena_full_total"] == 1
    assert (wheel.records["gen"][slots[:4]] == gens[:4]).all()
    again, _ = wheel.schedule_many(idents[:2], [5, 25], tags=[8, 9])  # re-arms keep their records
    assert again.tolist() == slots[:2].tolist() and wheel.counters()["rearms_total"] == 2
    assert wheel.cancel_many([idents[3], encode_ident("zz")]).tolist() == [True, False]
    fired = wheel.expire_many(25)
    records = wheel.records_of(fired)
    assert sorted(zip(records["deadline"].tolist(), records["tag"].tolist())) == [(5, 8), (25, 9)]
    assert wheel.release_many(fired, records["gen"]).tolist() == [True, True]
    assert wheel.release_many(fired, records["gen"]).tolist() == [False, False]  # stale now
    assert wheel.check() == []
    assert list(wheel.pending()) == [("c", 300, 0)]


# ----------------------------------------------------------------------------- keys, groups
def test_same_key_in_two_groups_is_two_timers():
    wheel = TimerWheel.create(10)
    g1 = wheel.group_id("one")
    g2 = wheel.group_id("two")
    assert g1 != g2 and wheel.group_id("one") == g1
    assert wheel.groups() == {0: "default", g1: "one", g2: "two"}
    assert wheel.group_name(g2) == "two"
    wheel.schedule("k", 10, group=g1)
    wheel.schedule("k", 20, group=g2)
    assert len(wheel) == 2
    assert wheel.lookup("k", group=g1) == 10 and wheel.lookup("k", group=g2) == 20
    assert wheel.lookup("k") is None
    assert wheel.cancel("k", group=g2) is True
    assert wheel.lookup("k", group=g1) == 10
    assert wheel.check() == []


def test_str_bytes_and_int_keys_are_distinct():
    wheel = TimerWheel.create(10)
    wheel.schedule("17", 5)
    wheel.schedule(b"17", 6)
    wheel.schedule(17, 7)
    wheel.schedule(-1, 8)
    wheel.schedule("k" * 32, 9)  # the longest key
    assert len(wheel) == 5
    assert sorted(wheel.advance(10), key=lambda kd: kd[1]) == [("17", 5), (b"17", 6), (17, 7), (-1, 8), ("k" * 32, 9)]


KEYS_OF_EVERY_KIND = [
    "a", "é" * 16, "ключ-17", "k" * 32,  # str: 1-byte to 32-byte UTF-8
    b"\x00", b"a\x00\x00", b"\xff" * 32,  # bytes, with zero bytes the record's padding must not eat
    0, 1, -1, 255, 256, -(1 << 63), (1 << 63) - 1, 0x0102030405060708,  # int: 8 bytes little-endian, signed
]


def test_every_kind_of_key_comes_back_as_it_went_in():
    """advance and fired (the compiled build reads keys straight from the record bytes)
    give back the very key scheduled, of its type."""
    wheel = TimerWheel.create(2 * len(KEYS_OF_EVERY_KIND))
    for n, key in enumerate(KEYS_OF_EVERY_KIND):
        wheel.schedule(key, 10 + n)
    out = wheel.advance(10 + len(KEYS_OF_EVERY_KIND))
    assert [(type(k), k) for k, _ in sorted(out, key=lambda kd: kd[1])] == [(type(k), k) for k in KEYS_OF_EVERY_KIND]
    for n, key in enumerate(KEYS_OF_EVERY_KIND):
        wheel.schedule(key, 100 + n)
    slots = wheel.expire(100 + len(KEYS_OF_EVERY_KIND))
    fired = sorted((wheel.fired(s) for s in slots), key=lambda f: f[1])
    assert [(type(f[0]), f[0]) for f in fired] == [(type(k), k) for k in KEYS_OF_EVERY_KIND]
    assert wheel.check() == []


def test_record_rows_are_the_rows_of_records_of():
    """record_rows (read from the arena; compiled, in C) equals records_of(...).tolist() for
    scheduled, fired and free records, and refuses a slot outside the arena."""
    wheel = TimerWheel.create(2 * len(KEYS_OF_EVERY_KIND))
    for n, key in enumerate(KEYS_OF_EVERY_KIND):
        wheel.schedule(key, 10 + 3 * n, tag=n, aux=n - 2 if n % 2 else -1)
    fired = wheel.expire(10 + len(KEYS_OF_EVERY_KIND))
    everything = list(range(wheel.n_records))
    assert fired and wheel.record_rows(fired) == wheel.records_of(fired).tolist()
    assert wheel.record_rows(everything) == wheel.records_of(everything).tolist()
    assert wheel.record_rows(np.array(fired[::-1])) == wheel.records_of(fired[::-1]).tolist()
    assert wheel.record_rows([]) == []
    for bad in (-1, wheel.n_records):
        with pytest.raises(InvalidRequest):
            wheel.record_rows([bad])


# ----------------------------------------------------------------------------- bad input
def snapshot(wheel: TimerWheel) -> tuple[bytes, set, list]:
    return bytes(wheel._seg.buf), pending_set(wheel), wheel.group_counts().tolist()


@pytest.mark.parametrize(
    "call, exc",
    [
        (lambda w: w.schedule("k", 1.5), InvalidDelay),
        (lambda w: w.schedule("k", "10"), InvalidDelay),
        (lambda w: w.schedule("k", None), InvalidDelay),
        (lambda w: w.schedule("k", True), InvalidDelay),
        (lambda w: w.schedule("k", MAX_DELAY_MS + 1000), InvalidDelay),
        (lambda w: w.schedule("k", -(1 << 62)), InvalidDelay),
        (lambda w: w.schedule("a", 1.5), InvalidDelay),  # a re-arm of an existing key
        (lambda w: w.schedule("", 10), InvalidKey),
        (lambda w: w.schedule(b"", 10), InvalidKey),
        (lambda w: w.schedule("x" * 33, 10), InvalidKey),
        (lambda w: w.schedule("é" * 17, 10), InvalidKey),  # 34 bytes encoded
        (lambda w: w.schedule(1 << 64, 10), InvalidKey),
        (lambda w: w.schedule(1.5, 10), InvalidKey),
        (lambda w: w.schedule(None, 10), InvalidKey),
        (lambda w: w.schedule(("a",), 10), InvalidKey),
        (lambda w: w.schedule("k", 10, group=5000), InvalidRequest),
        (lambda w: w.schedule("k", 10, tag=-1), InvalidRequest),
        (lambda w: w.schedule("k", 10, aux=1 << 40), InvalidRequest),
        (lambda w: w.cancel(""), InvalidKey),
        (lambda w: w.rearm_fired(w.first_entry, 1, 2.5), InvalidDelay),
        (lambda w: w.schedule_many([encode_ident("k")], [1.5]), InvalidDelay),
        (lambda w: w.schedule_many([encode_ident("k")], [1 << 70]), InvalidDelay),
        (lambda w: w.schedule_many([encode_ident("k"), encode_ident("a")], [10, MAX_DELAY_MS + 10]), InvalidDelay),
        (lambda w: w.schedule_many([encode_ident("k")], [10, 11]), InvalidDelay),
        (lambda w: w.schedule_many([b"\x00" * 33], [10]), InvalidKey),  # meta says length 0
        (lambda w: w.schedule_many([b"short"], [10]), InvalidKey),
        (lambda w: w.schedule_many(["k"], [10]), InvalidKey),
        (lambda w: w.schedule_many(np.zeros(1, dtype="V32"), [10]), InvalidKey),
        (lambda w: w.schedule_many([encode_ident("k")], [10], groups=[5000]), InvalidRequest),
        (lambda w: w.schedule_many([encode_ident("k")], [10], tags=[-1]), InvalidRequest),
        (lambda w: w.cancel_many([encode_ident("a")], groups=[-1]), InvalidRequest),
        (lambda w: w.release_many([1, 2], [1, 2, 3]), InvalidRequest),
        (lambda w: w.expire_many(1.5), InvalidDelay),
        (lambda w: w.group_id(""), InvalidRequest),
        (lambda w: w.group_id("x" * 32), InvalidRequest),
        (lambda w: w.group_id("a\0"), InvalidRequest),  # stored zero padded: it could never be found again
        (lambda w: w.group_id(b"bytes"), InvalidRequest),
        (lambda w: w.forget_group(5000), InvalidRequest),
        (lambda w: w.forget_group(-1), InvalidRequest),
        (lambda w: w.group_live(1024), InvalidRequest),
    ],
)
def test_bad_input_raises_and_changes_nothing(call, exc):
    wheel = TimerWheel.create(10, tick_ms=1, wheel_size=4, levels=3)
    wheel.schedule("a", 5)
    wheel.schedule("b", 500)
    before = snapshot(wheel)
    with pytest.raises(exc):
        call(wheel)
    assert wheel.check() == []
    assert snapshot(wheel) == before


def test_full_arena_raises_and_changes_nothing():
    wheel = TimerWheel.create(3, tick_ms=1, wheel_size=4, levels=3)
    for key in "abc":
        wheel.schedule(key, 100)
    before = snapshot(wheel)
    with pytest.raises(ArenaFull):
        wheel.schedule("d", 100)
    assert wheel.check() == []
    assert snapshot(wheel) == before
    assert wheel.counters()["arena_full_total"] == 1
    wheel.schedule("a", 50)  # a re-arm needs no record: allowed when full
    assert wheel.cancel("b")
    wheel.schedule("d", 60)
    assert wheel.check() == []
    assert fire_times(wheel, 200) == {"a": 50, "d": 60, "c": 100}


def test_fired_records_count_against_capacity():
    wheel = TimerWheel.create(2)
    wheel.schedule("a", 1)
    wheel.schedule("b", 1)
    fired = wheel.expire(1)
    with pytest.raises(ArenaFull):
        wheel.schedule("c", 5)
    wheel.release(fired[0], wheel.fired(fired[0])[5])
    wheel.schedule("c", 5)
    assert wheel.check() == []


def test_create_rejects_bad_parameters():
    for kwargs in ({"capacity": 0}, {"capacity": 10, "tick_ms": 0}, {"capacity": 10, "wheel_size": 1},
                   {"capacity": 10, "levels": 0}, {"capacity": 10, "levels": 16}, {"capacity": 10, "tick_ms": 1.5}):
        with pytest.raises(InvalidRequest):
            TimerWheel.create(**kwargs)


# ----------------------------------------------------------------------------- named arenas
def test_named_arena_survives_close_and_attach(shm_name):
    wheel = TimerWheel.create(100, tick_ms=1, wheel_size=4, levels=3, name=shm_name, start_ms=1000)
    g = wheel.group_id("g")
    for i in range(30):
        wheel.schedule(f"k{i}", 1000 + 7 * i, group=i % 2 and g, tag=i)
    wheel.cancel("k3")
    wheel.schedule("k4", 5000)
    fired = wheel.expire(1030)
    before_pending = pending_set(wheel)
    before_fired = {s: wheel.fired(s) for s in fired}
    before_counters = wheel.counters()
    wheel.close()
    wheel.close()  # idempotent

    again = TimerWheel.attach(shm_name)
    try:
        assert again.repairs == []
        assert again.check() == []
        assert again.current_ms == 1030
        assert (again.capacity, again.tick_ms, again.wheel_size, again.levels) == (100, 1, 4, 3)
        assert pending_set(again) == before_pending
        assert {s: again.fired(s) for s in again.fired_slots()} == before_fired
        assert again.group_id("g", create=False) == g
        c = again.counters()
        for name in ("pending", "fired_unacked", "adds_total", "rearms_total", "cancels_total", "expirations_total"):
            assert c[name] == before_counters[name], name
        out = fire_times(again, 6000)
        assert out == {key: d for key, d, _g in before_pending}
    finally:
        again.close()


def test_attach_of_something_that_is_not_an_arena_raises_corrupt(shm_name):
    shm = posix_ipc.SharedMemory(shm_name, posix_ipc.O_CREX, size=8192)
    try:
        os.write(shm.fd, os.urandom(8192))
    finally:
        shm.close_fd()
    with pytest.raises(CorruptArena):
        TimerWheel.attach(shm_name)


def test_attach_of_an_empty_or_short_segment_raises_corrupt(shm_name):
    shm = posix_ipc.SharedMemory(shm_name, posix_ipc.O_CREX, size=0)
    shm.close_fd()
    with pytest.raises(CorruptArena):
        TimerWheel.attach(shm_name)


def test_attach_of_a_truncated_arena_raises_corrupt(shm_name):
    wheel = TimerWheel.create(1000, name=shm_name)
    head = bytes(wheel._seg.buf[:4096])
    wheel.close()
    unlink(shm_name)
    shm = posix_ipc.SharedMemory(shm_name, posix_ipc.O_CREX, size=4096)
    try:
        os.write(shm.fd, head)
    finally:
        shm.close_fd()
    with pytest.raises(CorruptArena):
        TimerWheel.attach(shm_name)


def test_attach_of_a_missing_segment():
    with pytest.raises(FileNotFoundError):
        TimerWheel.attach(segment_name())


# ----------------------------------------------------------------------------- key index
@pytest.mark.parametrize("batch", [False, True])
def test_key_index_churn_leaves_no_tombstones(batch):
    """Many add/cancel cycles on a small capacity: deletions move keys back, so the
    table holds exactly the scheduled keys and every one is still found."""
    wheel = TimerWheel.create(8, tick_ms=1, wheel_size=4, levels=2)
    table_cells = len(wheel._index.table)
    live: dict[str, int] = {}
    for i in range(0, 5000, 4):
        keys = [f"key-{j}" for j in range(i, i + 4)]
        if batch:
            wheel.schedule_many([encode_ident(k) for k in keys], [10 + j % 50 for j in range(i, i + 4)])
        else:
            for j, key in zip(range(i, i + 4), keys):
                wheel.schedule(key, 10 + j % 50)
        live.update((key, 10 + j % 50) for j, key in zip(range(i, i + 4), keys))
        victims = list(live)[:4] if len(live) == 8 else []
        if batch:
            assert wheel.cancel_many([encode_ident(k) for k in victims]).all()
        else:
            assert all(wheel.cancel(k) for k in victims)
        for key in victims:
            del live[key]
        assert np.count_nonzero(wheel._index.table >= 0) == len(live) == wheel._index.used
        if i % 400 == 0:
            assert wheel.check() == []
    assert len(wheel._index.table) == table_cells
    assert wheel.check() == []
    for key, d in live.items():
        assert wheel.lookup(key) == d
    assert wheel.lookup("key-0") is None
    assert len(wheel) == len(live)


@pytest.mark.parametrize("batch", [False, True])
def test_key_index_long_cluster_deletions(batch):
    """Keys whose hashes all start probing in the same 4 cells form one long cluster;
    deleting from its front must keep every later key reachable (scalar: moving keys
    back; batch: inserting the rest of the cluster again, walking past the window)."""
    wheel = TimerWheel.create(64, tick_ms=1, wheel_size=4, levels=2)
    crowd = [i for i in range(200_000) if (hash(encode_ident(i)) ^ wheel._index.gmix[0]) & wheel._index.mask < 4][:30]
    assert len(crowd) == 30
    for n, key in enumerate(crowd):
        wheel.schedule(key, 100 + n)
    gone = crowd[:3] + crowd[10:12]
    if batch:
        assert wheel.cancel_many([encode_ident(k) for k in gone]).all()
    else:
        assert all(wheel.cancel(k) for k in gone)
    assert wheel.check() == []
    for n, key in enumerate(crowd):
        assert wheel.lookup(key) == (None if key in gone else 100 + n)
    expired = dict(wheel.advance(1000))
    assert expired == {key: 100 + n for n, key in enumerate(crowd) if key not in gone}
    assert wheel.check() == [] and wheel._index.used == 0


def test_key_index_under_collisions_of_many_keys():
    wheel = TimerWheel.create(2000, tick_ms=1, wheel_size=16, levels=3)
    keys = [i for i in range(1500)] + [str(i) for i in range(250)] + [str(i).encode() for i in range(250)]
    for n, key in enumerate(keys):
        wheel.schedule(key, 1 + n)
    for key in keys[::3]:
        assert wheel.cancel(key)
    assert wheel.check() == []
    for n, key in enumerate(keys):
        assert wheel.lookup(key) == (None if n % 3 == 0 else 1 + n)


@pytest.mark.parametrize("seed", range(6))
def test_key_index_batch_deletions_across_the_table_end(seed):
    """Clusters that wrap past the last cell of the table, several freed cells per
    cluster, keys of one cluster with homes on both sides of a freed cell: batches of
    cancels and of expirations (whole level-0 buckets) must leave every remaining key
    reachable and the table holding exactly the scheduled keys."""
    rng = np.random.default_rng(seed)
    wheel = TimerWheel.create(64, tick_ms=1, wheel_size=8, levels=3)
    mask = wheel._index.mask
    homes = {i: (hash(encode_ident(i)) ^ wheel._index.gmix[0]) & mask for i in range(400_000)}
    crowd = [i for i, h in homes.items() if h >= mask - 3 or h < 2][:40]
    others = [f"o{i}" for i in range(20)]
    assert len(crowd) == 40
    live: dict[object, int] = {}
    for round_number in range(25):
        now = wheel.current_ms
        absent = [k for k in crowd + others if k not in live]
        add = [absent[j] for j in rng.permutation(len(absent))[: 64 - len(live)]]
        deadlines = [now + 1 + int(rng.integers(0, 3)) for _ in add]  # a few full level-0 buckets
        slots, _gens = wheel.schedule_many([encode_ident(k) for k in add], deadlines)
        assert (slots >= 0).all()
        live.update(zip(add, deadlines))
        victims = [k for k in live if rng.random() < 0.4]
        assert wheel.cancel_many([encode_ident(k) for k in victims]).all()
        for key in victims:
            del live[key]
        assert wheel.check() == [], round_number
        until = now + int(rng.integers(1, 4))
        fired = wheel.expire_many(until)
        records = wheel.records_of(fired)
        due = {k for k, d in live.items() if d <= until}
        assert sorted(records["deadline"].tolist()) == sorted(live[k] for k in due)
        assert wheel.release_many(fired, records["gen"]).all()
        for key in due:
            del live[key]
        assert wheel.check() == [], round_number
        assert np.count_nonzero(wheel._index.table >= 0) == len(live) == wheel._index.used
        for key in crowd + others:
            assert wheel.lookup(key) == live.get(key)


def test_generations_wrap_within_31_bits_so_handles_fit_the_wire():
    """The ACK record's aux1 and an Expiry's generation are signed 32-bit; the free list
    reuses the hottest slot first, so generations must wrap before 2**31 (scalar and batch)."""
    from wheeld.protocol import commands as C
    from wheeld.protocol import messages as M
    from wheeld.shm import encode_ident

    wheel = TimerWheel.create(8, tick_ms=1, wheel_size=16)
    try:
        wheel.records["gen"][:] = (1 << 31) - 1  # every slot at the last signed 32-bit generation
        slot, gen = wheel.schedule("scalar", 5)
        assert gen == 0
        slots, gens = wheel.schedule_many([encode_ident("batch")], [5], 0, [1], [-1])
        assert int(gens[0]) == 0
        for s_, g_ in ((slot, gen), (int(slots[0]), int(gens[0]))):
            C.encode_command(C.ACK, b"", 0, 0, 1, s_, g_)  # fits the ring record
            body = M.encode_daemon_message(M.Expirations([M.Expiry.for_key("k", 5, 5, 1, s_, g_)]))
            assert M.decode_daemon_message(body).items[0].generation == g_  # and the notification
        assert wheel.check() == []
    finally:
        wheel.close()


# ----------------------------------------------------------------------------- cascade ahead
def test_cascade_ahead_moves_the_next_level_1_bucket_early_and_fires_exactly():
    """Timers of the next level-1 bucket reach level 0 before its boundary, in slices of
    at most the budget, and still fire exactly at their deadlines (tick 1)."""
    wheel = TimerWheel.create(2000, tick_ms=1, wheel_size=16, levels=3, start_ms=0)
    rng = np.random.default_rng(5)
    deadlines = {f"t{n}": int(d) for n, d in enumerate(rng.integers(1, 200, 600))}
    for key, d in deadlines.items():
        wheel.schedule(key, d)
    fired: dict[object, int] = {}
    boundary_cascades = 0
    for now in range(1, 201):
        before = wheel.counters()["cascades_total"]
        for s in wheel.expire_many(now).tolist():
            key, d = wheel.fired(s)[:2]
            fired[key] = now
            assert d == now  # neither early nor late
            wheel.release(s, wheel.fired(s)[5])
        boundary_cascades += wheel.counters()["cascades_total"] - before
        level1 = wheel._pending_by_level[1]
        moved = wheel.cascade_ahead(now, 7)
        assert 0 <= moved <= 7
        assert wheel._pending_by_level[1] == level1 - moved
        assert wheel.check() == []
    assert fired == deadlines
    assert wheel.counters()["cascades_total"] > 500
    assert boundary_cascades < 100  # most moved ahead of their boundary, not at it


def test_cascade_ahead_never_moves_what_level_0_does_not_reach():
    wheel = TimerWheel.create(64, tick_ms=1, wheel_size=4, levels=3, start_ms=1001)
    for n, d in enumerate((1008, 1011, 1009, 1010)):  # level-1 bucket [1008, 1012)
        wheel.schedule(f"a{n}", d)
    assert wheel._pending_by_level[1] == 4
    assert wheel.cascade_ahead(1003, 10) == 0  # the clock moved: level 0 reaches 1007
    assert wheel.current_ms == 1003
    assert wheel.cascade_ahead(1004, 1) == 1  # 1008; budget 1
    assert wheel.cascade_ahead(1004, 10) == 0  # 1011, 1009 (only 1008 reachable), 1010
    assert wheel.cascade_ahead(1004, 10) == 0  # pass ended, clock unchanged: nothing looked at
    # the pass began at 1004 with 4 ms left to 1008: the next begins once 2 of them passed
    assert wheel.cascade_ahead(1005, 10) == 0  # (1009 would fit now)
    assert wheel.check() == [] and [wheel._pending_by_level[0], wheel._pending_by_level[1]] == [1, 3]
    wheel.cancel("a1")  # 1011, still in level 1
    assert wheel.cascade_ahead(1006, 1) == 1  # a new pass: 1009
    assert wheel.check() == [] and [wheel._pending_by_level[0], wheel._pending_by_level[1]] == [2, 1]
    wheel.cancel("a2")  # 1009, moved
    assert wheel.cascade_ahead(1006, 10) == 1  # the same pass goes on: 1010
    assert wheel.check() == [] and [wheel._pending_by_level[0], wheel._pending_by_level[1]] == [2, 0]
    assert [k for k, _d in wheel.advance(1008)] == ["a0"]
    assert [k for k, _d in wheel.advance(1010)] == ["a3"]
    assert len(wheel) == 0 and wheel.check() == []


def test_cascade_ahead_leaves_due_buckets_and_the_clock_to_expire():
    wheel = TimerWheel.create(64, tick_ms=1, wheel_size=4, levels=3, start_ms=1000)
    wheel.schedule("due", 1002)
    wheel.schedule("later", 1009)
    assert wheel.cascade_ahead(1003, 10) == 0  # "due" is due at 1003: nothing moves, nor the clock
    assert wheel.current_ms == 1000 and wheel.check() == []
    with pytest.raises(InvalidRequest):
        wheel.cascade_ahead(1001, -1)
    with pytest.raises(InvalidDelay):
        wheel.cascade_ahead(1001.0, 1)


# ----------------------------------------------------------------------------- group live counts
def recount(wheel: TimerWheel) -> list[int]:
    """Live (scheduled or fired) records per group id, counted from the records."""
    rec = wheel.records[wheel.first_entry :]
    live = (rec["state"] & 0x0F) != 0
    return np.bincount(rec["group"][live], minlength=wheel.max_groups).tolist()


class Counts:
    """Expected live counts per group; ``see`` compares them with the wheel after a call."""

    def __init__(self, wheel: TimerWheel) -> None:
        self.wheel = wheel
        self.expected = [0] * wheel.max_groups

    def see(self, **changes) -> None:
        for gid, delta in changes.items():
            self.expected[int(gid[1:])] += delta
        wheel = self.wheel
        assert wheel.group_counts().tolist() == self.expected
        assert [wheel.group_live(g) for g in range(wheel.max_groups)] == self.expected
        assert recount(wheel) == self.expected
        assert wheel.check() == []


def test_group_live_counts_on_every_scalar_path():
    wheel = TimerWheel.create(5, tick_ms=1, wheel_size=4, levels=3, max_groups=4)
    a, b = wheel.group_id("a"), wheel.group_id("b")
    assert (a, b) == (1, 2)
    counts = Counts(wheel)
    counts.see()
    h1 = wheel.schedule("k1", 10, group=a)
    counts.see(g1=+1)
    assert wheel.schedule("k1", 30, group=a) == h1  # a re-arm: no new record
    counts.see()
    wheel.schedule("k1", 11, group=b)  # the same key in another group: a new record
    counts.see(g2=+1)
    h2 = wheel.schedule("k2", 400, group=b)
    wheel.schedule("k3", 12)
    wheel.schedule("k4", 2000, group=a)
    counts.see(g0=+1, g1=+1, g2=+1)
    with pytest.raises(ArenaFull):  # 5 records in use
        wheel.schedule("k5", 10, group=a)
    counts.see()
    assert wheel.cancel("k4", group=a) is True
    counts.see(g1=-1)
    assert wheel.cancel("k4", group=a) is False  # a miss
    assert wheel.cancel("k2", group=a) is False  # k2 is b's
    counts.see()
    assert wheel.cancel_handle(h2) is True
    counts.see(g2=-1)
    assert wheel.cancel_handle(h2) is False  # stale
    counts.see()
    fired = wheel.expire(12)  # k1 of b and k3 fire: fired records stay live until released
    assert len(fired) == 2
    counts.see()
    wheel.cascade_ahead(13, 10)
    counts.see()
    by_key = {(wheel.fired(s)[0], wheel.fired(s)[2]): (s, wheel.fired(s)[5]) for s in fired}
    s_b, gen_b = by_key[("k1", b)]
    assert wheel.rearm_fired(s_b, gen_b, 500) is True  # fired -> scheduled: still live
    counts.see()
    s_0, gen_0 = by_key[("k3", 0)]
    wheel.schedule("k3", 600)  # the key is armed again meanwhile: a new record
    counts.see(g0=+1)
    assert wheel.rearm_fired(s_0, gen_0, 700) is False  # refused
    counts.see()
    assert wheel.release(s_0, gen_0 + 1) is False  # stale generation
    counts.see()
    assert wheel.release(s_0, gen_0) is True
    counts.see(g0=-1)
    assert wheel.release(s_0, gen_0) is False
    counts.see()
    with pytest.raises(InvalidDelay):
        wheel.schedule("k9", 1.5, group=a)
    counts.see()
    out = wheel.advance(650)  # k1 of a (30), k1 of b (500), k3 (600): freed by advance
    assert sorted(d for _k, d in out) == [30, 500, 600]
    counts.see(g0=-1, g1=-1, g2=-1)
    assert wheel.group_counts().tolist() == [0, 0, 0, 0] and len(wheel) == 0


def test_group_live_counts_on_every_batch_path():
    wheel = TimerWheel.create(7, tick_ms=1, wheel_size=4, levels=3, max_groups=4)
    a, b = wheel.group_id("a"), wheel.group_id("b")
    counts = Counts(wheel)
    ids = [encode_ident(f"k{n}") for n in range(10)]
    slots, _ = wheel.schedule_many(ids[:3], [10, 20, 30], groups=a)  # one group
    counts.see(g1=+3)
    slots, _ = wheel.schedule_many(ids[:5], [11, 21, 31, 41, 51], groups=[a, b, a, b, 0])  # 2 re-arms, 3 new
    assert (slots >= 0).all()
    counts.see(g0=+1, g2=+2)
    slots, _ = wheel.schedule_many(ids[5:9], [60, 61, 62, 63], groups=[b, a, a, b])  # room for one: 3 refused
    assert (slots >= 0).tolist() == [True, False, False, False]
    counts.see(g2=+1)
    before = wheel.group_counts().tolist()
    with pytest.raises(InvalidDelay):
        wheel.schedule_many(ids[6:8], [10, 1.5], groups=a)
    with pytest.raises(InvalidRequest):
        wheel.schedule_many(ids[6:8], [10, 10], groups=[a, 9])
    assert wheel.group_counts().tolist() == before
    # a key twice in a batch takes the scalar path
    got = wheel.cancel_many([ids[0], ids[0], ids[1], ids[9]], groups=[a, a, b, b])
    assert got.tolist() == [True, False, True, False]
    counts.see(g1=-1, g2=-1)
    got = wheel.cancel_many([ids[2], ids[3], ids[4], ids[0]], groups=[a, b, 0, a])  # mixed groups
    assert got.tolist() == [True, True, True, False]
    counts.see(g0=-1, g1=-1, g2=-1)
    slots, _ = wheel.schedule_many([ids[0], ids[0]], [5, 6], groups=b)  # duplicate: scalar path
    counts.see(g2=+1)
    slots, _ = wheel.schedule_many(ids[1:4], [7, 8, 100], groups=[a, b, a])  # k1 of a: a re-arm
    counts.see(g1=+1, g2=+1)
    fired = wheel.expire_many(60)  # everything but k3 (deadline 100) fires
    assert fired.size == 4
    counts.see()
    gens = wheel.records["gen"][fired]
    got = wheel.release_many(np.r_[fired[:2], fired[:1]], np.r_[gens[:2], gens[:1]])  # a slot twice: once
    assert got.tolist() == [True, True, False]
    groups_released = wheel.records["group"][fired[:2]].tolist()
    counts.see(**{f"g{g}": -groups_released.count(g) for g in set(groups_released)})
    got = wheel.release_many(fired[2:], gens[2:] + 1)  # stale
    assert not got.any()
    counts.see()
    rest = wheel.records["group"][fired[2:]].tolist()
    assert wheel.release_many(fired[2:], gens[2:]).all()
    counts.see(**{f"g{g}": -rest.count(g) for g in set(rest)})
    assert wheel.group_counts().tolist() == [0, 1, 0, 0]  # k3 of a


def test_group_live_counts_are_recounted_on_attach(shm_name):
    wheel = TimerWheel.create(50, name=shm_name, tick_ms=1, wheel_size=4, levels=3, max_groups=8)
    gids = [wheel.group_id(f"g{n}") for n in range(5)]
    for n in range(30):
        wheel.schedule(f"k{n}", 5 + n, group=gids[n % 5])
    fired = wheel.expire(20)
    wheel.release(fired[0], wheel.fired(fired[0])[5])
    expected = wheel.group_counts().tolist()
    assert expected == recount(wheel) and sum(expected) == 29
    wheel.close()
    again = TimerWheel.attach(shm_name)
    try:
        assert again.group_counts().tolist() == expected
        assert again.check() == []
        again._group_live[gids[2]] += 1  # the counts are checked against the records
        assert any(f"group {gids[2]}: live count" in p for p in again.check())
    finally:
        again.close()


def test_group_counts_is_a_copy():
    wheel = TimerWheel.create(4)
    wheel.schedule("a", 10)
    counts = wheel.group_counts()
    assert counts.dtype == np.int64 and counts.shape == (wheel.max_groups,) and counts[0] == 1
    counts[0] = 7
    assert wheel.group_live(0) == 1


# ----------------------------------------------------------------------------- group reclamation
def test_forget_group_refuses_live_groups_and_frees_idle_ones():
    wheel = TimerWheel.create(10, tick_ms=1, wheel_size=4, levels=3, max_groups=4)
    a = wheel.group_id("a")
    h = wheel.schedule("k", 10, group=a)
    assert wheel.forget_group(a) is False  # a scheduled record
    assert wheel.groups() == {0: "default", a: "a"}
    (slot,) = wheel.expire(10)
    assert wheel.forget_group(a) is False  # a fired record, not released yet
    assert wheel.release(slot, h[1]) is True
    assert wheel.forget_group(0) is False  # the default group stays
    table = bytes(wheel._seg.buf[L.GROUPS_OFFSET : L.GROUPS_OFFSET + 4 * L.GROUP_NAME_BYTES])
    assert wheel.forget_group(a) is True
    assert wheel.groups() == {0: "default"} and wheel.group_name(a) == ""
    assert bytes(wheel._seg.buf[L.GROUPS_OFFSET + a * 32 : L.GROUPS_OFFSET + a * 32 + 32]) == bytes(32)
    assert table != bytes(wheel._seg.buf[L.GROUPS_OFFSET : L.GROUPS_OFFSET + 4 * L.GROUP_NAME_BYTES])
    assert wheel.forget_group(a) is False  # already unused
    with pytest.raises(KeyError):
        wheel.group_id("a", create=False)
    assert wheel.group_id("b") == a  # the id is reused
    assert wheel.group_id("a") == 2  # the old name registers again, under the next free id
    assert wheel.groups() == {0: "default", 1: "b", 2: "a"}
    assert wheel.check() == []


def test_forget_idle_groups_keeps_live_groups_and_the_ones_asked():
    wheel = TimerWheel.create(10, max_groups=8)
    gids = [wheel.group_id(name) for name in "abcde"]
    wheel.schedule("k", 10, group=gids[1])
    assert wheel.forget_idle_groups(keep=[gids[3]]) == [gids[0], gids[2], gids[4]]
    assert wheel.groups() == {0: "default", gids[1]: "b", gids[3]: "d"}
    assert wheel.forget_idle_groups() == [gids[3]]


def test_register_and_forget_1100_fresh_names_never_hits_the_limit():
    wheel = TimerWheel.create(4)  # 1024 group ids
    assert wheel.max_groups == 1024
    seen = set()
    for n in range(1100):
        gid = wheel.group_id(f"client-{n}")
        seen.add(gid)
        wheel.schedule("conn", 100 + n, group=gid)
        assert wheel.group_live(gid) == 1 and wheel.forget_group(gid) is False
        assert wheel.cancel("conn", group=gid) is True
        assert wheel.forget_group(gid) is True
    assert seen == {1}
    assert wheel.groups() == {0: "default"} and wheel.check() == []


def test_group_limit_when_every_id_is_in_use():
    wheel = TimerWheel.create(10, max_groups=4)
    gids = [wheel.group_id(name) for name in ("a", "b", "c")]
    assert gids == [1, 2, 3]
    with pytest.raises(GroupLimit) as info:
        wheel.group_id("d")
    assert isinstance(info.value, ArenaFull)  # callers that handle ArenaFull handle it too
    assert "all 4 group ids are in use" in str(info.value) and "--max-groups" in str(info.value)
    assert wheel.group_id("b") == 2  # registered names are still found
    with pytest.raises(KeyError):
        wheel.group_id("d", create=False)  # not GroupLimit: nothing was to be registered
    assert wheel.forget_group(2) is True
    assert wheel.group_id("d") == 2
    with pytest.raises(GroupLimit):
        wheel.group_id("e")


def test_an_unnamed_id_that_live_records_carry_is_not_handed_out():
    wheel = TimerWheel.create(10, max_groups=3)
    wheel.schedule("k", 10, group=2)  # a raw id, no name registered under it
    assert wheel.group_id("a") == 1
    with pytest.raises(GroupLimit):
        wheel.group_id("b")
    wheel.cancel("k", group=2)
    assert wheel.group_id("b") == 2


def test_group_table_after_a_writer_killed_mid_register_or_forget(shm_name):
    """The first byte of a name commits: an entry with leftover bytes after it and a
    zero first byte is an unused id that no name matches; attach clears it."""
    wheel = TimerWheel.create(10, name=shm_name, max_groups=4)
    assert wheel.group_id("abc") == 1 and wheel.group_id("xyz") == 2
    buf = wheel._seg.buf
    buf[L.GROUPS_OFFSET + 32] = 0  # forget("abc") killed after its commit point
    buf[L.GROUPS_OFFSET + 96 + 1 : L.GROUPS_OFFSET + 96 + 4] = b"new"  # register("?new") killed before it
    assert wheel.groups() == {0: "default", 2: "xyz"}
    with pytest.raises(KeyError):
        wheel.group_id("abc", create=False)
    wheel.close()
    again = TimerWheel.attach(shm_name)
    try:
        assert again.repairs == [] and again.check() == []
        table = bytes(again._seg.buf[L.GROUPS_OFFSET : L.GROUPS_OFFSET + 4 * 32])
        assert table[32:64] == bytes(32) and table[96:128] == bytes(32)
        assert again.group_id("abc") == 1 and again.group_id("new") == 3
    finally:
        again.close()


def test_publish_stats_writes_only_the_wheels_own_counter_words():
    """Each counter word has one writer: the wheel never touches the daemon's words."""
    wheel = TimerWheel.create(10, start_ms=0)
    try:
        words = wheel.header_words()
        base = L.H_COUNTERS // 8
        for name in L.DAEMON_COUNTER_NAMES:
            words[base + L.COUNTER[name]] = 1000 + L.COUNTER[name]
        wheel.schedule("k", 5)
        wheel.expire(10)
        wheel.publish_stats()
        assert all(words[base + L.COUNTER[n]] == 1000 + L.COUNTER[n] for n in L.DAEMON_COUNTER_NAMES)
        published = L.read_counters(bytes(wheel._seg.buf[: L.GROUPS_OFFSET]))
        assert published["expirations_total"] == published["fired_unacked"] == 1
        assert set(L.WHEEL_COUNTER_NAMES).isdisjoint(L.DAEMON_COUNTER_NAMES)
    finally:
        wheel.close()


@pytest.mark.parametrize("levels", [1, 2, 3])
def test_publish_stats_writes_counters_and_no_other_word(levels):
    """publish_stats writes each word of counters() with its value (the per-level words
    of the wheel's levels only), and leaves every other header word as it was."""
    wheel = TimerWheel.create(64, tick_ms=1, wheel_size=4, levels=levels, start_ms=0)
    try:
        for k in range(20):
            wheel.schedule(f"k{k}", 1 + 3 * k)
        wheel.cancel("k3")
        wheel.expire(9)
        wheel.cascade_ahead(9, 8)
        words = wheel.header_words()
        marked = {j: -7 - j for j in range(L.H_COUNTERS // 8, L.GROUPS_OFFSET // 8)}
        for j, value in marked.items():
            words[j] = value
        wheel.publish_stats()
        want = dict(marked)
        want.update({L.H_COUNTERS // 8 + L.COUNTER[name]: value for name, value in wheel.counters().items()})
        assert {j: words[j] for j in marked} == want
        assert wheel.counters()["pending"] == len(wheel) == 16
    finally:
        wheel.close()


def test_store_words_writes_each_value_at_its_word():
    wheel = TimerWheel.create(10, start_ms=0)
    try:
        words = wheel.header_words()
        before = words.tolist()
        word_of = {"a": 30, "b": 24, "c": 31, "unused": 40}
        wheel.store_words(word_of, {"a": 5, "b": -(1 << 63), "c": (1 << 62) + 1})
        after = words.tolist()
        assert (after[30], after[24], after[31]) == (5, -(1 << 63), (1 << 62) + 1)
        assert [v for j, v in enumerate(after) if j not in (24, 30, 31)] == \
            [v for j, v in enumerate(before) if j not in (24, 30, 31)]
        wheel.store_words(word_of, {})
        assert words.tolist() == after
        with pytest.raises(KeyError):
            wheel.store_words(word_of, {"a": 6, "nameless": 1})
        assert words[30] == 6  # the names before the unknown one are stored
    finally:
        wheel.close()
