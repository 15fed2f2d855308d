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


def _early_ones(expirations: list, touches_ns: dict, idle_ms: int) -> list:
    """Expirations received before ``idle_ms`` of real time since the last touch the
    daemon could have seen: one made before the millisecond in which it fired
    (``fired_ms``); a touch during or after that millisecond may come after the fire."""
    early = []
    for expired, received_ns in expirations:
        before = [t for t in touches_ns[expired.key] if t < expired.fired_ms * 1_000_000]
        if received_ns - max(before) < idle_ms * 1_000_000:
            early.append(expired.key)
    return early


def _receive(w, out: list, timeout_s: float) -> None:
    for expired in w.poll(timeout_s=timeout_s):
        out.append((expired, time.monotonic_ns()))


def test_idle_timers_through_the_daemon_are_never_early(daemon):
    idle_ms = 40
    rng = random.Random(11)
    touches_ns: dict[str, list[int]] = {}
    received: list = []
    with wheeld.connect(daemon.socket_path, group="never-early-idle") as w:
        # never touched: they fire idle_ms after add_idle
        for i in range(300):
            key = f"quiet-{i}"
            touches_ns[key] = [time.monotonic_ns()]
            w.add_idle(key, idle_ms)
            time.sleep(rng.random() / 5000)  # adds at sub-millisecond offsets: the load
        # active for a while (a touch every few ms, at sub-millisecond offsets), then quiet
        active = [f"active-{i}" for i in range(300)]
        for key in active:
            touches_ns[key] = [time.monotonic_ns()]
            w.add_idle(key, idle_ms)
        deadline = time.monotonic() + 0.1
        while time.monotonic() < deadline:
            rng.shuffle(active)
            for key in active:
                touches_ns[key].append(time.monotonic_ns())
                try:
                    w.touch(key)
                except wheeld.InvalidKey:  # it fired already (a stall longer than idle_ms)
                    touches_ns[key].pop()
            _receive(w, received, 0.005 * rng.random())
        end = time.monotonic() + 20
        while len(received) < 600 and time.monotonic() < end:
            _receive(w, received, 1.0)
    assert sorted(e.key for e, _ in received) == sorted(touches_ns)
    assert _early_ones(received, touches_ns, idle_ms) == []


def test_a_touch_made_after_the_daemon_read_its_clock_is_not_taken_for_a_bad_value():
    """The daemon checks a touch against the clock when it reads it, not against the
    (earlier) clock of its loop iteration: a touch stored in between is legitimate."""
    import os

    from wheeld.daemon.client_table import ClientSlot
    from wheeld.daemon.config import Config
    from wheeld.daemon.delivery import Delivery
    from wheeld.protocol import clients_layout as CL
    from wheeld.shm.ring import ClientSegment

    segment = ClientSegment.create("touch-clock", 8, 4)
    try:
        cs = ClientSlot(2, segment, "touch-clock", 0, "g", os.getpid(), os.getuid())
        config = Config(socket_path="/nonexistent/wheeld.sock", name="touch-clock")
        delivery = Delivery(_NoWheel(), {2: cs}, config, {}, 0, lambda cs, reason: setattr(cs, "poisoned", True),
                            lambda: time.monotonic_ns() // 1_000_000)
        iteration_now = time.monotonic_ns() // 1_000_000 - 50  # the loop read its clock 50 ms ago
        segment._last_touch[1] = -(-time.monotonic_ns() // 1_000_000)  # the client touched just now
        segment._idle[1] = 1_000
        rearm_at, idle_ms = delivery.idle_check(2 << CL.TOUCH_INDEX_BITS | 1, iteration_now)
        assert not cs.poisoned
        assert idle_ms == 1_000 and rearm_at >= iteration_now + 1_000
    finally:
        segment.close()


class _NoWheel:
    """Delivery's wheel, for a test that only checks touches."""

    tick_ms, wheel_size = 1, 256
