"""Kafka's purgatory micro benchmark (seeds 000 and 002), old design vs new, in one run.

    python bench/purgatory.py --quick          # 50k requests per point, a short sweep (minutes)
    python bench/purgatory.py                  # 1M requests per point (long: run on an idle machine)
    python bench/purgatory.py --case high --variants old,new --rates 2000,20000 --requests 200000

The workload is the seeds' (Kafka's ``TestPurgatoryPerformance``): requests
arrive with exponential inter-arrival times at a *target rate*; each would be
satisfied after a log-normal time (low-timeout case: median 20 ms, 75th
percentile 60 ms; high-timeout case: median 200 ms, 75th percentile 400 ms);
the timeout is 200 ms; each request carries 100 bytes and watches 3 keys. A
request due to be satisfied before its timeout is also put on a separate
completion queue (a heap with its own thread, Kafka's DelayQueue) that completes
it at that time with ``force_complete()``; the others time out. The generator
sleeps when it is ahead of the arrival schedule; the *achieved rate* is requests
over the generator's wall time, so a purgatory that cannot keep up shows as
achieved < target. Kafka ran 1M requests per point with a 200 MB heap; here
every point runs in a fresh process and we report its CPU time and peak RSS.

Variants, the same process structure for each (generator thread, completion
thread, one timer thread):

* ``old``: Kafka 0.8's ``RequestPurgatory`` (seed 002 "old design"): a DelayQueue
  (heap + condition) of *requests*, watcher lists that keep satisfied requests
  until a purge; an expiry reaper that polls one expired request at a time and
  after each poll purges every watcher list when their total size reaches
  ``purge_interval`` (1000, Kafka's default) and the delay queue when *its* size
  does. (Java's purge of the DelayQueue removes each element with a linear
  search; ours filters and re-heapifies in O(n), which favours the old design.)
* ``new``: :class:`wheeld.purgatory.Purgatory` on the in-process timing wheel,
  tick 1 ms, 20 buckets per level: O(1) removal from the timer and from the
  watch lists on completion, the clock thread sleeping until the next bucket.
* ``daemon``: the same purgatory on a wheeld daemon started for each point with
  ``--tick-ms 1 --wheel-size 20``: add and cancel are ring records, expirations
  come back on the socket; the daemon's CPU and peak RSS are added to the point.

Saturation. Kafka's figure plots the achieved enqueue rate against the target;
a design saturates where the two part. In Python the GIL hands the generator
its time slices even while a timer thread is swamped, so the enqueue rate alone
flatters a purgatory whose timeouts have stopped firing (the old design here
keeps enqueueing while its reaper, purging after every expiration, falls
seconds behind). So a point counts as *sustained* only if every request
finished (completed or expired, within ``--drain-s`` after the last enqueue)
and the p99 lateness of timeouts is at most 100 ms (half the timeout); a
variant's saturation rate is the highest achieved rate among its sustained
points. Both the enqueue rate and the lateness are in the table and the JSON.

A point whose generator falls more than ``--max-lag-s`` behind schedule stops
there (its achieved rate is known) instead of taking 1M/achieved seconds; after
two points in a row that are behind or late, a variant's sweep stops, like the
old design's missing points in Kafka's figure.

Results: a table per case on stdout, bench/results/purgatory.json and
bench/results/purgatory.png (achieved vs target rate, CPU vs achieved rate, peak
memory vs target rate; Kafka's figure layout).
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

if __package__ in (None, ""):  # python bench/purgatory.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import DaemonProcess, add_save_option, proc_cpu_s, results_path, rss_kb, unique_name  # noqa: E402

TIMEOUT_MS = 200
TICK_MS = 1
WHEEL_SIZE = 20
REQUEST_BYTES = 100
KEYS_PER_REQUEST = 3
PURGE_INTERVAL = 1000  # Kafka's *.purgatory.purge.interval.requests default
Z75 = 0.6744897501960817  # the standard normal's 75th percentile
CASES = {"low": (20.0, 60.0), "high": (200.0, 400.0)}  # (median ms, 75th percentile ms)
VARIANTS = ("old", "new", "daemon")
FULL_RATES = [3000, 5000, 10_000, 20_000, 30_000, 40_000, 50_000, 60_000, 80_000, 100_000]
QUICK_RATES = [2000, 5000, 10_000, 20_000, 40_000, 60_000, 80_000]


LATE_LIMIT_MS = 100  # half the timeout: a purgatory whose timeouts fire later is not keeping up


def behind(p: dict) -> bool:
    """Kafka's saturation: the generator could not enqueue at the target rate."""
    return p["achieved_rate"] < 0.9 * p["target_rate_sampled"]


def on_time(p: dict) -> bool:
    """Every request finished (completed or expired) and p99 timeout lateness <= LATE_LIMIT_MS."""
    late = p["expiry_lateness_ms"]["p99"]
    return p["unfinished"] == 0 and (late is None or late <= LATE_LIMIT_MS)


def lognormal_params(median_ms: float, p75_ms: float) -> tuple[float, float]:
    mu = math.log(median_ms)
    return mu, (math.log(p75_ms) - mu) / Z75


# =========================================================================== shared pieces
class Latch:
    """Counts finished requests (completion, timer and generator threads all count) and
    samples how late timeouts fire (every 8th expiration)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0
        self.expired = 0
        self.lateness_s: list[float] = []

    def done(self, expired: bool, deadline_s: float = 0.0) -> None:
        with self._lock:
            self.count += 1
            if expired:
                self.expired += 1
                if not self.expired & 7:
                    self.lateness_s.append(time.monotonic() - deadline_s)


class CompletionQueue:
    """Kafka's benchmark CompletionQueue: a DelayQueue of requests and a thread that completes them."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list = []
        self._seq = itertools.count()
        self._running = True
        self._thread = threading.Thread(target=self._run, name="completion", daemon=True)
        self._thread.start()

    def add(self, due_s: float, op) -> None:
        with self._cond:
            heap = self._heap
            heapq.heappush(heap, (due_s, next(self._seq), op))
            if heap[0][2] is op:
                self._cond.notify()

    def _run(self) -> None:
        cond, heap = self._cond, self._heap
        while self._running:
            batch = []
            with cond:
                now = time.monotonic()
                while heap and heap[0][0] <= now:
                    batch.append(heapq.heappop(heap)[2])
                if not batch:
                    cond.wait(min(0.1, heap[0][0] - now) if heap else 0.1)
                    continue
            for op in batch:
                op.force_complete()

    def close(self) -> None:
        self._running = False
        with self._cond:
            self._cond.notify()
        self._thread.join()


# =========================================================================== the old design
class OldRequest:
    """Kafka 0.8's DelayedRequest: keys, a deadline, an atomic ``satisfied`` flag."""

    __slots__ = ("keys", "due_s", "satisfied", "done", "completes_at_s", "data", "latch")

    def __init__(self, keys, delay_ms: int, completes_at_s: float, size: int, latch: Latch) -> None:
        self.keys = keys
        self.due_s = time.monotonic() + delay_ms / 1000
        self.satisfied = threading.Lock()  # compareAndSet(false, true) == acquire(False)
        self.done = False  # a plain read of the flag for the purge scans (AtomicBoolean.get)
        self.completes_at_s = completes_at_s
        self.data = bytearray(size)
        self.latch = latch

    def __lt__(self, other: "OldRequest") -> bool:
        return self.due_s < other.due_s

    def force_complete(self) -> bool:  # what the benchmark's completion thread does
        if self.satisfied.acquire(False):
            self.done = True
            self.latch.done(False)
            return True
        return False


class OldWatchers:
    __slots__ = ("requests", "lock")

    def __init__(self) -> None:
        self.requests: list[OldRequest] = []
        self.lock = threading.Lock()

    def add_if_not_satisfied(self, request: OldRequest) -> bool:
        if request.done:
            return False
        with self.lock:
            self.requests.append(request)
        return True

    def purge_satisfied(self) -> int:
        with self.lock:
            before = len(self.requests)
            self.requests = [r for r in self.requests if not r.done]
            return before - len(self.requests)


class OldPurgatory:
    """Kafka 0.8 ``RequestPurgatory``: DelayQueue of requests + size-triggered purge."""

    def __init__(self, purge_interval: int = PURGE_INTERVAL) -> None:
        self.purge_interval = purge_interval
        self.watchers: dict[object, OldWatchers] = {}
        self._watchers_lock = threading.Lock()
        self._cond = threading.Condition()
        self._queue: list[OldRequest] = []  # the DelayQueue (a heap under one lock)
        self._running = True
        self.purges_watchers = self.purges_queue = 0
        self._thread = threading.Thread(target=self._reaper, name="expired-request-reaper", daemon=True)
        self._thread.start()

    @staticmethod
    def check_satisfied(request: OldRequest) -> bool:
        return time.monotonic() >= request.completes_at_s

    def check_and_maybe_watch(self, request: OldRequest) -> bool:
        if self.check_satisfied(request):
            return request.force_complete()
        for key in request.keys:
            watchers = self.watchers.get(key)
            if watchers is None:
                with self._watchers_lock:
                    watchers = self.watchers.setdefault(key, OldWatchers())
            if not watchers.add_if_not_satisfied(request):
                return False
        if self.check_satisfied(request):
            return request.force_complete()
        with self._cond:  # DelayQueue.add: signal when the new request is the head
            heapq.heappush(self._queue, request)
            if self._queue[0] is request:
                self._cond.notify()
        return False

    def watched(self) -> int:
        return sum(len(w.requests) for w in list(self.watchers.values()))

    def delayed(self) -> int:
        return len(self._queue)

    def _poll(self, timeout_s: float) -> OldRequest | None:
        """DelayQueue.poll(timeout): the head once its delay has passed."""
        end = time.monotonic() + timeout_s
        with self._cond:
            while self._running:
                now = time.monotonic()
                queue = self._queue
                if queue and queue[0].due_s <= now:
                    return heapq.heappop(queue)
                if now >= end:
                    return None
                self._cond.wait(min(end, queue[0].due_s) - now if queue else end - now)
        return None

    def _poll_expired(self) -> OldRequest | None:
        while True:
            request = self._poll(0.2)
            if request is None:
                return None
            if request.satisfied.acquire(False):
                request.done = True
                return request

    def _reaper(self) -> None:
        while self._running:
            request = self._poll_expired()
            if request is not None:
                request.latch.done(True, request.due_s)  # expire(request)
            if self.watched() >= self.purge_interval:
                self.purges_watchers += 1
                for watchers in list(self.watchers.values()):
                    watchers.purge_satisfied()
            if self.delayed() >= self.purge_interval:
                self.purges_queue += 1
                with self._cond:
                    self._queue = [r for r in self._queue if not r.done]
                    heapq.heapify(self._queue)

    def close(self) -> None:
        self._running = False
        with self._cond:
            self._cond.notify()
        self._thread.join()


# =========================================================================== the new design
def new_request_class():
    from wheeld.purgatory import DelayedOperation

    class FakeOperation(DelayedOperation):
        """Kafka's benchmark FakeOperation: complete once its time has come."""

        def __init__(self, delay_ms: int, completes_at_s: float, size: int, latch: Latch) -> None:
            super().__init__(delay_ms)
            self.deadline_s = time.monotonic() + delay_ms / 1000
            self.completes_at_s = completes_at_s
            self.data = bytearray(size)
            self.latch = latch

        def try_complete(self) -> bool:
            return time.monotonic() >= self.completes_at_s and self.force_complete()

        def on_complete(self) -> None:
            self.latch.done(self.expired, self.deadline_s)

    return FakeOperation


# =========================================================================== one point (child process)
def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def run_point(spec: dict) -> dict:
    import numpy as np

    variant, rate, n = spec["variant"], spec["rate"], spec["requests"]
    median_ms, p75_ms = CASES[spec["case"]]
    mu, sigma = lognormal_params(median_ms, p75_ms)
    rng = np.random.default_rng(spec.get("seed", 1))
    intervals_s = rng.exponential(1.0 / rate, n).tolist()
    latencies_ms = rng.lognormal(mu, sigma, n).tolist()
    keys = [f"fakeKey{i}" for i in rng.integers(0, 100, KEYS_PER_REQUEST)]
    latch = Latch()
    client = None
    if variant == "old":
        purgatory = OldPurgatory()
        make = lambda completes_at_s: OldRequest(keys, TIMEOUT_MS, completes_at_s, REQUEST_BYTES, latch)  # noqa: E731
        submit = purgatory.check_and_maybe_watch
        sizes = lambda: (purgatory.delayed(), purgatory.watched())  # noqa: E731
    else:
        import wheeld
        from wheeld.purgatory import Purgatory

        FakeOperation = new_request_class()
        if variant == "new":
            purgatory = Purgatory(tick_ms=TICK_MS, wheel_size=WHEEL_SIZE)
        else:
            client = wheeld.connect(spec["socket"], group=f"bench-{os.getpid()}")
            purgatory = Purgatory(client=client)
        make = lambda completes_at_s: FakeOperation(TIMEOUT_MS, completes_at_s, REQUEST_BYTES, latch)  # noqa: E731
        submit = lambda op: purgatory.try_complete_else_watch(op, keys)  # noqa: E731
        sizes = lambda: (purgatory.delayed(), purgatory.watched())  # noqa: E731
    completion = CompletionQueue()
    rss_start_kb = _rss_kb()
    max_lag_s = spec["max_lag_s"]
    peak_delayed = peak_watched = 0

    cpu0 = time.process_time()
    start = time.monotonic()
    arrival = start
    generated = 0
    saturated = False
    monotonic, sleep = time.monotonic, time.sleep
    for i in range(n):
        arrival += intervals_s[i]
        now = monotonic()
        if arrival - now > 0.001:  # ahead of schedule: wait (Kafka: Thread.sleep in whole ms)
            sleep(arrival - now)
            now = arrival
        latency_ms = latencies_ms[i]
        op = make(now + latency_ms / 1000)
        if latency_ms < TIMEOUT_MS:
            completion.add(now + latency_ms / 1000, op)
        submit(op)
        generated += 1
        if not i & 4095:
            delayed, watched = sizes()
            peak_delayed = max(peak_delayed, delayed)
            peak_watched = max(peak_watched, watched)
            if now - arrival > max_lag_s:
                saturated = True
                break
    end = monotonic()
    drain_end = end + TIMEOUT_MS / 1000 + spec.get("drain_s", 10.0)
    while latch.count < generated and monotonic() < drain_end:
        sleep(0.01)
    drained = monotonic()
    cpu_s = time.process_time() - cpu0
    peak_rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    completion.close()
    extra = {}
    if variant == "old":
        extra = {"purges_watchers": purgatory.purges_watchers, "purges_queue": purgatory.purges_queue}
        purgatory.close()
    else:
        purgatory.close()
        if client is not None:
            client.close()
    target_span_s = sum(intervals_s[:generated])
    lateness_ms = sorted(x * 1000 for x in latch.lateness_s)

    def pct(q: float):
        return round(lateness_ms[min(len(lateness_ms) - 1, int(q * len(lateness_ms)))], 2) if lateness_ms else None

    return {
        "variant": variant, "case": spec["case"], "target_rate": rate,
        "target_rate_sampled": generated / target_span_s if target_span_s else 0.0,
        "requests": generated, "saturated": saturated,
        "achieved_rate": generated / (end - start),
        "wall_s": end - start, "drain_s": drained - end,
        "completed": latch.count, "expired": latch.expired,
        "unfinished": generated - latch.count,  # neither completed nor expired when the drain ended
        "expiry_lateness_ms": {"p50": pct(0.5), "p99": pct(0.99), "max": pct(1.0) if lateness_ms else None},
        "cpu_s": cpu_s, "cpu_cores": cpu_s / (drained - start),
        "cpu_us_per_request": cpu_s / generated * 1e6,
        "peak_rss_mb": peak_rss_kb / 1024, "rss_start_mb": rss_start_kb / 1024,
        "peak_rss_growth_mb": (peak_rss_kb - rss_start_kb) / 1024,
        "peak_delayed": peak_delayed, "peak_watched": peak_watched, **extra,
    }


# =========================================================================== the daemon
def start_daemon(workdir: str) -> DaemonProcess:
    """A wheeld with the purgatory's wheel parameters, on a socket in ``workdir``."""
    return DaemonProcess(workdir, name=unique_name("bench"), capacity=1 << 20, log_level="WARNING",
                         extra=["--tick-ms", str(TICK_MS), "--wheel-size", str(WHEEL_SIZE)]).start(20)


def peak_rss_kb(pid: int) -> int:
    """VmHWM of ``pid`` in KiB: the most resident memory it has had."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


# =========================================================================== the sweep (parent)
def run_child(spec: dict) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True,
                         timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"point {spec} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(spec: dict) -> dict:
    if spec["variant"] != "daemon":
        return run_child(spec)
    workdir = tempfile.mkdtemp(prefix="wheeld-bench-")
    daemon = None
    try:
        daemon = start_daemon(workdir)
        rss0_kb = rss_kb(daemon.pid)
        cpu0 = proc_cpu_s(daemon.pid)
        result = run_child({**spec, "socket": daemon.socket_path})
        daemon_cpu = proc_cpu_s(daemon.pid) - cpu0
        hwm_kb = peak_rss_kb(daemon.pid)
    finally:
        if daemon is not None:
            daemon.cleanup()
        shutil.rmtree(workdir, ignore_errors=True)
    result["daemon_cpu_s"] = daemon_cpu
    result["daemon_peak_rss_mb"] = hwm_kb / 1024
    result["daemon_peak_rss_growth_mb"] = (hwm_kb - rss0_kb) / 1024
    result["client_cpu_s"] = result["cpu_s"]
    result["cpu_s"] += daemon_cpu
    result["cpu_cores"] = result["cpu_s"] / (result["wall_s"] + result["drain_s"])
    result["cpu_us_per_request"] = result["cpu_s"] / result["requests"] * 1e6
    return result


def load_average() -> float:
    return os.getloadavg()[0]


def sweep(args) -> dict:
    points: list[dict] = []
    for case in args.cases:
        for variant in args.variants:
            saturated_in_a_row = 0
            for rate in args.rates:
                spec = {"variant": variant, "case": case, "rate": rate, "requests": args.requests,
                        "max_lag_s": args.max_lag_s, "seed": args.seed, "drain_s": args.drain_s}
                runs: list[dict] = []
                for _ in range(args.repeat):
                    load = load_average()
                    result = measure(spec)
                    result["load_average_before"] = load
                    runs.append(result)
                    best = max(runs, key=lambda p: (on_time(p), not behind(p), p["achieved_rate"]))
                best = dict(best)
                best["repeats"] = [{"achieved_rate": round(p["achieved_rate"]), "on_time": on_time(p),
                                    "late_p99_ms": p["expiry_lateness_ms"]["p99"]} for p in runs]
                points.append(best)
                late = best["expiry_lateness_ms"]
                print(f"  {case:4} {variant:6} target {rate:>7,}/s  achieved {best['achieved_rate']:>9,.0f}/s"
                      f"  cpu {best['cpu_us_per_request']:6.1f} us/req ({best['cpu_cores']:.2f} cores)"
                      f"  peak rss +{best['peak_rss_growth_mb']:.0f} MB"
                      f"  expired {best['expired'] / max(1, best['requests']):.0%}"
                      f"  late p50/p99 {late['p50']}/{late['p99']} ms  unfinished {best['unfinished']}"
                      f"{'  BEHIND' if behind(best) else ''}{'  LATE' if not on_time(best) else ''}"
                      f"  (load {best['load_average_before']:.1f})", flush=True)
                if behind(best) or not on_time(best):
                    saturated_in_a_row += 1
                    if saturated_in_a_row >= 2 and not args.keep_going:
                        break
                else:
                    saturated_in_a_row = 0
    return summarise(points, args)


def summarise(points: list[dict], args) -> dict:
    saturation: dict[str, dict[str, dict]] = {}
    for case in args.cases:
        saturation[case] = {}
        for variant in args.variants:
            mine = [p for p in points if p["case"] == case and p["variant"] == variant]
            if not mine:
                continue
            sustained = [p["achieved_rate"] for p in mine if on_time(p)]
            kept_up = [p["target_rate"] for p in mine if on_time(p) and not behind(p)]
            saturation[case][variant] = {
                "sustained_rate": max(sustained) if sustained else 0.0,
                "max_enqueue_rate": max(p["achieved_rate"] for p in mine),
                "highest_target_kept_up": max(kept_up) if kept_up else None,
            }
        old = saturation[case].get("old")
        for variant in ("new", "daemon"):
            if old and old["sustained_rate"] and variant in saturation[case]:
                saturation[case][variant]["vs_old"] = (
                    saturation[case][variant]["sustained_rate"] / old["sustained_rate"])
    return {
        "benchmark": "purgatory", "timeout_ms": TIMEOUT_MS, "tick_ms": TICK_MS, "wheel_size": WHEEL_SIZE,
        "request_bytes": REQUEST_BYTES, "keys_per_request": KEYS_PER_REQUEST, "purge_interval": PURGE_INTERVAL,
        "cases": {c: {"median_ms": CASES[c][0], "p75_ms": CASES[c][1]} for c in args.cases},
        "requests_per_point": args.requests, "max_lag_s": args.max_lag_s, "repeat": args.repeat,
        "late_limit_ms": LATE_LIMIT_MS,
        "definitions": {
            "achieved_rate": "requests enqueued per second of generator wall time (Kafka's y axis)",
            "sustained_rate": "highest achieved rate of a point where every request finished and p99 timeout "
                              f"lateness <= {LATE_LIMIT_MS} ms (the saturation point)",
            "max_enqueue_rate": "highest achieved rate of any point, on time or not",
        },
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
        "kafka_published": {"high": {"old": 25_000, "new": 105_000}, "low": {"old": 40_000}},
        "saturation": saturation, "points": points,
    }


def print_tables(result: dict) -> None:
    for case, shape in result["cases"].items():
        print(f"\n{case}-timeout case (completion median {shape['median_ms']:.0f} ms, p75 {shape['p75_ms']:.0f} ms, "
              f"timeout {result['timeout_ms']} ms), {result['requests_per_point']:,} requests per point")
        variants = [v for v in VARIANTS if v in result["saturation"][case]]
        header = f"{'target/s':>9} |" + "|".join(f" {v + ' achieved/s':>17} {'us/req':>7} {'MB':>5} " for v in variants)
        print(header)
        print("-" * len(header))
        rates = sorted({p["target_rate"] for p in result["points"] if p["case"] == case})
        for rate in rates:
            cells = []
            for v in variants:
                p = next((p for p in result["points"]
                          if p["case"] == case and p["variant"] == v and p["target_rate"] == rate), None)
                if p is None:
                    cells.append(f" {'-':>17} {'-':>7} {'-':>5} ")
                else:
                    mark = ("*" if behind(p) else "") + ("!" if not on_time(p) else "") or " "
                    mb = p["peak_rss_growth_mb"] + p.get("daemon_peak_rss_growth_mb", 0.0)
                    cells.append(f" {p['achieved_rate']:>16,.0f}{mark} {p['cpu_us_per_request']:>7.1f} {mb:>5.0f} ")
            print(f"{rate:>9,} |" + "|".join(cells))
        sat = result["saturation"][case]
        line = ", ".join(f"{v} {s['sustained_rate']:,.0f}/s" + (f" ({s['vs_old']:.1f}x old)" if "vs_old" in s else "")
                         for v, s in sat.items())
        print(f"saturation (highest rate sustained on time): {line}")
        print(f"  * enqueue below 90% of target   ! timeouts late (p99 > {LATE_LIMIT_MS} ms) or requests unfinished")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(result["cases"])
    fig, axes = plt.subplots(len(cases), 3, figsize=(15, 4.5 * len(cases)), squeeze=False)
    styles = {"old": ("tab:red", "o", "old: DelayQueue of requests + purge"),
              "new": ("tab:blue", "s", "new: timing wheel, O(1) removal"),
              "daemon": ("tab:green", "^", "new, timers in a wheeld daemon")}
    for row, case in enumerate(cases):
        shape = result["cases"][case]
        for variant, (color, marker, label) in styles.items():
            pts = sorted((p for p in result["points"] if p["case"] == case and p["variant"] == variant),
                         key=lambda p: p["target_rate"])
            if not pts:
                continue
            targets = [p["target_rate"] / 1000 for p in pts]
            achieved = [p["achieved_rate"] / 1000 for p in pts]
            axes[row][0].plot(targets, achieved, marker=marker, color=color, label=label)
            late = [(t, a) for t, a, p in zip(targets, achieved, pts) if not on_time(p)]
            if late:  # hollow: timeouts late or requests unfinished at this point
                axes[row][0].plot(*zip(*late), linestyle="none", marker=marker, markersize=9, color=color,
                                  markerfacecolor="white")
            axes[row][1].plot(achieved, [p["cpu_cores"] for p in pts], marker=marker, color=color, label=label)
            axes[row][2].plot(targets, [p["peak_rss_growth_mb"] + p.get("daemon_peak_rss_growth_mb", 0.0) for p in pts],
                              marker=marker, color=color, label=label)
        top = max(p["target_rate"] for p in result["points"] if p["case"] == case) / 1000
        axes[row][0].plot([0, top], [0, top], color="grey", linestyle=":", label="target")
        title = f"{case} timeout (median {shape['median_ms']:.0f} ms, p75 {shape['p75_ms']:.0f} ms)"
        axes[row][0].set(title=f"enqueue rate, {title}\n(hollow: timeouts late or unfinished)",
                         xlabel="target rate (k req/s)", ylabel="achieved rate (k req/s)")
        axes[row][1].set(title="CPU (client + daemon)", xlabel="achieved rate (k req/s)", ylabel="CPU (cores)")
        axes[row][2].set(title="peak memory growth (RSS)", xlabel="target rate (k req/s)", ylabel="MB")
        for ax in axes[row]:
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(f"Purgatory micro benchmark (Kafka's setup): timeout {result['timeout_ms']} ms, tick "
                 f"{result['tick_ms']} ms, wheel size {result['wheel_size']}, {result['requests_per_point']:,} "
                 f"requests per point, Python {result['machine']['python']}, {result['machine']['cpus']} CPUs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="50k requests per point, a shorter sweep")
    parser.add_argument("--requests", type=int, help="requests per point (default 1,000,000; --quick 50,000)")
    parser.add_argument("--rates", help="comma-separated target rates (requests/s)")
    parser.add_argument("--case", dest="cases", default="low,high", help="low,high")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="old,new,daemon")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs per point; the best (on time first, then rate) is kept, all are listed")
    parser.add_argument("--max-lag-s", type=float, default=2.0, help="a point stops once this far behind schedule")
    parser.add_argument("--keep-going", action="store_true", help="do not stop a sweep after two saturated points")
    parser.add_argument("--drain-s", type=float, default=10.0, help="wait this long for stragglers after a point")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default=None,
                        help="JSON results path, the chart beside it (default: purgatory.json, see --save)")
    add_save_option(parser)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(run_point(json.loads(args.child))), flush=True)
        return 0
    args.cases = [c for c in args.cases.split(",") if c]
    args.variants = [v for v in args.variants.split(",") if v]
    for case in args.cases:
        if case not in CASES:
            parser.error(f"unknown case {case!r}")
    for variant in args.variants:
        if variant not in VARIANTS:
            parser.error(f"unknown variant {variant!r}")
    args.requests = args.requests or (50_000 if args.quick else 1_000_000)
    args.rates = [int(r) for r in args.rates.split(",")] if args.rates else (QUICK_RATES if args.quick else FULL_RATES)
    print(f"purgatory benchmark: {args.requests:,} requests per point, rates {args.rates}, load average "
          f"{load_average():.1f} on {os.cpu_count()} CPUs", flush=True)
    started = time.monotonic()
    result = sweep(args)
    result["elapsed_s"] = time.monotonic() - started
    result["quick"] = args.quick
    print_tables(result)
    out = Path(args.out) if args.out else results_path("purgatory.json", args.save)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    png = out.with_suffix(".png")
    try:
        plot(result, png)
        print(f"\nwrote {out} and {png}")
    except ImportError:
        print(f"\nwrote {out} (matplotlib missing: no plot)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
