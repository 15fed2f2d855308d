"""Core timer throughput: the wheel (scalar and batch methods) vs heapq vs asyncio.

    python -m bench.wheel_core [--sizes 10000,1000000,10000000] [--quick] [--repeat 3] [--runs 1] [--markdown]

For each size N, each implementation runs in a fresh process (so its RSS is its
own): it is filled to N pending timers (deadlines 1-2 h ahead, so none comes
due during the run), then, with N pending, 100 rounds of ``--batch`` (1000)
operations of each kind are timed, as the daemon would apply drained batches
of ring commands (100 000 operations of each kind in all):

    insert   b new keys, deadlines 2-62 s ahead (idle-connection timeouts)
    re-arm   the same b keys, new deadlines
    cancel   the same b keys, by key (N pending again)
    expire   b keys due within 2 ms, scheduled 300 ms ahead (so each cascades once
             on the wheel), then the clock is driven the way the daemon drives it:
             to the next deadline the timer reports, until they are all out. Each
             expired timer's key and deadline are produced and its record freed.

The best of ``--repeat`` timed runs is kept, and with ``--runs N`` the best of N
whole passes (the machine is shared and noisy; every pass is in the JSON). Memory is
the RSS growth of the process from before the timer existed to N pending
(after ``malloc_trim``), divided by N: for the wheel that is the arena (private
memory here, so inside the RSS) plus the key index and free list of the owning
process. "arena B/timer" is the arena's size divided by N.

Implementations (keys are the same integers for all):

    wheel         TimerWheel scalar methods, the daemon's path: ``schedule_ident`` /
                  ``cancel_ident`` on 33-byte encoded keys, ``advance``
    wheel-int, wheel-str
                  TimerWheel's user-facing scalar methods, ``schedule(key)`` /
                  ``cancel(key)``, with int keys (as every other implementation
                  here) and with str keys ``"k<n>"`` (the key encoded on every call)
    wheel-batch   TimerWheel batch methods, one call per round of ``--batch`` operations,
                  as the daemon applies a drained batch of ring commands:
                  ``schedule_many`` / ``cancel_many`` / ``expire_many`` +
                  ``records_of`` + ``release_many``
    wheel-py, wheel-batch-py
                  the same on the Python path: the child runs with
                  ``WHEELD_PURE_PYTHON=1`` (the ``.py`` sources of the compiled
                  modules); ``wheel`` and ``wheel-batch`` run without it. The
                  "path" column says which path each child ran (compiled, python
                  or mixed, ``wheeld.protocol.accel.implementation()``)
    heapq         a heap of [deadline, seq, key, alive] lists + a dict key -> entry,
                  lazy deletion: the natural pure-Python timer
    heapq-str     the same with the str keys of wheel-str
    asyncio       ``loop.call_at`` / ``TimerHandle.cancel`` on a loop whose clock is
                  faked, + a dict key -> handle for cancel by key

Results: a table on stdout and bench/results/wheel_core.json.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import heapq
import json
import os
import subprocess
import sys
import time

import numpy as np
import psutil

from wheeld.protocol import accel
from wheeld.protocol import arena_layout as L
from wheeld.protocol.keys import TYPE_INT, key_meta_of
from wheeld.shm import TimerWheel, encode_ident

from bench.common import add_save_option, format_table, write_json

IMPLS = ("wheel", "wheel-py", "wheel-int", "wheel-str", "wheel-batch", "wheel-batch-py", "heapq", "heapq-str",
         "asyncio")
PURE_SUFFIX = "-py"  # the same implementation, on the Python path
OPS = ("insert", "rearm", "cancel", "expire")
BACKGROUND_MS = (3_600_000, 7_200_000)  # the N pending timers: 1-2 h ahead
IDLE_MS = (2_000, 62_000)  # inserted and re-armed timers: 2-62 s ahead
DUE_AHEAD_MS = 300  # expiring timers are scheduled this far ahead (beyond level 0: one cascade)
DUE_SPREAD_MS = 2
ROUNDS = 100
INT_META = key_meta_of(TYPE_INT, 8)


def int_idents(first: int, count: int) -> np.ndarray:
    """Encoded 33-byte keys (meta + 8-byte little-endian int + padding) for ints first..first+count-1."""
    raw = np.zeros((count, 33), dtype=np.uint8)
    raw[:, 0] = INT_META
    raw[:, 1:9] = np.arange(first, first + count, dtype="<i8").view(np.uint8).reshape(count, 8)
    return raw.view("V33").reshape(count)


def rss() -> int:
    """Resident bytes, after handing freed heap memory back to the OS (glibc keeps it otherwise)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the figure then includes free heap memory
        pass
    return psutil.Process().memory_info().rss


# ----------------------------------------------------------------------------- implementations
class WheelScalar:
    def __init__(self, capacity: int) -> None:
        self.wheel = TimerWheel.create(capacity, tick_ms=1, wheel_size=256)
        self.arena_bytes = L.segment_bytes(capacity, self.wheel.levels, self.wheel.wheel_size, self.wheel.max_groups)

    def fill(self, first: int, deadlines: np.ndarray) -> None:
        step = 1 << 16  # batch calls of 65536: bounded temporaries
        for at in range(0, deadlines.size, step):
            part = deadlines[at : at + step]
            self.wheel.schedule_many(int_idents(first + at, part.size), part)

    def keys(self, first: int, count: int):
        return int_idents(first, count).tolist()

    def insert(self, keys, deadlines) -> None:
        schedule = self.wheel.schedule_ident
        for key, deadline in zip(keys, deadlines.tolist()):
            schedule(key, deadline)

    rearm = insert

    def cancel(self, keys) -> None:
        cancel = self.wheel.cancel_ident
        for key in keys:
            cancel(key)

    def expire(self, until_ms: int) -> int:
        wheel, n = self.wheel, 0
        while (nd := wheel.next_deadline()) is not None and nd <= until_ms:
            n += len(wheel.advance(nd))
        n += len(wheel.advance(until_ms))
        return n

    @property
    def now(self) -> int:
        return self.wheel.current_ms

    def pending(self) -> int:
        return len(self.wheel)


class WheelKeys(WheelScalar):
    """The user-facing scalar methods, ``schedule(key)`` / ``cancel(key)``, with int keys."""

    def keys(self, first: int, count: int):
        return list(range(first, first + count))

    def insert(self, keys, deadlines) -> None:
        schedule = self.wheel.schedule
        for key, deadline in zip(keys, deadlines.tolist()):
            schedule(key, deadline)

    rearm = insert

    def cancel(self, keys) -> None:
        cancel = self.wheel.cancel
        for key in keys:
            cancel(key)


def str_keys(first: int, count: int) -> list[str]:
    return [f"k{n}" for n in range(first, first + count)]


class WheelStrKeys(WheelKeys):
    """:class:`WheelKeys` with str keys."""

    def fill(self, first: int, deadlines: np.ndarray) -> None:
        step = 1 << 16
        for at in range(0, deadlines.size, step):
            part = deadlines[at : at + step]
            self.wheel.schedule_many([encode_ident(k) for k in str_keys(first + at, part.size)], part)

    def keys(self, first: int, count: int):
        return str_keys(first, count)


class WheelBatch(WheelScalar):
    def keys(self, first: int, count: int):
        return int_idents(first, count)

    def insert(self, keys, deadlines) -> None:
        self.wheel.schedule_many(keys, deadlines)

    rearm = insert

    def cancel(self, keys) -> None:
        self.wheel.cancel_many(keys)

    def expire(self, until_ms: int) -> int:
        wheel, n = self.wheel, 0
        while True:
            nd = wheel.next_deadline()
            now = until_ms if nd is None or nd > until_ms else nd
            slots = wheel.expire_many(now)
            if slots.size:
                records = wheel.records_of(slots)  # key, deadline, tag, group: what a notification needs
                wheel.release_many(slots, records["gen"])
                n += slots.size
            if now == until_ms:
                return n


class HeapTimer:
    """heapq + dict with lazy deletion: entries are [deadline, seq, key, alive]."""

    def __init__(self, capacity: int) -> None:
        self.heap: list = []
        self.entries: dict = {}
        self.seq = 0
        self.now = 0
        self.arena_bytes = 0

    def keys(self, first: int, count: int):
        return list(range(first, first + count))

    def fill(self, first: int, deadlines: np.ndarray) -> None:
        self.insert(range(first, first + deadlines.size), deadlines)

    def insert(self, keys, deadlines) -> None:
        heap, entries, push = self.heap, self.entries, heapq.heappush
        seq = self.seq
        for key, deadline in zip(keys, deadlines.tolist()):
            old = entries.get(key)
            if old is not None:
                old[3] = False
            entry = [deadline, seq, key, True]
            seq += 1
            entries[key] = entry
            push(heap, entry)
        self.seq = seq

    rearm = insert

    def cancel(self, keys) -> None:
        pop = self.entries.pop
        for key in keys:
            entry = pop(key, None)
            if entry is not None:
                entry[3] = False

    def expire(self, until_ms: int) -> int:
        heap, entries, heappop = self.heap, self.entries, heapq.heappop
        out = []
        while heap and heap[0][0] <= until_ms:
            deadline, _seq, key, alive = heappop(heap)
            if alive:
                del entries[key]
                out.append((key, deadline))
        self.now = until_ms
        return len(out)

    def pending(self) -> int:
        return len(self.entries)


class HeapStrTimer(HeapTimer):
    """:class:`HeapTimer` with the str keys of :class:`WheelStrKeys`."""

    def keys(self, first: int, count: int):
        return str_keys(first, count)

    def fill(self, first: int, deadlines: np.ndarray) -> None:
        self.insert(str_keys(first, deadlines.size), deadlines)


class _FakeClockLoop(asyncio.SelectorEventLoop):
    fake_now = 0.0

    def time(self) -> float:
        return self.fake_now


class AsyncioTimer:
    """``loop.call_at`` + ``TimerHandle.cancel`` + a dict key -> handle; the loop's clock is faked."""

    def __init__(self, capacity: int) -> None:
        self.loop = _FakeClockLoop()
        self.handles: dict = {}
        self.now = 0
        self.arena_bytes = 0
        self.fired = 0

    def _fire(self, key) -> None:
        del self.handles[key]
        self.fired += 1

    def keys(self, first: int, count: int):
        return list(range(first, first + count))

    def fill(self, first: int, deadlines: np.ndarray) -> None:
        self.insert(range(first, first + deadlines.size), deadlines)

    def insert(self, keys, deadlines) -> None:
        handles, call_at, fire = self.handles, self.loop.call_at, self._fire
        for key, deadline in zip(keys, deadlines.tolist()):
            old = handles.get(key)
            if old is not None:
                old.cancel()
            handles[key] = call_at(deadline / 1000, fire, key)

    rearm = insert

    def cancel(self, keys) -> None:
        pop = self.handles.pop
        for key in keys:
            handle = pop(key, None)
            if handle is not None:
                handle.cancel()

    def expire(self, until_ms: int) -> int:
        loop, before = self.loop, self.fired
        loop.fake_now = until_ms / 1000
        while loop._scheduled and loop._scheduled[0].when() <= loop.fake_now:
            loop._run_once()  # pops every due handle and runs its callback; select(0)
        self.now = until_ms
        return self.fired - before

    def pending(self) -> int:
        return len(self.handles)


CLASSES = {"wheel": WheelScalar, "wheel-int": WheelKeys, "wheel-str": WheelStrKeys, "wheel-batch": WheelBatch,
           "heapq": HeapTimer, "heapq-str": HeapStrTimer, "asyncio": AsyncioTimer}
CLASSES.update({name + PURE_SUFFIX: CLASSES[name] for name in ("wheel", "wheel-batch")})


# ----------------------------------------------------------------------------- one measurement
def measure(impl: str, size: int, batch: int, repeat: int, seed: int = 1) -> dict:
    rng = np.random.default_rng(seed)
    gc.collect()
    rss_start = rss()
    timer = CLASSES[impl](size + 2 * batch + 16)
    t0 = time.perf_counter()
    timer.fill(0, rng.integers(*BACKGROUND_MS, size=size))
    fill_s = time.perf_counter() - t0
    gc.collect()
    rss_filled = rss()
    assert timer.pending() == size
    best = dict.fromkeys(OPS, float("inf"))
    first = size + 1
    for _repeat in range(repeat):
        spent = dict.fromkeys(OPS, 0.0)
        gc.disable()
        try:
            for _round in range(ROUNDS):
                keys = timer.keys(first, batch)
                due_keys = timer.keys(first + batch, batch)
                first += 2 * batch
                now = timer.now
                d1 = rng.integers(now + IDLE_MS[0], now + IDLE_MS[1], size=batch)
                d2 = rng.integers(now + IDLE_MS[0], now + IDLE_MS[1], size=batch)
                due = now + DUE_AHEAD_MS + rng.integers(0, DUE_SPREAD_MS, size=batch)
                t = time.perf_counter()
                timer.insert(keys, d1)
                t1 = time.perf_counter()
                timer.rearm(keys, d2)
                t2 = time.perf_counter()
                timer.cancel(keys)
                t3 = time.perf_counter()
                spent["insert"] += t1 - t
                spent["rearm"] += t2 - t1
                spent["cancel"] += t3 - t2
                timer.insert(due_keys, due)
                t = time.perf_counter()
                expired = timer.expire(now + DUE_AHEAD_MS + DUE_SPREAD_MS)
                spent["expire"] += time.perf_counter() - t
                assert expired == batch, (expired, batch)
            assert timer.pending() == size
        finally:
            gc.enable()
        for op in OPS:
            best[op] = min(best[op], spent[op])
    if impl.startswith("wheel"):
        problems = timer.wheel.check() if size <= 100_000 else []
        assert problems == [], problems[:5]
    ops = ROUNDS * batch
    result = {
        "impl": impl,
        "path": accel.implementation() if impl.startswith("wheel") else "-",
        "pending": size,
        "batch": batch,
        "ops": ops,
        "fill_per_s": size / fill_s,
        "rss_bytes_per_timer": (rss_filled - rss_start) / size,
        "arena_bytes_per_timer": timer.arena_bytes / size,
    }
    for op in OPS:
        result[f"{op}_per_s"] = ops / best[op]
        result[f"{op}_ns"] = best[op] / ops * 1e9
    return result


def run_worker(impl: str, size: int, batch: int, repeat: int) -> dict:
    """Run one measurement in a fresh interpreter, so memory figures are its own; the
    ``-py`` implementations with ``WHEELD_PURE_PYTHON=1``, the others without it."""
    cmd = [sys.executable, "-m", "bench.wheel_core", "--worker", impl, str(size), str(batch), str(repeat)]
    env = dict(os.environ)
    env.pop(accel.PURE_ENV, None)
    if impl.endswith(PURE_SUFFIX):
        env[accel.PURE_ENV] = "1"
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def best_of(rows: list[dict]) -> dict:
    """One (implementation, size) over several passes: the best throughput of each
    operation, the smallest memory figure."""
    best = dict(rows[0])
    for op in OPS:
        best[f"{op}_per_s"] = max(r[f"{op}_per_s"] for r in rows)
        best[f"{op}_ns"] = min(r[f"{op}_ns"] for r in rows)
    best["fill_per_s"] = max(r["fill_per_s"] for r in rows)
    best["rss_bytes_per_timer"] = min(r["rss_bytes_per_timer"] for r in rows)
    return best


def markdown_table(rows: list[dict]) -> str:
    """The result table as Markdown (docs/wheel.md carries one)."""
    lines = ["| impl | path | pending | insert/s | cancel/s | re-arm/s | expire/s | insert ns | cancel ns | expire ns "
             "| arena B/timer | RSS B/timer |", "|---|---|" + "---:|" * 10]
    for r in rows:
        arena = f"{r['arena_bytes_per_timer']:.1f}" if r["arena_bytes_per_timer"] else "-"
        lines.append(
            f"| {r['impl']} | {r.get('path', '-')} | {r['pending']:,} | {r['insert_per_s']:,.0f} "
            f"| {r['cancel_per_s']:,.0f} "
            f"| {r['rearm_per_s']:,.0f} | {r['expire_per_s']:,.0f} | {r['insert_ns']:,.0f} | {r['cancel_ns']:,.0f} "
            f"| {r['expire_ns']:,.0f} | {arena} | {r['rss_bytes_per_timer']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10000,1000000,10000000", help="pending timers, comma separated")
    parser.add_argument("--quick", action="store_true", help="sizes 10k and 100k, one run")
    parser.add_argument("--repeat", type=int, default=3,
                        help="timed runs per operation in one process; the best is kept")
    parser.add_argument("--runs", type=int, default=1,
                        help="passes over all sizes and implementations (minutes apart: load spikes on a shared "
                             "machine last longer than --repeat); the best figure of all passes is kept")
    parser.add_argument("--batch", type=int, default=1000, help="operations per round (one batch call for wheel-batch)")
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--baseline-max", type=int, default=None, help="skip heapq/asyncio above this size")
    parser.add_argument("--output", default="wheel_core",
                        help="result name: writes NAME.json (into bench/runs/, or bench/results/ with --save)")
    add_save_option(parser)
    parser.add_argument("--markdown", action="store_true", help="also print the table as Markdown")
    parser.add_argument("--worker", nargs=4, metavar=("IMPL", "SIZE", "BATCH", "REPEAT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        impl, size, batch, repeat = args.worker
        print(json.dumps(measure(impl, int(size), int(batch), int(repeat))))
        return 0
    sizes = [10_000, 100_000] if args.quick else [int(s) for s in args.sizes.split(",")]
    repeat = 1 if args.quick else args.repeat
    impls = args.impls.split(",")
    passes: list[list[dict]] = []
    for run in range(args.runs):
        rows = []
        for size in sizes:
            for impl in impls:
                baseline = impl in ("heapq", "heapq-str", "asyncio")
                if baseline and args.baseline_max is not None and size > args.baseline_max:
                    continue
                row = run_worker(impl, size, args.batch, repeat)
                rows.append(row)
                print(f"  run {run + 1}: {impl:14s} {size:>11,} pending: "
                      + ", ".join(f"{op} {row[op + '_per_s']:,.0f}/s" for op in OPS), file=sys.stderr, flush=True)
        passes.append(rows)
    rows = [best_of([p[i] for p in passes]) for i in range(len(passes[0]))]
    columns = ["impl", "path", "pending", "insert_per_s", "cancel_per_s", "rearm_per_s", "expire_per_s",
               "insert_ns", "cancel_ns", "expire_ns", "arena_bytes_per_timer", "rss_bytes_per_timer"]
    headers = ["impl", "path", "pending", "insert/s", "cancel/s", "re-arm/s", "expire/s",
               "insert ns", "cancel ns", "expire ns", "arena B/timer", "RSS B/timer"]
    print(format_table(rows, columns, headers))
    if args.markdown:
        print("\n" + markdown_table(rows))
    path = write_json(args.output, {
        "command": "python -m bench.wheel_core " + " ".join(argv if argv is not None else sys.argv[1:]),
        "repeat": repeat, "runs": args.runs, "batch": args.batch, "rounds": ROUNDS, "sizes": sizes,
        "results": rows, "passes": passes,
    }, save=args.save)
    print(f"\nwritten {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
