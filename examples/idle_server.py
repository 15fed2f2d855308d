"""An asyncio TCP server on 127.0.0.1 that closes connections idle for ``--idle-ms``.

    python examples/idle_server.py --idle-ms 1000                 # in-process wheel
    python examples/idle_server.py --idle-ms 1000 --daemon SOCK   # idle timers in a wheeld daemon
    python examples/idle_load.py --port PORT --connections 1000   # then drive it

Every connection gets an integer key. ``data_received`` notes the time of the
read, calls ``tracker.touch(key)`` (one store, the timer is not moved) and
echoes (``--no-echo``: reads only). When the tracker reports a key idle the
server checks two things first: its own time of the last read (a read that
raced the report, arriving while the expiration was on its way) and whether
bytes have arrived that the loop has not read yet (``FIONREAD``: a loop running
behind); either way the connection is not idle and its key is armed again
(``add``). Otherwise it closes the transport. So no connection is closed before
``idle_ms`` of real time since the server last read from it, nor while data it
sent waits to be read.

The server prints ``listening on 127.0.0.1:PORT`` once it accepts, one JSON
line per idle close with ``--log-closes``, and a summary on exit (SIGINT or
SIGTERM). It raises its open-file limit to the hard limit at start (a server
holds one descriptor per connection). The blocking twin of this file is
``idle_server_sync.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import itertools
import json
import resource
import signal
import struct
import sys
import termios
import time

import wheeld
from wheeld.idle import IdleTracker


def unread_bytes(fd: int) -> int:
    """Bytes received on socket ``fd`` that nobody has read yet (``ioctl(FIONREAD)``)."""
    try:
        return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
    except OSError:
        return 0


def raise_open_file_limit() -> int:
    """Raise RLIMIT_NOFILE's soft limit to the hard limit; return the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


class IdleServer:
    """The server, usable from other code (the tests and bench/sockets.py run it in their own loop).

    ``tracker``: anything with ``add(key)``, ``touch(key)``, ``remove(key)`` and
    ``aclose()`` that calls ``on_idle(key)`` (``tracker(idle_ms, on_idle)`` builds it);
    by default :class:`wheeld.idle.IdleTracker`, on ``client``'s daemon if given.
    ``recheck=False`` closes on every report without looking at the last read (for a
    tracker that is exact by construction; bench/sockets.py uses it to run the
    usual ``call_later`` server as it is).
    """

    def __init__(self, idle_ms: int, *, host: str = "127.0.0.1", port: int = 0, client=None,
                 log_closes: bool = False, echo: bool = True, tracker=None, recheck: bool = True) -> None:
        if host not in ("127.0.0.1", "::1", "localhost"):
            raise ValueError("this example listens on loopback only")
        self.idle_ms, self.host, self.port = idle_ms, host, port
        self.idle_ns = idle_ms * 1_000_000
        self.client = client
        self.log_closes = log_closes
        self.echo = echo
        self.recheck = recheck
        self._make_tracker = tracker
        self.connections: dict[int, asyncio.Transport] = {}
        self.fds: dict[int, int] = {}  # key -> socket descriptor (for the unread-bytes check)
        self.last_read_ns: dict[int, int] = {}  # key -> monotonic ns of the last read (or of the accept)
        self.closed_idle: list[tuple[int, int, int, int]] = []  # (key, last read ns, close ns, peer port)
        self.accepted = 0
        self.reads = 0
        self.raced = 0  # reports that found a read since: re-armed, not closed
        self._ids = itertools.count(1)
        self.tracker = None
        self.server: asyncio.base_events.Server | None = None

    async def start(self) -> IdleServer:
        if self._make_tracker is not None:
            self.tracker = self._make_tracker(self.idle_ms, self._on_idle)
        else:
            self.tracker = IdleTracker(self.idle_ms, on_idle=self._on_idle, client=self.client)
        self.server = await asyncio.get_running_loop().create_server(self._protocol, self.host, self.port,
                                                                     backlog=4096)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    def _protocol(self) -> asyncio.Protocol:
        return _Connection(self)

    def _on_idle(self, key: int) -> None:
        transport = self.connections.get(key)
        if transport is None:
            return  # closed by the peer meanwhile
        now_ns = time.monotonic_ns()
        last_ns = self.last_read_ns[key]
        if self.recheck and (now_ns - last_ns < self.idle_ns or unread_bytes(self.fds[key])):
            self.raced += 1  # a read raced the report, or bytes wait to be read: not idle after all
            self.tracker.add(key)
            return
        del self.connections[key]
        del self.last_read_ns[key]
        del self.fds[key]
        self.closed_idle.append((key, last_ns, now_ns, (transport.get_extra_info("peername") or ("", 0))[1]))
        if self.log_closes:
            print(json.dumps({"closed_idle": {"key": key, "idle_ms": (now_ns - last_ns) / 1e6,
                                              "peer": transport.get_extra_info("peername")}}), flush=True)
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
                "reads": self.reads, "raced": self.raced, "idle_ms": self.idle_ms,
                "backend": "daemon" if self.client is not None else "in-process"}


class _Connection(asyncio.Protocol):
    __slots__ = ("key", "server", "touch", "transport", "last_read_ns", "echo")

    def __init__(self, server: IdleServer) -> None:
        self.server = server

    def connection_made(self, transport) -> None:
        server = self.server
        self.key = key = next(server._ids)
        self.transport = transport
        self.touch = server.tracker.touch
        self.last_read_ns = server.last_read_ns
        self.echo = server.echo
        server.accepted += 1
        server.connections[key] = transport
        server.fds[key] = transport.get_extra_info("socket").fileno()
        server.last_read_ns[key] = time.monotonic_ns()  # before the add: the tracker's clock starts later
        server.tracker.add(key)

    def data_received(self, data: bytes) -> None:
        self.last_read_ns[self.key] = time.monotonic_ns()  # before the touch, for the same reason
        self.touch(self.key)
        self.server.reads += 1
        if self.echo:
            self.transport.write(data)

    def connection_lost(self, exc) -> None:
        server = self.server
        if server.connections.pop(self.key, None) is not None:  # closed by the peer, not idle
            server.tracker.remove(self.key)
            server.last_read_ns.pop(self.key, None)
            server.fds.pop(self.key, None)


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0, help="0: any free port (printed)")
    parser.add_argument("--idle-ms", type=int, default=30_000)
    parser.add_argument("--daemon", metavar="SOCKET", default=None,
                        help="use a wheeld daemon's idle timers (add_idle/touch) instead of the in-process wheel")
    parser.add_argument("--group", default="idle-server",
                        help="the daemon group of the idle timers (one per server process)")
    parser.add_argument("--no-echo", dest="echo", action="store_false", help="read only, do not echo")
    parser.add_argument("--log-closes", action="store_true")
    args = parser.parse_args(argv)

    raise_open_file_limit()
    client = await wheeld.connect_async(args.daemon, group=args.group) if args.daemon else None
    server = await IdleServer(args.idle_ms, port=args.port, client=client, log_closes=args.log_closes,
                              echo=args.echo).start()
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
