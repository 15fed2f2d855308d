"""Length-prefixed frames on the client <-> daemon stream socket.

A frame is a 4-byte little-endian unsigned body length, then the body (a msgpack
message of :mod:`wheeld.protocol.messages`)::

    0               4                         4 + length
    +---------------+-------------------------+
    | length u32 LE | body (length bytes)     |
    +---------------+-------------------------+

A length above :data:`MAX_FRAME` (16 MiB) is a :class:`ProtocolError`, announced
before the body arrives, so a broken or hostile peer cannot make us buffer an
unbounded amount. Zero-length bodies are legal frames (they do not decode as a
message; that is the message layer's error to report).

Like h11, this module does no I/O of its own: :class:`FrameReader` turns bytes
in (from asyncio's ``data_received`` or a socket read) into complete bodies out,
and :func:`encode_frame` / :func:`write_header` build frames for the caller to send.
"""

from __future__ import annotations

import struct

from .errors import InvalidRequest, ProtocolError

HEADER = struct.Struct("<I")
HEADER_SIZE = HEADER.size
MAX_FRAME = 16 * 1024 * 1024

assert HEADER_SIZE == 4


def write_header(buffer: bytearray, body_length: int, offset: int = 0) -> None:
    """Store the length prefix of a ``body_length``-byte body at ``buffer[offset:offset+4]``."""
    if not 0 <= body_length <= MAX_FRAME:
        raise InvalidRequest(f"a frame body is at most {MAX_FRAME} bytes, not {body_length}")
    HEADER.pack_into(buffer, offset, body_length)


def encode_frame(body: bytes) -> bytes:
    """Length prefix + ``body``."""
    size = len(body)
    if size > MAX_FRAME:
        raise InvalidRequest(f"a frame body is at most {MAX_FRAME} bytes, not {size}")
    return HEADER.pack(size) + body


class FrameReader:
    """Incremental frame splitter: ``feed(bytes) -> [complete bodies]``.

    Keeps at most one partial frame. After it raised ProtocolError the stream is
    out of sync and the reader refuses further input (raises again).
    """

    __slots__ = ("_buffer", "_failed", "max_frame")

    def __init__(self, max_frame: int = MAX_FRAME):
        self._buffer = bytearray()
        self._failed = False
        self.max_frame = max_frame

    def feed(self, data) -> list[bytes]:
        if self._failed:
            raise ProtocolError("frame stream is out of sync after an earlier error")
        buffer = self._buffer
        buffer += data
        bodies = []
        start = 0
        available = len(buffer)
        while available - start >= HEADER_SIZE:
            (length,) = HEADER.unpack_from(buffer, start)
            if length > self.max_frame:
                self._failed = True
                raise ProtocolError(f"peer announced a {length}-byte frame; the limit is {self.max_frame}")
            end = start + HEADER_SIZE + length
            if end > available:
                break
            bodies.append(bytes(buffer[start + HEADER_SIZE : end]))
            start = end
        if start:
            del buffer[:start]
        return bodies

    @property
    def pending_bytes(self) -> int:
        """Bytes of an incomplete frame held back (0 at a frame boundary)."""
        return len(self._buffer)

    def at_boundary(self) -> bool:
        """True if no partial frame is buffered (EOF here is a clean close)."""
        return not self._buffer
