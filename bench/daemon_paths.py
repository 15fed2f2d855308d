"""Four small measurements behind choices in the daemon and the client.

    python -m bench.daemon_paths            # ~30 s: three tables + bench/runs/daemon_paths.json
                                            # (--save: bench/results/)
    python -m bench.daemon_paths --quick    # seconds

1. **apply paths** (``daemon/executor.py`` ``BATCH_MIN``): the daemon applies a
   drained batch either planned (``plan_batch`` + ``Executor.apply_plan``: numpy,
   last operation per key) or command by command (``Executor.apply_in_order``). Both on a private-memory
   wheel with ~65k pending, the e2e bench's mix (60% add of a new key, 20%
   re-arm, 20% cancel), the daemon's check of the records included
   (``executor.valid_records``); us per command per batch size. The crossover
   is where ``BATCH_MIN`` belongs: on the Python path (run it with
   ``WHEELD_PURE_PYTHON=1``) ~128-192 commands; compiled, in order wins at
   every size and the daemon never plans.
2. **park precision** (``daemon/alarm.py``): how long after the start of the
   next millisecond a parked uvloop wakes, with ``loop.call_later(delay)`` (the
   baseline; "early" counts wake-ups before the boundary, after which a parked
   daemon loops) and with the timerfd ``Alarm`` armed at that instant.
3. **bookkeeping pauses** (``client/core.py`` ``_SHARDS``): the longest single
   insert into one dict of str-key idents (rehash pauses) against 64 dicts by
   hash, and the cost of dropping a 2^17-entry set of ``(ident, tag)`` at once
   against forgetting the oldest entry one at a time.
4. **coalescing** (``--coalesce-us``, ``daemon/server.py`` ``_soft_wake``): a
   real daemon, parked, gets one add every ~0.5 ms for a while with no flush:
   its wake-ups per add (one per window when gathered, about one per add
   without); then a flush right after an add on the parked daemon: how long it
   waits for its answer (an urgent doorbell wakes the daemon at once, not at
   the end of the window).
5. **expire paths** (``daemon/delivery.py`` ``SCALAR_EXPIRE``): a private wheel
   whose timers come due ``per_ms`` a millisecond (deadlines spread over 2 s,
   scheduled at once, so each cascades on its way), driven one millisecond at a
   time through the scalar ``expire`` and through the batch ``expire_many``, every
   fired timer then released; us per call (one call per ms, as the daemon makes).

Run from the repository root holding the shared lock
(``flock /tmp/wheeld-bench.lock python -m bench.daemon_paths``).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import random
import statistics
import tempfile
import time

import numpy as np

from bench.common import DaemonProcess, add_save_option, format_table, write_json


# --------------------------------------------------------------------------- 1. apply paths


def _private_executor(capacity: int):
    import collections

    from wheeld.daemon.client_table import ClientSlot
    from wheeld.daemon.executor import Executor
    from wheeld.shm.wheel import TimerWheel

    wheel = TimerWheel.create(capacity, start_ms=1000)
    slot = ClientSlot(3, None, "bench", wheel.group_id("g"), "g", os.getpid(), os.getuid())
    executor = Executor(wheel, {3: slot}, 77, 0, collections.Counter(), lambda cs, reason: None, lambda: 1000)
    return executor, slot


class _Plan:
    """Batches of ring records in the e2e mix, keys kept live across batches."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.live: list[str] = []
        self.seq = 0

    def batch(self, n: int) -> np.ndarray:
        from wheeld.protocol import commands as C
        from wheeld.protocol.keys import encode_key

        rng, live, out = self.rng, self.live, []
        for _ in range(n):
            self.seq += 1
            r = rng.random()
            if r < 0.6 or not live:
                key = f"c0-{self.seq}"
                live.append(key)
                op, deadline = C.ADD, 1500 + rng.randrange(9000)
            elif r < 0.8:
                key = live[rng.randrange(len(live))]
                op, deadline = C.ADD, 1500 + rng.randrange(9000)
            else:
                i = rng.randrange(len(live))
                key = live[i]
                live[i] = live[-1]
                live.pop()
                op, deadline = C.CANCEL, 0
            kb, meta = encode_key(key)
            out.append(C.encode_command(op, kb, meta, deadline, self.seq))
        return np.frombuffer(b"".join(out), dtype=C.RECORD_DTYPE).copy()


def apply_paths(sizes: list[int], commands_per_point: int) -> list[dict]:
    from wheeld.daemon.executor import valid_records

    executor, slot = _private_executor(600_000)
    plan = _Plan(1)
    for _ in range(40):  # ~65k pending after the cancels
        records = plan.batch(4096)
        executor.apply_plan(slot, executor.plan(slot, records), records)
    rows = []
    for n in sizes:
        row = {"batch_size": n, "pending": len(executor.wheel)}
        for path in ("collapsed", "one_by_one"):
            batches = [plan.batch(n) for _ in range(max(3, commands_per_point // n))]
            t0 = time.perf_counter()
            for records in batches:
                valid_records(records, 1 << 17)
                if path == "collapsed":
                    executor.apply_plan(slot, executor.plan(slot, records), records)
                else:
                    executor.apply_in_order(slot, records)
            row[f"{path}_us_per_cmd"] = round((time.perf_counter() - t0) / (len(batches) * n) * 1e6, 2)
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- 2. park precision


async def _park_lateness(rounds: int) -> dict[str, list[float]]:
    from wheeld.daemon.alarm import Alarm

    loop = asyncio.get_running_loop()
    out: dict[str, list[float]] = {}
    for delay_ms in (0.3, 0.6, 0.9):  # call_later with the time left to the boundary, as parks did
        late = out.setdefault(f"call_later, {delay_ms} ms before the boundary", [])
        for _ in range(rounds):
            now = time.monotonic_ns()  # align: start delay_ms before a millisecond boundary
            boundary = (now // 1_000_000 + 2) * 1_000_000
            await asyncio.sleep(max(0.0, (boundary - int(delay_ms * 1e6) - time.monotonic_ns()) / 1e9))
            while time.monotonic_ns() < boundary - int(delay_ms * 1e6):
                pass
            fut = loop.create_future()
            loop.call_later((boundary - time.monotonic_ns()) / 1e9, fut.set_result, None)
            await fut
            late.append((time.monotonic_ns() - boundary) / 1e3)
    alarm = Alarm.create()
    if alarm is not None:
        late = out.setdefault("timerfd Alarm at the boundary", [])
        box: list[asyncio.Future | None] = [None]

        def fired() -> None:
            if alarm.consume() and box[0] is not None and not box[0].done():
                box[0].set_result(None)

        loop.add_reader(alarm.fileno(), fired)
        try:
            for _ in range(rounds * 3):
                boundary = (time.monotonic_ns() // 1_000_000 + 1) * 1_000_000
                box[0] = loop.create_future()
                alarm.arm(boundary)
                await box[0]
                late.append((time.monotonic_ns() - boundary) / 1e3)
        finally:
            loop.remove_reader(alarm.fileno())
            alarm.close()
    return out


def park_precision(rounds: int) -> list[dict]:
    import uvloop

    rows = []
    for name, values in uvloop.run(_park_lateness(rounds)).items():
        a = np.array(values)
        rows.append({"wake-up": name, "n": len(a), "early": int((a < 0).sum()), "p50_us": round(float(np.median(a)), 1),
                     "p99_us": round(float(np.percentile(a, 99)), 1), "max_us": round(float(a.max()), 1)})
    return rows


# --------------------------------------------------------------------------- 3. bookkeeping pauses


def _longest_insert_us(count: int, shards: int) -> tuple[float, float]:
    tables = [{} for _ in range(shards)]
    mask = shards - 1
    longest = 0
    t_all = time.perf_counter_ns()
    for i in range(count):
        ident = b"\x45c0-%d" % i
        t = time.perf_counter_ns()
        tables[hash(ident) & mask][ident] = i
        longest = max(longest, time.perf_counter_ns() - t)
    return longest / 1e3, (time.perf_counter_ns() - t_all) / count


def bookkeeping_pauses(count: int, recent: int) -> list[dict]:
    rows = []
    for shards in (1, 64):
        longest, mean_ns = _longest_insert_us(count, shards)
        rows.append({"what": f"{count:,} inserts into {shards} dict(s)", "longest_us": round(longest, 1),
                     "mean_ns_per_op": round(mean_ns, 1)})
    seen = {(b"\x45c0-%d" % i, i) for i in range(recent)}
    t = time.perf_counter_ns()
    del seen
    rows.append({"what": f"drop a set of {recent:,} (ident, tag) at once",
                 "longest_us": round((time.perf_counter_ns() - t) / 1e3, 1),
                 "mean_ns_per_op": None})
    sets = [set() for _ in range(64)]
    order: collections.deque = collections.deque()
    longest = 0
    t_all = time.perf_counter_ns()
    for i in range(recent * 2):
        item = (b"\x45c0-%d" % i, i)
        t = time.perf_counter_ns()
        sets[i & 63].add(item)
        order.append(item)
        if len(order) > recent:
            old = order.popleft()
            sets[old[1] & 63].discard(old)
        longest = max(longest, time.perf_counter_ns() - t)
    rows.append({"what": f"{recent * 2:,} remembered, the oldest forgotten one at a time (64 sets)",
                 "longest_us": round(longest / 1e3, 1),
                 "mean_ns_per_op": round((time.perf_counter_ns() - t_all) / (recent * 2), 1)})
    return rows


# --------------------------------------------------------------------------- 4. coalescing


def _paced_adds(daemon: DaemonProcess, client, trickle_ms: int) -> dict:
    """Adds every ~0.5 ms for ``trickle_ms`` on a parked daemon, no flush: wake-ups per add."""
    before = daemon.wait_parked()
    start_ns = time.monotonic_ns()
    n = 0
    while time.monotonic_ns() - start_ns < trickle_ms * 1_000_000:
        client.add(f"k{n}", 600_000)
        n += 1
        time.sleep(0.0005)
    after = daemon.wait_parked()
    return {"adds": n, "wakeups": after["wakeups_total"] - before["wakeups_total"],
            "ms": (time.monotonic_ns() - start_ns) / 1e6}


def _flush_latency_ms(daemon: DaemonProcess, client, flushes: int) -> list[float]:
    """An add then a flush on a parked daemon, ``flushes`` times: ms until each flush returned."""
    out = []
    for i in range(flushes):
        daemon.wait_parked()
        client.add(f"f{i}", 600_000)
        t = time.monotonic_ns()
        client.flush()
        out.append((time.monotonic_ns() - t) / 1e6)
    return out


def coalescing(trickle_ms: int, flushes: int) -> list[dict]:
    import wheeld

    rows = []
    for window_us in (0, 10_000):
        with tempfile.TemporaryDirectory(prefix="wheeld-bench-") as workdir:
            daemon = DaemonProcess(workdir, name=f"bench-paths-{os.getpid()}", capacity=100_000,
                                   extra=["--coalesce-us", str(window_us)])
            try:
                daemon.start(20)
                with wheeld.connect(daemon.socket_path, group="coalesce") as client:
                    client.flush()
                    paced = _paced_adds(daemon, client, trickle_ms)
                    latency = _flush_latency_ms(daemon, client, flushes)
            finally:
                daemon.cleanup()
        rows.append({"coalesce_us": window_us, "adds": paced["adds"], "wakeups": paced["wakeups"],
                     "wakeups_per_add": round(paced["wakeups"] / paced["adds"], 3),
                     "windows": round(paced["ms"] / (window_us / 1000), 1) if window_us else None,
                     "flush_p50_ms": round(statistics.median(latency), 3), "flush_max_ms": round(max(latency), 3)})
    return rows


# --------------------------------------------------------------------------- 5. expire paths


def expire_paths(rates: list[int], span_ms: int) -> list[dict]:
    from wheeld.shm.wheel import TimerWheel, encode_ident

    rows = []
    for per_ms in rates:
        row = {"timers_per_ms": per_ms}
        for method in ("expire", "expire_many"):
            n = per_ms * span_ms
            wheel = TimerWheel.create(n + 1000, start_ms=0)
            try:
                deadlines = np.sort(np.random.default_rng(per_ms).integers(1, span_ms + 1, n))
                wheel.schedule_many([encode_ident(i) for i in range(n)], deadlines)
                expire, fired, spent = getattr(wheel, method), 0, 0.0
                for now in range(1, span_ms + 1):
                    t0 = time.perf_counter()
                    slots = np.asarray(expire(now), dtype=np.int64)
                    spent += time.perf_counter() - t0
                    if slots.size:
                        wheel.release_many(slots, wheel.records_of(slots)["gen"])
                        fired += slots.size
                assert fired == n
                row[f"{method}_us_per_ms"] = round(spent / span_ms * 1e6, 1)
            finally:
                wheel.close()
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    add_save_option(parser)
    args = parser.parse_args(argv)
    quick = args.quick
    sizes = [32, 64, 128, 256, 1024] if quick else [32, 64, 128, 192, 256, 1024, 4096]
    apply_rows = apply_paths(sizes, 2_000 if quick else 20_000)
    from wheeld.protocol import accel

    print(f"1. apply paths (us per command, validation included; {accel.implementation()} hot path)")
    print(format_table(apply_rows, ["batch_size", "pending", "collapsed_us_per_cmd", "one_by_one_us_per_cmd"]))
    park_rows = park_precision(30 if quick else 300)
    print("\n2. park precision: wake-up after the start of the next millisecond (us)")
    print(format_table(park_rows, ["wake-up", "n", "early", "p50_us", "p99_us", "max_us"]))
    pause_rows = bookkeeping_pauses(20_000 if quick else 300_000, 1 << (12 if quick else 17))
    print("\n3. client bookkeeping pauses")
    print(format_table(pause_rows, ["what", "longest_us", "mean_ns_per_op"]))
    coalesce_rows = coalescing(200 if quick else 2_000, 15 if quick else 200)
    print("\n4. coalescing: paced adds on a parked daemon, then flushes")
    print(format_table(coalesce_rows, ["coalesce_us", "adds", "wakeups", "wakeups_per_add", "windows",
                                       "flush_p50_ms", "flush_max_ms"]))
    expire_rows = expire_paths([10, 25, 50, 100, 200], 200 if quick else 2_000)
    print(f"\n5. expire paths: us per call, one call per ms ({accel.implementation()} hot path)")
    print(format_table(expire_rows, ["timers_per_ms", "expire_us_per_ms", "expire_many_us_per_ms"]))
    if not quick:
        path = write_json("daemon_paths", {"hot_path": accel.implementation(),
                                           "apply_paths": apply_rows, "park_precision": park_rows,
                                           "bookkeeping_pauses": pause_rows, "coalescing": coalesce_rows,
                                           "expire_paths": expire_rows}, save=args.save)
        print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
