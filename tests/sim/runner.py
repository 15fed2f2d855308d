"""The journal's background work (``--fsync interval=N`` fsyncs, durable-mark writes) run
when the simulator decides.

The real journal hands that work to a helper thread
(:class:`wheeld.journal.files.ThreadRunner`): an fsync goes on while the
loop drains rings, and finishes whenever the disk is done. :class:`SimRunner` has
the same port (``submit(fn, *args)`` returning a handle with ``done()`` and
``result()``, ``shutdown()``) and runs nothing on its own: the tasks wait in
submission order (the helper has one worker) until the simulator calls
:meth:`SimRunner.run_next` / :meth:`SimRunner.run_all`, or until the journal
waits for one (``result()``: the task and those submitted before it run then, as
the one worker would have run them by the time a wait returns). With
``inline=True`` every task runs as it is submitted.

So a simulation chooses, per seed, when each background fsync completes
relative to the appends, power cuts and crashes around it; a task that never ran
before a power cut never touched the disk.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["SimRunner", "SimTask"]


class SimTask:
    """One submitted task: its outcome once it has run."""

    def __init__(self, runner: SimRunner, fn: Callable, args: tuple) -> None:
        self._runner = runner
        self._fn = fn
        self._args = args
        self._ran = False
        self._value: Any = None
        self._error: BaseException | None = None

    def run(self) -> None:
        if self._ran:
            return
        self._ran = True
        try:
            self._value = self._fn(*self._args)
        except BaseException as exc:  # kept for result(), as a future keeps it
            self._error = exc

    def done(self) -> bool:
        return self._ran

    def result(self) -> Any:
        if not self._ran:
            self._runner.run_through(self)
        if self._error is not None:
            raise self._error
        return self._value


class SimRunner:
    """A single-worker runner the simulator steps (see the module docstring)."""

    def __init__(self, inline: bool = False) -> None:
        self.inline = inline
        self.queue: list[SimTask] = []
        self.submitted = 0

    def submit(self, fn: Callable, *args: Any) -> SimTask:
        task = SimTask(self, fn, args)
        self.submitted += 1
        if self.inline:
            task.run()
        else:
            self.queue.append(task)
        return task

    @property
    def pending(self) -> int:
        return len(self.queue)

    def run_next(self) -> bool:
        """Run the oldest waiting task; False when none waits."""
        if not self.queue:
            return False
        self.queue.pop(0).run()
        return True

    def run_through(self, task: SimTask) -> None:
        """Run the waiting tasks up to and including ``task`` (in order)."""
        while self.queue:
            first = self.queue.pop(0)
            first.run()
            if first is task:
                return
        task.run()

    def run_all(self) -> None:
        while self.run_next():
            pass

    def drop(self) -> int:
        """Forget the waiting tasks (the process that submitted them died); how many."""
        dropped = len(self.queue)
        self.queue.clear()
        return dropped

    def shutdown(self) -> None:
        self.run_all()
