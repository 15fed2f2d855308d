"""Chaos with workers that die without polling: no flush-acknowledged timer is lost.

Each group has a worker that adds, re-arms, cancels and polls (tests/chaos_worker.py)
and a *hoarder*: a member whose application never polls, so the expirations the
daemon gives it wait in its library's buffer (each flush reads them off the
socket). Under that load the daemon is SIGKILLed and restarted several times (it
sends every unacknowledged expiration again, the hoarders' buffered ones
included), a hoarder is SIGKILLed after each restart, and the run ends with a
reboot (``--fsync always``: the shared memory removed, the journal cut back to
what was fsynced, see tests/test_chaos.py) after which every hoarder dies
without polling. Whatever the hoarders held must reach the other member of
their group.

The truth comes from the workers' logs: every arming a flush() acknowledged
whose key no later command replaced must have been handed to the application
of some member of its group; nothing handed twice outside the documented
at-least-once windows (tests/test_chaos.py, :func:`check_run`).

The default suite runs two short runs; the ``slow`` variant (``make test-long``)
ten more.
"""

from __future__ import annotations

import time

import pytest
from test_chaos import Chaos, check_run

pytestmark = pytest.mark.timeout(300)

RESTARTS = 3  # daemon SIGKILLs per run, before the reboot


def run_unpolled(chaos: Chaos) -> None:
    rng = chaos.rng
    chaos.start()
    hoarders = [member for member in chaos.members if member.endswith("+hoard")]
    for _ in range(RESTARTS):
        rng_sleep(rng, 0.5, 1.0)  # load: the hoarders' buffers fill
        chaos.crash_daemon(reboot=False)  # copies of every unacknowledged expiration go out again
        rng_sleep(rng, 0.3, 0.8)  # the hoarders flush: any acknowledgement the library queued leaves
        chaos.kill_worker(rng.choice(hoarders))  # dies without polling; a new incarnation joins
    rng_sleep(rng, 0.5, 1.0)
    chaos.crash_daemon(reboot=True)
    rng_sleep(rng, 0.3, 0.8)
    for member in hoarders:
        chaos.kill_worker(member, restart=False)
    open(chaos.stop_file, "w").close()


def rng_sleep(rng, low: float, high: float) -> None:
    time.sleep(rng.uniform(low, high))


@pytest.mark.parametrize("run", [0, 1] + [pytest.param(run, marks=pytest.mark.slow) for run in range(2, 12)])
def test_workers_that_die_without_polling_lose_no_acknowledged_timer(tmp_path, run):
    chaos = Chaos(tmp_path, "always", workers=2, seed=1000 + run, hoarders=True, delay_ms=(20, 600),
                  capacity=50_000)
    try:
        run_unpolled(chaos)
        chaos.finish(timeout_s=60, window_ms=0)
    finally:
        chaos.cleanup()
    report = check_run(chaos, window_ms=0)
    assert report["lost"] == 0
    assert chaos.events["daemon_kills"] == RESTARTS and chaos.events["reboots"] == 1, report
    assert report["armings"] > 200, report
    # the hoarders' timers reached the application through the other member of their group
    hoarded = sum(1 for key in chaos.read_logs()["received"] if "+hoard-" in key)
    print(f"chaos: hoarders' timers handed by the other members: {hoarded}, lost: {report['lost']}, "
          f"duplicated: {report['duplicates']}")
    assert hoarded > 50, report
