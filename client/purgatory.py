"""A request purgatory: operations that complete when a condition is met or time out.

This is Kafka's ``DelayedOperationPurgatory`` in Python (the design: Yasuhiro
Matsuda, "Apache Kafka, Purgatory, and Hierarchical Timing Wheels", Confluent
blog, 2015, and the Kafka wiki's "Purgatory Redesign Proposal"). A *delayed
operation* is something that cannot be answered yet (a produce waiting for
replicas, a long-poll fetch waiting for data). It completes exactly once, by
whichever path gets there first:

* **condition**: something happened on a key it watches; ``check_and_complete(key)``
  calls its ``try_complete()``, which calls ``force_complete()`` if the condition
  now holds;
* **timeout**: ``delay_ms`` after it was put in the purgatory, the timer calls
  ``force_complete()`` and, if that won, ``on_expiration()``;
* **cancel**: the application calls ``force_complete()`` itself (shutdown, the
  client went away);
* **the purgatory stops**: ``close()`` completes every pending operation with
  ``op.error`` set to :class:`wheeld.Closed`; a daemon-backed purgatory whose
  expiration reader failed for ``fail_after_s`` completes them with
  :class:`ReaderFailed` (see "Errors" below).

Using it (examples/purgatory_fetch.py is this, runnable)::

    class DelayedFetch(DelayedOperation):
        def __init__(self, log, min_bytes, respond):
            super().__init__(delay_ms=500)
            self.log, self.min_bytes, self.respond = log, min_bytes, respond
        def try_complete(self):
            return self.log.available() >= self.min_bytes and self.force_complete()
        def on_complete(self):            # exactly once, on every path
            self.respond(self.log.read(), timed_out=self.expired, error=self.error)
        def on_expiration(self):          # only on the timeout path, after on_complete
            stats["expired"] += 1

    purgatory = Purgatory()                           # in-process wheel + clock thread
    purgatory.try_complete_else_watch(op, ["topic-0"])  # True: completed right away
    purgatory.check_and_complete("topic-0")           # after new data: how many completed
    purgatory.close()                                 # pending operations complete with op.error set

Callbacks follow Kafka: ``on_complete()`` runs exactly once whatever the path
(``self.expired`` tells it whether it timed out, ``self.error`` whether the
purgatory completed it because it stopped), and ``on_expiration()`` runs after
it only when the timeout won. So an operation is either completed by its
condition/cancel, expired, or completed with an error, never two of these.

Exactly once
------------
``force_complete()`` is a test-and-set on a one-shot flag, atomic with or without
the GIL: compiled, a byte of the operation changed with an atomic exchange; as
Python, a ``threading.Lock`` acquired without blocking. The path that sets it runs
the completion; every later attempt returns False. ``try_complete()`` calls are
serialised per operation so a condition check never races another check of the
same operation, the way Kafka's ``maybeTryComplete`` does it (KAFKA-8334): a check
that finds another one running does not wait; it flags the running one, which
checks once more when it ends, so an event that arrived meanwhile is not missed.
Checks are not serialised against ``force_complete()``, which needs no lock.

The timer: O(1) removal
-----------------------
An operation watched but not completed is put on a timer. On completion it is
removed from the timer at once, so the timer holds exactly the pending
operations:

* ``Purgatory()`` / ``AsyncPurgatory()``: wheeld's own timing wheel
  (:class:`wheeld.shm.TimerWheel`, a hierarchical timing wheel after Varghese
  and Lauck, "Hashed and Hierarchical Timing Wheels", SOSP 1987) on private
  memory, with Kafka's purgatory parameters (tick 1 ms, 20 buckets per level).
  ``schedule`` returns a handle (slot, generation) that the operation keeps;
  completion calls ``cancel_handle(handle)``: unlink from a doubly linked
  bucket, O(1). The wheel grows (a new wheel twice the size, pending operations
  moved over) when full. The clock is driven the way Kafka drives it: the wheel
  knows its earliest non-empty bucket (``next_deadline``; Kafka keeps the
  buckets in a DelayQueue); the clock thread (sync) or a loop timer (asyncio)
  sleeps until then and is woken early only by an operation whose deadline is
  earlier than the one it sleeps for. An idle purgatory makes no wake-ups. With
  the default 200 ms-ish timeouts each new deadline is later than the ones
  already queued, so an add almost never wakes the clock.
* ``Purgatory.connect(name)`` / ``Purgatory(client=wheeld.connect(...))``: the
  timeouts live in a wheeld daemon (``client.add(op_id, delay_ms)``; completion
  is ``client.cancel(op_id)``, O(1) in the daemon's wheel). An expiration
  thread (asyncio: a task) reads the expirations. The client must be in a group
  of its own: an expiration goes to *one* member of a group, and only this
  purgatory knows its operations (see :func:`default_group`). Operation ids are
  random-prefixed ints, so two purgatories never collide, and an expiration of
  an id this purgatory did not create (timers left by an earlier process of the
  same group, or a second process wrongly sharing it) is dropped and counted in
  ``foreign_expirations``. The purgatory owns the client while it runs: do not
  ``poll`` or ``flush`` it yourself (the asyncio client supports one reader of
  its socket at a time). What it costs: an add and a cancel are a 64-byte ring
  record each (~2 us of client CPU), but every operation's timer now also costs
  the daemon's CPU, and an expiration crosses a socket; bench/purgatory.py
  measures both sides.

Watch lists: exact removal, not purge
-------------------------------------
Kafka describes two ways to stop watch lists from filling up with completed
operations. The old purgatory (0.8) purged every list when their total size
passed a threshold (so it purged even when nothing was completed: the CPU
spikes when many requests time out); the redesigned one purges when an
*estimate* of completed-but-still-watched operations passes the threshold
(watched entries counted on insert, less the operations still on the timer).

This module does what the redesign discussion set aside: **exact removal on
completion**. A watch list is a dict used as an insertion-ordered set
(``{op: None}``), so removing one operation is one O(1) ``pop``; the operation
remembers its keys, and whoever completes it removes it from each of them (and
drops a list that became empty). Why, here:

* memory is exact: the watch lists hold exactly the pending operations, at every
  instant, with no threshold to tune and no purge pass that scans everything
  (an estimate can also over-count and purge for nothing);
* the cost is O(keys of that operation) dict pops in the completing thread,
  which matters for operations watching thousands of keys; Kafka's operations
  watch a handful (its purgatory benchmark: 3). An application whose
  operations watch thousands of keys pays that per completion instead of in a
  background purge;
* Kafka kept lazy purging because exact removal from concurrent doubly linked
  watch lists is hard to get right; a dict under one short lock is not.

Locking and threads
-------------------
One lock per purgatory guards the watch lists, the id->operation map of the
timer, the wheel (or the daemon client, which is not thread-safe). It is never
held while user code runs: ``check_and_complete`` copies the watch list under the
lock and calls ``try_complete`` outside it; the clock takes the due operations
off the timer, sets their one-shot flags and removes them from their watch lists
in one critical section per pass, and runs their callbacks after it. Registration
re-checks ``is_completed`` under the lock and completion sets the flag *before* it takes the lock to clean up, so an
operation completed by another thread while it is being watched is either not
added or removed right after: nothing leaks. Conditions may be checked, and
operations completed, from any number of threads (sync) or from tasks and
threads (asyncio: calls that touch the event loop are handed to it with
``call_soon_threadsafe``).

Errors
------
The clock thread, the expiration thread and the expiration task never spin and
never stay silent (:mod:`wheeld._background`): after a failure they back off
(10 ms, doubling up to 1 s), log the first failure with its traceback and then
at most one line per 10 s with a count, and when they have failed without a
single success for ``fail_after_s`` (default 30 s; None: never give up) the
purgatory *fails*: every pending operation completes with ``op.error`` set to a
:class:`ReaderFailed` (its ``__cause__`` is the last error; ``on_expiration``
is not called), ``purgatory.error`` holds it, and the next
``try_complete_else_watch`` raises it. ``close()`` does not raise.

Guarantees: exactly-once completion; a timeout never fires before ``delay_ms``
has passed since the operation was watched (the in-process clock rounds the
start up to the next ms; the daemon client does the same, see
``wheeld.core.ceil_ms``); every operation put in the purgatory completes,
including on ``close()`` (``op.error`` is a :class:`wheeld.Closed` then, and its
callbacks run in the thread that called ``close()``).
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import select
import socket
import threading
import time
from collections.abc import Hashable, Iterable
from typing import cast

from wheeld.protocol.errors import ArenaFull, Closed, InvalidRequest
from wheeld.protocol.keys import KEY_BYTES, encode_key
from wheeld.shm.wheel import TimerWheel

from ._background import Backoff, ReaderFailed

__all__ = ["DelayedOperation", "Purgatory", "AsyncPurgatory", "ReaderFailed", "default_group"]

log = logging.getLogger("wheeld.purgatory")

_NEVER = 1 << 62  # "the clock sleeps with no deadline": any add wakes it
_BUSY = -(1 << 62)  # "the clock is awake and will look again": no add wakes it
_INT_META = encode_key(1)[1]  # op ids are positive ints below 2**62: int keys, one meta byte
_INT_KEY_META = bytes((_INT_META,))
_KEY_PAD = bytes(KEY_BYTES - 8)
_ID_SHIFT = 32  # an op id is (random 30-bit base << 32) | counter
KAFKA_TICK_MS = 1
KAFKA_WHEEL_SIZE = 20
DEFAULT_CAPACITY = 1 << 16
DEFAULT_FAIL_AFTER_S = 30.0
_READ_WAIT_S = 1.0  # the expiration thread's longest wait on the socket (it re-reads the fd after)
_READABLE = select.POLLIN | select.POLLPRI


# This module is compiled by Cython (wheeld.protocol.accel, purgatory.pxd). Compiled, the
# operation's one-shot flag and its check flags are C bytes changed with atomic
# instructions (purgatory.pxd's _take_*/_clear_* helpers) instead of two threading.Locks
# per operation, and the clock is read with clock_gettime (the same CLOCK_MONOTONIC as
# time.monotonic_ns).
_COMPILED = not __file__.endswith(".py")


def _ceil_ms() -> int:
    """Monotonic ms rounded up: a deadline computed from it is never early."""
    if _COMPILED:
        return -(-_clock_ns() // 1_000_000)  # type: ignore[name-defined]  # noqa: F821 - purgatory.pxd
    return -(-time.monotonic_ns() // 1_000_000)


def _floor_ms() -> int:
    if _COMPILED:
        return _clock_ns() // 1_000_000  # type: ignore[name-defined]  # noqa: F821 - purgatory.pxd
    return time.monotonic_ns() // 1_000_000


class DelayedOperation:
    """An operation that completes when its condition holds or after ``delay_ms``.

    Subclass it: ``try_complete()`` checks the condition and returns
    ``self.force_complete()`` if it holds (False otherwise); ``on_complete()``
    does the work of completing (exactly once); ``on_expiration()`` runs after
    ``on_complete()`` when the timeout completed it. ``error`` is None, or the
    exception the purgatory completed it with when it stopped (``wheeld.Closed``
    from ``close()``, :class:`ReaderFailed` when timeouts could no longer be
    delivered); it is set before ``on_complete()`` runs.
    """

    __slots__ = ("delay_ms", "expired", "error", "_once", "_check_lock", "_check_pending", "_purgatory", "_op_id",
                 "_handle", "_deadline_ms", "_watch_keys")

    def __init__(self, delay_ms: int) -> None:
        if type(delay_ms) is not int or delay_ms < 0:
            raise InvalidRequest(f"delay_ms must be a non-negative int, not {delay_ms!r}")
        self.delay_ms = delay_ms
        self.expired = False  # True once the timeout path completed it (set before on_complete)
        self.error: BaseException | None = None  # set when the purgatory completed it on close or failure
        if not _COMPILED:  # compiled: C flags (purgatory.pxd), zero when the object is made
            self._once = threading.Lock()  # one-shot flag: held by whoever completed the operation
            self._check_lock = threading.Lock()  # held while a try_complete() runs (see _safe_try_complete)
            self._check_pending = False  # a check was asked for while another ran
        self._purgatory: _PurgatoryBase | None = None
        self._op_id: int | None = None  # key of its timer while it has one
        self._handle: tuple[int, int] | None = None  # (slot, generation) in an in-process wheel
        self._deadline_ms = 0
        self._watch_keys: tuple[Hashable, ...] = ()

    # ------------------------------------------------------------------ to override
    def try_complete(self) -> bool:
        """Check the condition; if it holds, ``return self.force_complete()``; else False."""
        raise NotImplementedError

    def on_complete(self) -> None:
        """Called exactly once, on whichever path completed the operation."""

    def on_expiration(self) -> None:
        """Called after :meth:`on_complete` when the operation timed out."""

    # ------------------------------------------------------------------ completion
    @property
    def is_completed(self) -> bool:
        return self._completed()

    def _completed(self) -> bool:
        if _COMPILED:
            return _get_done(self)  # type: ignore[name-defined]  # noqa: F821 - purgatory.pxd
        return self._once.locked()

    def _claim(self) -> bool:
        """Test-and-set of the one-shot flag: True for the one caller that completes the operation."""
        if _COMPILED:
            return _take_done(self)  # type: ignore[name-defined]  # noqa: F821 - purgatory.pxd: an atomic exchange
        return self._once.acquire(False)

    def force_complete(self) -> bool:
        """Complete now (condition met, or cancel). True if this call completed it."""
        if not self._claim():
            return False
        self._finish()
        return True

    def _finish(self) -> None:
        purgatory = self._purgatory
        if purgatory is not None:
            purgatory._forget(self)  # off the timer (O(1)) and off every watch list
        self.on_complete()

    def _abort(self, error: BaseException) -> bool:
        """The purgatory stopped (close or failure): complete with ``error`` set."""
        if not self._claim():
            return False
        self.error = error
        self._finish()
        return True

    def _safe_try_complete(self) -> bool:
        """Call ``try_complete()``, never two at once for one operation.

        Kafka's ``maybeTryComplete`` (KAFKA-8334): a check that finds another check of
        the same operation running does not wait for it; it sets a flag that makes the
        running check go round once more after it finishes, so a condition that became
        true meanwhile is not missed. True if this call completed the operation.
        """
        done = False
        while True:
            if self._check_enter():
                try:
                    if _COMPILED:
                        _clear_pending(self)  # type: ignore[name-defined]  # noqa: F821 - purgatory.pxd
                    else:
                        self._check_pending = False
                    done = bool(self.try_complete())
                finally:
                    self._check_exit()
                if _COMPILED:
                    retry = _get_pending(self)  # type: ignore[name-defined]  # noqa: F821 - purgatory.pxd
                else:
                    retry = self._check_pending
            elif _COMPILED:  # set the flag; retry if it was not set
                retry = _take_pending(self)  # type: ignore[name-defined]  # noqa: F821 - purgatory.pxd
            else:
                retry = not self._check_pending
                self._check_pending = True
            if not retry or self._completed():
                return done

    def _check_enter(self) -> bool:
        if _COMPILED:
            return _take_checking(self)  # type: ignore[name-defined]  # noqa: F821 - purgatory.pxd
        return self._check_lock.acquire(False)

    def _check_exit(self) -> None:
        if _COMPILED:
            _clear_checking(self)  # type: ignore[name-defined]  # noqa: F821 - purgatory.pxd
        else:
            self._check_lock.release()

    def __repr__(self) -> str:
        state = ("expired" if self.expired else f"failed ({type(self.error).__name__})" if self.error is not None
                 else "completed" if self.is_completed else "pending")
        return f"<{type(self).__name__} delay_ms={self.delay_ms} {state}>"


# ====================================================================== timers
class _WheelClock:
    """The in-process timer: a private TimerWheel plus a thread that sleeps until its next bucket.

    ``_by_slot[slot]`` is the operation whose timer is in that record of the wheel, so an
    expiration finds its operation by slot (the wheel's ``expire`` + ``release``) without
    decoding the timer's key."""

    def __init__(self, purgatory: "_PurgatoryBase", tick_ms: int, wheel_size: int, capacity: int) -> None:
        self._p = purgatory
        self.tick_ms, self.wheel_size = tick_ms, wheel_size
        self.wheel = TimerWheel.create(capacity, tick_ms=tick_ms, wheel_size=wheel_size, start_ms=_floor_ms())
        self._by_slot: list[DelayedOperation | None] = [None] * self.wheel.n_records
        self._wake_at_ms = _BUSY
        self._backoff = Backoff(log, f"purgatory {purgatory.name!r}: the clock", purgatory.fail_after_s)

    # called with the purgatory lock held
    def add(self, op: DelayedOperation) -> None:
        deadline = _ceil_ms() + op.delay_ms
        ident = _int_ident(op._op_id)  # type: ignore[arg-type]  # the purgatory numbered it before timing it
        try:
            handle = self.wheel.schedule_ident(ident, deadline)
        except ArenaFull:
            self._grow()
            handle = self.wheel.schedule_ident(ident, deadline)
        op._handle = handle
        self._by_slot[handle[0]] = op
        op._deadline_ms = deadline
        if deadline < self._wake_at_ms:
            self._wake_early(deadline)

    def remove(self, op: DelayedOperation) -> None:
        handle = op._handle  # set by add: only an operation on the timer is removed
        if self.wheel.cancel_handle(handle):  # type: ignore[arg-type]
            self._by_slot[handle[0]] = None  # type: ignore[index]

    def _grow(self) -> None:
        """Move every pending timer to a wheel twice the size (amortised O(1) per add)."""
        old = self.wheel
        new = TimerWheel.create(old.capacity * 2, tick_ms=self.tick_ms, wheel_size=self.wheel_size,
                                start_ms=old.current_ms)
        by_slot = cast("list[DelayedOperation | None]", [None] * new.n_records)
        for op_id, op in self._p._timed.items():
            op._handle = handle = new.schedule_ident(_int_ident(op_id), op._deadline_ms)
            by_slot[handle[0]] = op
        self.wheel = new
        self._by_slot = by_slot
        old.close()

    def _collect(self) -> tuple[list[DelayedOperation], int | None]:
        """Advance to now; the operations that timed out and the next bucket deadline (lock held).

        The operations returned are already completed by their timeout (flag set, off
        the watch lists): the caller runs their callbacks (``_run_expirations``)."""
        return self._p._claim_expired(self._due(_floor_ms())), self.wheel.next_deadline()

    def _due(self, now_ms: int) -> list[DelayedOperation]:
        """Advance the wheel to ``now_ms``; the operations whose timers fired, off the op-id map."""
        wheel = self.wheel
        slots = wheel.expire(now_ms)
        by_slot, timed = self._by_slot, self._p._timed
        ops = []
        for slot in slots:
            op = by_slot[slot]
            by_slot[slot] = None
            if op is None:  # not reached: every scheduled record has its operation
                wheel.release(slot, wheel.fired(slot)[5])
                continue
            wheel.release(slot, op._handle[1])  # type: ignore[index]  # on the wheel: it has a handle
            if timed.pop(op._op_id, None) is not None:  # type: ignore[arg-type]  # None pops nothing
                ops.append(op)
        return ops

    def _wake_early(self, deadline_ms: int) -> None:  # pragma: no cover - provided by subclasses
        raise NotImplementedError

    def close(self) -> None:
        self.wheel.close()


def _int_ident(op_id: int) -> bytes:
    """The wheel's record form of an int key (meta byte, 8 little-endian bytes, zero padding)."""
    if _COMPILED:  # the same 33 bytes, built in place
        return _int_ident_c(op_id)  # type: ignore[name-defined]  # noqa: F821 - purgatory.pxd
    return _INT_KEY_META + op_id.to_bytes(8, "little") + _KEY_PAD


class _ThreadWheelClock(_WheelClock):
    """Sync: a daemon thread waits on a Condition sharing the purgatory lock."""

    def __init__(self, purgatory, tick_ms, wheel_size, capacity) -> None:
        super().__init__(purgatory, tick_ms, wheel_size, capacity)
        self._cond = threading.Condition(purgatory._lock)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"wheeld-purgatory-clock-{purgatory.name}",
                                        daemon=True)
        self._thread.start()

    def _wake_early(self, deadline_ms: int) -> None:
        self._wake_at_ms = _BUSY
        self._cond.notify()

    def _run(self) -> None:
        cond, purgatory, backoff = self._cond, self._p, self._backoff
        while True:
            with cond:
                if self._closed:
                    return
                try:
                    ops, next_ms = self._collect()
                except Exception as exc:
                    delay_s = backoff.failure(exc)
                    if delay_s is None:
                        failed = True
                    else:
                        failed = False
                        self._wake_at_ms = _BUSY
                        cond.wait(delay_s)
                        continue
                else:
                    failed = False
                    backoff.success()
                    if not ops:
                        self._wake_at_ms = _NEVER if next_ms is None else next_ms
                        timeout_s = (None if next_ms is None
                                     else max(0.0, (next_ms * 1_000_000 - time.monotonic_ns()) / 1e9))
                        cond.wait(timeout_s)
                        self._wake_at_ms = _BUSY
                        continue
            if failed:
                purgatory._fail(backoff.give_up_error(f"purgatory {purgatory.name!r}: the clock thread stopped"))
                return
            purgatory._run_expirations(ops)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join()
        with self._cond:
            super().close()


class _LoopWheelClock(_WheelClock):
    """asyncio: one loop timer (``call_later``) for the wheel's next bucket."""

    def __init__(self, purgatory, tick_ms, wheel_size, capacity, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(purgatory, tick_ms, wheel_size, capacity)
        self._loop = loop
        self._loop_thread = threading.get_ident()
        self._timer: asyncio.TimerHandle | None = None
        self._wake_at_ms = _NEVER

    def _wake_early(self, deadline_ms: int) -> None:
        if threading.get_ident() == self._loop_thread:
            self._arm(deadline_ms)
        else:
            self._wake_at_ms = _BUSY
            self._loop.call_soon_threadsafe(self._fire)

    def _arm(self, deadline_ms: int | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if deadline_ms is None:
            self._wake_at_ms = _NEVER
            return
        self._wake_at_ms = deadline_ms
        delay_s = max(0.0, (deadline_ms * 1_000_000 - time.monotonic_ns()) / 1e9)
        self._timer = self._loop.call_later(delay_s, self._fire)

    def _fire(self) -> None:
        with self._p._lock:
            if self.wheel is None:
                return
            self._timer = None
            try:
                ops, next_ms = self._collect()
            except Exception as exc:
                delay_s = self._backoff.failure(exc)
                if delay_s is not None:  # try again later; adds meanwhile do not re-arm earlier
                    self._wake_at_ms = _BUSY
                    self._timer = self._loop.call_later(delay_s, self._fire)
                    return
                ops = None
            else:
                self._backoff.success()
                self._arm(next_ms)  # a loop timer may fire early: then nothing was due and we re-arm
        if ops is None:
            self._p._fail(self._backoff.give_up_error(f"purgatory {self._p.name!r}: the clock stopped"))
            return
        self._p._run_expirations(ops)

    def close(self) -> None:
        with self._p._lock:
            if self._timer is not None:
                self._timer.cancel()
            if self.wheel is not None:
                super().close()
            self.wheel = None  # type: ignore[assignment]  # closed: _fire and close look for None


def _client_fileno(client) -> int | None:
    """The daemon client's socket (it changes when the client reconnects; None meanwhile)."""
    fileno = getattr(client, "fileno", None)
    if callable(fileno):
        fd = fileno()
        return fd if fd is not None and fd >= 0 else None
    sock = getattr(client, "_sock", None)
    return sock.fileno() if sock is not None else None


def _wait_readable(fds: list[int], timeout_s: float) -> None:
    """Wait until one of ``fds`` is readable (or hung up), up to ``timeout_s``.

    ``poll(2)``: unlike ``select(2)`` it takes descriptors of any number (select
    refuses those at or above FD_SETSIZE, 1024, which a process serving thousands
    of sockets reaches)."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, _READABLE)
    poller.poll(max(0, int(timeout_s * 1000 + 0.999)))


def _client_closed_error(purgatory, exc: BaseException) -> ReaderFailed:
    error = ReaderFailed(f"purgatory {purgatory.name!r}: its wheeld client was closed while the purgatory ran")
    error.__cause__ = exc
    return error


class _DaemonClock:
    """Sync, daemon-backed: timeouts are wheeld timers; a thread reads their expirations."""

    def __init__(self, purgatory: "_PurgatoryBase", client) -> None:
        self._p = purgatory
        self.client = client
        self._closed = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._stop = threading.Event()
        self._backoff = Backoff(log, f"purgatory {purgatory.name!r}: reading expirations", purgatory.fail_after_s)
        self._thread = threading.Thread(target=self._run, name=f"wheeld-purgatory-expirations-{purgatory.name}",
                                        daemon=True)
        self._thread.start()

    def add(self, op: DelayedOperation) -> None:  # lock held
        self.client.add(op._op_id, op.delay_ms)

    def remove(self, op: DelayedOperation) -> None:  # lock held
        self.client.cancel(op._op_id)

    def _run(self) -> None:
        purgatory, lock, client, backoff = self._p, self._p._lock, self.client, self._backoff
        wake = self._wake_r.fileno()
        while not self._closed:
            try:
                fd = _client_fileno(client)
                # fd None: the client is between connections; poll() below reconnects it
                _wait_readable([wake] if fd is None else [fd, wake], _READ_WAIT_S if fd is not None else 0.01)
                if self._closed:
                    return
                with lock:
                    if self._closed:
                        return
                    expired = client.poll(0)
                    timed = purgatory._timed
                    ops = [op for op in (timed.pop(e.key, None) for e in expired) if op is not None]
                    if len(ops) != len(expired):
                        purgatory._count_foreign(expired)
                    ops = purgatory._claim_expired(ops)
            except Closed as exc:  # the application closed the client under us: no timeout can come
                if not self._closed:
                    purgatory._fail(_client_closed_error(purgatory, exc))
                return
            except Exception as exc:
                if self._closed:
                    return
                delay_s = backoff.failure(exc)
                if delay_s is None:
                    purgatory._fail(backoff.give_up_error(
                        f"purgatory {purgatory.name!r}: the expiration reader stopped"))
                    return
                self._stop.wait(delay_s)  # not the socket wait: that may be what fails
                continue
            backoff.success()
            if ops:
                purgatory._run_expirations(ops)

    def close(self) -> None:
        self._closed = True
        self._stop.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if threading.current_thread() is not self._thread:
            self._thread.join()
        self._wake_r.close()
        self._wake_w.close()


class _AsyncDaemonClock:
    """asyncio, daemon-backed: commands go through the AsyncClient on the loop; a task polls."""

    def __init__(self, purgatory: "_PurgatoryBase", client, loop: asyncio.AbstractEventLoop) -> None:
        self._p = purgatory
        self.client = client
        self._loop = loop
        self._loop_thread = threading.get_ident()
        self._backoff = Backoff(log, f"purgatory {purgatory.name!r}: reading expirations", purgatory.fail_after_s)
        self._task = loop.create_task(self._run(), name=f"wheeld-purgatory-expirations-{purgatory.name}")

    def _call(self, fn, *args) -> None:
        if threading.get_ident() == self._loop_thread:
            fn(*args)
        else:  # the client is not thread-safe: hand the call to its loop (FIFO, so order is kept)
            self._loop.call_soon_threadsafe(fn, *args)

    def add(self, op: DelayedOperation) -> None:
        self._call(self.client.add, op._op_id, op.delay_ms)

    def remove(self, op: DelayedOperation) -> None:
        self._call(self.client.cancel, op._op_id)

    async def _run(self) -> None:
        purgatory, backoff = self._p, self._backoff
        while True:
            try:
                expired = await self.client.poll(None)
            except asyncio.CancelledError:
                raise
            except Closed as exc:
                purgatory._fail(_client_closed_error(purgatory, exc))
                return
            except Exception as exc:
                delay_s = backoff.failure(exc)
                if delay_s is None:
                    purgatory._fail(backoff.give_up_error(
                        f"purgatory {purgatory.name!r}: the expiration reader stopped"))
                    return
                await asyncio.sleep(delay_s)
                continue
            backoff.success()
            with purgatory._lock:
                timed = purgatory._timed
                ops = [op for op in (timed.pop(e.key, None) for e in expired) if op is not None]
                if len(ops) != len(expired):
                    purgatory._count_foreign(expired)
                ops = purgatory._claim_expired(ops)
            purgatory._run_expirations(ops)

    def close(self) -> None:
        self._task.cancel()


# ====================================================================== purgatories
class _PurgatoryBase:
    """Watch lists, the op-id map and the completion protocol; the subclasses choose the timer."""

    def __init__(self, name: str, fail_after_s: float | None) -> None:
        self.name = name
        self.fail_after_s = fail_after_s
        self._lock = threading.Lock()
        self._watchers: dict[Hashable, dict[DelayedOperation, None]] = {}
        self._timed: dict[int, DelayedOperation] = {}  # op id -> operation, while on the timer
        self._id_base = secrets.randbits(30) << _ID_SHIFT  # daemon keys are per group: avoid collisions
        self._next_id = 0  # op ids are _id_base | 1, 2, 3, ... (taken under the lock)
        self._clock: _WheelClock | _DaemonClock | _AsyncDaemonClock | None = None  # set by the subclass
        # the clock again when it is an in-process wheel (its add/remove are C calls)
        self._wheel_clock: _WheelClock | None = None
        self._closed = False
        self._owns_client = False
        self.error: ReaderFailed | None = None  # set when the purgatory failed (see "Errors")
        self.expired_total = 0
        self.completed_total = 0  # by condition or cancel
        self.errored_total = 0  # completed with op.error set (close or failure)
        self.foreign_expirations = 0  # daemon expirations of ids this purgatory did not create

    def _set_clock(self, clock) -> None:
        self._clock = clock
        self._wheel_clock = clock if isinstance(clock, _WheelClock) else None

    # ------------------------------------------------------------------ the API
    def try_complete_else_watch(self, op: DelayedOperation, watch_keys: Iterable[Hashable]) -> bool:
        """Complete ``op`` now if its condition holds; else watch it on every key and time it.

        True if this call completed it. Kafka's order: check; watch; check again (an
        event between the first check and the watch is not missed). The timer is set
        together with the watch, under one lock acquisition, rather than after the
        second check: if that check succeeds, the O(1) removal undoes it. Raises
        ``wheeld.Closed`` after ``close()`` and :class:`ReaderFailed` once the
        purgatory failed (nothing is changed then).
        """
        self._check_usable()
        keys = tuple(watch_keys)
        if not keys:
            raise InvalidRequest("a delayed operation must watch at least one key")
        for key in keys:
            hash(key)  # an unhashable key raises here, before anything changed
        if op._purgatory is not None:
            raise InvalidRequest("this operation was already put in a purgatory")
        op._purgatory = self
        if op._safe_try_complete():
            return True
        lock = self._lock
        lock.acquire()
        try:
            if op._completed():  # completed by another thread (or cancelled) meanwhile
                return False
            if self._closed or self.error is not None:
                op._purgatory = None
                self._check_usable()
            self._watch(op, keys)
            # Kafka times the operation only after the second check; timing it first costs
            # one O(1) removal when that check succeeds and saves a lock round trip when not.
            self._next_id += 1
            op._op_id = op_id = self._id_base | self._next_id
            try:
                if self._wheel_clock is not None:
                    self._wheel_clock.add(op)
                else:
                    self._clock.add(op)  # type: ignore[union-attr]  # set by the subclass's __init__
            except BaseException:
                op._op_id = None
                self._unwatch(op)
                raise
            self._timed[op_id] = op
        finally:
            lock.release()
        return op._safe_try_complete()  # an event between the first check and the watch is not missed

    def _watch(self, op: DelayedOperation, keys: tuple) -> None:
        """Put ``op`` on the watch list of each key (lock held); a key given twice counts once."""
        watchers = self._watchers
        repeated = False
        for key in keys:
            ops = watchers.get(key)
            if ops is None:
                watchers[key] = {op: None}
            else:
                n = len(ops)
                ops[op] = None
                if len(ops) == n:  # op was already there: this key came earlier in keys
                    repeated = True
        op._watch_keys = tuple(dict.fromkeys(keys)) if repeated else keys

    def check_and_complete(self, key: Hashable) -> int:
        """Check the condition of every operation watching ``key``; how many this call completed."""
        with self._lock:
            ops = self._watchers.get(key)
            if not ops:
                return 0
            ops = list(ops)  # type: ignore[assignment]  # a copy to check outside the lock
        completed = 0
        for op in ops:
            if not op._completed() and op._safe_try_complete():
                completed += 1
        return completed

    def watched(self) -> int:
        """Entries in all watch lists (an operation on 3 keys counts 3): exactly the pending ones."""
        with self._lock:
            return sum(map(len, self._watchers.values()))

    def watch_keys(self) -> int:
        """Keys that have at least one watching operation."""
        return len(self._watchers)

    def delayed(self) -> int:
        """Operations on the timer (pending)."""
        return len(self._timed)

    def __len__(self) -> int:
        """Operations on the timer (pending): :meth:`delayed`."""
        return len(self._timed)

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_usable(self) -> None:
        if self._closed:
            raise Closed(f"purgatory {self.name!r} is closed")
        error = self.error
        if error is not None:
            raise ReaderFailed(f"purgatory {self.name!r} failed: {error}") from error.__cause__

    # ------------------------------------------------------------------ completion bookkeeping
    def _forget(self, op: DelayedOperation) -> None:
        """Called once by the path that completed ``op``, after it set the one-shot flag."""
        lock = self._lock
        lock.acquire()
        try:
            op_id = op._op_id
            if op_id is not None:
                if self._timed.pop(op_id, None) is not None and not self._closed and self.error is None:
                    # O(1): cancel_handle, or a CANCEL record to the daemon
                    if self._wheel_clock is not None:
                        self._wheel_clock.remove(op)
                    else:
                        self._clock.remove(op)  # type: ignore[union-attr]  # set by the subclass's __init__
                op._op_id = None
            if op._watch_keys:
                self._unwatch(op)
            if op.expired:
                self.expired_total += 1
            elif op.error is not None:
                self.errored_total += 1
            else:
                self.completed_total += 1
        finally:
            lock.release()

    def _unwatch(self, op: DelayedOperation) -> None:
        watchers = self._watchers
        for key in op._watch_keys:
            ops = watchers.get(key)
            if ops is not None:
                ops.pop(op, None)
                if not ops:
                    del watchers[key]
        op._watch_keys = ()

    def _claim_expired(self, ops: list[DelayedOperation]) -> list[DelayedOperation]:
        """The timeout path, for operations the timer just took off the op-id map (lock held).

        Each one whose one-shot flag this sets is completed by its timeout: marked
        expired and taken off its watch lists here, in the clock's critical section, not
        one lock round trip each; the others were completed by another path first. The
        ones it completed are returned: their callbacks run after the lock is released
        (:meth:`_run_expirations`)."""
        claimed = []
        for op in ops:
            if op._claim():
                op.expired = True
                op._op_id = None
                if op._watch_keys:
                    self._unwatch(op)
                self.expired_total += 1
                claimed.append(op)
        return claimed

    def _run_expirations(self, ops: list[DelayedOperation]) -> None:
        """The callbacks of operations :meth:`_claim_expired` completed (lock not held)."""
        for op in ops:
            try:
                op.on_complete()
                op.on_expiration()
            except Exception:
                log.exception("purgatory %r: %r raised while expiring", self.name, op)

    def _abort_all(self, ops: list[DelayedOperation], error: BaseException) -> None:
        for op in ops:
            try:
                op._abort(error)
            except Exception:
                log.exception("purgatory %r: %r raised while completing with %r", self.name, op, error)

    def _count_foreign(self, expired) -> None:
        """Expirations of ids this purgatory did not create (lock held): dropped, counted, logged rarely."""
        base = self._id_base >> _ID_SHIFT
        foreign = sum(1 for e in expired if not (type(e.key) is int and e.key >> _ID_SHIFT == base))
        if foreign:
            if not self.foreign_expirations:
                log.warning("purgatory %r: dropped %d expiration(s) of operations it did not create: timers "
                            "left by an earlier process of its group, or another process using the same "
                            "group (give each one its own name)", self.name, foreign)
            self.foreign_expirations += foreign

    def _fail(self, error: ReaderFailed) -> None:
        """A background loop gave up: every pending operation completes with ``error``."""
        with self._lock:
            if self._closed or self.error is not None:
                return
            self.error = error
            pending = list(self._timed.values())
        self._abort_all(pending, error)

    def _take_pending_for_close(self) -> list[tuple[int, DelayedOperation]]:
        with self._lock:
            self._closed = True
            return list(self._timed.items())


def _group_part(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def default_group(name: str = "default") -> str:
    """The daemon group of a purgatory called ``name``: ``"purgatory." + name``.

    Stable on purpose: the daemon keeps a group id for every group name it has
    seen (at most 1,024), so a name that changes with every process (a pid, a
    random suffix) takes one more id at each start, forever; a stable name reuses
    its id. It must still be private to one *running* process: an expiration goes
    to one member of the group, and only the purgatory that set a timer knows the
    operation. So give each process that runs a purgatory a name of its own that
    its replacement reuses, e.g. ``f"fetch-{worker_index}"``; a replacement then
    also receives the timers its predecessor left (dropped, and counted in
    ``foreign_expirations``).
    """
    if not isinstance(name, str) or not name:
        raise InvalidRequest(f"a purgatory name must be a non-empty str, not {name!r}")
    return "purgatory." + _group_part(name)


class Purgatory(_PurgatoryBase):
    """A purgatory for threaded code.

    ``Purgatory()`` times operations out on an in-process wheel driven by its own
    clock thread; ``Purgatory.connect(name)`` (or ``Purgatory(client=wheeld.connect(
    group=default_group(name)), name=name)``) on a wheeld daemon, read by an
    expiration thread. ``close()`` stops the thread, completes every pending
    operation with ``op.error`` set to ``wheeld.Closed``, cancels their daemon
    timers and closes the client if the purgatory opened it.
    """

    def __init__(self, client=None, *, name: str = "default", tick_ms: int = KAFKA_TICK_MS,
                 wheel_size: int = KAFKA_WHEEL_SIZE, capacity: int = DEFAULT_CAPACITY,
                 fail_after_s: float | None = DEFAULT_FAIL_AFTER_S) -> None:
        super().__init__(name, fail_after_s)
        if client is None:
            self._set_clock(_ThreadWheelClock(self, tick_ms, wheel_size, capacity))
        else:
            if asyncio.iscoroutinefunction(getattr(client, "poll", None)):
                raise InvalidRequest("an asyncio client needs AsyncPurgatory")
            self._set_clock(_DaemonClock(self, client))

    @classmethod
    def connect(cls, name: str = "default", socket_path: str | None = None, *,
                fail_after_s: float | None = DEFAULT_FAIL_AFTER_S, **client_options) -> "Purgatory":
        """A daemon-backed purgatory with a client of its own, in group :func:`default_group` (``name``).
        ``close()`` closes that client too."""
        import wheeld

        client = wheeld.connect(socket_path, group=default_group(name), **client_options)
        try:
            purgatory = cls(client, name=name, fail_after_s=fail_after_s)
        except BaseException:
            client.close()
            raise
        purgatory._owns_client = True
        return purgatory

    @property
    def client(self):
        return getattr(self._clock, "client", None)

    def close(self) -> None:
        """Stop the clock; pending operations complete with ``op.error`` a ``wheeld.Closed``
        (their callbacks run in this thread). Does not raise for a failed purgatory."""
        if self._closed:
            return
        pending = self._take_pending_for_close()
        assert self._clock is not None  # set by __init__
        self._clock.close()
        self._abort_all([op for _op_id, op in pending], Closed(f"purgatory {self.name!r} was closed"))
        if isinstance(self._clock, _DaemonClock):
            client = self._clock.client
            try:
                with self._lock:
                    for op_id, _op in pending:
                        client.cancel(op_id)
                client.flush()
            except Exception:  # the daemon is gone: its timers went with it or will not reach us
                log.debug("purgatory %r: cancelling the daemon timers on close failed", self.name, exc_info=True)
            if self._owns_client:
                client.close()

    def __enter__(self) -> "Purgatory":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncPurgatory(_PurgatoryBase):
    """A purgatory for asyncio code; construct it inside the running loop.

    ``AsyncPurgatory()`` drives an in-process wheel with one loop timer;
    ``await AsyncPurgatory.connect(name)`` (or ``AsyncPurgatory(client=await
    wheeld.connect_async(group=default_group(name)), name=name)``) uses the
    daemon, with a task reading expirations. Callbacks run on the loop
    (timeouts) or in whichever task or thread completed the operation.
    Conditions may also be checked from other threads. ``await aclose()``
    completes pending operations with ``op.error`` set to ``wheeld.Closed``.
    """

    def __init__(self, client=None, *, name: str = "default", tick_ms: int = KAFKA_TICK_MS,
                 wheel_size: int = KAFKA_WHEEL_SIZE, capacity: int = DEFAULT_CAPACITY,
                 fail_after_s: float | None = DEFAULT_FAIL_AFTER_S) -> None:
        super().__init__(name, fail_after_s)
        loop = asyncio.get_running_loop()
        if client is None:
            self._set_clock(_LoopWheelClock(self, tick_ms, wheel_size, capacity, loop))
        else:
            if not asyncio.iscoroutinefunction(getattr(client, "poll", None)):
                raise InvalidRequest("a blocking client needs Purgatory, not AsyncPurgatory")
            self._set_clock(_AsyncDaemonClock(self, client, loop))

    @classmethod
    async def connect(cls, name: str = "default", socket_path: str | None = None, *,
                      fail_after_s: float | None = DEFAULT_FAIL_AFTER_S, **client_options) -> "AsyncPurgatory":
        """A daemon-backed purgatory with a client of its own, in group :func:`default_group` (``name``).
        ``aclose()`` closes that client too."""
        import wheeld

        client = await wheeld.connect_async(socket_path, group=default_group(name), **client_options)
        try:
            purgatory = cls(client, name=name, fail_after_s=fail_after_s)
        except BaseException:
            await client.close()
            raise
        purgatory._owns_client = True
        return purgatory

    @property
    def client(self):
        return getattr(self._clock, "client", None)

    async def aclose(self) -> None:
        """Stop the clock; pending operations complete with ``op.error`` a ``wheeld.Closed``."""
        if self._closed:
            return
        pending = self._take_pending_for_close()
        assert self._clock is not None  # set by __init__
        self._clock.close()
        if isinstance(self._clock, _AsyncDaemonClock):
            try:
                await self._clock._task
            except (asyncio.CancelledError, Exception):
                pass
        self._abort_all([op for _op_id, op in pending], Closed(f"purgatory {self.name!r} was closed"))
        if isinstance(self._clock, _AsyncDaemonClock):
            client = self._clock.client
            try:
                for op_id, _op in pending:
                    client.cancel(op_id)
                await client.flush()
            except Exception:
                log.debug("purgatory %r: cancelling the daemon timers on close failed", self.name, exc_info=True)
            if self._owns_client:
                await client.close()

    async def __aenter__(self) -> "AsyncPurgatory":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
