"""The batch planner: a drained chunk of ring commands, as what to do to the wheel.

Commands on different keys commute, and on one key a later ADD/ADD_IDLE/CANCEL
overrides an earlier one, so a chunk is applied as its *last operation per key*:
one ``cancel_many`` and one ``schedule_many`` with the same end state as
applying it record by record (:func:`plan_batch` has the exact rules). This
module only decides; :mod:`wheeld.daemon.executor` applies a :class:`Plan` to
the wheel (and applies small chunks in ring order, which is the reference a plan
must agree with: tests/test_planner.py).

Live on the Python path only: with the compiled wheel the executor applies every
chunk in ring order, which measures cheaper there at every chunk size
(:data:`wheeld.daemon.executor.PLAN_BATCH_MIN` has the figures).

Pure: ring records in, a plan out. No wheel, no daemon, no clock (the wheel's
clock comes in as an argument), no I/O. The one question about the wheel, the
deadline each key has pending before the chunk, is asked through a lookup
function, and only for the journal, whose events say whether an arm added or
re-armed a key and whether a cancel hit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np

from wheeld.protocol import commands as C
from wheeld.protocol import messages as M
from wheeld.protocol.keys import key_length
from wheeld.shm.wheel import deadline_reason

#: idents (33-byte record forms: meta byte + zero-padded key) -> pending deadline of each, or None
Lookup = Callable[[list], list]


class Rejection(NamedTuple):
    """A command that was not applied: the fields of its ``Rejected`` answer (``raw_key``
    may carry its zero padding), and ``at``, the command's position in its chunk, which
    places the answer before the ``Applied`` of the first FLUSH after the command. The
    message itself is made only if it is sent one by one
    (:meth:`wheeld.daemon.connection.Session.answer`)."""

    seq: int
    raw_key: bytes
    key_meta: int
    reason: str
    code: str
    at: int

    def message(self) -> M.Rejected:
        return M.Rejected(self.seq, bytes(self.raw_key[: key_length(self.key_meta)]), self.key_meta, self.reason,
                          self.code)

    @property
    def key(self):
        """The refused command's key (None for a command without one)."""
        return self.message().key


def rejection(seq: int, raw_key: bytes, meta: int, reason: str, code: str, at: int) -> Rejection:
    """The answer to the command at position ``at`` of its chunk, which was not applied
    (``raw_key`` may carry its zero padding)."""
    return Rejection(seq, raw_key, meta, reason, code, at)



class CommandLog(NamedTuple):
    """The keyed commands a chunk applied, in ring order, as the journal records them
    (:meth:`wheeld.daemon.recorder.Recorder.commands`): one event each, derived from
    ``previous`` (ident -> pending deadline before the chunk, or None); arms of an
    ident in ``refused`` after its last cancel were not applied (no event)."""

    idents: list
    arms: list
    deadlines: list
    seqs: list
    idle_ms: list  # None for a plain timer
    previous: dict
    refused: frozenset | set = frozenset()


@dataclass(slots=True)
class Keyed:
    """The keyed commands (ADD, ADD_IDLE, CANCEL) of a chunk in ring order, arms with a
    deadline out of range left out. Index ``j`` below is the j-th of them."""

    at: np.ndarray  # position of each in the chunk
    ops: np.ndarray
    idents: np.ndarray  # record forms, dtype V33
    ident_list: list
    arm: np.ndarray  # bool: ADD or ADD_IDLE
    deadlines: np.ndarray
    seqs: np.ndarray
    last_cancel: dict  # ident -> j of its last CANCEL


@dataclass(slots=True)
class Arms:
    """One arm per key whose last keyed command arms it: the last arm's deadline and tag
    (its seq), and the touch index of the arm that creates the record (-1: a plain timer)."""

    at: np.ndarray  # j of the last arm of each key
    idents: np.ndarray
    deadlines: np.ndarray
    seqs: np.ndarray
    aux: np.ndarray


@dataclass(slots=True)
class Plan:
    """What a chunk does, in the order the executor applies it: cancels, acks, arms;
    flushes are answered once all of it is applied."""

    flushes: list  # seqs of its FLUSH records
    rejections: list  # Rejection of each arm whose deadline is out of range
    acks: tuple  # (slots, generations, stamps) of its ACK records, in ring order
    keyed: Keyed | None = None
    cancels: np.ndarray | None = None  # idents: every key with a CANCEL, cancelled first
    arms: Arms | None = None
    previous: dict | None = None  # ident -> pending deadline before the chunk (with a lookup)
    idle_ms: list | None = None  # per keyed command (journal): its idle time, None for plain ones

    def arena_full(self, refused: np.ndarray, records: np.ndarray) -> tuple[set, list]:
        """The idents of the arms the arena had no room for (``refused``: a mask over
        :attr:`arms`), and their ARENA_FULL rejections: one for every arm of such a key
        after its last cancel (in ring order each of them would have been refused)."""
        keyed = self.keyed
        idents = {keyed.ident_list[j] for j in self.arms.at[refused].tolist()}
        rejects = []
        if idents:
            for j in np.flatnonzero(keyed.arm).tolist():
                ident = keyed.ident_list[j]
                if ident in idents and j > keyed.last_cancel.get(ident, -1):
                    i = int(keyed.at[j])
                    rejects.append(rejection(int(records["seq"][i]), records["key"][i].tobytes(),
                                             int(records["key_meta"][i]), "the arena is full", M.Rejected.ARENA_FULL,
                                             i))
        return idents, rejects

    def log(self, refused: set) -> CommandLog | None:
        """The journal's view of the keyed commands (None without a lookup or keyed commands)."""
        keyed = self.keyed
        if keyed is None or self.previous is None:
            return None
        return CommandLog(keyed.ident_list, keyed.arm.tolist(), keyed.deadlines.tolist(), keyed.seqs.tolist(),
                          self.idle_ms, self.previous, refused)


def plan_batch(records: np.ndarray, clock_ms: int, max_delay_ms: int, touch_base: int,
               lookup: Lookup | None = None) -> Plan:
    """Plan a chunk of valid ring records (:func:`wheeld.protocol.commands.validate_records`).

    * a key with a CANCEL in the chunk is cancelled first; if an arm follows the
      last cancel, the key is then armed afresh (a new record, as in order);
    * the arm uses the last arm's deadline, tag (its ``seq``) and touch reference
      (aux: ``touch_base | touch index`` for an ADD_IDLE, -1 for an ADD): in order,
      each arm sets the record's touch reference, so an ADD makes an idle timer a
      plain one and an ADD_IDLE reads the touch index it names;
    * an arm with a deadline more than ``max_delay_ms`` from ``clock_ms`` is
      rejected (INVALID_DEADLINE, its own seq) and takes no part; an arm the
      arena has no room for is rejected (ARENA_FULL) by :meth:`Plan.arena_full`;
    * ACKs are released after the cancels and before the arms, so the records
      they free are available to this chunk; FLUSHes are answered after it all.

    Unlike in-order application, an arm that would have found the arena full
    before a later cancel or ack of the same chunk freed a record is accepted.
    ``lookup`` (idents -> pending deadlines), when given, is asked once for the
    chunk's distinct keys: the journal's events follow from the answers.
    """
    ops = records["op"]
    flush_at = np.flatnonzero(ops == C.FLUSH)
    ack_at = np.flatnonzero(ops == C.ACK)
    plan = Plan(records["seq"][flush_at].tolist() if flush_at.size else [], [],
                (records["aux0"][ack_at].tolist(), records["aux1"][ack_at].tolist(), records["seq"][ack_at].tolist()))
    keyed_at = np.flatnonzero((ops == C.ADD) | (ops == C.ADD_IDLE) | (ops == C.CANCEL))
    if keyed_at.size:
        _plan_keyed(plan, records, keyed_at, clock_ms, max_delay_ms, touch_base, lookup)
    return plan


def _in_range(plan: Plan, records: np.ndarray, keyed_at: np.ndarray, clock_ms: int,
              max_delay_ms: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(positions, ops, deadlines) of the keyed commands that take part: arms with a
    deadline out of range are rejected."""
    ops = records["op"][keyed_at]
    deadlines = records["deadline_ms"][keyed_at]
    bad = (ops != C.CANCEL) & ((deadlines > clock_ms + max_delay_ms) | (deadlines < clock_ms - max_delay_ms))
    if not bad.any():
        return keyed_at, ops, deadlines
    bad_at = keyed_at[bad]
    keys = np.ascontiguousarray(records["key"][bad_at]).view("V32").ravel().tolist()
    code = M.Rejected.INVALID_DEADLINE
    plan.rejections.extend(
        Rejection(seq, key, meta, deadline_reason(deadline, clock_ms, max_delay_ms), code, at)
        for seq, key, meta, deadline, at in zip(records["seq"][bad_at].tolist(), keys,
                                                records["key_meta"][bad_at].tolist(), deadlines[bad].tolist(),
                                                bad_at.tolist()))
    keep = ~bad
    return keyed_at[keep], ops[keep], deadlines[keep]


def _plan_keyed(plan: Plan, records: np.ndarray, keyed_at: np.ndarray, clock_ms: int, max_delay_ms: int,
                touch_base: int, lookup: Lookup | None) -> None:
    at, ops, deadlines = _in_range(plan, records, keyed_at, clock_ms, max_delay_ms)
    k = at.size
    idents = np.empty((k, 33), dtype=np.uint8)
    idents[:, 0] = records["key_meta"][at]
    idents[:, 1:] = records["key"][at]
    idents = idents.view("V33").ravel()
    ident_list = idents.tolist()
    arm = ops != C.CANCEL
    cancel_at = np.flatnonzero(~arm).tolist()
    last_cancel = dict(zip([ident_list[j] for j in cancel_at], cancel_at))
    keyed = plan.keyed = Keyed(at, ops, idents, ident_list, arm, deadlines, records["seq"][at], last_cancel)
    last = dict(zip(ident_list, range(k)))  # ident -> j of its last keyed command
    if last_cancel:
        plan.cancels = idents[np.fromiter(last_cancel.values(), dtype=np.int64, count=len(last_cancel))]
    if lookup is not None:  # before anything is applied
        distinct = list(last)
        plan.previous = dict(zip(distinct, lookup(distinct)))
        plan.idle_ms = [None if i < 0 else i for i in np.where(ops == C.ADD_IDLE, records["aux0"][at], -1).tolist()]
    last_at = np.fromiter(last.values(), dtype=np.int64, count=len(last))
    arm_at = last_at[arm[last_at]]
    if arm_at.size:
        plan.arms = Arms(arm_at, idents[arm_at], keyed.deadlines[arm_at], keyed.seqs[arm_at],
                         _touch_aux(keyed, records, arm_at, touch_base))


def _touch_aux(keyed: Keyed, records: np.ndarray, arm_at: np.ndarray, touch_base: int) -> np.ndarray:
    """The aux of each collapsed arm (its last arm): the touch reference of an ADD_IDLE, else -1."""
    idle = keyed.ops[arm_at] == C.ADD_IDLE
    return np.where(idle, touch_base | records["aux1"][keyed.at[arm_at]].astype(np.int64), -1)
