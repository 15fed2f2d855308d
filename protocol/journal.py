"""The journal format, version 1: what wheeld writes to disk and Spark reads.

The daemon records every change to its timers in a write-ahead journal so
that timers survive a reboot (``wheeld --journal DIR``). The same files are the
input of the fleet analytics pipeline (``wheeld.pipeline``). This module is the
one place that defines the bytes; the writer (:mod:`wheeld.journal.files`),
recovery (:mod:`wheeld.journal.recovery`), the fleet generator and the
pipeline all import it.

Why JSON Lines
==============

Spark reads JSON Lines natively (``spark.read.json``) and has no msgpack
reader; Parquet would need a writer that buffers row groups (a crash loses the
whole group) and a columnar writer in the daemon's hot path. One JSON object a
line, appended with one ``write(2)`` per batch, is crash-friendly (a crash tears
at most the last line), human-readable with ``less``/``jq``, and msgspec
encodes an event in ~100-150 ns; with the per-line crc the bulk encoder
(:func:`encode_events`) makes ~1.5M lines/s here (``bench/journal.py``).
Short field names keep an event at 110-170 bytes (an ``add`` with a 12-byte
key: 130).

Lines and checksums
===================

Every line is one JSON object, UTF-8, terminated by ``\\n``; its *last* member
is ``"crc"``, the CRC-32 (``zlib.crc32``, unsigned decimal) of the same object
encoded without that member::

    body = msgspec.json.encode(event)            # b'{"ev":"add",...,"s":42}'
    line = body[:-1] + b',"crc":' + str(zlib.crc32(body)).encode() + b'}\\n'

A reader verifies a line by finding the last ``,"crc":``, putting ``}`` back
in place of that suffix and comparing CRCs (:func:`line_body`,
:func:`check_line`). A ``,"crc":`` cannot occur inside a JSON string (its quote
would be escaped), so the last occurrence is always the checksum. A record
counts only with its newline: a final line without ``\\n`` is torn even if its
bytes happen to be complete.

Line order inside an object: msgspec writes ``"ev"`` first, then the fields in
the order of the tables below, then ``"crc"``. Readers must not depend on the
order.

Segment files
=============

``<dir>/journal-<first_lsn:016d>.jsonl``. Every event has a log sequence
number ``n`` (lsn): 1, 2, 3, ... without gaps over the life of a journal
directory. A segment holds consecutive lsns; its name is the lsn of its first
event, so sorting the names sorts the journal. The first line of a segment is
its header (it has no lsn of its own)::

    {"ev":"segment","v":1,"host":"web-3","name":"default","lsn":1001,
     "t":1700000000000,"mono0":523311,"wall0":1700000000000,"crc":2328536728}

=========  ==================================================================
``host``   host name of the daemon that wrote the segment
``name``   the daemon's ``--name`` (several daemons may share a host)
``lsn``    lsn of the first event in this segment (= the number in the file name)
``t``      wall-clock ms when the segment was opened
``mono0``  CLOCK_MONOTONIC ms read together with ``wall0``: lets a reader
           relate the daemon's monotonic clock to wall time
``wall0``  wall-clock ms (``time.time_ns() // 1_000_000``) read with ``mono0``
=========  ==================================================================

A segment grows until it passes its size limit (64 MiB by default); the writer
then opens the next one. After a restart the daemon always starts a new segment.

Events
======

Every event has these common fields:

=======  ======================================================================
``ev``   event type (below)
``v``    format version, 1 (:data:`JOURNAL_VERSION`)
``n``    lsn of this event
``t``    wall-clock ms when the event happened (for ``fire``: when it fired)
``g``    group name (str)
``k``    key as a JSON value (:func:`key_to_json`): an ``int`` key is a JSON
         integer; a ``str`` key is a JSON string, written as ``"str:" + key``
         if it starts with ``"b64:"`` or ``"str:"``; a ``bytes`` key is
         ``"b64:" + base64(key)``. So ``"conn-17"``, ``b"conn-17"`` and ``17``
         stay three different keys, as in :mod:`wheeld.protocol.keys`.
``s``    arming seq: the client's id of the add that armed this timer (int)
=======  ======================================================================

and then, by type (``d``: deadline, wall-clock ms):

==============  ==============================================================
``add``         a new timer: ``d``, ``s``; ``i`` = idle_ms for an idle timer
                (absent for a plain timer). An add whose key is already
                pending is journaled as ``rearm``.
``rearm``       a pending key was armed again (and replaces the old timer):
                ``d`` new deadline, ``pd`` previous deadline, ``s`` the new
                arming seq, ``i`` as for ``add``. Also written, without
                ``i`` and with ``s`` unchanged, for each pending idle timer
                of a client slot the daemon frees: it is a plain timer from
                then on (at last touch + idle_ms, or its deadline if later)
``cancel``      the client cancelled the key: ``s`` (seq of the cancel
                command), ``hit`` true if a pending timer was removed, then
                ``pd`` its deadline (absent when ``hit`` is false)
``fire``        the timer expired and was handed to delivery: ``d``, ``s``
                (seq of the add that armed it), ``f`` fired wall ms, ``late``
                true when it fired late because the daemon was down (recovered
                and overdue), ``lat`` lateness ms = ``f - d`` (>= 0: never early),
                ``i`` for an idle timer (its idle_ms, read from its client's
                touch table; absent when that table is gone, and for timers
                restored after a reboot, which are plain timers)
``ack``         the fired timer (``g``, ``k``, ``s``) was delivered to the
                application
``idle_rearm``  an idle timer was due (or within a few ms of it) but its key
                had been touched: it moved to ``d`` (last touch + ``i``),
                later than ``pd``, the deadline it had,
                ``s`` and ``i`` unchanged. Also written for an idle timer
                whose ``fire`` was journaled but which was never sent, put
                back on the wheel by a restarted daemon that cannot read
                its client's touches yet: pending again at ``d``
==============  ==============================================================

One more event type changes no timer and has no ``g``, ``k`` or ``s``: ``repl``,
the replication of the journal to the fleet's stream (``wheeld --replicate``,
docs/fleet.md) as the daemon saw it at ``t``. A replicating daemon writes one at
once when the replication's state changes, otherwise every
:data:`REPL_EVERY_MS` (10 s) at the least, and one when the journal closes;
through the same append as the timer events, so it is numbered, replicated and
compacted like them. A daemon without ``--replicate`` writes none.

==========  ==================================================================
``host``    the daemon's host id in the fleet (``--host-id``; not necessarily
            the segment header's ``host``)
``epoch``   its lease epoch (0 until it first holds its lease)
``state``   ``connecting``, ``replicating``, ``behind`` (the cluster out of
            reach or not storing), ``fenced`` (another host took its timers
            over: it stands down), ``stopped`` or ``failed``
            (:data:`REPL_STATES`)
``rlsn``    every event with ``n <= rlsn`` was stored by the stream
``lag``     events handed to the replicator and not stored yet (records)
``lag_ms``  how long the oldest of them has waited: ms since the stream last
            stored something, 0 when nothing waits
==========  ==================================================================

Examples (one line each in the file)::

    {"ev":"add","v":1,"n":1001,"t":1700000000000,"g":"conns","k":"c-17","d":1700000030000,"s":7,"i":30000,"crc":406464933}
    {"ev":"rearm","v":1,"n":1002,"t":1700000000100,"g":"jobs","k":4711,"d":1700000060000,"pd":1700000050000,"s":8,"crc":3360645997}
    {"ev":"cancel","v":1,"n":1003,"t":1700000000200,"g":"purgatory","k":"b64:AAEC","s":9,"hit":true,"pd":1700000000500,"crc":3794438138}
    {"ev":"fire","v":1,"n":1004,"t":1700000060003,"g":"jobs","k":4711,"d":1700000060000,"s":8,"f":1700000060003,"late":false,"lat":3,"crc":480816578}
    {"ev":"ack","v":1,"n":1005,"t":1700000060004,"g":"jobs","k":4711,"s":8,"crc":3489272897}
    {"ev":"idle_rearm","v":1,"n":1006,"t":1700000030000,"g":"conns","k":"c-17","d":1700000041000,"pd":1700000030000,"s":7,"i":30000,"crc":2961143879}
    {"ev":"repl","v":1,"n":1007,"t":1700000060010,"host":"web-3","epoch":3,"state":"replicating","rlsn":1005,"lag":1,"lag_ms":4,"crc":524358551}

(``python -m wheeld.protocol.journal`` prints these lines.)

State a reader rebuilds (the reference model of recovery): ``pending`` maps
(g, k) to (d, s, i); ``add``/``rearm`` set it, ``cancel`` and ``fire`` remove
it, ``idle_rearm`` changes its ``d``; ``fire`` also puts (g, k, s) into
``unacked``, which ``ack`` removes, and so does an ``idle_rearm`` of that
arming, which makes it pending again at its ``d``; ``repl`` changes nothing (it only
takes its lsn). Timers in ``unacked`` after a crash are
delivered again (at-least-once to the client library, which drops duplicates).

Snapshot files
==============

``<dir>/snapshot-<lsn:016d>.jsonl``: the state after every event with
``n <= lsn``. Lines, each with its own ``crc`` like a journal line::

    {"ev":"snapshot","v":1,"lsn":L,"count":P,"unacked":U,"t":...,"host":...,"name":...}
    {"ev":"pending","v":1,"g":...,"k":...,"d":...,"s":...[,"i":...]}      x P
    {"ev":"unacked","v":1,"g":...,"k":...,"d":...,"s":...,"f":...,"late":...,"lat":...[,"i":...]}  x U
    {"ev":"end","v":1,"lsn":L,"count":P,"unacked":U,"fcrc":C}

``fcrc`` is the CRC-32 of every byte of the file before the ``end`` line, so a
reader checks a whole snapshot with one pass of ``zlib.crc32`` (GB/s) instead
of a check per line. A snapshot without a valid ``end`` line is not a
snapshot. Snapshots are written to a temporary name, fsynced, renamed and the
directory fsynced (see :mod:`wheeld.journal.files`).

The durable mark
================

``<dir>/durable.mark``: the highest lsn the writer knows is on disk (fsynced),
kept outside the segments, so that cutting a segment short cannot take it
along. A crash mid-write can only lose what was never synced; a journal whose
events (or newest snapshot) end *before* the mark was cut short after the fact
(a truncated or deleted segment, a filesystem that lost synced blocks): that is
damage, not a torn write (reason ``truncated``). The file is 256 bytes: two
slots of 128, each one line padded with spaces before its newline::

    {"ev":"durable","v":1,"lsn":5210,"t":1700000000000,"crc":1942212744}      ...\n

The writer overwrites the two slots in turn (``pwrite`` + ``fdatasync``, never
growing the file), so a write cut short spoils at most one slot and the other
keeps an older, lower mark; a reader takes the highest lsn of the good slots
(:func:`parse_mark`; 0 when none, or no file: nothing is known). The mark only
ever trails what is durable: it is written after the fsync that made ``lsn``
durable (:mod:`wheeld.journal.files`).

Versioning
==========

``v`` is on every line. Adding an optional field keeps version 1 (readers
ignore unknown fields: msgspec does by default, Spark gives ``null``). A new
event type that changes timers, a changed meaning or a removed field makes
version 2; a version-1 reader never applies a line it does not understand: it
reports it rather than guessing (daemon recovery treats it as a damaged line:
skipped and counted, or a refusal to start under ``--journal-damage refuse``).

An event type that changes no timer keeps version 1: ``repl``. A reader that
does not know it loses nothing by skipping it: such a reader reports each
``repl`` line as a damaged line (``bad-json``, one event lost at its lsn) and
recovers the same timers, or refuses to start under ``--journal-damage
refuse``. Version 2 on these lines would change nothing for it (they would be
``unsupported-version``, skipped the same way).

Reading past damage
===================

Because every line is checked on its own, a damaged line costs only itself:
:func:`scan_lines` returns every good line of a segment and the runs of bad
lines between them (:class:`BadLines`: byte range, line numbers, reason), and
the lsns of the good lines around a bad run say which events it held. Only bad
bytes with no good line after them, at the end of the newest segment, are a
torn write. :func:`scan_segment` is the strict reader: it stops at the first
bad line.

For Spark
=========

``spark.read.json("fleet/*/journal-*.jsonl")`` gives one row per line
(header lines have ``ev = "segment"``). Spark does not check ``crc``: a
pipeline that must not be poisoned by a torn or corrupted line either reads
the files with :func:`iter_segment` (a Python data source) or filters lines
with :func:`check_line` (it accepts ``str`` lines, as the ``text`` reader gives).
With mixed key types Spark infers ``k`` as a string.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import zlib
from collections.abc import Iterable
from itertools import accumulate
from typing import Final, Literal, Union

import msgspec
from msgspec import UNSET, UnsetType

from .errors import InvalidKey, ProtocolError

__all__ = [
    "JOURNAL_VERSION",
    "JsonKey",
    "Add",
    "Rearm",
    "Cancel",
    "Fire",
    "Ack",
    "IdleRearm",
    "Repl",
    "SegmentHeader",
    "SnapshotHeader",
    "SnapshotPending",
    "SnapshotUnacked",
    "SnapshotEnd",
    "Event",
    "TimerEvent",
    "LoggedEvent",
    "SnapshotLine",
    "EVENT_TYPES",
    "REPL_EVERY_MS",
    "REPL_STATES",
    "CorruptJournal",
    "Defect",
    "TORN",
    "CHECKSUM",
    "BAD_JSON",
    "BAD_VERSION",
    "LSN_GAP",
    "BAD_HEADER",
    "key_to_json",
    "key_from_json",
    "encode_event",
    "encode_events",
    "encode_line",
    "line_body",
    "check_line",
    "decode_line",
    "scan_segment",
    "iter_segment",
    "BadLines",
    "SegmentScan",
    "scan_lines",
    "encode_snapshot",
    "parse_snapshot",
    "segment_name",
    "snapshot_name",
    "DurableMark",
    "MARK_NAME",
    "MARK_SLOT",
    "TRUNCATED",
    "encode_mark",
    "parse_mark",
    "parse_segment_name",
    "parse_snapshot_name",
]

JOURNAL_VERSION: Final = 1

SEGMENT_PREFIX = "journal-"
SNAPSHOT_PREFIX = "snapshot-"
SUFFIX = ".jsonl"

_SEGMENT_RE = re.compile(r"^journal-(\d{16})\.jsonl$")
_SNAPSHOT_RE = re.compile(r"^snapshot-(\d{16})\.jsonl$")

#: A key as it appears in the journal: a JSON string or a JSON integer.
JsonKey = Union[str, int]

_V = Literal[1]


# --------------------------------------------------------------------------- #
# Line types. Field order here is the order on disk (after "ev").
# --------------------------------------------------------------------------- #


class _Line(msgspec.Struct, tag_field="ev", kw_only=True):
    v: _V = JOURNAL_VERSION


class _TimerEvent(_Line, kw_only=True):
    n: int = 0  # assigned by the writer (wheeld.journal.files.Journal.append)
    t: int
    g: str
    k: JsonKey


class Add(_TimerEvent, tag="add", kw_only=True):
    """A new timer armed for (g, k): deadline ``d``; ``i`` set for idle timers."""

    d: int
    s: int
    i: int | UnsetType = UNSET


class Rearm(_TimerEvent, tag="rearm", kw_only=True):
    """A pending key armed again: new deadline ``d``, previous ``pd``, new seq ``s``."""

    d: int
    pd: int
    s: int
    i: int | UnsetType = UNSET


class Cancel(_TimerEvent, tag="cancel", kw_only=True):
    """A cancel command; ``hit`` if a pending timer (deadline ``pd``) was removed."""

    s: int
    hit: bool
    pd: int | UnsetType = UNSET


class Fire(_TimerEvent, tag="fire", kw_only=True):
    """A timer expired at ``f``; ``lat = f - d``; ``late`` if overdue after downtime."""

    d: int
    s: int
    f: int
    late: bool = False
    lat: int
    i: int | UnsetType = UNSET


class Ack(_TimerEvent, tag="ack", kw_only=True):
    """The fired timer (g, k, s) reached the application."""

    s: int


class IdleRearm(_TimerEvent, tag="idle_rearm", kw_only=True):
    """An idle timer found touched when due moved from ``pd`` to ``d``."""

    d: int
    pd: int
    s: int
    i: int


class Repl(_Line, tag="repl", kw_only=True):
    """The journal's replication as the daemon saw it at ``t`` (``wheeld --replicate``):
    the fleet ``host`` id and lease ``epoch``, the replicator's ``state``, the replicated
    lsn ``rlsn``, and ``lag`` events not stored yet, the oldest waiting ``lag_ms``."""

    n: int = 0  # assigned by the writer, as for the timer events
    t: int
    host: str
    epoch: int
    state: str
    rlsn: int
    lag: int
    lag_ms: int


class SegmentHeader(_Line, tag="segment", kw_only=True):
    """First line of every segment file."""

    host: str
    name: str
    lsn: int
    t: int
    mono0: int
    wall0: int


class SnapshotHeader(_Line, tag="snapshot", kw_only=True):
    """First line of a snapshot: it covers every event with ``n <= lsn``."""

    lsn: int
    count: int
    unacked: int
    t: int
    host: str = ""
    name: str = ""


class SnapshotPending(_Line, tag="pending", kw_only=True):
    """One pending timer in a snapshot."""

    g: str
    k: JsonKey
    d: int
    s: int
    i: int | UnsetType = UNSET


class SnapshotUnacked(_Line, tag="unacked", kw_only=True):
    """One fired-but-not-acknowledged timer in a snapshot (to deliver again)."""

    g: str
    k: JsonKey
    d: int
    s: int
    f: int
    late: bool = False
    lat: int
    i: int | UnsetType = UNSET


class SnapshotEnd(_Line, tag="end", kw_only=True):
    """Last line of a snapshot; ``fcrc`` = crc32 of every byte before this line."""

    lsn: int
    count: int
    unacked: int
    fcrc: int


class DurableMark(_Line, tag="durable", kw_only=True):
    """A slot of ``durable.mark``: every event with ``n <= lsn`` was on disk at wall ms ``t``."""

    lsn: int
    t: int


TimerEvent = Union[Add, Rearm, Cancel, Fire, Ack, IdleRearm]
#: Anything the writer numbers (``n``) and appends.
LoggedEvent = Union[Add, Rearm, Cancel, Fire, Ack, IdleRearm, Repl]
#: Anything that may appear in a segment file.
Event = Union[Add, Rearm, Cancel, Fire, Ack, IdleRearm, Repl, SegmentHeader]
SnapshotLine = Union[SnapshotHeader, SnapshotPending, SnapshotUnacked, SnapshotEnd]

#: ``ev`` value -> class, for readers that dispatch on the type name.
EVENT_TYPES: dict[str, type] = {
    "add": Add,
    "rearm": Rearm,
    "cancel": Cancel,
    "fire": Fire,
    "ack": Ack,
    "idle_rearm": IdleRearm,
    "repl": Repl,
    "segment": SegmentHeader,
}

#: A replicating daemon writes a ``repl`` event at least this often (ms), and at once
#: when the replication's state changes.
REPL_EVERY_MS: Final = 10_000
#: The ``state`` values of a ``repl`` event (the fleet replicator's states).
REPL_STATES: Final = ("connecting", "replicating", "behind", "fenced", "stopped", "failed")


class CorruptJournal(ProtocolError):
    """A journal or snapshot file does not hold what this format promises."""


# --------------------------------------------------------------------------- #
# Keys
# --------------------------------------------------------------------------- #

_B64 = "b64:"
_STR = "str:"
_ESCAPED = (_B64, _STR)


def key_to_json(key: str | bytes | int) -> JsonKey:
    """Return the journal form of a user key (see the module docstring)."""
    if type(key) is str:
        return _STR + key if key.startswith(_ESCAPED) else key
    if type(key) is int:
        return key
    if type(key) is bytes or type(key) is bytearray or type(key) is memoryview:
        return _B64 + base64.b64encode(bytes(key)).decode("ascii")
    if isinstance(key, bool):
        raise InvalidKey("a key is str, bytes or int, not bool")
    if isinstance(key, str):
        return key_to_json(str(key))
    if isinstance(key, int):
        return int(key)
    raise InvalidKey(f"a key is str, bytes or int, not {type(key).__name__}")


def key_from_json(value: JsonKey) -> str | bytes | int:
    """Inverse of :func:`key_to_json`; raise CorruptJournal on a bad ``b64:`` value."""
    if type(value) is str:
        if value.startswith(_B64):
            try:
                return base64.b64decode(value[4:], validate=True)
            except (binascii.Error, ValueError) as exc:
                raise CorruptJournal(f"bad base64 key {value!r}") from exc
        if value.startswith(_STR):
            return value[4:]
        return value
    if type(value) is int:
        return value
    raise CorruptJournal(f"a journal key is a JSON string or integer, not {value!r}")


# --------------------------------------------------------------------------- #
# Encoding
# --------------------------------------------------------------------------- #

_encoder = msgspec.json.Encoder()
_CRC_SEP = b',"crc":'
_CRC_SEP_LEN = len(_CRC_SEP)


def encode_line(body: bytes) -> bytes:
    """Turn an encoded JSON object ``body`` into a journal line (checksum + newline)."""
    return b"%b,\"crc\":%d}\n" % (body[:-1], zlib.crc32(body))


def encode_event(event: msgspec.Struct) -> bytes:
    """Encode one line (any type of this module) with its checksum and newline."""
    body = _encoder.encode(event)
    return b"%b,\"crc\":%d}\n" % (body[:-1], zlib.crc32(body))


def encode_events(events: Iterable[msgspec.Struct]) -> bytes:
    """Encode many lines into one ``bytes`` ready for a single ``write``.

    The fast path of the writer: one reused Encoder, one CRC call and one
    ``%``-format per line, one join at the end (docs/figures.md).
    """
    encode = _encoder.encode
    crc32 = zlib.crc32
    return b"".join([b"%b,\"crc\":%d}\n" % (body[:-1], crc32(body)) for body in map(encode, events)])


# --------------------------------------------------------------------------- #
# Verifying and decoding
# --------------------------------------------------------------------------- #

_event_decoder = msgspec.json.Decoder(Event)
_snapshot_decoder = msgspec.json.Decoder(SnapshotLine)
_any_decoder = msgspec.json.Decoder()


def line_body(line: bytes) -> bytes | None:
    """Return the checksummed body of ``line`` (without ``crc``), or None if it fails.

    ``line`` may end with ``\\n`` or not. The body is what the writer encoded,
    so ``msgspec.json.decode(body)`` gives the event without its ``crc``.
    """
    if line.endswith(b"\n"):
        line = line[:-1]
    cut = line.rfind(_CRC_SEP)
    if cut < 0 or not line.endswith(b"}"):
        return None
    digits = line[cut + _CRC_SEP_LEN : -1]
    if not digits.isdigit() or len(digits) > 10:
        return None
    body = line[:cut] + b"}"
    if zlib.crc32(body) != int(digits):
        return None
    return body


def check_line(line: bytes | str) -> bool:
    """True if ``line`` (bytes, or a str as Spark's text reader gives) has a good crc."""
    if isinstance(line, str):
        line = line.encode("utf-8")
    return line_body(line) is not None


def decode_line(line: bytes) -> Event:
    """Verify and decode one segment line; raise CorruptJournal if it is not valid."""
    body = line_body(line)
    if body is None:
        raise CorruptJournal(f"checksum mismatch or no checksum: {line[:80]!r}")
    try:
        return _event_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise CorruptJournal(f"not a version-{JOURNAL_VERSION} journal event: {exc}") from exc


TORN = "torn-tail"
TRUNCATED = "truncated"  # the journal ends before its durable mark
CHECKSUM = "checksum-mismatch"
BAD_JSON = "bad-json"
BAD_VERSION = "unsupported-version"
LSN_GAP = "lsn-gap"
BAD_HEADER = "bad-header"


class Defect(msgspec.Struct, frozen=True):
    """Where and why a segment stops being readable.

    ``offset`` is the byte offset of the first bad line, which is also the
    length of the good prefix: truncating the file there leaves only good
    lines. ``lines_after`` counts complete lines after the bad one: 0 for the
    usual crash (a torn tail), more for corruption in the middle of a file.
    """

    path: str
    offset: int
    line_no: int
    reason: str
    detail: str
    lines_after: int = 0

    def __str__(self) -> str:
        more = f", {self.lines_after} more line(s) after it" if self.lines_after else ""
        return f"{self.path}: {self.reason} at byte {self.offset} (line {self.line_no}): {self.detail}{more}"


def _classify_decode_failure(body: bytes) -> tuple[str, str]:
    try:
        raw = _any_decoder.decode(body)
    except msgspec.DecodeError as exc:
        return BAD_JSON, f"not JSON: {exc}"
    if isinstance(raw, dict) and raw.get("v", JOURNAL_VERSION) != JOURNAL_VERSION:
        return BAD_VERSION, f"version {raw.get('v')!r}, this reader knows {JOURNAL_VERSION}"
    try:
        _event_decoder.decode(body)
    except msgspec.DecodeError as exc:
        return BAD_JSON, f"not a journal event: {exc}"
    return BAD_JSON, "undecodable"  # pragma: no cover - decode succeeded alone


def _skip_events(lines: list[bytes], skip: int) -> tuple[list[bytes], int]:
    """``lines`` without the ``skip`` event lines after the header line, and the bytes those
    take in the file (newlines included)."""
    if not skip:
        return lines, 0
    return lines[:1] + lines[1 + skip :], sum(map(len, lines[1 : 1 + skip])) + skip


class _Lines:
    """A segment's bytes cut into the lines to check: the header line, then the lines after
    the ``skip_events`` skipped ones; indexes into ``checked`` map back to file offsets and
    line numbers. ``keep_tail``: a last piece without its newline is a line too."""

    def __init__(self, data: bytes, skip_events: int, keep_tail: bool) -> None:
        lines = data.split(b"\n")
        # a file ending in "\n" splits into [..., b""]; anything else is a torn tail
        self.tail = lines.pop()
        self.skip = max(0, min(skip_events, len(lines) - 1))
        if keep_tail and self.tail:
            lines.append(self.tail)  # never a record: its verdict is always bad
        self.data = data
        self.total = len(lines)
        self.checked, self.skipped_bytes = _skip_events(lines, self.skip)
        self._starts: list[int] | None = None

    def offset_of(self, index: int) -> int:
        """Byte offset of ``checked[index]`` in the file (``index == len(checked)``: the end)."""
        if self._starts is None:  # computed only when something bad needs placing
            self._starts = list(accumulate(map(len, self.checked), initial=0))
        return min(len(self.data), self._starts[index] + index + (self.skipped_bytes if index >= 1 else 0))

    def file_line(self, index: int) -> int:
        """1-based line number in the file of ``checked[index]``."""
        return (index + self.skip if index >= 1 else index) + 1


def _body(line: bytes) -> bytes:
    """What a line's crc covers: the line up to its last ``,"crc":``, closed with ``}``."""
    return line[: line.rfind(_CRC_SEP)] + b"}"


def _verify(lines: list[bytes]) -> tuple[list[bytes], list[bool]]:
    """Every line's body and whether its crc matches, checked in bulk (list comprehensions
    and map run in C loops): a line must end with exactly the suffix the writer would have
    produced for its body; one with no ``,"crc":`` gets a body whose suffix it cannot end with."""
    bodies = [line[: line.rfind(_CRC_SEP)] + b"}" for line in lines]
    verdicts = list(map(bytes.endswith, lines, [b',"crc":%d}' % crc for crc in map(zlib.crc32, bodies)]))
    return bodies, verdicts


#: where a strict read stops: (index in the lines checked, reason, detail)
_Stop = tuple[int, str, str]


def scan_segment(
    data: bytes, path: str = "<bytes>", skip_events: int = 0
) -> tuple[list[Event], int, Defect | None]:
    """Verify and decode a segment's bytes: ``(events, good_length, defect)``.

    ``events[0]`` is the :class:`SegmentHeader` (if the header is good), then
    the timer events in lsn order. Reading stops at the first bad line; the
    defect says where and why:

    - ``torn-tail``: the last line has no newline, or everything from the bad
      line to the end of the file is NUL bytes (a crash after the file grew
      but before its data reached the disk);
    - ``checksum-mismatch``: a complete line whose crc does not match;
    - ``bad-json`` / ``unsupported-version``: the crc matches but the line is
      not a version-1 event;
    - ``bad-header``: the first line is not a segment header;
    - ``lsn-gap``: an event's ``n`` does not follow the previous one.

    ``skip_events`` lines after the header are neither checked nor decoded
    (recovery skips the events a snapshot already covers). The lsns are then
    checked to be consecutive from the first line read, and the caller must
    check that this first lsn is the one it wanted (if a newline was damaged
    in the skipped part, the count of lines is off). Offsets and line numbers
    are the whole file's.

    Checksums are checked in bulk (one ``zlib.crc32`` per line in C-level
    loops); the good lines are then decoded in one ``msgspec`` call
    (``decode_lines``).
    """
    lines = _Lines(data, skip_events, keep_tail=False)
    good_count, stop, good_end = _crc_prefix(lines)
    events: list[Event] = []
    if good_count:
        events, found, good_end = _decode_prefix(lines, good_count, good_end)
        stop = found or stop
    if events:
        found, good_end = _check_sequence(lines, events, good_end)
        stop = found or stop
    if stop is None:
        return events, good_end, None
    index, reason, detail = stop
    line = lines.file_line(index)
    return events, good_end, Defect(path, good_end, line, reason, detail, max(0, lines.total - line))


def _crc_prefix(lines: _Lines) -> tuple[int, _Stop | None, int]:
    """The lines before the first bad crc: ``(count, stop, good_end)``. A last line with no
    newline, or only NUL bytes from the bad line on, is a torn tail."""
    checked, data = lines.checked, lines.data
    _, verdicts = _verify(checked)
    try:
        bad = verdicts.index(False)
    except ValueError:
        good_end = len(data) - len(lines.tail)
        if lines.tail:
            return len(checked), (len(checked), TORN, f"last line has no newline ({len(lines.tail)} bytes)"), good_end
        return len(checked), None, good_end
    good_end = lines.offset_of(bad)
    if not data[good_end:].strip(b"\x00"):
        return bad, (bad, TORN, f"{len(data) - good_end} NUL bytes at the end"), good_end
    return bad, (bad, CHECKSUM, f"line does not match its crc: {checked[bad][:60]!r}"), good_end


def _decode_prefix(lines: _Lines, good_count: int, good_end: int) -> tuple[list[Event], _Stop | None, int]:
    """Decode the first ``good_count`` lines (their crcs match) in one call; if that fails,
    line by line up to the first that is not a version-1 event: ``(events, stop, good_end)``."""
    checked = lines.checked
    try:
        events = [_event_decoder.decode(_body(checked[0]))]
        if good_count > 1:
            rest_start = len(checked[0]) + 1 + lines.skipped_bytes
            events += _event_decoder.decode_lines(memoryview(lines.data)[rest_start:good_end])
        return events, None, good_end
    except msgspec.DecodeError:
        pass
    events = []
    for index in range(good_count):
        body = _body(checked[index])
        try:
            events.append(_event_decoder.decode(body))
        except msgspec.DecodeError:
            reason, detail = _classify_decode_failure(body)
            return events, (index, reason, detail), lines.offset_of(index)
    return events, None, good_end


def _check_sequence(lines: _Lines, events: list[Event], good_end: int) -> tuple[_Stop | None, int]:
    """A header, then consecutive lsns: ``(stop, good_end)``; ``events`` is cut at the first
    event out of sequence (emptied when the first line is not a header)."""
    header = events[0]
    if type(header) is not SegmentHeader:
        events.clear()
        return (0, BAD_HEADER, f"first line is {type(header).__name__}, not a segment header"), 0
    expect = header.lsn if not lines.skip or len(events) < 2 else getattr(events[1], "n", -1)
    for index in range(1, len(events)):
        event = events[index]
        if isinstance(event, SegmentHeader) or event.n != expect:
            got = "a second header" if isinstance(event, SegmentHeader) else f"lsn {event.n}"
            del events[index:]
            return (index, LSN_GAP, f"expected lsn {expect}, found {got}"), lines.offset_of(index)
        expect += 1
    return None, good_end


def iter_segment(path: str | os.PathLike[str]) -> tuple[list[Event], Defect | None]:
    """Read a segment file: ``(events, defect)``; ``defect`` is None if it is whole.

    ``events`` holds the header and every event before the first bad line
    (see :func:`scan_segment` for the reasons). The file is not modified.
    """
    with open(path, "rb") as file:
        data = file.read()
    events, _, defect = scan_segment(data, os.fspath(path))
    return events, defect


# --------------------------------------------------------------------------- #
# Reading past damage: every good line, and where the bad ones are
# --------------------------------------------------------------------------- #


class BadLines(msgspec.Struct, frozen=True):
    """A run of consecutive lines of one file that cannot be used.

    ``start``/``end`` are byte offsets (``end`` exclusive: the next good line
    starts there, or the file ends); ``first_line`` is the 1-based number of
    its first line and ``lines`` how many lines it spans (pieces between
    newlines: a damaged newline merges two lines into one bad line, a byte
    turned into a newline splits one line into two bad ones; an unterminated
    last piece counts as one). ``reason``/``detail`` describe its first line.
    ``at_end``: no good line follows it in the file.
    """

    path: str
    start: int
    end: int
    first_line: int
    lines: int
    reason: str
    detail: str
    at_end: bool = False

    @property
    def last_line(self) -> int:
        return self.first_line + self.lines - 1

    def where(self) -> str:
        """``bytes 120-250 (line 3)`` / ``bytes 120-250 (lines 3-4, 2 lines)``."""
        lines = (f"line {self.first_line}" if self.lines == 1
                 else f"lines {self.first_line}-{self.last_line}, {self.lines} lines")
        return f"bytes {self.start}-{self.end} ({lines})"

    def __str__(self) -> str:
        return f"{self.path} {self.where()}: {self.reason}: {self.detail}"


class SegmentScan(msgspec.Struct):
    """What :func:`scan_lines` found in a segment.

    ``parts`` lists, in file order, runs of good timer events (a ``list``;
    every line verified and decoded) and the :class:`BadLines` between them.
    The header is not in ``parts``: ``header`` is None when the first line is
    damaged (or is an event). ``good_end`` is the offset just past the last
    good line (0: none). Lsns are not checked here: the reader knows which lsn
    it expects next (``wheeld.journal.recovery.recover`` does).
    """

    path: str
    size: int
    header: SegmentHeader | None
    parts: list
    good_end: int

    @property
    def bad(self) -> list[BadLines]:
        return [part for part in self.parts if type(part) is BadLines]

    @property
    def events(self) -> list:
        return [event for part in self.parts if type(part) is list for event in part]


def scan_lines(data: bytes, path: str = "<bytes>", skip_events: int = 0) -> SegmentScan:
    """Verify and decode every line of a segment, going on past bad ones.

    Unlike :func:`scan_segment`, which stops at the first bad line, this keeps
    every good line: a bad line (a crc that does not match, a line that is
    not a version-1 event, a segment header after the first line, an
    unterminated last piece, NUL bytes) goes into a :class:`BadLines` run and
    reading goes on with the next line. Each line carries its own crc, so a
    damaged byte costs the line it is in, and a damaged newline the two lines
    it joins; never what follows them. A bad run followed by no good line is
    marked ``at_end``; when everything from its start is NUL bytes its reason
    is ``torn-tail`` (a file that grew but whose data never reached the disk).

    ``skip_events`` lines after the header are neither checked nor decoded, as
    in :func:`scan_segment`; offsets and line numbers stay the file's. The
    clean case costs what :func:`scan_segment` costs (one bulk crc check, one
    ``decode_lines`` call); the offsets of lines are computed only when there
    is something bad to place.
    """
    lines = _Lines(data, skip_events, keep_tail=True)
    size = len(data)
    if not lines.checked:
        return SegmentScan(path, size, None, [], 0)
    bodies, verdicts = _verify(lines.checked)
    if lines.tail:
        verdicts[-1] = False
    header, first_event, header_fault = _first_line(bodies[0], verdicts[0])
    del bodies
    if all(verdicts) and header_fault is None:  # the common case: every line good, one bulk decode
        run = _decode_clean(lines, first_event)
        if run is not None:
            return SegmentScan(path, size, header, [run] if run else [], size)
    parts, good_end = _Placing(lines, path, verdicts, first_event, header_fault).parts(header is not None)
    return SegmentScan(path, size, header, parts, good_end)


def _first_line(body: bytes, good: bool) -> tuple[SegmentHeader | None, int, tuple[str, str] | None]:
    """The first line read: ``(header, index of the first event line, why it is bad)``; a good
    first line that is an event, not a header, is kept like any good line."""
    if not good:
        return None, 1, None
    try:
        first = _event_decoder.decode(body)
    except msgspec.DecodeError:
        return None, 1, _classify_decode_failure(body)
    if type(first) is SegmentHeader:
        return first, 1, None
    return None, 0, None


def _decode_clean(lines: _Lines, first_event: int) -> list | None:
    """Every event line in one ``decode_lines`` call; None if that fails or meets a header."""
    checked = lines.checked
    rest_start = (len(checked[0]) + 1 + lines.skipped_bytes) if first_event else 0
    try:
        run = _event_decoder.decode_lines(memoryview(lines.data)[rest_start:]) if len(checked) > first_event else []
    except msgspec.DecodeError:
        return None
    return None if SegmentHeader in map(type, run) else run


class _Placing:
    """:func:`scan_lines` once something is bad: why each bad line is bad, the good runs
    between them (decoded in bulk, line by line where that fails), then the parts."""

    def __init__(self, lines: _Lines, path: str, verdicts: list[bool], first_event: int,
                 header_fault: tuple[str, str] | None) -> None:
        self.lines = lines
        self.path = path
        self.reasons: dict[int, tuple[str, str]] = {} if header_fault is None else {0: header_fault}
        last = len(lines.checked) - 1
        for index, good in enumerate(verdicts):
            if good:
                continue
            if lines.tail and index == last:
                self.reasons[index] = (TORN, f"last line has no newline ({len(lines.tail)} bytes)")
            else:
                self.reasons[index] = (CHECKSUM, f"line does not match its crc: {lines.checked[index][:60]!r}")
        self.items: list = []  # file order: (low, high, events) for a good run, an int for a bad line
        if first_event == 1 and 0 in self.reasons:
            self.items.append(0)
        position = first_event
        for index in sorted(i for i in self.reasons if i >= first_event):
            self._decode_run(position, index)
            self.items.append(index)
            position = index + 1
        self._decode_run(position, len(lines.checked))

    def _decode_run(self, low: int, high: int) -> None:
        """Good-crc lines low..high-1 into ``items``, per line if the bulk decode fails."""
        if low >= high:
            return
        lines, items = self.lines, self.items
        try:
            run = _event_decoder.decode_lines(memoryview(lines.data)[lines.offset_of(low) : lines.offset_of(high)])
            if SegmentHeader not in map(type, run):
                items.append((low, high, run))
                return
        except msgspec.DecodeError:
            pass
        run, run_low = [], low
        for index in range(low, high):
            body = _body(lines.checked[index])
            try:
                event = _event_decoder.decode(body)
            except msgspec.DecodeError:
                event = None
                self.reasons[index] = _classify_decode_failure(body)
            if type(event) is SegmentHeader:
                event = None
                self.reasons[index] = (BAD_HEADER, "a segment header after the first line")
            if event is None:
                if run:
                    items.append((run_low, index, run))
                items.append(index)
                run, run_low = [], index + 1
            else:
                run.append(event)
        if run:
            items.append((run_low, high, run))

    def parts(self, has_header: bool) -> tuple[list, int]:
        """``(parts, good_end)``: runs of events and :class:`BadLines` in file order, consecutive
        bad lines in one run (not across the skipped events), and the end of the last good line."""
        parts: list = []
        good_end = self.lines.offset_of(1) if has_header else 0
        bad: list[int] | None = None  # first and last index of the bad run being built
        for item in self.items:
            if type(item) is int:
                if bad is not None and item == bad[1] + 1 and not (self.lines.skip and bad[1] == 0):
                    bad[1] = item
                    continue
                if bad is not None:
                    parts.append(self._bad_lines(*bad))
                bad = [item, item]
            else:
                if bad is not None:
                    parts.append(self._bad_lines(*bad))
                    bad = None
                low, high, run = item
                parts.append(run)
                good_end = self.lines.offset_of(high)
        if bad is not None:
            parts.append(self._bad_lines(*bad))
        _mark_at_end(parts, self.lines.data)
        return parts, good_end

    def _bad_lines(self, first: int, last: int) -> BadLines:
        lines = self.lines
        reason, detail = self.reasons[first]
        first_line = lines.file_line(first)
        return BadLines(self.path, lines.offset_of(first), lines.offset_of(last + 1), first_line,
                        lines.file_line(last) - first_line + 1, reason, detail)


def _mark_at_end(parts: list, data: bytes) -> None:
    """The bad runs after the last good event are ``at_end``; ``torn-tail`` when only NUL bytes
    follow their start (a file that grew but whose data never reached the disk)."""
    for index in range(len(parts) - 1, -1, -1):
        part = parts[index]
        if type(part) is list:
            break
        if not data[part.start :].strip(b"\x00"):
            part = msgspec.structs.replace(part, reason=TORN, detail=f"{len(data) - part.start} NUL bytes at the end")
        parts[index] = msgspec.structs.replace(part, at_end=True)


# --------------------------------------------------------------------------- #
# Snapshots
# --------------------------------------------------------------------------- #


def encode_snapshot(
    header: SnapshotHeader,
    pending: Iterable[SnapshotPending],
    unacked: Iterable[SnapshotUnacked] = (),
) -> bytes:
    """The bytes of a snapshot file. ``header.count``/``unacked`` are filled in here."""
    pending_bytes = encode_events(pending)
    unacked_bytes = encode_events(unacked)
    count = pending_bytes.count(b"\n")
    unacked_count = unacked_bytes.count(b"\n")
    header = msgspec.structs.replace(header, count=count, unacked=unacked_count)
    head = encode_event(header)
    crc = zlib.crc32(unacked_bytes, zlib.crc32(pending_bytes, zlib.crc32(head)))
    end = encode_event(SnapshotEnd(lsn=header.lsn, count=count, unacked=unacked_count, fcrc=crc))
    return b"".join((head, pending_bytes, unacked_bytes, end))


_snapshot_decoders: dict[tuple[type, type], msgspec.json.Decoder] = {}


def parse_snapshot(
    data: bytes,
    pending_type: type = SnapshotPending,
    unacked_type: type = SnapshotUnacked,
) -> tuple[SnapshotHeader, list, list]:
    """Check and decode a snapshot file; raise CorruptJournal if any check fails.

    Checks: the ``end`` line's own crc, ``fcrc`` over everything before it,
    header and end line agreeing on lsn and counts, and the line count.
    ``pending_type``/``unacked_type`` let a reader decode the ``pending`` and
    ``unacked`` lines straight into its own structs (tagged ``"pending"`` /
    ``"unacked"`` on ``"ev"``, with ``rename`` mapping to the short names),
    saving a copy per timer: the daemon's recovery does this.
    """
    decoder = _snapshot_decoders.get((pending_type, unacked_type))
    if decoder is None:
        decoder = msgspec.json.Decoder(Union[SnapshotHeader, pending_type, unacked_type, SnapshotEnd])
        _snapshot_decoders[(pending_type, unacked_type)] = decoder
    if not data.endswith(b"\n"):
        raise CorruptJournal("snapshot does not end with a newline (torn)")
    cut = data.rfind(b"\n", 0, len(data) - 1) + 1
    end_body = line_body(data[cut:])
    if end_body is None:
        raise CorruptJournal("snapshot end line fails its crc")
    try:
        end = _snapshot_decoder.decode(end_body)
    except msgspec.DecodeError as exc:
        raise CorruptJournal(f"snapshot end line: {exc}") from exc
    if type(end) is not SnapshotEnd:
        raise CorruptJournal(f"snapshot's last line is {type(end).__name__}, not its end line")
    if zlib.crc32(memoryview(data)[:cut]) != end.fcrc:
        raise CorruptJournal("snapshot content does not match its fcrc")
    try:
        lines = decoder.decode_lines(memoryview(data)[:cut])
    except msgspec.DecodeError as exc:
        raise CorruptJournal(f"snapshot line does not decode: {exc}") from exc
    if not lines or type(lines[0]) is not SnapshotHeader:
        raise CorruptJournal("snapshot does not start with its header")
    header = lines[0]
    if (header.lsn, header.count, header.unacked) != (end.lsn, end.count, end.unacked):
        raise CorruptJournal("snapshot header and end line disagree")
    if len(lines) != 1 + header.count + header.unacked:
        raise CorruptJournal("snapshot line count differs from its header")
    pending = lines[1 : 1 + header.count]
    unacked = lines[1 + header.count :]
    del lines
    if any(type(item) is not pending_type for item in pending) or any(
        type(item) is not unacked_type for item in unacked
    ):
        raise CorruptJournal("snapshot lines are out of order")
    return header, pending, unacked


# --------------------------------------------------------------------------- #
# The durable mark
# --------------------------------------------------------------------------- #

MARK_NAME = "durable.mark"
MARK_SLOT = 128  # bytes per slot; the file holds two
_mark_decoder = msgspec.json.Decoder(DurableMark)


def encode_mark(lsn: int, t: int) -> bytes:
    """One slot of the mark file: the line of :class:`DurableMark`, padded to :data:`MARK_SLOT`."""
    line = encode_event(DurableMark(lsn=lsn, t=t))
    return line[:-1].ljust(MARK_SLOT - 1, b" ") + b"\n"


def parse_mark(data: bytes) -> int:
    """The highest ``lsn`` among the good slots of a mark file's bytes (0: none good)."""
    best = 0
    for start in range(0, len(data) - MARK_SLOT + 1, MARK_SLOT):
        body = line_body(data[start : start + MARK_SLOT].rstrip(b" \n"))
        if body is None:
            continue
        try:
            mark = _mark_decoder.decode(body)
        except msgspec.DecodeError:
            continue
        best = max(best, mark.lsn)
    return best


# --------------------------------------------------------------------------- #
# File names
# --------------------------------------------------------------------------- #


def segment_name(first_lsn: int) -> str:
    """File name of the segment whose first event has lsn ``first_lsn``."""
    return f"{SEGMENT_PREFIX}{first_lsn:016d}{SUFFIX}"


def snapshot_name(lsn: int) -> str:
    """File name of the snapshot covering events up to lsn ``lsn``."""
    return f"{SNAPSHOT_PREFIX}{lsn:016d}{SUFFIX}"


def parse_segment_name(name: str) -> int | None:
    """First lsn from a segment file name, or None if it is not one."""
    match = _SEGMENT_RE.match(name)
    return int(match.group(1)) if match else None


def parse_snapshot_name(name: str) -> int | None:
    """Lsn from a snapshot file name, or None if it is not one."""
    match = _SNAPSHOT_RE.match(name)
    return int(match.group(1)) if match else None


if __name__ == "__main__":  # print real example lines
    _t = 1_700_000_000_000
    for _event in (
        SegmentHeader(host="web-3", name="default", lsn=1001, t=_t, mono0=523_311, wall0=_t),
        Add(n=1001, t=_t, g="conns", k="c-17", d=_t + 30_000, s=7, i=30_000),
        Rearm(n=1002, t=_t + 100, g="jobs", k=4711, d=_t + 60_000, pd=_t + 50_000, s=8),
        Cancel(n=1003, t=_t + 200, g="purgatory", k=key_to_json(b"\x00\x01\x02"), s=9, hit=True, pd=_t + 500),
        Fire(n=1004, t=_t + 60_003, g="jobs", k=4711, d=_t + 60_000, s=8, f=_t + 60_003, lat=3),
        Ack(n=1005, t=_t + 60_004, g="jobs", k=4711, s=8),
        IdleRearm(n=1006, t=_t + 30_000, g="conns", k="c-17", d=_t + 41_000, pd=_t + 30_000, s=7, i=30_000),
        Repl(n=1007, t=_t + 60_010, host="web-3", epoch=3, state="replicating", rlsn=1005, lag=1, lag_ms=4),
    ):
        print(encode_event(_event).decode(), end="")
