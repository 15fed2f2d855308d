"""A client's session with the daemon, apart from its commands: taking a Welcome (the ring,
the status page, the commands to push again), the daemon's other messages (Applied,
Rejected, Goodbye, Refused), the answers a ``flush()`` waits for, the re-arms of idle
timers pushed with acknowledgements (and again when the copy they replaced comes back),
and what a fork or a close leaves of the session.

:class:`ClientSession` is a room of :class:`wheeld.core.ClientCore` (a mixin: it works
on the core's fields); the I/O shells (``wheeld.sync``, ``wheeld.aio``) and the
simulator's client drive both through :mod:`wheeld.handshake`. The commands (``add``,
``touch``, ``cancel``...) and the expirations received are the core's.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, NoReturn

from wheeld.protocol import commands as C
from wheeld.protocol import messages as M
from wheeld.protocol.errors import (
    ArenaFull,
    BackPressure,
    BrokenPeer,
    Closed,
    ForkedClient,
    GroupLimit,
    InvalidRequest,
    JournalUnavailable,
    ReplicationBehind,
    NotAllowed,
    ProtocolError,
    QuotaExceeded,
    RingFull,
)
from wheeld.protocol.keys import key_length
from wheeld.shm.ring import ClientSegment
from wheeld.shm.status import StatusPage

__all__ = ["SEQ_BITS", "SHARDS", "ClientSession", "ClosedTouches", "ForkedTouches", "refusal_error"]

#: an arming's tag: the client id (from its Welcome) above SEQ_BITS bits of sequence number
SEQ_BITS = 21
#: the client keeps its per-key bookkeeping in SHARDS dicts, by hash(key) & (SHARDS - 1)
SHARDS = 64
_SEQ_BITS = SEQ_BITS
_SHARD_MASK = SHARDS - 1
_META = [bytes((m,)) for m in range(256)]
_SEQ_AT, _MARK_AT, _KEY_AT = C.SEQ_OFFSET, C.PAD_OFFSET, C.KEY_OFFSET  # in a ring record

class ForkedTouches(dict):
    """Stands in for the touch index in a forked child: every touch raises ForkedClient."""

    def __init__(self, owner_pid: int):
        super().__init__()
        self.owner_pid = owner_pid

    def __getitem__(self, key):
        raise ForkedClient(f"this wheeld client belongs to process {self.owner_pid}; connect again in the child")


class ClosedTouches(dict):
    """Stands in for the touch index once the client is closed (its touch table unmapped):
    every touch raises Closed."""

    def __getitem__(self, key):
        raise Closed("this wheeld client is closed")


def refusal_error(message: M.Refused) -> Exception:
    """The WheeldError a Refused message stands for."""
    text = f"the daemon refused the session: {message.reason}"
    if message.code == M.Refused.NOT_ALLOWED:
        return NotAllowed(text)
    if message.code == M.Refused.GROUP_LIMIT:
        return GroupLimit(text)
    if message.code == M.Refused.BUSY:
        return BackPressure(text)
    if message.code == M.Refused.BAD_REQUEST:
        return InvalidRequest(text)
    return ProtocolError(text) if message.code == M.Refused.VERSION else BrokenPeer(text)


class ClientSession:
    """The session room of :class:`wheeld.core.ClientCore` (see the module docstring)."""

    if TYPE_CHECKING:  # the core's fields and methods this room uses (ClientCore sets them)
        group: str
        ring_timeout_s: float
        max_delay_ms: int
        _segment: ClientSegment | None
        _status: StatusPage | None
        _parked: memoryview | None
        _page: memoryview | None
        _group_words: memoryview | None
        _touch_table: memoryview | None
        _touch_index: dict[bytes, int]
        _touch_by_key: dict
        _free_touch: list[int]
        _next_touch: int
        _welcome: M.Welcome | None
        _tag_base: int
        _rang_epoch: int
        _closed: bool
        _forked: bool
        _owner_pid: int
        _former_slots: set[int]
        _replay_from: int
        _flush_positions: dict[int, int]
        _answered_at: int
        _answered: set[int]
        _answer_positions: dict[int, int]
        _latest: list[dict]
        _acks_pending: list[tuple[int, int, int]]
        _rearms_pending: list[tuple]
        _rearmed: dict[bytes, tuple]
        _applied: int
        _marks: list[tuple[int, list]]
        _rejected: list[M.Rejected]
        _flush_answers: dict[int, list | None]

        def _wait_for_room(self) -> None: ...
        def _remember_done(self, bkey, tag: int) -> None: ...
        def _on_expirations(self, items) -> None: ...
        def _flush_acks(self) -> None: ...
        def _after_push(self) -> None: ...
        def _stale_idle(self, ident: bytes, e, bkey, handle, again: bool = False) -> bool: ...
        def _next_tag(self) -> int: ...
        def _push(self, op: int, kb: bytes, meta: int, deadline: int, tag: int, aux0: int = 0,
                  aux1: int = 0) -> None: ...
        def _ring_doorbell(self, urgent: bool = True) -> None: ...
    else:
        __slots__ = ()  # a mixin: the fields are the core's

    def _inherited_by_child(self) -> None:
        """In a child that ``fork()`` made: the session is the parent's. Every call raises
        ForkedClient; ``close()`` only drops the child's copies, sending nothing."""
        self._forked = True
        self._closed = True
        self._touch_by_key = ForkedTouches(self._owner_pid)

    def _raise_unconnected(self) -> NoReturn:
        raise Closed("this wheeld client has no session yet")

    def _raise_closed(self) -> NoReturn:
        if self._forked:
            raise ForkedClient(f"this wheeld client belongs to process {self._owner_pid}; connect again in the child")
        raise Closed("this wheeld client is closed")

    def _release_local(self) -> None:
        """Unmap the ring and the status page (this process's view only)."""
        self._touch_table = None  # (compiled: typed views of the segment; dropped before it is unmapped)
        self._group_words = None
        if not self._forked:  # (a forked child keeps _ForkedTouches: its touches raise ForkedClient)
            self._touch_by_key = ClosedTouches()  # the table is gone: a touch raises Closed
        if self._segment is not None:
            self._segment.close()
        if self._status is not None:
            self._parked = self._page = None
            self._status.close()
            self._status = None

    def _on_welcome(self, welcome: M.Welcome, fds: list[int]) -> None:
        """Take the session the daemon opened: ``fds`` are the descriptors that came with
        the Welcome (our ring, then the status page); every one is used or closed."""
        fds = list(fds)
        try:
            if not fds:
                raise ProtocolError("the daemon's Welcome carried no ring")
            ring_fd = fds.pop(0)
            old = self._segment
            if welcome.resumed and old is not None and old.same_file(ring_fd):
                os.close(ring_fd)  # the ring we handed back, kept: its commands will be applied
                old.name = welcome.segment_name  # its label in this daemon (a reboot relabels it)
                old.limit_head(None)  # the head word holds any rewind now (hello_frame)
                segment = old
                backlog = None
            else:
                segment = ClientSegment.attach(ring_fd, welcome.segment_name)  # takes ring_fd
                backlog = old.unapplied_records(self._replay_from) if old is not None else []
                self._replay_from = 0
                self._flush_positions.clear()
                self._answered_at = 0  # the new ring's positions; the backlog is answered on it
                self._answered.clear()
                self._answer_positions.clear()
                if old is not None:  # the daemon could not take our ring back: start afresh
                    self._touch_table = None
                    self._group_words = None
                    old.close()
                    self._touch_index.clear()
                    self._touch_by_key.clear()
                    self._free_touch.clear()
                    self._next_touch = 0
                    # their touch indices were the old ring's; the copies they replace are acknowledged
                    self._acks_pending.extend(rearm[6] for rearm in self._rearms_pending)
                    self._rearms_pending.clear()
                    self._rearmed.clear()
                self._segment = segment
                # touch() stores straight into the touch table: one 8-byte store (see shm.ring)
                self._touch_table = segment._last_touch
            self._group_words = segment._words
            if self._status is not None:
                self._parked = self._page = None
                self._status.close()
                self._status = None
            if welcome.status_page and fds:
                self._status = StatusPage.attach(fds.pop(0))
                self._parked = self._page = self._status.words
        finally:
            for fd in fds:
                os.close(fd)
        if self._welcome is not None and self._welcome.client_id != welcome.client_id:
            self._former_slots.add(self._welcome.client_id)  # armings tagged with it are still ours
        self._welcome = welcome
        self._tag_base = welcome.client_id << _SEQ_BITS
        self._rang_epoch = 0
        self.max_delay_ms = welcome.max_delay_ms
        if backlog is None:
            self._recover_answers(segment, welcome.head)
        else:
            self._push_backlog(backlog, segment)

    def _push_backlog(self, backlog: list[bytes], segment: ClientSegment) -> None:
        """Push into the new ring the records pushed before and never applied (a daemon that
        could not take the ring back); their FLUSHes end at new positions."""
        for record in backlog:
            self._push_record(record)
            if record[0] == C.FLUSH:
                self._answer_positions[int.from_bytes(record[_SEQ_AT : _SEQ_AT + 4], "little")] = segment._tail

    def _recover_answers(self, seg: ClientSegment, head: int) -> None:
        """Our ring was kept, and the commands before ``head`` were applied by a daemon: the
        answers to those we did not receive (the daemon killed after it moved the head, the
        session closed, answers queued for a socket that broke) will never come. Read them
        back from the ring: every FLUSH there is ``Applied``, every record with an answer
        mark was refused with its code (:mod:`wheeld.shm.ring`, "Answers kept in the ring").
        Each is handled as if received, in ring order, unless it was received."""
        start = self._answered_at
        kept = seg.kept_marks
        seg.kept_marks = []  # (every record kept is before the head)
        if head <= start:
            return
        records = seg.consumed_records(start, head)  # those still in the ring, and before them:
        first = records[0][0] if records else head
        records[:0] = [entry for entry in kept if start <= entry[0] < first]
        answered = self._answered
        for _position, record in records:
            op = record[0]
            if op == C.ACK:
                continue  # not answered
            seq = int.from_bytes(record[_SEQ_AT : _SEQ_AT + 4], "little")
            mark = int.from_bytes(record[_MARK_AT : _MARK_AT + 4], "little")
            if 0 < mark <= len(C.ANSWER_MARKS) and seq not in answered:
                code = C.ANSWER_MARKS[mark - 1]
                meta = record[1] if op != C.FLUSH else 0
                key_bytes = record[_KEY_AT : _KEY_AT + key_length(meta)] if meta else b""
                try:
                    refusal = M.Rejected(seq, key_bytes, meta, f"{code}: the daemon's answer did not reach this "
                                                                f"client (its session ended); read back from the ring",
                                         code)
                except (InvalidRequest, ValueError):
                    refusal = None  # not a record this client wrote: nothing to tell
                if refusal is not None:
                    self._on_message(refusal)
            if op == C.FLUSH and ~seq not in answered:
                self._on_message(M.Applied(seq))
        if head > self._answered_at:
            self._answered_at = head
            answered.clear()

    def _push_record(self, record: bytes) -> None:
        seg = self._segment
        assert seg is not None  # pushed by _on_welcome, once the ring is mapped
        if not seg.try_push_record(record):
            self._wait_for_room()
            if not seg.try_push_record(record):
                raise RingFull(f"the ring stayed full for {self.ring_timeout_s} s; the daemon is not draining it")

    def _on_message(self, message) -> None:
        kind = type(message)
        if kind is M.ExpirationRows or kind is M.Expirations:
            self._on_expirations(message.items)
        elif kind is M.Applied:
            self._applied = message.seq
            at = self._answer_positions.pop(message.seq, None)
            if at is None:
                self._answered.add(~message.seq)  # (a FLUSH whose position we do not know)
            else:
                self._answered_through(at)
            position = self._flush_positions.get(message.seq)
            rejected = self._rejected
            if rejected and rejected[-1].seq == message.seq and rejected[-1].code in M.Rejected.NOT_DURABLE:
                position = None  # applied but not on disk (the daemon's journal stalled): keep the replay position
            answers = self._flush_answers
            if answers and answers.get(message.seq, ()) is None:  # a flush() waits for it: its refusals
                answers[message.seq] = rejected
                self._rejected = []
            if position is not None:  # everything before it is acknowledged: no replay from before
                self._replay_from = position
                while self._flush_positions:
                    seq = next(iter(self._flush_positions))
                    del self._flush_positions[seq]
                    if seq == message.seq:
                        break
            shards = self._latest
            while self._marks and self._marks[0][0] == message.seq:
                _seq, cancelled = self._marks.pop(0)
                for bkey in cancelled[::2]:
                    latest = shards[hash(bkey) & _SHARD_MASK]
                    tag = latest.get(bkey)
                    if tag is not None and tag < 0:
                        del latest[bkey]
                        self._remember_done(bkey, ~tag)
        elif kind is M.Rejected:
            self._answered.add(message.seq)
            if not (self._rearmed and self._rearm_comes_again(message)):
                self._rejected.append(message)
        elif kind is M.Goodbye:
            raise BrokenPeer(f"the daemon ended the session: {message.reason}")
        elif kind is M.Refused:
            raise refusal_error(message)

    def _answered_through(self, position: int) -> None:
        """The Applied of the FLUSH that ends at ring ``position`` came: every command before
        it has been answered (the daemon answers in ring order)."""
        self._answered_at = position
        self._answered.clear()
        positions = self._answer_positions
        while positions and next(iter(positions.values())) <= position:  # (pushed in ring order)
            del positions[next(iter(positions))]
        seg = self._segment
        if seg is not None and seg.kept_marks:
            seg.kept_marks = [entry for entry in seg.kept_marks if entry[0] >= position]

    # ------------------------------------------------------------------ idle re-arms
    # (the core's _stale_idle makes them: an idle timer's copy touched after it fired)
    def _push_rearms(self) -> None:
        """Push the re-arms :meth:`_stale_idle` made, as many as the ring takes now (the
        rest at the next poll or flush), and wake the daemon if it is parked.

        Each is two records, pushed together or not at all: the acknowledgement of the
        copy it replaces, then the ADD_IDLE. In that order the copy's record is released
        before the new arming needs one, so a group at its ``--group-quota`` (or a full
        arena) does not refuse the re-arm of a timer it already holds: refused, the
        re-arm would be lost with the copy acknowledged. An acknowledgement that names an
        arena lost before the daemon read it releases nothing: the daemon that rebuilt the
        arena from its journal holds the fired record still, may refuse the re-arm for it,
        and sends the copy again, which is re-armed again then (:meth:`_rearm_again`)."""
        seg = self._segment
        assert seg is not None  # rearms are of idle timers, armed through the ring
        pending = self._rearms_pending
        done = 0
        for kb, meta, deadline, tag, idle_ms, index, handle in pending:
            if seg.free_slots() < 2:
                break
            slot, gen, epoch = handle
            seg.try_push(C.ACK, b"", 0, 0, epoch, slot, gen)
            seg.try_push(C.ADD_IDLE, kb, meta, deadline, tag, idle_ms, index)
            done += 1
        if done:
            del pending[:done]
            self._after_push()

    def _supersede_rearms(self, ident: bytes) -> None:
        """The application armed or cancelled ``ident`` while a re-arm of it (:meth:`_stale_idle`)
        still waits for room in the ring: pushed after the application's command, the re-arm
        would put the older arming back over it (and name a touch row released since, for
        another key to take). The re-arm is dropped; the acknowledgement of its copy is
        still pushed."""
        keep = []
        for rearm in self._rearms_pending:
            if _META[rearm[1]] + rearm[0] == ident:
                self._acks_pending.append(rearm[6])
            else:
                keep.append(rearm)
        self._rearms_pending[:] = keep

    def _rearm_again(self, ident: bytes, e, bkey, handle, latest: int) -> bool:
        """A copy of an arming whose key was armed since (``latest``): True when that is our
        re-arm of this very copy (:meth:`_stale_idle`), which is then done again.

        The copy comes back when the acknowledgement pushed with the re-arm released
        nothing: it named an arena lost before the daemon read it (a daemon that rebuilds
        the arena from its journal ignores it, and restores the fired record), or it was
        on its way again (a restart, an ack timeout). The re-arm itself may then have been
        refused, the fired record still holding its place in a group at its
        ``--group-quota`` or in a full arena: dropping the copy would lose the timer. So
        the re-arm is pushed again behind the acknowledgement of this copy, which now
        names the record; for last touch + idle_ms, due or not (never early: an applied
        first re-arm is moved there, a refused one replaced), and the copy is not handed."""
        rearmed = self._rearmed.get(ident)
        if rearmed is None or rearmed[0] != e.seq or rearmed[2][-1] != latest:
            return False
        return self._stale_idle(ident, e, bkey, handle, True)

    def _rearm_comes_again(self, message: M.Rejected) -> bool:
        """Is ``message`` the refusal of one of our re-arms of an idle key (:meth:`_stale_idle`,
        no arming of the application's) whose copy comes, or came, back to be re-armed again
        (:meth:`_rearm_again`)? That refusal is the library's own: neither ``flush()`` nor
        ``rejected()`` is told of it. It is one when the key was re-armed again since, or
        when the re-arm's acknowledgement named an arena other than this session's (the
        daemon ignored it, holds the fired record still and sends the copy again)."""
        if message.code != M.Rejected.QUOTA_EXCEEDED and message.code != M.Rejected.ARENA_FULL:
            return False
        rearmed = self._rearmed.get(_META[message.key_meta] + message.key_bytes)
        if rearmed is None or message.seq not in rearmed[2]:
            return False
        welcome = self._welcome
        return message.seq != rearmed[2][-1] or (welcome is not None and rearmed[1] != welcome.arena_epoch)

    def _init_flush_answers(self) -> None:
        """The answers flush() waits for (the core's __init__ calls it)."""
        # Rejected messages received since the last Applied that answered a flush() waiting
        # for it; that Applied hands them to its flush (_flush_answers), which raises them.
        # The daemon answers in ring order (a refusal before the Applied of the first FLUSH
        # after the refused command), so those are exactly the refusals of the commands
        # before that FLUSH that no earlier flush() was told of.
        self._rejected: list[M.Rejected] = []
        # seq of each flush() waiting for its Applied -> None until it comes, then the
        # Rejected messages received before it (see _rejected)
        self._flush_answers: dict[int, list | None] = {}

    def _push_flush(self) -> int:
        seg = self._segment
        if seg is None:
            self._raise_unconnected()
        self._flush_acks()
        seq = self._next_tag()
        self._push(C.FLUSH, b"", 0, 0, seq)
        self._flush_positions[seq] = seg._tail
        self._answer_positions[seq] = seg._tail
        self._ring_doorbell()
        return seq

    def rejected(self) -> list[M.Rejected]:
        """Commands the daemon refused since the last call (e.g. arena full) that no
        ``flush()`` has been answered for yet."""
        out, self._rejected = self._rejected, []
        return out

    def _flush_waits(self, seq: int) -> None:
        """A flush() waits for the Applied of its FLUSH ``seq`` (:meth:`_flush_answer`)."""
        self._flush_answers[seq] = None

    def _flush_answer(self, seq: int) -> list | None:
        """None while FLUSH ``seq``'s Applied has not come, then the refusals it answers."""
        return self._flush_answers[seq]

    def _flush_abandoned(self, seq: int) -> None:
        """The flush() of FLUSH ``seq`` ends without its answer (Timeout, a lost daemon, a
        cancelled task): the refusals its Applied answered, if it came, are the next one's."""
        answered = self._flush_answers.pop(seq, None)
        if answered:
            self._rejected[:0] = answered

    def _raise_rejections(self, rejected: list) -> None:
        """Raise what a flush() raises for the refusals answered before its Applied (if any)."""
        if not rejected:
            return
        # a flush the journal could not make durable: raised last, since a later flush that
        # succeeds covers those commands too, while a refused command is never applied
        unsynced = [r for r in rejected if r.code in M.Rejected.NOT_DURABLE]
        if unsynced:
            rejected = [r for r in rejected if r.code not in M.Rejected.NOT_DURABLE]
        full = [r for r in rejected if r.code == M.Rejected.ARENA_FULL]
        quota = [r for r in rejected if r.code == M.Rejected.QUOTA_EXCEEDED]
        summary = ", ".join(f"{r.key!r}: {r.reason}" for r in rejected[:5])
        if full:
            raise ArenaFull(f"{len(full)} add(s) refused because the arena is full ({summary})")
        if quota:
            raise QuotaExceeded(f"{len(quota)} add(s) refused: group {self.group!r} holds its quota ({summary})")
        if rejected:
            raise InvalidRequest(f"{len(rejected)} command(s) refused ({summary})")
        if unsynced[-1].code == M.Rejected.REPLICATION_BEHIND:
            raise ReplicationBehind(unsynced[-1].reason)
        raise JournalUnavailable(unsynced[-1].reason)
