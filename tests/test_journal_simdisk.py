"""The journal's engine over a simulated disk: seeded, deterministic histories of appends,
background fsyncs, snapshots, stalls, crashes and power cuts, checked against a model.

Each seed runs one history (``tests/sim/disk.py``: a page cache, power cuts that keep a
random prefix of what was not synced with a torn last write, ENOSPC/EIO on any call,
Linux's "a failed fsync drops the dirty pages"; ``tests/sim/runner.py``: the helper
thread's fsyncs and mark writes completed when the history says). The engine is the real
one (:class:`~wheeld.journal.files.Journal`, :func:`~wheeld.journal.recovery.recover`,
the daemon's restart decision :func:`wheeld.daemon.recovery._continue_after`), through its
file port. The checks:

* after a power cut, recovery rebuilds exactly the model's state at some lsn ``r`` with
  ``durable <= r <= numbered``: everything the journal reported durable (``durable_lsn``;
  what ``always`` returned from ``append``; what a ``resume`` covered) is there, nothing
  the owner never had is; no damage is reported; a torn tail is cut;
* the durable mark on disk never passes what was reported durable;
* a stalled journal refuses every append until a resume; a resume makes everything numbered
  durable;
* damage at rest (a flipped bit, a file cut short) is reported, or costs nothing: a state
  that is not the model's at an lsn at or after the mark comes with damage reported.

A failing seed prints the pytest command that replays it (``WHEELD_SIM_SEED=N``).
``WHEELD_SIM_SEEDS=N`` runs N seeds per policy (the default run is a bounded slice).
"""

from __future__ import annotations

import errno
import os
import random

import pytest
from journal_model import T0, Model

from sim.disk import SimDisk
from sim.runner import SimRunner
from wheeld.daemon.recovery import _continue_after, _unsynced_after_recovery
from wheeld.protocol.errors import JournalUnavailable
from wheeld.protocol.journal import MARK_NAME
from wheeld.journal.files import FiredTimer, Journal, PendingTimer, list_segments, list_snapshots, read_mark
from wheeld.journal.recovery import check_journal, recover

POLICIES = ("always", "interval=5", "off")
DIRECTORY = "/var/lib/wheeld/journal"
FAULT_CALLS = ("write", "fsync", "fdatasync", "pwrite", "open", "replace", "ftruncate")
FAULT_ERRORS = (errno.ENOSPC, errno.EIO, errno.EDQUOT)
KEYS = ["a", "b", "c", b"d", 5, 6, "b64:e", "str:f", "naïve", -7]


def _seeds(default: int) -> list[int]:
    one = os.environ.get("WHEELD_SIM_SEED")
    if one:
        return [int(one)]
    return list(range(int(os.environ.get("WHEELD_SIM_SEEDS", default))))


def frozen(pending: dict, unacked: dict) -> tuple:
    return (tuple(sorted(((g, repr(k)), v) for (g, k), v in pending.items())),
            tuple(sorted(((g, repr(k), s), v) for (g, k, s), v in unacked.items())))


def recovered_model(state) -> tuple[dict, dict]:
    """A recovered state in the model's terms: (pending, unacked)."""
    pending = {(g, k): (t.deadline_ms, t.seq, t.idle_ms) for (g, k), t in state.pending.items()}
    unacked = {(t.group, t.key, t.seq): (t.deadline_ms, t.fired_ms, t.late, t.lateness_ms, t.idle_ms)
               for t in state.unacked}
    return pending, unacked


class _Arena:
    """What ``_continue_after`` asks of the arena: how many timers it holds."""

    def __init__(self, model: Model) -> None:
        self.model = model

    def __len__(self) -> int:
        return len(self.model.pending)

    def counters(self) -> dict:
        return {"fired_unacked": len(self.model.unacked)}


class History:
    """One seeded history of one journal directory (see the module docstring)."""

    def __init__(self, seed: int, policy: str) -> None:
        self.seed = seed
        self.policy = policy
        self.rng = random.Random(seed)
        self.disk = SimDisk(random.Random(seed * 7919 + 1))
        self.mono = 1_000
        self.wall = T0
        self.model = Model()
        self.states: dict[int, tuple] = {0: frozen({}, {})}
        self.numbered = 0  # the last lsn the owner's state has (the arena's)
        self.durable = 0  # the highest lsn the journal reported durable
        self.published = (0, 0)  # (journal_lsn, journal_durable_lsn) as the arena's header holds them
        self.runner = SimRunner()
        self.trace: list[str] = []
        self.segment_bytes = self.rng.choice((600, 1500, 4000, 1 << 20))
        self.journal = self._open(next_lsn=1, resync=False)

    # ---------------------------------------------------------------- the owner
    def _open(self, next_lsn: int, resync: bool) -> Journal:
        self.runner = SimRunner()
        journal = Journal(DIRECTORY, fsync=self.policy, segment_bytes=self.segment_bytes, host="sim",
                          name="sim", next_lsn=next_lsn, wall_ms=lambda: self.wall, mono_ms=lambda: self.mono,
                          resync=resync, stall_on_error=True, fs=self.disk, runner=self.runner)
        self.observe(journal)
        return journal

    def observe(self, journal: Journal | None = None) -> None:
        """What the journal says is durable becomes a promise the checks hold it to."""
        journal = journal or self.journal
        self.durable = max(self.durable, journal.durable_lsn)
        assert journal.durable_lsn <= journal.last_lsn

    def publish(self) -> None:
        self.published = (self.journal.last_lsn, self.journal.durable_lsn)

    def state(self):
        pending = [PendingTimer(g, k, d, s, i) for (g, k), (d, s, i) in self.model.pending.items()]
        unacked = [FiredTimer(g, k, d, s, f, late, lat, i)
                   for (g, k, s), (d, f, late, lat, i) in self.model.unacked.items()]
        return pending, unacked

    def tick(self, ms: int) -> None:
        self.mono += ms
        self.wall += ms

    # ---------------------------------------------------------------- actions
    def append(self) -> None:
        events = []
        first = self.journal.last_lsn + 1
        for _ in range(self.rng.randint(1, 6)):
            op = self.rng.choice(["add", "add", "add", "add_idle", "cancel", "fire", "ack", "idle_rearm"])
            event = self.model.step(op, self.rng.choice(["g1", "g2"]), self.rng.choice(KEYS),
                                    self.rng.randint(1, 50_000), self.rng.randint(0, 99))
            if event is not None:
                events.append(event)
                self.states[first + len(events) - 1] = frozen(self.model.pending, self.model.unacked)
        if not events:
            return
        writable = self.journal.writable
        self.trace.append(f"append {len(events)} (lsn {first}..{first + len(events) - 1}, writable {writable})")
        try:
            lsn = self.journal.append(events, now_ms=self.mono)
        except JournalUnavailable:
            lsn = None
        assert [event.n for event in events] == list(range(first, first + len(events)))
        self.numbered = first + len(events) - 1
        assert self.journal.last_lsn == self.numbered
        if not writable:
            assert lsn is None, "a stalled journal took an append"
        if lsn is not None and self.policy == "always":
            assert self.journal.durable_lsn == lsn
        self.observe()
        self.publish()

    def sync_tick(self) -> None:
        self.tick(self.rng.choice((1, 3, 6, 20)))
        try:
            if self.policy.startswith("interval"):
                self.journal.start_sync(self.mono)
            else:
                self.journal.maybe_sync(self.mono)
        except JournalUnavailable:
            self.trace.append("sync tick: stalled")
        self.observe()
        self.publish()

    def background(self) -> None:
        if self.runner.run_next():
            self.trace.append("background task ran")
        try:
            self.journal.poll_sync()
        except JournalUnavailable:
            self.trace.append("background fsync failed: stalled")
        self.observe()

    def snapshot(self) -> None:
        if not self.journal.writable:
            return
        self.trace.append(f"snapshot at {self.journal.last_lsn}")
        try:
            self.journal.write_snapshot(self.journal.last_lsn, *self.state())
        except (JournalUnavailable, OSError) as exc:
            self.trace.append(f"snapshot failed: {exc!r}")
        self.observe()

    def resume(self) -> None:
        if self.journal.writable:
            return
        resumed = self.journal.resume(self.state)
        self.trace.append(f"resume -> {resumed}")
        if resumed:
            assert self.journal.writable and self.journal.durable_lsn == self.journal.last_lsn == self.numbered
        self.observe()
        self.publish()

    def fault(self) -> None:
        call, error = self.rng.choice(FAULT_CALLS), self.rng.choice(FAULT_ERRORS)
        self.trace.append(f"fail next {call} with {errno.errorcode[error]}")
        self.disk.fail_next(call, error)

    def crash(self) -> None:
        """The process dies (no reboot): the page cache and the arena survive, the helper's
        unfinished work does not; a new process continues as the daemon does."""
        self.trace.append(f"crash (published {self.published})")
        self.runner.drop()
        self.disk._faults.clear()
        self.restart_attached()

    def clean_restart(self) -> None:
        self.trace.append("close and restart")
        try:
            self.journal.close()
        except JournalUnavailable:
            pass
        self.runner.run_all()
        self.observe()
        self.publish()
        self.disk._faults.clear()
        self.restart_attached()

    def restart_attached(self) -> None:
        totals = {"journal_lsn": self.published[0], "journal_durable_lsn": self.published[1]}
        next_lsn, resync = _continue_after(DIRECTORY, _Arena(self.model), totals, fs=self.disk)
        self.trace.append(f"continue after: next {next_lsn}, resync {resync}")
        current = frozen(self.model.pending, self.model.unacked)
        for lsn in range(self.numbered + 1, next_lsn):
            self.states[lsn] = current  # lsns the journal skips: the arena's state at them is today's
        self.numbered = max(self.numbered, next_lsn - 1)
        self.journal = self._open(next_lsn, resync)
        try:
            self.journal.sync_previous_segments()
        except OSError as exc:
            self.trace.append(f"previous segments not synced: {exc!r}")
        if not self.journal.writable:
            self.resume()
        self.publish()

    def power_cut(self, damage: bool = False) -> None:
        """The host loses power; it reboots and a new daemon recovers the journal."""
        self.trace.append(f"power cut (durable {self.durable}, numbered {self.numbered})")
        self.runner.drop()
        self.disk.power_cut()
        mark = read_mark(DIRECTORY, self.disk)
        assert mark <= self.durable, f"the durable mark {mark} passed what was reported durable {self.durable}"
        lower = self.durable
        if damage:
            lower = mark
            self.damage_at_rest()
        state = recover(DIRECTORY, quiet=True, fs=self.disk)
        got = frozen(*recovered_model(state))
        exact = state.last_lsn in self.states and self.states[state.last_lsn] == got
        if self.policy == "off" and state.damage and not damage:
            # off promises nothing past what a snapshot or a close synced: a rotation leaves the
            # older segment's tail unsynced, and its loss is reported (never what was durable)
            for item in state.damage:
                assert item.lost_lsns is None or item.lost_lsns[0] > lower, str(item)
        elif not damage:
            assert state.damage == [], [str(item) for item in state.damage]
            assert lower <= state.last_lsn <= self.numbered, (lower, state.last_lsn, self.numbered)
            assert exact, f"recovered state is not the owner's at lsn {state.last_lsn}"
            if self.policy != "off":  # (off leaves an older segment's unsynced tail torn where a cut found it)
                report = check_journal(DIRECTORY, fs=self.disk)
                assert report.ok and report.torn == [], report.to_dict()  # recovery cut the torn tail
        elif not (exact and lower <= state.last_lsn):
            assert state.damage, "the state recovered from damaged files is wrong and no damage is reported"
        self.new_arena(state)

    def lose_arena(self) -> None:
        """The process dies and its arena is gone, the host runs on (the page cache keeps
        what was written): a new daemon recovers the journal into a new arena."""
        self.trace.append(f"crash, arena lost (durable {self.durable}, numbered {self.numbered})")
        self.runner.drop()
        self.disk._faults.clear()
        state = recover(DIRECTORY, quiet=True, fs=self.disk)
        assert self.durable <= state.last_lsn <= self.numbered
        assert state.damage == [] or self.policy == "off", [str(item) for item in state.damage]
        self.new_arena(state)

    def new_arena(self, state) -> None:
        """A new daemon: its arena is what was recovered; the journal continues after it,
        as :func:`wheeld.daemon.recovery.open_journal` continues it."""
        pending, unacked = recovered_model(state)
        self.model.pending, self.model.unacked = pending, unacked
        self.numbered = state.last_lsn
        self.states = {state.last_lsn: frozen(pending, unacked)}
        resync = _unsynced_after_recovery(DIRECTORY, state, self.disk)
        self.trace.append(f"recovered up to lsn {state.last_lsn}, resync {resync}")
        self.journal = self._open(state.last_lsn + 1, resync=resync)
        try:
            self.journal.sync_previous_segments()
        except OSError:
            pass
        if not self.journal.writable:
            self.resume()
        elif state.damage:
            self.snapshot()
        self.publish()

    def damage_at_rest(self) -> None:
        files = [str(path) for _, path in list_segments(DIRECTORY, self.disk) + list_snapshots(DIRECTORY, self.disk)]
        if not files:
            return
        path = self.rng.choice(files)
        size = len(self.disk.read_file(path))
        if self.rng.random() < 0.6 and size:
            at = self.disk.flip_bit(path)
            self.trace.append(f"bit flipped in {os.path.basename(path)} at byte {at}")
        elif size:
            length = self.rng.randrange(size)
            self.disk.truncate_file(path, length)
            self.trace.append(f"{os.path.basename(path)} cut from {size} to {length} bytes")

    # ---------------------------------------------------------------- the run
    def run(self, steps: int, faults: bool = True, crashes: bool = True, damage: bool = False) -> None:
        actions = [(self.append, 40), (self.sync_tick, 20), (self.background, 15), (self.snapshot, 3),
                   (self.resume, 8)]
        if faults:
            actions.append((self.fault, 6))
        if crashes:
            actions += [(self.crash, 2), (self.clean_restart, 1), (self.power_cut, 3), (self.lose_arena, 1)]
        choose, weights = zip(*actions)
        for _ in range(steps):
            self.rng.choices(choose, weights)[0]()
        self.power_cut(damage=damage)


def _run(seed: int, policy: str, steps: int, **kwargs) -> History:
    history = History(seed, policy)
    try:
        history.run(steps, **kwargs)
    except BaseException:
        print(f"replay: WHEELD_SIM_SEED={seed} python -m pytest -q -p no:cacheprovider "
              f"'tests/test_journal_simdisk.py' -k '{policy}'")
        print("\n".join(history.trace[-40:]))
        raise
    return history


@pytest.mark.parametrize("policy", POLICIES)
def test_power_cuts_keep_what_was_reported_durable(policy):
    for seed in _seeds(150):
        _run(seed, policy, 120, faults=False)


@pytest.mark.parametrize("policy", POLICIES)
def test_failing_calls_stall_and_resume_and_lose_nothing_reported_durable(policy):
    for seed in _seeds(150):
        _run(10_000 + seed, policy, 150)


@pytest.mark.parametrize("policy", POLICIES)
def test_damage_at_rest_is_reported_never_silently_accepted(policy):
    for seed in _seeds(100):
        _run(20_000 + seed, policy, 60, damage=True)


def test_one_seed_gives_one_history():
    def files(seed):
        history = _run(seed, "interval=5", 80)
        return history.trace, {path: history.disk.read_file(path) for path in history.disk.files(DIRECTORY)}

    assert files(3) == files(3)
    assert files(3) != files(4)


def test_histories_meet_every_fault_kind():
    """The default slice injects what it claims to: failures of every call, torn writes, stalls."""
    counts: dict[str, int] = {}
    for seed in range(60):
        history = _run(10_000 + seed, "always", 150)
        for what, n in history.disk.counts.items():
            counts[what] = counts.get(what, 0) + n
    for what in ("power_cut", "torn_write", "fault_write_EIO", "fault_fsync_EIO", "fault_write_ENOSPC",
                 "fault_fdatasync_EIO", "pwrite", "fdatasync"):
        assert counts.get(what, 0) > 0, (what, counts)


@pytest.mark.parametrize("retried", [False, True])
def test_a_mark_write_whose_fdatasync_failed_is_not_on_disk_until_written_again(retried):
    disk = SimDisk(random.Random(1))
    runner = SimRunner()
    model = Model()
    journal = Journal(DIRECTORY, fsync="always", host="sim", fs=disk, runner=runner)
    journal.append([model.step("add", "g", "a", 10, 0)])
    runner.run_all()
    journal.maybe_sync()  # collects the mark write
    assert journal.marked_lsn == 1 and read_mark(DIRECTORY, disk) == 1
    disk.fail_next("fdatasync", errno.EIO)
    journal.append([model.step("add", "g", "b", 10, 0)])
    runner.run_all()  # the slot is written, its fdatasync fails
    assert read_mark(DIRECTORY, disk) == 2  # the page cache has the slot...
    journal.maybe_sync()
    assert journal.mark_error is not None and journal.marked_lsn == 1
    if retried:  # ...written again, it is on disk
        runner.run_all()
        journal.maybe_sync()
        assert journal.mark_error is None and journal.marked_lsn == 2
    disk.power_cut()
    assert read_mark(DIRECTORY, disk) == (2 if retried else 1)  # ...the dropped write is not
    assert MARK_NAME in disk.listdir(DIRECTORY)


# --------------------------------------------------------------------------- #
# What the histories found, one case each
# --------------------------------------------------------------------------- #


def _journal(disk: SimDisk, policy: str = "always", **kwargs) -> Journal:
    kwargs.setdefault("runner", SimRunner(inline=True))
    return Journal(DIRECTORY, fsync=policy, host="sim", name="sim", fs=disk, **kwargs)


def _keys(state) -> set:
    return {key for (_group, key) in state.pending}


def _b_not_synced(disk: SimDisk, model: Model) -> Journal:
    """A journal that holds "a" synced, then "b" whose fsync failed with EIO."""
    journal = _journal(disk)
    journal.append([model.step("add", "g", "a", 60_000, 0)])
    disk.fail_next("fsync", errno.EIO)
    with pytest.raises(JournalUnavailable):
        journal.append([model.step("add", "g", "b", 60_000, 0)])
    return journal


def test_a_restart_writes_again_what_a_failed_fsync_dropped():
    """The fsync of a batch fails with EIO: Linux drops its pages, marks them clean and
    serves them from memory; the daemon dies; the next one reads those events back from
    the page cache. Continuing after them would count them durable (the journal's lsns
    go on, the next fsync succeeds without writing them) and a power cut would lose them:
    the restart writes a snapshot of the arena first."""
    disk = SimDisk(random.Random(3))
    model = Model()
    journal = _b_not_synced(disk, model)
    totals = {"journal_lsn": journal.last_lsn, "journal_durable_lsn": journal.durable_lsn}
    assert totals == {"journal_lsn": 2, "journal_durable_lsn": 1}
    # the daemon dies, its arena holds a and b; the page cache still serves b's line
    assert recover(DIRECTORY, repair=False, quiet=True, fs=disk).last_lsn == 2
    next_lsn, resync = _continue_after(DIRECTORY, _Arena(model), totals, fs=disk)
    assert (next_lsn, resync) == (3, True)
    journal = _journal(disk, next_lsn=next_lsn, resync=resync)
    assert journal.durable_lsn <= 1, "events nobody saw synced are not durable"
    assert journal.resume(lambda: ([PendingTimer("g", k, d, s, i) for (_g, k), (d, s, i) in model.pending.items()],
                                   []))
    journal.append([model.step("add", "g", "c", 60_000, 0)])
    disk.power_cut()
    assert _keys(recover(DIRECTORY, quiet=True, fs=disk)) == {"a", "b", "c"}


def test_a_start_killed_before_the_snapshot_after_a_damaged_recovery_leaves_it_to_the_next_start():
    """A recovery that skipped damage is followed by a snapshot of the arena it built
    (recovery.open_journal), so that later recoveries, and the comparison of an attached
    arena with the journal (daemon/reconcile.py, which refuses a journal with a damaged
    range), start after the damage. A start killed after it built the arena and opened
    the journal, before that snapshot, leaves an arena whose ``journal_lsn`` was never
    published (0); the next start attaches it and must write the snapshot itself, or the
    damage stays in the journal and no later attach repairs a damaged record from it
    (simulation seed 15488: a deadline moved earlier fired 477 ms early)."""
    disk = SimDisk(random.Random(5))
    model = Model()
    journal = _journal(disk)
    for key in "abcd":
        journal.append([model.step("add", "g", key, 60_000, 0)])
    journal.maybe_sync()
    assert read_mark(DIRECTORY, disk) == 4
    segment = list_segments(DIRECTORY, disk)[-1][1]
    disk.power_cut()
    disk.truncate_file(segment, len(disk.read_file(segment)) // 2)  # cut below the mark at the reboot
    state = recover(DIRECTORY, quiet=True, fs=disk)
    assert state.damage and state.last_lsn == 4
    # the start that built the new arena from ``state`` opens the journal and dies before its snapshot
    _journal(disk, next_lsn=state.last_lsn + 1)
    # the next start attaches that arena: its header says no daemon published a journal lsn
    totals = {"journal_lsn": 0, "journal_durable_lsn": 0}
    next_lsn, resync = _continue_after(DIRECTORY, _Arena(model), totals, fs=disk)
    assert (next_lsn, resync) == (5, True), "the snapshot that puts the damage behind is written"
    journal = _journal(disk, next_lsn=next_lsn, resync=resync)
    assert journal.resume(lambda: (list(state.pending.values()), []))  # the arena holds what was recovered
    journal.append([model.step("add", "g", "e", 60_000, 0)])
    again = recover(DIRECTORY, repair=False, quiet=True, fs=disk)
    assert not again.damage and again.snapshot_lsn == 4 and "e" in _keys(again)


def test_a_recovery_from_the_page_cache_is_written_again_before_it_counts():
    """As above, with the arena gone too (the host did not reboot): recovery reads the
    dropped pages back, so the new arena's journal starts with a snapshot."""
    disk = SimDisk(random.Random(4))
    model = Model()
    _b_not_synced(disk, model)
    state = recover(DIRECTORY, quiet=True, fs=disk)
    assert _keys(state) == {"a", "b"} and read_mark(DIRECTORY, disk) == 1
    assert _unsynced_after_recovery(DIRECTORY, state, disk) is True


def test_the_restart_sync_of_the_previous_segments_makes_their_names_durable():
    """Under off a segment's name is never synced when it is made; the next daemon's sync
    of the previous segments must cover the directory, or a power cut after it drops
    whole segments whose bytes it synced."""
    for seed in range(20):
        disk = SimDisk(random.Random(seed))
        model = Model()
        journal = _journal(disk, "off", segment_bytes=300)
        for index in range(12):
            journal.append([model.step("add", "g", f"k{index}", 60_000, 0)])
        assert len(list_segments(DIRECTORY, disk)) > 3
        # the daemon dies; the next continues after lsn 12 and syncs what it found
        journal = _journal(disk, "off", next_lsn=13)
        assert journal.sync_previous_segments()
        disk.power_cut()
        assert _keys(recover(DIRECTORY, quiet=True, fs=disk)) >= {f"k{index}" for index in range(12)}, seed


def test_an_explicit_sync_under_off_covers_the_segments_it_rotated_away_from():
    """``sync()`` (before a snapshot, at a clean stop) reports every event durable: under
    off the segments rotated away from were never synced, nor the names of the new ones."""
    for seed in range(20):
        disk = SimDisk(random.Random(seed))
        model = Model()
        journal = _journal(disk, "off", segment_bytes=300)
        for index in range(12):
            journal.append([model.step("add", "g", f"k{index}", 60_000, 0)])
        journal.sync()
        assert journal.durable_lsn == 12
        disk.power_cut()
        state = recover(DIRECTORY, quiet=True, fs=disk)
        assert state.damage == [] and _keys(state) == {f"k{index}" for index in range(12)}, seed
