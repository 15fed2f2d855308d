"""A daemon's arena, read straight from shared memory (never through the daemon).

``wheelctl`` maps the arena **read-only** (:class:`ArenaReader`) and copies what it
needs; it never sends the daemon a request. That is why it still answers when
the daemon is stuck, stopped (SIGSTOP) or dead, and why it cannot make a sick
daemon sicker. What it makes of the header is a :class:`~wheeld.shm.snapshot.Snapshot`;
the records give ``wheelctl dump`` its :class:`Timer` rows and ``wheelctl groups``
its counts per group; ``wheelctl check`` checks private copies (:mod:`wheeld.shm.check`).

The header is copied in one read: every counter word has one writer (the wheel
or the daemon, see :data:`wheeld.protocol.arena_layout.COUNTER_NAMES`) that only
ever stores whole values into it, so no word of a copy is torn and no word is
ever seen reset; figures of one copy may come from neighbouring iterations.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass

import numpy as np
import posix_ipc

from wheeld.protocol import arena_layout as L
from wheeld.protocol import clients_layout as CL
from wheeld.protocol.errors import BrokenPeer, WheeldError
from wheeld.protocol.keys import decode_key
from wheeld.shm.instance_lock import reader_segments
from wheeld.protocol.naming import shm_path

from .arena import Segment
from .header import parse_header
from .snapshot import DEFAULT_STALE_AFTER_S, RingStat, Snapshot, build_snapshot, pid_alive
from .wheel import encode_ident

__all__ = ["NoArena", "ArenaReader", "Timer", "key_json", "key_type_name", "map_readonly"]


class NoArena(BrokenPeer):
    """No arena of that name (no daemon ever ran with that --name, or it was removed), or we may not read it."""


def key_type_name(key) -> str:
    return "int" if type(key) is int else "bytes" if type(key) is bytes else "str"


def key_json(key) -> str | int:
    """A key as JSON: str and int as themselves, bytes as hex (see ``key_type``)."""
    return key.hex() if type(key) is bytes else key


# ---------------------------------------------------------------------------- reading the arena
@dataclass(frozen=True)
class Timer:
    """A timer record as ``wheelctl dump`` shows it."""

    slot: int
    key: object
    group: str
    deadline_ms: int
    state: str  # "scheduled" or "fired"
    generation: int

    def to_dict(self, now_ms: int) -> dict:
        return {"key": key_json(self.key), "key_type": key_type_name(self.key), "group": self.group,
                "deadline_ms": self.deadline_ms, "due_in_ms": self.deadline_ms - now_ms, "state": self.state,
                "slot": self.slot}


def may_not_read(segment_name: str) -> str:
    """Why this process may not read a segment, and what would let it: the group to join
    when the segment is readable by its group, else who may read it."""
    import grp
    import pwd

    path = shm_path(segment_name)
    try:
        st = os.stat(path)
    except OSError:
        return f"may not read the wheeld arena {segment_name}: run wheelctl as the daemon's user or root"
    try:
        owner = repr(pwd.getpwuid(st.st_uid).pw_name)
    except KeyError:
        owner = f"uid {st.st_uid}"
    if st.st_mode & 0o040:
        try:
            group = grp.getgrgid(st.st_gid).gr_name
        except KeyError:
            group = str(st.st_gid)
        return (f"may not read the wheeld arena {segment_name}: join the group {group!r} that may read it "
                f"(usermod -aG {group} USER, then log in again), or run wheelctl as its owner {owner} or root")
    return (f"may not read the wheeld arena {segment_name}: only its owner {owner} and root may (the daemon "
            f"runs without --monitor-group): run wheelctl as {owner} or root")


class ArenaReader:
    """The arena of daemon instance ``name``, mapped read-only. Close it (or use ``with``)."""

    def __init__(self, name: str):
        self.name = name
        self.segment_name, self.clients_segment = reader_segments(name)
        try:
            self._seg = Segment.attach(self.segment_name, readonly=True)
        except FileNotFoundError:
            raise NoArena(f"no wheeld arena named {name!r} ({self.segment_name}): "
                          f"is wheeld running with --name {name}?") from None
        except (PermissionError, posix_ipc.PermissionsError):
            raise NoArena(may_not_read(self.segment_name)) from None
        try:
            self.info = parse_header(self._seg.buf, self._seg.size, self.segment_name)
        except BaseException:
            self._seg.close()
            raise
        self.levels = self.info["levels"]
        self.wheel_size = self.info["wheel_size"]
        self.first_entry = self.levels * self.wheel_size + 2
        self.n_records = self.first_entry + self.info["capacity"]
        self._records = None

    def close(self) -> None:
        self._records = None
        self._seg.close()

    def __enter__(self) -> "ArenaReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def buf(self):
        return self._seg.buf

    @property
    def records(self) -> np.ndarray:
        if self._records is None:
            self._records = np.frombuffer(self._seg.buf, dtype=L.RECORD_DTYPE, count=self.n_records,
                                          offset=self.info["header_bytes"])
        return self._records

    # ---- header figures
    def header(self) -> bytes:
        """A copy of the header page (one read: see the module docstring)."""
        return bytes(self._seg.buf[: L.GROUPS_OFFSET])

    def counters(self, header: bytes | None = None) -> dict[str, int]:
        return L.read_counters(header or self.header())

    def groups(self) -> dict[int, str]:
        """Registered groups, id -> name (an entry whose first byte is 0 is an unused id)."""
        return _group_table(self._seg.buf, self.info["max_groups"])

    def group_id(self, group: str) -> int | None:
        for gid, name in self.groups().items():
            if name == group:
                return gid
        return None

    # ---- records
    def _live(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(slots, state low bits, group) of scheduled and fired entry records."""
        rec = self.records[self.first_entry :]
        states = rec["state"] & L.STATE_MASK
        live = np.flatnonzero((states == L.SCHEDULED) | (states == L.FIRED))
        return live + self.first_entry, states[live], rec["group"][live]

    def group_counts(self) -> tuple[np.ndarray, np.ndarray]:
        """(pending, fired) per group id, from one pass over the records."""
        _slots, states, groups = self._live()
        size = self.info["max_groups"]
        pending = np.bincount(groups[states == L.SCHEDULED].astype(np.int64), minlength=size)
        fired = np.bincount(groups[states == L.FIRED].astype(np.int64), minlength=size)
        return pending, fired

    def timers(self, limit: int | None, group: str | None = None, fired: bool = False) -> tuple[int, list[Timer]]:
        """(how many match, the first ``limit`` of them by deadline): scheduled timers, and fired ones if asked."""
        slots, states, groups = self._live()
        keep = states == L.SCHEDULED if not fired else np.ones(states.size, dtype=bool)
        if group is not None:
            gid = self.group_id(group)
            if gid is None:
                return 0, []
            keep &= groups == gid
        slots = slots[keep]
        total = int(slots.size)
        deadlines = self.records["deadline"][slots]
        order = np.argsort(deadlines, kind="stable")
        if limit is not None:
            order = order[:limit]
        names = self.groups()
        out = []
        for slot in slots[order].tolist():
            timer = self._timer(slot, names)
            if timer is not None:
                out.append(timer)
        return total, out

    def _timer(self, slot: int, names: dict[int, str]) -> Timer | None:
        r = self.records[slot]  # one record, copied: the daemon may be rewriting it
        record = bytes(r.tobytes())
        deadline, _prev, _next, gen, _tag, _aux, group, state, meta, key_raw = L.RECORD.unpack(record)
        low = state & L.STATE_MASK
        if low not in (L.SCHEDULED, L.FIRED):
            return None  # freed while we looked
        try:
            key = decode_key(key_raw, meta)
        except WheeldError:
            return None  # torn by a concurrent write
        return Timer(slot, key, names.get(group, f"#{group}"), deadline, L.STATE_NAMES[low], gen)

    def lookup(self, key, group: str) -> Timer | None:
        """The pending (scheduled) timer of ``key`` in ``group``, or None."""
        gid = self.group_id(group)
        if gid is None:
            return None
        ident = encode_ident(key)
        view = np.ndarray(shape=(self.n_records,), dtype="V33", buffer=self._seg.buf,
                          offset=self.info["header_bytes"] + L.R_KEY_META, strides=(L.RECORD_BYTES,))
        candidates = np.flatnonzero(view[self.first_entry :] == np.void(ident)) + self.first_entry
        rec = self.records
        names = self.groups()
        for slot in candidates.tolist():
            if rec["group"][slot] == gid and rec["state"][slot] & L.STATE_MASK == L.SCHEDULED:
                timer = self._timer(slot, names)
                if timer is not None and timer.key == key and timer.state == "scheduled":
                    return timer
        return None

    def record_state(self, slot: int) -> tuple[str, int]:
        """(state name, generation) of one record, for before/after comparisons."""
        r = self.records[slot]
        return L.STATE_NAMES.get(int(r["state"]) & L.STATE_MASK, "?"), int(r["gen"])

    # ---- clients
    def rings(self) -> list[RingStat] | None:
        """The daemon's client table and each ring's depth; None if the table cannot be read."""
        groups = self.groups()
        table = map_readonly(self.clients_segment, CL.SEGMENT_BYTES)
        if table is None:
            return None
        try:
            if struct.unpack_from("<Q", table, 0)[0] != CL.MAGIC:
                return []
            out = []
            for slot in range(CL.MAX_CLIENTS):
                in_use, group, pid, _uid, depth, capacity, _label = CL.ENTRY.unpack_from(table, CL.entry_offset(slot))
                if not in_use:
                    continue
                # the depth the daemon saw at its last look (about once a second): rings are
                # memfds that only their client and the daemon can map
                out.append(RingStat(slot, groups.get(group, f"#{group}"), pid, depth if capacity else None,
                                    capacity or None, pid_alive(pid)))
            return out
        finally:
            table.close()

    # ---- everything
    def snapshot(self, *, stale_after_s: float = DEFAULT_STALE_AFTER_S, with_records: bool = True) -> Snapshot:
        header = self.header()
        counts = self.group_counts() if with_records else None
        return build_snapshot(self.name, self.segment_name, header, self.groups(), self.rings(), counts,
                              stale_after_s=stale_after_s)


def _group_table(buf, max_groups: int) -> dict[int, str]:
    """The registered names of a group table: id -> name (first byte 0: an unused id)."""
    names = np.frombuffer(buf, dtype=np.uint8, count=max_groups * L.GROUP_NAME_BYTES,
                          offset=L.GROUPS_OFFSET).reshape(max_groups, L.GROUP_NAME_BYTES)
    out = {}
    for gid in np.flatnonzero(names[:, 0]).tolist():
        out[gid] = bytes(names[gid]).rstrip(b"\0").decode("utf-8", "replace")
    return out


def map_readonly(name: str, size: int | None = None) -> mmap.mmap | None:
    """Map the first ``size`` bytes (all if None) of a segment read-only; None if absent or not ours to read."""
    try:
        shm = posix_ipc.SharedMemory(name, flags=0, read_only=True)
    except (posix_ipc.ExistentialError, posix_ipc.PermissionsError):
        return None
    try:
        real = os.fstat(shm.fd).st_size
        if real == 0 or (size is not None and real < size):
            return None
        return mmap.mmap(shm.fd, size or real, prot=mmap.PROT_READ)
    except OSError:
        return None
    finally:
        shm.close_fd()
