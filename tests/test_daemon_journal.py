"""The daemon with --journal: a lost arena (reboot, /dev/shm cleared) is rebuilt from disk."""

from __future__ import annotations

import collections
import json
import time

import wheeld
from daemon_harness import unlink_segments, wait_for_clock


def mono_ms() -> int:
    return time.monotonic_ns() // 1_000_000


def collect(client, want, timeout_s):
    got = []
    end = time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < end:
        got.extend(client.poll(0.1))
    return got


def test_reboot_recovers_every_flushed_timer_and_marks_late_ones(daemon_factory, tmp_path):
    journal = tmp_path / "journal"
    d = daemon_factory(extra=["--journal", str(journal), "--fsync", "always"]).start()
    w = wheeld.connect(d.socket_path, group="durable")
    deadlines = {}
    for i in range(2000):
        delay = 300 if i % 2 else 3000  # half come due while the "host" is down
        deadlines[i] = w.add(i, delay)  # the deadline the expiration will carry
    w.add("cancelled", 1000)
    w.cancel("cancelled")
    w.add("rearmed", 200)
    deadlines["rearmed"] = w.add("rearmed", 2500)
    w.flush()  # with fsync=always everything above is on disk now
    w.close()
    d.kill()
    removed = unlink_segments(d.name)  # the reboot: shared memory is gone
    assert any(name.endswith("-arena") for name in removed)
    # + 2: recovery maps a journaled wall-clock deadline back to the monotonic clock rounded
    # up (wall_to_monotonic_ns): a recovered timer may carry a deadline a ms or two later
    wait_for_clock(max(deadlines[i] for i in range(1, 2000, 2)) + 2,
                   "the 300 ms timers to come due while the host is down")
    before_restart = mono_ms()
    d.start()
    after_restart = mono_ms()  # the daemon's start (what "late" is measured against) lies in between
    assert "journal recovery" in d.log()
    with wheeld.connect(d.socket_path, group="durable") as w:
        got = collect(w, len(deadlines), 10.0)
        got += w.poll(0.3)
    counts = collections.Counter(e.key for e in got)
    assert set(counts) == set(deadlines), f"missing {set(deadlines) - set(counts)}"
    assert max(counts.values()) == 1
    late = {e.key for e in got if e.late}
    overdue = {e.key for e in got if e.deadline_ms < before_restart}  # came due while the "host" was down
    assert {i for i in range(1, 2000, 2)} <= overdue  # every 300 ms timer (the wait above)
    assert all(0 <= e.deadline_ms - deadlines[e.key] <= 2 for e in got)  # never earlier than add said
    assert overdue <= late, "the overdue timers fire at once, marked late"
    # a timer due after the restart is on time (on a loaded machine the restart may take
    # long enough for some 2.5-3 s timers to be overdue too: those are late, rightly)
    assert not late & {e.key for e in got if e.deadline_ms > after_restart}, (
        "a timer due after the restart is marked late")
    for e in got:
        assert e.fired_ms >= e.deadline_ms
    # the journal is JSON Lines with checksums: every line parses (read once the daemon has
    # stopped: a live daemon may be writing its last line at that moment)
    assert d.stop() == 0, d.log()
    lines = [line for path in sorted(journal.glob("journal-*.jsonl")) for line in path.read_bytes().splitlines()]
    kinds = collections.Counter(json.loads(line)["ev"] for line in lines)
    assert kinds["add"] >= 2001 and kinds["cancel"] == 1 and kinds["rearm"] == 1 and kinds["fire"] >= 2000


_STALE_ACKER = r"""
import json, os, sys, time
import wheeld
from wheeld.protocol import commands as C
socket_path, old_epoch = sys.argv[1], int(sys.argv[2])
w = wheeld.connect(socket_path, group="durable")
got, end = [], time.monotonic() + 10
while len(got) < 2 and time.monotonic() < end:
    got += w.poll(0.1)
handles, w._to_ack = w._to_ack, []  # the real acks are never sent
# ack every expiration we hold, but stamped with the arena that the reboot destroyed:
# a client that survived the reboot still holds such handles, and they name other
# records in the recovered arena
for slot, generation, _epoch in handles:
    assert w._segment.try_push(C.ACK, b"", 0, 0, old_epoch, slot, generation)
w.flush(timeout_s=10)
print(json.dumps({"keys": sorted(e.key for e in got), "epoch": w._welcome.arena_epoch}), flush=True)
os._exit(0)  # dies without acknowledging anything for real
"""


def test_acks_for_a_rebooted_arena_release_nothing(daemon_factory, tmp_path):
    """An ack names a record by (slot, generation), which only means something in the arena
    it was received from. After a reboot the recovered arena reuses slots and generations,
    so a surviving client's old acks must not release the recovered timers (the chaos test
    lost timers that way)."""
    import subprocess
    import sys

    d = daemon_factory(extra=["--journal", str(tmp_path / "journal"), "--fsync", "always"]).start()
    w = wheeld.connect(d.socket_path, group="durable")
    w.add("a", 20)
    b_due = mono_ms() + 700
    w.add("b", 700)
    w.flush()
    assert [e.key for e in collect(w, 1, 5.0)] == ["a"]
    old_epoch = w._welcome.arena_epoch
    assert old_epoch > 0
    d.kill()
    unlink_segments(d.name)  # the reboot
    wait_for_clock(b_due, '"b" to come due while the host is down')
    d.start()
    out = subprocess.run([sys.executable, "-c", _STALE_ACKER, d.socket_path, str(old_epoch)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert seen["keys"] == ["a", "b"] and seen["epoch"] != old_epoch  # "a" again: its ack never reached the disk
    with wheeld.connect(d.socket_path, group="durable") as w2:  # the acker died: both come again
        got = collect(w2, 2, 10.0)
    assert sorted(e.key for e in got) == ["a", "b"]
    w.close()


def test_one_big_journaled_batch_journals_the_commands_final_state(daemon_factory, tmp_path):
    """Thousands of commands drained in one batch (the daemon is stopped while they are
    pushed): adds, re-arms and cancels of the same keys, str/int/bytes keys, idle timers.
    The journal must replay to the state the commands leave, with a re-arm journaled
    as ``rearm`` and a cancel's ``hit`` saying whether a timer was pending."""
    import os
    import random
    import signal

    from wheeld.journal.recovery import recover
    from wheeld.protocol.journal import key_to_json

    journal = tmp_path / "journal"
    d = daemon_factory(extra=["--journal", str(journal), "--fsync", "off"]).start()
    rng = random.Random(5)
    keys = [f"k{i}" for i in range(150)] + list(range(100)) + [b"b%d" % i for i in range(50)] + ["str:x", "b64:y"]
    model: dict = {}  # key -> (delay_ms, idle) while pending
    hits = {True: 0, False: 0}
    with wheeld.connect(d.socket_path, group="big") as w:
        w.add("warm-up", 60_000)
        w.flush()
        start_wall = time.time_ns() // 1_000_000
        os.kill(d.pid, signal.SIGSTOP)  # commands pile up in the ring: one drain sees them all
        try:
            for _ in range(4000):
                key = rng.choice(keys)
                roll = rng.random()
                if roll < 0.25:
                    w.cancel(key)
                    hits[key in model] += 1
                    model.pop(key, None)
                elif roll < 0.3 and type(key) is str:
                    w.add_idle(key, 90_000)
                    model[key] = (90_000, True)
                else:
                    delay = rng.randint(60_000, 120_000)
                    w.add(key, delay)
                    model[key] = (delay, False)
        finally:
            os.kill(d.pid, signal.SIGCONT)
        w.flush()
    d.stop()
    model["warm-up"] = (60_000, False)
    state = recover(journal, repair=False)
    assert not state.problems
    got = {key: timer for (group, key), timer in state.pending.items() if group == "big"}
    assert set(got) == set(model)
    for key, (delay, _idle) in model.items():
        assert abs(got[key].deadline_ms - (start_wall + delay)) < 5_000, key
    lines = [json.loads(line) for path in sorted(journal.glob("journal-*.jsonl"))
             for line in path.read_bytes().splitlines()]
    cancels = [line for line in lines if line["ev"] == "cancel"]
    assert sum(c["hit"] for c in cancels) == hits[True] and len(cancels) == hits[True] + hits[False]
    rearms = [line for line in lines if line["ev"] == "rearm"]
    assert rearms and all(r["pd"] > 0 for r in rearms)
    idle_keys = {line["k"] for line in lines if line["ev"] in ("add", "rearm") and line.get("i") == 90_000}
    assert {key_to_json(k) for k, (_, idle) in model.items() if idle} <= idle_keys


def test_a_key_with_a_fired_unacknowledged_arming_and_a_pending_one_keeps_both():
    """Recovery restores an arming that fired and was not acknowledged (to deliver it
    again) and a later arming of the same key still pending: neither replaces the other."""
    from wheeld.journal.files import FiredTimer, PendingTimer
    from wheeld.journal.recovery import RecoveredState
    from wheeld.daemon.recovery import load_recovered
    from wheeld.shm.wheel import TimerWheel

    wall_ns, mono_ns = 1_800_000_000_000 * 1_000_000, 5_000 * 1_000_000
    now_wall = wall_ns // 1_000_000
    state = RecoveredState(
        pending={("g", "k"): PendingTimer("g", "k", now_wall + 3_000, 2)},
        unacked=[FiredTimer("g", "k", now_wall - 500, 1, now_wall - 400, False, 100),
                 FiredTimer("g", "k", now_wall - 300, 3, now_wall - 200, False, 100),  # fired twice, unacked twice
                 FiredTimer("g", "other", now_wall - 10, 4, now_wall - 5, False, 5)],
        last_lsn=10, snapshot_lsn=0, problems=[])
    wheel = TimerWheel.create(1000, start_ms=4_000)
    try:
        assert load_recovered(wheel, state, clocks=lambda: (wall_ns, mono_ns)) == 11
        gid = wheel.group_id("g")
        assert wheel.lookup("k", gid) == 5_000 + 3_000  # the pending arming, untouched
        fired = sorted((wheel.fired(s)[0], wheel.fired(s)[3]) for s in wheel.fired_slots())
        assert fired == [("k", 1), ("k", 3), ("other", 4)]  # all three to deliver again
        assert wheel.counters()["pending"] == 1 and wheel.counters()["fired_unacked"] == 3
        assert wheel.check() == []
    finally:
        wheel.close()
