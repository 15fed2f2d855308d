"""An attached arena checked against the journal, the journal's word taken where they disagree.

The arena is shared memory: the daemon's uid (and root) can write it, and a
scribble into its records survives the daemon. Attach repairs what it can see on
its own (:meth:`wheeld.shm.wheel.TimerWheel.recover`: records with an impossible
state, key, group or deadline are freed, a generation beyond 31 bits is masked),
but a scribbled deadline, tag, state or key can look perfectly valid. With
``--journal`` the daemon holds a second copy of every timer: at every attach of an
existing arena (:func:`reconcile`, called by :mod:`wheeld.daemon.startup` before the
journal is opened) each live record is compared with the journal's state
(:func:`wheeld.journal.recovery.recover`, read-only) and the journal wins:

* a timer the journal has and the arena lost (freed as corrupt, or its key
  overwritten) is **restored**: pending ones as SCHEDULED at the journal's
  deadline, fired-unacknowledged ones as FIRED (delivered again);
* a SCHEDULED record whose deadline is not the journal's takes the journal's (so a
  damaged deadline fires neither early nor late); one whose arming tag differs takes
  the journal's tag (and its deadline, unless its own is the journal's);
* a FIRED record the journal still has pending, due in the future, goes back on
  the wheel at the journal's deadline (a state byte turned FIRED would otherwise
  deliver it early);
* a live record the journal does not know is freed (the key or group of another
  timer written over it, or a freed record's state byte turned live). A FIRED one
  may also be a repeat: the journal keeps one unacknowledged fire per key and arming,
  and an arming applied twice (a ring applied again from the head the last daemon
  published, after its timer fired) fires twice; freeing the repeat is right either
  way, and it is not counted as damage.

What a crash between applying a batch and journaling it leaves (the arena ahead of
the journal) is settled the same way and costs nothing: that batch's ring head was
not published, so its commands are applied again when the client hands its ring
back; a fire not yet journaled is either kept (due) or fires again. The arena says
whether a batch was open (``H_JOURNAL_OPEN``, set by the Recorder from its
``begin`` to its ``commit``): only when none was are the differences certainly
damage (ERROR lines, counted); after a crash inside a batch they are reported as
settled (a WARNING), since that batch and damage cannot be told apart.

An acknowledgement the batch applied freed its fired record, which the journal still
has unacknowledged: restored, it is a new record (generation bumped), which the
acknowledgement the ring applies again does not name, and it would go to its group
at once (its recipient was in the freed record's aux word, which an arm of the same
batch may have taken over). The word says whose ring chunk the batch applied
(``arena_layout.journal_open_word``): the fired records restored after it name that
client as their recipient, so the restarted daemon offers them to it first
(``DaemonCore._redeliver_fired``), and its library, which took them in before it
pushed the acknowledgements, acknowledges them without handing them again
(docs/contracts.md, "Delivery and durability").

Which deadlines are the journal's: the journal stores ``d = arena deadline +
offset`` (wall-clock ms, the offset between the clocks when the event was
written, rounded up), so for a sound record ``d - deadline`` *is* an offset the
clocks had. The offsets they had are known: each segment's header records both
clocks when it was opened (``mono0``, ``wall0``), and the clocks are read now. A
record is taken for damaged only when ``d - deadline`` is within ``TOLERANCE_MS``
of none of them; so a wall clock stepped since (between segments, or just now)
is not mistaken for damage. A damaged record gets the journal's deadline
converted with today's offset, as a recovery after a reboot does (a wall clock
stepped in the middle of a segment's life moves it by the step); a deadline
moved by at most ``TOLERANCE_MS`` is not told from the rounding.

The journal is trusted only when it covers the arena: the arena's ``journal_lsn``
counter (the last lsn the previous daemon appended and published) is not 0 (a
daemon without ``--journal`` publishes 0) and the journal reaches it, the journal
has no damaged range, and its newest segment was written by this instance's name.
Otherwise nothing is changed here, and what attach freed is reported as lost.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from wheeld.protocol import arena_layout as AL
from wheeld.protocol import fsport
from wheeld.protocol.errors import WheeldError
from wheeld.journal.files import list_segments, read_clocks, wall_to_monotonic_ns
from wheeld.journal.recovery import RecoveredState, recover
from wheeld.protocol.keys import KEY_BYTES, encode_key
from wheeld.shm.wheel import MAX_DELAY_MS, TimerWheel, encode_ident

log = logging.getLogger("wheeld")

#: how far ``d - deadline`` of a sound record may be from an offset read from the clocks
#: (the journal's offset is rounded up, a segment header's clocks are read as floored ms
#: one after the other): a difference up to this is rounding, not damage
TOLERANCE_MS = 3
_EXAMPLES = 5  # records named in the log per kind of repair


@dataclass
class Reconciled:
    """What :func:`reconcile` did. ``trusted``: the journal was used (else ``reason`` says why not)."""

    trusted: bool = False
    reason: str = ""
    batch_open: bool = False  # the previous daemon stopped between applying a batch and journaling it
    batch_ring: int | None = None  # the client slot whose ring chunk that batch applied, if it was one
    checked: int = 0
    restored: int = 0  # timers the arena had lost, made again from the journal
    rewritten: int = 0  # live records whose deadline, tag or state took the journal's
    freed: int = 0  # live records the journal does not know
    not_restored: int = 0  # the arena had no free record for them
    fired_freed: int = 0  # fired records the journal does not know: a repeat, or damage (see _compare)
    examples: list[str] = field(default_factory=list)
    unsure: list[str] = field(default_factory=list)  # examples of those
    # (group, key, arming tag) -> idle_ms of every idle timer the trusted journal has pending:
    # what the daemon's snapshots write for them while their clients' touch tables are out
    # of reach (daemon/recorder.py), so that the journal goes on knowing them as idle timers
    idle_ms: dict = field(default_factory=dict)

    @property
    def damaged(self) -> int:
        """Records found in disagreement with the journal (each repaired, or lost if not restored)."""
        return self.restored + self.not_restored + self.rewritten + self.freed


def journal_covers(wheel: TimerWheel, directory: str, name: str, fs: Any = os) -> str | None:
    """Why the journal in ``directory`` cannot be taken as the truth about this arena, or None."""
    arena_lsn = wheel.header_words()[AL.H_COUNTERS // 8 + AL.COUNTER["journal_lsn"]]
    if arena_lsn <= 0:
        return "the arena was not kept with a journal by the daemon before this one"
    segments = list_segments(directory, fs)
    if not segments:
        return f"the journal has no segment, and the arena's journal reached lsn {arena_lsn}"
    try:
        header = json.loads(fsport.read_line(fs, segments[-1][1]))
    except (OSError, ValueError):
        return f"the journal's newest segment {segments[-1][1].name} has no readable header"
    written_by = header.get("name") if isinstance(header, dict) else None
    if written_by != name:
        return f"the journal's newest segment was written by instance {written_by!r}, not {name!r}"
    return None


def reconcile(wheel: TimerWheel, directory: str, name: str, clocks=read_clocks, fs: Any = os) -> Reconciled:
    """Check a freshly attached arena against the journal in ``directory`` and repair it
    (module docstring). Never raises for what it finds: a journal it cannot use is
    reported in the result (``trusted`` False). ``clocks``: ``(wall ns, monotonic ns)``
    (:func:`~wheeld.journal.files.read_clocks`); ``fs``: the file port
    (:mod:`wheeld.protocol.fsport`; the real one is :mod:`os`)."""
    words = wheel.header_words()
    open_word = int(words[AL.H_JOURNAL_OPEN // 8])
    result = Reconciled(batch_open=open_word != 0, batch_ring=AL.journal_open_ring(open_word))
    try:
        _reconcile(wheel, directory, name, clocks, result, fs)
    finally:
        words[AL.H_JOURNAL_OPEN // 8] = 0  # the records and the journal agree from here on
    return result


def _reconcile(wheel: TimerWheel, directory: str, name: str, clocks, result: Reconciled, fs: Any) -> None:
    reason = journal_covers(wheel, directory, name, fs)
    state = None
    if reason is None:
        try:
            state = recover(directory, repair=False, quiet=True, fs=fs)
        except (WheeldError, OSError, ValueError) as exc:
            reason = f"the journal cannot be read: {exc}"
    if state is not None:
        arena_lsn = wheel.header_words()[AL.H_COUNTERS // 8 + AL.COUNTER["journal_lsn"]]
        if state.damage:
            reason = f"the journal has {len(state.damage)} damaged range(s)"
        elif state.last_lsn < arena_lsn:
            reason = f"the journal ends at lsn {state.last_lsn}, before the arena's {arena_lsn}"
    if reason is not None:
        result.reason = reason
        return
    result.trusted = True
    result.idle_ms = {(group, timer.key, timer.seq & 0xFFFFFFFF): timer.idle_ms
                      for (group, _key), timer in state.pending.items() if timer.idle_ms}
    _compare(wheel, state, clocks, result, clock_offsets(directory, fs))


def clock_offsets(directory: str, fs: Any = os) -> list[int]:
    """``wall0 - mono0`` of every segment header of the journal: offsets the clocks had."""
    offsets = []
    for _lsn, path in list_segments(directory, fs):
        try:
            header = json.loads(fsport.read_line(fs, path))
            offsets.append(int(header["wall0"]) - int(header["mono0"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a damaged header: that segment's offset is not known
    return offsets


def _compare(wheel: TimerWheel, state: RecoveredState, clocks, result: Reconciled, offsets: list[int]) -> None:
    """Every live record against the journal's state; the journal's word taken (see the
    module docstring), in four steps over what the vectorised first pass leaves."""
    comparison = _Comparison(wheel, state, clocks, result, offsets)
    comparison.exact_matches()
    comparison.fired_records()
    comparison.other_armings()
    comparison.lost_by_the_arena()
    comparison.write()


class _Comparison:
    """The state of one :func:`_compare`: the journal's timers by (group id, ident) and
    what is to be freed, rewritten and restored in the arena."""

    def __init__(self, wheel: TimerWheel, state: RecoveredState, clocks, result: Reconciled, offsets: list[int]):
        self.wheel, self.result = wheel, result
        wall_ns, mono_ns = clocks()
        self.wall_ns, self.mono_ns = wall_ns, mono_ns
        self.now = mono_ns // 1_000_000
        self.low, self.high = wheel.current_ms - MAX_DELAY_MS, wheel.current_ms + MAX_DELAY_MS
        self.offset_now = -(-(wall_ns - mono_ns) // 1_000_000)
        self.offsets = sorted(set(offsets + [self.offset_now - 1, self.offset_now]))
        self.gid_of = {name: gid for gid, name in wheel.groups().items()}
        self.names = wheel.groups()
        self._index_journal(state)
        slots, states, groups, deadlines, tags, idents = wheel.live_records()
        result.checked = len(slots)
        # The usual case, in numpy: a SCHEDULED record with the journal's arming of its key and
        # its deadline at today's offset. Only the others are looked at one by one below.
        agree, consumed = _agreeing(slots, states, groups, deadlines, tags, idents, self.j_gids, self.j_idents,
                                    self.j_timers, self.offset_now)
        self.pending = {(g, ident): timer for g, ident, timer, used
                        in zip(self.j_gids, self.j_idents, self.j_timers, consumed) if not used}
        keep = ~agree
        self.records = tuple(a[keep] for a in (slots, states, groups, deadlines, tags, idents))
        self.free: list = []
        self.rewrite: list = []
        self.restore: list = []
        self.scheduled_keys: set = set()  # (group, ident) of the SCHEDULED records that stay
        self.unmatched_scheduled: list = []
        self.unmatched_fired: list = []
        self.idle_restores: dict[int, tuple[int, object]] = {}  # index in restore -> (tag, timer): idle timers
        self.fired_restores: list[int] = []  # indices in restore of the fired-unacknowledged timers

    def _index_journal(self, state: RecoveredState) -> None:
        """The journal's timers by (group id, ident); those of a group the arena no longer names apart."""
        self.unacked, self.lost_groups = {}, []
        self.j_gids, self.j_idents, self.j_timers = [], [], []
        for (g, key), timer in state.pending.items():
            gid = self.gid_of.get(g)
            if gid is None:
                self.lost_groups.append((g, AL.SCHEDULED, _ident_of(key), timer))
            else:
                self.j_gids.append(gid)
                self.j_idents.append(_ident_of(key))
                self.j_timers.append(timer)
        for timer in state.unacked:
            gid = self.gid_of.get(timer.group)
            if gid is None:
                self.lost_groups.append((timer.group, AL.FIRED, _ident_of(timer.key), timer))
            else:
                self.unacked[(gid, _ident_of(timer.key), timer.seq & 0xFFFFFFFF)] = timer

    def monotonic(self, deadline_wall_ms: int) -> int:
        """The journal's wall-clock deadline as the arena's, within the wheel's range."""
        return min(max(wall_to_monotonic_ns(deadline_wall_ms, self.wall_ns, self.mono_ns), self.low), self.high)

    def journals(self, deadline_wall_ms: int, deadline: int) -> bool:
        """Is ``deadline`` the arena form of the journal's ``deadline_wall_ms`` at an offset the clocks had?"""
        x = deadline_wall_ms - deadline
        if -TOLERANCE_MS <= x - self.offset_now <= TOLERANCE_MS:
            return True
        at = bisect.bisect_left(self.offsets, x - TOLERANCE_MS)
        return at < len(self.offsets) and self.offsets[at] <= x + TOLERANCE_MS

    def note(self, text: str) -> None:
        if len(self.result.examples) < 4 * _EXAMPLES:
            self.result.examples.append(text)

    def exact_matches(self) -> None:
        """1. The same arming (tag) of the same key in the same state."""
        scheduled, pending, pop_unacked = AL.SCHEDULED, self.pending, self.unacked.pop
        slots, states, groups, deadlines, tags, idents = self.records
        for slot, st, g, d, tag, ident in zip(slots.tolist(), states.tolist(), groups.tolist(), deadlines.tolist(),
                                              tags.tolist(), idents.tolist()):
            if st == scheduled:
                timer = pending.pop((g, ident), None)
                if timer is not None and timer.seq & 0xFFFFFFFF == tag:
                    if not self.journals(timer.deadline_ms, d):
                        dj = self.monotonic(timer.deadline_ms)
                        if timer.idle_ms and dj < d <= _restored_deadline(timer, self.monotonic, self.now):
                            # an idle timer an earlier attach restored (its touches out of sight):
                            # moved later than the journal's deadline, as far as that allows
                            self.scheduled_keys.add((g, ident))
                            continue
                        self.rewrite.append((slot, scheduled, dj, tag))
                        self.note(f"record {slot} ({self.names.get(g)}): deadline {d}, the journal's is {dj}: "
                                  "took the journal's")
                    self.scheduled_keys.add((g, ident))
                    continue
                if timer is not None:
                    pending[(g, ident)] = timer  # another arming: step 3
                self.unmatched_scheduled.append((slot, st, g, d, tag, ident))
            elif pop_unacked((g, ident, tag), None) is None:
                self.unmatched_fired.append((slot, st, g, d, tag, ident))

    def fired_records(self) -> None:
        """2. Fired records the journal has as pending, that arming: not due yet means fired early."""
        other_scheduled = {(u[2], u[5]) for u in self.unmatched_scheduled}
        pending, result = self.pending, self.result
        for slot, _st, g, _d, tag, ident in self.unmatched_fired:
            timer = pending.get((g, ident))
            if timer is not None and timer.seq & 0xFFFFFFFF == tag and (g, ident) not in other_scheduled:
                del pending[(g, ident)]
                dj = self.monotonic(timer.deadline_ms)
                if dj > self.now + TOLERANCE_MS:
                    self.rewrite.append((slot, AL.SCHEDULED, dj, tag))
                    self.scheduled_keys.add((g, ident))
                    self.note(f"record {slot} ({self.names.get(g)}): fired, the journal has it pending until {dj}: "
                              "back on the wheel")
                continue  # due: a fire the journal had not recorded yet
            # The journal keeps one unacknowledged fire per (key, arming): an arming applied twice
            # (a ring re-applied from the head the last daemon published, after the timer it
            # armed had fired) fires twice, and the first ack leaves the journal without the
            # other. A fired record the journal does not know is that, or damage: freed either
            # way (a repeat of an arming delivered already), and not counted as damage.
            self.free.append(slot)
            result.fired_freed += 1
            if len(result.unsure) < _EXAMPLES:
                result.unsure.append(f"record {slot} ({self.names.get(g)}, key {ident[1:].rstrip(bytes(1))!r}, "
                                     f"arming {tag}): fired, not in the journal (an arming applied twice, or "
                                     "damage): freed")

    def other_armings(self) -> None:
        """3. Scheduled records of another arming, or of no timer the journal knows."""
        for slot, _st, g, d, tag, ident in self.unmatched_scheduled:
            timer = self.pending.pop((g, ident), None)
            if timer is not None:
                seq = timer.seq & 0xFFFFFFFF
                deadline = d if self.journals(timer.deadline_ms, d) else self.monotonic(timer.deadline_ms)
                self.rewrite.append((slot, AL.SCHEDULED, deadline, seq))
                self.scheduled_keys.add((g, ident))
                self.note(f"record {slot} ({self.names.get(g)}): arming {tag}, the journal's is {seq}: "
                          "took the journal's")
            elif self.unacked.pop((g, ident, tag), None) is not None:
                self.scheduled_keys.add((g, ident))  # fired and not acknowledged: due, it fires again
            else:
                self.free.append(slot)
                self.note(f"record {slot} ({self.names.get(g)}, key {ident[1:].rstrip(bytes(1))!r}, arming {tag}): "
                          "pending, not in the journal: freed")

    def lost_by_the_arena(self) -> None:
        """4. What the journal has and the arena lost (an idle timer comes back without its
        touch reference, which only the lost record held: :func:`_restored_deadline`)."""
        scheduled, restore, idle_restores, now = AL.SCHEDULED, self.restore, self.idle_restores, self.now
        for (g, ident), timer in self.pending.items():
            if (g, ident) not in self.scheduled_keys:
                if timer.idle_ms:
                    idle_restores[len(restore)] = (timer.seq & 0xFFFFFFFF, timer)
                restore.append((ident, g, scheduled, _restored_deadline(timer, self.monotonic, now),
                                timer.seq & 0xFFFFFFFF))
        for (g, ident, seq), timer in self.unacked.items():
            self.fired_restores.append(len(restore))
            restore.append((ident, g, AL.FIRED, min(self.monotonic(timer.deadline_ms), now), seq))
        for name, st, ident, timer in self.lost_groups:  # its group's name was overwritten too: registered again
            gid = _group(self.wheel, self.gid_of, name)
            if gid is None:
                self.result.not_restored += 1
                continue
            if st == scheduled and timer.idle_ms:
                idle_restores[len(restore)] = (timer.seq & 0xFFFFFFFF, timer)
            deadline = _restored_deadline(timer, self.monotonic, now) if st == scheduled \
                else min(self.monotonic(timer.deadline_ms), now)
            restore.append((ident, gid, st, deadline, timer.seq & 0xFFFFFFFF))
        for ident, _gid, st, _d, _seq in restore[:_EXAMPLES]:
            self.note(f"{'pending' if st == scheduled else 'fired'} timer {ident[1:].rstrip(bytes(1))!r} "
                      "restored from the journal")

    def write(self) -> None:
        """Free, rewrite and restore in the arena, and count what was done."""
        free, rewrite, restore, result = self.free, self.rewrite, self.restore, self.result
        if not (free or rewrite or restore):
            return
        # An idle timer's touch reference lives only in its record. The record attach freed
        # for it (a damaged key meta or group) keeps its tag and aux until it is used again:
        # read them before the restores take the lowest free records.
        touch_refs = _touch_references(self.wheel, {tag for tag, _timer in self.idle_restores.values()})
        for index, (tag, timer) in self.idle_restores.items():
            if tag in touch_refs:  # its touches are in sight again: the journal's deadline
                ident, g, st, _d, seq = restore[index]
                restore[index] = (ident, g, st, self.monotonic(timer.deadline_ms), seq)
        made = self.wheel.rewrite_records(free, rewrite, restore)
        for index, (tag, _timer) in self.idle_restores.items():
            if tag in touch_refs and made[index] >= 0:
                self.wheel.records["aux"][made[index]] = touch_refs[tag]
        if result.batch_ring is not None:  # freed by the acknowledgements of that ring's chunk, maybe
            recipient = AL.recipient_aux(result.batch_ring)
            for index in self.fired_restores:
                if made[index] >= 0:
                    self.wheel.records["aux"][made[index]] = recipient
        result.freed = len(free) - result.fired_freed
        result.rewritten = len(rewrite)
        missing = sum(1 for slot in made if slot < 0)
        result.restored = len(made) - missing
        result.not_restored += missing


def _agreeing(slots, states, groups, deadlines, tags, idents, j_gids, j_idents, j_timers, offset_now):
    """Which live records (a bool array) are SCHEDULED with the journal's arming (``j_*``:
    its pending timers) and its deadline at ``offset_now`` (within ``TOLERANCE_MS``), and
    which journal timers (a list of bools) they account for."""
    n = len(j_timers)
    agree = np.zeros(slots.size, dtype=bool)
    if not n or not slots.size:
        return agree, [False] * n
    try:
        seqs = np.fromiter((t.seq & 0xFFFFFFFF for t in j_timers), dtype=np.int64, count=n)
        walls = np.fromiter((t.deadline_ms for t in j_timers), dtype=np.int64, count=n)
    except OverflowError:  # a journaled deadline beyond 64 bits: every record the slow way
        return agree, [False] * n
    prefix = [gid.to_bytes(2, "big") for gid in range(max(max(j_gids), int(groups.max())) + 1)]
    index = {prefix[g] + ident: j for j, (g, ident) in enumerate(zip(j_gids, j_idents))}
    mine = np.empty(slots.size, dtype=_KEY_DTYPE)
    mine["g"] = groups
    mine["i"] = idents
    get = index.get
    j = np.fromiter((get(k, -1) for k in mine.view("V35").tolist()), dtype=np.int64, count=slots.size)
    found = j >= 0
    j = np.where(found, j, 0)
    lateness = walls[j] - np.clip(deadlines, -(1 << 62), 1 << 62) - offset_now  # no int64 overflow
    agree = found & (states == AL.SCHEDULED) & (tags == seqs[j]) & (np.abs(lateness) <= TOLERANCE_MS)
    consumed = np.zeros(n, dtype=bool)
    consumed[j[agree]] = True
    return agree, consumed.tolist()


_KEY_DTYPE = np.dtype([("g", ">u2"), ("i", "V33")])  # a (group id, ident) pair, compared as 35 bytes
_PAD = [bytes(KEY_BYTES - n) for n in range(KEY_BYTES + 1)]
_STR_METAS = [bytes((encode_key("x" * n)[1],)) if n else b"" for n in range(KEY_BYTES + 1)]
_INT_META = bytes((encode_key(0)[1],))


def _ident_of(key) -> bytes:
    """:func:`~wheeld.shm.wheel.encode_ident` of a journal's key, with str and int keys (the
    usual ones) encoded here without a call per key."""
    if type(key) is str:
        kb = key.encode()
        n = len(kb)
        if 0 < n <= KEY_BYTES:
            return _STR_METAS[n] + kb + _PAD[n]
    elif type(key) is int and -(1 << 63) <= key < (1 << 63):
        return _INT_META + key.to_bytes(8, "little", signed=True) + _PAD[8]
    return encode_ident(key)


def _group(wheel: TimerWheel, gid_of: dict, name: str) -> int | None:
    """The group id of ``name``, registered again if the arena lost it; None when no id is left."""
    gid = gid_of.get(name)
    if gid is None:
        try:
            gid = gid_of[name] = wheel.group_id(name)
        except WheeldError:
            return None
    return gid


def summary(result: Reconciled) -> str:
    parts = [f"{result.checked} live records checked against the journal"]
    for count, what in ((result.restored, "restored from it"), (result.rewritten, "took its deadline, tag or state"),
                        (result.freed, "freed (not in it)"),
                        (result.fired_freed, "fired and not in it, freed (a repeat, or damage)"),
                        (result.not_restored, "NOT restored (no free record or group id)")):
        if count:
            parts.append(f"{count} {what}")
    return ", ".join(parts)


__all__ = ["Reconciled", "TOLERANCE_MS", "journal_covers", "reconcile", "summary"]


def _restored_deadline(timer, monotonic, now: int) -> int:
    """The deadline of a pending timer restored from the journal into a live arena. An idle
    timer's record held the reference to its client's touch table, which the journal does
    not keep: restored, it can no longer see the touches its client goes on making, so it
    fires no sooner than ``idle_ms`` after now (the last touch was at or before now), nor
    before its journaled deadline. Never early; at most ``idle_ms`` late."""
    deadline = monotonic(timer.deadline_ms)
    idle_ms = getattr(timer, "idle_ms", None)
    return max(deadline, now + idle_ms) if idle_ms else deadline


def _touch_references(wheel, tags: set[int]) -> dict[int, int]:
    """Arming tag -> the touch reference (aux >= 0) of the FREE record holding that tag: the
    record of an idle timer attach freed as damaged. A tag found in more than one free
    record with a touch reference is ambiguous and left out (the timer then waits
    ``idle_ms`` after the restore, :func:`_restored_deadline`)."""
    if not tags:
        return {}
    rec = wheel.records[wheel.first_entry:]
    free = (rec["state"] & AL.STATE_MASK) == AL.FREE
    candidates = np.flatnonzero(free & (rec["aux"] >= 0) & np.isin(rec["tag"], np.fromiter(tags, dtype=np.int64)))
    found: dict[int, int] = {}
    ambiguous = set()
    for tag, aux in zip(rec["tag"][candidates].tolist(), rec["aux"][candidates].tolist()):
        if tag in found:
            ambiguous.add(tag)
        found[tag] = aux
    for tag in ambiguous:
        del found[tag]
    return found
