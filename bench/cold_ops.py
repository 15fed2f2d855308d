"""What the wheel's scalar operations cost on records the CPU caches no longer hold.

    .venv/bin/python bench/cold_ops.py                       # 150k pending in a 1M arena, ~1 minute
    .venv/bin/python bench/cold_ops.py --pending 20000 --capacity 100000 --rounds 50

A daemon under a paced load (``bench.e2e``'s steady phase: ~40 commands a
millisecond) touches each record once in a while, between wake-ups in which the
clients, the kernel and the rest of the daemon have used the caches: the records
and key-index cells an iteration reads are cold. This bench measures the compiled
(or, ``WHEELD_PURE_PYTHON=1``, Python) wheel's per-operation CPU time
(``time.thread_time_ns``) on a batch of ``--batch`` operations right after
``--evict-mb`` of other memory was written (cold), and on the same batch again
(warm: its records are cached now), for:

* ``rearm``: ``schedule`` of a pending key to a new deadline (a re-arm);
* ``add``: ``schedule`` of a new key; ``cancel``: ``cancel`` of a pending key;
* ``fire``: ``expire`` of a level-0 bucket holding the batch (per timer fired);
* ``ack``: ``release`` of a fired record (the client's acknowledgement).

The cold column is the floor under any loop that applies such operations a few
dozen at a time: a compiled wake-up loop removes the interpreter around them, not
the cache misses inside them. Writes bench/runs/cold_ops.json (``--save``:
bench/results/) and prints a table.
"""

from __future__ import annotations

import argparse
import mmap
import random
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import add_save_option, format_table, write_json  # noqa: E402
from wheeld.protocol import accel  # noqa: E402
from wheeld.shm.arena import Segment  # noqa: E402
from wheeld.shm.wheel import TimerWheel  # noqa: E402

OPS = ("rearm", "add", "cancel", "fire", "ack")


def _huge_segment(size: int) -> Segment:
    """Private memory for the arena, asking the kernel for transparent huge pages before
    any page is touched (``--huge-pages``): whether the cold cost is TLB misses."""
    # private: a shared anonymous mapping is shmem, whose huge pages the kernel's
    # shmem_enabled governs (commonly "never"), not the madvise
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE)
    return Segment(buf, None, size)


def _huge_kb() -> int:
    """This process's memory in transparent huge pages, in kB."""
    with open("/proc/self/smaps_rollup") as f:
        return sum(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))


class _Bench:
    def __init__(self, args):
        self.args = args
        self.rng = random.Random(args.seed)
        self.wheel = TimerWheel.create(args.capacity, tick_ms=1, wheel_size=256, start_ms=0,
                                       segment_factory=_huge_segment if args.huge_pages else None)
        self.now = 0
        self.keys = list(range(args.pending))
        for key in self.keys:
            self.wheel.schedule(key, self.rng.randint(args.delay_lo_ms, args.delay_hi_ms))
        self.next_key = args.pending
        self.junk = np.zeros(args.evict_mb << 20, dtype=np.uint8)
        self.totals = {op: [0, 0, 0] for op in OPS}  # cold ns, warm ns, operations

    def evict(self) -> None:
        self.junk[::64] += 1  # one store per cache line

    def timed(self, fn, items) -> int:
        start = time.thread_time_ns()
        for item in items:
            fn(item)
        return time.thread_time_ns() - start

    def record(self, op: str, cold_ns: int, warm_ns: int, n: int) -> None:
        t = self.totals[op]
        t[0] += cold_ns
        t[1] += warm_ns
        t[2] += n

    def round(self) -> None:
        a, w, rng, n = self.args, self.wheel, self.rng, self.args.batch
        picked = rng.sample(self.keys, n)
        deadline = lambda _key: self.now + rng.randint(a.delay_lo_ms, a.delay_hi_ms)  # noqa: E731
        self.evict()
        cold = self.timed(lambda k: w.schedule(k, deadline(k)), picked)
        self.record("rearm", cold, self.timed(lambda k: w.schedule(k, deadline(k)), picked), n)

        fresh = list(range(self.next_key, self.next_key + n))
        self.next_key += n
        self.evict()
        cold = self.timed(lambda k: w.cancel(k), picked)
        cold_add = self.timed(lambda k: w.schedule(k, deadline(k)), fresh)
        warm = self.timed(lambda k: w.schedule(k, deadline(k)), picked)  # the same records back
        warm_cancel = self.timed(lambda k: w.cancel(k), picked)
        self.timed(lambda k: w.schedule(k, deadline(k)), picked)
        self.record("cancel", cold, warm_cancel, n)
        self.record("add", cold_add, warm, n)
        self.keys.extend(fresh)

        # a bucket of n timers due at the next ms: fired cold, then acknowledged cold; the
        # warm figures repeat both on the records just used
        due = self.now + 2
        batch = list(range(self.next_key, self.next_key + n))
        self.next_key += n
        for key in batch:
            w.schedule(key, due)
        for attempt in ("cold", "warm"):
            if attempt == "cold":
                self.evict()
            start = time.thread_time_ns()
            fired = w.expire(due)
            took = time.thread_time_ns() - start
            handles = [(slot, w.fired(slot)[5]) for slot in fired]
            if attempt == "cold":
                self.evict()
            start = time.thread_time_ns()
            for slot, gen in handles:
                w.release(slot, gen)
            acked = time.thread_time_ns() - start
            if attempt == "cold":
                cold_fire, cold_ack, fired_n = took, acked, len(fired)
                for key in batch:  # the same keys again, for the warm pass
                    w.schedule(key, due + 1)
                due += 1
        self.record("fire", cold_fire, took, fired_n)
        self.record("ack", cold_ack, acked, fired_n)
        self.now = due
        w.expire(self.now)

    def rows(self) -> list[dict]:
        out = []
        for op in OPS:
            cold, warm, n = self.totals[op]
            out.append({"op": op, "operations": n, "cold_ns": cold / n, "warm_ns": warm / n,
                        "cold_over_warm": cold / warm if warm else None})
        return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--capacity", type=int, default=1_000_000)
    parser.add_argument("--pending", type=int, default=150_000)
    parser.add_argument("--batch", type=int, default=64, help="operations per batch (a wake-up's worth)")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--evict-mb", type=int, default=64, help="memory written between batches")
    parser.add_argument("--delay-lo-ms", type=int, default=5_000)
    parser.add_argument("--delay-hi-ms", type=int, default=9_500)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--huge-pages", action="store_true",
                        help="the arena in private memory advised for transparent huge pages (MADV_HUGEPAGE)")
    parser.add_argument("--out", help="JSON path (default: bench/runs/cold_ops.json)")
    add_save_option(parser)
    args = parser.parse_args(argv)
    bench = _Bench(args)
    try:
        for _ in range(args.rounds):
            bench.round()
        rows = bench.rows()
        huge_kb = _huge_kb()
    finally:
        bench.wheel.close()
    print(f"cold_ops: {accel.implementation()} wheel, {args.pending:,} pending in {args.capacity:,} records, "
          f"batches of {args.batch}, {args.evict_mb} MB written between cold batches; "
          f"{huge_kb:,} kB in huge pages\n")
    print(format_table(rows, ["op", "operations", "cold_ns", "warm_ns", "cold_over_warm"],
                       ["op", "ops", "cold ns/op", "warm ns/op", "cold/warm"]))
    payload = {"implementation": accel.implementation(), "capacity": args.capacity, "pending": args.pending,
               "batch": args.batch, "rounds": args.rounds, "evict_mb": args.evict_mb,
               "huge_pages": args.huge_pages, "huge_pages_kb": huge_kb, "results": rows}
    if args.out:
        path = Path(args.out)
        path.write_text(__import__("json").dumps(payload, indent=2) + "\n")
    else:
        path = write_json("cold_ops", payload, args.save)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
