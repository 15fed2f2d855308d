"""One incarnation of a chaos-test worker: python chaos_worker.py JSON_ARGS.

Works in batches: each batch adds new keys, re-arms keys of its own that were not
received yet, and cancels some, then flushes; it logs what the daemon
acknowledged (flush returned). It receives expirations and logs them, and logs
when a batch of expirations was acknowledged (pushed at the start of the next
poll). Runs until the stop file exists and every timer it knows of has been
received, or until it is killed.

``"hoard": true`` makes a worker whose application never polls: each batch only
adds new keys and flushes, and the expirations each flush reads off the socket
stay in the library's buffer until the test kills the process (a worker that
dies without polling). It stops adding once the stop file exists.

Log lines (one event each, appended, unbuffered; times are CLOCK_MONOTONIC ms):
    a <key> <deadline_ms>              an arming of key (an add or a re-arm) is pushed
    d <key> <deadline_ms>              ...its deadline, as add() returned it, when it differs
    x <key>                            a cancel is pushed (it reaches the daemon whatever it returns)
    c <key>                            ...and returned True
    A <key> <deadline_ms> <ack_ms>     ...that arming was acknowledged (flush returned)
    C <key> <ack_ms>                   ...that cancel was acknowledged
    R <key> <deadline_ms> <fired_ms> <recv_ms> <batch>
    K <batch> <ms>                     that batch of expirations acknowledged to the daemon
    F <seconds>                        a flush that raised Timeout, after that long
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


def ceil_ms() -> int:
    return -(-time.monotonic_ns() // 1_000_000)


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
            time.sleep(0.05)  # the daemon is down for a while: retry the connect


def main(args: dict) -> None:
    rng = random.Random(args["seed"])
    log = open(args["log"], "a", buffering=1)
    w = connect(args)
    seq = 0
    batch_no = 0
    pending_batch = None
    live: dict[str, int] = {}  # our keys armed and not received yet -> deadline of the latest arming
    flush_timeout_s = args.get("flush_timeout_s", 20)
    hoard = args.get("hoard", False)
    name = args.get("member", args["group"])
    while True:
        stopping = os.path.exists(args["stop"])
        if hoard and stopping:
            time.sleep(0.05)  # holds what it has read, never polls: the test kills it
            continue
        if not stopping:
            armed, cancelled = [], []
            for _ in range(args["batch"]):
                roll = 1.0 if hoard else rng.random()
                if live and roll < 0.15:  # re-arm one of ours
                    key = rng.choice(list(live))
                elif live and roll < 0.25:  # cancel one of ours
                    key = rng.choice(list(live))
                    log.write(f"x {key}\n")  # before: a kill must not hide a pushed cancel
                    if w.cancel(key):
                        log.write(f"c {key}\n")
                        cancelled.append(key)
                        del live[key]
                    continue
                else:
                    seq += 1
                    key = f"{name}-{args['incarnation']}-{seq}"
                delay = rng.randint(*args["delay_ms"])
                if key in live:  # a re-arm goes later than the arming it replaces: deadlines tell armings apart
                    delay = max(delay, live[key] - ceil_ms() + 50)
                predicted = ceil_ms() + delay
                log.write(f"a {key} {predicted}\n")  # before: a kill must not hide a pushed command
                deadline = w.add(key, delay)
                if deadline != predicted:
                    log.write(f"d {key} {deadline}\n")
                live[key] = deadline
                armed.append((key, deadline))
            started = time.monotonic()
            try:
                w.flush(timeout_s=flush_timeout_s)
            except wheeld.Timeout:  # not acknowledged, so not promised: they may or may not take effect
                log.write(f"F {time.monotonic() - started:.3f}\n")
                continue
            now = mono_ms()
            log.write("".join(f"A {k} {d} {now}\n" for k, d in armed) + "".join(f"C {k} {now}\n" for k in cancelled))
        if hoard:
            time.sleep(0.02)  # no poll: what the flushes read waits in the library's buffer
            continue
        got = w.poll(0.02)  # acknowledges the batch handed over before (pushes its acks)
        if pending_batch is not None and not w._acks_pending:  # logged only once really pushed
            log.write(f"K {pending_batch} {mono_ms()}\n")
            pending_batch = None
        if got:
            if pending_batch is not None:
                log.write(f"U {pending_batch}\n")  # its acks are still waiting for ring room
            batch_no += 1
            now = mono_ms()
            log.write("".join(f"R {e.key} {e.deadline_ms} {e.fired_ms} {now} {batch_no}\n" for e in got))
            for e in got:  # (a journal recovery may make a deadline later by a few ms)
                if 0 <= e.deadline_ms - live.get(e.key, e.deadline_ms + 99) <= 20:
                    del live[e.key]
            pending_batch = batch_no
        elif stopping and os.path.exists(args["stop"] + ".final"):
            break
    if pending_batch is not None:
        w.close()  # close() acknowledges the last batch
        log.write(f"K {pending_batch} {mono_ms()}\n")
    else:
        w.close()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
