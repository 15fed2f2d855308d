"""An asyncio TCP echo server on 127.0.0.1 that closes connections idle for ``--idle-ms``.

    python examples/idle_server.py --idle-ms 1000                 # in-process wheel
    python examples/idle_server.py --idle-ms 1000 --daemon SOCK   # idle timers in a wheeld daemon
    python examples/idle_load.py --port PORT --connections 1000   # then drive it

Every connection gets an integer key; ``data_received`` echoes and calls
``tracker.touch(key)`` (one store, the timer is not moved); ``on_idle`` closes the
transport. The server prints ``listening on 127.0.0.1:PORT`` once it accepts, one
JSON line per idle close when ``--log-closes`` is given, and a summary on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import sys
import time

import wheeld
from wheeld.idle import IdleTracker


class IdleServer:
    """The server, usable from other code (the tests run it in their own loop)."""

    def __init__(self, idle_ms: int, *, host: str = "127.0.0.1", port: int = 0, client=None,
                 log_closes: bool = False) -> None:
        if host not in ("127.0.0.1", "::1", "localhost"):
            raise ValueError("this example listens on loopback only")
        self.idle_ms, self.host, self.port = idle_ms, host, port
        self.client = client
        self.log_closes = log_closes
        self.connections: dict[int, asyncio.Transport] = {}
        self.last_activity_ns: dict[int, int] = {}  # for the report only (the tracker keeps its own)
        self.closed_idle: list[dict] = []
        self.accepted = 0
        self._ids = itertools.count(1)
        self.tracker: IdleTracker | None = None
        self.server: asyncio.base_events.Server | None = None

    async def start(self) -> IdleServer:
        self.tracker = IdleTracker(self.idle_ms, on_idle=self._on_idle, client=self.client)
        self.server = await asyncio.get_running_loop().create_server(self._protocol, self.host, self.port)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    def _protocol(self) -> asyncio.Protocol:
        return _Connection(self)

    def _on_idle(self, key: int) -> None:
        transport = self.connections.pop(key, None)
        if transport is None:
            return
        now_ns = time.monotonic_ns()
        record = {"key": key, "idle_ms": (now_ns - self.last_activity_ns.pop(key, now_ns)) / 1e6,
                  "peer": transport.get_extra_info("peername")}
        self.closed_idle.append(record)
        if self.log_closes:
            print(json.dumps({"closed_idle": record}), flush=True)
        transport.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            for transport in list(self.connections.values()):
                transport.close()
            await self.server.wait_closed()
        if self.tracker is not None:
            await self.tracker.aclose()

    def summary(self) -> dict:
        return {"accepted": self.accepted, "open": len(self.connections), "closed_idle": len(self.closed_idle),
                "idle_ms": self.idle_ms, "backend": "daemon" if self.client is not None else "in-process"}


class _Connection(asyncio.Protocol):
    __slots__ = ("key", "server", "touch", "transport")

    def __init__(self, server: IdleServer) -> None:
        self.server = server

    def connection_made(self, transport) -> None:
        server = self.server
        self.key = key = next(server._ids)
        self.transport = transport
        self.touch = server.tracker.touch
        server.accepted += 1
        server.connections[key] = transport
        server.last_activity_ns[key] = time.monotonic_ns()
        server.tracker.add(key)

    def data_received(self, data: bytes) -> None:
        self.touch(self.key)
        self.server.last_activity_ns[self.key] = time.monotonic_ns()
        self.transport.write(data)

    def connection_lost(self, exc) -> None:
        server = self.server
        if server.connections.pop(self.key, None) is not None:  # closed by the peer, not idle
            server.tracker.remove(self.key)
            server.last_activity_ns.pop(self.key, None)


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0, help="0: any free port (printed)")
    parser.add_argument("--idle-ms", type=int, default=30_000)
    parser.add_argument("--daemon", metavar="SOCKET", default=None,
                        help="use a wheeld daemon's idle timers (add_idle/touch) instead of the in-process wheel")
    parser.add_argument("--group", default=f"idle-server-{os.getpid()}")
    parser.add_argument("--log-closes", action="store_true")
    args = parser.parse_args(argv)

    client = await wheeld.connect_async(args.daemon, group=args.group) if args.daemon else None
    server = await IdleServer(args.idle_ms, port=args.port, client=client, log_closes=args.log_closes).start()
    print(f"listening on {server.host}:{server.port} idle_ms={args.idle_ms} "
          f"backend={'daemon' if client else 'in-process'}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.close()
    if client is not None:
        await client.close()
    print(json.dumps({"summary": server.summary()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
