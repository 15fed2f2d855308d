"""The executor: client commands drained from the rings, applied to the wheel.

Each ring is drained a chunk at a time (:meth:`Executor.drain`). A chunk of at
least ``BATCH_MIN`` valid records (Python path only, see below) is planned (:func:`wheeld.daemon.planner.plan_batch`)
and the plan applied: one ``cancel_many``, one ``release_many`` for its ACKs, one
``schedule_many``. A smaller chunk, or one of a group near its ``--group-quota``,
is applied record by record in ring order (:meth:`Executor.apply_in_order`), the
behaviour a plan must reproduce. With ``--journal`` both report to the Recorder
the same way: the keyed commands applied as a :class:`~wheeld.daemon.planner.CommandLog`,
each released ACK as it is released.

Then the chunk is committed: journal appended (fsynced under ``--fsync always``),
ring head published (a daemon killed before it re-applies the chunk: every
command is idempotent), FLUSHes answered with ``Applied`` and refusals with
``Rejected``, in ring order: a refusal goes before the ``Applied`` of the first
FLUSH after its command (:func:`answer_order`).
"""

from __future__ import annotations

import logging
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
from wheeld.shm.wheel import MAX_DELAY_MS, TimerWheel

from .connection import KeptAnswers
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
_O_META, _O_RESERVED, _O_DEADLINE = C.KEY_META_OFFSET, C.RESERVED_OFFSET, C.DEADLINE_OFFSET
_O_AUX0, _O_AUX1, _O_CHECK, _O_PAD, _O_KEY = C.AUX0_OFFSET, C.AUX1_OFFSET, C.CHECK_OFFSET, C.PAD_OFFSET, C.KEY_OFFSET
_KEY_FIELD = C.KEY_FIELD_SIZE
assert C.OP_OFFSET == 0 and _KEY_FIELD == 32  # op read as the first byte; a 33-byte ident buffer
assert [C.RECORD_DTYPE.fields[name][0].itemsize for name in ("reserved", "deadline_ms", "aux0", "aux1", "check",
                                                             "pad")] == [2, 8, 4, 4, 4, 4]
assert C.CHECKED_HEAD_SIZE == _O_CHECK  # the crc covers the head before the check word, then the key
# Compiled (executor.pxd), the in-order loop reads the records through C arrays.
_COMPILED = not __file__.endswith(".py")
_IW, _I_PREV, _I_NEXT = L.I_PER_RECORD, L.I_PREV, L.I_NEXT  # an arena record's int32 words (prefetches)
_I_AUX = L.I_AUX  # ...and its touch reference (an arm's, set after the arm)
# per key meta byte, for the compiled record check: commands' tables as bytes
_META_VALID = C._VALID_KEY_META.view(np.uint8)
_META_LENGTH = C._KEY_LENGTH.astype(np.uint8)
_META_STR = (C._KEY_TYPE == TYPE_STR).view(np.uint8)
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
            records = segment.peek(max_records if guard is None else max(max_records, DRAIN_BATCH))
        except ProtocolError as exc:
            self.poison(cs, str(exc))
            return 0
        n = len(records)
        if guard is not None:
            cs.replay_left -= n
            if cs.replay_left <= 0:
                cs.replay_guard = None
        if not n:
            return 0
        self.ring_depth += n
        valid = valid_records(records, segment.touch_capacity)
        good = n if valid.all() else int(np.argmin(valid))
        chunk = records[:good]
        if guard is not None and good:
            skip = replayed_commands(chunk, cs.group, guard)
            if skip is not None:
                log.info("client slot %d: %d commands of its ring were applied by the daemon before this one "
                         "(killed before it published the ring's head); not applied again", cs.slot,
                         int(np.count_nonzero(skip)))
                chunk = chunk[~skip]
        flushes, rejects = self.apply(cs, chunk) if len(chunk) else ([], [])
        cuts = answer_order(chunk, rejects) if rejects and flushes else None
        unsynced = None
        if self.recorder is not None:
            self.recorder.commit(self.clock())  # on disk before the head moves and before Applied (fsync=always)
            unsynced = self.recorder.unavailable  # not on disk (the journal cannot be written): no flush succeeds
            if unsynced and flushes:
                self.totals["journal_flushes_refused_total"] += len(flushes)
        segment.commit(good)  # only now may the client reuse the slots: a crash above re-applies the chunk
        self.totals["commands_total"] += good
        self.totals["rejected_total"] += len(rejects)
        _answer(cs, flushes, rejects, cuts, unsynced)
        if good < n:
            self.poison(cs, f"invalid command record (op {int(records['op'][good])}) at ring position {good}")
        return good

    def apply(self, cs, records: np.ndarray) -> tuple[list, list]:
        """Apply valid records (planned, or in order when few or near the group's quota);
        return (the seqs of its FLUSHes, its rejections)."""
        if self.recorder is not None:
            self.recorder.begin()
        quota = self.group_quota
        if BATCH_MIN is not None and len(records) >= BATCH_MIN and not (
                quota and self.wheel.group_live(cs.group) + len(records) > quota):
            return self.apply_plan(cs, self.plan(cs, records), records)
        return self.apply_in_order(cs, records)

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
        return _in_order(self, cs, records)

    def _over_quota(self, cs, ident: bytes) -> bool:
        """An arm that needs a new record in a group at its ``--group-quota``."""
        wheel = self.wheel
        return wheel.group_live(cs.group) >= self.group_quota and wheel.lookup_ident(ident, cs.group) is None

    def _quota_rejection(self, cs, seq: int, raw_key: bytes, meta: int, at: int) -> Rejection:
        return rejection(seq, raw_key, meta, f"group {cs.group_name!r} holds its quota of {self.group_quota} timers",
                         M.Rejected.QUOTA_EXCEEDED, at)

    def _in_order_log(self, gid: int, records: np.ndarray) -> CommandLog:
        """An empty log of the keyed commands to come, with the deadlines their keys have now."""
        ops, metas, keys = records["op"].tolist(), records["key_meta"].tolist(), _keys(records)
        distinct = list(dict.fromkeys(_META[meta] + key for op, meta, key in zip(ops, metas, keys)
                                      if op == C.ADD or op == C.ADD_IDLE or op == C.CANCEL))
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
        limit = _NO_TOUCH_LIMIT if touch_capacity is None else touch_capacity
        _check_records(raw, valid, _META_VALID, _META_LENGTH, _META_STR, limit)  # noqa: F821 - executor.pxd
    return valid.view(np.bool_)


def _keys(records: np.ndarray) -> list[bytes]:
    """Each record's 32-byte key field."""
    return np.ascontiguousarray(records["key"]).view("V32").ravel().tolist()


def _columns(index, records: np.ndarray, gid: int) -> tuple:
    """The fields :func:`_in_order` loops over: (raw bytes, key hashes, op, key_meta,
    deadline_ms, seq, aux0, aux1, keys). Compiled: arrays (the loop reads them through C
    typed views), the records' raw bytes (each ident is built from them) and each
    record's key-index hash, so the loop can prefetch the index cells and records the
    commands a few places ahead will probe (``_prefetch``: at a million timers they are
    cache misses). On the Python path: lists, and the 32-byte keys."""
    if _COMPILED:
        raw = np.ascontiguousarray(records).view(np.uint8).reshape(len(records), C.RECORD_SIZE)
        hashes = np.empty(len(records), dtype=np.int64)
        _hash_keys(index, raw, hashes, gid)  # noqa: F821 - executor.pxd
        return (raw, hashes, records["op"], records["key_meta"], records["deadline_ms"], records["seq"],
                records["aux0"], records["aux1"], None)
    return (None, None, records["op"].tolist(), records["key_meta"].tolist(), records["deadline_ms"].tolist(),
            records["seq"].tolist(), records["aux0"].tolist(), records["aux1"].tolist(), _keys(records))


def _in_order(executor: Executor, cs, records: np.ndarray) -> tuple[list, list]:
    """:meth:`Executor.apply_in_order`, a function so that executor.pxd can give its loop C types.

    Compiled, the fields are read through C arrays over the records and each key's
    33-byte ident (meta byte + key) is built from the record's bytes (``_ident_at``,
    executor.pxd), and the wheel's methods are called as C functions. On the Python
    path the fields are lists and the ident a concatenation. Either way the same
    branches run in the same order.
    """
    wheel, gid, quota, recorder = executor.wheel, cs.group, executor.group_quota, executor.recorder
    touch_base = cs.slot << CL.TOUCH_INDEX_BITS
    n = len(records)
    raw, hashes, ops, metas, deadlines, seqs, aux0, aux1, keys = _columns(wheel._index, records, gid)
    command_log = executor._in_order_log(gid, records) if recorder is not None else None
    # an ACK of what this daemon sent this client, without a journal: release_one's usual
    # case, inline (the others go through it)
    unacked = cs.unacked if recorder is None else None
    epoch = executor.arena_epoch
    flushes, rejects = [], []
    for i in range(n):
        if _COMPILED:
            _prefetch(wheel, hashes, i, n)  # noqa: F821 - executor.pxd
        op = ops[i]
        if op == _FLUSH:
            flushes.append(seqs[i])
            continue
        try:
            if op == _ACK:
                if unacked is not None and (seqs[i] == epoch or not seqs[i]) and unacked.get(aux0[i]) == aux1[i]:
                    del unacked[aux0[i]]
                    wheel.release(aux0[i], aux1[i])
                else:
                    executor.release_one(cs, aux0[i], aux1[i], seqs[i])
                continue
            # a keyed command: ADD, ADD_IDLE or CANCEL (validated records hold no other op)
            ident = _ident_at(raw, i) if _COMPILED else _META[metas[i]] + keys[i]  # noqa: F821 - executor.pxd
            if op == _CANCEL:
                wheel.cancel_ident(ident, gid)
            elif quota and executor._over_quota(cs, ident):
                rejects.append(executor._quota_rejection(cs, seqs[i], _key_at(records, i), metas[i], i))
                continue
            elif op == _ADD:  # a plain timer, also when it re-arms an idle one: no touch reference
                slot = wheel.schedule_ident(ident, deadlines[i], gid, seqs[i])[0]
                wheel._i[slot * _IW + _I_AUX] = -1
            else:  # an idle timer reads this arm's touch index, also when it re-arms a timer
                touch = touch_base | aux1[i]
                slot = wheel.schedule_ident(ident, deadlines[i], gid, seqs[i], touch)[0]
                wheel._i[slot * _IW + _I_AUX] = touch
        except (ArenaFull, InvalidRequest) as exc:
            reason = M.Rejected.ARENA_FULL if isinstance(exc, ArenaFull) else M.Rejected.INVALID_DEADLINE
            rejects.append(rejection(seqs[i], _key_at(records, i), metas[i], str(exc), reason, i))
            continue
        if command_log is not None:
            _log_command(command_log, ident, op, deadlines[i], seqs[i], aux0[i])
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


def _key_at(records: np.ndarray, i: int) -> bytes:
    """Record i's 32-byte key field (for a rejection)."""
    return records["key"][i].tobytes()


def _log_command(command_log: CommandLog, ident: bytes, op: int, deadline: int, seq: int, idle_ms: int) -> None:
    command_log.idents.append(ident)
    command_log.arms.append(op != C.CANCEL)
    command_log.deadlines.append(deadline)
    command_log.seqs.append(seq)
    command_log.idle_ms.append(idle_ms if op == C.ADD_IDLE else None)


def flush_answer(seq: int, unsynced) -> bytes:
    """The frames that answer FLUSH ``seq``: ``Applied``, preceded by a ``Rejected`` with code
    ``journal_unavailable`` when the commands before it are not on disk (``unsynced``: why)."""
    applied = M.encode_daemon_frame(M.Applied(seq))
    if not unsynced:
        return applied
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


def _answer(cs, flushes: list, rejects: list, cuts: list | None, unsynced=None) -> None:
    """Send a chunk's answers, each rejection before the ``Applied`` of the first FLUSH after
    its command (``cuts``: :func:`answer_order`; bounded: :meth:`Session.answer
    <wheeld.daemon.connection.Session.answer>`). Those of a chunk applied while the client's
    session was closed are kept for the session it opens next (its Hello)."""
    session = cs.session
    flush_answers = [flush_answer(seq, unsynced) for seq in flushes]
    if session is not None and not session.closed:
        session.answer(rejects, flush_answers, cuts)
    elif flushes or rejects:
        if cs.unanswered is None:
            cs.unanswered = KeptAnswers()
        cs.unanswered.add(rejects, flush_answers, cuts)


def _held_back(cs) -> bool:
    """Is this client's ring left undrained for now? (its answers wait unread: back pressure)"""
    session = cs.session
    return session is not None and session.held_back


def _fired_or_none(wheel: TimerWheel, slot: int):
    try:
        return wheel.fired(slot)
    except ValueError:  # InvalidRequest: not a fired record; UnicodeDecodeError: its key was overwritten
        return None
