"""The blocking client: ``wheeld.connect()``. See :mod:`wheeld.core` for the semantics."""

from __future__ import annotations

import math
import select
import socket
import time

from wheeld.protocol import messages as M
from wheeld.protocol.errors import BrokenPeer, ProtocolError
from wheeld.protocol.framing import FrameReader

from .core import ClientCore, Expired, decode_daemon_body


class Client(ClientCore):
    """A worker's connection to wheeld. Not thread-safe: one per thread (or guard it)."""

    def __init__(self, socket_path: str | None = None, group: str = "default", *, ring_timeout_s: float = 5.0,
                 reconnect_timeout_s: float = 30.0, connect_timeout_s: float = 10.0, client_name: str = ""):
        super().__init__(socket_path, group, ring_timeout_s, reconnect_timeout_s, client_name)
        self._sock: socket.socket | None = None
        self._reader = FrameReader()
        self._connect(connect_timeout_s)

    # ------------------------------------------------------------------ connection
    def _connect(self, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        delay = 0.01
        while True:
            try:
                self._handshake(max(0.1, end - time.monotonic()))
                return
            except (OSError, BrokenPeer) as exc:
                if isinstance(exc, BrokenPeer) and "refused the session" in str(exc):
                    raise
                if time.monotonic() >= end:
                    raise BrokenPeer(f"cannot reach wheeld at {self.socket_path}: {exc}") from exc
                time.sleep(delay)
                delay = min(delay * 2, 0.5)

    def _handshake(self, timeout_s: float) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout_s)
            sock.connect(self.socket_path)
            sock.sendall(M.encode_client_frame(self._hello()))
            reader = FrameReader()
            while True:
                data = sock.recv(65536)
                if not data:
                    raise BrokenPeer("the daemon closed the connection during the handshake")
                frames = reader.feed(data)
                if frames:
                    break
            message = decode_daemon_body(frames[0])
            if type(message) is M.Refused:
                raise BrokenPeer(f"the daemon refused the session: {message.reason}")
            if type(message) is not M.Welcome:
                raise ProtocolError(f"expected Welcome, got {type(message).__name__}")
            self._on_welcome(message)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        if self._sock is not None:
            self._sock.close()
        self._sock = sock
        self._reader = reader
        for body in frames[1:]:
            self._on_message(decode_daemon_body(body))

    def _reconnect(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._connect(self.reconnect_timeout_s)

    def _ring_doorbell(self, urgent: bool = True) -> None:
        sock = self._sock
        if sock is None:
            return
        try:
            sock.send(_DOORBELL_URGENT if urgent else _DOORBELL)
        except (BlockingIOError, InterruptedError):
            pass  # the socket buffer is full of doorbells already: the daemon is awake enough
        except OSError:
            pass  # a dead daemon: the next poll/flush reconnects

    def _read(self, timeout_s: float | None) -> bool:
        """Wait up to ``timeout_s`` for frames and handle them; False on timeout."""
        if self._sock is None:
            self._reconnect()
        if not wait_readable(self._sock.fileno(), timeout_s):
            return False
        try:
            data = self._sock.recv(1 << 20)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            data = b""
        if not data:
            self._reconnect()
            return True
        for body in self._reader.feed(data):
            try:
                self._on_message(decode_daemon_body(body))
            except BrokenPeer:
                self._reconnect()
                return True
        return True

    # ------------------------------------------------------------------ public
    def fileno(self) -> int:
        """The socket expirations arrive on, for a selector/poll loop (-1 between connections).

        When it is readable, ``poll(0)`` returns what arrived. It changes when the
        client reconnects (inside ``poll``/``flush``): read it again after each call."""
        return self._sock.fileno() if self._sock is not None else -1

    def poll(self, timeout_s: float | None = None) -> list[Expired]:
        """Expirations that came due; waits up to ``timeout_s`` (None: until at least one)."""
        self._check_open()
        self._flush_acks()
        if not self._ready:
            end = None if timeout_s is None else time.monotonic() + timeout_s
            while not self._ready:
                remaining = None if end is None else max(0.0, end - time.monotonic())
                if not self._read(remaining if remaining is None else min(remaining, 1.0)) and end is not None \
                        and time.monotonic() >= end:
                    break
        while self._sock is not None and self._read(0):
            pass
        return self._take_ready()

    def __iter__(self):
        while True:
            yield from self.poll(None)

    def flush(self, timeout_s: float = 10.0) -> None:
        """Return once the daemon has applied every command sent before this call.

        Raises ArenaFull / InvalidRequest for commands it refused since the last flush,
        TimeoutError if the daemon did not answer in time.
        """
        self._check_open()
        seq = self._push_flush()
        end = time.monotonic() + timeout_s
        while self._applied != seq:
            remaining = end - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"wheeld did not apply the commands within {timeout_s} s")
            # The FLUSH record stays in the ring across a daemon restart: the new daemon
            # applies it and answers on the new connection.
            if not self._read(min(remaining, 0.05)):
                self._ring_doorbell()
        self._raise_rejections()

    def close(self) -> None:
        """Acknowledge what was handed over, say goodbye, unmap. Pending timers stay."""
        if self._closed:
            return
        try:
            if self._segment is not None:
                self._flush_acks()
            if self._sock is not None:
                try:
                    self._sock.setblocking(True)
                    self._sock.settimeout(1.0)
                    self._sock.sendall(M.encode_client_frame(M.Bye()))
                except OSError:
                    pass
                self._sock.close()
        finally:
            self._closed = True
            if self._segment is not None:
                self._segment.close()
            if self._arena is not None:
                self._parked = None
                self._arena.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def wait_readable(fd: int, timeout_s: float | None) -> bool:
    """Wait up to ``timeout_s`` (None: forever) until ``fd`` is readable or hung up.

    ``poll(2)``, not ``select(2)``: select refuses descriptors at or above
    FD_SETSIZE (1024), which a server holding thousands of sockets reaches before
    it connects to wheeld. The timeout is rounded up to whole ms (poll's unit), so
    a sub-millisecond wait does not turn into a busy loop.
    """
    poller = select.poll()
    poller.register(fd, _READABLE)
    return bool(poller.poll(None if timeout_s is None else math.ceil(max(0.0, timeout_s) * 1000)))


_READABLE = select.POLLIN | select.POLLPRI
_DOORBELL = M.encode_client_frame(M.Doorbell())
_DOORBELL_URGENT = M.encode_client_frame(M.Doorbell(urgent=True))


def connect(socket_path: str | None = None, group: str = "default", **options) -> Client:
    """Connect to wheeld (``$WHEELD_SOCKET`` or the default path) as a member of ``group``."""
    return Client(socket_path, group, **options)
