"""Start-up: the arena (attached, or made and rebuilt from the journal) and the socket.

``open_arena(cfg, now, host, qualifier=None) -> OpenedArena`` is the core's: called
with the instance lock held (:meth:`wheeld.daemon.instance.InstanceLock.acquire`
``(cfg.name, host)``; ``qualifier`` is that lock's), it reaches named shared
memory only through ``host.shm`` (:class:`wheeld.daemon.host.SharedMemory`) and
stamps the arena with ``host.wall_ms``, so the simulator runs it over simulated
shared memory. :func:`open_socket` is the shell's (the real daemon's listening
socket; the simulator has none).
The arena's segment lock is taken before the arena is written (attached or
made); an arena another process holds stops the start. An arena that cannot be
trusted or used is set aside (see :mod:`wheeld.daemon.instance`), never refused.

An attached arena is checked: attach frees records no writer can leave (damage) and
masks a generation beyond 31 bits; with ``--journal`` every live record is then
compared with the journal and repaired from it (:mod:`wheeld.daemon.reconcile`).
Damage is never reported as sound: each repair is an ERROR line, and the records
found damaged and the timers lost (freed with no journal to restore them from)
are counted (``arena_damaged_records_total``, ``arena_timers_lost_total``).
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
from wheeld.shm.wheel import TimerWheel

from .activation import listen_fds, unix_stream_listener
from .config import Config
from .host import Host
from .instance import Unusable, create_segment, file_identity, set_aside, take_segment

log = logging.getLogger("wheeld")


@dataclass
class OpenedArena:
    wheel: TimerWheel
    fresh: bool  # made now (else attached)
    identity: tuple[int, int]  # the arena file's (device, inode): see instance.HeldSegment
    set_aside: list[str] = field(default_factory=list)  # unusable segments renamed on the way
    recovered: object = None  # the journal's RecoveredState, when a new arena was rebuilt from it
    next_lsn: int | None = None  # where the journal continues after that recovery
    damaged: int = 0  # records an attach found damaged (repaired or freed)
    lost: int = 0  # timers of damaged records nothing could restore
    # the idle timers of the journal an attached arena was compared with, (group, key, arming
    # tag) -> idle_ms (reconcile.Reconciled.idle_ms): the Recorder's known_idle
    idle_ms: dict = field(default_factory=dict)


def open_arena(cfg: Config, now: int, host: Host, qualifier: int | None = None) -> OpenedArena:
    """Attach the instance's arena, or create one (rebuilt from the journal when there is one).
    ``now``: the arena's clock (a new arena starts there); ``host``: the ports (``host.shm``
    for the segments, ``host.euid``/``host.pid`` for ownership and marks, ``host.wall_ms``);
    ``qualifier``: the uid of the segment names the daemon uses (None: the plain names).
    Raises AlreadyRunning (another process holds the arena), UntrustedSegment (an arena
    this uid may not even move), or the journal's refusal; a new arena is removed again
    when the start fails after making it (the caller removes it on a later refusal:
    ``shm_path(opened.wheel.name)`` when ``opened.fresh``)."""
    name = arena_name(cfg.name, qualifier)
    aside: list[str] = []
    attached = _attach_arena(cfg, host, name, aside)
    if attached is None:
        opened = _new_arena(cfg, host, name, now)
        opened.set_aside = aside
        return opened
    wheel, identity = attached
    log.info(
        "attached existing arena %s: %d pending, %d fired awaiting delivery (tick %d ms, wheel %d, capacity %d)",
        name, len(wheel), wheel.counters()["fired_unacked"], wheel.tick_ms, wheel.wheel_size, wheel.capacity,
    )
    idle_ms: dict = {}
    damaged, lost = _repair_attached(cfg, wheel, host, idle_ms)
    _check_attached(wheel, damaged, lost)
    if (wheel.tick_ms, wheel.wheel_size, wheel.capacity) != (cfg.tick_ms, cfg.wheel_size, cfg.capacity):
        log.warning("arena parameters differ from the command line; the arena's are used")
    return OpenedArena(wheel, False, identity, aside, damaged=damaged, lost=lost, idle_ms=idle_ms)


def _repair_attached(cfg: Config, wheel: TimerWheel, host: Host, idle_ms: dict) -> tuple[int, int]:
    """Report what attach repaired and, with a journal, reconcile the arena with it;
    return (records found damaged, timers lost). ``idle_ms`` takes the idle timers of a
    journal the arena was compared with (``Reconciled.idle_ms``)."""
    repairs, freed = list(wheel.repairs), wheel.lost
    for problem in repairs[:20]:
        log.error("arena damage: %s", problem)
    if len(repairs) > 20:
        log.error("arena damage: %d more record(s) like these", len(repairs) - 20)
    if not cfg.journal_dir:
        if freed:
            log.error("arena damage: %d damaged record(s) freed; their timers are LOST (no --journal to "
                      "restore them from)", freed)
        return len(repairs), freed
    from .reconcile import reconcile, summary
    from .recovery import host_clocks

    started = time.perf_counter()
    try:
        result = reconcile(wheel, cfg.journal_dir, cfg.name, host_clocks(host), fs=host.fs)
    except Exception:  # a fault of the check itself must not keep the daemon from serving
        log.exception("arena not compared with the journal: the check failed")
        if freed:
            log.error("arena damage: %d damaged record(s) freed; their timers are LOST", freed)
        return len(repairs), freed
    took_ms = (time.perf_counter() - started) * 1000
    if not result.trusted:
        log.info("arena not compared with the journal: %s", result.reason)
        if freed:
            log.error("arena damage: %d damaged record(s) freed; their timers are LOST (the journal cannot "
                      "restore them: %s)", freed, result.reason)
        return len(repairs), freed
    idle_ms.update(result.idle_ms)
    if result.batch_open and result.damaged:
        # the previous daemon stopped between applying a batch and journaling it: that batch
        # and damage cannot be told apart (the batch's commands are applied again from the rings)
        for example in result.examples + result.unsure:
            log.warning("arena settled from the journal: %s", example)
        log.warning("arena compared with the journal in %.0f ms, after a stop inside a batch: %s", took_ms,
                    summary(result))
        return len(repairs), result.not_restored
    for example in result.examples:
        log.error("arena damage: %s", example)
    for example in result.unsure:
        log.warning("arena settled from the journal: %s", example)
    level = logging.ERROR if result.damaged else logging.WARNING if result.fired_freed else logging.INFO
    log.log(level, "arena compared with the journal in %.0f ms: %s", took_ms, summary(result))
    return len(repairs) + result.rewritten + result.freed, result.not_restored


def _check_attached(wheel: TimerWheel, damaged: int = 0, lost: int = 0) -> None:
    """Run the arena's one invariant checker (shm/fsck.py, through ``TimerWheel.check``)
    over what attaching left: the replayed intents and the rebuilt links, lists, key
    index and counters. A problem here is a fault of the rebuild, not of the crash
    it recovered from; it is logged, and the daemon serves on. An arena in which
    damage was found and repaired is consistent, not sound: it says so."""
    started = time.perf_counter()
    problems = wheel.check()
    took_ms = (time.perf_counter() - started) * 1000
    if not problems and damaged:
        log.error("arena checked after attach in %.0f ms: consistent after repairing %d damaged record(s), "
                  "%d timer(s) lost", took_ms, damaged, lost)
        return
    if not problems:
        log.info("arena checked after attach in %.0f ms: sound", took_ms)
        return
    log.error("arena checked after attach in %.0f ms: %d problem(s)", took_ms, len(problems))
    for problem in problems[:20]:
        log.error("arena check: %s", problem)


def _attach_arena(cfg: Config, host: Host, name: str, aside: list[str]) -> tuple[TimerWheel, tuple[int, int]] | None:
    """The existing arena (its segment lock taken before it is mapped, kept by the
    mapping) and its file's identity, or None when there is none or it was set aside.
    Raises AlreadyRunning when another process holds it."""
    shm = host.shm
    try:
        fd = take_segment(host, name, cfg.name)
    except Unusable as exc:
        reason = str(exc)
    else:
        if fd is None:
            return None
        try:
            identity = file_identity(shm, fd)
            return TimerWheel.recover(shm.map(fd, name)), identity
        except (WheeldError, ValueError, OSError) as exc:
            reason = f"it cannot be used: {exc}"  # unmapped: its lock went with it; renamed below
        finally:
            shm.close(fd)
    moved = set_aside(host, name, reason)  # raises UntrustedSegment when it is not ours to move
    if moved:
        aside.append(moved)
        log.error("arena %s set aside as /dev/shm/%s because %s; a new arena is made%s", name, moved, reason,
                  " and rebuilt from the journal" if cfg.journal_dir else " (no journal: its timers are lost)")
    return None


def _clear_half_built(cfg: Config, host: Host, building: str) -> None:
    """Remove (or set aside, if unusable) the arena a daemon that died while building it
    left under ``building``; AlreadyRunning while another daemon builds it."""
    shm = host.shm
    try:
        left = take_segment(host, building, cfg.name)
    except Unusable as exc:
        log.warning("set aside %s, left by a daemon that died while building its arena",
                    set_aside(host, building, str(exc)))
        return
    if left is not None:
        try:
            shm.unlink(shm_path(building))
        finally:
            shm.close(left)
        log.warning("removed %s, left by a daemon that died while building its arena", building)


def _new_arena(cfg: Config, host: Host, name: str, now: int) -> OpenedArena:
    """A new arena, rebuilt from the journal when there is one. It is built under a
    temporary name and renamed into place only when complete: a daemon killed in the
    middle of a recovery leaves no half-filled arena that the next start would take
    for the real one (it starts the recovery over)."""
    shm = host.shm
    recovered = next_lsn = None
    capacity, max_groups = cfg.capacity, cfg.max_groups
    if cfg.journal_dir:  # before the arena exists: a refusal (--journal-damage refuse) leaves nothing
        from .recovery import arena_size_for, recover_journal

        recovered = recover_journal(cfg.journal_dir, cfg.journal_damage, fs=host.fs)
        capacity, max_groups = arena_size_for(recovered, capacity, max_groups)  # room for every journaled timer
    building = f"{name}.new"
    _clear_half_built(cfg, host, building)
    made: list[tuple[int, int]] = []

    def segment(size: int):
        """The arena's segment, locked by its maker from the start (before anything is written)."""
        fd = create_segment(host, building, cfg.arena_mode)
        try:
            made.append(file_identity(shm, fd))
            shm.ftruncate(fd, size)
            return shm.map(fd, building, size)
        except BaseException:
            shm.unlink(shm_path(building))
            raise
        finally:
            shm.close(fd)

    wheel = TimerWheel.create(
        capacity, tick_ms=cfg.tick_ms, wheel_size=cfg.wheel_size, start_ms=now, max_groups=max_groups,
        segment_factory=segment, created_wall_ms=host.wall_ms(),
    )
    try:
        hand_to_monitors(cfg, host, building)
        if recovered is not None:
            from .recovery import host_clocks, load_recovered

            next_lsn = load_recovered(wheel, recovered, cfg.journal_dir, host_clocks(host))
        wheel._seg.rename(name)
        wheel.name = name
    except BaseException:
        wheel.close()
        try:
            shm.unlink(shm_path(building))
        except FileNotFoundError:
            pass
        raise
    log.info("created arena %s (capacity %d, tick %d ms, wheel %d, %d levels)",
             name, capacity, cfg.tick_ms, cfg.wheel_size, wheel.levels)
    return OpenedArena(wheel, True, made[0], recovered=recovered, next_lsn=next_lsn)


def hand_to_monitors(cfg: Config, host: Host, segment_name: str) -> None:
    """Give a segment the daemon created to the monitoring group (``--monitor-group``)."""
    gid = cfg.monitor_gid
    if gid is not None:
        path = shm_path(segment_name)
        host.shm.chown(path, -1, gid)
        host.shm.chmod(path, 0o640)


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
