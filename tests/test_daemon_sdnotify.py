"""The real daemon speaking sd_notify to a datagram socket the test holds (systemd's part).

The daemon runs with ``NOTIFY_SOCKET`` pointing at our socket and
``WATCHDOG_USEC=200000`` (a ping every 100 ms: half the interval, as systemd
asks). What it must show:

* ``READY=1`` exactly once, and only once the control socket accepts
  connections and the arena is mapped (we connect the moment it arrives);
* ``STATUS=`` one-line summaries;
* ``WATCHDOG=1`` pings while it runs, from the wheel's own loop: a stopped
  process (SIGSTOP) sends none, and they resume after SIGCONT; and because
  SIGSTOP would silence a watchdog *thread* just as well, a second test wedges
  only the loop (a callback that blocks, inside a process that keeps running)
  and sees the pings stop too;
* ``STOPPING=1`` when SIGTERM starts the shutdown.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

import wheeld
from daemon_harness import unique_name, unlink_segments
from wheeld.shm import reader as R

pytestmark = pytest.mark.timeout(120)

WATCHDOG_USEC = 200_000
PING_S = WATCHDOG_USEC / 2 / 1e6


class Receiver:
    """Our end of NOTIFY_SOCKET: every datagram with the time it arrived."""

    def __init__(self, path: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.path = path

    def next(self, timeout_s: float) -> tuple[float, list[str]] | None:
        self.sock.settimeout(timeout_s)
        try:
            data = self.sock.recv(4096)
        except (TimeoutError, socket.timeout):
            return None
        return time.monotonic(), data.decode().split("\n")

    def until(self, wanted: str, timeout_s: float = 15.0) -> list[list[str]]:
        """Every message up to and including the first with the line ``wanted``."""
        seen = []
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            got = self.next(max(0.01, end - time.monotonic()))
            if got is None:
                break
            seen.append(got[1])
            if wanted in got[1]:
                return seen
        raise AssertionError(f"no {wanted} within {timeout_s} s; got {seen}")

    def during(self, seconds: float) -> list[tuple[float, list[str]]]:
        out = []
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            got = self.next(left)
            if got is not None:
                out.append(got)
        return out

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def notified_daemon(daemon_factory, tmp_path, monkeypatch):
    """A real daemon started with our NOTIFY_SOCKET and a 200 ms watchdog; (daemon, receiver, start thread)."""
    monkeypatch.delenv("WATCHDOG_PID", raising=False)  # set and not the daemon's pid: not its watchdog
    receiver = Receiver(str(tmp_path / "notify"))
    proc = daemon_factory()
    errors = []

    def start():
        try:
            proc.start(env={"NOTIFY_SOCKET": receiver.path, "WATCHDOG_USEC": str(WATCHDOG_USEC)})
        except Exception as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    starter = threading.Thread(target=start, daemon=True)
    starter.start()
    try:
        yield proc, receiver, starter, errors
    finally:
        starter.join(30)
        if proc.proc is not None and proc.proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
        receiver.close()


def watchdogs(messages) -> list[float]:
    return [at for at, lines in messages if "WATCHDOG=1" in lines]


def test_ready_status_watchdog_stall_and_stopping(notified_daemon):
    proc, receiver, starter, errors = notified_daemon

    # READY=1 comes first, and when it does the socket already accepts and the arena is mapped
    first = receiver.until("READY=1")
    assert first[-1][0] == "READY=1" and first[-1][1].startswith("STATUS=")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(proc.socket_path)  # no retry: it must accept now
    finally:
        probe.close()
    starter.join(30)
    assert not errors, errors
    with R.ArenaReader(proc.name) as reader:
        assert reader.info["capacity"] == proc.capacity
    with wheeld.connect(proc.socket_path, group="n") as w:
        w.add("k", 600_000)
        w.flush()

    # pings keep coming from the running loop, with one-line STATUS= summaries
    running = receiver.during(1.0)
    pings = watchdogs(running)
    assert len(pings) >= 4, running
    assert max(b - a for a, b in zip(pings, pings[1:])) < 0.5
    statuses = [line for _at, lines in running for line in lines if line.startswith("STATUS=")]
    assert statuses and all("pending" in s for s in statuses)
    assert any("1 pending" in s for s in statuses)
    assert not [lines for _at, lines in running if "READY=1" in lines], "READY=1 is sent once"

    # a stalled loop stops pinging: SIGSTOP it (what a stuck wheel looks like to systemd)
    os.kill(proc.pid, signal.SIGSTOP)
    receiver.during(0.1)  # anything sent just before the stop
    stalled = receiver.during(4 * WATCHDOG_USEC / 1e6)
    assert watchdogs(stalled) == [], stalled
    os.kill(proc.pid, signal.SIGCONT)
    resumed = receiver.during(1.0)
    assert len(watchdogs(resumed)) >= 3, resumed

    # SIGTERM: STOPPING=1, then a clean exit
    os.kill(proc.pid, signal.SIGTERM)
    stopping = receiver.until("STOPPING=1")
    assert "READY=1" not in [line for lines in stopping for line in lines]
    assert proc.proc.wait(15) == 0


def test_no_watchdog_pings_without_watchdog_usec(daemon_factory, tmp_path, monkeypatch):
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    receiver = Receiver(str(tmp_path / "notify"))
    try:
        proc = daemon_factory()
        proc.start(env={"NOTIFY_SOCKET": receiver.path})
        receiver.until("READY=1")
        assert watchdogs(receiver.during(0.6)) == []
        os.kill(proc.pid, signal.SIGTERM)
        receiver.until("STOPPING=1")
        assert proc.proc.wait(15) == 0
    finally:
        receiver.close()


# Runs the real CLI after wrapping DaemonCore.publish (called once per loop iteration) so
# that it blocks while a flag file exists: the loop is wedged, the process is not.
_STALLABLE = """
import os, sys, time
from wheeld.daemon import core
flag = os.environ["WHEELD_TEST_STALL_FLAG"]
publish = core.DaemonCore.publish
def stallable_publish(self, now):
    while os.path.exists(flag):
        time.sleep(0.005)
    publish(self, now)
core.DaemonCore.publish = stallable_publish
from wheeld.daemon.cli import main
main()
"""


def test_a_wedged_loop_in_a_running_process_stops_the_pings(tmp_path, monkeypatch):
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    name = unique_name()
    socket_path = str(tmp_path / "w.sock")
    flag = tmp_path / "stall"
    receiver = Receiver(str(tmp_path / "notify"))
    env = {**os.environ, "NOTIFY_SOCKET": receiver.path, "WATCHDOG_USEC": str(WATCHDOG_USEC),
           "WHEELD_TEST_STALL_FLAG": str(flag)}
    log = open(tmp_path / "daemon.log", "wb")
    proc = subprocess.Popen([sys.executable, "-c", _STALLABLE, "--socket", socket_path, "--name", name,
                             "--capacity", "1000"], stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        receiver.until("READY=1")
        assert len(watchdogs(receiver.during(0.6))) >= 3
        flag.touch()
        # The iteration in flight, or the first one after the park in progress (a park lasts
        # at most one ping interval), may still ping before it reaches the wedged publish.
        receiver.during(WATCHDOG_USEC / 2 / 1e6 + 0.3)
        wedged = receiver.during(4 * WATCHDOG_USEC / 1e6)
        assert proc.poll() is None and watchdogs(wedged) == [], wedged
        with open(f"/proc/{proc.pid}/stat") as f:
            assert f.read().rsplit(")", 1)[1].split()[0] != "T"  # running, not stopped
        flag.unlink()
        assert len(watchdogs(receiver.during(1.0))) >= 3
        os.kill(proc.pid, signal.SIGTERM)
        receiver.until("STOPPING=1")
        assert proc.wait(15) == 0
    finally:
        if flag.exists():
            flag.unlink()
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()
        receiver.close()
        unlink_segments(name)
