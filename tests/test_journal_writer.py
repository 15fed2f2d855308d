"""The journal writer (journal/files.py ``Journal``): rotation, reopening, refused
and failed writes; the fsync policies observed through a counting ``os.fsync`` and
a fake clock, durable_lsn; the background group commit of the interval policy."""

from __future__ import annotations

import os
import tempfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from journal_model import (
    FAST_PHASES,
    T0,
    FakeClock,
    make_journal,
    random_history,
)

from wheeld.journal.files import (
    FsyncPolicy,
    PendingTimer,
    list_segments,
    parse_fsync_policy,
)
from wheeld.journal.recovery import recover
from wheeld.protocol import journal as pj
from wheeld.protocol.errors import Closed, InvalidRequest, JournalUnavailable
from wheeld.protocol.journal import (
    Add,
    Cancel,
    SegmentHeader,
)


def test_rotation_by_size(tmp_path):
    clock = FakeClock()
    journal = make_journal(tmp_path, clock, fsync="off", segment_bytes=1_000, name="svc")
    for index in range(100):
        journal.append([Add(t=T0, g="g", k=index, d=T0 + index, s=index),
                        Cancel(t=T0, g="g", k=index, s=index, hit=False)])
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
    """A write that fails half-way is cut back; the journal stalls (tests/test_journal_stall.py)
    and its resume writes a snapshot of the owner's state, which covers that batch."""
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
    with pytest.raises(JournalUnavailable):
        journal.append([Add(t=T0, g="g", k="b", d=T0, s=2), Add(t=T0, g="g", k="c", d=T0, s=3)])
    monkeypatch.setattr(os, "write", real_write)
    assert journal.segment_path.stat().st_size == size_before and journal.last_lsn == 3
    state = [PendingTimer("g", key, T0, 1) for key in "abc"]
    assert journal.resume(lambda: (state, []))
    assert journal.append([Add(t=T0, g="g", k="d", d=T0, s=4)]) == 4
    journal.close()
    state = recover(tmp_path)
    assert set(state.pending) == {("g", "a"), ("g", "b"), ("g", "c"), ("g", "d")} and state.problems == []


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
    journal.sync()  # an explicit sync is always honoured: every segment written, and their names
    segments = len(list_segments(tmp_path))
    assert journal.durable_lsn == 30 and len(fsync_log) == segments + 1
    journal.close()
    assert len(fsync_log) == segments + 1


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
        for batch in random_history(seed=1, steps=80)[1]:
            journal.append(batch)
        journal.close()
        contents.append([path.read_bytes() for _, path in list_segments(directory)])
    assert contents[0] == contents[1] == contents[2]


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
    with pytest.raises(JournalUnavailable) as raised:
        journal.poll_sync(wait=True)
    assert isinstance(raised.value.__cause__, OSError) and raised.value.__cause__.errno == 5
    assert journal.durable_lsn == 0 and not journal.writable
    monkeypatch.undo()
    journal.close()
