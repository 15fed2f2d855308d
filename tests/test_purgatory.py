"""wheeld.purgatory: exactly-once completion, O(1) timer removal, bounded watch lists.

Layers: single-threaded behaviour (condition, timeout, cancel, callbacks order,
never early); races (threads hammering check_and_complete while timeouts fire and
a canceller force-completes); the watch lists and the timer hold only pending
operations after 100k early completions; the same API on a real daemon and on
asyncio.
"""

from __future__ import annotations

import asyncio
import random
import sys
import threading
import time

import pytest
from daemon_harness import wait_until, wait_until_async
import wheeld
from wheeld.protocol.errors import InvalidRequest
from wheeld.purgatory import AsyncPurgatory, DelayedOperation, Purgatory, default_group


class Op(DelayedOperation):
    """An operation whose condition is a flag; it records every callback and which path won."""

    def __init__(self, delay_ms: int, ready: bool = False) -> None:
        super().__init__(delay_ms)
        self.ready = ready
        self.watched_ns = 0
        self.completions: list[bool] = []  # self.expired as seen by on_complete
        self.expirations = 0
        self.completed_ns = 0
        self.won_by_condition = 0
        self.won_by_cancel = 0
        self.order: list[str] = []

    def try_complete(self) -> bool:
        if self.ready and self.force_complete():
            self.won_by_condition += 1
            return True
        return False

    def cancel(self) -> bool:
        if self.force_complete():
            self.won_by_cancel += 1
            return True
        return False

    def on_complete(self) -> None:
        self.completed_ns = time.monotonic_ns()
        self.completions.append(self.expired)
        self.order.append("complete")

    def on_expiration(self) -> None:
        self.expirations += 1
        self.order.append("expiration")


@pytest.fixture
def purgatory():
    p = Purgatory()
    try:
        yield p
    finally:
        p.close()


# --------------------------------------------------------------------------- one thread


def test_completes_at_once_when_the_condition_already_holds(purgatory):
    op = Op(1000, ready=True)
    assert purgatory.try_complete_else_watch(op, ["a", "b"]) is True
    assert op.completions == [False] and op.won_by_condition == 1
    assert purgatory.watched() == 0 and len(purgatory) == 0


def test_condition_completes_and_leaves_no_trace(purgatory):
    op = Op(5000)
    assert purgatory.try_complete_else_watch(op, ["a", "b", "c"]) is False
    assert purgatory.watched() == 3 and len(purgatory) == 1 and len(purgatory._clock.wheel) == 1
    assert purgatory.check_and_complete("b") == 0  # not ready yet
    op.ready = True
    assert purgatory.check_and_complete("zzz") == 0  # a key nobody watches
    assert purgatory.check_and_complete("b") == 1
    assert purgatory.check_and_complete("a") == 0  # already gone from every list
    assert op.completions == [False] and op.expirations == 0
    assert purgatory.watched() == 0 and purgatory.watch_keys() == 0
    assert len(purgatory) == 0 and len(purgatory._clock.wheel) == 0  # removed from the timer at once
    assert op.force_complete() is False


def test_timeout_completes_then_expires_never_early(purgatory):
    ops = [Op(delay) for delay in (5, 20, 60, 60, 150)]
    for op in ops:
        op.watched_ns = time.monotonic_ns()
        assert purgatory.try_complete_else_watch(op, ["k"]) is False
    assert wait_until(lambda: all(op.is_completed for op in ops))
    for op in ops:
        assert op.completions == [True] and op.expirations == 1
        assert op.order == ["complete", "expiration"]  # Kafka's order: onComplete, then onExpiration
        assert op.expired
        assert op.completed_ns - op.watched_ns >= op.delay_ms * 1_000_000, "expired early"
    assert purgatory.watched() == 0 and len(purgatory) == 0
    assert purgatory.expired_total == 5 and purgatory.completed_total == 0


def test_cancel_is_the_third_path(purgatory):
    op = Op(300)
    purgatory.try_complete_else_watch(op, ["k"])
    assert op.cancel() is True
    time.sleep(0.4)  # past the deadline it no longer has: it must not expire
    assert op.completions == [False] and op.expirations == 0 and op.won_by_cancel == 1
    assert purgatory.watched() == 0 and len(purgatory) == 0


def test_an_earlier_deadline_wakes_a_clock_sleeping_for_a_later_one(purgatory):
    late, early = Op(60_000), Op(30)
    purgatory.try_complete_else_watch(late, ["k"])
    wait_until(lambda: purgatory._clock._wake_at_ms > time.monotonic_ns() // 1_000_000 + 30_000,
               what="the clock thread asleep until the 60 s bucket")
    early.watched_ns = time.monotonic_ns()
    purgatory.try_complete_else_watch(early, ["k"])
    assert wait_until(lambda: early.is_completed, timeout=5.0)
    assert early.expired and not late.is_completed


def test_duplicate_keys_and_misuse(purgatory):
    op = Op(1000)
    purgatory.try_complete_else_watch(op, ["a", "a", "b"])
    assert purgatory.watched() == 2
    with pytest.raises(InvalidRequest):
        purgatory.try_complete_else_watch(op, ["c"])  # already in a purgatory
    with pytest.raises(InvalidRequest):
        purgatory.try_complete_else_watch(Op(10), [])
    with pytest.raises(InvalidRequest):
        Op(-1)
    op.cancel()


def test_the_wheel_grows_when_full():
    with Purgatory(capacity=8) as p:
        # the odd ones time out soon; the even ones would in a minute, and are cancelled
        # first (however slow the machine is between the watch and the cancel)
        ops = [Op(random.randint(20, 80) if i % 2 else 60_000 + i) for i in range(100)]
        for op in ops:
            p.try_complete_else_watch(op, [op.delay_ms % 7])
        assert p._clock.wheel.capacity >= 100
        for op in ops[::2]:
            op.cancel()
        assert wait_until(lambda: all(op.is_completed for op in ops))
        assert all(op.expirations == 1 for op in ops[1::2]) and all(op.expirations == 0 for op in ops[::2])
        assert p.watched() == 0 and len(p) == 0 and len(p._clock.wheel) == 0


def test_completed_by_another_thread_while_being_watched_leaks_nothing(purgatory):
    class Sneaky(Op):
        calls = 0

        def try_complete(self):
            self.calls += 1
            if self.calls == 2:  # the re-check after watching: another thread completes it first
                t = threading.Thread(target=self.cancel)
                t.start()
                t.join()
            return False

    op = Sneaky(10_000)
    assert purgatory.try_complete_else_watch(op, ["a", "b"]) is False
    assert op.completions == [False] and op.won_by_cancel == 1
    assert purgatory.watched() == 0 and len(purgatory) == 0 and len(purgatory._clock.wheel) == 0


def _park_five(p) -> list[Op]:
    ops = [Op(60_000) for _ in range(5)]
    for i, op in enumerate(ops):
        assert p.try_complete_else_watch(op, [f"k{i % 2}"]) is False
    assert len(p) == 5 and p.watched() == 5
    return ops


def _assert_completed_by_close(p, ops: list[Op]) -> None:
    for op in ops:
        assert op.completions == [False], "on_complete must run exactly once, not as a timeout"
        assert op.expirations == 0 and not op.expired
        assert isinstance(op.error, wheeld.Closed)
        assert op.force_complete() is False
    assert p.watched() == 0 and p.watch_keys() == 0 and len(p) == 0
    assert p.errored_total == 5 and p.completed_total == 0 and p.expired_total == 0


def test_close_completes_every_parked_operation_in_process():
    p = Purgatory()
    ops = _park_five(p)
    p.close()
    _assert_completed_by_close(p, ops)
    assert not p._clock._thread.is_alive()
    with pytest.raises(wheeld.Closed):
        p.try_complete_else_watch(Op(10), ["k"])
    p.close()  # idempotent


def test_close_completes_every_parked_operation_in_process_asyncio():
    async def main():
        p = AsyncPurgatory()
        ops = _park_five(p)
        await p.aclose()
        _assert_completed_by_close(p, ops)
        with pytest.raises(wheeld.Closed):
            p.try_complete_else_watch(Op(10), ["k"])

    asyncio.run(main())


def _pending_in_daemon(client) -> int:
    """Timers pending in the daemon's arena (its header's counter, read through the client's mapping)."""
    from wheeld import core

    return client._parked[core._PENDING]


def test_close_completes_every_parked_operation_on_a_daemon(daemon):
    client = wheeld.connect(daemon.socket_path, group=default_group("close-test"))
    try:
        p = Purgatory(client, name="close-test")
        ops = _park_five(p)
        assert wait_until(lambda: _pending_in_daemon(client) == 5)  # the daemon applied the five adds
        p.close()
        _assert_completed_by_close(p, ops)
        assert not p._clock._thread.is_alive()
        client.flush()
        assert wait_until(lambda: _pending_in_daemon(client) == 0)  # ...and close() cancelled their timers
    finally:
        client.close()


def test_close_completes_every_parked_operation_on_a_daemon_asyncio(daemon):
    async def main():
        client = await wheeld.connect_async(daemon.socket_path, group=default_group("close-async"))
        try:
            p = AsyncPurgatory(client, name="close-async")
            ops = _park_five(p)
            await wait_until_async(lambda: _pending_in_daemon(client) == 5, 10, "the daemon to hold the five timers")
            assert _pending_in_daemon(client) == 5
            await p.aclose()
            _assert_completed_by_close(p, ops)
            await client.flush()
            await wait_until_async(lambda: _pending_in_daemon(client) == 0, 10, "close() to cancel the five timers")
            assert _pending_in_daemon(client) == 0
        finally:
            await client.close()

    asyncio.run(main())


def test_connect_owns_its_client_and_close_closes_it(daemon):
    p = Purgatory.connect("owned", daemon.socket_path)
    client = p.client
    assert client.group == "purgatory.owned"
    ops = _park_five(p)
    p.close()
    _assert_completed_by_close(p, ops)
    with pytest.raises(wheeld.Closed):
        client.add("x", 10)


def test_default_group_is_stable_and_private_to_a_name():
    assert default_group("fetch-3") == default_group("fetch-3") == "purgatory.fetch-3"
    assert default_group("fetch-3") != default_group("fetch-4")
    assert default_group("a b/c") == "purgatory.a_b_c"
    with pytest.raises(InvalidRequest):
        default_group("")


def test_expirations_of_operations_it_did_not_create_are_dropped_and_counted(daemon):
    group = default_group("left-behind")
    with wheeld.connect(daemon.socket_path, group=group) as earlier:  # an earlier process of the same name
        earlier.add((12345 << 32) | 1, 20)
        earlier.add("not-an-op-id", 20)
        earlier.flush()
    with Purgatory.connect("left-behind", daemon.socket_path) as p:
        assert wait_until(lambda: p.foreign_expirations == 2)
        op = Op(20)
        p.try_complete_else_watch(op, ["k"])
        assert wait_until(lambda: op.is_completed)
        assert op.expired and p.foreign_expirations == 2


def test_a_key_given_twice_is_watched_once_and_a_bad_key_changes_nothing(purgatory):
    op = Op(60_000)
    assert not purgatory.try_complete_else_watch(op, ["a", "b", "a", "b"])
    assert purgatory.watched() == 2 and purgatory.watch_keys() == 2
    bad = Op(60_000)
    with pytest.raises(TypeError):
        purgatory.try_complete_else_watch(bad, ["a", ["unhashable"]])
    assert purgatory.watched() == 2 and len(purgatory) == 1
    assert purgatory.try_complete_else_watch(bad, ["c"]) is False  # it was not put in the purgatory
    assert op.cancel() and bad.cancel()
    assert purgatory.watched() == 0 and purgatory.watch_keys() == 0 and len(purgatory) == 0


def test_a_check_asked_for_while_another_runs_is_not_lost(purgatory):
    """Kafka's maybeTryComplete: the second check does not wait; the running one checks again."""
    entered, release = threading.Event(), threading.Event()

    class Slow(Op):
        calls = 0

        def try_complete(self) -> bool:
            Slow.calls += 1
            if Slow.calls == 3:  # the first check after the watch: hold it while another is asked for
                entered.set()
                release.wait(5)
                return False
            return super().try_complete()

    op = Slow(60_000)
    assert not purgatory.try_complete_else_watch(op, ["k"])  # checks 1 and 2
    runner = threading.Thread(target=purgatory.check_and_complete, args=("k",))
    runner.start()
    assert entered.wait(5)
    op.ready = True
    assert purgatory.check_and_complete("k") == 0  # check 3 is running: this one only flags it
    release.set()
    runner.join(5)
    assert op.is_completed and op.won_by_condition == 1 and Slow.calls == 4
    assert purgatory.watched() == 0 and len(purgatory) == 0


# --------------------------------------------------------------------------- races


def test_exactly_once_under_concurrent_completion_timeout_and_cancel(purgatory):
    """Four checker threads and a canceller race the clock thread; every operation ends once."""
    n_ops, keys = 6000, [f"key-{i}" for i in range(8)]
    rng = random.Random(5)
    ops = [Op(rng.randint(0, 25)) for _ in range(n_ops)]
    produced = threading.Event()
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # interleave the threads as finely as CPython allows
    watched_upto = 0
    try:
        def checker(seed: int) -> None:
            r = random.Random(seed)
            while not produced.is_set() or purgatory.watched():
                if watched_upto:
                    for _ in range(3):  # the condition becomes true at a random moment
                        ops[r.randrange(watched_upto)].ready = True
                purgatory.check_and_complete(r.choice(keys))
                time.sleep(0.0002)  # checks at random moments: the concurrency under test

        def canceller() -> None:
            r = random.Random(99)
            while not produced.is_set():
                if watched_upto:
                    ops[r.randrange(watched_upto)].cancel()
                time.sleep(0.0005)  # cancels at random moments: the concurrency under test

        threads = [threading.Thread(target=checker, args=(s,)) for s in range(4)]
        threads.append(threading.Thread(target=canceller))
        for t in threads:
            t.start()
        completed_at_once = 0
        for i, op in enumerate(ops):
            completed_at_once += purgatory.try_complete_else_watch(op, rng.sample(keys, 3))
            watched_upto = i + 1
            if i % 200 == 0:
                time.sleep(0.002)  # lets the checkers and the clock interleave with the producer
        produced.set()
        assert wait_until(lambda: all(op.is_completed for op in ops), timeout=30.0)
        for t in threads:
            t.join(30)
    finally:
        sys.setswitchinterval(old_interval)

    for op in ops:
        assert len(op.completions) == 1, "on_complete must run exactly once"
        paths = op.won_by_condition + op.won_by_cancel + op.expirations
        assert paths == 1, f"completed by {paths} paths"
        assert op.expirations == (1 if op.expired else 0)
        assert op.completions == [op.expired]
    expired = sum(op.expirations for op in ops)
    by_condition = sum(op.won_by_condition for op in ops)
    cancelled = sum(op.won_by_cancel for op in ops)
    assert expired and by_condition and cancelled, (expired, by_condition, cancelled)  # all three paths raced
    assert completed_at_once <= by_condition
    assert purgatory.watched() == 0 and len(purgatory) == 0 and len(purgatory._clock.wheel) == 0
    assert purgatory.expired_total == expired and purgatory.completed_total == n_ops - expired


# --------------------------------------------------------------------------- bounded watch lists


def test_watch_lists_and_timer_stay_small_after_100k_early_completions(purgatory):
    """Kafka's benchmark shape: 3 keys per operation, most complete early without check_and_complete.

    A purgatory that leaves completed operations in its watch lists (no purge, no
    removal) would hold 300 000 entries here; one that does not remove them from
    the timer would hold 100 000 timers.
    """
    keys = ["fakeKey0", "fakeKey1", "fakeKey2"]
    live: list[Op] = []
    peak_watched = 0
    for i in range(100_000):
        op = Op(60_000)
        purgatory.try_complete_else_watch(op, keys)
        live.append(op)
        if len(live) >= 100:  # complete all but a few, like requests answered early
            for old in live[:-10]:
                old.cancel()
            del live[:-10]
        if i % 997 == 0:
            peak_watched = max(peak_watched, purgatory.watched())
            assert len(purgatory._clock.wheel) <= 100
    assert peak_watched <= 3 * 100
    assert purgatory.watched() == 3 * len(live) and len(purgatory) == len(live)
    for op in live:
        op.cancel()
    assert purgatory.watched() == 0 and purgatory.watch_keys() == 0 and len(purgatory._clock.wheel) == 0


def test_completion_through_one_key_clears_the_others(purgatory):
    ops = [Op(60_000) for _ in range(2000)]
    for i, op in enumerate(ops):
        purgatory.try_complete_else_watch(op, [f"own-{i}", "shared-a", "shared-b"])
    for op in ops:
        op.ready = True
    assert purgatory.check_and_complete("shared-a") == 2000
    assert purgatory.watched() == 0 and purgatory.watch_keys() == 0 and len(purgatory) == 0


# --------------------------------------------------------------------------- asyncio and the daemon


def test_async_purgatory_in_process():
    async def main():
        async with AsyncPurgatory() as p:
            waiting, quick, cancelled = Op(5000), Op(40), Op(5000)
            quick.watched_ns = time.monotonic_ns()
            for op in (waiting, quick, cancelled):
                assert p.try_complete_else_watch(op, ["k"]) is False
            cancelled.cancel()
            waiting.ready = True
            assert p.check_and_complete("k") == 1
            await wait_until_async(lambda: quick.is_completed, 2, "the quick operation to expire")
            assert quick.expired and quick.completed_ns - quick.watched_ns >= 40_000_000
            assert waiting.completions == [False] and cancelled.completions == [False]
            assert cancelled.expirations == 0
            # a condition checked from another thread
            other = Op(5000)
            p.try_complete_else_watch(other, ["t"])
            other.ready = True
            done = await asyncio.to_thread(p.check_and_complete, "t")
            assert done == 1 and p.watched() == 0 and len(p) == 0

    asyncio.run(main())


def test_purgatory_on_a_real_daemon(daemon):
    client = wheeld.connect(daemon.socket_path, group="purgatory-test")
    p = Purgatory(client=client)
    try:
        timing_out = [Op(60) for _ in range(50)]
        early = [Op(500) for _ in range(50)]  # completed before then, however loaded the machine
        for op in timing_out + early:
            op.watched_ns = time.monotonic_ns()
            assert p.try_complete_else_watch(op, ["topic-0", "topic-1"]) is False
        for op in early:
            op.ready = True
        assert p.check_and_complete("topic-1") == 50  # checks all 100, completes the 50 ready ones
        assert all(op.is_completed and not op.expired for op in early)
        assert wait_until(lambda: all(op.is_completed for op in timing_out))
        last_watch_ns = max(op.watched_ns for op in early)
        # past the early ones' deadlines, which must not fire: their daemon timers were cancelled
        time.sleep(max(0.0, (last_watch_ns + 600_000_000 - time.monotonic_ns()) / 1e9))
        for op in timing_out:
            assert op.completions == [True] and op.expirations == 1
            assert op.completed_ns - op.watched_ns >= 59_000_000  # the daemon's clock is in whole ms
        for op in early:
            assert op.completions == [False] and op.expirations == 0
        assert p.watched() == 0 and len(p) == 0
        assert p.expired_total == 50
    finally:
        p.close()
        client.close()


def test_async_purgatory_on_a_real_daemon(daemon):
    async def main():
        client = await wheeld.connect_async(daemon.socket_path, group="purgatory-async")
        try:
            async with AsyncPurgatory(client=client) as p:
                fast, slow = Op(50), Op(3000)
                p.try_complete_else_watch(fast, ["k"])
                p.try_complete_else_watch(slow, ["k"])
                slow.ready = True
                assert p.check_and_complete("k") == 1
                await wait_until_async(lambda: fast.is_completed, 5, "the fast operation to expire")
                assert fast.expired and fast.expirations == 1
                assert slow.completions == [False] and slow.expirations == 0
                assert p.watched() == 0 and len(p) == 0
        finally:
            await client.close()

    asyncio.run(main())
