"""The wheeld daemon: the loop that drains client rings, drives the wheel and parks.

One process, one thread, one uvloop event loop. The pieces it drives:

* :mod:`~wheeld.daemon.sessions` (and :mod:`~wheeld.daemon.connection`,
  :mod:`~wheeld.daemon.client_table`): accept, Hello, allow-lists, client slots.
* :mod:`~wheeld.daemon.executor` and :mod:`~wheeld.daemon.planner`: ring commands
  applied to the wheel, a chunk at a time (planned when large, in order when few).
* :mod:`~wheeld.daemon.delivery`: expiry, idle re-arms, group queues, lateness,
  ``Expirations`` frames.
* :mod:`~wheeld.daemon.recorder` (``--journal``): the events of every chunk and
  expiry; :mod:`~wheeld.daemon.recovery` rebuilds a lost arena from them.

**The driver** (:meth:`Daemon._iterate`): drain every ring (up to 8192 commands
per ring and iteration, 1024 when a timer is already due, in chunks of 4096,
stopping between chunks as soon as the next timer's deadline has come; the ring
head is published only after a chunk is applied, so a daemon killed mid-chunk
re-applies it, and every command is idempotent), read the clock, expire, hand
what fired to the group's members, publish counters (at most once per ms while
busy), look at up to 256 timers of the next level-1 bucket and move those level
0 already reaches down to it, ahead of the bucket's boundary (``cascade_ahead``,
at most once per ms, ~75 us at 150k pending: the ~6.5k timers such a bucket
holds under load would otherwise be re-placed at the boundary, ~1.2 ms that the
timers due then wait for), then *park*.

**Parking** (:meth:`Daemon._park`) is an eventcount: store a new park epoch in
the status page's ``parked`` word, re-check every ring, and only then sleep
until the next bucket deadline. A client that pushes a command and sees a park
epoch it has not rung for rings the doorbell (one small frame); a client that
sees the daemon awake (0), or an epoch it already rang, rings nothing, so a
burst of commands costs one doorbell. A full fence sits between the store of
``parked`` and the re-check (and, in the client, between publishing the tail and
reading ``parked``); a missed wake-up is still bounded by ``max_park_ms``.

Delivery: a fired timer stays in the arena (state FIRED) until the client it was
sent to acknowledges it through its ring (``ACK slot generation``), after the
client library handed it to the application. If that client dies first, its
unacknowledged expirations go back to the group's queue and reach another
member; with no member connected they wait. After a daemon restart every FIRED
record is sent again (the client library drops duplicates it already handed
over); a timer whose deadline passed while the daemon was down is marked late.

Never early: ``expire(now)`` returns only timers with ``deadline <= now``; the
sleep is computed from the bucket heap and a wake-up that comes early simply
finds nothing due and sleeps again.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import threading
import time

from wheeld.protocol import accel
from wheeld.protocol import arena_layout as AL
from wheeld.protocol import status_layout as SL
from wheeld.protocol.naming import shm_path
from wheeld.shm.status import StatusPage
from wheeld.shm.wheel import TimerWheel

from .alarm import Alarm
from .config import Config
from .delivery import Delivery
from .executor import DRAIN_BATCH, Executor
from .host import real_host
from .instance import HeldSegment, InstanceLock
from .sdnotify import Notifier
from .sessions import MAINTAIN_S, Sessions
from .startup import open_arena, open_socket

log = logging.getLogger("wheeld")

_DRAIN_DUE = 1024  # commands taken from one ring when a timer is already due (about 1 ms of applying)
_BUSY_COMMANDS = 256  # an iteration that applied this many drains again at once; fewer: gather (coalesce_us)
_CASCADE_AHEAD = 256  # records of the next level-1 bucket looked at per ms (TimerWheel.cascade_ahead)
_PARKED_WORD = AL.H_PARKED // 8  # wheelctl's "at rest" word (the clients read the status page's)

#: the counters the daemon writes into the arena header (the wheel writes its own: TimerWheel.publish_stats)
DAEMON_TOTALS = AL.DAEMON_COUNTER_NAMES


def mono_ms() -> int:
    return time.monotonic_ns() // 1_000_000


def _full_fence(lock=threading.Lock()) -> None:
    """A locked instruction (x86-64): orders the parked store before the ring loads."""
    lock.acquire()
    lock.release()


class Daemon:
    """``clock``: the arena's clock in ms (CLOCK_MONOTONIC unless a test passes another)."""

    def __init__(self, config: Config, clock=mono_ms):
        self.config = config
        self.clock = clock
        self.host = real_host(clock)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.wheel: TimerWheel | None = None
        self.totals: dict[str, int] = dict.fromkeys(DAEMON_TOTALS, 0)
        self.sessions = Sessions(config, self.totals, self)
        self.clients = self.sessions.clients
        self.delivery: Delivery | None = None
        self.executor: Executor | None = None
        self.recorder = None  # the journal's Recorder, when --journal is given
        self.stopping = False
        self.ready = False
        self.listener = None
        self._owns_socket_path = False
        self.notifier = Notifier()
        self.started_ms = 0
        self.arena_epoch = 0
        self.lock: InstanceLock | None = None
        self.held: list[HeldSegment] = []  # the segments whose locks it holds (their names are checked)
        self._created: list[str] = []  # segments this start made (a refused start removes them)
        self._name_problem: str | None = None  # a lock file, arena or client table that lost its name
        self.status: StatusPage | None = None
        self._wake_future: asyncio.Future | None = None
        self._alarm: Alarm | None = None  # the park's precise wake-up (a timerfd), where Linux has it
        self._park_handle: asyncio.TimerHandle | None = None  # its stand-in without timerfd
        self._park_until_ns = 0  # when the current park ends (CLOCK_MONOTONIC ns)
        self._park_epoch = 0
        self._maintain_handle: asyncio.TimerHandle | None = None
        self._last_watchdog = 0.0
        self._last_publish = self._last_ahead = 0
        self._published = False  # the counters were published after everything this iteration wrote
        self._stats_pending = 0

    # ------------------------------------------------------------------ start-up
    def open_arena(self) -> None:
        """The arena (see :func:`wheeld.daemon.startup.open_arena`), the journal, delivery
        and the executor, and the client table. Call with the instance lock held."""
        cfg, totals = self.config, self.totals
        now = self.clock()
        qualifier = self.lock.qualifier if self.lock is not None else None
        opened = open_arena(cfg, now, self.host, qualifier)
        wheel = self.wheel = opened.wheel
        if opened.fresh:
            self._created.append(shm_path(wheel.name))
        self.held.append(HeldSegment("arena", wheel.name, opened.identity, self.host.shm))
        if not opened.fresh:
            hq = wheel.header_words()
            for counter in DAEMON_TOTALS:  # totals carry on across restarts (a damaged word clamped)
                totals[counter] = AL.sane_counter(hq[AL.H_COUNTERS // 8 + AL.COUNTER[counter]])
            totals["daemon_restarts_total"] += 1
        totals["arenas_set_aside_total"] += len(opened.set_aside)
        totals["arena_damaged_records_total"] += opened.damaged
        totals["arena_timers_lost_total"] += opened.lost
        if cfg.journal_dir:
            from .recovery import open_journal

            self.recorder = open_journal(cfg, wheel, opened.recovered, totals, next_lsn=opened.next_lsn)
            self.recorder.on_change = self._journal_changed
        self.started_ms = now
        # identifies the arena to clients: an ack stamped with another is ignored (Executor.ack_allowed)
        self.arena_epoch = (wheel.created_wall_ms & 0xFFFFFFFF) or 1
        totals["daemon_pid"] = os.getpid()
        totals["daemon_started_ms"] = now
        totals["daemon_hot_path"] = accel.PATH_CODES[accel.implementation()]
        poison = self.sessions.poison
        self.delivery = Delivery(wheel, self.clients, cfg, totals, now, poison, self.clock, self.recorder)
        self.executor = Executor(wheel, self.clients, self.arena_epoch, cfg.group_quota, totals, poison, self.clock,
                                 self.recorder)
        self.sessions.attach(wheel, self.delivery, self.executor, self.arena_epoch, self.recorder)
        for s in wheel.fired_slots():  # every fired-but-unacknowledged timer is delivered again
            _key, deadline, group, _tag, _aux, gen = wheel.fired(s)
            self.delivery.queues[group].append((s, gen, now, deadline < now))
        table = self.sessions.table
        table.open(wheel, self.clock(), self.host, qualifier)
        if table.created:
            self._created.append(shm_path(table.segment_name))
        self.held.append(HeldSegment("client table", table.segment_name, table.identity, self.host.shm))

    # ------------------------------------------------------------------ run
    def run(self) -> int:
        import uvloop

        return uvloop.run(self.main())

    async def main(self) -> int:
        self.loop = asyncio.get_running_loop()
        # One daemon per instance: the lock comes before anything is mapped for writing,
        # and the socket before the arena, so a second daemon changes nothing at all
        # (and a start refused later removes what it made: InstanceLock.abandon).
        self.lock = InstanceLock.acquire(self.config.name, self.host)
        try:
            metrics_server = await self._start()
        except BaseException:
            if self.listener is not None:
                self._close_listener()
            self.lock.abandon(self._created)
            raise
        self._publish(self.clock())  # ready means the arena's counters are this daemon's, not its predecessor's
        self.ready = True
        self.notifier.ready(status=self._status_line())
        log.info("wheeld %s ready on %s (pid %d, %s hot path)", self.config.name, self.config.socket_path, os.getpid(),
                 accel.implementation())
        try:
            await self._drive()
        finally:
            self.notifier.stopping()
            if metrics_server is not None:
                metrics_server.close()
            self._shutdown()
        return 0

    async def _start(self):
        """Everything between the instance lock and READY; the metrics server, if any."""
        self.listener, self._owns_socket_path = open_socket(self.config)
        self.open_arena()
        self.status = StatusPage.create(f"wheeld-{self.config.name}-status")
        self.sessions.serve(self.status, self.lock.secret)
        self._maintain_handle = self.loop.call_later(MAINTAIN_S, self._maintain)
        # Everything allocated so far lives as long as the daemon: move it out of the
        # collector's reach, so a full collection (3-7 ms over the ~30k objects of the
        # imported modules and the arena set-up) cannot stall the loop while timers are due.
        gc.collect()
        gc.freeze()
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.loop.add_signal_handler(sig, self.stop)
        metrics_server = None
        if self.config.metrics:  # before READY=1: a bad address must fail the start, not a running service
            from .metrics import start_metrics_server

            metrics_server = await start_metrics_server(self, self.config.metrics)
        self._listen()
        return metrics_server

    def _listen(self) -> None:
        """Readers for the listening socket and the park's alarm."""
        self.loop.add_reader(self.listener.fileno(), self.sessions.on_accept)
        self._alarm = Alarm.create()
        if self._alarm is not None:
            self.loop.add_reader(self._alarm.fileno(), self._on_alarm)
        else:
            log.warning("no timerfd: parking with the event loop's millisecond timer")

    def stop(self) -> None:
        log.info("stopping")
        self.stopping = True
        self.wake()

    def _shutdown(self) -> None:
        self.loop.remove_reader(self.listener.fileno())
        if self._alarm is not None:
            self.loop.remove_reader(self._alarm.fileno())
            self._alarm.close()
            self._alarm = None
        for session in list(self.sessions.sessions):
            self.sessions.close(session, "daemon shutting down", goodbye=True, resume=True)
        self.executor.drain()  # apply what is left (acks included) before the arena is closed
        self._publish(self.clock())
        self._close_listener()
        if self.recorder is not None:
            self.recorder.close()
        if self._maintain_handle is not None:
            self._maintain_handle.cancel()
        for cs in self.clients.values():
            if cs.segment is not None:
                cs.segment.close()
        self.status.close()
        self.wheel.close()
        self.lock.release()
        log.info("stopped; %d timers pending in the arena", self._stats_pending)
        if self.held and self.held[0].check() is not None:
            log.error("the arena these %d timers are in no longer has a name: they end with this process, "
                      "unless a journal rebuilds them at the next start", self._stats_pending)

    def _close_listener(self) -> None:
        self.listener.close()
        if self._owns_socket_path:
            try:
                os.unlink(self.config.socket_path)
            except FileNotFoundError:
                pass

    def _maintain(self) -> None:
        self._maintain_handle = self.loop.call_later(MAINTAIN_S, self._maintain)
        self.sessions.maintain()
        self._check_names()

    def _check_names(self) -> None:
        """Do the lock file and the segments still have their names? (see
        :mod:`wheeld.daemon.instance`); what is wrong goes into the status line too."""
        problems = [p for p in (self.lock.check(), *(held.check() for held in self.held)) if p]
        problem = problems[0] if problems else None
        if problem != self._name_problem:
            self._name_problem = problem
            self.notifier.status(self._status_line())

    # ------------------------------------------------------------------ driver
    async def _drive(self) -> None:
        self._park_epoch = self.wheel.header_words()[AL.H_WAKE_SEQ // 8]
        coalesce = self.config.coalesce_us
        while not self.stopping:
            commands = self._iterate()
            if commands >= _BUSY_COMMANDS or (commands and not coalesce):
                await asyncio.sleep(0)  # let sockets in, then drain again
                continue
            await self._park()

    def _iterate(self) -> int:
        """One pass of the loop (see the module docstring); returns the commands applied."""
        self.totals["loop_iterations_total"] += 1
        wheel, clock, delivery = self.wheel, self.clock, self.delivery
        # Timers already due go out before the commands gathered meanwhile are applied
        # (a cancel or re-arm that loses this race is dropped by the client library,
        # which knows its latest arming), and bound that drain, so a command flood
        # cannot hold expiry back for more than ~1 ms; the clock is read after the drain.
        due = wheel.next_deadline()
        if due is not None and due <= clock():
            delivery.expire(clock())
            delivery.dispatch()
            commands = self.executor.drain(_DRAIN_DUE)
        else:
            commands = self.executor.drain(DRAIN_BATCH, due)
        now = clock()
        delivery.expire(now)
        delivery.dispatch()
        if now != self._last_ahead:  # after this iteration's expirations went out; at most once per ms
            self._last_ahead = now
            wheel.cascade_ahead(now, _CASCADE_AHEAD)
        self._watchdog()
        if self.recorder is not None:
            self.recorder.tick(now)
        self.sessions.maybe_collect(now)
        # after everything this iteration writes into the arena, so that a park right
        # after it leaves counters that match the records (see _park)
        self._published = now != self._last_publish  # at most once per ms (and before a longer park)
        if self._published:
            self._last_publish = now
            self._publish(now)
        return commands

    def _watchdog(self) -> None:
        watchdog_s = self.notifier.watchdog_interval_s()
        if watchdog_s and time.monotonic() - self._last_watchdog >= watchdog_s:
            self._last_watchdog = time.monotonic()
            self.notifier.watchdog()
            self.notifier.status(self._status_line())

    async def _park(self) -> None:
        """Until the next deadline, a doorbell, or (commands arrive by the few) at most
        coalesce_us, so that one wake-up applies many of them: draining every handful
        of commands as it trickled in kept the daemon busy ~70% of a core."""
        hq, status_words = self.wheel.header_words(), self.status.words
        self._park_epoch += 1  # a new epoch: each client rings at most once per park
        hq[AL.H_WAKE_SEQ // 8] = status_words[SL.PARKED_WORD] = self._park_epoch
        _full_fence()
        gather = self.executor.rings_pending()
        coalesce_ns = self.config.coalesce_us * 1000
        if gather and not coalesce_ns:
            status_words[SL.PARKED_WORD] = 0
            return
        now = self.clock()
        timeout_ms = self._park_timeout(now)
        if timeout_ms > 1 and not self._published:  # a longer sleep: leave current counters
            self._last_publish = now
            self._publish(now)
            self._published = True
        if self._published:
            # for wheelctl: the arena is at rest and its counters match its records, until
            # the loop wakes or a callback clears it (arena_busy) before writing the arena
            hq[_PARKED_WORD] = self._park_epoch
        # wake at the start of the due millisecond, not timeout_ms after "now"
        # (the clock is floored: that would add up to 1 ms to every parked expiry),
        # with the timerfd: the loop's timer has whole-ms resolution (see alarm.py)
        wake_ns = (now + timeout_ms) * 1_000_000
        if gather:
            wake_ns = min(wake_ns, time.monotonic_ns() + coalesce_ns)
        if timeout_ms > 0 and not self.stopping:
            await self._sleep_until(wake_ns)
        hq[_PARKED_WORD] = status_words[SL.PARKED_WORD] = 0

    def _park_timeout(self, now: int) -> int:
        """How long the park may last: to the next deadline, at most ``max_park_ms``, the
        watchdog's interval and the journal's next sync."""
        next_deadline = self.wheel.next_deadline()
        max_park = self.config.max_park_ms
        timeout_ms = max_park if next_deadline is None else min(max_park, next_deadline - now)
        watchdog_s = self.notifier.watchdog_interval_s()
        if watchdog_s:
            timeout_ms = min(timeout_ms, int(watchdog_s * 1000))
        if self.recorder is not None and self.recorder.sync_due_ms() is not None:
            timeout_ms = min(timeout_ms, self.recorder.sync_due_ms() - now)
        return timeout_ms

    async def _sleep_until(self, wake_ns: int) -> None:
        fut = self._wake_future = self.loop.create_future()
        self._wake_at(wake_ns)
        await fut
        self._wake_future = None
        if self._park_handle is not None:
            self._park_handle.cancel()
            self._park_handle = None
        self.totals["wakeups_total"] += 1

    def wake(self) -> None:
        fut = self._wake_future
        if fut is not None and not fut.done():
            fut.set_result(None)

    def soft_wake(self) -> None:
        """A doorbell nobody waits on (commands pushed, no flush, room in the ring): wake
        ``coalesce_us`` later, or sooner for a due timer or an urgent doorbell, so one
        wake-up applies what many pushes brought. Without it, a paced client woke the
        daemon for every ~4 commands (14k wake-ups/s, ~70 us each: a whole core)."""
        fut = self._wake_future
        if fut is None or fut.done():
            return  # not parked: the loop drains anyway
        at_ns = time.monotonic_ns() + self.config.coalesce_us * 1000
        if at_ns < self._park_until_ns:  # else the park ends sooner anyway
            self._wake_at(at_ns)

    def _wake_at(self, at_ns: int) -> None:
        """End the current park at ``at_ns`` (CLOCK_MONOTONIC), replacing the earlier setting."""
        self._park_until_ns = at_ns
        if self._alarm is not None:
            self._alarm.arm(at_ns)
            return
        if self._park_handle is not None:
            self._park_handle.cancel()
        self._park_handle = self.loop.call_later(max(0.0, (at_ns - time.monotonic_ns()) / 1e9), self.wake)

    def _on_alarm(self) -> None:
        if self._alarm.consume():
            self.wake()

    # ------------------------------------------------------------------ counters
    def arena_busy(self) -> None:
        """A callback that may write the arena outside the loop's iteration (a client's
        message, a closed session, maintenance) calls this first: the arena stops
        counting as at rest for wheelctl's copies (:func:`wheeld.shm.check.check`) until
        the loop parks again with its counters published."""
        self.wheel.header_words()[_PARKED_WORD] = 0

    def _publish(self, now: int) -> None:
        """Counters into the arena header: the wheel's own (it writes them), then the daemon's."""
        wheel, totals, delivery = self.wheel, self.totals, self.delivery
        totals["daemon_heartbeat_ms"] = now
        totals["clients_connected"] = self.sessions.connected()
        totals["groups_active"] = sum(1 for members in delivery.members.values() if members)
        totals["undelivered"] = delivery.undelivered()
        if self.recorder is not None:
            journal = self.recorder.journal
            totals["journal_lsn"] = journal.last_lsn
            totals["journal_durable_lsn"] = journal.durable_lsn
        wheel.publish_stats()
        hq = wheel.header_words()
        counters = AL.H_COUNTERS // 8
        self.status.publish(wheel.capacity, hq[counters + AL.COUNTER["pending"]],
                            hq[counters + AL.COUNTER["fired_unacked"]])
        delivery.lateness.publish(hq, totals)
        for name, value in totals.items():
            hq[counters + AL.COUNTER[name]] = value
        self._stats_pending = len(wheel)
        if self.config.group_quota:
            self.sessions.publish_group_full()

    def _status_line(self) -> str:
        w = self.wheel
        line = f"{len(w)} pending, {len(self.sessions.sessions)} clients, {w.counters()['fired_unacked']} awaiting ack"
        unavailable = self.recorder.unavailable if self.recorder is not None else None
        if unavailable:
            line += f"; JOURNAL NOT WRITABLE ({unavailable}): flush() fails, timers still fire"
        return f"ERROR: {self._name_problem}; {line}" if self._name_problem else line

    def _journal_changed(self) -> None:
        """The journal stopped or started being writable: tell systemd (``STATUS=``) at once."""
        if self.ready:
            self.notifier.status(self._status_line())


def run(config: Config) -> int:
    return Daemon(config).run()
