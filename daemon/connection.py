"""One client connection: its frames in, its frames out, every buffer behind it bounded.

A client sends only small messages (Hello, Doorbell, Bye); what it is sent
(Welcome, Expirations, Applied, Rejected, Goodbye) is buffered when the
connection takes no more for now. What a message means is
:class:`wheeld.daemon.sessions.Sessions`'s business; this module keeps the
connection, and every buffer behind it, bounded. It performs no I/O: the shell
gives each connection a :class:`~wheeld.daemon.host.Transport` (a socket in the
real daemon, an in-memory pipe in the simulator) and hands over what it reads
(:meth:`Session.received`) and when it can write again (:meth:`Session.writable`).
"""

from __future__ import annotations

import collections
import logging
import os

from wheeld.protocol import messages as M
from wheeld.protocol.errors import ProtocolError
from wheeld.protocol.framing import FrameReader


log = logging.getLogger("wheeld")

HIGH_WATER = 8 << 20  # bytes queued to one client before we stop sending it expirations
# Answers (Applied, Rejected) come from the commands a client writes into its ring, as
# many as it likes: past ANSWER_HIGH_WATER of them unread, its ring is not drained (its
# producer finds the ring full, back pressure), and past REJECT_DETAIL_BYTES a rejection
# is counted rather than sent (one summary per code follows once the client reads).
ANSWER_HIGH_WATER = 1 << 20
REJECT_DETAIL_BYTES = 256 << 10
CLIENT_MAX_FRAME = 4096  # the largest client -> daemon frame (a Hello is a few hundred bytes)
RECV_BYTES = 65536  # the most the shell reads from one connection at a time
MAX_PASSED_FDS = 4  # descriptors the shell takes from one read (a Hello passes one)


class Session:
    """One client connection.

    Bounded: a frame announcing more than ``CLIENT_MAX_FRAME`` bytes is a protocol
    error, a frame must be complete within ``frame_timeout_s`` of its first byte,
    and one read takes at most 64 KiB: the input buffer never holds more than
    ~70 KiB. Output waiting for the client stops growing at ``HIGH_WATER``, and a
    client that has not taken a byte of it for ``ack_timeout_s`` is disconnected
    (``stuck_since``): otherwise every ack timeout would send it its unacknowledged
    expirations again, and the daemon would hold up to ``HIGH_WATER`` for each
    client that never reads.

    ``owner`` (the :class:`~wheeld.daemon.sessions.Sessions`) gets the messages
    (``on_message``), closes the session (``close``) and tells the time
    (``now_s()``, the core's clock in seconds); ``transport`` carries the bytes."""

    def __init__(self, owner, transport, pid: int, uid: int, gid: int, opened_s: float = 0.0):
        self.owner = owner
        self.transport = transport
        self.pid, self.uid, self.gid = pid, uid, gid
        self.opened_s = opened_s  # when it connected (the handshake timeout counts from here)
        self.reader = FrameReader(max_frame=CLIENT_MAX_FRAME)
        self.partial_since = 0.0  # owner.now_s() when an incomplete frame started, 0 at a boundary
        self.passed_fds: list[int] = []  # SCM_RIGHTS descriptors that came with the Hello
        self.out = bytearray()
        self.out_added = 0  # bytes ever queued in out (the socket did not take them at once)
        self.out_taken = 0  # bytes of out the socket took since
        self._marks: collections.deque = collections.deque()  # (out_added, owner.now_s()) of each look
        self._answer_runs: collections.deque = collections.deque()  # [end in the out stream, bytes] of answers
        self._answer_bytes = 0  # answer bytes still in out (a run partly taken counts whole)
        self.held_rejections: dict[str, list] = {}  # code -> [count, last reason]: rejections not sent one by one
        self._told_held_back = False  # logged that its ring waits (once until its output is all read)
        self.writing = False
        self.closed = False
        self.client = None  # its ClientSlot, once the Hello is accepted

    @property
    def congested(self) -> bool:
        """No more expirations for now."""
        return len(self.out) > HIGH_WATER

    @property
    def held_back(self) -> bool:
        """Its ring is not drained for now: too many answers wait unread."""
        return self.answers_queued() > ANSWER_HIGH_WATER

    def answers_queued(self) -> int:
        """Bytes of answers (Applied, Rejected) still waiting in the output buffer."""
        runs, taken = self._answer_runs, self.out_taken
        while runs and runs[0][0] <= taken:
            self._answer_bytes -= runs.popleft()[1]
        return self._answer_bytes

    def send(self, frame: bytes) -> None:
        self._write(frame, False)

    def answer(self, rejects: list, flush_answers: list, cuts: list | None = None) -> None:
        """The answers to a chunk of this client's commands, in ring order: the frames that
        answer each FLUSH (``Applied``...), each after the rejections
        (:class:`~wheeld.daemon.planner.Rejection`) of the commands between the FLUSH before
        it and itself, then the rejections of the commands after the chunk's last FLUSH.
        ``rejects`` are in ring order and ``cuts[k]`` is how many of them come before FLUSH
        k (None when there are no rejections). A rejection is never answered with a FLUSH
        before its command: the client raises it from the first ``flush()`` whose
        ``Applied`` follows it. Bounded: past ``REJECT_DETAIL_BYTES`` unread a rejection is
        counted instead of sent, and the counts go out as one summary per code before the
        next ``Applied`` (or as soon as the client reads)."""
        if self.closed or not (flush_answers or rejects):
            return
        if rejects and flush_answers and (cuts is None or len(cuts) != len(flush_answers)):
            raise ValueError("rejections and flush answers need a cut per flush")
        parts = []
        queued = self.answers_queued()
        if self.held_rejections and queued <= REJECT_DETAIL_BYTES // 2:
            parts.extend(self._summaries())
        start = 0
        for k, frames in enumerate(flush_answers):
            if rejects and cuts[k] > start:
                queued = self._rejections(rejects, start, cuts[k], parts, queued)
                start = cuts[k]
            if self.held_rejections:
                parts.extend(self._summaries())
            parts.append(frames)
        if start < len(rejects):
            self._rejections(rejects, start, len(rejects), parts, queued)
        self._write(b"".join(parts), True)
        if self.held_rejections and not self.out:  # the socket took it all: room for the summary now
            self._write(b"".join(self._summaries()), True)
        if not self._told_held_back and self.held_back:
            self._told_held_back = True
            cs = self.client
            log.warning("client pid %d (slot %s): %d bytes of answers to its commands unread; its ring waits until it "
                        "reads them", self.pid, cs.slot if cs is not None else "-", self.answers_queued())

    def _rejections(self, rejects: list, start: int, end: int, parts: list, queued: int) -> int:
        """Append the ``Rejected`` frames of ``rejects[start:end]`` to ``parts``, counting those past
        ``REJECT_DETAIL_BYTES`` of unread answers in ``held_rejections`` instead; return the bytes
        of answers queued then."""
        held = self.held_rejections
        encode = M.encode_daemon_frame
        for n in range(start, end):
            reject = rejects[n]
            if queued > REJECT_DETAIL_BYTES:
                count = held.get(reject.code)
                if count is None:
                    held[reject.code] = [1, reject.reason]
                else:
                    count[0] += 1
                    count[1] = reject.reason
                continue
            frame = encode(reject.message())
            parts.append(frame)
            queued += len(frame)
        return queued

    def _summaries(self) -> list[bytes]:
        """One ``Rejected`` per code for the rejections held back (and forget them)."""
        frames = []
        for code, (count, reason) in self.held_rejections.items():
            text = f"{count} more command(s) refused, not listed one by one (their answers were not read): {reason}"
            frames.append(M.encode_daemon_frame(M.Rejected(0, b"", 0, text[:1000], code)))
        self.held_rejections = {}
        return frames

    def stalled(self, now: float, timeout_s: float) -> bool:
        """Has output queued more than ``timeout_s`` ago still not been read? Called about
        once a second: each call notes how much was queued by then (``_marks``), and a
        mark is done with once the client has read past it. Progress, not activity:
        reading a little now and then does not keep a session whose output stays unread."""
        marks = self._marks
        if not self.out:
            marks.clear()
            return False
        taken = self.out_taken
        while marks and marks[0][0] <= taken:
            marks.popleft()
        if not marks or marks[-1][0] < self.out_added:
            marks.append((self.out_added, now))
        return now - marks[0][1] > timeout_s

    def _write(self, data: bytes, answer: bool) -> None:
        if self.closed or not data:
            return
        if self.out:
            self._queue(data, answer)
            return
        try:
            sent = self.transport.send(data)
        except OSError as exc:
            self.owner.close(self, f"send failed: {exc}")
            return
        if sent < len(data):
            self._queue(data[sent:] if sent else data, answer)

    def send_with_fds(self, frame: bytes, fds: list[int]) -> None:
        """Send ``frame`` with ``fds`` as SCM_RIGHTS data (the first frame of a session)."""
        try:
            sent = self.transport.send_with_fds(frame, fds)
        except (BlockingIOError, InterruptedError):
            self.owner.close(self, "the client does not read its socket")
            return
        except OSError as exc:
            self.owner.close(self, f"send failed: {exc}")
            return
        if sent < len(frame):  # the descriptors went with the first byte
            self._queue(frame[sent:], False)

    def _queue(self, data: bytes, answer: bool) -> None:
        self.out += data
        self.out_added += len(data)
        if answer:
            runs = self._answer_runs
            if runs and runs[-1][0] == self.out_added - len(data):  # right after the last run: one run
                runs[-1][0] = self.out_added
                runs[-1][1] += len(data)
            else:
                runs.append([self.out_added, len(data)])
            self._answer_bytes += len(data)
        if not self.writing:
            self.writing = True
            self.transport.want_writable(True)

    def writable(self) -> None:
        """The connection can take more bytes: send what waits."""
        if self.closed:
            return
        held_back = self.held_back
        try:
            sent = self.transport.send(self.out)
        except OSError as exc:
            self.owner.close(self, f"send failed: {exc}")
            return
        del self.out[:sent]
        self.out_taken += sent
        if self.held_rejections and self.answers_queued() <= REJECT_DETAIL_BYTES // 2:
            self._write(b"".join(self._summaries()), True)
        if not self.out:
            self.writing = False
            self._told_held_back = False
            self.out = bytearray()  # give a large buffer back
            self.transport.want_writable(False)
            self.owner.wake()  # it may take more expirations now
        elif held_back and not self.held_back:
            self.owner.wake()  # its ring is drained again

    def close_passed_fds(self, keep: int = 0) -> None:
        for fd in self.passed_fds[keep:]:
            os.close(fd)
        del self.passed_fds[keep:]

    def received(self, data: bytes, fds: list[int]) -> None:
        """Bytes (and descriptors passed with them) read from the connection; ``b""`` is
        the end of the stream. Descriptors are kept only before the handshake (a Hello
        hands back one ring), at most one; the rest are closed."""
        if fds:
            if self.client is None:
                self.passed_fds.extend(fds)
            else:
                for fd in fds:
                    os.close(fd)
        if len(self.passed_fds) > 1 or not data:
            self.close_passed_fds(keep=1 if data else 0)
        if not data:
            self.owner.close(self, "peer closed the connection")
            return
        self.owner.arena_busy()  # what follows may write the arena while the loop is parked
        try:
            frames = self.reader.feed(data)
            if self.reader.pending_bytes:
                self.partial_since = self.partial_since or self.owner.now_s()
            else:
                self.partial_since = 0.0
            for body in frames:
                self.owner.on_message(self, M.decode_client_message(body))
                if self.closed:
                    return
        except ProtocolError as exc:
            self.owner.close(self, f"protocol error: {exc}", goodbye=True)
