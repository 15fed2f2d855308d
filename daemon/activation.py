"""Socket activation: take over the listening socket systemd opened for us.

With ``wheeld.socket`` enabled, systemd binds ``/run/wheeld/default.sock``
(owner, group and mode from the socket unit), listens, and starts the daemon
with the socket already open. Connections that arrive before the daemon is
ready, or while it restarts, wait in the listen backlog instead of failing.

The protocol (sd_listen_fds(3)) is three environment variables and a range of
file descriptors:

====================  ========================================================
``LISTEN_PID``        the pid the descriptors are meant for. Checked against
                      ``os.getpid()``: a child that inherited the environment
                      must not think the sockets are its own.
``LISTEN_FDS``        how many descriptors, numbered from 3 (``SD_LISTEN_FDS_START``)
``LISTEN_FDNAMES``    their names, colon-separated (``FileDescriptorName=``;
                      wheeld.socket names its socket ``wheeld``)
====================  ========================================================

:func:`listen_fds` reads them, marks the descriptors close-on-exec (systemd
passes them inheritable), wraps each socket in a :class:`socket.socket`, and
unsets the variables (by default), so that nothing the daemon starts takes the
sockets for its own. :func:`unix_stream_listener` picks the control socket out
of them. Without socket activation both return nothing and the daemon binds
``--socket`` itself.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import MutableMapping
from typing import NamedTuple

from wheeld.protocol.errors import WheeldError

logger = logging.getLogger(__name__)

SD_LISTEN_FDS_START = 3
_ENVIRONMENT_KEYS = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")


class InheritedFd(NamedTuple):
    """One descriptor passed by systemd; ``socket`` is None for a FIFO or a file."""

    fd: int
    name: str
    socket: socket.socket | None


def listen_fds(
    environ: MutableMapping[str, str] | None = None, *, unset_environment: bool = True
) -> list[InheritedFd]:
    """The descriptors systemd passed to this process, in order; [] if none.

    Raises :class:`WheeldError` when ``LISTEN_PID`` is ours but ``LISTEN_FDS``
    is not a count, or a descriptor is not open: systemd would never do that,
    so the environment is broken and starting anyway would hide it.
    """
    env = os.environ if environ is None else environ
    listen_pid, listen_count, listen_names = (env.get(key) for key in _ENVIRONMENT_KEYS)
    if unset_environment:
        for key in _ENVIRONMENT_KEYS:
            env.pop(key, None)

    if listen_pid is None or listen_count is None:
        return []
    try:
        if int(listen_pid) != os.getpid():
            return []  # inherited from a parent that was activated, not meant for us
        fd_count = int(listen_count)
    except ValueError:
        raise WheeldError(f"bad socket activation environment: LISTEN_PID={listen_pid!r} "
                          f"LISTEN_FDS={listen_count!r}") from None
    if fd_count < 0:
        raise WheeldError(f"bad socket activation environment: LISTEN_FDS={listen_count!r}")

    names = listen_names.split(":") if listen_names else []
    if len(names) != fd_count:
        names = ["unknown"] * fd_count  # what sd_listen_fds_with_names() reports then
    inherited = []
    for index, name in enumerate(names):
        fd = SD_LISTEN_FDS_START + index
        try:
            os.set_inheritable(fd, False)
        except OSError as error:
            raise WheeldError(f"LISTEN_FDS={fd_count} but descriptor {fd} is not open: {error}") from None
        try:
            inherited.append(InheritedFd(fd, name, socket.socket(fileno=fd)))
        except OSError:  # ENOTSOCK: a ListenFIFO= or ListenSpecial= descriptor
            inherited.append(InheritedFd(fd, name, None))
    return inherited


def is_unix_stream_listener(sock: socket.socket) -> bool:
    """True for an AF_UNIX SOCK_STREAM socket in the listening state."""
    return (
        sock.family == socket.AF_UNIX
        and sock.type == socket.SOCK_STREAM
        and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
    )


def unix_stream_listener(
    inherited: list[InheritedFd], *, name: str | None = "wheeld", path: str | None = None
) -> socket.socket | None:
    """The inherited listening AF_UNIX stream socket to serve clients on, or None.

    A socket called ``name`` is preferred; otherwise the first listening Unix
    stream socket. When ``path`` (the daemon's ``--socket``) is given and the
    chosen socket is bound elsewhere, a warning says so: the socket unit wins,
    since it is what clients were told to connect to.
    """
    candidates = [entry for entry in inherited if entry.socket is not None and is_unix_stream_listener(entry.socket)]
    named = [entry for entry in candidates if entry.name == name]
    pool = named or candidates
    if not pool:
        return None
    listener = pool[0].socket
    assert listener is not None  # candidates only hold sockets
    bound_path = listener.getsockname()
    if path is not None and bound_path != path:
        logger.warning("socket activation: inherited socket is bound to %r, not --socket %r; using it",
                       bound_path, path)
    return listener
