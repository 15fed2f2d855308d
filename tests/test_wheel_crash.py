"""Crash consistency of the wheel: a writer SIGKILLed at random points, hundreds of times.

Each round forks a writer that attaches the named arena (which repairs and
rebuilds it) and performs random operations (new timers, re-arms, cancels,
``expire`` with a moving fake clock, releases, re-arms of fired timers,
registering and forgetting group names; half the writers also use the batch
methods ``schedule_many``, ``cancel_many``, ``expire_many`` and
``release_many``). Timers are spread over three groups (each key belongs to
one, ``group_of``); temporary names come and go in the other ids. It
writes ``B <op>`` to a pipe before each operation and ``E <result>`` after it.
The writer is then killed with SIGKILL, in one of two ways:

* after a random sleep of the parent (lands anywhere, attach included);
* by itself, from a ``sys.settrace`` hook armed at a random operation (or the
  attach) that counts line events inside ``shm/wheel.py`` and its rooms
  (``shm/wheel_*.py``) and SIGKILLs at a
  random count: this lands between any two lines of the wheel, e.g. between the
  two stores that link a record, or between a batch's field writes and its
  state bytes. A compiled module has no lines to trace, so this writer runs the
  wheel's Python source (``tests/python_source.py``); the writers killed after a
  random sleep run the path the process selected (the compiled one unless
  ``WHEELD_PURE_PYTHON=1``), where a kill lands at any instruction.

The parent keeps a model of the arena (slot, generation, deadline, tag of every
scheduled and fired timer, the group table, and the clock). After each kill it
replays the operations the log shows as finished, attaches the arena itself and
requires: ``check()`` finds nothing wrong (it recounts the per-group live
counts too); the live counts per group are those of the model's timers; every
finished operation's effect is there, nothing lost, nothing extra; the one
operation in flight either happened or did not (an in-flight ``expire`` may
have fired any subset of the due timers, but only after it moved the clock; a
group name is registered whole or not at all, an id forgotten or not, and an
unused id keeps no leftover bytes after the attach). The observed state then
becomes the model for the next round.

A ``slow`` variant (``make test-long``) runs ten times as many kills.
"""

from __future__ import annotations

import ast
import fcntl
import mmap
import os
import random
import select
import signal
import struct
import sys
import time
import uuid
import zlib

import pytest

from wheeld.protocol import arena_layout as L
from wheeld.protocol.errors import ArenaFull, CorruptArena, GroupLimit
from wheeld.shm import TimerWheel
from wheeld.shm.arena import Segment, unlink
from wheeld.shm.check import recover_copy
from wheeld.shm.fsck import fsck
from wheeld.shm import wheel_attach, wheel_batch, wheel_groups
from wheeld.shm.wheel import encode_ident

from python_source import load as load_source

wheel_module = load_source("wheeld.shm.wheel")  # the traced writers run the source (see above)
#: the files whose lines a traced writer counts: wheel.py and its rooms (every module that writes the arena)
WHEEL_FILES = frozenset([wheel_module.__file__] + [m.__file__ for m in (wheel_attach, wheel_batch, wheel_groups)])

# The writers are forked children that attach to the arena, run the wheel's code and are
# SIGKILLed; they touch no lock another thread of the test process may hold (pytest's
# timeout and xdist threads), so Python 3.12's warning about fork() in a multi-threaded
# process (one per writer: ~1,800 a run) says nothing here.
pytestmark = pytest.mark.filterwarnings(
    "ignore:This process .* is multi-threaded, use of fork\\(\\) may lead to deadlocks:DeprecationWarning")

CAPACITY = 48
SHAPE = {"tick_ms": 1, "wheel_size": 4, "levels": 3}  # 64 ms range: cascades and clamping all the time
KEYS = [f"k{i}" for i in range(40)] + list(range(-5, 5)) + [b"b%d" % i for i in range(10)]
OPS_PER_TRACED_WRITER = 60  # the trace kill is armed within the first 31 operations
OPS_PER_WRITER = 5000  # a sleep kill must find the writer busy even on a loaded machine
MAX_GROUPS = 6  # ids 0-2: the timers' groups; 3-5: temporary names (four of them: GroupLimit happens)
TIMER_GROUPS = ("default", "g1", "g2")
TEMP_NAMES = ("t0", "t1", "t2", "t3")


def group_of(key) -> int:
    """The group id a key's timer lives in (keys stay unique across the model)."""
    return zlib.crc32(repr(key).encode()) % len(TIMER_GROUPS)


def create_arena(name: str, capacity: int) -> TimerWheel:
    wheel = TimerWheel.create(capacity, name=name, start_ms=1000, max_groups=MAX_GROUPS, **SHAPE)
    assert [wheel.group_id(g) for g in TIMER_GROUPS] == [0, 1, 2]
    return wheel


# ----------------------------------------------------------------------------- the writer
def writer(name: str, seed: int, log_fd: int, trace_target: tuple[int, int] | None) -> None:
    """Runs in the forked child; never returns (os._exit or SIGKILL).

    ``trace_target``: (operation number, line count): SIGKILL at that many line
    events inside the wheel's modules (WHEEL_FILES), counted inside operations (between their B and E
    log lines) from that operation on; operation -1 is the attach.
    """
    rng = random.Random(seed)
    kill_op, kill_line = trace_target if trace_target is not None else (None, 0)
    in_operation = [kill_op == -1]

    def log(line: str) -> None:
        os.write(log_fd, (line + "\n").encode())
        in_operation[0] = line.startswith("B ")  # the writer's own reads between operations do not count

    if trace_target is not None:
        count = [0]

        def local(frame, event, arg):
            if event == "line" and in_operation[0]:
                count[0] += 1
                if count[0] >= kill_line:
                    os.kill(os.getpid(), signal.SIGKILL)
            return local

        def global_trace(frame, event, arg):
            return local if frame.f_code.co_filename in WHEEL_FILES else None

    if kill_op == -1:
        sys.settrace(global_trace)
    wheel = (TimerWheel if trace_target is None else wheel_module.TimerWheel).attach(name)
    log("ATTACHED")
    now = wheel.current_ms
    batches = rng.random() < 0.5  # half the writers use the *_many batch methods
    for op_number in range(OPS_PER_WRITER if trace_target is None else OPS_PER_TRACED_WRITER):
        if op_number == kill_op:
            sys.settrace(global_trace)
        r = rng.random()
        crowded = wheel.free_slots < CAPACITY // 3 and wheel.fired_slots() and rng.random() < 0.6
        if crowded:  # release fired timers, or the writer soon only meets a full arena
            r = 0.8
        if batches and (r < 0.75 or crowded):
            batch_op(wheel, rng, log, r, now, crowded)
            now = wheel.current_ms
            continue
        if rng.random() < 0.06:  # the group table
            if rng.random() < 0.5:
                name = rng.choice(TEMP_NAMES)
                log(f"B {('G', name)!r}")
                try:
                    log(f"E {wheel.group_id(name)!r}")
                except GroupLimit:
                    log("E 'limit'")
            else:
                gid = rng.randrange(MAX_GROUPS)
                log(f"B {('F', gid)!r}")
                log(f"E {wheel.forget_group(gid)!r}")
            continue
        if r < 0.40:
            key = rng.choice(KEYS)
            delta = rng.choice((rng.randint(-2, 5), rng.randint(0, 100), rng.randint(0, 10_000)))
            tag = rng.getrandbits(32)
            log(f"B {('S', key, now + delta, tag)!r}")
            try:
                slot, gen = wheel.schedule(key, now + delta, group=group_of(key), tag=tag)
                log(f"E {(slot, gen)!r}")
            except ArenaFull:
                log("E 'full'")
        elif r < 0.55:
            key = rng.choice(KEYS)
            log(f"B {('C', key)!r}")
            log(f"E {wheel.cancel(key, group=group_of(key))!r}")
        elif r < 0.75:
            now += rng.choice((0, 1, rng.randint(1, 20), rng.randint(1, 200), 5_000))
            log(f"B {('X', now)!r}")
            log(f"E {wheel.expire(now)!r}")
        else:
            fired = wheel.fired_slots()
            if not fired:
                continue
            slot = rng.choice(fired)
            gen = wheel.fired(slot)[5] + (1 if rng.random() < 0.1 else 0)  # sometimes a stale handle
            if r < 0.9:
                log(f"B {('R', slot, gen)!r}")
                log(f"E {wheel.release(slot, gen)!r}")
            else:
                deadline = now + rng.randint(-2, 300)
                log(f"B {('A', slot, gen, deadline)!r}")
                log(f"E {wheel.rearm_fired(slot, gen, deadline)!r}")
    sys.settrace(None)
    log("DONE")


def batch_op(wheel: TimerWheel, rng: random.Random, log, r: float, now: int, release: bool) -> None:
    """One batch operation of 1-20 items; results logged per item."""
    if r < 0.40:
        keys = rng.sample(KEYS, rng.randint(1, 20))
        items = [(k, now + rng.choice((rng.randint(-2, 5), rng.randint(0, 100), rng.randint(0, 10_000))),
                  rng.getrandbits(32)) for k in keys]
        log(f"B {('SM', items)!r}")
        slots, gens = wheel.schedule_many([encode_ident(k) for k, _d, _t in items],
                                          [d for _k, d, _t in items], [group_of(k) for k, _d, _t in items],
                                          tags=[t for *_x, t in items])
        log(f"E {[(int(s), int(g)) if s >= 0 else 'full' for s, g in zip(slots, gens)]!r}")
    elif r < 0.55:
        keys = rng.sample(KEYS, rng.randint(1, 20))
        log(f"B {('CM', keys)!r}")
        log(f"E {wheel.cancel_many([encode_ident(k) for k in keys], [group_of(k) for k in keys]).tolist()!r}")
    else:
        fired = wheel.fired_slots()
        if fired and (release or rng.random() < 0.4):
            picks = [rng.choice(fired) for _ in range(rng.randint(1, 10))]
            gens = [int(wheel.records["gen"][s]) + (1 if rng.random() < 0.1 else 0) for s in picks]
            log(f"B {('RM', picks, gens)!r}")
            log(f"E {wheel.release_many(picks, gens).tolist()!r}")
        else:
            now += rng.choice((0, 1, rng.randint(1, 20), rng.randint(1, 200), 5_000))
            log(f"B {('XM', now)!r}")
            log(f"E {wheel.expire_many(now).tolist()!r}")


# ----------------------------------------------------------------------------- the model
class Model:
    """sched: key -> (deadline, slot, gen, tag); fired: slot -> (key, deadline, gen, tag); now;
    groups: the group table, id -> name."""

    def __init__(self, now: int) -> None:
        self.sched: dict = {}
        self.fired: dict = {}
        self.now = now
        self.groups: dict[int, str] = dict(enumerate(TIMER_GROUPS))

    def copy(self) -> Model:
        m = Model(self.now)
        m.sched = dict(self.sched)
        m.fired = dict(self.fired)
        m.groups = dict(self.groups)
        return m

    def slots_in_use(self) -> set[int]:
        return {v[1] for v in self.sched.values()} | set(self.fired)

    def live(self) -> list[int]:
        """Scheduled + fired timers per group id."""
        out = [0] * MAX_GROUPS
        for key in self.sched:
            out[group_of(key)] += 1
        for key, *_rest in self.fired.values():
            out[group_of(key)] += 1
        return out

    def registered(self, name: str) -> int | None:
        """The id ``group_id(name)`` returns: the registered one, else the lowest free one
        (no name, no live timer), else None (GroupLimit)."""
        for gid, n in self.groups.items():
            if n == name:
                return gid
        live = self.live()
        return next((g for g in range(MAX_GROUPS) if g not in self.groups and not live[g]), None)

    def forgettable(self, gid: int) -> bool:
        return gid != 0 and gid in self.groups and not self.live()[gid]

    def apply(self, op: tuple, result) -> None:
        """A finished operation: check its result against the model, then apply it."""
        kind = op[0]
        if kind == "SM":  # a batch means its items one after the other
            for (key, deadline, tag), one in zip(op[1], result, strict=True):
                self.apply(("S", key, deadline, tag), one)
        elif kind == "CM":
            for key, one in zip(op[1], result, strict=True):
                self.apply(("C", key), one)
        elif kind == "RM":
            for slot, gen, one in zip(op[1], op[2], result, strict=True):
                self.apply(("R", slot, gen), one)
        elif kind == "XM":
            self.apply(("X", op[1]), result)
        elif kind == "G":
            gid = self.registered(op[1])
            assert result == ("limit" if gid is None else gid), (op, result, self.groups)
            if gid is not None:
                self.groups[gid] = op[1]
        elif kind == "F":
            assert result is self.forgettable(op[1]), (op, result, self.groups)
            if result:
                del self.groups[op[1]]
        elif kind == "S":
            _, key, deadline, tag = op
            if result == "full":
                assert key not in self.sched and len(self.sched) + len(self.fired) == CAPACITY
                return
            slot, gen = result
            if key in self.sched:
                assert self.sched[key][1:3] == (slot, gen), "a re-arm must keep its record"
            else:
                assert len(self.sched) + len(self.fired) < CAPACITY
                assert slot not in self.slots_in_use()
            self.sched[key] = (deadline, slot, gen, tag)
        elif kind == "C":
            assert result is (op[1] in self.sched)
            self.sched.pop(op[1], None)
        elif kind == "X":
            now = op[1]
            due = {key for key, v in self.sched.items() if v[0] <= now}
            assert sorted(result) == sorted(self.sched[key][1] for key in due), "expired set != due set"
            for key in due:
                deadline, slot, gen, tag = self.sched.pop(key)
                self.fired[slot] = (key, deadline, gen, tag)
            self.now = max(self.now, now)
        elif kind == "R":
            _, slot, gen = op
            ok = slot in self.fired and self.fired[slot][2] == gen
            assert result is ok
            if ok:
                del self.fired[slot]
        elif kind == "A":
            _, slot, gen, deadline = op
            ok = slot in self.fired and self.fired[slot][2] == gen and self.fired[slot][0] not in self.sched
            assert result is ok
            if ok:
                key, _old, gen, tag = self.fired.pop(slot)
                self.sched[key] = (deadline, slot, gen, tag)
        else:  # pragma: no cover - a log line this test does not write
            raise AssertionError(op)


def observe(wheel: TimerWheel) -> Model:
    """The wheel's state as a model; the per-group live counts must be the timers' (by group)."""
    m = Model(wheel.current_ms)
    states = wheel.records["state"] & L.STATE_MASK
    for slot in range(wheel.first_entry, wheel.n_records):
        st = int(states[slot])
        if st == L.FREE:
            continue
        key, deadline, group, tag, _aux, gen = wheel._entry(slot)
        assert group == group_of(key), f"{key!r} in group {group}"
        if st == L.SCHEDULED:
            assert key not in m.sched, f"key {key!r} scheduled twice"
            m.sched[key] = (deadline, slot, gen, tag)
        else:
            m.fired[slot] = (key, deadline, gen, tag)
    m.groups = wheel.groups()
    assert wheel.group_counts().tolist() == m.live()
    table = bytes(wheel._seg.buf[L.GROUPS_OFFSET : L.GROUPS_OFFSET + wheel.max_groups * L.GROUP_NAME_BYTES])
    for gid in range(wheel.max_groups):
        entry = table[gid * L.GROUP_NAME_BYTES : (gid + 1) * L.GROUP_NAME_BYTES]
        assert entry[0] or entry == bytes(L.GROUP_NAME_BYTES), f"unused group id {gid} keeps bytes {entry!r}"
    return m


def restrict(seen: Model, key, before: Model) -> Model:
    """``before`` with the scheduled timer ``key`` as ``seen`` has it."""
    m = before.copy()
    m.sched.pop(key, None)
    if key in seen.sched:
        m.sched[key] = seen.sched[key]
    return m


def without(d: dict, key) -> dict:
    return {k: v for k, v in d.items() if k != key}


def verify_inflight(before: Model, op: tuple | None, seen: Model) -> None:
    """``seen`` must be ``before`` with ``op`` (the operation in flight) applied or not.

    A batch in flight: each of its items applied or not, any subset.
    """
    if op is not None and op[0] in ("G", "F"):  # the group table changes, or not; nothing else does
        assert (seen.sched, seen.fired, seen.now) == (before.sched, before.fired, before.now)
        after = dict(before.groups)
        if op[0] == "G" and before.registered(op[1]) is not None:
            after[before.registered(op[1])] = op[1]
        elif op[0] == "F" and before.forgettable(op[1]):
            del after[op[1]]
        assert seen.groups in (before.groups, after), (op, before.groups, seen.groups)
        return
    assert seen.groups == before.groups, "the group table changed"
    if op is not None and op[0] in ("SM", "CM"):
        keys = {item[0] for item in op[1]} if op[0] == "SM" else set(op[1])
        assert seen.fired == before.fired and seen.now == before.now
        assert {k: v for k, v in seen.sched.items() if k not in keys} == {
            k: v for k, v in before.sched.items() if k not in keys}
        for item in op[1]:
            if op[0] == "SM":
                verify_inflight(before, ("S", *item), restrict(seen, item[0], before))
            else:
                verify_inflight(before, ("C", item), restrict(seen, item, before))
        return
    if op is not None and op[0] == "RM":
        assert seen.sched == before.sched and seen.now == before.now
        gone = set(before.fired) - set(seen.fired)
        assert set(seen.fired) <= set(before.fired) and all(seen.fired[s] == before.fired[s] for s in seen.fired)
        assert all(s in op[1] and before.fired[s][2] in op[2] for s in gone)
        return
    if op is not None and op[0] == "CA":  # moves the clock (nothing is due), then only links and levels
        assert (seen.sched, seen.fired) == (before.sched, before.fired)
        assert seen.now in (before.now, op[1])
        return
    if op is not None and op[0] == "XM":
        op = ("X", op[1])
    if op is None:
        assert (seen.sched, seen.fired, seen.now) == (before.sched, before.fired, before.now)
        return
    kind = op[0]
    if kind == "S":
        _, key, deadline, tag = op
        assert seen.fired == before.fired and seen.now == before.now
        assert without(seen.sched, key) == without(before.sched, key)
        got, old = seen.sched.get(key), before.sched.get(key)
        if got != old:  # it happened: the new deadline and tag; a re-arm keeps slot and generation
            assert got is not None and got[0] == deadline and got[3] == tag, (got, op)
            if old is not None:
                assert got[1:3] == old[1:3]
            else:
                assert got[1] not in before.slots_in_use()
    elif kind == "C":
        assert seen.fired == before.fired and seen.now == before.now
        assert without(seen.sched, op[1]) == without(before.sched, op[1])
        assert seen.sched.get(op[1]) in (None, before.sched.get(op[1]))
    elif kind == "X":
        now = op[1]
        if seen.now == before.now != now:  # the clock is stored before any timer is fired
            assert (seen.sched, seen.fired) == (before.sched, before.fired)
            return
        assert seen.now == now, (seen.now, before.now, now)
        moved = {}
        for key, (deadline, slot, gen, tag) in before.sched.items():
            if seen.sched.get(key) == (deadline, slot, gen, tag):
                continue
            assert key not in seen.sched, f"{key!r} changed by an expire"
            assert deadline <= now, f"{key!r} (deadline {deadline}) fired early at {now}"
            moved[slot] = (key, deadline, gen, tag)
        assert len(seen.sched) == len(before.sched) - len(moved)
        assert seen.fired == {**before.fired, **moved}, "timer lost or invented by an expire"
    elif kind == "R":
        assert seen.sched == before.sched and seen.now == before.now
        assert seen.fired in (before.fired, without(before.fired, op[1]))
    elif kind == "A":
        _, slot, gen, deadline = op
        assert seen.now == before.now
        if (seen.sched, seen.fired) != (before.sched, before.fired):
            key, _old, fgen, tag = before.fired[slot]
            assert fgen == gen and key not in before.sched
            assert seen.fired == without(before.fired, slot)
            assert seen.sched == {**before.sched, key: (deadline, slot, gen, tag)}
    else:  # pragma: no cover
        raise AssertionError(op)


# ----------------------------------------------------------------------------- the rounds
def wait_for_attached(fd: int, pid: int) -> bytes:
    """Read the log until the writer says it attached (or 10 s pass); return what was read."""
    data = b""
    deadline = time.monotonic() + 10
    while b"ATTACHED\n" not in data and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            data += chunk
    return data


def read_log(fd: int, head: bytes = b"") -> list[str]:
    chunks = [head]
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    text = b"".join(chunks).decode()
    return text.split("\n")[:-1]  # a torn last line cannot happen: each line is one write


def run_round(name: str, model: Model, seed: int, mode: str) -> tuple[Model, str]:
    rng = random.Random(seed)
    trace_target = None
    if mode == "trace":  # an operation, then a line inside it (or in the ones after it)
        kill_op = -1 if rng.random() < 0.1 else rng.randint(0, 30)
        trace_target = (kill_op, rng.randint(1, 100) if rng.random() < 0.8 else rng.randint(1, 2000))
    read_fd, write_fd = os.pipe()
    fcntl.fcntl(write_fd, fcntl.F_SETPIPE_SZ, 1 << 20)
    pid = os.fork()
    if pid == 0:  # child
        code = 1
        try:
            os.close(read_fd)
            writer(name, seed, write_fd, trace_target)
            code = 0
        finally:
            os._exit(code)
    os.close(write_fd)
    head = b""
    try:
        if mode == "sleep":
            if rng.random() < 0.8:  # mostly aim at the operations, sometimes at the attach
                head = wait_for_attached(read_fd, pid)
                time.sleep(rng.uniform(0, 0.004))  # a random kill point: the subject
            else:
                time.sleep(rng.uniform(0, 0.012))  # a random kill point: the subject
        else:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # the child kills itself (or finishes)
                done, _status = os.waitpid(pid, os.WNOHANG)
                if done:
                    break
                time.sleep(0.0005)  # poll interval: the child kills itself at its line
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        lines = read_log(read_fd, head)
    finally:
        os.close(read_fd)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass

    # replay the finished operations, keep the one in flight
    inflight = None
    expected = model.copy()
    for line in lines:
        if line in ("ATTACHED", "DONE"):
            continue
        kind, _, text = line.partition(" ")
        value = ast.literal_eval(text)
        if kind == "B":
            assert inflight is None
            inflight = value
        else:
            expected.apply(inflight, value)
            inflight = None
    wheel = TimerWheel.attach(name)
    try:
        assert wheel.repairs == []
        assert wheel.check() == []
        seen = observe(wheel)
    finally:
        wheel.close()
    verify_inflight(expected, inflight, seen)
    outcome = "done" if lines and lines[-1] == "DONE" else ("inflight" if inflight else "between")
    return seen, outcome


@pytest.fixture
def arena_name():
    name = f"/wheeld-test-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    try:
        yield name
    finally:
        unlink(name)


#: the rounds of the random-kill test (``make test-fast`` runs fewer)
ROUNDS = int(os.environ.get("WHEELD_CRASH_ROUNDS", 150))
#: kill after every STRIDE-th line in the systematic sweep: 1 (every line) unless the edit-test
#: loop (``make test-fast``) asks for a coarser sweep; ``make test`` sweeps every line
STRIDE = max(1, int(os.environ.get("WHEELD_CRASH_STRIDE", 1)))


@pytest.mark.parametrize("rounds", [ROUNDS, pytest.param(1500, marks=pytest.mark.slow)])
@pytest.mark.parametrize("mode", ["trace", "sleep"])
def test_writer_killed_at_random_points(arena_name, mode, rounds):
    base_seed = int(os.environ.get("WHEELD_CRASH_SEED", random.randrange(1 << 30)))  # to replay a failure
    create_arena(arena_name, CAPACITY).close()
    model = Model(1000)
    outcomes: dict[str, int] = {}
    for n in range(rounds):
        seed = base_seed + n
        try:
            model, outcome = run_round(arena_name, model, seed, mode)
        except AssertionError as exc:
            raise AssertionError(f"round {n} (base seed {base_seed}, mode {mode}): {exc}") from exc
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    # the kills must mostly land inside operations, or this test proves little
    assert outcomes.get("inflight", 0) >= rounds // (2 if mode == "trace" else 10), outcomes


# ----------------------------------------------------------------------------- every line, systematically
def _schedule(wheel: TimerWheel, key, deadline: int, tag: int):
    return wheel.schedule(key, deadline, group=group_of(key), tag=tag)


def _sweep_setup(wheel: TimerWheel) -> None:
    """A fixed arena: timers on several levels and in three groups, some due, some
    fired; a temporary group name ``t0`` (id 3) without timers."""
    for n in range(12):
        _schedule(wheel, f"k{n}", 1000 + [1, 3, 5, 20, 70, 300, 2_000, 9_000][n % 8] + n, tag=n)
    wheel.expire(1003)  # k0, k1 fired
    assert wheel.group_id("t0") == 3


def _sweep_setup_whole_buckets(wheel: TimerWheel) -> None:
    """``_sweep_setup`` plus full level-0 buckets and a due list: ``expire_many(1006)``
    then moves only whole chains (three buckets) to the fired list."""
    _sweep_setup(wheel)
    for n in range(5):
        _schedule(wheel, f"w{n}", 1005, tag=n)  # one level-0 bucket
        _schedule(wheel, f"x{n}", 1006, tag=n)  # the next one
    _schedule(wheel, "d0", 1002, tag=1)  # due already: the due list
    _schedule(wheel, "d1", 1003, tag=2)


def _sweep_setup_next_level1_bucket(wheel: TimerWheel) -> None:
    """``_sweep_setup`` without k1 (nothing due before 1007; clock 1003) plus timers of
    the level-1 bucket [1008, 1012): ``cascade_ahead(1005)`` moves the clock to 1005,
    where that bucket comes due next and level 0 reaches 1009: it moves those due
    by 1009 to level 0 and leaves the 1010-1011 ones where they are."""
    _sweep_setup(wheel)
    wheel.cancel("k1", group=group_of("k1"))  # due at 1004: the clock could not move
    for n, deadline in enumerate((1008, 1009, 1011, 1009, 1010, 1008, 1011, 1009)):
        _schedule(wheel, f"c{n}", deadline, tag=n)


SWEEP_SETUPS = {"expire_many whole buckets": _sweep_setup_whole_buckets,
                "cascade_ahead": _sweep_setup_next_level1_bucket}

SWEEP_OPS = {  # name -> (operation description for verify_inflight, call)
    "schedule new": (("S", "n1", 1010, 7), lambda w: _schedule(w, "n1", 1010, tag=7)),
    "schedule re-arm": (("S", "k5", 1001, 9), lambda w: _schedule(w, "k5", 1001, tag=9)),
    "cancel": (("C", "k6"), lambda w: w.cancel("k6", group=group_of("k6"))),
    "expire": (("X", 1400), lambda w: w.expire(1400)),
    "schedule_many": (
        ("SM", [("k3", 1500, 1), ("k4", 1004, 2), ("n2", 1006, 3), ("n3", 5000, 4), ("k7", 999, 5)]),
        lambda w: w.schedule_many([encode_ident(k) for k in ("k3", "k4", "n2", "n3", "k7")],
                                  [1500, 1004, 1006, 5000, 999], [group_of(k) for k in ("k3", "k4", "n2", "n3", "k7")],
                                  tags=[1, 2, 3, 4, 5]),
    ),
    "cancel_many": (
        ("CM", ["k2", "k3", "k4", "k10", "zz"]),
        lambda w: w.cancel_many([encode_ident(k) for k in ("k2", "k3", "k4", "k10", "zz")],
                                [group_of(k) for k in ("k2", "k3", "k4", "k10", "zz")]),
    ),
    "group_id new": (("G", "t1"), lambda w: w.group_id("t1")),
    "forget_group": (("F", 3), lambda w: w.forget_group(3)),
    "expire_many": (("XM", 1400), lambda w: w.expire_many(1400)),
    "expire_many whole buckets": (("XM", 1006), lambda w: w.expire_many(1006)),
    "cascade_ahead": (("CA", 1005), lambda w: w.cascade_ahead(1005, 5)),
}


def _run_killed(name: str, call, kill_line: int) -> bool:
    """Fork a writer that attaches and runs ``call``, SIGKILLed at ``kill_line`` line
    events of the wheel's modules (WHEEL_FILES) inside the call; True if the call finished first."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_fd)
            wheel = wheel_module.TimerWheel.attach(name)  # the source: its lines are traced
            count = [0]

            def local(frame, event, arg):
                if event == "line":
                    count[0] += 1
                    if count[0] >= kill_line:
                        os.kill(os.getpid(), signal.SIGKILL)
                return local

            sys.settrace(lambda frame, event, arg: local if frame.f_code.co_filename in WHEEL_FILES else None)
            call(wheel)
            sys.settrace(None)
            os.write(write_fd, b"E")
        finally:
            os._exit(0)
    os.close(write_fd)
    try:
        finished = _read_all(read_fd) == b"E"
    finally:
        os.close(read_fd)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
    return finished


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 4096):
        chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.parametrize("operation", sorted(SWEEP_OPS))
def test_kill_at_every_line_of_an_operation(arena_name, operation):
    """From the same arena each time, kill the writer after 1, 2, 3, ... lines of the
    operation until it completes: every intermediate state must attach cleanly and be
    the state before or after the operation (a batch: each item before or after)."""
    wheel = create_arena(arena_name, 32)
    SWEEP_SETUPS.get(operation, _sweep_setup)(wheel)
    wheel.close()
    attached = TimerWheel.attach(arena_name)
    before = observe(attached)
    snapshot = bytes(attached._seg.buf)
    attached.close()
    description, call = SWEEP_OPS[operation]
    if operation == "cascade_ahead":  # the sweep's call has work to do (crashes can land mid-move)
        wheel = TimerWheel.attach(arena_name)
        try:
            level1 = wheel._pending_by_level[1]
            moved = call(wheel)
            assert moved >= 1 and wheel._pending_by_level[1] == level1 - moved and wheel.check() == []
        finally:
            wheel.close()
    kills = open_batch_intents = torn_names = 0
    for kill_line in range(1, 5000, STRIDE):
        segment = Segment.attach(arena_name)
        try:
            segment.buf[:] = snapshot
        finally:
            segment.close()
        finished = _run_killed(arena_name, call, kill_line)
        open_batch_intents += _check_reports_open_batch_intent(arena_name)
        torn_names += _torn_group_entries(arena_name)
        wheel = TimerWheel.attach(arena_name)
        try:
            assert wheel.repairs == [], (kill_line, wheel.repairs)
            assert wheel.check() == [], (kill_line, wheel.check())
            seen = observe(wheel)
        finally:
            wheel.close()
        try:
            verify_inflight(before, description, seen)
        except AssertionError as exc:
            raise AssertionError(f"{operation}: killed after {kill_line} lines: {exc}") from exc
        if finished:
            if operation == "cascade_ahead":  # no timer changes: the clock did, and the call moved some
                assert seen.now == 1005, operation
            elif description[0] in ("G", "F"):
                assert seen.groups != before.groups, operation
            else:
                assert (seen.sched, seen.fired) != (before.sched, before.fired) or operation == "cancel_many", operation
            break
        kills += 1
    else:
        raise AssertionError(f"{operation} did not finish within 5000 lines")
    least = (5 if description[0] in ("G", "F") else 10) // STRIDE
    assert kills >= least, f"{operation}: only {kills} kill points"
    if STRIDE > 1:  # a coarse sweep may step over the few lines below
        return
    if operation == "schedule_many":  # it re-arms three keys: a batch intent must have been caught open
        assert open_batch_intents >= 1
    if description[0] in ("G", "F"):  # a kill landed between the first byte and the rest of a name
        assert torn_names >= 1


def _torn_group_entries(name: str) -> int:
    """Group table entries of the arena as the killed writer left it (before an attach
    clears them) that are unused (first byte 0) yet hold other bytes."""
    segment = Segment.attach(name, readonly=True)
    try:
        max_groups = struct.unpack_from("<I", segment.buf, L.H_MAX_GROUPS)[0]
        table = bytes(segment.buf[L.GROUPS_OFFSET : L.GROUPS_OFFSET + max_groups * L.GROUP_NAME_BYTES])
    finally:
        segment.close()
    entries = [table[g * L.GROUP_NAME_BYTES : (g + 1) * L.GROUP_NAME_BYTES] for g in range(max_groups)]
    return sum(1 for e in entries if not e[0] and any(e))


def _check_reports_open_batch_intent(name: str) -> int:
    """The arena as the killed writer left it (before any attach replays it), checked the
    way ``wheelctl check`` does, on a private copy: an open batch intent is reported
    with its size, and the recovery of the copy replays it and leaves a sound arena.
    1 if a batch intent was open, else 0."""
    segment = Segment.attach(name, readonly=True)
    try:
        size = segment.size
        image = bytes(segment.buf[:size])
    finally:
        segment.close()
    count = struct.unpack_from("<I", image, L.H_INTENT_COUNT)[0]
    if not count:
        return 0
    copy = mmap.mmap(-1, size)
    try:
        copy[:] = image
        assert f"a batch intent of {count} re-arms is open" in "\n".join(fsck(copy, size))
        repairs, after = recover_copy(copy, size)
        assert f"batch intent of {count} re-arms replayed" in repairs and after == []
    finally:
        copy.close()
    return 1


def test_check_reports_a_batch_intent_no_writer_can_leave():
    """A batch intent count above the maximum, or naming a sentinel, is corruption: the
    checker says so and recovery refuses the arena."""
    wheel = TimerWheel.create(32, start_ms=1000, **SHAPE)
    try:
        _sweep_setup(wheel)
        wheel.publish_stats()  # the counters the checker compares with the records
        size = wheel._seg.size
        image = bytes(wheel._seg.buf[:size])
    finally:
        wheel.close()
    assert fsck(image, size) == []
    for count, slot in ((L.INTENT_BATCH_MAX + 1, None), (2, 0)):
        copy = mmap.mmap(-1, size)
        try:
            copy[:] = image
            struct.pack_into("<I", copy, L.H_INTENT_COUNT, count)
            if slot is not None:
                struct.pack_into("<i", copy, L.intent_batch_offset(L.DEFAULT_MAX_GROUPS) + L.INTENT_ENTRY.size, slot)
            problems = fsck(copy, size)
            assert any("batch intent" in p and "corrupt" in p for p in problems), problems
            with pytest.raises(CorruptArena):
                recover_copy(copy, size)
        finally:
            copy.close()
