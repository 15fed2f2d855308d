"""Attach damaged arenas on whichever hot path this process runs; print what happened.

    python tests/corrupt_arena_worker.py SEED COUNT

For each of COUNT seeds from SEED: a small named arena gets timers (scheduled,
fired, some re-armed), is closed, then damaged: random bytes of the header's
fixed part, of the intent, of the records (links, states, keys, deadlines,
group ids) are overwritten. Then it is attached, and, when the attach accepts
it, checked and used (advance, schedule, cancel). One JSON line per seed: the
exception class that refused it, or the repairs and what the use returned.
A segfault ends the process: the test sees the signal in the exit status.
"""

from __future__ import annotations

import json
import os
import random
import sys

from wheeld.protocol import arena_layout as L
from wheeld.protocol.errors import WheeldError
from wheeld.shm import TimerWheel
from wheeld.shm.arena import Segment, unlink
from wheeld.shm.wheel import encode_ident


def build(name: str, rng: random.Random) -> None:
    wheel = TimerWheel.create(96, tick_ms=1, wheel_size=8, levels=3, name=name, start_ms=1000, max_groups=4)
    try:
        for i in range(rng.randint(5, 40)):
            wheel.schedule_ident(encode_ident(f"k{i}"), 1000 + rng.randint(-5, 5000), rng.randint(0, 1), i)
        wheel.expire(1000 + rng.randint(0, 300))
        for i in range(0, 40, 3):
            wheel.schedule_ident(encode_ident(f"k{i}"), 1000 + rng.randint(0, 9000), 0, 7)
    finally:
        wheel.close()


def damage(name: str, rng: random.Random) -> list[tuple[int, int]]:
    seg = Segment.attach(name)
    try:
        buf = seg.buf
        header = L.header_bytes(4)
        writes = []
        for _ in range(rng.randint(1, 12)):
            where = rng.random()
            if where < 0.2:
                offset = rng.randrange(0, 64)  # the fixed header: shape, clock, free head
            elif where < 0.35:
                offset = rng.randrange(L.H_INTENT_SLOT, L.H_INTENT_COUNT + 4)  # the intent
            else:
                offset = rng.randrange(header, seg.size)  # records: links, states, keys, deadlines, groups
            value = rng.choice([0, 0xFF, 0x7F, 0x80, rng.randrange(256)])
            buf[offset] = value
            writes.append((offset, value))
        return writes
    finally:
        seg.close()


def use(wheel: TimerWheel, rng: random.Random) -> list:
    out = [wheel.check(), len(wheel), wheel.current_ms]
    for _ in range(20):
        op = rng.random()
        try:
            if op < 0.4:
                out.append(wheel.schedule_ident(encode_ident(f"n{rng.randrange(60)}"),
                                                wheel.current_ms + rng.randint(0, 9000)))
            elif op < 0.7:
                out.append(wheel.cancel_ident(encode_ident(f"k{rng.randrange(40)}"), rng.randint(0, 1)))
            else:
                out.append([list(map(repr, item)) for item in wheel.advance(wheel.current_ms + rng.randint(0, 3000))])
        except WheeldError as error:
            out.append(type(error).__name__)
    out.append(wheel.check())
    return out


def main(seed: int, count: int) -> None:
    for n in range(seed, seed + count):
        rng = random.Random(n)
        name = f"/wheeld-corrupt-{os.getpid()}-{n}"
        try:
            build(name, rng)
            writes = damage(name, rng)
            try:
                wheel = TimerWheel.attach(name)
            except WheeldError as error:
                result = {"refused": type(error).__name__}
            else:
                try:
                    result = {"repairs": len(wheel.repairs), "use": use(wheel, rng)}
                finally:
                    wheel.close()
        finally:
            unlink(name)
        print(json.dumps({"seed": n, "writes": writes, **result}), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
