"""The contract as a model: every simulated history is checked against it.

Honest simulated clients record what they did and what they were handed
(:class:`History`); :func:`check` says what in that history breaks a promise of
README.md and docs/contracts.md ("Delivery and durability"):

1. **At least once.** Every arming (``add``, ``add_idle``) that a ``flush()``
   acknowledged, and that its client neither re-armed nor cancelled afterwards,
   is handed to the application of some member of its group, in this or a later
   incarnation of a worker, by the end of the run (the run ends with a daemon up,
   a live member in every group and the clock past every deadline, the ack timeout
   and the resume grace).
2. **Never early.** An expiration is handed no sooner than ``delay_ms`` after its
   ``add()`` call (for an idle timer: ``idle_ms`` after the last ``touch()`` made
   before the daemon fired it, or after ``add_idle()``; the touches of a client that died
   no longer count: its touch table died with it), in simulated real time.
3. **Cancel and re-arm are honoured.** An arming replaced by a later ``add`` or
   ``cancel`` of its key that a ``flush()`` acknowledged is never handed to the
   client that replaced it, unless its expiration had reached that client's
   library before the call (the call came too late: ``cancel()`` then returns
   False). (Another member may have been handed it already: it fired before the
   call reached the daemon.)
4. **Exactly once** to the application per arming, but for the at-least-once
   windows: of the copies of an arming handed to applications, at most one was
   acknowledged in time to a daemon that applied the acknowledgement; every other
   one went back to its group first (:meth:`History.released`: its client died
   before its acknowledgement reached its ring, or acknowledged it after the ack
   timeout, or lost its session meanwhile, or exited and its ring died unread with a
   daemon killed before it read it; a power cut came after it was sent), or
   is the copy its library took in and re-armed over (an idle timer touched after it
   fired), sent again because a power cut or an arena loss after that re-arm took the
   library's acknowledgement (:meth:`History.returned_after_rearm`). A daemon crash or
   restart alone never makes a second hand-over.
5. **Nothing invented**: an expiration handed is of an arming some member of
   the group made.
6. **On time once settled.** Once faults have stopped and the service has
   settled (a daemon up, a member polling in every group, every dead client past
   its resume grace and every copy past the ack timeout), an acknowledged arming
   is handed within a bound of the latest moment it can be due (:func:`late`).

Media damage the simulator injects on purpose (a journal cut short while the host
was down) may take acknowledged armings with it: no promise covers bytes removed
after they were synced, only that the loss is reported (the simulator checks that).
An arming made before such damage is not held to rule 1.

Keys are per client incarnation (``c<id>-<n>``), so an arming is named by
(incarnation, key, tag) and a key's history is its incarnation's calls in order.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

__all__ = ["History", "Violation", "check"]


@dataclass
class Arming:
    client: int
    group: str
    key: str
    tag: int
    called_ns: int
    earliest_ns: int  # the earliest moment it may be handed (idle: re-computed from touches)
    idle_ms: int | None
    acked: bool = False  # a flush() that covers it returned
    acked_ns: int = 0  # when
    superseded_by: Command | None = None
    received_before_superseded: bool = False
    handed: list = field(default_factory=list)  # (client, at_ns)
    copies: list = field(default_factory=list)  # per hand-over: (client, its number in that client, copy fired_ns)
    fired_ns: int | None = None  # the earliest fired_ms of its copies handed so far
    rearmed_ns: list = field(default_factory=list)  # when its library armed it again (touched since it fired)


@dataclass
class Command:
    client: int
    key: str
    kind: str  # "add", "add_idle", "cancel"
    called_ns: int
    acked: bool = False
    acked_ns: int = 0
    hit: bool | None = None  # cancel()'s answer


@dataclass
class Violation:
    rule: str
    text: str

    def __str__(self) -> str:
        return f"[{self.rule}] {self.text}"


class History:
    """What honest clients did, in the order they did it."""

    def __init__(self):
        self.armings: dict[tuple[int, str, int], Arming] = {}
        self.latest: dict[tuple[int, str], Arming] = {}  # (client, key) -> its latest arming
        self.touches: dict[tuple[int, str], list[int]] = {}
        self.pending_commands: dict[int, list[Command | Arming]] = {}  # pushed since the client's last flush() call
        self.crashed_groups: set[str] = set()
        self.crashed_clients: set[int] = set()
        self.crash_ns: dict[int, int] = {}  # client -> when it crashed
        # client -> when its ring died unread: it had exited (a Bye, a kill) and the daemon
        # that still held its ring died before it had read everything in it (ring_lost)
        self.rings_lost: dict[int, int] = {}
        self.daemon_deaths: list[int] = []  # when a daemon process died (killed, crashed, a power cut), in order
        self.arena_losses: list[int] = []  # when the arena was removed while the daemon was down, workers alive
        self.daemon_starts: list[int] = []  # when a daemon started (took its arena), in order
        self.resume_grace_ns = 0  # the daemon's --resume-grace-s, set by the simulator
        # set by the simulator once the run is over, per client: (when, n) each time the
        # acknowledgements of its first n hand-overs were all in its ring; when a session's
        # connection ended under it; and the daemon's --ack-timeout-s (ns)
        self.ack_marks: dict[int, list[tuple[int, int]]] = {}
        self.session_ends: dict[int, list[int]] = {}
        # client -> when it handed its ring to a new arena: per such hand-over, (the first Hello
        # it sent since its previous Welcome, the Welcome it took); the daemon replays the ring
        # when it reads a Hello, at some moment in between (a bare int: that moment)
        self.new_arena_welcomes: dict[int, list[tuple[int, int] | int]] = {}
        self.ack_timeout_ns = 0
        self.touch_tables_lost: set[int] = set()  # departed clients whose touches a reboot took
        self.left_ns: dict[int, int] = {}  # client -> when it left with a Bye
        self.power_cuts = 0
        self.every_cut: list[tuple[int, int]] = []  # (when, window) of every power cut, any policy
        self.cuts: list[tuple[int, int]] = []  # (when, the window of applied commands it may lose) per power cut
        self.disk_failures: list[int] = []  # when calls on the journal's disk failed (EIO, ENOSPC), in order
        # when files holding the journal's events (segments, snapshots; not its durable mark)
        # were synced, and when bytes were appended to them, in order
        self.syncs: list[int] = []
        self.writes: list[int] = []
        # per append (its index in writes) a sync made durable: how many syncs the disk had taken then
        self.durable_writes: dict[int, int] = {}
        self._append_index: dict[int, int] = {}  # the disk's number of an append -> its index in writes
        # per power cut (by its time): how many writes and syncs the disk had taken when the power went
        self.disk_at_cut: dict[int, tuple[int, int]] = {}
        self.disk_damage_ns: int | None = None  # the last time the journal's media was damaged on purpose
        # (key, the daemon's arming tag) -> the earliest fired_ms of a copy any library read
        self.first_fired: dict[tuple[str, int], int] = {}
        self.group_of: dict[int, str] = {}
        self.unknown: list[tuple[int, str, int]] = []  # handed, but no member armed it
        self.violations: list[Violation] = []

    # ------------------------------------------------------------------ what clients report
    def joined(self, client: int, group: str) -> None:
        self.group_of[client] = group

    def armed(self, client: int, key: str, tag: int, called_ns: int, delay_ms: int, idle: bool) -> None:
        previous = self.latest.get((client, key))
        command = Command(client, key, "add_idle" if idle else "add", called_ns)
        if previous is not None:
            self._supersede(previous, command)
        arming = Arming(client, self.group_of[client], key, tag, called_ns, called_ns + delay_ms * 1_000_000,
                        delay_ms if idle else None)
        self.armings[(client, key, tag)] = arming
        self.latest[(client, key)] = arming
        self.touches[(client, key)] = []
        self.pending_commands.setdefault(client, []).extend((arming, command))

    def cancelled(self, client: int, key: str, called_ns: int, hit: bool) -> None:
        command = Command(client, key, "cancel", called_ns, hit=hit)
        previous = self.latest.pop((client, key), None)
        if previous is not None:
            self._supersede(previous, command)
        self.pending_commands.setdefault(client, []).append(command)

    def _supersede(self, arming: Arming, command: Command) -> None:
        if arming.superseded_by is None:
            arming.superseded_by = command
            arming.received_before_superseded = bool(arming.handed) or self._in_library(arming)

    #: set by the simulator: (client, key) -> whether an expiration of it waits in the client's library
    in_library = None

    def _in_library(self, arming: Arming) -> bool:
        return bool(self.in_library and self.in_library(arming.client, arming.key))

    def touched(self, client: int, key: str, at_ns: int) -> None:
        touches = self.touches.get((client, key))
        if touches is not None:
            touches.append(at_ns)

    def flush_called(self, client: int) -> list:
        """The commands a flush() called now covers (handed back by the caller on success)."""
        covered = self.pending_commands.get(client, [])
        self.pending_commands[client] = []
        return covered

    def flushed(self, covered: list, at_ns: int = 0) -> None:
        """A flush() returned success (at ``at_ns``): what it covered is acknowledged."""
        for item in covered:
            item.acked = True
            item.acked_ns = at_ns

    def left(self, client: int, at_ns: int) -> None:
        """``client`` left with a Bye: the daemon journals its idle timers at last touch +
        idle_ms when it frees its slot, a moment later."""
        self.left_ns[client] = at_ns

    def journal_may_have_lost(self, since_ns: int) -> bool:
        """Whether what the daemon journaled from ``since_ns`` on may be gone, by the rules of
        :meth:`may_have_lost` for an event no flush acknowledged: a power cut under
        ``--fsync interval`` within its window, or after a failed call on the journal's
        disk with no bytes written after that failure made durable before the cut
        (:meth:`_wrote_again`). The failure may come before ``since_ns`` too: the journal
        was stalled then (it drops what it cannot write until a snapshot covers it), and
        never wrote again before the cut."""
        for at, window in self.every_cut:
            if since_ns > at:
                continue
            if since_ns >= at - window:
                return True
            last = bisect.bisect_right(self.disk_failures, at) - 1
            if last >= 0 and not self._wrote_again(self.disk_failures[last], at):
                return True
        return False

    def idle_rearmed(self, client: int, key: str, tag: int, at_ns: int) -> None:
        """``client``'s library took in an expiration of its idle arming ``tag`` that was touched
        after the daemon read the touch word: it acknowledged that copy and armed the key again
        (an ACK and an ADD_IDLE, pushed at ``at_ns``)."""
        arming = self.armings.get((client, key, tag))
        if arming is not None:
            arming.rearmed_ns.append(at_ns)

    def _wrote_again(self, failed: int, at: int) -> bool:
        """Whether bytes appended to the journal's disk after the failure at ``failed`` were
        made durable by a sync, by ``at``: only then may a stalled journal have ended its
        stall. docs/contracts.md: "what was applied since the last fsync that succeeded stays
        at risk until the daemon has written its snapshot again"; a stalled journal writes
        nothing until that snapshot (but its durable mark, which holds no event and is not
        counted here). A sync alone proves nothing: a background fsync started
        before the failure (it covers only what was written before it started) may complete
        after it, and a retry fsyncs the segment that failed before it finds no room for the
        snapshot. Nor do bytes written and a sync after them: the loop may append to the
        segment before it learns that a background fsync failed, and a sync after an fsync
        that failed with EIO succeeds without making the segment's bytes durable from where
        it dropped them (the next daemon's fsync of the segments it finds, say): those bytes
        are what the disk reports durable (:attr:`durable_writes`), appends as whole."""
        # Only what the disk took before the power went counts, not what it took at the same
        # moment after it: the next boot's recovery (a daemon started at once, e.g. when the run
        # winds down right after the cut) writes and syncs its snapshot at the cut's timestamp,
        # and "stays at risk until the daemon has written its snapshot again" means the daemon
        # that was cut, not the one recovering after it (docs/contracts.md, "Delivery and durability").
        writes_end, syncs_end = self.disk_at_cut.get(
            at, (bisect.bisect_right(self.writes, at), bisect.bisect_right(self.syncs, at)))
        # (a write cut short by the failure: not after it)
        first = bisect.bisect_right(self.writes, failed, 0, writes_end)
        durable = self.durable_writes
        return any(durable.get(index, syncs_end + 1) <= syncs_end for index in range(first, writes_end))

    def touches_lost(self, client: int) -> None:
        """A reboot took ``client``'s touch table before the daemon moved its idle timers
        to last touch + idle_ms: its touches are no longer promised."""
        self.touch_tables_lost.add(client)

    def crashed(self, client: int, at_ns: int = 0) -> None:
        self.crashed_groups.add(self.group_of[client])
        self.crashed_clients.add(client)
        self.crash_ns.setdefault(client, at_ns)

    def ring_lost(self, client: int, at_ns: int) -> None:
        """``client`` had exited (it said Bye, or was killed) while a daemon lived, and that
        daemon died at ``at_ns`` before it had read everything the client left in its ring
        (the kill came before it applied what the session's end leaves, docs/contracts.md:
        "when a session ends, the daemon applies everything its client left in the ring").
        No process holds the ring any more: the acknowledgements in it are never applied, and
        the next daemon, which finds the client's process gone, sends what it had sent that
        client to the group ("Delivery and durability")."""
        self.rings_lost.setdefault(client, at_ns)

    def daemon_died(self, at_ns: int) -> None:
        self.daemon_deaths.append(at_ns)

    def deaths_between_hand_and_ack(self) -> int:
        """How many daemon deaths came after a library handed a copy to its application and
        before that copy's acknowledgement was in its ring, in a group with another member:
        the history tests/test_sim_run.py needs (call once ``ack_marks`` are set)."""
        members: dict[str, int] = {}
        for group in self.group_of.values():
            members[group] = members.get(group, 0) + 1
        count = 0
        for death in self.daemon_deaths:
            for arming in self.armings.values():
                if members.get(arming.group, 0) < 2:
                    continue
                if any(client in self.ack_marks and hand_at <= death
                       and next((at for at, n in self.ack_marks[client] if n > number), death + 1) > death
                       for (client, hand_at), (_c, number, _f) in zip(arming.handed, arming.copies)):
                    count += 1
                    break
        return count

    def daemon_started(self, at_ns: int) -> None:
        self.daemon_starts.append(at_ns)

    def arena_lost(self, at_ns: int) -> None:
        """The arena was removed while the daemon was down (its workers live on): the next
        daemon rebuilds it from the journal, and an acknowledgement it finds in a ring names
        a record of the lost arena (it releases nothing: docs/contracts.md)."""
        self.arena_losses.append(at_ns)

    def power_cut(self, at_ns: int = 0, window_ns: int = 0) -> None:
        """The power was cut at ``at_ns``; under ``--fsync interval=N`` it may lose what was
        applied in its last ``window_ns`` (N ms plus one loop iteration)."""
        self.power_cuts += 1
        self.every_cut.append((at_ns, window_ns))
        self.disk_at_cut.setdefault(at_ns, (len(self.writes), len(self.syncs)))
        if window_ns:
            self.cuts.append((at_ns, window_ns))

    def disk_failed(self, at_ns: int) -> None:
        """A call on the journal's disk failed (EIO, ENOSPC) at ``at_ns``."""
        self.disk_failures.append(at_ns)

    def disk_synced(self, at_ns: int) -> None:
        """A file holding the journal's events was synced at ``at_ns``."""
        self.syncs.append(at_ns)

    def disk_written(self, at_ns: int, append: int | None = None) -> None:
        """Bytes were appended to a file holding the journal's events at ``at_ns``; ``append``:
        the disk's number of that append (:meth:`disk_made_durable` names it)."""
        if append is not None:
            self._append_index[append] = len(self.writes)
        self.writes.append(at_ns)

    def disk_made_durable(self, appends: list[int]) -> None:
        """The sync just reported (:meth:`disk_synced`) made the appends ``appends`` (the disk's
        numbers, as :meth:`disk_written` was given them) durable: every byte of each."""
        for append in appends:
            index = self._append_index.pop(append, None)
            if index is not None:
                self.durable_writes.setdefault(index, len(self.syncs))

    def may_have_lost(self, arming: Arming) -> bool:
        """An arming a power cut under ``--fsync interval`` may take (docs/contracts.md: "a
        reboot loses at most what was applied in the last N ms plus one loop iteration",
        "although a later flush() returns"): called before the cut, and not acknowledged
        before the window it may lose began; or one whose covering fsync may have failed:
        a call on the journal's disk failed after the window before its acknowledgement
        began, and no bytes written after the last such failure were made durable before
        the cut (:meth:`_wrote_again`; "when a write or fsync fails, what was applied since the
        last fsync that succeeded stays at risk until the daemon has written its snapshot
        again")."""
        for at, window in self.cuts:
            if arming.called_ns > at:
                continue
            # An idle arming its library armed again (docs/contracts.md, "Time": touched after
            # the daemon read the word, its expiration "is acknowledged, not handed over, and
            # the key is armed again ... (a new arming, an ADD_IDLE pushed at once ...)") lives
            # on in that new arming from then on: the ACK of the old copy and the ADD_IDLE are
            # commands applied when they were pushed, and "with --fsync interval=N a reboot
            # loses at most what was applied in the last N ms" -- a cut inside the unsynced tail
            # may keep the ACK and lose the ADD_IDLE behind it. So its last re-arm before the cut
            # counts here as its acknowledgement would: a cut within the window after it may lose it.
            # (a Command, superseding an arming, has no re-arms)
            latest_ns = max([arming.acked_ns] + [r for r in getattr(arming, "rearmed_ns", ()) if r <= at])
            if latest_ns >= at - window:
                return True
            # the last failure on the journal's disk from the window before the flush's
            # acknowledgement to the cut, with nothing written after it made durable: the journal
            # never recovered before the cut. A re-arm does not move that bound: the daemon applies
            # the library's ACK and ADD_IDLE while its journal is stalled and does not write them
            # (unlike a flush(), which then fails with JournalUnavailable), so a re-arm after the
            # failure says nothing of the journal having recovered, and the new arming is at risk
            # with the one it replaces
            last = bisect.bisect_right(self.disk_failures, at) - 1
            if last >= 0 and self.disk_failures[last] >= arming.acked_ns - window and \
                    not self._wrote_again(self.disk_failures[last], at):
                return True
        return False

    def disk_damaged(self, at_ns: int) -> None:
        """The journal lost synced bytes (a cut, by the simulator): armings made before may be lost."""
        self.disk_damage_ns = at_ns

    def received(self, key: str, tag: int, fired_ns: int) -> None:
        """A library read a copy of arming ``tag`` of ``key`` (``tag``: the daemon's, before any
        re-arm by the library) fired at ``fired_ns``, whether its application is handed it or not."""
        first = self.first_fired.get((key, tag))
        if first is None or fired_ns < first:
            self.first_fired[(key, tag)] = fired_ns

    def first_fired_ns(self, key: str, tag: int, fired_ns: int) -> int:
        """When the daemon read the touch word of arming ``tag`` of ``key``, at the latest: the
        earliest fired_ms of its copies a library read, ``fired_ns`` (the copy handed) if none
        came before. docs/contracts.md, "Time": "An expiration handed to another member of the
        group is not checked again: touches stored after the daemon read the word are too late
        for it. A copy sent again (its first recipient died or did not acknowledge it in time)
        carries as fired_ms the moment it was queued again, not the first fire." The first copy
        may have gone to a member that died without handing it (a hoarder)."""
        return min(fired_ns, self.first_fired.get((key, tag), fired_ns))

    def handed(self, client: int, key: str, tag: int, at_ns: int, fired_ns: int | None = None,
               number: int = -1, copy_fired_ns: int | None = None) -> None:
        """An expiration handed to the application of ``client``: its key and arming tag, and
        when the daemon fired it (its ``fired_ms``: a touch after that came too late);
        ``number``: how many hand-overs that client made before this one, ``copy_fired_ns``
        the ``fired_ms`` this copy carries (:meth:`released`)."""
        arming = self._find(key, tag)
        if arming is None:
            self.unknown.append((client, key, tag))
            return
        arming.handed.append((client, at_ns))
        arming.copies.append((client, number, at_ns if copy_fired_ns is None else copy_fired_ns))
        if fired_ns is not None:
            # a copy sent again (its first recipient died, or did not acknowledge it in time)
            # carries the moment it was queued again: the daemon read the touch word at the
            # first fire, which the earliest copy tells
            arming.fired_ns = fired_ns if arming.fired_ns is None else min(arming.fired_ns, fired_ns)
            fired_ns = arming.fired_ns
        self._check_early(arming, client, at_ns, at_ns if fired_ns is None else min(at_ns, fired_ns))
        if self.group_of[client] != arming.group:
            self.violations.append(Violation("group", f"{key!r} (tag {tag}) of group {arming.group!r} was handed to "
                                                      f"client {client} of group {self.group_of[client]!r}"))

    #: how long after an event the daemon may take to act on it (drain the ring an
    #: acknowledgement was pushed into, read its clock for an ack timeout)
    SLACK_NS = 100_000_000

    def released(self, copy: tuple[int, int, int], last_hand_ns: int) -> bool:
        """Whether a copy handed to an application went back to its group's pool: the
        daemon may send it again to another member, which is then handed it too (the
        at-least-once windows of docs/contracts.md, "Delivery and durability"). ``copy``:
        (client, its hand-over number in that client, the ``fired_ms`` it carried, ns);
        ``last_hand_ns``: the arming's last hand-over. Released when

        * its acknowledgement never reached the client's ring (the client died first, or
          stopped calling before it pushed it: the ack timeout sends it again);
        * it reached the ring ``--ack-timeout-s`` or more after the copy was sent (fired
          or queued again: the copy carries that moment, the send was no sooner);
        * the client's session ended between the send and the acknowledgement (what it
          had in flight goes back to the group);
        * a daemon died between the send and the drain of that acknowledgement, and the
          client's ring died unread after that: the client died after that death (its ring
          died with it), or it had exited before and that daemon died before it read what
          the client left in the ring (:meth:`ring_lost`);
        * a power cut came after the send (an acknowledgement applied but not yet
          durable is lost with the page cache; a reboot kills every client too), or the
          arena was lost after it (an acknowledgement still in the ring then names a
          record of the lost arena, and releases nothing in the rebuilt one).

        Anything else was acknowledged in time to a daemon that applied it: a second
        hand-over of it to the application is a bug."""
        client, number, sent = copy
        marks = self.ack_marks.get(client, ())
        acked = next((at for at, n in marks if n > number), None)
        if acked is None or acked - sent >= self.ack_timeout_ns - self.SLACK_NS:
            return True
        if any(sent <= at <= acked for at in self.session_ends.get(client, ())):
            return True
        # when its ring died, unread by a daemon: with the client, or with the daemon that
        # held it after the client had exited
        ring_end = self.rings_lost.get(client, self.crash_ns.get(client))
        if ring_end is not None and any(sent <= at <= acked + self.SLACK_NS and at <= ring_end
                                        for at in self.daemon_deaths):
            return True
        return any(sent <= at <= last_hand_ns for at, _window in self.every_cut) or \
            any(sent <= at <= last_hand_ns for at in self.arena_losses)

    def replayed_after(self, arming: Arming, copy: tuple[int, int, int], last_hand_ns: int) -> bool:
        """Whether the arming's own ring may have armed it again after ``copy`` was sent and
        acknowledged: the at-least-once window of docs/contracts.md, "Delivery and
        durability" ("after the arena was lost while clients lived ... so is one whose
        arming a ring replays after it had fired and been acknowledged (the journal keeps
        no acknowledged arming)").

        A ring handed to a daemon of another arena is replayed from the last ``flush()``
        the old arena acknowledged: the arming is in that range when it was called before
        the loss and no flush covering it returned before the loss. The daemon skips what
        its arena held when it started (``ArmingsAtStart``) for ``--resume-grace-s`` after
        the arena was rebuilt; so the replay arms it again only when the ring came back
        later than that, or when the copy was acknowledged before the daemon that took
        the ring started (a daemon died in between: the arming was gone from the arena
        that daemon found). Anything else the guard must have skipped.

        The client knows only that its ring went back between a Hello it sent and the
        Welcome it took: the daemon replays the ring when it reads the Hello, and may fire
        what it armed again and send it to another member, which may hand it, before the
        client reads its Welcome. So a replay counts when it may have come in that range
        after the copy was sent and by the last hand-over, at the latest moment it may."""
        client, number, sent = copy
        acked = next((at for at, n in self.ack_marks.get(client, ()) if n > number), None)
        for welcome in self.new_arena_welcomes.get(arming.client, ()):
            hello, welcomed = welcome if isinstance(welcome, tuple) else (welcome, welcome)
            if hello > last_hand_ns or welcomed < sent:
                continue
            at = min(welcomed, last_hand_ns)  # the latest moment the replay may have come
            for loss in self.arena_losses:
                if not (arming.called_ns <= loss <= at and (not arming.acked or arming.acked_ns > loss)):
                    continue
                rebuilt = next((start for start in self.daemon_starts if start >= loss), None)
                if rebuilt is None or at - rebuilt >= self.resume_grace_ns - self.SLACK_NS:
                    return True
                if acked is not None and any(acked <= death <= at for death in self.daemon_deaths):
                    return True
        return False

    def returned_after_rearm(self, arming: Arming, kept: list, last_hand_ns: int) -> list:
        """``kept`` (copies of ``arming`` handed to applications that :meth:`released` does
        not excuse) without the copies that came back because an acknowledgement its library
        pushed when it re-armed the key was lost. A library re-arm (docs/contracts.md, "Time":
        the copy "is acknowledged, not handed over, and the key is armed again ... (a new
        arming ...)") is an ACK of the copy it took in with an ADD_IDLE right behind it, and
        "a batch cut short by a power cut (a torn write) loses acknowledgements, whose copies
        are delivered again, before it loses an arming applied after them" ("Journal events");
        "after a power cut, one whose acknowledgement was not yet durable is delivered again",
        and after the arena was lost while clients lived, "one whose acknowledgement was still
        in a ring unread names a record of the lost arena and releases nothing, so it is
        delivered again" ("Delivery and durability"). The copy the library took in was never
        handed, so :meth:`released` never sees it: per re-arm followed by a power cut or an
        arena loss, by the last hand-over, one copy sent at or after that fault is excused
        (the fired record the new daemon sends again); the re-arm's own expiration stays."""
        if not arming.rearmed_ns:
            return kept
        kept = list(kept)
        for rearmed in arming.rearmed_ns:
            faults = [at for at, _window in self.every_cut if rearmed <= at <= last_hand_ns]
            faults += [at for at in self.arena_losses if rearmed <= at <= last_hand_ns]
            if not faults:
                continue
            after = [copy for copy in kept if copy[2] >= min(faults)]
            if after:
                kept.remove(after[0])
        return kept

    def _find(self, key: str, tag: int) -> Arming | None:
        owner = int(key.split("-", 1)[0][1:]) if key.startswith("c") and "-" in key else -1
        return self.armings.get((owner, key, tag))

    def _check_early(self, arming: Arming, client: int, at_ns: int, fired_ns: int) -> None:
        earliest = arming.earliest_ns
        # a journal damaged after the arming was made may have lost the re-arms its touches
        # made (docs/contracts.md: "a skipped event is lost with its consequences"), such as
        # the move to last touch + idle_ms when its client left: it counts from the add only
        damaged = self.disk_damage_ns is not None and arming.called_ns <= self.disk_damage_ns
        # a client that left: its touches live on in the journal (the move its departure
        # made), which a power cut after a failed fsync may take (may_have_lost)
        left = self.left_ns.get(arming.client)
        damaged = damaged or (left is not None and self.journal_may_have_lost(left))
        # an arena rebuilt from the journal since the arming holds it as a plain timer at its
        # journaled deadline: touches no longer move it
        rebuilt = any(arming.called_ns <= at <= at_ns for at in self.arena_losses)
        if arming.idle_ms is not None and arming.client not in self.crashed_clients and not damaged \
                and arming.client not in self.touch_tables_lost and not rebuilt:
            # touches are promised while their client lives: a client that died (a reboot
            # kills every client) takes its touch table with it, and a timer restored from
            # the journal is a plain timer at its last journaled deadline (docs/contracts.md)
            # (only touches the daemon could see when it fired it: one after that is too late;
            # fired_ms is the daemon's clock, whole ms, at or before the moment it read the table)
            touches = [t for t in self.touches.get((arming.client, arming.key), ()) if t <= fired_ns]
            if touches and arming is self.latest.get((arming.client, arming.key)):
                earliest = max(earliest, touches[-1] + arming.idle_ms * 1_000_000)
        if at_ns < earliest:
            self.violations.append(Violation(
                "early", f"{arming.key!r} (tag {arming.tag}) handed to client {client} "
                         f"{(earliest - at_ns) / 1e6:.3f} ms early"))


def latest_due_ns(history: History, arming: Arming) -> int:
    """The latest moment the daemon may hold ``arming`` as due: its delay counted from the
    acknowledging flush() (the daemon applied it by then), an idle timer's from its last
    touch if that came later (every touch, even of a client that died since: the daemon may
    have journaled it)."""
    delay_ns = arming.earliest_ns - arming.called_ns if arming.idle_ms is None else arming.idle_ms * 1_000_000
    start = arming.acked_ns
    if arming.idle_ms is not None:
        touches = history.touches.get((arming.client, arming.key))
        if touches and history.latest.get((arming.client, arming.key)) is arming:
            start = max(start, touches[-1])
    return start + delay_ns


def late(history: History, settled_ns: int, bound_ns: int, fire_bound_ns: int,
         idle_late: bool = False) -> list[Violation]:
    """Rule 6, timeliness: an acknowledged arming that comes due once the service has
    settled (no fault any more, a daemon up, a member polling in every group, every
    client that died past its resume grace and every copy past the ack timeout) is fired
    by the daemon within ``fire_bound_ns`` of :func:`latest_due_ns` (its ``fired_ms``)
    and handed to an application within ``bound_ns`` (which leaves room for an
    application that polls now and then). ``idle_late``: idle timers are not held (arena
    damage made attach free records that are restored from the journal without their
    touch reference: such a timer waits idle_ms from the restore, docs/contracts.md)."""
    out = []
    for arming in history.armings.values():
        if not arming.acked or arming.superseded_by is not None or not arming.handed:
            continue
        if idle_late and arming.idle_ms is not None:
            continue
        due = latest_due_ns(history, arming)
        if due < settled_ns or history.may_have_lost(arming):
            continue
        if arming.fired_ns is not None and arming.fired_ns - due > fire_bound_ns:
            out.append(Violation(
                "late", f"{arming.key!r} (tag {arming.tag}, group {arming.group!r}) was due by {due / 1e6:.3f} ms "
                        f"and fired {(arming.fired_ns - due) / 1e6:.3f} ms later, after the service had settled"))
            continue
        first = min(at for _client, at in arming.handed)
        if first - due > bound_ns:
            out.append(Violation(
                "late", f"{arming.key!r} (tag {arming.tag}, group {arming.group!r}) was due by {due / 1e6:.3f} ms "
                        f"and first handed {(first - due) / 1e6:.3f} ms later, after the service had settled"))
    return out


def check(history: History, end_ns: int, exact_groups: bool = True, settled_ns: int | None = None,
          late_bound_ns: int = 0, fire_bound_ns: int = 0, idle_late: bool = False) -> list[Violation]:
    """Every promise the history breaks (see the module docstring); ``end_ns``: when the run
    ended (every arming due by then must have been handed); ``settled_ns``: from when on
    rule 6 holds armings to ``late_bound_ns`` and ``fire_bound_ns`` (None: not checked)."""
    out = list(history.violations)
    if settled_ns is not None:
        out += late(history, settled_ns, late_bound_ns, fire_bound_ns, idle_late)
    for client, key, tag in history.unknown:
        out.append(Violation("invented", f"client {client} was handed {key!r} (tag {tag}), which nobody armed"))
    for arming in history.armings.values():
        superseder = arming.superseded_by
        if superseder is not None and superseder.acked and not arming.received_before_superseded and \
                not history.may_have_lost(superseder):
            mine = [at for client, at in arming.handed if client == arming.client]
            if mine:
                out.append(Violation(
                    "superseded", f"{arming.key!r} (tag {arming.tag}) was handed to its client at {mine[0] / 1e6:.3f} "
                                  f"ms after the client's acknowledged {superseder.kind} at "
                                  f"{superseder.called_ns / 1e6:.3f} ms"))
        damaged = (history.disk_damage_ns is not None and arming.called_ns <= history.disk_damage_ns) or \
            history.may_have_lost(arming)
        if arming.acked and superseder is None and not arming.handed and arming.earliest_ns <= end_ns and not damaged:
            out.append(Violation(
                "lost", f"{arming.key!r} (tag {arming.tag}, group {arming.group!r}, due at "
                        f"{arming.earliest_ns / 1e6:.3f} ms) was acknowledged by a flush() and never handed"))
        if exact_groups and len(arming.handed) > 1:
            last = max(at for _client, at in arming.handed)
            kept = [copy for copy in arming.copies
                    if not history.released(copy, last) and not history.replayed_after(arming, copy, last)]
            kept = history.returned_after_rearm(arming, kept, last)
            if len(kept) > 1:
                out.append(Violation("twice", f"{arming.key!r} (tag {arming.tag}) was handed {len(arming.handed)} "
                                              f"times ({arming.handed}) in group {arming.group!r}; the copies "
                                              f"{kept} (client, hand-over number, sent) were each acknowledged "
                                              f"in time to a daemon that applied it"))
    return out
