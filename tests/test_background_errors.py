"""Background threads and tasks under a persistent error: bounded logs, bounded CPU, the error surfaces.

Each case injects a failure that never goes away into one background loop of the
client libraries (the daemon-backed purgatory's expiration thread and task, the
in-process purgatory's clock thread, the idle tracker's expiration task and loop
timer) and checks what the application sees: the loop backs off (a handful of
attempts, not hundreds of thousands), logs at most one line per interval with a
count, spends almost no CPU, and after ``fail_after_s`` the failure reaches the
application (operations complete with ``op.error``, the next call raises
``ReaderFailed``).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import threading
import time

import pytest
from daemon_harness import wait_until, wait_until_async
import wheeld
import wheeld.purgatory as purgatory_mod
import wheeld.sync as sync_mod
from wheeld._background import Backoff, ReaderFailed
from wheeld.idle import IdleTracker
from wheeld.purgatory import AsyncPurgatory, DelayedOperation, Purgatory

LOG_INTERVAL_S = 0.25
FAIL_AFTER_S = 1.5
MAX_ATTEMPTS = 20  # 10 ms doubling to 1 s reaches 1.5 s in ~9 attempts; a spinning loop makes 100,000s


class Op(DelayedOperation):
    def __init__(self, delay_ms: int = 60_000) -> None:
        super().__init__(delay_ms)
        self.completions = 0
        self.expirations = 0

    def try_complete(self) -> bool:
        return False

    def on_complete(self) -> None:
        self.completions += 1

    def on_expiration(self) -> None:
        self.expirations += 1


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def records(monkeypatch):
    monkeypatch.setattr(Backoff, "LOG_INTERVAL_S", LOG_INTERVAL_S)
    handler = Records()
    loggers = [logging.getLogger("wheeld.purgatory"), logging.getLogger("wheeld.idle")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield handler.records
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


def thread_cpu_s(thread: threading.Thread) -> float:
    """CPU time (user + system) of one thread of this process, from /proc."""
    with open(f"/proc/self/task/{thread.native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def injected() -> OSError:
    return OSError(errno.EBADF, "injected: the wait on the daemon's socket fails")


def check_log_volume(records: list[logging.LogRecord], failing_s: float) -> None:
    assert records, "the failure was not logged at all"
    assert len(records) <= 2 + failing_s / LOG_INTERVAL_S + 1, [r.getMessage() for r in records]
    assert records[0].exc_info is not None  # the first failure carries its traceback...
    assert sum(1 for r in records if r.exc_info) == 1  # ...and only the first
    assert any("since the last report" in r.getMessage() for r in records)  # later lines carry a count
    assert "giving up" in records[-1].getMessage()


def check_operations_failed(p, ops: list[Op], cause_type=OSError) -> None:
    for op in ops:
        assert op.completions == 1 and op.expirations == 0 and not op.expired
        assert isinstance(op.error, ReaderFailed) and isinstance(op.error.__cause__, cause_type)
    assert p.error is not None and p.errored_total == len(ops) and len(p) == 0 and p.watched() == 0
    with pytest.raises(ReaderFailed) as raised:
        p.try_complete_else_watch(Op(), ["k"])
    assert isinstance(raised.value.__cause__, cause_type)


# --------------------------------------------------------------------------- purgatory, sync, daemon


def test_purgatory_expiration_thread_backs_off_and_fails_the_operations(daemon, records, monkeypatch):
    p = Purgatory.connect("inject", daemon.socket_path, fail_after_s=FAIL_AFTER_S)
    try:
        ops = [Op() for _ in range(5)]
        for op in ops:
            p.try_complete_else_watch(op, ["k"])
        thread = p._clock._thread
        cpu0 = thread_cpu_s(thread)
        t0 = time.monotonic()

        def failing_wait(*_args):
            raise injected()

        # Both waits fail at once and every time: the purgatory's own, and the client's in poll().
        monkeypatch.setattr(purgatory_mod, "_wait_readable", failing_wait)
        monkeypatch.setattr(sync_mod, "wait_readable", failing_wait)
        cpu = [cpu0]

        def done() -> bool:
            try:  # the thread's CPU, sampled while it lives (its /proc entry goes when it ends)
                cpu.append(thread_cpu_s(thread))
            except (FileNotFoundError, ProcessLookupError):
                pass
            return all(op.is_completed for op in ops)

        assert wait_until(done)
        failing_s = time.monotonic() - t0
        thread.join(10)
        assert not thread.is_alive()  # it gave up and ended
        assert len(cpu) > 10  # sampled along the way
        assert max(cpu) - cpu0 < 0.25 * failing_s
        assert p._clock._backoff.total_failures <= MAX_ATTEMPTS
        assert failing_s >= FAIL_AFTER_S
        check_log_volume(records, failing_s)
        check_operations_failed(p, ops)
    finally:
        monkeypatch.undo()
        p.close()  # does not raise for a failed purgatory


def test_purgatory_expiration_thread_cpu_while_backing_off(daemon, records):
    """The thread's own CPU while it keeps failing (before it gives up), then its recovery."""
    p = Purgatory.connect("inject-cpu", daemon.socket_path, fail_after_s=None)
    try:
        thread = p._clock._thread

        def failing_wait(*_args):
            raise injected()

        with pytest.MonkeyPatch.context() as failure:
            failure.setattr(purgatory_mod, "_wait_readable", failing_wait)
            failure.setattr(sync_mod, "wait_readable", failing_wait)
            assert wait_until(lambda: p._clock._backoff.failures >= 8)  # backed off to 1 s between attempts
            cpu0, t0 = thread_cpu_s(thread), time.monotonic()
            failures0 = p._clock._backoff.total_failures
            assert wait_until(lambda: p._clock._backoff.total_failures >= failures0 + 2)
            elapsed = time.monotonic() - t0
            assert thread_cpu_s(thread) - cpu0 < 0.1 * elapsed + 0.05
            assert p._clock._backoff.total_failures - failures0 <= elapsed / 0.5 + 2  # about one attempt a second
            assert p.error is None  # fail_after_s=None: it keeps trying
        # the failure goes away: the thread recovers, says so once, and delivers timeouts again
        op = Op(20)
        p.try_complete_else_watch(op, ["k"])
        assert wait_until(lambda: op.is_completed)
        assert op.expired and op.error is None
        assert sum(1 for r in records if "recovered" in r.getMessage()) == 1
    finally:
        p.close()


# --------------------------------------------------------------------------- purgatory, asyncio, daemon


def test_async_purgatory_expiration_task_backs_off_and_fails_the_operations(daemon, records):
    async def main():
        p = await AsyncPurgatory.connect("inject-async", daemon.socket_path, fail_after_s=FAIL_AFTER_S)
        try:
            ops = [Op() for _ in range(5)]
            for op in ops:
                p.try_complete_else_watch(op, ["k"])
            await p.client.flush()
            attempts = 0

            async def failing_poll(timeout_s=None):
                nonlocal attempts
                attempts += 1
                raise injected()

            cpu0, t0 = time.process_time(), time.monotonic()
            p._clock._task.cancel()  # restart the reader on a client whose poll always fails
            p.client.poll = failing_poll
            p._clock._task = asyncio.get_running_loop().create_task(p._clock._run())
            assert await wait_until_async(lambda: all(op.is_completed for op in ops))
            failing_s = time.monotonic() - t0
            assert attempts <= MAX_ATTEMPTS
            assert time.process_time() - cpu0 < 0.25 * failing_s
            check_log_volume(records, failing_s)
            check_operations_failed(p, ops)
        finally:
            await p.aclose()

    asyncio.run(main())


# --------------------------------------------------------------------------- purgatory, in-process clock


def test_in_process_purgatory_clock_thread_backs_off_and_fails_the_operations(records, monkeypatch):
    p = Purgatory(fail_after_s=FAIL_AFTER_S)
    try:
        ops = [Op(5) for _ in range(5)]

        def failing_collect():
            raise RuntimeError("injected: the wheel cannot advance")

        monkeypatch.setattr(p._clock, "_collect", failing_collect)
        t0 = time.monotonic()
        for op in ops:
            p.try_complete_else_watch(op, ["k"])  # an earlier deadline wakes the clock thread
        assert wait_until(lambda: all(op.is_completed for op in ops))
        failing_s = time.monotonic() - t0
        assert p._clock._backoff.total_failures <= MAX_ATTEMPTS
        check_log_volume(records, failing_s)
        check_operations_failed(p, ops, RuntimeError)
    finally:
        monkeypatch.undo()
        p.close()


# --------------------------------------------------------------------------- idle tracker


def test_idle_tracker_expiration_task_backs_off_and_the_next_add_raises(daemon, records):
    async def main():
        client = await wheeld.connect_async(daemon.socket_path, group="idle-inject")
        tracker = IdleTracker(60_000, client=client, fail_after_s=FAIL_AFTER_S)
        try:
            tracker.add("conn-1")
            await tracker.flush()
            attempts = 0

            async def failing_poll(timeout_s=None):
                nonlocal attempts
                attempts += 1
                raise injected()

            await tracker._pause_reader()
            client.poll = failing_poll
            cpu0, t0 = time.process_time(), time.monotonic()
            tracker._task = asyncio.get_running_loop().create_task(tracker._read_expirations())
            assert await wait_until_async(lambda: tracker.error is not None)
            failing_s = time.monotonic() - t0
            assert attempts <= MAX_ATTEMPTS
            assert time.process_time() - cpu0 < 0.25 * failing_s
            check_log_volume(records, failing_s)
            assert isinstance(tracker.error, ReaderFailed) and isinstance(tracker.error.__cause__, OSError)
            with pytest.raises(ReaderFailed):
                tracker.add("conn-2")
            with pytest.raises(ReaderFailed):
                await tracker.flush()
            tracker.touch("conn-1")  # the hot path stays silent
        finally:
            del client.poll
            await tracker.aclose()  # does not raise
            await client.close()

    asyncio.run(main())


def test_idle_tracker_async_iterator_raises_when_the_tracker_fails(records):
    async def main():
        tracker = IdleTracker(5, fail_after_s=FAIL_AFTER_S)

        def failing_advance():
            raise RuntimeError("injected: the wheel cannot advance")

        tracker._advance = failing_advance
        t0 = time.monotonic()
        tracker.add("conn-1")
        with pytest.raises(ReaderFailed) as raised:
            async for _key in tracker:
                pass
        failing_s = time.monotonic() - t0
        assert isinstance(raised.value.__cause__, RuntimeError)
        assert tracker._backoff.total_failures <= MAX_ATTEMPTS
        check_log_volume(records, failing_s)
        with pytest.raises(ReaderFailed):
            tracker.add("conn-2")
        await tracker.aclose()

    asyncio.run(main())


# --------------------------------------------------------------------------- the policy itself


def test_backoff_is_bounded_exponential_and_logs_a_count(monkeypatch):
    monkeypatch.setattr(Backoff, "LOG_INTERVAL_S", 3600.0)
    handler = Records()
    log = logging.getLogger("wheeld.test-backoff")
    log.addHandler(handler)
    try:
        backoff = Backoff(log, "test loop", fail_after_s=None)
        delays = [backoff.failure(ValueError(i)) for i in range(12)]
        assert delays[:4] == [0.01, 0.02, 0.04, 0.08] and max(delays) == 1.0 and delays[-1] == 1.0
        assert len(handler.records) == 1  # the rest wait for the interval
        monkeypatch.setattr(Backoff, "LOG_INTERVAL_S", 0.0)
        backoff.failure(ValueError("again"))
        assert len(handler.records) == 2 and "12 failure(s) since the last report" in handler.records[1].getMessage()
        backoff.success()
        assert "recovered after 13 failure(s)" in handler.records[2].getMessage()
        assert backoff.failure(ValueError("new streak")) == 0.01
    finally:
        log.removeHandler(handler)
