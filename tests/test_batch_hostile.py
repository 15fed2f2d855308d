"""The compiled batch loops on an arena that a hostile writer damages while the wheel is
attached (links, states and groups of live records overwritten with arbitrary values):
they may raise, never crash.

Each seed runs in a process of its own (``python -c``, the compiled path): the wheel is
filled, random link words, state bytes and group ids are overwritten, then every batch
method runs. A segfault shows in the exit status; a hang in the timeout. Exceptions are
expected (CorruptArena from the C loops, IndexError from a scalar path they call).
The Python path is not run: its numpy code follows damaged links without bounds.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from wheeld.protocol import accel

WORKER = r'''
import random, sys
import numpy as np
from wheeld.protocol import accel
from wheeld.protocol.errors import CorruptArena
from wheeld.shm import TimerWheel
from wheeld.shm.wheel import encode_ident

assert accel.compiled("wheeld.shm.wheel")
for seed in range(int(sys.argv[1]), int(sys.argv[2])):
    rng = random.Random(seed)
    w = TimerWheel.create(400, tick_ms=1, wheel_size=8, levels=3, start_ms=1000)
    try:
        keys = np.array([encode_ident(f"k{i}") for i in range(300)], dtype="S33").view("V33")
        w.schedule_many(keys, np.array([1000 + rng.randrange(-5, 600) for _ in range(300)]))
        fired = w.expire_many(1000 + rng.randrange(0, 100))
        rec, n = w.records, w.n_records
        for _ in range(rng.randrange(1, 12)):
            s = rng.randrange(n)
            field = rng.choice(["prev", "next", "prev", "next", "state", "group"])
            value = rng.choice([-1, -(2 ** 31), n, n + 5, 2 ** 31 - 1, rng.randrange(n), rng.randrange(w.first_entry)])
            if field == "state":
                value = rng.randrange(256)
            elif field == "group":
                value = rng.randrange(65536)
            rec[field][s] = value
        calls = [
            lambda: w.schedule_many(keys[rng.randrange(0, 200):][:80], np.full(80, 1000 + rng.randrange(0, 2000))),
            lambda: w.cancel_many(keys[rng.randrange(0, 300):][:60]),
            lambda: w.expire_many(1000 + rng.randrange(0, 5000)),
            lambda: w.release_many(fired, w.records_of(fired)["gen"]),
            lambda: w.records_of(np.arange(-n, n, dtype=np.int64)),
        ]
        for _ in range(8):
            try:
                rng.choice(calls)()
            except (CorruptArena, IndexError):
                pass
    finally:
        w.close()
print("ok")
'''


@pytest.mark.skipif(not accel.compiled("wheeld.shm.wheel") and accel.pure_python_requested(),
                    reason="the compiled path is not selected")
@pytest.mark.parametrize("first", [0, 150])
def test_batch_methods_survive_a_damaged_arena(first):
    env = dict(os.environ)
    env.pop(accel.PURE_ENV, None)
    done = subprocess.run([sys.executable, "-c", WORKER, str(first), str(first + 150)], env=env,
                          capture_output=True, text=True, timeout=300)
    if "AssertionError" in done.stderr and "accel.compiled" in done.stderr:
        pytest.skip("the extensions are not built")
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stderr[-3000:]}"
    assert done.stdout.strip() == "ok"
