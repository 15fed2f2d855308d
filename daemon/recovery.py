"""Recovery: a journal directory read back into a new arena, and the daemon's journal opened.

``wheeld --journal DIR`` rebuilds an arena that is gone (a reboot, /dev/shm
cleared) from the journal: :func:`recover_journal` reads the directory (before
the arena exists, so a refusal leaves nothing behind), :func:`arena_size_for`
sizes the new arena so that every journaled timer fits, :func:`load_recovered`
puts the timers into it (and refuses the start, :class:`TimersNotRestored`,
should one still not go in), and :func:`open_journal` continues the journal
after them with a :class:`~wheeld.daemon.recorder.Recorder`. A daemon that
attaches an existing arena compares the journal with it first: a journal cut
short, or behind what the arena holds, is caught up with a snapshot of the arena.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from wheeld.protocol.errors import ArenaFull, InvalidRequest, JournalUnavailable, WheeldError
from wheeld.shm.wheel import MAX_DELAY_MS, TimerWheel

from wheeld.journal.files import (
    Journal,
    describe_error,
    last_lsn_on_disk,
    read_clocks,
    read_mark,
    wall_to_monotonic_ns,
)
from wheeld.journal.recovery import RecoveredState, recover
from .config import MAX_CAPACITY
from .recorder import Recorder, wall_offset_ms

log = logging.getLogger("wheeld.journal")

MAX_GROUPS = 65535  # group ids an arena can have (TimerWheel.create)


class TimersNotRestored(WheeldError):
    """Timers of the journal that the new arena did not take. The daemon does not start
    (``wheeld`` exits 65): started, its next snapshot would drop them from the journal
    for good. Nothing on disk was changed by the attempt (the arena being built is
    removed)."""


def recover_journal(directory: str, on_damage: str = "skip", fs: Any = os) -> RecoveredState:
    """Recover a journal directory for a daemon whose arena is gone (``wheeld --journal-damage``).

    ``skip``: damaged ranges are skipped (each logged at ERROR level) and the
    rest recovered; ``refuse``: any damage raises
    :class:`~wheeld.journal.recovery.JournalDamaged`, a one-line message naming
    the ranges, and nothing on disk is changed. Called before the arena is
    created, so a refusal leaves no empty arena behind (one would make the next
    start skip the journal). A directory that cannot be read (or repaired: a torn
    tail cut) raises :class:`~wheeld.protocol.errors.JournalUnavailable`, one line.
    ``fs``: the file port (:mod:`wheeld.protocol.fsport`; the real one is :mod:`os`).
    """
    try:
        return recover(directory, on_damage=on_damage, fs=fs)
    except OSError as exc:
        raise JournalUnavailable(f"journal directory {directory} cannot be recovered: {exc}") from exc


def arena_size_for(state: RecoveredState, capacity: int, max_groups: int) -> tuple[int, int]:
    """``(capacity, max_groups)`` of a new arena that holds every timer of ``state``:
    the configured ones, raised where the journal holds more (each raise logged).

    The journal's timers were accepted (a ``flush()`` may have acknowledged them);
    an arena smaller than the journal would drop some, and its next snapshot
    would make that permanent. Refusing to start instead would leave every one
    of them unfired until an operator intervenes. So the arena grows, as an
    existing arena keeps its own parameters whatever the command line says: a
    capacity below the journal's timers becomes the journal's timers plus
    ``capacity`` (what the operator asked for stays the room for new timers, so
    adds are not refused from the first moment); ``max_groups`` likewise
    becomes the journal's groups plus ``max_groups``. A later reboot with fewer
    timers pending makes the arena the configured size again.
    """
    needed = len(state.pending) + len(state.unacked)
    # + 1: a new arena registers its default group at id 0 (TimerWheel.create)
    groups = len({group for group, _key in state.pending} | {timer.group for timer in state.unacked}) + 1
    if needed > capacity:
        raised = min(needed + capacity, MAX_CAPACITY)
        log.warning("journal recovery: the journal holds %d timers, more than --capacity %d: the new arena is made "
                    "with capacity %d (the journal's timers, and --capacity of room for new ones) so that none is "
                    "dropped", needed, capacity, raised)
        capacity = max(raised, needed)
    if groups > max_groups:
        raised = min(groups + max_groups, MAX_GROUPS)
        log.warning("journal recovery: the journal's timers are in %d groups, more than --max-groups %d leaves "
                    "room for: the new arena is made with %d group ids (theirs, and --max-groups more)",
                    groups - 1, max_groups, raised)
        max_groups = raised
    return capacity, max_groups


def load_recovered(wheel: TimerWheel, state: RecoveredState, directory: str = "",
                   clocks=read_clocks) -> int:
    """Load a recovered state into an empty arena; return the next lsn.

    Wall-clock deadlines become monotonic ones rounded up
    (:func:`~wheeld.journal.files.wall_to_monotonic_ns`), so no timer fires
    before its wall-clock deadline; those already past fire at once, late.
    """
    wall_ns, mono_ns = clocks()
    now_ms = mono_ns // 1_000_000
    loaded = lost = 0

    def restore(group: str, key, deadline_ms: int, seq: int) -> bool:
        nonlocal loaded, lost
        try:
            # a deadline the daemon accepted far in the past (up to MAX_DELAY_MS before its
            # clock) may lie beyond the wheel's range from this clock: it is due all the same
            deadline_ms = max(deadline_ms, wheel.current_ms - MAX_DELAY_MS)
            wheel.schedule(key, deadline_ms, wheel.group_id(group), seq & 0xFFFFFFFF)
            loaded += 1
            return True
        except (ArenaFull, InvalidRequest) as exc:
            lost += 1
            if lost <= 10:
                log.error("journal recovery: timer %r of group %s not restored: %s", key, group, exc)
            return False

    # Fired but not acknowledged: delivered again. They go in first, and are fired at once
    # (they fired before; their deadline is clamped to now), so that they leave the key index
    # before the pending timers go in: a key can have both, an arming that fired and was not
    # acknowledged and a later one still pending, and scheduling one would re-arm the other.
    # Two unacknowledged armings of one key go in separate waves for the same reason.
    waves: list[list] = []
    for t in state.unacked:
        ident = (t.group, t.key)
        wave = next((w for w in waves if ident not in w[0]), None)
        if wave is None:
            wave = (set(), [])
            waves.append(wave)
        wave[0].add(ident)
        wave[1].append(t)
    for _idents, timers in waves:
        for t in timers:
            restore(t.group, t.key, min(wall_to_monotonic_ns(t.deadline_ms, wall_ns, mono_ns), now_ms), t.seq)
        wheel.expire(max(now_ms, wheel.current_ms))
    for t in state.pending.values():
        restore(t.group, t.key, wall_to_monotonic_ns(t.deadline_ms, wall_ns, mono_ns), t.seq)
    if lost:
        raise TimersNotRestored(
            f"journal {directory}: {lost} of its {loaded + lost} timers could not be put into the new arena "
            f"(capacity {wheel.capacity}, {wheel.max_groups} group ids; the first are in the errors above); "
            "refusing to start, which would drop them from the journal at its next snapshot; nothing on disk "
            "was changed")
    damage = (f"; {len(state.damage)} DAMAGED RANGES SKIPPED ({state.damaged_lines} lines, see the errors above; "
              f"wheelctl check --journal {directory})" if state.damage else "")
    log.info("journal recovery from %s: %d timers restored (%d pending, %d to deliver again), snapshot lsn %d, "
             "%d events replayed from %d segments, last lsn %d, %.0f ms%s",
             directory, loaded, len(state.pending), len(state.unacked), state.snapshot_lsn,
             state.events_replayed, state.segments_read, state.last_lsn, state.elapsed_ms, damage)
    return state.last_lsn + 1


def host_clocks(host):
    """:func:`~wheeld.journal.files.read_clocks` on the clocks of ``host`` (a
    :class:`wheeld.daemon.host.Host`; None: the real clocks)."""
    if host is None:
        return read_clocks
    return lambda: read_clocks(host.clock_ns, host.wall_ns)


def open_journal(config, wheel: TimerWheel, recovered: RecoveredState | None, totals: dict,
                 next_lsn: int | None = None, host=None, known_idle: dict | None = None) -> Recorder:
    """The daemon's journal: load what was recovered (if the arena is new), open the writer.

    ``next_lsn``: the state was already loaded (:func:`load_recovered` returned it).
    ``known_idle``: the idle timers of the journal an attached arena was compared with
    (``OpenedArena.idle_ms``), the Recorder's for its snapshots.
    ``host``: the :class:`wheeld.daemon.host.Host` whose clocks, file port
    (``host.fs``), background runner (``host.runner``) and name the journal uses
    (None: the real ones).

    ``recovered`` is :func:`recover_journal`'s state when the arena was just
    created (None when an existing arena was attached: the journal continues,
    after :func:`_continue_after` compared it with the arena). Damage it skipped
    is added to ``totals`` (``journal_damaged_ranges_total``,
    ``journal_damaged_lines_total``: the daemon publishes them in the arena
    header), and a snapshot is written at once, so that later recoveries start
    after the damage and compaction removes the damaged segments in time.

    A journal that cannot be written for a passing reason (a full disk) starts
    stalled (:mod:`wheeld.daemon.recorder`); for another (read-only, not
    permitted) this raises :class:`~wheeld.protocol.errors.JournalUnavailable`,
    and ``wheeld`` exits 2 with that one line.
    """
    fs = os if host is None else host.fs
    resync = False
    if recovered is not None:
        if next_lsn is None:
            next_lsn = load_recovered(wheel, recovered, config.journal_dir, host_clocks(host))
        totals["journal_damaged_ranges_total"] = totals.get("journal_damaged_ranges_total", 0) + len(recovered.damage)
        totals["journal_damaged_lines_total"] = totals.get("journal_damaged_lines_total", 0) + recovered.damaged_lines
        resync = _unsynced_after_recovery(config.journal_dir, recovered, fs)
    else:
        next_lsn, resync = _continue_after(config.journal_dir, wheel, totals, fs)
    if host is None:
        journal = Journal(config.journal_dir, fsync=config.fsync, name=config.name, next_lsn=next_lsn, resync=resync,
                          stall_on_error=True)
        recorder = Recorder(journal, wheel, totals=totals, known_idle=known_idle)
    else:
        journal = Journal(config.journal_dir, fsync=config.fsync, host=host.hostname, name=config.name,
                          next_lsn=next_lsn, wall_ms=host.wall_ms, mono_ms=host.clock_ms, resync=resync,
                          stall_on_error=True, fs=fs, runner=host.runner)
        recorder = Recorder(journal, wheel, totals=totals, clock_ms=host.clock_ms,
                            offset_ms=lambda: wall_offset_ms(host.clock_ns, host.wall_ns), known_idle=known_idle)
    if recovered is not None and recovered.damage:
        recorder.snapshot()
    log.info("journal %s (fsync %s) continues at lsn %d%s", config.journal_dir, config.fsync, journal.last_lsn + 1,
             "" if journal.writable else f", NOT WRITABLE: {journal.unavailable()}")
    return recorder


def _unsynced_after_recovery(directory: str, state: RecoveredState, fs: Any) -> bool:
    """Whether the journal just recovered holds events past its durable mark (the last lsn
    a daemon saw fsynced): then a snapshot of the new arena comes first.

    After a reboot the files hold only what reached the disk. But an arena can be gone
    while the host runs on (removed, or set aside as damaged), and then recovery reads
    the page cache: bytes written and never synced, or whose fsync failed -- Linux drops
    the pages a failed writeback could not write, marks them clean and keeps serving
    them from memory, and a later fsync, of any descriptor, succeeds without writing
    them (the "fsyncgate" behaviour since 4.13). No later fsync can make them durable;
    writing them again can, and the snapshot does."""
    try:
        mark = read_mark(directory, fs)
    except OSError:
        mark = 0
    if state.last_lsn <= mark:
        return False
    log.warning("journal: %s holds events up to lsn %d but only up to lsn %d are known to have been synced: a "
                "snapshot of the recovered timers is written first", directory, state.last_lsn, mark)
    return True


def _continue_after(directory: str, wheel: TimerWheel, totals: dict, fs: Any = os) -> tuple[int, bool]:
    """For an attached arena: ``(next lsn, whether a snapshot of the arena must come first)``.

    The arena's header says up to which lsn the previous daemon numbered events
    (``journal_lsn``) and which it knew durable (``journal_durable_lsn``); the
    directory says where its files end and its durable mark. Events that were
    durable and are no longer in the files were cut away (damage: logged,
    counted); events numbered but never written (the journal could not be
    written) are simply missing. Either way the arena still holds their
    result: the journal continues after every lsn ever used, with a snapshot of
    the arena first, and nothing is lost. So it does when the directory is empty
    and the arena holds timers (a journal turned on, or moved, under a live arena).

    Events in the files past what was known durable (the previous daemon stopped
    before it synced them, or their fsync failed) are written again the same way:
    a failed fsync drops the pages it could not write while they stay readable in
    the page cache, and a later fsync succeeds without writing them
    (:func:`_unsynced_after_recovery`), so the files cannot be trusted past that lsn.

    An arena whose ``journal_lsn`` is 0 while the journal holds events was never kept
    with this journal by a running daemon: a start that rebuilt it from the journal and
    was killed before its first publish (maybe before the snapshot :func:`open_journal`
    writes after a recovery that skipped damage, so that later recoveries, and the
    comparisons of :mod:`wheeld.daemon.reconcile`, start after the damage), or a daemon
    without ``--journal``. A snapshot of the arena comes first then too: without it a
    damaged range stays in the journal, and every later attach refuses to compare the
    arena with it (a damaged record then fires early, seed 15488 of the simulation).
    """
    try:
        on_disk = last_lsn_on_disk(directory, repair=True, fs=fs)
        mark = read_mark(directory, fs)
    except FileNotFoundError:
        on_disk = mark = 0
    except OSError as exc:
        raise JournalUnavailable(f"journal directory {directory} cannot be read: {describe_error(exc)}") from exc
    numbered = totals.get("journal_lsn", 0)
    durable = max(mark, totals.get("journal_durable_lsn", 0))
    after = max(on_disk, mark, numbered)
    if on_disk < durable:
        totals["journal_damaged_ranges_total"] = totals.get("journal_damaged_ranges_total", 0) + 1
        log.error("journal: damaged range: %s ends at lsn %d but lsn %d was on disk (its durable mark / the arena): "
                  "events %d..%d were cut away after they were synced; the arena still holds their timers, a "
                  "snapshot of it is written now and the journal continues at lsn %d",
                  directory, on_disk, durable, on_disk + 1, durable, after + 1)
    elif after > on_disk:
        log.warning("journal: the arena holds changes up to lsn %d that %s does not (it ends at lsn %d: the previous "
                    "daemon could not write them); a snapshot of the arena is written now", after, directory, on_disk)
    elif on_disk == 0 and len(wheel) + wheel.counters()["fired_unacked"]:
        log.warning("journal: %s is empty and the arena holds timers: a snapshot of them is written now", directory)
        after = 1  # the snapshot stands for lsn 1: "what the arena held before the journal"
    elif on_disk > durable:
        log.warning("journal: %s holds events up to lsn %d but only up to lsn %d are known to have been synced (the "
                    "previous daemon stopped before it synced them, or their fsync failed): a snapshot of the arena "
                    "is written now", directory, on_disk, durable)
    elif numbered == 0 and after > 0:
        log.warning("journal: the arena was not kept with %s by a running daemon (a start that rebuilt it from the "
                    "journal stopped before its first snapshot, or its daemon ran without --journal): a snapshot of "
                    "the arena is written now", directory)
        return after + 1, True
    return after + 1, after > on_disk or after > durable
