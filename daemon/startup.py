"""Start-up: the arena (attached, or made and rebuilt from the journal) and the socket.

Called with the instance lock held (:class:`wheeld.daemon.instance.InstanceLock`).
The arena's segment lock is taken before the arena is written (attached or
made); an arena another process holds stops the start. An arena that cannot be
trusted or used is set aside (see :mod:`wheeld.daemon.instance`), never refused.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import time
from dataclasses import dataclass, field

from wheeld.protocol.errors import InvalidRequest, WheeldError
from wheeld.protocol.naming import arena_name, shm_path
from wheeld.shm.arena import Segment
from wheeld.shm.arena import unlink as unlink_segment
from wheeld.shm.wheel import TimerWheel

from .activation import listen_fds, unix_stream_listener
from .config import Config
from .instance import Unusable, file_identity, set_aside, take_segment

log = logging.getLogger("wheeld")


@dataclass
class OpenedArena:
    wheel: TimerWheel
    fresh: bool  # made now (else attached)
    identity: tuple[int, int]  # the arena file's (device, inode): see instance.HeldSegment
    set_aside: list[str] = field(default_factory=list)  # unusable segments renamed on the way
    recovered: object = None  # the journal's RecoveredState, when a new arena was rebuilt from it
    next_lsn: int | None = None  # where the journal continues after that recovery


def open_arena(cfg: Config, now: int, qualifier: int | None = None) -> OpenedArena:
    """Attach the instance's arena, or create one (rebuilt from the journal when there is one).
    ``qualifier``: the uid of the segment names the daemon uses (None: the plain names)."""
    name = arena_name(cfg.name, qualifier)
    aside: list[str] = []
    attached = _attach_arena(cfg, name, aside)
    if attached is None:
        opened = _new_arena(cfg, name, now)
        opened.set_aside = aside
        return opened
    wheel, identity = attached
    log.info(
        "attached existing arena %s: %d pending, %d fired awaiting delivery (tick %d ms, wheel %d, capacity %d)",
        name, len(wheel), wheel.counters()["fired_unacked"], wheel.tick_ms, wheel.wheel_size, wheel.capacity,
    )
    for problem in wheel.repairs:
        log.warning("arena repair: %s", problem)
    _check_attached(wheel)
    if (wheel.tick_ms, wheel.wheel_size, wheel.capacity) != (cfg.tick_ms, cfg.wheel_size, cfg.capacity):
        log.warning("arena parameters differ from the command line; the arena's are used")
    return OpenedArena(wheel, False, identity, aside)


def _check_attached(wheel: TimerWheel) -> None:
    """Run the arena's one invariant checker (shm/fsck.py, through ``TimerWheel.check``)
    over what attaching left: the replayed intents and the rebuilt links, lists, key
    index and counters. A problem here is a fault of the rebuild, not of the crash
    it recovered from; it is logged, and the daemon serves on."""
    started = time.monotonic()
    problems = wheel.check()
    took_ms = (time.monotonic() - started) * 1000
    if not problems:
        log.info("arena checked after attach in %.0f ms: sound", took_ms)
        return
    log.error("arena checked after attach in %.0f ms: %d problem(s)", took_ms, len(problems))
    for problem in problems[:20]:
        log.error("arena check: %s", problem)


def _attach_arena(cfg: Config, name: str, aside: list[str]) -> tuple[TimerWheel, tuple[int, int]] | None:
    """The existing arena (its segment lock taken before it is mapped, kept by the
    mapping) and its file's identity, or None when there is none or it was set aside.
    Raises AlreadyRunning when another process holds it."""
    try:
        fd = take_segment(name, cfg.name)
    except Unusable as exc:
        reason = str(exc)
    else:
        if fd is None:
            return None
        try:
            identity = file_identity(fd)
            return TimerWheel.recover(Segment.attach(name, fd=fd)), identity
        except (WheeldError, ValueError, OSError) as exc:
            reason = f"it cannot be used: {exc}"  # unmapped: its lock went with it; renamed below
        finally:
            os.close(fd)
    moved = set_aside(name, reason)  # raises UntrustedSegment when it is not ours to move
    if moved:
        aside.append(moved)
        log.error("arena %s set aside as /dev/shm/%s because %s; a new arena is made%s", name, moved, reason,
                  " and rebuilt from the journal" if cfg.journal_dir else " (no journal: its timers are lost)")
    return None


def _new_arena(cfg: Config, name: str, now: int) -> OpenedArena:
    """A new arena, rebuilt from the journal when there is one. It is built under a
    temporary name and renamed into place only when complete: a daemon killed in the
    middle of a recovery leaves no half-filled arena that the next start would take
    for the real one (it starts the recovery over)."""
    recovered = next_lsn = None
    capacity, max_groups = cfg.capacity, cfg.max_groups
    if cfg.journal_dir:  # before the arena exists: a refusal (--journal-damage refuse) leaves nothing
        from .recovery import arena_size_for, recover_journal

        recovered = recover_journal(cfg.journal_dir, cfg.journal_damage)
        capacity, max_groups = arena_size_for(recovered, capacity, max_groups)  # room for every journaled timer
    building = f"{name}.new"
    try:
        left = take_segment(building, cfg.name)  # AlreadyRunning while another daemon builds it
    except Unusable as exc:
        log.warning("set aside %s, left by a daemon that died while building its arena", set_aside(building, str(exc)))
    else:
        if left is not None:
            os.unlink(shm_path(building))
            os.close(left)
            log.warning("removed %s, left by a daemon that died while building its arena", building)
    wheel = TimerWheel.create(  # locked by its maker from the start (Segment.create)
        capacity, tick_ms=cfg.tick_ms, wheel_size=cfg.wheel_size, name=building, start_ms=now,
        max_groups=max_groups, mode=cfg.arena_mode,
    )
    try:
        identity = os.stat(shm_path(building)).st_dev, os.stat(shm_path(building)).st_ino
        hand_to_monitors(cfg, building)
        if recovered is not None:
            from .recovery import load_recovered

            next_lsn = load_recovered(wheel, recovered, cfg.journal_dir)
        wheel._seg.rename(name)
        wheel.name = name
    except BaseException:
        wheel.close()
        unlink_segment(building)
        raise
    log.info("created arena %s (capacity %d, tick %d ms, wheel %d, %d levels)",
             name, capacity, cfg.tick_ms, cfg.wheel_size, wheel.levels)
    return OpenedArena(wheel, True, identity, recovered=recovered, next_lsn=next_lsn)


def hand_to_monitors(cfg: Config, segment_name: str) -> None:
    """Give a segment the daemon created to the monitoring group (``--monitor-group``)."""
    gid = cfg.monitor_gid
    if gid is not None:
        path = shm_path(segment_name)
        os.chown(path, -1, gid)
        os.chmod(path, 0o640)


def open_socket(cfg: Config) -> tuple[socket.socket, bool]:
    """The listening socket (systemd's, else bound at ``--socket``) and whether the
    daemon owns its path (removes it when it stops)."""
    inherited = listen_fds()
    if inherited:
        listener = unix_stream_listener(inherited)
        log.info("using the socket passed by systemd (fd %d)", listener.fileno())
        if cfg.socket_mode is not None or cfg.socket_gid is not None:
            log.warning("--socket-mode and --socket-group apply to a socket wheeld binds itself; this one is "
                        "systemd's: its SocketMode= and SocketGroup= (wheeld.socket) decide")
        listener.setblocking(False)
        return listener, False
    path = cfg.socket_path
    try:
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
    except PermissionError as exc:  # another user's directory or stale socket
        raise InvalidRequest(f"may not listen on {path}: {exc.strerror} ({exc.filename or path}); "
                             f"choose another --socket") from None
    try:
        if cfg.socket_gid is not None:
            try:
                os.chown(path, -1, cfg.socket_gid)
            except PermissionError:
                raise InvalidRequest(
                    f"may not give the socket {path} to group {_group_label(cfg.socket_gid)} (--socket-group): "
                    f"the daemon's user (uid {os.geteuid()}) must belong to that group") from None
        os.chmod(path, SOCKET_MODE if cfg.socket_mode is None else cfg.socket_mode)
        sock.listen(1024)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        os.unlink(path)
        raise
    return sock, True


#: the mode of a socket wheeld binds itself, unless --socket-mode says otherwise (the
#: default of systemd's SocketMode=, ours in wheeld.socket: the owner and the group)
SOCKET_MODE = 0o660


def _group_label(gid: int) -> str:
    import grp

    try:
        return f"{grp.getgrgid(gid).gr_name!r} (gid {gid})"
    except KeyError:
        return f"gid {gid}"
