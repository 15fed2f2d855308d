"""What one dependent memory access costs here, by working-set size: the floor under a
scalar wheel call on a key nobody touched lately, at millions of timers.

    python -m bench.miss_floor                    # ~3 min; table + bench/runs/miss_floor.json (--save: bench/results/)
    python -m bench.miss_floor --no-wheel         # the chase alone (~1 min)

A C loop (compiled here with ``$CC``, default ``cc``) follows a random cycle of
8-byte indices through an array (Sattolo's shuffle: one cycle through every
element, so the prefetchers cannot guess the next address) and reports the
nanoseconds per load, for arrays of 16 KiB to ``--max-mib``: the latency of the
cache level, or of memory, that holds the working set, TLB misses included.

Why it matters for the wheel: a scalar ``schedule`` of a key that is not in the
wheel must read the key index's cell for that key's hash before it knows
whether the key is there. At 10M timers the index is a table of at least 20M
4-byte cells (128 MiB here) beside 10M 8-byte hashes and the 640 MB arena, far
more than any cache, and a new key's cell was not touched lately: one
dependent access to memory at least, whatever the code around it. So a scalar
insert of a new key at 10M costs at least its all-in-cache cost (the 10k row
of ``bench.wheel_core``) plus one such access. In the same run the bench runs
``bench.wheel_core`` for the compiled scalar ``wheel`` at 10k and 10M pending
and prints that expected minimum of the insert's 10M / 10k ratio beside the
ratio measured and the target (1.2x). It is an estimate, not a strict bound: an
out-of-order core overlaps a little work with the access (the hash comes before
it, and everything after it depends on the cell it reads), and the chase's
working set is not laid out the way the index's pages are. (Re-arm and cancel in that bench work on the
keys the insert round has just touched, in cache, so no such bound holds for
them there.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import add_save_option, compile_c, format_table, write_json  # noqa: E402

INDEX_MIB_AT_10M = 128  # the key index's table at 10M records: 2**25 int32 cells
TARGET_RATIO = 1.2  # bench.wheel_core's target: per-op cost at 10M within 1.2x of 10k

C_SOURCE = r"""
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static uint64_t state = 88172645463325252ULL;
static uint64_t next_random(void) {  /* xorshift64 */
    state ^= state << 13; state ^= state >> 7; state ^= state << 17;
    return state;
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
    size_t max_bytes = (size_t)((argc > 1 ? atof(argv[1]) : 256.0) * 1024 * 1024);
    long loads = argc > 2 ? atol(argv[2]) : 20000000;
    for (size_t bytes = 16 * 1024; bytes <= max_bytes; bytes *= 2) {
        size_t n = bytes / sizeof(uint64_t);
        uint64_t *next = malloc(n * sizeof(uint64_t));
        if (!next) { perror("malloc"); return 2; }
        for (size_t i = 0; i < n; i++) next[i] = i;
        for (size_t i = n - 1; i > 0; i--) {  /* Sattolo: a single cycle */
            size_t j = next_random() % i;
            uint64_t t = next[i]; next[i] = next[j]; next[j] = t;
        }
        uint64_t x = 0;
        for (size_t i = 0; i < n; i++) x = next[x];  /* touch every page once */
        double t0 = now_s();
        for (long i = 0; i < loads; i++) x = next[x];
        double ns = (now_s() - t0) * 1e9 / loads;
        printf("%zu %.2f %llu\n", bytes, ns, (unsigned long long)(x & 1));
        free(next);
    }
    return 0;
}
"""


def chase(exe: str, max_mib: float, loads: int) -> list[dict]:
    out = subprocess.run([exe, str(max_mib), str(loads)], capture_output=True, text=True, check=True, timeout=1800)
    rows = []
    for line in out.stdout.split("\n"):
        if line.strip():
            size, ns, _ = line.split()
            rows.append({"bytes": int(size), "kib": int(size) // 1024, "ns_per_load": float(ns)})
    return rows


def wheel_scalar(workdir: str) -> dict:
    """bench.wheel_core's compiled scalar ``wheel`` at 10k and 10M pending, by pending count."""
    out = os.path.join(workdir, "wheel_core")
    subprocess.run([sys.executable, "-m", "bench.wheel_core", "--impls", "wheel", "--sizes", "10000,10000000",
                    "--repeat", "2", "--runs", "1", "--output", out], check=True, timeout=3600,
                   cwd=Path(__file__).resolve().parent.parent)
    data = json.loads(Path(out + ".json").read_text())
    return {r["pending"]: r for r in data["results"] if r["impl"] == "wheel"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-mib", type=float, default=256.0, help="largest working set")
    ap.add_argument("--loads", type=int, default=20_000_000, help="dependent loads timed per size")
    ap.add_argument("--repeat", type=int, default=2, help="runs of the chase; the fastest per size is kept")
    ap.add_argument("--no-wheel", action="store_true", help="the chase only, no bench.wheel_core run")
    ap.add_argument("--out", default="miss_floor",
                    help="result name: writes NAME.json (into bench/runs/, or bench/results/ with --save)")
    add_save_option(ap)
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="wheeld-miss-floor-") as workdir:
        exe = compile_c(C_SOURCE, "miss_floor", workdir)
        runs = [chase(exe, args.max_mib, args.loads) for _ in range(args.repeat)]
        wheel = {} if args.no_wheel else wheel_scalar(workdir)
    rows = [min((run[i] for run in runs), key=lambda r: r["ns_per_load"]) for i in range(len(runs[0]))]
    for i, row in enumerate(rows):
        row["runs_ns"] = [run[i]["ns_per_load"] for run in runs]
    print(format_table(rows, ["kib", "ns_per_load"], ["working set KiB", "ns per dependent load"]))

    # the index's cell at 10M: a working set the size of its table
    at_index = [r for r in rows if r["bytes"] == INDEX_MIB_AT_10M * 1024 * 1024]
    miss_ns = at_index[0]["ns_per_load"] if at_index else None
    bound = None
    small, large = wheel.get(10_000), wheel.get(10_000_000)
    if miss_ns is not None and small and large:
        bound = {"ns_10k": round(small["insert_ns"], 1), "ns_10M": round(large["insert_ns"], 1),
                 "measured_ratio": round(large["insert_ns"] / small["insert_ns"], 2),
                 "expected_min_ratio": round((small["insert_ns"] + miss_ns) / small["insert_ns"], 2),
                 "target_ratio": TARGET_RATIO, "path": small.get("path")}
        print(f"\nscalar insert of a new key (compiled wheel, this run): {bound['ns_10k']} ns at 10k, "
              f"{bound['ns_10M']} ns at 10M ({bound['measured_ratio']}x); one access to memory at "
              f"{INDEX_MIB_AT_10M} MiB costs {miss_ns} ns; an insert at 10M waits for at least one (the key "
              f"index's cell, which everything after it depends on): about {bound['expected_min_ratio']}x 10k "
              f"(target {TARGET_RATIO}x)")
    path = write_json(args.out, {"loads": args.loads, "repeat": args.repeat, "rows": rows, "miss_ns": miss_ns,
                                 "index_mib_at_10m": INDEX_MIB_AT_10M, "insert": bound,
                                 "wheel_scalar": {str(k): v for k, v in wheel.items()}}, save=args.save)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
