"""A client that cannot be misused silently: fork, connecting to nothing, errors that
escape the hierarchy, keys and delays at the edge of what the daemon takes."""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import socket
import time

import pytest
from daemon_harness import wait_until

import wheeld
from wheeld.protocol import status_layout as SL


def collect(client, want: int, timeout_s: float = 10.0) -> list:
    got = []
    end = time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < end:
        got.extend(client.poll(0.1))
    return got


# A fork is what this test is about; the child uses nothing another thread of the test
# process (pytest's timeout, xdist) may hold, so Python 3.12's warning about fork() in a
# multi-threaded process says nothing here.
@pytest.mark.filterwarnings(
    "ignore:This process .* is multi-threaded, use of fork\\(\\) may lead to deadlocks:DeprecationWarning")
def test_a_forked_child_gets_a_clear_error_and_leaves_the_parents_session_alone(daemon):
    with wheeld.connect(daemon.socket_path, group="forked") as w:
        w.add("before", 300)
        w.add_idle("idle", 60_000)
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: every call refuses, close() sends nothing
            outcome = []
            for call in (lambda: w.add("child", 10), lambda: w.cancel("before"), lambda: w.touch("idle"),
                         lambda: w.flush(), lambda: w.poll(0)):
                try:
                    call()
                    outcome.append("accepted")
                except wheeld.ForkedClient:
                    outcome.append("forked")
                except BaseException as exc:  # noqa: BLE001 - reported to the parent
                    outcome.append(type(exc).__name__)
            w.close()
            os.write(write_end, ",".join(outcome).encode())
            os._exit(0)
        os.close(write_end)
        _, status = os.waitpid(pid, 0)
        outcome = os.read(read_end, 1000).decode().split(",")
        os.close(read_end)
        assert status == 0 and outcome == ["forked"] * 5
        w.add("after", 200)
        w.flush(timeout_s=5)  # the parent's session survived the child's close()
        got = collect(w, 2)
    assert sorted(e.key for e in got) == ["after", "before"]


def test_connecting_to_nothing_fails_fast(tmp_path):
    missing = str(tmp_path / "missing.sock")
    started = time.monotonic()
    with pytest.raises(wheeld.DaemonNotRunning):
        wheeld.connect(missing, connect_timeout_s=10)
    assert time.monotonic() - started < 1.0
    stale = str(tmp_path / "stale.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(stale)  # a socket file nobody listens on: a daemon that died
    sock.close()
    started = time.monotonic()
    with pytest.raises(wheeld.DaemonNotRunning):
        wheeld.connect(stale, connect_timeout_s=10)
    with pytest.raises(wheeld.DaemonNotRunning):
        asyncio.run(wheeld.connect_async(stale, connect_timeout_s=10))
    assert time.monotonic() - started < 1.0


def test_a_daemon_that_accepts_but_never_answers_is_a_timeout(tmp_path):
    path = str(tmp_path / "silent.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)
    try:
        started = time.monotonic()
        with pytest.raises(wheeld.Timeout):
            wheeld.connect(path, connect_timeout_s=0.5)
        assert time.monotonic() - started < 1.5
    finally:
        listener.close()


def test_every_error_the_library_raises_is_a_wheeld_error():
    for name in wheeld.__all__:
        value = getattr(wheeld, name)
        if isinstance(value, type) and issubclass(value, BaseException):
            assert issubclass(value, wheeld.WheeldError), name
    assert issubclass(wheeld.Timeout, TimeoutError)
    assert issubclass(wheeld.QuotaExceeded, wheeld.ArenaFull) and issubclass(wheeld.GroupLimit, wheeld.ArenaFull)
    assert issubclass(wheeld.ForkedClient, wheeld.Closed) and issubclass(wheeld.DaemonNotRunning, wheeld.BrokenPeer)


def test_connect_names_its_options():
    for function in (wheeld.connect, wheeld.connect_async):
        parameters = inspect.signature(function).parameters
        assert {"ring_timeout_s", "reconnect_timeout_s", "connect_timeout_s", "client_name"} <= set(parameters)
        assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


@pytest.mark.parametrize("key", ["\udc80", "a\ud800b"])
def test_a_key_that_is_not_utf8_is_an_invalid_key(daemon, key):
    with wheeld.connect(daemon.socket_path, group="keys") as w:
        for call in (lambda: w.add(key, 10), lambda: w.cancel(key), lambda: w.add_idle(key, 10)):
            with pytest.raises(wheeld.InvalidKey):
                call()
        w.flush()  # nothing reached the daemon that it would refuse


def test_the_longest_delay_the_client_accepts_is_never_refused_later(daemon):
    with wheeld.connect(daemon.socket_path, group="far") as w:
        w.add("far", w.max_delay_ms)
        w.flush()  # not InvalidRequest
        with pytest.raises(wheeld.InvalidDelay):
            w.add("too-far", w.max_delay_ms + 1)
        assert w.cancel("far")
        w.flush()


def test_add_idle_refuses_what_it_cannot_send_with_the_precise_error(daemon_factory):
    d = daemon_factory(extra=["--touch-capacity", "4"]).start()
    with wheeld.connect(d.socket_path, group="idle-edges") as w:
        for idle_ms, message in (("5", "idle_ms must be a positive int, not '5'"), (0, "not 0"), (-3, "not -3"),
                                 (1.5, "not 1.5"), (True, "not True"), ((1 << 31), "must fit in 32 bits"),
                                 (w.max_delay_ms + 1, "exceeds the daemon's maximum")):
            with pytest.raises(wheeld.InvalidDelay, match=message.replace("(", r"\(")):
                w.add_idle("k", idle_ms)
        for key in (b"", "x" * 33, 1 << 64, 2.0, None):
            with pytest.raises(wheeld.InvalidKey):
                w.add_idle(key, 1000)
        w.add_idle("longest", (1 << 31) - 1)
        for key in ("a", b"b", -7):  # every kind of key; with "longest", the four rows of the touch table
            before_ms = time.monotonic_ns() // 1_000_000  # read first: never early counts from the call
            assert w.add_idle(key, 60_000) >= before_ms + 60_000
        w.add_idle("a", 60_000)  # re-arming takes no new row
        with pytest.raises(wheeld.InvalidRequest, match="all 4 idle-timer slots of this client are in use"):
            w.add_idle("fifth", 60_000)
        w.flush()  # nothing reached the daemon that it would refuse
        assert w.cancel(b"b")
        w.add_idle("fifth", 60_000)  # the cancelled key's row
        w.flush()
        wait_until(lambda: d.counters()["pending"] == 4, 5, "longest, a, -7 and fifth pending")


def test_add_refuses_at_once_when_the_arena_is_full(daemon_factory):
    d = daemon_factory(capacity=50).start()
    with wheeld.connect(d.socket_path, group="full") as w:
        for i in range(50):
            w.add(i, 600_000)
        w.flush()
        status = w._parked
        wait_until(lambda: status[SL.PENDING_WORD] >= 50, 5,
                   "the status page to show 50 pending")  # published at the next iteration
        with pytest.raises(wheeld.ArenaFull):
            w.add("one-more", 10)
        assert w.cancel(0)
        w.flush()
        wait_until(lambda: status[SL.PENDING_WORD] < 50, 5, "the status page to show the cancel")
        w.add("one-more", 600_000)  # room again
        w.flush()


def test_a_flush_that_finds_the_daemon_gone_says_so(daemon):
    """A flush that times out tells a daemon that is gone (the connection closed, nothing
    listens) from one that is connected but silent (stopped)."""
    with wheeld.connect(daemon.socket_path, group="gone", reconnect_timeout_s=60) as w:
        w.add("a", 60_000)
        w.flush()
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            with pytest.raises(wheeld.Timeout) as silent:
                w.flush(timeout_s=0.5)
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        assert "gone" not in str(silent.value)
        w.flush()
        daemon.kill()
        with pytest.raises(wheeld.Timeout) as gone:
            w.flush(timeout_s=1.0)
    message = str(gone.value)
    assert "wheeld did not apply the commands within 1.0 s: the daemon is gone" in message, message
    assert f"no wheeld listens at {daemon.socket_path}" in message, message


def test_an_async_flush_that_finds_the_daemon_gone_says_so(daemon):
    async def scenario() -> str:
        w = await wheeld.connect_async(daemon.socket_path, group="gone", reconnect_timeout_s=60)
        try:
            w.add("a", 60_000)
            await w.flush()
            daemon.kill()
            with pytest.raises(wheeld.Timeout) as gone:
                await w.flush(timeout_s=1.0)
            return str(gone.value)
        finally:
            await w.close()

    message = asyncio.run(scenario())
    assert "wheeld did not apply the commands within 1.0 s: the daemon is gone" in message, message
    assert f"no wheeld listens at {daemon.socket_path}" in message, message
