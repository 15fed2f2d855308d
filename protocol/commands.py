"""The 64-byte ring command record: the only thing a client ever writes for the daemon.

A client schedules, re-arms and cancels timers by appending these records to its
own single-producer/single-consumer ring (:mod:`wheeld.shm.ring`). The daemon
copies a batch of them out with one numpy slice, checks the whole batch with
:func:`validate_records` and applies the valid ones. The record is declared here
once; no other module writes one of these offsets as a number.

Layout (little-endian, 64 bytes, one record per ring slot)::

     0       1       2               4               8                              16
     +-------+-------+---------------+---------------+-------------------------------+
     | op u8 | kmeta | reserved u16  | seq u32       | deadline_ms i64               |
     +-------+-------+---------------+---------------+-------------------------------+
    16               20              24              28                              32
     | aux0 i32      | aux1 i32      | check u32     | pad u32                       |
     +---------------+---------------+---------------+-------------------------------+
    32                                                                              64
     | key: 32 bytes, zero padded                                                    |
     +-------------------------------------------------------------------------------+

``check`` is ``zlib.crc32`` of bytes 0..23 followed by the whole 32-byte key
field (bytes 32..63, zero padding included): the 56 bytes that carry meaning.
``reserved`` and ``pad`` are zero when the client writes the record. ``pad`` is
outside the check: it is the record's *answer mark*, the one field the daemon
writes. Before it publishes the ring's head past a record it refused (or a FLUSH
it answers as not durable), the daemon stores there ``1 +`` the index of the
answer's code in :data:`ANSWER_MARKS`. An answer that never reaches the client (the
daemon killed between the head and the answer, a session closed or its socket
full) is then still in the ring; the client library reads it back when its next
session opens (see :mod:`wheeld.shm.ring`). ``kmeta`` is the key meta byte of
:mod:`wheeld.protocol.keys` (length in bits 0-5, type in bits 6-7).

Operations and the fields each one uses (every field an op does not use is zero;
a non-zero unused field makes the record garbage):

==========  ==========================================================================
``ADD``      key, ``deadline_ms`` (monotonic ms), ``seq`` = the client's arming id
``ADD_IDLE`` key, ``deadline_ms`` = first deadline, ``aux0`` = idle_ms (> 0),
             ``aux1`` = touch index (0 <= index < the segment's touch capacity), seq
``CANCEL``   key, ``seq``
``ACK``      ``aux0`` = slot (>= 0), ``aux1`` = generation of a fired record that was
             delivered to the application; ``seq`` = the ``arena_epoch`` of the
             ``Welcome`` it was received under (0: unstamped); the daemon ignores an
             ack stamped with another arena's epoch (after a reboot recovery)
``FLUSH``    ``seq``; the daemon answers ``Applied(seq)`` once everything before is applied
==========  ==========================================================================

What counts as garbage (the daemon disconnects a client that sends any): an
unknown op, a non-zero reserved/pad/unused field, a key meta that
:func:`~wheeld.protocol.keys.valid_key_meta` rejects (or a non-zero one on a
keyless op), non-zero bytes after the key's length, a ``str`` key that is not
UTF-8, or a check word that does not match. A random 64-byte record passes with
probability well below 2**-40, so torn or scribbled memory is detected rather than
applied.

Costs (``bench/ring.py``, docs/figures.md): encoding is one ``struct`` pack of the
56 checked bytes, one ``crc32`` and one ``pack_into``. The batch validator is
vectorised for large batches: the crc is computed with
per-byte-position lookup tables (CRC-32 is affine over GF(2), so for a fixed
56-byte message ``crc(m) = crc(0**56) ^ XOR_i T[i][m[i]]``). A batch of fewer than
64 records is checked one record at a time in Python, which is cheaper than the
fixed cost of ~30 numpy passes; both paths apply the same rules
(a property test holds them equal).
"""

from __future__ import annotations

import enum
import struct
import zlib
from typing import NamedTuple

import numpy as np

from .errors import InvalidKey, InvalidRequest, ProtocolError
from .keys import KEY_BYTES, TYPE_STR, VALID_KEY_METAS, Key, decode_key, key_length, key_type

# --------------------------------------------------------------------------- layout

RECORD_SIZE = 64

OP_OFFSET = 0
KEY_META_OFFSET = 1
RESERVED_OFFSET = 2
SEQ_OFFSET = 4
DEADLINE_OFFSET = 8
AUX0_OFFSET = 16
AUX1_OFFSET = 20
CHECK_OFFSET = 24
PAD_OFFSET = 28
KEY_OFFSET = 32
KEY_FIELD_SIZE = KEY_BYTES

#: bytes 0..CHECKED_HEAD_SIZE-1 and the key field are covered by the check word
CHECKED_HEAD_SIZE = CHECK_OFFSET
CHECKED_SIZE = CHECKED_HEAD_SIZE + KEY_FIELD_SIZE

#: the codes an answer mark (``pad``) names, 1-based: mark ``i + 1`` is ``ANSWER_MARKS[i]``
#: (the ``Rejected`` codes of :mod:`wheeld.protocol.messages`)
ANSWER_MARKS = ("arena_full", "quota_exceeded", "invalid_deadline", "invalid_touch_index", "unknown_key",
                "journal_unavailable", "replication_behind")
#: code -> its mark
ANSWER_MARK = {code: i + 1 for i, code in enumerate(ANSWER_MARKS)}

#: the full record (reserved and pad written as zero)
RECORD = struct.Struct("<BB2xIqiiI4x32s")
#: the 56 bytes the check word covers, in check order: bytes 0..23 then the key field
CHECKED = struct.Struct("<BB2xIqii32s")

#: the same two for ADD, whose aux0/aux1 are zero (fewer arguments on the hottest path)
ADD_RECORD = struct.Struct("<BB2xIq8xI4x32s")
ADD_CHECKED = struct.Struct("<BB2xIq8x32s")

assert RECORD.size == ADD_RECORD.size == RECORD_SIZE
assert ADD_CHECKED.size == CHECKED.size
assert RECORD_SIZE & (RECORD_SIZE - 1) == 0
#: ``slot << RECORD_SHIFT`` is the byte offset of a ring slot
RECORD_SHIFT = RECORD_SIZE.bit_length() - 1
assert CHECKED.size == CHECKED_SIZE == 56
assert struct.calcsize("<BBHIqii") == CHECK_OFFSET
assert struct.calcsize("<BBHIqiiII") == KEY_OFFSET
assert KEY_OFFSET + KEY_FIELD_SIZE == RECORD_SIZE

#: numpy view of one record, for batch decoding (``np.frombuffer(buf, RECORD_DTYPE)``)
RECORD_DTYPE = np.dtype(
    {
        "names": ["op", "key_meta", "reserved", "seq", "deadline_ms", "aux0", "aux1", "check", "pad", "key"],
        "formats": ["u1", "u1", "<u2", "<u4", "<i8", "<i4", "<i4", "<u4", "<u4", ("u1", (KEY_FIELD_SIZE,))],
        "offsets": [
            OP_OFFSET,
            KEY_META_OFFSET,
            RESERVED_OFFSET,
            SEQ_OFFSET,
            DEADLINE_OFFSET,
            AUX0_OFFSET,
            AUX1_OFFSET,
            CHECK_OFFSET,
            PAD_OFFSET,
            KEY_OFFSET,
        ],
        "itemsize": RECORD_SIZE,
    }
)
assert RECORD_DTYPE.itemsize == RECORD_SIZE

# --------------------------------------------------------------------------- ops


class Op(enum.IntEnum):
    """Ring command operations (see the table in the module docstring)."""

    ADD = 1
    ADD_IDLE = 2
    CANCEL = 3
    ACK = 4
    FLUSH = 5


ADD = Op.ADD.value
ADD_IDLE = Op.ADD_IDLE.value
CANCEL = Op.CANCEL.value
ACK = Op.ACK.value
FLUSH = Op.FLUSH.value

#: ops whose record carries a key
KEYED_OPS = frozenset({ADD, ADD_IDLE, CANCEL})

SEQ_MAX = (1 << 32) - 1
I32_MIN = -(1 << 31)
I32_MAX = (1 << 31) - 1

# --------------------------------------------------------------------------- encoding

_pack_checked = CHECKED.pack
_pack_record_into = RECORD.pack_into
_crc32 = zlib.crc32


def pack_command_into(
    buffer,
    offset: int,
    op: int,
    key_bytes: bytes = b"",
    key_meta: int = 0,
    deadline_ms: int = 0,
    seq: int = 0,
    aux0: int = 0,
    aux1: int = 0,
) -> None:
    """Write one complete record (check word included) at ``buffer[offset:offset+64]``.

    Raises :class:`InvalidRequest` if a field does not fit its width. The key is
    not validated here; get ``(key_bytes, key_meta)`` from
    :func:`wheeld.protocol.keys.encode_key`.
    """
    if len(key_bytes) > KEY_FIELD_SIZE:  # struct would truncate it silently
        raise InvalidKey(f"key is {len(key_bytes)} bytes; the record holds {KEY_FIELD_SIZE}")
    try:
        check = _crc32(_pack_checked(op, key_meta, seq, deadline_ms, aux0, aux1, key_bytes))
        _pack_record_into(buffer, offset, op, key_meta, seq, deadline_ms, aux0, aux1, check, key_bytes)
    except struct.error as exc:
        raise InvalidRequest(f"command field out of range: {exc}") from None


def encode_command(
    op: int,
    key_bytes: bytes = b"",
    key_meta: int = 0,
    deadline_ms: int = 0,
    seq: int = 0,
    aux0: int = 0,
    aux1: int = 0,
) -> bytes:
    """One record as 64 bytes."""
    buffer = bytearray(RECORD_SIZE)
    pack_command_into(buffer, 0, op, key_bytes, key_meta, deadline_ms, seq, aux0, aux1)
    return bytes(buffer)


def encode_add(key_bytes: bytes, key_meta: int, deadline_ms: int, seq: int) -> bytes:
    return encode_command(ADD, key_bytes, key_meta, deadline_ms, seq)


def encode_add_idle(
    key_bytes: bytes, key_meta: int, deadline_ms: int, idle_ms: int, touch_index: int, seq: int
) -> bytes:
    return encode_command(ADD_IDLE, key_bytes, key_meta, deadline_ms, seq, idle_ms, touch_index)


def encode_cancel(key_bytes: bytes, key_meta: int, seq: int) -> bytes:
    return encode_command(CANCEL, key_bytes, key_meta, 0, seq)


def encode_ack(slot: int, generation: int, seq: int = 0) -> bytes:
    return encode_command(ACK, b"", 0, 0, seq, slot, generation)


def encode_flush(seq: int) -> bytes:
    return encode_command(FLUSH, b"", 0, 0, seq)


# --------------------------------------------------------------------------- decoding

#: key meta byte -> valid for a keyed op, key length, key type (from wheeld.protocol.keys, the one authority)
_VALID_KEY_META = np.array(VALID_KEY_METAS, dtype=bool)
_KEY_LENGTH = key_length(np.arange(256, dtype=np.uint8))
_KEY_TYPE = key_type(np.arange(256, dtype=np.uint8))
_WORDS_PER_RECORD = RECORD_SIZE // 8
_KEY_FIRST_WORD = KEY_OFFSET // 8
assert KEY_OFFSET % 8 == 0 and KEY_FIELD_SIZE == 4 * 8  # _any_word ORs the key's four words


def _build_padding_masks() -> np.ndarray:
    """_PADDING_MASKS[n]: the key field's bits at byte positions >= n, as little-endian u64 words."""
    masks = np.zeros((256, KEY_FIELD_SIZE), dtype=np.uint8)
    for length in range(256):
        masks[length, min(length, KEY_FIELD_SIZE) :] = 0xFF
    return masks.view("<u8")


_PADDING_MASKS = _build_padding_masks()
_HIGH_BITS = np.uint64(0x8080808080808080)

# CRC-32 is affine: for a fixed-length message m, crc(m) = crc(zeros) ^ XOR_i T[i][m[i]],
# where T[i][b] = crc(b at position i, zeros elsewhere) ^ crc(zeros).
_CRC_OF_ZEROS = zlib.crc32(bytes(CHECKED_SIZE))


def _build_crc_tables() -> np.ndarray:
    tables = np.empty((CHECKED_SIZE, 256), dtype=np.uint32)
    message = bytearray(CHECKED_SIZE)
    for position in range(CHECKED_SIZE):
        for value in range(256):
            message[position] = value
            tables[position, value] = zlib.crc32(message) ^ _CRC_OF_ZEROS
        message[position] = 0
    return tables


_CRC_TABLES = _build_crc_tables()
#: below this many records zlib per record beats 56 vectorised table passes
_VECTOR_CRC_MIN_RECORDS = 192


def _any_word(words: np.ndarray) -> np.ndarray:
    """Per row of an (n, 4) u64 array: is any word non-zero (faster than np.any(axis=1))."""
    return (words[:, 0] | words[:, 1] | words[:, 2] | words[:, 3]) != 0


def checked_bytes(records: np.ndarray) -> np.ndarray:
    """The (n, 56) uint8 array of the bytes each record's check word covers."""
    raw = np.ascontiguousarray(records).view(np.uint8).reshape(-1, RECORD_SIZE)
    checked = np.empty((raw.shape[0], CHECKED_SIZE), dtype=np.uint8)
    checked[:, :CHECKED_HEAD_SIZE] = raw[:, :CHECKED_HEAD_SIZE]
    checked[:, CHECKED_HEAD_SIZE:] = raw[:, KEY_OFFSET:]
    return checked


def crc32_rows(checked: np.ndarray) -> np.ndarray:
    """``zlib.crc32`` of every row of an (n, 56) uint8 array, as uint32."""
    count = checked.shape[0]
    if count < _VECTOR_CRC_MIN_RECORDS:
        return np.fromiter(map(_crc32, checked), dtype=np.uint32, count=count)
    columns = np.ascontiguousarray(checked.T)
    result = np.full(count, _CRC_OF_ZEROS, dtype=np.uint32)
    for position in range(CHECKED_SIZE):
        result ^= _CRC_TABLES[position][columns[position]]
    return result


def records_from_buffer(data) -> np.ndarray:
    """A read-only record array over ``data`` (bytes-like, a multiple of 64 bytes long)."""
    size = memoryview(data).nbytes
    if size % RECORD_SIZE:
        raise ProtocolError(f"{size} bytes is not a whole number of {RECORD_SIZE}-byte commands")
    return np.frombuffer(data, dtype=RECORD_DTYPE)


_unpack_head = struct.Struct("<BBHIqiiII").unpack_from
assert struct.calcsize("<BBHIqiiII") == KEY_OFFSET
_KEY_LENGTH_TUPLE = tuple(_KEY_LENGTH.tolist())
_KEY_TYPE_TUPLE = tuple(_KEY_TYPE.tolist())
_ZERO_TAILS = tuple(bytes(KEY_FIELD_SIZE - length) for length in range(KEY_FIELD_SIZE + 1))
#: below this many records the per-record loop beats ~30 vectorised numpy passes
_VECTOR_VALIDATE_MIN_RECORDS = 64


def _validate_each(records: np.ndarray, touch_capacity: int | None) -> np.ndarray:
    """validate_records for small batches: the same rules, one record at a time."""
    raw = records.tobytes()
    valid = np.zeros(records.shape[0], dtype=bool)
    for index in range(records.shape[0]):
        start = index * RECORD_SIZE
        op, key_meta, reserved, _seq, deadline_ms, aux0, aux1, check, pad = _unpack_head(raw, start)
        if reserved or pad:
            continue
        if op == ADD or op == ADD_IDLE or op == CANCEL:
            if not VALID_KEY_METAS[key_meta]:
                continue
            length = _KEY_LENGTH_TUPLE[key_meta]
        elif op == ACK or op == FLUSH:
            if key_meta:
                continue
            length = 0
        else:
            continue
        key = raw[start + KEY_OFFSET : start + RECORD_SIZE]
        if key[length:] != _ZERO_TAILS[length]:
            continue
        if (op == ADD or op == CANCEL or op == FLUSH) and (aux0 or aux1):
            continue
        if (op == CANCEL or op == ACK or op == FLUSH) and deadline_ms:
            continue
        if op == ADD_IDLE and not (aux0 > 0 and aux1 >= 0 and (touch_capacity is None or aux1 < touch_capacity)):
            continue
        if op == ACK and aux0 < 0:
            continue
        if _crc32(key, _crc32(raw[start : start + CHECKED_HEAD_SIZE])) != check:
            continue
        if length and _KEY_TYPE_TUPLE[key_meta] == TYPE_STR:
            try:
                key[:length].decode("utf-8")
            except UnicodeDecodeError:
                continue
        valid[index] = True
    return valid


def validate_records(records: np.ndarray, touch_capacity: int | None = None) -> np.ndarray:
    """Return a bool array: which records of a batch are well-formed commands.

    ``records`` is a 1-D array of :data:`RECORD_DTYPE` (what
    :meth:`wheeld.shm.ring.ClientSegment.drain` returns). With ``touch_capacity``
    an ``ADD_IDLE`` must also name a touch index inside the client's table. Never
    raises on any content of the records; raises ProtocolError only if ``records``
    is not a record array at all.
    """
    if not isinstance(records, np.ndarray) or records.dtype != RECORD_DTYPE or records.ndim != 1:
        raise ProtocolError("expected a 1-D array of ring command records")
    count = records.shape[0]
    if count < _VECTOR_VALIDATE_MIN_RECORDS:
        return _validate_each(records, touch_capacity)
    return _validate_vectorised(records, touch_capacity)


def _validate_vectorised(records: np.ndarray, touch_capacity: int | None) -> np.ndarray:
    """validate_records for large batches: ~30 numpy passes over the whole batch."""
    count = records.shape[0]
    records = np.ascontiguousarray(records)
    op = records["op"]
    key_meta = records["key_meta"]
    aux0 = records["aux0"]
    aux1 = records["aux1"]
    deadline_ms = records["deadline_ms"]
    key_words = records.view(np.uint64).reshape(count, _WORDS_PER_RECORD)[:, _KEY_FIRST_WORD:]

    keyed = (op == ADD) | (op == ADD_IDLE) | (op == CANCEL)
    keyless = (op == ACK) | (op == FLUSH)
    valid = (keyed | keyless) & (records["reserved"] == 0) & (records["pad"] == 0)

    # keys: a valid meta, and nothing but zeros after the key's length (keyless ops: meta 0, key all zero)
    key_length = _KEY_LENGTH[key_meta]
    padding_dirty = _any_word(key_words & _PADDING_MASKS[key_length])
    valid &= np.where(keyed, _VALID_KEY_META[key_meta], key_meta == 0) & ~padding_dirty

    # fields each op does not use are zero; the ones it uses are in range
    is_add = op == ADD
    is_idle = op == ADD_IDLE
    is_cancel = op == CANCEL
    is_ack = op == ACK
    is_flush = op == FLUSH
    valid &= ~(is_add | is_cancel | is_flush) | ((aux0 == 0) & (aux1 == 0))
    valid &= ~(is_cancel | is_ack | is_flush) | (deadline_ms == 0)
    idle_ok = (aux0 > 0) & (aux1 >= 0)
    if touch_capacity is not None:
        idle_ok &= aux1 < touch_capacity
    valid &= ~is_idle | idle_ok
    valid &= ~is_ack | (aux0 >= 0)

    # the check word, computed only for records that passed everything else
    candidates = np.flatnonzero(valid)
    if candidates.size == count:
        valid = crc32_rows(checked_bytes(records)) == records["check"]
    elif candidates.size:
        computed = crc32_rows(checked_bytes(records)[candidates])
        valid[candidates] = computed == records["check"][candidates]

    # str keys must be UTF-8: ASCII ones are (vectorised); decode only the others
    non_ascii = _any_word(key_words & _HIGH_BITS)
    str_keys = np.flatnonzero(valid & keyed & non_ascii & (_KEY_TYPE[key_meta] == TYPE_STR))
    for index in str_keys:
        try:
            key_words[index].tobytes()[: key_length[index]].decode("utf-8")
        except UnicodeDecodeError:
            valid[index] = False
    return valid


class Command(NamedTuple):
    """One decoded record, for code that handles commands one at a time."""

    op: Op
    key: Key | None
    deadline_ms: int
    seq: int
    aux0: int
    aux1: int


def decode_record(data, touch_capacity: int | None = None) -> Command:
    """Decode one 64-byte record; raise ProtocolError if it is garbage."""
    records = records_from_buffer(data)
    if records.shape[0] != 1:
        raise ProtocolError(f"a command is {RECORD_SIZE} bytes, not {records.nbytes}")
    if not validate_records(records, touch_capacity)[0]:
        raise ProtocolError("invalid ring command record")
    return command_at(records, 0)


def command_at(records: np.ndarray, index: int) -> Command:
    """The :class:`Command` at ``records[index]`` (which must have validated)."""
    record = records[index]
    op = Op(int(record["op"]))
    key_meta = int(record["key_meta"])
    key = decode_key(record["key"].tobytes(), key_meta) if op in KEYED_OPS else None
    return Command(op, key, int(record["deadline_ms"]), int(record["seq"]), int(record["aux0"]), int(record["aux1"]))
