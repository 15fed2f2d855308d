"""The clocks every part of wheeld reads, defined once.

* **The arena's clock**: ``CLOCK_MONOTONIC`` in whole milliseconds, rounded down
  (:func:`mono_ms`). Every process of a host shares it; the wheel, the rings and
  the status page count in it. The daemon fires a timer once this clock reaches
  its deadline.
* **A client's deadlines** are taken from the same clock rounded *up*
  (:func:`ceil_ms`): ``ceil_ms() + delay_ms`` is never early in real time, since the
  daemon's floored clock reaches it no sooner than ``delay_ms`` after the call.
* **The journal** stores wall-clock ms (:func:`wall_ms`), which survive a reboot.

The daemon's decisions read time only through the clock its host gives it
(:class:`wheeld.daemon.host.Host`, whose real clocks are these functions); a
simulation passes clocks of its own, so these are the only definitions.
"""

from __future__ import annotations

import time

__all__ = ["mono_ns", "mono_ms", "ceil_ms", "wall_ms", "wall_ns"]

def mono_ns() -> int:
    """``CLOCK_MONOTONIC`` in ns."""
    return time.monotonic_ns()


def mono_ms() -> int:
    """``CLOCK_MONOTONIC`` in ms, rounded down: the arena's clock."""
    return time.monotonic_ns() // 1_000_000


def ceil_ms() -> int:
    """``CLOCK_MONOTONIC`` in ms, rounded up: a deadline ``ceil_ms() + delay_ms`` is never
    early in real time (see the module docstring). A touch stores it for the same reason."""
    return -(-time.monotonic_ns() // 1_000_000)


def wall_ns() -> int:
    """Wall-clock ns (``CLOCK_REALTIME``)."""
    return time.time_ns()


def wall_ms() -> int:
    """Wall-clock ms (``CLOCK_REALTIME``), rounded down: what the journal stores."""
    return time.time_ns() // 1_000_000
