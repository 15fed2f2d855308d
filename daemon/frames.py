"""What fired, from the arena's records to the daemon's queues and frames.

:func:`queue_usual` is the delivery's usual expiry (``Delivery.expire``): the slots the
wheel just fired go to their groups' queues as (slot, generation, fired_ms, late)
entries, their lateness counted; it stops at the first record it leaves to the caller
(an idle timer, whose touch word decides whether it fires, or a damaged record).
Compiled (``frames.pxd``), it reads the records in C: no record tuple per expiration.

:func:`expirations_frame` is the delivery's usual send (``Delivery._send``): queue
entries (slot, generation, fired_ms, late) in, one length-prefixed ``Expirations``
frame out, its records marked with the client they go to (``TimerWheel.mark_fired``)
and noted in that client's in-flight table. Compiled (``frames.pxd``), it reads the
records and writes the MessagePack bytes in C, in one buffer: no record tuple, item
tuple or msgspec call per expiration. This source is its reference: both give the bytes
``M.encode_expirations_frame`` gives for the same items (``tests/test_frames.py``).

It takes the usual case only. An item the client might refuse (a generation beyond 31
bits, a key meta byte no key has, a str key that is not ASCII: ``_suspect``), or an
entry of another shape, makes it return None before anything is written: the caller
then builds the frame the checked way (``Delivery._send``), which repairs or drops
such records one by one.
"""

from __future__ import annotations

from wheeld.protocol import arena_layout as AL
from wheeld.protocol import framing
from wheeld.protocol import messages as M
from wheeld.protocol.keys import TYPE_STR, VALID_KEY_METAS, key_length, key_type

__all__ = ["LATENESS_CAP_MS", "expirations_frame", "lateness_us", "queue_usual", "suspect"]

_COMPILED = not __file__.endswith(".py")
_KEY_LEN_MASK = key_length(0xFF)
_GEN_MAX = (1 << 31) - 1
# Per key meta byte, what an item's key needs before its client takes it: 0 nothing (bytes
# and int keys of a valid meta), 1 a str key (UTF-8: ASCII is), 2 never (no key has this
# meta). With a generation within 31 bits, an item built from an arena record (its other
# fields fit their types by the record's layout) decodes at the client unless suspect()
# says so: tests/test_arena_damage.py holds the two to that.
KEY_CHECK = bytes(0 if VALID_KEY_METAS[meta] and key_type(meta) != TYPE_STR else 1 if VALID_KEY_METAS[meta] else 2
                  for meta in range(256))
#: the most lateness one expiration counts for (see wheeld.daemon.delivery, "Deadlines in the past")
LATENESS_CAP_MS = 86_400_000
_CAP_MS = LATENESS_CAP_MS  # (a C constant in the compiled build)
# the bounds of the lateness histogram's buckets; compiled, a C array (frames.pxd)
_BOUNDS = list(AL.LATENESS_BOUNDS_US)
_VALID_META = bytes(VALID_KEY_METAS)
# the frame body up to its items: the array header of an Expirations message and its tag
_PREFIX = M.EXPIRATIONS_PREFIX
if _COMPILED and _f_layout() != (  # noqa: F821 - frames.pxd: its C constants are this layout's
        AL.RECORD_BYTES, AL.R_DEADLINE, AL.R_GEN, AL.R_TAG, AL.R_AUX, AL.R_STATE, AL.R_KEY_META, AL.R_KEY,
        AL.KEY_BYTES, _KEY_LEN_MASK, AL.FIRED, AL.R_GROUP, AL.LATENESS_BUCKETS):
    raise ImportError("frames.pxd's record layout constants are not those of wheeld.protocol.arena_layout")


def lateness_us(now: int, deadline: int) -> int:
    """How late an expiration fired at ``now`` for ``deadline`` counts, in us: 0 ..
    ``LATENESS_CAP_MS`` ms, whatever the deadline."""
    late_ms = now - deadline
    return (0 if late_ms < 0 else min(late_ms, LATENESS_CAP_MS)) * 1000


def queue_usual(wheel, slots: list, start: int, now: int, started_ms: int, lateness, queues) -> int:
    """Queue the records the wheel fired at ``now``, ``slots[start:]`` in order, up to the
    first one that is not usual, and return its index (``len(slots)`` when each was).

    Usual: a group id below the wheel's ``max_groups``, a key meta byte some key has, and
    no touch reference (aux < 0: not an idle timer). Each goes to ``queues[group]`` as
    (slot, generation, now, late), late when its deadline is before ``started_ms``, and
    its lateness is counted (``lateness.add``). The caller handles the one it stops at
    (``Delivery._queue_rows``) and calls again after it: the queues keep the wheel's
    order."""
    if _COMPILED:
        return _c_queue_usual(wheel, slots, start, now, started_ms, lateness, queues)  # noqa: F821 - frames.pxd
    end, max_groups, valid = len(slots), wheel.max_groups, VALID_KEY_METAS
    late_us = []
    i = start
    for row in wheel.record_rows(slots[start:]) if start < end else ():
        deadline, _prev, _next, gen, _tag, aux, group, _state, meta, _key = row
        if group >= max_groups or not valid[meta] or aux >= 0:
            break
        late_us.append(lateness_us(now, deadline))
        queues[group].append((slots[i], gen, now, deadline < started_ms))
        i += 1
    if late_us:
        lateness.add(late_us)
    return i


def suspect(items: list[tuple]) -> bool:
    """May one of these Expirations items (``M.ExpiryFields`` order) be refused by the
    client? False only when each surely decodes (see KEY_CHECK)."""
    check = KEY_CHECK
    for key, meta, _deadline, _fired, _seq, _slot, gen, _late in items:
        c = check[meta]
        if gen > _GEN_MAX or c == 2 or (c and not key.isascii()):
            return True
    return False


def fired_items(taken: list, rows: list) -> list[tuple]:
    """``Expirations`` items (``M.ExpiryFields`` order) of the queue entries ``taken`` (slot,
    generation, fired_ms, late) whose record tuples ``rows`` (``TimerWheel.record_rows``, in
    the same order) are still FIRED with that generation."""
    fired, length = AL.FIRED, _KEY_LEN_MASK
    return [
        (key[: meta & length], meta, deadline, fired_ms, tag, s, gen, late)
        for (s, gen, fired_ms, late), (deadline, _p, _n, rgen, tag, _aux, _g, state, meta, key) in zip(taken, rows)
        if state == fired and rgen == gen
    ]


def expirations_frame(wheel, taken: list, aux: int, unacked: dict):
    """The ``Expirations`` frame of the queue entries ``taken`` (slot, generation,
    fired_ms, late) whose records are still FIRED with that generation, as
    ``(frame, items)``; ``(None, 0)`` when none is. Before it returns, each record in the
    frame has ``aux`` in its aux word (``TimerWheel.mark_fired``: the client it is sent
    to) and its ``slot: generation`` in ``unacked``.

    None, with nothing written, when an item might be refused by the client (see the
    module docstring): the caller builds that frame the checked way."""
    if _COMPILED:
        return _c_expirations_frame(wheel, taken, aux, unacked, KEY_CHECK, _PREFIX, framing.MAX_FRAME)  # noqa: F821
    items = fired_items(taken, wheel.record_rows([entry[0] for entry in taken]))
    if suspect(items):
        return None
    if not items:
        return None, 0
    frame = M.encode_expirations_frame(items)
    pairs = [(item[5], item[6]) for item in items]
    wheel.mark_fired([slot for slot, _gen in pairs], aux)
    unacked.update(pairs)
    return frame, len(items)
