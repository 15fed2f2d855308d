"""Alternating A/B of a benchmark between two checkouts of wheeld.

    python -m bench.ab --a /path/to/old --b . --runs 5          # table + bench/runs/e2e-ab.json
    python -m bench.ab --a /path/to/old --b . --runs 5 --save   # recorded: bench/results/e2e-ab.json
    python -m bench.ab --bench wheel_core --a /path/to/old --b . --runs 3 --save
                                                                # bench/results/wheel_core-ab.json

Each checkout runs its own code with its own virtualenv, A then B, ``--runs`` times,
so that the machine's drift (other load, thermal state) falls on both alike:
``bench.e2e --only wheeld --repeat 1`` (the end to end figures), or ``bench.wheel_core
--quick`` (the compiled wheel's scalar and batch operations at 100k pending). The table
gives min / median / max of each figure per side and the ratio of B's median to A's
(of the first figure).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from .common import results_path

FIELDS = {
    "ops_per_s": lambda w: w["ops_per_s"],
    "burst daemon us/op": lambda w: w["cpu_us_per_op"]["daemon"],
    "burst clients us/op": lambda w: w["cpu_us_per_op"]["clients"],
    "steady daemon us/op": lambda w: w["steady_daemon_cpu_us_per_op"],
    "preload adds/s": lambda w: w["preload_adds_per_s"],
    "steady daemon CPU share": lambda w: w["steady_cpu_share"]["daemon"],
    "steady recv p99 ms": lambda w: w["lateness"]["steady"]["recv"]["p99"],
}


def _git(directory: str) -> str:
    try:
        return subprocess.run(["git", "-C", directory, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"



def _core_figure(impl: str, operation: str):
    """A wheel_core figure: ``operation`` per second of ``impl`` at 100k pending."""
    def get(results: list) -> float | None:
        return next((r[f"{operation}_per_s"] for r in results if r["impl"] == impl and r["pending"] == 100_000), None)
    return get


CORE_FIELDS = {f"{impl} {op}/s": _core_figure(impl, op) for impl in ("wheel", "wheel-batch")
               for op in ("insert", "cancel", "rearm", "expire")}


def run_once(directory: str, out: str, timeout_s: float, bench: str = "e2e"):
    python = os.path.join(directory, ".venv", "bin", "python")
    if bench == "wheel_core":
        subprocess.run([python, "-m", "bench.wheel_core", "--quick", "--output", out], cwd=directory, check=True,
                       timeout=timeout_s, stdout=subprocess.DEVNULL)
        with open(out + ".json") as f:
            return json.load(f)["results"]
    subprocess.run([python, "-m", "bench.e2e", "--only", "wheeld", "--repeat", "1", "--out", out],
                   cwd=directory, check=True, timeout=timeout_s, stdout=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)["runs"][0]["wheeld"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__.split("\n")[0])
    parser.add_argument("--a", required=True, help="checkout A (built: DIR/.venv, make build)")
    parser.add_argument("--b", required=True, help="checkout B")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--save", action="store_true")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--bench", choices=("e2e", "wheel_core"), default="e2e")
    args = parser.parse_args(argv)
    fields = CORE_FIELDS if args.bench == "wheel_core" else FIELDS
    first = next(iter(fields))
    sides = {"A": os.path.abspath(args.a), "B": os.path.abspath(args.b)}
    commits = {side: _git(path) for side, path in sides.items()}
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for order in range(1, args.runs + 1):
            for side, path in sides.items():
                load = os.getloadavg()[0]
                started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
                result = run_once(path, os.path.join(tmp, f"{side}{order}.json"), args.timeout, args.bench)
                row = {"code": f"{side} {commits[side]}", "order": order, "started": started, "loadavg_before": load}
                row.update({name: get(result) for name, get in fields.items()})
                runs.append(row)
                print(f"{side} run {order}: {first} {row[first]:,.0f} (load {load:.2f})", flush=True)
    summary = {}
    print(f"\n| code | {' | '.join(fields)} |\n|---|" + "---:|" * len(fields))
    for side in sides:
        cells, summary[side] = [], {}
        for name in fields:
            values = [r[name] for r in runs if r["code"].startswith(side) and r[name] is not None]
            median = statistics.median(values) if values else None
            summary[side][name] = {"min": min(values, default=None), "median": median, "max": max(values, default=None)}
            cells.append(f"{min(values):,.3g} / {median:,.3g} / {max(values):,.3g}" if values else "-")
        print(f"| {side} {commits[side]} | {' | '.join(cells)} |")
    ratios = {name: (summary["B"][name]["median"] / summary["A"][name]["median"]
                     if summary["A"][name]["median"] and summary["B"][name]["median"] is not None else None)
              for name in fields}
    print("\nB / A medians: " + ", ".join(f"{name} {r:.3f}" for name, r in ratios.items() if r is not None))
    out = results_path(f"{args.bench}-ab.json", args.save)
    command = f"python -m bench.ab --bench {args.bench} --a {sides['A']} --b {sides['B']} --runs {args.runs}"
    out.write_text(json.dumps({"command": command, "commits": commits, "runs": runs, "summary": summary,
                               "b_over_a_medians": ratios, "b_over_a_ops_per_s": ratios.get("ops_per_s")},
                              indent=1) + "\n")
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
