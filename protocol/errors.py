"""One exception hierarchy for all of wheeld.

Errors say whose fault they are (trio's ClosedResourceError vs
BrokenResourceError is the model):

=====================  ==========================================================
``WheeldError``        base of everything wheeld raises on purpose
``InvalidRequest``     the caller's mistake (a ``ValueError``): bad key, bad delay,
                       bad parameter. Nothing was changed.
``InvalidKey``         ...a key of the wrong type, empty, or too long
``InvalidDelay``       ...a negative, non-integer or out-of-range delay/deadline
``BackPressure``       expected and temporary: retry later or shed load
``RingFull``           ...the client's command ring stayed full past the timeout
``ArenaFull``          ...every entry record of the arena is in use
``GroupLimit``         ......every group id of the arena's group table is in use
``ProtocolError``      a peer sent something that does not decode (garbage,
                       wrong version, bad checksum); the peer is at fault
``Closed``             the caller used something it had closed itself
``BrokenPeer``         the other side died or vanished (daemon gone, client gone)
``CorruptArena``       the shared-memory arena fails its invariants or its header
                       does not describe a wheeld arena
=====================  ==========================================================
"""

from __future__ import annotations


class WheeldError(Exception):
    """Base class of every error wheeld raises on purpose."""


class InvalidRequest(WheeldError, ValueError):
    """The caller asked for something impossible; nothing was changed."""


class InvalidKey(InvalidRequest):
    """A key of the wrong type, empty, or longer than the record holds."""


class InvalidDelay(InvalidRequest):
    """A delay or deadline that is negative, not an integer, or out of range."""


class BackPressure(WheeldError):
    """Expected, temporary refusal: the request may succeed later."""


class RingFull(BackPressure):
    """The client's command ring stayed full for longer than the timeout."""


class ArenaFull(BackPressure):
    """No free entry record is left in the arena."""


class GroupLimit(ArenaFull):
    """A new group name found every id of the arena's group table in use.

    The table has ``max_groups`` ids (``TimerWheel.create(max_groups=...)``,
    1,024 by default); an id is in use while its name is registered or a
    scheduled or fired timer carries it. Groups with no member and nothing
    pending are reclaimed; raise --max-groups or use fewer group names.
    """


class ProtocolError(WheeldError):
    """A peer sent bytes that are not a valid message of this protocol version."""


class Closed(WheeldError):
    """The object was closed by its owner and cannot be used any more."""


class BrokenPeer(WheeldError):
    """The other side (daemon or client) died or went away."""


class CorruptArena(WheeldError):
    """The arena does not pass its invariants or is not a wheeld arena."""
