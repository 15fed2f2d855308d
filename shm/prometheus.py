"""Prometheus metrics: the text exposition (format 0.0.4) of a snapshot, written by hand.

``wheelctl stats --prometheus`` prints it from the arena (for node_exporter's
textfile collector, or when the daemon is stuck), and ``wheeld --metrics
ADDR:PORT`` serves it (:mod:`wheeld.daemon.metrics`). Both render a
:class:`wheeld.shm.snapshot.Snapshot` with :func:`render`, so the two never
disagree on names.

No ``prometheus_client``: the format is a few ``# HELP`` / ``# TYPE`` lines and
``name{labels} value`` samples, and rendering it from the header costs
microseconds. The tests parse it with ``prometheus_client``'s parser.

Names follow the Prometheus conventions: prefix ``wheeld_``, base units
(seconds, bytes), ``_total`` on counters; no label carries a timer key, a pid
or a client slot (unbounded cardinality). The only labels are ``level`` on
pending timers (at most 15 levels plus ``due``) and ``le`` on the histogram.

=====================================  =========  ======================================
metric                                 type       arena counter
=====================================  =========  ======================================
wheeld_timers_pending                  gauge      pending
wheeld_timers_pending_by_level{level}  gauge      pending_level_N, pending_due ("due")
wheeld_timers_added_total              counter    adds_total
wheeld_timers_rearmed_total            counter    rearms_total
wheeld_timers_cancelled_total          counter    cancels_total
wheeld_cancel_misses_total             counter    cancel_misses_total
wheeld_timers_expired_total            counter    expirations_total
wheeld_timers_idle_rearmed_total       counter    idle_rearms_total
wheeld_timers_cascaded_total           counter    cascades_total
wheeld_expirations_delivered_total     counter    delivered_total
wheeld_expirations_redelivered_total   counter    redelivered_total
wheeld_expirations_late_total          counter    late_total
wheeld_expirations_acknowledged_total  counter    acks_total
wheeld_expirations_undelivered         gauge      undelivered
wheeld_expirations_unacknowledged      gauge      fired_unacked - undelivered
wheeld_fire_lateness_seconds           histogram  lateness buckets and sum
wheeld_commands_total                  counter    commands_total
wheeld_commands_rejected_total         counter    rejected_total
wheeld_arena_full_total                counter    arena_full_total
wheeld_ring_full_total                 counter    ring_full_total
wheeld_ring_depth                      gauge      rings' tail - head, summed
wheeld_rings                           gauge      client slots in use
wheeld_clients_connected               gauge      clients_connected
wheeld_clients_accepted_total          counter    clients_total
wheeld_clients_refused_total           counter    clients_refused_total
wheeld_clients_dropped_total           counter    clients_dropped_total
wheeld_groups_active                   gauge      groups_active
wheeld_groups_registered               gauge      group table entries with a name
wheeld_groups_in_use                   gauge      group ids in use (see below)
wheeld_groups_max                      gauge      header max_groups
wheeld_arena_capacity_timers           gauge      header capacity
wheeld_arena_used_timers               gauge      pending + fired_unacked
wheeld_arena_bytes                     gauge      segment size
wheeld_tick_seconds                    gauge      header tick_ms
wheeld_wakeups_total                   counter    wakeups_total
wheeld_daemon_restarts_total           counter    daemon_restarts_total
wheeld_journal_damaged_ranges_total    counter    journal_damaged_ranges_total
wheeld_journal_damaged_lines_total     counter    journal_damaged_lines_total
wheeld_journal_writable                gauge      journal_stalled == 0
wheeld_journal_stalls_total            counter    journal_stalls_total
wheeld_journal_unwritten_events_total  counter    journal_unwritten_events_total
wheeld_journal_flushes_refused_total   counter    journal_flushes_refused_total
wheeld_arena_damaged_records_total     counter    arena_damaged_records_total
wheeld_arena_timers_lost_total         counter    arena_timers_lost_total
wheeld_fleet_state{state=...}          gauge      1, labelled by fleet_state (--replicate only)
wheeld_fleet_lag_records               gauge      fleet_lag_records
wheeld_fleet_lag_seconds               gauge      fleet_lag_ms
wheeld_daemon_up                       gauge      1 if the daemon process exists
wheeld_daemon_heartbeat_age_seconds    gauge      now - daemon_heartbeat_ms
wheeld_daemon_uptime_seconds           gauge      now - daemon_started_ms
wheeld_build_info{hot_path=...}        gauge      1, labelled by daemon_hot_path
=====================================  =========  ======================================

Histogram buckets: ``le`` is each bound of
:data:`~wheeld.protocol.arena_layout.LATENESS_BOUNDS_US` in seconds, the counts
cumulative, ``+Inf`` equal to ``_count``. The arena counts bucket *i* as
``[bound[i-1], bound[i])``, so a lateness exactly on a bound is counted one
bucket up: the ``le`` buckets never overstate how many timers were on time.

Group ids in use are those a new group name cannot take: a name is registered
under them, or (``wheelctl``, which reads the records) a live record carries
them. When ``wheeld_groups_in_use`` reaches ``wheeld_groups_max``, new group
names are refused (``GroupLimit``).
"""

from __future__ import annotations

import math

from wheeld.protocol import arena_layout as L

from .snapshot import Snapshot

__all__ = ["CONTENT_TYPE", "render"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (metric name, type, help, counter name in the arena)
_COUNTERS = (
    ("wheeld_timers_added_total", "New timers scheduled.", "adds_total"),
    ("wheeld_timers_rearmed_total", "Schedules of a key that was already pending (re-arms).", "rearms_total"),
    ("wheeld_timers_cancelled_total", "Cancels that removed a pending timer.", "cancels_total"),
    ("wheeld_cancel_misses_total", "Cancels of a key that was not pending.", "cancel_misses_total"),
    ("wheeld_timers_expired_total", "Timers that came due.", "expirations_total"),
    ("wheeld_timers_idle_rearmed_total", "Idle timers found touched when due and re-armed.", "idle_rearms_total"),
    ("wheeld_timers_cascaded_total", "Timers moved down a wheel level.", "cascades_total"),
    ("wheeld_expirations_delivered_total", "Expirations sent to clients.", "delivered_total"),
    ("wheeld_expirations_redelivered_total", "Expirations sent again after their client died.", "redelivered_total"),
    ("wheeld_expirations_late_total", "Timers fired more than one tick after their deadline.", "late_total"),
    ("wheeld_expirations_acknowledged_total", "Expirations acknowledged by clients.", "acks_total"),
    ("wheeld_commands_total", "Ring commands applied.", "commands_total"),
    ("wheeld_commands_rejected_total", "Commands refused (bad input, arena full).", "rejected_total"),
    ("wheeld_arena_full_total", "Adds refused because the arena was full.", "arena_full_total"),
    ("wheeld_ring_full_total", "Times a client ring was found full.", "ring_full_total"),
    ("wheeld_clients_accepted_total", "Client sessions accepted.", "clients_total"),
    ("wheeld_clients_refused_total", "Client sessions refused (not allowed, bad version, too many).",
     "clients_refused_total"),
    ("wheeld_clients_dropped_total", "Clients disconnected for a protocol violation.", "clients_dropped_total"),
    ("wheeld_wakeups_total", "Times the wheel loop woke from parking.", "wakeups_total"),
    ("wheeld_daemon_restarts_total", "Daemon starts that re-attached an existing arena.", "daemon_restarts_total"),
    ("wheeld_journal_damaged_ranges_total",
     "Damaged journal ranges (bad lines followed by good ones, damaged snapshots, missing events) that recovery "
     "skipped when it rebuilt the arena.", "journal_damaged_ranges_total"),
    ("wheeld_journal_damaged_lines_total", "Journal lines in those damaged ranges.", "journal_damaged_lines_total"),
    ("wheeld_journal_stalls_total", "Times the journal stopped being writable (disk full, I/O error...).",
     "journal_stalls_total"),
    ("wheeld_journal_unwritten_events_total", "Journal events not written while it was not writable (the "
     "snapshot written when it is again covers them).", "journal_unwritten_events_total"),
    ("wheeld_journal_flushes_refused_total", "Flushes answered with JournalUnavailable (not durable).",
     "journal_flushes_refused_total"),
    ("wheeld_arena_damaged_records_total",
     "Arena records found damaged (at attach, or when delivered): repaired, freed, or restored from the journal.",
     "arena_damaged_records_total"),
    ("wheeld_arena_timers_lost_total", "Timers of damaged arena records that nothing could restore.",
     "arena_timers_lost_total"),
)


def _value(value: float | int) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "+Inf" if value > 0 else "-Inf"
        return repr(value)
    return str(int(value))


def _lateness_samples(snap: Snapshot) -> list:
    """The histogram's samples: cumulative ``le`` buckets in seconds, ``+Inf``, sum and count."""
    cumulative = 0
    samples = []
    for bound_us, count in zip(L.LATENESS_BOUNDS_US, snap.lateness_counts):
        cumulative += count
        samples.append(("_bucket", (("le", _value(bound_us / 1e6)),), cumulative))
    total = sum(snap.lateness_counts)
    samples.append(("_bucket", (("le", "+Inf"),), total))
    samples.append(("_sum", (), snap.lateness_sum_us / 1e6))
    samples.append(("_count", (), total))
    return samples


def _fleet_metrics(metric, c: dict) -> None:
    """The replication's gauges (``--replicate`` only: nothing without it)."""
    if not c["fleet_state"]:
        return
    states = L.FLEET_STATES
    state = states[c["fleet_state"]] if c["fleet_state"] < len(states) else str(c["fleet_state"])
    metric("wheeld_fleet_state", "gauge", "The journal's replication to the cluster (--replicate): "
           "connecting, replicating, behind (the cluster out of reach), fenced (another host took over).",
           [("", (("state", state),), 1)])
    metric("wheeld_fleet_lag_records", "gauge", "Journal events the cluster has not stored yet.",
           [("", (), c["fleet_lag_records"])])
    metric("wheeld_fleet_lag_seconds", "gauge", "How long events have waited for the cluster.",
           [("", (), c["fleet_lag_ms"] / 1000)])


def render(snap: Snapshot) -> str:
    """The text exposition (format 0.0.4) of one snapshot."""
    out: list[str] = []

    def metric(name: str, kind: str, text: str, samples) -> None:
        out.append(f"# HELP {name} {text}")
        out.append(f"# TYPE {name} {kind}")
        for suffix, labels, value in samples:
            label_text = "{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}" if labels else ""
            out.append(f"{name}{suffix}{label_text} {_value(value)}")

    c = snap.counters
    metric("wheeld_timers_pending", "gauge", "Timers scheduled and not yet due.", [("", (), c["pending"])])
    metric("wheeld_timers_pending_by_level", "gauge",
           "Pending timers per wheel level (level 0 is the finest; due: waiting for the next advance).",
           [("", (("level", level),), count) for level, count in snap.pending_by_level.items()])
    for name, text, counter in _COUNTERS:
        metric(name, "counter", text, [("", (), c[counter])])
    metric("wheeld_expirations_undelivered", "gauge", "Fired timers waiting for a live member of their group.",
           [("", (), snap.undelivered)])
    metric("wheeld_expirations_unacknowledged", "gauge", "Expirations sent to a client and not acknowledged yet.",
           [("", (), snap.unacknowledged)])
    metric("wheeld_fire_lateness_seconds", "histogram",
           "Time from a timer's deadline to its expiration being handed to delivery.", _lateness_samples(snap))
    depth = snap.ring_depth
    metric("wheeld_ring_depth", "gauge", "Commands waiting in client rings.",
           [("", (), c["ring_depth"] if depth is None else depth)])
    if snap.rings is not None:
        metric("wheeld_rings", "gauge", "Client ring segments in use.", [("", (), len(snap.rings))])
    metric("wheeld_clients_connected", "gauge", "Clients connected now.", [("", (), c["clients_connected"])])
    metric("wheeld_groups_active", "gauge", "Groups with at least one connected member.",
           [("", (), c["groups_active"])])
    metric("wheeld_groups_registered", "gauge", "Group names registered in the arena's group table.",
           [("", (), snap.groups_registered)])
    metric("wheeld_groups_in_use", "gauge", "Group ids in use (a name registered, or live timers carry it).",
           [("", (), snap.groups_in_use)])
    metric("wheeld_groups_max", "gauge", "Group ids in the arena's group table (--max-groups).",
           [("", (), snap.max_groups)])
    metric("wheeld_arena_capacity_timers", "gauge", "Timer records in the arena.", [("", (), snap.capacity)])
    metric("wheeld_arena_used_timers", "gauge", "Timer records in use (pending or fired, not acknowledged).",
           [("", (), snap.used)])
    metric("wheeld_arena_bytes", "gauge", "Size of the arena segment.", [("", (), snap.arena_bytes)])
    metric("wheeld_tick_seconds", "gauge", "Width of a level-0 bucket.", [("", (), snap.tick_ms / 1000)])
    metric("wheeld_journal_writable", "gauge", "0 while the daemon cannot write its journal (flush() fails with "
           "JournalUnavailable), else 1.", [("", (), 0 if c["journal_stalled"] else 1)])
    _fleet_metrics(metric, c)
    metric("wheeld_daemon_up", "gauge", "1 if the daemon process that last wrote the arena exists.",
           [("", (), 1 if snap.daemon_alive else 0)])
    age = snap.heartbeat_age_ms
    if age is not None:
        metric("wheeld_daemon_heartbeat_age_seconds", "gauge", "Time since the wheel loop last published.",
               [("", (), max(0, age) / 1000)])
    if snap.hot_path is not None:
        metric("wheeld_build_info", "gauge", "The daemon's hot path: compiled (Cython) or python (the sources).",
               [("", (("hot_path", snap.hot_path),), 1)])
    uptime = snap.uptime_ms
    if uptime is not None:
        metric("wheeld_daemon_uptime_seconds", "gauge", "Time since the daemon started.",
               [("", (), uptime / 1000)])
    return "\n".join(out) + "\n"
