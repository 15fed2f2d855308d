"""The daemon's frame writer (``wheeld.daemon.frames``): in C when compiled, held here to
its Python source (the reference) and to msgspec's bytes for the same items.

Every value an arena record's fields can hold is drawn (deadline, tag, generation, key
meta and key bytes), with entries that match their record or not, on records FIRED or
not: both give the same answer (a frame and its item count, or None: "build it the
checked way"), leave the same arena bytes and the same in-flight table, in the same
order. An item the C path lets through decodes at the client.
"""

from __future__ import annotations

import collections
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from python_source import load

from wheeld.daemon import frames
from wheeld.protocol import accel
from wheeld.protocol import arena_layout as AL
from wheeld.protocol import framing
from wheeld.protocol import messages as M
from wheeld.protocol.keys import KEY_BYTES, VALID_KEY_METAS, encode_key
from wheeld.shm.wheel import TimerWheel

_SOURCE = load("wheeld.daemon.frames")
_COMPILED = accel.compiled("wheeld.daemon.frames")
_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
_RECORDS = 12


def _fired_wheel() -> tuple[TimerWheel, list[int]]:
    """A private wheel with ``_RECORDS`` FIRED records (their slots, in firing order)."""
    wheel = TimerWheel.create(64, start_ms=1000)
    for i in range(_RECORDS):
        wheel.schedule(f"k{i}", 1001 + i)
    return wheel, wheel.expire(1000 + _RECORDS + 5)


def _write(wheel, slot, fields) -> None:
    """Overwrite a record's fields as damage or any writer could leave them."""
    deadline, tag, gen, meta, raw, state = fields
    rec = wheel.records
    rec["deadline"][slot] = deadline
    rec["tag"][slot] = tag
    rec["gen"][slot] = gen
    rec["key_meta"][slot] = meta
    rec["key"][slot] = raw
    rec["state"][slot] = state


def _answer(module, wheel, taken, aux):
    """What ``expirations_frame`` of ``module`` answers, with the arena and table after it."""
    unacked = {99: 7}  # an entry already in flight stays first
    result = module.expirations_frame(wheel, list(taken), aux, unacked)
    if result is not None:
        frame, count = result
        result = (None if frame is None else bytes(frame), count)
    return result, wheel.records.tobytes(), list(unacked.items())


_ASCII = st.binary(min_size=KEY_BYTES, max_size=KEY_BYTES).map(lambda raw: bytes(b & 0x7F for b in raw))
_VALID_METAS = [meta for meta in range(256) if VALID_KEY_METAS[meta]]
_STATES = st.sampled_from([AL.FIRED, AL.FIRED, AL.FIRED, AL.SCHEDULED, AL.FREE])
# any value a record's fields can hold (deadline, tag, generation, meta, key, state) ...
_ANY = st.tuples(st.integers(-(2**63), 2**63 - 1), st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1),
                 st.integers(0, 255), st.binary(min_size=KEY_BYTES, max_size=KEY_BYTES), _STATES)
# ... or, nine times in ten, those of a record a client wrote: so that most draws make a frame
_USUAL = st.tuples(st.integers(-(2**63), 2**63 - 1), st.integers(0, 2**32 - 1), st.integers(0, 2**31 - 1),
                   st.sampled_from(_VALID_METAS), _ASCII, _STATES)
_FIELDS = st.integers(0, 9).flatmap(lambda k: _ANY if k == 0 else _USUAL)


@pytest.mark.skipif(not _COMPILED, reason="the C frame writer exists in the compiled build only")
@settings(max_examples=700, **_SETTINGS)
@given(fields=st.lists(_FIELDS, min_size=_RECORDS, max_size=_RECORDS), data=st.data(),
       aux=st.integers(-(2**31), 2**31 - 1))
def test_the_c_frame_writer_answers_as_its_python_source_over_every_record_value(fields, data, aux):
    wheel, slots = _fired_wheel()
    for slot, f in zip(slots, fields):
        _write(wheel, slot, f)
    picks = data.draw(st.lists(st.sampled_from(range(_RECORDS)), min_size=1, max_size=2 * _RECORDS))
    taken = []
    for j in picks:
        gen = fields[j][2] if data.draw(st.integers(0, 3)) else data.draw(st.integers(0, 2**32 - 1))
        fired = data.draw(st.integers(-(2**63), 2**63 - 1) | st.integers(0, 2000))
        taken.append((slots[j], gen, fired, data.draw(st.booleans())))
    before = wheel.records.tobytes()
    reference = _answer(_SOURCE, wheel, taken, aux)
    wheel.records.view(np.uint8)[:] = np.frombuffer(before, dtype=np.uint8)
    compiled = _answer(frames, wheel, taken, aux)
    assert compiled == reference
    result = compiled[0]
    if result is not None and result[0] is not None:
        # the bytes msgspec writes, and a frame its client takes whole
        frame, count = result
        body = frame[framing.HEADER_SIZE:]
        assert int.from_bytes(frame[:framing.HEADER_SIZE], "little") == len(body)
        assert M.expirations_frame_problem(frame) is None
        assert len(M.decode_daemon_body(body).items) == count
    _SEEN["none" if result is None else "empty" if result[0] is None else "frame"] += 1


_SEEN = collections.Counter()  # what the draws made: "frame", "empty" (no entry still FIRED) or "none"


@pytest.mark.skipif(not _COMPILED, reason="the C frame writer exists in the compiled build only")
def test_the_draws_above_made_frames():
    """The property above is not vacuous: in a run of it, a third of the draws or more
    made a frame (the others: no entry still FIRED, or an item for the checked path)."""
    _SEEN.clear()
    test_the_c_frame_writer_answers_as_its_python_source_over_every_record_value()
    assert _SEEN["frame"] >= sum(_SEEN.values()) / 3, _SEEN


def test_a_frame_of_usual_records_is_msgspecs_and_marks_each_record_for_its_client():
    """The common case on either path: the frame encode_expirations_frame writes for the
    records' items, each record's aux word naming the client, the in-flight table in
    item order; an entry acknowledged since it was queued (generation moved) is left out."""
    wheel, slots = _fired_wheel()
    rng = random.Random(3)
    keys = ["conn-1", 2**40, b"\x00\xff", "x" * 32, -5, "ascii"]
    for j, key in enumerate(keys):
        kb, meta = encode_key(key)
        rec = wheel.records
        rec["key_meta"][slots[j]] = meta
        rec["key"][slots[j]] = kb.ljust(KEY_BYTES, b"\0")
        rec["tag"][slots[j]] = rng.choice((0, 127, 128, 65535, 65536, 2**32 - 1))
        rec["deadline"][slots[j]] = rng.choice((-(2**63), -33, -32, -1, 0, 2**31, 2**63 - 1))
    rec = wheel.records
    taken = [(s, int(rec["gen"][s]), 1000 + j, j % 2 == 0) for j, s in enumerate(slots[: len(keys)])]
    taken[2] = (taken[2][0], taken[2][1] + 1, taken[2][2], taken[2][3])  # acknowledged and used again
    aux = AL.recipient_aux(5)
    unacked = {}
    frame, count = frames.expirations_frame(wheel, taken, aux, unacked)
    kept = [e for j, e in enumerate(taken) if j != 2]
    items = []
    for s, gen, fired_ms, late in kept:
        meta = int(rec["key_meta"][s])
        items.append((bytes(rec["key"][s])[: meta & 0x3F], meta, int(rec["deadline"][s]), fired_ms,
                      int(rec["tag"][s]), s, gen, late))
    assert bytes(frame) == bytes(M.encode_expirations_frame(items))
    assert count == len(kept)
    assert list(unacked.items()) == [(s, gen) for s, gen, _f, _l in kept]
    assert [int(rec["aux"][s]) for s, *_ in kept] == [aux] * len(kept)
    assert int(rec["aux"][taken[2][0]]) != aux


def test_entries_the_c_writer_does_not_take_leave_everything_as_it_was():
    """An item the client might refuse (a generation beyond 31 bits, a meta byte no key
    has, a non-ASCII str key) is None on either path; so, compiled, is an entry of another
    shape (a late flag that is not a bool, a slot beyond the arena): the caller builds
    such a frame the checked way. Nothing is marked and nothing is in flight then."""
    wheel, slots = _fired_wheel()
    rec = wheel.records
    s = slots[0]
    good = (s, int(rec["gen"][s]), 1000, False)
    cases = []
    rec["gen"][slots[1]] = 2**31
    cases.append([good, (slots[1], 2**31, 1000, False)])
    rec["key_meta"][slots[2]] = 0xFF
    cases.append([good, (slots[2], int(rec["gen"][slots[2]]), 1000, False)])
    kb, meta = encode_key("é")
    rec["key_meta"][slots[3]] = meta
    rec["key"][slots[3]] = kb.ljust(KEY_BYTES, b"\0")
    cases.append([good, (slots[3], int(rec["gen"][slots[3]]), 1000, False)])
    if _COMPILED:
        cases += [[(s, good[1], 1000, 1)], [(s, good[1], 1000.0, False)], [(wheel.n_records, 0, 1000, False)],
                  [good, [s, good[1], 1000, False]]]
    for taken in cases:
        before = rec.tobytes()
        unacked = {}
        assert frames.expirations_frame(wheel, taken, AL.recipient_aux(1), unacked) is None, taken
        assert rec.tobytes() == before and unacked == {}
    if _COMPILED:  # an aux word beyond int32: mark_fired refuses it on the checked path
        assert frames.expirations_frame(wheel, [good], 1 << 31, {}) is None


# ------------------------------------------------------------------ queue_usual
_DEADLINES = st.integers(-(2**63), 2**63 - 1) | st.integers(0, 3000)  # now is 1000..2000
# any value of the fields queueing reads (deadline, generation, aux, group, meta) ...
_QUEUE_ANY = st.tuples(_DEADLINES, st.integers(0, 2**32 - 1), st.integers(-(2**31), 2**31 - 1),
                       st.integers(0, 65535), st.integers(0, 255))
# ... or, nine times in ten, those of a usual fired timer (no touch reference, group 0 or 1)
_QUEUE_USUAL = st.tuples(_DEADLINES, st.integers(0, 2**32 - 1), st.just(-1), st.integers(0, 1),
                         st.sampled_from(_VALID_METAS))
_QUEUE_FIELDS = st.integers(0, 9).flatmap(lambda k: _QUEUE_ANY if k == 0 else _QUEUE_USUAL)


def _queued(module, wheel, slots, start, now, started):
    """What ``queue_usual`` of ``module`` answers, with the queues and the lateness after it."""
    from wheeld.daemon.delivery import Lateness

    lateness = Lateness(wheel.tick_ms)
    queues = collections.defaultdict(collections.deque)
    stop = module.queue_usual(wheel, slots, start, now, started, lateness, queues)
    return stop, {g: list(q) for g, q in queues.items() if q}, lateness.counts, lateness.sum_us, lateness.beyond_tick


@pytest.mark.skipif(not _COMPILED, reason="the C queueing exists in the compiled build only")
@settings(max_examples=700, **_SETTINGS)
@given(fields=st.lists(_QUEUE_FIELDS, min_size=_RECORDS, max_size=_RECORDS), data=st.data(),
       now=st.integers(1000, 2000), started=st.integers(0, 3000))
def test_the_c_queueing_answers_as_its_python_source_over_every_record_value(fields, data, now, started):
    """Where it stops, what each group's queue holds (in order), the lateness histogram,
    its sum and the count beyond a tick: the same on both, over deadlines from the far
    past to the far future, idle timers, damaged group ids and meta bytes."""
    wheel, slots = _fired_wheel()
    rec = wheel.records
    for slot, (deadline, gen, aux, group, meta) in zip(slots, fields):
        rec["deadline"][slot], rec["gen"][slot], rec["aux"][slot] = deadline, gen, aux
        rec["group"][slot], rec["key_meta"][slot] = group, meta
    order = data.draw(st.lists(st.sampled_from(slots), max_size=2 * _RECORDS))
    start = data.draw(st.integers(0, 2) | st.integers(0, len(order)))
    before = rec.tobytes()
    reference = _queued(_SOURCE, wheel, order, start, now, started)
    compiled = _queued(frames, wheel, order, start, now, started)
    assert compiled == reference
    assert rec.tobytes() == before  # queueing writes nothing into the arena
    _QUEUED[reference[0] - start > 0] += 1


_QUEUED = collections.Counter()  # draws that queued some records (True) or none (False)


@pytest.mark.skipif(not _COMPILED, reason="the C queueing exists in the compiled build only")
def test_the_queueing_draws_above_queued_records():
    """The property above is not vacuous: a third of its draws or more queued records."""
    _QUEUED.clear()
    test_the_c_queueing_answers_as_its_python_source_over_every_record_value()
    assert _QUEUED[True] >= sum(_QUEUED.values()) / 3, _QUEUED


def test_queueing_stops_at_each_record_the_caller_handles_and_keeps_the_wheels_order():
    """An idle timer, a group id beyond the wheel's groups, a meta byte no key has: each
    stops the pass at its index; the records before it are queued in order, with their
    lateness (one beyond the tick, one late because it is due before the start)."""
    from wheeld.daemon.delivery import Lateness

    wheel, slots = _fired_wheel()
    rec = wheel.records
    now = 2000
    for j, s in enumerate(slots):
        rec["deadline"][s] = now - j  # 0, 1, 2 ... ms late
        rec["aux"][s], rec["group"][s] = -1, 0
    rec["aux"][slots[3]] = 5  # an idle timer
    rec["group"][slots[6]] = wheel.max_groups
    rec["key_meta"][slots[9]] = 0xFF
    lateness = Lateness(wheel.tick_ms)
    queues = collections.defaultdict(collections.deque)
    stops, start = [], 0
    while start < len(slots):
        start = frames.queue_usual(wheel, slots, start, now, now - 1, lateness, queues)
        stops.append(start)
        start += 1
    assert stops == [3, 6, 9, len(slots)]
    expected = [s for j, s in enumerate(slots) if j not in (3, 6, 9)]
    assert [entry[0] for entry in queues[0]] == expected
    assert [entry[3] for entry in queues[0]] == [j >= 2 for j, s in enumerate(slots) if j not in (3, 6, 9)]
    assert lateness.sum_us == sum(j * 1000 for j in range(len(slots)) if j not in (3, 6, 9))
    assert lateness.beyond_tick == len([j for j in range(len(slots)) if j not in (3, 6, 9) and j > 1])
