"""A blocking TCP server on 127.0.0.1 (one ``selectors`` loop, no asyncio) that closes
connections idle for ``--idle-ms`` through a wheeld daemon.

    wheeld --socket /tmp/wheeld.sock &                                   # a daemon
    python examples/idle_server_sync.py --daemon /tmp/wheeld.sock --idle-ms 1000
    python examples/idle_load.py --port PORT --connections 1000          # then drive it

The loop watches the listening socket, every connection, and the wheeld
client's own socket (``client.fileno()``) with one epoll selector:

* accept: ``client.add_idle(key, idle_ms)``, one ring record;
* a read: note the time, ``client.touch(key)`` (one 8-byte store in shared
  memory, no system call), echo unless ``--no-echo``;
* the client's socket readable: ``client.poll(0)`` returns the keys the daemon
  found idle; each is closed, unless the server read from it in the meantime
  (a read that raced the expiration) or bytes wait in it unread (``FIONREAD``:
  the loop is behind): then it is armed again. Expirations are handled before
  the reads of the same batch;
* a connection closed by its peer: ``client.cancel(key)``.

So the only per-packet cost of idle detection is the store; the daemon re-arms
an active connection's timer once per idle period, and no connection is closed
before ``idle_ms`` of real time since the server last read from it. The
client's socket changes when it reconnects to a restarted daemon, so the loop
re-reads ``client.fileno()`` after every ``poll``. Everything runs in one
thread; ``stop()`` may be called from another thread or a signal handler.

The server prints ``listening on 127.0.0.1:PORT``, one JSON line per idle close
with ``--log-closes``, and a summary on exit (SIGINT or SIGTERM). It raises its
open-file limit to the hard limit at start. The asyncio twin of this file is
``idle_server.py``.
"""

from __future__ import annotations

import argparse
import fcntl
import itertools
import json
import resource
import selectors
import signal
import socket
import struct
import sys
import termios
import time

import wheeld

_ACCEPT = object()
_WHEELD = object()
_WAKE = object()


def unread_bytes(sock: socket.socket) -> int:
    """Bytes received on ``sock`` that nobody has read yet (``ioctl(FIONREAD)``)."""
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]
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


class SyncIdleServer:
    """The server, usable from other code (the tests and bench/sockets.py run it).

    ``client`` is a blocking wheeld client (``wheeld.connect(...)``) that this
    server uses alone: its group should be this server's own.
    """

    def __init__(self, idle_ms: int, client, *, host: str = "127.0.0.1", port: int = 0, echo: bool = True,
                 log_closes: bool = False) -> None:
        if host not in ("127.0.0.1", "::1", "localhost"):
            raise ValueError("this example listens on loopback only")
        self.idle_ms, self.idle_ns = idle_ms, idle_ms * 1_000_000
        self.client = client
        self.echo, self.log_closes = echo, log_closes
        self.connections: dict[int, socket.socket] = {}
        self.last_read_ns: dict[int, int] = {}  # key -> monotonic ns of the last read (or of the accept)
        self.closed_idle: list[tuple[int, int, int, int]] = []  # (key, last read ns, close ns, peer port)
        self.accepted = 0
        self.reads = 0
        self.raced = 0  # reports that found a read since: re-armed, not closed
        self._ids = itertools.count(1)
        self._periodic: list[list] = []  # [next_ns, interval_ns, fn]
        self._stopping = False
        self._selector = selectors.DefaultSelector()
        self._listener = socket.create_server((host, port), backlog=4096)
        self._listener.setblocking(False)
        self.host, self.port = host, self._listener.getsockname()[1]
        self._selector.register(self._listener, selectors.EVENT_READ, _ACCEPT)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        self._client_fd = -1
        self._watch_client()

    # ------------------------------------------------------------------ control
    def every(self, interval_s: float, fn) -> None:
        """Call ``fn(due_ns)`` from the loop every ``interval_s`` (a periodic task without threads).

        ``due_ns`` is the ``time.monotonic_ns()`` it was due at (so ``fn`` can tell how late the loop
        ran it); a period missed while the loop was busy is skipped, not made up."""
        interval_ns = int(interval_s * 1e9)
        self._periodic.append([time.monotonic_ns() + interval_ns, interval_ns, fn])

    def stop(self) -> None:
        """Make ``serve_forever`` return (thread- and signal-safe)."""
        self._stopping = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def close(self) -> None:
        """Close every connection, cancel their timers, close the listener (the client stays open)."""
        for key, sock in list(self.connections.items()):
            self.client.cancel(key)
            sock.close()
        self.connections.clear()
        self.last_read_ns.clear()
        try:
            self.client.flush()
        except Exception:
            pass
        self._selector.close()
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()

    def summary(self) -> dict:
        return {"accepted": self.accepted, "open": len(self.connections), "closed_idle": len(self.closed_idle),
                "reads": self.reads, "raced": self.raced, "idle_ms": self.idle_ms, "backend": "daemon"}

    # ------------------------------------------------------------------ the loop
    def serve_forever(self) -> None:
        select, monotonic_ns = self._selector.select, time.monotonic_ns
        last_read_ns = self.last_read_ns
        touch, echo = self.client.touch, self.echo
        periodic = self._periodic
        while not self._stopping:
            timeout = None
            if periodic:
                timeout = max(0.0, (min(p[0] for p in periodic) - monotonic_ns()) / 1e9)
            events = select(timeout)
            for key, _mask in events:  # expirations first: closes are not held up by a batch of reads
                if key.data is _WHEELD:
                    self._on_expirations()
                    break
            for key, _mask in events:
                data = key.data
                if type(data) is int:  # a connection
                    try:
                        chunk = key.fileobj.recv(65536)
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError:
                        chunk = b""
                    if chunk:
                        last_read_ns[data] = monotonic_ns()  # before the touch: the daemon's clock starts later
                        try:
                            touch(data)
                        except wheeld.InvalidKey:  # its timer is not armed here (cannot happen in this loop)
                            self.client.add_idle(data, self.idle_ms)
                        self.reads += 1
                        if echo:
                            try:
                                key.fileobj.send(chunk)
                            except OSError:
                                pass  # a full send buffer: this example drops the echo
                    else:
                        self._closed_by_peer(data)
                elif data is _WHEELD:
                    pass  # handled above
                elif data is _ACCEPT:
                    self._accept()
                else:
                    try:
                        self._wake_r.recv(4096)
                    except OSError:
                        pass
            if periodic:
                now = monotonic_ns()
                for p in periodic:
                    due = p[0]
                    if now >= due:
                        p[0] = due + p[1] if due + p[1] > now else now + p[1]
                        p[2](due)

    def _accept(self) -> None:
        for _ in range(512):  # a burst of connects: take up to 512 per readiness
            try:
                sock, _peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # e.g. EMFILE: leave the rest in the backlog for now
                return
            sock.setblocking(False)
            key = next(self._ids)
            self.accepted += 1
            self.connections[key] = sock
            self.last_read_ns[key] = time.monotonic_ns()  # before add_idle, for the same reason
            self.client.add_idle(key, self.idle_ms)
            self._selector.register(sock, selectors.EVENT_READ, key)

    def _closed_by_peer(self, key: int) -> None:
        sock = self.connections.pop(key, None)
        if sock is None:
            return
        del self.last_read_ns[key]
        self._selector.unregister(sock)
        sock.close()
        self.client.cancel(key)

    def _on_expirations(self) -> None:
        client = self.client
        for expired in client.poll(0):
            key = expired.key
            sock = self.connections.get(key)
            if sock is None:
                continue  # closed by the peer meanwhile
            now_ns = time.monotonic_ns()
            last_ns = self.last_read_ns[key]
            if now_ns - last_ns < self.idle_ns or unread_bytes(sock):
                self.raced += 1  # a read raced the expiration, or bytes wait to be read: not idle
                client.add_idle(key, self.idle_ms)
                continue
            del self.connections[key]
            del self.last_read_ns[key]
            self._selector.unregister(sock)
            try:
                peer_port = sock.getpeername()[1]
            except OSError:
                peer_port = 0
            sock.close()
            self.closed_idle.append((key, last_ns, now_ns, peer_port))
            if self.log_closes:
                print(json.dumps({"closed_idle": {"key": key, "idle_ms": (now_ns - last_ns) / 1e6}}), flush=True)
        self._watch_client()

    def _watch_client(self) -> None:
        """(Re-)register the client's socket: it is a new one after a reconnect."""
        fd = self.client.fileno()
        if fd == self._client_fd:
            return
        if self._client_fd >= 0:
            try:
                self._selector.unregister(self._client_fd)
            except (KeyError, ValueError):
                pass
        self._client_fd = fd
        if fd >= 0:
            self._selector.register(fd, selectors.EVENT_READ, _WHEELD)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0, help="0: any free port (printed)")
    parser.add_argument("--idle-ms", type=int, default=30_000)
    parser.add_argument("--daemon", metavar="SOCKET", default=None, help="wheeld's socket (default: $WHEELD_SOCKET)")
    parser.add_argument("--group", default="idle-server-sync",
                        help="the daemon group of the idle timers (one per server process)")
    parser.add_argument("--no-echo", dest="echo", action="store_false", help="read only, do not echo")
    parser.add_argument("--log-closes", action="store_true")
    args = parser.parse_args(argv)

    raise_open_file_limit()
    with wheeld.connect(args.daemon, group=args.group) as client:
        server = SyncIdleServer(args.idle_ms, client, port=args.port, echo=args.echo, log_closes=args.log_closes)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: server.stop())
        print(f"listening on {server.host}:{server.port} idle_ms={args.idle_ms} backend=daemon", flush=True)
        try:
            server.serve_forever()
        finally:
            summary = server.summary()
            server.close()
    print(json.dumps({"summary": summary}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
