"""Benchmark of the write-ahead journal: append rate per fsync policy, bytes, recovery.

    python bench/journal.py              # ~1-2 min; table + bench/runs/journal.json (--save: bench/results/)
    python bench/journal.py --big        # also recovery of 10M pending timers (~6 GB RAM, minutes)
    python bench/journal.py --big --recovery-only   # just that, merged into the results file
    python bench/journal.py --dir /var/lib/wheeld-bench   # measure on another disk

What is measured (best of ``--repeat`` runs, and the median):

* **append** -- :meth:`Journal.append` of ``--events`` add events in batches of
  64 and 512 (what the daemon drains from its rings per loop turn), for each
  policy: ``always`` (write + fsync per batch: group commit), ``interval=10``
  (write per batch; ``maybe_sync`` driven after each batch with the real
  monotonic clock, as the daemon's timer would) and ``off`` (write only).
  The figure is events/s including numbering, encoding and the write
  syscall; building the event structs is measured apart (``build``), since
  the daemon pays it with any policy. The baseline in the same run is
  ``encode only`` (the bulk encoder without any file): the ceiling of any
  policy.
* **bytes** -- journal bytes per event type with realistic keys and groups,
  and per timer over its life: ``add + cancel`` (an operation completed
  early), ``add + fire + ack`` (it timed out and was delivered); and snapshot
  bytes per pending timer.
* **recovery** -- :func:`recover` of a directory holding ``--pending``
  (1M) pending timers, two ways: a snapshot of all of them plus 100k journal
  events after it (the steady state with periodic snapshots), and a journal
  of 1M adds with no snapshot (the worst case before the first snapshot).
  Target: 1M pending timers recovered in under 5 s. With ``--big``
  the same at 10M.

The fsync cost is the disk's: on this machine's virtual disk one fsync of a
small append takes ~2 ms, which bounds ``always`` at ~500 batches/s.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import add_save_option, results_path  # noqa: E402
from wheeld.journal.files import Journal, PendingTimer
from wheeld.journal.recovery import recover
from wheeld.protocol.journal import Ack, Add, Cancel, Fire, encode_event, encode_events

T0 = 1_700_000_000_000


def best_and_median(samples: list[float], higher_is_better: bool = True) -> dict:
    return {"best": max(samples) if higher_is_better else min(samples), "median": statistics.median(samples)}


def make_adds(count: int, start: int = 0) -> list[Add]:
    return [
        Add(t=T0 + index, g="purgatory", k=f"req-{index}", d=T0 + index + 30_000, s=index)
        for index in range(start, start + count)
    ]


# --------------------------------------------------------------------------- append


def bench_build(events: int, repeat: int) -> dict:
    rates = []
    for _ in range(repeat):
        started = time.perf_counter()
        make_adds(events)
        rates.append(events / (time.perf_counter() - started))
    return best_and_median(rates)


def bench_encode_only(events: int, batch: int, repeat: int) -> dict:
    adds = make_adds(events)
    rates = []
    for _ in range(repeat):
        started = time.perf_counter()
        for index in range(0, events, batch):
            encode_events(adds[index : index + batch])
        rates.append(events / (time.perf_counter() - started))
    return best_and_median(rates)


def bench_append(directory: Path, policy: str, events: int, batch: int, repeat: int) -> dict:
    adds = make_adds(events)
    batches = [adds[index : index + batch] for index in range(0, events, batch)]
    rates, fsyncs = [], []
    for run in range(repeat):
        folder = directory / f"append-{policy.replace('=', '')}-{batch}-{run}"
        journal = Journal(folder, fsync=policy, host="bench")
        interval = journal.policy.mode == "interval"
        started = time.perf_counter()
        for chunk in batches:
            journal.append(chunk)
            if interval:
                journal.maybe_sync()
        journal.sync()  # everything on disk at the end, for every policy
        rates.append(events / (time.perf_counter() - started))
        fsyncs.append(journal.fsync_count)
        journal.close()
        shutil.rmtree(folder)
    return {**best_and_median(rates), "fsyncs": statistics.median(fsyncs)}


# --------------------------------------------------------------------------- bytes


def bench_bytes() -> dict:
    count = 10_000
    adds = [Add(n=10**8 + i, t=T0 + i, g="purgatory", k=f"req-{i:08d}", d=T0 + i + 500, s=i) for i in range(count)]
    cancels = [Cancel(n=10**8 + i, t=T0 + i, g="purgatory", k=f"req-{i:08d}", s=i, hit=True, pd=T0 + i + 500)
               for i in range(count)]
    fires = [Fire(n=10**8 + i, t=T0 + i, g="purgatory", k=f"req-{i:08d}", d=T0 + i, s=i, f=T0 + i + 1, lat=1)
             for i in range(count)]
    acks = [Ack(n=10**8 + i, t=T0 + i, g="purgatory", k=f"req-{i:08d}", s=i) for i in range(count)]
    per = {
        "add": len(encode_events(adds)) / count,
        "cancel": len(encode_events(cancels)) / count,
        "fire": len(encode_events(fires)) / count,
        "ack": len(encode_events(acks)) / count,
    }
    per["timer_add_cancel"] = per["add"] + per["cancel"]
    per["timer_add_fire_ack"] = per["add"] + per["fire"] + per["ack"]
    with tempfile.TemporaryDirectory() as folder:
        journal = Journal(folder, fsync="off", host="bench")
        journal.append(make_adds(1))
        pending = [PendingTimer("purgatory", f"req-{i:08d}", T0 + i, i) for i in range(count)]
        path = journal.write_snapshot(1, pending)
        per["snapshot_per_pending"] = path.stat().st_size / count
        journal.close()
    per["example_add_line"] = encode_event(adds[0]).decode().strip()
    return per


# --------------------------------------------------------------------------- recovery


def build_snapshot_dir(folder: Path, pending_count: int, tail_events: int) -> dict:
    """A directory with a snapshot of ``pending_count`` timers and a journal tail after it."""
    started = time.perf_counter()
    journal = Journal(folder, fsync="off", host="bench")
    chunk = 100_000
    for start in range(0, pending_count, chunk):
        journal.append(make_adds(min(chunk, pending_count - start), start))
    lsn = journal.last_lsn
    built = time.perf_counter()
    pending = (PendingTimer("purgatory", f"req-{i}", T0 + i + 30_000, i) for i in range(pending_count))
    journal.write_snapshot(lsn, pending)
    snapshot_s = time.perf_counter() - built
    # the journal goes on after the snapshot; the segments it covers stay (compaction
    # deletes them only once a newer snapshot exists) but recovery does not read them
    for start in range(0, tail_events, chunk):
        journal.append(make_adds(min(chunk, tail_events - start), pending_count + start))
    journal.close()
    return {"build_s": built - started, "snapshot_write_s": snapshot_s}


def build_journal_dir(folder: Path, pending_count: int) -> None:
    journal = Journal(folder, fsync="off", host="bench")
    chunk = 100_000
    for start in range(0, pending_count, chunk):
        journal.append(make_adds(min(chunk, pending_count - start), start))
    journal.close()


def time_recovery(folder: Path, expected: int, repeat: int) -> dict:
    times = []
    for _ in range(repeat):
        gc.collect()
        started = time.perf_counter()
        state = recover(folder, repair=False)
        times.append(time.perf_counter() - started)
        assert len(state.pending) == expected, (len(state.pending), expected)
        assert not state.problems, state.problems
        del state
    size = sum(path.stat().st_size for path in folder.iterdir())
    return {**best_and_median(times, higher_is_better=False), "bytes_on_disk": size}


def bench_recovery(directory: Path, pending_count: int, repeat: int, tail_events: int = 100_000) -> dict:
    result = {}
    folder = directory / f"recover-snapshot-{pending_count}"
    result["snapshot_plus_tail"] = {**build_snapshot_dir(folder, pending_count, tail_events)}
    result["snapshot_plus_tail"].update(time_recovery(folder, pending_count + tail_events, repeat))
    shutil.rmtree(folder)
    folder = directory / f"recover-journal-{pending_count}"
    build_journal_dir(folder, pending_count)
    result["journal_only"] = time_recovery(folder, pending_count, repeat)
    shutil.rmtree(folder)
    return result


# --------------------------------------------------------------------------- main


def print_recovery(recovery: dict) -> None:
    print("\nrecovery (seconds, best / median)")
    for count, figures in recovery.items():
        for layout, numbers in figures.items():
            print(f"  {int(count):>10,} pending, {layout:<20}{numbers['best']:>7.2f} /{numbers['median']:>6.2f}"
                  f"   ({numbers['bytes_on_disk'] / 1e6:.0f} MB on disk)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=200_000, help="events per append run (off/interval)")
    parser.add_argument("--always-events", type=int, default=20_000, help="events per 'always' run (fsync-bound)")
    parser.add_argument("--pending", type=int, default=1_000_000)
    parser.add_argument("--big", action="store_true", help="also recover 10M pending timers")
    parser.add_argument("--recovery-only", action="store_true", help="skip append and bytes; merge into --output")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--output", type=Path, default=None, help="result file (default: journal.json, see --save)")
    add_save_option(parser)
    args = parser.parse_args(argv)
    if args.output is None:
        args.output = results_path("journal.json", args.save)

    base = Path(tempfile.mkdtemp(prefix="wheeld-bench-journal-", dir=args.dir))
    result: dict = {
        "machine": {"python": sys.version.split()[0], "platform": platform.platform(), "cpus": os.cpu_count()},
        "parameters": {"events": args.events, "always_events": args.always_events, "pending": args.pending,
                       "repeat": args.repeat},
    }
    if args.recovery_only:
        try:
            previous = json.loads(args.output.read_text())
        except (OSError, ValueError):
            previous = {}
        recovery = dict(previous.get("recovery_s", {}))
        try:
            counts = [10_000_000] if args.big else [args.pending]
            for count in counts:
                recovery[f"{count}"] = bench_recovery(base, count, 1 if count > 1_000_000 else args.repeat)
        finally:
            shutil.rmtree(base, ignore_errors=True)
        previous["recovery_s"] = recovery
        print_recovery(recovery)
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(previous, indent=2) + "\n")
        print(f"\nwrote {args.output}")
        return 0
    try:
        result["build_events_per_s"] = bench_build(args.events, args.repeat)
        append: dict = {}
        for batch in (64, 512):
            append[f"encode_only_batch_{batch}"] = bench_encode_only(args.events, batch, args.repeat)
            for policy in ("off", "interval=10", "always"):
                count = args.always_events if policy == "always" else args.events
                append[f"{policy}_batch_{batch}"] = bench_append(base, policy, count, batch, args.repeat)
                print(f"  append {policy:<12} batch {batch:>3}: "
                      f"{append[f'{policy}_batch_{batch}']['best'] / 1e3:8.0f}k events/s", file=sys.stderr)
        result["append_events_per_s"] = append
        result["bytes"] = bench_bytes()
        recovery = {f"{args.pending}": bench_recovery(base, args.pending, args.repeat)}
        print(f"  recovery {args.pending:,}: done", file=sys.stderr)
        if args.big:
            recovery["10000000"] = bench_recovery(base, 10_000_000, 1)
        result["recovery_s"] = recovery
    finally:
        shutil.rmtree(base, ignore_errors=True)

    # ----- table
    build = result["build_events_per_s"]["best"]
    print(f"\njournal append (events/s, best of {args.repeat}; event structs built apart at {build / 1e3:.0f}k/s)")
    print(f"{'policy':<14}{'batch 64':>12}{'batch 512':>12}{'fsyncs (512)':>14}")
    for policy in ("encode_only", "off", "interval=10", "always"):
        row = [append[f"{policy}_batch_{batch}"] for batch in (64, 512)]
        fsyncs = row[1].get("fsyncs", "-")
        print(f"{policy:<14}{row[0]['best'] / 1e3:>11.0f}k{row[1]['best'] / 1e3:>11.0f}k{fsyncs!s:>14}")
    off, interval = append["off_batch_512"]["best"], append["interval=10_batch_512"]["best"]
    print(f"interval=10 / off at batch 512: {interval / off:.2f}")
    sizes = result["bytes"]
    print("\njournal bytes")
    for name in ("add", "cancel", "fire", "ack", "timer_add_cancel", "timer_add_fire_ack", "snapshot_per_pending"):
        print(f"  {name:<22}{sizes[name]:>8.1f}")
    print_recovery(recovery)
    target = recovery[f"{args.pending}"]["snapshot_plus_tail"]["best"]
    if args.pending == 1_000_000:
        print(f"  target: 1M pending in < 5 s -> {'met' if target < 5 else 'NOT met'} ({target:.2f} s)")

    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
