"""wheeld's side of ``bench/fleet.py``: the same daemon local-only and replicating to a
3-node NATS JetStream cluster, in one run.

- **throughput**: ``clients`` worker processes, each ``ops`` timer ops (60/20/20 add /
  re-arm / cancel, timers 10-70 s ahead so none fires during the run) with a ``flush()``
  every ``flush_every`` ops; ops/s = all ops / the time until the last flush returned;
  every flush's latency (p50/p99/max). Modes: ``local`` (``--journal``, ``--fsync
  interval=10``: what a reboot keeps) and ``replicated`` (the same plus ``--replicate``
  ``--durability replicated``: each flush returns once a quorum of the cluster stored it).
- **scheduling and lateness at the application**, the same workload as the NATS
  message-schedule baseline: ``timers`` timers due 1.0-3.0 s ahead, armed as fast as one
  client can, acknowledged by one flush() after the last (it returns once the cluster
  stored them all: replicated), received by a worker of the group;
  lateness = receive time - (the add() call's time + its delay), both CLOCK_MONOTONIC in
  ns, reported in ms to the µs; early count; a tenth of
  them cancelled (cancel is acknowledged by the flush; none of them may arrive).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import tempfile
import time

from bench.common import DaemonProcess, no_collector_pauses, unique_name

MODES = ("local", "replicated")


def _credentials(connect: dict | None) -> dict:
    """The daemon's environment for the cluster's credentials (as the systemd drop-in sets it)."""
    connect = connect or {}
    if connect.get("user") is None:
        return {}
    return {"WHEELD_NATS_USER": connect["user"], "WHEELD_NATS_PASSWORD": connect.get("password") or ""}


def _daemon(workdir: str, mode: str, urls: list[str], linger_ms: int | None = None) -> DaemonProcess:
    host = f"bench{unique_name()[-8:]}"
    extra = ["--journal", os.path.join(workdir, f"journal-{host}"), "--fsync", "interval=10"]
    if mode == "replicated":
        extra += ["--replicate", ",".join(urls), "--host-id", host, "--durability", "replicated",
                  "--replicate-timeout-s", "30"]
        if linger_ms is not None:  # (else the daemon's default)
            extra += ["--replicate-linger-ms", str(linger_ms)]
    daemon = DaemonProcess(workdir, capacity=2_000_000, extra=extra, log_level="WARNING")
    daemon.fleet_host = host  # (its stream: WHEELD_<host>)
    return daemon


def _forget(urls: list[str], host: str, connect: dict | None) -> None:
    """Delete a finished daemon's stream and lease (``wheelctl fleet forget``): every R3
    stream left behind keeps a Raft group beating on the cluster, which would slow every
    later run of the benchmark on this machine."""
    import asyncio

    import nats

    from wheeld.ctl_fleet import forget_on

    async def forget() -> None:
        options = {"servers": list(urls), "connect_timeout": 5, "allow_reconnect": False}
        if connect and connect.get("user") is not None:
            options.update(user=connect["user"], password=connect.get("password") or "")
        nc = await nats.connect(**options)
        try:
            await forget_on(nc, host)  # (a local-only daemon has neither: nothing deleted)
        finally:
            await nc.close()

    asyncio.run(forget())


def _worker(socket_path: str, index: int, ops: int, flush_every: int, start, out) -> None:
    import wheeld

    w = wheeld.connect(socket_path, group=f"bench{index}")
    add, cancel = w.add, w.cancel
    keys = [f"w{index}-{i}" for i in range(max(1, ops // 2))]
    latencies = []
    start.wait()
    t0 = time.perf_counter()
    armed = 0
    for i in range(ops):
        r = i % 10
        if r < 6 or armed == 0:
            add(keys[armed % len(keys)], 10_000 + (i * 7919) % 60_000)
            armed += 1
        elif r < 8:
            add(keys[(i * 31) % armed % len(keys)], 10_000 + (i * 104_729) % 60_000)  # re-arm
        else:
            cancel(keys[(i * 17) % armed % len(keys)])
        if i % flush_every == flush_every - 1:
            f = time.perf_counter()
            w.flush(timeout_s=60)
            latencies.append(time.perf_counter() - f)
    w.flush(timeout_s=60)
    out.put({"ops": ops, "seconds": time.perf_counter() - t0, "flush_s": latencies})
    w.close()


def throughput(urls: list[str], mode: str, clients: int = 2, ops: int = 200_000, flush_every: int = 1_000,
               fault=None, connect: dict | None = None, linger_ms: int | None = None) -> dict:
    """ops/s and flush latency of one daemon in ``mode`` (module docstring). ``fault(host)``:
    called in a thread once the clients start, with the daemon's host id (a server killed and
    restarted meanwhile, say); what it returns is reported as ``fault``."""
    workdir = tempfile.mkdtemp(prefix=f"wheeld-bench-fleet-{mode}-")
    daemon = _daemon(workdir, mode, urls, linger_ms)
    try:
        daemon.start(timeout_s=60, env=_credentials(connect))
        if mode == "replicated":
            _wait_replicating(daemon)
        ctx = mp.get_context("fork")  # (spawn would leave its resource tracker running)
        start, out = ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=_worker, args=(daemon.socket_path, i, ops, flush_every, start, out))
                 for i in range(clients)]
        for p in procs:
            p.start()
        time.sleep(1.0)
        t0 = time.perf_counter()
        start.set()
        fault_result: dict = {}
        if fault is not None:
            import threading

            thread = threading.Thread(target=lambda: fault_result.update(fault(daemon.fleet_host) or {}),
                                      daemon=True)
            thread.start()
        results = [out.get(timeout=600) for _ in procs]
        elapsed = time.perf_counter() - t0
        if fault is not None:
            thread.join(120)
        for p in procs:
            p.join(30)
        flushes = sorted(x for r in results for x in r["flush_s"])
        counters = daemon.counters()
        return {"mode": mode, "clients": clients, "ops": clients * ops, "flush_every": flush_every,
                "ops_per_s": round(clients * ops / elapsed), "seconds": round(elapsed, 3),
                "flush_ms_p50": _pct(flushes, 50), "flush_ms_p99": _pct(flushes, 99),
                "flush_ms_max": round(flushes[-1] * 1000, 3) if flushes else None, "flushes": len(flushes),
                "flushes_refused": counters["journal_flushes_refused_total"],
                **({"fault": fault_result, "lag_records_at_end": _caught_up(daemon)} if fault is not None else {})}
    finally:
        daemon.cleanup()
        shutil.rmtree(workdir, ignore_errors=True)
        _forget(urls, daemon.fleet_host, connect)


def _caught_up(daemon: DaemonProcess, timeout_s: float = 60.0) -> int:
    """Wait until the stream stored everything the daemon journaled; the lag left (0)."""
    end = time.monotonic() + timeout_s
    lag = daemon.counters()["fleet_lag_records"]
    while lag and time.monotonic() < end:
        time.sleep(0.1)
        lag = daemon.counters()["fleet_lag_records"]
    return lag


def _wait_replicating(daemon: DaemonProcess, timeout_s: float = 30.0) -> None:
    from wheeld.protocol import arena_layout as AL

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            if daemon.counters()["fleet_state"] == AL.FLEET_STATES.index("replicating"):
                return
        except Exception:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"the daemon never replicated:\n{daemon.log()[-2000:]}")


def _pct(sorted_s: list[float], p: float) -> float | None:
    if not sorted_s:
        return None
    return round(sorted_s[min(len(sorted_s) - 1, int(len(sorted_s) * p / 100))] * 1000, 3)


def schedules(urls: list[str], timers: int = 10_000, ahead_s: tuple[float, float] = (1.0, 3.0),
              cancel_every: int = 10, connect: dict | None = None, linger_ms: int | None = None) -> dict:
    """wheeld's answer to the message-schedule baseline (module docstring), replicated."""
    import wheeld
    workdir = tempfile.mkdtemp(prefix="wheeld-bench-fleet-sched-")
    daemon = _daemon(workdir, "replicated", urls, linger_ms)
    try:
        daemon.start(timeout_s=60, env=_credentials(connect))
        _wait_replicating(daemon)
        sender = wheeld.connect(daemon.socket_path, group="sched")  # a group's timers come back to it
        lo, hi = int(ahead_s[0] * 1000), int(ahead_s[1] * 1000)
        wanted, cancelled = {}, set()
        t0 = time.perf_counter()
        for i in range(timers):
            delay = lo + (i * 7919) % (hi - lo)
            key = f"s{i}"
            wanted[key] = time.monotonic_ns() / 1e6 + delay  # the call's time in ns: lateness in µs
            sender.add(key, delay)
        sender.flush(timeout_s=60)  # returns once the cluster stored them all (--durability replicated)
        armed_s = time.perf_counter() - t0
        for i in range(0, timers, cancel_every) if cancel_every else ():
            if sender.cancel(f"s{i}"):
                cancelled.add(f"s{i}")
        sender.flush(timeout_s=60)
        got: dict[str, float] = {}
        end = time.monotonic() + ahead_s[1] + 10
        expected = set(wanted) - cancelled
        waiting = len(expected)  # counted down, not a set built per poll: the loop's own cost is lateness too
        with no_collector_pauses():  # (this process's own collections are not the service's lateness)
            while time.monotonic() < end and waiting:
                batch = sender.poll(0.05)
                at = time.monotonic_ns() / 1e6  # when the application has them
                for e in batch:
                    if e.key not in got:
                        got[e.key] = at
                        waiting -= e.key in expected
        sender.close()
        late = sorted(round(got[k] - wanted[k], 3) for k in got if k in wanted)
        return {"system": "wheeld --durability replicated", "timers": timers,
                "schedules_per_s": round(timers / armed_s), "delivered": len(got),
                "missing": len(expected - set(got)), "cancelled": len(cancelled),
                "cancelled_delivered": len(cancelled & set(got)),
                "early": sum(1 for x in late if x < 0),
                "lateness_ms_p50": late[len(late) // 2] if late else None,
                "lateness_ms_p99": late[min(len(late) - 1, len(late) * 99 // 100)] if late else None,
                "lateness_ms_max": late[-1] if late else None}
    finally:
        daemon.cleanup()
        shutil.rmtree(workdir, ignore_errors=True)
        _forget(urls, daemon.fleet_host, connect)


def flush_latency(urls: list[str], mode: str, rounds: int = 1_000, ops_per_flush: int = 10,
                  connect: dict | None = None, linger_ms: int | None = None) -> dict:
    """What a flush() waits for, apart from the work it covers: one client, ``ops_per_flush``
    adds then a flush(), ``rounds`` times; p50/p99/max of the flush, local and replicated."""
    import wheeld

    workdir = tempfile.mkdtemp(prefix=f"wheeld-bench-fleet-lat-{mode}-")
    daemon = _daemon(workdir, mode, urls, linger_ms)
    try:
        daemon.start(timeout_s=60, env=_credentials(connect))
        if mode == "replicated":
            _wait_replicating(daemon)
        w = wheeld.connect(daemon.socket_path, group="lat")
        waits = []
        for r in range(rounds):
            for i in range(ops_per_flush):
                w.add(f"l{r}-{i}", 600_000)
            t = time.perf_counter()
            w.flush(timeout_s=60)
            waits.append(time.perf_counter() - t)
        w.close()
        waits.sort()
        return {"mode": mode, "rounds": rounds, "ops_per_flush": ops_per_flush, "flush_ms_p50": _pct(waits, 50),
                "flush_ms_p99": _pct(waits, 99), "flush_ms_max": round(waits[-1] * 1000, 3)}
    finally:
        daemon.cleanup()
        shutil.rmtree(workdir, ignore_errors=True)
        _forget(urls, daemon.fleet_host, connect)
