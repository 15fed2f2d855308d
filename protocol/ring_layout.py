"""Layout of a per-client segment: header, command ring, touch table. Declared once.

The daemon creates one sealed memfd per client session and passes it to that
client over its socket (see :mod:`wheeld.shm.ring` for the code and the
memory-ordering argument, :mod:`wheeld.shm.memfd` for the sealing). Every
offset of that segment is a named constant here, in the style of Agrona's
``RingBufferDescriptor``; no other module writes one as a number.

::

      0                               8               12              16              20              24
      +-------------------------------+---------------+---------------+---------------+---------------+
      | magic u64 "WHLDRING"          | layout ver u32| ring cap u32  | touch cap u32 | record size   |
      +-------------------------------+---------------+---------------+---------------+---------------+
     24 .. 63  zero                                           line 0: written once, by create()
     64                               72              80
      +-------------------------------+-------------------------------+
      | producer tail u64             | producer_pid i64              |  line 1: written only by the
      +-------------------------------+-------------------------------+  producer (the client)
     80 .. 127 zero
    128                              136                             144                             152
      +-------------------------------+-------------------------------+-------------------------------+
      | consumer head u64             | closed u64 (0 open, 1 closed) | group_full u64 (1: the group  |  line 2: written only
      +-------------------------------+-------------------------------+ reached its quota)            |  by the consumer
    152 .. 191 zero                                                   +-------------------------------+  (the daemon)
    192 = RING_OFFSET
      +-----------------------------------------------------------------------------------------------+
      | ring_capacity command records of 64 bytes (wheeld.protocol.commands), slot = sequence & mask  |
      +-----------------------------------------------------------------------------------------------+
    touch_offset(ring_capacity)
      | last_touch_ms i64 [touch_capacity]  monotonic ms of the key's last touch, written by the client|
      +-----------------------------------------------------------------------------------------------+
    idle_offset(ring_capacity, touch_capacity)
      | idle_ms i64 [touch_capacity]        the key's idle timeout, written by the client at add_idle |
      +-----------------------------------------------------------------------------------------------+

``tail`` and ``head`` are free-running 64-bit record counters (they never wrap in
practice: 2**64 records at 10M/s is 58,000 years); the slot of record ``n`` is
``n & (ring_capacity - 1)``. The ring is empty when ``head == tail`` and full when
``tail - head == ring_capacity``. Each hot word has its own 64-byte cache line so
that the producer's tail stores and the consumer's head stores never share a line
(no false sharing), and each line has exactly one writer.

The touch table is two arrays rather than interleaved pairs so that a touch is
one aligned 8-byte store into a memoryview that is exactly the table (a bad index
fails on the view's own bounds check).
"""

from __future__ import annotations

import struct

from .commands import RECORD_SIZE
from .errors import InvalidRequest

CACHE_LINE = 64
WORD = 8

MAGIC = int.from_bytes(b"WHLDRING", "little")
LAYOUT_VERSION = 2  # 2: a sealed memfd passed over the socket; group_full

# line 0: the static header (written once by the creator, validated by attach)
MAGIC_OFFSET = 0
LAYOUT_VERSION_OFFSET = 8
RING_CAPACITY_OFFSET = 12
TOUCH_CAPACITY_OFFSET = 16
RECORD_SIZE_OFFSET = 20
STATIC_HEADER = struct.Struct("<QIIII")

# line 1: producer-owned
PRODUCER_LINE_OFFSET = 1 * CACHE_LINE
TAIL_OFFSET = PRODUCER_LINE_OFFSET
PRODUCER_PID_OFFSET = PRODUCER_LINE_OFFSET + WORD

# line 2: consumer-owned
CONSUMER_LINE_OFFSET = 2 * CACHE_LINE
HEAD_OFFSET = CONSUMER_LINE_OFFSET
CLOSED_OFFSET = CONSUMER_LINE_OFFSET + WORD
GROUP_FULL_OFFSET = CONSUMER_LINE_OFFSET + 2 * WORD

HEADER_SIZE = 3 * CACHE_LINE
RING_OFFSET = HEADER_SIZE

# index of each hot word in a memoryview of the segment cast to 8-byte words ('Q'/'q')
TAIL_WORD = TAIL_OFFSET // WORD
PRODUCER_PID_WORD = PRODUCER_PID_OFFSET // WORD
HEAD_WORD = HEAD_OFFSET // WORD
CLOSED_WORD = CLOSED_OFFSET // WORD
GROUP_FULL_WORD = GROUP_FULL_OFFSET // WORD

TOUCH_ENTRY_SIZE = 8  # one i64 per touch index in each of the two touch arrays

MIN_RING_CAPACITY = 2
MAX_RING_CAPACITY = 1 << 22
MAX_TOUCH_CAPACITY = 1 << 24

assert STATIC_HEADER.size == RECORD_SIZE_OFFSET + 4 <= PRODUCER_LINE_OFFSET
assert struct.calcsize("<QQQ") <= CACHE_LINE  # tail + pid, head + closed + group_full each fit their line
assert TAIL_OFFSET % CACHE_LINE == 0 and HEAD_OFFSET % CACHE_LINE == 0
assert TAIL_OFFSET % WORD == 0 and HEAD_OFFSET % WORD == 0 and CLOSED_OFFSET % WORD == 0
assert RING_OFFSET % CACHE_LINE == 0 and RECORD_SIZE == CACHE_LINE


def ring_bytes(ring_capacity: int) -> int:
    return ring_capacity * RECORD_SIZE


def touch_offset(ring_capacity: int) -> int:
    """Offset of the ``last_touch_ms`` array."""
    return RING_OFFSET + ring_bytes(ring_capacity)


def idle_offset(ring_capacity: int, touch_capacity: int) -> int:
    """Offset of the ``idle_ms`` array."""
    return touch_offset(ring_capacity) + touch_capacity * TOUCH_ENTRY_SIZE


def segment_size(ring_capacity: int, touch_capacity: int) -> int:
    return idle_offset(ring_capacity, touch_capacity) + touch_capacity * TOUCH_ENTRY_SIZE


def check_capacities(ring_capacity: int, touch_capacity: int) -> None:
    """Raise InvalidRequest unless the capacities describe a valid segment."""
    if type(ring_capacity) is not int or not MIN_RING_CAPACITY <= ring_capacity <= MAX_RING_CAPACITY:
        raise InvalidRequest(f"ring_capacity must be an int in [{MIN_RING_CAPACITY}, {MAX_RING_CAPACITY}]")
    if ring_capacity & (ring_capacity - 1):
        raise InvalidRequest(f"ring_capacity must be a power of two, not {ring_capacity}")
    if type(touch_capacity) is not int or not 0 <= touch_capacity <= MAX_TOUCH_CAPACITY:
        raise InvalidRequest(f"touch_capacity must be an int in [0, {MAX_TOUCH_CAPACITY}]")
