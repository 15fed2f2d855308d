"""bench.daemon_paths with tiny sizes: it runs, and its measured properties hold."""

from __future__ import annotations

from bench import daemon_paths


def test_apply_paths_run_both_paths_on_every_size():
    rows = daemon_paths.apply_paths([32, 256], 512)
    assert [r["batch_size"] for r in rows] == [32, 256]
    assert all(r["collapsed_us_per_cmd"] > 0 and r["one_by_one_us_per_cmd"] > 0 for r in rows)


def test_the_timerfd_park_never_wakes_before_its_deadline():
    rows = {r["wake-up"]: r for r in daemon_paths.park_precision(5)}
    alarm = rows["timerfd Alarm at the boundary"]
    assert alarm["n"] == 15 and alarm["early"] == 0


def test_bookkeeping_rows_cover_both_layouts():
    rows = daemon_paths.bookkeeping_pauses(2_000, 256)
    assert len(rows) == 4 and all(r["longest_us"] >= 0 for r in rows)


def test_coalescing_rows_count_wakeups_and_flushes_for_both_windows():
    rows = {r["coalesce_us"]: r for r in daemon_paths.coalescing(50, 3)}
    assert set(rows) == {0, 10_000}
    for row in rows.values():
        assert 0 < row["wakeups"] <= row["adds"] and row["flush_max_ms"] >= row["flush_p50_ms"] > 0


def test_expire_paths_fire_every_timer_both_ways():
    rows = daemon_paths.expire_paths([5, 20], 50)
    assert [r["timers_per_ms"] for r in rows] == [5, 20]
    assert all(r["expire_us_per_ms"] > 0 and r["expire_many_us_per_ms"] > 0 for r in rows)
