"""A client's segment: a lock-free single-producer/single-consumer command ring and a touch table.

The daemon creates one segment per client session (:meth:`ClientSegment.create`):
a memfd sealed against resizing, passed to that client alone over its Unix socket
(:mod:`wheeld.shm.memfd`); the client maps it (:meth:`ClientSegment.attach`) and appends 64-byte command
records (:mod:`wheeld.protocol.commands`) to the
ring; the daemon copies them out in batches (:meth:`ClientSegment.drain`). The
byte layout is declared in :mod:`wheeld.protocol.ring_layout`.

Supported platform: x86-64 (Linux) with CPython. The argument below relies on the
x86-64 memory model and on how CPython stores through a memoryview; on another
architecture the ring needs real fences and this module warns at import.

Memory ordering
===============

Who writes what:

============================  ============================  =======================
word                          written by                    read by
============================  ============================  =======================
ring records                  producer (client) only        consumer (daemon)
a record's answer mark (pad)  consumer, before the head     producer, at a head read
                              moves past the record         and when a session opens
tail (own cache line)         producer only                 consumer
head (own cache line)         consumer only                 producer
closed (head's line)          consumer only                 producer
producer_pid (tail's line)    producer, once at attach      consumer (diagnostics)
touch table                   producer only                 consumer
============================  ============================  =======================

``tail`` and ``head`` are free-running record counters; slot = counter & mask.

Producer (push)::

    1. if tail - head_cache == capacity: head_cache = load(head); still full -> return False
    2. write the whole 64-byte record into slot tail & mask (pack_into)
    3. store(tail, tail + 1)                    # publish

Consumer (drain)::

    1. t = load(tail)                           # everything before t is complete
    2. check 0 <= t - head <= capacity, else ProtocolError (the segment is untrusted)
    3. copy records head .. t-1 out of the ring (one copy)           peek() / peek_bytes()
    4. store(head, head + n)                    # hand the slots back  commit(n)

(``drain`` is both; the daemon peeks, applies the batch, then commits, so a
daemon killed in between finds the batch again after :meth:`adopt`.)

Why it is safe:

* Each hot word is an aligned 8-byte word written by ``memoryview.cast('Q')``
  item assignment. CPython implements that as a ``memcpy`` of a fixed 8 bytes,
  which the compiler emits as one ``mov``; an aligned 8-byte ``mov`` is atomic
  on x86-64. A reader sees the old or the new counter, never a mix.
* x86-64 (TSO) does not reorder a store with earlier stores: when the consumer
  observes the new tail, the record stores of step 2 are visible too. Loads are
  not reordered with earlier loads: the record loads of consumer step 3 happen
  after the tail load of step 1.
* x86-64 does not reorder a store with earlier loads: the head store of step 4
  becomes visible only after the copy of step 3 read the slots, so the producer
  never overwrites a slot the consumer is still copying.
* The compiler cannot move these accesses across each other either: every
  step is a separate bytecode, i.e. separate opaque C calls.
* Compiled (Cython, see :mod:`wheeld.protocol.accel`), a push writes the record
  with plain C stores of 8-byte words into the mapping and then the tail with one
  aligned 8-byte store; a compiler barrier between the two (``_store_fence``,
  declared in ring.pxd) keeps the C compiler from moving a record store below
  the tail store, and x86-64 keeps them in order for the consumer.
* The producer keeps a private copy of ``tail`` and a cached ``head`` (reloaded
  only when the ring looks full), so a push touches the shared head line rarely.
  The consumer keeps a private ``head`` and does not read it back from the
  segment (except once, in :meth:`adopt`).

What the ring does not give: a store-then-load fence. x86-64 may reorder a store
with a later load of another address, so a "set parked, then re-check the rings"
eventcount built on plain stores can miss a wake-up; its users need a locked
instruction between the two (e.g. acquiring and releasing an uncontended
``threading.Lock``) or a bounded sleep.

Dead producer
=============

A client killed in the middle of step 2 never reached step 3: the half-written
record lies beyond the published tail and the consumer never looks at it. The
consumer sees an intact prefix of what the client pushed. Nothing has to be
repaired; the daemon notices the death on the socket, drains what was published
and then closes the segment.
``tests/test_ring_multiprocess.py`` kills producers with SIGKILL mid-stream.

Hostile client
==============

The client can write anything anywhere in its segment, including ``head`` and
``tail``. The consumer therefore trusts nothing it reads from the segment: it
uses the capacities it chose at :meth:`create`, keeps ``head`` privately (only
:meth:`adopt`, after a daemon restart, reads it back), checks
``0 <= tail - head <= capacity`` before copying (else :class:`ProtocolError`),
bound-checks touch indices, and the records it returns still have to pass
:func:`wheeld.protocol.commands.validate_records`. A client scribbling on its own
segment can only break its own timers. It cannot resize the segment either: the
memfd is sealed (``F_SEAL_SHRINK | F_SEAL_GROW``), so the daemon can never take
SIGBUS from pages a client truncated away.

Answers kept in the ring
========================

A refusal (``Rejected``) exists only in its answer, and answers travel on the
socket after the head has moved: a daemon killed in between, a session closed, or
answers queued for a socket the client stopped reading would lose it, and the
client's next flush would be answered as if the refused command had been applied.
So the consumer writes each such decision into the record itself, in its ``pad``
word (the *answer mark*, :data:`~wheeld.protocol.commands.ANSWER_MARKS`), before it
publishes the head past it (:meth:`ClientSegment.mark_answer`): the refused
commands, and the FLUSHes answered as not durable (journal unavailable, or held
for a replication stream). The producer never writes a slot the head has not
passed, so the mark is stored before the producer can overwrite the record. Each
time the producer reads a new head (the slow path of a push that found the ring
full by its cached head), it keeps a copy of every marked record and every FLUSH
the head has passed since the last one it read (:attr:`ClientSegment.kept_marks`):
those are the records it may overwrite next, and a push pays nothing for them.
When the client's next session opens, the library reads the records between its
last answered FLUSH and the head the new session starts from
(:meth:`ClientSegment.consumed_records`): every FLUSH there was applied, every mark
is a refusal, and those it did not receive are answered from the ring. A consumer
that adopts a ring clears the marks of the records it is to apply (a daemon killed
between the mark and the head leaves some).

Daemon restart
==============

The client keeps the segment's descriptor. When it reconnects to a restarted
daemon it passes the descriptor back with its ``Hello``; the new daemon checks
the seals and the header (:meth:`adopt`) and carries on from the head word the
old one published, so commands pushed while no daemon ran are applied. A daemon
whose arena is not the one the client last flushed to rewinds the head to the
client's last acknowledged flush and publishes it: the one time the head word
moves backwards. The producer's cached head cannot see that, so while its
``Hello`` offers such a replay it counts its room from that position
(:meth:`limit_head`), and never overwrites a record the daemon is to apply again.

Costs (``python bench/ring.py``, docs/figures.md): as Python, a push is one 56-byte
``struct`` pack, one ``crc32``, one ``pack_into`` and one 8-byte store; compiled, eight
8-byte stores and a slicing-by-8 CRC-32 in C. A touch is one 8-byte store; a drain
is one numpy copy per contiguous run of slots.
"""

from __future__ import annotations

import array
import mmap
import os
import platform
import struct
import warnings
import zlib

import numpy as np
from wheeld.protocol import ring_layout as layout
from wheeld.protocol.commands import (
    ADD,
    ADD_CHECKED,
    ADD_RECORD,
    CHECKED,
    FLUSH,
    KEY_FIELD_SIZE,
    PAD_OFFSET,
    RECORD,
    RECORD_DTYPE,
    RECORD_SHIFT,
)
from wheeld.protocol.errors import BrokenPeer, Closed, InvalidRequest, ProtocolError

from . import memfd

SUPPORTED_MACHINES = ("x86_64", "AMD64")
if platform.machine() not in SUPPORTED_MACHINES:  # pragma: no cover - CI is x86-64
    warnings.warn(
        f"wheeld.shm.ring relies on x86-64 store ordering; {platform.machine()} is not supported",
        RuntimeWarning,
        stacklevel=2,
    )

_crc32 = zlib.crc32
_pack_checked = CHECKED.pack
_pack_record_into = RECORD.pack_into
_pack_add_checked = ADD_CHECKED.pack
_pack_add_into = ADD_RECORD.pack_into
_TAIL_WORD = layout.TAIL_WORD
_HEAD_WORD = layout.HEAD_WORD
_EMPTY = np.zeros(0, dtype=RECORD_DTYPE)
_MARK = struct.Struct("<I")  # a record's answer mark (its pad word; protocol.commands.ANSWER_MARKS)
_MARKS_ONE_BY_ONE = 32  # _keep_marks: fewer new records than this are read one at a time
#: the longest idle timeout (about 24.8 days): an ADD_IDLE's aux0 is a signed 32-bit field
MAX_IDLE_MS = (1 << 31) - 1

# ------------------------------------------------------------------ the typed record writer
#
# This module is compiled by Cython (wheeld.protocol.accel, ring.pxd). Compiled, a push
# writes the record with the typed writer below (eight 8-byte stores and a table-driven
# CRC-32, no Python object made); as Python source, it writes it with struct and
# zlib.crc32, which is faster there. Both produce the same 64 bytes
# (tests/test_ring.py holds them equal on both paths).
_COMPILED = not __file__.endswith(".py")
_U32 = 0xFFFFFFFF
_U64 = 0xFFFFFFFFFFFFFFFF
_I64_MAX = (1 << 63) - 1
_I64_MIN = -_I64_MAX - 1
_I32_MIN = -(1 << 31)
_I32_MAX = (1 << 31) - 1
_WORDS_PER_RECORD = RECORD.size // 8


def _crc32_slice8_tables() -> array.array:
    """zlib's CRC-32 (reflected polynomial 0xEDB88320) as 8 tables of 256: table k maps a
    byte to the CRC of that byte followed by k zero bytes (slicing-by-8)."""
    tables = array.array("I", bytes(4 * 8 * 256))
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0xEDB88320 if crc & 1 else crc >> 1
        tables[byte] = crc
    for k in range(1, 8):
        for byte in range(256):
            previous = tables[(k - 1) * 256 + byte]
            tables[k * 256 + byte] = (previous >> 8) ^ tables[previous & 0xFF]
    return tables


_CRC_TABLES = _crc32_slice8_tables()


def _crc32_word(crc: int, word: int) -> int:
    """Feed the 8 little-endian bytes of ``word`` to a running (pre-inverted) CRC-32."""
    low = (crc ^ word) & _U32
    high = word >> 32
    return (_CRC_TABLES[7 * 256 + (low & 0xFF)] ^ _CRC_TABLES[6 * 256 + ((low >> 8) & 0xFF)]
            ^ _CRC_TABLES[5 * 256 + ((low >> 16) & 0xFF)] ^ _CRC_TABLES[4 * 256 + (low >> 24)]
            ^ _CRC_TABLES[3 * 256 + (high & 0xFF)] ^ _CRC_TABLES[2 * 256 + ((high >> 8) & 0xFF)]
            ^ _CRC_TABLES[256 + ((high >> 16) & 0xFF)] ^ _CRC_TABLES[high >> 24])


def _key_word(key_bytes: bytes, length: int, first: int) -> int:
    """Bytes ``first .. first+7`` of the zero-padded key field as a little-endian word."""
    if _COMPILED:
        return _key_word_le(key_bytes, first)  # noqa: F821 - ring.pxd: one memcpy
    word = 0
    end = first + 8 if first + 8 < length else length
    for i in range(end - 1, first - 1, -1):
        word = (word << 8) | key_bytes[i]
    return word


class ClientSegment:
    """One client's ring + touch table, seen from the daemon (consumer) or the client (producer).

    Build it with :meth:`create` (daemon) or :meth:`attach` (client), not directly.
    A segment object is used by one thread; one process is the producer, one the
    consumer.
    """

    def __init__(self, name: str, segment: mmap.mmap, ring_capacity: int, touch_capacity: int, consumer: bool,
                 fd: int | None = None):
        self.name = name
        self._fd = fd
        self.ring_capacity = ring_capacity
        self.touch_capacity = touch_capacity
        self.is_consumer = consumer
        self._closed = False
        self._mm = segment
        self._capacity = ring_capacity
        self._mask = ring_capacity - 1
        self._ring_offset = layout.RING_OFFSET
        view = memoryview(segment)
        self._view = view
        # the hot header words; 8-byte aligned, one store each (see the module docstring)
        self._words = view[: layout.HEADER_SIZE].cast("Q")
        touch_at = layout.touch_offset(ring_capacity)
        idle_at = layout.idle_offset(ring_capacity, touch_capacity)
        table_bytes = touch_capacity * layout.TOUCH_ENTRY_SIZE
        self._last_touch = view[touch_at : touch_at + table_bytes].cast("q")
        self._idle = view[idle_at : idle_at + table_bytes].cast("q")
        self._ring = np.frombuffer(segment, dtype=RECORD_DTYPE, count=ring_capacity, offset=layout.RING_OFFSET)
        # the same memory again for the producer's hot path (typed memoryviews when compiled)
        self._ring_view = view[layout.RING_OFFSET : layout.RING_OFFSET + layout.ring_bytes(ring_capacity)].cast("Q")
        self._counters = self._words
        self._ring_words = self._ring_view
        # producer state: private tail, cached head, and the head it may not count past while a
        # daemon may rewind the ring (None: the head word; see limit_head)
        self._tail = self._words[_TAIL_WORD]
        self._head_cache = self._words[_HEAD_WORD]
        self._head_limit = None
        # copies of the marked records and FLUSHes the producer may overwrite (position, 64 bytes): their
        # answers may not have reached the client yet (see "Answers kept in the ring"), and
        # the position up to which it looked for them (each head it reads: _reload_head)
        self.kept_marks = []
        self._marks_scanned = self._head_cache
        # consumer state: private head (never read back from the untrusted segment, except by adopt)
        self._head = 0
        self._peeked = 0  # records returned by the last peek and not yet committed

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def create(cls, name: str, ring_capacity: int, touch_capacity: int) -> ClientSegment:
        """Create and map a new segment (daemon side): a sealed memfd labelled ``name``.

        The descriptor (:attr:`fd`) is what the daemon passes to the client; nothing
        appears in /dev/shm, and nobody can resize the segment (:mod:`wheeld.shm.memfd`).
        """
        layout.check_capacities(ring_capacity, touch_capacity)
        size = layout.segment_size(ring_capacity, touch_capacity)
        fd = memfd.create_sealed(name, size)
        try:
            segment = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        # the memfd is zero-filled; magic goes last so a half-built header never validates
        layout.STATIC_HEADER.pack_into(segment, 0, 0, layout.LAYOUT_VERSION, ring_capacity, touch_capacity, RECORD.size)
        struct.pack_into("<Q", segment, layout.MAGIC_OFFSET, layout.MAGIC)
        return cls(name, segment, ring_capacity, touch_capacity, consumer=True, fd=fd)

    @classmethod
    def attach(cls, fd: int, name: str = "", producer_pid: int | None = None) -> ClientSegment:
        """Map the segment the daemon passed (client side) and record our pid in it.

        Takes ownership of ``fd`` (closed by :meth:`close`; the client keeps it to hand
        the ring back after a daemon restart). ProtocolError if it is not a wheeld ring
        segment of this layout version.
        """
        self = cls._map_fd(fd, name, consumer=False)
        self._words[layout.PRODUCER_PID_WORD] = os.getpid() if producer_pid is None else producer_pid
        return self

    @classmethod
    def adopt(cls, fd: int, name: str, max_ring_capacity: int = layout.MAX_RING_CAPACITY,
              max_touch_capacity: int = layout.MAX_TOUCH_CAPACITY, rewind_to: int | None = None) -> ClientSegment:
        """Map, as its consumer, a segment a client handed back (a daemon restarted).

        The descriptor comes from the client: it must be a memfd sealed against
        resizing (:func:`~wheeld.shm.memfd.check_sealed`) whose header describes
        capacities within the given maxima and exactly its size. Takes ownership of
        ``fd``. The consumer position is read back from the segment's head word: the
        last head a daemon published, i.e. everything it had applied. This is the one
        place the consumer believes a word of the segment: a client that rewrote its
        head can only make its own commands be skipped or applied twice, and counters
        that are impossible raise ProtocolError. ``rewind_to`` (a position at or before
        that head, no more than a ring behind the tail): the consumer starts there
        instead, and stores it in the head word for the producer to count from.
        """
        try:
            size = memfd.check_sealed(fd, layout.HEADER_SIZE,
                                      layout.segment_size(max_ring_capacity, max_touch_capacity))
        except BaseException:
            os.close(fd)
            raise
        self = cls._map_fd(fd, name, consumer=True, size=size)
        try:
            if self.ring_capacity > max_ring_capacity or self.touch_capacity > max_touch_capacity:
                raise ProtocolError(f"segment {name!r} has capacities above this daemon's")
            self._head = self._words[_HEAD_WORD]
            self.depth()  # raises ProtocolError if the client left impossible counters
            tail = self._words[_TAIL_WORD]
            if rewind_to is not None and 0 <= tail - rewind_to <= self._capacity and rewind_to <= self._head:
                # published at once: the producer counts its room from this word, and the slots
                # from rewind_to on hold records still to apply (limit_head keeps it from
                # overwriting them before it sees this store)
                self._head = rewind_to
                self._words[_HEAD_WORD] = rewind_to
            self._clear_marks(self._head, tail)
        except BaseException:
            self.close()
            raise
        return self

    @classmethod
    def _map_fd(cls, fd: int, name: str, consumer: bool, size: int | None = None) -> ClientSegment:
        try:
            if size is None:
                size = os.fstat(fd).st_size
            if size < layout.HEADER_SIZE:
                raise ProtocolError(f"segment {name!r} is {size} bytes, smaller than a ring header")
            segment = mmap.mmap(fd, size)
        except OSError as exc:
            os.close(fd)
            raise ProtocolError(f"segment {name!r} cannot be mapped: {exc}") from None
        except BaseException:
            os.close(fd)
            raise
        try:
            magic, version, ring_capacity, touch_capacity, record_size = layout.STATIC_HEADER.unpack_from(segment, 0)
            if magic != layout.MAGIC:
                raise ProtocolError(f"segment {name!r} is not a wheeld ring (magic {magic:#x})")
            if version != layout.LAYOUT_VERSION or record_size != RECORD.size:
                raise ProtocolError(f"segment {name!r} has layout version {version}, record size {record_size}")
            try:
                layout.check_capacities(ring_capacity, touch_capacity)
            except InvalidRequest as exc:
                raise ProtocolError(f"segment {name!r} header: {exc}") from None
            if size != layout.segment_size(ring_capacity, touch_capacity):
                raise ProtocolError(f"segment {name!r} is {size} bytes, not the size its header describes")
            return cls(name, segment, ring_capacity, touch_capacity, consumer=consumer, fd=fd)
        except BaseException:
            try:
                segment.close()
            except BufferError:
                pass  # a half-built instance still exports views; the map goes with them
            os.close(fd)
            raise

    @property
    def fd(self) -> int:
        """The memfd behind the segment (kept open: the daemon passes it, the client hands it back)."""
        self._check_open()
        return self._fd

    def same_file(self, fd: int) -> bool:
        """Is ``fd`` a descriptor of this very segment?"""
        mine, other = os.fstat(self._fd), os.fstat(fd)
        return (mine.st_dev, mine.st_ino) == (other.st_dev, other.st_ino)

    def close(self) -> None:
        """Unmap the segment and close its descriptor (idempotent). Records returned by
        drain() stay valid: they are copies."""
        if self._closed:
            return
        self._closed = True
        self._ring = None
        self._counters = None  # (compiled: typed views; set to None they release their buffers)
        self._ring_words = None
        for view in (self._ring_view, self._words, self._last_touch, self._idle, self._view):
            view.release()
        try:
            self._mm.close()
        except BufferError:
            pass  # someone still holds a view; the mapping goes when the last one does
        self._mm = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> ClientSegment:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        """True once the daemon marked the session closed (see :meth:`mark_closed`)."""
        self._check_open()
        return self._words[layout.CLOSED_WORD] != 0

    @property
    def group_full(self) -> bool:
        """True while the daemon says this client's group reached its quota (see :meth:`set_group_full`)."""
        return self._words[layout.GROUP_FULL_WORD] != 0

    @property
    def producer_pid(self) -> int:
        self._check_open()
        return self._words[layout.PRODUCER_PID_WORD]

    def _check_open(self) -> None:
        if self._closed:
            raise Closed(f"segment {self.name!r} is closed")

    # ------------------------------------------------------------------ producer (client)

    def push_add(self, key_bytes: bytes, key_meta: int, deadline_ms: int, seq: int) -> bool:
        """Append an ADD; False if the ring is full. The fast path of :meth:`try_push`.

        ``(key_bytes, key_meta)`` must come from :func:`wheeld.protocol.keys.encode_key`.
        """
        tail = self._tail
        if tail >= self._head_cache + self._capacity and not self._has_room(tail):
            return False
        if not (_COMPILED and self._store_record(tail & self._mask, ADD, key_meta, seq, deadline_ms, 0, 0, key_bytes)):
            try:
                check = _crc32(_pack_add_checked(ADD, key_meta, seq, deadline_ms, key_bytes))
                _pack_add_into(
                    self._mm, self._ring_offset + ((tail & self._mask) << RECORD_SHIFT),
                    ADD, key_meta, seq, deadline_ms, check, key_bytes,
                )  # fmt: skip
            except (struct.error, TypeError) as exc:
                self._raise_push_error(exc)
        self._publish(tail + 1)
        return True

    def try_push(
        self,
        op: int,
        key_bytes: bytes = b"",
        key_meta: int = 0,
        deadline_ms: int = 0,
        seq: int = 0,
        aux0: int = 0,
        aux1: int = 0,
    ) -> bool:
        """Append one command record; False if the ring is full.

        Fields are as in :mod:`wheeld.protocol.commands`; a field out of its width
        raises InvalidRequest; a ring the daemon has closed raises BrokenPeer
        (noticed when the ring looks full).
        """
        tail = self._tail
        if tail >= self._head_cache + self._capacity and not self._has_room(tail):
            return False
        if not (_COMPILED and self._store_record(tail & self._mask, op, key_meta, seq, deadline_ms, aux0, aux1,
                                                 key_bytes)):
            try:
                check = _crc32(_pack_checked(op, key_meta, seq, deadline_ms, aux0, aux1, key_bytes))
                _pack_record_into(
                    self._mm, self._ring_offset + ((tail & self._mask) << RECORD_SHIFT),
                    op, key_meta, seq, deadline_ms, aux0, aux1, check, key_bytes,
                )  # fmt: skip
            except (struct.error, TypeError) as exc:
                self._raise_push_error(exc)
        self._publish(tail + 1)
        return True

    def try_push_record(self, record: bytes) -> bool:
        """Append a complete 64-byte record (one this client encoded before); False if full."""
        if len(record) != RECORD.size:
            raise InvalidRequest(f"a ring record is {RECORD.size} bytes, not {len(record)}")
        tail = self._tail
        if tail >= self._head_cache + self._capacity and not self._has_room(tail):
            return False
        start = self._ring_offset + ((tail & self._mask) << RECORD_SHIFT)
        self._mm[start : start + RECORD.size] = record
        self._publish(tail + 1)
        return True

    def _publish(self, tail: int) -> None:
        """Step 3 of a push: store the new tail, after the record's stores."""
        self._tail = tail
        if _COMPILED:
            _store_fence()  # noqa: F821 - ring.pxd's compiler barrier; the record stores are not moved below it
        self._counters[_TAIL_WORD] = tail  # publish: the record stores above are visible first

    def _store_record(self, slot: int, op, key_meta, seq, deadline_ms, aux0, aux1, key_bytes) -> bool:
        """Write one complete record (check word included) at ring ``slot`` with the typed
        writer. Returns False, writing nothing, for any argument it does not take (not an
        exact int or bytes, out of its field's range, a key over 32 bytes): the struct
        path then writes it, or raises, exactly as it does for every push in Python."""
        if type(op) is not int or type(key_meta) is not int or type(seq) is not int \
                or type(deadline_ms) is not int or type(aux0) is not int or type(aux1) is not int \
                or type(key_bytes) is not bytes or len(key_bytes) > KEY_FIELD_SIZE or self._ring_words is None:
            return False  # (no ring: the segment is closed, the struct path raises Closed)
        try:
            return self._write_record(slot, op, key_meta, seq, deadline_ms, aux0, aux1, key_bytes)
        except OverflowError:
            return False  # compiled: an int that does not fit the 64-bit C integer of its argument

    def _write_record(self, slot: int, op: int, key_meta: int, seq: int, deadline_ms: int, aux0: int, aux1: int,
                      key_bytes: bytes) -> bool:
        """_store_record, once every field is an int: 64-bit C integers when compiled."""
        if not (0 <= op <= 0xFF and 0 <= key_meta <= 0xFF and 0 <= seq <= _U32 and _I64_MIN <= deadline_ms <= _I64_MAX
                and _I32_MIN <= aux0 <= _I32_MAX and _I32_MIN <= aux1 <= _I32_MAX):
            return False
        length = len(key_bytes)
        head = op | (key_meta << 8) | (seq << 32)
        deadline = deadline_ms & _U64
        aux = (aux0 & _U32) | ((aux1 & _U32) << 32)
        key0 = _key_word(key_bytes, length, 0)
        key1 = _key_word(key_bytes, length, 8)
        key2 = _key_word(key_bytes, length, 16)
        key3 = _key_word(key_bytes, length, 24)
        crc = _U32
        crc = _crc32_word(crc, head)
        crc = _crc32_word(crc, deadline)
        crc = _crc32_word(crc, aux)
        crc = _crc32_word(crc, key0)
        crc = _crc32_word(crc, key1)
        crc = _crc32_word(crc, key2)
        crc = _crc32_word(crc, key3)
        base = slot * _WORDS_PER_RECORD
        self._ring_words[base] = head  # (through self: a typed-view local costs two locked instructions)
        self._ring_words[base + 1] = deadline
        self._ring_words[base + 2] = aux
        self._ring_words[base + 3] = crc ^ _U32  # the check word; the pad above it is zero
        self._ring_words[base + 4] = key0
        self._ring_words[base + 5] = key1
        self._ring_words[base + 6] = key2
        self._ring_words[base + 7] = key3
        return True

    def unapplied_records(self, since: int | None = None) -> list[bytes]:
        """Producer: the records pushed but not yet handed back by a consumer (head .. tail),
        oldest first: what a daemon that is gone never applied. With ``since`` (a position
        at or before head, no more than a ring behind the tail): from there on instead."""
        self._check_open()
        head = self._words[_HEAD_WORD]
        start = head if since is None or not 0 <= self._tail - since <= self._capacity else min(since, head)
        count = self._tail - start
        if not 0 <= count <= self._capacity:
            return []  # impossible counters: nothing trustworthy to re-send
        out = []
        for position in range(start, self._tail):
            offset = self._ring_offset + ((position & self._mask) << RECORD_SHIFT)
            # without its answer mark: pushed again, the record is the client's as it wrote it
            out.append(bytes(self._mm[offset : offset + PAD_OFFSET]) + b"\0\0\0\0"
                       + bytes(self._mm[offset + PAD_OFFSET + 4 : offset + RECORD.size]))
        return out

    def consumed_records(self, start: int, end: int) -> list[tuple[int, bytes]]:
        """Producer: (position, 64 bytes) of each record from ``start`` up to ``end`` (before the
        head) the ring still holds, oldest first (a ring behind the tail: :attr:`kept_marks`)."""
        self._check_open()
        tail = int(self._tail)  # (compiled, an unsigned C integer: no negative differences)
        first = max(start, tail - self._capacity, 0)
        last = min(end, tail)
        return [(position, _record_bytes(self, position)) for position in range(first, last)]

    def _has_room(self, tail: int) -> bool:
        """Slow path of a push that found the cached head too old: reload head."""
        self._check_open()
        words = self._words
        if words[layout.CLOSED_WORD]:
            raise BrokenPeer(f"the daemon closed the session of segment {self.name!r}")
        return tail - self._reload_head() < self._capacity

    def _reload_head(self) -> int:
        """Producer side: the head word into the cached head, no later than the limit
        :meth:`limit_head` set; returns it."""
        head = self._words[_HEAD_WORD]
        if head != self._marks_scanned:
            _keep_marks(self, head)
        limit = self._head_limit
        if limit is not None and head > limit:
            head = limit
        self._head_cache = head
        return head

    def _raise_push_error(self, exc: Exception):
        self._check_open()
        raise InvalidRequest(f"command field out of range: {exc}") from None

    def free_slots(self) -> int:
        """Producer side: how many records can be pushed right now."""
        self._check_open()
        return self._capacity - (self._tail - self._reload_head())

    def limit_head(self, position: int | None) -> None:
        """Producer side: count the room in the ring from no later than ``position`` (None:
        from the head word again).

        A daemon that adopts this ring with ``rewind_to`` (:meth:`adopt`) moves its head
        back to that position, and publishes it, to apply those records again: the head
        word goes backwards, which a cached head does not see. The client sets the limit to
        the ``replay_from`` its ``Hello`` offers before sending it, and lifts it once the
        answer came (the daemon published any rewind before it answered) or the attempt
        failed: meanwhile no push overwrites a record the daemon may still replay."""
        self._head_limit = position
        if position is not None and self._head_cache > position:
            self._head_cache = position

    def touch(self, index: int, now_ms: int) -> None:
        """Record that the idle key at touch ``index`` was active at ``now_ms``: one 8-byte store."""
        if index < 0:
            raise InvalidRequest(f"touch index {index} is negative")
        try:
            self._last_touch[index] = now_ms
        except IndexError:
            raise InvalidRequest(f"touch index {index} is outside the table of {self.touch_capacity}") from None
        except (TypeError, ValueError) as exc:
            self._check_open()
            raise InvalidRequest(f"bad touch: {exc}") from None

    def set_idle(self, index: int, idle_ms: int) -> None:
        """Store the idle timeout of the key at touch ``index`` (client, at add_idle time)."""
        if index < 0 or index >= self.touch_capacity:
            raise InvalidRequest(f"touch index {index} is outside the table of {self.touch_capacity}")
        self._check_open()
        self._idle[index] = idle_ms

    # ------------------------------------------------------------------ consumer (daemon)

    def depth(self) -> int:
        """Records waiting in the ring. Raises ProtocolError if the client corrupted the counters."""
        self._check_open()
        if self.is_consumer:
            depth = self._words[_TAIL_WORD] - self._head
        else:
            depth = self._tail - self._words[_HEAD_WORD]
        if not 0 <= depth <= self._capacity:
            raise ProtocolError(f"segment {self.name!r}: tail - head = {depth} outside [0, {self._capacity}]")
        return depth

    def drain(self, max_records: int | None = None) -> np.ndarray:
        """Copy up to ``max_records`` waiting records out (oldest first) and free their slots.

        Returns a new array of :data:`~wheeld.protocol.commands.RECORD_DTYPE` (a copy,
        independent of the segment). The records are not validated: pass them to
        :func:`~wheeld.protocol.commands.validate_records`. Raises ProtocolError if
        the tail the client published is impossible. ``drain`` is ``peek`` + ``commit``
        of the whole batch.
        """
        records = self.peek(max_records)
        self.commit(len(records))
        return records

    def peek(self, max_records: int | None = None) -> np.ndarray:
        """Like :meth:`drain`, but the slots are handed back only by :meth:`commit`.

        The daemon applies a batch and then commits it, so a daemon killed in
        between re-reads (and re-applies: every command is idempotent) the batch.
        A second peek without a commit returns the same records again (and more,
        if more arrived).
        """
        start, count = self._peek_range(max_records)
        if count == 0:
            return _EMPTY.copy()
        end = start + count
        ring = self._ring
        if end <= self._capacity:
            return ring[start:end].copy()
        return np.concatenate((ring[start:], ring[: end - self._capacity]))

    def peek_bytes(self, max_records: int | None = None) -> bytes:
        """:meth:`peek`, the records as one bytes object (64 bytes each, in ring order):
        the same copy without a numpy array (the daemon reads small chunks from it)."""
        start, count = self._peek_range(max_records)
        if count == 0:
            return b""
        end = start + count
        capacity = self._capacity
        view, at = self._view, self._ring_offset
        if end <= capacity:
            return view[at + (start << RECORD_SHIFT) : at + (end << RECORD_SHIFT)].tobytes()
        return (view[at + (start << RECORD_SHIFT) : at + (capacity << RECORD_SHIFT)].tobytes()
                + view[at : at + ((end - capacity) << RECORD_SHIFT)].tobytes())

    def _peek_range(self, max_records: int | None) -> tuple[int, int]:
        """(first slot, count) of the records a peek returns; remembered for :meth:`commit`."""
        self._check_open()
        head = self._head
        tail = self._words[_TAIL_WORD]  # every record before this tail is completely written
        available = tail - head
        capacity = self._capacity
        if not 0 <= available <= capacity:
            raise ProtocolError(f"segment {self.name!r}: tail - head = {available} outside [0, {capacity}]")
        count = available if max_records is None or max_records >= available else max(max_records, 0)
        self._peeked = count
        return head & self._mask, count

    def commit(self, count: int) -> None:
        """Hand back the slots of the first ``count`` records of the last :meth:`peek`."""
        if not 0 <= count <= self._peeked:
            raise InvalidRequest(f"commit({count}) after a peek of {self._peeked}")
        self._peeked = 0
        if count:
            self._head += count
            self._words[_HEAD_WORD] = self._head  # only after the records were copied (and applied)

    @property
    def consumer_head(self) -> int:  # (every record before it was applied)
        return self._head

    def mark_answer(self, index: int, mark: int) -> None:
        """Store answer mark ``mark`` (:data:`~wheeld.protocol.commands.ANSWER_MARKS`) in record
        ``index`` of the last peek, before the :meth:`commit` past it: the decision outlives
        a daemon killed before its answer left (see "Answers kept in the ring")."""
        if not 0 <= index < self._peeked:
            raise InvalidRequest(f"mark_answer({index}) after a peek of {self._peeked}")
        offset = self._ring_offset + (((self._head + index) & self._mask) << RECORD_SHIFT)
        _MARK.pack_into(self._mm, offset + PAD_OFFSET, mark)

    def _clear_marks(self, start: int, end: int) -> None:
        """Consumer, adopting the ring: clear the marks of the records it is to apply (a daemon
        killed between a mark and its commit leaves some; the validator rejects them). ``end``
        is the client's tail word: more than a ring ahead, it is not believed (no clearing)."""
        if 0 < end - start <= self._capacity:
            slots = np.arange(start, end, dtype=np.int64) & self._mask
            self._ring["pad"][slots] = 0

    def read_touch(self, index: int) -> int:
        """The last-touch monotonic ms the client stored at ``index``; ProtocolError if out of range."""
        if not 0 <= index < self.touch_capacity:
            raise ProtocolError(f"touch index {index} is outside the table of {self.touch_capacity}")
        self._check_open()
        return self._last_touch[index]

    def touch_views(self) -> tuple[memoryview, memoryview]:
        """The touch table as two int64 views, (last touch ms, idle_ms) by touch index, for
        a reader that checks each pair as :meth:`read_activity` does (the daemon's wheel,
        re-arming idle timers in bulk). Released when the segment is closed: reading them
        then raises ValueError."""
        self._check_open()
        return self._last_touch, self._idle

    def read_activity(self, index: int, now_ms: int, clock=None) -> tuple[int, int] | None:
        """An idle timer's (last_touch_ms, idle_ms) at touch ``index``, checked, or None.

        The two words are the client's to write, so they are checked before the daemon
        computes a deadline from them: None when the key carries no activity (either
        word is 0); ProtocolError when they are impossible: an index outside the table,
        a touch later than the clock + 1 (a touch stores the clock rounded up), a
        negative one, or an ``idle_ms`` outside ``1 .. MAX_IDLE_MS``. So
        ``last_touch_ms + idle_ms`` always fits the wheel's range.

        ``now_ms`` is a clock read made before this call. The client may store a touch
        at any moment, so a touch later than ``now_ms + 1`` is checked again against
        ``clock()`` (the daemon's clock, read after the word was): a touch stored
        between the caller's clock read and the word's read is legitimate.
        """
        touched = self.read_touch(index)
        idle_ms = self._idle[index]
        if touched == 0 or idle_ms == 0:
            return None
        if touched > now_ms + 1 and clock is not None:
            now_ms = clock()  # after the read above: every honest touch is at most this + 1
        if not 0 < touched <= now_ms + 1:
            raise ProtocolError(f"touch index {index}: last touch {touched} ms is not a time before now ({now_ms})")
        if not 0 < idle_ms <= MAX_IDLE_MS:
            raise ProtocolError(f"touch index {index}: idle_ms {idle_ms} is outside 1..{MAX_IDLE_MS}")
        return touched, idle_ms

    def set_group_full(self, full: bool) -> None:
        """Consumer: tell the producer whether its group is at its quota (``add`` then
        raises QuotaExceeded before it reaches the daemon)."""
        self._words[layout.GROUP_FULL_WORD] = 1 if full else 0

    def mark_closed(self) -> None:
        """Consumer: tell the producer this session is over (its next full-ring push raises BrokenPeer)."""
        self._check_open()
        self._words[layout.CLOSED_WORD] = 1

    def __repr__(self) -> str:
        role = "consumer" if self.is_consumer else "producer"
        state = "closed" if self._closed else f"ring_capacity={self.ring_capacity}"
        return f"<ClientSegment {self.name!r} {role} {state}>"


def _keep_marks(self: ClientSegment, head: int) -> None:
    """The producer ``self`` read a new ``head``: the records from the last head it read up
    to this one become its to overwrite. Keep a copy of each one with an answer mark, and
    of each FLUSH (:attr:`ClientSegment.kept_marks`): its answer may not have reached the
    client yet (the marks are final: stored before the head passed them)."""
    scanned = self._marks_scanned
    if head <= scanned or head - scanned > self._capacity:  # rewound (or impossible): from here on
        self._marks_scanned = head
        return
    words, mask = self._ring_view, self._mask
    if head - scanned <= _MARKS_ONE_BY_ONE:  # a few: each one's words (numpy's fixed cost is ~5 us)
        marked = [p for p in range(scanned, head)
                  if words[((p & mask) << 3) + 3] >> 32 or words[(p & mask) << 3] & 0xFF == FLUSH]
    else:
        positions = np.arange(scanned, head, dtype=np.int64)
        records = self._ring[positions & mask]
        marked = positions[np.flatnonzero((records["pad"] != 0) | (records["op"] == FLUSH))].tolist()
    self.kept_marks.extend((position, _record_bytes(self, position)) for position in marked)
    self._marks_scanned = head


def _record_bytes(seg: ClientSegment, position: int) -> bytes:
    """The 64 bytes of the record at ring ``position`` of ``seg`` (its slot, as stored now)."""
    offset = seg._ring_offset + ((position & seg._mask) << RECORD_SHIFT)
    return bytes(seg._mm[offset : offset + RECORD.size])
