"""Damage written into the arena's records (the daemon's uid, or root, can write the arena):
what a real daemon does with it, an honest client served throughout.

* Found at attach, with ``--journal``: every live record is compared with the journal
  and the journal wins (``wheeld.daemon.reconcile``): no acknowledged timer is lost and
  none fires early, a damaged deadline or state included.
* Found at attach, without a journal: what cannot be repaired is reported as lost (ERROR
  lines, ``arena_timers_lost_total``), never as sound.
* Found while running: a fired record whose fields the client would refuse is never
  sent as they are (a generation beyond 31 bits is masked; anything else is freed and
  counted). No frame the daemon builds is one its own client refuses.
"""

from __future__ import annotations

import mmap
import random
import time

import pytest
from daemon_harness import wait_until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import wheeld
from hostile_harness import Honest, counters
from wheeld.daemon.sessions import CLIENT_MAX_DELAY_MS
from wheeld.protocol import arena_layout as AL
from wheeld.protocol import messages as M
from wheeld.protocol import ring_layout as RL
from wheeld.protocol.keys import KEY_BYTES, encode_key
from wheeld.protocol.naming import arena_name, shm_path
from wheeld.shm import check as CK
from wheeld.shm import reader as R
from wheeld.shm.wheel import GENERATION_MASK, MAX_CLOCK_MS, MAX_DELAY_MS

VICTIMS = 1500
WRITES = 200  # random 16-byte writes into the victims' records


def live_slots(name: str, group: str) -> tuple[int, list[int]]:
    """(the arena's header size, the live records of ``group``), read-only."""
    with R.ArenaReader(name) as reader:
        gid = reader.group_id(group)
        slots, _states, groups = reader._live()
        return reader.info["header_bytes"], slots[groups == gid].tolist()


def due_or_fired(name: str, group: str) -> int:
    """Live records of ``group`` that are fired, or scheduled and due (read-only)."""
    with R.ArenaReader(name) as reader:
        gid = reader.group_id(group)
        slots, states, groups = reader._live()
        mine = groups == gid
        deadlines = reader.records["deadline"][slots[mine]]
        now = time.monotonic_ns() // 1_000_000
        return int(((states[mine] == AL.FIRED) | (deadlines <= now)).sum())


def write_records(name: str, header_bytes: int, writes: list[tuple[int, int, bytes]]) -> None:
    """``(slot, offset in the record, bytes)`` written into the arena, as its owner's uid may."""
    with open(shm_path(arena_name(name)), "r+b") as f:
        mm = mmap.mmap(f.fileno(), 0)
        try:
            for slot, offset, data in writes:
                at = header_bytes + slot * AL.RECORD_BYTES + offset
                mm[at : at + len(data)] = data
        finally:
            mm.close()


def scribble(name: str, group: str, rng: random.Random, count: int) -> list[int]:
    """``count`` random 16-byte writes at random places of random live records of ``group``."""
    header_bytes, slots = live_slots(name, group)
    assert len(slots) >= count
    writes = [(rng.choice(slots), rng.randrange(AL.RECORD_BYTES - 16 + 1), rng.randbytes(16)) for _ in range(count)]
    write_records(name, header_bytes, writes)
    return slots


def add_victims(w, rng: random.Random, low_ms: int, high_ms: int) -> dict[str, tuple[int, int]]:
    added = {}
    for i in range(VICTIMS):
        key, delay = f"v{i}", rng.randint(low_ms, high_ms)
        t0 = time.monotonic_ns()
        w.add(key, delay)
        added[key] = (t0, delay)
    w.flush()  # acknowledged: with --fsync always on disk too
    return added


def receive(w, until: callable, timeout_s: float) -> list[tuple[object, int]]:
    got = []
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and not until(got):
        for e in w.poll(0.1):  # a frame the library refuses raises ProtocolError here
            got.append((e, time.monotonic_ns()))
    return got


def early(got: list, added: dict) -> list:
    out = []
    for e, received_ns in got:
        t0, delay = added[e.key]
        if received_ns - t0 < delay * 1_000_000 or e.fired_ms < e.deadline_ms:
            out.append((e.key, delay, (received_ns - t0) / 1e6, e.deadline_ms, e.fired_ms))
    return out


def restart_log(d, offset: int) -> str:
    return d.log_path.read_bytes()[offset:].decode("utf-8", "replace")


@pytest.fixture
def damaged(tmp_path, daemon_factory):
    """start(extra) -> (daemon, honest client); the honest client is stopped after the test."""
    made: list[Honest] = []

    def start(extra=()):
        d = daemon_factory(capacity=20_000, extra=list(extra)).start()
        honest = Honest(tmp_path, d.socket_path)
        made.append(honest)
        return d, honest

    try:
        yield start
    finally:
        for honest in made:
            honest.kill()


def test_damage_found_at_attach_is_repaired_from_the_journal_nothing_lost_nothing_early(damaged, tmp_path):
    d, honest = damaged(["--journal", str(tmp_path / "journal"), "--fsync", "always"])
    rng = random.Random(26)
    with wheeld.connect(d.socket_path, group="victim", reconnect_timeout_s=60) as w:
        added = add_victims(w, rng, 5000, 9000)
        wait_until(lambda: counters(d.name)["journal_lsn"] >= VICTIMS, 10, what="the journal's lsn published")
        d.kill()
        scribble(d.name, "victim", rng, WRITES)
        offset = d.log_path.stat().st_size
        d.start()
        got = receive(w, lambda got: {e.key for e, _ in got} >= set(added), 40)
        got += receive(w, lambda got: False, 0.5)  # a duplicate or a phantom would show up here
    keys = [e.key for e, _ in got]
    assert sorted(set(keys) - set(added)) == []  # no timer made up from a damaged key
    assert sorted(set(added) - set(keys)) == []  # no acknowledged timer lost
    assert len(keys) == len(set(keys))
    assert early(got, added) == []
    log = restart_log(d, offset)
    assert "arena compared with the journal" in log and "restored from it" in log, log[-3000:]
    assert "sound" not in log
    published = counters(d.name)
    assert published["arena_damaged_records_total"] > 0 and published["arena_timers_lost_total"] == 0
    honest.wait_served(10)
    honest.finish()
    assert d.proc.poll() is None and "Traceback" not in d.log()
    assert CK.check(d.name).ok


def test_damage_found_at_attach_without_a_journal_is_reported_lost_never_sound(damaged):
    d, honest = damaged()
    rng = random.Random(27)
    with wheeld.connect(d.socket_path, group="victim", reconnect_timeout_s=60) as w:
        add_victims(w, rng, 3000, 6000)
        d.kill()
        slots = scribble(d.name, "victim", rng, WRITES)
        offset = d.log_path.stat().st_size
        d.start()
        log = restart_log(d, offset)
        published = counters(d.name)
        lost = published["arena_timers_lost_total"]
        assert lost > 0 and published["arena_damaged_records_total"] >= lost
        assert f"{lost} damaged record(s) freed; their timers are LOST" in log, log[-3000:]
        assert "ERROR" in log and "sound" not in log
        assert len(live_slots(d.name, "victim")[1]) <= len(slots) - lost
        # what is left and due is delivered in frames the client takes (no ProtocolError from
        # poll) and acknowledged: no record of the group stays fired, or due and not fired
        end = time.monotonic() + 40
        while due_or_fired(d.name, "victim") and time.monotonic() < end:
            w.poll(0.1)
        assert due_or_fired(d.name, "victim") == 0
    honest.wait_served(10)
    honest.finish()
    assert d.proc.poll() is None and "Traceback" not in d.log()


def test_a_generation_damaged_while_running_is_masked_not_sent_as_is(damaged):
    """Generations are u32 in the arena and signed 32-bit on the wire: one written beyond
    2**31 - 1 into a pending record goes out masked, and the ack releases the record."""
    d, honest = damaged()
    count = 300
    with wheeld.connect(d.socket_path, group="gens") as w:
        for i in range(count):
            w.add(f"g{i}", 1500)
        w.flush()
        header_bytes, slots = live_slots(d.name, "gens")
        assert len(slots) == count
        rng = random.Random(3)
        write_records(d.name, header_bytes, [(slot, AL.R_GEN, rng.randrange(1 << 31, 1 << 32).to_bytes(4, "little"))
                                             for slot in slots])
        got = receive(w, lambda got: len(got) >= count, 20)
        assert sorted(e.key for e, _ in got) == sorted(f"g{i}" for i in range(count))
        w.poll(0.2)  # acknowledges them
    wait_until(lambda: not live_slots(d.name, "gens")[1], 10, what="the acknowledged records released")
    assert counters(d.name)["arena_damaged_records_total"] == count
    assert counters(d.name)["arena_timers_lost_total"] == 0
    honest.finish()
    assert d.proc.poll() is None and "Traceback" not in d.log()


def test_a_key_damaged_while_running_is_freed_and_counted_not_sent(damaged):
    """A str key overwritten with bytes that are not UTF-8 (or a meta byte no key has):
    the client would refuse the whole frame; the daemon frees those records, counts them
    lost, and delivers the rest of the frame."""
    d, honest = damaged()
    count = 100
    with wheeld.connect(d.socket_path, group="keys") as w:
        for i in range(count):
            w.add(f"k{i:03d}", 1500)
        w.flush()
        header_bytes, slots = live_slots(d.name, "keys")
        bad = slots[:10]
        write_records(d.name, header_bytes, [(slot, AL.R_KEY, b"\xff\xfe") for slot in bad[:5]]
                      + [(slot, AL.R_KEY_META, b"\x3f") for slot in bad[5:]])
        got = receive(w, lambda got: len(got) >= count - len(bad), 20)
        got += receive(w, lambda got: False, 0.5)
        assert len(got) == count - len(bad)
    published = counters(d.name)
    assert published["arena_damaged_records_total"] == len(bad) == published["arena_timers_lost_total"]
    honest.finish()
    assert d.proc.poll() is None and "Traceback" not in d.log()


# ---------------------------------------------------------------------------- every frame the daemon builds


def _decodes(frame: bytes) -> object:
    body = frame[4:]
    message = M.decode_daemon_body(body)
    if isinstance(message, M.ExpirationRows):
        M.expiry_keys(message.items)
    return message


EXTREME_KEYS = [encode_key("k"), encode_key("é" * 16), encode_key(b"\0" * KEY_BYTES), encode_key(-(2**63)),
                encode_key(2**63 - 1), encode_key("x" * KEY_BYTES)]


def test_every_frame_the_daemon_builds_decodes_at_its_client_at_the_extremes_of_its_sources():
    """Each field takes the extreme values what feeds it can hold: ring fields (seq u32,
    keys of every type and length), arena records after attach (deadline within
    +-(MAX_CLOCK_MS + MAX_DELAY_MS), generation masked to 31 bits, slots below 2**31,
    tags u32), the daemon's own values (tokens, epochs, the advertised maximum delay)."""
    from wheeld.daemon.planner import rejection

    items = []
    for kb, meta in EXTREME_KEYS:
        for deadline in (-(MAX_CLOCK_MS + MAX_DELAY_MS), MAX_CLOCK_MS + MAX_DELAY_MS, 0):
            items.append((kb, meta, deadline, MAX_CLOCK_MS, 0xFFFFFFFF, (1 << 31) - 10_001, GENERATION_MASK, True))
            items.append((kb, meta, deadline, -MAX_CLOCK_MS, 0, 0, 0, False))
    frames = [M.encode_expirations_frame(items)]
    for seq in (0, 0xFFFFFFFF):
        frames.append(M.encode_daemon_frame(M.Applied(seq)))
        for kb, meta in EXTREME_KEYS + [(b"", 0)]:
            reason = f"deadline {-(2**63)} is more than {MAX_DELAY_MS} ms from the clock ({-(MAX_CLOCK_MS)})"
            frames.append(M.encode_daemon_frame(rejection(seq, kb + bytes(KEY_BYTES - len(kb)), meta, reason,
                                                          M.Rejected.INVALID_DEADLINE, 0).message()))
    frames.append(M.encode_daemon_frame(M.Welcome(M.PROTOCOL_VERSION, 2**63 - 1, "wheeld-x-c" + "f" * 200,
                                                  RL.MAX_RING_CAPACITY, RL.MAX_TOUCH_CAPACITY, "wheeld-" + "n" * 200,
                                                  (1 << 31) - 1, CLIENT_MAX_DELAY_MS,
                                                  (1 << 63) - 1, 0xFFFFFFFF, True, True)))
    frames.append(M.encode_daemon_frame(M.Goodbye("x" * 4096)))
    frames.append(M.encode_daemon_frame(M.Refused("y" * 4096, M.Refused.BUSY)))
    for frame in frames:
        _decodes(frame)
        assert M.expirations_frame_problem(frames[0]) is None
    bad = [(b"k", 0x41, 0, 0, 0, 0, GENERATION_MASK + 1, False), (b"\xff", 0x41, 0, 0, 0, 0, 0, False),
           (b"k", 0x3F, 0, 0, 0, 0, 0, False), (b"k", 0x41, 0, 0, 1 << 32, 0, 0, False)]
    for item in bad:
        assert M.expirations_frame_problem(M.encode_expirations_frame(items[:3] + [item])) is not None


@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(meta=st.integers(0, 255), raw=st.binary(min_size=KEY_BYTES, max_size=KEY_BYTES),
       deadline=st.integers(-(2**63), 2**63 - 1), fired=st.integers(-(2**63), 2**63 - 1),
       tag=st.integers(0, 2**32 - 1), slot=st.integers(0, 2**31 - 1), gen=st.integers(0, 2**32 - 1),
       late=st.booleans())
def test_an_item_the_daemon_sends_without_the_decoder_check_always_decodes(meta, raw, deadline, fired, tag, slot,
                                                                          gen, late):
    """Delivery checks a frame with the client's decoder only when ``frames.suspect`` says one of
    its items may be refused (the cheap test it runs on every frame). Over every value an
    arena record's fields can hold, an item it lets through decodes at the client."""
    from wheeld.daemon.frames import _KEY_LEN_MASK
    from wheeld.daemon.frames import suspect as _suspect

    item = (raw[: meta & _KEY_LEN_MASK], meta, deadline, fired, tag, slot, gen, late)
    if not _suspect([item]):
        assert M.expirations_frame_problem(M.encode_expirations_frame([item])) is None


@settings(max_examples=300, deadline=None)
@given(text=st.text(min_size=1, max_size=8))
def test_str_keys_that_are_not_ascii_are_checked_and_sent(text):
    """A valid non-ASCII str key makes a frame suspect; the decoder then takes it whole."""
    from wheeld.daemon.frames import suspect as _suspect

    kb, meta = encode_key(text)
    item = (kb, meta, 0, 0, 0, 0, 0, False)
    assert _suspect([item]) == (not kb.isascii())
    assert M.expirations_frame_problem(M.encode_expirations_frame([item])) is None


def test_a_daemon_killed_under_load_again_and_again_finds_no_damage(damaged, tmp_path):
    """The check against the journal must not take what a crash leaves for damage: killed
    at random moments under load (in the middle of batches too), each restarted daemon
    reports no damaged record, and the honest client loses nothing."""
    d, honest = damaged(["--journal", str(tmp_path / "journal"), "--fsync", "interval=10"])
    busy = Honest(tmp_path, d.socket_path, group="busy", rate=3000, delay_ms=(1, 2000), seed=4, tag="busy")
    try:
        rng = random.Random(8)
        compared = 0
        for _ in range(6):
            busy.wait_served(200, timeout_s=60)
            time.sleep(rng.random() * 0.5)
            d.kill()
            offset = d.log_path.stat().st_size
            d.start()
            log = restart_log(d, offset)
            assert "arena damage" not in log, log[-3000:]
            compared += "arena compared with the journal" in log
        assert compared == 6
        assert counters(d.name)["arena_damaged_records_total"] == 0
        busy.wait_served(200, timeout_s=60)
        busy.finish()
    finally:
        busy.kill()
    honest.finish()
    assert "Traceback" not in d.log()


@settings(max_examples=500, deadline=None)
@given(key=st.one_of(st.text(min_size=1, max_size=8), st.binary(min_size=1, max_size=KEY_BYTES),
                     st.integers(-(2**63), 2**63 - 1)))
def test_the_reconciler_names_a_journal_key_as_the_wheel_does(key):
    from wheeld.daemon.reconcile import _ident_of
    from wheeld.shm.wheel import encode_ident

    try:
        expected = encode_ident(key)
    except wheeld.InvalidKey:
        return
    assert _ident_of(key) == expected


def test_rewrite_records_frees_rewrites_and_restores_and_leaves_a_sound_wheel():
    from wheeld.shm.wheel import TimerWheel, encode_ident

    wheel = TimerWheel.create(64, start_ms=1000)
    try:
        gid = wheel.group_id("g")
        a = wheel.schedule("a", 5000, gid, tag=1)[0]
        b = wheel.schedule("b", 6000, gid, tag=2)[0]
        c = wheel.schedule("c", 1500, gid, tag=3)[0]
        wheel.expire(2000)  # c fires
        made = wheel.rewrite_records(free=[b], rewrite=[(a, AL.SCHEDULED, 9000, 7), (c, AL.SCHEDULED, 2500, 3)],
                                     restore=[(encode_ident("d"), gid, AL.SCHEDULED, 4000, 4),
                                              (encode_ident("a"), gid, AL.FIRED, 1900, 1)])
        assert wheel.check() == []
        assert wheel.lookup("a", gid) == 9000 and wheel.lookup("b", gid) is None
        assert wheel.lookup("c", gid) == 2500 and wheel.lookup("d", gid) == 4000
        assert wheel.fired(made[1])[:4] == ("a", 1900, gid, 1)
        assert sorted(k for k, _d, _g in wheel.pending()) == ["a", "c", "d"]
        with pytest.raises(wheeld.InvalidRequest):
            wheel.rewrite_records(free=[wheel.first_entry + 60])  # a free record
        assert wheel.mask_generation(made[1], wheel.fired(made[1])[5]) is None  # within 31 bits already
    finally:
        wheel.close()


def test_an_idle_timer_restored_without_its_touch_reference_fires_no_sooner_than_idle_after_the_restore():
    """The journal keeps an idle timer's idle time but not its touch reference (the record
    held it): restored into a live arena it cannot see its client's touches, so it goes
    no sooner than ``idle_ms`` after the restore (the last touch was at or before it), nor
    before its journaled deadline. A plain timer keeps the journal's deadline."""
    from wheeld.daemon.reconcile import _restored_deadline
    from wheeld.journal.files import PendingTimer

    def same(ms):
        return ms

    idle = PendingTimer("g", "k", 1_000, 7, idle_ms=300)
    assert _restored_deadline(idle, same, now=900) == 1_200
    assert _restored_deadline(idle, same, now=500) == 1_000
    plain = PendingTimer("g", "k", 1_000, 7)
    assert _restored_deadline(plain, same, now=900) == 1_000
