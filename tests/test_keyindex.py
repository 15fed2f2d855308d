"""The key index (shm/keyindex.py) against a dict: random insert/lookup/delete sequences,
one key and batches at a time, with the index rebuilt from the records now and then;
and the same through a TimerWheel whose arena is re-attached (recovered) from a copy."""

from __future__ import annotations

import mmap

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from wheeld.protocol import arena_layout as L
from wheeld.shm.arena import Segment
from wheeld.shm.keyindex import KeyIndex
from wheeld.shm.wheel import TimerWheel, encode_ident

# a small universe of keys and groups, so that keys come back after being deleted and
# (with a 16-cell table for 8 records) clusters are long and wrap past the table's end
KEYS = [b"k%d" % i for i in range(40)] + list(range(20)) + ["s%d" % i for i in range(20)]
key_st = st.sampled_from(KEYS)
group_st = st.integers(0, 3)


class IndexAgainstDict(RuleBasedStateMachine):
    """Records in a plain numpy array (no arena): a record holds a key and a group, the
    index maps (group, key) to its slot, the dict is what it should say."""

    @initialize(capacity=st.sampled_from([8, 24]), fp_bits=st.sampled_from([None, 0, 1]))
    def setup(self, capacity, fp_bits):
        self.capacity = capacity
        self.fp_bits = fp_bits  # None: the index's own (26 bits here); 0 or 1: fingerprints that collide
        self.first = 3  # records below this are never indexed (the arena's sentinels)
        self.records = np.zeros(self.first + capacity, dtype=L.RECORD_DTYPE)
        self.index = self._new_index()
        self.model: dict[tuple[int, object], int] = {}
        self.free = list(range(self.first + capacity - 1, self.first - 1, -1))

    def _new_index(self) -> KeyIndex:
        index = KeyIndex(self.records, self.capacity, max_groups=4)
        assert index.fp_mask == (1 << (31 - index.slot_bits)) - 1 and index.slot_mask >= self.first + self.capacity - 1
        if self.fp_bits is not None:
            index.fp_mask = (1 << self.fp_bits) - 1
        return index

    def _ident(self, key) -> bytes:
        return encode_ident(key)

    def _write(self, key, group) -> int:
        slot = self.free.pop()
        ident = self._ident(key)
        self.records["key_meta"][slot] = ident[0]
        self.records["key"][slot] = np.void(ident[1:])
        self.records["group"][slot] = group
        return slot

    @rule(key=key_st, group=group_st)
    def insert(self, key, group):
        if (group, key) in self.model or not self.free:
            return
        slot = self._write(key, group)
        self.index.add(slot, self.index.key_hash(self._ident(key), group))
        self.model[(group, key)] = slot

    @rule(keys=st.lists(st.tuples(group_st, key_st), max_size=12, unique=True))
    def insert_many(self, keys):
        keys = [k for k in keys if k not in self.model][: len(self.free)]
        if not keys:
            return
        slots = np.array([self._write(key, group) for group, key in keys], dtype=np.int64)
        groups = np.array([group for group, _key in keys], dtype=np.int64)
        self.index.add_many(slots, self.index.key_hashes([self._ident(key) for _g, key in keys], groups))
        self.model.update(zip(keys, slots.tolist()))

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def delete(self, data):
        group, key = data.draw(st.sampled_from(sorted(self.model, key=repr)))
        slot = self.model.pop((group, key))
        self.index.remove(slot)
        self.free.append(slot)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def delete_many(self, data):
        gone = data.draw(st.lists(st.sampled_from(sorted(self.model, key=repr)), min_size=1, unique=True))
        slots = np.array([self.model.pop(k) for k in gone], dtype=np.int64)
        self.index.remove_many(slots)
        self.free.extend(slots.tolist())

    @rule()
    def rebuild(self):
        """A new index over the same records, built from the indexed slots (what attach does)."""
        self.index.close()
        self.index = self._new_index()
        assert self.index.rebuild(np.array(sorted(self.model.values()), dtype=np.int64)) == []

    @rule(probes=st.lists(st.tuples(group_st, key_st), min_size=1, max_size=16, unique=True))
    def lookup_many(self, probes):
        idents = [self._ident(key) for _g, key in probes]
        groups = np.array([g for g, _k in probes], dtype=np.int64)
        found = self.index.find_many(np.array(idents, dtype="S33").view("V33"),
                                     self.index.key_hashes(idents, groups), groups)
        assert found.tolist() == [self.model.get(k, -1) for k in probes]

    @invariant()
    def agrees_with_the_dict(self):
        for group in range(4):
            for key in KEYS[::7]:
                ident = self._ident(key)
                assert self.index.find(ident, group) == self.model.get((group, key), -1)
        for (group, key), slot in self.model.items():
            ident = self._ident(key)
            assert self.index.find(ident, group) == slot
        assert self.index.used == len(self.model)
        assert self.index.problems(np.array(sorted(self.model.values()), dtype=np.int64)) == []

    def teardown(self):
        if hasattr(self, "index"):
            self.index.close()


TestIndexAgainstDict = IndexAgainstDict.TestCase
TestIndexAgainstDict.settings = settings(max_examples=80, stateful_step_count=30, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])


def test_rebuild_keeps_the_first_of_a_duplicated_key():
    records = np.zeros(10, dtype=L.RECORD_DTYPE)
    ident = encode_ident("same")
    for slot in (4, 7):
        records["key_meta"][slot] = ident[0]
        records["key"][slot] = np.void(ident[1:])
    index = KeyIndex(records, 8, max_groups=1)
    try:
        assert index.rebuild(np.array([4, 7])) == [(7, 4)]
        assert index.find(ident, 0) == 4 and index.used == 1
    finally:
        index.close()


def test_every_path_hashes_a_key_as_hash_does_in_all_64_bits():
    """The scalar path indexes a key under ``hash(ident) ^ mix(group)``; the compiled batch
    loops hash the 33 bytes in place (wheel.pxd, through keyindex.pxd's ``_hash_bytes``) and
    must store the same 64 bits, or a key scheduled one way is not found the other way.
    Most of these keys' hashes need more than 32 bits (a C call of an undeclared hash
    function keeps only 32)."""
    wheel = TimerWheel.create(2048, tick_ms=1, wheel_size=64, start_ms=0, max_groups=4)
    try:
        index = wheel._index
        batch = [encode_ident(f"batch-{i}") for i in range(600)]
        one_by_one = [encode_ident(f"scalar-{i}") for i in range(600)]
        groups = np.arange(600, dtype=np.int64) % 4
        assert sum(not -(1 << 31) <= hash(ident) < 1 << 31 for ident in batch) > 500
        slots, _gens = wheel.schedule_many(batch, 10_000, groups)
        assert (slots >= 0).all()
        expected = [hash(ident) ^ index.gmix[g] for ident, g in zip(batch, groups.tolist())]
        assert index.hashes[slots].tolist() == expected
        assert [index.key_hash(ident, g) for ident, g in zip(batch, groups.tolist())] == expected
        for ident, g in zip(one_by_one, groups.tolist()):
            wheel.schedule_ident(ident, 10_000, g)
        assert index.problems(np.flatnonzero(index.cells >= 0)) == []
        # each found by the other path: scalar cancel of batch-made keys, batch cancel of scalar-made ones
        assert all(wheel.cancel_ident(ident, g) for ident, g in zip(batch[:300], groups[:300].tolist()))
        assert wheel.cancel_many(one_by_one, groups).all()
        assert wheel.cancel_many(batch[300:], groups[300:]).all()
        assert index.used == 0 and wheel.check() == []
    finally:
        wheel.close()


def _reattached(wheel: TimerWheel) -> TimerWheel:
    """What a restart makes of this wheel's arena: a copy, recovered (links, index, counts
    rebuilt from the records)."""
    size = wheel._seg.size
    copy = mmap.mmap(-1, size)
    copy[:] = bytes(wheel._seg.buf[:size])
    wheel.close()
    return TimerWheel.recover(Segment(copy, None, size))


ops_st = st.lists(st.tuples(st.sampled_from(["schedule", "cancel", "many", "cancel_many", "reattach"]),
                            st.lists(st.tuples(group_st, key_st), min_size=1, max_size=10, unique=True),
                            st.integers(1, 100_000)), max_size=30)


def _narrow_fingerprints(wheel: TimerWheel, fp_bits: int | None) -> TimerWheel:
    """The wheel's index re-made with ``fp_bits``-bit fingerprints (None: as it is), so that
    keys share fingerprints and the probes (the compiled batch loops' too) must go on
    to the hash and the key bytes."""
    if fp_bits is not None:
        index = wheel._index
        slots = np.flatnonzero(index.cells >= 0)
        index.fp_mask = (1 << fp_bits) - 1
        assert index.rebuild(slots) == []
    return wheel


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops_st, fp_bits=st.sampled_from([None, 0, 1]))
def test_wheel_lookups_agree_with_a_dict_across_reattach(ops, fp_bits):
    wheel = _narrow_fingerprints(TimerWheel.create(32, tick_ms=1, wheel_size=8, start_ms=0, max_groups=4), fp_bits)
    model: dict[tuple[int, object], int] = {}
    try:
        for op, keys, deadline in ops:
            idents = [encode_ident(key) for _g, key in keys]
            groups = [g for g, _k in keys]
            if op == "schedule":
                for (group, key), ident in zip(keys, idents):
                    if (group, key) in model or len(model) < 32:
                        wheel.schedule_ident(ident, deadline, group)
                        model[(group, key)] = deadline
            elif op == "many":
                keys = [k for k in keys if k in model] + [k for k in keys if k not in model][: 32 - len(model)]
                slots, _gens = wheel.schedule_many([encode_ident(k) for _g, k in keys], deadline,
                                                   np.array([g for g, _k in keys], dtype=np.int64))
                assert (slots >= 0).all()
                model.update((k, deadline) for k in keys)
            elif op == "cancel":
                for (group, key), ident in zip(keys, idents):
                    assert wheel.cancel_ident(ident, group) == ((group, key) in model)
                    model.pop((group, key), None)
            elif op == "cancel_many":
                hit = wheel.cancel_many(idents, groups)
                assert hit.tolist() == [k in model for k in keys]
                for k in keys:
                    model.pop(k, None)
            else:
                wheel = _narrow_fingerprints(_reattached(wheel), fp_bits)
            for group in range(4):
                probe = [key for g, key in model if g == group]
                assert wheel.lookup_many([encode_ident(k) for k in probe], group) == [model[(group, k)] for k in probe]
        for group in range(4):
            for key in KEYS:
                assert wheel.lookup(key, group) == model.get((group, key))
        assert wheel.check() == []
    finally:
        wheel.close()


def test_problems_names_a_key_that_probing_cannot_reach_and_a_stale_hash():
    records = np.zeros(20, dtype=L.RECORD_DTYPE)
    index = KeyIndex(records, 16, max_groups=1)
    try:
        slots = []
        for slot, key in enumerate(range(10), start=4):
            ident = encode_ident(key)
            records["key_meta"][slot] = ident[0]
            records["key"][slot] = np.void(ident[1:])
            index.add(slot, index.key_hash(ident, 0))
            slots.append(slot)
        assert index.problems(np.array(slots)) == []
        victim = slots[3]
        cell = int(index.cells[victim])
        home = int(index.hashes[victim] & index.mask)
        empty = next(c for c in range(index.table.size) if index.table[(home - 1 - c) & index.mask] == -1)
        away = (home - 1 - empty) & index.mask  # an EMPTY cell just before its home: probing never gets there
        held = int(index.table[cell])  # the victim's slot and its fingerprint
        assert held & index.slot_mask == victim
        index.table[cell], index.table[away] = -1, held
        index.cells[victim] = away
        problems = index.problems(np.array(slots))  # emptying its old cell may cut other keys' paths too
        assert f"scheduled record {victim} is not found by its key" in problems
        unreachable = [s for s in slots if index.find(encode_ident(s - 4), 0) != s]
        assert problems == [f"scheduled record {s} is not found by its key" for s in unreachable]
        index.table[away], index.table[cell] = -1, held
        index.cells[victim] = cell
        assert index.problems(np.array(slots)) == []
        index.hashes[slots[0]] ^= 1 << 40
        assert f"scheduled record {slots[0]}: the key index holds a stale hash" in index.problems(np.array(slots))
    finally:
        index.close()
