"""The daemon's write-ahead journal: appending, fsync policies, snapshots, recovery.

The bytes are defined in :mod:`wheeld.protocol.journal` (JSON Lines, a crc per
line, ``journal-<lsn>.jsonl`` segments and ``snapshot-<lsn>.jsonl`` files).
This module owns the files: it appends, decides when they reach the disk,
rotates and compacts them, and rebuilds the timers from them after a reboot.

Writing
=======

The daemon drains its client rings in batches. For each batch it builds the
events (structs of :mod:`wheeld.protocol.journal`, ``n`` left at 0) and calls
:meth:`Journal.append` once: the journal numbers them (lsn), encodes them with
the bulk encoder and writes them with one ``write(2)``. When the fsync policy
asks for it, ``fsync(2)`` follows. One fsync per batch is *group commit*: the
cost of the disk flush is shared by every add in the batch.

=================  ==========================================================
``always``         ``append`` returns only after write + fsync: when the
                   daemon answers ``flush()``, every add before it is on disk.
                   ``durable_lsn == last_lsn`` after every append.
``interval=N``     ``append`` only writes; the owner's loop calls
                   :meth:`Journal.maybe_sync` (at :attr:`Journal.sync_due_ms`
                   at the latest), which fsyncs when the oldest unsynced event
                   is N ms old. So fsyncs are at least N ms apart and an event
                   is on disk at most N ms (plus one fsync) after it was
                   appended: a crash loses only events younger than that window.
                   The daemon uses the non-blocking form,
                   :meth:`Journal.start_sync` / :meth:`Journal.poll_sync`: the
                   fsync runs on a helper thread while the loop goes on
                   draining rings (``fsync(2)`` releases the GIL); at most one
                   is in flight, and ``durable_lsn`` advances when the loop
                   collects it. The window then grows by the fsync in flight:
                   an event is on disk at most N ms plus two fsyncs after it
                   was appended.
``off``            never fsync the journal; the kernel writes it back on its own
                   schedule (``vm.dirty_expire_centisecs``, 30 s by default).
                   A daemon crash loses nothing (the page cache survives it);
                   a power loss or kernel crash loses what was not written back.
=================  ==========================================================

:attr:`Journal.durable_lsn` is the highest lsn known to be on disk. The daemon
answers a ``flush()`` (``Applied``) once the batch holding it is appended: with
``always`` that is after its fsync; with ``interval`` and ``off`` after the
``write(2)`` only -- their promise is the window (or nothing), not each flush,
which is why their acknowledged add rate is close to that of no journal
(``bench/durability.py``).

Segments rotate by size: once a segment holds ``segment_bytes`` (64 MiB by
default) the next batch goes to a new file (the old one is fsynced first unless
the policy is ``off``, and the directory is fsynced so the new name survives).
A batch never straddles two segments, so a segment may pass the limit by one
batch. After a restart the journal always opens a new segment: it never
appends after bytes a previous process may have left torn.

If a write fails (disk full), the segment is cut back to its previous length
and the error propagates: the journal never holds half a batch followed by
more events.

Snapshots and compaction
========================

Replaying the whole history would make recovery time grow without bound. The
daemon periodically calls :meth:`Journal.write_snapshot` with the lsn its state
corresponds to and the pending (and fired-but-unacknowledged) timers. The
snapshot is written to a temporary file, fsynced, renamed to
``snapshot-<lsn>.jsonl`` and the directory fsynced: it either exists whole or
not at all. Then compaction keeps the newest two snapshots and deletes the
segments wholly covered by the *older* of the two. Keeping one older snapshot
and the journal after it means a snapshot found corrupted at recovery costs
only time (replay from the previous one), never timers.

Recovery
========

:func:`recover` rebuilds the state from a directory:

1. the newest snapshot that passes its checks (whole-file crc, header and end
   line agree); see "Damage" for a damaged one;
2. the events after the snapshot's lsn, segment by segment, applied to a dict
   ``(group, key) -> pending timer`` and a dict of fired-but-unacked timers
   (the reference model in :mod:`wheeld.protocol.journal`);
3. a torn tail of the newest segment -- bad bytes with no good line after
   them, what a crash in the middle of a write leaves -- is cut at the last
   good line and a warning names the file, the byte offset and the reason;
   bytes cut that held complete lines are first saved next to it as
   ``<segment>.cut-<offset>``.

The result, :class:`RecoveredState`, holds wall-clock deadlines. The arena runs
on the monotonic clock: :func:`wall_to_monotonic_ns` converts, rounding up so
that no recovered timer fires before its wall-clock deadline, and a timer
whose deadline passed while the host was down fires at once with
``late=True`` and its lateness (as systemd's ``Persistent=``); the daemon
does that.

Damage
======

Every line carries its own crc, so damage costs only the lines it touches.
A bad line (a crc that does not match, a line that is not a version-1 event,
NUL bytes) *followed by good lines* is not a torn write: recovery skips it and
goes on (:func:`wheeld.protocol.journal.scan_lines`). The lsns say what was
lost: the next good event's lsn minus the last applied one. A damaged byte
costs the event on its line; a damaged newline joins two lines into one bad
line and costs both events; a byte turned into a newline splits a line into
two bad ones and costs its event; a damaged segment header costs nothing.
Lost events are *lost*, with their consequences: a skipped ``cancel`` means
the arming it cancelled comes back and fires; a skipped ``rearm`` leaves the
previous deadline and seq; a skipped ``add`` loses that timer; a skipped
``fire`` leaves the timer pending, so it fires again after recovery; a
skipped ``ack`` delivers that expiration again. Events missing with no bad
line before them (a segment file deleted) are reported the same way, as a
range without damaged bytes.

A damaged snapshot costs nothing when an older good snapshot, or lsn 0, has
the whole journal after it (compaction keeps the journal back to the older of
two snapshots): it is reported and renamed ``*.corrupt``. When nothing
replaces it, it is salvaged line by line (snapshot lines carry crcs too): the
timers on damaged lines are lost, the others kept, loudly, and the file stays.

Every damaged range (file, byte range, lines, lsns lost) is logged at ERROR
level and returned in :attr:`RecoveredState.damage`; the daemon counts them
(``journal_damaged_ranges_total``, ``journal_damaged_lines_total``). Damaged
lines in the middle of a segment stay where they are (the file is evidence);
damage in events a snapshot covers is never read, so it costs nothing (and
``wheelctl check --journal``, :func:`check_journal`, still lists it). With
``on_damage="refuse"`` any damage raises :class:`JournalDamaged` before
anything on disk is changed.

Using it from the daemon
========================

::

    state = recover(journal_dir, on_damage="skip")   # only when the arena is missing
    journal = Journal(journal_dir, fsync="interval=10", name=daemon_name,
                      next_lsn=state.last_lsn + 1)
    wall_ns, mono_ns = read_clocks()
    for timer in state.pending.values():          # overdue ones fire at once, late=True
        arena.insert(timer.group, timer.key,
                     wall_to_monotonic_ns(timer.deadline_ms, wall_ns, mono_ns), ...)
    for fired in state.unacked: deliver_again(fired)

    # each loop turn, after draining the rings:
    lsn = journal.append(events_of_this_batch)    # Add/Rearm/Cancel/Fire/Ack/IdleRearm
    # then answer Applied(seq) for a FLUSH in this batch (with "always" the
    # batch is fsynced by now; "interval" and "off" promise a window, or nothing)
    # schedule the loop's next wake-up no later than journal.sync_due_ms

    # every few minutes or N events, with the wall-clock deadlines of the arena:
    journal.write_snapshot(journal.last_lsn, pending_timers(), unacked_timers())

A snapshot of 1M pending timers takes ~1.5 s to encode and write here
(``bench/journal.py``) and blocks the caller meanwhile (the encoding holds
the GIL, so a thread would not help much): take it at a quiet moment, and
space snapshots by journal volume (replaying 1M events costs about as much as
loading a 1M-timer snapshot).

Speed: a snapshot is checked with one crc over the whole file and its lines
are decoded by one ``msgspec`` call straight into :class:`PendingTimer`
structs; the events of the segment that the snapshot already covers are
skipped without being checked (they are found by counting lines, and by their
lsn if a damaged newline makes the count wrong); the rest are crc-checked in
C-level loops and decoded with one call per run of good lines (one per file
when nothing is damaged). Keys stay in their journal
form during replay and only the escaped ones are converted at the end.
Measured here (``python bench/journal.py``): 1M pending timers from a
snapshot plus 100k journal events in 1.6-1.9 s, from a journal of 1M adds
without a snapshot in 1.7-1.9 s (target: under 5 s).
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Union

import msgspec
from msgspec import UNSET

from wheeld.protocol.errors import Closed, InvalidRequest
from wheeld.protocol.journal import (
    CHECKSUM,
    LSN_GAP,
    SEGMENT_PREFIX,
    SNAPSHOT_PREFIX,
    Ack,
    Add,
    BadLines,
    Cancel,
    CorruptJournal,
    Fire,
    IdleRearm,
    Rearm,
    SegmentHeader,
    SegmentScan,
    SnapshotEnd,
    SnapshotHeader,
    SnapshotPending,
    SnapshotUnacked,
    encode_event,
    encode_events,
    encode_snapshot,
    key_from_json,
    key_to_json,
    line_body,
    parse_segment_name,
    parse_snapshot,
    parse_snapshot_name,
    scan_lines,
    segment_name,
    snapshot_name,
)
from wheeld.protocol.keys import Key

__all__ = [
    "DEFAULT_SEGMENT_BYTES",
    "FsyncPolicy",
    "parse_fsync_policy",
    "PendingTimer",
    "FiredTimer",
    "Problem",
    "DamagedRange",
    "DAMAGE_POLICIES",
    "JournalDamaged",
    "RecoveredState",
    "Journal",
    "recover",
    "JournalReport",
    "check_journal",
    "prepare_directory",
    "FILE_MODE",
    "DIR_MODE",
    "read_clocks",
    "clock_offset_ns_above",
    "wall_to_monotonic",
    "wall_to_monotonic_ns",
    "list_segments",
    "list_snapshots",
]

log = logging.getLogger("wheeld.journal")

_ESCAPED_KEYS = ("b64:", "str:")  # journal key forms that differ from the user's key

DEFAULT_SEGMENT_BYTES = 64 << 20
SNAPSHOTS_KEPT = 2


def _wall_ms() -> int:
    return time.time_ns() // 1_000_000


def _mono_ms() -> int:
    return time.monotonic_ns() // 1_000_000


# --------------------------------------------------------------------------- #
# Policy
# --------------------------------------------------------------------------- #


class FsyncPolicy(msgspec.Struct, frozen=True):
    """``mode`` is "always", "interval" or "off"; ``interval_ms`` only for "interval"."""

    mode: str
    interval_ms: int = 0

    def __str__(self) -> str:
        return f"interval={self.interval_ms}ms" if self.mode == "interval" else self.mode


def parse_fsync_policy(text: str | FsyncPolicy) -> FsyncPolicy:
    """Parse ``always``, ``off``, ``interval=N`` or ``interval=Nms`` (N > 0 ms)."""
    if isinstance(text, FsyncPolicy):
        return text
    value = text.strip().lower()
    if value in ("always", "off"):
        return FsyncPolicy(value)
    if value.startswith("interval="):
        number = value[len("interval=") :].removesuffix("ms").strip()
        if number.isdigit() and int(number) > 0:
            return FsyncPolicy("interval", int(number))
    raise InvalidRequest(f"fsync policy is 'always', 'interval=N' (ms, N > 0) or 'off', not {text!r}")


# --------------------------------------------------------------------------- #
# Recovered state
# --------------------------------------------------------------------------- #


class PendingTimer(
    msgspec.Struct,
    tag_field="ev",
    tag="pending",
    rename={"group": "g", "key": "k", "deadline_ms": "d", "seq": "s", "idle_ms": "i"},
    gc=False,
):
    """A timer waiting to fire; ``deadline_ms`` is wall-clock ms.

    ``key`` is the user's key (str, bytes or int). The struct is also the
    decoding target of a snapshot's ``pending`` lines (tag and short names),
    so recovery builds no intermediate object per timer.
    """

    group: str
    key: Any  # str | bytes | int; decoded in its journal form, converted by recover()
    deadline_ms: int
    seq: int
    idle_ms: int | None = None


class FiredTimer(
    msgspec.Struct,
    tag_field="ev",
    tag="unacked",
    rename={
        "group": "g",
        "key": "k",
        "deadline_ms": "d",
        "seq": "s",
        "fired_ms": "f",
        "lateness_ms": "lat",
        "idle_ms": "i",
    },
    gc=False,
):
    """A timer that fired but whose delivery was not acknowledged: deliver it again."""

    group: str
    key: Any  # str | bytes | int
    deadline_ms: int
    seq: int
    fired_ms: int
    late: bool
    lateness_ms: int
    idle_ms: int | None = None


class Problem(msgspec.Struct, frozen=True):
    """Something recovery found wrong, and what it did about it."""

    path: str
    offset: int
    reason: str
    detail: str
    action: str

    def __str__(self) -> str:
        return f"{self.path} at byte {self.offset}: {self.reason}: {self.detail} -> {self.action}"


#: What recovery does when it finds damage: ``skip`` the damaged lines and go
#: on, or ``refuse`` (raise :class:`JournalDamaged`, change nothing on disk).
DAMAGE_POLICIES = ("skip", "refuse")


class DamagedRange(msgspec.Struct, frozen=True):
    """A stretch of a journal file that recovery cannot use, and what it costs.

    ``start``/``end``: byte offsets in ``path`` (``end`` exclusive);
    ``first_line`` (1-based) and ``lines``: the lines it spans (0 lines for
    events missing without a damaged byte, e.g. a deleted segment file);
    ``reason``/``detail``: as :class:`wheeld.protocol.journal.BadLines` gives
    them. ``lost_lsns``: first and last lsn of the events lost with it (None:
    no event lost, e.g. a damaged segment header, or a damaged snapshot the
    previous snapshot and the journal replace); ``lost``: how many events (in
    a segment) or timers (a snapshot salvaged line by line) are lost;
    ``action``: what recovery does about it.
    """

    path: str
    start: int
    end: int
    first_line: int
    lines: int
    reason: str
    detail: str
    lost_lsns: tuple[int, int] | None = None
    lost: int = 0
    action: str = ""

    @property
    def last_line(self) -> int:
        return self.first_line + max(self.lines, 1) - 1

    def where(self) -> str:
        if not self.lines:
            return "(no damaged bytes)"
        lines = f"line {self.first_line}" if self.lines == 1 else f"lines {self.first_line}-{self.last_line}"
        return f"bytes {self.start}-{self.end} ({lines}, {self.lines} line{'s' if self.lines != 1 else ''})"

    def cost(self) -> str:
        if self.lost_lsns is not None:
            first, last = self.lost_lsns
            lsns = f"lsn {first}" if first == last else f"lsns {first}-{last}"
            return f"{self.lost} event{'s' if self.lost != 1 else ''} lost ({lsns})"
        if self.lost:
            return f"{self.lost} timer{'s' if self.lost != 1 else ''} lost"
        return "nothing lost"

    def __str__(self) -> str:
        return f"{self.path} {self.where()}: {self.reason}: {self.detail}; {self.cost()} -> {self.action}"

    def short(self) -> str:
        """One clause for a one-line message: file name, bytes, lines, cost."""
        return f"{Path(self.path).name} {self.where()}, {self.cost()}"


class JournalDamaged(CorruptJournal):
    """Recovery found damage and the policy is ``refuse``; nothing on disk was changed."""

    def __init__(self, directory: str | os.PathLike[str], damage: list[DamagedRange]) -> None:
        self.directory = str(directory)
        self.damage = list(damage)
        lines = sum(item.lines for item in damage)
        shown = "; ".join(item.short() for item in damage[:5])
        more = f"; and {len(damage) - 5} more" if len(damage) > 5 else ""
        super().__init__(
            f"journal {self.directory} is damaged ({len(damage)} range{'s' if len(damage) != 1 else ''}, "
            f"{lines} line{'s' if lines != 1 else ''}): {shown}{more}; refusing to start "
            f"(--journal-damage refuse), nothing on disk was changed; 'wheelctl check --journal "
            f"{self.directory}' lists the damage, --journal-damage skip recovers without it"
        )


class RecoveredState(msgspec.Struct):
    """What :func:`recover` rebuilt.

    ``pending`` maps (group, key) to its timer; ``unacked`` are fired timers
    to deliver again; ``last_lsn`` is the lsn the journal continues after (the
    last event applied, or higher when the newest segment's name says so);
    ``snapshot_lsn`` is the snapshot used (0: none); ``problems`` lists what
    was cut, skipped or missing; ``damage`` the damaged ranges skipped (a torn
    tail in the newest segment is a crash's cut-short write, not damage: it
    is in ``torn`` and ``problems``).
    """

    pending: dict[tuple[str, Key], PendingTimer]
    unacked: list[FiredTimer]
    last_lsn: int
    snapshot_lsn: int
    problems: list[Problem]
    segments_read: int = 0
    events_replayed: int = 0
    elapsed_ms: float = 0.0
    damage: list[DamagedRange] = msgspec.field(default_factory=list)
    torn: list[Problem] = msgspec.field(default_factory=list)

    @property
    def damaged_lines(self) -> int:
        return sum(item.lines for item in self.damage)


def _bracketed_clocks(tries: int = 3) -> tuple[int, int, int]:
    """``(monotonic ns before, wall ns, monotonic ns after)``: the wall clock read between
    two monotonic reads, the tightest of ``tries`` attempts. A process preempted between
    two clock reads (a loaded host) would otherwise skew the offset by the time it waited;
    it would have to be preempted in every attempt."""
    best = None
    for _ in range(tries):
        before = time.monotonic_ns()
        wall = time.time_ns()
        after = time.monotonic_ns()
        if best is None or after - before < best[2] - best[0]:
            best = (before, wall, after)
    return best


def read_clocks() -> tuple[int, int]:
    """``(wall ns, monotonic ns)`` with ``wall - mono`` at most the true offset between the
    clocks (the monotonic reading after the wall one; see :func:`wall_to_monotonic_ns`)."""
    _before, wall, after = _bracketed_clocks()
    return wall, after


def clock_offset_ns_above() -> int:
    """``wall - mono`` in ns, at least the true offset between the clocks (the monotonic
    reading before the wall one): what turns a monotonic deadline into a wall-clock one
    that is never early."""
    before, wall, _after = _bracketed_clocks()
    return wall - before


def wall_to_monotonic_ns(deadline_wall_ms: int, wall_ns: int, mono_ns: int) -> int:
    """Monotonic deadline (ms) for a wall-clock one, rounded so it is never early.

    ``wall_ns``/``mono_ns`` are both clocks read together, the wall clock
    first (:func:`read_clocks`): the monotonic reading is then the later one,
    so ``wall_ns - mono_ns`` never exceeds the true offset between the clocks.
    The result is the ceiling of ``deadline - offset`` in ms; the wheel fires
    a timer once ``CLOCK_MONOTONIC`` reaches the start of its millisecond, and
    at that instant the wall clock has reached ``deadline_wall_ms``. The cost
    is at most 1 ms of lateness (the rounding) plus the time between the two
    reads. A deadline already past maps to now or earlier: it is due now.
    """
    return -((wall_ns - mono_ns - deadline_wall_ms * 1_000_000) // 1_000_000)


def wall_to_monotonic(deadline_wall_ms: int, now_wall_ms: int, now_mono_ms: int) -> int:
    """:func:`wall_to_monotonic_ns` for clocks read in whole ms (wall first).

    Each reading is floored to its ms, which hides up to 1 ms of the offset
    between the clocks: 1 ms is added so that the result is never early.
    """
    return now_mono_ms + (deadline_wall_ms - now_wall_ms) + 1


# --------------------------------------------------------------------------- #
# Directory helpers
# --------------------------------------------------------------------------- #


def list_segments(directory: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """``(first_lsn, path)`` of every segment in ``directory``, in lsn order."""
    found = []
    for entry in os.scandir(directory):
        lsn = parse_segment_name(entry.name)
        if lsn is not None:
            found.append((lsn, Path(entry.path)))
    found.sort()
    return found


def list_snapshots(directory: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """``(lsn, path)`` of every snapshot in ``directory``, in lsn order."""
    found = []
    for entry in os.scandir(directory):
        lsn = parse_snapshot_name(entry.name)
        if lsn is not None:
            found.append((lsn, Path(entry.path)))
    found.sort()
    return found


def _fsync_dir(directory: str | os.PathLike[str]) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


#: Modes of what the journal creates, whatever the umask: the files hold every
#: key and group name, so they are readable by the daemon's group at most.
FILE_MODE = 0o640
DIR_MODE = 0o750


def _is_journal_file(name: str) -> bool:
    """A segment, a snapshot, or what recovery keeps of them (``.cut-N``, ``.corrupt``, ``.tmp``)."""
    return name.startswith((SEGMENT_PREFIX, SNAPSHOT_PREFIX)) and ".jsonl" in name


def prepare_directory(directory: str | os.PathLike[str]) -> None:
    """Create the journal directory with mode 0750, or tighten an existing one.

    A new directory gets exactly :data:`DIR_MODE` (``chmod`` after ``mkdir``,
    so the umask cannot widen or narrow it). An existing directory whose mode
    allows more than 0750 is tightened to ``mode & 0750``, and its journal
    files that allow more than 0640 to ``mode & 0640`` (journals written
    before these modes were 0755/0644: keys and groups readable by everyone);
    each change is logged as a warning. A mode that cannot be changed (another
    owner) is logged as a warning and left alone.
    """
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(directory, DIR_MODE)
    except FileExistsError:
        if not directory.is_dir():
            raise
        mode = stat.S_IMODE(os.stat(directory).st_mode)
        if mode & ~DIR_MODE:
            _tighten(directory, mode, mode & DIR_MODE)
    else:
        os.chmod(directory, DIR_MODE)
        return
    wide = []
    for entry in os.scandir(directory):
        if not _is_journal_file(entry.name) or not entry.is_file(follow_symlinks=False):
            continue
        mode = stat.S_IMODE(entry.stat(follow_symlinks=False).st_mode)
        if mode & ~FILE_MODE:
            wide.append((Path(entry.path), mode))
    for path, mode in wide:
        _tighten(path, mode, mode & FILE_MODE, quiet=True)
    if wide:
        log.warning("journal: %d file(s) in %s were readable beyond owner and group (e.g. %s was %o); "
                    "tightened to %o", len(wide), directory, wide[0][0].name, wide[0][1], FILE_MODE)


def _tighten(path: Path, mode: int, wanted: int, quiet: bool = False) -> None:
    try:
        os.chmod(path, wanted)
    except OSError as exc:
        log.warning("journal: %s has mode %o (keys and groups readable by others) and cannot be tightened "
                    "to %o: %s", path, mode, wanted, exc)
        return
    if not quiet:
        log.warning("journal: %s had mode %o; tightened to %o", path, mode, wanted)


def _create_file(path: Path, flags: int = 0) -> int:
    """Open a new journal file with mode :data:`FILE_MODE` whatever the umask; return the fd."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | flags, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _write_file(path: Path, data: bytes) -> None:
    """Write a whole new file (mode 0640) and fsync it."""
    fd = _create_file(path, os.O_TRUNC)
    try:
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _cut_segment(path: Path, offset: int, data: bytes) -> str:
    """Truncate a segment at ``offset`` (its torn tail); keep cut complete lines aside."""
    kept = ""
    if b"\n" in data[offset:]:  # complete lines go: keep them as evidence
        aside = path.with_name(f"{path.name}.cut-{offset}")
        _write_file(aside, data[offset:])
        kept = f"; cut bytes saved in {aside.name}"
    if offset == 0:
        path.unlink()
        _fsync_dir(path.parent)
        return f"removed the file (no good line){kept}"
    fd = os.open(path, os.O_WRONLY)
    try:
        os.ftruncate(fd, offset)
        os.fsync(fd)
    finally:
        os.close(fd)
    return f"truncated to {offset} bytes{kept}"


def _starts_at(scan: SegmentScan, lsn: int) -> bool:
    """True if the first event read (after a damaged header, if any) is ``lsn``."""
    parts = scan.parts
    if parts and type(parts[0]) is BadLines and parts[0].first_line == 1 and parts[0].lines == 1:
        parts = parts[1:]
    return bool(parts) and type(parts[0]) is list and parts[0][0].n == lsn


def _read_segment(path: Path, wanted_lsn: int | None = None) -> tuple[SegmentScan, bytes]:
    """Scan a segment past damage; with ``wanted_lsn``, skip (unchecked) the events before it.

    The events before ``wanted_lsn`` are found by counting lines. If the first
    line read is not that event (a damaged newline in the skipped part makes
    the count wrong, or the wanted line itself is damaged), the line holding
    its lsn is looked up by its text; failing that, the whole file is read and
    the caller drops the events it already has.
    """
    with open(path, "rb") as file:
        data = file.read()
    name = str(path)
    first_lsn = parse_segment_name(path.name)
    skip = 0 if wanted_lsn is None or first_lsn is None else max(0, wanted_lsn - first_lsn)
    scan = scan_lines(data, name, skip)
    if skip and not _starts_at(scan, wanted_lsn):
        position = data.find(b',"v":1,"n":%d,' % wanted_lsn)
        scan = None
        if position >= 0:
            line_start = data.rfind(b"\n", 0, position) + 1
            exact = data.count(b"\n", 0, line_start) - 1
            if exact >= 0:
                scan = scan_lines(data, name, exact)
                if not _starts_at(scan, wanted_lsn):
                    scan = None
        if scan is None:
            scan = scan_lines(data, name)
    return scan, data


def _torn_tail(scan: SegmentScan) -> BadLines | None:
    """The first of the bad runs after the last good line (what a crash mid-write leaves), or None."""
    for part in scan.parts:
        if type(part) is BadLines and part.at_end:
            return part
    return None


def _last_lsn_on_disk(directory: Path, repair: bool) -> int:
    """Highest lsn in the newest non-empty segment or snapshot (0 for an empty dir).

    With ``repair`` the newest segment's torn tail is cut first. Damage in the
    middle of a segment is left alone: the lsn after it is what counts.
    """
    last = max((lsn for lsn, _ in list_snapshots(directory)), default=0)
    segments = list_segments(directory)
    for index in range(len(segments) - 1, -1, -1):
        first_lsn, path = segments[index]
        scan, data = _read_segment(path)
        tail = _torn_tail(scan)
        if tail is not None and repair and index == len(segments) - 1:
            action = _cut_segment(path, tail.start, data)
            log.warning("journal: torn tail %s -> %s", tail, action)
            if tail.start == 0:
                continue
        events = [part[-1].n for part in scan.parts if type(part) is list]
        if events:
            return max(last, *events)
        return max(last, first_lsn - 1)  # a header alone: the next lsn is the one its name announces
    return last


# --------------------------------------------------------------------------- #
# The writer
# --------------------------------------------------------------------------- #


class Journal:
    """Append-only writer of one journal directory (one daemon owns it).

    ``next_lsn`` is the lsn of the next event: pass ``recover(dir).last_lsn + 1``
    after a recovery; when None the journal reads the newest segment to find it
    (and cuts a torn tail it finds there). ``wall_ms``/``mono_ms`` are the
    clocks (ms); tests pass fake ones.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        fsync: str | FsyncPolicy = "always",
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        host: str | None = None,
        name: str = "default",
        next_lsn: int | None = None,
        wall_ms: Callable[[], int] = _wall_ms,
        mono_ms: Callable[[], int] = _mono_ms,
    ) -> None:
        self.policy = parse_fsync_policy(fsync)
        if segment_bytes <= 0:
            raise InvalidRequest(f"segment_bytes must be > 0, not {segment_bytes}")
        self.directory = Path(directory)
        prepare_directory(self.directory)
        self.segment_bytes = segment_bytes
        self.host = host if host is not None else socket.gethostname()
        self.name = name
        self._wall_ms = wall_ms
        self._mono_ms = mono_ms
        if next_lsn is None:
            next_lsn = _last_lsn_on_disk(self.directory, repair=True) + 1
        if next_lsn < 1:
            raise InvalidRequest(f"next_lsn starts at 1, not {next_lsn}")
        self._last_lsn = next_lsn - 1
        self._durable_lsn = next_lsn - 1
        self._unsynced_since_ms: int | None = None
        self._always = self.policy.mode == "always"
        self._interval = self.policy.mode == "interval"
        self._fd = -1
        self._segment_size = 0
        self.segment_path: Path | None = None
        self.fsync_count = 0
        # background group commit (start_sync/poll_sync): the helper thread, the fsync in
        # flight as (future, lsn it covers, segment, bytes it covers, mono ms it started)
        self._sync_thread = None
        self._sync_in_flight = None
        #: called as ``on_synced(segment_path, bytes_on_disk, started_mono_ms)`` when a
        #: background fsync completes (the chaos test's power-cut model listens here)
        self.on_synced: Callable[[Path, int, int], None] | None = None
        self._open_segment(next_lsn)

    # -- state -------------------------------------------------------------

    @property
    def last_lsn(self) -> int:
        """Lsn of the last event appended (written to the file, maybe not synced)."""
        return self._last_lsn

    @property
    def durable_lsn(self) -> int:
        """Highest lsn known to be on disk (fsynced)."""
        return self._durable_lsn

    @property
    def sync_due_ms(self) -> int | None:
        """Monotonic ms at which :meth:`maybe_sync` must run next (None: nothing to sync)."""
        if not self._interval or self._unsynced_since_ms is None:
            return None
        return self._unsynced_since_ms + self.policy.interval_ms

    @property
    def closed(self) -> bool:
        return self._fd < 0

    # -- writing -----------------------------------------------------------

    def append(self, events: Sequence[msgspec.Struct], now_ms: int | None = None) -> int:
        """Number, encode and write one batch; return the lsn of its last event.

        Sets ``n`` on each event. With ``always`` the batch is fsynced before
        this returns; with ``interval`` ``now_ms`` (monotonic ms, read here if
        None) starts the sync window if nothing was pending.
        """
        if self._fd < 0:
            raise Closed("journal is closed")
        if not events:
            return self._last_lsn
        if self._segment_size >= self.segment_bytes:
            self._rotate()
        lsn = self._last_lsn
        for event in events:
            lsn += 1
            event.n = lsn
        data = encode_events(events)
        try:
            _write_all(self._fd, data)
        except OSError:
            # never leave half a batch that later events would follow
            try:
                os.ftruncate(self._fd, self._segment_size)
            except OSError:
                pass
            raise
        self._segment_size += len(data)
        self._last_lsn = lsn
        if self._always:
            os.fsync(self._fd)
            self.fsync_count += 1
            self._durable_lsn = lsn
        elif self._interval and self._unsynced_since_ms is None:
            self._unsynced_since_ms = self._mono_ms() if now_ms is None else now_ms
        return lsn

    def maybe_sync(self, now_ms: int | None = None) -> bool:
        """Fsync if the oldest unsynced event is ``interval`` ms old; True if it did."""
        if self._unsynced_since_ms is None or self._fd < 0:
            return False
        if now_ms is None:
            now_ms = self._mono_ms()
        if now_ms - self._unsynced_since_ms < self.policy.interval_ms:
            return False
        self.sync()
        return True

    # -- background group commit (the daemon's interval policy) ------------

    @property
    def sync_in_flight(self) -> bool:
        """True while a :meth:`start_sync` fsync has not been collected by :meth:`poll_sync`."""
        return self._sync_in_flight is not None

    def start_sync(self, now_ms: int | None = None) -> bool:
        """:meth:`maybe_sync` without waiting for the disk: start the fsync on a helper thread.

        The caller (the daemon's loop) goes on appending meanwhile: ``fsync(2)``
        releases the GIL, and a ``write(2)`` to the file during it is fine (the
        fsync covers at least what was written before it started). At most one
        fsync is in flight; :meth:`poll_sync` collects it and only then does
        ``durable_lsn`` advance. Events appended while it runs start the next
        window. True if an fsync was started.
        """
        self.poll_sync()
        if self._sync_in_flight is not None or self._unsynced_since_ms is None or self._fd < 0:
            return False
        if now_ms is None:
            now_ms = self._mono_ms()
        if now_ms - self._unsynced_since_ms < self.policy.interval_ms:
            return False
        if self._sync_thread is None:
            from concurrent.futures import ThreadPoolExecutor

            self._sync_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wheeld-fsync")
        future = self._sync_thread.submit(os.fsync, self._fd)
        self._sync_in_flight = (future, self._last_lsn, self.segment_path, self._segment_size, now_ms)
        self._unsynced_since_ms = None
        return True

    def poll_sync(self, wait: bool = False) -> bool:
        """Collect a finished background fsync (``wait``: wait for it); True if one was.

        An fsync error is raised here, in the caller's thread, as a synchronous
        fsync would raise it.
        """
        in_flight = self._sync_in_flight
        if in_flight is None:
            return False
        future, lsn, path, size, started_ms = in_flight
        if not wait and not future.done():
            return False
        self._sync_in_flight = None
        future.result()
        self.fsync_count += 1
        self._durable_lsn = max(self._durable_lsn, lsn)
        if self.on_synced is not None:
            self.on_synced(path, size, started_ms)
        return True

    def sync(self) -> None:
        """Fsync the current segment now (any policy); ``durable_lsn`` catches up."""
        if self._fd < 0:
            raise Closed("journal is closed")
        self.poll_sync(wait=True)
        if self._durable_lsn != self._last_lsn:
            os.fsync(self._fd)
            self.fsync_count += 1
        self._durable_lsn = self._last_lsn
        self._unsynced_since_ms = None

    def close(self) -> None:
        """Sync (unless the policy is ``off``) and close. Idempotent."""
        if self._fd < 0:
            return
        try:
            if self.policy.mode != "off":
                self.sync()
        finally:
            try:
                self.poll_sync(wait=True)  # never close the fd under a running fsync
            finally:
                os.close(self._fd)
                self._fd = -1
                if self._sync_thread is not None:
                    self._sync_thread.shutdown(wait=True)
                    self._sync_thread = None

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- segments ----------------------------------------------------------

    def _open_segment(self, first_lsn: int) -> None:
        path = self.directory / segment_name(first_lsn)
        if path.exists():
            # only a segment that died before its first event can have our name
            scan, _ = _read_segment(path)
            if any(type(part) is list for part in scan.parts):
                raise CorruptJournal(f"{path} already holds events from lsn {first_lsn}; next_lsn is wrong")
            path.unlink()
        fd = _create_file(path, os.O_EXCL | os.O_APPEND)
        header = encode_event(
            SegmentHeader(
                host=self.host,
                name=self.name,
                lsn=first_lsn,
                t=self._wall_ms(),
                mono0=self._mono_ms(),
                wall0=self._wall_ms(),
            )
        )
        try:
            _write_all(fd, header)
            if self.policy.mode != "off":
                os.fsync(fd)
                _fsync_dir(self.directory)
                self.fsync_count += 1
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._segment_size = len(header)
        self.segment_path = path

    def _rotate(self) -> None:
        if self.policy.mode != "off":
            self.sync()
        self.poll_sync(wait=True)
        os.close(self._fd)
        self._fd = -1
        self._open_segment(self._last_lsn + 1)

    # -- snapshots ---------------------------------------------------------

    def write_snapshot(
        self,
        lsn: int,
        pending: Iterable[PendingTimer],
        unacked: Iterable[FiredTimer] = (),
    ) -> Path:
        """Write the state after event ``lsn`` atomically, then compact.

        ``pending``/``unacked`` must be the state after applying every event
        up to ``lsn`` (``lsn <= last_lsn``). The journal is fsynced first, so
        the snapshot never gets ahead of the journal on disk.
        """
        if self._fd < 0:
            raise Closed("journal is closed")
        if not 0 <= lsn <= self._last_lsn:
            raise InvalidRequest(f"snapshot lsn {lsn} is not in 0..{self._last_lsn}")
        self.sync()
        unset = UNSET
        pending_lines = [
            SnapshotPending(
                g=timer.group,
                k=key_to_json(timer.key),
                d=timer.deadline_ms,
                s=timer.seq,
                i=unset if timer.idle_ms is None else timer.idle_ms,
            )
            for timer in pending
        ]
        unacked_lines = [
            SnapshotUnacked(
                g=timer.group,
                k=key_to_json(timer.key),
                d=timer.deadline_ms,
                s=timer.seq,
                f=timer.fired_ms,
                late=timer.late,
                lat=timer.lateness_ms,
                i=unset if timer.idle_ms is None else timer.idle_ms,
            )
            for timer in unacked
        ]
        header = SnapshotHeader(lsn=lsn, count=0, unacked=0, t=self._wall_ms(), host=self.host, name=self.name)
        data = encode_snapshot(header, pending_lines, unacked_lines)
        del pending_lines, unacked_lines
        final = self.directory / snapshot_name(lsn)
        temporary = final.with_name(final.name + ".tmp")
        _write_file(temporary, data)
        os.replace(temporary, final)
        _fsync_dir(self.directory)
        self.fsync_count += 2
        self.compact()
        return final

    def compact(self) -> list[Path]:
        """Keep the newest two snapshots; delete segments covered by the older one.

        Returns the files deleted. A segment is covered when the next segment
        starts at or before ``older_snapshot_lsn + 1``; the segment being
        written is never deleted.
        """
        deleted: list[Path] = []
        snapshots = list_snapshots(self.directory)
        for _, path in snapshots[:-SNAPSHOTS_KEPT]:
            path.unlink(missing_ok=True)
            deleted.append(path)
        kept = snapshots[-SNAPSHOTS_KEPT:]
        if len(kept) == SNAPSHOTS_KEPT:
            floor_lsn = kept[0][0]
            segments = list_segments(self.directory)
            for (_, path), (next_first, _) in zip(segments, segments[1:]):
                if next_first <= floor_lsn + 1 and path != self.segment_path:
                    path.unlink(missing_ok=True)
                    deleted.append(path)
        if deleted:
            _fsync_dir(self.directory)
            log.info("journal: compaction deleted %s", ", ".join(path.name for path in deleted))
        return deleted


# --------------------------------------------------------------------------- #
# Recovery
# --------------------------------------------------------------------------- #


class _Findings:
    """What a recovery pass found, collected before anything is logged or repaired."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.problems: list[Problem] = []
        self.damage: list[DamagedRange] = []
        self.torn: list[Problem] = []
        self.repairs: list[Callable[[], None]] = []  # run only with repair=True and no refusal

    def add_damage(self, item: DamagedRange) -> None:
        self.damage.append(item)
        self.problems.append(Problem(item.path, item.start, item.reason, f"{item.where()}: {item.detail}; "
                                     f"{item.cost()}", item.action))

    def log(self) -> None:
        if self.quiet:
            return
        for item in self.damage:
            log.error("journal: damaged range: %s", item)


_salvage_decoder = msgspec.json.Decoder(Union[SnapshotHeader, PendingTimer, FiredTimer, SnapshotEnd])


def _salvage_snapshot(data: bytes, path: str) -> tuple[list, list, list[BadLines], int | None]:
    """Every good line of a damaged snapshot: ``(pending, unacked, bad runs, timers it held or None)``.

    Each snapshot line carries its own crc like a journal line, so a damaged
    byte costs one timer; the header (or the end line) says how many there
    were. When no line is bad (a line missing, counts that disagree) the
    whole file is one bad range.
    """
    lines = data.split(b"\n")
    tail = lines.pop()
    if tail:
        lines.append(tail)
    pending: list = []
    unacked: list = []
    bad: list[BadLines] = []
    held: int | None = None
    offset = 0
    run: list | None = None  # [start, first_line, lines, reason, detail]
    for index, line in enumerate(lines):
        body = None if tail and index == len(lines) - 1 else line_body(line)
        item = None
        reason, detail = CHECKSUM, f"line does not match its crc: {line[:60]!r}"
        if body is not None:
            try:
                item = _salvage_decoder.decode(body)
            except msgspec.DecodeError as exc:
                reason, detail = "bad-json", f"not a snapshot line: {exc}"
        if item is None:
            if run is None:
                run = [offset, index + 1, 0, reason, detail]
            run[2] += 1
        else:
            if run is not None:
                bad.append(BadLines(path, run[0], offset, run[1], run[2], run[3], run[4]))
                run = None
            kind = type(item)
            if kind is PendingTimer:
                pending.append(item)
            elif kind is FiredTimer:
                unacked.append(item)
            elif held is None:  # the header or the end line
                held = item.count + item.unacked
        offset += len(line) + 1
    if run is not None:
        bad.append(BadLines(path, run[0], len(data), run[1], run[2], run[3], run[4], at_end=True))
    return pending, unacked, bad, held


def _snapshot_damage(path: Path, data: bytes, error: str) -> list[BadLines]:
    _, _, bad, _ = _salvage_snapshot(data, str(path))
    if not bad:  # every line good, the whole does not hold together
        bad = [BadLines(str(path), 0, len(data), 1, max(1, data.count(b"\n")), "corrupt-snapshot", error)]
    return bad


def _report_snapshot(findings: _Findings, path: Path, data: bytes, error: str, action: str, lost: int = 0,
                     bad: list[BadLines] | None = None) -> None:
    findings.problems.append(Problem(str(path), 0, "corrupt-snapshot", error, action))
    for index, run in enumerate(bad if bad is not None else _snapshot_damage(path, data, error)):
        findings.damage.append(DamagedRange(run.path, run.start, run.end, run.first_line, run.lines, run.reason,
                                            run.detail, None, lost if index == 0 else 0, action))


def _load_base(directory: Path, segments: list, findings: _Findings, repair: bool):
    """The state recovery starts from: ``(snapshot lsn, pending, unacked)``.

    The newest snapshot that passes its checks. A damaged one costs nothing
    when an older good snapshot, or lsn 0, has the whole journal after it
    (compaction keeps the journal back to the older of two snapshots); it is
    then reported and renamed ``*.corrupt``. When nothing replaces it, the
    newest damaged snapshot is salvaged line by line (each line has its own
    crc): the timers on damaged lines are lost, the rest kept, loudly.
    """
    first_segment = segments[0][0] if segments else None

    def journal_after(lsn: int) -> bool:  # every event after lsn is in the segments (or there are none)
        return first_segment is None or first_segment <= lsn + 1

    damaged: list[tuple[int, Path, bytes, str]] = []
    for lsn, path in reversed(list_snapshots(directory)):
        data = b""
        try:
            with open(path, "rb") as file:
                data = file.read()
            header, pending, unacked = parse_snapshot(data, PendingTimer, FiredTimer)
            if header.lsn != lsn:
                raise CorruptJournal(f"snapshot names lsn {header.lsn} but the file name says {lsn}")
        except (CorruptJournal, OSError) as exc:
            damaged.append((lsn, path, data, str(exc)))
            continue
        if damaged and not journal_after(lsn):
            continue  # good, but the journal after it is gone: it would lose what the damaged ones hold
        _replaced(findings, damaged, f"snapshot-{lsn} and the journal after it replace it", repair)
        return header.lsn, pending, unacked
    if not damaged:
        return 0, [], []
    if journal_after(0):
        _replaced(findings, damaged, "the journal from lsn 1 replaces it", repair)
        return 0, [], []
    lsn, path, data, error = damaged[0]
    pending, unacked, bad, held = _salvage_snapshot(data, str(path))
    kept = len(pending) + len(unacked)
    lost = max(0, held - kept) if held is not None else sum(run.lines for run in bad)
    action = (f"no older snapshot or journal replaces it: salvaged {kept} timers line by line "
              f"({'of ' + str(held) if held is not None else 'count unknown'}); file left as is")
    _report_snapshot(findings, path, data, error, action, lost, bad or None)
    _replaced(findings, damaged[1:], "not used (a newer snapshot was salvaged)", repair)
    return lsn, pending, unacked


def _replaced(findings: _Findings, damaged: list, how: str, repair: bool) -> None:
    for _lsn, path, data, error in damaged:
        action = how
        if repair:
            action += f"; renamed to {path.name}.corrupt"
            findings.repairs.append(lambda path=path: path.rename(path.with_name(path.name + ".corrupt")))
        _report_snapshot(findings, path, data, error, action)


def recover(
    directory: str | os.PathLike[str],
    repair: bool = True,
    on_damage: str = "skip",
    quiet: bool = False,
) -> RecoveredState:
    """Rebuild pending and unacknowledged timers from a journal directory.

    Damage (module docstring, "Damage") is skipped and reported in
    ``damage``: a bad line followed by good lines costs the events on it; a
    bad tail of the newest segment is a torn write and is cut. With
    ``on_damage="refuse"`` any damage raises :class:`JournalDamaged` instead,
    before anything on disk is touched.

    With ``repair`` (the default) the newest segment's torn tail is cut,
    corrupted snapshots that something else replaces are renamed aside and
    leftover temporary files are removed, so the directory is clean for a new
    :class:`Journal`; damaged lines in the middle of a segment stay where they
    are. With ``repair=False`` nothing on disk changes. ``quiet``: log nothing
    (``wheelctl check --journal`` prints the findings itself).
    """
    if on_damage not in DAMAGE_POLICIES:
        raise InvalidRequest(f"journal damage policy is one of {', '.join(DAMAGE_POLICIES)}, not {on_damage!r}")
    started = time.perf_counter()
    directory = Path(directory)
    findings = _Findings(quiet)
    if not directory.is_dir():
        return RecoveredState({}, [], 0, 0, [])
    for entry in os.scandir(directory):
        if entry.name.endswith(".jsonl.tmp"):
            findings.repairs.append(lambda path=entry.path: os.unlink(path))

    # during replay keys stay in their journal form (str or int: cheap to hash);
    # the few escaped ones ("b64:", "str:") are converted at the end
    segments = list_segments(directory)
    snapshot_lsn, snapshot_pending, snapshot_unacked = _load_base(directory, segments, findings, repair)
    pending: dict[tuple[str, Any], PendingTimer] = {(timer.group, timer.key): timer for timer in snapshot_pending}
    unacked: dict[tuple[str, Any, int], FiredTimer] = {
        (timer.group, timer.key, timer.seq): timer for timer in snapshot_unacked
    }
    del snapshot_pending, snapshot_unacked

    replay = _Replay(pending, unacked, snapshot_lsn, findings)
    start = 0  # the last segment whose first lsn is <= snapshot_lsn + 1
    for index, (first_lsn, _) in enumerate(segments):
        if first_lsn <= snapshot_lsn + 1:
            start = index
    tails: list[tuple[Path, BadLines, bytes]] = []
    for index in range(start, len(segments)):
        first_lsn, path = segments[index]
        newest = index == len(segments) - 1
        if first_lsn > replay.last_lsn + 1:
            replay.missing(first_lsn, path, 0, "before this segment")
        scan, data = _read_segment(path, replay.last_lsn + 1)
        replay.segments_read += 1
        tail = _torn_tail(scan) if newest else None
        for part in scan.parts:
            if type(part) is list:
                replay.run(part, path)
            elif tail is None or part.start < tail.start:
                replay.waiting.append(part)
        if tail is not None:
            tails.append((path, tail, data))
        del data, scan
    replay.finish()
    last_lsn = max(replay.last_lsn, segments[-1][0] - 1 if segments else 0)

    if on_damage == "refuse" and findings.damage:
        findings.log()
        raise JournalDamaged(directory, findings.damage)
    findings.log()
    # now the disk: repairs, then the torn tails (their problems say what was done)
    if repair:
        for fix in findings.repairs:
            try:
                fix()
            except FileNotFoundError:
                pass
    torn_problems = []
    for path, tail, data in tails:
        if repair:
            action = _cut_segment(path, tail.start, data)
        else:
            action = "the lines from here on are ignored (repair=False: file left as is)"
        problem = Problem(str(path), tail.start, tail.reason, f"{tail.where()}: {tail.detail}", action)
        torn_problems.append(problem)
        if not quiet:
            log.warning("journal: torn tail (a write cut short by a crash): %s", problem)
    findings.problems += torn_problems

    escaped = [entry for entry in pending if type(entry[1]) is str and entry[1].startswith(_ESCAPED_KEYS)]
    for entry in escaped:
        timer = pending.pop(entry)
        timer.key = key_from_json(entry[1])
        pending[(entry[0], timer.key)] = timer
    for timer in unacked.values():
        timer.key = key_from_json(timer.key)
    elapsed_ms = (time.perf_counter() - started) * 1000
    if not quiet:
        log.info(
            "journal: recovered %d pending and %d unacked timers (snapshot lsn %d + %d events in %d segments, "
            "last lsn %d%s) in %.0f ms",
            len(pending),
            len(unacked),
            snapshot_lsn,
            replay.events_replayed,
            replay.segments_read,
            last_lsn,
            f"; {len(findings.damage)} damaged ranges skipped" if findings.damage else "",
            elapsed_ms,
        )
    return RecoveredState(
        pending, list(unacked.values()), last_lsn, snapshot_lsn, findings.problems, replay.segments_read,
        replay.events_replayed, elapsed_ms, findings.damage, torn_problems,
    )


class _Replay:
    """Applies runs of good events in lsn order and accounts for what is missing between them.

    ``waiting`` holds the bad runs seen since the last good event. The next
    good event says what they cost: an lsn above ``last_lsn + 1`` means the
    events in between are lost, and the waiting runs are where they were; an
    lsn at or below ``last_lsn`` means the bad runs lay among events the state
    already has (a snapshot covers them), which costs nothing and is not
    reported. A gap with no bad run before it (a segment file missing) is
    reported as a range of its own, with no damaged bytes.
    """

    def __init__(self, pending: dict, unacked: dict, last_lsn: int, findings: _Findings) -> None:
        self.pending = pending
        self.unacked = unacked
        self.last_lsn = last_lsn
        self.findings = findings
        self.waiting: list[BadLines] = []
        self.segments_read = 0
        self.events_replayed = 0

    def run(self, run: list, path: Path) -> None:
        last = self.last_lsn
        skip = 0
        if run[0].n <= last:  # already in the state (the snapshot's, or a repeated line)
            while skip < len(run) and run[skip].n <= last:
                skip += 1
            if self.waiting:
                self.waiting = []  # damage among events the state already has: costs nothing
            if skip == len(run):
                return
        first = run[skip].n
        if first > last + 1:
            self.missing(first, path, 0, "")
        else:
            self.resolve_waiting(None)
        if run[-1].n - first == len(run) - 1 - skip:  # consecutive lsns: the normal case
            self.events_replayed += _apply(run, skip, self.pending, self.unacked)
            self.last_lsn = run[-1].n
            return
        for index in range(skip, len(run)):  # lsns out of order: event by event
            n = run[index].n
            if n <= self.last_lsn:
                continue
            if n > self.last_lsn + 1:
                self.missing(n, path, 0, "")
            self.events_replayed += _apply(run, index, self.pending, self.unacked, index + 1)
            self.last_lsn = n

    def missing(self, next_lsn: int, path: Path, offset: int, where: str) -> None:
        """Events last_lsn+1 .. next_lsn-1 are not there: charge them to the waiting bad runs."""
        first, last = self.last_lsn + 1, next_lsn - 1
        if self.waiting:
            self.resolve_waiting((first, last))
            return
        detail = f"events {first}..{last} are missing{' ' + where if where else ''} with no damaged line before them"
        self.findings.add_damage(DamagedRange(
            str(path), offset, offset, 0, 0, LSN_GAP, detail, (first, last), last - first + 1,
            "replayed what exists; timers those events changed may be wrong",
        ))  # fmt: skip
        self.last_lsn = last

    def resolve_waiting(self, lost: tuple[int, int] | None) -> None:
        waiting, self.waiting = self.waiting, []
        for index, bad in enumerate(waiting):
            mine = lost if index == len(waiting) - 1 else None
            count = mine[1] - mine[0] + 1 if mine else 0
            if mine:
                action = "skipped, file left as is; the events after it are kept"
            elif lost:
                action = "skipped, file left as is; its events are counted with the next range"
            else:
                action = "skipped, file left as is; it held no event"
            self.findings.add_damage(DamagedRange(
                bad.path, bad.start, bad.end, bad.first_line, bad.lines, bad.reason, bad.detail, mine, count, action,
            ))  # fmt: skip
        if lost:
            self.last_lsn = max(self.last_lsn, lost[1])

    def finish(self) -> None:
        if self.waiting:  # bad runs at the end of an older segment, and no event anywhere after them
            self.resolve_waiting(None)


def _apply(events: list, start: int, pending: dict, unacked: dict, end: int | None = None) -> int:
    """Apply ``events[start:end]`` to the replay state; return how many were applied."""
    pop_pending = pending.pop
    pop_unacked = unacked.pop
    unset = UNSET
    end = len(events) if end is None else end
    for index in range(start, end):
        event = events[index]
        kind = type(event)
        if kind is Add or kind is Rearm:
            idle = event.i
            pending[(event.g, event.k)] = PendingTimer(event.g, event.k, event.d, event.s, None if idle is unset else idle)
        elif kind is Cancel:
            pop_pending((event.g, event.k), None)
        elif kind is Fire:
            pop_pending((event.g, event.k), None)
            idle = event.i
            unacked[(event.g, event.k, event.s)] = FiredTimer(
                event.g, event.k, event.d, event.s, event.f, event.late, event.lat, None if idle is unset else idle
            )
        elif kind is Ack:
            if pop_unacked((event.g, event.k, event.s), None) is None:
                # No fire event for it: a daemon killed between expiring the timer in
                # the arena and journaling the fire; the next daemon delivered it from
                # the arena and the ack was journaled. That arming is done.
                current = pending.get((event.g, event.k))
                if current is not None and current.seq == event.s:
                    pop_pending((event.g, event.k))
        elif kind is IdleRearm:
            current = pending.get((event.g, event.k))
            if current is None:
                pending[(event.g, event.k)] = PendingTimer(event.g, event.k, event.d, event.s, event.i)
            else:
                current.deadline_ms = event.d
    return max(0, end - start)


# --------------------------------------------------------------------------- #
# Checking a journal directory (wheelctl check --journal)
# --------------------------------------------------------------------------- #


class JournalReport(msgspec.Struct):
    """What :func:`check_journal` found.

    ``damage``: every damaged range, first those recovery would meet (with
    what they cost, as :func:`recover` reports them), then those it would not
    read (events a snapshot covers, snapshots a newer one replaces: they cost
    nothing now, but they are damaged bytes on disk). ``torn``: torn tails
    recovery would cut. ``recovered``: what a recovery would rebuild.
    """

    directory: str
    segments: int
    snapshots: int
    damage: list[DamagedRange]
    torn: list[Problem]
    pending: int
    unacked: int
    last_lsn: int
    snapshot_lsn: int

    @property
    def ok(self) -> bool:
        return not self.damage

    def to_dict(self) -> dict:
        return {
            "directory": self.directory, "ok": self.ok, "segments": self.segments, "snapshots": self.snapshots,
            "damaged_ranges": len(self.damage), "damaged_lines": sum(item.lines for item in self.damage),
            "lost_events": sum(item.lost for item in self.damage if item.lost_lsns is not None),
            "damage": [dict(msgspec.structs.asdict(item), where=item.where(), cost=item.cost())
                       for item in self.damage],
            "torn": [msgspec.structs.asdict(item) for item in self.torn],
            "recovery": {"pending": self.pending, "unacked": self.unacked, "last_lsn": self.last_lsn,
                         "snapshot_lsn": self.snapshot_lsn},
        }  # fmt: skip


def check_journal(directory: str | os.PathLike[str]) -> JournalReport:
    """Read every file of a journal directory and list its damage; change nothing.

    A dry run of :func:`recover` says what recovery would lose; then every
    segment is read whole and every snapshot parsed, to find the damage
    recovery would not read.
    """
    directory = Path(directory)
    state = recover(directory, repair=False, quiet=True)
    damage = list(state.damage)
    known = {(item.path, item.start) for item in damage}
    torn = {(item.path, item.offset) for item in state.torn}
    segments = list_segments(directory)
    for _first_lsn, path in segments:
        scan, _ = _read_segment(path)
        for bad in scan.bad:
            if (bad.path, bad.start) in known or (bad.path, bad.start) in torn:
                continue
            damage.append(DamagedRange(
                bad.path, bad.start, bad.end, bad.first_line, bad.lines, bad.reason, bad.detail, None, 0,
                f"not read by recovery: snapshot-{state.snapshot_lsn} covers these events",
            ))  # fmt: skip
    snapshots = list_snapshots(directory)
    for lsn, path in snapshots:
        if any(item.path == str(path) for item in damage):
            continue
        data = b""
        try:
            data = path.read_bytes()
            header, _, _ = parse_snapshot(data)
            if header.lsn != lsn:
                raise CorruptJournal(f"snapshot names lsn {header.lsn} but the file name says {lsn}")
        except (CorruptJournal, OSError) as exc:
            for bad in _snapshot_damage(path, data, str(exc)):
                damage.append(DamagedRange(
                    bad.path, bad.start, bad.end, bad.first_line, bad.lines, bad.reason, bad.detail, None, 0,
                    "not read by recovery: a newer snapshot is good",
                ))  # fmt: skip
    return JournalReport(str(directory), len(segments), len(snapshots), damage, state.torn, len(state.pending),
                         len(state.unacked), state.last_lsn, state.snapshot_lsn)
