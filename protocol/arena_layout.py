"""Binary layout of the wheeld arena: declared here once, used everywhere.

The arena is one shared-memory segment. It holds a header page (parameters,
clock, crash-recovery intent, counters read by ``wheelctl stats``, the group
table), then an array of 64-byte records. The first records are bucket
sentinels; the rest are timer entries. Every link is a record index ("slot"),
never a pointer, so the arena means the same thing in every process that maps it.

Segment::

    0                         HEADER_BYTES                          segment end
    +-------------------------+----------------------------------------------+
    | header                  | record 0 .. record (sentinels + capacity - 1)|
    +-------------------------+----------------------------------------------+
                              ^ RECORDS_OFFSET

    record index:  0 .. FIRED_LIST-1           bucket sentinels, level by level
                   DUE_LIST                    sentinel: timers already due
                   FIRED_LIST                  sentinel: fired, not yet acknowledged
                   first_entry .. end          timer entries (the "capacity")

Header (little-endian, offsets in bytes)::

    0    magic            u64   b"WHEELD\\x00\\x01"
    8    layout_version   u32
    12   record_bytes     u32   always 64
    16   capacity         u32   timer entries
    20   tick_ms          u32
    24   wheel_size       u32   buckets per level
    28   levels           u32
    32   start_ms         i64   clock value the arena was created at
    40   current_ms       i64   the wheel's clock: time of the last advance
    48   free_head        i32   unused, -1 (free records are derived state, kept by the owner)
    52   max_groups       u32
    56   created_wall_ms  i64
    64   -- cache line: crash-recovery intent (see shm.wheel) --
    64   intent_slot      i32   -1 when no update is in flight
    68   intent_state     u32
    72   intent_deadline  i64
    80   intent_tag       u32
    84   intent_count     u32   entries of the batch intent, 0 when none is in flight
    128  -- cache line: doorbell eventcount (the daemon's "parked" flag) --
    128  parked           u64
    136  wake_seq         u64
    144  journal_open     u64   not 0 while the daemon has applied a batch to the records that
                                it has not appended to its journal yet (daemon/recorder.py):
                                1, or 2 + the client slot whose ring chunk the batch applies
                                (journal_open_word below)
    192  -- counters: COUNTERS u64 words, names in COUNTER_NAMES --
    192+8*COUNTERS  -- lateness histogram: LATENESS_BUCKETS u64 --
    GROUPS_OFFSET   -- group table: max_groups names, GROUP_NAME_BYTES each; an entry
                       whose first byte is 0 is an unused id (that byte is the commit
                       point of registering and of forgetting a name) --
    intent_batch_offset(max_groups)  -- batch intent: INTENT_BATCH_MAX entries
                       (slot i32, tag u32, deadline i64), committed by intent_count --

Entry record (64 bytes)::

    0       8       12      16      20      24      28   30   31   32            64
    +-------+-------+-------+-------+-------+-------+----+----+----+-------------+
    |deadline| prev | next  | gen   | tag   | aux   |grp |st  |kmeta| key (32 B) |
    |  i64   | i32  | i32   | u32   | u32   | i32   |u16 |u8  |u8  |            |
    +-------+-------+-------+-------+-------+-------+----+----+----+-------------+

    deadline   ms on the arena clock (monotonic); for a sentinel: bucket expiration
    prev/next  record indices of the neighbours in the circular list
    gen        generation: bumped each time the entry is allocated; a handle is
               (slot, gen), so a handle kept past its timer's life is harmless
    tag        opaque to the wheel: the client's arming id
    aux        opaque to the wheel; the daemon keeps in it, for a SCHEDULED record, the
               touch reference of an idle timer (>= 0) or -1; for a FIRED record the same
               until it is sent, then ``-2 - client slot``: the client slot it was last
               sent to (:func:`recipient_aux`, :func:`recipient_of`, "Recipients" below)
    grp        group id (index into the group table)
    st         bits 0-3 state (FREE, SCHEDULED, FIRED), bits 4-7 the level whose
               bucket holds the entry (DUE_LEVEL for the due list)
    kmeta      key type and length, see wheeld.protocol.keys
"""

from __future__ import annotations

import struct

import numpy as np

from .clients_layout import MAX_CLIENTS

MAGIC = int.from_bytes(b"WHEELD\x00\x01", "little")
LAYOUT_VERSION = 2  # 2: batch intent after the group table, intent_count

RECORD_BYTES = 64
KEY_BYTES = 32

# ---- header field offsets (bytes) -------------------------------------------
H_MAGIC = 0
H_LAYOUT_VERSION = 8
H_RECORD_BYTES = 12
H_CAPACITY = 16
H_TICK_MS = 20
H_WHEEL_SIZE = 24
H_LEVELS = 28
H_START_MS = 32
H_CURRENT_MS = 40
H_FREE_HEAD = 48
H_MAX_GROUPS = 52
H_CREATED_WALL_MS = 56

H_INTENT_SLOT = 64
H_INTENT_STATE = 68
H_INTENT_DEADLINE = 72
H_INTENT_TAG = 80
H_INTENT_COUNT = 84

H_PARKED = 128
H_WAKE_SEQ = 136
H_JOURNAL_OPEN = 144

H_COUNTERS = 192

HEADER_FIXED = struct.Struct("<QIIIIIIqqiIq")
assert HEADER_FIXED.size == 64, HEADER_FIXED.size

# ---- counters ---------------------------------------------------------------
# One u64 word each, at H_COUNTERS + 8 * index; read by anyone (wheelctl). Each word has
# one writer: the wheel (``TimerWheel.publish_stats``) or the daemon (``Daemon._publish``),
# and neither ever writes the other's words.
WHEEL = "wheel"
DAEMON = "daemon"
MAX_LEVELS = 15  # levels 0..14; the state byte keeps the level in 4 bits
DUE_LEVEL = 15
_COUNTER_TABLE = (
    ("pending", WHEEL),  # scheduled timers now
    ("fired_unacked", WHEEL),  # fired, awaiting acknowledgement by a client
    ("adds_total", WHEEL),  # new timers scheduled
    ("rearms_total", WHEEL),  # schedules of a key already pending
    ("cancels_total", WHEEL),  # cancels that removed a pending timer
    ("cancel_misses_total", WHEEL),  # cancels of a key that was not pending
    ("expirations_total", WHEEL),  # timers that came due
    ("acks_total", WHEEL),  # fired timers acknowledged and freed
    ("cascades_total", WHEEL),  # entries moved down a level
    ("idle_rearms_total", WHEEL),  # idle timers found touched when due and re-armed
    ("delivered_total", DAEMON),  # expirations sent to clients
    ("redelivered_total", DAEMON),  # expirations sent again after a client died
    ("late_total", DAEMON),  # timers fired more than one tick after their deadline
    ("ring_full_total", DAEMON),  # times a client found its ring full (reported by clients)
    ("rejected_total", DAEMON),  # commands refused (bad input, arena full)
    ("arena_full_total", WHEEL),  # adds refused because the arena was full
    ("clients_connected", DAEMON),
    ("clients_total", DAEMON),  # sessions accepted since start
    ("clients_refused_total", DAEMON),
    ("clients_dropped_total", DAEMON),  # disconnected for a protocol violation
    ("groups_active", DAEMON),
    ("ring_depth", DAEMON),  # commands waiting in all rings at the last drain
    ("daemon_pid", DAEMON),
    ("daemon_started_ms", DAEMON),  # arena clock when the daemon started
    ("daemon_heartbeat_ms", DAEMON),  # arena clock of the daemon's last loop iteration
    ("daemon_restarts_total", DAEMON),
    ("undelivered", DAEMON),  # fired timers waiting for a live group member
    ("wakeups_total", DAEMON),  # times the daemon woke from park
    ("loop_iterations_total", DAEMON),
    ("commands_total", DAEMON),  # ring commands applied
    ("journal_lsn", DAEMON),  # the last journal line appended (0 without --journal)
    ("journal_durable_lsn", DAEMON),  # the last journal line known to be on disk
    *((f"pending_level_{level}", WHEEL) for level in range(MAX_LEVELS)),  # pending per level
    ("pending_due", WHEEL),  # pending in the due list (DUE_LEVEL)
    ("ack_timeouts_total", DAEMON),  # expirations sent again because their client left them unacknowledged
    ("arenas_set_aside_total", DAEMON),  # unusable arenas renamed out of the way at start-up
    ("accept_pauses_total", DAEMON),  # times the daemon stopped accepting for lack of descriptors
    # damaged journal ranges recovery skipped (journal/recovery.py, "Damage")
    ("journal_damaged_ranges_total", DAEMON),
    ("journal_damaged_lines_total", DAEMON),  # the lines in them
    ("groups_reclaimed_total", DAEMON),  # group ids freed (no member, nothing pending) for new names
    ("daemon_hot_path", DAEMON),  # which hot path the daemon runs: protocol/accel.py PATH_CODES (0: not published)
    ("journal_stalled", DAEMON),  # the errno that stops the journal being written (ENOSPC 28...); 0: writable
    ("journal_stalls_total", DAEMON),  # times the journal stopped being writable (daemon/recorder.py)
    ("journal_unwritten_events_total", DAEMON),  # events it could not write (the snapshot of a resume covers them)
    ("journal_flushes_refused_total", DAEMON),  # FLUSHes answered with JournalUnavailable
    ("arena_damaged_records_total", DAEMON),  # records found damaged (at attach, or when delivered): daemon/startup.py
    ("arena_timers_lost_total", DAEMON),  # timers of damaged records nothing could restore (no journal to restore from)
    # --replicate (wheeld.fleet): FLEET_STATES code (0: not replicating), and what the stream has not stored yet
    ("fleet_state", DAEMON),
    ("fleet_lag_records", DAEMON),  # journal events not yet stored by the cluster
    ("fleet_lag_ms", DAEMON),  # how long since the stream last stored something, while events wait
)
#: fleet_state's codes (wheeld.fleet.replicator.Replicator.state)
FLEET_STATES = ("off", "connecting", "replicating", "behind", "fenced", "stopped", "failed")
COUNTERS = 64
assert len(_COUNTER_TABLE) <= COUNTERS
#: name of each counter word, by index
COUNTER_NAMES = tuple(name for name, _writer in _COUNTER_TABLE)
COUNTER = {name: index for index, name in enumerate(COUNTER_NAMES)}
#: the words the wheel writes (per-level ones included), and those the daemon writes
WHEEL_COUNTER_NAMES = tuple(name for name, writer in _COUNTER_TABLE if writer == WHEEL)
DAEMON_COUNTER_NAMES = tuple(name for name, writer in _COUNTER_TABLE if writer == DAEMON)
_COUNTER_WORDS = struct.Struct(f"<{COUNTERS}q")
#: the most a counter word (a total, a histogram bucket, the lateness sum) ever holds. The
#: words outlive the daemon (a restart reads its totals back), so a word is clamped to
#: ``0..COUNTER_MAX`` when it is read back (:func:`sane_counter`: a damaged word is repaired,
#: not added to) and additions saturate there (:func:`saturating_add`): no sum of
#: client-chosen values and no damaged word can overflow a 64-bit word. 2**62 leaves a
#: counter counting a billion events a second 146 years of room.
COUNTER_MAX = 1 << 62


def sane_counter(value: int) -> int:
    """A counter word as read back from an arena: clamped to ``0..COUNTER_MAX``."""
    return 0 if value < 0 else min(value, COUNTER_MAX)


def saturating_add(words, index: int, amount: int) -> None:
    """``words[index] += amount`` on a counter word (an int64 view of the header), clamped
    to ``0..COUNTER_MAX``: what the word held before is taken through :func:`sane_counter`."""
    words[index] = sane_counter(sane_counter(words[index]) + amount)


def read_counters(buf) -> dict[str, int]:
    """Every named counter of an arena header (a buffer that starts at the header)."""
    words = _COUNTER_WORDS.unpack_from(buf, H_COUNTERS)
    return {name: words[index] for name, index in COUNTER.items()}


# Fire lateness histogram: bucket i counts lateness in [LATENESS_BOUNDS_US[i-1], LATENESS_BOUNDS_US[i]) us,
# the last bucket everything above. Bounds in microseconds, roughly x2 apart.
LATENESS_BOUNDS_US = (
    50, 100, 250, 500, 1_000, 2_000, 5_000, 10_000, 25_000, 50_000, 100_000,
    250_000, 500_000, 1_000_000, 2_500_000, 5_000_000, 10_000_000, 60_000_000,
)
LATENESS_BUCKETS = len(LATENESS_BOUNDS_US) + 1
H_LATENESS = H_COUNTERS + 8 * COUNTERS
H_LATENESS_SUM_US = H_LATENESS + 8 * LATENESS_BUCKETS
GROUPS_OFFSET = 1024
assert H_LATENESS_SUM_US + 8 <= GROUPS_OFFSET
GROUP_NAME_BYTES = 32  # UTF-8, zero padded, no NUL inside; first byte 0 marks an unused id (see shm.wheel, "Groups")
DEFAULT_MAX_GROUPS = 1024


# Batch intent: the redo record of a batch of re-arms (see shm.wheel, "Crash consistency").
INTENT_BATCH_MAX = 4096
INTENT_ENTRY = struct.Struct("<iIq")  # slot, tag, deadline_ms
assert INTENT_ENTRY.size == 16


def intent_batch_offset(max_groups: int) -> int:
    """Where the batch intent starts: after the group table, 64-byte aligned."""
    return (GROUPS_OFFSET + max_groups * GROUP_NAME_BYTES + 63) // 64 * 64


def header_bytes(max_groups: int) -> int:
    """Header size: fixed part, group table and batch intent, rounded up to a page."""
    raw = intent_batch_offset(max_groups) + INTENT_BATCH_MAX * INTENT_ENTRY.size
    return (raw + 4095) // 4096 * 4096


# ---- record field offsets (bytes within a record) ---------------------------
R_DEADLINE = 0
R_PREV = 8
R_NEXT = 12
R_GEN = 16
R_TAG = 20
R_AUX = 24
R_GROUP = 28
R_STATE = 30
R_KEY_META = 31
R_KEY = 32

RECORD = struct.Struct("<qiiIIiHBB32s")
assert RECORD.size == RECORD_BYTES, RECORD.size

RECORD_DTYPE = np.dtype(
    {
        "names": ["deadline", "prev", "next", "gen", "tag", "aux", "group", "state", "key_meta", "key"],
        "formats": ["<i8", "<i4", "<i4", "<u4", "<u4", "<i4", "<u2", "u1", "u1", "V32"],
        "offsets": [R_DEADLINE, R_PREV, R_NEXT, R_GEN, R_TAG, R_AUX, R_GROUP, R_STATE, R_KEY_META, R_KEY],
        "itemsize": RECORD_BYTES,
    }
)
assert RECORD_DTYPE.itemsize == RECORD_BYTES

INTENT_DTYPE = np.dtype({"names": ["slot", "tag", "deadline"], "formats": ["<i4", "<u4", "<i8"],
                         "offsets": [0, 4, 8], "itemsize": INTENT_ENTRY.size})
assert INTENT_DTYPE.itemsize == INTENT_ENTRY.size

# Word indices inside a record, for memoryview casts of the whole arena.
Q_DEADLINE = R_DEADLINE // 8  # in int64 words
I_PREV = R_PREV // 4  # in int32 words
I_NEXT = R_NEXT // 4
I_GEN = R_GEN // 4
I_TAG = R_TAG // 4
I_AUX = R_AUX // 4
H_GROUP_WORD = R_GROUP // 2  # in uint16 words
Q_PER_RECORD = RECORD_BYTES // 8
I_PER_RECORD = RECORD_BYTES // 4
H_PER_RECORD = RECORD_BYTES // 2

# ---- record states (low 4 bits of the state byte) ---------------------------
FREE = 0
SCHEDULED = 1
FIRED = 2
STATE_NAMES = {FREE: "free", SCHEDULED: "scheduled", FIRED: "fired"}
STATE_MASK = 0x0F
LEVEL_SHIFT = 4

# ---- recipients (the aux word of a FIRED record) ------------------------------
# The daemon stores in a fired record's aux, before it sends the expiration, the client slot
# it sends it to (daemon/delivery.py), so that a daemon restarted on the arena offers the
# record to that client first: its library knows whether it handed the expiration already.
# Nothing else writes an aux value below -1 (a touch reference is >= 0, a plain timer's aux
# is -1): a fired record whose aux is -1 or more has no recipient known, and goes to its
# group. Any arena of this layout version is read so, whoever wrote it.
RECIPIENT_AUX_BASE = -2


def recipient_aux(client_slot: int) -> int:
    """The aux word of a fired record sent to ``client_slot`` (0 .. clients_layout.MAX_CLIENTS - 1)."""
    return RECIPIENT_AUX_BASE - client_slot


def recipient_of(aux: int) -> int | None:
    """The client slot a fired record's aux word names as its recipient, or None (-1, or a
    touch reference: it was not sent)."""
    return RECIPIENT_AUX_BASE - aux if aux <= RECIPIENT_AUX_BASE else None


# ---- the journal_open word ------------------------------------------------------
# 0 while the records and the journal agree. A batch the daemon applies to the records ahead
# of its journal sets it until the batch is appended (daemon/recorder.py): to JOURNAL_OPEN for
# one of the daemon's own (fires, idle re-arms, a slot's release), to JOURNAL_OPEN_RING + the
# client slot for a chunk of that client's ring. A daemon that attaches the arena after a crash
# inside a chunk thus knows whose acknowledgements it may have applied and not journaled
# (daemon/reconcile.py). Any value but 0 means a batch was open, whoever wrote it.
JOURNAL_OPEN = 1
JOURNAL_OPEN_RING = 2


def journal_open_word(client_slot: int | None) -> int:
    """The journal_open word of a batch that applies ``client_slot``'s ring chunk (None: the daemon's own)."""
    return JOURNAL_OPEN if client_slot is None else JOURNAL_OPEN_RING + client_slot


def journal_open_ring(word: int) -> int | None:
    """The client slot whose ring chunk an open batch applied, or None (no batch open, one of
    the daemon's own, or a word no daemon writes)."""
    slot = word - JOURNAL_OPEN_RING
    return slot if 0 <= slot < MAX_CLIENTS else None


def sentinel_count(levels: int, wheel_size: int) -> int:
    """Bucket sentinels of every level, plus the due list and the fired list."""
    return levels * wheel_size + 2


def segment_bytes(capacity: int, levels: int, wheel_size: int, max_groups: int) -> int:
    return header_bytes(max_groups) + (sentinel_count(levels, wheel_size) + capacity) * RECORD_BYTES
