"""Alternating A/B of the end-to-end benchmark between two checkouts of wheeld.

    python -m bench.ab --a /path/to/old --b . --runs 5          # table + bench/runs/e2e-ab.json
    python -m bench.ab --a /path/to/old --b . --runs 5 --save   # recorded: bench/results/e2e-ab.json

Each checkout runs its own code with its own virtualenv (``DIR/.venv/bin/python -m
bench.e2e --only wheeld --repeat 1``), A then B, ``--runs`` times, so that the
machine's drift (other load, thermal state) falls on both alike. The table gives
min / median / max of each figure per side and the ratio of B's median to A's.
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
    "steady daemon CPU share": lambda w: w["steady_cpu_share"]["daemon"],
    "steady recv p99 ms": lambda w: w["lateness"]["steady"]["recv"]["p99"],
}


def _git(directory: str) -> str:
    try:
        return subprocess.run(["git", "-C", directory, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def run_once(directory: str, out: str, timeout_s: float) -> dict:
    python = os.path.join(directory, ".venv", "bin", "python")
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
    args = parser.parse_args(argv)
    sides = {"A": os.path.abspath(args.a), "B": os.path.abspath(args.b)}
    commits = {side: _git(path) for side, path in sides.items()}
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for order in range(1, args.runs + 1):
            for side, path in sides.items():
                load = os.getloadavg()[0]
                started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
                result = run_once(path, os.path.join(tmp, f"{side}{order}.json"), args.timeout)
                row = {"code": f"{side} {commits[side]}", "order": order, "started": started, "loadavg_before": load}
                row.update({name: get(result) for name, get in FIELDS.items()})
                runs.append(row)
                print(f"{side} run {order}: {row['ops_per_s']:,.0f} ops/s (load {load:.2f})", flush=True)
    summary = {}
    print(f"\n| code | {' | '.join(FIELDS)} |\n|---|" + "---:|" * len(FIELDS))
    for side in sides:
        cells, summary[side] = [], {}
        for name in FIELDS:
            values = [r[name] for r in runs if r["code"].startswith(side) and r[name] is not None]
            median = statistics.median(values) if values else None
            summary[side][name] = {"min": min(values, default=None), "median": median, "max": max(values, default=None)}
            cells.append(f"{min(values):,.3g} / {median:,.3g} / {max(values):,.3g}" if values else "-")
        print(f"| {side} {commits[side]} | {' | '.join(cells)} |")
    a, b = summary["A"]["ops_per_s"]["median"], summary["B"]["ops_per_s"]["median"]
    ratio = b / a if a else None
    print(f"\nB / A median throughput: {ratio:.3f}" if ratio else "")
    out = results_path("e2e-ab.json", args.save)
    command = f"python -m bench.ab --a {sides['A']} --b {sides['B']} --runs {args.runs}"
    out.write_text(json.dumps({"command": command, "commits": commits, "runs": runs, "summary": summary,
                               "b_over_a_ops_per_s": ratio}, indent=1) + "\n")
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
