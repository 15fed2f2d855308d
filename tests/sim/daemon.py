"""A simulated wheeld process: the real core (:class:`wheeld.daemon.core.DaemonCore`) in a
simulated world, driven the way the real shell drives it.

The shell's loop (:mod:`wheeld.daemon.server`) becomes events of the world's
queue: an iteration, then a park until the time the core names, ended early
when the core asks to be woken (a doorbell, a closed session) or when the
simulator says so. A crash drops the core object between two events (or,
inside an event, wherever a fault point raises :class:`Crash`): its shared
memory and its disk stay as the crash left them, exactly as a SIGKILL leaves
them; a restart builds a new core over the same host.
"""

from __future__ import annotations

from wheeld.daemon.config import Config
from wheeld.daemon.core import DaemonCore
from wheeld.daemon.sessions import MAINTAIN_S

__all__ = ["Crash", "SimDaemon"]

ITERATIONS_PER_WAKE = 64  # a busy loop yields to the world's other events this often


class Crash(BaseException):
    """Raised inside the core at a fault point: the process dies there."""


class _Shell:
    """The core's :class:`~wheeld.daemon.host.Shell` in the simulated world."""

    def __init__(self, daemon: SimDaemon):
        self.daemon = daemon

    def wake(self) -> None:
        self.daemon.wake_at(self.daemon.world.now_ns)

    def wake_at(self, at_ns: int) -> None:
        self.daemon.wake_at(at_ns)

    def resume_accept(self) -> None:
        pass

    def status_changed(self) -> None:
        pass


class SimDaemon:
    """One run of the daemon, from its start to its stop or crash."""

    def __init__(self, world, host, config: Config):
        self.world = world
        self.host = host
        self.config = config
        self.core = DaemonCore(config, host, _Shell(self))
        self.alive = False
        self._wake_ns: int | None = None  # the park ends then (None: not parked, or no event queued)
        self._generation = 0  # bumped by every re-scheduling: stale wake events do nothing
        self.iterations = 0
        self.guard = lambda action, *args: action(*args)  # runs each core call (a fault may strike inside)
        self.on_raise = None  # called with what a core call raised (None: re-raised)

    def start(self) -> None:
        core = self.core
        core.acquire()
        try:
            core.open()
        except BaseException:
            core.abandon()
            raise
        core.mark_ready()
        self.alive = True
        self.wake_at(self.world.now_ns)
        self.world.after_ms(MAINTAIN_S * 1000, self._maintain)

    def _maintain(self) -> None:
        """The shell's once-a-second call."""
        if not self.alive:
            return
        try:
            self.guard(self.core.maintain)
        except BaseException as exc:  # noqa: BLE001 - as in _run
            if self.on_raise is None:
                raise
            self.on_raise(exc)
            return
        self.world.after_ms(MAINTAIN_S * 1000, self._maintain)

    # ------------------------------------------------------------------ the loop, as events
    def wake_at(self, at_ns: int) -> None:
        if not self.alive:
            return
        if self._wake_ns is not None and self._wake_ns <= at_ns:
            return
        self._wake_ns = at_ns
        self._generation += 1
        generation = self._generation
        self.world.at(at_ns, lambda: self._run(generation))

    def _run(self, generation: int) -> None:
        if not self.alive or generation != self._generation:
            return
        self._wake_ns = None
        try:
            self.guard(self._loop)
        except BaseException as exc:  # noqa: BLE001 - the simulator judges it (a crash fault, or a finding)
            if self.on_raise is None:
                raise
            self.on_raise(exc)

    def _loop(self) -> None:
        core = self.core
        if core._parked:
            core.unpark()
        for _ in range(ITERATIONS_PER_WAKE):
            self.iterations += 1
            again = core.iterate()
            if core.stopping:
                return
            if again:
                continue
            wake_ns = core.park()
            if wake_ns is None:
                continue
            self.wake_at(wake_ns)
            return
        self.wake_at(self.world.now_ns)  # still busy: let the world's other events in first

    # ------------------------------------------------------------------ the end
    def crash(self) -> None:
        """SIGKILL: nothing more runs; shared memory and the disk stay as they are."""
        self.alive = False
        self._generation += 1

    def stop(self) -> None:
        """SIGTERM: the core shuts down cleanly."""
        if not self.alive:
            return
        self.core.stop()
        self.core.shutdown()
        self.alive = False
        self._generation += 1
