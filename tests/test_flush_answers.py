"""Each flush() raises for the refused commands before it, and only for those.

The daemon answers a chunk of a client's commands in ring order: a command it refused
is answered (``Rejected``) before the ``Applied`` of the first FLUSH after it, never
before an earlier one, and the client library hands a flush() the refusals it received
before that flush's ``Applied``. When flushes are pipelined (an asyncio task flushing
while another adds, a ring replayed in one chunk after a daemon restart), a refusal
answered with an earlier flush would make that flush raise for a command it did not
cover, and the flush that does cover it return as if the command had been applied.

In process: the ordering (``Session.answer``, ``answer_order``, ``Executor.apply_ring``
on both of its paths, the answers read back from the ring) and the client's
attribution (``ClientCore``). Against a real daemon: pipelined flushes around refused commands
(a group quota, a deadline out of range), with the daemon stopped, restarted, or
after it closed the session.
"""

from __future__ import annotations

import asyncio
import os
import signal

import numpy as np
import pytest
from daemon_harness import mono_ms, process_state, wait_until
from ring_harness import ring_executor

import wheeld
from wheeld.core import ClientCore
from wheeld.daemon import connection as CN
from wheeld.daemon import executor as E
from wheeld.daemon.planner import Rejection
from wheeld.protocol import commands as C
from wheeld.protocol import framing
from wheeld.protocol import messages as M
from wheeld.protocol import ring_layout as RL
from wheeld.protocol.keys import encode_key
from wheeld.shm.wheel import MAX_DELAY_MS

QUOTA = M.Rejected.QUOTA_EXCEEDED
INVALID = M.Rejected.INVALID_DEADLINE
FULL = M.Rejected.ARENA_FULL


# ---------------------------------------------------------------------------- helpers


class _Transport:
    """A connection that takes everything, or nothing while ``taking`` is False."""

    def __init__(self, taking: bool = True):
        self.taking = taking
        self.data = bytearray()

    def send(self, data) -> int:
        if not self.taking:
            return 0
        self.data += data
        return len(data)

    def want_writable(self, wanted: bool) -> None:
        pass

    def close(self) -> None:
        pass


class _Owner:
    def close(self, session, reason, goodbye=False):
        raise AssertionError(f"session closed: {reason}")

    def now_s(self) -> float:
        return 0.0

    def wake(self) -> None:
        pass


def _session(taking: bool = True) -> tuple[CN.Session, _Transport]:
    transport = _Transport(taking)
    return CN.Session(_Owner(), transport, os.getpid(), os.getuid(), os.getgid()), transport


def _refusal(seq: int, at: int, code: str = QUOTA, reason: str = "") -> Rejection:
    kb, meta = encode_key(f"k{seq}")
    return Rejection(seq, kb, meta, reason or f"refused {seq}", code, at)


def _applied(seq: int) -> bytes:
    return M.encode_daemon_frame(M.Applied(seq))


def _told(data) -> list[tuple]:
    """The daemon's answers in ``data``: ("applied", seq), ("rejected", seq, code) or, for a
    summary of refusals not sent one by one, ("summary", code, count)."""
    told = []
    for body in framing.FrameReader().feed(bytes(data)):
        message = M.decode_daemon_message(body)
        if type(message) is M.Applied:
            told.append(("applied", message.seq))
        elif message.seq:
            told.append(("rejected", message.seq, message.code))
        else:
            told.append(("summary", message.code, int(message.reason.split(" ", 1)[0])))
    return told


def _records(commands) -> np.ndarray:
    return np.frombuffer(b"".join(C.encode_command(*c) for c in commands), dtype=C.RECORD_DTYPE).copy()


# ---------------------------------------------------------------------------- the daemon's order


def test_a_session_answers_each_flush_after_the_refusals_before_it_and_none_after():
    session, transport = _session()
    # ring: FLUSH 2 (at 1), refused 3 (at 2), refused 4 (at 3), FLUSH 6 (at 5), FLUSH 7 (at 6), refused 8 (at 7)
    rejects = [_refusal(3, 2), _refusal(4, 3), _refusal(8, 7)]
    session.answer(rejects, [_applied(2), _applied(6), _applied(7)], [0, 2, 2])
    assert _told(transport.data) == [("applied", 2), ("rejected", 3, QUOTA), ("rejected", 4, QUOTA),
                                     ("applied", 6), ("applied", 7), ("rejected", 8, QUOTA)]
    with pytest.raises(ValueError):
        session.answer(rejects, [_applied(9)], None)  # refusals and flushes need their order


def test_refusals_counted_instead_of_sent_are_summarised_before_the_next_flush_only():
    """A client that leaves its answers unread gets later refusals as one summary per code:
    a summary goes before the Applied of the first flush after the refusals it counts."""
    session, transport = _session(taking=False)
    flood = [_refusal(1, n, INVALID, "x" * 300) for n in range(2000)]  # past REJECT_DETAIL_BYTES unread
    session.answer(flood, [], None)
    assert session.held_rejections, "the flood should be past the detail bound"
    held = session.held_rejections[INVALID][0]
    # ring: refused (at 0), FLUSH 11 (at 1), refused (at 2), refused (at 3), FLUSH 12 (at 4)
    session.answer([_refusal(2, 0), _refusal(3, 2), _refusal(4, 3)], [_applied(11), _applied(12)], [1, 3])
    transport.taking = True
    session.writable()
    told = _told(transport.data)
    assert told[-5:] == [("summary", INVALID, held), ("summary", QUOTA, 1), ("applied", 11), ("summary", QUOTA, 2),
                         ("applied", 12)]
    one_by_one = [t for t in told if t[0] == "rejected"]
    assert len(one_by_one) + held == len(flood)


def test_answer_order_puts_refusals_in_ring_order_and_cuts_them_at_each_flush():
    x, y, z, w = (encode_key(k) for k in "xyzw")
    records = _records([(C.ADD, *x, 2000, 1), (C.FLUSH, b"", 0, 0, 2), (C.ADD, *y, 2000, 3), (C.ADD, *z, 2000, 4),
                        (C.FLUSH, b"", 0, 0, 5), (C.ADD, *w, 2000, 6)])
    rejects = [_refusal(6, 5), _refusal(1, 0), _refusal(4, 3)]  # a plan reports them by kind, not in order
    assert E.answer_order(records, rejects) == [1, 2]
    assert [r.seq for r in rejects] == [1, 4, 6]


def _chunk_commands():
    """A chunk around refused commands: (commands, the answers it gets in ring order)."""
    keys = [encode_key(k) for k in ("a", "b", "c", "d", "e")]
    far = 1000 + MAX_DELAY_MS + 1
    commands = [(C.ADD, *keys[0], 5000, 1), (C.FLUSH, b"", 0, 0, 2), (C.ADD, *keys[1], far, 3),
                (C.ADD, *keys[2], 5000, 4), (C.ADD, *keys[3], 5000, 5), (C.FLUSH, b"", 0, 0, 6),
                (C.ADD, *keys[4], far, 7), (C.FLUSH, b"", 0, 0, 8), (C.ADD, *keys[1], far, 9)]
    answers = [("applied", 2), ("rejected", 3, INVALID), ("rejected", 5, FULL), ("applied", 6),
               ("rejected", 7, INVALID), ("applied", 8), ("rejected", 9, INVALID)]
    return commands, answers


class _ReadBack(ClientCore):
    """A client library that notes the answers it handles (received or read back)."""

    def __init__(self, segment):
        super().__init__("/nonexistent.sock", "g", 1.0, 1.0, "")
        self._segment = segment
        self.told: list[tuple] = []

    def _on_message(self, message) -> None:
        if type(message) is M.Applied:
            self.told.append(("applied", message.seq))
        else:
            self.told.append(("rejected", message.seq, message.code))
        super()._on_message(message)


@pytest.mark.parametrize("planned", [False, True], ids=["in-order", "planned"])
@pytest.mark.parametrize("connected", [True, False], ids=["session", "no-session"])
def test_the_executor_answers_a_chunk_in_ring_order(monkeypatch, planned, connected):
    """``apply_ring``, applying in order and planned: the refusals are answered in ring order
    (a plan finds the deadlines out of range before the arms the arena has no room for).
    Without a session nothing is sent: the client library reads the same answers back from
    the ring when its next session opens (the answer marks, shm.ring)."""
    monkeypatch.setattr(E, "BATCH_MIN", 1 if planned else None)
    with ring_executor(2) as r:
        cs, producer, executor = r.cs, r.producer, r.executor
        commands, answers = _chunk_commands()
        for command in commands:
            assert producer.try_push_record(C.encode_command(*command))
        session, transport = _session()
        if connected:
            cs.session = session
            session.client = cs
        assert executor.apply_ring(cs) == len(commands)
        if connected:
            assert _told(transport.data) == answers
            return
        assert not transport.data
        client = _ReadBack(producer)
        client._recover_answers(producer, cs.segment.consumer_head)  # its next Welcome's head
        assert client.told == answers
        client.told.clear()
        client._recover_answers(producer, cs.segment.consumer_head)  # read back once
        assert client.told == []


# ---------------------------------------------------------------------------- the client's attribution


def _rejected(seq: int, code: str = QUOTA) -> M.Rejected:
    kb, meta = encode_key(f"k{seq}")
    return M.Rejected(seq, kb, meta, f"refused {seq}", code)


def test_the_client_hands_each_flush_the_refusals_received_before_its_applied():
    core = ClientCore("/nonexistent.sock", "g", 1.0, 1.0, "")
    core._flush_waits(5)
    core._flush_waits(7)
    for message in (_rejected(3), M.Applied(4),  # 4: a FLUSH no flush() waits for (the library's own)
                    M.Applied(5), _rejected(6), M.Applied(7), _rejected(8)):
        core._on_message(message)
    assert [r.seq for r in core._flush_answer(5)] == [3]
    assert [r.seq for r in core._flush_answer(7)] == [6]
    with pytest.raises(wheeld.QuotaExceeded, match="k6") as raised:
        core._raise_rejections(core._flush_answers.pop(7))
    assert "k3" not in str(raised.value) and "k8" not in str(raised.value)
    assert [r.seq for r in core._rejected] == [8]  # for the next flush
    # a flush() that ends without its answer (a timeout) leaves its refusals to the next one
    core._flush_waits(9)
    core._on_message(M.Applied(9))
    core._flush_abandoned(9)
    core._flush_waits(10)
    core._on_message(_rejected(10, INVALID))
    core._on_message(M.Applied(10))
    assert [r.seq for r in core._flush_answers.pop(10)] == [8, 10]
    # one whose Applied never came: the next flush's Applied answers what came before it
    core._flush_waits(11)
    core._flush_abandoned(11)
    core._flush_waits(12)
    core._on_message(_rejected(11))
    core._on_message(M.Applied(11))  # its answer, late: nobody waits for it any more
    core._on_message(M.Applied(12))
    assert [r.seq for r in core._flush_answers.pop(12)] == [11]


def test_the_client_raises_a_stalled_journal_last_and_keeps_its_replay_position():
    core = ClientCore("/nonexistent.sock", "g", 1.0, 1.0, "")
    core._flush_positions[6] = 17
    core._flush_waits(6)
    unsynced = M.Rejected(6, b"", 0, "not durable: disk full", M.Rejected.JOURNAL_UNAVAILABLE)
    for message in (_rejected(5, FULL), unsynced, M.Applied(6)):
        core._on_message(message)
    assert core._replay_from == 0  # not on disk: the replay keeps the commands before it
    with pytest.raises(wheeld.ArenaFull):
        core._raise_rejections(core._flush_answers.pop(6))
    with pytest.raises(wheeld.JournalUnavailable):
        core._raise_rejections([unsynced])


# ---------------------------------------------------------------------------- against a real daemon


class _Stopped:
    """The daemon stopped (SIGSTOP) while the body pushes: one chunk holds all of it."""

    def __init__(self, daemon):
        self.daemon = daemon

    def __enter__(self):
        os.kill(self.daemon.pid, signal.SIGSTOP)
        wait_until(lambda: process_state(self.daemon.pid) == "T", 5, what="the daemon stopped")
        return self

    def __exit__(self, *exc):
        os.kill(self.daemon.pid, signal.SIGCONT)


def _read_until(client, done, timeout_s: float = 10.0) -> list:
    """The daemon's messages on a library client's socket, read by hand, until ``done(messages)``."""
    reader = framing.FrameReader()
    messages = []
    sock = client._sock
    sock.settimeout(timeout_s)
    while not done(messages):
        data = sock.recv(1 << 20)
        assert data, "the daemon closed the session"
        messages += [m for m in map(M.decode_daemon_message, reader.feed(data)) if type(m) in (M.Applied, M.Rejected)]
    return messages


def test_pipelined_flushes_are_each_answered_after_the_refusals_before_them(daemon_factory):
    """Commands pushed while the daemon is stopped are applied in one chunk: each refusal
    (the group's quota, a deadline out of range) is answered after the Applied of the flush
    before it and before the Applied of the flush after it; one after the chunk's last flush
    before the next chunk's answers."""
    d = daemon_factory(extra=["--group-quota", "2"]).start()
    with wheeld.connect(d.socket_path, group="pipelined") as client:
        seg = client._segment
        a, b, x, y = (encode_key(k) for k in ("a", "b", "x", "y"))
        later, far = mono_ms() + 600_000, 2**62
        with _Stopped(d):  # the quota refuses x and y, the range a's re-arm
            for command in [(C.ADD, *a, later, 1), (C.ADD, *b, later, 2), (C.FLUSH, b"", 0, 0, 3),
                            (C.ADD, *x, later, 4), (C.ADD, *a, far, 5), (C.FLUSH, b"", 0, 0, 6),
                            (C.ADD, *y, later, 7)]:
                assert seg.try_push_record(C.encode_command(*command))
        client._ring_doorbell()
        wait_until(lambda: seg._words[RL.HEAD_WORD] == seg._tail, 10, what="the chunk applied")
        assert seg.try_push_record(C.encode_command(C.FLUSH, b"", 0, 0, 8))
        client._ring_doorbell()
        messages = _read_until(client, lambda ms: ms and type(ms[-1]) is M.Applied and ms[-1].seq == 8)
        told = [("applied", m.seq) if type(m) is M.Applied else ("rejected", m.seq, m.code) for m in messages]
        assert told == [("applied", 3), ("rejected", 4, QUOTA), ("rejected", 5, INVALID), ("applied", 6),
                        ("rejected", 7, QUOTA), ("applied", 8)], d.log()[-2000:]


def test_an_async_flush_does_not_raise_for_a_command_another_task_pushed_after_it(daemon_factory):
    """One task awaits flush() while another adds a key the group's quota refuses: the flush
    returns (the commands before it were applied) and the next one raises for that key."""
    d = daemon_factory(extra=["--group-quota", "2"]).start()

    async def scenario():
        async with await wheeld.connect_async(d.socket_path, group="tasks") as client:
            with _Stopped(d):
                client.add("a", 600_000)
                client.add("b", 600_000)
                first = asyncio.create_task(client.flush(timeout_s=20))
                for _ in range(5):
                    await asyncio.sleep(0)  # it pushes its FLUSH and waits
                client.add("over", 600_000)  # after that FLUSH: the quota refuses it
            await first  # nothing it covers was refused
            with pytest.raises(wheeld.QuotaExceeded, match="over"):
                await client.flush()
            await client.flush()  # told once

    asyncio.run(scenario())


def test_a_ring_replayed_after_a_restart_answers_each_flush_with_its_own_refusals(daemon_factory):
    """Commands pushed while the daemon is down (a flush awaited among them) are applied in one
    chunk by the daemon that comes back: the awaited flush returns, the refusal after it is
    raised by the next flush, and the timers it covered were applied."""
    d = daemon_factory(extra=["--group-quota", "2"]).start()

    async def scenario():
        async with await wheeld.connect_async(d.socket_path, group="replayed", reconnect_timeout_s=30) as client:
            d.kill()
            client.add("a", 600_000)
            client.add("b", 600_000)
            first = asyncio.create_task(client.flush(timeout_s=30))
            for _ in range(5):
                await asyncio.sleep(0)
            client.add("over", 600_000)
            await asyncio.to_thread(d.start)
            await first
            with pytest.raises(wheeld.QuotaExceeded, match="over") as raised:
                await client.flush(timeout_s=30)
            assert "'a'" not in str(raised.value) and "'b'" not in str(raised.value)
            assert client.cancel("a") and client.cancel("b")
            await client.flush()

    asyncio.run(scenario())


def test_refusals_applied_while_the_session_was_closed_reach_the_flush_after_them(daemon_factory):
    """The daemon closes a session (a frame left incomplete) and goes on draining its ring:
    the refusals of commands applied then are answered on the client's next session, each
    before the Applied of the first flush after it."""
    d = daemon_factory(extra=["--frame-timeout-s", "0.5"]).start()
    with wheeld.connect(d.socket_path, group="cut") as client:
        client.add("before", 60_000)
        client.flush()
        client._sock.send(b"\x10\x00")  # half a frame header: closed after the frame timeout
        wait_until(lambda: "stayed incomplete" in d.log(), 10, what="the session closed")
        seg = client._segment
        for key in ("far1", "far2"):  # deadlines out of range, a FLUSH between them
            kb, meta = encode_key(key)
            assert seg.try_push(C.ADD, kb, meta, 2**62, client._next_tag())
            if key == "far1":
                between = client._push_flush()  # the doorbell finds no session; the ring is drained anyway
                client._flush_waits(between)
        wait_until(lambda: seg._words[RL.HEAD_WORD] == seg._tail, 10, what="the ring applied without a session")
        with pytest.raises(wheeld.InvalidRequest, match="far2") as raised:
            client.flush(timeout_s=10)  # reconnects, hands the ring back, is answered
        assert "far1" not in str(raised.value)
        got = client._flush_answers.pop(between)
        assert [r.key for r in got] == ["far1"]
        client.flush()
        assert client.cancel("before")
        client.flush()


# ---------------------------------------------------------------------------- the simulator


def test_the_simulated_service_loses_no_refused_add_to_a_pipelined_flush():
    """Seed 131 (tests/sim/regressions.txt): one chunk held several flushes around adds the
    group's quota refused; answered before an earlier flush's Applied, the refusals made
    that flush raise, and the flush that covered them returned as if they were applied."""
    from sim.run import run_seed

    result = run_seed(131, 1000)
    assert result.ok, "\n".join(str(v) for v in result.violations)
