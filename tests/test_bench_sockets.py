"""bench/sockets.py in its small mode: real loopback TCP connections, real server processes, a real daemon.

The 2,000-connection run drives both example servers (examples/idle_server.py on
the daemon's idle timers, examples/idle_server_sync.py) and asserts what an idle
detector must do: no active connection closed, no close before ``idle_ms`` of
real time since the server's last read, every quiet connection closed. The
smoke run goes through every server kind with a few hundred connections and
checks the report. Speed is not asserted here (that is the benchmark's job).
The benchmark stops every process it started (by pid) and unlinks its daemons'
segments; the tests check that nothing of theirs is left in /dev/shm.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import sockets  # noqa: E402

SMALL = ["--idle-ms", "1000", "--min-interval-ms", "50", "--max-interval-ms", "200", "--duration-s", "1",
         "--connect-rate", "4000"]


def leftover_segments() -> set[str]:
    return {e for e in os.listdir("/dev/shm") if e.startswith(f"wheeld-bench-sockets-{os.getpid()}-")}


def run(tmp_path, *args) -> dict:
    out = tmp_path / "sockets.json"
    assert sockets.main([*SMALL, *args, "--out", str(out)]) == 0
    assert leftover_segments() == set()
    return json.loads(out.read_text())


def test_both_example_servers_hold_2000_connections_with_no_wrong_or_early_close(tmp_path):
    report = run(tmp_path, "--connections", "2000", "--kinds", "asyncio-wheeld,sync-wheeld")
    assert [r["kind"] for r in report["results"]] == ["asyncio-wheeld", "sync-wheeld"]
    for r in report["results"]:
        assert r["connections"] == 2000 and r["quiet"] == 1000
        assert r["wrong_closes"] == 0, r["wrong_examples"]
        assert r["early_closes"] == 0, r["early_examples_ms"]
        assert r["load_stalls"] == 0  # the load kept its schedule: the run is valid
        assert r["missed"] == 0 and r["idle_closes"] == 1000 and r["undetermined_closes"] == 0
        assert r["lateness_ms"]["p50"] >= 0
        assert r["reads_in_window"] > 0 and r["daemon_us_per_read"] > 0


def test_smoke_every_server_kind(tmp_path):
    report = run(tmp_path, "--connections", "300")
    by_kind = {r["kind"]: r for r in report["results"]}
    assert set(by_kind) == set(sockets.KINDS)
    for kind, r in by_kind.items():
        assert r["wrong_closes"] == 0, (kind, r["wrong_examples"])
        if kind.endswith("-none"):
            assert r["idle_closes"] == 0  # no idle detection at all
        else:
            assert r["idle_closes"] == 150 and r["missed"] == 0
        if kind.endswith("-wheeld"):
            assert r["early_closes"] == 0
    assert "net_us_per_read" in by_kind["asyncio-wheeld"] and "net_us_per_read" in by_kind["sync-wheeld"]
    assert report["summary"]["lines"]


def test_the_open_file_limit_message(monkeypatch):
    import resource

    monkeypatch.setattr(resource, "getrlimit", lambda _r: (1024, 1024))

    def refuse(*_args):
        raise ValueError("not allowed to raise maximum limit")

    monkeypatch.setattr(resource, "setrlimit", refuse)
    ok, message = sockets.raise_nofile(51_024)
    assert not ok and "51024" in message and "RLIMIT_NOFILE is 1024" in message
    with pytest.raises(SystemExit):
        sockets.plan_processes(50_000, None)  # 1,024 descriptors: not even one useful process
