"""The blocking client: ``wheeld.connect()``. See :mod:`wheeld.core` for the semantics.

Connecting fails fast when it cannot work: no socket file or a refused connection
(:class:`~wheeld.DaemonNotRunning`), no permission on the socket or a refusal by
the daemon (:class:`~wheeld.NotAllowed`, :class:`~wheeld.GroupLimit`...). Once a
session existed, losing the daemon is different: the client reconnects by itself
and keeps trying for ``reconnect_timeout_s`` (a restarting daemon), handing its
ring back so that commands pushed meanwhile are applied; a call with its own
timeout (``flush``, ``poll``) never waits past that timeout for it.
"""

from __future__ import annotations

import array
import math
import select
import socket
import time

from wheeld.protocol import messages as M
from wheeld.protocol.errors import BrokenPeer, DaemonNotRunning, NotAllowed, Timeout, WheeldError
from wheeld.protocol.framing import FrameReader

from .core import _FDS_SPACE, ClientCore, Expired, close_quietly, decode_daemon_body, not_applied, passed_fds


class Client(ClientCore):
    """A worker's connection to wheeld. Not thread-safe: one per thread (or guard it).
    Not fork-safe either: a child process that inherited it gets ForkedClient."""

    def __init__(self, socket_path: str | None = None, group: str = "default", *, ring_timeout_s: float = 5.0,
                 reconnect_timeout_s: float = 30.0, connect_timeout_s: float = 10.0, client_name: str = ""):
        super().__init__(socket_path, group, ring_timeout_s, reconnect_timeout_s, client_name)
        self._sock: socket.socket | None = None
        self._reader = FrameReader()
        self._gone_since: float | None = None  # when the daemon went away (reconnecting since)
        self._gone_reason = ""  # why the last attempt to reconnect failed
        self._connect(time.monotonic() + connect_timeout_s, first=True)

    # ------------------------------------------------------------------ connection
    def _connect(self, until: float, first: bool) -> None:
        """Open a session before ``until`` (time.monotonic()). The first connect gives up at
        once when nothing listens; a reconnection keeps trying (a restarting daemon)."""
        delay = 0.01
        while True:
            try:
                self._handshake(max(0.05, until - time.monotonic()))
                return
            except PermissionError as exc:
                raise NotAllowed(f"may not connect to wheeld at {self.socket_path}: {exc.strerror}") from None
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                if first:
                    raise DaemonNotRunning(
                        f"no wheeld listens at {self.socket_path} ({exc.strerror}); start it (`make run`, "
                        f"`systemctl start wheeld`) or point WHEELD_SOCKET / WHEELD_NAME at the running one") from None
                failure: Exception = DaemonNotRunning(f"no wheeld listens at {self.socket_path} ({exc.strerror})")
            except TimeoutError:
                failure = Timeout(f"wheeld at {self.socket_path} did not answer the handshake in time")
            except (OSError, BrokenPeer) as exc:
                if isinstance(exc, WheeldError) and type(exc) is not BrokenPeer:
                    raise  # a refusal: it will not heal by retrying
                failure = BrokenPeer(f"cannot reach wheeld at {self.socket_path}: {exc}")
            if time.monotonic() + delay >= until:
                raise failure
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    def _handshake(self, timeout_s: float) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        received: list[int] = []
        try:
            sock.settimeout(timeout_s)
            sock.connect(self.socket_path)
            frame, fds = self._hello_frame()
            if fds:
                sent = sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
                sock.sendall(frame[sent:])
            else:
                sock.sendall(frame)
            reader = FrameReader()
            while True:
                data, ancillary, _flags, _addr = sock.recvmsg(65536, _FDS_SPACE)
                received += passed_fds(ancillary)
                if not data:
                    raise BrokenPeer("the daemon closed the connection during the handshake")
                frames = reader.feed(data)
                if frames:
                    break
            welcome = self._welcome_of(frames[0])
            taken, received = received, []
            self._on_welcome(welcome, taken)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            for fd in received:
                close_quietly(fd)
            raise
        if self._sock is not None:
            self._sock.close()
        self._sock = sock
        self._reader = reader
        for body in frames[1:]:
            self._on_message(decode_daemon_body(body))

    def _reconnect(self, until: float | None = None) -> None:
        """Try to get a session back before ``until``; raises BrokenPeer once the daemon has
        been unreachable for ``reconnect_timeout_s``."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        now = time.monotonic()
        if self._gone_since is None:
            self._gone_since = now
        give_up = self._gone_since + self.reconnect_timeout_s
        try:
            self._connect(give_up if until is None else min(until, give_up), first=False)
        except (BrokenPeer, Timeout) as exc:
            self._gone_reason = str(exc)
            if time.monotonic() >= give_up:
                raise BrokenPeer(f"wheeld at {self.socket_path} has been unreachable for "
                                 f"{self.reconnect_timeout_s:.0f} s: {exc}") from None
            return  # not yet: the caller's own deadline came first
        self._gone_since = None

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

    def _read(self, timeout_s: float | None, until: float | None = None) -> bool:
        """Wait up to ``timeout_s`` for frames and handle them; False on timeout. A lost
        session is re-opened, trying no later than ``until``."""
        if self._sock is None:
            self._reconnect(until)
            if self._sock is None:
                return False
        if not wait_readable(self._sock.fileno(), timeout_s):
            return False
        try:
            data = self._sock.recv(1 << 20)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            data = b""
        if not data:
            self._reconnect(until)
            return True
        for body in self._reader.feed(data):
            try:
                self._on_message(decode_daemon_body(body))
            except BrokenPeer:
                self._reconnect(until)
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
        end = None if timeout_s is None else time.monotonic() + timeout_s
        if not self._ready:
            while not self._ready:
                remaining = None if end is None else max(0.0, end - time.monotonic())
                if not self._read(remaining if remaining is None else min(remaining, 1.0), end) and end is not None \
                        and time.monotonic() >= end:
                    break
        while self._sock is not None and self._read(0, end):
            pass
        return self._take_ready()

    def __iter__(self):
        while True:
            yield from self.poll(None)

    def flush(self, timeout_s: float = 10.0) -> None:
        """Return once the daemon has applied every command sent before this call.

        Raises ArenaFull / QuotaExceeded / InvalidRequest for commands it refused since
        the last flush, JournalUnavailable when the daemon applied them but could not
        write its journal (``--journal``: disk full, I/O error; a later flush that
        succeeds covers them), and Timeout (a TimeoutError) if the daemon did not answer
        within ``timeout_s``: a flush never waits longer, also not for a daemon restarting.
        """
        self._check_open()
        end = time.monotonic() + timeout_s
        seq = self._push_flush()
        while self._applied != seq:
            remaining = end - time.monotonic()
            if remaining <= 0:
                raise not_applied(timeout_s, self._gone_since, self._gone_reason)
            # The FLUSH record stays in the ring across a daemon restart: the new daemon
            # adopts the ring, applies it and answers on the new connection.
            if not self._read(min(remaining, 0.05), end):
                self._ring_doorbell()
        self._raise_rejections()

    def close(self) -> None:
        """Acknowledge what was handed over, say goodbye, unmap. Pending timers stay.

        In a child process that inherited the client through ``fork()``, only the
        child's copies are dropped: nothing is sent, the parent's session goes on."""
        if self._closed and not self._forked:
            return
        try:
            if self._sock is not None and not self._forked:
                if self._segment is not None:
                    self._flush_acks()
                try:
                    self._sock.setblocking(True)
                    self._sock.settimeout(1.0)
                    self._sock.sendall(M.encode_client_frame(M.Bye()))
                except OSError:
                    pass
            if self._sock is not None:
                self._sock.close()
                self._sock = None
        finally:
            self._closed = True
            self._release_local()

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


def connect(socket_path: str | None = None, group: str = "default", *, ring_timeout_s: float = 5.0,
            reconnect_timeout_s: float = 30.0, connect_timeout_s: float = 10.0, client_name: str = "") -> Client:
    """Connect to wheeld as a member of ``group``.

    ``socket_path``: None finds the daemon by itself (``$WHEELD_SOCKET``, else the
    default path of instance ``$WHEELD_NAME``, see :func:`wheeld.protocol.naming.default_socket_path`).
    ``ring_timeout_s``: how long a command waits for room in a full ring (then RingFull).
    ``reconnect_timeout_s``: how long a lost daemon is waited for before BrokenPeer.
    ``connect_timeout_s``: how long the first handshake may take (a daemon busy starting).
    ``client_name``: shown in the daemon's log and ``wheelctl``.
    """
    return Client(socket_path, group, ring_timeout_s=ring_timeout_s, reconnect_timeout_s=reconnect_timeout_s,
                  connect_timeout_s=connect_timeout_s, client_name=client_name)
