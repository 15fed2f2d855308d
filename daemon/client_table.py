"""The client slots and the client table that keeps them across daemon restarts.

``/wheeld-NAME-clients`` (:mod:`wheeld.protocol.clients_layout`) holds, per client
slot, its group, pid, uid, ring label and last ring depth (wheelctl shows them:
rings are memfds it cannot map), and per group id its owner. A restarted daemon
finds the slots its clients had; they wait ``resume_grace_s`` for their client
to hand the ring back. The table is reached through the host's shared-memory
port (``ClientTable.open(wheel, now, host, qualifier)``: ``host.shm``,
:class:`wheeld.daemon.host.SharedMemory`), like the arena.
"""

from __future__ import annotations

import logging

import numpy as np

from wheeld.protocol import arena_layout as AL
from wheeld.protocol import clients_layout as CL
from wheeld.protocol.errors import ProtocolError
from wheeld.shm.ring import ClientSegment

from wheeld.protocol.naming import clients_name, segment_prefix
from .host import Host
from .instance import Unusable, create_segment, file_identity, set_aside, take_segment
from .startup import hand_to_monitors

log = logging.getLogger("wheeld")


def _live(wheel) -> int:
    """The arena's armings, pending or fired and not acknowledged (a restart fires at once
    what came due while no daemon ran: those are armings a replayed ring holds too)."""
    counters = wheel.counters()
    return counters["pending"] + counters["fired_unacked"]


class ClientSlot:
    """A client's ring segment, drained whether or not its client is connected.

    ``segment`` is None while a slot found in the client table after a daemon
    restart waits for its client to hand the ring back (``resume_grace_s``).
    ``unacked`` holds what was sent to this client and not yet acknowledged, in two
    generations: every ``ack_timeout_s / 2`` what is still in the older one is sent
    again (to any member) and the newer one becomes the older."""

    __slots__ = ("slot", "segment", "label", "group", "group_name", "session", "unacked", "unacked_old", "poisoned",
                 "pid", "uid", "orphan_since", "said_bye",
                 "apply_ns", "replay_guard", "replay_left")

    def __init__(self, slot: int, segment: ClientSegment | None, label: str, group: int, group_name: str, pid: int,
                 uid: int):
        self.slot = slot
        self.segment = segment
        self.label = label
        self.group = group
        self.group_name = group_name
        self.session = None  # its connection.Session while connected
        self.unacked: dict[int, int] = {}  # fired slot -> generation, sent to this client
        self.unacked_old: dict[int, int] = {}
        self.poisoned = False
        self.pid = pid
        self.uid = uid
        self.orphan_since = 0
        self.said_bye = False  # its client ended its last session with Bye: it will not come back for it
        self.apply_ns = 0  # what applying one of its commands costs the daemon (Executor.drain), ns; 0 unknown
        # A slot found in the table at start, or a ring handed back to a daemon with another
        # arena: the armings the arena held when this daemon started (ArmingsAtStart), until
        # ``replay_left`` records of its ring were applied (Executor.apply_ring)
        self.replay_guard: ArmingsAtStart | None = None
        self.replay_left = 0

    def touch_views(self) -> tuple[memoryview, memoryview] | None:
        """Its touch table's (last touch, idle_ms) int64 views, for the wheel's lazy re-arm
        (``TimerWheel.expire``), or None while they are out of reach (no ring yet after a
        restart) or must not be trusted (poisoned): its idle timers then fire, for
        ``Delivery.idle_check`` to decide."""
        segment = self.segment
        if segment is None or self.poisoned:
            return None
        return segment.touch_views()

    def take_unacked(self) -> list[tuple[int, int]]:
        """Everything in flight to this client, forgotten here (it goes back to the queue)."""
        pairs = list(self.unacked_old.items()) + list(self.unacked.items())
        self.unacked_old.clear()
        self.unacked.clear()
        return pairs


class ArmingsAtStart:
    """The armings (key, group, tag) the arena held, pending or fired, when the daemon
    started on it: what the ring chunk a killed daemon was applying has already done.

    A daemon applies a chunk of a ring, journals it and only then publishes the ring's
    head; killed in between, it leaves the chunk to be applied again by the next
    daemon once the client hands the ring back. Applying an ADD again whose timer
    fired meanwhile (the restarted daemon fires what came due while it was down at
    once, and may deliver it and have it acknowledged before the client is back)
    would arm it a second time and deliver it twice. :func:`wheeld.daemon.executor.
    replayed_commands` uses this to skip the commands of the first chunk of such a
    ring whose effect the arena already shows.

    The same holds for a ring handed back to a daemon that rebuilt the arena from the
    journal (a reboot, or the arena removed while no daemon ran): the client replays
    it from its last acknowledged flush, and the commands in that range the lost
    daemon did apply are in the journal, so in the rebuilt arena (pending, or fired
    and not acknowledged). Those are skipped there over the whole replayed range
    (``ClientSlot.replay_left``); a ring handed back without a replay (more than a
    ring's worth pushed since that flush) is taken from the head the lost daemon
    published, and its first chunk is guarded as a restarted daemon's are. Taken when
    the rebuilt arena is first used, for every group (``groups`` None). Taken after the
    arena was compared with the journal (``reconcile`` frees what the journal does not
    know: those are applied again). Sorted byte strings (tag, group, 33-byte key
    ident), searched with numpy: about 40 bytes per live timer of the slots' groups."""

    def __init__(self, wheel, groups: set[int] | None = None):
        rec = wheel.records[wheel.first_entry:]
        state = rec["state"] & AL.STATE_MASK
        live = (state == AL.SCHEDULED) | (state == AL.FIRED)
        if groups is not None:
            live &= np.isin(rec["group"], list(groups))
        live = np.flatnonzero(live)
        self.entries = self.pack(rec["tag"][live], rec["group"][live],
                                 wheel._idents[live + wheel.first_entry].view(np.uint8).reshape(-1, 33))
        self.entries.sort()

    @staticmethod
    def pack(tags: np.ndarray, groups: np.ndarray, idents: np.ndarray) -> np.ndarray:
        """(tag, group, ident) rows as comparable byte strings: big-endian tag and group first."""
        n = len(tags)
        rows = np.empty((n, 39), dtype=np.uint8)
        rows[:, :4] = np.asarray(tags, dtype=">u4").reshape(n, 1).view(np.uint8)
        rows[:, 4:6] = np.asarray(groups, dtype=">u2").reshape(n, 1).view(np.uint8)
        rows[:, 6:] = idents
        return rows.view("S39").reshape(n)

    def holds(self, tags: np.ndarray, group: int, idents: np.ndarray) -> np.ndarray:
        """Which of these armings (one group) the arena held at start."""
        wanted = self.pack(tags, np.full(len(tags), group), idents)
        if not len(self.entries):
            return np.zeros(len(wanted), dtype=bool)
        at = np.minimum(np.searchsorted(self.entries, wanted), len(self.entries) - 1)
        return self.entries[at] == wanted


class ClientTable:
    """The client slots in use (``clients``: slot -> ClientSlot, also by ring label)
    and their shared-memory table."""

    def __init__(self, config, clients: dict[int, ClientSlot]):
        self.config = config
        self.clients = clients
        self.by_label: dict[str, ClientSlot] = {}  # ring label -> its slot (resume looks them up)
        self._next_slot = 0  # slots are handed out round robin: a freed slot is reused last
        self._static_owners = {name: (CL.OWNER_UID if kind == "uid" else CL.OWNER_GID, ident)
                               for name, kind, ident in config.group_owners}
        self._buf = None
        self._segment = None  # the mapped table (a wheeld.shm.arena.Segment)
        self.segment_name = ""
        self.identity = (0, 0)  # the table file's (device, inode): see instance.HeldSegment
        # an arena rebuilt from the journal at start: its armings then, for rings replayed into it
        # (kept for --resume-grace-s, as long as a client away is waited for: ~40 bytes per timer)
        self.armings_at_start: ArmingsAtStart | None = None
        self.armings_until = 0
        self.created = False  # made by this start (else found)

    def open(self, wheel, now: int, host: Host, qualifier: int | None = None) -> None:
        """Map the client table (its segment lock taken first: :func:`~wheeld.daemon.instance.take_segment`;
        ``host``: the ports, ``host.shm`` for the segment; ``qualifier``: the uid of the segment names
        in use, None for the plain ones); a restarted daemon finds the slots its clients had (they wait
        ``resume_grace_s`` for their client to hand the ring back) and the group owners."""
        shm = host.shm
        name = self.segment_name = clients_name(self.config.name, qualifier)
        mode = self.config.arena_mode
        try:
            fd = take_segment(host, name, self.config.name)
        except Unusable as exc:
            moved = set_aside(host, name, str(exc))
            log.error("client table %s set aside as %s because %s", name, moved, exc)
            fd = None
        self.created = fd is None
        if fd is None:
            fd = create_segment(host, name, mode)
        try:
            self.identity = file_identity(shm, fd)
            if shm.fstat(fd).st_size != CL.SEGMENT_BYTES:
                shm.ftruncate(fd, 0)
                shm.ftruncate(fd, CL.SEGMENT_BYTES)
            shm.fchmod(fd, mode)
            self._segment = shm.map(fd, name, CL.SEGMENT_BYTES)  # keeps the segment lock
            self._buf = self._segment.buf
        finally:
            shm.close(fd)
        hand_to_monitors(self.config, host, name)
        buf = self._buf
        magic, arena_created = CL.HEADER.unpack_from(buf, 0)
        if magic != CL.MAGIC or arena_created != wheel.created_wall_ms:
            buf[: CL.SEGMENT_BYTES] = bytes(CL.SEGMENT_BYTES)  # another arena's table (or none)
            CL.HEADER.pack_into(buf, 0, CL.MAGIC, wheel.created_wall_ms)
            if _live(wheel):  # rebuilt from a journal: what rings replayed into it may hold already
                self.armings_at_start = ArmingsAtStart(wheel)
                self.armings_until = now + int(self.config.resume_grace_s * 1000)
            return
        self._restore(wheel, now)
        # A restart on an arena rebuilt less than --resume-grace-s ago: rings of the lost arena
        # may still come back, replayed (the daemon that rebuilt it died before they did)
        grace_ms = int(self.config.resume_grace_s * 1000)
        young_ms = grace_ms - (host.wall_ms() - wheel.created_wall_ms)
        if _live(wheel) and 0 < young_ms <= grace_ms:
            self.armings_at_start = ArmingsAtStart(wheel)
            self.armings_until = now + young_ms

    def _restore(self, wheel, now: int) -> None:
        for slot in range(CL.MAX_CLIENTS):
            in_use, group, pid, uid, _depth, _capacity, raw = CL.ENTRY.unpack_from(self._buf, CL.entry_offset(slot))
            if not in_use:
                continue
            label = raw.rstrip(b"\0").decode("utf-8", "replace")
            cs = ClientSlot(slot, None, label, group, wheel.group_name(group), pid, uid)
            cs.orphan_since = now
            self.clients[slot] = cs
            self.by_label[label] = cs
            log.info("client slot %d (pid %d, group %s): waiting up to %.0f s for its client to hand ring %s back",
                     slot, pid, cs.group_name, self.config.resume_grace_s, label)
        if self.clients:
            armings = ArmingsAtStart(wheel, {cs.group for cs in self.clients.values()})
            for cs in self.clients.values():
                cs.replay_guard = armings
                cs.replay_left = 1  # a killed daemon leaves one chunk unpublished: the first

    # ------------------------------------------------------------------ slots
    def forget_armings_at_start(self, now: int) -> None:
        """Called now and then: the armings of a rebuilt arena are dropped once the clients
        away are no longer waited for (a ring handed back later is replayed unguarded)."""
        if self.armings_at_start is not None and now >= self.armings_until:
            self.armings_at_start = None

    def add(self, cs: ClientSlot, replayed: bool = False, handed_back: bool = False) -> None:
        """A new slot; ``handed_back``: its ring comes from a daemon that is gone; ``replayed``:
        that daemon had another arena (this one was rebuilt from the journal) and the ring
        is replayed from the client's last acknowledged flush.

        A ring handed back is guarded by the armings this arena held when this daemon
        started (ArmingsAtStart), while the arena is younger than ``--resume-grace-s``
        (taken by the daemon that rebuilt it, and again by a daemon restarted on it within
        that time): a replayed one over the whole replayed range, any other over its first
        chunk, which the last daemon may have applied and journaled before it was killed,
        short of publishing the ring's head past it (as ``_restore`` guards the slots a
        restarted daemon finds)."""
        self.clients[cs.slot] = cs
        self.by_label[cs.label] = cs
        if (replayed or handed_back) and self.armings_at_start is not None and cs.segment is not None:
            cs.replay_guard = self.armings_at_start
            cs.replay_left = cs.segment.depth() if replayed else 1

    def remove(self, cs: ClientSlot) -> None:
        del self.clients[cs.slot]
        self.by_label.pop(cs.label, None)
        self.write_entry(cs.slot, None)

    def write_entry(self, slot: int, cs: ClientSlot | None) -> None:
        if cs is None:
            CL.ENTRY.pack_into(self._buf, CL.entry_offset(slot), 0, 0, 0, 0, 0, 0, b"")
            return
        capacity = cs.segment.ring_capacity if cs.segment is not None else 0
        CL.ENTRY.pack_into(self._buf, CL.entry_offset(slot), 1, cs.group, cs.pid, cs.uid, 0, capacity,
                           cs.label.encode("utf-8")[:104])

    def write_depths(self) -> None:
        """Ring depths for wheelctl (rings are memfds it cannot map)."""
        for cs in self.clients.values():
            if cs.segment is not None and not cs.poisoned:
                try:
                    depth = cs.segment.depth()
                except ProtocolError:
                    continue
                CL.DEPTH.pack_into(self._buf, CL.entry_offset(cs.slot) + CL.DEPTH_OFFSET, depth)

    @property
    def limit(self) -> int:
        """How many client slots there are (``--max-clients``, at most the table's)."""
        return min(self.config.max_clients, CL.MAX_CLIENTS)

    def free_slot_number(self, previous_label: str) -> int | None:
        """A free client slot: the one the label names when free (a ring from before a
        reboot keeps its slot, and so its arming tags), else the next one round robin."""
        limit = self.limit
        prefix = segment_prefix(self.config.name)
        if previous_label.startswith(prefix):
            wanted = previous_label[len(prefix):].partition("-")[0]
            if wanted.isdigit() and int(wanted) < limit and int(wanted) not in self.clients:
                return int(wanted)
        for offset in range(limit):
            slot = (self._next_slot + offset) % limit
            if slot not in self.clients:
                self._next_slot = slot + 1
                return slot
        return None

    # ------------------------------------------------------------------ group owners
    def group_owner(self, group_name: str, group: int | None) -> tuple[int, int] | None:
        """(kind, id) of whoever owns a group: ``--group-owner``, else the first uid that
        joined it (kept in the client table), else nobody yet."""
        static = self._static_owners.get(group_name)
        if static is not None:
            return static
        if group is None:
            return None
        kind, ident = CL.OWNER.unpack_from(self._buf, CL.owner_offset(group))
        return None if kind == CL.OWNER_NONE else (kind, ident)

    def static_owner(self, group_name: str) -> bool:
        """Does ``--group-owner`` name this group's owner?"""
        return group_name in self._static_owners

    def groups_owned_by(self, uid: int, max_groups: int) -> int:
        """How many of the first ``max_groups`` group ids ``uid`` owns (joined first)."""
        owners = np.frombuffer(self._buf, dtype=np.uint32, count=2 * max_groups, offset=CL.OWNERS_OFFSET)
        return int(np.count_nonzero((owners[0::2] == CL.OWNER_UID) & (owners[1::2] == uid)))

    def claim(self, group_name: str, group: int, uid: int) -> bool:
        """Record ``uid`` as the owner of a group nobody owns (not one ``--group-owner`` names)."""
        if group_name in self._static_owners:
            return False
        if CL.OWNER.unpack_from(self._buf, CL.owner_offset(group))[0] != CL.OWNER_NONE:
            return False
        CL.OWNER.pack_into(self._buf, CL.owner_offset(group), CL.OWNER_UID, uid)
        return True

    def forget_owner(self, group: int) -> None:
        CL.OWNER.pack_into(self._buf, CL.owner_offset(group), CL.OWNER_NONE, 0)
