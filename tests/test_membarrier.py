"""The doorbell's eventcount with the fence paid by the daemon (wheeld.shm.membarrier).

Where the kernel offers ``membarrier(MEMBARRIER_CMD_GLOBAL_EXPEDITED)``, the daemon
issues it at every park, says so in its status page, and a client registered for it
skips its own fence after a push. Checked here: the page's word follows what the
daemon's host offers; every park issues the barrier exactly once; a barrier the
kernel refuses later falls back to the fence and clears the word; a client drops its
fence only when the page says so; and, end to end, pushes racing the daemon's parks
are never left asleep.
"""

from __future__ import annotations

import dataclasses
import os
import random
import time

import pytest

import wheeld
from daemon_harness import unique_name, unlink_segments
from wheeld.core import ClientCore
from wheeld.daemon.config import Config
from wheeld.daemon.core import DaemonCore
from wheeld.daemon.host import real_host
from wheeld.protocol import messages as M
from wheeld.protocol import status_layout as SL
from wheeld.shm import membarrier
from wheeld.shm.ring import ClientSegment
from wheeld.shm.status import StatusPage
from test_daemon_clock import FakeClock, QuietShell

needs_membarrier = pytest.mark.skipif(not membarrier.supported(),
                                      reason="this kernel (or its seccomp profile) refuses membarrier")


@needs_membarrier
def test_the_kernel_registers_a_process_and_issues_the_barrier():
    assert membarrier.register() and membarrier.register()  # once per process: the second is free
    membarrier.barrier()
    assert membarrier.daemon_barrier() is membarrier.barrier


@pytest.fixture
def core_with(tmp_path):
    """An open daemon core (no socket, no loop) on a fake clock, with the given barrier."""
    made: list[DaemonCore] = []

    def make(barrier) -> DaemonCore:
        name = unique_name()
        config = Config(socket_path=str(tmp_path / f"{name}.sock"), name=name, capacity=1000)
        host = dataclasses.replace(real_host(FakeClock(10_000_000)), barrier=barrier)
        core = DaemonCore(config, host, QuietShell())
        made.append(core)
        core.acquire()
        core.open()
        return core

    try:
        yield make
    finally:
        for core in made:
            if core.lock is not None:
                core.lock.release()
            unlink_segments(core.config.name)


def _park(core: DaemonCore) -> None:
    assert core.park() is not None  # nothing due and nothing pushed: it sleeps
    core.unpark()


def test_every_park_issues_the_hosts_barrier_once_and_the_page_says_so(core_with):
    calls = []
    core = core_with(lambda: calls.append(1))
    assert core.status.barrier and core.status.words[SL.BARRIER_WORD] == 1
    for n in range(1, 4):
        _park(core)
        assert len(calls) == n


def test_a_park_that_ends_within_the_coalescing_window_needs_no_barrier(core_with):
    """No client rings into such a park (its quiet_from is past): the barrier would buy nothing."""
    calls = []
    core = core_with(lambda: calls.append(1))
    clock = core.clock
    gid = core.wheel.group_id("g")
    core.wheel.schedule("soon", clock.ms + 1, gid)  # a 1 ms park: within the 1000 us window
    assert core.park() == (clock.ms + 1) * 1_000_000
    core.unpark()
    assert calls == [] and core.status.words[SL.QUIET_FROM_WORD] <= clock.ms * 1_000_000
    assert core.wheel.cancel("soon", gid)
    core.wheel.schedule("later", clock.ms + 5, gid)  # a 5 ms park: a client may ring into it
    assert core.park() == (clock.ms + 5) * 1_000_000
    core.unpark()
    assert calls == [1]


def test_without_a_barrier_the_daemon_fences_and_the_page_tells_clients_to(core_with):
    core = core_with(None)
    assert not core.status.barrier and core.status.words[SL.BARRIER_WORD] == 0
    _park(core)  # the fence of its own: no barrier to call


def test_a_barrier_refused_later_falls_back_to_the_fence_and_clears_the_word(core_with, caplog):
    calls = []

    def refused() -> None:
        calls.append(1)
        raise OSError(1, "membarrier(GLOBAL_EXPEDITED): Operation not permitted")

    core = core_with(refused)
    assert core.status.barrier
    _park(core)
    assert len(calls) == 1 and not core.status.barrier
    assert "membarrier failed" in caplog.text
    _park(core)
    assert len(calls) == 1  # not asked again


class _PageClient(ClientCore):
    """The client state machine on a ring and a status page made here (no daemon)."""

    def __init__(self):
        super().__init__("/nonexistent/wheeld.sock", "membarrier", 5.0, 30.0, "membarrier")
        self.doorbells = 0

    def _ring_doorbell(self, urgent: bool = True) -> None:
        self.doorbells += 1


@pytest.mark.parametrize("barrier", [False, True])
def test_a_client_skips_its_fence_only_when_the_page_says_the_daemon_fences_for_it(barrier):
    name = f"wheeld-test-membarrier-{os.getpid()}-{int(barrier)}"
    ring = ClientSegment.create(name, 1024, 64)
    status = StatusPage.create(name + "-status", barrier=barrier)
    client = _PageClient()
    try:
        status.publish(1 << 40, 0, 0)
        welcome = M.Welcome(M.PROTOCOL_VERSION, 1, name, 1024, 64, "membarrier", 1, 1 << 40, arena_epoch=1,
                            status_page=True)
        client._on_welcome(welcome, [os.dup(ring.fd), os.dup(status.readonly_fd)])
        assert client._fenceless == (barrier and membarrier.supported())
        # fenceless or not, a push into a new park rings once, and not again in the same park
        status.words[SL.PARKED_WORD] = 5
        client.add("a", 60_000)
        client.cancel("a")
        assert client.doorbells == 1
        status.words[SL.PARKED_WORD] = 6
        client.add("b", 60_000)
        assert client.doorbells == 2
        assert len(ring.drain()) == 3
        client._release_local()
        assert not client._fenceless
    finally:
        client._release_local()
        status.close()
        ring.close()


def test_a_connected_client_is_fenceless_where_the_kernel_allows(daemon):
    with wheeld.connect(daemon.socket_path, group="membarrier") as w:
        w.flush()
        assert w._status.barrier == membarrier.supported()
        assert w._fenceless == membarrier.supported()


def test_pushes_racing_the_daemons_parks_are_never_left_asleep(daemon):
    """A timer due at once, pushed at random moments around the daemon's park (nothing else
    pending: a missed doorbell would leave it until the park's 500 ms end). Every one comes
    back within a fraction of that."""
    rng = random.Random(20261129)
    worst_ms = 0.0
    with wheeld.connect(daemon.socket_path, group="membarrier-race") as w:
        w.flush()
        for i in range(400):
            spin_until = time.perf_counter() + rng.choice((0.0, 0.00002, 0.0001, 0.0003, 0.001))
            while time.perf_counter() < spin_until:
                pass
            began = time.perf_counter()
            w.add(f"race-{i}", 0)
            got = []
            while not got and time.perf_counter() - began < 2.0:
                got = w.poll(0.5)
            assert [e.key for e in got] == [f"race-{i}"]
            worst_ms = max(worst_ms, (time.perf_counter() - began) * 1000)
    assert worst_ms < 250, f"a push waited {worst_ms:.0f} ms: the daemon slept through it"
