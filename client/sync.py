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
from wheeld.protocol.errors import BrokenPeer, RingFull, Timeout
from wheeld.protocol.framing import FrameReader

from .core import _FDS_SPACE, ClientCore, Expired, decode_daemon_body, passed_fds
from .handshake import RETRY_FIRST_S, Handshake, Reconnection

# A full ring: wait, sleeping, until this share of it is free again (then refill it in one go)
_ROOM_SHARE = 8
_ROOM_PAUSES_S = (0.00005, 0.001)  # the first sleep between looks, doubled up to the last


class Client(ClientCore):
    """A worker's connection to wheeld. Not thread-safe: one per thread (or guard it).
    Not fork-safe either: a child process that inherited it gets ForkedClient."""

    def __init__(self, socket_path: str | None = None, group: str = "default", *, ring_timeout_s: float = 5.0,
                 reconnect_timeout_s: float = 30.0, connect_timeout_s: float = 10.0, client_name: str = ""):
        super().__init__(socket_path, group, ring_timeout_s, reconnect_timeout_s, client_name)
        self._sock: socket.socket | None = None
        self._reader = FrameReader()
        self._reconnection = Reconnection(self.socket_path, reconnect_timeout_s)
        self._connect(time.monotonic() + connect_timeout_s, first=True)

    # ------------------------------------------------------------------ connection
    def _connect(self, until: float, first: bool) -> None:
        """Open a session before ``until`` (time.monotonic()). The first connect gives up at
        once when nothing listens; a reconnection keeps trying (a restarting daemon)."""
        pause = RETRY_FIRST_S
        while True:
            try:
                self._handshake(max(0.05, until - time.monotonic()))
                return
            except (OSError, BrokenPeer) as exc:
                failure = self._reconnection.attempt_failed(exc, first)  # raises what retrying will not heal
            if time.monotonic() + pause >= until:
                raise failure
            time.sleep(pause)
            pause = Reconnection.next_pause(pause)

    def _handshake(self, timeout_s: float) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        attempt = None
        try:
            sock.settimeout(timeout_s)
            sock.connect(self.socket_path)
            attempt = Handshake(self)
            frame, fds = attempt.frame, attempt.fds
            if fds:
                sent = sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
                sock.sendall(frame[sent:])
            else:
                sock.sendall(frame)
            while True:
                data, ancillary, _flags, _addr = sock.recvmsg(65536, _FDS_SPACE)
                if attempt.received(data, passed_fds(ancillary)):
                    break
            reader = attempt.open()
            sock.setblocking(False)
        except BaseException:
            sock.close()
            if attempt is not None:
                attempt.abandon()
            raise
        if self._sock is not None:
            self._sock.close()
        self._sock = sock
        self._reader = reader
        for body in attempt.rest:
            self._on_message(decode_daemon_body(body))

    def _reconnect(self, until: float | None = None) -> None:
        """Try to get a session back before ``until``; raises BrokenPeer once the daemon has
        been unreachable for ``reconnect_timeout_s``."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        give_up = self._reconnection.lost(time.monotonic())
        try:
            self._connect(give_up if until is None else min(until, give_up), first=False)
        except (BrokenPeer, Timeout) as exc:
            self._reconnection.failed(exc, time.monotonic())  # raises BrokenPeer past give_up
            return  # not yet: the caller's own deadline came first
        self._reconnection.restored()

    def _wait_for_room(self) -> None:
        """Wait until an eighth of the ring is free again, up to ``ring_timeout_s`` (then
        RingFull, unless some room came).

        A full ring means the daemon is a whole ring of commands behind (a few ms of its
        work), so this client sleeps rather than polls: polling (``sched_yield`` in a
        loop) took the cores the daemon needed to catch up, half of a pushing client's
        CPU on a 2-core machine with two such clients. Waiting for an eighth rather than
        one slot refills the ring in one go, instead of a slot or a chunk per wake-up.
        The sleeps start at 50 us and double up to 1 ms."""
        self._ring_doorbell()
        segment = self._segment
        assert segment is not None  # a full ring: there is one
        free_slots = segment.free_slots
        wanted = max(1, segment.ring_capacity // _ROOM_SHARE)
        pause, longest = _ROOM_PAUSES_S
        end = time.monotonic() + self.ring_timeout_s
        while (free := free_slots()) < wanted:
            if time.monotonic() >= end:
                if free:
                    return
                raise RingFull(f"the ring stayed full for {self.ring_timeout_s} s; the daemon is not draining it")
            time.sleep(pause)
            pause = min(pause * 2, longest)

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

        Raises ArenaFull / QuotaExceeded / InvalidRequest for commands pushed before it
        that the daemon refused and no earlier flush raised (never for one pushed after
        it), JournalUnavailable when the daemon applied them but could not write its
        journal (``--journal``: disk full, I/O error; a later flush that succeeds covers
        them), and Timeout (a TimeoutError) if the daemon did not answer within
        ``timeout_s``: a flush never waits longer, also not for a daemon restarting.
        """
        self._check_open()
        end = time.monotonic() + timeout_s
        seq = self._push_flush()
        self._flush_waits(seq)
        try:
            while self._flush_answer(seq) is None:
                remaining = end - time.monotonic()
                if remaining <= 0:
                    raise self._reconnection.not_applied(timeout_s, time.monotonic())
                # The FLUSH record stays in the ring across a daemon restart: the new daemon
                # adopts the ring, applies it and answers on the new connection.
                if not self._read(min(remaining, 0.05), end):
                    self._ring_doorbell()
        except BaseException:
            self._flush_abandoned(seq)  # what its Applied answered goes to the next flush
            raise
        rejected = self._flush_answers.pop(seq)
        assert rejected is not None  # the Applied came: the loop above waited for it
        self._raise_rejections(rejected)

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
    It waits asleep, until an eighth of the ring is free (or some room at the timeout).
    ``reconnect_timeout_s``: how long a lost daemon is waited for before BrokenPeer.
    ``connect_timeout_s``: how long the first handshake may take (a daemon busy starting).
    ``client_name``: shown in the daemon's log and ``wheelctl``.
    """
    return Client(socket_path, group, ring_timeout_s=ring_timeout_s, reconnect_timeout_s=reconnect_timeout_s,
                  connect_timeout_s=connect_timeout_s, client_name=client_name)
