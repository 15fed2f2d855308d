"""A daemon whose journal cannot be written keeps serving, says so, and resumes by itself.

The journal lives on a small tmpfs mounted for the test (root only: skipped otherwise)
and a ballast file fills it. With ``--fsync always`` the daemon must then:

* keep running and keep firing timers (an honest client is served throughout; its
  periodic flushes may fail with ``JournalUnavailable``, and nothing else);
* answer a ``flush()`` at once with ``JournalUnavailable`` (not a timeout), since the
  commands before it are in the arena but not on disk;
* say so: the ``journal_stalled`` counter (the errno), ``journal_stalls_total``, an ERROR
  line in its log, ``STATUS=`` to systemd;
* start again on the full disk after a SIGKILL (it used to exit at its first write);
* once the ballast is removed, write a snapshot of its arena and acknowledge flushes
  again: everything a flush acknowledged, before or after the stall, is in the journal,
  and the journal has no partial line.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

import wheeld
from daemon_harness import unlink_segments, wait_until
from hostile_harness import Honest
from wheeld.journal.files import Journal, PendingTimer, list_segments, list_snapshots
from wheeld.journal.recovery import check_journal, recover
from wheeld.protocol.journal import Add, Cancel

pytestmark = pytest.mark.timeout(180)

T0 = 1_700_000_000_000


@contextlib.contextmanager
def small_tmpfs(where: Path, size: str):
    """A tmpfs of ``size`` mounted on ``where`` for the test, unmounted after it."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem for the journal needs root")
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755",
                           f"wheeld-test-{uuid.uuid4().hex[:8]}",
                           str(where)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield where
    finally:
        unmount(where)


def unmount(where: Path) -> None:
    """Unmount what the test mounted; lazily if something still holds it (it goes once released)."""
    for _ in range(20):
        if subprocess.run(["umount", str(where)], capture_output=True).returncode == 0:
            return
        time.sleep(0.1)
    subprocess.run(["umount", "-l", str(where)], check=False)


def fill(directory: Path) -> Path:
    """A ballast file that takes every free byte of the filesystem of ``directory``."""
    ballast = directory / "ballast"
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for chunk in (1 << 16, 1 << 12, 1):
            try:
                while True:
                    os.write(fd, b"\0" * chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
    finally:
        os.close(fd)
    return ballast


class Notifications:
    """Our end of the daemon's NOTIFY_SOCKET: every STATUS= it sent."""

    def __init__(self, path: Path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setblocking(False)
        self.path = str(path)
        self.statuses: list[str] = []

    def read(self) -> list[str]:
        while True:
            try:
                data = self.sock.recv(4096)
            except BlockingIOError:
                return self.statuses
            for line in data.decode().split("\n"):
                if line.startswith("STATUS="):
                    self.statuses.append(line[len("STATUS="):])

    def close(self) -> None:
        self.sock.close()


def _wheelctl(daemon, *args) -> str:
    from click.testing import CliRunner

    from wheeld.ctl import main

    return CliRunner().invoke(main, ["--socket", daemon.socket_path, "--name", daemon.name, *args],
                              catch_exceptions=False).stdout


@pytest.mark.parametrize("fsync", ["always", "interval=10"])
def test_a_full_journal_disk_refuses_flushes_keeps_serving_and_resumes(daemon_factory, tmp_path, fsync):
    with small_tmpfs(tmp_path / "small", "8m") as mount:
        journal = mount / "journal"
        notify = Notifications(tmp_path / "notify.sock")
        d = daemon_factory(extra=["--journal", str(journal), "--fsync", fsync])
        d.start(env={"NOTIFY_SOCKET": notify.path})
        honest = Honest(tmp_path, d.socket_path, rate=50, delay_ms=(1, 200), tolerate=("JournalUnavailable",))
        try:
            with wheeld.connect(d.socket_path, group="main", reconnect_timeout_s=60) as w:
                for i in range(200):
                    w.add(f"a{i}", 600_000)
                w.flush()  # durable before the disk fills
                ballast = fill(mount)
                for i in range(200):
                    w.add(f"b{i}", 600_000)
                started = time.monotonic()
                with pytest.raises(wheeld.JournalUnavailable, match="No space left on device"):
                    w.flush(timeout_s=15)
                assert time.monotonic() - started < 10, "the flush was answered, not timed out"
                counters = wait_until(lambda: (c := d.counters())["journal_flushes_refused_total"] and c, 10,
                                      "the refused flush counted")
                assert counters["journal_stalled"] == errno.ENOSPC and counters["journal_stalls_total"] == 1
                stats = _wheelctl(d, "stats", "--interval", "0")
                assert "journal  NOT WRITABLE: No space left on device (ENOSPC)" in stats, stats
                assert "\nwheeld_journal_writable 0\n" in _wheelctl(d, "stats", "--prometheus", "--interval", "0")
                assert d.proc.poll() is None, d.log()[-2000:]
                assert "cannot be written" in d.log() and "ERROR" in d.log()
                wait_until(lambda: any("JOURNAL NOT WRITABLE" in s for s in notify.read()), 10,
                           "STATUS= saying the journal is not writable")
                # it goes on serving: timers fire, other clients are served
                w.add("short", 50)
                got = wait_until(lambda: [e for e in w.poll(0.1) if e.key == "short"], 10, "a timer added meanwhile")
                assert got[0].fired_ms >= got[0].deadline_ms
                honest.wait_served(20)
                # a restart on the full disk starts (and stays stalled)
                d.kill()
                d.start(env={"NOTIFY_SOCKET": notify.path})
                wait_until(lambda: d.counters()["journal_stalled"] == errno.ENOSPC, 10, "a restart that stays stalled")
                with pytest.raises(wheeld.JournalUnavailable):
                    w.flush(timeout_s=15)
                honest.wait_served(20)
                # space comes back: it resumes by itself
                ballast.unlink()
                wait_until(lambda: d.counters()["journal_stalled"] == 0, 20, "the journal to be writable again",
                           detail=lambda: d.log()[-2000:])
                assert "writable again" in d.log()
                wait_until(lambda: notify.read() and "NOT WRITABLE" not in notify.read()[-1], 10,
                           "STATUS= without the stall")
                w.flush(timeout_s=15)  # acknowledged: the a and b timers are durable
                assert "\nwheeld_journal_writable 1\n" in _wheelctl(d, "stats", "--prometheus", "--interval", "0")
            honest.finish()
            assert d.proc.poll() is None
            report = check_journal(journal)
            assert report.ok and report.torn == [], report.to_dict()  # no partial line anywhere
            d.kill()
            state = recover(journal, repair=False)
            main = {key for group, key in state.pending if group == "main"}
            assert {f"a{i}" for i in range(200)} | {f"b{i}" for i in range(200)} <= main
            assert state.damage == [] and state.torn == []
            unlink_segments(d.name)  # a reboot: the arena comes back from the journal
            d.start()
            assert d.counters()["pending"] >= 400
        finally:
            if honest.proc.poll() is None:
                honest.kill()
            d.cleanup()
            notify.close()


# --------------------------------------------------------------------------- #
# The writer alone
# --------------------------------------------------------------------------- #


class Disk:
    """``os.write``/``os.fsync`` on the journal's segment fds failing with ``error`` while ``full``."""

    def __init__(self, monkeypatch, journal_dir: Path):
        self.full = False
        self.error = errno.ENOSPC
        self.dir = str(journal_dir)
        real_write, real_fsync = os.write, os.fsync

        def segment(fd) -> bool:
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                return False
            return target.startswith(self.dir) and "/journal-" in target

        def write(fd, data):
            if self.full and segment(fd):
                if len(data) > 20:  # a short write, as a filesystem with a few bytes left makes
                    return real_write(fd, bytes(data[:20]))
                raise OSError(self.error, os.strerror(self.error))
            return real_write(fd, data)

        def fsync(fd):
            if self.full and segment(fd):
                raise OSError(self.error, os.strerror(self.error))
            return real_fsync(fd)

        monkeypatch.setattr(os, "write", write)
        monkeypatch.setattr(os, "fsync", fsync)


def adds(*keys):
    return [Add(t=T0, g="g", k=key, d=T0 + 60_000, s=1) for key in keys]


@pytest.mark.parametrize("policy", ["always", "interval=5", "off"])
def test_a_failed_write_stalls_the_journal_and_resume_covers_it_with_a_snapshot(tmp_path, monkeypatch, policy):
    disk = Disk(monkeypatch, tmp_path)
    journal = Journal(tmp_path, fsync=policy)
    journal.append(adds("a"), now_ms=0)
    journal.sync()
    size = journal.segment_path.stat().st_size
    disk.full = True
    with pytest.raises(wheeld.JournalUnavailable, match="No space left on device"):
        journal.append(adds("b", "c"), now_ms=1)
    assert journal.segment_path.stat().st_size == size, "the partial batch was cut back"
    assert not journal.writable and journal.last_lsn == 3 and journal.durable_lsn == 1
    with pytest.raises(wheeld.JournalUnavailable):
        journal.append(adds("d"), now_ms=2)  # numbered, not written
    assert journal.last_lsn == 4 and journal.unwritten_events == 3 and journal.stalls == 1
    state = [PendingTimer("g", key, T0 + 60_000, 1) for key in "abcd"]
    assert journal.resume(lambda: (state, [])) is False  # still full
    disk.full = False
    assert journal.resume(lambda: (state, [])) is True
    assert journal.writable and journal.durable_lsn == 4
    assert [lsn for lsn, _ in list_snapshots(tmp_path)] == [4]
    assert journal.append(adds("e"), now_ms=3) == 5
    journal.close()
    assert [first for first, _ in list_segments(tmp_path)] == [1, 5]
    recovered = recover(tmp_path)
    assert set(recovered.pending) == {("g", key) for key in "abcde"}
    assert recovered.damage == [] and recovered.torn == [] and check_journal(tmp_path).ok


@pytest.mark.parametrize("error", [errno.EIO, errno.EROFS, errno.EDQUOT])
def test_a_failed_fsync_stalls_the_journal_whatever_the_error(tmp_path, monkeypatch, error):
    disk = Disk(monkeypatch, tmp_path)
    disk.error = error
    journal = Journal(tmp_path, fsync="always")
    journal.append(adds("a"))
    disk.full = True
    with pytest.raises(wheeld.JournalUnavailable) as raised:
        journal.append(adds("b"))
    assert raised.value.__cause__.errno == error and journal.stalled.errno == error
    assert journal.durable_lsn == 1
    disk.full = False
    assert journal.resume(lambda: ([PendingTimer("g", key, T0, 1) for key in "ab"], []))
    journal.close()
    assert set(recover(tmp_path).pending) == {("g", "a"), ("g", "b")} and check_journal(tmp_path).ok


def test_a_background_fsync_that_fails_stalls_the_interval_journal(tmp_path, monkeypatch):
    disk = Disk(monkeypatch, tmp_path)
    journal = Journal(tmp_path, fsync="interval=1")
    journal.append(adds("a"), now_ms=0)
    disk.full = True
    disk.error = errno.EIO
    assert journal.start_sync(5) is True
    with pytest.raises(wheeld.JournalUnavailable, match="Input/output error"):
        journal.poll_sync(wait=True)
    assert not journal.writable and journal.durable_lsn == 0
    disk.full = False
    assert journal.resume(lambda: ([PendingTimer("g", "a", T0, 1)], []))
    assert journal.durable_lsn == 1
    journal.close()
    assert set(recover(tmp_path).pending) == {("g", "a")}


def test_a_journal_that_cannot_open_its_segment_starts_stalled_only_when_asked(tmp_path, monkeypatch):
    disk = Disk(monkeypatch, tmp_path)
    disk.full = True
    with pytest.raises(wheeld.JournalUnavailable, match="cannot be written"):
        Journal(tmp_path, fsync="always")
    assert list_segments(tmp_path) == []  # no header cut short left behind
    journal = Journal(tmp_path, fsync="always", stall_on_error=True)
    assert not journal.writable and journal.stalled.errno == errno.ENOSPC
    disk.error = errno.EROFS  # not something that passes: a read-only directory is refused
    with pytest.raises(wheeld.JournalUnavailable, match="Read-only"):
        Journal(tmp_path, fsync="always", stall_on_error=True)
    disk.full = False
    assert journal.resume(lambda: ([], []))
    journal.close()


def test_the_resume_snapshot_is_not_encoded_without_room_for_it(tmp_path, monkeypatch):
    disk = Disk(monkeypatch, tmp_path)
    journal = Journal(tmp_path, fsync="always")
    disk.full = True
    with pytest.raises(wheeld.JournalUnavailable):
        journal.append(adds("a"))
    disk.full = False
    asked = []
    assert journal.resume(lambda: asked.append(1) or ([], []), min_free=1 << 62) is False
    assert asked == [] and not journal.writable
    assert journal.resume(lambda: asked.append(1) or ([], [])) is True and asked == [1]
    journal.close()


# --------------------------------------------------------------------------- #
# A journal directory that cannot be written at start
# --------------------------------------------------------------------------- #


@contextlib.contextmanager
def read_only_view(source: Path, where: Path):
    """``source`` bind-mounted read-only on ``where`` (root only: skipped otherwise)."""
    if os.geteuid() != 0:
        pytest.skip("a read-only mount for the journal needs root (root writes through a chmod 0500)")
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "--bind", str(source), str(where)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {done.stderr.strip()}")
    try:
        remount = subprocess.run(["mount", "-o", "remount,bind,ro", str(where)], capture_output=True, text=True)
        if remount.returncode != 0:
            pytest.skip(f"cannot remount read-only here: {remount.stderr.strip()}")
        yield where
    finally:
        unmount(where)


@pytest.mark.parametrize("existing", [True, False], ids=["existing-directory", "directory-to-create"])
def test_a_read_only_journal_directory_at_start_is_one_line_and_exit_2(tmp_path, existing):
    source = tmp_path / "source"
    (source / "journal").mkdir(parents=True)
    with read_only_view(source, tmp_path / "ro") as ro:
        journal = ro / ("journal" if existing else "new")
        name = f"test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        command = [sys.executable, "-m", "wheeld.daemon.cli", "--socket", str(tmp_path / f"{name}.sock"), "--name",
                   name, "--capacity", "1000", "--journal", str(journal), "--fsync", "always"]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=60)
        finally:
            unlink_segments(name)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"wheeld: journal directory {journal} cannot be") and "Read-only file system" in last, last


def test_a_partial_line_the_stall_could_not_cut_is_cut_before_anything_else(tmp_path, monkeypatch):
    disk = Disk(monkeypatch, tmp_path)
    journal = Journal(tmp_path, fsync="always")
    journal.append(adds("a"))
    first = journal.segment_path
    size = first.stat().st_size
    real_ftruncate = os.ftruncate

    def failing_ftruncate(fd, length):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    disk.full = True
    monkeypatch.setattr(os, "ftruncate", failing_ftruncate)
    with pytest.raises(wheeld.JournalUnavailable):
        journal.append(adds("b"))
    assert first.stat().st_size > size  # a partial line is left: the cut failed too
    monkeypatch.setattr(os, "ftruncate", real_ftruncate)
    disk.full = False
    assert journal.resume(lambda: ([PendingTimer("g", key, T0, 1) for key in "ab"], []))
    assert first.stat().st_size == size, "cut back to its last whole line before the snapshot"
    journal.append(adds("c"))
    journal.close()
    report = check_journal(tmp_path)
    assert report.ok and report.torn == []
    assert set(recover(tmp_path).pending) == {("g", "a"), ("g", "b"), ("g", "c")}


class FlakyDisk:
    """Every write, fsync, fdatasync, ftruncate and pwrite on a file of the journal directory
    fails with probability ``p`` (a random errno of ENOSPC, EIO, EDQUOT, EROFS; a write may
    first write a part), from a seeded generator."""

    ERRORS = (errno.ENOSPC, errno.EIO, errno.EDQUOT, errno.EROFS)

    def __init__(self, monkeypatch, directory: Path, seed: int, p: float):
        import random
        import threading

        self.rng = random.Random(seed)
        self.lock = threading.Lock()  # the journal's helper thread calls in too
        self.p = p
        self.dir = str(directory)
        self.failures = 0
        real = {name: getattr(os, name) for name in ("write", "fsync", "fdatasync", "ftruncate", "pwrite")}

        def ours(fd) -> bool:
            try:
                return os.readlink(f"/proc/self/fd/{fd}").startswith(self.dir)
            except OSError:
                return False

        def roll() -> int | None:
            with self.lock:
                if self.p and self.rng.random() < self.p:
                    self.failures += 1
                    return self.rng.choice(self.ERRORS)
            return None

        def wrap(name):
            call = real[name]

            def failing(fd, *args):
                error = roll() if ours(fd) else None
                if error is None:
                    return call(fd, *args)
                if name == "write" and len(args[0]) > 1 and self.rng.random() < 0.5:
                    return call(fd, bytes(args[0][: len(args[0]) // 2]))  # a short write; the rest fails next
                raise OSError(error, os.strerror(error))

            return failing

        for name in real:
            monkeypatch.setattr(os, name, wrap(name))


@pytest.mark.parametrize("seed", range(12))
def test_write_errors_anywhere_never_lose_or_corrupt_what_the_owner_holds(tmp_path, monkeypatch, seed):
    """Random write/fsync/truncate errors at any step (appends, rotations, snapshots, the
    mark, resumes): whenever an append succeeds the journal recovers to exactly what the
    owner holds, and once the disk heals it resumes with nothing lost and nothing torn."""
    import random

    rng = random.Random(seed)
    disk = FlakyDisk(monkeypatch, tmp_path, seed, p=0.0)
    journal = Journal(tmp_path, fsync="always", segment_bytes=1500)
    disk.p = 0.08
    held: dict[str, int] = {}  # the owner's state (the arena): key -> seq

    def state():
        return [PendingTimer("g", key, T0 + 60_000, seq) for key, seq in held.items()], []

    checked = 0
    for step in range(300):
        key = f"k{rng.randrange(40)}"
        if key in held and rng.random() < 0.3:
            del held[key]
            events = [Cancel(t=T0, g="g", k=key, s=step, hit=True, pd=T0 + 60_000)]
        else:
            held[key] = step
            events = [Add(t=T0, g="g", k=key, d=T0 + 60_000, s=step)]
        try:
            journal.append(events)
            written = True
        except wheeld.JournalUnavailable:
            written = False
        if not journal.writable and step % 7 == 0:
            journal.resume(state)
        elif journal.writable and step % 40 == 39:
            try:
                journal.write_snapshot(journal.last_lsn, *state())
            except (wheeld.JournalUnavailable, OSError):
                pass
        if written and journal.writable:
            disk.p, saved = 0.0, disk.p  # reading needs no luck
            recovered = recover(tmp_path, repair=False, quiet=True)
            report = check_journal(tmp_path)  # every file, also those recovery does not read
            disk.p = saved
            assert recovered.damage == [] and report.ok and report.torn == [], report.to_dict()
            assert {key: timer.seq for (_g, key), timer in recovered.pending.items()} == held, step
            checked += 1
    disk.p = 0.0
    assert journal.resume(state)
    journal.close()
    assert disk.failures > 10 and checked > 20
    report = check_journal(tmp_path)
    assert report.ok and report.torn == [], report.to_dict()
    assert {key: timer.seq for (_g, key), timer in recover(tmp_path).pending.items()} == held


def _collect(client, keys: set, timeout_s: float) -> set:
    got: set = set()
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and not keys <= got:
        got.update(e.key for e in client.poll(0.1))
    return got


def test_what_a_failed_flush_left_undurable_is_applied_again_after_a_power_cut(daemon_factory, tmp_path):
    """A flush that failed with JournalUnavailable does not move the client's replay position:
    if the host loses power during the stall, the daemon that rebuilds its arena from the
    journal applies those commands again from the ring the client hands back."""
    with small_tmpfs(tmp_path / "small", "4m") as mount:
        journal = mount / "journal"
        d = daemon_factory(extra=["--journal", str(journal), "--fsync", "always"]).start()
        try:
            with wheeld.connect(d.socket_path, group="g", reconnect_timeout_s=60) as w:
                w.add("before", 1_500)
                w.flush()
                ballast = fill(mount)
                keys = {f"k{i}" for i in range(200)}  # more than the room left in the last page
                for key in sorted(keys):
                    w.add(key, 1_500)
                with pytest.raises(wheeld.JournalUnavailable):
                    w.flush(timeout_s=15)
                d.kill()
                unlink_segments(d.name)  # the power cut, during the stall: the journal never had them
                ballast.unlink()
                d.start()
                w.flush(timeout_s=15)
                got = _collect(w, keys | {"before"}, 20)
            assert keys | {"before"} <= got
        finally:
            d.cleanup()


def _bodies(frames: bytes) -> list:
    from wheeld.protocol import framing
    from wheeld.protocol.messages import decode_daemon_body

    out, offset = [], 0
    while offset < len(frames):
        (length,) = framing.HEADER.unpack_from(frames, offset)
        out.append(decode_daemon_body(frames[offset + framing.HEADER_SIZE : offset + framing.HEADER_SIZE + length]))
        offset += framing.HEADER_SIZE + length
    return out


def test_a_flush_that_is_not_durable_is_answered_with_a_rejection_then_applied():
    from wheeld.daemon.executor import flush_answer
    from wheeld.protocol import messages as M

    assert _bodies(flush_answer(7, None)) == [M.Applied(7)]
    rejected, applied = _bodies(flush_answer(7, "journal /j cannot be written: No space left on device (ENOSPC)"))
    assert applied == M.Applied(7)
    assert rejected.seq == 7 and rejected.key is None and rejected.code == M.Rejected.JOURNAL_UNAVAILABLE
    assert "No space left on device" in rejected.reason and M.Rejected.JOURNAL_UNAVAILABLE in M.REJECT_CODES
    long = _bodies(flush_answer(7, "x" * 10_000))[0]  # a reason is at most 4096 characters
    assert len(long.reason) == 4096
