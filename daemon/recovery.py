"""Recovery: a journal directory read back into a new arena, and the daemon's journal opened.

``wheeld --journal DIR`` rebuilds an arena that is gone (a reboot, /dev/shm
cleared) from the journal: :func:`recover_journal` reads the directory (before
the arena exists, so a refusal leaves nothing behind), :func:`load_recovered`
puts the timers into the new arena, and :func:`open_journal` continues the
journal after them with a :class:`~wheeld.daemon.recorder.Recorder`.
"""

from __future__ import annotations

import logging

from wheeld.protocol.errors import ArenaFull, InvalidRequest
from wheeld.shm.wheel import MAX_DELAY_MS, TimerWheel

from wheeld.protocol.journal_files import Journal, read_clocks, wall_to_monotonic_ns
from wheeld.protocol.journal_recovery import RecoveredState, recover
from .recorder import Recorder

log = logging.getLogger("wheeld.journal")


def recover_journal(directory: str, on_damage: str = "skip") -> RecoveredState:
    """Recover a journal directory for a daemon whose arena is gone (``wheeld --journal-damage``).

    ``skip``: damaged ranges are skipped (each logged at ERROR level) and the
    rest recovered; ``refuse``: any damage raises
    :class:`~wheeld.protocol.journal_recovery.JournalDamaged`, a one-line message naming
    the ranges, and nothing on disk is changed. Called before the arena is
    created, so a refusal leaves no empty arena behind (one would make the next
    start skip the journal).
    """
    return recover(directory, on_damage=on_damage)


def load_recovered(wheel: TimerWheel, state: RecoveredState, directory: str = "",
                   clocks=read_clocks) -> int:
    """Load a recovered state into an empty arena; return the next lsn.

    Wall-clock deadlines become monotonic ones rounded up
    (:func:`~wheeld.protocol.journal_files.wall_to_monotonic_ns`), so no timer fires
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
    damage = (f"; {len(state.damage)} DAMAGED RANGES SKIPPED ({state.damaged_lines} lines, see the errors above; "
              f"wheelctl check --journal {directory})" if state.damage else "")
    log.info("journal recovery from %s: %d timers restored (%d pending, %d to deliver again), snapshot lsn %d, "
             "%d events replayed from %d segments, last lsn %d, %.0f ms%s%s",
             directory, loaded, len(state.pending), len(state.unacked), state.snapshot_lsn,
             state.events_replayed, state.segments_read, state.last_lsn, state.elapsed_ms,
             f"; {lost} NOT restored (arena full?)" if lost else "", damage)
    return state.last_lsn + 1


def recover_into(wheel: TimerWheel, directory: str, on_damage: str = "skip") -> int:
    """Load a journal directory's state into an empty arena; return the next lsn."""
    return load_recovered(wheel, recover_journal(directory, on_damage), directory)


def open_journal(config, wheel: TimerWheel, recovered: RecoveredState | None, totals: dict,
                 next_lsn: int | None = None) -> Recorder:
    """The daemon's journal: load what was recovered (if the arena is new), open the writer.

    ``next_lsn``: the state was already loaded (:func:`load_recovered` returned it).

    ``recovered`` is :func:`recover_journal`'s state when the arena was just
    created (None when an existing arena was attached: the journal only
    continues). Damage it skipped is added to ``totals``
    (``journal_damaged_ranges_total``, ``journal_damaged_lines_total``: the
    daemon publishes them in the arena header), and a snapshot is written at
    once, so that later recoveries start after the damage and compaction
    removes the damaged segments in time.
    """
    if recovered is not None:
        if next_lsn is None:
            next_lsn = load_recovered(wheel, recovered, config.journal_dir)
        totals["journal_damaged_ranges_total"] = totals.get("journal_damaged_ranges_total", 0) + len(recovered.damage)
        totals["journal_damaged_lines_total"] = totals.get("journal_damaged_lines_total", 0) + recovered.damaged_lines
    journal = Journal(config.journal_dir, fsync=config.fsync, name=config.name, next_lsn=next_lsn)
    recorder = Recorder(journal, wheel)
    if recovered is not None and recovered.damage:
        recorder.snapshot()
    log.info("journal %s (fsync %s) continues at lsn %d", config.journal_dir, config.fsync, journal.last_lsn + 1)
    return recorder
