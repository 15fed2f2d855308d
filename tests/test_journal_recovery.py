"""Recovery (journal/recovery.py ``recover``): random event sequences, snapshots and
compaction agree with a reference model after recovery; torn and corrupted tails
are cut at the last good record (and saved aside), damage in older segments is
reported and skipped, gaps are reported; replication samples (``repl``) change no
timer."""

from __future__ import annotations

import os
import tempfile

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from journal_model import (
    FAST_PHASES,
    T0,
    Model,
    assert_state_equals_model,
    make_journal,
    no_fsync,
    random_history,
)

from wheeld.journal.files import (
    list_segments,
    list_snapshots,
)
from wheeld.journal.recovery import check_journal, recover
from wheeld.protocol import journal as pj
from wheeld.protocol.journal import (
    Ack,
    Add,
    Cancel,
    Fire,
    IdleRearm,
    Rearm,
    Repl,
    key_from_json,
    key_to_json,
)

KEYS = st.sampled_from(["a", "b64:x", b"a", b"\xff", 1, 2**40])
OPS = st.tuples(
    st.sampled_from(["add", "add", "add_idle", "cancel", "fire", "ack", "idle_rearm", "snapshot", "batch", "repl"]),
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
            elif op == "repl":  # a replication sample, amid the timer events: it changes nothing
                batch.append(_repl(T0 + delay_ms, pick))
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


def _repl(t: int, pick: int = 0) -> Repl:
    states = ("connecting", "replicating", "behind", "fenced")
    return Repl(t=t, host="h1", epoch=pick % 4, state=states[pick % len(states)], rlsn=pick, lag=pick % 7,
                lag_ms=pick * 3)


def test_a_journal_with_replication_samples_recovers_the_same_timers(tmp_path):
    """The same history journaled with repl events among its timer events (in batches of
    their own and inside timer batches, across segments, after a snapshot) recovers the
    same timers, with nothing reported; its lsns count the samples."""
    model, batches = random_history(seed=21, steps=400)
    directories = {}
    for with_samples in (False, True):
        directory = tmp_path / ("repl" if with_samples else "plain")
        journal = make_journal(directory, fsync="off", segment_bytes=4_000)
        samples = 0
        for index, batch in enumerate(batches):
            batch = [msgspec.structs.replace(event) for event in batch]  # append numbers its events
            if with_samples and index % 3 == 0:
                journal.append([_repl(T0 + index, index)])
                samples += 1
            if with_samples and index % 4 == 1 and batch:
                batch.insert(len(batch) // 2, _repl(T0 + index, index))
                samples += 1
            journal.append(batch)
            if index == len(batches) // 2:
                journal.write_snapshot(journal.last_lsn, *_state_of(directory))
        directories[with_samples] = (directory, journal.last_lsn, samples)
        journal.close()
    plain_dir, plain_last, _ = directories[False]
    repl_dir, repl_last, samples = directories[True]
    assert samples > 0 and repl_last == plain_last + samples
    assert len(list_segments(repl_dir)) > 2
    plain, state = recover(plain_dir), recover(repl_dir)
    assert state.problems == [] and state.damage == [] and state.last_lsn == repl_last
    assert state.pending == plain.pending and _unacked(state) == _unacked(plain)
    assert_state_equals_model(state, model)
    assert check_journal(repl_dir).ok


def _state_of(directory) -> tuple[list, list]:
    state = recover(directory, repair=False, quiet=True)
    return list(state.pending.values()), state.unacked


def _unacked(state) -> list:
    return sorted((timer.group, repr(timer.key), timer.seq, timer.deadline_ms) for timer in state.unacked)


def test_corrupted_newest_snapshot_falls_back_to_older(tmp_path):
    model, batches = random_history(seed=3, steps=400)
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




@given(cut_fraction=st.floats(0.0, 1.0), zeros=st.integers(0, 300))
@settings(max_examples=80, deadline=None, phases=FAST_PHASES)
def test_torn_tail_recovers_to_last_good_record(cut_fraction, zeros):
    model, batches = random_history(seed=11, steps=150)
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
        if model.unacked.pop((event.g, key, event.s), None) is not None:  # a fired one, back on the wheel
            model.pending[(event.g, key)] = (event.d, event.s, idle)
        else:
            deadline, seq, old_idle = model.pending[(event.g, key)]
            model.pending[(event.g, key)] = (event.d, seq, old_idle)


@pytest.mark.parametrize("damaged_lines", [1, 2])
def test_corrupted_tail_is_cut_and_saved_aside(tmp_path, caplog, damaged_lines):
    """Bad lines with no good line after them in the newest segment are a torn write: cut."""
    model, batches = random_history(seed=5, steps=60)
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


def test_recovery_skips_covered_events_even_after_a_damaged_newline(tmp_path):
    model, batches = random_history(seed=21, steps=300)
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
