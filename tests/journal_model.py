"""What the journal tests share: a fake clock, a journal on it, one event of every
type, and a reference model of what recovery must rebuild (with random histories
that drive it)."""

from __future__ import annotations

import contextlib
import os
import random
from unittest import mock

from hypothesis import Phase

from wheeld.journal.files import (
    FiredTimer,
    Journal,
    PendingTimer,
)
from wheeld.protocol.journal import (
    Ack,
    Add,
    Cancel,
    Fire,
    IdleRearm,
    Rearm,
    key_to_json,
)

T0 = 1_700_000_000_000


class FakeClock:
    """Monotonic and wall ms under the test's control."""

    def __init__(self, mono_ms: int = 1_000, wall_ms: int = T0) -> None:
        self.mono = mono_ms
        self.wall = wall_ms

    def mono_ms(self) -> int:
        return self.mono

    def wall_ms(self) -> int:
        return self.wall


# hypothesis tests: no "explain" phase (it re-parses source, slow and brittle here)
FAST_PHASES = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink]


@contextlib.contextmanager
def no_fsync():
    """Property tests check contents, not durability: skip the ~2 ms disk flushes."""
    with mock.patch.object(os, "fsync", lambda fd: None):
        yield


def make_journal(path, clock=None, **kwargs) -> Journal:
    clock = clock or FakeClock()
    kwargs.setdefault("host", "test-host")
    return Journal(path, wall_ms=clock.wall_ms, mono_ms=clock.mono_ms, **kwargs)


def one_of_each() -> list:
    return [
        Add(t=T0, g="conns", k=key_to_json("c-17"), d=T0 + 30_000, s=7, i=30_000),
        Add(t=T0 + 1, g="jobs", k=key_to_json(4711), d=T0 + 50_000, s=8),
        Rearm(t=T0 + 100, g="jobs", k=key_to_json(4711), d=T0 + 60_000, pd=T0 + 50_000, s=9),
        Add(t=T0 + 150, g="purgatory", k=key_to_json(b"\x00\x01\x02"), d=T0 + 500, s=10),
        Cancel(t=T0 + 200, g="purgatory", k=key_to_json(b"\x00\x01\x02"), s=11, hit=True, pd=T0 + 500),
        Cancel(t=T0 + 201, g="purgatory", k=key_to_json("nope"), s=12, hit=False),
        IdleRearm(t=T0 + 30_000, g="conns", k=key_to_json("c-17"), d=T0 + 41_000, pd=T0 + 30_000, s=7, i=30_000),
        Fire(t=T0 + 60_003, g="jobs", k=key_to_json(4711), d=T0 + 60_000, s=9, f=T0 + 60_003, lat=3),
        Ack(t=T0 + 60_004, g="jobs", k=key_to_json(4711), s=9),
        Add(t=T0 + 60_005, g="jobs", k=key_to_json(-5), d=T0 + 60_010, s=13),
        Fire(t=T0 + 90_000, g="jobs", k=key_to_json(-5), d=T0 + 60_010, s=13, f=T0 + 90_000, late=True, lat=29_990),
    ]


class Model:
    """What the journal promises to rebuild, kept with plain dicts."""

    def __init__(self) -> None:
        self.pending: dict[tuple[str, object], tuple[int, int, int | None]] = {}
        self.unacked: dict[tuple[str, object, int], tuple[int, int, bool, int, int | None]] = {}
        self.seq = 0
        self.now = T0

    def snapshot(self) -> tuple[list[PendingTimer], list[FiredTimer]]:
        pending = [PendingTimer(g, k, d, s, i) for (g, k), (d, s, i) in self.pending.items()]
        unacked = [FiredTimer(g, k, d, s, f, late, lat, i) for (g, k, s), (d, f, late, lat, i) in self.unacked.items()]
        return pending, unacked

    def step(self, op: str, group: str, key, delay_ms: int, pick: int) -> object | None:
        """Apply one operation; return the journal event a daemon would write (or None)."""
        self.now += 1
        self.seq += 1
        if op == "idle_rearm" and pick % 3 == 0:
            # a fired idle timer put back on the wheel before it was sent (a restarted daemon
            # could not read its client's touches yet): pending again, no longer unacked
            fired = sorted((entry for entry, value in self.unacked.items()
                            if value[4] is not None and entry[:2] not in self.pending), key=repr)
            if fired:
                group, key, seq = fired[pick % len(fired)]
                deadline, _f, _late, _lat, idle = self.unacked.pop((group, key, seq))
                self.pending[(group, key)] = (self.now + 100, seq, idle)
                return IdleRearm(t=self.now, g=group, k=key_to_json(key), d=self.now + 100, pd=deadline, s=seq,
                                 i=idle)
        if op in ("fire", "idle_rearm") and (group, key) not in self.pending:
            # aim at an existing timer (an idle one for idle_rearm) so these ops are not mostly no-ops
            candidates = sorted(
                (entry for entry, value in self.pending.items() if op == "fire" or value[2] is not None), key=repr
            )
            if candidates:
                group, key = candidates[pick % len(candidates)]
        json_key = key_to_json(key)
        current = self.pending.get((group, key))
        if op in ("add", "add_idle"):
            idle = delay_ms if op == "add_idle" else None
            extra = {} if idle is None else {"i": idle}
            self.pending[(group, key)] = (self.now + delay_ms, self.seq, idle)
            if current is None:
                return Add(t=self.now, g=group, k=json_key, d=self.now + delay_ms, s=self.seq, **extra)
            return Rearm(t=self.now, g=group, k=json_key, d=self.now + delay_ms, pd=current[0], s=self.seq, **extra)
        if op == "cancel":
            if current is None:
                return Cancel(t=self.now, g=group, k=json_key, s=self.seq, hit=False)
            del self.pending[(group, key)]
            return Cancel(t=self.now, g=group, k=json_key, s=self.seq, hit=True, pd=current[0])
        if op == "fire" and current is not None:
            deadline, seq, idle = current
            del self.pending[(group, key)]
            fired = max(self.now, deadline)
            late = pick % 5 == 0
            self.unacked[(group, key, seq)] = (deadline, fired, late, fired - deadline, idle)
            extra = {} if idle is None else {"i": idle}
            return Fire(t=fired, g=group, k=json_key, d=deadline, s=seq, f=fired, late=late, lat=fired - deadline,
                        **extra)
        if op == "idle_rearm" and current is not None and current[2] is not None:
            deadline, seq, idle = current
            self.pending[(group, key)] = (deadline + idle, seq, idle)
            return IdleRearm(t=self.now, g=group, k=json_key, d=deadline + idle, pd=deadline, s=seq, i=idle)
        if op == "ack" and self.unacked:
            keys = sorted(self.unacked, key=repr)
            group, key, seq = keys[pick % len(keys)]
            del self.unacked[(group, key, seq)]
            return Ack(t=self.now, g=group, k=key_to_json(key), s=seq)
        return None


def assert_state_equals_model(state, model: Model) -> None:
    expected_pending = {(g, k): PendingTimer(g, k, d, s, i) for (g, k), (d, s, i) in model.pending.items()}
    assert state.pending == expected_pending
    expected_unacked = sorted(
        (
            (g, repr(k), s, d, f, late, lat, i)
            for (g, k, s), (d, f, late, lat, i) in model.unacked.items()
        )
    )
    got_unacked = sorted((u.group, repr(u.key), u.seq, u.deadline_ms, u.fired_ms, u.late, u.lateness_ms, u.idle_ms)
                         for u in state.unacked)
    assert got_unacked == expected_unacked


def random_history(seed: int, steps: int) -> tuple[Model, list[list]]:
    rng = random.Random(seed)
    model = Model()
    batches: list[list] = [[]]
    keys = ["a", "b", "c", b"d", 5, 6]
    for _ in range(steps):
        op = rng.choice(["add", "add", "add_idle", "cancel", "fire", "ack", "idle_rearm"])
        event = model.step(op, rng.choice(["g1", "g2"]), rng.choice(keys), rng.randint(1, 10_000), rng.randint(0, 99))
        if event is not None:
            batches[-1].append(event)
        if rng.random() < 0.2:
            batches.append([])
    return model, batches
