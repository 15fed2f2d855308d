"""The deterministic simulation of the whole service (tests/sim, docs/testing.md), in the suite.

Every seed that ever failed stays here as a regression case (sim/regressions.txt),
and each run of the suite tries a slice of fresh seeds: their first is printed (and
``WHEELD_SIM_FIRST`` replays the slice); a failing seed prints the command that
replays it alone (``make simulate SEED=N OPS=N``). ``make simulate SEEDS=N`` runs
as many as asked; the long variant (marked slow) runs more.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from pathlib import Path

import pytest

from sim.__main__ import regression_cases, replay_command
from sim.run import run_seed

SLICES = 4  # tests the fresh seeds are spread over (xdist runs them side by side)
# each runs fresh seeds for about this long (make test-fast asks for less: WHEELD_SIM_SLICE_S)
SLICE_SECONDS = float(os.environ.get("WHEELD_SIM_SLICE_S", "20"))
SLICE_OPS = 1000


@pytest.fixture(autouse=True)
def _quiet():
    logging.disable(logging.CRITICAL)
    yield
    logging.disable(logging.NOTSET)


def _failure(seed: int, ops: int, violations, extra: bool = True, hold: bool = True, cut: bool = True) -> str:
    shown = "\n".join(str(v)[:2000] for v in violations[:5])
    return (f"seed {seed} ({ops} ops) broke the contract:\n{shown}\n"
            f"replay: {replay_command(seed, ops, extra, hold, cut=cut)}")


@pytest.mark.parametrize("seed,ops,extra,hold,cut", regression_cases())
def test_every_seed_that_ever_failed_passes(seed, ops, extra, hold, cut):
    result = run_seed(seed, ops, extra=extra, hold=hold, cut=cut)
    assert not result.violations, _failure(seed, ops, result.violations, extra, hold, cut)
    assert result.acked > 0, "the seed's workers had no acknowledged arming: it checks nothing"


def _fresh(index: int, seconds: float, ops: int, extra: bool) -> None:
    first = int(os.environ["WHEELD_SIM_FIRST"]) + index * 100_000
    print(f"fresh seeds from {first} ({ops} ops each, {'all workloads' if extra else 'plain'}; "
          f"WHEELD_SIM_FIRST={os.environ['WHEELD_SIM_FIRST']})")
    deadline = time.monotonic() + seconds
    seed, checked, handed = first, 0, 0
    while checked < 3 or time.monotonic() < deadline:
        result = run_seed(seed, ops, extra=extra)
        assert not result.violations, _failure(seed, ops, result.violations, extra)
        checked += 1
        handed += result.handed
        seed += 1
    print(f"{checked} seeds passed, {handed} expirations handed over")
    assert handed > 0


@pytest.mark.parametrize("index", range(SLICES))
def test_a_slice_of_fresh_seeds_keeps_the_contract(index):
    """The plain workloads: every fresh seed of them has passed since the failures in
    docs/testing.md were fixed. The newer ones (Profile.draw_extra) still fail about one
    seed in a hundred on the Python path (the open findings listed there), so the
    suite, which must not fail at random, runs them only in the slow variant below."""
    _fresh(index, SLICE_SECONDS, SLICE_OPS, extra=False)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(SLICES, SLICES + 4))
def test_a_long_run_of_fresh_seeds_keeps_the_contract(index):
    _fresh(index, 600.0, SLICE_OPS, extra=True)


def test_one_seed_is_one_history():
    """The same seed twice gives the same run, event for event (a replay is exact)."""
    for seed in (11, 12):
        a, b = run_seed(seed, 300, trace=True), run_seed(seed, 300, trace=True)
        assert a.trace == b.trace and a.events == b.events and dict(a.faults) == dict(b.faults)
        assert len(a.trace) > 50


def test_the_checker_catches_what_it_is_for():
    """Each rule of the checker fires on a history that breaks it (the checker is not vacuous)."""
    from sim.checker import History, check

    ms = 1_000_000
    h = History()
    h.joined(1, "g")
    h.joined(2, "g")
    h.armed(1, "c1-0", 10, 0, 100, idle=False)  # lost: acknowledged, never handed
    h.armed(1, "c1-1", 11, 0, 100, idle=False)  # early: handed at 50 ms
    h.armed(1, "c1-2", 12, 0, 100, idle=False)  # superseded by an acknowledged cancel, then handed
    h.cancelled(1, "c1-2", 10 * ms, hit=True)
    h.armed(1, "c1-3", 13, 0, 10, idle=False)  # twice
    h.flushed(h.flush_called(1))
    h.handed(1, "c1-1", 11, 50 * ms)
    h.handed(1, "c1-2", 12, 200 * ms)
    h.handed(1, "c1-3", 13, 20 * ms, number=2, copy_fired_ns=10 * ms)
    h.handed(2, "c1-3", 13, 30 * ms, number=0, copy_fired_ns=25 * ms)
    h.handed(2, "c1-9", 99, 30 * ms)  # invented
    h.ack_timeout_ns = 30_000 * ms
    h.ack_marks = {1: [(21 * ms, 3)], 2: [(31 * ms, 2)]}  # each acknowledged its copies at once
    rules = sorted({v.rule for v in check(h, 10_000 * ms)})
    assert rules == ["early", "invented", "lost", "superseded", "twice"]


def _twice_history(**faults):
    """One arming handed to client 1 (its copy sent at 10 ms, handed at 20 ms) and then to
    client 2 (sent at 40 s, handed at 41 s, acknowledged at once), with ``faults`` applied:
    whether that second hand-over is a violation is the question."""
    from sim.checker import History

    ms = 1_000_000
    h = History()
    h.joined(1, "g")
    h.joined(2, "g")
    h.armed(1, "c1-0", 10, 0, 10, idle=False)
    h.flushed(h.flush_called(1), faults.get("flushed_at", 1) * ms)
    h.handed(1, "c1-0", 10, 20 * ms, number=0, copy_fired_ns=10 * ms)
    h.handed(2, "c1-0", 10, 41_000 * ms, number=0, copy_fired_ns=40_000 * ms)
    h.ack_timeout_ns = 30_000 * ms
    h.resume_grace_ns = faults.get("resume_grace", 60_000) * ms
    if "arena_loss" in faults:  # the arena lost while no daemon ran; the next one rebuilt it at once
        h.arena_lost(faults["arena_loss"] * ms)
        h.daemon_started(faults["arena_loss"] * ms + ms)
    if "ring_back" in faults:  # client 1's ring handed to the rebuilt arena's daemon, replayed
        h.new_arena_welcomes = {1: [faults["ring_back"] * ms]}
    if "hello_welcome" in faults:  # the same, between a Hello it sent and the Welcome it took (ms)
        hello, welcome = faults["hello_welcome"]
        h.new_arena_welcomes = {1: [(hello * ms, welcome * ms)]}
    h.ack_marks = {1: [(faults.get("acked_at", 21) * ms, 1)] if faults.get("acked_at", 21) is not None else [],
                   2: [(41_001 * ms, 1)]}
    if "session_end" in faults:
        h.session_ends = {1: [faults["session_end"] * ms]}
    if "crash" in faults:
        h.crashed(1, faults["crash"] * ms)
    if "ring_lost" in faults:  # client 1 had exited; the daemon holding its ring died before reading it all
        h.ring_lost(1, faults["ring_lost"] * ms)
    for at in faults.get("daemon_deaths", ()):
        h.daemon_died(at * ms)
    if "power_cut" in faults:
        h.power_cut(faults["power_cut"] * ms)
    return h


@pytest.mark.parametrize("faults,twice", [
    ({}, True),  # acknowledged at once to a daemon that applied it: handed again is a bug
    ({"crash": 30_000}, True),  # died long after its acknowledgement was in its ring
    ({"daemon_deaths": [5_000]}, True),  # a daemon restart alone never makes a second hand-over
    ({"acked_at": None, "crash": 30_000}, False),  # died before it pushed the acknowledgement
    ({"acked_at": 35_000}, False),  # acknowledged after the ack timeout
    ({"session_end": 15}, False),  # its session ended with the copy in flight
    ({"daemon_deaths": [21], "crash": 25}, False),  # the daemon died before it drained the ack, then it
    # it exited (a Bye, a kill) with the ack in its ring, and the daemon died before reading the ring ...
    ({"daemon_deaths": [21], "ring_lost": 21}, False),
    ({"daemon_deaths": [22], "crash": 21, "ring_lost": 22}, False),
    ({"daemon_deaths": [22], "crash": 21}, True),  # ... not when it read what the client left before it died
    ({"daemon_deaths": [5_000], "ring_lost": 5_000}, True),  # ... nor when what it left unread came after the ack
    ({"power_cut": 30}, False),  # a power cut after the copy was sent: the ack may not have been durable
    # the arena lost before the flush covering the arming returned, client 1's ring replayed
    # into the rebuilt arena at 40.5 s: within --resume-grace-s of the rebuild the daemon
    # skips what its arena held (ArmingsAtStart), so arming it again is a bug ...
    ({"flushed_at": 5, "arena_loss": 3, "ring_back": 40_500}, True),
    ({"flushed_at": 2, "arena_loss": 3, "ring_back": 40_500, "resume_grace": 30_000}, True),  # acked before
    # ... unless the ring came back after the grace, or a daemon died after the copy was acknowledged
    ({"flushed_at": 5, "arena_loss": 3, "ring_back": 40_500, "resume_grace": 30_000}, False),
    ({"flushed_at": 5, "arena_loss": 3, "ring_back": 40_500, "daemon_deaths": [30_000]}, False),
    # the daemon replays the ring when it reads the Hello: what it armed again may fire and be
    # handed to another member before client 1 reads its Welcome (seed 127670) ...
    ({"flushed_at": 5, "arena_loss": 3, "hello_welcome": (40_500, 41_040), "resume_grace": 30_000}, False),
    # ... but not before the Hello, nor within the grace
    ({"flushed_at": 5, "arena_loss": 3, "hello_welcome": (41_010, 41_040), "resume_grace": 30_000}, True),
    ({"flushed_at": 5, "arena_loss": 3, "hello_welcome": (40_500, 41_040)}, True),
])
def test_the_checker_allows_a_second_hand_over_only_in_the_at_least_once_windows(faults, twice):
    """Rule 4 (sim/checker.py): a second hand-over of one arming is allowed only where the
    first copy went back to its group (docs/contracts.md, "Delivery and durability")."""
    from sim.checker import check

    rules = {v.rule for v in check(_twice_history(**faults), 100_000 * 1_000_000)}
    assert ("twice" in rules) == twice, rules


@pytest.mark.parametrize("read_first", [False, True], ids=["killed-as-the-bye-came", "killed-after-the-bye"])
def test_a_ring_left_unread_by_a_daemon_killed_after_its_client_left_is_lost(read_first):
    """Seed 111376: a worker handed an expiration and left at once (``close()``: its library
    pushes the acknowledgement into its ring and sends a Bye, and does not wait), and the
    daemon was killed as the Bye came in, before it applied what the worker left in its ring.
    No process holds that ring any more: the next daemon finds the worker's process gone and
    sends the fired record to the group (docs/contracts.md, "Delivery and durability"), so
    the copy it had was not acknowledged to a daemon that applied it. The simulator tells the
    checker (``History.ring_lost``); a daemon that read the ring before it died lost nothing."""
    from sim.client import client_clock
    from sim.run import MS, Simulation

    sim = Simulation(1, 0)
    sim.fault_free = True
    world = sim.world

    def run(ms: int, done=lambda: False) -> None:
        until = world.now_ns + ms * MS
        while not done() and world.next_time() is not None and world.next_time() <= until:
            world.step()
            sim._settle()

    with client_clock(world.clock_ns):
        sim.start_daemon()
        worker = sim.spawn("g0")
        run(100, lambda: worker.client.connected)
        worker.client.add("c1-0", 1)
        worker.client.flush()
        run(100, lambda: worker.client.hands > 0)
        assert worker.client.hands == 1
        worker.alive = False
        worker.client.close()  # the acknowledgement into the ring, then the Bye
        assert worker.client.ack_marks[-1] == (world.now_ns, 1)
        if read_first:
            sim._settle()
            run(5)
            assert not sim.daemon.core.clients  # the Bye was read: the ring applied, the slot freed
        sim.kill_daemon()
    assert sim.history.rings_lost == ({} if read_first else {worker.ident: world.now_ns})


def _rearmed_history(rearm_ms=25, power_cut=None, arena_loss=None, copies=2):
    """An idle arming whose first copy client 1's library took in at 20 ms and re-armed
    over (touched since it fired: an ACK and an ADD_IDLE pushed at ``rearm_ms``), then
    ``copies`` copies of it (the fired record, the re-arm's expiration, ...) handed to
    client 2 from 40 s on, each acknowledged at once; ``power_cut``/``arena_loss``: when
    (ms)."""
    from sim.checker import History

    ms = 1_000_000
    h = History()
    h.joined(1, "g")
    h.joined(2, "g")
    h.armed(1, "c1-0", 10, 0, 10, idle=True)
    h.flushed(h.flush_called(1), 1 * ms)
    h.idle_rearmed(1, "c1-0", 10, rearm_ms * ms)
    for n in range(copies):
        h.handed(2, "c1-0", 10, (41_000 + n) * ms, number=n, copy_fired_ns=(40_000 + n) * ms)
    h.ack_timeout_ns = 30_000 * ms
    h.ack_marks = {2: [((41_000 + n) * ms + 1, n + 1) for n in range(copies)]}
    if power_cut is not None:
        h.crashed(1, power_cut * ms)
        h.power_cut(power_cut * ms)
    if arena_loss is not None:
        h.arena_lost(arena_loss * ms)
    return h


@pytest.mark.parametrize("faults,twice", [
    ({}, True),  # the library's acknowledgement was applied: the fired record is not sent again
    ({"power_cut": 30}, False),  # a power cut after the re-arm: its ACK may be lost, the ADD_IDLE kept
    ({"arena_loss": 30}, False),  # the arena lost after the re-arm: its ACK releases nothing
    ({"power_cut": 20, "rearm_ms": 25}, True),  # the cut came before the re-arm: no ACK of it to lose
    ({"power_cut": 30, "copies": 3}, True),  # one re-arm's lost ACK sends the fired record again once
])
def test_the_checker_allows_the_copy_a_library_rearmed_over_back_after_a_power_cut(faults, twice):
    """Rule 4 (sim/checker.py, History.returned_after_rearm): the copy a library took in and
    re-armed over was acknowledged, not handed; a power cut or an arena loss after that re-arm
    may take the acknowledgement and keep the ADD_IDLE behind it (docs/contracts.md, "Journal
    events" and "Delivery and durability"), so the fired record and the re-arm both reach an
    application: one hand-over more, and only one, per such re-arm."""
    from sim.checker import check

    rules = {v.rule for v in check(_rearmed_history(**faults), 100_000 * 1_000_000)}
    assert ("twice" in rules) == twice, rules


@pytest.mark.parametrize("snapshot", [False, True], ids=["stalled-to-the-cut", "snapshot-before-the-cut"])
def test_a_library_rearm_during_a_stall_leaves_its_arming_at_risk(snapshot):
    """Seed 79282: under ``--fsync interval=50`` an idle arming was acknowledged (10 ms), and
    the journal's next write failed (ENOSPC, 33 ms) before the fsync that was to make it
    durable; the journal stalled. Its library re-armed it 220 ms later (touched since it
    fired: an ACK and an ADD_IDLE, which the stalled daemon applied and did not write), and
    the power was cut 362 ms after the failure, before the retry's snapshot: the arming was
    at risk "until the daemon has written its snapshot again" (docs/contracts.md, "Delivery
    and durability"), re-arm or not, and its loss is no violation. Appends after the failure
    made durable before the cut (that snapshot) are the journal writing again: the loss is a
    violation then."""
    from sim.checker import History, check

    ms = 1_000_000
    h = History()
    h.joined(1, "g")
    h.armed(1, "c1-0", 10, 0, 20, idle=True)
    h.disk_written(1 * ms, append=0)  # the ADD_IDLE, appended and not yet synced
    h.flushed(h.flush_called(1), 10 * ms)
    h.disk_failed(33 * ms)  # the next append: ENOSPC, the journal stalls
    h.idle_rearmed(1, "c1-0", 10, 253 * ms)  # applied, not written
    if snapshot:
        h.disk_written(300 * ms, append=1)  # a snapshot fitted, then its fsync
        h.disk_synced(300 * ms)
        h.disk_made_durable([1])
    h.power_cut(395 * ms, 100 * ms)
    assert h.may_have_lost(h.armings[(1, "c1-0", 10)]) is not snapshot
    assert [v.rule for v in check(h, 20_000 * ms)] == (["lost"] if snapshot else [])


def test_every_known_bug_patch_still_applies():
    """The re-introduced bugs of tests/sim/known_bugs (docs/testing.md, "It finds what we
    know") stay measurable: each patch applies to the tree as it is."""
    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists():
        pytest.skip("not a git checkout: git apply needs one")
    patches = sorted((root / "tests" / "sim" / "known_bugs").glob("*.patch"))
    assert patches
    failed = [p.name for p in patches
              if subprocess.run(["git", "apply", "--check", str(p)], cwd=root, capture_output=True).returncode]
    assert not failed, f"these no longer apply (regenerate them against the code as it is): {failed}"


def test_the_checker_reads_the_cut_and_the_first_fire_right():
    """Seeds 16453 and 16362: what the disk took after a power cut at its very timestamp is the
    next boot's, not the stalled journal writing again; and a copy sent again to another member
    counts touches only up to the first fire, which a copy its dead first recipient read tells."""
    from sim.checker import History, check

    ms = 1_000_000
    h = History()
    h.joined(1, "g")
    h.armed(1, "c1-0", 10, 0, 10_000, idle=False)
    h.flushed(h.flush_called(1), 1 * ms)
    h.disk_failed(2 * ms)  # the journal stalls before its fsync
    h.power_cut(100 * ms, 60 * ms)
    h.disk_written(100 * ms)  # the next daemon's snapshot, at the cut's timestamp
    h.disk_synced(100 * ms)
    assert h.may_have_lost(h.armings[(1, "c1-0", 10)])
    assert not [v for v in check(h, 20_000 * ms) if v.rule == "lost"]

    h = History()
    h.joined(1, "g")
    h.joined(2, "g")
    h.armed(1, "c1-0", 10, 0, 14, idle=True)
    h.touched(1, "c1-0", 1 * ms)
    h.flushed(h.flush_called(1), 1 * ms)
    h.received("c1-0", 10, 15 * ms)  # the first copy, to a member that dies unpolled
    h.touched(1, "c1-0", 28 * ms)  # after the daemon read the word: too late for it
    h.handed(2, "c1-0", 10, 29 * ms, h.first_fired_ns("c1-0", 10, 29 * ms))  # re-queued at 29 ms
    assert not h.violations
    h.armed(1, "c1-1", 11, 30 * ms, 14, idle=True)
    h.touched(1, "c1-1", 40 * ms)  # before the first fire: held to its idle time
    h.received("c1-1", 11, 44 * ms)
    h.handed(2, "c1-1", 11, 50 * ms, h.first_fired_ns("c1-1", 11, 60 * ms))
    assert [v.rule for v in h.violations] == ["early"]


@pytest.mark.parametrize("snapshot", [False, True])
def test_the_durable_mark_does_not_end_a_stall(snapshot):
    """Seed 49288: a journal stalled on a full disk keeps advancing its durable mark (made
    the first time by write() under a temporary name, then fdatasync) for the events the
    fsync before the stall made durable. Those bytes hold no event: they do not end the
    stall, so a client's idle timers journaled at last touch + idle_ms as it left with a
    Bye during the stall are still at risk at a reboot before the snapshot that ends it
    (docs/contracts.md, "Delivery and durability"). Only the snapshot's bytes, written and
    synced, do."""
    import errno

    from sim.run import JOURNAL_DIR, Simulation

    from wheeld.protocol.journal import MARK_NAME

    ms = 1_000_000
    sim = Simulation(1, 1)
    disk, h, world = sim.disk, sim.history, sim.world
    disk.makedirs(JOURNAL_DIR)
    start = world.now_ns

    def append(name: str, at_ms: int, sync: bool = True) -> None:
        world.now_ns = start + at_ms * ms
        fd = disk.open(f"{JOURNAL_DIR}/{name}", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            disk.write(fd, b"{}\n")
            if sync:
                disk.fdatasync(fd)
        finally:
            disk.close(fd)

    h.joined(1, "g")
    append("journal-0000000000000001.jsonl", 1)
    disk.fail_next("write", errno.ENOSPC)
    with pytest.raises(OSError):
        append("journal-0000000000000001.jsonl", 2)  # the journal stalls
    h.left(1, start + 3 * ms)  # its idle timers are journaled while nothing is written
    append(MARK_NAME + ".tmp", 1_000)  # the mark, for what the fsync before the stall covered
    if snapshot:
        append("snapshot-0000000000000009.jsonl.tmp", 1_500)  # the stall ends
    h.power_cut(start + 2_000 * ms, 100 * ms)
    assert h.journal_may_have_lost(start + 3 * ms) is not snapshot


@pytest.mark.parametrize("snapshot", [False, True], ids=["stalled-to-the-cut", "snapshot-before-the-cut"])
def test_the_checker_takes_only_bytes_made_durable_for_a_stalled_journal_writing_again(snapshot):
    """Seed 49933: under ``--fsync interval=50`` an arming was acknowledged, and the fsync
    that was to make it durable failed (EIO) 41 ms later; the loop appended two events
    before it learned of the failure, and the next daemon's start fsynced that segment (a
    success that makes nothing durable after an EIO, sim/disk.py). No snapshot fitted the
    full disk before the power was cut: the arming was at risk "until the daemon has written
    its snapshot again" (docs/contracts.md), and its loss is no violation. Appends after the
    failure made durable before the cut (the snapshot) are the journal writing again: the
    loss is a violation then."""
    from sim.checker import History, check

    ms = 1_000_000
    h = History()
    h.joined(1, "g")
    h.armed(1, "c1-0", 10, 0, 10_000, idle=False)
    h.flushed(h.flush_called(1), 7 * ms)
    h.disk_failed(48 * ms)  # the interval's background fsync: EIO
    h.disk_written(50 * ms, append=0)  # the loop, before it learns of the failure
    h.disk_synced(300 * ms)  # the next daemon fsyncs the segments it finds: append 0 is not made durable
    if snapshot:
        h.disk_written(400 * ms, append=1)  # the snapshot, then its fsync
        h.disk_synced(400 * ms)
        h.disk_made_durable([1])
    h.power_cut(500 * ms, 100 * ms)
    assert h.may_have_lost(h.armings[(1, "c1-0", 10)]) is not snapshot
    assert [v.rule for v in check(h, 20_000 * ms)] == (["lost"] if snapshot else [])
