"""Start and stop real wheeld processes for tests; clean up every segment they made."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

SHM_DIR = "/dev/shm"


def unique_name() -> str:
    return f"test-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def unlink_segments(name: str) -> list[str]:
    """Remove every shared-memory segment of daemon instance ``name``."""
    removed = []
    prefix = f"wheeld-{name}-"
    for entry in os.listdir(SHM_DIR):
        if entry.startswith(prefix):
            try:
                os.unlink(os.path.join(SHM_DIR, entry))
                removed.append(entry)
            except FileNotFoundError:
                pass
    return removed


class DaemonProcess:
    def __init__(self, tmp_path, *, capacity=200_000, extra=(), name=None):
        self.name = name or unique_name()
        self.socket_path = str(tmp_path / f"{self.name}.sock")
        self.log_path = tmp_path / f"{self.name}.log"
        self.capacity = capacity
        self.extra = list(extra)
        self.proc: subprocess.Popen | None = None
        self._log = None

    def start(self, timeout_s: float = 15.0, env: dict | None = None) -> "DaemonProcess":
        self._log = open(self.log_path, "ab")
        cmd = [sys.executable, "-m", "wheeld.daemon.cli", "--socket", self.socket_path, "--name", self.name,
               "--capacity", str(self.capacity), *self.extra]
        full_env = dict(os.environ)
        full_env.pop("NOTIFY_SOCKET", None)
        full_env.update(env or {})
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=full_env)
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"wheeld exited with {self.proc.returncode}:\n{self.log()}")
            # ready: it logs so once the arena is mapped (a recovery can take a while
            # after the socket is bound) and it accepts
            if " ready on " in self.log_path.read_bytes()[offset:].decode("utf-8", "replace"):
                return self
            time.sleep(0.01)
        self.kill()
        raise RuntimeError(f"wheeld did not become ready within {timeout_s} s:\n{self.log()}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def kill(self, sig=signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if self._log is not None:
            self._log.close()
            self._log = None

    def stop(self) -> int:
        self.kill(signal.SIGTERM)
        return self.proc.returncode

    def restart(self) -> "DaemonProcess":
        self.kill()
        return self.start()

    def cleanup(self) -> None:
        self.kill()
        unlink_segments(self.name)
