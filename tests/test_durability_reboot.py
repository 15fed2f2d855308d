"""What flush() acknowledged survives a reboot (--fsync always), and the client does
not throw it away because of a command the reboot erased.

A reboot here: the daemon is SIGKILLed and its shared memory removed while a client
process lives on. The client's ring is a memfd the client holds, so the commands it
pushed after its last flush are still in it: it hands the ring back to the new
daemon, which applies them after the journal recovery.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

import wheeld
from daemon_harness import unlink_segments, wait_until


def collect(client, want: int, timeout_s: float) -> list:
    got = []
    end = time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < end:
        got.extend(client.poll(0.1))
    return got


@pytest.fixture
def durable(daemon_factory, tmp_path):
    return daemon_factory(extra=["--journal", str(tmp_path / "journal"), "--fsync", "always"]).start()


def reboot_while_stopped(daemon, between) -> None:
    """Stop the daemon, run ``between`` (commands that stay in the ring), then power-cut it."""
    os.kill(daemon.pid, signal.SIGSTOP)
    try:
        between()
    finally:
        daemon.kill()  # SIGKILL reaches a stopped process
    unlink_segments(daemon.name)
    daemon.start()


def test_a_rearm_the_reboot_caught_in_the_ring_is_applied_after_recovery(durable):
    keys = [f"k{i}" for i in range(20)]
    with wheeld.connect(durable.socket_path, group="g", reconnect_timeout_s=30) as w:
        for key in keys:
            w.add(key, 2500)
        w.flush()  # durable: on disk before flush returned
        rearmed_at = {}

        def rearm():
            for key in keys:
                rearmed_at[key] = time.monotonic_ns()
                w.add(key, 3500)

        reboot_while_stopped(durable, rearm)
        got = collect(w, 20, 15)
        got += w.poll(0.5)
    assert sorted(e.key for e in got) == sorted(keys)  # each once: the re-arm replaced the first arming
    for e in got:
        assert e.deadline_ms - e.fired_ms <= 0
    # the re-arm's deadline, not the first arming's (which the recovery brought back first)
    assert all(e.deadline_ms >= rearmed_at[e.key] // 1_000_000 + 3500 for e in got)


def test_the_first_arming_is_delivered_when_no_rearm_followed(durable):
    with wheeld.connect(durable.socket_path, group="g") as w:
        for i in range(20):
            w.add(f"k{i}", 2500)
        w.flush()
        reboot_while_stopped(durable, lambda: None)
        got = collect(w, 20, 15)
    assert sorted(e.key for e in got) == sorted(f"k{i}" for i in range(20))


def test_a_cancel_the_reboot_caught_in_the_ring_is_honoured(durable):
    with wheeld.connect(durable.socket_path, group="g") as w:
        for i in range(20):
            w.add(f"k{i}", 1500)
        w.add("control", 1500)
        w.flush()
        cancelled = []
        reboot_while_stopped(durable, lambda: cancelled.extend(w.cancel(f"k{i}") for i in range(20)))
        assert cancelled == [True] * 20
        got = collect(w, 1, 15)
        got += w.poll(2.0)  # long past the cancelled armings' deadline
    assert [e.key for e in got] == ["control"]


def test_flush_never_waits_past_its_timeout(durable):
    with wheeld.connect(durable.socket_path, group="g", reconnect_timeout_s=60) as w:
        w.add("a", 10_000)
        os.kill(durable.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(wheeld.Timeout):
                w.flush(timeout_s=1.0)
            assert isinstance(wheeld.Timeout("x"), TimeoutError)
            stopped_for = time.monotonic() - started
        finally:
            os.kill(durable.pid, signal.SIGCONT)
        assert stopped_for < 1.5
        durable.kill()  # gone, and nothing restarts it: the reconnection is bounded by the flush too
        started = time.monotonic()
        with pytest.raises((wheeld.Timeout, wheeld.BrokenPeer)):
            w.flush(timeout_s=1.0)
        assert time.monotonic() - started < 1.5
        durable.start()
        w.flush(timeout_s=10)  # the daemon is back: the ring (and its FLUSH) is handed back


def test_commands_a_lost_daemon_applied_but_did_not_persist_are_applied_again(daemon_factory, tmp_path):
    """The flush that acknowledges them is answered by the daemon after the power cut:
    the client hands its ring back rewound to its last acknowledged flush, so what the
    dead daemon applied (and lost with the page cache) is applied again."""

    journal = tmp_path / "journal"
    d = daemon_factory(extra=["--journal", str(journal), "--fsync", "off"]).start()
    with wheeld.connect(d.socket_path, group="g") as w:
        w.add("before", 600_000)
        w.flush()
        for i in range(20):
            w.add(f"k{i}", 1500)  # no flush: applied by this daemon, never made durable
        wait_until(lambda: d.counters()["pending"] == 21, 10, "the 20 unflushed adds applied")
        d.kill()
        unlink_segments(d.name)
        for segment in journal.glob("journal-*.jsonl"):  # the power cut: nothing was fsynced
            segment.write_bytes(b"")
        d.start()
        w.flush(timeout_s=10)
        got = collect(w, 20, 15)
    assert sorted(e.key for e in got) == sorted(f"k{i}" for i in range(20))


def test_an_internal_mark_answered_before_the_power_cut_does_not_hide_what_it_follows(daemon_factory, tmp_path):
    """Every 256 cancels the client pushes an internal FLUSH (a mark: once applied, the
    cancelled armings can be forgotten). The dead daemon answered one after applying, but
    not persisting, the commands before it; the user's flush after it is answered by the
    daemon that comes back. Those commands are applied again: a mark is no acknowledgement
    the user saw, so the ring handed back is rewound to the last flush the user made."""
    journal = tmp_path / "journal"
    d = daemon_factory(extra=["--journal", str(journal), "--fsync", "off"]).start()
    with wheeld.connect(d.socket_path, group="g") as w:
        w.add("victim", 1500)
        for i in range(256):
            w.add(f"c{i}", 600_000)
        for i in range(256):
            assert w.cancel(f"c{i}")  # the 256th cancel pushes the mark
        wait_until(lambda: d.counters()["commands_total"] >= 1 + 256 + 256 + 1 and d.counters()["pending"] == 1,
                   10, "the adds, the cancels and the mark applied")
        assert w.poll(0.3) == []  # takes the mark's Applied off the socket
        d.kill()
        unlink_segments(d.name)
        for segment in journal.glob("journal-*.jsonl"):  # the power cut: nothing was fsynced
            segment.write_bytes(b"")
        d.start()
        w.flush(timeout_s=10)  # acknowledged by the daemon that came back
        got = collect(w, 1, 15)
    assert [e.key for e in got] == ["victim"]
