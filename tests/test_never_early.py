"""Never early in real time: through a real daemon, measured with a nanosecond clock.

A deadline is ``ceil(now in ms) + delay_ms`` and the daemon fires once its floored
clock reaches it, so an expiration is never handed over before ``delay_ms`` of
real time has passed since the call (or since the last touch of an idle timer).
For an idle timer that holds for every touch the application made before it was
handed the expiration: a touch the daemon had not seen when it fired (stored after
its last read of the touch word) is seen by the library, which arms the timer again
instead of handing the expiration over (``ClientCore._stale_idle``).
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
    """Expirations handed over before ``idle_ms`` of real time since the last touch call
    the application made before it received them (its time read just before the call)."""
    early = []
    for expired, received_ns in expirations:
        before = [t for t in touches_ns[expired.key] if t < received_ns]
        if received_ns - max(before) < idle_ms * 1_000_000:
            early.append((expired.key, (received_ns - max(before)) / 1e6))
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


def test_a_touch_stored_after_the_daemon_fired_the_timer_is_not_followed_by_its_expiration(daemon):
    """The race, made deterministic: the daemon fires an idle timer and writes its
    expiration to the socket; the application touches the key before the library has
    read that frame. Handing the expiration over would follow the touch by far less than
    idle_ms: the library arms the timer again instead (for last touch + idle_ms)."""
    from daemon_harness import wait_until

    idle_ms = 300
    with wheeld.connect(daemon.socket_path, group="touch-race") as w:
        before = daemon.counters()["expirations_total"]
        w.add_idle("conn", idle_ms)
        w.flush()
        wait_until(lambda: daemon.counters()["expirations_total"] > before, 10, what="the daemon to fire it")
        touched_ns = time.monotonic_ns()
        w.touch("conn")  # the frame is in our socket, not read: the library still tracks the key
        got = []
        end = time.monotonic() + 10
        while not got and time.monotonic() < end:
            got += [(e, time.monotonic_ns()) for e in w.poll(0.05)]
        assert got, "the re-armed idle timer never fired"
        expired, received_ns = got[0]
        assert expired.key == "conn"
        assert received_ns - touched_ns >= idle_ms * 1_000_000, (received_ns - touched_ns) / 1e6
        assert expired.fired_ms >= expired.deadline_ms >= touched_ns // 1_000_000 + idle_ms
        assert w.poll(0.3) == []  # the stale expiration was acknowledged, not handed over


def test_two_thousand_idle_timers_of_two_ms_touched_in_a_race_are_never_early(daemon):
    """Idle timers of 2 ms touched at sub-millisecond offsets right around their deadlines:
    every expiration handed over comes idle_ms after every touch made before it."""
    idle_ms = 2
    rng = random.Random(9)
    keys = [f"r{i}" for i in range(2000)]
    touches_ns: dict[str, list[int]] = {key: [] for key in keys}
    received: list = []
    with wheeld.connect(daemon.socket_path, group="never-early-race") as w:
        for start in range(0, len(keys), 100):
            batch = keys[start : start + 100]
            for key in batch:
                touches_ns[key].append(time.monotonic_ns())
                w.add_idle(key, idle_ms)
            for _ in range(rng.randint(1, 4)):  # touch each a few times, around its deadline
                time.sleep(rng.random() / 1000)
                for key in batch:
                    touches_ns[key].append(time.monotonic_ns())
                    try:
                        w.touch(key)
                    except wheeld.InvalidKey:  # handed to the library already: it fired
                        touches_ns[key].pop()
                _receive(w, received, 0)
        end = time.monotonic() + 20
        while len(received) < len(keys) and time.monotonic() < end:
            _receive(w, received, 0.2)
    assert sorted(e.key for e, _ in received) == sorted(keys)
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


def test_a_touch_stored_right_after_the_daemon_read_its_clock_does_not_poison_the_client():
    """The race a loaded host opens: the daemon reads its clock, the client stores a touch
    in the next millisecond (rounded up: two past what the daemon read), then the daemon
    reads the touch word. That client is honest: it is not disconnected, and its timer
    moves to the touch it stored (idle timers of a poisoned client fire at once, early)."""
    import os

    from wheeld.daemon.client_table import ClientSlot
    from wheeld.daemon.config import Config
    from wheeld.daemon.delivery import Delivery
    from wheeld.protocol import clients_layout as CL
    from wheeld.shm.ring import ClientSegment

    segment = ClientSegment.create("touch-race-clock", 8, 4)
    try:
        cs = ClientSlot(2, segment, "touch-race-clock", 0, "g", os.getpid(), os.getuid())
        config = Config(socket_path="/nonexistent/wheeld.sock", name="touch-race-clock")
        base = time.monotonic_ns() // 1_000_000
        reads = []

        def clock():
            # a millisecond later at each read, each read followed by a touch 0.x ms later
            reads.append(base + len(reads) + 1)
            segment._last_touch[1] = reads[-1] + 2
            return reads[-1]

        delivery = Delivery(_NoWheel(), {2: cs}, config, {}, 0, lambda cs, reason: setattr(cs, "poisoned", True),
                            clock)
        segment._last_touch[1] = base + 2  # touched at base + 0.x, after the loop read the clock
        segment._idle[1] = 1_000
        rearm_at, idle_ms = delivery.idle_check(2 << CL.TOUCH_INDEX_BITS | 1, base)
        assert not cs.poisoned
        assert idle_ms == 1_000 and rearm_at >= base + 2 + 1_000
    finally:
        segment.close()


class _NoWheel:
    """Delivery's wheel, for a test that only checks touches."""

    tick_ms, wheel_size = 1, 256
