"""Per-call cost of the client's ``add``, ``cancel``, ``touch`` and ``add_idle``: compiled and Python path.

    python -m bench.client_ops                 # ~1 min; prints a table, writes bench/runs/client_ops.json
                                               # (--save: bench/results/)
    python -m bench.client_ops --rounds 41 --batch 8192

What is measured: the real client code (:class:`wheeld.core.ClientCore`, the state
machine the blocking and the asyncio client share) pushing real 64-byte records
into a real ring (:class:`wheeld.shm.ring.ClientSegment`), with no daemon. Each
path runs in its own child process (``WHEELD_PURE_PYTHON=1`` for the Python
path, unset for the compiled one; the child reports which path it ran). The child
plays the daemon's part itself: it creates the ring segment and a status page
(sealed memfds, nothing in /dev/shm), hands them to the client through the
client's own ``_on_welcome`` (what a real ``Welcome`` does), publishes an arena
with room to spare and leaves the ``parked`` word at 0 (a daemon that is awake),
so no call rings the doorbell (the bench checks that none did: a doorbell is a
``send`` system call, the daemon's business, not the client's own cost). Between
timed rounds the child drains the ring, untimed, so the ring never fills.

Why not a live daemon: on a 2-core machine shared with other work, a daemon
draining and parking concurrently turns a 0.2 us figure into a measure of the
scheduler (and of doorbells every time it parks); bench/e2e.py measures that
whole path.

Per operation, ``--rounds`` rounds of ``--batch`` calls (distinct str keys
``"conn-NNNNNN"``, a 60 s delay), best round and median, in us per call. The
figure includes the Python ``for`` loop that makes the calls (``loop`` row: the
same loop calling a function that does nothing, ~20-30 ns).

* ``add``: arms a fresh key (the key was cancelled the round before, so the
  bookkeeping dicts hold an entry of the same size: a steady state);
* ``cancel``: cancels an armed key (the hit path: its arming is remembered so a
  late expiration is dropped; one FLUSH record every 256 cancels);
* ``touch``: one idle timer's activity (keys armed with ``add_idle`` first);
* ``add_idle``: arms an idle timer on a key that has its touch slot already.

With ``--live N`` (N keys armed and left pending: ``python -m bench.client_ops --live
200000``), the same calls on keys drawn at random among the N, as an application with N
open connections makes them (bench/e2e.py's clients hold 100k-180k): ``add, live``
re-arms an armed key, ``cancel, live`` cancels one (re-armed after the round, untimed),
``loop, live`` is the empty loop over such a draw. Each row draws its own keys, and
every draw is made before the first timed round (a draw reads the keys it takes), so no
row finds its keys in the caches because of its own draw or the row before it; the
baseline's dict holds the same N keys. What these rows add to the ones above is the
cost of reaching a key's objects in memory (its ``str``, the dict slots that name it),
which an in-process timer pays as well.

Baseline, in the same child (plain Python, the same on both paths): what an
in-process timer costs per call: a dict store of the deadline plus
``heapq.heappush`` of ``(deadline, key)`` (``add``), a dict pop (``cancel``),
a dict store of the time (``touch``); each computes the deadline from
``time.monotonic_ns()`` as the client does.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import random
import statistics
import subprocess
import sys
import time

RING_CAPACITY = 1 << 16
TOUCH_CAPACITY = 1 << 14
DELAY_MS = 60_000
LIVE_ROWS = ("add, live", "cancel, live", "loop, live", "baseline add, live", "baseline cancel, live")  # --live


def _child(rounds: int, batch: int, live: int = 0) -> dict:
    import wheeld
    from wheeld.core import ClientCore
    from wheeld.protocol import accel
    from wheeld.protocol import messages as M
    from wheeld.shm.ring import ClientSegment
    from wheeld.shm.status import StatusPage

    class BenchClient(ClientCore):
        """The client state machine with a doorbell that only counts (no socket)."""

        def __init__(self):
            super().__init__("/nonexistent/wheeld.sock", "bench", 5.0, 30.0, "bench")
            self.doorbells = 0

        def _ring_doorbell(self, urgent: bool = True) -> None:
            self.doorbells += 1

    name = f"wheeld-bench-client-ops-{os.getpid()}"
    consumer = ClientSegment.create(name, RING_CAPACITY, TOUCH_CAPACITY)
    status = StatusPage.create(name + "-status")
    status.publish(1 << 40, 0, 0)
    client = BenchClient()
    welcome = M.Welcome(M.PROTOCOL_VERSION, 1, name, RING_CAPACITY, TOUCH_CAPACITY, "bench", 1, 1 << 40,
                        arena_epoch=7, status_page=True)
    client._on_welcome(welcome, [os.dup(consumer.fd), os.dup(status.readonly_fd)])
    assert client._status is not None, "the bench needs the status page (a parked word to read)"
    keys = [f"conn-{i:06d}" for i in range(batch)]
    idle_keys = keys[: min(batch, TOUCH_CAPACITY)]
    perf = time.perf_counter_ns
    drain = consumer.drain
    drained = 0

    def timed(call, args_list) -> float:
        start = perf()
        for key in args_list:
            call(key)
        return (perf() - start) / len(args_list) / 1000

    def timed2(call, args_list, arg) -> float:
        start = perf()
        for key in args_list:
            call(key, arg)
        return (perf() - start) / len(args_list) / 1000

    samples: dict[str, list[float]] = {k: [] for k in ("loop", "add", "cancel", "touch", "add_idle",
                                                       "baseline add", "baseline cancel", "baseline touch")}

    def nothing(key, arg=None):
        return None

    add, cancel, touch, add_idle = client.add, client.cancel, client.touch, client.add_idle
    # warm-up: every key armed and cancelled once (the dicts reach their steady size)
    for key in keys:
        add(key, DELAY_MS)
    drained += len(drain())
    for key in keys:
        cancel(key)
    drained += len(drain())
    for _ in range(rounds):
        samples["loop"].append(timed2(nothing, keys, DELAY_MS))
        samples["add"].append(timed2(add, keys, DELAY_MS))
        drained += len(drain())
        samples["cancel"].append(timed(cancel, keys))
        drained += len(drain())
    for key in idle_keys:
        add_idle(key, DELAY_MS)
    drained += len(drain())
    for _ in range(rounds):
        samples["touch"].append(timed(touch, idle_keys))
        samples["add_idle"].append(timed2(add_idle, idle_keys, DELAY_MS))
        drained += len(drain())

    # the in-process baseline
    deadlines: dict = {}
    heap: list = []
    monotonic_ns = time.monotonic_ns
    heappush = heapq.heappush

    def base_add(key, delay_ms):
        deadline = delay_ms - (-monotonic_ns() // 1_000_000)
        deadlines[key] = deadline
        heappush(heap, (deadline, key))
        return deadline

    def base_cancel(key):
        return deadlines.pop(key, None) is not None

    def base_touch(key):
        deadlines[key] = -(-monotonic_ns() // 1_000_000)

    for _ in range(rounds):
        heap.clear()
        samples["baseline add"].append(timed2(base_add, keys, DELAY_MS))
        samples["baseline touch"].append(timed(base_touch, keys))
        samples["baseline cancel"].append(timed(base_cancel, keys))

    if live:
        drained += _live_rounds(samples, rounds, batch, live, client, drain, timed, timed2, nothing,
                                (deadlines, heap, base_add, base_cancel))

    doorbells = client.doorbells
    paths = accel.module_paths()
    client._closed = True
    client._release_local()
    consumer.close()
    status.close()
    return {
        "wheeld": wheeld.__name__,
        "module_paths": paths,
        "doorbells": doorbells,
        "records_drained": drained,
        "us_per_call": {k: {"best": min(v), "median": statistics.median(v)} for k, v in samples.items()},
    }


def _live_rounds(samples: dict, rounds: int, batch: int, live: int, client, drain, timed, timed2, nothing,
                 baseline: tuple) -> int:
    """The ``--live`` rows (see the module's doc): ``live`` keys armed, then per round
    calls on keys drawn at random among them, a fresh draw for every timed row. Returns
    the records drained."""
    deadlines, heap, base_add, base_cancel = baseline
    add, cancel = client.add, client.cancel
    rng = random.Random(7)
    keys = [f"live-{i:07d}" for i in range(live)]
    drained = 0
    for start in range(0, live, batch):
        for key in keys[start: start + batch]:
            add(key, DELAY_MS)
        drained += len(drain())
    deadlines.clear()
    heap.clear()
    for key in keys:
        base_add(key, DELAY_MS)
    for name in LIVE_ROWS:
        samples[name] = []
    # Every draw made before any is timed: a draw reads the keys it takes (their reference
    # counts), so a row timed right after its own draw would find them in the caches.
    draws = [[rng.sample(keys, batch) for _ in LIVE_ROWS] for _ in range(rounds)]
    for add_keys, cancel_keys, loop_keys, base_add_keys, base_cancel_keys in draws:
        samples["loop, live"].append(timed2(nothing, loop_keys, DELAY_MS))
        samples["add, live"].append(timed2(add, add_keys, DELAY_MS))
        drained += len(drain())
        samples["cancel, live"].append(timed(cancel, cancel_keys))
        drained += len(drain())
        for key in cancel_keys:  # armed again: N live keys for the next round
            add(key, DELAY_MS)
        drained += len(drain())
        samples["baseline add, live"].append(timed2(base_add, base_add_keys, DELAY_MS))
        samples["baseline cancel, live"].append(timed(base_cancel, base_cancel_keys))
        for key in base_cancel_keys:
            base_add(key, DELAY_MS)
    return drained


def _run_child(pure: bool, rounds: int, batch: int, live: int = 0) -> dict:
    env = dict(os.environ)
    env.pop("WHEELD_PURE_PYTHON", None)
    if pure:
        env["WHEELD_PURE_PYTHON"] = "1"
    command = [sys.executable, "-m", "bench.client_ops", "--child", "--rounds", str(rounds), "--batch", str(batch),
               "--live", str(live)]
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    from bench.common import add_save_option

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--live", type=int, default=0, metavar="N",
                        help="also time calls on keys drawn at random among N armed ones (e.g. 200000)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    parser.add_argument("--out", default="client_ops", metavar="NAME", help="result name: writes NAME.json")
    add_save_option(parser)
    args = parser.parse_args(argv)
    if args.batch * 2 > RING_CAPACITY:
        parser.error(f"--batch must be at most {RING_CAPACITY // 2} (a round must fit the ring)")
    if args.child:
        print(json.dumps(_child(args.rounds, args.batch, args.live)))
        return

    from bench.common import format_table, write_json

    runs = {"compiled": _run_child(False, args.rounds, args.batch, args.live),
            "python": _run_child(True, args.rounds, args.batch, args.live)}
    for label, run in runs.items():
        kinds = set(run["module_paths"].values())
        if kinds != {label}:
            print(f"warning: the {label} child ran modules {run['module_paths']}", file=sys.stderr)
        if run["doorbells"]:
            print(f"warning: the {label} child rang the doorbell {run['doorbells']} times", file=sys.stderr)
    rows = []
    ops = ["add", "cancel", "touch", "add_idle", "loop", "baseline add", "baseline cancel", "baseline touch"]
    if args.live:
        ops += LIVE_ROWS
    for op in ops:
        row = {"op": op}
        for label, run in runs.items():
            figures = run["us_per_call"][op]
            row[f"{label} best"] = round(figures["best"], 3)
            row[f"{label} median"] = round(figures["median"], 3)
        rows.append(row)
    columns = ["op", "compiled best", "compiled median", "python best", "python median"]

    def cell3(value):
        return f"{value:.3f}"

    printable = [{k: (cell3(v) if isinstance(v, float) else v) for k, v in row.items()} for row in rows]
    print(f"us per call ({args.rounds} rounds of {args.batch} calls; best round, median round)")
    print(format_table(printable, columns))
    if not args.no_write:
        path = write_json(args.out, {
            "command": "python -m bench.client_ops " + " ".join(argv if argv is not None else sys.argv[1:]),
            "rounds": args.rounds,
            "batch": args.batch,
            "live": args.live,
            "ring_capacity": RING_CAPACITY,
            "rows_us_per_call": rows,
            "runs": runs,
        }, save=args.save)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
