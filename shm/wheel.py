"""A hierarchical timing wheel stored in a shared-memory arena.

This is Kafka's purgatory timer (``TimingWheel``/``SystemTimer`` in
apache/kafka, ``server-common/src/main/java/org/apache/kafka/server/util/timer/``;
the design is described in Confluent's "Apache Kafka, Purgatory, and
Hierarchical Timing Wheels", 2015) laid out in fixed-size records so that it
outlives the process that owns it. The operations do no I/O and read no clock:
each takes ``now_ms`` or a deadline. Only setting up touches the outside:
``create`` makes the arena (shared memory, or private memory with ``name=None``)
and stamps it with the wall-clock time it was made (``created_wall_ms``);
``attach`` maps an existing one.

Levels and buckets
------------------
Level 0 has ``wheel_size`` buckets, each ``tick_ms`` wide. Level *L* has the same
number of buckets, each as wide as the whole of level *L-1*::

    tick(L) = tick_ms * wheel_size ** L          interval(L) = tick(L) * wheel_size

With the defaults (``tick_ms=1``, ``wheel_size=256``) the levels span 256 ms,
65.5 s, 4.7 h, 49.7 days and 34.8 years. A bucket is a circular doubly linked
list of records headed by a sentinel record; links are record indices, so an
entry is unlinked in O(1) without knowing its bucket.

Placing a timer (``cur`` is the wheel's clock, ``d`` the deadline; the rule is
written once, ``Placement.bucket_for`` in :mod:`wheeld.shm.placement`)::

    d <= cur                       -> the due list (comes out at the next advance)
    level 0: v = ceil(d / tick0)   -> if v - cur//tick0 <= wheel_size: bucket v % wheel_size
    level L: v = d // tick(L)      -> if v - cur//tick(L) < wheel_size: bucket v % wheel_size
    beyond the top level           -> the top level's farthest bucket (clamped); when that
                                      bucket comes due the timer is placed again, so any
                                      delay is accepted and none is lost

The bucket's expiration is ``v * tick(L)``, always after ``cur``. Level 0 accepts
``v - cur//tick0 == wheel_size`` too: the values ``cur//tick0 + 1 .. + wheel_size``
are ``wheel_size`` distinct buckets (``v == cur//tick0`` would be due), and without
it a deadline in the last level-0 tick of the current level-1 tick (tick_ms > 1)
would land in a level-1 bucket that has already expired. Level 0 rounds *up*: a level-0 bucket
only expires once every timer in it is due, so nothing fires early (Kafka rounds
down and may fire up to a tick early). Higher levels round down: when their
bucket expires, its timers *cascade*: each is placed again relative to the new
clock and lands on a lower level (or is due).

Cascading ahead: a level-1 bucket cascades whole when it comes due, and under
load it holds thousands of timers (re-placing ~6.5k costs ~1.2 ms, which the
timers due at that boundary wait for). ``cascade_ahead(now, n)`` spreads that
work: it looks at up to ``n`` records of the next level-1 bucket and moves those
whose deadline level 0 already reaches from the current clock to their level-0
bucket, the one the cascade at the boundary would have chosen. Only links and
the derived level bits change, so it needs no intent (``attach`` re-places every
timer from its deadline and the stored clock anyway).

The clock is not ticked. Every non-empty bucket's expiration sits in a heap
(Kafka's DelayQueue of buckets); ``advance(now)`` pops the buckets whose
expiration is <= now, detaches them, sets ``cur = now``, then re-checks every
detached timer: ``deadline <= now`` fires, anything else is placed again. An
idle wheel costs nothing, and a clock jump of any size costs the buckets it
crosses, not the ticks.

Worked example (tick 1 ms, wheel 256, cur = 1000)
--------------------------------------------------
* ``schedule("a", 1100)``: level 0, v = 1100, 1100 - 1000 < 256 -> bucket 1100 % 256 = 76,
  expiration 1100. ``advance(1099)`` returns nothing; ``advance(1100)`` returns "a".
* ``schedule("b", 31_000)``: level 0 rejects (30 000 ticks away); level 1 (tick 256):
  v = 121, cur//256 = 3 -> bucket 121 with expiration 30 976. At ``advance(30_976)``
  the bucket cascades: "b" is placed again relative to cur = 30 976, lands in level 0
  bucket 31 000 % 256 = 24 and fires at ``advance(31_000)``.
* ``schedule("c", 1000 + 3_600_000)`` (an hour): level 2 (tick 65 536): v = 54,
  expiration 3 538 944; it cascades to level 1, then level 0: three placements in all.
* ``advance(10**9)`` after that: one heap pop per non-empty bucket, everything due is
  returned at once, "late" by whatever the caller waited.

Guarantees
----------
* A timer never expires before its deadline: ``advance(now)`` returns exactly the
  timers with ``deadline <= now`` (each one re-checked before it is returned).
* Advanced on time (at least once per tick), a timer expires no later than one
  tick after its deadline.
* Cancel and re-arm are exact: a cancelled timer never comes out; a re-armed timer
  comes out once, for its new deadline.
* The order of timers inside one tick is not guaranteed.

Costs: insert O(levels) arithmetic + O(1) links; cancel O(1); advance O(buckets
crossed + timers due + timers cascaded); each timer cascades at most ``levels`` times.

Records, keys and handles
-------------------------
A timer is one 64-byte record (layout in ``wheeld.protocol.arena_layout``).
Keys (str/bytes/int, at most 32 bytes encoded) are unique per group. The key
index (:mod:`wheeld.shm.keyindex`) is an open-addressing hash table (linear
probing; a deletion moves the rest of its cluster back, so there are no
tombstones to pile up and no rebuilds while running) that lives in the owning
process, holding record indices only: 8-16 bytes of table (at least two cells
per record, a power of two) and 12 bytes of per-slot hash/position per timer,
instead of a Python dict's ~100 bytes. Free records are a stack of slot numbers in the owning
process too (4 bytes per record). With the 64-byte record that is about 90-100
bytes per timer in all (``python -m bench.wheel_core``). A handle is
``(slot, generation)``; the generation is bumped whenever a record is
allocated, so an old handle is a harmless no-op.

Groups
------
Every record carries a group id (u16). The arena's group table holds
``max_groups`` names (1..65535, default 1,024; ``create(max_groups=...)``) of at
most 31 UTF-8 bytes, zero padded to 32; id 0 is ``default``, registered at
creation. An entry whose *first byte* is 0 is an unused id, whatever the other
31 bytes hold. ``group_id(name)`` returns a registered name's id (one vectorized
compare of the whole 32-byte entries) or registers the name under the lowest
free id: unused, and no live record carries it. It raises ``GroupLimit`` (an
``ArenaFull``) when every id is in use.

Live counts: ``group_live(gid)`` is the number of the group's records that are
SCHEDULED or FIRED (fired timers hold their record until released), exact after
every call. Each path that allocates or frees a record adjusts it: a new
``schedule``, ``cancel``/``cancel_handle``, ``release`` and the records
``advance`` frees (one item of a Python list each); ``schedule_many``, ``cancel_many`` and
``release_many`` (one addition when the batch is of one group, a bincount
otherwise). Re-arms, ``expire``/``expire_many``, ``rearm_fired`` and cascades
change no record's liveness and no count; a refused call changes none.
``group_counts()`` copies all of them into an array. The counts are derived
state of the owning process, like the key index: ``attach`` recounts them from
the records' state and group columns (one ``np.bincount``), so a writer killed
anywhere leaves nothing to repair, and ``check()`` compares them with a
recount. Readers (``wheelctl groups``) count the records themselves.

Reclaiming ids: ``forget_group(gid)`` frees the id of a group with no live
record (False, and nothing changes, otherwise; id 0 is never forgotten); its
name can be registered again, and the id goes to the next new name.
``forget_idle_groups(keep)`` does that for every idle group not in ``keep``.
Which groups to forget (no member, nothing pending) is the daemon's decision;
whoever caches names by id must drop the forgotten one. Both changes to the
table commit with the one-byte store of the first byte: registering writes
bytes 1..31 first and the first byte last, forgetting clears the first byte
first and the rest after. A writer killed in between leaves either the old name
or an unused id, never a half name ``group_id`` could match (it compares all 32
bytes, and a name's first byte is never 0); ``attach`` clears the leftover bytes
of unused ids.

Batches
-------
``schedule_many`` / ``cancel_many`` / ``expire_many`` / ``release_many`` mean
exactly what the scalar methods mean called item by item (tested against them),
for a drained batch of ring commands. They are computed with numpy: record
fields, the placement level by level, key-index probing (an 8-cell probe window
gathered per key), splicing whole chains into buckets, unlinking runs of
neighbours (pointer jumping), and deleting a batch of keys from the index (each
cluster that loses keys has its tail re-placed at once, see
``KeyIndex.remove_many``). ``expire_many`` moves a due level-0 bucket (and the due
list) to the fired list whole: every timer in it is due, because level 0 rounds
up (checked anyway), so the bucket's chain is spliced onto the fired list with
four link stores and its records change state with one numpy store; only
timers of due higher-level buckets are re-checked one by one (vectorized), to
fire or cascade. What stays per item: hashing the keys, walking due buckets (to
learn their slots), and batches that name one key twice (they take the scalar
path). Re-arms in a batch go through a batch intent (below). At 1M pending a
batch costs a fraction of the scalar methods per insert, cancel or expiration
(``python -m bench.wheel_core``; measured figures in docs/wheel.md).

The compiled build runs the same steps as C loops instead (the ``_c_*``
functions of wheel.pxd), item by item over the callers' buffers: each key is
hashed from its 33 bytes (``_Py_HashBytes``, what ``hash`` of the bytes gives)
and probed in the key index's table, records are linked and unlinked through C
pointers, and the index cells, the records and their neighbours are prefetched
a few items ahead. The order of every link, free-stack push and intent entry
is the numpy code's, so both paths leave the same bytes (the differential test
holds them to it); the key index and the bucket heap (C arrays on the compiled
path) are derived state and may differ inside.

Who calls them: the daemon on the Python path (its executor plans chunks of 192
commands or more into ``cancel_many``/``release_many``/``schedule_many``, its
delivery takes cascades and backlogs through ``expire_many``). The compiled
daemon does not: there the executor applies every chunk in ring order and
delivery always calls the scalar ``expire``, each cheaper at every size measured
(``python -m bench.daemon_paths``, "expire paths"). The compiled batch methods
serve an application that drives a :class:`TimerWheel` in its own process, and
the benchmarks.

Record life (the only legal steps)::

    FREE --schedule--> SCHEDULED --cancel--> FREE
                       SCHEDULED --schedule (re-arm)--> SCHEDULED
                       SCHEDULED --advance--> FREE            (caller takes the result)
                       SCHEDULED --expire--> FIRED --release--> FREE
                                             FIRED --rearm_fired--> SCHEDULED

Any other step changes nothing, and says so: a step named by handle (``cancel_handle``,
``release``, ``rearm_fired``) returns False when the handle is stale or the record is
not in the state the step starts from (so does ``cancel`` of a key that is not
pending); bad input (a key, deadline, group, tag or slot out of range) raises.

Crash consistency
-----------------
The records are the truth; links, the free list, the key index, the bucket
heap and the per-group live counts are derived from them (only the links live
in the arena; the rest is in the owning process and rebuilt on attach). Every state change has one commit
point, a single
aligned store: the state byte (allocate: fields first, then ``SCHEDULED``;
cancel/free: ``FREE``). The one update that changes several fields of a live
record (a re-arm: deadline, tag and level; re-arming a fired timer: also the
state) first writes a redo *intent* into the header (fields, then the slot as
commit word), then the record, then clears the intent. A batch of re-arms
(``schedule_many``) writes up to 4096 (slot, tag, deadline) entries into the
batch intent, then their count as commit word, then the records, then count 0.
``attach`` therefore:

1. replays a committed intent or batch intent (the update is finished, exactly
   as requested);
2. rebuilds every list from the records' states: free records into the free
   list, fired ones into the fired list, scheduled ones into the bucket their
   deadline maps to relative to the stored clock (``cur`` is written after the
   due buckets were detached and before they are re-placed, so a crash inside
   ``advance`` leaves every timer still scheduled, due ones in the due list);
3. rebuilds the key index, the bucket heap and the per-group live counts
   (and clears the leftover bytes of unused group ids).

``expire_many`` follows the same order as ``advance``: detach the due buckets,
store the clock, then splice (links, derived) and store the FIRED states (the
commit points, one per record); killed in between, the records still SCHEDULED
with deadlines <= the stored clock are rebuilt into the due list and fire at the
next advance.

A writer killed at any instruction loses no timer that was scheduled before the
interrupted call; the interrupted call itself either happened or did not. A
batch (or an ``advance`` firing many timers) commits record by record: each of
its items happened or did not, not necessarily a prefix; none is torn. The
daemon re-applies unacknowledged ring commands after a restart, and every
command is idempotent, so this is enough. ``tests/test_wheel_crash.py`` kills a
writer hundreds of times, also between any two lines of this module (the only one
that writes the arena), and checks exactly this. ``check()`` verifies every invariant
(:mod:`wheeld.shm.fsck`, plus the derived state of the owning process).

Threading: one writer process at a time (the daemon); readers (``wheelctl``)
may map the arena read-only and read counters and records.

Where the code lives
--------------------
:class:`TimerWheel` is one class assembled from rooms, each a module of its own:

* :class:`WheelRecords` (here): the arena's views, the links and the steps every
  operation is made of (link, unlink, re-arm through the intent, free, fire), the
  bucket heap, ``cascade_ahead`` and the counters;
* :class:`TimerWheel` (here): the operations over it, scalar (``schedule``,
  ``cancel``, ``advance``/``expire``, ``release``, ``rearm_fired``) and batch (their
  checks, then the C loops when compiled or the numpy room);
* :class:`~wheeld.shm.wheel_groups.GroupTable`: the group table and live counts;
* :class:`~wheeld.shm.wheel_attach.WheelAttach`: ``create``, ``attach``/``recover``
  (intent replay and the rebuild of everything derived), repairs and ``check``;
* :class:`~wheeld.shm.wheel_batch.NumpyBatches`: the batch operations computed
  with numpy (the Python path, and the reference of the C loops).

Compiled, ``WheelRecords`` and ``TimerWheel`` are extension types (``shm/wheel.pxd``
declares their fields and C methods; ``TimerWheel`` is final, so its methods are called
directly); the rooms are Python mixins that read the same fields. Shared bounds and
the counter table are :mod:`wheeld.shm.wheel_common`'s.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Iterator

import numpy as np

from wheeld.protocol import arena_layout as L
from wheeld.protocol.clients_layout import TOUCH_INDEX_BITS as _TOUCH_INDEX_BITS, TOUCH_INDEX_MASK as _TOUCH_INDEX_MASK
from wheeld.protocol.errors import ArenaFull, CorruptArena, InvalidDelay, InvalidKey, InvalidRequest
from wheeld.protocol.keys import VALID_KEY_METAS, c_layout, decode_key, encode_key, key_length

from .arena import Segment
from .header import parse_header
from .keyindex import KeyIndex
from .placement import Placement
from .ring import MAX_IDLE_MS as _MAX_IDLE_MS
from .wheel_attach import WheelAttach
from .wheel_batch import NumpyBatches
from .wheel_common import (  # the counters' indices, under this module's names
    C_PENDING as _C_PENDING, C_FIRED_UNACKED as _C_FIRED_UNACKED, C_ADDS as _C_ADDS, C_REARMS as _C_REARMS,
    C_CANCELS as _C_CANCELS, C_CANCEL_MISSES as _C_CANCEL_MISSES, C_EXPIRATIONS as _C_EXPIRATIONS,
    C_CASCADES as _C_CASCADES, C_ACKS as _C_ACKS, C_IDLE_REARMS as _C_IDLE_REARMS, C_ARENA_FULL as _C_ARENA_FULL,
)
from .wheel_common import (
    DEADLINE_HIGH, DEADLINE_LOW, DEFAULT_WHEEL_SIZE, GENERATION_MASK, LEVEL_SLOTS, MAX_CLOCK_MS,
    MAX_DELAY_MS, OWN_COUNTERS, VALID_META, check_clock, default_levels,
)
from .wheel_groups import GroupTable

__all__ = ["DEFAULT_WHEEL_SIZE", "MAX_CLOCK_MS", "MAX_DELAY_MS", "GENERATION_MASK", "TimerWheel", "WheelRecords",
           "deadline_reason", "encode_ident"]

_default_levels = default_levels  # (the name tests use)
_check_clock = check_clock
_FREE = L.FREE
_SCHEDULED = L.SCHEDULED
_FIRED = L.FIRED
_STATE_MASK = L.STATE_MASK
_LEVEL_SHIFT = L.LEVEL_SHIFT
_META = [bytes((m,)) for m in range(256)]
_PAD = [b"\0" * (L.KEY_BYTES - n) for n in range(L.KEY_BYTES + 1)]
_NO_VIEWS = object()  # _touched_deadline: a client not looked up yet
_KEY_END = [L.R_KEY + key_length(meta) for meta in range(256)]  # where a record's key ends, by meta byte
# word indices into the arena views (see wheeld.protocol.arena_layout)
_CUR = L.H_CURRENT_MS // 8
_QW, _IW, _HW, _RB = L.Q_PER_RECORD, L.I_PER_RECORD, L.H_PER_RECORD, L.RECORD_BYTES
_PREV, _NEXT, _GEN, _TAG, _AUX, _GROUP = L.I_PREV, L.I_NEXT, L.I_GEN, L.I_TAG, L.I_AUX, L.H_GROUP_WORD
_ST, _KM, _KEY = L.R_STATE, L.R_KEY_META, L.R_KEY
_GNB = L.GROUP_NAME_BYTES
_DUE_LEVEL = L.DUE_LEVEL
_INTENT_SLOT, _INTENT_STATE, _INTENT_TAG = L.H_INTENT_SLOT // 4, L.H_INTENT_STATE // 4, L.H_INTENT_TAG // 4
_INTENT_DEADLINE = L.H_INTENT_DEADLINE // 8
# the header words publish_stats writes: those of OWN_COUNTERS (in _count's order), of
# each level's pending count (level 0 first) and of the due list's
_OWN_WORDS = tuple(L.H_COUNTERS // 8 + L.COUNTER[name] for name in OWN_COUNTERS)
_LEVEL_WORDS = tuple(L.H_COUNTERS // 8 + L.COUNTER[f"pending_level_{level}"] for level in range(L.MAX_LEVELS))
_DUE_WORD = L.H_COUNTERS // 8 + L.COUNTER["pending_due"]
_MAX_DELAY = MAX_DELAY_MS  # the scalar paths' names for these (C constants in the compiled build)
_GEN_MASK = GENERATION_MASK
# Compiled (wheel.pxd), a bytes key is copied into its record with memcpy (_put_key)
# instead of a slice assignment through the record view, and the batch methods run C
# loops (the _c_* functions of wheel.pxd) instead of their numpy code.
_COMPILED = not __file__.endswith(".py")
_VALID_META_BYTES = VALID_META.view(np.uint8)  # the key metas a record may carry, as bytes, for the C loops
_INT64 = np.dtype(np.int64)
_ONE_VALUE = {v: np.array((v,), dtype=np.int64) for v in (-1, 0)}  # the batch methods' defaults, as columns
for _one in _ONE_VALUE.values():
    _one.flags.writeable = False
if _COMPILED and _c_layout() != (  # noqa: F821 - wheel.pxd: its C constants are this layout's
        L.I_PER_RECORD, L.Q_PER_RECORD, L.H_PER_RECORD, L.RECORD_BYTES, L.I_PREV, L.I_NEXT, L.I_GEN, L.I_TAG, L.I_AUX,
        L.H_GROUP_WORD, L.R_STATE, L.R_KEY_META, L.KEY_BYTES + 1, L.FREE, L.SCHEDULED, L.FIRED, L.LEVEL_SHIFT,
        L.DUE_LEVEL, L.H_CURRENT_MS // 8, L.H_INTENT_COUNT // 4, L.INTENT_BATCH_MAX, L.INTENT_ENTRY.size,
        GENERATION_MASK):
    raise ImportError("wheel.pxd's record layout constants are not those of wheeld.protocol.arena_layout")
if _COMPILED and _kc_layout() != c_layout():  # noqa: F821 - protocol/keycodec.pxd, cimported by wheel.pxd
    raise ImportError("protocol/keycodec.pxd's key format constants are not those of wheeld.protocol.keys")


def deadline_reason(deadline_ms: int, clock_ms: int, max_delay_ms: int) -> str:
    """Why a deadline more than ``max_delay_ms`` from the wheel's clock ``clock_ms`` is refused: the
    words of the wheel's ``InvalidDelay``, and of the daemon's refusal of such an arm (which a
    plan and the in-order loop make without asking the wheel: wheeld.daemon.executor)."""
    return f"deadline {deadline_ms} is more than {max_delay_ms} ms from the clock ({clock_ms})"


def _int64_counts(counts: list[int]) -> memoryview | list[int]:
    """Counts as a writable view of int64 words: the C array the compiled build declares
    (wheel.pxd). The Python path keeps a list, whose items it reads and writes faster."""
    return memoryview(array("q", counts)) if _COMPILED else list(counts)


def _int64_array(n: int) -> np.ndarray:
    """An uninitialised int64 array of n items (the compiled expire_many fills it)."""
    return np.empty(n, dtype=np.int64)


def _ident(key) -> tuple[bytes, int]:
    """(key meta byte + zero-padded key, meta): the 33 bytes at offset 31 of a record."""
    data, meta = encode_key(key)
    return _META[meta] + data + _PAD[len(data)], meta


def encode_ident(key) -> bytes:
    """A key in the form the ``*_ident`` and ``*_many`` methods take: meta byte + 32 padded bytes.

    It is also the ring command's ``kmeta`` byte followed by its 32-byte key field.
    """
    return _ident_of(key)


def _ident_of(key) -> bytes:
    """:func:`encode_ident`. Compiled, a str or int key is encoded in C, in one bytes object
    (``encode_ident_c``, protocol/keycodec.pxd); any other key, or one it leaves, as here."""
    if _COMPILED:
        ident = encode_ident_c(key)  # noqa: F821 - protocol/keycodec.pxd, cimported by wheel.pxd
        if ident is not None:
            return ident
    return _ident(key)[0]


class WheelRecords:
    """The arena's records as a wheel: the views every path reads and writes through, the
    links and the steps each operation is made of (link, unlink, re-arm through the
    intent, free, fire), the bucket heap, cascading ahead and the counters.
    :class:`TimerWheel` adds the operations (see the module docstring for the algorithm)."""

    # ------------------------------------------------------------------ set-up
    def __init__(self, seg: Segment) -> None:
        self._seg = seg
        info = parse_header(seg.buf, seg.size, seg.name or "arena")
        self.capacity = info["capacity"]
        self.tick_ms = info["tick_ms"]
        self.wheel_size = info["wheel_size"]
        self.levels = info["levels"]
        self.start_ms = info["start_ms"]
        self.max_groups = info["max_groups"]
        self.created_wall_ms = info["created_wall_ms"]
        self.name = seg.name
        self._header_bytes = info["header_bytes"]
        self.due_list = self.levels * self.wheel_size
        self.fired_list = self.due_list + 1
        self.first_entry = self.due_list + 2
        self.n_records = self.first_entry + self.capacity
        self._placement = Placement(self.tick_ms, self.wheel_size, self.levels)
        self._buckets_for = self._placement.buckets_for
        self._ticks = self._placement.ticks
        self._map_views(seg.buf)
        self._index = KeyIndex(self.records, self.capacity, self.max_groups)
        # Free entry records: a stack of slot numbers in this process (derived state,
        # like the key index; rebuilt from the records' states on attach).
        self._free_np = np.zeros(self.capacity, dtype=np.int32)
        self._free_view = memoryview(self._free_np)
        self._free_stack = self._free_view
        self._free_top = 0
        # Live records (SCHEDULED or FIRED) per group id, and scheduled ones per level:
        # derived state of this process, like the key index, recounted from the records
        # on attach. Views of int64 arrays: C arrays for the scalar paths when compiled.
        self._group_live = _int64_counts([0] * self.max_groups)
        self._heap: list[tuple[int, int]] = []
        if _COMPILED:  # the compiled path keeps the heap in C arrays instead (wheel.pxd, _c_heap_*)
            self._hx = np.zeros(256, dtype=np.int64)
            self._hb = np.zeros(256, dtype=np.int32)
            self._hn = 0
        self._queued = [-1] * self.first_entry  # expiration each bucket is queued under
        # rearm_touched_ahead's memo per level-0 bucket: the expiration, tail slot and the
        # tail's generation of its last complete walk that found no idle timer (-1: none)
        self._ahead_memo = _int64_counts([-1] * (3 * self.wheel_size))
        self._pending_by_level = _int64_counts([0] * LEVEL_SLOTS)
        self._count_array = array("q", bytes(8 * len(OWN_COUNTERS)))  # OWN_COUNTERS, in order
        self._count = memoryview(self._count_array)
        self._closed = False
        #: repairs of corruption the last attach made (messages), and how many live records
        #: they freed (timers lost unless restored, see rewrite_records)
        self.repairs: list[str] = []
        self.lost = 0
        # cascade_ahead's place in the next level-1 bucket: (its expiration, the next
        # record to look at or the sentinel when a pass ended, the clock the pass began at)
        self._ahead: tuple[int, int, int] | None = None

    def _map_views(self, buf) -> None:
        """The views of the arena every path reads and writes through (the scalar paths
        index them one item at a time: C arrays in the compiled build)."""
        mv = memoryview(buf)
        header = mv[: L.GROUPS_OFFSET]
        rec = mv[self._header_bytes : self._header_bytes + self.n_records * L.RECORD_BYTES]
        views = (header.cast("q"), header.cast("i"), header.cast("I"), rec.cast("q"), rec.cast("i"), rec.cast("I"),
                 rec.cast("H"), rec)
        self._views = views  # close() releases them
        self._hq, self._hi, self._hu, self._q, self._i, self._u, self._h, self._rb = views
        self._clock = self._hq  # header words, for the scalar paths (header_words() hands out _hq)
        self._b = rec  # record bytes, one at a time (state bytes); _rb is sliced for keys
        self.records = np.frombuffer(buf, dtype=L.RECORD_DTYPE, count=self.n_records, offset=self._header_bytes)
        self._raw = np.ndarray(shape=(self.n_records,), dtype=f"V{L.RECORD_BYTES}", buffer=buf,
                               offset=self._header_bytes)
        self._next = memoryview(self.records["next"])  # strided: record s's next link is _next[s]
        self._intent_batch = np.ndarray(
            shape=(L.INTENT_BATCH_MAX,), dtype=L.INTENT_DTYPE, buffer=buf, offset=L.intent_batch_offset(self.max_groups)
        )
        # The 33 bytes (key meta + key) of every record, for vectorized key compares.
        self._idents = np.ndarray(
            shape=(self.n_records,), dtype="V33", buffer=buf, offset=self._header_bytes + _KM, strides=(L.RECORD_BYTES,)
        )
        # The group table in the arena: whole names (for compares) and their bytes.
        self._group_names = np.ndarray(shape=(self.max_groups,), dtype=f"V{_GNB}", buffer=buf, offset=L.GROUPS_OFFSET)
        self._group_bytes = np.ndarray(shape=(self.max_groups, _GNB), dtype=np.uint8, buffer=buf,
                                       offset=L.GROUPS_OFFSET)

    def close(self) -> None:
        """Unmap (the arena stays in shared memory)."""
        if self._closed:
            return
        self._closed = True
        self.publish_stats()
        views = self._views + (self._next, self._free_view)
        # the views are dropped before they are released (typed views in the compiled build hold them)
        self._clock = self._hi = self._hu = self._q = self._i = self._u = self._h = self._b = self._free_stack = None
        self._hq = self._rb = self._next = None
        for view in views:
            view.release()
        self.records = None
        self._raw = None
        self._idents = None
        self._intent_batch = None
        self._group_names = None
        self._group_bytes = None
        self._index.close()
        self._seg.close()

    def unlink(self) -> None:
        """Remove the shared-memory segment (the mapping stays valid until close)."""
        self._seg.unlink()

    def __enter__(self) -> TimerWheel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ header
    @property
    def current_ms(self) -> int:
        """The wheel's clock: the ``now_ms`` of the last advance."""
        return self._hq[L.H_CURRENT_MS // 8]

    def __len__(self) -> int:
        """Pending (scheduled) timers."""
        return self._count[_C_PENDING]

    @property
    def free_slots(self) -> int:
        return self.capacity - self._count[_C_PENDING] - self._count[_C_FIRED_UNACKED]

    # ------------------------------------------------------------------ links and the steps of a record
    def _link(self, slot: int, deadline: int, cur: int) -> int:
        """Link a record into the bucket for its deadline; return the state byte to store.

        The scalar paths index the views through ``self`` rather than local names: a
        compiled local copy of a view costs two atomic reference-count updates."""
        b, expiration, level = self._placement.place(deadline, cur)
        bp = b * _IW
        tail = self._i[bp + _PREV]
        if tail == b:  # bucket was empty: (re)set its expiration and queue it
            self._q[b * _QW] = expiration
            self._queue_bucket(b, expiration)
        sp = slot * _IW
        self._i[sp + _PREV] = tail
        self._i[sp + _NEXT] = b
        self._i[tail * _IW + _NEXT] = slot
        self._i[bp + _PREV] = slot
        self._pending_by_level[level] += 1
        return (level << _LEVEL_SHIFT) | _SCHEDULED

    def _unlink(self, slot: int) -> None:
        sp = slot * _IW
        prev = self._i[sp + _PREV]
        nxt = self._i[sp + _NEXT]
        self._i[prev * _IW + _NEXT] = nxt
        self._i[nxt * _IW + _PREV] = prev

    def _rearm(self, slot: int, deadline_ms: int, tag: int, cur: int) -> None:
        """Move a scheduled record: a multi-field update of a live record, so through the intent."""
        old_state = self._b[slot * _RB + _ST]
        self._unlink(slot)
        self._pending_by_level[old_state >> _LEVEL_SHIFT] -= 1
        new_state = self._link(slot, deadline_ms, cur)
        self._apply_with_intent(slot, new_state, deadline_ms, tag)
        self._count[_C_REARMS] += 1

    def _apply_with_intent(self, slot: int, state: int, deadline_ms: int, tag: int) -> None:
        self._hi[_INTENT_STATE] = state
        self._clock[_INTENT_DEADLINE] = deadline_ms
        self._hu[_INTENT_TAG] = tag  # the arena's words are little-endian, as this host's
        self._hi[_INTENT_SLOT] = slot  # commit the intent
        self._q[slot * _QW] = deadline_ms
        self._u[slot * _IW + _TAG] = tag
        self._b[slot * _RB + _ST] = state
        self._hi[_INTENT_SLOT] = -1  # done

    def _remove_scheduled(self, slot: int, group: int) -> None:
        state = self._b[slot * _RB + _ST]
        sp = slot * _IW  # _unlink, written out: one call less per cancel
        prev = self._i[sp + _PREV]
        nxt = self._i[sp + _NEXT]
        self._i[prev * _IW + _NEXT] = nxt
        self._i[nxt * _IW + _PREV] = prev
        self._b[slot * _RB + _ST] = _FREE  # commit point
        self._pending_by_level[state >> _LEVEL_SHIFT] -= 1
        self._index.remove(slot)
        self._free_stack[self._free_top] = slot  # _free, written out
        self._free_top += 1
        self._group_live[group] -= 1
        self._count[_C_PENDING] -= 1

    def _free(self, slot: int) -> None:
        self._free_stack[self._free_top] = slot
        self._free_top += 1

    def _fire(self, s: int, out: list) -> None:
        """A due timer of :meth:`expire`: to the tail of the fired list, FIRED; its slot to ``out``."""
        self._index.remove(s)
        fl = self.fired_list
        flp = fl * _IW
        tail = self._i[flp + _PREV]
        self._i[s * _IW + _PREV] = tail
        self._i[s * _IW + _NEXT] = fl
        self._i[tail * _IW + _NEXT] = s
        self._i[flp + _PREV] = s
        self._b[s * _RB + _ST] = _FIRED
        out.append(s)

    def _unlink_free(self, slot: int) -> None:
        """Unlink a record already stored FREE and push it on the free stack (for the rooms:
        :meth:`_unlink` and :meth:`_free` are C functions in the compiled build)."""
        self._unlink(slot)
        self._free(slot)

    def _new_counts(self, counts: list[int]) -> memoryview | list[int]:
        """Per-level or per-group counts in this build's form (see _int64_counts)."""
        return _int64_counts(counts)

    # ------------------------------------------------------------------ the bucket heap
    # Every non-empty bucket's expiration sits in a heap (Kafka's DelayQueue of buckets):
    # (expiration, sentinel) pairs, a heapq list on the Python path and C arrays when
    # compiled (_c_heap_* in wheel.pxd, its twin). _queued[b] is the expiration bucket b
    # is queued under (-1: none): an entry that disagrees is stale and skipped when popped.
    def _queue_bucket(self, b: int, expiration: int) -> None:
        """Queue bucket ``b`` under ``expiration`` unless it already is (a bucket that was
        empty: :meth:`_link`, and the numpy room's splices). Compiled, a C method (only the
        Python path's batch code calls it from a room)."""
        if self._queued[b] != expiration:
            self._queued[b] = expiration
            if _COMPILED:
                _c_heap_push(self, expiration, b)  # noqa: F821 - wheel.pxd
            else:
                heapq.heappush(self._heap, (expiration, b))

    def _fill_heap(self, pairs: list[tuple[int, int]]) -> None:
        """The heap of ``pairs`` (whose buckets' _queued entries are set), replacing the old one."""
        if _COMPILED:
            self._hn = 0
            _c_heap_fill(self, pairs)  # noqa: F821 - wheel.pxd
            self._heap = []
        else:
            heapq.heapify(pairs)
            self._heap = pairs

    def next_deadline(self) -> int | None:
        """Expiration of the earliest non-empty bucket: when ``advance`` next has work.

        This is a bucket time, not necessarily a timer's deadline: a higher-level
        bucket comes due to cascade. None when the wheel is empty.
        """
        if _COMPILED:
            return _c_next_deadline(self)  # noqa: F821 - wheel.pxd: the same loop over the C heap
        heap, queued, i = self._heap, self._queued, self._i
        while heap:
            expiration, b = heap[0]
            if queued[b] == expiration and i[b * _IW + _NEXT] != b:
                return expiration
            heapq.heappop(heap)  # stale: the bucket was emptied by cancels or re-queued
            if queued[b] == expiration:
                queued[b] = -1
        return None

    def _due_buckets(self, now_ms: int) -> list[int]:
        """The non-empty buckets due at ``now_ms``, in the heap's order, taken off the heap
        (each un-queued) but not detached: what :meth:`_collect` and :meth:`_collect_buckets`
        walk, and the compiled :meth:`expire_many` in C. Compiled, the heap is C arrays."""
        if _COMPILED:
            return _c_due_buckets(self, now_ms)  # noqa: F821 - wheel.pxd
        heap, queued, i = self._heap, self._queued, self._i
        due = []
        while heap and heap[0][0] <= now_ms:
            expiration, b = heapq.heappop(heap)
            if queued[b] != expiration:
                continue  # a stale entry: the bucket was queued again under another time
            queued[b] = -1
            if i[b * _IW + _NEXT] != b:  # else emptied by cancels
                due.append(b)
        return due

    def _heap_grow(self) -> None:
        """Twice the room in the C arrays of the compiled path's bucket heap."""
        n = self._hn
        self._hx = np.concatenate((np.asarray(self._hx)[:n], np.zeros(max(n, 256), dtype=np.int64)))
        self._hb = np.concatenate((np.asarray(self._hb)[:n], np.zeros(max(n, 256), dtype=np.int32)))

    # ------------------------------------------------------------------ cascading ahead
    def cascade_ahead(self, now_ms: int, max_entries: int) -> int:
        """Move timers of the next level-1 bucket down to level 0 before it comes due.

        The level-1 bucket ``[T, T + tick(1))`` cascades whole at ``T``; under load it
        holds thousands of timers, and re-placing them at ``T`` delays the timers
        due at ``T`` itself. While the clock ``cur`` runs through ``[T - tick(1), T)``,
        every timer of that bucket whose deadline is already within level 0's reach
        (``ceil(d / tick_ms) - cur // tick_ms <= wheel_size``, exactly the test
        ``bucket_for`` makes first) can go to its level-0 bucket now: that is the
        bucket a cascade at ``T`` would give it (level-0 buckets do not depend on the
        clock once a deadline fits), so nothing fires earlier or later than it would
        have; at ``T`` only the rest is left to cascade.

        Looks at no more than ``max_entries`` records of the bucket per call (the cost
        is bounded), continuing where the previous call stopped, and moves those that
        fit. A new pass over the bucket starts once the clock has covered half the time
        that was left to the bucket's expiration when the last pass began (at least
        1 ms): with deadlines spread over the bucket, each pass finds about half of
        what is left fitting, so a record is looked at about three times before the
        boundary instead of once per ms. Returns how many moved (counted in
        ``cascades_total``).

        If no bucket is due at ``now_ms``, the clock first moves to ``now_ms`` (what
        :meth:`expire` does then); otherwise placement stays relative to the stored
        clock and the due buckets wait for ``expire``.

        Crash consistency: only links and the level bits of state bytes change, both
        derived (``attach`` re-places every scheduled record from its deadline and the
        stored clock, which puts a timer that fits level 0 there anyway); deadlines,
        tags and keys are not touched, so no intent is needed.
        """
        _check_clock(now_ms)
        if type(max_entries) is not int or max_entries < 0:
            raise InvalidRequest("max_entries must be an integer >= 0")
        cur = self._move_idle_clock(now_ms)
        if self.levels < 2 or max_entries == 0:
            return 0
        t1 = self._ticks[1]
        v1 = cur // t1 + 1  # the level-1 bucket that comes due next (v1 - 1 is always empty)
        expiration = v1 * t1
        b = self.wheel_size + v1 % self.wheel_size
        if self._queued[b] != expiration or self._i[b * _IW + _NEXT] == b:
            return 0
        if not self._placement.level_value(expiration, cur, 0)[1]:
            return 0  # level 0 does not reach this bucket's first ms yet: nothing of it fits
        start, pass_cur = self._ahead_start(b, v1, cur)
        if start == b:
            return 0
        if _COMPILED:  # record by record in C: cheaper than numpy's fixed cost at this size
            return self._move_each_to_level0(start, b, max_entries, expiration, pass_cur, cur)
        i = self._i
        examined: list[int] = []
        s = start
        for _ in range(max_entries):
            if s == b:
                break
            examined.append(s)
            s = i[s * _IW + _NEXT]
        self._ahead = (expiration, s, pass_cur)
        return self._move_to_level0(np.array(examined, dtype=np.int64), s, cur)

    def _move_idle_clock(self, now_ms: int) -> int:
        """Move the clock to ``now_ms`` if no bucket is due by then (as :meth:`expire` would);
        returns the clock."""
        hq = self._hq
        cur = int(hq[_CUR])
        if now_ms > cur:
            due = self.next_deadline()
            if due is None or due > now_ms:
                hq[_CUR] = now_ms  # nothing is due: the clock moves, as in expire()
                return now_ms
        return cur

    def _ahead_start(self, b: int, v1: int, cur: int) -> tuple[int, int]:
        """(the record of level-1 bucket ``b`` a pass of :meth:`cascade_ahead` looks at first, the
        clock its pass began at): where the last call stopped while that record is still
        in the bucket, else the bucket's head; ``b`` itself when the last pass over the
        bucket ended and the next is not due yet (see :meth:`cascade_ahead`)."""
        t1 = self._ticks[1]
        head = self._i[b * _IW + _NEXT]
        ahead = self._ahead
        if ahead is None or ahead[0] != v1 * t1:
            return head, cur
        at = ahead[1]
        if at == b:  # the last pass ended: the next waits for half the time left then
            began = ahead[2]
            return (head, cur) if cur - began >= max(1, (v1 * t1 - began) // 2) else (b, began)
        if (self.first_entry <= at < self.n_records
                and self._rb[at * _RB + _ST] == (1 << _LEVEL_SHIFT) | _SCHEDULED
                and self._q[at * _QW] // t1 == v1):  # still in this bucket: continue the pass
            return at, ahead[2]
        return head, cur

    def _move_each_to_level0(self, start: int, b: int, max_entries: int, expiration: int, pass_cur: int,
                             cur: int) -> int:
        """The walk of :meth:`cascade_ahead` and :meth:`_move_to_level0` one record at a
        time (the compiled build uses this one): from ``start``, at most ``max_entries``
        records of bucket ``b``; each that fits is unlinked and appended to its level-0
        bucket as the walk meets it, in list order, so the links, the states and the
        counts come out as that method leaves them (a move rewrites no link the rest of
        the walk follows but its successor's back link)."""
        i = self._i
        moved = 0
        s = start
        for _ in range(max_entries):
            if s == b:
                break
            nxt = i[s * _IW + _NEXT]
            deadline = self._q[s * _QW]
            if self._placement.place(deadline, cur)[2] == 0:
                self._unlink(s)
                self._b[s * _RB + _ST] = self._link(s, deadline, cur)  # level 0 (counted by _link)
                moved += 1
            s = nxt
        self._ahead = (expiration, s, pass_cur)
        if moved:
            self._pending_by_level[1] -= moved
            self._count[_C_CASCADES] += moved
        return moved

    # ------------------------------------------------------------------ introspection
    def pending(self, limit: int | None = None) -> Iterator[tuple[object, int, int]]:
        """(key, deadline_ms, group) of scheduled timers, in slot order, at most ``limit``."""
        states = self.records["state"] & _STATE_MASK
        slots = np.flatnonzero(states == _SCHEDULED)
        slots = slots[slots >= self.first_entry]
        if limit is not None:
            slots = slots[:limit]
        for s in slots.tolist():
            key, deadline, group, *_ = self._entry(s)
            yield key, deadline, group

    def counters(self) -> dict[str, int]:
        c = dict(zip(OWN_COUNTERS, self._count_array))
        for level in range(self.levels):
            c[f"pending_level_{level}"] = self._pending_by_level[level]
        c["pending_due"] = self._pending_by_level[L.DUE_LEVEL]
        return c

    def publish_stats(self) -> None:
        """Write the wheel's counters into the arena header, where wheelctl reads them
        (the daemon's own counters, in the same table, are left alone): the words of
        :meth:`counters`, each from its count."""
        hq, count, by_level = self._clock, self._count, self._pending_by_level
        for j in range(len(_OWN_WORDS)):
            hq[_OWN_WORDS[j]] = count[j]
        for level in range(self.levels):
            hq[_LEVEL_WORDS[level]] = by_level[level]
        hq[_DUE_WORD] = by_level[_DUE_LEVEL]

    def header_words(self) -> memoryview:
        """The header's first page as int64 words (counters, parked flag, histogram)."""
        return self._hq

    def store_words(self, word_of: dict, values: dict) -> None:
        """``header_words()[word_of[name]] = value`` for each name and value of ``values``,
        in one call (the daemon's counters); KeyError for a name ``word_of`` lacks."""
        hq = self._clock
        for name, value in values.items():
            hq[word_of[name]] = value


class TimerWheel(WheelRecords, GroupTable, WheelAttach, NumpyBatches):
    """The timing wheel over an arena: the operations, scalar and batch, over
    :class:`WheelRecords`, with the rooms of the group table, of making and attaching
    an arena and of the numpy batch operations. See the module docstring."""

    # ------------------------------------------------------------------ scalar operations
    def schedule(self, key, deadline_ms: int, group: int = 0, tag: int = 0, aux: int = -1) -> tuple[int, int]:
        """Schedule ``key`` to expire at ``deadline_ms``; an existing key is re-armed.

        Returns the handle ``(slot, generation)``. Raises InvalidKey, InvalidDelay,
        InvalidRequest (bad group/tag/aux) or ArenaFull; on any error nothing changed.
        """
        return self.schedule_ident(_ident_of(key), deadline_ms, group, tag, aux)

    def schedule_ident(self, ident: bytes, deadline_ms: int, group: int = 0, tag: int = 0,
                       aux: int = -1) -> tuple[int, int]:
        """``schedule`` for a key already encoded as its 33-byte record form (meta + padded key)."""
        if type(deadline_ms) is not int:
            raise InvalidDelay(f"a deadline is an integer number of ms, not {type(deadline_ms).__name__}")
        cur = self._clock[_CUR]
        # A deadline beyond +-DEADLINE_HIGH is more than _MAX_DELAY from any clock the wheel
        # accepts (+-MAX_CLOCK_MS); within it, the value and cur +- _MAX_DELAY fit 64 bits
        # (the compiled build's C integers; Python's cannot overflow, the next check covers it).
        if _COMPILED and not DEADLINE_LOW <= deadline_ms <= DEADLINE_HIGH:
            raise InvalidDelay(deadline_reason(deadline_ms, cur, MAX_DELAY_MS))
        deadline = deadline_ms  # from here on 64-bit (C integers in the compiled build)
        if deadline > cur + _MAX_DELAY or deadline < cur - _MAX_DELAY:
            raise InvalidDelay(deadline_reason(deadline_ms, cur, MAX_DELAY_MS))
        if not 0 <= group < self.max_groups:
            raise InvalidRequest(f"group id {group} out of range")
        if not 0 <= tag <= 0xFFFFFFFF or not -(1 << 31) <= aux < (1 << 31):
            raise InvalidRequest("tag is u32, aux is i32")
        g = group
        t = tag
        a = aux
        slot = self._index.find(ident, g)
        if slot >= 0:
            self._rearm(slot, deadline, t, cur)
            return slot, self._u[slot * _IW + _GEN]
        top = self._free_top
        if not top:
            self._count[_C_ARENA_FULL] += 1
            raise ArenaFull(f"all {self.capacity} entry records are in use")
        if len(ident) != 33 or not VALID_KEY_METAS[ident[0]]:
            raise InvalidKey("malformed encoded key")
        slot = self._free_stack[top - 1]
        self._free_top = top - 1
        sp = slot * _IW
        gen = (self._u[sp + _GEN] + 1) & _GEN_MASK
        self._u[sp + _GEN] = gen
        self._u[sp + _TAG] = t
        self._i[sp + _AUX] = a
        self._h[slot * _HW + _GROUP] = g
        self._q[slot * _QW] = deadline
        base = slot * _RB
        if _COMPILED and type(ident) is bytes:
            _put_key(self._b, base + _KM, ident)  # noqa: F821 - wheel.pxd: memcpy of the 33 bytes
        else:
            self._rb[base + _KM : base + _RB] = ident
        state = self._link(slot, deadline, cur)
        self._b[base + _ST] = state  # commit point: the timer exists from here on
        self._index.add_vacant(slot)  # where find ended its probe for this key
        self._group_live[g] += 1
        self._count[_C_PENDING] += 1
        self._count[_C_ADDS] += 1
        return slot, gen

    def cancel(self, key, group: int = 0) -> bool:
        """Remove a pending timer; True if there was one."""
        return self.cancel_ident(_ident_of(key), group)

    def cancel_ident(self, ident: bytes, group: int = 0) -> bool:
        if not 0 <= group < self.max_groups:
            raise InvalidRequest(f"group id {group} out of range")
        slot = self._index.find(ident, group)
        if slot < 0:
            self._count[_C_CANCEL_MISSES] += 1
            return False
        self._remove_scheduled(slot, group)
        self._count[_C_CANCELS] += 1
        return True

    def cancel_handle(self, handle: tuple[int, int]) -> bool:
        """Cancel by handle; a stale handle (fired, cancelled, slot reused) is a no-op."""
        slot, gen = handle
        if not self.first_entry <= slot < self.n_records or self._u[slot * _IW + _GEN] != gen:
            return False
        if self._b[slot * _RB + _ST] & _STATE_MASK != _SCHEDULED:
            return False
        self._remove_scheduled(slot, self._h[slot * _HW + _GROUP])
        self._count[_C_CANCELS] += 1
        return True

    def lookup(self, key, group: int = 0) -> int | None:
        """Deadline of the pending timer for ``key``, or None."""
        return self.lookup_ident(_ident_of(key), group)

    def lookup_ident(self, ident: bytes, group: int = 0) -> int | None:
        """:meth:`lookup` for an encoded key (meta byte + key bytes)."""
        if not 0 <= group < self.max_groups:
            raise InvalidRequest(f"group id {group} out of range")
        slot = self._index.find(ident, group)
        return None if slot < 0 else self._q[slot * _QW]

    def lookup_many(self, idents, group: int = 0) -> list[int | None]:
        """:meth:`lookup_ident` of distinct encoded keys of one group, found in one pass."""
        if _COMPILED:  # one compiled probe per key: no numpy fixed costs (the daemon looks each chunk up)
            items = self._batch_idents(idents)[0] if isinstance(idents, np.ndarray) else list(idents)
            for ident in items:
                if type(ident) is not bytes or len(ident) != 33:
                    raise InvalidKey("encoded keys are 33-byte bytes objects (meta + padded key)")
            if not items:
                return []
            gid = self._check_gid(group)
            find, q, out = self._index.find, self._q, []
            for ident in items:
                slot = find(ident, gid)
                out.append(None if slot < 0 else q[slot * _QW])
            return out
        ident_list, ident_arr = self._batch_idents(idents)
        if not ident_list:
            return []
        groups = np.full(len(ident_list), self._check_gid(group), dtype=np.int64)
        found = self._index.find_many(ident_arr, self._index.key_hashes(ident_list, groups), groups)
        deadlines = self.records["deadline"][np.where(found >= 0, found, 0)].tolist()
        return [None if slot < 0 else d for slot, d in zip(found.tolist(), deadlines)]

    def _collect(self, now_ms: int) -> list[int]:
        """Detach every bucket due at ``now_ms``, advance the clock, return their slots."""
        i = self._i
        out: list[int] = []
        for b in self._due_buckets(now_ms):
            bp = b * _IW
            s = i[bp + _NEXT]
            while s != b:
                out.append(s)
                s = i[s * _IW + _NEXT]
            i[bp + _PREV] = b
            i[bp + _NEXT] = b
        if now_ms > self._clock[_CUR]:
            self._clock[_CUR] = now_ms  # after detaching, before re-placing (see Crash consistency)
        return out

    def _sweep(self, now_ms: int, to_fired: bool, out: list, sources, rearmed: list | None) -> int:
        """Advance to ``now_ms``; each due timer goes to the fired list (``to_fired``: its slot
        appended to ``out``) or is freed (its ``(key, deadline_ms)`` appended to ``out``);
        the rest is placed again. With ``sources`` (see :meth:`expire`), a due idle timer
        touched since it was armed is placed again at its new deadline instead."""
        _check_clock(now_ms)
        slots = self._collect(now_ms)
        if not slots:
            return 0
        now = now_ms
        q, b = self._q, self._b
        by_level = self._pending_by_level
        cur = self._clock[_CUR]
        index = self._index
        fired = cascaded = touched = 0
        views: dict = {}
        for s in slots:
            deadline = q[s * _QW]
            state = b[s * _RB + _ST]
            by_level[state >> _LEVEL_SHIFT] -= 1
            if deadline <= now:
                if to_fired:
                    aux = self._i[s * _IW + _AUX]
                    if sources is not None and aux >= 0:
                        rearm_at = self._touched_deadline(aux, now, now, sources, views, s, deadline, rearmed)
                        if rearm_at:  # a multi-field update of a live record: through the intent
                            self._apply_with_intent(s, self._link(s, rearm_at, cur), rearm_at, self._u[s * _IW + _TAG])
                            touched += 1
                            continue
                    self._fire(s, out)
                else:  # advance: the key and deadline to out, the record freed
                    base = s * _RB
                    meta = b[base + _KM]
                    # compiled: the key built from the record's bytes (None: a meta byte encode_key never writes)
                    if not _COMPILED or (key := _decode_key_at(b, base + _KEY, meta)) is None:  # noqa: F821
                        key = decode_key(bytes(self._rb[base + _KEY : base + _KEY_END[meta]]), meta)
                    out.append((key, deadline))
                    b[base + _ST] = _FREE
                    index.remove(s)
                    self._free_stack[self._free_top] = s  # _free, written out
                    self._free_top += 1
                    self._group_live[self._h[s * _HW + _GROUP]] -= 1
                fired += 1
            else:
                b[s * _RB + _ST] = self._link(s, deadline, cur)
                cascaded += 1
        c = self._count
        c[_C_EXPIRATIONS] += fired
        c[_C_CASCADES] += cascaded
        c[_C_PENDING] -= fired
        c[_C_IDLE_REARMS] += touched
        return fired

    def _touched_deadline(self, aux: int, now: int, floor: int, sources, views: dict, slot: int, deadline: int,
                          rearmed: list | None) -> int:
        """The lazy re-arm of an idle timer (``aux``: its client's slot and touch index) due
        by ``floor`` (``now`` for one come due): the deadline it moves to when its client
        touched it since it was armed (last touch + idle_ms, later than ``floor``; appended
        to ``rearmed`` as ``(slot, old deadline, new deadline, idle_ms)``), or 0: it stays
        (one come due fires, and the daemon decides what then: ``Delivery.idle_check``,
        for a client whose touch table is out of reach, impossible words to poison it for,
        a touch stored after ``now``). ``views`` caches each client's (last touch, idle)
        views for one pass."""
        if self._h[slot * _HW + _GROUP] >= self.max_groups or not VALID_KEY_METAS[self._b[slot * _RB + _KM]]:
            return 0  # a damaged record (overwritten in the arena): it fires, the daemon frees it
        client = aux >> _TOUCH_INDEX_BITS
        pair = views.get(client, _NO_VIEWS)
        if pair is _NO_VIEWS:
            source = sources.get(client)
            pair = views[client] = None if source is None else source.touch_views()
        if pair is None:
            return 0
        index = aux & _TOUCH_INDEX_MASK
        try:
            last_touch = pair[0][index]
            idle_ms = pair[1][index]
        except (IndexError, ValueError):  # beyond its table, or the segment was closed (views released)
            return 0
        if not (0 < last_touch <= now + 1 and 0 < idle_ms <= _MAX_IDLE_MS):  # the words Delivery.idle_check refuses
            return 0
        rearm_at = last_touch + idle_ms
        if rearm_at <= floor:
            return 0
        if rearmed is not None:
            rearmed.append((slot, deadline, rearm_at, idle_ms))
        return rearm_at

    def advance(self, now_ms: int) -> list[tuple[object, int]]:
        """Move the clock to ``now_ms``; return ``(key, deadline_ms)`` of every timer due.

        Their records are freed: the caller owns the result. (The daemon uses
        :meth:`expire` instead, which keeps fired timers until they are acknowledged.)
        """
        out: list[tuple[object, int]] = []
        self._sweep(now_ms, False, out, None, None)
        return out

    def expire(self, now_ms: int, sources=None, rearmed: list | None = None) -> list[int]:
        """Move the clock to ``now_ms``; move every due timer to the fired list.

        Returns the slots, now FIRED: they keep their key, deadline, group, tag and
        aux until :meth:`release` (delivery acknowledged) or :meth:`rearm_fired` (the
        aux word may be rewritten meanwhile: :meth:`mark_fired`).

        ``sources``: the lazy re-arm of idle timers, in this pass (the daemon's client
        table: client slot -> an object whose ``touch_views()`` returns its touch
        table's (last touch, idle_ms) int64 views, or None when they must not be read).
        A due idle timer whose client touched it since it was armed is placed again at
        last touch + idle_ms, still scheduled (its key stays indexed), and appended to
        ``rearmed`` (see :meth:`_touched_deadline`); every other due timer fires. What
        this pass cannot decide fires, for the caller to decide (and re-arm with
        :meth:`rearm_fired`).
        """
        out: list[int] = []
        fired = self._sweep(now_ms, True, out, sources, rearmed)
        self._count[_C_FIRED_UNACKED] += fired
        return out

    def rearm_touched_ahead(self, now_ms: int, horizon_ms: int, max_entries: int, sources,
                            rearmed: list | None = None) -> int:
        """The lazy re-arm of :meth:`expire`, ahead of time: every idle timer of the level-0
        buckets due in ``(now_ms, now_ms + horizon_ms]`` whose client touched it since it
        was armed, so that last touch + idle_ms is already later than its deadline, moves
        there now (through the intent; ``sources`` and ``rearmed`` as for :meth:`expire`).

        It would move there anyway when it came due: a touch word only grows (a touch
        stores the clock), so the word read then gives a deadline at least as late, and a
        touch the daemon has seen is activity it may act on at once. Nothing moves
        earlier and nothing fires. What it saves is the wake-ups: with many connections
        the idle deadlines cover every ms, and a daemon that waits for each bucket wakes
        every ms to find its timers touched; looking ahead a few ms at each wake-up
        empties those buckets first, while an untouched timer still fires in its own ms.
        Records of other kinds are looked at and left; no more than ``max_entries`` records
        are looked at per call (the cost is bounded, as :meth:`cascade_ahead`'s). Returns
        how many moved (counted in ``idle_rearms_total``)."""
        _check_clock(now_ms)
        if type(horizon_ms) is not int or horizon_ms < 0 or type(max_entries) is not int or max_entries < 0:
            raise InvalidRequest("horizon_ms and max_entries must be integers >= 0")
        cur = self._move_idle_clock(now_ms)
        tick, size = self.tick_ms, self.wheel_size
        views: dict = {}
        moved = 0
        budget = max_entries
        for v0 in range(now_ms // tick + 1, min((now_ms + horizon_ms) // tick, cur // tick + size - 1) + 1):
            b = v0 % size  # the level-0 bucket of [v0 * tick, (v0 + 1) * tick)
            if self._queued[b] != v0 * tick:
                continue
            # A bucket walked before, with no idle timer in it and nothing appended since (a
            # record joins a bucket at its tail), is skipped: a bucket of other kinds costs
            # one look, not a walk every call. An idle timer that reached it otherwise (a
            # tail re-armed back into it behind one) is left to the due pass, which moves
            # it all the same.
            tail = self._i[b * _IW + _PREV]
            if self._ahead_walked(b, v0 * tick, tail):
                continue
            idle_seen = False
            s = self._i[b * _IW + _NEXT]
            while s != b:
                if budget == 0:
                    idle_seen = True  # (not walked to its end: no memo)
                    break
                budget -= 1
                after = self._i[s * _IW + _NEXT]
                aux = self._i[s * _IW + _AUX]
                deadline = self._q[s * _QW]
                if aux >= 0:
                    idle_seen = True
                    rearm_at = self._touched_deadline(aux, now_ms, deadline, sources, views, s, deadline, rearmed)
                    if rearm_at:
                        self._unlink(s)
                        self._pending_by_level[0] -= 1
                        self._apply_with_intent(s, self._link(s, rearm_at, cur), rearm_at, self._u[s * _IW + _TAG])
                        moved += 1
                s = after
            if not idle_seen:
                self._ahead_remember(b, v0 * tick, tail)
        self._count[_C_IDLE_REARMS] += moved
        return moved

    def _ahead_walked(self, b: int, expiration: int, tail: int) -> bool:
        """rearm_touched_ahead walked level-0 bucket ``b`` (under ``expiration``) to ``tail``,
        its tail now, and found no idle timer (:meth:`_ahead_remember`)."""
        m = 3 * b
        return (self._ahead_memo[m] == expiration and self._ahead_memo[m + 1] == tail
                and self._ahead_memo[m + 2] == self._u[tail * _IW + _GEN])

    def _ahead_remember(self, b: int, expiration: int, tail: int) -> None:
        m = 3 * b
        self._ahead_memo[m] = expiration
        self._ahead_memo[m + 1] = tail
        self._ahead_memo[m + 2] = self._u[tail * _IW + _GEN]

    def fired(self, slot: int) -> tuple[object, int, int, int, int, int]:
        """(key, deadline_ms, group, tag, aux, generation) of a FIRED record."""
        if not self.first_entry <= slot < self.n_records or self._rb[slot * _RB + _ST] != _FIRED:
            raise InvalidRequest(f"slot {slot} is not a fired timer")
        return self._entry(slot)

    def _entry(self, slot: int) -> tuple[object, int, int, int, int, int]:
        base = slot * _RB
        meta = self._b[base + _KM]
        key = _decode_key_at(self._b, base + _KEY, meta) if _COMPILED else None  # noqa: F821 - wheel.pxd
        if key is None:
            key = decode_key(bytes(self._rb[base + _KEY : base + _KEY_END[meta]]), meta)
        sp = slot * _IW
        return (key, self._q[slot * _QW], self._h[slot * _HW + _GROUP], self._u[sp + _TAG], self._i[sp + _AUX],
                self._u[sp + _GEN])

    def fired_slots(self) -> list[int]:
        """Every FIRED record, in the order they fired (rebuilt in deadline order on attach)."""
        out, i, fl = [], self._i, self.fired_list
        s = i[fl * _IW + _NEXT]
        while s != fl:
            out.append(s)
            s = i[s * _IW + _NEXT]
        return out

    def mark_fired(self, slots, aux: int) -> int:
        """Store ``aux`` in the aux word of each FIRED record of ``slots`` (one aligned store
        each; other slots are skipped). The wheel never reads a fired record's aux: the
        daemon notes there the client a fired timer was sent to (``arena_layout.recipient_aux``).
        Returns how many records were written."""
        if type(aux) is not int or not -(1 << 31) <= aux < (1 << 31):
            raise InvalidRequest("aux is i32")
        first, end = self.first_entry, self.n_records
        marked = 0
        for slot in slots:
            if first <= slot < end and self._b[slot * _RB + _ST] == _FIRED:
                self._i[slot * _IW + _AUX] = aux
                marked += 1
        return marked

    def release(self, slot: int, generation: int) -> bool:
        """Free a FIRED record (its delivery was acknowledged). A stale handle is a no-op."""
        if not self.first_entry <= slot < self.n_records:
            return False
        if self._b[slot * _RB + _ST] != _FIRED or self._u[slot * _IW + _GEN] != generation:
            return False
        self._unlink(slot)
        self._b[slot * _RB + _ST] = _FREE  # commit point
        self._free(slot)
        self._group_live[self._h[slot * _HW + _GROUP]] -= 1
        c = self._count
        c[_C_FIRED_UNACKED] -= 1
        c[_C_ACKS] += 1
        return True

    def rearm_fired(self, slot: int, generation: int, deadline_ms: int) -> bool:
        """Put a FIRED timer back on the wheel (an idle timer found touched when due).

        False (and nothing changes) if the handle is stale or the key was scheduled
        again meanwhile; the caller then releases the old record.
        """
        if type(deadline_ms) is not int:
            raise InvalidDelay("a deadline is an integer number of ms")
        cur = self._clock[_CUR]
        if deadline_ms - cur > _MAX_DELAY or deadline_ms < cur - _MAX_DELAY:
            raise InvalidDelay(deadline_reason(deadline_ms, cur, MAX_DELAY_MS))
        deadline = deadline_ms  # validated: from here on 64-bit (C integers in the compiled build)
        if not self.first_entry <= slot < self.n_records:
            return False
        if self._b[slot * _RB + _ST] != _FIRED or self._u[slot * _IW + _GEN] != generation:
            return False
        base = slot * _RB
        ident = bytes(self._rb[base + _KM : base + _RB])
        group = self._h[slot * _HW + _GROUP]
        if self._index.find(ident, group) >= 0:
            return False
        self._unlink(slot)
        state = self._link(slot, deadline, cur)
        self._apply_with_intent(slot, state, deadline, self._u[slot * _IW + _TAG])
        self._index.add(slot, self._index.key_hash(ident, group))
        c = self._count
        c[_C_FIRED_UNACKED] -= 1
        c[_C_PENDING] += 1
        c[_C_IDLE_REARMS] += 1
        return True

    # ------------------------------------------------------------------ batch operations
    # (checked here, then run by the C loops of wheel.pxd when compiled, else by the numpy room)
    def _ident_array(self, idents) -> np.ndarray:
        """The V33 array of :meth:`_batch_idents` without its list (the compiled batch paths
        read the keys' bytes in C)."""
        if isinstance(idents, np.ndarray):
            if idents.dtype.itemsize != 33 or idents.ndim != 1:
                raise InvalidKey("encoded keys are a 1-d array of 33-byte items (meta + padded key)")
            return np.ascontiguousarray(idents).view("V33")
        return self._batch_idents(idents)[1]

    def _column(self, values, n: int, low: int, high: int, what: str, exc=InvalidRequest) -> np.ndarray:
        """:meth:`_batch_column` for the C loops of the compiled batch paths: an int64 array of ``n``
        items, or of one item that holds for every item (from an int). The usual inputs (an
        int, a 1-d int64 array) are checked here (the range in C), the others, and any value
        out of range, by :meth:`_batch_column` (with its exceptions)."""
        if type(values) is int:
            if low <= values <= high:
                one = _ONE_VALUE.get(values)
                return np.array((values,), dtype=np.int64) if one is None else one
        elif (type(values) is np.ndarray and values.dtype is _INT64 and values.ndim == 1 and values.size == n
              and _c_in_range(values, low, high)):  # noqa: F821 - wheel.pxd
            return values
        return self._batch_column(values, n, low, high, what, exc)

    def schedule_many(self, idents, deadlines_ms, groups=0, tags=0, auxs=-1) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`schedule_ident` for a batch: arrays (or scalars) of equal length.

        Returns ``(slots, generations)``; an item refused because the arena is full
        has slot -1 (the scalar method would raise ArenaFull for it). Bad input
        anywhere in the batch raises InvalidKey / InvalidDelay / InvalidRequest and
        changes nothing.
        """
        if _COMPILED:
            ident_list, ident_arr = None, self._ident_array(idents)
            n = ident_arr.size
        else:
            ident_list, ident_arr = self._batch_idents(idents)
            n = len(ident_list)
        cur = self._hq[_CUR]
        column = self._column if _COMPILED else self._batch_column
        deadlines = column(deadlines_ms, n, cur - MAX_DELAY_MS, cur + MAX_DELAY_MS, "deadline_ms", InvalidDelay)
        groups = column(groups, n, 0, self.max_groups - 1, "group id")
        tags = column(tags, n, 0, 0xFFFFFFFF, "tag")
        auxs = column(auxs, n, -(1 << 31), (1 << 31) - 1, "aux")
        slots_out = np.full(n, -1, dtype=np.int64)
        gens_out = np.zeros(n, dtype=np.uint32)
        if not n:
            return slots_out, gens_out
        if _COMPILED:  # C loops over the keys' bytes (wheel.pxd)
            hashes = np.empty(n, dtype=np.int64)
            if _c_hash_idents(self, ident_arr.view(np.uint8), groups, hashes, _VALID_META_BYTES, True):  # noqa: F821
                raise InvalidKey("malformed encoded key")
            if not _c_has_duplicates(hashes):  # noqa: F821 - wheel.pxd
                rearms, added, refused = _c_schedule_many(  # noqa: F821 - wheel.pxd
                    self, ident_arr.view(np.uint8), deadlines, groups, tags, auxs, cur, hashes, slots_out, gens_out,
                    self._intent_batch.view(np.uint8), CorruptArena)
                c = self._count
                c[_C_REARMS] += rearms
                c[_C_ARENA_FULL] += refused
                c[_C_PENDING] += added
                c[_C_ADDS] += added
                return slots_out, gens_out
            deadlines, groups, tags, auxs = (np.broadcast_to(v, (n,)) for v in (deadlines, groups, tags, auxs))
            return self._schedule_each(ident_arr.tolist(), deadlines, groups, tags, auxs, slots_out, gens_out)
        return self._schedule_many_np(ident_list, ident_arr, deadlines, groups, tags, auxs, cur, slots_out, gens_out)

    def cancel_many(self, idents, groups=0) -> np.ndarray:
        """:meth:`cancel_ident` for a batch; returns a bool array (True: a timer was removed)."""
        if _COMPILED:
            ident_list, ident_arr = None, self._ident_array(idents)
            n = ident_arr.size
        else:
            ident_list, ident_arr = self._batch_idents(idents)
            n = len(ident_list)
        groups = (self._column if _COMPILED else self._batch_column)(groups, n, 0, self.max_groups - 1, "group id")
        if not n:
            return np.zeros(0, dtype=bool)
        if _COMPILED:  # C loops over the keys' bytes (wheel.pxd)
            hashes = np.empty(n, dtype=np.int64)
            _c_hash_idents(self, ident_arr.view(np.uint8), groups, hashes, _VALID_META_BYTES, False)  # noqa: F821
            if not _c_has_duplicates(hashes):  # noqa: F821 - wheel.pxd
                hit = np.zeros(n, dtype=bool)
                k = _c_cancel_many(self, ident_arr.view(np.uint8), groups, hashes, hit.view(np.uint8),  # noqa: F821
                                   CorruptArena)
                c = self._count
                c[_C_PENDING] -= k
                c[_C_CANCELS] += k
                c[_C_CANCEL_MISSES] += n - k
                return hit
            ident_list = ident_arr.tolist()  # a key twice: the scalar loop
            groups = np.broadcast_to(groups, (n,))
            return np.array([self.cancel_ident(ident_list[j], int(groups[j])) for j in range(n)], dtype=bool)
        return self._cancel_many_np(ident_list, ident_arr, groups, n)

    def expire_many(self, now_ms: int) -> np.ndarray:
        """:meth:`expire` for a whole advance, with whole buckets moved at once.

        Every timer of a due level-0 bucket (or of the due list) is due: level 0
        rounds up, so the bucket's expiration is at or after each of its deadlines
        (checked anyway, never early). Such a bucket moves to the fired list as one
        chain (four link stores), its records change state with one numpy store and
        leave the key index together. Timers of due higher-level buckets are
        re-checked one by one (vectorized): the due ones fire, the rest cascade.

        Returns the FIRED slots as an int64 array, in the order they now have on the
        fired list; read their fields at once with :meth:`records_of`.
        """
        _check_clock(now_ms)
        if _COMPILED:  # the same steps, record by record in C (wheel.pxd)
            out: list = []
            fired, cascaded = _c_expire_many(self, self._due_buckets(now_ms), now_ms, _int64_array, out,  # noqa: F821
                                             CorruptArena)
            if not out:
                return np.zeros(0, dtype=np.int64)
            self._count_expired(fired, cascaded)
            return out[0]
        return self._expire_many_np(now_ms)

    def _count_expired(self, fired: int, cascaded: int) -> None:
        c = self._count
        c[_C_EXPIRATIONS] += fired
        c[_C_CASCADES] += cascaded
        c[_C_PENDING] -= fired
        c[_C_FIRED_UNACKED] += fired

    def release_many(self, slots, generations) -> np.ndarray:
        """:meth:`release` for a batch; returns a bool array (False: stale handle, no-op)."""
        try:
            slots = np.asarray(slots, dtype=np.int64).reshape(-1)
            generations = np.asarray(generations, dtype=np.int64)
            if not (_COMPILED and generations.shape == slots.shape):  # (compiled: no broadcast view needed)
                generations = np.broadcast_to(generations, slots.shape)
        except (OverflowError, ValueError, TypeError) as error:
            raise InvalidRequest(f"release_many takes equal-length integer slots and generations: {error}") from None
        if _COMPILED:  # the same steps, record by record in C (wheel.pxd)
            ok = np.zeros(slots.shape, dtype=bool)
            k = _c_release_many(self, slots, generations, ok.view(np.uint8), CorruptArena)  # noqa: F821 - wheel.pxd
            c = self._count
            c[_C_FIRED_UNACKED] -= k
            c[_C_ACKS] += k
            return ok
        return self._release_many_np(slots, generations)

    def records_of(self, slots) -> np.ndarray:
        """A copy of the records at ``slots`` (numpy structured array: deadline, tag, key, ...)."""
        if _COMPILED and type(slots) is np.ndarray and slots.dtype is _INT64 and slots.ndim == 1:
            out = np.empty(slots.size, dtype=L.RECORD_DTYPE)  # copied in C (wheel.pxd) when every slot is a record
            if _c_records_of(self, slots, out.view(np.uint8)):  # noqa: F821 - wheel.pxd
                return out
        return self._raw[np.asarray(slots, dtype=np.int64)].view(L.RECORD_DTYPE)  # whole-record copies: fast

    def record_rows(self, slots) -> list[tuple]:
        """``records_of(slots).tolist()`` read straight from the arena: one tuple per slot,
        (deadline, prev, next, gen, tag, aux, group, state, key_meta, key) with the key
        field's 32 bytes. Compiled, it costs no numpy call (what a few rows need)."""
        out = []
        for s in slots:
            if not 0 <= s < self.n_records:
                raise InvalidRequest(f"slot {s} is not a record of this arena")
            sp = s * _IW
            base = s * _RB
            key = _key_field(self._b, base + _KEY) if _COMPILED else bytes(self._rb[base + _KEY : base + _RB])  # noqa: F821 - wheel.pxd
            out.append((self._q[s * _QW], self._i[sp + _PREV], self._i[sp + _NEXT], self._u[sp + _GEN],
                        self._u[sp + _TAG], self._i[sp + _AUX], self._h[s * _HW + _GROUP], self._b[base + _ST],
                        self._b[base + _KM], key))
        return out
