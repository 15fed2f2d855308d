"""The daemon with --journal: a lost arena (reboot, /dev/shm cleared) is rebuilt from disk."""

from __future__ import annotations

import collections
import json
import time

import wheeld
from daemon_harness import unlink_segments


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
        deadlines[i] = mono_ms() + delay
        w.add(i, delay)
    w.add("cancelled", 1000)
    w.cancel("cancelled")
    w.add("rearmed", 200)
    w.add("rearmed", 2500)
    deadlines["rearmed"] = mono_ms() + 2500
    w.flush()  # with fsync=always everything above is on disk now
    w.close()
    d.kill()
    removed = unlink_segments(d.name)  # the reboot: shared memory is gone
    assert any(name.endswith("-arena") for name in removed)
    time.sleep(0.6)
    d.start()
    assert "journal recovery" in d.log()
    with wheeld.connect(d.socket_path, group="durable") as w:
        got = collect(w, len(deadlines), 10.0)
        got += w.poll(0.3)
    counts = collections.Counter(e.key for e in got)
    assert set(counts) == set(deadlines), f"missing {set(deadlines) - set(counts)}"
    assert max(counts.values()) == 1
    late = [e for e in got if e.late]
    assert {e.key for e in late} == {i for i in range(2000) if i % 2}, "the overdue timers fire at once, marked late"
    for e in got:
        assert e.fired_ms >= e.deadline_ms
    # the journal is JSON Lines with checksums: every line parses
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
    w.add("b", 700)
    w.flush()
    assert [e.key for e in collect(w, 1, 5.0)] == ["a"]
    old_epoch = w._welcome.arena_epoch
    assert old_epoch > 0
    d.kill()
    unlink_segments(d.name)  # the reboot
    time.sleep(0.8)  # "b" comes due while the host is down
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
