"""Making, attaching and checking a :class:`~wheeld.shm.wheel.TimerWheel`'s arena: the
steps of "Crash consistency" in :mod:`wheeld.shm.wheel`'s docstring.

``create`` lays out a new arena; ``attach``/``recover`` map one that a writer may have
left anywhere: a committed intent is replayed, then every list (buckets, the fired
list, free records), the key index, the bucket heap and the per-group and per-level
counts are rebuilt from the records' states, the only truth the arena holds
(:meth:`WheelAttach._rebuild`). Records no interrupted writer can leave (an unknown
state, a malformed key, a group outside the table, an impossible deadline) are freed
and counted in ``lost``; the daemon can put them back from its journal
(:meth:`WheelAttach.rewrite_records`). ``check`` verifies every invariant.
"""

from __future__ import annotations

import struct
import time
from typing import Self

import numpy as np

from wheeld.protocol import arena_layout as L
from wheeld.protocol.errors import CorruptArena, InvalidRequest
from wheeld.protocol.keys import VALID_KEY_METAS, key_length

from . import fsck
from .arena import Segment
from .arrays import has_duplicates, run_starts
from .wheel_common import (  # the counters' indices, under this module's names
    C_PENDING as _C_PENDING, C_FIRED_UNACKED as _C_FIRED_UNACKED,
)
from .wheel_common import (
    COUNTER_INDEX, DEADLINE_HIGH, DEADLINE_LOW, DEFAULT_WHEEL_SIZE, GENERATION_MASK, LEVEL_SLOTS, MAX_CLOCK_MS,
    MAX_DELAY_MS, STR_META, TOTALS, VALID_META, default_levels,
)

__all__ = ["WheelAttach"]

_FREE, _SCHEDULED, _FIRED = L.FREE, L.SCHEDULED, L.FIRED
_STATE_MASK, _LEVEL_SHIFT = L.STATE_MASK, L.LEVEL_SHIFT
_CUR = L.H_CURRENT_MS // 8
_FREE_HEAD = L.H_FREE_HEAD // 4
_QW, _IW, _RB = L.Q_PER_RECORD, L.I_PER_RECORD, L.RECORD_BYTES
_NEXT, _GEN, _TAG = L.I_NEXT, L.I_GEN, L.I_TAG
_ST, _KM = L.R_STATE, L.R_KEY_META
_MAX_DELAY = MAX_DELAY_MS
_GEN_MASK = GENERATION_MASK


class WheelAttach:
    """The making-and-attaching room of :class:`~wheeld.shm.wheel.TimerWheel` (a mixin:
    it works on the wheel's record views and derived state, and asks the wheel for what
    only it may do in C: :meth:`~wheeld.shm.wheel.WheelRecords._fill_heap`,
    :meth:`~wheeld.shm.wheel.WheelRecords._unlink_free`)."""

    # ------------------------------------------------------------------ making and attaching
    @classmethod
    def create(
        cls,
        capacity: int,
        tick_ms: int = 1,
        wheel_size: int = DEFAULT_WHEEL_SIZE,
        name: str | None = None,
        start_ms: int = 0,
        *,
        levels: int | None = None,
        max_groups: int = L.DEFAULT_MAX_GROUPS,
        mode: int = 0o644,
        segment_factory=None,
        created_wall_ms: int | None = None,
    ) -> Self:
        """A new, empty wheel: in shared memory ``name``, or private memory when None; or in
        the segment ``segment_factory(size)`` returns (a :class:`~wheeld.shm.arena.Segment`
        of at least ``size`` bytes, zeroed, which the wheel then owns: the daemon makes its
        arena through its shared-memory port; ``name`` and ``mode`` are then unused).
        ``created_wall_ms`` stamps the arena's creation (default: the wall clock now)."""
        for label, value, low in (("capacity", capacity, 1), ("tick_ms", tick_ms, 1), ("wheel_size", wheel_size, 2)):
            if type(value) is not int or value < low:
                raise InvalidRequest(f"{label} must be an integer >= {low}, not {value!r}")
        if capacity >= (1 << 31) - 10_000:
            raise InvalidRequest("capacity must fit a 32-bit slot index")
        if levels is None:
            levels = default_levels(tick_ms, wheel_size)
        if type(levels) is not int or not 1 <= levels <= L.MAX_LEVELS:
            raise InvalidRequest(f"levels must be 1..{L.MAX_LEVELS}")
        if type(start_ms) is not int:
            raise InvalidRequest("start_ms must be an integer")
        if not 1 <= max_groups <= 65535:
            raise InvalidRequest("max_groups must be 1..65535")
        size = L.segment_bytes(capacity, levels, wheel_size, max_groups)
        if created_wall_ms is None:
            created_wall_ms = time.time_ns() // 1_000_000
        seg = Segment.create(name, size, mode=mode) if segment_factory is None else segment_factory(size)
        try:
            if seg.size < size:
                raise InvalidRequest(f"the segment made for the arena holds {seg.size} bytes, not {size}")
            buf = seg.buf
            L.HEADER_FIXED.pack_into(
                buf, 0, L.MAGIC, L.LAYOUT_VERSION, L.RECORD_BYTES, capacity, tick_ms, wheel_size,
                levels, start_ms, start_ms, -1, max_groups, created_wall_ms,
            )
            struct.pack_into("<i", buf, L.H_INTENT_SLOT, -1)
            name_bytes = b"default"
            buf[L.GROUPS_OFFSET : L.GROUPS_OFFSET + len(name_bytes)] = name_bytes
            wheel = cls(seg)
            wheel._rebuild()
            return wheel
        except BaseException:
            seg.close()
            seg.unlink()
            raise

    @classmethod
    def attach(cls, name: str) -> Self:
        """Map an existing arena, repair what an interrupted writer left, rebuild the rest."""
        return cls.recover(Segment.attach(name))

    @classmethod
    def recover(cls, seg: Segment) -> Self:
        """The wheel over the arena in ``seg`` after the recovery a restart makes: an open
        intent replayed, every list, the key index and the counts rebuilt from the records
        (``repairs`` lists the records freed as corrupt). The wheel owns ``seg`` from here."""
        try:
            wheel = cls(seg)
            clock = wheel.current_ms
            if not -MAX_CLOCK_MS <= clock < MAX_CLOCK_MS:
                raise CorruptArena(f"the arena's clock {clock} is beyond +-{MAX_CLOCK_MS}")
            wheel._replay_intent()
            wheel._rebuild()
            return wheel
        except BaseException:
            seg.close()
            raise

    def _replay_intent(self) -> bool:
        count = self._hi[L.H_INTENT_COUNT // 4]
        if count:  # a committed batch of re-arms: redo all of it (levels are re-derived by the rebuild)
            if not 0 < count <= L.INTENT_BATCH_MAX:
                raise CorruptArena(f"batch intent claims {count} entries")
            entries = self._intent_batch[:count]
            slots = entries["slot"].astype(np.int64)
            if slots.min() < self.first_entry or slots.max() >= self.n_records:
                raise CorruptArena("batch intent names slots outside the entry records")
            rec = self.records
            rec["deadline"][slots] = entries["deadline"]
            rec["tag"][slots] = entries["tag"]
            rec["state"][slots] = _SCHEDULED
            self._hi[L.H_INTENT_COUNT // 4] = 0
        slot = self._hi[L.H_INTENT_SLOT // 4]
        if slot == -1:  # no intent open (a writer never leaves another negative value)
            return bool(count)
        if not self.first_entry <= slot < self.n_records:
            raise CorruptArena(f"intent names slot {slot}, outside the entry records")
        self._q[slot * _QW] = self._hq[L.H_INTENT_DEADLINE // 8]
        self._u[slot * _IW + _TAG] = int.from_bytes(self._seg.buf[L.H_INTENT_TAG : L.H_INTENT_TAG + 4], "little")
        self._rb[slot * _RB + _ST] = self._hi[L.H_INTENT_STATE // 4]
        self._hi[L.H_INTENT_SLOT // 4] = -1
        return True

    # ------------------------------------------------------------------ repairs from outside
    def live_records(self) -> tuple[np.ndarray, ...]:
        """Every SCHEDULED or FIRED record: ``(slots, states, groups, deadlines, tags, idents)``,
        arrays in slot order (``idents``: the 33-byte record forms, meta byte + key)."""
        states = self.records["state"] & _STATE_MASK
        slots = np.flatnonzero(states != _FREE)
        slots = slots[slots >= self.first_entry]
        rec = self.records[slots]
        return (slots, states[slots], rec["group"].astype(np.int64), rec["deadline"].copy(),
                rec["tag"].astype(np.int64), self._idents[slots].copy())

    def rewrite_records(self, free=(), rewrite=(), restore=()) -> list[int]:
        """Repairs of corruption from a record of the truth kept outside the arena (the
        daemon's journal, :mod:`wheeld.daemon.reconcile`), made right after :meth:`attach`
        and before any other call; then everything derived is rebuilt as attach does.

        ``free``: slots of live records to free; ``rewrite``: ``(slot, state, deadline,
        tag)`` of live records (SCHEDULED or FIRED); ``restore``: ``(ident, group, state,
        deadline, tag)`` of records to make (in the lowest free slots, generation bumped, aux
        -1: a plain timer). The caller keeps the keys unique among SCHEDULED records.
        Returns the restored slots (-1 where the arena had no free record).

        Each record commits at its state byte, written last (as every writer here does),
        so a writer killed in the middle leaves records that attach takes as they are and a
        second pass of the same repairs finishes. Raises InvalidRequest (and changes
        nothing) for a slot that is not live, a deadline the clock does not reach within
        ``MAX_DELAY_MS``, a group outside the table, or a malformed ident.
        """
        rec, first, cur = self.records, self.first_entry, self.current_ms
        states = rec["state"] & _STATE_MASK
        for slot in list(free) + [r[0] for r in rewrite]:
            if not first <= slot < self.n_records or states[slot] == _FREE:
                raise InvalidRequest(f"slot {slot} is not a live record")
        for state, deadline in [(r[1], r[2]) for r in rewrite] + [(r[2], r[3]) for r in restore]:
            if state not in (_SCHEDULED, _FIRED) or not cur - _MAX_DELAY <= deadline <= cur + _MAX_DELAY:
                raise InvalidRequest(f"cannot write state {state}, deadline {deadline} (clock {cur})")
        for ident, group, _state, _deadline, tag in restore:
            if len(ident) != 33 or not VALID_KEY_METAS[ident[0]] or not 0 <= group < self.max_groups \
                    or not 0 <= tag <= 0xFFFFFFFF:
                raise InvalidRequest("malformed ident, group or tag")
        repairs = self.repairs
        for slot in free:
            rec["state"][slot] = _FREE
        for slot, state, deadline, tag in rewrite:
            rec["deadline"][slot] = deadline
            rec["tag"][slot] = tag
            rec["state"][slot] = state  # commit point
        vacant = np.flatnonzero(rec["state"][first:] & _STATE_MASK == _FREE)[: len(restore)] + first
        made = []
        for n, (ident, group, state, deadline, tag) in enumerate(restore):
            if n >= vacant.size:
                made.append(-1)
                continue
            slot = int(vacant[n])
            rec["gen"][slot] = (int(rec["gen"][slot]) + 1) & _GEN_MASK
            rec["tag"][slot] = tag
            rec["aux"][slot] = -1
            rec["group"][slot] = group
            rec["deadline"][slot] = deadline
            base = slot * _RB
            self._rb[base + _KM : base + _RB] = ident
            rec["state"][slot] = state  # commit point
            made.append(slot)
        self._rebuild()  # (adds what it finds to lost, and lists it in repairs)
        self.repairs = repairs + self.repairs
        return made

    def mask_generation(self, slot: int, generation: int) -> int | None:
        """A FIRED record whose generation reads beyond 31 bits (``GENERATION_MASK``: every
        allocation masks it, so only damage puts it there) gets it masked, one aligned
        store; returns the new generation, or None when ``(slot, generation)`` is not such a
        record. Expirations carry generations as signed 32-bit values."""
        if not self.first_entry <= slot < self.n_records or self._rb[slot * _RB + _ST] != _FIRED:
            return None
        if self._u[slot * _IW + _GEN] != generation or generation <= _GEN_MASK:
            return None
        self._u[slot * _IW + _GEN] = generation & _GEN_MASK
        return generation & _GEN_MASK

    # ------------------------------------------------------------------ rebuild
    def _rebuild(self) -> None:
        """Derive links, free list, key index, bucket heap and counts from the records."""
        rec = self.records
        first = self.first_entry
        self.repairs = self._free_invalid()
        idx = np.arange(first, dtype=np.int32)  # sentinels: empty circular lists
        rec["prev"][:first] = idx
        rec["next"][:first] = idx
        rec["deadline"][:first] = -1
        rec["state"][:first] = 0
        slots = np.arange(first, self.n_records, dtype=np.int64)
        states = rec["state"][first:] & _STATE_MASK
        free_slots = slots[states == _FREE]
        self._free_np[: free_slots.size] = free_slots[::-1]  # a stack that hands out the lowest slot first
        self._free_top = int(free_slots.size)
        self._hi[_FREE_HEAD] = -1  # unused: the free list is kept in the owning process
        fired = slots[states == _FIRED]
        self._chain(self.fired_list, fired[np.argsort(rec["deadline"][fired], kind="stable")])  # in deadline order
        sched = slots[states == _SCHEDULED]
        self._rebuild_buckets(sched)
        for s, kept in self._index.rebuild(sched):  # never written by a wheel, but the index must stay sound
            self.repairs.append(f"record {s}: duplicate key of record {kept}, cancelled")
            self.lost += 1
            rec["state"][s] = _FREE
            self._unlink_free(s)
        self._recount()
        # an unused group id (first byte 0) keeps no bytes: what a writer killed while
        # registering or forgetting a name left behind is cleared
        table = self._group_bytes
        unused = table[:, 0] == 0
        if table[unused].any():
            table[unused] = 0
        self.publish_stats()

    def _free_invalid(self) -> list[str]:
        """Free the live records with an unknown state, a malformed key, a group id outside
        the table or a deadline no clock the wheel accepts is within ``MAX_DELAY_MS`` of:
        not something an interrupted writer can leave, but corruption (each is counted in
        ``lost``: its timer is gone unless someone restores it). A generation beyond 31 bits
        (``GENERATION_MASK``, which every allocation applies) is masked back into range.
        Returns the repairs made (the daemon logs them)."""
        entries = self.records[self.first_entry :]
        states = entries["state"] & _STATE_MASK
        metas = entries["key_meta"]
        deadlines = entries["deadline"]
        invalid = (states > _FIRED) | ((states != _FREE) & (~VALID_META[metas] | (entries["group"] >= self.max_groups)
                                                           | (deadlines < DEADLINE_LOW)
                                                           | (deadlines > DEADLINE_HIGH)))
        wild = np.flatnonzero((entries["gen"] > _GEN_MASK) & (states != _FREE) & ~invalid)
        masked = [f"record {self.first_entry + s}: generation {g} beyond 31 bits, masked"
                  for s, g in zip(wild.tolist(), entries["gen"][wild].tolist())]
        entries["gen"][wild] &= _GEN_MASK
        text = np.flatnonzero(~invalid & (states != _FREE) & STR_META[metas])  # live string keys: valid UTF-8?
        rb, first = self._rb, self.first_entry
        for s in text.tolist():
            base = (first + s) * _RB + L.R_KEY
            try:
                str(rb[base : base + key_length(int(metas[s]))], "utf-8")
            except UnicodeDecodeError:
                invalid[s] = True
        bad = np.flatnonzero(invalid)
        entries["state"][bad] = _FREE
        self.lost += int(bad.size)
        return masked + [f"record {self.first_entry + s}: invalid state/key/group/deadline, freed"
                         for s in bad.tolist()]

    def _rebuild_buckets(self, sched: np.ndarray) -> None:
        """Link the scheduled records into the buckets their deadlines map to relative to the
        stored clock (level bits included) and queue every non-empty bucket."""
        rec = self.records
        cur = int(self._hq[_CUR])
        buckets, expirations, levels = self._buckets_for(rec["deadline"][sched], cur)
        rec["state"][sched] = ((levels << _LEVEL_SHIFT) | _SCHEDULED).astype(np.uint8)
        order = np.lexsort((sched, buckets))
        sched, buckets, expirations = sched[order], buckets[order], expirations[order]
        self._queued = [-1] * self.first_entry
        pairs = []
        if sched.size:
            starts = run_starts(buckets)
            ends = np.r_[starts[1:], sched.size]
            for a, z in zip(starts.tolist(), ends.tolist()):
                b = int(buckets[a])
                self._chain(b, sched[a:z])
                expiration = int(expirations[a])
                rec["deadline"][b] = expiration
                self._queued[b] = expiration
                pairs.append((expiration, b))
        self._fill_heap(pairs)

    def _recount(self) -> None:
        """The counts this process keeps, from the records' states: pending, fired, per
        level, per group; the totals from the header (they survive restarts)."""
        states = self.records["state"][self.first_entry :]
        low = states & _STATE_MASK
        levels = (states[low == _SCHEDULED] >> _LEVEL_SHIFT).astype(np.int64)
        self._pending_by_level = self._new_counts(np.bincount(levels, minlength=LEVEL_SLOTS).tolist())
        live = low != _FREE
        self._group_live = self._new_counts(np.bincount(self.records["group"][self.first_entry :][live],
                                                     minlength=self.max_groups).tolist())
        c = self._count
        c[_C_PENDING] = int(levels.size)
        c[_C_FIRED_UNACKED] = int(np.count_nonzero(low == _FIRED))
        base = L.H_COUNTERS // 8
        for name in TOTALS:  # a damaged word is clamped (L.sane_counter): a restart must not overflow it
            c[COUNTER_INDEX[name]] = max(c[COUNTER_INDEX[name]], L.sane_counter(self._hq[base + L.COUNTER[name]]))

    def _chain(self, sentinel: int, slots: np.ndarray) -> None:
        rec = self.records
        if not slots.size:
            rec["next"][sentinel] = sentinel
            rec["prev"][sentinel] = sentinel
            return
        ring = np.concatenate(([sentinel], slots))
        rec["next"][ring] = np.roll(ring, -1)
        rec["prev"][ring] = np.roll(ring, 1)

    # ------------------------------------------------------------------ invariants
    def check(self) -> list[str]:
        """Every invariant; a list of problems, [] when sound.

        The arena's (:func:`wheeld.shm.fsck.fsck`, against this process's counters,
        published or not), then those of the state only this process keeps: the key
        index, the free stack, the bucket queue and the live count of each group.
        """
        problems = fsck.fsck(self._seg.buf, self._seg.size, self.name or "arena", counters=self.counters())
        states = self.records["state"] & _STATE_MASK
        entry = np.arange(self.n_records) >= self.first_entry
        problems += self._index.problems(np.flatnonzero(entry & (states == _SCHEDULED)))
        problems += self._free_stack_problems(np.flatnonzero(entry & (states == _FREE)))
        i, queued = self._i, self._queued
        for b in range(self.fired_list):
            if i[b * _IW + _NEXT] != b and queued[b] != self._q[b * _QW]:
                problems.append(f"bucket {b} (expiration {self._q[b * _QW]}) is not in the bucket queue")
        live = (states != _FREE) & entry
        recount = np.bincount(self.records["group"][live].astype(np.int64), minlength=self.max_groups)
        counts = self.group_counts()
        if recount.size == counts.size:  # else fsck reported a live record outside the group table
            for gid in np.flatnonzero(recount != counts)[:10].tolist():
                problems.append(f"group {gid}: live count {counts[gid]}, {recount[gid]} records are live")
        return problems

    def _free_stack_problems(self, free: np.ndarray) -> list[str]:
        """The free stack holds exactly the free records, each once."""
        stack = self._free_np[: self._free_top]
        if np.array_equal(np.sort(stack), free):
            return []
        if has_duplicates(stack):
            return ["free list: a slot is listed twice"]
        return [f"free list holds {stack.size} records, {free.size} are free; "
                f"{np.setdiff1d(stack, free).size} of them are not free records"]
