"""The Python path against an earlier tree, in machine instructions per call (callgrind).

    python -m bench.python_path                      # ~5 min; table + bench/runs/python_path.json
                                                     # (--save: bench/results/)
    python -m bench.python_path --base 1c6bfd3 --ops 3000

Wall-clock figures of the interpreter swing 10-40% within minutes on the
project's shared 2-core machines, so whether a change made the Python path
(``WHEELD_PURE_PYTHON=1``, the ``.py`` sources that are the reference and the
fallback) slower by a few percent cannot be read off ``bench.wheel_core`` or
``bench.client_ops``. Instructions can: ``valgrind --tool=callgrind`` counts
the instructions a deterministic workload executes (the same count on a loaded
or a quiet machine), and this bench runs the same workload on this checkout and
on ``--base`` (default: ``1c6bfd3``, the tree before the hot path was compiled),
checked out into a temporary git worktree, in the same run. The count is not
exact to the instruction across trees: the same code counted in two trees moves by
up to ~5% per call (measured for the client's ``add_idle``), as where the
interpreter's objects land decides collisions in its type attribute cache and in
dicts keyed by object ids; read differences of a few percent with that in mind.

The workload (one child process per part and tree, ``PYTHONHASHSEED=0``):

* ``wheel``: a ``TimerWheel`` (tick 1 ms, 256 buckets, private memory) with
  ``--pending`` timers 1-2 h ahead, then ``--ops`` calls of each kind:
  ``schedule_ident`` of new keys 2-62 s ahead (insert), ``schedule_ident`` of
  the same keys again (re-arm), ``cancel_ident``, and ``--ops`` timers due within
  2 ms of a 300 ms deadline driven out by ``next_deadline``/``advance`` (expire,
  per timer).
* ``client``: ``ClientCore`` on a real ring and status page with no daemon (as
  ``bench.client_ops`` sets it up): ``add``, ``cancel``, ``add_idle``, ``touch``
  on ``--ops`` str keys.

Each kind of call runs inside one C builtin (``sorted``, ``min``, ``max``,
``any`` with the calls in a key function or generator) and callgrind collects
only inside those (``--toggle-collect``), so set-up, imports and the interpreter's
start are not counted. The table gives instructions per call for the base's
Python path, this tree's Python path and this tree's compiled path, and the
Python path's change. Needs ``valgrind`` (Debian: ``apt install valgrind``) and git.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import add_save_option, format_table, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_BASE = "1c6bfd3"  # the last commit before the hot path was compiled
#: the import package ``wheeld`` is assembled from these folders (pyproject.toml's package-dir)
PACKAGE_DIRS = {"shm": "shm", "protocol": "protocol", "daemon": "daemon"}
REGIONS = {"builtin_sorted": 0, "builtin_min": 1, "builtin_max": 2, "builtin_any": 3}
KINDS = {"wheel": ("insert", "re-arm", "cancel", "expire"), "client": ("add", "cancel", "add_idle", "touch")}

WORKLOAD = r'''
import os, random, sys
part, pending, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
from wheeld.protocol import accel

if part == "wheel":
    from wheeld.protocol.keys import TYPE_INT, key_meta_of
    from wheeld.shm import TimerWheel

    meta = bytes([key_meta_of(TYPE_INT, 8)])

    def ident(i):
        return meta + i.to_bytes(8, "little", signed=True) + bytes(24)

    rng = random.Random(1)
    wheel = TimerWheel.create(2 * (pending + 2 * n) + 1024, tick_ms=1, wheel_size=256)
    for i in range(pending):
        wheel.schedule_ident(ident(i), rng.randrange(3_600_000, 7_200_000))
    keys = [ident(10**9 + i) for i in range(n)]
    first = [rng.randrange(2_000, 62_000) for _ in range(n)]
    second = [rng.randrange(2_000, 62_000) for _ in range(n)]
    due = [ident(2 * 10**9 + i) for i in range(n)]
    due_at = [300 + rng.randrange(0, 2) for _ in range(n)]

    def insert(_):
        schedule = wheel.schedule_ident
        for key, deadline in zip(keys, first):
            schedule(key, deadline)

    def rearm(_):
        schedule = wheel.schedule_ident
        for key, deadline in zip(keys, second):
            schedule(key, deadline)

    def cancel(_):
        cancel_ident = wheel.cancel_ident
        for key in keys:
            cancel_ident(key)

    sorted([0], key=insert)
    min([0], key=rearm)
    max([0], key=cancel)
    for key, deadline in zip(due, due_at):
        wheel.schedule_ident(key, deadline)

    def expire():
        out = 0
        while (nd := wheel.next_deadline()) is not None and nd <= 400:
            out += len(wheel.advance(nd))
        yield out

    expired = []
    any(expired.append(x) for x in expire())
    assert expired == [n] and len(wheel) == pending, (expired, len(wheel))
else:
    from wheeld.core import ClientCore
    from wheeld.protocol import messages as M
    from wheeld.shm.ring import ClientSegment
    from wheeld.shm.status import StatusPage

    class Client(ClientCore):
        def __init__(self):
            super().__init__("/nonexistent/wheeld.sock", "bench", 5.0, 30.0, "bench")

        def _ring_doorbell(self, urgent=True):
            raise AssertionError("the daemon is awake: no doorbell")

    ring_capacity = 1 << 16
    assert 4 * n <= ring_capacity
    name = f"wheeld-bench-python-path-{os.getpid()}"
    consumer = ClientSegment.create(name, ring_capacity, 1 << 14)
    status = StatusPage.create(name + "-status")
    status.publish(1 << 40, 0, 0)
    client = Client()
    welcome = M.Welcome(M.PROTOCOL_VERSION, 1, name, ring_capacity, 1 << 14, "bench", 1, 1 << 40,
                        arena_epoch=7, status_page=True)
    client._on_welcome(welcome, [os.dup(consumer.fd), os.dup(status.readonly_fd)])
    keys = [f"conn-{i:06d}" for i in range(n)]
    idle = [f"idle-{i:06d}" for i in range(n)]
    for key in keys:  # the bookkeeping at its steady size: each key armed and cancelled once
        client.add(key, 60_000)
    for key in keys:
        client.cancel(key)
    consumer.drain()

    def add(_):
        add = client.add
        for key in keys:
            add(key, 60_000)

    def cancel(_):
        cancel = client.cancel
        for key in keys:
            cancel(key)

    def add_idle(_):
        add_idle = client.add_idle
        for key in idle:
            add_idle(key, 60_000)

    def touch():
        touch = client.touch
        for key in idle:
            touch(key)
        yield True

    sorted([0], key=add)
    min([0], key=cancel)
    consumer.drain()
    max([0], key=add_idle)
    any(touch())
    consumer.drain()
    client._closed = True
    client._release_local()
    consumer.close()
    status.close()
print(accel.implementation())
'''


def package_tree(source: Path, into: Path) -> Path:
    """A folder on which ``import wheeld`` finds ``source``'s modules, laid out as installed."""
    pkg = into / "wheeld"
    pkg.mkdir(parents=True)
    for entry in (source / "client").iterdir():
        (pkg / entry.name).symlink_to(entry)
    for name, folder in PACKAGE_DIRS.items():
        (pkg / name).symlink_to(source / folder)
    return into


def callgrind(part: str, env: dict, out: Path, pending: int, ops: int, script: Path) -> list[int]:
    """Instructions inside each region of one workload run."""
    toggles = [f"--toggle-collect={name}" for name in REGIONS]
    cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", *toggles, sys.executable, str(script),
           part, str(pending), str(ops)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600, check=False)
    if run.returncode != 0:
        raise RuntimeError(f"{part} workload failed:\n{run.stderr[-3000:]}")
    annotated = subprocess.run(["callgrind_annotate", "--inclusive=yes", str(out)], capture_output=True, text=True,
                               check=True).stdout
    counts = [0] * len(REGIONS)
    for line in annotated.splitlines():
        m = re.match(r"\s*([\d,]+)\s.*:(builtin_\w+) ", line)
        if m and m.group(2) in REGIONS:
            counts[REGIONS[m.group(2)]] = int(m.group(1).replace(",", ""))
    if not all(counts):
        raise RuntimeError(f"{part}: a region was not found in {out}: {counts}")
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default=DEFAULT_BASE, help="git revision to compare with (its Python path)")
    ap.add_argument("--ops", type=int, default=5000, help="calls of each kind")
    ap.add_argument("--pending", type=int, default=20_000, help="timers in the wheel before the calls")
    ap.add_argument("--out", default="python_path",
                    help="result name: writes NAME.json (into bench/runs/, or bench/results/ with --save)")
    add_save_option(ap)
    args = ap.parse_args(argv)
    for tool in ("valgrind", "callgrind_annotate", "git"):
        if shutil.which(tool) is None:
            sys.exit(f"python_path: needs {tool} (Debian: apt install valgrind git)")

    with tempfile.TemporaryDirectory(prefix="wheeld-python-path-") as tmp:
        tmp_path = Path(tmp)
        script = tmp_path / "workload.py"
        script.write_text(WORKLOAD)
        worktree = tmp_path / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(worktree), args.base],
                       check=True)
        try:
            base_commit = subprocess.run(["git", "-C", str(worktree), "rev-parse", "HEAD"], capture_output=True,
                                         text=True, check=True).stdout.strip()
            head_commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                                         text=True, check=True).stdout.strip()
            base_tree = package_tree(worktree, tmp_path / "base-pkg")
            env = {k: v for k, v in os.environ.items() if k not in ("WHEELD_PURE_PYTHON", "PYTHONPATH")}
            env["PYTHONHASHSEED"] = "0"
            trees = {
                "base python": {**env, "PYTHONPATH": str(base_tree)},
                "python": {**env, "WHEELD_PURE_PYTHON": "1"},
                "compiled": env,
            }
            jobs = {(tree, part): (part, tree_env, tmp_path / f"cg-{tree.replace(' ', '-')}-{part}", args.pending,
                                   args.ops, script)
                    for tree, tree_env in trees.items() for part in KINDS}
            with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
                futures = {key: pool.submit(callgrind, *job) for key, job in jobs.items()}
                counts = {key: f.result() for key, f in futures.items()}
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(worktree)], check=False)

    rows = []
    for part, kinds in KINDS.items():
        for i, kind in enumerate(kinds):
            per = {tree: counts[(tree, part)][i] / args.ops for tree in trees}
            rows.append({"part": part, "call": kind, "base": round(per["base python"]), "python": round(per["python"]),
                         "change": f"{(per['python'] / per['base python'] - 1) * 100:+.1f}%",
                         "compiled": round(per["compiled"])})
    print(format_table(rows, ["part", "call", "base", "python", "change", "compiled"],
                       ["part", "call", f"base {args.base} (python)", "this tree (python)", "python change",
                        "this tree (compiled)"]))
    print("\ninstructions per call (callgrind), the same workload on each tree")
    path = write_json(args.out, {"base": args.base, "base_commit": base_commit, "head_commit": head_commit,
                                 "ops": args.ops, "pending": args.pending, "unit": "instructions per call",
                                 "rows": rows}, save=args.save)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
