"""What ``wheelctl stats`` shows, as one value: a :class:`Snapshot` of an arena's header.

The daemon publishes its figures into the arena header once per loop iteration:
the counters named in :data:`wheeld.protocol.arena_layout.COUNTER_NAMES` (the
wheel writes its own words, ``TimerWheel.publish_stats``; the daemon the others),
the fire-lateness histogram and the group table. :func:`build_snapshot` turns a
copy of that header into a Snapshot; ``wheelctl`` copies it from the arena
(:class:`wheeld.shm.reader.ArenaReader`), the daemon's metrics endpoint from its
own mapping, and both render it the same way (:mod:`wheeld.shm.prometheus`).

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
    journal writable               counter journal_stalled: the errno that
                                   stops the daemon writing its journal (0:
                                   writable), journal_stalls_total,
                                   journal_unwritten_events_total,
                                   journal_flushes_refused_total
    hot path                       counter daemon_hot_path: "compiled" or
                                   "python" (protocol/accel.py), as the daemon
                                   that last started said
    daemon pid, alive              counter daemon_pid; ``os.kill(pid, 0)``, and
                                   /proc/PID/cmdline mentions wheeld (pid reuse)
    responding                     counter daemon_heartbeat_ms: the daemon writes
                                   it every iteration and parks at most
                                   ``max_park_ms`` (500 ms), so a heartbeat older
                                   than a few seconds means a stuck loop

Consistency: every counter is one aligned 8-byte word with one writer, so a
single figure is never torn; figures are not updated together, so two of them
may come from neighbouring iterations (``pending`` and ``pending_level_0`` may
disagree by the timers of one batch).
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass

import numpy as np

from wheeld.protocol import arena_layout as L
from wheeld.protocol.accel import PATH_NAMES
from wheeld.protocol.clock import mono_ms  # wheelctl reads the clock through here

from .header import parse_header

__all__ = [
    "Snapshot", "build_snapshot", "RingStat", "GroupStat", "pid_alive", "daemon_alive", "rates", "quantile_us",
    "max_us", "mono_ms", "RATE_COUNTERS", "DEFAULT_STALE_AFTER_S",
]

DEFAULT_STALE_AFTER_S = 5.0  # 10x the daemon's longest park: a heartbeat older than this is a stuck loop

# counters that only grow: these get a rate
RATE_COUNTERS = (
    "adds_total", "rearms_total", "cancels_total", "cancel_misses_total", "expirations_total", "acks_total",
    "cascades_total", "idle_rearms_total", "delivered_total", "redelivered_total", "late_total", "commands_total",
    "rejected_total", "arena_full_total", "ring_full_total", "clients_total", "clients_refused_total",
    "clients_dropped_total", "wakeups_total",
)
_LATENESS = struct.Struct(f"<{L.LATENESS_BUCKETS}q")


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
    def hot_path(self) -> str | None:
        """"compiled", "python" or "mixed": the daemon's hot path (None: not published)."""
        return PATH_NAMES.get(self.counters["daemon_hot_path"])

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
                "restarts_total": c["daemon_restarts_total"], "parked": self.parked, "hot_path": self.hot_path,
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
                "writable": c["journal_stalled"] == 0,
                "stalled_errno": c["journal_stalled"],
                "stalls_total": c["journal_stalls_total"],
                "unwritten_events_total": c["journal_unwritten_events_total"],
                "flushes_refused_total": c["journal_flushes_refused_total"],
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
    info = parse_header(header, None, segment)
    taken = mono_ms()
    counters = L.read_counters(header)
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
