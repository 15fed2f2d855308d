"""Push floods through a live daemon: how a client waits for room in a full ring.

    python -m bench.ring_full                  # ~1 min; table, bench/runs/ring_full.json (--save: bench/results/)
    python -m bench.ring_full --adds 500000 --rounds 5

What is measured: one real daemon (``--ring-capacity`` 16384, its default) and
``--clients`` blocking clients (:func:`wheeld.connect`), each in its own process,
each pushing ``--adds`` adds of distinct keys (a 10 min delay, nothing fires) as
fast as it can, then a flush. Two clients out-push one daemon on two cores, so
their rings fill and every client spends part of the flood waiting for room.

Two ways of waiting, alternated round by round on the same daemon:

* ``sleep`` (the library's ``Client._wait_for_room``): ring the doorbell, sleep
  (50 us doubling to 1 ms) until an eighth of the ring is free;
* ``poll`` (the baseline: what the library did before): ring the doorbell, poll
  the ring with up to 20,000 ``sched_yield`` calls, then 0.2 ms sleeps, and return
  at the first free slot. The bench installs it on its clients itself.

Per round and mode: adds/s end to end (all clients' adds over the time from the
first push to the last flush's answer), the clients' CPU per add (their
``process_time`` over the push loop), the daemon's CPU per add. The table gives
the median over ``--rounds`` rounds, and each round's figures are in the JSON.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import format_table, write_json  # noqa: E402

_POLL_YIELDS = 20_000


def _poll_for_room(self) -> None:
    """The baseline wait: sched_yield polls, then 0.2 ms sleeps, back at the first free slot."""
    from wheeld.protocol.errors import RingFull

    self._ring_doorbell()
    free_slots = self._segment.free_slots
    for _ in range(_POLL_YIELDS):
        if free_slots():
            return
        os.sched_yield()
    end = time.monotonic() + self.ring_timeout_s
    while free_slots() == 0:
        if time.monotonic() >= end:
            raise RingFull(f"the ring stayed full for {self.ring_timeout_s} s")
        time.sleep(0.0002)


def _client(socket_path: str, tag: str, adds: int, mode: str, go, out) -> None:
    import wheeld

    w = wheeld.connect(socket_path, group=f"flood-{tag}", ring_timeout_s=60.0)
    if mode == "poll":
        w._wait_for_room = _poll_for_room.__get__(w)
    w.flush()
    keys = [f"{tag}-{i}" for i in range(adds)]
    add = w.add
    go.wait()
    cpu0 = time.process_time()
    for key in keys:
        add(key, 600_000)
    cpu = time.process_time() - cpu0
    w.flush(timeout_s=120)
    out.put({"tag": tag, "cpu_s": cpu, "done_ns": time.monotonic_ns()})
    for key in keys:  # leave the arena as it was (untimed)
        w.cancel(key)
    w.flush(timeout_s=120)
    w.close()


def _round(daemon, mode: str, clients: int, adds: int, tag: str) -> dict:
    import psutil

    ctx = mp.get_context("fork")
    go, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_client, args=(daemon.socket_path, f"{tag}{i}", adds, mode, go, out))
             for i in range(clients)]
    for p in procs:
        p.start()
    time.sleep(0.5)  # every client connected and flushed (an idle daemon meanwhile)
    ps = psutil.Process(daemon.pid)
    cpu0 = ps.cpu_times()
    start_ns = time.monotonic_ns()
    go.set()
    results: list[dict] = []
    deadline = time.monotonic() + 300
    while len(results) < len(procs):
        try:
            results.append(out.get(timeout=1.0))
        except queue.Empty:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                raise RuntimeError(f"a flood client failed (exit {failed}) or took over 300 s") from None
    end_ns = max(r["done_ns"] for r in results)
    cpu1 = ps.cpu_times()
    for p in procs:
        p.join(60)
    total = clients * adds
    return {"mode": mode, "adds_per_s": round(total / ((end_ns - start_ns) / 1e9)),
            "client_cpu_us_per_add": round(sum(r["cpu_s"] for r in results) * 1e6 / total, 3),
            "daemon_cpu_us_per_add": round(((cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)) * 1e6 / total, 3)}


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from daemon_harness import DaemonProcess

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--adds", type=int, default=300_000, help="adds per client per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--name", default="ring_full", help="the JSON's name (NAME.json)")
    ap.add_argument("--save", action="store_true")
    args = ap.parse_args(argv)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="wheeld-ring-full-") as tmp:
        daemon = DaemonProcess(tmp, capacity=args.clients * args.adds + 100_000).start()
        try:
            for r in range(args.rounds):
                for mode in ("poll", "sleep") if r % 2 == 0 else ("sleep", "poll"):
                    row = _round(daemon, mode, args.clients, args.adds, f"r{r}{mode[0]}")
                    row["round"] = r
                    rows.append(row)
                    print(f"round {r} {mode:5}: {row['adds_per_s']:>10,} adds/s, client "
                          f"{row['client_cpu_us_per_add']} us/add, daemon {row['daemon_cpu_us_per_add']} us/add",
                          flush=True)
        finally:
            daemon.cleanup()
    table = []
    for mode in ("poll", "sleep"):
        mine = [r for r in rows if r["mode"] == mode]
        table.append({"wait": mode, **{k: statistics.median(r[k] for r in mine)
                                       for k in ("adds_per_s", "client_cpu_us_per_add", "daemon_cpu_us_per_add")}})
    print()
    print(format_table(table, ["wait", "adds_per_s", "client_cpu_us_per_add", "daemon_cpu_us_per_add"],
                       ["wait for room", "adds/s (median)", "client CPU us/add", "daemon CPU us/add"]))
    path = write_json(args.name, {
        "command": "python -m bench.ring_full " + " ".join(argv if argv is not None else sys.argv[1:]),
        "clients": args.clients, "adds_per_client": args.adds, "ring_capacity": 1 << 14,
        "medians": table, "rounds": rows}, args.save)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
