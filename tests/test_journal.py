"""Tests of the journal format (protocol/journal.py) and its writer/recovery (protocol/journal_files.py, protocol/journal_recovery.py).

Layers: round trips of every line type; checksums against every single-byte
change; torn tails cut at random points (hypothesis); a reference dict model
that random event sequences, snapshots and compaction must agree with after
recovery; fsync policies observed through a counting ``os.fsync`` and a fake
clock; decoders fed random bytes.
"""

from __future__ import annotations

import contextlib
import os
import random
import tempfile
import zlib
from pathlib import Path
from unittest import mock

import msgspec
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from wheeld.protocol.journal_files import (
    FiredTimer,
    FsyncPolicy,
    Journal,
    PendingTimer,
    list_segments,
    list_snapshots,
    parse_fsync_policy,
)
from wheeld.protocol.journal_recovery import recover
from wheeld.protocol import journal as pj
from wheeld.protocol.errors import Closed, InvalidKey, InvalidRequest
from wheeld.protocol.journal import (
    Ack,
    Add,
    Cancel,
    Fire,
    IdleRearm,
    Rearm,
    SegmentHeader,
    SnapshotHeader,
    SnapshotPending,
    SnapshotUnacked,
    key_from_json,
    key_to_json,
)

T0 = 1_700_000_000_000


class FakeClock:
    """Monotonic and wall ms under the test's control."""

    def __init__(self, mono_ms: int = 1_000, wall_ms: int = T0) -> None:
        self.mono = mono_ms
        self.wall = wall_ms

    def mono_ms(self) -> int:
        return self.mono

    def wall_ms(self) -> int:
        return self.wall


# hypothesis tests: no "explain" phase (it re-parses source, slow and brittle here)
FAST_PHASES = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink]


@contextlib.contextmanager
def no_fsync():
    """Property tests check contents, not durability: skip the ~2 ms disk flushes."""
    with mock.patch.object(os, "fsync", lambda fd: None):
        yield


def make_journal(path, clock=None, **kwargs) -> Journal:
    clock = clock or FakeClock()
    kwargs.setdefault("host", "test-host")
    return Journal(path, wall_ms=clock.wall_ms, mono_ms=clock.mono_ms, **kwargs)


def one_of_each() -> list:
    return [
        Add(t=T0, g="conns", k=key_to_json("c-17"), d=T0 + 30_000, s=7, i=30_000),
        Add(t=T0 + 1, g="jobs", k=key_to_json(4711), d=T0 + 50_000, s=8),
        Rearm(t=T0 + 100, g="jobs", k=key_to_json(4711), d=T0 + 60_000, pd=T0 + 50_000, s=9),
        Add(t=T0 + 150, g="purgatory", k=key_to_json(b"\x00\x01\x02"), d=T0 + 500, s=10),
        Cancel(t=T0 + 200, g="purgatory", k=key_to_json(b"\x00\x01\x02"), s=11, hit=True, pd=T0 + 500),
        Cancel(t=T0 + 201, g="purgatory", k=key_to_json("nope"), s=12, hit=False),
        IdleRearm(t=T0 + 30_000, g="conns", k=key_to_json("c-17"), d=T0 + 41_000, pd=T0 + 30_000, s=7, i=30_000),
        Fire(t=T0 + 60_003, g="jobs", k=key_to_json(4711), d=T0 + 60_000, s=9, f=T0 + 60_003, lat=3),
        Ack(t=T0 + 60_004, g="jobs", k=key_to_json(4711), s=9),
        Add(t=T0 + 60_005, g="jobs", k=key_to_json(-5), d=T0 + 60_010, s=13),
        Fire(t=T0 + 90_000, g="jobs", k=key_to_json(-5), d=T0 + 60_010, s=13, f=T0 + 90_000, late=True, lat=29_990),
    ]


# --------------------------------------------------------------------------- #
# Format
# --------------------------------------------------------------------------- #


def test_every_event_type_round_trips():
    header = SegmentHeader(host="h", name="default", lsn=1, t=T0, mono0=5, wall0=T0)
    events = one_of_each()
    for n, event in enumerate(events, 1):
        event.n = n
    kinds = {type(event) for event in events}
    assert kinds == {Add, Rearm, Cancel, Fire, Ack, IdleRearm}
    for event in [header, *events]:
        line = pj.encode_event(event)
        assert line.endswith(b"}\n") and line.count(b"\n") == 1
        assert pj.check_line(line) and pj.check_line(line.decode())
        assert pj.decode_line(line) == event
        raw = msgspec.json.decode(line)
        assert raw["v"] == pj.JOURNAL_VERSION and raw["crc"] == zlib.crc32(msgspec.json.encode(event))
        assert list(raw)[-1] == "crc"
    data = pj.encode_events([header, *events])
    decoded, good_end, defect = pj.scan_segment(data)
    assert defect is None and good_end == len(data)
    assert decoded == [header, *events]


def test_line_is_the_documented_construction():
    event = Add(n=3, t=T0, g="g", k="k", d=T0 + 5, s=1)
    body = msgspec.json.encode(event)
    assert pj.encode_event(event) == body[:-1] + b',"crc":' + str(zlib.crc32(body)).encode() + b"}\n"
    assert pj.line_body(pj.encode_event(event)) == body
    # optional fields are absent, not null
    assert b'"i"' not in body and b"null" not in body


@given(st.one_of(st.text(min_size=1), st.binary(min_size=1), st.integers(-(2**63), 2**63 - 1)))
def test_key_json_round_trip(key):
    value = key_to_json(key)
    assert type(value) in (str, int)
    back = key_from_json(value)
    assert back == key and type(back) is type(key)
    # the JSON form survives a journal line
    line = pj.encode_event(Add(n=1, t=0, g="g", k=value, d=0, s=0))
    assert key_from_json(pj.decode_line(line).k) == key


def test_key_json_keeps_types_apart():
    forms = {key_to_json("b64:AA=="), key_to_json(b"\x00"), key_to_json("str:x"), key_to_json("17"), key_to_json(17)}
    assert len(forms) == 5
    with pytest.raises(InvalidKey):
        key_to_json(True)
    with pytest.raises(InvalidKey):
        key_to_json(1.5)
    with pytest.raises(pj.CorruptJournal):
        key_from_json("b64:!!!")


def _segment_bytes(count: int = 6) -> tuple[bytes, list[bytes]]:
    header = SegmentHeader(host="h", name="n", lsn=1, t=T0, mono0=0, wall0=T0)
    events = one_of_each()[:count]
    for n, event in enumerate(events, 1):
        event.n = n
    lines = [pj.encode_event(line) for line in [header, *events]]
    return b"".join(lines), lines


def test_crc_detects_every_flipped_byte():
    data, lines = _segment_bytes()
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    rng = random.Random(7)
    for position in range(len(data)):
        for mask in (0x01, 0x80, rng.randrange(1, 256)):
            corrupted = bytearray(data)
            corrupted[position] ^= mask
            events, good_end, defect = pj.scan_segment(bytes(corrupted))
            line_index = max(i for i, start in enumerate(starts[:-1]) if start <= position)
            assert defect is not None, (position, mask)
            # everything before the damaged line is kept, nothing from it on
            assert good_end == starts[line_index]
            assert len(events) == line_index
            assert defect.offset == starts[line_index] and defect.line_no == line_index + 1


def test_defect_reasons():
    data, lines = _segment_bytes()
    # torn: no newline at the end
    _, good_end, defect = pj.scan_segment(data[:-5])
    assert defect.reason == pj.TORN and good_end == len(data) - len(lines[-1])
    # torn: zeros after the last good line (file grew, data never written)
    _, good_end, defect = pj.scan_segment(data + b"\x00" * 4096)
    assert defect.reason == pj.TORN and good_end == len(data)
    # checksum mismatch in the middle, with lines after it
    corrupted = data.replace(b'"g":"jobs"', b'"g":"jabs"', 1)
    _, _, defect = pj.scan_segment(corrupted)
    assert defect.reason == pj.CHECKSUM and defect.lines_after > 0
    # a line with a good crc that is not a version-1 event
    future = pj.encode_line(b'{"ev":"add","v":2,"n":7,"t":0,"g":"g","k":"k","d":0,"s":0}')
    events, good_end, defect = pj.scan_segment(data + future)
    assert defect.reason == pj.BAD_VERSION and good_end == len(data) and len(events) == len(lines)
    unknown = pj.encode_line(b'{"ev":"teleport","v":1,"n":7}')
    _, _, defect = pj.scan_segment(data + unknown)
    assert defect.reason == pj.BAD_JSON
    # a gap in lsns
    gap = pj.encode_event(Add(n=99, t=0, g="g", k="k", d=0, s=0))
    _, good_end, defect = pj.scan_segment(data + gap)
    assert defect.reason == pj.LSN_GAP and good_end == len(data)
    # no header
    _, good_end, defect = pj.scan_segment(b"".join(lines[1:]))
    assert defect.reason == pj.BAD_HEADER and good_end == 0
    assert "bad-header at byte 0" in str(defect)


@given(st.binary(max_size=400))
@settings(max_examples=300)
def test_scan_random_bytes_never_raises(data):
    events, good_end, defect = pj.scan_segment(data)
    assert 0 <= good_end <= len(data)
    assert defect is not None or good_end == len(data)
    with pytest.raises(pj.CorruptJournal):
        pj.parse_snapshot(data)


@given(st.binary(max_size=200))
def test_decode_line_random_bytes_raises_protocol_error(data):
    try:
        event = pj.decode_line(data)
    except pj.CorruptJournal:
        return
    assert isinstance(event, tuple(pj.EVENT_TYPES.values()))


def test_snapshot_bytes_round_trip_and_checks():
    header = SnapshotHeader(lsn=9, count=0, unacked=0, t=T0, host="h", name="n")
    pending = [SnapshotPending(g="g", k=key_to_json(i), d=T0 + i, s=i) for i in range(5)]
    pending.append(SnapshotPending(g="idle", k="c", d=T0, s=1, i=30_000))
    unacked = [SnapshotUnacked(g="g", k="z", d=T0, s=3, f=T0 + 2, lat=2)]
    data = pj.encode_snapshot(header, pending, unacked)
    parsed_header, parsed_pending, parsed_unacked = pj.parse_snapshot(data)
    assert (parsed_header.lsn, parsed_header.count, parsed_header.unacked) == (9, 6, 1)
    assert parsed_pending == pending and parsed_unacked == unacked
    for position in range(0, len(data), 7):
        corrupted = bytearray(data)
        corrupted[position] ^= 0x20
        with pytest.raises(pj.CorruptJournal):
            pj.parse_snapshot(bytes(corrupted))
    with pytest.raises(pj.CorruptJournal):
        pj.parse_snapshot(data[:-1])


def test_file_names():
    assert pj.segment_name(42) == "journal-0000000000000042.jsonl"
    assert pj.parse_segment_name(pj.segment_name(42)) == 42
    assert pj.parse_snapshot_name(pj.snapshot_name(7)) == 7
    assert pj.parse_segment_name("journal-42.jsonl") is None
    assert pj.parse_segment_name("journal-0000000000000042.jsonl.cut-5") is None


# --------------------------------------------------------------------------- #
# Reference model
# --------------------------------------------------------------------------- #


class Model:
    """What the journal promises to rebuild, kept with plain dicts."""

    def __init__(self) -> None:
        self.pending: dict[tuple[str, object], tuple[int, int, int | None]] = {}
        self.unacked: dict[tuple[str, object, int], tuple[int, int, bool, int, int | None]] = {}
        self.seq = 0
        self.now = T0

    def snapshot(self) -> tuple[list[PendingTimer], list[FiredTimer]]:
        pending = [PendingTimer(g, k, d, s, i) for (g, k), (d, s, i) in self.pending.items()]
        unacked = [FiredTimer(g, k, d, s, f, late, lat, i) for (g, k, s), (d, f, late, lat, i) in self.unacked.items()]
        return pending, unacked

    def step(self, op: str, group: str, key, delay_ms: int, pick: int) -> object | None:
        """Apply one operation; return the journal event a daemon would write (or None)."""
        self.now += 1
        self.seq += 1
        if op in ("fire", "idle_rearm") and (group, key) not in self.pending:
            # aim at an existing timer (an idle one for idle_rearm) so these ops are not mostly no-ops
            candidates = sorted(
                (entry for entry, value in self.pending.items() if op == "fire" or value[2] is not None), key=repr
            )
            if candidates:
                group, key = candidates[pick % len(candidates)]
        json_key = key_to_json(key)
        current = self.pending.get((group, key))
        if op in ("add", "add_idle"):
            idle = delay_ms if op == "add_idle" else None
            extra = {} if idle is None else {"i": idle}
            self.pending[(group, key)] = (self.now + delay_ms, self.seq, idle)
            if current is None:
                return Add(t=self.now, g=group, k=json_key, d=self.now + delay_ms, s=self.seq, **extra)
            return Rearm(t=self.now, g=group, k=json_key, d=self.now + delay_ms, pd=current[0], s=self.seq, **extra)
        if op == "cancel":
            if current is None:
                return Cancel(t=self.now, g=group, k=json_key, s=self.seq, hit=False)
            del self.pending[(group, key)]
            return Cancel(t=self.now, g=group, k=json_key, s=self.seq, hit=True, pd=current[0])
        if op == "fire" and current is not None:
            deadline, seq, idle = current
            del self.pending[(group, key)]
            fired = max(self.now, deadline)
            late = pick % 5 == 0
            self.unacked[(group, key, seq)] = (deadline, fired, late, fired - deadline, idle)
            extra = {} if idle is None else {"i": idle}
            return Fire(t=fired, g=group, k=json_key, d=deadline, s=seq, f=fired, late=late, lat=fired - deadline, **extra)
        if op == "idle_rearm" and current is not None and current[2] is not None:
            deadline, seq, idle = current
            self.pending[(group, key)] = (deadline + idle, seq, idle)
            return IdleRearm(t=self.now, g=group, k=json_key, d=deadline + idle, pd=deadline, s=seq, i=idle)
        if op == "ack" and self.unacked:
            keys = sorted(self.unacked, key=repr)
            group, key, seq = keys[pick % len(keys)]
            del self.unacked[(group, key, seq)]
            return Ack(t=self.now, g=group, k=key_to_json(key), s=seq)
        return None


def assert_state_equals_model(state, model: Model) -> None:
    expected_pending = {(g, k): PendingTimer(g, k, d, s, i) for (g, k), (d, s, i) in model.pending.items()}
    assert state.pending == expected_pending
    expected_unacked = sorted(
        (
            (g, repr(k), s, d, f, late, lat, i)
            for (g, k, s), (d, f, late, lat, i) in model.unacked.items()
        )
    )
    got_unacked = sorted((u.group, repr(u.key), u.seq, u.deadline_ms, u.fired_ms, u.late, u.lateness_ms, u.idle_ms) for u in state.unacked)
    assert got_unacked == expected_unacked


KEYS = st.sampled_from(["a", "b64:x", b"a", b"\xff", 1, 2**40])
OPS = st.tuples(
    st.sampled_from(["add", "add", "add_idle", "cancel", "fire", "ack", "idle_rearm", "snapshot", "batch"]),
    st.sampled_from(["g1", "g2"]),
    KEYS,
    st.integers(1, 100_000),
    st.integers(0, 1000),
)


@given(ops=st.lists(OPS, max_size=120), segment_bytes=st.sampled_from([300, 2_000, 1 << 20]))
@settings(max_examples=100, deadline=None, phases=FAST_PHASES, suppress_health_check=[HealthCheck.too_slow])
def test_recovery_equals_reference_model(ops, segment_bytes):
    with tempfile.TemporaryDirectory() as directory, no_fsync():
        model = Model()
        journal = make_journal(directory, fsync="off", segment_bytes=segment_bytes)
        batch: list = []
        snapshot_lsns: set[int] = set()
        for op, group, key, delay_ms, pick in ops:
            if op == "batch":
                journal.append(batch)
                batch = []
            elif op == "snapshot":
                journal.append(batch)
                batch = []
                pending, unacked = model.snapshot()
                journal.write_snapshot(journal.last_lsn, pending, unacked)
                snapshot_lsns.add(journal.last_lsn)
            else:
                event = model.step(op, group, key, delay_ms, pick)
                if event is not None:
                    batch.append(event)
        journal.append(batch)
        last_lsn = journal.last_lsn
        journal.close()
        assert [lsn for lsn, _ in list_snapshots(directory)] == sorted(snapshot_lsns)[-2:]
        state = recover(directory)
        assert state.problems == []
        assert state.last_lsn == last_lsn
        assert state.snapshot_lsn == max(snapshot_lsns, default=0)
        # only the events after the snapshot are replayed
        assert state.events_replayed == last_lsn - state.snapshot_lsn
        assert_state_equals_model(state, model)
        # a journal reopened after recovery continues the lsns
        reopened = make_journal(directory, fsync="off", next_lsn=state.last_lsn + 1)
        reopened.append([Add(t=T0, g="g1", k="later", d=T0 + 1, s=0)])
        reopened.close()
        model.pending[("g1", "later")] = (T0 + 1, 0, None)
        again = recover(directory)
        assert again.last_lsn == last_lsn + 1 and again.problems == []
        assert_state_equals_model(again, model)


def _random_history(seed: int, steps: int) -> tuple[Model, list[list]]:
    rng = random.Random(seed)
    model = Model()
    batches: list[list] = [[]]
    keys = ["a", "b", "c", b"d", 5, 6]
    for _ in range(steps):
        op = rng.choice(["add", "add", "add_idle", "cancel", "fire", "ack", "idle_rearm"])
        event = model.step(op, rng.choice(["g1", "g2"]), rng.choice(keys), rng.randint(1, 10_000), rng.randint(0, 99))
        if event is not None:
            batches[-1].append(event)
        if rng.random() < 0.2:
            batches.append([])
    return model, batches


def test_corrupted_newest_snapshot_falls_back_to_older(tmp_path):
    model, batches = _random_history(seed=3, steps=400)
    journal = make_journal(tmp_path, fsync="off", segment_bytes=2_000)
    for batch in batches:
        journal.append(batch)
    pending, unacked = model.snapshot()
    first = journal.write_snapshot(journal.last_lsn, pending, unacked)
    journal.append([model.step("add", "g9", "x", 9, 0)])
    pending, unacked = model.snapshot()
    second = journal.write_snapshot(journal.last_lsn, pending, unacked)
    journal.append([model.step("cancel", "g1", "a", 0, 0), model.step("add", "g9", "y", 9, 0)])
    journal.close()
    data = bytearray(second.read_bytes())
    data[len(data) // 2] ^= 0x04
    second.write_bytes(bytes(data))

    state = recover(tmp_path)
    assert [problem.reason for problem in state.problems] == ["corrupt-snapshot"]
    assert state.snapshot_lsn == pj.parse_snapshot_name(first.name)
    assert_state_equals_model(state, model)
    assert not second.exists() and second.with_name(second.name + ".corrupt").exists()


def test_compaction_keeps_two_snapshots_and_what_the_older_needs(tmp_path):
    journal = make_journal(tmp_path, fsync="off", segment_bytes=400)
    model = Model()
    snapshot_lsns = []
    for round_number in range(5):
        batch = [model.step("add", "g", f"k{round_number}-{i}", 1_000, 0) for i in range(10)]
        journal.append(batch[:5])
        journal.append(batch[5:])
        pending, unacked = model.snapshot()
        journal.write_snapshot(journal.last_lsn, pending, unacked)
        snapshot_lsns.append(journal.last_lsn)
    journal.append([model.step("cancel", "g", "k0-0", 0, 0)])
    journal.close()
    kept = [lsn for lsn, _ in list_snapshots(tmp_path)]
    assert kept == snapshot_lsns[-2:]
    segments = list_segments(tmp_path)
    # the journal still reaches back to the older snapshot: it can be used alone
    assert segments[0][0] <= kept[0] + 1
    assert segments[1][0] > kept[0] + 1
    assert_state_equals_model(recover(tmp_path, repair=False), model)
    os.unlink(tmp_path / pj.snapshot_name(kept[1]))
    state = recover(tmp_path, repair=False)
    assert state.snapshot_lsn == kept[0] and state.problems == []
    assert_state_equals_model(state, model)


# --------------------------------------------------------------------------- #
# Torn and corrupted tails
# --------------------------------------------------------------------------- #


@given(cut_fraction=st.floats(0.0, 1.0), zeros=st.integers(0, 300))
@settings(max_examples=80, deadline=None, phases=FAST_PHASES)
def test_torn_tail_recovers_to_last_good_record(cut_fraction, zeros):
    model, batches = _random_history(seed=11, steps=150)
    with tempfile.TemporaryDirectory() as directory, no_fsync():
        journal = make_journal(directory, fsync="off")
        for batch in batches:
            journal.append(batch)
        path = journal.segment_path
        journal.close()
        data = path.read_bytes()
        cut = int(len(data) * cut_fraction)
        path.write_bytes(data[:cut] + b"\x00" * zeros)

        # the reference: replay exactly the events whose whole line (newline included) survived
        lines = data.splitlines(keepends=True)
        kept_bytes = 0
        reference = Model()
        survivors = []
        for line in lines:
            if kept_bytes + len(line) > cut:
                break
            kept_bytes += len(line)
            survivors.append(pj.decode_line(line))
        for event in survivors[1:]:
            _apply_to_model(reference, event)

        state = recover(directory)
        at_boundary = kept_bytes == cut and zeros == 0
        if at_boundary:
            assert state.problems == []
        else:
            assert len(state.problems) == 1
            problem = state.problems[0]
            assert problem.reason == pj.TORN and problem.offset == kept_bytes and problem.path == str(path)
        assert state.last_lsn == len(survivors) - 1 if len(survivors) > 1 else state.last_lsn == 0
        assert_state_equals_model(state, reference)
        if kept_bytes:
            assert path.read_bytes() == data[:kept_bytes]
        else:  # nothing good: the file is removed (or was left empty, which is harmless)
            assert not path.exists() or path.read_bytes() == b""
        # cut once: a second recovery finds nothing wrong
        assert recover(directory).problems == []


def _apply_to_model(model: Model, event) -> None:
    """Replay a decoded journal event into a Model (used to build references)."""
    key = key_from_json(event.k)
    idle = getattr(event, "i", msgspec.UNSET)
    idle = None if idle is msgspec.UNSET else idle
    kind = type(event)
    if kind in (Add, Rearm):
        model.pending[(event.g, key)] = (event.d, event.s, idle)
    elif kind is Cancel:
        model.pending.pop((event.g, key), None)
    elif kind is Fire:
        model.pending.pop((event.g, key), None)
        model.unacked[(event.g, key, event.s)] = (event.d, event.f, event.late, event.lat, idle)
    elif kind is Ack:
        model.unacked.pop((event.g, key, event.s), None)
    elif kind is IdleRearm:
        deadline, seq, old_idle = model.pending[(event.g, key)]
        model.pending[(event.g, key)] = (event.d, seq, old_idle)


@pytest.mark.parametrize("damaged_lines", [1, 2])
def test_corrupted_tail_is_cut_and_saved_aside(tmp_path, caplog, damaged_lines):
    """Bad lines with no good line after them in the newest segment are a torn write: cut."""
    model, batches = _random_history(seed=5, steps=60)
    journal = make_journal(tmp_path, fsync="off")
    for batch in batches:
        journal.append(batch)
    path = journal.segment_path
    journal.close()
    data = path.read_bytes()
    lines = data.splitlines(keepends=True)
    bad = len(lines) - damaged_lines
    offset = sum(map(len, lines[:bad]))
    corrupted = bytearray(data)
    for line in range(bad, len(lines)):
        corrupted[sum(map(len, lines[:line])) + 10] ^= 0x01
    path.write_bytes(bytes(corrupted))
    with caplog.at_level("WARNING", logger="wheeld.journal"):
        state = recover(tmp_path)
    (problem,) = state.problems
    assert problem.reason == pj.CHECKSUM and problem.offset == offset
    assert state.torn == [problem] and state.damage == []
    assert path.read_bytes() == data[:offset]
    aside = tmp_path / f"{path.name}.cut-{offset}"
    assert aside.read_bytes() == bytes(corrupted[offset:])
    assert state.last_lsn == bad - 1
    assert any(path.name in record.getMessage() and str(offset) in record.getMessage() for record in caplog.records)


def test_corruption_in_an_older_segment_is_reported_and_skipped(tmp_path):
    journal = make_journal(tmp_path, fsync="off", segment_bytes=500)
    for index in range(40):
        journal.append([Add(t=T0, g="g", k=f"k{index}", d=T0 + index, s=index)])
    journal.close()
    segments = list_segments(tmp_path)
    assert len(segments) >= 3
    _, victim = segments[1]
    original = victim.read_bytes()
    broken = bytearray(original)
    broken[-20] ^= 0x01  # inside the last line of that segment
    victim.write_bytes(bytes(broken))
    state = recover(tmp_path)
    # the next segment's first lsn says which event the bad line held
    (problem,) = state.problems
    (damage,) = state.damage
    lost = msgspec.json.decode(original.splitlines()[-1])
    assert problem.path == damage.path == str(victim) and problem.reason == pj.CHECKSUM
    assert damage.lost_lsns == (lost["n"], lost["n"]) and damage.lost == 1 and damage.lines == 1
    assert damage.start == len(original) - len(original.splitlines(keepends=True)[-1]) and damage.end == len(original)
    assert victim.read_bytes() == bytes(broken)  # evidence kept
    assert ("g", lost["k"]) not in state.pending
    assert len(state.pending) == 39 and state.last_lsn == 40


def test_missing_segment_is_reported_as_gap(tmp_path):
    journal = make_journal(tmp_path, fsync="off", segment_bytes=300)
    for index in range(20):
        journal.append([Add(t=T0, g="g", k=index, d=T0, s=index)])
    journal.close()
    segments = list_segments(tmp_path)
    os.unlink(segments[1][1])
    state = recover(tmp_path)
    assert [problem.reason for problem in state.problems] == ["lsn-gap"]
    assert state.last_lsn == 20


# --------------------------------------------------------------------------- #
# Writer: rotation, reopening, failures
# --------------------------------------------------------------------------- #


def test_rotation_by_size(tmp_path):
    clock = FakeClock()
    journal = make_journal(tmp_path, clock, fsync="off", segment_bytes=1_000, name="svc")
    for index in range(100):
        journal.append([Add(t=T0, g="g", k=index, d=T0 + index, s=index), Cancel(t=T0, g="g", k=index, s=index, hit=False)])
    journal.close()
    segments = list_segments(tmp_path)
    assert len(segments) > 10
    expected_first = 1
    for first_lsn, path in segments:
        events, defect = pj.iter_segment(path)
        assert defect is None
        header = events[0]
        assert isinstance(header, SegmentHeader) and header.lsn == first_lsn == expected_first
        assert (header.host, header.name, header.mono0, header.wall0) == ("test-host", "svc", clock.mono, clock.wall)
        assert [event.n for event in events[1:]] == list(range(first_lsn, first_lsn + len(events) - 1))
        # a segment passes its limit by at most one batch
        assert path.stat().st_size < 1_000 + 300
        expected_first += len(events) - 1
    assert expected_first == 201
    state = recover(tmp_path)
    assert state.last_lsn == 200 and state.pending == {} and state.problems == []


def test_reopen_starts_a_new_segment_after_the_last_lsn(tmp_path):
    journal = make_journal(tmp_path, fsync="always")
    journal.append([Add(t=T0, g="g", k="a", d=T0, s=1)])
    journal.close()
    # a torn tail left by a crash is cut when the journal is opened without recovery
    with open(journal.segment_path, "ab") as file:
        file.write(b'{"ev":"add","v":1,"n":2,')
    second = make_journal(tmp_path, fsync="always")
    assert second.last_lsn == 1 and second.segment_path.name == pj.segment_name(2)
    assert second.append([Add(t=T0, g="g", k="b", d=T0, s=2)]) == 2
    second.close()
    # a daemon that died right after opening a segment leaves a header-only file: reused
    third = make_journal(tmp_path, fsync="always")
    third.close()
    fourth = make_journal(tmp_path, fsync="always")
    assert fourth.segment_path == third.segment_path
    fourth.close()
    state = recover(tmp_path)
    assert set(state.pending) == {("g", "a"), ("g", "b")} and state.problems == []


def test_wrong_next_lsn_is_refused(tmp_path):
    journal = make_journal(tmp_path, fsync="off")
    journal.append([Add(t=T0, g="g", k="a", d=T0, s=1)])
    journal.close()
    with pytest.raises(pj.CorruptJournal):
        make_journal(tmp_path, fsync="off", next_lsn=1)


def test_failed_write_leaves_no_partial_batch(tmp_path, monkeypatch):
    journal = make_journal(tmp_path, fsync="off")
    journal.append([Add(t=T0, g="g", k="a", d=T0, s=1)])
    size_before = journal.segment_path.stat().st_size
    real_write = os.write

    def half_then_fail(fd, data):
        if fd == journal._fd and len(data) > 10:
            real_write(fd, bytes(data[: len(data) // 2]))
            raise OSError(28, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", half_then_fail)
    with pytest.raises(OSError):
        journal.append([Add(t=T0, g="g", k="b", d=T0, s=2), Add(t=T0, g="g", k="c", d=T0, s=3)])
    monkeypatch.setattr(os, "write", real_write)
    assert journal.segment_path.stat().st_size == size_before and journal.last_lsn == 1
    assert journal.append([Add(t=T0, g="g", k="d", d=T0, s=4)]) == 2
    journal.close()
    state = recover(tmp_path)
    assert set(state.pending) == {("g", "a"), ("g", "d")} and state.problems == []


def test_closed_journal_refuses(tmp_path):
    journal = make_journal(tmp_path)
    journal.close()
    journal.close()
    with pytest.raises(Closed):
        journal.append([Add(t=T0, g="g", k="a", d=T0, s=1)])


def test_recover_missing_or_empty_directory(tmp_path):
    state = recover(tmp_path / "nothing-here")
    assert (state.pending, state.unacked, state.last_lsn, state.problems) == ({}, [], 0, [])
    assert recover(tmp_path).last_lsn == 0


# --------------------------------------------------------------------------- #
# Fsync policies and durable_lsn
# --------------------------------------------------------------------------- #


@pytest.fixture
def fsync_log(monkeypatch):
    """Replace os.fsync with a recorder of (fd, file size at that moment)."""
    calls: list[tuple[int, int]] = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        calls.append((fd, os.fstat(fd).st_size))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    return calls


def test_parse_fsync_policy():
    assert parse_fsync_policy("always") == FsyncPolicy("always")
    assert parse_fsync_policy("interval=10") == FsyncPolicy("interval", 10)
    assert parse_fsync_policy("interval=25ms") == FsyncPolicy("interval", 25)
    assert str(parse_fsync_policy("off")) == "off"
    for bad in ("sometimes", "interval=0", "interval=-3", "interval=", "interval=1.5"):
        with pytest.raises(InvalidRequest):
            parse_fsync_policy(bad)


def test_always_fsyncs_the_batch_before_append_returns(tmp_path, fsync_log):
    journal = make_journal(tmp_path, fsync="always")
    assert journal.durable_lsn == 0
    for round_number in range(1, 4):
        fsync_log.clear()
        batch = [Add(t=T0, g="g", k=f"{round_number}-{i}", d=T0, s=i) for i in range(50)]
        lsn = journal.append(batch)
        # exactly one fsync for the whole batch (group commit), of the segment, covering all of it
        assert fsync_log == [(journal._fd, journal.segment_path.stat().st_size)]
        assert journal.durable_lsn == journal.last_lsn == lsn == 50 * round_number
    assert journal.maybe_sync(10**12) is False and journal.sync_due_ms is None
    journal.close()


def test_interval_syncs_no_later_than_the_window(tmp_path, fsync_log):
    clock = FakeClock(mono_ms=0)
    journal = make_journal(tmp_path, clock, fsync="interval=10")
    fsync_log.clear()
    lsn = journal.append([Add(t=T0, g="g", k="a", d=T0, s=1)], now_ms=0)
    assert fsync_log == [] and journal.durable_lsn == 0 and journal.sync_due_ms == 10
    clock.mono = 4
    journal.append([Add(t=T0, g="g", k="b", d=T0, s=2)])  # the window started at the first unsynced append
    assert journal.sync_due_ms == 10
    assert journal.maybe_sync(9) is False and journal.durable_lsn == 0
    assert journal.maybe_sync(10) is True
    assert journal.durable_lsn == journal.last_lsn == lsn + 1 and len(fsync_log) == 1
    assert journal.sync_due_ms is None and journal.maybe_sync(100) is False
    journal.close()


@given(
    gaps=st.lists(st.integers(0, 30), min_size=1, max_size=60),
    interval_ms=st.integers(1, 20),
    tick_ms=st.integers(1, 7),
)
@settings(max_examples=60, deadline=None, phases=FAST_PHASES)
def test_interval_bound_holds_for_any_append_pattern(gaps, interval_ms, tick_ms):
    """Drive maybe_sync from a loop ticking every tick_ms, as the daemon's timer would:
    each event is durable at most interval + tick ms after its append, and fsyncs
    are at least interval ms apart."""
    with tempfile.TemporaryDirectory() as directory:
        clock = FakeClock(mono_ms=0)
        journal = make_journal(directory, clock, fsync=f"interval={interval_ms}")
        appended_at: dict[int, int] = {}
        durable_at: dict[int, int] = {}
        sync_times: list[int] = []
        pending_gaps = list(gaps)
        next_append = pending_gaps.pop(0)
        now = 0
        while pending_gaps or next_append is not None or journal.durable_lsn < journal.last_lsn:
            if next_append is not None and now >= next_append:
                lsn = journal.append([Add(t=T0, g="g", k="k", d=T0, s=now)], now_ms=now)
                appended_at[lsn] = now
                next_append = now + pending_gaps.pop(0) if pending_gaps else None
            due = journal.sync_due_ms
            if due is not None:
                assert due <= now + interval_ms
            before = journal.durable_lsn
            if journal.maybe_sync(now):
                sync_times.append(now)
                for lsn in range(before + 1, journal.durable_lsn + 1):
                    durable_at[lsn] = now
            now += tick_ms
            assert now < 10_000
        journal.close()
        assert set(durable_at) == set(appended_at)
        for lsn, at in appended_at.items():
            assert durable_at[lsn] - at < interval_ms + tick_ms
        assert all(b - a >= interval_ms for a, b in zip(sync_times, sync_times[1:]))


def test_off_never_fsyncs_and_durable_lsn_stays(tmp_path, fsync_log):
    journal = make_journal(tmp_path, fsync="off", segment_bytes=300)
    for index in range(30):
        journal.append([Add(t=T0, g="g", k=index, d=T0, s=index)])
        journal.maybe_sync(10**12)
    assert len(list_segments(tmp_path)) > 3  # rotation happened, still no fsync
    assert fsync_log == [] and journal.durable_lsn == 0 and journal.last_lsn == 30
    journal.sync()  # an explicit sync is always honoured
    assert journal.durable_lsn == 30 and len(fsync_log) == 1
    journal.close()
    assert len(fsync_log) == 1


def test_durable_lsn_continues_from_next_lsn_and_follows_rotation(tmp_path, fsync_log):
    clock = FakeClock(mono_ms=0)
    journal = make_journal(tmp_path, clock, fsync="interval=1000", segment_bytes=200, next_lsn=101)
    assert journal.last_lsn == journal.durable_lsn == 100
    journal.append([Add(t=T0, g="g", k="a", d=T0, s=1), Add(t=T0, g="g", k="b", d=T0, s=2)], now_ms=0)
    assert journal.durable_lsn == 100
    # the next append rotates: the finished segment is synced before the new one opens
    journal.append([Add(t=T0, g="g", k="c", d=T0, s=3)], now_ms=1)
    assert journal.durable_lsn == 102 and journal.last_lsn == 103
    journal.close()  # close syncs under interval
    assert journal.durable_lsn == 103


def test_snapshot_syncs_journal_first(tmp_path, fsync_log):
    journal = make_journal(tmp_path, fsync="off")
    journal.append([Add(t=T0, g="g", k="a", d=T0, s=1)])
    with pytest.raises(InvalidRequest):
        journal.write_snapshot(5, [])
    journal.write_snapshot(1, [PendingTimer("g", "a", T0, 1)])
    assert journal.durable_lsn == 1
    assert len(fsync_log) >= 3  # journal, snapshot file, directory
    journal.close()


def test_fsync_policy_affects_only_when_not_what(tmp_path):
    """The three policies write the same bytes."""
    contents = []
    for policy in ("always", "interval=5", "off"):
        directory = tmp_path / policy.replace("=", "")
        journal = make_journal(directory, fsync=policy)
        for batch in _random_history(seed=1, steps=80)[1]:
            journal.append(batch)
        journal.close()
        contents.append([path.read_bytes() for _, path in list_segments(directory)])
    assert contents[0] == contents[1] == contents[2]


# --------------------------------------------------------------------------- #
# The fleet generator (pipeline/generate.py) writes journals that obey the format
# --------------------------------------------------------------------------- #


def _check_host_journal(folder: Path) -> dict:
    """Replay one host's journal, asserting every event is consistent with the state.

    Returns per-host figures the tests look at.
    """
    pending: dict = {}
    unacked: set = set()
    expected_lsn = 1
    last_t = 0
    figures = {"events": 0, "lateness": [], "late_fires": 0, "headers": [], "kinds": {}, "hours": [0] * 24}
    for first_lsn, path in list_segments(folder):
        events, defect = pj.iter_segment(path)
        assert defect is None, defect
        header = events[0]
        assert header.lsn == first_lsn == expected_lsn and header.host == folder.name
        figures["headers"].append(header)
        for event in events[1:]:
            assert event.n == expected_lsn
            expected_lsn += 1
            assert event.t >= last_t, "events are written in time order"
            last_t = event.t
            figures["events"] += 1
            kind = type(event).__name__
            figures["kinds"][kind] = figures["kinds"].get(kind, 0) + 1
            figures["hours"][(event.t - figures["headers"][0].t) // 3_600_000 % 24] += 1
            key = (event.g, event.k)
            current = pending.get(key)
            if type(event) is Add:
                assert current is None
                pending[key] = (event.d, event.s, event.i)
            elif type(event) is Rearm:
                assert current is not None and event.pd == current[0]
                pending[key] = (event.d, event.s, event.i)
            elif type(event) is IdleRearm:
                assert current is not None and event.pd == current[0] == event.t
                assert (event.s, event.i) == current[1:] and event.d > event.t - event.i
                pending[key] = (event.d, current[1], current[2])
            elif type(event) is Cancel:
                if event.hit:
                    assert current is not None and event.pd == current[0]
                    del pending[key]
                else:
                    assert current is None
            elif type(event) is Fire:
                assert current is not None and (event.d, event.s, event.i) == current
                assert event.f == event.t and event.lat == event.f - event.d >= 0
                del pending[key]
                unacked.add((event.g, event.k, event.s))
                if event.late:
                    figures["late_fires"] += 1
                else:
                    figures["lateness"].append(event.lat)
            elif type(event) is Ack:
                unacked.remove((event.g, event.k, event.s))
    return figures


def test_generated_fleet_is_consistent(tmp_path):
    from wheeld.pipeline.generate import generate_fleet

    info = generate_fleet(
        tmp_path / "fleet",
        hosts=4,
        events_per_host=20_000,
        seed=5,
        slow_hosts=1,
        restart_fraction=0.5,
        segment_bytes=200_000,
    )
    assert info.hosts == ["host-000", "host-001", "host-002", "host-003"]
    assert len(info.slow_hosts) == 1 and info.restarted_hosts
    figures = {name: _check_host_journal(tmp_path / "fleet" / name) for name in info.hosts}
    for name, host in figures.items():
        assert host["events"] == 20_000
        assert set(host["kinds"]) == {"Add", "Rearm", "Cancel", "Fire", "Ack", "IdleRearm"}
        assert len(host["headers"]) >= 2  # rotation at 200 kB
        groups_seen = {line["g"] for line in _sample_lines(tmp_path / "fleet" / name)}
        assert groups_seen == {"conns", "purgatory", "jobs", "leases"}
    for name in info.restarted_hosts:
        host = figures[name]
        assert host["late_fires"] > 0
        # the restarted daemon's monotonic clock starts again near zero
        assert any(header.mono0 < 120_000 for header in host["headers"][1:])
    for name in set(info.hosts) - set(info.restarted_hosts):
        assert figures[name]["late_fires"] == 0
    (slow,) = info.slow_hosts
    median = {name: sorted(host["lateness"])[len(host["lateness"]) // 2] for name, host in figures.items()}
    assert all(median[slow] > median[name] for name in info.hosts if name != slow)
    # diurnal load: the afternoon is busier than the small hours
    hours = [sum(figures[name]["hours"][hour] for name in info.hosts) for hour in range(24)]
    assert sum(hours[13:17]) > 2 * sum(hours[1:5])


def _sample_lines(folder: Path) -> list[dict]:
    lines = []
    for _, path in list_segments(folder):
        lines += [msgspec.json.decode(line) for line in path.read_bytes().splitlines()[1:]]
    return lines


def test_generated_fleet_is_deterministic_and_torn_tails_are_real(tmp_path):
    from wheeld.pipeline.generate import generate_fleet

    first = generate_fleet(tmp_path / "a", hosts=2, events_per_host=800, seed=9, torn_tail_hosts=1)
    second = generate_fleet(tmp_path / "b", hosts=2, events_per_host=800, seed=9, torn_tail_hosts=1)
    for name in first.hosts:
        files_a = [path.read_bytes() for _, path in list_segments(tmp_path / "a" / name)]
        files_b = [path.read_bytes() for _, path in list_segments(tmp_path / "b" / name)]
        assert files_a == files_b
    torn = [name for name in first.hosts if not list_segments(tmp_path / "a" / name)[-1][1].read_bytes().endswith(b"\n")]
    assert len(torn) == 1
    state = recover(tmp_path / "a" / torn[0], repair=False)
    assert [problem.reason for problem in state.problems] == [pj.TORN]
    assert state.last_lsn == 799


def test_generator_cli(tmp_path, capsys):
    from wheeld.pipeline.generate import main

    assert main([str(tmp_path / "out"), "--hosts", "2", "--events", "1000", "--seed", "3"]) == 0
    assert "wrote 1,000 events for 2 hosts" in capsys.readouterr().out
    for name in ("host-000", "host-001"):
        assert recover(tmp_path / "out" / name, repair=False).last_lsn == 500


def test_scan_with_skip_matches_full_scan():
    data, lines = _segment_bytes(count=11)
    full, full_end, full_defect = pj.scan_segment(data)
    assert full_defect is None
    for skip in range(0, 12):
        events, good_end, defect = pj.scan_segment(data, skip_events=skip)
        assert defect is None and good_end == len(data)
        assert events == [full[0]] + full[1 + skip :]
    # a defect after the skipped part is reported at its real place
    torn = data[:-7]
    events, good_end, defect = pj.scan_segment(torn, skip_events=4)
    assert defect.reason == pj.TORN and defect.offset == len(data) - len(lines[-1])
    assert defect.line_no == len(lines) and events == [full[0]] + full[5:-1]
    # a defect inside the skipped part goes unseen: those events are not read at all
    broken = bytearray(data)
    broken[len(lines[0]) + 20] ^= 0x01
    events, _, defect = pj.scan_segment(bytes(broken), skip_events=3)
    assert defect is None and events[1:] == full[4:]


def test_recovery_skips_covered_events_even_after_a_damaged_newline(tmp_path):
    model, batches = _random_history(seed=21, steps=300)
    journal = make_journal(tmp_path, fsync="off")
    half = len(batches) // 2
    for batch in batches[:half]:
        journal.append(batch)
    # snapshot the model state at this point (replayed from the journal so far)
    state_at_snapshot = recover(tmp_path, repair=False)
    snapshot_lsn = journal.last_lsn
    journal.write_snapshot(snapshot_lsn, state_at_snapshot.pending.values(), state_at_snapshot.unacked)
    for batch in batches[half:]:
        journal.append(batch)
    path = journal.segment_path
    journal.close()
    assert_state_equals_model(recover(tmp_path, repair=False), model)
    # damage a newline in the part the snapshot covers: two lines merge, the line count is off by one
    data = bytearray(path.read_bytes())
    newline = [index for index, byte in enumerate(data) if byte == 0x0A][3]
    data[newline] = ord(" ")
    path.write_bytes(bytes(data))
    state = recover(tmp_path, repair=False)
    assert state.problems == [] and state.snapshot_lsn == snapshot_lsn
    assert state.events_replayed == state.last_lsn - snapshot_lsn
    assert_state_equals_model(state, model)


# --------------------------------------------------------------------------- #
# The Recorder's batch methods (the daemon's journaled big-batch path)
# --------------------------------------------------------------------------- #

_BATCH_KEYS = ["c0-1", "str:x", "b64:y", "naïve", 'quo"te', "tab\tkey", 0, -5, 2**62, b"\x00\x01", b"raw", "k" * 32]


@contextlib.contextmanager
def _recorder(tmp_path, name: str):
    """A Recorder over a fresh arena (unlinked on exit) and a journal in ``tmp_path``."""
    import uuid

    from wheeld.daemon.recorder import Recorder
    from wheeld.shm.wheel import TimerWheel

    wheel = TimerWheel.create(1000, tick_ms=1, wheel_size=64, name=f"/wheeld-test-{os.getpid()}-{uuid.uuid4().hex[:8]}",
                              start_ms=1_000)
    journal = None
    try:
        journal = Journal(tmp_path / name, fsync="off", host="test-host")
        yield Recorder(journal, wheel), wheel
    finally:
        if journal is not None:
            journal.close()
        wheel.close()
        wheel.unlink()


def _ident(key) -> bytes:
    from wheeld.protocol.keys import encode_key

    data, meta = encode_key(key)
    return bytes((meta,)) + data.ljust(32, b"\0")


def test_ident_to_json_equals_key_to_json():
    from wheeld.daemon.recorder import _ident_to_json

    for key in _BATCH_KEYS:
        value = _ident_to_json(_ident(key))
        assert value == key_to_json(key) and type(value) is type(key_to_json(key)), key


def test_batch_methods_journal_exactly_what_the_scalar_methods_do(tmp_path, monkeypatch):
    """Same commands, same clock: armed_many/cancelled_many write the bytes that
    armed/cancelled write one command at a time (add vs rearm, cancel hit vs miss)."""
    from wheeld.daemon import recorder as recorder_module

    monkeypatch.setattr(recorder_module, "mono_ms", lambda: 5_000)
    monkeypatch.setattr(recorder_module, "wall_offset_ms", lambda: T0 - 5_000)
    keys = _BATCH_KEYS
    files = {}
    for mode in ("scalar", "batch"):
        with _recorder(tmp_path, mode) as (recorder, wheel):
            gid, other = wheel.group_id("g1"), wheel.group_id("g2")
            recorder.begin()
            for j, key in enumerate(keys[::2]):  # half of the keys are pending already
                wheel.schedule(key, 9_000 + j, gid, 1)
            wheel.schedule(keys[1], 9_999, other, 1)  # the same key in another group is not a re-arm
            idents = [_ident(k) for k in keys]
            deadlines = [20_000 + j for j in range(len(keys))]
            seqs = list(range(100, 100 + len(keys)))
            idle = [None if j % 3 else 7_000 for j in range(len(keys))]
            if mode == "scalar":
                for key, deadline, seq, idle_ms in zip(keys, deadlines, seqs, idle):
                    previous = wheel.lookup(key, gid)
                    wheel.schedule(key, deadline, gid, seq)
                    recorder.armed(gid, key, deadline, seq, previous, idle_ms)
                for key, seq in zip(keys[:5], seqs):
                    previous = wheel.lookup(key, other)
                    wheel.cancel(key, other)
                    recorder.cancelled(other, key, seq, previous)
            else:
                previous = recorder.previous_deadlines(gid, idents)
                assert previous == [wheel.lookup(k, gid) for k in keys]
                assert previous[0] is not None and previous[1] is None
                wheel.schedule_many(idents, deadlines, gid, seqs)
                recorder.armed_many(gid, idents, deadlines, seqs, previous, idle)
                previous = recorder.previous_deadlines(other, idents[:5])
                assert [p is not None for p in previous] == [False, True, False, False, False]
                wheel.cancel_many(idents[:5], other)
                recorder.cancelled_many(other, idents[:5], seqs, previous)
            recorder.commit(5_000)
            files[mode] = recorder.journal.segment_path.read_bytes().split(b"\n", 1)[1]
    assert files["batch"] == files["scalar"]
    kinds = [msgspec.json.decode(line)["ev"] for line in files["batch"].splitlines()]
    assert kinds.count("add") == 6 and kinds.count("rearm") == 6 and kinds.count("cancel") == 5
    assert all(pj.check_line(line) for line in files["batch"].splitlines())


def test_previous_deadlines_of_an_empty_batch_and_of_absent_keys(tmp_path):
    with _recorder(tmp_path, "j") as (recorder, wheel):
        gid = wheel.group_id("g")
        assert recorder.previous_deadlines(gid, []) == []
        assert recorder.previous_deadlines(gid, [_ident("a"), _ident(1)]) == [None, None]
        wheel.schedule(1, 4_321, gid)
        assert recorder.previous_deadlines(gid, [_ident("a"), _ident(1)]) == [None, 4_321]


def test_a_forgotten_group_id_reused_by_another_name_is_journaled_under_the_new_name(tmp_path, monkeypatch):
    from wheeld.daemon import recorder as recorder_module

    monkeypatch.setattr(recorder_module, "mono_ms", lambda: 5_000)
    monkeypatch.setattr(recorder_module, "wall_offset_ms", lambda: T0 - 5_000)
    with _recorder(tmp_path, "forget") as (recorder, wheel):
        gid = wheel.group_id("old")
        recorder.begin()
        wheel.schedule("k", 9_000, gid, 1)
        recorder.armed(gid, "k", 9_000, 1, None, None)
        assert recorder.forget_group(gid) is False  # "k" is pending: the group stays
        wheel.cancel("k", gid)
        recorder.cancelled(gid, "k", 2, 9_000)
        assert recorder.forget_group(gid) is True
        assert wheel.group_id("new") == gid
        wheel.schedule("k", 9_500, gid, 3)
        recorder.armed(gid, "k", 9_500, 3, None, None)
        recorder.commit(5_000)
        lines = recorder.journal.segment_path.read_bytes().split(b"\n", 1)[1].splitlines()
    assert [msgspec.json.decode(line)["g"] for line in lines] == ["old", "old", "new"]


# --------------------------------------------------------------------------- #
# Background group commit (the daemon's interval policy)
# --------------------------------------------------------------------------- #


@pytest.fixture
def gated_fsync(monkeypatch):
    """os.fsync that waits for ``gate`` and records (thread name, fd, file size, fd still open after)."""
    import threading

    gate = threading.Event()
    calls: list = []
    real_fsync = os.fsync

    def fsync(fd):
        size = os.fstat(fd).st_size
        assert gate.wait(10), "the test never opened the gate"
        still_open = os.fstat(fd) is not None  # raises if someone closed the fd under us
        real_fsync(fd)
        calls.append((threading.current_thread().name, fd, size, still_open))

    monkeypatch.setattr(os, "fsync", fsync)
    return gate, calls


def test_start_sync_fsyncs_on_a_helper_thread_and_durable_lsn_waits_for_it(tmp_path, gated_fsync):
    gate, calls = gated_fsync
    clock = FakeClock(mono_ms=0)
    gate.set()  # the segment header's fsync in the constructor
    journal = make_journal(tmp_path, clock, fsync="interval=10")
    calls.clear()
    gate.clear()
    synced = []
    journal.on_synced = lambda path, size, started: synced.append((path, size, started))
    first = journal.append([Add(t=T0, g="g", k="a", d=T0, s=1)], now_ms=0)
    assert journal.start_sync(9) is False and not journal.sync_in_flight
    assert journal.start_sync(10) is True and journal.sync_in_flight  # returned although fsync waits
    size_at_start = journal.segment_path.stat().st_size
    later = journal.append([Add(t=T0, g="g", k="b", d=T0, s=2)], now_ms=11)  # appending goes on
    assert journal.start_sync(30) is False, "one fsync in flight at a time"
    assert journal.durable_lsn == 0 and journal.poll_sync() is False
    gate.set()
    assert journal.poll_sync(wait=True) is True
    assert journal.durable_lsn == first < later  # what was written before the fsync started
    assert calls[0][0].startswith("wheeld-fsync")
    assert synced == [(journal.segment_path, size_at_start, 10)]
    assert journal.sync_due_ms == 21  # the window of the event appended during the fsync
    assert journal.start_sync(21) is True
    journal.poll_sync(wait=True)
    assert journal.durable_lsn == journal.last_lsn == later
    journal.close()


def test_close_and_rotation_wait_for_the_fsync_in_flight(tmp_path, gated_fsync):
    import threading

    gate, calls = gated_fsync
    gate.set()
    journal = make_journal(tmp_path, fsync="interval=5", segment_bytes=300)
    journal.append([Add(t=T0, g="g", k="a", d=T0, s=1)], now_ms=0)
    gate.clear()
    assert journal.start_sync(10) is True
    threading.Timer(0.2, gate.set).start()
    journal.append([Add(t=T0, g="g", k=f"k{i}", d=T0, s=i) for i in range(5)], now_ms=11)  # past 300 bytes
    journal.append([Add(t=T0, g="g", k="z", d=T0, s=9)], now_ms=12)  # rotates: syncs, waits, closes
    assert len(list_segments(tmp_path)) == 2
    gate.clear()
    assert journal.start_sync(30) is True
    threading.Timer(0.2, gate.set).start()
    journal.close()
    assert journal.durable_lsn == journal.last_lsn
    assert all(still_open for *_, still_open in calls)
    assert recover(tmp_path, repair=False).last_lsn == 7


def test_a_failed_background_fsync_raises_in_the_caller(tmp_path, monkeypatch):
    journal = make_journal(tmp_path, fsync="interval=1")
    journal.append([Add(t=T0, g="g", k="a", d=T0, s=1)], now_ms=0)

    def failing(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing)
    assert journal.start_sync(5) is True
    with pytest.raises(OSError):
        journal.poll_sync(wait=True)
    assert journal.durable_lsn == 0
    monkeypatch.undo()
    journal.close()


def test_commands_many_journals_a_batch_with_repeated_keys_as_in_order(tmp_path, monkeypatch):
    """A batch applied collapsed (last operation per key) is journaled command by command:
    the same bytes as applying and recording each command in order; arms the arena
    refused after a key's last cancel leave no event."""
    from wheeld.daemon import recorder as recorder_module

    monkeypatch.setattr(recorder_module, "mono_ms", lambda: 5_000)
    monkeypatch.setattr(recorder_module, "wall_offset_ms", lambda: T0 - 5_000)
    rng = random.Random(3)
    keys = ["a", "b", 7, b"c", "str:d"]
    commands = [(rng.choice(keys), rng.random() < 0.7, 10_000 + j, 100 + j, 9_000 if j % 4 == 0 else None)
                for j in range(60)]
    refused_key = "b"
    files = {}
    for mode in ("scalar", "many"):
        with _recorder(tmp_path, mode) as (recorder, wheel):
            gid = wheel.group_id("g")
            wheel.schedule("a", 8_000, gid, 1)
            wheel.schedule(7, 8_001, gid, 1)
            recorder.begin()
            last_cancel = max(j for j, c in enumerate(commands) if c[0] == refused_key and not c[1])
            if mode == "scalar":
                for j, (key, arm, deadline, seq, idle) in enumerate(commands):
                    previous = wheel.lookup(key, gid)
                    if arm:
                        if key == refused_key and j > last_cancel:
                            continue  # the arena was full for it
                        wheel.schedule(key, deadline, gid, seq)
                        recorder.armed(gid, key, deadline, seq, previous, idle)
                    else:
                        wheel.cancel(key, gid)
                        recorder.cancelled(gid, key, seq, previous)
            else:
                idents = [_ident(c[0]) for c in commands]
                distinct = list(dict.fromkeys(idents))
                previous = dict(zip(distinct, recorder.previous_deadlines(gid, distinct)))
                recorder.commands_many(gid, idents, [c[1] for c in commands], [c[2] for c in commands],
                                       [c[3] for c in commands], [c[4] for c in commands], previous,
                                       refused={_ident(refused_key)})
            recorder.commit(5_000)
            files[mode] = recorder.journal.segment_path.read_bytes().split(b"\n", 1)[1]
    assert files["many"] == files["scalar"]
    kinds = {msgspec.json.decode(line)["ev"] for line in files["many"].splitlines()}
    assert kinds == {"add", "rearm", "cancel"}


def test_an_ack_without_its_fire_event_ends_that_arming(tmp_path):
    """A daemon SIGKILLed after expiring a timer in the arena but before journaling the
    fire leaves add ... ack with no fire in between (the next daemon delivered it from
    the arena and journaled the ack). Recovery must not fire that arming again; an ack
    for an older arming leaves a re-armed timer alone (the chaos test found this)."""
    journal = make_journal(tmp_path, fsync="off")
    journal.append([
        Add(t=T0, g="g", k=key_to_json("done"), d=T0 + 100, s=5),
        Add(t=T0, g="g", k=key_to_json("rearmed"), d=T0 + 100, s=6),
        Rearm(t=T0 + 1, g="g", k=key_to_json("rearmed"), d=T0 + 900, pd=T0 + 100, s=8),
        Ack(t=T0 + 200, g="g", k=key_to_json("done"), s=5),
        Ack(t=T0 + 200, g="g", k=key_to_json("rearmed"), s=6),
    ])
    journal.close()
    state = recover(tmp_path)
    assert ("g", "done") not in state.pending
    assert state.pending[("g", "rearmed")].seq == 8 and state.pending[("g", "rearmed")].deadline_ms == T0 + 900
    assert state.unacked == []
