"""The fleet pipeline on real PySpark against the plain-Python reference.

One SparkSession per xdist worker (``local[2]``, session-scoped fixture); the
job runs once per test run (the first worker that needs it runs it under a
file lock, the others read its output) on a small generated fleet (``pipeline.generate``,
the daemon's own journal writer) into which the test then cuts a torn tail,
flips a byte, drops a garbage file, an empty file, lines of a future version
and a segment whose header is damaged. Every table the job writes must equal
the one :mod:`wheeld.pipeline.reference` computes line by line from the same
files: exactly, percentiles included (both sides use the nearest-rank
definition, Spark's ``percentile_disc``). The tests skip, with the reason,
only when there is no Java runtime; a missing pyspark is a failure (CI
installs the ``pipeline`` extra).
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import math
import os
import random
import shutil
import zlib
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.spark,
    pytest.mark.skipif(
        shutil.which("java") is None and not os.environ.get("JAVA_HOME"),
        reason="Spark needs a Java runtime (no 'java' on PATH, no JAVA_HOME)",
    ),
]

HOSTS = 5
EVENTS_PER_HOST = 2_500
SEGMENT_BYTES = 48 * 1024
REPLICATED_HOSTS = 3


# --------------------------------------------------------------------------- #
# Fleet fixtures (also used by test_pipeline_cluster.py)
# --------------------------------------------------------------------------- #


def clean_fleet(root: Path, seed: int = 11, replicated_hosts: int = REPLICATED_HOSTS) -> Path:
    """A small generated fleet: 5 hosts, one slow, restarts (overdue fires), ~12k events;
    3 hosts replicate (~2k replication samples each), one of them is fenced at the end
    (``replicated_hosts=0``: none, for tests that need no replication table, which costs
    the job one Spark job)."""
    from wheeld.pipeline.generate import generate_fleet

    generate_fleet(
        root, hosts=HOSTS, events_per_host=EVENTS_PER_HOST, seed=seed, slow_hosts=1,
        restart_fraction=0.6, segment_bytes=SEGMENT_BYTES, duration_ms=6 * 3_600_000,
        replicated_hosts=replicated_hosts, fenced_hosts=min(1, replicated_hosts),
    )  # fmt: skip
    return root


def _segments(host_dir: Path) -> list[Path]:
    return sorted(host_dir.glob("journal-*.jsonl"))


def damage(root: Path) -> dict[str, object]:
    """Damage a clean fleet the ways disks and crashes do; return what was done.

    - host-000: last segment cut in the middle of its last line (torn tail);
    - host-001: one byte flipped in the middle of its first segment;
    - host-002: a segment of random bytes, and an empty segment;
    - host-003: a version-2 line, an unknown event type, an event and a
      replication sample missing a required field, all with good crcs; a
      complete last line without its newline; the header of its second
      segment damaged;
    - a snapshot-like file and a hidden file that must not be read at all.
    """
    from wheeld.protocol import journal

    rng = random.Random(5)
    hosts = sorted(p for p in root.iterdir() if p.is_dir())
    done: dict[str, object] = {}

    torn = _segments(hosts[0])[-1]
    data = torn.read_bytes()
    last_line_start = data.rstrip(b"\n").rfind(b"\n") + 1
    torn.write_bytes(data[: last_line_start + (len(data) - last_line_start) // 2])
    done["torn"] = str(torn)

    flipped = _segments(hosts[1])[0]
    data = bytearray(flipped.read_bytes())
    middle = len(data) // 2
    while data[middle] in b"\n":
        middle += 1
    data[middle] ^= 0x04
    flipped.write_bytes(bytes(data))
    done["flipped"] = str(flipped)

    garbage = hosts[2] / journal.segment_name(10**12)
    garbage.write_bytes(bytes(rng.randrange(256) for _ in range(6000)))
    empty = hosts[2] / journal.segment_name(10**12 + 1)
    empty.write_bytes(b"")
    done["garbage"], done["empty"] = str(garbage), str(empty)

    segments = _segments(hosts[3])
    future = segments[0]
    with open(future, "ab") as file:
        file.write(journal.encode_line(b'{"ev":"add","v":2,"n":1,"t":1,"g":"x","k":1,"d":2,"s":1}'))
        file.write(journal.encode_line(b'{"ev":"teleport","v":1,"n":2,"t":1,"g":"x","k":1}'))
        file.write(journal.encode_line(b'{"ev":"add","v":1,"n":3,"t":1,"g":"x","k":1}'))
        file.write(journal.encode_line(b'{"ev":"repl","v":1,"n":4,"t":1,"host":"x","epoch":1,"state":"behind"}'))
    no_newline = segments[-1]
    no_newline.write_bytes(no_newline.read_bytes().rstrip(b"\n"))
    header = segments[1]
    data = bytearray(header.read_bytes())
    data[3] ^= 0x01  # inside "ev": the header line fails its crc
    header.write_bytes(bytes(data))
    done["future"], done["no_newline"], done["bad_header"] = str(future), str(no_newline), str(header)

    (hosts[3] / journal.snapshot_name(5)).write_bytes(b"not read\n")
    (hosts[3] / ("." + journal.segment_name(7))).write_bytes(b"hidden, not read\n")
    return done


# --------------------------------------------------------------------------- #
# Spark fixtures: one session per xdist worker, one job run per module
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="session")
def spark():
    from wheeld.pipeline.spark import session

    spark = session("local[2]", shuffle_partitions=4, driver_memory="1g", progress=False)
    try:
        yield spark
    finally:
        spark.stop()


@contextlib.contextmanager
def _exclusive(lock_path: Path):
    """An inter-process lock (xdist workers share the once-per-session fleet and job run)."""
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory, worker_id) -> Path:
    """A directory every xdist worker of this run sees (the parent of their basetemps)."""
    base = tmp_path_factory.getbasetemp()
    return base if worker_id == "master" else base.parent


@pytest.fixture(scope="session")
def fleet(shared_dir) -> tuple[Path, dict]:
    """The damaged fleet, generated once per test run whatever the number of workers."""
    root = shared_dir / "pipeline-fleet"
    done_file = shared_dir / "pipeline-fleet.json"
    with _exclusive(shared_dir / "pipeline-fleet.lock"):
        if not done_file.exists():
            shutil.rmtree(root, ignore_errors=True)
            clean_fleet(root)
            done_file.write_text(json.dumps(damage(root)))
    return root, json.loads(done_file.read_text())


class SavedResult:
    """A finished job run read back from its output directory (no Spark needed)."""

    def __init__(self, out_dir: Path) -> None:
        import pandas as pd

        saved = json.loads((out_dir / "summary.json").read_text())
        self.out_dir = str(out_dir)
        self.tables_dir = saved["run"]["tables_dir"]
        self.report_path = str(out_dir / "report.html")
        self.summary = saved["summary"]
        self.tables = {
            name: pd.read_parquet(os.path.join(self.tables_dir, name))
            for name in os.listdir(self.tables_dir)
            if name != "events"
        }


@pytest.fixture(scope="session")
def result(fleet, shared_dir, request) -> SavedResult:
    """The job run once per test run on the damaged fleet (by the first worker that asks)."""
    from wheeld.pipeline import job

    out = shared_dir / "pipeline-out"
    with _exclusive(shared_dir / "pipeline-out.lock"):
        if not (out / "summary.json").exists():  # written last: its presence means a whole run
            shutil.rmtree(out, ignore_errors=True)
            job.run(str(fleet[0]), str(out), spark=request.getfixturevalue("spark"))
    return SavedResult(out)


@pytest.fixture(scope="session")
def expected(fleet):
    from wheeld.pipeline import reference

    return reference.compute(str(fleet[0]))


def _table(result, name: str) -> list[dict]:
    """A written Parquet table as plain Python rows (ints stay ints, nulls are None)."""
    import pyarrow.parquet as pq

    return pq.read_table(os.path.join(result.tables_dir, name)).to_pylist()


# --------------------------------------------------------------------------- #
# The figures equal the reference
# --------------------------------------------------------------------------- #


FIGURES = (
    "lateness_by_host_group", "lateness_by_host", "lateness_by_group", "lateness_over_time",
    "lateness_by_hour", "lateness_by_host_hour", "throughput_over_time", "timeout_rate_by_group",
    "timeout_rate_by_host", "idle_churn_by_group", "slowest_hosts", "noisiest_groups",
    "replication", "segments", "summary",
)  # fmt: skip


@pytest.mark.parametrize("name", FIGURES)
def test_table_equals_reference(result, expected, name):
    assert _table(result, name) == expected[name]
    assert len(expected[name]) > 0


def test_events_table_equals_reference(result, expected):
    key = lambda row: (row["segment"], row["lsn"], row["event"])  # noqa: E731
    written = sorted(_table(result, "events"), key=key)
    wanted = sorted(expected["events"], key=key)
    assert len(written) == len(wanted)
    for got, want in zip(written, wanted):
        assert got == want


def test_fleet_has_what_the_figures_need(expected):
    """The generated fleet exercises every figure (else equality would prove little)."""
    summary = expected["summary"][0]
    assert summary["hosts"] == HOSTS
    assert summary["overdue_fires"] > 0  # restarts: timers that fired late after downtime
    assert summary["p99_ms"] > summary["p50_ms"]
    assert any(row["idle_rearms"] > 0 and row["idle_fires"] > 0 for row in expected["idle_churn_by_group"])
    assert any(0 < (row["timeout_rate"] or 0) < 1 for row in expected["timeout_rate_by_group"])
    # 6 hours: 2-minute buckets, 180 points (not 360 minutes)
    assert summary["bucket_width_ms"] == 120_000
    assert 120 <= len(expected["throughput_over_time"]) <= 300
    # replication: every state the generator makes, a restart's new epoch, time behind and lag
    replication = expected["replication"]
    assert summary["repl_hosts"] == REPLICATED_HOSTS and summary["repl_fenced_hosts"] == 1
    assert {row["worst_state"] for row in replication} == {"replicating", "connecting", "behind", "fenced"}
    assert summary["repl_behind_ms"] > 0 and summary["repl_lag_max_ms"] >= 10_000
    assert any(row["connecting_ms"] > 0 and row["epoch"] == 2 for row in replication)  # a restarted daemon
    assert any(row["behind_ms"] > 0 and row["replicating_ms"] > 0 for row in replication)


def test_replication_table_follows_the_samples(expected):
    """The replication table from the journaled samples: counts, states and the time each
    state held add up per daemon (a sample holds until the next one, at most REPL_HOLD_MS)."""
    from wheeld.pipeline.reference import REPL_HOLD_MS, REPL_TIME_COLUMNS

    samples = expected["repl_samples"]
    rows = expected["replication"]
    width = expected["summary"][0]["bucket_width_ms"]
    assert sum(row["samples"] for row in rows) == len(samples) == expected["summary"][0]["repl_samples"]
    by_daemon: dict = {}
    for sample in samples:
        by_daemon.setdefault((sample["host"], sample["host_id"]), []).append(sample)
    for (host, host_id), mine in by_daemon.items():
        mine.sort(key=lambda s: (s["t_ms"], s["lsn"]))
        held = sum(max(0, min(b["t_ms"] - a["t_ms"], REPL_HOLD_MS)) for a, b in zip(mine, mine[1:]))
        daemon_rows = [row for row in rows if (row["host"], row["host_id"]) == (host, host_id)]
        assert sum(row[column] for row in daemon_rows for _, column in REPL_TIME_COLUMNS) == held
        last = daemon_rows[-1]
        assert last["bucket_ms"] == mine[-1]["t_ms"] - mine[-1]["t_ms"] % width
        assert last["state"] == mine[-1]["state"] and last["replicated_lsn"] == max(s["rlsn"] for s in mine)
        for row in daemon_rows:
            assert row["lag_p50"] <= row["lag_p99"] <= row["lag_max"]
            assert row["lag_p50_ms"] <= row["lag_p99_ms"] <= row["lag_max_ms"]


def test_slow_host_ranks_first(result):
    slowest = result.tables["slowest_hosts"]
    by_host = result.tables["lateness_by_host"].set_index("host")
    top = slowest.iloc[0]["host"]
    assert by_host.loc[top, "p99_ms"] == by_host["p99_ms"].max()
    assert by_host.loc[top, "p99_ms"] > 3 * by_host["p99_ms"].median()


# --------------------------------------------------------------------------- #
# Bad input: counted and skipped
# --------------------------------------------------------------------------- #


def _segment_row(result, path: str) -> dict:
    table = result.tables["segments"]
    rows = table[table["segment"] == os.path.abspath(path)]
    assert len(rows) == 1, path
    return rows.iloc[0].to_dict()


def test_bad_segments_are_counted_and_skipped(result, fleet):
    _, done = fleet
    torn = _segment_row(result, done["torn"])
    assert (torn["torn_tail"], torn["checksum_mismatch"], torn["status"]) == (1, 0, "damaged")
    flipped = _segment_row(result, done["flipped"])
    assert (flipped["checksum_mismatch"], flipped["torn_tail"], flipped["status"]) == (1, 0, "damaged")
    assert flipped["events"] == flipped["lines"] - 2  # the header and the flipped line
    garbage = _segment_row(result, done["garbage"])
    assert garbage["events"] == 0 and garbage["bad_lines"] == garbage["lines"] > 0
    assert _segment_row(result, done["empty"])["status"] == "empty"
    future = _segment_row(result, done["future"])
    assert (future["unsupported_version"], future["bad_json"]) == (1, 3)
    no_newline = _segment_row(result, done["no_newline"])
    assert no_newline["torn_tail"] == 1  # complete bytes, but a record needs its newline
    bad_header = _segment_row(result, done["bad_header"])
    assert (bad_header["headers"], bad_header["checksum_mismatch"]) == (0, 1)
    # its events keep their host (named by the folder's other headers), not "host-003" twice
    assert bad_header["host"] == _segment_row(result, done["future"])["host"]

    names = {os.path.basename(s) for s in result.tables["segments"]["segment"]}
    assert not any(name.startswith((".", "snapshot-")) for name in names)
    summary = result.summary
    assert summary["bad_lines"] == int(result.tables["segments"]["bad_lines"].sum()) >= 10
    assert summary["damaged_segments"] == 6


def test_bad_lines_never_reach_the_figures(result, expected, fleet, tmp_path):
    """The damaged fleet's events and replication samples are the clean fleet's minus exactly
    the damaged lines."""
    from wheeld.pipeline import reference

    clean = reference.compute(str(clean_fleet(tmp_path / "clean")))

    def lines(tables) -> set:
        return {(row["host"], row["lsn"]) for name in ("events", "repl_samples") for row in tables[name]}

    clean_keys, damaged_keys = lines(clean), lines(expected)
    assert damaged_keys < clean_keys  # nothing invented: no event from a damaged byte
    lost = len(clean_keys) - len(damaged_keys)
    assert lost == 3  # torn tail, flipped line, the line that lost its newline
    assert result.summary["events"] + result.summary["repl_samples"] == len(damaged_keys)
    assert result.summary["groups"] == clean["summary"][0]["groups"]  # no "x" group from bad lines
    assert "x" not in {row["host_id"] for row in expected["replication"]}  # nor a host id


def test_report_is_a_self_contained_html_with_charts(result):
    html = Path(result.report_path).read_text()
    images = html.count('src="data:image/png;base64,')
    assert images >= 8
    first = html.split('src="data:image/png;base64,', 1)[1].split('"', 1)[0]
    assert base64.b64decode(first)[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Input quality" in html
    assert "Replication to the fleet" in html and "hosts fenced" in html
    assert f"{result.summary['bad_lines']} bad lines skipped" in html
    assert "http://" not in html and "https://" not in html  # nothing fetched when opened


# --------------------------------------------------------------------------- #
# Building blocks, and the command lines
# --------------------------------------------------------------------------- #


def test_crc_expression_agrees_with_the_format_reader(spark):
    from pyspark.sql import functions as F

    from wheeld.pipeline.job import crc_ok_column
    from wheeld.protocol import journal

    good = journal.encode_line(b'{"ev":"ack","v":1,"n":1,"t":5,"g":"g","k":"k","s":1}').rstrip(b"\n")
    # raw multi-byte UTF-8 in the body: positions must be counted in bytes, not characters
    accented = journal.encode_line('{"ev":"ack","v":1,"n":2,"t":5,"g":"gé€","k":"ключ","s":1}'.encode()).rstrip(b"\n")
    body, crc = good.rsplit(b',"crc":', 1)
    lines = [
        good,
        accented,
        good.replace(b'"t":5', b'"t":6'),
        body + b"}",  # no crc
        body + b',"crc":0' + crc,  # a leading zero: same number (if it still fits 10 digits)
        body + b',"crc":+' + crc,
        body + b',"crc":' + crc[:-1] + b" }",
        body + b',"crc":12345678901}',  # 11 digits
        b"",
        b',"crc":0}',
        good[:-1],
        accented.replace("é".encode(), b"\xff\xfe"),  # invalid UTF-8, same length
        journal.encode_line(b'{"a":",\\"crc\\":1}"}').rstrip(b"\n"),  # the separator inside a string
    ]
    frame = spark.createDataFrame([(line,) for line in lines], "raw binary").select(
        F.col("raw").cast("string").alias("value")
    )
    got = [row[0] for row in frame.select(crc_ok_column(F.col("value"))).collect()]
    assert got == [journal.check_line(line) for line in lines]
    assert got[0] and got[1] and got[-1] and not any(got[2:4]) and not got[-2]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 99, 100, 101, 999, 1000, 1001, 2003])
def test_percentile_disc_is_nearest_rank(spark, size):
    from pyspark.sql import functions as F

    from wheeld.pipeline.reference import QUANTILES, nearest_rank

    rng = random.Random(size)
    values = [rng.choice([0, 1, 1, 2, 3, 5, 8, 40, 250, 1999]) for _ in range(size)]
    frame = spark.createDataFrame([(v,) for v in values], "x long")
    row = frame.agg(*[
        F.expr(f"percentile_disc({q!r}) WITHIN GROUP (ORDER BY x)").alias(name) for name, q in QUANTILES.items()
    ]).first()  # fmt: skip
    ordered = sorted(values)
    assert {name: int(row[name]) for name in QUANTILES} == {
        name: nearest_rank(ordered, q) for name, q in QUANTILES.items()
    }
    assert nearest_rank(ordered, 0.99) == ordered[max(1, math.ceil(size * 0.99)) - 1]


def test_module_command_line(spark, tmp_path, capsys):
    from wheeld.pipeline import job

    fleet = clean_fleet(tmp_path / "fleet", seed=3, replicated_hosts=0)
    code = job.main([str(fleet), "--out", str(tmp_path / "out"), "--top", "2", "--quiet"])
    assert code == 0
    assert "report:" in capsys.readouterr().out
    assert (tmp_path / "out" / "report.html").exists()
    import pandas as pd

    assert len(pd.read_parquet(tmp_path / "out" / "tables" / "slowest_hosts")) == 2
    assert job.main([str(tmp_path / "missing"), "--out", str(tmp_path / "out2"), "-q"]) == 2


def test_wheelctl_report_command(spark, tmp_path):
    from click.testing import CliRunner

    from wheeld.ctl_report import report

    fleet = clean_fleet(tmp_path / "fleet", seed=4, replicated_hosts=0)
    out = tmp_path / "out"
    answer = CliRunner().invoke(report, [str(fleet), "--out", str(out), "--quiet"])
    assert answer.exit_code == 0, answer.output
    assert f"report: {out / 'report.html'}" in answer.output
    assert "0 bad lines skipped" in answer.output
    missing = CliRunner().invoke(report, [str(tmp_path / "nope"), "--out", str(out)])
    assert missing.exit_code == 1 and "cannot read journals" in missing.output


def test_empty_journal_dir_gives_an_empty_report(spark, tmp_path):
    from wheeld.pipeline import job

    (tmp_path / "fleet" / "host-a").mkdir(parents=True)
    (tmp_path / "fleet" / "host-a" / "snapshot-0000000000000001.jsonl").write_bytes(b"{}\n")
    result = job.run(str(tmp_path / "fleet"), str(tmp_path / "out"), spark=spark)
    assert result.summary["events"] == 0 and result.summary["segments"] == 0
    assert "No data for this chart." in Path(result.report_path).read_text()


def test_probe_finds_torn_tails_longer_than_one_read(spark, tmp_path):
    """A torn piece longer than the probe's read size is still matched exactly."""
    from wheeld.pipeline import job
    from wheeld.protocol import journal

    folder = tmp_path / "fleet" / "host-a"
    folder.mkdir(parents=True)
    header = journal.encode_event(journal.SegmentHeader(host="a", name="n", lsn=1, t=1, mono0=1, wall0=1))
    event = journal.encode_event(journal.Ack(n=1, t=1, g="g", k="k", s=1))
    tail = b"x" * (job.HEAD_PROBE_BYTES * 2 + 17)
    (folder / journal.segment_name(1)).write_bytes(header + event + tail)
    probe = job.probe_files(spark, [str((folder / journal.segment_name(1)).as_uri())])[0]
    assert (probe.torn_len, probe.torn_crc, probe.host) == (len(tail), zlib.crc32(tail), "a")
    result = job.run(str(tmp_path / "fleet"), str(tmp_path / "out"), spark=spark, render=False)
    row = result.tables["segments"].iloc[0]
    assert (row["events"], row["torn_tail"], row["lines"]) == (1, 1, 3)


def test_a_short_run_is_charted_in_second_buckets(spark, tmp_path):
    """A few minutes of journal: 1-second buckets (not 3 points a minute apart), the same
    in the Spark job and in the reference, and the report says which width it drew."""
    from wheeld.pipeline import job, reference
    from wheeld.pipeline.generate import generate_fleet

    generate_fleet(tmp_path / "fleet", hosts=2, events_per_host=3_000, seed=8, restart_fraction=0.0,
                   duration_ms=200_000, segment_bytes=SEGMENT_BYTES)
    result = job.run(str(tmp_path / "fleet"), str(tmp_path / "out"), spark=spark)
    expected = reference.compute(str(tmp_path / "fleet"))
    assert result.summary["bucket_width_ms"] == expected["summary"][0]["bucket_width_ms"] == 1_000
    for name in ("throughput_over_time", "lateness_over_time", "summary"):
        assert _table(result, name) == expected[name], name
    assert len(expected["throughput_over_time"]) > 150
    html = Path(result.report_path).read_text()
    assert "averaged per 1 s bucket" in html and "per 1 s bucket. Exact" in html
