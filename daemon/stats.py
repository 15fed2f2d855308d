"""What wheeld is doing, read straight from its shared-memory arena (never through the daemon).

The daemon publishes its figures into the arena header once per loop iteration
(``Daemon._publish``): the counters named in
:data:`wheeld.protocol.arena_layout.COUNTER_NAMES`, the fire-lateness
histogram and the group table. ``wheelctl`` maps the arena **read-only** and
copies what it needs; it never sends the daemon a request. That is why it still
answers when the daemon is stuck, stopped (SIGSTOP) or dead, and why it cannot
make a sick daemon sicker.

What a snapshot holds and where each figure comes from::

    figure                         source
    -----------------------------  ----------------------------------------------
    pending, per level, due        counters pending, pending_level_N, pending_due
    adds/re-arms/cancels/...       the *_total counters (they survive restarts)
    rates                          two snapshots: (b - a) / (b.taken - a.taken)
    lateness                       the histogram after the counters, plus its sum
    rings (depth)                  client table /wheeld-NAME-clients: the depth the
                                   daemon saw about a second ago (rings are memfds
                                   only their client and the daemon can map)
    groups                         the arena's group table (an entry whose first
                                   byte is 0 is an unused id); pending and fired
                                   per group from one pass over the records'
                                   state and group columns (the wheel's own live
                                   counts are in the daemon's memory, not the
                                   arena); ids in use: registered, or carried by
                                   a live record
    journal damage                 counters journal_damaged_ranges_total and
                                   journal_damaged_lines_total: what recovery
                                   skipped when it rebuilt this arena
    daemon pid, alive              counter daemon_pid; ``os.kill(pid, 0)``, and
                                   /proc/PID/cmdline mentions wheeld (pid reuse)
    responding                     counter daemon_heartbeat_ms: the daemon writes
                                   it every iteration and parks at most
                                   ``max_park_ms`` (500 ms), so a heartbeat older
                                   than a few seconds means a stuck loop

Consistency: every counter is one aligned 8-byte word, so a single figure is
never torn; figures are not updated together, so two of them may come from
neighbouring iterations (``pending`` and ``pending_level_0`` may disagree by
the timers of one batch). :func:`_stable_header` re-reads the header until two
copies agree on the daemon's own words, because the wheel rewrites those
words to 0 before the daemon writes them again (see ``TimerWheel.publish_stats``).

The checker (:func:`check_arena`) verifies the arena's invariants on a
*private copy* of the segment: ``TimerWheel.attach`` repairs and rebuilds, which
writes, and nothing but the daemon may write a live arena. A copy of an arena
the daemon is writing at that moment can be inconsistent, so :func:`check`
takes copies while the daemon is parked at rest (its parked word: set only for a
park with the counters published, cleared before anything writes the arena), and
otherwise calls the arena broken only when the same problems show in every copy
it took.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
import time
from dataclasses import dataclass

import numpy as np
import posix_ipc

from wheeld.protocol import arena_layout as L
from wheeld.protocol import clients_layout as CL
from wheeld.protocol.errors import BrokenPeer, CorruptArena, WheeldError
from wheeld.protocol.keys import TYPE_BYTES, TYPE_INT, TYPE_STR, decode_key, encode_key
from wheeld.protocol.naming import arena_name, clients_name
from wheeld.shm.arena import Segment


__all__ = [
    "NoArena", "ArenaReader", "Snapshot", "build_snapshot", "RingStat", "GroupStat", "Timer", "CheckReport",
    "pid_alive", "daemon_alive", "rates", "quantile_us", "check", "check_arena", "RATE_COUNTERS",
    "DEFAULT_STALE_AFTER_S",
]

DEFAULT_STALE_AFTER_S = 5.0  # 10x the daemon's longest park: a heartbeat older than this is a stuck loop

# counters that only grow: these get a rate
RATE_COUNTERS = (
    "adds_total", "rearms_total", "cancels_total", "cancel_misses_total", "expirations_total", "acks_total",
    "cascades_total", "idle_rearms_total", "delivered_total", "redelivered_total", "late_total", "commands_total",
    "rejected_total", "arena_full_total", "ring_full_total", "clients_total", "clients_refused_total",
    "clients_dropped_total", "wakeups_total",
)
# words the daemon (not the wheel) writes; re-read until two copies agree (module docstring)
_DAEMON_WORDS = tuple(
    L.H_COUNTERS + 8 * L.COUNTER[n]
    for n in ("daemon_pid", "daemon_started_ms", "daemon_heartbeat_ms", "clients_connected", "groups_active",
              "undelivered", "commands_total", "delivered_total", "clients_total", "wakeups_total",
              "journal_damaged_ranges_total", "journal_damaged_lines_total")
)
_COUNTERS = struct.Struct(f"<{L.COUNTERS}q")
_LATENESS = struct.Struct(f"<{L.LATENESS_BUCKETS}q")
_KEY_TYPE_NAMES = {TYPE_BYTES: "bytes", TYPE_STR: "str", TYPE_INT: "int"}


class NoArena(BrokenPeer):
    """No arena of that name (no daemon ever ran with that --name, or it was removed), or we may not read it."""


def mono_ms() -> int:
    return time.monotonic_ns() // 1_000_000


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (EPERM: it exists, it is just not ours)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def daemon_alive(pid: int) -> bool:
    """:func:`pid_alive`, minus a recycled pid: a process whose command line we can read
    and that does not mention wheeld is not the daemon that wrote the arena."""
    if not pid_alive(pid):
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        return True  # hidden from us (hidepid=, another user): trust the pid
    return not cmdline or b"wheeld" in cmdline


def key_type_name(key) -> str:
    return "int" if type(key) is int else "bytes" if type(key) is bytes else "str"


def key_json(key) -> str | int:
    """A key as JSON: str and int as themselves, bytes as hex (see ``key_type``)."""
    return key.hex() if type(key) is bytes else key


# ---------------------------------------------------------------------------- snapshot
@dataclass(frozen=True)
class RingStat:
    """One client slot of the daemon's client table and its ring's fill level."""

    slot: int
    group: str
    pid: int
    depth: int | None  # None: the segment could not be read (another user's, or gone)
    capacity: int | None
    client_alive: bool

    def to_dict(self) -> dict:
        return {"slot": self.slot, "group": self.group, "pid": self.pid, "depth": self.depth,
                "capacity": self.capacity, "client_alive": self.client_alive}


@dataclass(frozen=True)
class GroupStat:
    id: int
    name: str  # "" for an id no name is registered under that live records still carry
    pending: int
    fired: int  # fired, not acknowledged yet (undelivered + unacknowledged)
    clients: int  # client slots of the table in this group whose process is alive

    @property
    def live(self) -> int:
        """Records of the group in the arena: scheduled + fired (what ``TimerWheel.group_live`` counts)."""
        return self.pending + self.fired

    def to_dict(self) -> dict:
        return {"id": self.id, "name": self.name, "live": self.live, "pending": self.pending, "fired": self.fired,
                "clients": self.clients}


@dataclass
class Snapshot:
    """Everything ``wheelctl stats`` shows, read at one moment (``taken_ms``, monotonic)."""

    name: str
    segment: str
    taken_ms: int
    capacity: int
    tick_ms: int
    wheel_size: int
    levels: int
    max_groups: int
    arena_bytes: int
    clock_ms: int
    created_wall_ms: int
    parked: bool
    counters: dict[str, int]
    lateness_counts: tuple[int, ...]
    lateness_sum_us: int
    groups: list[GroupStat]  # every group id in use, by id
    rings: list[RingStat] | None  # None: the client table could not be read
    daemon_alive: bool
    stale_after_s: float = DEFAULT_STALE_AFTER_S

    # ---- derived figures
    @property
    def daemon_pid(self) -> int:
        return self.counters["daemon_pid"]

    @property
    def heartbeat_age_ms(self) -> int | None:
        beat = self.counters["daemon_heartbeat_ms"]
        return self.taken_ms - beat if beat > 0 else None

    @property
    def uptime_ms(self) -> int | None:
        started = self.counters["daemon_started_ms"]
        return self.taken_ms - started if started > 0 and self.daemon_alive else None

    @property
    def responding(self) -> bool:
        age = self.heartbeat_age_ms
        return self.daemon_alive and age is not None and age <= self.stale_after_s * 1000

    @property
    def health(self) -> str:
        """``ok``, ``stuck`` (alive, heartbeat stale) or ``down`` (no daemon process)."""
        if not self.daemon_alive:
            return "down"
        return "ok" if self.responding else "stuck"

    @property
    def pending(self) -> int:
        return self.counters["pending"]

    @property
    def pending_by_level(self) -> dict[str, int]:
        out = {str(level): self.counters[f"pending_level_{level}"] for level in range(self.levels)}
        out["due"] = self.counters["pending_due"]
        return out

    @property
    def used(self) -> int:
        return self.counters["pending"] + self.counters["fired_unacked"]

    @property
    def undelivered(self) -> int:
        return self.counters["undelivered"]

    @property
    def unacknowledged(self) -> int:
        """Sent to a client, not acknowledged yet: fired records minus those still queued."""
        return max(0, self.counters["fired_unacked"] - self.counters["undelivered"])

    @property
    def ring_depth(self) -> int | None:
        if self.rings is None:
            return None
        return sum(r.depth for r in self.rings if r.depth is not None)

    @property
    def lateness_count(self) -> int:
        return sum(self.lateness_counts)

    @property
    def groups_in_use(self) -> int:
        """Group ids in use: a name is registered under them, or a live record carries them."""
        return len(self.groups)

    @property
    def groups_registered(self) -> int:
        return sum(1 for g in self.groups if g.name)

    def lateness_quantiles(self) -> dict[str, float | None]:
        counts = self.lateness_counts
        return {
            "p50_us": quantile_us(counts, 0.5), "p99_us": quantile_us(counts, 0.99),
            "p999_us": quantile_us(counts, 0.999), "max_us": max_us(counts),
        }

    def to_dict(self, rates_per_s: dict[str, float] | None = None) -> dict:
        c = self.counters
        n = self.lateness_count
        buckets = [{"le_us": bound, "count": count} for bound, count in zip(L.LATENESS_BOUNDS_US, self.lateness_counts)]
        buckets.append({"le_us": None, "count": self.lateness_counts[-1]})
        return {
            "name": self.name,
            "health": self.health,
            "daemon": {
                "pid": self.daemon_pid, "alive": self.daemon_alive, "responding": self.responding,
                "heartbeat_age_ms": self.heartbeat_age_ms, "uptime_ms": self.uptime_ms,
                "restarts_total": c["daemon_restarts_total"], "parked": self.parked,
            },
            "arena": {
                "segment": self.segment, "bytes": self.arena_bytes, "capacity": self.capacity, "used": self.used,
                "free": self.capacity - self.used, "use_ratio": self.used / self.capacity if self.capacity else 0.0,
                "tick_ms": self.tick_ms, "wheel_size": self.wheel_size, "levels": self.levels,
                "max_groups": self.max_groups, "clock_ms": self.clock_ms, "created_wall_ms": self.created_wall_ms,
            },
            "timers": {
                "pending": self.pending, "pending_by_level": self.pending_by_level,
                "fired_unacked": c["fired_unacked"], "undelivered": self.undelivered,
                "unacknowledged": self.unacknowledged,
            },
            "totals": {name: c[name] for name in RATE_COUNTERS},
            "rates_per_s": rates_per_s,
            "lateness": {
                "count": n, "sum_us": self.lateness_sum_us, "mean_us": self.lateness_sum_us / n if n else None,
                **self.lateness_quantiles(), "max_open_ended": bool(self.lateness_counts[-1]), "buckets": buckets,
            },
            "clients": {
                "connected": c["clients_connected"], "accepted_total": c["clients_total"],
                "refused_total": c["clients_refused_total"], "dropped_total": c["clients_dropped_total"],
            },
            "rings": {
                "count": None if self.rings is None else len(self.rings), "depth": self.ring_depth,
                "full_total": c["ring_full_total"],
                "rings": None if self.rings is None else [r.to_dict() for r in self.rings],
            },
            "groups": {
                "active": c["groups_active"], "registered": self.groups_registered, "in_use": self.groups_in_use,
                "max": self.max_groups, "groups": [g.to_dict() for g in self.groups],
            },
            "journal": {
                "damaged_ranges_total": c["journal_damaged_ranges_total"],
                "damaged_lines_total": c["journal_damaged_lines_total"],
            },
            "counters": dict(c),
        }


def rates(a: Snapshot, b: Snapshot) -> dict[str, float] | None:
    """Per-second rates of the growing counters between two snapshots (None if no time passed)."""
    dt_s = (b.taken_ms - a.taken_ms) / 1000
    if dt_s <= 0:
        return None
    return {name: max(0, b.counters[name] - a.counters[name]) / dt_s for name in RATE_COUNTERS}


def _bucket_range_us(index: int) -> tuple[float, float]:
    bounds = L.LATENESS_BOUNDS_US
    low = 0.0 if index == 0 else float(bounds[index - 1])
    high = float(bounds[index]) if index < len(bounds) else math.inf
    return low, high


def quantile_us(counts, q: float) -> float | None:
    """The q-quantile of lateness in us, interpolated linearly inside its histogram bucket.

    None without samples. In the open-ended last bucket (> 60 s) the bucket's
    lower bound is returned: the estimate is then a floor, not a value.
    """
    total = sum(counts)
    if not total:
        return None
    rank = q * total
    seen = 0
    for index, count in enumerate(counts):
        if count and seen + count >= rank:
            low, high = _bucket_range_us(index)
            if math.isinf(high):
                return low
            return low + (high - low) * max(0.0, rank - seen) / count
        seen += count
    return _bucket_range_us(len(counts) - 1)[0]  # pragma: no cover - rank <= total always lands above


def max_us(counts) -> float | None:
    """An upper bound of the largest lateness seen: the top of the highest non-empty bucket
    (its lower bound for the open-ended last bucket)."""
    for index in range(len(counts) - 1, -1, -1):
        if counts[index]:
            low, high = _bucket_range_us(index)
            return low if math.isinf(high) else high
    return None


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


def _parse_header(buf, size: int | None, label: str) -> dict:
    """The fixed header's parameters, validated; ``size`` None skips the segment-size check."""
    if len(buf) < L.GROUPS_OFFSET or (size is not None and size < L.GROUPS_OFFSET):
        raise CorruptArena(f"{label} is {size} bytes, too small for a wheeld arena header")
    (magic, version, record_bytes, capacity, tick_ms, wheel_size, levels, start_ms, cur, free_head, max_groups,
     created_wall_ms) = L.HEADER_FIXED.unpack_from(buf, 0)
    if magic != L.MAGIC:
        raise CorruptArena(f"{label} is not a wheeld arena (bad magic)")
    if version != L.LAYOUT_VERSION:
        raise CorruptArena(f"{label} has arena layout version {version}; this wheelctl reads {L.LAYOUT_VERSION}")
    if record_bytes != L.RECORD_BYTES or not 1 <= levels <= L.MAX_LEVELS or wheel_size < 2 or tick_ms < 1 \
            or not 1 <= max_groups <= 65535:
        raise CorruptArena(f"{label}: header parameters are inconsistent")
    expected = L.segment_bytes(capacity, levels, wheel_size, max_groups)
    if size is not None and size < expected:
        raise CorruptArena(f"{label} is {size} bytes, its header describes {expected}")
    return {"capacity": capacity, "tick_ms": tick_ms, "wheel_size": wheel_size, "levels": levels,
            "start_ms": start_ms, "current_ms": cur, "free_head": free_head, "max_groups": max_groups,
            "created_wall_ms": created_wall_ms, "header_bytes": L.header_bytes(max_groups), "bytes": expected}


def _stable_header(buf, tries: int = 20) -> bytes:
    """A copy of the header page whose daemon-written words two consecutive reads agree on."""
    previous = bytes(buf[: L.GROUPS_OFFSET])
    for _ in range(tries):
        current = bytes(buf[: L.GROUPS_OFFSET])
        pid = struct.unpack_from("<q", current, L.H_COUNTERS + 8 * L.COUNTER["daemon_pid"])[0]
        if pid != 0 and all(previous[o : o + 8] == current[o : o + 8] for o in _DAEMON_WORDS):
            return current
        previous = current
        time.sleep(0.0005)
    return previous  # a daemon that stopped cleanly leaves pid 0: that is its real state


class ArenaReader:
    """The arena of daemon instance ``name``, mapped read-only. Close it (or use ``with``)."""

    def __init__(self, name: str):
        self.name = name
        self.segment_name = arena_name(name)
        try:
            self._seg = Segment.attach(self.segment_name, readonly=True)
        except FileNotFoundError:
            raise NoArena(f"no wheeld arena named {name!r} ({self.segment_name}): "
                          f"is wheeld running with --name {name}?") from None
        except (PermissionError, posix_ipc.PermissionsError):
            raise NoArena(f"may not read the wheeld arena {self.segment_name}: run wheelctl as the daemon's "
                          f"user, or as a member of the group that owns /dev/shm{self.segment_name}") from None
        try:
            self.info = _parse_header(self._seg.buf, self._seg.size, self.segment_name)
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
        return _stable_header(self._seg.buf)

    def counters(self, header: bytes | None = None) -> dict[str, int]:
        words = _COUNTERS.unpack_from(header or self.header(), L.H_COUNTERS)
        return {name: words[index] for index, name in enumerate(L.COUNTER_NAMES)}

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
            key = decode_key(key_raw[: meta & 0x3F], meta)
        except WheeldError:
            return None  # torn by a concurrent write
        return Timer(slot, key, names.get(group, f"#{group}"), deadline, L.STATE_NAMES[low], gen)

    def lookup(self, key, group: str) -> Timer | None:
        """The pending (scheduled) timer of ``key`` in ``group``, or None."""
        gid = self.group_id(group)
        if gid is None:
            return None
        data, meta = encode_key(key)
        ident = bytes((meta,)) + data + b"\0" * (L.KEY_BYTES - len(data))
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
        table = _map_readonly(clients_name(self.name), CL.SEGMENT_BYTES)
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


def build_snapshot(
    name: str,
    segment: str,
    header: bytes,
    group_names: dict[int, str],
    rings: list[RingStat] | None,
    group_counts: tuple[np.ndarray, np.ndarray] | None = None,
    *,
    alive: bool | None = None,
    stale_after_s: float = DEFAULT_STALE_AFTER_S,
) -> Snapshot:
    """A :class:`Snapshot` from a copy of the header page (``wheelctl`` reads it from the
    arena; the daemon's metrics endpoint from its own mapping). ``alive`` None: ask
    :func:`daemon_alive` about the pid in the header."""
    info = _parse_header(header, None, segment)
    taken = mono_ms()
    words = _COUNTERS.unpack_from(header, L.H_COUNTERS)
    counters = {n: words[i] for i, n in enumerate(L.COUNTER_NAMES)}
    members: dict[str, int] = {}
    for ring in rings or ():
        if ring.client_alive:
            members[ring.group] = members.get(ring.group, 0) + 1
    ids = set(group_names)
    if group_counts is not None:
        pending, fired = group_counts
        ids.update(np.flatnonzero((pending != 0) | (fired != 0)).tolist())  # unnamed ids that live records carry
    groups = []
    for gid in sorted(ids):
        gname = group_names.get(gid, "")
        counts = (int(pending[gid]), int(fired[gid])) if group_counts is not None else (0, 0)
        groups.append(GroupStat(gid, gname, *counts, members.get(gname, 0) if gname else 0))
    return Snapshot(
        name=name, segment=segment, taken_ms=taken, capacity=info["capacity"],
        tick_ms=info["tick_ms"], wheel_size=info["wheel_size"], levels=info["levels"],
        max_groups=info["max_groups"], arena_bytes=info["bytes"],
        clock_ms=struct.unpack_from("<q", header, L.H_CURRENT_MS)[0], created_wall_ms=info["created_wall_ms"],
        parked=struct.unpack_from("<q", header, L.H_PARKED)[0] != 0, counters=counters,
        lateness_counts=tuple(_LATENESS.unpack_from(header, L.H_LATENESS)),
        lateness_sum_us=struct.unpack_from("<q", header, L.H_LATENESS_SUM_US)[0], groups=groups, rings=rings,
        daemon_alive=daemon_alive(counters["daemon_pid"]) if alive is None else alive,
        stale_after_s=stale_after_s,
    )


def _group_table(buf, max_groups: int) -> dict[int, str]:
    """The registered names of a group table: id -> name (first byte 0: an unused id)."""
    names = np.frombuffer(buf, dtype=np.uint8, count=max_groups * L.GROUP_NAME_BYTES,
                          offset=L.GROUPS_OFFSET).reshape(max_groups, L.GROUP_NAME_BYTES)
    out = {}
    for gid in np.flatnonzero(names[:, 0]).tolist():
        out[gid] = bytes(names[gid]).rstrip(b"\0").decode("utf-8", "replace")
    return out


def _map_readonly(name: str, size: int | None = None) -> mmap.mmap | None:
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


# ---------------------------------------------------------------------------- invariants
_MAX_PER_KIND = 10  # problems of one kind listed before "... and N more"


class _Problems:
    def __init__(self) -> None:
        self.items: list[str] = []

    def add(self, message: str) -> None:
        self.items.append(message)

    def many(self, what: str, slots: np.ndarray, describe) -> None:
        """One line per offending record (at most _MAX_PER_KIND), then a count of the rest."""
        slots = np.asarray(slots)
        for s in slots[:_MAX_PER_KIND].tolist():
            self.items.append(f"{what}: {describe(s)}")
        if slots.size > _MAX_PER_KIND:
            self.items.append(f"{what}: ... and {slots.size - _MAX_PER_KIND} more records")


def _cycle_owner(nxt: np.ndarray, member: np.ndarray, first: int) -> np.ndarray:
    """For each record on a circular list, the smallest sentinel index on its cycle, or >= n if none.

    Pointer doubling: after k rounds every record knows the minimum label of the
    next 2**k records on its cycle; log2(n) rounds cover any cycle.
    """
    n = nxt.size
    label = np.where(np.arange(n) < first, np.arange(n), n + np.arange(n)).astype(np.int64)
    label[~member] = 2 * n + 1
    jump = np.where(member, nxt, np.arange(n)).astype(np.int64)
    for _ in range(max(1, int(n).bit_length())):
        label = np.minimum(label, label[jump])
        jump = jump[jump]
    return label


def check_arena(buf, size: int | None = None, label: str = "arena") -> list[str]:
    """Every invariant of a (private copy of an) arena, without writing it; [] when sound.

    Checks: the header; links (``next``/``prev`` agree, stay in range); every
    circular list has exactly one sentinel; scheduled records sit in the bucket
    (or due list) their state and deadline say, fired ones on the fired list;
    every non-empty bucket expires after the clock and maps to its index; a free
    list kept in the arena is one chain through exactly the free records; no (group, key) is
    scheduled twice; keys are well formed; live records carry a group id inside the
    group table; the header's pending / fired /
    per-level counters match the records; no update intent and no batch intent is open.
    """
    size = len(buf) if size is None else size
    info = _parse_header(buf, size, label)
    p = _Problems()
    levels, ws, capacity = info["levels"], info["wheel_size"], info["capacity"]
    first = levels * ws + 2
    n = first + capacity
    due_list, fired_list = levels * ws, levels * ws + 1
    cur = info["current_ms"]
    rec = np.frombuffer(buf, dtype=L.RECORD_DTYPE, count=n, offset=info["header_bytes"])
    state = rec["state"].astype(np.int64)
    low = state & L.STATE_MASK
    level = state >> L.LEVEL_SHIFT
    nxt = rec["next"].astype(np.int64)
    prv = rec["prev"].astype(np.int64)
    deadline = rec["deadline"]
    entry = np.arange(n) >= first
    counters = _COUNTERS.unpack_from(buf, L.H_COUNTERS)
    counter = {name: counters[i] for i, name in enumerate(L.COUNTER_NAMES)}

    intent = struct.unpack_from("<i", buf, L.H_INTENT_SLOT)[0]
    if intent != -1:
        p.add(f"an update intent is open (slot {intent}): a writer stopped in the middle of a re-arm")
    for problem in _batch_intent_problems(buf, info, first, n):
        p.add(problem)

    # states and keys
    bad_state = np.flatnonzero(entry & (low > L.FIRED))
    p.many("unknown state", bad_state, lambda s: f"record {s} has state byte {state[s]}")
    meta = rec["key_meta"].astype(np.int64)
    key_len, key_kind = meta & 0x3F, meta >> 6
    bad_meta = (key_len < 1) | (key_len > L.KEY_BYTES) | (key_kind > 2) | ((key_kind == 2) & (key_len != 8))
    bad_key = np.flatnonzero(entry & (low != L.FREE) & (low <= L.FIRED) & bad_meta)
    p.many("malformed key", bad_key, lambda s: f"record {s} has key meta {meta[s]:#x}")
    sched = entry & (low == L.SCHEDULED)
    bad_level = np.flatnonzero(sched & (level >= levels) & (level != L.DUE_LEVEL))
    p.many("bad level", bad_level, lambda s: f"scheduled record {s} claims level {level[s]} of {levels}")
    fired = entry & (low == L.FIRED)
    bad_fired = np.flatnonzero(fired & (state != L.FIRED))
    p.many("bad fired state", bad_fired, lambda s: f"fired record {s} has state byte {state[s]}")
    group = rec["group"]
    bad_group = np.flatnonzero((sched | fired) & (group >= info["max_groups"]))
    p.many("bad group", bad_group, lambda s: f"record {s} carries group id {group[s]}, the table has "
                                             f"{info['max_groups']}")

    # links of the circular lists: sentinels and every scheduled or fired record
    member = ~entry | sched | fired
    in_range = (nxt >= 0) & (nxt < n) & (prv >= 0) & (prv < n)
    broken = np.flatnonzero(member & ~in_range)
    p.many("link out of range", broken, lambda s: f"record {s}: next {nxt[s]}, prev {prv[s]}")
    ok = member & in_range
    nxt_c = np.where(ok, nxt, 0)
    prv_c = np.where(ok, prv, 0)
    asym = np.flatnonzero(ok & ((prv[nxt_c] != np.arange(n)) | (nxt[prv_c] != np.arange(n)) | ~member[nxt_c]))
    p.many("links disagree", asym, lambda s: f"record {s}: next {nxt[s]} (whose prev is {prv[nxt[s]]}), "
                                             f"prev {prv[s]} (whose next is {nxt[prv[s]]})")
    if not broken.size and not asym.size:
        owner = _cycle_owner(nxt, member, first)
        orphans = np.flatnonzero(member & (owner >= n))
        p.many("lost records", orphans, lambda s: f"record {s} is on a circular list without a sentinel")
        merged = np.flatnonzero(~entry & (owner != np.arange(n)))
        p.many("merged lists", merged, lambda s: f"bucket sentinel {s} is on the list of sentinel {owner[s]}")
        own = np.where(owner < n, owner, -1)
        # fired list: exactly the fired records
        p.many("fired list", np.flatnonzero(entry & (own == fired_list) & ~fired),
               lambda s: f"record {s} on the fired list has state byte {state[s]}")
        p.many("fired list", np.flatnonzero(fired & (own != fired_list) & (own >= 0)),
               lambda s: f"fired record {s} is on list {own[s]}, not the fired list")
        # due list
        on_due = entry & (own == due_list)
        p.many("due list", np.flatnonzero(on_due & ~(sched & (level == L.DUE_LEVEL))),
               lambda s: f"record {s} on the due list has state byte {state[s]}")
        p.many("due list", np.flatnonzero(on_due & (deadline > cur)),
               lambda s: f"record {s} on the due list is not due ({deadline[s]} > clock {cur})")
        p.many("due list", np.flatnonzero(sched & (level == L.DUE_LEVEL) & (own != due_list) & (own >= 0)),
               lambda s: f"record {s} says due but is on list {own[s]}")
        # buckets
        in_bucket = entry & (own >= 0) & (own < due_list)
        slots = np.flatnonzero(in_bucket)
        if slots.size:
            b = own[slots]
            blevel, j = b // ws, b % ws
            ticks = np.array([info["tick_ms"] * ws**lv for lv in range(levels)], dtype=np.int64)
            t = ticks[blevel]
            exp = deadline[b]
            v = exp // t
            d = deadline[slots]
            wrong_state = ~sched[slots] | (level[slots] != blevel)
            p.many("bucket", slots[wrong_state],
                   lambda s: f"record {s} in level-{own[s] // ws} bucket {own[s] % ws} has state byte {state[s]}")
            bad_exp = (exp % t != 0) | (v % ws != j) | (exp <= cur)
            bad_buckets = np.unique(b[bad_exp])
            p.many("bucket", bad_buckets, lambda s: f"bucket {s} (level {s // ws}) has expiration {deadline[s]} "
                                                    f"that does not map to it or is not after the clock {cur}")
            right = np.where(blevel == 0, -(-d // t) == v, np.where(blevel == levels - 1, d // t >= v, d // t == v))
            p.many("bucket", slots[~right & ~bad_exp],
                   lambda s: f"record {s}: deadline {deadline[s]} does not belong in level-{own[s] // ws} bucket "
                             f"{own[s] % ws} (expiration {deadline[own[s]]})")

    # free list: when the header names a head (older wheels chain free records through
    # ``next`` in the arena), one chain from it through exactly the free records, ending
    # in -1. A head of -1 means the owning process keeps the free records (its own
    # stack, rebuilt from the states on attach): nothing in the arena to check.
    free = entry & (low == L.FREE)
    head = info["free_head"]
    free_slots = np.flatnonzero(free)
    if head == -1:
        pass
    elif not free_slots.size:
        p.add(f"free list starts at {head} but no record is free")
    elif not (first <= head < n) or not free[head]:
        p.add(f"free list starts at {head}, which is not a free record")
    else:
        targets = nxt[free_slots]
        to_free = (targets >= first) & (targets < n) & free[np.clip(targets, 0, n - 1)]
        outside = free_slots[(targets != -1) & ~to_free]
        p.many("free list", outside, lambda s: f"free record {s} links to {nxt[s]}, which is not free")
        ends = int(np.count_nonzero(targets == -1))
        inner = targets[targets >= 0]
        shared = inner.size - np.unique(inner).size
        if ends != 1:
            p.add(f"free list has {ends} ends, expected 1")
        if shared:
            p.add(f"free list: {shared} records are linked from two free records")
        if np.any(inner == head):
            p.add(f"free list head {head} is linked from another free record: the records before it are lost")
        if not outside.size and ends == 1 and not shared:
            # every free record must reach the end: pointer doubling towards the terminal
            term = n
            jump = np.full(n + 1, term, dtype=np.int64)
            jump[free_slots] = np.where(targets == -1, term, targets)
            for _ in range(max(1, int(free_slots.size).bit_length())):
                jump = jump[jump]
            cyc = free_slots[jump[free_slots] != term]
            p.many("free list", cyc, lambda s: f"free record {s} is on a cycle, not on the free list")

    # duplicates: (group, key) scheduled twice
    s_slots = np.flatnonzero(sched)
    if s_slots.size > 1:
        raw = np.frombuffer(buf, dtype=np.uint8, count=n * L.RECORD_BYTES, offset=info["header_bytes"]).reshape(n, -1)
        ident = np.ascontiguousarray(np.concatenate((raw[s_slots, L.R_GROUP : L.R_GROUP + 2],
                                                     raw[s_slots, L.R_KEY_META :]), axis=1))
        ident_v = ident.view(f"V{ident.shape[1]}").ravel()
        _uniq, inverse, counts = np.unique(ident_v, return_inverse=True, return_counts=True)
        dup = s_slots[counts[inverse] > 1]
        p.many("duplicate key", dup, lambda s: f"record {s} shares its (group, key) with another scheduled record")

    # the header's counters against the records
    n_sched = int(np.count_nonzero(sched))
    n_fired = int(np.count_nonzero(fired))
    if counter["pending"] != n_sched:
        p.add(f"counter pending={counter['pending']}, but {n_sched} records are scheduled")
    if counter["fired_unacked"] != n_fired:
        p.add(f"counter fired_unacked={counter['fired_unacked']}, but {n_fired} records are fired")
    per_level = np.bincount(level[sched], minlength=L.DUE_LEVEL + 1)
    for lv in range(levels):
        if counter[f"pending_level_{lv}"] != per_level[lv]:
            p.add(f"counter pending_level_{lv}={counter[f'pending_level_{lv}']}, but {per_level[lv]} records are there")
    if counter["pending_due"] != per_level[L.DUE_LEVEL]:
        p.add(f"counter pending_due={counter['pending_due']}, but {per_level[L.DUE_LEVEL]} records are due")
    return p.items


def _batch_intent_problems(buf, info: dict, first: int, n: int) -> list[str]:
    """What an open batch intent (layout v2, ``H_INTENT_COUNT`` != 0) says about the arena.

    The count is the commit word of a batch of re-arms (``TimerWheel.schedule_many``):
    nonzero means a writer stopped after committing the batch and before finishing
    its records. That is recoverable (a restart replays every entry, see
    :func:`recover_copy`), so it is reported as one open intent with its size; the
    re-armed records' links may disagree with their states meanwhile and are
    reported as well (recovery rebuilds links from the records). A count above
    ``INTENT_BATCH_MAX`` or an entry naming a slot outside the entry records cannot
    come from a writer: corruption, and a restart refuses such an arena.
    """
    count = struct.unpack_from("<I", buf, L.H_INTENT_COUNT)[0]
    if not count:
        return []
    if count > L.INTENT_BATCH_MAX:
        return [(f"the batch intent claims {count} entries (at most {L.INTENT_BATCH_MAX} exist): corrupt header; "
                 "a restart refuses this arena")]
    entries = np.frombuffer(buf, dtype=L.INTENT_DTYPE, count=count, offset=L.intent_batch_offset(info["max_groups"]))
    slots = entries["slot"].astype(np.int64)
    outside = np.flatnonzero((slots < first) | (slots >= n))
    if outside.size:
        return [(f"the batch intent ({count} entries) names slot {int(slots[outside[0]])} (entry {int(outside[0])}), "
                 "not an entry record: corrupt; a restart refuses this arena")]
    return [(f"a batch intent of {count} re-arms is open: a writer stopped in the middle of a batch re-arm "
             "(a restart replays it)")]


def _replayed_intents(buf) -> list[str]:
    """The intents a restart would replay on this arena, as repair descriptions."""
    out = []
    slot = struct.unpack_from("<i", buf, L.H_INTENT_SLOT)[0]
    if slot != -1:
        out.append(f"update intent of record {slot} replayed")
    count = struct.unpack_from("<I", buf, L.H_INTENT_COUNT)[0]
    if count:
        out.append(f"batch intent of {count} re-arms replayed")
    return out


def recover_copy(buf: mmap.mmap, size: int) -> tuple[list[str], list[str]]:
    """What a restarting daemon would do to this private copy: (repairs made, problems left after).

    Runs the wheel's own recovery (replay the intent, rebuild every list from the
    records) and its check. The copy is private memory: nothing reaches the live arena.
    """
    from wheeld.shm.wheel import TimerWheel

    wheel = TimerWheel(Segment(buf, None, size))
    try:
        # TimerWheel.attach(name) takes a segment name; a private copy has none, so the
        # two recovery steps attach runs are called directly.
        replayed = _replayed_intents(buf)
        wheel._replay_intent()
        wheel._rebuild()
        return replayed + list(wheel.repairs), wheel.check()
    finally:
        wheel.close()


@dataclass
class CheckReport:
    problems: list[str]
    copies: int
    quiet: bool  # the verdict comes from a copy taken while nothing wrote the arena
    repairs: list[str]  # what recovery (a daemon restart) would repair on the last copy
    after_recovery: list[str]  # problems the wheel's own check still finds after recovery
    inconclusive: bool = False  # every copy had problems, none in common (a busy arena)
    daemon_alive: bool = False

    @property
    def ok(self) -> bool:
        return not self.problems and not self.inconclusive and not self.after_recovery

    def to_dict(self) -> dict:
        return {"ok": self.ok, "problems": self.problems, "copies": self.copies, "quiet": self.quiet,
                "inconclusive": self.inconclusive, "repairs_on_restart": self.repairs,
                "after_recovery": self.after_recovery, "daemon_alive": self.daemon_alive}


def _private_copy(reader: ArenaReader, budget_s: float = 0.5) -> tuple[mmap.mmap, bool]:
    """(a private copy of the arena, whether nothing wrote it while we copied).

    The daemon sets the arena's parked word only when it parks with its counters
    published, and clears it before anything writes the arena (``Daemon.arena_busy``),
    so copies are taken until one starts and ends with that word set and the header
    unchanged, for up to
    ``budget_s`` (a busy daemon parks for moments; a reader preempted during a
    copy misses one of them and tries again); the last copy is returned either way.
    """
    size = reader.info["bytes"]
    buf = reader.buf
    parked_at = L.H_PARKED
    copy = mmap.mmap(-1, size)
    end = time.monotonic() + budget_s
    while True:
        while struct.unpack_from("<q", buf, parked_at)[0] == 0 and time.monotonic() < end:
            time.sleep(0.0005)
        before = bytes(buf[: L.GROUPS_OFFSET])
        memoryview(copy)[:size] = memoryview(buf)[:size]
        after = bytes(buf[: L.GROUPS_OFFSET])
        quiet = struct.unpack_from("<q", before, parked_at)[0] != 0 and before == after
        if quiet or time.monotonic() >= end:
            return copy, quiet


def check(name: str, attempts: int = 5, interval_s: float = 0.05) -> CheckReport:
    """Check the arena of ``name`` on private copies (see the module docstring).

    With no live daemon one copy is final. With a live one, a copy taken while
    it was parked and wrote nothing is final; otherwise up to ``attempts``
    copies are taken, the arena is sound if any copy is, and the problems
    reported are those every copy showed.
    """
    with ArenaReader(name) as reader:
        alive = daemon_alive(reader.counters()["daemon_pid"])
        size = reader.info["bytes"]
        common: list[str] | None = None
        copies = 0
        copy = None
        quiet = False
        for attempt in range(max(1, attempts)):
            if copy is not None:
                copy.close()
            copy, quiet = _private_copy(reader)
            copies += 1
            problems = check_arena(copy, size, reader.segment_name)
            if not alive or quiet or not problems:
                common = problems
                break
            common = problems if common is None else [q for q in common if q in problems]
            if attempt + 1 < attempts:
                time.sleep(interval_s)
        inconclusive = bool(alive and not quiet and common == [] and problems)
        try:
            repairs, after = recover_copy(copy, size)
        except CorruptArena as exc:
            repairs, after = [], [f"recovery fails: {exc}"]
        finally:
            copy.close()
        return CheckReport(common or [], copies, quiet or not alive, repairs, after if not inconclusive else [],
                           inconclusive, alive)

