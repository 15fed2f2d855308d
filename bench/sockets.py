"""Idle detection for 50,000 real loopback TCP connections, per server kind, in one run.

    .venv/bin/python bench/sockets.py                   # 50,000 connections, every kind (~6 minutes)
    .venv/bin/python bench/sockets.py --connections 2000 --idle-ms 1000 --max-interval-ms 200 \
        --duration-s 1 --out /tmp/sockets.json          # the small mode (tests/test_bench_sockets.py)

A *load* process holds the connections and the *server* runs as its own
process; for the wheeld kinds a real wheeld daemon is started too. Both need
one descriptor per connection: the script raises RLIMIT_NOFILE (soft and hard;
the hard limit needs root with CAP_SYS_RESOURCE). Where it cannot, it says so
and splits the connections over as many server processes as the hard limit
requires, each with its own load process, port and source address (127.0.0.1,
127.0.0.2, ...), like a pre-forked server's workers; the wheeld kinds' workers
share one daemon, each in its own group. ``--processes N`` forces a split.
Everything listens and connects on 127.0.0.x only.

Server kinds (each a fresh set of processes, the same load):

* ``asyncio-wheeld``: examples/idle_server.py's ``IdleServer`` with
  ``wheeld.idle.IdleTracker`` on the daemon: a read is one 8-byte store
  (``touch``), the daemon re-arms lazily once per idle period;
* ``sync-wheeld``: examples/idle_server_sync.py's ``SyncIdleServer``, one
  ``selectors`` (epoll) loop and the blocking client, the same store per read;
* ``asyncio-call-later``: the same asyncio server with what most servers do
  today: one ``loop.call_later`` per connection, cancelled and re-created on
  every read (uvicorn cancels its keep-alive timer on every read), closing when
  it fires;
* ``asyncio-none``, ``sync-none``: the same servers with no idle detection at
  all, so that what idle detection itself costs per read can be given net of
  the server's own read path.

The load: every connection sends a byte when it opens. *Active* ones (half)
then send a byte every 100-500 ms (uniform) for the whole run; *quiet* ones
(the other half) send nothing more, so each is closed idle_ms after it opened,
while the others are still being opened. The idle time is 2 s. The run has
two phases: the *close phase*, from the first connect until every quiet
connection is closed (the opening at ``--connect-rate``, then idle_ms and a
margin), and the *CPU window* (``--duration-s``, 20 s) in which the servers only
read and re-arm. Then the servers are stopped. (``--quiet-span-s S``: quiet
connections send every idle_ms/2 until a moment uniform over S seconds after
all are open, so they are closed in a steady state; at 50,000 connections that
extra load saturates a 2-core machine.) The asyncio servers run on uvloop
(``--loop asyncio``: the standard loop).

Reported per kind:

* *wrong closes*: an active connection closed although it had sent within
  ``idle_ms`` (must be 0); an active connection that this load itself failed
  to serve for ``idle_ms`` is counted apart as a *load stall* (the machine could
  not run the load on time: such a run is not valid);
* *early closes*: closed before ``idle_ms`` of real time since the server's
  last read of it (``time.monotonic_ns()`` taken by the server at the read and
  at the close); must be 0; and quiet connections never closed (*missed*);
* idle-close *lateness* p50/p99/max: close time - (last read + idle_ms);
* server *CPU per read* over the CPU window (process CPU from /proc over the
  reads the servers counted), and for the wheeld kinds the daemon's CPU per
  read (its threads' on-CPU nanoseconds from ``/proc/PID/task/*/schedstat``:
  the daemon runs a few ms a second, below the 10 ms clock tick); *net*:
  minus the ``-none`` server of the same family in the same run (plus the
  daemon's): what idle detection costs per read (the close phase's
  figure, which includes the closes, is in the JSON);
* the daemon's own *fire lateness* over the close phase (its arena's
  histogram): how much of the idle-close lateness is the daemon's;
* *event-loop lag* p99 over both phases: a probe due every 10 ms in each server's loop (a loop
  timer in asyncio, a periodic entry of the selectors loop), how late it ran;
  its floor is the 1 ms resolution of epoll timeouts and libuv timers;
* *RSS per connection*: the servers' RSS growth from before the first connect
  to after the last accept, over the connections (plus the daemon's growth).

Writes bench/runs/sockets.json (``--out``; ``--save``: bench/results/) and prints a table. Every process
it starts is stopped by pid and every shared-memory segment of its daemon is
unlinked, also on failure. ``--profile DIR`` samples the servers and the daemon
with py-spy during the window.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import errno
import json
import os
import random
import resource
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # python bench/sockets.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    DaemonProcess, add_save_option, proc_cpu_s, proc_oncpu_s, results_path, rss_kb, unique_name,
)

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
KINDS = ("asyncio-none", "asyncio-call-later", "asyncio-wheeld", "sync-none", "sync-wheeld")
PER_SOURCE_IP = 25_000  # connections per source address (ephemeral ports: 32768-60999 by default)
PROBE_INTERVAL_S = 0.01
SEND_RING = 32  # send times kept per connection (a power of two)
HEADROOM = 1024  # descriptors beyond the connections (listener, daemon client, pipes, libraries)
IP_BIND_ADDRESS_NO_PORT = getattr(socket, "IP_BIND_ADDRESS_NO_PORT", 24)


# =========================================================================== shared helpers


def raise_nofile(needed: int) -> tuple[bool, str]:
    """Make RLIMIT_NOFILE at least ``needed`` (soft and hard); (ok, message)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= needed:
        return True, f"RLIMIT_NOFILE {soft}"
    new_hard = hard if hard == resource.RLIM_INFINITY or hard >= needed else needed
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, new_hard))
        return True, f"RLIMIT_NOFILE raised from {soft} to {needed}"
    except (ValueError, OSError) as exc:
        if os.geteuid() == 0:
            who, hint = "root", "root without CAP_SYS_RESOURCE here (a container?): raise the hard limit outside"
        else:
            who, hint = f"uid {os.geteuid()} (not root)", "run as root, or raise the hard limit"
        return False, (f"need {needed} open files per process (connections + headroom) but RLIMIT_NOFILE is "
                       f"{soft} (hard {hard}) and cannot be raised as {who}: {exc}. To hold them in one "
                       f"process: {hint} (ulimit -Hn, LimitNOFILE=), or use fewer --connections "
                       f"(fs.nr_open is {Path('/proc/sys/fs/nr_open').read_text().strip()})")


def percentile(sorted_values: list, q: float):
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, int(len(sorted_values) * q))]


# =========================================================================== the server process
class CallLaterTracker:
    """The usual way: one loop timer per connection, cancelled and re-created on every read."""

    def __init__(self, idle_ms: int, on_idle) -> None:
        loop = asyncio.get_running_loop()
        handles: dict[int, asyncio.TimerHandle] = {}
        idle_s, call_later = idle_ms / 1000, loop.call_later
        self.handles = handles

        def fire(key) -> None:
            del handles[key]
            on_idle(key)

        def touch(key) -> None:
            handle = handles.get(key)
            if handle is not None:
                handle.cancel()
                handles[key] = call_later(idle_s, fire, key)

        def add(key) -> None:
            old = handles.get(key)
            if old is not None:
                old.cancel()
            handles[key] = call_later(idle_s, fire, key)

        self.touch, self.add, self._fire = touch, add, fire

    def remove(self, key) -> bool:
        handle = self.handles.pop(key, None)
        if handle is not None:
            handle.cancel()
        return handle is not None

    async def aclose(self) -> None:
        for handle in self.handles.values():
            handle.cancel()
        self.handles.clear()


class NoTracker:
    """No idle detection: the server's read path alone."""

    def __init__(self, idle_ms: int, on_idle) -> None:
        self.touch = lambda key: None

    def add(self, key) -> None:
        pass

    def remove(self, key) -> bool:
        return False

    async def aclose(self) -> None:
        pass


class NullClient:
    """Stands in for the blocking wheeld client in the ``sync-none`` server: nothing is tracked."""

    def add_idle(self, key, idle_ms) -> None:
        pass

    def touch(self, key) -> None:
        pass

    def cancel(self, key) -> bool:
        return False

    def flush(self, timeout_s: float = 10.0) -> None:
        pass

    def poll(self, timeout_s=None) -> list:
        return []

    def fileno(self) -> int:
        return -1

    def close(self) -> None:
        pass


def _load_example(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"wheeld_example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Probe:
    """Event-loop lag: a callback due every 10 ms; how late it ran (monotonic ns samples).
    Also the pauses of Python's cyclic garbage collector (``gc.callbacks``), per generation."""

    def __init__(self) -> None:
        import gc

        self.samples: list[tuple[int, int]] = []  # (ran at ns, lag ns)
        self.gc_pauses: list[tuple[int, int, int]] = []  # (generation, started at ns, took ns)
        self._gc_start = 0

        def on_gc(phase: str, info: dict) -> None:
            if phase == "start":
                self._gc_start = time.monotonic_ns()
            else:
                self.gc_pauses.append((info["generation"], self._gc_start, time.monotonic_ns() - self._gc_start))

        gc.callbacks.append(on_gc)

    def ran(self, due_ns: int) -> None:
        now = time.monotonic_ns()
        self.samples.append((now, max(0, now - due_ns)))


def _stats(server, probe_samples: int) -> dict:
    return {"t_ns": time.monotonic_ns(), "reads": server.reads, "accepted": server.accepted,
            "open": len(server.connections), "closed_idle": len(server.closed_idle), "raced": server.raced,
            "cpu_s": time.process_time(), "rss_kb": rss_kb(), "probes": probe_samples}


def _overdue(server, received: dict | None) -> dict:
    """Connections still open although the server has read nothing from them for idle_ms + 2 s:
    how many, and where each one's idle timer stands (still tracked, waiting in the tracker's
    unsent adds, an expiration ever received for its key)."""
    now = time.monotonic_ns()
    limit = server.idle_ns + 2_000_000_000
    tracker = getattr(server, "tracker", None)
    keys = getattr(tracker, "_keys", None)
    unsent = getattr(tracker, "_unsent", None)
    out = {"count": 0, "tracked": 0, "unsent": 0, "expired_received": 0, "examples": []}
    for key in list(server.connections):
        last = server.last_read_ns.get(key)
        if last is None or now - last < limit:
            continue
        out["count"] += 1
        out["tracked"] += int(keys is not None and key in keys)
        out["unsent"] += int(unsent is not None and key in unsent)
        out["expired_received"] += int(received is not None and key in received)
        if len(out["examples"]) < 10:
            out["examples"].append({"key": key, "silent_ms": (now - last) / 1e6,
                                    "received": (received or {}).get(key)})
    return out


def _write_report(path: str, server, probe: _Probe, extra: dict, received: dict | None = None) -> None:
    report = {"closed_idle": server.closed_idle, "lag": probe.samples, "gc": probe.gc_pauses,
              "summary": server.summary(), "overdue": _overdue(server, received), **extra}
    if received is not None:  # wheeld kinds: the path of each idle close, in parts
        report["received"] = {str(key): value for key, value in received.items()}
    Path(path).write_text(json.dumps(report))


def _note_deliveries(client, received: dict, asynchronous: bool) -> None:
    """Wrap ``client.poll`` to note, per key, the daemon's deadline and firing time (ms) and
    when the server got it (ns): the idle-close lateness split into its parts."""
    poll = client.poll
    if asynchronous:
        async def noting_poll(timeout_s=None):
            out = await poll(timeout_s)
            now = time.monotonic_ns()
            for e in out:
                received[e.key] = (e.deadline_ms, e.fired_ms, now)
            return out
    else:
        def noting_poll(timeout_s=None):
            out = poll(timeout_s)
            now = time.monotonic_ns()
            for e in out:
                received[e.key] = (e.deadline_ms, e.fired_ms, now)
            return out
    client.poll = noting_poll


def serve(spec: dict) -> int:
    """The server process: start the kind, print ``listening PORT``, answer SIGUSR1 with a stats
    line on stdout, and on SIGTERM stop and write the report to ``spec["report"]``."""
    ok, message = raise_nofile(spec["nofile"])
    if not ok:
        print(f"error {message}", flush=True)
        return 2
    kind = spec["kind"]
    if kind.startswith("sync-"):
        return _serve_sync(spec)
    if spec.get("loop") == "uvloop":
        import uvloop

        uvloop.install()
    return asyncio.run(_serve_asyncio(spec))


async def _serve_asyncio(spec: dict) -> int:
    import wheeld

    mod = _load_example("idle_server")
    kind, idle_ms = spec["kind"], spec["idle_ms"]
    loop = asyncio.get_running_loop()
    client = None
    received = None
    if kind == "asyncio-wheeld":
        client = await wheeld.connect_async(spec["socket"], group=spec["group"])
        received = {}
        _note_deliveries(client, received, asynchronous=True)
        server = mod.IdleServer(idle_ms, client=client, echo=False)
    elif kind == "asyncio-call-later":
        server = mod.IdleServer(idle_ms, tracker=CallLaterTracker, echo=False, recheck=False)
    elif kind == "asyncio-none":
        server = mod.IdleServer(idle_ms, tracker=NoTracker, echo=False)
    else:
        raise ValueError(kind)
    await server.start()
    probe = _Probe()
    interval_ns = int(PROBE_INTERVAL_S * 1e9)

    def schedule(due_ns: int) -> None:
        loop.call_later(max(0.0, (due_ns - time.monotonic_ns()) / 1e9), run_probe, due_ns)

    def run_probe(due_ns: int) -> None:
        probe.ran(due_ns)
        now = time.monotonic_ns()
        due_ns += interval_ns
        schedule(due_ns if due_ns > now else now + interval_ns)  # a missed period is skipped, not made up

    schedule(time.monotonic_ns() + interval_ns)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, lambda: print(json.dumps(_stats(server, len(probe.samples))),
                                                          flush=True))
    print(f"listening {server.port} {type(loop).__module__}", flush=True)
    await stop.wait()
    _write_report(spec["report"], server, probe, {"loop": type(loop).__module__}, received)
    await server.close()
    if client is not None:
        await client.close()
    return 0


def _serve_sync(spec: dict) -> int:
    import wheeld

    mod = _load_example("idle_server_sync")
    kind, idle_ms = spec["kind"], spec["idle_ms"]
    client = wheeld.connect(spec["socket"], group=spec["group"]) if kind == "sync-wheeld" else NullClient()
    received = None
    if kind == "sync-wheeld":
        received = {}
        _note_deliveries(client, received, asynchronous=False)
    server = mod.SyncIdleServer(idle_ms, client, echo=False)
    probe = _Probe()
    server.every(PROBE_INTERVAL_S, probe.ran)
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    signal.signal(signal.SIGUSR1, lambda *_: print(json.dumps(_stats(server, len(probe.samples))), flush=True))
    print(f"listening {server.port} selectors", flush=True)
    try:
        server.serve_forever()
        _write_report(spec["report"], server, probe, {"loop": "selectors"}, received)
    finally:
        server.close()
        client.close()
    return 0


# =========================================================================== the daemon
def start_daemon(connections: int, workdir: str, nice: int = 0) -> DaemonProcess:
    """A wheeld with room for ``connections`` idle timers, on a socket in ``workdir``."""
    touch_capacity = 1 << max(17, (2 * connections - 1).bit_length())
    return DaemonProcess(workdir, name=unique_name("bench-sockets"), capacity=max(1 << 17, 4 * connections),
                         extra=["--touch-capacity", str(touch_capacity)], log_level="WARNING", nice=nice).start(30)


def lateness_counts(daemon: DaemonProcess) -> tuple[int, ...]:
    """The daemon's own fire-lateness histogram (deadline to firing), read from its arena."""
    from wheeld.shm.reader import ArenaReader

    with ArenaReader(daemon.name) as reader:
        return reader.snapshot(with_records=False).lateness_counts


def lateness_parts(reports: list[dict], idle_ns: int) -> dict:
    """Each idle close's lateness in parts: *rounding* (the deadline is the touch rounded up to
    the ms, plus idle_ms: 0-1 ms), *daemon* (deadline to firing, both in whole ms), *delivery*
    (firing to the server's poll returning it: the frame, the socket, the server's loop getting
    to it; the firing time is floored to the ms, so up to 1 ms of this is the floor), *server*
    (from there to the close). p50/p99 of each, in ms."""
    parts: dict[str, list[float]] = {"rounding": [], "daemon": [], "delivery": [], "server": []}
    for report in reports:
        received = report.get("received", {})
        for key, last_ns, close_ns, _port in report["closed_idle"]:
            got = received.get(str(key))
            if got is None:
                continue
            deadline_ms, fired_ms, recv_ns = got
            parts["rounding"].append((deadline_ms * 1_000_000 - last_ns - idle_ns) / 1e6)
            parts["daemon"].append(fired_ms - deadline_ms)
            parts["delivery"].append((recv_ns - fired_ms * 1_000_000) / 1e6)
            parts["server"].append((close_ns - recv_ns) / 1e6)
    out = {}
    for name, values in parts.items():
        values.sort()
        out[name] = {"p50": percentile(values, 0.5), "p99": percentile(values, 0.99)}
    out["count"] = len(parts["daemon"])
    return out


def daemon_lateness(before: tuple[int, ...], after: tuple[int, ...]) -> dict:
    """p50/p99 of how late the daemon fired the timers that came due between two histograms."""
    from wheeld.shm.snapshot import quantile_us

    counts = [b - a for a, b in zip(before, after)]
    q = {name: quantile_us(counts, frac) for name, frac in (("p50", 0.5), ("p99", 0.99))}
    return {"count": sum(counts), **{k: (v / 1000 if v is not None else None) for k, v in q.items()}}


# =========================================================================== child processes, seen from here
class Child:
    """A child process of this script that talks in JSON lines on stdout (and reads them on stdin)."""

    def __init__(self, role: str, spec: dict, stderr_path: str) -> None:
        self.role = role
        self.stderr_path = stderr_path
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        with open(stderr_path, "wb") as stderr:
            self.proc = subprocess.Popen([sys.executable, __file__, f"--{role}", json.dumps(spec)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, env=env)
        self._buf = b""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stderr(self) -> str:
        try:
            return Path(self.stderr_path).read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def readline(self, timeout_s: float) -> str:
        fd = self.proc.stdout.fileno()
        end = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            remaining = end - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{self.role} {self.pid} did not answer within {timeout_s} s: {self.stderr()}")
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            if poller.poll(int(remaining * 1000) + 1):
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise RuntimeError(f"{self.role} {self.pid} exited: {self.stderr()}")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def read_json(self, timeout_s: float) -> dict:
        while True:
            line = self.readline(timeout_s)
            if line.startswith("{"):
                message = json.loads(line)
                if "error" in message:
                    raise RuntimeError(f"{self.role} {self.pid}: {message['error']}")
                return message

    def send(self, message: dict) -> None:
        self.proc.stdin.write((json.dumps(message) + "\n").encode())
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass


class ServerProcess(Child):
    def __init__(self, spec: dict, workdir: str) -> None:
        super().__init__("serve", spec, spec["report"] + ".stderr")
        self.spec = spec
        line = self.readline(60)
        if not line.startswith("listening "):
            raise RuntimeError(f"the {spec['kind']} server did not start: {line!r} {self.stderr()}")
        _, port, self.loop = line.split()
        self.port = int(port)

    def stats(self, timeout_s: float = 30.0) -> dict:
        os.kill(self.pid, signal.SIGUSR1)
        return self.read_json(timeout_s)

    def stop(self, timeout_s: float = 120.0) -> dict:
        os.kill(self.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the {self.spec['kind']} server did not stop within {timeout_s} s") from None
        if self.proc.returncode != 0:
            raise RuntimeError(f"the {self.spec['kind']} server exited with {self.proc.returncode}: {self.stderr()}")
        return json.loads(Path(self.spec["report"]).read_text())


# =========================================================================== the load (a child process)
class Load:
    """Every connection of one load process, in one epoll loop: opens, sends on schedule, notices closes."""

    def __init__(self, spec: dict) -> None:
        n = spec["connections"]
        rng = random.Random(spec["seed"])
        self.n, self.port = n, spec["port"]
        self.source = spec["source"]
        self.socks: list[socket.socket | None] = [None] * n
        self.fd_index: dict[int, int] = {}
        self.active = [i % 2 == 0 for i in range(n)]
        # quiet ones send a byte every quiet_interval_ms (under idle_ms) until their quiet moment,
        # drawn uniformly over the run when it starts, then nothing
        # (--quiet-span-s 0: quiet from their first byte on)
        self.quiet_interval_ms = spec["quiet_interval_ms"]
        self.quiet_frac = [rng.random() for _ in range(n)]
        self.quiet_at_ns = [1 << 62 if spec["quiet_span"] else 0] * n
        self.closed_ns = [0] * n
        self.last_send_ns = [0] * n
        self.port_index: dict[int, int] = {}  # local port -> connection
        # the last SEND_RING sends of each connection, each as the time just before the send
        # call and the time it returned (the byte reached the server's socket in between): a
        # send made after the server had closed the connection (before this process saw the
        # EOF), or one the process was preempted in, must not count as activity before the close
        self.send_ring = array.array("q", bytes(8 * n * SEND_RING))
        self.sent_ring = array.array("q", bytes(8 * n * SEND_RING))
        self.send_count = [0] * n
        self.sends = 0
        self.send_blocked = 0
        self.connect_failures = 0
        self.epoll = select.epoll()
        self.slots: list[list[int]] = [[] for _ in range(1024)]
        self.slot_ms = time.monotonic_ns() // 1_000_000
        self.intervals = [rng.randint(spec["min_interval_ms"], spec["max_interval_ms"]) for _ in range(1 << 16)]
        self.interval_at = 0
        self.established = 0
        self.slot_lag_ms: list[int] = []  # how late each non-empty send slot was processed (load health)

    # ------------------------------------------------------------------ connect
    def open_all(self, rate: float) -> float:
        """Open every connection at ``rate`` per second; returns once all are established."""
        t0 = time.monotonic()
        opened = 0
        while opened < self.n:
            allowed = min(self.n, int((time.monotonic() - t0) * rate) + 1) - opened
            for _ in range(max(0, min(allowed, 256))):
                self._open(opened)
                opened += 1
            self.pump(0.002)
        end = time.monotonic() + 60
        while self.established + self.connect_failures < self.n and time.monotonic() < end:
            self.pump(0.01)
        return time.monotonic() - t0

    def _open(self, i: int) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            # the port is chosen at connect time, for this destination: no ephemeral-port shortage
            sock.setsockopt(socket.SOL_IP, IP_BIND_ADDRESS_NO_PORT, 1)
            sock.bind((self.source, 0))
            err = sock.connect_ex(("127.0.0.1", self.port))
            if err not in (0, errno.EINPROGRESS):
                raise OSError(err, os.strerror(err))
        except OSError:
            sock.close()
            self.connect_failures += 1
            return
        self.socks[i] = sock
        fd = sock.fileno()
        self.fd_index[fd] = i
        # the first byte goes out once the connection is established (writable); after that,
        # readability means the server closed it (it never writes)
        self.epoll.register(fd, select.EPOLLOUT)

    # ------------------------------------------------------------------ the loop
    def pump(self, timeout_s: float) -> list[int]:
        """One turn: handle socket events, send what is due; returns other ready fds (stdin)."""
        other = []
        for fd, mask in self.epoll.poll(timeout_s):
            i = self.fd_index.get(fd)
            if i is None:
                other.append(fd)
                continue
            sock = self.socks[i]
            if mask & select.EPOLLOUT and not self.last_send_ns[i]:
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                    self._closed(i, fd)
                    self.connect_failures += 1
                    continue
                self.established += 1
                self.port_index[sock.getsockname()[1]] = i
                self.epoll.modify(fd, select.EPOLLIN | select.EPOLLRDHUP)
                self._send(i, time.monotonic_ns())
                continue
            try:
                data = sock.recv(4096)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                data = b""
            if not data:
                self._closed(i, fd)
        self._send_due()
        return other

    def _closed(self, i: int, fd: int) -> None:
        self.closed_ns[i] = time.monotonic_ns()
        self.epoll.unregister(fd)
        del self.fd_index[fd]
        # the socket stays open (CLOSE_WAIT) until the end: its local port is not reused by a
        # later connection, so the server's close records (by peer port) stay unambiguous

    def _send(self, i: int, now_ns: int) -> None:
        self.last_send_ns[i] = now_ns  # before the send: the server reads it later, never earlier
        count = self.send_count[i]
        at = i * SEND_RING + (count & (SEND_RING - 1))
        self.send_ring[at] = now_ns
        self.sent_ring[at] = 1 << 62  # until the send returns
        self.send_count[i] = count + 1
        try:
            self.socks[i].send(b"x")
            self.sent_ring[at] = time.monotonic_ns()
            self.sends += 1
        except (BlockingIOError, InterruptedError):
            self.send_blocked += 1
        except OSError:
            return  # reset: the close shows up as an event
        if self.active[i]:
            self.interval_at = (self.interval_at + 1) & 0xFFFF
            due = now_ns // 1_000_000 + self.intervals[self.interval_at]
        elif now_ns + self.quiet_interval_ms * 1_000_000 < self.quiet_at_ns[i]:
            due = now_ns // 1_000_000 + self.quiet_interval_ms
        else:
            return  # gone quiet: this was its last byte
        self.slots[due & 1023].append(i)

    def _send_due(self) -> None:
        """Every send due up to now (the hot loop: ``_send`` inlined)."""
        now_ns = time.monotonic_ns()
        now_ms = now_ns // 1_000_000
        slots, closed_ns, socks, active = self.slots, self.closed_ns, self.socks, self.active
        last_send_ns, ring, counts, intervals = self.last_send_ns, self.send_ring, self.send_count, self.intervals
        sent_ring, monotonic_ns = self.sent_ring, time.monotonic_ns
        quiet_at, quiet_ns, quiet_ms = self.quiet_at_ns, self.quiet_interval_ms * 1_000_000, self.quiet_interval_ms
        at = self.interval_at
        sends = blocked = 0
        while self.slot_ms <= now_ms:
            index = self.slot_ms & 1023
            slot = slots[index]
            if slot:
                slots[index] = []
                self.slot_lag_ms.append(now_ms - self.slot_ms)
                for i in slot:
                    if closed_ns[i]:
                        continue
                    # each send's own times (a batch of thousands, or a preemption, takes ms)
                    last_send_ns[i] = before = monotonic_ns()  # the server reads it later, never earlier
                    count = counts[i]
                    slot_at = i * SEND_RING + (count & (SEND_RING - 1))
                    ring[slot_at] = before
                    sent_ring[slot_at] = 1 << 62  # until the send returns
                    counts[i] = count + 1
                    try:
                        socks[i].send(b"x")
                        sent_ring[slot_at] = monotonic_ns()
                        sends += 1
                    except (BlockingIOError, InterruptedError):
                        blocked += 1
                    except OSError:
                        continue  # reset: the close shows up as an event
                    if active[i]:
                        at = (at + 1) & 0xFFFF
                        due = now_ms + intervals[at]
                    elif now_ns + quiet_ns < quiet_at[i]:
                        due = now_ms + quiet_ms
                    else:
                        continue  # gone quiet: that was its last byte
                    slots[due & 1023].append(i)
            self.slot_ms += 1
        self.interval_at = at
        self.sends += sends
        self.send_blocked += blocked

    def last_send_before(self, i: int, t_ns: int) -> tuple[int, int] | None:
        """(before, returned) of the latest send of connection ``i`` that returned at or before
        ``t_ns`` (None: not in the ring any more, or none)."""
        base, count = i * SEND_RING, self.send_count[i]
        best = None
        for k in range(min(count, SEND_RING)):
            if self.sent_ring[base + k] <= t_ns and (best is None or self.send_ring[base + k] > self.send_ring[best]):
                best = base + k
        if best is None or (count > SEND_RING and self.send_ring[best] == min(self.send_ring[base:base + SEND_RING])):
            return None  # the ring may have lost a later send before t_ns: undetermined
        return self.send_ring[best], self.sent_ring[best]

    def close_all(self) -> None:
        for sock in self.socks:
            if sock is not None:
                sock.close()
        self.epoll.close()


def load_main(spec: dict) -> int:
    """A load process: open its connections, say so, run when told, report, close when told."""
    ok, message = raise_nofile(spec["connections"] + HEADROOM)
    if not ok:
        print(json.dumps({"error": message}), flush=True)
        return 2
    load = Load(spec)
    stdin = sys.stdin.buffer.raw.fileno()
    os.set_blocking(stdin, False)
    load.epoll.register(stdin, select.EPOLLIN)
    buf = b""

    def command(timeout_s: float) -> dict | None:
        nonlocal buf
        if b"\n" not in buf and stdin in load.pump(timeout_s):
            chunk = os.read(stdin, 4096)
            if not chunk:
                raise SystemExit(1)  # the parent went away
            buf += chunk
        if b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            return json.loads(line)
        return None

    cpu0 = time.process_time()
    open_s = load.open_all(spec["rate"])
    print(json.dumps({"opened": load.established, "failures": load.connect_failures, "open_s": open_s}),
          flush=True)
    run = None
    while run is None:
        run = command(0.002)
    end = run["window_end"]
    if spec["quiet_span"]:
        for i in range(load.n):
            if not load.active[i]:
                load.quiet_at_ns[i] = run["t0"] + int(load.quiet_frac[i] * spec["quiet_span"])
    load.slot_lag_ms.clear()
    cpu_run0 = time.process_time()
    while time.monotonic_ns() < end:
        if command(min(0.002, max(0.0, (end - time.monotonic_ns()) / 1e9))) is not None:
            break
    cpu_run = time.process_time() - cpu_run0
    lags = sorted(load.slot_lag_ms)
    print(json.dumps({
        "connections": load.n, "active": sum(load.active), "send_lag_ms_p99": percentile(lags, 0.99),
        "send_lag_ms_max": lags[-1] if lags else None, "closed": sum(1 for c in load.closed_ns if c),
        "sends": load.sends, "send_blocked": load.send_blocked, "cpu_s": time.process_time() - cpu0,
        "run_cpu_cores": cpu_run / max(1e-9, (end - run["t0"]) / 1e9),
    }), flush=True)
    closes = None
    while closes is None:  # keep sending until the parent has stopped the server and sends its closes
        closes = command(0.01)
    print(json.dumps(judge_closes(load, closes["closes"], spec["idle_ms"] * 1_000_000, end)), flush=True)
    while command(0.01) is None:
        pass
    load.close_all()
    return 0


def judge_closes(load: Load, closes: list, idle_ns: int, end_ns: int) -> dict:
    """Each idle close the server made, against what this process sent on that connection.

    ``closes``: [peer port, server's close ns] per close. A connection still in its
    sending phase when the server closed it (an active one, or a quiet one before its
    quiet moment) is a *wrong* close when a send that had returned before the close
    started within ``idle_ms`` before it (the byte was in the server's socket), and a
    *load stall* when no send of this process had reached it for ``idle_ms`` (the
    machine could not run the load on time). Quiet connections the server never
    closed are *missed*."""
    wrong, stalls, undetermined, unknown = [], 0, 0, 0
    stall_examples = []
    closed = set()
    for port, close_ns in closes:
        i = load.port_index.get(port)
        if i is None:
            unknown += 1
            continue
        closed.add(i)
        if close_ns > end_ns:
            continue
        if not load.active[i] and close_ns >= load.quiet_at_ns[i]:
            continue  # closed after it went quiet: right (whether early is judged by the server's clock)
        sent = load.last_send_before(i, close_ns)  # it was still sending: was it on schedule?
        if sent is None:
            undetermined += 1
        elif close_ns - sent[0] < idle_ns:  # the byte was in the server's socket within idle_ms
            wrong.append((i, (close_ns - sent[0]) / 1e6))
        elif close_ns - sent[1] >= idle_ns:  # nothing reached the server for idle_ms: the load's fault
            stalls += 1
            if len(stall_examples) < 10:
                base = i * SEND_RING
                tried = sorted(load.send_ring[base + k] for k in range(min(load.send_count[i], SEND_RING)))
                stall_examples.append({
                    "since_last_send_ms": (close_ns - sent[0]) / 1e6, "sends": load.send_count[i],
                    "load_saw_close_ms": (load.closed_ns[i] - close_ns) / 1e6 if load.closed_ns[i] else None,
                    "failed_sends_after": sum(1 for k in range(min(load.send_count[i], SEND_RING))
                                              if load.send_ring[base + k] > sent[0]
                                              and load.sent_ring[base + k] == 1 << 62),
                    "send_gaps_ms": [round((b - a) / 1e6, 1) for a, b in zip(tried, tried[1:])][-6:]})
        else:
            undetermined += 1  # the send call straddled the moment idle_ms before the close
    missed = sum(1 for i in range(load.n) if not load.active[i] and i not in closed)
    return {"wrong": len(wrong), "load_stalls": stalls, "undetermined": undetermined, "unknown_ports": unknown,
            "missed": missed, "stall_examples": stall_examples,
            "wrong_examples": [{"active": load.active[i], "since_last_send_ms": ms}
                               for i, ms in wrong[:10]]}


# =========================================================================== profiles (--profile DIR)
def start_profilers(args, kind: str, servers: list, daemon) -> list[subprocess.Popen]:
    """py-spy (if installed) samples the servers, and the daemon, during the measured window:
    collapsed stacks in DIR/<kind>.<process>.txt. Sampling costs CPU on this machine: compare
    profiled runs only with each other."""
    if not args.profile:
        return []
    import shutil

    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not os.path.exists(spy):
        raise RuntimeError("--profile needs py-spy (pip install py-spy)")
    Path(args.profile).mkdir(parents=True, exist_ok=True)
    targets = [(f"server{i}", server.pid) for i, server in enumerate(servers)]
    if daemon:
        targets.append(("daemon", daemon.pid))
    procs = []
    for name, pid in targets:
        out = os.path.join(args.profile, f"{kind}.{name}.txt")
        procs.append(subprocess.Popen([spy, "record", "--pid", str(pid), "--format", "raw", "--rate", "200",
                                       "--nonblocking", "--output", out, "--duration", str(int(args.duration_s))],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return procs


def stop_profilers(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)


# =========================================================================== one kind
def shares(n: int, processes: int) -> list[int]:
    return [n // processes + (1 if i < n % processes else 0) for i in range(processes)]


def sleep_until(t_ns: int) -> None:
    delay = (t_ns - time.monotonic_ns()) / 1e9
    if delay > 0:
        time.sleep(delay)


def run_kind(kind: str, args, workdir: str) -> dict:
    n, idle_ms, processes = args.connections, args.idle_ms, args.processes
    idle_ns = idle_ms * 1_000_000
    daemon = None
    servers: list[ServerProcess] = []
    loads: list[Child] = []
    profilers: list[subprocess.Popen] = []
    out: dict = {"kind": kind, "connections": n, "idle_ms": idle_ms, "processes": processes}
    try:
        if kind.endswith("-wheeld"):
            daemon = start_daemon(n, workdir, args.daemon_nice)
        for i, share in enumerate(shares(n, processes)):
            spec = {"kind": kind, "idle_ms": idle_ms, "nofile": share + HEADROOM, "loop": args.loop,
                    "report": os.path.join(workdir, f"{kind}.{i}.report.json"), "group": f"bench-sockets-{i}",
                    "socket": daemon.socket_path if daemon else None}
            servers.append(ServerProcess(spec, workdir))
        out["loop"] = servers[0].loop
        rss0 = [rss_kb(server.pid) for server in servers]
        daemon_rss0 = rss_kb(daemon.pid) if daemon else 0

        fired0 = lateness_counts(daemon) if daemon else None  # the close phase starts with the first connect
        sc0 = [server.stats() for server in servers]
        cc0 = [proc_cpu_s(server.pid) for server in servers]
        open_t0 = time.monotonic_ns()

        # open: one load process per server, each from its own source address
        for i, (server, share) in enumerate(zip(servers, shares(n, processes))):
            spec = {"connections": share, "port": server.port, "source": f"127.0.0.{1 + i}", "idle_ms": idle_ms,
                    "quiet_interval_ms": max(1, idle_ms // 2), "quiet_span": int(args.quiet_span_s * 1e9),
                    "seed": args.seed * 1000 + i, "rate": args.connect_rate / processes,
                    "min_interval_ms": args.min_interval_ms, "max_interval_ms": args.max_interval_ms}
            loads.append(Child("load", spec, os.path.join(workdir, f"{kind}.load{i}.stderr")))
        opened = [load.read_json(600) for load in loads]
        failures = sum(o["failures"] for o in opened)
        if failures:
            raise RuntimeError(f"{failures} of {n} connections failed to open")
        out["open_s"] = max(o["open_s"] for o in opened)
        end = time.monotonic() + 120
        for server, share in zip(servers, shares(n, processes)):
            while server.stats()["accepted"] < share:
                if time.monotonic() > end:
                    raise RuntimeError(f"a {kind} server accepted fewer than {share} connections in 120 s")
                time.sleep(0.05)
        open_now = sum(server.stats()["open"] for server in servers)
        # per connection open now (with --quiet-span-s 0 the first quiet ones are closed already)
        out["rss_bytes_per_connection"] = sum(rss_kb(s.pid) - r for s, r in zip(servers, rss0)) * 1024 / open_now
        out["open_at_rss"] = open_now
        if daemon:
            out["daemon_rss_bytes_per_connection"] = (rss_kb(daemon.pid) - daemon_rss0) * 1024 / n

        # The run. Close phase: from the first connect until every quiet connection is closed
        # (lateness, wrong and early closes, the daemon's fire lateness). With --quiet-span-s 0
        # quiet connections go quiet after their first byte, so they are closed while the others
        # are still being opened; otherwise they stop at moments uniform over the span after
        # all are open. Then, with every active timer re-armed at least once, the CPU window:
        # --duration-s of reads only (CPU per read).
        idle_s = idle_ms / 1000
        t0 = time.monotonic_ns() + 200_000_000
        cw0 = t0 + int((args.quiet_span_s + idle_s + max(1.0, idle_s / 2)) * 1e9)
        end_ns = cw0 + int(args.duration_s * 1e9)
        for load in loads:
            load.send({"t0": t0, "window_end": end_ns})
        sleep_until(cw0)
        fired1 = lateness_counts(daemon) if daemon else None
        profilers = start_profilers(args, kind, servers, daemon)
        s0 = [server.stats() for server in servers]
        cpu0 = [proc_cpu_s(server.pid) for server in servers]
        d_cpu0 = proc_oncpu_s(daemon.pid) if daemon else 0.0
        w0 = time.monotonic_ns()
        sleep_until(end_ns)
        w1 = time.monotonic_ns()
        cpu1 = [proc_cpu_s(server.pid) for server in servers]
        d_cpu1 = proc_oncpu_s(daemon.pid) if daemon else 0.0
        s1 = [server.stats() for server in servers]
        stop_profilers(profilers)
        close_reads = sum(b["reads"] - a["reads"] for a, b in zip(sc0, s0))
        out["close_phase"] = {
            "seconds": (cw0 - open_t0) / 1e9, "reads_per_s": close_reads / ((cw0 - open_t0) / 1e9),
            "server_us_per_read": (sum(cpu0) - sum(cc0)) / max(1, close_reads) * 1e6,
            "idle_closes": sum(b["closed_idle"] - a["closed_idle"] for a, b in zip(sc0, s0)),
        }
        load_results = [load.read_json(120) for load in loads]
        reports = [server.stop() for server in servers]
        for load, report, result in zip(loads, reports, load_results):
            load.send({"closes": [[c[3], c[2]] for c in report["closed_idle"]]})
            result.update(load.read_json(300))
        for load in loads:
            load.send({"close": True})
        window_s = (w1 - w0) / 1e9
        reads = sum(b["reads"] - a["reads"] for a, b in zip(s0, s1))
        cpu = sum(cpu1) - sum(cpu0)
        out.update({
            "window_s": window_s, "reads_in_window": reads, "reads_per_s": reads / window_s,
            "server_cpu_cores": cpu / window_s, "server_us_per_read": cpu / max(1, reads) * 1e6,
            "load_cpu_cores": sum(r["run_cpu_cores"] for r in load_results),
            "sends": sum(r["sends"] for r in load_results),
            "send_blocked": sum(r["send_blocked"] for r in load_results),
        })
        if daemon:
            out["daemon_us_per_read"] = (d_cpu1 - d_cpu0) / max(1, reads) * 1e6
            out["daemon_cpu_cores"] = (d_cpu1 - d_cpu0) / window_s
            out["daemon_fire_lateness_ms"] = daemon_lateness(fired0, fired1)  # over the close phase

        closes = [c for report in reports for c in report["closed_idle"]]
        if kind.endswith("-wheeld"):
            out["lateness_parts_ms"] = lateness_parts(reports, idle_ns)
        early = [c for c in closes if c[2] - c[1] < idle_ns]
        late_ms = sorted((c[2] - c[1] - idle_ns) / 1e6 for c in closes)
        lag_ms = sorted(lag / 1e6 for report in reports for at, lag in report["lag"] if open_t0 <= at <= w1)
        gc_ms = sorted(took / 1e6 for report in reports for gen, at, took in report["gc"] if gen == 2 and at >= open_t0)
        out["gc_full_collections"] = {"count": len(gc_ms), "max_ms": gc_ms[-1] if gc_ms else None,
                                      "total_ms": sum(gc_ms)}
        out.update({
            "active": sum(r["active"] for r in load_results),
            "quiet": n - sum(r["active"] for r in load_results),
            "idle_closes": len(closes), "closed_seen_by_load": sum(r["closed"] for r in load_results),
            "wrong_closes": sum(r["wrong"] for r in load_results),
            "load_stalls": sum(r["load_stalls"] for r in load_results),
            "undetermined_closes": sum(r["undetermined"] + r["unknown_ports"] for r in load_results),
            "load_send_lag_ms_p99": max((r["send_lag_ms_p99"] or 0) for r in load_results),
            "load_send_lag_ms_max": max((r["send_lag_ms_max"] or 0) for r in load_results),
            "wrong_examples": [e for r in load_results for e in r["wrong_examples"]][:10],
            "stall_examples": [e for r in load_results for e in r.get("stall_examples", [])][:10],
            "early_closes": len(early), "early_examples_ms": [round((c[2] - c[1]) / 1e6, 3) for c in early[:10]],
            "missed": sum(r["missed"] for r in load_results),
            # open past idle_ms + 2 s of silence at the end, as the servers saw them (a missed close's why)
            "overdue_open": {k: sum(report.get("overdue", {}).get(k, 0) for report in reports)
                             for k in ("count", "tracked", "unsent", "expired_received")},
            "overdue_examples": [e for report in reports for e in report.get("overdue", {}).get("examples", [])][:10],
            "raced_reports": sum(report["summary"].get("raced", 0) for report in reports),
            "lateness_ms": {"p50": percentile(late_ms, 0.5), "p99": percentile(late_ms, 0.99),
                            "max": late_ms[-1] if late_ms else None},
            "loop_lag_ms": {"p50": percentile(lag_ms, 0.5), "p99": percentile(lag_ms, 0.99),
                            "max": lag_ms[-1] if lag_ms else None, "samples": len(lag_ms)},
        })
        return out
    finally:
        stop_profilers(profilers)
        for child in loads + servers:
            child.kill()
        if daemon is not None:
            daemon.cleanup()


# =========================================================================== parent
def plan_processes(n: int, requested: int | None) -> tuple[int, str]:
    """How many server/load process pairs hold ``n`` connections, and why."""
    if requested:
        return requested, f"{requested} process pair(s) as requested"
    ok, message = raise_nofile(n + HEADROOM)
    if ok:
        return 1, message
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    per_process = hard - HEADROOM
    if per_process < 1000:
        raise SystemExit(f"bench/sockets.py: {message}")
    processes = -(-n // per_process)
    return processes, (f"{message}. So the connections are split over {processes} server processes (each "
                       f"with its own load process, port and source address; the wheeld kinds share one "
                       f"daemon), {n // processes:,}-{-(-n // processes):,} connections each")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--load", help=argparse.SUPPRESS)
    parser.add_argument("--connections", type=int, default=50_000)
    parser.add_argument("--idle-ms", type=int, default=2000)
    parser.add_argument("--quiet-span-s", type=float, default=0.0,
                        help="0: quiet connections go quiet after their first byte; else they send every "
                        "idle_ms/2 until a moment uniform over this span after all are open")
    parser.add_argument("--duration-s", type=float, default=20.0,
                        help="the CPU window, after the close phase: reads only")
    parser.add_argument("--min-interval-ms", type=int, default=100)
    parser.add_argument("--max-interval-ms", type=int, default=500)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop",
                        help="the asyncio servers' event loop")
    parser.add_argument("--processes", type=int, help="server/load process pairs (default: 1, or as many as "
                        "RLIMIT_NOFILE requires when it cannot be raised)")
    parser.add_argument("--connect-rate", type=int, default=4000, help="connections opened per second (all loads)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--daemon-nice", type=int, default=0, metavar="N",
                        help="run the daemon at this niceness (negative: ahead of the servers and the load; "
                        "the unit's Nice=)")
    parser.add_argument("--profile", metavar="DIR", help="sample the servers and daemons with py-spy into DIR")
    parser.add_argument("--out", default=None, help="JSON results path (default: sockets.json, see --save)")
    add_save_option(parser)
    args = parser.parse_args(argv)
    if args.serve:
        return serve(json.loads(args.serve))
    if args.load:
        return load_main(json.loads(args.load))

    kinds = [k for k in args.kinds.split(",") if k]
    for kind in kinds:
        if kind not in KINDS:
            parser.error(f"unknown kind {kind!r} (one of {', '.join(KINDS)})")
    if args.max_interval_ms >= args.idle_ms:
        parser.error("--max-interval-ms must be below --idle-ms (active connections would look idle)")
    args.processes, plan = plan_processes(args.connections, args.processes)
    print(f"sockets benchmark: {args.connections:,} loopback connections, idle {args.idle_ms} ms, sends every "
          f"{args.min_interval_ms}-{args.max_interval_ms} ms, quiet ones going quiet "
          f"{'after their first byte' if not args.quiet_span_s else f'over {args.quiet_span_s} s'}, "
          f"CPU window {args.duration_s} s, asyncio servers on {args.loop}; {plan}; load average "
          f"{os.getloadavg()[0]:.2f} on "
          f"{os.cpu_count()} CPUs", flush=True)
    results = []
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="wheeld-bench-sockets-") as workdir:
        for kind in kinds:
            r = run_kind(kind, args, workdir)
            results.append(r)
            print(f"  {kind:20} {format_row(r)}", flush=True)
    add_net(results)
    print()
    print(format_table(results))
    payload = {"benchmark": "sockets", "spec": {k: v for k, v in vars(args).items() if k not in ("serve", "load")},
               "plan": plan, "machine": _machine(), "started_unix_s": int(started), "results": results,
               "summary": summarize(results)}
    out = Path(args.out) if args.out else results_path("sockets.json", args.save)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2) + "\n")
    for line in payload["summary"].get("lines", []):
        print(line)
    print(f"\nwrote {out}")
    return 0


def _machine() -> dict:
    import platform

    return {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
            "load_average_at_end": list(os.getloadavg())}


def add_net(results: list[dict]) -> None:
    """Idle detection's own CPU per read: minus the -none server of the same family (same run)."""
    by_kind = {r["kind"]: r for r in results}
    for r in results:
        family = r["kind"].split("-", 1)[0]
        base = by_kind.get(f"{family}-none")
        if base is None or r["kind"] == base["kind"]:
            continue
        r["net_us_per_read"] = r["server_us_per_read"] - base["server_us_per_read"]
        if "daemon_us_per_read" in r:
            r["net_with_daemon_us_per_read"] = r["net_us_per_read"] + r["daemon_us_per_read"]


def summarize(results: list[dict]) -> dict:
    by_kind = {r["kind"]: r for r in results}
    out: dict = {"lines": []}
    base = by_kind.get("asyncio-call-later")
    for kind in ("asyncio-wheeld", "sync-wheeld"):
        r = by_kind.get(kind)
        if r is None or base is None:
            continue
        all_in = r["server_us_per_read"] + r.get("daemon_us_per_read", 0.0)
        out[f"{kind}_server_cpu_per_read_vs_call_later"] = base["server_us_per_read"] / r["server_us_per_read"]
        out[f"{kind}_with_daemon_cpu_per_read_vs_call_later"] = base["server_us_per_read"] / all_in
        line = (f"{kind}: server CPU per read {r['server_us_per_read']:.2f} us (+ daemon "
                f"{r.get('daemon_us_per_read', 0.0):.2f}) vs call_later {base['server_us_per_read']:.2f} us: "
                f"{out[f'{kind}_server_cpu_per_read_vs_call_later']:.2f}x lower (server), "
                f"{out[f'{kind}_with_daemon_cpu_per_read_vs_call_later']:.2f}x (server + daemon)")
        if "net_us_per_read" in r and "net_us_per_read" in base:
            with_daemon = r.get("net_with_daemon_us_per_read", r["net_us_per_read"])
            out[f"{kind}_net_us_per_read"] = r["net_us_per_read"]
            out[f"{kind}_net_with_daemon_us_per_read"] = with_daemon
            out["call_later_net_us_per_read"] = base["net_us_per_read"]
            line += (f"; idle detection alone (minus {kind.split('-')[0]}-none): {r['net_us_per_read']:.2f} us in "
                     f"the server, {with_daemon:.2f} with the daemon, vs {base['net_us_per_read']:.2f} us for "
                     f"call_later")
        out["lines"].append(line)
    return out


def format_row(r: dict) -> str:
    lat, lag = r["lateness_ms"], r["loop_lag_ms"]

    def ms(v):
        return "-" if v is None else f"{v:.2f}"

    daemon = f" + daemon {r['daemon_us_per_read']:.2f}" if "daemon_us_per_read" in r else ""
    return (f"open {r['open_s']:.1f} s, {r['reads_per_s']:,.0f} reads/s, server {r['server_cpu_cores']:.2f} cores, "
            f"load {r['load_cpu_cores']:.2f} cores, cpu/read {r['server_us_per_read']:.2f}{daemon} us, wrong "
            f"{r['wrong_closes']}, early {r['early_closes']}, missed {r['missed']}, idle closes {r['idle_closes']}, "
            f"load stalls {r['load_stalls']} (send lag p99/max "
            f"{r['load_send_lag_ms_p99']}/{r['load_send_lag_ms_max']} ms), "
            f"late p50/p99/max {ms(lat['p50'])}/{ms(lat['p99'])}/{ms(lat['max'])} ms"
            + (f" (daemon fired p50/p99 {ms(r['daemon_fire_lateness_ms']['p50'])}/"
               f"{ms(r['daemon_fire_lateness_ms']['p99'])} ms late)" if "daemon_fire_lateness_ms" in r else "")
            + f", lag p99 {ms(lag['p99'])} ms, "
            f"rss {r['rss_bytes_per_connection']:.0f} B/conn")


def format_table(results: list[dict]) -> str:
    def ms(v):
        return "-" if v is None else f"{v:.2f}"

    head = (f"{'server':19} | {'conns':>6} | {'wrong':>5} | {'early':>5} | {'missed':>6} | "
            f"{'late p50/p99/max ms':>19} | {'CPU/read us':>11} | {'daemon':>6} | {'net':>5} | "
            f"{'lag p99 ms':>10} | {'RSS B/conn':>10}")
    lines = [head, "-" * len(head)]
    for r in results:
        lat = r["lateness_ms"]
        none = r["kind"].endswith("-none")
        late = "-" if none else f"{ms(lat['p50'])}/{ms(lat['p99'])}/{ms(lat['max'])}"
        rss = r["rss_bytes_per_connection"] + r.get("daemon_rss_bytes_per_connection", 0.0)
        net = r.get("net_with_daemon_us_per_read", r.get("net_us_per_read"))
        lines.append(
            f"{r['kind']:19} | {r['connections']:>6} | {r['wrong_closes']:>5} | {r['early_closes']:>5} | "
            f"{'-' if none else r['missed']:>6} | {late:>19} | {r['server_us_per_read']:>11.2f} | "
            f"{(format(r['daemon_us_per_read'], '.2f') if 'daemon_us_per_read' in r else '-'):>6} | "
            f"{(format(net, '.2f') if net is not None else '-'):>5} | {ms(r['loop_lag_ms']['p99']):>10} | {rss:>10.0f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
