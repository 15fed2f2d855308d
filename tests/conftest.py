import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from daemon_harness import DaemonProcess  # noqa: E402


@pytest.fixture
def daemon(tmp_path):
    """A real wheeld process on a private socket and name; killed and cleaned up after the test."""
    proc = DaemonProcess(tmp_path)
    try:
        proc.start()
        yield proc
    finally:
        proc.cleanup()


@pytest.fixture
def daemon_factory(tmp_path):
    made = []

    def make(**kwargs):
        proc = DaemonProcess(tmp_path, **kwargs)
        made.append(proc)
        return proc

    try:
        yield make
    finally:
        for proc in made:
            proc.cleanup()


# Modules whose tests run for many seconds each (Spark jobs and a standalone
# cluster, the chaos and socket-scale runs, the crash sweeps): handed to the
# workers first, so that no worker starts a long test when the others are
# nearly done. Only the order changes; every test still runs.
_LONG_FIRST = ("test_pipeline_cluster", "test_pipeline", "test_chaos", "test_chaos_unpolled", "test_bench_sockets",
               "test_fuzz_daemon", "test_wheel_crash", "test_hostile")


def pytest_collection_modifyitems(items):
    def rank(item) -> int:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
        return _LONG_FIRST.index(module) if module in _LONG_FIRST else len(_LONG_FIRST)

    items.sort(key=rank)  # stable: the collection order within each rank


def pytest_configure(config):
    """The first fresh seed of this run's simulation slice (tests/test_simulation.py), chosen
    once in the controlling process so that every xdist worker shares it (WHEELD_SIM_FIRST
    set by hand replays a run's slice)."""
    if "WHEELD_SIM_FIRST" not in os.environ:
        import time

        os.environ["WHEELD_SIM_FIRST"] = str(int(time.time() * 1000) % 10**12)
