"""The ring between two processes: ordering, no loss, no duplicates, and producers killed mid-stream.

The producer is this file run as a script (``python test_ring_multiprocess.py
produce NAME COUNT``), so the test needs no helper module and the child is a
fresh interpreter. Every record's fields are a function of its seq, so the
parent can check each one it drains; the crc in the record catches a torn write.

A producer killed with SIGKILL at a random moment must leave the consumer an
intact prefix 0..n-1: the record it was writing was never published.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest
from wheeld.protocol.commands import ADD, ADD_IDLE, command_at, validate_records
from wheeld.protocol.keys import encode_key
from wheeld.shm.ring import ClientSegment

RING_CAPACITY = 1024
TOUCH_CAPACITY = 64
DRAIN_BATCH = 512


def expected_key(seq: int):
    return f"k{seq}" if seq % 2 == 0 else seq


def produce(fd: int, count: int) -> None:
    """Push ``count`` records (forever if negative) into the ring behind descriptor ``fd``
    (inherited, as a client receives it from the daemon), spinning while the ring is full."""
    producer = ClientSegment.attach(fd, "producer")
    seq = 0
    while count < 0 or seq < count:
        key_bytes, key_meta = encode_key(expected_key(seq))
        while True:
            if seq % 5 == 4:
                pushed = producer.try_push(
                    ADD_IDLE, key_bytes, key_meta, seq * 7 + 1, seq % 2**32, seq % 1000 + 1, seq % TOUCH_CAPACITY
                )
            else:
                pushed = producer.push_add(key_bytes, key_meta, seq * 7 + 1, seq % 2**32)
            if pushed:
                break
            os.sched_yield()
        producer.touch(seq % TOUCH_CAPACITY, seq)
        seq += 1
    producer.close()


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "produce":
    produce(int(sys.argv[2]), int(sys.argv[3]))
    sys.exit(0)

def segment_name() -> str:
    return f"/wheeld-test-{os.getpid()}-{uuid.uuid4().hex[:16]}"


@contextlib.contextmanager
def segment_with_producers():
    """A consumer segment plus a way to start producers; all are killed and unlinked afterwards."""
    consumer = ClientSegment.create(segment_name(), RING_CAPACITY, TOUCH_CAPACITY)
    children: list[subprocess.Popen] = []

    def start_producer(count: int) -> subprocess.Popen:
        child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "produce", str(consumer.fd), str(count)],
                                 pass_fds=[consumer.fd])
        children.append(child)
        return child

    try:
        yield consumer, start_producer
    finally:
        for child in children:
            if child.poll() is None:
                os.kill(child.pid, signal.SIGKILL)
            child.wait(timeout=10)
        consumer.close()


def check_batch(records: np.ndarray, first_seq: int) -> None:
    """Every record is valid and is exactly what the producer wrote for its seq, in order."""
    seq = np.arange(first_seq, first_seq + len(records), dtype=np.int64)
    assert validate_records(records, touch_capacity=TOUCH_CAPACITY).all()
    assert np.array_equal(records["seq"], seq % 2**32)
    assert np.array_equal(records["deadline_ms"], seq * 7 + 1)
    idle = seq % 5 == 4
    assert np.array_equal(records["op"], np.where(idle, ADD_IDLE, ADD))
    assert np.array_equal(records["aux0"], np.where(idle, seq % 1000 + 1, 0))
    assert np.array_equal(records["aux1"], np.where(idle, seq % TOUCH_CAPACITY, 0))
    for index in range(0, len(records), 7):
        assert command_at(records, index).key == expected_key(first_seq + index)


def drain_until(consumer, child, received: int, target: int | None, timeout_s: float) -> int:
    """Drain and check batches until ``target`` records arrived (None: until the child exits and the ring is empty)."""
    deadline = time.monotonic() + timeout_s
    while target is None or received < target:
        batch = consumer.drain(DRAIN_BATCH)
        if len(batch):
            check_batch(batch, received)
            received += len(batch)
            continue
        if child.poll() is not None and consumer.depth() == 0:
            if target is None:
                return received
            raise AssertionError(f"producer exited with {child.returncode} after {received} records")
        assert time.monotonic() < deadline, f"stalled after {received} records"
        time.sleep(0.0005)  # poll interval: the ring is empty for now
    return received


def test_200k_records_arrive_in_order_without_loss_or_duplicates():
    count = 200_000
    with segment_with_producers() as (consumer, start_producer):
        child = start_producer(count)
        received = drain_until(consumer, child, 0, count, timeout_s=120)
        assert child.wait(timeout=30) == 0
        assert received == count
        assert consumer.depth() == 0 and len(consumer.drain()) == 0
        assert consumer.producer_pid == child.pid
        assert consumer.read_touch((count - 1) % TOUCH_CAPACITY) == count - 1


@pytest.mark.parametrize("kills", [3, pytest.param(25, marks=pytest.mark.slow)])
def test_producer_killed_mid_stream_leaves_an_intact_prefix(kills):
    rng = np.random.default_rng()
    for _ in range(kills):
        kill_after = int(rng.integers(1, 20_000))
        with segment_with_producers() as (consumer, start_producer):
            child = start_producer(-1)
            received = drain_until(consumer, child, 0, kill_after, timeout_s=60)
            os.kill(child.pid, signal.SIGKILL)  # the ring has free slots: the child is most likely mid-push
            assert child.wait(timeout=10) == -signal.SIGKILL
            received = drain_until(consumer, child, received, None, timeout_s=10)
            assert received >= kill_after
            # nothing more ever appears: a half-written record beyond the tail stays invisible
            assert consumer.depth() == 0 and len(consumer.drain()) == 0
