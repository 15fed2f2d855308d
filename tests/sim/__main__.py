"""Run simulated seeds: ``python -m sim`` from ``tests/`` (``make simulate`` wraps it).

    python -m sim --seeds 1000               # 1000 fresh seeds (the first printed), both cores
    python -m sim --seed 123456 --trace      # replay one seed, printing what happened
    python -m sim --seed 123456 --shrink     # the fewest operations with which it still fails
    python -m sim --regressions              # every seed in sim/regressions.txt
    python -m sim --seed 6 --ops 300 --plain # without the newer workloads and faults
    python -m sim --seed 40 --unheld         # without the groups held at their quota
    python -m sim --seed 40 --uncut          # without the sessions the daemon cuts
    python -m sim --fleet --seeds 500        # the fleet: hosts, a simulated NATS cluster (sim/fleet.py)
    python -m sim --fleet --seed 77 --trace  # replay one fleet seed

A failing seed prints the command that replays it. The totals say how often
each fault was injected across the run.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import sys
import time
import traceback
from collections import Counter

from .fleet import run_fleet_seed
from .run import run_seed

REGRESSIONS = os.path.join(os.path.dirname(__file__), "regressions.txt")
FLEET_REGRESSIONS = os.path.join(os.path.dirname(__file__), "fleet_regressions.txt")


def regression_cases(path: str = REGRESSIONS) -> list[tuple[int, int, bool, bool, bool]]:
    """(seed, ops, extra, hold, cut) of every seed that ever failed (sim/regressions.txt: ``seed
    ops [plain] [unheld] [uncut] # why``; ``plain``: found before the newer workloads and
    faults, run without them; ``unheld``: found before the groups held at their quota, run
    without those; ``uncut``: found before the sessions the daemon cuts, run without those;
    sim/fleet_regressions.txt: the fleet's, ``seed ops [uncut] # why``)."""
    cases = []
    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].split()
            if line:
                cases.append((int(line[0]), int(line[1]) if len(line) > 1 else 1000, "plain" not in line[2:],
                              "unheld" not in line[2:], "uncut" not in line[2:]))
    return cases


def _one(args: tuple):
    """One case: (seed, ops, extra, hold, cut), and ``fleet`` sixth for the fleet's simulation."""
    seed, ops, extra, hold, cut = args[:5]
    fleet = len(args) > 5 and args[5]
    started = time.perf_counter()
    try:
        result = run_fleet_seed(seed, ops, cut=cut) if fleet else run_seed(seed, ops, extra=extra, hold=hold, cut=cut)
    except BaseException as exc:  # noqa: BLE001 - the simulator itself failed: report the seed
        text = "".join(traceback.format_exception(exc))[-2000:] if fleet else f"{type(exc).__name__}: {exc}"
        violations, faults = [f"[simulator] {text}"], Counter()
    else:
        violations, faults = [str(v) for v in result.violations], result.faults
    return seed, ops, violations, faults, time.perf_counter() - started, extra, hold, cut, fleet


def shrink(seed: int, ops: int, extra: bool = True, hold: bool = True, fleet: bool = False, cut: bool = True) -> int:
    """The fewest operations with which ``seed`` still fails (the run is a prefix of the
    longer one: the seed decides every choice, ``ops`` only where the faults stop)."""
    low, high = 1, ops
    while low < high:
        middle = (low + high) // 2
        result = (run_fleet_seed(seed, middle, cut=cut) if fleet
                  else run_seed(seed, middle, extra=extra, hold=hold, cut=cut))
        if result.violations:
            high = middle
        else:
            low = middle + 1
    return high


def replay_command(seed: int, ops: int, extra: bool = True, hold: bool = True, fleet: bool = False,
                   cut: bool = True) -> str:
    if fleet:
        return f"cd tests && python -m sim --fleet --seed {seed} --ops {ops}{'' if cut else ' --uncut'} --trace"
    if not extra:
        return f"cd tests && python -m sim --seed {seed} --ops {ops} --plain --trace"
    if not hold or not cut:
        flags = (" --unheld" if not hold else "") + (" --uncut" if not cut else "")
        return f"cd tests && python -m sim --seed {seed} --ops {ops}{flags} --trace"
    return f"make simulate SEED={seed} OPS={ops}   (or: cd tests && python -m sim --seed {seed} --ops {ops} --trace)"


def run_many(cases: list[tuple], jobs: int, out=sys.stdout) -> tuple[list, Counter, float]:
    """Run every (seed, ops, extra, hold, cut[, fleet]); returns the failures, the fault totals and
    the seconds per seed."""
    failures, faults, spent = [], Counter(), 0.0
    chunk = max(1, len(cases) // (jobs * 16))
    if jobs > 1:
        with multiprocessing.get_context("fork").Pool(jobs, initializer=_quiet) as pool:
            results = pool.imap_unordered(_one, cases, chunksize=chunk)
            for item in results:
                spent += _collect(item, failures, faults, out)
    else:
        _quiet()
        for case in cases:
            spent += _collect(_one(case), failures, faults, out)
    return failures, faults, spent / max(1, len(cases))


def _collect(item, failures, faults, out) -> float:
    seed, ops, violations, seed_faults, seconds, extra, hold, cut, fleet = item
    faults.update(seed_faults)
    if violations:
        failures.append((seed, ops, violations))
        print(f"FAILED {'fleet ' if fleet else ''}seed {seed} ({ops} ops): {violations[0][:500]}", file=out)
        print(f"  replay: {replay_command(seed, ops, extra, hold, fleet, cut)}", file=out, flush=True)
    return seconds


def _quiet() -> None:
    logging.disable(logging.CRITICAL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sim", description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=0, help="how many fresh seeds to run")
    parser.add_argument("--first", type=int, default=None, help="the first of them (default: from the clock)")
    parser.add_argument("--seed", type=int, default=None, help="run this one seed")
    parser.add_argument("--ops", type=int, default=1000, help="operations per seed")
    parser.add_argument("--regressions", action="store_true", help="run every seed that ever failed")
    parser.add_argument("--trace", action="store_true", help="with --seed: print what happened")
    parser.add_argument("--shrink", action="store_true", help="with --seed: the fewest ops that still fail")
    parser.add_argument("--plain", action="store_true", help="without the newer workloads and faults "
                                                             "(Profile.draw_extra), as the plain regression seeds")
    parser.add_argument("--unheld", action="store_true",
                        help="without the groups held at their quota (Profile.draw_quota_hold), as the unheld "
                             "regression seeds")
    parser.add_argument("--uncut", action="store_true",
                        help="without the sessions the daemon cuts (Profile.draw_cut), as the uncut regression seeds")
    parser.add_argument("--fleet", action="store_true", help="the fleet's simulation: hosts replicating to a "
                                                             "simulated NATS JetStream cluster (sim/fleet.py)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)

    if args.seed is not None:
        _quiet()
        started = time.perf_counter()
        if args.fleet:
            result = run_fleet_seed(args.seed, args.ops, trace=args.trace, cut=not args.uncut)
        else:
            result = run_seed(args.seed, args.ops, trace=args.trace, extra=not args.plain, hold=not args.unheld,
                              cut=not args.uncut)
        took = time.perf_counter() - started
        if args.trace:
            print("\n".join(result.trace))
        print(f"seed {args.seed}: {result.profile.describe()}")
        print(f"{result.ops} ops, {result.events} events, {result.sim_ms / 1000:.1f} s simulated in {took:.3f} s; "
              f"{result.acked} armings acknowledged, {result.handed} hand-overs; faults: {dict(result.faults)}")
        for violation in result.violations:
            print(violation)
        if result.violations and args.shrink:
            fewest = shrink(args.seed, args.ops, extra=not args.plain, hold=not args.unheld, fleet=args.fleet,
                            cut=not args.uncut)
            print(f"fails with as few as {fewest} operations: "
                  f"{replay_command(args.seed, fewest, not args.plain, not args.unheld, args.fleet, not args.uncut)}")
        return 1 if result.violations else 0

    cases = regression_cases(FLEET_REGRESSIONS if args.fleet else REGRESSIONS) if args.regressions else []
    if args.seeds:
        first = args.first if args.first is not None else int(time.time() * 1000) % 10**12
        print(f"{'fleet ' if args.fleet else ''}seeds {first}..{first + args.seeds - 1}, {args.ops} operations each, "
              f"{args.jobs} jobs", flush=True)
        cases += [(seed, args.ops, not args.plain, not args.unheld, not args.uncut)
                  for seed in range(first, first + args.seeds)]
    cases = [(*case, args.fleet) for case in cases]
    if not cases:
        parser.error("nothing to run: --seeds N, --seed S or --regressions")
    started = time.perf_counter()
    failures, faults, per_seed = run_many(cases, args.jobs)
    wall = time.perf_counter() - started
    print(f"{len(cases)} seeds in {wall:.1f} s ({per_seed * 1000:.0f} ms per seed on one core, {args.jobs} jobs): "
          f"{len(failures)} failing")
    print("faults injected:")
    for name, count in sorted(faults.items()):
        print(f"  {count:>9}  {name}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
