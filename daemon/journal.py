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
   line agree); a corrupted one is reported, renamed to ``*.corrupt`` and the
   previous one used instead;
2. the events after the snapshot's lsn, segment by segment, applied to a dict
   ``(group, key) -> pending timer`` and a dict of fired-but-unacked timers
   (the reference model in :mod:`wheeld.protocol.journal`);
3. a bad line stops the replay of its segment. In the newest segment (the
   crash case: a torn tail) the file is cut at the last good line and a
   warning names the file, the byte offset and the reason; bytes cut that
   held complete lines are first saved next to it as ``<segment>.cut-<offset>``.
   In an older segment (media corruption) the file is left as it is, the
   problem is reported and replay goes on with the next segment.

The result, :class:`RecoveredState`, holds wall-clock deadlines. The arena runs
on the monotonic clock: :func:`wall_to_monotonic` converts, and a timer whose
deadline passed while the host was down fires at once with ``late=True`` and
its lateness (as systemd's ``Persistent=``); the daemon does that.

Using it from the daemon
========================

::

    state = recover(journal_dir)                  # only when the arena is missing
    journal = Journal(journal_dir, fsync="interval=10", name=daemon_name,
                      next_lsn=state.last_lsn + 1)
    now_wall, now_mono = wall_ms(), mono_ms()
    for timer in state.pending.values():          # overdue ones fire at once, late=True
        arena.insert(timer.group, timer.key,
                     wall_to_monotonic(timer.deadline_ms, now_wall, now_mono), ...)
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
C-level loops and decoded with one call per file. Keys stay in their journal
form during replay and only the escaped ones are converted at the end.
Measured here (``python bench/journal.py``): 1M pending timers from a
snapshot plus 100k journal events in 1.6-1.9 s, from a journal of 1M adds
without a snapshot in 1.7-1.9 s (target: under 5 s).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import msgspec
from msgspec import UNSET

from wheeld.protocol.errors import Closed, InvalidRequest
from wheeld.protocol.journal import (
    Ack,
    Add,
    Cancel,
    CorruptJournal,
    Defect,
    Fire,
    IdleRearm,
    Rearm,
    SegmentHeader,
    SnapshotHeader,
    SnapshotPending,
    SnapshotUnacked,
    LSN_GAP,
    TORN,
    encode_event,
    encode_events,
    encode_snapshot,
    key_from_json,
    key_to_json,
    parse_segment_name,
    parse_snapshot,
    parse_snapshot_name,
    scan_segment,
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
    "RecoveredState",
    "Journal",
    "recover",
    "wall_to_monotonic",
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


class RecoveredState(msgspec.Struct):
    """What :func:`recover` rebuilt.

    ``pending`` maps (group, key) to its timer; ``unacked`` are fired timers
    to deliver again; ``last_lsn`` is the last event applied (the journal
    continues at ``last_lsn + 1``); ``snapshot_lsn`` is the snapshot used (0:
    none); ``problems`` lists what was cut, skipped or missing.
    """

    pending: dict[tuple[str, Key], PendingTimer]
    unacked: list[FiredTimer]
    last_lsn: int
    snapshot_lsn: int
    problems: list[Problem]
    segments_read: int = 0
    events_replayed: int = 0
    elapsed_ms: float = 0.0


def wall_to_monotonic(deadline_wall_ms: int, now_wall_ms: int, now_mono_ms: int) -> int:
    """Monotonic deadline for a wall-clock one, given both clocks read together.

    A deadline already past maps to ``now_mono_ms`` or earlier: it is due now.
    """
    return now_mono_ms + (deadline_wall_ms - now_wall_ms)


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


def _cut_segment(path: Path, defect: Defect, data: bytes) -> str:
    """Truncate a segment at its last good line; keep cut complete lines aside."""
    kept = ""
    if defect.reason != TORN or defect.lines_after:
        aside = path.with_name(f"{path.name}.cut-{defect.offset}")
        with open(aside, "wb") as file:
            file.write(data[defect.offset :])
            file.flush()
            os.fsync(file.fileno())
        kept = f"; cut bytes saved in {aside.name}"
    if defect.offset == 0:
        path.unlink()
        _fsync_dir(path.parent)
        return f"removed the file (no good line){kept}"
    fd = os.open(path, os.O_WRONLY)
    try:
        os.ftruncate(fd, defect.offset)
        os.fsync(fd)
    finally:
        os.close(fd)
    return f"truncated to {defect.offset} bytes{kept}"


def _read_segment(path: Path, wanted_lsn: int | None = None) -> tuple[list, Defect | None, bytes]:
    """Scan a segment; with ``wanted_lsn``, skip (unchecked) the events before it."""
    with open(path, "rb") as file:
        data = file.read()
    first_lsn = parse_segment_name(path.name)
    skip = 0 if wanted_lsn is None or first_lsn is None else max(0, wanted_lsn - first_lsn)
    events, _, defect = scan_segment(data, str(path), skip)
    if skip and len(events) > 1 and events[1].n != wanted_lsn:
        # the line count is off (a damaged newline in the skipped part):
        # find the wanted event's line by its lsn and skip exactly up to it
        position = data.find(b',"v":1,"n":%d,' % wanted_lsn)
        if position >= 0:
            line_start = data.rfind(b"\n", 0, position) + 1
            events, _, defect = scan_segment(data, str(path), data.count(b"\n", 0, line_start) - 1)
        if len(events) > 1 and events[1].n != wanted_lsn:
            events, _, defect = scan_segment(data, str(path))
    return events, defect, data


def _last_lsn_on_disk(directory: Path, repair: bool) -> int:
    """Highest lsn in the newest non-empty segment or snapshot (0 for an empty dir)."""
    last = max((lsn for lsn, _ in list_snapshots(directory)), default=0)
    segments = list_segments(directory)
    for index in range(len(segments) - 1, -1, -1):
        _, path = segments[index]
        events, defect, data = _read_segment(path)
        if defect is not None and repair and index == len(segments) - 1:
            action = _cut_segment(path, defect, data)
            log.warning("journal: %s -> %s", defect, action)
        if len(events) > 1:
            return max(last, events[-1].n)
        if events:  # a header alone: the next lsn is the one it announced
            return max(last, events[0].lsn - 1)
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
        self.directory.mkdir(parents=True, exist_ok=True)
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
            events, _, _ = _read_segment(path)
            if len(events) > 1:
                raise CorruptJournal(f"{path} already holds events from lsn {first_lsn}; next_lsn is wrong")
            path.unlink()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o644)
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
        with open(temporary, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
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


def _load_snapshot(directory: Path, problems: list[Problem], repair: bool):
    for lsn, path in reversed(list_snapshots(directory)):
        try:
            with open(path, "rb") as file:
                data = file.read()
            header, pending, unacked = parse_snapshot(data, PendingTimer, FiredTimer)
            if header.lsn != lsn:
                raise CorruptJournal(f"snapshot names lsn {header.lsn} but the file name says {lsn}")
            return header, pending, unacked
        except (CorruptJournal, OSError) as exc:
            action = "skipped; using an older snapshot and more journal"
            if repair:
                try:
                    path.rename(path.with_name(path.name + ".corrupt"))
                    action += f"; renamed to {path.name}.corrupt"
                except OSError:
                    pass
            problem = Problem(str(path), 0, "corrupt-snapshot", str(exc), action)
            log.error("journal: %s", problem)
            problems.append(problem)
    return None


def recover(directory: str | os.PathLike[str], repair: bool = True) -> RecoveredState:
    """Rebuild pending and unacknowledged timers from a journal directory.

    With ``repair`` (the default) the newest segment's bad tail is cut,
    corrupted snapshots are renamed aside and leftover temporary files are
    removed, so the directory is clean for a new :class:`Journal`. With
    ``repair=False`` nothing on disk changes.
    """
    started = time.perf_counter()
    directory = Path(directory)
    problems: list[Problem] = []
    if not directory.is_dir():
        return RecoveredState({}, [], 0, 0, problems)
    if repair:
        for entry in os.scandir(directory):
            if entry.name.endswith(".jsonl.tmp"):
                os.unlink(entry.path)

    # during replay keys stay in their journal form (str or int: cheap to hash);
    # the few escaped ones ("b64:", "str:") are converted at the end
    pending: dict[tuple[str, Any], PendingTimer] = {}
    unacked: dict[tuple[str, Any, int], FiredTimer] = {}
    snapshot_lsn = 0
    loaded = _load_snapshot(directory, problems, repair)
    if loaded is not None:
        header, snapshot_pending, snapshot_unacked = loaded
        snapshot_lsn = header.lsn
        pending = {(timer.group, timer.key): timer for timer in snapshot_pending}
        unacked = {(timer.group, timer.key, timer.seq): timer for timer in snapshot_unacked}
        del snapshot_pending, snapshot_unacked

    last_lsn = snapshot_lsn
    segments = list_segments(directory)
    # start at the last segment whose first lsn is <= snapshot_lsn + 1
    start = 0
    for index, (first_lsn, _) in enumerate(segments):
        if first_lsn <= snapshot_lsn + 1:
            start = index
    segments_read = 0
    events_replayed = 0
    for index in range(start, len(segments)):
        first_lsn, path = segments[index]
        events, defect, data = _read_segment(path, last_lsn + 1)
        segments_read += 1
        if defect is not None:
            newest = index == len(segments) - 1
            if newest and repair:
                action = _cut_segment(path, defect, data)
            elif newest:
                action = "events after it ignored (repair=False: file left as is)"
            else:
                action = "events after it in this segment skipped; file left as is; replay continues"
            problem = Problem(str(path), defect.offset, defect.reason, f"line {defect.line_no}: {defect.detail}", action)
            (log.warning if newest and defect.reason == TORN else log.error)("journal: %s", problem)
            problems.append(problem)
        del data
        if len(events) <= 1:
            continue
        first_n = events[1].n
        if first_n > last_lsn + 1:
            problem = Problem(
                str(path),
                0,
                LSN_GAP,
                f"events {last_lsn + 1}..{first_n - 1} are missing",
                "replayed what exists; timers changed by the missing events may be wrong",
            )
            log.error("journal: %s", problem)
            problems.append(problem)
        skip = max(0, last_lsn + 1 - first_n)  # events already in the snapshot
        applied = _apply(events, 1 + skip, pending, unacked)
        events_replayed += applied
        if applied:
            last_lsn = events[-1].n
        del events

    escaped = [entry for entry in pending if type(entry[1]) is str and entry[1].startswith(_ESCAPED_KEYS)]
    for entry in escaped:
        timer = pending.pop(entry)
        timer.key = key_from_json(entry[1])
        pending[(entry[0], timer.key)] = timer
    for timer in unacked.values():
        timer.key = key_from_json(timer.key)
    elapsed_ms = (time.perf_counter() - started) * 1000
    log.info(
        "journal: recovered %d pending and %d unacked timers (snapshot lsn %d + %d events in %d segments, last lsn %d) in %.0f ms",
        len(pending),
        len(unacked),
        snapshot_lsn,
        events_replayed,
        segments_read,
        last_lsn,
        elapsed_ms,
    )
    return RecoveredState(
        pending, list(unacked.values()), last_lsn, snapshot_lsn, problems, segments_read, events_replayed, elapsed_ms
    )


def _apply(events: list, start: int, pending: dict, unacked: dict) -> int:
    """Apply ``events[start:]`` to the replay state; return how many were applied."""
    pop_pending = pending.pop
    pop_unacked = unacked.pop
    unset = UNSET
    for index in range(start, len(events)):
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
    return max(0, len(events) - start)
