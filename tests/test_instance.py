"""One daemon per instance, arenas that cannot be used are set aside, and a stopped
daemon's segments can be removed: what an operator meets when starting wheeld."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

import wheeld
from daemon_harness import DaemonProcess, unlink_segments, wait_until
from wheeld.ctl import main as wheelctl_main
from wheeld.protocol.naming import SHM_DIR, lock_path
from wheeld.shm import check as CK
from wheeld.shm import reader as R


def wheelctl(name: str, socket_path: str, *args):
    return CliRunner().invoke(wheelctl_main, ["--socket", socket_path, "--name", name, *args], catch_exceptions=False)


def collect(client, want: int, timeout_s: float = 20.0) -> list:
    got = []
    end = time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < end:
        got.extend(client.poll(0.2))
    return got


def run_second_daemon(name: str, socket_path: str, tmp_path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "wheeld.daemon.cli", "--socket", socket_path, "--name", name, "--capacity", "200000"]
    env = dict(os.environ)
    env.pop("NOTIFY_SOCKET", None)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.parametrize("same_socket", [True, False], ids=["same-socket", "other-socket"])
def test_a_second_daemon_of_the_same_name_changes_nothing(daemon, tmp_path, same_socket):
    with wheeld.connect(daemon.socket_path, group="live") as w:
        for i in range(5000):
            w.add(i, 1500 + i % 500)
        w.flush()
        before = os.stat(os.path.join(SHM_DIR, f"wheeld-{daemon.name}-arena"))
        second_socket = daemon.socket_path if same_socket else str(tmp_path / "other.sock")
        second = run_second_daemon(daemon.name, second_socket, tmp_path)
        assert second.returncode != 0
        assert f"pid {daemon.pid}" in second.stderr and "nothing was changed" in second.stderr, second.stderr
        assert not os.path.exists(tmp_path / "other.sock")
        after = os.stat(os.path.join(SHM_DIR, f"wheeld-{daemon.name}-arena"))
        assert (after.st_ino, after.st_size) == (before.st_ino, before.st_size)
        report = CK.check(daemon.name)
        assert report.ok, report.problems
        got = collect(w, 5000)
    assert sorted(e.key for e in got) == list(range(5000))
    assert all(e.fired_ms >= e.deadline_ms for e in got)
    assert daemon.proc.poll() is None


def test_destroy_refuses_while_the_daemon_runs_and_removes_everything_after(daemon):
    with wheeld.connect(daemon.socket_path, group="g") as w:
        w.add("k", 600_000)
        w.flush()
    refused = wheelctl(daemon.name, daemon.socket_path, "destroy")
    assert refused.exit_code == 1 and f"pid {daemon.pid}" in refused.stderr
    assert os.path.exists(os.path.join(SHM_DIR, f"wheeld-{daemon.name}-arena"))
    daemon.stop()
    done = wheelctl(daemon.name, daemon.socket_path, "destroy", "--name", daemon.name)
    assert done.exit_code == 0, done.output
    assert "arena" in done.stdout and "lock" in done.stdout
    assert not [e for e in os.listdir(SHM_DIR) if e.startswith(f"wheeld-{daemon.name}-")]
    again = wheelctl(daemon.name, daemon.socket_path, "destroy")
    assert again.exit_code == 0 and "nothing to remove" in again.stdout


def test_a_lock_file_of_another_user_is_refused(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to create a file owned by another uid")
    d = DaemonProcess(tmp_path)
    path = lock_path(d.name)
    with open(path, "w"):
        pass
    os.chown(path, 65534, 65534)
    try:
        second = run_second_daemon(d.name, d.socket_path, tmp_path)
        assert second.returncode != 0 and "belongs to uid 65534" in second.stderr
    finally:
        d.cleanup()


def _damage_arena(path: str, how: str) -> int:
    """Damage the arena file of a stopped daemon; return its size afterwards."""
    size = os.stat(path).st_size
    if how == "emptied":
        os.truncate(path, 0)
    elif how == "halved":
        os.truncate(path, size // 2)
    else:  # "header scribbled": the size is right, the first page is not an arena's
        with open(path, "r+b") as f:
            f.write(os.urandom(4096))
    return os.stat(path).st_size


@pytest.mark.parametrize("how", ["emptied", "halved", "header scribbled"])
def test_a_truncated_arena_is_set_aside_and_rebuilt_from_the_journal(daemon_factory, tmp_path, how):
    d = daemon_factory(extra=["--journal", str(tmp_path / "journal"), "--fsync", "always"]).start()
    with wheeld.connect(d.socket_path, group="g") as w:
        for i in range(300):
            w.add(i, 2000)
        w.flush()
    d.kill()
    arena = os.path.join(SHM_DIR, f"wheeld-{d.name}-arena")
    damaged_size = _damage_arena(arena, how)  # what a process of the daemon's own uid could do
    d.start()
    assert "set aside" in d.log() and "rebuilt from the journal" in d.log()
    aside = [e for e in os.listdir(SHM_DIR) if e.startswith(f"wheeld-{d.name}-arena.unusable-")]
    assert len(aside) == 1 and os.stat(os.path.join(SHM_DIR, aside[0])).st_size == damaged_size
    with wheeld.connect(d.socket_path, group="g") as w:
        got = collect(w, 300)
    assert sorted(e.key for e in got) == list(range(300))
    with R.ArenaReader(d.name) as reader:
        assert reader.counters()["arenas_set_aside_total"] == 1


def test_a_daemon_killed_while_rebuilding_its_arena_rebuilds_it_again(daemon_factory, tmp_path):
    """The arena is built under a temporary name: a half-recovered one is never attached."""
    journal = tmp_path / "journal"
    d = daemon_factory(capacity=400_000, extra=["--journal", str(journal), "--fsync", "off"]).start()
    with wheeld.connect(d.socket_path, group="g") as w:
        for i in range(150_000):
            w.add(i, 600_000)
        w.flush(timeout_s=60)
    d.stop()  # SIGTERM: the journal is complete on disk
    unlink_segments(d.name)  # a reboot
    env = dict(os.environ)
    env.pop("NOTIFY_SOCKET", None)
    cmd = [sys.executable, "-m", "wheeld.daemon.cli", "--socket", d.socket_path, "--name", d.name,
           "--capacity", "400000", "--journal", str(journal)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        arena = os.path.join(SHM_DIR, f"wheeld-{d.name}-arena")
        wait_until(lambda: os.path.exists(arena) or os.path.exists(arena + ".new") or proc.poll() is not None,
                   timeout=30, what="the recovery to begin (or the daemon to exit)", interval=0.001)
        os.kill(proc.pid, signal.SIGKILL)  # in the middle of the recovery
    finally:
        proc.wait(10)
    d.start(timeout_s=60)
    with R.ArenaReader(d.name) as reader:
        assert reader.counters()["pending"] == 150_000
    assert not os.path.exists(os.path.join(SHM_DIR, f"wheeld-{d.name}-arena.new"))


def test_no_client_ring_or_status_page_is_named_in_dev_shm(daemon):
    with wheeld.connect(daemon.socket_path, group="g") as w:
        w.add("k", 10)
        w.flush()
        names = sorted(e for e in os.listdir(SHM_DIR) if e.startswith(f"wheeld-{daemon.name}-"))
        kinds = collections.Counter(name.rsplit("-", 1)[1] for name in names)
        assert kinds == {"arena": 1, "clients": 1, "lock": 1}, names
