"""bench/fleet.py in a small mode: its own three-node NATS cluster, a few hundred JetStream
message schedules, a consumer process, cancels; then every process and directory gone.

Speed is not asserted (that is the benchmark's job); what the report claims is: every
schedule acknowledged, none early, none cancelled in time arriving, none lost or doubled.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

pytest.importorskip("nats", reason="the fleet's benchmark needs nats-py (the test extra installs it)")

from bench import fleet  # noqa: E402
from daemon_harness import child_pids  # noqa: E402


def _cluster_dirs() -> set[str]:
    """This process's NatsCluster directories in the temporary directory (``wheeld-<pid>-...``)."""
    return {e for e in os.listdir(tempfile.gettempdir()) if e.startswith(f"wheeld-{os.getpid()}-")}


@pytest.mark.timeout(120)
def test_the_nats_schedules_baseline_runs_small_and_reports_what_it_measures(tmp_path):
    before_pids, before_dirs = child_pids(), _cluster_dirs()
    out = tmp_path / "fleet.json"
    assert fleet.main(["--only", "nats-schedules", "--n", "300", "--ahead-s", "0.4,0.8", "--grace-s", "1.0",
                       "--in-flight", "100", "--cancel-every", "5", "--repeat", "1", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["benchmark"] == "fleet" and data["cluster"]["started_here"] and data["cluster"]["nodes"] == 3
    assert data["machine"]["nats-server"].startswith("v2.")
    r = data["results"]["nats-schedules"]
    s, late, cancel, delivery = r["scheduling"], r["lateness_ms"], r["cancel"], r["delivery"]
    assert s["acked"] == 300 and s["failed"] == s["unanswered"] == 0 and s["schedules_per_s"] > 0
    assert cancel["requested"] == 60 and cancel["acked"] == 60 and cancel["in_time"] + cancel["late"] == 60
    assert cancel["in_time_arrived"] == 0  # a schedule purged before its time never fires
    assert delivery["missing"] == 0 and delivery["duplicates"] == 0 and delivery["unknown"] == 0
    assert delivery["arrived"] == 240 + cancel["late_arrived"]
    assert late["received"]["count"] == delivery["arrived"] and late["received"]["early"] == 0
    assert late["stored"]["early"] == 0 and late["stored"]["p50"] <= late["received"]["p50"]
    assert child_pids() <= before_pids  # the three nats-servers and the consumer were reaped
    assert _cluster_dirs() <= before_dirs  # the cluster's directory was removed


@pytest.mark.timeout(120)
def test_it_runs_on_a_given_cluster_with_a_password(tmp_path, monkeypatch):
    from wheeld.fleet.cluster import NatsCluster

    with NatsCluster(3, base_dir=tmp_path / "nats", user="bench", password="bench-secret") as cluster:
        monkeypatch.setenv("WHEELD_NATS_PASSWORD", "bench-secret")
        out = tmp_path / "fleet.json"
        assert fleet.main(["--urls", cluster.url, "--user", "bench", "--n", "60", "--ahead-s", "0.3,0.5",
                           "--only", "nats-schedules,wheeld-schedules",
                           "--grace-s", "0.8", "--cancel-every", "0", "--repeat", "1", "--out", str(out)]) == 0
        results = json.loads(out.read_text())["results"]
        r = results["nats-schedules"]
    # wheeld's daemons took the credentials too
    assert results["wheeld-schedules"]["delivered"] == 60 and results["wheeld-schedules"]["early"] == 0
    assert r["scheduling"]["acked"] == 60 and r["delivery"]["arrived"] == 60 and r["cancel"]["requested"] == 0
    assert r["lateness_ms"]["received"]["early"] == 0


@pytest.mark.timeout(180)
def test_wheeld_s_kinds_run_small_local_and_replicated_beside_each_other(tmp_path):
    before_pids = child_pids()
    out = tmp_path / "fleet.json"
    assert fleet.main(["--only", "wheeld-schedules,wheeld-throughput,wheeld-flush-latency", "--n", "300",
                       "--ahead-s", "0.4,0.8", "--cancel-every", "5", "--clients", "1", "--ops", "2000",
                       "--flush-every", "100", "--latency-rounds", "20", "--repeat", "2", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    sched = data["results"]["wheeld-schedules"]
    assert sched["timers"] == 300 and sched["cancelled"] == 60 and sched["cancelled_delivered"] == 0
    assert sched["delivered"] == 240 and sched["missing"] == 0 and sched["early"] == 0
    modes = data["results"]["wheeld-throughput"]["modes"]
    assert set(modes) == {"local", "replicated"}
    for r in modes.values():
        assert r["ops"] == 2000 and r["flushes"] == 20 and r["flushes_refused"] == 0 and r["ops_per_s"] > 0
    assert data["comparison"]["replicated_over_local"] > 0
    # two runs of each kind: the section is one of them (the median by its figure), both beside
    runs = data["results"]["wheeld-throughput"]["runs"]
    assert len(runs) == 2 and data["comparison"]["replicated_over_local_runs"] == [
        r["replicated_over_local"] for r in runs]
    assert data["results"]["wheeld-throughput"]["replicated_over_local"] == min(
        r["replicated_over_local"] for r in runs)  # (the lower of two is the median run)
    assert len(data["results"]["wheeld-schedules"]["runs"]) == 2
    latency = data["results"]["wheeld-flush-latency"]["modes"]
    assert {m: r["rounds"] for m, r in latency.items()} == {"local": 20, "replicated": 20}
    assert all(0 < r["flush_ms_p50"] <= r["flush_ms_p99"] <= r["flush_ms_max"] for r in latency.values())
    assert child_pids() <= before_pids
