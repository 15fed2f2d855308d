"""The fleet tier with real processes: a 3-node NATS JetStream cluster on loopback,
two or more wheeld "hosts" (own names, journal directories, host ids) on this machine.

- host loss: workers on A add, re-arm and cancel with flush() under --durability
  replicated; A is lost (SIGKILL, its segments and journal deleted); B adopts it within
  the lease TTL + 2 s; every flush-acknowledged arming is delivered on B, none early,
  none cancelled, a re-armed one only at its last deadline;
- zombie: A paused past its lease while B adopts, then resumed: it stands down (exit 69)
  without handing out a timer; B delivers them; A's stale writes are refused;
- cluster faults: one of three servers killed under load loses nothing; two killed make
  flush() fail with ReplicationBehind within its timeout while timers still fire
  locally; with the quorum back everything is replicated, nothing lost.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("nats")

from daemon_harness import DaemonProcess, mono_ms, unique_name, wait_until  # noqa: E402

import wheeld  # noqa: E402
from wheeld.fleet.cluster import NatsCluster, find_nats_server  # noqa: E402

try:
    find_nats_server()
except Exception as exc:  # pragma: no cover - the test extra installs it
    pytest.skip(f"no nats-server: {exc}", allow_module_level=True)

TTL_S = 2.0


@pytest.fixture
def cluster(tmp_path):
    with NatsCluster(nodes=3, base_dir=tmp_path / "nats") as c:
        yield c


def _host(tmp_path, cluster, host_id: str, *extra, durability="replicated", timeout_s=5.0) -> DaemonProcess:
    journal = tmp_path / f"journal-{host_id}"
    return DaemonProcess(tmp_path, capacity=50_000, extra=[
        "--journal", str(journal), "--replicate", ",".join(cluster.urls), "--host-id", host_id,
        "--durability", durability, "--lease-ttl-s", str(TTL_S), "--replicate-timeout-s", str(timeout_s),
        *extra])


def _lose(daemon: DaemonProcess, tmp_path, host_id: str) -> None:
    """A host lost for good: its daemon SIGKILLed, its segments and journal deleted."""
    daemon.cleanup()
    shutil.rmtree(tmp_path / f"journal-{host_id}", ignore_errors=True)


def _wait_held(daemon: DaemonProcess) -> None:
    daemon.wait_for_log("holds its lease", timeout=20)


def _drain(client, wanted: set, seconds: float) -> list[tuple]:
    """(expiration, mono ms received) until every key of ``wanted`` came or ``seconds`` passed,
    then a little longer (duplicates and strays arrive too)."""
    got: list[tuple] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        got += [(e, mono_ms()) for e in client.poll(0.05)]
        if wanted <= {e.key for e, _ in got}:
            break
    tail_end = time.monotonic() + 0.5
    while time.monotonic() < tail_end:
        got += [(e, mono_ms()) for e in client.poll(0.05)]
    return got


def _workload(client, n: int, base_ms: int, spread_ms: int):
    """Adds, re-arms and cancels, each acknowledged by a flush(); returns
    (key -> earliest allowed mono ms, keys cancelled, keys re-armed)."""
    due: dict[str, int] = {}
    for i in range(n):
        key = f"t{i}"
        delay = base_ms + (i * 37) % spread_ms
        due[key] = mono_ms() + delay
        client.add(key, delay)
    client.flush()
    rearmed = {f"t{i}" for i in range(0, n, 7)}
    for key in rearmed:
        due[key] = mono_ms() + base_ms + spread_ms  # later than any first deadline
        client.add(key, base_ms + spread_ms)
    cancelled = {f"t{i}" for i in range(3, n, 11)} - rearmed
    for key in cancelled:
        assert client.cancel(key)
        del due[key]
    client.flush()
    return due, cancelled, rearmed


def _check_delivered(got, due: dict, cancelled: set) -> dict:
    keys = [e.key for e, _ in got]
    missing = set(due) - set(keys)
    assert not missing, f"{len(missing)} flush-acknowledged timers never delivered: {sorted(missing)[:10]}"
    assert not set(keys) & cancelled, f"cancelled timers delivered: {sorted(set(keys) & cancelled)[:10]}"
    early = [(e.key, received, due[e.key]) for e, received in got if e.key in due and received < due[e.key]]
    assert not early, f"delivered before their deadline: {early[:5]}"
    return {"delivered": len(keys), "duplicates": len(keys) - len(set(keys))}


@pytest.mark.timeout(120)
def test_a_lost_host_s_timers_are_delivered_by_the_peer_that_adopts_it(tmp_path, cluster):
    a_id, b_id = f"a{unique_name()[-8:]}", f"b{unique_name()[-8:]}"
    a = _host(tmp_path, cluster, a_id)
    b = _host(tmp_path, cluster, b_id, "--adopt", a_id)
    try:
        a.start()
        b.start()
        _wait_held(a)
        _wait_held(b)
        group = "orders"
        with wheeld.connect(a.socket_path, group=group) as worker_a:
            due, cancelled, rearmed = _workload(worker_a, 300, base_ms=4_000, spread_ms=2_000)
        worker_b = wheeld.connect(b.socket_path, group=group)
        try:
            lost_at = mono_ms()
            _lose(a, tmp_path, a_id)
            got = _drain(worker_b, set(due), seconds=TTL_S + 2 + 8)
        finally:
            worker_b.close()
        counts = _check_delivered(got, due, cancelled)
        assert counts["duplicates"] == 0  # nothing was handed on A: no at-least-once window
        for e, received in got:
            if e.key in rearmed:
                assert received >= due[e.key]  # the re-armed deadline, never the first one
        b.wait_for_log(f"ADOPTED host {a_id}", timeout=1)
        adopted_line = next(line for line in b.log().splitlines() if "lease lapsed" in line)
        assert adopted_line  # the takeover was logged
        first = min(received for _, received in got)
        # the earliest timers were due 4 s after the loss at the latest: the takeover came in time
        assert first - lost_at <= 4_000 + (TTL_S + 2) * 1000
        stats = subprocess.run([sys.executable, "-m", "wheeld.ctl", "--name", b.name, "stats"], capture_output=True,
                               text=True, timeout=30)
        assert "fleet  replicating" in stats.stdout, stats.stdout
        fleet = subprocess.run([sys.executable, "-m", "wheeld.ctl", "fleet", "--replicate", ",".join(cluster.urls)],
                               capture_output=True, text=True, timeout=30)
        assert f"ADOPTED by {b_id}" in fleet.stdout, fleet.stdout + fleet.stderr
    finally:
        a.cleanup()
        b.cleanup()


@pytest.mark.timeout(120)
def test_a_paused_host_stands_down_after_a_peer_adopted_it(tmp_path, cluster):
    a_id, b_id = f"a{unique_name()[-8:]}", f"b{unique_name()[-8:]}"
    a = _host(tmp_path, cluster, a_id)
    b = _host(tmp_path, cluster, b_id, "--adopt", "*")
    try:
        a.start()
        b.start()
        _wait_held(a)
        _wait_held(b)
        worker_a = wheeld.connect(a.socket_path, group="g")
        due = {}
        for i in range(100):
            due[f"z{i}"] = mono_ms() + 1_000
            worker_a.add(f"z{i}", 1_000)
        worker_a.flush()
        os.kill(a.pid, signal.SIGSTOP)  # a VM stall: past the lease, and past the timers' deadlines
        try:
            b.wait_for_log(f"ADOPTED host {a_id}", timeout=TTL_S * 3 + 5)
        finally:
            os.kill(a.pid, signal.SIGCONT)
        with wheeld.connect(b.socket_path, group="g") as worker_b:
            got_b = _drain(worker_b, set(due), seconds=5)
        got_a = []
        try:
            end = time.monotonic() + 3
            while time.monotonic() < end and a.proc.poll() is None:
                got_a += worker_a.poll(0.1)
        except wheeld.WheeldError:
            pass  # the daemon went away under it
        worker_a.close()
        assert a.proc.wait(10) == 69  # EXIT_FENCED
        assert "FENCED" in a.log()
        assert got_a == [], f"the fenced host handed out {len(got_a)} timers it no longer owned"
        _check_delivered(got_b, due, set())
        assert all(e.late for e, _ in got_b)  # due during the gap: at once, marked late
        # started again with its old arena and journal, it finds the fence and stands down
        # before it hands anything out
        a.start()
        assert a.proc.wait(20) == 69
        assert "was taken over by" in a.log()
        # forgotten (and its state removed: docs/fleet.md), the host joins again, empty
        forget = subprocess.run([sys.executable, "-m", "wheeld.ctl", "fleet", "--replicate", ",".join(cluster.urls),
                                 "forget", a_id, "--yes"], capture_output=True, text=True, timeout=30)
        assert f"{a_id}: deleted stream WHEELD_{a_id}" in forget.stdout, forget.stdout + forget.stderr
        a.cleanup()
        shutil.rmtree(tmp_path / f"journal-{a_id}")
        a.start()
        _wait_held(a)
        assert a.proc.poll() is None and a.counters()["pending"] == 0
    finally:
        a.cleanup()
        b.cleanup()


@pytest.mark.timeout(180)
def test_cluster_faults_lose_nothing_and_no_quorum_fails_flush_cleanly(tmp_path, cluster):
    a_id = f"a{unique_name()[-8:]}"
    a = _host(tmp_path, cluster, a_id, timeout_s=3.0)
    try:
        a.start()
        _wait_held(a)
        with wheeld.connect(a.socket_path, group="g") as w:
            # one of three servers killed under load: flushes go on, nothing lost
            refused = 0
            for i in range(2_000):
                w.add(f"k{i}", 600_000)
                if i == 500:
                    cluster.kill(0)
                if i % 100 == 99:
                    # a leader lost: the stream's new leader is elected within a few seconds; a
                    # flush that waits past --replicate-timeout-s meanwhile fails, and a later
                    # one covers its commands
                    while not _flush_ok(w):
                        refused += 1
            assert refused <= 5
            cluster.restart(0)
            # two of three: no quorum; flush fails within its timeout, local firing goes on
            cluster.kill(1)
            cluster.kill(2)
            w.add("local", 200)
            started = time.monotonic()
            with pytest.raises(wheeld.ReplicationBehind):
                w.flush(timeout_s=10)
            assert time.monotonic() - started < 3.0 + 3.0
            fired = []
            end = time.monotonic() + 5
            while time.monotonic() < end and not fired:
                fired += [e for e in w.poll(0.1) if e.key == "local"]
            assert fired, "a timer due while the cluster has no quorum did not fire locally"
            for i in range(2_000, 2_200):
                w.add(f"k{i}", 600_000)
            cluster.restart(1, wait=False)
            cluster.restart(2, wait=False)
            # the quorum is back: what the cluster missed is sent; a flush succeeds again
            wait_until(lambda: _flush_ok(w), 60, "a flush to succeed once the quorum is back")
        counters = a.counters()
        wait_until(lambda: a.counters()["fleet_lag_records"] == 0, 30, "replication to catch up")
        # the stream holds every pending timer: read it back as a takeover would
        state = _stream_state(cluster, a_id)
        assert {k for (_g, k) in state.pending} >= {f"k{i}" for i in range(2_200)}
        assert counters["journal_flushes_refused_total"] >= 1
    finally:
        a.cleanup()


def _flush_ok(w) -> bool:
    try:
        w.flush(timeout_s=10)
        return True
    except wheeld.ReplicationBehind:
        return False


def _stream_state(cluster, host: str):
    """A host's stream, recovered as the adopting peer reads it."""
    import asyncio
    import tempfile

    import nats

    from wheeld.fleet import stream as S
    from wheeld.journal.recovery import recover

    async def read():
        nc = await nats.connect(servers=cluster.urls)
        try:
            js = nc.jetstream(timeout=5)
            info = await js.stream_info(S.stream_name(host))
            records = await S.read_records(js, host, info.state.last_seq + 1)
            return records
        finally:
            await nc.close()

    records = asyncio.run(read())
    kept, _ = S.tail(records)
    with tempfile.TemporaryDirectory() as d:
        S.write_directory(kept, d, host)
        return recover(d, repair=False, quiet=True)


@pytest.mark.timeout(120)
def test_the_fleet_demo_shows_a_lost_host_s_timers_arriving_on_the_other():
    demo = os.path.join(os.path.dirname(__file__), "..", "examples", "fleet_demo.py")
    result = subprocess.run([sys.executable, demo, "--timers", "300", "--lease-ttl-s", "2"], capture_output=True,
                            text=True, timeout=110)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "summary: 300/300 timers" in result.stdout and ", 0 early, 0 twice" in result.stdout, result.stdout
    assert "ADOPTED host hostA-" in result.stdout


class _Collector:
    """A worker of ``group`` on one host, polling in a thread: (key, mono ms received, host)."""

    def __init__(self, daemon: DaemonProcess, host_id: str, group: str, sink: list):
        import threading

        self.client = wheeld.connect(daemon.socket_path, group=group, reconnect_timeout_s=1.0)
        self.host_id, self.sink, self.stopped = host_id, sink, False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped:
            try:
                for e in self.client.poll(0.05):
                    self.sink.append((e.key, mono_ms(), self.host_id))
            except wheeld.WheeldError:
                return  # its host was lost

    def stop(self) -> None:
        self.stopped = True
        self.thread.join(5)
        try:
            self.client.close()
        except wheeld.WheeldError:
            pass


def _chaos(tmp_path, cluster, rounds: int) -> None:
    """Hosts that adopt each other ('*') are lost one after another, a fresh host joining
    each time: timers move from host to host through several takeovers; every one a
    flush() acknowledged is delivered once, none early."""
    hosts: dict[str, DaemonProcess] = {}
    collectors: dict[str, _Collector] = {}
    got: list = []
    due: dict[str, int] = {}
    lost_at: dict[str, int] = {}

    def join() -> str:
        host_id = f"c{unique_name()[-8:]}"
        d = hosts[host_id] = _host(tmp_path, cluster, host_id, "--adopt", "*")
        d.start()
        _wait_held(d)
        collectors[host_id] = _Collector(d, host_id, "chaos", got)
        return host_id

    try:
        for _ in range(3):
            join()
        for r in range(rounds):
            victim = sorted(hosts)[r % len(hosts)]
            with wheeld.connect(hosts[victim].socket_path, group="chaos") as w:
                for i in range(100):
                    delay = 3_000 + (i * 113) % 9_000  # some due before the next loss, some after several
                    due[f"r{r}-{i}"] = mono_ms() + delay
                    w.add(f"r{r}-{i}", delay)
                w.flush()
            collectors.pop(victim).stop()
            lost_at[victim] = mono_ms()
            _lose(hosts.pop(victim), tmp_path, victim)
            join()
            time.sleep(TTL_S + 1)
        wait_until(lambda: set(due) <= {k for k, _, _ in got}, 12 + TTL_S * 3, "every timer delivered",
                   detail=lambda: f"missing {sorted(set(due) - {k for k, _, _ in got})[:10]}")
        time.sleep(0.5)
        keys = [k for k, _, _ in got]
        early = [(k, t, due[k]) for k, t, _ in got if k in due and t < due[k]]
        assert not early, early[:5]
        # at least once across a loss: a copy handed (and acknowledged) on a host shortly before
        # it was lost, its acknowledgement not yet stored by the stream, is delivered again by
        # the adopter; any other repeat is a bug
        first: dict[str, tuple] = {}
        repeats = []
        for k, t, host in got:
            if k in first:
                repeats.append((k, first[k], (t, host)))
            else:
                first[k] = (t, host)
        outside = [r for r in repeats if r[1][1] not in lost_at or not 0 <= lost_at[r[1][1]] - r[1][0] <= 2_000]
        assert not outside, f"delivered twice outside the takeover window: {outside[:5]}"
        print(f"{len(set(keys))} timers, {len(repeats)} delivered again after their host was lost")
    finally:
        for c in collectors.values():
            c.stop()
        for d in hosts.values():
            d.cleanup()


@pytest.mark.timeout(180)
def test_timers_survive_two_host_losses_in_a_row(tmp_path, cluster):
    _chaos(tmp_path, cluster, rounds=2)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_timers_survive_many_host_losses_in_a_row(tmp_path, cluster):
    _chaos(tmp_path, cluster, rounds=10)
