"""Never early in real time: through a real daemon, measured with a nanosecond clock.

A deadline is ``ceil(now in ms) + delay_ms`` and the daemon fires once its floored
clock reaches it, so an expiration is never handed over before ``delay_ms`` of
real time has passed since the call (or since the last touch of an idle timer).
"""

from __future__ import annotations

import random
import time

import wheeld


def test_ten_thousand_timers_through_the_daemon_are_never_early(daemon):
    rng = random.Random(7)
    called_ns: dict[str, tuple[int, int]] = {}
    early = []
    received = 0
    with wheeld.connect(daemon.socket_path, group="never-early") as w:
        for burst in range(100):
            for i in range(100):
                key = f"k{burst}-{i}"
                delay_ms = rng.randrange(0, 25)
                called_ns[key] = (time.monotonic_ns(), delay_ms)
                w.add(key, delay_ms)
            for expired in w.poll(timeout_s=0):
                received += 1
                start_ns, delay_ms = called_ns[expired.key]
                if time.monotonic_ns() - start_ns < delay_ms * 1_000_000:
                    early.append(expired.key)
        end = time.monotonic() + 30
        while received < len(called_ns) and time.monotonic() < end:
            for expired in w.poll(timeout_s=1.0):
                now_ns = time.monotonic_ns()
                received += 1
                start_ns, delay_ms = called_ns[expired.key]
                if now_ns - start_ns < delay_ms * 1_000_000:
                    early.append(expired.key)
    assert received == 10_000
    assert early == []


def _collect(w, last_touch_ns: dict, idle_ms: int, count: int) -> list:
    early = []
    got = 0
    end = time.monotonic() + 20
    while got < count and time.monotonic() < end:
        for expired in w.poll(timeout_s=1.0):
            now_ns = time.monotonic_ns()
            got += 1
            if now_ns - last_touch_ns.pop(expired.key) < idle_ms * 1_000_000:
                early.append(expired.key)
    assert got == count
    return early


def test_idle_timers_through_the_daemon_are_never_early(daemon):
    idle_ms = 40
    rng = random.Random(11)
    last_touch_ns: dict[str, int] = {}
    with wheeld.connect(daemon.socket_path, group="never-early-idle") as w:
        # never touched: they fire idle_ms after add_idle
        for i in range(300):
            key = f"quiet-{i}"
            last_touch_ns[key] = time.monotonic_ns()
            w.add_idle(key, idle_ms)
            time.sleep(rng.random() / 5000)
        assert _collect(w, last_touch_ns, idle_ms, 300) == []
        # active for a while (a touch every ~5 ms, inside idle_ms, at sub-millisecond
        # offsets), then quiet: they fire idle_ms after their last touch
        active = [f"active-{i}" for i in range(300)]
        for key in active:
            last_touch_ns[key] = time.monotonic_ns()
            w.add_idle(key, idle_ms)
        deadline = time.monotonic() + 0.1
        while time.monotonic() < deadline:
            rng.shuffle(active)
            for key in active:
                last_touch_ns[key] = time.monotonic_ns()
                w.touch(key)
            assert w.poll(timeout_s=0.005 * rng.random()) == []
        assert _collect(w, last_touch_ns, idle_ms, 300) == []
