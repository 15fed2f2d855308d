"""Rebuilding the timers from a journal directory, and listing its damage.

The files are written by :mod:`wheeld.journal.files` (segments,
snapshots) in the format of :mod:`wheeld.protocol.journal`.


Recovery
========

:func:`recover` rebuilds the state from a directory:

1. the newest snapshot that passes its checks (whole-file crc, header and end
   line agree); see "Damage" for a damaged one;
2. the events after the snapshot's lsn, segment by segment, applied to a dict
   ``(group, key) -> pending timer`` and a dict of fired-but-unacked timers
   (the reference model in :mod:`wheeld.protocol.journal`); a ``repl`` event
   (the replication's state, ``wheeld --replicate``) changes neither: it only
   takes its lsn;
3. a torn tail of the newest segment -- bad bytes with no good line after
   them, what a crash in the middle of a write leaves -- is cut at the last
   good line and a warning names the file, the byte offset and the reason;
   bytes cut that held complete lines are first saved next to it as
   ``<segment>.cut-<offset>``;
4. unless the journal ends before its durable mark (``durable.mark``, the
   highest lsn the writer had fsynced): a torn write loses only what was never
   synced, so events up to the mark that are missing were cut away after the
   fact (a truncated or deleted segment). That is damage (reason
   ``truncated``, the lsns from the journal's end to the mark lost), reported
   and refused like any other; the bad tail, if there is one, stays in its
   file, and the journal continues after the mark.

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

import functools
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Union

import msgspec
from msgspec import UNSET

from wheeld.protocol import fsport
from wheeld.protocol.errors import InvalidRequest
from wheeld.protocol.journal import (
    CHECKSUM,
    LSN_GAP,
    MARK_NAME,
    TRUNCATED,
    Ack,
    Add,
    BadLines,
    Cancel,
    CorruptJournal,
    Fire,
    IdleRearm,
    Rearm,
    SnapshotEnd,
    SnapshotHeader,
    key_from_json,
    line_body,
    parse_snapshot,
)
from .files import (
    FiredTimer,
    PendingTimer,
    cut_segment,
    list_segments,
    list_snapshots,
    read_mark,
    read_segment,
    torn_tail,
)
from wheeld.protocol.keys import Key

__all__ = [
    "Problem",
    "DamagedRange",
    "DAMAGE_POLICIES",
    "JournalDamaged",
    "RecoveredState",
    "recover",
    "JournalReport",
    "check_journal",
]

log = logging.getLogger("wheeld.journal")

_ESCAPED_KEYS = ("b64:", "str:")  # journal key forms that differ from the user's key


# --------------------------------------------------------------------------- #
# What recovery found
# --------------------------------------------------------------------------- #


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

    def repair(self) -> None:
        """Run the repairs collected (a file already gone is fine)."""
        for fix in self.repairs:
            try:
                fix()
            except FileNotFoundError:
                pass

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
            if isinstance(item, PendingTimer):
                pending.append(item)
            elif isinstance(item, FiredTimer):
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


def _load_base(directory: Path, segments: list, findings: _Findings, repair: bool, fs: Any):
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
    for lsn, path in reversed(list_snapshots(directory, fs)):
        data = b""
        try:
            data = fsport.read_file(fs, path)
            header, pending, unacked = parse_snapshot(data, PendingTimer, FiredTimer)
            if header.lsn != lsn:
                raise CorruptJournal(f"snapshot names lsn {header.lsn} but the file name says {lsn}")
        except (CorruptJournal, OSError) as exc:
            damaged.append((lsn, path, data, str(exc)))
            continue
        if damaged and not journal_after(lsn):
            continue  # good, but the journal after it is gone: it would lose what the damaged ones hold
        _replaced(findings, damaged, f"snapshot-{lsn} and the journal after it replace it", repair, fs)
        return header.lsn, pending, unacked
    if not damaged:
        return 0, [], []
    if journal_after(0):
        _replaced(findings, damaged, "the journal from lsn 1 replaces it", repair, fs)
        return 0, [], []
    lsn, path, data, error = damaged[0]
    pending, unacked, bad, held = _salvage_snapshot(data, str(path))
    kept = len(pending) + len(unacked)
    lost = max(0, held - kept) if held is not None else sum(run.lines for run in bad)
    action = (f"no older snapshot or journal replaces it: salvaged {kept} timers line by line "
              f"({'of ' + str(held) if held is not None else 'count unknown'}); file left as is")
    _report_snapshot(findings, path, data, error, action, lost, bad or None)
    _replaced(findings, damaged[1:], "not used (a newer snapshot was salvaged)", repair, fs)
    return lsn, pending, unacked


def _replaced(findings: _Findings, damaged: list, how: str, repair: bool, fs: Any) -> None:
    for _lsn, path, data, error in damaged:
        action = how
        if repair:
            action += f"; renamed to {path.name}.corrupt"
            findings.repairs.append(functools.partial(fs.rename, path, path.with_name(path.name + ".corrupt")))
        _report_snapshot(findings, path, data, error, action)


def recover(
    directory: str | os.PathLike[str],
    repair: bool = True,
    on_damage: str = "skip",
    quiet: bool = False,
    fs: Any = os,
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
    (``wheelctl check --journal`` prints the findings itself). ``fs``: the file
    port (:mod:`wheeld.protocol.fsport`; the real one is :mod:`os`).
    """
    if on_damage not in DAMAGE_POLICIES:
        raise InvalidRequest(f"journal damage policy is one of {', '.join(DAMAGE_POLICIES)}, not {on_damage!r}")
    started = time.perf_counter()
    directory = Path(directory)
    findings = _Findings(quiet)
    if not fsport.is_dir(fs, directory):
        return RecoveredState({}, [], 0, 0, [])
    for entry in fs.scandir(directory):  # a snapshot's temporary file, left by a crash: removed
        if entry.name.endswith(".jsonl.tmp"):
            findings.repairs.append(functools.partial(fs.unlink, entry.path))
    segments = list_segments(directory, fs)
    snapshot_lsn, replay, tails = _replay_directory(directory, segments, findings, repair, fs)
    last_lsn = max(replay.last_lsn, segments[-1][0] - 1 if segments else 0)
    mark = read_mark(directory, fs)
    if mark > last_lsn:  # events that were on disk are gone: damage, not a torn write
        tails = _cut_short(directory, segments, tails, last_lsn, mark, findings, fs)
        last_lsn = mark  # the journal continues after the mark: lsns that were durable are not reused

    if on_damage == "refuse" and findings.damage:
        findings.log()
        raise JournalDamaged(directory, findings.damage)
    findings.log()
    # now the disk: repairs, then the torn tails (their problems say what was done)
    if repair:
        findings.repair()
    torn_problems = _settle_torn_tails(tails, repair, quiet, fs)
    findings.problems += torn_problems

    pending, unacked = replay.pending, replay.unacked
    _to_user_keys(pending, unacked)
    state = RecoveredState(
        pending, list(unacked.values()), last_lsn, snapshot_lsn, findings.problems, replay.segments_read,
        replay.events_replayed, (time.perf_counter() - started) * 1000, findings.damage, torn_problems,
    )
    if not quiet:
        _log_recovered(state)
    return state


def _log_recovered(state: RecoveredState) -> None:
    log.info(
        "journal: recovered %d pending and %d unacked timers (snapshot lsn %d + %d events in %d segments, "
        "last lsn %d%s) in %.0f ms",
        len(state.pending), len(state.unacked), state.snapshot_lsn, state.events_replayed, state.segments_read,
        state.last_lsn, f"; {len(state.damage)} damaged ranges skipped" if state.damage else "", state.elapsed_ms,
    )  # fmt: skip


def _replay_directory(directory: Path, segments: list, findings: _Findings, repair: bool, fs: Any):
    """The base snapshot, then every segment event after it: ``(snapshot lsn, replay, torn tails)``.

    The torn tail of the newest segment, if any, is returned as ``(path, tail,
    bytes)`` for the caller to cut; bad runs before it wait in the replay until
    the next good event says what they cost.
    """
    # during replay keys stay in their journal form (str or int: cheap to hash);
    # the few escaped ones ("b64:", "str:") are converted at the end
    snapshot_lsn, snapshot_pending, snapshot_unacked = _load_base(directory, segments, findings, repair, fs)
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
        scan, data = read_segment(path, replay.last_lsn + 1, fs)
        replay.segments_read += 1
        tail = torn_tail(scan) if newest else None
        for part in scan.parts:
            if type(part) is list:
                replay.run(part, path)
            elif tail is None or part.start < tail.start:
                replay.waiting.append(part)
        if tail is not None:
            tails.append((path, tail, data))
        del data, scan
    replay.finish()
    return snapshot_lsn, replay, tails


def _cut_short(directory: Path, segments: list, tails: list, end: int, mark: int, findings: _Findings,
               fs: Any) -> list:
    """The journal ends at lsn ``end`` but its durable mark says ``mark`` was on disk: report
    events ``end+1..mark`` as one damaged range (at the newest segment's bad tail, if it has
    one: those bytes are what is left of them, and stay in the file). Returns the torn tails
    that are still torn."""
    lost = (end + 1, mark)
    detail = (f"the journal ends at lsn {end} but lsn {mark} was on disk ({MARK_NAME}): events "
              f"{end + 1}..{mark} were cut away after they were synced (a torn write loses only what was never "
              "synced)")
    action = "skipped, file left as is; the journal continues after the mark"
    if tails:
        path, tail, _data = tails[0]
        findings.add_damage(DamagedRange(str(path), tail.start, tail.end, tail.first_line, tail.lines, TRUNCATED,
                                         f"{detail}; {tail.detail}", lost, mark - end, action))
        return tails[1:]
    if segments:
        path = segments[-1][1]
        size = fsport.file_size(fs, path)
        findings.add_damage(DamagedRange(str(path), size, size, 0, 0, TRUNCATED, detail, lost, mark - end, action))
    else:
        findings.add_damage(DamagedRange(str(directory / MARK_NAME), 0, 0, 0, 0, TRUNCATED, detail, lost,
                                         mark - end, action))
    return tails


def _settle_torn_tails(tails: list[tuple[Path, BadLines, bytes]], repair: bool, quiet: bool,
                       fs: Any) -> list[Problem]:
    """Cut each torn tail (``repair``) or leave it; the problems say which."""
    problems = []
    for path, tail, data in tails:
        if repair:
            action = cut_segment(path, tail.start, data, fs)
        else:
            action = "the lines from here on are ignored (repair=False: file left as is)"
        problem = Problem(str(path), tail.start, tail.reason, f"{tail.where()}: {tail.detail}", action)
        problems.append(problem)
        if not quiet:
            log.warning("journal: torn tail (a write cut short by a crash): %s", problem)
    return problems


def _to_user_keys(pending: dict, unacked: dict) -> None:
    """Turn the keys replay kept in their journal form into the user's keys (str, bytes, int)."""
    escaped = [entry for entry in pending if type(entry[1]) is str and entry[1].startswith(_ESCAPED_KEYS)]
    for entry in escaped:
        timer = pending.pop(entry)
        timer.key = key_from_json(entry[1])
        pending[(entry[0], timer.key)] = timer
    for timer in unacked.values():
        timer.key = key_from_json(timer.key)


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
            pending[(event.g, event.k)] = PendingTimer(event.g, event.k, event.d, event.s,
                                                       None if idle is unset else idle)
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
            # a fired record put back on the wheel (Delivery.recheck_idle: a restarted daemon
            # found the fire of an idle timer whose touches it could not read yet) is that
            # arming pending again, no longer a fire waiting for its ack
            pop_unacked((event.g, event.k, event.s), None)
            current = pending.get((event.g, event.k))
            if current is None:
                pending[(event.g, event.k)] = PendingTimer(event.g, event.k, event.d, event.s, event.i)
            else:
                current.deadline_ms = event.d
        # Repl (the replication's state as the daemon saw it) changes no timer
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


def check_journal(directory: str | os.PathLike[str], fs: Any = os) -> JournalReport:
    """Read every file of a journal directory and list its damage; change nothing.

    A dry run of :func:`recover` says what recovery would lose; then every
    segment is read whole and every snapshot parsed, to find the damage
    recovery would not read.
    """
    directory = Path(directory)
    state = recover(directory, repair=False, quiet=True, fs=fs)
    damage = list(state.damage)
    known = {(item.path, item.start) for item in damage}
    torn = {(item.path, item.offset) for item in state.torn}
    segments = list_segments(directory, fs)
    for _first_lsn, path in segments:
        scan, _ = read_segment(path, fs=fs)
        for bad in scan.bad:
            if (bad.path, bad.start) in known or (bad.path, bad.start) in torn:
                continue
            damage.append(DamagedRange(
                bad.path, bad.start, bad.end, bad.first_line, bad.lines, bad.reason, bad.detail, None, 0,
                f"not read by recovery: snapshot-{state.snapshot_lsn} covers these events",
            ))  # fmt: skip
    snapshots = list_snapshots(directory, fs)
    for lsn, path in snapshots:
        if any(item.path == str(path) for item in damage):
            continue
        data = b""
        try:
            data = fsport.read_file(fs, path)
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
