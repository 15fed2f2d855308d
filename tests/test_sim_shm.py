"""The simulated shared memory answers as the real one: one script of port calls run
against :class:`wheeld.shm.named.RealShm` in ``/dev/shm`` and against
:class:`sim.shm.SimShm` gives the same transcript; and what only the simulation
has (crashes, reboots, owners, faults) does what the daemon's start-up assumes."""

from __future__ import annotations

import errno
import os
import random
import stat

import pytest

from daemon_harness import unique_name
from sim.shm import SimCrashed, SimShm
from wheeld.shm.instance_lock import Holder
from wheeld.protocol.naming import SHM_DIR
from wheeld.shm.named import RealShm


def _script(shm, base: str, pid: int) -> list:
    """Port calls and what they answered (errors as their errno), as a comparable list."""
    out: list = []

    def attempt(label, call):
        try:
            result = call()
        except OSError as exc:
            out.append((label, "error", exc.errno))
            return None
        out.append((label, "ok"))
        return result

    a, b, c = f"{base}-a", f"{base}-b", f"{base}-c"
    name_a, name_b = "/" + os.path.basename(a), "/" + os.path.basename(b)
    out.append(("stat missing", shm.stat(a)))
    attempt("open missing", lambda: shm.open(a, True))
    h1 = shm.create(a, 0o640)
    attempt("create taken", lambda: shm.create(a, 0o600))
    out.append(("mode exact", stat.S_IMODE(shm.fstat(h1).st_mode), stat.S_ISREG(shm.fstat(h1).st_mode)))
    shm.ftruncate(h1, 8192)
    out.append(("size", shm.fstat(h1).st_size, shm.stat(a).st_size))
    shm.pwrite(h1, b"hello", 10)
    out.append(("pread", shm.pread(h1, 8, 8), shm.pread(h1, 8, 8190), shm.pread(h1, 8, 9000)))
    h2 = shm.open(a, True)
    out.append(("one file", (shm.fstat(h1).st_dev, shm.fstat(h1).st_ino) == (shm.fstat(h2).st_dev,
                                                                             shm.fstat(h2).st_ino)))
    out.append(("locks", shm.lock(h1), shm.lock(h2), shm.lock(h1)))
    out.append(("no marks yet", shm.read_marks(h2)))
    shm.mark(h1, 4242, 77)
    out.append(("marks", shm.read_marks(h2), shm.read_marks(h1), shm.wait_marks(h2)))
    seg = shm.map(h1, name_a)
    out.append(("mapped", seg.size, seg.name))
    shm.close(h1)
    out.append(("the mapping keeps the lock", shm.lock(h2), shm.read_marks(h2)))
    seg.buf[0:3] = b"abc"
    out.append(("shared memory", shm.pread(h2, 3, 0)))
    shm.pwrite(h2, b"xyz", 3)
    out.append(("both ways", bytes(seg.buf[0:6])))
    identity = shm.stat(a).st_ino
    seg.rename(name_b)
    out.append(("renamed", shm.stat(a), shm.stat(b).st_ino == identity, seg.name))
    seg.close()
    out.append(("unmapped: the lock is free", shm.lock(h2)))
    shm.close(h2)
    h3, h4 = shm.open(b, True), shm.open(b, False)
    out.append(("flock", shm.flock(h3), shm.flock(h4), shm.flock_holder_pid(b) == pid))
    out.append(("flock holder", shm.flock_holder(b) == Holder(pid, os.geteuid())))
    shm.close(h3)
    out.append(("flock after close", shm.flock(h4), shm.flock_holder_pid(b) == pid))
    h5 = shm.create(c, 0o600)
    shm.pwrite(h5, b"other", 0)
    shm.rename(c, b)  # replaces b
    out.append(("replaced", shm.stat(c), shm.stat(b).st_size, shm.pread(h4, 5, 0), shm.pread(h5, 5, 0)))
    shm.ftruncate(h5, 2)
    out.append(("shrunk", shm.pread(h5, 5, 0), shm.fstat(h5).st_size))
    shm.close(h4)
    shm.close(h5)
    shm.unlink(b)
    attempt("unlink missing", lambda: shm.unlink(b))
    attempt("rename missing", lambda: shm.rename(b, c))
    attempt("close twice", lambda: shm.close(h5))
    empty = shm.create(a, 0o600)
    out.append(("map empty raised", type(_raised(lambda: shm.map(empty, name_a))).__name__))
    shm.close(empty)
    shm.chmod(a, 0o604)
    out.append(("chmod", stat.S_IMODE(shm.stat(a).st_mode)))
    shm.unlink(a)
    return out


def _raised(call):
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the type is what is compared
        return exc
    return None


def test_the_simulated_port_answers_every_call_as_the_real_one():
    base = os.path.join(SHM_DIR, unique_name("simshm-diff"))
    real = RealShm()
    try:
        got_real = _script(real, base, os.getpid())
    finally:
        for suffix in ("-a", "-b", "-c"):
            try:
                os.unlink(base + suffix)
            except FileNotFoundError:
                pass
    machine = SimShm()
    got_sim = _script(machine.port(os.getpid(), os.geteuid()), base, os.getpid())
    assert got_sim == got_real
    assert machine.names() == []


def test_a_symlink_or_directory_is_refused_as_the_real_one_refuses_it():
    base = os.path.join(SHM_DIR, unique_name("simshm-odd"))
    link, directory = base + "-link", base + "-dir"
    real, machine = RealShm(), SimShm()
    sim = machine.port(os.getpid(), os.geteuid())
    os.symlink("/etc/hostname", link)
    os.mkdir(directory, 0o700)
    machine.plant(link, kind="symlink", uid=os.geteuid())
    machine.plant(directory, kind="dir", uid=os.geteuid(), mode=0o700)
    answers = {}
    try:
        for side, shm in (("real", real), ("sim", sim)):
            row = []
            for path in (link, directory):
                st = shm.stat(path)
                row.append((stat.S_ISLNK(st.st_mode), stat.S_ISDIR(st.st_mode)))
                for write in (True, False):
                    try:
                        shm.close(shm.open(path, write))
                        row.append("opened")
                    except OSError as exc:
                        row.append(exc.errno)
            answers[side] = row
    finally:
        os.unlink(link)
        os.rmdir(directory)
    assert answers["sim"] == answers["real"]
    assert errno.ELOOP in answers["real"] and errno.EISDIR in answers["real"]


# ---------------------------------------------------------------------------- what only the simulation has
def test_a_crash_releases_the_locks_and_keeps_the_segments_a_reboot_drops_them():
    machine = SimShm()
    first, second = machine.port(10, 1000), machine.port(11, 1000)
    h = first.create("/dev/shm/x", 0o600)
    first.ftruncate(h, 4096)
    assert first.lock(h) and first.flock(h)
    first.mark(h, 10, 1000)
    seg = first.map(h, "/x")
    first.close(h)
    seg.buf[100:104] = b"kept"
    h2 = second.open("/dev/shm/x", True)
    assert not second.lock(h2) and not second.flock(h2) and second.read_marks(h2) == Holder(10, 1000)
    machine.crash(first)
    assert second.lock(h2) and second.flock(h2) and second.read_marks(h2) is None
    assert second.pread(h2, 4, 100) == b"kept"  # the memory outlives its process
    with pytest.raises(SimCrashed):
        first.stat("/dev/shm/x")  # a dead process makes no more calls
    machine.reboot()
    assert machine.names() == []
    with pytest.raises(SimCrashed):
        second.stat("/dev/shm/x")
    third = machine.port(12, 1000)
    assert third.stat("/dev/shm/x") is None


def test_a_crash_point_stops_the_process_at_that_call():
    machine = SimShm()
    port = machine.port(10, 1000)
    machine.crash_after(port, 2)
    h = port.create("/dev/shm/y", 0o600)
    assert port.lock(h)
    with pytest.raises(SimCrashed):
        port.ftruncate(h, 4096)  # the third call: not made
    assert machine.read("/dev/shm/y") == b"" and machine.holder("/dev/shm/y") is None


def test_owners_modes_and_the_sticky_directory():
    machine = SimShm()
    alice, bob = machine.port(10, 1000), machine.port(11, 2000, gids=(3000,))
    h = alice.create("/dev/shm/a", 0o640)
    alice.close(h)
    with pytest.raises(PermissionError):
        bob.open("/dev/shm/a", False)  # not his, not his group's
    alice.chown("/dev/shm/a", -1, 1000)
    machine.set_owner("/dev/shm/a", mode=0o644)
    bob.close(bob.open("/dev/shm/a", False))
    with pytest.raises(PermissionError):
        bob.open("/dev/shm/a", True)
    with pytest.raises(PermissionError) as refused:
        bob.rename("/dev/shm/a", "/dev/shm/b")  # sticky: only the owner moves it
    assert refused.value.errno == errno.EPERM
    with pytest.raises(PermissionError):
        bob.unlink("/dev/shm/a")
    assert bob.stat("/dev/shm/a").st_uid == 1000
    machine.set_owner("/dev/shm/a", mode=0o646)  # writable by others: anyone may open it for writing
    bob.close(bob.open("/dev/shm/a", True))
    root = machine.port(1, 0)
    root.rename("/dev/shm/a", "/dev/shm/b")
    assert machine.names() == ["/dev/shm/b"]


def test_faults_on_demand():
    machine = SimShm(random.Random(5))
    port = machine.port(10, 1000)
    machine.fail_next("create", errno.ENOSPC)
    with pytest.raises(OSError) as full:
        port.create("/dev/shm/z", 0o600)
    assert full.value.errno == errno.ENOSPC and machine.names() == []
    h = port.create("/dev/shm/z", 0o600)
    port.ftruncate(h, 64)
    seg = port.map(h, "/z")
    machine.damage("/dev/shm/z", 0, b"\x01\x02")
    assert bytes(seg.buf[:2]) == b"\x01\x02"
    at = machine.flip_bit("/dev/shm/z")
    assert 0 <= at < 64 and machine.read("/dev/shm/z") != b"\x01\x02" + bytes(62)
    assert machine.truncate("/dev/shm/z", 10) == 10 and port.fstat(h).st_size == 10
    machine.remove("/dev/shm/z")
    assert port.stat("/dev/shm/z") is None and port.fstat(h).st_size == 10  # open files outlive the name
    assert machine.counts["shm_damage"] == 1 and machine.counts["fault_create_ENOSPC"] == 1
