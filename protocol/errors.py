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
``QuotaExceeded``      ......the group holds its quota of records (``--group-quota``)
``GroupLimit``         ......every group id is in use (``--max-groups``)
``Timeout``            ...the daemon did not answer in time (also a ``TimeoutError``)
``JournalUnavailable`` ...the daemon cannot write its journal (disk full, I/O
                       error, read-only): a ``flush()`` could not be made durable
``ReplicationBehind``  ......``--durability replicated``: the cluster has not stored
                       what a ``flush()`` covers within ``--replicate-timeout-s``
``ProtocolError``      a peer sent something that does not decode (garbage,
                       wrong version, bad checksum); the peer is at fault
``NotAllowed``         the daemon refuses this user: not an allowed uid/gid, or a
                       group owned by someone else
``Closed``             the caller used something it had closed itself
``ForkedClient``       ...a client used in a child process it was inherited by
``BrokenPeer``         the other side died or vanished (daemon gone, client gone)
``DaemonNotRunning``   ...nothing listens on the socket (no such file, refused)
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


class QuotaExceeded(ArenaFull):
    """The group already holds its quota of pending + unacknowledged timers
    (``wheeld --group-quota``); other groups are not affected."""


class GroupLimit(ArenaFull):
    """A new group name found every id of the arena's group table in use.

    The table has ``max_groups`` ids (``TimerWheel.create(max_groups=...)``,
    1,024 by default); an id is in use while its name is registered or a
    scheduled or fired timer carries it. Groups with no member and nothing
    pending are reclaimed; raise --max-groups or use fewer group names.
    """


class Timeout(BackPressure, TimeoutError):
    """The daemon did not answer within the timeout (a ``flush()``, a handshake)."""


class JournalUnavailable(BackPressure):
    """The daemon's journal (``wheeld --journal``) cannot be written: the disk is full,
    over quota, read-only or failing. The commands were applied to the daemon's
    arena (the timers fire) but are not on disk, so the ``flush()`` that asked for
    them is not acknowledged. The daemon keeps serving and writes a snapshot of
    everything once the journal can be written again; a ``flush()`` after that
    succeeds and covers them."""


class ReplicationBehind(JournalUnavailable):
    """``wheeld --durability replicated``: the NATS JetStream cluster the daemon replicates
    its journal to has not stored what this ``flush()`` covers within
    ``--replicate-timeout-s`` (out of reach, no quorum, or slower than the commands). The
    commands were applied (the timers fire, on this host) and are in the local journal;
    the daemon sends what the cluster missed, in order, once it is back, and a ``flush()``
    that succeeds then covers them."""


class ProtocolError(WheeldError):
    """A peer sent bytes that are not a valid message of this protocol version."""


class NotAllowed(WheeldError):
    """The daemon refuses this user: its uid/gid is not allowed, or the group
    belongs to another owner (``wheeld --allow-*``, ``--group-owner``)."""


class Closed(WheeldError):
    """The object was closed by its owner and cannot be used any more."""


class ForkedClient(Closed):
    """A client object used in a child process that inherited it through ``fork()``.
    The session belongs to the parent; connect again in the child."""


class BrokenPeer(WheeldError):
    """The other side (daemon or client) died or went away."""


class DaemonNotRunning(BrokenPeer):
    """No daemon listens on the socket path (no such file, or connection refused)."""


class CorruptArena(WheeldError):
    """The arena does not pass its invariants or is not a wheeld arena."""
