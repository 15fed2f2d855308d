"""One incarnation of a chaos-test worker: python chaos_worker.py JSON_ARGS.

Adds timers in batches, flushes, and logs what the daemon acknowledged; receives
expirations and logs them; logs when a batch of expirations was acknowledged
(at the start of the next poll). Runs until the stop file exists and every
timer it knows of has been received, or until it is killed.

Log lines (one event each, appended, unbuffered):
    A <key> <min_deadline_ms> <ack_mono_ms>     the daemon applied this add (flush returned)
    R <key> <deadline_ms> <fired_ms> <recv_ms> <batch>
    K <batch>                                   batch acknowledged to the daemon
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

import wheeld


def mono_ms() -> int:
    return time.monotonic_ns() // 1_000_000


def connect(args: dict) -> wheeld.Client:
    """The first connect fails fast when nothing listens; this worker may be started
    while the chaos test has the daemon down, so it waits for it (60 s at most)."""
    end = time.monotonic() + 60
    while True:
        try:
            return wheeld.connect(args["socket"], group=args["group"], reconnect_timeout_s=60, connect_timeout_s=60,
                                  ring_timeout_s=30)
        except wheeld.DaemonNotRunning:
            if time.monotonic() > end:
                raise
            time.sleep(0.05)


def main(args: dict) -> None:
    rng = random.Random(args["seed"])
    log = open(args["log"], "a", buffering=1)
    w = connect(args)
    seq = 0
    batch_no = 0
    pending_batch = None
    while True:
        stopping = os.path.exists(args["stop"])
        if not stopping:
            keys = []
            for _ in range(args["batch"]):
                seq += 1
                key = f"{args['group']}-{args['incarnation']}-{seq}"
                delay = rng.randint(*args["delay_ms"])
                keys.append((key, mono_ms() + delay))
                w.add(key, delay)
            try:
                w.flush(timeout_s=30)
            except TimeoutError:
                continue  # not acknowledged: not logged, so not promised
            now = mono_ms()
            log.write("".join(f"A {k} {d} {now}\n" for k, d in keys))
        got = w.poll(0.02)  # acknowledges the batch handed over before (pushes its acks)
        if pending_batch is not None and not w._acks_pending:  # logged only once really pushed
            log.write(f"K {pending_batch}\n")
            pending_batch = None
        if got:
            if pending_batch is not None:
                log.write(f"U {pending_batch}\n")  # its acks are still waiting for ring room
            batch_no += 1
            now = mono_ms()
            log.write("".join(f"R {e.key} {e.deadline_ms} {e.fired_ms} {now} {batch_no}\n" for e in got))
            pending_batch = batch_no
        elif stopping and os.path.exists(args["stop"] + ".final"):
            break
    if pending_batch is not None:
        w.close()  # close() acknowledges the last batch
        log.write(f"K {pending_batch}\n")
    else:
        w.close()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
