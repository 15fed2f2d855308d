"""Kafka-style delayed fetches on wheeld.purgatory: answered when data arrives, or empty at their timeout.

    python examples/purgatory_fetch.py                   # timeouts on an in-process wheel
    python examples/purgatory_fetch.py --daemon SOCKET   # timeouts in a wheeld daemon

A long-poll fetch waits until its partition has ``min_bytes`` of new data or
its ``delay_ms`` passes, whichever comes first (Kafka's ``DelayedFetch``). Three
fetches wait on ``topic-0`` and are answered when data is appended; one waits
on ``topic-1``, where nothing arrives, and is answered empty at its timeout;
one is still waiting when the purgatory closes and is answered with an error.
Every fetch is answered exactly once. Prints one line per answer and exits 0
when all five went as described.
"""

from __future__ import annotations

import argparse
import sys
import threading

from wheeld.purgatory import DelayedOperation, Purgatory


class Log:
    """A partition's log: appended to by producers, read by fetches (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data = bytearray()

    def append(self, data: bytes) -> None:
        with self._lock:
            self._data += data

    def available(self) -> int:
        with self._lock:
            return len(self._data)

    def read(self) -> bytes:
        with self._lock:
            return bytes(self._data)


class DelayedFetch(DelayedOperation):
    def __init__(self, name: str, log: Log, min_bytes: int, delay_ms: int, answers: list) -> None:
        super().__init__(delay_ms)
        self.name, self.log, self.min_bytes, self.answers = name, log, min_bytes, answers
        self.answered = threading.Event()

    def try_complete(self) -> bool:  # called when something happened on a watched key
        return self.log.available() >= self.min_bytes and self.force_complete()

    def on_complete(self) -> None:  # exactly once, whichever path won
        if self.error is not None:
            outcome = f"error: {self.error}"
        elif self.expired:
            outcome = f"timed out, {len(self.log.read())} bytes"
        else:
            outcome = f"answered, {len(self.log.read())} bytes"
        self.answers.append((self.name, outcome))
        self.answered.set()

    def on_expiration(self) -> None:  # after on_complete, only when the timeout won
        self.answers.append((self.name, "expired"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--daemon", metavar="SOCKET", help="keep the timeouts in this wheeld daemon")
    args = parser.parse_args(argv)

    purgatory = Purgatory.connect("fetch-example", args.daemon) if args.daemon else Purgatory()
    answers: list[tuple[str, str]] = []
    topic0, topic1 = Log(), Log()
    waiting = [DelayedFetch(f"fetch-{i}", topic0, 1, 5_000, answers) for i in range(3)]
    lonely = DelayedFetch("fetch-quiet", topic1, 1, 100, answers)
    parked = DelayedFetch("fetch-at-close", topic1, 1, 60_000, answers)
    try:
        for fetch in waiting:
            assert not purgatory.try_complete_else_watch(fetch, ["topic-0"])  # no data yet: it waits
        purgatory.try_complete_else_watch(lonely, ["topic-1"])
        purgatory.try_complete_else_watch(parked, ["topic-1"])
        topic0.append(b"hello")                      # a producer appends...
        completed = purgatory.check_and_complete("topic-0")  # ...and the waiting fetches are checked
        lonely.answered.wait(10)                     # topic-1 stays empty: its timeout answers it
    finally:
        purgatory.close()                            # the parked fetch is answered with an error
    for name, outcome in answers:
        print(f"{name}: {outcome}")
    expected = ({(f"fetch-{i}", "answered, 5 bytes") for i in range(3)}
                | {("fetch-quiet", "timed out, 0 bytes"), ("fetch-quiet", "expired")})
    ok = (completed == 3 and expected <= set(answers) and len(answers) == 6
          and answers[-1][0] == "fetch-at-close" and answers[-1][1].startswith("error:"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
