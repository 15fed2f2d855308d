"""Timer keys: the one place that turns a user's key into record bytes and back.

A key is ``str`` (UTF-8), ``bytes`` or ``int`` (signed 64-bit). It is stored in a
record as up to :data:`KEY_BYTES` bytes plus one *key meta* byte::

    bit 7 6 | 5 4 3 2 1 0
        type| length (1..32)

    type 0 = bytes, 1 = str (UTF-8), 2 = int (8 bytes, little-endian, signed)

So ``"conn-17"`` and ``b"conn-17"`` are different keys (same bytes, other type),
and ``17`` is a third one. Empty keys and keys longer than 32 encoded bytes are
rejected with :class:`~wheeld.protocol.errors.InvalidKey`; nothing is truncated.
"""

from __future__ import annotations

from .errors import InvalidKey

KEY_BYTES = 32

TYPE_BYTES = 0
TYPE_STR = 1
TYPE_INT = 2

_TYPE_SHIFT = 6
_LEN_MASK = 0x3F

_INT_MIN = -(1 << 63)
_INT_MAX = (1 << 63) - 1
INT_KEY_BYTES = 8  # an int key: 8 bytes, little-endian, signed

Key = str | bytes | int


def encode_key(key: Key) -> tuple[bytes, int]:
    """Return ``(key_bytes, key_meta)`` for a user key; raise InvalidKey if unusable."""
    if type(key) is bytes:
        data = key
        kind = TYPE_BYTES
    elif type(key) is str:
        try:
            data = key.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidKey("a str key must be encodable as UTF-8 (it holds a lone surrogate)") from None
        kind = TYPE_STR
    elif type(key) is int:
        if not _INT_MIN <= key <= _INT_MAX:
            raise InvalidKey(f"int key {key} does not fit in a signed 64-bit integer")
        data = key.to_bytes(INT_KEY_BYTES, "little", signed=True)
        kind = TYPE_INT
    elif isinstance(key, (bytes, bytearray, memoryview)):
        data = bytes(key)
        kind = TYPE_BYTES
    elif isinstance(key, str):
        return encode_key(str(key))
    elif isinstance(key, int) and not isinstance(key, bool):
        return encode_key(int(key))
    else:
        raise InvalidKey(f"a key is str, bytes or int, not {type(key).__name__}")
    size = len(data)
    if size == 0:
        raise InvalidKey("a key must not be empty")
    if size > KEY_BYTES:
        raise InvalidKey(f"key is {size} bytes encoded; at most {KEY_BYTES} are supported")
    return data, key_meta_of(kind, size)


def key_meta_of(kind: int, length: int) -> int:
    """The key meta byte of a key of type ``kind`` (TYPE_*) and ``length`` encoded bytes."""
    return (kind << _TYPE_SHIFT) | length


def key_length(key_meta):
    """Encoded length of the key a meta byte describes (an int, or a numpy array of them)."""
    return key_meta & _LEN_MASK


def key_type(key_meta):
    """Type (TYPE_BYTES, TYPE_STR, TYPE_INT) of the key a meta byte describes (int or numpy array)."""
    return key_meta >> _TYPE_SHIFT


def decode_key(data: bytes, key_meta: int) -> Key:
    """Inverse of :func:`encode_key`; ``data`` may carry zero padding after the key."""
    kind = key_meta >> _TYPE_SHIFT
    raw = data[: key_meta & _LEN_MASK]
    if kind == TYPE_STR:
        return raw.decode("utf-8")
    if kind == TYPE_INT:
        return int.from_bytes(raw, "little", signed=True)
    return bytes(raw)


def valid_key_meta(key_meta: int) -> bool:
    """True if ``key_meta`` could have come from :func:`encode_key`."""
    size = key_meta & _LEN_MASK
    kind = key_meta >> _TYPE_SHIFT
    return 1 <= size <= KEY_BYTES and kind in (TYPE_BYTES, TYPE_STR, TYPE_INT) and (kind != TYPE_INT or size == 8)


#: :func:`valid_key_meta` of every byte value: index it with a meta byte (or, as a numpy
#: array, with an array of them) to check many at once
VALID_KEY_METAS = tuple(valid_key_meta(meta) for meta in range(256))


def c_layout() -> tuple[int, ...]:
    """The format's constants as the compiled decoder (``protocol/keycodec.pxd``) declares
    them; the modules that cimport it compare its ``_kc_layout()`` with this at import."""
    return (_TYPE_SHIFT, _LEN_MASK, TYPE_BYTES, TYPE_STR, TYPE_INT, INT_KEY_BYTES, KEY_BYTES)
