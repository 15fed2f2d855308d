"""The wheeld daemon: drains client rings, drives the wheel, delivers expirations.

One process, one thread, one uvloop event loop. The loop does three things:

* **Sessions.** A client connects to the Unix socket and sends ``Hello`` (protocol
  version, group). The daemon records its SO_PEERCRED, gives it a client slot
  and a ring segment (``/wheeld-<name>-c<slot>-<random>``) and answers
  ``Welcome`` with a random *token*. The socket then carries ``Doorbell`` frames
  one way and ``Expirations``/``Applied``/``Rejected`` frames the other.
* **The driver** (:meth:`Daemon._drive`): drain every ring (up to 8192 commands
  per ring and iteration, 1024 when a timer is already due, in chunks of 4096,
  stopping between chunks as soon as the next timer's deadline has come;
  the ring head is published only after a chunk is applied, so a daemon killed
  mid-chunk re-applies it, and every command is idempotent), read the clock,
  ``expire(now)``, re-arm idle timers that were touched, hand the rest to the
  group's delivery queue, send them, publish counters (at most once per ms while
  busy), look at up to 256 timers of the next level-1 bucket and move those
  level 0 already reaches down to it, ahead of the bucket's boundary
  (``cascade_ahead``, at most once per ms, ~75 us at 150k pending: the ~6.5k
  timers such a bucket holds under load would otherwise be re-placed at the
  boundary, ~1.2 ms that the timers due then wait for), then *park*.
* **Applying a chunk** (:meth:`Daemon._apply_batch`): commands on different keys
  commute and a later command on a key overrides an earlier one, so a chunk is
  applied as its *last operation per key*: one ``cancel_many`` and one
  ``schedule_many`` with the end state of applying it in ring order (the method
  docstring has the exact rules: tags, idle touch indices, rejections, acks).
  ``FLUSH(seq)`` is answered with ``Applied(seq)`` after the whole chunk.
* **Expiry** (:meth:`Daemon._expire`, :meth:`Daemon._dispatch`): a level-1
  cascade or a backlog goes through the wheel's batch ``expire_many`` and the
  records' numpy columns; a level-0 bucket of a few timers through the scalar
  ``expire``. ``Expirations`` frames are encoded straight from record fields
  (no key decode/encode round trip, no ``Expiry`` objects). With ``--journal``
  expiry stays per item, journaling every event.
* **Parking** is an eventcount: store a new park epoch in the arena's ``parked``
  word, re-check every ring, and only then sleep until the next bucket deadline.
  A client that pushes a command and sees a park epoch it has not rung for rings
  the doorbell (one small frame); a client that sees the daemon awake (0), or an
  epoch it already rang, rings nothing, so a burst of commands costs one
  doorbell. A full fence sits between the store of ``parked`` and the re-check
  (and, in the client, between publishing the tail and reading ``parked``); a
  missed wake-up is still bounded by ``max_park_ms``.

Delivery: a fired timer stays in the arena (state FIRED) until the client it was
sent to acknowledges it through its ring (``ACK slot generation``), after the
client library handed it to the application. If that client dies first, its
unacknowledged expirations go back to the group's queue and reach another
member; with no member connected they wait. After a daemon restart every FIRED
record is sent again (the client library drops duplicates it already handed
over); a timer whose deadline passed while the daemon was down is marked late.

Never early: ``expire(now)`` returns only timers with ``deadline <= now``; the
sleep is computed from the bucket heap and a wake-up that comes early (uvloop's
timers may fire up to ~0.5 ms early) simply finds nothing due and sleeps again.

Choices made where the issue is silent: a client's segment survives its death
until its ring is drained and no idle timer refers to its touch table (so a
touch made before the crash still counts); clients reconnecting after a daemon
restart resume their segment by presenting the token; a client whose ring holds
garbage is disconnected and its ring is no longer read (its group's timers stay).
"""

from __future__ import annotations

import array
import asyncio
import bisect
import collections
import errno
import gc
import hmac
import logging
import mmap
import os
import secrets
import signal
import socket
import stat
import struct
import threading
import time
from itertools import repeat

import msgspec
import numpy as np
import posix_ipc
from wheeld.protocol import arena_layout as AL
from wheeld.protocol import clients_layout as CL
from wheeld.protocol import commands as C
from wheeld.protocol import framing
from wheeld.protocol import messages as M
from wheeld.protocol import status_layout as SL
from wheeld.protocol.errors import (
    ArenaFull,
    GroupLimit,
    InvalidRequest,
    ProtocolError,
    WheeldError,
)
from wheeld.protocol.framing import FrameReader
from wheeld.protocol.keys import decode_key
from wheeld.protocol.naming import arena_name, clients_name, segment_prefix
from wheeld.shm.arena import unlink as unlink_segment
from wheeld.shm.ring import ClientSegment
from wheeld.shm.status import StatusPage
from wheeld.shm.wheel import MAX_DELAY_MS, TimerWheel

from .activation import listen_fds, unix_stream_listener
from .alarm import Alarm
from .config import Config
from .instance import InstanceLock, check_owned, set_aside, shm_path
from .sdnotify import Notifier

log = logging.getLogger("wheeld")

_META = [bytes((m,)) for m in range(256)]
_PEERCRED = struct.Struct("3i")
_HIGH_WATER = 8 << 20  # bytes queued to one client before we stop sending to it
CLIENT_MAX_FRAME = 4096  # the largest client -> daemon frame (a Hello is a few hundred bytes)
_RECV_BYTES = 65536
_FDS_SPACE = socket.CMSG_SPACE(4 * array.array("i").itemsize)  # room for a few passed descriptors
_MAINTAIN_S = 1.0  # period of the bookkeeping timer (frame and ack timeouts, accept pauses)
_IDLE_WAIT_MS = 100  # an idle timer whose client has not come back after a restart waits this long
_LOG_EVERY_S = 1.0  # a repeated warning is logged at most this often, with a count
# The longest delay a client may ask for: the wheel takes deadlines up to MAX_DELAY_MS past
# its own clock, which lags real time by up to a park; a day of margin means a delay the
# client accepted is never refused later (at flush) for being a few ms too far out.
CLIENT_MAX_DELAY_MS = MAX_DELAY_MS - 86_400_000
_DRAIN_BATCH = 8192  # commands taken from one ring per loop iteration
_DRAIN_DUE = 1024  # ... when a timer is already due (about 1 ms of applying)
_APPLY_CHUNK = 4096  # applied, then committed, at a time
_GC_INTERVAL_MS = 2000
# Smaller drained batches are cheaper one command at a time: a batch costs ~300 us fixed
# + ~1.2 us/command, one by one ~3.5-4 us/command (crossover ~130-190, measured by
# python -m bench.daemon_paths). At 64 the paced steady phase paid ~7 us per command.
_BATCH_MIN = 192
_BUSY_COMMANDS = 256  # an iteration that applied this many drains again at once; fewer: gather (coalesce_us)
_CASCADE_AHEAD = 256  # records of the next level-1 bucket looked at per ms (TimerWheel.cascade_ahead)
_EXPIRE_MANY_MIN = 24  # see _expire (expire_many ~30 us per call, expire ~1.7 us per timer)
_COLUMNS_MIN = 256  # expirations handled per column (numpy) from this many on, per item below
_LATENESS_BOUNDS_US = np.array(AL.LATENESS_BOUNDS_US, dtype=np.int64)
_EXPIRATIONS_TAG = M.Expirations.__struct_config__.tag
_encoder = msgspec.msgpack.Encoder()  # the daemon's one encoder for frames it builds from columns


def mono_ms() -> int:
    return time.monotonic_ns() // 1_000_000


def _full_fence(lock=threading.Lock()) -> None:
    """A locked instruction (x86-64): orders the parked store before the ring loads."""
    lock.acquire()
    lock.release()


class ClientSlot:
    """A client's ring segment, drained whether or not its client is connected.

    ``segment`` is None while a slot found in the client table after a daemon
    restart waits for its client to hand the ring back (``resume_grace_s``).
    ``unacked`` holds what was sent to this client and not yet acknowledged, in two
    generations: every ``ack_timeout_s / 2`` what is still in the older one is sent
    again (to any member) and the newer one becomes the older."""

    __slots__ = ("slot", "segment", "label", "group", "group_name", "session", "unacked", "unacked_old", "poisoned",
                 "pid", "uid", "orphan_since", "unanswered_flush")

    def __init__(self, slot: int, segment: ClientSegment | None, label: str, group: int, group_name: str, pid: int,
                 uid: int):
        self.slot = slot
        self.segment = segment
        self.label = label
        self.group = group
        self.group_name = group_name
        self.session: Session | None = None
        self.unacked: dict[int, int] = {}  # fired slot -> generation, sent to this client
        self.unacked_old: dict[int, int] = {}
        self.poisoned = False
        self.pid = pid
        self.uid = uid
        self.orphan_since = 0
        self.unanswered_flush: int | None = None  # a FLUSH applied while no session was open

    def take_unacked(self) -> list[tuple[int, int]]:
        """Everything in flight to this client, forgotten here (it goes back to the queue)."""
        pairs = list(self.unacked_old.items()) + list(self.unacked.items())
        self.unacked_old.clear()
        self.unacked.clear()
        return pairs


class Session:
    """One connected socket.

    Bounded: a client sends only small messages (Hello, Doorbell, Bye), so a frame
    announcing more than ``CLIENT_MAX_FRAME`` bytes is a protocol error, a frame
    must be complete within ``frame_timeout_s`` of its first byte, and one read
    takes at most 64 KiB: the input buffer never holds more than ~70 KiB. Output
    waiting for the client stops growing at ``_HIGH_WATER``, and a client that has
    not taken a byte of it for ``ack_timeout_s`` is disconnected (``stuck_since``):
    otherwise every ack timeout would send it its unacknowledged expirations again,
    and the daemon would hold up to ``_HIGH_WATER`` for each client that never reads."""

    def __init__(self, daemon: "Daemon", sock: socket.socket, pid: int, uid: int, gid: int):
        self.daemon = daemon
        self.sock = sock
        self.pid, self.uid, self.gid = pid, uid, gid
        self.reader = FrameReader(max_frame=CLIENT_MAX_FRAME)
        self.partial_since = 0.0  # time.monotonic() when an incomplete frame started, 0 at a boundary
        self.passed_fds: list[int] = []  # SCM_RIGHTS descriptors that came with the Hello
        self.out = bytearray()
        self.stuck_since = 0.0  # time.monotonic() since when out has waited without the client taking a byte
        self.writing = False
        self.closed = False
        self.client: ClientSlot | None = None

    @property
    def congested(self) -> bool:
        return len(self.out) > _HIGH_WATER

    def send(self, frame: bytes) -> None:
        if self.closed:
            return
        if self.out:
            self.out += frame
            return
        try:
            sent = self.sock.send(frame)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            self.daemon.close_session(self, f"send failed: {exc}")
            return
        self._keep(frame, sent)

    def send_with_fds(self, frame: bytes, fds: list[int]) -> None:
        """Send ``frame`` with ``fds`` as SCM_RIGHTS data (the first frame of a session)."""
        try:
            sent = self.sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        except (BlockingIOError, InterruptedError):
            self.daemon.close_session(self, "the client does not read its socket")
            return
        except OSError as exc:
            self.daemon.close_session(self, f"send failed: {exc}")
            return
        self._keep(frame, sent)  # the descriptors went with the first byte

    def _keep(self, frame: bytes, sent: int) -> None:
        if sent < len(frame):
            self.out += frame[sent:]
            if not self.writing:
                self.writing = True
                self.stuck_since = time.monotonic()
                self.daemon.loop.add_writer(self.sock.fileno(), self._on_writable)

    def _on_writable(self) -> None:
        try:
            sent = self.sock.send(self.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self.daemon.close_session(self, f"send failed: {exc}")
            return
        del self.out[:sent]
        if sent:
            self.stuck_since = time.monotonic()
        if not self.out:
            self.writing = False
            self.out = bytearray()  # give a large buffer back
            self.daemon.loop.remove_writer(self.sock.fileno())
            self.daemon.wake()  # it may take more expirations now

    def _recv(self) -> bytes:
        if self.client is not None:
            return self.sock.recv(_RECV_BYTES)
        # before the handshake a Hello may carry the client's old ring (SCM_RIGHTS)
        data, ancillary, _flags, _addr = self.sock.recvmsg(_RECV_BYTES, _FDS_SPACE)
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
                self.passed_fds.extend(fds)
        if len(self.passed_fds) > 1 or data == b"":
            self.close_passed_fds(keep=1 if data else 0)
        return data

    def close_passed_fds(self, keep: int = 0) -> None:
        for fd in self.passed_fds[keep:]:
            os.close(fd)
        del self.passed_fds[keep:]

    def on_readable(self) -> None:
        self.daemon.arena_busy()  # what follows may write the arena while the loop is parked
        try:
            data = self._recv()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self.daemon.close_session(self, f"recv failed: {exc}")
            return
        if not data:
            self.daemon.close_session(self, "peer closed the connection")
            return
        try:
            frames = self.reader.feed(data)
            if self.reader.pending_bytes:
                self.partial_since = self.partial_since or time.monotonic()
            else:
                self.partial_since = 0.0
            for body in frames:
                self.daemon.on_message(self, M.decode_client_message(body))
                if self.closed:
                    return
        except ProtocolError as exc:
            self.daemon.close_session(self, f"protocol error: {exc}", goodbye=True)


class Daemon:
    def __init__(self, config: Config):
        self.config = config
        self.loop: asyncio.AbstractEventLoop | None = None
        self.wheel: TimerWheel | None = None
        self.clients: dict[int, ClientSlot] = {}  # client slot -> ClientSlot
        self.sessions: set[Session] = set()
        self.queues: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        self.members: dict[int, list[Session]] = collections.defaultdict(list)
        self._rr = 0
        self._stopping = False
        self._wake_future: asyncio.Future | None = None
        self._alarm: Alarm | None = None  # the park's precise wake-up (a timerfd), where Linux has it
        self._park_handle: asyncio.TimerHandle | None = None  # its stand-in without timerfd
        self._park_until_ns = 0  # when the current park ends (CLOCK_MONOTONIC ns)
        self._listener: socket.socket | None = None
        self._owns_socket_path = False
        self.notifier = Notifier()
        self.started_ms = 0
        self.totals: dict[str, int] = dict.fromkeys(_DAEMON_TOTALS, 0)
        self._last_gc = 0
        self._clients_buf = None
        self._lateness_counts = [0] * AL.LATENESS_BUCKETS
        self._lateness_sum_us = 0
        self._stats_pending = 0
        self.recorder = None  # the journal, when --journal is given
        self._ring_depth = 0
        self._last_watchdog = 0.0
        self._level1_tick_ms = 256
        self._last_expired = 0  # timers the last _expire fired (chooses the wheel method)
        self.ready = False
        self.lock: InstanceLock | None = None
        self.status: StatusPage | None = None
        self._by_label: dict[str, ClientSlot] = {}  # ring label -> its slot (resume looks them up)
        self._next_slot = 0  # slots are handed out round robin: a freed slot is reused last
        self._handshaking: collections.Counter = collections.Counter()  # uid -> sessions before Hello
        self._accept_paused = False
        self._maintain_handle: asyncio.TimerHandle | None = None
        self._last_ack_rotation = 0.0
        self._static_owners = {name: (CL.OWNER_UID if kind == "uid" else CL.OWNER_GID, ident)
                               for name, kind, ident in config.group_owners}
        self._groups_of_uid: dict[int, tuple[float, frozenset[int]]] = {}
        self._log_limiter = _LogLimiter()
        self._set_aside: list[str] = []  # unusable segments renamed at start-up
        self._full_groups: set[int] = set()  # groups at --group-quota (their members were told)
        self._next_lsn: int | None = None  # where the journal continues after a recovery
        self._recovered = None  # the journal's recovered state, when the arena was rebuilt from it

    # ------------------------------------------------------------------ start-up
    def open_arena(self) -> None:
        """Attach the instance's arena, or create one (rebuilt from the journal when there
        is one). Call with the instance lock held. An arena that cannot be trusted or
        used is set aside (see :mod:`wheeld.daemon.instance`), never refused."""
        cfg = self.config
        name = arena_name(cfg.name)
        now = mono_ms()
        self.wheel = self._attach_arena(name)
        if self.wheel is not None:
            w = self.wheel
            log.info(
                "attached existing arena %s: %d pending, %d fired awaiting delivery (tick %d ms, wheel %d, capacity %d)",
                name, len(w), w.counters()["fired_unacked"], w.tick_ms, w.wheel_size, w.capacity,
            )
            for problem in w.repairs:
                log.warning("arena repair: %s", problem)
            if (w.tick_ms, w.wheel_size, w.capacity) != (cfg.tick_ms, cfg.wheel_size, cfg.capacity):
                log.warning("arena parameters differ from the command line; the arena's are used")
            hq = w.header_words()
            for counter in _DAEMON_TOTALS:  # totals carry on across restarts
                self.totals[counter] = hq[AL.H_COUNTERS // 8 + AL.COUNTER[counter]]
            self.totals["daemon_restarts_total"] += 1
            fresh = False
        else:
            self.wheel = self._new_arena(name, now)
            fresh = True
        if self._set_aside:
            self.totals["arenas_set_aside_total"] += len(self._set_aside)
        if cfg.journal_dir:
            from .journaling import open_journal

            self.recorder = open_journal(cfg, self.wheel, self._recovered if fresh else None, self.totals,
                                         next_lsn=self._next_lsn if fresh else None)
        self.started_ms = now
        self.arena_epoch = (self.wheel.created_wall_ms & 0xFFFFFFFF) or 1  # see _ack_allowed
        self._level1_tick_ms = self.wheel.tick_ms * self.wheel.wheel_size  # see _expire
        self.totals["daemon_pid"] = os.getpid()
        self.totals["daemon_started_ms"] = now
        # every fired-but-unacknowledged timer is delivered again
        for s in self.wheel.fired_slots():
            key, deadline, group, tag, aux, gen = self.wheel.fired(s)
            self.queues[group].append((s, gen, now, deadline < now))
        self._open_client_table()

    def _new_arena(self, name: str, now: int) -> TimerWheel:
        """A new arena, rebuilt from the journal when there is one. It is built under a
        temporary name and renamed into place only when complete: a daemon killed in the
        middle of a recovery leaves no half-filled arena that the next start would take
        for the real one (it starts the recovery over)."""
        cfg = self.config
        self._recovered = self._next_lsn = None
        if cfg.journal_dir:  # before the arena exists: a refusal (--journal-damage refuse) leaves nothing
            from .journaling import recover_journal

            self._recovered = recover_journal(cfg.journal_dir, cfg.journal_damage)
        building = f"{name}.new"
        if unlink_segment(building):
            log.warning("removed %s, left by a daemon that died while building its arena", building)
        wheel = TimerWheel.create(
            cfg.capacity, tick_ms=cfg.tick_ms, wheel_size=cfg.wheel_size, name=building, start_ms=now,
            max_groups=cfg.max_groups, mode=cfg.arena_mode,
        )
        try:
            self._hand_to_monitors(building)
            if self._recovered is not None:
                from .journaling import load_recovered

                self._next_lsn = load_recovered(wheel, self._recovered, cfg.journal_dir)
            wheel._seg.rename(name)
            wheel.name = name
        except BaseException:
            wheel.close()
            unlink_segment(building)
            raise
        log.info("created arena %s (capacity %d, tick %d ms, wheel %d, %d levels)",
                 name, cfg.capacity, cfg.tick_ms, cfg.wheel_size, wheel.levels)
        return wheel

    def _attach_arena(self, name: str) -> TimerWheel | None:
        """The existing arena, or None when there is none or it was set aside."""
        self._set_aside = []
        untrusted = check_owned(name)
        if untrusted is None:
            try:
                return TimerWheel.attach(name)
            except FileNotFoundError:
                return None
            except (WheeldError, ValueError, OSError) as exc:
                reason = f"it cannot be used: {exc}"
        else:
            reason = untrusted
        moved = set_aside(name)  # raises UntrustedSegment when it is not ours to move
        if moved:
            self._set_aside.append(moved)
            log.error("arena %s set aside as /dev/shm/%s because %s; a new arena is made%s", name, moved, reason,
                      " and rebuilt from the journal" if self.config.journal_dir else " (no journal: its timers are lost)")
        return None

    def _hand_to_monitors(self, segment_name: str) -> None:
        """Give a segment the daemon created to the monitoring group (``--monitor-group``)."""
        gid = self.config.monitor_gid
        if gid is not None:
            path = shm_path(segment_name)
            os.chown(path, -1, gid)
            os.chmod(path, 0o640)

    def _open_client_table(self) -> None:
        """Map the client table; a restarted daemon finds the slots its clients had (they
        wait ``resume_grace_s`` for their client to hand the ring back) and the group owners."""
        name = clients_name(self.config.name)
        untrusted = check_owned(name)
        if untrusted is not None:
            moved = set_aside(name)
            log.error("client table %s set aside as %s because %s", name, moved, untrusted)
        mode = self.config.arena_mode
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREAT, mode=mode, size=CL.SEGMENT_BYTES)
        try:
            fresh = os.fstat(shm.fd).st_size != CL.SEGMENT_BYTES
            if fresh:
                os.ftruncate(shm.fd, 0)
                os.ftruncate(shm.fd, CL.SEGMENT_BYTES)
            os.fchmod(shm.fd, mode)
            self._clients_buf = mmap.mmap(shm.fd, CL.SEGMENT_BYTES)
        finally:
            shm.close_fd()
        self._hand_to_monitors(name)
        buf = self._clients_buf
        magic, arena_created = CL.HEADER.unpack_from(buf, 0)
        if magic != CL.MAGIC or arena_created != self.wheel.created_wall_ms:
            buf[: CL.SEGMENT_BYTES] = bytes(CL.SEGMENT_BYTES)  # another arena's table (or none)
            CL.HEADER.pack_into(buf, 0, CL.MAGIC, self.wheel.created_wall_ms)
            return
        now = mono_ms()
        for slot in range(CL.MAX_CLIENTS):
            in_use, group, pid, uid, _depth, _capacity, raw = CL.ENTRY.unpack_from(buf, CL.entry_offset(slot))
            if not in_use:
                continue
            label = raw.rstrip(b"\0").decode("utf-8", "replace")
            cs = ClientSlot(slot, None, label, group, self.wheel.group_name(group), pid, uid)
            cs.orphan_since = now
            self.clients[slot] = cs
            self._by_label[label] = cs
            log.info("client slot %d (pid %d, group %s): waiting up to %.0f s for its client to hand ring %s back",
                     slot, pid, cs.group_name, self.config.resume_grace_s, label)

    def _write_client_entry(self, slot: int, cs: ClientSlot | None) -> None:
        if cs is None:
            CL.ENTRY.pack_into(self._clients_buf, CL.entry_offset(slot), 0, 0, 0, 0, 0, 0, b"")
            return
        capacity = cs.segment.ring_capacity if cs.segment is not None else 0
        CL.ENTRY.pack_into(self._clients_buf, CL.entry_offset(slot), 1, cs.group, cs.pid, cs.uid, 0, capacity,
                           cs.label.encode("utf-8")[:104])

    def open_socket(self) -> None:
        cfg = self.config
        inherited = listen_fds()
        if inherited:
            self._listener = unix_stream_listener(inherited)
            log.info("using the socket passed by systemd (fd %d)", self._listener.fileno())
        else:
            path = cfg.socket_path
            os.makedirs(os.path.dirname(path) or ".", mode=0o755, exist_ok=True)
            if os.path.exists(path):
                if not stat.S_ISSOCK(os.stat(path).st_mode):
                    raise InvalidRequest(f"{path} exists and is not a socket")
                probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    probe.connect(path)
                    raise InvalidRequest(f"another wheeld is listening on {path}")
                except (ConnectionRefusedError, FileNotFoundError):
                    os.unlink(path)  # stale socket of a dead daemon
                finally:
                    probe.close()
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(path)
            os.chmod(path, cfg.socket_mode)
            sock.listen(1024)
            self._listener = sock
            self._owns_socket_path = True
        self._listener.setblocking(False)

    # ------------------------------------------------------------------ run
    def run(self) -> int:
        import uvloop

        return uvloop.run(self.main())

    async def main(self) -> int:
        self.loop = asyncio.get_running_loop()
        # One daemon per instance: the lock comes before anything is mapped for writing,
        # and the socket before the arena, so a second daemon changes nothing at all.
        self.lock = InstanceLock.acquire(self.config.name)
        self.open_socket()
        try:
            self.open_arena()
        except BaseException:
            self._close_listener()
            raise
        self.status = StatusPage.create(f"wheeld-{self.config.name}-status")
        self._maintain_handle = self.loop.call_later(_MAINTAIN_S, self._maintain)
        # Everything allocated so far lives as long as the daemon: move it out of the
        # collector's reach, so a full collection (3-7 ms over the ~30k objects of the
        # imported modules and the arena set-up) cannot stall the loop while timers are due.
        gc.collect()
        gc.freeze()
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.loop.add_signal_handler(sig, self.stop)
        metrics_server = None
        if self.config.metrics:  # before READY=1: a bad address must fail the start, not a running service
            from .metrics import start_metrics_server

            metrics_server = await start_metrics_server(self, self.config.metrics)
        self.loop.add_reader(self._listener.fileno(), self._on_accept)
        self._alarm = Alarm.create()
        if self._alarm is not None:
            self.loop.add_reader(self._alarm.fileno(), self._on_alarm)
        else:
            log.warning("no timerfd: parking with the event loop's millisecond timer")
        self.ready = True
        self.notifier.ready(status=self._status_line())
        log.info("wheeld %s ready on %s (pid %d)", self.config.name, self.config.socket_path, os.getpid())
        try:
            await self._drive()
        finally:
            self.notifier.stopping()
            if metrics_server is not None:
                metrics_server.close()
            self._shutdown()
        return 0

    def stop(self) -> None:
        log.info("stopping")
        self._stopping = True
        self.wake()

    def wake(self) -> None:
        fut = self._wake_future
        if fut is not None and not fut.done():
            fut.set_result(None)

    def _on_alarm(self) -> None:
        if self._alarm.consume():
            self.wake()

    def _shutdown(self) -> None:
        self.loop.remove_reader(self._listener.fileno())
        if self._alarm is not None:
            self.loop.remove_reader(self._alarm.fileno())
            self._alarm.close()
            self._alarm = None
        for session in list(self.sessions):
            self.close_session(session, "daemon shutting down", goodbye=True, resume=True)
        self._drain_rings()  # apply what is left (acks included) before the arena is closed
        self._publish(mono_ms())
        self._close_listener()
        if self.recorder is not None:
            self.recorder.close()
        if self._maintain_handle is not None:
            self._maintain_handle.cancel()
        for cs in self.clients.values():
            if cs.segment is not None:
                cs.segment.close()
        self.status.close()
        self.wheel.close()
        self.lock.release()
        log.info("stopped; %d timers pending in the arena", self._stats_pending)

    def _close_listener(self) -> None:
        self._listener.close()
        if self._owns_socket_path:
            try:
                os.unlink(self.config.socket_path)
            except FileNotFoundError:
                pass

    # ------------------------------------------------------------------ driver
    async def _drive(self) -> None:
        loop = self.loop
        wheel = self.wheel
        hq = wheel.header_words()
        parked_word = AL.H_PARKED // 8  # wheelctl's "at rest" word (the clients use the status page's)
        status_words = self.status.words  # the clients from the status page
        status_parked = SL.PARKED_WORD
        park_epoch = hq[AL.H_WAKE_SEQ // 8]
        max_park = self.config.max_park_ms
        watchdog_s = self.notifier.watchdog_interval_s()
        last_publish = last_ahead = 0
        coalesce_ns = self.config.coalesce_us * 1000
        while not self._stopping:
            self.totals["loop_iterations_total"] += 1
            # Timers already due go out before the commands gathered meanwhile are applied
            # (a cancel or re-arm that loses this race is dropped by the client library,
            # which knows its latest arming), and bound that drain, so a command flood
            # cannot hold expiry back for more than ~1 ms; the clock is read after the drain.
            due = wheel.next_deadline()
            if due is not None and due <= mono_ms():
                self._expire(mono_ms())
                self._dispatch()
                commands = self._drain_rings(_DRAIN_DUE)
            else:
                commands = self._drain_rings(_DRAIN_BATCH, due)
            now = mono_ms()
            self._expire(now)
            self._dispatch()
            if now != last_ahead:  # after this iteration's expirations went out; at most once per ms
                last_ahead = now
                wheel.cascade_ahead(now, _CASCADE_AHEAD)
            if watchdog_s and time.monotonic() - self._last_watchdog >= watchdog_s:
                self._last_watchdog = time.monotonic()
                self.notifier.watchdog()
                self.notifier.status(self._status_line())
            if self.recorder is not None:
                self.recorder.tick(now)
            if now - self._last_gc >= _GC_INTERVAL_MS:
                self._last_gc = now
                self._collect_orphans(now)
            # after everything this iteration writes into the arena, so that a park right
            # after it leaves counters that match the records (see the parked word below)
            published = now != last_publish  # at most once per ms (and before a longer park)
            if published:
                last_publish = now
                self._publish(now)
            if commands >= _BUSY_COMMANDS or (commands and not coalesce_ns):
                await asyncio.sleep(0)  # let sockets in, then drain again
                continue
            # Park: until the next deadline, a doorbell, or (commands arrive by the few) at
            # most coalesce_us, so that one wake-up applies many of them: draining every
            # handful of commands as it trickled in kept the daemon busy ~70% of a core.
            park_epoch += 1  # a new epoch: each client rings at most once per park
            hq[AL.H_WAKE_SEQ // 8] = park_epoch
            status_words[status_parked] = park_epoch
            _full_fence()
            gather = self._rings_pending()
            if gather and not coalesce_ns:
                status_words[status_parked] = 0
                continue
            next_deadline = wheel.next_deadline()
            now = mono_ms()
            timeout_ms = max_park if next_deadline is None else min(max_park, next_deadline - now)
            if watchdog_s:
                timeout_ms = min(timeout_ms, int(watchdog_s * 1000))
            if self.recorder is not None and self.recorder.sync_due_ms() is not None:
                timeout_ms = min(timeout_ms, self.recorder.sync_due_ms() - now)
            if timeout_ms > 1 and not published:  # a longer sleep: leave current counters
                last_publish = now
                self._publish(now)
                published = True
            if published:
                # for wheelctl: the arena is at rest and its counters match its records, until
                # the loop wakes or a callback clears it (arena_busy) before writing the arena
                hq[parked_word] = park_epoch
            # wake at the start of the due millisecond, not timeout_ms after "now"
            # (mono_ms() is floored: that would add up to 1 ms to every parked expiry),
            # with the timerfd: the loop's timer has whole-ms resolution (see alarm.py)
            wake_ns = (now + timeout_ms) * 1_000_000
            if gather:
                wake_ns = min(wake_ns, time.monotonic_ns() + coalesce_ns)
            if timeout_ms > 0 and not self._stopping:
                fut = self._wake_future = loop.create_future()
                self._wake_at(wake_ns)
                await fut
                self._wake_future = None
                if self._park_handle is not None:
                    self._park_handle.cancel()
                    self._park_handle = None
                self.totals["wakeups_total"] += 1
            hq[parked_word] = status_words[status_parked] = 0

    def _soft_wake(self) -> None:
        """A doorbell nobody waits on (commands pushed, no flush, room in the ring): wake
        ``coalesce_us`` later, or sooner for a due timer or an urgent doorbell, so one
        wake-up applies what many pushes brought. Without it, a paced client woke the
        daemon for every ~4 commands (14k wake-ups/s, ~70 us each: a whole core)."""
        fut = self._wake_future
        if fut is None or fut.done():
            return  # not parked: the loop drains anyway
        at_ns = time.monotonic_ns() + self.config.coalesce_us * 1000
        if at_ns < self._park_until_ns:  # else the park ends sooner anyway
            self._wake_at(at_ns)

    def _wake_at(self, at_ns: int) -> None:
        """End the current park at ``at_ns`` (CLOCK_MONOTONIC), replacing the earlier setting."""
        self._park_until_ns = at_ns
        if self._alarm is not None:
            self._alarm.arm(at_ns)
            return
        if self._park_handle is not None:
            self._park_handle.cancel()
        self._park_handle = self.loop.call_later(max(0.0, (at_ns - time.monotonic_ns()) / 1e9), self.wake)

    def _rings_pending(self) -> bool:
        for cs in self.clients.values():
            if not cs.poisoned and cs.segment is not None:
                try:
                    if cs.segment.depth():
                        return True
                except ProtocolError:
                    return True  # let the drain report it
        return False

    def _drain_rings(self, max_per_ring: int = _DRAIN_BATCH, stop_at_ms: int | None = None) -> int:
        """Apply up to ``max_per_ring`` commands of every ring, committing each chunk of
        ``_APPLY_CHUNK`` as soon as it is applied (a producer waiting for room gets it sooner).

        With ``stop_at_ms`` (the next timer's deadline) the drain stops between chunks
        once that moment has come, so a flood of commands delays an expiration by at
        most about one chunk (~4-5 ms at worst) instead of the whole drain (two full
        rings: ~20 ms). Chunks of 1024 would bound it to ~1 ms but cost ~0.3 us of
        daemon CPU per command under load (more fixed costs per batch), measured."""
        total = 0
        for cs in list(self.clients.values()):
            if stop_at_ms is not None and mono_ms() >= stop_at_ms:
                break
            if cs.poisoned or cs.segment is None:
                continue
            try:
                if cs.segment.depth() == cs.segment.ring_capacity:
                    self.totals["ring_full_total"] += 1  # the client found (or will find) it full
            except ProtocolError:
                pass  # _apply reports it
            done = 0
            while done < max_per_ring and not cs.poisoned:
                want = min(_APPLY_CHUNK, max_per_ring - done)
                applied = self._apply(cs, want)
                done += applied
                if applied < want or (stop_at_ms is not None and mono_ms() >= stop_at_ms):
                    break
            total += done
        self.totals["ring_depth"] = self._ring_depth
        self._ring_depth = 0
        return total

    def _apply(self, cs: ClientSlot, max_records: int = _DRAIN_BATCH) -> int:
        """Apply up to one batch of this client's commands; return how many."""
        segment = cs.segment
        try:
            records = segment.peek(max_records)
        except ProtocolError as exc:
            self._poison(cs, str(exc))
            return 0
        n = len(records)
        if not n:
            return 0
        self._ring_depth += n
        valid = C.validate_records(records, segment.touch_capacity)
        good = n if valid.all() else int(np.argmin(valid))
        flushes = []
        rejects = []
        recorder = self.recorder
        quota = self.config.group_quota
        if good >= _BATCH_MIN and not (quota and self.wheel.group_live(cs.group) + good > quota):
            # (with --journal too: the Recorder journals the batch command by command; a group
            # near its quota goes one by one, where each arm that needs a new record is checked)
            self._apply_batch(cs, records[:good], flushes, rejects)
        elif good:
            ops = records["op"][:good].tolist()
            metas = records["key_meta"][:good].tolist()
            keys = np.ascontiguousarray(records["key"][:good]).view("V32").ravel().tolist()
            deadlines = records["deadline_ms"][:good].tolist()
            seqs = records["seq"][:good].tolist()
            aux0 = records["aux0"][:good].tolist()
            aux1 = records["aux1"][:good].tolist()
            self._apply_one_by_one(cs, good, ops, metas, keys, deadlines, seqs, aux0, aux1, flushes, rejects)
        if recorder is not None:
            recorder.commit(mono_ms())  # on disk before the head moves and before Applied (fsync=always)
        segment.commit(good)  # only now may the client reuse the slots: a crash above re-applies the batch
        self.totals["commands_total"] += good
        self.totals["rejected_total"] += len(rejects)
        session = cs.session
        if session is not None and not session.closed:
            for reject in rejects:
                session.send(M.encode_daemon_frame(reject))
            for seq in flushes:
                session.send(M.encode_daemon_frame(M.Applied(seq)))
        elif flushes:  # its session was closed and it may come back: answered then (_hello)
            cs.unanswered_flush = flushes[-1]
        if good < n:
            op = int(records["op"][good])
            self._poison(cs, f"invalid command record (op {op}) at ring position {good}")
        return good

    def _ack_allowed(self, cs: ClientSlot, slot: int, generation: int, stamp: int = 0) -> bool:
        """May this client acknowledge fired record (slot, generation)? Forget it as in flight.

        ``stamp`` (the ACK record's ``seq``) is the ``arena_epoch`` of the Welcome under
        which the client received the expiration. An ack stamped with another epoch
        names a record of an arena that is gone (a reboot recovered from the journal
        into a fresh one, whose slots and generations start over): it would release an
        unrelated timer, so it is ignored; what it meant to ack is re-delivered and the
        client recognises it by (key, arming tag). Unstamped acks (0) are accepted.

        Usually it is one this daemon sent to this client. After a daemon restart the
        acks a client pushed earlier (even one that died since) are in its ring but in
        nobody's in-flight table: they count when the record is still fired with that
        generation and belongs to the client's group. A client cannot acknowledge
        another group's timers.
        """
        if stamp and stamp != self.arena_epoch:
            log.debug("client slot %d: ignored an ack for (%d, %d) of a previous arena", cs.slot, slot, generation)
            return False
        for in_flight in (cs.unacked, cs.unacked_old):
            if in_flight.get(slot) == generation:
                del in_flight[slot]
                return True
        try:
            _key, _deadline, group, _tag, _aux, current = self.wheel.fired(slot)
        except InvalidRequest:
            return False  # not a fired record (already released): a stale ack
        if current != generation or group != cs.group:
            return False
        for other in self.clients.values():  # in flight to another member: it is done now
            if other.group == group:
                for in_flight in (other.unacked, other.unacked_old):
                    if in_flight.get(slot) == generation:
                        del in_flight[slot]
        return True

    def _apply_one_by_one(self, cs, good, ops, metas, keys, deadlines, seqs, aux0, aux1, flushes, rejects) -> None:
        wheel = self.wheel
        gid = cs.group
        touch_base = cs.slot << CL.TOUCH_INDEX_BITS
        schedule, cancel, release = wheel.schedule_ident, wheel.cancel_ident, wheel.release
        recorder = self.recorder
        if recorder is not None:
            recorder.begin()
        quota = self.config.group_quota
        for i in range(good):
            op = ops[i]
            try:
                if quota and (op == C.ADD or op == C.ADD_IDLE) and wheel.group_live(gid) >= quota \
                        and wheel.lookup_ident(_META[metas[i]] + keys[i], gid) is None:  # a new record: refused
                    rejects.append(_rejected(seqs[i], keys[i], metas[i], f"group {cs.group_name!r} holds its quota "
                                             f"of {quota} timers", M.Rejected.QUOTA_EXCEEDED))
                    continue
                if recorder is not None and op != C.FLUSH:
                    self._record_command(op, metas[i], keys[i], deadlines[i], seqs[i], aux0[i], aux1[i], cs)
                elif op == C.ADD:
                    schedule(_META[metas[i]] + keys[i], deadlines[i], gid, seqs[i])
                elif op == C.CANCEL:
                    cancel(_META[metas[i]] + keys[i], gid)
                elif op == C.ACK:
                    if self._ack_allowed(cs, aux0[i], aux1[i], seqs[i]):
                        release(aux0[i], aux1[i])
                elif op == C.ADD_IDLE:
                    schedule(_META[metas[i]] + keys[i], deadlines[i], gid, seqs[i], touch_base | aux1[i])
                elif op == C.FLUSH:
                    flushes.append(seqs[i])
            except ArenaFull as exc:
                rejects.append(_rejected(seqs[i], keys[i], metas[i], str(exc), M.Rejected.ARENA_FULL))
            except InvalidRequest as exc:
                rejects.append(_rejected(seqs[i], keys[i], metas[i], str(exc), M.Rejected.INVALID_DEADLINE))

    def _apply_batch(self, cs: ClientSlot, records: np.ndarray, flushes: list, rejects: list) -> None:
        """A drained batch of valid commands, applied as the *last operation per key*.

        Commands on different keys commute, and on one key a later ADD/ADD_IDLE/CANCEL
        overrides an earlier one, so the batch collapses to one ``cancel_many`` and one
        ``schedule_many`` with the same end state as applying it record by record:

        * a key with a CANCEL in the batch is cancelled first; if an arm follows the
          last cancel, the key is then armed afresh (a new record, as in order);
        * the arm uses the last arm's deadline and tag (its ``seq``), and the aux
          (idle touch index) of the first arm after the last cancel: in order, that
          one created the record and later arms re-armed it, which keeps the aux;
          a key armed before the batch and not cancelled in it is re-armed (keeps
          its aux, as a scalar re-arm does);
        * an arm with a deadline out of range is rejected (INVALID_DEADLINE, its own
          seq) and takes no part; an arm the arena has no room for is rejected
          (ARENA_FULL) with the seq of every arm of that key after its last cancel
          (in order each of them would have been refused);
        * ACKs (keyed by slot and generation) are released after the cancels and
          before the arms, so the records they free are available to this batch;
          FLUSHes are answered by the caller once the whole batch is applied.

        Unlike in-order application, an arm that would have found the arena full
        before a later cancel or ack of the same batch freed a record is accepted.
        The wheel's ``adds_total``/``rearms_total``/``cancels_total`` count the
        collapsed operations, not the commands (``commands_total`` counts those).

        With --journal the journal still gets one event per command, in command
        order (``Recorder.commands_many``): the pending deadlines of the batch's
        keys are looked up once before anything is applied, and the events follow
        from them as in-order application would record them.
        """
        wheel = self.wheel
        gid = cs.group
        recorder = self.recorder
        if recorder is not None:
            recorder.begin()
        ops = records["op"]
        flush_at = np.flatnonzero(ops == C.FLUSH)
        if flush_at.size:
            flushes.extend(records["seq"][flush_at].tolist())
        keyed = np.flatnonzero((ops == C.ADD) | (ops == C.ADD_IDLE) | (ops == C.CANCEL))
        arm_order = None
        if keyed.size:
            kops = ops[keyed]
            deadlines = records["deadline_ms"][keyed]
            arm = kops != C.CANCEL
            cur = wheel.current_ms
            bad = arm & ((deadlines > cur + MAX_DELAY_MS) | (deadlines < cur - MAX_DELAY_MS))
            if bad.any():
                for i in keyed[bad].tolist():
                    r = records[i]
                    rejects.append(_rejected(int(r["seq"]), r["key"].tobytes(), int(r["key_meta"]),
                                             f"deadline {int(r['deadline_ms'])} is more than {MAX_DELAY_MS} ms "
                                             f"from the clock ({cur})", M.Rejected.INVALID_DEADLINE))
                keep = ~bad
                keyed, kops, deadlines, arm = keyed[keep], kops[keep], deadlines[keep], arm[keep]
            k = keyed.size
            idents = np.empty((k, 33), dtype=np.uint8)
            idents[:, 0] = records["key_meta"][keyed]
            idents[:, 1:] = records["key"][keyed]
            idents = idents.view("V33").ravel()
            ident_list = idents.tolist()
            last = dict(zip(ident_list, range(k)))  # ident -> index (into keyed) of its last command
            last_at = np.fromiter(last.values(), dtype=np.int64, count=len(last))
            if recorder is not None:  # before anything is applied
                distinct = list(last)
                previous = dict(zip(distinct, recorder.previous_deadlines(gid, distinct)))
            cancel_at = np.flatnonzero(~arm)
            last_cancel: dict = {}
            if cancel_at.size:
                last_cancel = dict(zip([ident_list[j] for j in cancel_at.tolist()], cancel_at.tolist()))
                wheel.cancel_many(idents[np.fromiter(last_cancel.values(), dtype=np.int64, count=len(last_cancel))],
                                  gid)
            arm_order = last_at[arm[last_at]]
        if flush_at.size < ops.size - keyed.size:
            self._release_acks(cs, records, np.flatnonzero(ops == C.ACK))
        if arm_order is None or not arm_order.size:
            if recorder is not None and keyed.size:
                self._record_batch(gid, records, keyed, kops, deadlines, ident_list, arm, previous, frozenset())
            return
        seqs = records["seq"][keyed]
        aux = np.full(arm_order.size, -1, dtype=np.int64)
        idle = kops == C.ADD_IDLE
        if idle.any():
            first = self._first_arms(ident_list, arm, last_cancel)
            creator = np.fromiter((first[ident_list[j]] for j in arm_order.tolist()), dtype=np.int64,
                                  count=arm_order.size)
            by_idle = idle[creator]
            aux[by_idle] = (cs.slot << CL.TOUCH_INDEX_BITS) | records["aux1"][keyed[creator[by_idle]]]
        try:
            slots, _gens = wheel.schedule_many(idents[arm_order], deadlines[arm_order], gid, seqs[arm_order], aux)
        except InvalidRequest:  # not expected (deadlines were checked): apply the collapsed arms one by one
            slots = np.full(arm_order.size, -1, dtype=np.int64)
            for n, j in enumerate(arm_order.tolist()):
                try:
                    slots[n] = wheel.schedule_ident(ident_list[j], int(deadlines[j]), gid, int(seqs[j]), int(aux[n]))[0]
                except ArenaFull:
                    pass
                except InvalidRequest as exc:
                    slots[n] = 0  # reported here, not as arena full
                    i = int(keyed[j])
                    rejects.append(_rejected(int(seqs[j]), records["key"][i].tobytes(), int(records["key_meta"][i]),
                                             str(exc), M.Rejected.INVALID_DEADLINE))
        refused = arm_order[slots < 0]
        refused_idents = {ident_list[j] for j in refused.tolist()}
        if refused.size:
            self._reject_refused(records, keyed, ident_list, arm, last_cancel, refused_idents, rejects)
        if recorder is not None:
            self._record_batch(gid, records, keyed, kops, deadlines, ident_list, arm, previous, refused_idents)

    def _record_batch(self, gid, records, keyed, kops, deadlines, ident_list, arm, previous, refused) -> None:
        """Journal the keyed commands of a batch, one event each, in command order."""
        idle = np.where(kops == C.ADD_IDLE, records["aux0"][keyed], -1).tolist()
        self.recorder.commands_many(gid, ident_list, arm.tolist(), deadlines.tolist(), records["seq"][keyed].tolist(),
                                    [None if i < 0 else i for i in idle], previous, refused)

    @staticmethod
    def _first_arms(ident_list: list, arm: np.ndarray, last_cancel: dict) -> dict:
        """ident -> index of its first arm after its last cancel (the arm that created the record)."""
        first: dict = {}
        for j in np.flatnonzero(arm).tolist():
            ident = ident_list[j]
            if ident not in first and j > last_cancel.get(ident, -1):
                first[ident] = j
        return first

    @staticmethod
    def _reject_refused(records, keyed, ident_list, arm, last_cancel, refused: set, rejects: list) -> None:
        for j in np.flatnonzero(arm).tolist():
            ident = ident_list[j]
            if ident in refused and j > last_cancel.get(ident, -1):
                i = int(keyed[j])
                rejects.append(_rejected(int(records["seq"][i]), records["key"][i].tobytes(),
                                         int(records["key_meta"][i]), "the arena is full", M.Rejected.ARENA_FULL))

    def _release_acks(self, cs: ClientSlot, records: np.ndarray, ack_at: np.ndarray) -> None:
        """ACK records of a batch: :meth:`_ack_allowed` each, then one ``release_many``."""
        if not ack_at.size:
            return
        epoch = self.arena_epoch
        unacked = cs.unacked
        allowed = self._ack_allowed
        slots, gens = [], []
        for slot, gen, stamp in zip(records["aux0"][ack_at].tolist(), records["aux1"][ack_at].tolist(),
                                    records["seq"][ack_at].tolist()):
            if (stamp == epoch or not stamp) and unacked.get(slot) == gen:  # the usual case, inline
                del unacked[slot]
            elif not allowed(cs, slot, gen, stamp):
                continue
            slots.append(slot)
            gens.append(gen)
        if slots:
            recorder = self.recorder
            fired = [_fired_or_none(self.wheel, s) for s in slots] if recorder is not None else None
            released = self.wheel.release_many(slots, gens)
            if fired is not None:  # journal what each released record was (read before the release)
                for info, ok in zip(fired, released.tolist()):
                    if ok and info is not None:
                        key, _deadline, group, tag, _aux, _gen = info
                        recorder.acked(group, key, tag)

    def _record_command(self, op, meta, raw_key, deadline, seq, aux0, aux1, cs: ClientSlot) -> None:
        """Apply one command and journal what it did (the slower path used with --journal)."""
        wheel, recorder, gid = self.wheel, self.recorder, cs.group
        if op == C.ACK:
            if self._ack_allowed(cs, aux0, aux1, seq):
                key, _deadline, group, tag, _aux, _gen = wheel.fired(aux0)
                if wheel.release(aux0, aux1):
                    recorder.acked(group, key, tag)
            return
        key = decode_key(raw_key, meta)
        previous = wheel.lookup(key, gid)
        if op == C.CANCEL:
            wheel.cancel_ident(_META[meta] + raw_key, gid)
            recorder.cancelled(gid, key, seq, previous)
            return
        idle = aux0 if op == C.ADD_IDLE else None
        aux = (cs.slot << CL.TOUCH_INDEX_BITS) | aux1 if op == C.ADD_IDLE else -1
        wheel.schedule_ident(_META[meta] + raw_key, deadline, gid, seq, aux)
        recorder.armed(gid, key, deadline, seq, previous, idle)

    def _poison(self, cs: ClientSlot, reason: str) -> None:
        log.warning("client slot %d (pid %d): %s; disconnecting it, its group's timers stay", cs.slot, cs.pid, reason)
        cs.poisoned = True
        self.totals["clients_dropped_total"] += 1
        if cs.session is not None:
            self.close_session(cs.session, reason, goodbye=True)

    def _expire(self, now: int) -> None:
        """Fire what is due at ``now``: idle timers that were touched go back on the wheel,
        the rest join their group's delivery queue (and the lateness histogram)."""
        if self.recorder is not None:
            self._expire_journaled(now)
            return
        # expire_many costs tens of us per call and less per timer; expire the reverse. A
        # level-1 bucket (its expiration a multiple of tick_ms * wheel_size) cascades
        # thousands of timers, a backlog (the clock ran more than a tick past the first
        # due bucket) covers many buckets, and a rate of many per level-0 bucket shows
        # in the previous call: batch methods then; one level-0 bucket of a few, per item.
        wheel = self.wheel
        due = wheel.next_deadline()
        if due is None or due > now:
            wheel.expire(now)  # nothing is due: only moves the clock
            return
        if self._last_expired < _EXPIRE_MANY_MIN and now - due <= wheel.tick_ms and due % self._level1_tick_ms:
            slots = wheel.expire(now)
            self._last_expired = len(slots)
            if slots:
                self._queue_rows(slots, wheel.records_of(slots).tolist(), now)
            return
        slots = wheel.expire_many(now)
        self._last_expired = slots.size
        if not slots.size:
            return
        records = wheel.records_of(slots)
        if slots.size < _COLUMNS_MIN:
            self._queue_rows(slots.tolist(), records.tolist(), now)
            return
        idle = records["aux"] >= 0
        if idle.any():
            keep = np.ones(slots.size, dtype=bool)
            for j in np.flatnonzero(idle).tolist():
                record = records[j]
                if self._idle_rearmed(int(slots[j]), int(record["gen"]), int(record["aux"]), now):
                    keep[j] = False
            if not keep.all():
                slots, records = slots[keep], records[keep]
                if not slots.size:
                    return
        deadlines = records["deadline"]
        late_us = (now - deadlines) * 1000
        self._lateness_sum_us += int(late_us.sum())
        # bucket i: <= bounds[i], like Prometheus le (searchsorted "left" is bisect_left)
        counts = np.bincount(np.searchsorted(_LATENESS_BOUNDS_US, late_us, side="left"), minlength=AL.LATENESS_BUCKETS)
        lateness = self._lateness_counts
        for i, count in enumerate(counts.tolist()):
            if count:
                lateness[i] += count
        late = (deadlines < self.started_ms).tolist()
        groups = records["group"]
        first = int(groups[0])
        if (groups == first).all():
            self.queues[first].extend(zip(slots.tolist(), records["gen"].tolist(), repeat(now), late))
            return
        slot_list, gen_list, group_list = slots.tolist(), records["gen"].tolist(), groups.tolist()
        queues = self.queues
        for j, group in enumerate(group_list):
            queues[group].append((slot_list[j], gen_list[j], now, late[j]))

    def _queue_rows(self, slot_list: list, rows: list, now: int) -> None:
        """:meth:`_expire` for a few timers: the same steps on record tuples, without numpy passes."""
        lateness = self._lateness_counts
        bounds = AL.LATENESS_BOUNDS_US
        queues = self.queues
        started = self.started_ms
        late_sum = 0
        for s, (deadline, _prev, _next, gen, _tag, aux, group, _state, _meta, _key) in zip(slot_list, rows):
            if aux >= 0 and self._idle_rearmed(s, gen, aux, now):
                continue
            late_us = (now - deadline) * 1000
            late_sum += late_us
            lateness[bisect.bisect_left(bounds, late_us)] += 1  # bucket i: <= bounds[i], like Prometheus le
            queues[group].append((s, gen, now, deadline < started))
        self._lateness_sum_us += late_sum

    def _idle_rearmed(self, slot: int, gen: int, aux: int, now: int) -> bool:
        """An idle timer came due: if its key was touched since, put it back on the wheel
        (or, if the key was armed again meanwhile, release it) and return True."""
        rearm_at, _idle_ms = self._idle_check(aux, now)
        if rearm_at is None:
            return False
        wheel = self.wheel
        if not wheel.rearm_fired(slot, gen, rearm_at):
            wheel.release(slot, gen)  # the key was armed again meanwhile
        return True

    def _idle_check(self, aux: int, now: int) -> tuple[int | None, int]:
        """For an idle timer that came due at ``now``: (when it must fire instead, or None
        to fire it now; its idle_ms, 0 when unknown).

        The last touch and the idle time are read from the client's touch table,
        which the client writes: impossible values poison that client (its session
        ends; the timer fires now). A client that has not handed its ring back since
        a daemon restart has its touches out of reach for a while: its idle timers
        wait ``_IDLE_WAIT_MS`` at a time, up to ``resume_grace_s``, rather than
        firing for connections that may well be active."""
        cs = self.clients.get(aux >> CL.TOUCH_INDEX_BITS)
        if cs is None or cs.poisoned:
            return None, 0
        if cs.segment is None:
            waited_ms = now - cs.orphan_since
            return (now + _IDLE_WAIT_MS if waited_ms < self.config.resume_grace_s * 1000 else None), 0
        try:
            # the bound for a touch is the clock now, not the iteration's ``now``: the client
            # may have touched after this iteration read it
            activity = cs.segment.read_activity(aux & CL.TOUCH_INDEX_MASK, max(now, mono_ms()))
        except ProtocolError as exc:
            self._poison(cs, f"touch table: {exc}")
            return None, 0
        if activity is None:
            return None, 0
        touched, idle_ms = activity
        return (touched + idle_ms if touched + idle_ms > now else None), idle_ms

    def _expire_journaled(self, now: int) -> None:
        """:meth:`_expire` one timer at a time, journaling every event (with --journal)."""
        wheel = self.wheel
        slots = wheel.expire(now)
        if not slots:
            return
        lateness = self._lateness_counts
        bounds = AL.LATENESS_BOUNDS_US
        queues = self.queues
        started = self.started_ms
        recorder = self.recorder
        recorder.begin()
        late_sum = 0
        for s in slots:
            key, deadline, group, tag, aux, gen = wheel.fired(s)
            idle_ms = 0  # journaled with the fire: an idle timer's idle_ms is in its client's touch table
            if aux >= 0:  # an idle timer: was it touched since it was armed?
                rearm_at, idle_ms = self._idle_check(aux, now)
                if rearm_at is not None:
                    if wheel.rearm_fired(s, gen, rearm_at):
                        recorder.idle_rearmed(group, key, deadline, rearm_at, tag, idle_ms)
                    else:
                        wheel.release(s, gen)  # the key was armed again meanwhile
                    continue
            late_us = (now - deadline) * 1000
            late_sum += late_us
            lateness[bisect.bisect_left(bounds, late_us)] += 1  # bucket i: <= bounds[i], like Prometheus le
            late = deadline < started
            queues[group].append((s, gen, now, late))
            recorder.fired(group, key, deadline, tag, now, late, idle_ms or None)
        self._lateness_sum_us += late_sum
        recorder.commit(now)

    def _dispatch(self) -> None:
        """Send queued expirations to live group members, round robin, one frame per batch.

        A queued (slot, generation) that is no longer FIRED with that generation (it
        was acknowledged meanwhile, e.g. by an ack left in a ring across a restart) is
        dropped. The frame is built from the records' columns: an ``Expirations``
        message is a msgpack array ``["expirations", [[key_bytes, key_meta, deadline_ms,
        fired_ms, seq, slot, generation, late], ...]]`` (``array_like`` structs), so it
        is encoded from tuples without building ``Expiry`` objects.
        """
        batch = self.config.delivery_batch
        for gid, queue in self.queues.items():
            if not queue:
                continue
            members = [m for m in self.members.get(gid, ()) if not m.congested and not m.closed]
            if not members:
                continue
            while queue and members:
                self._rr += 1
                member = members[self._rr % len(members)]
                popleft = queue.popleft
                taken = [popleft() for _ in range(min(batch, len(queue)))]
                items = self._expiry_items(taken) if len(taken) >= _COLUMNS_MIN else self._expiry_rows(taken)
                if items:
                    member.client.unacked.update([(item[5], item[6]) for item in items])
                    member.send(_expirations_frame(items))
                    self.totals["delivered_total"] += len(items)
                members = [m for m in members if not m.congested and not m.closed]

    def _expiry_rows(self, taken: list) -> list[tuple]:
        """Expiry tuples (the field order of ``M.Expiry``) for queued (slot, gen, fired_ms, late)
        entries still FIRED with that generation; a few at a time, from record tuples."""
        rows = self.wheel.records_of([entry[0] for entry in taken]).tolist()
        fired = AL.FIRED
        return [
            (key[: meta & 0x3F], meta, deadline, fired_ms, tag, s, gen, late)
            for (s, gen, fired_ms, late), (deadline, _p, _n, rgen, tag, _aux, _g, state, meta, key) in zip(taken, rows)
            if state == fired and rgen == gen
        ]

    def _expiry_items(self, taken: list) -> list[tuple]:
        """:meth:`_expiry_rows` for a large batch, from the records' columns."""
        slot_list, gen_list, fired_list, late_list = zip(*taken)
        records = self.wheel.records_of(slot_list)
        ok = (records["state"] == AL.FIRED) & (records["gen"] == np.array(gen_list, dtype=np.int64))
        if not ok.all():
            keep = np.flatnonzero(ok).tolist()
            records = records[ok]
            slot_list = [slot_list[j] for j in keep]
            gen_list = [gen_list[j] for j in keep]
            fired_list = [fired_list[j] for j in keep]
            late_list = [late_list[j] for j in keep]
        metas = records["key_meta"].tolist()
        keys = [raw[: meta & 0x3F] for raw, meta in zip(records["key"].tolist(), metas)]
        return list(zip(keys, metas, records["deadline"].tolist(), fired_list, records["tag"].tolist(),
                        slot_list, gen_list, late_list))

    # ------------------------------------------------------------------ stats

    def arena_busy(self) -> None:
        """A callback that may write the arena outside the loop's iteration (a client's
        message, a closed session, maintenance) calls this first: the arena stops
        counting as at rest for wheelctl's copies (:func:`wheeld.shm.check.check`) until
        the loop parks again with its counters published."""
        self.wheel.header_words()[AL.H_PARKED // 8] = 0

    def _publish(self, now: int) -> None:
        """Counters into the arena header: the wheel's own, then the daemon's."""
        wheel = self.wheel
        totals = self.totals
        totals["daemon_heartbeat_ms"] = now
        totals["clients_connected"] = sum(1 for s in self.sessions if s.client is not None)
        totals["groups_active"] = sum(1 for members in self.members.values() if members)
        totals["undelivered"] = sum(len(q) for q in self.queues.values())
        wheel.publish_stats()
        hq = wheel.header_words()
        counters = AL.H_COUNTERS // 8
        self.status.publish(wheel.capacity, hq[counters + AL.COUNTER["pending"]],
                            hq[counters + AL.COUNTER["fired_unacked"]])
        base = AL.H_COUNTERS // 8
        for name, value in totals.items():
            hq[base + AL.COUNTER[name]] = value
        lat_base = AL.H_LATENESS // 8
        counts = self._lateness_counts
        for i, count in enumerate(counts):
            if count:
                hq[lat_base + i] += count
                counts[i] = 0
        if self._lateness_sum_us:
            hq[AL.H_LATENESS_SUM_US // 8] += self._lateness_sum_us
            self._lateness_sum_us = 0
        self._stats_pending = len(wheel)
        if self.config.group_quota:
            self._publish_group_full()

    def _publish_group_full(self) -> None:
        """Tell the members of a group at its quota (their ``add`` raises QuotaExceeded at
        once), and those of a group back under it; written on changes only."""
        quota, live = self.config.group_quota, self.wheel.group_live
        full = {gid for gid, members in self.members.items() if members and live(gid) >= quota}
        for gid in full ^ self._full_groups:
            for session in self.members.get(gid, ()):
                session.client.segment.set_group_full(gid in full)
        self._full_groups = full

    def _reclaim_groups(self) -> None:
        """Free the id of every group with no member, no client slot, nothing queued and
        no live record (and forget its owner): the id can go to a new name. Without this
        each group name ever used would hold one of the arena's ids for good."""
        keep = {cs.group for cs in self.clients.values()}
        keep.update(gid for gid, members in self.members.items() if members)
        keep.update(gid for gid, queue in self.queues.items() if queue)
        wheel = self.wheel
        forget = self.recorder.forget_group if self.recorder is not None else wheel.forget_group
        for gid in list(wheel.groups()):
            if gid and gid not in keep and wheel.group_live(gid) == 0 and forget(gid):
                CL.OWNER.pack_into(self._clients_buf, CL.owner_offset(gid), CL.OWNER_NONE, 0)
                self.members.pop(gid, None)
                self.queues.pop(gid, None)
                self.totals["groups_reclaimed_total"] += 1

    def _status_line(self) -> str:
        w = self.wheel
        return f"{len(w)} pending, {len(self.sessions)} clients, {w.counters()['fired_unacked']} awaiting ack"

    # ------------------------------------------------------------------ sessions
    def _on_accept(self) -> None:
        for _ in range(64):
            try:
                sock, _addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._pause_accept(exc)
                else:
                    self._log_limiter.warning("accept", "accept: %s", exc)
                return
            sock.setblocking(False)
            try:
                pid, uid, gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
            except OSError:
                pid = uid = gid = -1
            if self._handshaking[uid] >= self.config.max_handshakes_per_uid:
                self._log_limiter.warning("handshakes", "uid %d has %d connections without a Hello; closing more",
                                          uid, self._handshaking[uid])
                self.totals["clients_refused_total"] += 1
                sock.close()
                continue
            self._handshaking[uid] += 1
            session = Session(self, sock, pid, uid, gid)
            self.sessions.add(session)
            self.loop.add_reader(sock.fileno(), session.on_readable)
            self.loop.call_later(self.config.handshake_timeout_s, self._handshake_deadline, session)

    def _pause_accept(self, exc: OSError) -> None:
        """Out of descriptors: stop accepting (the listening socket would stay readable and
        spin the loop) until a session closes or a second has passed."""
        if self._accept_paused:
            return
        self._accept_paused = True
        self.totals["accept_pauses_total"] += 1
        self.loop.remove_reader(self._listener.fileno())
        self._log_limiter.error("accept-paused", "accept paused: %s (%d sessions); resuming when a session closes "
                                "or in %.0f s", exc.strerror, len(self.sessions), _MAINTAIN_S)

    def _resume_accept(self) -> None:
        if self._accept_paused and not self._stopping:
            self._accept_paused = False
            self.loop.add_reader(self._listener.fileno(), self._on_accept)

    def _handshake_deadline(self, session: Session) -> None:
        if not session.closed and session.client is None:
            self.close_session(session, "no Hello within the handshake timeout", goodbye=True)

    def _refuse(self, session: Session, reason: str, code: str) -> None:
        log.warning("refusing client pid %d uid %d: %s", session.pid, session.uid, reason)
        self.totals["clients_refused_total"] += 1
        session.send(M.encode_daemon_frame(M.Refused(reason, code)))
        self.close_session(session, reason)

    def on_message(self, session: Session, message) -> None:
        if type(message) is M.Doorbell:
            if message.urgent or not self.config.coalesce_us:
                self.wake()
            else:
                self._soft_wake()
            return
        if type(message) is M.Hello:
            if session.client is not None:
                raise ProtocolError("Hello sent twice")
            fd = session.passed_fds.pop(0) if session.passed_fds else None
            try:
                self._hello(session, message, fd)
            finally:
                session.close_passed_fds()
            return
        if session.client is None:
            raise ProtocolError(f"{type(message).__name__} before Hello")
        if type(message) is M.Bye:
            cs = session.client
            self.close_session(session, "client said bye")
            if cs is not None:
                cs.orphan_since = -_GC_INTERVAL_MS  # a clean goodbye: release its ring at the next check
                self._last_gc = 0
            return
        raise ProtocolError(f"unexpected {type(message).__name__}")

    # ---- who may do what
    def _privileged(self, session: Session) -> bool:
        """Root and the daemon's own uid may use any group (they can read the arena anyway)."""
        return session.uid == 0 or session.uid == os.geteuid()

    def _gids_of(self, session: Session) -> frozenset[int]:
        """The peer's primary gid and the supplementary groups of its user (SO_PEERCRED
        carries only the primary one), cached for a minute."""
        now = time.monotonic()
        cached = self._groups_of_uid.get(session.uid)
        if cached is None or now - cached[0] > 60:
            try:
                import pwd

                entry = pwd.getpwuid(session.uid)
                gids = frozenset(os.getgrouplist(entry.pw_name, entry.pw_gid))
            except (KeyError, OSError):
                gids = frozenset()
            cached = self._groups_of_uid[session.uid] = (now, gids)
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

    def _group_owner(self, group_name: str, group: int | None) -> tuple[int, int] | None:
        """(kind, id) of whoever owns a group: ``--group-owner``, else the first uid that
        joined it (kept in the client table), else nobody yet."""
        static = self._static_owners.get(group_name)
        if static is not None:
            return static
        if group is None:
            return None
        kind, ident = CL.OWNER.unpack_from(self._clients_buf, CL.owner_offset(group))
        return None if kind == CL.OWNER_NONE else (kind, ident)

    def _may_join(self, session: Session, owner: tuple[int, int] | None) -> bool:
        if owner is None or self._privileged(session):
            return True
        kind, ident = owner
        if kind == CL.OWNER_UID:
            return session.uid == ident
        return ident in self._gids_of(session)

    def _claim(self, session: Session, group_name: str, group: int) -> None:
        if self._privileged(session) or group_name in self._static_owners:
            return
        if CL.OWNER.unpack_from(self._clients_buf, CL.owner_offset(group))[0] == CL.OWNER_NONE:
            CL.OWNER.pack_into(self._clients_buf, CL.owner_offset(group), CL.OWNER_UID, session.uid)
            log.info("group %r (id %d) now belongs to uid %d", group_name, group, session.uid)

    # ---- the handshake
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
        cs.session = session
        session.client = cs
        self._write_client_entry(cs.slot, cs)
        self.members[cs.group].append(session)
        self.totals["clients_total"] += 1
        cs.segment.set_group_full(cs.group in self._full_groups)
        status = self.status.readonly_fd
        welcome = M.Welcome(
            M.PROTOCOL_VERSION, cs.slot, cs.label, cs.segment.ring_capacity, cs.segment.touch_capacity,
            self.wheel.name or "", self.wheel.tick_ms, CLIENT_MAX_DELAY_MS, self._token(cs.slot, cs.label),
            self.arena_epoch,
            status is not None, resumed,
        )
        session.send_with_fds(M.encode_daemon_frame(welcome), [cs.segment.fd] + ([status] if status is not None else []))
        if cs.unanswered_flush is not None:  # a client whose session the daemon closed may be waiting for it
            session.send(M.encode_daemon_frame(M.Applied(cs.unanswered_flush)))
            cs.unanswered_flush = None
        log.info("client pid %d uid %d joined group %r (slot %d, ring %s%s)", session.pid, session.uid, hello.group,
                 cs.slot, cs.label, ", handed back" if resumed else "")
        self.wake()

    def _admit(self, session: Session, hello: M.Hello, passed: _Passed) -> tuple[ClientSlot, bool] | None:
        """The checks of a Hello and (the client slot it gets, whether the ring it handed
        back is that slot's ring), or None when it is refused."""
        cfg = self.config
        if hello.protocol_version != M.PROTOCOL_VERSION:
            self._refuse(session, f"protocol version {hello.protocol_version} not supported (this daemon speaks "
                                  f"{M.PROTOCOL_VERSION}); upgrade the client library", M.Refused.VERSION)
            return None
        if not self._allowed(session):
            self._refuse(session, f"uid {session.uid} gid {session.gid} is not allowed to use this wheeld",
                         M.Refused.NOT_ALLOWED)
            return None
        try:
            existing = self.wheel.group_id(hello.group, create=False)
        except KeyError:
            existing = None
        except InvalidRequest as exc:
            self._refuse(session, str(exc), M.Refused.BAD_REQUEST)
            return None
        owner = self._group_owner(hello.group, existing)
        if not self._may_join(session, owner):
            kind = "uid" if owner[0] == CL.OWNER_UID else "group id"
            self._refuse(session, f"group {hello.group!r} belongs to {kind} {owner[1]}; uid {session.uid} may not "
                                  f"join it", M.Refused.NOT_ALLOWED)
            return None
        try:
            try:
                group = existing if existing is not None else self.wheel.group_id(hello.group)
            except GroupLimit:
                self._reclaim_groups()  # groups that went idle since the last periodic pass
                group = self.wheel.group_id(hello.group)
        except ArenaFull as exc:
            self._refuse(session, f"{exc}: groups with no member and nothing pending are reclaimed; use fewer "
                                  f"group names or a larger --max-groups", M.Refused.GROUP_LIMIT)
            return None
        self._claim(session, hello.group, group)
        if passed.fd is not None:
            cs = self._resumed_slot(session, hello, group, passed)
            if cs is not None:
                return cs, True
            if hello.resume_segment in self._by_label:
                passed.close()  # a ring this daemon knows, not proven to be the caller's: never adopted
        slot = self._free_slot_number(hello.resume_segment)
        if slot is None:
            self._refuse(session, "too many clients", M.Refused.BUSY)
            return None
        label = f"{segment_prefix(cfg.name)}{slot}-{secrets.token_hex(4)}"
        segment = None
        if passed.fd is not None:  # a ring from a daemon that is gone (a reboot): its commands are still to apply
            # ...and from the client's last acknowledged flush on when that daemon had another arena:
            # it may have applied some of them without making them durable before the power cut
            replay = hello.replay_epoch and hello.replay_epoch != self.arena_epoch
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
        self.clients[slot] = cs
        self._by_label[label] = cs
        return cs, resumed

    def _resumed_slot(self, session: Session, hello: M.Hello, group: int, passed: _Passed) -> ClientSlot | None:
        """The slot a reconnecting client had, if its token proves it and the ring it handed
        back is that slot's ring (this daemon's, or one to adopt after a restart)."""
        cs = self._by_label.get(hello.resume_segment)
        if (cs is None or cs.poisoned or cs.group != group or cs.uid != session.uid
                or not hmac.compare_digest(self._token(cs.slot, cs.label).to_bytes(8, "little"),
                                           hello.resume_token.to_bytes(8, "little"))):
            return None
        if cs.segment is not None:  # this daemon still drains it: the client lost its connection
            if not cs.segment.same_file(passed.fd):
                return None
            if cs.session is not None:  # we have not noticed yet: the token and the ring prove it is gone
                self.close_session(cs.session, "the client reconnected")
            return cs
        try:
            cs.segment = ClientSegment.adopt(passed.take(), cs.label, self.config.ring_capacity,
                                             self.config.touch_capacity)
        except ProtocolError as exc:
            log.warning("client slot %d: the ring handed back is unusable (%s)", cs.slot, exc)
            self._release_slot(cs)
            return None
        return cs

    def _free_slot_number(self, previous_label: str) -> int | None:
        """A free client slot: the one the label names when free (a ring from before a
        reboot keeps its slot, and so its arming tags), else the next one round robin."""
        limit = min(self.config.max_clients, CL.MAX_CLIENTS)
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

    def _token(self, slot: int, label: str) -> int:
        """The resume token of a slot: an HMAC under the instance secret, never stored."""
        digest = hmac.new(self.lock.secret, f"{slot}:{label}".encode(), "sha256").digest()
        return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)

    def close_session(self, session: Session, reason: str, goodbye: bool = False, resume: bool = False) -> None:
        if session.closed:
            return
        self.arena_busy()
        if goodbye:
            try:
                session.sock.send(M.encode_daemon_frame(M.Goodbye(reason[:200] or "closed")))
            except OSError:
                pass
        session.closed = True
        session.close_passed_fds()
        self.sessions.discard(session)
        fd = session.sock.fileno()
        if fd >= 0:
            self.loop.remove_reader(fd)
            if session.writing:
                self.loop.remove_writer(fd)
        session.sock.close()
        self._resume_accept()
        cs = session.client
        if cs is None:
            self._handshaking[session.uid] -= 1
            if self._handshaking[session.uid] <= 0:
                del self._handshaking[session.uid]
            log.info("connection from pid %d closed before the handshake: %s", session.pid, reason)
            return
        log.info("client pid %d (slot %d, group %s) left: %s", session.pid, cs.slot, cs.group_name, reason)
        members = self.members.get(cs.group)
        if members and session in members:
            members.remove(session)
        cs.session = None
        cs.orphan_since = mono_ms()
        if not cs.poisoned and not resume:
            self._apply(cs)  # acks it pushed before it went are applied before we redeliver
        self._requeue(cs.take_unacked(), cs.group)
        self.wake()

    def _requeue(self, pairs: list[tuple[int, int]], group: int) -> None:
        """Expirations in flight to a client that is gone (or too slow) go to the front of its group's queue."""
        if pairs:
            queue = self.queues[group]
            now = mono_ms()
            queue.extendleft((s, gen, now, False) for s, gen in reversed(pairs))
            self.totals["redelivered_total"] += len(pairs)

    def _collect_orphans(self, now: int) -> None:
        """Forget client slots whose client is gone: once the ring is drained and no idle
        timer refers to the touch table any more; a slot waiting for its client after a
        restart once ``resume_grace_s`` has passed; a poisoned slot at once."""
        orphans = [cs for cs in self.clients.values() if cs.session is None and now - cs.orphan_since >= _GC_INTERVAL_MS]
        if not orphans:
            self._reclaim_groups()
            return
        referenced = self._touch_references()
        grace_ms = self.config.resume_grace_s * 1000
        for cs in orphans:
            if cs.segment is None:
                if now - cs.orphan_since < grace_ms:
                    continue
                log.warning("client slot %d (pid %d) did not come back within %.0f s; its ring is forgotten",
                            cs.slot, cs.pid, self.config.resume_grace_s)
            elif not cs.poisoned:
                try:
                    if cs.segment.depth():
                        continue
                except ProtocolError:
                    pass
                if cs.slot in referenced:
                    continue
            self._release_slot(cs, referenced)
        self._reclaim_groups()

    def _touch_references(self) -> set[int]:
        """Client slots whose touch table some live idle timer refers to."""
        rec = self.wheel.records
        first = self.wheel.first_entry
        aux = rec["aux"][first:]
        state = rec["state"][first:] & AL.STATE_MASK
        live_aux = aux[(state != AL.FREE) & (aux >= 0)] >> CL.TOUCH_INDEX_BITS
        return set(np.unique(live_aux).tolist())

    def _release_slot(self, cs: ClientSlot, referenced: set[int] | None = None) -> None:
        """Forget a client slot. Idle timers that still refer to its touch table become
        plain timers (their deadline stays): the slot may be given to another client."""
        if referenced is None:
            referenced = self._touch_references()
        if cs.slot in referenced:
            rec = self.wheel.records
            first = self.wheel.first_entry
            aux = rec["aux"][first:]
            mine = (aux >= 0) & ((aux >> CL.TOUCH_INDEX_BITS) == cs.slot) & ((rec["state"][first:] & AL.STATE_MASK) != AL.FREE)
            aux[mine] = -1
            log.info("client slot %d: %d idle timers lose their touch table and fire at their deadline",
                     cs.slot, int(mine.sum()))
        log.info("client slot %d (pid %d) released", cs.slot, cs.pid)
        if cs.segment is not None:
            cs.segment.close()
        del self.clients[cs.slot]
        self._by_label.pop(cs.label, None)
        self._write_client_entry(cs.slot, None)

    # ---- bookkeeping, once a second
    def _maintain(self) -> None:
        """Frames that never complete, expirations nobody acknowledges, a paused accept."""
        self._maintain_handle = self.loop.call_later(_MAINTAIN_S, self._maintain)
        self.arena_busy()
        now = time.monotonic()
        timeout = self.config.frame_timeout_s
        for session in [s for s in self.sessions if s.partial_since and now - s.partial_since > timeout]:
            self.close_session(session, f"a frame stayed incomplete for more than {timeout:g} s", goodbye=True)
        ack_timeout = self.config.ack_timeout_s
        for session in [s for s in self.sessions if s.writing and now - s.stuck_since > ack_timeout]:
            self.close_session(session, f"it has not read its socket for {ack_timeout:g} s")
        self._resume_accept()
        for cs in self.clients.values():  # ring depths for wheelctl (rings are memfds it cannot map)
            if cs.segment is not None and not cs.poisoned:
                try:
                    depth = cs.segment.depth()
                except ProtocolError:
                    continue
                CL.DEPTH.pack_into(self._clients_buf, CL.entry_offset(cs.slot) + CL.DEPTH_OFFSET, depth)
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
                self._requeue(overdue, cs.group)
        self.wake()


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
    """At most one line per ``_LOG_EVERY_S`` per topic, saying how many were held back."""

    def __init__(self):
        self._last: dict[str, float] = {}
        self._held: collections.Counter = collections.Counter()

    def warning(self, topic: str, message: str, *args) -> None:
        self._log(logging.WARNING, topic, message, args)

    def error(self, topic: str, message: str, *args) -> None:
        self._log(logging.ERROR, topic, message, args)

    def _log(self, level: int, topic: str, message: str, args) -> None:
        now = time.monotonic()
        if now - self._last.get(topic, -_LOG_EVERY_S) < _LOG_EVERY_S:
            self._held[topic] += 1
            return
        self._last[topic] = now
        held = self._held.pop(topic, 0)
        log.log(level, message + (f" ({held} more like this since the last one)" if held else ""), *args)


_DAEMON_TOTALS = (
    "ring_depth", "ring_full_total", "commands_total", "rejected_total", "clients_total", "clients_refused_total", "clients_dropped_total",
    "delivered_total", "redelivered_total", "wakeups_total", "loop_iterations_total", "daemon_restarts_total", "daemon_pid",
    "daemon_started_ms", "daemon_heartbeat_ms", "clients_connected", "groups_active", "undelivered",
    "ack_timeouts_total", "arenas_set_aside_total", "accept_pauses_total",
    "journal_damaged_ranges_total", "journal_damaged_lines_total", "groups_reclaimed_total",
)


def _rejected(seq: int, raw_key: bytes, meta: int, reason: str, code: str) -> M.Rejected:
    return M.Rejected(seq, bytes(raw_key[: meta & 0x3F]), meta, reason, code)


def _expirations_frame(items: list[tuple]) -> bytearray:
    """A length-prefixed ``Expirations`` frame from item tuples in ``Expiry`` field order
    (msgspec encodes an ``array_like`` struct and a tuple of its fields alike)."""
    buffer = bytearray(framing.HEADER_SIZE)
    _encoder.encode_into((_EXPIRATIONS_TAG, items), buffer, framing.HEADER_SIZE)
    framing.write_header(buffer, len(buffer) - framing.HEADER_SIZE)
    return buffer


def _fired_or_none(wheel: TimerWheel, slot: int):
    try:
        return wheel.fired(slot)
    except InvalidRequest:
        return None


def run(config: Config) -> int:
    return Daemon(config).run()
