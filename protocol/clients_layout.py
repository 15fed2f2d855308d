"""Layout of the daemon's client table: which client slots exist, and who owns which group.

A small shared-memory segment ``/wheeld-<name>-clients`` that only the daemon
writes (mode 0600, or 0640 to the monitoring group like the arena: ``wheelctl``
lists clients from it). It outlives a daemon crash, so a restarted daemon knows:

* which client slots were in use, with their group and uid: a client that
  reconnects hands its ring back (a memfd) and, presenting its resume token (an
  HMAC of the slot and ring label under a secret kept in the daemon-only lock
  file, so the token itself is stored nowhere), gets its slot again. The slot is
  also the high bits of an idle timer's touch reference (``aux``) and of the
  client's arming tags::

      aux = slot << TOUCH_INDEX_BITS | touch_index

* which uid owns each group id (the first uid that joined it, unless the operator
  named an owner with ``--group-owner``), so a restart does not hand a group to
  whoever connects first.

The table belongs to one arena: the header keeps that arena's creation wall-clock
ms, and a table that does not match the arena attached is reset.

Header (64 bytes)::

    0 magic u64 "WHLCLNT2"   8 arena_created_wall_ms i64   16 .. 63 zero

Client table: MAX_CLIENTS entries of ENTRY_BYTES each::

    0        2        4        8        12       16       20       24                       128
    +--------+--------+--------+--------+--------+--------+--------+------------------------+
    | in_use | group  | pid    | uid u32| depth  | ring   | zero   | ring label, UTF-8, zero |
    | u16    | u16    | i32    |        | u32    | cap u32| u32    | padded (104 bytes)      |
    +--------+--------+--------+--------+--------+--------+--------+------------------------+

``depth`` is the ring's depth at the daemon's last look (for ``wheelctl``).

Group owner table: OWNER_ENTRIES entries (one per possible group id) of 8 bytes::

    0             4             8
    +-------------+-------------+
    | kind u32    | id u32      |   kind: 0 no owner yet, 1 a uid, 2 a gid (members of a group)
    +-------------+-------------+
"""

from __future__ import annotations

import struct

MAGIC = int.from_bytes(b"WHLCLNT2", "little")
HEADER = struct.Struct("<Qq")
HEADER_BYTES = 64
ENTRY = struct.Struct("<HHiIII4x104s")
ENTRY_BYTES = ENTRY.size
assert ENTRY_BYTES == 128
DEPTH = struct.Struct("<I")
DEPTH_OFFSET = 12  # within an entry: updated alone, about once a second
MAX_CLIENTS = 2047
TOUCH_INDEX_BITS = 20
TOUCH_INDEX_MASK = (1 << TOUCH_INDEX_BITS) - 1
assert (MAX_CLIENTS << TOUCH_INDEX_BITS | TOUCH_INDEX_MASK) < 1 << 31  # fits the record's i32 aux

OWNER = struct.Struct("<II")
OWNER_NONE, OWNER_UID, OWNER_GID = 0, 1, 2
OWNER_ENTRIES = 1 << 16  # group ids are u16
OWNERS_OFFSET = HEADER_BYTES + MAX_CLIENTS * ENTRY_BYTES
SEGMENT_BYTES = OWNERS_OFFSET + OWNER_ENTRIES * OWNER.size


def entry_offset(slot: int) -> int:
    return HEADER_BYTES + slot * ENTRY_BYTES


def owner_offset(group_id: int) -> int:
    return OWNERS_OFFSET + group_id * OWNER.size
