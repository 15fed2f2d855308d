"""Start-up over simulated shared memory: the instance lock, the arena and the client
table go through the host's ``shm`` port only, and keep their promises across
simulated crashes, reboots and damage.

Every test runs the daemon's own start-up code (:func:`wheeld.daemon.startup.open_arena`,
:class:`wheeld.daemon.instance.InstanceLock`, :class:`wheeld.daemon.client_table.ClientTable`)
over a :class:`sim.shm.SimShm`, and checks at the end that nothing of the instance
appeared in the real ``/dev/shm``. The journal, where one is used, is a real
directory under ``tmp_path``.
"""

from __future__ import annotations

import dataclasses
import os
import random

import numpy as np
import pytest

from daemon_harness import unique_name
from sim.shm import SimCrashed, SimShm
from wheeld.daemon import recovery
from wheeld.daemon.client_table import ClientSlot, ClientTable
from wheeld.daemon.config import Config
from wheeld.daemon.host import Host
from wheeld.daemon.instance import AlreadyRunning, HeldSegment, InstanceLock, UntrustedSegment
from wheeld.daemon.recovery import open_journal
from wheeld.daemon.startup import open_arena
from wheeld.journal.recovery import recover
from wheeld.protocol import arena_layout as AL
from wheeld.protocol import clients_layout as CL
from wheeld.protocol import clock
from wheeld.protocol.naming import SHM_DIR, arena_name, clients_name, instance_entries, lock_path, secret_name, shm_path

UID = 1000


class SeededRandom:
    """``host.rng`` of a simulated host: secrets from a seed."""

    def __init__(self, seed: int):
        self._rng = random.Random(seed)

    def token_bytes(self, n: int) -> bytes:
        return self._rng.randbytes(n)

    def token_hex(self, n: int) -> str:
        return self.token_bytes(n).hex()


class World:
    """One simulated host's shared memory, the processes started on it, and their wall clock."""

    def __init__(self, name: str, seed: int = 1):
        self.name = name
        self.machine = SimShm(random.Random(seed))
        self.seed = seed
        self.wall = 1_700_000_000_000
        self.mono = clock.mono_ms  # the arena's clock: real, as the journal's recovery reads the real clocks
        self.next_pid = 100

    def host(self, uid: int = UID, gids: tuple[int, ...] = ()) -> Host:
        pid, self.next_pid = self.next_pid, self.next_pid + 1
        self.wall += 1

        def wall_ms() -> int:
            return self.wall

        return Host(clock_ms=clock.mono_ms, wall_ms=wall_ms, shm=self.machine.port(pid, uid, gids),
                    rng=SeededRandom(self.seed * 1000 + pid), pid=pid, euid=uid, hostname="sim")

    def path(self, segment: str) -> str:
        return shm_path(segment)


class Daemon:
    """What a daemon's start-up holds: its instance lock, arena and client table."""

    def __init__(self, world: World, cfg: Config, host: Host):
        self.world, self.cfg, self.host = world, cfg, host
        self.lock = InstanceLock.acquire(cfg.name, host)
        self.opened = open_arena(cfg, world.mono(), host, self.lock.qualifier)
        self.wheel = self.opened.wheel
        self.table = ClientTable(cfg, {})
        self.table.open(self.wheel, world.mono(), host, self.lock.qualifier)

    def crash(self) -> None:
        self.world.machine.crash(self.host.shm)

    def stop(self) -> None:
        """A clean stop, then the process exits (the client table stays mapped until then)."""
        self.wheel.close()
        self.lock.release()
        self.world.machine.exit(self.host.shm)


@pytest.fixture
def world():
    name = unique_name("simshm")
    yield World(name)
    assert instance_entries(name, os.listdir(SHM_DIR)) == [], "start-up went around the shm port"


def config(world: World, journal: str | None = None, **kwargs) -> Config:
    return Config(socket_path="/nonexistent/sim.sock", name=world.name, capacity=kwargs.pop("capacity", 500),
                  journal_dir=journal, fsync="always", **kwargs)


def fill(wheel, n: int, delay_ms: int = 600_000) -> dict[int, int]:
    """``n`` timers in group "g", due ``delay_ms`` from now: key -> deadline."""
    gid = wheel.group_id("g")
    now = clock.mono_ms()
    deadlines = {}
    for key in range(n):
        wheel.schedule(key, now + delay_ms + key, gid, key)
        deadlines[key] = now + delay_ms + key
    return deadlines


def timers(wheel) -> dict[int, int]:
    gid = wheel.group_id("g")
    return {key: deadline for key in range(2000) if (deadline := wheel.lookup(key, gid)) is not None}


def journal_of(world: World, tmp_path, n: int) -> tuple[str, dict[int, int]]:
    """A journal directory holding ``n`` timers (a daemon made them, then the host rebooted)."""
    directory = str(tmp_path / "journal")
    cfg = config(world, directory)
    d = Daemon(world, cfg, world.host())
    recorder = open_journal(cfg, d.wheel, d.opened.recovered, {}, next_lsn=d.opened.next_lsn)
    made = fill(d.wheel, n)
    recorder.snapshot()
    recorder.close()
    d.stop()
    world.machine.reboot()
    return directory, made


def close_to(got: dict[int, int], want: dict[int, int]) -> bool:
    """The same keys, each deadline within 2 s (a journal keeps wall-clock deadlines) and
    never earlier than the one scheduled."""
    return got.keys() == want.keys() and all(0 <= got[k] - want[k] <= 2_000 for k in want)


# ---------------------------------------------------------------------------- fresh, crash, reboot
def test_a_fresh_start_makes_its_files_in_simulated_shared_memory_and_holds_them(world):
    d = Daemon(world, config(world), world.host())
    machine, pid = world.machine, d.host.pid
    assert d.opened.fresh and d.table.created and d.opened.set_aside == []
    assert machine.names() == sorted([shm_path(arena_name(world.name)), shm_path(clients_name(world.name)),
                                      lock_path(world.name), shm_path(secret_name(world.name))])
    assert machine.holder(lock_path(world.name)) == pid  # the instance lock
    assert machine.holder(shm_path(arena_name(world.name))) == pid  # the segment locks, kept by the mappings
    assert machine.holder(shm_path(clients_name(world.name))) == pid
    st = d.host.shm.stat(shm_path(arena_name(world.name)))
    assert d.opened.identity == (st.st_dev, st.st_ino)
    assert HeldSegment("arena", d.wheel.name, d.opened.identity, d.host.shm).check() is None
    assert len(d.lock.secret) == 32 and machine.read(shm_path(secret_name(world.name))) == d.lock.secret
    assert d.wheel.created_wall_ms == world.wall  # stamped by the host's wall clock
    assert d.host.shm.stat(lock_path(world.name)).st_mode & 0o777 == 0o644
    assert machine.read(lock_path(world.name)).startswith(f"{pid}\n".encode())
    d.stop()
    assert machine.holder(lock_path(world.name)) is None and machine.holder(shm_path(arena_name(world.name))) is None


def test_a_second_daemon_is_refused_by_the_lock_and_by_the_arena_when_the_lock_file_is_gone(world):
    first = Daemon(world, config(world), world.host())
    with pytest.raises(AlreadyRunning, match=f"uid {UID}, pid {first.host.pid}"):
        InstanceLock.acquire(world.name, world.host())
    world.machine.remove(lock_path(world.name))  # a /dev/shm clean-up script
    second_host = world.host()
    lock = InstanceLock.acquire(world.name, second_host)  # a new lock file...
    with pytest.raises(AlreadyRunning, match=f"pid {first.host.pid}"):
        open_arena(config(world), clock.mono_ms(), second_host, lock.qualifier)  # ...but the arena is held
    assert "holds the new one" in first.lock.check()  # the first daemon sees its lock file replaced
    lock.release()
    assert first.lock.check() is None  # ...and takes the new one once it is free
    assert world.machine.holder(lock_path(world.name)) == first.host.pid
    first.stop()


def test_a_daemon_that_crashed_is_succeeded_by_one_that_attaches_everything_it_had(world):
    first = Daemon(world, config(world), world.host())
    made = fill(first.wheel, 300)
    slot = ClientSlot(3, None, "wheeld-x-c3-ab", first.wheel.group_id("g"), "g", 4242, UID)
    first.table.add(slot)
    first.table.write_entry(3, slot)
    secret, identity = first.lock.secret, first.opened.identity
    first.crash()  # no clean-up at all: the kernel drops the locks, the segments stay
    with pytest.raises(SimCrashed):
        first.lock.release()  # a dead process does nothing more
    second = Daemon(world, config(world), world.host())
    assert not second.opened.fresh and not second.table.created
    assert second.opened.identity == identity and second.lock.secret == secret
    assert timers(second.wheel) == made
    assert second.wheel.check() == []
    assert list(second.table.clients) == [3] and second.table.clients[3].pid == 4242
    assert world.machine.holder(shm_path(arena_name(world.name))) == second.host.pid
    second.stop()


def test_a_reboot_loses_every_segment_and_without_a_journal_starts_empty(world):
    first = Daemon(world, config(world), world.host())
    fill(first.wheel, 50)
    secret = first.lock.secret
    world.machine.reboot()
    assert world.machine.names() == []
    second = Daemon(world, config(world), world.host())
    assert second.opened.fresh and len(second.wheel) == 0 and second.opened.recovered is None
    assert second.lock.secret != secret  # a new secret: the old one went with /dev/shm
    second.stop()


def test_a_reboot_rebuilds_the_arena_from_the_journal(world, tmp_path):
    directory, made = journal_of(world, tmp_path, 400)
    assert world.machine.names() == []
    d = Daemon(world, config(world, directory), world.host())
    assert d.opened.fresh and d.opened.recovered is not None and d.opened.next_lsn is not None
    assert close_to(timers(d.wheel), made)
    assert not world.machine.exists(shm_path(arena_name(world.name)) + ".new")
    assert d.wheel.check() == []
    d.stop()


@pytest.mark.parametrize("fired", [False, True], ids=["pending", "fired"])
@pytest.mark.parametrize("restart_after_s", [1, 59, 61])
def test_a_restart_on_an_arena_rebuilt_within_the_resume_grace_guards_replayed_rings(world, tmp_path,
                                                                                       restart_after_s, fired):
    """The daemon that rebuilt an arena from the journal notes the armings it held
    (``ArmingsAtStart``): a ring of the lost arena, replayed, skips what it already shows.
    Killed before those rings came back, its successor on the same arena takes the
    armings again while the arena is younger than ``--resume-grace-s`` (60 s), for the
    rest of that time; later, none (docs/contracts.md, "Sessions"). Fired and not yet
    acknowledged armings count: every one of them may be (a restart fires at once what
    came due while no daemon ran)."""
    directory, made = journal_of(world, tmp_path, 50)
    first = Daemon(world, config(world, directory), world.host())
    assert first.table.armings_at_start is not None  # the rebuild's own guard
    if fired:
        assert len(first.wheel.expire(max(made.values()) + 2_000)) == len(made)
        assert len(first.wheel) == 0
    first.crash()
    world.wall += restart_after_s * 1000
    second = Daemon(world, config(world, directory), world.host())
    try:
        guard = second.table.armings_at_start
        if restart_after_s >= 60:
            assert guard is None
            return
        assert guard is not None and len(guard.entries) == len(made)
        assert 0 < second.table.armings_until - world.mono() <= (60 - restart_after_s) * 1000
    finally:
        second.stop()


# ---------------------------------------------------------------------------- a crash while building
def _assert_complete_arena(world: World, directory: str, made: dict[int, int]) -> None:
    d = Daemon(world, config(world, directory), world.host())
    try:
        assert close_to(timers(d.wheel), made), "an arena missing journaled timers was taken for the real one"
        assert d.wheel.check() == []
        assert not world.machine.exists(shm_path(arena_name(world.name)) + ".new")
    finally:
        d.stop()


def test_a_crash_at_any_shared_memory_call_of_a_rebuild_never_leaves_an_arena_taken_for_the_real_one(
        world, tmp_path):
    directory, made = journal_of(world, tmp_path, 200)
    cfg = config(world, directory)
    probe = world.host()  # how many port calls a whole start makes
    started = Daemon(world, cfg, probe)
    calls = probe.shm.calls
    started.stop()
    world.machine.reboot()
    assert calls > 10
    for point in range(calls):
        host = world.host()
        world.machine.crash_after(host.shm, point)
        with pytest.raises(SimCrashed):
            Daemon(world, cfg, host)
        _assert_complete_arena(world, directory, made)  # and this one stops cleanly...
        world.machine.reboot()  # ...so start each crash point from a rebooted host


def test_a_crash_half_way_through_loading_the_journal_leaves_only_a_temporary_arena(world, tmp_path, monkeypatch):
    directory, made = journal_of(world, tmp_path, 300)
    host = world.host()
    real_load = recovery.load_recovered

    def load_half_then_die(wheel, state, directory="", *clocks):
        half = dict(list(state.pending.items())[:150])
        real_load(wheel, type(state)(pending=half, unacked=[], last_lsn=state.last_lsn,
                                     snapshot_lsn=state.snapshot_lsn, problems=[]), directory, *clocks)
        world.machine.crash(host.shm)  # SIGKILL in the middle of the recovery
        raise SimCrashed("killed while loading")

    monkeypatch.setattr(recovery, "load_recovered", load_half_then_die)
    with pytest.raises(SimCrashed):
        Daemon(world, config(world, directory), host)
    monkeypatch.undo()
    building = shm_path(arena_name(world.name)) + ".new"
    assert world.machine.exists(building) and not world.machine.exists(shm_path(arena_name(world.name)))
    _assert_complete_arena(world, directory, made)  # the half-built one is removed, the recovery made again


# ---------------------------------------------------------------------------- damage
def _arena_size(world: World) -> int:
    return len(world.machine.read(shm_path(arena_name(world.name))))


@pytest.mark.parametrize("how", ["emptied", "halved", "header scribbled", "wrong layout version"])
def test_a_damaged_or_truncated_arena_is_set_aside_and_rebuilt_from_the_journal(world, tmp_path, how):
    directory = str(tmp_path / "journal")
    cfg = config(world, directory)
    first = Daemon(world, cfg, world.host())
    recorder = open_journal(cfg, first.wheel, first.opened.recovered, {}, next_lsn=first.opened.next_lsn)
    made = fill(first.wheel, 250)
    recorder.snapshot()
    recorder.close()
    first.crash()
    arena = shm_path(arena_name(world.name))
    size = _arena_size(world)
    if how == "emptied":
        world.machine.truncate(arena, 0)
    elif how == "halved":
        world.machine.truncate(arena, size // 2)
    elif how == "header scribbled":
        world.machine.damage(arena, 0, random.Random(7).randbytes(4096))
    else:
        world.machine.damage(arena, 8, (AL.LAYOUT_VERSION + 1).to_bytes(4, "little"))
    damaged = world.machine.read(arena)
    second = Daemon(world, cfg, world.host())
    assert second.opened.fresh and len(second.opened.set_aside) == 1
    aside = os.path.join(SHM_DIR, second.opened.set_aside[0])
    assert aside == f"{arena}.unusable-{world.wall}"
    assert world.machine.read(aside) == damaged  # kept as it was found, for an operator to look at
    assert close_to(timers(second.wheel), made)
    second.stop()


def test_a_damaged_record_is_repaired_at_attach_and_counted_never_reported_sound(world):
    first = Daemon(world, config(world), world.host())
    fill(first.wheel, 20)
    first.crash()
    wheel = first.wheel
    states = wheel.records["state"] & AL.STATE_MASK
    victim = int(np.nonzero(states == AL.SCHEDULED)[0][0])
    at = wheel._header_bytes + victim * AL.RECORD_BYTES + AL.R_KEY_META
    world.machine.damage(shm_path(arena_name(world.name)), at, b"\xff")  # no key has meta byte 0xff
    second = Daemon(world, config(world), world.host())
    assert not second.opened.fresh
    assert second.opened.damaged == 1 and second.opened.lost == 1  # no journal: that timer is lost, and said so
    assert len(timers(second.wheel)) == 19
    assert second.wheel.check() == []
    second.stop()


@pytest.mark.parametrize("touch_reference_kept", [True, False], ids=["record-freed", "record-gone"])
def test_an_idle_timer_snapshotted_before_its_client_is_back_is_restored_as_an_idle_timer(world, tmp_path,
                                                                                          touch_reference_kept):
    """Seed 57081 of the simulation: a daemon restarted under ``--fsync off`` snapshots the
    arena at once (the events after the durable mark cannot be trusted), before any client
    has handed its ring back, so no touch table is in reach. The snapshot must still write
    an idle timer as one (``i``, from the journal read at start): a record of it damaged
    later is restored from the journal either with the touch reference attach freed for it
    (its client's touches move it again), or, that record gone, no sooner than ``idle_ms``
    after the restore (docs/contracts.md, "Delivery and durability"). Written as a plain
    timer it was restored at its first deadline, which its client's touches had passed."""
    directory = str(tmp_path / "journal")
    cfg = dataclasses.replace(config(world, directory), fsync="off")
    first = Daemon(world, cfg, world.host())
    recorder = open_journal(cfg, first.wheel, first.opened.recovered, {}, next_lsn=first.opened.next_lsn)
    gid = first.wheel.group_id("g")
    deadline, idle_ms, tag = world.mono() + 1_000, 600_000, 7
    reference = 3 << CL.TOUCH_INDEX_BITS | 5  # client slot 3's touch row 5
    recorder.begin()
    slot, _gen = first.wheel.schedule("idle", deadline, gid, tag, reference)
    recorder.armed(gid, "idle", deadline, tag, None, idle_ms)
    recorder.commit(world.mono())
    first.crash()

    second = Daemon(world, cfg, world.host())
    assert second.opened.idle_ms == {("g", "idle", tag): idle_ms}
    resynced = open_journal(cfg, second.wheel, second.opened.recovered, {}, next_lsn=second.opened.next_lsn,
                            known_idle=second.opened.idle_ms)  # resyncs: a snapshot of the arena, no client back
    assert recover(directory, repair=False, quiet=True).snapshot_lsn > 0
    second.crash()
    arena = shm_path(arena_name(world.name))
    at = second.wheel._header_bytes + slot * AL.RECORD_BYTES
    world.machine.damage(arena, at + AL.R_KEY_META, b"\xff")  # attach frees the record
    if not touch_reference_kept:
        world.machine.damage(arena, at + AL.R_AUX, (-1).to_bytes(4, "little", signed=True))

    restarted_at = world.mono()
    third = Daemon(world, cfg, world.host())
    try:
        wheel = third.wheel
        gid = wheel.group_id("g")
        rec = wheel.records
        live = np.flatnonzero(((rec["state"] & AL.STATE_MASK) == AL.SCHEDULED) & (rec["tag"] == tag))
        assert live.size == 1, "the damaged idle timer was not restored"
        restored, aux = int(rec["deadline"][live[0]]), int(rec["aux"][live[0]])
        if touch_reference_kept:  # its touches in sight again: the journal's deadline (rounded up on the
            assert aux == reference and 0 <= restored - deadline <= 2  # way), moved by them when due
        else:  # no sooner than idle_ms after the restore
            assert aux == -1 and restored >= restarted_at + idle_ms
    finally:
        third.stop()
        for held in (recorder, resynced):
            held.close()


# ---------------------------------------------------------------------------- other users' files
def test_plain_segments_of_another_uid_make_the_daemon_use_its_uid_qualified_names(world):
    for segment in (arena_name(world.name), clients_name(world.name)):
        world.machine.plant(shm_path(segment), b"root's", uid=0, mode=0o600)
    d = Daemon(world, config(world), world.host())
    assert d.lock.qualifier == UID
    assert d.wheel.name == arena_name(world.name, UID) and d.table.segment_name == clients_name(world.name, UID)
    assert world.machine.read(shm_path(arena_name(world.name))) == b"root's"  # untouched
    d.stop()
    again = Daemon(world, config(world), world.host())  # its qualified segments now hold its timers
    assert again.lock.qualifier == UID and not again.opened.fresh
    again.stop()


def test_an_arena_other_users_may_write_is_set_aside_not_trusted(world):
    first = Daemon(world, config(world), world.host())
    fill(first.wheel, 10)
    first.crash()
    arena = shm_path(arena_name(world.name))
    world.machine.set_owner(arena, mode=0o666)
    second = Daemon(world, config(world), world.host())
    assert second.opened.fresh and len(second.opened.set_aside) == 1 and len(second.wheel) == 0
    second.stop()


def test_an_arena_of_another_uid_that_may_not_be_moved_stops_the_start_with_a_clear_error(world):
    for segment in (arena_name(world.name), arena_name(world.name, UID)):
        world.machine.plant(shm_path(segment), bytes(4096), uid=666, mode=0o666)
    host = world.host()
    lock = InstanceLock.acquire(world.name, host)
    assert lock.qualifier == UID
    with pytest.raises(UntrustedSegment, match="belongs to uid 666"):
        open_arena(config(world), clock.mono_ms(), host, lock.qualifier)
    lock.abandon()
    assert world.machine.names() == sorted([shm_path(arena_name(world.name)), shm_path(arena_name(world.name, UID))])


@pytest.mark.parametrize("proc_locks", [True, False], ids=["proc-locks", "no-proc-locks"])
def test_a_lock_file_this_uid_may_not_open(world, proc_locks):
    world.machine.proc_locks = proc_locks
    world.machine.plant(lock_path(world.name), b"", uid=0, mode=0o600)  # an older root wheeld's
    d = Daemon(world, config(world), world.host())
    assert d.lock.path == lock_path(world.name, UID)
    d.stop()


def test_a_lock_file_this_uid_may_not_open_held_by_a_running_daemon_names_it(world):
    root = world.host(uid=0)
    root_lock = InstanceLock.acquire(world.name, root)
    world.machine.set_owner(lock_path(world.name), mode=0o600)  # as an older wheeld made it
    with pytest.raises(AlreadyRunning, match=f"uid 0, pid {root.pid}"):
        InstanceLock.acquire(world.name, world.host())
    root_lock.release()


def test_a_symlink_or_directory_in_place_of_a_segment_is_never_followed(world):
    world.machine.plant(shm_path(arena_name(world.name)), kind="symlink", uid=UID)
    world.machine.plant(shm_path(clients_name(world.name)), kind="dir", uid=UID, mode=0o700)
    d = Daemon(world, config(world), world.host())
    assert d.opened.fresh and len(d.opened.set_aside) == 1
    assert d.table.created
    d.stop()


def test_a_secret_another_user_may_read_is_replaced(world):
    first = Daemon(world, config(world), world.host())
    secret = first.lock.secret
    first.stop()
    world.machine.set_owner(shm_path(secret_name(world.name)), mode=0o644)
    second = Daemon(world, config(world), world.host())
    assert second.lock.secret != secret and len(second.lock.secret) == 32
    second.stop()


# ---------------------------------------------------------------------------- faults of the port
def test_shared_memory_full_while_making_the_arena_fails_the_start_and_leaves_no_arena(world):
    import errno

    host = world.host()
    lock = InstanceLock.acquire(world.name, host)
    world.machine.fail_next("ftruncate", errno.ENOSPC)
    with pytest.raises(OSError) as failed:
        open_arena(config(world), clock.mono_ms(), host, lock.qualifier)
    assert failed.value.errno == errno.ENOSPC
    lock.abandon()
    assert world.machine.names() == []
    Daemon(world, config(world), world.host()).stop()


def test_the_same_seed_gives_the_same_files_byte_for_byte():
    def run(seed: int) -> dict[str, bytes]:
        w = World("simshm-determinism", seed)
        w.mono = lambda: 5_000_000
        d = Daemon(w, config(w), w.host())
        gid = d.wheel.group_id("g")
        for key in range(50):
            d.wheel.schedule(key, 5_010_000 + key, gid, key)
        d.crash()
        return {path: w.machine.read(path) for path in w.machine.names()}

    first, second, other = run(3), run(3), run(4)
    assert first == second
    assert [path for path in first if first[path] != other[path]] == [shm_path(secret_name("simshm-determinism"))]
    assert instance_entries("simshm-determinism", os.listdir(SHM_DIR)) == []
