"""The wheeld daemon's shell: the event loop, the sockets and the timer around the core.

One process, one thread, one uvloop event loop. Every decision is the core's
(:mod:`wheeld.daemon.core`: what a timer, a client or a byte on disk becomes);
this module only moves bytes and time to it:

* the listening socket: accept, read the peer's credentials (``SO_PEERCRED``),
  hand the connection to the core with a :class:`SocketTransport`; out of
  descriptors (``EMFILE``), stop accepting until a session closes or a second
  has passed;
* each connection: what it reads (``recvmsg``, with passed descriptors) goes to
  :meth:`DaemonCore.received <wheeld.daemon.core.DaemonCore.received>`, and when
  it can take more bytes, :meth:`~wheeld.daemon.core.DaemonCore.writable`;
* the loop: :meth:`~wheeld.daemon.core.DaemonCore.iterate`, then
  :meth:`~wheeld.daemon.core.DaemonCore.park` says until when to sleep, and the
  shell sleeps on a timerfd (:mod:`wheeld.daemon.alarm`: the loop's own timer has
  whole-ms resolution) until then or until the core asks to be woken;
* once a second :meth:`~wheeld.daemon.core.DaemonCore.maintain`; signals (stop);
  sd_notify (READY, STATUS, the watchdog's pings, STOPPING); the Prometheus
  endpoint (``--metrics``).
"""

from __future__ import annotations

import array
import asyncio
import errno
import gc
import logging
import os
import signal
import socket
import struct
import time

from wheeld.protocol import accel
from wheeld.protocol import clock as clocks

from .alarm import Alarm
from .config import Config
from .connection import MAX_PASSED_FDS, RECV_BYTES
from .core import DaemonCore
from .host import real_host
from .sdnotify import Notifier
from .sessions import MAINTAIN_S
from .startup import open_socket

log = logging.getLogger("wheeld")

_PEERCRED = struct.Struct("3i")
_FDS_SPACE = socket.CMSG_SPACE(MAX_PASSED_FDS * array.array("i").itemsize)
_ACCEPTS_PER_WAKE = 64


class SocketTransport:
    """A client connection as the core sees it (:class:`wheeld.daemon.host.Transport`)."""

    __slots__ = ("sock", "fd", "daemon", "session", "_writing", "_closed")

    def __init__(self, sock: socket.socket, daemon: Daemon):
        self.sock = sock
        self.fd = sock.fileno()
        self.daemon = daemon
        self.session = None
        self._writing = False
        self._closed = False

    def send(self, data) -> int:
        try:
            return self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            return 0

    def send_with_fds(self, data: bytes, fds: list[int]) -> int:
        return self.sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])

    def want_writable(self, wanted: bool) -> None:
        if wanted == self._writing or self._closed:
            return
        self._writing = wanted
        loop = self.daemon.loop
        if wanted:
            loop.add_writer(self.fd, self.daemon.core.writable, self.session)
        else:
            loop.remove_writer(self.fd)

    def peer_gone(self) -> bool:
        try:
            return self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True  # ECONNRESET

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        loop = self.daemon.loop
        loop.remove_reader(self.fd)
        if self._writing:
            loop.remove_writer(self.fd)
        self.sock.close()

    def on_readable(self) -> None:
        try:
            data, ancillary, _flags, _addr = self.sock.recvmsg(RECV_BYTES, _FDS_SPACE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self.daemon.core.hangup(self.session, f"recv failed: {exc}")
            return
        fds: list[int] = []
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                received = array.array("i")
                received.frombytes(payload[: len(payload) - len(payload) % received.itemsize])
                fds.extend(received)
        self.daemon.core.received(self.session, data, fds)


class Daemon:
    """The real daemon: a :class:`~wheeld.daemon.core.DaemonCore` on the real host, driven by
    uvloop. ``clock``: the arena's clock in ms (CLOCK_MONOTONIC unless a test passes another)."""

    def __init__(self, config: Config, clock=clocks.mono_ms):
        self.config = config
        self.core = DaemonCore(config, real_host(clock), self)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.listener: socket.socket | None = None
        self._owns_socket_path = False
        self.notifier = Notifier()
        self._wake_future: asyncio.Future | None = None
        self._alarm: Alarm | None = None  # the park's precise wake-up (a timerfd), where Linux has it
        self._park_handle: asyncio.TimerHandle | None = None  # its stand-in without timerfd
        self._maintain_handle: asyncio.TimerHandle | None = None
        self._accept_paused = False
        self._last_watchdog = 0.0
        self.replicator = None  # --replicate: wheeld.fleet.replicator.Replicator (the core reads it)

    # what the metrics endpoint reads
    @property
    def wheel(self):
        return self.core.wheel

    @property
    def clients(self):
        return self.core.clients

    # ------------------------------------------------------------------ run
    def run(self) -> int:
        import uvloop

        return uvloop.run(self.main())

    async def main(self) -> int:
        self.loop = asyncio.get_running_loop()
        core = self.core
        # One daemon per instance: the lock comes before anything is mapped for writing,
        # and the socket before the arena, so a second daemon changes nothing at all
        # (and a start refused later removes what it made).
        core.acquire()
        try:
            metrics_server = await self._start()
        except BaseException:
            if self.listener is not None:
                self._close_listener()
            core.abandon()
            raise
        core.mark_ready()
        self.notifier.ready(status=core.status_line())
        log.info("wheeld %s ready on %s (pid %d, %s hot path)", self.config.name, self.config.socket_path, os.getpid(),
                 accel.implementation())
        try:
            await self._drive()
        finally:
            self.notifier.stopping()
            if metrics_server is not None:
                metrics_server.close()
            self._shutdown()
            if self.replicator is not None:
                await self.replicator.close()
        return core.exit_code

    async def _start(self):
        """Everything between the instance lock and READY; the metrics server, if any."""
        self.listener, self._owns_socket_path = open_socket(self.config)
        if self.config.fleet is not None:
            from wheeld.fleet.replicator import Replicator

            self.replicator = Replicator(self.config.fleet, on_progress=self.core.replication_progress,
                                         on_fenced=self.core.fenced, clock_ms=self.core.clock)
            if self.config.fleet.adopt:
                from wheeld.fleet.adopt import Adopter

                self.replicator.adopter = Adopter(self.config.fleet, self.core.adopt)
        self.core.open()
        if self.replicator is not None:
            self.replicator.start()
        watchdog_s = self.notifier.watchdog_interval_s()
        self.core.watchdog_ms = int(watchdog_s * 1000) if watchdog_s else 0
        self._maintain_handle = self.loop.call_later(MAINTAIN_S, self._maintain)
        # Everything allocated so far lives as long as the daemon: move it out of the
        # collector's reach, so a full collection (3-7 ms over the ~30k objects of the
        # imported modules and the arena set-up) cannot stall the loop while timers are due.
        gc.collect()
        gc.freeze()
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.loop.add_signal_handler(sig, self.core.stop)
        metrics_server = None
        if self.config.metrics:  # before READY=1: a bad address must fail the start, not a running service
            from .metrics import start_metrics_server

            metrics_server = await start_metrics_server(self, self.config.metrics)
        self.loop.add_reader(self.listener.fileno(), self._on_accept)
        self._alarm = Alarm.create()
        if self._alarm is not None:
            self.loop.add_reader(self._alarm.fileno(), self._on_alarm)
        else:
            log.warning("no timerfd: parking with the event loop's millisecond timer")
        return metrics_server

    def _shutdown(self) -> None:
        self.loop.remove_reader(self.listener.fileno())
        if self._alarm is not None:
            self.loop.remove_reader(self._alarm.fileno())
            self._alarm.close()
            self._alarm = None
        if self._maintain_handle is not None:
            self._maintain_handle.cancel()
        self.core.shutdown()
        self._close_listener()

    def _close_listener(self) -> None:
        self.listener.close()
        if self._owns_socket_path:
            try:
                os.unlink(self.config.socket_path)
            except FileNotFoundError:
                pass

    def _maintain(self) -> None:
        self._maintain_handle = self.loop.call_later(MAINTAIN_S, self._maintain)
        self.resume_accept()  # at most a second after accepting paused
        self.core.maintain()

    # ------------------------------------------------------------------ connections
    def _on_accept(self) -> None:
        for _ in range(_ACCEPTS_PER_WAKE):
            try:
                sock, _addr = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._pause_accept(exc)
                else:
                    log.warning("accept: %s", exc)
                return
            sock.setblocking(False)
            try:
                pid, uid, gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
            except OSError:
                pid = uid = gid = -1
            transport = SocketTransport(sock, self)
            session = self.core.connected(transport, pid, uid, gid)
            if session is not None:
                transport.session = session
                self.loop.add_reader(transport.fd, transport.on_readable)

    def _pause_accept(self, exc: OSError) -> None:
        """Out of descriptors: stop accepting (the listening socket would stay readable and
        spin the loop) until a session closes or a second has passed."""
        if self._accept_paused:
            return
        self._accept_paused = True
        self.loop.remove_reader(self.listener.fileno())
        self.core.accept_paused(exc.strerror)

    def resume_accept(self) -> None:
        if self._accept_paused and not self.core.stopping:
            self._accept_paused = False
            self.loop.add_reader(self.listener.fileno(), self._on_accept)

    def status_changed(self) -> None:
        if self.core.ready:
            self.notifier.status(self.core.status_line())

    # ------------------------------------------------------------------ the loop
    async def _drive(self) -> None:
        core = self.core
        while not core.stopping:
            again = core.iterate()
            self._watchdog()
            if again:
                await asyncio.sleep(0)  # let sockets in, then drain again
                continue
            wake_ns = core.park()
            if wake_ns is None:
                continue
            await self._sleep_until(wake_ns)
            core.unpark()

    def _watchdog(self) -> None:
        watchdog_s = self.notifier.watchdog_interval_s()
        if watchdog_s and time.monotonic() - self._last_watchdog >= watchdog_s:
            self._last_watchdog = time.monotonic()
            self.notifier.watchdog()
            self.notifier.status(self.core.status_line())

    async def _sleep_until(self, wake_ns: int) -> None:
        fut = self._wake_future = self.loop.create_future()
        self.wake_at(wake_ns)
        await fut
        self._wake_future = None
        if self._park_handle is not None:
            self._park_handle.cancel()
            self._park_handle = None

    def wake(self) -> None:
        fut = self._wake_future
        if fut is not None and not fut.done():
            fut.set_result(None)

    def wake_at(self, at_ns: int) -> None:
        """End the current park at ``at_ns`` (CLOCK_MONOTONIC), replacing the earlier setting."""
        if self._alarm is not None:
            self._alarm.arm(at_ns)
            return
        if self._park_handle is not None:
            self._park_handle.cancel()
        self._park_handle = self.loop.call_later(max(0.0, (at_ns - time.monotonic_ns()) / 1e9), self.wake)

    def _on_alarm(self) -> None:
        if self._alarm.consume():
            self.wake()


def run(config: Config) -> int:
    return Daemon(config).run()
