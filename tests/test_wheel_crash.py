"""Crash consistency of the wheel: a writer SIGKILLed at random points, hundreds of times.

Each round forks a writer that attaches the named arena (which repairs and
rebuilds it) and performs random operations (new timers, re-arms, cancels,
``expire`` with a moving fake clock, releases, re-arms of fired timers). It
writes ``B <op>`` to a pipe before each operation and ``E <result>`` after it.
The writer is then killed with SIGKILL, in one of two ways:

* after a random sleep of the parent (lands anywhere, attach included);
* by itself, from a ``sys.settrace`` hook that counts line events inside
  ``shm/wheel.py`` and SIGKILLs at a random count: this lands between any two
  lines of the wheel, e.g. between the two stores that link a record.

The parent keeps a model of the arena (slot, generation, deadline, tag of every
scheduled and fired timer, and the clock). After each kill it replays the
operations the log shows as finished, attaches the arena itself and requires:
``check()`` finds nothing wrong; every finished operation's effect is there,
nothing lost, nothing extra; the one operation in flight either happened or did
not (an in-flight ``expire`` may have fired any subset of the due timers, but
only after it moved the clock). The observed state then becomes the model for
the next round.

``WHEELD_LONG=1`` runs ten times as many kills.
"""

from __future__ import annotations

import ast
import fcntl
import os
import random
import select
import signal
import sys
import time
import uuid

import pytest

import wheeld.shm.wheel as wheel_module
from wheeld.protocol import arena_layout as L
from wheeld.protocol.errors import ArenaFull
from wheeld.shm import TimerWheel
from wheeld.shm.arena import unlink

LONG = os.environ.get("WHEELD_LONG") == "1"
CAPACITY = 48
SHAPE = {"tick_ms": 1, "wheel_size": 4, "levels": 3}  # 64 ms range: cascades and clamping all the time
KEYS = [f"k{i}" for i in range(40)] + list(range(-5, 5)) + [b"b%d" % i for i in range(10)]
OPS_PER_WRITER = 400


# ----------------------------------------------------------------------------- the writer
def writer(name: str, seed: int, log_fd: int, trace_target: int | None, trace_attach: bool) -> None:
    """Runs in the forked child; never returns (os._exit or SIGKILL)."""
    rng = random.Random(seed)

    def log(line: str) -> None:
        os.write(log_fd, (line + "\n").encode())

    if trace_target is not None:
        wheel_file = wheel_module.__file__
        count = [0]

        def local(frame, event, arg):
            if event == "line":
                count[0] += 1
                if count[0] >= trace_target:
                    os.kill(os.getpid(), signal.SIGKILL)
            return local

        def global_trace(frame, event, arg):
            return local if frame.f_code.co_filename == wheel_file else None

    if trace_target is not None and trace_attach:
        sys.settrace(global_trace)
    wheel = TimerWheel.attach(name)
    log("ATTACHED")
    if trace_target is not None and not trace_attach:
        sys.settrace(global_trace)
    now = wheel.current_ms
    for _ in range(OPS_PER_WRITER):
        r = rng.random()
        if r < 0.40:
            key = rng.choice(KEYS)
            delta = rng.choice((rng.randint(-2, 5), rng.randint(0, 100), rng.randint(0, 10_000)))
            tag = rng.getrandbits(32)
            log(f"B {('S', key, now + delta, tag)!r}")
            try:
                slot, gen = wheel.schedule(key, now + delta, tag=tag)
                log(f"E {(slot, gen)!r}")
            except ArenaFull:
                log("E 'full'")
        elif r < 0.55:
            key = rng.choice(KEYS)
            log(f"B {('C', key)!r}")
            log(f"E {wheel.cancel(key)!r}")
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


# ----------------------------------------------------------------------------- the model
class Model:
    """sched: key -> (deadline, slot, gen, tag); fired: slot -> (key, deadline, gen, tag); now."""

    def __init__(self, now: int) -> None:
        self.sched: dict = {}
        self.fired: dict = {}
        self.now = now

    def copy(self) -> "Model":
        m = Model(self.now)
        m.sched = dict(self.sched)
        m.fired = dict(self.fired)
        return m

    def slots_in_use(self) -> set[int]:
        return {v[1] for v in self.sched.values()} | set(self.fired)

    def apply(self, op: tuple, result) -> None:
        """A finished operation: check its result against the model, then apply it."""
        kind = op[0]
        if kind == "S":
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
    m = Model(wheel.current_ms)
    states = wheel.records["state"] & L.STATE_MASK
    for slot in range(wheel.first_entry, wheel.n_records):
        st = int(states[slot])
        if st == L.FREE:
            continue
        key, deadline, _group, tag, _aux, gen = wheel._entry(slot)
        if st == L.SCHEDULED:
            assert key not in m.sched, f"key {key!r} scheduled twice"
            m.sched[key] = (deadline, slot, gen, tag)
        else:
            m.fired[slot] = (key, deadline, gen, tag)
    return m


def without(d: dict, key) -> dict:
    return {k: v for k, v in d.items() if k != key}


def verify_inflight(before: Model, op: tuple | None, seen: Model) -> None:
    """``seen`` must be ``before`` with ``op`` (the operation in flight) applied or not."""
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
    trace_target = rng.randint(1, 6000) if mode == "trace" else None
    trace_attach = mode == "trace" and rng.random() < 0.1
    read_fd, write_fd = os.pipe()
    fcntl.fcntl(write_fd, fcntl.F_SETPIPE_SZ, 1 << 20)
    pid = os.fork()
    if pid == 0:  # child
        code = 1
        try:
            os.close(read_fd)
            writer(name, seed, write_fd, trace_target, trace_attach)
            code = 0
        finally:
            os._exit(code)
    os.close(write_fd)
    head = b""
    try:
        if mode == "sleep":
            if rng.random() < 0.8:  # mostly aim at the operations, sometimes at the attach
                head = wait_for_attached(read_fd, pid)
                time.sleep(rng.uniform(0, 0.004))
            else:
                time.sleep(rng.uniform(0, 0.012))
        else:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # the child kills itself (or finishes)
                done, _status = os.waitpid(pid, os.WNOHANG)
                if done:
                    break
                time.sleep(0.0005)
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


@pytest.mark.parametrize("mode", ["trace", "sleep"])
def test_writer_killed_at_random_points(arena_name, mode):
    rounds = (1500 if LONG else 150)
    base_seed = int(os.environ.get("WHEELD_CRASH_SEED", random.randrange(1 << 30)))  # to replay a failure
    wheel = TimerWheel.create(CAPACITY, name=arena_name, start_ms=1000, **SHAPE)
    wheel.close()
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
    assert outcomes.get("inflight", 0) >= rounds // (2 if mode == "trace" else 4), outcomes
