"""Durability benchmark: acknowledged add throughput of a real wheeld per fsync policy.

    python -m bench.durability                 # ~1-2 min: table + bench/runs/durability.json (--save: bench/results/)
    python -m bench.durability --quick         # seconds: small sizes, 1 repeat, no recovery run
    python -m bench.durability --batches 64 --policies none,interval=10 --profile /tmp/prof
    python -m bench.durability --summarize /tmp/prof   # shares of the py-spy recordings

Run it from the repository root on a quiet machine, holding the shared lock
(``flock /tmp/wheeld-bench.lock python -m bench.durability``); the load average
of every run is written into the JSON and the table.

What is measured
================

For each *policy* a fresh ``wheeld`` process is started (its own name, socket
and an empty temporary journal directory) and stopped by pid afterwards; its
shared-memory segments are unlinked by name. The policies:

==============  =============================================================
``none``        no ``--journal``: the daemon's batched apply path (the baseline)
``off``         ``--journal DIR --fsync off``: written, never fsynced
``interval=10`` ``--fsync interval=10``: group commit, fsync at most every 10 ms
``always``      ``--fsync always``: ``flush()`` returns only once the adds are
                fsynced (one fsync per drained batch)
==============  =============================================================

``--clients`` processes (2) connect, wait for a common start instant and then
each adds ``--adds-per-client`` new keys (str keys ``"c<client>-<i>"``, one
hour delay, so nothing fires) and calls ``flush()`` after every ``--batch``
adds (64 and 512). ``flush()`` returns when the daemon has applied -- and
journaled -- everything before it, so the figure is **acknowledged adds/s =
all adds / (last client's last flush return - start)**. With ``interval`` an
acknowledged add is written but may be up to 10 ms (plus two fsyncs) from the
disk; with ``always`` it is on disk.

Per run also: journal bytes per add (growth of the ``journal-*.jsonl`` files
over the run / adds), fsyncs per second (the daemon logs its journal's fsync
count when it stops; the fsync that opened the segment is subtracted), the
daemon's CPU seconds (psutil) per add, and the load average when the run
started. Policies are interleaved inside each repeat (none, off, interval,
always, none, ...) so a change of machine load hits them alike; the table
shows the best run and the spread (min-max) of ``--repeat`` runs, and the
ratios of the bests to ``none`` and to ``off``.

Recovery: with ``--recovery N`` (1M by default, 0 to
skip) the same run writes a journal of N adds (no snapshot, the worst case
before the first snapshot) and times :func:`wheeld.journal.recovery.recover`
over it; the recovery and bytes-per-timer figures of ``bench/journal.py``
(``bench/results/journal.json``: 1M and 10M pending, snapshot plus tail) are
copied into the summary with their source named.

Targets: ``interval=10`` at least 0.5x the ``none`` add throughput
(checked for each batch size, on the best runs); recovery of 1M pending timers
in under 5 s.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue as queue_module
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

from bench.common import RESULTS_DIR, add_save_option, format_table, machine_info, results_path

JOURNAL_RESULTS = RESULTS_DIR / "journal.json"  # the recorded figures of bench/journal.py
POLICIES = ("none", "off", "interval=10", "always")
DELAY_MS = 3_600_000  # nothing fires during a run
TARGET_INTERVAL_RATIO = 0.5
TARGET_RECOVERY_1M_S = 5.0
_FSYNC_LINE = re.compile(r"journal: closed at lsn (\d+) after (\d+) fsyncs \((\d+) at start\)")


# --------------------------------------------------------------------------- a client process


def client_process(client: int, socket_path: str, adds: int, batch: int, ready, go, start_ns, results) -> None:
    try:
        results.put(("result", client, _client(client, socket_path, adds, batch, ready, go, start_ns)))
    except BaseException:  # noqa: BLE001 - everything goes to the parent
        results.put(("error", client, traceback.format_exc()))


def _client(client, socket_path, adds, batch, ready, go, start_ns) -> dict:
    import wheeld

    keys = [f"c{client}-{i}" for i in range(adds)]
    w = wheeld.connect(socket_path, group=f"durable-{client}", ring_timeout_s=60.0)
    try:
        w.flush(timeout_s=30)
        ready.put(client)
        go.wait(60)
        t0 = start_ns.value
        while time.monotonic_ns() < t0:
            pass
        add, flush = w.add, w.flush
        cpu0 = time.process_time()
        flushes = 0
        for start in range(0, adds, batch):
            for key in keys[start : start + batch]:
                add(key, DELAY_MS)
            flush(timeout_s=60)
            flushes += 1
        end_ns = time.monotonic_ns()
        return {"client": client, "adds": adds, "flushes": flushes, "end_ns": end_ns,
                "cpu_s": time.process_time() - cpu0}
    finally:
        w.close()


# --------------------------------------------------------------------------- one run


def journal_bytes(directory: Path | None) -> int:
    if directory is None or not directory.exists():
        return 0
    return sum(p.stat().st_size for p in directory.glob("journal-*.jsonl"))


def fsyncs_from_log(text: str) -> int | None:
    """Fsyncs the journal made while the daemon ran, minus the one that opened its segment."""
    found = _FSYNC_LINE.findall(text)
    if not found:
        return None
    _lsn, total, at_start = found[-1]
    return int(total) - int(at_start)


def run_policy(policy: str, batch: int, clients: int, adds_per_client: int, capacity: int,
               name_prefix: str, workdir: Path, profile_dir: str | None = None) -> dict:
    import psutil

    from bench.common import unique_name
    from bench.e2e import bench_daemon, start_pyspy, stop_pyspy

    name = unique_name(name_prefix)
    journal_dir = None
    extra = ["--ring-capacity", str(1 << 14)]
    if policy != "none":
        journal_dir = workdir / f"journal-{name}"
        extra += ["--journal", str(journal_dir), "--fsync", policy]
    daemon = bench_daemon(workdir, name, capacity, extra_args=tuple(extra), log_level="INFO")
    ctx = multiprocessing.get_context("fork")
    ready, results = ctx.Queue(), ctx.Queue()
    go = ctx.Event()
    start_ns = ctx.Value("q", 0, lock=False)
    procs: list = []
    spies: list = []
    loadavg = list(os.getloadavg())
    try:
        daemon.start(timeout_s=20)
        daemon_ps = psutil.Process(daemon.proc.pid)
        procs = [ctx.Process(target=client_process, daemon=True,
                             args=(c, daemon.socket_path, adds_per_client, batch, ready, go, start_ns, results))
                 for c in range(clients)]
        for p in procs:
            p.start()
        for _ in procs:
            _get(ready, procs, 60)
        if profile_dir:
            label = f"{policy.replace('=', '')}-b{batch}"
            spies = start_pyspy(profile_dir, label, {"daemon": daemon.proc.pid})
        bytes_before = journal_bytes(journal_dir)
        cpu_before = daemon_ps.cpu_times()
        t0 = time.monotonic_ns() + 20_000_000
        start_ns.value = t0
        go.set()
        outs = {}
        for _ in procs:
            what, client, payload = _get(results, procs, 300)
            if what == "error":
                raise RuntimeError(f"client {client} failed:\n{payload}")
            outs[client] = payload
        cpu_after = daemon_ps.cpu_times()
        bytes_after = journal_bytes(journal_dir)
        stop_pyspy(spies)
        spies = []
    finally:
        stop_pyspy(spies)
        for p in procs:
            p.join(5)
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join(5)
        daemon.cleanup(signal.SIGTERM)  # the journal logs its fsync count as it closes
        log_text = daemon.log()
        if journal_dir is not None:
            shutil.rmtree(journal_dir, ignore_errors=True)
    adds = sum(o["adds"] for o in outs.values())
    wall_s = (max(o["end_ns"] for o in outs.values()) - t0) / 1e9
    daemon_cpu_s = (cpu_after.user + cpu_after.system) - (cpu_before.user + cpu_before.system)
    fsyncs = fsyncs_from_log(log_text) if journal_dir is not None else 0
    out = {
        "policy": policy,
        "batch": batch,
        "adds": adds,
        "wall_s": round(wall_s, 4),
        "adds_per_s": round(adds / wall_s),
        "journal_bytes_per_add": round((bytes_after - bytes_before) / adds, 1) if journal_dir else 0.0,
        "fsyncs": fsyncs,
        "fsyncs_per_s": round(fsyncs / wall_s, 1) if fsyncs is not None else None,
        "daemon_cpu_us_per_add": round(daemon_cpu_s / adds * 1e6, 3),
        "daemon_busy_share": round(daemon_cpu_s / wall_s, 3),
        "client_cpu_us_per_add": round(sum(o["cpu_s"] for o in outs.values()) / adds * 1e6, 3),
        "loadavg_at_start": [round(x, 2) for x in loadavg],
    }
    problems = [line for line in log_text.splitlines() if " WARNING " in line or " ERROR " in line]
    if problems:
        out["daemon_log_warnings"] = problems[:10]
    return out


def _get(q, procs, timeout_s: float):
    end = time.monotonic() + timeout_s
    while True:
        try:
            return q.get(timeout=0.2)
        except queue_module.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"client process {dead[0].pid} exited with {dead[0].exitcode}") from None
            if time.monotonic() > end:
                raise TimeoutError(f"clients silent for {timeout_s} s") from None


# --------------------------------------------------------------------------- recovery


def measure_recovery(pending: int, repeat: int, base: Path) -> dict:
    """Write a journal of ``pending`` adds (no snapshot) and time recover() over it."""
    from bench.journal import build_journal_dir, time_recovery

    folder = base / f"recover-{pending}"
    started = time.perf_counter()
    build_journal_dir(folder, pending)
    build_s = time.perf_counter() - started
    try:
        result = time_recovery(folder, pending, repeat)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {"layout": "journal_only", "build_s": round(build_s, 3), **result}


def journal_bench_figures(path: Path = JOURNAL_RESULTS) -> dict | None:
    """Recovery and bytes figures of bench/journal.py, as measured by it."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return {"source": str(path.relative_to(path.parent.parent.parent)),
            "recovery_s": data.get("recovery_s"), "bytes": data.get("bytes")}


# --------------------------------------------------------------------------- summary


def summarize(runs: list[dict], policies, batches) -> list[dict]:
    rows = []
    for batch in batches:
        best = {}
        for policy in policies:
            mine = [r for r in runs if r["policy"] == policy and r["batch"] == batch]
            if not mine:
                continue
            rates = [r["adds_per_s"] for r in mine]
            top = max(mine, key=lambda r: r["adds_per_s"])
            best[policy] = top["adds_per_s"]
            fsync_rates = [r["fsyncs_per_s"] for r in mine if r["fsyncs_per_s"] is not None]
            rows.append({
                "policy": policy, "batch": batch, "runs": len(mine),
                "adds_per_s_best": top["adds_per_s"], "adds_per_s_min": min(rates),
                "adds_per_s_median": statistics.median(rates),
                "spread_pct": round(100 * (max(rates) - min(rates)) / max(rates), 1),
                "journal_bytes_per_add": top["journal_bytes_per_add"],
                "fsyncs_per_s": top["fsyncs_per_s"],
                "fsyncs_per_s_all": fsync_rates,
                "daemon_cpu_us_per_add": top["daemon_cpu_us_per_add"],
                "daemon_cpu_us_per_add_min": min(r["daemon_cpu_us_per_add"] for r in mine),
                "loadavg_1m": [r["loadavg_at_start"][0] for r in mine],
            })
        for row in rows:
            if row["batch"] != batch:
                continue
            row["vs_none"] = round(row["adds_per_s_best"] / best["none"], 3) if "none" in best else None
            row["vs_off"] = round(row["adds_per_s_best"] / best["off"], 3) if "off" in best else None
    return rows


FULL_ADDS_PER_CLIENT = 100_000  # the size the targets are for


def targets(rows: list[dict], recovery: dict | None, comparable: bool = True) -> list[dict]:
    """The target rows; ``comparable`` False (not the full sizes, e.g. --quick): ``met`` is None."""
    out = []
    for row in rows:
        if row["policy"] == "interval=10" and row["vs_none"] is not None:
            out.append({"target": f"interval=10 >= {TARGET_INTERVAL_RATIO}x none (batch {row['batch']})",
                        "value": row["vs_none"],
                        "met": row["vs_none"] >= TARGET_INTERVAL_RATIO if comparable else None})
    if recovery is not None:
        out.append({"target": f"recover 1M pending < {TARGET_RECOVERY_1M_S} s (journal only, this run)",
                    "value": recovery["best"], "met": recovery["best"] < TARGET_RECOVERY_1M_S})
    return out


def print_report(rows, target_rows, recovery, journal_figures, loadavgs) -> None:
    table = [{**r, "spread": f"{r['spread_pct']:.0f}%", "load": "/".join(f"{x:.1f}" for x in r["loadavg_1m"]),
              "fsyncs_per_s": r["fsyncs_per_s"] if r["policy"] not in ("none",) else None} for r in rows]
    print("\nacknowledged adds through a real daemon (best of runs; flush() every `batch` adds)")
    print(format_table(table, ["policy", "batch", "adds_per_s_best", "spread", "vs_none", "vs_off",
                               "journal_bytes_per_add", "fsyncs_per_s", "daemon_cpu_us_per_add", "load"],
                       ["policy", "batch", "adds/s", "spread", "x none", "x off", "B/add", "fsync/s",
                        "daemon us/add", "load 1m"]))
    print(f"load average over the runs: {min(loadavgs):.2f} - {max(loadavgs):.2f}")
    if recovery is not None:
        print(f"\nrecovery, this run: {recovery['pending']:,} pending from a journal of adds (no snapshot): "
              f"best {recovery['best']:.2f} s, median {recovery['median']:.2f} s "
              f"({recovery['bytes_on_disk'] / 1e6:.0f} MB)")
    if journal_figures and journal_figures.get("recovery_s"):
        print(f"recovery, from {journal_figures['source']} (bench/journal.py):")
        for count, layouts in journal_figures["recovery_s"].items():
            for layout, numbers in layouts.items():
                if not isinstance(numbers, dict):
                    print(f"  {int(count):>11,} pending: {layout}: {numbers}")
                    continue
                print(f"  {int(count):>11,} pending, {layout:<20} best {numbers['best']:6.2f} s"
                      f"  ({numbers['bytes_on_disk'] / 1e6:,.0f} MB)")
    if journal_figures and journal_figures.get("bytes"):
        b = journal_figures["bytes"]
        print(f"journal bytes per timer (bench/journal.py): add {b['add']:.0f}, "
              f"add+cancel {b['timer_add_cancel']:.0f}, "
              f"add+fire+ack {b['timer_add_fire_ack']:.0f}, snapshot {b['snapshot_per_pending']:.0f} per pending")
    print("\ntargets")
    for t in target_rows:
        verdict = "not comparable: not the full sizes" if t["met"] is None else ("met" if t["met"] else "NOT met")
        print(f"  {t['target']:<55} {t['value']:>8.3f}  {verdict}")


# --------------------------------------------------------------------------- main


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes, 1 repeat, no recovery run")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma list of none, off, interval=N, always")
    p.add_argument("--batches", default="64,512", help="adds per flush() (comma list)")
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--adds-per-client", type=int, default=None, help="default 100000 (quick: 5000)")
    p.add_argument("--always-adds-per-client", type=int, default=None,
                   help="for 'always' (fsync-bound); default: --adds-per-client")
    p.add_argument("--repeat", type=int, default=None, help="default 2 (quick: 1)")
    p.add_argument("--capacity", type=int, default=None)
    p.add_argument("--recovery", type=int, default=None, help="pending timers to recover (default 1M; quick 0)")
    p.add_argument("--out", type=Path, default=None, help="result file (default: durability.json, see --save)")
    add_save_option(p)
    p.add_argument("--variant", default=None, metavar="LABEL",
                   help="store this run under variants[LABEL] of --out, keeping the rest of the file "
                        "(e.g. the daemon with a proposed patch, run from a copy through PYTHONPATH)")
    p.add_argument("--name-prefix", default="bench-durable")
    p.add_argument("--profile", default=None, metavar="DIR", help="py-spy the daemon (first repeat)")
    p.add_argument("--summarize", default=None, metavar="DIR", help="print the shares of DIR's recordings and exit")
    args = p.parse_args(argv)
    if args.out is None:
        args.out = results_path("durability.json", args.save)
    return args


def git_head() -> dict:
    from bench.e2e import git_state

    return git_state()


def daemon_source() -> dict:
    """Which daemon code ran: the work tree is shared and may hold others' unfinished
    edits, so a run may use a clean copy (``PYTHONPATH``); its files' git blob ids say
    what it was (compare with ``git rev-parse HEAD:daemon/server.py``)."""
    import subprocess

    import wheeld.daemon.delivery
    import wheeld.daemon.executor
    import wheeld.daemon.planner
    import wheeld.daemon.recorder
    import wheeld.daemon.server

    out = {}
    for module in (wheeld.daemon.server, wheeld.daemon.planner, wheeld.daemon.executor, wheeld.daemon.delivery,
                   wheeld.daemon.recorder):
        path = module.__file__
        blob = subprocess.run(["git", "hash-object", path], capture_output=True, text=True, check=False).stdout.strip()
        out[module.__name__] = {"path": path, "blob": blob}
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.summarize:
        from bench.e2e import summarize_pyspy

        for path in sorted(Path(args.summarize).glob("pyspy-*.txt")):
            print(summarize_pyspy(str(path), top=25))
        return 0
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    batches = [int(b) for b in args.batches.split(",")]
    adds = args.adds_per_client or (5_000 if args.quick else FULL_ADDS_PER_CLIENT)
    always_adds = args.always_adds_per_client or adds
    repeat = args.repeat or (1 if args.quick else 2)
    recovery_n = args.recovery if args.recovery is not None else (0 if args.quick else 1_000_000)
    capacity = args.capacity or max(50_000, int(args.clients * max(adds, always_adds) * 1.25))
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="wheeld-durable-"))
    runs: list[dict] = []
    recovery = None
    try:
        for rep in range(repeat):
            for batch in batches:
                for policy in policies:
                    n = always_adds if policy == "always" else adds
                    run = run_policy(policy, batch, args.clients, n, capacity, args.name_prefix, workdir,
                                     args.profile if rep == 0 else None)
                    run["repeat"] = rep
                    runs.append(run)
                    print(f"  [{rep}] {policy:<12} batch {batch:>4}: {run['adds_per_s']:>9,} adds/s "
                          f"daemon {run['daemon_cpu_us_per_add']:.2f} us/add, {run['journal_bytes_per_add']} B/add, "
                          f"fsync/s {run['fsyncs_per_s']}, load {run['loadavg_at_start'][0]:.2f}", file=sys.stderr)
        if recovery_n:
            recovery = {"pending": recovery_n, **measure_recovery(recovery_n, 2, workdir)}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    rows = summarize(runs, policies, batches)
    journal_figures = journal_bench_figures()
    target_rows = targets(rows, recovery if recovery_n == 1_000_000 else None, comparable=adds == FULL_ADDS_PER_CLIENT)
    loadavgs = [r["loadavg_at_start"][0] for r in runs]
    print_report(rows, target_rows, recovery, journal_figures, loadavgs)
    payload = {
        "benchmark": "durability",
        "machine": machine_info(),
        "git": git_head(),
        "daemon_source": daemon_source(),
        "parameters": {"policies": policies, "batches": batches, "clients": args.clients,
                       "adds_per_client": adds, "always_adds_per_client": always_adds, "repeat": repeat,
                       "delay_ms": DELAY_MS, "capacity": capacity, "quick": args.quick, "recovery": recovery_n},
        "summary": rows,
        "targets": target_rows,
        "recovery_this_run": recovery,
        "journal_bench": journal_figures,
        "loadavg_1m_range": [min(loadavgs), max(loadavgs)],
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.variant:
        try:
            document = json.loads(args.out.read_text())
        except (OSError, ValueError):
            document = {"benchmark": "durability"}
        document.setdefault("variants", {})[args.variant] = payload
        payload = document
    else:
        try:
            payload["variants"] = json.loads(args.out.read_text()).get("variants", {})
        except (OSError, ValueError):
            pass
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nwrote {args.out}" + (f" (variant {args.variant})" if args.variant else ""))
    return 0


if __name__ == "__main__":
    from bench.durability import main as _main

    sys.exit(_main())
