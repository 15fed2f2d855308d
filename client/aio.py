"""The asyncio client: ``await wheeld.connect_async()``. Same semantics as :mod:`wheeld.sync`.

Commands (add, add_idle, touch, cancel) are plain methods: they write to shared
memory and never block the loop (a full ring raises RingFull at once instead of
waiting). ``poll``, ``flush`` and ``close`` are coroutines. Connecting fails fast
when nothing listens or the daemon refuses; a lost daemon is waited for up to
``reconnect_timeout_s``, and never past the timeout of the call that found it gone.
"""

from __future__ import annotations

import array
import asyncio
import socket
import time

from wheeld.protocol import messages as M
from wheeld.protocol.errors import BrokenPeer, RingFull, Timeout
from wheeld.protocol.framing import FrameReader

from .core import _FDS_SPACE, ClientCore, Expired, decode_daemon_body, passed_fds
from .handshake import RETRY_FIRST_S, Handshake, Reconnection

_DOORBELL = M.encode_client_frame(M.Doorbell())
_DOORBELL_URGENT = M.encode_client_frame(M.Doorbell(urgent=True))


class AsyncClient(ClientCore):
    """A worker's connection to wheeld from asyncio code (one event loop)."""

    def __init__(self, socket_path: str | None, group: str, ring_timeout_s: float, reconnect_timeout_s: float,
                 client_name: str) -> None:
        super().__init__(socket_path, group, ring_timeout_s, reconnect_timeout_s, client_name)
        self._sock: socket.socket | None = None
        self._reader = FrameReader()
        self._reconnection = Reconnection(self.socket_path, reconnect_timeout_s)

    async def _connect(self, until: float, first: bool) -> None:
        """Open a session before ``until`` (time.monotonic()); see :mod:`wheeld.sync`."""
        pause = RETRY_FIRST_S
        while True:
            try:
                await self._handshake(until)
                return
            except (OSError, BrokenPeer) as exc:  # asyncio.TimeoutError is TimeoutError, an OSError
                failure = self._reconnection.attempt_failed(exc, first)  # raises what retrying will not heal
            if time.monotonic() + pause >= until:
                raise failure
            await asyncio.sleep(pause)
            pause = Reconnection.next_pause(pause)

    async def _handshake(self, until: float) -> None:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        attempt = None
        try:
            await asyncio.wait_for(loop.sock_connect(sock, self.socket_path), max(0.05, until - time.monotonic()))
            attempt = Handshake(self)
            frame, fds = attempt.frame, attempt.fds
            if fds:
                sent = await _wait_ready(loop, sock, until, write=True, op=lambda: sock.sendmsg(
                    [frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]))
                await loop.sock_sendall(sock, frame[sent:])
            else:
                await loop.sock_sendall(sock, frame)
            while True:
                data, ancillary, _flags, _addr = await _wait_ready(
                    loop, sock, until, write=False, op=lambda: sock.recvmsg(65536, _FDS_SPACE))
                if attempt.received(data, passed_fds(ancillary)):
                    break
            reader = attempt.open()
        except BaseException:
            sock.close()
            if attempt is not None:
                attempt.abandon()
            raise
        if self._sock is not None:
            self._sock.close()
        self._sock, self._reader = sock, reader
        for body in attempt.rest:
            self._on_message(decode_daemon_body(body))

    async def _reconnect(self, until: float | None = None) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        give_up = self._reconnection.lost(time.monotonic())
        try:
            await self._connect(give_up if until is None else min(until, give_up), first=False)
        except (BrokenPeer, Timeout) as exc:
            self._reconnection.failed(exc, time.monotonic())  # raises BrokenPeer past give_up
            return
        self._reconnection.restored()

    def _wait_for_room(self) -> None:
        self._ring_doorbell()
        raise RingFull("the ring is full; await flush() or poll() and retry")

    def _ring_doorbell(self, urgent: bool = True) -> None:
        if self._sock is not None:
            try:
                self._sock.send(_DOORBELL_URGENT if urgent else _DOORBELL)
            except OSError:
                pass

    async def _read(self, timeout_s: float | None, until: float | None = None) -> bool:
        loop = asyncio.get_running_loop()
        if self._sock is None:
            await self._reconnect(until)
            if self._sock is None:
                return False
        # bytes already waiting are taken at once; otherwise wait, then read with no await
        # between the read and handling what it got (see _readable)
        data = _recv_now(self._sock)
        if data is None:
            if not await _readable(loop, self._sock, timeout_s):
                return False
            data = _recv_now(self._sock)
            if data is None:
                return True  # woken without data (another reader took it)
        if not data:
            await self._reconnect(until)
            return True
        for body in self._reader.feed(data):
            try:
                self._on_message(decode_daemon_body(body))
            except BrokenPeer:
                await self._reconnect(until)
                return True
        return True

    async def poll(self, timeout_s: float | None = None) -> list[Expired]:
        """Expirations that came due; waits up to ``timeout_s`` (None: until at least one)."""
        self._check_open()
        self._flush_acks()
        end = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._ready:
            remaining = None if end is None else end - time.monotonic()
            if remaining is not None and remaining <= 0:
                break
            await self._read(remaining, end)
        return self._take_ready()

    def __aiter__(self):
        return self

    async def __anext__(self) -> Expired:
        while not self._ready:
            self._check_open()
            self._flush_acks()
            await self._read(None)
        return self._take_one()

    async def flush(self, timeout_s: float = 10.0) -> None:
        """Return once the daemon has applied every command sent before this call.

        Raises ArenaFull / QuotaExceeded / InvalidRequest for commands pushed before it
        that the daemon refused and no earlier flush raised (never for one pushed after
        it: another task's), JournalUnavailable when the daemon applied them but could
        not write its journal (a later flush that succeeds covers them), and Timeout (a
        TimeoutError) after ``timeout_s`` at the latest."""
        self._check_open()
        end = time.monotonic() + timeout_s
        seq = self._push_flush()
        self._flush_waits(seq)
        try:
            while self._flush_answer(seq) is None:
                remaining = end - time.monotonic()
                if remaining <= 0:
                    raise self._reconnection.not_applied(timeout_s, time.monotonic())
                if not await self._read(min(remaining, 0.05), end):
                    self._ring_doorbell()
        except BaseException:
            self._flush_abandoned(seq)  # what its Applied answered goes to the next flush
            raise
        rejected = self._flush_answers.pop(seq)
        assert rejected is not None  # the Applied came: the loop above waited for it
        self._raise_rejections(rejected)

    async def close(self) -> None:
        """Acknowledge what was handed over, say goodbye, unmap. Pending timers stay.
        In a child process that inherited the client, only the child's copies go."""
        if self._closed and not self._forked:
            return
        try:
            if self._sock is not None and not self._forked:
                if self._segment is not None:
                    self._flush_acks()
                try:
                    await asyncio.wait_for(
                        asyncio.get_running_loop().sock_sendall(self._sock, M.encode_client_frame(M.Bye())), 1.0)
                except (OSError, asyncio.TimeoutError):
                    pass
            if self._sock is not None:
                self._sock.close()
                self._sock = None
        finally:
            self._closed = True
            self._release_local()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


async def _readable(loop: asyncio.AbstractEventLoop, sock: socket.socket, timeout_s: float | None) -> bool:
    """Wait until ``sock`` is readable (True) or ``timeout_s`` has passed (False); reads nothing.

    Not ``loop.sock_recv``: it reads in the loop's callback, and a task cancelled after that
    callback but before it resumed drops the bytes (a reader paused for a flush lost whole
    batches of expirations). Nor ``asyncio.wait_for``: on Python 3.11 it can swallow a
    cancellation when the awaited future is already done, and the task that was cancelled
    keeps reading. A cancellation here can only end the wait.
    """
    ready = loop.create_future()
    fd = sock.fileno()
    loop.add_reader(fd, _resolve, ready, True)
    timer = None if timeout_s is None else loop.call_later(max(0.0, timeout_s), _resolve, ready, False)
    try:
        return await ready
    finally:
        loop.remove_reader(fd)
        if timer is not None:
            timer.cancel()


def _recv_now(sock: socket.socket) -> bytes | None:
    """What ``sock`` holds now (b"": closed or failed), or None when nothing is waiting."""
    try:
        return sock.recv(1 << 20)
    except (BlockingIOError, InterruptedError):
        return None
    except OSError:
        return b""


def _resolve(future: asyncio.Future, value: object) -> None:
    if not future.done():
        future.set_result(value)


async def _wait_ready(loop: asyncio.AbstractEventLoop, sock: socket.socket, until: float, write: bool, op):
    """Run the non-blocking ``op`` on ``sock`` once it is ready (sendmsg/recvmsg with
    descriptors, which the loop has no coroutine for), before ``until``."""
    while True:
        try:
            return op()
        except (BlockingIOError, InterruptedError):
            pass
        ready = loop.create_future()
        fd = sock.fileno()
        (loop.add_writer if write else loop.add_reader)(fd, _resolve, ready, None)
        try:
            await asyncio.wait_for(ready, max(0.0, until - time.monotonic()))
        finally:
            (loop.remove_writer if write else loop.remove_reader)(fd)


async def connect_async(socket_path: str | None = None, group: str = "default", *, ring_timeout_s: float = 5.0,
                        reconnect_timeout_s: float = 30.0, connect_timeout_s: float = 10.0,
                        client_name: str = "") -> AsyncClient:
    """Connect to wheeld as a member of ``group`` (the options as in :func:`wheeld.connect`)."""
    client = AsyncClient(socket_path, group, ring_timeout_s, reconnect_timeout_s, client_name)
    await client._connect(time.monotonic() + connect_timeout_s, first=True)
    return client
