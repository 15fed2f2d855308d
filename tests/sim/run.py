"""One seed, one history: the whole service in a simulated world, checked against the contract.

:class:`Simulation` builds a world from a seed (:class:`~sim.world.World`: the
clock and the event queue), a host for the daemon (:class:`~sim.disk.SimDisk`
behind the journal, :class:`~sim.shm.SimShm` behind ``/dev/shm``, the world's
clocks and randomness), the real daemon core (:class:`~sim.daemon.SimDaemon`)
and several worker processes running the real client library
(:class:`~sim.client.SimClient`). The seed also picks the run's *profile*: the
daemon's configuration (journal or not, its fsync policy, the coalescing window,
small rings and arenas that fill) and how often each fault is injected. Then it
runs ``ops`` operations:

* honest workers ``add``, re-arm, ``add_idle``, ``touch``, ``cancel``,
  ``flush`` and ``poll`` (and hand what they poll to the "application", which
  the :class:`~sim.checker.History` records), some of them slow readers whose
  connection delivers what the daemon sends in dribbles;
* hostile workers write random ring records and touch words, and random bytes
  on their connection;
* faults: a worker killed (SIGKILL: no acknowledgement, no Bye), the daemon
  killed between two events or *inside* one (at a random line of the core's
  Python code: a commit point of the wheel, a journal write), restarted after a
  while; a reboot (shared memory gone, a power cut keeps a random prefix of the
  disk's unsynced bytes); the disk failing a write or an fsync (EIO, ENOSPC);
  the journal's background fsync delayed across all of that.

Then the faults stop, a daemon runs, every group gets a live member, and the
clock runs past every deadline, the ack timeout and the resume grace (by then a
client slot whose client is gone is freed, and what waited on it has moved on)
while the workers poll. :func:`~sim.checker.check`
reads the history: nothing acknowledged lost, nothing early, nothing handed
after an acknowledged cancel or re-arm, nothing twice where no worker died,
nothing invented; and the daemon core never raised.

Deterministic: every choice comes from the world's generator, events at one
instant run in the order they were scheduled, and nothing reads the real clock
(the client library reads the world's: :func:`~sim.client.client_clock`).
"""

from __future__ import annotations

import dataclasses
import errno
import os
import posixpath
import random
import sys
import traceback
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from wheeld.daemon import core as core_module
from wheeld.daemon.config import Config
from wheeld.daemon.connection import ANSWER_HIGH_WATER, REJECT_DETAIL_BYTES
from wheeld.daemon.host import Host
from wheeld.daemon.sessions import GC_INTERVAL_MS
from wheeld.protocol import arena_layout as AL
from wheeld.protocol import commands as C
from wheeld.protocol.errors import (ArenaFull, BackPressure, BrokenPeer, Closed, DaemonNotRunning, InvalidDelay,
                                    InvalidKey, InvalidRequest, QuotaExceeded, RingFull,
                                    WheeldError)
from wheeld.protocol.journal import MARK_NAME, scan_lines
from wheeld.journal.files import list_segments, list_snapshots, read_mark
from wheeld.protocol.keys import encode_key
from wheeld.shm.ring import MAX_IDLE_MS
from wheeld.shm.wheel import MAX_DELAY_MS

from .checker import History, Violation, check
from .client import SimClient, SimListener, client_clock
from .daemon import Crash, SimDaemon
from .disk import SimDisk
from .runner import SimRunner
from .shm import SimCrashed, SimShm
from .world import SimRandom, SimUsers, World

__all__ = ["Profile", "Result", "Simulation", "run_seed"]

MS = 1_000_000  # ns
JOURNAL_DIR = "/var/lib/wheeld/sim"
GROUPS = ("g0", "g1", "g2")
DAEMON_UID = 0
WORKER_UID = 1000
HOSTILE_UID = 2000
HOSTILE_GROUP = "h0"
#: the answers (Applied, Rejected) one session may hold unread: docs/contracts.md ("Answers are
#: bounded per session"): past 1 MiB unread its ring is not drained, so at most one more chunk
#: of answers follows, whose rejections are counted rather than sent (past 256 KiB)
ANSWER_BOUND = ANSWER_HIGH_WATER + REJECT_DETAIL_BYTES
# once the service has settled, the daemon fires an arming at most FIRE_LATE_BOUND_MS after
# it is due, and an application is handed it at most LATE_BOUND_MS after (the checker's
# rule 6): wake-up coalescing and the simulated clock's steps fit well inside the first
# (the most seen is under 2 ms), a hoarding worker's poll every 250 ms inside the second;
# a timer that waits for a longer park, a cascade, a redelivery or a reboot does not
FIRE_LATE_BOUND_MS = 50
STUCK_NS = 3600 * 1_000_000_000  # a run with no operation for an hour of simulated time is stuck (Simulation._stuck)
LATE_BOUND_MS = 1000
CHURN_MAX_CLIENTS = 12  # the client slots of a run with departing clients (--max-clients)


@dataclass
class Profile:
    """What one seed runs: the daemon's configuration and the rate of every fault (per operation)."""

    journal: bool = True
    fsync: str = "always"
    coalesce_us: int = 500
    capacity: int = 4096
    ring_capacity: int = 1 << 10
    touch_capacity: int = 64
    group_quota: int = 0
    workers: int = 3
    hostile: int = 0
    slow_readers: int = 0
    max_delay_ms: int = 30_000
    worker_crash: float = 0.0
    daemon_crash: float = 0.0
    crash_inside: float = 0.0  # of the daemon crashes: at a random line inside an event
    reboot: float = 0.0
    disk_fault: float = 0.0
    background_delay: bool = False  # the journal's background fsyncs run when the simulator says
    # Drawn from a generator of their own (draw_extra), so that a seed which draws none of
    # them runs exactly as it did before they existed:
    crafted: int = 0  # hostile workers writing well-formed records with hostile values
    flooder: int = 0  # hostile workers filling their ring with refused commands, never reading
    hoarders: int = 0  # honest workers whose library reads expirations the application polls late
    arena_damage: float = 0.0  # per daemon crash: live arena records overwritten before the restart
    journal_cut: float = 0.0  # per reboot: the newest journal segment cut short
    shrink: float = 0.0  # per reboot: the daemon comes back with a smaller --capacity
    disk_full: float = 0.0  # per operation: the journal's disk fills up for a while
    churn: float = 0.0  # per operation: a short-lived worker arms idle timers and leaves
    recovery_kill: float = 0.0  # per start after a reboot: the daemon killed at a line of its recovery
    # Drawn from a generator of its own (draw_interleave), for the same reason:
    interleave: float = 0.0  # per daemon event: time passes at its clock reads, and clients touch meanwhile
    # Drawn from a generator of its own too (draw_pushes):
    pushes: float = 0.0  # per client turn inside a daemon event: commands pushed into its ring, not touches
    # And this one (draw_arena_loss):
    arena_loss: float = 0.0  # per daemon crash: /dev/shm's segments removed before the restart, workers alive
    # And this one (draw_quota_hold):
    quota_hold: float = 0.0  # per honest operation: its group topped up to --group-quota with far-off timers
    # And this one (draw_cut):
    cut: float = 0.0  # per operation: the daemon closes an honest worker's session and runs on

    @classmethod
    def draw(cls, rng: random.Random) -> Profile:
        p = cls()
        p.journal = rng.random() < 0.8
        p.fsync = rng.choice(["always", "always", "interval=5", "interval=50", "off"]) if p.journal else "off"
        p.coalesce_us = rng.choice([0, 200, 500, 2000])
        p.capacity = rng.choice([256, 4096, 4096])
        p.ring_capacity = rng.choice([64, 1 << 10])
        p.touch_capacity = rng.choice([16, 64])
        p.group_quota = rng.choice([0, 0, 0, 64])
        p.workers = rng.randint(1, 4)
        p.hostile = 1 if rng.random() < 0.25 else 0
        p.slow_readers = rng.randint(0, 1)
        p.max_delay_ms = rng.choice([50, 2_000, 30_000, 600_000])
        p.worker_crash = rng.choice([0.0, 0.002, 0.01])
        p.daemon_crash = rng.choice([0.0, 0.002, 0.01])
        p.crash_inside = rng.choice([0.0, 0.5, 1.0])
        p.reboot = rng.choice([0.0, 0.0, 0.002]) if p.journal and p.fsync == "always" else 0.0
        p.disk_fault = rng.choice([0.0, 0.0, 0.005]) if p.journal else 0.0
        p.background_delay = p.journal and rng.random() < 0.5
        return p

    def draw_extra(self, rng: random.Random) -> None:
        """The newer workloads and faults, from ``rng`` (not the run's generator)."""
        self.crafted = 1 if rng.random() < 0.25 else 0
        self.flooder = 1 if rng.random() < 0.15 else 0
        self.hoarders = 1 if rng.random() < 0.3 else 0
        # the journal must be able to restore what is damaged: with one, and a disk that works
        self.arena_damage = rng.choice([0.0, 0.0, 0.5]) if self.journal and not self.disk_fault else 0.0
        self.journal_cut = rng.choice([0.0, 0.5]) if self.reboot else 0.0
        self.shrink = rng.choice([0.0, 0.5]) if self.reboot else 0.0
        self.disk_full = rng.choice([0.0, 0.0, 0.003]) if self.journal else 0.0
        if self.disk_full:  # a journal that could not be written does not cover the arena
            self.arena_damage = 0.0
        self.churn = rng.choice([0.0, 0.0, 0.0, 0.03])
        if self.journal and self.fsync.startswith("interval") and rng.random() < 0.5:
            self.reboot = 0.002  # the checker excuses what the contract lets such a reboot lose
        self.recovery_kill = rng.choice([0.0, 0.5]) if self.reboot else 0.0

    def draw_interleave(self, rng: random.Random) -> None:
        """How often a daemon event runs concurrently with the clients, from ``rng``."""
        self.interleave = rng.choice([0.0, 0.3, 1.0])

    def draw_pushes(self, rng: random.Random) -> None:
        """How often a client's turn inside a daemon event pushes ring records, from ``rng``."""
        self.pushes = rng.choice([0.0, 0.5]) if self.interleave else 0.0

    def draw_arena_loss(self, rng: random.Random) -> None:
        """How often the arena is lost while the daemon is down and its workers live, from
        ``rng``: with a journal whose disk works (it alone has the timers then)."""
        working = self.journal and not self.disk_fault and not self.disk_full
        self.arena_loss = rng.choice([0.0, 0.5]) if working and self.daemon_crash else 0.0

    def draw_cut(self, rng: random.Random) -> None:
        """How often the daemon closes a live honest worker's session while it runs on, from
        ``rng``: as it does a client that stopped reading its socket (a Goodbye, its ring
        applied without a session, what was sent to it back to its group), so that the
        answers of that ring are made with no session to send them to."""
        self.cut = rng.choice([0.0, 0.0, 0.003, 0.01])

    def draw_quota_hold(self, rng: random.Random) -> None:
        """How often a worker keeps its group at its --group-quota, from ``rng``, with arena
        losses right after library re-arms: the daemon that rebuilds the arena from the
        journal restores the fired records the lost one had sent, which count towards the
        quota a re-arm then meets (``Simulation._hold_quota``, ``_lose_after_rearm``). With
        a journal whose disk works (it alone has the timers then); a seed without a quota
        gets one (small, to be reached), and clients touch inside daemon events (their
        touches after the daemon read the word make the library re-arms)."""
        working = self.journal and not self.disk_fault and not self.disk_full
        self.quota_hold = rng.choice([0.0, 0.3]) if working else 0.0
        if self.quota_hold:
            self.group_quota = self.group_quota or rng.choice([16, 64])
            self.interleave = self.interleave or 0.3

    def describe(self) -> str:
        journal = f"journal fsync={self.fsync}" if self.journal else "no journal"
        return (f"{journal}, coalesce {self.coalesce_us} us, capacity {self.capacity}, ring {self.ring_capacity}, "
                f"{self.workers} workers ({self.hostile} hostile, {self.slow_readers} slow), delays <= "
                f"{self.max_delay_ms} ms" + "".join(
                    f", {name} {value}" for name, value in (
                        ("crafted", self.crafted), ("flooder", self.flooder), ("hoarders", self.hoarders),
                        ("arena damage", self.arena_damage), ("journal cut", self.journal_cut),
                        ("shrink", self.shrink), ("disk full", self.disk_full), ("churn", self.churn),
                        ("recovery kill", self.recovery_kill), ("interleave", self.interleave),
                        ("pushes", self.pushes), ("arena loss", self.arena_loss),
                        ("group quota", self.group_quota), ("quota hold", self.quota_hold),
                        ("cut", self.cut)) if value))


@dataclass
class Result:
    seed: int
    profile: Profile
    ops: int
    violations: list[Violation]
    faults: Counter
    events: int
    sim_ms: int
    handed: int
    acked: int
    trace: list[str] = field(default_factory=list)
    deaths_between_hand_and_ack: int = 0  # History.deaths_between_hand_and_ack

    @property
    def ok(self) -> bool:
        return not self.violations


class _Life:
    """Whether a simulated daemon process is dead. A raise in a trace function turns
    tracing off, so the ``except``/``finally`` code the :class:`Crash` unwinds through
    still runs, which a SIGKILL would not let run: once dead, the process's disk and
    shared memory refuse every call (:class:`_ProcessFs`, the shm port's ``alive``), so
    that code changes nothing a later process sees."""

    def __init__(self):
        self.dead = False
        self.shm = None  # the process's shm port

    def kill(self) -> None:
        self.dead = True
        if self.shm is not None:
            self.shm.alive = False


class _ProcessFs:
    """One process's view of the simulated disk: every call raises Crash once it is dead."""

    def __init__(self, disk: SimDisk, life: _Life):
        self._disk = disk
        self._life = life

    def __getattr__(self, name):
        attribute = getattr(self._disk, name)
        if not callable(attribute):
            return attribute
        life = self._life

        def call(*args, **kwargs):
            if life.dead:
                raise Crash("the process is dead")
            return attribute(*args, **kwargs)
        if name not in vars(self._disk) and callable(getattr(type(self._disk), name, None)):
            setattr(self, name, call)  # a method of the disk's class: the same call every time
        return call


def _a_kill(exc: BaseException | None) -> bool:
    """Whether ``exc`` is a simulated kill, or was raised while handling one. A real
    SIGKILL runs no cleanup; the simulated one unwinds through ``except`` blocks, and
    whatever they raise after it belongs to the dead process too."""
    seen = 0
    while exc is not None and seen < 50:
        if isinstance(exc, (Crash, SimCrashed)):
            return True
        exc = exc.__context__
        seen += 1
    return False


class _Tracer:
    """Raises :class:`Crash` at the n-th line the core runs (a SIGKILL at that line), or
    with ``at_call`` (module, function) as that function is called: a kill at one
    chosen point, such as between applying a ring chunk and publishing the ring's
    head. Only Python code is traced: on the compiled path a call made from compiled
    code is not seen."""

    def __init__(self, lines: int, life: _Life | None = None, at_call: tuple[str, str] | None = None):
        self.left = lines
        self.life = life
        self.at_call = at_call

    def __call__(self, frame, event, arg):
        if event == "call":
            module = frame.f_globals.get("__name__", "")
            if self.at_call is not None:
                if (module, frame.f_code.co_name) == self.at_call:
                    if self.life is not None:
                        self.life.kill()
                    raise Crash(f"killed as {module}.{frame.f_code.co_name} was called")
                return None
            return self if module.startswith(("wheeld.daemon", "wheeld.shm", "wheeld.protocol")) else None
        if event == "line":
            self.left -= 1
            if self.left <= 0:
                if self.life is not None:
                    self.life.kill()
                raise Crash("killed inside the core")
        return self


class Worker:
    """One worker process: a client incarnation and what its application does."""

    def __init__(self, sim: Simulation, ident: int, group: str, slow: bool = False, hostile: bool = False,
                 kind: str = ""):
        self.sim = sim
        self.ident = ident
        self.group = group
        self.slow = slow
        self.hostile = hostile
        # "crafted", "flooder" (hostile); "hoarder", "churn" (honest); "" the plain ones
        self.kind = kind
        self.ops_left = sim.xrng.randint(2, 12) if kind == "churn" else None
        self.acting = False
        self.retrying = False  # refused at its first connect: connecting again
        self.backoff_ms = 50.0
        self.pid = 10_000 + ident
        self.client = SimClient(self._dial, sim.world.clock_ns, group=group, pid=self.pid,
                                reconnect_timeout_s=10 ** 6, connect_timeout_s=10 ** 6)
        self.connection = None
        self.keys: list[str] = []
        self.idle_keys: set[str] = set()
        self.flushes: dict[int, list] = {}  # flush number -> what it covers (History.flush_called)
        self.alive = True
        self.started = False
        self.aliases: dict[int, int] = {}  # a tag the library re-armed an idle timer with -> the arming's
        self.welcome_seen = None  # (a hoarder) the Welcome of the session it last read on
        self.rearmed = False  # its library re-armed an idle timer in the poll under way

    def _dial(self):
        uid = HOSTILE_UID if self.hostile else WORKER_UID
        end = self.sim.listener.connect(self.pid, uid, uid)
        self.connection = end.connection
        self.sim.connections.append(end.connection)
        if self.slow:
            end.connection.to_client.hold = True
        return end


class Simulation:
    """A run of one seed (module docstring)."""

    def __init__(self, seed: int, ops: int = 1000, profile: Profile | None = None, trace: bool = False,
                 extra: bool = True, hold: bool = True, cut: bool = True):
        self.seed = seed
        self.world = World(seed)
        rng = self.rng = self.world.rng
        # the newer workloads and faults choose with a generator of their own
        self.xrng = random.Random(seed * 1_000_003 + 17)
        self.irng = random.Random(seed * 7_000_003 + 29)  # and the clients' stores inside daemon events
        self.prng = random.Random(seed * 11_000_003 + 37)  # and which of those stores are ring records
        self.arng = random.Random(seed * 13_000_003 + 41)  # and whether a crashed daemon's arena is lost
        self.qrng = random.Random(seed * 17_000_003 + 43)  # and the groups held at their quota
        self.crng = random.Random(seed * 19_000_003 + 47)  # and the sessions the daemon cuts
        self.extra = extra
        if profile is None:
            profile = Profile.draw(rng)
            if extra:  # (extra=False: the run as it was before the newer workloads and faults)
                profile.draw_extra(self.xrng)
                profile.draw_interleave(self.irng)
                profile.draw_pushes(self.prng)
                profile.draw_arena_loss(self.arng)
                if hold:  # (hold=False: the run as it was before draw_quota_hold)
                    profile.draw_quota_hold(self.qrng)
                if cut:  # (cut=False: the run as it was before draw_cut)
                    profile.draw_cut(self.crng)
        self._interleaving = 0  # clock reads of the current daemon event that may still let time pass
        self.profile = profile
        self.ops_target = ops
        self.disk = SimDisk(random.Random(rng.getrandbits(64)))
        self.shm = SimShm(random.Random(rng.getrandbits(64)))
        self.listener = SimListener()
        self.history = History()
        self.history.in_library = self._in_library
        self.disk.on_failure = lambda: self.history.disk_failed(self.world.now_ns)
        self.disk.on_sync = self._disk_synced
        self.disk.on_write = self._disk_written
        self.disk.on_durable = self._disk_made_durable
        self.faults: Counter = Counter()
        self.violations: list[Violation] = []
        self.connections: list = []  # every connection made; the closed ones are dropped as they are seen
        self.sessions: dict[int, object] = {}  # id(connection) -> its session in the current daemon
        self.daemon: SimDaemon | None = None
        self.runner: SimRunner | None = None
        self.workers: list[Worker] = []
        # the honest workers in self.workers that may still be alive, in the same order (a
        # dead worker never lives again: _prune_honest drops those found dead)
        self._honest: list[Worker] = []
        # worker ident -> when the daemon cut its session (the client may notice only later, or
        # never: an acknowledgement it pushes meanwhile reaches a ring the daemon already left)
        self._cuts: dict[int, list[int]] = {}
        self._by_ident: dict[int, Worker] = {}  # every worker ever spawned, by ident
        self.next_ident = 0
        self.ops = 0
        self.pid = 100
        self.tracing = trace
        self.trace: list[str] = []
        self._net_due = False
        self._background_due = False
        self.fault_free = False
        self._memory_flagged = False
        self._settled_ns: int | None = None  # set by the wind-down (see LATE_BOUND_MS)
        self._left_while_settling = False  # a worker died or left once the faults had stopped
        self._arena_damaged = False  # records of the arena were overwritten between daemon runs
        self._damage_expected: bool | None = None  # a journal cut before the next start: is it damage?
        self._damaged_before = False  # a journal cut below its durable mark happened in this run
        self._refused_in_a_row = 0  # daemon starts refused since the last one that succeeded
        self._recovering = False  # no daemon has started since the last reboot
        self._last_death_ns = 0  # when the last daemon died
        self._damage_reported = False  # a start since the last journal cut counted damage, and died
        self._life = _Life()  # the daemon process that runs now, or was started last
        p = self.profile
        churn = {"max_clients": CHURN_MAX_CLIENTS, "clients_per_uid": 0} if p.churn else {}
        self.config = Config(
            socket_path="sim:wheeld", name=f"sim{seed}", capacity=p.capacity, ring_capacity=p.ring_capacity,
            touch_capacity=p.touch_capacity, max_groups=64, group_quota=p.group_quota,
            journal_dir=JOURNAL_DIR if p.journal else None, fsync=p.fsync, coalesce_us=p.coalesce_us,
            max_park_ms=500, ack_timeout_s=30.0, resume_grace_s=60.0, **churn,
        )

    # ------------------------------------------------------------------ the journal's disk
    def _disk_synced(self, path: str) -> None:
        if _holds_events(path):
            self.history.disk_synced(self.world.now_ns)

    def _disk_written(self, path: str, number: int) -> None:
        if _holds_events(path):
            self.history.disk_written(self.world.now_ns, number)

    def _disk_made_durable(self, path: str, numbers: list[int]) -> None:
        if _holds_events(path):
            self.history.disk_made_durable(numbers)

    # ------------------------------------------------------------------ the log
    def note(self, text: str) -> None:
        if self.tracing:
            self.trace.append(f"{self.world.now_ns / MS:14.3f} {text}")

    # ------------------------------------------------------------------ the daemon
    def _host(self) -> Host:
        self.pid += 1
        self.runner = SimRunner(inline=not self.profile.background_delay)
        life = self._life = _Life()
        fs = _ProcessFs(self.disk, life) if self.extra else self.disk
        host = Host(clock_ms=self._daemon_clock_ms, clock_ns=self.world.clock_ns, wall_ms=self.world.wall_ms,
                    wall_ns=lambda: self.world.wall_ms() * MS, fs=fs, runner=self.runner,
                    shm=self.shm.port(self.pid, DAEMON_UID, ()), users=SimUsers(), rng=SimRandom(self.rng),
                    pid=self.pid, euid=DAEMON_UID, hostname="sim", process_alive=self._process_alive)
        if self.extra:  # (plain runs, as before: the unwound code ran on)
            life.shm = host.shm
        return host

    def _daemon_clock_ms(self) -> int:
        """The daemon's clock. The daemon shares the host with its clients: while it works
        time passes, and a client may store into shared memory between any two of its
        instructions. In an event chosen for it (:meth:`_guard`) a clock read is followed,
        now and then, by a little time passing and an honest worker's application touching
        its idle keys: the daemon then reads touch words stored after its clock read."""
        now = self.world.now_ns // 1_000_000  # (World.clock_ms)
        if self._interleaving and self.irng.random() < 0.5:
            self._interleaving -= 1
            self.world.now_ns += self.irng.randint(100_000, 1_900_000)  # the daemon's work takes time
            # the worker is another process: a kill of the daemon (_Tracer) counts none of its
            # lines and cannot stop it halfway (its ring and protocol code are traced modules)
            tracer = sys.gettrace()
            sys.settrace(None)
            try:
                if self.profile.pushes and self.prng.random() < self.profile.pushes:
                    self._push_meanwhile()
                else:
                    self._touch_meanwhile()
            finally:
                sys.settrace(tracer)
        return now

    def _push_meanwhile(self) -> None:
        """An honest, live worker's application arms, cancels, touches or flushes, now: its
        records land in its ring (and its doorbell on the socket) while the daemon is between
        two clock reads, e.g. between two chunks of a drain or after reading a ring's depth."""
        workers = [w for w in self._honest if w.alive and w.started and not w.kind
                   and w.client.connected and not w.client.closed_session]
        if not workers:
            return
        worker = self.prng.choice(workers)
        self.faults["client commands inside a daemon event"] += 1
        for _ in range(self.prng.randint(1, 8)):
            self._honest_step(worker, self.prng, poll=False)

    def _touch_meanwhile(self) -> None:
        """An honest, live worker's application touches each of its idle keys, now."""
        workers = [w for w in self._honest if w.alive and w.started and w.idle_keys]
        if not workers:
            return
        worker = self.irng.choice(workers)
        now = self.world.now_ns
        self.faults["client touches inside a daemon event"] += 1
        for key in sorted(worker.idle_keys):
            try:
                worker.client.touch(key)
            except InvalidKey:  # its expiration was handed over: no longer armed
                worker.idle_keys.discard(key)
                continue
            self.history.touched(worker.ident, key, now)
            if self.tracing:
                self.note(f"w{worker.ident} touch {key} (inside a daemon event)")

    def _process_alive(self, pid: int) -> bool:
        """A worker's process exists while it lives (a pid no worker has: unknown, alive)."""
        worker = next((w for w in self.workers if w.pid == pid), None)
        return worker is None or worker.alive

    def start_daemon(self) -> None:
        if self.daemon is not None and self.daemon.alive:
            return
        host = self._host()
        daemon = SimDaemon(self.world, host, self.config)
        daemon.on_raise = self._daemon_raised
        daemon.guard = self._guard
        try:
            if self._recovering and self.profile.recovery_kill and not self.fault_free and \
                    self.xrng.random() < self.profile.recovery_kill:
                self._start_killed(daemon)
            else:
                self._guard(daemon.start)
        except BaseException as exc:  # noqa: BLE001 - a kill, a refusal, or a finding
            if not _a_kill(exc):
                if isinstance(exc, WheeldError):
                    return self._start_refused(daemon, exc)
                raise
            self.faults["daemon killed while starting"] += 1
            self._damage_reported |= bool(getattr(daemon.core, "totals", {}).get("journal_damaged_ranges_total"))
            self._daemon_died(daemon)
            self.world.after_ms(self.rng.uniform(1, 300), self.start_daemon)
            return
        self.daemon = daemon
        self._refused_in_a_row = 0
        self.sessions = {}
        self.listener.listening = True
        self._recovering = False
        self.note(f"daemon {host.pid} started")
        self.history.daemon_started(self.world.now_ns)
        self._check_damage_reported(daemon)

    def _touches_not_settled(self) -> None:
        """A worker that left has its idle timers moved to last touch + idle_ms, and
        journaled, when the daemon frees its slot. Its touch table lives in its ring's
        memfd, which no process holds once the worker has exited and the daemon has died
        (or the host rebooted): a worker whose slot the daemon still held then loses its
        touches as a crashed one does. Its idle timers keep their deadlines (the next
        daemon frees the slot of a process that is gone, with no table to read), or come
        back at their journaled ones after a reboot (docs/contracts.md)."""
        clients = getattr(getattr(self.daemon, "core", None), "clients", None) or {}
        held = {cs.pid for cs in clients.values()}
        for worker in self._by_ident.values():
            if not worker.alive and not worker.hostile and worker.pid in held:
                self.history.touches_lost(worker.ident)

    def _rings_left_unread(self, daemon: SimDaemon) -> None:
        """A worker that exited (a Bye, a kill) leaves its ring to the daemon, which applies
        what is in it as it ends the session (docs/contracts.md, "Delivery and durability").
        A daemon that dies before it has read all of it (killed as the Bye or the closed
        connection came in) takes the ring with it: no process holds it any more, and the
        acknowledgements in it are never applied. The next daemon finds the process gone and
        sends what it had sent that worker to the group (History.ring_lost)."""
        clients = getattr(daemon.core, "clients", None) or {}
        exited = {w.pid: w for w in self._by_ident.values() if not w.alive and not w.hostile}
        for cs in clients.values():
            worker = exited.get(cs.pid)
            segment = cs.segment
            if worker is None or segment is None:
                continue
            try:
                unread = segment.depth() > 0
            except WheeldError:  # (unmapped, or impossible counters: nothing left to read)
                continue
            if unread:
                self.history.ring_lost(worker.ident, self.world.now_ns)

    def _start_killed(self, daemon: SimDaemon) -> None:
        """The first starts after a reboot rebuild the arena from the journal: kill one at a
        random line of that work (a start that finishes first is not killed)."""
        self.faults["daemon start after a reboot under a kill"] += 1
        sys.settrace(_Tracer(self.xrng.randint(1, 5_000), self._life))  # a start runs a few thousand lines
        try:
            daemon.start()
        finally:
            sys.settrace(None)

    def _check_damage_reported(self, daemon: SimDaemon) -> None:
        """After a reboot whose power cut came with a journal cut short: docs/contracts.md, "a
        torn write only loses what was never synced; a journal that ends before its durable
        mark was cut short after the fact, and that is damage": a cut below the mark is
        reported (journal_damaged_ranges_total of the arena the recovery built)."""
        expected, self._damage_expected = self._damage_expected, None
        if expected is None or not self.profile.journal:
            return
        # a start killed after its recovery counted the damage (and may have written the
        # snapshot after which the next recovery no longer sees it) reported it too
        reported = daemon.core.totals.get("journal_damaged_ranges_total", 0) or self._damage_reported
        self._damage_reported = False
        if expected and not reported:
            self.violations.append(Violation(
                "silent-damage", "the journal was cut short below its durable mark before this start, and the "
                                 "recovery reported no damage (journal_damaged_ranges_total is 0)"))
        elif not expected and reported and not self._damaged_before:
            # (a journal cut below its mark at an earlier reboot stays in the journal until a
            # snapshot covers it, which a full or failing disk can put off: a later recovery
            # reports that range again)
            self.violations.append(Violation(
                "false-damage", f"a power cut (no bytes removed after they were synced) was reported as "
                                f"{reported} damaged journal range(s)"))

    def _guard(self, action, *args):
        """Run a core event; a crash fault may strike at a random line inside it."""
        tracer = None
        if not self.fault_free and self.profile.daemon_crash and self.rng.random() < self.profile.daemon_crash * \
                self.profile.crash_inside * 0.3:
            tracer = _Tracer(self.rng.randint(1, 3000), self._life if self.extra else None)
            if self.extra and self.xrng.random() < 0.25:
                # the point where a killed daemon leaves work to redo: a ring chunk applied
                # and journaled, its head not published (the next daemon applies it again)
                tracer = _Tracer(0, self._life, at_call=("wheeld.shm.ring", "commit"))
            self.faults["daemon killed inside an event"] += 1
            sys.settrace(tracer)
        if self.profile.interleave and not self.fault_free and self.irng.random() < self.profile.interleave:
            self._interleaving = 3
        try:
            return action(*args)
        finally:
            self._interleaving = 0
            if tracer is not None:
                sys.settrace(None)

    def _start_refused(self, daemon: SimDaemon, exc: WheeldError) -> None:
        """A refused start: systemd starts it again a little later."""
        self.faults["daemon start refused"] += 1
        self._damage_reported |= bool(getattr(daemon.core, "totals", {}).get("journal_damaged_ranges_total"))
        self.note(f"daemon start refused: {exc}")
        self._daemon_died(daemon)
        self._refused_in_a_row += 1
        # a fault may make a start fail now and then; one refused again and again, or
        # at all once the faults have stopped, leaves the service down for good
        # (systemd's StartLimitBurst gives up after 5 starts)
        if self._refused_in_a_row >= (5 if self.fault_free else 20):
            self.violations.append(Violation(
                "no-daemon", f"{self._refused_in_a_row} daemon starts in a row were refused"
                             f"{' with no fault injected any more' if self.fault_free else ''}: {exc}"))
            self.world.stop()
            return
        self.world.after_ms(self.rng.uniform(50, 500), self.start_daemon)

    def _daemon_raised(self, exc: BaseException) -> None:
        if _a_kill(exc):
            self.note("daemon killed inside an event")
            self.kill_daemon(counted=False)
            return
        text = "".join(traceback.format_exception(exc))
        self.violations.append(Violation("raised", f"the daemon core raised: {text}"))
        self.kill_daemon(counted=False)

    def kill_daemon(self, counted: bool = True, lose_arena: bool = False) -> None:
        daemon = self.daemon
        if daemon is None or not daemon.alive:
            return
        if counted:
            self.faults["daemon killed between events"] += 1
        self.note("daemon killed")
        self._daemon_died(daemon, damage=True)
        if lose_arena or (self.profile.arena_loss and not self.fault_free
                          and self.arng.random() < self.profile.arena_loss):
            self._lose_arena()
        self.world.after_ms(self.rng.uniform(1, 300), self.start_daemon)

    def _lose_arena(self) -> None:
        """While the daemon is down, its segments in ``/dev/shm`` are removed (an operator, or
        systemd's RemoveIPC) and its workers live on: the next daemon rebuilds the arena from
        the journal, a new one (a new arena epoch), and adopts the rings the workers hand
        back (docs/contracts.md, the handshake). Its timers are plain timers at their journaled
        deadlines: touches made since no longer move them."""
        for name in self.shm.names():
            self.shm.remove(name)
        self.faults["arena lost while the daemon was down"] += 1
        self.history.arena_lost(self.world.now_ns)
        self._arena_damaged = True  # (idle timers restored from the journal: see [late])
        self.note("the arena's segments were removed from /dev/shm")

    def _daemon_died(self, daemon: SimDaemon, damage: bool = False) -> None:
        self._touches_not_settled()
        self._rings_left_unread(daemon)
        daemon.crash()
        self._last_death_ns = self.world.now_ns
        self.history.daemon_died(self.world.now_ns)
        if damage and self.profile.arena_damage and not self.fault_free and \
                self.xrng.random() < self.profile.arena_damage:
            self._damage_arena(daemon.core)
        self.listener.stop()
        for connection in self.connections:
            connection.cut()
        self.sessions = {}
        if self.runner is not None:
            self.faults["background syncs lost with the daemon"] += self.runner.drop()
        self.shm.crash(daemon.host.shm)
        _release_fds(daemon.core)

    def _damage_arena(self, core) -> None:
        """A stray writer overwrites live records of the arena while no daemon runs. The
        contract (docs/contracts.md, README "arena damage"): with --journal, damage found at
        attach is reconciled from the journal, so no timer is lost and none fires early."""
        wheel = getattr(core, "wheel", None)
        records = getattr(wheel, "records", None)
        if records is None:
            return
        x = self.xrng
        live = np.flatnonzero((records["state"] & AL.STATE_MASK) == AL.SCHEDULED)
        live = live[live >= wheel.first_entry]
        if not live.size:
            return
        for _ in range(x.randint(1, 4)):
            slot = int(live[x.randrange(live.size)])
            kind = x.choice(["impossible deadline", "deadline moved earlier", "key meta", "group"])
            if kind == "impossible deadline":
                records["deadline"][slot] = x.choice([1 << 62, -(1 << 62), (1 << 63) - 1])
            elif kind == "deadline moved earlier":
                records["deadline"][slot] = int(records["deadline"][slot]) - x.randint(50, 5000)
            elif kind == "key meta":
                records["key_meta"][slot] = 0xFF
            else:
                records["group"][slot] = 0x7FFF
            self.faults[f"arena damaged: {kind}"] += 1
            # an idle timer whose record is restored from the journal has lost its touch
            # reference: it waits idle_ms from the restore (docs/contracts.md), late and
            # never early: [late] then holds only the plain timers
            self._arena_damaged = True
            self.note(f"arena record {slot} damaged: {kind}")

    def reboot(self) -> None:
        self.faults["reboot"] += 1
        self.note("reboot")
        was_alive = self.daemon is not None and self.daemon.alive
        self._touches_not_settled()
        if self.daemon is not None and self.daemon.alive:
            self._daemon_died(self.daemon)
        for worker in list(self.workers):
            if worker.alive:
                self._kill_worker(worker, reboot=True)
        self.shm.reboot()
        self.disk.power_cut()
        fsync = self.profile.fsync
        # --fsync interval=N: "a reboot loses at most what was applied in the last N ms plus
        # one loop iteration" (docs/contracts.md); a loop iteration is given 50 ms here. The
        # last N ms of the last daemon's life: one killed before it synced, with none started
        # since, leaves its unsynced tail to the cut (a started one syncs what it finds)
        window_ms = int(fsync.split("=", 1)[1]) + 50 if fsync.startswith("interval") else 0
        self.history.power_cut(self.world.now_ns if was_alive else self._last_death_ns, window_ms * MS)
        self._recovering = True
        self._damage_expected = False
        if self.profile.journal_cut and self.xrng.random() < self.profile.journal_cut:
            self._cut_journal()
        self.world.after_ms(self.rng.uniform(10, 1000), self._after_reboot)

    def _cut_journal(self) -> None:
        """The newest journal segment cut short while the host was down (an operator, a file
        system repair). Whether the cut reaches below the durable mark decides whether the
        next start must report damage (:meth:`_check_damage_reported`); either way the
        timers the cut bytes held may be lost (the checker excuses them)."""
        segments = list_segments(JOURNAL_DIR, self.disk) if self.disk.exists(JOURNAL_DIR) else []
        if not segments:
            return
        first_lsn, path = segments[-1]
        data = self.disk.read_file(path)
        length = self.xrng.randint(0, len(data))
        mark = read_mark(JOURNAL_DIR, self.disk)
        kept = [event.n for event in scan_lines(bytes(data[:length])).events]
        reaches = max(kept) if kept else first_lsn - 1
        snapshots = list_snapshots(JOURNAL_DIR, self.disk)
        if snapshots:
            reaches = max(reaches, snapshots[-1][0])
        self.disk.truncate_file(path, length)
        below = reaches < mark
        self._damage_expected = below
        self._damaged_before |= below
        self._damage_reported = False
        self.history.disk_damaged(self.world.now_ns)
        self.faults["journal cut at a reboot" + (" below its durable mark" if below else "")] += 1
        self.note(f"journal {path} cut from {len(data)} to {length} bytes (reaches lsn {reaches}, mark {mark})")

    def _after_reboot(self) -> None:
        if self.profile.shrink and self.xrng.random() < self.profile.shrink:
            capacity = self.xrng.choice([16, 32, 64])
            if capacity < self.config.capacity:
                self.config = dataclasses.replace(self.config, capacity=capacity)
                self.faults["reboot with a smaller --capacity"] += 1
                self.note(f"the daemon comes back with --capacity {capacity}")
        self.start_daemon()
        for group in GROUPS[: max(1, min(len(GROUPS), self.profile.workers))]:
            self.spawn(group)

    # ------------------------------------------------------------------ workers
    def spawn(self, group: str, slow: bool = False, hostile: bool = False, kind: str = "") -> Worker:
        self.next_ident += 1
        worker = Worker(self, self.next_ident, group, slow, hostile, kind)
        worker.client.on_idle_rearm = lambda key, tag, w=worker: self._idle_rearmed(w, key, tag)
        worker.client.on_received = self._received
        self.workers.append(worker)
        self._by_ident[worker.ident] = worker
        if not hostile:
            self._honest.append(worker)
            self.history.joined(worker.ident, group)
        self.world.after_ms(self.rng.uniform(0, 5), lambda: self._connect(worker))
        return worker

    def _connect(self, worker: Worker) -> None:
        if not worker.alive:
            return
        try:
            worker.client.connect()
        except (DaemonNotRunning, BrokenPeer, OSError):
            self._connect_again(worker)
            return
        worker.started = True
        if worker.acting:  # a connect again after a refusal: its application is running already
            return
        worker.acting = True
        self.world.after_ms(self.rng.uniform(0, 2), lambda: self._act(worker))

    def _connect_again(self, worker: Worker) -> None:
        """The first connect of ``worker``'s client failed (nothing listened, or the daemon
        went away before its Welcome): its application tries again with a new client, as
        one whose ``wheeld.connect()`` raised would."""
        worker.client = SimClient(worker._dial, self.world.clock_ns, group=worker.group, pid=worker.pid,
                                  reconnect_timeout_s=10 ** 6, connect_timeout_s=10 ** 6)
        worker.client.on_received = self._received
        worker.client.on_idle_rearm = lambda key, tag, w=worker: self._idle_rearmed(w, key, tag)
        self.world.after_ms(self.rng.uniform(5, 100), lambda: self._connect(worker))

    def _flush_then_die(self, worker: Worker) -> None:
        """A hoarder back on a new session after a daemon restart, still holding what its
        application has not polled (the daemon sends it copies of those): sometimes it
        flushes at once, which pushes the acknowledgements its library has, and dies a
        moment later without polling. An acknowledgement of a copy of an expiration the
        application never had would take that timer with it."""
        welcome = worker.client._welcome
        if welcome is None or welcome is worker.welcome_seen:
            return
        first = worker.welcome_seen is None
        worker.welcome_seen = welcome
        if first or self.fault_free or not worker.client._ready or self.xrng.random() >= 0.3:
            return
        self.faults["hoarder flushed after a restart and died"] += 1
        try:
            number = worker.client.flush()
        except WheeldError as exc:
            self.note(f"worker {worker.ident} flush: {exc!r}")
        else:
            worker.flushes[number] = self.history.flush_called(worker.ident)
            self.note(f"w{worker.ident} flush #{number} (back after a restart, {len(worker.client._ready)} unpolled)")

        def die() -> None:
            if worker.alive:
                self._kill_worker(worker)
        self.world.after_ms(self.xrng.uniform(0.5, 20), die)

    def _kill_worker(self, worker: Worker, reboot: bool = False) -> None:
        worker.alive = False
        self._left_while_settling |= self.fault_free  # (as in _depart)
        worker.client.crash()
        if not worker.hostile:
            self.history.crashed(worker.ident, self.world.now_ns)
        self.note(f"worker {worker.ident} killed")
        if not reboot:
            self.faults["worker killed"] += 1
            if worker.kind != "churn":  # a departing worker is not replaced
                self.world.after_ms(self.rng.uniform(1, 200), lambda: self.spawn(worker.group, worker.slow,
                                                                                 worker.hostile, worker.kind))

    def _act(self, worker: Worker) -> None:
        """One operation of a worker's application, then the next one a little later."""
        if not worker.alive:
            return
        if worker.retrying or (self.extra and not worker.hostile and worker.client._segment is None):
            # its application waits for its connect (a real connect() returns after the
            # Welcome; plain runs, as before, went on without it)
            if worker.client._segment is None:
                self._poll(worker)  # (a real connect() reads its Welcome as it comes, and tries again)
                self.world.after_ms(self.xrng.uniform(0.5, 1) * worker.backoff_ms, lambda: self._act(worker))
                return
            worker.retrying = False
        if not worker.hostile and worker.client._welcome is None:
            # the first session is not open yet (wheeld.connect() returns only then)
            self._poll(worker)
            self.world.after_ms(self.rng.uniform(0.1, 5), lambda: self._act(worker))
            return
        if self.ops < self.ops_target:
            self.ops += 1
            self._faults()
            if not worker.alive:
                return
            if worker.hostile and self.extra and (worker.client._segment is None or worker.kind == "crafted"):
                # a hostile client reads its Welcome (and its ring) before it writes into the ring;
                # the crafted kind reads on (and connects again when closed), the others read
                # nothing after that (plain runs, as before: no ring, only the socket)
                try:
                    worker.client.receive()
                except (WheeldError, OSError):
                    pass
            if worker.kind == "crafted":
                self._crafted_step(worker)
            elif worker.kind == "flooder":
                self._flood_step(worker)
            elif worker.hostile:
                self._hostile_step(worker)
            else:
                self._honest_step(worker)
                if self.profile.quota_hold and self.qrng.random() < self.profile.quota_hold:
                    self._hold_quota(worker)
            if worker.ops_left is not None:
                worker.ops_left -= 1
                if worker.ops_left <= 0 and worker.alive:
                    self._depart(worker)
                    return
            pause = self.rng.choice([0.01, 0.05, 0.3, 2.0, 20.0])
            self.world.after_ms(self.rng.uniform(0, pause), lambda: self._act(worker))
        elif not worker.hostile:
            self._poll(worker)

    def _depart(self, worker: Worker) -> None:
        """A short-lived worker leaves: half of them close (a Bye), the others are killed.
        Its idle timers stay armed; its slot must not outlive it (docs/contracts.md: freed
        at once after a Bye, else resume_grace_s after the session ended)."""
        # its timers and what was sent to it may wait for its resume grace and an ack
        # timeout from now on, past the moment the wind-down counted as settled
        self._left_while_settling |= self.fault_free
        if self.xrng.random() < 0.5:
            worker.alive = False
            end = worker.client._end
            unread = end is None or end.connection.daemon.closed  # its session's daemon died
            if not worker.hostile and (not worker.client.connected or unread or self.daemon is None
                                       or not self.daemon.alive):
                # no daemon to read them: the acknowledgements close() pushes stay in a ring
                # nobody will drain, as a crashed worker's (docs/contracts.md, at-least-once;
                # so do those pushed since its session's daemon died: its ring is not handed back)
                self.history.crashed(worker.ident, self.world.now_ns)
            try:
                worker.client.close()
            except WheeldError:
                worker.client.crash()
            self.faults["short-lived worker left (Bye)"] += 1
            self.history.left(worker.ident, self.world.now_ns)
            self.note(f"worker {worker.ident} left with a Bye")
        else:
            self._kill_worker(worker)
            self.faults["short-lived worker left (killed)"] += 1

    def _key(self, worker: Worker, rng: random.Random | None = None, fresh: bool = False) -> str:
        rng = self.rng if rng is None else rng
        if not fresh and worker.keys and rng.random() < 0.4:
            return rng.choice(worker.keys)
        key = f"c{worker.ident}-{len(worker.keys)}"
        worker.keys.append(key)
        return key

    def _delay(self, rng: random.Random | None = None) -> int:
        rng, top = self.rng if rng is None else rng, self.profile.max_delay_ms
        roll = rng.random()
        if roll < 0.5:
            return rng.randint(0, min(top, 20))
        if roll < 0.9:
            return rng.randint(0, min(top, 500))
        return rng.randint(0, top)

    def _honest_step(self, worker: Worker, rng: random.Random | None = None, poll: bool = True) -> None:
        """One call of a worker's application, chosen with ``rng`` (the run's by default);
        ``poll=False``: anything but a poll."""
        rng = self.rng if rng is None else rng
        client, history, now = worker.client, self.history, self.world.now_ns
        roll = rng.random()
        try:
            if worker.kind == "churn" and roll < 0.6 and client.max_delay_ms:
                # a connection's idle timer, with the long idle time of a keep-alive
                key, idle = self._key(worker), self.xrng.randint(60_000, 600_000)
                client.add_idle(key, idle)
                worker.idle_keys.add(key)
                self._armed(worker, key, now, idle, idle=True)
                if self.xrng.random() < 0.5:
                    number = client.flush()
                    worker.flushes[number] = history.flush_called(worker.ident)
                return
            if roll < 0.35:
                key, delay = self._key(worker, rng), self._delay(rng)
                client.add(key, delay)
                worker.idle_keys.discard(key)
                self._armed(worker, key, now, delay, idle=False)
            elif roll < 0.45:
                key, idle = self._key(worker, rng), rng.randint(1, min(self.profile.max_delay_ms, 2000))
                client.add_idle(key, idle)
                worker.idle_keys.add(key)
                self._armed(worker, key, now, idle, idle=True)
            elif roll < 0.6 and worker.idle_keys:
                key = rng.choice(sorted(worker.idle_keys))
                try:
                    client.touch(key)
                    history.touched(worker.ident, key, now)
                    self.note(f"w{worker.ident} touch {key}")
                except InvalidKey:  # its expiration was handed over: no longer armed
                    worker.idle_keys.discard(key)
            elif roll < 0.7 and worker.keys:
                key = rng.choice(worker.keys)
                hit = client.cancel(key)
                worker.idle_keys.discard(key)
                history.cancelled(worker.ident, key, now, hit)
                self.note(f"w{worker.ident} cancel {key} -> {hit}")
            elif roll < 0.85:
                number = client.flush()
                covered = history.flush_called(worker.ident)
                worker.flushes[number] = covered
                self.note(f"w{worker.ident} flush #{number}")
            elif poll and (worker.kind != "hoarder" or self.xrng.random() < 0.1):  # a hoarder polls late
                self._poll(worker)
        except InvalidDelay:
            if client.max_delay_ms:
                raise
            # the simulated connect() returns before the Welcome (which says the daemon's
            # maximum delay); a real connect() returns after it: no application gets here
            self.faults["call before the Welcome"] += 1
        except RingFull:
            self.faults["RingFull raised to a worker"] += 1
        except (ArenaFull, QuotaExceeded):
            self.faults["ArenaFull or QuotaExceeded raised at once"] += 1
        except InvalidRequest as exc:  # the touch table is full: an application error, refused at once
            if "idle-timer slots" not in str(exc):
                raise
            self.faults["touch table full"] += 1
        except (BrokenPeer, Closed, DaemonNotRunning) as exc:
            self.note(f"worker {worker.ident}: {exc!r}")

    def _hold_quota(self, worker: Worker) -> None:
        """``worker``'s application keeps its group at the --group-quota. Its connections
        are busy at their idle boundary: it touches the idle keys whose timers the daemon
        has fired (their expirations not read yet: its library re-arms them, see
        ``_lose_after_rearm``) and polls; then it tops the group up with a few far-off
        timers on new keys, half of them idle ones, until its ring's group_full word says
        the group is full or an add is refused at once."""
        client, q, top = worker.client, self.qrng, self.profile.max_delay_ms
        seg, now = client._segment, self.world.now_ns
        if seg is None or client._welcome is None or not client.max_delay_ms:
            return
        self.faults["group topped up to its quota"] += 1
        for key in self._fired_idle_keys(worker):
            try:
                client.touch(key)
            except InvalidKey:  # its expiration was handed over: no longer armed
                worker.idle_keys.discard(key)
                continue
            self.history.touched(worker.ident, key, now)
            self.note(f"w{worker.ident} touch {key} (fired)")
        self._poll(worker)
        if not worker.alive or client is not worker.client or client._segment is None:
            return
        seg = client._segment
        for _ in range(q.randint(1, 8)):
            if seg.group_full:
                return
            key, ms, idle = self._key(worker, q, fresh=True), q.randint(max(1, top // 2), top), q.random() < 0.5
            try:
                if idle:
                    client.add_idle(key, ms)
                else:
                    client.add(key, ms)
            except (ArenaFull, QuotaExceeded):
                self.faults["ArenaFull or QuotaExceeded raised at once"] += 1
                return
            except InvalidRequest as exc:  # the touch table is full
                if "idle-timer slots" not in str(exc):
                    raise
                self.faults["touch table full"] += 1
                return
            except (RingFull, BrokenPeer, Closed, DaemonNotRunning) as exc:
                self.note(f"worker {worker.ident}: {exc!r}")
                return
            if idle:
                worker.idle_keys.add(key)
            else:
                worker.idle_keys.discard(key)
            self._armed(worker, key, now, ms, idle=idle)

    def _fired_idle_keys(self, worker: Worker) -> list[str]:
        """``worker``'s idle keys of which the daemon holds a fired record (read from its arena)."""
        daemon = self.daemon
        wheel = getattr(daemon.core, "wheel", None) if daemon is not None and daemon.alive else None
        if wheel is None or not worker.idle_keys:
            return []
        keys = set()
        for slot in wheel.fired_slots():
            try:
                key = wheel.fired(slot)[0]
            except (ValueError, UnicodeDecodeError):  # a damaged record
                continue
            if key in worker.idle_keys:
                keys.add(key)
        return sorted(keys)

    def _lose_after_rearm(self, worker: Worker) -> None:
        """``worker``'s library re-armed an idle timer touched after it fired (the ACK of its
        copy, an ADD_IDLE behind it): the daemon is killed at once, before it reads the two,
        and the arena is lost, most times while the group holds its quota. The daemon that
        rebuilds the arena from the journal ignores the ACK (it names the lost arena) and
        restores the fired record, which counts towards the quota the re-arm meets."""
        daemon = self.daemon
        if self.fault_free or daemon is None or not daemon.alive:
            return
        wheel = getattr(daemon.core, "wheel", None)
        gid = next((g for g, name in wheel.groups().items() if name == worker.group), None) if wheel else None
        at_quota = gid is not None and wheel.group_live(gid) >= self.profile.group_quota
        if self.qrng.random() >= (0.7 if at_quota else 0.2):
            return
        self.faults["daemon killed after a library re-arm" + (" at the quota" if at_quota else "")] += 1
        self.kill_daemon(counted=False, lose_arena=True)

    def _armed(self, worker: Worker, key: str, now: int, ms: int, idle: bool) -> None:
        """``worker``'s application armed ``key`` (``add`` or ``add_idle``, ``ms`` its delay
        or idle time) at ``now``: the history learns of the arming its library made."""
        tag = _latest_tag(worker.client, key)
        self.history.armed(worker.ident, key, tag, now, ms, idle=idle)
        if self.tracing:
            self.note(f"w{worker.ident} {'add_idle' if idle else 'add'} {key} {ms} tag {tag}")

    def _resolve_tag(self, key, tag: int) -> int:
        """The tag the application armed, for one a library re-armed an idle timer with: the
        library of the key's owner (``c<id>-<n>``: only it re-arms its idle keys), whichever
        member of the group is handed the expiration."""
        owner = int(key.split("-", 1)[0][1:]) if isinstance(key, str) and key.startswith("c") and "-" in key else None
        worker = self._by_ident.get(owner) if owner is not None else None
        return worker.client.resolve_tag(tag) if worker is not None else tag

    def _received(self, key: bytes, tag: int, fired_ms: int) -> None:
        """A library read a copy of the expiration of arming ``tag`` of ``key`` (handed or not:
        it may die with a member that never polls): the checker learns when the daemon first
        fired it, which a later copy sent again to another member no longer says."""
        self.history.received(key.decode("utf-8", "replace"), tag, fired_ms * MS)

    def _idle_rearmed(self, worker: Worker, key, tag: int) -> None:
        """``worker``'s library took in an expiration of its idle ``key`` (arming ``tag``) that
        was touched since it fired: it acknowledges that copy and arms the key again."""
        original = self._resolve_tag(key, tag)
        worker.rearmed = True
        self.history.idle_rearmed(worker.ident, key, original, self.world.now_ns)
        self.note(f"w{worker.ident} library re-armed {key} tag {tag}->{original} (touched since it fired)")

    def _poll(self, worker: Worker) -> None:
        if not worker.alive or worker.hostile or not worker.started:
            return
        worker.rearmed = False
        try:
            polled = worker.client.poll()
        except (BrokenPeer, DaemonNotRunning, Closed) as exc:
            self.note(f"worker {worker.ident} poll: {exc!r}")
            if worker.client._welcome is None and worker.client._closed:  # the first connect failed late
                worker.started = False
                self._connect_again(worker)
            return
        except WheeldError as exc:
            self.note(f"worker {worker.ident} poll raised {exc!r}")
            self._refused(worker, exc)
            return
        now, history = self.world.now_ns, self.history
        number = worker.client.hands - len(polled.expired)
        for expired, tag in zip(polled.expired, worker.client.handed_tags):
            original = self._resolve_tag(expired.key, tag)
            history.handed(worker.ident, expired.key, original, now,
                           history.first_fired_ns(expired.key, tag, expired.fired_ms * MS),
                           number=number, copy_fired_ns=expired.fired_ms * MS)
            number += 1
            if self.tracing:
                self.note(f"w{worker.ident} handed {expired.key} tag {tag}->{original} "
                          f"deadline {expired.deadline_ms} fired {expired.fired_ms} late {expired.late}")
            worker.idle_keys.discard(expired.key)
        worker.client.handed_tags.clear()
        if polled.flushed:
            self._flushes_answered(worker, polled.flushed)
        if worker.rearmed and self.profile.quota_hold:
            self._lose_after_rearm(worker)

    def _flushes_answered(self, worker: Worker, flushed: list) -> None:
        for number, outcome in flushed:
            covered = worker.flushes.pop(number, None)
            if covered is None:
                continue
            self.note(f"w{worker.ident} flush #{number} answered: {outcome!r}")
            refused = {seq for seq, code in worker.client.flush_rejections.pop(number, ())
                       if code != "journal_unavailable"}
            if refused:  # never applied: not acknowledged by this flush nor any later one
                covered = [item for item in covered if getattr(item, "tag", None) not in refused]
            if outcome is None:
                self._flush_answered(covered)
            else:
                self.faults[f"flush failed: {type(outcome).__name__}"] += 1
                # what it covered stays unacknowledged; a later flush that succeeds covers it
                self.history.pending_commands.setdefault(worker.ident, [])[:0] = covered

    def _flush_answered(self, covered: list) -> None:
        self.history.flushed(covered, self.world.now_ns)

    def _refused(self, worker: Worker, exc: WheeldError) -> None:
        """A worker's poll raised ``exc``: a refusal of its first connect closes its client."""
        if isinstance(exc, BackPressure) and "too many clients" in str(exc):
            self._check_admission(str(exc))
        if worker.client.closed_session and not worker.client._welcome and worker.kind == "churn":
            worker.alive = False  # a short-lived worker refused gives up
        elif worker.client.closed_session and not worker.client._welcome:
            # a refused first connect closes the client; the application tries again later
            worker.backoff_ms = min(5000.0, worker.backoff_ms * 2)
            worker.client = SimClient(worker._dial, self.world.clock_ns, group=worker.group, pid=worker.pid,
                                      reconnect_timeout_s=10 ** 6, connect_timeout_s=10 ** 6)
            worker.client.on_received = self._received
            worker.started = False
            worker.retrying = True
            self.world.after_ms(self.xrng.uniform(0.5, 1) * worker.backoff_ms, lambda: self._connect(worker))

    def _check_admission(self, refusal: str) -> None:
        """A client refused for want of a slot: docs/contracts.md and README (client slots): a
        slot is held by a client with a session, by one that left without a Bye for
        resume_grace_s (collected every GC_INTERVAL_MS), and while its ring still holds
        commands; never by its timers alone. A refusal while fewer slots than --max-clients
        are held so is a slot that outlived its client."""
        self.faults["client refused: too many clients"] += 1
        daemon = self.daemon
        if daemon is None or not daemon.alive:
            return
        core = daemon.core
        now = core.clock()
        grace_ms = self.config.resume_grace_s * 1000 + 2 * GC_INTERVAL_MS
        held = 0
        for cs in core.clients.values():
            waiting = cs.session is not None or now - cs.orphan_since < grace_ms
            if not waiting and cs.segment is not None:
                try:
                    waiting = bool(cs.segment.depth())
                except Exception:  # noqa: BLE001 - a ring the client damaged: not a reason to hold it
                    waiting = False
            held += waiting
        if held < self.config.max_clients:
            self.violations.append(Violation(
                "admission", f"a client was refused ({refusal}) while only {held} of {self.config.max_clients} "
                             f"slots belong to clients that are connected, may still come back or left commands"))

    def _in_library(self, ident: int, key: str) -> bool:
        for worker in self.workers:
            if worker.ident == ident:
                return any(e.key == key for e in worker.client._ready)
        return False

    def _hostile_step(self, worker: Worker) -> None:
        rng, client = self.rng, worker.client
        segment = client._segment
        roll = rng.random()
        self.faults["hostile writes"] += 1
        try:
            if segment is not None and roll < 0.6:
                record = bytearray(rng.getrandbits(8 * C.RECORD_SIZE).to_bytes(C.RECORD_SIZE, "little"))
                if rng.random() < 0.7:  # a valid opcode with hostile fields: the interesting ones
                    record[0] = rng.choice([C.ADD, C.ADD_IDLE, C.CANCEL, C.ACK, C.FLUSH])
                segment.try_push_record(bytes(record))
                client._ring_doorbell()
            elif segment is not None and roll < 0.8 and segment.touch_capacity:
                segment.touch(rng.randrange(segment.touch_capacity), rng.getrandbits(64) - (1 << 63))
            elif client._end is not None:
                client._end.send(rng.getrandbits(8 * 24).to_bytes(24, "little"))
        except (OSError, WheeldError, ValueError):
            pass

    def _crafted_step(self, worker: Worker) -> None:
        """A hostile client writing well-formed records (they pass the checks every record
        must) with the values a hostile client chooses: deadlines at and past the edges of the
        accepted range, idle timers whose touch words and idle words it then overwrites. The
        contract: nothing a client writes into its own memory harms the daemon or other groups
        (docs/contracts.md, README "Security model")."""
        segment = self._hostile_ring(worker, "hostile crafted records")
        if segment is None:
            return
        x, client, now = self.xrng, worker.client, self.world.clock_ms()
        capacity = segment.touch_capacity
        roll = x.random()
        try:
            if roll < 0.6:
                # a burst of adds whose deadlines sit at the edges of the range (far past
                # first: they fire at once, and their lateness is counted)
                for _ in range(x.randint(1, 16)):
                    key, meta = encode_key(f"h{worker.ident}-{x.randrange(256)}")
                    deadline = x.choice([now - MAX_DELAY_MS + x.randint(0, 1000)] * 4 + [
                        now - MAX_DELAY_MS - x.randint(1, 1000), now + MAX_DELAY_MS - x.randint(0, 1000),
                        now + MAX_DELAY_MS + x.randint(1, 1000), -(1 << 63), (1 << 63) - 1,
                        now - x.randint(0, 1 << 40)])
                    if not segment.try_push(C.ADD, key, meta, deadline, x.getrandbits(32)):
                        break
            elif roll < 0.65:
                self._shrink_ring(worker, segment)
            elif roll < 0.85 and capacity:
                index = x.randrange(capacity)
                idle = x.choice([1, 50, 1000, 2**31 - 1])
                key, meta = encode_key(f"h{worker.ident}-i{x.randrange(64)}")
                segment.set_idle(index, idle)
                segment.touch(index, now)
                segment.try_push(C.ADD_IDLE, key, meta, now + x.randint(0, 100), x.getrandbits(32), idle, index)
            elif capacity:
                index = x.randrange(capacity)
                segment.touch(index, x.choice([(1 << 63) - 1, 1 << 62, now + x.randint(2, 10**6), -(1 << 63),
                                               now - x.randint(0, 1 << 46), x.getrandbits(64) - (1 << 63), now]))
                if x.random() < 0.5:
                    segment.set_idle(index, x.choice([(1 << 63) - 1, 1 << 40, MAX_IDLE_MS, MAX_IDLE_MS + 1, -1]))
            client._ring_doorbell()
        except (OSError, WheeldError, ValueError, OverflowError):
            pass

    def _shrink_ring(self, worker: Worker, segment) -> None:
        """The client cuts its ring's memfd to half its size under the daemon's mapping. The
        memfd is sealed against resizing (docs/contracts.md: "client segments are sealed
        memfds"), so this fails. Were it to succeed, the daemon's next access of the mapping
        would die of SIGBUS: the simulator (one process) records that as the daemon's death,
        puts the size back before anything touches the pages, and kills the daemon."""
        fd = segment.fd
        size = os.fstat(fd).st_size
        try:
            os.ftruncate(fd, size // 2)
        except OSError:
            self.faults["ring shrink refused (sealed)"] += 1
            return
        os.ftruncate(fd, size)
        self.faults["ring shrunk under the daemon"] += 1
        daemon = self.daemon
        if daemon is not None and daemon.alive:
            self.violations.append(Violation(
                "sigbus", f"client {worker.ident} cut its ring memfd from {size} to {size // 2} bytes under the "
                          f"daemon's mapping: the daemon's next access of it dies of SIGBUS"))
            self.kill_daemon(counted=False)

    def _hostile_ring(self, worker: Worker, fault: str):
        """The ring a hostile worker writes into (None before its first Welcome), the fault counted."""
        segment = worker.client._segment
        if segment is not None:
            self.faults[fault] += 1
        return segment

    def _flood_step(self, worker: Worker) -> None:
        """A client that fills its ring with commands that are answered (adds the daemon
        refuses, and FLUSHes) and never reads its socket."""
        segment = self._hostile_ring(worker, "hostile ring floods")
        if segment is None:
            return
        x, client, now = self.xrng, worker.client, self.world.clock_ms()
        try:
            for _ in range(segment.ring_capacity):
                if x.random() < 0.8:
                    key, meta = encode_key(f"f{worker.ident}-{x.randrange(1 << 20)}")
                    pushed = segment.try_push(C.ADD, key, meta, now + MAX_DELAY_MS + 10**6, x.getrandbits(32))
                else:
                    pushed = segment.try_push(C.FLUSH, seq=x.getrandbits(32))
                if not pushed:
                    break
            client._ring_doorbell()
        except (OSError, WheeldError, ValueError):
            pass

    def _check_answers(self, session) -> None:
        """docs/contracts.md ("Answers are bounded per session"): the answers one session
        holds unread stay under ANSWER_BOUND."""
        if self._memory_flagged or session.closed:
            return
        queued = session.answers_queued()
        if queued > ANSWER_BOUND:
            self._memory_flagged = True
            self.violations.append(Violation(
                "memory", f"the daemon holds {queued} bytes of answers unread by client pid {session.pid} "
                          f"(the bound is {ANSWER_BOUND}); {len(session.out)} bytes in its output buffer"))

    # ------------------------------------------------------------------ faults
    def _faults(self) -> None:
        if self.fault_free:
            return
        rng, p = self.rng, self.profile
        if p.daemon_crash and rng.random() < p.daemon_crash * (1 - p.crash_inside):
            self.kill_daemon()
        if p.reboot and rng.random() < p.reboot:
            self.reboot()
            return
        if p.worker_crash and rng.random() < p.worker_crash:
            live = [w for w in self.workers if w.alive]
            if live:
                self._kill_worker(rng.choice(live))
        if p.disk_fault and rng.random() < p.disk_fault:
            operation = rng.choice(["write", "fsync", "fdatasync"])
            self.disk.fail_next(operation, rng.choice([errno.EIO, errno.ENOSPC]))
            self.faults[f"disk {operation} failed"] += 1
        x = self.xrng
        if p.disk_full and self.disk.capacity is None and x.random() < p.disk_full:
            self.disk.capacity = self.disk.used_bytes() + x.randint(0, 4096)
            self.faults["journal disk full"] += 1
            self.note("the journal's disk is full")
            self.world.after_ms(x.uniform(5, 3000), self._disk_freed)
        if p.hoarders and p.worker_crash and x.random() < 0.02:
            live = [w for w in self.workers if w.alive and w.kind == "hoarder" and w.client._ready]
            if live:  # a worker holding expirations its application has not polled yet
                self.faults["hoarder killed"] += 1
                self._kill_worker(x.choice(live))
        if p.churn and x.random() < p.churn:
            groups = GROUPS[: max(1, min(len(GROUPS), p.workers))]
            self.spawn(x.choice(groups), kind="churn")
            self.faults["short-lived worker started"] += 1
        if p.cut and self.crng.random() < p.cut:
            self._cut_session()

    def _cut_session(self) -> None:
        """The daemon closes a live honest worker's session, as it closes one that stopped
        reading its socket (Sessions.maintain), and runs on: the worker reconnects."""
        daemon = self.daemon
        if daemon is None or not daemon.alive:
            return
        open_ones = []
        for worker in self._honest:
            session = self.sessions.get(id(worker.connection)) if worker.connection is not None else None
            if worker.alive and session is not None and not session.closed and session.client is not None:
                open_ones.append((worker, session))
        if not open_ones:
            return
        worker, session = self.crng.choice(open_ones)
        self.faults["session cut by the daemon"] += 1
        self.note(f"the daemon cuts worker {worker.ident}'s session")
        self._cuts.setdefault(worker.ident, []).append(self.world.now_ns)
        self._core_call(daemon.core.sessions.close, session, "cut by the simulator (as a client that stopped reading)",
                        True)

    def _disk_freed(self) -> None:
        self.disk.capacity = None
        self.note("the journal's disk has room again")

    # ------------------------------------------------------------------ the network
    def _network(self) -> None:
        """Move what waits: new connections to the daemon, bytes both ways, closes. The daemon
        reads what a client sent (up to 8 chunks; EOF once it closed and all was read) and
        hears that it may send again; the answers it holds are checked (_check_answers)."""
        daemon = self.daemon
        live = daemon is not None and daemon.alive
        if live and self.listener.backlog:
            self._accept(daemon)
        rng = self.rng
        keep = []
        for connection in self.connections:
            end = connection.daemon
            session = self.sessions.get(id(connection)) if live else None
            if session is not None and daemon.alive:
                stream = connection.to_daemon
                # (what take_for_daemon returns None for: nothing to read, no EOF to report)
                if not end.closed and (stream.visible or (stream.writer_closed and not stream.size)):
                    for _ in range(8):
                        got = connection.take_for_daemon()
                        if got is None:
                            break
                        data, fds = got
                        self._core_call(daemon.core.received, session, data, fds)
                        if not daemon.alive or not data or end.closed:
                            break
                if daemon.alive and end.wants_writable and connection.writable_due():
                    self._core_call(daemon.core.writable, session)
                if daemon.alive and not self._memory_flagged and not session.closed:
                    self._check_answers(session)
            to_client = connection.to_client
            if to_client.hold and to_client.size > to_client.visible:
                connection.deliver(rng.choice([1, 64, 4096]))
            if end.closed and connection.client.closed:
                self.sessions.pop(id(connection), None)
                continue
            keep.append(connection)
        self.connections = keep

    def _accept(self, daemon: SimDaemon) -> None:
        """Hand each new connection to the daemon."""
        while True:
            connection = self.listener.accept()
            if connection is None:
                break
            pid, uid, gid = connection.peer
            session = self._core_call(daemon.core.connected, connection.daemon, pid, uid, gid)
            if session is not None:
                self.sessions[id(connection)] = session

    def _network_busy(self) -> bool:
        """Whether bytes wait to move: for the daemon, for a slow reader (not delivered yet),
        or for a client whose daemon asked to hear that it can send again, and can."""
        for connection in self.connections:
            to_client = connection.to_client
            if connection.to_daemon.size or (to_client.hold and to_client.size > to_client.visible):
                return True
            end = connection.daemon
            if end.wants_writable and not end.closed and to_client.room() > 0:  # (writable_due)
                return True
        return False

    def _stuck(self, since_ns: int) -> None:
        """No worker's application made an operation for STUCK_NS of simulated time while
        the world still ran: every worker left alive waits on something that never comes
        (a connect never answered nor timed out, a daemon that never serves it). The run
        ends with a violation rather than running for ever."""
        waiting = [f"w{w.ident} (welcome {w.client._welcome is not None}, handshake {w.client._attempt is not None})"
                   for w in self.workers if w.alive and not w.hostile]
        self.violations.append(Violation(
            "stuck", f"no operation since {since_ns / 1e6:.3f} ms ({self.ops} of {self.ops_target} done); "
                     f"workers alive: {', '.join(waiting) or 'none'}"))

    def _core_call(self, action, *args):
        try:
            return self._guard(action, *args)
        except BaseException as exc:  # noqa: BLE001 - every raise of the core is a finding or a crash fault
            self._daemon_raised(exc)
            return None

    def _settle(self) -> None:
        """After each event: the network moves, and workers with something to read poll (a
        worker's event loop sees its socket readable)."""
        self._network()
        dead = False
        for worker in self._honest:
            if not worker.alive:
                dead = True
            elif worker.started and (worker.kind == "hoarder" or (
                    worker.connection is not None and worker.connection.to_client.visible)):
                self._settle_worker(worker)  # (no other worker has anything to do)
        if dead:
            self._honest = [w for w in self._honest if w.alive]
        if not self._net_due and (self.listener.backlog or self._network_busy()):
            self._net_due = True
            self.world.after_ms(self.rng.choice([0.005, 0.02, 0.1]), self._net_tick)

        runner = self.runner
        if runner is not None and runner.queue and not self._background_due:
            # the journal's helper thread finishes its task a little later
            self._background_due = True
            self.world.after_ms(self.rng.choice([0.05, 0.5, 3.0, 20.0]) * self.rng.random(),
                                lambda: self._background(runner))

    def _settle_worker(self, worker: Worker) -> None:
        """A live, started honest worker whose socket is readable reads: a hoarder's library
        (connecting again on its own when cut), the others' application polls."""
        connection, client = worker.connection, worker.client
        if worker.kind == "hoarder" and not client._closed and (
                (connection is not None and connection.to_client.writer_closed) or not client.connected):
            try:  # its library connects again on its own (as the asyncio client's reader does)
                client.receive()
            except WheeldError as exc:
                self.note(f"worker {worker.ident} receive: {exc!r}")
                self._refused(worker, exc)
            return
        if connection is not None and connection.to_client.visible and not client._closed:
            if worker.kind == "hoarder":  # its library reads; its application polls later
                try:
                    client.receive()
                except WheeldError as exc:
                    self.note(f"worker {worker.ident} receive: {exc!r}")
                    self._refused(worker, exc)
                self._flush_then_die(worker)
                # its application's flush() returned when the answer came (only the
                # simulated flush hands its outcome over with a poll)
                flushed, worker.client._flushed = worker.client._flushed, []
                self._flushes_answered(worker, flushed)
            else:
                self._poll(worker)

    def _background(self, runner: SimRunner) -> None:
        self._background_due = False
        if runner is self.runner:
            runner.run_next()

    def _net_tick(self) -> None:
        self._net_due = False

    # ------------------------------------------------------------------ the run
    def run(self) -> Result:
        world, p = self.world, self.profile
        with client_clock(world.clock_ns):
            try:
                self.start_daemon()
                groups = GROUPS[: max(1, min(len(GROUPS), p.workers))]
                for index in range(p.workers):
                    kind = "hoarder" if index >= p.workers - p.hoarders else ""
                    self.spawn(groups[index % len(groups)], slow=index < p.slow_readers, kind=kind)
                for _ in range(p.hostile):  # a uid of its own: it cannot join the honest groups
                    self.spawn(HOSTILE_GROUP, hostile=True)
                for _ in range(p.crafted):
                    self.spawn(HOSTILE_GROUP, hostile=True, kind="crafted")
                for _ in range(p.flooder):
                    self.spawn(HOSTILE_GROUP, hostile=True, kind="flooder")
                progress_ops, progress_ns = self.ops, world.now_ns
                while self.ops < self.ops_target and world.step():
                    self._settle()
                    if self.ops != progress_ops:
                        progress_ops, progress_ns = self.ops, world.now_ns
                    elif world.now_ns - progress_ns > STUCK_NS:
                        self._stuck(progress_ns)
                        break
                self._wind_down()
            finally:
                self._close()
        end = world.now_ns
        settled = None if self._left_while_settling else self._settled_ns
        history = self.history
        history.ack_timeout_ns = int(self.config.ack_timeout_s * 1e9)
        history.resume_grace_ns = int(self.config.resume_grace_s * 1e9)
        for worker in self.workers:
            if not worker.hostile:
                history.ack_marks[worker.ident] = worker.client.ack_marks
                history.session_ends[worker.ident] = sorted(worker.client.session_ends
                                                            + self._cuts.get(worker.ident, []))
                history.new_arena_welcomes[worker.ident] = worker.client.new_arena_welcomes
        self.violations += check(self.history,
                                 end - int((self.config.ack_timeout_s + self.config.resume_grace_s) * 1000) * MS,
                                 settled_ns=settled,
                                 late_bound_ns=LATE_BOUND_MS * MS,
                                 fire_bound_ns=FIRE_LATE_BOUND_MS * MS, idle_late=self._arena_damaged)
        acked = sum(1 for a in self.history.armings.values() if a.acked)
        handed = sum(len(a.handed) for a in self.history.armings.values())
        return Result(self.seed, p, self.ops, self.violations, self.faults, world.events_run, end // MS,
                      handed, acked, self.trace, history.deaths_between_hand_and_ack())

    def _wind_down(self) -> None:
        """No more faults: a daemon up, a live member in every group, pending background work
        done, then the clock runs past every deadline, the ack timeout and the resume grace
        (plus a pass of the slot collection: a slot whose client is gone is freed by then,
        and what waited on it has moved on) while the workers flush and poll."""
        world = self.world
        if any(v.rule == "no-daemon" for v in self.violations):
            return  # the service is down for good: nothing more to see
        self.fault_free = True
        self.disk.capacity = None
        if self.runner is not None:
            self.runner.run_all()
        self.start_daemon()
        # sorted: a set of str iterates in an order that varies by process
        for group in sorted({w.group for w in self.workers if not w.hostile}):
            if not any(w.alive and w.group == group and not w.hostile for w in self.workers):
                self.spawn(group)
        for worker in self.workers:
            if worker.alive and not worker.hostile:
                world.after_ms(1, lambda w=worker: self._final_flush(w))
        last = max((a.earliest_ns for a in self.history.armings.values()), default=world.now_ns)
        # past every deadline, an ack timeout (a copy held by a member that died goes to
        # another), a resume grace and one slot collection (the idle timers of a client that
        # died, and what was sent to it, wait that long for it to come back)
        wait_ms = int((self.config.ack_timeout_s + self.config.resume_grace_s + 5) * 1000) + GC_INTERVAL_MS
        end = max(last, world.now_ns) + wait_ms * MS
        self._settled_ns = world.now_ns + wait_ms * MS  # from then on, every arming is held to the late bound
        tick = 250 * MS
        at = world.now_ns
        while at < end:
            at += tick
            world.at(at, self._poll_all)
        while world.step():
            self._settle()
            if world.now_ns > end:
                break
            if self.daemon is None or not self.daemon.alive:
                continue

    def _final_flush(self, worker: Worker) -> None:
        if not worker.alive:
            return
        try:
            if not worker.started or worker.client._segment is None:
                raise RingFull("not connected yet")
            number = worker.client.flush()
            worker.flushes[number] = self.history.flush_called(worker.ident)
        except WheeldError:
            self.world.after_ms(10, lambda: self._final_flush(worker))

    def _poll_all(self) -> None:
        for worker in self._honest:  # (_poll passes over the hostile ones)
            self._poll(worker)

    def _close(self) -> None:
        for worker in self.workers:
            if worker.alive:
                worker.alive = False
                worker.client.crash()
        if self.daemon is not None and self.daemon.alive:
            self._daemon_died(self.daemon)
        for connection in self.connections:
            connection.discard()
        self.shm.reboot()


def _holds_events(path: str) -> bool:
    """Whether a file of the journal's disk holds events (a segment, a snapshot), for the
    checker's ``History.writes`` and ``History.syncs``: the durable mark (and the temporary
    file it is first made under) holds none, and the journal writes it while it is stalled
    too (the fsync that collected the last good events advances it), so its bytes say
    nothing of a stall's end (``History._wrote_again``)."""
    return not posixpath.basename(path).startswith(MARK_NAME)


def _latest_tag(client: SimClient, key: str) -> int:
    shards = client._latest  # a key's arming is in shard hash(key) & (shards - 1) (64 of them)
    shard = shards[hash(key) & (len(shards) - 1)]
    if key in shard:
        return shard[key]
    for shard in shards:
        if key in shard:
            return shard[key]
    raise AssertionError(f"{key!r} has no arming in its client")


def _release_fds(core) -> None:
    """Close what a killed daemon process held (the kernel closes a dead process's descriptors)."""
    sessions = getattr(core, "sessions", None)
    for cs in list(getattr(core, "clients", {}).values()):
        segment = getattr(cs, "segment", None)
        if segment is not None:
            try:
                segment.close()
            except Exception:  # noqa: BLE001 - best effort, as the kernel's close
                pass
    if sessions is not None:
        for session in list(sessions.sessions):
            try:
                session.close_passed_fds(keep=0)
            except Exception:  # noqa: BLE001
                pass
    for thing in (getattr(core, "status", None), getattr(core, "wheel", None)):
        if thing is not None:
            try:
                thing.close()
            except Exception:  # noqa: BLE001
                pass
    table = getattr(sessions, "table", None) if sessions is not None else None
    if table is not None:
        try:
            table.close()
        except Exception:  # noqa: BLE001
            pass
    # a crash inside the core's fence leaves its lock (one per process) taken; in a real
    # daemon it dies with the process, here the next incarnation would wait
    fence_lock = core_module._FENCE_LOCK
    if fence_lock.locked():
        fence_lock.release()


def run_seed(seed: int, ops: int = 1000, trace: bool = False, profile: Profile | None = None,
             extra: bool = True, hold: bool = True, cut: bool = True) -> Result:
    """One seed's run; ``extra=False`` leaves out the newer workloads and faults (Profile.draw_extra),
    as the regression seeds found before them ran; ``hold=False`` only the groups held at their
    quota (Profile.draw_quota_hold), likewise; ``cut=False`` only the sessions the daemon cuts
    (Profile.draw_cut)."""
    return Simulation(seed, ops, profile=profile, trace=trace, extra=extra, hold=hold, cut=cut).run()
