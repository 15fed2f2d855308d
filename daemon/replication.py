"""The core's side of ``--replicate``: what a flush() may answer, and when timers may go out.

The replicator (:mod:`wheeld.fleet.replicator`) sends the journal to the cluster and
says how far the stream has stored it (``replicated_lsn``) and whether this host's lease
is good (``lease_ok``). The decisions are here:

* ``--durability replicated``: the answers to a chunk with a FLUSH wait until the stream
  holds every event the chunk journaled (its lsn). Once one of a client's answers waits,
  its later ones wait behind it, so a client reads them in ring order. A FLUSH the
  stream has not stored after ``--replicate-timeout-s`` is answered with
  ``Rejected(code "replication_behind")`` then ``Applied``: the client raises
  ``ReplicationBehind`` and keeps its replay position, as for a stalled journal.
  Held answers go to the session they were made for, or to none: a client whose
  session ended reads them back from its ring when its next one opens (the executor
  marks a held chunk's FLUSHes ``replication_behind`` before the ring's head moves),
  and answered again on the next session they would be told twice.
* Delivery waits while the lease may have lapsed by this host's clock and a renewal is
  not answered yet (a host resumed after a pause must not fire what a peer may have
  taken over); once fenced, nothing goes out again.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Callable

log = logging.getLogger("wheeld.fleet")

REASON = ("not replicated: the cluster ({urls}) has not stored these commands within {timeout} s ({state}); "
          "they were applied (timers fire on this host) and are in the local journal; a flush() once "
          "replication caught up covers them")


class Replication:
    """Held answers (see the module docstring). ``send(cs, flushes, rejects, cuts,
    unsynced, code)`` answers a chunk."""

    def __init__(self, replicator, durability: str, timeout_ms: int, clock: Callable[[], int], totals: dict,
                 send: Callable):
        self.replicator = replicator
        self.replicated = durability == "replicated"
        self.timeout_ms = timeout_ms
        self.clock = clock
        self.totals = totals
        self.send = send
        self.held: deque = deque()  # (lsn, since_ms, cs, its session then, flushes, rejects, cuts, unsynced)
        self._held_by: Counter = Counter()  # client slot -> answers held

    def answer(self, cs, lsn: int, flushes: list, rejects: list, cuts, unsynced) -> None:
        """A chunk's answers: now, or once the stream holds ``lsn``."""
        if not self._held_by[cs.slot] and (not self.replicated or not flushes or unsynced
                                           or lsn <= self.replicator.replicated_lsn):
            self.send(cs, flushes, rejects, cuts, unsynced, None)
            return
        self.held.append((lsn, self.clock(), cs, cs.session, flushes, rejects, cuts, unsynced))
        self._held_by[cs.slot] += 1
        if self.replicated and flushes and not unsynced:
            self.replicator.hurry(lsn)  # (a flush waits for it: the outbox does not linger)

    def release(self, now: int) -> None:
        """Answer what the stream now holds, and what waited past the timeout (refused)."""
        held, stored = self.held, self.replicator.replicated_lsn
        while held:
            lsn, since, cs, session, flushes, rejects, cuts, unsynced = held[0]
            late = now - since >= self.timeout_ms
            if flushes and lsn > stored and not late:
                break  # (answers with no FLUSH only keep their place behind a client's held ones)
            held.popleft()
            self._held_by[cs.slot] -= 1
            code = None
            if lsn > stored and not unsynced and flushes:
                r = self.replicator
                unsynced = REASON.format(urls=",".join(r.config.urls), timeout=self.timeout_ms / 1000, state=r.state)
                code = "replication_behind"
                self.totals["journal_flushes_refused_total"] += len(flushes)
            if cs.session is session:  # (else read back from the ring: see the module docstring)
                self.send(cs, flushes, rejects, cuts, unsynced, code)

    def next_timeout_ms(self) -> int | None:
        """When the oldest held answer times out (None: none held)."""
        return self.held[0][1] + self.timeout_ms if self.held else None


def adopt_timers(wheel, recorder, clock: Callable[[], int], host: str, state,
                 late_marks: set | None = None,
                 clocks: Callable[[], tuple[int, int]] | None = None) -> tuple[int, int, int]:
    """Put a lost host's timers (``state``: a :class:`~wheeld.journal.recovery.RecoveredState`
    read from its stream) into this daemon's arena and journal: each in the group of the
    same name, at its wall-clock deadline (one already past is due at once and fires
    late); a fired one its host had not seen acknowledged is due at once. A key the group
    already holds here keeps its timer; the adopted one goes in as ``<key>@<host>``. Those
    due at once go into ``late_marks`` (slot, generation): they fire marked late.
    ``clocks``: the (wall ns, monotonic ns) reading of the host whose ``clock`` this is
    (:func:`wheeld.daemon.recovery.host_clocks`; the real clocks by default).
    Returns (timers adopted, keys renamed, timers that did not fit)."""
    from wheeld.journal.files import read_clocks, wall_to_monotonic_ns
    from wheeld.protocol.errors import InvalidRequest, WheeldError
    from wheeld.shm.wheel import MAX_DELAY_MS

    wall_ns, mono_ns = (clocks or read_clocks)()
    now = clock()
    adopted = renamed = lost = 0
    recorder.begin()
    timers = [(t, True) for t in state.unacked] + [(t, False) for t in state.pending.values()]
    for t, fired in timers:
        deadline = wall_to_monotonic_ns(t.deadline_ms, wall_ns, mono_ns)
        deadline = max(min(deadline, now) if fired else deadline, wheel.current_ms - MAX_DELAY_MS + 1)
        try:
            gid = wheel.group_id(t.group)
            key = t.key
            if wheel.lookup(key, gid) is not None:
                key = _renamed(key, host)
                renamed += 1
            placed = wheel.schedule(key, deadline, gid, t.seq & 0xFFFFFFFF)
            if deadline <= now and late_marks is not None:
                late_marks.add(placed)
            recorder.armed(gid, key, deadline, t.seq & 0xFFFFFFFF, None, None)
            adopted += 1
        except (InvalidRequest, WheeldError) as exc:
            lost += 1
            if lost <= 10:
                log.error("fleet: timer %r of group %s of host %s not adopted: %s", t.key, t.group, host, exc)
    recorder.commit(now)
    return adopted, renamed, lost


def _renamed(key, host: str):
    suffix = f"@{host}"
    if isinstance(key, bytes):
        return key + suffix.encode()
    return f"{key}{suffix}"
