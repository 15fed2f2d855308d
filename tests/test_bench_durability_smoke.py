"""Smoke test of bench/durability.py: real daemons, a few thousand adds, sane JSON.

It runs every fsync policy once with tiny sizes and checks that the JSON has
the figures the docs quote (adds/s, ratios, bytes per add, fsyncs, daemon
CPU), that the journal grew by a plausible number of bytes per add under every
journaling policy and not at all without one, that ``always`` fsynced and
``off`` did not, and that no segment was left in /dev/shm. It does not judge
speed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_bench_durability_quick_writes_sane_json(tmp_path):
    out = tmp_path / "durability.json"
    prefix = f"test-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    cmd = [sys.executable, "-m", "bench.durability", "--quick", "--batches", "64", "--adds-per-client", "1500",
           "--always-adds-per-client", "300", "--recovery", "2000", "--out", str(out), "--name-prefix", prefix]
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    try:
        proc = subprocess.run(cmd, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "acknowledged adds through a real daemon" in proc.stdout

        data = json.loads(out.read_text())
        runs = {r["policy"]: r for r in data["runs"]}
        assert set(runs) == {"none", "off", "interval=10", "always"}
        for policy, run in runs.items():
            expected = 2 * (300 if policy == "always" else 1500)
            assert run["adds"] == expected and run["batch"] == 64
            assert run["adds_per_s"] > 0 and run["wall_s"] > 0
            assert run["daemon_cpu_us_per_add"] >= 0
            assert "daemon_log_warnings" not in run, run["daemon_log_warnings"]
        assert runs["none"]["journal_bytes_per_add"] == 0
        for policy in ("off", "interval=10", "always"):
            # one "add" line per add: ~100-150 bytes with these keys (nothing else is journaled)
            assert 80 < runs[policy]["journal_bytes_per_add"] < 200, runs[policy]
        assert runs["off"]["fsyncs"] == 0
        assert runs["always"]["fsyncs"] >= 1
        assert runs["interval=10"]["fsyncs"] is not None

        rows = {r["policy"]: r for r in data["summary"]}
        assert rows["none"]["vs_none"] == 1.0 and rows["off"]["vs_off"] == 1.0
        ratio = rows["interval=10"]["adds_per_s_best"] / rows["none"]["adds_per_s_best"]
        assert abs(rows["interval=10"]["vs_none"] - ratio) < 1e-3
        assert [t["target"] for t in data["targets"]] == ["interval=10 >= 0.5x none (batch 64)"]
        assert data["recovery_this_run"]["pending"] == 2000 and data["recovery_this_run"]["best"] > 0
        assert len(data["loadavg_1m_range"]) == 2
    finally:
        leftovers = [e for e in os.listdir("/dev/shm") if e.startswith(f"wheeld-{prefix}-")]
        for entry in leftovers:
            os.unlink(os.path.join("/dev/shm", entry))
    assert leftovers == [], f"the bench left segments behind: {leftovers}"
