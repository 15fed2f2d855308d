"""A journal cut short before what was fsynced is damage, not a torn write.

A crash in the middle of a write loses only what was never synced: a torn tail lies
after the durable mark (``durable.mark``, written after each fsync, outside the
segments). A journal whose events end before the mark was cut short after the fact:
recovery reports it (ERROR, counters), ``wheelctl check --journal`` exits 1, and
``--journal-damage refuse`` refuses. A daemon that still has its arena notices it too
and writes a snapshot of the arena, so nothing is lost.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import wheeld
from daemon_harness import unique_name, unlink_segments
from hostile_harness import Honest
from wheeld.protocol import journal as pj
from wheeld.protocol.journal import Add
from wheeld.journal.files import Journal, list_segments, list_snapshots, read_mark
from wheeld.journal.recovery import JournalDamaged, check_journal, recover

T0 = 1_700_000_000_000


def _write(directory: Path, count: int, fsync: str = "always", segment_bytes: int = 64 << 20) -> Journal:
    journal = Journal(directory, fsync=fsync, segment_bytes=segment_bytes, host="h", name="mark")
    for index in range(count):
        journal.append([Add(t=T0, g="g", k=f"k{index}", d=T0 + 60_000, s=index + 1)], now_ms=index)
    return journal


def _tree(directory: Path) -> dict:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def _line_starts(path: Path) -> list[int]:
    data = path.read_bytes()
    starts, offset = [], 0
    for line in data.splitlines(keepends=True):
        starts.append(offset)
        offset += len(line)
    return starts


def _check(directory: Path):
    from click.testing import CliRunner

    from wheeld.ctl import main

    return CliRunner().invoke(main, ["check", "--journal", str(directory)], catch_exceptions=False)


# --------------------------------------------------------------------------- #
# The mark and recovery
# --------------------------------------------------------------------------- #


def test_the_mark_follows_the_fsyncs_and_never_passes_them(tmp_path):
    journal = _write(tmp_path / "always", 50)
    journal.flush_mark()
    assert journal.marked_lsn == journal.durable_lsn == 50
    journal.close()
    assert read_mark(tmp_path / "always") == 50
    assert (tmp_path / "always" / pj.MARK_NAME).stat().st_size == 2 * pj.MARK_SLOT
    # interval: the mark waits for the fsync; off: no fsync, no mark
    interval = _write(tmp_path / "interval", 10, fsync="interval=1000")
    interval.flush_mark()
    assert interval.durable_lsn == 0 and read_mark(tmp_path / "interval") == 0
    interval.start_sync(10_000)
    interval.poll_sync(wait=True)
    interval.flush_mark()
    assert read_mark(tmp_path / "interval") == 10
    interval.close()
    off = _write(tmp_path / "off", 10, fsync="off")
    off.close()
    assert read_mark(tmp_path / "off") == 0


def test_a_torn_slot_leaves_the_other_one():
    first, second = pj.encode_mark(41, T0), pj.encode_mark(42, T0)
    assert len(first) == pj.MARK_SLOT and pj.parse_mark(first + second) == 42
    assert pj.parse_mark(first + second[:30] + b"\0" * (pj.MARK_SLOT - 30)) == 41
    assert pj.parse_mark(b"") == 0 and pj.parse_mark(b"\0" * 256) == 0


@pytest.mark.parametrize("where", ["mid-line", "line boundary", "header only", "segment deleted"])
def test_a_segment_cut_short_after_its_fsync_is_damage_and_refused(tmp_path, where):
    journal = _write(tmp_path, 600, segment_bytes=40_000)
    journal.close()
    segments = list_segments(tmp_path)
    assert len(segments) >= 2 and read_mark(tmp_path) == 600
    newest = segments[-1][1]
    starts = _line_starts(newest)
    if where == "mid-line":
        os.truncate(newest, starts[len(starts) // 2] + 17)
    elif where == "line boundary":
        os.truncate(newest, starts[len(starts) // 2])
    elif where == "header only":
        os.truncate(newest, starts[1])
    else:
        newest.unlink()
    before = _tree(tmp_path)
    report = check_journal(tmp_path)
    assert not report.ok
    (damage,) = report.damage
    assert damage.reason == pj.TRUNCATED and damage.lost_lsns[1] == 600 and damage.lost == 600 - damage.lost_lsns[0] + 1
    assert damage.lost_lsns[0] <= 600 and report.torn == []
    result = _check(tmp_path)
    assert result.exit_code == 1 and "truncated" in result.stdout, result.stdout
    with pytest.raises(JournalDamaged, match="refusing to start"):
        recover(tmp_path, on_damage="refuse")
    assert _tree(tmp_path) == before, "a refusal changes nothing"
    state = recover(tmp_path)
    assert [d.reason for d in state.damage] == [pj.TRUNCATED] and state.torn == []
    assert state.last_lsn == 600, "the journal continues after the mark: no durable lsn is used twice"
    assert len(state.pending) == damage.lost_lsns[0] - 1


def test_a_torn_write_after_the_mark_is_still_only_a_torn_tail(tmp_path):
    journal = _write(tmp_path, 100)
    journal.close()
    newest = list_segments(tmp_path)[-1][1]
    with open(newest, "ab") as file:  # the next batch, cut short by a crash before its fsync
        file.write(pj.encode_events([Add(n=101, t=T0, g="g", k="x", d=T0, s=9)])[:-12])
    report = check_journal(tmp_path)
    assert report.ok and len(report.torn) == 1
    state = recover(tmp_path, on_damage="refuse")
    assert state.damage == [] and len(state.torn) == 1 and state.last_lsn == 100 and len(state.pending) == 100
    # unsynced events of an interval journal cut away: torn, not damage
    other = tmp_path / "interval"
    journal = _write(other, 20, fsync="interval=1000")
    journal.start_sync(10_000)
    journal.poll_sync(wait=True)
    journal.flush_mark()
    for index in range(20, 30):
        journal.append([Add(t=T0, g="g", k=f"k{index}", d=T0, s=1)], now_ms=20_000)
    # the power cut: the disk keeps what was fsynced (and the mark) and 50 bytes more
    crash = tmp_path / "crash"
    crash.mkdir()
    for path in other.iterdir():
        (crash / path.name).write_bytes(path.read_bytes())
    cut = crash / journal.segment_path.name
    os.truncate(cut, journal._durable_size + 50)
    journal.close()
    state = recover(crash, on_damage="refuse")
    assert state.damage == [] and len(state.torn) == 1 and state.last_lsn == 20


# --------------------------------------------------------------------------- #
# Through a real daemon
# --------------------------------------------------------------------------- #


def _collect(client, keys: set, timeout_s: float) -> list:
    got = []
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and not keys <= {expired.key for expired in got}:
        got.extend(client.poll(0.1))
    return got


def _cut_newest_segment_in_the_middle(journal: Path) -> Path:
    newest = list_segments(journal)[-1][1]
    starts = _line_starts(newest)
    os.truncate(newest, starts[len(starts) // 2] + 10)
    return newest


@pytest.mark.timeout(180)
def test_a_rebooted_daemon_refuses_or_reports_a_journal_cut_short(daemon_factory, tmp_path):
    journal = tmp_path / "journal"
    d = daemon_factory(extra=["--journal", str(journal), "--fsync", "always"]).start()
    keys = {f"t-{index}" for index in range(600)}
    with wheeld.connect(d.socket_path, group="durable") as client:
        for index, key in enumerate(sorted(keys)):
            client.add(key, 600_000)
            if index % 50 == 49:
                client.flush()  # fsync=always: on disk now, batch by batch
    d.kill()
    unlink_segments(d.name)  # the reboot
    _cut_newest_segment_in_the_middle(journal)
    before = _tree(journal)
    # --journal-damage refuse: one line, exit 65, nothing changed
    name = unique_name()
    command = [sys.executable, "-m", "wheeld.daemon.cli", "--socket", str(tmp_path / "refuse.sock"), "--name", name,
               "--capacity", "10000", "--journal", str(journal), "--journal-damage", "refuse"]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    finally:
        unlink_segments(name)
    assert result.returncode == 65, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"wheeld: journal {journal} is damaged") and "refusing to start" in last
    assert "Traceback" not in result.stderr and _tree(journal) == before
    checked = _check(journal)
    assert checked.exit_code == 1 and "truncated" in checked.stdout
    # skip: it starts with what is left, loudly, and serves
    d.start()
    log = d.log()
    assert "ERROR journal: damaged range:" in log and "truncated" in log
    counters = d.counters()
    assert counters["journal_damaged_ranges_total"] == 1
    assert 0 < counters["pending"] < 600
    honest = Honest(tmp_path, d.socket_path)
    try:
        honest.wait_served(50)
        honest.finish()
    finally:
        honest.kill()


@pytest.mark.timeout(180)
def test_a_restarted_daemon_rebuilds_a_journal_cut_short_from_its_arena(daemon_factory, tmp_path):
    journal = tmp_path / "journal"
    d = daemon_factory(extra=["--journal", str(journal), "--fsync", "always"]).start()
    keys = {f"t-{index}" for index in range(600)}
    honest = Honest(tmp_path, d.socket_path)
    try:
        with wheeld.connect(d.socket_path, group="durable") as client:
            for key in sorted(keys):
                client.add(key, 6_000)
            client.flush()
            d.kill()  # no reboot: the arena survives
            _cut_newest_segment_in_the_middle(journal)
            d.start()
            log = d.log()
            assert "ERROR journal: damaged range:" in log and "cut away after they were synced" in log
            assert d.counters()["journal_damaged_ranges_total"] == 1
            snapshots = list_snapshots(journal)
            assert snapshots, "a snapshot of the arena was written at once"
            client.flush()
            honest.wait_served(50)
            honest.finish()
            d.kill()
            unlink_segments(d.name)  # now the reboot: the journal alone must hold every timer
            state = recover(journal, repair=False)
            assert {key for _group, key in state.pending} | {t.key for t in state.unacked} >= keys
            d.start()
            got = _collect(client, keys, 30)
    finally:
        honest.kill()
    assert set(collections.Counter(e.key for e in got)) >= keys
    for e in got:
        assert e.fired_ms >= e.deadline_ms
