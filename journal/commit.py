"""Group commit and the durable mark of a :class:`~wheeld.journal.files.Journal`: when
what was written is fsynced, and how far the mark file says the journal is durable.

Under ``always`` every append is fsynced before it returns; under ``interval`` the
daemon's loop starts an fsync on a helper thread once the oldest unsynced event is
``interval`` ms old (:meth:`GroupCommit.start_sync`) and goes on appending while it
runs, collecting it later (:meth:`GroupCommit.poll_sync`): the events appended meanwhile
ride on the next fsync, the group commit of databases (and of Kafka's log flusher).
Only a finished fsync moves ``durable_lsn``; after it, the durable mark (two slots in
``MARK_NAME``, written alternately with ``fdatasync``) is advanced on the same helper
thread, so a journal cut short before the mark can be told from a torn write.

The writer itself (segments, rotation, stalls, snapshots) is
:class:`~wheeld.journal.files.Journal`; this room is its mixin.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wheeld.protocol import fsport
from wheeld.protocol.errors import Closed, JournalUnavailable
from wheeld.protocol.journal import MARK_NAME, MARK_SLOT, parse_mark

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

    from .files import FsyncPolicy

__all__ = ["GroupCommit", "ThreadRunner"]

log = logging.getLogger("wheeld.journal")


class GroupCommit:
    """The group-commit room of :class:`~wheeld.journal.files.Journal` (a mixin: it reads
    the writer's state and calls its ``_stall``, ``_fsync_path`` and ``_write_mark``)."""

    if TYPE_CHECKING:  # the writer's fields and methods this room uses (Journal sets them)
        policy: FsyncPolicy
        fs: Any
        directory: Path
        segment_path: Path | None
        stalled: OSError | None
        fsync_count: int
        _fd: int
        _closed: bool
        _last_lsn: int
        _durable_lsn: int
        _durable_size: int
        _segment_size: int
        _unsynced_since_ms: int | None
        _unsynced_segments: list[Path]
        _directory_unsynced: bool
        _mono_ms: Callable[[], int]

        @property
        def writable(self) -> bool: ...
        def unavailable(self) -> str | None: ...
        def _stall(self, exc: OSError) -> None: ...
        def _fsync_path(self, path: Path) -> None: ...
        def _write_mark(self, lsn: int) -> None: ...

    def _init_group_commit(self, runner: Any, resync: bool) -> None:
        """The background fsync and the durable mark's state."""
        fs = self.fs
        # background group commit (start_sync/poll_sync) and the durable mark: the runner
        # (a helper thread), the fsync in flight as (handle, lsn it covers, segment, bytes it
        # covers, mono ms it started), the mark write in flight as (handle, lsn)
        self._runner = runner if runner is not None else ThreadRunner()
        self._sync_in_flight: tuple[Any, int, Path, int, int] | None = None
        self._mark_in_flight: tuple[Any, int] | None = None
        self._mark_fd = -1
        self._marked_lsn, self._mark_slot = _mark_state(self.directory, fs)
        self._synced_lsn = self._marked_lsn  # the highest lsn an fsync of this journal made durable
        if resync:  # the files do not hold every lsn before next_lsn durably: what is known is the mark
            self._durable_lsn = min(self._durable_lsn, self._marked_lsn)
        self.mark_error: OSError | None = None
        #: called as ``on_synced(segment_path, bytes_on_disk, mono_ms)`` whenever an fsync made
        #: bytes of a segment durable (for a background fsync: the moment it started), before
        #: the durable mark can say so (the chaos test's power-cut model listens here)
        self.on_synced: Callable[[Path, int, int], None] | None = None

    @property
    def marked_lsn(self) -> int:
        """The durable mark on disk (or being written): at most :attr:`durable_lsn`."""
        return self._marked_lsn

    def maybe_sync(self, now_ms: int | None = None) -> bool:
        """Fsync if the oldest unsynced event is ``interval`` ms old; True if it did."""
        self._advance_mark()
        if self._unsynced_since_ms is None or not self.writable:
            return False
        if now_ms is None:
            now_ms = self._mono_ms()
        if now_ms - self._unsynced_since_ms < self.policy.interval_ms:
            return False
        self.sync()
        return True

    def _durable(self, lsn: int, size: int | None, started_ms: int | None = None) -> None:
        """An fsync made events up to ``lsn`` durable (``size``: bytes of the current segment
        it covered; None: another segment's fsync): :attr:`on_synced` is told, then the mark
        follows, on the helper thread (so whoever listens hears of the bytes first).

        Only an fsync feeds the mark: the lsns a journal starts after (``next_lsn - 1``)
        were not necessarily synced by the process that wrote them (``off``)."""
        self._durable_lsn = max(self._durable_lsn, lsn)
        self._synced_lsn = max(self._synced_lsn, lsn)
        if size is not None:
            self._durable_size = max(self._durable_size, size)
            if self.on_synced is not None:
                assert self.segment_path is not None  # size is that of the segment being written
                self.on_synced(self.segment_path, size, self._mono_ms() if started_ms is None else started_ms)
        self._advance_mark()

    def _poll_mark(self, wait: bool = False) -> None:
        """Collect a finished mark write; an error is logged once (the mark is a check on
        the journal, not its durability) and the mark stays where it was."""
        in_flight = self._mark_in_flight
        if in_flight is None or (not wait and not in_flight[0].done()):
            return
        self._mark_in_flight = None
        try:
            in_flight[0].result()
        except OSError as exc:
            if self.mark_error is None:
                log.error("journal: the durable mark %s cannot be written (%s); a journal cut short before "
                          "lsn %d would not be told from a torn write", self.directory / MARK_NAME, exc,
                          self._durable_lsn)
            self.mark_error = exc
            return
        if self.mark_error is not None:
            log.warning("journal: the durable mark is written again")
            self.mark_error = None
        self._marked_lsn = max(self._marked_lsn, in_flight[1])

    def _advance_mark(self) -> None:
        """Collect a finished mark write; start the next if the mark trails what was fsynced."""
        self._poll_mark()
        if self._mark_in_flight is None and self._synced_lsn > self._marked_lsn and not self._closed:
            lsn = self._synced_lsn
            self._mark_in_flight = (self._runner.submit(self._write_mark, lsn), lsn)

    def flush_mark(self) -> None:
        """Wait for the mark write in flight, then write the mark up to what was fsynced."""
        self._poll_mark(wait=True)
        if self._synced_lsn > self._marked_lsn:
            lsn = self._synced_lsn
            self._mark_in_flight = (self._runner.submit(self._write_mark, lsn), lsn)
            self._poll_mark(wait=True)

    @property
    def mark_pending(self) -> bool:
        """A mark write is in flight, or the mark trails what was fsynced (and the last
        mark write did not fail: a failing one is tried again at the next fsync)."""
        return self._mark_in_flight is not None or (self._synced_lsn > self._marked_lsn and self.mark_error is None)

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
        self._advance_mark()
        if self._sync_in_flight is not None or self._unsynced_since_ms is None or not self.writable:
            return False
        if now_ms is None:
            now_ms = self._mono_ms()
        if now_ms - self._unsynced_since_ms < self.policy.interval_ms:
            return False
        assert self.segment_path is not None  # writable: a segment is open
        future = self._runner.submit(self.fs.fsync, self._fd)
        self._sync_in_flight = (future, self._last_lsn, self.segment_path, self._segment_size, now_ms)
        self._unsynced_since_ms = None
        return True

    def poll_sync(self, wait: bool = False) -> bool:
        """Collect a finished background fsync (``wait``: wait for it); True if one was.

        An fsync error is raised here, in the caller's thread, as a synchronous
        fsync would raise it: it stalls the journal
        (:class:`~wheeld.protocol.errors.JournalUnavailable`).
        """
        in_flight = self._sync_in_flight
        if in_flight is None:
            return False
        future, lsn, path, size, started_ms = in_flight
        if not wait and not future.done():
            return False
        self._sync_in_flight = None
        try:
            future.result()
        except OSError as exc:
            if self.stalled is None:
                self._stall(exc)
            raise JournalUnavailable(self.unavailable()) from exc
        self.fsync_count += 1
        if path == self.segment_path:
            self._durable(lsn, size, started_ms)
        else:  # the segment was rotated meanwhile
            if self.on_synced is not None:
                self.on_synced(path, size, started_ms)
            self._durable(lsn, None)
        return True

    def sync(self) -> None:
        """Fsync what was written now (any policy); ``durable_lsn`` catches up.

        That is the current segment, and under ``off`` also the segments it rotated
        away from without syncing them and the directory that names them: every event
        up to :attr:`last_lsn` is then on disk."""
        if self._closed:
            raise Closed("journal is closed")
        self.poll_sync(wait=True)
        if not self.writable:
            raise JournalUnavailable(self.unavailable())
        if self._durable_lsn != self._last_lsn or self._unsynced_segments or self._directory_unsynced:
            try:
                for path in self._unsynced_segments:
                    self._fsync_path(path)
                self.fs.fsync(self._fd)
                if self._directory_unsynced:
                    fsport.fsync_dir(self.fs, self.directory)
            except OSError as exc:
                self._stall(exc)
                raise JournalUnavailable(self.unavailable()) from exc
            self._unsynced_segments.clear()
            self._directory_unsynced = False
            self.fsync_count += 1
        self._durable(self._last_lsn, self._segment_size)
        self._unsynced_since_ms = None

class ThreadRunner:
    """Where the journal runs its background work: the fsyncs of ``interval`` and the
    durable mark's writes (the *runner* port of :class:`Journal`).

    ``submit(fn, *args)`` starts ``fn(*args)`` and returns a handle with ``done()``
    (finished?) and ``result()`` (wait for it; its exception raised here);
    ``shutdown()`` waits for what was submitted and releases the worker. This one
    is the real daemon's: one helper thread (``fsync(2)`` and ``fdatasync(2)``
    release the GIL, so the loop goes on meanwhile), made when first needed, so a
    journal that never needs it starts no thread. One worker runs the tasks in the
    order they were submitted. A simulation passes a runner of its own that runs
    them when the simulator decides (``tests/sim/runner.py``)."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None

    def submit(self, fn: Callable, *args: Any):
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wheeld-fsync")
        return self._pool.submit(fn, *args)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _mark_state(directory: Path, fs: Any) -> tuple[int, int]:
    """``(mark, slot to write next)`` of a directory's mark file: the slot that does not hold
    the mark (a bad slot, or the lower one)."""
    try:
        data = fsport.read_file(fs, directory / MARK_NAME, 2 * MARK_SLOT)
    except FileNotFoundError:
        return 0, 0
    first, second = parse_mark(data[:MARK_SLOT]), parse_mark(data[MARK_SLOT : 2 * MARK_SLOT])
    return max(first, second), 0 if first <= second else 1
