"""Sessions: who is connected, who may join which group, and the client slots.

A client connects to the Unix socket and sends ``Hello`` (protocol version,
group). The daemon checks it (the allow-lists, the group's owner), records its
SO_PEERCRED, gives it a client slot and a ring (a sealed memfd, or the ring it
handed back) and answers ``Welcome`` with a resume *token*. The socket then
carries ``Doorbell`` frames one way and ``Expirations``/``Applied``/``Rejected``
frames the other (:mod:`wheeld.daemon.connection`).

A client's slot outlives its session: its ring is drained until it is empty,
the daemon goes on reading its touch table for the idle timers that refer to it
(a client that lost its connection touches on, and comes back to its slot by
presenting its token), and a client reconnecting after a daemon restart resumes
its slot the same way. A slot whose client is gone for good is freed: at once
after a ``Bye``, else ``resume_grace_s`` after its session ended. Its idle timers
then become plain timers at the deadline its last touch gave them (``last touch
+ idle``, never sooner than they were due), so that no slot, and no ring or touch
table, is held by timers alone. The client table (``/wheeld-NAME-clients``) keeps
the slots and the group owners across daemon restarts. Orphaned slots are
collected every ``GC_INTERVAL_MS``, idle groups reclaimed with them.

Bounds per uid (root and the daemon's own uid have none: they can write the
arena anyway): ``clients_per_uid`` client slots, the slots of its clients that
left without a ``Bye`` and may still come back included; ``groups_per_uid``
groups it owns (the groups it was the first to join that are still in use).
"""

from __future__ import annotations

import collections
import hmac
import logging
import os

import numpy as np

from wheeld.protocol import arena_layout as AL
from wheeld.protocol import clients_layout as CL
from wheeld.protocol import messages as M
from wheeld.protocol.errors import ArenaFull, GroupLimit, InvalidRequest, ProtocolError
from wheeld.protocol.keys import decode_key
from wheeld.shm.ring import MAX_IDLE_MS, ClientSegment
from wheeld.shm.wheel import MAX_DELAY_MS

from .client_table import ClientSlot, ClientTable
from wheeld.protocol.naming import segment_prefix
from .connection import Session

log = logging.getLogger("wheeld")

MAINTAIN_S = 1.0  # period of the bookkeeping timer (frame and ack timeouts, accept pauses)
GC_INTERVAL_MS = 2000  # orphaned client slots and idle groups are looked for this often
DEMAND_COLLECT_MS = 250  # ...and, for a Hello that needs a slot, at most this often
# The longest delay a client may ask for: the wheel takes deadlines up to MAX_DELAY_MS past
# its own clock, which lags real time by up to a park; a day of margin means a delay the
# client accepted is never refused later (at flush) for being a few ms too far out.
CLIENT_MAX_DELAY_MS = MAX_DELAY_MS - 86_400_000
_LOG_EVERY_S = 1.0  # a repeated warning is logged at most this often, with a count


class Sessions:
    """The connections, the client slots and who may use what.

    ``daemon`` is the core (:class:`wheeld.daemon.core.DaemonCore`): its ``host`` (the
    clock, the user database, randomness, the daemon's uid), ``clock()``, ``wake()``,
    ``soft_wake()``, ``arena_busy()``, ``stopping`` and ``shell`` (to resume a paused
    accept); after the arena is open, :meth:`attach` and :meth:`serve` hand over what a
    session works with. Connections come from the shell (:meth:`connected`) with
    their :class:`~wheeld.daemon.host.Transport`."""

    def __init__(self, config, totals: dict, daemon):
        self.config = config
        self.totals = totals
        self.daemon = daemon
        self.host = daemon.host
        self.clients: dict[int, ClientSlot] = {}  # client slot -> ClientSlot (shared with delivery, executor)
        # the open connections, in the order they came (a dict: every pass over them is in
        # that order, whatever their hashes: a simulated run replays exactly)
        self.sessions: dict[Session, None] = {}
        self.table = ClientTable(config, self.clients)
        self._handshaking: collections.Counter = collections.Counter()  # uid -> sessions before Hello
        self._groups_of_uid: dict[int, tuple[float, frozenset[int]]] = {}
        self._log_limiter = _LogLimiter(self.now_s)
        self._last_ack_rotation = 0.0
        self._last_collect = 0
        self._last_demand_collect = -DEMAND_COLLECT_MS
        self._last_demand_reclaim = -DEMAND_COLLECT_MS
        self._full_groups: set[int] = set()  # groups at --group-quota (their members were told)
        self.wheel = self.delivery = self.executor = self.status = self.recorder = None
        self.arena_epoch = 0
        self.secret = b""

    def attach(self, wheel, delivery, executor, arena_epoch: int, recorder=None) -> None:
        """What sessions work with once the arena is open."""
        self.wheel, self.delivery, self.executor = wheel, delivery, executor
        self.arena_epoch, self.recorder = arena_epoch, recorder

    def serve(self, status, secret: bytes) -> None:
        """What a Welcome hands out: the status page, and resume tokens under the instance secret."""
        self.status, self.secret = status, secret

    def now_s(self) -> float:
        """The core's clock, in seconds (timeouts of frames, handshakes and acks)."""
        return self.host.clock_ms() / 1000

    @property
    def clients_per_uid(self) -> int:
        """Client slots one uid may hold (0: no bound); by default a quarter of them."""
        limit = self.config.clients_per_uid
        return max(1, self.table.limit // 4) if limit is None else limit

    @property
    def groups_per_uid(self) -> int:
        """Groups one uid may own (0: no bound); by default a quarter of the arena's group ids."""
        limit = self.config.groups_per_uid
        return max(1, self.wheel.max_groups // 4) if limit is None else limit

    def wake(self) -> None:
        self.daemon.wake()

    def arena_busy(self) -> None:
        self.daemon.arena_busy()

    def connected_clients(self) -> int:
        return sum(1 for s in self.sessions if s.client is not None)

    # ------------------------------------------------------------------ accept
    def connected(self, transport, pid: int, uid: int, gid: int) -> Session | None:
        """A connection the shell accepted, with its peer's credentials (SO_PEERCRED; -1
        when unknown): its session, or None when it was closed at once (the uid has
        ``max_handshakes_per_uid`` connections without a Hello already)."""
        if self._handshaking[uid] >= self.config.max_handshakes_per_uid:
            self._log_limiter.warning("handshakes", "uid %d has %d connections without a Hello; closing more",
                                      uid, self._handshaking[uid])
            self.totals["clients_refused_total"] += 1
            transport.close()
            return None
        self._handshaking[uid] += 1
        session = Session(self, transport, pid, uid, gid, self.now_s())
        self.sessions[session] = None
        return session

    def accept_paused(self, error: str) -> None:
        """The shell stopped accepting (out of descriptors) until a session closes or a second passed."""
        self.totals["accept_pauses_total"] += 1
        self._log_limiter.error("accept-paused", "accept paused: %s (%d sessions); resuming when a session closes "
                                "or in %.0f s", error, len(self.sessions), MAINTAIN_S)

    def _refuse(self, session: Session, reason: str, code: str) -> None:
        log.warning("refusing client pid %d uid %d: %s", session.pid, session.uid, reason)
        self.totals["clients_refused_total"] += 1
        session.send(M.encode_daemon_frame(M.Refused(reason, code)))
        self.close(session, reason)

    def on_message(self, session: Session, message) -> None:
        if type(message) is M.Doorbell:
            if message.urgent or not self.config.coalesce_us:
                self.wake()
            else:
                self.daemon.soft_wake()
            return
        if type(message) is M.Hello:
            if session.client is not None:
                raise ProtocolError("Hello sent twice")
            fd = session.passed_fds.pop(0) if session.passed_fds else None
            try:
                if session.transport.peer_gone():
                    # it gave up waiting for the Welcome (its connection waited in the listen
                    # backlog while the daemon restarted) and tries again on another one:
                    # adopting its ring here would only log a join and a "Broken pipe"
                    if fd is not None:
                        os.close(fd)
                    self.close(session, "the client gave up before its Hello was answered", quiet=True)
                    return
                self._hello(session, message, fd)
            finally:
                session.close_passed_fds()
            return
        if session.client is None:
            raise ProtocolError(f"{type(message).__name__} before Hello")
        if type(message) is M.Bye:
            cs = session.client
            self.close(session, "client said bye")
            if cs is not None:
                cs.said_bye = True  # it will not come back for this ring
                cs.orphan_since = -GC_INTERVAL_MS  # a clean goodbye: release its ring at the next check
                self._last_collect = 0
            return
        raise ProtocolError(f"unexpected {type(message).__name__}")

    # ------------------------------------------------------------------ who may do what
    def _privileged(self, session: Session) -> bool:
        """Root and the daemon's own uid may use any group (they can read the arena anyway)."""
        return session.uid == 0 or session.uid == self.host.euid

    def _gids_of(self, session: Session) -> frozenset[int]:
        """The peer's primary gid and the supplementary groups of its user (SO_PEERCRED
        carries only the primary one), cached for a minute."""
        now = self.now_s()
        cached = self._groups_of_uid.get(session.uid)
        if cached is None or now - cached[0] > 60:
            cached = self._groups_of_uid[session.uid] = (now, self.host.users.groups_of(session.uid, session.gid))
        return cached[1] | {session.gid}

    def _allowed(self, session: Session) -> bool:
        cfg = self.config
        if self._privileged(session):
            return True
        if cfg.allowed_uids is None and cfg.allowed_gids is None:
            return True
        if cfg.allowed_uids is not None and session.uid in cfg.allowed_uids:
            return True
        return cfg.allowed_gids is not None and not cfg.allowed_gids.isdisjoint(self._gids_of(session))

    def _may_join(self, session: Session, owner: tuple[int, int] | None) -> bool:
        if owner is None or self._privileged(session):
            return True
        kind, ident = owner
        if kind == CL.OWNER_UID:
            return session.uid == ident
        return ident in self._gids_of(session)

    def _claim(self, session: Session, group_name: str, group: int) -> None:
        if not self._privileged(session) and self.table.claim(group_name, group, session.uid):
            log.info("group %r (id %d) now belongs to uid %d", group_name, group, session.uid)

    def _over_group_bound(self, session: Session, name: str, owner) -> str | None:
        """Why joining group ``name`` would take this uid past ``groups_per_uid``, or None.
        Only a group the uid would come to own counts (a new one, or one nobody owns)."""
        limit = self.groups_per_uid
        if not limit or owner is not None or self._privileged(session) or self.table.static_owner(name):
            return None
        held = self.table.groups_owned_by(session.uid, self.wheel.max_groups)
        if held < limit:
            return None
        now = self.daemon.clock()
        if now - self._last_demand_reclaim >= DEMAND_COLLECT_MS:  # groups of its that went idle since the
            self._last_demand_reclaim = now                        # last periodic pass (not for every Hello)
            self.reclaim_groups()
            held = self.table.groups_owned_by(session.uid, self.wheel.max_groups)
            if held < limit:
                return None
        return (f"uid {session.uid} owns {held} groups, its limit (--groups-per-uid, {limit}): a group is given up "
                f"once it has no member and nothing pending; use fewer group names")

    # ------------------------------------------------------------------ the handshake
    def _hello(self, session: Session, hello: M.Hello, fd: int | None) -> None:
        """Open a session: checks, the group, the ring (resumed, adopted or new), Welcome.
        ``fd`` is the ring the client handed back, if any; it is consumed or closed."""
        passed = _Passed(fd)
        try:
            admitted = self._admit(session, hello, passed)
        finally:
            passed.close()
        if admitted is None:
            return
        cs, resumed = admitted
        self._handshaking[session.uid] -= 1
        cs.pid = session.pid
        cs.said_bye = False
        cs.session = session
        session.client = cs
        self.table.write_entry(cs.slot, cs)
        self.delivery.members[cs.group].append(session)
        self.totals["clients_total"] += 1
        cs.segment.set_group_full(cs.group in self._full_groups)
        self._welcome(session, cs, resumed)
        log.info("client pid %d uid %d joined group %r (slot %d, ring %s%s)", session.pid, session.uid, hello.group,
                 cs.slot, cs.label, ", handed back" if resumed else "")
        self.wake()

    def _welcome(self, session: Session, cs: ClientSlot, resumed: bool) -> None:
        status = self.status.readonly_fd
        welcome = M.Welcome(
            M.PROTOCOL_VERSION, cs.slot, cs.label, cs.segment.ring_capacity, cs.segment.touch_capacity,
            self.wheel.name or "", self.wheel.tick_ms, CLIENT_MAX_DELAY_MS, self._token(cs.slot, cs.label),
            self.arena_epoch, status is not None, resumed, cs.segment.consumer_head,
        )
        session.send_with_fds(M.encode_daemon_frame(welcome),
                              [cs.segment.fd] + ([status] if status is not None else []))

    def _admit(self, session: Session, hello: M.Hello, passed: _Passed) -> tuple[ClientSlot, bool] | None:
        """The checks of a Hello and (the client slot it gets, whether the ring it handed
        back is that slot's ring), or None when it is refused."""
        if hello.protocol_version != M.PROTOCOL_VERSION:
            self._refuse(session, f"protocol version {hello.protocol_version} not supported (this daemon speaks "
                                  f"{M.PROTOCOL_VERSION}); upgrade the client library", M.Refused.VERSION)
            return None
        if not self._allowed(session):
            self._refuse(session, f"uid {session.uid} gid {session.gid} is not allowed to use this wheeld",
                         M.Refused.NOT_ALLOWED)
            return None
        group = self._join_group(session, hello.group)
        if group is None:
            return None
        if passed.fd is not None:
            cs = self._resumed_slot(session, hello, group, passed)
            if cs is not None:
                return cs, True
            if hello.resume_segment in self.table.by_label:
                passed.close()  # a ring this daemon knows, not proven to be the caller's: never adopted
        return self._new_slot(session, hello, group, passed)

    def _join_group(self, session: Session, name: str) -> int | None:
        """The id of group ``name`` for this session (made if new), or None when refused."""
        try:
            existing = self.wheel.group_id(name, create=False)
        except KeyError:
            existing = None
        except InvalidRequest as exc:
            self._refuse(session, str(exc), M.Refused.BAD_REQUEST)
            return None
        owner = self.table.group_owner(name, existing)
        if not self._may_join(session, owner):
            kind = "uid" if owner[0] == CL.OWNER_UID else "group id"
            self._refuse(session, f"group {name!r} belongs to {kind} {owner[1]}; uid {session.uid} may not "
                                  f"join it", M.Refused.NOT_ALLOWED)
            return None
        over = self._over_group_bound(session, name, owner)
        if over is not None:
            self._refuse(session, over, M.Refused.GROUP_LIMIT)
            return None
        try:
            try:
                group = existing if existing is not None else self.wheel.group_id(name)
            except GroupLimit:
                self.reclaim_groups()  # groups that went idle since the last periodic pass
                group = self.wheel.group_id(name)
        except ArenaFull as exc:
            self._refuse(session, f"{exc}: groups with no member and nothing pending are reclaimed; use fewer "
                                  f"group names or a larger --max-groups", M.Refused.GROUP_LIMIT)
            return None
        self._claim(session, name, group)
        return group

    def _new_slot(self, session: Session, hello: M.Hello, group: int,
                  passed: _Passed) -> tuple[ClientSlot, bool] | None:
        """A free slot with a new ring, or with the ring handed back when it comes from a
        daemon that is gone (a reboot): its commands are still to apply."""
        cfg = self.config
        over = self._over_slot_bound(session)
        if over is not None:
            self._refuse(session, over, M.Refused.BUSY)
            return None
        slot = self.table.free_slot_number(hello.resume_segment)
        now = self.daemon.clock()
        if slot is None and now - self._last_collect >= DEMAND_COLLECT_MS:
            self._last_collect = now  # slots whose client is gone for good, freed now (not for every Hello)
            self.collect_orphans(now)
            slot = self.table.free_slot_number(hello.resume_segment)
        if slot is None:
            self._refuse(session, f"too many clients: all {self.table.limit} client slots are in use (--max-clients)",
                         M.Refused.BUSY)
            return None
        label = f"{segment_prefix(cfg.name)}{slot}-{self.host.rng.token_hex(4)}"
        segment, replay = None, False
        if passed.fd is not None:
            # ...from the client's last acknowledged flush on when that daemon had another arena:
            # it may have applied some of them without making them durable before the power cut
            replay = bool(hello.replay_epoch) and hello.replay_epoch != self.arena_epoch
            try:
                segment = ClientSegment.adopt(passed.take(), label, cfg.ring_capacity, cfg.touch_capacity,
                                              rewind_to=hello.replay_from if replay else None)
            except ProtocolError as exc:
                log.warning("client pid %d handed back an unusable ring (%s); it gets a new one", session.pid, exc)
        resumed = segment is not None
        if segment is None:
            try:
                segment = ClientSegment.create(label, cfg.ring_capacity, cfg.touch_capacity)
            except OSError as exc:  # out of descriptors (EMFILE) or memory: no ring for anyone right now
                self._refuse(session, f"cannot make a ring now: {exc.strerror}", M.Refused.BUSY)
                return None
        cs = ClientSlot(slot, segment, label, group, hello.group, session.pid, session.uid)
        self.table.add(cs, replayed=resumed and replay, handed_back=resumed)
        return cs, resumed

    def _over_slot_bound(self, session: Session) -> str | None:
        """Why a new slot for this uid would take it past ``clients_per_uid``, or None."""
        limit = self.clients_per_uid
        if not limit or self._privileged(session):
            return None
        mine = [cs for cs in self.clients.values() if cs.uid == session.uid]
        if len(mine) < limit:
            return None
        self.collect_orphans(self.daemon.clock(), session.uid)  # those of its clients that are gone for good
        mine = [cs for cs in self.clients.values() if cs.uid == session.uid]
        if len(mine) < limit:
            return None
        away = sum(1 for cs in mine if cs.session is None)
        return (f"uid {session.uid} holds {len(mine)} client slots, its limit (--clients-per-uid, {limit}); {away} of "
                f"them wait for a client that left without a Bye (freed {self.config.resume_grace_s:g} s after it "
                f"left)")

    def _resumed_slot(self, session: Session, hello: M.Hello, group: int, passed: _Passed) -> ClientSlot | None:
        """The slot a reconnecting client had, if its token proves it and the ring it handed
        back is that slot's ring (this daemon's, or one to adopt after a restart)."""
        cs = self.table.by_label.get(hello.resume_segment)
        if (cs is None or cs.poisoned or cs.group != group or cs.uid != session.uid
                or not hmac.compare_digest(self._token(cs.slot, cs.label).to_bytes(8, "little"),
                                           hello.resume_token.to_bytes(8, "little"))):
            return None
        if cs.segment is not None:  # this daemon still drains it: the client lost its connection
            if not cs.segment.same_file(passed.fd):
                return None
            if cs.session is not None:  # we have not noticed yet: the token and the ring prove it is gone
                self.close(cs.session, "the client reconnected")
            return cs
        try:
            cs.segment = ClientSegment.adopt(passed.take(), cs.label, self.config.ring_capacity,
                                             self.config.touch_capacity)
        except ProtocolError as exc:
            log.warning("client slot %d: the ring handed back is unusable (%s)", cs.slot, exc)
            self.release_slot(cs)
            return None
        return cs

    def _token(self, slot: int, label: str) -> int:
        """The resume token of a slot: an HMAC under the instance secret, never stored."""
        digest = hmac.new(self.secret, f"{slot}:{label}".encode(), "sha256").digest()
        return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)

    # ------------------------------------------------------------------ the end of a session
    def close(self, session: Session, reason: str, goodbye: bool = False, resume: bool = False,
              quiet: bool = False) -> None:
        if session.closed:
            return
        self.arena_busy()
        if goodbye:
            try:
                session.transport.send(M.encode_daemon_frame(M.Goodbye(reason[:200] or "closed")))
            except OSError:
                pass
        session.closed = True
        session.close_passed_fds()
        self.sessions.pop(session, None)
        session.transport.close()
        self.daemon.shell.resume_accept()
        cs = session.client
        if cs is None:
            self._handshaking[session.uid] -= 1
            if self._handshaking[session.uid] <= 0:
                del self._handshaking[session.uid]
            log.log(logging.DEBUG if quiet else logging.INFO, "connection from pid %d closed before the handshake: %s",
                    session.pid, reason)
            return
        log.info("client pid %d (slot %d, group %s) left: %s", session.pid, cs.slot, cs.group_name, reason)
        members = self.delivery.members.get(cs.group)
        if members and session in members:
            members.remove(session)
        cs.session = None
        cs.orphan_since = self.daemon.clock()
        if not cs.poisoned and not resume:
            self._apply_what_it_left(cs)
        self.delivery.requeue(cs.take_unacked(), cs.group)
        self.wake()

    def _apply_what_it_left(self, cs: ClientSlot) -> None:
        """Apply what a departed client left in its ring (its acks) before what was sent to it
        goes back to its group: the whole ring, not one drain's worth (a ring replayed after a
        reboot can hold more), at most its capacity (a live client cannot keep it going)."""
        budget = cs.segment.ring_capacity if cs.segment is not None else 0
        while budget > 0 and not cs.poisoned and cs.segment is not None:
            applied = self.executor.apply_ring(cs)
            if not applied:
                return
            budget -= applied

    def poison(self, cs: ClientSlot, reason: str) -> None:
        log.warning("client slot %d (pid %d): %s; disconnecting it, its group's timers stay", cs.slot, cs.pid, reason)
        cs.poisoned = True
        self.totals["clients_dropped_total"] += 1
        if cs.session is not None:
            self.close(cs.session, reason, goodbye=True)

    # ------------------------------------------------------------------ orphans and idle groups
    def maybe_collect(self, now: int) -> None:
        """Every ``GC_INTERVAL_MS`` (sooner after a Bye): :meth:`collect_orphans`."""
        if now - self._last_collect >= GC_INTERVAL_MS:
            self._last_collect = now
            self.collect_orphans(now)

    def collect_orphans(self, now: int, uid: int | None = None) -> None:
        """Forget client slots whose client is gone for good (:meth:`_collectable`), and
        reclaim idle groups. With ``uid`` (a Hello that needs a slot), only that uid's
        slots, at most every ``DEMAND_COLLECT_MS``, and no groups: each pass looks at
        every record of the arena once, which a stream of Hellos must not repeat."""
        if uid is not None:
            if now - self._last_demand_collect < DEMAND_COLLECT_MS:
                return
            self._last_demand_collect = now
        orphans = [cs for cs in self.clients.values() if cs.session is None and (uid is None or cs.uid == uid)
                   and now - cs.orphan_since >= GC_INTERVAL_MS]
        if orphans:
            idle = _IdleTimers(self.wheel)
            for cs in orphans:
                if self._collectable(cs, now, idle):
                    self.release_slot(cs, idle)
        if uid is None:
            self.reclaim_groups()

    def _collectable(self, cs: ClientSlot, now: int, idle: _IdleTimers) -> bool:
        """Is this orphaned slot's client gone for good? A poisoned one at once; one that
        said Bye once its ring is drained; any other once its ring is drained and no
        idle timer refers to its touch table, or ``resume_grace_s`` after it left (a
        ring still written to by then is not waited for). A slot found in the table at
        start, whose ring only its client can hand back, as soon as its process is
        gone (``Host.process_alive``: it died while no daemon ran)."""
        grace_over = now - cs.orphan_since >= self.config.resume_grace_s * 1000
        if cs.segment is None:
            if not grace_over:
                if self.host.process_alive(cs.pid):
                    return False
                log.warning("client slot %d: its process (pid %d) is gone; its ring is forgotten", cs.slot, cs.pid)
                return True
            log.warning("client slot %d (pid %d) did not come back within %.0f s; its ring is forgotten",
                        cs.slot, cs.pid, self.config.resume_grace_s)
            return True
        if cs.poisoned or grace_over:
            return True
        try:
            if cs.segment.depth():
                return False
        except ProtocolError:
            pass
        return cs.said_bye or not idle.of(cs.slot).size

    def release_slot(self, cs: ClientSlot, idle: _IdleTimers | None = None) -> None:
        """Forget a client slot (the slot may be given to another client). Idle timers
        that still refer to its touch table become plain timers (:meth:`_settle_idle_timers`);
        fired records sent to its client no longer name it, and those held for it since a
        restart go to its group (:meth:`Delivery.release_held
        <wheeld.daemon.delivery.Delivery.release_held>`)."""
        idle = idle or _IdleTimers(self.wheel)
        mine = idle.of(cs.slot)
        if mine.size:
            self._settle_idle_timers(cs, mine)
        sent = idle.sent_to(cs.slot)
        if sent.size:  # before the table forgets the slot: no record names a freed slot
            self.wheel.mark_fired(sent.tolist(), -1)
        moved = self.delivery.release_held(cs.slot)
        if moved:
            log.info("client slot %d: %d expirations it was sent before the restart go to group %s", cs.slot, moved,
                     cs.group_name)
        log.info("client slot %d (pid %d) released", cs.slot, cs.pid)
        if cs.segment is not None:
            cs.segment.close()
        self.table.remove(cs)

    def _settle_idle_timers(self, cs: ClientSlot, mine: np.ndarray) -> None:
        """The idle timers (records ``mine``) that refer to this slot's touch table become
        plain timers at the deadline the table gives them: ``last touch + idle_ms`` when
        that is later than their deadline (the re-arm :meth:`Delivery.idle_check
        <wheeld.daemon.delivery.Delivery.idle_check>` would make when they come due),
        else their deadline. A table that holds impossible values for a timer (the
        values idle_check poisons a client for), or none at all (a slot still waiting
        for its client after a restart), or a poisoned client's, leaves the deadline.
        The pending ones are journaled as the plain timers they now are
        (:func:`_journal_settled`)."""
        wheel, rec = self.wheel, self.wheel.records
        moved = 0
        pending = mine[(rec["state"][mine] & AL.STATE_MASK) == AL.SCHEDULED]
        before = rec["deadline"][pending].astype(np.int64)
        after = before.copy()
        recorder = self.recorder if pending.size else None
        if recorder is not None:
            recorder.begin()  # the records change ahead of the journal until the commit
        if cs.segment is not None and not cs.poisoned:
            index = rec["aux"][pending].astype(np.int64) & CL.TOUCH_INDEX_MASK
            inside = index < cs.segment.touch_capacity
            slots, index = pending[inside], index[inside]
            touched = np.frombuffer(cs.segment._last_touch, dtype=np.int64)[index]
            idle_ms = np.frombuffer(cs.segment._idle, dtype=np.int64)[index]
            # the clock after the words were read (copied): a touch the client stored
            # meanwhile is not taken for one from the future
            now = max(wheel.current_ms, self.daemon.clock())
            # ClientSegment.read_activity's checks, for many: 0 in either word is "no activity"
            sound = (touched > 0) & (touched <= now + 1) & (idle_ms > 0) & (idle_ms <= MAX_IDLE_MS)
            deadlines = rec["deadline"][slots]
            settle_at = np.where(sound, touched + np.where(sound, idle_ms, 0), 0)
            later = sound & (settle_at > deadlines)
            moved = int(np.count_nonzero(later))
            if moved:
                # re-arms: each key is armed, so no new record (key, group and tag unchanged)
                wheel.schedule_many(wheel._idents[slots[later]], settle_at[later],
                                    rec["group"][slots[later]].astype(np.int64),
                                    rec["tag"][slots[later]].astype(np.int64))
                after[np.flatnonzero(inside)[later]] = settle_at[later]
        rec["aux"][mine] = -1
        if recorder is not None:
            _journal_settled(self.wheel, recorder, pending, before, after, self.daemon.clock())
        log.info("client slot %d: %d idle timers become plain timers (%d of them at last touch + idle time)",
                 cs.slot, int(mine.size), moved)

    def reclaim_groups(self) -> None:
        """Free the id of every group with no member, no client slot, nothing queued and
        no live record (and forget its owner): the id can go to a new name. Without this
        each group name ever used would hold one of the arena's ids for good."""
        members, queues = self.delivery.members, self.delivery.queues
        keep = {cs.group for cs in self.clients.values()}
        keep.update(gid for gid, sessions in members.items() if sessions)
        keep.update(gid for gid, queue in queues.items() if queue)
        wheel = self.wheel
        forget = self.recorder.forget_group if self.recorder is not None else wheel.forget_group
        for gid in list(wheel.groups()):
            if gid and gid not in keep and wheel.group_live(gid) == 0 and forget(gid):
                self.table.forget_owner(gid)
                members.pop(gid, None)
                queues.pop(gid, None)
                self.totals["groups_reclaimed_total"] += 1

    def publish_group_full(self) -> None:
        """Tell the members of a group at its quota (their ``add`` raises QuotaExceeded at
        once), and those of a group back under it; written on changes only."""
        quota, live, members = self.config.group_quota, self.wheel.group_live, self.delivery.members
        full = {gid for gid, sessions in members.items() if sessions and live(gid) >= quota}
        for gid in full ^ self._full_groups:
            for session in members.get(gid, ()):
                session.client.segment.set_group_full(gid in full)
        self._full_groups = full

    # ------------------------------------------------------------------ bookkeeping, once a second
    def maintain(self) -> None:
        """Hellos that never come, frames that never complete, expirations nobody acknowledges."""
        self.arena_busy()
        now = self.now_s()
        hello_timeout = self.config.handshake_timeout_s
        for session in [s for s in self.sessions if s.client is None and now - s.opened_s > hello_timeout]:
            self.close(session, "no Hello within the handshake timeout", goodbye=True)
        timeout = self.config.frame_timeout_s
        for session in [s for s in self.sessions if s.partial_since and now - s.partial_since > timeout]:
            self.close(session, f"a frame stayed incomplete for more than {timeout:g} s", goodbye=True)
        ack_timeout = self.config.ack_timeout_s
        for session in [s for s in self.sessions if s.stalled(now, ack_timeout)]:
            self.close(session, f"it has not read its socket: what it was sent {ack_timeout:g} s ago is still unread "
                                f"({len(session.out)} bytes queued)")
        self.table.write_depths()
        if now - self._last_ack_rotation >= self.config.ack_timeout_s / 2:
            self._last_ack_rotation = now
            self._rotate_unacked()

    def _rotate_unacked(self) -> None:
        """Whatever a client left unacknowledged for ``ack_timeout_s / 2 .. ack_timeout_s``
        is sent again, to any member of its group (the client library drops a repeat it
        already handed over), and counted."""
        for cs in self.clients.values():
            overdue = list(cs.unacked_old.items())
            cs.unacked_old, cs.unacked = cs.unacked, {}
            if overdue:
                self.totals["ack_timeouts_total"] += len(overdue)
                self._log_limiter.warning(
                    "ack-timeout", "client slot %d (pid %d, group %s) left %d expirations unacknowledged for over "
                    "%g s; they are sent again", cs.slot, cs.pid, cs.group_name, len(overdue),
                    self.config.ack_timeout_s / 2)
                self.delivery.requeue(overdue, cs.group)
        self.wake()


class _IdleTimers:
    """The arena's live idle timers by the client slot whose touch table they refer to,
    and its fired records by the client slot they were sent to (the aux word, see
    ``arena_layout.recipient_aux``), each looked up on first use (one pass over the
    records' aux and state columns)."""

    def __init__(self, wheel):
        self.wheel = wheel
        self._records = self._owners = None
        self._sent = self._recipients = None

    def sent_to(self, client_slot: int) -> np.ndarray:
        """The record slots of the fired records whose aux names ``client_slot`` as their recipient."""
        if self._sent is None:
            rec, first = self.wheel.records, self.wheel.first_entry
            aux = rec["aux"][first:]
            sent = np.flatnonzero((aux <= AL.RECIPIENT_AUX_BASE) & ((rec["state"][first:] & AL.STATE_MASK) == AL.FIRED))
            self._sent = sent + first
            self._recipients = AL.RECIPIENT_AUX_BASE - aux[sent].astype(np.int64)
        return self._sent[self._recipients == client_slot]

    def of(self, client_slot: int) -> np.ndarray:
        """The record slots of the live idle timers that refer to ``client_slot``'s table."""
        if self._records is None:
            rec, first = self.wheel.records, self.wheel.first_entry
            aux = rec["aux"][first:]
            live = np.flatnonzero((aux >= 0) & ((rec["state"][first:] & AL.STATE_MASK) != AL.FREE))
            self._records = live + first
            self._owners = aux[live] >> CL.TOUCH_INDEX_BITS
        return self._records[self._owners == client_slot]


class _Passed:
    """A descriptor a client passed: taken by whoever keeps it, else closed."""

    def __init__(self, fd: int | None):
        self.fd = fd

    def take(self) -> int:
        fd, self.fd = self.fd, None
        return fd

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.take())


class _LogLimiter:
    """At most one line per ``_LOG_EVERY_S`` per topic (``clock()`` in s), saying how many were held back."""

    def __init__(self, clock):
        self._clock = clock
        self._last: dict[str, float] = {}
        self._held: collections.Counter = collections.Counter()

    def warning(self, topic: str, message: str, *args) -> None:
        self._log(logging.WARNING, topic, message, args)

    def error(self, topic: str, message: str, *args) -> None:
        self._log(logging.ERROR, topic, message, args)

    def _log(self, level: int, topic: str, message: str, args) -> None:
        now = self._clock()
        if now - self._last.get(topic, -_LOG_EVERY_S) < _LOG_EVERY_S:
            self._held[topic] += 1
            return
        self._last[topic] = now
        held = self._held.pop(topic, 0)
        log.log(level, message + (f" ({held} more like this since the last one)" if held else ""), *args)


def _journal_settled(wheel, recorder, slots: np.ndarray, before: np.ndarray, after: np.ndarray, now: int) -> None:
    """Journal the pending timers ``slots`` of a freed client slot (their deadlines were
    ``before``) as the plain timers they became: a ``rearm`` without ``i``, same arming
    tag, at their deadline now (``after``: moved or not). The journal must not go on
    calling them idle timers: a record damaged later is restored from it
    (:mod:`wheeld.daemon.reconcile`), and an idle timer restored without its touch
    reference waits ``idle_ms`` from the restore (``reconcile._restored_deadline``), which
    for a timer no touch can move any more is only late (simulation seeds 16646 and
    16733: fired up to the restart's distance from the last touch after its deadline)."""
    rec = wheel.records
    idents = wheel._idents[slots]
    groups = rec["group"][slots].astype(np.int64)
    tags = rec["tag"][slots].astype(np.int64)
    for ident, group, tag, previous, deadline in zip(idents.tolist(), groups.tolist(), tags.tolist(),
                                                     before.tolist(), after.tolist()):
        try:
            recorder.armed(group, decode_key(ident[1:], ident[0]), deadline, tag, previous, None)
        except ValueError:  # a key or group id overwritten in the arena: delivery frees that record
            continue
    recorder.commit(now)
