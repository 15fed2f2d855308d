"""Tell systemd how the daemon is doing: the sd_notify protocol, spoken directly.

systemd starts a ``Type=notify`` service with ``NOTIFY_SOCKET`` in its
environment: the address of a Unix *datagram* socket, either a path
(``/run/systemd/notify``) or, when it starts with ``@``, a name in the Linux
abstract namespace (``@`` stands for the leading NUL byte). Each datagram is a
few newline-separated ``KEY=value`` assignments. No libsystemd, no
python-systemd: a datagram socket and ``sendto`` are the whole protocol
(gunicorn's ``systemd.py`` does the same).

What wheeld sends, and when (the daemon decides *when*; this module only
speaks):

=================================  =============================================
``READY=1``                        once the arena is mapped and the control
                                   socket accepts; the unit leaves "activating"
``STATUS=<one line>``              a summary for ``systemctl status``
``WATCHDOG=1``                     from the wheel's own loop, every
                                   :meth:`Notifier.watchdog_interval_s`; a stuck
                                   wheel stops pinging and systemd kills it
``STOPPING=1``                     when shutdown begins
``RELOADING=1`` + ``MONOTONIC_USEC``  when a reload begins (then ``READY=1``
                                   again when done); systemd uses the
                                   timestamp to order the two
``EXTEND_TIMEOUT_USEC=<us>``       "still starting" during a long recovery
=================================  =============================================

The watchdog: ``WatchdogSec=`` reaches the service as ``WATCHDOG_USEC``
(microseconds), with ``WATCHDOG_PID`` naming the process it is meant for (if
set and not ours, the watchdog is somebody else's). systemd asks for a ping at
half the interval, so one late ping is not fatal.

Guarantees: with ``NOTIFY_SOCKET`` unset (not under systemd, tests) every call
is a no-op. A send never raises: if the socket is gone or full, the message is
dropped and the failure logged once (until a send succeeds again). A
notification must never take the daemon down, and the wheel loop must never
stall on it for long: the socket has a short send timeout.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping, MutableMapping

logger = logging.getLogger(__name__)

_ENVIRONMENT_KEYS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


class Notifier:
    """One connection-less sender to ``$NOTIFY_SOCKET``; cheap to call often."""

    def __init__(
        self,
        environ: Mapping[str, str] | None = None,
        *,
        unset_environment: bool = False,
        send_timeout_s: float = 0.5,
    ) -> None:
        """Read the systemd variables from ``environ`` (default ``os.environ``).

        ``unset_environment=True`` removes them afterwards (from ``os.environ``
        when that is what was read), so child processes do not believe that
        systemd supervises them too.
        """
        env = os.environ if environ is None else environ
        self._address = _socket_address(env.get("NOTIFY_SOCKET", ""))
        self._watchdog_usec = _watchdog_usec(env)
        self._send_timeout_s = send_timeout_s
        self._socket: socket.socket | None = None
        self._failure_logged = False
        if unset_environment and isinstance(env, MutableMapping):
            for key in _ENVIRONMENT_KEYS:
                env.pop(key, None)

    @property
    def enabled(self) -> bool:
        """True when a notification socket was given (running under systemd)."""
        return self._address is not None

    def watchdog_interval_s(self) -> float | None:
        """Seconds between two ``WATCHDOG=1`` pings (half of ``WatchdogSec``), or None when no watchdog is ours."""
        if self._watchdog_usec is None:
            return None
        return self._watchdog_usec / 2 / 1_000_000

    def ready(self, status: str | None = None) -> None:
        """Startup finished: the arena is mapped and the socket accepts."""
        self.notify("READY=1" if status is None else f"READY=1\nSTATUS={_one_line(status)}")

    def status(self, text: str) -> None:
        """Set the one-line status ``systemctl status`` shows."""
        self.notify(f"STATUS={_one_line(text)}")

    def watchdog(self) -> None:
        """The wheel is alive (call at :meth:`watchdog_interval_s`)."""
        self.notify("WATCHDOG=1")

    def stopping(self) -> None:
        """Shutdown has begun."""
        self.notify("STOPPING=1")

    def reloading(self) -> None:
        """A reload has begun; send :meth:`ready` when it is done."""
        monotonic_usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1_000
        self.notify(f"RELOADING=1\nMONOTONIC_USEC={monotonic_usec}")

    def extend_timeout(self, seconds: float) -> None:
        """Ask for ``seconds`` more before systemd gives up on start or stop."""
        self.notify(f"EXTEND_TIMEOUT_USEC={int(seconds * 1_000_000)}")

    def notify(self, message: str) -> None:
        """Send raw ``KEY=value`` lines; a no-op without a socket, never raises."""
        if self._address is None:
            return
        try:
            if self._socket is None:
                self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._socket.settimeout(self._send_timeout_s)
            self._socket.sendto(message.encode(), self._address)
        except OSError as error:
            if not self._failure_logged:
                logger.warning("sd_notify to %r failed, message dropped: %s", self._address, error)
                self._failure_logged = True
            return
        self._failure_logged = False

    def close(self) -> None:
        """Close the sending socket (a later call reopens it)."""
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def _socket_address(notify_socket: str) -> str | bytes | None:
    """``$NOTIFY_SOCKET`` as a ``sendto`` address; None when unset or unusable."""
    if notify_socket.startswith("@"):
        return b"\0" + notify_socket[1:].encode()  # abstract namespace
    if notify_socket.startswith("/"):
        return notify_socket
    if notify_socket:  # e.g. vsock: (systemd 253+, for VMs): not for a host-local daemon
        logger.warning("unsupported NOTIFY_SOCKET %r; not notifying systemd", notify_socket)
    return None


def _watchdog_usec(env: Mapping[str, str]) -> int | None:
    """``WATCHDOG_USEC`` if the watchdog is meant for this process, else None."""
    try:
        watchdog_usec = int(env.get("WATCHDOG_USEC", ""))
        if watchdog_usec <= 0:
            return None
        if "WATCHDOG_PID" in env and int(env["WATCHDOG_PID"]) != os.getpid():
            return None
    except ValueError:
        return None
    return watchdog_usec


def _one_line(text: str) -> str:
    """A newline would start a new assignment; keep STATUS= to one line."""
    return " ".join(text.splitlines())
