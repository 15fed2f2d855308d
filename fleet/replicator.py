"""A host's journal sent to its JetStream stream, and the host's lease kept.

``wheeld --replicate nats://A,nats://B,nats://C`` runs a :class:`Replicator` in the
daemon's event loop (its I/O is a few asyncio tasks of ``nats-py``; every decision
about what a flush() may answer stays in the daemon's core, which reads
:attr:`Replicator.replicated_lsn`).

What it sends (:mod:`wheeld.fleet.stream`): every journal append, as written to the
local segment, and every snapshot the local journal writes, in the order the journal
made them; after a snapshot is stored the stream is purged up to it, so the stream holds
what the local journal holds: the live timers, not the history. The first thing sent
after a start is a snapshot (the core writes one at once), so nothing the stream missed
while no daemon ran, or while the cluster was out of reach, is ever needed from memory.

The outbox is bounded (:data:`OUTBOX_BYTES`): when the cluster is out of reach longer
than it holds, the queued batches are dropped and the next snapshot (asked of the core
through :attr:`Replicator.want_snapshot`) replaces them; batches appended meanwhile are
covered by that snapshot too. Nothing the stream stored is ever doubled: each message
names the stream sequence it follows, and a retry whose first attempt was stored
(its acknowledgement lost) is recognised by the stream's last message.

Lease and fencing: the host holds the key ``<host id>`` of the bucket
:data:`~wheeld.fleet.stream.LEASE_BUCKET` (its TTL is ``--lease-ttl-s``), renewed every
third of it with a compare-and-set on the key's revision. :attr:`lease_valid_until_ms`
is when the lease may have lapsed by this host's own clock (the renewal's send time
plus the TTL, less a margin). A peer that adopts the host claims the lapsed key, then
writes a ``fence`` to the host's stream: every later write of the host is refused by
the stream, and its next renewal fails. Either tells the host it was fenced
(:attr:`fenced`); the daemon then stands down (``on_fenced``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from . import stream as S

log = logging.getLogger("wheeld.fleet")

#: bytes of journal the outbox holds while the cluster is out of reach (then: a snapshot)
OUTBOX_BYTES = 64 << 20
#: the outbox sends at once, linger or not, once it holds this much
LINGER_BYTES = 256 << 10
#: a renewal starts every third of the TTL; the lease counts as lapsed this share early
LEASE_MARGIN = 0.2
_WRONG_LAST_SEQUENCE = 10071
#: a payload this long is deflated in a worker thread (zlib lets go of the GIL meanwhile):
#: ~1 ms of the loop at most (zlib level 1 takes ~4 ms per MiB here), as when the outbox
#: catches up after an outage with messages of up to MAX_PART; shorter ones, a flush()'s
#: usual batch among them, go faster inline than through a thread
DEFLATE_OFF_LOOP = LINGER_BYTES


@dataclass(frozen=True)
class FleetConfig:
    """What ``--replicate`` and its options say."""

    urls: tuple[str, ...]
    host_id: str
    lease_ttl_s: float = 10.0
    replicas: int = 3
    publish_timeout_s: float = 2.0
    user: str | None = None
    password: str | None = None
    creds: str | None = None  # a NATS credentials file
    adopt: tuple[str, ...] = ()  # host ids this daemon takes over when their lease lapses ("*": any)
    connect_timeout_s: float = 2.0
    #: journal appends wait this long (ms) to go out together, unless a flush() waits for them
    linger_ms: int = 10


@dataclass
class Outbox:
    """What is still to be sent, in order (sans-IO: the tests drive it directly)."""

    limit: int = OUTBOX_BYTES
    items: deque = field(default_factory=deque)  # (kind, first, last, payload)
    size: int = 0
    want_snapshot: bool = True  # nothing is sent before a first snapshot
    dropped: int = 0  # batches dropped for a snapshot to replace

    def appended(self, first: int, last: int, data: bytes) -> None:
        if self.want_snapshot:
            self.dropped += 1
            return
        self.items.append((S.BATCH, first, last, data))
        self.size += len(data)
        if self.size > self.limit:
            log.warning("fleet: %d bytes of journal not replicated yet; dropped for the next snapshot", self.size)
            self.dropped += sum(1 for it in self.items if it[0] == S.BATCH)
            self.items = deque(it for it in self.items if it[0] != S.BATCH)
            self.size = sum(len(it[3]) for it in self.items)
            self.want_snapshot = True

    def snapshotted(self, lsn: int, data: bytes) -> None:
        kept = deque(it for it in self.items if it[2] > lsn)  # what a snapshot covers, older snapshots too
        kept.append((S.SNAP, lsn, lsn, data))
        self.items = kept
        self.size = sum(len(it[3]) for it in kept)
        self.want_snapshot = False

    def next_message(self) -> tuple[str, int, int, bytes, int]:
        """The next message to send: the first item, and the batches right after a batch
        joined to it (contiguous lsns, up to :data:`~wheeld.fleet.stream.MAX_PART` bytes):
        while one message is in flight the appends gather, and the next carries them all.
        Returns (kind, first lsn, last lsn, payload, items taken)."""
        items = self.items
        kind, first, last, payload = items[0]
        if kind != S.BATCH:
            return kind, first, last, payload, 1
        parts, size, taken = [payload], len(payload), 1
        while taken < len(items):
            k, f, la, p = items[taken]
            if k != S.BATCH or f != last + 1 or size + len(p) > S.MAX_PART:
                break
            parts.append(p)
            size += len(p)
            last = la
            taken += 1
        return kind, first, last, payload if taken == 1 else b"".join(parts), taken

    def sent(self, kind: str, first: int, taken: int) -> None:
        """The message of :meth:`next_message` is stored: drop its items (unless a snapshot
        replaced them meanwhile)."""
        items = self.items
        if not items or items[0][0] != kind or items[0][1] != first:
            return
        for _ in range(min(taken, len(items))):
            self.size -= len(items.popleft()[3])

    def queued_lsn(self) -> int:
        return self.items[-1][2] if self.items else 0


class Fenced(Exception):
    """Another host holds this host's lease, or fenced its stream."""


class Replicator:
    """Sends the journal (see the module docstring). ``on_progress()``: the replicated lsn
    moved (or the state changed); ``on_fenced(reason)``: stand down. Both are called in the
    daemon's loop. ``connect``: ``nats.connect`` unless another is given (the simulator's,
    tests/sim/jetstream.py); ``pid``: the process id its leases name."""

    def __init__(self, config: FleetConfig, on_progress: Callable[[], None] = lambda: None,
                 on_fenced: Callable[[str], None] = lambda reason: None,
                 clock_ms: Callable[[], int] = lambda: time.monotonic_ns() // 1_000_000,
                 connect: Callable | None = None, pid: int | None = None):
        self.config = config
        self.connect = connect
        self.pid = os.getpid() if pid is None else pid
        self.host = config.host_id
        self.subject = S.subject(self.host)
        self.stream = S.stream_name(self.host)
        self.outbox = Outbox()
        self.on_progress = on_progress
        self.on_fenced = on_fenced
        self.clock_ms = clock_ms
        self.replicated_lsn = 0  # every event up to it is stored by the stream
        self.journal_lsn = 0  # the last event the journal told (appended or snapshotted)
        self.epoch = 0
        self.state = "connecting"  # connecting | replicating | behind | fenced | stopped
        self.fenced: str | None = None
        self.lease_valid_until_ms = 0
        # the last renewal reached the cluster (until the first claim: assumed, so that a
        # host does not deliver before it knows it still owns its timers)
        self._lease_reachable = True
        self.unreachable_ms = clock_ms()  # when it last was not (or the start): see in_reach()
        self.last_ack_ms = 0
        self._waiting_since_ms = 0  # when the journal's oldest event not stored began waiting
        self.published_total = 0
        self.published_bytes = 0  # as sent (deflated)
        self.retries_total = 0
        self.flush_waits: list[float] = []
        self._nc = None
        self._js = None
        self._kv = None
        self._rev = 0
        self._renew_answered = False  # the last renewal (or claim) was answered, whatever followed
        # the lease was claimed (or created again) and no write of this daemon has been stored
        # in the stream since: a peer's fence sent before may still land (see lease_ok)
        self._unconfirmed = False
        self._marks = 0  # marks written (their message ids' nonce)
        self._last_seq = 0
        self._wake = asyncio.Event()
        self._hurry_lsn = 0  # a flush() waits for the stream to hold this lsn: no lingering
        self._tasks: list[asyncio.Task] = []
        self.adopter = None  # an Adopter (wheeld.fleet.adopt) when --adopt is given

    # ------------------------------------------------------------------ from the core
    def appended(self, first: int, last: int, data: bytes) -> None:
        outbox = self.outbox
        was_empty = not outbox.items
        if was_empty:
            self._waiting_since_ms = self.clock_ms()
        self.journal_lsn = max(self.journal_lsn, last)
        outbox.appended(first, last, data)
        # the publish loop lingers on a first append; later ones wake it only when it must not
        if was_empty or outbox.size >= LINGER_BYTES or self._hurry_lsn > self.replicated_lsn:
            self._wake.set()

    def hurry(self, lsn: int) -> None:
        """A flush() waits for the stream to hold ``lsn``: what is queued goes out without
        lingering (:attr:`FleetConfig.linger_ms`)."""
        if lsn > self._hurry_lsn:
            self._hurry_lsn = lsn
            self._wake.set()

    def snapshotted(self, lsn: int, data: bytes) -> None:
        if not self.outbox.items:
            self._waiting_since_ms = self.clock_ms()
        self.journal_lsn = max(self.journal_lsn, lsn)
        self.outbox.snapshotted(lsn, data)
        self._wake.set()

    @property
    def want_snapshot(self) -> bool:
        return self.outbox.want_snapshot and self.fenced is None

    def lease_ok(self, now_ms: int) -> bool:
        """May this host deliver its timers now? Yes while its lease is valid by its own
        clock, or while the cluster is out of reach (no peer can claim a lease without a
        quorum, and a host cut off from the cluster keeps firing: docs/fleet.md); no while a
        renewal is due and not answered, and never once fenced.

        Nor, in reach, from a claim of the lease (at start, or the key created again after
        it lapsed) until a write of this daemon is stored in its stream: a peer that
        claimed the lapsed key before, and lost it again, may have a fence in flight, which
        the cluster can still store after this daemon found the stream's tail unfenced (a
        Raft entry committed once a quorum is back). The fence names the sequence it
        follows; once a write of this daemon follows that sequence instead, the fence is
        refused, and if the fence landed first, that write is, and the daemon stands down
        (fleet seed 43017)."""
        if self.fenced is not None:
            return False
        if not self.lease_reachable:
            return True
        return now_ms < self.lease_valid_until_ms and not self._unconfirmed

    @property
    def lease_reachable(self) -> bool:
        return self._lease_reachable

    @lease_reachable.setter
    def lease_reachable(self, reachable: bool) -> None:
        if not reachable:
            self.unreachable_ms = self.clock_ms()
        self._lease_reachable = reachable

    def in_reach(self, now_ms: int) -> bool:
        """Has this host held its lease, renewal after renewal, for a whole TTL? A peer takes
        another host over only then (wheeld.fleet.adopt): after the cluster itself was out of
        reach (no quorum, a partition of this host), or this host's own lease lapsed (a pause
        through an outage), every host's lease may have lapsed alike, and each gets a TTL to
        take its own back before a peer takes it over."""
        return self._lease_reachable and self.fenced is None and now_ms < self.lease_valid_until_ms and \
            now_ms - self.unreachable_ms >= int(self.config.lease_ttl_s * 1000)

    def stats(self) -> dict[str, int | str]:
        queued = self.outbox.queued_lsn()
        return {
            "fleet_state": self.state,
            "fleet_epoch": self.epoch,
            "fleet_replicated_lsn": self.replicated_lsn,
            "fleet_lag_records": max(0, queued - self.replicated_lsn) if queued else 0,
            "fleet_lag_ms": (0 if not queued or queued <= self.replicated_lsn
                             else self.clock_ms() - self._waiting_since_ms),
            "fleet_outbox_bytes": self.outbox.size,
            "fleet_published_total": self.published_total,
            "fleet_retries_total": self.retries_total,
        }

    # ------------------------------------------------------------------ life
    def start(self) -> None:
        self._tasks.append(asyncio.ensure_future(self._run()))

    async def close(self, drain_s: float = 2.0) -> None:
        """Stop; what the outbox still holds is sent first, for up to ``drain_s`` while the
        cluster stores it (a stop does not wait out the linger, nor an unreachable cluster)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + drain_s
        if self.outbox.items and self.fenced is None and self.state == "replicating":
            self.hurry(self.journal_lsn)
            while self.outbox.items and self.state == "replicating" and loop.time() < end:
                await asyncio.sleep(0.005)
        self.state = "stopped" if self.fenced is None else self.state
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        if self._nc is not None:
            try:
                await asyncio.wait_for(self._nc.close(), 2.0)
            except Exception:
                pass

    async def _run(self) -> None:
        try:
            await self._connect()
            while True:
                try:
                    await self._claim()
                    break
                except (Fenced, asyncio.CancelledError):
                    raise
                except Exception as exc:  # no quorum, a timeout: serve locally, try again
                    if not self._renew_answered:  # (answered, then a step failed: in reach, no lease yet)
                        self.lease_reachable = False
                    self._set_state("behind")
                    log.warning("fleet: the lease of %s cannot be claimed yet: %s", self.host,
                                exc or type(exc).__name__)
                    await asyncio.sleep(1.0)
            self._tasks.append(asyncio.ensure_future(self._renew_loop()))
            if self.adopter is not None:
                self._tasks.append(asyncio.ensure_future(self.adopter.run(self)))
            await self._publish_loop()
        except Fenced as exc:
            self._stand_down(str(exc))
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("fleet: the replicator stopped")
            self.state = "failed"
            self.on_progress()

    async def _connect(self) -> None:
        connect = self.connect
        if connect is None:
            import nats

            connect = nats.connect
        cfg = self.config
        options = dict(servers=list(cfg.urls), connect_timeout=cfg.connect_timeout_s, allow_reconnect=True,
                       max_reconnect_attempts=-1, reconnect_time_wait=0.25, name=f"wheeld-{self.host}",
                       error_cb=self._nats_error, disconnected_cb=self._nats_disconnected)
        if cfg.creds:
            options["user_credentials"] = cfg.creds
        elif cfg.user is not None:
            options["user"], options["password"] = cfg.user, cfg.password or ""
        while True:
            try:
                self._nc = await connect(**options)
                break
            except Exception as exc:  # no server reachable yet: keep serving locally, try again
                self.lease_reachable = False
                self._set_state("behind")
                log.warning("fleet: cannot reach %s: %s; trying again", ",".join(cfg.urls), exc)
                await asyncio.sleep(1.0)
        self._js = self._nc.jetstream(timeout=cfg.publish_timeout_s)
        await self._ensure_stream()
        self._kv = await self._lease_bucket()

    async def _nats_error(self, exc: Exception) -> None:
        """nats-py's errors (a server gone, a reconnect refused): one line, not a traceback."""
        log.debug("fleet: nats: %s", exc or type(exc).__name__)

    async def _nats_disconnected(self) -> None:
        log.info("fleet: disconnected from a NATS server; reconnecting")

    async def _ensure_stream(self) -> None:
        from nats.js.api import StorageType, StreamConfig
        from nats.js.errors import NotFoundError

        config = StreamConfig(name=self.stream, subjects=[self.subject], storage=StorageType.FILE,
                              num_replicas=self.config.replicas, duplicate_window=120.0)
        while True:
            try:
                try:
                    await self._js.stream_info(self.stream)
                except NotFoundError:
                    await self._js.add_stream(config)
                return
            except NotFoundError:
                raise
            except Exception as exc:
                self.lease_reachable = False
                self._set_state("behind")
                log.warning("fleet: stream %s not ready: %s", self.stream, exc)
                await asyncio.sleep(0.5)

    async def _lease_bucket(self):
        from nats.js.api import KeyValueConfig, StorageType

        while True:
            try:
                try:
                    return await self._js.key_value(S.LEASE_BUCKET)
                except Exception:
                    return await self._js.create_key_value(KeyValueConfig(
                        bucket=S.LEASE_BUCKET, ttl=self.config.lease_ttl_s, history=1,
                        storage=StorageType.FILE, replicas=self.config.replicas))
            except Exception as exc:
                self.lease_reachable = False
                log.warning("fleet: lease bucket not ready: %s", exc)
                await asyncio.sleep(0.5)

    # ------------------------------------------------------------------ lease
    async def _claim(self) -> None:
        """This host's lease, and where its stream ends. A stream that ends with a fence,
        or a lease held by another host, means this host was adopted: Fenced."""
        from nats.js.errors import KeyNotFoundError

        self._renew_answered = False
        last = await self._last_record()
        # answered: the cluster is in reach; until the claim succeeds nothing goes out (lease_ok),
        # the key may be a peer's
        self._renew_answered = self.lease_reachable = True
        if last is not None and last[0] == S.FENCE:
            raise Fenced(f"host {self.host} was taken over by {last[1]} (epoch {last[2]}); its timers are "
                         f"that host's now: `wheelctl fleet forget {self.host}` lets it join again, empty")
        stream_epoch = last[2] if last is not None else 0
        while True:
            sent = self.clock_ms()
            try:
                entry = await self._kv.get(self.host)
            except KeyNotFoundError:
                entry = None
            if entry is not None and entry.value:
                lease = msgspec.json.decode(entry.value, type=S.Lease)
                if lease.holder != self.host:
                    raise Fenced(f"the lease of host {self.host} is held by {lease.holder} (epoch {lease.epoch})")
                epoch = max(lease.epoch, stream_epoch) + 1
                value = msgspec.json.encode(S.Lease(self.host, epoch, self.pid, int(time.time() * 1000)))
                try:
                    self._rev = await self._kv.update(self.host, value, last=entry.revision)
                except Exception:
                    continue  # changed meanwhile: read again
            else:
                epoch = stream_epoch + 1
                value = msgspec.json.encode(S.Lease(self.host, epoch, self.pid, int(time.time() * 1000)))
                try:
                    self._rev = await self._kv.create(self.host, value)
                except Exception:
                    continue
            self.epoch = epoch
            self._held_from_now()  # however long the claim took (a pause in it: fleet seed 43299)
            self._renewed(sent)
            log.info("fleet: host %s holds its lease (epoch %d); stream %s at sequence %d", self.host, epoch,
                     self.stream, self._last_seq)
            return

    def _held_from_now(self) -> None:
        """The lease became this daemon's (claimed at start, or its lapsed key created again):
        nothing goes out until a write of this daemon is stored (lease_ok; the publish loop
        writes a mark unless it has something to send), and no other host is taken over for
        a TTL (in_reach)."""
        self._unconfirmed = True
        self.unreachable_ms = self.clock_ms()
        self._wake.set()

    def _renewed(self, sent_ms: int) -> None:
        ttl_ms = int(self.config.lease_ttl_s * 1000)
        self.lease_valid_until_ms = sent_ms + int(ttl_ms * (1 - LEASE_MARGIN))
        self.lease_reachable = True

    async def _renew_loop(self) -> None:
        from nats.js.errors import KeyWrongLastSequenceError

        period = self.config.lease_ttl_s / 3
        retry = S.renewal_retry_s(self.config.lease_ttl_s)  # after a renewal that went unanswered
        delay, again = period, False
        while self.fenced is None:
            if not again:
                await asyncio.sleep(delay)
            again, delay = False, period
            sent = self.clock_ms()
            try:
                holder = await self._renew()
            except KeyWrongLastSequenceError:  # the key changed while _reclaim looked: look again
                again = True
                continue
            except Exception as exc:  # out of reach (a timeout, no leader): keep serving (lease_ok)
                if self.lease_reachable:
                    log.warning("fleet: lease of %s not renewed: %s", self.host, exc or type(exc).__name__)
                if not self._renew_answered:  # (refused, then a look-up failed: not cut off, the lease lapsed)
                    self.lease_reachable = False
                    self.on_progress()
                delay = retry
                continue
            if holder is not None:
                self._stand_down(f"the lease of host {self.host} was claimed by {holder}")
                return
            waited = not self.lease_ok(self.clock_ms())
            self._renewed(sent)
            if waited:  # timers held back while the lease could not be used go out now
                self.on_progress()

    async def _renew(self) -> str | None:
        """One renewal (a compare-and-set on the key's revision); when it is refused, who holds
        the lease now (:meth:`_reclaim`). Returns that holder, None while it is this daemon's.
        What cannot be answered (a timeout) raises: nobody is known to hold it."""
        from nats.js.errors import KeyWrongLastSequenceError

        value = msgspec.json.encode(S.Lease(self.host, self.epoch, self.pid, int(time.time() * 1000)))
        self._renew_answered = False
        try:
            self._rev = await asyncio.wait_for(self._kv.update(self.host, value, last=self._rev),
                                               self.config.publish_timeout_s)
            return None
        except KeyWrongLastSequenceError:
            # answered: the cluster is in reach, and until the lease is this daemon's again
            # its validity alone says whether timers may go out (lease_ok), also when a
            # look-up of the take-back fails
            self._renew_answered = self.lease_reachable = True
            return await self._reclaim(value)

    async def _reclaim(self, value: bytes) -> str | None:
        """A renewal refused for its revision: who holds the lease? None when it is still
        this daemon's (an earlier renewal was stored and its answer lost: renewed again on
        its revision, since the key lives from when that one was stored, which is not known;
        or the key lapsed while the cluster was out of reach and nobody took the host over:
        created again, unless a fence ends the stream), else the holder's host id."""
        from nats.js.errors import KeyNotFoundError

        try:
            entry = await self._kv.get(self.host)
        except KeyNotFoundError:
            entry = None
        if entry is None or not entry.value:
            tail = await self._tail()  # lapsed: a peer may have taken it, fenced, and let it lapse too
            h = (tail.headers or {}) if tail is not None else {}
            if h.get(S.H_KIND) == S.FENCE:
                return f"{h.get(S.H_HOST)} (epoch {h.get(S.H_EPOCH)}), which fenced its stream"
            self._rev = await self._kv.create(self.host, value)  # raises if a peer got there first
            # the lease lapsed (a pause, an outage): held again only from now, as the hosts
            # whose leases lapsed with its own take theirs back (fleet seed 39218)
            self._held_from_now()
            return None
        lease = msgspec.json.decode(entry.value, type=S.Lease)
        if lease.holder == self.host and lease.epoch == self.epoch and lease.pid == self.pid:
            self._rev = await self._kv.update(self.host, value, last=entry.revision)
            return None
        return lease.holder if lease.holder != self.host else f"{self.host} (epoch {lease.epoch}, another daemon)"

    def _stand_down(self, reason: str) -> None:
        if self.fenced is None:
            self.fenced = reason
            self.state = "fenced"
            log.critical("fleet: FENCED: %s; this daemon stands down", reason)
            self.on_fenced(reason)

    # ------------------------------------------------------------------ the stream
    async def _last_record(self) -> tuple[str, str, int, int] | None:
        """(kind, host, epoch, last lsn) of the stream's last message; sets the sequence the
        next write follows."""
        from nats.js.errors import NotFoundError

        try:
            msg = await self._js.get_msg(self.stream, subject=self.subject, direct=False)
        except NotFoundError:
            self._last_seq = 0
            return None
        self._last_seq = msg.seq
        h = msg.headers or {}
        last = int(h.get(S.H_LSN, "0 0").split()[1])
        return h.get(S.H_KIND, ""), h.get(S.H_HOST, ""), int(h.get(S.H_EPOCH, "0")), last

    async def _publish_loop(self) -> None:
        outbox = self.outbox
        while self.fenced is None:
            if self._unconfirmed and not outbox.items:
                await self._mark()
                continue
            if not outbox.items:
                self._wake.clear()
                if not outbox.items and not self._unconfirmed:
                    await self._wake.wait()
                continue
            if await self._linger():
                continue
            kind, first, last, payload, taken = outbox.next_message()
            await self._send(kind, first, last, payload)
            self._unconfirmed = False  # stored: no fence sent before it can land now (lease_ok)
            outbox.sent(kind, first, taken)
            self.replicated_lsn = max(self.replicated_lsn, last)
            self.last_ack_ms = self._waiting_since_ms = self.clock_ms()  # what is left waits from now
            if kind == S.SNAP:
                await self._purge_before_snapshot()
            self._set_state("replicating")
            self.on_progress()

    async def _mark(self) -> None:
        """Write a ``mark`` (see :meth:`lease_ok`): once it is stored, no fence sent before can
        be; a fence stored first refuses it (Fenced)."""
        self._marks += 1
        lsn = self.replicated_lsn
        await self._publish_one(S.MARK, lsn, lsn, b"", None, None, self._marks)
        self._unconfirmed = False
        self._set_state("replicating")
        self.on_progress()

    async def _linger(self) -> bool:
        """Wait for more appends to go in the same message: until the queue's oldest event
        waited :attr:`FleetConfig.linger_ms`, the outbox holds :data:`LINGER_BYTES`, or a
        flush() waits (:meth:`hurry`). Each message costs the cluster a round of its Raft
        log and this loop a request, whatever it carries: with timers firing every
        millisecond, one message per wake-up would take the CPU the wheel's own lateness
        needs. Snapshots go at once. True: it waited (look again)."""
        outbox = self.outbox
        wait_ms = self._waiting_since_ms + self.config.linger_ms - self.clock_ms()
        if (wait_ms <= 0 or outbox.size >= LINGER_BYTES or self._hurry_lsn > self.replicated_lsn
                or outbox.items[0][0] != S.BATCH):
            return False
        self._wake.clear()
        timer = asyncio.get_running_loop().call_later(wait_ms / 1000, self._wake.set)
        try:
            await self._wake.wait()
        finally:
            timer.cancel()
        return True

    async def _send(self, kind: str, first: int, last: int, payload: bytes) -> None:
        if len(payload) >= DEFLATE_OFF_LOOP:  # a snapshot, a catch-up: not on the daemon's loop
            data, encoding = await asyncio.get_running_loop().run_in_executor(None, S.deflate, payload)
        else:
            data, encoding = S.deflate(payload)
        parts = S.split(data)
        n = len(parts)
        for i, part in enumerate(parts, 1):
            label = (i, n) if n > 1 else None
            if kind == S.SNAP and i == 1:
                self._snap_first_seq = 0
            seq = await self._publish_one(kind, first, last, part, label, encoding)
            if kind == S.SNAP and i == 1:
                self._snap_first_seq = seq

    async def _publish_one(self, kind, first, last, data, part, encoding=None, nonce=None) -> int:
        from nats.js.errors import APIError

        backoff = 0.1
        while True:
            hdrs = S.headers(kind, self.host, self.epoch, first, last, self._last_seq, part, encoding, nonce)
            try:
                ack = await self._js.publish(self.subject, data, headers=hdrs, stream=self.stream)
                self._last_seq = ack.seq
                self.published_total += 1
                self.published_bytes += len(data)
                return ack.seq
            except APIError as exc:
                if getattr(exc, "err_code", None) != _WRONG_LAST_SEQUENCE:
                    raise
                error: Exception = exc
                try:  # (a timeout here: the same message again, below)
                    tail = await self._tail()
                except Exception as lookup:
                    error = lookup
                else:
                    h = (tail.headers or {}) if tail is not None else {}
                    if tail is not None and h.get(S.H_MSG_ID) == hdrs[S.H_MSG_ID]:
                        self._last_seq = tail.seq  # an earlier attempt stored, its acknowledgement lost
                        return tail.seq
                    if tail is not None and self._own_late_write(h):
                        # this host's earlier daemon's write, stored after this one's claim
                        # read the stream: no fence. Nothing can follow it but this host's
                        # own writes (each names the sequence it follows): go on after it
                        log.info("fleet: stream %s: a write of this host's epoch %s stored late (sequence %d)",
                                 self.stream, h.get(S.H_EPOCH), tail.seq)
                        self._last_seq = tail.seq
                        continue
                    who = f"{h.get(S.H_HOST)} ({h.get(S.H_KIND)}, epoch {h.get(S.H_EPOCH)})" if h else "another writer"
                    raise Fenced(f"the stream of host {self.host} was written by {who}") from exc
            except Exception as exc:  # timeout, no responders, reconnecting: the same message again
                error = exc
            self.retries_total += 1
            self._set_state("behind")
            if backoff >= 0.4:
                log.warning("fleet: %s lsn %d-%d not stored yet: %s", kind, first, last, error or type(error).__name__)
            await asyncio.sleep(backoff)
            backoff = min(2.0, backoff * 2)

    def _own_late_write(self, h: dict) -> bool:
        """Is a stream message with headers ``h`` one this host wrote under an earlier epoch
        (a publish of its previous daemon, in flight when that daemon died)? Such a write
        is stored only if it follows the stream's last message at the time, so no fence
        of a peer can come before it unseen: it is not one."""
        try:
            epoch = int(h.get(S.H_EPOCH, ""))
        except ValueError:
            return False
        return h.get(S.H_HOST) == self.host and h.get(S.H_KIND) != S.FENCE and 0 <= epoch < self.epoch

    async def _tail(self):
        """The stream's last message (None: none), to see after a refused write whether it
        is this very one (an earlier attempt stored, its acknowledgement lost)."""
        from nats.js.errors import NotFoundError

        try:
            return await self._js.get_msg(self.stream, subject=self.subject, direct=False)
        except NotFoundError:
            return None

    async def _purge_before_snapshot(self) -> None:
        seq = getattr(self, "_snap_first_seq", 0)
        if seq > 1:
            try:
                await self._js.purge_stream(self.stream, seq=seq, subject=self.subject)
            except Exception as exc:  # the next snapshot purges it
                log.warning("fleet: stream %s not purged before sequence %d: %s", self.stream, seq, exc)

    def _set_state(self, state: str) -> None:
        if self.fenced is None and self.state != state:
            self.state = state
            self.on_progress()
