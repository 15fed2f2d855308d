"""What the client libraries' background threads and tasks do when something keeps failing.

The daemon-backed purgatory reads expirations in a thread (asyncio: a task), the
idle tracker in a task, the in-process purgatory and tracker drive their wheel
from a clock thread or a loop timer. Each runs a loop the application does not
see, so an error there must neither spin nor stay silent:

* **Back off**: after a failure the loop waits before it tries again, 10 ms
  after the first, doubling up to 1 s (bounded exponential backoff); one
  success resets it.
* **Log a bounded volume**: the first failure is logged with its traceback;
  after that at most one line per ``LOG_INTERVAL_S`` (10 s), which says how
  many failures it stands for and the last one. The end of a streak that was
  logged is logged once ("recovered"); a loop that flaps between failure and
  success stays within the same one line per interval.
* **Surface a persistent failure**: when a loop has failed without a single
  success for ``fail_after_s``, :meth:`Backoff.failure` returns None and the
  loop stops; its owner turns that into a :class:`ReaderFailed` the application
  sees (the purgatory completes its pending operations with it and raises it
  from the next call; the idle tracker raises it from the next ``add``). The
  cause is chained (``__cause__``).
"""

from __future__ import annotations

import logging
import time

from wheeld.protocol.errors import WheeldError

__all__ = ["Backoff", "ReaderFailed"]


class ReaderFailed(WheeldError):
    """A background thread or task of a purgatory or idle tracker failed for too long and stopped."""


class Backoff:
    """Bounded exponential backoff and rate-limited logging for one background loop."""

    FIRST_S = 0.01
    MAX_S = 1.0
    LOG_INTERVAL_S = 10.0

    def __init__(self, log: logging.Logger, what: str, fail_after_s: float | None) -> None:
        self.log, self.what, self.fail_after_s = log, what, fail_after_s
        self.failures = 0  # failures in the current streak (reset by a success)
        self.total_failures = 0
        self.last_error: BaseException | None = None
        self._delay_s = 0.0
        self._streak_start = 0.0
        self._last_log = -float("inf")
        self._unlogged = 0  # failures since the last line that reported them
        self._streak_logged = False  # a line reported this streak: its end is reported too

    def success(self) -> None:
        """The loop did its work: reset the backoff (logs once if it had been failing)."""
        if not self.failures:
            return
        now = time.monotonic()
        if self._streak_logged or now - self._last_log >= self.LOG_INTERVAL_S:
            self.log.warning("%s recovered after %d failure(s) in %.1f s", self.what, self.failures,
                             now - self._streak_start)
            self._last_log, self._unlogged = now, 0
        self.failures = 0
        self._streak_logged = False
        self._delay_s = 0.0

    def failure(self, exc: BaseException) -> float | None:
        """Record a failure: the delay before the next try, or None to give up."""
        now = time.monotonic()
        if not self.failures:
            self._streak_start = now
            self._streak_logged = False
        self.failures += 1
        self.total_failures += 1
        self.last_error = exc
        self._unlogged += 1
        failing_s = now - self._streak_start
        if self.fail_after_s is not None and failing_s >= self.fail_after_s and self.failures > 1:
            self.log.error("%s failed %d time(s) in %.1f s without a success; giving up (last: %r)", self.what,
                           self.failures, failing_s, exc)
            self._last_log, self._unlogged = now, 0
            return None
        if self.total_failures == 1:
            self.log.error("%s failed; retrying with backoff (at most one log line per %g s)", self.what,
                           self.LOG_INTERVAL_S, exc_info=exc)
            self._last_log, self._unlogged, self._streak_logged = now, 0, True
        elif now - self._last_log >= self.LOG_INTERVAL_S:
            self.log.error("%s: %d failure(s) since the last report, %d in a row over %.1f s (last: %r)", self.what,
                           self._unlogged, self.failures, failing_s, exc)
            self._last_log, self._unlogged, self._streak_logged = now, 0, True
        self._delay_s = min(self.MAX_S, self._delay_s * 2) if self._delay_s else self.FIRST_S
        return self._delay_s

    def give_up_error(self, message: str) -> ReaderFailed:
        error = ReaderFailed(f"{message}: {self.failures} failure(s) in a row, the last: {self.last_error!r}")
        error.__cause__ = self.last_error
        return error
