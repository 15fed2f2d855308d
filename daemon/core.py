"""The daemon's core: every decision of wheeld, and no I/O.

The core owns the wheel, the client sessions, the journal's recorder and the
counters. It performs no I/O itself: it reads the clocks, the disk, named shared
memory, the user database and randomness through the :class:`~wheeld.daemon.host.Host`
it is given, talks to each client through a :class:`~wheeld.daemon.host.Transport`,
and asks its :class:`~wheeld.daemon.host.Shell` to wake it. Two shells drive it:
the real daemon (:mod:`wheeld.daemon.server`: uvloop, sockets, a timerfd,
signals, sd_notify) and the simulator (``tests/sim``: a seeded, simulated world
in one process). The shells hold no decision: whatever they do about a timer, a
client or a byte on disk, they do because the core said so.

The pieces it drives:

* :mod:`~wheeld.daemon.sessions` (and :mod:`~wheeld.daemon.connection`,
  :mod:`~wheeld.daemon.client_table`): connections, Hello, allow-lists, client slots.
* :mod:`~wheeld.daemon.executor` and :mod:`~wheeld.daemon.planner`: ring commands
  applied to the wheel, a chunk at a time (planned when large, in order when few).
* :mod:`~wheeld.daemon.delivery`: expiry, idle re-arms, group queues, lateness,
  ``Expirations`` frames.
* :mod:`~wheeld.daemon.recorder` (``--journal``): the events of every chunk and
  expiry; :mod:`~wheeld.daemon.recovery` rebuilds a lost arena from them.

**Events** (the shell calls): :meth:`DaemonCore.acquire` and :meth:`DaemonCore.open`
at start; :meth:`connected`, :meth:`received`, :meth:`writable`, :meth:`hangup` for
connections; :meth:`iterate` and :meth:`park` / :meth:`unpark` for the loop;
:meth:`maintain` once a second; :meth:`shutdown` at the end.

**The iteration** (:meth:`DaemonCore.iterate`): drain every ring (up to 8192
commands per ring and iteration, 1024 when a timer is already due, in chunks,
stopping between chunks as soon as the next timer's deadline has come; the ring
head is published only after a chunk is applied, so a daemon killed mid-chunk
re-applies it, and every command is idempotent), read the clock, expire, hand
what fired to the group's members, publish counters (at most every
``PUBLISH_EVERY_MS`` while the loop wakes every millisecond, and always before a longer
park), look at up to 256 timers of the next level-1 bucket and move those level
0 already reaches down to it, ahead of the bucket's boundary (``cascade_ahead``,
at most once per ms: the thousands of timers such a bucket holds under load would
otherwise be re-placed at the boundary, delaying the timers due then), then *park*.

**Parking** (:meth:`DaemonCore.park`) is an eventcount: store a new park epoch in
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
record is sent again: to the client it was last sent to first (the record keeps
that client's slot, and the client resumes it: its library drops a copy of what
it already handed over, and acknowledges it), to the group once that slot is
freed, or at once when no recipient is known (see :mod:`~wheeld.daemon.delivery`,
"Recipients"); a timer whose deadline passed while the daemon was down is marked late.

Never early: ``expire(now)`` returns only timers with ``deadline <= now``; the
sleep is computed from the bucket heap and a wake-up that comes early simply
finds nothing due and sleeps again.
"""

from __future__ import annotations

import logging
import threading

from wheeld.protocol import accel
from wheeld.protocol import arena_layout as AL
from wheeld.protocol import status_layout as SL
from wheeld.protocol.naming import shm_path
from wheeld.shm.status import StatusPage
from wheeld.shm.wheel import TimerWheel

from .config import EXIT_FENCED, Config
from .delivery import Delivery
from .executor import DRAIN_BATCH, Executor
from .host import Host, Shell
from .instance import HeldSegment, InstanceLock
from .sessions import Sessions
from .startup import open_arena

log = logging.getLogger("wheeld")

_DRAIN_DUE = 1024  # commands taken from one ring when a timer is already due (about 1 ms of applying)
_BUSY_COMMANDS = 256  # an iteration that applied this many drains again at once; fewer: gather (coalesce_us)
PUBLISH_EVERY_MS = 10  # counters published at most this often while parks are 1 ms (always before a longer one)
_CASCADE_AHEAD = 256  # records of the next level-1 bucket looked at per ms (TimerWheel.cascade_ahead)
_PARKED_WORD = AL.H_PARKED // 8  # wheelctl's "at rest" word (the clients read the status page's)
_COUNTER_WORD = {name: AL.H_COUNTERS // 8 + index for name, index in AL.COUNTER.items()}  # its header word
_PENDING_WORD = _COUNTER_WORD["pending"]
_FIRED_UNACKED_WORD = _COUNTER_WORD["fired_unacked"]

#: the counters the daemon writes into the arena header (the wheel writes its own: TimerWheel.publish_stats)
DAEMON_TOTALS = AL.DAEMON_COUNTER_NAMES


_FENCE_LOCK = threading.Lock()


def _full_fence() -> None:
    """A locked instruction (x86-64): orders the parked store before the ring loads."""
    _FENCE_LOCK.acquire()
    _FENCE_LOCK.release()


class DaemonCore:
    """wheeld's decisions over ``host`` (see the module docstring); ``shell`` drives it."""

    def __init__(self, config: Config, host: Host, shell: Shell):
        self.config = config
        self.host = host
        self.shell = shell
        self.clock = host.clock_ms
        self.wheel: TimerWheel | None = None
        self.totals: dict[str, int] = dict.fromkeys(DAEMON_TOTALS, 0)
        self.sessions = Sessions(config, self.totals, self)
        self.clients = self.sessions.clients
        self.delivery: Delivery | None = None
        self.executor: Executor | None = None
        self.recorder = None  # the journal's Recorder, when --journal is given
        self.stopping = False
        self.ready = False
        self.started_ms = 0
        self.arena_epoch = 0
        self.lock: InstanceLock | None = None
        self.held: list[HeldSegment] = []  # the segments whose locks it holds (their names are checked)
        self.created: list[str] = []  # segments this start made (a refused start removes them)
        self.name_problem: str | None = None  # a lock file, arena or client table that lost its name
        self.status: StatusPage | None = None
        self.watchdog_ms = 0  # the shell's watchdog interval: no park lasts longer (0: none)
        self._parked = False  # between park() returning a time and unpark()
        self._park_until_ns = 0  # when the current park ends (the host's clock_ns)
        self._park_epoch = 0
        self._last_ahead = 0
        self._last_publish = -(1 << 62)  # the first iteration publishes
        self._published = False  # the counters were published after everything this iteration wrote
        self.stats_pending = 0
        self.replication = None  # --replicate (wheeld.daemon.replication)
        self.fenced_reason: str | None = None
        self.exit_code = 0

    # ------------------------------------------------------------------ start-up
    def acquire(self) -> None:
        """The instance lock: before anything is mapped for writing (and before the shell
        opens the socket), so a second daemon of the name changes nothing at all."""
        self.lock = InstanceLock.acquire(self.config.name, self.host)

    def abandon(self) -> None:
        """A start refused after :meth:`acquire`: remove what it made, drop the lock."""
        if self.lock is not None:
            self.lock.abandon(self.created)

    def open(self) -> None:
        """The arena (see :func:`wheeld.daemon.startup.open_arena`), the journal, delivery
        and the executor, the client table and the status page. Call after :meth:`acquire`."""
        cfg, totals = self.config, self.totals
        now = self.clock()
        qualifier = self.lock.qualifier if self.lock is not None else None
        opened = open_arena(cfg, now, self.host, qualifier)
        wheel = self.wheel = opened.wheel
        if opened.fresh:
            self.created.append(shm_path(wheel.name))
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

            self.recorder = open_journal(cfg, wheel, opened.recovered, totals, next_lsn=opened.next_lsn, host=self.host,
                                         known_idle=opened.idle_ms)
            self.recorder.on_change = self.shell.status_changed
        self.started_ms = now
        # identifies the arena to clients: an ack stamped with another is ignored (Executor.ack_allowed)
        self.arena_epoch = (wheel.created_wall_ms & 0xFFFFFFFF) or 1
        totals["daemon_pid"] = self.host.pid
        totals["daemon_started_ms"] = now
        totals["daemon_hot_path"] = accel.PATH_CODES[accel.implementation()]
        poison = self.sessions.poison
        self.delivery = Delivery(wheel, self.clients, cfg, totals, now, poison, self.clock, self.recorder)
        if self.recorder is not None:  # a snapshot takes idle timers' idle_ms from their touch tables
            self.recorder.idle_source = self.delivery.idle_ms_of
        self.executor = Executor(wheel, self.clients, self.arena_epoch, cfg.group_quota, totals, poison, self.clock,
                                 self.recorder, self.host.clock_ns)
        self.sessions.attach(wheel, self.delivery, self.executor, self.arena_epoch, self.recorder)
        table = self.sessions.table
        table.open(wheel, self.clock(), self.host, qualifier)
        if table.created:
            self.created.append(shm_path(table.segment_name))
        self.held.append(HeldSegment("client table", table.segment_name, table.identity, self.host.shm))
        self._open_replication()
        self._redeliver_fired(now)
        self.status = StatusPage.create(f"wheeld-{cfg.name}-status")
        self.sessions.serve(self.status, self.lock.secret)
        self._park_epoch = wheel.header_words()[AL.H_WAKE_SEQ // 8]

    def _open_replication(self) -> None:
        """``--replicate``: the journal's appends and snapshots go to the shell's replicator
        too, the stream starts with a snapshot, and (``--durability replicated``) flush
        answers wait for the stream (:mod:`wheeld.daemon.replication`)."""
        replicator = getattr(self.shell, "replicator", None)
        if replicator is None or self.recorder is None:
            return
        from .executor import answer_chunk
        from .replication import Replication

        cfg = self.config
        self.recorder.journal.tap = self.recorder.replica = replicator
        self.replication = Replication(replicator, cfg.durability, int(cfg.replicate_timeout_s * 1000), self.clock,
                                       self.totals, answer_chunk)
        self.executor.replication = self.replication
        self.recorder.snapshot()

    def replication_progress(self) -> None:
        """The stream stored more, or the lease or the replicator's state changed: answer
        what waited, send what the lease held back (the next iteration)."""
        if self.replication is not None:
            self.replication.release(self.clock())
        self.wake()

    def fenced(self, reason: str) -> None:
        """Another host took this host's timers over: stand down (nothing more is sent;
        the daemon exits with EXIT_FENCED)."""
        self.fenced_reason = reason
        self.exit_code = EXIT_FENCED
        self.shell.status_changed()
        self.stop()

    def adopt(self, host: str, state) -> tuple[int, int, int]:
        """A lost host's timers into this arena (:func:`wheeld.daemon.replication.adopt_timers`);
        the journal (and so this host's stream) records them as this host's own."""
        from .recovery import host_clocks
        from .replication import adopt_timers

        self.arena_busy()
        result = adopt_timers(self.wheel, self.recorder, self.clock, host, state, self.delivery.late_marks,
                              clocks=host_clocks(self.host))
        self.wake()
        return result

    def _may_deliver(self) -> bool:
        replication = self.replication
        return replication is None or replication.replicator.lease_ok(self.clock())

    def _redeliver_fired(self, now: int) -> None:
        """Every fired-but-unacknowledged timer is delivered again: to the client it was last
        sent to first, when the client table still holds that client's slot (it waits for
        the client to resume the slot, and goes to the group once the slot is freed), else
        to its group."""
        wheel, delivery, clients = self.wheel, self.delivery, self.clients
        for s in wheel.fired_slots():
            _key, deadline, group, _tag, aux, gen = wheel.fired(s)
            if aux >= 0 and delivery.recheck_idle(s, aux, now):
                continue  # an idle timer expired but not sent: its touches were maybe never read
            entry = (s, gen, now, deadline < now)
            recipient = AL.recipient_of(aux)
            cs = clients.get(recipient) if recipient is not None else None
            if cs is not None and cs.group == group:
                delivery.hold(cs.slot, group, entry)
            else:
                delivery.queues[group].append(entry)

    def mark_ready(self) -> None:
        """Serving: the counters are published (they are this daemon's now, not its predecessor's)."""
        self.publish(self.clock())
        self.ready = True

    # ------------------------------------------------------------------ connections
    def connected(self, transport, pid: int, uid: int, gid: int):
        """A connection accepted (credentials from SO_PEERCRED, -1 when unknown): its session,
        or None when refused at once. The shell hands its reads to :meth:`received`."""
        return self.sessions.connected(transport, pid, uid, gid)

    @staticmethod
    def received(session, data: bytes, fds: list[int]) -> None:
        """Bytes read from a connection (with the descriptors passed along); ``b""``: end of stream."""
        session.received(data, fds)

    @staticmethod
    def writable(session) -> None:
        """A connection that waited can take more bytes."""
        session.writable()

    def hangup(self, session, reason: str) -> None:
        """The connection failed (a read error)."""
        self.sessions.close(session, reason)

    def accept_paused(self, error: str) -> None:
        """The shell stopped accepting for a while (out of descriptors)."""
        self.sessions.accept_paused(error)

    # ------------------------------------------------------------------ the loop
    def iterate(self) -> bool:
        """One pass of the loop (see the module docstring). True: go again at once (after
        letting the connections in): it applied enough commands that more are likely."""
        self.totals["loop_iterations_total"] += 1
        wheel, clock, delivery = self.wheel, self.clock, self.delivery
        # Timers already due go out before the commands gathered meanwhile are applied
        # (a cancel or re-arm that loses this race is dropped by the client library,
        # which knows its latest arming), and bound that drain, so a command flood
        # cannot hold expiry back for more than ~1 ms; the clock is read after the drain.
        due = wheel.next_deadline()
        may_deliver = self.replication is None or self._may_deliver()
        if due is not None and due <= clock():
            delivery.expire(clock())
            if may_deliver:
                delivery.dispatch()
            commands = self.executor.drain(_DRAIN_DUE)
        else:
            commands = self.executor.drain(DRAIN_BATCH, due)
        now = clock()
        delivery.expire(now)
        if may_deliver:
            delivery.dispatch()
        if self.replication is not None:
            self.replication.release(now)
        if now != self._last_ahead:  # after this iteration's expirations went out; at most once per ms
            self._last_ahead = now
            wheel.cascade_ahead(now, _CASCADE_AHEAD)
            delivery.rearm_ahead(now)
        if self.recorder is not None:
            self.recorder.tick(now)
        self.sessions.maybe_collect(now)
        # after everything this iteration writes into the arena, so that a park right
        # after it leaves counters that match the records (see park)
        # at most every PUBLISH_EVERY_MS (and before a longer park: see park)
        self._published = now - self._last_publish >= PUBLISH_EVERY_MS
        if self._published:
            self._last_publish = now
            self.publish(now)
        return commands >= _BUSY_COMMANDS or (commands > 0 and not self.config.coalesce_us)

    def park(self) -> int | None:
        """Start parking: until the next deadline, a doorbell, or (commands arrive by the
        few) at most ``coalesce_us``, so that one wake-up applies many of them. Returns
        when the park ends (the host's ``clock_ns``), or None: do not sleep, iterate again.
        The shell sleeps until then or until :meth:`Shell.wake`, then calls :meth:`unpark`."""
        hq, status_words = self.wheel.header_words(), self.status.words
        now = self.clock()
        timeout_ms = self._park_timeout(now)
        coalesce_ns = self.config.coalesce_us * 1000
        # Before the epoch, the park's quiet_from (status_layout): a client that reads the new
        # epoch reads its end, never an older park's. Commands found below only make the park
        # shorter: the word then says later than it could, and a client rings, as without it.
        status_words[SL.QUIET_FROM_WORD] = (now + timeout_ms) * 1_000_000 - coalesce_ns \
            if coalesce_ns and timeout_ms > 0 else 0
        self._park_epoch += 1  # a new epoch: each client rings at most once per park
        hq[AL.H_WAKE_SEQ // 8] = status_words[SL.PARKED_WORD] = self._park_epoch
        _full_fence()
        gather = self.executor.rings_pending()
        if gather and not coalesce_ns:
            status_words[SL.PARKED_WORD] = 0
            return None
        if timeout_ms > 1 and not self._published:  # a longer sleep: leave current counters
            self._last_publish = now
            self.publish(now)
            self._published = True
        if self._published:
            # for wheelctl: the arena is at rest and its counters match its records, until
            # the loop wakes or a callback clears it (arena_busy) before writing the arena
            hq[_PARKED_WORD] = self._park_epoch
        if timeout_ms <= 0 or self.stopping:
            hq[_PARKED_WORD] = status_words[SL.PARKED_WORD] = 0
            return None
        # wake at the start of the due millisecond, not timeout_ms after "now"
        # (the clock is floored: that would add up to 1 ms to every parked expiry)
        wake_ns = (now + timeout_ms) * 1_000_000
        if gather:
            wake_ns = min(wake_ns, self.host.clock_ns() + coalesce_ns)
        self._parked = True
        self._park_until_ns = wake_ns
        return wake_ns

    def unpark(self) -> None:
        """The park is over (its time came, or the shell was woken)."""
        hq, status_words = self.wheel.header_words(), self.status.words
        hq[_PARKED_WORD] = status_words[SL.PARKED_WORD] = 0
        self._parked = False
        self.totals["wakeups_total"] += 1

    def _park_timeout(self, now: int) -> int:
        """How long the park may last: to the next deadline, at most ``max_park_ms``, the
        watchdog's interval and the journal's next sync."""
        next_deadline = self.wheel.next_deadline()
        max_park = self.config.max_park_ms
        timeout_ms = max_park if next_deadline is None else min(max_park, next_deadline - now)
        if self.watchdog_ms:
            timeout_ms = min(timeout_ms, self.watchdog_ms)
        if self.recorder is not None and self.recorder.sync_due_ms() is not None:
            timeout_ms = min(timeout_ms, self.recorder.sync_due_ms() - now)
        if self.replication is not None:
            held_until = self.replication.next_timeout_ms()
            if held_until is not None:
                timeout_ms = min(timeout_ms, held_until - now)
        return timeout_ms

    def wake(self) -> None:
        """End the current park now (someone waits: a flush, a full ring, a closed session)."""
        if self._parked:
            self.shell.wake()

    def soft_wake(self) -> None:
        """A doorbell nobody waits on (commands pushed, no flush, room in the ring): end the
        park ``coalesce_us`` from now, or sooner for a due timer or an urgent doorbell, so
        one wake-up applies what many pushes brought (a paced client would otherwise wake
        the daemon for every few commands)."""
        if not self._parked:
            return  # not parked: the loop drains anyway
        now_ns = self.host.clock_ns()
        at_ns = now_ns + self.config.coalesce_us * 1000
        if at_ns < self._park_until_ns:  # else the park ends sooner anyway
            self._park_until_ns = at_ns
            if at_ns != now_ns:  # (with a window: the other clients' doorbells change nothing now)
                self.status.words[SL.QUIET_FROM_WORD] = now_ns
            self.shell.wake_at(at_ns)

    def stop(self) -> None:
        log.info("stopping")
        self.stopping = True
        self.wake()

    def maintain(self) -> None:
        """Once a second: timeouts of sessions, the names of the held segments."""
        self.sessions.maintain()
        self.sessions.table.forget_armings_at_start(self.clock())
        problems = [p for p in (self.lock.check(), *(held.check() for held in self.held)) if p]
        problem = problems[0] if problems else None
        if problem != self.name_problem:
            self.name_problem = problem
            self.shell.status_changed()

    def shutdown(self) -> None:
        """Close every session (clients keep their rings to hand back), apply what is left,
        publish, close the journal and the segments, drop the lock."""
        for session in list(self.sessions.sessions):
            self.sessions.close(session, "daemon shutting down", goodbye=True, resume=True)
        self.executor.drain()  # apply what is left (acks included) before the arena is closed
        self.publish(self.clock())
        if self.recorder is not None:
            self.recorder.close()
        for cs in self.clients.values():
            if cs.segment is not None:
                cs.segment.close()
        self.status.close()
        self.wheel.close()
        self.lock.release()
        log.info("stopped; %d timers pending in the arena", self.stats_pending)
        if self.held and self.held[0].check() is not None:
            log.error("the arena these %d timers are in no longer has a name: they end with this process, "
                      "unless a journal rebuilds them at the next start", self.stats_pending)

    # ------------------------------------------------------------------ counters
    def arena_busy(self) -> None:
        """A callback that may write the arena outside the loop's iteration (a client's
        message, a closed session, maintenance) calls this first: the arena stops
        counting as at rest for wheelctl's copies (:func:`wheeld.shm.check.check`) until
        the loop parks again with its counters published."""
        self.wheel.header_words()[_PARKED_WORD] = 0

    def publish(self, now: int) -> None:
        """Counters into the arena header: the wheel's own (it writes them), then the daemon's."""
        wheel, totals, delivery = self.wheel, self.totals, self.delivery
        totals["daemon_heartbeat_ms"] = now
        totals["clients_connected"] = self.sessions.connected_clients()
        totals["groups_active"] = sum(map(bool, delivery.members.values()))
        totals["undelivered"] = delivery.undelivered()
        if self.recorder is not None:
            journal = self.recorder.journal
            totals["journal_lsn"] = journal.last_lsn
            totals["journal_durable_lsn"] = journal.durable_lsn
        if self.replication is not None:
            fleet = self.replication.replicator.stats()
            totals["fleet_state"] = AL.FLEET_STATES.index(fleet["fleet_state"])
            totals["fleet_lag_records"] = fleet["fleet_lag_records"]
            totals["fleet_lag_ms"] = fleet["fleet_lag_ms"]
        wheel.publish_stats()
        hq = wheel.header_words()
        self.status.publish(wheel.capacity, hq[_PENDING_WORD], hq[_FIRED_UNACKED_WORD])
        delivery.lateness.publish(hq, totals)
        wheel.store_words(_COUNTER_WORD, totals)
        self.stats_pending = len(wheel)
        if self.config.group_quota:
            self.sessions.publish_group_full()

    def status_line(self) -> str:
        """One line for systemd's ``STATUS=``."""
        w = self.wheel
        line = f"{len(w)} pending, {len(self.sessions.sessions)} clients, {w.counters()['fired_unacked']} awaiting ack"
        if self.fenced_reason:
            line += f"; FENCED, STANDING DOWN: {self.fenced_reason}"
        elif self.replication is not None:
            r = self.replication.replicator
            line += f"; fleet {r.host} {r.state} (epoch {r.epoch})"
        unavailable = self.recorder.unavailable if self.recorder is not None else None
        if unavailable:
            line += f"; JOURNAL NOT WRITABLE ({unavailable}): flush() fails, timers still fire"
        return f"ERROR: {self.name_problem}; {line}" if self.name_problem else line
