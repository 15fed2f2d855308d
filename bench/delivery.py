"""The daemon's delivery per millisecond, at the shape of bench.e2e's steady phase.

    python -m bench.delivery            # ~1 min: table + bench/runs/delivery.json (--save: bench/results/)
    python -m bench.delivery --quick    # seconds

A private-memory wheel of 2**20 records holds ~150k pending timers (delays uniform
0.5-9.5 s); each millisecond 25 new ones are scheduled and ``Delivery.expire(now)`` then
``Delivery.dispatch()`` run, as the daemon's loop calls them, for two members of one
group whose frames go out on real Unix socket pairs (drained by the harness, outside the
timed part); every fired timer is then released, as its acknowledgement would. Timed:
expire plus dispatch, per millisecond, after a warm-up second.

Two paths of the same code, alternated, each run in a process of its own:

* ``C``: the usual records queued and their frames written from the arena in C
  (``wheeld.daemon.frames``: ``queue_usual``, ``expirations_frame``);
* ``checked``: the path every record took before those, and that records they do not
  take still take: record tuples, ``Delivery._queue_rows``, item tuples, msgspec and
  the frame check (``Delivery._items_from_rows``), selected by replacing the two
  functions in the process.

Both run the compiled wheel (the expire itself is in C either way).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time

from bench.common import add_save_option, format_table, write_json

PENDING = 150_000
PER_MS = 25
DELAY_MS = (500, 9_500)
WARM_MS = 1_000


class _Member:
    """A group member whose frames go out on a socket (the daemon's Session, minus the loop)."""

    congested = closed = False

    def __init__(self, client, sock):
        self.client = client
        self.sock = sock

    def send(self, frame) -> None:
        self.sock.send(frame)


def measure(path: str, ms: int) -> dict:
    """One run in this process: us per millisecond of expire + dispatch, ``path`` "C" or "checked"."""
    from wheeld.daemon import delivery as D
    from wheeld.daemon.client_table import ClientSlot
    from wheeld.daemon.config import Config
    from wheeld.protocol import accel
    from wheeld.shm.wheel import TimerWheel

    if path == "checked":
        D.expirations_frame = lambda *args: None
        D.Delivery._queue_usual = lambda self, slots, now: self._queue_rows(slots, self._rows(slots), now)
    wheel = TimerWheel.create(1 << 20, start_ms=1000)
    clock = [1000]
    clients, readers = {}, []
    delivery = D.Delivery(wheel, clients, Config(socket_path="/nonexistent/bench.sock", name="bench-delivery"),
                          collections.Counter(), 1000, lambda *args: None, lambda: clock[0])
    group = wheel.group_id("g")
    for slot in (3, 4):
        cs = ClientSlot(slot, None, "bench", group, "g", os.getpid(), 0)
        clients[slot] = cs
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        theirs.setblocking(False)
        readers.append(theirs)
        cs.session = _Member(cs, ours)
        delivery.members[group].append(cs.session)
    rng = random.Random(1)
    made = 0

    def add(now: int) -> None:
        nonlocal made
        made += 1
        wheel.schedule_ident(b"\x4e" + b"conn-%09d" % made + b"\0" * 18, now + rng.randint(*DELAY_MS), group, made)

    for _ in range(PENDING):
        add(1000)
    spent_ns = fired = 0
    sink = bytearray(1 << 20)
    for now in range(1001, 1001 + WARM_MS + ms):
        clock[0] = now
        for _ in range(PER_MS):
            add(now)
        t0 = time.perf_counter_ns()
        delivery.expire(now)
        delivery.dispatch()
        t1 = time.perf_counter_ns()
        for reader in readers:
            try:
                while reader.recv_into(sink):
                    pass
            except BlockingIOError:
                pass
        for cs in clients.values():
            if now > 1000 + WARM_MS:
                fired += len(cs.unacked)
            for slot, gen in cs.unacked.items():
                wheel.release(slot, gen)
            cs.unacked.clear()
        if now > 1000 + WARM_MS:
            spent_ns += t1 - t0
    return {"path": path, "hot_path": accel.implementation(), "ms": ms, "fired_per_ms": fired / ms,
            "us_per_ms": spent_ns / ms / 1000, "ns_per_fired": spent_ns / max(fired, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short runs (a smoke run)")
    parser.add_argument("--repeat", type=int, default=5, help="runs of each path, alternated")
    parser.add_argument("--child", choices=["C", "checked"], help=argparse.SUPPRESS)
    parser.add_argument("--ms", type=int, default=None, help=argparse.SUPPRESS)
    add_save_option(parser)
    args = parser.parse_args(argv)
    ms = args.ms or (500 if args.quick else 5_000)
    if args.child:
        print(json.dumps(measure(args.child, ms)))
        return 0
    repeat = 1 if args.quick else args.repeat
    runs = []
    for _ in range(repeat):
        for path in ("checked", "C"):
            out = subprocess.run([sys.executable, "-m", "bench.delivery", "--child", path, "--ms", str(ms)],
                                 capture_output=True, text=True, check=True, timeout=600)
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    rows = []
    for path in ("checked", "C"):
        mine = [r["us_per_ms"] for r in runs if r["path"] == path]
        fired = [r["fired_per_ms"] for r in runs if r["path"] == path]
        rows.append({"path": path, "runs": len(mine), "us_per_ms_median": statistics.median(mine),
                     "us_per_ms_min": min(mine), "us_per_ms_max": max(mine),
                     "fired_per_ms": statistics.median(fired),
                     "ns_per_fired_median": statistics.median(r["ns_per_fired"] for r in runs if r["path"] == path)})
    print(f"delivery: expire + dispatch per ms, {PENDING:,} pending, {PER_MS} scheduled a ms, two members "
          f"({runs[0]['hot_path']} wheel; runs alternated)")
    print(format_table(rows, ["path", "runs", "us_per_ms_median", "us_per_ms_min", "us_per_ms_max", "fired_per_ms",
                              "ns_per_fired_median"]))
    ratio = rows[0]["us_per_ms_median"] / rows[1]["us_per_ms_median"]
    print(f"checked / C: {ratio:.2f}x")
    if not args.quick:
        path = write_json("delivery", {"pending": PENDING, "per_ms": PER_MS, "ms_per_run": ms,
                                       "load_average_at_start": os.getloadavg(), "summary": rows,
                                       "checked_over_c": ratio, "runs": runs}, save=args.save)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
