"""Simulated clients that run the real client library, over an in-memory connection.

:class:`SimClient` is the client library's state machine (:class:`wheeld.core.ClientCore`:
the ring, the touch table, the tags, the exactly-once bookkeeping, acknowledgements
and replay) under a third I/O shell beside the blocking and the asyncio one. It
opens and reopens its session with the same :mod:`wheeld.handshake` objects they
use, and it never blocks: the simulator runs every client and the daemon in one
thread, so

* a full ring raises RingFull at once (:meth:`ClientCore._wait_for_room`);
* :meth:`SimClient.flush` pushes the FLUSH and returns its number; the flush's
  outcome (None, or the error the blocking ``flush()`` would raise) comes out of a
  later :meth:`SimClient.poll`, once the daemon's ``Applied`` was read;
* :meth:`SimClient.poll` reads what the connection holds now, reconnects when the
  daemon went away (backing off as the real clients do, on the simulated clock)
  and returns what is ready;
* :meth:`SimClient.crash` drops the process as SIGKILL would: no acknowledgement,
  no Bye.

Time: the library reads one clock, which :func:`client_clock` points at the
simulation's (``wheeld.core._set_clock``); the shell's own waits (reconnecting,
the handshake's deadline) read the ``clock_ns`` it is given, the same clock.

:class:`SimConnection` is one client connection: two bounded byte streams with
descriptor passing (SCM_RIGHTS in one process: the descriptors are ``os.dup``'d
when sent, the receiver owns the copies, and those never received are closed
with the stream, as the kernel does). Its daemon end implements the daemon core's
:class:`wheeld.daemon.host.Transport` port; the simulator moves the bytes
(:meth:`SimConnection.take_for_daemon`, :meth:`SimConnection.deliver`) and
reports a closed connection (:meth:`SimConnection.take_for_daemon` returns EOF,
:meth:`SimConnection.cut`). :class:`SimListener` is the daemon's listening socket.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import itertools
import os
from dataclasses import dataclass
from typing import Callable

from wheeld import core as client_core
from wheeld.core import ClientCore, Expired, decode_daemon_body
from wheeld.handshake import RETRY_FIRST_S, Handshake, Reconnection
from wheeld.protocol import messages as M
from wheeld.protocol.errors import BrokenPeer
from wheeld.protocol.framing import FrameReader

__all__ = ["SimClient", "SimConnection", "SimListener", "Polled", "client_clock", "DEFAULT_CAPACITY"]

#: bytes one direction of a connection holds before a sender is told to wait (a
#: socket's buffer; small ones simulate slow readers)
DEFAULT_CAPACITY = 212_992
_RECV_BYTES = 65536
_MIN_HANDSHAKE_S = 0.05  # the shortest wait for a Welcome (wheeld.sync: a handshake's socket timeout)
_BYE = M.encode_client_frame(M.Bye())
_DOORBELL = M.encode_client_frame(M.Doorbell())
_DOORBELL_URGENT = M.encode_client_frame(M.Doorbell(urgent=True))


@contextlib.contextmanager
def client_clock(clock_ns: Callable[[], int]):
    """Every client of this process reads ``clock_ns`` (ns, the CLOCK_MONOTONIC scale)
    instead of the real clock, until the block ends."""
    client_core._set_clock(clock_ns)
    try:
        yield
    finally:
        client_core._set_clock(None)


# ------------------------------------------------------------------------ the connection


class _Stream:
    """One direction of a connection: at most ``capacity`` bytes, in chunks that may carry
    descriptors (attached to their first byte). With ``hold``, bytes become readable only
    once the simulator delivers them (a reader that is slow to get its data)."""

    def __init__(self, capacity: int, hold: bool):
        if capacity <= 0:
            raise ValueError("a stream holds at least one byte")
        self.capacity = capacity
        self.hold = hold
        self.chunks: collections.deque[list] = collections.deque()  # [bytes, fds], oldest first
        self.size = 0
        self.visible = 0  # bytes the reader may take (all of them without hold)
        self.writer_closed = False  # EOF once the reader has taken everything
        self.dropped = False  # the reader closed: nothing more is kept

    def room(self) -> int:
        return 0 if self.dropped else self.capacity - self.size

    def write(self, data, fds: list[int], whole: bool) -> int:
        """Take ``data`` (all of it when ``whole``, else as much as fits); ``fds`` travel with
        its first byte (duplicated: the sender keeps its own). Returns the bytes taken."""
        room = self.room()
        n = len(data)
        if self.dropped:
            raise BrokenPipeError(errno.EPIPE, "the peer closed the connection")
        if n == 0:
            return 0
        if room <= 0 or (whole and room < n):
            raise BlockingIOError(errno.EAGAIN, "the connection's buffer is full")
        taken = min(n, room)
        copies = [os.dup(fd) for fd in fds]
        self.chunks.append([bytes(data[:taken]), copies])
        self.size += taken
        if not self.hold:
            self.visible = self.size
        return taken

    def deliver(self, max_bytes: int | None) -> int:
        """Make up to ``max_bytes`` more (None: all) readable; returns how many."""
        hidden = self.size - self.visible
        n = hidden if max_bytes is None else max(0, min(hidden, max_bytes))
        self.visible += n
        return n

    def read(self, max_bytes: int) -> tuple[bytes, list[int]] | None:
        """Up to ``max_bytes`` readable bytes and the descriptors that came with them; None
        when nothing is readable yet, (b"", []) at the end of the stream. A read stops before
        a chunk that carries descriptors (they arrive with their own first byte)."""
        if self.visible == 0:
            return (b"", []) if self.writer_closed and self.size == 0 else None
        out: list[bytes] = []
        fds: list[int] = []
        want = min(max_bytes, self.visible)
        while want and self.chunks:
            chunk = self.chunks[0]
            if chunk[1]:
                if out:
                    break
                fds += chunk[1]
                chunk[1] = []
            data = chunk[0]
            if len(data) <= want:
                out.append(data)
                self.chunks.popleft()
            else:
                out.append(data[:want])
                chunk[0] = data[want:]
            taken = len(out[-1])
            want -= taken
            self.size -= taken
            self.visible -= taken
        return b"".join(out), fds

    def drop(self) -> None:
        """The reader closed: what it never read goes, and the descriptors in it are closed."""
        self.dropped = True
        for _data, fds in self.chunks:
            for fd in fds:
                os.close(fd)
        self.chunks.clear()
        self.size = self.visible = 0

    def fds_in_flight(self) -> int:
        return sum(len(fds) for _data, fds in self.chunks)


class DaemonEnd:
    """The daemon's end of a :class:`SimConnection`: the core's ``Transport`` port."""

    def __init__(self, connection: SimConnection):
        self.connection = connection
        self.wants_writable = False
        self.closed = False

    def send(self, data) -> int:
        """Bytes of ``data`` taken now (0 when the client's buffer is full); BrokenPipeError
        once the client closed its end."""
        if self.closed:
            raise OSError(errno.EBADF, "the daemon closed this connection")
        try:
            return self.connection.to_client.write(data, [], whole=False)
        except BlockingIOError:
            return 0

    def send_with_fds(self, data: bytes, fds: list[int]) -> int:
        """As :meth:`send`, ``fds`` with the first byte; BlockingIOError when nothing fits."""
        if self.closed:
            raise OSError(errno.EBADF, "the daemon closed this connection")
        return self.connection.to_client.write(data, list(fds), whole=False)

    def want_writable(self, wanted: bool) -> None:
        self.wants_writable = wanted

    def peer_gone(self) -> bool:
        """The client closed its end and everything it sent was read (a recv would give EOF)."""
        stream = self.connection.to_daemon
        return stream.writer_closed and stream.size == 0

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.connection.to_client.writer_closed = True
            self.connection.to_client.deliver(None)  # sent before the close: the client reads it, then EOF
            self.connection.to_daemon.drop()


class ClientEnd:
    """The client's end: whole-frame sends (a client sends only small frames, which a stream
    socket takes whole or not at all) and reads of what was delivered."""

    def __init__(self, connection: SimConnection):
        self.connection = connection
        self.closed = False

    def send(self, data: bytes, fds: list[int] | None = None) -> None:
        """Send ``data`` whole (BlockingIOError when it does not fit now), ``fds`` with it;
        BrokenPipeError once the daemon closed its end."""
        if self.closed:
            raise OSError(errno.EBADF, "this connection is closed")
        if self.connection.daemon.closed:
            raise BrokenPipeError(errno.EPIPE, "the daemon closed the connection")
        self.connection.to_daemon.write(data, fds or [], whole=True)

    def recv(self, max_bytes: int = _RECV_BYTES) -> tuple[bytes, list[int]] | None:
        """What was delivered (bytes, descriptors now owned by the caller); None when
        nothing is waiting; (b"", []) once the daemon closed and everything was read."""
        if self.closed:
            raise OSError(errno.EBADF, "this connection is closed")
        return self.connection.to_client.read(max_bytes)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.connection.to_daemon.writer_closed = True
            self.connection.to_client.drop()


class SimConnection:
    """One client connection in memory. ``peer``: the client's (pid, uid, gid), what
    SO_PEERCRED gives the real daemon. ``capacity``: bytes each direction holds. With
    ``hold``, what the daemon sends reaches the client only through :meth:`deliver`."""

    def __init__(self, peer: tuple[int, int, int], capacity: int = DEFAULT_CAPACITY, hold: bool = False):
        self.peer = peer
        self.to_daemon = _Stream(capacity, hold=False)
        self.to_client = _Stream(capacity, hold=hold)
        self.daemon = DaemonEnd(self)
        self.client = ClientEnd(self)

    # ---------------------------------------------------------------- the simulator's side
    def take_for_daemon(self, max_bytes: int = _RECV_BYTES) -> tuple[bytes, list[int]] | None:
        """What the client sent, for the daemon's "bytes received" event (the descriptors
        are the daemon's now); None when nothing waits; (b"", []) when the client closed
        its end and everything was taken: the "connection closed" event."""
        if self.daemon.closed:
            return None
        return self.to_daemon.read(max_bytes)

    def deliver(self, max_bytes: int | None = None) -> int:
        """Let the client see up to ``max_bytes`` more of what the daemon sent (None: all)."""
        return self.to_client.deliver(max_bytes)

    def writable_due(self) -> bool:
        """True when the daemon asked to hear that it can send again and it can."""
        return self.daemon.wants_writable and not self.daemon.closed and self.to_client.room() > 0

    def cut(self) -> None:
        """The daemon's side is gone (its process died): the client reads what was sent, then
        EOF; what the client sent and the daemon did not read is dropped."""
        self.daemon.close()

    @property
    def client_closed(self) -> bool:
        return self.client.closed

    def fds_in_flight(self) -> int:
        return self.to_daemon.fds_in_flight() + self.to_client.fds_in_flight()

    def discard(self) -> None:
        """Close both ends and every descriptor still in flight."""
        self.client.close()
        self.daemon.close()


class SimListener:
    """The daemon's listening socket. Clients :meth:`connect` while it :attr:`listening`
    (ConnectionRefusedError otherwise, as a socket file nobody listens on gives); the
    simulator :meth:`accept`\\ s each new connection and gives its daemon end to the core."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, hold: bool = False):
        self.capacity = capacity
        self.hold = hold
        self.listening = False
        self.backlog: collections.deque[SimConnection] = collections.deque()

    def connect(self, pid: int, uid: int, gid: int) -> ClientEnd:
        if not self.listening:
            raise ConnectionRefusedError(errno.ECONNREFUSED, "nothing listens on the simulated socket")
        connection = SimConnection((pid, uid, gid), self.capacity, self.hold)
        self.backlog.append(connection)
        return connection.client

    def accept(self) -> SimConnection | None:
        return self.backlog.popleft() if self.backlog else None

    def stop(self) -> None:
        """The daemon stopped listening (or died): connections not accepted are reset."""
        self.listening = False
        while self.backlog:
            self.backlog.popleft().cut()


# ------------------------------------------------------------------------ the client


@dataclass
class Polled:
    """What one :meth:`SimClient.poll` found: the expirations handed to the application, and
    the flushes answered since, as (flush number, None or the error flush() would raise)."""

    expired: list[Expired]
    flushed: list[tuple[int, Exception | None]]


class SimClient(ClientCore):
    """A client process's wheeld client, driven by the simulator (see the module docstring).

    ``dial``: opens a connection to the daemon (e.g. a :class:`SimListener`'s ``connect``
    with this process's credentials), or raises ConnectionRefusedError / FileNotFoundError.
    ``clock_ns``: the simulation's clock, in ns. ``pid``: the process id its Hello gives."""

    def __init__(self, dial: Callable[[], ClientEnd], clock_ns: Callable[[], int], *, group: str = "default",
                 pid: int = 1, client_name: str = "", reconnect_timeout_s: float = 30.0,
                 connect_timeout_s: float = 10.0, socket_path: str = "sim:wheeld"):
        super().__init__(socket_path, group, 0.0, reconnect_timeout_s, client_name)
        self.pid = pid
        self.connect_timeout_s = connect_timeout_s
        self._dial_fn = dial
        self._clock_ns = clock_ns
        self._end: ClientEnd | None = None
        self._attempt: Handshake | None = None  # a handshake under way on _end
        self._attempt_until = 0.0  # (s) when it is given up
        self._first_until: float | None = None  # (s) the first connect's deadline, until its session opens
        self._reader = FrameReader()
        self._reconnection = Reconnection(self.socket_path, reconnect_timeout_s)
        self._retry_at: float | None = None  # (s) when to try to connect next; None: no attempt due
        self._pause = RETRY_FIRST_S
        self._flushes: dict[int, None] = {}  # flush numbers not answered yet
        self._flushed: list[tuple[int, Exception | None]] = []
        # for a checker: the arming tag of each expiration made ready, in step with the
        # library's ready queue (taken by the caller after each poll), and the tags the
        # library re-armed a touched idle timer with -> the tag it replaced
        self.ready_tags: list[int] = []
        self.handed_tags: list[int] = []
        self.idle_rearms: dict[int, int] = {}
        self.on_idle_rearm = None  # called (key, the tag it replaced) when the library re-arms an idle timer
        self.on_received = None  # called (key bytes, arming tag, fired_ms) for each expiration its library reads
        self.flush_rejections: dict[int, list] = {}  # flush number -> (seq, code) of each command refused before it
        # for the checker's exactly-once rule: how many expirations were handed to the
        # application so far; (when, n) each time the acknowledgements of the first n of
        # them were all in the ring; when a session's connection ended under it
        self.hands = 0
        self.ack_marks: list[tuple[int, int]] = []
        self.session_ends: list[int] = []
        # when its ring was handed to a daemon of another arena (its Welcome's arena epoch
        # changed): the ring is then replayed from the last flush the old arena acknowledged.
        # Per such Welcome (the first Hello sent since the previous Welcome, the Welcome taken):
        # the daemon adopts and replays the ring when it reads a Hello, before the client reads
        # the Welcome, and may fire and send what it replays to another member meanwhile; the
        # Hello it read may be an earlier attempt's, answered by a daemon that died before its
        # Welcome was read
        self.new_arena_welcomes: list[tuple[int, int]] = []
        self._hello_since_welcome_ns: int | None = None

    def _now(self) -> float:
        return self._clock_ns() / 1e9

    # ---------------------------------------------------------------- session
    @property
    def connected(self) -> bool:
        """A session is open (its Welcome taken) on a live connection."""
        return self._end is not None and self._attempt is None

    def connect(self) -> None:
        """Start the first session: send the Hello. As :func:`wheeld.connect`, it raises at once
        when nothing listens (DaemonNotRunning) and keeps trying other failures for
        ``connect_timeout_s``; the Welcome is taken by a later :meth:`poll`. A failure that
        ends the first connect leaves the client closed (a real one would not exist)."""
        self._check_open()
        if self._first_until is not None or self._welcome is not None:
            raise RuntimeError("connect() starts the first session, once")
        self._first_until = self._now() + self.connect_timeout_s
        self._fatal(self._dial)

    def _fatal(self, step, *args) -> None:
        """Run ``step``; an error it raises that ends the first connect closes the client."""
        try:
            step(*args)
        except BaseException:
            if self._first_until is not None:
                self.crash()
            raise

    def _dial(self) -> None:
        """One attempt: connect and send the Hello."""
        now = self._now()
        self._retry_at = None
        try:
            end = self._dial_fn()
        except OSError as exc:
            self._attempt_failed(exc, now)
            return
        attempt = Handshake(self, pid=self.pid)
        try:
            end.send(attempt.frame, attempt.fds)
        except OSError as exc:
            attempt.abandon()
            end.close()
            self._attempt_failed(exc, now)
            return
        self._end, self._attempt = end, attempt
        if self._hello_since_welcome_ns is None:
            self._hello_since_welcome_ns = self._clock_ns()
        # the answer is waited for until the connect's deadline (the first connect's, or when
        # reconnecting gives up), and at least _MIN_HANDSHAKE_S, as the real clients do
        until = self._first_until if self._first_until is not None else self._reconnection.lost(now)
        self._attempt_until = max(until, now + _MIN_HANDSHAKE_S)

    def _attempt_failed(self, exc: BaseException, now: float) -> None:
        """An attempt failed with ``exc``: the next one after a pause (doubling up to
        RETRY_MAX_S), or the error raised, as the real clients decide
        (:meth:`Reconnection.attempt_failed`, :meth:`Reconnection.failed`)."""
        failure = self._reconnection.attempt_failed(exc, self._first_until is not None)
        if self._first_until is not None:
            if now + self._pause >= self._first_until:
                raise failure
        self._retry_at = now + self._pause  # (also after BrokenPeer: each later poll tries again)
        self._pause = Reconnection.next_pause(self._pause)
        if self._first_until is None:
            self._reconnection.failed(failure, now)  # BrokenPeer once gone for reconnect_timeout_s

    def _flush_acks(self) -> None:
        handed = self.hands
        super()._flush_acks()
        if self._segment is not None and not self._acks_pending and not self._to_ack and \
                (not self.ack_marks or self.ack_marks[-1][1] != handed):
            self.ack_marks.append((self._clock_ns(), handed))

    def _lost(self) -> None:
        """The connection ended (EOF, a Goodbye): try again at once, then backing off."""
        self.session_ends.append(self._clock_ns())
        self._drop_connection()
        self._reconnection.lost(self._now())
        self._retry_at = self._now()
        self._pause = RETRY_FIRST_S

    def _handshake_step(self, data: bytes, fds: list[int]) -> None:
        attempt = self._attempt
        before = self._welcome
        try:
            if not attempt.received(data, fds):
                return
            self._reader = attempt.open()
            now_ns = self._clock_ns()
            if before is not None and self._welcome is not None and self._welcome.arena_epoch != before.arena_epoch:
                hello_ns = self._hello_since_welcome_ns
                self.new_arena_welcomes.append((now_ns if hello_ns is None else hello_ns, now_ns))
            self._hello_since_welcome_ns = None
        except (OSError, BrokenPeer) as exc:
            self._drop_connection()
            self._attempt_failed(exc, self._now())
            return
        except BaseException:
            self._drop_connection()  # a refusal: raised; a reconnection tries again at the next poll
            if self._first_until is None:
                self._retry_at = self._now() + self._pause
            raise
        self._attempt = None
        self._first_until = None
        self._retry_at = None
        self._pause = RETRY_FIRST_S
        self._reconnection.restored()
        for body in attempt.rest:
            if not self._message(body):
                return

    def _message(self, body: bytes) -> bool:
        """Handle one frame of the session; False when it ended it (a Goodbye)."""
        try:
            self._on_message(decode_daemon_body(body))
        except BrokenPeer:
            self._lost()
            return False
        return True

    def _on_expirations(self, items) -> None:
        if self.on_received is not None:
            for item in items:
                self.on_received(bytes(item.key_bytes), item.seq, item.fired_ms)
        before = len(self._ready)
        super()._on_expirations(items)
        if len(self._ready) > before:
            # which item each came from: its handle, appended in step, names the item's record
            # (slot, generation). Key, deadline and fired time do not: a re-arm with delay 0
            # in the ms its first arming was due has that deadline too, and two copies sent
            # again together (their member died) carry the same fired time.
            tag_of = {(item.slot, item.generation): item.seq for item in items}
            for slot, generation, _epoch in itertools.islice(self._ready_handles, before, None):
                self.ready_tags.append(tag_of.get((slot, generation), -1))

    def _stale_idle(self, ident, e, bkey, handle, again: bool = False) -> bool:
        rearmed = super()._stale_idle(ident, e, bkey, handle, again)
        if rearmed:  # armed again under a new tag: the same arming, for the checker
            for shard in self._latest:
                if bkey in shard:
                    self.idle_rearms[shard[bkey]] = e.seq
                    break
            if self.on_idle_rearm is not None:
                self.on_idle_rearm(bkey, e.seq)
        return rearmed

    def resolve_tag(self, tag: int) -> int:
        """The tag the application armed, for one the library re-armed an idle timer with."""
        seen = 0
        while tag in self.idle_rearms and seen < 1000:
            tag = self.idle_rearms[tag]
            seen += 1
        return tag

    @property
    def closed_session(self) -> bool:
        return self._closed

    def _take_ready(self):
        taken = super()._take_ready()
        if not taken:
            return taken
        self.hands += len(taken)
        self.handed_tags += self.ready_tags[: len(taken)]
        del self.ready_tags[: len(taken)]
        return taken

    def _on_message(self, message) -> None:
        super()._on_message(message)
        if type(message) is M.Applied and message.seq in self._flushes:
            del self._flushes[message.seq]
            rejected = self._flush_answers.pop(message.seq)
            self.flush_rejections[message.seq] = [(r.seq, r.code) for r in rejected]
            try:
                self._raise_rejections(rejected)
                outcome = None
            except Exception as exc:  # what the blocking flush() raises once this Applied came
                outcome = exc
            self._flushed.append((message.seq, outcome))

    def _pump(self) -> None:
        """Read what the connection holds; connect again when it is gone and it is time."""
        while not self._closed:
            if self._end is None:
                if self._retry_at is None or self._now() < self._retry_at:
                    return
                self._dial()
                continue
            if self._attempt is not None and self._now() >= self._attempt_until:
                self._drop_connection()
                self._attempt_failed(TimeoutError("the handshake was not answered in time"), self._now())
                continue
            got = self._end.recv(_RECV_BYTES)
            if got is None:
                return
            data, fds = got
            if self._attempt is not None:
                self._handshake_step(data, fds)
                continue
            for fd in fds:  # a session passes descriptors only with its Welcome
                os.close(fd)
            if not data:
                self._lost()
                continue
            for body in self._reader.feed(data):
                if not self._message(body):
                    break

    # ---------------------------------------------------------------- the application's calls
    def _ring_doorbell(self, urgent: bool = True) -> None:
        if self._end is None or self._attempt is not None:
            return  # no session: the next one's daemon looks at the ring
        try:
            self._end.send(_DOORBELL_URGENT if urgent else _DOORBELL)
        except OSError:
            pass  # full of doorbells already, or gone: the next poll finds out

    def flush(self) -> int:
        """Push a FLUSH and ring; returns its number. Its outcome comes out of a later
        :meth:`poll` (``Polled.flushed``). RingFull at once when the ring has no room."""
        self._check_open()
        seq = self._push_flush()
        self._flushes[seq] = None
        self._flush_waits(seq)
        return seq

    def poll(self) -> Polled:
        """Acknowledge what the last poll handed over, read what arrived (reconnecting if the
        daemon went away), and hand over what is ready. Raises as the blocking poll does: a
        refusal, BrokenPeer once the daemon was gone for ``reconnect_timeout_s``."""
        self._check_open()
        if self._segment is not None:
            self._flush_acks()
        self._fatal(self._pump)
        flushed, self._flushed = self._flushed, []
        return Polled(self._take_ready(), flushed)

    def receive(self) -> None:
        """Read what the connection holds into the library, as the asyncio client's reader
        does while its application is busy elsewhere: nothing is handed to the application
        and nothing is acknowledged (the next :meth:`poll` hands over what waits)."""
        self._check_open()
        self._fatal(self._pump)

    def pending_flushes(self) -> list[int]:
        """Flushes sent and not answered yet, oldest first."""
        return list(self._flushes)

    def close(self) -> None:
        """As the real close(): acknowledge what was handed over, say goodbye, unmap."""
        if self._closed:
            return
        try:
            if self.connected:
                if self._segment is not None:
                    self._flush_acks()
                try:
                    self._end.send(_BYE)
                except OSError:
                    pass
            self._drop_connection()
        finally:
            self._closed = True
            self._release_local()

    def crash(self) -> None:
        """The process dies (SIGKILL): nothing acknowledged, no Bye; the daemon sees the
        connection close. Every later call raises Closed."""
        if self._closed:
            return
        self._drop_connection()
        self._closed = True
        self._release_local()

    def _drop_connection(self) -> None:
        if self._attempt is not None:
            self._attempt.abandon()
            self._attempt = None
        if self._end is not None:
            self._end.close()
            self._end = None
        self._retry_at = None
