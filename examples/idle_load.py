"""Open many loopback connections to idle_server.py, keep some active, report which were closed.

    python examples/idle_load.py --spawn-server --idle-ms 1000           # one command: server + load
    python examples/idle_load.py --port PORT --idle-ms 1000 --connections 1000 --active 0.5

Each connection is either *active* (sends a byte every ``--interval-ms``, well
under the idle time, and reads the echo) or *silent* (sends one byte at start,
then nothing). The run lasts ``--duration-s``; a connection closed by the server
is recorded with the time since its last send. Connections start their
pattern as soon as they are open (at most 200 connects in flight); the run ends
``--duration-s`` after the last one opened. The verdict checks what an idle
detector must do: every silent connection closed, no active one closed, and no
close earlier than ``idle_ms`` after the last send (never early). The number of
connections is capped (``--connections`` at most 5000, and below the open-file
limit) and the script only connects to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

MAX_CONNECTIONS = 5000
HOST = "127.0.0.1"


class Conn:
    __slots__ = ("active", "closed_ns", "index", "last_send_ns", "reader", "writer")

    def __init__(self, index: int, active: bool) -> None:
        self.index, self.active = index, active
        self.reader = self.writer = None
        self.last_send_ns = 0
        self.closed_ns = 0


async def _run_conn(conn: Conn, port: int, interval_s: float, run: dict, opened: asyncio.Semaphore) -> None:
    """Open, say something once, then until ``run["end"]``: an active connection sends every
    ``interval_s``; every connection watches for EOF. ``run["end"]`` is set once all are open."""
    async with opened:
        conn.reader, conn.writer = await asyncio.open_connection(HOST, port)
    writer, reader = conn.writer, conn.reader
    conn.last_send_ns = time.monotonic_ns()  # before the write: the server sees it later, never earlier
    writer.write(b".")
    run["opened"] += 1
    if run["opened"] == run["total"]:
        run["all_open"].set()
    loop = asyncio.get_running_loop()
    try:
        while True:
            end = run["end"]
            remaining = 0.1 if end is None else end - loop.time()
            if remaining <= 0:
                return
            wait_s = min(remaining, interval_s) if conn.active else remaining
            try:
                data = await asyncio.wait_for(reader.read(4096), wait_s)
            except TimeoutError:
                if conn.active and (run["end"] is None or loop.time() < run["end"]):
                    conn.last_send_ns = time.monotonic_ns()
                    writer.write(b".")
                continue
            if not data:  # EOF: the server closed us
                conn.closed_ns = time.monotonic_ns()
                return
    except (ConnectionError, OSError):
        conn.closed_ns = time.monotonic_ns()
    finally:
        writer.close()


async def run_load(port: int, connections: int, active_fraction: float, interval_ms: int, duration_s: float,
                   idle_ms: int | None) -> dict:
    """Open every connection (at most 200 connects in flight); the run lasts ``duration_s`` from the last."""
    n_active = round(connections * active_fraction)
    conns = [Conn(i, i < n_active) for i in range(connections)]
    loop = asyncio.get_running_loop()
    run = {"end": None, "opened": 0, "total": connections, "all_open": asyncio.Event()}
    opened = asyncio.Semaphore(200)
    started = loop.time()
    tasks = [asyncio.ensure_future(_run_conn(c, port, interval_ms / 1000, run, opened)) for c in conns]
    done = asyncio.ensure_future(asyncio.gather(*tasks, return_exceptions=True))
    await asyncio.wait([done, asyncio.ensure_future(run["all_open"].wait())], return_when=asyncio.FIRST_COMPLETED)
    open_s = loop.time() - started
    run["end"] = loop.time() + duration_s
    results = await done
    failed = [r for r in results if isinstance(r, BaseException)]
    out = report([c for c in conns if c.writer is not None], idle_ms)
    out["connect_failures"] = len(failed)
    out["open_phase_s"] = round(open_s, 3)
    return out


def report(conns: list[Conn], idle_ms: int | None) -> dict:
    active = [c for c in conns if c.active]
    silent = [c for c in conns if not c.active]
    closed_silent = [c for c in silent if c.closed_ns]
    closed_active = [c for c in active if c.closed_ns]
    margins_ms = sorted((c.closed_ns - c.last_send_ns) / 1e6 for c in closed_silent + closed_active)
    out = {
        "connections": len(conns), "active": len(active), "silent": len(silent),
        "silent_closed": len(closed_silent), "active_closed": len(closed_active),
        "active_closed_indices": [c.index for c in closed_active][:20],
        "close_after_last_send_ms": {
            "min": margins_ms[0] if margins_ms else None,
            "median": margins_ms[len(margins_ms) // 2] if margins_ms else None,
            "max": margins_ms[-1] if margins_ms else None,
        },
    }
    if idle_ms is not None:
        early = [m for m in margins_ms if m < idle_ms]
        out["idle_ms"] = idle_ms
        out["closed_early"] = len(early)
        out["ok"] = not early and not closed_active and len(closed_silent) == len(silent)
    return out


def cap_connections(requested: int) -> int:
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(1, min(requested, MAX_CONNECTIONS, soft - 100))


def spawn_server(idle_ms: int, daemon_socket: str | None) -> tuple[subprocess.Popen, int]:
    cmd = [sys.executable, str(Path(__file__).with_name("idle_server.py")), "--idle-ms", str(idle_ms)]
    if daemon_socket:
        cmd += ["--daemon", daemon_socket]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line.startswith("listening on"):
        proc.kill()
        proc.wait()
        raise RuntimeError(f"idle_server.py did not start: {line!r}")
    port = int(line.split()[2].rsplit(":", 1)[1])
    return proc, port


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, help="idle_server.py's port (or --spawn-server)")
    parser.add_argument("--spawn-server", action="store_true", help="start idle_server.py as a child process")
    parser.add_argument("--daemon", metavar="SOCKET", help="with --spawn-server: the server uses this wheeld daemon")
    parser.add_argument("--connections", type=int, default=1000, help=f"capped at {MAX_CONNECTIONS} and the fd limit")
    parser.add_argument("--active", type=float, default=0.5, help="fraction of connections kept active")
    parser.add_argument("--idle-ms", type=int, default=1000, help="the server's idle time (for the verdict)")
    parser.add_argument("--interval-ms", type=int, help="active connections send this often (default idle/4)")
    parser.add_argument("--duration-s", type=float, help="default: 2.5 x idle time")
    args = parser.parse_args(argv)

    connections = cap_connections(args.connections)
    interval_ms = args.interval_ms or max(1, args.idle_ms // 4)
    duration_s = args.duration_s or 2.5 * args.idle_ms / 1000
    proc = None
    port = args.port
    if args.spawn_server:
        proc, port = spawn_server(args.idle_ms, args.daemon)
    elif port is None:
        parser.error("give --port or --spawn-server")
    try:
        result = asyncio.run(run_load(port, connections, args.active, interval_ms, duration_s, args.idle_ms))
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, 9)
                proc.wait()
    result["requested_connections"] = args.connections
    print(json.dumps(result, indent=2))
    return 0 if result.get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
