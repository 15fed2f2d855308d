"""The client library's state machine, shared by the blocking and the asyncio client.

What a call costs:

* ``add``/``add_idle``/``cancel``: one 64-byte record written into this client's
  own ring in shared memory and one 8-byte store to publish it. If the daemon
  said it is parked (a word in the arena, which the client maps read-only), one
  small ``Doorbell`` frame on the socket wakes it; otherwise no system call.
* ``touch``: one 8-byte store of the current time into this client's touch table.
  The daemon reads it only when the idle timer comes due.
* ``poll``: reads ``Expirations`` frames from the socket.

Exactly once to the application, per arming: every arming carries a *tag*
(``client slot << 21 | sequence``). The library remembers the tag of this
client's latest arming of each key; an expiration of an older arming of this
client's (the key was re-armed or cancelled since) is dropped, and so is one it
already handed over (a daemon restart re-sends unacknowledged expirations).
Acknowledgements go back through the ring when the application comes back for
more (the next ``poll``) or closes. Two windows are at least once instead of
exactly once: an expiration handed to a process that dies before acknowledging
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

import collections
import os
import threading
import time
from dataclasses import dataclass

from wheeld.protocol import arena_layout as AL
from wheeld.protocol import commands as C
from wheeld.protocol import messages as M
from wheeld.protocol.errors import ArenaFull, BrokenPeer, Closed, InvalidDelay, InvalidKey, InvalidRequest, RingFull
from wheeld.protocol.keys import decode_key, encode_key
from wheeld.shm.arena import Segment
from wheeld.shm.ring import ClientSegment

_META = [bytes((m,)) for m in range(256)]
_fence = threading.Lock()
_PARKED = AL.H_PARKED // 8
_PENDING = AL.H_COUNTERS // 8 + AL.COUNTER["pending"]
_FIRED_UNACKED = AL.H_COUNTERS // 8 + AL.COUNTER["fired_unacked"]
_CAPACITY_WORD = AL.H_CAPACITY // 8
_SEQ_BITS = 21
_SEQ_MASK = (1 << _SEQ_BITS) - 1
_RECENT = 1 << 17  # expirations remembered to drop re-sent ones
_CANCEL_MARK_EVERY = 1024  # cancels between internal flushes that let us forget cancelled armings


def mono_ms() -> int:
    return time.monotonic_ns() // 1_000_000


@dataclass(frozen=True, slots=True)
class Expired:
    """A timer that came due. ``late`` is True when it fired late because the daemon was down."""

    key: str | bytes | int
    deadline_ms: int
    fired_ms: int
    late: bool = False


class ClientCore:
    """Ring, touch table and bookkeeping; the subclasses add the socket I/O."""

    def __init__(self, socket_path: str | None, group: str, ring_timeout_s: float, reconnect_timeout_s: float,
                 client_name: str):
        from wheeld.daemon.config import default_socket_path

        self.socket_path = socket_path or default_socket_path()
        self.group = group
        self.ring_timeout_s = ring_timeout_s
        self.reconnect_timeout_s = reconnect_timeout_s
        self.client_name = client_name
        self._segment: ClientSegment | None = None
        self._arena: Segment | None = None
        self._parked = None
        self._rang_epoch = 0
        self._welcome: M.Welcome | None = None
        self._seq = 0
        self._tag_base = 0
        self._latest: dict[bytes, int] = {}  # ident -> tag of our live arming, or ~tag once cancelled
        self._touch_index: dict[bytes, int] = {}  # ident -> touch index
        self._touch_by_key: dict = {}  # the user's key object -> touch index (touch's fast path)
        self._touch_table = None
        self._free_touch: list[int] = []
        self._next_touch = 0
        # expirations already handed over, by (key, arming tag): survives a daemon
        # restart (same records) and a reboot recovery (new records, same journaled arming)
        self._recent: collections.OrderedDict[tuple[bytes, int], None] = collections.OrderedDict()
        self._ready: collections.deque[tuple[Expired, tuple[int, int, int]]] = collections.deque()  # received, not handed over
        self._to_ack: list[tuple[int, int, int]] = []  # (slot, generation, arena epoch): handed over, ack at the next poll
        self._acks_pending: list[tuple[int, int, int]] = []  # could not be pushed yet (ring full)
        self._applied = -1
        self._cancels_since_mark = 0
        self._marks: list[tuple[int, list[bytes]]] = []
        self._cancelled_since_mark: list[bytes] = []
        self._rejected: list[M.Rejected] = []
        self._closed = False
        self.max_delay_ms = 0

    # ------------------------------------------------------------------ handshake
    def _hello(self) -> M.Hello:
        seg = self._segment
        return M.Hello(M.PROTOCOL_VERSION, self.group, os.getpid(), self.client_name,
                       seg.name if seg is not None else "", self._welcome.token if self._welcome else 0)

    def _on_welcome(self, welcome: M.Welcome) -> None:
        if self._segment is None or self._segment.name != welcome.segment_name:
            if self._segment is not None:  # the daemon could not resume our old ring
                self._segment.close()
                self._touch_index.clear()
                self._touch_by_key.clear()
                self._free_touch.clear()
                self._next_touch = 0
            self._segment = ClientSegment.attach(welcome.segment_name)
            # touch() stores straight into the touch table: one 8-byte store (see shm.ring)
            self._touch_table = self._segment._last_touch
        if self._arena is not None:
            self._arena.close()
            self._arena = None
        self._parked = None
        if welcome.arena_name:
            try:
                self._arena = Segment.attach(welcome.arena_name, readonly=True)
                self._parked = memoryview(self._arena.buf)[: AL.GROUPS_OFFSET].cast("q")
            except (OSError, FileNotFoundError):
                self._arena = None  # not readable by us: ring the doorbell every time
        self._welcome = welcome
        self._tag_base = welcome.client_id << _SEQ_BITS
        self.max_delay_ms = welcome.max_delay_ms

    # ------------------------------------------------------------------ commands
    def _check_open(self) -> None:
        if self._closed:
            raise Closed("this wheeld client is closed")

    def _next_tag(self) -> int:
        self._seq = (self._seq + 1) & _SEQ_MASK
        return self._tag_base | self._seq

    def _deadline(self, delay_ms) -> int:
        if type(delay_ms) is not int:
            raise InvalidDelay(f"delay_ms must be an int, not {type(delay_ms).__name__}")
        if delay_ms < 0:
            raise InvalidDelay(f"delay_ms must not be negative ({delay_ms})")
        if delay_ms > self.max_delay_ms:
            raise InvalidDelay(f"delay_ms {delay_ms} exceeds the daemon's maximum of {self.max_delay_ms}")
        return mono_ms() + delay_ms

    def _push(self, op: int, kb: bytes, meta: int, deadline: int, tag: int, aux0: int = 0, aux1: int = 0) -> None:
        seg = self._segment
        if seg.try_push(op, kb, meta, deadline, tag, aux0, aux1):
            return
        self._wait_for_room()
        if not seg.try_push(op, kb, meta, deadline, tag, aux0, aux1):
            raise RingFull(f"the ring stayed full for {self.ring_timeout_s} s; the daemon is not draining it")

    def _wait_for_room(self) -> None:
        self._ring_doorbell()
        end = time.monotonic() + self.ring_timeout_s
        while self._segment.free_slots() == 0:
            if time.monotonic() >= end:
                raise RingFull(f"the ring stayed full for {self.ring_timeout_s} s; the daemon is not draining it")
            time.sleep(0.0002)

    def _arena_full(self) -> bool:
        header = self._parked
        if header is None:
            return False
        return header[_PENDING] + header[_FIRED_UNACKED] >= header[_CAPACITY_WORD] & 0xFFFFFFFF

    def _after_push(self) -> None:
        # Eventcount, client half: tail published (in _push), full fence, then read
        # `parked`. x86-64 may let a load pass an earlier store; the locked
        # instruction inside an uncontended lock's acquire/release forbids it, so
        # either we see parked=1 and ring, or the daemon's re-check sees our tail.
        _fence.acquire()
        _fence.release()
        parked = self._parked
        if parked is None:
            self._ring_doorbell()
            return
        epoch = parked[_PARKED]
        if epoch and epoch != self._rang_epoch:
            self._rang_epoch = epoch
            self._ring_doorbell()

    def add(self, key, delay_ms: int) -> None:
        """Schedule ``key`` to expire ``delay_ms`` from now; an armed key is re-armed."""
        if self._closed:
            raise Closed("this wheeld client is closed")
        kb, meta = encode_key(key)
        if type(delay_ms) is not int or not 0 <= delay_ms <= self.max_delay_ms:
            self._deadline(delay_ms)  # raises the precise InvalidDelay
        if self._arena_full():
            raise ArenaFull("the daemon's arena is full")
        ident = _META[meta] + kb
        self._seq = seq = (self._seq + 1) & _SEQ_MASK
        tag = self._tag_base | seq
        if not self._segment.push_add(kb, meta, time.monotonic_ns() // 1_000_000 + delay_ms, tag):
            self._wait_for_room()
            self._push(C.ADD, kb, meta, time.monotonic_ns() // 1_000_000 + delay_ms, tag)
        self._latest[ident] = tag
        if self._touch_index:
            self._release_touch(ident, key)
        self._after_push()

    def add_idle(self, key, idle_ms: int) -> None:
        """An idle timer: fires ``idle_ms`` after the last :meth:`touch` of ``key``."""
        self._check_open()
        kb, meta = encode_key(key)
        if type(idle_ms) is not int or idle_ms <= 0:
            raise InvalidDelay(f"idle_ms must be a positive int, not {idle_ms!r}")
        now = mono_ms()
        deadline = now + idle_ms
        self._deadline(idle_ms)  # range check
        if idle_ms > (1 << 31) - 1:
            raise InvalidDelay("idle_ms must fit in 32 bits (about 24 days)")
        if self._arena_full():
            raise ArenaFull("the daemon's arena is full")
        ident = _META[meta] + kb
        seg = self._segment
        index = self._touch_index.get(ident)
        if index is None:
            if self._free_touch:
                index = self._free_touch.pop()
            elif self._next_touch < seg.touch_capacity:
                index = self._next_touch
                self._next_touch += 1
            else:
                raise InvalidRequest(f"all {seg.touch_capacity} idle-timer slots of this client are in use")
        seg.set_idle(index, idle_ms)
        seg.touch(index, now)
        tag = self._next_tag()
        self._push(C.ADD_IDLE, kb, meta, deadline, tag, idle_ms, index)
        self._touch_index[ident] = index
        self._touch_by_key[key] = index
        self._latest[ident] = tag
        self._after_push()

    def _release_touch(self, ident: bytes, key) -> None:
        index = self._touch_index.pop(ident, None)
        if index is not None:
            self._touch_by_key.pop(key, None)
            self._free_touch.append(index)

    def touch(self, key) -> None:
        """Record activity on an idle timer's key: one 8-byte store, no message."""
        kind = type(key)
        try:
            if kind is not str and kind is not bytes and kind is not int:
                raise TypeError
            index = self._touch_by_key[key]
        except (KeyError, TypeError):
            raise InvalidKey(f"{key!r} is not an idle timer of this client (add_idle it first)") from None
        self._touch_table[index] = time.monotonic_ns() // 1_000_000

    def cancel(self, key) -> bool:
        """Cancel ``key``; True if this client's arming of it will not be delivered."""
        self._check_open()
        kb, meta = encode_key(key)
        ident = _META[meta] + kb
        self._push(C.CANCEL, kb, meta, 0, self._next_tag())
        self._release_touch(ident, key)
        tag = self._latest.get(ident)
        hit = tag is not None and tag >= 0
        if hit:
            self._latest[ident] = ~tag
            self._cancelled_since_mark.append(ident)
            self._cancels_since_mark += 1
            if self._cancels_since_mark >= _CANCEL_MARK_EVERY:
                self._mark()
        self._after_push()
        return hit

    def _mark(self) -> None:
        """An internal FLUSH: once Applied(seq) arrives, the armings cancelled before it
        can no longer produce an expiration on our socket, so we forget them."""
        seq = self._next_tag()
        self._push(C.FLUSH, b"", 0, 0, seq)
        self._marks.append((seq, self._cancelled_since_mark))
        self._cancelled_since_mark = []
        self._cancels_since_mark = 0

    def _push_flush(self) -> int:
        self._flush_acks()
        seq = self._next_tag()
        self._push(C.FLUSH, b"", 0, 0, seq)
        self._ring_doorbell()
        return seq

    # ------------------------------------------------------------------ delivery
    def _flush_acks(self) -> None:
        if self._to_ack:
            self._acks_pending.extend(self._to_ack)
            self._to_ack = []
        seg = self._segment
        pending = self._acks_pending
        done = 0
        for slot, gen, epoch in pending:
            if not seg.try_push(C.ACK, b"", 0, 0, epoch, slot, gen):
                break
            done += 1
        if done:
            del pending[:done]

    def _on_message(self, message) -> None:
        kind = type(message)
        if kind is M.Expirations:
            self._on_expirations(message.items)
        elif kind is M.Applied:
            self._applied = message.seq
            while self._marks and self._marks[0][0] == message.seq:
                _seq, idents = self._marks.pop(0)
                for ident in idents:
                    tag = self._latest.get(ident)
                    if tag is not None and tag < 0:
                        del self._latest[ident]
        elif kind is M.Rejected:
            self._rejected.append(message)
        elif kind is M.Goodbye:
            raise BrokenPeer(f"the daemon ended the session: {message.reason}")
        elif kind is M.Refused:
            raise BrokenPeer(f"the daemon refused the session: {message.reason}")

    def _on_expirations(self, items) -> None:
        my_slot = self._tag_base >> _SEQ_BITS
        epoch = self._welcome.arena_epoch  # handles name records of this arena only
        recent = self._recent
        latest = self._latest
        for e in items:
            handle = (e.slot, e.generation, epoch)
            ident = _META[e.key_meta] + e.key_bytes
            seen = (ident, e.seq)
            if seen in recent:
                self._acks_pending.append(handle)  # already handed over before a daemon restart
                continue
            if e.seq >> _SEQ_BITS == my_slot:
                tag = latest.get(ident)
                if tag is not None and tag != e.seq:
                    self._acks_pending.append(handle)  # re-armed or cancelled since: not for the app
                    continue
                if tag is not None:
                    del latest[ident]
                if self._touch_index:
                    self._release_touch(ident, e.key)
            recent[seen] = None
            if len(recent) > _RECENT:
                recent.popitem(last=False)
            self._ready.append((Expired(decode_key(e.key_bytes, e.key_meta), e.deadline_ms, e.fired_ms, e.late), handle))

    def _take_ready(self) -> list[Expired]:
        """Hand everything received to the application; acknowledge it at the next call."""
        out = [expired for expired, _handle in self._ready]
        self._to_ack.extend(handle for _expired, handle in self._ready)
        self._ready.clear()
        return out

    def _take_one(self) -> Expired:
        expired, handle = self._ready.popleft()
        self._to_ack.append(handle)
        return expired

    def rejected(self) -> list[M.Rejected]:
        """Commands the daemon refused since the last call (e.g. arena full)."""
        out, self._rejected = self._rejected, []
        return out

    def _raise_rejections(self) -> None:
        rejected = self.rejected()
        if not rejected:
            return
        full = [r for r in rejected if r.code == M.Rejected.ARENA_FULL]
        summary = ", ".join(f"{r.key!r}: {r.reason}" for r in rejected[:5])
        if full:
            raise ArenaFull(f"{len(full)} add(s) refused because the arena is full ({summary})")
        raise InvalidRequest(f"{len(rejected)} command(s) refused ({summary})")

    def _ring_doorbell(self) -> None:  # pragma: no cover - provided by the I/O shells
        raise NotImplementedError
