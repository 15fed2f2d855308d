"""The batch operations of a :class:`~wheeld.shm.wheel.TimerWheel` computed with numpy:
the Python path's implementation, and the reference the compiled C loops
(``_c_*`` in ``shm/wheel.pxd``) are held to (tests/test_compiled_differential.py).

Each batch method has the meaning of its scalar method called on every item in order
(results item by item): record fields, placement, key-index probing and list splicing
are vectorized; only hashing the keys and walking due buckets stay per item. Batches
that name one key twice take the scalar path; re-arms go through the batch intent (see
``_rearm_many``). Crash consistency is that of the scalar methods, record by record:
every record's fields and links are written before its state byte, which commits it. A
batch interrupted by a crash therefore leaves each of its items done or not done (not
necessarily a prefix), and no record half-written.

The entry points (``schedule_many``, ``cancel_many``, ``expire_many``, ``release_many``)
are :class:`~wheeld.shm.wheel.TimerWheel`'s: they check the input, then run the C loops
when compiled and the ``*_np`` methods here otherwise.
"""

from __future__ import annotations

import numpy as np

from wheeld.protocol import arena_layout as L
from wheeld.protocol.errors import ArenaFull, InvalidKey, InvalidRequest

from .arrays import first_of_each, has_duplicates, run_starts
from .wheel_common import (  # the counters' indices, under this module's names
    C_PENDING as _C_PENDING, C_FIRED_UNACKED as _C_FIRED_UNACKED, C_ADDS as _C_ADDS, C_REARMS as _C_REARMS,
    C_CANCELS as _C_CANCELS, C_CANCEL_MISSES as _C_CANCEL_MISSES, C_CASCADES as _C_CASCADES, C_ACKS as _C_ACKS,
    C_ARENA_FULL as _C_ARENA_FULL,
)
from .wheel_common import GENERATION_MASK, LEVEL_SLOTS, VALID_META

__all__ = ["NumpyBatches"]

_FREE, _SCHEDULED, _FIRED = L.FREE, L.SCHEDULED, L.FIRED
_LEVEL_SHIFT = L.LEVEL_SHIFT
_DUE_LEVEL = L.DUE_LEVEL
_CUR = L.H_CURRENT_MS // 8
_IW = L.I_PER_RECORD
_PREV, _NEXT = L.I_PREV, L.I_NEXT


class NumpyBatches:
    """The numpy batch room of :class:`~wheeld.shm.wheel.TimerWheel` (a mixin: it works on
    the wheel's ``records`` array, its views and its derived state)."""

    def _batch_idents(self, idents) -> tuple[list[bytes], np.ndarray]:
        """(list of 33-byte idents, the same as a V33 array) from either form."""
        if isinstance(idents, np.ndarray):
            if idents.dtype.itemsize != 33 or idents.ndim != 1:
                raise InvalidKey("encoded keys are a 1-d array of 33-byte items (meta + padded key)")
            array = np.ascontiguousarray(idents).view("V33")
            return array.tolist(), array
        items = list(idents)
        if any(type(x) is not bytes or len(x) != 33 for x in items):
            raise InvalidKey("encoded keys are 33-byte bytes objects (meta + padded key)")
        return items, np.array(items, dtype="S33").view("V33")

    def _batch_column(self, values, n: int, low: int, high: int, what: str, exc=InvalidRequest) -> np.ndarray:
        try:
            array = np.asarray(values)
        except (OverflowError, ValueError) as error:
            raise exc(f"{what}: {error}") from None
        if array.dtype.kind not in "iu" or array.ndim > 1 or (array.ndim == 1 and array.size != n):
            raise exc(f"{what}: {n} integers expected")
        array = np.broadcast_to(array.astype(np.int64, copy=False), (n,))
        if n and (int(array.min()) < low or int(array.max()) > high):
            raise exc(f"{what} out of range [{low}, {high}]")
        return array

    def _schedule_many_np(self, ident_list, ident_arr, deadlines, groups, tags, auxs, cur, slots_out, gens_out):
        """:meth:`~wheeld.shm.wheel.TimerWheel.schedule_many` after its checks, with numpy."""
        if not VALID_META[ident_arr.view(np.uint8)[::33]].all():
            raise InvalidKey("malformed encoded key")
        hashes = self._index.key_hashes(ident_list, groups)
        if has_duplicates(hashes):  # a key twice: keep the order of the scalar path
            return self._schedule_each(ident_list, deadlines, groups, tags, auxs, slots_out, gens_out)
        found = self._index.find_many(ident_arr, hashes, groups)
        rearm = np.flatnonzero(found >= 0)
        if rearm.size:
            self._rearm_many(found[rearm], deadlines[rearm], tags[rearm], cur)
            slots_out[rearm] = found[rearm]
        new = np.flatnonzero(found < 0)
        if new.size > self._free_top:
            self._count[_C_ARENA_FULL] += int(new.size - self._free_top)
            new = new[: self._free_top]
        if new.size:
            slots_out[new] = self._add_many(ident_arr[new], hashes[new], deadlines[new], groups[new], tags[new],
                                            auxs[new], cur)
        gens_out[slots_out >= 0] = self.records["gen"][slots_out[slots_out >= 0]]
        return slots_out, gens_out

    def _cancel_many_np(self, ident_list, ident_arr, groups, n):
        """:meth:`~wheeld.shm.wheel.TimerWheel.cancel_many` after its checks, with numpy."""
        hashes = self._index.key_hashes(ident_list, groups)
        if has_duplicates(hashes):
            return np.array([self.cancel_ident(ident_list[j], int(groups[j])) for j in range(n)], dtype=bool)
        found = self._index.find_many(ident_arr, hashes, groups)
        hit = found >= 0
        slots = found[hit]
        self._remove_scheduled_many(slots)
        self._count_groups(groups[hit], -1)
        c = self._count
        c[_C_CANCELS] += int(slots.size)
        c[_C_CANCEL_MISSES] += int(n - slots.size)
        return hit

    def _expire_many_np(self, now_ms: int) -> np.ndarray:
        """:meth:`~wheeld.shm.wheel.TimerWheel.expire_many` after its checks, with numpy."""
        whole, chains, mixed = self._collect_buckets(now_ms)
        if not whole and not mixed:
            return np.zeros(0, dtype=np.int64)
        rec = self.records
        fired = np.array(whole, dtype=np.int64)
        if whole and int(rec["deadline"][fired].max()) > now_ms:  # not in a sound arena: stay exact anyway
            mixed, chains = whole + mixed, []
            fired = fired[:0]
        again = fired[:0]
        fired_one_by_one = fired[:0]
        if mixed:
            slots = np.array(mixed, dtype=np.int64)
            deadlines = rec["deadline"][slots]
            due = deadlines <= now_ms
            fired_one_by_one = slots[due]
            again = slots[~due]
            fired = np.concatenate((fired, fired_one_by_one))
        if fired.size:
            self._index.remove_many(fired)
            self._join_fired(chains)
            if fired_one_by_one.size:
                self._append_run(self.fired_list, fired_one_by_one)
            rec["state"][fired] = _FIRED  # commit points
        if again.size:
            buckets, expirations, levels = self._buckets_for(deadlines[~due], int(self._hq[_CUR]))
            self._splice_many(again, buckets, expirations)
            rec["state"][again] = (levels << _LEVEL_SHIFT) | _SCHEDULED
            self._count_levels(levels, +1)
        self._count_expired(int(fired.size), int(again.size))
        return fired

    def _release_many_np(self, slots: np.ndarray, generations: np.ndarray) -> np.ndarray:
        """:meth:`~wheeld.shm.wheel.TimerWheel.release_many` after its checks, with numpy."""
        rec = self.records
        ok = (slots >= self.first_entry) & (slots < self.n_records)
        if ok.all():
            ok = (rec["state"][slots] == _FIRED) & (rec["gen"][slots] == generations)
        else:
            inside = slots[ok]
            ok[ok] = (rec["state"][inside] == _FIRED) & (rec["gen"][inside] == generations[ok])
        if ok.any() and has_duplicates(slots[ok]):  # a slot named twice is released once
            index = np.flatnonzero(ok)
            ok[:] = False
            ok[index[first_of_each(slots[index])]] = True
        released = slots[ok]
        if released.size:
            rec["state"][released] = _FREE  # commit points (the lists are derived: unlinked after)
            self._unlink_many(released)
            self._free_many(released)
            self._count_groups(rec["group"][released], -1)
            c = self._count
            c[_C_FIRED_UNACKED] -= int(released.size)
            c[_C_ACKS] += int(released.size)
        return ok

    def _collect_buckets(self, now_ms: int) -> tuple[list[int], list[tuple[int, int]], list[int]]:
        """:meth:`_collect` for :meth:`expire_many`: detach every bucket due at ``now_ms``
        and advance the clock. Returns the slots of level-0 buckets and of the due list
        (they fire whole), the (first, last) record of each of those chains, and the
        slots of higher-level buckets (to be re-checked). Per-level counts drop here."""
        i = self._i
        by_level, ws, due_list = self._pending_by_level, self.wheel_size, self.due_list
        whole: list[int] = []
        mixed: list[int] = []
        chains: list[tuple[int, int]] = []
        for b in self._due_buckets(now_ms):
            bp = b * _IW
            s = i[bp + _NEXT]
            if b < ws or b == due_list:
                out = whole
                chains.append((s, i[bp + _PREV]))
            else:
                out = mixed
            before = len(out)
            while s != b:
                out.append(s)
                s = i[s * _IW + _NEXT]
            by_level[_DUE_LEVEL if b == due_list else b // ws] -= len(out) - before
            i[bp + _PREV] = b
            i[bp + _NEXT] = b
        if now_ms > self._hq[_CUR]:
            self._hq[_CUR] = now_ms  # after detaching, before re-placing (see Crash consistency)
        return whole, chains, mixed

    def _schedule_each(self, ident_list, deadlines, groups, tags, auxs, slots_out, gens_out):
        """:meth:`schedule_many` one by one with the scalar method (a key in the batch twice)."""
        for j in range(len(ident_list)):
            try:
                slots_out[j], gens_out[j] = self.schedule_ident(
                    ident_list[j], int(deadlines[j]), int(groups[j]), int(tags[j]), int(auxs[j]))
            except ArenaFull:
                pass
        return slots_out, gens_out

    def _add_many(self, idents: np.ndarray, hashes: np.ndarray, deadlines: np.ndarray, groups: np.ndarray,
                  tags: np.ndarray, auxs: np.ndarray, cur: int) -> np.ndarray:
        """New timers for absent keys, as many as there are free records: fields, links, then
        each state byte (its commit point); returns their slots."""
        rec = self.records
        top, k = self._free_top, idents.size
        slots = self._free_np[top - k : top][::-1].astype(np.int64)
        # wraps like the scalar path
        rec["gen"][slots] = (rec["gen"][slots] + np.uint32(1)) & np.uint32(GENERATION_MASK)
        rec["tag"][slots] = tags
        rec["aux"][slots] = auxs
        rec["group"][slots] = groups
        rec["deadline"][slots] = deadlines
        self._idents[slots] = idents
        buckets, expirations, levels = self._buckets_for(deadlines, cur)
        self._splice_many(slots, buckets, expirations)
        rec["state"][slots] = (levels << _LEVEL_SHIFT) | _SCHEDULED  # commit points
        self._free_top = top - k
        self._count_levels(levels, +1)
        self._index.add_many(slots, hashes)
        self._count_groups(groups, +1)
        c = self._count
        c[_C_PENDING] += k
        c[_C_ADDS] += k
        return slots

    def _join_fired(self, chains: list[tuple[int, int]]) -> None:
        """Each whole bucket, a (head, tail) chain, joins the end of the fired list (four link stores)."""
        i, fl = self._i, self.fired_list
        flp = fl * _IW
        for head, tail in chains:
            last = i[flp + _PREV]
            i[head * _IW + _PREV] = last
            i[last * _IW + _NEXT] = head
            i[tail * _IW + _NEXT] = fl
            i[flp + _PREV] = tail

    def _move_to_level0(self, slots: np.ndarray, after: int, cur: int) -> int:
        """Move the records of a run of a level-1 bucket (``slots``, in list order, ``after``
        the record that follows the run) whose deadlines level 0 reaches from ``cur`` to
        their level-0 buckets; the others stay in place. Returns how many moved."""
        if not slots.size:
            return 0
        rec, i = self.records, self._i
        buckets, expirations, levels = self._buckets_for(rec["deadline"][slots], cur)
        fit = levels == 0
        moved = int(np.count_nonzero(fit))
        if not moved:
            return 0
        # the run, minus the moved records, stays in place between its neighbours
        kept = slots[~fit]
        chain = np.empty(kept.size + 2, dtype=np.int64)
        chain[0] = i[int(slots[0]) * _IW + _PREV]
        chain[1:-1] = kept
        chain[-1] = after
        rec["next"][chain[:-1]] = chain[1:]
        rec["prev"][chain[1:]] = chain[:-1]
        going = slots[fit]
        self._splice_many(going, buckets[fit], expirations[fit])
        rec["state"][going] = _SCHEDULED  # level 0 (derived: a rebuild places them the same)
        by_level = self._pending_by_level
        by_level[1] -= moved
        by_level[0] += moved
        self._count[_C_CASCADES] += moved
        return moved

    # ------------------------------------------------------------------ helpers
    def _count_levels(self, levels: np.ndarray, sign: int) -> None:
        counts = np.bincount(levels, minlength=LEVEL_SLOTS).tolist()
        by_level = self._pending_by_level
        for level, count in enumerate(counts):
            if count:
                by_level[level] += sign * count

    def _free_many(self, slots: np.ndarray) -> None:
        top = self._free_top
        self._free_np[top : top + slots.size] = slots
        self._free_top = top + slots.size

    def _rearm_many(self, slots: np.ndarray, deadlines: np.ndarray, tags: np.ndarray, cur: int) -> None:
        """Vectorized :meth:`_rearm` of distinct scheduled records, through the batch intent.

        Links first (derived state), then the intent entries, then the count word
        (the commit point of the whole batch), then the records, then count = 0.
        """
        rec, hi = self.records, self._hi
        for at in range(0, slots.size, L.INTENT_BATCH_MAX):
            part = slots[at : at + L.INTENT_BATCH_MAX]
            d = deadlines[at : at + L.INTENT_BATCH_MAX]
            t = tags[at : at + L.INTENT_BATCH_MAX]
            k = part.size
            self._count_levels((rec["state"][part] >> _LEVEL_SHIFT).astype(np.int64), -1)
            self._unlink_many(part, linked=True)
            buckets, expirations, levels = self._buckets_for(d, cur)
            self._splice_many(part, buckets, expirations)
            intent = self._intent_batch
            intent["slot"][:k] = part
            intent["tag"][:k] = t
            intent["deadline"][:k] = d
            hi[L.H_INTENT_COUNT // 4] = k  # commit the batch
            rec["deadline"][part] = d
            rec["tag"][part] = t
            rec["state"][part] = (levels << _LEVEL_SHIFT) | _SCHEDULED
            hi[L.H_INTENT_COUNT // 4] = 0  # done
            self._count_levels(levels, +1)
            self._count[_C_REARMS] += k

    def _remove_scheduled_many(self, slots: np.ndarray) -> None:
        """Vectorized :meth:`_remove_scheduled` of distinct scheduled slots."""
        if not slots.size:
            return
        rec = self.records
        self._count_levels((rec["state"][slots] >> _LEVEL_SHIFT).astype(np.int64), -1)
        rec["state"][slots] = _FREE  # commit points (the lists are derived: unlinked after)
        self._unlink_many(slots)
        self._index.remove_many(slots)
        self._free_many(slots)
        self._count[_C_PENDING] -= int(slots.size)

    def _unlink_many(self, slots: np.ndarray, linked: bool = False) -> None:
        """Unlink distinct records from their lists; neighbours may be among them.

        The records are already committed FREE (a neighbour to skip is then an
        entry record in state FREE, as no linked record is otherwise), or, with
        ``linked``, still live (re-arms: membership is looked up in the sorted
        slots). Whole runs of a bucket are common: each record's nearest surviving
        neighbours are found by pointer jumping on its own prev/next fields (each
        round doubles the distance covered).
        """
        rec = self.records
        state, first = rec["state"], self.first_entry
        if linked:
            ordered = np.sort(slots)

            def skipped(to: np.ndarray) -> np.ndarray:
                at = np.searchsorted(ordered, to)
                at[at == ordered.size] = 0
                return ordered[at] == to
        else:

            def skipped(to: np.ndarray) -> np.ndarray:
                return (to >= first) & (state[to] == _FREE)

        prev = rec["prev"][slots].astype(np.int64)
        nxt = rec["next"][slots].astype(np.int64)
        prev_kept = ~skipped(prev)
        next_kept = ~skipped(nxt)
        if prev_kept.all() or np.count_nonzero(prev_kept) == 1:  # no two adjacent, or one run
            before, after = prev[prev_kept], nxt[next_kept]
            rec["next"][before] = after
            rec["prev"][after] = before
            return
        for field in ("prev", "next"):
            links = rec[field]
            while True:
                to = links[slots].astype(np.int64)
                skip = skipped(to)
                if not skip.any():
                    break
                links[slots[skip]] = links[to[skip]]
        prev = rec["prev"][slots]
        nxt = rec["next"][slots]
        rec["next"][prev] = nxt
        rec["prev"][nxt] = prev

    def _splice_many(self, slots: np.ndarray, sentinels: np.ndarray, expirations: np.ndarray | None) -> None:
        """Append records to the tails of their lists (in the order given, per list).

        ``expirations`` (None for the fired list) are the bucket times: a bucket that
        was empty gets its expiration and is queued, as :meth:`_link` does.
        """
        rec = self.records
        keys = sentinels.astype(np.uint16) if self.first_entry <= 0xFFFF else sentinels
        order = np.argsort(keys, kind="stable")  # a radix sort for 16-bit keys
        chain = slots[order]
        owner = sentinels[order]
        n = chain.size
        starts = run_starts(owner)
        ends = np.empty_like(starts)
        ends[:-1] = starts[1:] - 1
        ends[-1] = n - 1
        heads = owner[starts]
        tails = rec["prev"][heads].astype(np.int64)
        prev = np.empty(n, dtype=np.int64)
        prev[1:] = chain[:-1]
        prev[starts] = tails
        nxt = np.empty(n, dtype=np.int64)
        nxt[:-1] = chain[1:]
        nxt[ends] = heads
        rec["prev"][chain] = prev
        rec["next"][chain] = nxt
        rec["next"][tails] = chain[starts]
        rec["prev"][heads] = chain[ends]
        if expirations is None:
            return
        was_empty = tails == heads
        if was_empty.any():
            due_list = self.due_list
            cur = int(self._hq[_CUR])
            bucket_exp = expirations[order][starts]
            for b, expiration in zip(heads[was_empty].tolist(), bucket_exp[was_empty].tolist()):
                if b == due_list:
                    expiration = cur
                rec["deadline"][b] = expiration
                self._queue_bucket(b, expiration)

    def _append_run(self, sentinel: int, run: np.ndarray) -> None:
        """Append distinct records, in order, to the tail of one list."""
        rec, i = self.records, self._i
        sp = sentinel * _IW
        last = i[sp + _PREV]
        prev = np.empty(run.size, dtype=np.int64)
        prev[0] = last
        prev[1:] = run[:-1]
        nxt = np.empty(run.size, dtype=np.int64)
        nxt[:-1] = run[1:]
        nxt[-1] = sentinel
        rec["prev"][run] = prev
        rec["next"][run] = nxt
        i[last * _IW + _NEXT] = int(run[0])
        i[sp + _PREV] = int(run[-1])
