"""The client library and the purgatory in a process that already holds 5,000 descriptors.

``select.select`` refuses descriptors at or above FD_SETSIZE (1024): a server with
thousands of sockets open that then connects to wheeld got ``ValueError:
filedescriptor out of range in select()`` from ``flush``/``poll``, and the
purgatory's expiration thread could not wait on its socket. Every wait in the
client library and the purgatory now uses ``poll(2)``; this test puts the
client's socket above 5,000 and runs each call through a real daemon.
"""

from __future__ import annotations

import asyncio
import os
import resource
import threading
import time

import pytest
from daemon_harness import wait_until_async
import wheeld
from wheeld.purgatory import AsyncPurgatory, DelayedOperation, Purgatory

HELD = 5000


@pytest.fixture
def many_fds():
    """Raise RLIMIT_NOFILE if needed, open 5,000 descriptors; restore both afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = HELD + 1024
    if soft < want:
        if hard != resource.RLIM_INFINITY and hard < want:
            pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {want} and it cannot be raised here")
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    fds = []
    try:
        for _ in range(HELD):
            fds.append(os.open(os.devnull, os.O_RDONLY))
        assert max(fds) >= HELD
        yield fds
    finally:
        for fd in fds:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


class Op(DelayedOperation):
    def __init__(self, delay_ms: int) -> None:
        super().__init__(delay_ms)
        self.ready = False
        self.done = threading.Event()
        self.started_ns = time.monotonic_ns()
        self.completed_ns = 0

    def try_complete(self) -> bool:
        return self.ready and self.force_complete()

    def on_complete(self) -> None:
        self.completed_ns = time.monotonic_ns()
        self.done.set()


def test_sync_client_and_purgatory_above_fd_setsize(daemon, many_fds):
    with wheeld.connect(daemon.socket_path, group="many-fds") as w:
        assert w._sock.fileno() > HELD  # the client's socket is far above FD_SETSIZE
        start_ns = time.monotonic_ns()
        w.add("a", 20)
        w.add_idle("b", 30)
        w.flush()  # waited on the socket: poll(2)
        got = {}
        end = time.monotonic() + 10
        while len(got) < 2 and time.monotonic() < end:
            for expired in w.poll(timeout_s=1.0):
                got[expired.key] = time.monotonic_ns()
        assert set(got) == {"a", "b"}
        assert got["a"] - start_ns >= 20_000_000 and got["b"] - start_ns >= 30_000_000

    p = Purgatory.connect("many-fds", daemon.socket_path)
    try:
        assert p.client._sock.fileno() > HELD
        timing_out, completing = Op(40), Op(60_000)
        assert p.try_complete_else_watch(timing_out, ["k"]) is False
        assert p.try_complete_else_watch(completing, ["k"]) is False
        completing.ready = True
        assert p.check_and_complete("k") == 1
        assert timing_out.done.wait(10), "the expiration thread never delivered the timeout"
        assert timing_out.expired and timing_out.error is None
        assert timing_out.completed_ns - timing_out.started_ns >= 40_000_000
        assert p._clock._backoff.total_failures == 0  # its wait never failed
    finally:
        p.close()


def test_async_client_and_purgatory_above_fd_setsize(daemon, many_fds):
    async def main():
        p = await AsyncPurgatory.connect("many-fds-async", daemon.socket_path)
        try:
            assert p.client._sock.fileno() > HELD
            op = Op(30)
            p.try_complete_else_watch(op, ["k"])
            await wait_until_async(lambda: op.done.is_set(), 10, "the operation to expire")
            assert op.expired and op.error is None
        finally:
            await p.aclose()

    asyncio.run(main())
