"""wheelctl against a real daemon: every subcommand, the exit codes, figures that agree with what we did.

The readers (stats, dump, groups, check) are run in-process through click's
CliRunner (fast); ``tail`` and one ``stats`` run as real ``wheelctl`` processes.
The daemon is the ``daemon`` fixture (a real wheeld process, segments unlinked
afterwards); arena copies made here get their own ``/wheeld-test-...`` names
and are unlinked in ``finally``.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time

import numpy as np
import posix_ipc
import pytest
from click.testing import CliRunner
from daemon_harness import process_state, unique_name, unlink_segments, wait_until
from prometheus_client.parser import text_string_to_metric_families

import wheeld
from wheeld.ctl import main
from wheeld.protocol import arena_layout as L
from wheeld.protocol.errors import CorruptArena
from wheeld.shm import check as CK
from wheeld.shm import reader as R
from wheeld.shm import snapshot as SN
from wheeld.shm.fsck import fsck
from wheeld.shm.header import parse_header

pytestmark = pytest.mark.timeout(120)


def wheelctl(daemon, *args, name=None, socket_path=None):
    """Run wheelctl in-process; returns click's Result (exit_code, stdout, stderr)."""
    runner = CliRunner()
    argv = ["--socket", socket_path or daemon.socket_path, "--name", name or daemon.name, *args]
    return runner.invoke(main, argv, catch_exceptions=False)


def settle(name: str, timeout_s: float = 5.0) -> SN.Snapshot:
    """A snapshot published by a daemon iteration that began after this call.

    The daemon answers a flush before it publishes the counters of that
    iteration, so a test waits for the next heartbeat before it compares.
    """
    after = SN.mono_ms()

    def fresh() -> SN.Snapshot | None:
        with R.ArenaReader(name) as reader:
            snap = reader.snapshot()
        return snap if snap.counters["daemon_heartbeat_ms"] > after else None

    return wait_until(fresh, timeout_s, "the daemon to publish a new heartbeat", interval=0.01)


def collect(client, want: int, timeout_s: float = 10.0):
    got = []
    end = time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < end:
        got.extend(client.poll(0.1))
    return got


def stop_while_parked(daemon, timeout_s: float = 10.0) -> None:
    """SIGSTOP the daemon at a moment it is parked (asleep between iterations, writing nothing).

    Parked before and after the stop, with the same park epoch and wake-up count,
    means it did not leave the park in between.
    """
    words = ("daemon_heartbeat_ms", "wakeups_total")
    end = time.monotonic() + timeout_s
    with R.ArenaReader(daemon.name) as reader:
        def state():
            counters = reader.counters()
            return (struct.unpack_from("<qq", reader.buf, L.H_PARKED), tuple(counters[w] for w in words))

        while time.monotonic() < end:
            before = state()
            if not before[0][0]:
                time.sleep(0.002)
                continue
            os.kill(daemon.pid, signal.SIGSTOP)
            wait_until(lambda: process_state(daemon.pid) == "T", 5, "the daemon stopped", interval=0.001)
            if state() == before:
                return
            os.kill(daemon.pid, signal.SIGCONT)
            time.sleep(0.01)
    raise AssertionError("could not stop the daemon while it was parked")


def copy_arena(source_name: str) -> tuple[str, mmap.mmap]:
    """Copy a live arena into a new segment of a fresh instance name; returns (name, writable mapping)."""
    copy_name = unique_name()
    with R.ArenaReader(source_name) as reader:
        size = reader.info["bytes"]
        data = bytes(reader.buf[:size])
    shm = posix_ipc.SharedMemory(f"/wheeld-{copy_name}-arena", posix_ipc.O_CREX, mode=0o600, size=size)
    try:
        buf = mmap.mmap(shm.fd, size)
    finally:
        shm.close_fd()
    buf[:size] = data
    return copy_name, buf


# ---------------------------------------------------------------------------- stats
def test_stats_figures_agree_with_what_the_test_did(daemon):
    with wheeld.connect(daemon.socket_path, group="work") as w:
        for i in range(10):
            w.add(f"short-{i}", 50)
        for i in range(6):
            w.add(f"long-{i}", 60_000)
        for i in range(2):
            w.add(f"long-{i}", 90_000)  # re-arms
        for i in range(3, 6):
            w.cancel(f"long-{i}")
        w.cancel("never-armed")  # a miss
        w.flush()
        assert len(collect(w, 10)) == 10
        w.poll(0.01)  # acknowledges the ten
        w.flush()
        settle(daemon.name)
        result = wheelctl(daemon, "stats", "--json", "--interval", "0")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    totals = doc["totals"]
    assert totals["adds_total"] == 16
    assert totals["rearms_total"] == 2
    assert totals["cancels_total"] == 3
    assert totals["cancel_misses_total"] == 1
    assert totals["expirations_total"] == 10
    assert totals["acks_total"] == 10
    assert totals["delivered_total"] == 10
    assert doc["timers"]["pending"] == 3
    assert sum(doc["timers"]["pending_by_level"].values()) == 3
    # 60 s lies inside level 1 (256 ms buckets, 65.5 s span), 90 s in level 2
    assert {k: v for k, v in doc["timers"]["pending_by_level"].items() if v} == {"1": 1, "2": 2}
    assert doc["timers"]["undelivered"] == 0 and doc["timers"]["unacknowledged"] == 0
    assert doc["lateness"]["count"] == 10
    assert doc["lateness"]["p50_us"] is not None and doc["lateness"]["max_us"] >= doc["lateness"]["p50_us"]
    assert doc["arena"]["capacity"] == daemon.capacity and doc["arena"]["used"] == 3
    assert doc["daemon"] == {**doc["daemon"], "pid": daemon.pid, "alive": True, "responding": True}
    assert doc["health"] == "ok" and doc["rates_per_s"] is None
    assert doc["clients"]["connected"] == 1  # the test's own client
    work = [g for g in doc["groups"]["groups"] if g["name"] == "work"]
    assert work and work[0]["pending"] == 3


def test_stats_rates_and_table(daemon):
    with R.ArenaReader(daemon.name) as reader:
        before = reader.snapshot()
    with wheeld.connect(daemon.socket_path, group="rates") as w:
        for i in range(200):
            w.add(i, 600_000)
        w.flush()
        after = settle(daemon.name)
        rates = SN.rates(before, after)
        elapsed_s = (after.taken_ms - before.taken_ms) / 1000
        assert rates["adds_total"] == pytest.approx(200 / elapsed_s)
        assert rates["cancels_total"] == 0
        table = wheelctl(daemon, "stats", "--interval", "0.2")
        assert table.exit_code == 0, table.output
        assert f"pid {daemon.pid} alive" in table.stdout and ": ok" in table.stdout
        assert "adds_total" in table.stdout and "200" in table.stdout and "/s" in table.stdout
        assert "1 connected" in table.stdout  # this client
        as_json = json.loads(wheelctl(daemon, "stats", "--json", "--interval", "0.2").stdout)
        assert set(as_json["rates_per_s"]) == set(SN.RATE_COUNTERS)
        assert as_json["rings"]["count"] == 1 and as_json["rings"]["depth"] == 0
        assert as_json["rings"]["rings"][0]["group"] == "rates" and as_json["rings"]["rings"][0]["client_alive"]


def test_stats_prometheus_parses(daemon):
    with wheeld.connect(daemon.socket_path, group="prom") as w:
        for i in range(5):
            w.add(f"p{i}", 20)
        w.add("later", 600_000)
        w.flush()
        assert len(collect(w, 5)) == 5
        w.poll(0.01)
        w.flush()
        settle(daemon.name)
        result = wheelctl(daemon, "stats", "--prometheus", "--interval", "0")
    assert result.exit_code == 0
    families = {f.name: f for f in text_string_to_metric_families(result.stdout)}
    value = {f.name: f.samples[0].value for f in families.values() if len(f.samples) == 1}
    assert families["wheeld_timers_added"].type == "counter"
    assert value["wheeld_timers_added"] == 6
    assert value["wheeld_timers_expired"] == 5
    assert value["wheeld_timers_pending"] == 1
    assert value["wheeld_expirations_acknowledged"] == 5
    hist = families["wheeld_fire_lateness_seconds"]
    assert hist.type == "histogram"
    buckets = [(s.labels["le"], s.value) for s in hist.samples if s.name.endswith("_bucket")]
    counts = [v for _le, v in buckets]
    assert counts == sorted(counts), "buckets are cumulative"
    assert buckets[-1] == ("+Inf", 5)
    assert [s.value for s in hist.samples if s.name.endswith("_count")] == [5]
    for family in families.values():
        assert family.name.startswith("wheeld_")
        for sample in family.samples:
            assert set(sample.labels) <= {"le", "level", "hot_path"}, sample


def test_stats_answers_while_the_daemon_is_stopped(daemon):
    with wheeld.connect(daemon.socket_path, group="g") as w:
        for i in range(7):
            w.add(i, 600_000)
        w.flush()
    settle(daemon.name)
    os.kill(daemon.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: process_state(daemon.pid) == "T", 5, "the daemon stopped")
        with R.ArenaReader(daemon.name) as reader:
            heartbeat = reader.counters()["daemon_heartbeat_ms"]  # its last one
        wait_until(lambda: SN.mono_ms() > heartbeat + 400, 5, "the heartbeat older than --stale-after 0.3 s")
        result = wheelctl(daemon, "stats", "--json", "--interval", "0", "--stale-after", "0.3")
        assert result.exit_code == 4, result.output
        doc = json.loads(result.stdout)
        assert doc["health"] == "stuck" and doc["daemon"]["alive"] and not doc["daemon"]["responding"]
        assert doc["timers"]["pending"] == 7 and doc["totals"]["adds_total"] == 7
        assert "does not respond" in result.stderr
        # clients get exit 4 too: the socket accepts into its backlog, nobody answers
        added = wheelctl(daemon, "--timeout", "0.5", "add", "x", "10")
        assert added.exit_code == 4 and "does not respond" in added.stderr
        # a real wheelctl process, to cover the script's entry point
        proc = subprocess.run([sys.executable, "-m", "wheeld.ctl", "--socket", daemon.socket_path,
                               "--name", daemon.name, "stats", "--interval", "0", "--stale-after", "0.3"],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 4 and "NOT RESPONDING" in proc.stdout
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
    daemon.kill()  # SIGKILL: the arena stays, with the dead daemon's pid in it
    result = wheelctl(daemon, "stats", "--json", "--interval", "0")
    assert result.exit_code == 3
    doc = json.loads(result.stdout)
    assert doc["health"] == "down" and not doc["daemon"]["alive"] and doc["timers"]["pending"] == 7
    assert f"wheeld (pid {daemon.pid}) is not running" in result.stderr


def test_daemon_liveness_sees_through_a_recycled_pid(daemon):
    assert SN.daemon_alive(daemon.pid)
    other = subprocess.Popen(["sleep", "30"])  # what a recycled pid would look like
    try:
        # between fork and exec the child still shows our own command line: wait for the exec
        def execed() -> bool:
            with open(f"/proc/{other.pid}/cmdline", "rb") as f:
                return f.read().startswith(b"sleep")

        wait_until(execed, 10, "the child to exec sleep")
        assert SN.pid_alive(other.pid) and not SN.daemon_alive(other.pid)
    finally:
        other.kill()
        other.wait()
    assert not SN.pid_alive(other.pid) and not SN.daemon_alive(0)


def test_nothing_running_gives_exit_3_and_says_why(tmp_path):
    name = unique_name()
    missing = str(tmp_path / "none.sock")
    for args in (["stats"], ["stats", "--json"], ["dump"], ["groups"], ["check"]):
        result = wheelctl(None, *args, name=name, socket_path=missing)
        assert result.exit_code == 3, (args, result.output)
        assert f"no wheeld arena named {name!r}" in result.stderr
        assert f"is wheeld running with --name {name}?" in result.stderr
    for args in (["add", "k", "10"], ["cancel", "k"], ["tail"]):
        result = wheelctl(None, *args, name=name, socket_path=missing)
        assert result.exit_code == 3, (args, result.output)
        assert f"no wheeld socket at {missing}" in result.stderr
    stale = tmp_path / "stale.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(stale))  # bound, never listening: what a killed daemon leaves
    try:
        result = wheelctl(None, "add", "k", "10", name=name, socket_path=str(stale))
        assert result.exit_code == 3 and "nothing listens" in result.stderr
    finally:
        sock.close()
    help_text = CliRunner().invoke(main, ["--help"]).stdout
    for line in ("0  ok", "2  usage error", "3  no daemon or no arena", "4  the daemon does not respond"):
        assert line in help_text


def test_usage_errors_exit_2(daemon):
    assert wheelctl(daemon, "add", "k", "-5").exit_code == 2
    assert wheelctl(daemon, "add", "--key-type", "int", "nan", "5").exit_code == 2
    assert wheelctl(daemon, "stats", "--json", "--prometheus").exit_code == 2
    assert wheelctl(daemon, "frobnicate").exit_code == 2


# ---------------------------------------------------------------------------- add / cancel
def test_add_and_cancel(daemon):
    added = wheelctl(daemon, "add", "job-1", "60000", "--group", "ops")
    assert added.exit_code == 0 and added.stdout.startswith("added 'job-1' in group 'ops'")
    rearmed = wheelctl(daemon, "add", "job-1", "120000", "--group", "ops")
    assert rearmed.exit_code == 0 and rearmed.stdout.startswith("re-armed 'job-1'")
    assert wheelctl(daemon, "add", "--key-type", "int", "42", "60000", "-g", "ops").exit_code == 0
    snap = settle(daemon.name)
    assert snap.counters["adds_total"] == 2 and snap.counters["rearms_total"] == 1
    with R.ArenaReader(daemon.name) as reader:
        assert reader.lookup("job-1", "ops").deadline_ms > SN.mono_ms() + 100_000
        assert reader.lookup(42, "ops") is not None and reader.lookup("42", "ops") is None

    cancelled = wheelctl(daemon, "cancel", "job-1", "--group", "ops")
    assert cancelled.exit_code == 0 and cancelled.stdout.startswith("cancelled 'job-1'")
    again = wheelctl(daemon, "cancel", "job-1", "--group", "ops")
    assert again.exit_code == 1 and "no pending timer 'job-1'" in again.stderr
    wrong_group = wheelctl(daemon, "cancel", "--key-type", "int", "42")
    assert wrong_group.exit_code == 1  # keys are scoped by group: 42 is pending in "ops" only
    assert wheelctl(daemon, "cancel", "--key-type", "int", "42", "-g", "ops").exit_code == 0
    snap = settle(daemon.name)
    assert snap.counters["cancels_total"] == 2 and snap.pending == 0

    # a timer that fired before the cancel: nothing to cancel (exit 1), and it was delivered
    with wheeld.connect(daemon.socket_path, group="fast") as w:
        assert wheelctl(daemon, "add", "soon", "30", "-g", "fast").exit_code == 0
        got = collect(w, 1)
        assert [e.key for e in got] == ["soon"]
        assert wheelctl(daemon, "cancel", "soon", "-g", "fast").exit_code == 1


def test_add_prints_the_deadline_that_dump_shows(daemon):
    """The deadline ``add`` prints is the one add() returned: the expiration carries it and
    ``dump`` shows it (the clock in ms rounded up, plus the delay)."""
    for i in range(3):
        added = wheelctl(daemon, "add", f"due-{i}", "60000", "-g", "deadlines")
        assert added.exit_code == 0, added.output
        printed = int(re.search(r"deadline (\d+) \(CLOCK_MONOTONIC ms\)", added.stdout).group(1))
        dumped = json.loads(wheelctl(daemon, "dump", "--json", "-g", "deadlines").stdout)
        assert {t["key"]: t["deadline_ms"] for t in dumped["timers"]}[f"due-{i}"] == printed


def test_a_negative_delay_is_an_invalid_delay_and_a_negative_int_key_a_key(daemon):
    for args in (["add", "x", "-5"], ["add", "-g", "neg", "x", "-5000"], ["add", "x", "-5", "-g", "neg"]):
        result = wheelctl(daemon, *args)
        assert result.exit_code == 2, (args, result.output)
        assert "InvalidDelay: delay_ms must not be negative (-5" in result.stderr, (args, result.output)
        assert "No such option" not in result.output
    assert daemon.counters()["clients_total"] == 0, "refused before anything was sent"
    # a mistyped option is still refused as one, beside a negative number or not
    for args in (["add", "x", "5", "--bogus"], ["add", "x", "-5", "--bogus"], ["cancel", "--bogus", "x"]):
        result = wheelctl(daemon, *args)
        assert result.exit_code == 2 and "No such option '--bogus'" in result.output, (args, result.output)
    added = wheelctl(daemon, "add", "--key-type", "int", "-3", "60000", "-g", "neg")
    assert added.exit_code == 0 and added.stdout.startswith("added -3 (int) in group 'neg'"), added.output
    with R.ArenaReader(daemon.name) as reader:
        assert reader.lookup(-3, "neg") is not None and reader.lookup("x", "neg") is None
    assert wheelctl(daemon, "cancel", "--key-type", "int", "-3", "-g", "neg").exit_code == 0


def _expirations_waiting(daemon, group: str, n: int) -> None:
    """Leave ``n`` fired timers of ``group`` waiting for a member (none is connected)."""
    with wheeld.connect(daemon.socket_path, group=group) as w:
        for i in range(n):
            w.add(f"e{i}", 30)
        w.flush()
    end = time.monotonic() + 10
    while settle(daemon.name).counters["undelivered"] < n:
        assert time.monotonic() < end


def _received_unread(client, n: int) -> None:
    """Read frames until the daemon's ``n`` expirations sit in the client, handed to nobody."""
    end = time.monotonic() + 10
    while len(client._ready) < n:
        assert time.monotonic() < end
        client._read(0.1)


def test_add_and_cancel_give_back_expirations_they_never_read(daemon):
    """wheelctl add/cancel join the group for a moment; what the daemon hands them meanwhile
    must go back to the group. The library acknowledges only what it handed to the
    application, so a plain close() gives unread expirations back, and so does
    ctl._leave; what the application did take is acknowledged and gone."""
    from wheeld.ctl import _leave

    _expirations_waiting(daemon, "control", 3)
    client = wheeld.connect(daemon.socket_path, group="control")
    _received_unread(client, 3)
    taken = client.poll(0)  # the application takes them: acknowledged at close()
    assert len(taken) == 3
    client.close()
    with wheeld.connect(daemon.socket_path, group="control") as worker:
        assert worker.poll(0.5) == []  # acknowledged by close(): gone

    _expirations_waiting(daemon, "q", 5)
    client = wheeld.connect(daemon.socket_path, group="q")
    _received_unread(client, 5)
    _leave(client)
    with wheeld.connect(daemon.socket_path, group="q") as worker:
        got = collect(worker, 5)
    assert sorted(e.key for e in got) == [f"e{i}" for i in range(5)]
    assert settle(daemon.name).counters["redelivered_total"] == 5


def test_a_key_wheeld_cannot_store_is_a_usage_error(daemon):
    result = wheelctl(daemon, "add", "k" * 40, "10")
    assert result.exit_code == 2 and "at most 32" in result.stderr
    assert wheelctl(daemon, "cancel", "--key-type", "bytes", "").exit_code == 2
    assert settle(daemon.name).counters["commands_total"] == 0  # nothing reached the daemon


# ---------------------------------------------------------------------------- dump / groups
def test_dump_lists_pending_timers_by_deadline(daemon):
    with wheeld.connect(daemon.socket_path, group="d") as w:
        for i in range(30):
            w.add(f"t{i:02d}", 100_000 + 1000 * (29 - i))  # t29 first
        w.add(b"\x01\x02", 200_000)
        w.flush()
    with wheeld.connect(daemon.socket_path, group="other") as w:
        for i in range(5):
            w.add(i, 50_000)
        w.flush()
    result = wheelctl(daemon, "dump", "--json", "--limit", "10", "--group", "d")
    assert result.exit_code == 0
    doc = json.loads(result.stdout)
    assert doc["total"] == 31 and doc["shown"] == 10
    assert [t["key"] for t in doc["timers"]] == [f"t{i:02d}" for i in range(29, 19, -1)]
    deadlines = [t["deadline_ms"] for t in doc["timers"]]
    assert deadlines == sorted(deadlines)
    assert all(t["group"] == "d" and t["state"] == "scheduled" and 90_000 < t["due_in_ms"] <= 129_000
               for t in doc["timers"])
    everything = json.loads(wheelctl(daemon, "dump", "--json", "--limit", "1000").stdout)
    assert everything["total"] == 36
    assert {"key": "0102", "key_type": "bytes"}.items() <= everything["timers"][-1].items()
    assert [t["key"] for t in everything["timers"][:5]] == [0, 1, 2, 3, 4]
    table = wheelctl(daemon, "dump", "--limit", "3")
    assert table.exit_code == 0
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["KEY", "GROUP", "DEADLINE_MS", "DUE", "IN", "STATE"]
    assert len(lines) == 5 and lines[-1].startswith("3 of 36 pending")
    missing = wheelctl(daemon, "dump", "--group", "nope")
    assert missing.exit_code == 1 and "no group 'nope'" in missing.stderr


def test_groups(daemon):
    with wheeld.connect(daemon.socket_path, group="alpha") as a, wheeld.connect(daemon.socket_path, group="beta"):
        for i in range(4):
            a.add(i, 600_000)
        a.flush()
        settle(daemon.name)
        result = wheelctl(daemon, "groups", "--json")
        assert result.exit_code == 0
        doc = json.loads(result.stdout)
        by_name = {g["name"]: g for g in doc["groups"]}
        assert by_name["alpha"]["pending"] == 4 and by_name["alpha"]["clients"] == 1
        assert by_name["alpha"]["live"] == 4 and by_name["alpha"]["fired"] == 0
        assert by_name["beta"]["pending"] == 0 and by_name["beta"]["clients"] == 1
        assert doc["active"] == 2
        assert doc["in_use"] == 3 and doc["max"] == L.DEFAULT_MAX_GROUPS  # default, alpha, beta
        table = wheelctl(daemon, "groups").stdout
        assert table.splitlines()[0] == "3 of 1,024 group ids in use"
        assert "alpha" in table and "beta" in table
        stats_table = wheelctl(daemon, "stats", "--interval", "0").stdout
        assert "groups   2 active, 3 of 1,024 group ids in use" in stats_table
        stats_json = json.loads(wheelctl(daemon, "stats", "--json", "--interval", "0").stdout)["groups"]
        assert (stats_json["in_use"], stats_json["max"], stats_json["registered"]) == (3, L.DEFAULT_MAX_GROUPS, 3)
        prom = {f.name: f.samples[0].value for f in text_string_to_metric_families(
            wheelctl(daemon, "stats", "--prometheus", "--interval", "0").stdout)}
        assert prom["wheeld_groups_in_use"] == 3 and prom["wheeld_groups_max"] == L.DEFAULT_MAX_GROUPS


def test_groups_of_an_arena_read_without_a_daemon():
    """The reader counts live records per group from the records: named groups, a
    forgotten one, an id that live records carry without a name, and a table entry
    a writer was killed in the middle of (first byte 0: unused)."""
    from wheeld.protocol.naming import arena_name
    from wheeld.shm.wheel import TimerWheel

    name = unique_name()
    wheel = TimerWheel.create(100, name=arena_name(name), max_groups=8, start_ms=1000)
    try:
        a, b, gone = wheel.group_id("alpha"), wheel.group_id("beta"), wheel.group_id("gone")
        for n in range(5):
            wheel.schedule(f"a{n}", 1010 + n, group=a)
        wheel.schedule("b0", 5000, group=b)
        wheel.schedule("raw", 5000, group=6)  # an id without a name
        fired = wheel.expire(1012)  # a0..a2 fired, not acknowledged
        assert len(fired) == 3
        assert wheel.forget_group(gone) is True
        wheel._seg.buf[L.GROUPS_OFFSET + 7 * L.GROUP_NAME_BYTES + 1
                       : L.GROUPS_OFFSET + 7 * L.GROUP_NAME_BYTES + 4] = b"xyz"
        expected_live = wheel.group_counts().tolist()
        wheel.publish_stats()
        result = wheelctl(None, "groups", "--json", name=name, socket_path="/nonexistent")
        assert result.exit_code == 0, result.output
        doc = json.loads(result.stdout)
        assert doc["in_use"] == 4 and doc["max"] == 8  # default, alpha, beta, and id 6
        rows = {g["id"]: g for g in doc["groups"]}
        assert sorted(rows) == [0, a, b, 6]
        assert rows[a] == {"id": a, "name": "alpha", "live": 5, "pending": 2, "fired": 3, "clients": 0}
        assert rows[b]["live"] == 1 and rows[6]["name"] == "" and rows[6]["live"] == 1
        assert [rows.get(g, {"live": 0})["live"] for g in range(8)] == expected_live
        lines = wheelctl(None, "groups", name=name, socket_path="/nonexistent").stdout.splitlines()
        assert lines[0] == "4 of 8 group ids in use"
        assert lines[1].split() == ["id", "group", "live", "pending", "fired", "clients"]
        assert lines[3].split() == [str(a), "alpha", "5", "2", "3", "0"]
        assert lines[5].split() == ["6", "(no", "name)", "1", "1", "0", "0"]
        stats_doc = json.loads(wheelctl(None, "stats", "--json", "--interval", "0", name=name,
                                        socket_path="/nonexistent").stdout)  # exits 3 (no daemon) after printing
        assert (stats_doc["groups"]["in_use"], stats_doc["groups"]["max"],
                stats_doc["groups"]["registered"]) == (4, 8, 3)
    finally:
        wheel.close()
        unlink_segments(name)


# ---------------------------------------------------------------------------- tail
def test_tail_prints_the_groups_expirations(daemon):
    proc = subprocess.Popen(
        [sys.executable, "-m", "wheeld.ctl", "--socket", daemon.socket_path, "--name", daemon.name,
         "tail", "--group", "watched", "--count", "3", "--duration", "30"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert "tailing group 'watched'" in proc.stderr.readline()
        with wheeld.connect(daemon.socket_path, group="feeder") as feeder:
            feeder.add("not-watched", 10)  # another group: tail must not see it
            feeder.flush()
        for key in ("a", "b"):
            assert wheelctl(daemon, "add", key, "100", "-g", "watched").exit_code == 0
        assert wheelctl(daemon, "add", "--key-type", "int", "7", "150", "-g", "watched").exit_code == 0
        out, _err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0
    lines = [json.loads(line) for line in out.splitlines()]
    assert sorted(str(x["key"]) for x in lines) == ["7", "a", "b"]
    for line in lines:
        assert line["group"] == "watched" and line["fired_ms"] >= line["deadline_ms"]
        assert line["late_ms"] == line["fired_ms"] - line["deadline_ms"] and line["late"] is False
    assert [x["key_type"] for x in lines if x["key"] == 7] == ["int"]
    snap = settle(daemon.name)
    assert snap.counters["acks_total"] >= 3  # tail acknowledged what it printed


# ---------------------------------------------------------------------------- check
def test_check_passes_on_the_live_arena_and_never_writes_it(daemon):
    with wheeld.connect(daemon.socket_path, group="c") as w:
        for i in range(300):
            w.add(i, 1000 + 700 * i)  # levels 0, 1 and 2
        w.add("due-now", 0)
        w.flush()
        collect(w, 1)
    settle(daemon.name)
    result = wheelctl(daemon, "check")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("ok:")
    stop_while_parked(daemon)
    try:
        with R.ArenaReader(daemon.name) as reader:
            size = reader.info["bytes"]
            before = bytes(reader.buf[:size])
            result = wheelctl(daemon, "check", "--json")
            after = bytes(reader.buf[:size])
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
    assert result.exit_code == 0 and json.loads(result.stdout)["ok"]
    assert before == after, "check wrote into the live arena"


def test_check_is_clean_on_a_daemon_firing_every_millisecond(daemon):
    """Timers fire every ms and a client acknowledges them while ``check`` runs, so the
    daemon parks for a millisecond at a time, often without publishing its counters. A
    copy counts as taken at rest only when the arena's parked word is set, which the
    daemon does only when it parks with its counters published: no copy may show
    counters that disagree with the records."""
    import threading

    reports = []
    with wheeld.connect(daemon.socket_path, group="busy") as w:
        for i in range(3000):
            w.add(i, 200 + i)  # one due every ms for 3 s
        w.flush()
        stop = threading.Event()

        def check_repeatedly():
            while not stop.is_set():
                reports.append(CK.check(daemon.name, attempts=3, interval_s=0.01))

        thread = threading.Thread(target=check_repeatedly)
        thread.start()
        try:
            got = set()
            end = time.monotonic() + 10
            while len(got) < 3000 and time.monotonic() < end:
                got.update(e.key for e in w.poll(timeout_s=0.2))
        finally:
            stop.set()
            thread.join()
    assert len(got) == 3000
    assert len(reports) >= 2, len(reports)
    broken = [(r.quiet, r.copies, r.problems) for r in reports if not r.ok and not r.inconclusive]
    assert not broken, broken[:3]


def _scheduled_slots(buf, info):
    first = info["levels"] * info["wheel_size"] + 2
    rec = np.frombuffer(buf, dtype=L.RECORD_DTYPE, count=first + info["capacity"], offset=info["header_bytes"])
    slots = np.flatnonzero((rec["state"] & L.STATE_MASK) == L.SCHEDULED)
    return [int(s) for s in slots if s >= first]


@pytest.mark.parametrize("damage", ["link", "counter", "duplicate", "magic"])
def test_check_catches_a_corrupted_arena_copy(daemon, damage):
    with wheeld.connect(daemon.socket_path, group="victim") as w:
        for i in range(50):
            w.add(f"v{i}", 300_000 + i)
        w.flush()
    settle(daemon.name)
    copy_name, buf = copy_arena(daemon.name)
    try:
        info = parse_header(buf, len(buf), "copy")
        struct.pack_into("<q", buf, L.H_COUNTERS + 8 * L.COUNTER["daemon_pid"], 0)  # no live writer
        assert wheelctl(daemon, "check", name=copy_name).exit_code == 0  # the copy itself is sound
        slots = _scheduled_slots(buf, info)
        victim = slots[len(slots) // 2]
        base = info["header_bytes"] + victim * L.RECORD_BYTES
        if damage == "link":
            struct.pack_into("<i", buf, base + L.R_NEXT, victim)  # points at itself
            expected = f"record {victim}"
        elif damage == "counter":
            struct.pack_into("<q", buf, L.H_COUNTERS + 8 * L.COUNTER["pending"], len(slots) + 5)
            expected = f"counter pending={len(slots) + 5}, but {len(slots)} records are scheduled"
        elif damage == "duplicate":
            other = slots[0]
            other_base = info["header_bytes"] + other * L.RECORD_BYTES
            ident = buf[other_base + L.R_KEY_META : other_base + L.RECORD_BYTES]
            buf[base + L.R_KEY_META : base + L.RECORD_BYTES] = ident
            expected = "shares its (group, key)"
        else:
            buf[0:8] = b"NOTWHEEL"
            expected = "not a wheeld arena"
        result = wheelctl(daemon, "check", name=copy_name)
        assert result.exit_code == 1, result.output
        assert expected in result.output
        if damage != "magic":
            assert result.stdout.startswith("BROKEN")
            as_json = json.loads(wheelctl(daemon, "check", "--json", name=copy_name).stdout)
            assert not as_json["ok"] and any(expected in p for p in as_json["problems"])
        if damage == "duplicate":
            assert "a daemon restart would repair" in result.stdout
        # the live arena is untouched by all this
        assert wheelctl(daemon, "check").exit_code == 0
    finally:
        buf.close()
        unlink_segments(copy_name)


def test_check_with_a_live_pid_needs_the_problem_in_every_copy(daemon):
    with wheeld.connect(daemon.socket_path, group="v") as w:
        for i in range(20):
            w.add(i, 300_000)
        w.flush()
    settle(daemon.name)
    copy_name, buf = copy_arena(daemon.name)
    try:
        struct.pack_into("<q", buf, L.H_PARKED, 0)  # looks busy: never a quiet copy
        struct.pack_into("<q", buf, L.H_COUNTERS + 8 * L.COUNTER["pending_level_0"], 999)
        report = CK.check(copy_name, attempts=3, interval_s=0.01)
        assert report.daemon_alive and not report.quiet and report.copies == 3
        assert report.problems == [next(p for p in report.problems if "pending_level_0=999" in p)]
        assert not report.ok and not report.inconclusive
    finally:
        buf.close()
        unlink_segments(copy_name)


# ---------------------------------------------------------------------------- watch
# SIGINT is sent to a wheelctl started with SIGINT ignored, as a background job of a
# non-interactive shell is: --watch stops on it all the same, and on SIGTERM.
_IGNORING_SIGINT = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                    "sys.argv[0] = 'wheelctl'; runpy.run_module('wheeld.ctl', run_name='__main__')")


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_stats_watch_redraws_until_interrupted(daemon, stop):
    proc = subprocess.Popen(
        [sys.executable, "-c", _IGNORING_SIGINT, "--socket", daemon.socket_path, "--name", daemon.name,
         "stats", "--watch", "0.2", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        first = json.loads(proc.stdout.readline())
        with wheeld.connect(daemon.socket_path, group="w") as w:
            w.add("k", 600_000)
            w.flush()
        end = time.monotonic() + 10
        while True:
            doc = json.loads(proc.stdout.readline())
            if doc["totals"]["adds_total"] == 1 or time.monotonic() > end:
                break
        assert doc["totals"]["adds_total"] == 1 and first["totals"]["adds_total"] == 0
        assert doc["rates_per_s"] is not None  # from the previous redraw
        os.kill(proc.pid, stop)
        # keep reading: redraws left in a full pipe would block its exit (the final flush)
        proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0


# ---------------------------------------------------------------------------- the checker alone
def _exercised_wheel(seed: int):
    """A private-memory wheel after a random mix of every operation, counters published."""
    from wheeld.shm.wheel import TimerWheel

    rng = np.random.default_rng(seed)
    wheel = TimerWheel.create(3000, tick_ms=int(rng.choice([1, 2, 10])), wheel_size=int(rng.choice([4, 16, 256])),
                              start_ms=1000)
    now = 1000
    for _ in range(4000):
        op = rng.random()
        key = int(rng.integers(0, 2500))
        if op < 0.55:
            wheel.schedule(key, now + int(rng.integers(-5, 200_000)), group=key % 3)
        elif op < 0.7:
            wheel.cancel(key, group=key % 3)
        elif op < 0.85:
            now += int(rng.integers(0, 5000))
            wheel.expire(now)
        else:
            for slot in wheel.fired_slots()[: int(rng.integers(0, 20))]:
                *_, generation = wheel.fired(slot)
                if rng.random() < 0.2:
                    wheel.rearm_fired(slot, generation, now + 100) or wheel.release(slot, generation)
                else:
                    wheel.release(slot, generation)
    wheel.publish_stats()
    return wheel


@pytest.mark.parametrize("seed", range(4))
def test_checker_finds_nothing_in_a_sound_wheel_and_catches_each_broken_link(seed):
    wheel = _exercised_wheel(seed)
    try:
        buf = wheel._seg.buf
        assert fsck(buf) == [] and wheel.check() == []
        info = parse_header(buf, len(buf), "w")
        first = wheel.first_entry
        rec = np.frombuffer(buf, dtype=L.RECORD_DTYPE, count=wheel.n_records, offset=info["header_bytes"])
        live = np.flatnonzero((rec["state"][first:] & L.STATE_MASK) != L.FREE) + first
        assert live.size
        rng = np.random.default_rng(seed)
        for slot in rng.choice(live, size=min(30, live.size), replace=False).tolist():
            base = info["header_bytes"] + slot * L.RECORD_BYTES
            for field, fmt in ((L.R_NEXT, "<i"), (L.R_PREV, "<i"), (L.R_STATE, "<B")):
                (saved,) = struct.unpack_from(fmt, buf, base + field)
                bad = int(rng.integers(0, wheel.n_records)) if fmt == "<i" else int(rng.choice([0, 0x21, 0x0F]))
                if bad == saved:
                    continue
                struct.pack_into(fmt, buf, base + field, bad)
                assert fsck(buf), f"record {slot}: field at {field} = {bad} went unnoticed"
                struct.pack_into(fmt, buf, base + field, saved)
        assert fsck(buf) == []
        # any byte anywhere in the records: a list of problems or CorruptArena, never a crash
        for _ in range(200):
            offset = int(rng.integers(0, len(buf)))
            saved = buf[offset]
            buf[offset] = int(rng.integers(0, 256))
            try:
                assert isinstance(fsck(buf), list)
            except CorruptArena:
                pass
            buf[offset] = saved
    finally:
        wheel.close()


def test_checker_flags_a_live_record_outside_the_group_table():
    from wheeld.shm.wheel import TimerWheel

    wheel = TimerWheel.create(10, max_groups=4, start_ms=1000)
    try:
        slot, _gen = wheel.schedule("k", 2000, group=wheel.group_id("g"))
        wheel.publish_stats()
        buf = wheel._seg.buf
        assert fsck(buf) == []
        info = parse_header(buf, len(buf), "w")
        struct.pack_into("<H", buf, info["header_bytes"] + slot * L.RECORD_BYTES + L.R_GROUP, 4)
        assert any(p.startswith("bad group: record") for p in fsck(buf))
        copy = mmap.mmap(-1, len(buf))
        try:
            copy[:] = bytes(buf)
            repairs, after = CK.recover_copy(copy, len(buf))
            assert repairs == [f"record {slot}: invalid state/key/group/deadline, freed"] and after == []
        finally:
            copy.close()
    finally:
        wheel.close()
