"""Layout of the daemon's status page: what every client may read, nothing more.

One 4096-byte page that the daemon writes and hands to each client read-only at
the handshake (a sealed memfd re-opened ``O_RDONLY``, see :mod:`wheeld.shm.memfd`).
It replaces reading the arena: a client needs to know whether the daemon is
parked (the doorbell's eventcount) and whether the arena is full (so ``add``
can refuse at once), and must not be able to read other groups' keys::

      0                               8               12                              64
      +-------------------------------+---------------+-------------------------------+
      | magic u64 "WHLDSTAT"          | layout ver u32| zero                          |  line 0: written once
      +-------------------------------+---------------+-------------------------------+
     64                               72                                            128
      | parked u64: park epoch, 0 awake| quiet_from u64: ns, 0 unknown | zero          |  line 1: every park
      +-------------------------------+-------------------------------+---------------+
    128              136              144             152                           192
      | capacity u64 | pending u64    | fired_unacked u64 | zero                      |  line 2: at publish
      +--------------+----------------+-------------------+---------------------------+

``parked`` has its own cache line: the daemon stores it on every park, and the
clients load it after every push. A client reads ``pending + fired_unacked >=
capacity`` to refuse an ``add`` with ArenaFull before it reaches the daemon
(the daemon refuses it anyway; the page only saves the round trip).

``quiet_from`` (CLOCK_MONOTONIC ns) is when the current park ends, less the
daemon's ``--coalesce-us``: a doorbell nobody waits on, rung at or after it,
changes nothing (the daemon wakes within the window anyway), so a client that
sees a new park epoch and a clock at or past ``quiet_from`` rings nothing. The
daemon zeroes it before it stores a new epoch and sets it once it knows the
park's end (a park made shorter sets it again): a client that reads the new epoch
reads 0 (ring) or that park's value, never an older park's. A daemon that does
not write it leaves 0: the clients ring as before.
"""

from __future__ import annotations

import struct

MAGIC = int.from_bytes(b"WHLDSTAT", "little")
LAYOUT_VERSION = 1
PAGE_BYTES = 4096
WORD = 8

HEADER = struct.Struct("<QI")
MAGIC_OFFSET = 0
PARKED_OFFSET = 64
QUIET_FROM_OFFSET = 72
CAPACITY_OFFSET = 128
PENDING_OFFSET = 136
FIRED_UNACKED_OFFSET = 144

# indices in a memoryview of the page cast to 8-byte words
PARKED_WORD = PARKED_OFFSET // WORD
QUIET_FROM_WORD = QUIET_FROM_OFFSET // WORD
CAPACITY_WORD = CAPACITY_OFFSET // WORD
PENDING_WORD = PENDING_OFFSET // WORD
FIRED_UNACKED_WORD = FIRED_UNACKED_OFFSET // WORD

assert HEADER.size <= PARKED_OFFSET and PARKED_OFFSET % 64 == 0 and CAPACITY_OFFSET % 64 == 0
assert FIRED_UNACKED_OFFSET + WORD <= PAGE_BYTES
