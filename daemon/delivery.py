"""Delivery: what comes due leaves the wheel and reaches a member of its group.

* **Expire** (:meth:`Delivery.expire`): on the Python path a level-1 cascade or a
  backlog goes through the wheel's batch ``expire_many``, a level-0 bucket of a
  few timers through the scalar ``expire``; with the compiled wheel always the
  scalar ``expire`` (cheaper at every size there). From ``COLUMNS_MIN`` timers on
  they are queued from the records' numpy columns, below from record tuples (*rows*).
  With ``--journal`` the rows are what the
  Recorder observes: every fire and idle re-arm becomes an event.
* **Idle timers**: one that comes due and was touched since it was armed goes back
  on the wheel at ``last touch + idle time`` (:meth:`Delivery.idle_check` reads the
  client's touch table), or is released when its key was armed again meanwhile.
* **Queues**: what fired waits in its group's queue (slot, generation, fired_ms,
  late) until a member can take it; what a client had in flight when it went goes
  back to the front (:meth:`Delivery.requeue`).
* **Lateness**: fired - deadline of every expiration, as the arena header's histogram
  (published by the daemon) and ``late_total``, the timers fired more than a tick late.
* **Deadlines in the past** are accepted (the wheel takes any deadline within
  ``MAX_DELAY_MS`` of its clock, either side): a command can reach the daemon long after
  its client wrote it (a ring handed back after a daemon restart), and a client may
  compute one on purpose. Such a timer is due at once and fires at the next expiry; its
  expiration carries the deadline as given (``add()`` returns it, and
  ``fired_ms >= deadline_ms`` stays literally true). Its *lateness* is measured from
  the later of its deadline and ``now - LATENESS_CAP_MS``: one expiration adds at most
  a day to the lateness sum, computed without overflow for any int64 deadline (a
  damaged record's too), and the arena's counter words saturate
  (:func:`wheeld.protocol.arena_layout.saturating_add`) and are clamped when read
  back, so no value a client can choose, and no damaged word a restart reads, can
  overflow them.
* **Dispatch** (:meth:`Delivery.dispatch`): queues go to live members round robin,
  one ``Expirations`` frame per ``--delivery-batch``, written straight from the
  records (:func:`wheeld.daemon.frames.expirations_frame`, in C when compiled; a
  frame with an item its client might refuse, or a large batch, is built from item
  tuples by :func:`wheeld.protocol.messages.encode_expirations_frame` and checked). A
  queued entry no longer FIRED with its generation (acknowledged meanwhile, e.g. by an
  ack left in a ring across a restart) is dropped.
* **Recipients**: before a frame is sent, each of its records gets the client slot
  it goes to in its aux word (:meth:`TimerWheel.mark_fired
  <wheeld.shm.wheel.TimerWheel.mark_fired>`, ``arena_layout.recipient_aux``). A
  daemon restarted on the arena *holds* a fired record whose recipient's slot it
  finds in the client table (:meth:`Delivery.hold`): it goes to that client first,
  once it resumes its slot (its library knows whether it handed the expiration
  already: a copy is acknowledged, not handed again), and to its group when the slot
  is freed (:meth:`Delivery.release_held`: a ``Bye``, ``--resume-grace-s`` without
  the client, or the slot collected). What a session had in flight when it ended
  while the daemon runs, or left unacknowledged for the ack timeout, goes to its
  group (:meth:`Delivery.requeue`), and its record names no recipient until it is
  sent again.

Never early: ``expire(now)`` returns only timers with ``deadline <= now``.
"""

from __future__ import annotations

import bisect
import collections
import logging
from itertools import repeat
from typing import Callable

import numpy as np

from wheeld.protocol import accel
from wheeld.protocol import arena_layout as AL
from wheeld.protocol import clients_layout as CL
from wheeld.protocol import messages as M
from wheeld.protocol.errors import ProtocolError
from wheeld.protocol.keys import VALID_KEY_METAS, decode_key, key_length
from wheeld.shm.ring import MAX_IDLE_MS
from wheeld.shm.wheel import TimerWheel

from .frames import LATENESS_CAP_MS, expirations_frame, fired_items, lateness_us, queue_usual, suspect

log = logging.getLogger("wheeld")

EXPIRE_MANY_MIN = 24  # see Delivery.expire (expire_many costs more per call, less per timer)
# Compiled, the scalar expire is cheaper at every rate python -m bench.daemon_paths
# measures ("expire paths"): there the daemon always expires through it (docs/figures.md).
SCALAR_EXPIRE = accel.compiled("wheeld.shm.wheel")
# Record tuples of a few expired timers: compiled, record_rows reads them from the arena in C
# (no numpy call); the Python path takes numpy's records_of(...).tolist() (one call for all).
ROWS_FROM_ARENA = SCALAR_EXPIRE
COLUMNS_MIN = 256  # expirations handled per column (numpy) from this many on, per row below
# Idle timers due this soon are re-armed ahead when touched (Delivery.rearm_ahead). A
# daemon that only idle timers wake sleeps about this long between wake-ups, each of
# which costs ~100-200 us however few timers it moves: at 10,000 connections 128 ms
# took the daemon from 0.63-0.72 to 0.37-0.40 us per read against 32 ms (bench/sockets.py).
IDLE_AHEAD_MS = 128
IDLE_AHEAD_EVERY_MS = 32  # ... looked for at most this often (each timer is looked at ~4 times before it is due)
# Records looked at per call: bounds the pass (~0.4 ms of cold records), so a timer due
# meanwhile waits no longer; a horizon that holds more is covered by the next wake-ups.
# At 10,000 connections (bench/sockets.py, 3 runs each) 1024 cost the daemon 0.24-0.28 us
# per read against 256's 0.37-0.40, but its close lateness p99 was 1.8-8.4 ms against
# 1.6-3.8; at 50,000, 1024 gave 0.15 us, 256 0.50 (six passes cover the horizon's ~1,600).
IDLE_AHEAD_ENTRIES = 256
IDLE_WAIT_MS = 100  # an idle timer whose client has not come back after a restart waits this long
_LATENESS_BOUNDS_US = np.array(AL.LATENESS_BOUNDS_US, dtype=np.int64)
_VALID_META = np.array(VALID_KEY_METAS, dtype=bool)


def lateness_us_array(now: int, deadlines: np.ndarray) -> np.ndarray:
    """:func:`lateness_us` of many deadlines (int64), without int64 overflow: the deadlines
    are clipped into ``now - LATENESS_CAP_MS .. now`` before anything is subtracted."""
    return (now - np.clip(deadlines, now - LATENESS_CAP_MS, now)) * 1000


class Lateness:
    """How late expirations fire, until the daemon publishes it (:meth:`publish`)."""

    def __init__(self, tick_ms: int):
        self.counts = [0] * AL.LATENESS_BUCKETS
        self.sum_us = 0
        self.beyond_tick = 0  # fired more than a tick after the deadline (late_total)
        self._tick_us = tick_ms * 1000

    def add(self, late_us) -> None:
        """Count expirations fired ``late_us`` after their deadline: a list, or an int64
        array for many. Bucket i counts lateness <= bounds[i], like Prometheus ``le``
        (``bisect_left``, and ``searchsorted(side="left")`` for the array)."""
        counts = self.counts
        if isinstance(late_us, np.ndarray):
            # summed as whole ms and the rest: a day (the cap) in us times a backlog of ~10**5
            # expirations would pass 2**63 in one int64 sum; in ms it takes ~10**11
            self.sum_us += int((late_us // 1000).sum()) * 1000 + int((late_us % 1000).sum())
            self.beyond_tick += int(np.count_nonzero(late_us > self._tick_us))
            buckets = np.bincount(np.searchsorted(_LATENESS_BOUNDS_US, late_us, side="left"),
                                  minlength=AL.LATENESS_BUCKETS)
            for i, count in enumerate(buckets.tolist()):
                if count:
                    counts[i] += count
            return
        bounds, tick_us = AL.LATENESS_BOUNDS_US, self._tick_us
        for us in late_us:
            counts[bisect.bisect_left(bounds, us)] += 1
            if us > tick_us:
                self.beyond_tick += 1
        self.sum_us += sum(late_us)

    def publish(self, words, totals: dict) -> None:
        """Add what was counted since the last call to the arena header's histogram (the
        words saturate, and a damaged one is repaired first: AL.saturating_add)."""
        base = AL.H_LATENESS // 8
        counts = self.counts
        if any(counts):
            for i, count in enumerate(counts):
                if count:
                    AL.saturating_add(words, base + i, count)
                    counts[i] = 0
        if self.sum_us:
            AL.saturating_add(words, AL.H_LATENESS_SUM_US // 8, self.sum_us)
            self.sum_us = 0
        totals["late_total"] += self.beyond_tick
        self.beyond_tick = 0


class Delivery:
    """Fired timers from the wheel to group members (see the module docstring).

    ``clients`` is the daemon's client table (idle timers read their client's touch
    table); ``members`` gid -> the sessions of that group, filled by the sessions."""

    def __init__(self, wheel: TimerWheel, clients: dict, config, totals: dict, started_ms: int,
                 poison: Callable, clock: Callable[[], int], recorder=None):
        self.wheel = wheel
        self.clients = clients
        self.config = config
        self.totals = totals
        self.started_ms = started_ms  # a timer due before this fires marked late (the daemon was down)
        #: (slot, generation) of records that fire marked late whatever their deadline: a lost
        #: host's timers adopted after they came due (wheeld.daemon.replication.adopt_timers)
        self.late_marks: set[tuple[int, int]] = set()
        self.poison = poison
        self.clock = clock
        self.recorder = recorder
        self.queues: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        # client slot -> (group, queue): fired records sent to that client before a restart,
        # waiting for it to resume its slot (see "Recipients" above)
        self.held: dict[int, tuple[int, collections.deque]] = {}
        self.members: dict[int, list] = collections.defaultdict(list)
        self.lateness = Lateness(wheel.tick_ms)
        self._rr = 0
        self._last_expired = 0  # timers the last expire fired (chooses the wheel method)
        self._next_ahead = 0  # when rearm_ahead looks again
        self._level1_tick_ms = wheel.tick_ms * wheel.wheel_size

    # ------------------------------------------------------------------ expire
    def expire(self, now: int) -> None:
        """Fire what is due at ``now``: idle timers that were touched go back on the wheel,
        the rest join their group's queue (and the lateness counts)."""
        # expire_many costs tens of us per call and less per timer; expire the reverse. A
        # level-1 bucket (its expiration a multiple of tick_ms * wheel_size) cascades
        # thousands of timers, a backlog (the clock ran more than a tick past the first
        # due bucket) covers many buckets, and a rate of many per level-0 bucket shows
        # in the previous call: batch methods then; one level-0 bucket of a few, per item.
        wheel = self.wheel
        due = wheel.next_deadline()
        if due is None or due > now:
            wheel.expire(now)  # nothing is due: only moves the clock
            return
        recorder = self.recorder
        if recorder is not None:
            recorder.begin()
        if SCALAR_EXPIRE or (self._last_expired < EXPIRE_MANY_MIN and now - due <= wheel.tick_ms
                             and due % self._level1_tick_ms):
            # idle timers touched since they were armed go back on the wheel in this pass
            rearmed: list | None = None if recorder is None else []
            slots = wheel.expire(now, self.clients, rearmed)
            if rearmed:
                self._journal_rearmed(rearmed)
            self._last_expired = len(slots)
            if len(slots) >= COLUMNS_MIN and recorder is None:
                fired = np.array(slots, dtype=np.int64)
                self._queue_columns(fired, wheel.records_of(fired), now)
            elif slots:
                if recorder is None and not self.late_marks:
                    self._queue_usual(slots, now)
                else:
                    self._queue_rows(slots, self._rows(slots), now)
        else:
            slots = wheel.expire_many(now)
            self._last_expired = slots.size
            if slots.size >= COLUMNS_MIN and recorder is None:
                self._queue_columns(slots, wheel.records_of(slots), now)
            elif slots.size:
                self._queue_rows(slots.tolist(), wheel.records_of(slots).tolist(), now)
        if recorder is not None:
            recorder.commit(now)

    def rearm_ahead(self, now: int) -> None:
        """Idle timers due in the next ``IDLE_AHEAD_MS`` whose touch words already put them
        later move there now (``TimerWheel.rearm_touched_ahead``): the buckets they leave
        need no wake-up. At most every ``IDLE_AHEAD_EVERY_MS``: a timer due within the
        horizon is looked at again before it comes due all the same."""
        if now < self._next_ahead:
            return
        self._next_ahead = now + IDLE_AHEAD_EVERY_MS
        recorder = self.recorder
        if recorder is None:
            self.wheel.rearm_touched_ahead(now, IDLE_AHEAD_MS, IDLE_AHEAD_ENTRIES, self.clients)
            return
        rearmed: list = []
        recorder.begin()
        if self.wheel.rearm_touched_ahead(now, IDLE_AHEAD_MS, IDLE_AHEAD_ENTRIES, self.clients, rearmed):
            self._journal_rearmed(rearmed)
        recorder.commit(now)

    def _journal_rearmed(self, rearmed: list) -> None:
        """The idle timers the wheel re-armed in its pass (``TimerWheel.expire``), journaled
        as :meth:`_rearm_idle` journals one."""
        recorder = self.recorder
        rows = self._rows([slot for slot, _old, _new, _idle in rearmed])
        for (_slot, deadline, rearm_at, idle_ms), row in zip(rearmed, rows):
            _d, _prev, _next, _gen, tag, _aux, group, _state, meta, key = row
            recorder.idle_rearmed(group, decode_key(key, meta), deadline, rearm_at, tag, idle_ms)

    def _queue_usual(self, slots: list, now: int) -> None:
        """:meth:`_queue_rows` without a journal or late marks: the usual records queued by
        :func:`~wheeld.daemon.frames.queue_usual` (in C, compiled), each other one (an idle
        timer, a damaged record) here, in the wheel's order."""
        i, end = 0, len(slots)
        wheel, started, lateness, queues = self.wheel, self.started_ms, self.lateness, self.queues
        while True:
            i = queue_usual(wheel, slots, i, now, started, lateness, queues)
            if i >= end:
                return
            self._queue_rows(slots[i : i + 1], self._rows(slots[i : i + 1]), now)
            i += 1

    def _queue_rows(self, slots: list, rows: list, now: int) -> None:
        """Expired timers as record tuples: idle re-arms, queues, lateness, journal."""
        queues, started, recorder = self.queues, self.started_ms, self.recorder
        late_us = []
        max_groups = self.wheel.max_groups
        for s, row in zip(slots, rows):
            deadline, _prev, _next, gen, tag, aux, group, _state, meta, key = row
            if group >= max_groups or not VALID_KEY_METAS[meta]:
                self.damaged(s, gen, f"group id {group}, key meta {meta:#x}")
                continue
            idle_ms = 0  # journaled with the fire: an idle timer's idle_ms is in its client's touch table
            if aux >= 0:  # an idle timer: was it touched since it was armed?
                rearm_at, idle_ms = self.idle_check(aux, now)
                if rearm_at is not None:
                    self._rearm_idle(s, row, rearm_at, idle_ms)
                    continue
            late_us.append(lateness_us(now, deadline))
            late = deadline < started
            if self.late_marks and not late:
                late = _marked(self.late_marks, s, gen)
            queues[group].append((s, gen, now, late))
            if recorder is not None:
                try:
                    user_key = decode_key(key, meta)
                except ValueError:  # a damaged str key (not UTF-8): dispatch finds it undeliverable
                    continue
                recorder.fired(group, user_key, deadline, tag, now, late, idle_ms or None)
        self.lateness.add(late_us)

    def _queue_columns(self, slots: np.ndarray, records: np.ndarray, now: int) -> None:
        """:meth:`_queue_rows` for many timers, from the records' numpy columns (no journal)."""
        bad = (records["group"] >= self.wheel.max_groups) | ~_VALID_META[records["key_meta"]]
        if bad.any():
            for j in np.flatnonzero(bad).tolist():
                self.damaged(int(slots[j]), int(records["gen"][j]),
                             f"group id {int(records['group'][j])}, key meta {int(records['key_meta'][j]):#x}")
            slots, records = slots[~bad], records[~bad]
            if not slots.size:
                return
        idle = records["aux"] >= 0
        if idle.any():
            keep = np.ones(slots.size, dtype=bool)
            for j in np.flatnonzero(idle).tolist():
                row = records[j].item()
                rearm_at, idle_ms = self.idle_check(row[5], now)
                if rearm_at is not None:
                    self._rearm_idle(int(slots[j]), row, rearm_at, idle_ms)
                    keep[j] = False
            if not keep.all():
                slots, records = slots[keep], records[keep]
                if not slots.size:
                    return
        deadlines = records["deadline"]
        self.lateness.add(lateness_us_array(now, deadlines))
        late = (deadlines < self.started_ms).tolist()
        if self.late_marks:
            marks = self.late_marks
            late = [was or _marked(marks, slot, gen)
                    for was, slot, gen in zip(late, slots.tolist(), records["gen"].tolist())]
        groups = records["group"]
        first = int(groups[0])
        if (groups == first).all():
            self.queues[first].extend(zip(slots.tolist(), records["gen"].tolist(), repeat(now), late))
            return
        queues = self.queues
        for slot, gen, group, is_late in zip(slots.tolist(), records["gen"].tolist(), groups.tolist(), late):
            queues[group].append((slot, gen, now, is_late))

    def damaged(self, slot: int, gen: int, what: str) -> None:
        """A fired record that cannot be delivered (its fields were overwritten in the arena:
        no writer of wheeld leaves them so): logged, counted, and freed, so that it is not
        sent, and not kept, forever. Its timer is lost here; with ``--journal`` the journal
        still has it, and the next attach restores it (:mod:`wheeld.daemon.reconcile`)."""
        log.error("arena damage: fired record %d (generation %d) cannot be delivered (%s): freed", slot, gen, what)
        totals = self.totals
        totals["arena_damaged_records_total"] = totals.get("arena_damaged_records_total", 0) + 1
        totals["arena_timers_lost_total"] = totals.get("arena_timers_lost_total", 0) + 1
        self.wheel.release(slot, gen)

    def _receivable(self, items: list[tuple]) -> list[tuple]:
        """The items of a frame its client would refuse, one by one: a generation beyond 31
        bits is masked in its record (the timer is delivered), any other item the client
        would refuse is a damaged record (:meth:`damaged`)."""
        out = []
        for item in items:
            problem = M.expirations_frame_problem(M.encode_expirations_frame([item]))
            if problem is None:
                out.append(item)
                continue
            slot, gen = item[5], item[6]
            masked = self.wheel.mask_generation(slot, gen)
            if masked is not None:
                repaired = item[:6] + (masked,) + item[7:]
                if M.expirations_frame_problem(M.encode_expirations_frame([repaired])) is None:
                    log.error("arena damage: fired record %d had generation %d (beyond 31 bits): masked to %d",
                              slot, gen, masked)
                    totals = self.totals
                    totals["arena_damaged_records_total"] = totals.get("arena_damaged_records_total", 0) + 1
                    out.append(repaired)
                    continue
                gen = masked
            self.damaged(slot, gen, problem)
        return out

    def _rearm_idle(self, slot: int, row: tuple, rearm_at: int, idle_ms: int) -> None:
        """An idle timer touched since it was armed goes back on the wheel at ``rearm_at``
        (or is released: its key was armed again meanwhile)."""
        deadline, _prev, _next, gen, tag, _aux, group, _state, meta, key = row
        if not self.wheel.rearm_fired(slot, gen, rearm_at):
            self.wheel.release(slot, gen)
        elif self.recorder is not None:
            self.recorder.idle_rearmed(group, decode_key(key, meta), deadline, rearm_at, tag, idle_ms)

    def recheck_idle(self, slot: int, aux: int, now: int) -> bool:
        """A FIRED idle timer a restarted daemon found never sent (its aux word still its
        touch reference): the previous daemon may have stopped between the wheel's expire
        and :meth:`idle_check` (docs/contracts.md, "Time": it fires an idle timer once its
        clock has passed the touch word it read plus ``idle_ms``; it read none for this
        fire). Checked again as :meth:`expire` does: True when it went back on the wheel
        (or was released: its key was armed again), False to deliver it now."""
        rearm_at, idle_ms = self.idle_check(aux, now)
        if rearm_at is None:
            return False
        recorder = self.recorder
        if recorder is not None:
            recorder.begin()
        self._rearm_idle(slot, self._rows([slot])[0], rearm_at, idle_ms)
        if recorder is not None:
            recorder.commit(now)
        return True

    def idle_check(self, aux: int, now: int) -> tuple[int | None, int]:
        """For an idle timer that came due at ``now``: (when it must fire instead, or None
        to fire it now; its idle_ms, 0 when unknown).

        The last touch and the idle time are read from the client's touch table,
        which the client writes: impossible values poison that client (its session
        ends; the timer fires now). A client that has not handed its ring back since
        a daemon restart has its touches out of reach for a while: its idle timers
        wait ``IDLE_WAIT_MS`` at a time, up to ``resume_grace_s``, rather than
        firing for connections that may well be active."""
        cs = self.clients.get(aux >> CL.TOUCH_INDEX_BITS)
        if cs is None or cs.poisoned:
            return None, 0
        if cs.segment is None:
            waited_ms = now - cs.orphan_since
            return (now + IDLE_WAIT_MS if waited_ms < self.config.resume_grace_s * 1000 else None), 0
        try:
            # the bound for a touch is the clock after the touch word was read, not the
            # iteration's ``now``: the client may have touched after either clock read
            activity = cs.segment.read_activity(aux & CL.TOUCH_INDEX_MASK, now, self.clock)
        except ProtocolError as exc:
            self.poison(cs, f"touch table: {exc}")
            return None, 0
        if activity is None:
            return None, 0
        touched, idle_ms = activity
        return (touched + idle_ms if touched + idle_ms > now else None), idle_ms

    def idle_ms_of(self, aux: int) -> int | None:
        """The idle time an idle timer's touch reference ``aux`` names in its client's touch
        table, or None while the table is out of reach (a slot still waiting for its client
        after a restart, a poisoned client, a freed slot) or holds no sound value there (the
        Recorder's ``idle_source``: what its snapshots write as the timer's ``i``)."""
        cs = self.clients.get(aux >> CL.TOUCH_INDEX_BITS)
        views = cs.touch_views() if cs is not None else None
        if views is None:
            return None
        try:
            idle_ms = int(views[1][aux & CL.TOUCH_INDEX_MASK])
        except IndexError:  # a row beyond its table
            return None
        return idle_ms if 0 < idle_ms <= MAX_IDLE_MS else None

    # ------------------------------------------------------------------ queues
    def requeue(self, pairs: list[tuple[int, int]], group: int) -> None:
        """Expirations in flight to a client that is gone (or too slow) go to the front of its
        group's queue. Their records no longer name that client as their recipient: a
        daemon restarted before they are sent again must not hold them for a client that
        is gone (for up to ``--resume-grace-s``), it queues them for the group."""
        if pairs:
            rec = self.wheel.records
            slots = np.fromiter((s for s, _gen in pairs), dtype=np.int64, count=len(pairs))
            gens = np.fromiter((gen for _s, gen in pairs), dtype=np.int64, count=len(pairs))
            inside = (slots >= self.wheel.first_entry) & (slots < len(rec))
            same = slots[inside][rec["gen"][slots[inside]] == gens[inside]]  # not freed and used again since
            if same.size:
                self.wheel.mark_fired(same.tolist(), -1)
            now = self.clock()
            self.queues[group].extendleft((s, gen, now, False) for s, gen in reversed(pairs))
            self.totals["redelivered_total"] += len(pairs)

    def hold(self, client_slot: int, group: int, entry: tuple) -> None:
        """A queue entry (slot, generation, fired_ms, late) of a fired record that was sent
        to ``client_slot`` before a restart: it waits for that client (:meth:`dispatch`)."""
        held = self.held.get(client_slot)
        if held is None:
            held = self.held[client_slot] = (group, collections.deque())
        held[1].append(entry)

    def release_held(self, client_slot: int) -> int:
        """The slot is freed: what waits for its client goes to the front of its group's
        queue, in the order it was held. Returns how many entries moved."""
        held = self.held.pop(client_slot, None)
        if held is None:
            return 0
        group, entries = held
        self.queues[group].extendleft(reversed(entries))
        return len(entries)

    def undelivered(self) -> int:
        queued = sum(map(len, self.queues.values()))
        return queued + sum(len(q) for _group, q in self.held.values()) if self.held else queued

    # ------------------------------------------------------------------ dispatch
    def dispatch(self) -> None:
        """Send what is held for a client that is back to it, then queued expirations to live
        group members, round robin; one frame per batch."""
        batch = self.config.delivery_batch
        if self.held:
            self._dispatch_held(batch)
        if not any(self.queues.values()):
            return  # nothing queued: no pass over the groups
        for gid, queue in self.queues.items():
            if not queue:
                continue
            members = [m for m in self.members.get(gid, ()) if not m.congested and not m.closed]
            while queue and members:
                self._rr += 1
                member = members[self._rr % len(members)]
                popleft = queue.popleft
                self._send(member, [popleft() for _ in range(min(batch, len(queue)))])
                members = [m for m in members if not m.congested and not m.closed]

    def _dispatch_held(self, batch: int) -> None:
        """What waits for a client (:meth:`hold`) goes to it once it has a session again."""
        for client_slot, (_group, queue) in list(self.held.items()):
            cs = self.clients.get(client_slot)
            member = cs.session if cs is not None else None
            if member is None:
                if cs is None:  # the slot is gone (its release moves what it held): to the group
                    self.release_held(client_slot)
                continue
            while queue and not member.congested and not member.closed:
                popleft = queue.popleft
                self._send(member, [popleft() for _ in range(min(batch, len(queue)))])
            if not queue:
                del self.held[client_slot]

    def _send(self, member, taken: list) -> None:
        """One ``Expirations`` frame of queue entries to ``member`` (a session): the entries
        still FIRED with their generation, each record marked as sent to its client first.
        A few at a time, the usual frame is written from the arena by
        :func:`~wheeld.daemon.frames.expirations_frame` (in C, compiled); one it does not
        take, or a large batch, is built here from the records' items, and checked."""
        if len(taken) < COLUMNS_MIN:
            client = member.client
            built = expirations_frame(self.wheel, taken, AL.recipient_aux(client.slot), client.unacked)
            if built is not None:
                frame, count = built
                if count:
                    member.send(frame)
                    self.totals["delivered_total"] += count
                return
        items = self._items_from_columns(taken) if len(taken) >= COLUMNS_MIN else self._items_from_rows(taken)
        if items:
            frame = M.encode_expirations_frame(items)
            # never a frame the client refuses: one with an item that may not decode
            # is checked with the client's own decoder
            if suspect(items) and M.expirations_frame_problem(frame) is not None:
                items = self._receivable(items)
                frame = M.encode_expirations_frame(items)
        if items:
            client = member.client
            pairs = [(item[5], item[6]) for item in items]
            # before the frame leaves: a daemon killed once the client may have it finds the
            # client it went to in the arena (see "Recipients" above)
            self.wheel.mark_fired([slot for slot, _gen in pairs], AL.recipient_aux(client.slot))
            client.unacked.update(pairs)
            member.send(frame)
            self.totals["delivered_total"] += len(items)

    def _items_from_rows(self, taken: list) -> list[tuple]:
        """``Expirations`` items (``M.ExpiryFields`` order) for queued (slot, gen, fired_ms, late)
        entries still FIRED with that generation; a few at a time, from record tuples."""
        return fired_items(taken, self._rows([entry[0] for entry in taken]))

    def _rows(self, slots: list) -> list[tuple]:
        """The record tuples of ``slots`` (:meth:`TimerWheel.record_rows`)."""
        if ROWS_FROM_ARENA:
            return self.wheel.record_rows(slots)
        return self.wheel.records_of(slots).tolist()

    def _items_from_columns(self, taken: list) -> list[tuple]:
        """:meth:`_items_from_rows` for a large batch, from the records' columns."""
        slot_list, gen_list, fired_list, late_list = zip(*taken)
        records = self.wheel.records_of(slot_list)
        ok = (records["state"] == AL.FIRED) & (records["gen"] == np.array(gen_list, dtype=np.int64))
        if not ok.all():
            keep = np.flatnonzero(ok).tolist()
            records = records[ok]
            slot_list = [slot_list[j] for j in keep]
            gen_list = [gen_list[j] for j in keep]
            fired_list = [fired_list[j] for j in keep]
            late_list = [late_list[j] for j in keep]
        keys = [raw[:length] for raw, length in zip(records["key"].tolist(), key_length(records["key_meta"]).tolist())]
        return list(zip(keys, records["key_meta"].tolist(), records["deadline"].tolist(), fired_list,
                        records["tag"].tolist(), slot_list, gen_list, late_list))


def _marked(marks: set, slot: int, gen: int) -> bool:
    """Is record ``slot`` (of generation ``gen``) marked to fire late? (the mark is used up)"""
    try:
        marks.remove((slot, gen))
        return True
    except KeyError:
        return False
