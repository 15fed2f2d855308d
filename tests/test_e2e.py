"""End to end: a real wheeld process, real client processes, real shared memory."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import wheeld
from daemon_harness import wait_for_clock, wait_until
from wheeld.protocol import commands as C
from wheeld.protocol import messages as M
from wheeld.protocol.errors import InvalidKey
from wheeld.shm.ring import ClientSegment

WORKER = os.path.join(os.path.dirname(__file__), "e2e_worker.py")


def mono_ms() -> int:
    return time.monotonic_ns() // 1_000_000


def run_workers(tmp_path, specs):
    procs = []
    for i, (mode, args) in enumerate(specs):
        out = tmp_path / f"worker-{i}.json"
        procs.append((subprocess.Popen([sys.executable, WORKER, mode, json.dumps(args), str(out)]), out))
    results = []
    for proc, out in procs:
        try:
            proc.wait(120)
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
        results.append((proc.returncode, json.loads(out.read_text()) if out.exists() else None))
    return results


def collect(client, want: int, timeout_s: float = 10.0) -> list[wheeld.Expired]:
    got: list[wheeld.Expired] = []
    end = time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < end:
        got.extend(client.poll(0.1))
    return got


def test_many_processes_exactly_once_never_early(daemon, tmp_path):
    specs = [("load", {"socket": daemon.socket_path, "group": f"g{i}", "prefix": f"p{i}", "n": 8000,
                       "seed": i, "delay_ms": [0, 1500]}) for i in range(4)]
    results = run_workers(tmp_path, specs)
    total = 0
    for code, result in results:
        assert code == 0 and result is not None, daemon.log()
        expected = result["expected"]
        received = result["received"]
        counts = collections.Counter(r[0] for r in received)
        assert not [k for k, c in counts.items() if c > 1], "an expiration was delivered twice"
        assert set(counts) == set(expected), "missing or unexpected expirations"
        assert not set(result["cancelled"]) & set(counts), "a cancelled timer was delivered"
        for key, deadline, fired, received_ms in received:
            assert fired >= deadline, f"{key} fired early"
            assert received_ms >= expected[key], f"{key} reached the application before its deadline"
        total += len(received)
    assert total > 25_000


def test_cancel_races_with_expiry(daemon):
    rng = random.Random(7)
    delivered = collections.Counter()
    cancelled_true = set()
    with wheeld.connect(daemon.socket_path, group="race") as w:
        for i in range(3000):
            key = f"r{i}"
            w.add(key, rng.randint(0, 3))
            if rng.random() < 0.5:
                time.sleep(rng.random() * 0.002)  # lets some expire before their cancel: the race
                for e in w.poll(0):
                    delivered[e.key] += 1
            if w.cancel(key):
                cancelled_true.add(key)
        w.flush()
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            for e in w.poll(0.05):
                delivered[e.key] += 1
    assert max(delivered.values()) == 1
    assert not cancelled_true & set(delivered), "cancel returned True but the timer was delivered"
    # every arming either was cancelled (True) or had already been delivered (False)
    assert cancelled_true | set(delivered) == {f"r{i}" for i in range(3000)}
    assert cancelled_true and delivered, "the race did not happen both ways"


def test_rearm_delivers_once_for_the_new_deadline(daemon):
    with wheeld.connect(daemon.socket_path, group="rearm") as w:
        start = mono_ms()
        w.add("k", 100)
        w.add("k", 400)  # moved later
        w.add(b"k", 50)  # a different key (bytes)
        w.add(5, 60)  # int key
        got = collect(w, 3, 2.0)
        got += w.poll(0.2)
    keys = [e.key for e in got]
    assert sorted(map(repr, keys)) == sorted(map(repr, ["k", b"k", 5]))
    k = next(e for e in got if e.key == "k")
    assert k.deadline_ms >= start + 400 and k.fired_ms >= k.deadline_ms


def test_int_keys_at_the_64_bit_edges(daemon):
    """add/cancel encode an int key in place (the purgatory's op ids): the same record as
    encode_key, the same key back, and an int beyond 64 bits refused as before."""
    edges = [-(1 << 63), -1, 0, 1, (1 << 62) + 7, (1 << 63) - 1]
    with wheeld.connect(daemon.socket_path, group="int-edges") as w:
        for key in edges:
            w.add(key, 30)
        w.add(12345, 30)
        assert w.cancel(12345) is True
        for bad in (1 << 63, -(1 << 63) - 1):
            with pytest.raises(InvalidKey):
                w.add(bad, 30)
            with pytest.raises(InvalidKey):
                w.cancel(bad)
        got = collect(w, len(edges), 5.0)
        got += w.poll(0.2)
    assert sorted(e.key for e in got) == sorted(edges)
    assert all(type(e.key) is int for e in got)


@pytest.mark.parametrize("descheduled_s", [0, 0.25], ids=["prompt", "descheduled"])
def test_idle_timers_touched_and_untouched(daemon, descheduled_s):
    """Touched idle timers stay armed, untouched ones time out; ``descheduled`` plays a loaded
    machine that stops the test process between its last touch and what follows."""
    with wheeld.connect(daemon.socket_path, group="idle") as w:
        armed = mono_ms()
        for i in range(10):
            w.add_idle(f"conn{i}", 300)
        w.flush()
        fired: dict[str, int] = {}
        last_touch = {}
        end = time.monotonic() + 1.0
        while time.monotonic() < end:  # keep the even connections busy for a second
            for i in range(0, 10, 2):
                # read before the touch: the touch stores a time no earlier than this one, so
                # the timer may not fire before last_touch + 300, however long the touch took
                last_touch[f"conn{i}"] = mono_ms()
                w.touch(f"conn{i}")
            for e in w.poll(0.05):
                fired[e.key] = mono_ms()
        time.sleep(descheduled_s)
        assert set(fired) == {f"conn{i}" for i in range(1, 10, 2)}, "only untouched connections may time out"
        assert all(t >= armed + 300 for t in fired.values()), "an idle timer fired early"
        for e in collect(w, 5, 2.0):
            fired[e.key] = mono_ms()
        assert len(fired) == 10
        touched = {key: fired[key] - last_touch[key] for key in last_touch}
        assert set(touched) == {f"conn{i}" for i in range(0, 10, 2)}
        # each touched connection timed out idle_ms after its own last touch, not before: the
        # touches held it for the whole second (however late the machine let the loop run)
        assert all(gap >= 300 for gap in touched.values()), f"fired less than idle_ms after the last touch: {touched}"


def test_killed_client_hands_its_timers_to_the_group(daemon, tmp_path):
    survivor = wheeld.connect(daemon.socket_path, group="shared")
    try:
        # the doomed worker adds 400 timers, receives a first batch, dies without acknowledging
        results = run_workers(tmp_path, [("add_and_die", {"socket": daemon.socket_path, "group": "shared",
                                                            "prefix": "d", "n": 400, "delay_ms": 300})])
        code, result = results[0]
        assert code == -signal.SIGKILL and result["received"], daemon.log()
        got = collect(survivor, 400, 10.0)
        got += survivor.poll(0.3)
    finally:
        survivor.close()
    counts = collections.Counter(e.key for e in got)
    assert set(counts) == {f"d-{i}" for i in range(400)}, "timers of the dead client were lost"
    assert max(counts.values()) == 1


def test_daemon_sigkill_under_load_loses_nothing(daemon):
    w = wheeld.connect(daemon.socket_path, group="crash", reconnect_timeout_s=20)
    try:
        deadlines = {}
        for i in range(20_000):
            delay = 200 + (i * 7919) % 1800
            deadlines[f"c{i}"] = mono_ms() + delay
            w.add(f"c{i}", delay)
        w.flush()
        got = collect(w, 3000, 5.0)  # part of them arrive before the crash
        daemon.kill()
        for i in range(20_000, 21_000):  # added while no daemon runs: they wait in the ring
            deadlines[f"c{i}"] = mono_ms() + 100
            w.add(f"c{i}", 100)
        wait_for_clock(deadlines["c20999"], "the timers added while the daemon was down to come due")
        daemon.start()
        got += collect(w, 21_000 - len(got), 20.0)
        got += w.poll(0.5)
    finally:
        w.close()
    counts = collections.Counter(e.key for e in got)
    assert set(counts) == set(deadlines), f"lost {len(set(deadlines) - set(counts))} timers\n{daemon.log()[-3000:]}"
    assert max(counts.values()) == 1, "a timer reached the application twice"
    assert all(e.fired_ms >= e.deadline_ms >= deadlines[e.key] for e in got)
    log = daemon.log()
    assert "attached existing arena" in log
    assert "arena checked after attach" in log and ": sound" in log, log[-3000:]  # fsck over the rebuilt arena


def test_garbage_in_a_ring_disconnects_only_that_client(daemon):
    good = wheeld.connect(daemon.socket_path, group="good")
    bad = wheeld.connect(daemon.socket_path, group="bad")
    try:
        bad.add("kept", 300)  # the bad client's group keeps its timers
        bad.flush()
        # write random bytes straight into the bad client's ring and publish them
        seg: ClientSegment = bad._segment
        raw = np.frombuffer(np.random.default_rng(1).bytes(64 * 4), dtype=C.RECORD_DTYPE)
        view = seg._ring
        for record in raw:
            view[seg._tail & seg._mask] = record
            seg._tail += 1
        seg._words[_tail_word()] = seg._tail
        bad._ring_doorbell()
        good.add("still-served", 50)
        got = collect(good, 1, 3.0)
        assert [e.key for e in got] == ["still-served"]
        daemon.wait_for_log("invalid command record")
        # the bad group's timer survives; a new member of that group gets it
        other = wheeld.connect(daemon.socket_path, group="bad")
        try:
            assert [e.key for e in collect(other, 1, 3.0)] == ["kept"]
        finally:
            other.close()
    finally:
        good.close()
        bad._closed = True
        bad._sock.close()


def _tail_word() -> int:
    from wheeld.protocol import ring_layout

    return ring_layout.TAIL_OFFSET // 8


def test_garbage_and_wrong_version_on_the_socket(daemon):
    with wheeld.connect(daemon.socket_path, group="victim") as w:
        rng = random.Random(3)
        for _ in range(20):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(daemon.socket_path)
            s.sendall(bytes(rng.randrange(256) for _ in range(rng.randint(1, 300))))
            s.close()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(daemon.socket_path)
        s.sendall(M.encode_client_frame(M.Hello(99, "g", os.getpid(), "")))
        s.settimeout(5)
        reply = s.recv(4096)
        s.close()
        assert isinstance(M.decode_daemon_message(reply[4:]), M.Refused)
        w.add("after-garbage", 20)
        assert [e.key for e in collect(w, 1, 3.0)] == ["after-garbage"]
    assert "protocol" in daemon.log()


def test_bad_input_raises_in_the_client_and_sends_nothing(daemon):
    with wheeld.connect(daemon.socket_path, group="bad-input") as w:
        seg = w._segment
        before = seg._tail
        for key in ["", b"", "x" * 33, 3.5, None, ("t",), 1 << 70]:
            with pytest.raises(wheeld.InvalidKey):
                w.add(key, 10)
        for delay in [-1, 1.5, "10", None, 1 << 60]:
            with pytest.raises(wheeld.InvalidDelay):
                w.add("k", delay)
        with pytest.raises(wheeld.InvalidKey):
            w.touch("never-armed")
        assert seg._tail == before
        w.add("fine", 10)
        assert [e.key for e in collect(w, 1, 3.0)] == ["fine"]


def test_full_arena_is_reported_to_that_client_only(daemon_factory):
    d = daemon_factory(capacity=100).start()
    with wheeld.connect(d.socket_path, group="hog") as hog:
        raised_by_add = False
        with pytest.raises(wheeld.ArenaFull):
            for i in range(150):
                try:
                    hog.add(f"h{i}", 60_000)
                except wheeld.ArenaFull:
                    raised_by_add = True  # the library saw the full arena at once
                    raise
            hog.flush()
        try:
            hog.flush()
        except wheeld.ArenaFull:
            # only when add() raised first: the adds it had pushed before are refused by
            # the daemon, and this flush is the first to report them
            assert raised_by_add
        hog.flush()  # the rejections were reported once
    with wheeld.connect(d.socket_path, group="other") as other:
        other.cancel("nothing")
        other.flush()


def test_asyncio_client(daemon):
    async def main():
        async with await wheeld.connect_async(daemon.socket_path, group="aio") as w:
            for i in range(100):
                w.add(i, 20 + i)
            assert w.cancel(99)
            await w.flush()
            got = []
            while len(got) < 99:
                got += await w.poll(2.0)
            return got

    got = asyncio.run(main())
    assert sorted(e.key for e in got) == list(range(99))
    assert all(e.fired_ms >= e.deadline_ms for e in got)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another uid")
# The client that is refused is a fork of this process that becomes nobody (a new
# interpreter run as nobody could not read this checkout). pytest's timeout and xdist
# threads hold none of the locks it takes, so Python 3.12's warning about fork() in a
# multi-threaded process says nothing here.
@pytest.mark.filterwarnings(
    "ignore:This process .* is multi-threaded, use of fork\\(\\) may lead to deadlocks:DeprecationWarning")
def test_disallowed_uid_is_refused_with_a_reason(daemon_factory):
    import shutil
    import tempfile

    base = tempfile.mkdtemp(prefix="wheeld-test-")  # pytest's tmp dirs are private to root
    os.chmod(base, 0o777)
    d = daemon_factory(extra=["--allow-uid", "4242"])
    d.socket_path = os.path.join(base, "w.sock")
    try:
        d.start()
        _refused_as_nobody(d)
    finally:
        d.cleanup()
        shutil.rmtree(base, ignore_errors=True)


def _refused_as_nobody(d):
    os.chmod(d.socket_path, 0o666)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: become nobody and try to connect
        os.close(read_end)
        try:
            os.setgid(65534)
            os.setuid(65534)
            wheeld.connect(d.socket_path, group="x", connect_timeout_s=3)
            msg = b"connected"
        except wheeld.BrokenPeer as exc:
            msg = str(exc).encode()
        except BaseException as exc:  # noqa: BLE001 - report anything to the parent
            msg = repr(exc).encode()
        os.write(write_end, msg)
        os._exit(0)
    os.close(write_end)
    _, status = os.waitpid(pid, 0)
    answer = os.read(read_end, 4096).decode()
    os.close(read_end)
    assert "refused" in answer and "not allowed" in answer, answer
    with wheeld.connect(d.socket_path, group="root-is-fine") as w:  # the daemon's own uid may
        w.flush()


def test_one_big_batch_with_repeated_keys_applies_in_order(daemon):
    """The daemon applies large drained batches through the wheel's batch methods;
    a key armed, re-armed and cancelled inside one batch must end as the last command says.

    Checked in the arena itself (read-only): the client drops expirations of armings it
    cancelled, so deliveries alone would hide a daemon that failed to cancel."""
    from wheeld.shm.reader import ArenaReader

    rng = random.Random(11)
    model: dict[str, int | None] = {}
    with wheeld.connect(daemon.socket_path, group="batch") as w:
        os.kill(daemon.pid, signal.SIGSTOP)  # commands pile up: one drain will see them all
        try:
            start = mono_ms()
            for _ in range(5000):
                key = f"b{rng.randrange(400)}"
                if rng.random() < 0.3:
                    w.cancel(key)
                    model[key] = None
                else:
                    delay = rng.randint(20_000, 40_000)
                    w.add(key, delay)
                    model[key] = start + delay
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        w.flush()
        with ArenaReader(daemon.name) as reader:
            _total, timers = reader.timers(limit=None, group="batch")
        pending = {t.key: t.deadline_ms for t in timers}
        expected = {k for k, v in model.items() if v is not None}
        assert set(pending) == expected
        for key in expected:  # the last arming won (deadline read after it was pushed)
            assert model[key] <= pending[key] <= model[key] + 2_000


def test_loop_iterations_and_commands_are_counted_in_the_arena(daemon):
    with wheeld.connect(daemon.socket_path, group="count") as w:
        for i in range(10_000):  # more than one chunk of the ring, timers coming due meanwhile
            w.add(i, i % 50)
        w.flush()
        assert len(collect(w, 10_000)) == 10_000
        counter = daemon.wait_parked()  # the counters are published before the daemon parks
    assert counter["commands_total"] >= 10_001  # the adds and the flush (acks come on top)
    assert counter["loop_iterations_total"] >= max(1, counter["wakeups_total"])
    assert counter["delivered_total"] == 10_000


def test_commands_nobody_waits_for_are_gathered_and_a_flush_is_answered_at_once(daemon_factory):
    """--coalesce-us: a parked daemon applies commands that trickle in up to the window
    later, many per wake-up: at most one wake-up per window, not one per doorbell (an
    add rings a doorbell that is not urgent); a flush rings an urgent one (how soon the
    daemon answers it is measured by bench/daemon_paths.py); nothing fires early."""
    d = daemon_factory(extra=["--coalesce-us", "10000"]).start()
    with wheeld.connect(d.socket_path, group="gather") as w:
        doorbells = _record_doorbells(w)
        w.flush()
        before = d.wait_parked()  # nothing due
        doorbells.clear()
        start = mono_ms()
        n = 0
        while mono_ms() < start + 200:  # ~200 ms of adds, no flush
            w.add(f"k{n}", 60_000)
            n += 1
            time.sleep(0.0005)  # the adds trickle in: the load this test is about
        after = wait_until(lambda: d.parked() and _applied(d, before, n), what=f"{n} adds applied without a flush")
        elapsed_ms = mono_ms() - start
        assert doorbells and not any(doorbells), "an add rang an urgent doorbell"
        wakeups = after["wakeups_total"] - before["wakeups_total"]
        windows = elapsed_ms // 10 + elapsed_ms // 500  # 10 ms windows, and the longest park (500 ms)
        assert wakeups <= windows + 3, f"{wakeups} wake-ups for {n} adds in {elapsed_ms} ms: not gathered"

        for i in range(3):
            d.wait_parked()
            w.add(f"f{i}", 60_000)
            w.flush()
            assert doorbells[-1] is True, "a flush rings an urgent doorbell"

        d.wait_parked()
        w.add("soon", 3)
        (expired,) = collect(w, 1, 3.0)
        assert expired.key == "soon" and expired.fired_ms >= expired.deadline_ms
        assert mono_ms() >= expired.deadline_ms


def test_no_doorbell_is_rung_when_the_park_ends_within_the_window(daemon_factory):
    """The status page's ``quiet_from``: a park that ends within ``--coalesce-us`` anyway
    (a timer due every 2 ms, a 10 ms window) takes no doorbell for an add, which the next
    wake-up applies all the same; a long park (nothing due: ``--max-park-ms``) does."""
    from wheeld.protocol import status_layout as SL

    d = daemon_factory(extra=["--coalesce-us", "10000"]).start()
    with wheeld.connect(d.socket_path, group="quiet") as w:
        doorbells = _record_doorbells(w)
        w.flush()
        before = d.wait_parked()  # nothing due: a long park, its quiet_from far ahead
        assert w._page[SL.QUIET_FROM_WORD] > time.monotonic_ns() + 100_000_000
        doorbells.clear()
        w.add("lone", 60_000)
        assert doorbells == [False], "a push into a long park rings (not urgent)"
        wait_until(lambda: _applied(d, before, 1), what="the add applied")

        # timers due every 2 ms for 3 s: every park ends within the 10 ms window
        for i in range(1500):
            w.add(f"tick{i}", 2 + 2 * i)
        w.flush()
        before = d.counters()
        doorbells.clear()
        start = mono_ms()
        n = 0
        while mono_ms() < start + 300:
            w.add(f"k{n}", 60_000)
            n += 1
            time.sleep(0.001)
        assert doorbells == [], f"{len(doorbells)} doorbells rung into parks that end within the window"
        wait_until(lambda: _applied(d, before, n), what=f"{n} adds applied without a doorbell")
        assert 0 < w._page[SL.QUIET_FROM_WORD] <= time.monotonic_ns()


def _record_doorbells(w) -> list:
    """The doorbells ``w`` rings from now on, each as its urgent flag (it still rings them)."""
    doorbells: list = []
    ring = w._ring_doorbell
    w._ring_doorbell = lambda urgent=True: (doorbells.append(urgent), ring(urgent))
    return doorbells


def _applied(daemon, before: dict, n: int) -> dict | None:
    """The counters, once at least ``n`` commands more than ``before`` were applied."""
    counters = daemon.counters()
    return counters if counters["commands_total"] - before["commands_total"] >= n else None


def test_client_expirations_decoder_agrees_with_the_protocol_decoder():
    from wheeld.core import decode_daemon_body

    rng = random.Random(3)
    items = [M.Expiry.for_key(k, 10, 12, 5, 7, 1, late) for k, late in (("a", False), (b"\x00\xff", True), (-5, False))]
    body = M.encode_daemon_message(M.Expirations(items))
    fast = decode_daemon_body(body)
    assert [tuple(getattr(e, f) for f in M.Expiry.__struct_fields__) for e in fast.items] == \
        [tuple(getattr(e, f) for f in M.Expiry.__struct_fields__) for e in items]
    assert decode_daemon_body(M.encode_daemon_message(M.Applied(9))) == M.Applied(9)
    for _ in range(3000):  # random bytes, mutated frames: a message or ProtocolError, nothing else
        raw = bytearray(body)
        for _ in range(rng.randrange(1, 4)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        for candidate in (bytes(raw), bytes(raw[: rng.randrange(len(raw))]), rng.randbytes(rng.randrange(40))):
            try:
                decode_daemon_body(candidate)
            except wheeld.ProtocolError:
                pass


def test_client_refuses_an_expiry_whose_key_does_not_match_its_meta():
    from wheeld.core import ClientCore, decode_daemon_body

    core = ClientCore("/nonexistent", "g", 1.0, 1.0, "")
    core._welcome = M.Welcome(M.PROTOCOL_VERSION, 1, "seg", 1024, 0, "", 1, 1 << 40, 1, 77)
    good = M.Expiry.for_key("ok", 10, 12, 5, 7, 1)
    for key_bytes, meta in ((b"abc", 0x40 | 2), (b"\xff\xfe", 0x40 | 2), (b"x", 0xC1)):
        bad = msgspec_encode(["expirations", [[good.key_bytes, good.key_meta, 10, 12, 5, 7, 1, False],
                                              [key_bytes, meta, 10, 12, 6, 8, 1, False]]])
        with pytest.raises(wheeld.ProtocolError):
            core._on_message(decode_daemon_body(bad))
        assert not core._ready, "a refused frame hands nothing to the application"
    core._on_message(decode_daemon_body(M.encode_daemon_message(M.Expirations([good]))))
    (expired,) = core._take_ready()
    assert expired == wheeld.Expired("ok", 10, 12, False) and hash(expired) == hash(wheeld.Expired("ok", 10, 12))
    with pytest.raises(AttributeError):
        expired.key = "other"
    assert core._to_ack == [(7, 1, 77)]


def test_client_drops_resent_expirations_it_remembers_and_forgets_the_oldest_one_at_a_time(monkeypatch):
    """The latest _RECENT handed-over expirations are remembered (a re-sent one is acked,
    not handed over again); older ones are forgotten one by one, not a generation at once."""
    from wheeld import core as client_core
    from wheeld.core import ClientCore, decode_daemon_body

    monkeypatch.setattr(client_core, "_RECENT", 500)
    core = ClientCore("/nonexistent", "g", 1.0, 1.0, "")
    core._welcome = M.Welcome(M.PROTOCOL_VERSION, 1, "seg", 1024, 0, "", 1, 1 << 40, 1, 77)

    def deliver(pairs) -> list:
        frame = M.Expirations([M.Expiry.for_key(key, 10, 12, seq, seq % 4096, 1) for key, seq in pairs])
        core._on_message(decode_daemon_body(M.encode_daemon_message(frame)))
        return [e.key for e in core._take_ready()]

    first = [(f"k{i}", i) for i in range(600)]
    for start in range(0, 600, 50):
        assert deliver(first[start:start + 50]) == [key for key, _ in first[start:start + 50]]
    assert len(core._recent_order) == 500 and sum(len(s) for s in core._recent) == 500
    core._to_ack.clear()
    assert deliver(first[100:]) == [], "the latest 500 are dropped when re-sent"
    assert len(core._acks_pending) == 500, "and acknowledged again"
    assert deliver(first[:100]) == [key for key, _ in first[:100]], "the oldest 100 were forgotten"
    assert deliver([("other", 599)]) == ["other"], "the same tag with another key is another arming"
    assert len(core._recent_order) == 500 and sum(len(s) for s in core._recent) == 500


def msgspec_encode(value) -> bytes:
    import msgspec

    return msgspec.msgpack.encode(value)


def test_an_add_idle_the_full_ring_refuses_leaves_the_key_as_it_was(daemon_factory):
    """add_idle writes the key's row of the touch table (its idle time, a first touch)
    that the daemon reads for the key's pending timer; when the ring is full and the
    call raises RingFull, nothing may have changed: the earlier arming keeps its idle
    time (a shorter one written anyway would fire it early), and no row is used up."""
    d = daemon_factory(extra=["--ring-capacity", "64", "--touch-capacity", "16"]).start()
    with wheeld.connect(d.socket_path, group="ringfull", ring_timeout_s=0.05) as w:
        armed_ms = mono_ms()
        w.add_idle("conn", 60_000)
        w.flush()
        segment = w._segment
        row = w._touch_by_key["conn"]
        os.kill(d.pid, signal.SIGSTOP)  # nothing drains: the ring fills
        try:
            with pytest.raises(wheeld.RingFull):
                for i in range(1000):
                    w.add(f"filler{i}", 3_600_000)
            free_rows = w._free_touch[:], w._next_touch
            with pytest.raises(wheeld.RingFull):
                w.add_idle("conn", 5)  # refused: must not shorten conn's idle time
            with pytest.raises(wheeld.RingFull):
                w.add_idle("other", 5)  # refused: must not take a row
            assert segment._idle[row] == 60_000  # the row still holds conn's idle time
            assert (w._free_touch[:], w._next_touch) == free_rows
            assert "other" not in w._touch_by_key
        finally:
            os.kill(d.pid, signal.SIGCONT)
        w.flush()
        for expired in w.poll(timeout_s=0.3):  # conn (60 s idle) did not fire at the refused 5 ms
            assert expired.key != "conn" or expired.fired_ms >= armed_ms + 60_000, expired
