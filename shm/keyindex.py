"""The wheel's key index: (group, key) -> slot of the scheduled timer, in the owning process.

An open-addressing hash table of record indices (linear probing). A deletion
moves the rest of its cluster back into the hole (backward-shift deletion), so
there are no tombstones to pile up and no rebuilds while running. The table has
at least two cells per record (a power of two, int32 cells); per record it
keeps the key's hash (int64) and the cell holding it (int32): 8-16 bytes of
table and 12 bytes per record, instead of a Python dict's ~100 bytes per key.

Keys are not stored here: a cell names a record, and a probe compares the
record's 33 key bytes (meta byte + zero-padded key) and its group id. A cell's
bits above those a slot number needs (7 of 31 at 10M records, 11 at 1M) hold a
*fingerprint*, bits of the key's hash: a probe passes over a cell whose
fingerprint differs without reading that record's hash, which at millions of
timers is a cache miss per occupied cell passed (the cell names slot
``cell & slot_mask``; an EMPTY cell is -1, an occupied one is >= 0). The hash
of a key is ``hash(ident) ^ mix(group)`` (:meth:`KeyIndex.key_hash`); Python
salts ``hash`` per process, so the index is derived state of the process that
owns the wheel, rebuilt from the records on attach (:meth:`KeyIndex.rebuild`).

The batch methods (``*_many``) mean what the scalar ones mean called item by
item, computed with numpy: one gather of an 8-cell probe window per key,
and deletions of a whole batch with each cluster that loses keys re-packed at
once (:meth:`KeyIndex.remove_many`).
"""

from __future__ import annotations

from array import array

import numpy as np

from wheeld.protocol import arena_layout as L

from .arrays import first_of_each, run_starts

__all__ = ["KeyIndex", "EMPTY"]

EMPTY = -1  # a cell never used (or emptied by a deletion)
_EMPTY = EMPTY  # the scalar paths' name for it (a C constant in the compiled build)
_GROUP_MIX = 0x9E3779B97F4A7C15
_WINDOW = 8  # vectorized probing gathers this many cells per key at once
_WINDOW_STEPS = np.arange(_WINDOW, dtype=np.int64)
_TAIL_CELLS = 16  # cluster-end search: cells looked at per freed cell before walking
_RB, _HW, _GROUP, _KM = L.RECORD_BYTES, L.H_PER_RECORD, L.H_GROUP_WORD, L.R_KEY_META
_IDENT_BYTES = L.KEY_BYTES + 1  # a record's key meta byte and its padded key
# Compiled (keyindex.pxd), a probe compares a bytes key with memcmp (_key_equal)
# instead of slicing the record view: the same answer, without two temporary objects.
_COMPILED = not __file__.endswith(".py")


def _signed64(value: int) -> int:
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


class KeyIndex:
    """The index over ``records`` (an arena's records as a ``RECORD_DTYPE`` array, or any
    array of that dtype): ``capacity`` entry records, group ids below ``max_groups``."""

    def __init__(self, records: np.ndarray, capacity: int, max_groups: int) -> None:
        n_records = records.size
        raw = records.view(np.uint8)
        self._rb = memoryview(raw)  # record s's key bytes are _rb[s * 64 + 31 : s * 64 + 64]
        self._keys = self._rb  # the same bytes: a C array in the compiled build (keyindex.pxd)
        h_view = memoryview(records.view(np.uint16))
        self._h = h_view  # record s's group is _h[s * 32 + 14]
        self._idents = np.ndarray(shape=(n_records,), dtype="V33", buffer=raw, offset=_KM, strides=(_RB,))
        self._groups = records["group"]
        size = 16
        while size < 2 * capacity:
            size *= 2
        self.table = np.full(size, EMPTY, dtype=np.int32)
        table_view = memoryview(self.table)
        self._table = table_view
        self._rows = np.lib.stride_tricks.sliding_window_view(self.table, _TAIL_CELLS)  # a view
        self.mask = size - 1
        slot_bits = max(1, (n_records - 1).bit_length())
        self.slot_bits = slot_bits
        self.slot_mask = (1 << slot_bits) - 1
        self.fp_mask = (1 << max(0, 31 - slot_bits)) - 1  # 0: no bits left, every fingerprint is 0
        self.hashes = np.zeros(n_records, dtype=np.int64)
        hash_view = memoryview(self.hashes)
        self._hash = hash_view
        self.cells = np.full(n_records, -1, dtype=np.int32)
        pos_view = memoryview(self.cells)
        self._pos = pos_view
        self._views = (self._rb, h_view, table_view, hash_view, pos_view)  # released by close()
        self.used = 0  # occupied cells (= scheduled timers)
        self._vacant_cell = 0  # find's last miss: the EMPTY cell its probe ended at, and the key's hash
        self._vacant_hash = 0
        self.gmix = [_signed64(g * _GROUP_MIX) for g in range(max_groups)]
        self._gmix_np = np.array(self.gmix, dtype=np.int64)
        # the same values: a C array for the compiled scalar paths (the Python path reads a list faster)
        self._gmix = memoryview(array("q", self.gmix)) if _COMPILED else self.gmix

    def close(self) -> None:
        """Drop every view of the records (the arena can be unmapped after this)."""
        views = self._views
        # the typed views of the compiled build, first
        self._h = self._table = self._hash = self._pos = self._keys = None
        self._rb = self._idents = self._groups = None
        for view in views:
            view.release()

    # ------------------------------------------------------------------ hashing
    def stamp(self, h: int) -> int:
        """The fingerprint bits of a cell that holds a key with hash ``h`` (bits 33.. of the
        hash: the home cell takes the low bits, a table has at most 2**32 cells)."""
        return ((h >> 33) & self.fp_mask) << self.slot_bits

    def stamps(self, hashes: np.ndarray) -> np.ndarray:
        """:meth:`stamp` of an int64 array of hashes (as int32 cell bits)."""
        return (((hashes >> 33) & self.fp_mask) << self.slot_bits).astype(np.int32)

    def key_hash(self, ident: bytes, group: int) -> int:
        """The hash of (group, ident): ``hash(ident) ^ mix(group)``."""
        return hash(ident) ^ self._gmix[group]

    def key_hashes(self, idents: list[bytes], groups: np.ndarray) -> np.ndarray:
        """:meth:`key_hash` of every item, as an int64 array."""
        hashes = np.fromiter(map(hash, idents), dtype=np.int64, count=len(idents))
        return hashes ^ self._gmix_np[groups]

    # ------------------------------------------------------------------ one key
    def find(self, ident: bytes, group: int) -> int:
        """Slot of the indexed record with key (group, ident), or -1."""
        h = hash(ident) ^ self._gmix[group]  # key_hash, written out: the scalar hot path
        g = group
        mask = self.mask
        p = h & mask
        stamp = ((h >> 33) & self.fp_mask) << self.slot_bits
        smask = self.slot_mask
        while True:  # the views through self: a compiled local copy of one costs two atomic updates
            c = self._table[p]
            if c == _EMPTY:
                self._vacant_cell = p  # where add_vacant puts this key
                self._vacant_hash = h
                return -1
            s = c ^ stamp  # the slot, if the fingerprint matches
            if s <= smask and self._hash[s] == h and self._h[s * _HW + _GROUP] == g:
                base = s * _RB + _KM
                if _COMPILED and type(ident) is bytes:
                    if len(ident) == _IDENT_BYTES and _key_equal(self._keys, base, ident):  # noqa: F821 - keyindex.pxd
                        return s
                elif self._rb[base : base + _IDENT_BYTES] == ident:
                    return s
            p = (p + 1) & mask

    def add_vacant(self, slot: int) -> None:
        """Index ``slot`` under the key the last :meth:`find` did not find, in the EMPTY cell
        that ended its probe (where :meth:`add` would put it): no probe, no second hash.
        Nothing may change the table between that ``find`` and this call."""
        p = self._vacant_cell
        h = self._vacant_hash
        self.used += 1
        self._table[p] = slot | (((h >> 33) & self.fp_mask) << self.slot_bits)
        self._hash[slot] = h
        self._pos[slot] = p

    def add(self, slot: int, h: int) -> None:
        """Index ``slot`` (whose key is absent) under hash ``h``."""
        mask = self.mask
        p = h & mask
        while self._table[p] >= 0:
            p = (p + 1) & mask
        self.used += 1
        self._table[p] = slot | (((h >> 33) & self.fp_mask) << self.slot_bits)
        self._hash[slot] = h
        self._pos[slot] = p

    def remove(self, slot: int) -> None:
        """Delete without a tombstone: move later keys of the cluster back into the hole.

        A key at cell q (home cell h) may fill the hole p if p lies on its probe
        path h..q; then the hole moves to q. Ends at an empty cell.
        """
        mask = self.mask
        smask = self.slot_mask
        p = self._pos[slot]
        self._pos[slot] = -1
        q = p
        while True:
            q = (q + 1) & mask
            c = self._table[q]
            if c == _EMPTY:
                break
            s = c & smask
            if (q - self._hash[s]) & mask >= (q - p) & mask:
                self._table[p] = c
                self._pos[s] = p
                p = q
        self._table[p] = _EMPTY
        self.used -= 1

    # ------------------------------------------------------------------ batches
    def find_many(self, idents: np.ndarray, hashes: np.ndarray, groups: np.ndarray) -> np.ndarray:
        """:meth:`find` of every item (``idents`` a V33 array): one gather of each item's first
        probe cells. A key is absent if an EMPTY cell comes before any cell holding it; the
        items whose window holds neither (rare at the table's load) are finished one by one."""
        n = hashes.size
        found = np.full(n, -1, dtype=np.int64)
        cells = self.table[(hashes & self.mask)[:, None] + _WINDOW_STEPS & self.mask]
        empty = cells == EMPTY
        first_empty = np.where(empty.any(axis=1), empty.argmax(axis=1), _WINDOW)
        row, col = np.nonzero((cells >= 0) & (_WINDOW_STEPS < first_empty[:, None])
                              & ((cells ^ self.stamps(hashes)[:, None]) <= self.slot_mask))  # fingerprint
        if row.size:
            slot = (cells[row, col] & self.slot_mask).astype(np.int64)
            same = self.hashes[slot] == hashes[row]
            row, slot = row[same], slot[same]
            same = (self._idents[slot] == idents[row]) & (self._groups[slot] == groups[row])
            found[row[same]] = slot[same]
        for j in np.flatnonzero((first_empty == _WINDOW) & (found < 0)).tolist():
            found[j] = self.find(bytes(idents[j]), int(groups[j]))
        return found

    def add_many(self, slots: np.ndarray, hashes: np.ndarray) -> None:
        """:meth:`add` of distinct slots whose keys are absent. Each item takes the first
        EMPTY cell of its probe window; where two items want the same cell, or a window
        has none, the later items go one by one."""
        table, mask = self.table, self.mask
        self.hashes[slots] = hashes
        cells = table[(hashes & mask)[:, None] + _WINDOW_STEPS & mask]
        open_cells = cells < 0
        target = (hashes + open_cells.argmax(axis=1)) & mask
        rows = np.flatnonzero(open_cells.any(axis=1))
        winners = rows[first_of_each(target[rows])]
        won = target[winners]
        table[won] = slots[winners] | self.stamps(hashes[winners])
        self.cells[slots[winners]] = won
        self.used += int(winners.size)
        placed = np.zeros(slots.size, dtype=bool)
        placed[winners] = True
        for j in np.flatnonzero(~placed).tolist():
            self.add(int(slots[j]), int(hashes[j]))

    def remove_many(self, slots: np.ndarray) -> None:
        """:meth:`remove` of distinct indexed slots: backward-shift deletion of a whole batch.

        A key's probe path (home cell .. its cell) must hold no EMPTY cell. Freeing
        cells breaks that only for keys after a freed cell in its cluster (the run of
        occupied cells up to the next EMPTY). So for each cluster that loses keys,
        the *region* from its first freed cell to its end is emptied and its
        remaining keys are put back by linear probing in the order of their home
        cells (a home before the region counts as the region's start): then key k
        lands on ``max(home_k, cell_{k-1} + 1)``, one running maximum
        (``np.maximum.accumulate``) over all regions in table order (regions are
        separated by EMPTY cells, so one cannot push into the next). Keys only move
        back, never out of their region, and the table is as sound as after
        one-by-one deletions (though cells may differ). Cells are counted
        "unrolled" (a region that wraps past the last cell goes on above it) and
        masked when used.
        """
        if not slots.size:
            return
        table, mask = self.table, self.mask
        cells = np.sort(self.cells[slots]).astype(np.int64)
        dist = self._cluster_tails(cells)  # to the first EMPTY cell; freed cells still occupied
        self.cells[slots] = -1
        table[cells] = EMPTY
        self.used -= int(slots.size)
        start, length = self._regions(cells, dist)
        offset = np.cumsum(length) - length  # where each region's cells start in the gathered run
        cell = np.repeat(start - offset, length) + np.arange(int(offset[-1] + length[-1]))  # unrolled
        content = table[cell & mask]
        live = content >= 0
        if not live.any():
            return
        moved_cells = content[live]  # slot and fingerprint
        moved = (moved_cells & self.slot_mask).astype(np.int64)
        cell = cell[live]
        home = np.maximum(cell - ((cell - self.hashes[moved]) & mask), np.repeat(start, length)[live])
        if moved.size > 1 and (home[1:] < home[:-1]).any():
            order = np.argsort(home, kind="stable")
            moved, moved_cells, home = moved[order], moved_cells[order], home[order]
        rank = np.arange(moved.size)
        placed = (rank + np.maximum.accumulate(home - rank)) & mask
        table[cell & mask] = EMPTY
        table[placed] = moved_cells
        self.cells[moved] = placed

    def _regions(self, cells: np.ndarray, dist: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(first cell, length) of each region :meth:`remove_many` re-packs: one per cluster,
        from its first freed cell (in table order) to its end, unrolled."""
        ends = cells + dist  # unrolled: past the last cell for a cluster that wraps
        masked = ends & self.mask
        heads = run_starts(masked)
        if heads.size > 1 and masked[0] == masked[-1]:  # a wrapping cluster: its cells at the top are the last
            heads = heads[1:]  # run, the run of its cells at the bottom is covered by it
        length = np.maximum.reduceat(dist, heads)
        return np.maximum.reduceat(ends, heads) - length, length

    def _cluster_tails(self, cells: np.ndarray) -> np.ndarray:
        """For each occupied cell: how many cells on is the first EMPTY one (>= 1).

        One row of the following ``_TAIL_CELLS`` cells per cell (a strided view of
        the table, no copy of it); the rare longer tails, and cells near the table's
        end, are walked one by one."""
        rows = self._rows
        start = cells + 1
        inside = start < rows.shape[0]
        start[~inside] = 0
        empty = rows[start] == EMPTY
        dist = empty.argmax(axis=1)
        found = empty[np.arange(cells.size), dist] & inside
        dist += 1
        if not found.all():
            table, mask = self._table, self.mask
            for j in np.flatnonzero(~found).tolist():
                p = int(cells[j])
                d = 1
                while table[(p + d) & mask] != EMPTY:
                    d += 1
                dist[j] = d
        return dist

    # ------------------------------------------------------------------ rebuild and check
    def rebuild(self, slots: np.ndarray) -> list[tuple[int, int]]:
        """Index exactly the records ``slots`` (the scheduled ones), from their key bytes and
        groups. A key named by two of them (never written by a wheel, but the index must
        stay sound) is indexed for the first; returns ``(slot, first slot)`` of the others."""
        slots = np.asarray(slots, dtype=np.int64)
        idents = self._idents[slots].tolist()
        groups = self._groups[slots].astype(np.int64)
        hashes = self.key_hashes(idents, groups)
        duplicates = []
        keys = list(zip(idents, groups.tolist()))
        if len(set(keys)) != len(keys):
            seen: dict = {}
            keep = np.ones(slots.size, dtype=bool)
            for j, (s, key) in enumerate(zip(slots.tolist(), keys)):
                if key in seen:
                    duplicates.append((s, seen[key]))
                    keep[j] = False
                else:
                    seen[key] = s
            slots, hashes = slots[keep], hashes[keep]
        self._fill(slots, hashes)
        return duplicates

    def _fill(self, slots: np.ndarray, hashes: np.ndarray) -> None:
        """An empty table, then every slot placed by linear probing (round by round: in each,
        the lowest pending item that wants an open cell takes it)."""
        table = self.table
        table.fill(EMPTY)
        self.cells.fill(-1)
        self.hashes[slots] = hashes
        self.used = int(slots.size)
        pos = hashes & self.mask
        stamped = slots | self.stamps(hashes)
        pending = np.arange(slots.size)
        while pending.size:
            p = pos[pending]
            open_cells = table[p] == EMPTY
            cells, first = np.unique(p[open_cells], return_index=True)
            winners = pending[open_cells][first]
            table[cells] = stamped[winners]
            self.cells[slots[winners]] = cells
            placed = np.zeros(slots.size, dtype=bool)
            placed[winners] = True
            pending = pending[~placed[pending]]
            pos[pending] = (pos[pending] + 1) & self.mask

    def problems(self, slots: np.ndarray) -> list[str]:
        """How the index differs from one over exactly the records ``slots`` (the scheduled
        ones); [] when each is found by its key and nothing else is indexed.

        A record is found by its key when its hash is the key's, its cell holds it, and no
        EMPTY cell lies between its home cell and its cell (linear probing stops there):
        one running count of EMPTY cells over the table, unrolled once for wrapping paths.
        """
        slots = np.sort(np.asarray(slots, dtype=np.int64))
        indexed = self.table[self.table >= 0] & self.slot_mask
        if indexed.size != slots.size or self.used != slots.size:
            return [f"key index holds {indexed.size} entries (counted {self.used}), {slots.size} timers are scheduled"]
        if not np.array_equal(np.sort(indexed), slots):
            return ["key index points at records that are not scheduled"]
        out = []
        hashes = self.key_hashes(self._idents[slots].tolist(), self._groups[slots].astype(np.int64))
        for s in slots[hashes != self.hashes[slots]][:10].tolist():
            out.append(f"scheduled record {s}: the key index holds a stale hash")
        cell = self.cells[slots].astype(np.int64)
        home = hashes & self.mask
        empty_before = np.concatenate(([0], np.cumsum(np.tile(self.table == EMPTY, 2))))  # EMPTY cells in [0, i)
        end = np.where(cell >= home, cell, cell + self.table.size)  # unrolled
        lost = (self.table[cell] != (slots | self.stamps(hashes))) | (empty_before[end] != empty_before[home])
        for s in slots[lost][:10].tolist():
            out.append(f"scheduled record {s} is not found by its key")
        return out
