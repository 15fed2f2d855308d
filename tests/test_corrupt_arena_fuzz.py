"""Damaged arenas, attached on both hot paths (``tests/corrupt_arena_worker.py``).

Each path runs the same seeds in a process of its own: random bytes of the
header, the intent and the records are overwritten, the arena is attached and,
if accepted, checked and used. Neither path may die (a segfault shows in the
exit status) or raise anything but wheeld's own exceptions; an accepted arena
checks sound before and after use; and the two paths must tell the same story,
seed by seed (refused with the same exception, or the same repairs and the
same results).

The ``slow`` twin (``make test-long``) runs ten times as many seeds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from wheeld.protocol import accel

WORKER = Path(__file__).with_name("corrupt_arena_worker.py")


def _run(pure: bool, seed: int, count: int) -> list[dict]:
    env = dict(os.environ, PYTHONHASHSEED="0", **{accel.PURE_ENV: "1" if pure else "0"})
    done = subprocess.run([sys.executable, str(WORKER), str(seed), str(count)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, (f"exit {done.returncode} on the {'Python' if pure else 'default'} path:\n"
                                  f"{done.stderr[-4000:]}")
    return [json.loads(line) for line in done.stdout.splitlines()]


def _fuzz(seed: int, count: int) -> None:
    default, pure = _run(False, seed, count), _run(True, seed, count)
    assert len(default) == len(pure) == count
    for a, b in zip(default, pure):
        assert a == b, f"seed {a['seed']}: the paths differ:\n{a}\n{b}"
        if "use" in a:
            assert a["use"][0] == [] and a["use"][-1] == [], a
    refused = sum("refused" in a for a in default)
    assert 0 < refused < count, "the damage must sometimes be refused and sometimes repaired or harmless"


def test_damaged_arenas_are_refused_or_repaired_alike_on_both_paths():
    _fuzz(seed=int(os.environ.get("WHEELD_FUZZ_SEED", "0")), count=300)


@pytest.mark.slow
def test_damaged_arenas_are_refused_or_repaired_alike_on_both_paths_long():
    _fuzz(seed=100_000, count=3000)
