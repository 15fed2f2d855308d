"""The fleet's contract as a model: a simulated fleet's history checked against docs/fleet.md
("Guarantees, level by level", under ``--durability replicated``).

The honest workers of every host record what they did and what they were handed
(:class:`FleetHistory`); :func:`check` says what breaks a promise:

1. **Survives host loss** (``lost``). Every arming a ``flush()`` acknowledged, whose key
   was not cancelled afterwards (acknowledged or not: a cancel may have reached the
   stream), is handed to an application by the end of the run: by its host before it
   was lost or stood down, or by the peer that adopted it (a re-arm made afterwards
   may take its place: one of the key's later armings is handed instead).
2. **Never early** (``early``): no arming is handed before its delay passed since its
   ``add()``, on any host.
3. **Cancel and re-arm are honoured across hosts** (``after-cancel``): an arming
   replaced by a later ``add`` or ``cancel`` of its key is never handed once a
   ``flush()`` acknowledged the replacement, if it was not due by then (due, it may have
   fired before the replacement reached the daemon: handed once more by a peer after a
   takeover, within the at-least-once window).

The simulator adds the rules it checks as the run goes (fleet.py): no stream write of a
host accepted after its fence (``after-fence``); no delivery while a host's lease may
have lapsed, unless its last lease request went unanswered (``lease``: the documented
window of a host cut off from the cluster); none by a fenced host (``fenced``); no host
epoch adopted twice (``adopted-twice``); nothing the stream acknowledged lost while a
quorum of servers kept its disk (``stream-lost``).

Counted, not judged: an arming handed more than once (by two hosts: a takeover's
at-least-once window; by one: a worker that died holding it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .checker import Violation

__all__ = ["FleetHistory", "check"]

MS = 1_000_000


@dataclass
class FCommand:
    """One call of a worker's application: an ``add`` (an arming) or a ``cancel``."""

    kind: str  # "add" | "cancel"
    host: str
    worker: int
    key: str
    called_ns: int
    tag: int = 0  # add: the arming's tag
    due_ns: int = 0  # add: called_ns + delay
    acked_ns: int | None = None  # when a flush() that covers it returned
    handed: list = field(default_factory=list)  # add: (host, worker, at_ns)


class FleetHistory:
    """What every host's honest workers did, and were handed."""

    def __init__(self):
        self.commands: dict[tuple[int, str], list[FCommand]] = {}  # (worker, key) -> its calls in order
        self.armings: dict[tuple[str, int], FCommand] = {}  # (key, tag) -> the add
        self.pending: dict[int, list[FCommand]] = {}  # worker -> commands since its last flush() call
        self.unknown: list[str] = []  # expirations of armings nobody made

    def armed(self, host: str, worker: int, key: str, tag: int, now_ns: int, delay_ms: int) -> None:
        command = FCommand("add", host, worker, key, now_ns, tag, now_ns + delay_ms * MS)
        self.commands.setdefault((worker, key), []).append(command)
        self.armings[(key, tag)] = command
        self.pending.setdefault(worker, []).append(command)

    def cancelled(self, host: str, worker: int, key: str, now_ns: int) -> None:
        command = FCommand("cancel", host, worker, key, now_ns)
        self.commands.setdefault((worker, key), []).append(command)
        self.pending.setdefault(worker, []).append(command)

    def flush_called(self, worker: int) -> list[FCommand]:
        covered = self.pending.pop(worker, [])
        return covered

    def flush_failed(self, worker: int, covered: list[FCommand]) -> None:
        """A flush() that failed: what it covered waits for a later one."""
        self.pending.setdefault(worker, [])[:0] = covered

    @staticmethod
    def flushed(covered: list[FCommand], now_ns: int) -> None:
        for command in covered:
            if command.acked_ns is None:
                command.acked_ns = now_ns

    def handed(self, host: str, worker: int, key: str, tag: int, now_ns: int) -> None:
        original = key.split("@", 1)[0]  # an adopted timer renamed <key>@<host>
        arming = self.armings.get((original, tag))
        if arming is None:
            self.unknown.append(f"{key!r} tag {tag:#x} handed to worker {worker} on host {host}")
            return
        arming.handed.append((host, worker, now_ns))

    def duplicates(self) -> tuple[int, int]:
        """(armings handed by two hosts, armings handed twice by one host)."""
        across = within = 0
        for arming in self.armings.values():
            if len(arming.handed) > 1:
                if len({h for h, _w, _t in arming.handed}) > 1:
                    across += 1
                else:
                    within += 1
        return across, within


def check(history: FleetHistory) -> list[Violation]:
    out: list[Violation] = []
    for text in history.unknown[:3]:
        out.append(Violation("invented", f"an expiration of an arming no worker made: {text}"))
    for (worker, key), commands in history.commands.items():
        _check_key(worker, key, commands, out)
    return out


def _check_key(worker: int, key: str, commands: list[FCommand], out: list[Violation]) -> None:
    for index, command in enumerate(commands):
        if command.kind != "add":
            continue
        for host, _w, at_ns in command.handed:
            if at_ns < command.due_ns:
                out.append(Violation("early", f"{key!r} (tag {command.tag:#x}, worker {worker} on host {command.host}) "
                                              f"handed on host {host} {(command.due_ns - at_ns) / MS:.3f} ms early"))
        later = [c.acked_ns for c in commands[index + 1:] if c.acked_ns is not None]
        replaced_ns = min(later) if later else None
        if replaced_ns is not None and command.handed and command.due_ns > replaced_ns:
            host, _w, at_ns = command.handed[0]
            kind = commands[index + 1].kind
            out.append(Violation("after-cancel", f"{key!r} (tag {command.tag:#x}, worker {worker} on host "
                                                 f"{command.host}, due at {command.due_ns / MS:.3f} ms) handed on host "
                                                 f"{host} at {at_ns / MS:.3f} ms, though a later {kind} of its key "
                                                 f"was acknowledged at {replaced_ns / MS:.3f} ms"))
    acked = [i for i, c in enumerate(commands) if c.kind == "add" and c.acked_ns is not None]
    if not acked:
        return
    first = acked[-1]
    if any(c.kind == "cancel" for c in commands[first + 1:]):
        return
    if not any(c.handed for c in commands[first:]):
        a = commands[first]
        out.append(Violation("lost", f"{key!r} (tag {a.tag:#x}) of worker {worker} on host {a.host}, armed at "
                                     f"{a.called_ns / MS:.3f} ms, due at {a.due_ns / MS:.3f} ms, acknowledged by a "
                                     f"flush() at {a.acked_ns / MS:.3f} ms, was never handed to an application"))
