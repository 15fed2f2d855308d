"""Opening a session and getting it back, decided once for every I/O shell.

A client opens its session the same way whatever drives it (the blocking client,
the asyncio client, a simulated client): it sends a ``Hello`` (with its ring, when it
had a session, so that a restarted daemon adopts the commands still in it), reads
until the daemon's first answer is complete, and takes the ``Welcome`` with its
descriptors, or raises the refusal's error. When the daemon goes away the client
tries again, backing off, until it has been gone for ``reconnect_timeout_s``.

Those decisions live here and do no I/O, in the sans-I/O style of h11: a shell
connects, sends :attr:`Handshake.frame` with :attr:`Handshake.fds`, hands every
read to :meth:`Handshake.received`, and waits or sleeps as :class:`Reconnection`
says, reading its own clock (every method that needs the time takes ``now``, in
seconds of ``time.monotonic()`` or of the simulation's clock).
"""

from __future__ import annotations

import os

from wheeld.protocol import messages as M
from wheeld.protocol.errors import BrokenPeer, DaemonNotRunning, NotAllowed, ProtocolError, Timeout
from wheeld.protocol.framing import FrameReader

from .core import ClientCore, close_quietly, decode_daemon_body
from .session import refusal_error

#: the pause after a failed attempt to connect, doubled after each one up to RETRY_MAX_S
RETRY_FIRST_S = 0.01
RETRY_MAX_S = 0.5


def hello_frame(core: ClientCore, pid: int) -> tuple[bytes, list[int]]:
    """The Hello frame of ``core``'s next session, and the descriptors to pass with it: its
    ring, when it has one, so that a restarted daemon adopts it (and the commands still in
    it). ``pid``: the process the daemon shows for the session."""
    seg = core._segment
    welcome = core._welcome
    replay_epoch = replay_from = 0
    if seg is not None and welcome is not None and seg._tail - core._replay_from <= seg.ring_capacity:
        # everything pushed since the last acknowledged flush is still in the ring
        replay_epoch, replay_from = welcome.arena_epoch, core._replay_from
    if seg is not None:
        # a daemon with another arena rewinds the ring to replay_from: until the answer (or
        # the attempt's end, Handshake.abandon), pushes keep the records from there on
        seg.limit_head(replay_from if replay_epoch else None)
    hello = M.Hello(M.PROTOCOL_VERSION, core.group, pid, core.client_name, seg.name if seg is not None else "",
                    welcome.token if welcome is not None else 0, replay_epoch, replay_from)
    return M.encode_client_frame(hello), [seg.fd] if seg is not None else []


def welcome_of(body: bytes) -> M.Welcome:
    """The daemon's answer to a Hello: its Welcome, or the refusal's error raised."""
    message = decode_daemon_body(body)
    if type(message) is M.Refused:
        raise refusal_error(message)
    if type(message) is not M.Welcome:
        raise ProtocolError(f"expected Welcome, got {type(message).__name__}")
    return message


class Handshake:
    """One attempt at opening a session for ``core``.

    Send :attr:`frame` with :attr:`fds` (SCM_RIGHTS: the ring handed back), then feed
    every read to :meth:`received` until it returns True; then :meth:`open` takes the
    session (or raises the refusal's error), and the shell handles :attr:`rest`, the
    frames that came after the Welcome, once it has made the connection the client's.
    Whatever way the attempt ends, the descriptors received are used or closed:
    :meth:`abandon` closes those not taken."""

    __slots__ = ("core", "frame", "fds", "reader", "rest", "_received", "_answer")

    def __init__(self, core: ClientCore, pid: int | None = None):
        self.core = core
        self.frame, self.fds = hello_frame(core, os.getpid() if pid is None else pid)
        self.reader = FrameReader()  # the connection's reader from now on
        self.rest: list[bytes] = []
        self._received: list[int] = []
        self._answer: bytes | None = None

    def received(self, data: bytes, fds: list[int]) -> bool:
        """Bytes read from the connection and the descriptors that came with them; True once
        the daemon's answer is complete. BrokenPeer when the daemon closed (``data`` empty)."""
        self._received += fds
        if not data:
            raise BrokenPeer("the daemon closed the connection during the handshake")
        frames = self.reader.feed(data)
        if not frames:
            return False
        self._answer, self.rest = frames[0], frames[1:]
        return True

    def open(self) -> FrameReader:
        """Take the session the Welcome opened (:meth:`ClientCore._on_welcome` maps its
        descriptors); returns the reader for the rest of the connection. Raises the
        refusal's error, or ProtocolError for any other answer."""
        if self._answer is None:
            raise ProtocolError("the daemon's answer to Hello is not complete")
        welcome = welcome_of(self._answer)
        taken, self._received = self._received, []
        self.core._on_welcome(welcome, taken)
        return self.reader

    def abandon(self) -> None:
        """The attempt failed: close the descriptors received and not taken, and count the
        ring's room from its head word again (a daemon that adopted the ring published the
        head it rewound to before it could answer)."""
        seg = self.core._segment
        if seg is not None:
            seg.limit_head(None)
        received, self._received = self._received, []
        for fd in received:
            close_quietly(fd)


class Reconnection:
    """When the daemon went away, why getting it back failed so far, and when to give up."""

    __slots__ = ("socket_path", "reconnect_timeout_s", "gone_since", "gone_reason")

    def __init__(self, socket_path: str, reconnect_timeout_s: float):
        self.socket_path = socket_path
        self.reconnect_timeout_s = reconnect_timeout_s
        self.gone_since: float | None = None  # when the connection was lost (reconnecting since)
        self.gone_reason = ""  # why the last attempt to reconnect failed

    def attempt_failed(self, exc: BaseException, first: bool) -> Exception:
        """What an attempt to connect that raised ``exc`` means: the error to report should
        the attempts stop now (a later attempt may succeed), or ``exc`` (or the error it
        stands for) raised when retrying will not help: no permission, a refusal, and on the
        ``first`` connect nothing listening at all."""
        if isinstance(exc, PermissionError):
            raise NotAllowed(f"may not connect to wheeld at {self.socket_path}: {exc.strerror}") from None
        if isinstance(exc, (FileNotFoundError, ConnectionRefusedError)):
            if first:
                raise DaemonNotRunning(
                    f"no wheeld listens at {self.socket_path} ({exc.strerror}); start it (`make run`, "
                    f"`systemctl start wheeld`) or point WHEELD_SOCKET / WHEELD_NAME at the running one") from None
            return DaemonNotRunning(f"no wheeld listens at {self.socket_path} ({exc.strerror})")
        if isinstance(exc, TimeoutError):
            return Timeout(f"wheeld at {self.socket_path} did not answer the handshake in time")
        if isinstance(exc, OSError) or type(exc) is BrokenPeer:
            return BrokenPeer(f"cannot reach wheeld at {self.socket_path}: {exc}")
        raise exc  # a refusal, a protocol error: it will not heal by retrying

    @staticmethod
    def next_pause(pause_s: float) -> float:
        """The pause after the next failed attempt, after one of ``pause_s``."""
        return min(pause_s * 2, RETRY_MAX_S)

    def lost(self, now: float) -> float:
        """The connection is gone (or still gone) at ``now``: when to give up reconnecting."""
        if self.gone_since is None:
            self.gone_since = now
        return self.gone_since + self.reconnect_timeout_s

    def failed(self, exc: Exception, now: float) -> None:
        """Reconnecting failed with ``exc`` (a BrokenPeer or Timeout of
        :meth:`attempt_failed`): BrokenPeer once the daemon has been gone for
        ``reconnect_timeout_s``; otherwise the next call tries again."""
        self.gone_reason = str(exc)
        if self.gone_since is not None and now >= self.gone_since + self.reconnect_timeout_s:
            raise BrokenPeer(f"wheeld at {self.socket_path} has been unreachable for "
                             f"{self.reconnect_timeout_s:.0f} s: {exc}") from None

    def restored(self) -> None:
        self.gone_since = None

    def not_applied(self, timeout_s: float, now: float) -> Timeout:
        """The Timeout of a ``flush()`` not answered in ``timeout_s``; it says so when the
        daemon is gone (and why reconnecting failed) rather than connected and silent."""
        text = f"wheeld did not apply the commands within {timeout_s} s"
        if self.gone_since is not None:
            text += (f": the daemon is gone (its connection closed {now - self.gone_since:.1f} s ago; "
                     f"reconnecting: {self.gone_reason or 'not tried yet'}); the commands stay in the ring for a "
                     f"daemon that comes back")
        return Timeout(text)
