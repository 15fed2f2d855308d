"""Ring command records, socket messages and framing: round trips, garbage detection, fuzzing.

Every decoder fed arbitrary bytes must return a valid value or raise
ProtocolError, nothing else.
"""

from __future__ import annotations

import zlib

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from wheeld.protocol import accel, commands, framing, messages
from wheeld.protocol.commands import (
    ADD,
    ADD_IDLE,
    CANCEL,
    RECORD_DTYPE,
    RECORD_SIZE,
    Op,
    decode_record,
    encode_command,
    records_from_buffer,
    validate_records,
)
from wheeld.protocol.errors import InvalidKey, InvalidRequest, ProtocolError
from wheeld.daemon.executor import valid_prefix, valid_records
from wheeld.protocol.keys import TYPE_STR, encode_key, key_meta_of
from wheeld.protocol.messages import (
    PROTOCOL_VERSION,
    Applied,
    Bye,
    Doorbell,
    Expirations,
    Expiry,
    Goodbye,
    Hello,
    Refused,
    Rejected,
    Welcome,
    decode_client_message,
    decode_daemon_message,
    encode_client_frame,
    encode_client_message,
    encode_daemon_frame,
    encode_daemon_message,
)

keys = st.one_of(
    st.text(min_size=1, max_size=8),
    st.binary(min_size=1, max_size=32),
    st.integers(-(2**63), 2**63 - 1),
)

# ---------------------------------------------------------------- command records


def test_record_layout_is_64_bytes_and_matches_the_dtype():
    assert RECORD_DTYPE.itemsize == RECORD_SIZE == 64
    data = encode_command(ADD_IDLE, b"abc", 3, deadline_ms=-2, seq=9, aux0=7, aux1=5)
    record = records_from_buffer(data)[0]
    assert (record["op"], record["key_meta"], record["seq"], record["deadline_ms"]) == (ADD_IDLE, 3, 9, -2)
    assert (record["aux0"], record["aux1"]) == (7, 5)
    assert record["key"].tobytes() == b"abc" + bytes(29)
    assert record["check"] == zlib.crc32(data[:24] + data[32:])
    assert record["reserved"] == 0 and record["pad"] == 0


@settings(max_examples=200, deadline=None)
@given(
    key=keys,
    op=st.sampled_from([ADD, ADD_IDLE, CANCEL]),
    deadline_ms=st.integers(-(2**63), 2**63 - 1),
    seq=st.integers(0, 2**32 - 1),
    idle_ms=st.integers(1, 2**31 - 1),
    touch_index=st.integers(0, 99),
)
def test_keyed_commands_round_trip(key, op, deadline_ms, seq, idle_ms, touch_index):
    key_bytes, key_meta = encode_key(key)
    if op == ADD:
        data = commands.encode_add(key_bytes, key_meta, deadline_ms, seq)
        expected = (Op.ADD, key, deadline_ms, seq, 0, 0)
    elif op == ADD_IDLE:
        data = commands.encode_add_idle(key_bytes, key_meta, deadline_ms, idle_ms, touch_index, seq)
        expected = (Op.ADD_IDLE, key, deadline_ms, seq, idle_ms, touch_index)
    else:
        data = commands.encode_cancel(key_bytes, key_meta, seq)
        expected = (Op.CANCEL, key, 0, seq, 0, 0)
    command = decode_record(data, touch_capacity=100)
    assert command == expected
    assert type(command.key) is type(key)


def test_keyless_commands_round_trip():
    assert decode_record(commands.encode_ack(slot=12, generation=-3, seq=4)) == (Op.ACK, None, 0, 4, 12, -3)
    assert decode_record(commands.encode_flush(seq=77)) == (Op.FLUSH, None, 0, 77, 0, 0)


def _valid_batch():
    parts = [
        commands.encode_add(*encode_key("a"), 10, 1),
        commands.encode_add_idle(*encode_key(b"b"), 20, 30_000, 3, 2),
        commands.encode_cancel(*encode_key(7), 3),
        commands.encode_ack(5, 6),
        commands.encode_flush(4),
    ]
    return bytearray(b"".join(parts))


def _recheck(buffer, index):
    """Recompute the check word of record ``index`` so only the field under test is wrong."""
    start = index * RECORD_SIZE
    record = bytes(buffer[start : start + RECORD_SIZE])
    check = zlib.crc32(record[:24] + record[32:])
    buffer[start + commands.CHECK_OFFSET : start + commands.CHECK_OFFSET + 4] = check.to_bytes(4, "little")


def test_valid_batch_is_valid():
    assert validate_records(records_from_buffer(bytes(_valid_batch())), touch_capacity=4).all()


@pytest.mark.parametrize(
    "index, offset, value, fix_check",
    [
        (0, commands.OP_OFFSET, 0, True),  # unknown op
        (0, commands.OP_OFFSET, 6, True),
        (0, commands.KEY_META_OFFSET, 0, True),  # keyed op without a key
        (0, commands.KEY_META_OFFSET, 0xC1, True),  # key type 3
        (2, commands.KEY_META_OFFSET, 0x84, True),  # int key of 4 bytes
        (0, commands.KEY_META_OFFSET, 33 | 0x40, True),  # 33 bytes
        (0, commands.RESERVED_OFFSET, 1, True),
        (0, commands.PAD_OFFSET, 1, True),
        (0, commands.KEY_OFFSET + 5, 1, True),  # dirty padding after the key
        (0, commands.AUX0_OFFSET, 1, True),  # ADD uses no aux
        (2, commands.DEADLINE_OFFSET, 1, True),  # CANCEL has no deadline
        (1, commands.AUX0_OFFSET, bytes(4), True),  # idle_ms 0
        (1, commands.AUX1_OFFSET + 3, 0x80, True),  # negative touch index
        (1, commands.AUX1_OFFSET, 4, True),  # touch index == touch capacity
        (3, commands.KEY_META_OFFSET, 1, True),  # ACK with a key meta
        (3, commands.AUX0_OFFSET + 3, 0x80, True),  # negative slot
        (4, commands.KEY_OFFSET, 1, True),  # FLUSH with key bytes
        (4, commands.AUX1_OFFSET, 1, True),
        (0, commands.KEY_OFFSET, 0xFF, True),  # str key "\xff": not UTF-8
        (0, commands.SEQ_OFFSET, 9, False),  # a bad check word
        (3, commands.CHECK_OFFSET, 0, False),
    ],
)
def test_each_kind_of_garbage_is_flagged(index, offset, value, fix_check):
    buffer = _valid_batch()
    position = index * RECORD_SIZE + offset
    if isinstance(value, bytes):
        buffer[position : position + len(value)] = value
    else:
        buffer[position] = value
    if fix_check:
        _recheck(buffer, index)
    valid = validate_records(records_from_buffer(bytes(buffer)), touch_capacity=4)
    expected = [True] * 5
    expected[index] = False
    assert valid.tolist() == expected
    with pytest.raises(ProtocolError):
        decode_record(bytes(buffer[index * RECORD_SIZE : (index + 1) * RECORD_SIZE]), touch_capacity=4)


def test_non_ascii_str_keys_are_valid():
    data = commands.encode_add(*encode_key("clé-ü"), 1, 1)
    assert decode_record(data).key == "clé-ü"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=RECORD_SIZE * 8))
def test_random_bytes_into_the_batch_decoder(data):
    try:
        records = records_from_buffer(data)
    except ProtocolError:
        assert len(data) % RECORD_SIZE
        return
    valid = validate_records(records, touch_capacity=16)
    assert valid.dtype == bool and valid.shape == (len(data) // RECORD_SIZE,)
    for index in np.flatnonzero(valid):  # whatever passes decodes cleanly
        commands.command_at(records, int(index))
    for index in range(len(records)):
        chunk = data[index * RECORD_SIZE : (index + 1) * RECORD_SIZE]
        try:
            decode_record(chunk, touch_capacity=16)
        except ProtocolError:
            assert not valid[index]


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), count=st.integers(1, 600), flips=st.integers(0, 5))
def test_bit_flips_in_a_valid_batch_are_caught(seed, count, flips):
    rng = np.random.default_rng(seed)
    parts = [commands.encode_add(*encode_key(f"key-{i}"), int(rng.integers(0, 2**40)), i) for i in range(count)]
    buffer = bytearray(b"".join(parts))
    flipped = set()
    for _ in range(flips):
        position = int(rng.integers(0, len(buffer)))
        buffer[position] ^= 1 << int(rng.integers(0, 8))
        flipped.add(position // RECORD_SIZE)
    valid = validate_records(records_from_buffer(bytes(buffer)))
    untouched = np.ones(count, dtype=bool)
    untouched[list(flipped)] = False
    assert valid[untouched].all()
    # a record with exactly one flipped bit is always caught (crc32 detects every single-bit error)
    if flips == 1:
        assert not valid[~untouched].any()


@settings(max_examples=300, deadline=None)
@given(
    picks=st.lists(st.integers(0, 4), min_size=1, max_size=40),
    mutations=st.lists(st.tuples(st.integers(0, 40 * 64 - 1), st.integers(0, 255), st.booleans()), max_size=6),
    random_records=st.lists(st.binary(min_size=64, max_size=64), max_size=3),
    touch_capacity=st.one_of(st.none(), st.integers(0, 8)),
)
def test_small_and_large_batch_validators_agree(picks, mutations, random_records, touch_capacity):
    """The per-record path (small batches) and the numpy path (large ones) apply the same rules,
    and so does the daemon's check of a drained chunk (one C pass when compiled)."""
    valid_batch = bytes(_valid_batch())
    buffer = bytearray(b"".join(valid_batch[pick * RECORD_SIZE : (pick + 1) * RECORD_SIZE] for pick in picks))
    for position, value, fix_check in mutations:
        position %= len(buffer)
        buffer[position] = value
        if fix_check:  # so that the field rules, not just the crc, get exercised
            _recheck(buffer, position // RECORD_SIZE)
    records = records_from_buffer(bytes(buffer) + b"".join(random_records))
    small = commands._validate_each(records, touch_capacity)
    large = commands._validate_vectorised(records, touch_capacity)
    assert small.tolist() == large.tolist()
    assert valid_records(records, touch_capacity).tolist() == small.tolist()
    # the daemon's drain: how many records come before the first it refuses (compiled: a C pass)
    assert valid_prefix(records.tobytes(), touch_capacity) == (len(small) if small.all() else int(np.argmin(small)))


def test_the_daemons_check_refuses_non_record_arrays():
    with pytest.raises(ProtocolError):
        valid_records(np.zeros(4, dtype=np.uint8))
    assert valid_records(np.zeros(0, dtype=RECORD_DTYPE)).shape == (0,)


def test_the_daemons_check_reads_str_keys_as_python_decodes_them():
    """A str key must be UTF-8 as ``bytes.decode`` has it: surrogates and overlong forms are refused."""
    keys = ["ascii", "caf\u00e9", "\u65e5\u672c", "\U0001f600"]
    raw = [k.encode() for k in keys] + [b"\xed\xa0\x80", b"\xc0\xaf", b"\xff", b"ab\xe6\x97"]
    buffer = b"".join(commands.encode_command(commands.ADD, kb, key_meta_of(TYPE_STR, len(kb)), 5, 1) for kb in raw)
    records = records_from_buffer(buffer)
    assert valid_records(records).tolist() == [True] * 4 + [False] * 4
    assert valid_prefix(buffer) == 4
    for bad in range(4, 8):
        assert valid_prefix(buffer[: 4 * RECORD_SIZE] + buffer[bad * RECORD_SIZE :]) == 4
    assert commands._validate_each(records, None).tolist() == [True] * 4 + [False] * 4


@settings(max_examples=50, deadline=None)
@given(rows=st.lists(st.binary(min_size=56, max_size=56), min_size=0, max_size=400))
def test_vectorised_crc_matches_zlib(rows):
    checked = np.frombuffer(b"".join(rows), dtype=np.uint8).reshape(-1, 56)
    assert commands.crc32_rows(checked).tolist() == [zlib.crc32(row) for row in rows]


def test_vectorised_crc_matches_zlib_on_a_large_batch():
    checked = np.random.default_rng(1).integers(0, 256, size=(1000, 56), dtype=np.uint8)
    assert commands.crc32_rows(checked).tolist() == [zlib.crc32(row.tobytes()) for row in checked]


def test_validate_rejects_non_record_arrays():
    with pytest.raises(ProtocolError):
        validate_records(np.zeros(4, dtype=np.uint8))
    with pytest.raises(ProtocolError):
        decode_record(bytes(128))
    assert validate_records(np.zeros(0, dtype=RECORD_DTYPE)).shape == (0,)


def test_encoder_rejects_out_of_range_fields():
    with pytest.raises(InvalidRequest):
        encode_command(ADD, b"k", 1, seq=2**32)
    with pytest.raises(InvalidRequest):
        commands.encode_ack(slot=2**31, generation=0)
    with pytest.raises(InvalidKey):  # never truncated
        encode_command(ADD, bytes(33), 33)


# ---------------------------------------------------------------- socket messages

CLIENT_MESSAGES = [
    Hello(PROTOCOL_VERSION, "sessions", 4242, "worker-1"),
    Hello(PROTOCOL_VERSION, "g", 0, ""),
    Hello(PROTOCOL_VERSION, "g", 1, "x", resume_segment="/wheeld-c7", resume_token=2**63 - 1),
    Doorbell(),
    Bye(),
]
DAEMON_MESSAGES = [
    Welcome(PROTOCOL_VERSION, 7, "/wheeld-c7", 4096, 1024, "/wheeld-arena", 1, 3_600_000),
    Welcome(PROTOCOL_VERSION, 8, "/wheeld-c8", 2, 0, "", 10, 0, token=12345),
    Refused("protocol version 2 is not supported"),
    Expirations([]),
    Expirations(
        [
            Expiry.for_key("conn-1", 1000, 1001, 5, 10, 2),
            Expiry.for_key(b"\x00\xff", 2000, 2600, 6, 11, -1, late=True),
            Expiry.for_key(-(2**63), 3000, 3000, 2**32 - 1, 2**31 - 1, 0),
        ]
    ),
    Applied(2**32 - 1),
    Rejected.for_key(9, "conn-2", "no free record", Rejected.ARENA_FULL),
    Rejected.for_key(10, None, "flush rejected", "unknown_key"),
    Goodbye("shutting down"),
]


@pytest.mark.parametrize("message", CLIENT_MESSAGES, ids=repr)
def test_client_messages_round_trip(message):
    assert decode_client_message(encode_client_message(message)) == message
    with pytest.raises(ProtocolError):  # the other direction's decoder refuses it
        decode_daemon_message(encode_client_message(message))


@pytest.mark.parametrize("message", DAEMON_MESSAGES, ids=repr)
def test_daemon_messages_round_trip(message):
    assert decode_daemon_message(encode_daemon_message(message)) == message
    with pytest.raises(ProtocolError):
        decode_client_message(encode_daemon_message(message))


@settings(max_examples=200, deadline=None)
@given(key=keys)
def test_keys_keep_their_type_through_a_message(key):
    expiry = decode_daemon_message(encode_daemon_message(Expirations([Expiry.for_key(key, 1, 2, 3, 4, 5)]))).items[0]
    assert expiry.key == key and type(expiry.key) is type(key)
    rejected = decode_daemon_message(encode_daemon_message(Rejected.for_key(1, key, "r", "c")))
    assert rejected.key == key and type(rejected.key) is type(key)


def test_str_bytes_and_int_keys_are_distinct():
    decoded = [Expiry.for_key(key, 1, 2, 3, 4, 5).key for key in ("17", b"17", 17)]
    assert [type(key) for key in decoded] == [str, bytes, int]


def test_messages_are_frozen():
    with pytest.raises(AttributeError):
        Applied(1).seq = 2


def _encode_raw(tag, *fields):
    return msgspec.msgpack.encode([tag, *fields])


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"\xc1",  # never-used msgpack byte
        _encode_raw("applied", 2**32),  # seq beyond u32
        _encode_raw("applied", -1),
        _encode_raw("applied", "1"),
        _encode_raw("applied"),  # missing field
        _encode_raw("nope", 1),  # unknown tag
        _encode_raw("welcome", 1, 7, "/s", 12, 0, "/a", 1, 0),  # ring capacity not a power of two
        _encode_raw("welcome", 1, 7, "/s", 16, 0, "/a", 0, 0),  # tick_ms 0
        _encode_raw("expirations", [[b"ab", 0x41, 1, 2, 3, 4, 5, False]]),  # key_meta says 1 byte
        _encode_raw("expirations", [[b"\xff", 0x41, 1, 2, 3, 4, 5, False]]),  # str key not UTF-8
        _encode_raw("expirations", [[b"\x01\x02\x03\x04", 0x84, 1, 2, 3, 4, 5, False]]),  # 4-byte int key
        _encode_raw("expirations", [[b"", 0, 1, 2, 3, 4, 5, False]]),  # an expiry must have a key
        _encode_raw("expirations", [[b"k", 1, 1, 2, 3, -4, 5, False]]),  # negative slot
        _encode_raw("expirations", [[b"k", 1, 2**63, 2, 3, 4, 5, False]]),  # deadline beyond i64
        _encode_raw("rejected", 1, b"k", 0, "r", "c"),  # key bytes without a meta
        _encode_raw("goodbye", "x" * 5000),  # reason too long
    ],
)
def test_invalid_daemon_messages_are_protocol_errors(body):
    with pytest.raises(ProtocolError):
        decode_daemon_message(body)


@pytest.mark.parametrize(
    "body",
    [
        _encode_raw("hello", 1, "", 1, "x"),  # empty group
        _encode_raw("hello", 1, "g", -1, "x"),  # negative pid
        _encode_raw("hello", 1, "g" * 300, 1, "x"),
        msgspec.msgpack.encode({"tag": "bye"}),  # not array-like
    ],
)
def test_invalid_client_messages_are_protocol_errors(body):
    with pytest.raises(ProtocolError):
        decode_client_message(body)


def test_extra_trailing_fields_are_ignored():
    """msgspec's array_like default: a peer of this version may append fields (room for compatible additions)."""
    assert decode_client_message(_encode_raw("doorbell", True, 1)) == Doorbell(urgent=True)
    assert decode_client_message(_encode_raw("doorbell")) == Doorbell(urgent=False), "an older client's doorbell"
    assert decode_daemon_message(_encode_raw("applied", 5, "future")) == Applied(5)


def test_invalid_constructed_keys_are_the_callers_mistake():
    with pytest.raises(InvalidKey):
        Expiry(b"\xff", 0x41, 1, 2, 3, 4, 5, False)
    with pytest.raises(InvalidKey):
        Expiry.for_key("", 1, 2, 3, 4, 5)


def test_encoding_a_message_of_the_wrong_direction_is_the_callers_mistake():
    with pytest.raises(InvalidRequest):
        encode_client_message(Applied(1))
    with pytest.raises(InvalidRequest):
        encode_daemon_message(Hello(1, "g", 1, "x"))
    with pytest.raises(InvalidRequest):
        encode_daemon_frame(Bye())
    with pytest.raises(InvalidRequest):
        encode_client_frame("hello")


@settings(max_examples=500, deadline=None)
@given(body=st.binary(max_size=200))
def test_random_bytes_into_the_message_decoders(body):
    for decode in (decode_client_message, decode_daemon_message):
        try:
            decode(body)
        except ProtocolError:
            pass


@settings(max_examples=500, deadline=None)
@given(
    index=st.integers(0, len(CLIENT_MESSAGES) + len(DAEMON_MESSAGES) - 1),
    mutations=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=4),
    cut=st.integers(0, 10_000),
)
def test_mutated_valid_messages_into_the_decoders(index, mutations, cut):
    """Random bytes rarely look like msgpack; mutated real messages reach deeper into the decoders."""
    messages_ = CLIENT_MESSAGES + DAEMON_MESSAGES
    body = bytearray(messages._encoder.encode(messages_[index]))
    for position, value in mutations:
        body[position % len(body)] = value
    body = bytes(body[: max(1, cut % (len(body) + 1))])
    for decode in (decode_client_message, decode_daemon_message):
        try:
            message = decode(body)
        except ProtocolError:
            continue
        assert isinstance(message, (messages.ClientMessage.__args__ + messages.DaemonMessage.__args__))
        for item in getattr(message, "items", ()):  # a decoded key is usable
            assert type(item.key) in (str, bytes, int)
        if isinstance(message, Rejected):
            assert type(message.key) in (str, bytes, int, type(None))


# ---------------------------------------------------------------- framing


def test_frames_round_trip_through_the_reader():
    frames = [encode_client_frame(m) for m in CLIENT_MESSAGES]
    reader = framing.FrameReader()
    bodies = reader.feed(b"".join(frames))
    assert [decode_client_message(body) for body in bodies] == CLIENT_MESSAGES
    assert reader.at_boundary()


@settings(max_examples=200, deadline=None)
@given(
    bodies=st.lists(st.binary(max_size=300), max_size=10),
    cuts=st.lists(st.integers(0, 4000), max_size=12),
)
def test_reader_reassembles_any_split(bodies, cuts):
    stream = b"".join(framing.encode_frame(body) for body in bodies)
    points = sorted({cut % (len(stream) + 1) for cut in cuts} | {0, len(stream)})
    reader = framing.FrameReader()
    got = []
    for start, end in zip(points, points[1:], strict=False):
        got += reader.feed(stream[start:end])
    assert got == bodies
    assert reader.at_boundary() and reader.pending_bytes == 0


@settings(max_examples=300, deadline=None)
@given(chunks=st.lists(st.binary(max_size=64), max_size=8), max_frame=st.integers(0, 100))
def test_random_bytes_into_the_frame_reader(chunks, max_frame):
    reader = framing.FrameReader(max_frame=max_frame)
    try:
        for chunk in chunks:
            for body in reader.feed(chunk):
                assert isinstance(body, bytes) and len(body) <= max_frame
    except ProtocolError:
        with pytest.raises(ProtocolError):  # out of sync for good
            reader.feed(b"")


def test_oversized_frame_is_refused_before_its_body_arrives():
    reader = framing.FrameReader()
    with pytest.raises(ProtocolError):
        reader.feed((framing.MAX_FRAME + 1).to_bytes(4, "little"))
    assert framing.FrameReader().feed(framing.MAX_FRAME.to_bytes(4, "little")) == []
    with pytest.raises(InvalidRequest):
        framing.encode_frame(bytes(framing.MAX_FRAME + 1))


def test_empty_body_is_a_frame():
    assert framing.FrameReader().feed(b"\x00\x00\x00\x00") == [b""]
    with pytest.raises(ProtocolError):
        decode_client_message(b"")


def test_frame_helpers_agree_with_encode_frame():
    for message in DAEMON_MESSAGES:
        assert encode_daemon_frame(message) == framing.encode_frame(encode_daemon_message(message))


class _Item:
    """What the client reads of an expiration item: its key fields."""

    def __init__(self, key_bytes: bytes, key_meta: int):
        self.key_bytes, self.key_meta = key_bytes, key_meta


def _keys_or_error(fn, items):
    try:
        return [(type(k), k) for k in fn(items)]
    except ProtocolError as exc:
        return str(exc)


_VALID_KEYS = st.one_of(st.text(min_size=1, max_size=8), st.binary(min_size=1, max_size=32),
                        st.integers(min_value=-(1 << 63), max_value=(1 << 63) - 1))


@pytest.mark.skipif(not accel.compiled("wheeld.core"),
                    reason="the compiled client's key decoding (Python path: expiry_keys itself)")
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(items=st.lists(st.one_of(
    _VALID_KEYS.map(lambda key: encode_key(key)),  # keys the daemon sends
    st.tuples(st.binary(max_size=40), st.integers(min_value=0, max_value=255)),  # anything else
    st.tuples(st.sampled_from([b"\xed\xa0\x80", b"\xc0\xaf", b"\xff", b"ab\xe6\x97"]),
              st.just(None)).map(lambda kv: (kv[0], key_meta_of(TYPE_STR, len(kv[0])))),  # not UTF-8
), max_size=6))
def test_the_compiled_client_decodes_expiration_keys_as_expiry_keys(items):
    """The client's compiled ``_expiry_keys`` gives the keys ``messages.expiry_keys`` gives, or
    the same ProtocolError, for any frame."""
    from wheeld import core

    frame = [_Item(kb, meta) for kb, meta in items]
    assert _keys_or_error(core._expiry_keys, frame) == _keys_or_error(messages.expiry_keys, frame)
