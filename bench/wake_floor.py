"""What it costs a process just to wake once per millisecond: the floor under the
daemon's CPU in the steady phase of ``bench.e2e``.

    python -m bench.wake_floor                   # ~30 s; table + bench/runs/wake_floor.json (--save: bench/results/)
    python -m bench.wake_floor --seconds 2       # quicker

A timer service that expires every timer in the millisecond it is due (the e2e
bench's "fired p99 0") must wake in every millisecond in which a timer is due.
In the e2e steady phase ~25k timers come due per second, spread over the
deadlines, so nearly every millisecond has one: ~1,000 wake-ups a second at
the least, whatever each wake-up then does. This bench measures what those
wake-ups cost on this machine with nothing else to do:

* ``c timerfd``: a C loop (compiled here with ``$CC``, default ``cc``) that arms
  a one-shot absolute ``timerfd`` for the start of the next millisecond, waits
  for it in ``epoll_wait`` and reads it: the daemon's park (``daemon/alarm.py``)
  with no Python and no work.
* ``c timerfd + 2 sends``: the same, writing one 600-byte frame on each of two
  Unix stream sockets per wake-up (the e2e's two clients each get an
  ``Expirations`` frame per millisecond); child processes read them.
* ``python uvloop``: a uvloop loop parked the daemon's way (the ``Alarm``
  timerfd as a reader, a future awaited per park), doing nothing else.

CPU is the process's own on-CPU time from ``/proc/self/schedstat`` (the
scheduler's nanosecond count) and, beside it, user + system time from
``getrusage`` (what ``psutil``'s ``cpu_times`` gives the e2e bench). Per
operation it is divided by the e2e steady phase's client operations per second
(``--ops-per-s``, 40,000: two clients at 20,000) and compared with the e2e
target for the daemon's steady CPU per op (0.3 us): a row above the target
says that no daemon that wakes every millisecond can meet it here, however
little each wake-up does.

The children it starts are stopped by pid; nothing touches the network.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import add_save_option, compile_c, format_table, write_json  # noqa: E402

TARGET_US_PER_OP = 0.3  # bench.e2e: the daemon's steady CPU per client op
E2E_STEADY_OPS_PER_S = 40_000  # bench.e2e: 2 clients x steady_rate_per_client 20,000
FRAME_BYTES = 600  # about one Expirations frame of ~13 items

C_SOURCE = r"""
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static unsigned long long on_cpu_ns(void) {
    unsigned long long ns = 0;
    FILE *f = fopen("/proc/self/schedstat", "r");
    if (f) { if (fscanf(f, "%llu", &ns) != 1) ns = 0; fclose(f); }
    return ns;
}

static long long mono_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static double rusage_s(void) {
    struct rusage r;
    getrusage(RUSAGE_SELF, &r);
    return r.ru_utime.tv_sec + r.ru_utime.tv_usec / 1e6 + r.ru_stime.tv_sec + r.ru_stime.tv_usec / 1e6;
}

int main(int argc, char **argv) {
    double seconds = argc > 1 ? atof(argv[1]) : 5.0;
    int sends = argc > 2 ? atoi(argv[2]) : 0;
    int frame = argc > 3 ? atoi(argv[3]) : 600;
    int socks[8], pids[8];
    char *buf = calloc(1, frame > 0 ? frame : 1);
    if (sends > 8) sends = 8;
    for (int i = 0; i < sends; i++) {
        int sv[2];
        if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) { perror("socketpair"); return 2; }
        pids[i] = fork();
        if (pids[i] == 0) {
            char rb[65536];
            close(sv[0]);
            for (int j = 0; j < i; j++) close(socks[j]);  /* only this child's end: EOF when the parent closes */
            while (read(sv[1], rb, sizeof rb) > 0) {}
            _exit(0);
        }
        close(sv[1]);
        socks[i] = sv[0];
    }
    int tfd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
    int ep = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event ev = {.events = EPOLLIN};
    ev.data.fd = tfd;
    if (tfd < 0 || ep < 0 || epoll_ctl(ep, EPOLL_CTL_ADD, tfd, &ev) != 0) { perror("timerfd/epoll"); return 2; }
    long long start = mono_ns(), end = start + (long long)(seconds * 1e9);
    unsigned long long cpu0 = on_cpu_ns();
    double ru0 = rusage_s();
    long wakes = 0;
    for (;;) {
        long long now = mono_ns();
        if (now >= end) break;
        long long next_ms = (now / 1000000 + 1) * 1000000;  /* the start of the next millisecond */
        struct itimerspec its;
        memset(&its, 0, sizeof its);
        its.it_value.tv_sec = next_ms / 1000000000LL;
        its.it_value.tv_nsec = next_ms % 1000000000LL;
        timerfd_settime(tfd, TFD_TIMER_ABSTIME, &its, NULL);
        struct epoll_event out[4];
        if (epoll_wait(ep, out, 4, -1) <= 0) continue;
        uint64_t expirations;
        if (read(tfd, &expirations, sizeof expirations) != sizeof expirations) continue;
        wakes++;
        for (int i = 0; i < sends; i++)
            if (write(socks[i], buf, frame) != frame) { perror("write"); return 2; }
    }
    double wall = (mono_ns() - start) / 1e9;
    unsigned long long cpu = on_cpu_ns() - cpu0;
    double ru = rusage_s() - ru0;
    for (int i = 0; i < sends; i++) { close(socks[i]); waitpid(pids[i], NULL, 0); }
    printf("%ld %.6f %llu %.6f\n", wakes, wall, cpu, ru);
    return 0;
}
"""


def run_c(exe: str, seconds: float, sends: int) -> dict:
    out = subprocess.run([exe, str(seconds), str(sends), str(FRAME_BYTES)], capture_output=True, text=True,
                         timeout=seconds + 60, check=True)
    wakes, wall_s, cpu_ns, rusage_s = out.stdout.split()
    return {"wakes": int(wakes), "wall_s": float(wall_s), "on_cpu_s": int(cpu_ns) / 1e9, "rusage_s": float(rusage_s)}


def _on_cpu_s() -> float:
    with open("/proc/self/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


def run_python(seconds: float) -> dict:
    """A uvloop loop parked as the daemon parks (Alarm timerfd + a future per park)."""
    import uvloop

    from wheeld.daemon.alarm import Alarm

    async def main() -> dict:
        loop = asyncio.get_running_loop()
        alarm = Alarm.create()
        if alarm is None:
            raise RuntimeError("no timerfd on this system")
        waiter: list = [None]

        def on_alarm() -> None:
            if alarm.consume() and waiter[0] is not None and not waiter[0].done():
                waiter[0].set_result(None)

        loop.add_reader(alarm.fileno(), on_alarm)
        start = time.monotonic_ns()
        end = start + int(seconds * 1e9)
        cpu0, ru0 = _on_cpu_s(), _rusage_s()
        wakes = 0
        while (now := time.monotonic_ns()) < end:
            waiter[0] = loop.create_future()
            alarm.arm((now // 1_000_000 + 1) * 1_000_000)
            await waiter[0]
            wakes += 1
        cpu, ru = _on_cpu_s() - cpu0, _rusage_s() - ru0
        loop.remove_reader(alarm.fileno())
        alarm.close()
        return {"wakes": wakes, "wall_s": (time.monotonic_ns() - start) / 1e9, "on_cpu_s": cpu, "rusage_s": ru}

    return uvloop.run(main())


def _rusage_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def row(name: str, m: dict, ops_per_s: int) -> dict:
    wakes_per_s = m["wakes"] / m["wall_s"]
    cpu_ms_per_s = m["on_cpu_s"] * 1000 / m["wall_s"]
    return {
        "loop": name, "wakes_per_s": round(wakes_per_s), "cpu_ms_per_s": round(cpu_ms_per_s, 1),
        "rusage_ms_per_s": round(m["rusage_s"] * 1000 / m["wall_s"], 1),
        "us_per_wake": round(m["on_cpu_s"] * 1e6 / max(1, m["wakes"]), 2),
        "us_per_op": round(cpu_ms_per_s * 1000 / ops_per_s, 3),
        "over_target": round(cpu_ms_per_s * 1000 / ops_per_s / TARGET_US_PER_OP, 2), **m,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=5.0, help="per loop and repeat")
    ap.add_argument("--repeat", type=int, default=2, help="runs of each loop; the cheapest is kept")
    ap.add_argument("--ops-per-s", type=int, default=E2E_STEADY_OPS_PER_S,
                    help="client ops per second the wake-ups are shared by (bench.e2e's steady phase)")
    ap.add_argument("--out", default="wake_floor",
                    help="result name: writes NAME.json (into bench/runs/, or bench/results/ with --save)")
    add_save_option(ap)
    args = ap.parse_args(argv)

    rows = []
    with tempfile.TemporaryDirectory(prefix="wheeld-wake-floor-") as workdir:
        exe = compile_c(C_SOURCE, "wake_floor", workdir)
        loops = [("c timerfd", lambda: run_c(exe, args.seconds, 0)),
                 ("c timerfd + 2 sends", lambda: run_c(exe, args.seconds, 2)),
                 ("python uvloop", lambda: run_python(args.seconds))]
        for name, run in loops:
            runs = [row(name, run(), args.ops_per_s) for _ in range(args.repeat)]
            best = min(runs, key=lambda r: r["us_per_wake"])
            best["runs_us_per_wake"] = [r["us_per_wake"] for r in runs]
            rows.append(best)
            print(f"  {name}: {best['us_per_wake']} us per wake-up (runs {best['runs_us_per_wake']})", flush=True)

    print()
    print(format_table(rows, ["loop", "wakes_per_s", "cpu_ms_per_s", "rusage_ms_per_s", "us_per_wake", "us_per_op",
                              "over_target"],
                       ["loop", "wakes/s", "CPU ms/s", "rusage ms/s", "us/wake", f"us/op at {args.ops_per_s:,}/s",
                        f"x target {TARGET_US_PER_OP} us/op"]))
    floor = rows[0]["us_per_op"]
    verdict = "above" if floor > TARGET_US_PER_OP else "below"
    print(f"\nthe bare wake-up alone costs {floor} us per steady op, {verdict} the {TARGET_US_PER_OP} us/op target")
    path = write_json(args.out, {"ops_per_s": args.ops_per_s, "target_us_per_op": TARGET_US_PER_OP,
                                 "seconds": args.seconds, "repeat": args.repeat, "frame_bytes": FRAME_BYTES,
                                 "rows": rows}, save=args.save)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
