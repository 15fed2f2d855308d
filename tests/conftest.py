import os
import re
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


# The tiers (`make test-fast` runs what is neither): a test that starts processes (a
# daemon, workers, a command-line tool, a NATS cluster) is marked `process`, one that needs
# PySpark `spark`.
# A module that names one of these starts processes in some of its tests.
_PROCESS_HINTS = ("daemon_harness", "subprocess", "multiprocessing", "Popen", "DaemonProcess", "NatsCluster")
_DAEMON_FIXTURES = {"daemon", "daemon_factory"}


# ...or that imports a helper module of the suite (or bench/, whose benchmarks run daemons)
# that does
_HELPER_IMPORT = re.compile(r"^from (bench|[a-z_]+) import", re.MULTILINE)


def _starts_processes(module, cache: dict = {}) -> bool:  # noqa: B006 - a per-session cache
    path = getattr(module, "__file__", None)
    return path is not None and _file_starts_processes(path, cache)


def _file_starts_processes(path: str, cache: dict) -> bool:
    if path not in cache:
        cache[path] = False  # (an import cycle ends here)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        found = any(hint in text for hint in _PROCESS_HINTS)
        for match in _HELPER_IMPORT.finditer(text):
            name = match.group(1)
            helper = os.path.join(os.path.dirname(path), name + ".py")
            found = found or name == "bench" or (os.path.exists(helper) and _file_starts_processes(helper, cache))
        cache[path] = found
    return cache[path]


def pytest_collection_modifyitems(items):
    def rank(item) -> int:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
        return _LONG_FIRST.index(module) if module in _LONG_FIRST else len(_LONG_FIRST)

    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        module = item.module
        name = module.__name__.rsplit(".", 1)[-1] if module else ""
        if "spark" in fixtures or name.startswith("test_pipeline"):
            item.add_marker(pytest.mark.spark)
        if fixtures & _DAEMON_FIXTURES or (module is not None and _starts_processes(module)):
            item.add_marker(pytest.mark.process)
    items.sort(key=rank)  # stable: the collection order within each rank


def pytest_configure(config):
    """The first fresh seed of this run's simulation slice (tests/test_simulation.py), chosen
    once in the controlling process so that every xdist worker shares it (WHEELD_SIM_FIRST
    set by hand replays a run's slice)."""
    if "WHEELD_SIM_FIRST" not in os.environ:
        import time

        os.environ["WHEELD_SIM_FIRST"] = str(int(time.time() * 1000) % 10**12)


_SHM = "/dev/shm"


def _segments_of_dead_test_processes(pid: int | None = None) -> list[str]:
    """Shared-memory segments named by a test of this suite (``wheeld-test-<pid>-...`` or
    ``wheeld-test-cancel-log-<pid>-...``) whose process is ``pid`` or, without it, is gone."""
    found = []
    try:
        names = os.listdir(_SHM)
    except OSError:
        return found
    for name in names:
        if not name.startswith("wheeld-test-"):
            continue
        digits = next((part for part in name[len("wheeld-test-"):].split("-") if part.isdigit()), None)
        if digits is None:
            continue
        owner = int(digits)
        if owner == pid or (pid is None and owner != os.getpid() and not os.path.exists(f"/proc/{owner}")):
            found.append(name)
    return found


def pytest_sessionstart(session):
    """Segments left by a test process that was killed (a CI job cut short) are removed:
    each is named by its process id, and that process no longer exists."""
    for name in _segments_of_dead_test_processes():
        try:
            os.unlink(os.path.join(_SHM, name))
        except OSError:
            pass


def pytest_sessionfinish(session, exitstatus):
    """Every test unlinks what it creates, even on failure; this catches what a test
    killed by a timeout in its own finally block could not (it reports them, so the
    test that leaked is found)."""
    left = _segments_of_dead_test_processes(os.getpid())
    for name in left:
        try:
            os.unlink(os.path.join(_SHM, name))
        except OSError:
            pass
    if left:
        sys.stderr.write(f"\nshared-memory segments left by tests of process {os.getpid()} (removed): "
                         f"{sorted(left)[:8]}\n")
