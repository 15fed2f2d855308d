"""A task reading the asyncio client can be cancelled at any moment without losing what it read.

``IdleTracker`` (and any application that pauses its reader, e.g. to ``flush()``)
cancels the task blocked in ``AsyncClient.poll``. If the client's read had already
taken bytes off the socket when the cancellation landed, those expirations were
gone: the frames were consumed but never decoded, and the daemon only sent them
again after ``--ack-timeout-s`` (30 s by default). The client now waits for
readability and reads synchronously after the wait, so a cancellation can only hit
the wait, never a read in flight.
"""

import asyncio
import random
import socket
import threading
import time

import pytest
import uvloop

import wheeld


N = 4000


async def _run(socket_path: str) -> tuple[set, int]:
    """Expirations arrive while another socket's callback keeps cancelling the reading task:
    when both sockets are ready in the same loop iteration, the cancellation can land after the
    client's read took bytes and before the task resumed (the window an IdleTracker's flush hits
    when a connection's callback finds the ring full)."""
    loop = asyncio.get_running_loop()
    seen: set = set()
    state = {"task": None, "cancels": 0}
    async with await wheeld.connect_async(socket_path, group="cancel") as w:
        for i in range(N):
            while True:
                try:
                    w.add(i, 300 + (i % 1000))  # due over 0.3-1.3 s
                    break
                except wheeld.RingFull:
                    await w.flush()
        await w.flush()

        async def reader():
            while True:
                for e in await w.poll(None):
                    seen.add(e.key)

        kick_r, kick_w = socket.socketpair()
        kick_r.setblocking(False)
        stop = threading.Event()

        def kicker():
            rng = random.Random(7)
            while not stop.is_set():
                kick_w.send(b"k")
                time.sleep(rng.random() * 0.0005)  # kicks at random moments: the race

        def on_kick():
            try:
                kick_r.recv(4096)
            except BlockingIOError:
                return
            state["task"].cancel()  # synchronously, from another socket's callback
            state["cancels"] += 1
            state["task"] = loop.create_task(reader())

        state["task"] = loop.create_task(reader())
        loop.add_reader(kick_r.fileno(), on_kick)
        thread = threading.Thread(target=kicker, daemon=True)
        thread.start()
        try:
            end = time.monotonic() + 8.0  # well under the daemon's 30 s ack timeout: no redelivery helps
            while len(seen) < N and time.monotonic() < end:
                await asyncio.sleep(0.05)  # the loop runs the readers meanwhile; the count is checked after
        finally:
            stop.set()
            thread.join()
            loop.remove_reader(kick_r.fileno())
            state["task"].cancel()
            try:
                await state["task"]
            except asyncio.CancelledError:
                pass
            kick_r.close()
            kick_w.close()
    return seen, state["cancels"]


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_cancelled_readers_lose_no_expiration(daemon, loop):
    if loop == "uvloop":
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            seen, cancels = runner.run(_run(daemon.socket_path))
    else:
        seen, cancels = asyncio.run(_run(daemon.socket_path))
    assert cancels > 100, cancels  # the reader was interrupted often
    missing = sorted(set(range(N)) - seen)
    assert not missing, f"{len(missing)} of {N} expirations lost to cancelled reads (first: {missing[:10]})"
