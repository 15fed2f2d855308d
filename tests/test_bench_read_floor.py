"""bench/read_floor.py in a small mode: a real server process and a real load over loopback.

Checks what the report claims to measure (reads made, CPU split into user and
system time, reads per wait) and that both
processes are gone afterwards. Speed is not asserted (that is the benchmark's job).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import read_floor  # noqa: E402
from daemon_harness import child_pids  # noqa: E402


def test_small_run_reports_cpu_per_read_for_each_loop_shape(tmp_path):
    before = child_pids()
    out = tmp_path / "floor.json"
    assert read_floor.main(["--connections", "400", "--window-s", "1", "--shapes", "epoll,epoll+2ms",
                            "--out", str(out)]) == 0
    rows = {r["shape"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"epoll", "epoll+2ms"}
    for row in rows.values():
        assert row["connections"] == 400
        assert row["reads"] > 100  # 200 active connections, a byte each every 100-500 ms, for 1 s
        assert row["user_us_per_read"] >= 0 and row["sys_us_per_read"] >= 0
        assert row["us_per_read"] == row["user_us_per_read"] + row["sys_us_per_read"] > 0
        assert row["reads_per_wait"] > 0
    assert child_pids() <= before  # the server and the load were killed and reaped
