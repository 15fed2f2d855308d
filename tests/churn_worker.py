"""Attackers of another uid: python churn_worker.py JSON_ARGS, started as root.

It imports all it needs while it is root, then becomes ``uid`` (gid the same, no
supplementary groups) in the same process: the interpreter running the tests may
live where another uid cannot read it (a pyenv under /root), so neither
``subprocess.Popen(user=...)`` nor an import after the change would work (see
tests/layout_roles.py). Then it runs ``code`` (a snippet with ``ARGS``, printing
its result as the last JSON line), or else the churn.

The churn, seeded, plays three kinds of session in a random order against one
daemon and prints its tally as one JSON line at the end:

* **answer floods**: a ring filled with commands the daemon answers (ADDs with
  deadlines it refuses, FLUSHes, ACKs of records that are not the client's),
  its tail re-published over the same records as fast as the daemon drains
  them, while the session reads a random trickle of the answers, or nothing;
* **slot churn**: sessions that arm idle timers (up to ~24.8 days), touch some
  and leave with a Bye, without one (the socket shut, as a crash leaves it), or
  stay open for a while, several at once, so that the uid's slot bound is met;
* **group churn**: sessions in group names drawn from a pool larger than the
  uid's group bound, arming plain timers (short or an hour) and cancelling some.

Refusals the bounds make (``BackPressure`` for slots, ``GroupLimit`` for groups,
``RingFull`` for a ring the daemon holds back) are counted, not errors; any
other WheeldError is recorded as an error, and the worker exits 1 on one.
"""

from __future__ import annotations

import json
import os
import pkgutil
import random
import socket
import sys
import time

import msgspec  # noqa: F401
import numpy  # noqa: F401

import wheeld
import wheeld.protocol
import wheeld.shm
from wheeld.protocol import commands as C
from wheeld.protocol import messages as M
from wheeld.protocol import ring_layout as RL
from wheeld.protocol.keys import encode_key

LONG_IDLE_MS = 2**31 - 1


class Churn:
    def __init__(self, args: dict):
        self.socket_path = args["socket"]
        self.rng = random.Random(args["seed"])
        self.prefix = args["prefix"]
        self.group_pool = args["group_pool"]
        self.tally = {"flood_sessions": 0, "flooded_records": 0, "trickle_bytes": 0, "slot_sessions": 0,
                      "idle_timers": 0, "left_with_bye": 0, "left_without_bye": 0, "group_sessions": 0,
                      "group_timers": 0, "refused_slots": 0, "refused_groups": 0, "ring_full": 0, "errors": []}
        self.open: list = []  # slot-churn sessions kept open for a while

    def connect(self, group: str):
        try:
            return wheeld.connect(self.socket_path, group=group, connect_timeout_s=30, ring_timeout_s=2)
        except wheeld.GroupLimit:
            self.tally["refused_groups"] += 1
        except wheeld.BackPressure:
            self.tally["refused_slots"] += 1
        return None

    @staticmethod
    def leave(client, bye: bool) -> None:
        """End a session with the library's close (Bye) or as a crash would (no Bye)."""
        if bye:
            try:
                client.close()
            except wheeld.WheeldError:
                pass
            return
        try:
            client._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        client._closed = True
        client._sock.close()
        client._sock = None
        client._release_local()

    # ------------------------------------------------------------------ answer floods
    def flood(self) -> None:
        rng = self.rng
        client = self.connect(f"{self.prefix}-flood")
        if client is None:
            return
        self.tally["flood_sessions"] += 1
        seg = client._segment
        capacity = seg.ring_capacity
        epoch = client._welcome.arena_epoch
        for i in range(capacity):
            kind = rng.random()
            if kind < 0.6:
                kb, meta = encode_key(rng.randbytes(rng.randint(1, 32)))
                record = C.encode_add(kb, meta, rng.choice([2**62, -(2**62), 2**63 - 1, -(2**63)]), i + 1)
            elif kind < 0.8:
                record = C.encode_flush(i + 1)
            else:
                record = C.encode_ack(rng.randint(0, 1 << 20), rng.randint(0, 100), rng.choice([0, epoch]))
            assert seg.try_push_record(record)
        sock = client._sock
        sock.setblocking(False)
        trickle = rng.choice([0, 0, 4096, 65536, 1 << 20])
        every_s = rng.choice([0.01, 0.1, 0.5])
        end = time.monotonic() + rng.uniform(0.1, 1.0)
        last_read = time.monotonic()
        try:
            while time.monotonic() < end:
                head = seg._words[RL.HEAD_WORD]
                if seg._tail < head + capacity:
                    self.tally["flooded_records"] += head + capacity - seg._tail
                    seg._tail = seg._words[RL.TAIL_WORD] = head + capacity  # publish the tail
                    sock.send(M.encode_client_frame(M.Doorbell(urgent=True)))
                if trickle and time.monotonic() - last_read >= every_s:
                    last_read = time.monotonic()
                    try:
                        data = sock.recv(trickle)
                    except BlockingIOError:
                        data = None
                    if data == b"":
                        break
                    self.tally["trickle_bytes"] += len(data or b"")
                time.sleep(0.001)
        except OSError:
            pass  # the daemon ended the session (its unread answers)
        sock.setblocking(True)
        self.leave(client, rng.random() < 0.5)

    # ------------------------------------------------------------------ slot churn
    def slots(self) -> None:
        rng = self.rng
        client = self.connect(f"{self.prefix}-idle")
        if client is None:
            self.settle_open(rng.randint(1, 3))
            return
        self.tally["slot_sessions"] += 1
        keys = [f"s{self.tally['slot_sessions']}-{i}" for i in range(rng.randint(1, 20))]
        try:
            for key in keys:
                client.add_idle(key, rng.choice([LONG_IDLE_MS, rng.randint(50, 3000)]))
                self.tally["idle_timers"] += 1
            client.flush()
            for key in rng.sample(keys, rng.randint(0, len(keys))):
                client.touch(key)
        except wheeld.RingFull:
            self.tally["ring_full"] += 1
        self.open.append(client)
        if len(self.open) > rng.randint(4, 30):
            self.settle_open(rng.randint(1, len(self.open)))

    def settle_open(self, count: int) -> None:
        rng = self.rng
        for _ in range(min(count, len(self.open))):
            client = self.open.pop(rng.randrange(len(self.open)))
            bye = rng.random() < 0.5
            self.tally["left_with_bye" if bye else "left_without_bye"] += 1
            self.leave(client, bye)

    # ------------------------------------------------------------------ group churn
    def groups(self) -> None:
        rng = self.rng
        client = self.connect(f"{self.prefix}-g{rng.randrange(self.group_pool)}")
        if client is None:
            return
        self.tally["group_sessions"] += 1
        keys = [f"g{i}" for i in range(rng.randint(1, 10))]
        for key in keys:
            client.add(key, rng.choice([rng.randint(1, 500), 3_600_000]))
            self.tally["group_timers"] += 1
        for key in rng.sample(keys, rng.randint(0, len(keys))):
            client.cancel(key)
        client.flush()
        end = time.monotonic() + rng.uniform(0, 0.2)
        while time.monotonic() < end:
            client.poll(0.02)
        self.leave(client, rng.random() < 0.7)

    def run(self, seconds: float) -> dict:
        rng = self.rng
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            action = rng.choices([self.flood, self.slots, self.groups], [1, 5, 5])[0]
            try:
                action()
            except wheeld.WheeldError as exc:
                self.tally["errors"].append(f"{action.__name__}: {type(exc).__name__}: {exc}")
                if len(self.tally["errors"]) > 20:
                    break
        self.settle_open(len(self.open))
        return self.tally


def become(uid: int) -> None:
    """Import what the client may load lazily, then take ``uid`` for good."""
    for package in (wheeld, wheeld.protocol, wheeld.shm):
        for module in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
            __import__(module.name)
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


def main() -> int:
    args = json.loads(sys.argv[1])
    become(args["uid"])
    if "code" in args:
        exec(compile(args["code"], "<snippet>", "exec"), {"ARGS": args, "json": json, "wheeld": wheeld, "os": os,
                                                        "socket": socket, "time": time})
        return 0
    tally = Churn(args).run(args["seconds"])
    print(json.dumps(tally))
    return 1 if tally["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
