"""One seed, one fleet: hosts replicating to a simulated NATS JetStream cluster, checked
against docs/fleet.md ("Guarantees").

:class:`FleetSimulation` builds, from a seed, a world (:class:`~sim.world.World`) with
two or three simulated **hosts**, each a machine of its own: a
:class:`~sim.disk.SimDisk` behind its journal, a :class:`~sim.shm.SimShm` behind its
``/dev/shm``, its socket, and a daemon process: the real core
(:class:`~sim.daemon.SimDaemon`) with ``--durability replicated``, whose shell holds a
real :class:`wheeld.fleet.replicator.Replicator` and :class:`wheeld.fleet.adopt.Adopter`
(``--adopt '*'``) running on a :class:`~sim.aioloop.SimLoop` (asyncio on the simulated
clock) over :mod:`sim.jetstream` (a three-server JetStream cluster, its key-value
lease bucket, and the network to it). Each host's workers run the real client library
(:class:`~sim.client.SimClient`): ``add`` (new keys and re-arms), ``cancel``,
``flush``, ``poll``, in groups every host shares.

Faults, per operation (their rates are the seed's :class:`FleetProfile`):

* a **host lost** (its daemon killed, its workers with it, its disk and ``/dev/shm``
  gone for good): a peer adopts its timers once its lease lapses;
* a host's daemon **paused** (SIGSTOP, a VM stall) for up to three lease TTLs, and
  resumed: adopted meanwhile, it must find out and stand down, delivering nothing;
* a host **cut off** from the cluster (a partition) for up to three TTLs;
* its daemon **killed** (SIGKILL: arena and journal kept) and restarted by systemd a
  while later (after more than a TTL it finds itself adopted and stands down);
* the adopting peer **killed in the middle of a takeover** (after its fence, before or
  after it put the timers into its arena);
* a NATS **server down** for a while (two down: no quorum), or **losing its disk**
  (while the two others hold every message), and the leader election a lost leader
  costs;
* the network: requests lost, answers lost after the request was applied, latency
  spikes of seconds (a request applied after its client gave up);
* a worker killed (replaced by a new one);
* a live worker's session cut by its host's daemon, which runs on (as it cuts a client
  that stopped reading its socket); its rate from a generator of its own
  (:meth:`FleetProfile.draw_cut`), so ``cut=False`` runs a seed as before.

Then the faults stop: the cluster is whole, partitions heal, paused daemons resume,
every host that still serves has a live member in every group, and the clock runs past
every deadline, two lease TTLs (a lost host is adopted) and the ack timeout while the
workers poll. :func:`~sim.fleet_checker.check` reads the history; the rules about
leases and fences are checked as the run goes (:meth:`FleetSimulation._sent`,
:meth:`FleetSimulation._adopting`, ``Cluster.after_fence``).

Deterministic: the world's generator decides the workload, the cluster's its own, and
the loops run on the world's clock (:mod:`sim.aioloop`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import random
import sys
import traceback
from collections import Counter
from dataclasses import dataclass, field

from wheeld.daemon.config import Config
from wheeld.daemon.host import Host
from wheeld.fleet.adopt import Adopter
from wheeld.fleet.replicator import FleetConfig, Replicator
from wheeld.protocol.errors import (ArenaFull, BrokenPeer, Closed, DaemonNotRunning, InvalidDelay, QuotaExceeded,
                                    RingFull, WheeldError)

from .aioloop import SimLoop
from .checker import Violation
from .client import SimClient, SimListener, client_clock
from .daemon import Crash, SimDaemon
from .disk import SimDisk
from .fleet_checker import FleetHistory, check
from .jetstream import Cluster, Connection, LeaseWatch, NetProfile, connector
from .runner import SimRunner
from .run import _latest_tag, _release_fds
from .shm import SimShm
from .world import SimRandom, SimUsers, World

__all__ = ["FleetProfile", "FleetResult", "FleetSimulation", "run_fleet_seed"]

MS = 1_000_000
JOURNAL_DIR = "/var/lib/wheeld/fleet"
GROUPS = ("g0", "g1")
WORKER_UID = 1000
HOST_IDS = tuple("ABCDEFGHIJKLMNOP")


@dataclass
class FleetProfile:
    """What one seed runs: the fleet's settings and the rate of every fault (per operation)."""

    hosts: int = 3
    workers: int = 2  # per host
    ttl_s: float = 4.0
    publish_timeout_s: float = 0.5
    replicate_timeout_s: float = 2.0
    max_delay_ms: int = 20_000
    net: NetProfile = field(default_factory=NetProfile)
    host_loss: float = 0.0
    pause: float = 0.0
    partition: float = 0.0
    daemon_kill: float = 0.0
    takeover_kill: float = 0.0  # per takeover: the adopting peer killed in the middle of it
    node_crash: float = 0.0
    disk_loss: float = 0.0
    worker_crash: float = 0.0
    # drawn apart (draw_cut), from a generator of its own: the fleet seeds found before it
    # run as they did with cut=False
    cut: float = 0.0  # per operation: a host's daemon closes a live worker's session and runs on

    @classmethod
    def draw(cls, rng: random.Random) -> FleetProfile:
        p = cls()
        p.hosts = rng.choice([2, 3, 3])
        p.workers = rng.choice([1, 2, 3])
        p.ttl_s = rng.choice([2.0, 4.0, 10.0])
        p.publish_timeout_s = p.ttl_s * rng.choice([0.05, 0.125, 0.25])
        p.replicate_timeout_s = rng.choice([1.0, 5.0])
        p.max_delay_ms = rng.choice([2_000, 20_000, 60_000])
        p.net = NetProfile(latency_ms=rng.choice([0.1, 0.5, 2.0]), spike=rng.choice([0.0, 0.0, 0.002, 0.01]),
                           lose_request=rng.choice([0.0, 0.0, 0.002, 0.01]),
                           lose_answer=rng.choice([0.0, 0.0, 0.002, 0.01]), no_responders=rng.choice([0.0, 0.5]))
        p.host_loss = rng.choice([0.0, 0.001, 0.003])
        p.pause = rng.choice([0.0, 0.001, 0.003])
        p.partition = rng.choice([0.0, 0.001, 0.003])
        p.daemon_kill = rng.choice([0.0, 0.001, 0.003])
        p.takeover_kill = rng.choice([0.0, 0.0, 0.3])
        p.node_crash = rng.choice([0.0, 0.002, 0.005])
        p.disk_loss = rng.choice([0.0, 0.001, 0.003])
        p.worker_crash = rng.choice([0.0, 0.002])
        return p

    def draw_cut(self, rng: random.Random) -> None:
        """The rate of sessions a daemon cuts (sim/run.py's Profile.draw_cut): it closes a
        live worker's session as it closes a client that stopped reading its socket."""
        self.cut = rng.choice([0.0, 0.0, 0.003, 0.01])

    def describe(self) -> str:
        n = self.net
        rates = [(name, value) for name, value in (
            ("host loss", self.host_loss), ("pause", self.pause), ("partition", self.partition),
            ("daemon kill", self.daemon_kill), ("takeover kill", self.takeover_kill),
            ("server crash", self.node_crash), ("server disk loss", self.disk_loss),
            ("worker crash", self.worker_crash), ("session cut", self.cut),
            ("latency spike", n.spike), ("request lost", n.lose_request),
            ("answer lost", n.lose_answer), ("no responders", n.no_responders)) if value]
        return (f"{self.hosts} hosts x {self.workers} workers, lease TTL {self.ttl_s} s, publish timeout "
                f"{self.publish_timeout_s} s, flush timeout {self.replicate_timeout_s} s, delays <= "
                f"{self.max_delay_ms} ms, latency {n.latency_ms} ms" + "".join(f", {k} {v}" for k, v in rates))


@dataclass
class FleetResult:
    seed: int
    profile: FleetProfile
    ops: int
    violations: list[Violation]
    faults: Counter
    events: int
    sim_ms: int
    acked: int
    handed: int
    trace: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations


class _Process:
    """One daemon process of a host: its core, its event loop and what runs on it."""

    def __init__(self, host_id: str, pid: int, daemon: SimDaemon, loop: SimLoop, replicator: Replicator,
                 watch: LeaseWatch):
        self.host_id = host_id
        self.pid = pid
        self.daemon = daemon
        self.loop = loop
        self.replicator = replicator
        self.watch = watch
        self.connections: list[Connection] = []
        self.dead = False
        self.started_ns = 0
        self.loop_wake_ns: int | None = None
        self.loop_generation = 0


class SimHost:
    """One machine of the fleet (module docstring)."""

    def __init__(self, sim: FleetSimulation, ident: str):
        self.id = ident
        rng = random.Random(sim.rng.getrandbits(64))
        self.rng = rng
        self.disk = SimDisk(random.Random(rng.getrandbits(64)))
        self.shm = SimShm(random.Random(rng.getrandbits(64)))
        self.listener = SimListener()
        self.connections: list = []
        self.sessions: dict[int, object] = {}
        self.proc: _Process | None = None
        self.state = "up"  # up | lost | stood down
        self.paused = False
        self.restart_due = False
        self.pid = 100
        self.trouble_ns = -1  # the last moment it was paused or cut off from the cluster


class FleetWorker:
    """One worker process on a host: a client and what its application does."""

    def __init__(self, sim: FleetSimulation, host: SimHost, ident: int, group: str):
        self.sim = sim
        self.host = host
        self.ident = ident
        self.group = group
        self.pid = 20_000 + ident
        self.client = self._client()
        self.connection = None
        self.keys: list[str] = []
        self.flushes: dict[int, list] = {}
        self.alive = True
        self.started = False

    def _client(self) -> SimClient:
        return SimClient(self._dial, self.sim.world.clock_ns, group=self.group, pid=self.pid,
                         reconnect_timeout_s=10 ** 6, connect_timeout_s=10 ** 6)

    def _dial(self):
        end = self.host.listener.connect(self.pid, WORKER_UID, WORKER_UID)
        self.connection = end.connection
        self.host.connections.append(end.connection)
        return end


class _LogCollector(logging.Handler):
    """The daemon's and the fleet tier's log records during a run: into the trace (with
    --trace), and a programming error the fleet tier caught and logged (it keeps running:
    a retry loop, a warning) reported as a finding."""

    _BUGS = (AttributeError, TypeError, NameError, KeyError, IndexError, AssertionError, ZeroDivisionError,
             UnboundLocalError)

    def __init__(self, sim: FleetSimulation):
        super().__init__(logging.DEBUG)
        self.sim = sim
        self.last_exception = ""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 - a record whose arguments do not format
            text = str(record.msg)
        if record.exc_info and record.exc_info[1] is not None:
            self.last_exception = "".join(traceback.format_exception(record.exc_info[1]))
        if self.sim.tracing:
            self.sim.note(f"log {record.levelname} {record.name}: {text}")
        for arg in record.args if isinstance(record.args, tuple) else ():
            if isinstance(arg, self._BUGS):
                self.sim.flag("fleet-error", record.name, f"the fleet tier logged a programming error and went on: "
                                                          f"{text} ({type(arg).__name__})")


class FleetSimulation:
    """A run of one seed (module docstring)."""

    def __init__(self, seed: int, ops: int = 1000, profile: FleetProfile | None = None, trace: bool = False,
                 cut: bool = True):
        self.seed = seed
        self.world = World(seed)
        self.rng = self.world.rng
        self.crng = random.Random(seed * 19_000_003 + 47)  # the sessions the daemons cut
        if profile is None:
            profile = FleetProfile.draw(self.rng)
            if cut:  # (cut=False: the run as it was before draw_cut)
                profile.draw_cut(self.crng)
        self.profile = profile
        self.ops_target = ops
        self.ops = 0
        self.faults: Counter = Counter()
        self.killed: list = []  # every process ended: kept to the end of the run (_reap_killed)
        self.violations: list[Violation] = []
        self._flagged: set[tuple[str, str]] = set()
        self.history = FleetHistory()
        self.tracing = trace
        self.trace: list[str] = []
        self.cluster = Cluster(self.world, random.Random(seed * 1_000_033 + 7), dataclasses.replace(self.profile.net),
                               self.faults)
        if trace:
            self.cluster.on_note = self.note
        self.cluster.on_claim = self._claimed
        self.hosts = [SimHost(self, HOST_IDS[i]) for i in range(self.profile.hosts)]
        self.workers: list[FleetWorker] = []
        self.next_ident = 0
        self.fault_free = False
        # (lost host, peer, epoch claimed, peer process, when)
        self.adoptions: list[tuple[str, str, int, _Process, int]] = []
        self._net_due = False
        self._joining = False  # a new host is about to join (every other one gone)
        self._log: _LogCollector | None = None
        p = self.profile
        self.config = Config(
            socket_path="sim:wheeld", name=f"simf{seed}", capacity=4096, ring_capacity=1 << 10, touch_capacity=16,
            max_groups=64, journal_dir=JOURNAL_DIR, fsync="always", coalesce_us=500, max_park_ms=500,
            ack_timeout_s=10.0, resume_grace_s=15.0, durability="replicated",
            replicate_timeout_s=p.replicate_timeout_s)

    # ------------------------------------------------------------------ findings and the log
    def note(self, text: str) -> None:
        if self.tracing:
            self.trace.append(f"{self.world.now_ns / MS:14.3f} {text}")

    def flag(self, rule: str, where: str, text: str) -> None:
        """A finding (the first of each rule per host: one is enough to replay)."""
        if (rule, where) in self._flagged:
            return
        self._flagged.add((rule, where))
        self.violations.append(Violation(rule, f"at {self.world.now_ns / MS:.3f} ms: {text}"))
        self.note(f"VIOLATION [{rule}] {text}")

    # ------------------------------------------------------------------ daemons
    def _fleet_config(self, host: SimHost) -> FleetConfig:
        p = self.profile
        return FleetConfig(urls=("nats://sim-1:4222", "nats://sim-2:4222", "nats://sim-3:4222"), host_id=host.id,
                           lease_ttl_s=p.ttl_s, replicas=3, publish_timeout_s=p.publish_timeout_s, adopt=("*",),
                           connect_timeout_s=p.publish_timeout_s)

    def start_daemon(self, host: SimHost) -> None:
        """Start ``host``'s daemon (systemd's start, or its restart after a kill)."""
        host.restart_due = False
        if host.state != "up" or (host.proc is not None and not host.proc.dead):
            return
        host.pid += 1
        pid, world = host.pid, self.world
        port = Host(clock_ms=world.clock_ms, clock_ns=world.clock_ns, wall_ms=world.wall_ms,
                    wall_ns=lambda: world.wall_ms() * MS, fs=host.disk, runner=SimRunner(inline=True),
                    shm=host.shm.port(pid, 0, ()), users=SimUsers(), rng=SimRandom(host.rng), pid=pid, euid=0,
                    hostname=host.id, process_alive=lambda p, h=host: self._process_alive(h, p))
        config = dataclasses.replace(self.config, name=f"simf{self.seed}{host.id}", fleet=self._fleet_config(host))
        daemon = SimDaemon(world, port, config)
        core = daemon.core
        watch = LeaseWatch()
        proc = _Process(host.id, pid, daemon, SimLoop(world.clock_ns), None, watch)
        proc.replicator = Replicator(
            config.fleet, on_progress=lambda: self._callback(host, proc, core.replication_progress),
            on_fenced=lambda reason: self._callback(host, proc, core.fenced, reason), clock_ms=core.clock,
            connect=connector(self.cluster, host.id, watch, proc.connections.append), pid=pid)
        proc.replicator.adopter = Adopter(config.fleet, lambda lost, state: self._adopting(host, proc, lost, state))
        core.shell.replicator = proc.replicator
        daemon.on_raise = lambda exc: self._raised(host, proc, exc)
        daemon.guard = lambda action, *args: None if host.paused else action(*args)
        try:
            daemon.start()
        except WheeldError as exc:
            self.faults["daemon start refused"] += 1
            self.note(f"host {host.id}: daemon start refused: {exc}")
            host.shm.crash(port.shm)
            _release_fds(core)
            host.restart_due = True
            world.after_ms(1000, lambda: self.start_daemon(host))
            return
        host.proc = proc
        proc.started_ns = world.now_ns
        host.sessions = {}
        host.listener.listening = True
        original_send = core.delivery._send

        def send(member, entries):
            self._sent(host, proc, entries)
            return original_send(member, entries)
        core.delivery._send = send
        proc.loop.call(proc.replicator.start)
        self.note(f"host {host.id}: daemon {pid} started")

    def _process_alive(self, host: SimHost, pid: int) -> bool:
        worker = next((w for w in self.workers if w.host is host and w.pid == pid), None)
        return worker is None or worker.alive

    def _callback(self, host: SimHost, proc: _Process, fn, *args):
        """A call of the core from the fleet tier (in the process's event loop)."""
        if proc.dead:
            raise Crash("the process is dead")
        try:
            return fn(*args)
        except Crash:
            raise
        except BaseException as exc:  # noqa: BLE001 - the core raised: a finding
            self._raised(host, proc, exc)
            raise Crash("the daemon core raised") from exc

    def _raised(self, host: SimHost, proc: _Process, exc: BaseException) -> None:
        if not isinstance(exc, Crash):
            text = "".join(traceback.format_exception(exc))
            self.flag("raised", host.id, f"host {host.id}'s daemon core raised: {text}")
        self.kill_daemon(host, counted=False)

    def _core_call(self, host: SimHost, proc: _Process, fn, *args):
        try:
            return fn(*args)
        except BaseException as exc:  # noqa: BLE001 - every raise of the core is a finding
            self._raised(host, proc, exc)
            return None

    def kill_daemon(self, host: SimHost, counted: bool = True, restart: bool = True) -> None:
        """SIGKILL: the process's loop never runs again; its arena and journal stay."""
        proc = host.proc
        if proc is None or proc.dead:
            return
        if counted:
            self.faults["daemon killed (restarted later)" if restart else "daemon killed"] += 1
        self.note(f"host {host.id}: daemon {proc.pid} killed")
        self._end_process(host, proc)
        proc.daemon.crash()
        host.shm.crash(proc.daemon.host.shm)
        _release_fds(proc.daemon.core)
        if restart and host.state == "up":
            host.restart_due = True
            delay_ms = self.rng.uniform(0.05, 3.0) * self.profile.ttl_s * 1000
            self.world.after_ms(delay_ms, lambda: self.start_daemon(host))

    def _end_process(self, host: SimHost, proc: _Process) -> None:
        proc.dead = True
        self.killed.append(proc)  # its coroutines are not collected (closed) in the middle of the run
        for conn in proc.connections:
            conn.dead = True
        host.listener.stop()
        for connection in host.connections:
            connection.cut()
        host.sessions = {}

    def _stand_down(self, host: SimHost, proc: _Process) -> None:
        """The daemon was fenced: it shuts down and exits 69 (EXIT_FENCED: not restarted)."""
        self.faults["host stood down (fenced)"] += 1
        replicator = proc.replicator
        self.note(f"host {host.id}: daemon {proc.pid} stands down: {replicator.fenced}")
        lease = self.cluster.lease_of(host.id)
        if f"WHEELD_{host.id}" not in self.cluster.fences and (lease is None or lease == (host.id, replicator.epoch)):
            self.flag("false-fence", host.id, f"host {host.id} (epoch {replicator.epoch}) stood down "
                                              f"({replicator.fenced}) though its stream was not fenced and its "
                                              f"lease was {'lapsed, unclaimed' if lease is None else 'its own'}")
        try:
            proc.daemon.stop()
        except BaseException as exc:  # noqa: BLE001 - a finding
            text = "".join(traceback.format_exception(exc))
            self.flag("raised", host.id, f"host {host.id}'s shutdown raised: {text}")
        proc.loop.call(asyncio.ensure_future, proc.replicator.close())
        proc.loop.run_ready()
        self._end_process(host, proc)
        host.shm.exit(proc.daemon.host.shm)  # the process exits: its files and locks are closed
        _release_fds(proc.daemon.core)
        host.state = "stood down"
        if not self.fault_free and self.rng.random() < 0.25:  # its journal and arena kept: it must stand down again
            self.world.after_ms(self.rng.uniform(1.0, 3.0) * self.profile.ttl_s * 1000, lambda: self._restart(host))
        self._ensure_serving()

    def _restart(self, host: SimHost) -> None:
        """An operator starts a daemon that stood down again, without ``wheelctl fleet forget``:
        it finds the fence (or its lease taken) and stands down once more, delivering nothing
        (docs/fleet.md: "Started again with the old journal, it finds the fence and refuses
        to start")."""
        if host.state != "stood down" or self.fault_free:
            return
        self.faults["a stood-down daemon started again (an operator)"] += 1
        host.state = "up"
        self.start_daemon(host)

    # ------------------------------------------------------------------ the rules checked as the run goes
    def _sent(self, host: SimHost, proc: _Process, entries) -> None:
        """Expirations go out to a worker of ``host``: allowed while the host holds its lease
        and its stream is not fenced, or while its last lease request went unanswered (the
        documented window of a host cut off from the cluster); never once it knows it is
        fenced."""
        replicator = proc.replicator
        if replicator.fenced is not None:
            self.flag("fenced", host.id, f"host {host.id} delivered {len(entries)} expirations after it was fenced "
                                         f"({replicator.fenced})")
            return
        lease = self.cluster.lease_of(host.id)
        fence = self.cluster.fences.get(f"WHEELD_{host.id}")
        if lease == (host.id, replicator.epoch) and fence is None:
            return
        if proc.watch.reached is False:
            self.faults["expirations sent while cut off from the cluster (the documented window)"] += len(entries)
            return
        why = (f"its stream was fenced at sequence {fence}" if fence is not None else
               f"its lease is {'lapsed' if lease is None else f'held by {lease[0]} at epoch {lease[1]}'}")
        self.flag("lease", host.id, f"host {host.id} (epoch {replicator.epoch}) delivered {len(entries)} expirations "
                                    f"while {why}, and its last lease request was answered "
                                    f"(replicator: state {replicator.state}, lease valid until "
                                    f"{replicator.lease_valid_until_ms} ms, reachable {replicator.lease_reachable})")

    def _adopting(self, host: SimHost, proc: _Process, lost: str, state):
        """A peer's adopter hands a lost host's timers to its core: no two adoptions of one
        host epoch, none while an earlier adopter of the host lives; maybe killed here."""
        if proc.dead:
            raise Crash("the process is dead")
        lease = self.cluster.lease_of(lost)
        epoch = lease[1] if lease is not None and lease[0] == host.id else -1
        self.note(f"host {host.id} adopts host {lost} (lease {lease}): {len(state.pending)} pending, "
                  f"{len(state.unacked)} fired unacknowledged, lsn {state.last_lsn}")
        self.faults["takeovers"] += 1
        now = self.world.now_ns
        for other_lost, peer, other_epoch, other, when in self.adoptions:
            if other_lost != lost:
                continue
            if epoch >= 0 and other_epoch == epoch:
                self.flag("adopted-twice", lost, f"host {lost} epoch {epoch} adopted by {peer} and by {host.id}")
            elif not other.dead and not self._troubled(other, when):
                self.flag("adopted-twice", lost, f"host {lost} adopted by {host.id} while {peer}, which adopted it "
                                                 f"(epoch {other_epoch}) at {when / MS:.3f} ms, still runs and "
                                                 f"reached the cluster all along")
            else:
                self.faults["host adopted again (its first adopter died or was cut off)"] += 1
        self.adoptions.append((lost, host.id, epoch, proc, now))
        kill = self.profile.takeover_kill and not self.fault_free and self.rng.random() < self.profile.takeover_kill
        if kill and self.rng.random() < 0.5:
            self.faults["peer killed in a takeover, before adopting"] += 1
            self.kill_daemon(host, counted=False)
            raise Crash("killed in the middle of a takeover")
        result = self._callback(host, proc, proc.daemon.core.adopt, lost, state)
        if kill:
            self.faults["peer killed in a takeover, after adopting"] += 1
            self.kill_daemon(host, counted=False)
            raise Crash("killed in the middle of a takeover")
        return result

    def _claimed(self, peer: str, lost: str) -> None:
        """``peer`` created ``lost``'s lease key (a takeover begins). A host that was up and in
        reach of the cluster all along (not paused, not cut off, none of its requests lost or
        delayed by the network), whose lease lapsed only because the cluster itself had no
        leader for a while (every host's renewals failed alike), must not be taken over:
        docs/fleet.md, "two of three down: ... the host serves and fires locally; sent when the
        quorum is back", not fenced when it is back."""
        host = next((h for h in self.hosts if h.id == lost), None)
        proc = host.proc if host is not None else None
        now, ttl_ns = self.world.now_ns, int(self.profile.ttl_s * 1e9)
        if proc is None or proc.dead or host.paused or host.state != "up":
            return
        if f"WHEELD_{lost}" in self.cluster.fences:
            return  # taken over before (its stream fenced): a takeover that stopped short, taken up again
        window = now - 3 * ttl_ns // 2
        if proc.started_ns > window or host.trouble_ns >= window or host.id in self.cluster.cut_off or \
                self.cluster.unavailable_ns < window:
            return
        if any(conn.net_trouble_ns >= window for conn in proc.connections):
            return  # its own requests were lost or delayed: it could not reach the cluster either
        self.flag("outage-takeover", lost, f"host {peer} claimed host {lost}'s lease though {lost} ran and was in "
                                           f"reach of the cluster for the last {1.5 * self.profile.ttl_s:.1f} s: its "
                                           f"lease lapsed while the cluster had no leader (last at "
                                           f"{self.cluster.unavailable_ns / MS:.3f} ms), as every host's did")

    def _troubled(self, proc: _Process, since_ns: int) -> bool:
        """Whether ``proc`` was paused, cut off, or saw a request go unanswered since ``since_ns``."""
        host = next(h for h in self.hosts if h.id == proc.host_id)
        return host.trouble_ns >= since_ns or host.paused or host.id in self.cluster.cut_off or \
            any(conn.failed_ns >= since_ns for conn in proc.connections)

    # ------------------------------------------------------------------ the event loops
    def _pump(self) -> None:
        """Run what each live, running daemon's event loop has ready; queue its next timer."""
        for host in self.hosts:
            proc = host.proc
            if proc is None or proc.dead or host.paused:
                continue
            if proc.loop.busy():
                proc.loop.run_ready()
                self._after_loop(host, proc)
            if not proc.dead and host.proc is proc:
                self._schedule_loop(proc)

    def _after_loop(self, host: SimHost, proc: _Process) -> None:
        if proc.dead:
            return
        if proc.replicator.state == "failed":
            self.flag("replicator-failed", host.id, f"host {host.id}'s replicator stopped: "
                                                    f"{self._log.last_exception if self._log else ''}")
        if proc.daemon.core.stopping:
            self._stand_down(host, proc)

    def _schedule_loop(self, proc: _Process) -> None:
        when = proc.loop.next_ns()
        if when is None or (proc.loop_wake_ns is not None and proc.loop_wake_ns <= when):
            return
        proc.loop_wake_ns = when
        proc.loop_generation += 1
        generation = proc.loop_generation

        def tick() -> None:
            if proc.loop_generation == generation:
                proc.loop_wake_ns = None
        self.world.at(when, tick)

    # ------------------------------------------------------------------ host faults
    def serving(self) -> list[SimHost]:
        return [h for h in self.hosts if h.state == "up"]

    def lose_host(self, host: SimHost) -> None:
        """The host is gone for good: its daemon and workers killed, its disk and /dev/shm lost."""
        self.faults["host lost"] += 1
        self.note(f"host {host.id} LOST")
        self.kill_daemon(host, counted=False, restart=False)
        host.state = "lost"
        host.paused = False
        for worker in self.workers:
            if worker.host is host and worker.alive:
                worker.alive = False
                worker.client.crash()
        for connection in host.connections:
            connection.discard()
        host.connections = []
        host.shm.reboot()
        self._ensure_serving()

    def _ensure_serving(self, at_once: bool = False) -> None:
        """With every host lost or stood down, a new one joins the fleet (``--adopt '*'``, a
        member in every group) a moment later: the fleet's timers need a peer to adopt them."""
        if self.serving() or self._joining or len(self.hosts) >= len(HOST_IDS):
            return
        self._joining = True

        def join() -> None:
            self._joining = False
            if self.serving():
                return
            host = SimHost(self, HOST_IDS[len(self.hosts)])
            self.hosts.append(host)
            self.faults["a new host joined (every other one gone)"] += 1
            self.note(f"host {host.id} joins the fleet")
            self.start_daemon(host)
            for index in range(self.profile.workers):
                self.spawn(host, GROUPS[index % len(GROUPS)])
        if at_once:
            join()
        else:
            self.world.after_ms(self.rng.uniform(1000, 5000), join)

    def pause(self, host: SimHost) -> None:
        """SIGSTOP of the daemon (or a VM stall) for up to three lease TTLs."""
        if host.paused or host.proc is None or host.proc.dead:
            return
        host.paused = True
        host.trouble_ns = self.world.now_ns
        seconds = self.rng.uniform(0.1, 3.0) * self.profile.ttl_s
        self.faults["daemon paused"] += 1
        self.note(f"host {host.id}: daemon paused for {seconds:.3f} s")
        self.world.after_ms(seconds * 1000, lambda: self.resume(host))

    def resume(self, host: SimHost) -> None:
        if not host.paused:
            return
        host.paused = False
        host.trouble_ns = self.world.now_ns
        self.note(f"host {host.id}: daemon resumed")
        proc = host.proc
        if proc is not None and not proc.dead:
            proc.daemon._wake_ns = None
            proc.daemon.wake_at(self.world.now_ns)

    def partition(self, host: SimHost) -> None:
        if host.id in self.cluster.cut_off:
            return
        seconds = self.rng.uniform(0.1, 3.0) * self.profile.ttl_s
        self.cluster.cut_off.add(host.id)
        host.trouble_ns = self.world.now_ns
        self.faults["host cut off from the cluster"] += 1
        self.note(f"host {host.id}: cut off from the cluster for {seconds:.3f} s")
        self.world.after_ms(seconds * 1000, lambda: self.heal(host))

    def heal(self, host: SimHost) -> None:
        if host.id in self.cluster.cut_off:
            self.cluster.cut_off.discard(host.id)
            host.trouble_ns = self.world.now_ns
            self.note(f"host {host.id}: reaches the cluster again")

    def _node_faults(self) -> None:
        rng, p, cluster = self.rng, self.profile, self.cluster
        up = sorted(cluster.up_nodes())
        if p.node_crash and up and rng.random() < p.node_crash:
            index = rng.choice(up)
            cluster.crash_node(index)
            self.faults["nats server down"] += 1
            self.world.after_ms(rng.uniform(0.1, 20.0) * 1000, lambda: cluster.restart_node(index))
        if p.disk_loss and rng.random() < p.disk_loss:
            wipeable = [i for i in sorted(cluster.up_nodes()) if cluster.may_wipe(i)]
            if not wipeable:
                return
            index = rng.choice(wipeable)
            cluster.crash_node(index, wipe=True)
            self.faults["nats server lost its disk"] += 1
            self.world.after_ms(rng.uniform(0.1, 10.0) * 1000, lambda: cluster.restart_node(index))

    def _faults(self) -> None:
        if self.fault_free:
            return
        rng, p = self.rng, self.profile
        serving = self.serving()
        running = [h for h in serving if h.proc is not None and not h.proc.dead]
        if p.host_loss and len(serving) >= 2 and rng.random() < p.host_loss:
            self.lose_host(rng.choice(serving))
            return
        if p.pause and running and rng.random() < p.pause:
            self.pause(rng.choice(running))
        if p.partition and serving and rng.random() < p.partition:
            self.partition(rng.choice(serving))
        if p.daemon_kill and running and rng.random() < p.daemon_kill:
            host = rng.choice(running)
            if not host.paused:
                self.kill_daemon(host)
        self._node_faults()
        if p.worker_crash and rng.random() < p.worker_crash:
            live = [w for w in self.workers if w.alive]
            if live:
                self.kill_worker(rng.choice(live))
        if p.cut and self.crng.random() < p.cut:
            self._cut_session()

    def _cut_session(self) -> None:
        """A host's daemon closes a live worker's session, as it closes one that stopped
        reading its socket (Sessions.maintain), and runs on: the worker reconnects. What
        the closed session held goes back to its group, as at any session's end."""
        open_ones = []
        for worker in self.workers:
            host = worker.host
            proc = self._running(host)
            session = host.sessions.get(id(worker.connection)) if proc is not None and worker.connection else None
            if worker.alive and session is not None and not session.closed and session.client is not None:
                open_ones.append((worker, host, proc, session))
        if not open_ones:
            return
        worker, host, proc, session = self.crng.choice(open_ones)
        self.faults["session cut by the daemon"] += 1
        self.note(f"host {host.id}: the daemon cuts worker {worker.ident}'s session")
        self._core_call(host, proc, proc.daemon.core.sessions.close, session,
                        "cut by the simulator (as a client that stopped reading)", True)

    # ------------------------------------------------------------------ workers
    def spawn(self, host: SimHost, group: str) -> FleetWorker:
        self.next_ident += 1
        worker = FleetWorker(self, host, self.next_ident, group)
        self.workers.append(worker)
        self.world.after_ms(self.rng.uniform(0, 5), lambda: self._connect(worker))
        return worker

    def _connect(self, worker: FleetWorker) -> None:
        if not worker.alive:
            return
        try:
            worker.client.connect()
        except (DaemonNotRunning, BrokenPeer, OSError):
            worker.client = worker._client()
            self.world.after_ms(self.rng.uniform(50, 500), lambda: self._connect(worker))
            return
        worker.started = True
        self.world.after_ms(self.rng.uniform(0, 2), lambda: self._act(worker))

    def kill_worker(self, worker: FleetWorker) -> None:
        worker.alive = False
        worker.client.crash()
        self.faults["worker killed"] += 1
        self.note(f"worker {worker.ident} on host {worker.host.id} killed")
        host = worker.host
        self.world.after_ms(self.rng.uniform(1, 200),
                            lambda: self.spawn(host, worker.group) if host.state != "lost" else None)

    def _act(self, worker: FleetWorker) -> None:
        if not worker.alive:
            return
        if worker.client._welcome is None:  # its connect() has not returned yet
            self._poll(worker)
            self.world.after_ms(self.rng.uniform(1, 20), lambda: self._act(worker))
            return
        if self.ops >= self.ops_target:
            self._poll(worker)
            return
        self.ops += 1
        self._faults()
        if not worker.alive:
            return
        self._step(worker)
        pause = self.rng.choice([5, 50, 500, 2000])
        self.world.after_ms(self.rng.uniform(0, pause), lambda: self._act(worker))

    def _key(self, worker: FleetWorker) -> str:
        if worker.keys and self.rng.random() < 0.4:
            return self.rng.choice(worker.keys)
        key = f"c{worker.ident}-{len(worker.keys)}"
        worker.keys.append(key)
        return key

    def _delay(self) -> int:
        rng, top = self.rng, self.profile.max_delay_ms
        roll = rng.random()
        if roll < 0.4:
            return rng.randint(0, min(top, 500))
        if roll < 0.8:
            return rng.randint(0, min(top, 5000))
        return rng.randint(0, top)

    def _step(self, worker: FleetWorker) -> None:
        """One call of the worker's application: add (a new key or a re-arm), cancel, flush, poll."""
        rng, client, history, now = self.rng, worker.client, self.history, self.world.now_ns
        host = worker.host.id
        roll = rng.random()
        try:
            if roll < 0.45:
                key, delay = self._key(worker), self._delay()
                client.add(key, delay)
                tag = _latest_tag(client, key)
                history.armed(host, worker.ident, key, tag, now, delay)
                self.note(f"w{worker.ident}@{host} add {key} {delay} ms tag {tag:#x}")
            elif roll < 0.6 and worker.keys:
                key = rng.choice(worker.keys)
                hit = client.cancel(key)
                history.cancelled(host, worker.ident, key, now)
                self.note(f"w{worker.ident}@{host} cancel {key} -> {hit}")
            elif roll < 0.8:
                number = client.flush()
                worker.flushes[number] = history.flush_called(worker.ident)
                self.note(f"w{worker.ident}@{host} flush #{number}")
            else:
                self._poll(worker)
        except InvalidDelay:
            if client.max_delay_ms:
                raise
            self.faults["call before the Welcome"] += 1
        except RingFull:
            self.faults["RingFull raised to a worker"] += 1
        except (ArenaFull, QuotaExceeded):
            self.faults["ArenaFull or QuotaExceeded raised at once"] += 1
        except (BrokenPeer, Closed, DaemonNotRunning) as exc:
            self.note(f"w{worker.ident}@{host}: {exc!r}")

    def _poll(self, worker: FleetWorker) -> None:
        if not worker.alive or not worker.started:
            return
        client, host = worker.client, worker.host.id
        try:
            polled = client.poll()
        except WheeldError as exc:
            self.note(f"w{worker.ident}@{host} poll: {exc!r}")
            return
        now = self.world.now_ns
        for expired, tag in zip(polled.expired, client.handed_tags):
            key = expired.key if isinstance(expired.key, str) else bytes(expired.key).decode("utf-8", "replace")
            self.history.handed(host, worker.ident, key, tag, now)
            self.note(f"w{worker.ident}@{host} handed {key} tag {tag:#x} deadline {expired.deadline_ms} "
                      f"fired {expired.fired_ms} late {expired.late}")
        client.handed_tags.clear()
        for number, outcome in polled.flushed:
            covered = worker.flushes.pop(number, None)
            if covered is None:
                continue
            refused = {seq for seq, code in client.flush_rejections.pop(number, ()) if code != "journal_unavailable"}
            if refused:  # never applied
                covered = [c for c in covered if c.kind != "add" or c.tag not in refused]
            self.note(f"w{worker.ident}@{host} flush #{number} answered: {outcome!r}")
            if outcome is None:
                self.history.flushed(covered, now)
            else:
                self.faults[f"flush failed: {type(outcome).__name__}"] += 1
                self.history.flush_failed(worker.ident, covered)

    # ------------------------------------------------------------------ the sockets
    def _running(self, host: SimHost) -> _Process | None:
        proc = host.proc
        if proc is None or proc.dead or host.paused or not proc.daemon.alive:
            return None
        return proc

    def _network(self, host: SimHost) -> None:
        """Move what waits between ``host``'s workers and its daemon (as sim.run does)."""
        proc = self._running(host)
        if proc is not None and host.listener.backlog:
            while (connection := host.listener.accept()) is not None:
                pid, uid, gid = connection.peer
                session = self._core_call(host, proc, proc.daemon.core.connected, connection.daemon, pid, uid, gid)
                if session is not None:
                    host.sessions[id(connection)] = session
        keep = []
        for connection in host.connections:
            end = connection.daemon
            session = host.sessions.get(id(connection)) if proc is not None else None
            if session is not None and not proc.dead:
                stream = connection.to_daemon
                if not end.closed and (stream.visible or (stream.writer_closed and not stream.size)):
                    for _ in range(8):
                        got = connection.take_for_daemon()
                        if got is None:
                            break
                        data, fds = got
                        self._core_call(host, proc, proc.daemon.core.received, session, data, fds)
                        if proc.dead or not data or end.closed:
                            break
                if not proc.dead and end.wants_writable and connection.writable_due():
                    self._core_call(host, proc, proc.daemon.core.writable, session)
            if end.closed and connection.client.closed:
                host.sessions.pop(id(connection), None)
                continue
            keep.append(connection)
        host.connections = keep

    def _network_busy(self, host: SimHost) -> bool:
        if self._running(host) is None:
            return False
        if host.listener.backlog:
            return True
        for connection in host.connections:
            if connection.to_daemon.size:
                return True
            end = connection.daemon
            if end.wants_writable and not end.closed and connection.to_client.room() > 0:
                return True
        return False

    def _settle(self) -> None:
        """After each event: bytes move, workers with something to read poll, loops run."""
        for host in self.hosts:
            self._network(host)
        for worker in self.workers:
            if worker.alive and worker.started and worker.connection is not None and \
                    worker.connection.to_client.visible:
                self._poll(worker)
        if not self._net_due and any(self._network_busy(h) for h in self.hosts):
            self._net_due = True
            self.world.after_ms(self.rng.choice([0.005, 0.02, 0.1]), self._net_tick)
        self._pump()

    def _net_tick(self) -> None:
        self._net_due = False

    # ------------------------------------------------------------------ the run
    def run(self) -> FleetResult:
        world, p = self.world, self.profile
        with client_clock(world.clock_ns), _captured_log(self):
            try:
                for host in self.hosts:
                    self.start_daemon(host)
                for host in self.hosts:
                    for index in range(p.workers):
                        self.spawn(host, GROUPS[index % len(GROUPS)])
                progress_ops, progress_ns = self.ops, world.now_ns
                while self.ops < self.ops_target and world.step():
                    self._settle()
                    if self.ops != progress_ops:
                        progress_ops, progress_ns = self.ops, world.now_ns
                    elif world.now_ns - progress_ns > 3600 * 1_000_000_000:
                        self.flag("stuck", "run", f"no operation for an hour ({self.ops} of {self.ops_target} done)")
                        break
                self._wind_down()
            finally:
                self._close()
        self.violations += check(self.history)
        for text in self.cluster.after_fence[:1]:
            self.violations.append(Violation("after-fence", f"a host's write was accepted after its fence: {text}"))
        for text in self.cluster.lost[:1]:
            self.violations.append(Violation("stream-lost", f"the cluster lost a message while a quorum of servers "
                                                            f"kept its disk: {text}"))
        across, within = self.history.duplicates()
        self.faults["armings handed by two hosts (a takeover's at-least-once window)"] += across
        self.faults["armings handed twice by one host"] += within
        acked = sum(1 for a in self.history.armings.values() if a.acked_ns is not None)
        handed = sum(len(a.handed) for a in self.history.armings.values())
        return FleetResult(self.seed, p, self.ops, self.violations, +self.faults, world.events_run,
                           world.now_ns // MS, acked, handed, self.trace)

    def _wind_down(self) -> None:
        """The faults stop; the fleet settles (module docstring)."""
        world, cluster, p = self.world, self.cluster, self.profile
        self.fault_free = True
        self.ops_target = self.ops  # (a run that stopped short: its workers make no more calls)
        net = cluster.net
        net.spike = net.lose_request = net.lose_answer = net.no_responders = 0.0
        for index, node in enumerate(cluster.nodes):
            if not node.up:
                cluster.restart_node(index)
        for host in self.hosts:
            self.heal(host)
        for host in self.hosts:
            self.resume(host)
        for host in self.serving():
            if (host.proc is None or host.proc.dead) and not host.restart_due:
                self.start_daemon(host)
        self._ensure_serving(at_once=True)
        for host in self.serving():
            for group in GROUPS[: max(1, min(len(GROUPS), p.workers))]:
                if not any(w.alive and w.host is host and w.group == group for w in self.workers):
                    self.spawn(host, group)
        for worker in self.workers:
            if worker.alive:
                world.after_ms(1, lambda w=worker: self._final_flush(w))
        last = max((a.due_ns for a in self.history.armings.values()), default=world.now_ns)
        wait_ms = int((6 * p.ttl_s + self.config.ack_timeout_s + self.config.resume_grace_s + 10) * 1000)
        end = max(last, world.now_ns) + wait_ms * MS
        at = world.now_ns
        while at < end:
            at += 250 * MS
            world.at(at, self._poll_all)
        while world.step():
            self._settle()
            if world.now_ns > end:
                break

    def _final_flush(self, worker: FleetWorker) -> None:
        if not worker.alive or worker.host.state != "up":
            return
        try:
            if not worker.started or worker.client._segment is None:
                raise RingFull("not connected yet")
            worker.flushes[worker.client.flush()] = self.history.flush_called(worker.ident)
        except WheeldError:
            self.world.after_ms(10, lambda: self._final_flush(worker))

    def _poll_all(self) -> None:
        self.workers = [w for w in self.workers if w.alive]
        for worker in self.workers:
            self._poll(worker)

    def _close(self) -> None:
        for worker in self.workers:
            if worker.alive:
                worker.alive = False
                worker.client.crash()
        for host in self.hosts:
            if host.proc is not None and not host.proc.dead:
                self.kill_daemon(host, counted=False, restart=False)
            for connection in host.connections:
                connection.discard()
            host.shm.reboot()


class _captured_log:
    """The ``wheeld`` loggers into the run's collector while it runs (logging.disable lifted:
    the parallel runner silences everything), as they were afterwards."""

    def __init__(self, sim: FleetSimulation):
        self.sim = sim

    def __enter__(self):
        logger = logging.getLogger("wheeld")
        self.saved = (logging.root.manager.disable, logger.level, logger.propagate, list(logger.handlers),
                      logging.getLogger("asyncio").level)
        logging.disable(logging.NOTSET)
        self.sim._log = _LogCollector(self.sim)
        logger.handlers = [self.sim._log]
        logger.propagate = False
        logger.setLevel(logging.DEBUG if self.sim.tracing else logging.WARNING)
        logging.getLogger("asyncio").setLevel(logging.CRITICAL + 1)
        return self

    def __exit__(self, *exc_info):
        disable, level, propagate, handlers, asyncio_level = self.saved
        logger = logging.getLogger("wheeld")
        logger.handlers, logger.propagate = handlers, propagate
        logger.setLevel(level)
        logging.getLogger("asyncio").setLevel(asyncio_level)
        logging.disable(disable)
        return False


def run_fleet_seed(seed: int, ops: int = 1000, trace: bool = False, profile: FleetProfile | None = None,
                   cut: bool = True) -> FleetResult:
    """One seed's fleet run (``cut``: with the sessions the daemons cut, FleetProfile.draw_cut)."""
    sim = FleetSimulation(seed, ops, profile=profile, trace=trace, cut=cut)
    try:
        return sim.run()
    finally:
        del sim
        _reap_killed()


def _reap_killed() -> None:
    """Collect what the run's killed processes left: their loops' coroutines, suspended
    where the SIGKILL found them. Collected, each is closed, and the ones suspended in a
    ``try``/``finally`` that awaits (an ordered consumer's unsubscribe, say) cannot run it
    without their loop: Python reports each as an exception it ignored. A killed process
    runs none of that; the reports say nothing of the run, so they are not shown (at a
    random later moment, in another test, they were)."""
    hook = sys.unraisablehook
    sys.unraisablehook = lambda unraisable: None
    try:
        gc.collect()
    finally:
        sys.unraisablehook = hook
