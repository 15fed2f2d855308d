"""Values a client may legitimately send, and what arithmetic on them can produce, against a
real daemon with an honest client served throughout (``hostile_harness.Honest``).

* Deadlines at the edges of the range the daemon accepts (``MAX_DELAY_MS`` either side of
  its clock): far-past ones fire at once and count a bounded lateness; nothing a client
  can send makes a sum overflow the arena's 64-bit counter words.
* Counter words an earlier daemon (or damage) left at or beyond their limits: a
  restarted daemon clamps them when it reads them back and keeps serving.
"""

from __future__ import annotations

import mmap
import struct
import time

import pytest
from daemon_harness import wait_until

import wheeld
from hostile_harness import Honest, counters
from wheeld.daemon.delivery import LATENESS_CAP_MS
from wheeld.protocol import arena_layout as AL
from wheeld.protocol import commands as C
from wheeld.protocol.keys import encode_key
from wheeld.protocol.naming import arena_name, shm_path
from wheeld.shm import check as CK
from wheeld.shm.wheel import MAX_DELAY_MS

SMALL_RINGS = ["--ring-capacity", "1024", "--touch-capacity", "64"]
INT64_MAX = (1 << 63) - 1


def now_ms() -> int:
    return time.monotonic_ns() // 1_000_000


def push(client, records: list[bytes]) -> None:
    seg = client._segment
    for record in records:
        while not seg.try_push_record(record):
            client._ring_doorbell()
            time.sleep(0.001)
    client._ring_doorbell()


def collect(client, want: int, timeout_s: float = 20.0) -> list:
    got = []
    end = time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < end:
        got.extend(client.poll(0.1))
    return got


def far_past_adds(prefix: str, count: int) -> tuple[list[bytes], dict]:
    """ADDs whose deadline is as far in the past as the daemon accepts (1 s inside the
    range, ~2230 years ago), and the deadline each key was given."""
    records, deadlines = [], {}
    for i in range(count):
        key = f"{prefix}-{i}"
        deadline = now_ms() - MAX_DELAY_MS + 1000
        kb, meta = encode_key(key)
        records.append(C.encode_add(kb, meta, deadline, 1 + i))
        deadlines[key] = deadline
    return records, deadlines


def arena_words(name: str):
    """The arena mapped read-write, as this test's uid may (the daemon's): (mmap, close)."""
    f = open(shm_path(arena_name(name)), "r+b")
    mm = mmap.mmap(f.fileno(), 0)
    return mm, f


def lateness(name: str) -> tuple[int, int]:
    """(count, sum in us) of the arena's lateness histogram."""
    mm, f = arena_words(name)
    try:
        counts = struct.unpack_from(f"<{AL.LATENESS_BUCKETS}q", mm, AL.H_LATENESS)
        return sum(counts), struct.unpack_from("<q", mm, AL.H_LATENESS_SUM_US)[0]
    finally:
        mm.close()
        f.close()


def served_and_sound(d, honest: Honest) -> None:
    result = honest.finish()
    assert d.proc.poll() is None, f"the daemon exited:\n{d.log()[-3000:]}"
    assert counters(d.name)["daemon_pid"] == d.pid
    report = CK.check(d.name)
    assert report.ok, report.problems
    assert "Traceback" not in d.log(), d.log()[-5000:]
    assert result["missing_count"] == 0


@pytest.fixture
def honest_daemon(tmp_path, daemon_factory):
    made: list[Honest] = []

    def start(extra=SMALL_RINGS):
        d = daemon_factory(extra=list(extra)).start()
        honest = Honest(tmp_path, d.socket_path)
        made.append(honest)
        return d, honest

    try:
        yield start
    finally:
        for honest in made:
            honest.kill()


def test_deadlines_as_far_in_the_past_as_accepted_fire_at_once_and_count_a_bounded_lateness(honest_daemon):
    """Each of these adds 2**46 ms of lateness measured naively, ~7e16 us: 132 of them
    overflow an int64 sum. They are accepted, fire at once with the deadline as given,
    and count at most LATENESS_CAP_MS each."""
    d, honest = honest_daemon()
    count = 400
    with wheeld.connect(d.socket_path, group="far-past") as w:
        before_count, before_sum = lateness(d.name)
        records, deadlines = far_past_adds("past", count)
        push(w, records)
        w.flush()
        got = collect(w, count)
        assert sorted(e.key for e in got) == sorted(deadlines)
        for e in got:
            assert e.deadline_ms == deadlines[e.key] and e.fired_ms >= e.deadline_ms
        honest.wait_served(10)
        assert d.proc.poll() is None, d.log()[-3000:]
        w.add("after", 5)
        assert [e.key for e in collect(w, 1)] == ["after"]

    def published():
        total, sum_us = lateness(d.name)
        return total - before_count >= count + 1 and (total, sum_us)

    total, sum_us = wait_until(published, 10, what="the lateness of the far-past timers published")
    added = sum_us - before_sum
    assert count * LATENESS_CAP_MS * 1000 <= added <= (count + 1) * LATENESS_CAP_MS * 1000
    assert 0 <= sum_us <= AL.COUNTER_MAX
    served_and_sound(d, honest)


def test_a_restart_clamps_counter_words_left_at_their_limits_and_keeps_serving(honest_daemon):
    """The lateness sum, a histogram bucket, a wheel total and a daemon total left at the
    int64 limit (or negative) by an earlier daemon: the next one reads them back clamped
    and keeps counting; more far-past timers make it saturate, never overflow."""
    d, honest = honest_daemon()
    honest.wait_served(5)
    d.kill()
    mm, f = arena_words(d.name)
    try:
        words = memoryview(mm).cast("q")
        base = AL.H_COUNTERS // 8
        words[AL.H_LATENESS_SUM_US // 8] = INT64_MAX
        words[AL.H_LATENESS // 8 + AL.LATENESS_BUCKETS - 1] = INT64_MAX
        words[AL.H_LATENESS // 8] = -5
        words[base + AL.COUNTER["adds_total"]] = INT64_MAX
        words[base + AL.COUNTER["delivered_total"]] = INT64_MAX
        words[base + AL.COUNTER["commands_total"]] = -(1 << 63)
        words.release()
    finally:
        mm.close()
        f.close()
    d.start()
    with wheeld.connect(d.socket_path, group="far-past") as w:
        records, deadlines = far_past_adds("again", 50)
        push(w, records)
        for i in range(50):
            w.add(f"soon-{i}", 2)
        w.flush()
        assert len(collect(w, 100)) == 100
    honest.wait_served(20)

    def clamped():  # read back as COUNTER_MAX (or 0), then counted on from there
        c = counters(d.name)
        return c["delivered_total"] > AL.COUNTER_MAX and c["adds_total"] > AL.COUNTER_MAX and c

    c = wait_until(clamped, 10, what="the clamped totals published")
    assert c["delivered_total"] < AL.COUNTER_MAX + 100_000 and c["adds_total"] < AL.COUNTER_MAX + 100_000
    assert 0 < c["commands_total"] < 100_000
    total, sum_us = lateness(d.name)
    assert sum_us == AL.COUNTER_MAX
    assert d.proc.poll() is None, d.log()[-3000:]
    served_and_sound(d, honest)


def test_the_lateness_of_a_large_backlog_of_far_past_deadlines_is_summed_exactly():
    """One expire can hand Lateness a backlog of hundreds of thousands of far-past timers
    as one array: each counts LATENESS_CAP_MS; their sum is exact (no int64 wrap)."""
    import numpy as np

    from wheeld.daemon.delivery import Lateness, lateness_us_array

    now = 10**9
    deadlines = np.full(500_000, now - MAX_DELAY_MS, dtype=np.int64)
    deadlines[:3] = (-(2**63), 2**63 - 1, now)
    lateness = Lateness(1)
    lateness.add(lateness_us_array(now, deadlines))
    assert lateness.sum_us == (500_000 - 2) * LATENESS_CAP_MS * 1000
    assert sum(lateness.counts) == 500_000
