"""The daemon's Recorder (daemon/recorder.py): its batch methods journal exactly
what the scalar methods do, and a batch applied collapsed is journaled as the
commands in order."""

from __future__ import annotations

import contextlib
import os
import random

import msgspec
from journal_model import (
    T0,
)

from wheeld.journal.files import (
    Journal,
)
from wheeld.protocol.journal import (
    key_to_json,
)

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


def test_a_batch_journals_its_acknowledgements_after_its_armings(tmp_path, monkeypatch):
    """The library re-arms an idle timer touched after it fired with an ACK of the fired
    copy and an ADD_IDLE behind it, applied in that order. The journal has the arming
    first: a torn write that keeps only the start of the batch keeps the re-arm (the
    copy is delivered again) instead of the acknowledgement alone (the timer lost)."""
    from wheeld.daemon import recorder as recorder_module
    from wheeld.journal.recovery import recover

    monkeypatch.setattr(recorder_module, "mono_ms", lambda: 5_000)
    monkeypatch.setattr(recorder_module, "wall_offset_ms", lambda: T0 - 5_000)
    with _recorder(tmp_path, "acks-last") as (recorder, wheel):
        gid = wheel.group_id("g")
        recorder.begin()
        recorder.armed(gid, "conn", 4_000, 1, None, 500)
        recorder.commit(5_000)
        recorder.begin()
        recorder.fired(gid, "conn", 4_000, 1, 4_001, False, 500)
        recorder.commit(5_000)
        recorder.begin()  # the library's ACK of the stale copy, then its ADD_IDLE
        recorder.acked(gid, "conn", 1)
        recorder.armed(gid, "conn", 5_500, 2, None, 500)
        recorder.commit(5_000)
        path = recorder.journal.segment_path
        lines = path.read_bytes().splitlines()
    events = [msgspec.json.decode(line) for line in lines[1:]]
    assert [(e["ev"], e["s"]) for e in events] == [("add", 1), ("fire", 1), ("add", 2), ("ack", 1)]
    # a power cut tore the last batch's write after its first line: the re-arm survives,
    # and the acknowledged copy is delivered again (at least once)
    path.write_bytes(b"\n".join(lines[:-1]) + b"\n" + lines[-1][:10])
    state = recover(tmp_path / "acks-last", repair=False, quiet=True)
    assert [(timer.key, timer.seq) for timer in state.pending.values()] == [("conn", 2)]
    assert [(timer.key, timer.seq) for timer in state.unacked] == [("conn", 1)]


def test_the_idle_timers_of_a_freed_client_slot_are_journaled_as_the_plain_timers_they_become(tmp_path, monkeypatch):
    """A client slot freed (its client said Bye, or stayed away past its resume grace)
    turns the idle timers that read its touch table into plain timers, at last touch +
    idle_ms when that is later, else at their deadline (docs/contracts.md, "Sessions").
    The journal must say so: a record damaged afterwards is restored from it
    (daemon/reconcile.py), and an idle timer restored without its touch reference fires
    no sooner than idle_ms after the restore (``_restored_deadline``), so a timer the
    journal still called idle fired late by as much as the restart came after its last
    touch (simulation seeds 16646, moved to last touch + idle, and 16733, not moved)."""
    from types import SimpleNamespace

    import numpy as np

    from wheeld.daemon import recorder as recorder_module
    from wheeld.daemon.reconcile import _restored_deadline
    from wheeld.daemon.sessions import Sessions
    from wheeld.protocol import clients_layout as CL
    from wheeld.journal.recovery import recover

    monkeypatch.setattr(recorder_module, "mono_ms", lambda: 5_000)
    monkeypatch.setattr(recorder_module, "wall_offset_ms", lambda: T0 - 5_000)
    client_slot = 3
    with _recorder(tmp_path, "settled") as (recorder, wheel):
        gid = wheel.group_id("g")
        recorder.begin()
        slots = []
        # (key, deadline, tag, touch index, idle_ms): "touched" was touched at 4_000 (settles
        # at 7_000, later than its 6_000); "quiet" was never touched (keeps its 14_000)
        for key, deadline, tag, index, idle_ms in (("touched", 6_000, 1, 0, 3_000), ("quiet", 14_000, 2, 1, 9_000)):
            slot, _gen = wheel.schedule(key, deadline, gid, tag, client_slot << CL.TOUCH_INDEX_BITS | index)
            recorder.armed(gid, key, deadline, tag, None, idle_ms)
            slots.append(slot)
        recorder.commit(5_000)
        segment = SimpleNamespace(touch_capacity=2, _last_touch=np.array([4_000, 0], dtype=np.int64),
                                  _idle=np.array([3_000, 9_000], dtype=np.int64))
        sessions = Sessions.__new__(Sessions)
        sessions.wheel, sessions.recorder = wheel, recorder
        sessions.daemon = SimpleNamespace(clock=lambda: 5_000)
        sessions._settle_idle_timers(SimpleNamespace(slot=client_slot, segment=segment, poisoned=False),
                                     np.array(slots))
        assert wheel.records["deadline"][slots].tolist() == [7_000, 14_000]
        assert wheel.records["aux"][slots].tolist() == [-1, -1]
        state = recover(tmp_path / "settled", repair=False, quiet=True)
    pending = {key: timer for (_group, key), timer in state.pending.items()}
    assert {key: (timer.deadline_ms - (T0 - 5_000), timer.seq, timer.idle_ms) for key, timer in pending.items()} == \
        {"touched": (7_000, 1, None), "quiet": (14_000, 2, None)}
    # a record of theirs damaged, then restored from the journal by a daemon started at 6_000:
    # at its deadline, not idle_ms after the restart
    monotonic = lambda wall_ms: wall_ms - (T0 - 5_000)  # noqa: E731
    assert [_restored_deadline(pending[key], monotonic, 6_000) for key in ("touched", "quiet")] == [7_000, 14_000]


def test_a_snapshot_keeps_idle_timers_idle_from_the_touch_table_or_the_journal_read_at_start(tmp_path, monkeypatch):
    """An idle timer's snapshot line carries its idle time (``i``), as its ``add`` did: a
    record of it damaged later is restored from the journal as an idle timer
    (daemon/reconcile.py), not as a plain timer at a deadline its client's touches may have
    passed (simulation seed 57081). The idle time is its client's touch table's
    (``idle_source``); while that table is out of reach, the journal's at start
    (``known_idle``), kept only as long as a snapshot still needs it."""
    from wheeld.daemon import recorder as recorder_module
    from wheeld.daemon.recorder import Recorder
    from wheeld.journal.recovery import recover
    from wheeld.protocol import clients_layout as CL

    monkeypatch.setattr(recorder_module, "mono_ms", lambda: 5_000)
    monkeypatch.setattr(recorder_module, "wall_offset_ms", lambda: T0 - 5_000)
    in_reach, away = 1 << CL.TOUCH_INDEX_BITS | 4, 2 << CL.TOUCH_INDEX_BITS | 9
    with _recorder(tmp_path, "idle") as (_unused, wheel):
        gid = wheel.group_id("g")
        # (key, tag, aux): a plain timer, an idle one whose table is in reach, one whose table is
        # not (its idle time known from the journal at start), one neither knows
        for key, tag, aux in (("plain", 1, -1), ("touched", 2, in_reach), ("away", 3, away), ("unknown", 4, away)):
            wheel.schedule(key, 9_000, gid, tag, aux)
        journal = Journal(tmp_path / "snapshots", fsync="off", host="test-host")
        try:
            recorder = Recorder(journal, wheel, known_idle={("g", "away", 3): 7_000, ("g", "gone", 5): 1_000})
            recorder.idle_source = lambda aux: 3_000 if aux == in_reach else None
            recorder.snapshot()
            assert recorder._known_idle == {("g", "away", 3): 7_000}  # what the next snapshot still needs
        finally:
            journal.close()
        state = recover(tmp_path / "snapshots", repair=False, quiet=True)
    assert {key: timer.idle_ms for (_group, key), timer in state.pending.items()} == \
        {"plain": None, "touched": 3_000, "away": 7_000, "unknown": None}


class _FakeReplicator:
    """What the Recorder reads of a replicator (wheeld.fleet.replicator.Replicator): its
    host id, ``state``, ``stats()`` and ``want_snapshot``; counts the ``stats()`` calls."""

    def __init__(self) -> None:
        self.host = "web-3"
        self.state = "connecting"
        self.want_snapshot = False
        self.stats_calls = 0
        self.figures = {"fleet_epoch": 0, "fleet_replicated_lsn": 0, "fleet_lag_records": 1, "fleet_lag_ms": 0}

    def stats(self) -> dict:
        self.stats_calls += 1
        return {"fleet_state": self.state, **self.figures, "fleet_outbox_bytes": 0}


class _Clock:
    def __init__(self, now_ms: int) -> None:
        self.now_ms, self.reads = now_ms, 0

    def __call__(self) -> int:
        self.reads += 1
        return self.now_ms


@contextlib.contextmanager
def _replicating_recorder(tmp_path, clock: _Clock, replica, **options):
    """A Recorder on a fake clock (offset T0 - 5_000: monotonic 5_000 is wall T0) with ``replica``."""
    from wheeld.daemon.recorder import Recorder

    with _recorder(tmp_path, "unused") as (_unused, wheel):
        journal = Journal(tmp_path / "repl", fsync="off", host="test-host")
        try:
            recorder = Recorder(journal, wheel, clock_ms=clock, offset_ms=lambda: T0 - 5_000, **options)
            recorder.replica = replica
            yield recorder, wheel
        finally:
            journal.close()


def _journaled(tmp_path) -> list[dict]:
    from wheeld.journal.files import list_segments

    return [msgspec.json.decode(line) for _, path in list_segments(tmp_path / "repl")
            for line in path.read_bytes().splitlines()[1:]]


def test_the_recorder_journals_the_replication_every_period_and_at_once_on_a_change(tmp_path):
    """With a replicator, a tick journals a repl event (state, replicated lsn, lag, host id,
    epoch, at the wall time of the tick) when REPL_EVERY_MS passed since the last one or the
    replicator's state changed, and at close; the other ticks ask the replicator nothing
    and read the clock no more than without one. Recovery skips the events."""
    from wheeld.journal.recovery import recover
    from wheeld.protocol.journal import REPL_EVERY_MS

    clock, replica = _Clock(5_000), _FakeReplicator()
    with _replicating_recorder(tmp_path, clock, replica) as (recorder, wheel):
        recorder.tick(5_000)  # the first tick: at once
        gid = wheel.group_id("g")
        recorder.begin()
        wheel.schedule("k", 9_000, gid, 1)
        recorder.armed(gid, "k", 9_000, 1, None, None)
        recorder.commit(5_100)
        replica.state = "replicating"
        replica.figures.update(fleet_epoch=3, fleet_replicated_lsn=2, fleet_lag_records=0)
        recorder.tick(5_200)  # the state changed: at once
        calls, reads = replica.stats_calls, clock.reads
        for now in range(5_201, 5_200 + REPL_EVERY_MS, 499):  # nothing due: nothing asked, no clock read added
            recorder.tick(now)
        assert replica.stats_calls == calls
        idle_reads = clock.reads - reads
        recorder.replica = None
        reads = clock.reads
        for now in range(5_201, 5_200 + REPL_EVERY_MS, 499):
            recorder.tick(now)
        assert clock.reads - reads == idle_reads
        recorder.replica = replica
        replica.figures.update(fleet_lag_records=4, fleet_lag_ms=1_250)
        recorder.tick(5_200 + REPL_EVERY_MS)  # the period: one more, same state
        replica.state = "behind"
        recorder.tick(5_200 + REPL_EVERY_MS + 7)
        assert replica.stats_calls == calls + 2
        clock.now_ms = 20_000
        recorder.close()  # the last one, as the daemon leaves
    events = _journaled(tmp_path)
    samples = [event for event in events if event["ev"] == "repl"]
    assert [event["ev"] for event in events] == ["repl", "add", "repl", "repl", "repl", "repl"]
    assert [event["n"] for event in events] == [1, 2, 3, 4, 5, 6]
    wall = lambda now: now + T0 - 5_000  # noqa: E731
    assert [(s["t"], s["state"], s["epoch"], s["rlsn"], s["lag"], s["lag_ms"]) for s in samples] == [
        (wall(5_000), "connecting", 0, 0, 1, 0),
        (wall(5_200), "replicating", 3, 2, 0, 0),
        (wall(5_200 + REPL_EVERY_MS), "replicating", 3, 2, 4, 1_250),
        (wall(5_207 + REPL_EVERY_MS), "behind", 3, 2, 4, 1_250),
        (wall(20_000), "behind", 3, 2, 4, 1_250),
    ]
    assert {s["host"] for s in samples} == {"web-3"}
    state = recover(tmp_path / "repl", repair=False, quiet=True)
    assert state.last_lsn == 6 and state.problems == [] and list(state.pending) == [("g", "k")]


def test_without_a_replicator_the_recorder_journals_no_replication(tmp_path):
    from wheeld.protocol.journal import REPL_EVERY_MS

    clock = _Clock(5_000)
    with _replicating_recorder(tmp_path, clock, None) as (recorder, _wheel):
        for now in range(5_000, 5_000 + 3 * REPL_EVERY_MS, 1_000):
            recorder.tick(now)
        recorder.close()
    assert _journaled(tmp_path) == []


def test_a_stalled_journal_journals_no_replication_until_it_is_writable_again(tmp_path):
    """A journal that cannot be written gets no repl event (the tick tries to resume it
    instead); once it is writable again, the next tick journals the state it missed."""
    import errno

    clock, replica = _Clock(5_000), _FakeReplicator()
    with _replicating_recorder(tmp_path, clock, replica) as (recorder, _wheel):
        recorder.tick(5_000)
        recorder.journal._stall(OSError(errno.ENOSPC, "No space left on device"))
        replica.state = "behind"
        recorder._next_retry_ms = 10**12  # no resume yet
        recorder.tick(5_100)
        assert replica.stats_calls == 1 and not recorder.journal.writable
        clock.now_ms = recorder._next_retry_ms = 6_000
        recorder.tick(6_000)  # resumes the journal (a snapshot, a new segment)
        assert recorder.journal.writable
        recorder.tick(6_001)
        assert replica.stats_calls == 2
    assert [event["state"] for event in _journaled(tmp_path) if event["ev"] == "repl"] == ["connecting", "behind"]


def test_replication_samples_alone_make_a_snapshot_due_only_once_a_day_of_them_gathered(tmp_path, monkeypatch):
    """An idle replicating daemon journals a repl event every 10 s; they alone must not make
    the time-based snapshot due (it would write, and send to the stream, all its timers every
    snapshot_every_s), until a day's worth (REPL_SNAPSHOT_SAMPLES) has gathered. A timer
    event does, as without replication."""
    from wheeld.daemon import recorder as recorder_module
    from wheeld.journal.files import list_snapshots
    from wheeld.protocol.journal import REPL_EVERY_MS

    monkeypatch.setattr(recorder_module, "REPL_SNAPSHOT_SAMPLES", 30)
    clock, replica = _Clock(5_000), _FakeReplicator()

    def run(recorder, until_ms: int) -> None:
        while clock.now_ms < until_ms:
            clock.now_ms += REPL_EVERY_MS
            recorder.tick(clock.now_ms)

    with _replicating_recorder(tmp_path, clock, replica, snapshot_every_s=60.0) as (recorder, wheel):
        run(recorder, 5_000 + 20 * REPL_EVERY_MS)  # 20 samples over 200 s: none due
        assert list_snapshots(tmp_path / "repl") == []
        gid = wheel.group_id("g")
        recorder.begin()
        wheel.schedule("k", 900_000, gid, 1)
        recorder.armed(gid, "k", 900_000, 1, None, None)
        recorder.commit(clock.now_ms)
        run(recorder, clock.now_ms + REPL_EVERY_MS)  # a timer event and 60 s: due
        assert [lsn for lsn, _ in list_snapshots(tmp_path / "repl")] == [recorder.journal.last_lsn]
        first = recorder.journal.last_lsn
        run(recorder, clock.now_ms + 29 * REPL_EVERY_MS)  # 29 samples since: still none
        assert len(list_snapshots(tmp_path / "repl")) == 1
        run(recorder, clock.now_ms + 2 * REPL_EVERY_MS)  # the 30th: due (60 s passed long ago)
        snapshots = [lsn for lsn, _ in list_snapshots(tmp_path / "repl")]
        assert snapshots == [first, first + 30]
