"""Start and stop real wheeld processes, and wait for what they do: for tests.

A project that uses wheeld can test against a real daemon with it, as wheeld's
own tests (through their conftest's fixtures) and benchmarks do::

    from wheeld.testing import DaemonProcess

    daemon = DaemonProcess(tmp_path).start()      # a private socket and instance name
    try:
        with wheeld.connect(daemon.socket_path) as wheel:
            ...
    finally:
        daemon.cleanup()                          # SIGKILL, and unlink its segments

One way to start a daemon on a private socket and instance name, to know it is
ready, to stop it, and to remove every shared-memory segment it made.

``wait_until`` is how a test waits for something a daemon does: it polls a
condition (an arena counter read through the read-only reader, a log line, a
file, a process state) and fails naming what it waited for, instead of
sleeping a fixed time and hoping the thing happened meanwhile.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from wheeld.protocol.clock import mono_ms  # the clock the daemon and the clients use

__all__ = [
    "DaemonProcess", "accepts", "child_pids", "mono_ms", "process_state", "unique_name", "unlink_segments",
    "wait_for_clock", "wait_until", "wait_until_async",
]

T = TypeVar("T")


def wait_until(condition: Callable[[], T], timeout: float = 10.0, what: str | None = None, *,
               interval: float = 0.005, detail: Callable[[], str] | None = None) -> T:
    """Poll ``condition()`` until it returns something truthy, and return that.

    After ``timeout`` seconds raise AssertionError naming ``what`` (the
    condition's name if not given), with ``detail()`` appended (a log tail, say).
    """
    end = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= end:
            message = f"waited {timeout} s for {what or getattr(condition, '__name__', 'a condition')}"
            raise AssertionError(message + (f"\n{detail()}" if detail else ""))
        time.sleep(interval)


async def wait_until_async(condition: Callable[[], T], timeout: float = 10.0, what: str | None = None, *,
                           interval: float = 0.005) -> T:
    """``wait_until`` for a coroutine: polls with ``asyncio.sleep`` so the loop runs meanwhile."""
    end = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= end:
            raise AssertionError(f"waited {timeout} s for {what or getattr(condition, '__name__', 'a condition')}")
        await asyncio.sleep(interval)


def wait_for_clock(ms: int, what: str = "the clock") -> None:
    """Until CLOCK_MONOTONIC has passed ``ms`` (a deadline read in the same clock)."""
    wait_until(lambda: mono_ms() > ms, timeout=max(1.0, (ms - mono_ms()) / 1000 + 5), what=what)


def process_state(pid: int) -> str:
    """The state letter of ``pid`` in /proc (R, S, T stopped, Z zombie, ...)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def child_pids() -> set[int]:
    """The pids of this process's live children (a test checks that it reaped what it started)."""
    path = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children")
    return {int(p) for p in path.read_text().split()}


def unique_name(prefix: str = "test") -> str:
    return f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def unlink_segments(name: str) -> list[str]:
    """Remove every shared-memory segment of daemon instance ``name``."""
    from wheeld.shm.arena import remove_instance_segments

    return remove_instance_segments(name)


def accepts(socket_path: str) -> bool:
    """Does something accept connections on the Unix socket ``socket_path``?"""
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(socket_path)
            return True
        except OSError:
            return False


class DaemonProcess:
    """A real wheeld on socket ``<workdir>/<name>.sock`` and instance ``name`` (segments
    ``/wheeld-<name>-*``), its output in ``<workdir>/<name>.log``.

    ``log_level`` is wheeld's --log-level (its default, INFO, when None); ``prefix``
    goes between the interpreter and ``-m wheeld.daemon.cli`` (``-m cProfile -o F``);
    ``nice`` renices it.
    """

    def __init__(self, workdir, *, capacity: int = 200_000, extra=(), name: str | None = None,
                 log_level: str | None = None, prefix=(), nice: int = 0):
        self.name = name or unique_name()
        workdir = Path(workdir)
        self.socket_path = str(workdir / f"{self.name}.sock")
        self.log_path = workdir / f"{self.name}.log"
        self.capacity = capacity
        self.extra = list(extra) + (["--log-level", log_level] if log_level else [])
        self.quiet = log_level is not None and log_level.upper() not in ("INFO", "DEBUG")
        self.prefix = list(prefix)
        self.nice = nice
        self.proc: subprocess.Popen | None = None
        self._log = None

    def start(self, timeout_s: float = 15.0, env: dict | None = None) -> "DaemonProcess":
        """Start it and return once it is ready: it logs so once its arena is mapped (a
        recovery can take a while after the socket is bound); with a log level that
        hides that line, once its arena exists and its socket accepts."""
        self._log = open(self.log_path, "ab")
        offset = self._log.tell()
        cmd = [sys.executable, *self.prefix, "-m", "wheeld.daemon.cli", "--socket", self.socket_path,
               "--name", self.name, "--capacity", str(self.capacity), *self.extra]
        full_env = dict(os.environ)
        full_env.pop("NOTIFY_SOCKET", None)
        full_env.pop("WATCHDOG_USEC", None)
        full_env.update(env or {})
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=full_env,
                                     preexec_fn=(lambda: os.nice(self.nice)) if self.nice else None)

        from wheeld.protocol.naming import arena_name, shm_path

        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"wheeld exited with {self.proc.returncode}:\n{self.log()}")
            if self.quiet:  # it binds its socket first, then maps (or builds) its arena
                return os.path.exists(shm_path(arena_name(self.name))) and accepts(self.socket_path)
            return " ready on " in self.log_path.read_bytes()[offset:].decode("utf-8", "replace")

        try:
            wait_until(ready, timeout_s, "wheeld to become ready", interval=0.01, detail=self.log)
        except AssertionError as e:
            self.kill()
            raise RuntimeError(str(e)) from None
        return self

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def kill(self, sig=signal.SIGKILL, timeout_s: float = 10.0) -> None:
        """Send ``sig`` and reap it (SIGKILL if it has not ended within ``timeout_s``)."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if self._log is not None:
            self._log.close()
            self._log = None

    def stop(self, timeout_s: float = 10.0) -> int:
        """A graceful stop (SIGTERM); its exit code."""
        self.kill(signal.SIGTERM, timeout_s)
        return self.proc.returncode

    def restart(self) -> "DaemonProcess":
        self.kill()
        return self.start()

    def cleanup(self, sig=signal.SIGKILL) -> None:
        """End it with ``sig`` (SIGTERM lets it write what it writes on a stop) and unlink its segments."""
        try:
            self.kill(sig, 30.0)
        finally:
            unlink_segments(self.name)

    # ---- what it does, read from its arena (read-only) and its log
    def counters(self) -> dict[str, int]:
        """The arena's counters as last published."""
        from wheeld.shm.reader import ArenaReader

        with ArenaReader(self.name) as reader:
            return reader.counters()

    def parked(self) -> int:
        """The arena's parked word: nonzero while the loop sleeps with its counters published
        after everything its last iteration wrote (wheelctl's "at rest")."""
        from wheeld.shm.reader import ArenaReader
        from wheeld.protocol import arena_layout as AL

        with ArenaReader(self.name) as reader:
            return struct.unpack_from("<q", reader.buf, AL.H_PARKED)[0]

    def wait_parked(self, timeout: float = 10.0) -> dict[str, int]:
        """Wait until the loop is parked; return the counters it published for that park."""
        def parked_counters():
            return self.parked() and self.counters()

        return wait_until(parked_counters, timeout, "the daemon to park", detail=lambda: self.log()[-2000:])

    def wait_for_log(self, text: str, timeout: float = 10.0, start: int = 0) -> None:
        """Wait until ``text`` appears in the log (from byte ``start`` on)."""
        wait_until(lambda: text in self.log_path.read_bytes()[start:].decode("utf-8", "replace"), timeout,
                   f"{text!r} in the daemon's log", detail=lambda: self.log()[-2000:])
