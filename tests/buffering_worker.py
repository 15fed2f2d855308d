"""A worker whose application does not poll: python buffering_worker.py JSON_ARGS.

It takes one command a line on stdin and answers each with one JSON line on stdout:

    add N DELAY_MS   add keys k0..k{N-1} (DELAY_MS from now) and flush
    buffer N         flush until N expirations wait in the library's buffer (the
                     application has not polled: a flush reads them off the socket)
    copies N         flush until N expirations (first copies and copies sent again)
                     have arrived since the start, then flush once more (that flush
                     pushes whatever acknowledgements the library has queued)
    flush            flush once
    poll             poll(0.5): what the application is handed
    push N           push N adds (keys p0..p{N-1}, an hour ahead) without a flush, then
                     poll(0): the acknowledgements queued go into the ring behind them
    state            the library's buffer and queued acknowledgements

Answers carry ``buffered`` (expirations received, not handed), ``acks`` (queued
acknowledgements, not pushed yet) and ``copies``. ``"aio": true`` runs the same on
the asyncio client. The test SIGKILLs the process: a worker that dies without polling.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import wheeld
from wheeld.aio import AsyncClient
from wheeld.protocol import messages as M
from wheeld.sync import Client


class CountingClient(Client):
    """Counts the expirations that arrive (every copy), as the library's receive path sees them."""

    copies = 0

    def _on_message(self, message) -> None:
        if type(message) is M.Expirations or type(message) is M.ExpirationRows:
            self.copies += len(message.items)
        super()._on_message(message)


class CountingAsyncClient(AsyncClient):
    copies = 0

    def _on_message(self, message) -> None:
        if type(message) is M.Expirations or type(message) is M.ExpirationRows:
            self.copies += len(message.items)
        super()._on_message(message)


def state(w) -> dict:
    return {"buffered": len(w._ready), "acks": len(w._to_ack) + len(w._acks_pending), "copies": w.copies}


async def run(args: dict, lines) -> None:
    aio = args.get("aio", False)
    if aio:
        w = CountingAsyncClient(args["socket"], args["group"], 30.0, 60.0, "buffering")
        await w._connect(time.monotonic() + 30, first=True)
    else:
        w = CountingClient(args["socket"], args["group"], reconnect_timeout_s=60, connect_timeout_s=30)

    async def flush() -> None:
        if aio:
            await w.flush(timeout_s=30)
        else:
            w.flush(timeout_s=30)

    async def flush_until(done) -> None:
        end = time.monotonic() + 60
        while not done():
            if time.monotonic() > end:
                raise AssertionError(f"not reached in 60 s: {state(w)}")
            await flush()
            await asyncio.sleep(0.01)

    async for line in lines:
        words = line.split()
        answer: dict = {}
        if words[0] == "add":
            n, delay = int(words[1]), int(words[2])
            answer["deadlines"] = [w.add(f"k{i}", delay) for i in range(n)]
            await flush()
        elif words[0] == "buffer":
            await flush_until(lambda: len(w._ready) >= int(words[1]))  # noqa: B023 - awaited here
        elif words[0] == "copies":
            await flush_until(lambda: w.copies >= int(words[1]))  # noqa: B023 - awaited here
            await flush()
        elif words[0] == "flush":
            await flush()
        elif words[0] == "poll":
            got = await w.poll(0.5) if aio else w.poll(0.5)
            answer["keys"] = [e.key for e in got]
        elif words[0] == "push":
            for i in range(int(words[1])):
                w.add(f"p{i}", 3_600_000)
            got = await w.poll(0) if aio else w.poll(0)
            answer["keys"] = [e.key for e in got]
        answer.update(state(w))
        print(json.dumps(answer), flush=True)


async def stdin_lines():
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            return
        if line.strip():
            yield line


if __name__ == "__main__":
    assert wheeld  # the import installs the pure-Python finder when WHEELD_PURE_PYTHON=1
    asyncio.run(run(json.loads(sys.argv[1]), stdin_lines()))
