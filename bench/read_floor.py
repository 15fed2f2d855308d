"""What one read costs a Python server before any idle detection: the floor under
``bench/sockets.py``'s "server CPU per read".

    .venv/bin/python bench/read_floor.py                     # 16,000 connections, ~2 minutes
    .venv/bin/python bench/read_floor.py --connections 2000 --window-s 2 --out /tmp/floor.json

A server process holds ``--connections`` loopback TCP connections in one
``select.epoll`` and does nothing but ``os.read`` each readable descriptor (no
timer, no clock, no dict write); a load process sends one byte on every other
connection every 100-500 ms (uniform), as bench/sockets.py's active half does.
Over a ``--window-s`` window the server's CPU (``getrusage``: user and system
apart) is divided by the reads it made. Two shapes of loop:

* ``epoll``: wait, read what is readable, wait again: the usual event loop;
* ``epoll+Nms``: the same, sleeping N ms after each batch, so that each wait
  returns many descriptors (coalescing: reads are up to N ms later, and the
  wait's cost is shared by the batch).

The system-time share is the kernel's cost of ``epoll_wait`` and ``read`` on
this machine; no detection scheme added to a server can make its CPU per read
lower than this row. Writes bench/runs/read_floor.json (``--save``: bench/results/) and prints a table.
The processes it starts are stopped by pid; it listens and connects on
127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import random
import resource
import select
import signal
import socket
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import add_save_option, format_table, machine_info, results_path  # noqa: E402

SHAPES = {"epoll": 0.0, "epoll+1ms": 0.001, "epoll+2ms": 0.002}


def _raise_nofile(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= needed:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(needed, soft), max(needed, hard)))
    except (ValueError, OSError):
        sys.exit(f"read_floor: needs {needed} descriptors, RLIMIT_NOFILE is {soft}/{hard} "
                 "(run as root or lower --connections)")


def _accept_all(listener: socket.socket, poller: select.epoll, socks: dict) -> None:
    while True:
        try:
            sock, _ = listener.accept()
        except BlockingIOError:
            return
        sock.setblocking(False)
        socks[sock.fileno()] = sock
        poller.register(sock.fileno(), select.EPOLLIN)


def _usage() -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


def serve(report_fd: int, listener: socket.socket, connections: int, window_s: float, pause_s: float) -> None:
    """The server: epoll + os.read, nothing else; writes one JSON line to ``report_fd``."""
    poller = select.epoll()
    poller.register(listener.fileno(), select.EPOLLIN)
    socks: dict[int, socket.socket] = {}
    listen_fd, read, reads, waits = listener.fileno(), os.read, 0, 0
    start = None
    while True:
        events = poller.poll(0.1)
        waits += 1
        for fd, _mask in events:
            if fd == listen_fd:
                _accept_all(listener, poller, socks)
            elif read(fd, 4096):
                reads += 1
        if pause_s:
            time.sleep(pause_s)
        if start is None and len(socks) >= connections:
            time.sleep(1.0)  # let every connection's first byte be read before the window opens
            start = (time.monotonic(), _usage(), reads, waits)
        elif start is not None and time.monotonic() - start[0] >= window_s:
            break
    (t0, (u0, s0), r0, w0), (u1, s1) = start, _usage()
    n = reads - r0
    os.write(report_fd, json.dumps({"reads": n, "reads_per_s": n / (time.monotonic() - t0),
                                    "user_us_per_read": (u1 - u0) / n * 1e6, "sys_us_per_read": (s1 - s0) / n * 1e6,
                                    "reads_per_wait": n / max(1, waits - w0)}).encode() + b"\n")


def drive(port: int, connections: int, seed: int) -> None:
    """The load: open every connection, then send a byte on every other one every 100-500 ms."""
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(connections)]
    for sock in socks:
        sock.setblocking(False)
    rnd, now = random.Random(seed), time.monotonic()
    due = [(now + rnd.uniform(0.1, 0.5), i) for i in range(0, connections, 2)]
    heapq.heapify(due)
    while True:
        at, i = due[0]
        wait = at - time.monotonic()
        if wait > 0:
            time.sleep(min(wait, 0.005))
            continue
        heapq.heapreplace(due, (at + rnd.uniform(0.1, 0.5), i))
        try:
            socks[i].send(b"x")
        except OSError:
            pass


def measure(shape: str, connections: int, window_s: float, seed: int) -> dict:
    listener = socket.create_server(("127.0.0.1", 0), backlog=4096)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    report_r, report_w = os.pipe()
    pids = []
    try:
        pid = os.fork()
        if pid == 0:  # the server
            os.close(report_r)
            try:
                serve(report_w, listener, connections, window_s, SHAPES[shape])
            finally:
                os._exit(0)
        pids.append(pid)
        listener.close()
        pid = os.fork()
        if pid == 0:  # the load
            try:
                drive(port, connections, seed)
            finally:
                os._exit(0)
        pids.append(pid)
        os.close(report_w)
        with os.fdopen(report_r, "rb") as report:
            line = report.readline()
        if not line:
            raise RuntimeError(f"{shape}: the server exited without a report")
        row = {"shape": shape, "connections": connections, **json.loads(line)}
        row["us_per_read"] = row["user_us_per_read"] + row["sys_us_per_read"]
        return row
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=16_000)
    parser.add_argument("--window-s", type=float, default=15.0)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default=None, help="JSON results path (default: read_floor.json, see --save)")
    add_save_option(parser)
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = str(results_path("read_floor.json", args.save))
    shapes = args.shapes.split(",")
    unknown = set(shapes) - set(SHAPES)
    if unknown:
        parser.error(f"unknown shapes: {', '.join(sorted(unknown))} (known: {', '.join(SHAPES)})")
    _raise_nofile(args.connections + 64)  # per process: the server and the load each hold one end
    info = machine_info()
    rows = [measure(shape, args.connections, args.window_s, args.seed) for shape in shapes]
    print(format_table(rows, ["shape", "connections", "reads_per_s", "reads_per_wait", "user_us_per_read",
                              "sys_us_per_read", "us_per_read"],
                       ["loop", "connections", "reads/s", "reads/wait", "user us", "sys us", "us/read"]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"benchmark": "read_floor", "machine": info, "results": rows}, indent=2)
                              + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
