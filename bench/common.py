"""Helpers shared by the benchmarks: a plain-text table, a JSON result file, /proc
readings of a process, and the daemon harness the tests use (wheeld.testing:
start a wheeld on a private socket and name, wait until it is ready, stop it, unlink
its segments).

Every result file carries the machine it was measured on and the load average
at the start: the project's machines have 2 cores shared by several engineers,
so a figure measured under load says so.

Where result files go (:func:`results_path`): ``bench/results/`` holds the recorded
figures the docs quote, tracked by git, and a benchmark writes there only when asked
(``--save``). Any other run writes under ``bench/runs/`` (ignored by git; the
environment variable ``WHEELD_BENCH_RUNS`` names another folder), so a trial run
never replaces a recorded figure. An explicit ``--out``/``--output`` path is used as
given.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from wheeld.testing import DaemonProcess, unique_name, unlink_segments

__all__ = ["DaemonProcess", "add_save_option", "compile_c", "format_table", "machine_info", "proc_cpu_s",
           "proc_oncpu_s", "results_path", "rss_kb", "unique_name", "unlink_segments", "write_json"]

RESULTS_DIR = Path(__file__).resolve().parent / "results"  # the recorded figures (tracked): written with --save
RUNS_DIR = Path(__file__).resolve().parent / "runs"  # every other run's files (ignored by git)
RUNS_ENV = "WHEELD_BENCH_RUNS"  # another folder for them


@contextlib.contextmanager
def no_collector_pauses():
    """While a benchmark's application receives what it times (expirations, scheduled
    messages), its own garbage collector stays out: everything allocated before is frozen
    and collection is off until the block ends. A full collection of the benchmark process
    (its clients, results, nats-py) takes tens of ms, and inside a receive window it shows
    as the timer service's lateness: in one wheeld-schedules run of bench/fleet.py a gen2
    collection started in the very millisecond its burst of late expirations began."""
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.unfreeze()


def runs_dir() -> Path:
    """Where a run that was not asked to ``--save`` writes: ``$WHEELD_BENCH_RUNS``, else bench/runs/."""
    return Path(os.environ.get(RUNS_ENV) or RUNS_DIR)


def results_path(filename: str, save: bool = False) -> Path:
    """The path of result file ``filename``: in bench/results/ (the recorded figures) when
    ``save``, else in :func:`runs_dir`; its folder is created."""
    directory = RESULTS_DIR if save else runs_dir()
    directory.mkdir(parents=True, exist_ok=True)
    return directory / filename


def add_save_option(parser) -> None:
    """``--save``: write the result into bench/results/, replacing the recorded figures."""
    parser.add_argument("--save", action="store_true",
                        help="write the result into bench/results/ (the recorded figures, tracked by git) "
                             f"instead of bench/runs/ (or ${RUNS_ENV})")


def machine_info() -> dict:
    info = {
        "python": sys.version.split()[0],
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "load_average_at_start": list(os.getloadavg()),
        "measured_at_unix_s": int(time.time()),
    }
    try:
        import numpy

        info["numpy"] = numpy.__version__
    except ImportError:  # pragma: no cover
        pass
    return info


def compile_c(source: str, name: str, workdir: str) -> str:
    """Compile a benchmark's own C program (``-O2``, with ``$CC``, else ``cc`` or ``gcc``) into
    ``workdir``; return the executable's path. The floors some benchmarks compare with are
    measured in C, so that no interpreter is inside them."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        sys.exit(f"{name}: needs a C compiler (cc or gcc; the hot path's build needs one too)")
    src = os.path.join(workdir, name + ".c")
    exe = os.path.join(workdir, name)
    Path(src).write_text(source)
    subprocess.run([cc, "-O2", "-o", exe, src], check=True)
    return exe


def format_table(rows: Sequence[dict], columns: Sequence[str], headers: Sequence[str] | None = None) -> str:
    """Right-aligned columns; floats with thousands separators, None as '-'."""

    def cell(value) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:,.0f}" if abs(value) >= 100 else f"{value:,.2f}"
        if isinstance(value, int):
            return f"{value:,}"
        return str(value)

    headers = list(headers or columns)
    body = [[cell(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in body]
    return "\n".join(lines)


def write_json(name: str, payload: dict, save: bool = False) -> Path:
    """Write ``<name>.json`` (with machine info) where :func:`results_path` says; return its path."""
    path = results_path(f"{name}.json", save)
    data = {"benchmark": name, "machine": machine_info(), **payload}
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    return path


def rss_kb(pid: int | str = "self") -> int:
    """VmRSS of ``pid`` in KiB (0 when the kernel gives none)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_oncpu_s(pid: int) -> float:
    """On-CPU seconds of ``pid``'s threads so far, from the scheduler's nanosecond counts
    (``/proc/PID/task/*/schedstat``): :func:`proc_cpu_s` counts clock ticks (10 ms), too
    coarse for a process that runs a few ms in a measured second. A thread that ended
    is not counted."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total / 1e9

