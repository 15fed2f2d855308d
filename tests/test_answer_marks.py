"""A decision the daemon made is not lost with its answer: the ring keeps it.

A refusal exists only in its ``Rejected`` answer, and the daemon answers a chunk of a
client's ring after it has published the ring's head past it. A daemon killed in
between (simulation seed 700834), a session closed, or answers queued for a socket
that broke, used to lose the refusal: the next daemon, on the same arena, had nothing
of the chunk left and answered the client's next flush as if the refused command had
been applied. Now the daemon stores each refusal's code in the refused record (its
``pad`` word, the *answer mark*) before the head moves, and so for a FLUSH answered as
not durable; the client library reads the answers it did not receive back from its
ring when its next session opens (``ClientSession._recover_answers``, with the head
the Welcome carries). See shm/ring.py, "Answers kept in the ring".
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ring_harness import ring_executor
from test_flush_answers import _session

import wheeld
from wheeld.core import ClientCore
from wheeld.daemon import executor as E
from wheeld.protocol import commands as C
from wheeld.protocol import framing
from wheeld.protocol import messages as M
from wheeld.protocol.keys import encode_key
from wheeld.shm.wheel import MAX_DELAY_MS
from wheeld.shm.ring import ClientSegment


class _Killed(BaseException):
    """The daemon killed while it answers (a SIGKILL there: nothing after it runs)."""


class _DyingSession:
    """A session the daemon is killed in while answering."""

    closed = held_back = False

    def answer(self, rejects, flush_answers, cuts=None):
        raise _Killed()


class _Client(ClientCore):
    """The client library over the producer's end of an in-process ring; notes the answers
    it handles (received, or read back from the ring)."""

    def __init__(self, producer: ClientSegment):
        super().__init__("/nonexistent.sock", "g", 1.0, 1.0, "")
        self._segment = producer
        self.told: list[tuple] = []

    def _on_message(self, message) -> None:
        self.told.append(("applied", message.seq) if type(message) is M.Applied
                         else ("rejected", message.seq, message.code))
        super()._on_message(message)

    def push(self, command) -> None:
        assert self._segment.try_push_record(C.encode_command(*command))
        if command[0] == C.FLUSH:  # what _push_flush notes for a flush() waiting for it
            self._flush_waits(command[4])
            self._answer_positions[command[4]] = self._segment._tail


def _marks(segment: ClientSegment) -> list[int]:
    """The answer mark of every slot of the ring, by slot."""
    return segment._ring["pad"].tolist()


def _adds(names, first_seq: int, deadline: int = 5000) -> list[tuple]:
    return [(C.ADD, *encode_key(name), deadline, first_seq + i) for i, name in enumerate(names)]


@pytest.mark.parametrize("planned", [False, True], ids=["in-order", "planned"])
def test_a_refusal_lost_with_a_daemon_killed_after_the_head_moved_is_read_back_from_the_ring(monkeypatch, planned):
    """Seed 700834's shape: two adds refused (the arena full), the daemon killed while it
    answers, after it published the head. The next daemon has nothing of the chunk left;
    the client's flush() is answered from the ring: it raises for the refused adds, and
    only for those, and the flush before them returns."""
    monkeypatch.setattr(E, "BATCH_MIN", 1 if planned else None)
    with ring_executor(4) as r:
        cs, producer, executor = r.cs, r.producer, r.executor
        client = _Client(producer)
        names = [f"k{i}" for i in range(6)]
        commands = _adds(names[:2], 1) + [(C.FLUSH, b"", 0, 0, 3)] + _adds(names[2:], 4) + [(C.FLUSH, b"", 0, 0, 8)]
        for command in commands:
            client.push(command)
        cs.session = _DyingSession()
        with pytest.raises(_Killed):
            executor.apply_ring(cs)
        assert cs.segment.depth() == 0, "the head moves first: a producer waiting for room gets it"
        full = C.ANSWER_MARK[M.Rejected.ARENA_FULL]
        assert _marks(producer)[: len(commands)] == [0, 0, 0, 0, 0, full, full, 0]
        # the next session opens (a restarted daemon on the same arena: the head it left)
        client._recover_answers(producer, cs.segment.consumer_head)
        assert client.told == [("applied", 3), ("rejected", 6, M.Rejected.ARENA_FULL),
                               ("rejected", 7, M.Rejected.ARENA_FULL), ("applied", 8)]
        assert client._flush_answer(3) == []
        with pytest.raises(wheeld.ArenaFull, match="'k4'.*'k5'") as raised:
            client._raise_rejections(client._flush_answers.pop(8))
        assert "'k2'" not in str(raised.value) and "'k3'" not in str(raised.value)
        assert client._answered_at == len(commands)


def test_answers_received_before_the_session_ended_are_not_told_twice():
    """The first refusal and the first flush's Applied reached the client before the
    daemon was killed: only the rest is read back."""
    with ring_executor(1) as r:
        cs, producer, executor = r.cs, r.producer, r.executor
        client = _Client(producer)
        commands = (_adds(["a", "b"], 1) + [(C.FLUSH, b"", 0, 0, 3)] + _adds(["c"], 4)
                    + [(C.FLUSH, b"", 0, 0, 5)])
        for command in commands:
            client.push(command)
        cs.session = _DyingSession()
        with pytest.raises(_Killed):
            executor.apply_ring(cs)
        kb, meta = encode_key("b")
        client._on_message(M.Rejected(2, kb, meta, "arena full", M.Rejected.ARENA_FULL))  # received
        client.told.clear()
        client._recover_answers(producer, cs.segment.consumer_head)
        assert client.told == [("applied", 3), ("rejected", 4, M.Rejected.ARENA_FULL), ("applied", 5)]
        client.told.clear()
        client._recover_answers(producer, cs.segment.consumer_head)
        assert client.told == []


@pytest.mark.parametrize("pushed", [3, 4], ids=["still-in-the-ring", "overwritten"])
def test_a_marked_record_the_client_may_overwrite_is_read_back_once_from_its_copy(pushed):
    """While no daemon answers, the producer may fill the ring and overwrite records whose
    answers it never received: when it reads a head past a marked record it keeps a copy
    (a push costs nothing more). Read back once, whether the ring still holds it or not."""
    with ring_executor(1, ring=4) as r:
        cs, producer, executor = r.cs, r.producer, r.executor
        client = _Client(producer)
        for command in _adds(["a", "b"], 1):  # "b" refused: the arena holds one
            client.push(command)
        assert executor.apply_ring(cs) == 2  # no session: nothing sent
        for command in _adds(["c", "d", "e", "f"][:pushed], 3, deadline=6000):  # over "a" (and "b")
            client.push(command)
        assert [position for position, _record in producer.kept_marks] == [1]
        assert _marks(producer)[1] == (0 if pushed == 4 else C.ANSWER_MARK[M.Rejected.ARENA_FULL])
        client._recover_answers(producer, cs.segment.consumer_head)
        assert client.told == [("rejected", 2, M.Rejected.ARENA_FULL)]
        assert producer.kept_marks == []


def test_copies_of_many_marked_records_are_kept_at_once_and_read_back_in_ring_order():
    """A head that passed many records at once (more than are read one by one): the copies
    are found with one vectorised pass over the pad words."""
    with ring_executor(1, ring=64) as r:
        cs, producer, executor = r.cs, r.producer, r.executor
        client = _Client(producer)
        names = [f"k{i}" for i in range(40)]
        for command in _adds(names, 1):  # the arena holds one: 39 refused
            client.push(command)
        assert executor.apply_ring(cs) == 40
        for command in _adds([f"n{i}" for i in range(25)], 41, deadline=6000):  # the 25th reads the head
            client.push(command)
        assert [position for position, _record in producer.kept_marks] == list(range(1, 40))
        client._recover_answers(producer, cs.segment.consumer_head)
        assert client.told == [("rejected", seq, M.Rejected.ARENA_FULL) for seq in range(2, 41)]


def test_a_daemon_that_adopts_a_ring_clears_the_marks_of_what_it_is_to_apply():
    """Killed between a mark and the head's move, a daemon leaves marked records to the next
    one, which applies them again: a marked record would be garbage to the validator."""
    with ring_executor(4) as r:
        cs, producer = r.cs, r.producer
        for command in _adds(["a", "b"], 1):
            assert producer.try_push_record(C.encode_command(*command))
        cs.segment.peek(2)
        cs.segment.mark_answer(1, C.ANSWER_MARK[M.Rejected.QUOTA_EXCEEDED])  # and killed: no commit
        assert E.valid_prefix(cs.segment.peek_bytes(), producer.touch_capacity) == 1
        adopted = ClientSegment.adopt(os.dup(producer.fd), "adopted")
        try:
            assert not any(_marks(adopted))
            assert E.valid_prefix(adopted.peek_bytes(), producer.touch_capacity) == 2
        finally:
            adopted.close()
        # records pushed again into a new ring (the daemon could not take it back) carry no mark
        cs.segment.peek(2)
        cs.segment.mark_answer(0, C.ANSWER_MARK[M.Rejected.ARENA_FULL])
        cs.segment.commit(2)
        assert [record[C.PAD_OFFSET] for record in producer.unapplied_records(0)] == [0, 0]


def test_a_tail_word_moved_far_ahead_during_the_adoption_is_not_believed():
    """The client may rewrite its tail word between the adoption's check of the counters
    and the clearing of the marks: a tail far ahead clears nothing (and makes no array of
    its size); the first peek then reports the impossible counters."""
    with ring_executor(1) as r:
        segment = r.cs.segment
        segment._clear_marks(0, 1 << 62)
        segment._clear_marks(5, 0)
        assert not any(_marks(segment))


def test_every_refusal_code_has_a_mark():
    codes = {value for name, value in vars(M.Rejected).items() if name.isupper() and isinstance(value, str)}
    assert codes == set(C.ANSWER_MARKS)
    assert M.REJECT_CODES <= set(C.ANSWER_MARKS)


# a command: ("add", key index, deadline in range) or ("flush",)
_COMMANDS = st.lists(st.one_of(st.tuples(st.just("add"), st.integers(0, 7), st.booleans()),
                               st.tuples(st.just("flush"))), min_size=1, max_size=40)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(commands=_COMMANDS, chunk=st.integers(1, 40), received=st.one_of(st.just(0), st.integers(0, 80)),
       pushed_after=st.one_of(st.just(64), st.integers(0, 64)), planned=st.booleans())
def test_answers_lost_at_any_point_are_read_back_exactly_once_in_ring_order(
        commands, chunk, received, pushed_after, planned):
    """The class of the bug, not its instance: whatever the chunk sizes, however many of a
    session's answers reached the client before it ended, and however far the producer went
    on pushing (over the records of the lost answers) before its next session opened, the
    client handles every answer the daemon made once, in the order the daemon made them.
    Refusals come from a full arena (3 records) and from deadlines out of range."""
    saved = E.BATCH_MIN
    E.BATCH_MIN = 1 if planned else None
    try:
        with ring_executor(3, ring=64) as r:
            cs, producer, executor = r.cs, r.producer, r.executor
            client = _Client(producer)
            seq = 0
            for command in commands:
                seq += 1
                if command[0] == "flush":
                    client.push((C.FLUSH, b"", 0, 0, seq))
                else:
                    deadline = 5000 if command[2] else 1000 + MAX_DELAY_MS + 1
                    client.push((C.ADD, *encode_key(f"k{command[1]}"), deadline, seq))
            session, wire = _session()  # a connection that takes every answer
            cs.session = session
            session.client = cs
            while cs.segment.depth():
                assert executor.apply_ring(cs, chunk) > 0
            made = [M.decode_daemon_message(body) for body in framing.FrameReader().feed(bytes(wire.data))]
            truth = [("applied", m.seq) if type(m) is M.Applied else ("rejected", m.seq, m.code) for m in made]
            for message in made[:received]:  # what reached the client before its session ended
                client._on_message(message)
            for i in range(pushed_after):  # pushed while no session, never applied: 64 overwrites them all
                assert producer.try_push_record(C.encode_command(C.ADD, *encode_key(f"n{i}"), 6000, 1000 + i))
            client._recover_answers(producer, cs.segment.consumer_head)  # its next Welcome
            assert client.told == truth
    finally:
        E.BATCH_MIN = saved
