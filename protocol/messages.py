"""Socket messages between a client and the daemon: small typed msgspec values.

Commands that carry timers travel through the shared-memory ring
(:mod:`wheeld.protocol.commands`); the Unix socket carries only the session
handshake, the doorbell and what comes back: expirations, flush answers,
rejections. Every message is a frozen, tagged, ``array_like`` msgspec Struct
(encoded as a msgpack array whose first element is the tag), in one union per
direction, inside a length-prefixed frame (:mod:`wheeld.protocol.framing`)::

    client -> daemon   Hello | Doorbell | Bye
    daemon -> client   Welcome | Refused | Expirations | Applied | Rejected | Goodbye

A session::

    client                                   daemon
    Hello(version, group, pid, name)  --->   (+ the old ring's memfd when resuming)
                                      <---   Welcome(version, client_id, segment_name, ...)
                                             + SCM_RIGHTS: the ring's memfd, the status page
                                             (or Refused(reason, code) and close)
    ...pushes commands into the ring; Doorbell() only when the daemon is parked...
                                      <---   Expirations([Expiry, ...])
                                      <---   Applied(seq)                after FLUSH(seq)
                                      <---   Rejected(seq, key, reason, code)
    Bye()                             --->   (or the daemon's Goodbye(reason))

Keys. A timer key is ``str``, ``bytes`` or ``int``; msgspec cannot decode a union
holding both ``str`` and ``bytes`` (both are "str-like" to it), so messages carry
the key the way the ring does: ``key_bytes`` plus the ``key_meta`` byte of
:mod:`wheeld.protocol.keys`, and a ``key`` property decodes it. The decoder checks
that the two agree (and that a ``str`` key is UTF-8), so a message that decodes is
a message the rest of wheeld can use.

Encoding and decoding: one module-level Encoder and one typed Decoder per
direction, reused (msgspec's fastest path). ``decode_*`` raise
:class:`~wheeld.protocol.errors.ProtocolError` on any invalid input and nothing
else; ``encode_*`` raise :class:`~wheeld.protocol.errors.InvalidRequest` when
handed something that is not a message of that direction (the caller's bug).
Constraints (``msgspec.Meta``) are checked when decoding, not when constructing.
Extra trailing fields are ignored (msgspec's default for ``array_like``), which
leaves room to append optional fields without a new protocol version.

Size: an Expiry with a 10-byte key is about 33 bytes. ``Expirations`` has a codec of
its own for both ends (see "the Expirations codec" below).
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Union, get_args

import msgspec

from . import framing
from .errors import InvalidKey, InvalidRequest, ProtocolError
from .keys import KEY_BYTES, TYPE_STR, Key, decode_key, encode_key, key_length, key_type, valid_key_meta
from .ring_layout import MAX_RING_CAPACITY, MAX_TOUCH_CAPACITY, MIN_RING_CAPACITY

#: 2: rings are sealed memfds passed with SCM_RIGHTS alongside Hello/Welcome, a
#: read-only status page replaces reading the arena, Refused carries a code.
#: 3: the answers a client did not receive before its session ended are read back from
#: its ring (answer marks; ``Welcome.head``): the daemon no longer sends them on the next
#: session, so a client library of version 2 would miss them and is refused
PROTOCOL_VERSION = 3

U8 = Annotated[int, msgspec.Meta(ge=0, le=0xFF)]
U32 = Annotated[int, msgspec.Meta(ge=0, le=0xFFFF_FFFF)]
I32 = Annotated[int, msgspec.Meta(ge=-(1 << 31), le=(1 << 31) - 1)]
I64 = Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)]
NonNegativeI32 = Annotated[int, msgspec.Meta(ge=0, le=(1 << 31) - 1)]
NonNegativeI64 = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
Name = Annotated[str, msgspec.Meta(max_length=255)]
NonEmptyName = Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
Reason = Annotated[str, msgspec.Meta(max_length=4096)]
Code = Annotated[str, msgspec.Meta(max_length=64)]
KeyBytes = Annotated[bytes, msgspec.Meta(max_length=KEY_BYTES)]

#: key meta -> the key length it announces, or -1 if no key can have that meta
_KEY_LENGTH_FOR_META = tuple(key_length(meta) if valid_key_meta(meta) else -1 for meta in range(256))


def _check_key(key_bytes: bytes, key_meta: int, optional: bool) -> None:
    """Raise InvalidKey unless (key_bytes, key_meta) is a key encode_key could produce.

    Raised inside ``__post_init__``, a ValueError becomes msgspec's ValidationError
    when decoding (hence ProtocolError) and stays InvalidKey when constructing.
    """
    if optional and key_meta == 0 and not key_bytes:
        return
    if _KEY_LENGTH_FOR_META[key_meta] != len(key_bytes):
        raise InvalidKey(f"key_bytes of length {len(key_bytes)} do not match key_meta {key_meta:#x}")
    if key_type(key_meta) == TYPE_STR:
        try:
            key_bytes.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidKey("a str key must be UTF-8") from None


class _Message(msgspec.Struct, frozen=True, array_like=True):
    pass


# --------------------------------------------------------------------------- client -> daemon


class Hello(_Message, frozen=True, tag="hello"):
    """First message of a session: who the client is and which key group it uses.

    A client that had a session hands its ring back: the memfd travels as
    ``SCM_RIGHTS`` data with this frame, and ``resume_segment``/``resume_token``
    name it. The daemon adopts it (seals and header checked) so commands pushed
    while no daemon ran are applied."""

    protocol_version: U32
    group: NonEmptyName
    pid: NonNegativeI32
    client_name: Name
    #: after a daemon restart: the segment this client had, and the token that proves it
    resume_segment: Name = ""
    resume_token: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)] = 0
    #: the arena epoch of the last Welcome, and the ring position just after the last FLUSH
    #: that arena acknowledged: a daemon with another arena (rebuilt from the journal after a
    #: power cut) applies the handed-back ring from there; 0, 0: nothing to replay
    replay_epoch: U32 = 0
    replay_from: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)] = 0  # ring positions never get near 2**63


class Doorbell(_Message, frozen=True, tag="doorbell"):
    """'My ring has records': sent only when the daemon has said it is parked.

    ``urgent``: the client waits for the daemon (a flush, a full ring): apply now.
    Otherwise the daemon may let the commands gather for up to its coalescing window
    (``wheeld --coalesce-us``) and apply them in one wake-up. (A trailing field with a
    default: an older client's doorbell decodes as not urgent.)"""

    urgent: bool = False


class Bye(_Message, frozen=True, tag="bye"):
    """The client ends its session; the daemon drains the ring, then closes."""


ClientMessage = Union[Hello, Doorbell, Bye]


# --------------------------------------------------------------------------- daemon -> client


class Welcome(_Message, frozen=True, tag="welcome"):
    """The session is open: map the ring passed with this frame and push commands.

    ``SCM_RIGHTS`` data with this frame: the ring's memfd, then (``status_page``)
    the read-only status page. ``resumed``: the ring the client handed back is the
    one it keeps (its unapplied commands will be applied). ``head``: the ring's head as
    this session starts. The commands before it were applied by a daemon, and the
    answers to them that the client did not receive will not come: the client reads
    them back from the ring's answer marks (:mod:`wheeld.shm.ring`). Those from
    ``head`` on are answered on this session."""

    protocol_version: U32
    client_id: NonNegativeI64
    segment_name: NonEmptyName
    ring_capacity: Annotated[int, msgspec.Meta(ge=MIN_RING_CAPACITY, le=MAX_RING_CAPACITY)]
    touch_capacity: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOUCH_CAPACITY)]
    arena_name: Name
    tick_ms: Annotated[int, msgspec.Meta(ge=1, le=(1 << 31) - 1)]
    max_delay_ms: NonNegativeI64
    #: secret for resuming this segment after a daemon restart
    token: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)] = 0
    #: identifies the arena (its creation wall-clock ms, low 32 bits, never 0): slots
    #: and generations in expirations mean something only within one arena; acks carry
    #: it back in the ACK record's ``seq``
    arena_epoch: U32 = 0
    status_page: bool = False
    resumed: bool = False
    head: NonNegativeI64 = 0

    def __post_init__(self) -> None:
        if self.ring_capacity & (self.ring_capacity - 1):
            raise InvalidRequest(f"ring_capacity {self.ring_capacity} is not a power of two")


class Refused(_Message, frozen=True, tag="refused"):
    """The daemon will not open a session; it closes next. ``code`` says why, for the
    client to raise the right error (see REFUSE_CODES)."""

    reason: Reason
    code: Code = ""

    VERSION: ClassVar[str] = "version"  # protocol version not spoken
    NOT_ALLOWED: ClassVar[str] = "not_allowed"  # uid/gid not allowed, or the group has another owner
    GROUP_LIMIT: ClassVar[str] = "group_limit"  # every group id is in use
    BAD_REQUEST: ClassVar[str] = "bad_request"  # e.g. an invalid group name
    BUSY: ClassVar[str] = "busy"  # too many clients


class ExpiryFields(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """The fields of one expiration as they travel (an ``Expirations`` item), each
    constrained; :class:`Expiry` adds the check that ``key_bytes`` is a key of ``key_meta``.
    """

    key_bytes: KeyBytes
    key_meta: U8
    deadline_ms: I64
    fired_ms: I64
    seq: U32
    slot: NonNegativeI32
    generation: I32
    late: bool


class Expiry(ExpiryFields, frozen=True):
    """One timer that fired. ``late`` is True when it fired later than the daemon's promise."""

    def __post_init__(self) -> None:
        _check_key(self.key_bytes, self.key_meta, optional=False)

    @property
    def key(self) -> Key:
        return decode_key(self.key_bytes, self.key_meta)

    @classmethod
    def for_key(
        cls, key: Key, deadline_ms: int, fired_ms: int, seq: int, slot: int, generation: int, late: bool = False
    ) -> Expiry:
        key_bytes, key_meta = encode_key(key)
        return cls(key_bytes, key_meta, deadline_ms, fired_ms, seq, slot, generation, late)


class Expirations(_Message, frozen=True, tag="expirations"):
    """A batch of fired timers, oldest deadline first within one tick's batch."""

    items: list[Expiry]


class Applied(_Message, frozen=True, tag="applied"):
    """Every command before ``FLUSH(seq)`` in the ring has been applied."""

    seq: U32


class Rejected(_Message, frozen=True, tag="rejected"):
    """A command was not applied. ``code`` is machine-readable (see REJECT_CODES).

    ``key_bytes``/``key_meta`` are empty/0 when the command had no key.
    """

    seq: U32
    key_bytes: KeyBytes
    key_meta: U8
    reason: Reason
    code: Code

    ARENA_FULL: ClassVar[str] = "arena_full"
    QUOTA_EXCEEDED: ClassVar[str] = "quota_exceeded"
    INVALID_DEADLINE: ClassVar[str] = "invalid_deadline"
    INVALID_TOUCH_INDEX: ClassVar[str] = "invalid_touch_index"
    UNKNOWN_KEY: ClassVar[str] = "unknown_key"
    #: for a FLUSH (``seq`` is the flush's, no key): the commands before it were applied
    #: but the journal could not be written, so they are not durable (JournalUnavailable)
    JOURNAL_UNAVAILABLE: ClassVar[str] = "journal_unavailable"
    #: for a FLUSH: applied and journaled, but not yet stored by the cluster the daemon
    #: replicates to (``--durability replicated``; ReplicationBehind)
    REPLICATION_BEHIND: ClassVar[str] = "replication_behind"
    #: the codes of a FLUSH that was applied but is not as durable as promised
    NOT_DURABLE: ClassVar[frozenset] = frozenset(("journal_unavailable", "replication_behind"))

    def __post_init__(self) -> None:
        _check_key(self.key_bytes, self.key_meta, optional=True)

    @property
    def key(self) -> Key | None:
        if self.key_meta == 0:
            return None
        return decode_key(self.key_bytes, self.key_meta)

    @classmethod
    def for_key(cls, seq: int, key: Key | None, reason: str, code: str) -> Rejected:
        key_bytes, key_meta = encode_key(key) if key is not None else (b"", 0)
        return cls(seq, key_bytes, key_meta, reason, code)


REJECT_CODES = frozenset(
    {Rejected.ARENA_FULL, Rejected.QUOTA_EXCEEDED, Rejected.INVALID_DEADLINE, Rejected.INVALID_TOUCH_INDEX,
     Rejected.UNKNOWN_KEY, Rejected.JOURNAL_UNAVAILABLE}
)
REFUSE_CODES = frozenset({Refused.VERSION, Refused.NOT_ALLOWED, Refused.GROUP_LIMIT, Refused.BAD_REQUEST, Refused.BUSY})


class Goodbye(_Message, frozen=True, tag="goodbye"):
    """The daemon ends the session (shutdown, garbage in the ring...); it closes next."""

    reason: Reason


DaemonMessage = Union[Welcome, Refused, Expirations, Applied, Rejected, Goodbye]

_CLIENT_TYPES = frozenset(get_args(ClientMessage))
_DAEMON_TYPES = frozenset(get_args(DaemonMessage))

# --------------------------------------------------------------------------- codecs

_encoder = msgspec.msgpack.Encoder()
_client_decoder = msgspec.msgpack.Decoder(ClientMessage)
_daemon_decoder = msgspec.msgpack.Decoder(DaemonMessage)
_DECODE_ERRORS = (msgspec.MsgspecError, ValueError)


def encode_client_message(message: ClientMessage) -> bytes:
    """The msgpack body of a client -> daemon message (no frame header)."""
    if type(message) not in _CLIENT_TYPES:
        raise InvalidRequest(f"{type(message).__name__} is not a client -> daemon message")
    return _encoder.encode(message)


def encode_daemon_message(message: DaemonMessage) -> bytes:
    """The msgpack body of a daemon -> client message (no frame header)."""
    if type(message) not in _DAEMON_TYPES:
        raise InvalidRequest(f"{type(message).__name__} is not a daemon -> client message")
    return _encoder.encode(message)


def decode_client_message(body) -> ClientMessage:
    """Decode a frame body sent by a client; ProtocolError if it is not a valid message."""
    try:
        return _client_decoder.decode(body)
    except _DECODE_ERRORS as exc:
        raise ProtocolError(f"invalid client message: {exc}") from None


def decode_daemon_message(body) -> DaemonMessage:
    """Decode a frame body sent by the daemon; ProtocolError if it is not a valid message."""
    try:
        return _daemon_decoder.decode(body)
    except _DECODE_ERRORS as exc:
        raise ProtocolError(f"invalid daemon message: {exc}") from None


# --------------------------------------------------------------------------- the Expirations codec
#
# An ``Expirations`` message is the msgpack array
#     ["expirations", [[key_bytes, key_meta, deadline_ms, fired_ms, seq, slot, generation, late], ...]]
# (``array_like`` structs). The daemon encodes it from tuples in that field order, without
# building ``Expiry`` objects; the client decodes it as ``ExpirationRows`` (the same field
# constraints, checked in msgspec's C code, without ``Expiry.__post_init__``'s per-item
# Python call) and makes the one check that call makes, for the whole frame, in
# :func:`expiry_keys`.


class ExpirationRows(_Message, frozen=True, tag=Expirations.__struct_config__.tag):
    """An ``Expirations`` frame as the client decodes it (see :func:`decode_daemon_body`)."""

    items: list[ExpiryFields]


_expiration_rows_decoder = msgspec.msgpack.Decoder(ExpirationRows)
_EXPIRATIONS_PREFIX = msgspec.msgpack.encode(Expirations([]))[:-1]  # array header + tag
_EXPIRATIONS_TAG = Expirations.__struct_config__.tag
#: an Expirations frame's body up to its items (the daemon's frame writer, wheeld.daemon.frames)
EXPIRATIONS_PREFIX = _EXPIRATIONS_PREFIX


def encode_expirations_frame(items: list[tuple]) -> bytearray:
    """A length-prefixed ``Expirations`` frame from item tuples in ``ExpiryFields`` order
    (msgspec encodes an ``array_like`` struct and a tuple of its fields alike)."""
    buffer = bytearray(framing.HEADER_SIZE)
    _encoder.encode_into((_EXPIRATIONS_TAG, items), buffer, framing.HEADER_SIZE)
    framing.write_header(buffer, len(buffer) - framing.HEADER_SIZE)
    return buffer


def expirations_frame_problem(frame) -> str | None:
    """Why a client would refuse this ``Expirations`` frame (a whole frame, header
    included), or None: the client's own decoder and key check
    (:func:`decode_daemon_body`, :func:`expiry_keys`) run on it. The daemon builds its
    items from arena records, which the daemon's uid (or damage) can overwrite; it checks
    a frame this way before sending it rather than send one its client refuses."""
    try:
        message = decode_daemon_body(memoryview(frame)[framing.HEADER_SIZE:])
        if type(message) is not ExpirationRows:
            return f"not an Expirations frame: {type(message).__name__}"
        expiry_keys(message.items)
    except ProtocolError as exc:
        return str(exc)
    return None


def decode_daemon_body(body) -> DaemonMessage | ExpirationRows:
    """A daemon frame body as a message: ``Expirations`` as :class:`ExpirationRows`,
    anything else through :func:`decode_daemon_message`. Raises ProtocolError on
    invalid input, like :func:`decode_daemon_message`."""
    if body[: len(_EXPIRATIONS_PREFIX)] == _EXPIRATIONS_PREFIX:
        try:
            return _expiration_rows_decoder.decode(body)
        except _DECODE_ERRORS as exc:
            raise ProtocolError(f"invalid daemon message: {exc}") from None
    return decode_daemon_message(body)


def expiry_keys(items) -> list[Key]:
    """The keys of a frame's items, after the check ``Expiry.__post_init__`` makes (the
    bytes are a key of the meta byte, a str key is UTF-8) for every item; ProtocolError
    if one fails: a frame is taken whole or refused."""
    key_length = _KEY_LENGTH_FOR_META
    try:
        keys = [decode_key(e.key_bytes, e.key_meta) for e in items if key_length[e.key_meta] == len(e.key_bytes)]
    except UnicodeDecodeError:
        raise ProtocolError("invalid daemon message: a str key must be UTF-8") from None
    if len(keys) != len(items):
        raise ProtocolError("invalid daemon message: key_bytes do not match key_meta")
    return keys


def _encode_frame(message) -> bytes:
    buffer = bytearray(framing.HEADER_SIZE)
    _encoder.encode_into(message, buffer, framing.HEADER_SIZE)
    framing.write_header(buffer, len(buffer) - framing.HEADER_SIZE)
    return bytes(buffer)


def encode_client_frame(message: ClientMessage) -> bytes:
    """Length prefix + body of a client -> daemon message, ready for ``sendall``."""
    if type(message) not in _CLIENT_TYPES:
        raise InvalidRequest(f"{type(message).__name__} is not a client -> daemon message")
    return _encode_frame(message)


def encode_daemon_frame(message: DaemonMessage) -> bytes:
    """Length prefix + body of a daemon -> client message, ready for a transport's ``write``."""
    if type(message) not in _DAEMON_TYPES:
        raise InvalidRequest(f"{type(message).__name__} is not a daemon -> client message")
    return _encode_frame(message)
