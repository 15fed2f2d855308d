"""Random input against one real daemon, an honest client served throughout.

Seeded (``random.Random(seed)``): ring records, touch-table values and socket
frames from short-lived attacking sessions, while an honest client process
(``honest_worker.py``) adds and receives timers. The daemon must never exit, its
RSS must stay under ``RSS_GROWTH_BOUND_KB`` above what it was after start-up,
and every honest timer must be delivered exactly once, never early, and at most
``LATE_BOUND_MS`` after its deadline as the daemon fired it.

What the attackers send:

* **ring records**, pushed straight into an attacker's ring: most sessions are
  *clean* (every record well-formed, checked with ``validate_records`` before it
  is pushed: random ops, random valid keys, deadlines across the whole int64
  range (:meth:`Fuzzer.deadline`: near now, as far past and as far ahead as
  accepted, which overflow a naive lateness sum, every range check's edges),
  random touch indices, acks of random (slot, generation), flushes);
  the others are *dirty*: well-formed records, then one that is not (random
  bytes, a flipped check bit, a random op or field with a correct check word),
  after which the daemon drops the client and reads nothing more from that ring;
* **touch-table values**: random last-touch and idle words (0, near now, far in
  the future, negative, 2**62...) at random indices of an attacker's table, read
  when its idle timers come due;
* **socket frames**: before and after a Hello, random bytes, frames with random
  msgpack bodies (tagged like real messages or not), doorbells, announced
  lengths beyond the 4 KiB limit.

A drainer joins a random attacked group now and then and acknowledges what
fired there, and ``--group-quota`` bounds what the attacked groups can hold.

The CI version pushes 200,000 records and 6,000 frames (12-16 s on a 2-core
machine); ``@pytest.mark.slow`` (``make test-long``) pushes 1,000,000 records and
30,000 frames (~75 s). The inputs follow from the seed; where a session stops
(the daemon dropping it, an idle timer reading its touch table) depends on timing.
"""

from __future__ import annotations

import os
import random
import select
import struct
import time

import msgspec
import pytest
from daemon_harness import wait_until

import wheeld
from hostile_harness import Honest, Raw, counters, rss_kb
from wheeld.protocol import commands as C
from wheeld.protocol import framing
from wheeld.protocol import messages as M
from wheeld.protocol import ring_layout as RL
from wheeld.protocol.errors import WheeldError
from wheeld.protocol.keys import encode_key
from wheeld.daemon.sessions import CLIENT_MAX_DELAY_MS
from wheeld.protocol import arena_layout as AL
from wheeld.shm import check as CK
from wheeld.shm import reader as R
from wheeld.shm.wheel import MAX_CLOCK_MS, MAX_DELAY_MS

RING_CAPACITY = 1024
TOUCH_CAPACITY = 1024
CAPACITY = 300_000
GROUP_QUOTA = 20_000
GROUPS = 8
#: the daemon's RSS may grow this much above its level after start-up (it maps a 19 MB
#: arena; every attacking session costs it a few pages of ring and its Python objects)
RSS_GROWTH_BOUND_KB = 64 * 1024
#: how late (fired_ms - deadline_ms) the daemon may fire an honest timer during the fuzz
LATE_BOUND_MS = 1000


def now_ms() -> int:
    return time.monotonic_ns() // 1_000_000


class Fuzzer:
    def __init__(self, d, seed: int):
        self.d = d
        self.rng = random.Random(seed)
        self.stats = {"records": 0, "sessions": 0, "dirty": 0, "touch_writes": 0, "frames": 0, "connections": 0,
                      "drains": 0}
        self.epoch = 0
        self.idle_indices: list[int] = []  # touch indices the current session's ADD_IDLEs use
        self.rss_peak_kb = 0

    # ------------------------------------------------------------------ records
    def key(self) -> tuple[bytes, int]:
        rng = self.rng
        kind = rng.random()
        if kind < 0.4:
            return encode_key("".join(rng.choice("abcxyz0189é€😀") for _ in range(rng.randint(1, 8))))
        if kind < 0.7:
            return encode_key(rng.randbytes(rng.randint(1, 32)))
        return encode_key(rng.randint(-(2**63), 2**63 - 1))

    def deadline(self) -> int:
        """Deadlines across the whole int64 range: mostly near now, then as far in the past
        as the daemon accepts (each such expiration adds ~7e16 us of naive lateness: a
        hundred and thirty of them overflow an int64 sum), as far in the future, every
        boundary of every range check (the wheel's +-MAX_DELAY_MS around its clock, the
        client's advertised maximum, the 64-bit extremes the wheel refuses outright), and
        log-uniform and uniform values of either sign."""
        rng = self.rng
        roll = rng.random()
        now = now_ms()
        if roll < 0.7:
            return now + rng.randint(0, 3000)
        if roll < 0.74:
            return now - rng.randint(0, 10**6)
        if roll < 0.82:  # accepted, ~2230 years ago: fires at once (the daemon's clock lags by < 1 s)
            return now - MAX_DELAY_MS + rng.randint(1000, 60_000)
        if roll < 0.85:  # accepted, ~2230 years ahead: stays pending
            return now + MAX_DELAY_MS - rng.randint(1000, 60_000)
        if roll < 0.9:  # the edges of every range check, either side
            edge = rng.choice([now - MAX_DELAY_MS, now + MAX_DELAY_MS, now + CLIENT_MAX_DELAY_MS,
                               MAX_CLOCK_MS + MAX_DELAY_MS, -(MAX_CLOCK_MS + MAX_DELAY_MS), MAX_CLOCK_MS,
                               -MAX_CLOCK_MS, 2**63 - 1, -(2**63), 0])
            return max(-(2**63), min(2**63 - 1, edge + rng.choice([-1001, -1, 0, 1, 1001])))
        if roll < 0.95:
            return rng.choice([1, -1]) * min(int(2 ** rng.uniform(0, 63)), 2**63 - 1)
        return rng.randint(-(2**63), 2**63 - 1)

    def well_formed(self, keys: list) -> bytes:
        rng = self.rng
        op = rng.choices([C.ADD, C.ADD_IDLE, C.CANCEL, C.ACK, C.FLUSH], [45, 15, 20, 15, 5])[0]
        seq = rng.randint(0, C.SEQ_MAX)
        if op in (C.ADD, C.ADD_IDLE, C.CANCEL):
            kb, meta = rng.choice(keys) if keys and rng.random() < 0.5 else self.key()
            keys.append((kb, meta))
            if op == C.ADD:
                return C.encode_add(kb, meta, self.deadline(), seq)
            if op == C.CANCEL:
                return C.encode_cancel(kb, meta, seq)
            idle = rng.choice([rng.randint(1, 5000), C.I32_MAX, 1])
            index = rng.randrange(TOUCH_CAPACITY)
            self.idle_indices.append(index)
            return C.encode_add_idle(kb, meta, self.deadline(), idle, index, seq)
        if op == C.ACK:
            return C.encode_ack(rng.randint(0, 2 * CAPACITY), rng.randint(-5, 20),
                                rng.choice([0, self.epoch, rng.randint(0, C.SEQ_MAX)]))
        return C.encode_flush(seq)

    def garbage(self, keys: list) -> bytes:
        rng = self.rng
        roll = rng.random()
        if roll < 0.3:
            return rng.randbytes(64)
        if roll < 0.6:
            record = bytearray(self.well_formed(keys))
            bit = rng.randrange(64 * 8)
            record[bit // 8] ^= 1 << (bit % 8)
            return bytes(record)
        while True:  # random op and fields with a correct check word
            kb = rng.randbytes(rng.randint(0, 32))
            try:
                return C.encode_command(rng.randrange(256), kb, rng.randrange(256), rng.randint(-(2**63), 2**63 - 1),
                                        rng.randint(0, C.SEQ_MAX), rng.randint(C.I32_MIN, C.I32_MAX),
                                        rng.randint(C.I32_MIN, C.I32_MAX))
            except WheeldError:
                continue

    def ring_session(self, count: int) -> None:
        rng = self.rng
        group = f"fuzz{rng.randrange(GROUPS)}"
        client = wheeld.connect(self.d.socket_path, group=group, connect_timeout_s=30)
        self.epoch = client._welcome.arena_epoch
        seg = client._segment
        dirty_at = rng.randrange(count) if rng.random() < 0.25 else None
        keys: list = []
        self.idle_indices = []
        records = []
        for i in range(count):
            if i == dirty_at:
                record = self.garbage(keys)
            else:
                record = self.well_formed(keys)
                assert C.validate_records(C.records_from_buffer(record), TOUCH_CAPACITY)[0]
            records.append(record)
        for _ in range(rng.randint(0, 40)):  # mostly where this session's idle timers look
            index = rng.choice(self.idle_indices) if self.idle_indices and rng.random() < 0.8 \
                else rng.randrange(TOUCH_CAPACITY)
            seg._last_touch[index] = rng.choice([0, now_ms(), now_ms() - rng.randint(0, 10**6), now_ms() + 10**7,
                                                 -rng.randint(1, 2**62), 2**62, rng.randint(-(2**63), 2**63 - 1)])
            seg._idle[index] = rng.choice([0, rng.randint(1, 5000), C.I32_MAX, C.I32_MAX + 1, -1, 2**62,
                                           rng.randint(-(2**63), 2**63 - 1)])
            self.stats["touch_writes"] += 1
        dropped = False
        for record in records:
            while not dropped and not seg.try_push_record(record):
                client._ring_doorbell()
                dropped = self._dropped(client, 0.001)
            if dropped:
                break
            self.stats["records"] += 1
        client._ring_doorbell()
        end = time.monotonic() + 10
        while not dropped and seg._words[RL.HEAD_WORD] != seg._tail and time.monotonic() < end:
            dropped = self._dropped(client, 0.005)
        if dirty_at is not None:
            self.stats["dirty"] += 1
            end = time.monotonic() + 10
            while not dropped and time.monotonic() < end:
                dropped = self._dropped(client, 0.01)
            assert dropped, "a ring with garbage was not refused"
        self.stats["sessions"] += 1
        client._closed = True  # not the library's close: no acks, no Bye (half of them)
        if not dropped and rng.random() < 0.5:
            try:
                client._sock.sendall(M.encode_client_frame(M.Bye()))
            except OSError:
                pass  # dropped meanwhile (its touch table, read when an idle timer came due)
        client._sock.close()
        client._sock = None
        client._release_local()

    @staticmethod
    def _dropped(client, timeout_s: float) -> bool:
        """Has the daemon closed this attacker's session? (reads and drops what it sent)"""
        sock = client._sock
        while select.select([sock], [], [], timeout_s)[0]:
            try:
                if not sock.recv(1 << 20):
                    return True
            except (BlockingIOError, InterruptedError):
                return False
            except OSError:
                return True
            timeout_s = 0
        return False

    # ------------------------------------------------------------------ frames
    def value(self, depth: int = 0):
        rng = self.rng
        kinds = ["int", "str", "bytes", "none", "bool", "float"] + (["list", "dict"] if depth < 3 else [])
        kind = rng.choice(kinds)
        if kind == "int":
            return rng.choice([rng.randint(-(2**63), 2**64 - 1), rng.randint(-5, 300), M.PROTOCOL_VERSION])
        if kind == "str":
            return rng.choice(["hello", "doorbell", "bye", "welcome", "expirations", "",
                               "".join(rng.choice("ab€\0") for _ in range(rng.randint(0, 300)))])
        if kind == "bytes":
            return rng.randbytes(rng.randint(0, 100))
        if kind == "none":
            return None
        if kind == "bool":
            return rng.random() < 0.5
        if kind == "float":
            return rng.choice([rng.random(), float("nan"), float("inf"), -1e300])
        if kind == "list":
            return [self.value(depth + 1) for _ in range(rng.randint(0, 8))]
        return {str(self.value(depth + 1)): self.value(depth + 1) for _ in range(rng.randint(0, 4))}

    def frame(self) -> bytes:
        rng = self.rng
        roll = rng.random()
        if roll < 0.15:
            return rng.randbytes(rng.randint(1, 200))
        if roll < 0.25:
            return M.encode_client_frame(M.Doorbell(urgent=rng.random() < 0.5))
        if roll < 0.3:
            return framing.HEADER.pack(rng.choice([4097, 1 << 20, framing.MAX_FRAME, 2**32 - 1])) + rng.randbytes(8)
        if roll < 0.6:  # shaped like a real message: a tag, then random fields
            body = ([rng.choice(["hello", "doorbell", "bye", "hell0"])]
                    + [self.value(1) for _ in range(rng.randint(0, 7))])
        else:
            body = self.value()
        encoded = msgspec.msgpack.encode(body)
        return framing.encode_frame(encoded[:4000])

    def socket_session(self) -> None:
        rng = self.rng
        raw = Raw(self.d.socket_path, timeout_s=5)
        self.stats["connections"] += 1
        try:
            if rng.random() < 0.5:
                welcome, fds = raw.hello(f"fuzz{rng.randrange(GROUPS)}")
                for fd in fds:
                    os.close(fd)
                assert isinstance(welcome, M.Welcome), welcome
            for _ in range(rng.randint(1, 12)):
                try:
                    raw.sock.sendall(self.frame())
                except OSError:
                    break  # the daemon closed it (a frame it refused)
                self.stats["frames"] += 1
        finally:
            raw.close()

    # ------------------------------------------------------------------ drainer
    def drain(self) -> None:
        """A well-behaved member of an attacked group receives and acknowledges for a moment."""
        group = f"fuzz{self.rng.randrange(GROUPS)}"
        with wheeld.connect(self.d.socket_path, group=group, connect_timeout_s=30) as member:
            end = time.monotonic() + 0.05
            while time.monotonic() < end:
                member.poll(0.01)
        self.stats["drains"] += 1

    # ------------------------------------------------------------------ the run
    def run(self, records: int, frames: int) -> None:
        rng = self.rng
        pid = self.d.pid
        while self.stats["records"] < records or self.stats["frames"] < frames:
            roll = rng.random()
            if self.stats["records"] < records and (roll < 0.5 or self.stats["frames"] >= frames):
                self.ring_session(rng.randint(50, 3000))
            elif self.stats["frames"] < frames:
                self.socket_session()
            if rng.random() < 0.1:
                self.drain()
            assert self.d.proc.poll() is None, f"the daemon exited:\n{self.d.log()[-3000:]}"
            self.rss_peak_kb = max(self.rss_peak_kb, rss_kb(pid))


def fuzz(tmp_path, daemon_factory, seed: int, records: int, frames: int) -> dict:
    d = daemon_factory(capacity=CAPACITY, extra=["--ring-capacity", str(RING_CAPACITY), "--touch-capacity",
                                                  str(TOUCH_CAPACITY), "--group-quota", str(GROUP_QUOTA)]).start()
    honest = Honest(tmp_path, d.socket_path, seed=seed)
    try:
        honest.wait_served(20)
        start_kb = rss_kb(d.pid)
        started = time.monotonic()
        fuzzer = Fuzzer(d, seed)
        fuzzer.run(records, frames)
        elapsed = time.monotonic() - started
        honest.wait_served(20)
        result = honest.finish()
        assert result["max_late_ms"] <= LATE_BOUND_MS, result
        assert d.proc.poll() is None
        published = counters(d.name)
        assert published["daemon_pid"] == d.pid and published["daemon_restarts_total"] == 0
        growth_kb = fuzzer.rss_peak_kb - start_kb
        assert growth_kb < RSS_GROWTH_BOUND_KB, (start_kb, fuzzer.rss_peak_kb)
        assert "Traceback" not in d.log(), d.log()[-5000:]
        report = CK.check(d.name)
        assert report.ok, report.problems
        with R.ArenaReader(d.name) as reader:  # the far-past deadlines' lateness, summed without overflow
            lateness_sum = struct.unpack_from("<q", reader.buf, AL.H_LATENESS_SUM_US)[0]
            beyond_top = struct.unpack_from("<q", reader.buf, AL.H_LATENESS + 8 * (AL.LATENESS_BUCKETS - 1))[0]
        assert 0 <= lateness_sum <= AL.COUNTER_MAX
        # enough far-past timers fired to overflow a naive int64 sum (~132 of them): the class was exercised
        assert beyond_top >= 200, beyond_top
        wait_until(lambda: counters(d.name)["clients_dropped_total"] >= fuzzer.stats["dirty"], 10,
                   what="every dirty ring dropped")
        summary = dict(fuzzer.stats, seconds=round(elapsed, 1), rss_start_mb=start_kb // 1024,
                       rss_peak_mb=fuzzer.rss_peak_kb // 1024, commands_applied=published["commands_total"],
                       clients_dropped=published["clients_dropped_total"], rejected=published["rejected_total"],
                       honest_delivered=result["delivered"], honest_max_late_ms=result["max_late_ms"])
        print("fuzz summary:", summary)
        return summary
    finally:
        honest.kill()


@pytest.mark.parametrize("seed", [1])
def test_fuzz_one_daemon_with_random_records_touches_and_frames(tmp_path, daemon_factory, seed):
    summary = fuzz(tmp_path, daemon_factory, seed, records=200_000, frames=6_000)
    assert summary["records"] >= 200_000 and summary["frames"] >= 6_000


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_fuzz_long(tmp_path, daemon_factory):
    summary = fuzz(tmp_path, daemon_factory, 2, records=1_000_000, frames=30_000)
    assert summary["records"] >= 1_000_000


# ---------------------------------------------------------------------------- answer floods, slot and group churn

CHURN_WORKER = os.path.join(os.path.dirname(__file__), "churn_worker.py")
CHURN_UIDS = (65534, 65533)  # not root, not the daemon's uid: the per-uid bounds apply to them
CHURN_MAX_CLIENTS = 48
CHURN_CLIENTS_PER_UID = 8
CHURN_MAX_GROUPS = 64  # a quarter of them (16) per uid by default
CHURN_GROUP_POOL = 40  # group names each attacker draws from: more than its bound
_FRESH_CLIENT = """
end = time.monotonic() + 30
while True:  # slots left without a Bye come back within --resume-grace-s
    try:
        w = wheeld.connect(ARGS["socket"], group=ARGS["group"], connect_timeout_s=10)
        break
    except wheeld.BackPressure as exc:
        if isinstance(exc, wheeld.ArenaFull):
            raise
        if time.monotonic() > end:
            raise
        time.sleep(0.2)
w.add("fresh-x", 5)
got = []
while "fresh-x" not in got and time.monotonic() < end + 10:
    got += [e.key for e in w.poll(1)]  # idle timers of the group may come due to this member too
got = [k for k in got if k == "fresh-x"]
w.close()
print(json.dumps({"served": got}))
"""


def churn(tmp_path, daemon_factory, seed: int, seconds: float) -> dict:
    """Two attackers (two uids) churn slots and groups and flood answers for ``seconds``
    against one daemon, beside the honest client; then a fresh client of each uid still
    gets a slot and a group of its own, and the daemon is as the other fuzz requires."""
    import json
    import shutil
    import subprocess
    import sys
    import tempfile

    from test_hostile_bounds import run_as

    base = tempfile.mkdtemp(prefix="wheeld-churn-")
    os.chmod(base, 0o755)
    d = daemon_factory(capacity=CAPACITY, extra=[
        "--max-clients", str(CHURN_MAX_CLIENTS), "--clients-per-uid", str(CHURN_CLIENTS_PER_UID),
        "--max-groups", str(CHURN_MAX_GROUPS), "--resume-grace-s", "1", "--ack-timeout-s", "2",
        "--ring-capacity", str(RING_CAPACITY), "--touch-capacity", str(TOUCH_CAPACITY),
        "--group-quota", str(GROUP_QUOTA)])
    d.socket_path = os.path.join(base, f"{d.name}.sock")
    attackers = []
    honest = None
    try:
        d.start()
        os.chmod(d.socket_path, 0o666)
        honest = Honest(tmp_path, d.socket_path, seed=seed)
        honest.wait_served(20)
        start_kb = rss_kb(d.pid)
        peak_kb = start_kb
        for n, uid in enumerate(CHURN_UIDS):
            args = {"uid": uid, "socket": d.socket_path, "seed": seed * 100 + n, "prefix": f"churn{uid}",
                    "seconds": seconds, "group_pool": CHURN_GROUP_POOL}
            attackers.append(subprocess.Popen([sys.executable, CHURN_WORKER, json.dumps(args)],
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        while any(a.poll() is None for a in attackers):
            assert d.proc.poll() is None, f"the daemon exited:\n{d.log()[-3000:]}"
            peak_kb = max(peak_kb, rss_kb(d.pid))
            time.sleep(0.05)
        tallies = []
        for a in attackers:
            out, err = a.communicate(timeout=30)
            assert a.returncode == 0, (out.decode()[-2000:], err.decode(errors="replace")[-3000:])
            tallies.append(json.loads(out.decode().strip().splitlines()[-1]))
        honest.wait_served(20)
        # the slots the attackers left behind came back: each uid gets one again (its groups keep their
        # hour-long timers, so it joins one of its own)
        for uid in CHURN_UIDS:
            assert run_as(uid, _FRESH_CLIENT, socket=d.socket_path, group=f"churn{uid}-idle") == {"served": ["fresh-x"]}
        result = honest.finish()
        assert result["max_late_ms"] <= LATE_BOUND_MS, result
        published = counters(d.name)
        assert published["daemon_pid"] == d.pid and published["daemon_restarts_total"] == 0
        growth_kb = peak_kb - start_kb
        assert growth_kb < RSS_GROWTH_BOUND_KB, (start_kb, peak_kb)
        assert "Traceback" not in d.log(), d.log()[-5000:]
        report = CK.check(d.name)
        assert report.ok, report.problems
        total = {key: sum(t[key] for t in tallies) for key in tallies[0] if key != "errors"}
        summary = dict(total, rss_start_mb=start_kb // 1024, rss_peak_mb=peak_kb // 1024,
                       rejected=published["rejected_total"], honest_delivered=result["delivered"],
                       honest_max_late_ms=result["max_late_ms"])
        print("churn summary:", summary)
        return summary
    finally:
        for a in attackers:
            if a.poll() is None:
                a.kill()
                a.wait(10)
        if honest is not None:
            honest.kill()
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("seed", [1])
def test_fuzz_answer_floods_and_slot_and_group_churn(tmp_path, daemon_factory, seed):
    summary = churn(tmp_path, daemon_factory, seed, seconds=15)
    assert summary["flooded_records"] >= 2 * RING_CAPACITY and summary["rejected"] >= RING_CAPACITY
    assert summary["refused_slots"] and summary["refused_groups"]  # both bounds were met...
    assert summary["left_without_bye"] and summary["idle_timers"]  # ...and slots left behind came back


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_fuzz_churn_long(tmp_path, daemon_factory):
    summary = churn(tmp_path, daemon_factory, 2, seconds=180)
    assert summary["flooded_records"] >= 50 * RING_CAPACITY
