"""The fleet analytics job: wheeld journals in, Parquet tables and a report out.

::

    wheelctl report JOURNAL_DIR --out DIR [--master URL]
    python -m wheeld.pipeline.job JOURNAL_DIR --out DIR [--master URL]
    spark-submit --master spark://host:7077 pipeline/job.py JOURNAL_DIR --out DIR

``JOURNAL_DIR`` is anything Spark can list: a directory tree with one folder
per host (``fleet/web-3/journal-0000000000001001.jsonl``), a glob
(``fleet/web-*``), an ``hdfs://`` or ``s3a://`` URL. The definitions of every
figure (line status, host of a segment, nearest-rank percentiles, timeout
rate, idle churn) are in :mod:`wheeld.pipeline.reference`, the plain-Python
computation the tests compare this job with.

Stages (each is logged with its counts and elapsed time)
=========================================================

1. **list** -- Spark lists ``journal-*.jsonl`` files under the path
   (``recursiveFileLookup``, ``pathGlobFilter``); snapshots are skipped.
2. **probe** -- the driver opens every segment through Hadoop's FileSystem
   (so it works for any scheme) and reads two small pieces: the first line
   (the segment header: ``host``, daemon ``name``) and, if the file does not
   end in ``\\n``, its unterminated last piece (a torn tail). A file that
   cannot be opened is counted ``unreadable`` here. The result is a small
   table, one row per file, broadcast to every task.
3. **verify** -- executors read every line as text (``lineSep="\\n"``:
   Spark's default also splits on ``\\r``), check its crc, parse the JSON of
   the lines whose crc matched (``from_json``, fixed schema, no inference
   pass) and give every line a status (see below). A narrow projection
   (status, event columns, a file id) is cached on local disk; one action
   counts lines by file and status.
4. **events** -- the ``ok`` rows, joined with the per-file strings (segment
   path, host, daemon), are written as the ``events`` table. The ``repl``
   rows (replication samples) are aggregated from the same cache into the
   ``replication`` table: one Spark job (a window per daemon for how long each
   sample's state held, then a group by host, host id and time bucket with
   exact ``percentile_disc``), skipped when there is no sample.
5. **aggregate** -- two Spark jobs over ``events`` read back from Parquet
   (columnar: only the needed columns): lateness with GROUPING SETS and
   exact ``percentile_disc``, and event counts with GROUPING SETS. The time
   buckets of the charts over time have one width for the whole input,
   chosen from its time span (:func:`wheeld.pipeline.reference.bucket_width_ms`:
   at most 300 buckets, never under 1 s); the first and last times of the
   timer events and replication samples come with the line counts of stage 3,
   so choosing costs no extra pass. The small
   results are collected; rates and rankings are derived on the driver
   (:func:`figure_tables`) and every table is written as one Parquet file.
6. **report** -- :mod:`wheeld.pipeline.report` draws PNG charts with
   matplotlib and writes ``report.html`` (charts embedded, one file).

Why the crc is checked with Spark SQL expressions, not a Python UDF
==================================================================

The line format (``protocol/journal.py``) puts the checksum last:
``{...,"crc":123}``; the body is the line cut at the last ``,"crc":`` with
``}`` put back. In Spark SQL::

    tail  = substring_index(value, ',"crc":', -1)          -- '123}'
    body  = substring(cast(value as binary), 1,
                      octet_length(value) - octet_length(tail) - 7) || X'7D'
    crc_ok = tail rlike '^[0-9]{1,10}}$'
             and crc32(body) = try_cast(<tail without '}'> as bigint)

``crc32`` is ``java.util.zip.CRC32`` (the same polynomial as ``zlib.crc32``)
and all of it compiles into Spark's generated Java code: no row leaves the
JVM. A Python UDF (even an Arrow ``pandas_udf``) ships every line to a
Python worker and back, which costs more than the JSON parse that follows
(``python -m bench.pipeline --crc`` measures both: on 1M lines here the
expression adds 0.3 s to reading the text, a UDF 2-6 s), and it would need Python
and wheeld installed on every executor; this way a stock Spark cluster runs
the job. Positions are counted in bytes (``octet_length``, binary
``substring``): Spark's text reader keeps a line's raw bytes, so a corrupted
line with invalid UTF-8 is checked byte for byte and simply fails.

The JSON is then parsed once, with ``from_json`` and an explicit schema; the
``crc`` member is just a field the schema does not list.

Bad input never stops the job and never reaches the figures: every line gets
a status (``ok``, ``header``, ``repl``, ``torn-tail``, ``checksum-mismatch``,
``unsupported-version``, ``bad-json``), only ``ok`` lines become events (``repl``
lines become the ``replication`` table), and the ``segments`` table and the
report count the rest per file.

Tables (``OUT/tables/<name>/``, Parquet)
========================================

======================  ========================================================
events                  one row per valid timer event (host, daemon, segment,
                        lsn, event, t_ms, group, key, seq, deadline_ms,
                        previous_deadline_ms, idle_ms, fired_ms, lateness_ms,
                        overdue, hit)
segments                one row per file: lines by status (``repl_samples``:
                        replication samples), ``status`` ok / damaged /
                        unreadable / empty
lateness_by_host_group  fires, overdue_fires, p50/p99/p999/max lateness (ms)
lateness_by_host        ... per host
lateness_by_group       ... per group
lateness_over_time      ... per time bucket of the fleet (``bucket_ms``; the
                        width is ``summary.bucket_width_ms``)
lateness_by_hour        ... per hour of the fleet
lateness_by_host_hour   fires, p99, max per host and hour (the heat map)
throughput_over_time    adds, rearms, cancels, fires, acks, idle_rearms per
                        time bucket and adds/cancels/fires per second
timeout_rate_by_group   fired, cancelled_hit, cancelled_miss, timeout_rate
timeout_rate_by_host    ... per host
idle_churn_by_group     idle_arms, idle_rearms, idle_fires, rearms_per_fire
slowest_hosts           top N hosts by p99 lateness
noisiest_groups         top N groups by events
replication             per host, host id (the replicating daemon) and time
                        bucket: samples, state (last), worst_state, epoch,
                        replicated_lsn, lag_p50/p99/max (events),
                        lag_p50_ms/p99_ms/max_ms, replicating_ms,
                        connecting_ms, behind_ms, failed_ms, fenced_ms (time
                        in each state); definitions in reference.py
summary                 one row of fleet-wide figures (also ``summary.json``;
                        ``repl_*``: replication, from its table)
======================  ========================================================
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import re
import sys
import time
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from wheeld.protocol import journal
from wheeld.protocol.errors import InvalidRequest

from wheeld.pipeline import reference
from wheeld.pipeline.reference import (
    BAD_JSON,
    BAD_VERSION,
    CHECKSUM,
    HEADER,
    HOUR_MS,
    OK,
    QUANTILES,
    REPL,
    REPLICATION_COLUMNS,
    TOP_N,
    TORN,
)
from wheeld.pipeline.spark import Stopwatch, log, session

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd
    from pyspark.sql import Column, DataFrame, SparkSession

SEGMENT_GLOB = "journal-*.jsonl"
CRC_SEPARATOR = ',"crc":'
#: How much of a file's head the probe reads to find the header line.
HEAD_PROBE_BYTES = 64 * 1024
#: Torn tails are matched on length, crc32 and up to this many leading bytes.
TORN_PREFIX_BYTES = 4096
#: Bytes of a bad line kept as a sample in the ``segments`` table.
SAMPLE_BYTES = 120

#: Fields each event type must carry (msgspec's required fields, protocol/journal.py).
REQUIRED_FIELDS: dict[str, tuple[str, ...]] = {
    "add": ("t", "g", "k", "d", "s"),
    "rearm": ("t", "g", "k", "d", "pd", "s"),
    "cancel": ("t", "g", "k", "s", "hit"),
    "fire": ("t", "g", "k", "d", "s", "f", "lat"),
    "ack": ("t", "g", "k", "s"),
    "idle_rearm": ("t", "g", "k", "d", "pd", "s", "i"),
    "repl": ("t", "host", "epoch", "state", "rlsn", "lag", "lag_ms"),
    "segment": ("host", "name", "lsn", "t", "mono0", "wall0"),
}
#: Which event types carry which optional/typed field (anything else is null).
FIELD_OWNERS: dict[str, tuple[str, ...]] = {
    "s": ("add", "rearm", "cancel", "fire", "ack", "idle_rearm"),
    "d": ("add", "rearm", "fire", "idle_rearm"),
    "pd": ("rearm", "cancel", "idle_rearm"),
    "i": ("add", "rearm", "fire", "idle_rearm"),
    "f": ("fire",),
    "lat": ("fire",),
    "hit": ("cancel",),
}
LINE_SCHEMA = (
    "ev string, v long, n long, t long, g string, k string, d long, pd long, s long, "
    "i long, f long, late boolean, lat long, hit boolean, "
    "host string, name string, lsn long, mono0 long, wall0 long, "
    "epoch long, state string, rlsn long, lag long, lag_ms long"
)
EVENT_COLUMNS = (
    "host", "daemon", "segment", "lsn", "event", "t_ms", "group", "key", "seq",
    "deadline_ms", "previous_deadline_ms", "idle_ms", "fired_ms", "lateness_ms",
    "overdue", "hit",
)  # fmt: skip
SEGMENT_COLUMNS = (
    "segment", "host", "daemon", "size_bytes", "lines", "events", "headers",
    "repl_samples", "torn_tail", "checksum_mismatch", "unsupported_version", "bad_json",
    "bad_lines", "status",
)  # fmt: skip
STATUS_COLUMNS = {
    OK: "events",
    HEADER: "headers",
    REPL: "repl_samples",
    TORN: "torn_tail",
    CHECKSUM: "checksum_mismatch",
    BAD_VERSION: "unsupported_version",
    BAD_JSON: "bad_json",
}
#: Tables in the order the job writes them (``events`` and ``segments`` first).
FIGURE_TABLES = (
    "lateness_by_host_group",
    "lateness_by_host",
    "lateness_by_group",
    "lateness_over_time",
    "lateness_by_hour",
    "lateness_by_host_hour",
    "throughput_over_time",
    "timeout_rate_by_group",
    "timeout_rate_by_host",
    "idle_churn_by_group",
    "slowest_hosts",
    "noisiest_groups",
    "replication",
    "summary",
)

_URI_AUTHORITY_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):///")
_header_decoder = msgspec.json.Decoder(journal.Event)


def path_key(uri: str) -> str:
    """One spelling for a file URI: Spark writes ``file:/x`` in one place, ``file:///x`` in another."""
    return _URI_AUTHORITY_RE.sub(r"\1:/", uri)


# --------------------------------------------------------------------------- #
# Stage 2: probe every file from the driver
# --------------------------------------------------------------------------- #


@dataclass
class Probe:
    """What the driver learns about one segment file before Spark reads it."""

    key: str  # path_key() of Spark's URI for the file: the join key
    segment: str  # readable path (a local path for file: URIs)
    host: str
    daemon: str | None
    size_bytes: int
    torn_len: int | None = None
    torn_crc: int | None = None
    torn_prefix: bytes | None = None
    error: str | None = None


class _HadoopFiles:
    """Reads byte ranges through Hadoop's FileSystem (any scheme Spark reads)."""

    def __init__(self, spark: "SparkSession") -> None:
        self._jvm = spark._jvm
        self._conf = spark._jsc.hadoopConfiguration()

    def probe(self, uri: str) -> Probe:
        jvm = self._jvm
        path = jvm.org.apache.hadoop.fs.Path(jvm.java.net.URI(uri))
        java_uri = path.toUri()
        scheme = java_uri.getScheme()
        segment = java_uri.getPath() if scheme in (None, "file") else path.toString()
        folder = path.getParent().getName() if path.getParent() is not None else ""
        probe = Probe(key=path_key(uri), segment=segment, host=folder, daemon=None, size_bytes=0)
        try:
            filesystem = path.getFileSystem(self._conf)
            size = filesystem.getFileStatus(path).getLen()
            probe.size_bytes = size
            if size == 0:
                return probe
            stream = filesystem.open(path)
            try:
                self._read_header(stream, size, probe)
                self._read_torn_tail(stream, size, probe)
            finally:
                stream.close()
        except Exception as exc:  # py4j wraps IOExceptions; any failure = unreadable
            probe.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        return probe

    @staticmethod
    def _read(stream: Any, position: int, length: int) -> bytes:
        stream.seek(position)
        return bytes(stream.readNBytes(length))

    def _read_header(self, stream: Any, size: int, probe: Probe) -> None:
        head = self._read(stream, 0, min(size, HEAD_PROBE_BYTES))
        newline = head.find(b"\n")
        if newline < 0:
            return  # no complete first line: no header, the folder names the host
        status, event = reference.classify(head[:newline], terminated=True)
        if status == HEADER:
            probe.host, probe.daemon = event.host, event.name

    def _read_torn_tail(self, stream: Any, size: int, probe: Probe) -> None:
        if self._read(stream, size - 1, 1) == b"\n":
            return
        # walk back in chunks to the last newline: the torn piece starts after it
        start = 0
        end = size
        chunk_bytes = HEAD_PROBE_BYTES
        while end > 0:
            begin = max(0, end - chunk_bytes)
            chunk = self._read(stream, begin, end - begin)
            newline = chunk.rfind(b"\n")
            if newline >= 0:
                start = begin + newline + 1
                break
            end = begin
        crc = 0
        position = start
        prefix = b""
        while position < size:
            piece = self._read(stream, position, min(size - position, 1 << 20))
            if not prefix:
                prefix = piece[:TORN_PREFIX_BYTES]
            crc = zlib.crc32(piece, crc)
            position += len(piece)
        probe.torn_len, probe.torn_crc, probe.torn_prefix = size - start, crc, prefix


def probe_files(spark: "SparkSession", uris: list[str], threads: int = 8) -> list[Probe]:
    """Probe every file (in a few threads: each probe is a handful of py4j calls).

    A file without a valid header gets its host from the other segments of
    its folder (:func:`wheeld.pipeline.reference.folder_hosts`).
    """
    files = _HadoopFiles(spark)
    with concurrent.futures.ThreadPoolExecutor(max_workers=threads) as pool:
        probes = list(pool.map(files.probe, uris))
    fallback = reference.folder_hosts(
        (_folder(p.segment), p.host if p.daemon is not None else None) for p in probes
    )
    for probe in probes:
        if probe.daemon is None:
            probe.host = fallback[_folder(probe.segment)]
    return probes


def _folder(segment: str) -> str:
    return segment.rsplit("/", 1)[0] if "/" in segment else ""


# --------------------------------------------------------------------------- #
# Stage 3: verify and classify every line
# --------------------------------------------------------------------------- #


def crc_ok_column(value: "Column") -> "Column":
    """True when a journal line (a text column) carries a matching crc (see module doc)."""
    from pyspark.sql import functions as F

    tail = F.substring_index(value, CRC_SEPARATOR, -1)
    cut_bytes = F.octet_length(value) - F.octet_length(tail) - F.lit(len(CRC_SEPARATOR))
    body = F.concat(F.substring(value.cast("binary"), F.lit(1), cut_bytes), F.expr("X'7D'"))
    digits = F.substring(tail, F.lit(1), F.octet_length(tail) - F.lit(1))
    claimed = digits.try_cast("bigint")
    return (
        (F.instr(value, CRC_SEPARATOR) > 0)
        & tail.rlike(r"^[0-9]{1,10}\}$")
        & (F.crc32(body) == claimed)
    )


def _required_ok(parsed: "Column") -> "Column":
    from pyspark.sql import functions as F

    ev = parsed["ev"]
    condition = None
    for kind, names in REQUIRED_FIELDS.items():
        present = F.lit(True)
        for name in names:
            present = present & parsed[name].isNotNull()
        condition = (F.when(ev == kind, present) if condition is None else condition.when(ev == kind, present))
    return condition.otherwise(F.lit(False))


def classify_lines(lines: "DataFrame") -> "DataFrame":
    """Add ``status`` and the parsed line ``j`` to rows of (value, torn_len, torn_crc, torn_prefix, ...)."""
    from pyspark.sql import functions as F

    value = F.col("value")
    raw = value.cast("binary")
    is_torn = (
        F.col("torn_len").isNotNull()
        & (F.octet_length(value) == F.col("torn_len"))
        & (F.crc32(raw) == F.col("torn_crc"))
        & (F.substring(raw, F.lit(1), F.lit(TORN_PREFIX_BYTES)) == F.col("torn_prefix"))
    )
    parsed = F.from_json(value, LINE_SCHEMA)
    with_flags = lines.select("*", is_torn.alias("_torn"), crc_ok_column(value).alias("_crc_ok"))
    j = F.col("j")
    status = (
        F.when(F.col("_torn"), F.lit(TORN))
        .when(~F.col("_crc_ok"), F.lit(CHECKSUM))
        .when(j.isNull(), F.lit(BAD_JSON))
        .when(j["v"].isNotNull() & (j["v"] != journal.JOURNAL_VERSION), F.lit(BAD_VERSION))
        .when(~_required_ok(j), F.lit(BAD_JSON))
        .when(j["ev"] == "segment", F.lit(HEADER))
        .when(j["ev"] == "repl", F.lit(REPL))
        .otherwise(F.lit(OK))
    )
    # parse only lines whose crc matched: the JSON parse is the expensive part
    with_json = with_flags.withColumn(
        "j", F.when(F.col("_crc_ok") & ~F.col("_torn"), parsed)
    )
    return with_json.withColumn("status", status)


def slim_lines(classified: "DataFrame") -> "DataFrame":
    """Per line: ``status``, a ``sample`` of bad lines, ``file_id``, the event columns and
    those of a replication sample (``host_id``, ``state``, ``epoch``, ``rlsn``, ``lag``,
    ``lag_ms``: null on every other line).

    This narrow projection is what the job caches: the raw text, the parsed
    struct and the per-file strings (segment path, host, daemon: joined back
    by ``file_id`` when the events are written) are dropped, so the cache is
    smaller than the events table.
    """
    from pyspark.sql import functions as F

    j = F.col("j")
    ev = j["ev"]

    def owned(field: str) -> "Column":
        return F.when(ev.isin(*FIELD_OWNERS[field]), j[field])

    def repl(field: str) -> "Column":
        return F.when(ev == "repl", j[field])

    return classified.select(
        F.col("status"),
        F.when(~F.col("status").isin(OK, HEADER, REPL), F.substring(F.col("value"), 1, SAMPLE_BYTES)).alias("sample"),
        F.col("file_id"),
        F.coalesce(j["n"], F.lit(0)).alias("lsn"),
        ev.alias("event"),
        j["t"].alias("t_ms"),
        j["g"].alias("group"),
        j["k"].alias("key"),
        owned("s").alias("seq"),
        owned("d").alias("deadline_ms"),
        owned("pd").alias("previous_deadline_ms"),
        owned("i").alias("idle_ms"),
        owned("f").alias("fired_ms"),
        owned("lat").alias("lateness_ms"),
        F.when(ev == "fire", F.coalesce(j["late"], F.lit(False))).alias("overdue"),
        owned("hit").alias("hit"),
        repl("host").alias("host_id"),
        *(repl(field).alias(field) for field in ("state", "epoch", "rlsn", "lag", "lag_ms")),
    )


# --------------------------------------------------------------------------- #
# Stage 5: the figures
# --------------------------------------------------------------------------- #
#
# Every figure comes out of two aggregations over the events table, each one
# Spark job with GROUPING SETS (one scan, one shuffle), instead of one job per
# table: on a laptop the fixed cost of a Spark job (~0.3-1 s) is most of the
# time of a small table. The aggregates are small (per host, group, time
# bucket, host-hour) and are collected; rates and rankings are then derived on the
# driver from exact integer counts.

#: lateness table -> grouping columns (the () set is the fleet-wide row).
LATENESS_SETS: dict[str, tuple[str, ...]] = {
    "lateness_by_host_group": ("host", "group"),
    "lateness_by_host": ("host",),
    "lateness_by_group": ("group",),
    "lateness_over_time": ("bucket_ms",),
    "lateness_by_hour": ("hour_ms",),
    "lateness_by_host_hour": ("host", "hour_ms"),
    "fleet": (),
}
LATENESS_KEYS = ("host", "group", "bucket_ms", "hour_ms")
COUNT_SETS: dict[str, tuple[str, ...]] = {
    "time": ("bucket_ms",),
    "group": ("group",),
    "host": ("host",),
    "fleet": (),
}
COUNT_KEYS = ("bucket_ms", "group", "host")
LATENESS_FIGURES = ("fires", "overdue_fires", *QUANTILES, "max_ms")


def _grouping_id(keys: tuple[str, ...], grouping: tuple[str, ...]) -> int:
    """Spark's grouping_id(): bit set for every key *not* in the set, first key = high bit."""
    width = len(keys)
    return sum(1 << (width - 1 - index) for index, key in enumerate(keys) if key not in grouping)


def _lateness_aggregates() -> list["Column"]:
    """fires, overdue_fires, p50/p99/p999 (exact nearest rank) and max of running fires."""
    from pyspark.sql import functions as F

    running = "CASE WHEN NOT overdue THEN lateness_ms END"
    columns = [
        F.count(F.expr(running)).alias("fires"),
        F.count_if(F.col("overdue")).alias("overdue_fires"),
    ]
    for name, quantile in QUANTILES.items():
        columns.append(
            F.expr(f"percentile_disc({quantile!r}) WITHIN GROUP (ORDER BY {running})")
            .cast("long")
            .alias(name)
        )
    columns.append(F.max(F.expr(running)).alias("max_ms"))
    return columns


def _bucket(column: str, width_ms: int) -> "Column":
    from pyspark.sql import functions as F

    return F.col(column) - F.pmod(F.col(column), F.lit(width_ms))


def lateness_aggregate(events: "DataFrame", bucket_width_ms: int) -> "DataFrame":
    """One row per (host, group), host, group, time bucket, (host, hour) and the fleet."""
    from pyspark.sql import functions as F

    fires = events.where(F.col("event") == "fire").select(
        "host", "group", "lateness_ms", "overdue",
        _bucket("t_ms", bucket_width_ms).alias("bucket_ms"),
        _bucket("t_ms", HOUR_MS).alias("hour_ms"),
    )  # fmt: skip
    sets = [[F.col(k) for k in keys] for keys in LATENESS_SETS.values()]
    return fires.groupingSets(sets, *LATENESS_KEYS).agg(
        F.grouping_id().alias("gid"), *_lateness_aggregates()
    )


def count_aggregate(events: "DataFrame", bucket_width_ms: int) -> "DataFrame":
    """Event counts by type per time bucket, group, host and for the fleet."""
    from pyspark.sql import functions as F

    event = F.col("event")
    idle = F.col("idle_ms").isNotNull()
    counts = [F.count(F.lit(1)).alias("events")]
    counts += [F.count_if(event == kind).alias(column) for kind, column in reference._THROUGHPUT_COLUMNS]
    counts += [
        F.count_if((event == "cancel") & F.col("hit")).alias("cancelled_hit"),
        F.count_if((event == "cancel") & ~F.col("hit")).alias("cancelled_miss"),
        F.count_if(idle & event.isin("add", "rearm")).alias("idle_arms"),
        F.count_if(idle & (event == "fire")).alias("idle_fires"),
        F.count_distinct("host").alias("hosts"),
        F.count_distinct("group").alias("groups"),
        F.min("t_ms").alias("first_ms"),
        F.max("t_ms").alias("last_ms"),
    ]
    rows = events.select(
        "event", "hit", "idle_ms", "host", "group", "t_ms", _bucket("t_ms", bucket_width_ms).alias("bucket_ms")
    )
    sets = [[F.col(k) for k in keys] for keys in COUNT_SETS.values()]
    return rows.groupingSets(sets, *COUNT_KEYS).agg(F.grouping_id().alias("gid"), *counts)


def replication_aggregate(samples: "DataFrame", bucket_width_ms: int) -> "DataFrame":
    """The ``replication`` table from the replication samples (rows with ``host``, ``host_id``,
    ``lsn``, ``t_ms``, ``state``, ``epoch``, ``rlsn``, ``lag``, ``lag_ms``): one row per host,
    host id and time bucket (the definitions: :mod:`wheeld.pipeline.reference`).

    A window over each daemon's samples (ordered by time, then lsn) gives how long each
    sample's state held (until the next sample, at most ``REPL_HOLD_MS``); the group by
    then sums those per state and takes exact ``percentile_disc`` of the lag."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    daemon = Window.partitionBy("host", "host_id").orderBy("t_ms", "lsn")
    gap = F.lead("t_ms").over(daemon) - F.col("t_ms")
    held = F.when(gap.isNull(), F.lit(0)).otherwise(F.greatest(F.lit(0), F.least(gap, F.lit(reference.REPL_HOLD_MS))))
    severity = F.lit(len(reference.REPL_SEVERITY))
    for state, rank in sorted(reference.REPL_SEVERITY.items(), key=lambda item: item[1], reverse=True):
        severity = F.when(F.col("state") == state, F.lit(rank)).otherwise(severity)
    rows = samples.select(
        "host", "host_id", "lsn", "t_ms", "state", "epoch", "rlsn", "lag", "lag_ms", held.alias("held_ms"),
        severity.alias("severity"), _bucket("t_ms", bucket_width_ms).alias("bucket_ms"),
    )  # fmt: skip
    columns = [
        F.count(F.lit(1)).alias("samples"),
        F.max(F.struct("t_ms", "lsn", "state"))["state"].alias("state"),
        F.max(F.struct("severity", "state"))["state"].alias("worst_state"),
        F.max("epoch").alias("epoch"),
        F.max("rlsn").alias("replicated_lsn"),
    ]
    for field, suffix in (("lag", ""), ("lag_ms", "_ms")):
        for name, quantile in reference.REPL_QUANTILES.items():
            columns.append(F.expr(f"percentile_disc({quantile!r}) WITHIN GROUP (ORDER BY {field})").cast("long")
                           .alias(f"lag_{name}{suffix}"))
        columns.append(F.max(field).alias(f"lag_max{suffix}"))
    for state, column in reference.REPL_TIME_COLUMNS:
        columns.append(F.sum(F.when(F.col("state") == state, F.col("held_ms")).otherwise(F.lit(0))).alias(column))
    return rows.groupBy("host", "host_id", "bucket_ms").agg(*columns)


def replication_table(rows: "pd.DataFrame | None") -> "pd.DataFrame":
    """The collected :func:`replication_aggregate` in the table's column order and row order
    (host, host id, bucket); an empty table with the same columns when there is none."""
    import pandas as pd

    text = ("host", "host_id", "state", "worst_state")
    if rows is None or rows.empty:
        return pd.DataFrame({column: pd.Series([], dtype="string" if column in text else "Int64")
                             for column in REPLICATION_COLUMNS})
    table = rows[list(REPLICATION_COLUMNS)].sort_values(["host", "host_id", "bucket_ms"]).reset_index(drop=True)
    return _nullable_ints(table, tuple(column for column in REPLICATION_COLUMNS if column not in text))


def _split(frame: "pd.DataFrame", keys: tuple[str, ...], sets: dict[str, tuple[str, ...]],
           metrics: tuple[str, ...] | None = None) -> dict[str, "pd.DataFrame"]:
    out = {}
    for name, grouping in sets.items():
        part = frame[frame["gid"] == _grouping_id(keys, grouping)]
        columns = [*grouping, *(metrics or [c for c in frame.columns if c not in keys and c != "gid"])]
        out[name] = part[columns].sort_values(list(grouping) or columns[:1]).reset_index(drop=True)
    return out


def _nullable_ints(frame: "pd.DataFrame", columns: tuple[str, ...]) -> "pd.DataFrame":
    for column in columns:
        if column in frame:
            frame[column] = frame[column].astype("Int64")
    return frame


def _rate(numerator: "pd.Series", denominator: "pd.Series") -> "pd.Series":
    import pandas as pd

    values = [n / d if d else None for n, d in zip(numerator.tolist(), denominator.tolist())]
    return pd.Series(values, index=numerator.index, dtype="float64")


def figure_tables(
    lateness_rows: "pd.DataFrame",
    count_rows: "pd.DataFrame",
    segments: list[dict[str, Any]],
    top_n: int = TOP_N,
    bucket_width_ms: int = reference.BUCKET_WIDTHS_MS[0],
    replication_rows: "pd.DataFrame | None" = None,
) -> dict[str, "pd.DataFrame"]:
    """Every figure table (pandas) from the collected aggregates; see reference.py.

    ``bucket_width_ms`` is the width the aggregates' ``bucket_ms`` were made with;
    ``replication_rows``: the collected :func:`replication_aggregate` (None: no sample).
    """
    import pandas as pd

    lateness = _split(lateness_rows, LATENESS_KEYS, LATENESS_SETS, LATENESS_FIGURES)
    for frame in lateness.values():
        _nullable_ints(frame, ("fires", "overdue_fires", *QUANTILES, "max_ms"))
    counts = _split(count_rows, COUNT_KEYS, COUNT_SETS)

    tables: dict[str, pd.DataFrame] = {name: lateness[name] for name in LATENESS_SETS if name != "fleet"}
    tables["lateness_by_host_hour"] = tables["lateness_by_host_hour"][
        ["host", "hour_ms", "fires", "overdue_fires", "p99_ms", "max_ms"]
    ]

    over_time = counts["time"]
    throughput = over_time[["bucket_ms", *(c for _, c in reference._THROUGHPUT_COLUMNS)]].copy()
    for column in ("adds", "cancels", "fires"):
        throughput[f"{column}_per_s"] = throughput[column] / (bucket_width_ms / 1000)
    tables["throughput_over_time"] = throughput.reset_index(drop=True)

    for scope in ("group", "host"):
        part = counts[scope]
        part = part[(part["fires"] + part["cancelled_hit"] + part["cancelled_miss"]) > 0]
        rate = part[[scope, "fires", "cancelled_hit", "cancelled_miss"]].rename(columns={"fires": "fired"})
        rate["timeout_rate"] = _rate(rate["fired"], rate["fired"] + rate["cancelled_hit"])
        tables[f"timeout_rate_by_{scope}"] = rate.reset_index(drop=True)

    group = counts["group"]
    idle = group[(group["idle_arms"] + group["idle_rearms"] + group["idle_fires"]) > 0]
    idle = idle[["group", "idle_arms", "idle_rearms", "idle_fires"]].copy()
    idle["rearms_per_fire"] = _rate(idle["idle_rearms"], idle["idle_fires"])
    tables["idle_churn_by_group"] = idle.reset_index(drop=True)

    by_host = tables["lateness_by_host"]
    slowest = by_host[by_host["fires"] > 0].sort_values(
        ["p99_ms", "max_ms", "host"], ascending=[False, False, True]
    ).head(top_n)
    slowest.insert(0, "rank", range(1, len(slowest) + 1))
    tables["slowest_hosts"] = slowest.reset_index(drop=True)

    noisy = group.sort_values(["events", "group"], ascending=[False, True]).head(top_n)
    noisy = noisy[["group", "events", "adds", "rearms", "cancels", "fires", "acks", "idle_rearms", "hosts"]].copy()
    noisy.insert(0, "rank", range(1, len(noisy) + 1))
    tables["noisiest_groups"] = noisy.reset_index(drop=True)

    tables["segments"] = pd.DataFrame(segments, columns=list(SEGMENT_COLUMNS))
    fleet_counts = counts["fleet"].to_dict("records")
    fleet_lateness = lateness["fleet"].to_dict("records")
    tables["replication"] = replication_table(replication_rows)
    summary = summary_row(fleet_counts, fleet_lateness, segments, bucket_width_ms)
    replication = tables["replication"].astype(object).where(tables["replication"].notna(), None)
    summary.update(reference.replication_summary(replication.to_dict("records")))
    tables["summary"] = _nullable_ints(pd.DataFrame([summary]), tuple(k for k in summary if k != "timeout_rate"))
    return tables, summary


def summary_row(
    fleet_counts: list[dict],
    fleet_lateness: list[dict],
    segments: list[dict[str, Any]],
    bucket_width_ms: int = reference.BUCKET_WIDTHS_MS[0],
) -> dict[str, Any]:
    """The one-row fleet summary (empty fleet: zeros and Nones)."""
    import pandas as pd

    counts = fleet_counts[0] if fleet_counts else {}
    late = fleet_lateness[0] if fleet_lateness else {}

    def value(mapping: dict, name: str, default: Any = None) -> Any:
        item = mapping.get(name, default)
        return None if item is None or item is pd.NA or (isinstance(item, float) and pd.isna(item)) else int(item)

    fired, hit = value(counts, "fires", 0), value(counts, "cancelled_hit", 0)
    return {
        "hosts": value(counts, "hosts", 0),
        "groups": value(counts, "groups", 0),
        "segments": len(segments),
        "events": value(counts, "events", 0),
        "first_ms": value(counts, "first_ms"),
        "last_ms": value(counts, "last_ms"),
        "bucket_width_ms": bucket_width_ms,
        "fires": value(late, "fires", 0),
        "overdue_fires": value(late, "overdue_fires", 0),
        **{name: value(late, name) for name in (*QUANTILES, "max_ms")},
        "timeout_rate": fired / (fired + hit) if fired + hit else None,
        "lines": sum(s["lines"] for s in segments),
        "bad_lines": sum(s["bad_lines"] for s in segments),
        "damaged_segments": sum(1 for s in segments if s["status"] == "damaged"),
        "unreadable_segments": sum(1 for s in segments if s["status"] == "unreadable"),
    }


# --------------------------------------------------------------------------- #
# The job
# --------------------------------------------------------------------------- #


@dataclass
class JobResult:
    out_dir: str
    tables_dir: str
    report_path: str | None
    summary: dict[str, Any]
    tables: dict[str, Any]
    stages_s: dict[str, float]
    master: str


def _segment_rows(probes: list[Probe], counts: dict[str, dict[str, int]]) -> list[dict[str, Any]]:
    rows = []
    for probe in probes:
        by_status = counts.get(probe.segment, {})
        row: dict[str, Any] = {
            "segment": probe.segment,
            "host": probe.host,
            "daemon": probe.daemon,
            "size_bytes": probe.size_bytes,
            "lines": sum(by_status.values()),
        }
        for status, column in STATUS_COLUMNS.items():
            row[column] = by_status.get(status, 0)
        row["bad_lines"] = sum(by_status.get(s, 0) for s in reference.BAD_STATUSES)
        if probe.size_bytes == 0 and probe.error is None:
            row["status"] = "empty"
        elif probe.error is not None or row["lines"] == 0:
            row["status"] = "unreadable"
        elif row["bad_lines"]:
            row["status"] = "damaged"
        else:
            row["status"] = "ok"
        rows.append(row)
    return sorted(rows, key=lambda r: r["segment"])


PROBE_SCHEMA = "key string, file_id int, torn_len long, torn_crc long, torn_prefix binary"
FILES_SCHEMA = "file_id int, segment string, host string, daemon string"


def _is_local(path: str) -> bool:
    scheme = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*):", path)
    return scheme is None or scheme.group(1) == "file"


def write_small_table(spark: "SparkSession", tables_dir: str, name: str, frame: "pd.DataFrame") -> None:
    """Write a collected figure table as ``tables_dir/name/part-0.parquet``.

    Local paths are written by the driver with pyarrow (no Spark job); remote
    ones (hdfs://, s3a://) through Spark, one file.
    """
    if _is_local(tables_dir):
        import pyarrow as pa
        import pyarrow.parquet as pq

        folder = os.path.join(re.sub(r"^file:(//)?", "", tables_dir), name)
        if os.path.isdir(folder):
            for old in os.listdir(folder):
                os.unlink(os.path.join(folder, old))
        os.makedirs(folder, exist_ok=True)
        pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), os.path.join(folder, "part-0.parquet"))
    else:  # pragma: no cover - needs a remote filesystem
        spark.createDataFrame(frame).coalesce(1).write.mode("overwrite").parquet(f"{tables_dir}/{name}")


def run(
    journal_path: str,
    out_dir: str,
    master: str | None = None,
    *,
    spark: "SparkSession | None" = None,
    tables_dir: str | None = None,
    top_n: int = TOP_N,
    render: bool = True,
    progress: bool = True,
) -> JobResult:
    """Run the whole job; return where it wrote, the figure tables and the summary.

    ``spark`` reuses a session (tests); otherwise :func:`wheeld.pipeline.spark.session`
    makes one for ``master``. ``tables_dir`` defaults to ``OUT/tables``; on a
    multi-machine cluster it must be storage every executor can write
    (``hdfs://``, ``s3a://``, a shared mount); the report itself is written
    by the driver into ``out_dir``.
    """
    from pyspark.sql import functions as F
    from pyspark.storagelevel import StorageLevel

    watch = Stopwatch()
    if spark is None:
        spark = session(master, progress=progress)
        watch.lap("spark", "session on %s", spark.sparkContext.master)
    os.makedirs(out_dir, exist_ok=True)
    tables_dir = tables_dir or os.path.join(os.path.abspath(out_dir), "tables")

    # 1. list
    reader = (
        spark.read.option("lineSep", "\n")
        .option("recursiveFileLookup", "true")
        .option("pathGlobFilter", SEGMENT_GLOB)
    )
    try:
        text = reader.text(journal_path)
    except Exception as exc:  # AnalysisException: the path does not exist
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InvalidRequest(f"cannot read journals at {journal_path!r}: {first_line}") from exc
    uris = sorted(text.inputFiles())
    watch.lap("list", "%d segment files under %s", len(uris), journal_path)

    # 2. probe
    probes = probe_files(spark, uris)
    torn = sum(1 for p in probes if p.torn_len is not None)
    failed = sum(1 for p in probes if p.error is not None)
    watch.lap("probe", "%d files: %d with a torn tail, %d unreadable", len(probes), torn, failed)
    for probe in probes:
        if probe.error:
            log.warning("unreadable segment %s: %s", probe.segment, probe.error)

    # 3. verify + classify; cache the narrow per-line projection
    readable = [p for p in probes if p.error is None]
    probe_df = spark.createDataFrame(
        [(p.key, file_id, p.torn_len, p.torn_crc, p.torn_prefix) for file_id, p in enumerate(readable)],
        PROBE_SCHEMA,
    )
    files_df = spark.createDataFrame(
        [(file_id, p.segment, p.host, p.daemon) for file_id, p in enumerate(readable)], FILES_SCHEMA
    )
    lines = text.select(
        "value",
        F.regexp_replace(F.col("_metadata.file_path"), _URI_AUTHORITY_RE.pattern, "$1:/").alias("key"),
    ).join(F.broadcast(probe_df), "key", "inner")
    # DISK_ONLY: measured faster here than MEMORY_AND_DISK (no GC pressure on a
    # small heap) and it leaves the heap to the percentile count maps
    slim = slim_lines(classify_lines(lines)).persist(StorageLevel.DISK_ONLY)
    status_counts = (
        slim.groupBy("file_id", "status")
        .agg(
            F.count(F.lit(1)).alias("lines"),
            F.min("sample").alias("sample"),
            F.min("t_ms").alias("first_ms"),
            F.max("t_ms").alias("last_ms"),
        )
        .collect()
    )
    event_times = [(row["first_ms"], row["last_ms"]) for row in status_counts if row["status"] in (OK, REPL)]
    bucket_width_ms = reference.bucket_width_ms(
        min((first for first, _ in event_times if first is not None), default=None),
        max((last for _, last in event_times if last is not None), default=None),
    )
    counts: dict[str, dict[str, int]] = {}
    for row in status_counts:
        segment = readable[row["file_id"]].segment
        counts.setdefault(segment, {})[row["status"]] = row["lines"]
        if row["status"] in reference.BAD_STATUSES:
            log.warning("%s: %d %s line(s), e.g. %.80r", segment, row["lines"], row["status"], row["sample"])
    segments = _segment_rows(probes, counts)
    total_lines = sum(s["lines"] for s in segments)
    bad_lines = sum(s["bad_lines"] for s in segments)
    total_events = sum(s["events"] for s in segments)
    total_samples = sum(s["repl_samples"] for s in segments)
    watch.lap("verify", "%d lines: %d events, %d replication samples, %d bad lines skipped", total_lines,
              total_events, total_samples, bad_lines)

    # 4. events
    events_path = f"{tables_dir}/events"
    (
        slim.where(F.col("status") == OK)
        .join(F.broadcast(files_df), "file_id", "inner")
        .select(*EVENT_COLUMNS)
        .write.mode("overwrite")
        .parquet(events_path)
    )
    watch.lap("events", "%d events written to %s", total_events, events_path)
    replication_rows = None
    if total_samples:  # from the cache too, before it goes
        samples = slim.where(F.col("status") == REPL).join(F.broadcast(files_df), "file_id", "inner")
        replication_rows = replication_aggregate(samples, bucket_width_ms).toPandas()
        watch.lap("replication", "%d replication samples: %d rows (time buckets of %d ms)", total_samples,
                  len(replication_rows), bucket_width_ms)
    slim.unpersist()
    events = spark.read.parquet(events_path)

    # 5. figures: two aggregations, the rest on the driver
    lateness_rows = lateness_aggregate(events, bucket_width_ms).toPandas()
    watch.lap("aggregate", "lateness percentiles: %d groups (time buckets of %d ms)", len(lateness_rows),
              bucket_width_ms)
    count_rows = count_aggregate(events, bucket_width_ms).toPandas()
    watch.lap("aggregate", "counts: %d groups", len(count_rows))
    tables, summary = figure_tables(lateness_rows, count_rows, segments, top_n, bucket_width_ms, replication_rows)
    for name in ("segments", *FIGURE_TABLES):
        write_small_table(spark, tables_dir, name, tables[name])
    watch.lap("tables", "%d figure tables written to %s", len(FIGURE_TABLES) + 1, tables_dir)

    run_info: dict[str, Any] = {
        "journal_path": journal_path,
        "tables_dir": tables_dir,
        "master": spark.sparkContext.master,
        "spark_version": spark.version,
        "default_parallelism": spark.sparkContext.defaultParallelism,
    }
    report_path = None
    if render:
        from wheeld.pipeline import report

        run_info["stages_s"] = _stage_totals(watch)
        run_info["elapsed_s"] = round(watch.total_s, 3)
        report_path = report.render(out_dir, tables, summary, run_info)
        watch.lap("report", "wrote %s", report_path)
    stages = _stage_totals(watch)
    run_info["stages_s"] = stages
    run_info["elapsed_s"] = round(watch.total_s, 3)
    with open(os.path.join(out_dir, "summary.json"), "w") as file:
        json.dump({"summary": summary, "run": run_info}, file, indent=2, default=_json_default)
    log.info("done in %.1f s: %s", watch.total_s, out_dir)
    return JobResult(
        out_dir=out_dir,
        tables_dir=tables_dir,
        report_path=report_path,
        summary=summary,
        tables=tables,
        stages_s=stages,
        master=spark.sparkContext.master,
    )


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    return str(value)


def _stage_totals(watch: Stopwatch) -> dict[str, float]:
    totals: dict[str, float] = {}
    for stage, seconds in watch.stages:
        totals[stage] = round(totals.get(stage, 0.0) + seconds, 3)
    return totals

# --------------------------------------------------------------------------- #
# Command line
# --------------------------------------------------------------------------- #


def configure_logging(verbose: bool = True) -> None:
    """Stage progress on stderr (the job's progress indication)."""
    logger = logging.getLogger("wheeld.pipeline")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s wheeld.pipeline %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO if verbose else logging.WARNING)
    logger.propagate = False


def main(argv: list[str] | None = None) -> int:
    """``python -m wheeld.pipeline.job JOURNAL_DIR --out DIR [--master URL]``."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m wheeld.pipeline.job",
        description="Fleet analytics over wheeld journals: Parquet tables and an HTML report.",
    )
    parser.add_argument("journal_dir", help="journal tree (one folder per host), glob or URL")
    parser.add_argument("--out", required=True, help="output directory (report.html, tables/)")
    parser.add_argument("--master", default=None, help="Spark master URL (default local[*])")
    parser.add_argument("--tables", default=None, help="where to write Parquet tables (default OUT/tables)")
    parser.add_argument("--top", type=int, default=TOP_N, help="rows in the slowest/noisiest rankings")
    parser.add_argument("-q", "--quiet", action="store_true", help="no stage progress on stderr")
    args = parser.parse_args(argv)
    configure_logging(not args.quiet)
    started = time.monotonic()
    try:
        result = run(
            args.journal_dir, args.out, args.master, tables_dir=args.tables, top_n=args.top, progress=not args.quiet
        )
    except InvalidRequest as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    summary = result.summary
    print(
        f"{summary['events']} events from {summary['hosts']} hosts in {summary['segments']} segments "
        f"({summary['bad_lines']} bad lines skipped) in {time.monotonic() - started:.1f} s; "
        f"report: {result.report_path}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
