"""bench.client_ops with tiny sizes: both paths run, every call pushed its record, and the
``--live`` rows (calls on keys drawn among many armed ones) are reported."""

from __future__ import annotations

import json

from bench import client_ops

ROUNDS, BATCH, LIVE = 1, 512, 3000
LIVE_ROWS = ("add, live", "cancel, live", "loop, live", "baseline add, live", "baseline cancel, live")


def test_both_paths_run_with_live_keys(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WHEELD_BENCH_RUNS", str(tmp_path))
    client_ops.main(["--rounds", str(ROUNDS), "--batch", str(BATCH), "--live", str(LIVE), "--out", "client_ops_smoke"])
    assert "add, live" in capsys.readouterr().out
    data = json.loads((tmp_path / "client_ops_smoke.json").read_text())
    assert data["live"] == LIVE
    assert [r["op"] for r in data["rows_us_per_call"]][-len(LIVE_ROWS):] == list(LIVE_ROWS)
    idle_keys = min(BATCH, client_ops.TOUCH_CAPACITY)
    # one record per add, cancel and add_idle (the warm-up, the rounds, the live keys, the
    # live rounds' re-arms, cancels and re-adds); the cancels' FLUSH marks come on top
    calls = 2 * BATCH + ROUNDS * 2 * BATCH + idle_keys * (1 + ROUNDS) + LIVE + ROUNDS * 3 * BATCH
    cancels = BATCH + ROUNDS * 2 * BATCH
    for label, run in data["runs"].items():
        assert set(run["module_paths"].values()) == {label}
        assert run["doorbells"] == 0
        assert calls <= run["records_drained"] <= calls + cancels // 256 + 1
        for row in LIVE_ROWS:
            assert run["us_per_call"][row]["best"] > 0
