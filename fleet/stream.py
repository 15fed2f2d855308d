"""What a replicating host writes to NATS JetStream: names, message headers, and a host's
stream read back into a journal directory.

Each host (``wheeld --host-id``) has a stream of its own, ``WHEELD_<HOST>``, with one
subject, ``wheeld.<host>.journal``: file storage, ``--replicas`` copies (3: Raft
inside JetStream keeps a message once a quorum stored it). Its messages are the host's
journal (:mod:`wheeld.protocol.journal`), in order:

=========  ==================================================================
``batch``  the lines of one journal append (events ``first..last``), as written
           to the local segment
``snap``   a snapshot file of the local journal (every pending and fired but
           unacknowledged timer after event ``lsn``); the stream is purged up to
           it once stored, as the local journal deletes the segments it covers
``fence``  written by a peer that took the host's timers over: nothing the host
           writes after it is accepted (every write names the stream sequence
           it follows, ``Nats-Expected-Last-Subject-Sequence``)
``mark``   no payload: written by a host that claimed its lease (at start, or
           its lapsed key created again) before it delivers, so that a peer's
           fence still in flight is refused (``Replicator.lease_ok``); readers
           skip it
=========  ==================================================================

A payload of :data:`DEFLATE_MIN` bytes or more is sent deflated (zlib, header
``Wheeld-Encoding: deflate``), then split: a message larger than :data:`MAX_PART` is
split into parts (``Wheeld-Part: i n``),
sent one after the other; a reader ignores a message whose parts are not all there (a
writer killed between them: nothing covered by it was acknowledged as replicated).

The leases live in the KV bucket :data:`LEASE_BUCKET`: key = host id, value =
:class:`Lease`; the bucket's TTL is the lease time. A key that lapsed is free for a peer
to claim with a create (a compare-and-set).
"""

from __future__ import annotations

import logging
import os
import re
import zlib
from pathlib import Path

import msgspec

from wheeld.protocol.journal import SegmentHeader, encode_event, segment_name, snapshot_name

#: the KV bucket of the hosts' leases
LEASE_BUCKET = "WHEELD_LEASES"
#: the largest payload of one message (NATS's default max_payload is 1 MiB)
MAX_PART = 900 * 1024

H_KIND = "Wheeld-Kind"
H_LSN = "Wheeld-Lsn"
H_PART = "Wheeld-Part"
H_EPOCH = "Wheeld-Epoch"
H_HOST = "Wheeld-Host"
H_EXPECT = "Nats-Expected-Last-Subject-Sequence"
H_MSG_ID = "Nats-Msg-Id"
H_ENCODING = "Wheeld-Encoding"

#: a payload at least this long is sent deflated (``Wheeld-Encoding: deflate``)
DEFLATE_MIN = 2048
#: the zlib level: the fastest, since the journal's JSON lines shrink ~4x even so
DEFLATE_LEVEL = 1
#: a deflated message read back may grow to this many times its size (journal lines
#: deflate ~4x; a crafted "deflate bomb" ~1000x), or to INFLATE_FLOOR, whichever is more
INFLATE_RATIO = 64
INFLATE_FLOOR = 16 << 20

BATCH, SNAP, FENCE, MARK = "batch", "snap", "fence", "mark"
DEFLATE = "deflate"

log = logging.getLogger("wheeld.fleet")

_HOST_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class Lease(msgspec.Struct, frozen=True):
    """A host's lease: who holds it (the host itself, or the peer that adopted it)."""

    holder: str  # host id of the daemon holding it
    epoch: int  # grows by one at every claim; every stream write carries it
    pid: int = 0
    t: int = 0  # wall ms of the claim


def renewal_retry_s(ttl_s: float) -> float:
    """How soon a lease (or a claim) renewal that went unanswered is tried again: a
    twentieth of the TTL (at least 0.1 s), not the third it is renewed at. The request may
    have fallen in the cluster's leaderless moment (an election) while peers, renewing in
    between, found the cluster fine: two such misses in a row would let the key lapse
    (fleet seed 11432)."""
    return min(ttl_s / 3, max(0.1, ttl_s / 20))


def msgspec_decode_lease(value: bytes) -> Lease:
    """A lease value as stored in the bucket."""
    return msgspec.json.decode(value, type=Lease)


def check_host_id(host: str) -> str:
    """A host id is 1-64 of ``A-Z a-z 0-9 _ -`` (a stream name and a subject token)."""
    if not _HOST_ID.match(host):
        raise ValueError(f"host id {host!r}: 1-64 characters of A-Z, a-z, 0-9, '_' and '-'")
    return host


def default_host_id() -> str:
    """This machine's host name, made a valid host id (dots become dashes)."""
    name = re.sub(r"[^A-Za-z0-9_-]", "-", os.uname().nodename)[:64]
    return name or "host"


def stream_name(host: str) -> str:
    return f"WHEELD_{host}"


def subject(host: str) -> str:
    return f"wheeld.{host}.journal"


def headers(kind: str, host: str, epoch: int, first: int, last: int, expect: int,
            part: tuple[int, int] | None = None, encoding: str | None = None,
            nonce: int | None = None) -> dict[str, str]:
    """The headers of one message (``expect``: the stream sequence it must follow;
    ``encoding``: :data:`DEFLATE` when the whole payload, all parts joined, is deflated;
    ``nonce``: what makes a :data:`MARK`'s message id its own, as the stream drops a
    message whose id it has seen in its duplicate window without storing it)."""
    h = {H_KIND: kind, H_HOST: host, H_EPOCH: str(epoch), H_LSN: f"{first} {last}", H_EXPECT: str(expect)}
    if encoding is not None:
        h[H_ENCODING] = encoding
    if part is not None:
        h[H_PART] = f"{part[0]} {part[1]}"
        h[H_MSG_ID] = f"{host}:{epoch}:{kind}:{first}:{last}:{part[0]}"
    else:
        h[H_MSG_ID] = f"{host}:{epoch}:{kind}:{first}:{last}"
    if nonce is not None:
        h[H_MSG_ID] += f":{nonce}"
    return h


def deflate(payload: bytes) -> tuple[bytes, str | None]:
    """What goes on the wire for ``payload``, and its encoding (None: as it is).

    The journal's lines are JSON with a checksum, ~110 bytes per event; zlib's fastest
    level takes them to about a quarter at ~0.5 µs per event. Every byte sent is stored
    by three servers and carried twice by their Raft log, and a publish's round trip
    grows with its size, so a flush() of 1,000 ops waits for ~26 KB, not ~110 KB.
    Short payloads (a flush of a few ops) go as they are."""
    if len(payload) < DEFLATE_MIN:
        return payload, None
    return zlib.compress(payload, DEFLATE_LEVEL), DEFLATE


def inflate(data: bytes, encoding: str | None) -> bytes:
    """The payload a message carried (:func:`deflate` undone); ValueError if it cannot be
    read: an unknown encoding, damaged data, or more than :data:`INFLATE_RATIO` times its
    size (at least :data:`INFLATE_FLOOR` bytes): a reader's memory is not the writer's to
    multiply."""
    if encoding is None:
        return data
    if encoding != DEFLATE:
        raise ValueError(f"unknown {H_ENCODING} {encoding!r}")
    limit = max(INFLATE_FLOOR, len(data) * INFLATE_RATIO)
    d = zlib.decompressobj()
    try:
        out = d.decompress(data, limit)
    except zlib.error as exc:
        raise ValueError(f"damaged deflate data: {exc}") from None
    if d.unconsumed_tail:
        raise ValueError(f"deflate data of {len(data)} bytes inflates past {limit} bytes")
    if not d.eof:
        raise ValueError("deflate data cut short")
    return out


def split(payload: bytes) -> list[bytes]:
    """``payload`` in parts of at most :data:`MAX_PART` bytes (one part at least)."""
    if len(payload) <= MAX_PART:
        return [payload]
    return [payload[i:i + MAX_PART] for i in range(0, len(payload), MAX_PART)]


class Record(msgspec.Struct):
    """One message read back (whole: its parts joined)."""

    kind: str
    host: str
    epoch: int
    first: int
    last: int
    seq: int  # stream sequence of its last part
    payload: bytes


class Reassembler:
    """Joins parts into :class:`Record`\\ s; a message whose parts stop short is dropped."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self._want: tuple | None = None

    def feed(self, hdrs: dict[str, str] | None, data: bytes, seq: int) -> Record | None:
        hdrs = hdrs or {}
        kind = hdrs.get(H_KIND)
        if kind is None:
            return None
        first, last = (int(x) for x in hdrs.get(H_LSN, "0 0").split())
        ident = (kind, hdrs.get(H_HOST, ""), int(hdrs.get(H_EPOCH, "0")), first, last)
        part = hdrs.get(H_PART)
        encoding = hdrs.get(H_ENCODING)
        if part is None:
            self._parts, self._want = [], None
            return self._record(ident, seq, data, encoding)
        i, n = (int(x) for x in part.split())
        if i == 1:
            self._parts, self._want = [data], ident
        elif self._want == ident and len(self._parts) == i - 1:
            self._parts.append(data)
        else:  # a part out of order: the message it belongs to stopped short
            self._parts, self._want = [], None
            return None
        if i == n:
            payload, self._parts, self._want = b"".join(self._parts), [], None
            return self._record(ident, seq, payload, encoding)
        return None

    @staticmethod
    def _record(ident: tuple, seq: int, data: bytes, encoding: str | None) -> Record | None:
        kind, host, epoch, first, last = ident
        try:
            payload = inflate(data, encoding)
        except ValueError as exc:  # dropped: recovery reports the lsns it is missing
            log.error("fleet: %s lsn %d-%d of host %s (stream sequence %d) cannot be read: %s",
                      kind, first, last, host, seq, exc)
            return None
        return Record(kind, host, epoch, first, last, seq, payload)


def tail(records: list[Record]) -> tuple[list[Record], Record | None]:
    """What recovery needs of a stream read in order: the newest snapshot and the batches
    after it (lsns contiguous), and the fence that ends the stream if there is one."""
    fence = records[-1] if records and records[-1].kind == FENCE else None
    start = 0
    for i, rec in enumerate(records):
        if rec.kind == SNAP:
            start = i
    kept: list[Record] = []
    for rec in records[start:]:
        if rec.kind == SNAP:
            kept = [rec]
        elif rec.kind == BATCH:
            if kept and rec.first != kept[-1].last + 1:
                if rec.last <= kept[-1].last:
                    continue  # sent again (a retry): already there
            kept.append(rec)
    return kept, fence


def write_directory(records: list[Record], directory: str | os.PathLike[str], host: str) -> int:
    """Write ``records`` (from :func:`tail`) as a journal directory that
    :func:`wheeld.journal.recovery.recover` reads: the snapshot as a snapshot file, the
    batches after it as one segment. Returns the last lsn written."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    last = 0
    batches = []
    for rec in records:
        if rec.kind == SNAP:
            (d / snapshot_name(rec.last)).write_bytes(rec.payload)
            last = rec.last
        else:
            batches.append(rec)
    if batches:
        first = batches[0].first
        header = encode_event(SegmentHeader(host=host, name="adopted", lsn=first, t=0, mono0=0, wall0=0))
        with open(d / segment_name(first), "wb") as f:
            f.write(header)
            for rec in batches:
                f.write(rec.payload)
        last = batches[-1].last
    return last


async def read_records(js, host: str, upto_seq: int, timeout_s: float = 5.0, attempts: int = 10) -> list[Record]:
    """Every message of ``host``'s stream before sequence ``upto_seq``, whole (parts joined),
    in order. Read with an ordered consumer from the next sequence wanted; one that stops
    answering (a leader moved, a server restarted) is replaced, from where it stopped."""
    from nats.js.api import ConsumerConfig, DeliverPolicy

    name, subj = stream_name(host), subject(host)
    records: list[Record] = []
    joiner = Reassembler()
    next_seq = 1
    for _ in range(attempts):
        if next_seq >= upto_seq:
            break
        config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=next_seq)
        try:
            sub = await js.subscribe(subj, ordered_consumer=True, stream=name, config=config)
        except Exception:
            continue
        try:
            while next_seq < upto_seq:
                msg = await sub.next_msg(timeout=timeout_s)
                seq = msg.metadata.sequence.stream
                if seq >= upto_seq:
                    next_seq = upto_seq
                    break
                rec = joiner.feed(msg.headers, msg.data, seq)
                if rec is not None:
                    records.append(rec)
                next_seq = seq + 1
        except Exception:  # a timeout: read on with a new consumer
            continue
        finally:
            try:
                await sub.unsubscribe()
            except Exception:
                pass
    if next_seq < upto_seq:
        raise TimeoutError(f"the stream of host {host} could not be read up to sequence {upto_seq} "
                           f"(stopped at {next_seq})")
    return records
