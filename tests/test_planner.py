"""The batch planner and the executor, in process, on private-memory wheels.

The reference is applying a chunk's commands one by one in ring order
(``Executor.apply_in_order``); a plan (``plan_batch`` + ``Executor.apply_plan``)
must leave the same timers, tags, idle touch indices, answers, rejections,
in-flight tables and journal events.
"""

from __future__ import annotations

import collections
import os
import random
import tempfile
from pathlib import Path
from unittest import mock

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from wheel_state import wheel_state

from wheeld.daemon.client_table import ClientSlot
from wheeld.daemon.executor import Executor
from wheeld.daemon.planner import plan_batch
from wheeld.protocol import clients_layout as CL
from wheeld.protocol import commands as C
from wheeld.protocol import messages as M
from wheeld.protocol.keys import encode_key
from wheeld.shm.wheel import MAX_DELAY_MS, TimerWheel

EPOCH = 77
SLOT = 3
KEYS = [encode_key(k) for k in ["k1", "k2", b"k3", 4, "k5", "k6", "k7", 8]]
PHASES = [Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink]


def _ident(kb: bytes, meta: int) -> bytes:
    return bytes((meta,)) + kb.ljust(32, b"\0")


def _records(commands) -> np.ndarray:
    return np.frombuffer(b"".join(C.encode_command(*c) for c in commands), dtype=C.RECORD_DTYPE).copy()


def _poison(cs, reason):
    raise AssertionError(f"poisoned: {reason}")


def _executor(capacity: int = 4096, recorder=None) -> tuple[Executor, ClientSlot]:
    wheel = TimerWheel.create(capacity, start_ms=1000)
    gid = wheel.group_id("g")
    cs = ClientSlot(SLOT, None, "test", gid, "g", os.getpid(), os.getuid())
    executor = Executor(wheel, {SLOT: cs}, EPOCH, 0, collections.Counter(), _poison, lambda: 1000, recorder)
    return executor, cs


def _with_fired(executor: Executor, cs: ClientSlot) -> list[int]:
    """Four fired records, the first three in flight to ``cs``: something to acknowledge."""
    for j, (kb, meta) in enumerate(KEYS[:4]):
        executor.wheel.schedule_ident(_ident(kb, meta), 1001 + j, cs.group, 900 + j)
    fired = executor.wheel.expire(1010)
    cs.unacked.update({s: executor.wheel.fired(s)[5] for s in fired[:3]})
    return fired


def _planned(executor: Executor, cs: ClientSlot, records: np.ndarray):
    return executor.apply_plan(cs, executor.plan(cs, records), records)


# --------------------------------------------------------------------------- the plan itself


def test_a_plan_keeps_the_last_operation_per_key():
    x, y, z = (encode_key(k) for k in ("x", "y", "z"))
    records = _records([
        (C.ADD, *x, 2000, 1), (C.CANCEL, *x, 0, 2), (C.ADD_IDLE, *x, 3000, 3, 500, 7), (C.ADD, *x, 4000, 4),
        (C.ADD, *y, 2500, 5), (C.CANCEL, *z, 0, 6), (C.FLUSH, b"", 0, 0, 7), (C.ACK, b"", 0, 0, EPOCH, 40, 2),
        (C.ADD, *z, 1000 + MAX_DELAY_MS + 1, 8), (C.FLUSH, b"", 0, 0, 9),
    ])
    plan = plan_batch(records, 1000, MAX_DELAY_MS, SLOT << CL.TOUCH_INDEX_BITS)
    assert plan.flushes == [7, 9]
    assert plan.acks == ([40], [2], [EPOCH])
    assert [(r.seq, r.code) for r in plan.rejections] == [(8, M.Rejected.INVALID_DEADLINE)]
    assert sorted(plan.cancels.tolist()) == sorted([_ident(*x), _ident(*z)])
    arms = {ident: (d, s, a) for ident, d, s, a in zip(plan.arms.idents.tolist(), plan.arms.deadlines.tolist(),
                                                        plan.arms.seqs.tolist(), plan.arms.aux.tolist())}
    # x: the last arm's deadline, tag and touch reference (an ADD: none)
    assert arms == {_ident(*x): (4000, 4, -1), _ident(*y): (2500, 5, -1)}
    assert plan.previous is None and plan.log(set()) is None


def test_a_plan_asks_the_lookup_once_for_the_distinct_keys():
    x, y = encode_key("x"), encode_key("y")
    asked = []

    def lookup(idents):
        asked.append(list(idents))
        return [1234 if ident == _ident(*x) else None for ident in idents]

    records = _records([(C.ADD, *x, 2000, 1), (C.ADD_IDLE, *y, 2100, 2, 900, 1), (C.CANCEL, *x, 0, 3)])
    plan = plan_batch(records, 1000, MAX_DELAY_MS, 0, lookup)
    assert asked == [[_ident(*x), _ident(*y)]]
    log = plan.log(set())
    assert log.arms == [True, True, False] and log.idle_ms == [None, 900, None]
    assert log.previous == {_ident(*x): 1234, _ident(*y): None}


def test_a_chunk_without_keyed_commands_plans_no_wheel_work():
    plan = plan_batch(_records([(C.FLUSH, b"", 0, 0, 1), (C.ACK, b"", 0, 0, 0, 5, 6)]), 1000, MAX_DELAY_MS, 0)
    assert plan.flushes == [1] and plan.acks == ([5], [6], [0])
    assert plan.keyed is None and plan.cancels is None and plan.arms is None


def test_a_plan_keeps_the_last_arming_and_reports_a_full_arena():
    executor, cs = _executor(capacity=3)
    x, y, z, w = (encode_key(k) for k in ("x", "y", "z", "w"))
    commands = [(C.ADD, *x, 2000, 1), (C.CANCEL, *x, 0, 2), (C.ADD_IDLE, *x, 3000, 3, 500, 7), (C.ADD, *x, 4000, 4),
                (C.ADD, *y, 2500, 5), (C.ADD, *z, 2600, 6), (C.ADD, *w, 2700, 9), (C.ADD, *w, 2800, 10),
                (C.FLUSH, b"", 0, 0, 7)]
    flushes, rejects = _planned(executor, cs, _records(commands))
    state = wheel_state(executor.wheel)
    assert (x[1], x[0].ljust(32, b"\0"), 4000, 4, -1) in state["scheduled"]  # its last arm, an ADD: plain
    assert len(state["scheduled"]) == 3 and not state["problems"]
    assert [(r.seq, r.code) for r in rejects] == [(9, M.Rejected.ARENA_FULL), (10, M.Rejected.ARENA_FULL)]
    assert flushes == [7]


# --------------------------------------------------------------------------- plan == in order

_command = st.one_of(
    st.tuples(st.just(C.ADD), st.integers(0, len(KEYS) - 1), st.integers(0, 5000), st.booleans()),
    st.tuples(st.just(C.ADD_IDLE), st.integers(0, len(KEYS) - 1), st.integers(0, 5000), st.integers(0, 63)),
    st.tuples(st.just(C.CANCEL), st.integers(0, len(KEYS) - 1)),
    st.tuples(st.just(C.FLUSH)),
    st.tuples(st.just(C.ACK), st.integers(0, 3), st.sampled_from([EPOCH, 0, 5]), st.sampled_from([0, 0, 1])),
)


def _encode(drawn: list, fired: list[int], gens: dict) -> list[tuple]:
    """Drawn commands as ring commands (seq = position + 1; an ADD's flag: deadline out of range)."""
    out = []
    for seq, c in enumerate(drawn, 1):
        if c[0] == C.ADD:
            deadline = 1010 + MAX_DELAY_MS + 5 if c[3] and c[2] % 17 == 0 else 1011 + c[2]
            out.append((C.ADD, *KEYS[c[1]], deadline, seq))
        elif c[0] == C.ADD_IDLE:
            out.append((C.ADD_IDLE, *KEYS[c[1]], 1011 + c[2], seq, 1 + c[2], c[3]))
        elif c[0] == C.CANCEL:
            out.append((C.CANCEL, *KEYS[c[1]], 0, seq))
        elif c[0] == C.FLUSH:
            out.append((C.FLUSH, b"", 0, 0, seq))
        else:  # acks: good, stale generation, other epoch, unstamped, never sent to us
            slot = fired[c[1]]
            out.append((C.ACK, b"", 0, 0, c[2], slot, gens[slot] + c[3]))
    return out


def _two_executors():
    pair = []
    for _ in range(2):
        executor, cs = _executor()
        fired = _with_fired(executor, cs)
        pair.append((executor, cs))
    gens = {s: pair[0][0].wheel.fired(s)[5] for s in fired}
    return pair, fired, gens


@settings(max_examples=150, deadline=None, phases=PHASES, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.lists(_command, min_size=1, max_size=120), min_size=1, max_size=4))
def test_applying_a_plan_leaves_what_applying_in_ring_order_leaves(chunks):
    ((planned, cs_p), (ordered, cs_o)), fired, gens = _two_executors()
    for drawn in chunks:
        records = _records(_encode(drawn, fired, gens))
        assert C.validate_records(records, 1 << 17).all()
        got = _planned(planned, cs_p, records)
        want = ordered.apply_in_order(cs_o, records)
        assert got[0] == want[0], "Applied answers differ"
        assert [(r.seq, r.code, r.key) for r in got[1]] == [(r.seq, r.code, r.key) for r in want[1]]
        assert wheel_state(planned.wheel) == wheel_state(ordered.wheel)
        assert cs_p.unacked == cs_o.unacked and cs_p.unacked_old == cs_o.unacked_old


def _recorder(directory: Path, wheel: TimerWheel):
    from wheeld.journal.files import Journal
    from wheeld.daemon.recorder import Recorder

    return Recorder(Journal(directory, fsync="off", host="test-host"), wheel)


@settings(max_examples=40, deadline=None, phases=PHASES, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_command, min_size=1, max_size=150))
def test_a_plan_is_journaled_as_applying_in_ring_order_journals_it(drawn):
    """The Recorder observes both paths the same way: the same events, byte for byte."""
    from wheeld.daemon import recorder as recorder_module

    with tempfile.TemporaryDirectory() as tmp, mock.patch.object(recorder_module, "mono_ms", lambda: 5_000), \
            mock.patch.object(recorder_module, "wall_offset_ms", lambda: 1_700_000_000_000), \
            mock.patch.object(os, "fsync", lambda fd: None):
        recorders, executors = [], []
        for name in ("planned", "ordered"):
            executor, cs = _executor()
            executor.recorder = _recorder(Path(tmp) / name, executor.wheel)
            recorders.append(executor.recorder)
            executors.append((executor, cs))
        fired = _with_fired(*executors[0])
        _with_fired(*executors[1])
        gens = {s: executors[0][0].wheel.fired(s)[5] for s in fired}
        records = _records(_encode(drawn, fired, gens))
        (planned, cs_p), (ordered, cs_o) = executors
        for executor, apply in ((planned, lambda: _planned(planned, cs_p, records)),
                                (ordered, lambda: ordered.apply_in_order(cs_o, records))):
            executor.recorder.begin()
            apply()
            executor.recorder.commit(5_000)
        lines = [r.journal.segment_path.read_bytes().split(b"\n", 1)[1] for r in recorders]
        for r in recorders:
            r.journal.close()
    assert lines[0] == lines[1]
    assert all(msgspec.json.decode(line)["ev"] in {"add", "rearm", "cancel", "ack"} for line in lines[0].splitlines())


def test_random_chunks_through_apply_choose_either_path_and_agree(monkeypatch):
    """``Executor.apply`` (the drain's entry: a plan from BATCH_MIN records, else in order)
    against in-order application, on chunks of every size around the threshold (the
    Python path's threshold, set here on both paths: compiled, the daemon never plans)."""
    from wheeld.daemon import executor as executor_module

    BATCH_MIN = executor_module.PLAN_BATCH_MIN
    monkeypatch.setattr(executor_module, "BATCH_MIN", BATCH_MIN)
    rng = random.Random(11)
    ((a, cs_a), (b, cs_b)), fired, gens = _two_executors()
    for size in [1, 5, BATCH_MIN - 1, BATCH_MIN, BATCH_MIN + 1, 500, 2000]:
        drawn = []
        for _ in range(size):
            r = rng.random()
            key = rng.randrange(len(KEYS))
            if r < 0.35:
                drawn.append((C.ADD, key, rng.randrange(5000), rng.random() < 0.05))
            elif r < 0.55:
                drawn.append((C.ADD_IDLE, key, rng.randrange(5000), rng.randrange(64)))
            elif r < 0.85:
                drawn.append((C.CANCEL, key))
            elif r < 0.95:
                drawn.append((C.FLUSH,))
            else:
                drawn.append((C.ACK, rng.randrange(4), rng.choice([EPOCH, 0, 5]), rng.choice([0, 0, 1])))
        records = _records(_encode(drawn, fired, gens))
        got, want = a.apply(cs_a, records), b.apply_in_order(cs_b, records)
        assert got[0] == want[0] and [(r.seq, r.code) for r in got[1]] == [(r.seq, r.code) for r in want[1]]
        # answered in the same order: each refusal before the Applied of the first FLUSH after it
        cuts = executor_module.answer_order(records, got[1])
        assert cuts == executor_module.answer_order(records, want[1])
        assert [(r.seq, r.code, r.at) for r in got[1]] == [(r.seq, r.code, r.at) for r in want[1]]
        assert wheel_state(a.wheel) == wheel_state(b.wheel), size
    assert wheel_state(a.wheel)["scheduled"], "the test should leave timers armed"


def test_in_order_refuses_a_deadline_out_of_range_as_the_wheel_does():
    """The in-order loop refuses an arm whose deadline is more than MAX_DELAY_MS from the wheel's
    clock before it reaches the wheel: exactly the arms ``schedule_ident`` would refuse with
    ``InvalidDelay``, with its words, at either edge of the range."""
    executor, cs = _executor()
    wheel = executor.wheel
    wheel.advance(1500)
    cur = wheel.current_ms
    deadlines = [cur + MAX_DELAY_MS, cur + MAX_DELAY_MS + 1, cur - MAX_DELAY_MS, cur - MAX_DELAY_MS - 1,
                 (1 << 63) - 1, -(1 << 63)]
    records = _records([(C.ADD, *encode_key(f"d{j}"), d, j + 1) for j, d in enumerate(deadlines)])
    _flushes, rejects = executor.apply_in_order(cs, records)
    refused = {r.seq: r for r in rejects}
    probe = TimerWheel.create(64, start_ms=1000)
    probe.advance(1500)
    for j, deadline in enumerate(deadlines):
        try:
            probe.schedule_ident(_ident(*encode_key(f"d{j}")), deadline, 0, j + 1)
        except Exception as exc:  # noqa: BLE001 - its words are the answer
            assert type(exc).__name__ == "InvalidDelay"
            assert refused[j + 1].reason == str(exc) and refused[j + 1].code == M.Rejected.INVALID_DEADLINE
        else:
            assert j + 1 not in refused and wheel.lookup(f"d{j}", cs.group) == deadline
    assert sorted(refused) == [2, 4, 5, 6]


@pytest.mark.parametrize("quota", [2, 5])
def test_a_group_at_its_quota_is_refused_new_keys_in_order(quota):
    executor, cs = _executor()
    executor.group_quota = quota
    commands = [(C.ADD, *encode_key(f"q{i}"), 2000 + i, i + 1) for i in range(quota + 3)]
    commands.append((C.ADD, *encode_key("q0"), 3000, 99))  # a re-arm needs no new record
    flushes, rejects = executor.apply(cs, _records(commands))
    assert [r.seq for r in rejects] == list(range(quota + 1, quota + 4))
    assert {r.code for r in rejects} == {M.Rejected.QUOTA_EXCEEDED}
    assert executor.wheel.lookup("q0", cs.group) == 3000 and len(executor.wheel) == quota
