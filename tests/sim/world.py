"""The simulated world: one clock, one queue of events, one random generator.

Everything a simulated run does happens here, in one thread, in the order of
this queue: a client's call, bytes reaching the other end of a connection, the
daemon waking from its park, a crash, a reboot, a disk fault. Time is a number
(``now_ns``) that jumps from one event to the next, so hours of timer time take
as long as the work done in them. Every random choice comes from ``rng``
(``random.Random(seed)``), and events at the same instant run in the order they
were scheduled: one seed is one history, replayed exactly.
"""

from __future__ import annotations

import heapq
import random
from typing import Callable

__all__ = ["World", "SimRandom", "SimUsers"]

START_NS = 1_000_000_000_000  # the simulated CLOCK_MONOTONIC at the start (about 17 minutes after boot)


class World:
    """The clock and the event queue of a simulated run (see the module docstring)."""

    def __init__(self, seed: int):
        self.seed = seed
        self.rng = random.Random(seed)
        self.now_ns = START_NS
        self.wall_offset_ms = 1_780_000_000_000 - START_NS // 1_000_000  # wall clock = monotonic + offset
        self._queue: list[tuple[int, int, Callable[[], None]]] = []
        self._seq = 0
        self.events_run = 0

    # ------------------------------------------------------------------ clocks (the host's)
    def clock_ns(self) -> int:
        return self.now_ns

    def clock_ms(self) -> int:
        return self.now_ns // 1_000_000

    def wall_ms(self) -> int:
        return self.now_ns // 1_000_000 + self.wall_offset_ms

    # ------------------------------------------------------------------ events
    def at(self, when_ns: int, action: Callable[[], None]) -> None:
        """Run ``action`` at ``when_ns`` (at once, after what is queued for now, if in the past)."""
        self._seq += 1
        now = self.now_ns
        heapq.heappush(self._queue, (when_ns if when_ns > now else now, self._seq, action))

    def soon(self, action: Callable[[], None]) -> None:
        self.at(self.now_ns, action)

    def after_ms(self, ms: float, action: Callable[[], None]) -> None:
        self.at(self.now_ns + int(ms * 1_000_000), action)

    def next_time(self) -> int | None:
        return self._queue[0][0] if self._queue else None

    def stop(self) -> None:
        """Drop every scheduled event: the run ends (a finding that leaves nothing to wait for)."""
        self._queue.clear()

    def step(self) -> bool:
        """Run the next event (the clock moves to its time); False when none is left."""
        if not self._queue:
            return False
        when, _seq, action = heapq.heappop(self._queue)
        if when > self.now_ns:
            self.now_ns = when
        self.events_run += 1
        action()
        return True

    def run_until(self, until_ns: int, stop: Callable[[], bool] | None = None) -> None:
        """Run events up to ``until_ns`` (the clock ends there), or until ``stop()`` says so."""
        while self._queue and self._queue[0][0] <= until_ns:
            self.step()
            if stop is not None and stop():
                return
        self.now_ns = max(self.now_ns, until_ns)


class SimRandom:
    """The host's randomness (labels, the instance secret) from the run's generator."""

    def __init__(self, rng: random.Random):
        self._rng = rng

    def token_bytes(self, n: int = 32) -> bytes:
        return self._rng.getrandbits(8 * n).to_bytes(n, "little")

    def token_hex(self, n: int = 32) -> str:
        return self.token_bytes(n).hex()


class SimUsers:
    """A user database: uid -> its groups (``groups``), the primary gid added."""

    def __init__(self, groups: dict[int, frozenset[int]] | None = None):
        self.groups = groups or {}

    def groups_of(self, uid: int, primary_gid: int) -> frozenset[int]:
        return self.groups.get(uid, frozenset()) | {primary_gid}
