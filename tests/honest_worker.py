"""The honest client of the hostile-input tests: python honest_worker.py JSON_ARGS STATUS_FILE.

It keeps adding timers (random delays, paced) and receiving them until a line
arrives on its stdin (or stdin closes), then stops adding, waits for every timer
it added and writes its verdict to STATUS_FILE. While it runs, STATUS_FILE holds
its progress (``added``, ``delivered``), rewritten a few times a second, so a
test can wait until it was served *during* an attack.

What it checks, per timer: delivered exactly once, never early (the time of
delivery is at least the delay after ``time.monotonic_ns()`` read just before
the ``add`` call, and ``fired_ms >= deadline_ms``), and it records how late the
daemon fired it (``fired_ms - deadline_ms``). Every WheeldError a call raised is
recorded; the honest client must see none, except a ``flush()`` failing with one
of the classes named in ``tolerate`` (e.g. ``JournalUnavailable`` while a test
keeps the daemon's journal from being written): those are counted in
``tolerated``, and every timer must still arrive.
"""

from __future__ import annotations

import json
import os
import random
import select
import sys
import time

import wheeld


def _write(path: str, state: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(state, f)
    os.replace(tmp, path)


def main(args: dict, status_path: str) -> None:
    rng = random.Random(args.get("seed", 0))
    rate = args.get("rate", 200)  # timers added per second
    lo, hi = args.get("delay_ms", [1, 250])
    client = wheeld.connect(args["socket"], group=args.get("group", "honest"), connect_timeout_s=30,
                            reconnect_timeout_s=60)
    added: dict[str, tuple[int, int]] = {}  # key -> (monotonic ns read before add, delay ms)
    delivered: dict[str, int] = {}  # key -> times delivered
    early: list = []
    errors: list[str] = []
    tolerate = tuple(getattr(wheeld, name) for name in args.get("tolerate", ()))
    tolerated: list[str] = []
    max_late_ms = 0  # fired_ms - deadline_ms, as the daemon saw it
    max_client_late_ms = 0.0  # time of delivery - (add time + delay), as this process saw it
    started = time.monotonic()
    last_status = 0.0
    last_flush = started
    stop = False

    def receive(timeout_s: float) -> None:
        nonlocal max_late_ms, max_client_late_ms
        try:
            got = client.poll(timeout_s)
        except wheeld.WheeldError as exc:
            errors.append(f"poll: {type(exc).__name__}: {exc}")
            return
        now_ns = time.monotonic_ns()
        for e in got:
            delivered[e.key] = delivered.get(e.key, 0) + 1
            t0, delay = added.get(e.key, (None, None))
            if t0 is None:
                early.append([e.key, "never added"])
                continue
            if now_ns - t0 < delay * 1_000_000 or e.fired_ms < e.deadline_ms:
                early.append([e.key, delay, (now_ns - t0) / 1e6, e.deadline_ms, e.fired_ms])
            max_late_ms = max(max_late_ms, e.fired_ms - e.deadline_ms)
            max_client_late_ms = max(max_client_late_ms, (now_ns - t0) / 1e6 - delay)

    def status(done: bool = False) -> None:
        state = {"pid": os.getpid(), "added": len(added), "delivered": sum(delivered.values()),
                 "errors": errors[:20], "tolerated": len(tolerated), "done": done}
        if done:
            state.update(
                missing=sorted(set(added) - set(delivered))[:50],
                missing_count=len(set(added) - set(delivered)),
                duplicates=sorted(k for k, n in delivered.items() if n > 1)[:50],
                early=early[:50],
                max_late_ms=max_late_ms,
                max_client_late_ms=round(max_client_late_ms, 3),
            )
        _write(status_path, state)

    n = 0
    while not stop:
        now = time.monotonic()
        due = int((now - started) * rate) - n
        for _ in range(min(due, 50)):
            key = f"h{n}"
            delay = rng.randint(lo, hi)
            t0 = time.monotonic_ns()
            try:
                client.add(key, delay)
                added[key] = (t0, delay)
            except wheeld.WheeldError as exc:
                errors.append(f"add: {type(exc).__name__}: {exc}")
            n += 1
        if now - last_flush >= 1.0:  # rejections (ArenaFull, QuotaExceeded...) surface here
            last_flush = now
            try:
                client.flush(timeout_s=20)
            except tolerate as exc:
                tolerated.append(f"flush: {type(exc).__name__}: {exc}")
            except wheeld.WheeldError as exc:
                errors.append(f"flush: {type(exc).__name__}: {exc}")
        receive(0.005)
        if now - last_status >= 0.1:
            last_status = now
            status()
        if select.select([sys.stdin], [], [], 0)[0]:
            stop = True
    try:
        client.flush(timeout_s=20)
    except wheeld.WheeldError as exc:
        errors.append(f"flush: {type(exc).__name__}: {exc}")
    end = time.monotonic() + hi / 1000 + args.get("drain_s", 20)
    while time.monotonic() < end and set(added) - set(delivered):
        receive(0.1)
    receive(0.3)  # a duplicate would show up here
    client.close()
    status(done=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), sys.argv[2])
