"""Idle-connection detection for asyncio servers.

The problem: a server holds many connections (100 000) and must close the ones
that received nothing for ``idle_ms`` (30 s). The usual answers cost something
on every packet: re-arm a loop timer per connection (``handle.cancel()`` +
``loop.call_later``; uvicorn cancels its keep-alive timer on every read and arms
a new one after each response), or store the time of the last activity and
re-check it when the connection's loop timer fires (aiohttp's keep-alive:
``_next_keepalive_close_time`` and ``_process_keepalive``, a lazy re-arm), or
nothing per packet but an O(N) scan of a dict of last-activity times every
second. bench/idle.py measures them all. This
module keeps the per-packet cost at one store and the per-connection timer in a
hierarchical timing wheel (Varghese and Lauck, SOSP 1987), in this process or
in a wheeld daemon:

* ``add(key)`` arms one timer at ``now + idle_ms``;
* ``touch(key)`` only records the time of the activity; the timer is not moved;
* when the timer comes due, the last activity is read: if the key was active
  since, the timer is armed again at ``last_activity + idle_ms`` (once per idle
  period, however many packets arrived); otherwise the key is idle.

So an active connection costs one wheel operation per ``idle_ms`` and one store
per packet, and an idle one is reported between ``idle_ms`` and
``idle_ms + tick`` after its last activity, never before.

Two backends, one API::

    tracker = IdleTracker(30_000, on_idle=close_connection)        # in-process wheel
    tracker = IdleTracker(30_000, on_idle=..., client=await wheeld.connect_async(group=...))

    tracker.add(conn_id)      # a new connection (keys: str, bytes or int, as for wheeld)
    tracker.touch(conn_id)    # on every read; unknown or already-idle keys are ignored
    tracker.remove(conn_id)   # the connection closed by itself
    async for conn_id in tracker: ...   # instead of on_idle

* **In-process** (``client=None``): wheeld's timing wheel on private memory,
  driven by one loop timer set to the wheel's next bucket (an idle server has no
  wake-ups). ``touch`` is a dict store of ``time.monotonic_ns()``; activity is
  rounded *up* to the ms, so a deadline computed from it is never early.
* **Daemon** (``client`` an AsyncClient): ``add_idle``/``touch``/``cancel`` of the
  client library. ``touch`` is its one 8-byte store into the client's shared
  touch table (the time rounded up to the ms, so never early either); the daemon
  does the lazy re-arm when the timer comes due, and a task reads the
  expirations. The timers outlive this process (the daemon hands them to
  another member of the group if it dies); give the tracker a client of a group
  that only idle tracking uses, and leave that client's ``poll`` and ``flush``
  to the tracker (``await tracker.flush()``): the asyncio client supports one
  reader of its socket at a time. An ``add`` or ``remove`` that finds the
  client's ring full (the daemon is not draining it right now) is kept and sent
  after a flush, in order, so neither fails for that reason.

  One window is the application's to close: the daemon decides a key is idle
  when its timer comes due; activity in the moment between that decision and
  ``on_idle`` (the expiration crossing the socket) is not seen by it. A server
  that keeps the time of each connection's last read can re-check it in
  ``on_idle`` and ``add`` the key again instead of closing
  (examples/idle_server.py does).

A key is reported once (``on_idle(key)`` or one item of the async iterator) and
is then no longer tracked; ``add`` it again to track it again. ``on_idle`` runs
on the event loop; if it returns an awaitable, it is scheduled as a task.

Errors: the loop timer (in-process) and the expiration task (daemon) back off
on repeated errors (10 ms doubling to 1 s), log the first with its traceback
and then at most one line per 10 s with a count (:mod:`wheeld._background`).
When one has failed without a success for ``fail_after_s`` (default 30 s;
None: never), the tracker *fails*: it stops reporting, ``tracker.error`` holds a
:class:`ReaderFailed` (``__cause__``: the last error), and ``add``, ``flush``
and the async iterator raise it.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import time
from collections.abc import Callable

from wheeld.protocol.errors import ArenaFull, Closed, InvalidKey, InvalidRequest, RingFull
from wheeld.protocol.keys import encode_key
from wheeld.shm.wheel import TimerWheel

from ._background import Backoff, ReaderFailed

__all__ = ["IdleTracker", "ReaderFailed"]

log = logging.getLogger("wheeld.idle")

DEFAULT_CAPACITY = 1 << 14
DEFAULT_FAIL_AFTER_S = 30.0


def _ceil_ms_of(ns: int) -> int:
    return -(-ns // 1_000_000)


class IdleTracker:
    """Report keys that had no ``touch`` for ``idle_ms``. Construct it inside the running loop."""

    def __init__(self, idle_ms: int, on_idle: Callable[[object], object] | None = None, *, client=None,
                 tick_ms: int = 1, capacity: int = DEFAULT_CAPACITY,
                 fail_after_s: float | None = DEFAULT_FAIL_AFTER_S) -> None:
        if type(idle_ms) is not int or idle_ms <= 0:
            raise InvalidRequest(f"idle_ms must be a positive int, not {idle_ms!r}")
        self.idle_ms = idle_ms
        self._loop = asyncio.get_running_loop()
        self._on_idle = on_idle
        self._queue: asyncio.Queue | None = None if on_idle is not None else asyncio.Queue()
        self._closed = False
        self.client = client
        self.idle_total = 0
        self.error: ReaderFailed | None = None  # set when the tracker failed (see "Errors")
        self._backoff = Backoff(log, "idle tracker: " + ("the wheel's timer" if client is None
                                                         else "reading expirations"), fail_after_s)
        if client is None:
            self._wheel: TimerWheel | None = TimerWheel.create(capacity, tick_ms=tick_ms,
                                                               start_ms=time.monotonic_ns() // 1_000_000)
            self._last_ns: dict[object, int] = {}  # key -> last activity, monotonic ns
            self._timer: asyncio.TimerHandle | None = None
            self._armed_ms: int | None = None
            self.touch = self._make_local_touch()
            self._task = None
        else:
            if not inspect.iscoroutinefunction(getattr(client, "poll", None)):
                raise InvalidRequest("IdleTracker needs an asyncio client (await wheeld.connect_async(...))")
            self._wheel = None
            self._keys: set = set()
            # adds (True) and cancels (False) that found the client's ring full, oldest first; sent
            # after a flush (the latest per key wins: an add re-arms, a cancel of an unarmed key is a no-op)
            self._unsent: dict[object, bool] = {}
            self._resend_task: asyncio.Task | None = None
            self._flush_lock = asyncio.Lock()
            self.touch = self._make_daemon_touch(client)
            self._task = self._loop.create_task(self._read_expirations(), name="wheeld-idle-expirations")

    # ------------------------------------------------------------------ touch (bound per backend)
    def _make_local_touch(self):
        last, now_ns = self._last_ns, time.monotonic_ns

        def touch(key) -> None:
            """Record activity on ``key`` (ignored if it is not tracked)."""
            if key in last:
                last[key] = now_ns()

        return touch

    def _make_daemon_touch(self, client):
        client_touch = client.touch

        def touch(key) -> None:
            """Record activity on ``key`` (ignored if it is not tracked)."""
            try:
                client_touch(key)
            except InvalidKey:
                pass  # not an idle timer of ours (never added, removed, already reported, or not sent yet)

        return touch

    # ------------------------------------------------------------------ the API
    def add(self, key) -> None:
        """Track ``key`` from now; adding a tracked key counts as activity."""
        if self._closed:
            raise Closed("this idle tracker is closed")
        if self.error is not None:
            raise ReaderFailed(f"this idle tracker failed: {self.error}") from self.error.__cause__
        if self._wheel is None:
            if self._unsent:
                encode_key(key)
                self._defer(key, True)  # behind the commands already waiting
            else:
                try:
                    self.client.add_idle(key, self.idle_ms)
                except RingFull:
                    self._defer(key, True)
            self._keys.add(key)
            return
        encode_key(key)  # the wheel's key rules, checked before anything changes
        now_ns = time.monotonic_ns()
        if key in self._last_ns:
            self._last_ns[key] = now_ns
            return
        deadline = _ceil_ms_of(now_ns) + self.idle_ms
        self._schedule(key, deadline)
        self._last_ns[key] = now_ns

    def remove(self, key) -> bool:
        """Stop tracking ``key``; True if it was tracked."""
        if self._wheel is None:
            if key not in self._keys:
                return False
            self._keys.discard(key)
            if self._closed:
                return True
            if self._unsent:
                self._defer(key, False)
            else:
                try:
                    self.client.cancel(key)
                except RingFull:
                    self._defer(key, False)
            return True
        if self._last_ns.pop(key, None) is None:
            return False
        if not self._closed:
            self._wheel.cancel(key)
        return True

    def __contains__(self, key) -> bool:
        return key in (self._keys if self._wheel is None else self._last_ns)

    def __len__(self) -> int:
        return len(self._keys if self._wheel is None else self._last_ns)

    def __aiter__(self):
        if self._queue is None:
            raise InvalidRequest("this tracker reports through on_idle; create it without one to iterate")
        return self

    async def __anext__(self):
        if self._queue.empty():
            if self.error is not None:
                raise ReaderFailed(f"this idle tracker failed: {self.error}") from self.error.__cause__
            if self._closed:
                raise StopAsyncIteration
        key = await self._queue.get()
        if key is _CLOSED:
            if self.error is not None:
                raise ReaderFailed(f"this idle tracker failed: {self.error}") from self.error.__cause__
            raise StopAsyncIteration
        return key

    async def flush(self, timeout_s: float = 10.0) -> None:
        """Daemon: return once the daemon applied every add/remove made so far (no-op in-process).

        Use this, not ``client.flush()``: the tracker's task is reading the client's
        socket, and the asyncio client does not support two readers at once. The
        task is paused around the flush; expirations read meanwhile are not lost.
        Raises :class:`ReaderFailed` once the tracker failed.
        """
        if self.error is not None:
            raise ReaderFailed(f"this idle tracker failed: {self.error}") from self.error.__cause__
        if self._wheel is not None or self._closed:
            return
        end = time.monotonic() + timeout_s
        async with self._flush_lock:  # one flush at a time: the client has one reader
            await self._pause_reader()
            try:
                await self.client.flush(timeout_s)
                while self._unsent:  # adds/removes that found the ring full: send them now there is room
                    self._send_unsent()
                    await self.client.flush(max(0.01, end - time.monotonic()))
            finally:
                if not self._closed and self.error is None:
                    self._task = self._loop.create_task(self._read_expirations(), name="wheeld-idle-expirations")

    async def aclose(self) -> None:
        """Stop reporting. Daemon timers of keys still tracked are cancelled (the client stays open).
        Does not raise for a failed tracker."""
        if self._closed:
            return
        self._closed = True
        if self._wheel is not None:
            if self._timer is not None:
                self._timer.cancel()
            self._wheel.close()
        else:
            if self._resend_task is not None:
                self._resend_task.cancel()
            async with self._flush_lock:
                await self._pause_reader()
                cancels = [key for key, add in self._unsent.items() if not add]
                self._unsent.clear()
                try:
                    for key in itertools.chain(self._keys, cancels):
                        while True:
                            try:
                                self.client.cancel(key)
                                break
                            except RingFull:
                                await self.client.flush()
                    await self.client.flush()
                except Exception:
                    log.debug("idle: cancelling the daemon timers on close failed", exc_info=True)
        if self._queue is not None:
            self._queue.put_nowait(_CLOSED)

    async def __aenter__(self) -> IdleTracker:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    # ------------------------------------------------------------------ delivery
    def _report(self, key) -> None:
        self.idle_total += 1
        if self._queue is not None:
            self._queue.put_nowait(key)
            return
        on_idle = self._on_idle
        assert on_idle is not None  # no queue: the tracker was given on_idle
        try:
            result = on_idle(key)
            if inspect.isawaitable(result):
                asyncio.ensure_future(result, loop=self._loop)
        except Exception:
            log.exception("idle: on_idle(%r) raised", key)

    def _fail(self, error: ReaderFailed) -> None:
        if self._closed or self.error is not None:
            return
        self.error = error
        if self._queue is not None:
            self._queue.put_nowait(_CLOSED)

    # ------------------------------------------------------------------ in-process wheel
    def _schedule(self, key, deadline_ms: int) -> None:
        assert self._wheel is not None  # the in-process backend's
        try:
            self._wheel.schedule(key, deadline_ms)
        except ArenaFull:
            self._grow()
            self._wheel.schedule(key, deadline_ms)
        if self._armed_ms is None or deadline_ms < self._armed_ms:
            self._arm(deadline_ms)

    def _grow(self) -> None:
        old = self._wheel
        assert old is not None  # the in-process backend's
        new = TimerWheel.create(old.capacity * 2, tick_ms=old.tick_ms, wheel_size=old.wheel_size,
                                start_ms=old.current_ms)
        for key, deadline, _group in old.pending():
            new.schedule(key, deadline)
        self._wheel = new
        old.close()

    def _arm(self, deadline_ms: int | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._armed_ms = deadline_ms
        if deadline_ms is not None:
            delay_s = max(0.0, (deadline_ms * 1_000_000 - time.monotonic_ns()) / 1e9)
            self._timer = self._loop.call_later(delay_s, self._fire)

    def _fire(self) -> None:
        """The loop timer: advance the wheel; re-arm touched keys, report the idle ones."""
        self._timer = None
        if self._closed or self.error is not None:
            return
        try:
            idle = self._advance()
        except Exception as exc:
            delay_s = self._backoff.failure(exc)
            if delay_s is None:
                self._fail(self._backoff.give_up_error("idle tracker: the wheel's timer stopped"))
                return
            self._armed_ms = -1  # adds meanwhile do not re-arm earlier: the retry is the next look
            self._timer = self._loop.call_later(delay_s, self._fire)
            return
        self._backoff.success()
        for key in idle:
            self._report(key)

    def _advance(self) -> list:
        wheel, last = self._wheel, self._last_ns
        assert wheel is not None  # the in-process backend's
        now_ms = time.monotonic_ns() // 1_000_000
        idle = []
        for key, _deadline in wheel.advance(now_ms):
            touched_ns = last.get(key)
            if touched_ns is None:
                continue  # removed meanwhile
            deadline = _ceil_ms_of(touched_ns) + self.idle_ms
            if deadline > now_ms:
                wheel.schedule(key, deadline)  # active since it was armed: lazy re-arm
            else:
                del last[key]
                idle.append(key)
        self._arm(wheel.next_deadline())  # a loop timer may fire early: then nothing was due
        return idle

    # ------------------------------------------------------------------ daemon
    async def _pause_reader(self) -> None:
        task = self._task
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass

    def _defer(self, key, add: bool) -> None:
        self._unsent.pop(key, None)
        self._unsent[key] = add
        self._start_resend()

    def _send_unsent(self) -> None:
        """Send the deferred adds and cancels, oldest first, until the ring is full again."""
        unsent, add_idle, cancel, idle_ms = self._unsent, self.client.add_idle, self.client.cancel, self.idle_ms
        while unsent:
            key = next(iter(unsent))
            try:
                if unsent[key]:
                    add_idle(key, idle_ms)
                else:
                    cancel(key)
            except RingFull:
                return
            del unsent[key]

    def _start_resend(self) -> None:
        if self._resend_task is None or self._resend_task.done():
            self._resend_task = self._loop.create_task(self._resend(), name="wheeld-idle-resend")

    async def _resend(self) -> None:
        backoff = Backoff(log, "idle tracker: sending adds that found the ring full", None)
        while self._unsent and not self._closed and self.error is None:
            try:
                await self.flush()
            except ReaderFailed:
                return
            except Exception as exc:
                delay_s = backoff.failure(exc)
                assert delay_s is not None  # a backoff without fail_after_s never gives up
                await asyncio.sleep(delay_s)
            else:
                backoff.success()

    async def _read_expirations(self) -> None:
        client, backoff = self.client, self._backoff
        while True:
            try:
                expired = await client.poll(None)
            except asyncio.CancelledError:
                raise
            except Closed as exc:
                if not self._closed:
                    error = ReaderFailed("idle tracker: its wheeld client was closed while the tracker ran")
                    error.__cause__ = exc
                    self._fail(error)
                return
            except Exception as exc:
                delay_s = backoff.failure(exc)
                if delay_s is None:
                    self._fail(backoff.give_up_error("idle tracker: the expiration reader stopped"))
                    return
                await asyncio.sleep(delay_s)
                continue
            backoff.success()
            keys = self._keys
            for e in expired:
                if e.key in keys:
                    keys.discard(e.key)
                    self._report(e.key)


_CLOSED = object()
