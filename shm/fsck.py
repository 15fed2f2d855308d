"""The arena's invariants, checked on its bytes: the one checker of wheeld.

:func:`fsck` reads an arena (a live mapping, or a private copy of one) and never
writes it. ``TimerWheel.check`` runs it on its own arena with its own counters
(and adds the state only the owning process has: key index, free stack, bucket
queue, group live counts); ``wheelctl check`` runs it on private copies of a
daemon's arena (:mod:`wheeld.shm.check`).

What it checks:

* the header (magic, version, parameters, size); no update intent and no
  batch intent left open;
* every entry record: a known state, a well-formed key (see
  :mod:`wheeld.protocol.keys`), a level the wheel has, a group id inside the
  group table (live records);
* links: ``next``/``prev`` in range and agreeing; every circular list has
  exactly one sentinel; scheduled and fired records are on a list, free ones
  on none;
* the fired list holds exactly the fired records; the due list only scheduled
  records marked due whose deadline is not after the clock;
* buckets: a record sits in the bucket its deadline maps to at the bucket's
  level (the placement rule, :class:`~wheeld.shm.placement.Placement`; the top
  level also holds the deadlines beyond it), with that level in its state byte;
  each non-empty bucket's expiration maps to it, is after the clock and within
  the level's reach;
* no (group, key) scheduled twice;
* the counters (the header's, or those given) of pending, fired and pending
  per level match the records.
"""

from __future__ import annotations

import struct

import numpy as np

from wheeld.protocol import arena_layout as L
from wheeld.protocol.keys import VALID_KEY_METAS

from .header import parse_header
from .placement import Placement

__all__ = ["fsck"]

_MAX_PER_KIND = 10  # problems of one kind listed before "... and N more"
_VALID_META = np.array(VALID_KEY_METAS, dtype=bool)
# the record's word holding its group id and key meta byte, and the bits of those two fields
_IDENT_WORD = L.R_GROUP // 8
assert L.R_KEY_META // 8 == _IDENT_WORD and L.R_KEY % 8 == 0
_IDENT_MASK = np.uint64((0xFFFF << 8 * (L.R_GROUP % 8)) | (0xFF << 8 * (L.R_KEY_META % 8)))


def fsck(buf, size: int | None = None, label: str = "arena", counters: dict[str, int] | None = None) -> list[str]:
    """Every invariant of the arena in ``buf``; [] when sound. Raises CorruptArena for a
    header that describes no arena. ``counters`` (pending, fired_unacked, pending_level_N,
    pending_due) replace the header's: the owner's figures, published or not."""
    size = len(buf) if size is None else size
    image = _Image(buf, parse_header(buf, size, label))
    p = _Problems()
    _intent_problems(image, p)
    _record_problems(image, p)
    owner = _link_problems(image, p)
    if owner is not None:
        _list_problems(image, p, owner)
        _bucket_problems(image, p, owner)
    _duplicate_problems(image, p)
    _counter_problems(image, p, L.read_counters(buf) if counters is None else counters)
    return p.items


class _Image:
    """The columns of an arena image the checks read (int64 where they compute)."""

    def __init__(self, buf, info: dict) -> None:
        self.buf, self.info = buf, info
        self.levels, self.ws = info["levels"], info["wheel_size"]
        self.due_list = self.levels * self.ws
        self.fired_list = self.due_list + 1
        self.first = self.due_list + 2
        self.n = self.first + info["capacity"]
        self.cur = info["current_ms"]
        self.placement = Placement(info["tick_ms"], self.ws, self.levels)
        self.rec = np.frombuffer(buf, dtype=L.RECORD_DTYPE, count=self.n, offset=info["header_bytes"])
        self.state = self.rec["state"].astype(np.int64)
        self.low = self.state & L.STATE_MASK
        self.level = self.state >> L.LEVEL_SHIFT
        self.nxt = self.rec["next"].astype(np.int64)
        self.prv = self.rec["prev"].astype(np.int64)
        self.deadline = self.rec["deadline"]
        self.entry = np.arange(self.n) >= self.first
        self.sched = self.entry & (self.low == L.SCHEDULED)
        self.fired = self.entry & (self.low == L.FIRED)


class _Problems:
    def __init__(self) -> None:
        self.items: list[str] = []

    def add(self, message: str) -> None:
        self.items.append(message)

    def many(self, what: str, slots: np.ndarray, describe) -> None:
        """One line per offending record (at most _MAX_PER_KIND), then a count of the rest."""
        slots = np.asarray(slots)
        for s in slots[:_MAX_PER_KIND].tolist():
            self.items.append(f"{what}: {describe(s)}")
        if slots.size > _MAX_PER_KIND:
            self.items.append(f"{what}: ... and {slots.size - _MAX_PER_KIND} more records")


def _intent_problems(img: _Image, p: _Problems) -> None:
    """An open update intent, or an open batch intent (layout v2, ``H_INTENT_COUNT`` != 0).

    The count is the commit word of a batch of re-arms (``TimerWheel.schedule_many``):
    nonzero means a writer stopped after committing the batch and before finishing
    its records. That is recoverable (a restart replays every entry), so it is
    reported as one open intent with its size; the re-armed records' links may
    disagree with their states meanwhile and are reported as well (recovery rebuilds
    links from the records). A count above ``INTENT_BATCH_MAX`` or an entry naming a
    slot outside the entry records cannot come from a writer: corruption, and a
    restart refuses such an arena.
    """
    intent = struct.unpack_from("<i", img.buf, L.H_INTENT_SLOT)[0]
    if intent != -1:
        p.add(f"an update intent is open (slot {intent}): a writer stopped in the middle of a re-arm")
    count = struct.unpack_from("<I", img.buf, L.H_INTENT_COUNT)[0]
    if not count:
        return
    if count > L.INTENT_BATCH_MAX:
        p.add(f"the batch intent claims {count} entries (at most {L.INTENT_BATCH_MAX} exist): corrupt header; "
              "a restart refuses this arena")
        return
    entries = np.frombuffer(img.buf, dtype=L.INTENT_DTYPE, count=count,
                            offset=L.intent_batch_offset(img.info["max_groups"]))
    slots = entries["slot"].astype(np.int64)
    outside = np.flatnonzero((slots < img.first) | (slots >= img.n))
    if outside.size:
        p.add(f"the batch intent ({count} entries) names slot {int(slots[outside[0]])} (entry {int(outside[0])}), "
              "not an entry record: corrupt; a restart refuses this arena")
    else:
        p.add(f"a batch intent of {count} re-arms is open: a writer stopped in the middle of a batch re-arm "
              "(a restart replays it)")


def _record_problems(img: _Image, p: _Problems) -> None:
    """States, keys, levels and group ids of the entry records."""
    entry, low, state, level = img.entry, img.low, img.state, img.level
    p.many("unknown state", np.flatnonzero(entry & (low > L.FIRED)), lambda s: f"record {s} has state byte {state[s]}")
    meta = img.rec["key_meta"]
    bad_key = np.flatnonzero(entry & (low != L.FREE) & (low <= L.FIRED) & ~_VALID_META[meta])
    p.many("malformed key", bad_key, lambda s: f"record {s} has key meta {meta[s]:#x}")
    bad_level = np.flatnonzero(img.sched & (level >= img.levels) & (level != L.DUE_LEVEL))
    p.many("bad level", bad_level, lambda s: f"scheduled record {s} claims level {level[s]} of {img.levels}")
    bad_fired = np.flatnonzero(img.fired & (state != L.FIRED))
    p.many("bad fired state", bad_fired, lambda s: f"fired record {s} has state byte {state[s]}")
    group, max_groups = img.rec["group"], img.info["max_groups"]
    bad_group = np.flatnonzero((img.sched | img.fired) & (group >= max_groups))
    p.many("bad group", bad_group, lambda s: f"record {s} carries group id {group[s]}, the table has {max_groups}")


def _link_problems(img: _Image, p: _Problems) -> np.ndarray | None:
    """Links in range and agreeing, one sentinel per circular list. Returns the list each
    record is on (its sentinel, -1 for none) when the links allow telling, else None."""
    n, nxt, prv = img.n, img.nxt, img.prv
    member = ~img.entry | img.sched | img.fired
    in_range = (nxt >= 0) & (nxt < n) & (prv >= 0) & (prv < n)
    broken = np.flatnonzero(member & ~in_range)
    p.many("link out of range", broken, lambda s: f"record {s}: next {nxt[s]}, prev {prv[s]}")
    ok = member & in_range
    nxt_c = np.where(ok, nxt, 0)
    prv_c = np.where(ok, prv, 0)
    here = np.arange(n)
    asym = np.flatnonzero(ok & ((prv[nxt_c] != here) | (nxt[prv_c] != here) | ~member[nxt_c]))
    p.many("links disagree", asym, lambda s: f"record {s}: next {nxt[s]} (whose prev is {prv[nxt[s]]}), "
                                             f"prev {prv[s]} (whose next is {nxt[prv[s]]})")
    if broken.size or asym.size:
        return None
    owner = _cycle_owner(nxt, member, img.first)
    p.many("lost records", np.flatnonzero(member & (owner >= n)),
           lambda s: f"record {s} is on a circular list without a sentinel")
    p.many("merged lists", np.flatnonzero(~img.entry & (owner != here)),
           lambda s: f"bucket sentinel {s} is on the list of sentinel {owner[s]}")
    return np.where(owner < n, owner, -1)


def _cycle_owner(nxt: np.ndarray, member: np.ndarray, first: int) -> np.ndarray:
    """For each record on a circular list, the smallest sentinel index on its cycle, or >= n if none.

    Pointer doubling: after k rounds every record knows the minimum label of the
    next 2**k records on its cycle; log2(n) rounds cover any cycle.
    """
    n = nxt.size
    label = np.where(np.arange(n) < first, np.arange(n), n + np.arange(n)).astype(np.int64)
    label[~member] = 2 * n + 1
    jump = np.where(member, nxt, np.arange(n)).astype(np.int64)
    for _ in range(max(1, int(n).bit_length())):
        label = np.minimum(label, label[jump])
        jump = jump[jump]
    return label


def _list_problems(img: _Image, p: _Problems, own: np.ndarray) -> None:
    """The fired list holds exactly the fired records; the due list only due ones."""
    entry, state, deadline, cur = img.entry, img.state, img.deadline, img.cur
    fired_list, due_list = img.fired_list, img.due_list
    p.many("fired list", np.flatnonzero(entry & (own == fired_list) & ~img.fired),
           lambda s: f"record {s} on the fired list has state byte {state[s]}")
    p.many("fired list", np.flatnonzero(img.fired & (own != fired_list) & (own >= 0)),
           lambda s: f"fired record {s} is on list {own[s]}, not the fired list")
    on_due = entry & (own == due_list)
    due_state = img.sched & (img.level == L.DUE_LEVEL)
    p.many("due list", np.flatnonzero(on_due & ~due_state),
           lambda s: f"record {s} on the due list has state byte {state[s]}")
    p.many("due list", np.flatnonzero(on_due & (deadline > cur)),
           lambda s: f"record {s} on the due list is not due ({deadline[s]} > clock {cur})")
    p.many("due list", np.flatnonzero(due_state & (own != due_list) & (own >= 0)),
           lambda s: f"record {s} says due but is on list {own[s]}")


def _bucket_problems(img: _Image, p: _Problems, own: np.ndarray) -> None:
    """Records in the bucket of their deadline; bucket expirations that map to their bucket."""
    ws, cur, deadline, state = img.ws, img.cur, img.deadline, img.state
    slots = np.flatnonzero(img.entry & (own >= 0) & (own < img.due_list))
    if not slots.size:
        return
    bucket = own[slots]
    blevel = bucket // ws
    wrong_state = ~img.sched[slots] | (img.level[slots] != blevel)
    p.many("bucket", slots[wrong_state],
           lambda s: f"record {s} in level-{own[s] // ws} bucket {own[s] % ws} has state byte {state[s]}")
    bad_bucket = np.zeros(slots.size, dtype=bool)
    misplaced = np.zeros(slots.size, dtype=bool)
    for level in np.unique(blevel).tolist():
        at = blevel == level
        tick = img.placement.ticks[level]
        expiration = deadline[bucket[at]]
        v, fits = img.placement.level_value(expiration, cur, level)
        bad_bucket[at] = (expiration % tick != 0) | (v % ws != bucket[at] % ws) | (expiration <= cur) | ~fits
        mine, _fits = img.placement.level_value(deadline[slots[at]], cur, level)
        misplaced[at] = mine < v if level == img.levels - 1 else mine != v  # the top level clamps
    p.many("bucket", np.unique(bucket[bad_bucket]),
           lambda s: f"bucket {s} (level {s // ws}) has expiration {deadline[s]} that does not map to it, "
                     f"is not after the clock {cur} or is beyond the level's reach")
    p.many("bucket", slots[misplaced & ~bad_bucket],
           lambda s: f"record {s}: deadline {deadline[s]} does not belong in level-{own[s] // ws} bucket "
                     f"{own[s] % ws} (expiration {deadline[own[s]]})")


def _duplicate_problems(img: _Image, p: _Problems) -> None:
    """No (group, key) scheduled twice: records whose 64-bit fingerprints of group and key
    collide are compared byte for byte (sorting the fingerprints is much cheaper than
    sorting the 34-byte identities themselves)."""
    slots = np.flatnonzero(img.sched)
    if slots.size < 2:
        return
    raw = np.frombuffer(img.buf, dtype=np.uint8, count=img.n * L.RECORD_BYTES,
                        offset=img.info["header_bytes"]).reshape(img.n, L.RECORD_BYTES)
    words = raw.view(np.uint64)[slots]  # 8 little-endian words per record
    fingerprint = words[:, _IDENT_WORD] & _IDENT_MASK
    for w in range(L.R_KEY // 8, L.RECORD_BYTES // 8):
        fingerprint = (fingerprint ^ words[:, w]) * np.uint64(0x9E3779B97F4A7C15)
    order = np.argsort(fingerprint)
    ordered = fingerprint[order]
    twins = np.flatnonzero(ordered[1:] == ordered[:-1])
    if not twins.size:
        return
    slots = np.unique(slots[np.concatenate((order[twins], order[twins + 1]))])
    ident = np.ascontiguousarray(np.concatenate((raw[slots, L.R_GROUP : L.R_GROUP + 2],
                                                 raw[slots, L.R_KEY_META :]), axis=1))
    _unique, inverse, counts = np.unique(ident.view(f"V{ident.shape[1]}").ravel(), return_inverse=True,
                                         return_counts=True)
    p.many("duplicate key", slots[counts[inverse] > 1],
           lambda s: f"record {s} shares its (group, key) with another scheduled record")


def _counter_problems(img: _Image, p: _Problems, counter: dict[str, int]) -> None:
    """The pending, fired and per-level counters against the records."""
    n_sched = int(np.count_nonzero(img.sched))
    n_fired = int(np.count_nonzero(img.fired))
    if counter["pending"] != n_sched:
        p.add(f"counter pending={counter['pending']}, but {n_sched} records are scheduled")
    if counter["fired_unacked"] != n_fired:
        p.add(f"counter fired_unacked={counter['fired_unacked']}, but {n_fired} records are fired")
    per_level = np.bincount(img.level[img.sched], minlength=L.DUE_LEVEL + 1)
    for level in range(img.levels):
        name = f"pending_level_{level}"
        if counter[name] != per_level[level]:
            p.add(f"counter {name}={counter[name]}, but {per_level[level]} records are there")
    if counter["pending_due"] != per_level[L.DUE_LEVEL]:
        p.add(f"counter pending_due={counter['pending_due']}, but {per_level[L.DUE_LEVEL]} records are due")
