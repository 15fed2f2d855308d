"""Smoke test of bench/e2e.py: its wheeld part, tiny sizes, a real daemon; no Redis.

It checks that the bench runs end to end (two client processes, every phase),
that the JSON it writes has the fields the table and docs/bench-e2e.md rely on,
that expirations reached the clients and none fired before its deadline, and
that the daemon's segments are gone afterwards. It does not judge speed: the
bench itself must not either, at these sizes (no "NOT met" against the full
run's targets). Run without ``--out``, it leaves the recorded figures
(bench/results/e2e.json) alone and writes where ``WHEELD_BENCH_RUNS`` says.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_bench_e2e_wheeld_quick_writes_the_json(tmp_path):
    out = tmp_path / "e2e.json"
    recorded = REPO / "bench" / "results" / "e2e.json"
    recorded_before = recorded.read_bytes()
    prefix = f"test-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    cmd = [
        sys.executable, "-m", "bench.e2e", "--quick", "--only", "wheeld", "--repeat", "1",
        "--name-prefix", prefix,
        "--preload-per-client", "300", "--burst-ops-per-client", "2000", "--steady-s", "0.4",
        "--steady-rate-per-client", "2000", "--delay-lo-ms", "20", "--delay-hi-ms", "300",
        "--touch-keys", "200", "--touch-rounds", "2", "--capacity", "20000",
    ]
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["WHEELD_BENCH_RUNS"] = str(tmp_path)
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "end-to-end timer ops/s" in proc.stdout
        assert recorded.read_bytes() == recorded_before, "a run without --save replaced the recorded figures"
        assert f"wrote {out}" in proc.stdout
        assert "NOT met" not in proc.stdout and " met\n" not in proc.stdout, proc.stdout
        assert "not comparable" in proc.stdout

        data = json.loads(out.read_text())
        assert data["meta"]["quick"] is True
        assert data["meta"]["sizes"]["burst_ops_per_client"] == 2000
        run = data["runs"][0]
        assert set(run) >= {"wheeld", "loadavg"} and "redis" not in run
        w = run["wheeld"]
        assert w["ops"] == 2 * 2000
        assert w["ops_per_s"] > 0 and w["wall_s"] > 0
        # the daemon's CPU time comes from psutil in 10 ms clock ticks: 4000 ops may take less
        assert w["cpu_us_per_op"]["daemon"] >= 0 and w["cpu_us_per_op"]["clients"] > 0
        assert w["daemon_counters"]["commands_total"] >= w["ops"] + 2 * 300

        lateness = w["lateness"]
        assert lateness["early_total"] == 0
        assert lateness["received_total"] > 0
        for phase in ("burst", "steady"):
            for which in ("fired", "recv"):
                stats = lateness[phase][which]
                assert set(stats) == {"count", "p50", "p99", "p999", "max", "mean"}
        steady = lateness["steady"]["recv"]
        assert steady["count"] > 0
        assert 0 <= steady["p50"] <= steady["p99"] <= steady["max"]

        assert w["touch"]["touch_ns"] > 0
        assert w["touch"]["calls"] == 200 * 2
        assert set(w["touch"]["parts_ns"]) >= {"encode_key", "bare_8_byte_store"}
        assert w["pending"]["steady"]["max"] > 0

        summary = data["summary"]["wheeld"]
        assert summary["ops_per_s"]["best"] == w["ops_per_s"]
        names = [t["target"] for t in data["targets"]]
        assert "end-to-end timer ops/s" in names and "touch" in names
        assert all(t["met"] is None and t["comparable"] is False for t in data["targets"])
        assert data["meta"]["comparable_to_targets"] is False
    finally:
        leftovers = [e for e in os.listdir("/dev/shm") if e.startswith(f"wheeld-{prefix}-")]
        for entry in leftovers:
            os.unlink(os.path.join("/dev/shm", entry))
    assert leftovers == [], f"the bench left segments behind: {leftovers}"
