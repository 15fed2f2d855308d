"""The compiled hot path against its Python source: the same operations leave the
same bytes.

Two worker processes (``tests/differential_worker.py``) run each generated
scenario, one on the compiled path, one with ``WHEELD_PURE_PYTHON=1``, both with
the same ``PYTHONHASHSEED`` (the key index hashes with Python's ``hash``). A
scenario is a wheel shape and a sequence of scalar and batch calls (new timers,
re-arms, cancels by key and by handle, advances, expiries, releases, re-arms of
fired timers, ``cascade_ahead``, the aux word of fired records (``mark_fired``),
group names registered and forgotten, reads: ``next_deadline``, ``record_rows``,
``fired``), with bad input among them (deadlines off
the clock's range or not integers, malformed keys, group ids and tags out of
range) and re-attaches (the recovery a restart makes). Both sides must return
the same results, raise the same exceptions, and leave byte-identical arenas
(the header's creation wall-clock time aside).

The ``slow`` twin (``make test-long``) runs many more scenarios.
"""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wheeld.protocol import accel
from wheeld.protocol import arena_layout as L
from wheeld.shm.arena import unlink
from wheeld.shm.wheel import MAX_DELAY_MS, _default_levels, encode_ident

WORKER = Path(__file__).with_name("differential_worker.py")
_LEN = struct.Struct("<Q")

SHAPES = [
    {"capacity": 24, "tick_ms": 1, "wheel_size": 4, "levels": 3, "start_ms": 1000, "max_groups": 4},
    {"capacity": 40, "tick_ms": 10, "wheel_size": 8, "levels": 2, "start_ms": 0, "max_groups": 3},
    {"capacity": 64, "tick_ms": 1, "wheel_size": 256, "start_ms": 5_000, "max_groups": 8},
    # neither the tick nor the wheel size a power of two, and a clock below 0: the C
    # placement's divisions and remainders of negative numbers (wheel.pxd, _c_place)
    {"capacity": 30, "tick_ms": 3, "wheel_size": 5, "levels": 3, "start_ms": -5_000, "max_groups": 4},
]


class Worker:
    def __init__(self, pure: bool):
        env = dict(os.environ, PYTHONHASHSEED="0", **{accel.PURE_ENV: "1" if pure else "0"})
        self.proc = subprocess.Popen([sys.executable, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env)

    def run(self, name: str, shape: dict, ops: list) -> dict:
        data = pickle.dumps((name, shape, ops))
        self.proc.stdin.write(_LEN.pack(len(data)) + data)
        self.proc.stdin.flush()
        head = self.proc.stdout.read(_LEN.size)
        assert len(head) == _LEN.size, f"worker exited with {self.proc.wait()}"
        return pickle.loads(self.proc.stdout.read(_LEN.unpack(head)[0]))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


@pytest.fixture(scope="module")
def workers():
    compiled, pure = Worker(pure=False), Worker(pure=True)
    try:
        yield compiled, pure
    finally:
        compiled.close()
        pure.close()


KEYS = st.sampled_from(["a", "b", "c", "d", "e", "f", 7, 8, 2**40, b"\x00bin", "k" * 32])
BAD_KEYS = st.sampled_from([b"short", b"\x00" * 33, bytes([0x3F]) + b"x" * 32])
GROUPS = st.integers(0, 2)
OFFSETS = st.integers(-50, 3000) | st.integers(3000, 10**7)
TAGS = st.integers(0, 5)


@st.composite
def scenarios(draw):
    shape = draw(st.sampled_from(SHAPES))
    start = shape["start_ms"]
    clock = start
    ops = []
    for _ in range(draw(st.integers(1, 40))):
        kind = draw(st.sampled_from([
            "schedule", "schedule", "schedule", "cancel", "advance", "expire", "release", "rearm_fired",
            "schedule_many", "cancel_many", "expire_many", "release_many", "records_of", "cascade_ahead",
            "cancel_handle", "next_deadline", "record_rows", "fired", "lookup_many",
            "mark_fired", "group", "forget", "reattach", "bad",
        ]))
        if kind == "schedule":
            ops.append(("schedule_ident", (encode_ident(draw(KEYS)), clock + draw(OFFSETS), draw(GROUPS),
                                           draw(TAGS), draw(st.integers(-1, 3)))))
        elif kind == "cancel":
            ops.append(("cancel_ident", (encode_ident(draw(KEYS)), draw(GROUPS))))
        elif kind in ("advance", "expire", "expire_many"):
            clock += draw(st.integers(0, 400) | st.integers(400, 200_000))
            ops.append((kind, (clock,)))
        elif kind == "cascade_ahead":
            ops.append(("cascade_ahead", (clock + draw(st.integers(0, 300)), draw(st.integers(0, 20)))))
        elif kind == "release":  # a slot and a generation: right ones come from fired timers, others are stale
            ops.append(("release", (draw(st.integers(0, 80)), draw(st.integers(0, 4)))))
        elif kind == "rearm_fired":
            ops.append(("rearm_fired", (draw(st.integers(0, 80)), draw(st.integers(0, 4)), clock + draw(OFFSETS))))
        elif kind == "cancel_handle":
            ops.append(("cancel_handle", ((draw(st.integers(0, 80)), draw(st.integers(0, 4))),)))
        elif kind == "schedule_many":
            keys = draw(st.lists(KEYS, min_size=0, max_size=8))
            ops.append(("schedule_many", ([encode_ident(k) for k in keys],
                                          [clock + draw(OFFSETS) for _ in keys],
                                          [draw(GROUPS) for _ in keys], [draw(TAGS) for _ in keys])))
        elif kind == "cancel_many":
            keys = draw(st.lists(KEYS, min_size=0, max_size=8))
            ops.append(("cancel_many", ([encode_ident(k) for k in keys], [draw(GROUPS) for _ in keys])))
        elif kind == "lookup_many":  # read-only probes of one group (the compiled path loops in C)
            keys = draw(st.lists(KEYS, min_size=0, max_size=8))
            ops.append(("lookup_many", ([encode_ident(k) for k in keys], draw(GROUPS))))
        elif kind == "release_many":
            n = draw(st.integers(0, 6))
            ops.append(("release_many", ([draw(st.integers(0, 80)) for _ in range(n)],
                                         [draw(st.integers(0, 4)) for _ in range(n)])))
        elif kind == "mark_fired":  # the recipient word of fired records (other slots are skipped)
            n = draw(st.integers(0, 6))
            ops.append(("mark_fired", ([draw(st.integers(0, 80)) for _ in range(n)], draw(st.integers(-6, 2)))))
        elif kind == "records_of":  # slots of the arena's records, negative ones counted from the end
            records = _records(shape)
            ops.append(("records_of", (np.array(draw(st.lists(st.integers(-records, records - 1), max_size=6)),
                                                dtype=np.int64),)))
        elif kind == "next_deadline":  # the bucket heap (C arrays when compiled) between other calls
            ops.append(("next_deadline", ()))
        elif kind == "record_rows":  # every field of some records, the key field's 32 bytes included
            ops.append(("record_rows", (draw(st.lists(st.integers(0, _records(shape)), max_size=6)),)))
        elif kind == "fired":  # a fired timer's key, decoded from its record (or InvalidRequest)
            ops.append(("fired", (draw(st.integers(0, 80)),)))
        elif kind == "group":
            ops.append(("group_id", (draw(st.sampled_from(["default", "g1", "g2", "g3", "x" * 31])),)))
        elif kind == "forget":
            ops.append(("forget_group", (draw(st.integers(1, 3)),)))
        elif kind == "reattach":
            ops.append(("reattach", ()))
        else:
            ops.append(draw(st.sampled_from([
                ("schedule_ident", (encode_ident("a"), clock + MAX_DELAY_MS + 1)),
                ("schedule_ident", (encode_ident("a"), clock - MAX_DELAY_MS - 1)),
                ("schedule_ident", (encode_ident("a"), 2**70)),
                ("schedule_ident", (encode_ident("a"), -(2**70))),
                ("schedule_ident", (encode_ident("a"), 1.5)),
                ("schedule_ident", (encode_ident("a"), clock + 5, 99)),
                ("schedule_ident", (encode_ident("a"), clock + 5, 0, -1)),
                ("schedule_ident", (encode_ident("a"), clock + 5, 0, 2**32)),
                ("schedule_ident", (encode_ident("a"), clock + 5, 0, 0, 2**31)),
                ("schedule_many", ([encode_ident("a")], [2**70])),
                ("schedule_many", ([encode_ident("a")], [clock + 5], [7])),
                ("expire", (1.5,)),
                ("expire_many", (2**70,)),
                ("advance", (-(2**70),)),
                ("rearm_fired", (0, 0, 2**70)),
                ("release_many", ([1, 2], [1])),
                ("mark_fired", ([1, 2], 2**31)),
                ("mark_fired", ([1, 2], 1.5)),
                ("group_id", ("",)),
                ("forget_group", (-1,)),
                ("lookup_many", ([b"short"], 0)),
                ("lookup_many", ([encode_ident("a")], 99)),
                ("lookup_many", ([], 99)),
            ])))
            ops.append(("schedule_ident", (draw(BAD_KEYS), clock + 5)))
    return shape, ops


def _records(shape: dict) -> int:
    """How many records (sentinels and entries) an arena of ``shape`` has."""
    levels = shape.get("levels") or _default_levels(shape["tick_ms"], shape["wheel_size"])
    return levels * shape["wheel_size"] + 2 + shape["capacity"]


def _compare(workers, shape, ops):
    compiled, pure = workers
    name = f"/wheeld-diff-{os.getpid()}-{uuid.uuid4().hex[:10]}"
    try:
        a = compiled.run(name, shape, ops)
        b = pure.run(name, shape, ops)
    finally:
        unlink(name)
    assert "crashed" not in a and "crashed" not in b, (a.get("crashed"), b.get("crashed"))
    assert (a["path"], b["path"]) == ("compiled", "python")
    for i, (x, y) in enumerate(zip(a["results"], b["results"])):
        assert x == y, f"op {i} {ops[i] if i < len(ops) else 'final'}: compiled {x!r} != python {y!r}"
    assert len(a["results"]) == len(b["results"])
    if a["arena"] != b["arena"]:
        first = next(i for i, (x, y) in enumerate(zip(a["arena"], b["arena"])) if x != y)
        raise AssertionError(f"the arenas differ, first at byte {first} of {len(a['arena'])}")
    assert a["results"][-1] == ("check", [])
    return a["results"]


def _built() -> bool:
    return accel.implementation() == "compiled" or not accel.pure_python_requested() and all(
        kind == "compiled" for kind in _child_paths().values())


def _child_paths() -> dict:
    code = "import json; from wheeld.protocol import accel; print(json.dumps(accel.module_paths()))"
    env = dict(os.environ, **{accel.PURE_ENV: "0"})
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    import json

    return json.loads(out.stdout) if out.returncode == 0 else {}


pytestmark = pytest.mark.skipif(not _built(), reason="the extensions are not built (WHEELD_NO_EXTENSIONS)")

_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@settings(max_examples=150, **_SETTINGS)
@given(scenarios())
def test_compiled_and_python_leave_the_same_bytes(workers, scenario):
    _compare(workers, *scenario)


@pytest.mark.slow
@settings(max_examples=3000, **_SETTINGS)
@given(scenarios())
def test_compiled_and_python_leave_the_same_bytes_long(workers, scenario):
    _compare(workers, *scenario)


def test_a_scenario_that_fills_the_arena_and_cascades(workers):
    shape = dict(SHAPES[0])
    keys = [encode_ident(f"k{i}") for i in range(30)]
    ops = [("schedule_ident", (k, 1000 + 7 * i + 1, i % 3, i)) for i, k in enumerate(keys)]  # 6 refused: ArenaFull
    ops += [("reattach", ()), ("advance", (1050,)), ("cancel_many", (keys[10:20], [i % 3 for i in range(10, 20)]))]
    ops += [("expire_many", (1300,)), ("reattach", ()), ("advance", (10**6,))]
    _compare(workers, shape, ops)


def test_cascade_ahead_moves_the_same_records_on_both_paths(workers):
    """The compiled build moves a level-1 bucket's records down one at a time, the Python
    path with numpy (``_move_to_level0``): the same links, states and counts."""
    shape = dict(SHAPES[2])  # tick 1 ms, 256 buckets: level 1 buckets span 256 ms
    start = shape["start_ms"]
    keys = [encode_ident(f"c{i}") for i in range(48)]
    ops = [("schedule_ident", (k, start + 260 + 11 * i % 500, i % 2, i)) for i, k in enumerate(keys)]
    for now in (start + 5, start + 40, start + 120, start + 200, start + 250, start + 255):
        ops += [("cascade_ahead", (now, 7)), ("cascade_ahead", (now, 50))]
    ops += [("cancel_many", (keys[:6], [i % 2 for i in range(6)])), ("cascade_ahead", (start + 300, 50)),
            ("reattach", ()), ("expire_many", (start + 520,)), ("advance", (start + 900,))]
    results = _compare(workers, shape, ops)
    moved = sum(r for op, r in zip(ops, results) if op[0] == "cascade_ahead" and isinstance(r, int))
    assert moved > 0, results


def _idents(keys) -> np.ndarray:
    """Encoded keys as the V33 array the batch methods take (the form the daemon passes)."""
    return np.array([encode_ident(k) for k in keys], dtype="S33").view("V33")


def test_large_batches_leave_the_same_bytes(workers):
    """Batches past what the generated scenarios reach, for the compiled batch loops: re-arms
    in more than one batch-intent chunk, a batch the arena has room for only in part,
    cancels and releases whose records form several runs of neighbours (and one run),
    slots named twice, and expiries of due lists, level-0 buckets and higher-level
    buckets at once (fired whole, fired one by one, cascaded)."""
    shape = {"capacity": 6000, "tick_ms": 1, "wheel_size": 16, "levels": 4, "start_ms": 1000, "max_groups": 4}
    first = 4 * 16 + 2
    n = L.INTENT_BATCH_MAX + 904  # re-armed at once below: two chunks of the batch intent
    keys = [f"k{i}" for i in range(n + 2000)]
    spread = np.array([1000 + (7 * i) % 3000 - 5 for i in range(n)])  # the due list, level 0 .. level 2
    cancelled = [i for i in range(3000) if i % 3 != 1]  # runs of two neighbours, and single ones
    ops = [
        ("schedule_many", (_idents(keys[:n]), spread, 0, np.arange(n) % 5, np.arange(n) % 3 - 1)),
        ("schedule_many", ([encode_ident(k) for k in keys[:30]], spread[:30] + 9, [1, 2] * 15)),  # other groups
        ("schedule_many", (_idents(keys[: n - 100] + keys[n : n + 400]),
                           np.array([1000 + (13 * i) % 5000 for i in range(n + 300)]),
                           0, 7)),  # re-arms of n - 100 keys, and new ones
        ("schedule_many", (_idents(keys[n + 400 :]), 2000, 0)),  # 1600 new keys: the arena has room for 570
        ("records_of", (np.arange(first, first + 40, dtype=np.int64),)),
        ("cancel_many", (_idents([keys[i] for i in cancelled]), 0)),
        ("cancel_many", (_idents(keys[n + 400 : n + 800]), 0)),  # neighbours in one bucket: one run
        ("expire_many", (1003,)),
        ("expire_many", (1040,)),
        ("expire_many", (1300,)),  # level-1 buckets: some records fire one by one, the rest cascade
        ("release_many", (list(range(first, first + 2500)) + list(range(first + 100, first + 200)),
                          [1] * 2500 + [1] * 100)),  # stale handles, and slots named twice
        ("reattach", ()),
        ("expire_many", (5000,)),
        ("records_of", (np.arange(-60, 0, dtype=np.int64),)),
        ("release_many", (np.arange(first, first + 6000), np.ones(6000, dtype=np.int64))),
        ("schedule_many", (_idents(keys[:50] + keys[:50]), np.arange(100) + 6000)),  # a key twice: the scalar path
        ("cancel_many", (_idents(keys[:20] + keys[10:30]), 0)),
        ("expire_many", (10**6,)),
        ("release_many", (np.arange(first, first + 6000), np.ones(6000, dtype=np.int64))),
    ]
    results = _compare(workers, shape, ops)
    refused = results[3][0][2]  # the slots of the fourth call: -1 where the arena was full
    assert 0 < refused.count(-1) < len(refused), refused.count(-1)
    assert all(isinstance(r, tuple) and r[0] == "array" and len(r[2]) for r in (results[8], results[9], results[12]))
