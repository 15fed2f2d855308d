"""The client library's state machine, shared by the blocking and the asyncio client.

What a call costs:

* ``add``/``add_idle``/``cancel``: one 64-byte record written into this client's
  own ring in shared memory and one 8-byte store to publish it. If the daemon
  said it is parked (a word in the arena, which the client maps read-only), one
  small ``Doorbell`` frame on the socket wakes it; otherwise no system call.
* ``touch``: one 8-byte store of the current time into this client's touch table.
  The daemon reads it only when the idle timer comes due.
* ``poll``: reads ``Expirations`` frames from the socket.

Per call, compiled (``python -m bench.client_ops``: best of 31 rounds of 8192 calls on
distinct str keys, no daemon, a ~0.03 us Python loop included): ``add`` 0.20 us,
``cancel`` 0.19 us, ``touch`` 0.06 us, ``add_idle`` 1.4 us; as Python, ``add`` 1.4 us,
``cancel`` 1.3 us, ``touch`` 0.23 us, ``add_idle`` 2.7 us. Beside the record, ``add``
reads the clock and stores the arming's tag in a dict; ``cancel`` swaps the tag for its
complement and appends the key and tag to a list (see :meth:`ClientCore._cancelled`). A
str or int key is its own dict key (no bytes built, a str's hash is cached).

Exactly once to the application, per arming: every arming carries a *tag*
(``client slot << 21 | sequence``). The library remembers the tag of this
client's latest arming of each key; an expiration of an older arming of this
client's (the key was re-armed or cancelled since) is dropped, and so is a copy
of one it already received (a daemon restart, a reboot recovery and an ack
timeout send unacknowledged expirations again). An expiration is acknowledged
only once the application was handed it: acknowledgements go back through the
ring when the application comes back for more (the next ``poll``), flushes or
closes. A copy of one still waiting in this library is not acknowledged (the
process may die before the application polls: then the daemon gives it to
another member); it only renews the handle the acknowledgement will carry. A
dropped expiration whose arming the application replaced or cancelled, or a copy
of one it was handed, is acknowledged with the next acknowledgements. Two
windows are at least once instead of exactly once: an expiration handed to a process that dies before acknowledging
it reaches another member of the group; and after a power cut (with
``--journal``), one whose acknowledgement was not yet durable (still in the
ring, or inside the fsync window) is delivered again, to a member that does not
remember having had it.

``cancel(key)`` returns True when this client had armed the key and not yet
received its expiration: that arming will not be delivered to this client, even
if it already fired inside the daemon. It returns False otherwise (the cancel is
still sent: another member of the group may have armed the key).
"""

from __future__ import annotations

import array
import collections
import os
import socket
import threading
import weakref

import msgspec
from wheeld.protocol import clock
from wheeld.protocol import commands as C
from wheeld.protocol import messages as M
from wheeld.protocol import ring_layout as RL
from wheeld.protocol import status_layout as SL
from wheeld.protocol.errors import (
    ArenaFull,
    InvalidDelay,
    InvalidKey,
    InvalidRequest,
    ProtocolError,
    QuotaExceeded,
    RingFull,
)
from wheeld.protocol.keys import (
    KEY_BYTES,
    TYPE_BYTES,
    TYPE_INT,
    TYPE_STR,
    c_layout,
    decode_key,
    encode_key,
    key_meta_of,
    key_type,
)
from wheeld.protocol.messages import decode_daemon_body  # noqa: F401 - the I/O shells import it from here
from wheeld.protocol.naming import default_socket_path
from wheeld.shm.ring import MAX_IDLE_MS, ClientSegment
from wheeld.shm.status import StatusPage

from .session import SEQ_BITS, SHARDS, ClientSession

_META = [bytes((m,)) for m in range(256)]
_fence = threading.Lock()
_fence_acquire = _fence.acquire
_fence_release = _fence.release
_STR_META = key_meta_of(TYPE_STR, 0)  # | the key's length
_INT_META = key_meta_of(TYPE_INT, 8)  # an int key: 8 little-endian bytes, signed
_INT_LOW, _INT_HIGH = -(1 << 63), (1 << 63) - 1
_PARKED = SL.PARKED_WORD
_QUIET_FROM = SL.QUIET_FROM_WORD
_PENDING = SL.PENDING_WORD
_FIRED_UNACKED = SL.FIRED_UNACKED_WORD
_CAPACITY_WORD = SL.CAPACITY_WORD
_GROUP_FULL = RL.GROUP_FULL_WORD
_FDS_SPACE = socket.CMSG_SPACE(4 * array.array("i").itemsize)
_SEQ_BITS = SEQ_BITS
_SEQ_MASK = (1 << _SEQ_BITS) - 1
_RECENT = 1 << 17  # the latest expirations received, the latest cancelled armings, and the latest keys no
# longer tracked (their last arming), remembered to drop re-sent and replaced expirations
# The per-key bookkeeping is split into this many dicts/sets (by hash). A Python dict or
# set grows, and under insert/delete churn compacts, by rehashing all its entries at
# once: milliseconds for one insert among hundreds of thousands (python -m
# bench.daemon_paths, docs/figures.md). Those pauses stalled delivery (the application
# got expirations late); split in 64 each pause is 64 times shorter, for a few ns per
# operation.
_SHARDS = SHARDS
_SHARD_MASK = _SHARDS - 1
# A dict whose keys are all str keeps no hashes in its entries: every probe that meets
# another key reads that key's str object for its hash, one more cache miss per
# collision once the bookkeeping outgrows the caches. One key of another type (this
# sentinel, never a user key: keys are str, int or bytes) makes CPython keep the hash
# in each entry, so a probe compares hashes without leaving the table (CPython 3.11+
# "unicode" dict keys). Nothing iterates the shards, so the sentinel is never seen.
_HASHED_ENTRIES = object()
_CANCEL = C.CANCEL
_ADD_IDLE = C.ADD_IDLE
_IDLE_MS_MAX = MAX_IDLE_MS
_KEY_BYTES = KEY_BYTES
# This module is compiled by Cython (wheeld.protocol.accel, core.pxd). Compiled, the hot
# calls read the clock and fence with core.pxd's C functions (_clock_ns: the same
# CLOCK_MONOTONIC as wheeld.protocol.clock.mono_ns; _full_fence: one locked instruction,
# what the uncontended lock's acquire/release gives the Python source).
_COMPILED = not __file__.endswith(".py")
if _COMPILED and _kc_layout() != c_layout():  # type: ignore[name-defined]  # noqa: F821 - protocol/keycodec.pxd
    raise ImportError("protocol/keycodec.pxd's key format constants are not those of wheeld.protocol.keys")
_CANCEL_MARK_EVERY = 256  # cancels between internal flushes that let us forget cancelled armings
# (forgetting 1024 at once took ~1 ms of the receive path on a busy machine)

# The one clock every client of this process reads (deadlines, touches, the idle check on
# receipt): CLOCK_MONOTONIC in ns (wheeld.protocol.clock.mono_ns), rounded up to ms where
# it makes a deadline (clock.ceil_ms's rule, inlined on the hot path). A simulation that
# runs many clients in one thread on a simulated clock replaces it (_set_clock); compiled,
# the hot calls test the C flag _clock_replaced before reading the clock in C.
_monotonic_ns = clock.mono_ns
_clock_replaced = False


def _set_clock(now_ns=None) -> None:
    """Read ``now_ns()`` (an int, ns on the CLOCK_MONOTONIC scale) wherever the client reads
    the clock, in every client of this process; None: the real clock again. For a
    deterministic simulation (tests/sim), never for a real client."""
    global _monotonic_ns, _clock_replaced
    if now_ns is not None and not callable(now_ns):
        raise TypeError(f"the clock must be callable, not {type(now_ns).__name__}")
    _monotonic_ns = clock.mono_ns if now_ns is None else now_ns
    _clock_replaced = now_ns is not None


def _now_ns() -> int:
    """The client's clock in ns (see _set_clock). On the Python path the hot calls read
    ``_monotonic_ns()`` themselves (one Python call fewer); compiled, this is a C function."""
    if _COMPILED and not _clock_replaced:
        return _clock_ns()  # type: ignore[name-defined]  # noqa: F821 - core.pxd
    return _monotonic_ns()


def check_delay_ms(delay_ms, max_delay_ms: int | None = None) -> None:
    """InvalidDelay unless ``delay_ms`` is an int from 0 to ``max_delay_ms`` (the daemon's,
    from its Welcome; None: not known here, only the sign is checked)."""
    if type(delay_ms) is not int:
        raise InvalidDelay(f"delay_ms must be an int, not {type(delay_ms).__name__}")
    if delay_ms < 0:
        raise InvalidDelay(f"delay_ms must not be negative ({delay_ms})")
    if max_delay_ms is not None and delay_ms > max_delay_ms:
        raise InvalidDelay(f"delay_ms {delay_ms} exceeds the daemon's maximum of {max_delay_ms}")


def _bookkeeping_key(kb: bytes, meta: int):
    """The name the bookkeeping gives a key (see ClientCore._latest): the key as an exact
    str or int (what an expiration of it decodes to), its ident (meta byte + bytes) for a
    bytes key (a bytes and a str key never meet in one dict: no BytesWarning under -b)."""
    if key_type(meta) == TYPE_BYTES:
        return _META[meta] + kb
    return decode_key(kb, meta)


def _expiry_keys(items) -> list:
    """:func:`wheeld.protocol.messages.expiry_keys` in the compiled build: each key built in C
    from its bytes (``_decode_key_bytes``, core.pxd); the same keys and the same errors."""
    keys = []
    matched = True
    for e in items:
        try:
            key = _decode_key_bytes(e.key_bytes, e.key_meta)  # type: ignore[name-defined]  # noqa: F821 - core.pxd
        except UnicodeDecodeError:
            raise ProtocolError("invalid daemon message: a str key must be UTF-8") from None
        if key is None:
            matched = False  # reported once every key was tried, as expiry_keys does
        else:
            keys.append(key)
    if not matched:
        raise ProtocolError("invalid daemon message: key_bytes do not match key_meta")
    return keys


class Expired(msgspec.Struct, frozen=True, gc=False):
    """A timer that came due. ``late`` is True when it fired late because the daemon was down.

    Immutable, hashable, compared by value (a msgspec Struct: built in ~0.1 us, where a
    frozen dataclass takes ~0.5 us; ``msgspec.structs.asdict`` gives a dict).
    """

    key: str | bytes | int
    deadline_ms: int
    fired_ms: int
    late: bool = False


_live_clients: weakref.WeakSet = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for client in list(_live_clients):
        client._inherited_by_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


def passed_fds(ancillary) -> list[int]:
    """The descriptors in a ``recvmsg`` ancillary list (SCM_RIGHTS)."""
    fds = array.array("i")
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    return list(fds)


def close_quietly(fd: int) -> None:
    """Close a descriptor we were handed, on a path that is already failing."""
    try:
        os.close(fd)
    except OSError:
        pass


class ClientBase:
    """The extension type under :class:`ClientCore` in the compiled build (a compiled class
    whose other bases are Python mixins needs one first); nothing of its own."""


def _renew_handle(handles, index: int, handle: tuple, acks_pending: list) -> None:
    """A copy of an expiration still in the library's buffer: not handed twice, and not
    acknowledged, since the application has not had it (were this process to die now, that
    ack would take the timer with it). Its ack goes out when it is handed, under this copy's
    handle: after a reboot the arena is another one, and an ack stamped with the old epoch
    is ignored. A copy in another record of the same arena (a ring replayed after a reboot
    armed it again after the journal's arming had fired) leaves the first record in flight
    to us: that one is acknowledged now, as this copy stays unacknowledged until the
    hand-over (else, were this process to die, the first would go to another member)."""
    first = handles[index]
    if first[2] == handle[2] and first != handle:
        acks_pending.append(first)
    handles[index] = handle


class ClientCore(ClientBase, ClientSession):
    """Ring, touch table and bookkeeping; the subclasses add the socket I/O."""

    def __init__(self, socket_path: str | None, group: str, ring_timeout_s: float, reconnect_timeout_s: float,
                 client_name: str):
        self.socket_path = socket_path or default_socket_path()
        self.group = group
        self.ring_timeout_s = ring_timeout_s
        self.reconnect_timeout_s = reconnect_timeout_s
        self.client_name = client_name
        self._segment: ClientSegment | None = None
        self._status: StatusPage | None = None
        self._parked: memoryview | None = None  # the status page's words: parked epoch, arena counters
        self._page: memoryview | None = None  # the same words for the hot path (compiled: a typed view)
        self._group_words: memoryview | None = None  # our ring's header words: the daemon's group_full flag
        self._rang_epoch = 0
        self._welcome: M.Welcome | None = None
        self._seq = 0
        self._tag_base = 0
        self._init_armings()
        self._init_receipts()
        self._init_cancels()
        self._closed = False
        self._owner_pid = os.getpid()
        self._forked = False
        self._former_slots: set[int] = set()  # client ids this client had before a reconnect
        # Replay after a reboot: the ring position just after the last FLUSH the daemon
        # acknowledged, and where each FLUSH not yet acknowledged ends (seq -> position).
        # A daemon that recovers from the journal after a power cut may have lost commands
        # a previous daemon applied (fsync interval) before answering our flush itself;
        # it re-applies our ring from here (see _hello_frame).
        self._replay_from = 0
        self._flush_positions: dict[int, int] = {}
        # Answers read back from the ring (ClientSession._recover_answers): the position after
        # the last FLUSH whose Applied came (every command before it has been answered), the
        # answers received since (a Rejected's seq, ~seq for an Applied), and where each FLUSH
        # still unanswered ends (seq -> position; the library's own FLUSHes too)
        self._answered_at = 0
        self._answered: set[int] = set()
        self._answer_positions: dict[int, int] = {}
        self.max_delay_ms = 0
        self._key_meta = 0  # _encode's outputs beside the key bytes it returns
        self._key_name: str | bytes | int | None = None
        _live_clients.add(self)

    def _init_armings(self) -> None:
        """The armings the application made: latest tag per key, the touch table's rows."""
        # key -> tag of our live arming, or ~tag once cancelled; in _SHARDS dicts by hash(key).
        # A str or int key is its own name here (its hash is cached or trivial, no bytes to
        # build), a bytes key goes by its ident: see _bookkeeping_key.
        self._latest: list[dict] = [{_HASHED_ENTRIES: None} for _ in range(_SHARDS)]
        self._touch_index: dict[bytes, int] = {}  # ident -> touch index
        self._touch_by_key: dict = {}  # the user's key object -> touch index (touch's fast path)
        self._touch_table: memoryview | None = None
        self._free_touch: list[int] = []
        self._next_touch = 0

    def _init_receipts(self) -> None:
        """Expirations received, handed over and to acknowledge."""
        # expirations received (buffered or handed over), by (key, arming tag) -> their
        # receipt number (see _on_expirations): survives a daemon restart (same records)
        # and a reboot recovery (new records, same journaled arming). The latest _RECENT,
        # in _SHARDS dicts by tag; the oldest is forgotten one at a time.
        # (Cancelled armings are remembered apart, in the cancel log: see _cancelled.)
        self._recent: list[dict[tuple[bytes, int], int]] = [{} for _ in range(_SHARDS)]
        self._recent_order: collections.deque[tuple[bytes, int]] = collections.deque()
        self._ready: collections.deque[Expired] = collections.deque()  # received, not handed over
        self._ready_handles: collections.deque[tuple[int, int, int]] = collections.deque()  # their acks, in step
        self._received = 0  # expirations ever put in _ready: those handed over are the first _received - len(_ready)
        # the tag of our latest arming of each key _latest forgot (its expiration received, or
        # its cancel applied), for the latest _RECENT such keys, in _SHARDS dicts by hash(key):
        # an older arming's expiration that comes later is one the application replaced (see
        # _superseded); (key, tag) in the order remembered, to forget the oldest
        self._done: list[dict] = [{} for _ in range(_SHARDS)]
        self._done_order: collections.deque[tuple] = collections.deque()
        # (slot, generation, arena epoch): handed over, ack at the next poll
        self._to_ack: list[tuple[int, int, int]] = []
        # could not be pushed yet (ring full)
        self._acks_pending: list[tuple[int, int, int]] = []
        # idle timers touched after the daemon last read their touch word: (kb, meta, deadline,
        # tag, idle_ms, touch index) of their ADD_IDLE again, pushed with the acks (_stale_idle)
        self._rearms_pending: list[tuple] = []
        # the idle keys re-armed so, until the key is handed over or armed by the application:
        # ident -> (the tag of the copy acknowledged, the arena epoch that acknowledgement
        # names, the tags the key was armed with since, the latest last); see _rearm_again
        self._rearmed: dict[bytes, tuple] = {}
        self._applied = -1

    def _init_cancels(self) -> None:
        """Cancelled armings (and the answers flush() waits for: the session's)."""
        # Cancelled armings (see cancel): flat lists [key, tag, key, tag, ...] (keys named as
        # in _latest), one per mark.
        # _marks: (mark seq, its list) until the mark's Applied; _cancel_log: the lists of the
        # latest cancels (at least _RECENT), oldest first, searched through _cancel_index, a
        # count per (key, tag) built only when an expiration needs it (see _cancelled).
        self._cancels_since_mark = 0
        self._marks: list[tuple[int, list]] = []
        self._cancelled_since_mark: list = []
        self._cancel_log: collections.deque[list] = collections.deque()
        self._cancel_log_pairs = 0
        self._cancel_index: dict[tuple, int] | None = None
        self._cancel_indexed = 0  # entries of _cancelled_since_mark in the index
        self._cancel_index_idle = 0  # marks since the index was last asked
        self._init_flush_answers()

    # ------------------------------------------------------------------ commands
    def _check_open(self) -> None:
        if self._closed:
            self._raise_closed()

    def _next_tag(self) -> int:
        self._seq = (self._seq + 1) & _SEQ_MASK
        return self._tag_base | self._seq

    def _encode(self, key) -> bytes:
        """``key``'s bytes in a record (:func:`wheeld.protocol.keys.encode_key`, whose str and
        int encodings are inlined here); InvalidKey for a key it refuses. Its meta byte is
        left in ``_key_meta``, its name in the bookkeeping (:func:`_bookkeeping_key`) in
        ``_key_name``: no tuple is built (compiled, both are C fields of the object)."""
        if type(key) is str:
            text = key  # (compiled: a str variable, so the encoding is one C call)
            try:
                kb = text.encode()
            except UnicodeEncodeError:
                kb = b""  # encode_key below raises InvalidKey
            meta = _STR_META | len(kb)
            if not 0 < len(kb) <= _KEY_BYTES:
                kb, meta = encode_key(key)  # raises InvalidKey
            self._key_name = key
        elif type(key) is int and _INT_LOW <= key <= _INT_HIGH:
            kb = key.to_bytes(8, "little", signed=True)
            meta = _INT_META
            self._key_name = key
        else:
            kb, meta = encode_key(key)
            self._key_name = key if type(key) is int else _bookkeeping_key(kb, meta)
        self._key_meta = meta
        return kb

    def _deadline(self, delay_ms) -> int:
        check_delay_ms(delay_ms, self.max_delay_ms)
        return delay_ms - (-_now_ns() // 1_000_000)  # clock.ceil_ms's rule: never early

    def _push(self, op: int, kb: bytes, meta: int, deadline: int, tag: int, aux0: int = 0, aux1: int = 0) -> None:
        seg = self._segment
        if seg is None:
            self._raise_unconnected()
        if seg.try_push(op, kb, meta, deadline, tag, aux0, aux1):
            return
        self._wait_for_room()
        if not seg.try_push(op, kb, meta, deadline, tag, aux0, aux1):
            raise RingFull(f"the ring stayed full for {self.ring_timeout_s} s; the daemon is not draining it")

    def _wait_for_room(self) -> None:
        """The ring is full. Waiting for room is the I/O shell's business: the blocking
        client waits (:meth:`wheeld.sync.Client._wait_for_room`); the state machine itself
        never blocks (an asyncio client, or a simulated one that shares its thread with the
        daemon, would wait forever). It wakes the daemon and raises RingFull at once."""
        self._ring_doorbell()
        raise RingFull("the ring is full; flush() or poll() and retry")

    def _refuse_if_full(self, bkey) -> None:
        """ArenaFull / QuotaExceeded now, when the daemon says it would refuse an add (a
        re-arm of a key this client has armed needs no new record: the quota allows it)."""
        header = self._parked
        if header is not None and header[_PENDING] + header[_FIRED_UNACKED] >= header[_CAPACITY_WORD]:
            raise ArenaFull("the daemon's arena is full")
        if self._group_words is not None and self._group_words[_GROUP_FULL] \
                and self._latest[hash(bkey) & _SHARD_MASK].get(bkey, -1) < 0:
            raise QuotaExceeded(f"group {self.group!r} holds its quota of timers (wheeld --group-quota)")

    def _after_push(self) -> None:
        # Eventcount, client half: tail published (in _push), full fence, then read
        # `parked`. x86-64 may let a load pass an earlier store; the locked
        # instruction inside an uncontended lock's acquire/release forbids it, so
        # either we see parked=1 and ring, or the daemon's re-check sees our tail.
        if _COMPILED:
            _full_fence()  # type: ignore[name-defined]  # noqa: F821 - core.pxd
        else:
            _fence_acquire()
            _fence_release()
        parked = self._page
        if parked is None:
            self._ring_doorbell(False)
            return
        epoch = parked[_PARKED]
        if epoch and epoch != self._rang_epoch:
            self._rang_epoch = epoch
            if not (quiet := parked[_QUIET_FROM]) or _now_ns() < quiet:  # status_layout: quiet_from
                self._ring_doorbell(False)

    def add(self, key, delay_ms: int) -> int:
        """Schedule ``key`` to expire ``delay_ms`` from now; an armed key is re-armed.

        Returns the deadline (CLOCK_MONOTONIC ms, the ``deadline_ms`` its expiration
        will carry). Never early: the expiration is handed over no sooner than
        ``delay_ms`` of real time after this call (the deadline is the clock in ms
        rounded up, plus the delay).
        """
        # The hot path, inlined: the arena-full check and _after_push (the key's encoding is
        # _encode, a C call compiled).
        if self._closed:
            self._raise_closed()
        kb = self._encode(key)  # raises InvalidKey
        meta = self._key_meta
        bkey = self._key_name
        if type(delay_ms) is not int or not 0 <= delay_ms <= self.max_delay_ms:
            self._deadline(delay_ms)  # raises the precise InvalidDelay
        seg = self._segment
        if seg is None:
            self._raise_unconnected()
        header = self._page
        if header is None or header[_PENDING] + header[_FIRED_UNACKED] >= header[_CAPACITY_WORD] \
                or self._group_words[_GROUP_FULL]:  # type: ignore[index]  # mapped with the ring
            self._refuse_if_full(bkey)
        self._seq = seq = (self._seq + 1) & _SEQ_MASK
        tag = self._tag_base | seq
        # the deadline in ms rounded up (ceil_ms, inlined): never early in real time
        now_ns = _now_ns() if _COMPILED else _monotonic_ns()  # _now_ns inlined on the Python path
        deadline = delay_ms - (-now_ns // 1_000_000)
        if not seg.push_add(kb, meta, deadline, tag):
            self._wait_for_room()
            deadline = delay_ms - (-_now_ns() // 1_000_000)
            self._push(C.ADD, kb, meta, deadline, tag)
        shard = self._latest[hash(bkey) & _SHARD_MASK]
        shard[bkey] = tag
        if self._touch_index:
            self._release_touch(_META[meta] + kb, key)
        # _after_push, inlined (see there for the ordering argument)
        if _COMPILED:
            _full_fence()  # type: ignore[name-defined]  # noqa: F821 - core.pxd
        else:
            _fence_acquire()
            _fence_release()
        if header is None:
            self._ring_doorbell(False)
            return deadline
        epoch = header[_PARKED]
        if epoch and epoch != self._rang_epoch:
            self._rang_epoch = epoch
            if not (quiet := header[_QUIET_FROM]) or now_ns < quiet:
                self._ring_doorbell(False)
        return deadline

    def add_idle(self, key, idle_ms: int) -> int:
        """An idle timer: fires ``idle_ms`` after the last :meth:`touch` of ``key``.
        Returns its first deadline (as :meth:`add`); each touch moves it."""
        # The hot path, inlined as in add: the range and arena-full checks (the precise
        # errors from the helpers), one clock read.
        if self._closed:
            self._raise_closed()
        kb = self._encode(key)  # raises InvalidKey
        meta = self._key_meta
        bkey = self._key_name
        if type(idle_ms) is not int or not 0 < idle_ms <= self.max_delay_ms or idle_ms > _IDLE_MS_MAX:
            self._check_idle_ms(idle_ms)  # raises the precise InvalidDelay
        seg = self._segment
        if seg is None:
            self._raise_unconnected()
        header = self._page
        if header is None or header[_PENDING] + header[_FIRED_UNACKED] >= header[_CAPACITY_WORD] \
                or self._group_words[_GROUP_FULL]:  # type: ignore[index]  # mapped with the ring
            self._refuse_if_full(bkey)
        if not seg.free_slots():
            # Room first: the table row below is the daemon's to read as soon as it is
            # written, so an add_idle the ring refuses (RingFull) must not have changed it
            # (the key's earlier arming would fire by the new idle time), nor taken a row.
            self._wait_for_room()
        ident = _META[meta] + kb
        if self._rearms_pending:  # a re-arm of ours still to push: this arming wins
            self._supersede_rearms(ident)
        index = self._touch_index.get(ident)
        if index is None:
            index = self._new_touch_index()
        # the deadline in ms rounded up (ceil_ms, inlined): never early in real time
        now_ns = _now_ns() if _COMPILED else _monotonic_ns()  # _now_ns inlined on the Python path
        now = -(-now_ns // 1_000_000)
        deadline = now + idle_ms
        seg.set_idle(index, idle_ms)
        self._touch_table[index] = now  # type: ignore[index]  # mapped with the ring; touch(): its first activity
        self._seq = seq = (self._seq + 1) & _SEQ_MASK
        tag = self._tag_base | seq
        if not seg.try_push(_ADD_IDLE, kb, meta, deadline, tag, idle_ms, index):
            self._push(_ADD_IDLE, kb, meta, deadline, tag, idle_ms, index)
        self._touch_index[ident] = index
        self._touch_by_key[key] = index
        self._latest[hash(bkey) & _SHARD_MASK][bkey] = tag
        self._after_push()
        return deadline

    def _check_idle_ms(self, idle_ms) -> None:
        """InvalidDelay for an ``idle_ms`` add_idle does not take (a positive int, at most the
        daemon's maximum delay and 32 bits)."""
        if type(idle_ms) is not int or idle_ms <= 0:
            raise InvalidDelay(f"idle_ms must be a positive int, not {idle_ms!r}")
        check_delay_ms(idle_ms, self.max_delay_ms)
        if idle_ms > _IDLE_MS_MAX:
            raise InvalidDelay("idle_ms must fit in 32 bits (about 24 days)")

    def _new_touch_index(self) -> int:
        """A touch-table row for a new idle key (InvalidRequest when all are in use)."""
        if self._free_touch:
            return self._free_touch.pop()
        segment = self._segment
        assert segment is not None  # add_idle checked the session
        capacity = segment.touch_capacity
        if self._next_touch < capacity:
            self._next_touch += 1
            return self._next_touch - 1
        raise InvalidRequest(f"all {capacity} idle-timer slots of this client are in use")

    def _release_touch(self, ident: bytes, key) -> None:
        index = self._touch_index.pop(ident, None)
        if index is not None:
            self._touch_by_key.pop(key, None)
            self._free_touch.append(index)
            if self._rearmed:
                self._rearmed.pop(ident, None)
            if self._rearms_pending:  # a re-arm of ours still to push: the application's command wins
                self._supersede_rearms(ident)

    def touch(self, key) -> None:
        """Record activity on an idle timer's key: one 8-byte store, no message."""
        kind = type(key)
        try:
            if kind is not str and kind is not bytes and kind is not int:
                raise TypeError
            index = self._touch_by_key[key]
        except (KeyError, TypeError):
            raise InvalidKey(f"{key!r} is not an idle timer of this client (add_idle it first)") from None
        now_ns = _now_ns() if _COMPILED else _monotonic_ns()  # _now_ns inlined on the Python path
        # (the table is mapped while _touch_by_key holds the key: once closed, ClosedTouches raises)
        self._touch_table[index] = -(-now_ns // 1_000_000)  # type: ignore[index]  # ceil_ms(): never early

    def cancel(self, key) -> bool:
        """Cancel ``key``; True if this client's arming of it will not be delivered."""
        if self._closed:
            self._raise_closed()
        kb = self._encode(key)  # raises InvalidKey
        meta = self._key_meta
        bkey = self._key_name
        self._seq = seq = (self._seq + 1) & _SEQ_MASK
        seg = self._segment
        if seg is None:
            self._raise_unconnected()
        if not seg.try_push(_CANCEL, kb, meta, 0, self._tag_base | seq):
            self._push(_CANCEL, kb, meta, 0, self._tag_base | seq)
        if self._touch_index:
            self._release_touch(_META[meta] + kb, key)
        latest = self._latest[hash(bkey) & _SHARD_MASK]
        tag = latest.get(bkey)
        hit = tag is not None and tag >= 0
        if hit:
            latest[bkey] = ~tag  # type: ignore[operator]  # hit: tag is an int
            # Also in the cancel log, whose armings' expirations are dropped on sight: after
            # the next mark forgets ~tag, an expiration of this arming can still come, fired
            # before the cancel reached the daemon and queued there, or sent to a member that
            # died and then handed to us. Two appends; the lookups are _cancelled's.
            cancelled = self._cancelled_since_mark
            cancelled.append(bkey)
            cancelled.append(tag)
            self._cancels_since_mark += 1
            if self._cancels_since_mark >= _CANCEL_MARK_EVERY:
                self._mark()
        # _after_push, inlined (see there for the ordering argument)
        if _COMPILED:
            _full_fence()  # type: ignore[name-defined]  # noqa: F821 - core.pxd
        else:
            _fence_acquire()
            _fence_release()
        parked = self._page
        if parked is None:
            self._ring_doorbell(False)
            return hit
        epoch = parked[_PARKED]
        if epoch and epoch != self._rang_epoch:
            self._rang_epoch = epoch
            if not (quiet := parked[_QUIET_FROM]) or _now_ns() < quiet:
                self._ring_doorbell(False)
        return hit

    def _mark(self) -> None:
        """An internal FLUSH: once Applied(seq) arrives, the armings cancelled before it
        can no longer produce an expiration on our socket, so their ~tag entries go (the
        cancel log, which the cancels since the last mark join here, still has them).

        Its Applied moves no replay position (``_flush_positions``): under a group
        commit a daemon answers once it has applied, not once it has persisted, and a
        mark is no acknowledgement the user saw. Were a power cut to follow, the ring
        handed back must be replayed from the user's last acknowledged flush, or the
        commands before the mark would be lost while the user's next flush, answered
        by the daemon that comes back, says they were applied."""
        seq = self._next_tag()
        self._push(C.FLUSH, b"", 0, 0, seq)
        seg = self._segment
        assert seg is not None  # (_push raised otherwise)
        self._answer_positions[seq] = seg._tail
        cancelled = self._cancelled_since_mark
        self._marks.append((seq, cancelled))
        index = self._cancel_index
        if index is not None:
            self._cancel_index_idle += 1
            if self._cancel_index_idle > len(self._cancel_log):  # unasked for a whole log: drop it
                self._cancel_index = index = None
            else:
                self._count_cancels(cancelled, self._cancel_indexed, 1)
        log = self._cancel_log
        log.append(cancelled)
        self._cancel_log_pairs += len(cancelled) >> 1
        while self._cancel_log_pairs - (len(log[0]) >> 1) >= _RECENT:  # the latest _RECENT at least
            oldest = log.popleft()
            self._cancel_log_pairs -= len(oldest) >> 1
            if index is not None:
                self._count_cancels(oldest, 0, -1)
        self._cancelled_since_mark = []
        self._cancels_since_mark = 0
        self._cancel_indexed = 0

    def _count_cancels(self, cancelled: list, start: int, step: int) -> None:
        """Add ``step`` to the index's count of each (key, tag) of ``cancelled[start:]``."""
        index = self._cancel_index
        assert index is not None  # called only while the index is kept
        for i in range(start, len(cancelled), 2):
            pair = (cancelled[i], cancelled[i + 1])
            count = index.get(pair, 0) + step
            if count:
                index[pair] = count
            else:
                del index[pair]

    def _cancelled(self, bkey, seq: int) -> bool:
        """True if the arming ``(bkey, seq)`` of ours is among the latest cancelled ones
        (the cancel log and the cancels since the last mark).

        Asked only for an expiration of an arming of ours whose key this client no longer
        tracks (its ~tag forgotten by a mark, or its entry gone with a later arming's
        expiration): so the log is indexed on the first such expiration, not by cancel, and
        the index is kept up to date (at each mark) until a whole log has gone by unasked."""
        self._cancel_index_idle = 0
        index = self._cancel_index
        if index is None:
            index = self._cancel_index = {}
            for cancelled in self._cancel_log:
                self._count_cancels(cancelled, 0, 1)
            self._cancel_indexed = 0
        cancelled = self._cancelled_since_mark
        if self._cancel_indexed < len(cancelled):
            self._count_cancels(cancelled, self._cancel_indexed, 1)
            self._cancel_indexed = len(cancelled)
        return (bkey, seq) in index

    def _remember_done(self, bkey, tag: int) -> None:
        """``_latest`` forgets ``bkey``, whose latest arming of ours, ``tag``, was received or
        cancelled: remember that arming for :meth:`_superseded` (the latest _RECENT keys)."""
        done = self._done[hash(bkey) & _SHARD_MASK]
        done[bkey] = tag
        order = self._done_order
        order.append((bkey, tag))
        if len(order) > _RECENT:
            old_key, old_tag = order.popleft()
            done = self._done[hash(old_key) & _SHARD_MASK]
            if done.get(old_key) == old_tag:
                del done[old_key]

    def _superseded(self, bkey, seq: int, my_slot: int) -> bool:
        """True if the application armed ``bkey`` again after our arming ``seq``, whose
        expiration comes only now (it fired before the re-arm and went to a member that
        died, or waited in the daemon), and ``_latest`` has forgotten the key since: the
        later arming was received or cancelled (:meth:`_remember_done`). A tag of this
        session is later than one of a former session; within one session the sequence
        numbers compare modulo their width."""
        done = self._done[hash(bkey) & _SHARD_MASK].get(bkey)
        if done is None or done == seq:
            return False
        if seq >> _SEQ_BITS != done >> _SEQ_BITS:
            return done >> _SEQ_BITS == my_slot
        return ((done - seq) & _SEQ_MASK) < (1 << (_SEQ_BITS - 1))

    # ------------------------------------------------------------------ delivery
    def _flush_acks(self) -> None:
        if self._rearms_pending:
            self._push_rearms()
        if self._to_ack:
            self._acks_pending.extend(self._to_ack)
            self._to_ack = []
        seg = self._segment
        if seg is None:  # no session yet: nothing was received, nothing to acknowledge
            return
        pending = self._acks_pending
        done = 0
        for slot, gen, epoch in pending:
            if not seg.try_push(C.ACK, b"", 0, 0, epoch, slot, gen):
                break
            done += 1
        if done:
            del pending[:done]


    def _on_expirations(self, items) -> None:
        keys = _expiry_keys(items) if _COMPILED else M.expiry_keys(items)  # the whole frame checked first
        my_slot = self._tag_base >> _SEQ_BITS
        former = self._former_slots
        welcome = self._welcome
        assert welcome is not None  # expirations come in a session, after its Welcome
        epoch = welcome.arena_epoch  # handles name records of this arena only
        recent, recent_order = self._recent, self._recent_order
        latest_shards = self._latest
        ready, handles = self._ready, self._ready_handles
        acks_pending = self._acks_pending
        received = self._received
        handed = received - len(ready)  # receipt numbers below this were handed to the application
        for e, key in zip(items, keys):
            seq = e.seq
            handle = (e.slot, e.generation, epoch)
            ident = _META[e.key_meta] + e.key_bytes
            seen = (ident, seq)
            seen_map = recent[seq & _SHARD_MASK]
            number = seen_map.get(seen)
            if number is not None:  # sent again: a daemon restart, a reboot, an ack timeout
                if number >= handed:  # still buffered: _renew_handle
                    _renew_handle(handles, number - handed, handle, acks_pending)
                else:
                    acks_pending.append(handle)  # handed over already
                continue
            if seq >> _SEQ_BITS == my_slot or seq >> _SEQ_BITS in former:
                bkey = ident if type(key) is bytes else key  # _bookkeeping_key: key decoded already
                latest = latest_shards[hash(bkey) & _SHARD_MASK]
                tag = latest.get(bkey)
                if tag is not None:
                    if tag != seq:
                        if not (self._rearmed and self._rearm_again(ident, e, bkey, handle, tag)):
                            acks_pending.append(handle)  # re-armed or cancelled since: not for the app
                        continue
                    del latest[bkey]
                    self._remember_done(bkey, seq)
                elif self._cancelled(bkey, seq) or self._superseded(bkey, seq, my_slot):
                    acks_pending.append(handle)  # cancelled or re-armed (that entry forgotten since)
                    continue
                if self._touch_index:
                    if self._stale_idle(ident, e, bkey, handle):
                        continue  # touched since the daemon looked: armed again (acknowledged with it)
                    self._release_touch(ident, key)
            seen_map[seen] = received
            received += 1
            self._received = received
            recent_order.append(seen)
            if len(recent_order) > _RECENT:
                old = recent_order.popleft()
                recent[old[1] & _SHARD_MASK].pop(old, None)
            ready.append(Expired(key, e.deadline_ms, e.fired_ms, e.late))
            handles.append(handle)

    def _stale_idle(self, ident: bytes, e, bkey, handle, again: bool = False) -> bool:
        """An expiration of one of our idle timers whose touch word shows a touch the daemon
        had not seen when it fired it (the touch was stored after the daemon's last read):
        handing it over would be early. It is armed again instead, for last touch +
        idle_ms (an ADD_IDLE with a new tag, right behind the acknowledgement of this
        copy: :meth:`_push_rearms`), and True returned. ``again``: the copy came back
        after such a re-arm (:meth:`_rearm_again`), which is done again, due or not.

        Exact, because this runs before the key's touch index is released: from then on
        :meth:`touch` raises InvalidKey, so every touch the application made before it is
        handed an expiration is in the word read here, and the clock is read after it."""
        index = self._touch_index.get(ident)
        table = self._touch_table
        seg = self._segment
        if index is None or table is None or seg is None:
            return False
        touched = table[index]
        now = _now_ns() // 1_000_000
        idle_ms = seg._idle[index]
        if touched <= 0 or idle_ms <= 0 or (touched + idle_ms <= now and not again):
            return False  # due: fired_ms >= last touch + idle_ms
        tag = self._next_tag()
        self._rearms_pending.append((e.key_bytes, e.key_meta, touched + idle_ms, tag, idle_ms, index, handle))
        self._latest[hash(bkey) & _SHARD_MASK][bkey] = tag
        before = self._rearmed.get(ident) if again else None
        self._rearmed[ident] = (e.seq, handle[2], (before[2] if before is not None else ()) + (tag,))
        self._push_rearms()
        return True

    def _take_ready(self) -> list[Expired]:
        """Hand everything received to the application; acknowledge it at the next call."""
        out = list(self._ready)
        self._to_ack.extend(self._ready_handles)
        self._ready.clear()
        self._ready_handles.clear()
        return out

    def _take_one(self) -> Expired:
        self._to_ack.append(self._ready_handles.popleft())
        return self._ready.popleft()


    def _ring_doorbell(self, urgent: bool = True) -> None:  # pragma: no cover - provided by the I/O shells
        """Wake a parked daemon; ``urgent=False`` (commands nobody waits for yet) lets it
        gather more commands first, for up to its coalescing window."""
        raise NotImplementedError
