"""An asyncio event loop whose time is the simulated clock, stepped by the simulator.

The fleet tier (:mod:`wheeld.fleet`) is asyncio code: the replicator's tasks, the
adopter's, the NATS client's requests and their timeouts. :class:`SimLoop` runs that
real code in the simulated world, one loop per simulated daemon process:

* ``time()`` is the world's clock (``clock_ns() / 1e9``): ``asyncio.sleep``,
  ``call_later`` and ``wait_for`` timeouts are simulated time;
* nothing blocks and nothing polls a file descriptor: the selector returns at once, and
  what wakes a task is a future set by the simulated network (:mod:`sim.nats`) or by
  the daemon core (the replicator's wake-up event);
* the simulator calls :meth:`SimLoop.run_ready` after each of the world's events: every
  callback that is ready, and every timer that is due now, runs (and what they make
  ready in turn), then :meth:`SimLoop.next_ns` says when the next timer is due, for
  the simulator to queue an event then. A paused process is a loop not run.

Deterministic: callbacks run in the order asyncio runs them (ready ones first, then the
due timers by deadline), and the clock moves only between the world's events.
"""

from __future__ import annotations

import asyncio
import asyncio.events
import heapq
import math
from collections.abc import Callable
from typing import Any

__all__ = ["SimLoop"]

_MAX_ROUNDS = 100_000  # rounds of one run_ready: more means a task that never waits


class _NoSelector:
    """What BaseEventLoop._run_once polls: nothing, at once."""

    @staticmethod
    def select(timeout: float | None = None) -> list:
        return []

    @staticmethod
    def close() -> None:
        pass


class SimLoop(asyncio.BaseEventLoop):
    """See the module docstring. ``clock_ns``: the world's clock."""

    def __init__(self, clock_ns: Callable[[], int]):
        super().__init__()
        self._clock_ns = clock_ns
        self._selector = _NoSelector()
        self.errors: list[dict[str, Any]] = []  # what reached the exception handler (a task's error nobody read)
        self.set_exception_handler(lambda loop, context: self.errors.append(context))

    def time(self) -> float:
        return self._clock_ns() / 1e9

    def _process_events(self, event_list) -> None:
        pass

    def _write_to_self(self) -> None:
        pass

    def run_in_executor(self, executor, func, *args) -> asyncio.Future:
        """``func(*args)`` at once, in this thread: no real thread ever runs in the
        simulated world (its timing would not be the seed's)."""
        future = self.create_future()
        try:
            future.set_result(func(*args))
        except BaseException as exc:  # as a worker thread's future would hold it
            future.set_exception(exc)
        return future

    # ------------------------------------------------------------------ stepping
    def _due(self) -> bool:
        scheduled = self._scheduled
        while scheduled and scheduled[0]._cancelled:
            self._timer_cancelled_count -= 1
            scheduled[0]._scheduled = False
            heapq.heappop(scheduled)
        return bool(scheduled) and scheduled[0]._when < self.time() + self._clock_resolution

    def busy(self) -> bool:
        """Whether something is ready or due now."""
        return bool(self._ready) or self._due()

    def run_ready(self) -> int:
        """Run what is ready and due now, until nothing is; returns the rounds run."""
        previous = asyncio.events._get_running_loop()
        asyncio.events._set_running_loop(self)
        rounds = 0
        try:
            while self._ready or self._due():
                self._run_once()
                rounds += 1
                if rounds > _MAX_ROUNDS:
                    raise RuntimeError("a task of the simulated loop runs without ever waiting")
        finally:
            asyncio.events._set_running_loop(previous)
        return rounds

    def call(self, fn: Callable, *args) -> Any:
        """``fn(*args)`` as if called from a callback of this loop (tasks it creates are this
        loop's); what it makes ready runs at the next :meth:`run_ready`."""
        previous = asyncio.events._get_running_loop()
        asyncio.events._set_running_loop(self)
        try:
            return fn(*args)
        finally:
            asyncio.events._set_running_loop(previous)

    def next_ns(self) -> int | None:
        """When the earliest timer is due (the world's ns), None when none is scheduled."""
        self._due()
        if not self._scheduled:
            return None
        return math.ceil(self._scheduled[0]._when * 1e9)

    def drop(self) -> None:
        """The process died: nothing of this loop runs again (its tasks are not cancelled:
        a SIGKILL runs no ``finally``)."""
        self._ready.clear()
        self._scheduled.clear()


def run_world(world, loops: list[SimLoop], until_ns: int, check: Callable[[], None] | None = None,
              every_ns: int = 0, done: Callable[[], bool] | None = None) -> None:
    """Run ``world``'s events and ``loops`` together up to ``until_ns``, or until ``done()`` (a
    test's driver: the fleet's simulation schedules the loops as world events itself).
    ``check()`` runs after each step, and every ``every_ns`` of simulated time when given."""
    if every_ns:
        at = world.now_ns
        while at < until_ns:
            at += every_ns
            world.at(at, lambda: None)
    while True:
        for loop in loops:
            loop.run_ready()
        if check is not None:
            check()
        if done is not None and done():
            return
        times = [t for t in [world.next_time(), *(loop.next_ns() for loop in loops)] if t is not None]
        if not times or min(times) > until_ns:
            world.now_ns = max(world.now_ns, until_ns)
            return
        world.now_ns = max(world.now_ns, min(times))
        if world.next_time() is not None and world.next_time() <= world.now_ns:
            world.step()
