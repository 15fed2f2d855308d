"""Where a timer goes: the one placement rule of the wheel (``bucket_for``).

Level *L* has ``wheel_size`` buckets of ``tick(L) = tick_ms * wheel_size ** L``
ms each. A deadline ``d`` has, at level *L*, the bucket number::

    v = ceil(d / tick(0))      at level 0 (rounded up: nothing fires early)
    v = d // tick(L)           at the higher levels (their buckets cascade)

and that bucket is within the level's reach from the clock ``c`` when::

    v - c // tick(0) <= wheel_size       at level 0
    v - c // tick(L) <  wheel_size       at the higher levels

A deadline ``d <= c`` goes to the due list; otherwise to the lowest level whose
reach holds it, bucket ``v % wheel_size`` with expiration ``v * tick(L)`` (always
after ``c``); beyond the top level, into the top level's farthest bucket
(``v = c // tick(top) + wheel_size - 1``), to be placed again when it comes due.
The module docstring of :mod:`wheeld.shm.wheel` explains why level 0 reaches
one bucket further than the others.

:meth:`Placement.level_value` is that rule at one level, for an int or a numpy
array; :meth:`Placement.bucket_for` (one deadline, the wheel's scalar paths),
:meth:`Placement.buckets_for` (arrays, the batch paths and the rebuild) and the
invariant checker (:mod:`wheeld.shm.fsck`, which checks that every record sits
where its deadline maps to at its bucket's level) all use it.
"""

from __future__ import annotations

from array import array

import numpy as np

from wheeld.protocol import arena_layout as L

__all__ = ["Placement"]

#: :meth:`Placement.place` computes in 64-bit integers when the clock and the deadline
#: are within this of 0 and the top level's interval is at most half of it: then no
#: sum or product it forms leaves the 64-bit range
_EXACT_RANGE = 1 << 62
_DUE_LEVEL = L.DUE_LEVEL
_COMPILED = not __file__.endswith(".py")


class Placement:
    """The placement rule of one wheel's geometry. Sentinels are numbered as in the arena:
    level *L*'s bucket *j* is ``L * wheel_size + j``, the due list ``levels * wheel_size``."""

    def __init__(self, tick_ms: int, wheel_size: int, levels: int) -> None:
        self.tick_ms = tick_ms
        self.wheel_size = wheel_size
        self.levels = levels
        self.due_list = levels * wheel_size
        self.ticks = [tick_ms * wheel_size**level for level in range(levels)]
        # per level: (level, tick, what to add before dividing (rounds level 0 up), reach)
        self._rules = [(level, t, t - 1 if level == 0 else 0, wheel_size if level == 0 else wheel_size - 1)
                       for level, t in enumerate(self.ticks)]
        self._top = self._rules[-1]
        # the rule as arrays of 64-bit ints, for :meth:`place`
        self.exact = self.ticks[-1] * wheel_size <= _EXACT_RANGE // 2
        self._ws = wheel_size
        self._due = self.due_list
        self._n = levels
        self._tk = memoryview(array("q", self.ticks if self.exact else [1] * levels))
        self._up = memoryview(array("q", [rule[2] if self.exact else 0 for rule in self._rules]))
        self._reach = memoryview(array("q", [rule[3] for rule in self._rules]))

    def level_value(self, deadline, clock, level: int):
        """``(v, fits)`` at ``level``: the bucket number of ``deadline`` (expiration ``v * tick``)
        and whether it is within the level's reach from ``clock``. Ints or numpy arrays."""
        _level, t, up, reach = self._rules[level]
        v = (deadline + up) // t
        return v, v - clock // t <= reach

    def bucket_for(self, deadline: int, clock: int) -> tuple[int, int, int]:
        """``(sentinel, bucket expiration, level)`` of one deadline; the due list has
        expiration ``clock`` and level :data:`~wheeld.protocol.arena_layout.DUE_LEVEL`."""
        if self.exact and -_EXACT_RANGE <= clock <= _EXACT_RANGE and -_EXACT_RANGE <= deadline <= _EXACT_RANGE:
            return self.place(deadline, clock)
        return self._bucket_any(deadline, clock)

    def place(self, deadline: int, clock: int) -> tuple[int, int, int]:
        """:meth:`bucket_for` of a deadline and a clock that are 64-bit integers, with results
        that are (the wheel's scalar paths: it stores them in 64-bit fields)."""
        if not (self.exact and -_EXACT_RANGE <= clock <= _EXACT_RANGE and -_EXACT_RANGE <= deadline <= _EXACT_RANGE):
            return self._bucket_any(deadline, clock)
        if deadline <= clock:
            return self._due, clock, _DUE_LEVEL
        ws = self._ws
        tk, up, reach = self._tk, self._up, self._reach
        for level in range(self._n):  # level_value, written out in 64-bit C integers (compiled)
            t = tk[level]
            v = (deadline + up[level]) // t
            if v - clock // t <= reach[level]:
                return level * ws + v % ws, v * t, level
        return self._farthest(clock)

    def _bucket_any(self, deadline: int, clock: int) -> tuple[int, int, int]:
        """:meth:`bucket_for` of any integers."""
        if deadline <= clock:
            return self.due_list, clock, L.DUE_LEVEL
        ws = self.wheel_size
        for level, t, _up, _reach in self._rules:
            v, fits = self.level_value(deadline, clock, level)
            if fits:
                return level * ws + v % ws, v * t, level
        return self._farthest(clock)

    def _farthest(self, clock: int) -> tuple[int, int, int]:
        """A deadline beyond the top level's reach: the top level's farthest bucket."""
        level, t, _up, _reach = self._top
        v = clock // t + self.wheel_size - 1
        return level * self.wheel_size + v % self.wheel_size, v * t, level

    def buckets_for(self, deadlines: np.ndarray, clock: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`bucket_for` of every deadline: int64 arrays (sentinel, expiration, level).

        Level by level over the deadlines not placed yet (a batch usually fits one
        or two levels): each takes the lowest level whose reach holds it.
        """
        n = deadlines.size
        buckets = np.empty(n, dtype=np.int64)
        expirations = np.empty(n, dtype=np.int64)
        levels = np.empty(n, dtype=np.int64)
        rest = np.flatnonzero(deadlines > clock)
        if rest.size < n:
            due = np.flatnonzero(deadlines <= clock)
            buckets[due], expirations[due], levels[due] = self.due_list, clock, L.DUE_LEVEL
            left = deadlines[rest]
        else:
            rest, left = None, deadlines  # every item: no index arrays
        for level, t, _up, _reach in self._rules:
            if not left.size:
                break
            v, fit = self.level_value(left, clock, level)
            if level == self.levels - 1:
                v[~fit] = clock // t + self.wheel_size - 1  # clamp into the farthest bucket of the top level
            elif not fit.all():
                where = np.flatnonzero(fit)
                self._store(buckets, expirations, levels, where if rest is None else rest[where], v[where], level)
                keep = np.flatnonzero(~fit)
                rest = keep if rest is None else rest[keep]
                left = left[keep]
                continue
            self._store(buckets, expirations, levels, slice(None) if rest is None else rest, v, level)
            break
        return buckets, expirations, levels

    def _store(self, buckets, expirations, levels, at, v: np.ndarray, level: int) -> None:
        buckets[at] = level * self.wheel_size + v % self.wheel_size
        expirations[at] = v * self.ticks[level]
        levels[at] = level


if not _COMPILED:
    # The Python path: Python ints cannot overflow, so the rule needs neither place's
    # 64-bit range check nor its arrays (the interpreter reads the rule tuples faster);
    # _bucket_any gives the same answers for every int.
    Placement.place = Placement.bucket_for = Placement._bucket_any
