"""A simulated NATS JetStream cluster, and the part of ``nats-py`` the fleet tier calls, over it.

The fleet tier (:mod:`wheeld.fleet`) talks to NATS through a handful of ``nats-py``
calls. :func:`connector` gives the replicator (``Replicator(..., connect=...)``) a
``nats.connect`` of its own whose connection, JetStream context, key-value bucket and
ordered consumer have the same methods, answers and exceptions as ``nats-py``'s, over
:class:`Cluster`, a model of a three-server JetStream cluster in the simulated world:

* **Streams** (:class:`Stream`): messages numbered by sequence, per-subject last
  sequence, ``Nats-Expected-Last-Subject-Sequence`` checked first and then
  ``Nats-Msg-Id`` de-duplicated within the duplicate window (the stricter order: a
  retry whose first attempt was stored is refused with err_code 10071; nats-server
  2.15 de-duplicates first and answers it as a duplicate with the first attempt's
  sequence, which the replicator takes as stored all the same), purge of a subject below a sequence, ``max_age``
  expiring messages on the simulated clock, and one message per subject for a
  key-value bucket (``history=1``).
* **The key-value bucket** is such a stream (``KV_<bucket>``, subjects
  ``$KV.<bucket>.<key>``): a revision is a sequence, ``create`` is a write expecting
  no message on the key's subject, ``update(last=)`` a write expecting ``last``
  (compare-and-set), and the bucket's TTL is the stream's ``max_age``.
* **Servers** (:class:`Node`): three; a write is stored on every server that is up and
  acknowledged once a quorum (two) stored it; without a quorum (two servers down) or
  while a stream leader is elected (the leader died), nothing is answered: the client
  times out. A server that restarts catches up from the others a little later; one
  that **loses its disk** restarts empty (its copies gone) and catches up. The model
  counts what a disk loss takes: nothing acknowledged while a quorum keeps its disk
  (``Cluster.lost``; the simulator injects disk losses that leave a quorum).
* **The network** between a host and the cluster: each request reaches the cluster
  after a latency (now and then a spike of seconds: applied after the client gave up),
  or is lost before it is applied; each answer comes back after a latency, or is lost
  after the request was applied (the acknowledgement lost). Requests and answers of
  one connection keep their order (one TCP connection). A host **cut off** (a partition)
  reaches no server: its requests are not answered and it cannot connect.

Everything is decided by the cluster's own ``random.Random`` and the world's clock:
one seed, one history. What the checker reads: :meth:`Cluster.lease_of` (who holds a
host's lease now), ``Cluster.after_fence`` (writes of a host accepted after its fence)
and ``Cluster.lost``.

Not modelled: servers' clocks apart from the world's (a TTL expires exactly
``max_age`` after the write), a message stored on a minority and kept or dropped by the
next leader (a write is applied whole or not at all), consumers other than the ordered
one the takeover reads with, and the JetStream API's limits (sizes, counts).
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import nats.errors
from nats.js import api
from nats.js import errors as jse

__all__ = ["Cluster", "NetProfile", "Stream", "connector"]

QUORUM = 2
NODES = 3
MS = 1_000_000
EXPECT = "Nats-Expected-Last-Subject-Sequence"
MSG_ID = "Nats-Msg-Id"
KV_PREFIX = "KV_"


@dataclass
class NetProfile:
    """How the network between the hosts and the cluster behaves (per seed)."""

    latency_ms: float = 0.5  # the usual one-way latency (uniform from 0 to twice this)
    spike: float = 0.0  # per request or answer: a latency of 0.1 to 4 s instead
    lose_request: float = 0.0  # per request: lost before it reaches the cluster
    lose_answer: float = 0.0  # per request: applied, its answer lost
    no_responders: float = 0.0  # per publish while the stream has no leader: answered at once (503)


@dataclass
class Message:
    seq: int
    subject: str
    headers: dict[str, str]
    data: bytes
    time_ns: int
    holders: set[int]


class Stream:
    """One stream's messages, as its leader holds them (see the module docstring)."""

    def __init__(self, config: api.StreamConfig, created_ns: int):
        self.config = config
        self.name = config.name
        self.subjects = list(config.subjects or [])
        self.max_age_ns = int((config.max_age or 0) * 1e9)
        self.per_subject = config.max_msgs_per_subject if (config.max_msgs_per_subject or 0) > 0 else 0
        self.window_ns = int((config.duplicate_window or 120.0) * 1e9)
        self.messages: dict[int, Message] = {}  # by sequence, in order
        self.last_seq = 0
        self.last_of: dict[str, int] = {}  # subject -> sequence of its last message
        self.dedupe: dict[str, tuple[int, int]] = {}  # msg id -> (sequence, when stored)
        self.created_ns = created_ns

    def expire(self, now_ns: int) -> None:
        if not self.max_age_ns:
            return
        for seq in [s for s, m in self.messages.items() if m.time_ns + self.max_age_ns <= now_ns]:
            self._remove(seq)

    def _remove(self, seq: int) -> Message:
        msg = self.messages.pop(seq)
        if self.last_of.get(msg.subject) == seq:
            earlier = [s for s, m in self.messages.items() if m.subject == msg.subject]
            if earlier:
                self.last_of[msg.subject] = earlier[-1]
            else:
                del self.last_of[msg.subject]
        return msg

    def publish(self, subject: str, data: bytes, headers: dict[str, str], now_ns: int,
                holders: set[int]) -> api.PubAck:
        """Store one message: the expected last subject sequence first, then the msg id."""
        self.expire(now_ns)
        expected = headers.get(EXPECT)
        if expected is not None:
            last = self.last_of.get(subject, 0)
            if last != int(expected):
                raise jse.BadRequestError(code=400, err_code=10071, description=f"wrong last sequence: {last}",
                                          stream=self.name)
        msg_id = headers.get(MSG_ID)
        if msg_id:
            dedupe = self.dedupe  # (in the order stored: the oldest first)
            while dedupe and dedupe[next(iter(dedupe))][1] + self.window_ns <= now_ns:
                del dedupe[next(iter(dedupe))]
            if msg_id in self.dedupe:
                return api.PubAck(stream=self.name, seq=self.dedupe[msg_id][0], duplicate=True)
        self.last_seq += 1
        seq = self.last_seq
        self.messages[seq] = Message(seq, subject, dict(headers), bytes(data), now_ns, set(holders))
        self.last_of[subject] = seq
        if msg_id:
            self.dedupe[msg_id] = (seq, now_ns)
        if self.per_subject:
            older = [s for s, m in self.messages.items() if m.subject == subject and s != seq]
            for s in older[: max(0, len(older) + 1 - self.per_subject)]:
                self._remove(s)
        return api.PubAck(stream=self.name, seq=seq)

    def last(self, subject: str, now_ns: int) -> Message | None:
        self.expire(now_ns)
        seq = self.last_of.get(subject)
        return self.messages[seq] if seq is not None else None

    def purge(self, below: int | None, subject: str | None) -> int:
        """Remove the messages (of ``subject``) below sequence ``below`` (all without it)."""
        gone = [s for s, m in self.messages.items()
                if (below is None or s < below) and (subject is None or m.subject == subject)]
        for s in gone:
            self._remove(s)
        return len(gone)

    def first_seq(self) -> int:
        return next(iter(self.messages)) if self.messages else self.last_seq + 1

    def info(self, now_ns: int) -> api.StreamInfo:
        self.expire(now_ns)
        state = api.StreamState(messages=len(self.messages), bytes=sum(len(m.data) for m in self.messages.values()),
                                first_seq=self.first_seq(), last_seq=self.last_seq, consumer_count=0)
        return api.StreamInfo(config=self.config, state=state)

    def next_from(self, seq: int, subject: str, now_ns: int) -> Message | None:
        self.expire(now_ns)
        for s, m in self.messages.items():
            if s >= seq and m.subject == subject:
                return m
        return None


@dataclass
class Node:
    up: bool = True
    wiped: bool = False  # restarted without its disk, not caught up yet


@dataclass
class LeaseWatch:
    """What a replicator's own lease requests came to, as its host saw them (the checker's
    "could it reach the cluster"): None before any answer or failure."""

    reached: bool | None = None
    claimed: bool = False  # its lease was claimed once (its first own-key create or update answered)
    history: list = field(default_factory=list)  # (ns, reached)

    def note(self, now_ns: int, reached: bool) -> None:
        self.reached = reached
        self.history.append((now_ns, reached))


class Connection:
    """One daemon process's connection to the cluster (dies with the process)."""

    def __init__(self, cluster: Cluster, host: str, watch: LeaseWatch | None):
        self.cluster = cluster
        self.host = host
        self.watch = watch
        self.dead = False
        self.closed = False
        self.failed_ns = -1  # when a request last went unanswered (timed out, or no leader answered)
        self.net_trouble_ns = -1  # when the network last lost or delayed (a spike) one of its requests
        self.arrive_ns = 0  # the last request's arrival at the cluster (requests keep their order)
        self.answer_ns = 0  # the last answer's arrival back (answers keep theirs)


class Cluster:
    """The servers, their streams, and the network to them (module docstring)."""

    def __init__(self, world, rng: random.Random, net: NetProfile | None = None, faults: Counter | None = None):
        self.world = world
        self.rng = rng
        self.net = net or NetProfile()
        self.faults = faults if faults is not None else Counter()
        self.nodes = [Node() for _ in range(NODES)]
        self.leader = 0
        self.election_until_ns = 0
        self.streams: dict[str, Stream] = {}
        self.cut_off: set[str] = set()  # hosts that reach no server
        self.fences: dict[str, int] = {}  # stream -> sequence of its first fence
        self.after_fence: list[str] = []  # writes of a host accepted after its fence (the checker's)
        self.lost: list[str] = []  # messages no server holds any more (a disk loss took the last copy)
        self.on_note: Callable[[str], None] | None = None
        self.script: Callable[[str, str], object] | None = None  # (host, request) -> its fate (a test's)
        self.unavailable_ns = -1  # the last moment a request found no leader (no quorum, an election)
        self.on_claim: Callable[[str, str], None] | None = None  # (claimer, host): a host's lease key created

    def note(self, text: str) -> None:
        if self.on_note is not None:
            self.on_note(text)

    # ------------------------------------------------------------------ servers
    def up_nodes(self) -> set[int]:
        return {i for i, n in enumerate(self.nodes) if n.up}

    def quorum(self) -> bool:
        return len(self.up_nodes()) >= QUORUM

    def available(self) -> bool:
        """Whether the streams have leaders: a quorum, and no election under way."""
        return self.quorum() and self.world.now_ns >= self.election_until_ns

    def crash_node(self, index: int, wipe: bool = False) -> None:
        node = self.nodes[index]
        node.up = False
        if wipe:
            node.wiped = True
            for stream in self.streams.values():
                for msg in list(stream.messages.values()):
                    msg.holders.discard(index)
                    if not msg.holders:
                        self.lost.append(f"{stream.name} sequence {msg.seq}")
                        stream._remove(msg.seq)
        if index == self.leader:
            others = sorted(self.up_nodes())
            self.leader = others[0] if others else index
            self.election_until_ns = self.world.now_ns + int(self.rng.uniform(200, 2000) * MS)
            self.faults["nats leader election"] += 1
        self.note(f"nats server {index} down{' and its disk lost' if wipe else ''}")

    def restart_node(self, index: int) -> None:
        self.nodes[index].up = True
        if not self.nodes[self.leader].up:
            self.leader = index
        self.note(f"nats server {index} up")
        self.world.after_ms(self.rng.uniform(10, 1000), lambda: self._caught_up(index))

    def _caught_up(self, index: int) -> None:
        node = self.nodes[index]
        if not node.up or not self.quorum():
            if node.up:
                self.world.after_ms(500, lambda: self._caught_up(index))
            return
        node.wiped = False
        for stream in self.streams.values():
            for msg in stream.messages.values():
                msg.holders.add(index)

    def may_wipe(self, index: int) -> bool:
        """Whether server ``index`` may lose its disk while a quorum keeps every message."""
        return all(len(m.holders - {index}) >= QUORUM for s in self.streams.values() for m in s.messages.values())

    # ------------------------------------------------------------------ the network
    def reachable(self, host: str) -> bool:
        return host not in self.cut_off and bool(self.up_nodes())

    def _latency_ns(self) -> int:
        if self.net.spike and self.rng.random() < self.net.spike:
            self.faults["nats latency spike"] += 1
            return int(self.rng.uniform(100, 4000) * MS)
        return int(self.rng.uniform(0, 2 * self.net.latency_ms) * MS) + 1

    def request(self, conn: Connection, apply: Callable[[int], object], fut: asyncio.Future,
                publish: bool = False, what: str = "") -> None:
        """Send a request: ``apply(now_ns)`` runs at the cluster (its result or the nats error
        it raises is the answer), unless the request is lost on the way. ``script`` (a test's)
        may decide a request's fate: ``"lose request"``, ``"lose answer"``, or a latency in ms."""
        if not self.reachable(conn.host):
            return
        fate = self.script(conn.host, what) if self.script is not None else None
        if fate == "lose request" or (fate is None and self.net.lose_request and
                                      self.rng.random() < self.net.lose_request):
            self.faults["nats request lost"] += 1
            conn.net_trouble_ns = self.world.now_ns
            return
        latency = int(fate * MS) if isinstance(fate, (int, float)) else self._latency_ns()
        if latency >= 100 * MS:
            conn.net_trouble_ns = self.world.now_ns + latency
        at = max(self.world.now_ns + latency, conn.arrive_ns)
        conn.arrive_ns = at
        self.world.at(at, lambda: self._arrive(conn, apply, fut, publish, fate == "lose answer"))

    def _arrive(self, conn: Connection, apply, fut, publish: bool, lose_answer: bool) -> None:
        if not self.reachable(conn.host):
            return
        if not self.available():
            self.unavailable_ns = self.world.now_ns
            if publish and self.net.no_responders and self.rng.random() < self.net.no_responders:
                self._answer(conn, fut, None, jse.NoStreamResponseError())
            return  # no leader: nothing answers, the client times out
        try:
            result, error = apply(self.world.now_ns), None
        except (jse.Error, nats.errors.Error) as exc:
            result, error = None, exc
        if lose_answer or (self.net.lose_answer and self.rng.random() < self.net.lose_answer):
            self.faults["nats answer lost (request applied)"] += 1
            conn.net_trouble_ns = self.world.now_ns
            return
        self._answer(conn, fut, result, error)

    def _answer(self, conn: Connection, fut, result, error) -> None:
        latency = self._latency_ns()
        if latency >= 100 * MS:
            conn.net_trouble_ns = self.world.now_ns + latency
        at = max(self.world.now_ns + latency, conn.answer_ns)
        conn.answer_ns = at

        def deliver() -> None:
            if conn.dead or fut.done() or conn.host in self.cut_off:
                return
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)
        self.world.at(at, deliver)

    # ------------------------------------------------------------------ streams (at the leader)
    def stream(self, name: str) -> Stream:
        stream = self.streams.get(name)
        if stream is None:
            raise jse.NotFoundError(code=404, err_code=10059, description="stream not found")
        return stream

    def add_stream(self, config: api.StreamConfig, now_ns: int) -> api.StreamInfo:
        if config.name not in self.streams:
            self.streams[config.name] = Stream(config, now_ns)
        return self.streams[config.name].info(now_ns)

    def stream_for(self, subject: str) -> Stream | None:
        for stream in self.streams.values():
            for pattern in stream.subjects:
                if pattern == subject or (pattern.endswith(">") and subject.startswith(pattern[:-1])):
                    return stream
        return None

    def publish(self, subject: str, data: bytes, headers: dict[str, str], now_ns: int,
                stream_name: str | None = None) -> api.PubAck:
        stream = self.stream_for(subject)
        if stream is None or (stream_name is not None and stream.name != stream_name):
            raise jse.NoStreamResponseError()
        ack = stream.publish(subject, data, headers, now_ns, self.up_nodes())
        if not ack.duplicate:
            self._watch_fence(stream, headers, ack.seq)
            if headers.get(EXPECT) == "0" and stream.name.startswith(KV_PREFIX) and self.on_claim is not None:
                holder = msgspec.json.decode(data).get("holder", "") if data else ""
                key = subject.rsplit(".", 1)[1]
                if holder != key:
                    self.on_claim(holder, key)
        return ack

    def _watch_fence(self, stream: Stream, headers: dict[str, str], seq: int) -> None:
        """A host's write stored after a fence of its stream: the checker's "no stream write
        accepted after its fence"."""
        if not stream.name.startswith("WHEELD_"):
            return
        host = stream.name[len("WHEELD_"):]
        if headers.get("Wheeld-Kind") == "fence":
            self.fences.setdefault(stream.name, seq)
        elif stream.name in self.fences and headers.get("Wheeld-Host") == host:
            self.after_fence.append(f"{stream.name}: {headers.get('Wheeld-Kind')} lsn {headers.get('Wheeld-Lsn')} "
                                    f"epoch {headers.get('Wheeld-Epoch')} stored at sequence {seq}, after the fence "
                                    f"at sequence {self.fences[stream.name]}")

    # ------------------------------------------------------------------ leases (for the checker)
    def lease_of(self, host: str, bucket: str = "WHEELD_LEASES") -> tuple[str, int] | None:
        """(holder, epoch) of ``host``'s lease key now, None when there is none (lapsed)."""
        stream = self.streams.get(KV_PREFIX + bucket)
        if stream is None:
            return None
        msg = stream.last(f"$KV.{bucket}.{host}", self.world.now_ns)
        if msg is None or not msg.data:
            return None
        lease = msgspec.json.decode(msg.data)
        return lease.get("holder", ""), int(lease.get("epoch", 0))


# ---------------------------------------------------------------------- the client side


class _Seq(msgspec.Struct):
    stream: int
    consumer: int = 0


class _Metadata(msgspec.Struct):
    sequence: _Seq


class _Msg(msgspec.Struct):
    """What an ordered consumer's ``next_msg`` returns (the fields the fleet reads)."""

    subject: str
    data: bytes
    headers: dict
    metadata: _Metadata


class Entry(msgspec.Struct):
    """A key-value entry (``nats.js.kv.KeyValue.Entry``'s fields the fleet reads)."""

    bucket: str
    key: str
    value: bytes
    revision: int


async def _call(conn: Connection, apply: Callable[[int], object], timeout: float, publish: bool = False,
                lease: bool = False, what: str = "request"):
    """One request and its answer, as nats-py's ``request``: ``nats.errors.TimeoutError`` when no
    answer came in ``timeout`` s. ``lease``: one of the host's own lease requests (LeaseWatch)."""
    loop = asyncio.get_running_loop()
    cluster = conn.cluster
    if conn.closed or conn.dead:
        raise nats.errors.ConnectionClosedError()
    fut = loop.create_future()
    cluster.request(conn, apply, fut, publish, what)
    watch = conn.watch if lease or (conn.watch is not None and not conn.watch.claimed) else None
    try:
        result = await asyncio.wait_for(fut, timeout)
    except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
        conn.failed_ns = cluster.world.now_ns
        if watch is not None:
            watch.note(cluster.world.now_ns, False)
        cancelled = isinstance(exc, asyncio.CancelledError)
        if cluster.on_note is not None:
            cluster.note(f"{conn.host}: {what}: {'cancelled' if cancelled else 'timed out'}")
        if cancelled:
            raise
        raise nats.errors.TimeoutError() from None
    except BaseException as exc:
        if isinstance(exc, _UNAVAILABLE):
            conn.failed_ns = cluster.world.now_ns
        if watch is not None and isinstance(exc, _UNAVAILABLE):
            watch.note(cluster.world.now_ns, False)  # no leader: the cluster (a quorum) was out of reach
        elif lease and watch is not None:
            watch.note(cluster.world.now_ns, True)  # an answer: an error, but the cluster was reached
        if cluster.on_note is not None:
            cluster.note(f"{conn.host}: {what}: {type(exc).__name__} {exc}")
        raise
    if lease and watch is not None:
        watch.note(cluster.world.now_ns, True)
    if cluster.on_note is not None:
        cluster.note(f"{conn.host}: {what}: {_short(result)}")
    return result


#: answers that say no stream leader answered (no quorum, an election): the cluster is out of reach
_UNAVAILABLE = (jse.NoStreamResponseError, jse.ServiceUnavailableError, nats.errors.NoRespondersError)


def _short(result) -> str:
    if isinstance(result, api.PubAck):
        return f"stored at {result.seq}{' (duplicate)' if result.duplicate else ''}"
    if isinstance(result, api.RawStreamMsg):
        return f"sequence {result.seq} {result.headers}"
    if isinstance(result, Entry):  # (the lease's wall-clock "t" is the real clock's: left out)
        lease = msgspec.json.decode(result.value) if result.value else {}
        return f"revision {result.revision} {({k: v for k, v in lease.items() if k != 't'})}"
    if isinstance(result, _Msg):
        return f"sequence {result.metadata.sequence.stream}"
    return str(result)[:80]


class SimKeyValue:
    """``nats.js.kv.KeyValue`` over the model: get, create, update(last=), keys, purge."""

    def __init__(self, js: SimJetStream, bucket: str):
        self._js = js
        self._conn = js._conn
        self.bucket = bucket
        self._stream = KV_PREFIX + bucket
        self._pre = f"$KV.{bucket}."

    def _own(self, key: str) -> bool:
        return self._conn.watch is not None and key == self._conn.host

    async def get(self, key: str) -> Entry:
        cluster, stream, subject = self._conn.cluster, self._stream, self._pre + key

        def apply(now_ns: int):
            msg = cluster.stream(stream).last(subject, now_ns)
            if msg is None:
                raise jse.KeyNotFoundError()
            return Entry(self.bucket, key, msg.data, msg.seq)
        return await _call(self._conn, apply, self._js._timeout, lease=self._own(key), what=f"kv get {key}")

    async def _write(self, key: str, value: bytes, last: int | None) -> int:
        cluster, subject = self._conn.cluster, self._pre + key
        headers = {EXPECT: str(last)} if last is not None else {}

        def apply(now_ns: int):
            try:
                return cluster.publish(subject, value, headers, now_ns).seq
            except jse.BadRequestError as exc:
                if exc.err_code == 10071:
                    raise jse.KeyWrongLastSequenceError(description=exc.description) from None
                raise
        own = self._own(key)
        revision = await _call(self._conn, apply, self._js._timeout, publish=True, lease=own,
                               what=f"kv write {key} last={last}")
        if own:
            self._conn.watch.claimed = True
        return revision

    async def create(self, key: str, value: bytes) -> int:
        return await self._write(key, value, 0)

    async def update(self, key: str, value: bytes, last: int | None = None) -> int:
        return await self._write(key, value, last if last is not None else 0)

    async def put(self, key: str, value: bytes) -> int:
        return await self._write(key, value, None)

    async def keys(self) -> list[str]:
        cluster, stream = self._conn.cluster, self._stream

        def apply(now_ns: int):
            s = cluster.stream(stream)
            s.expire(now_ns)
            found = sorted(subject[len(self._pre):] for subject in s.last_of)
            if not found:
                raise jse.NoKeysError()
            return found
        return await _call(self._conn, apply, self._js._timeout, what="kv keys")

    async def purge(self, key: str) -> bool:
        cluster, stream, subject = self._conn.cluster, self._stream, self._pre + key
        return await _call(self._conn, lambda now_ns: cluster.stream(stream).purge(None, subject) >= 0,
                           self._js._timeout, what=f"kv purge {key}")


class SimSubscription:
    """An ordered consumer from a start sequence: ``next_msg`` asks for the next message."""

    def __init__(self, js: SimJetStream, stream: str, subject: str, start: int):
        self._js = js
        self._stream = stream
        self._subject = subject
        self._next = start

    async def next_msg(self, timeout: float = 1.0) -> _Msg:
        cluster, stream, subject, start = self._js._conn.cluster, self._stream, self._subject, self._next

        def apply(now_ns: int):
            msg = cluster.stream(stream).next_from(start, subject, now_ns)
            if msg is None:
                raise _NoneYet()
            return _Msg(msg.subject, msg.data, dict(msg.headers), _Metadata(_Seq(msg.seq)))
        try:
            msg = await _call(self._js._conn, apply, timeout, what=f"next message of {stream} from {start}")
        except _NoneYet:
            await asyncio.sleep(timeout)  # nothing to deliver: the consumer waits, the call times out
            raise nats.errors.TimeoutError() from None
        self._next = msg.metadata.sequence.stream + 1
        return msg

    async def unsubscribe(self) -> None:
        pass


class _NoneYet(jse.Error):
    """(the model's) no message at or after the consumer's sequence yet."""


class SimJetStream:
    """``nats.js.JetStreamContext`` over the model (the calls the fleet makes)."""

    def __init__(self, conn: Connection, timeout: float):
        self._conn = conn
        self._timeout = timeout

    async def stream_info(self, name: str) -> api.StreamInfo:
        cluster = self._conn.cluster
        return await _call(self._conn, lambda now_ns: cluster.stream(name).info(now_ns), self._timeout,
                           what=f"stream info {name}")

    async def add_stream(self, config: api.StreamConfig | None = None, **params) -> api.StreamInfo:
        config = config or api.StreamConfig(**params)
        cluster = self._conn.cluster
        return await _call(self._conn, lambda now_ns: cluster.add_stream(config, now_ns), self._timeout,
                           what=f"add stream {config.name}")

    async def streams_info(self) -> list[api.StreamInfo]:
        cluster = self._conn.cluster
        return await _call(self._conn, lambda now_ns: [s.info(now_ns) for s in cluster.streams.values()],
                           self._timeout, what="streams info")

    async def publish(self, subject: str, payload: bytes = b"", timeout: float | None = None,
                      stream: str | None = None, headers: dict | None = None) -> api.PubAck:
        cluster, hdrs = self._conn.cluster, dict(headers or {})
        return await _call(self._conn, lambda now_ns: cluster.publish(subject, payload, hdrs, now_ns, stream),
                           timeout if timeout is not None else self._timeout, publish=True,
                           what=f"publish {hdrs.get('Wheeld-Kind')} {hdrs.get('Wheeld-Lsn')} to {subject} "
                                f"expecting {hdrs.get(EXPECT)}")

    async def get_msg(self, stream_name: str, seq: int | None = None, subject: str | None = None,
                      direct: bool = False, **_ignored) -> api.RawStreamMsg:
        cluster = self._conn.cluster

        def apply(now_ns: int):
            stream = cluster.stream(stream_name)
            msg = stream.last(subject, now_ns) if subject is not None else stream.messages.get(seq)
            if msg is None:
                raise jse.NotFoundError(code=404, err_code=10037, description="no message found")
            return api.RawStreamMsg(subject=msg.subject, seq=msg.seq, data=msg.data, headers=dict(msg.headers),
                                    stream=stream_name)
        return await _call(self._conn, apply, self._timeout, what=f"get last of {subject}")

    async def purge_stream(self, name: str, seq: int | None = None, subject: str | None = None,
                           keep: int | None = None) -> bool:
        cluster = self._conn.cluster
        return await _call(self._conn, lambda now_ns: cluster.stream(name).purge(seq, subject) >= 0, self._timeout,
                           what=f"purge {name} below {seq}")

    async def subscribe(self, subject: str, ordered_consumer: bool = False, stream: str | None = None,
                        config: api.ConsumerConfig | None = None, **_ignored) -> SimSubscription:
        cluster = self._conn.cluster
        name = stream or cluster.stream_for(subject).name
        start = (config.opt_start_seq or 1) if config is not None else 1
        await _call(self._conn, lambda now_ns: bool(cluster.stream(name)), self._timeout,  # the consumer is made
                    what=f"subscribe {name} from {start}")
        return SimSubscription(self, name, subject, start)

    async def key_value(self, bucket: str) -> SimKeyValue:
        cluster = self._conn.cluster

        def apply(now_ns: int):
            if KV_PREFIX + bucket not in cluster.streams:
                raise jse.BucketNotFoundError(code=404, err_code=10059, description="stream not found")
            return True
        await _call(self._conn, apply, self._timeout, what=f"key value {bucket}")
        return SimKeyValue(self, bucket)

    async def create_key_value(self, config: api.KeyValueConfig | None = None, **params) -> SimKeyValue:
        config = config or api.KeyValueConfig(**params)
        stream = api.StreamConfig(name=KV_PREFIX + config.bucket, subjects=[f"$KV.{config.bucket}.>"],
                                  max_age=config.ttl, max_msgs_per_subject=config.history or 1,
                                  num_replicas=config.replicas, duplicate_window=120.0)
        await self.add_stream(stream)
        return SimKeyValue(self, config.bucket)


class SimNatsClient:
    """The connection ``nats.connect`` returns (``jetstream()``, ``close()``)."""

    def __init__(self, conn: Connection):
        self._conn = conn

    def jetstream(self, timeout: float = 5.0, **_ignored) -> SimJetStream:
        return SimJetStream(self._conn, timeout)

    async def close(self) -> None:
        self._conn.closed = True

    @property
    def is_connected(self) -> bool:
        return not self._conn.closed and self._conn.cluster.reachable(self._conn.host)


def connector(cluster: Cluster, host: str, watch: LeaseWatch | None = None,
              on_connection: Callable[[Connection], None] | None = None):
    """A ``nats.connect`` for one daemon process of ``host``: it connects when a server is
    reachable (after ``connect_timeout`` it raises NoServersError), and the connection's
    requests go through :class:`Cluster`. ``on_connection``: told each connection made
    (the simulator kills it with its process)."""

    async def connect(servers=None, connect_timeout: float = 2.0, **_options) -> SimNatsClient:
        if not cluster.reachable(host):
            await asyncio.sleep(connect_timeout)
            if watch is not None:
                watch.note(cluster.world.now_ns, False)
            raise nats.errors.NoServersError()
        await asyncio.sleep(cluster._latency_ns() * 2 / 1e9)
        conn = Connection(cluster, host, watch)
        if on_connection is not None:
            on_connection(conn)
        return SimNatsClient(conn)
    return connect
