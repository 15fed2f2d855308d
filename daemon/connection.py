"""One client connection: the socket, its frames in, its frames out.

A client sends only small messages (Hello, Doorbell, Bye); what it is sent
(Welcome, Expirations, Applied, Rejected, Goodbye) is buffered when the socket
is full. What a message means is :class:`wheeld.daemon.sessions.Sessions`'s
business; this module keeps the socket bounded.
"""

from __future__ import annotations

import array
import os
import socket
import time

from wheeld.protocol import messages as M
from wheeld.protocol.errors import ProtocolError
from wheeld.protocol.framing import FrameReader

HIGH_WATER = 8 << 20  # bytes queued to one client before we stop sending to it
CLIENT_MAX_FRAME = 4096  # the largest client -> daemon frame (a Hello is a few hundred bytes)
_RECV_BYTES = 65536
_FDS_SPACE = socket.CMSG_SPACE(4 * array.array("i").itemsize)  # room for a few passed descriptors


class Session:
    """One connected socket.

    Bounded: a frame announcing more than ``CLIENT_MAX_FRAME`` bytes is a protocol
    error, a frame must be complete within ``frame_timeout_s`` of its first byte,
    and one read takes at most 64 KiB: the input buffer never holds more than
    ~70 KiB. Output waiting for the client stops growing at ``HIGH_WATER``, and a
    client that has not taken a byte of it for ``ack_timeout_s`` is disconnected
    (``stuck_since``): otherwise every ack timeout would send it its unacknowledged
    expirations again, and the daemon would hold up to ``HIGH_WATER`` for each
    client that never reads.

    ``owner`` (the :class:`~wheeld.daemon.sessions.Sessions`) gets the messages
    (``on_message``) and closes the session (``close``)."""

    def __init__(self, owner, sock: socket.socket, pid: int, uid: int, gid: int):
        self.owner = owner
        self.sock = sock
        self.pid, self.uid, self.gid = pid, uid, gid
        self.reader = FrameReader(max_frame=CLIENT_MAX_FRAME)
        self.partial_since = 0.0  # time.monotonic() when an incomplete frame started, 0 at a boundary
        self.passed_fds: list[int] = []  # SCM_RIGHTS descriptors that came with the Hello
        self.out = bytearray()
        self.stuck_since = 0.0  # time.monotonic() since when out has waited without the client taking a byte
        self.writing = False
        self.closed = False
        self.client = None  # its ClientSlot, once the Hello is accepted

    @property
    def congested(self) -> bool:
        return len(self.out) > HIGH_WATER

    def send(self, frame: bytes) -> None:
        if self.closed:
            return
        if self.out:
            self.out += frame
            return
        try:
            sent = self.sock.send(frame)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            self.owner.close(self, f"send failed: {exc}")
            return
        self._keep(frame, sent)

    def send_with_fds(self, frame: bytes, fds: list[int]) -> None:
        """Send ``frame`` with ``fds`` as SCM_RIGHTS data (the first frame of a session)."""
        try:
            sent = self.sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        except (BlockingIOError, InterruptedError):
            self.owner.close(self, "the client does not read its socket")
            return
        except OSError as exc:
            self.owner.close(self, f"send failed: {exc}")
            return
        self._keep(frame, sent)  # the descriptors went with the first byte

    def _keep(self, frame: bytes, sent: int) -> None:
        if sent < len(frame):
            self.out += frame[sent:]
            if not self.writing:
                self.writing = True
                self.stuck_since = time.monotonic()
                self.owner.loop.add_writer(self.sock.fileno(), self._on_writable)

    def _on_writable(self) -> None:
        try:
            sent = self.sock.send(self.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self.owner.close(self, f"send failed: {exc}")
            return
        del self.out[:sent]
        if sent:
            self.stuck_since = time.monotonic()
        if not self.out:
            self.writing = False
            self.out = bytearray()  # give a large buffer back
            self.owner.loop.remove_writer(self.sock.fileno())
            self.owner.wake()  # it may take more expirations now

    def _recv(self) -> bytes:
        if self.client is not None:
            return self.sock.recv(_RECV_BYTES)
        # before the handshake a Hello may carry the client's old ring (SCM_RIGHTS)
        data, ancillary, _flags, _addr = self.sock.recvmsg(_RECV_BYTES, _FDS_SPACE)
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
                self.passed_fds.extend(fds)
        if len(self.passed_fds) > 1 or data == b"":
            self.close_passed_fds(keep=1 if data else 0)
        return data

    def close_passed_fds(self, keep: int = 0) -> None:
        for fd in self.passed_fds[keep:]:
            os.close(fd)
        del self.passed_fds[keep:]

    def on_readable(self) -> None:
        self.owner.arena_busy()  # what follows may write the arena while the loop is parked
        try:
            data = self._recv()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self.owner.close(self, f"recv failed: {exc}")
            return
        if not data:
            self.owner.close(self, "peer closed the connection")
            return
        try:
            frames = self.reader.feed(data)
            if self.reader.pending_bytes:
                self.partial_since = self.partial_since or time.monotonic()
            else:
                self.partial_since = 0.0
            for body in frames:
                self.owner.on_message(self, M.decode_client_message(body))
                if self.closed:
                    return
        except ProtocolError as exc:
            self.owner.close(self, f"protocol error: {exc}", goodbye=True)
