"""A worker process for the end-to-end tests: python e2e_worker.py MODE JSON_ARGS OUT_FILE."""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time

import wheeld


def mono_ms() -> int:
    return time.monotonic_ns() // 1_000_000


def load(args: dict) -> dict:
    """Add, re-arm and cancel timers, then collect every expiration."""
    rng = random.Random(args["seed"])
    w = wheeld.connect(args["socket"], group=args["group"], connect_timeout_s=60)
    expected: dict[str, int] = {}
    cancelled: list[str] = []
    prefix = args["prefix"]
    lo, hi = args["delay_ms"]
    for i in range(args["n"]):
        key = f"{prefix}-{i}"
        delay = rng.randint(lo, hi)
        before = mono_ms()
        w.add(key, delay)
        expected[key] = before + delay  # the deadline is at least this
        roll = rng.random()
        if roll < 0.1:
            if w.cancel(key):
                cancelled.append(key)
                del expected[key]
        elif roll < 0.2:
            delay = rng.randint(lo, hi)
            before = mono_ms()
            w.add(key, delay)  # re-arm
            expected[key] = before + delay
    w.flush(timeout_s=120)  # generous: CI machines may be loaded
    received = []
    end = time.monotonic() + args.get("timeout_s", 90)
    while time.monotonic() < end and len(received) < len(expected):
        for e in w.poll(0.2):
            received.append([e.key, e.deadline_ms, e.fired_ms, mono_ms()])
    for e in w.poll(0.3):  # anything extra (a duplicate) would show up here
        received.append([e.key, e.deadline_ms, e.fired_ms, mono_ms()])
    w.close()
    return {"expected": expected, "cancelled": cancelled, "received": received}


def add_and_die(args: dict) -> dict:
    """Add timers, receive the first expirations, then die by SIGKILL without acknowledging."""
    w = wheeld.connect(args["socket"], group=args["group"])
    for i in range(args["n"]):
        w.add(f"{args['prefix']}-{i}", args["delay_ms"])
    w.flush()
    got = []
    while not got:
        got = w.poll(5)
    with open(args["out"], "w") as f:
        json.dump({"received": [e.key for e in got]}, f)
    os.kill(os.getpid(), signal.SIGKILL)
    return {}


if __name__ == "__main__":
    mode, raw, out = sys.argv[1], sys.argv[2], sys.argv[3]
    args = json.loads(raw)
    args["out"] = out
    result = {"load": load, "add_and_die": add_and_die}[mode](args)
    with open(out, "w") as f:
        json.dump(result, f)
