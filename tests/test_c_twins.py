"""The C twins without a test elsewhere, each against its Python reference in the same process.

A C twin is a C function of a ``.pxd`` that re-implements logic the Python path runs
in Python (docs/compiled.md lists them all, with the test that holds each). The ones
here are reached from Python only through the compiled module's functions that call
them; each test computes the same thing with the Python reference (the module's
``.py`` source, loaded by ``tests/python_source.py`` even in a compiled process, or
the expression the ``.py`` runs on its Python path) and requires the same answer.

On the Python path (``WHEELD_PURE_PYTHON=1``, or no extensions built) there are no
C twins: the tests skip.
"""

from __future__ import annotations

import collections
import contextlib
import os
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from python_source import load

from wheeld.protocol import accel
from wheeld.protocol import arena_layout as L
from wheeld.protocol import commands as C
from wheeld.protocol.keys import encode_key

_TWIN_MODULES = ("wheeld.shm.keyindex", "wheeld.shm.wheel", "wheeld.daemon.executor", "wheeld.core", "wheeld.purgatory")
pytestmark = pytest.mark.skipif(
    not all(accel.compiled(name) for name in _TWIN_MODULES),
    reason="the C twins exist in the compiled build only (extensions not built, or WHEELD_PURE_PYTHON=1)")

_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
_KEYS = (st.text(min_size=1, max_size=8) | st.binary(min_size=1, max_size=32)
         | st.integers(-(1 << 63), (1 << 63) - 1))


def _outcome(fn, *args):
    """fn(*args) as (type name, value), or ("raised", exception type name)."""
    try:
        value = fn(*args)
    except Exception as error:  # noqa: BLE001 - the type is the answer
        return "raised", type(error).__name__
    return type(value).__name__, value


# ------------------------------------------------------------------ keyindex.pxd: _key_equal
def test_a_probe_compares_all_33_key_bytes_as_the_python_slice_does():
    """KeyIndex.find compares a candidate's key with ``memcmp`` when compiled (``_key_equal``),
    with a slice of the record view on the Python path. A record whose key bytes changed
    after it was indexed keeps its hash, so the probe reaches the byte comparison: both
    indexes must miss it for a change at any of the 33 bytes (meta byte and key field)."""
    from wheeld.shm.keyindex import KeyIndex

    source = load("wheeld.shm.keyindex")
    assert not source._COMPILED
    records = np.zeros(24, dtype=L.RECORD_DTYPE)
    raw = records.view(np.uint8).reshape(len(records), L.RECORD_BYTES)
    compiled_index, python_index = KeyIndex(records, 16, max_groups=2), source.KeyIndex(records, 16, max_groups=2)
    try:
        idents = {}
        for slot in range(4, 20):
            kb, meta = encode_key(f"key-{slot}" * 3)
            ident = bytes((meta,)) + kb.ljust(32, b"\0")
            raw[slot, L.R_KEY_META : L.R_KEY_META + 33] = np.frombuffer(ident, dtype=np.uint8)
            records["group"][slot] = slot % 2
            idents[slot] = ident
            for index in (compiled_index, python_index):
                index.add(slot, index.key_hash(ident, slot % 2))
        for slot, ident in idents.items():
            g = slot % 2
            for at in range(33):
                assert compiled_index.find(ident, g) == python_index.find(ident, g) == slot
                raw[slot, L.R_KEY_META + at] ^= 0x01
                assert (compiled_index.find(ident, g), python_index.find(ident, g)) == (-1, -1), (slot, at)
                raw[slot, L.R_KEY_META + at] ^= 0x01
    finally:
        compiled_index.close()
        python_index.close()


# ------------------------------------------------------------------ wheel.pxd: _key_field, _decode_key_at
@contextlib.contextmanager
def _wheel():
    """A small compiled wheel, one per example."""
    from wheeld.shm import TimerWheel

    w = TimerWheel.create(40, tick_ms=1, wheel_size=16, start_ms=1000, max_groups=2)
    try:
        yield w
    finally:
        w.close()


def _writable(view) -> np.ndarray:
    """The arena's record bytes (TimerWheel._rb) as a writable uint8 array."""
    return np.frombuffer(view, dtype=np.uint8)


@settings(max_examples=100, **_SETTINGS)
@given(keys=st.lists(_KEYS, min_size=1, max_size=12, unique=True), noise=st.binary(min_size=32, max_size=32))
def test_record_rows_reads_the_key_field_as_the_python_path(keys, noise):
    """record_rows builds a record's 32-byte key field with ``_key_field`` when compiled; the
    Python path slices the record view: the same bytes for every record, the sentinels and
    free records too, and for any bytes in the field (written past the key here)."""
    from wheeld.shm.wheel import encode_ident

    with _wheel() as wheel:
        slots, _gens = wheel.schedule_many([encode_ident(k) for k in keys], 5000)
        rb = wheel._rb
        first = int(slots[0]) * L.RECORD_BYTES + L.R_KEY
        _writable(rb)[first + 24 : first + 32] = np.frombuffer(noise[:8], dtype=np.uint8)  # after a short key
        every = list(range(wheel.n_records))
        rows = wheel.record_rows(every)
        for s, row in zip(every, rows):
            base = s * L.RECORD_BYTES
            assert row[-1] == bytes(rb[base + L.R_KEY : base + L.RECORD_BYTES]), s


@settings(max_examples=400, **_SETTINGS)
@given(meta=st.integers(0, 255), field=st.binary(min_size=32, max_size=32))
def test_a_fired_key_is_decoded_as_the_python_path_decodes_it(meta, field):
    """A fired timer's key: compiled, built from the record bytes by ``_decode_key_at`` (None
    for a meta byte encode_key never writes, then decoded the Python way); on the Python
    path ``decode_key`` of the record's key bytes. Any meta byte, any key field (a str
    key that is not UTF-8 included): the same key, or the same exception."""
    from wheeld.shm.wheel import encode_ident

    source = load("wheeld.shm.wheel")
    with _wheel() as wheel:
        slot = int(wheel.schedule_many([encode_ident("fired")], 1001)[0][0])
        assert wheel.expire(1001) == [slot]
        base = slot * L.RECORD_BYTES
        rb = wheel._rb
        _writable(rb)[base + L.R_KEY_META] = meta
        _writable(rb)[base + L.R_KEY : base + L.RECORD_BYTES] = np.frombuffer(field, dtype=np.uint8)
        python = _outcome(lambda: source.decode_key(bytes(rb[base + L.R_KEY : base + source._KEY_END[meta]]), meta))
        compiled = _outcome(lambda: wheel.fired(slot)[0])
    assert compiled == python, (meta, field)


# ------------------------------------------------------------------ keycodec.pxd: encode_ident_c
class _Str(str):
    pass


class _Int(int):
    pass


_ANY_KEY = (st.text(max_size=40) | st.text(alphabet=st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF),
                                           min_size=1, max_size=3)
            | st.integers(-(1 << 64), 1 << 64) | st.binary(max_size=40) | st.booleans()
            | st.text(min_size=1, max_size=8).map(_Str) | st.integers().map(_Int) | st.none() | st.floats())


@settings(max_examples=600, **_SETTINGS)
@given(key=_ANY_KEY)
def test_a_key_is_encoded_for_the_scalar_methods_as_the_python_path_encodes_it(key):
    """``schedule(key)``, ``cancel(key)``, ``lookup(key)`` and ``encode_ident``: compiled, a str
    or int key is built in C (``encode_ident_c``, None for any other key, then encoded the
    Python way); on the Python path ``_ident`` (``keys.encode_key`` plus padding). Any key,
    empty, too long, with a lone surrogate, out of int64, a subclass, not a key at all:
    the same 33 bytes, or the same exception."""
    from wheeld.shm.wheel import encode_ident

    source = load("wheeld.shm.wheel")
    python = _outcome(lambda: source._ident(key)[0])
    assert _outcome(encode_ident, key) == python, key
    with _wheel() as wheel:
        compiled = _outcome(wheel.schedule, key, 1500)
        if python[0] == "bytes":
            assert compiled[0] == "tuple" and wheel.lookup_ident(python[1]) == 1500
            assert wheel.lookup(key) == 1500 and wheel.cancel(key) and wheel.lookup_ident(python[1]) is None
        else:
            assert compiled == python, key


# ------------------------------------------------------------------ executor.pxd: _fields, _keyed_idents
_OPS = st.sampled_from(["add", "add", "cancel", "flush"])
# deadlines near the wheel's clock (1000), and some more than MAX_DELAY_MS from it (refused)
_OFFSETS = st.integers(-5, 300) | st.sampled_from([(1 << 40), -(1 << 40), 1 << 62, -(1 << 62)])


@settings(max_examples=60, **_SETTINGS)
@given(commands=st.lists(st.tuples(_OPS, st.sampled_from(["a", "b", "é", b"\x00b", 7, -(1 << 63), "k" * 32]),
                                   _OFFSETS), min_size=1, max_size=30))
def test_the_executor_applies_records_as_its_python_source(commands):
    """The daemon's in-order loop reads each record's fields from the record bytes when compiled
    (``_fields``) and builds each keyed command's 33-byte ident from them (``_keyed_idents``:
    meta byte, then the key field); its Python source reads them with ``struct`` and
    concatenates the meta byte and the key. The compiled ``_in_order`` on the compiled wheel
    and the source's on the source wheel (test_compiled_differential holds the two wheels to
    the same bytes) must leave the same arena and give the same answers (the refusals of
    deadlines out of range included)."""
    from wheeld.daemon import executor as compiled_executor
    from wheeld.daemon.client_table import ClientSlot
    from wheeld.shm import TimerWheel

    source_executor = load("wheeld.daemon.executor")
    assert not source_executor._COMPILED
    buffer = bytearray()
    for seq, (op, key, offset) in enumerate(commands, 1):
        kb, meta = encode_key(key)
        if op == "add":
            buffer += C.encode_command(C.ADD, kb, meta, 1000 + offset, seq)
        elif op == "cancel":
            buffer += C.encode_command(C.CANCEL, kb, meta, 0, seq)
        else:
            buffer += C.encode_command(C.FLUSH, b"", 0, 0, seq)
    records = C.records_from_buffer(bytes(buffer))
    assert C.validate_records(records).all()
    answers, arenas = [], []
    for module, wheels in ((compiled_executor, TimerWheel), (source_executor, load("wheeld.shm.wheel").TimerWheel)):
        wheel = wheels.create(64, tick_ms=1, wheel_size=16, start_ms=1000)
        try:
            gid = wheel.group_id("g")
            cs = ClientSlot(1, None, "ring", gid, "g", os.getpid(), os.getuid())
            executor = module.Executor(wheel, {1: cs}, 1, 0, collections.Counter(), _never_poisoned, lambda: 1000)
            flushes, rejects = module._in_order(executor, cs, records.tobytes())
            answers.append((flushes, [tuple(r) for r in rejects],
                            [wheel.lookup(key, gid) for _op, key, _offset in commands]))
            arena = bytearray(wheel._seg.buf)
            arena[L.H_CREATED_WALL_MS : L.H_CREATED_WALL_MS + 8] = bytes(8)
            arenas.append(bytes(arena))
        finally:
            wheel.close()
    assert answers[0] == answers[1]
    assert arenas[0] == arenas[1]


def _never_poisoned(cs, reason):
    raise AssertionError(f"poisoned: {reason}")


# ------------------------------------------------------------------ purgatory.pxd: _int_ident_c, flags, clock
@settings(max_examples=300, **_SETTINGS)
@given(op_id=st.integers(0, (1 << 63) - 1) | st.sampled_from([0, 1, 255, 256, (1 << 63) - 1]))
def test_the_purgatorys_int_ident_is_the_python_one(op_id):
    """An operation's timer key in the purgatory's wheel: compiled, the 33 bytes written in
    place (``_int_ident_c``); on the Python path, meta byte + ``to_bytes(8, "little")`` +
    padding. Op ids are non-negative (the purgatory's id base | a counter)."""
    from wheeld import purgatory
    from wheeld.shm.wheel import encode_ident

    source = load("wheeld.purgatory")
    assert purgatory._int_ident(op_id) == source._int_ident(op_id) == encode_ident(op_id)


class _Trace:
    """A delayed operation whose condition holds on its ``ready``-th check; its third check (the
    first one a ``check_and_complete`` makes, once it is watched) asks for another check of
    the same key while it runs: the check flag is held, so the pending flag makes the
    running check go round once more."""

    @staticmethod
    def make(module, log, ready):
        class Op(module.DelayedOperation):
            checks = 0

            def try_complete(self):
                Op.checks += 1
                number = Op.checks
                if number == 3:
                    log.append(("inner", self._purgatory.check_and_complete("k")))  # finds a check running
                log.append(("check", number, self.is_completed))
                return self.force_complete() if number >= ready else False

            def on_complete(self):
                log.append(("complete", self.expired, self.error is None))

        return Op(60_000)


@pytest.mark.parametrize("ready", [1, 3, 4, 5])
def test_the_purgatorys_flags_behave_as_the_python_locks(ready):
    """The one-shot, check and pending flags of a delayed operation are C bytes changed
    atomically when compiled (``_take_done``, ``_get_done``, ``_take_checking``, ``_clear_checking``,
    ``_take_pending``, ``_clear_pending``, ``_get_pending``), ``threading.Lock``s and a bool on
    the Python path: the same calls, the same order of checks and completions."""
    from wheeld import purgatory as compiled_purgatory

    source = load("wheeld.purgatory")
    traces = []
    for module in (compiled_purgatory, source):
        log: list = []
        with module.Purgatory(name="twins") as p:
            op = _Trace.make(module, log, ready)
            log.append(("watch", p.try_complete_else_watch(op, ("k",))))
            log.append(("again", p.check_and_complete("k")))
            log.append(("again", p.check_and_complete("k")))
            log.append(("force", op.force_complete(), op.force_complete(), op.is_completed))
        traces.append(log)
    assert traces[0] == traces[1]
    assert ready == 1 or ("inner", 0) in traces[1]


def test_the_c_clocks_read_time_monotonic_ns():
    """The compiled client and purgatory read CLOCK_MONOTONIC with ``clock_gettime`` (core.pxd,
    purgatory.pxd); the Python path calls ``time.monotonic_ns``: a reading of the one lies
    between two readings of the other, rounded as each caller rounds."""
    from wheeld import core, purgatory

    client = core.ClientCore.__new__(core.ClientCore)
    client.max_delay_ms = None
    for _ in range(1000):
        before = time.monotonic_ns()
        floor_ms, ceil_ms, deadline = purgatory._floor_ms(), purgatory._ceil_ms(), client._deadline(0)
        after = time.monotonic_ns()
        assert before // 1_000_000 <= floor_ms <= after // 1_000_000
        assert -(-before // 1_000_000) <= ceil_ms <= -(-after // 1_000_000)
        assert -(-before // 1_000_000) <= deadline <= -(-after // 1_000_000)
