"""sd_notify and socket activation, checked against sockets the tests create.

The notification tests play systemd's part: a Unix datagram socket (a path
socket and an abstract one) is handed to :class:`Notifier` as
``NOTIFY_SOCKET`` and every datagram is compared byte for byte with what
systemd parses. The activation tests play systemd's other part: a child
process started with a listening socket at fd 3 and ``LISTEN_PID`` set, by a
``sh`` wrapper, to the child's own pid (``$$`` survives ``exec``).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from wheeld.daemon.activation import listen_fds, unix_stream_listener
from wheeld.daemon.sdnotify import Notifier
from wheeld.protocol.errors import WheeldError

RECEIVE_TIMEOUT_S = 5.0


@pytest.fixture(params=["path", "abstract"])
def notify_socket(request, tmp_path):
    """A datagram socket standing in for systemd's; yields (NOTIFY_SOCKET value, socket)."""
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.settimeout(RECEIVE_TIMEOUT_S)
    if request.param == "path":
        address = str(tmp_path / "notify")
        receiver.bind(address)
        env_value = address
    else:
        name = f"wheeld-test-{os.getpid()}-{uuid.uuid4().hex}"
        receiver.bind(b"\0" + name.encode())
        env_value = "@" + name
    try:
        yield env_value, receiver
    finally:
        receiver.close()


def received(receiver: socket.socket) -> bytes:
    return receiver.recv(4096)


def assert_nothing_more(receiver: socket.socket) -> None:
    receiver.setblocking(False)
    try:
        with pytest.raises(BlockingIOError):
            receiver.recv(4096)
    finally:
        receiver.settimeout(RECEIVE_TIMEOUT_S)


def test_each_message_arrives_as_systemd_parses_it(notify_socket):
    env_value, receiver = notify_socket
    notifier = Notifier({"NOTIFY_SOCKET": env_value})
    assert notifier.enabled

    notifier.ready()
    assert received(receiver) == b"READY=1"
    notifier.ready(status="serving 3 clients")
    assert received(receiver) == b"READY=1\nSTATUS=serving 3 clients"
    notifier.status("1204 pending, 3 clients")
    assert received(receiver) == b"STATUS=1204 pending, 3 clients"
    notifier.watchdog()
    assert received(receiver) == b"WATCHDOG=1"
    notifier.stopping()
    assert received(receiver) == b"STOPPING=1"
    notifier.extend_timeout(2.5)
    assert received(receiver) == b"EXTEND_TIMEOUT_USEC=2500000"
    assert_nothing_more(receiver)
    notifier.close()


def test_reloading_carries_the_monotonic_clock_in_microseconds(notify_socket):
    env_value, receiver = notify_socket
    notifier = Notifier({"NOTIFY_SOCKET": env_value})
    before_usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1_000
    notifier.reloading()
    after_usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1_000

    first_line, second_line = received(receiver).split(b"\n")
    assert first_line == b"RELOADING=1"
    key, value = second_line.split(b"=")
    assert key == b"MONOTONIC_USEC"
    assert before_usec <= int(value) <= after_usec
    notifier.close()


def test_status_is_kept_to_one_line(notify_socket):
    env_value, receiver = notify_socket
    notifier = Notifier({"NOTIFY_SOCKET": env_value})
    notifier.status("line one\nREADY=1\nline three")
    # A newline would have made "READY=1" an assignment of its own.
    assert received(receiver) == b"STATUS=line one READY=1 line three"
    notifier.close()


def test_without_notify_socket_everything_is_a_no_op(caplog):
    notifier = Notifier({})
    assert not notifier.enabled
    assert notifier.watchdog_interval_s() is None
    with caplog.at_level(logging.DEBUG, logger="wheeld.daemon.sdnotify"):
        notifier.ready("x")
        notifier.status("x")
        notifier.watchdog()
        notifier.reloading()
        notifier.stopping()
    assert notifier._socket is None  # not even a socket was opened
    assert caplog.records == []


def test_a_vanished_socket_does_not_raise_and_is_logged_once(tmp_path, caplog):
    address = str(tmp_path / "notify")
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(address)
    receiver.settimeout(RECEIVE_TIMEOUT_S)
    notifier = Notifier({"NOTIFY_SOCKET": address})
    notifier.ready()
    assert receiver.recv(4096) == b"READY=1"

    receiver.close()
    os.unlink(address)  # systemd went away
    with caplog.at_level(logging.WARNING, logger="wheeld.daemon.sdnotify"):
        for _ in range(3):
            notifier.watchdog()
            notifier.status("still here")
    warnings = [record for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "failed" in warnings[0].getMessage()

    # It comes back: messages flow again, and the next outage is reported again.
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(address)
    receiver.settimeout(RECEIVE_TIMEOUT_S)
    notifier.watchdog()
    assert receiver.recv(4096) == b"WATCHDOG=1"
    receiver.close()
    os.unlink(address)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="wheeld.daemon.sdnotify"):
        notifier.watchdog()
    assert len(caplog.records) == 1
    notifier.close()


def test_a_socket_that_never_existed_does_not_raise(tmp_path):
    notifier = Notifier({"NOTIFY_SOCKET": str(tmp_path / "absent")})
    notifier.ready()
    notifier.stopping()
    abstract = Notifier({"NOTIFY_SOCKET": f"@wheeld-test-{os.getpid()}-{uuid.uuid4().hex}-absent"})
    abstract.watchdog()
    notifier.close()
    abstract.close()


def test_an_unsupported_address_disables_notifications():
    assert not Notifier({"NOTIFY_SOCKET": "vsock:2:1234"}).enabled
    assert not Notifier({"NOTIFY_SOCKET": "relative/path"}).enabled


@pytest.mark.parametrize(
    ("environment", "interval_s"),
    [
        ({"WATCHDOG_USEC": "10000000"}, 5.0),
        ({"WATCHDOG_USEC": "10000000", "WATCHDOG_PID": str(os.getpid())}, 5.0),
        ({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": str(os.getpid() + 1)}, None),  # someone else's
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "ten"}, None),
        ({"WATCHDOG_USEC": "10000000", "WATCHDOG_PID": "me"}, None),
        ({}, None),
    ],
)
def test_watchdog_interval_is_half_of_watchdog_sec_and_only_for_us(environment, interval_s):
    notifier = Notifier({"NOTIFY_SOCKET": "/run/systemd/notify", **environment})
    assert notifier.watchdog_interval_s() == interval_s


def test_unset_environment_removes_the_variables():
    environment = {"NOTIFY_SOCKET": "/run/systemd/notify", "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": str(os.getpid()),
                   "PATH": "/bin"}
    notifier = Notifier(environment, unset_environment=True)
    assert notifier.enabled and notifier.watchdog_interval_s() == 0.5
    assert environment == {"PATH": "/bin"}


# --- socket activation ---------------------------------------------------

def test_listen_fds_without_activation_returns_nothing():
    assert listen_fds({}) == []


def test_listen_fds_for_another_pid_are_ignored_and_unset():
    environment = {"LISTEN_PID": str(os.getpid() + 1), "LISTEN_FDS": "1", "LISTEN_FDNAMES": "wheeld", "HOME": "/"}
    assert listen_fds(environment) == []
    assert environment == {"HOME": "/"}


@pytest.mark.parametrize("count", ["one", "-1"])
def test_listen_fds_rejects_a_broken_environment(count):
    with pytest.raises(WheeldError, match="LISTEN_FDS"):
        listen_fds({"LISTEN_PID": str(os.getpid()), "LISTEN_FDS": count})


# The child: ``sh`` sets LISTEN_PID to its own pid and execs Python, which
# keeps that pid. The first statement stands in for systemd, which places the
# socket at fd 3 before exec; subprocess's pass_fds keeps the parent's number.
CHILD_PROGRAM = textwrap.dedent(
    """
    import json, os, socket, sys
    passed_fd = int(sys.argv[1])
    os.dup2(passed_fd, 3)
    os.close(passed_fd)

    from wheeld.daemon.activation import listen_fds, unix_stream_listener
    inherited = listen_fds()
    report = {
        "pid_matches": os.environ.get("WHEELD_TEST_SHELL_PID") == str(os.getpid()),
        "left_in_environment": sorted(k for k in os.environ if k.startswith("LISTEN_")),
        "inherited": [
            [entry.fd, entry.name, entry.socket.family == socket.AF_UNIX,
             entry.socket.type == socket.SOCK_STREAM, os.get_inheritable(entry.fd)]
            for entry in inherited
        ],
    }
    listener = unix_stream_listener(inherited, path=sys.argv[2])
    print(json.dumps(report), flush=True)
    if listener is not None:
        listener.settimeout(10)
        connection, _ = listener.accept()
        connection.sendall(b"accepted by " + str(os.getpid()).encode() + b": " + connection.recv(64))
        connection.close()
    """
)


def spawn_activated_child(listening: socket.socket, socket_path: str, listen_pid: str) -> subprocess.Popen:
    wrapper = (
        f'WHEELD_TEST_SHELL_PID=$$ LISTEN_PID={listen_pid} LISTEN_FDS=1 LISTEN_FDNAMES=wheeld '
        'exec "$0" -c "$1" "$2" "$3"'
    )
    return subprocess.Popen(
        ["sh", "-c", wrapper, sys.executable, CHILD_PROGRAM, str(listening.fileno()), socket_path],
        pass_fds=(listening.fileno(),),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def stop(child: subprocess.Popen) -> tuple[bytes, bytes]:
    try:
        return child.communicate(timeout=10)
    finally:
        if child.poll() is None:
            os.kill(child.pid, 9)
            child.wait()


def test_activated_child_takes_the_socket_and_accepts_through_it(tmp_path):
    socket_path = str(tmp_path / "wheeld.sock")
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listening.bind(socket_path)
    listening.listen()
    child = spawn_activated_child(listening, socket_path, listen_pid="$$")
    try:
        listening.close()  # from now on only the child holds the listening socket
        report = json.loads(child.stdout.readline())
        assert report == {
            "pid_matches": True,
            "left_in_environment": [],
            # fd 3, named by FileDescriptorName=, a Unix stream socket, close-on-exec
            "inherited": [[3, "wheeld", True, True, False]],
        }
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.settimeout(10)
        client.connect(socket_path)
        client.sendall(b"hello")
        assert client.recv(128) == f"accepted by {child.pid}: hello".encode()
        client.close()
    finally:
        _, stderr = stop(child)
    assert child.returncode == 0, stderr.decode()


def test_a_child_that_is_not_listen_pid_does_not_take_the_socket(tmp_path):
    socket_path = str(tmp_path / "wheeld.sock")
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listening.bind(socket_path)
    listening.listen()
    try:
        # LISTEN_PID names this test process: the child merely inherited it.
        child = spawn_activated_child(listening, socket_path, listen_pid=str(os.getpid()))
        stdout, stderr = stop(child)
    finally:
        listening.close()
    assert child.returncode == 0, stderr.decode()
    report = json.loads(stdout)
    assert report["inherited"] == []
    assert report["left_in_environment"] == []


def test_unix_stream_listener_prefers_the_named_socket_and_skips_others(tmp_path):
    from wheeld.daemon.activation import InheritedFd

    datagram = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    not_listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    first = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    first.bind(str(tmp_path / "first.sock"))
    first.listen()
    named = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    named.bind(str(tmp_path / "named.sock"))
    named.listen()
    sockets = [datagram, not_listening, first, named]
    try:
        entries = [
            InheritedFd(datagram.fileno(), "wheeld", datagram),
            InheritedFd(not_listening.fileno(), "wheeld", not_listening),
            InheritedFd(first.fileno(), "other", first),
            InheritedFd(named.fileno(), "wheeld", named),
            InheritedFd(99, "fifo", None),
        ]
        assert unix_stream_listener(entries) is named
        assert unix_stream_listener(entries, name="absent") is first
        assert unix_stream_listener(entries[:2]) is None
    finally:
        for sock in sockets:
            sock.close()
