"""The group table of a :class:`~wheeld.shm.wheel.TimerWheel`'s arena: names by id, and
the live count of each group (the rules are in the "Groups" section of
:mod:`wheeld.shm.wheel`'s docstring).

Every record carries a group id (u16); the arena's table holds ``max_groups`` names of
at most 31 UTF-8 bytes, zero padded to 32, and a name commits with the one-byte store of
its first byte. The live counts are derived state of the owning process, kept by the
wheel's operations and recounted on attach (:mod:`wheeld.shm.wheel_attach`).
"""

from __future__ import annotations

import numpy as np

from wheeld.protocol import arena_layout as L
from wheeld.protocol.errors import GroupLimit, InvalidRequest

__all__ = ["GroupTable"]

_GNB = L.GROUP_NAME_BYTES


class GroupTable:
    """The group-table room of :class:`~wheeld.shm.wheel.TimerWheel` (a mixin: it works on
    the wheel's ``_group_names``/``_group_bytes`` views of the table, ``_group_live`` counts
    and ``max_groups``)."""

    def _name_bytes(self, group_name: str) -> bytes:
        """A group name as stored in the table: UTF-8, zero padded to GROUP_NAME_BYTES."""
        raw = group_name.encode("utf-8") if isinstance(group_name, str) else None
        if not raw or len(raw) > _GNB - 1 or b"\0" in raw:
            raise InvalidRequest(f"a group name is 1..{_GNB - 1} UTF-8 bytes, without NUL")
        return raw + b"\0" * (_GNB - len(raw))

    def _check_gid(self, gid: int) -> int:
        if not isinstance(gid, (int, np.integer)) or isinstance(gid, bool) or not 0 <= gid < self.max_groups:
            raise InvalidRequest(f"group id {gid!r} out of range 0..{self.max_groups - 1}")
        return int(gid)

    def group_id(self, group_name: str, create: bool = True) -> int:
        """The id of a group name, registering it in the arena's group table if new.

        A new name takes the lowest id that is free: no name registered and no
        live (scheduled or fired) record carrying it. Raises InvalidRequest for a
        name that is not 1..31 UTF-8 bytes without NUL, KeyError for an unknown
        name with ``create=False``, and GroupLimit when every id is in use.

        Registering writes bytes 1..31 of the entry first and the first byte last:
        that store is the commit point (an entry whose first byte is 0 is unused,
        whatever follows it), so a writer killed in between leaves an unused id.
        """
        padded = self._name_bytes(group_name)
        hit = np.flatnonzero(self._group_names == np.void(padded))
        if hit.size:
            return int(hit[0])
        if not create:
            raise KeyError(group_name)
        table = self._group_bytes
        free = np.flatnonzero((table[:, 0] == 0) & (self.group_counts() == 0))
        if not free.size:
            raise GroupLimit(f"all {self.max_groups} group ids are in use: groups with no member and nothing "
                             "pending are reclaimed; raise --max-groups or use fewer group names")
        gid = int(free[0])
        row = table[gid]
        row[1:] = np.frombuffer(padded, dtype=np.uint8, offset=1)
        row[0] = padded[0]  # commit point: the name exists from here on
        return gid

    def group_name(self, gid: int) -> str:
        """The name registered under ``gid``; "" for an unused id (or one outside the table)."""
        if not 0 <= gid < self.max_groups:
            return ""
        off = L.GROUPS_OFFSET + gid * _GNB
        raw = self._seg.buf[off : off + _GNB]
        if not raw[0]:
            return ""
        return raw.rstrip(b"\0").decode("utf-8", "replace")

    def groups(self) -> dict[int, str]:
        """Every registered group: id -> name."""
        return {gid: self.group_name(gid) for gid in np.flatnonzero(self._group_bytes[:, 0]).tolist()}

    def group_live(self, gid: int) -> int:
        """Records of group ``gid`` that are SCHEDULED or FIRED (fired, not released yet). O(1)."""
        return self._group_live[self._check_gid(gid)]

    def group_counts(self) -> np.ndarray:
        """:meth:`group_live` of every group id at once: a copy, int64, ``max_groups`` long."""
        return np.array(self._group_live, dtype=np.int64)

    def forget_group(self, gid: int) -> bool:
        """Free the id of a group that has no live record; its name may be registered again.

        Returns False, and changes nothing, if the group still has a scheduled or
        fired record, if the id is unused, or for id 0 (the arena's ``default``
        group, registered when it was created, is never forgotten). The id then
        goes to the next new name :meth:`group_id` registers (the lowest free id
        first). Whoever caches names by id (the journal recorder) must drop its
        entry for ``gid``.

        Crash consistency: the name's first byte is cleared first, one byte store
        and the commit point (the id is unused from then on), then the rest; a
        writer killed in between leaves an unused id whose leftover bytes no name
        matches (a stored name is compared whole, first byte included), and
        ``attach`` clears them.
        """
        gid = self._check_gid(gid)
        row = self._group_bytes[gid]
        if gid == 0 or not row[0] or self._group_live[gid]:
            return False
        row[0] = 0  # commit point: the id is unused from here on
        row[1:] = 0
        return True

    def forget_idle_groups(self, keep=()) -> list[int]:
        """:meth:`forget_group` for every registered group with no live record, except
        id 0 and the ids in ``keep`` (groups that still have members); returns the ids freed."""
        idle = (self._group_bytes[:, 0] != 0) & (self.group_counts() == 0)
        idle[0] = False
        freed = []
        keep = {int(g) for g in keep}
        for gid in np.flatnonzero(idle).tolist():
            if gid not in keep and self.forget_group(gid):
                freed.append(gid)
        return freed

    def _count_groups(self, groups: np.ndarray, sign: int) -> None:
        """Add ``sign`` to the live count of each item's group (a batch's records)."""
        n = groups.size
        if not n:
            return
        live = self._group_live
        first = int(groups[0])
        if n == 1 or not (groups != first).any():  # one group: the usual batch (one client's ring)
            live[first] += sign * n
            return
        counts = np.bincount(groups)
        present = np.flatnonzero(counts)
        for gid, count in zip(present.tolist(), counts[present].tolist()):
            live[gid] += sign * count
