"""The simulated disk keeps its promises: what is synced survives a power cut, what is
not may be lost (a prefix, maybe torn), a failed fsync never makes its bytes durable."""

from __future__ import annotations

import errno
import os
import random

import pytest

from sim.disk import SimDisk


def _disk(seed=1, capacity=None) -> SimDisk:
    disk = SimDisk(random.Random(seed), capacity=capacity)
    disk.makedirs("/j")
    return disk


def _append(disk: SimDisk, path: str, data: bytes) -> int:
    fd = disk.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
    assert disk.write(fd, data) == len(data)
    return fd


def test_synced_bytes_and_a_synced_directory_survive_every_power_cut():
    for seed in range(200):
        disk = _disk(seed)
        fd = _append(disk, "/j/a", b"durable;")
        disk.fsync(fd)
        dfd = disk.open("/j", os.O_RDONLY | os.O_DIRECTORY)
        disk.fsync(dfd)
        disk.write(fd, b"maybe")
        disk.power_cut()
        data = disk.read_file("/j/a")
        assert data.startswith(b"durable;")
        assert len(data) <= len(b"durable;maybe")


def test_unsynced_bytes_are_lost_as_a_prefix_sometimes_torn():
    kept, torn = set(), 0
    for seed in range(300):
        disk = _disk(seed)
        fd = _append(disk, "/j/a", b"x" * 10)
        disk.fsync(fd)
        disk.fsync(disk.open("/j", os.O_RDONLY | os.O_DIRECTORY))
        disk.write(fd, b"y" * 100)
        disk.power_cut()
        data = disk.read_file("/j/a")
        kept.add(len(data))
        assert data[:10] == b"x" * 10
        if data[10:] != b"y" * (len(data) - 10):
            torn += 1
    assert 10 in kept and 110 in kept and len(kept) > 20
    assert torn > 10


def test_a_file_created_without_a_directory_fsync_may_vanish():
    outcomes = set()
    for seed in range(100):
        disk = _disk(seed)
        fd = _append(disk, "/j/new", b"data")
        disk.fsync(fd)  # the data, not the directory entry
        disk.power_cut()
        outcomes.add(disk.exists("/j/new"))
    assert outcomes == {True, False}


def test_a_failed_fsync_drops_the_dirty_bytes_for_good():
    disk = _disk()
    fd = _append(disk, "/j/a", b"first;")
    disk.fsync(fd)
    disk.fsync(disk.open("/j", os.O_RDONLY | os.O_DIRECTORY))
    disk.write(fd, b"lost;")
    disk.fail_next("fsync", errno.EIO)
    with pytest.raises(OSError) as raised:
        disk.fsync(fd)
    assert raised.value.errno == errno.EIO
    assert disk.read_file("/j/a") == b"first;lost;"  # still readable until the power goes
    disk.fsync(fd)  # succeeds, but the lost pages are not written
    disk.power_cut()
    assert disk.read_file("/j/a") == b"first;"


def test_a_full_disk_writes_what_fits_then_refuses_and_takes_room_back_after_unlink():
    disk = _disk(capacity=20)
    fd = disk.open("/j/a", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    assert disk.write(fd, b"a" * 15) == 15
    assert disk.write(fd, b"b" * 10) == 5
    with pytest.raises(OSError) as raised:
        disk.write(fd, b"c")
    assert raised.value.errno == errno.ENOSPC
    disk.ftruncate(fd, 15)
    disk.close(fd)
    other = disk.open("/j/b", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    assert disk.write(other, b"d" * 5) == 5
    disk.unlink("/j/a")
    assert disk.write(other, b"e" * 10) == 10


def test_one_seed_gives_one_history():
    def run(seed):
        disk = _disk(seed)
        _append(disk, "/j/a", b"z" * 50)
        disk.power_cut()
        return disk.exists("/j/a") and disk.read_file("/j/a")

    assert [run(s) for s in range(50)] == [run(s) for s in range(50)]


def test_a_sync_reports_each_append_it_made_durable_never_those_a_failed_fsync_dropped():
    """``on_durable`` (the checker's proof that a stalled journal wrote again,
    ``History._wrote_again``): each append a successful fsync made durable, by its number,
    once. Not the appends a failed fsync (EIO) dropped, nor those appended behind them in
    that file (a later fsync succeeds and makes neither durable), nor one a truncation cut
    off, nor what a power cut happens to keep."""
    disk = _disk()
    made: list[int] = []
    disk.on_durable = lambda path, numbers: made.extend(numbers)
    fd = _append(disk, "/j/a", b"first;")  # append 0
    disk.fsync(fd)
    assert made == [0]
    disk.write(fd, b"lost;")  # 1
    disk.fail_next("fsync", errno.EIO)
    with pytest.raises(OSError):
        disk.fsync(fd)
    disk.write(fd, b"behind;")  # 2: after the failure, behind the bytes it dropped
    disk.fsync(fd)
    assert made == [0]
    other = _append(disk, "/j/b", b"snapshot;")  # 3
    disk.write(other, b"cut")  # 4
    disk.ftruncate(other, len(b"snapshot;"))
    disk.fsync(other)
    disk.fsync(other)
    assert made == [0, 3]
    disk.write(other, b"unsynced")  # 5
    disk.power_cut()
    assert made == [0, 3]
