"""The journal's files: appending, fsync policies, segments, snapshots, the directory.

The bytes are defined in :mod:`wheeld.protocol.journal` (JSON Lines, a crc per
line, ``journal-<lsn>.jsonl`` segments and ``snapshot-<lsn>.jsonl`` files).
This module owns the files: it appends, decides when they reach the disk,
rotates and compacts them. Rebuilding the timers from them after a reboot is
:mod:`wheeld.journal.recovery`. Both are used by the daemon, by
``wheelctl check --journal`` and by the pipeline's fleet generator, so they
live in ``protocol/`` and import nothing of the daemon.

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

The durable mark
================

After each fsync that makes events durable, the helper thread writes their lsn
into ``durable.mark`` (format: :mod:`wheeld.protocol.journal`, "The durable
mark"; ``pwrite`` + ``fdatasync`` of one 128-byte slot, at most one write in
flight, so the loop never waits for it and it costs no fsync of its own under
``always``). The mark thus trails :attr:`Journal.durable_lsn` by at most one
mark write, and never passes it. Recovery compares it with where the journal
ends: a torn write loses only what was never synced, so a journal that ends
before the mark was cut short after the fact, and that is damage
(:mod:`wheeld.journal.recovery`). ``off`` never fsyncs, so it writes
no mark (nothing is known to be durable).

When the journal cannot be written
==================================

A ``write(2)`` or ``fsync(2)`` that fails (``ENOSPC``, ``EDQUOT``, ``EIO``,
``EROFS``, ...) *stalls* the journal: the segment is cut back to its last whole
line (a partial line is never followed by more events), :attr:`Journal.stalled`
holds the error, and :meth:`Journal.append` raises
:class:`~wheeld.protocol.errors.JournalUnavailable`, then and at every append
until the journal is resumed. Events keep their lsns while nothing is written
(:attr:`Journal.last_lsn` goes on; :attr:`Journal.durable_lsn` stays), so the
files show the gap for what it is.

:meth:`Journal.resume` makes it writable again: it fsyncs (or cuts back) the
segment that failed, writes a *snapshot* of the owner's state at
:attr:`Journal.last_lsn` -- it covers every event of the stall, so nothing has
to be kept in memory meanwhile -- and opens a new segment after it. The owner
(the daemon, whose arena holds the timers) calls it about once a second; each
failed attempt costs a little (a free-space check first, so a snapshot is not
encoded for a disk that cannot take it). A recovery from that snapshot has
everything; from an older one (the newest damaged) it reports the events of
the stall as missing (``lsn-gap``).

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

Using it from the daemon
========================

::

    state = recovery.recover(journal_dir, on_damage="skip")   # only when the arena is missing
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
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import msgspec
from msgspec import UNSET

from wheeld.protocol import clock, fsport
from wheeld.protocol.errors import Closed, InvalidRequest, JournalUnavailable
from wheeld.protocol.journal import (
    MARK_NAME,
    MARK_SLOT,
    SEGMENT_PREFIX,
    SNAPSHOT_PREFIX,
    BadLines,
    CorruptJournal,
    LoggedEvent,
    SegmentHeader,
    SegmentScan,
    SnapshotHeader,
    SnapshotPending,
    SnapshotUnacked,
    encode_event,
    encode_events,
    encode_mark,
    encode_snapshot,
    key_to_json,
    parse_mark,
    parse_segment_name,
    parse_snapshot_name,
    scan_lines,
    segment_name,
    snapshot_name,
)

from .commit import GroupCommit, ThreadRunner

__all__ = [
    "DEFAULT_SEGMENT_BYTES",
    "FsyncPolicy",
    "parse_fsync_policy",
    "PendingTimer",
    "FiredTimer",
    "Journal",
    "prepare_directory",
    "FILE_MODE",
    "DIR_MODE",
    "read_clocks",
    "clock_offset_ns_above",
    "wall_to_monotonic",
    "wall_to_monotonic_ns",
    "list_segments",
    "list_snapshots",
    "read_segment",
    "torn_tail",
    "cut_segment",
    "last_lsn_on_disk",
    "read_mark",
    "free_bytes",
    "describe_error",
    "TRANSIENT_ERRNOS",
    "ThreadRunner",
]

log = logging.getLogger("wheeld.journal")

DEFAULT_SEGMENT_BYTES = 64 << 20
SNAPSHOTS_KEPT = 2


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
# Timers in a snapshot (and in a recovered state)
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


# --------------------------------------------------------------------------- #
# Clocks: the arena's monotonic deadlines and the journal's wall-clock ones
# --------------------------------------------------------------------------- #


def _bracketed_clocks(mono_ns: Callable[[], int] | None = None, wall_ns: Callable[[], int] | None = None,
                      tries: int = 3) -> tuple[int, int, int]:
    """``(monotonic ns before, wall ns, monotonic ns after)``: the wall clock read between
    two monotonic reads, the tightest of ``tries`` attempts. A process preempted between
    two clock reads (a loaded host) would otherwise skew the offset by the time it waited;
    it would have to be preempted in every attempt. The clocks are
    :func:`wheeld.protocol.clock.mono_ns` and :func:`~wheeld.protocol.clock.wall_ns`
    unless others are given (a simulation's)."""
    mono_ns = clock.mono_ns if mono_ns is None else mono_ns
    wall_ns = clock.wall_ns if wall_ns is None else wall_ns
    before = mono_ns()
    wall = wall_ns()
    best = (before, wall, mono_ns())
    for _ in range(tries - 1):
        before = mono_ns()
        wall = wall_ns()
        after = mono_ns()
        if after - before < best[2] - best[0]:
            best = (before, wall, after)
    return best


def read_clocks(mono_ns: Callable[[], int] | None = None, wall_ns: Callable[[], int] | None = None) -> tuple[int, int]:
    """``(wall ns, monotonic ns)`` with ``wall - mono`` at most the true offset between the
    clocks (the monotonic reading after the wall one; see :func:`wall_to_monotonic_ns`)."""
    _before, wall, after = _bracketed_clocks(mono_ns, wall_ns)
    return wall, after


def clock_offset_ns_above(mono_ns: Callable[[], int] | None = None, wall_ns: Callable[[], int] | None = None) -> int:
    """``wall - mono`` in ns, at least the true offset between the clocks (the monotonic
    reading before the wall one): what turns a monotonic deadline into a wall-clock one
    that is never early."""
    before, wall, _after = _bracketed_clocks(mono_ns, wall_ns)
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


def list_segments(directory: str | os.PathLike[str], fs: Any = os) -> list[tuple[int, Path]]:
    """``(first_lsn, path)`` of every segment in ``directory``, in lsn order. ``fs``: the
    file port (:mod:`wheeld.protocol.fsport`; the real one is :mod:`os`)."""
    return _listed(directory, parse_segment_name, fs)


def list_snapshots(directory: str | os.PathLike[str], fs: Any = os) -> list[tuple[int, Path]]:
    """``(lsn, path)`` of every snapshot in ``directory``, in lsn order."""
    return _listed(directory, parse_snapshot_name, fs)


def _listed(directory: str | os.PathLike[str], parse, fs: Any) -> list[tuple[int, Path]]:
    """``(lsn, path)`` of every entry whose name ``parse`` reads an lsn from, sorted."""
    found = [(lsn, Path(entry.path)) for entry in fs.scandir(directory) if (lsn := parse(entry.name)) is not None]
    found.sort()
    return found


#: Modes of what the journal creates, whatever the umask: the files hold every
#: key and group name, so they are readable by the daemon's group at most.
FILE_MODE = 0o640
DIR_MODE = 0o750


def _is_journal_file(name: str) -> bool:
    """A segment, a snapshot, or what recovery keeps of them (``.cut-N``, ``.corrupt``, ``.tmp``);
    the durable mark."""
    return name.startswith((SEGMENT_PREFIX, SNAPSHOT_PREFIX)) and ".jsonl" in name or name.startswith(MARK_NAME)


def prepare_directory(directory: str | os.PathLike[str], fs: Any = os) -> None:
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
    fs.makedirs(directory.parent, exist_ok=True)
    try:
        fs.mkdir(directory, DIR_MODE)
    except FileExistsError:
        if not fsport.is_dir(fs, directory):
            raise
        mode = stat.S_IMODE(fs.stat(directory).st_mode)
        if mode & ~DIR_MODE:
            _tighten(directory, mode, mode & DIR_MODE, fs)
    else:
        fs.chmod(directory, DIR_MODE)
        return
    wide = []
    for entry in fs.scandir(directory):
        if not _is_journal_file(entry.name) or not entry.is_file(follow_symlinks=False):
            continue
        mode = stat.S_IMODE(entry.stat(follow_symlinks=False).st_mode)
        if mode & ~FILE_MODE:
            wide.append((Path(entry.path), mode))
    for path, mode in wide:
        _tighten(path, mode, mode & FILE_MODE, fs, quiet=True)
    if wide:
        log.warning("journal: %d file(s) in %s were readable beyond owner and group (e.g. %s was %o); "
                    "tightened to %o", len(wide), directory, wide[0][0].name, wide[0][1], FILE_MODE)


def _tighten(path: Path, mode: int, wanted: int, fs: Any, quiet: bool = False) -> None:
    try:
        fs.chmod(path, wanted)
    except OSError as exc:
        log.warning("journal: %s has mode %o (keys and groups readable by others) and cannot be tightened "
                    "to %o: %s", path, mode, wanted, exc)
        return
    if not quiet:
        log.warning("journal: %s had mode %o; tightened to %o", path, mode, wanted)


def _create_file(path: Path, fs: Any, flags: int = 0) -> int:
    """Open a new journal file with mode :data:`FILE_MODE` whatever the umask; return the fd."""
    fd = fs.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | flags, FILE_MODE)
    try:
        fs.fchmod(fd, FILE_MODE)
    except BaseException:
        fs.close(fd)
        raise
    return fd


def _write_file(path: Path, data: bytes, fs: Any) -> None:
    """Write a whole new file (mode 0640) and fsync it."""
    fd = _create_file(path, fs, os.O_TRUNC)
    try:
        fsport.write_all(fs, fd, data)
        fs.fsync(fd)
    finally:
        fs.close(fd)


def cut_segment(path: Path, offset: int, data: bytes, fs: Any = os) -> str:
    """Truncate a segment at ``offset`` (its torn tail); keep cut complete lines aside."""
    kept = ""
    if b"\n" in data[offset:]:  # complete lines go: keep them as evidence
        aside = path.with_name(f"{path.name}.cut-{offset}")
        try:
            _write_file(aside, data[offset:], fs)
            kept = f"; cut bytes saved in {aside.name}"
        except OSError as exc:  # a full disk: the cut goes on (it frees space), the evidence cannot
            fsport.unlink(fs, aside, missing_ok=True)
            kept = f"; cut bytes NOT saved ({describe_error(exc)})"
    if offset == 0:
        fs.unlink(path)
        fsport.fsync_dir(fs, path.parent)
        return f"removed the file (no good line){kept}"
    fd = fs.open(path, os.O_WRONLY)
    try:
        fs.ftruncate(fd, offset)
        fs.fsync(fd)
    finally:
        fs.close(fd)
    return f"truncated to {offset} bytes{kept}"


def _starts_at(scan: SegmentScan, lsn: int) -> bool:
    """True if the first event read (after a damaged header, if any) is ``lsn``."""
    parts = scan.parts
    if parts and type(parts[0]) is BadLines and parts[0].first_line == 1 and parts[0].lines == 1:
        parts = parts[1:]
    return bool(parts) and type(parts[0]) is list and parts[0][0].n == lsn


def read_segment(path: Path, wanted_lsn: int | None = None, fs: Any = os) -> tuple[SegmentScan, bytes]:
    """Scan a segment past damage; with ``wanted_lsn``, skip (unchecked) the events before it.

    The events before ``wanted_lsn`` are found by counting lines. If the first
    line read is not that event (a damaged newline in the skipped part makes
    the count wrong, or the wanted line itself is damaged), the line holding
    its lsn is looked up by its text; failing that, the whole file is read and
    the caller drops the events it already has.
    """
    data = fsport.read_file(fs, path)
    name = str(path)
    first_lsn = parse_segment_name(path.name)
    skip = 0 if wanted_lsn is None or first_lsn is None else max(0, wanted_lsn - first_lsn)
    scan = scan_lines(data, name, skip)
    if skip and wanted_lsn is not None and not _starts_at(scan, wanted_lsn):
        position = data.find(b',"v":1,"n":%d,' % wanted_lsn)
        found: SegmentScan | None = None
        if position >= 0:
            line_start = data.rfind(b"\n", 0, position) + 1
            exact = data.count(b"\n", 0, line_start) - 1
            if exact >= 0:
                found = scan_lines(data, name, exact)
                if not _starts_at(found, wanted_lsn):
                    found = None
        scan = found if found is not None else scan_lines(data, name)
    return scan, data


def torn_tail(scan: SegmentScan) -> BadLines | None:
    """The first of the bad runs after the last good line (what a crash mid-write leaves), or None."""
    for part in scan.parts:
        if type(part) is BadLines and part.at_end:
            return part
    return None


def last_lsn_on_disk(directory: str | os.PathLike[str], repair: bool = False, fs: Any = os) -> int:
    """Highest lsn in the newest non-empty segment or snapshot (0 for an empty dir).

    With ``repair`` the newest segment's torn tail is cut first. Damage in the
    middle of a segment is left alone: the lsn after it is what counts.
    """
    directory = Path(directory)
    last = max((lsn for lsn, _ in list_snapshots(directory, fs)), default=0)
    segments = list_segments(directory, fs)
    for index in range(len(segments) - 1, -1, -1):
        first_lsn, path = segments[index]
        scan, data = read_segment(path, fs=fs)
        tail = torn_tail(scan)
        if tail is not None and repair and index == len(segments) - 1:
            action = cut_segment(path, tail.start, data, fs)
            log.warning("journal: torn tail %s -> %s", tail, action)
            if tail.start == 0:
                continue
        events = [part[-1].n for part in scan.parts if type(part) is list]
        if events:
            return max(last, *events)
        return max(last, first_lsn - 1)  # a header alone: the next lsn is the one its name announces
    return last


def read_mark(directory: str | os.PathLike[str], fs: Any = os) -> int:
    """The durable mark of a journal directory (:func:`wheeld.protocol.journal.parse_mark`;
    0 when it has none or it cannot be read)."""
    try:
        return parse_mark(fsport.read_file(fs, Path(directory) / MARK_NAME, 2 * MARK_SLOT))
    except FileNotFoundError:
        return 0


def free_bytes(directory: str | os.PathLike[str], fs: Any = os) -> int:
    """Bytes this process may still write on the filesystem of ``directory`` (root may
    use the blocks reserved for it)."""
    return fsport.free_bytes(fs, directory)


#: errors that let a daemon start with its journal stalled (they come and go: space is
#: freed, a quota raised, a path that failed answers again); any other error opening the
#: journal at start (a read-only or unwritable directory) is a configuration to fix
TRANSIENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EFBIG})


def describe_error(exc: BaseException) -> str:
    """``[Errno 28] No space left on device`` (ENOSPC): an OSError in one clause."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return f"{exc.strerror or os.strerror(exc.errno)} ({errno.errorcode.get(exc.errno, exc.errno)})"
    return str(exc)


# --------------------------------------------------------------------------- #
# The writer
# --------------------------------------------------------------------------- #


class Journal(GroupCommit):
    """Append-only writer of one journal directory (one daemon owns it).

    ``next_lsn`` is the lsn of the next event: pass ``recover(dir).last_lsn + 1``
    after a recovery; when None the journal reads the newest segment to find it
    (and cuts a torn tail it finds there). ``wall_ms``/``mono_ms`` are the
    clocks (ms; by default :mod:`wheeld.protocol.clock`'s); tests pass fake ones.
    ``fs`` is the file port every file operation goes through (:mod:`os` itself
    for real; :mod:`wheeld.protocol.fsport`), ``runner`` where the background
    fsyncs and mark writes run (:class:`ThreadRunner` unless given).

    ``resync``: do not open a segment; the journal starts as if stalled (without
    an error) and :meth:`resume` writes a snapshot first. For a daemon whose
    arena holds changes the files do not (lsns numbered while the journal could
    not be written). ``stall_on_error``: a segment that cannot be created for a
    transient reason (:data:`TRANSIENT_ERRNOS`: disk full...) starts the journal
    stalled instead of raising; any other error raises
    :class:`~wheeld.protocol.errors.JournalUnavailable`.

    Stalls: see the module docstring, "When the journal cannot be written".
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        fsync: str | FsyncPolicy = "always",
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        host: str | None = None,
        name: str = "default",
        next_lsn: int | None = None,
        wall_ms: Callable[[], int] = clock.wall_ms,
        mono_ms: Callable[[], int] = clock.mono_ms,
        *,
        resync: bool = False,
        stall_on_error: bool = False,
        fs: Any = os,
        runner: Any = None,
    ) -> None:
        self.policy = parse_fsync_policy(fsync)
        if segment_bytes <= 0:
            raise InvalidRequest(f"segment_bytes must be > 0, not {segment_bytes}")
        self.directory = Path(directory)
        self.fs = fs
        try:
            prepare_directory(self.directory, fs)
            if next_lsn is None:
                next_lsn = last_lsn_on_disk(self.directory, repair=True, fs=fs) + 1
        except OSError as exc:
            raise JournalUnavailable(f"journal directory {self.directory} cannot be used: {exc}") from exc
        self.segment_bytes = segment_bytes
        self.host = host if host is not None else socket.gethostname()
        self.name = name
        self._wall_ms = wall_ms
        self._mono_ms = mono_ms
        if next_lsn < 1:
            raise InvalidRequest(f"next_lsn starts at 1, not {next_lsn}")
        self._init_writer(next_lsn)
        self._init_group_commit(runner, resync)
        if resync:
            return
        try:
            self._open_segment(next_lsn)
        except OSError as exc:
            if not stall_on_error or exc.errno not in TRANSIENT_ERRNOS:
                raise JournalUnavailable(f"journal directory {self.directory} cannot be written: {exc}") from exc
            self._stall(exc)

    def _init_writer(self, next_lsn: int) -> None:
        """The writer's state: numbering, the open segment, what is synced, stalls."""
        self._last_lsn = next_lsn - 1
        self._durable_lsn = next_lsn - 1  # the caller says so; with resync, only the mark does
        self._unsynced_since_ms: int | None = None
        self._always = self.policy.mode == "always"
        self._interval = self.policy.mode == "interval"
        self._fd = -1
        self._closed = False
        self._segment_size = 0  # bytes of the segment that are whole lines written
        self._durable_size = 0  # ... of which fsynced
        self.segment_path: Path | None = None
        self.fsync_count = 0
        #: why the journal cannot be written (the OSError), None while it can
        self.stalled: OSError | None = None
        self.stalls = 0  # times it stopped being writable
        self.unwritten_events = 0  # events numbered while it could not be written (a resume's snapshot covers them)
        self._cut_to: int | None = None  # the segment must be cut back to this size before it is synced
        # under "off": segments rotated away from without a sync, and whether the directory holds
        # names not synced yet (sync() makes both durable)
        self._unsynced_segments: list[Path] = []
        self._directory_unsynced = False
        #: told every batch written (``appended(first_lsn, last_lsn, data)``) and every snapshot
        #: (``snapshotted(lsn, data)``), in order: :class:`wheeld.fleet.replicator.Replicator`
        self.tap: Any = None


    # -- state -------------------------------------------------------------

    @property
    def last_lsn(self) -> int:
        """Lsn of the last event numbered (written to the file, maybe not synced; or, while
        the journal is stalled, not written at all)."""
        return self._last_lsn

    @property
    def durable_lsn(self) -> int:
        """Highest lsn known to be on disk (fsynced), in a segment or a snapshot."""
        return self._durable_lsn


    @property
    def sync_due_ms(self) -> int | None:
        """Monotonic ms at which :meth:`maybe_sync` must run next (None: nothing to sync)."""
        if not self._interval or self._unsynced_since_ms is None:
            return None
        return self._unsynced_since_ms + self.policy.interval_ms

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def writable(self) -> bool:
        """False while stalled (or waiting for the first :meth:`resume` of ``resync``)."""
        return self._fd >= 0 and self.stalled is None

    def unavailable(self) -> str | None:
        """Why appends are not written, in one clause (None while the journal is writable)."""
        if self.writable:
            return None
        if self.stalled is None:
            return f"journal {self.directory} waits for its first snapshot"
        return f"journal {self.directory} cannot be written: {describe_error(self.stalled)}"

    # -- writing -----------------------------------------------------------

    def append(self, events: Sequence[LoggedEvent], now_ms: int | None = None) -> int:
        """Number, encode and write one batch; return the lsn of its last event.

        Sets ``n`` on each event. With ``always`` the batch is fsynced before
        this returns; with ``interval`` ``now_ms`` (monotonic ms, read here if
        None) starts the sync window if nothing was pending.

        A write or fsync that fails stalls the journal (the segment is cut back
        to its last whole line) and raises :class:`~wheeld.protocol.errors.JournalUnavailable`;
        so does every append while it is stalled. The events are numbered all the
        same, and a :meth:`resume`'s snapshot covers them.
        """
        if self._closed:
            raise Closed("journal is closed")
        if not events:
            return self._last_lsn
        if self.writable and self._segment_size >= self.segment_bytes:
            try:
                self._rotate()
            except JournalUnavailable:
                pass  # stalled: the batch is numbered and not written, below
        lsn = self._last_lsn
        for event in events:
            lsn += 1
            event.n = lsn
        if not self.writable:
            self._last_lsn = lsn
            self.unwritten_events += len(events)
            raise JournalUnavailable(self.unavailable())
        data = encode_events(events)
        before = self._segment_size
        try:
            fsport.write_all(self.fs, self._fd, data)
        except OSError as exc:
            self._last_lsn = lsn
            self.unwritten_events += len(events)
            self._cut_to = before  # never leave half a batch that later events would follow
            self._stall(exc)
            raise JournalUnavailable(self.unavailable()) from exc
        self._segment_size += len(data)
        first_lsn, self._last_lsn = self._last_lsn + 1, lsn
        if self._always:
            try:
                self.fs.fsync(self._fd)
            except OSError as exc:
                self._stall(exc)
                raise JournalUnavailable(self.unavailable()) from exc
            self.fsync_count += 1
            self._durable(lsn, self._segment_size)
        elif self._interval and self._unsynced_since_ms is None:
            self._unsynced_since_ms = self._mono_ms() if now_ms is None else now_ms
        if self.tap is not None:  # a replica (wheeld --replicate) gets the same bytes, in order
            self.tap.appended(first_lsn, lsn, data)
        return lsn


    def sync_previous_segments(self) -> list[tuple[Path, int]]:
        """Fsync every segment of the directory but the one being written; ``(path, size)``
        of each.

        A process killed without a reboot leaves its last events written but maybe not
        fsynced (the page cache keeps them); a journal opened after it writes a new
        segment and would only ever fsync that one, so a later power cut would lose them.
        The directory is fsynced too: the names of segments created under ``off`` (which
        never fsyncs the directory) are durable only then."""
        fs = self.fs
        synced = []
        for _lsn, path in list_segments(self.directory, fs):
            if path == self.segment_path:
                continue
            fd = fs.open(path, os.O_RDONLY)
            try:
                fs.fsync(fd)
            finally:
                fs.close(fd)
            synced.append((path, fsport.file_size(fs, path)))
        if synced:
            fsport.fsync_dir(fs, self.directory)
        return synced

    # -- the durable mark (its bookkeeping: journal/commit.py) ----------------

    def _write_mark(self, lsn: int) -> None:
        """Write the mark ``lsn`` into the older slot and fdatasync it (on the helper thread).

        The file is created whole (both slots) under a temporary name the first time; after
        that it is only overwritten in place, so it never needs a new block."""
        fs = self.fs
        slot = encode_mark(lsn, self._wall_ms())
        if self._mark_fd < 0:
            path = self.directory / MARK_NAME
            if not fsport.exists(fs, path):
                temporary = path.with_name(MARK_NAME + ".tmp")
                fd = _create_file(temporary, fs, os.O_TRUNC)
                try:
                    fsport.write_all(fs, fd, slot + slot)
                    fs.fdatasync(fd)  # the mark needs its bytes and size on disk, not its timestamps
                finally:
                    fs.close(fd)
                fs.replace(temporary, path)
                directory = fs.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    fs.fdatasync(directory)
                finally:
                    fs.close(directory)
                self._mark_fd = fs.open(path, os.O_RDWR | os.O_CLOEXEC)
                return
            self._mark_fd = fs.open(path, os.O_RDWR | os.O_CLOEXEC)
        fs.pwrite(self._mark_fd, slot, self._mark_slot * MARK_SLOT)
        fs.fdatasync(self._mark_fd)
        self._mark_slot ^= 1


    def close(self) -> None:
        """Sync (unless the policy is ``off``), write the mark and close. Idempotent.

        A stalled journal is closed as it is: the events it could not write stay unwritten."""
        if self._closed:
            return
        try:
            if self.policy.mode != "off" and self.writable:
                self.sync()
            self.flush_mark()
        finally:
            self._closed = True
            try:
                if self._sync_in_flight is not None:
                    try:
                        self.poll_sync(wait=True)  # never close the fd under a running fsync
                    except JournalUnavailable:
                        pass
            finally:
                self._poll_mark(wait=True)
                for fd in (self._fd, self._mark_fd):
                    if fd >= 0:
                        self.fs.close(fd)
                self._fd = self._mark_fd = -1
                self._runner.shutdown()
                if self.stalled is not None and self.unwritten_events:
                    log.warning("journal: closed while it could not be written (%s); events up to lsn %d are not "
                                "on disk", describe_error(self.stalled), self._last_lsn)

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- when the journal cannot be written -------------------------------

    def _stall(self, exc: OSError) -> None:
        """Stop writing: cut the segment back to its last whole line (or remember to)."""
        if self.stalled is None:
            self.stalls += 1
        self.stalled = exc
        self._unsynced_since_ms = None
        if self._cut_to is not None and self._fd >= 0:
            try:
                self.fs.ftruncate(self._fd, self._cut_to)
                self._segment_size = self._cut_to
                self._cut_to = None
            except OSError:
                pass  # cut at the next resume, before anything else

    def resume(self, state: Callable[[], tuple[Iterable[PendingTimer], Iterable[FiredTimer]]],
               min_free: int = 0) -> bool:
        """Make a stalled journal writable again; True if it is.

        1. the segment that failed is cut back to its last whole line if that is
           still to do, and fsynced (if that fails, cut back to what was fsynced
           before); then closed;
        2. if the filesystem has less than ``min_free`` bytes free, stop here
           (False: no point encoding a snapshot that cannot fit);
        3. a snapshot of ``state()`` (the pending and unacknowledged timers the
           owner holds now) at :attr:`last_lsn`: it covers every event numbered
           while nothing was written;
        4. a new segment from ``last_lsn + 1``.

        Any OSError on the way keeps the journal stalled (with that error) and
        returns False; a call later starts over.
        """
        if self._closed:
            raise Closed("journal is closed")
        if self.writable:
            return True
        try:
            self.poll_sync(wait=True)
        except JournalUnavailable:
            pass
        try:
            self._close_failed_segment()
            if min_free:
                free = free_bytes(self.directory, self.fs)
                if free < min_free:
                    if self.stalled is None:  # a resync that has no room yet
                        self._stall(OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)}: {free} bytes free, a "
                                                          f"snapshot needs about {min_free}"))
                    return False
            pending, unacked = state()
            self._write_snapshot_file(self._last_lsn, pending, unacked)
            del pending, unacked
            self._open_segment(self._last_lsn + 1)
        except OSError as exc:
            self.stalled = exc
            return False
        self.stalled = None
        self._unsynced_segments.clear()  # the snapshot holds what they held
        self._durable(self._last_lsn, self._segment_size)
        try:
            self.compact()
        except OSError as exc:
            log.warning("journal: compaction after the snapshot failed: %s", exc)
        return True

    def _close_failed_segment(self) -> None:
        fd = self._fd
        if fd < 0:
            return
        fs = self.fs
        if self._cut_to is not None:
            fs.ftruncate(fd, self._cut_to)
            self._segment_size = self._cut_to
            self._cut_to = None
        if self.policy.mode != "off":
            try:
                fs.fsync(fd)
            except OSError:
                # what was written since the last good fsync may not be on disk: keep only that
                fs.ftruncate(fd, self._durable_size)
                self._segment_size = self._durable_size
                fs.fsync(fd)
            self.fsync_count += 1
        fs.close(fd)
        self._fd = -1

    # -- segments ----------------------------------------------------------

    def _open_segment(self, first_lsn: int) -> None:
        fs = self.fs
        path = self.directory / segment_name(first_lsn)
        if fsport.exists(fs, path):
            # only a segment that died before its first event can have our name
            scan, _ = read_segment(path, fs=fs)
            if any(type(part) is list for part in scan.parts):
                raise CorruptJournal(f"{path} already holds events from lsn {first_lsn}; next_lsn is wrong")
            fs.unlink(path)
        fd = _create_file(path, fs, os.O_EXCL | os.O_APPEND)
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
            fsport.write_all(fs, fd, header)
            if self.policy.mode != "off":
                fs.fsync(fd)
                fsport.fsync_dir(fs, self.directory)
                self.fsync_count += 1
            else:
                self._directory_unsynced = True
        except BaseException:
            fs.close(fd)
            try:
                fs.unlink(path)  # a header cut short would read as a damaged segment
            except OSError:
                pass
            raise
        self._fd = fd
        self._segment_size = len(header)
        self._durable_size = len(header) if self.policy.mode != "off" else 0
        self.segment_path = path

    def _fsync_path(self, path: Path) -> None:
        try:
            fd = self.fs.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return  # compacted away: nothing in it is needed
        try:
            self.fs.fsync(fd)
        finally:
            self.fs.close(fd)

    def _rotate(self) -> None:
        if self.policy.mode != "off":
            self.sync()
        else:  # its events are on disk only after a sync() (a snapshot, a close)
            assert self.segment_path is not None  # rotated only while writable: a segment is open
            self._unsynced_segments.append(self.segment_path)
        self.poll_sync(wait=True)
        self.fs.close(self._fd)
        self._fd = -1
        try:
            self._open_segment(self._last_lsn + 1)
        except OSError as exc:
            self._stall(exc)
            raise JournalUnavailable(self.unavailable()) from exc

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
        the snapshot never gets ahead of the journal on disk. A snapshot file
        that cannot be written raises its OSError (the temporary file removed,
        the journal still writable); a journal that cannot be fsynced raises
        :class:`~wheeld.protocol.errors.JournalUnavailable`.
        """
        if self._closed:
            raise Closed("journal is closed")
        if not 0 <= lsn <= self._last_lsn:
            raise InvalidRequest(f"snapshot lsn {lsn} is not in 0..{self._last_lsn}")
        self.sync()
        final = self._write_snapshot_file(lsn, pending, unacked)
        self.compact()
        return final

    def _write_snapshot_file(self, lsn: int, pending: Iterable[PendingTimer], unacked: Iterable[FiredTimer]) -> Path:
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
        fs = self.fs
        try:
            _write_file(temporary, data, fs)
            fs.replace(temporary, final)
        except OSError:
            try:
                fs.unlink(temporary)
            except OSError:
                pass
            raise
        fsport.fsync_dir(fs, self.directory)
        self.fsync_count += 2
        if self.tap is not None:
            self.tap.snapshotted(lsn, data)
        return final

    def compact(self) -> list[Path]:
        """Keep the newest two snapshots; delete segments covered by the older one.

        Returns the files deleted. A segment is covered when the next segment
        starts at or before ``older_snapshot_lsn + 1``; the segment being
        written is never deleted.
        """
        fs = self.fs
        deleted: list[Path] = []
        snapshots = list_snapshots(self.directory, fs)
        for _, path in snapshots[:-SNAPSHOTS_KEPT]:
            fsport.unlink(fs, path, missing_ok=True)
            deleted.append(path)
        kept = snapshots[-SNAPSHOTS_KEPT:]
        if len(kept) == SNAPSHOTS_KEPT:
            floor_lsn = kept[0][0]
            segments = list_segments(self.directory, fs)
            for (_, path), (next_first, _) in zip(segments, segments[1:]):
                if next_first <= floor_lsn + 1 and path != self.segment_path:
                    fsport.unlink(fs, path, missing_ok=True)
                    deleted.append(path)
        if deleted:
            fsport.fsync_dir(fs, self.directory)
            log.info("journal: compaction deleted %s", ", ".join(path.name for path in deleted))
        return deleted

