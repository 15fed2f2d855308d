"""bench.ring_full with tiny sizes: it runs both ways of waiting, and every add arrives."""

from __future__ import annotations

import json

from bench import ring_full


def test_both_waits_run_and_report_their_costs(tmp_path, monkeypatch):
    monkeypatch.setenv("WHEELD_BENCH_RUNS", str(tmp_path))
    assert ring_full.main(["--rounds", "1", "--adds", "20000", "--name", "ring_full_smoke"]) == 0
    data = json.loads((tmp_path / "ring_full_smoke.json").read_text())
    assert [r["mode"] for r in data["rounds"]] == ["poll", "sleep"]
    for row in data["rounds"]:  # (each round's flush answered: all 40,000 adds were applied)
        assert row["adds_per_s"] > 0 and row["client_cpu_us_per_add"] > 0 and row["daemon_cpu_us_per_add"] > 0
    assert {m["wait"] for m in data["medians"]} == {"poll", "sleep"}
