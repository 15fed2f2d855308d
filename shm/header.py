"""The arena header's fixed part, read and validated: one reader for the wheel, wheelctl and fsck."""

from __future__ import annotations

from wheeld.protocol import arena_layout as L
from wheeld.protocol.errors import CorruptArena

__all__ = ["parse_header"]


def parse_header(buf, size: int | None, label: str = "arena") -> dict:
    """The parameters of the arena in ``buf``, validated; raises CorruptArena naming ``label``.

    ``size`` is the segment's size (None: a copy of the header page alone, whose size
    is not checked against the parameters). Keys: capacity, tick_ms, wheel_size,
    levels, start_ms, current_ms, max_groups, created_wall_ms, header_bytes, bytes
    (the size the parameters describe).
    """
    if len(buf) < L.GROUPS_OFFSET or (size is not None and size < L.GROUPS_OFFSET):
        raise CorruptArena(f"{label} is {size} bytes, too small for a wheeld arena header")
    (magic, version, record_bytes, capacity, tick_ms, wheel_size, levels, start_ms, cur, _free_head, max_groups,
     created_wall_ms) = L.HEADER_FIXED.unpack_from(buf, 0)
    if magic != L.MAGIC:
        raise CorruptArena(f"{label} is not a wheeld arena (bad magic)")
    if version != L.LAYOUT_VERSION:
        raise CorruptArena(f"{label} has arena layout version {version}; this wheeld reads {L.LAYOUT_VERSION}")
    if record_bytes != L.RECORD_BYTES or not 1 <= levels <= L.MAX_LEVELS or wheel_size < 2 or tick_ms < 1 \
            or not 1 <= max_groups <= 65535:
        raise CorruptArena(f"{label}: header parameters are inconsistent")
    expected = L.segment_bytes(capacity, levels, wheel_size, max_groups)
    if size is not None and size < expected:
        raise CorruptArena(f"{label} is {size} bytes, its header describes {expected}")
    return {"capacity": capacity, "tick_ms": tick_ms, "wheel_size": wheel_size, "levels": levels,
            "start_ms": start_ms, "current_ms": cur, "max_groups": max_groups,
            "created_wall_ms": created_wall_ms, "header_bytes": L.header_bytes(max_groups), "bytes": expected}
