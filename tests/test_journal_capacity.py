"""A reboot with a smaller --capacity (or --max-groups) keeps every journaled timer.

The journal's timers were accepted, some acknowledged by a flush(): the arena rebuilt
from it is made large enough for all of them (plus --capacity of room for new ones),
so none is dropped, and the snapshot the new daemon writes holds them all. Should a
timer still not go in, the daemon refuses to start (exit 65, one line) rather than
start and compact it away.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

import wheeld
from daemon_harness import unique_name, unlink_segments
from hostile_harness import Honest
from wheeld.protocol.journal import Add
from wheeld.journal.files import Journal, read_clocks
from wheeld.journal.recovery import recover
from wheeld.shm.reader import ArenaReader

pytestmark = pytest.mark.timeout(240)


def _arena_capacity(name: str) -> tuple[int, int]:
    with ArenaReader(name) as reader:
        return reader.info["capacity"], reader.info["max_groups"]


def test_a_reboot_with_a_smaller_capacity_restores_every_journaled_timer(daemon_factory, tmp_path):
    journal = tmp_path / "journal"
    big = daemon_factory(capacity=5000, extra=["--journal", str(journal), "--fsync", "always"]).start()
    keys = {f"k{i}" for i in range(3000)}
    with wheeld.connect(big.socket_path, group="g") as w:
        for index, key in enumerate(sorted(keys)):
            w.add(key, 600_000)
            if index % 500 == 499:
                w.flush()
        w.flush()
    for group in range(5):  # 5 groups
        with wheeld.connect(big.socket_path, group=f"other-{group}") as w:
            w.add("x", 600_000)
            w.flush()
    big.kill()
    unlink_segments(big.name)  # the reboot
    small = daemon_factory(capacity=1000, name=big.name,
                           extra=["--journal", str(journal), "--fsync", "always", "--max-groups", "2"]).start()
    counters = small.counters()
    assert counters["pending"] >= 3005, small.log()[-3000:]
    capacity, max_groups = _arena_capacity(small.name)
    assert capacity >= 3005 + 1000 and max_groups >= 7
    log = small.log()
    assert "more than --capacity 1000" in log and "more than --max-groups 2 leaves room for" in log
    assert "NOT restored" not in log
    honest = Honest(tmp_path, small.socket_path, rate=100)
    try:
        honest.wait_served(50)
        with wheeld.connect(small.socket_path, group="g") as w:  # the snapshot the next one reads
            w.flush()
        honest.finish()
    finally:
        honest.kill()
    small.kill()
    state = recover(journal, repair=False)
    assert keys <= {key for group, key in state.pending if group == "g"}
    assert {group for group, key in state.pending if key == "x"} == {f"other-{g}" for g in range(5)}


def test_timers_that_still_do_not_fit_refuse_the_start_and_change_nothing(tmp_path, monkeypatch):
    """The guard behind the sizing: a timer the new arena refuses (here: a deadline the
    wheel cannot hold) stops the start with exit 65 and one line; nothing is dropped."""
    journal = tmp_path / "journal"
    wall_ms = read_clocks()[0] // 1_000_000
    with Journal(journal, fsync="always") as writer:
        writer.append([Add(t=wall_ms, g="g", k="fine", d=wall_ms + 60_000, s=1)])
        writer.append([Add(t=wall_ms, g="g", k="absurd", d=wall_ms + (1 << 47), s=2)])
    before = {path.name: path.read_bytes() for path in journal.iterdir()}
    name = unique_name()
    command = [sys.executable, "-m", "wheeld.daemon.cli", "--socket", str(tmp_path / f"{uuid.uuid4().hex[:8]}.sock"),
               "--name", name, "--capacity", "100", "--journal", str(journal)]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=60)
        created = unlink_segments(name)
    finally:
        unlink_segments(name)
    assert result.returncode == 65, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"wheeld: journal {journal}: 1 of its 2 timers could not be put into the new arena")
    assert "refusing to start" in last and "Traceback" not in result.stderr
    assert [entry for entry in created if not entry.endswith("-lock")] == []  # no arena left behind
    assert {path.name: path.read_bytes() for path in journal.iterdir()} == before
    assert os.path.exists(journal)
