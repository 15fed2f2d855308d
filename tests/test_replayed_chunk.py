"""A ring chunk a killed daemon applied, applied again by the next one, arms nothing twice.

The daemon applies a chunk of a client's ring, journals it and only then publishes
the ring's head (daemon/executor.py, ``Executor.apply_ring``). Killed in between,
it leaves the whole chunk to the next daemon, which applies it once the client
hands the ring back. Meanwhile that daemon has fired what came due while nothing
ran, and may have delivered it and had it acknowledged by another member. An ADD
applied again after its timer fired used to arm the key anew: the expiration was
delivered twice (the chaos test saw it go to two incarnations of a worker). The
client table notes the armings the arena held at start (``ArmingsAtStart``) and the
first chunk of a ring handed back skips, per key, what the arena shows was applied.

An ACK of the chunk, applied and not journaled, freed a fired record the journal still
holds: the next daemon restores it from the journal as a new record, which the ACK the
ring applies again does not name. It is offered to the client whose chunk it was (the
arena's ``journal_open`` word names it), whose library took it in before it acknowledged
it, not to any member of the group.
"""

from __future__ import annotations

import numpy as np
import pytest
from ring_harness import ring_executor

from wheeld.daemon import executor as E
from wheeld.daemon.client_table import ArmingsAtStart, ClientTable
from wheeld.daemon.config import Config
from wheeld.daemon.reconcile import reconcile
from wheeld.daemon.recorder import Recorder
from wheeld.journal.files import Journal
from wheeld.protocol import arena_layout as AL
from wheeld.protocol import clock
from wheeld.protocol import commands as C
from wheeld.protocol.keys import encode_key
from wheeld.shm import TimerWheel


def _chunk():
    """a: due soon; b: armed, then re-armed later; c: armed, then cancelled; d: due late."""
    k = {name: encode_key(name) for name in "abcd"}
    return [(C.ADD, *k["a"], 1100, 1), (C.ADD, *k["b"], 5000, 2), (C.ADD, *k["b"], 6000, 3),
            (C.ADD, *k["c"], 1200, 4), (C.CANCEL, *k["c"], 0, 5), (C.ADD, *k["d"], 9000, 6),
            (C.FLUSH, b"", 0, 0, 7)]


def _pending(wheel) -> dict:
    return {key: deadline for key, deadline, _group in wheel.pending()}


@pytest.mark.parametrize("planned", [False, True], ids=["in-order", "planned"])
@pytest.mark.parametrize("applied_before", [7, 2, 0], ids=["all", "part", "none"])
@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "unguarded"])
def test_a_chunk_applied_again_after_a_restart_arms_nothing_twice(monkeypatch, planned, applied_before, guarded):
    monkeypatch.setattr(E, "BATCH_MIN", 1 if planned else None)
    with ring_executor(16) as r:
        wheel, cs, producer, executor = r.wheel, r.cs, r.producer, r.executor
        for command in _chunk():
            assert producer.try_push_record(C.encode_command(*command))
        # the killed daemon: it applied the first records of the chunk, never published the head
        if applied_before:
            executor.apply(cs, cs.segment.peek(applied_before))
        # the next daemon starts on the arena, fires what is due, and another member
        # has it acknowledged before this client hands its ring back
        armings = ArmingsAtStart(wheel, {r.gid})
        for slot in wheel.expire(1150):
            wheel.release(slot, wheel.fired(slot)[5])
        cs.replay_guard = armings if guarded else None
        assert executor.apply_ring(cs) == len(_chunk())
        pending = _pending(wheel)
        if applied_before and not guarded:  # what this guards against: "a" armed a second time
            assert "a" in pending
            return
        expected = {"b": 6000, "d": 9000} | ({} if applied_before else {"a": 1100})
        assert pending == expected
        assert cs.replay_guard is None, "the guard covers the first chunk only"
        # what the client pushes next is applied as usual
        assert producer.try_push_record(C.encode_command(C.ADD, *encode_key("a"), 7000, 8))
        assert executor.apply_ring(cs) == 1
        assert _pending(wheel)["a"] == 7000


def test_the_armings_at_start_are_those_of_the_slots_groups_pending_or_fired():
    wheel = TimerWheel.create(16, start_ms=1000)
    try:
        g, other = wheel.group_id("g"), wheel.group_id("other")
        for name, deadline, tag, group in (("p", 5000, 11, g), ("f", 1001, 12, g), ("x", 5000, 13, other)):
            kb, meta = encode_key(name)
            wheel.schedule(name, deadline, group, tag)
        wheel.expire(1010)  # "f" is FIRED, unacknowledged
        armings = ArmingsAtStart(wheel, {g})

        def ident(name):
            kb, meta = encode_key(name)
            return np.frombuffer(bytes([meta]) + kb.ljust(32, b"\0"), dtype=np.uint8)

        names = ["p", "f", "x", "p"]
        tags = np.array([11, 12, 13, 99])
        held = armings.holds(tags, g, np.stack([ident(n) for n in names]))
        assert held.tolist() == [True, True, False, False]
    finally:
        wheel.close()


@pytest.mark.parametrize("whole_range", [True, False], ids=["whole-range", "first-chunk-only"])
def test_a_ring_replayed_into_a_rebuilt_arena_is_guarded_over_its_whole_range(monkeypatch, whole_range):
    """A ring handed back to a daemon that rebuilt the arena from the journal is replayed from
    the client's last acknowledged flush: more than one chunk (a drain takes DRAIN_BATCH at
    most). What the lost daemon applied of it is in the rebuilt arena; an ADD of that range
    whose timer fired and was acknowledged since must not arm it again, in any chunk
    (``ClientSlot.replay_left``: the records the guard covers)."""
    monkeypatch.setattr(E, "DRAIN_BATCH", 2)
    k = {name: encode_key(name) for name in "xya"}
    commands = [(C.ADD, *k["x"], 9000, 1), (C.ADD, *k["y"], 9000, 2), (C.ADD, *k["a"], 1100, 3),
                (C.FLUSH, b"", 0, 0, 4)]
    with ring_executor(16) as r:
        wheel, cs, producer, executor = r.wheel, r.cs, r.producer, r.executor
        for command in commands:
            assert producer.try_push_record(C.encode_command(*command))
        executor.apply(cs, cs.segment.peek(len(commands)))  # the lost daemon applied (and journaled) them all
        armings = ArmingsAtStart(wheel)  # the rebuilt arena at start: every group
        for slot in wheel.expire(1150):  # "a" fires, another member has it acknowledged
            wheel.release(slot, wheel.fired(slot)[5])
        cs.replay_guard = armings
        cs.replay_left = len(commands) if whole_range else 1
        assert executor.apply_ring(cs, 2) == 2
        assert executor.apply_ring(cs, 2) == 2
        pending = _pending(wheel)
        if not whole_range:  # what this guards against: the second chunk arms "a" again
            assert "a" in pending
            return
        assert pending == {"x": 9000, "y": 9000}
        assert cs.replay_guard is None


@pytest.mark.parametrize("handed_back", [True, False], ids=["handed-back", "unguarded"])
def test_a_ring_handed_back_to_a_rebuilt_arena_without_a_replay_guards_its_first_chunk(handed_back):
    """A client offers no replay once more than a ring's worth was pushed since its last
    acknowledged flush: the daemon that rebuilt the arena takes its ring from the head the
    lost daemon published (docs/contracts.md, "Sessions"). That daemon, killed after it
    applied and journaled a chunk and before it published the head past it, left the
    chunk in the ring, and the arena rebuilt from the journal holds its armings: one that
    fired and was acknowledged since must not be armed again (``ClientTable.add``,
    ``handed_back``: the first chunk is guarded, as for every slot a restarted daemon
    finds)."""
    k = {name: encode_key(name) for name in "xa"}
    commands = [(C.ADD, *k["x"], 9000, 1), (C.ADD, *k["a"], 1100, 2), (C.FLUSH, b"", 0, 0, 3)]
    with ring_executor(16) as r:
        wheel, cs, producer, executor = r.wheel, r.cs, r.producer, r.executor
        for command in commands:
            assert producer.try_push_record(C.encode_command(*command))
        executor.apply(cs, cs.segment.peek(len(commands)))  # applied and journaled; the head not published
        table = ClientTable(Config(), {})
        table.armings_at_start = ArmingsAtStart(wheel)  # the arena rebuilt from that journal, at start
        for slot in wheel.expire(1150):  # "a" fires, another member has it acknowledged
            wheel.release(slot, wheel.fired(slot)[5])
        table.add(cs, handed_back=handed_back)
        assert executor.apply_ring(cs) == len(commands)
        pending = _pending(wheel)
        if not handed_back:  # what this guards against: "a" armed a second time
            assert "a" in pending
            return
        assert pending == {"x": 9000}
        assert cs.replay_guard is None, "the guard covers the first chunk only"
        assert producer.try_push_record(C.encode_command(C.ADD, *k["a"], 7000, 4))
        assert executor.apply_ring(cs) == 1
        assert _pending(wheel) == {"x": 9000, "a": 7000}


class Killed(BaseException):
    """The daemon killed between applying a chunk and journaling it."""


@pytest.mark.parametrize("planned", [False, True], ids=["in-order", "planned"])
def test_an_ack_applied_and_not_journaled_leaves_its_restored_copy_to_the_client_that_pushed_it(
        tmp_path, monkeypatch, planned):
    """Simulation seed 57545: a worker acknowledged two expirations and armed new keys in one
    chunk; the daemon applied it (the ACKs freed the fired records, the ADDs took their slots)
    and was killed before journaling it. The next daemon restored the fired records from the
    journal as new records with no recipient: they went to another member of the group at
    once, which handed them a second time. Restored after a crash inside that client's chunk,
    they name the client as their recipient: the restarted daemon holds them for it
    (``DaemonCore._redeliver_fired``), and its library acknowledges a copy of what it took
    in without handing it again. The ACK the ring applies again does not release them: it
    names the freed record's generation."""
    monkeypatch.setattr(E, "BATCH_MIN", 1 if planned else None)
    start = clock.mono_ms()
    with ring_executor(16, start_ms=start) as r:
        wheel, cs, producer, executor = r.wheel, r.cs, r.producer, r.executor
        journal = Journal(tmp_path / "journal", fsync="always", host="sim", name="test")
        try:
            recorder = executor.recorder = Recorder(journal, wheel)
            k = {name: encode_key(name) for name in "xy"}
            assert producer.try_push_record(C.encode_command(C.ADD, *k["x"], start + 5, 1))
            assert executor.apply_ring(cs) == 1
            # "x" fires; the daemon journals the fire and sends it to the client, its recipient
            recorder.begin()
            (slot,) = wheel.expire(start + 5)
            key, deadline, gid, tag, _aux, gen = wheel.fired(slot)
            recorder.fired(gid, key, deadline, tag, start + 5, False, None)
            recorder.commit(start + 5)
            wheel.mark_fired([slot], AL.recipient_aux(cs.slot))
            # the client acknowledges it and arms "y"; the daemon is killed before the journal has them
            assert producer.try_push_record(C.encode_ack(slot, gen, executor.arena_epoch))
            assert producer.try_push_record(C.encode_command(C.ADD, *k["y"], start + 60_000, 2))

            def killed(now_ms):
                raise Killed

            monkeypatch.setattr(recorder, "commit", killed)
            with pytest.raises(Killed):
                executor.apply_ring(cs)
            assert wheel.lookup("y", gid) is not None and wheel.fired_slots() == []
            assert AL.journal_open_ring(wheel.header_words()[AL.H_JOURNAL_OPEN // 8]) == cs.slot
        finally:
            journal.close()
        # the next daemon attaches the arena and settles it from the journal
        result = reconcile(wheel, str(tmp_path / "journal"), "test")
        assert result.trusted and result.batch_open and result.restored == 1
        assert wheel.lookup("y", gid) is None  # not journaled: freed, the ring arms it again
        (restored,) = wheel.fired_slots()
        assert wheel.fired(restored)[0] == "x" and wheel.fired(restored)[2:4] == (gid, tag)
        assert AL.recipient_of(wheel.fired(restored)[4]) == cs.slot, "restored with no recipient: to the group"
        # the client hands its ring back: the chunk is applied again, its ACK names the old record
        executor.recorder = None
        assert executor.apply_ring(cs) == 2
        assert wheel.fired_slots() == [restored] and wheel.lookup("y", gid) == start + 60_000
