"""One daemon per instance, arenas that cannot be used are set aside, and a stopped
daemon's segments can be removed: what an operator meets when starting wheeld."""

from __future__ import annotations

import collections
import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

import wheeld
from daemon_harness import DaemonProcess, unique_name, unlink_segments, wait_until
from hostile_harness import Honest
from wheeld.ctl import main as wheelctl_main
from wheeld.shm import instance_lock as IL
from wheeld.protocol.naming import SHM_DIR, arena_name, clients_name, instance_entries, lock_path, shm_path
from wheeld.shm import check as CK
from wheeld.shm import reader as R

EXIT_INSTANCE_RUNNING = 75  # wheeld's exit code when another daemon runs the instance (daemon/cli.py)


def wheelctl(name: str, socket_path: str, *args):
    return CliRunner().invoke(wheelctl_main, ["--socket", socket_path, "--name", name, *args], catch_exceptions=False)


def collect(client, want: int, timeout_s: float = 20.0) -> list:
    got = []
    end = time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < end:
        got.extend(client.poll(0.2))
    return got


def run_second_daemon(name: str, socket_path: str, tmp_path, *extra: str,
                      timeout: float = 60) -> subprocess.CompletedProcess:
    """A daemon expected to be refused (subprocess.run kills it when it is not, at ``timeout``)."""
    cmd = [sys.executable, "-m", "wheeld.daemon.cli", "--socket", socket_path, "--name", name, "--capacity", "200000",
           *extra]
    env = dict(os.environ)
    env.pop("NOTIFY_SOCKET", None)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ wheeld\[\d+\] [A-Z]+ ")


def one_line(result: subprocess.CompletedProcess, code: int) -> str:
    """The refusal: exit ``code``, one line on stderr starting 'wheeld: ' besides the log, no traceback."""
    lines = [line for line in result.stderr.strip().splitlines() if not LOG_LINE.match(line)]
    assert result.returncode == code, f"exit {result.returncode}:\n{result.stderr}"
    assert len(lines) == 1 and lines[0].startswith("wheeld: "), result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    return lines[0]


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


def test_a_lock_file_another_user_left_is_tried_first_and_its_holder_named(tmp_path):
    """The lock is tried before the file's owner is judged: held by another uid's process, the
    start is refused naming that uid and pid (and nothing is removed); free, the daemon runs."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create a file owned by another uid")
    d = DaemonProcess(tmp_path)
    path = lock_path(d.name)
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))  # what an older wheeld of uid 65534 left
    os.chown(path, 65534, 65534)
    hold = ("import fcntl, os, sys; os.setgid(65534); os.setuid(65534); fd = os.open(sys.argv[1], os.O_RDONLY); "
            "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()")
    holder = subprocess.Popen([sys.executable, "-c", hold, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        second = run_second_daemon(d.name, d.socket_path, tmp_path)
        line = one_line(second, EXIT_INSTANCE_RUNNING)
        assert f"instance {d.name!r} is run by uid 65534, pid {holder.pid}" in line, line
        assert "remove" not in line
        assert os.stat(path).st_uid == 65534 and not os.path.exists(d.socket_path)
        holder.stdin.close()
        holder.wait(10)
        d.start()  # free now: taken, whoever owns the file
        running = IL.holder(d.name)
        assert (running.pid, running.uid) == (d.pid, 0)
        with wheeld.connect(d.socket_path, group="g") as w:
            w.add("k", 5)
            w.flush()
            assert [e.key for e in collect(w, 1)] == ["k"]
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(10)
        d.cleanup()


def preloaded_daemon(name: str, socket_path: str) -> subprocess.Popen:
    """A wheeld that imports its modules, prints 'loaded' and starts only when a line
    arrives on its stdin (so that a test can start it within a short window)."""
    preload = ("import sys, wheeld.daemon.cli as cli, wheeld.daemon.server; print('loaded', flush=True); "
               "sys.stdin.readline(); cli.main(sys.argv[1:], prog_name='wheeld')")
    env = {k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"}
    proc = subprocess.Popen([sys.executable, "-c", preload, "--socket", socket_path, "--name", name, "--capacity",
                             "200000"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    assert proc.stdout.readline() == "loaded\n"
    return proc


def test_a_removed_lock_file_does_not_let_a_second_daemon_share_the_arena(daemon, tmp_path):
    """Unlink the lock file (a /dev/shm clean-up, RemoveIPC=) and start a second daemon of the
    name on another socket: the arena's own lock turns it away, naming the holder; the running
    daemon makes its lock file again; every acknowledged timer arrives; an honest client is
    served throughout."""
    honest = Honest(tmp_path, daemon.socket_path)
    other = str(tmp_path / "other.sock")
    second = preloaded_daemon(daemon.name, other)
    try:
        with wheeld.connect(daemon.socket_path, group="acked") as w:
            for i in range(200):
                w.add(i, 3000)
            w.flush()
            os.kill(daemon.pid, signal.SIGSTOP)  # so that it cannot make its lock file again meanwhile
            try:
                os.unlink(lock_path(daemon.name))
                out, err = second.communicate("go\n", timeout=30)
            finally:
                os.kill(daemon.pid, signal.SIGCONT)
            line = one_line(subprocess.CompletedProcess(second.args, second.returncode, out, err),
                            EXIT_INSTANCE_RUNNING)
            assert f"instance {daemon.name!r} is run by uid {os.geteuid()}, pid {daemon.pid}" in line, line
            assert shm_path(arena_name(daemon.name)) in line and "nothing was changed" in line
            assert not os.path.exists(other)
            # the refused start removed the lock file it made; the running daemon makes its own again
            wait_until(lambda: (IL.holder(daemon.name) or IL.Holder(0)).pid == daemon.pid, 10,
                       "the running daemon to hold a lock file again", detail=daemon.log)
            daemon.wait_for_log("made and held again")
            third = run_second_daemon(daemon.name, other, tmp_path, timeout=60)
            assert f"pid {daemon.pid} (lock {lock_path(daemon.name)})" in one_line(third, EXIT_INSTANCE_RUNNING)
            # the client table is held as the arena is: its lock and its holder's marks
            for segment in (arena_name(daemon.name), clients_name(daemon.name)):
                fd = os.open(shm_path(segment), os.O_RDONLY)
                try:
                    assert IL.segment_locked(fd), segment
                    assert IL.read_marks(fd) == IL.Holder(daemon.pid, os.geteuid()), segment
                finally:
                    os.close(fd)
            got = collect(w, 200)
    finally:
        if second.poll() is None:
            second.kill()
            second.wait(10)
    assert sorted(e.key for e in got) == list(range(200))
    assert all(e.fired_ms >= e.deadline_ms for e in got)
    report = CK.check(daemon.name)
    assert report.ok, report.problems
    honest.finish()
    assert daemon.proc.poll() is None


def test_an_arena_removed_under_its_daemon_is_reported_and_its_timers_still_fire(daemon, tmp_path):
    """Linux cannot give an unlinked arena its name back: the daemon says so (log, status) and
    keeps serving from the arena it has mapped; a new daemon is still turned away."""
    honest = Honest(tmp_path, daemon.socket_path)
    arena = shm_path(arena_name(daemon.name))
    with wheeld.connect(daemon.socket_path, group="acked") as w:
        for i in range(100):
            w.add(i, 1500)
        w.flush()
        os.unlink(arena)
        daemon.wait_for_log(f"ERROR {arena} was removed while this daemon runs", timeout=10)
        got = collect(w, 100)
        second = run_second_daemon(daemon.name, str(tmp_path / "other.sock"), tmp_path, timeout=30)
    assert sorted(e.key for e in got) == list(range(100))
    assert f"pid {daemon.pid}" in one_line(second, EXIT_INSTANCE_RUNNING)
    assert not os.path.exists(arena)  # the refused daemon made no arena of its own
    honest.finish()
    assert daemon.log().count("was removed while this daemon runs") == 1  # said once, not every second


@pytest.mark.parametrize("refusal", ["socket in use", "bad metrics address"])
def test_a_refused_start_leaves_nothing_behind(tmp_path, refusal):
    """One line, exit 2, and no lock file, secret, arena, client table or socket left behind."""
    name = unique_name()
    socket_path = str(tmp_path / "s.sock")
    extra = ["--metrics", "127.0.0.1:not-a-port"] if refusal == "bad metrics address" else []
    squatter = None
    if refusal == "socket in use":
        squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        squatter.bind(socket_path)
        squatter.listen(1)
    try:
        result = run_second_daemon(name, socket_path, tmp_path, *extra)
        left = instance_entries(name, os.listdir(SHM_DIR))
    finally:
        if squatter is not None:
            squatter.close()
        unlink_segments(name)
    one_line(result, 2)
    assert left == []
    assert os.path.exists(socket_path) == (refusal == "socket in use")
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
        assert kinds == {"arena": 1, "clients": 1, "lock": 1, "secret": 1}, names


def test_a_restart_under_a_held_socket_logs_each_client_once(tmp_path):
    """With systemd's socket (wheeld.socket), a client polling while the daemon restarts
    connects into the listen backlog and may give up waiting for a Welcome, more than once.
    The restarted daemon drops those abandoned handshakes quietly: each client joins once
    (not "joined ... handed back" twice and "left: send failed: Broken pipe")."""
    roles = os.path.join(os.path.dirname(__file__), "layout_roles.py")
    name = unique_name()
    socket_path = str(tmp_path / "held.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # what wheeld.socket holds across restarts
    listener.bind(socket_path)
    listener.listen(128)
    identity = json.dumps({"uid": os.geteuid(), "gid": os.getegid(), "groups": os.getgroups(), "umask": 0o022,
                           "listen_fd": listener.fileno()})
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LISTEN_", "NOTIFY_SOCKET", "WATCHDOG_"))}
    daemons: list[subprocess.Popen] = []

    def start(tag: str) -> str:
        log_path = str(tmp_path / f"{tag}.log")
        with open(log_path, "wb") as log:
            daemons.append(subprocess.Popen(
                [sys.executable, roles, identity, "wheeld", "--socket", socket_path, "--name", name, "--capacity",
                 "10000"], stdout=log, stderr=subprocess.STDOUT, pass_fds=[listener.fileno()], env=env))
        wait_until(lambda: " ready on " in open(log_path, errors="replace").read(), 30, f"daemon {tag} to be ready")
        return log_path

    try:
        start("first")
        with wheeld.connect(socket_path, group="g", reconnect_timeout_s=60) as w:
            for i in range(50):
                w.add(i, 3000)
            w.flush()
            daemons[0].kill()  # the socket stays (the test holds it, as systemd does)
            daemons[0].wait(10)
            end = time.monotonic() + 1.5
            got = []
            while time.monotonic() < end:  # a worker's loop: short polls while nobody answers
                got += w.poll(0.05)
            second_log = start("second")
            got += collect(w, 50 - len(got))
        assert sorted(e.key for e in got) == list(range(50))
        log = open(second_log, errors="replace").read()
        joined = [line for line in log.splitlines() if f"client pid {os.getpid()} uid" in line and " joined " in line]
        assert len(joined) == 1 and "handed back" in joined[0], log
        assert "send failed" not in log, log
    finally:
        for proc in daemons:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        listener.close()
        unlink_segments(name)


def test_the_secret_an_older_wheeld_kept_in_its_lock_file_moves_to_its_own_file(tmp_path):
    """The lock file is readable by everybody now: the secret (resume tokens are HMACs under
    it) moves from its bytes 32-63 to the 0600 secret file, so clients' tokens stay valid."""
    from wheeld.protocol.naming import secret_name

    d = DaemonProcess(tmp_path)
    legacy = os.urandom(32)
    fd = os.open(lock_path(d.name), os.O_CREAT | os.O_WRONLY, 0o600)
    os.pwrite(fd, b"4242\n".ljust(32) + legacy, 0)
    os.close(fd)
    try:
        d.start()
        secret = shm_path(secret_name(d.name))
        with open(secret, "rb") as f:
            assert f.read() == legacy
        assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
        lock = os.stat(lock_path(d.name))
        assert (lock.st_size, stat.S_IMODE(lock.st_mode)) == (32, 0o644)
        with open(lock_path(d.name), "rb") as f:
            assert f.read().split() == [str(d.pid).encode()]
    finally:
        d.cleanup()


@pytest.mark.parametrize("name", ["x-uid5", "a/b", "y" * 201])
def test_a_name_that_is_not_an_instance_name_is_refused_before_anything_is_made(tmp_path, name):
    """'x-uid5' would be the uid-qualified spelling of instance 'x' (protocol/naming.py)."""
    socket_path = str(tmp_path / "n.sock")
    try:
        result = run_second_daemon(name, socket_path, tmp_path, timeout=30)
        made = [e for e in os.listdir(SHM_DIR) if e.startswith(f"wheeld-{name}-")] if "/" not in name else []
    finally:
        if "/" not in name:
            unlink_segments(name)
    assert "instance name" in one_line(result, 2)
    assert not os.path.exists(socket_path) and made == []
