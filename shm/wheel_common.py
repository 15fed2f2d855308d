"""What the rooms of :class:`wheeld.shm.wheel.TimerWheel` share: its bounds, defaults and
counter table.

The wheel is one class assembled from rooms (see the module docstring of
:mod:`wheeld.shm.wheel`, where a reader starts): the records, links and scalar
operations (``wheel.py``), the group table (``wheel_groups.py``), making, attaching
and checking an arena (``wheel_attach.py``) and the numpy batch operations
(``wheel_batch.py``). The numbers they all use are defined here, once; the record
layout itself is :mod:`wheeld.protocol.arena_layout`'s.
"""

from __future__ import annotations

import numpy as np

from wheeld.protocol import arena_layout as L
from wheeld.protocol.errors import InvalidDelay
from wheeld.protocol.keys import TYPE_STR, VALID_KEY_METAS, key_type

__all__ = [
    "COUNTER_INDEX", "C_ACKS", "C_ADDS", "C_ARENA_FULL", "C_CANCELS", "C_CANCEL_MISSES", "C_CASCADES", "C_EXPIRATIONS",
    "C_FIRED_UNACKED", "C_IDLE_REARMS", "C_PENDING", "C_REARMS", "DEADLINE_HIGH", "DEADLINE_LOW",
    "DEFAULT_LEVELS_RANGE_MS", "DEFAULT_WHEEL_SIZE", "GENERATION_MASK", "LEVEL_SLOTS", "MAX_CLOCK_MS", "MAX_DELAY_MS",
    "OWN_COUNTERS", "STR_META", "TOTALS", "VALID_META", "check_clock", "default_levels",
]

DEFAULT_WHEEL_SIZE = 256
DEFAULT_LEVELS_RANGE_MS = 1 << 40  # levels are added until they cover ~34.8 years
MAX_DELAY_MS = 1 << 46  # sanity bound on deadlines (~2230 years past the clock)
MAX_CLOCK_MS = 1 << 62  # bound on the clock a caller may move the wheel to (either sign)
#: generations wrap within 31 bits: they travel as signed 32-bit fields (the ACK
#: record's aux1, an Expiry's generation), and the free list reuses the hottest
#: slot first, so one slot can be re-allocated 2**31 times in hours at full rate
GENERATION_MASK = 0x7FFFFFFF
#: the deadlines a sound record can hold: within MAX_DELAY_MS of a clock the wheel accepts
DEADLINE_HIGH = MAX_CLOCK_MS + MAX_DELAY_MS
DEADLINE_LOW = -DEADLINE_HIGH

LEVEL_SLOTS = L.DUE_LEVEL + 1  # per-level counters: levels 0..14 and the due list
#: meta bytes a record's key may carry, and those of string keys (checked for UTF-8)
VALID_META = np.array(VALID_KEY_METAS, dtype=bool)
STR_META = np.array([key_type(meta) == TYPE_STR for meta in range(256)], dtype=bool)

#: the wheel's own counter words (the daemon writes the rest): the per-level ones are
#: computed from the per-level counts, the others kept in TimerWheel._count (by index)
LEVEL_COUNTERS = tuple(f"pending_level_{level}" for level in range(L.MAX_LEVELS)) + ("pending_due",)
OWN_COUNTERS = tuple(name for name in L.WHEEL_COUNTER_NAMES if name not in LEVEL_COUNTERS)
TOTALS = tuple(name for name in OWN_COUNTERS if name.endswith("_total"))  # survive restarts
COUNTER_INDEX = {name: index for index, name in enumerate(OWN_COUNTERS)}
#: the index of each of the wheel's own counters (TimerWheel._count[C_PENDING] ...)
C_PENDING = COUNTER_INDEX["pending"]
C_FIRED_UNACKED = COUNTER_INDEX["fired_unacked"]
C_ADDS = COUNTER_INDEX["adds_total"]
C_REARMS = COUNTER_INDEX["rearms_total"]
C_CANCELS = COUNTER_INDEX["cancels_total"]
C_CANCEL_MISSES = COUNTER_INDEX["cancel_misses_total"]
C_EXPIRATIONS = COUNTER_INDEX["expirations_total"]
C_CASCADES = COUNTER_INDEX["cascades_total"]
C_ACKS = COUNTER_INDEX["acks_total"]
C_IDLE_REARMS = COUNTER_INDEX["idle_rearms_total"]
C_ARENA_FULL = COUNTER_INDEX["arena_full_total"]


def default_levels(tick_ms: int, wheel_size: int) -> int:
    """Levels enough to cover DEFAULT_LEVELS_RANGE_MS (at most L.MAX_LEVELS)."""
    levels, span = 1, tick_ms * wheel_size
    while span < DEFAULT_LEVELS_RANGE_MS and levels < L.MAX_LEVELS:
        levels += 1
        span *= wheel_size
    return levels


def check_clock(now_ms) -> None:
    """A clock a caller moves the wheel to: an int within +-MAX_CLOCK_MS, or InvalidDelay."""
    if type(now_ms) is not int:
        raise InvalidDelay(f"now_ms is an integer number of ms, not {type(now_ms).__name__}")
    if not -MAX_CLOCK_MS <= now_ms < MAX_CLOCK_MS:
        raise InvalidDelay(f"now_ms {now_ms} is beyond +-{MAX_CLOCK_MS}")
