"""The asyncio client: ``await wheeld.connect_async()``. Same semantics as :mod:`wheeld.sync`.

Commands (add, add_idle, touch, cancel) are plain methods: they write to shared
memory and never block the loop (a full ring raises RingFull at once instead of
waiting). ``poll`` and ``flush`` are coroutines.
"""

from __future__ import annotations

import asyncio
import socket
import time

from wheeld.protocol import messages as M
from wheeld.protocol.errors import BrokenPeer, ProtocolError, RingFull
from wheeld.protocol.framing import FrameReader

from .core import ClientCore, Expired, decode_daemon_body

_DOORBELL = M.encode_client_frame(M.Doorbell())
_DOORBELL_URGENT = M.encode_client_frame(M.Doorbell(urgent=True))


class AsyncClient(ClientCore):
    def __init__(self, socket_path, group, ring_timeout_s, reconnect_timeout_s, client_name):
        super().__init__(socket_path, group, ring_timeout_s, reconnect_timeout_s, client_name)
        self._sock: socket.socket | None = None
        self._reader = FrameReader()

    async def _connect(self, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        end = time.monotonic() + timeout_s
        delay = 0.01
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, self.socket_path)
                await loop.sock_sendall(sock, M.encode_client_frame(self._hello()))
                reader = FrameReader()
                frames = []
                while not frames:
                    data = await asyncio.wait_for(loop.sock_recv(sock, 65536), max(0.1, end - time.monotonic()))
                    if not data:
                        raise BrokenPeer("the daemon closed the connection during the handshake")
                    frames = reader.feed(data)
                message = decode_daemon_body(frames[0])
                if type(message) is M.Refused:
                    sock.close()
                    raise BrokenPeer(f"the daemon refused the session: {message.reason}")
                if type(message) is not M.Welcome:
                    raise ProtocolError(f"expected Welcome, got {type(message).__name__}")
                self._on_welcome(message)
            except (OSError, asyncio.TimeoutError, BrokenPeer) as exc:
                sock.close()
                if isinstance(exc, BrokenPeer) and "refused the session" in str(exc):
                    raise
                if time.monotonic() >= end:
                    raise BrokenPeer(f"cannot reach wheeld at {self.socket_path}: {exc}") from exc
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.5)
                continue
            if self._sock is not None:
                self._sock.close()
            self._sock, self._reader = sock, reader
            for body in frames[1:]:
                self._on_message(decode_daemon_body(body))
            return

    def _wait_for_room(self) -> None:
        self._ring_doorbell()
        raise RingFull("the ring is full; await flush() or poll() and retry")

    def _ring_doorbell(self, urgent: bool = True) -> None:
        if self._sock is not None:
            try:
                self._sock.send(_DOORBELL_URGENT if urgent else _DOORBELL)
            except OSError:
                pass

    async def _read(self, timeout_s: float | None) -> bool:
        loop = asyncio.get_running_loop()
        if self._sock is None:
            await self._connect(self.reconnect_timeout_s)
        try:
            data = await asyncio.wait_for(loop.sock_recv(self._sock, 1 << 20), timeout_s)
        except asyncio.TimeoutError:
            return False
        except OSError:
            data = b""
        if not data:
            self._sock.close()
            self._sock = None
            await self._connect(self.reconnect_timeout_s)
            return True
        for body in self._reader.feed(data):
            try:
                self._on_message(decode_daemon_body(body))
            except BrokenPeer:
                self._sock.close()
                self._sock = None
                await self._connect(self.reconnect_timeout_s)
                return True
        return True

    async def poll(self, timeout_s: float | None = None) -> list[Expired]:
        self._check_open()
        self._flush_acks()
        end = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._ready:
            remaining = None if end is None else end - time.monotonic()
            if remaining is not None and remaining <= 0:
                break
            await self._read(remaining)
        return self._take_ready()

    def __aiter__(self):
        return self

    async def __anext__(self) -> Expired:
        while not self._ready:
            self._flush_acks()
            await self._read(None)
        return self._take_one()

    async def flush(self, timeout_s: float = 10.0) -> None:
        self._check_open()
        seq = self._push_flush()
        end = time.monotonic() + timeout_s
        while self._applied != seq:
            remaining = end - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"wheeld did not apply the commands within {timeout_s} s")
            if not await self._read(min(remaining, 0.05)):
                self._ring_doorbell()
        self._raise_rejections()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._segment is not None:
                self._flush_acks()
            if self._sock is not None:
                try:
                    await asyncio.get_running_loop().sock_sendall(self._sock, M.encode_client_frame(M.Bye()))
                except OSError:
                    pass
                self._sock.close()
        finally:
            if self._segment is not None:
                self._segment.close()
            if self._arena is not None:
                self._parked = None
                self._arena.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


async def connect_async(socket_path: str | None = None, group: str = "default", *, ring_timeout_s: float = 5.0,
                        reconnect_timeout_s: float = 30.0, connect_timeout_s: float = 10.0,
                        client_name: str = "") -> AsyncClient:
    client = AsyncClient(socket_path, group, ring_timeout_s, reconnect_timeout_s, client_name)
    await client._connect(connect_timeout_s)
    return client
