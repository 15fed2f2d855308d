"""End-to-end benchmark: wheeld against a Redis delayed queue and asyncio, in one run.

    python -m bench.e2e              # full run, 3 repeats (~3 min); table + bench/runs/e2e.json
                                     # (--save: bench/results/)
    python -m bench.e2e --quick      # seconds: a smoke run with small sizes, 1 repeat
    python -m bench.e2e --only wheeld --repeat 1 --profile /tmp/prof   # py-spy recordings of one run
    python -m bench.e2e --only wheeld --repeat 1 --raw /tmp/raw        # when did timers fire late?
    python -m bench.e2e --only wheeld --daemon-args "--wheel-size 64"  # another daemon configuration

Run it from the repository root (``bench`` is a namespace package) on a quiet
machine: the bench checks ``os.getloadavg()`` and writes it into the JSON.

The workload (identical for the three systems: the same seeded plan)
=====================================================================

Each of two *client processes* owns its own keys (``"c0-123"``; str keys of 4-9
bytes) and its own group (``bench-0``/``bench-1``; a Redis sorted set per
client), and runs four phases in lock-step with the other client:

1. **preload**: add ``preload_per_client`` keys with delays uniform in
   ``[delay_lo_ms, delay_hi_ms]`` (100k pending in all after the full preload),
   then ``flush``. Timed separately ("add burst"), not part of the targets.
2. **burst** (throughput): ``burst_ops_per_client`` operations as fast as the
   client can issue them: 60% add of a new key, 20% re-arm of a random live key
   (``add`` of an armed key), 20% cancel of a random live key; the same delay
   distribution. The client receives expirations between ops (``poll(0)`` every
   1024 ops). Both clients start at a shared instant ``t0``; each ends with
   ``flush()`` (the daemon has applied everything it sent). **Throughput =
   ops issued by both clients / (latest flush return - t0).** Pending grows
   during this phase (60% new keys minus 20% cancels); the JSON records the
   pending count sampled from the arena header every 10 ms.
3. **steady** (lateness): ``steady_s`` seconds paced at
   ``steady_rate_per_client`` ops/s per client (same mix), receiving
   expirations the rest of the time (``poll(timeout)`` up to the next 1 ms
   step), then a 300 ms grace to receive the last ones. At least 100k timers
   stay pending (130-180k with the full sizes; sampled, see ``pending`` in the
   JSON) and ~25k come due per second.
4. **touch** (client 0 only): ``add_idle`` ``touch_keys`` keys with a long
   idle time, then ``w.touch(key)`` over all of them ``touch_rounds`` times in
   a tight loop; ns per call. The parts of a touch are timed alone too (loop,
   ``encode_key``, clock read, the bare 8-byte store), for the profile.

Fire lateness, two figures for every expiration, in milliseconds:

* ``fired``: ``Expired.fired_ms - Expired.deadline_ms``: the daemon's view,
  integer ms of CLOCK_MONOTONIC (the daemon's ``now`` when it expired the timer).
  For Redis the pop request's ``now`` (the score bound) minus the score; for
  asyncio the callback's ``loop.time()`` minus its ``call_at`` time.
* ``recv``: the client's ``time.monotonic_ns()`` when ``poll`` handed the item
  over, minus ``deadline_ms``: what the application sees (socket, decode,
  client polling included). For asyncio identical to ``fired``.

Lateness is reported per phase by *deadline*: "steady" = deadlines inside the
steady window (100k pending, moderate load: **the basis of the 2 ms target**);
"burst" = deadlines inside the burst window (clients and daemon saturating both
cores; informational). Any item with ``fired < deadline`` is counted as
``early`` (must be 0: the never-early guarantee).

The baselines
=============

* **Redis** (:mod:`bench.redis_baseline`): a real ``redis-server`` on 127.0.0.1
  and a free port (no persistence), one sorted set per client, ``ZADD key
  score=deadline_ms`` (an add and a re-arm are the same command), ``ZREM`` to
  cancel, and a Lua script that pops due members (``ZRANGEBYSCORE .. LIMIT`` +
  ``ZREM``) as the consumer. Two client processes, the same plan, pipelined
  ``pipeline`` commands at a time with one pop per pipeline; in the steady phase
  one pipeline (+ pop) per 1 ms step, i.e. a 1 ms polling consumer. Also an
  unpipelined run (one round trip per command) for reference.
* **asyncio**: one process, ``loop.call_at``/``handle.cancel`` (re-arm =
  cancel + call_at), both clients' plans interleaved in chunks of 1024 with a
  yield to the loop between chunks; the same pending count and paced steady
  phase (at twice the per-client rate).

CPU accounting: each client reports ``time.process_time()`` for the burst
phase; the daemon's CPU time comes from psutil; both as us per operation, which
is where the wall time of a 2-core machine goes.

Targets (those of the compiled steady loop): >= 2,500,000 timer ops/s end to end
(best run; every run >= 2,000,000); >= 10x the pipelined Redis baseline (best
wheeld run / best Redis run); steady-phase lateness p99 <= 1 ms with ~100k pending
(recv figure) and a fired p99 of 0, in every run; the daemon's CPU in the steady
phase per client op issued there <= 1.5 us (within ~2x of the C floor that
``python -m bench.wake_floor`` measures); ``w.touch`` <= 0.1 us. The table marks each met /
NOT met, and shows the spread. The targets are for the full sizes: a run with
other sizes (``--quick``, or a size option) reports its figures beside them as
not comparable, with no verdict (``met`` is null in the JSON). docs/bench-e2e.md has the measured figures and
where the time goes.

Both paths: ``wheeld`` runs the daemon and clients as installed (the compiled
hot path), ``wheeld-py`` the same run in a child process with
``WHEELD_PURE_PYTHON=1`` (the Python sources), in the table side by side. The
targets are read from the ``wheeld`` rows.

Profiling (``--profile DIR``, first repeat only): ``py-spy record --format raw
--idle`` samples the daemon and both clients during the burst phase and, in a
second recording, the daemon during the steady phase (needs ``pip install
py-spy``; about 5-10% slower). ``--cprofile`` adds deterministic profiles: the
daemon runs under ``python -m cProfile`` (stats written at its graceful SIGTERM
stop) and each client profiles its burst phase; that is 2-4x slower, use it for
call counts, not for time shares. ``python -m bench.e2e --summarize DIR`` prints
the inclusive and self shares of every py-spy recording in DIR.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import platform
import queue as queue_module
import random
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # python bench/e2e.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import DaemonProcess, add_save_option, results_path, unique_name  # noqa: E402


OP_ADD, OP_REARM, OP_CANCEL = 0, 1, 2
WHEELD_SYSTEMS = ("wheeld", "wheeld-py")  # the compiled path (as installed) and the Python path
POLL_EVERY = 1024  # burst phase: receive expirations every this many ops
GRACE_S = 0.3  # after the steady phase: keep receiving what came due inside it
TARGET_OPS_PER_S = 2_500_000  # best run
TARGET_OPS_EVERY_RUN = 2_000_000
TARGET_REDIS_RATIO = 10.0
TARGET_P99_MS = 1.0  # steady recv p99, in every run
TARGET_FIRED_P99_MS = 0  # steady fired p99, in every run
TARGET_STEADY_DAEMON_US_PER_OP = 1.5
TARGET_TOUCH_NS = 100.0


# --------------------------------------------------------------------------- sizes


@dataclass(frozen=True)
class Sizes:
    clients: int = 2
    preload_per_client: int = 50_000
    burst_ops_per_client: int = 100_000
    steady_s: float = 8.0
    steady_rate_per_client: int = 20_000
    delay_lo_ms: int = 500
    delay_hi_ms: int = 9_500
    touch_keys: int = 10_000
    touch_rounds: int = 50
    unpipelined_ops_per_client: int = 10_000
    pipeline: int = 1000
    capacity: int = 1_000_000


FULL = Sizes()
QUICK = Sizes(preload_per_client=5_000, burst_ops_per_client=20_000, steady_s=1.0, steady_rate_per_client=5_000,
              delay_lo_ms=200, delay_hi_ms=3_000, touch_keys=2_000, touch_rounds=10,
              unpipelined_ops_per_client=1_000, capacity=200_000)


# --------------------------------------------------------------------------- the plan


@dataclass
class Plan:
    """One client's operations, generated before the clock starts (seeded, so every
    system runs the same work). Re-arms and cancels pick a random key that the plan
    still holds armed; keys that expired meanwhile are not tracked (a re-arm of one
    is then a fresh add, a cancel of one a miss: both are ordinary operations)."""

    preload_keys: list
    preload_delays: list
    burst: list  # [(op, key, delay_ms)]
    steady: list


def make_plan(client: int, sizes: Sizes, seed: int) -> Plan:
    rng = random.Random(seed * 7919 + client)
    lo, hi = sizes.delay_lo_ms, sizes.delay_hi_ms
    live: list[str] = []
    next_id = 0

    def new_key() -> str:
        nonlocal next_id
        key = f"c{client}-{next_id}"
        next_id += 1
        return key

    preload_keys = [new_key() for _ in range(sizes.preload_per_client)]
    preload_delays = [rng.randint(lo, hi) for _ in preload_keys]
    live.extend(preload_keys)

    def ops(count: int) -> list:
        out = []
        for _ in range(count):
            r = rng.random()
            if r < 0.6 or not live:
                key = new_key()
                live.append(key)
                out.append((OP_ADD, key, rng.randint(lo, hi)))
            elif r < 0.8:
                out.append((OP_REARM, live[rng.randrange(len(live))], rng.randint(lo, hi)))
            else:
                i = rng.randrange(len(live))
                key = live[i]
                live[i] = live[-1]
                live.pop()
                out.append((OP_CANCEL, key, 0))
        return out

    burst = ops(sizes.burst_ops_per_client)
    steady = ops(int(sizes.steady_s * sizes.steady_rate_per_client) + 1)
    return Plan(preload_keys, preload_delays, burst, steady)


# --------------------------------------------------------------------------- phases (lock-step)


class Phases:
    """Lock-step between the parent and the client processes, one phase at a time.

    A client calls :meth:`arrive` when it is ready for ``phase`` and keeps
    receiving expirations (``idle``) until the parent has seen every client arrive
    and published a common start instant a few ms ahead; then it spins to it."""

    LEAD_NS = 20_000_000

    def __init__(self, ctx, names: list[str]):
        self.events = {name: ctx.Event() for name in names}
        self.starts = {name: ctx.Value("q", 0, lock=False) for name in names}
        self.messages = ctx.Queue()

    # client side
    def arrive(self, client: int, phase: str, idle=None, info=None) -> int:
        self.messages.put(("arrive", client, phase, info))
        event = self.events[phase]
        while not event.is_set():
            if idle is not None:
                idle()
            else:
                event.wait(0.005)
        start_ns = self.starts[phase].value
        while time.monotonic_ns() < start_ns:
            if idle is not None and start_ns - time.monotonic_ns() > 2_000_000:
                idle()
        return start_ns

    def result(self, client: int, payload) -> None:
        self.messages.put(("result", client, None, payload))

    def error(self, client: int, text: str) -> None:
        self.messages.put(("error", client, None, text))

    # parent side
    def wait(self, procs, kind: str, phase: str | None, timeout_s: float) -> dict:
        """Collect one ``kind`` message from every client; raise on an error or a dead client."""
        got: dict[int, object] = {}
        end = time.monotonic() + timeout_s
        while len(got) < len(procs):
            try:
                what, client, msg_phase, payload = self.messages.get(timeout=0.2)
            except queue_module.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"client process {dead[0].pid} exited with {dead[0].exitcode}") from None
                if time.monotonic() > end:
                    raise TimeoutError(f"clients did not reach {kind} {phase} within {timeout_s} s") from None
                continue
            if what == "error":
                raise RuntimeError(f"client {client} failed:\n{payload}")
            if what != kind or msg_phase != phase:
                raise RuntimeError(f"client {client}: expected {kind} {phase}, got {what} {msg_phase}")
            got[client] = payload
        return got

    def release(self, phase: str) -> int:
        start_ns = time.monotonic_ns() + self.LEAD_NS
        self.starts[phase].value = start_ns
        self.events[phase].set()
        return start_ns


def stop_processes(procs) -> None:
    """Stop client processes we started, by pid."""
    for p in procs:
        if p.is_alive():
            p.join(2.0)
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
            p.join(5.0)


# --------------------------------------------------------------------------- measurement helpers


class Received:
    """Expirations as three parallel lists (cheap appends in the hot loop)."""

    __slots__ = ("deadline_ms", "fired_ms", "recv_us")

    def __init__(self):
        self.deadline_ms: list[int] = []
        self.fired_ms: list[int] = []
        self.recv_us: list[int] = []

    def arrays(self) -> dict:
        return {"deadline_ms": np.array(self.deadline_ms, dtype=np.int64),
                "fired_ms": np.array(self.fired_ms, dtype=np.int64),
                "recv_us": np.array(self.recv_us, dtype=np.int64)}


def lateness_stats(values_ms: np.ndarray) -> dict:
    if len(values_ms) == 0:
        return {"count": 0, "p50": None, "p99": None, "p999": None, "max": None, "mean": None}
    p50, p99, p999 = np.percentile(values_ms, [50, 99, 99.9])
    return {"count": int(len(values_ms)), "p50": round(float(p50), 3), "p99": round(float(p99), 3),
            "p999": round(float(p999), 3), "max": round(float(values_ms.max()), 3),
            "mean": round(float(values_ms.mean()), 3)}


def lateness_report(received: list[dict], windows: dict[str, tuple[int, int]]) -> dict:
    """Per window (by deadline): lateness of the ``fired`` and ``recv`` figures, in ms."""
    deadline = np.concatenate([r["deadline_ms"] for r in received]) if received else np.zeros(0, np.int64)
    fired = np.concatenate([r["fired_ms"] for r in received]) if received else np.zeros(0, np.int64)
    recv_us = np.concatenate([r["recv_us"] for r in received]) if received else np.zeros(0, np.int64)
    early = int((fired < deadline).sum() + (recv_us < deadline * 1000).sum())
    out = {"received_total": int(len(deadline)), "early_total": early}
    for name, (lo_ms, hi_ms) in windows.items():
        mask = (deadline >= lo_ms) & (deadline <= hi_ms)
        out[name] = {
            "window_ms": [int(lo_ms), int(hi_ms)],
            "fired": lateness_stats((fired[mask] - deadline[mask]).astype(np.float64)),
            "recv": lateness_stats((recv_us[mask] - deadline[mask] * 1000) / 1000.0),
        }
    return out


class PendingSampler:
    """A parent thread sampling a pending count every ``period_s``, labelled by phase."""

    def __init__(self, read, period_s: float = 0.01):
        self.read = read
        self.period_s = period_s
        self.phase = "setup"
        self.samples: dict[str, list[int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "PendingSampler":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                value = int(self.read())
            except Exception:  # noqa: BLE001 - a sampler must not kill the bench
                continue
            self.samples.setdefault(self.phase, []).append(value)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(2.0)
        return {phase: {"min": min(v), "mean": round(statistics.fmean(v)), "max": max(v), "samples": len(v)}
                for phase, v in self.samples.items() if v}


def mono_ms() -> int:
    return time.monotonic_ns() // 1_000_000


# --------------------------------------------------------------------------- wheeld: the daemon


def bench_daemon(workdir: Path, name: str, capacity: int, cprofile_path: str | None = None,
                 extra_args: tuple = (), log_level: str = "WARNING") -> DaemonProcess:
    """A wheeld on a private socket and instance name (the tests' harness), optionally
    under cProfile (stopped with SIGTERM by ``cleanup(signal.SIGTERM)``, which writes the stats)."""
    prefix = ["-m", "cProfile", "-o", cprofile_path] if cprofile_path else []
    return DaemonProcess(workdir, name=name, capacity=capacity, extra=extra_args, log_level=log_level,
                         prefix=prefix)


def arena_reader(name: str):
    """(read pending, read a counter by name, close) over the daemon's arena header, read-only."""
    from wheeld.protocol.naming import arena_name
    from wheeld.protocol import arena_layout as AL
    from wheeld.shm.arena import Segment

    segment = Segment.attach(arena_name(name), readonly=True)
    words = memoryview(segment.buf)[: AL.GROUPS_OFFSET].cast("q")
    base = AL.H_COUNTERS // 8

    def counter(counter_name: str) -> int:
        return words[base + AL.COUNTER[counter_name]]

    def close() -> None:
        words.release()
        segment.close()

    return (lambda: counter("pending")), counter, close


# --------------------------------------------------------------------------- wheeld: a client process


def wheeld_client(client: int, socket_path: str, sizes: Sizes, seed: int, phases: Phases, profile_dir: str | None):
    try:
        phases.result(client, _wheeld_client(client, socket_path, sizes, seed, phases, profile_dir))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        phases.error(client, traceback.format_exc())


def _wheeld_client(client, socket_path, sizes: Sizes, seed, phases: Phases, profile_dir):
    import wheeld

    plan = make_plan(client, sizes, seed)
    got = Received()
    d_append, f_append, r_append = got.deadline_ms.append, got.fired_ms.append, got.recv_us.append
    monotonic_ns = time.monotonic_ns
    out: dict = {"client": client, "pid": os.getpid()}

    w = wheeld.connect(socket_path, group=f"bench-{client}", ring_timeout_s=60.0)
    poll = w.poll

    def receive(timeout_s: float = 0.0) -> int:
        items = poll(timeout_s)
        if items:
            now_us = monotonic_ns() // 1000
            for e in items:
                d_append(e.deadline_ms)
                f_append(e.fired_ms)
                r_append(now_us)
        return len(items)

    idle = lambda: receive(0.001)  # noqa: E731

    # 1. preload
    phases.arrive(client, "preload", idle)
    add, cancel = w.add, w.cancel
    t = time.perf_counter()
    for key, delay in zip(plan.preload_keys, plan.preload_delays):
        add(key, delay)
    w.flush(timeout_s=120)
    out["preload"] = {"ops": len(plan.preload_keys), "seconds": time.perf_counter() - t}

    # 2. burst
    phases.arrive(client, "burst", idle, info={"pid": os.getpid()})
    profiler = None
    if profile_dir:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    cpu0 = time.process_time()
    hits = received = 0
    burst = plan.burst
    for start in range(0, len(burst), POLL_EVERY):
        for op, key, delay in burst[start: start + POLL_EVERY]:
            if op == OP_CANCEL:
                hits += cancel(key)
            else:
                add(key, delay)
        received += receive()
    issued_ns = monotonic_ns()
    w.flush(timeout_s=120)
    end_ns = monotonic_ns()
    cpu = time.process_time() - cpu0
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(os.path.join(profile_dir, f"client{client}-burst.prof"))
    out["burst"] = {"ops": len(burst), "issued_ns": issued_ns, "end_ns": end_ns, "cpu_s": cpu,
                    "cancel_hits": hits, "received_during": received}

    # 3. steady: paced ops, receive the rest of the time
    start_ns = phases.arrive(client, "steady", idle)
    rate = sizes.steady_rate_per_client
    steady = plan.steady
    end_ns = start_ns + int(sizes.steady_s * 1e9)
    i = 0
    n = len(steady)
    cpu0 = time.process_time()
    while True:
        now = monotonic_ns()
        if now >= end_ns:
            break
        due = min(n, (now - start_ns) * rate // 1_000_000_000)
        while i < due:
            op, key, delay = steady[i]
            if op == OP_CANCEL:
                cancel(key)
            else:
                add(key, delay)
            i += 1
        next_step = now - (now - start_ns) % 1_000_000 + 1_000_000
        receive(max(0.0, (next_step - monotonic_ns()) / 1e9))
    grace_end = end_ns + int(GRACE_S * 1e9)
    while monotonic_ns() < grace_end:
        receive(0.005)
    w.flush(timeout_s=60)
    out["steady"] = {"ops": i, "cpu_s": time.process_time() - cpu0}

    # 4. touch (client 0)
    phases.arrive(client, "touch", idle)
    if client == 0:
        out["touch"] = measure_touch(w, sizes)
    receive()
    out["received"] = got.arrays()
    w.close()
    return out


def measure_touch(w, sizes: Sizes) -> dict:
    """ns per ``w.touch(key)`` in a tight loop over idle timers, and its parts."""
    from wheeld.protocol.keys import encode_key

    keys = [f"idle-{i}" for i in range(sizes.touch_keys)]
    for key in keys:
        w.add_idle(key, 3_600_000)
    w.flush(timeout_s=60)
    rounds = sizes.touch_rounds
    count = rounds * len(keys)

    def per_call(fn) -> float:
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter_ns()
            fn()
            best = min(best, (time.perf_counter_ns() - t) / count)
        return round(best, 1)

    touch = w.touch

    def touches():
        for _ in range(rounds):
            for key in keys:
                touch(key)

    def loop_only():
        for _ in range(rounds):
            for _key in keys:
                pass

    def encode_only():
        for _ in range(rounds):
            for key in keys:
                encode_key(key)

    monotonic_ns = time.monotonic_ns

    def clock_only():
        for _ in range(rounds):
            for _key in keys:
                monotonic_ns() // 1_000_000

    segment = w._segment  # the bare store, for the breakdown only
    index = w._touch_index
    seg_touch = segment.touch
    idx = [index[bytes((encode_key(k)[1],)) + encode_key(k)[0]] for k in keys]

    def segment_touch_only():
        for _ in range(rounds):
            for i in idx:
                seg_touch(i, 12345)

    table = segment._last_touch

    def raw_store_only():
        for _ in range(rounds):
            for i in idx:
                table[i] = 12345

    return {
        "calls": count,
        "touch_ns": per_call(touches),
        "parts_ns": {
            "loop": per_call(loop_only),
            "encode_key": per_call(encode_only),
            "monotonic_ns_to_ms": per_call(clock_only),
            "ClientSegment.touch": per_call(segment_touch_only),
            "bare_8_byte_store": per_call(raw_store_only),
        },
    }


# --------------------------------------------------------------------------- wheeld: the parent


def run_wheeld(sizes: Sizes, seed: int, name_prefix: str = "bench", profile_dir: str | None = None,
               cprofile: bool = False, raw_dir: str | None = None, daemon_args: tuple = ()) -> dict:
    ctx = multiprocessing.get_context("fork")
    names = ["preload", "burst", "steady", "touch"]
    workdir = Path(tempfile.mkdtemp(prefix="wheeld-e2e-"))
    name = unique_name(name_prefix)
    daemon = bench_daemon(workdir, name, sizes.capacity,
                          cprofile_path=os.path.join(profile_dir, "daemon.prof") if profile_dir and cprofile else None,
                          extra_args=daemon_args)
    procs = []
    sampler = None
    close_arena = None
    spies = []
    try:
        daemon.start(timeout_s=20)
        import psutil

        daemon_ps = psutil.Process(daemon.proc.pid)
        phases = Phases(ctx, names)
        client_profile = profile_dir if cprofile else None
        procs = [ctx.Process(target=wheeld_client, args=(c, daemon.socket_path, sizes, seed, phases, client_profile),
                             daemon=True) for c in range(sizes.clients)]
        for p in procs:
            p.start()
        read_pending, counter, close_arena = arena_reader(name)
        sampler = PendingSampler(read_pending).start()
        timeout = 120.0
        out: dict = {"daemon_name": name, "daemon_args": list(daemon_args)}

        phases.wait(procs, "arrive", "preload", timeout)
        sampler.phase = "preload"
        phases.release("preload")

        infos = phases.wait(procs, "arrive", "burst", timeout)
        if profile_dir:
            spies = start_pyspy(profile_dir, "burst", {"daemon": daemon.proc.pid,
                                                       **{f"client{c}": infos[c]["pid"] for c in infos}})
        cpu_before = daemon_ps.cpu_times()
        commands_before = counter("commands_total")
        burst_counters0 = {k: counter(k) for k in _STEADY_COUNTERS}
        sampler.phase = "burst"
        t0_ns = phases.release("burst")

        phases.wait(procs, "arrive", "steady", timeout)
        cpu_after = daemon_ps.cpu_times()
        commands_after = counter("commands_total")
        burst_counters1 = {k: counter(k) for k in _STEADY_COUNTERS}
        stop_pyspy(spies)
        spies = []
        if profile_dir:
            spies = start_pyspy(profile_dir, "steady", {"daemon": daemon.proc.pid})
        sampler.phase = "steady"
        steady_ns = phases.release("steady")
        steady_cpu0 = daemon_ps.cpu_times()
        steady_counters0 = {k: counter(k) for k in _STEADY_COUNTERS}

        phases.wait(procs, "arrive", "touch", timeout + sizes.steady_s)
        steady_cpu1 = daemon_ps.cpu_times()
        steady_counters1 = {k: counter(k) for k in _STEADY_COUNTERS}
        stop_pyspy(spies)
        spies = []
        sampler.phase = "touch"
        touch_ns = phases.release("touch")

        results = phases.wait(procs, "result", None, timeout)
        pending = sampler.stop()
        sampler = None
        counters = {k: counter(k) for k in ("pending", "commands_total", "delivered_total", "expirations_total",
                                            "wakeups_total", "cascades_total", "rearms_total", "cancels_total",
                                            "cancel_misses_total", "adds_total")}
    finally:
        stop_pyspy(spies)
        if sampler is not None:
            sampler.stop()
        stop_processes(procs)
        if close_arena is not None:
            close_arena()
        daemon.cleanup(signal.SIGTERM)  # a graceful stop writes the cProfile stats
        log_text = daemon.log()
        shutil.rmtree(workdir, ignore_errors=True)

    clients = [results[c] for c in sorted(results)]
    raw_dir = raw_dir or profile_dir
    if raw_dir:  # the raw expirations, for a look at when the late ones happen
        np.savez(os.path.join(raw_dir, "wheeld-received.npz"), t0_ns=t0_ns, steady_ns=steady_ns,
                 **{f"{k}_{c['client']}": v for c in clients for k, v in c["received"].items()})
    ops = sum(c["burst"]["ops"] for c in clients)
    end_ns = max(c["burst"]["end_ns"] for c in clients)
    wall_s = (end_ns - t0_ns) / 1e9
    daemon_cpu_s = (cpu_after.user + cpu_after.system) - (cpu_before.user + cpu_before.system)
    client_cpu_s = sum(c["burst"]["cpu_s"] for c in clients)
    t0_ms = t0_ns // 1_000_000
    steady_ms = steady_ns // 1_000_000
    steady_window_s = (touch_ns - steady_ns) / 1e9
    steady_ops = max(1, sum(c["steady"]["ops"] for c in clients))
    windows = {"burst": (t0_ms, end_ns // 1_000_000),
               "steady": (steady_ms, steady_ms + int(sizes.steady_s * 1000))}
    out.update({
        "ops": ops,
        "wall_s": round(wall_s, 4),
        "ops_per_s": round(ops / wall_s),
        "issue_s": round((max(c["burst"]["issued_ns"] for c in clients) - t0_ns) / 1e9, 4),
        "preload_adds_per_s": round(sum(c["preload"]["ops"] for c in clients)
                                    / max(c["preload"]["seconds"] for c in clients)),
        "cpu_us_per_op": {"daemon": round(daemon_cpu_s / ops * 1e6, 3),
                          "clients": round(client_cpu_s / ops * 1e6, 3),
                          "daemon_commands_applied": commands_after - commands_before},
        # Derived, not measured: what the CPU cost per op allows on this machine if nothing else ran:
        # the daemon is one thread; daemon + clients share os.cpu_count() cores.
        "cpu_ceiling_ops_per_s": round(min(1e6 / max(daemon_cpu_s / ops * 1e6, 1e-9),
                                           (os.cpu_count() or 1) * ops / max(daemon_cpu_s + client_cpu_s, 1e-9))),
        "steady_ops": sum(c["steady"]["ops"] for c in clients),
        "steady_cpu_share": {"daemon": round(((steady_cpu1.user + steady_cpu1.system)
                                              - (steady_cpu0.user + steady_cpu0.system)) / sizes.steady_s, 3),
                             "clients": [round(c["steady"]["cpu_s"] / sizes.steady_s, 3) for c in clients]},
        # the daemon's work in the burst (from the release to the last client's flush and arrival)
        "burst_daemon_counts": {k: burst_counters1[k] - burst_counters0[k] for k in _STEADY_COUNTERS},
        "burst_daemon_busy_share": round(daemon_cpu_s / wall_s, 3),
        # the daemon's work in the steady phase, per second (counters from the arena header; the
        # window is a little longer than steady_s: it ends when both clients finished their grace)
        "steady_daemon_per_s": {k: round((steady_counters1[k] - steady_counters0[k]) / steady_window_s)
                                for k in _STEADY_COUNTERS},
        # daemon CPU in the steady phase per client op issued in it (the ops, their
        # expirations and deliveries, the acks, the idle wake-ups: all it does there)
        "steady_daemon_cpu_us_per_op": round(
            ((steady_cpu1.user + steady_cpu1.system) - (steady_cpu0.user + steady_cpu0.system)) * 1e6
            / max(1, sum(c["steady"]["ops"] for c in clients)), 3),
        # of it, in the kernel (system time: the wake-ups, the socket sends) and in the process
        "steady_daemon_cpu_split_us_per_op": {
            "user": round((steady_cpu1.user - steady_cpu0.user) * 1e6 / steady_ops, 3),
            "system": round((steady_cpu1.system - steady_cpu0.system) * 1e6 / steady_ops, 3)},
        "steady_daemon_cpu_us_per_wakeup": round(
            ((steady_cpu1.user + steady_cpu1.system) - (steady_cpu0.user + steady_cpu0.system)) * 1e6
            / max(1, steady_counters1["wakeups_total"] - steady_counters0["wakeups_total"]), 1),
        "cancel_hits": sum(c["burst"]["cancel_hits"] for c in clients),
        "lateness": lateness_report([c["received"] for c in clients], windows),
        "pending": pending,
        "touch": clients[0]["touch"],
        "daemon_counters": counters,
    })
    warnings = [line for line in log_text.splitlines() if " WARNING " in line or " ERROR " in line]
    if warnings:
        out["daemon_log_warnings"] = warnings[:20]
    return out


_STEADY_COUNTERS = ("wakeups_total", "commands_total", "expirations_total",
                    "delivered_total", "cascades_total")


def start_pyspy(profile_dir: str, phase: str, pids: dict[str, int]) -> list:
    exe = shutil.which("py-spy")
    if exe is None:
        print("py-spy not found (pip install py-spy): no sampling profile", file=sys.stderr)
        return []
    spies = []
    for label, pid in pids.items():
        path = os.path.join(profile_dir, f"pyspy-{label}-{phase}.txt")
        spies.append(subprocess.Popen([exe, "record", "--pid", str(pid), "--format", "raw", "--rate", "500",
                                       "--idle", "--nonblocking", "-o", path], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
    time.sleep(1.0)  # py-spy needs a moment to attach
    return spies


def _frame_name(frame: str) -> str:
    """``func (path/file.py:123)`` -> ``func (file.py)``."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rstrip(')').split(':')[0].split('/')[-1]})"


def summarize_pyspy(path: str, top: int = 30) -> str:
    """Inclusive and self shares of a ``py-spy record --format raw`` file (idle samples included)."""
    import collections

    inclusive: collections.Counter = collections.Counter()
    self_time: collections.Counter = collections.Counter()
    total = 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            if not stack:
                continue
            n = int(count)
            total += n
            frames = [_frame_name(fr) for fr in stack.split(";")]
            for name in set(frames):
                inclusive[name] += n
            self_time[frames[-1]] += n
    lines = [f"{path}: {total} samples"]
    lines += ["  inclusive:"] + [f"  {100 * v / total:6.1f}%  {k}" for k, v in inclusive.most_common(top)]
    lines += ["  self:"] + [f"  {100 * v / total:6.1f}%  {k}" for k, v in self_time.most_common(top)]
    return "\n".join(lines)


def stop_pyspy(spies: list) -> None:
    for spy in spies:
        if spy.poll() is None:
            os.kill(spy.pid, signal.SIGINT)
            try:
                spy.wait(20)
            except subprocess.TimeoutExpired:
                os.kill(spy.pid, signal.SIGKILL)
                spy.wait(5)


# --------------------------------------------------------------------------- asyncio baseline


def asyncio_process(sizes: Sizes, seed: int, results) -> None:
    try:
        results.put(("ok", _asyncio_run(sizes, seed)))
    except BaseException:  # noqa: BLE001
        results.put(("error", traceback.format_exc()))


def _asyncio_run(sizes: Sizes, seed: int) -> dict:
    import asyncio

    plans = [make_plan(c, sizes, seed) for c in range(sizes.clients)]
    return asyncio.run(_asyncio_main(plans, sizes))


async def _asyncio_main(plans: list[Plan], sizes: Sizes) -> dict:
    import asyncio

    loop = asyncio.get_running_loop()
    handles: dict = {}
    deadlines: list[float] = []
    fired: list[float] = []
    d_append, f_append = deadlines.append, fired.append
    ltime = loop.time
    call_at = loop.call_at

    def fire(key, deadline):
        d_append(deadline)
        f_append(ltime())
        del handles[key]

    def add(key, delay_ms):
        handle = handles.get(key)
        if handle is not None:
            handle.cancel()
        deadline = ltime() + delay_ms / 1000.0
        handles[key] = call_at(deadline, fire, key, deadline)

    def cancel(key):
        handle = handles.pop(key, None)
        if handle is None:
            return False
        handle.cancel()
        return True

    pending_samples: dict[str, list[int]] = {"burst": [], "steady": []}
    out: dict = {}

    # 1. preload (both clients' keys)
    t = time.perf_counter()
    count = 0
    for plan in plans:
        for key, delay in zip(plan.preload_keys, plan.preload_delays):
            add(key, delay)
            count += 1
    out["preload_adds_per_s"] = round(count / (time.perf_counter() - t))
    await asyncio.sleep(0.05)

    # 2. burst: both plans interleaved chunk by chunk, a loop iteration between chunks
    chunks = []
    for start in range(0, max(len(p.burst) for p in plans), POLL_EVERY):
        for plan in plans:
            if start < len(plan.burst):
                chunks.append(plan.burst[start: start + POLL_EVERY])
    ops = sum(len(c) for c in chunks)
    t0 = ltime()
    cpu0 = time.process_time()
    for n, chunk in enumerate(chunks):
        for op, key, delay in chunk:
            if op == OP_CANCEL:
                cancel(key)
            else:
                add(key, delay)
        if n % 16 == 0:
            pending_samples["burst"].append(len(handles))
        await asyncio.sleep(0)
    t1 = ltime()
    cpu = time.process_time() - cpu0
    out.update({"ops": ops, "wall_s": round(t1 - t0, 4), "ops_per_s": round(ops / (t1 - t0)),
                "cpu_us_per_op": round(cpu / ops * 1e6, 3)})

    # 3. steady: paced, total rate = clients x per-client rate
    await asyncio.sleep(0.05)
    steady = [op for group in zip(*(p.steady for p in plans)) for op in group]
    rate = sizes.steady_rate_per_client * len(plans)
    start = ltime()
    end = start + sizes.steady_s
    i = 0
    n = len(steady)
    last_sample = start
    cpu_steady0 = time.process_time()
    while True:
        now = ltime()
        if now >= end:
            break
        due = min(n, int((now - start) * rate))
        while i < due:
            op, key, delay = steady[i]
            if op == OP_CANCEL:
                cancel(key)
            else:
                add(key, delay)
            i += 1
        if now - last_sample >= 0.01:
            pending_samples["steady"].append(len(handles))
            last_sample = now
        await asyncio.sleep(max(0.0, 0.001 - (ltime() - now)))
    out["steady_cpu_share"] = round((time.process_time() - cpu_steady0) / sizes.steady_s, 3)
    await asyncio.sleep(GRACE_S)
    out["steady_ops"] = i
    d = np.array(deadlines)
    f = np.array(fired)
    late_ms = (f - d) * 1000.0
    windows = {"burst": (t0, t1), "steady": (start, end)}
    lat = {"received_total": int(len(d)), "early_total": int((late_ms < 0).sum())}
    for name, (lo, hi) in windows.items():
        mask = (d >= lo) & (d <= hi)
        stats = lateness_stats(late_ms[mask])
        lat[name] = {"window_ms": [int(lo * 1000), int(hi * 1000)], "fired": stats, "recv": stats}
    out["lateness"] = lat
    out["pending"] = {phase: {"min": min(v), "mean": round(statistics.fmean(v)), "max": max(v), "samples": len(v)}
                      for phase, v in pending_samples.items() if v}
    for handle in handles.values():
        handle.cancel()
    return out


def run_asyncio(sizes: Sizes, seed: int) -> dict:
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    proc = ctx.Process(target=asyncio_process, args=(sizes, seed, results), daemon=True)
    proc.start()
    try:
        deadline = time.monotonic() + 180 + sizes.steady_s
        while True:
            try:
                kind, payload = results.get(timeout=0.5)
                break
            except queue_module.Empty:
                if proc.exitcode not in (None, 0):
                    raise RuntimeError(f"asyncio process exited with {proc.exitcode}") from None
                if time.monotonic() > deadline:
                    raise TimeoutError("asyncio baseline did not finish") from None
        if kind == "error":
            raise RuntimeError(f"asyncio baseline failed:\n{payload}")
        return payload
    finally:
        stop_processes([proc])


# --------------------------------------------------------------------------- report


def spread(values: list[float], higher_is_better: bool) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {"best": None, "worst": None, "median": None, "all": []}
    best = max(values) if higher_is_better else min(values)
    worst = min(values) if higher_is_better else max(values)
    return {"best": best, "worst": worst, "median": statistics.median(values), "all": values}


def get(d: dict, *path):
    for p in path:
        if d is None:
            return None
        d = d.get(p) if isinstance(d, dict) else None
    return d


def summarize(runs: list[dict]) -> dict:
    summary: dict = {}
    for system in WHEELD_SYSTEMS:
        if not any(system in r for r in runs):
            continue
        w = [r[system] for r in runs if system in r]
        summary[system] = {
            "ops_per_s": spread([x["ops_per_s"] for x in w], True),
            "steady_recv_p99_ms": spread([get(x, "lateness", "steady", "recv", "p99") for x in w], False),
            "steady_fired_p99_ms": spread([get(x, "lateness", "steady", "fired", "p99") for x in w], False),
            "burst_recv_p99_ms": spread([get(x, "lateness", "burst", "recv", "p99") for x in w], False),
            "steady_daemon_cpu_us_per_op": spread([x.get("steady_daemon_cpu_us_per_op") for x in w], False),
            "touch_ns": spread([get(x, "touch", "touch_ns") for x in w], False),
            "early_total": sum(x["lateness"]["early_total"] for x in w),
        }
    if any("redis" in r for r in runs):
        rd = [r["redis"] for r in runs if "redis" in r]
        summary["redis"] = {
            "ops_per_s": spread([x["ops_per_s"] for x in rd], True),
            "unpipelined_ops_per_s": spread([x.get("unpipelined", {}).get("ops_per_s") for x in rd], True),
            "steady_recv_p99_ms": spread([get(x, "lateness", "steady", "recv", "p99") for x in rd], False),
        }
    if any("asyncio" in r for r in runs):
        a = [r["asyncio"] for r in runs if "asyncio" in r]
        summary["asyncio"] = {
            "ops_per_s": spread([x["ops_per_s"] for x in a], True),
            "steady_recv_p99_ms": spread([get(x, "lateness", "steady", "recv", "p99") for x in a], False),
        }
    if "wheeld" in summary and "redis" in summary:
        ratios = [r["wheeld"]["ops_per_s"] / r["redis"]["ops_per_s"] for r in runs if "wheeld" in r and "redis" in r]
        summary["wheeld_over_redis"] = spread([round(x, 2) for x in ratios], True)
        # the target's figure: each system at its best (a per-run ratio can flatter either side)
        summary["wheeld_over_redis"]["of_bests"] = round(summary["wheeld"]["ops_per_s"]["best"]
                                                         / summary["redis"]["ops_per_s"]["best"], 2)
    return summary


NOT_COMPARABLE = "not comparable: not the full sizes"


def targets(summary: dict, comparable: bool = True) -> list[dict]:
    """The target rows; ``comparable`` False (a run with other sizes than FULL's): each
    row's figure is given, its verdict ``met`` is None and ``comparable`` False."""
    out = []
    w = summary.get("wheeld")
    if w is None:
        return out

    def row(name, target, value, met, basis):
        verdict = bool(met) if value is not None and comparable else None
        out.append({"target": name, "goal": target, "measured": value, "met": verdict, "comparable": comparable,
                    "basis": basis})

    ops = w["ops_per_s"]["best"]
    row("end-to-end timer ops/s", f">= {TARGET_OPS_PER_S:,}", ops, ops is not None and ops >= TARGET_OPS_PER_S,
        "best run; 2 client processes, 60/20/20 add/re-arm/cancel, until flush() returned")
    worst = w["ops_per_s"]["worst"]
    row("  (every run)", f">= {TARGET_OPS_EVERY_RUN:,}", worst, worst is not None and worst >= TARGET_OPS_EVERY_RUN,
        "worst run")
    if "wheeld_over_redis" in summary:
        ratio = summary["wheeld_over_redis"]["of_bests"]
        row("x Redis pipelined", f">= {TARGET_REDIS_RATIO}x", ratio, ratio >= TARGET_REDIS_RATIO,
            "best wheeld ops/s / best Redis (pipeline 1000) ops/s over the repeats, same plan")
    p99 = w["steady_recv_p99_ms"]["worst"]
    row("lateness p99, ~100k pending", f"<= {TARGET_P99_MS} ms", p99, p99 is not None and p99 <= TARGET_P99_MS,
        "steady phase, receive time - deadline_ms in the client, worst run")
    p99f = w["steady_fired_p99_ms"]["worst"]
    row("  (same, fired_ms - deadline_ms)", f"<= {TARGET_FIRED_P99_MS} ms", p99f,
        p99f is not None and p99f <= TARGET_FIRED_P99_MS, "steady phase, daemon's fired_ms, worst run")
    p99b = w["burst_recv_p99_ms"]["best"]
    row("  (same, under burst load)", f"<= {TARGET_P99_MS} ms", p99b, p99b is not None and p99b <= TARGET_P99_MS,
        "burst phase (both cores saturated), receive time, best run; informational")
    cpu = w["steady_daemon_cpu_us_per_op"]["best"]
    row("daemon CPU per op, steady", f"<= {TARGET_STEADY_DAEMON_US_PER_OP} us", cpu,
        cpu is not None and cpu <= TARGET_STEADY_DAEMON_US_PER_OP,
        "steady phase: daemon CPU time / client ops issued in it (expirations, acks, wake-ups included), best run")
    touch = w["touch_ns"]["best"]
    row("touch", f"<= {TARGET_TOUCH_NS:.0f} ns", touch, touch is not None and touch <= TARGET_TOUCH_NS,
        "ns per w.touch(key) in a tight loop, best of 3 x runs")
    return out


def fmt(value, unit="", digits=2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not value.is_integer():
        return f"{value:,.{digits}f}{unit}"
    return f"{int(value):,}{unit}"


def lat_cell(lat: dict | None, phase: str, which: str) -> str:
    stats = get(lat, phase, which)
    if not stats or not stats.get("count"):
        return "-"
    return f"{stats['p50']:.2f}/{stats['p99']:.2f}/{stats['max']:.1f}"


def print_table(runs: list[dict], summary: dict, target_rows: list[dict]) -> None:
    print()
    print("per run: ops/s end to end; lateness p50/p99/max in ms (fired = daemon/pop time, recv = client receive time)")
    header = (f"{'run':>3} {'system':<20} {'ops/s':>11} {'steady fired':>17} {'steady recv':>17} "
              f"{'burst recv':>19} {'pending steady':>16}")
    print(header)
    print("-" * len(header))
    for i, run in enumerate(runs):
        for system, label in (("wheeld", "wheeld (2 clients)"), ("wheeld-py", "  Python path"),
                              ("redis", "redis pipe 1000"), ("asyncio", "asyncio call_at")):
            r = run.get(system)
            if r is None:
                continue
            lat = r.get("lateness")
            pend = get(r, "pending", "steady")
            pend_s = f"{pend['min'] // 1000}k-{pend['max'] // 1000}k" if pend else "-"
            print(f"{i + 1:>3} {label:<20} {fmt(r['ops_per_s']):>11} {lat_cell(lat, 'steady', 'fired'):>17} "
                  f"{lat_cell(lat, 'steady', 'recv'):>17} {lat_cell(lat, 'burst', 'recv'):>19} {pend_s:>16}")
            if system == "redis" and "unpipelined" in r:
                print(f"{i + 1:>3} {'redis unpipelined':<20} {fmt(r['unpipelined']['ops_per_s']):>11}")
            if system in WHEELD_SYSTEMS:
                cpu = r["cpu_us_per_op"]
                print(f"{'':>3} {'':<20} cpu us/op: daemon {cpu['daemon']}, clients {cpu['clients']}, "
                      f"daemon steady {r.get('steady_daemon_cpu_us_per_op')} "
                      f"(ceiling {fmt(r['cpu_ceiling_ops_per_s'])} ops/s); touch {r['touch']['touch_ns']} ns; "
                      f"early {r['lateness']['early_total']}")
    print()
    for system, s in summary.items():
        if system == "wheeld_over_redis":
            print(f"wheeld / redis: {s['of_bests']}x of the bests; per run {s['worst']}-{s['best']}x")
            continue
        ops = s["ops_per_s"]
        print(f"{system}: ops/s best {fmt(ops['best'])}, spread {fmt(ops['worst'])}-{fmt(ops['best'])}"
              f" over {len(ops['all'])} run(s)")
    print()
    if target_rows and not target_rows[0]["comparable"]:
        print("these sizes are not the full run's: the figures below are not comparable with the targets")
    print(f"{'target':<34} {'goal':>12} {'measured':>12}  result")
    for t in target_rows:
        if not t["comparable"]:
            verdict = NOT_COMPARABLE
        else:
            verdict = "-" if t["met"] is None else ("met" if t["met"] else "NOT met")
        print(f"{t['target']:<34} {t['goal']:>12} {fmt(t['measured']):>12}  {verdict}")
    print()


# --------------------------------------------------------------------------- main


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m bench.e2e", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, one repeat (seconds)")
    parser.add_argument("--repeat", type=int, default=None, help="repeats of the whole run (default 3, quick 1)")
    parser.add_argument("--only", default="wheeld,wheeld-py,redis,asyncio",
                        help="comma list of wheeld, wheeld-py (the Python path), redis, asyncio")
    parser.add_argument("--out", default=None, help="JSON results path (default: e2e.json, see --save)")
    add_save_option(parser)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--name-prefix", default="bench",
                        help="daemon instance name prefix (segments /wheeld-PREFIX-PID-UUID-*)")
    parser.add_argument("--profile", default=None, metavar="DIR", help="py-spy recordings of the first repeat")
    parser.add_argument("--cprofile", action="store_true", help="with --profile: cProfile the daemon and clients too")
    parser.add_argument("--summarize", default=None, metavar="DIR", help="print the shares of DIR's py-spy files")
    parser.add_argument("--daemon-args", default="", metavar="ARGS",
                        help="extra wheeld flags, e.g. '--wheel-size 64' (recorded in the JSON)")
    parser.add_argument("--raw", default=None, metavar="DIR",
                        help="save wheeld's raw expirations of the first repeat (npz) and print its late-fire moments")
    for field in dataclasses.fields(Sizes):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=float if field.type in (float, "float") else int,
                            default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def build_sizes(args) -> Sizes:
    base = QUICK if args.quick else FULL
    overrides = {}
    for field in dataclasses.fields(Sizes):
        value = getattr(args, field.name)
        if value is not None:
            overrides[field.name] = float(value) if field.type in (float, "float") else int(value)
    return dataclasses.replace(base, **overrides)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.summarize:
        for path in sorted(Path(args.summarize).glob("pyspy-*.txt")):
            print(summarize_pyspy(str(path)))
        return 0
    sizes = build_sizes(args)
    repeat = args.repeat or (1 if args.quick else 3)
    systems = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(systems) - {*WHEELD_SYSTEMS, "redis", "asyncio"}
    if unknown:
        raise SystemExit(f"unknown system(s): {', '.join(sorted(unknown))}")
    for directory in (args.profile, args.raw):
        if directory:
            os.makedirs(directory, exist_ok=True)
    meta = {
        "git": git_state(),
        "command": " ".join(["python -m bench.e2e", *(argv if argv is not None else sys.argv[1:])]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "loadavg_before": [round(x, 2) for x in os.getloadavg()],
        "sizes": dataclasses.asdict(sizes),
        "repeat": repeat,
        "quick": args.quick,
        "comparable_to_targets": sizes == FULL,
        "profiled": bool(args.profile),
        "lateness_definitions": {
            "fired": "Expired.fired_ms - Expired.deadline_ms (daemon clock; Redis: pop request time; "
                     "asyncio: callback time)",
            "recv": "client monotonic time when poll() returned the item - deadline_ms (asyncio: callback time)",
            "steady": "expirations whose deadline lies in the steady phase (paced load, ~100k pending)",
            "burst": "expirations whose deadline lies in the burst phase (throughput run)",
        },
    }
    print(f"bench.e2e: {', '.join(systems)}; repeat {repeat}; load average {meta['loadavg_before']}; "
          f"{sizes.clients} clients x {sizes.burst_ops_per_client:,} burst ops, "
          f"{sizes.clients * sizes.preload_per_client:,} preloaded", flush=True)
    runs = []
    for i in range(repeat):
        run: dict = {"loadavg": [round(x, 2) for x in os.getloadavg()]}
        seed = args.seed + i
        if "wheeld" in systems:
            run["wheeld"] = run_wheeld(sizes, seed, args.name_prefix,
                                       profile_dir=args.profile if i == 0 else None, cprofile=args.cprofile,
                                       raw_dir=args.raw if i == 0 else None,
                                       daemon_args=tuple(shlex.split(args.daemon_args)))
            print(f"  run {i + 1}: wheeld {run['wheeld']['ops_per_s']:,} ops/s", flush=True)
        if "wheeld-py" in systems:
            run["wheeld-py"] = run_wheeld_python_path(args, seed)
            print(f"  run {i + 1}: wheeld, Python path {run['wheeld-py']['ops_per_s']:,} ops/s", flush=True)
        if "redis" in systems:
            from bench.redis_baseline import run_redis

            run["redis"] = run_redis(sizes, seed)
            print(f"  run {i + 1}: redis {run['redis']['ops_per_s']:,} ops/s", flush=True)
        if "asyncio" in systems:
            run["asyncio"] = run_asyncio(sizes, seed)
            print(f"  run {i + 1}: asyncio {run['asyncio']['ops_per_s']:,} ops/s", flush=True)
        runs.append(run)
    summary = summarize(runs)
    target_rows = targets(summary, comparable=sizes == FULL)
    print_table(runs, summary, target_rows)
    meta["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    out_path = Path(args.out) if args.out else results_path("e2e.json", args.save)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({"meta": meta, "runs": runs, "summary": summary, "targets": target_rows},
                                   indent=1, default=_json_default) + "\n")
    print(f"wrote {out_path}")
    if args.raw and "wheeld" in systems:
        print(late_moments(os.path.join(args.raw, "wheeld-received.npz"), sizes))
    return 0


def run_wheeld_python_path(args, seed: int) -> dict:
    """One wheeld run with the daemon and the clients on the Python path: this bench in a
    child process with ``WHEELD_PURE_PYTHON=1`` (the clients are forked from it)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "e2e-python-path.json")
        command = [sys.executable, "-m", "bench.e2e", "--only", "wheeld", "--repeat", "1", "--seed", str(seed),
                   "--name-prefix", args.name_prefix, "--out", out]
        if args.quick:
            command.append("--quick")
        if args.daemon_args:
            command += ["--daemon-args", args.daemon_args]
        env = dict(os.environ, WHEELD_PURE_PYTHON="1")
        subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL,
                       cwd=str(Path(__file__).resolve().parent.parent))
        with open(out) as f:
            return json.load(f)["runs"][0]["wheeld"]


def late_moments(path: str, sizes: Sizes, min_late_ms: int = 3) -> str:
    """When, in the steady phase, timers fired >= ``min_late_ms`` late: one line per daemon
    ``fired_ms`` (ms after the phase start, worst lateness, items). A period of 256 ms
    (tick 1 ms x 256 buckets) points at level-1 cascades."""
    data = np.load(path)
    start_ms = int(data["steady_ns"]) // 1_000_000
    clients = sorted({int(k.rsplit("_", 1)[1]) for k in data.files if k.startswith("deadline_ms_")})
    deadline = np.concatenate([data[f"deadline_ms_{c}"] for c in clients])
    fired = np.concatenate([data[f"fired_ms_{c}"] for c in clients])
    inside = (deadline >= start_ms) & (deadline <= start_ms + int(sizes.steady_s * 1000))
    deadline, fired = deadline[inside] - start_ms, fired[inside] - start_ms
    late = fired - deadline
    count_late = int((late >= min_late_ms).sum())
    lines = [f"steady phase: {len(late)} expirations, {count_late} fired >= {min_late_ms} ms late"]
    moments = np.unique(fired[late >= min_late_ms])
    for moment in moments.tolist():
        at = fired == moment
        lines.append(f"  fired at +{moment} ms (+{moment % 256} mod 256): worst {int(late[at].max())} ms late, "
                     f"{int(at.sum())} items")
    return "\n".join(lines)


def git_state() -> dict:
    """The commit measured, and which product files differed from it (the work tree is shared)."""
    repo = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--", "daemon", "client", "shm", "protocol"],
                                cwd=repo, capture_output=True, text=True, timeout=10).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return {"head": None, "dirty": None}
    return {"head": head, "dirty": [line[3:] for line in status]}


def _json_default(value):
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


if __name__ == "__main__":
    # Run the importable module, not __main__, so bench.redis_baseline shares its helpers.
    from bench.e2e import main as _main

    sys.exit(_main())
