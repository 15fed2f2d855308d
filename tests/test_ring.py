"""The client segment in one process: ring order, wrap-around, full ring, touch table, hostile segments."""

from __future__ import annotations

import collections
import fcntl
import os
import struct
import uuid

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from wheeld.protocol import commands, ring_layout
from wheeld.protocol.commands import ADD, ADD_IDLE, CANCEL, FLUSH, command_at, validate_records
from wheeld.protocol.errors import BrokenPeer, Closed, InvalidRequest, ProtocolError
from wheeld.protocol.keys import encode_key
from wheeld.shm.ring import ClientSegment


def segment_name() -> str:
    return f"/wheeld-test-{os.getpid()}-{uuid.uuid4().hex[:16]}"


def producer_of(consumer):
    """The client's side of a segment: what it maps from the descriptor the daemon passed."""
    return ClientSegment.attach(os.dup(consumer.fd), consumer.name)


@pytest.fixture
def make_segments():
    """Factory: (consumer, producer) over a fresh segment; everything closed afterwards."""
    created = []

    def make(ring_capacity=8, touch_capacity=4):
        consumer = ClientSegment.create(segment_name(), ring_capacity, touch_capacity)
        created.append(consumer)
        producer = producer_of(consumer)
        created.append(producer)
        return consumer, producer

    try:
        yield make
    finally:
        for segment in created:
            segment.close()


def add(producer, seq, key=None, deadline_ms=None):
    key_bytes, key_meta = encode_key(f"key-{seq}" if key is None else key)
    return producer.push_add(key_bytes, key_meta, seq * 10 if deadline_ms is None else deadline_ms, seq)


def seqs(records):
    return records["seq"].tolist()


def test_push_then_drain_returns_records_in_order(make_segments):
    consumer, producer = make_segments(ring_capacity=16)
    for seq in range(10):
        assert add(producer, seq)
    assert consumer.depth() == 10
    records = consumer.drain()
    assert seqs(records) == list(range(10))
    assert validate_records(records).all()
    assert [command_at(records, i).key for i in range(10)] == [f"key-{i}" for i in range(10)]
    assert records["deadline_ms"].tolist() == [seq * 10 for seq in range(10)]
    assert consumer.depth() == 0
    assert len(consumer.drain()) == 0


def test_try_push_carries_every_field(make_segments):
    consumer, producer = make_segments(ring_capacity=8, touch_capacity=16)
    key_bytes, key_meta = encode_key(b"\x00raw\xff")
    assert producer.try_push(ADD_IDLE, key_bytes, key_meta, deadline_ms=-5, seq=2**32 - 1, aux0=30_000, aux1=15)
    assert producer.try_push(CANCEL, *encode_key(-(2**63)), seq=7)
    assert producer.try_push(FLUSH, seq=8)
    records = consumer.drain()
    assert validate_records(records, touch_capacity=16).all()
    first, second, third = (command_at(records, i) for i in range(3))
    assert first == (commands.Op.ADD_IDLE, b"\x00raw\xff", -5, 2**32 - 1, 30_000, 15)
    assert second.key == -(2**63) and second.op == commands.Op.CANCEL and second.seq == 7
    assert third.op == commands.Op.FLUSH and third.key is None and third.seq == 8


def test_push_add_writes_the_same_bytes_as_the_encoder(make_segments):
    consumer, producer = make_segments()
    key_bytes, key_meta = encode_key("same")
    producer.push_add(key_bytes, key_meta, 123, 4)
    producer.try_push(ADD, key_bytes, key_meta, 123, 4)
    records = consumer.drain()
    expected = commands.encode_add(key_bytes, key_meta, 123, 4)
    assert records[0].tobytes() == expected == records[1].tobytes()


def test_full_ring_refuses_until_drained(make_segments):
    consumer, producer = make_segments(ring_capacity=4)
    assert [add(producer, seq) for seq in range(4)] == [True] * 4
    assert add(producer, 4) is False
    assert producer.try_push(FLUSH, seq=4) is False
    assert producer.free_slots() == 0
    assert seqs(consumer.drain(max_records=1)) == [0]
    assert producer.free_slots() == 1
    assert add(producer, 4)
    assert add(producer, 5) is False
    assert seqs(consumer.drain()) == [1, 2, 3, 4]


def test_wrap_around_keeps_order_across_many_laps(make_segments):
    consumer, producer = make_segments(ring_capacity=8)
    next_seq = 0
    received = []
    for lap in range(50):
        for _ in range(lap % 7 + 1):  # 1..7 records, so the slots shift every lap
            assert add(producer, next_seq)
            next_seq += 1
        batch = consumer.drain(max_records=6)  # leaves at most one behind: the ring never fills
        received += seqs(batch)
        assert validate_records(batch).all()
    received += seqs(consumer.drain())
    assert received == list(range(next_seq))


def test_drain_across_the_wrap_point_is_one_contiguous_batch(make_segments):
    consumer, producer = make_segments(ring_capacity=8)
    for seq in range(6):
        add(producer, seq)
    assert seqs(consumer.drain()) == list(range(6))
    for seq in range(6, 14):  # slots 6, 7, 0, 1, ..., 5
        assert add(producer, seq)
    batch = consumer.drain()
    assert seqs(batch) == list(range(6, 14))
    assert validate_records(batch).all()


def test_drain_with_zero_or_negative_max_returns_nothing(make_segments):
    consumer, producer = make_segments()
    add(producer, 1)
    assert len(consumer.drain(max_records=0)) == 0
    assert len(consumer.drain(max_records=-3)) == 0
    assert consumer.depth() == 1


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(st.tuples(st.booleans(), st.integers(0, 20)), max_size=60))
def test_ring_matches_a_fifo_model(steps):
    consumer = ClientSegment.create(segment_name(), 16, 0)
    producer = producer_of(consumer)
    try:
        model = collections.deque()
        next_seq = 0
        for is_push, amount in steps:
            if is_push:
                for _ in range(amount):
                    pushed = add(producer, next_seq)
                    assert pushed == (len(model) < 16)
                    if pushed:
                        model.append(next_seq)
                    next_seq += 1
            else:
                got = seqs(consumer.drain(max_records=amount))
                assert got == [model.popleft() for _ in range(min(amount, len(got)))]
                assert len(got) == min(amount, len(got) + len(model))
            assert consumer.depth() == len(model) == producer.depth()
    finally:
        producer.close()
        consumer.close()


def test_drained_records_are_copies(make_segments):
    consumer, producer = make_segments(ring_capacity=4)
    add(producer, 1, key="first")
    records = consumer.drain()
    for seq in range(2, 6):  # overwrite the slot the first record lived in
        add(producer, seq)
    assert command_at(records, 0).key == "first"
    consumer.close()
    assert command_at(records, 0).seq == 1


# ---------------------------------------------------------------- touch table


def test_touch_is_visible_to_the_daemon(make_segments):
    consumer, producer = make_segments(touch_capacity=8)
    assert consumer.read_touch(3) == 0
    producer.touch(3, 1_000_123)
    producer.touch(7, -1)
    producer.set_idle(3, 30_000)
    assert consumer.read_touch(3) == 1_000_123
    assert consumer.read_touch(7) == -1
    assert consumer.read_activity(3, 1_000_200) == (1_000_123, 30_000)  # what the daemon reads of an idle timer


@pytest.mark.parametrize("index", [-1, 8, 1 << 40])
def test_touch_index_out_of_range(make_segments, index):
    consumer, producer = make_segments(touch_capacity=8)
    with pytest.raises(InvalidRequest):
        producer.touch(index, 5)
    with pytest.raises(InvalidRequest):
        producer.set_idle(index, 5)
    with pytest.raises(ProtocolError):  # an index from a client record is untrusted input to the daemon
        consumer.read_touch(index)
    with pytest.raises(ProtocolError):
        consumer.read_activity(index, 10)


@pytest.mark.parametrize(
    "touched, idle_ms, expected",
    [
        (0, 30_000, None),  # never touched: no activity to go by
        (990, 0, None),
        (990, 30_000, (990, 30_000)),
        (1001, 30_000, (1001, 30_000)),  # a touch stores the clock rounded up
        (1002, 30_000, ProtocolError),  # from the future
        (-5, 30_000, ProtocolError),
        (2**62 + 5, 2**62, ProtocolError),  # the values that once overflowed the daemon's deadline
        (990, -1, ProtocolError),
        (990, 2**31, ProtocolError),  # longer than an idle timer can be
    ],
)
def test_activity_read_by_the_daemon_is_range_checked(make_segments, touched, idle_ms, expected):
    consumer, producer = make_segments(touch_capacity=4)
    producer._last_touch[2] = touched  # what a hostile client can store
    producer._idle[2] = idle_ms
    if expected is ProtocolError:
        with pytest.raises(ProtocolError):
            consumer.read_activity(2, 1000)
    else:
        assert consumer.read_activity(2, 1000) == expected


def test_a_touch_stored_after_the_callers_clock_read_is_checked_against_a_later_one(make_segments):
    """The daemon read its clock (1000.9 ms: 1000), then the client touched (1001.2 ms,
    stored rounded up: 1002), then the daemon read the word: the touch is legitimate, and
    ``clock``, read after the word, says so. Without a clock to ask it is refused."""
    consumer, producer = make_segments(touch_capacity=4)
    producer._last_touch[2] = 1002
    producer._idle[2] = 30_000
    assert consumer.read_activity(2, 1000, clock=lambda: 1001) == (1002, 30_000)
    with pytest.raises(ProtocolError):
        consumer.read_activity(2, 1000)
    with pytest.raises(ProtocolError):  # still the future when the clock is read again
        consumer.read_activity(2, 1000, clock=lambda: 1000)


def test_touch_table_does_not_overlap_the_ring(make_segments):
    consumer, producer = make_segments(ring_capacity=4, touch_capacity=4)
    for index in range(4):
        producer.touch(index, -1)
        producer.set_idle(index, -1)
    for seq in range(4):
        add(producer, seq)
    batch = consumer.drain()
    assert validate_records(batch).all() and seqs(batch) == [0, 1, 2, 3]
    assert [consumer.read_touch(i) for i in range(4)] == [-1] * 4


def test_segment_without_touch_table(make_segments):
    consumer, producer = make_segments(touch_capacity=0)
    with pytest.raises(InvalidRequest):
        producer.touch(0, 1)
    assert add(producer, 1)
    assert seqs(consumer.drain()) == [1]


# ---------------------------------------------------------------- lifecycle


def test_segment_is_a_sealed_memfd_that_nobody_can_resize(make_segments):
    consumer, producer = make_segments()
    assert not any(entry.endswith(consumer.name) for entry in os.listdir("/dev/shm"))
    seals = fcntl.fcntl(producer.fd, fcntl.F_GET_SEALS)
    assert seals & (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL) == (
        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    size = os.fstat(producer.fd).st_size
    for new_size in (0, 64, size + 4096):
        with pytest.raises(PermissionError):
            os.ftruncate(producer.fd, new_size)  # what a client would do to SIGBUS the daemon
    assert os.fstat(consumer.fd).st_size == size
    add(producer, 1)
    assert seqs(consumer.drain()) == [1]


@pytest.mark.parametrize("ring_capacity", [0, 1, 3, 12, ring_layout.MAX_RING_CAPACITY * 2])
def test_create_rejects_bad_capacities(ring_capacity):
    with pytest.raises(InvalidRequest):
        ClientSegment.create(segment_name(), ring_capacity, 4)


def test_attach_records_the_producer_pid(make_segments):
    consumer, producer = make_segments()
    assert consumer.producer_pid == os.getpid() == producer.producer_pid
    assert producer.ring_capacity == consumer.ring_capacity and producer.touch_capacity == consumer.touch_capacity


def _raw_memfd(size, seal=True):
    fd = os.memfd_create("raw", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda fd: None,  # all zeros: no magic
        lambda fd: os.pwrite(fd, struct.pack("<QIIII", ring_layout.MAGIC, 99, 8, 4, 64), 0),  # other version
        lambda fd: os.pwrite(fd, struct.pack("<QIIII", ring_layout.MAGIC, 2, 12, 4, 64), 0),  # not a power of two
        # larger than the file
        lambda fd: os.pwrite(fd, struct.pack("<QIIII", ring_layout.MAGIC, 2, 1 << 20, 4, 64), 0),
        lambda fd: os.pwrite(fd, struct.pack("<QIIII", ring_layout.MAGIC, 2, 8, 4, 32), 0),  # other record size
        lambda fd: os.pwrite(fd, struct.pack("<QIIII", ring_layout.MAGIC, 2, 4, 4, 64), 0),  # smaller than the file
    ],
)
def test_attach_and_adopt_reject_segments_that_are_not_rings(corrupt):
    for open_segment in (ClientSegment.attach, ClientSegment.adopt):
        fd = _raw_memfd(ring_layout.segment_size(8, 4))
        corrupt(fd)
        with pytest.raises(ProtocolError):
            open_segment(fd, "corrupt")
        with pytest.raises(OSError):
            os.fstat(fd)  # the descriptor was consumed either way


def test_attach_rejects_a_tiny_segment():
    with pytest.raises(ProtocolError):
        ClientSegment.attach(_raw_memfd(16), "tiny")


def test_adopt_refuses_a_ring_that_could_be_resized_or_not_written(make_segments):
    consumer, producer = make_segments()
    size = os.fstat(consumer.fd).st_size
    image = os.pread(consumer.fd, size, 0)
    unsealed = _raw_memfd(size, seal=False)
    os.pwrite(unsealed, image, 0)
    with pytest.raises(ProtocolError, match="sealed"):
        ClientSegment.adopt(unsealed, "unsealed")
    write_sealed = _raw_memfd(size)
    os.pwrite(write_sealed, image, 0)
    fcntl.fcntl(write_sealed, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
    with pytest.raises(ProtocolError):
        ClientSegment.adopt(write_sealed, "write-sealed")
    readonly = os.open(f"/proc/self/fd/{consumer.fd}", os.O_RDONLY)
    with pytest.raises(ProtocolError):
        ClientSegment.adopt(readonly, "read-only")
    with pytest.raises(ProtocolError, match="outside"):  # larger than this daemon's rings
        ClientSegment.adopt(os.dup(consumer.fd), "big", max_ring_capacity=4, max_touch_capacity=4)
    path = f"/dev/shm/{segment_name().lstrip('/')}"
    shm_file = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(shm_file, size)
        os.pwrite(shm_file, image, 0)
        with pytest.raises(ProtocolError, match="sealed"):  # a plain shm file can be truncated
            ClientSegment.adopt(shm_file, "shm-file")
    finally:
        os.unlink(path)


def test_adopt_failing_half_built_raises_its_own_error_and_closes_the_fd(make_segments, monkeypatch):
    """An error while the instance is being built (its views already export the map)
    is the error the caller sees, not a BufferError from closing the map under them,
    and the handed fd is closed."""
    consumer, producer = make_segments()
    fd = os.dup(producer.fd)

    def no_memory(*args, **kwargs):
        raise MemoryError("simulated")

    monkeypatch.setattr(np, "frombuffer", no_memory)
    with pytest.raises(MemoryError, match="simulated"):
        ClientSegment.adopt(fd, producer.name)
    monkeypatch.undo()
    with pytest.raises(OSError):
        os.fstat(fd)


def test_closed_session_is_reported_to_a_producer_with_a_full_ring(make_segments):
    consumer, producer = make_segments(ring_capacity=2)
    assert not producer.closed
    add(producer, 0)
    consumer.mark_closed()
    assert producer.closed
    add(producer, 1)  # still room: the cached head says so, no shared read needed
    with pytest.raises(BrokenPeer):
        add(producer, 2)


def test_use_after_close_raises_closed(make_segments):
    consumer, producer = make_segments()
    producer.close()
    producer.close()  # idempotent
    with pytest.raises(Closed):
        add(producer, 1)
    with pytest.raises(Closed):
        producer.try_push(FLUSH, seq=1)
    with pytest.raises(Closed):
        producer.touch(0, 1)
    consumer.close()
    with pytest.raises(Closed):
        consumer.drain()
    with pytest.raises(Closed):
        consumer.depth()


@pytest.mark.parametrize(
    "fields",
    [
        dict(seq=2**32),
        dict(seq=-1),
        dict(deadline_ms=2**63),
        dict(aux0=2**31),
        dict(key_meta=256),
        dict(key_bytes="not bytes"),
    ],
)
def test_out_of_range_fields_are_the_callers_mistake(make_segments, fields):
    consumer, producer = make_segments()
    arguments = dict(op=ADD, key_bytes=b"k", key_meta=1, deadline_ms=1, seq=1, aux0=0, aux1=0) | fields
    with pytest.raises(InvalidRequest):
        producer.try_push(**arguments)
    if "aux0" not in fields:
        with pytest.raises(InvalidRequest):
            producer.push_add(arguments["key_bytes"], arguments["key_meta"], arguments["deadline_ms"], arguments["seq"])
    assert consumer.depth() == 0  # nothing was published


# ---------------------------------------------------------------- hostile client


def _write_word(producer, word, value):
    producer._words[word] = value  # what a hostile client can do with its own mapping


@pytest.mark.parametrize("tail_minus_head", [-1, 9, 2**40, -(2**40)])
def test_impossible_tail_is_a_protocol_error_not_a_crash(make_segments, tail_minus_head):
    consumer, producer = make_segments(ring_capacity=8)
    for seq in range(3):
        add(producer, seq)
    assert seqs(consumer.drain()) == [0, 1, 2]
    _write_word(producer, ring_layout.TAIL_WORD, (3 + tail_minus_head) % 2**64)
    with pytest.raises(ProtocolError):
        consumer.drain()
    with pytest.raises(ProtocolError):
        consumer.depth()


@settings(max_examples=40, deadline=None)
@given(head=st.integers(0, 2**64 - 1), tail=st.integers(0, 2**64 - 1), garbage=st.binary(min_size=64, max_size=64))
def test_random_counters_and_records_never_crash_the_consumer(head, tail, garbage):
    consumer = ClientSegment.create(segment_name(), 8, 4)
    producer = producer_of(consumer)
    try:
        _write_word(producer, ring_layout.HEAD_WORD, head)
        _write_word(producer, ring_layout.TAIL_WORD, tail)
        producer._mm[ring_layout.RING_OFFSET : ring_layout.RING_OFFSET + 64] = garbage
        try:
            records = consumer.drain()
        except ProtocolError:
            assert not 0 <= tail <= 8  # the consumer's own head is 0 whatever the client wrote
        else:
            assert 0 <= tail <= 8 and len(records) == tail
            valid = validate_records(records, touch_capacity=4)
            assert valid.dtype == bool and valid.shape == (tail,)
            assert not valid[1:].any()  # zero records are not commands
    finally:
        producer.close()
        consumer.close()


def test_client_overwriting_head_cannot_move_the_consumer(make_segments):
    consumer, producer = make_segments(ring_capacity=8)
    for seq in range(4):
        add(producer, seq)
    _write_word(producer, ring_layout.HEAD_WORD, 3)  # pretend three were consumed
    assert seqs(consumer.drain()) == [0, 1, 2, 3]
    assert consumer._words[ring_layout.HEAD_WORD] == 4


def test_scribbled_records_are_flagged_invalid(make_segments):
    consumer, producer = make_segments(ring_capacity=8)
    for seq in range(4):
        add(producer, seq)
    slot_2 = ring_layout.RING_OFFSET + 2 * commands.RECORD_SIZE + commands.DEADLINE_OFFSET
    producer._mm[slot_2] ^= 0x01  # one bit of the deadline of seq 2
    records = consumer.drain()
    assert validate_records(records).tolist() == [True, True, False, True]
    assert np.array_equal(records["seq"], [0, 1, 2, 3])


# ---------------------------------------------------------------- peek / commit / reopen


def test_peek_without_commit_returns_the_same_records_again(make_segments):
    consumer, producer = make_segments(ring_capacity=4)
    for seq in range(3):
        add(producer, seq)
    assert seqs(consumer.peek()) == [0, 1, 2]
    assert seqs(consumer.peek(max_records=2)) == [0, 1]
    consumer.commit(1)
    assert seqs(consumer.peek()) == [1, 2]
    assert add(producer, 3) and add(producer, 4)
    assert add(producer, 5) is False  # slots 1, 2 are still not handed back
    consumer.commit(2)
    assert seqs(consumer.drain()) == [3, 4]


def test_peek_bytes_is_peek_as_bytes_across_the_wrap(make_segments):
    """``peek_bytes`` (the daemon's drain) copies what ``peek`` copies, also when the records
    wrap around the end of the ring, and a commit after it hands back the same slots."""
    consumer, producer = make_segments(ring_capacity=4)
    assert consumer.peek_bytes() == b""
    for seq in range(3):
        add(producer, seq)
    consumer.commit(len(consumer.peek_bytes(max_records=2)) // commands.RECORD_SIZE)
    for seq in range(3, 6):
        add(producer, seq)  # slots 3, 0, 1: the ring wraps
    for limit in (None, 0, 1, 2, 3, 4, 9):
        raw = consumer.peek_bytes(limit)
        assert raw == consumer.peek(limit).tobytes()
        assert seqs(commands.records_from_buffer(raw)) == [2, 3, 4, 5][: 4 if limit is None else limit]
    consumer.peek_bytes(3)
    with pytest.raises(InvalidRequest):
        consumer.commit(4)
    consumer.commit(3)
    assert seqs(consumer.drain()) == [5]


def test_commit_more_than_peeked_is_the_callers_mistake(make_segments):
    consumer, producer = make_segments()
    add(producer, 0)
    with pytest.raises(InvalidRequest):
        consumer.commit(1)  # nothing peeked
    consumer.peek()
    with pytest.raises(InvalidRequest):
        consumer.commit(2)
    consumer.commit(1)
    with pytest.raises(InvalidRequest):
        consumer.commit(1)  # the peek was used up
    assert consumer.depth() == 0


def test_adopt_resumes_after_the_last_committed_record(make_segments):
    consumer, producer = make_segments(ring_capacity=8)
    for seq in range(5):
        add(producer, seq)
    consumer.peek(max_records=4)
    consumer.commit(2)  # the daemon applied two, then died
    consumer.close()
    assert [commands.decode_record(r).seq for r in producer.unapplied_records()] == [2, 3, 4]
    restarted = ClientSegment.adopt(os.dup(producer.fd), producer.name)  # the client hands it back
    try:
        assert restarted.is_consumer and restarted.depth() == 3
        assert seqs(restarted.drain()) == [2, 3, 4]
    finally:
        restarted.close()


def test_a_rewound_ring_keeps_the_records_to_replay_from_the_producer(make_segments):
    """A daemon with a rebuilt arena rewinds a ring handed back to the client's last
    acknowledged flush: it publishes that head, and the producer, limited to it while its
    Hello offers the replay, never overwrites a record still to be applied again (else the
    daemon finds tail - head beyond the capacity and drops the client as a violator)."""
    consumer, producer = make_segments(ring_capacity=8)
    for seq in range(6):
        add(producer, seq)
    consumer.drain()  # the lost daemon applied all six and published head 6
    consumer.close()
    assert producer.free_slots() == 8
    producer.limit_head(2)  # hello_frame: replay from 2, the last acknowledged flush
    assert [add(producer, seq) for seq in range(6, 11)] == [True, True, True, True, False]
    adopted = ClientSegment.adopt(os.dup(producer.fd), producer.name, rewind_to=2)
    try:
        assert producer._words[ring_layout.HEAD_WORD] == 2, "the rewound head is published"
        producer.limit_head(None)  # the Welcome came
        assert producer.free_slots() == 0 and not add(producer, 11)
        assert seqs(adopted.peek()) == list(range(2, 10))
        adopted.commit(3)
        assert [add(producer, seq) for seq in range(11, 15)] == [True, True, True, False]
        assert seqs(adopted.drain()) == [5, 6, 7, 8, 9, 11, 12, 13]
    finally:
        adopted.close()


def test_lifting_the_head_limit_counts_from_the_head_word_again(make_segments):
    consumer, producer = make_segments(ring_capacity=4)
    for seq in range(4):
        add(producer, seq)
    consumer.drain()
    producer.limit_head(1)  # a replay offered, and the attempt failed before any daemon adopted the ring
    assert producer.free_slots() == 1
    producer.limit_head(None)
    assert producer.free_slots() == 4
    assert all(add(producer, seq) for seq in range(4, 8))


def test_adopt_refuses_impossible_counters(make_segments):
    consumer, producer = make_segments(ring_capacity=8)
    _write_word(producer, ring_layout.HEAD_WORD, 100)  # head ahead of tail
    with pytest.raises(ProtocolError):
        ClientSegment.adopt(os.dup(producer.fd), producer.name)
    assert producer.unapplied_records() == []  # nothing trustworthy to send again


def test_records_pushed_again_into_a_new_ring_keep_their_bytes(make_segments):
    old_consumer, old_producer = make_segments(ring_capacity=8)
    for seq in range(3):
        add(old_producer, seq)
    old_producer.try_push(FLUSH, seq=9)
    new_consumer, new_producer = make_segments(ring_capacity=4)
    for record in old_producer.unapplied_records():
        assert new_producer.try_push_record(record)
    assert new_producer.try_push_record(old_producer.unapplied_records()[0]) is False  # full
    records = new_consumer.drain()
    assert validate_records(records).all() and seqs(records) == [0, 1, 2, 9]
    with pytest.raises(InvalidRequest):
        new_producer.try_push_record(b"short")


_fields = st.tuples(
    st.binary(max_size=commands.KEY_FIELD_SIZE),
    st.integers(0, 255),  # key meta
    st.integers(-(1 << 63), (1 << 63) - 1),  # deadline
    st.integers(0, (1 << 32) - 1),  # seq
    st.integers(-(1 << 31), (1 << 31) - 1),  # aux0
    st.integers(-(1 << 31), (1 << 31) - 1),  # aux1
)


@settings(max_examples=300, deadline=None)
@given(op=st.integers(0, 255), fields=_fields, start=st.integers(0, 40))
def test_a_pushed_record_is_the_encoded_one_on_either_path(op, fields, start):
    """Compiled, a push writes the record with the typed writer (ring.py's _write_record);
    as Python, with struct and zlib: the same 64 bytes, check word included."""
    key_bytes, key_meta, deadline, seq, aux0, aux1 = fields
    with ClientSegment.create(segment_name(), 8, 4) as consumer, producer_of(consumer) as producer:
        _push_and_compare(consumer, producer, op, key_bytes, key_meta, deadline, seq, aux0, aux1, start)


def _push_and_compare(consumer, producer, op, key_bytes, key_meta, deadline, seq, aux0, aux1, start):
    for i in range(start % 8):  # start anywhere in the ring
        assert producer.try_push(FLUSH, seq=i)
    consumer.drain()
    assert producer.try_push(op, key_bytes, key_meta, deadline, seq, aux0, aux1)
    assert producer.push_add(key_bytes, key_meta, deadline, seq)
    records = consumer.drain()
    assert records[0].tobytes() == commands.encode_command(op, key_bytes, key_meta, deadline, seq, aux0, aux1)
    assert records[1].tobytes() == commands.encode_command(ADD, key_bytes, key_meta, deadline, seq)
    store = getattr(producer, "_store_record", None)
    if store is not None:  # the Python path: the typed writer itself, run as Python
        assert store(3, op, key_meta, seq, deadline, aux0, aux1, key_bytes)
        assert producer._ring_view.tobytes()[3 * 64 : 4 * 64] == records[0].tobytes()


@pytest.mark.parametrize("field, value", [("seq", 1 << 32), ("seq", -1), ("deadline_ms", 1 << 63),
                                          ("deadline_ms", 1 << 200), ("aux0", 1 << 31), ("aux1", -(1 << 31) - 1),
                                          ("key_meta", 256), ("op", -1), ("seq", 1.0), ("seq", True)])
def test_a_field_out_of_its_width_is_invalid_on_either_path(make_segments, field, value):
    consumer, producer = make_segments()
    args = {"op": ADD, "key_bytes": b"k", "key_meta": 1, "deadline_ms": 5, "seq": 1, "aux0": 0, "aux1": 0}
    args[field] = value
    if field == "seq" and value is True:
        assert producer.try_push(**args)  # struct takes a bool as an int: so does the ring
        assert consumer.drain()[0].tobytes() == commands.encode_command(ADD, b"k", 1, 5, 1)
        return
    with pytest.raises(InvalidRequest):
        producer.try_push(**args)
    if field not in ("op", "aux0", "aux1"):
        add_args = {k: args[k] for k in ("key_bytes", "key_meta", "deadline_ms", "seq")}
        with pytest.raises(InvalidRequest):
            producer.push_add(**add_args)
    assert producer.depth() == 0
