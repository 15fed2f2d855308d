"""wheeld.idle: idle keys reported once, only when idle, never early; real loopback sockets.

The tracker alone (in-process wheel): lazy re-arm keeps one timer per key however
many touches; removed keys are never reported. Then the example server
(examples/idle_server.py) in this test's loop, with real client sockets on
127.0.0.1, some kept active: only the silent ones are closed, each no earlier
than ``idle_ms`` after the client's last send; then the same with the daemon's
idle timers; then the load script end to end in subprocesses.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from daemon_harness import wait_until_async
import wheeld
from wheeld.idle import IdleTracker
from wheeld.protocol.errors import InvalidRequest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"wheeld_example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------- the tracker


def test_tracker_reports_idle_keys_once_never_early_and_rearms_lazily():
    async def main():
        reported: dict[int, int] = {}
        tracker = IdleTracker(200, on_idle=lambda key: reported.setdefault(key, time.monotonic_ns()))
        last_activity = {}
        for key in range(6):
            last_activity[key] = time.monotonic_ns()
            tracker.add(key)
        assert len(tracker) == 6 and len(tracker._wheel) == 6
        tracker.remove(5)  # removed: never reported
        for _ in range(25):  # keys 0 and 1 stay active for ~400 ms: many touches, one timer each
            await asyncio.sleep(0.015)  # the pace of the activity: well under the idle time
            for key in (0, 1):
                last_activity[key] = time.monotonic_ns()
                tracker.touch(key)
            assert len(tracker._wheel) <= 5
        tracker.touch("never-added")  # ignored
        assert set(reported) == {2, 3, 4}
        await wait_until_async(lambda: set(reported) == {0, 1, 2, 3, 4}, 5, "keys 0 and 1 reported once quiet")
        for key, at_ns in reported.items():
            assert at_ns - last_activity[key] >= 200_000_000, f"key {key} reported early"
        assert tracker.idle_total == 5 and len(tracker) == 0 and len(tracker._wheel) == 0
        tracker.touch(2)  # an idle key is no longer tracked: touching it is harmless
        tracker.add(2)  # ...and it can be tracked again
        assert 2 in tracker and 3 not in tracker
        await tracker.aclose()

    asyncio.run(main())


def test_tracker_as_async_iterator_and_growth():
    async def main():
        tracker = IdleTracker(30, capacity=4)
        for key in range(50):
            tracker.add(f"conn-{key}")
        seen = []
        async for key in tracker:
            seen.append(key)
            if len(seen) == 50:
                break
        assert sorted(seen) == sorted(f"conn-{k}" for k in range(50))
        await tracker.aclose()
        with pytest.raises(wheeld.Closed):
            tracker.add("late")

    asyncio.run(main())


def test_tracker_rejects_bad_arguments():
    async def main():
        with pytest.raises(InvalidRequest):
            IdleTracker(0)
        tracker = IdleTracker(100, on_idle=print)
        with pytest.raises(wheeld.InvalidKey):
            tracker.add(("not", "a", "key"))
        with pytest.raises(InvalidRequest):
            tracker.__aiter__()
        await tracker.aclose()

    asyncio.run(main())


# --------------------------------------------------------------------------- real sockets


async def _exercise_server(client, idle_ms: int, slack_ms: float) -> None:
    """3 active + 3 silent loopback connections; later the active ones fall silent too."""
    server_mod = load_example("idle_server")
    server = await server_mod.IdleServer(idle_ms, client=client).start()
    try:
        conns = []
        for i in range(6):
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            conns.append({"reader": reader, "writer": writer, "active": i < 3, "last_send_ns": 0, "eof_ns": 0})

        async def send(conn):
            conn["last_send_ns"] = time.monotonic_ns()  # before the write: the server sees it later
            conn["writer"].write(b"ping")
            await conn["writer"].drain()

        async def watch_eof(conn):
            while True:
                data = await conn["reader"].read(4096)
                if not data:
                    conn["eof_ns"] = time.monotonic_ns()
                    return

        for conn in conns:
            await send(conn)
        await server.tracker.flush()  # daemon: pauses and resumes the tracker's reader; in-process: no-op
        watchers = [asyncio.ensure_future(watch_eof(c)) for c in conns]
        active_until = time.monotonic() + 3 * idle_ms / 1000
        while time.monotonic() < active_until:  # active: well under the idle time between sends
            await asyncio.sleep(idle_ms / 6000)
            for conn in conns[:3]:
                await send(conn)
        silent_closed = [c["eof_ns"] != 0 for c in conns[3:]]
        active_closed = [c["eof_ns"] != 0 for c in conns[:3]]
        assert all(silent_closed), "a silent connection was not closed"
        assert not any(active_closed), "an active connection was closed as idle"
        assert server.tracker.idle_total == 3 and len(server.connections) == 3
        # now the active ones fall silent: they are closed too, idle_ms after their last send
        await asyncio.wait_for(asyncio.gather(*watchers), timeout=10 + idle_ms / 1000)
        for conn in conns:
            waited_ms = (conn["eof_ns"] - conn["last_send_ns"]) / 1e6
            assert waited_ms >= idle_ms - slack_ms, f"closed {waited_ms:.3f} ms after the last send: early"
        assert len(server.closed_idle) == 6 and not server.connections
        for conn in conns:
            conn["writer"].close()
    finally:
        await server.close()


def test_example_server_closes_only_idle_sockets_never_early():
    asyncio.run(_exercise_server(None, idle_ms=300, slack_ms=0.0))


def test_example_server_on_daemon_idle_timers(daemon):
    async def main():
        client = await wheeld.connect_async(daemon.socket_path, group="idle-test")
        try:
            # the daemon's clock and the client's touch store whole ms (rounded down): 1 ms slack
            await _exercise_server(client, idle_ms=300, slack_ms=1.0)
        finally:
            await client.close()

    asyncio.run(main())


def test_load_script_against_the_example_server():
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "idle_load.py"), "--spawn-server", "--idle-ms", "300",
         "--connections", "40", "--active", "0.5", "--interval-ms", "60", "--duration-s", "1.0"],
        capture_output=True, text=True, timeout=60,
    )
    result = json.loads(out.stdout)
    assert out.returncode == 0, (result, out.stderr)
    assert result["ok"] and result["silent_closed"] == 20 and result["active_closed"] == 0
    assert result["close_after_last_send_ms"]["min"] >= 300


def test_daemon_tracker_keeps_adds_and_removes_that_find_the_ring_full(daemon):
    """The asyncio client raises RingFull at once when its ring is full; the tracker keeps
    those adds and removes and sends them, in order, after a flush: nothing is lost."""

    async def main():
        client = await wheeld.connect_async(daemon.socket_path, group="idle-ringfull")
        reported: list = []
        tracker = IdleTracker(200, on_idle=reported.append, client=client)
        real_add_idle, real_cancel = client.add_idle, client.cancel
        full = {"left": 3}

        def flaky(real):
            def call(*args):
                if full["left"] > 0:
                    full["left"] -= 1
                    raise wheeld.RingFull("the ring is full (injected)")
                return real(*args)
            return call

        client.add_idle, client.cancel = flaky(real_add_idle), flaky(real_cancel)
        try:
            for key in ("a", "b", "c", "d", "e"):
                tracker.add(key)  # a, b, c find the ring full; d and e queue behind them
            assert len(tracker) == 5 and list(tracker._unsent) == ["a", "b", "c", "d", "e"]
            tracker.remove("e")  # never sent: a cancel queued behind its add (harmless)
            await tracker.flush()
            assert not tracker._unsent
            await wait_until_async(lambda: len(reported) == 4, 5, "four keys reported idle")
            assert sorted(reported) == ["a", "b", "c", "d"]
        finally:
            await tracker.aclose()
            del client.add_idle, client.cancel
            await client.close()

    asyncio.run(main())
