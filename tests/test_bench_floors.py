"""bench/wake_floor.py, bench/miss_floor.py and bench/python_path.py in small modes.

Each runs for real (its C program compiled here, callgrind run for real) and
the tests check what the reports claim to measure and that the children are
gone afterwards. Speed is not asserted (that is the benchmarks' job).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import miss_floor, python_path, wake_floor  # noqa: E402
from daemon_harness import child_pids  # noqa: E402


def test_wake_floor_reports_cpu_per_wake_up_for_each_loop(tmp_path):
    before = child_pids()
    out = tmp_path / "wake"
    assert wake_floor.main(["--seconds", "0.3", "--repeat", "1", "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    rows = {r["loop"]: r for r in data["rows"]}
    assert set(rows) == {"c timerfd", "c timerfd + 2 sends", "python uvloop"}
    for row in rows.values():
        # one wake-up per ms at most (a late one folds the missed ms into it), and some
        assert 0 < row["wakes"] <= row["wall_s"] * 1000 + 2
        assert row["on_cpu_s"] > 0 and row["rusage_s"] >= 0
        assert row["us_per_wake"] == round(row["on_cpu_s"] * 1e6 / row["wakes"], 2)
        assert row["us_per_op"] == round(row["on_cpu_s"] * 1000 / row["wall_s"] * 1000 / data["ops_per_s"], 3)
    assert child_pids() <= before  # the C loop and its readers were reaped


def test_miss_floor_times_a_load_per_working_set(tmp_path):
    out = tmp_path / "miss"
    assert miss_floor.main(["--no-wheel", "--max-mib", "1", "--loads", "200000", "--repeat", "1",
                            "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    assert [r["kib"] for r in data["rows"]] == [16, 32, 64, 128, 256, 512, 1024]
    assert all(r["ns_per_load"] > 0 for r in data["rows"])
    assert data["insert"] is None  # no wheel run: no comparison made up


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="needs valgrind (Debian: apt install valgrind)")
@pytest.mark.timeout(900)  # two trees built and run under valgrind: minutes on a loaded machine
def test_python_path_counts_instructions_of_both_trees(tmp_path):
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    out = tmp_path / "pp"
    assert python_path.main(["--base", head.stdout.strip(), "--ops", "300", "--pending", "1000",
                             "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["base_commit"] == data["head_commit"] == head.stdout.strip()
    calls = {(r["part"], r["call"]): r for r in data["rows"]}
    assert set(calls) == {("wheel", "insert"), ("wheel", "re-arm"), ("wheel", "cancel"), ("wheel", "expire"),
                          ("client", "add"), ("client", "cancel"), ("client", "add_idle"), ("client", "touch")}
    for row in calls.values():
        assert 0 < row["compiled"] < row["python"]  # the compiled build: fewer instructions for the same calls
        assert row["base"] > 0
    for call in ("insert", "cancel", "expire"):  # (at 300 calls, one-time set-up weighs on the others)
        assert calls[("wheel", call)]["compiled"] < calls[("wheel", call)]["python"] / 3
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "shm", "client", "protocol"],
                           capture_output=True, text=True).stdout
    if not dirty:  # the same commit on both sides: the same code, counted in two trees
        # Not to the instruction: where the interpreter's objects land differs between the
        # trees (module paths of other lengths), and with it the collisions of the type
        # attribute cache and of dicts keyed by object ids; a call through a deep class
        # hierarchy (ClientCore's rooms) moves by up to ~5% that way, measured.
        for row in calls.values():
            assert abs(row["python"] - row["base"]) <= 0.08 * row["base"], row
    worktrees = subprocess.run(["git", "-C", str(ROOT), "worktree", "list"], capture_output=True, text=True).stdout
    assert "wheeld-python-path-" not in worktrees  # the base's worktree was removed


def test_cold_ops_times_every_operation_cold_and_warm(tmp_path):
    """bench/cold_ops.py in a small mode: every operation is timed on the same number of
    records cold and warm, and the batches fired are the batches armed."""
    from bench import cold_ops

    out = tmp_path / "cold.json"
    assert cold_ops.main(["--capacity", "20000", "--pending", "2000", "--batch", "16", "--rounds", "5",
                          "--evict-mb", "4", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = {r["op"]: r for r in data["results"]}
    assert list(rows) == list(cold_ops.OPS)
    for row in rows.values():
        assert row["operations"] == 16 * 5 and row["cold_ns"] > 0 and row["warm_ns"] > 0
