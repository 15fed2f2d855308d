"""``wheelctl check``: the arena's invariants on private copies of a daemon's arena.

The checker (:func:`wheeld.shm.fsck.fsck`) reads an arena without writing it;
what a restart would do (``TimerWheel.attach`` replays an open intent and
rebuilds every list, which writes) is run on a *private copy* of the segment,
never on the live arena, which nothing but the daemon may write
(:func:`recover_copy`). A copy of an arena the daemon is writing at that moment
can be inconsistent, so :func:`check` takes copies while the daemon is parked at
rest (its parked word: set only for a park with the counters published, cleared
before anything writes the arena), and otherwise calls the arena broken only
when the same problems show in every copy it took.
"""

from __future__ import annotations

import mmap
import struct
import time
from dataclasses import dataclass

from wheeld.protocol import arena_layout as L
from wheeld.protocol.errors import CorruptArena

from .arena import Segment
from .fsck import fsck
from .reader import ArenaReader
from .snapshot import daemon_alive
from .wheel import TimerWheel

__all__ = ["CheckReport", "check", "recover_copy"]


def _replayed_intents(buf) -> list[str]:
    """The intents a restart would replay on this arena, as repair descriptions."""
    out = []
    slot = struct.unpack_from("<i", buf, L.H_INTENT_SLOT)[0]
    if slot != -1:
        out.append(f"update intent of record {slot} replayed")
    count = struct.unpack_from("<I", buf, L.H_INTENT_COUNT)[0]
    if count:
        out.append(f"batch intent of {count} re-arms replayed")
    return out


def recover_copy(buf: mmap.mmap, size: int) -> tuple[list[str], list[str]]:
    """What a restarting daemon would do to this private copy: (repairs made, problems left after).

    Runs the wheel's own recovery (replay the intent, rebuild every list from the
    records) and its check. The copy is private memory: nothing reaches the live arena.
    """
    replayed = _replayed_intents(buf)
    wheel = TimerWheel.recover(Segment(buf, None, size))
    try:
        return replayed + list(wheel.repairs), wheel.check()
    finally:
        wheel.close()


@dataclass
class CheckReport:
    problems: list[str]
    copies: int
    quiet: bool  # the verdict comes from a copy taken while nothing wrote the arena
    repairs: list[str]  # what recovery (a daemon restart) would repair on the last copy
    after_recovery: list[str]  # problems the wheel's own check still finds after recovery
    inconclusive: bool = False  # every copy had problems, none in common (a busy arena)
    daemon_alive: bool = False

    @property
    def ok(self) -> bool:
        return not self.problems and not self.inconclusive and not self.after_recovery

    def to_dict(self) -> dict:
        return {"ok": self.ok, "problems": self.problems, "copies": self.copies, "quiet": self.quiet,
                "inconclusive": self.inconclusive, "repairs_on_restart": self.repairs,
                "after_recovery": self.after_recovery, "daemon_alive": self.daemon_alive}


def _private_copy(reader: ArenaReader, budget_s: float = 0.5) -> tuple[mmap.mmap, bool]:
    """(a private copy of the arena, whether nothing wrote it while we copied).

    The daemon sets the arena's parked word only when it parks with its counters
    published, and clears it before anything writes the arena (``Daemon.arena_busy``),
    so copies are taken until one starts and ends with that word set and the header
    unchanged, for up to
    ``budget_s`` (a busy daemon parks for moments; a reader preempted during a
    copy misses one of them and tries again); the last copy is returned either way.
    """
    size = reader.info["bytes"]
    buf = reader.buf
    parked_at = L.H_PARKED
    copy = mmap.mmap(-1, size)
    end = time.monotonic() + budget_s
    while True:
        while struct.unpack_from("<q", buf, parked_at)[0] == 0 and time.monotonic() < end:
            time.sleep(0.0005)
        before = bytes(buf[: L.GROUPS_OFFSET])
        memoryview(copy)[:size] = memoryview(buf)[:size]
        after = bytes(buf[: L.GROUPS_OFFSET])
        quiet = struct.unpack_from("<q", before, parked_at)[0] != 0 and before == after
        if quiet or time.monotonic() >= end:
            return copy, quiet


def check(name: str, attempts: int = 5, interval_s: float = 0.05) -> CheckReport:
    """Check the arena of ``name`` on private copies (see the module docstring).

    With no live daemon one copy is final. With a live one, a copy taken while
    it was parked and wrote nothing is final; otherwise up to ``attempts``
    copies are taken, the arena is sound if any copy is, and the problems
    reported are those every copy showed.
    """
    with ArenaReader(name) as reader:
        alive = daemon_alive(reader.counters()["daemon_pid"])
        size = reader.info["bytes"]
        common: list[str] | None = None
        copies = 0
        copy = None
        quiet = False
        for attempt in range(max(1, attempts)):
            if copy is not None:
                copy.close()
            copy, quiet = _private_copy(reader)
            copies += 1
            problems = fsck(copy, size, reader.segment_name)
            if not alive or quiet or not problems:
                common = problems
                break
            common = problems if common is None else [q for q in common if q in problems]
            if attempt + 1 < attempts:
                time.sleep(interval_s)
        inconclusive = bool(alive and not quiet and common == [] and problems)
        try:
            repairs, after = recover_copy(copy, size)
        except CorruptArena as exc:
            repairs, after = [], [f"recovery fails: {exc}"]
        finally:
            copy.close()
        return CheckReport(common or [], copies, quiet or not alive, repairs, after if not inconclusive else [],
                           inconclusive, alive)
