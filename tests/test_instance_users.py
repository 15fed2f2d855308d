"""One instance name, several users: a root wheeld and a non-root one (the systemd
service's), and a daemon that other users' workers reach outside the systemd layout.

Throwaway users and groups (tests/throwaway_users.py), removed afterwards; root only.
Daemons run as those users through tests/layout_roles.py; every daemon, socket and
segment made here is removed afterwards, also when a check fails.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time

import pytest

import wheeld
from daemon_harness import DaemonProcess, unique_name, unlink_segments, wait_until
from test_instance import one_line
from throwaway_users import SKIP_REASON, Accounts, run_wheeld_as, start_wheeld_as, wheelctl_as
from wheeld.shm import instance_lock as IL
from wheeld.protocol.naming import SHM_DIR, arena_name, instance_entries, lock_path, shm_path

pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")

EXIT_INSTANCE_RUNNING = 75  # daemon/cli.py


@pytest.fixture(scope="module")
def people():
    accounts = Accounts()
    try:
        dev = accounts.group("dev")
        yield {"service": accounts.user("svc"), "worker": accounts.user("wrk", [dev]),
               "outsider": accounts.user("out"), "dev_gid": dev,
               "dev_name": f"wt{accounts.tag}-dev"}
    finally:
        accounts.close()


@pytest.fixture
def workdir():
    """A directory every throwaway user can traverse and write (sockets, logs)."""
    base = tempfile.mkdtemp(prefix="wheeld-users-")
    os.chmod(base, 0o1777)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


class AsUser:
    """A wheeld run as a throwaway user; ``stop()`` ends it (SIGTERM) and returns its exit code."""

    def __init__(self, person: dict, workdir: str, name: str, tag: str, *extra: str):
        self.socket_path = os.path.join(workdir, f"{tag}.sock")
        self.log_path = os.path.join(workdir, f"{tag}.log")
        self.proc = start_wheeld_as(person, self.log_path, "--socket", self.socket_path, "--name", name,
                                    "--capacity", "5000", *extra)
        try:
            wait_until(self._ready, 60, f"wheeld as {person['name']} to become ready", detail=self.log)
        except BaseException:
            self.stop()
            raise

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"wheeld exited with {self.proc.returncode}:\n{self.log()}")
        return " ready on " in self.log()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def refused(result: subprocess.CompletedProcess, code: int) -> str:
    """The refusal: exit ``code``, one line on stderr starting 'wheeld: ' besides the log, no traceback."""
    return one_line(result, code)


def run_root_daemon(name: str, socket_path: str, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "LISTEN_FDS", "LISTEN_PID")}
    return subprocess.run([sys.executable, "-m", "wheeld.daemon.cli", "--socket", socket_path, "--name", name,
                           "--capacity", "5000", *extra], capture_output=True, text=True, timeout=60, env=env)


def receive(client, keys: set, timeout_s: float = 20.0) -> dict:
    got: dict = {}
    end = time.monotonic() + timeout_s
    while set(got) != keys and time.monotonic() < end:
        for e in client.poll(0.2):
            assert e.fired_ms >= e.deadline_ms, e
            got[e.key] = got.get(e.key, 0) + 1
    return got


def owner(segment: str) -> int:
    return os.stat(shm_path(segment)).st_uid


def test_a_root_daemon_and_the_service_users_daemon_share_an_instance_name(people, workdir):
    """``make run`` as root, then the service's user on the same name, and back: each start
    either runs or exits 75 with "instance NAME is run by uid U, pid P" (one line); nobody
    advises removing what a live daemon holds; a restart never refuses because of what the
    other uid left, and neither uid's timers are touched by the other."""
    service = people["service"]
    name = unique_name()
    root = DaemonProcess(workdir, name=name, capacity=5000)
    service_daemon = None
    try:
        root.start()
        with wheeld.connect(root.socket_path, group="root-timers") as w:
            for i in range(20):
                w.add(f"r{i}", 600_000)
            w.flush()
        assert root.stop() == 0  # its segments stay, as a root `make run` leaves them
        plain_arena = os.stat(shm_path(arena_name(name)))
        assert plain_arena.st_uid == 0

        # the service's user: not refused, not a traceback; its own names beside root's
        service_daemon = AsUser(service, workdir, name, "svc")
        assert "Traceback" not in service_daemon.log()
        assert owner(arena_name(name, service["uid"])) == service["uid"]
        assert os.stat(shm_path(arena_name(name))).st_ino == plain_arena.st_ino  # root's arena left alone
        with wheeld.connect(service_daemon.socket_path, group="svc-timers") as w:  # root may connect
            keys = {f"s{i}" for i in range(50)}
            for i, key in enumerate(sorted(keys)):
                w.add(key, 20 + i)
            w.flush()
            assert receive(w, keys) == dict.fromkeys(keys, 1)
        running = IL.holder(name)
        assert (running.pid, running.uid, running.qualified) == (service_daemon.pid, service["uid"], True)
        stats = json.loads(subprocess.run([sys.executable, "-m", "wheeld.ctl", "--name", name, "stats", "--json",
                                           "--interval", "0"], capture_output=True, text=True, timeout=60).stdout)
        assert stats["daemon"]["pid"] == service_daemon.pid  # wheelctl reads the running daemon's arena

        # root again while the service's daemon runs: refused, naming it, advising nothing destructive
        line = refused(run_root_daemon(name, os.path.join(workdir, "root2.sock")), EXIT_INSTANCE_RUNNING)
        assert f"instance {name!r} is run by uid {service['uid']}, pid {service_daemon.pid}" in line, line
        assert "remove" not in line
        assert service_daemon.proc.poll() is None
        assert not os.path.exists(os.path.join(workdir, "root2.sock"))

        assert service_daemon.stop() == 0
        # root's own restart finds its own arena and timers, whatever the service's user left
        root.start()
        assert root.counters()["pending"] == 20
        # and the service's user is now the one refused, with the same one line
        line = refused(run_wheeld_as(service, "--socket", os.path.join(workdir, "svc2.sock"), "--name", name),
                       EXIT_INSTANCE_RUNNING)
        assert f"instance {name!r} is run by uid 0, pid {root.pid}" in line, line
        assert "remove" not in line
        root.stop()
        # once both stopped, the service's daemon comes back to its own (qualified) arena
        service_daemon = AsUser(service, workdir, name, "svc3")
        assert "attached existing arena /wheeld-%s-uid%d-arena" % (name, service["uid"]) in service_daemon.log()
    finally:
        if service_daemon is not None:
            service_daemon.stop()
        root.cleanup()
        unlink_segments(name)
    assert instance_entries(name, os.listdir(SHM_DIR)) == []


def test_a_lock_file_another_user_may_not_open(people, workdir):
    """An older wheeld made its lock file 0600: a daemon of another uid cannot even open it.
    Held (/proc/locks says by whom): refused with that pid; free: the daemon takes a lock of
    its own uid and runs."""
    service = people["service"]
    name = unique_name()
    path = lock_path(name)
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))  # root's, 0600
    daemon = None
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDONLY); "
                               "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()", path],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        line = refused(run_wheeld_as(service, "--socket", os.path.join(workdir, "a.sock"), "--name", name),
                       EXIT_INSTANCE_RUNNING)
        assert f"instance {name!r} is run by uid 0, pid {holder.pid}" in line, line
        holder.stdin.close()
        holder.wait(10)
        daemon = AsUser(service, workdir, name, "b")
        assert lock_path(name, service["uid"]) in daemon.log()
        running = IL.holder(name)
        assert (running.pid, running.uid) == (daemon.pid, service["uid"])
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(10)
        if daemon is not None:
            daemon.stop()
        unlink_segments(name)


def test_other_users_workers_reach_a_daemon_through_socket_group_and_mode(people, workdir):
    """Outside the systemd layout: --socket-group/--socket-mode give the socket to a group,
    so its members' workers connect and read the figures; anyone else is refused at the
    socket, and told which group to join to read the arena."""
    worker, outsider, dev = people["worker"], people["outsider"], people["dev_name"]
    d = DaemonProcess(workdir, capacity=5000,
                      extra=["--socket-group", dev, "--socket-mode", "0660", "--allow-group", dev,
                             "--monitor-group", dev])
    try:
        d.start()
        st = os.stat(d.socket_path)
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, people["dev_gid"], 0o660)
        env = {"WHEELD_SOCKET": d.socket_path, "WHEELD_NAME": d.name}
        add, stats = wheelctl_as(worker, ["add", "k", "10", "--group", "dev"], ["stats", "--interval", "0"], env=env)
        assert (add["code"], add["err"]) == (0, ""), add
        assert stats["code"] == 0, stats
        add, stats = wheelctl_as(outsider, ["add", "k", "10", "--group", "out"], ["stats", "--interval", "0"], env=env)
        assert add["code"] == 3 and "permission denied" in add["err"], add
        assert stats["code"] == 3 and f"join the group {dev!r}" in stats["err"], stats
    finally:
        d.cleanup()
    d = DaemonProcess(workdir, capacity=5000)  # no --monitor-group: the arena is root's alone
    try:
        d.start()
        (stats,) = wheelctl_as(outsider, ["stats", "--interval", "0"], env={"WHEELD_NAME": d.name})
        assert stats["code"] == 3 and "only its owner 'root' and root may" in stats["err"], stats
    finally:
        d.cleanup()


def test_socket_group_and_mode_are_checked_before_anything_is_made(people, workdir):
    name = unique_name()
    socket_path = os.path.join(workdir, "bad.sock")
    try:
        line = refused(run_root_daemon(name, socket_path, "--socket-group", "no-such-group-here"), 2)
        assert "--socket-group: unknown group 'no-such-group-here'" in line
        line = refused(run_root_daemon(name, socket_path, "--socket-mode", "0999"), 2)
        assert "--socket-mode: '0999' is not an octal access mode" in line
        # a group the daemon's user does not belong to: refused at the socket, nothing left behind
        line = refused(run_wheeld_as(people["outsider"], "--socket", socket_path, "--name", name,
                                     "--socket-group", people["dev_name"]), 2)
        assert f"may not give the socket {socket_path} to group {people['dev_name']!r}" in line
        assert not os.path.exists(socket_path)
        assert instance_entries(name, os.listdir(SHM_DIR)) == []
    finally:
        unlink_segments(name)
