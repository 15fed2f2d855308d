"""A journal that survives damage: bad lines in the middle are skipped and counted, only a
damaged tail of the newest segment is a torn write, damaged snapshots fall back, and the
damage is loud (log, counters, ``wheelctl check --journal``, ``--journal-damage refuse``).

The main test writes a 2,000-timer journal through the daemon's own ``Recorder`` and
``Journal`` (segments, a snapshot in the middle, fires and acks), then changes one byte at
100 seeded random offsets, each time in a fresh copy, and recovers in-process. For every
offset the test predicts from the file's lines alone what recovery must lose and report:

* a byte of a segment line the snapshot does not cover: that line's event is lost (a
  damaged newline joins two lines: both events), the rest is kept, one damaged range is
  reported, with the lost lsns;
* the header line of a segment recovery reads: reported, nothing lost (unless its newline
  joined it with an event recovery needs);
* the tail of the newest segment (no good line after the damage): a torn write, cut as
  after a crash, those events lost, not counted as damage;
* a line the snapshot covers, or a segment recovery does not read: nothing lost, nothing
  reported;
* the snapshot: the journal from lsn 1 replaces it, nothing lost, the snapshot reported.
"""

from __future__ import annotations

import collections
import json
import time
import contextlib
import hashlib
import os
import random
import shutil
import stat
import uuid
from pathlib import Path
from unittest import mock

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from daemon_harness import wait_until

from wheeld.journal.files import DIR_MODE, FILE_MODE, Journal, list_segments, list_snapshots
from wheeld.journal.recovery import JournalDamaged, check_journal, recover
from wheeld.protocol import journal as pj
from wheeld.protocol.journal import Ack, Add, Cancel, Fire, IdleRearm, Rearm, key_to_json

T0 = 1_700_000_000_000
TIMERS = 2_000
OFFSETS = 100


@contextlib.contextmanager
def no_fsync():
    with mock.patch.object(os, "fsync", lambda fd: None):
        yield


# --------------------------------------------------------------------------- #
# A journal written by the daemon's code path
# --------------------------------------------------------------------------- #


def write_recorded_journal(directory: Path, timers: int = TIMERS, seed: int = 7) -> None:
    """``timers`` adds (str, int and bytes keys, two groups) with re-arms, cancels, fires and
    acks, through ``Recorder`` over a real arena; 64 KiB segments; a snapshot half-way."""
    from wheeld.daemon.recorder import Recorder
    from wheeld.shm.wheel import TimerWheel

    rng = random.Random(seed)
    wheel = TimerWheel.create(8192, tick_ms=1, wheel_size=64, name=f"/wheeld-test-{os.getpid()}-{uuid.uuid4().hex[:8]}",
                              start_ms=1_000)
    try:
        with no_fsync():
            journal = Journal(directory, fsync="off", segment_bytes=64 * 1024, host="test-host", name="damage")
            recorder = Recorder(journal, wheel, snapshot_every_events=10**9, snapshot_every_s=1e9)
            groups = [wheel.group_id("conns"), wheel.group_id("jobs")]
            armed: list = []
            now = 1_000
            seq = 0
            for index in range(timers):
                recorder.begin()
                seq += 1
                key = (f"conn-{index}", index, b"b%d" % index)[index % 3]
                group = groups[index % 2]
                deadline = now + rng.randint(1, 4_000)
                previous = wheel.lookup(key, group)
                wheel.schedule(key, deadline, group, seq)
                recorder.armed(group, key, deadline, seq, previous, None)
                armed.append((key, group))
                roll = rng.random()
                if roll < 0.1:  # cancel an earlier timer (a miss if it fired already)
                    key, group = rng.choice(armed)
                    seq += 1
                    previous = wheel.lookup(key, group)
                    wheel.cancel(key, group)
                    recorder.cancelled(group, key, seq, previous)
                elif roll < 0.2:  # re-arm an earlier one
                    key, group = rng.choice(armed)
                    seq += 1
                    deadline = now + rng.randint(1, 4_000)
                    previous = wheel.lookup(key, group)
                    wheel.schedule(key, deadline, group, seq)
                    recorder.armed(group, key, deadline, seq, previous, None)
                if index % 16 == 15:  # time passes: fire what is due, acknowledge most of it
                    now += 40
                    for slot in wheel.expire(now):
                        key, deadline, group, tag, _aux, generation = wheel.fired(slot)
                        recorder.fired(group, key, deadline, tag, now, False, None)
                        if rng.random() < 0.8:
                            wheel.release(slot, generation)
                            recorder.acked(group, key, tag)
                recorder.commit(now)
                if index == timers // 2:
                    recorder.snapshot()
            recorder.commit(now)
            journal.close()
    finally:
        wheel.close()
        wheel.unlink()


class Line(msgspec.Struct):
    path: Path
    start: int
    end: int  # just past its newline
    lsn: int | None  # None: the segment header
    event: object


class Journaled:
    """The clean journal, line by line: what the predictions are made from."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.segments = list_segments(directory)
        ((self.snapshot_lsn, self.snapshot_path),) = list_snapshots(directory)
        self.lines: dict[Path, list[Line]] = {}
        self.events: dict[int, object] = {}
        for first_lsn, path in self.segments:
            data = path.read_bytes()
            offset, lines = 0, []
            for number, raw in enumerate(data.splitlines(keepends=True)):
                event = pj.decode_line(raw)
                lsn = None if number == 0 else first_lsn + number - 1
                assert lsn is None or event.n == lsn
                lines.append(Line(path, offset, offset + len(raw), lsn, event))
                if lsn is not None:
                    self.events[lsn] = event
                offset += len(raw)
            self.lines[path] = lines
        self.last_lsn = max(self.events)
        # recovery starts at the last segment whose first lsn <= snapshot lsn + 1
        self.first_read = max(index for index, (first, _) in enumerate(self.segments) if first <= self.snapshot_lsn + 1)
        _, pending, unacked = pj.parse_snapshot(self.snapshot_path.read_bytes())
        self.base_pending = {(timer.g, timer.k): timer.s for timer in pending}
        self.base_unacked = {(timer.g, timer.k, timer.s) for timer in unacked}

    def files(self) -> list[Path]:
        return [path for _, path in self.segments] + [self.snapshot_path]

    def expected_state(self, lost: set[int], from_scratch: bool = False):
        """The reference model (protocol/journal.py) replayed without the ``lost`` events."""
        pending = {} if from_scratch else dict(self.base_pending)
        unacked = set() if from_scratch else set(self.base_unacked)
        first = 1 if from_scratch else self.snapshot_lsn + 1
        for lsn in range(first, self.last_lsn + 1):
            if lsn in lost:
                continue
            event = self.events[lsn]
            kind, at = type(event), (event.g, event.k)
            if kind in (Add, Rearm):
                pending[at] = event.s
            elif kind is Cancel:
                pending.pop(at, None)
            elif kind is Fire:
                pending.pop(at, None)
                unacked.add((*at, event.s))
            elif kind is Ack:
                if (*at, event.s) in unacked:
                    unacked.discard((*at, event.s))
                elif pending.get(at) == event.s:
                    del pending[at]  # an ack whose fire was not journaled ends that arming
            elif kind is IdleRearm and at not in pending:
                pending[at] = event.s
        return pending, unacked


def recovered_state(state):
    pending = {(group, key_to_json(key)): timer.seq for (group, key), timer in state.pending.items()}
    unacked = {(timer.group, key_to_json(timer.key), timer.seq) for timer in state.unacked}
    return pending, unacked


class Prediction(msgspec.Struct):
    kind: str  # "skipped", "header", "torn", "nothing", "snapshot"
    lost: set
    lines: int  # damaged lines recovery sees (0 when it sees none)


def predict(journal: Journaled, path: Path, offset: int, new_byte: int) -> Prediction:
    """What one changed byte must cost, from the clean file's lines alone."""
    if path == journal.snapshot_path:
        return Prediction("snapshot", set(), 0)
    lines = journal.lines[path]
    index = next(i for i, line in enumerate(lines) if line.start <= offset < line.end)
    was_newline = offset == lines[index].end - 1
    affected = [index, index + 1] if was_newline and index + 1 < len(lines) else [index]
    segment_index = next(i for i, (_, p) in enumerate(journal.segments) if p == path)
    if segment_index < journal.first_read:
        return Prediction("nothing", set(), 0)
    lsns = [lines[i].lsn for i in affected]
    lost = {lsn for lsn in lsns if lsn is not None and lsn > journal.snapshot_lsn}
    physical = 2 if new_byte == ord("\n") else 1
    newest = segment_index == len(journal.segments) - 1
    if newest and affected[-1] == len(lines) - 1:
        return Prediction("torn", lost, physical)
    if lost:
        return Prediction("skipped", lost, physical)
    if None in lsns:
        return Prediction("header", set(), physical)
    return Prediction("nothing", set(), 0)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Journaled:
    directory = tmp_path_factory.mktemp("recorded") / "journal"
    write_recorded_journal(directory)
    journal = Journaled(directory)
    assert len(journal.segments) >= 4 and journal.first_read >= 1  # some segments are never read
    assert journal.snapshot_lsn < journal.last_lsn - 500
    kinds = collections.Counter(type(event).__name__ for event in journal.events.values())
    assert kinds["Add"] >= TIMERS and kinds["Cancel"] and kinds["Rearm"] and kinds["Fire"] and kinds["Ack"]
    return journal


def test_one_changed_byte_costs_at_most_its_lines(recorded, tmp_path):
    clean = recover(recorded.directory, repair=False, quiet=True)
    assert clean.problems == [] and clean.damage == []
    clean_pending, clean_unacked = recovered_state(clean)
    assert (clean_pending, clean_unacked) == recorded.expected_state(set())
    assert len(clean_pending) > 300 and clean_unacked

    rng = random.Random(2024)
    files = recorded.files()
    sizes = [path.stat().st_size for path in files]
    cases = []  # (file, offset, new byte or None for a random one)
    for _ in range(OFFSETS):  # anywhere: most of the bytes are in the middle of segments
        position = rng.randrange(sum(sizes))
        for path, size in zip(files, sizes):  # noqa: B007 - path is the one the loop stops at
            if position < size:
                break
            position -= size
        cases.append((path, position, None))
    cases += targeted_cases(recorded)
    seen = collections.Counter()
    for run, (path, position, new) in enumerate(cases):
        copy = tmp_path / f"run-{run}"
        shutil.copytree(recorded.directory, copy)
        victim = copy / path.name
        data = bytearray(victim.read_bytes())
        old = data[position]
        if new is None:  # any other byte; a newline more often (it splits a line in two)
            new = rng.choice([b for b in range(256) if b != old] + ([ord("\n")] * 20 if old != ord("\n") else []))
        data[position] = new
        victim.write_bytes(bytes(data))
        expected = predict(recorded, path, position, new)
        seen[expected.kind] += 1
        where = f"run {run}: {path.name} byte {position} {old:#x} -> {new:#x}, predicted {expected.kind}"

        report = check_journal(copy)  # changes nothing; lists every damaged byte on disk
        if expected.kind == "torn":
            assert report.ok and len(report.torn) == 1, where
        else:
            (listed,) = [item for item in report.damage if item.start <= position < item.end]
            assert not report.ok and listed.path == str(victim), where
            assert ("not read by recovery" in listed.action) == (expected.kind == "nothing"), where

        state = recover(copy, quiet=True)

        pending, unacked = recovered_state(state)
        lost = expected.lost
        assert len(lost) <= 2, where
        assert (pending, unacked) == recorded.expected_state(lost, from_scratch=expected.kind == "snapshot"), where
        if expected.kind in ("skipped", "header"):
            (damage,) = state.damage
            assert damage.path == str(victim) and damage.start <= position < damage.end, where
            assert damage.lines == expected.lines and state.torn == [], where
            assert damage.lost == len(lost) and damage.lost_lsns == ((min(lost), max(lost)) if lost else None), where
            assert victim.read_bytes() == bytes(data), where  # damage in the middle stays as evidence
        elif expected.kind == "torn":
            (torn,) = state.torn
            assert state.damage == [] and torn.path == str(victim) and torn.offset <= position, where
            assert victim.stat().st_size == torn.offset, where  # cut as after a crash
        elif expected.kind == "snapshot":
            assert state.snapshot_lsn == 0 and state.torn == [], where
            assert state.damage and all(item.path == str(victim) and item.lost == 0 for item in state.damage), where
            assert any(item.start <= position < item.end for item in state.damage), where
            assert not victim.exists() and victim.with_name(victim.name + ".corrupt").exists(), where
        else:
            assert state.damage == [] and state.torn == [] and state.problems == [], where
        shutil.rmtree(copy)
    # every kind of place was hit (the random offsets alone: skipped, nothing, snapshot)
    assert set(seen) == {"skipped", "header", "torn", "nothing", "snapshot"}, seen


def targeted_cases(journal: Journaled) -> list:
    """Places random offsets rarely hit: the newest segment's tail, headers, the snapshot's edge."""
    newline = ord("\n")
    newest = journal.lines[journal.segments[-1][1]]
    read = journal.lines[journal.segments[journal.first_read + 1][1]]
    start = journal.lines[journal.segments[journal.first_read][1]]
    boundary = next(line for line in start if line.lsn == journal.snapshot_lsn)
    covered = next(line for line in start if line.lsn is not None and line.lsn < journal.snapshot_lsn)
    last, before_last = newest[-1], newest[-2]
    return [
        (last.path, last.start + 20, None),  # the last line: a torn write
        (last.path, last.end - 1, ord(" ")),  # its newline: an unterminated tail
        (before_last.path, before_last.end - 1, ord(" ")),  # joined with the last line: both lost
        (last.path, last.end - 2, newline),  # split in two at the end
        (newest[0].path, newest[0].start + 5, None),  # the newest segment's header
        (read[0].path, read[0].end - 1, ord("x")),  # a header joined with the first event
        (boundary.path, boundary.end - 1, ord("x")),  # the last covered event joined with the first needed one
        (covered.path, covered.start + 30, newline),  # a covered line split in two: count of lines off
        (start[0].path, start[0].start + 5, None),  # the header of the segment recovery starts in
    ]


# --------------------------------------------------------------------------- #
# The line scanner
# --------------------------------------------------------------------------- #


def _segment(count: int = 12) -> tuple[bytes, list[bytes]]:
    header = pj.SegmentHeader(host="h", name="n", lsn=1, t=T0, mono0=0, wall0=T0)
    events = [Add(n=n, t=T0, g="g", k=f"key-{n}", d=T0 + n, s=n) for n in range(1, count + 1)]
    lines = [pj.encode_event(line) for line in [header, *events]]
    return b"".join(lines), lines


def test_scan_lines_agrees_with_the_strict_reader_on_a_whole_segment():
    data, _ = _segment()
    for skip in range(0, 14):
        events, good_end, defect = pj.scan_segment(data, skip_events=skip)
        scan = pj.scan_lines(data, skip_events=skip)
        assert defect is None and scan.bad == [] and scan.good_end == good_end == len(data)
        assert scan.header == events[0] and scan.events == events[1:]


@given(st.data())
@settings(max_examples=300, deadline=None)
def test_scan_lines_never_raises_and_places_every_bad_line(draw):
    data, lines = _segment()
    changed = bytearray(data)
    for _ in range(draw.draw(st.integers(0, 4))):
        changed[draw.draw(st.integers(0, len(data) - 1))] = draw.draw(st.integers(0, 255))
    cut = draw.draw(st.integers(0, len(changed)))
    changed = bytes(changed[:cut]) + draw.draw(st.binary(max_size=40))
    skip = draw.draw(st.integers(0, 3))
    scan = pj.scan_lines(changed, skip_events=skip)
    originals = {pj.encode_event(event) for event in scan.events}
    assert originals <= set(lines)  # nothing invented: every event read is a line that was written
    previous_end = 0
    for part in scan.parts:
        if type(part) is pj.BadLines:
            assert previous_end <= part.start < part.end <= len(changed) and part.lines >= 1
            previous_end = part.end
    at_end = [part.at_end for part in scan.parts if type(part) is pj.BadLines]
    assert at_end == sorted(at_end)  # the ranges at the end come last
    assert 0 <= scan.good_end <= len(changed)


# --------------------------------------------------------------------------- #
# Particular cases
# --------------------------------------------------------------------------- #


def make_journal(path, **kwargs) -> Journal:
    kwargs.setdefault("host", "test-host")
    kwargs.setdefault("fsync", "off")
    return Journal(path, **kwargs)


def _lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


def _damage_line(path: Path, number: int, at: int = 12) -> int:
    """Flip a bit in line ``number`` (0-based, 0 is the header); return the line's offset."""
    lines = _lines(path)
    start = sum(map(len, lines[:number]))
    data = bytearray(path.read_bytes())
    data[start + at] ^= 0x01
    path.write_bytes(bytes(data))
    return start


def test_a_damaged_newline_costs_the_two_lines_it_joins(tmp_path):
    with make_journal(tmp_path) as journal:
        for index in range(20):
            journal.append([Add(t=T0, g="g", k=f"k{index}", d=T0 + index, s=index)])
    path = list_segments(tmp_path)[0][1]
    lines = _lines(path)
    data = bytearray(path.read_bytes())
    newline = sum(map(len, lines[:8])) - 1  # the end of line 7 (lsn 7)
    data[newline] = ord(" ")
    path.write_bytes(bytes(data))
    state = recover(tmp_path)
    (damage,) = state.damage
    assert (damage.lines, damage.lost, damage.lost_lsns) == (1, 2, (7, 8))
    assert damage.start == sum(map(len, lines[:7])) and damage.end == sum(map(len, lines[:9]))
    assert sorted(key for _, key in state.pending) == sorted(f"k{i}" for i in range(20) if i not in (6, 7))
    assert state.last_lsn == 20


def test_a_skipped_cancel_brings_the_arming_back(tmp_path):
    """The event lost is the cancel: the state is as if it had never been sent."""
    with make_journal(tmp_path) as journal:
        journal.append([Add(t=T0, g="g", k="a", d=T0 + 10, s=1), Add(t=T0, g="g", k="b", d=T0 + 20, s=2)])
        journal.append([Cancel(t=T0, g="g", k="a", s=3, hit=True, pd=T0 + 10)])
        journal.append([Add(t=T0, g="g", k="c", d=T0 + 30, s=4)])
    path = list_segments(tmp_path)[0][1]
    _damage_line(path, 3)
    state = recover(tmp_path)
    assert {key: timer.seq for (_, key), timer in state.pending.items()} == {"a": 1, "b": 2, "c": 4}
    (damage,) = state.damage
    assert damage.lost_lsns == (3, 3) and "skipped" in damage.action


def test_damage_in_several_places_is_several_ranges(tmp_path):
    with make_journal(tmp_path, segment_bytes=2_000) as journal:
        for index in range(60):
            journal.append([Add(t=T0, g="g", k=index, d=T0 + index, s=index)])
    segments = list_segments(tmp_path)
    assert len(segments) >= 3
    _damage_line(segments[0][1], 3)
    _damage_line(segments[0][1], 4)  # adjacent: the same range
    _damage_line(segments[1][1], 0)  # a header: nothing lost
    _damage_line(segments[1][1], 2)
    state = recover(tmp_path)
    assert [(item.lines, item.lost) for item in state.damage] == [(2, 2), (1, 0), (1, 1)]
    assert len(state.pending) == 57 and state.last_lsn == 60
    assert sum(item.lines for item in state.damage) == state.damaged_lines == 4


def test_events_missing_without_damage_are_a_range_of_their_own(tmp_path):
    with make_journal(tmp_path, segment_bytes=300) as journal:
        for index in range(20):
            journal.append([Add(t=T0, g="g", k=index, d=T0, s=index)])
    segments = list_segments(tmp_path)
    os.unlink(segments[1][1])
    state = recover(tmp_path)
    (gap,) = state.damage
    first, last = segments[1][0], segments[2][0] - 1
    assert (gap.reason, gap.lines, gap.lost_lsns, gap.lost) == (pj.LSN_GAP, 0, (first, last), last - first + 1)


def test_nul_bytes_in_the_middle_are_damage_at_the_end_a_torn_tail(tmp_path):
    with make_journal(tmp_path) as journal:
        for index in range(10):
            journal.append([Add(t=T0, g="g", k=index, d=T0, s=index)])
    path = list_segments(tmp_path)[0][1]
    lines = _lines(path)
    middle = sum(map(len, lines[:4]))
    data = path.read_bytes()
    zeros = data[:middle] + b"\x00" * (len(lines[4]) - 1) + data[middle + len(lines[4]) - 1:]
    path.write_bytes(zeros + b"\x00" * 512)
    state = recover(tmp_path)
    (damage,) = state.damage
    (torn,) = state.torn
    assert damage.lost_lsns == (4, 4) and torn.reason == pj.TORN and torn.offset == len(data)
    assert path.read_bytes() == zeros


def _snapshot_history(tmp_path):
    """Two snapshots, compaction, events after each: returns the journal's final pending keys."""
    pending: dict = {}
    journal = make_journal(tmp_path, segment_bytes=600)
    from wheeld.journal.files import PendingTimer

    for round_number in range(3):
        batch = [Add(t=T0, g="g", k=f"r{round_number}-{i}", d=T0 + i, s=i) for i in range(8)]
        journal.append(batch)
        for event in batch:
            pending[event.k] = event.s
        journal.write_snapshot(journal.last_lsn, [PendingTimer("g", k, T0, s) for k, s in pending.items()])
    journal.append([Add(t=T0, g="g", k="after", d=T0, s=99)])
    pending["after"] = 99
    journal.close()
    return pending


def test_a_damaged_snapshot_falls_back_to_the_older_one(tmp_path):
    pending = _snapshot_history(tmp_path)
    (older_lsn, _), (newer_lsn, newer) = list_snapshots(tmp_path)
    _damage_line(newer, 3)
    state = recover(tmp_path)
    assert state.snapshot_lsn == older_lsn and {key for _, key in state.pending} == set(pending)
    (damage,) = state.damage
    assert damage.path == str(newer) and damage.lost == 0 and damage.lines == 1
    assert damage.cost() == "nothing lost" and f"snapshot-{older_lsn} and the journal after it" in damage.action


def test_two_damaged_snapshots_without_the_journal_are_salvaged_line_by_line(tmp_path, caplog):
    pending = _snapshot_history(tmp_path)
    (older_lsn, older), (newer_lsn, newer) = list_snapshots(tmp_path)
    assert list_segments(tmp_path)[0][0] == older_lsn + 1 > 1  # compaction removed what the older one covers
    _damage_line(older, 2)
    lost_line = _lines(newer)[5]
    _damage_line(newer, 5)
    with caplog.at_level("ERROR", logger="wheeld.journal"):
        state = recover(tmp_path)
    lost_key = msgspec.json.decode(lost_line)["k"]
    assert state.snapshot_lsn == newer_lsn
    assert {key for _, key in state.pending} == set(pending) - {lost_key}
    salvaged = [item for item in state.damage if item.path == str(newer)]
    assert [(item.lines, item.lost) for item in salvaged] == [(1, 1)] and "salvaged" in salvaged[0].action
    assert newer.exists()  # the salvaged snapshot stays until a new one replaces it
    assert any("damaged range" in record.getMessage() and newer.name in record.getMessage()
               for record in caplog.records if record.levelname == "ERROR")


def _tree(directory: Path) -> dict:
    return {path.name: (hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mode)
            for path in sorted(directory.iterdir())}


def test_refuse_raises_and_changes_nothing(tmp_path):
    with make_journal(tmp_path) as journal:
        for index in range(30):
            journal.append([Add(t=T0, g="g", k=index, d=T0, s=index)])
    path = list_segments(tmp_path)[0][1]
    _damage_line(path, 10)
    with open(path, "ab") as file:
        file.write(b'{"ev":"add","v":1,"n":31,"t"')  # and a torn tail, which skip would cut
    (tmp_path / "snapshot-0000000000000005.jsonl.tmp").write_bytes(b"leftover")
    before = _tree(tmp_path)
    with pytest.raises(JournalDamaged) as caught:
        recover(tmp_path, on_damage="refuse")
    message = str(caught.value)
    assert "\n" not in message and path.name in message and "lsn 10" in message
    assert "refusing to start" in message and "wheelctl check --journal" in message
    assert _tree(tmp_path) == before
    state = recover(tmp_path, on_damage="skip")  # skip recovers and repairs
    assert len(state.pending) == 29 and len(state.damage) == 1 and len(state.torn) == 1
    assert not (tmp_path / "snapshot-0000000000000005.jsonl.tmp").exists()
    # a clean journal (a torn tail is not damage) starts under refuse
    clean = tmp_path / "clean"
    with make_journal(clean) as journal:
        journal.append([Add(t=T0, g="g", k=1, d=T0, s=1)])
    with open(list_segments(clean)[0][1], "ab") as file:
        file.write(b'{"ev":"add"')
    assert len(recover(clean, on_damage="refuse").torn) == 1


def test_check_journal_lists_damage_recovery_does_not_read(tmp_path):
    from wheeld.journal.files import PendingTimer

    journal = make_journal(tmp_path)
    journal.append([Add(t=T0, g="g", k=index, d=T0, s=index) for index in range(10)])
    journal.write_snapshot(10, [PendingTimer("g", index, T0, index) for index in range(10)])
    journal.append([Add(t=T0, g="g", k=index, d=T0, s=index) for index in range(10, 20)])
    journal.close()
    assert check_journal(tmp_path).ok
    path = list_segments(tmp_path)[0][1]
    _damage_line(path, 3)  # covered by the snapshot
    _damage_line(path, 15)  # after it
    assert len(recover(tmp_path, repair=False, quiet=True).damage) == 1
    report = check_journal(tmp_path)
    assert not report.ok
    assert [(item.first_line, item.lost) for item in report.damage] == [(16, 1), (4, 0)]
    assert "snapshot-10 covers these events" in report.damage[1].action
    as_dict = report.to_dict()
    assert as_dict["damaged_ranges"] == 2 and as_dict["lost_events"] == 1 and not as_dict["ok"]


# --------------------------------------------------------------------------- #
# File modes
# --------------------------------------------------------------------------- #


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077])
def test_journal_files_are_0640_and_the_directory_0750_whatever_the_umask(tmp_path, umask):
    from wheeld.journal.files import PendingTimer

    directory = tmp_path / "a" / "journal"
    old = os.umask(umask)
    try:
        journal = make_journal(directory, segment_bytes=200)
        for index in range(10):
            journal.append([Add(t=T0, g="g", k=index, d=T0, s=index)])
        journal.write_snapshot(journal.last_lsn, [PendingTimer("g", 1, T0, 1)])
        journal.close()
        newest = list_segments(directory)[-1][1]
        with open(newest, "ab") as file:
            file.write(b'{"ev":"add","v":1,"n":99}\n{"ev"')  # a torn tail with a complete line: kept aside
        recover(directory)
    finally:
        os.umask(old)
    assert _mode(directory) == DIR_MODE
    files = list(directory.iterdir())
    assert {path.name.split("-")[0] for path in files} == {"journal", "snapshot", pj.MARK_NAME}
    assert any(".cut-" in path.name for path in files)
    assert {path.name: _mode(path) for path in files} == {path.name: FILE_MODE for path in files}


def test_an_existing_wide_directory_and_its_files_are_tightened(tmp_path, caplog):
    directory = tmp_path / "journal"
    directory.mkdir(mode=0o755)
    os.chmod(directory, 0o755)
    with make_journal(directory) as journal:
        journal.append([Add(t=T0, g="g", k=1, d=T0, s=1)])
    old_segment = list_segments(directory)[0][1]
    os.chmod(old_segment, 0o644)  # as journals were written before
    os.chmod(directory, 0o777)
    with caplog.at_level("WARNING", logger="wheeld.journal"):
        make_journal(directory).close()
    assert _mode(directory) == 0o750 and _mode(old_segment) == 0o640
    messages = [record.getMessage() for record in caplog.records]
    assert any("777" in message and "750" in message for message in messages)
    assert any("644" in message for message in messages)
    os.chmod(directory, 0o700)  # narrower than 0750 stays as it is
    make_journal(directory).close()
    assert _mode(directory) == 0o700


# --------------------------------------------------------------------------- #
# wheelctl check --journal
# --------------------------------------------------------------------------- #


def _check(directory: Path, *args: str):
    from click.testing import CliRunner

    from wheeld.ctl import main

    return CliRunner().invoke(main, ["check", "--journal", str(directory), *args], catch_exceptions=False)


def test_wheelctl_check_journal_lists_ranges_and_exits_1_on_damage(tmp_path):
    with make_journal(tmp_path, segment_bytes=1_500) as journal:
        for index in range(40):
            journal.append([Add(t=T0, g="g", k=f"k{index}", d=T0 + index, s=index)])
    clean = _check(tmp_path)
    assert clean.exit_code == 0 and clean.stdout.startswith("ok: journal ") and "40 pending" in clean.stdout
    segments = list_segments(tmp_path)
    with open(segments[-1][1], "ab") as file:
        file.write(b'{"ev":"add","v":1')  # a torn tail alone is not damage
    torn = _check(tmp_path)
    assert torn.exit_code == 0 and "torn tail" in torn.stdout
    start = _damage_line(segments[1][1], 2)
    before = _tree(tmp_path)
    result = _check(tmp_path)
    assert result.exit_code == 1, result.stdout
    assert result.stdout.startswith("DAMAGED: journal ") and "1 damaged range, 1 line, 1 event lost" in result.stdout
    assert f"{segments[1][1].name} bytes {start}-" in result.stdout and "(line 3, 1 line)" in result.stdout
    assert (f"1 event lost (lsn {segments[1][0] + 1})" in result.stdout
            and "the events after it are kept" in result.stdout)
    as_json = json.loads(_check(tmp_path, "--json").stdout)
    assert as_json["ok"] is False and as_json["damage"][0]["start"] == start and as_json["damaged_lines"] == 1
    assert _tree(tmp_path) == before  # check never writes
    missing = _check(tmp_path / "nope")
    assert missing.exit_code == 2


# --------------------------------------------------------------------------- #
# Through a real daemon
# --------------------------------------------------------------------------- #


def _wheelctl(daemon, *args):
    from click.testing import CliRunner

    from wheeld.ctl import main

    return CliRunner().invoke(main, ["--socket", daemon.socket_path, "--name", daemon.name, *args],
                              catch_exceptions=False)


def _collect(client, keys: set, timeout_s: float) -> list:
    got = []
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and not keys <= {expired.key for expired in got}:
        got.extend(client.poll(0.1))
    return got


def _journal_lines(directory: Path) -> list[tuple[Path, int, dict]]:
    """(segment, offset, decoded line) of every line of every segment."""
    found = []
    for _, path in list_segments(directory):
        offset = 0
        for raw in path.read_bytes().splitlines(keepends=True):
            found.append((path, offset, msgspec.json.decode(raw)))
            offset += len(raw)
    return found


@pytest.mark.timeout(120)
def test_a_rebooted_daemon_delivers_all_but_the_damaged_lines_timers(daemon_factory, tmp_path):
    import wheeld
    from daemon_harness import unlink_segments

    journal = tmp_path / "journal"
    d = daemon_factory(extra=["--journal", str(journal), "--fsync", "always"]).start()
    keys = {f"t-{index}" for index in range(600)}
    with wheeld.connect(d.socket_path, group="durable") as client:
        for key in sorted(keys):
            client.add(key, 2_500)
        client.flush()  # fsync=always: on disk now
    d.kill()
    assert any(name.endswith("-arena") for name in unlink_segments(d.name))  # the reboot
    adds = [(path, offset, line) for path, offset, line in _journal_lines(journal) if line["ev"] == "add"]
    victim_path, victim_offset, victim = adds[len(adds) // 2]
    data = bytearray(victim_path.read_bytes())
    data[victim_offset + 25] ^= 0x08  # one byte in the middle of the journal
    victim_path.write_bytes(bytes(data))

    d.start()
    with wheeld.connect(d.socket_path, group="durable") as client:
        got = _collect(client, keys - {victim["k"]}, 20.0)
        got += client.poll(0.3)
    delivered = collections.Counter(expired.key for expired in got)
    assert set(delivered) == keys - {victim["k"]} and max(delivered.values()) == 1
    log = d.log()
    assert "ERROR journal: damaged range:" in log and f"{victim_path.name} bytes {victim_offset}-" in log
    assert "1 event lost (lsn" in log

    snap = json.loads(_wheelctl(d, "stats", "--json", "--interval", "0").stdout)
    assert snap["journal"]["damaged_ranges_total"] == 1 and snap["journal"]["damaged_lines_total"] == 1
    assert snap["journal"]["writable"] is True and snap["journal"]["stalls_total"] == 0
    assert snap["counters"]["journal_damaged_ranges_total"] == 1
    text = _wheelctl(d, "stats", "--interval", "0").stdout
    assert "journal  DAMAGED: the recovery that built this arena skipped 1 damaged range (1 line)" in text
    prometheus = _wheelctl(d, "stats", "--prometheus", "--interval", "0").stdout
    assert "\nwheeld_journal_damaged_ranges_total 1\n" in prometheus
    assert "\nwheeld_journal_damaged_lines_total 1\n" in prometheus
    check = _check(journal)
    assert check.exit_code == 1 and f"{victim_path.name} bytes {victim_offset}-" in check.stdout
    # the daemon wrote a snapshot after that recovery: the next recovery starts after the damage
    ((snapshot_lsn, _),) = list_snapshots(journal)
    assert snapshot_lsn > victim["n"]
    again = recover(journal, repair=False, quiet=True)
    assert again.damage == [] and again.snapshot_lsn == snapshot_lsn


@pytest.mark.timeout(120)
def test_journal_damage_refuse_exits_with_one_line_and_changes_nothing(daemon_factory, tmp_path):
    import subprocess
    import sys

    from daemon_harness import unique_name, unlink_segments

    journal = tmp_path / "journal"
    with make_journal(journal) as writer:
        for index in range(50):
            writer.append([Add(t=T0, g="g", k=f"k{index}", d=time.time_ns() // 1_000_000 + 3_600_000, s=index)])
    path = list_segments(journal)[0][1]
    start = _damage_line(path, 20)
    before = _tree(journal)
    name = unique_name()
    command = [sys.executable, "-m", "wheeld.daemon.cli", "--socket", str(tmp_path / "refuse.sock"), "--name", name,
               "--capacity", "10000", "--journal", str(journal), "--journal-damage", "refuse"]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=60)
        created = unlink_segments(name)
    finally:
        unlink_segments(name)
    assert result.returncode == 65, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"wheeld: journal {journal} is damaged (1 range, 1 line): {path.name} bytes {start}-")
    assert "1 event lost (lsn 20)" in last and "refusing to start (--journal-damage refuse)" in last
    assert "ERROR journal: damaged range:" in result.stderr
    # no arena left behind (a later start still recovers from the journal); only the instance lock
    assert [entry for entry in created if not entry.endswith("-lock")] == []
    assert _tree(journal) == before and not (tmp_path / "refuse.sock").exists()

    d = daemon_factory(extra=["--journal", str(journal), "--journal-damage", "skip"], name=name).start()
    wait_until(lambda: json.loads(_wheelctl(d, "stats", "--json", "--interval", "0").stdout)["journal"]
               ["damaged_ranges_total"] == 1, 10.0, "the damage counter")
    from wheeld.shm import reader as R

    with R.ArenaReader(d.name) as reader:
        assert reader.counters()["pending"] == 49


@pytest.mark.timeout(120)
def test_an_idle_timers_fire_is_journaled_as_idle_and_reported_as_idle(daemon_factory, tmp_path):
    import wheeld
    from wheeld.pipeline import reference

    journal = tmp_path / "journal"
    d = daemon_factory(extra=["--journal", str(journal), "--fsync", "always"]).start()
    with wheeld.connect(d.socket_path, group="sockets") as client:
        client.add_idle("idle-1", 150)
        client.add_idle("idle-2", 200)
        client.add("plain", 150)
        client.flush()
        got = _collect(client, {"idle-1", "idle-2", "plain"}, 10.0)
    assert {expired.key for expired in got} == {"idle-1", "idle-2", "plain"}
    fires = wait_until(lambda: {line["k"]: line for _, _, line in _journal_lines(journal) if line["ev"] == "fire"}
                       if len([1 for _, _, line in _journal_lines(journal) if line["ev"] == "fire"]) == 3 else None,
                       10.0, "three fire events")
    assert fires["idle-1"]["i"] == 150 and fires["idle-2"]["i"] == 200 and "i" not in fires["plain"]
    tables = reference.compute(str(journal))
    (row,) = [row for row in tables["idle_churn_by_group"] if row["group"] == "sockets"]
    assert (row["idle_arms"], row["idle_fires"]) == (2, 2)


# --------------------------------------------------------------------------- #
# Recovery is never early
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("wall_phase_ns, mono_phase_ns", [(0, 999_999), (999_999, 0), (500_000, 500_000), (0, 0)])
def test_recovered_deadlines_are_never_early(tmp_path, monkeypatch, wall_phase_ns, mono_phase_ns):
    """Wall-clock deadlines become monotonic ones rounded up: at the instant the wheel
    fires (CLOCK_MONOTONIC reaches the deadline's ms) the wall clock has reached the
    journaled deadline; and the journaled deadline is not before the wall-clock time
    the arena's deadline stood for. Clocks are frozen at chosen sub-ms phases (a
    truncation to whole ms would hide up to 1 ms in each direction)."""
    import time as time_module

    from wheeld.daemon import recovery
    from wheeld.daemon.recorder import Recorder
    from wheeld.shm.wheel import TimerWheel

    wall_ns = 1_700_000_000_123 * 1_000_000 + wall_phase_ns
    mono_ns = 5_000_000 * 1_000_000 + mono_phase_ns
    offset_ns = wall_ns - mono_ns  # the clocks' true offset (both frozen at one instant)
    deadlines = [wall_ns // 1_000_000 + delta for delta in (-5_000, -1, 0, 1, 2, 250, 3_600_000)]
    with make_journal(tmp_path / "journal") as journal:
        journal.append([Add(t=T0, g="g", k=index, d=deadline, s=index) for index, deadline in enumerate(deadlines)])
    name = f"/wheeld-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    wheel = TimerWheel.create(1000, tick_ms=1, wheel_size=64, name=name, start_ms=mono_ns // 1_000_000 - 10_000)
    try:
        monkeypatch.setattr(time_module, "time_ns", lambda: wall_ns)
        monkeypatch.setattr(time_module, "monotonic_ns", lambda: mono_ns)
        directory = str(tmp_path / "journal")
        recovery.load_recovered(wheel, recovery.recover_journal(directory), directory)
        recorder = Recorder(make_journal(tmp_path / "other"), wheel)
        recorder.begin()
        recorder.armed(wheel.group_id("g"), "x", 5_000_250, 1, None, None)
        recorded = recorder.events[0].d
        recorder.close()
        monkeypatch.undo()
        for index, deadline in enumerate(deadlines):
            mono_deadline = wheel.lookup(index, wheel.group_id("g"))
            fires_at_wall_ns = mono_deadline * 1_000_000 + offset_ns
            assert fires_at_wall_ns >= deadline * 1_000_000, (index, fires_at_wall_ns - deadline * 1_000_000)
            assert fires_at_wall_ns < (deadline + 1) * 1_000_000 + 1  # and at most 1 ms late
        assert recorded * 1_000_000 >= 5_000_250 * 1_000_000 + offset_ns  # journaled never before it stood for
    finally:
        wheel.close()
        wheel.unlink()
