"""The fleet generator (pipeline/generate.py) writes journals that obey the format:
consistent, deterministic, with real torn tails; its command line."""

from __future__ import annotations

from pathlib import Path

import msgspec

from wheeld.journal.files import (
    list_segments,
)
from wheeld.journal.recovery import recover
from wheeld.protocol import journal as pj
from wheeld.protocol.journal import (
    Ack,
    Add,
    Cancel,
    Fire,
    IdleRearm,
    Rearm,
    Repl,
)


def _check_host_journal(folder: Path) -> dict:
    """Replay one host's journal, asserting every event is consistent with the state.

    Returns per-host figures the tests look at.
    """
    pending: dict = {}
    unacked: set = set()
    expected_lsn = 1
    last_t = 0
    figures = {"events": 0, "lateness": [], "late_fires": 0, "headers": [], "kinds": {}, "hours": [0] * 24,
               "samples": []}
    for first_lsn, path in list_segments(folder):
        events, defect = pj.iter_segment(path)
        assert defect is None, defect
        header = events[0]
        assert header.lsn == first_lsn == expected_lsn and header.host == folder.name
        figures["headers"].append(header)
        for event in events[1:]:
            assert event.n == expected_lsn
            expected_lsn += 1
            assert event.t >= last_t, "events are written in time order"
            last_t = event.t
            if type(event) is Repl:  # a replication sample: it changes no timer
                assert event.host == folder.name and 0 <= event.rlsn < event.n and event.lag >= 0
                figures["samples"].append(event)
                continue
            figures["events"] += 1
            kind = type(event).__name__
            figures["kinds"][kind] = figures["kinds"].get(kind, 0) + 1
            figures["hours"][(event.t - figures["headers"][0].t) // 3_600_000 % 24] += 1
            key = (event.g, event.k)
            current = pending.get(key)
            if type(event) is Add:
                assert current is None
                pending[key] = (event.d, event.s, event.i)
            elif type(event) is Rearm:
                assert current is not None and event.pd == current[0]
                pending[key] = (event.d, event.s, event.i)
            elif type(event) is IdleRearm:
                assert current is not None and event.pd == current[0] == event.t
                assert (event.s, event.i) == current[1:] and event.d > event.t - event.i
                pending[key] = (event.d, current[1], current[2])
            elif type(event) is Cancel:
                if event.hit:
                    assert current is not None and event.pd == current[0]
                    del pending[key]
                else:
                    assert current is None
            elif type(event) is Fire:
                assert current is not None and (event.d, event.s, event.i) == current
                assert event.f == event.t and event.lat == event.f - event.d >= 0
                del pending[key]
                unacked.add((event.g, event.k, event.s))
                if event.late:
                    figures["late_fires"] += 1
                else:
                    figures["lateness"].append(event.lat)
            elif type(event) is Ack:
                unacked.remove((event.g, event.k, event.s))
    return figures


def test_generated_fleet_is_consistent(tmp_path):
    from wheeld.pipeline.generate import generate_fleet

    info = generate_fleet(
        tmp_path / "fleet",
        hosts=4,
        events_per_host=20_000,
        seed=5,
        slow_hosts=1,
        restart_fraction=0.5,
        segment_bytes=200_000,
    )
    assert info.hosts == ["host-000", "host-001", "host-002", "host-003"]
    assert len(info.slow_hosts) == 1 and info.restarted_hosts
    figures = {name: _check_host_journal(tmp_path / "fleet" / name) for name in info.hosts}
    for name, host in figures.items():
        assert host["events"] == 20_000
        assert set(host["kinds"]) == {"Add", "Rearm", "Cancel", "Fire", "Ack", "IdleRearm"}
        assert len(host["headers"]) >= 2  # rotation at 200 kB
        groups_seen = {line["g"] for line in _sample_lines(tmp_path / "fleet" / name)}
        assert groups_seen == {"conns", "purgatory", "jobs", "leases"}
    for name in info.restarted_hosts:
        host = figures[name]
        assert host["late_fires"] > 0
        # the restarted daemon's monotonic clock starts again near zero
        assert any(header.mono0 < 120_000 for header in host["headers"][1:])
    for name in set(info.hosts) - set(info.restarted_hosts):
        assert figures[name]["late_fires"] == 0
    (slow,) = info.slow_hosts
    median = {name: sorted(host["lateness"])[len(host["lateness"]) // 2] for name, host in figures.items()}
    assert all(median[slow] > median[name] for name in info.hosts if name != slow)
    # diurnal load: the afternoon is busier than the small hours
    hours = [sum(figures[name]["hours"][hour] for name in info.hosts) for hour in range(24)]
    assert sum(hours[13:17]) > 2 * sum(hours[1:5])


def test_replicated_hosts_journal_replication_samples(tmp_path):
    """Replicating hosts journal repl events as the daemon's Recorder does: at most
    REPL_EVERY_MS apart while the daemon runs, one at each change of state, a new epoch per
    daemon run; the timers are the same as without them; a fenced host ends fenced."""
    from wheeld.pipeline.generate import generate_fleet

    generate_fleet(tmp_path / "plain", hosts=3, events_per_host=3_000, seed=6, restart_fraction=1.0,
                           duration_ms=3 * 3_600_000)
    info = generate_fleet(tmp_path / "fleet", hosts=3, events_per_host=3_000, seed=6, restart_fraction=1.0,
                          duration_ms=3 * 3_600_000, replicated_hosts=2, fenced_hosts=1)
    assert len(info.replicated_hosts) == 2 and len(info.fenced_hosts) == 1
    assert set(info.fenced_hosts) < set(info.replicated_hosts)
    seen: set = set()
    for name in info.hosts:
        figures = _check_host_journal(tmp_path / "fleet" / name)
        assert figures["events"] == 3_000
        state, again = recover(tmp_path / "fleet" / name), recover(tmp_path / "plain" / name)
        assert state.pending == again.pending and state.problems == [] == state.damage
        samples = figures["samples"]
        assert len(samples) == info.per_host[name]["repl_samples"]
        if name not in info.replicated_hosts:
            assert samples == []
            continue
        assert state.last_lsn == 3_000 + len(samples)
        states = [sample.state for sample in samples]
        seen.update(states)
        assert (states[-1] == "fenced") == (name in info.fenced_hosts)
        runs = [index for index, sample in enumerate(samples) if sample.state == "connecting" and
                (index == 0 or samples[index - 1].state != "connecting")]
        assert runs[0] == 0 and len(runs) == 2  # the start and the restart after the outage
        for index, (before, after) in enumerate(zip(samples, samples[1:])):
            if index + 1 in runs or after.state == "fenced":
                continue  # the outage (a crash writes no last sample) and a fenced host's pause
            assert after.t - before.t <= pj.REPL_EVERY_MS
            assert after.t - before.t == pj.REPL_EVERY_MS or after.state != before.state
        assert [s.epoch for s in samples if s.state == "replicating"][-1] == 2
    assert seen == {"connecting", "replicating", "behind", "fenced"}


def _sample_lines(folder: Path) -> list[dict]:
    lines = []
    for _, path in list_segments(folder):
        lines += [msgspec.json.decode(line) for line in path.read_bytes().splitlines()[1:]]
    return lines


def test_generated_fleet_is_deterministic_and_torn_tails_are_real(tmp_path):
    from wheeld.pipeline.generate import generate_fleet

    first = generate_fleet(tmp_path / "a", hosts=2, events_per_host=800, seed=9, torn_tail_hosts=1)
    generate_fleet(tmp_path / "b", hosts=2, events_per_host=800, seed=9, torn_tail_hosts=1)
    for name in first.hosts:
        files_a = [path.read_bytes() for _, path in list_segments(tmp_path / "a" / name)]
        files_b = [path.read_bytes() for _, path in list_segments(tmp_path / "b" / name)]
        assert files_a == files_b
    torn = [name for name in first.hosts
            if not list_segments(tmp_path / "a" / name)[-1][1].read_bytes().endswith(b"\n")]
    assert len(torn) == 1
    state = recover(tmp_path / "a" / torn[0], repair=False)
    assert [problem.reason for problem in state.problems] == [pj.TORN]
    assert state.last_lsn == 799


def test_generator_cli(tmp_path, capsys):
    from wheeld.pipeline.generate import main

    assert main([str(tmp_path / "out"), "--hosts", "2", "--events", "1000", "--seed", "3"]) == 0
    assert "wrote 1,000 events for 2 hosts" in capsys.readouterr().out
    for name in ("host-000", "host-001"):
        assert recover(tmp_path / "out" / name, repair=False).last_lsn == 500


def test_generator_makes_journal_directories_as_the_daemon_does(tmp_path, caplog):
    """The host folders it creates have the journal's directory mode from the start, so the
    journal writer has nothing to tighten and warns about nothing (whatever the umask)."""
    import logging
    import os
    import stat

    from wheeld.pipeline.generate import generate_fleet
    from wheeld.journal.files import DIR_MODE

    old = os.umask(0o022)
    try:
        with caplog.at_level(logging.WARNING):
            info = generate_fleet(tmp_path / "fleet", hosts=2, events_per_host=300, seed=4)
    finally:
        os.umask(old)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    for name in info.hosts:
        assert stat.S_IMODE(os.stat(tmp_path / "fleet" / name).st_mode) == DIR_MODE
