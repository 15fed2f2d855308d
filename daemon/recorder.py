"""The daemon's side of the journal: what it records and when it syncs (the Recorder).

``wheeld --journal DIR --fsync POLICY`` turns this on. The arena survives a crash
of the daemon; the journal is for when the arena itself is gone (a reboot, or
/dev/shm cleared). The format and the writer live in ``wheeld.protocol.journal``
and ``wheeld.journal.files``; this module only decides what to write, and
:mod:`wheeld.daemon.recovery` reads it back into a new arena.

Ordering with the rings (what makes ``always`` mean "on disk before flush()
returns"): for each drained batch the daemon applies the commands to the arena,
appends their events (``always``: fsync inside the append), and only then
publishes the ring head and answers ``Applied`` to a flush. A daemon killed
before the append re-reads the same commands from the ring after restart and
applies (and journals) them again; every command is idempotent.

Clocks: the arena runs on CLOCK_MONOTONIC ms, which restarts at boot; the
journal stores wall-clock ms. Each batch converts with one offset read at its
start. Recovery converts back, so a timer due while the host was down is due
at once and fires marked ``late`` (like systemd's ``Persistent=``).

Snapshots bound recovery time: every ``snapshot_every_events`` journaled events
(or ``snapshot_every_s``) the pending and fired-unacknowledged timers are
written as a snapshot and the segments it covers are deleted. The snapshot is
written from the loop (it pauses the loop in proportion to the pending timers:
docs/figures.md). An idle timer is snapshotted at its current deadline with its idle
time (``i``), as its ``add`` was journaled: a record of it damaged later is restored
from the journal as the idle timer it is (:mod:`wheeld.daemon.reconcile`), never as a
plain timer at that deadline, which its client's touches may have passed. The idle
time comes from its client's touch table (:attr:`Recorder.idle_source`); while that
table is out of reach (a slot still waiting for its client after a restart) from the
journal read at start (``known_idle``); a timer neither knows is written plain.

When the journal cannot be written (a full disk, a quota, an I/O error, a
read-only remount) the daemon keeps serving: commands are applied to the arena
and timers fire as ever, but nothing is acknowledged as durable -- every FLUSH
answered meanwhile is refused with ``JournalUnavailable`` (the executor asks
:attr:`Recorder.unavailable`). The journal numbers the events it cannot write
and drops them: the arena holds their result. About once a second
(:data:`RETRY_S`, and never more often than ten times what a failed attempt
cost) the Recorder tries :meth:`~wheeld.journal.files.Journal.resume`,
which writes a snapshot of the arena and opens a new segment: from then on
everything the arena holds is durable again, and so is every command applied
during the stall. The state is logged (an ERROR when it starts, again every
minute, a WARNING when it ends), counted in the arena (``journal_stalled``: the
errno, 0 when writable; ``journal_stalls_total``;
``journal_unwritten_events_total``; ``journal_flushes_refused_total``) and told
to systemd (``STATUS=``, through :attr:`Recorder.on_change`).

Replication (``--replicate``): the Recorder also journals what the replicator
(:attr:`Recorder.replica`) reports, as ``repl`` events (:class:`wheeld.protocol.journal.Repl`:
state, replicated lsn, lag in events and ms, host id, epoch), so that the journal
pipeline can tell which hosts fell behind the stream, and when. One is written from
:meth:`Recorder.tick` at once when the replicator's state differs from the last one
journaled, else every :data:`~wheeld.protocol.journal.REPL_EVERY_MS` (10 s; the loop
ticks at least every ``max_park_ms``), and a last one when the journal closes; the
tick compares the time it is given and the state, and reads no clock. They go through
the same append as the timer events (numbered, fsynced per policy, replicated, compacted);
none is written while the journal cannot be written. Recovery skips them. They alone
do not make a time-based snapshot due (an idle daemon would write, and send to the
stream, a snapshot of all its timers every ``snapshot_every_s`` for them), except
once a day's worth (:data:`REPL_SNAPSHOT_SAMPLES`) has gathered.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import numpy as np

from wheeld.protocol import arena_layout as AL
from wheeld.protocol import fsport
from wheeld.protocol import journal as J
from wheeld.protocol.clock import mono_ms
from wheeld.protocol.keys import TYPE_INT, TYPE_STR, decode_key, key_length, key_type
from wheeld.shm.wheel import TimerWheel

from wheeld.protocol.errors import JournalUnavailable
from wheeld.journal.files import (
    FiredTimer,
    Journal,
    PendingTimer,
    clock_offset_ns_above,
    describe_error,
)

log = logging.getLogger("wheeld.journal")

_UNSET = J.UNSET
_JOURNAL_OPEN = AL.H_JOURNAL_OPEN // 8

_LSN_WORD = AL.H_COUNTERS // 8 + AL.COUNTER["journal_lsn"]
_DURABLE_WORD = AL.H_COUNTERS // 8 + AL.COUNTER["journal_durable_lsn"]
RETRY_S = 1.0  # a stalled journal is tried again this often...
RETRY_COST_FACTOR = 10  # ...and no more often than this many times what the last failed attempt took
STILL_STALLED_LOG_S = 60.0  # a stall that goes on is logged again this often
# free bytes a resume's snapshot needs at the least (a snapshot line holds a timer's group, key,
# deadline and seq with its crc: more than this per timer): below this it is not even encoded
MIN_SNAPSHOT_BYTES_PER_TIMER = 64
MIN_SNAPSHOT_BYTES = 64 << 10
#: repl events alone make a time-based snapshot due once there are this many since the last
#: snapshot (a day of them at one per REPL_EVERY_MS): the journal and the stream of an idle
#: replicating daemon stay bounded, and it is not snapshotted every snapshot_every_s for them
REPL_SNAPSHOT_SAMPLES = 86_400_000 // J.REPL_EVERY_MS


def wall_offset_ms(mono_ns: Callable[[], int] | None = None, wall_ns: Callable[[], int] | None = None) -> int:
    """Wall-clock ms minus monotonic ms, rounded up: what turns an arena deadline into the journal's.

    The monotonic clock is read first (the tightest of a few bracketed readings,
    :func:`~wheeld.journal.files.clock_offset_ns_above`), so ``wall - mono`` in ns
    is at least the true offset between the clocks; rounding it up keeps every journaled
    wall-clock deadline at or after the moment the monotonic deadline stood
    for (at most 1 ms after), and recovery rounds up again on its way back
    (:func:`wheeld.journal.files.wall_to_monotonic_ns`): a timer is never
    early across a reboot. The clocks are :mod:`wheeld.protocol.clock`'s unless others
    are given (a simulation's).
    """
    return -(-clock_offset_ns_above(mono_ns, wall_ns) // 1_000_000)


class Recorder:
    """Collects the events of one loop iteration and appends them as one batch.

    The batch's acknowledgements go last: a batch cut short (a power cut tearing its
    write, under any ``--fsync`` policy) then loses acknowledgements, whose copies are
    delivered again (at least once), rather than armings that came after them in the
    ring. The library re-arms an idle timer touched after it fired with an ACK of the
    fired copy and an ADD_IDLE right behind it; journaled in that order, a torn write
    could keep the ACK and lose the re-arm. The order does not matter to a recovery
    otherwise: an acknowledgement names its arming (key and tag), which nothing later
    in the batch touches.

    ``clock_ms`` is the arena's clock (CLOCK_MONOTONIC ms) and ``offset_ms``
    what turns it into the journal's wall clock (:func:`wall_offset_ms`); both the
    real ones unless given. Every time the Recorder reads (event times, when a
    snapshot or a retry is due) comes from ``clock_ms``; its file operations go
    through the journal's port (``journal.fs``)."""

    def __init__(self, journal: Journal, wheel: TimerWheel, snapshot_every_events: int = 1_000_000,
                 snapshot_every_s: float = 300.0, totals: dict | None = None,
                 clock_ms: Callable[[], int] | None = None, offset_ms: Callable[[], int] | None = None,
                 known_idle: dict | None = None):
        self.journal = journal
        self.wheel = wheel
        #: a pending idle timer's idle_ms from its touch reference (the record's aux), or None
        #: while its client's touch table is out of reach (the daemon's Delivery.idle_ms_of)
        self.idle_source: Callable[[int], int | None] | None = None
        self.replica = None  # --replicate: the Replicator (its want_snapshot asks for a snapshot)
        self._repl_due_ms = 0  # when the next repl event is due, whatever the state
        self._repl_state: str | None = None  # the replicator's state the last repl event recorded
        # repl events since the last snapshot: alone they make no time-based snapshot due (an idle
        # daemon would write, and send, one every snapshot_every_s), until there are a day's worth
        self._repl_since_snapshot = 0
        # (group, key, arming tag) -> idle_ms of the idle timers the journal held at start
        # (reconcile.Reconciled.idle_ms): for those whose touch table is out of reach
        self._known_idle = known_idle or {}
        self.events: list = []
        self._acks: list = []  # the batch's acknowledgements, appended after its other events
        self._group_names: dict[int, str] = {}
        self._clock_ms = clock_ms if clock_ms is not None else mono_ms
        self._wall_offset_ms = offset_ms if offset_ms is not None else wall_offset_ms
        self._offset = self._wall_offset_ms()
        self.snapshot_every_events = snapshot_every_events
        self.snapshot_every_s = snapshot_every_s
        self._snapshot_lsn = journal.last_lsn
        now = self._clock_ms()
        self._snapshot_time_ms = now
        self._snapshot_retry_at_ms = now
        self.totals = totals if totals is not None else {}
        self._header = wheel.header_words()
        #: called when the journal stops or starts being writable (the daemon tells systemd)
        self.on_change = None
        self._stalled_since_ms: int | None = None
        self._stall_logged_ms = 0
        self._next_retry_ms = now
        self._durable_log = os.environ.get("WHEELD_TEST_DURABLE_LOG")
        if self._durable_log:
            _observe_durability(journal, self._durable_log, self._clock_ms)
        try:
            self._sync_previous_segments()
        except OSError as exc:
            log.error("journal: the segments of the previous daemon cannot be fsynced: %s", describe_error(exc))
        self._fsyncs_at_start = journal.fsync_count
        if not journal.writable:
            self._retry()  # a resync (or a journal that could not be opened): try at once

    def _sync_previous_segments(self) -> None:
        """A daemon killed without a reboot leaves its last events written but maybe not
        fsynced (the page cache keeps them); this daemon writes a new segment and would
        only ever fsync that one, so a later power cut would lose them. Sync them now."""
        synced = self.journal.sync_previous_segments()
        if self._durable_log:
            with open(self._durable_log, "a") as log_file:
                for path, size in synced:
                    log_file.write(f"{path.name} {size} {self._clock_ms()}\n")

    # ------------------------------------------------------------------ events
    def begin(self, client_slot: int | None = None) -> None:
        """A batch begins: the records are about to change ahead of the journal. The arena
        says so (``H_JOURNAL_OPEN``) until :meth:`commit`: a daemon that attaches the arena
        after a crash in between knows the two may differ by that batch, and, for a chunk
        of ``client_slot``'s ring, whose acknowledgements it may have applied
        (:mod:`wheeld.daemon.reconcile`)."""
        self._offset = self._wall_offset_ms()
        self._header[_JOURNAL_OPEN] = AL.journal_open_word(client_slot)

    def _group(self, gid: int) -> str:
        name = self._group_names.get(gid)
        if name is None:
            name = self._group_names[gid] = self.wheel.group_name(gid)
        return name

    def forget_group(self, gid: int) -> bool:
        """``TimerWheel.forget_group(gid)``, and drop the name cached for ``gid``: the id
        may go to another name, whose events must not carry the old one."""
        forgotten = self.wheel.forget_group(gid)
        if forgotten:
            self._group_names.pop(gid, None)
        return forgotten

    def armed(self, gid: int, key, deadline_ms: int, seq: int, previous_ms: int | None, idle_ms: int | None) -> None:
        off = self._offset
        idle = _UNSET if idle_ms is None else idle_ms
        k = J.key_to_json(key)
        if previous_ms is None:
            self.events.append(J.Add(t=self._clock_ms() + off, g=self._group(gid), k=k, d=deadline_ms + off, s=seq,
                                     i=idle))
        else:
            self.events.append(J.Rearm(t=self._clock_ms() + off, g=self._group(gid), k=k, d=deadline_ms + off,
                                       pd=previous_ms + off, s=seq, i=idle))

    def cancelled(self, gid: int, key, seq: int, previous_ms: int | None) -> None:
        off = self._offset
        self.events.append(J.Cancel(t=self._clock_ms() + off, g=self._group(gid), k=J.key_to_json(key), s=seq,
                                    hit=previous_ms is not None,
                                    pd=_UNSET if previous_ms is None else previous_ms + off))

    def fired(self, gid: int, key, deadline_ms: int, seq: int, fired_ms: int, late: bool, idle_ms: int | None) -> None:
        off = self._offset
        self.events.append(J.Fire(t=fired_ms + off, g=self._group(gid), k=J.key_to_json(key), d=deadline_ms + off,
                                  s=seq, f=fired_ms + off, late=late, lat=fired_ms - deadline_ms,
                                  i=_UNSET if idle_ms is None else idle_ms))

    def acked(self, gid: int, key, seq: int) -> None:
        self._acks.append(J.Ack(t=self._clock_ms() + self._offset, g=self._group(gid), k=J.key_to_json(key), s=seq))

    def idle_rearmed(self, gid: int, key, previous_ms: int, deadline_ms: int, seq: int, idle_ms: int) -> None:
        off = self._offset
        self.events.append(J.IdleRearm(t=self._clock_ms() + off, g=self._group(gid), k=J.key_to_json(key),
                                       d=deadline_ms + off, pd=previous_ms + off, s=seq, i=idle_ms))

    # ------------------------------------------------------------------ batch events
    # The daemon applies a drained chunk as a batch (a plan, or ring order). These
    # record it with one clock read and one group-name lookup for the whole chunk, keys
    # turned into their journal form straight from the 33-byte record form (no
    # intermediate user key), the previous deadlines found by one vectorized lookup.
    # The events are the same structs, in the same order, as the one-at-a-time
    # methods would record for the same commands (tests/test_journal_recorder.py checks it).

    def previous_deadlines(self, gid: int, idents) -> list:
        """Deadline (monotonic ms) of the pending timer of each ident, or None.

        Call it before applying the segment: it tells an ``add`` from a ``rearm``
        and whether a cancel hit. ``idents`` are 33-byte record forms (meta + key).
        """
        return self.wheel.lookup_many(idents, gid)

    def commands(self, gid: int, log) -> None:
        """The events of the keyed commands a chunk applied (a :class:`~wheeld.daemon.planner.CommandLog`,
        from a plan or from applying in ring order): :meth:`commands_many`."""
        self.commands_many(gid, log.idents, log.arms, log.deadlines, log.seqs, log.idle_ms, log.previous, log.refused)

    def commands_many(self, gid: int, idents, arms, deadlines_ms, seqs, idle_ms, previous: dict,
                      refused=frozenset()) -> None:
        """The events of a batch of keyed commands that may repeat keys, in command order.

        For a daemon that applies a batch collapsed to the last operation per key:
        the journal still gets one event per command, exactly what applying them
        one at a time records. ``arms[j]``: an ADD/ADD_IDLE (else a CANCEL);
        ``idle_ms[j]``: None for a plain timer; ``previous``: ident -> pending
        deadline before the batch (None), from :meth:`previous_deadlines` of the
        batch's distinct keys; ``refused``: idents whose arms after their last
        cancel the arena had no room for (not applied: no event).
        """
        off = self._offset
        t = self._clock_ms() + off
        g = self._group(gid)
        append = self.events.append
        Add, Rearm, Cancel, unset = J.Add, J.Rearm, J.Cancel, _UNSET
        state = dict(previous)
        last_cancel = {}
        if refused:
            for j, (ident, arm) in enumerate(zip(idents, arms)):
                if not arm:
                    last_cancel[ident] = j
        keys: dict = {}
        for j, (ident, arm, deadline, seq, idle) in enumerate(zip(idents, arms, deadlines_ms, seqs, idle_ms)):
            k = keys.get(ident)
            if k is None:
                k = keys[ident] = _ident_to_json(ident)
            before = state.get(ident)
            if arm:
                if ident in refused and j > last_cancel.get(ident, -1):
                    continue
                i = unset if idle is None else idle
                if before is None:
                    append(Add(t=t, g=g, k=k, d=deadline + off, s=seq, i=i))
                else:
                    append(Rearm(t=t, g=g, k=k, d=deadline + off, pd=before + off, s=seq, i=i))
                state[ident] = deadline
            else:
                if before is None:
                    append(Cancel(t=t, g=g, k=k, s=seq, hit=False, pd=unset))
                else:
                    append(Cancel(t=t, g=g, k=k, s=seq, hit=True, pd=before + off))
                state[ident] = None

    # ------------------------------------------------------------------ batches
    def commit(self, now_ms: int) -> int:
        """Append what this iteration recorded (fsynced under ``always``). A journal that
        cannot be written numbers and drops them (:attr:`unavailable` says so)."""
        if self.events or self._acks:
            events, self.events = self.events, []
            if self._acks:
                events += self._acks
                self._acks = []
            try:
                self.journal.append(events, now_ms)
            except JournalUnavailable:
                self.totals["journal_unwritten_events_total"] = (
                    self.totals.get("journal_unwritten_events_total", 0) + len(events))
                self._stalled()
            else:
                if self._durable_log and self.journal.policy.mode == "always":
                    _note_durable(self.journal, self._durable_log, self._clock_ms())
                self._header[_JOURNAL_OPEN] = 0  # the records and the journal agree again
            self._publish_lsns()
        else:
            self._header[_JOURNAL_OPEN] = 0  # the batch changed nothing the journal records
        return self.journal.last_lsn

    def _publish_lsns(self) -> None:
        """The journal's last and durable lsns into the arena header at once (not at the next
        publish): before any flush is answered, the arena knows what the journal holds, and a
        daemon that attaches it after a crash can tell a journal cut short (recovery.py)."""
        journal, words = self.journal, self._header
        words[_LSN_WORD] = self.totals["journal_lsn"] = journal.last_lsn
        words[_DURABLE_WORD] = self.totals["journal_durable_lsn"] = journal.durable_lsn

    @property
    def unavailable(self) -> str | None:
        """Why nothing applied now is durable (the journal cannot be written), in one
        clause; None while the journal is writable."""
        return self.journal.unavailable()

    def tick(self, now_ms: int) -> None:
        """Group commit, the durable mark, snapshots, and a stalled journal's retries;
        called once per loop iteration.

        ``interval``: the fsync runs on the journal's helper thread
        (:meth:`Journal.start_sync`), so the loop keeps draining rings and
        answering flushes while the disk works (an fsync here takes 2-5 ms, a
        third of a 10 ms window if the loop waited for it); a later tick collects it.
        """
        journal = self.journal
        if not journal.writable:
            self._stalled()
            self._retry()
            return
        replica = self.replica
        if replica is not None and (now_ms >= self._repl_due_ms or replica.state != self._repl_state):
            self.record_replication(now_ms)
        try:
            if journal.policy.mode == "interval":
                journal.start_sync(now_ms)
            else:
                journal.maybe_sync(now_ms)
        except JournalUnavailable:
            self._stalled()
            return
        due_events = self.journal.last_lsn - self._snapshot_lsn >= self.snapshot_every_events
        clock_ms = self._clock_ms()
        if self.replica is not None and self.replica.want_snapshot:
            due_events = True  # the stream needs one (its start, or what it missed: wheeld.fleet.replicator)
        due_time = (clock_ms - self._snapshot_time_ms >= self.snapshot_every_s * 1000
                    and self.journal.last_lsn > self._snapshot_lsn + self._repl_since_snapshot)
        if (due_events or due_time) and clock_ms >= self._snapshot_retry_at_ms:
            self.snapshot()

    def record_replication(self, now_ms: int) -> None:
        """Journal a ``repl`` event: the replicator's state, replicated lsn, lag (events
        and ms), host id and epoch now; the next is due :data:`~wheeld.protocol.journal.REPL_EVERY_MS`
        later (or at the next change of state). A journal that cannot be written drops it,
        as it drops timer events (it is counted, and the stall is the journal's)."""
        replica = self.replica
        if replica is None:
            return
        state = replica.state
        stats = replica.stats()
        self._repl_state = state
        self._repl_due_ms = now_ms + J.REPL_EVERY_MS
        self._repl_since_snapshot += 1
        if self._repl_since_snapshot >= REPL_SNAPSHOT_SAMPLES:
            self._repl_since_snapshot = 0  # a day of them: the next time-based snapshot compacts them
        event = J.Repl(t=now_ms + self._wall_offset_ms(), host=replica.host, epoch=int(stats["fleet_epoch"]),
                       state=state, rlsn=int(stats["fleet_replicated_lsn"]), lag=int(stats["fleet_lag_records"]),
                       lag_ms=int(stats["fleet_lag_ms"]))
        try:
            self.journal.append([event], now_ms)
        except JournalUnavailable:
            self.totals["journal_unwritten_events_total"] = self.totals.get("journal_unwritten_events_total", 0) + 1
            self._stalled()
        else:
            if self._durable_log and self.journal.policy.mode == "always":
                _note_durable(self.journal, self._durable_log, self._clock_ms())
        self._publish_lsns()

    def sync_due_ms(self) -> int | None:
        """When the loop must run :meth:`tick` next (None: nothing pending).

        While a background fsync or a mark write is in flight, 1 ms from now: the
        loop looks for its completion (which nothing else would wake it for) every
        millisecond. While the journal is stalled, at its next retry.
        """
        journal = self.journal
        now = self._clock_ms()
        if not journal.writable:
            return now + max(1, self._next_retry_ms - now + 1)
        if journal.sync_in_flight or journal.mark_pending:
            return now + 1
        return journal.sync_due_ms

    def _state(self) -> tuple[list, list]:
        """The pending and fired-unacknowledged timers of the arena, as a snapshot holds them."""
        wheel = self.wheel
        off = self._wall_offset_ms()
        pending = []
        still_needed: dict = {}  # the entries of known_idle this snapshot used: the rest are let go
        for key, deadline, gid, tag, aux in _scheduled(wheel):
            try:
                group = self._group(gid)
            except ValueError:  # a group id overwritten in the arena: left out, as a damaged key is
                continue
            idle_ms = self._idle_ms(group, key, tag, aux, still_needed) if aux >= 0 else None
            pending.append(PendingTimer(group, key, deadline + off, tag, idle_ms))
        self._known_idle = still_needed
        unacked = []
        now = self._clock_ms()
        for slot in wheel.fired_slots():
            try:
                key, deadline, gid, tag, aux, gen = wheel.fired(slot)
                group = self._group(gid)
            except ValueError:  # a record overwritten in the arena: delivery frees it (Delivery.damaged)
                continue
            unacked.append(FiredTimer(group, key, deadline + off, tag, now + off, False, now - deadline))
        return pending, unacked

    def _idle_ms(self, group: str, key, tag: int, aux: int, still_needed: dict) -> int | None:
        """The idle time of the pending idle timer (``aux``: its touch reference) of ``key``
        and arming ``tag``: its client's touch table's, else the journal's at start, else
        None (it is snapshotted as a plain timer)."""
        source = self.idle_source
        idle_ms = source(aux) if source is not None else None
        if idle_ms is None and self._known_idle:
            known = (group, key, tag)
            idle_ms = self._known_idle.get(known)
            if idle_ms is not None:
                still_needed[known] = idle_ms
        return idle_ms

    def snapshot(self) -> None:
        """A snapshot of the arena at the journal's last lsn (then compaction). A snapshot
        that cannot be written is logged and tried again 30 s later; a journal that
        cannot be synced first stalls."""
        if not self.journal.writable:
            return
        started = time.perf_counter()
        pending, unacked = self._state()
        lsn = self.journal.last_lsn
        try:
            self.journal.write_snapshot(lsn, pending, unacked)
        except JournalUnavailable:
            self._stalled()
            return
        except OSError as exc:
            self._snapshot_retry_at_ms = self._clock_ms() + 30_000
            log.error("journal: a snapshot at lsn %d could not be written (%s); the journal goes on without it, "
                      "another is tried in 30 s", lsn, describe_error(exc))
            return
        self._snapshot_lsn = lsn
        self._repl_since_snapshot = 0
        self._snapshot_time_ms = self._clock_ms()
        log.info("journal: snapshot at lsn %d (%d pending, %d unacknowledged) in %.0f ms",
                 lsn, len(pending), len(unacked), (time.perf_counter() - started) * 1000)

    # ------------------------------------------------------------------ stalls
    def _stalled(self) -> None:
        """The journal is not writable: say so once when it starts, then every minute."""
        journal = self.journal
        now = self._clock_ms()
        error = journal.stalled
        self.totals["journal_stalled"] = (error.errno or 1) if error is not None else 1
        if self._stalled_since_ms is None:
            self._stalled_since_ms = self._stall_logged_ms = now
            self._next_retry_ms = max(self._next_retry_ms, now + int(RETRY_S * 1000))
            self.totals["journal_stalls_total"] = self.totals.get("journal_stalls_total", 0) + 1
            log.error("%s (from lsn %d on); the daemon goes on serving: commands are applied and timers "
                      "fire, but every flush() fails with JournalUnavailable until the journal can be written again "
                      "(tried every %.0f s: a snapshot of the arena then covers what was not written)",
                      journal.unavailable(), journal.durable_lsn + 1, RETRY_S)
            if self.on_change is not None:
                self.on_change()
        elif now - self._stall_logged_ms >= STILL_STALLED_LOG_S * 1000:
            self._stall_logged_ms = now
            log.error("journal: still not writable after %.0f s: %s; %d events not written (lsns %d..%d)",
                      (now - self._stalled_since_ms) / 1000, journal.unavailable(),
                      journal.last_lsn - journal.durable_lsn,
                      journal.durable_lsn + 1, journal.last_lsn)

    def _retry(self) -> None:
        """Try to make a stalled journal writable again (:meth:`Journal.resume`), at most
        every :data:`RETRY_S`, and never more often than ten times what a failed try cost."""
        now = self._clock_ms()
        if now < self._next_retry_ms:
            return
        journal = self.journal
        wheel = self.wheel
        self.commit(now)  # events recorded and not yet committed: numbered, so the snapshot covers them
        timers = len(wheel) + wheel.counters()["fired_unacked"]
        behind = journal.last_lsn - journal.durable_lsn
        resumed = journal.resume(self._state, MIN_SNAPSHOT_BYTES + timers * MIN_SNAPSHOT_BYTES_PER_TIMER)
        done = self._clock_ms()
        took_ms = done - now
        self._next_retry_ms = done + max(int(RETRY_S * 1000), RETRY_COST_FACTOR * took_ms)
        if not resumed:
            self._stalled()
            return
        self._snapshot_lsn = journal.last_lsn
        self._repl_since_snapshot = 0
        self._snapshot_time_ms = done
        self._publish_lsns()
        self.totals["journal_stalled"] = 0
        since = self._stalled_since_ms
        self._stalled_since_ms = None
        log.warning("journal: writable again%s: snapshot at lsn %d of the arena's %d timers written in %d ms (it "
                    "covers the %d events that were not written); flush() is acknowledged again",
                    f" after {(now - since) / 1000:.1f} s" if since is not None else "", journal.last_lsn, timers,
                    took_ms, behind)
        if self.on_change is not None:
            self.on_change()

    def close(self) -> None:
        journal = self.journal
        if not journal.writable:  # a last try: a snapshot now saves what the stall left unwritten
            self._next_retry_ms = self._clock_ms()
            self._retry()
        if self.replica is not None and journal.writable:  # the replication as the daemon leaves it
            self.record_replication(self._clock_ms())
        # bench/durability.py reads this line: fsyncs per policy over the daemon's life
        log.info("journal: closed at lsn %d after %d fsyncs (%d at start)",
                 journal.last_lsn, journal.fsync_count, self._fsyncs_at_start)
        if journal.writable:
            try:
                journal.sync()
            except JournalUnavailable:
                pass
        journal.close()


_ESCAPED = ("b64:", "str:")


def _ident_to_json(ident: bytes):
    """Journal form of a key given in its record form (meta byte + zero-padded key).

    The same value as ``J.key_to_json(decode_key(ident[1:], ident[0]))``, with the
    common cases (a str key without a reserved prefix, an int key) done inline.
    The daemon validated the ring record, so a str key is UTF-8.
    """
    meta = ident[0]
    kind = key_type(meta)
    if kind == TYPE_STR:
        text = ident[1 : 1 + key_length(meta)].decode("utf-8")
        return "str:" + text if text.startswith(_ESCAPED) else text
    if kind == TYPE_INT:
        return int.from_bytes(ident[1:9], "little", signed=True)
    return J.key_to_json(decode_key(ident[1:], meta))


def _scheduled(wheel: TimerWheel):
    """(key, deadline_ms, group id, tag, aux) of every scheduled timer, read from the records
    (``aux``: an idle timer's touch reference, -1 for a plain timer)."""
    rec = wheel.records
    states = rec["state"] & AL.STATE_MASK
    slots = np.flatnonzero(states == AL.SCHEDULED)
    slots = slots[slots >= wheel.first_entry]
    keys = rec["key"][slots].tolist()
    metas = rec["key_meta"][slots].tolist()
    out = []
    for key, meta, deadline, gid, tag, aux in zip(keys, metas, rec["deadline"][slots].tolist(),
                                                  rec["group"][slots].tolist(), rec["tag"][slots].tolist(),
                                                  rec["aux"][slots].tolist()):
        try:  # a record overwritten in the arena (a str key that is not UTF-8) is left out
            out.append((decode_key(key, meta), deadline, gid, tag, aux))
        except ValueError:
            continue
    return out


def _note_durable(journal: Journal, log_path: str, now_ms: int) -> None:
    path = journal.segment_path
    if path is not None:
        with open(log_path, "a") as log_file:
            log_file.write(f"{path.name} {fsport.file_size(journal.fs, path)} {now_ms}\n")


def _observe_durability(journal: Journal, log_path: str, clock_ms: Callable[[], int]) -> None:
    """Test hook, on only with WHEELD_TEST_DURABLE_LOG: after every fsync of a segment,
    log how many of its bytes are on disk. The chaos test simulates a power loss by
    cutting each segment back to that size (the page cache survives a SIGKILL, a
    power cut does not), which is what makes the fsync policies testable."""
    original_sync = journal.sync

    def sync() -> None:
        original_sync()
        _note_durable(journal, log_path, clock_ms())

    def synced(path, size: int, started_ms: int) -> None:
        # a background fsync: it covers the bytes written before it started, so the
        # line carries that size and that moment (not the size and time at completion)
        with open(log_path, "a") as log_file:
            log_file.write(f"{path.name} {size} {started_ms}\n")

    journal.sync = sync
    journal.on_synced = synced
