"""Idle-connection detection for 100,000 connections: cost per touch and memory per connection.

    python bench/idle.py                 # 100k connections, ~8 minutes
    python bench/idle.py --quick         # 20k connections, shorter phases (~2 minutes)
    python bench/idle.py --variants asyncio-timer,lazy-timer,wheeld-daemon --repeat 3

N connections; report those that received nothing for ``idle_ms``.
Connections are simulated keys (ints), no sockets (bench/sockets.py runs real
ones). Each variant runs in its own process (clean memory figures), in an
asyncio event loop (the standard one), through the same phases:

* ``asyncio-timer``: one loop timer per connection, cancelled and re-created on
  every touch (``handle.cancel()`` + ``loop.call_later``; uvicorn does this with
  its keep-alive timer on every read);
* ``lazy-timer``: aiohttp's keep-alive: one loop timer per connection, and a
  touch only stores the time of the activity (a dict store); when the timer
  fires it is re-armed at ``last + idle`` if the key was active since
  (``RequestHandler._next_keepalive_close_time`` / ``_process_keepalive``);
* ``moving-wheel``: a timing wheel of 1 ms buckets in this process (one level:
  every deadline is within ``idle_ms``; Varghese and Lauck, SOSP 1987), and a
  touch *moves* the key to the bucket of its new deadline (two dict operations,
  O(1)); a loop timer advances it every ms while keys are tracked;
* ``deque``: gunicorn's gthread worker keeps keep-alive connections in a deque,
  which a fixed timeout keeps ordered by expiry (appends come in deadline
  order); it takes an active connection out with ``deque.remove`` (O(n)). Here
  a touch appends ``(deadline, key)`` and records the key's latest deadline,
  and a stale entry is skipped when it reaches the head (O(1) per touch, one
  entry per touch for ``idle_ms``); one loop timer at the head's deadline;
* ``scan``: a dict of last-activity times (a touch is one dict store) and one
  task that scans the whole dict every ``--scan-interval-ms`` (O(N) per scan);
* ``wheel``: :class:`wheeld.idle.IdleTracker` on its in-process wheel (lazy
  re-arm, a dict store per touch);
* ``wheeld-daemon``: :class:`wheeld.idle.IdleTracker` on a wheeld daemon
  (``add_idle``; ``touch`` is one 8-byte store into the client's shared touch
  table; the daemon re-arms lazily when the timer comes due). The daemon's CPU
  and memory are added to the variant's;
* ``none``: the driver alone (touch does nothing): the harness's own cost,
  subtracted from the all-in figures.

Phases, per variant:

1. *setup*: add N connections; CPU per connection, and memory per connection as
   the growth of the process's RSS (+ the daemon's RSS growth for wheeld-daemon;
   its arena of 64-byte records is allocated up front and counted as touched).
2. *touch*: ``--touches`` touches at full speed on random active connections
   (yielding to the loop every 1000, so asyncio's cleanup of cancelled timers is
   paid): CPU per touch.
3. *steady*: ``--duration-s`` (40 s) at a realistic ``--touch-rate`` (default
   20,000/s: 90% of the connections active, each touched every ~4.5 s
   round-robin; 10% silent) with ``idle_ms`` of 30 s, so timers come due inside
   the window: silent keys are reported, active ones re-armed. All-in CPU
   (process + daemon) per touch, minus the ``none`` driver; idle reports, and
   *early* reports: reported before ``idle_ms`` of real time since the key's
   last touch, with no slack (the driver notes ``time.monotonic_ns()`` just
   *before* each touch, so a variant that is never early by its own clock is
   never counted early); must be 0. The scan is up to one scan interval late.

Writes bench/runs/idle.json (``--save``: bench/results/) and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # python bench/idle.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import DaemonProcess, add_save_option, proc_cpu_s, results_path, rss_kb, unique_name  # noqa: E402

VARIANTS = ("none", "asyncio-timer", "lazy-timer", "moving-wheel", "deque", "scan", "wheel", "wheeld-daemon")




# =========================================================================== variants
class Detector:
    """add / touch / report idle keys; ``reports`` collects (key, monotonic ns)."""

    def __init__(self, idle_ms: int) -> None:
        self.idle_ms = idle_ms
        self.reports: list[tuple[int, int]] = []

    def on_idle(self, key) -> None:
        self.reports.append((key, time.monotonic_ns()))

    async def close(self) -> None:
        pass


class NoDetector(Detector):
    async def start(self):
        self.touch = lambda key: None
        return self

    def add(self, key) -> None:
        pass


class AsyncioTimers(Detector):
    """One loop timer per connection, cancelled and re-created on every touch."""

    async def start(self):
        loop = asyncio.get_running_loop()
        handles: dict[int, asyncio.TimerHandle] = {}
        idle_s, on_idle, call_later = self.idle_ms / 1000, self._fired, loop.call_later
        self.handles = handles

        def touch(key) -> None:
            handle = handles.get(key)
            if handle is not None:
                handle.cancel()
                handles[key] = call_later(idle_s, on_idle, key)

        def add(key) -> None:
            handles[key] = call_later(idle_s, on_idle, key)

        self.touch, self.add = touch, add
        return self

    def _fired(self, key) -> None:
        del self.handles[key]
        self.on_idle(key)


class PeriodicScan(Detector):
    """A dict of last-activity times and one task scanning it every ``scan_interval_ms``."""

    def __init__(self, idle_ms: int, scan_interval_ms: int) -> None:
        super().__init__(idle_ms)
        self.scan_interval_s = scan_interval_ms / 1000

    async def start(self):
        last: dict[int, int] = {}
        now_ns = time.monotonic_ns
        self.last = last

        def touch(key) -> None:
            if key in last:
                last[key] = now_ns()

        def add(key) -> None:
            last[key] = now_ns()

        self.touch, self.add = touch, add
        self._task = asyncio.get_running_loop().create_task(self._scan())
        return self

    async def _scan(self) -> None:
        idle_ns = self.idle_ms * 1_000_000
        while True:
            await asyncio.sleep(self.scan_interval_s)
            cutoff = time.monotonic_ns() - idle_ns
            idle = [key for key, at in self.last.items() if at <= cutoff]
            for key in idle:
                del self.last[key]
                self.on_idle(key)

    async def close(self) -> None:
        self._task.cancel()


class LazyTimers(Detector):
    """aiohttp's keep-alive: a loop timer per connection; a touch stores the time; the timer re-arms lazily."""

    async def start(self):
        loop = asyncio.get_running_loop()
        last: dict[int, float] = {}  # key -> loop time of its last activity
        handles: dict[int, asyncio.TimerHandle] = {}
        idle_s, call_at, now = self.idle_ms / 1000, loop.call_at, loop.time
        self.last, self.handles = last, handles

        def fire(key) -> None:
            close_time = last[key] + idle_s
            if now() < close_time:  # active since it was armed: re-arm at the new close time
                handles[key] = call_at(close_time, fire, key)
                return
            del last[key], handles[key]
            self.on_idle(key)

        def touch(key) -> None:
            if key in last:
                last[key] = now()

        def add(key) -> None:
            t = last[key] = now()
            old = handles.get(key)
            if old is not None:
                old.cancel()
            handles[key] = call_at(t + idle_s, fire, key)

        self.touch, self.add = touch, add
        return self


class MovingWheel(Detector):
    """A one-level wheel of 1 ms buckets in this process; a touch moves the key to its new bucket."""

    async def start(self):
        loop = asyncio.get_running_loop()
        # at least twice as many buckets as ms in idle_ms: a deadline never lands in a bucket
        # that the cursor still has to empty for an earlier turn, unless the loop lags > idle_ms
        size = 1 << max(4, (2 * self.idle_ms).bit_length())
        mask = size - 1
        buckets: list[dict[int, None] | None] = [None] * size  # created when first used
        where: dict[int, int] = {}  # key -> its deadline (ms); its bucket is deadline & mask
        idle_ms, now_ns = self.idle_ms, time.monotonic_ns
        self.where, self.buckets = where, buckets
        self._cursor = -(-now_ns() // 1_000_000)  # the next ms to look at
        self._timer = None

        def touch(key) -> None:
            old = where.get(key)
            if old is not None:
                deadline = -(-now_ns() // 1_000_000) + idle_ms  # rounded up: never early
                if deadline != old:
                    del buckets[old & mask][key]
                    bucket = buckets[deadline & mask]
                    if bucket is None:
                        bucket = buckets[deadline & mask] = {}
                    bucket[key] = None
                    where[key] = deadline

        def add(key) -> None:
            deadline = -(-now_ns() // 1_000_000) + idle_ms
            where[key] = deadline
            bucket = buckets[deadline & mask]
            if bucket is None:
                bucket = buckets[deadline & mask] = {}
            bucket[key] = None
            if self._timer is None:
                self._cursor = max(self._cursor, now_ns() // 1_000_000)  # nothing was tracked until now
                self._schedule()

        def tick() -> None:
            self._timer = None
            now_ms = now_ns() // 1_000_000
            while self._cursor <= now_ms:
                bucket = buckets[self._cursor & mask]
                if bucket is not None:
                    buckets[self._cursor & mask] = None
                    for key in bucket:
                        if where[key] <= now_ms:
                            del where[key]
                            self.on_idle(key)
                        else:  # a later turn's deadline (only if the loop lagged idle_ms): keep it
                            kept = buckets[self._cursor & mask]
                            if kept is None:
                                kept = buckets[self._cursor & mask] = {}
                            kept[key] = None
                self._cursor += 1
            if where:
                self._schedule()

        self.touch, self.add, self._tick, self._loop = touch, add, tick, loop
        return self

    def _schedule(self) -> None:
        delay_s = max(0.0, (self._cursor * 1_000_000 - time.monotonic_ns()) / 1e9)
        self._timer = self._loop.call_later(delay_s, self._tick)

    async def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


class ExpiryDeque(Detector):
    """gunicorn gthread's keep-alive deque, with lazy removal: a touch appends, stale entries are skipped."""

    async def start(self):
        loop = asyncio.get_running_loop()
        queue: collections.deque[tuple[int, int]] = collections.deque()  # (deadline ns, key), in deadline order
        latest: dict[int, int] = {}  # key -> its current deadline (ns)
        idle_ns, now_ns = self.idle_ms * 1_000_000, time.monotonic_ns
        self.queue, self.latest = queue, latest
        self._timer = None

        def touch(key) -> None:
            if key in latest:
                deadline = now_ns() + idle_ns
                latest[key] = deadline
                queue.append((deadline, key))

        def add(key) -> None:
            deadline = now_ns() + idle_ns
            latest[key] = deadline
            queue.append((deadline, key))
            if self._timer is None:
                self._arm(deadline)

        def expire() -> None:
            self._timer = None
            now = now_ns()
            while queue and queue[0][0] <= now:
                deadline, key = queue.popleft()
                if latest.get(key) == deadline:  # not touched since this entry: idle
                    del latest[key]
                    self.on_idle(key)
            if queue:
                self._arm(queue[0][0])

        self.touch, self.add, self._expire, self._loop = touch, add, expire, loop
        return self

    def _arm(self, deadline_ns: int) -> None:
        self._timer = self._loop.call_later(max(0.0, (deadline_ns - time.monotonic_ns()) / 1e9), self._expire)

    async def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


class TrackerDetector(Detector):
    """wheeld.idle.IdleTracker, on the in-process wheel or on a daemon."""

    def __init__(self, idle_ms: int, socket_path: str | None) -> None:
        super().__init__(idle_ms)
        self.socket_path = socket_path
        self.client = None

    async def start(self):
        import wheeld
        from wheeld.idle import IdleTracker

        if self.socket_path:
            self.client = await wheeld.connect_async(self.socket_path, group=f"idle-bench-{os.getpid()}")
        self.tracker = IdleTracker(self.idle_ms, on_idle=self.on_idle, client=self.client)
        self.touch, self._add = self.tracker.touch, self.tracker.add
        return self

    def add(self, key) -> None:
        self._add(key)

    async def settle(self) -> None:
        await self.tracker.flush(timeout_s=60)

    async def close(self) -> None:
        await self.tracker.aclose()
        if self.client is not None:
            await self.client.close()


def make_detector(variant: str, spec: dict) -> Detector:
    if variant == "none":
        return NoDetector(spec["idle_ms"])
    if variant == "asyncio-timer":
        return AsyncioTimers(spec["idle_ms"])
    if variant == "lazy-timer":
        return LazyTimers(spec["idle_ms"])
    if variant == "moving-wheel":
        return MovingWheel(spec["idle_ms"])
    if variant == "deque":
        return ExpiryDeque(spec["idle_ms"])
    if variant == "scan":
        return PeriodicScan(spec["idle_ms"], spec["scan_interval_ms"])
    if variant == "wheeld-daemon":
        return TrackerDetector(spec["idle_ms"], spec["socket"])
    if variant == "wheel":
        return TrackerDetector(spec["idle_ms"], None)
    raise ValueError(variant)


# =========================================================================== one variant (child process)
async def run_variant(spec: dict) -> dict:
    import numpy as np

    n, variant = spec["connections"], spec["variant"]
    daemon_pid = spec.get("daemon_pid")
    rng = np.random.default_rng(spec.get("seed", 1))
    keys = list(range(1, n + 1))
    n_active = int(n * spec["active_fraction"])
    active = rng.permutation(n_active) + 1  # keys 1..n_active are active, the rest stay silent
    loop = asyncio.get_running_loop()
    out: dict = {"variant": variant, "connections": n, "idle_ms": spec["idle_ms"]}

    # ---- phase 1: setup (create the detector, add every connection)
    rss0 = rss_kb()
    daemon_rss0 = rss_kb(daemon_pid) if daemon_pid else 0
    cpu0 = time.process_time()
    detector = await make_detector(variant, spec).start()
    add = detector.add
    settle = getattr(detector, "settle", None)
    for start in range(0, n, 8192):  # a daemon client's ring holds 16k commands: let it drain
        for key in keys[start : start + 8192]:
            add(key)
        if settle is not None:
            await settle()
    out["setup_us_per_connection"] = (time.process_time() - cpu0) / n * 1e6
    out["rss_bytes_per_connection"] = (rss_kb() - rss0) * 1024 / n
    if daemon_pid:
        out["daemon_rss_bytes_per_connection"] = (rss_kb(daemon_pid) - daemon_rss0) * 1024 / n
    last_touch_ns = np.full(n + 1, time.monotonic_ns(), dtype=np.int64)

    # ---- phase 2: touches at full speed (the per-touch cost)
    touch = detector.touch
    m = spec["touches"]
    order = rng.choice(active, size=m).tolist()
    daemon_cpu0 = proc_cpu_s(daemon_pid) if daemon_pid else 0.0
    cpu0 = time.process_time()
    for start in range(0, m, 1000):
        for key in order[start:start + 1000]:
            touch(key)
        await asyncio.sleep(0)  # let the loop run (asyncio purges cancelled timers from its heap here)
    cpu_touch = time.process_time() - cpu0
    out["touch_us"] = cpu_touch / m * 1e6
    if daemon_pid:
        out["touch_daemon_us"] = (proc_cpu_s(daemon_pid) - daemon_cpu0) / m * 1e6
    # every variant starts phase 3 from the same state: all keys tracked and just touched
    for key, _at in detector.reports:
        add(key)  # reported during phase 1-2 (a slow machine): track it again
    if hasattr(detector, "settle"):
        await detector.settle()
    for key in keys:
        last_touch_ns[key] = time.monotonic_ns()  # just before the touch: the early check has no slack
        touch(key)

    # ---- phase 3: steady state at a realistic rate
    rate, duration_s = spec["touch_rate"], spec["duration_s"]
    round_robin = active.tolist()
    position = 0
    batch_s = 0.01
    per_batch = rate * batch_s
    owed = 0.0
    touches = 0
    reports_before = len(detector.reports)
    daemon_cpu0 = proc_cpu_s(daemon_pid) if daemon_pid else 0.0
    cpu0 = time.process_time()
    wall0 = loop.time()
    next_batch = wall0
    now_ns = time.monotonic_ns
    while True:
        now = loop.time()
        if now - wall0 >= duration_s:
            break
        owed += per_batch
        k = int(owed)
        owed -= k
        for _ in range(k):
            key = round_robin[position]
            position += 1
            if position == n_active:
                position = 0
            last_touch_ns[key] = now_ns()  # just before the touch (see the early check)
            touch(key)
        touches += k
        next_batch += batch_s
        await asyncio.sleep(max(0.0, next_batch - loop.time()))
    wall = loop.time() - wall0
    cpu = time.process_time() - cpu0
    daemon_cpu = (proc_cpu_s(daemon_pid) - daemon_cpu0) if daemon_pid else 0.0
    reports = detector.reports[reports_before:]
    idle_ns = spec["idle_ms"] * 1_000_000
    # idle for: from the key's last touch to its report; anything under idle_ms is early (no slack)
    idle_for_ns = sorted(at - int(last_touch_ns[key]) for key, at in reports)
    idle_for_ms = [v / 1e6 for v in idle_for_ns]
    early = sum(1 for v in idle_for_ns if v < idle_ns)
    silent_reported = sum(1 for key, _at in reports if key > n_active)
    out.update({
        "steady_touches": touches, "steady_wall_s": wall, "steady_cpu_s": cpu, "steady_daemon_cpu_s": daemon_cpu,
        "steady_cpu_cores": (cpu + daemon_cpu) / wall, "steady_us_per_touch": (cpu + daemon_cpu) / touches * 1e6,
        "idle_reports": len(reports), "silent_reported": silent_reported, "silent": n - n_active,
        "active_reported": len(reports) - silent_reported, "early_reports": early,
        "earliest_report_ms_before_idle": (idle_ns - idle_for_ns[0]) / 1e6 if idle_for_ns else None,
        "report_lateness_ms": {
            "p50": idle_for_ms[len(idle_for_ms) // 2] - spec["idle_ms"] if idle_for_ms else None,
            "p99": idle_for_ms[int(len(idle_for_ms) * 0.99)] - spec["idle_ms"] if idle_for_ms else None,
            "max": idle_for_ms[-1] - spec["idle_ms"] if idle_for_ms else None,
        },
    })
    await detector.close()
    return out


# =========================================================================== parent
def start_daemon(connections: int, workdir: str) -> DaemonProcess:
    """A wheeld with room for ``connections`` idle timers, on a socket in ``workdir``."""
    return DaemonProcess(workdir, name=unique_name("bench-idle"), capacity=max(1 << 17, 2 * connections),
                         extra=["--touch-capacity", str(1 << 17)], log_level="WARNING").start(20)


def run_child(spec: dict) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True,
                         timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"variant {spec['variant']} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(spec: dict) -> dict:
    if spec["variant"] != "wheeld-daemon":
        return run_child(spec)
    workdir = tempfile.mkdtemp(prefix="wheeld-bench-")
    try:
        daemon = start_daemon(spec["connections"], workdir)
        try:
            return run_child({**spec, "socket": daemon.socket_path, "daemon_pid": daemon.pid})
        finally:
            daemon.cleanup()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true",
                        help="20k connections, 200k touches, 4000 touches/s, idle 5 s, 8 s steady phase")
    parser.add_argument("--connections", type=int)
    parser.add_argument("--touches", type=int, help="touches in the full-speed phase (default 1,000,000)")
    parser.add_argument("--touch-rate", type=int, default=20_000, help="touches per second in the steady phase")
    parser.add_argument("--duration-s", type=float, help="steady phase length (default 40)")
    parser.add_argument("--idle-ms", type=int, help="default 30000 (--quick 5000)")
    parser.add_argument("--active-fraction", type=float, default=0.9)
    parser.add_argument("--scan-interval-ms", type=int, default=1000)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--repeat", type=int, default=1, help="runs per variant; best (lowest touch cost) kept")
    parser.add_argument("--out", default=None, help="JSON results path (default: idle.json, see --save)")
    add_save_option(parser)
    args = parser.parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        print(json.dumps(asyncio.run(run_variant(spec))), flush=True)
        return 0
    connections = args.connections or (20_000 if args.quick else 100_000)
    spec_base = {
        "connections": connections, "touches": args.touches or (200_000 if args.quick else 1_000_000),
        "touch_rate": args.touch_rate if not args.quick else min(args.touch_rate, 4000),
        "duration_s": args.duration_s or (8.0 if args.quick else 40.0),
        "idle_ms": args.idle_ms or (5000 if args.quick else 30_000),
        "active_fraction": args.active_fraction, "scan_interval_ms": args.scan_interval_ms,
    }
    variants = [v for v in args.variants.split(",") if v]
    print(f"idle benchmark: {connections:,} connections, load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} CPUs; {spec_base}", flush=True)
    results: dict[str, dict] = {}
    for variant in variants:
        runs = []
        for _ in range(args.repeat):
            runs.append(measure({**spec_base, "variant": variant}))
        best = dict(min(runs, key=lambda r: r["touch_us"]))
        best["touch_us_runs"] = [round(r["touch_us"], 3) for r in runs]
        best["steady_us_per_touch_runs"] = [round(r["steady_us_per_touch"], 3) for r in runs]
        results[variant] = best
        print(f"  {variant:14} touch {best['touch_us']:.3f} us (runs {best['touch_us_runs']})  "
              f"setup {best['setup_us_per_connection']:.2f} us/conn  "
              f"rss {best['rss_bytes_per_connection'] + best.get('daemon_rss_bytes_per_connection', 0):.0f} B/conn  "
              f"steady {best['steady_us_per_touch']:.2f} us/touch ({best['steady_cpu_cores']:.2f} cores)  "
              f"idle reports {best['idle_reports']} (silent {best['silent_reported']}/{best['silent']}, "
              f"early {best['early_reports']})", flush=True)
    driver = results.get("none")
    if driver:
        for variant, r in results.items():
            if variant == "none":
                continue
            r["touch_us_net"] = r["touch_us"] - driver["touch_us"]
            r["steady_us_per_touch_net"] = r["steady_us_per_touch"] - driver["steady_us_per_touch"]
    summary = {}
    key = "touch_us_net" if driver else "touch_us"
    steady = "steady_us_per_touch_net" if driver else "steady_us_per_touch"
    base = results.get("asyncio-timer")
    if base:
        for variant in results:
            if variant not in ("none", "asyncio-timer"):
                summary[f"asyncio_rearm_vs_{variant}_touch"] = base[key] / max(results[variant][key], 1e-9)
    daemon = results.get("wheeld-daemon")
    if daemon:
        for variant in results:
            if variant not in ("none", "wheeld-daemon"):
                summary[f"{variant}_vs_wheeld_daemon_touch"] = results[variant][key] / max(daemon[key], 1e-9)
                summary[f"{variant}_vs_wheeld_daemon_steady"] = results[variant][steady] / max(daemon[steady], 1e-9)
    print_table(results, summary)
    out = Path(args.out) if args.out else results_path("idle.json", args.save)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "idle", "spec": spec_base, "repeat": args.repeat,
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform(),
                    "load_average": os.getloadavg()[0]},
        "results": results, "summary": summary,
    }, indent=2) + "\n")
    print(f"\nwrote {out}")
    return 0


def print_table(results: dict, summary: dict) -> None:
    print(f"\n{'variant':14} | {'touch us':>8} | {'net':>6} | {'setup us':>8} | {'B/conn':>7} | "
          f"{'steady us/touch':>15} | {'net':>6} | {'cores':>5} | {'idle':>6} | {'early':>5}")
    print("-" * 108)
    for variant, r in results.items():
        mem = r["rss_bytes_per_connection"] + r.get("daemon_rss_bytes_per_connection", 0.0)
        print(f"{variant:14} | {r['touch_us']:8.3f} | {r.get('touch_us_net', 0.0):6.3f} | "
              f"{r['setup_us_per_connection']:8.2f} | {mem:7.0f} | {r['steady_us_per_touch']:15.2f} | "
              f"{r.get('steady_us_per_touch_net', 0.0):6.2f} | {r['steady_cpu_cores']:5.2f} | "
              f"{r['idle_reports']:6} | {r['early_reports']:5}")
    for name, value in summary.items():
        print(f"{name}: {value:.1f}x")


if __name__ == "__main__":
    sys.exit(main())
