"""Realistic fleet journals for the pipeline's tests and benchmarks.

::

    python -m wheeld.pipeline.generate OUT --hosts 20 --events 10000000 --seed 1

writes ``OUT/host-000/journal-0000000000000001.jsonl``, ... one folder per
host, in exactly the format the daemon writes: the events are the structs of
:mod:`wheeld.protocol.journal` and the files are written by the daemon's own
writer, :class:`wheeld.journal.files.Journal` (lsns, segment headers,
rotation), with ``fsync="off"`` and simulated clocks.

What a host does over its simulated day
=======================================

Operations arrive with a diurnal rate, ``rate(t) ~ 1 + 0.6 sin(2 pi (t/day -
0.375))`` (quiet at night, a peak in the afternoon, each host slightly shifted),
drawn by inverting the rate's cumulative integral. Each operation belongs to
one of four groups that behave differently:

============  ===============================================================
``conns``     idle-connection timers (``add`` with ``i`` = 10/30/60 s, str
              keys ``conn-<n>``). The connection stays active for a lognormal
              time (median 90 s) and is touched all along: each time its
              deadline comes the daemon finds it touched and moves it
              (``idle_rearm``, last touch + idle). 55 % are closed by the
              client (``cancel`` hit), the rest go idle and time out
              (``fire`` then ``ack``); 5 % are never touched at all.
``purgatory`` request purgatory (str keys ``req-<n>``): a timeout of
              200/500/1000/5000 ms; the operation completes after a lognormal
              time (median 15 ms), which cancels the timer early (``cancel``
              hit) -- or it times out (``fire``, ``ack``) and a late
              completion may still try to cancel it (``cancel`` miss).
``jobs``      delayed jobs (int keys): delays lognormal around 5 min; 10 %
              are rescheduled once (``rearm``), 5 % cancelled, the rest fire.
``leases``    leases with bytes keys (``b64:``): a 10 s lease renewed every
              ~3 s (``rearm``) a geometric number of times, then released
              (``cancel`` hit, 85 %) or left to expire (``fire``).
============  ===============================================================

Fire lateness (``lat = f - d``) grows with the load of the moment. On a normal
host it is about 1 ms with rare pauses of 20-250 ms; on a *slow* host about
15 ms with pauses up to 2 s. Every fire is acknowledged 0-3 ms later.

Some hosts (``restart_fraction``) go down once for 2-20 minutes: no operation
arrives meanwhile, the daemon restarts with a new segment (its monotonic clock
starts again near zero, the lsns continue), timers whose deadline passed
while it was down fire at once with ``late: true`` and their lateness, and
operations caught in the outage end there (their timer fires at its deadline
or late at the restart, then is acknowledged).

Hosts run with ``--replicate`` (``replicated_hosts``) also journal
replication samples (``repl`` events), as the daemon's Recorder writes them: one
at every change of state and every 10 s otherwise. Each daemon run starts
``connecting`` (epoch 0, nothing stored yet) and is ``replicating`` (its next
lease epoch) 0.15-2.5 s later; the cluster is out of reach about six times a
day for a lognormal time (median 20 s, 2 s to 15 min): ``behind``, the lag
growing with the events journaled meanwhile. While replicating, the lag is the
events of the last few ms (a batch in flight). A restart is a crash (no last
sample) and a new run at the next epoch. A ``fenced`` host is paused after its
last event, longer than its lease, and finds on resuming that a peer took it
over: a ``fenced`` sample, and the last one as it stands down. The samples
are extra lines with their own lsns, within the span of the host's timer
events (a fenced host's two after it).

Each host gets exactly ``events_per_host`` events: the simulation is sized
from a small pilot run and the day's events are cut in time order at that
count (timers armed near the end are simply still pending, as in a real
journal). Everything is decided in numpy arrays; only the last step, one
struct per event and the daemon's writer, runs per event in Python: about
200k events/s end to end on one core here (2M events in 11 s, so 10M in about
a minute; ``--workers`` spreads hosts over processes). Memory: ~170 bytes
per event of the largest host while it is being written.

The generator returns no ground truth on purpose: the pipeline's tests
compute the figures from the files, independently of how they were made.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from wheeld.journal.files import DEFAULT_SEGMENT_BYTES, Journal, prepare_directory
from wheeld.protocol.journal import REPL_EVERY_MS, Ack, Add, Cancel, Fire, IdleRearm, Rearm, Repl, key_to_json

__all__ = ["FleetInfo", "generate_fleet", "generate_host", "main"]

DAY_MS = 86_400_000
#: 2024-01-01T00:00:00Z: a fixed default so the same seed gives the same bytes.
DEFAULT_START_WALL_MS = 1_704_067_200_000
DAEMON_NAME = "default"
BATCH_EVENTS = 256  # events per Journal.append, like one drained ring batch
REPL_OUTAGES_PER_DAY = 6  # times a day a replicating host loses the cluster (behind), on average

GROUPS = ("conns", "purgatory", "jobs", "leases")
CONNS, PURGATORY, JOBS, LEASES = range(4)
#: share of *operations* per group (conns and leases make many events each)
GROUP_MIX = (0.08, 0.70, 0.12, 0.10)

# event kinds, in the order they may happen within one millisecond of one op
ADD, REARM, IDLE_REARM, CANCEL, FIRE, ACK, CANCEL_MISS = range(7)


@dataclass
class FleetInfo:
    """What was written: folders, host names, which hosts are slow or restarted."""

    out_dir: Path
    hosts: list[str]
    slow_hosts: list[str]
    restarted_hosts: list[str]
    events_per_host: int
    seed: int
    start_wall_ms: int
    replicated_hosts: list[str] = field(default_factory=list)
    fenced_hosts: list[str] = field(default_factory=list)
    seconds: float = 0.0
    bytes_written: int = 0
    segments: int = 0
    per_host: dict[str, dict] = field(default_factory=dict)


# --------------------------------------------------------------------------- #
# Simulation (numpy)
# --------------------------------------------------------------------------- #


class _Events:
    """Column arrays of one host's events; ``op`` ties an event to its operation."""

    COLUMNS = ("op", "t", "kind", "d", "pd", "lat", "late")

    def __init__(self) -> None:
        self.parts: list[dict[str, np.ndarray]] = []

    def add(self, op, t, kind, d, pd=None, lat=None, late=None) -> None:
        size = len(op)
        if size == 0:
            return
        zeros = np.zeros(size, dtype=np.int64)
        self.parts.append(
            {
                "op": np.asarray(op, dtype=np.int64),
                "t": np.asarray(t, dtype=np.int64),
                "kind": np.full(size, kind, dtype=np.int8) if np.isscalar(kind) else np.asarray(kind, np.int8),
                "d": np.asarray(d, dtype=np.int64),
                "pd": zeros if pd is None else np.asarray(pd, dtype=np.int64),
                "lat": zeros if lat is None else np.asarray(lat, dtype=np.int64),
                "late": np.zeros(size, dtype=bool) if late is None else np.asarray(late, dtype=bool),
            }
        )

    def columns(self) -> dict[str, np.ndarray]:
        return {name: np.concatenate([part[name] for part in self.parts]) for name in self.COLUMNS}


def _arrivals(rng: np.random.Generator, count: int, start_ms: int, duration_ms: int, phase: float) -> np.ndarray:
    """``count`` sorted arrival times with a diurnal (sinusoidal) rate."""
    grid = np.linspace(0.0, 1.0, 4097)
    rate = 1.0 + 0.6 * np.sin(2 * np.pi * (grid - 0.375 + phase))
    cumulative = np.concatenate(([0.0], np.cumsum((rate[1:] + rate[:-1]) / 2)))
    cumulative /= cumulative[-1]
    fraction = np.interp(np.sort(rng.random(count)), cumulative, grid)
    return start_ms + (fraction * duration_ms).astype(np.int64)


def _load(t: np.ndarray, start_ms: int, duration_ms: int, phase: float) -> np.ndarray:
    """The relative load (rate / mean rate) at times ``t``."""
    fraction = (t - start_ms) / duration_ms
    return 1.0 + 0.6 * np.sin(2 * np.pi * (fraction - 0.375 + phase))


def _lateness(rng, t, slow: bool, start_ms, duration_ms, phase) -> np.ndarray:
    """How late each fire is (ms, >= 0): grows with load; slow hosts much more."""
    size = len(t)
    load = _load(t, start_ms, duration_ms, phase)
    if slow:
        base = rng.exponential(15.0, size) * load**2
        pause = rng.random(size) < 0.01
        spikes = rng.uniform(100, 2000, size)
    else:
        base = rng.exponential(1.2, size) * load
        pause = rng.random(size) < 0.002
        spikes = rng.uniform(20, 250, size)
    return np.floor(base + np.where(pause, spikes, 0.0)).astype(np.int64)


def _ack_delay(rng, size) -> np.ndarray:
    return rng.integers(0, 4, size)


def _expand(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For per-item ``counts``: (item index, 0-based rank within the item) of every repeat."""
    counts = counts.astype(np.int64)
    owner = np.repeat(np.arange(len(counts)), counts)
    starts = np.cumsum(counts) - counts
    rank = np.arange(counts.sum()) - np.repeat(starts, counts)
    return owner, rank


def _fires(events: _Events, rng, op, deadline, slow, start_ms, duration_ms, phase) -> None:
    lat = _lateness(rng, deadline, slow, start_ms, duration_ms, phase)
    fired = deadline + lat
    events.add(op, fired, FIRE, deadline, lat=lat)
    events.add(op, fired + _ack_delay(rng, len(op)), ACK, deadline)


def _simulate_conns(events, rng, op, t0, slow, start_ms, duration_ms, phase) -> None:
    size = len(op)
    idle = rng.choice(np.array([10_000, 30_000, 60_000]), size, p=[0.2, 0.6, 0.2])
    life = np.clip(rng.lognormal(math.log(90_000), 1.2, size), 1_000, 6 * 3_600_000).astype(np.int64)
    life[rng.random(size) < 0.05] = 0  # never touched
    last_activity = t0 + life
    lag = rng.integers(0, 2_000, size)  # how long before each due time the last touch was
    step = idle - lag
    closes = (rng.random(size) < 0.55) & (life > 0)
    events.add(op, t0, ADD, t0 + idle)
    # idle_rearms on the regular grid D_j = t0 + idle + j*step: the daemon finds a
    # touch (lag ms old) each time the deadline comes while the client is active
    first_due = t0 + idle
    grid_count = np.where(
        closes,
        np.maximum(0, np.ceil((last_activity - first_due) / step)),  # D_j < close time
        np.maximum(0, np.floor((last_activity + lag - first_due) / step) + 1),  # D_j - lag <= last activity
    ).astype(np.int64)
    grid_count[life == 0] = 0
    owner, rank = _expand(grid_count)
    due = first_due[owner] + rank * step[owner]
    moved_to = due - lag[owner] + idle[owner]
    events.add(op[owner], due, IDLE_REARM, moved_to, pd=due)
    current = first_due + grid_count * step  # the deadline pending after the grid rearms
    # clean close: the client cancels at its last activity
    events.add(op[closes], last_activity[closes], CANCEL, current[closes], pd=current[closes])
    # idle: one last move to last activity + idle (if touched since), then it fires
    idle_out = ~closes
    touched_since = idle_out & (life > 0) & (last_activity > current - idle)
    final_deadline = np.where(touched_since, last_activity + idle, current)
    events.add(op[touched_since], current[touched_since], IDLE_REARM, final_deadline[touched_since],
               pd=current[touched_since])
    _fires(events, rng, op[idle_out], final_deadline[idle_out], slow, start_ms, duration_ms, phase)
    return idle


def _simulate_purgatory(events, rng, op, t0, slow, start_ms, duration_ms, phase) -> None:
    size = len(op)
    timeout = rng.choice(np.array([200, 500, 1_000, 5_000]), size, p=[0.3, 0.4, 0.2, 0.1])
    deadline = t0 + timeout
    completion = np.maximum(1, rng.lognormal(math.log(15), 1.5, size)).astype(np.int64)
    events.add(op, t0, ADD, deadline)
    early = completion < timeout
    events.add(op[early], t0[early] + completion[early], CANCEL, deadline[early], pd=deadline[early])
    late_ops = ~early
    lat = _lateness(rng, deadline[late_ops], slow, start_ms, duration_ms, phase)
    fired = deadline[late_ops] + lat
    events.add(op[late_ops], fired, FIRE, deadline[late_ops], lat=lat)
    events.add(op[late_ops], fired + _ack_delay(rng, len(fired)), ACK, deadline[late_ops])
    # a completion that lost the race still tries to cancel: a miss
    raced = rng.random(len(fired)) < 0.2
    events.add(op[late_ops][raced], fired[raced] + rng.integers(1, 50, raced.sum()), CANCEL_MISS,
               deadline[late_ops][raced])


def _simulate_jobs(events, rng, op, t0, slow, start_ms, duration_ms, phase) -> None:
    size = len(op)
    delay = np.clip(rng.lognormal(math.log(300_000), 1.5, size), 1_000, 12 * 3_600_000).astype(np.int64)
    deadline = t0 + delay
    events.add(op, t0, ADD, deadline)
    choice = rng.random(size)
    rescheduled = choice < 0.10
    cancelled = (choice >= 0.10) & (choice < 0.15)
    moved_at = t0 + (delay * rng.uniform(0.1, 0.9, size)).astype(np.int64)
    new_deadline = moved_at + np.clip(rng.lognormal(math.log(300_000), 1.0, size), 1_000,
                                      12 * 3_600_000).astype(np.int64)
    events.add(op[rescheduled], moved_at[rescheduled], REARM, new_deadline[rescheduled], pd=deadline[rescheduled])
    final = np.where(rescheduled, new_deadline, deadline)
    events.add(op[cancelled], moved_at[cancelled], CANCEL, deadline[cancelled], pd=deadline[cancelled])
    fires = ~cancelled
    _fires(events, rng, op[fires], final[fires], slow, start_ms, duration_ms, phase)


def _simulate_leases(events, rng, op, t0, slow, start_ms, duration_ms, phase) -> None:
    size = len(op)
    ttl = 10_000
    renewals = rng.geometric(1 / 10, size) - 1
    period = rng.integers(2_500, 3_500, size)
    events.add(op, t0, ADD, t0 + ttl)
    owner, rank = _expand(renewals)
    renew_at = t0[owner] + (rank + 1) * period[owner]
    events.add(op[owner], renew_at, REARM, renew_at + ttl, pd=renew_at - period[owner] + ttl)
    last_arm = t0 + renewals * period
    current = last_arm + ttl
    released = rng.random(size) < 0.85
    release_at = last_arm + rng.integers(1, 3_000, size)
    events.add(op[released], release_at[released], CANCEL, current[released], pd=current[released])
    expired = ~released
    _fires(events, rng, op[expired], current[expired], slow, start_ms, duration_ms, phase)


def _simulate(rng, ops: int, start_ms: int, duration_ms: int, phase: float, slow: bool):
    t0 = _arrivals(rng, ops, start_ms, duration_ms, phase)
    group = rng.choice(len(GROUPS), ops, p=GROUP_MIX).astype(np.int8)
    idle_of_op = np.zeros(ops, dtype=np.int64)
    events = _Events()
    for index, simulate in ((CONNS, _simulate_conns), (PURGATORY, _simulate_purgatory), (JOBS, _simulate_jobs),
                            (LEASES, _simulate_leases)):
        op = np.flatnonzero(group == index)
        idle = simulate(events, rng, op, t0[op], slow, start_ms, duration_ms, phase)
        if idle is not None:
            idle_of_op[op] = idle
    return t0, group, idle_of_op, events.columns()


def _apply_outage(rng, columns, t0, down_ms: int, up_ms: int) -> dict[str, np.ndarray]:
    """Rewrite the events caught by an outage [down_ms, up_ms) (see module docstring)."""
    t = columns["t"]
    op = columns["op"]
    alive = (t0[op] < down_ms) | (t0[op] >= up_ms)  # ops that would arrive during the outage never happen
    order = np.lexsort((columns["kind"], t, op))
    keep = np.ones(len(t), dtype=bool)
    keep[~alive] = False
    in_window = alive & (t >= down_ms) & (t < up_ms)
    affected_ops = np.unique(op[in_window])
    # position of the first in-window event of each affected op, in (op, t) order
    sorted_op = op[order]
    sorted_in_window = in_window[order]
    new_rows = []
    for op_id in affected_ops.tolist():
        lo = np.searchsorted(sorted_op, op_id, "left")
        hi = np.searchsorted(sorted_op, op_id, "right")
        rows = order[lo:hi]
        first = rows[np.argmax(sorted_in_window[lo:hi])]
        kind = columns["kind"][first]
        later = rows[columns["t"][rows] >= columns["t"][first]]
        if kind in (ACK, CANCEL_MISS):
            # the timer had fired: delivery (or the vain cancel) happens after the restart
            for offset, row in enumerate(later):
                columns["t"][row] = max(columns["t"][row], up_ms + 1 + offset)
            continue
        # the timer was pending when the daemon went down
        pending_deadline = columns["d"][first] if kind == FIRE else columns["pd"][first]
        keep[later] = False
        if pending_deadline < up_ms:
            fired = up_ms + int(rng.integers(50, 500))
            late = True
        else:
            fired = pending_deadline + int(rng.integers(0, 3))
            late = False
        new_rows.append((op_id, fired, FIRE, pending_deadline, 0, fired - pending_deadline, late))
        new_rows.append((op_id, fired + 1 + int(rng.integers(0, 3)), ACK, pending_deadline, 0, 0, False))
    result = {name: values[keep] for name, values in columns.items()}
    if new_rows:
        extra = np.array(new_rows, dtype=np.int64)
        for index, name in enumerate(_Events.COLUMNS):
            values = extra[:, index]
            result[name] = np.concatenate((result[name], values.astype(result[name].dtype)))
    return result


def _order_and_seq(columns, count: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Sort events by time and assign the arming seqs; keep the first ``count``."""
    order = np.lexsort((columns["op"], columns["kind"], columns["t"]))[:count]
    columns = {name: values[order] for name, values in columns.items()}
    kind = columns["kind"]
    op = columns["op"]
    new_seq = (kind == ADD) | (kind == REARM) | (kind == CANCEL) | (kind == CANCEL_MISS)
    counter = np.cumsum(new_seq)
    # fire/ack/idle_rearm carry the seq of the latest add/rearm of their op
    arming = (kind == ADD) | (kind == REARM)
    by_op = np.lexsort((np.arange(len(op)), op))
    big = np.int64(1) << 32
    tagged = np.where(arming, op * big + counter, 0)[by_op]
    filled = np.maximum.accumulate(tagged) - op[by_op] * big
    armed_seq = np.empty_like(filled)
    armed_seq[by_op] = filled
    seq = np.where(new_seq, counter, armed_seq)
    return columns, seq


# --------------------------------------------------------------------------- #
# Writing (the daemon's own writer and encoder)
# --------------------------------------------------------------------------- #


class _SimClock:
    def __init__(self, wall_ms: int, mono_ms: int) -> None:
        self.wall = wall_ms
        self.mono_offset = mono_ms - wall_ms

    def wall_ms(self) -> int:
        return self.wall

    def mono_ms(self) -> int:
        return self.wall + self.mono_offset


def _keys(group: np.ndarray, host_index: int) -> list:
    """The journal form of every operation's key."""
    keys: list = [None] * len(group)
    for op_id, group_index in enumerate(group.tolist()):
        if group_index == CONNS:
            keys[op_id] = f"conn-{op_id}"
        elif group_index == PURGATORY:
            keys[op_id] = f"req-{op_id}"
        elif group_index == JOBS:
            keys[op_id] = host_index * 1_000_000_000 + op_id
        else:
            keys[op_id] = key_to_json(b"L" + op_id.to_bytes(5, "big"))
    return keys


def _open_journal(directory: Path, host: str, segment_bytes: int, next_lsn: int, clock: _SimClock) -> Journal:
    """The journal a (simulated) daemon process writes, with the daemon's own writer."""
    return Journal(directory, fsync="off", segment_bytes=segment_bytes, host=host, name=DAEMON_NAME,
                   next_lsn=next_lsn, wall_ms=clock.wall_ms, mono_ms=clock.mono_ms)


class _Writer:
    """One host's journal as its daemon writes it: batches of events, appended with the
    daemon's own writer; a restart (new process, new segment, the monotonic clock
    starting again near zero) when the time of the next line reaches ``restart_at``."""

    def __init__(self, directory: Path, host: str, segment_bytes: int, start_ms: int, restart_at: int | None,
                 rng) -> None:
        self.directory, self.host, self.segment_bytes, self.rng = directory, host, segment_bytes, rng
        self.clock = _SimClock(start_ms, int(rng.integers(3_600_000, 90 * 86_400_000)))
        self.journal = _open_journal(directory, host, segment_bytes, 1, self.clock)
        self.restart_at = restart_at
        self.batch: list = []

    def at(self, t: int) -> None:
        """The next line happens at ``t``: restart the daemon first if its outage ended."""
        if self.restart_at is not None and t >= self.restart_at:
            self.flush(header_time=False)
            self.journal.close()
            self.clock = _SimClock(self.restart_at, int(self.rng.integers(20_000, 60_000)))
            self.journal = _open_journal(self.directory, self.host, self.segment_bytes, self.journal.last_lsn + 1,
                                         self.clock)
            self.restart_at = None

    @property
    def next_lsn(self) -> int:
        return self.journal.last_lsn + len(self.batch) + 1

    def flush(self, header_time: bool = True) -> None:
        if self.batch:
            if header_time:
                self.clock.wall = self.batch[0].t  # a new segment's header carries the time it opened
            self.journal.append(self.batch)
            self.batch.clear()

    def sample(self, sample: tuple) -> None:
        """A replication sample (:func:`_replication_samples`); its replicated lsn is what its
        lag leaves of the lines before it (0 while the daemon had not connected yet)."""
        t, state, epoch, lag, lag_ms = sample
        self.at(t)
        rlsn = 0 if state == "connecting" else max(0, self.next_lsn - 1 - lag)
        self.batch.append(Repl(t=t, host=self.host, epoch=epoch, state=state, rlsn=rlsn, lag=lag, lag_ms=lag_ms))


def _write(directory: Path, host: str, columns, seq, group, idle_of_op, keys, outage, rng, segment_bytes,
           start_ms, samples: list | None = None) -> None:
    ops, times, kinds, deadlines, previous, lateness, lates = (
        columns[name].tolist() for name in ("op", "t", "kind", "d", "pd", "lat", "late"))
    seqs = seq.tolist()
    group_names = [GROUPS[index] for index in group.tolist()]
    idle_values = idle_of_op.tolist()
    writer = _Writer(directory, host, segment_bytes, start_ms, outage[1] if outage else None, rng)
    samples = samples or []
    next_sample = 0
    batch = writer.batch
    append = batch.append
    for index in range(len(ops)):
        t = times[index]
        while next_sample < len(samples) and samples[next_sample][0] <= t:  # a sample goes before a later event
            writer.sample(samples[next_sample])
            next_sample += 1
        writer.at(t)
        op = ops[index]
        kind = kinds[index]
        g = group_names[op]
        k = keys[op]
        if kind == ADD:
            idle = idle_values[op]
            if idle:
                append(Add(t=t, g=g, k=k, d=deadlines[index], s=seqs[index], i=idle))
            else:
                append(Add(t=t, g=g, k=k, d=deadlines[index], s=seqs[index]))
        elif kind == CANCEL:
            append(Cancel(t=t, g=g, k=k, s=seqs[index], hit=True, pd=previous[index]))
        elif kind == FIRE:
            idle = idle_values[op]
            if idle:
                append(Fire(t=t, g=g, k=k, d=deadlines[index], s=seqs[index], f=t, late=lates[index],
                            lat=lateness[index], i=idle))
            else:
                append(Fire(t=t, g=g, k=k, d=deadlines[index], s=seqs[index], f=t, late=lates[index],
                            lat=lateness[index]))
        elif kind == ACK:
            append(Ack(t=t, g=g, k=k, s=seqs[index]))
        elif kind == IDLE_REARM:
            append(IdleRearm(t=t, g=g, k=k, d=deadlines[index], pd=previous[index], s=seqs[index], i=idle_values[op]))
        elif kind == REARM:
            append(Rearm(t=t, g=g, k=k, d=deadlines[index], pd=previous[index], s=seqs[index]))
        else:  # CANCEL_MISS
            append(Cancel(t=t, g=g, k=k, s=seqs[index], hit=False))
        if len(batch) >= BATCH_EVENTS:
            writer.flush()
    for sample in samples[next_sample:]:  # a fenced daemon's last samples, after its last event
        writer.sample(sample)
    writer.flush()
    writer.journal.close()


# --------------------------------------------------------------------------- #
# Replication samples (the ``repl`` events of a daemon run with --replicate)
# --------------------------------------------------------------------------- #


def _state_changes(rng, start: int, end: int) -> list[tuple[int, str]]:
    """(time, state) where one daemon run's replication changes state: connecting at its start,
    replicating once connected, and a few outages of the cluster (behind) between."""
    connected = start + int(rng.uniform(150, 2_500))
    changes = [(start, "connecting"), (connected, "replicating")]
    span = max(0, end - connected)
    outages = rng.poisson(REPL_OUTAGES_PER_DAY * span / DAY_MS)
    at = np.sort(connected + rng.uniform(0, span, outages).astype(np.int64)).tolist()
    lengths = np.clip(rng.lognormal(math.log(20_000), 1.2, outages), 2_000, 15 * 60_000).astype(np.int64).tolist()
    for began, length in zip(at, lengths):
        if began <= changes[-1][0]:
            continue  # inside the previous outage
        changes += [(began, "behind"), (began + length, "replicating")]
    return changes


def _run_samples(rng, times: np.ndarray, start: int, end: int, epoch: int) -> list[tuple]:
    """The samples of one daemon run from ``start`` to ``end``: one at every change of state,
    otherwise every REPL_EVERY_MS (as the daemon's Recorder writes them)."""
    changes = _state_changes(rng, start, end)
    samples = []
    at, change = start, 0
    while at <= end:
        while change + 1 < len(changes) and changes[change + 1][0] <= at:
            change += 1
        since, state = changes[change]
        before = int(np.searchsorted(times, at, "left"))  # the events journaled before this sample
        if state == "replicating":  # a batch or two in flight
            delay = int(rng.lognormal(math.log(3), 0.8)) + 1
            lag = before - int(np.searchsorted(times, at - delay, "left"))
            lag_ms = delay if lag else 0
        elif state == "connecting":  # the first snapshot and what followed it wait for the stream
            lag = before - int(np.searchsorted(times, since, "left")) + 1
            lag_ms = at - since
        else:  # behind: nothing stored since the cluster went out of reach (the last store a bit before)
            lag = before - int(np.searchsorted(times, since, "left")) + 1
            lag_ms = at - since + int(rng.integers(1, 50))
        samples.append((at, state, 0 if state == "connecting" else epoch, lag, lag_ms))
        next_change = changes[change + 1][0] if change + 1 < len(changes) else None
        at = at + REPL_EVERY_MS if next_change is None else min(at + REPL_EVERY_MS, next_change)
    return samples


def _replication_samples(rng, times: np.ndarray, outage, fenced: bool) -> list[tuple]:
    """(t, state, epoch, lag, lag_ms) of every replication sample of a host whose timer events
    happen at ``times``: each daemon run (two with an outage: a crash, no last sample) claims
    the next lease epoch; a ``fenced`` host is paused after its last event, past its lease,
    and finds on resuming that a peer took its timers over (a sample at once, and the
    last one as it stands down)."""
    if not len(times):
        return []
    first, last = int(times[0]), int(times[-1])
    runs = [(first, last)]
    if outage is not None and outage[0] <= last:
        runs = [(first, outage[0] - 1)] + ([(outage[1], last)] if last >= outage[1] else [])
    samples: list[tuple] = []
    for epoch, (start, end) in enumerate(runs, 1):
        samples += _run_samples(rng, times, start, end, epoch)
    if fenced:
        resumed = last + int(rng.uniform(12_000, 40_000))
        epoch = len(runs)
        samples.append((resumed, "fenced", epoch, 1, resumed - last))
        samples.append((resumed + int(rng.integers(1, 20)), "fenced", epoch, 1, resumed - last))
    return samples


def _events_per_op(rng_seed: int, start_ms: int, duration_ms: int) -> float:
    """Average events per operation, from a pilot simulation."""
    rng = np.random.default_rng(rng_seed)
    pilot_ops = 20_000
    _, _, _, columns = _simulate(rng, pilot_ops, start_ms, duration_ms, 0.0, False)
    inside = columns["t"] < start_ms + duration_ms
    return inside.sum() / pilot_ops


def generate_host(
    directory: str | os.PathLike[str],
    host: str,
    events: int,
    seed: int | np.random.SeedSequence,
    slow: bool = False,
    restart: bool = False,
    start_wall_ms: int = DEFAULT_START_WALL_MS,
    duration_ms: int = DAY_MS,
    segment_bytes: int = DEFAULT_SEGMENT_BYTES,
    host_index: int = 0,
    torn_tail: bool = False,
    replicated: bool = False,
    fenced: bool = False,
) -> dict:
    """Write one host's journal (exactly ``events`` timer events) into ``directory``;
    ``replicated``: with the replication samples of a daemon run with ``--replicate``
    (``fenced``: taken over by a peer after its last event)."""
    rng = np.random.default_rng(seed)
    directory = Path(directory)
    prepare_directory(directory)  # a journal directory as the daemon makes one (0750), not the umask's
    phase = float(rng.uniform(-0.03, 0.03))
    per_op = _events_per_op(int(rng.integers(2**31)), start_ms=start_wall_ms, duration_ms=duration_ms)
    outage = None
    if restart:
        down = start_wall_ms + int(rng.uniform(0.15, 0.85) * duration_ms)
        outage = (down, down + int(rng.integers(2 * 60_000, 20 * 60_000)))
    columns = None
    ops = max(16, int(events / per_op * 1.05) + 16)
    for _ in range(6):  # grow until the day holds enough events (rarely needed)
        t0, group, idle_of_op, columns = _simulate(rng, ops, start_wall_ms, duration_ms, phase, slow)
        if outage:
            columns = _apply_outage(rng, columns, t0, *outage)
        if len(columns["t"]) >= events:
            break
        ops = int(ops * 1.3) + 16
    columns, seq = _order_and_seq(columns, events)
    keys = _keys(group, host_index)
    samples = None
    if replicated:
        samples = _replication_samples(np.random.default_rng(int(rng.integers(2**63))), columns["t"], outage, fenced)
    _write(directory, host, columns, seq, group, idle_of_op, keys, outage, rng, segment_bytes, start_wall_ms,
           samples)
    if torn_tail:
        # a copy taken while the daemon was writing: the last line is cut short
        last = sorted(directory.glob("journal-*.jsonl"))[-1]
        size = last.stat().st_size
        with open(last, "r+b") as file:
            file.truncate(size - int(rng.integers(2, 40)))
    return {
        "events": int(len(columns["t"])),
        "slow": slow,
        "outage_ms": list(outage) if outage else None,
        "first_t": int(columns["t"][0]) if len(columns["t"]) else None,
        "last_t": int(columns["t"][-1]) if len(columns["t"]) else None,
        "repl_samples": len(samples or ()),
    }


def _generate_host_job(arguments: dict) -> tuple[str, dict]:
    return arguments["host"], generate_host(**arguments)


def generate_fleet(
    out_dir: str | os.PathLike[str],
    hosts: int = 8,
    events_per_host: int = 100_000,
    seed: int = 0,
    slow_hosts: int = 1,
    start_wall_ms: int = DEFAULT_START_WALL_MS,
    restart_fraction: float = 0.25,
    duration_ms: int = DAY_MS,
    segment_bytes: int = DEFAULT_SEGMENT_BYTES,
    torn_tail_hosts: int = 0,
    workers: int = 1,
    progress: bool = False,
    replicated_hosts: int = 0,
    fenced_hosts: int = 0,
) -> FleetInfo:
    """Write ``hosts`` folders ``host-000``... under ``out_dir``, each one host's journal.

    ``slow_hosts`` hosts (chosen by the seed) fire later; about
    ``restart_fraction`` of the hosts have one outage; ``torn_tail_hosts``
    hosts end with a cut-off last line (a copy taken mid-write);
    ``replicated_hosts`` hosts run with ``--replicate`` (their journals hold
    replication samples), ``fenced_hosts`` of them are taken over by a peer
    at the end. The same arguments always give the same bytes.
    """
    if hosts < 1 or events_per_host < 1 or not 0 <= slow_hosts <= hosts:
        raise ValueError("need hosts >= 1, events_per_host >= 1 and 0 <= slow_hosts <= hosts")
    if not 0 <= fenced_hosts <= replicated_hosts <= hosts:
        raise ValueError("need 0 <= fenced_hosts <= replicated_hosts <= hosts")
    started = time.perf_counter()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    root = np.random.default_rng(seed)
    names = [f"host-{index:03d}" for index in range(hosts)]
    slow = set(root.choice(hosts, slow_hosts, replace=False).tolist()) if slow_hosts else set()
    restarted = set(np.flatnonzero(root.random(hosts) < restart_fraction).tolist())
    torn = set(root.choice(hosts, min(torn_tail_hosts, hosts), replace=False).tolist()) if torn_tail_hosts else set()
    replicated = root.choice(hosts, replicated_hosts, replace=False).tolist() if replicated_hosts else []
    fenced = set(replicated[:fenced_hosts])
    seeds = np.random.SeedSequence(seed).spawn(hosts)
    common = {"events": events_per_host, "start_wall_ms": start_wall_ms, "duration_ms": duration_ms,
              "segment_bytes": segment_bytes}
    jobs = [
        {"directory": out_dir / name, "host": name, "seed": seeds[index], "slow": index in slow,
         "restart": index in restarted, "host_index": index, "torn_tail": index in torn,
         "replicated": index in replicated, "fenced": index in fenced, **common}
        for index, name in enumerate(names)
    ]
    info = FleetInfo(
        out_dir=out_dir, hosts=names, slow_hosts=[names[index] for index in sorted(slow)],
        restarted_hosts=[names[index] for index in sorted(restarted)], events_per_host=events_per_host, seed=seed,
        start_wall_ms=start_wall_ms, replicated_hosts=[names[index] for index in sorted(replicated)],
        fenced_hosts=[names[index] for index in sorted(fenced)],
    )
    with contextlib.ExitStack() as stack:
        pool = stack.enter_context(concurrent.futures.ProcessPoolExecutor(workers)) if workers > 1 else None
        results = pool.map(_generate_host_job, jobs) if pool is not None else map(_generate_host_job, jobs)
        for done, (name, summary) in enumerate(results, 1):
            info.per_host[name] = summary
            if progress:
                elapsed = time.perf_counter() - started
                rate = done * events_per_host / elapsed if elapsed else 0
                print(f"  {done}/{hosts} hosts ({name}), {rate / 1e3:.0f}k events/s", file=sys.stderr, flush=True)
    for name in names:
        for path in (out_dir / name).glob("journal-*.jsonl"):
            info.bytes_written += path.stat().st_size
            info.segments += 1
    info.seconds = time.perf_counter() - started
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m wheeld.pipeline.generate", description="Write realistic wheeld fleet journals."
    )
    parser.add_argument("out", help="output directory (one folder per host is created in it)")
    parser.add_argument("--hosts", type=int, default=8)
    parser.add_argument("--events", type=int, default=1_000_000, help="events in the whole fleet (split evenly)")
    parser.add_argument("--events-per-host", type=int, default=None, help="overrides --events")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slow-hosts", type=int, default=None, help="default: about one host in eight")
    parser.add_argument("--restart-fraction", type=float, default=0.25)
    parser.add_argument("--torn-tail-hosts", type=int, default=0)
    parser.add_argument("--replicated-hosts", type=int, default=0, help="hosts run with --replicate (repl samples)")
    parser.add_argument("--fenced-hosts", type=int, default=0, help="replicated hosts a peer takes over at the end")
    parser.add_argument("--start-wall-ms", type=int, default=DEFAULT_START_WALL_MS)
    parser.add_argument("--segment-mib", type=float, default=DEFAULT_SEGMENT_BYTES / (1 << 20))
    parser.add_argument("--workers", type=int, default=1, help="processes (one host each at a time)")
    args = parser.parse_args(argv)
    per_host = args.events_per_host or max(1, args.events // args.hosts)
    slow_hosts = args.slow_hosts if args.slow_hosts is not None else max(1, args.hosts // 8)
    info = generate_fleet(
        args.out,
        hosts=args.hosts,
        events_per_host=per_host,
        seed=args.seed,
        slow_hosts=min(slow_hosts, args.hosts),
        start_wall_ms=args.start_wall_ms,
        restart_fraction=args.restart_fraction,
        segment_bytes=int(args.segment_mib * (1 << 20)),
        torn_tail_hosts=args.torn_tail_hosts,
        replicated_hosts=min(args.replicated_hosts, args.hosts),
        fenced_hosts=min(args.fenced_hosts, args.replicated_hosts, args.hosts),
        workers=args.workers,
        progress=True,
    )
    total = per_host * args.hosts
    print(
        f"wrote {total:,} events for {args.hosts} hosts in {info.segments} segments, "
        f"{info.bytes_written / 1e6:.1f} MB ({info.bytes_written / total:.0f} B/event), "
        f"{info.seconds:.1f} s ({total / info.seconds / 1e3:.0f}k events/s) to {info.out_dir}; "
        f"slow: {', '.join(info.slow_hosts) or '-'}; restarted: {', '.join(info.restarted_hosts) or '-'}"
        + (f"; replicated: {', '.join(info.replicated_hosts)}" if info.replicated_hosts else "")
        + (f" (fenced: {', '.join(info.fenced_hosts)})" if info.fenced_hosts else "")
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
