"""Helpers for the hostile-input tests: an honest client in its own process, raw
sessions that speak the socket protocol by hand, and what /proc says about the daemon.

The honest client (``honest_worker.py``) runs beside every attack; :meth:`Honest.finish`
stops it and asserts its verdict: every timer it added delivered exactly once,
none early, no error raised by any call.
"""

from __future__ import annotations

import array
import json
import os
import signal
import socket
import subprocess
import sys
from daemon_harness import wait_until

from wheeld.protocol import framing
from wheeld.protocol import messages as M
from wheeld.shm import reader as R

WORKER = os.path.join(os.path.dirname(__file__), "honest_worker.py")
CLK_TCK = os.sysconf("SC_CLK_TCK")
_FDS_SPACE = socket.CMSG_SPACE(8 * array.array("i").itemsize)


# ---------------------------------------------------------------------------- /proc


def rss_kb(pid: int) -> int:
    """VmRSS of ``pid`` in KiB (private and shared pages it has mapped in)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds ``pid`` has used (fields 14 and 15 of /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def fd_targets(pid: int) -> list[str]:
    """What each open descriptor of ``pid`` points to (``socket:[...]``, ``/memfd:...``)."""
    out = []
    base = f"/proc/{pid}/fd"
    for entry in os.listdir(base):
        try:
            out.append(os.readlink(os.path.join(base, entry)))
        except FileNotFoundError:
            pass  # closed meanwhile
    return out


def counters(name: str) -> dict[str, int]:
    """The arena's published counters (what ``wheelctl stats`` shows)."""
    with R.ArenaReader(name) as reader:
        return reader.counters()


# ---------------------------------------------------------------------------- the honest client


class Honest:
    """An honest client process adding and receiving timers until :meth:`finish`."""

    def __init__(self, tmp_path, socket_path: str, *, group: str = "honest", rate: int = 200,
                 delay_ms=(1, 250), seed: int = 0, tag: str = "honest", tolerate: tuple[str, ...] = ()):
        self.status_path = str(tmp_path / f"{tag}.json")
        args = {"socket": socket_path, "group": group, "rate": rate, "delay_ms": list(delay_ms), "seed": seed,
                "tolerate": list(tolerate)}
        self.proc = subprocess.Popen([sys.executable, WORKER, json.dumps(args), self.status_path],
                                     stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.delay_ms = delay_ms
        self.wait_served(1, timeout_s=30)

    def status(self) -> dict:
        try:
            with open(self.status_path) as f:
                return json.load(f)
        except (FileNotFoundError, json.JSONDecodeError):
            return {"added": 0, "delivered": 0, "errors": [], "done": False}

    def delivered(self) -> int:
        return self.status()["delivered"]

    def wait_served(self, more: int, timeout_s: float = 20.0) -> int:
        """Wait until ``more`` timers were delivered from now on (it is being served)."""
        start = self.delivered()

        def served():
            if self.proc.poll() is not None:
                raise AssertionError(f"the honest client exited: {self.proc.stderr.read().decode()[-2000:]}")
            return self.delivered() >= start + more

        wait_until(served, timeout_s, f"{more} more deliveries to the honest client", interval=0.02)
        return self.delivered()

    def finish(self, timeout_s: float = 60.0) -> dict:
        """Stop adding, wait for every timer, and assert the verdict."""
        try:
            self.proc.stdin.write(b"stop\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError("the honest client did not finish in time") from None
        stderr = self.proc.stderr.read().decode(errors="replace")
        result = self.status()
        assert self.proc.returncode == 0 and result.get("done"), f"honest client failed:\n{stderr[-3000:]}"
        assert result["errors"] == [], result["errors"]
        assert result["missing_count"] == 0, f"lost {result['missing_count']} honest timers: {result['missing']}"
        assert result["duplicates"] == [], result["duplicates"]
        assert result["early"] == [], result["early"]
        assert result["added"] > 0 and result["delivered"] == result["added"]
        return result

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


# ---------------------------------------------------------------------------- raw sessions


class Raw:
    """A connection that speaks the framing by hand (what a hostile client does)."""

    def __init__(self, socket_path: str, timeout_s: float = 10.0):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout_s)
        self.sock.connect(socket_path)
        self.reader = framing.FrameReader()

    def send(self, data: bytes, fds: list[int] = ()) -> None:
        if fds:
            sent = self.sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
            self.sock.sendall(data[sent:])
        else:
            self.sock.sendall(data)

    def hello(self, group: str, fds: list[int] = (), resume_segment: str = "", resume_token: int = 0):
        """Send a Hello (with ``fds`` as SCM_RIGHTS) and return (reply, descriptors received)."""
        self.send(M.encode_client_frame(M.Hello(M.PROTOCOL_VERSION, group, os.getpid(), "hostile", resume_segment,
                                                resume_token)), fds)
        return self.reply()

    def reply(self):
        """The next daemon message and the descriptors that came with it; None on EOF."""
        received: list[int] = []
        while True:
            data, ancillary, _flags, _addr = self.sock.recvmsg(65536, _FDS_SPACE)
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds = array.array("i")
                    fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
                    received += fds
            if not data:
                return None, received
            frames = self.reader.feed(data)
            if frames:
                return M.decode_daemon_message(frames[0]), received

    def closed_by_peer(self, timeout_s: float) -> bool:
        """Read (and drop) until the daemon closes the connection; False after ``timeout_s``."""
        self.sock.settimeout(timeout_s)
        try:
            while self.sock.recv(65536):
                pass
            return True
        except (TimeoutError, BlockingIOError):
            return False
        except OSError:
            return True  # ECONNRESET: closed too

    def close(self) -> None:
        self.sock.close()
