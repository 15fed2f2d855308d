"""The simulated client runs the real client library over an in-memory connection.

No daemon: each test plays the daemon's side by hand, with a real ring and status page
(sealed memfds) passed as descriptors, and reads what the client wrote into its ring.
What is held here: the connection's streams (bounded, descriptors passed and closed
like SCM_RIGHTS), the client's one replaceable clock (both paths), the state machine
that never blocks, and the session the shared handshake opens and reopens.
"""

from __future__ import annotations

import collections
import os
import threading
import time

import pytest

import wheeld
from sim.client import DaemonEnd, SimClient, SimConnection, SimListener, client_clock
from wheeld import core as client_core
from wheeld.daemon.client_table import ClientSlot
from wheeld.daemon.executor import Executor
from wheeld.daemon.recorder import Recorder
from wheeld.daemon.recovery import load_recovered, recover_journal
from wheeld.journal.files import Journal
from wheeld.protocol import commands as C
from wheeld.protocol import messages as M
from wheeld.protocol.framing import FrameReader
from wheeld.protocol.keys import encode_key
from wheeld.shm.ring import ClientSegment
from wheeld.shm.status import StatusPage
from wheeld.shm.wheel import TimerWheel

RING = 1 << 10
TOUCH = 16
TOKEN = 4242
EPOCH = 7


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def latest_tag(client, key) -> int | None:
    """The tag of ``client``'s latest arming of ``key`` (~tag once cancelled), or None."""
    for shard in client._latest:
        if key in shard:
            return shard[key]
    return None


def same_file(fd_a: int, fd_b: int) -> bool:
    return os.path.samestat(os.fstat(fd_a), os.fstat(fd_b))


class Clock:
    """A simulated CLOCK_MONOTONIC, in ns; far from the real one (which is hours at most
    on a test machine), so a reading of the real clock cannot pass for it."""

    def __init__(self, ns: int = 40 * 86_400 * 10**9 + 123_456):
        self.ns = ns

    def __call__(self) -> int:
        return self.ns

    def advance(self, seconds: float) -> None:
        self.ns += int(seconds * 1e9)


class FakeDaemon:
    """The daemon's side of SimClient's connections, played by the test: a real ring and
    status page, Welcomes with their descriptors, Applied, Expirations."""

    def __init__(self, tag: str):
        self.listener = SimListener()
        self.listener.listening = True
        self.name = f"wheeld-test-sim-client-{os.getpid()}-{tag}"
        self.ring = ClientSegment.create(self.name, RING, TOUCH)
        self.status = StatusPage.create(self.name + "-status")
        self.status.publish(1 << 40, 0, 0)
        self.connection: SimConnection | None = None
        self.reader = FrameReader()
        self.received_fds: list[int] = []
        self.client_id = 3

    def accept(self) -> SimConnection:
        connection = self.listener.accept()
        assert connection is not None, "the client connected"
        self.connection = connection
        self.reader = FrameReader()
        return connection

    def read(self) -> list:
        """The client's messages that arrived; the descriptors kept in received_fds."""
        messages = []
        while (got := self.connection.take_for_daemon()) is not None:
            data, fds = got
            self.received_fds += fds
            if not data:
                messages.append("EOF")
                break
            messages += [M.decode_client_message(body) for body in self.reader.feed(data)]
        return messages

    def welcome(self, resumed: bool = False, ring: ClientSegment | None = None, epoch: int = EPOCH) -> None:
        ring = ring or self.ring
        welcome = M.Welcome(M.PROTOCOL_VERSION, self.client_id, ring.name, RING, TOUCH, "arena", 1, 1 << 40,
                            token=TOKEN, arena_epoch=epoch, status_page=True, resumed=resumed)
        frame = M.encode_daemon_frame(welcome)
        assert self.connection.daemon.send_with_fds(frame, [ring.fd, self.status.readonly_fd]) == len(frame)

    def send(self, message) -> None:
        frame = M.encode_daemon_frame(message)
        assert self.connection.daemon.send(frame) == len(frame)

    def records(self) -> list[tuple[int, int]]:
        """(op, seq) of each record the client pushed since the last call."""
        return [(int(r["op"]), int(r["seq"])) for r in self.ring.drain()]

    def close(self) -> None:
        for fd in self.received_fds:
            os.close(fd)
        self.received_fds = []
        if self.connection is not None:
            self.connection.discard()
        self.ring.close()
        self.status.close()


@pytest.fixture
def world():
    clock = Clock()
    daemon = FakeDaemon(str(id(clock)))
    clients: list[SimClient] = []

    def client(**kwargs) -> SimClient:
        c = SimClient(lambda: daemon.listener.connect(4000 + len(clients), 1000, 1000), clock, pid=4000 + len(clients),
                      **kwargs)
        clients.append(c)
        return c

    with client_clock(clock):
        try:
            yield clock, daemon, client
        finally:
            for c in clients:
                c.crash()
            daemon.close()


def open_session(daemon: FakeDaemon, client: SimClient) -> M.Hello:
    client.connect()
    daemon.accept()
    (hello,) = daemon.read()
    daemon.welcome()
    client.poll()
    assert client.connected
    return hello


# ------------------------------------------------------------------------ the connection


def test_a_connection_is_bounded_and_a_daemon_send_takes_what_fits():
    connection = SimConnection((1, 2, 3), capacity=10)
    try:
        assert connection.daemon.send(b"0123456") == 7
        assert connection.daemon.send(b"789abc") == 3, "a partial send, as a full socket buffer gives"
        assert connection.daemon.send(b"x") == 0
        with pytest.raises(BlockingIOError):
            connection.daemon.send_with_fds(b"y", [])
        connection.daemon.want_writable(True)
        assert not connection.writable_due(), "no room yet"
        assert connection.client.recv(4) == (b"0123", [])
        assert connection.writable_due(), "the reader made room: the daemon is told it can write"
        assert connection.client.recv(100) == (b"456789", [])
        assert connection.client.recv(100) is None, "nothing waiting, not closed"
        with pytest.raises(BlockingIOError):  # a client frame goes whole or not at all
            connection.client.send(b"a" * 11)
        connection.client.send(b"hello")
        assert connection.take_for_daemon() == (b"hello", [])
        assert connection.take_for_daemon() is None
        connection.client.close()
        assert connection.take_for_daemon() == (b"", []), "the connection-closed event"
        with pytest.raises(BrokenPipeError):
            connection.daemon.send(b"late")
    finally:
        connection.discard()


def test_descriptors_travel_with_their_first_byte_and_those_never_read_are_closed():
    before = open_fds()
    r, w = os.pipe()
    connection = SimConnection((1, 2, 3), hold=True)
    try:
        connection.daemon.send(b"ab")
        assert connection.daemon.send_with_fds(b"cd", [r]) == 2
        connection.daemon.send(b"ef")
        assert connection.client.recv() is None, "held until the simulator delivers it"
        assert connection.deliver(3) == 3
        assert connection.client.recv() == (b"ab", []), "a read stops before a chunk with descriptors"
        data, fds = connection.client.recv()
        assert data == b"c" and len(fds) == 1 and fds[0] != r and same_file(fds[0], r), "a copy, as SCM_RIGHTS"
        os.close(fds[0])
        connection.deliver()
        assert connection.client.recv() == (b"def", [])
        connection.daemon.send_with_fds(b"gh", [w, r])
        assert connection.fds_in_flight() == 2
        connection.client.close()  # never read: the kernel closes them with the socket
        assert connection.fds_in_flight() == 0
    finally:
        connection.discard()
        os.close(r)
        os.close(w)
    assert open_fds() == before


def test_a_cut_connection_lets_the_client_read_what_was_sent_then_eof():
    connection = SimConnection((1, 2, 3), hold=True)
    connection.daemon.send(b"last words")
    connection.client.send(b"unread")
    connection.cut()
    assert connection.client.recv() == (b"last words", [])
    assert connection.client.recv() == (b"", [])
    with pytest.raises(BrokenPipeError):
        connection.client.send(b"x")
    assert connection.take_for_daemon() is None, "the daemon is gone: nobody reads"
    assert isinstance(connection.daemon, DaemonEnd)
    connection.discard()


def test_the_listener_refuses_when_nothing_listens_and_resets_the_backlog_when_it_stops():
    listener = SimListener()
    with pytest.raises(ConnectionRefusedError):
        listener.connect(1, 2, 3)
    listener.listening = True
    end = listener.connect(1, 2, 3)
    listener.stop()
    assert end.recv() == (b"", [])
    assert listener.accept() is None


# ------------------------------------------------------------------------ the client's clock


def test_every_clock_the_client_reads_is_the_replaced_one(world):
    clock, daemon, client = world
    c = client()
    open_session(daemon, c)
    deadline = c.add("k", 1000)
    assert deadline == -(-clock.ns // 1_000_000) + 1000, "add: the deadline from the simulated clock, rounded up"
    clock.advance(0.0005)
    deadline = c.add_idle("idle", 5000)
    assert deadline == -(-clock.ns // 1_000_000) + 5000
    index = c._touch_by_key["idle"]
    clock.advance(2.0)
    c.touch("idle")
    touched = -(-clock.ns // 1_000_000)
    assert daemon.ring.read_touch(index) == touched, "touch stores the simulated clock"
    daemon.records()
    # the idle timer's expiration, fired before the touch the daemon has not seen: not
    # handed over (it would be early) but armed again, for the last touch + idle_ms
    tag = latest_tag(c, "idle")
    daemon.send(M.Expirations([M.Expiry.for_key("idle", deadline, deadline, tag, 9, 1)]))
    assert c.poll().expired == []
    # the copy's acknowledgement first, then the re-arm: its record is released before the
    # new arming needs one (a group at its quota does not refuse the re-arm)
    (ack, _), (op, _seq) = daemon.records()
    assert ack == C.ACK and op == C.ADD_IDLE
    assert c._rearms_pending == [] and latest_tag(c, "idle") != tag
    clock.advance(5.001)  # now past last touch + idle_ms on the simulated clock: due
    tag = latest_tag(c, "idle")
    daemon.send(M.Expirations([M.Expiry.for_key("idle", touched + 5000, touched + 5000, tag, 10, 1)]))
    assert [e.key for e in c.poll().expired] == ["idle"]


QUOTA = 4


def _apply_and_journal(executor: Executor, cs: ClientSlot, records, now_ms: int) -> list:
    """The daemon's apply of a drained chunk, committed to its journal: its rejections."""
    _flushes, rejects = executor.apply(cs, records)
    if executor.recorder is not None:
        executor.recorder.commit(now_ms)
    return rejects


def _rebuilt_from(directory, clock: Clock) -> TimerWheel:
    """The arena a daemon makes from the journal after the old one was lost."""
    wheel = TimerWheel.create(64, start_ms=clock.ns // 1_000_000)
    load_recovered(wheel, recover_journal(str(directory)), str(directory))
    return wheel


def test_an_arming_of_the_application_supersedes_a_rearm_of_ours_still_waiting_for_room(world):
    """A copy of an idle timer touched after it fired is armed again by the library
    (``_stale_idle``), the acknowledgement and the ADD_IDLE pushed together once the ring
    has room for both. When the application arms the key meanwhile, the re-arm must not
    follow its command: pushed later, it put the older arming back over the application's,
    whose timer was then never handed (simulator seed 703434, ``[lost]``). It is dropped;
    the copy is still acknowledged."""
    clock, daemon, client = world
    c = client()
    open_session(daemon, c)
    deadline = c.add_idle("idle", 5000)
    clock.advance(2.0)
    c.touch("idle")
    daemon.records()
    filler = 0
    while c._segment.free_slots() > 1:  # room for one record: not for a re-arm's two
        c.add(f"filler-{filler}", 60_000)
        filler += 1
    tag = latest_tag(c, "idle")
    daemon.send(M.Expirations([M.Expiry.for_key("idle", deadline, deadline, tag, 9, 1)]))
    assert c.poll().expired == []
    assert len(c._rearms_pending) == 1, "the re-arm waits for room"
    armed = c.add("idle", 0)  # the application's arming takes the last slot
    assert c._rearms_pending == []
    pushed = daemon.records()
    assert pushed[-1] == (C.ADD, latest_tag(c, "idle"))
    assert not any(op == C.ADD_IDLE for op, _seq in pushed)
    c.poll()  # the copy's acknowledgement, and nothing else for the key
    assert daemon.records() == [(C.ACK, EPOCH)]
    daemon.send(M.Expirations([M.Expiry.for_key("idle", armed, armed, latest_tag(c, "idle"), 10, 1)]))
    assert [e.key for e in c.poll().expired] == ["idle"]


@pytest.mark.parametrize("order", ["copy-first", "refusal-first"])
@pytest.mark.parametrize("at_quota", [True, False], ids=["at-quota", "below-quota"])
def test_a_rearm_whose_ack_named_a_lost_arena_is_pushed_again_with_the_copy(world, tmp_path, at_quota, order):
    """Simulation seed 90834: a library re-armed an idle timer touched after it fired (the
    ACK of the copy, an ADD_IDLE behind it) and the arena was lost before the daemon read
    the two. The daemon that rebuilt the arena from the journal restored the fired record,
    ignored the ACK (it names the lost arena) and, the group at its --group-quota with the
    restored record counted, refused the ADD_IDLE; the library had taken the re-arm for the
    key's latest arming, so it acknowledged and dropped the copy sent again: the timer was
    never handed. The copy that comes back is re-armed again behind its new handle's ACK
    (``ClientSession._rearm_again``), which releases the record first, and the refusal of the
    library's own re-arm is no refusal of the application's (``flush()`` raises nothing)."""
    clock, daemon, client = world
    clock.ns = time.monotonic_ns()  # the journal converts deadlines with the real clocks
    directory = tmp_path / "journal"
    c = client()
    open_session(daemon, c)
    old = TimerWheel.create(64, start_ms=clock.ns // 1_000_000)
    journal = Journal(directory, fsync="always", host="sim", name="test")
    try:
        recorder = Recorder(journal, old)
        cs = ClientSlot(daemon.client_id, None, "test", old.group_id("g"), "g", os.getpid(), os.getuid())
        executor = Executor(old, {cs.slot: cs}, EPOCH, QUOTA, collections.Counter(), _poisoned,
                            lambda: clock.ns // 1_000_000, recorder)
        for n in range(QUOTA - 1 if at_quota else 1):  # the group's other timers, far ahead
            c.add(f"p{n}", 600_000)
        deadline = c.add_idle("idle", 5000)
        first = latest_tag(c, "idle")
        assert _apply_and_journal(executor, cs, daemon.ring.drain(), clock.ns // 1_000_000) == []
        clock.advance(5.0)
        recorder.begin()
        (slot,) = old.expire(deadline)
        key, _deadline, gid, tag, _aux, generation = old.fired(slot)
        recorder.fired(gid, key, deadline, tag, deadline, False, 5000)
        recorder.commit(deadline)
        c.touch("idle")  # after the daemon read the touch word: the copy would be early
        touched = -(-clock.ns // 1_000_000)
        daemon.send(M.Expirations([M.Expiry.for_key("idle", deadline, deadline, first, slot, generation)]))
        assert c.poll().expired == []
        pair = daemon.ring.drain()  # ACK of the copy (naming this arena), ADD_IDLE: never read by this daemon
        assert [int(op) for op in pair["op"]] == [C.ACK, C.ADD_IDLE]
    finally:
        journal.close()
        old.close()
    # the arena is lost; the next daemon rebuilds it from the journal and takes the ring back
    new = _rebuilt_from(directory, clock)
    try:
        gid = new.group_id("g")
        (restored,) = new.fired_slots()
        assert new.fired(restored)[0] == "idle" and new.fired(restored)[3] == first
        assert new.group_live(gid) == (QUOTA if at_quota else 2)
        cs = ClientSlot(daemon.client_id, None, "test", gid, "g", os.getpid(), os.getuid())
        rebuilt = Executor(new, {cs.slot: cs}, EPOCH + 1, QUOTA, collections.Counter(), _poisoned,
                           lambda: clock.ns // 1_000_000)
        refusals = _apply_and_journal(rebuilt, cs, pair, clock.ns // 1_000_000)
        rearm = int(pair["seq"][1])
        assert [r.seq for r in refusals] == ([rearm] if at_quota else []), "the ACK released nothing"
        assert new.fired_slots() == [restored]
        daemon.connection.cut()
        c.poll()  # the connection's end: a new one at once, the ring handed back
        daemon.accept()
        daemon.read()
        daemon.welcome(resumed=True, epoch=EPOCH + 1)
        c.poll()
        assert c.connected
        # the rebuilt arena's copy of the fired record, and the refusal, in either order
        copy = M.Expirations([M.Expiry.for_key("idle", deadline, clock.ns // 1_000_000, first, restored,
                                               new.fired(restored)[5])])
        answers = [r.message() for r in refusals]
        for message in ([copy, *answers] if order == "copy-first" else [*answers, copy]):
            daemon.send(message)
        assert c.poll().expired == [], "touched since: not handed (it would be early)"
        number = c.flush()
        records = daemon.ring.drain()
        assert [int(op) for op in records["op"]] == [C.ACK, C.ADD_IDLE, C.FLUSH]
        assert _apply_and_journal(rebuilt, cs, records, clock.ns // 1_000_000) == []
        assert new.fired_slots() == [] and new.lookup("idle", gid) == touched + 5000
        assert new.group_live(gid) <= QUOTA
        daemon.send(M.Applied(int(records["seq"][2])))
        assert c.poll().flushed == [(number, None)], "the library's own re-arm was refused, no command of the app"
        assert c.rejected() == []
        # due at last touch + idle_ms: handed once
        clock.advance(5.001)
        (slot,) = new.expire(touched + 5000)
        _key, _deadline, _gid, tag, _aux, generation = new.fired(slot)
        assert tag == latest_tag(c, "idle")
        daemon.send(M.Expirations([M.Expiry.for_key("idle", touched + 5000, touched + 5000, tag, slot, generation)]))
        assert [e.key for e in c.poll().expired] == ["idle"]
    finally:
        new.close()


def _poisoned(cs, reason):
    raise AssertionError(f"poisoned: {reason}")


def test_the_real_clock_comes_back():
    core = client_core.ClientCore("/nonexistent", "g", 1.0, 1.0, "")
    core.max_delay_ms = 1 << 40
    client_core._set_clock(lambda: 5 * 10**18)
    try:
        with pytest.raises(wheeld.InvalidDelay):
            core._deadline(-1)
        assert core._deadline(10) == 5 * 10**12 + 10
    finally:
        client_core._set_clock(None)
    now = -(-time.monotonic_ns() // 1_000_000)
    assert now <= core._deadline(10) - 10 <= now + 1000
    with pytest.raises(TypeError):
        client_core._set_clock(123)


# ------------------------------------------------------------------------ never blocking


def test_a_full_ring_raises_ringfull_at_once_and_rings_the_daemon(world):
    clock, daemon, client = world
    c = client()
    open_session(daemon, c)
    daemon.read()
    pushed = 0
    with pytest.raises(wheeld.RingFull):
        for i in range(RING + 1):
            c.add(f"k{i}", 60_000)
            pushed += 1
    assert pushed == RING, "every slot used, then RingFull with no wait"
    assert M.Doorbell(urgent=True) in daemon.read(), "the daemon is woken to drain"
    with pytest.raises(wheeld.RingFull):
        c.cancel("k0")
    with pytest.raises(wheeld.RingFull):
        c.flush()
    assert len(daemon.records()) == RING
    c.add("again", 60_000)  # room again
    assert daemon.records()[0][0] == C.ADD


def test_the_blocking_client_still_waits_for_room():
    """The wait is the blocking shell's: wheeld.sync.Client waits for room (up to
    ring_timeout_s) where the state machine alone raises at once."""
    from wheeld.handshake import Reconnection
    from wheeld.sync import Client

    name = f"wheeld-test-sim-client-sync-{os.getpid()}"
    ring = ClientSegment.create(name, RING, TOUCH)
    status = StatusPage.create(name + "-status")
    status.publish(1 << 40, 0, 0)
    w = Client.__new__(Client)  # no daemon: the test opens the session by hand
    client_core.ClientCore.__init__(w, "/nonexistent", "g", 5.0, 1.0, "")
    w._sock = None
    w._reconnection = Reconnection(w.socket_path, 1.0)
    welcome = M.Welcome(M.PROTOCOL_VERSION, 1, name, RING, TOUCH, "arena", 1, 1 << 40, arena_epoch=EPOCH,
                        status_page=True)
    w._on_welcome(welcome, [os.dup(ring.fd), os.dup(status.readonly_fd)])
    try:
        for i in range(RING):
            w.add(f"k{i}", 60_000)
        done = threading.Event()
        thread = threading.Thread(target=lambda: (w.add("waits", 60_000), done.set()), daemon=True)
        thread.start()
        assert not done.wait(0.2), "the blocking client waits while the ring is full"
        ring.drain()
        assert done.wait(10), "and goes on once the daemon made room"
        thread.join()
        w.ring_timeout_s = 0.05
        for i in range(RING - 1):
            w.add(f"m{i}", 60_000)
        with pytest.raises(wheeld.RingFull):
            w.add("never", 60_000)
    finally:
        w._closed = True
        w._release_local()
        ring.close()
        status.close()


# ------------------------------------------------------------------------ the session


def test_hello_welcome_commands_flush_and_expirations_over_the_simulated_connection(world):
    clock, daemon, client = world
    c = client(group="jobs", client_name="sim-a")
    before = open_fds()
    hello = open_session(daemon, c)
    assert (hello.group, hello.pid, hello.client_name, hello.resume_segment) == ("jobs", 4000, "sim-a", "")
    assert daemon.received_fds == [], "a first Hello hands no ring"
    assert c._segment is not None and c._segment.same_file(daemon.ring.fd), "the ring came with the Welcome"
    assert c._status is not None
    assert open_fds() > before, "the ring and the status page, mapped from their descriptors"
    c.add("a", 100)
    c.add(7, 100)
    c.add(b"\x00raw", 100)
    assert c.cancel(7) is True
    c.add_idle("i", 1000)
    seq = c.flush()
    assert [op for op, _ in daemon.records()] == [C.ADD, C.ADD, C.ADD, C.CANCEL, C.ADD_IDLE, C.FLUSH]
    assert M.Doorbell(urgent=True) in daemon.read(), "a flush rings"
    assert c.poll().flushed == [], "not answered yet"
    assert c.pending_flushes() == [seq]
    tags = {key: latest_tag(c, key) for key in ("a",)}
    daemon.send(M.Applied(seq))
    daemon.send(M.Expirations([M.Expiry.for_key("a", 5, 6, tags["a"], 11, 2)]))
    polled = c.poll()
    assert polled.flushed == [(seq, None)]
    assert polled.expired == [wheeld.Expired("a", 5, 6)]
    assert daemon.records() == [], "acknowledged at the next poll, not before"
    c.poll()
    ((op, _),) = daemon.records()
    assert op == C.ACK
    # a refused add: the flush after it reports the error the blocking flush raises
    c.add("b", 100)
    seq = c.flush()
    daemon.send(M.Rejected(seq - 1, *encode_key("b"), "the arena is full", M.Rejected.ARENA_FULL))
    daemon.send(M.Applied(seq))
    ((done, error),) = c.poll().flushed
    assert done == seq and isinstance(error, wheeld.ArenaFull)
    c.close()
    assert daemon.read()[-2:] == [M.Bye(), "EOF"]
    assert open_fds() == before, "closing unmapped and closed everything"


def test_a_lost_daemon_gets_the_ring_handed_back_and_the_flush_answered_by_the_next(world):
    clock, daemon, client = world
    c = client()
    open_session(daemon, c)
    c.add("x", 500)
    seq = c.flush()
    daemon.connection.cut()  # the daemon dies before answering
    daemon.records()
    c.poll()  # EOF: a new connection at once, with the ring handed back
    assert not c.connected
    daemon.accept()
    (hello,) = daemon.read()
    assert hello.resume_segment == daemon.ring.name and hello.resume_token == TOKEN
    assert (hello.replay_epoch, hello.replay_from) == (EPOCH, 0), "nothing acknowledged yet: replay all"
    (handed,) = daemon.received_fds
    assert same_file(handed, daemon.ring.fd), "the ring travelled with the Hello"
    daemon.welcome(resumed=True)
    assert c.poll().flushed == []
    assert c.connected and c._segment.same_file(daemon.ring.fd)
    daemon.send(M.Applied(seq))  # the new daemon applies the ring and answers
    assert c.poll().flushed == [(seq, None)]
    assert c._replay_from == c._segment._tail


def _flushed_session(daemon, c) -> None:
    """A session with one add, flushed and acknowledged: the replay position is after it."""
    open_session(daemon, c)
    c.add("x", 500)
    seq = c.flush()
    daemon.records()
    daemon.send(M.Applied(seq))
    c.poll()


def test_a_hello_offering_a_replay_keeps_what_it_replays_until_the_welcome(world):
    """A daemon with another arena rewinds the ring handed back to replay_from and applies it
    again: from the Hello that offers it to the Welcome, the library counts the ring's room
    from replay_from, not from the lost daemon's head, so its pushes meanwhile overwrite
    nothing still to replay; the Welcome lifts that (the daemon published the rewound head)."""
    clock, daemon, client = world
    c = client()
    _flushed_session(daemon, c)
    replay_from = c._replay_from
    for n in range(10):
        c.add(f"y{n}", 500)
    daemon.records()  # the lost daemon applied them (and published its head) without a flush
    seg = c._segment
    assert seg.free_slots() == RING
    daemon.connection.cut()
    c.poll()  # EOF: a new connection at once, the Hello offering the replay
    daemon.accept()
    (hello,) = daemon.read()
    assert (hello.replay_epoch, hello.replay_from) == (EPOCH, replay_from)
    assert seg.free_slots() == RING - 10, "the ten commands after the acknowledged flush are kept"
    c.add("z", 500)
    assert seg.free_slots() == RING - 11
    (handed,) = daemon.received_fds
    daemon.received_fds = []
    adopted = ClientSegment.adopt(handed, "adopted", RING, TOUCH, rewind_to=replay_from)  # a rebuilt arena's daemon
    try:
        daemon.welcome(resumed=True)
        c.poll()
        assert c.connected and seg is c._segment
        assert seg.free_slots() == RING - 11, "from the head word again: the head the daemon rewound to"
        assert [op for op in adopted.drain()["op"]] == [C.ADD] * 11
        assert seg.free_slots() == RING
    finally:
        adopted.close()


def test_a_failed_attempt_counts_the_ring_from_its_head_word_again(world):
    clock, daemon, client = world
    c = client()
    _flushed_session(daemon, c)
    c.add("y", 500)
    daemon.records()
    seg = c._segment
    daemon.connection.cut()
    c.poll()  # a Hello offering the replay of "y"
    daemon.accept()
    daemon.read()
    assert seg.free_slots() == RING - 1
    daemon.connection.cut()  # the daemon dies before it answers: the attempt failed
    c.poll()
    assert seg.free_slots() == RING


def test_reconnecting_backs_off_on_the_simulated_clock_and_gives_up_with_brokenpeer(world):
    clock, daemon, client = world
    c = client(reconnect_timeout_s=2.0)
    open_session(daemon, c)
    daemon.listener.stop()
    daemon.connection.cut()
    attempts = []
    real_dial = c._dial_fn

    def counting_dial():
        attempts.append(clock.ns)
        return real_dial()

    c._dial_fn = counting_dial
    c.poll()
    assert len(attempts) == 1, "one attempt at once"
    c.poll()
    assert len(attempts) == 1, "then none before the pause is over"
    clock.advance(0.01)
    c.poll()
    clock.advance(0.015)
    c.poll()
    assert len(attempts) == 2, "the pause doubled"
    clock.advance(0.005)
    c.poll()
    assert len(attempts) == 3
    pauses = []
    with pytest.raises(wheeld.BrokenPeer, match="unreachable for 2 s"):
        for _ in range(1000):
            clock.advance(0.1)
            c.poll()
            pauses.append(len(attempts))
    gaps = [(b - a) / 1e9 for a, b in zip(attempts, attempts[1:])]
    assert max(gaps) <= 0.5 + 0.1 and round(gaps[-1], 1) == 0.5, gaps
    daemon.listener.listening = True  # back: the next poll tries again and opens a session
    clock.advance(1.0)
    c.poll()
    daemon.accept()
    assert isinstance(daemon.read()[0], M.Hello)
    daemon.welcome(resumed=True)
    c.poll()
    assert c.connected


def test_the_first_connect_fails_at_once_when_nothing_listens(world):
    clock, daemon, client = world
    daemon.listener.listening = False
    c = client()
    with pytest.raises(wheeld.DaemonNotRunning):
        c.connect()
    with pytest.raises(wheeld.Closed):
        c.poll()


def test_a_refusal_raises_its_error_and_closes_what_came_with_it(world):
    clock, daemon, client = world
    c = client()
    before = open_fds()
    c.connect()
    daemon.accept()
    daemon.read()
    daemon.send(M.Refused("not in the allowed groups", M.Refused.NOT_ALLOWED))
    with pytest.raises(wheeld.NotAllowed):
        c.poll()
    with pytest.raises(wheeld.Closed):
        c.add("k", 1)
    assert open_fds() == before


def test_each_expiration_handed_is_named_by_the_tag_of_its_own_record(world):
    """The checker learns which arming was handed from ready_tags: the item the library
    took, not the first one that looks like it. Seed 810039: a key re-armed with delay 0
    in the ms its first arming was due; both copies sat with a member that died and came
    back together, same key, deadline and fired time; the library dropped the old one."""
    clock, daemon, client = world
    c = client()
    open_session(daemon, c)
    c.add("k", 14)
    old = latest_tag(c, "k")
    c.add("k", 0)
    new = latest_tag(c, "k")
    daemon.records()
    daemon.send(M.Expirations([M.Expiry.for_key("k", 972, 1021, old, 5, 7),
                               M.Expiry.for_key("k", 972, 1021, new, 9, 1)]))
    assert [e.key for e in c.poll().expired] == ["k"], "the re-armed arming's copy is dropped"
    assert c.handed_tags == [new]


def test_a_goodbye_ends_the_session_and_the_client_comes_back(world):
    clock, daemon, client = world
    c = client()
    open_session(daemon, c)
    first = daemon.connection
    daemon.send(M.Goodbye("the daemon is stopping"))
    c.poll()
    assert first.client_closed and not c.connected
    daemon.accept()
    assert isinstance(daemon.read()[0], M.Hello)


def test_a_crash_sends_nothing_and_acknowledges_nothing(world):
    clock, daemon, client = world
    c = client()
    open_session(daemon, c)
    daemon.read()
    tag = None
    c.add("k", 10)
    tag = latest_tag(c, "k")
    daemon.records()
    daemon.send(M.Expirations([M.Expiry.for_key("k", 10, 11, tag, 1, 1)]))
    assert [e.key for e in c.poll().expired] == ["k"]
    c.crash()
    assert daemon.read() == ["EOF"], "no Bye"
    assert daemon.records() == [], "what was handed is never acknowledged"
    with pytest.raises(wheeld.Closed):
        c.poll()


def test_a_handshake_the_daemon_never_answers_is_given_up_and_tried_again(world):
    clock, daemon, client = world
    c = client(connect_timeout_s=1.0)
    c.connect()
    daemon.accept()
    daemon.read()
    clock.advance(0.5)
    c.poll()
    assert not c.connected
    with pytest.raises(wheeld.Timeout):
        clock.advance(0.6)
        c.poll()
