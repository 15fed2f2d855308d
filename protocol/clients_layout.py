"""Layout of the daemon's client table: which client segments exist, by client slot.

A small shared-memory segment ``/wheeld-<name>-clients`` written only by the
daemon. A restarted daemon reads it to re-open the segments of the clients it
had: their rings may hold commands pushed while it was down, and their touch
tables decide whether an idle timer that comes due was touched meanwhile. The
slot is also the high bits of an idle timer's touch reference (``aux``)::

    aux = slot << TOUCH_INDEX_BITS | touch_index

Table: MAX_CLIENTS entries of ENTRY_BYTES each::

    0        2        4        8           16                                 128
    +--------+--------+----------------+------------------------------------+
    | in_use | group  | pid    | token u64 | segment name, UTF-8, zero padded |
    | u16    | u16    | i32    |           | (112 bytes)                      |
    +--------+--------+----------------+------------------------------------+

``token`` is a random secret the daemon gives the client at the handshake; a
client that reconnects after a daemon restart presents it to resume its segment.
"""

from __future__ import annotations

import struct

MAGIC = int.from_bytes(b"WHLCLNT1", "little")
HEADER_BYTES = 64
ENTRY = struct.Struct("<HHiQ112s")
ENTRY_BYTES = ENTRY.size
assert ENTRY_BYTES == 128
MAX_CLIENTS = 2047
TOUCH_INDEX_BITS = 20
TOUCH_INDEX_MASK = (1 << TOUCH_INDEX_BITS) - 1
SEGMENT_BYTES = HEADER_BYTES + MAX_CLIENTS * ENTRY_BYTES
assert (MAX_CLIENTS << TOUCH_INDEX_BITS | TOUCH_INDEX_MASK) < 1 << 31  # fits the record's i32 aux


def entry_offset(slot: int) -> int:
    return HEADER_BYTES + slot * ENTRY_BYTES
