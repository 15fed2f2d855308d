"""The fleet figures computed in plain Python, line by line: the pipeline's oracle.

The Spark job (:mod:`wheeld.pipeline.job`) and this module read the same
journal files and must produce the same tables. They share only the *format*
(:mod:`wheeld.protocol.journal`: ``line_body`` checks a line's crc, the msgspec
``Event`` union decodes it) and the definitions below; the code paths have
nothing else in common: here a file is ``open().read().split(b"\\n")`` and every
figure is a dict, a sort and an index; there it is a text scan, SQL
expressions, shuffles and Spark's exact ``percentile_disc``. A test that finds
them equal on a generated fleet checks both. It is meant for test-sized data
(a few hundred thousand events), not for the bench.

Definitions (shared with the job; the job's docstring refers here)
==================================================================

Which files
    Every file named ``journal-<16 digits>.jsonl`` under the input path, at
    any depth, skipping names that start with ``.`` or ``_`` (Spark's rule for
    hidden files). Snapshots are not read: they hold state, not events.

Line status, in this order of precedence
    ``torn-tail``            the file does not end with ``\\n`` and this is its
                             last, unterminated piece (the format counts a
                             record only with its newline);
    ``checksum-mismatch``    no ``,"crc":<digits>}`` suffix, or the crc32 of the
                             body differs (``journal.line_body`` returns None);
    ``unsupported-version``  the crc matches but ``"v"`` is present and not 1;
    ``bad-json``             the crc matches but the body is not a version-1
                             event (unknown ``ev``, a required field missing);
    ``header``               a valid ``segment`` header line;
    ``repl``                 a valid ``repl`` event (a replication sample,
                             ``wheeld --replicate``): it counts only in the
                             ``replication`` table;
    ``ok``                   a valid timer event: the only lines the other
                             figures count.

    The pipeline is per line: a bad line is skipped and counted, the lines
    after it still count. (Recovery, in ``wheeld.journal.recovery``, skips a
    bad line too, but its state depends on every event, so it charges the events
    a bad line held to it by their lsns; statistics need no such accounting.)

Host of a segment
    The ``host`` of its header if the file's *first* line is a complete, valid
    segment header. A segment whose header is damaged takes the host named by
    the valid headers of the other segments in its folder (the most frequent,
    then the smallest name), so one bad header does not split a host in two;
    with no valid header in the folder, the folder's name is the host.

Lateness
    ``lat`` of ``fire`` events with ``late`` false: how late the running
    daemon fired. Fires with ``late`` true (overdue after downtime, fired at
    recovery) would put hours of downtime into the percentiles; they are
    counted as ``overdue_fires`` instead.

Percentiles: nearest rank, exact
    ``p(q)`` of n values is the value of rank ``max(1, ceil(n * q))`` (1-based)
    in ascending order, with ``n * q`` a float product. This is Spark's
    ``percentile_disc(q) WITHIN GROUP (ORDER BY x)`` (its non-legacy
    definition: ``ceil(n * q)``), so the two sides agree to the millisecond,
    and every reported figure is a lateness that really occurred. Reported for
    q = 0.5, 0.99, 0.999 and the maximum.

Time buckets
    The charts over time use one bucket width for the whole input, chosen from
    its time span: the narrowest of :data:`BUCKET_WIDTHS_MS` (1, 2, 5, 10, 15,
    30 s; 1, 2, 5, 10, 15, 30 min; 1, 2, 3, 6, 12 h; 1 day) for which the
    buckets from the first to the last timer event or replication sample number at most
    :data:`MAX_BUCKETS` (300); :func:`bucket_width_ms`. A run of a few minutes
    gets 1-2 s buckets, a day 5 min buckets, a week 1 h buckets: 120-300
    points (fewer only for runs shorter than 100 s, never buckets under 1 s).
    ``bucket_ms = t - t mod width``, ``hour_ms = t - t mod 3600000`` (the heat
    map) of the event's wall-clock ``t`` (for a fire, ``t`` is when it
    fired), UTC; the widths divide a day, so buckets start at round times.

Timeout rate (Kafka's purgatory "expiration rate")
    ``fired / (fired + cancelled_hit)``: of the operations that were armed and
    ended, the fraction that timed out instead of completing (a cancel that hit
    a pending timer is an operation that completed before its deadline). All
    fires count, overdue ones too. ``None`` when nothing ended.

Idle churn
    For idle timers (``i`` present): ``idle_rearms`` (the daemon woke for an
    idle deadline and found the key touched, so it moved the timer: the price
    of lazy re-arming) versus ``idle_fires`` (the key really was idle).
    ``rearms_per_fire = idle_rearms / idle_fires``.

Throughput
    Events per time bucket by type; ``*_per_s`` = count / (bucket width in s).

Rankings
    slowest hosts: by p99 desc, then max desc, then host; noisiest groups: by
    all timer events desc, then group.

Replication (the ``replication`` table)
    From the ``repl`` samples a replicating daemon journals (its state, lag
    and epoch at least every 10 s and at every change of state:
    :mod:`wheeld.protocol.journal`). One row per ``host`` (the segment's, as
    everywhere), ``host_id`` (the sample's fleet host id: one per replicating
    daemon) and time bucket of the sample's ``t``. ``state``: the state of
    the bucket's last sample (by ``t``, then lsn); ``worst_state``: the most
    severe state seen, in the order of :data:`REPL_SEVERITY` (replicating,
    stopped, connecting, behind, failed, fenced; a state this reader does not
    know ranks above fenced); ``epoch`` and ``replicated_lsn``: the highest
    seen. Lag percentiles (nearest rank, as for lateness) over the bucket's
    samples: ``lag_p50``/``lag_p99``/``lag_max`` in events,
    ``lag_p50_ms``/``lag_p99_ms``/``lag_max_ms`` in ms. Time in a state
    (``replicating_ms``, ``connecting_ms``, ``behind_ms``, ``failed_ms``,
    ``fenced_ms``): a sample's state holds from its ``t`` until the same
    daemon's next sample (same host and host id, ordered by ``t`` then lsn),
    at most :data:`REPL_HOLD_MS` (twice the period: a daemon that writes no
    sample for that long was not running, was paused, or could not journal),
    never less than 0 (a wall clock stepped back); a daemon's last sample
    holds for 0. The whole of that time counts in the bucket of the sample.
    A fenced daemon stands down at once, so ``fenced_ms`` is the short time
    it took to; ``worst_state`` = fenced marks the bucket.
"""

from __future__ import annotations

import math
import os
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable

import msgspec

from wheeld.protocol import journal

#: Status of a line (see the module docstring); the job uses the same strings.
OK = "ok"
HEADER = "header"
TORN = journal.TORN
CHECKSUM = journal.CHECKSUM
BAD_JSON = journal.BAD_JSON
BAD_VERSION = journal.BAD_VERSION
REPL = "repl"
BAD_STATUSES = (TORN, CHECKSUM, BAD_VERSION, BAD_JSON)

QUANTILES = {"p50_ms": 0.5, "p99_ms": 0.99, "p999_ms": 0.999}
MINUTE_MS = 60_000
HOUR_MS = 3_600_000
#: Bucket widths of the charts over time (ms): each divides a day.
BUCKET_WIDTHS_MS = (
    1_000, 2_000, 5_000, 10_000, 15_000, 30_000,
    60_000, 120_000, 300_000, 600_000, 900_000, 1_800_000,
    3_600_000, 7_200_000, 10_800_000, 21_600_000, 43_200_000, 86_400_000,
)  # fmt: skip
MAX_BUCKETS = 300
TOP_N = 20
#: How long a replication sample's state counts at most (twice the daemon's period).
REPL_HOLD_MS = 2 * journal.REPL_EVERY_MS
#: States of a replication sample, least severe first (``worst_state``); an unknown one ranks above them all.
REPL_SEVERITY = {"replicating": 0, "stopped": 1, "connecting": 2, "behind": 3, "failed": 4, "fenced": 5}
#: Replication states whose time the ``replication`` table sums, and their columns.
REPL_TIME_COLUMNS = (
    ("replicating", "replicating_ms"),
    ("connecting", "connecting_ms"),
    ("behind", "behind_ms"),
    ("failed", "failed_ms"),
    ("fenced", "fenced_ms"),
)
REPL_QUANTILES = {"p50": 0.5, "p99": 0.99}
REPLICATION_COLUMNS = (
    "host", "host_id", "bucket_ms", "samples", "state", "worst_state", "epoch", "replicated_lsn",
    "lag_p50", "lag_p99", "lag_max", "lag_p50_ms", "lag_p99_ms", "lag_max_ms",
    *(column for _, column in REPL_TIME_COLUMNS),
)  # fmt: skip
SEGMENT_FILE_RE = re.compile(r"^journal-\d{16}\.jsonl$")

_event_decoder = msgspec.json.Decoder(journal.Event)
_any_decoder = msgspec.json.Decoder()


def nearest_rank(sorted_values: list[int], quantile: float) -> int | None:
    """The nearest-rank percentile (Spark's ``percentile_disc``) of sorted values."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(len(sorted_values) * quantile))
    return sorted_values[rank - 1]


def bucket_width_ms(first_ms: int | None, last_ms: int | None) -> int:
    """The narrowest width of :data:`BUCKET_WIDTHS_MS` with at most :data:`MAX_BUCKETS` buckets
    from ``first_ms`` to ``last_ms`` (the widest when even that has more; the narrowest when
    there is no event)."""
    if first_ms is None or last_ms is None:
        return BUCKET_WIDTHS_MS[0]
    for width in BUCKET_WIDTHS_MS:
        if last_ms // width - first_ms // width + 1 <= MAX_BUCKETS:
            return width
    return BUCKET_WIDTHS_MS[-1]


def lateness_figures(values: Iterable[int]) -> dict[str, int | None]:
    ordered = sorted(values)
    figures: dict[str, int | None] = {
        name: nearest_rank(ordered, q) for name, q in QUANTILES.items()
    }
    figures["max_ms"] = ordered[-1] if ordered else None
    return figures


def classify(line: bytes, terminated: bool) -> tuple[str, Any]:
    """Status of one line and, for ``ok``/``header``, the decoded event."""
    if not terminated:
        return TORN, None
    body = journal.line_body(line)
    if body is None:
        return CHECKSUM, None
    try:
        raw = _any_decoder.decode(body)
    except msgspec.DecodeError:
        return BAD_JSON, None
    if isinstance(raw, dict) and raw.get("v", journal.JOURNAL_VERSION) != journal.JOURNAL_VERSION:
        return BAD_VERSION, None
    try:
        event = _event_decoder.decode(body)
    except msgspec.DecodeError:
        return BAD_JSON, None
    if type(event) is journal.SegmentHeader:
        return HEADER, event
    if type(event) is journal.Repl:
        return REPL, event
    return OK, event


def segment_files(root: str) -> list[str]:
    """Segment files under ``root`` (a directory or one file), sorted."""
    if os.path.isfile(root):
        return [root]
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "_")))
        for name in names:
            if SEGMENT_FILE_RE.match(name):
                found.append(os.path.join(folder, name))
    return sorted(found)


@dataclass
class SegmentStats:
    segment: str
    host: str
    daemon: str | None
    size_bytes: int
    counts: Counter = field(default_factory=Counter)

    def row(self) -> dict[str, Any]:
        lines = sum(self.counts.values())
        bad = sum(self.counts[s] for s in BAD_STATUSES)
        if self.size_bytes == 0:
            status = "empty"
        elif lines == 0:
            status = "unreadable"
        elif bad:
            status = "damaged"
        else:
            status = "ok"
        return {
            "segment": self.segment,
            "host": self.host,
            "daemon": self.daemon,
            "size_bytes": self.size_bytes,
            "lines": lines,
            "events": self.counts[OK],
            "headers": self.counts[HEADER],
            "repl_samples": self.counts[REPL],
            "torn_tail": self.counts[TORN],
            "checksum_mismatch": self.counts[CHECKSUM],
            "unsupported_version": self.counts[BAD_VERSION],
            "bad_json": self.counts[BAD_JSON],
            "bad_lines": bad,
            "status": status,
        }


def read_segment(path: str) -> tuple[SegmentStats, list[tuple[str, Any]]]:
    """Every line of one file as (status, event), and the file's counts."""
    with open(path, "rb") as file:
        data = file.read()
    pieces = data.split(b"\n")
    tail = pieces.pop()  # b"" when the file ends with a newline
    lines = [(piece, True) for piece in pieces]
    if tail:
        lines.append((tail, False))
    classified = [classify(line, terminated) for line, terminated in lines]
    host = os.path.basename(os.path.dirname(os.path.abspath(path)))  # see compute()
    daemon = None
    if classified and classified[0][0] == HEADER:
        host, daemon = classified[0][1].host, classified[0][1].name
    stats = SegmentStats(os.path.abspath(path), host, daemon, len(data))
    stats.counts.update(status for status, _ in classified)
    return stats, classified


def folder_hosts(headers: Iterable[tuple[str, str | None]]) -> dict[str, str]:
    """folder -> host for segments without a valid header, from (folder, header host) pairs."""
    seen: dict[str, Counter] = defaultdict(Counter)
    for folder, host in headers:
        seen[folder]
        if host is not None:
            seen[folder][host] += 1
    return {
        folder: min(hosts.items(), key=lambda item: (-item[1], item[0]))[0] if hosts else os.path.basename(folder)
        for folder, hosts in seen.items()
    }


def compute(root: str, top_n: int = TOP_N) -> dict[str, list[dict[str, Any]]]:
    """All tables of the job, as lists of row dicts, for the journals under ``root``."""
    read = [read_segment(path) for path in segment_files(root)]
    fallback = folder_hosts(
        (os.path.dirname(stats.segment), stats.host if stats.daemon is not None else None)
        for stats, _ in read
    )
    segments: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    samples: list[dict[str, Any]] = []
    for stats, classified in read:
        if stats.daemon is None:
            stats.host = fallback[os.path.dirname(stats.segment)]
        segments.append(stats.row())
        for status, event in classified:
            if status == OK:
                events.append(_event_row(stats, event))
            elif status == REPL:
                samples.append(_sample_row(stats, event))
    return tables_from_events(events, segments, top_n, samples)


def _event_row(stats: SegmentStats, event: Any) -> dict[str, Any]:
    get = lambda name: getattr(event, name, None)  # noqa: E731 - a tiny accessor
    unset = lambda value: None if value is msgspec.UNSET else value  # noqa: E731
    kind = event.__struct_config__.tag
    return {
        "host": stats.host,
        "daemon": stats.daemon,
        "segment": stats.segment,
        "lsn": event.n,
        "event": kind,
        "t_ms": event.t,
        "group": event.g,
        "key": str(event.k),
        "seq": get("s"),
        "deadline_ms": get("d"),
        "previous_deadline_ms": unset(get("pd")),
        "idle_ms": unset(get("i")),
        "fired_ms": get("f"),
        "lateness_ms": get("lat"),
        "overdue": get("late") if kind == "fire" else None,
        "hit": get("hit"),
    }


def _sample_row(stats: SegmentStats, event: journal.Repl) -> dict[str, Any]:
    return {
        "host": stats.host,
        "host_id": event.host,
        "segment": stats.segment,
        "lsn": event.n,
        "t_ms": event.t,
        "state": event.state,
        "epoch": event.epoch,
        "rlsn": event.rlsn,
        "lag": event.lag,
        "lag_ms": event.lag_ms,
    }


def _lateness_table(fires: list[dict[str, Any]], keys: tuple[str, ...]) -> list[dict[str, Any]]:
    running: dict[tuple, list[int]] = defaultdict(list)
    overdue: Counter = Counter()
    for fire in fires:
        group_key = tuple(fire[k] for k in keys)
        if fire["overdue"]:
            overdue[group_key] += 1
            running.setdefault(group_key, [])
        else:
            running[group_key].append(fire["lateness_ms"])
    rows = []
    for group_key, values in running.items():
        row = dict(zip(keys, group_key))
        row["fires"] = len(values)
        row["overdue_fires"] = overdue[group_key]
        row.update(lateness_figures(values))
        rows.append(row)
    return sorted(rows, key=lambda r: tuple(r[k] for k in keys))


def _bucket(t_ms: int, width_ms: int) -> int:
    return t_ms - t_ms % width_ms


def tables_from_events(
    events: list[dict[str, Any]], segments: list[dict[str, Any]], top_n: int = TOP_N,
    samples: list[dict[str, Any]] | None = None,
) -> dict[str, list[dict[str, Any]]]:
    samples = samples or []
    times = [row["t_ms"] for row in (*events, *samples)]
    width = bucket_width_ms(min(times, default=None), max(times, default=None))
    fires = [
        {**e, "bucket_ms": _bucket(e["t_ms"], width), "hour_ms": _bucket(e["t_ms"], HOUR_MS)}
        for e in events
        if e["event"] == "fire"
    ]
    tables = _lateness_tables(fires)
    tables["throughput_over_time"] = _throughput_table(events, width)
    for scope in ("group", "host"):
        tables[f"timeout_rate_by_{scope}"] = _timeout_rate_table(events, scope)
    tables["idle_churn_by_group"] = _idle_churn_table(events)
    ranked = [row for row in tables["lateness_by_host"] if row["fires"] > 0]
    ranked.sort(key=lambda r: (-r["p99_ms"], -r["max_ms"], r["host"]))
    tables["slowest_hosts"] = [
        {"rank": rank, **row} for rank, row in enumerate(ranked[:top_n], start=1)
    ]
    tables["noisiest_groups"] = _noisiest_groups_table(events, top_n)
    tables["replication"] = _replication_table(samples, width)
    tables["segments"] = sorted(segments, key=lambda r: r["segment"])
    tables["summary"] = [{**_summary(events, segments, fires, width), **replication_summary(tables["replication"])}]
    tables["events"] = events
    tables["repl_samples"] = samples  # the input of the replication table (not a table the job writes)
    return tables


def _held_ms(samples: list[dict[str, Any]]) -> list[int]:
    """How long each sample's state holds (see the module docstring), in the order given."""
    by_daemon: dict[tuple, list[int]] = defaultdict(list)
    for index, sample in enumerate(samples):
        by_daemon[(sample["host"], sample["host_id"])].append(index)
    held = [0] * len(samples)
    for indexes in by_daemon.values():
        indexes.sort(key=lambda i: (samples[i]["t_ms"], samples[i]["lsn"]))
        for here, after in zip(indexes, indexes[1:]):
            gap = samples[after]["t_ms"] - samples[here]["t_ms"]
            held[here] = max(0, min(gap, REPL_HOLD_MS))
    return held


def _replication_table(samples: list[dict[str, Any]], width: int) -> list[dict[str, Any]]:
    held = _held_ms(samples)
    buckets: dict[tuple, list[int]] = defaultdict(list)
    for index, sample in enumerate(samples):
        buckets[(sample["host"], sample["host_id"], _bucket(sample["t_ms"], width))].append(index)
    unknown = len(REPL_SEVERITY)
    rows = []
    for key in sorted(buckets):
        mine = [samples[i] for i in buckets[key]]
        row = dict(zip(("host", "host_id", "bucket_ms"), key))
        row["samples"] = len(mine)
        row["state"] = max((s["t_ms"], s["lsn"], s["state"]) for s in mine)[2]
        row["worst_state"] = max((REPL_SEVERITY.get(s["state"], unknown), s["state"]) for s in mine)[1]
        row["epoch"] = max(s["epoch"] for s in mine)
        row["replicated_lsn"] = max(s["rlsn"] for s in mine)
        for measure, suffix in (("lag", ""), ("lag_ms", "_ms")):
            values = sorted(s[measure] for s in mine)
            for name, quantile in REPL_QUANTILES.items():
                row[f"lag_{name}{suffix}"] = nearest_rank(values, quantile)
            row[f"lag_max{suffix}"] = values[-1]
        for state, column in REPL_TIME_COLUMNS:
            row[column] = sum(held[i] for i in buckets[key] if samples[i]["state"] == state)
        rows.append({column: row[column] for column in REPLICATION_COLUMNS})
    return rows


def replication_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary's replication figures, from the rows of the ``replication`` table: host ids
    that journaled samples, samples, the highest lag (events, ms), the time behind, and the
    host ids with a bucket whose worst state is fenced. The job derives the summary's figures
    with this function too: what the tests compare independently is the table."""
    return {
        "repl_hosts": len({row["host_id"] for row in rows}),
        "repl_samples": sum(row["samples"] for row in rows),
        "repl_lag_max": max((row["lag_max"] for row in rows), default=None),
        "repl_lag_max_ms": max((row["lag_max_ms"] for row in rows), default=None),
        "repl_behind_ms": sum(row["behind_ms"] for row in rows),
        "repl_fenced_hosts": len({row["host_id"] for row in rows if row["worst_state"] == "fenced"}),
    }


def _lateness_tables(fires: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    tables: dict[str, list[dict[str, Any]]] = {}
    tables["lateness_by_host_group"] = _lateness_table(fires, ("host", "group"))
    tables["lateness_by_host"] = _lateness_table(fires, ("host",))
    tables["lateness_by_group"] = _lateness_table(fires, ("group",))
    tables["lateness_over_time"] = _lateness_table(fires, ("bucket_ms",))
    tables["lateness_by_hour"] = _lateness_table(fires, ("hour_ms",))
    by_hour = _lateness_table(fires, ("host", "hour_ms"))
    tables["lateness_by_host_hour"] = [
        {k: row[k] for k in ("host", "hour_ms", "fires", "overdue_fires", "p99_ms", "max_ms")}
        for row in by_hour
    ]
    return tables


def _throughput_table(events: list[dict[str, Any]], width: int) -> list[dict[str, Any]]:
    per_bucket: dict[int, Counter] = defaultdict(Counter)
    for event in events:
        per_bucket[_bucket(event["t_ms"], width)][event["event"]] += 1
    throughput = []
    for bucket_ms in sorted(per_bucket):
        counts = per_bucket[bucket_ms]
        row = {"bucket_ms": bucket_ms}
        for kind, column in _THROUGHPUT_COLUMNS:
            row[column] = counts[kind]
        for column in ("adds", "cancels", "fires"):
            row[f"{column}_per_s"] = row[column] / (width / 1000)
        throughput.append(row)
    return throughput


def _timeout_rate_table(events: list[dict[str, Any]], scope: str) -> list[dict[str, Any]]:
    ended: dict[str, Counter] = defaultdict(Counter)
    for event in events:
        if event["event"] == "fire":
            ended[event[scope]]["fired"] += 1
        elif event["event"] == "cancel":
            ended[event[scope]]["cancelled_hit" if event["hit"] else "cancelled_miss"] += 1
    rows = []
    for name in sorted(ended):
        counts = ended[name]
        fired, hit = counts["fired"], counts["cancelled_hit"]
        rows.append({
            scope: name,
            "fired": fired,
            "cancelled_hit": hit,
            "cancelled_miss": counts["cancelled_miss"],
            "timeout_rate": fired / (fired + hit) if fired + hit else None,
        })
    return rows


def _idle_churn_table(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    idle: dict[str, Counter] = defaultdict(Counter)
    for event in events:
        if event["event"] == "idle_rearm":
            idle[event["group"]]["idle_rearms"] += 1
        elif event["idle_ms"] is not None and event["event"] in ("add", "rearm"):
            idle[event["group"]]["idle_arms"] += 1
        elif event["idle_ms"] is not None and event["event"] == "fire":
            idle[event["group"]]["idle_fires"] += 1
    return [
        {
            "group": name,
            "idle_arms": idle[name]["idle_arms"],
            "idle_rearms": idle[name]["idle_rearms"],
            "idle_fires": idle[name]["idle_fires"],
            "rearms_per_fire": (
                idle[name]["idle_rearms"] / idle[name]["idle_fires"] if idle[name]["idle_fires"] else None
            ),
        }
        for name in sorted(idle)
    ]


def _noisiest_groups_table(events: list[dict[str, Any]], top_n: int) -> list[dict[str, Any]]:
    per_group: dict[str, Counter] = defaultdict(Counter)
    hosts_of: dict[str, set] = defaultdict(set)
    for event in events:
        counts = per_group[event["group"]]
        counts["events"] += 1
        counts[event["event"]] += 1
        hosts_of[event["group"]].add(event["host"])
    noisy = sorted(per_group, key=lambda g: (-per_group[g]["events"], g))[:top_n]
    return [
        {
            "rank": rank,
            "group": name,
            "events": per_group[name]["events"],
            "adds": per_group[name]["add"],
            "rearms": per_group[name]["rearm"],
            "cancels": per_group[name]["cancel"],
            "fires": per_group[name]["fire"],
            "acks": per_group[name]["ack"],
            "idle_rearms": per_group[name]["idle_rearm"],
            "hosts": len(hosts_of[name]),
        }
        for rank, name in enumerate(noisy, start=1)
    ]


def _summary(events: list[dict[str, Any]], segments: list[dict[str, Any]], fires: list[dict[str, Any]],
             width: int) -> dict[str, Any]:
    fleet = lateness_figures(
        f["lateness_ms"] for f in fires if not f["overdue"]
    )
    fired = len(fires)
    hit = sum(1 for e in events if e["event"] == "cancel" and e["hit"])
    return {
        "hosts": len({e["host"] for e in events}),
        "groups": len({e["group"] for e in events}),
        "segments": len(segments),
        "events": len(events),
        "first_ms": min((e["t_ms"] for e in events), default=None),
        "last_ms": max((e["t_ms"] for e in events), default=None),
        "bucket_width_ms": width,
        "fires": sum(1 for f in fires if not f["overdue"]),
        "overdue_fires": sum(1 for f in fires if f["overdue"]),
        **fleet,
        "timeout_rate": fired / (fired + hit) if fired + hit else None,
        "lines": sum(s["lines"] for s in segments),
        "bad_lines": sum(s["bad_lines"] for s in segments),
        "damaged_segments": sum(1 for s in segments if s["status"] == "damaged"),
        "unreadable_segments": sum(1 for s in segments if s["status"] in ("unreadable",)),
    }


_THROUGHPUT_COLUMNS = (
    ("add", "adds"),
    ("rearm", "rearms"),
    ("cancel", "cancels"),
    ("fire", "fires"),
    ("ack", "acks"),
    ("idle_rearm", "idle_rearms"),
)
