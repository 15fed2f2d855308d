"""Prometheus metrics: the hand-written exposition parsed by prometheus_client, and the daemon's HTTP endpoint."""

from __future__ import annotations

import http.client
import socket
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families
from daemon_harness import wait_until

import wheeld
from wheeld.daemon.metrics import MAX_REQUEST_BYTES, parse_address
from wheeld.protocol import arena_layout as L
from wheeld.protocol.errors import InvalidRequest
from wheeld.shm import reader as R
from wheeld.shm import snapshot as SN
from wheeld.shm.prometheus import CONTENT_TYPE, render

pytestmark = pytest.mark.timeout(120)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fake_snapshot(lateness_counts=None, lateness_sum_us=0, **counters) -> SN.Snapshot:
    values = dict.fromkeys(L.COUNTER_NAMES, 0)
    values.update(counters)
    counts = tuple(lateness_counts or (0,) * L.LATENESS_BUCKETS)
    return SN.Snapshot(
        name="t", segment="/wheeld-t-arena", taken_ms=10_000, capacity=1000, tick_ms=1, wheel_size=256, levels=5,
        max_groups=1024, arena_bytes=1 << 20, clock_ms=9_000, created_wall_ms=0, parked=True, counters=values,
        lateness_counts=counts, lateness_sum_us=lateness_sum_us,
        groups=[SN.GroupStat(0, "default", 0, 0, 0)], rings=[], daemon_alive=False,
    )


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


# ---------------------------------------------------------------------------- exposition
def test_render_names_types_and_values():
    snap = fake_snapshot(pending=7, pending_level_0=3, pending_level_2=4, adds_total=11, cancels_total=2,
                         expirations_total=5, fired_unacked=3, undelivered=1, ring_full_total=4)
    fams = families(render(snap))
    assert fams["wheeld_timers_pending"].type == "gauge" and fams["wheeld_timers_pending"].samples[0].value == 7
    by_level = {s.labels["level"]: s.value for s in fams["wheeld_timers_pending_by_level"].samples}
    assert by_level == {"0": 3, "1": 0, "2": 4, "3": 0, "4": 0, "due": 0}
    for name, value in (("wheeld_timers_added", 11), ("wheeld_timers_cancelled", 2), ("wheeld_timers_expired", 5),
                        ("wheeld_ring_full", 4)):
        assert fams[name].type == "counter"
        assert [(s.name, s.value) for s in fams[name].samples] == [(name + "_total", value)]
    assert fams["wheeld_expirations_undelivered"].samples[0].value == 1
    assert fams["wheeld_expirations_unacknowledged"].samples[0].value == 2
    assert fams["wheeld_arena_used_timers"].samples[0].value == 10
    assert fams["wheeld_tick_seconds"].samples[0].value == 0.001
    assert fams["wheeld_daemon_up"].samples[0].value == 0
    assert "wheeld_daemon_uptime_seconds" not in fams  # no live daemon: no uptime


def test_group_ids_in_use_and_max_are_gauges():
    snap = fake_snapshot(groups_active=1)
    snap.groups = [SN.GroupStat(0, "default", 0, 0, 0), SN.GroupStat(1, "conns", 4, 1, 1),
                   SN.GroupStat(5, "", 2, 0, 0)]  # an id live records carry without a name
    fams = families(render(snap))
    for name, value in (("wheeld_groups_in_use", 3), ("wheeld_groups_max", 1024), ("wheeld_groups_registered", 2),
                        ("wheeld_groups_active", 1)):
        assert fams[name].type == "gauge" and [s.value for s in fams[name].samples] == [value], name


def test_lateness_is_a_cumulative_histogram_in_seconds():
    counts = [0] * L.LATENESS_BUCKETS
    counts[0] = 5  # < 50 us
    counts[4] = 3  # [500 us, 1 ms)
    counts[-1] = 1  # > 60 s
    fams = families(render(fake_snapshot(counts, lateness_sum_us=61_000_000 + 3 * 700)))
    hist = fams["wheeld_fire_lateness_seconds"]
    assert hist.type == "histogram"
    buckets = {s.labels["le"]: s.value for s in hist.samples if s.name.endswith("_bucket")}
    assert len(buckets) == len(L.LATENESS_BOUNDS_US) + 1
    assert buckets["5e-05"] == 5 and buckets["0.0005"] == 5 and buckets["0.001"] == 8 and buckets["60.0"] == 8
    assert buckets["+Inf"] == 9
    sample = {s.name: s.value for s in hist.samples if not s.name.endswith("_bucket")}
    assert sample["wheeld_fire_lateness_seconds_count"] == 9
    assert sample["wheeld_fire_lateness_seconds_sum"] == pytest.approx(61.0021)


def test_quantiles_from_the_histogram():
    counts = [0] * L.LATENESS_BUCKETS
    assert SN.quantile_us(counts, 0.5) is None and SN.max_us(counts) is None
    counts[0] = 100  # 100 samples in [0, 50) us
    assert SN.quantile_us(counts, 0.5) == pytest.approx(25.0)
    assert SN.max_us(counts) == 50
    counts[5] = 100  # and 100 in [1000, 2000) us
    assert SN.quantile_us(counts, 0.5) == pytest.approx(50.0)  # the top of the first bucket
    assert SN.quantile_us(counts, 0.75) == pytest.approx(1500.0)
    assert SN.quantile_us(counts, 0.999) == pytest.approx(1998.0)
    assert SN.max_us(counts) == 2000
    counts[-1] = 1  # open-ended: the estimate is the bucket's floor
    assert SN.quantile_us(counts, 1.0) == L.LATENESS_BOUNDS_US[-1]
    assert SN.max_us(counts) == L.LATENESS_BOUNDS_US[-1]


def test_parse_address():
    assert parse_address("127.0.0.1:9464") == ("127.0.0.1", 9464)
    assert parse_address("[::1]:9464") == ("::1", 9464)
    assert parse_address(":9464") == (None, 9464)
    assert parse_address("localhost:0") == ("localhost", 0)
    for bad in ("9464", "127.0.0.1", "127.0.0.1:http", "::1:9464", "[nope]:1", "1.2.3.4:70000"):
        with pytest.raises(InvalidRequest):
            parse_address(bad)


# ---------------------------------------------------------------------------- the endpoint
@pytest.fixture
def metrics_daemon(daemon_factory):
    port = free_port()
    proc = daemon_factory(extra=["--metrics", f"127.0.0.1:{port}"])
    proc.start()

    def listening() -> bool:  # the endpoint starts right after the socket
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            return False

    wait_until(listening, 10, "the metrics endpoint", interval=0.02, detail=proc.log)
    return proc, port


def request(port: int, method: str = "GET", path: str = "/metrics"):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path)
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def scrape(port: int) -> dict:
    status, headers, body = request(port)
    assert status == 200
    assert headers["Content-Type"] == CONTENT_TYPE
    return families(body.decode("utf-8"))


def wait_for(port: int, name: str, value: float, timeout_s: float = 5.0) -> dict:
    """Scrape until ``name`` shows ``value`` (the daemon publishes once per iteration)."""
    def showing() -> dict | None:
        fams = scrape(port)
        return fams if fams[name].samples[0].value == value else None

    return wait_until(showing, timeout_s, f"{name} = {value} in a scrape", interval=0.02)


def test_metrics_endpoint_serves_what_the_daemon_did(metrics_daemon):
    daemon, port = metrics_daemon
    fams = scrape(port)
    assert fams["wheeld_timers_added"].samples[0].value == 0
    assert fams["wheeld_daemon_up"].samples[0].value == 1
    with wheeld.connect(daemon.socket_path, group="m") as w:
        for i in range(12):
            w.add(i, 30 if i < 4 else 600_000)
        w.cancel(11)
        w.flush()
        got = []
        end = time.monotonic() + 10
        while len(got) < 4 and time.monotonic() < end:
            got.extend(w.poll(0.1))
        assert len(got) == 4
        fams = wait_for(port, "wheeld_timers_expired", 4)
        assert fams["wheeld_timers_added"].samples[0].value == 12
        assert fams["wheeld_timers_cancelled"].samples[0].value == 1
        assert fams["wheeld_timers_expired"].samples[0].value == 4
        assert fams["wheeld_timers_pending"].samples[0].value == 7
        assert fams["wheeld_clients_connected"].samples[0].value == 1
        assert fams["wheeld_rings"].samples[0].value == 1
        hist = {s.name: s.value for s in fams["wheeld_fire_lateness_seconds"].samples if not s.labels}
        assert hist["wheeld_fire_lateness_seconds_count"] == 4
        assert fams["wheeld_daemon_uptime_seconds"].samples[0].value > 0
    # the same names as wheelctl stats --prometheus, which reads the arena instead
    with R.ArenaReader(daemon.name) as reader:
        from_arena = families(render(reader.snapshot()))
    assert set(from_arena) == set(scrape(port))


def test_metrics_endpoint_refuses_everything_else(metrics_daemon):
    daemon, port = metrics_daemon
    assert request(port, path="/")[0] == 404
    assert request(port, path="/metrics/../x")[0] == 404
    assert request(port, path="/metrics?name[]=x")[0] == 200  # query strings are ignored
    status, headers, _ = request(port, method="POST")
    assert status == 405 and headers["Allow"] == "GET, HEAD"
    status, headers, body = request(port, method="HEAD")
    assert status == 200 and body == b"" and int(headers["Content-Length"]) > 0

    # a request head larger than the bound is answered 400 and closed, not buffered
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nX-Filler: " + b"a" * (MAX_REQUEST_BYTES + 2000))
        reply = b""
        while chunk := s.recv(4096):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 400")

    # a client that never finishes its request does not hold up the wheel
    with socket.create_connection(("127.0.0.1", port), timeout=10) as slow:
        slow.sendall(b"GET /metr")
        with wheeld.connect(daemon.socket_path, group="meanwhile") as w:
            w.add("k", 20)
            w.flush()
            got = []
            end = time.monotonic() + 10
            while not got and time.monotonic() < end:
                got.extend(w.poll(0.1))
            assert [e.key for e in got] == ["k"]
        assert scrape(port)["wheeld_timers_expired"].samples[0].value >= 0


def test_a_bad_metrics_address_stops_the_daemon_with_a_message(daemon_factory):
    proc = daemon_factory(extra=["--metrics", "not-an-address"])
    try:
        proc.start(timeout_s=10)  # may see the socket listen before the metrics fail
    except RuntimeError:
        pass
    assert proc.proc.wait(10) == 2
    assert "wheeld: --metrics wants ADDR:PORT" in proc.log()
