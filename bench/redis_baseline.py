"""The Redis baseline of :mod:`bench.e2e`: a sorted-set delayed queue, the same plan.

What a user would build with Redis instead of wheeld:

* a real ``redis-server`` (7.x, ``apt-get install redis-server``) started here on
  127.0.0.1 and a free port, without persistence (``--save '' --appendonly no``),
  stopped by pid at the end;
* one sorted set per client (``timers:0``, ``timers:1``): add and re-arm are
  ``ZADD timers:N <deadline_ms> <key>`` (ZADD of an existing member moves it),
  cancel is ``ZREM``;
* the consumer is a Lua script run atomically by the server: take up to 1000
  members with ``score <= now`` (``ZRANGEBYSCORE .. WITHSCORES LIMIT``) and
  ``ZREM`` them; the client passes ``now`` = its CLOCK_MONOTONIC ms (the
  scores are CLOCK_MONOTONIC deadlines, like wheeld's).

Two client processes (``redis-py``; with ``hiredis`` installed it parses the
replies, which is what a user tuning Redis would do), the same seeded plan and phases as the
wheeld run: preload, burst (pipelines of ``pipeline`` commands, transaction
off, one pop appended to each pipeline; throughput = ops of both clients /
time until the last pipeline's reply), steady (one pipeline + pop per 1 ms
step: a consumer polling every millisecond), and an *unpipelined* run (one
round trip per command) for reference. Lateness: ``fired`` = the pop's
``now`` minus the score, ``recv`` = the reply's arrival minus the score.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import traceback

from bench.e2e import (
    GRACE_S,
    OP_CANCEL,
    PendingSampler,
    Phases,
    Received,
    Sizes,
    lateness_report,
    make_plan,
    stop_processes,
)

POP_LIMIT = 1000
POP_DUE = """
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'WITHSCORES', 'LIMIT', 0, tonumber(ARGV[2]))
if #due > 0 then
  local members = {}
  for i = 1, #due, 2 do members[#members + 1] = due[i] end
  redis.call('ZREM', KEYS[1], unpack(members))
end
return due
"""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A private redis-server on loopback; :meth:`stop` ends it by pid."""

    def __init__(self):
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (apt-get install -y redis-server)")
        self.exe = exe
        self.port = 0
        self.dir = tempfile.mkdtemp(prefix="wheeld-e2e-redis-")
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 10.0) -> "RedisServer":
        import redis

        for _attempt in range(5):
            self.port = free_port()
            self.proc = subprocess.Popen(
                [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--dir", self.dir, "--daemonize", "no", "--loglevel", "warning"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            end = time.monotonic() + timeout_s
            while time.monotonic() < end and self.proc.poll() is None:
                try:
                    redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1).ping()
                    return self
                except redis.exceptions.ConnectionError:
                    time.sleep(0.02)
            self.stop()  # port taken meanwhile, or too slow: try another
        raise RuntimeError("could not start redis-server")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)

    def cleanup(self) -> None:
        try:
            self.stop()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


# --------------------------------------------------------------------------- a client process


def redis_client(client: int, port: int, sizes: Sizes, seed: int, phases: Phases) -> None:
    try:
        phases.result(client, _redis_client(client, port, sizes, seed, phases))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        phases.error(client, traceback.format_exc())


def _redis_client(client: int, port: int, sizes: Sizes, seed: int, phases: Phases) -> dict:
    import redis

    plan = make_plan(client, sizes, seed)
    r = redis.Redis(host="127.0.0.1", port=port)
    zkey = f"timers:{client}"
    pop_sha = r.script_load(POP_DUE)
    got = Received()
    d_append, f_append, r_append = got.deadline_ms.append, got.fired_ms.append, got.recv_us.append
    monotonic_ns = time.monotonic_ns
    out: dict = {"client": client}

    def record(due, now_ms) -> int:
        if due:
            recv_us = monotonic_ns() // 1000
            for i in range(1, len(due), 2):
                d_append(int(float(due[i])))
                f_append(now_ms)
                r_append(recv_us)
        return len(due) // 2

    def pop_now() -> int:
        now_ms = monotonic_ns() // 1_000_000
        return record(r.evalsha(pop_sha, 1, zkey, now_ms, POP_LIMIT), now_ms)

    def idle() -> None:
        pop_now()
        time.sleep(0.001)

    def run_pipelined(ops) -> None:
        pipe = r.pipeline(transaction=False)
        zadd, zrem = pipe.zadd, pipe.zrem
        for op, key, delay in ops:
            if op == OP_CANCEL:
                zrem(zkey, key)
            else:
                zadd(zkey, {key: monotonic_ns() // 1_000_000 + delay})
        now_ms = monotonic_ns() // 1_000_000
        pipe.evalsha(pop_sha, 1, zkey, now_ms, POP_LIMIT)
        replies = pipe.execute()
        if record(replies[-1], now_ms) == POP_LIMIT:
            while pop_now() == POP_LIMIT:
                pass

    # 1. preload
    phases.arrive(client, "preload", idle)
    t = time.perf_counter()
    preload = [(0, k, d) for k, d in zip(plan.preload_keys, plan.preload_delays)]
    for start in range(0, len(preload), sizes.pipeline):
        run_pipelined(preload[start: start + sizes.pipeline])
    out["preload"] = {"ops": len(preload), "seconds": time.perf_counter() - t}

    # 2. burst
    phases.arrive(client, "burst", idle)
    cpu0 = time.process_time()
    burst = plan.burst
    for start in range(0, len(burst), sizes.pipeline):
        run_pipelined(burst[start: start + sizes.pipeline])
    end_ns = monotonic_ns()
    out["burst"] = {"ops": len(burst), "end_ns": end_ns, "cpu_s": time.process_time() - cpu0}

    # 3. steady: one pipeline (+ pop) per 1 ms step
    start_ns = phases.arrive(client, "steady", idle)
    rate = sizes.steady_rate_per_client
    steady = plan.steady
    n = len(steady)
    i = 0
    stop_ns = start_ns + int(sizes.steady_s * 1e9)
    while True:
        now = monotonic_ns()
        if now >= stop_ns:
            break
        due = min(n, (now - start_ns) * rate // 1_000_000_000)
        run_pipelined(steady[i:due])
        i = max(i, due)
        next_step = now - (now - start_ns) % 1_000_000 + 1_000_000
        pause = (next_step - monotonic_ns()) / 1e9
        if pause > 0:
            time.sleep(pause)
    grace_end = stop_ns + int(GRACE_S * 1e9)
    while monotonic_ns() < grace_end:
        idle()
    out["steady"] = {"ops": i}

    # 4. unpipelined: one round trip per command (a fresh set, not popped)
    start_ns = phases.arrive(client, "unpipelined", None)
    ukey = f"unpipelined:{client}"
    ops = plan.burst[: sizes.unpipelined_ops_per_client]
    for op, key, delay in ops:
        if op == OP_CANCEL:
            r.zrem(ukey, key)
        else:
            r.zadd(ukey, {key: monotonic_ns() // 1_000_000 + delay})
    out["unpipelined"] = {"ops": len(ops), "end_ns": monotonic_ns()}
    out["received"] = got.arrays()
    r.close()
    return out


# --------------------------------------------------------------------------- the parent


def run_redis(sizes: Sizes, seed: int) -> dict:
    import redis

    ctx = multiprocessing.get_context("fork")
    server = RedisServer()
    procs = []
    sampler = None
    try:
        server.start()
        phases = Phases(ctx, ["preload", "burst", "steady", "unpipelined"])
        procs = [ctx.Process(target=redis_client, args=(c, server.port, sizes, seed, phases), daemon=True)
                 for c in range(sizes.clients)]
        for p in procs:
            p.start()
        probe = redis.Redis(host="127.0.0.1", port=server.port)
        zkeys = [f"timers:{c}" for c in range(sizes.clients)]
        sampler = PendingSampler(lambda: sum(probe.zcard(k) for k in zkeys), period_s=0.02).start()
        timeout = 300.0
        phases.wait(procs, "arrive", "preload", timeout)
        sampler.phase = "preload"
        phases.release("preload")
        phases.wait(procs, "arrive", "burst", timeout)
        import psutil

        server_ps = psutil.Process(server.proc.pid)
        cpu0 = server_ps.cpu_times()
        sampler.phase = "burst"
        t0_ns = phases.release("burst")
        phases.wait(procs, "arrive", "steady", timeout)
        cpu1 = server_ps.cpu_times()
        sampler.phase = "steady"
        steady_ns = phases.release("steady")
        phases.wait(procs, "arrive", "unpipelined", timeout + sizes.steady_s)
        sampler.phase = "unpipelined"
        u0_ns = phases.release("unpipelined")
        results = phases.wait(procs, "result", None, timeout)
        pending = sampler.stop()
        sampler = None
        info = probe.info("server")
        probe.close()
    finally:
        if sampler is not None:
            sampler.stop()
        stop_processes(procs)
        server.cleanup()

    clients = [results[c] for c in sorted(results)]
    ops = sum(c["burst"]["ops"] for c in clients)
    end_ns = max(c["burst"]["end_ns"] for c in clients)
    wall_s = (end_ns - t0_ns) / 1e9
    u_ops = sum(c["unpipelined"]["ops"] for c in clients)
    u_wall = (max(c["unpipelined"]["end_ns"] for c in clients) - u0_ns) / 1e9
    t0_ms, steady_ms = t0_ns // 1_000_000, steady_ns // 1_000_000
    windows = {"burst": (t0_ms, end_ns // 1_000_000), "steady": (steady_ms, steady_ms + int(sizes.steady_s * 1000))}
    try:
        import hiredis  # noqa: F401 - redis-py parses replies with it when installed

        parser = "hiredis"
    except ImportError:
        parser = "python"
    return {
        "redis_version": info.get("redis_version"),
        "redis_py": redis.__version__,
        "reply_parser": parser,
        "pipeline": sizes.pipeline,
        "ops": ops,
        "wall_s": round(wall_s, 4),
        "ops_per_s": round(ops / wall_s),
        "preload_adds_per_s": round(sum(c["preload"]["ops"] for c in clients)
                                    / max(c["preload"]["seconds"] for c in clients)),
        "cpu_us_per_op": {"server": round(((cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)) / ops * 1e6, 3),
                          "clients": round(sum(c["burst"]["cpu_s"] for c in clients) / ops * 1e6, 3)},
        "steady_ops": sum(c["steady"]["ops"] for c in clients),
        "unpipelined": {"ops": u_ops, "wall_s": round(u_wall, 4), "ops_per_s": round(u_ops / u_wall)},
        "lateness": lateness_report([c["received"] for c in clients], windows),
        "pending": pending,
    }


if __name__ == "__main__":
    import json
    import sys

    from bench.e2e import QUICK

    print(json.dumps(run_redis(QUICK, 1), indent=1, default=str))
    sys.exit(0)
