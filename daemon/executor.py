"""The executor: client commands drained from the rings, applied to the wheel.

Each ring is drained a chunk at a time (:meth:`Executor.drain`), copied out of the ring
as bytes (:meth:`~wheeld.shm.ring.ClientSegment.peek_bytes`) and checked up to its first
malformed record (:func:`valid_prefix`). A chunk of at
least ``BATCH_MIN`` valid records (Python path only, see below) is planned (:func:`wheeld.daemon.planner.plan_batch`)
and the plan applied: one ``cancel_many``, one ``release_many`` for its ACKs, one
``schedule_many``. A smaller chunk, or one of a group near its ``--group-quota``,
is applied record by record in ring order (:meth:`Executor.apply_in_order`), the
behaviour a plan must reproduce. With ``--journal`` both report to the Recorder
the same way: the keyed commands applied as a :class:`~wheeld.daemon.planner.CommandLog`,
each released ACK as it is released.

Then the chunk is committed: journal appended (fsynced under ``--fsync always``),
each refusal, and each FLUSH not answered as durable, marked in its ring record
(:func:`_mark_answers`: an answer lost after this point is read back from the ring
by the client), ring head published (a daemon killed before it re-applies the
chunk: every command is idempotent), FLUSHes answered with ``Applied`` and refusals with
``Rejected``, in ring order: a refusal goes before the ``Applied`` of the first
FLUSH after its command (:func:`answer_order`).
"""

from __future__ import annotations

import logging
import struct
from time import perf_counter_ns
from typing import Callable

import numpy as np

from wheeld.protocol import accel
from wheeld.protocol import arena_layout as L
from wheeld.protocol import clients_layout as CL
from wheeld.protocol import commands as C
from wheeld.protocol import messages as M
from wheeld.protocol.errors import ArenaFull, InvalidRequest, ProtocolError
from wheeld.protocol.keys import TYPE_STR
from wheeld.shm.wheel import MAX_DELAY_MS, TimerWheel, deadline_reason

from .planner import CommandLog, Plan, Rejection, plan_batch, rejection

log = logging.getLogger("wheeld")

_META = [bytes((m,)) for m in range(256)]
DRAIN_BATCH = 8192  # commands taken from one ring per loop iteration, at most
APPLY_CHUNK = 4096  # applied, then committed, at a time, at most
# The daemon's time one ring may take per loop iteration: once a ring's chunks have
# taken this long, the drain moves on to the next ring (and, in the next iteration,
# back to it). A chunk is sized by what its commands cost so far (ClientSlot.apply_ns:
# the last chunk's ns per command, or less than an eighth below the one before; a
# ring whose cost is not known yet gets FIRST_CHUNK), so one chunk of expensive
# commands (each refused, say) does not hold the loop either. A chunk of 4096
# ordinary commands fits it (~1.5-5 ms, compiled or planned).
RING_BUDGET_NS = 5_000_000
FIRST_CHUNK = 512
MIN_CHUNK = 64
# On the Python path smaller drained chunks are cheaper one command at a time, larger
# ones planned (a plan has a fixed cost and a lower cost per command). Compiled, in
# order wins at every size, so there every chunk is applied in order (BATCH_MIN None).
# The crossover and the costs: docs/figures.md (python -m bench.daemon_paths).
PLAN_BATCH_MIN = 192
BATCH_MIN = None if accel.compiled("wheeld.shm.wheel") else PLAN_BATCH_MIN
_ADD, _ADD_IDLE, _CANCEL, _ACK, _FLUSH = C.ADD, C.ADD_IDLE, C.CANCEL, C.ACK, C.FLUSH
# A ring record's fields as executor.pxd reads them from the raw bytes: the offsets from
# their owner (wheeld.protocol.commands), the widths its loads assume checked here.
_RECORD_SIZE = C.RECORD_SIZE
_O_META, _O_RESERVED, _O_SEQ, _O_DEADLINE = C.KEY_META_OFFSET, C.RESERVED_OFFSET, C.SEQ_OFFSET, C.DEADLINE_OFFSET
_O_AUX0, _O_AUX1, _O_CHECK, _O_PAD, _O_KEY = C.AUX0_OFFSET, C.AUX1_OFFSET, C.CHECK_OFFSET, C.PAD_OFFSET, C.KEY_OFFSET
_KEY_FIELD = C.KEY_FIELD_SIZE
assert C.OP_OFFSET == 0 and _KEY_FIELD == 32  # op read as the first byte; a 33-byte ident buffer
assert [C.RECORD_DTYPE.fields[name][0].itemsize for name in ("reserved", "seq", "deadline_ms", "aux0", "aux1",
                                                             "check", "pad")] == [2, 4, 8, 4, 4, 4, 4]
assert C.CHECKED_HEAD_SIZE == _O_CHECK  # the crc covers the head before the check word, then the key
# ...and as the Python path reads them (struct): every field of RECORD_DTYPE, in its order
_RECORD = struct.Struct("<BBHIqiiII32s")
assert _RECORD.size == _RECORD_SIZE and list(C.RECORD_DTYPE.names) == [
    "op", "key_meta", "reserved", "seq", "deadline_ms", "aux0", "aux1", "check", "pad", "key"]
assert [C.RECORD_DTYPE.fields[name][1] for name in C.RECORD_DTYPE.names] == [0, 1, 2, 4, 8, 16, 20, 24, 28, 32]
# Compiled (executor.pxd), the in-order loop reads the records from their bytes.
_COMPILED = not __file__.endswith(".py")


def timerfd_arm(fd: int, at_ns: int) -> int:
    """Arm the timerfd ``fd`` for the absolute CLOCK_MONOTONIC time ``at_ns`` (at least
    1 ns: an all-zero time would disarm it), in one C call: the daemon's park sets it on
    every wake-up (:class:`wheeld.daemon.alarm.Alarm`, whose ctypes call is the reference).
    Returns 0 or the errno; -1 on the Python path, which has no such call."""
    if not _COMPILED:
        return -1
    return _c_timerfd_arm(fd, at_ns)  # noqa: F821 - executor.pxd
_IW, _I_PREV, _I_NEXT = L.I_PER_RECORD, L.I_PREV, L.I_NEXT  # an arena record's int32 words (prefetches)
_I_AUX = L.I_AUX  # ...and its touch reference (an arm's, set after the arm)
_H_CURRENT = L.H_CURRENT_MS // 8  # the wheel's clock, a header word (TimerWheel.current_ms)
_MAX_DELAY = MAX_DELAY_MS
_INVALID_DEADLINE, _ARENA_FULL = M.Rejected.INVALID_DEADLINE, M.Rejected.ARENA_FULL
_new_tuple = tuple.__new__  # a Rejection made as its NamedTuple makes it, without the Python-level __new__
# Compiled, a chunk of at least this many commands is prefetched ahead (_prefetch); a smaller
# one does not pay for the keys' hashes (its first commands are not prefetched anyway).
PREFETCH_MIN = 16
# per key meta byte, for the compiled record check: commands' tables (C arrays, executor.pxd)
assert C._VALID_KEY_META.shape == C._KEY_LENGTH.shape == C._KEY_TYPE.shape == (256,)
_META_VALID = C._VALID_KEY_META.view(np.uint8).tolist()
_META_LENGTH = C._KEY_LENGTH.astype(np.uint8).tolist()
_META_STR = (C._KEY_TYPE == TYPE_STR).view(np.uint8).tolist()
_NO_TOUCH_LIMIT = 1 << 62


class Executor:
    """Applies the commands of every client's ring to the wheel and answers them.

    ``clients`` is the daemon's client table (slot -> ClientSlot), read for the
    in-flight tables an ACK is checked against; ``poison`` disconnects a client
    whose ring holds garbage; ``totals`` are the daemon's counters."""

    def __init__(self, wheel: TimerWheel, clients: dict, arena_epoch: int, group_quota: int, totals: dict,
                 poison: Callable, clock: Callable[[], int], recorder=None,
                 clock_ns: Callable[[], int] = perf_counter_ns):
        self.wheel = wheel
        self.clock_ns = clock_ns  # times a ring's chunks for the fairness budget (the host's clock)
        self.clients = clients
        self.arena_epoch = arena_epoch
        self.group_quota = group_quota
        self.totals = totals
        self.poison = poison
        self.clock = clock
        self.recorder = recorder
        self.replication = None  # --replicate: answers may wait for the stream (wheeld.daemon.replication)
        self.ring_depth = 0  # commands seen in the rings during the current drain

    # ------------------------------------------------------------------ draining
    def drain(self, max_per_ring: int = DRAIN_BATCH, stop_at_ms: int | None = None) -> int:
        """Apply up to ``max_per_ring`` commands of every ring, committing each chunk of
        ``APPLY_CHUNK`` as soon as it is applied (a producer waiting for room gets it sooner),
        and no more of a ring than fits ``RING_BUDGET_NS`` (fairness: one client's
        expensive commands do not make everyone else's timers late). A ring whose
        client has too many answers unread waits (``Session.held_back``: back pressure).

        With ``stop_at_ms`` (the next timer's deadline) the drain stops between chunks
        once that moment has come, so a flood of commands delays an expiration by at
        most about one chunk instead of the whole drain (two full rings). Smaller chunks
        would bound it tighter but cost more daemon CPU per command under load (more
        fixed costs per chunk): docs/figures.md."""
        total = 0
        clock = self.clock
        for cs in list(self.clients.values()):
            if stop_at_ms is not None and clock() >= stop_at_ms:
                break
            if cs.poisoned or cs.segment is None or _held_back(cs):
                continue
            try:
                depth = cs.segment.depth()
                if not depth:
                    continue  # nothing to apply: no chunk is read
                if depth == cs.segment.ring_capacity:
                    self.totals["ring_full_total"] += 1  # the client found (or will find) it full
            except ProtocolError:
                pass  # apply_ring reports it
            clock_ns = self.clock_ns
            done = spent = 0
            while done < max_per_ring and not cs.poisoned:
                cost = cs.apply_ns
                want = min(max(MIN_CHUNK, RING_BUDGET_NS // cost) if cost else FIRST_CHUNK, APPLY_CHUNK,
                           max_per_ring - done)
                started = clock_ns()
                applied = self.apply_ring(cs, want)
                took = clock_ns() - started
                spent += took
                if applied:
                    cs.apply_ns = max(took // applied, cost - cost // 8, 1)
                done += applied
                if applied < want or spent >= RING_BUDGET_NS or (stop_at_ms is not None and clock() >= stop_at_ms):
                    break
            total += done
        self.totals["ring_depth"] = self.ring_depth
        self.ring_depth = 0
        return total

    def rings_pending(self) -> bool:
        for cs in self.clients.values():
            if not cs.poisoned and cs.segment is not None and not _held_back(cs):
                try:
                    if cs.segment.depth():
                        return True
                except ProtocolError:
                    return True  # let the drain report it
        return False

    def apply_ring(self, cs, max_records: int = DRAIN_BATCH) -> int:
        """Apply up to one chunk of this client's commands, commit and answer them; return how many."""
        segment = cs.segment
        guard = cs.replay_guard
        try:
            # a ring handed back after a restart: its first chunk, as large as the killed
            # daemon's may have been (see replayed_commands)
            raw = segment.peek_bytes(max_records if guard is None else max(max_records, DRAIN_BATCH))
        except ProtocolError as exc:
            self.poison(cs, str(exc))
            return 0
        n = len(raw) // _RECORD_SIZE
        if guard is not None:
            cs.replay_left -= n
            if cs.replay_left <= 0:
                cs.replay_guard = None
        if not n:
            return 0
        self.ring_depth += n
        good = valid_prefix(raw, segment.touch_capacity)
        chunk = raw if good == n else raw[: good * _RECORD_SIZE]
        kept = None  # the indices (in raw) of the records applied, when the replay guard skipped some
        if guard is not None and good:
            records = C.records_from_buffer(chunk)
            skip = replayed_commands(records, cs.group, guard)
            if skip is not None:
                log.info("client slot %d: %d commands of its ring were applied by the daemon before this one "
                         "(killed before it published the ring's head); not applied again", cs.slot,
                         int(np.count_nonzero(skip)))
                kept = np.flatnonzero(~skip)
                chunk = records[kept].tobytes()
        flushes, rejects = self._apply(cs, chunk, None) if chunk else ([], [])
        cuts = None
        if rejects:  # answered in ring order (a plan reports them by kind)
            if flushes:
                cuts = answer_order(C.records_from_buffer(chunk), rejects)
            else:
                rejects.sort(key=_position)
        unsynced = None
        if self.recorder is not None:
            self.recorder.commit(self.clock())  # on disk before the head moves and before Applied (fsync=always)
            unsynced = self.recorder.unavailable  # not on disk (the journal cannot be written): no flush succeeds
            if unsynced and flushes:
                self.totals["journal_flushes_refused_total"] += len(flushes)
        flush_code = None  # how the chunk's FLUSHes are answered, when not as durable
        if flushes and (unsynced or self._held_for_stream()):
            flush_code = M.Rejected.JOURNAL_UNAVAILABLE if unsynced else M.Rejected.REPLICATION_BEHIND
        if rejects or flush_code is not None:
            _mark_answers(segment, chunk, kept, rejects, flush_code)
        segment.commit(good)  # only now may the client reuse the slots: a crash above re-applies the chunk
        self.totals["commands_total"] += good
        self.totals["rejected_total"] += len(rejects)
        if self.replication is None:
            _answer(cs, flushes, rejects, cuts, unsynced)
        else:
            self.replication.answer(cs, self.recorder.journal.last_lsn, flushes, rejects, cuts, unsynced)
        if good < n:
            self.poison(cs, f"invalid command record (op {raw[good * _RECORD_SIZE]}) at ring position {good}")
        return good

    def _held_for_stream(self) -> bool:
        """Are this chunk's FLUSHes answered only once the replication stream holds them?"""
        replication = self.replication
        return (replication is not None and replication.replicated
                and self.recorder.journal.last_lsn > replication.replicator.replicated_lsn)

    def apply(self, cs, records: np.ndarray) -> tuple[list, list]:
        """Apply valid records (planned, or in order when few or near the group's quota);
        return (the seqs of its FLUSHes, its rejections)."""
        return self._apply(cs, _record_bytes(records), records)

    def _apply(self, cs, raw: bytes, records: np.ndarray | None) -> tuple[list, list]:
        """:meth:`apply` of the records' bytes (``records``: the same as an array, or None)."""
        if self.recorder is not None:
            self.recorder.begin(cs.slot)  # a crash before the commit: these acks are applied, not journaled
        quota = self.group_quota
        count = len(raw) // _RECORD_SIZE
        if BATCH_MIN is not None and count >= BATCH_MIN and not (
                quota and self.wheel.group_live(cs.group) + count > quota):
            if records is None:
                records = C.records_from_buffer(raw)
            return self.apply_plan(cs, self.plan(cs, records), records)
        return _in_order(self, cs, raw)

    # ------------------------------------------------------------------ a plan
    def plan(self, cs, records: np.ndarray) -> Plan:
        recorder = self.recorder
        lookup = None if recorder is None else (lambda idents: recorder.previous_deadlines(cs.group, idents))
        return plan_batch(records, self.wheel.current_ms, MAX_DELAY_MS, cs.slot << CL.TOUCH_INDEX_BITS, lookup)

    def apply_plan(self, cs, plan: Plan, records: np.ndarray) -> tuple[list, list]:
        """Cancels, then acks, then arms (each with its last arm's touch reference, as in
        ring order); the arms the arena had no room for are rejected."""
        wheel, gid = self.wheel, cs.group
        rejects = list(plan.rejections)
        if plan.cancels is not None:
            wheel.cancel_many(plan.cancels, gid)
        if plan.acks[0]:
            self.release_acks(cs, *plan.acks)
        refused: set = set()
        if plan.arms is not None:
            slots = self._schedule(plan, gid, records, rejects)
            armed = slots > 0
            wheel.records["aux"][slots[armed]] = plan.arms.aux[armed]  # re-arms keep theirs otherwise
            refused, full = plan.arena_full(slots < 0, records)
            rejects.extend(full)
        if self.recorder is not None:
            command_log = plan.log(refused)
            if command_log is not None:
                self.recorder.commands(gid, command_log)
        return plan.flushes, rejects

    def _schedule(self, plan: Plan, gid: int, records: np.ndarray, rejects: list) -> np.ndarray:
        """``schedule_many`` of the plan's arms: their slots, -1 where the arena was full."""
        arms = plan.arms
        try:
            return self.wheel.schedule_many(arms.idents, arms.deadlines, gid, arms.seqs, arms.aux)[0]
        except InvalidRequest:  # not expected (deadlines were checked): the collapsed arms one by one
            pass
        keyed = plan.keyed
        slots = np.full(arms.at.size, -1, dtype=np.int64)
        for n, j in enumerate(arms.at.tolist()):
            try:
                slots[n] = self.wheel.schedule_ident(keyed.ident_list[j], int(arms.deadlines[n]), gid,
                                                     int(arms.seqs[n]), int(arms.aux[n]))[0]
            except ArenaFull:
                pass
            except InvalidRequest as exc:
                slots[n] = 0  # reported here, not as arena full
                i = int(keyed.at[j])
                rejects.append(rejection(int(arms.seqs[n]), records["key"][i].tobytes(), int(records["key_meta"][i]),
                                         str(exc), M.Rejected.INVALID_DEADLINE, i))
        return slots

    # ------------------------------------------------------------------ in ring order
    def apply_in_order(self, cs, records: np.ndarray) -> tuple[list, list]:
        """Apply records one at a time in ring order; return (FLUSH seqs, rejections)."""
        return _in_order(self, cs, _record_bytes(records))

    def _over_quota(self, cs, ident: bytes) -> bool:
        """An arm that needs a new record in a group at its ``--group-quota``."""
        wheel = self.wheel
        return wheel.group_live(cs.group) >= self.group_quota and wheel.lookup_ident(ident, cs.group) is None

    def _quota_rejection(self, cs, seq: int, raw_key: bytes, meta: int, at: int) -> Rejection:
        return rejection(seq, raw_key, meta, f"group {cs.group_name!r} holds its quota of {self.group_quota} timers",
                         M.Rejected.QUOTA_EXCEEDED, at)

    def _in_order_log(self, gid: int, idents: list) -> CommandLog:
        """An empty log of the keyed commands to come (``idents``: theirs, in ring order), with
        the deadlines their keys have now."""
        distinct = list(dict.fromkeys(idents))
        previous = dict(zip(distinct, self.recorder.previous_deadlines(gid, distinct)))
        return CommandLog([], [], [], [], [], previous)

    # ------------------------------------------------------------------ acks
    def ack_allowed(self, cs, slot: int, generation: int, stamp: int = 0) -> bool:
        """May this client acknowledge fired record (slot, generation)? Forget it as in flight.

        ``stamp`` (the ACK record's ``seq``) is the ``arena_epoch`` of the Welcome under
        which the client received the expiration. An ack stamped with another epoch
        names a record of an arena that is gone (a reboot recovered from the journal
        into a fresh one, whose slots and generations start over): it would release an
        unrelated timer, so it is ignored; what it meant to ack is re-delivered and the
        client recognises it by (key, arming tag). Unstamped acks (0) are accepted.

        Usually it is one this daemon sent to this client. After a daemon restart the
        acks a client pushed earlier (even one that died since) are in its ring but in
        nobody's in-flight table: they count when the record is still fired with that
        generation and belongs to the client's group. A client cannot acknowledge
        another group's timers.
        """
        if stamp and stamp != self.arena_epoch:
            log.debug("client slot %d: ignored an ack for (%d, %d) of a previous arena", cs.slot, slot, generation)
            return False
        for in_flight in (cs.unacked, cs.unacked_old):
            if in_flight.get(slot) == generation:
                del in_flight[slot]
                return True
        fired = _fired_or_none(self.wheel, slot)
        if fired is None or fired[5] != generation or fired[2] != cs.group:
            return False  # not a fired record (a stale ack), another arming, another group's
        for other in self.clients.values():  # in flight to another member: it is done now
            if other.group == cs.group:
                for in_flight in (other.unacked, other.unacked_old):
                    if in_flight.get(slot) == generation:
                        del in_flight[slot]
        return True

    def release_one(self, cs, slot: int, generation: int, stamp: int) -> None:
        if not self.ack_allowed(cs, slot, generation, stamp):
            return
        if self.recorder is None:
            self.wheel.release(slot, generation)
            return
        fired = _fired_or_none(self.wheel, slot)  # journal what the released record was
        if self.wheel.release(slot, generation) and fired is not None:
            self.recorder.acked(fired[2], fired[0], fired[3])

    def release_acks(self, cs, slots: list, generations: list, stamps: list) -> None:
        """ACK records of a chunk: :meth:`ack_allowed` each, then one ``release_many``."""
        epoch = self.arena_epoch
        unacked = cs.unacked
        allowed = self.ack_allowed
        ok_slots, ok_gens = [], []
        for slot, gen, stamp in zip(slots, generations, stamps):
            if (stamp == epoch or not stamp) and unacked.get(slot) == gen:  # the usual case, inline
                del unacked[slot]
            elif not allowed(cs, slot, gen, stamp):
                continue
            ok_slots.append(slot)
            ok_gens.append(gen)
        if not ok_slots:
            return
        recorder = self.recorder
        fired = [_fired_or_none(self.wheel, s) for s in ok_slots] if recorder is not None else None
        released = self.wheel.release_many(ok_slots, ok_gens)
        if fired is not None:  # journal what each released record was (read before the release)
            for info, ok in zip(fired, released.tolist()):
                if ok and info is not None:
                    recorder.acked(info[2], info[0], info[3])


def valid_records(records: np.ndarray, touch_capacity: int | None = None) -> np.ndarray:
    """:func:`wheeld.protocol.commands.validate_records` of a drained chunk (which of its records
    are well-formed commands). Compiled, one C pass over the records (``_check_records``,
    executor.pxd) applying the same rules; tests hold the two to the same answers."""
    if not _COMPILED:
        return C.validate_records(records, touch_capacity)
    if not isinstance(records, np.ndarray) or records.dtype != C.RECORD_DTYPE or records.ndim != 1:
        raise ProtocolError("expected a 1-D array of ring command records")
    n = len(records)
    valid = np.zeros(n, dtype=np.uint8)
    if n:
        raw = np.ascontiguousarray(records).view(np.uint8).reshape(n, C.RECORD_SIZE)
        _check_records(raw, valid, _touch_limit(touch_capacity))  # noqa: F821 - executor.pxd
    return valid.view(np.bool_)


def valid_prefix(raw: bytes, touch_capacity: int | None = None) -> int:
    """How many records of a drained chunk (``raw``: their bytes, 64 each) are well-formed
    commands before the first that is not (:func:`wheeld.protocol.commands.validate_records`).
    Compiled, a C pass that stops there (``_valid_prefix``, executor.pxd: the rules of
    ``_check_records``); tests hold the two to the same answers."""
    if _COMPILED:
        return _valid_prefix(raw, _touch_limit(touch_capacity))  # noqa: F821 - executor.pxd
    valid = C.validate_records(C.records_from_buffer(raw), touch_capacity)
    return len(valid) if valid.all() else int(np.argmin(valid))


def _touch_limit(touch_capacity: int | None) -> int:
    return _NO_TOUCH_LIMIT if touch_capacity is None else touch_capacity


def _record_bytes(records: np.ndarray) -> bytes:
    """A record array's bytes, 64 per record (what :meth:`ClientSegment.peek_bytes` returns)."""
    if not isinstance(records, np.ndarray) or records.dtype != C.RECORD_DTYPE or records.ndim != 1:
        raise ProtocolError("expected a 1-D array of ring command records")
    return records.tobytes()


def _rows(raw: bytes) -> tuple[list, list]:
    """The Python path's records: each one's fields (op, key_meta, reserved, seq, deadline_ms, aux0,
    aux1, check, pad, key), and the 33-byte ident (meta byte + key) of each keyed command."""
    rows = list(_RECORD.iter_unpack(raw))
    return rows, [_META[row[1]] + row[9] for row in rows if row[0] == _ADD or row[0] == _ADD_IDLE or row[0] == _CANCEL]


def _release(executor: Executor, cs, unacked: dict | None, epoch: int, slot: int, generation: int, stamp: int) -> None:
    """An ACK of the in-order loop: :meth:`Executor.release_one`; without a journal (``unacked``:
    the client's in-flight table) its usual case inline, an ACK of what this daemon sent this client."""
    if unacked is not None and (stamp == epoch or not stamp) and unacked.get(slot) == generation:
        del unacked[slot]
        wheel = executor.wheel
        wheel.release(slot, generation)
    else:
        executor.release_one(cs, slot, generation, stamp)


def _prefetch_hashes(wheel: TimerWheel, raw: bytes, gid: int) -> np.ndarray | None:
    """Compiled: each record's key hash (``_hash_keys``), for ``_prefetch``; None for a chunk of
    fewer than PREFETCH_MIN records."""
    n = len(raw) // _RECORD_SIZE
    if n < PREFETCH_MIN:
        return None
    hashes = np.empty(n, dtype=np.int64)
    _hash_keys(wheel._index, _data(raw), n, hashes, gid)  # noqa: F821 - executor.pxd
    return hashes


def _in_order(executor: Executor, cs, raw: bytes) -> tuple[list, list]:
    """:meth:`Executor.apply_in_order` of validated records (``raw``: their bytes, 64 each). Compiled
    (executor.pxd), the fields and the keyed commands' idents are read from the bytes in C and the wheel's
    methods called as C functions; on the Python path ``struct`` reads them. The same branches run."""
    wheel, gid, quota, recorder = executor.wheel, cs.group, executor.group_quota, executor.recorder
    touch_base = cs.slot << CL.TOUCH_INDEX_BITS
    n = len(raw) // _RECORD_SIZE
    if _COMPILED:
        p = _data(raw)  # noqa: F821 - executor.pxd
        idents, hashes = _keyed_idents(p, n), _prefetch_hashes(wheel, raw, gid)  # noqa: F821
    else:
        rows, idents = _rows(raw)
    # the journal's log of the keyed commands (a chunk of ACKs and FLUSHes has none)
    command_log = executor._in_order_log(gid, idents) if recorder is not None and idents else None
    unacked = cs.unacked if recorder is None else None  # for _release
    epoch = executor.arena_epoch
    flushes, rejects, k = [], [], 0  # k: keyed commands so far (idents[k] is the next one's)
    for i in range(n):
        if _COMPILED:
            if hashes is not None:  # the index cells and records of the commands a few places ahead
                _prefetch(wheel, hashes, i, n)  # noqa: F821
            op, meta, seq, deadline, aux0, aux1 = _fields(p, i)  # noqa: F821
        else:
            op, meta, _reserved, seq, deadline, aux0, aux1, _check, _pad, _key = rows[i]
        if op == _FLUSH:
            flushes.append(seq)
            continue
        try:
            if op == _ACK:
                _release(executor, cs, unacked, epoch, aux0, aux1, seq)
                continue
            # a keyed command: ADD, ADD_IDLE or CANCEL (validated records hold no other op)
            ident = idents[k]
            k += 1
            cur = wheel._clock[_H_CURRENT]
            if op == _CANCEL:
                wheel.cancel_ident(ident, gid)
            elif quota and executor._over_quota(cs, ident):
                rejects.append(executor._quota_rejection(cs, seq, _key_at(raw, i), meta, i))
                continue
            elif deadline > cur + _MAX_DELAY or deadline < cur - _MAX_DELAY:  # schedule_ident's InvalidDelay
                reason = deadline_reason(deadline, cur, _MAX_DELAY)
                rejects.append(_new_tuple(Rejection, (seq, _key_at(raw, i), meta, reason, _INVALID_DEADLINE, i)))
                continue
            elif op == _ADD:  # a plain timer, also when it re-arms an idle one: no touch reference
                slot = wheel.schedule_ident(ident, deadline, gid, seq)[0]
                wheel._i[slot * _IW + _I_AUX] = -1
            else:  # an idle timer reads this arm's touch index, also when it re-arms a timer
                touch = touch_base | aux1
                slot = wheel.schedule_ident(ident, deadline, gid, seq, touch)[0]
                wheel._i[slot * _IW + _I_AUX] = touch
        except (ArenaFull, InvalidRequest) as exc:
            code = _ARENA_FULL if isinstance(exc, ArenaFull) else _INVALID_DEADLINE
            rejects.append(_new_tuple(Rejection, (seq, _key_at(raw, i), meta, str(exc), code, i)))
            continue
        if command_log is not None:
            _log_command(command_log, ident, op, deadline, seq, aux0)
    if command_log is not None and command_log.idents:
        recorder.commands(gid, command_log)
    return flushes, rejects


def replayed_commands(chunk: np.ndarray, group: int, armings) -> np.ndarray | None:
    """Which keyed commands of the first chunk of a ring handed back after a restart the
    killed daemon had applied already (None: none). ``armings`` is the client table's
    :class:`ArmingsAtStart <wheeld.daemon.client_table.ArmingsAtStart>`.

    Decided per key, by its last command in the chunk: an ADD or ADD_IDLE whose
    arming (key, group, tag) the arena held at start was applied, and so was every
    earlier command of that key in the chunk (the ring is applied in order): all are
    skipped. Any other key's commands are applied (again): a re-arm the killed daemon
    did not reach puts the key where its last command says, an arming it did apply
    earlier in the chunk is re-armed in place or, fired meanwhile, armed anew and then
    moved by that last command before anything fires; a last CANCEL leaves the key
    cancelled either way."""
    ops = chunk["op"]
    keyed = np.flatnonzero((ops == C.ADD) | (ops == C.ADD_IDLE) | (ops == C.CANCEL))
    if not keyed.size:
        return None
    metas = chunk["key_meta"][keyed].astype(np.uint8)
    idents = np.empty((keyed.size, 33), dtype=np.uint8)
    idents[:, 0] = metas
    idents[:, 1:] = chunk["key"][keyed]
    names = idents.view("V33").reshape(-1).tolist()
    last: dict = {}
    for j, name in enumerate(names):
        last[name] = j
    arms = [j for j in last.values() if ops[keyed[j]] != C.CANCEL]
    if not arms:
        return None
    at = np.array(arms, dtype=np.int64)
    held = armings.holds(chunk["seq"][keyed[at]], group, idents[at])
    if not held.any():
        return None
    done = {names[j] for j in at[held].tolist()}
    skip = np.zeros(len(chunk), dtype=bool)
    skip[keyed[[j for j, name in enumerate(names) if name in done]]] = True
    return skip


def _key_at(raw: bytes, i: int) -> bytes:
    """Record i's 32-byte key field (for a rejection)."""
    return raw[i * _RECORD_SIZE + _O_KEY : (i + 1) * _RECORD_SIZE]


def _log_command(command_log: CommandLog, ident: bytes, op: int, deadline: int, seq: int, idle_ms: int) -> None:
    command_log.idents.append(ident)
    command_log.arms.append(op != C.CANCEL)
    command_log.deadlines.append(deadline)
    command_log.seqs.append(seq)
    command_log.idle_ms.append(idle_ms if op == C.ADD_IDLE else None)


def flush_answer(seq: int, unsynced, code=None) -> bytes:
    """The frames that answer FLUSH ``seq``: ``Applied``, preceded by a ``Rejected`` with code
    ``journal_unavailable`` when the commands before it are not on disk (``unsynced``: why),
    or ``code`` (``replication_behind``: ``unsynced`` is the whole reason)."""
    applied = M.encode_daemon_frame(M.Applied(seq))
    if not unsynced:
        return applied
    if code is not None:
        return M.encode_daemon_frame(M.Rejected(seq, b"", 0, unsynced[:4096], code)) + applied
    reason = (f"not durable: {unsynced}; the commands were applied (timers fire) but are not on disk; "
              "a flush() once the journal is writable again covers them")
    return M.encode_daemon_frame(M.Rejected(seq, b"", 0, reason[:4096], M.Rejected.JOURNAL_UNAVAILABLE)) + applied


def answer_order(records: np.ndarray, rejects: list) -> list[int]:
    """Put a chunk's rejections in ring order (in place, by the position of their command)
    and return, for each FLUSH of the chunk (``records``, the commands applied), how many of
    them come before it: those are answered before its ``Applied``, the rest after it."""
    rejects.sort(key=_position)
    flush_at = np.flatnonzero(records["op"] == C.FLUSH)
    positions = np.fromiter((r.at for r in rejects), dtype=np.int64, count=len(rejects))
    return np.searchsorted(positions, flush_at).tolist()


def _position(reject: Rejection) -> int:
    return reject.at


def answer_chunk(cs, flushes: list, rejects: list, cuts, unsynced=None, code=None) -> None:
    """The chunk's answers (:func:`_answer`), for the replication's held answers."""
    _answer(cs, flushes, rejects, cuts, unsynced, code)


def _mark_answers(segment, chunk: bytes, kept, rejects: list, flush_code: str | None) -> None:
    """Store the chunk's decisions that exist only in their answers in the ring's records
    (:meth:`ClientSegment.mark_answer <wheeld.shm.ring.ClientSegment.mark_answer>`), before
    its head moves: each refused command's code, and ``flush_code`` on each FLUSH when the
    chunk's FLUSHes are not answered as durable (the journal could not be written, or their
    answers wait for the replication stream). An answer lost after the head moved (the
    daemon killed, the session closed, a socket never read) is then read back from the ring
    by the client. ``kept``: the records of the peek that ``chunk`` holds (None: all)."""
    for reject in rejects:
        at = reject.at if kept is None else int(kept[reject.at])
        segment.mark_answer(at, C.ANSWER_MARK[reject.code])
    if flush_code is not None:
        mark = C.ANSWER_MARK[flush_code]
        for at in np.flatnonzero(C.records_from_buffer(chunk)["op"] == C.FLUSH).tolist():
            segment.mark_answer(at if kept is None else int(kept[at]), mark)


def _answer(cs, flushes: list, rejects: list, cuts: list | None, unsynced=None, code=None) -> None:
    """Send a chunk's answers, each rejection before the ``Applied`` of the first FLUSH after
    its command (``cuts``: :func:`answer_order`; bounded: :meth:`Session.answer
    <wheeld.daemon.connection.Session.answer>`). A client with no open session is not
    answered: the ring holds the decisions its answers carry (:func:`_mark_answers`), and
    the client reads them back when its next session opens."""
    session = cs.session
    if session is not None and not session.closed and (flushes or rejects):
        session.answer(rejects, [flush_answer(seq, unsynced, code) for seq in flushes], cuts)


def _held_back(cs) -> bool:
    """Is this client's ring left undrained for now? (its answers wait unread: back pressure)"""
    session = cs.session
    return session is not None and session.held_back


def _fired_or_none(wheel: TimerWheel, slot: int):
    try:
        return wheel.fired(slot)
    except ValueError:  # InvalidRequest: not a fired record; UnicodeDecodeError: its key was overwritten
        return None
