"""Where a wheeld instance lives: its socket path and its shared-memory names.

Shared by the daemon, which creates them, and by the client library and
``wheelctl``, which look for them, so both sides agree without importing each
other. An instance has a *name* (``--name``, ``$WHEELD_NAME``, default
``default``); everything else follows from it unless ``$WHEELD_SOCKET`` says
where the socket is.
"""

from __future__ import annotations

import os

DEFAULT_NAME = "default"
SYSTEM_SOCKET_DIR = "/run/wheeld"
SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared-memory names


def default_name() -> str:
    """``$WHEELD_NAME``, else ``default``."""
    return os.environ.get("WHEELD_NAME") or DEFAULT_NAME


def default_socket_path(name: str | None = None) -> str:
    """``$WHEELD_SOCKET``, else /run/wheeld/<name>.sock when that directory is writable
    (the systemd unit's RuntimeDirectory) or a daemon listens there, else
    $XDG_RUNTIME_DIR/wheeld-<name>.sock, else ~/.cache/wheeld/<name>.sock (never /tmp:
    PrivateTmp= would hide it). ``name`` defaults to :func:`default_name`."""
    env = os.environ.get("WHEELD_SOCKET")
    if env:
        return env
    name = name or default_name()
    system = os.path.join(SYSTEM_SOCKET_DIR, f"{name}.sock")
    if os.path.isdir(SYSTEM_SOCKET_DIR) and os.access(SYSTEM_SOCKET_DIR, os.W_OK | os.X_OK):
        return system
    if os.path.isdir(SYSTEM_SOCKET_DIR) and os.access(SYSTEM_SOCKET_DIR, os.X_OK) and os.path.exists(system):
        return system  # a system daemon runs: clients use its socket
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime) and os.access(runtime, os.W_OK):
        return os.path.join(runtime, f"wheeld-{name}.sock")
    return os.path.join(os.path.expanduser("~"), ".cache", "wheeld", f"{name}.sock")


def arena_name(name: str) -> str:
    """The arena's POSIX shared-memory name (``/dev/shm/wheeld-<name>-arena``)."""
    return f"/wheeld-{name}-arena"


def clients_name(name: str) -> str:
    """The daemon's client table (``/dev/shm/wheeld-<name>-clients``)."""
    return f"/wheeld-{name}-clients"


def segment_prefix(name: str) -> str:
    """Label prefix of a client's ring (a memfd: it shows in /proc/PID/fd, not in /dev/shm)."""
    return f"wheeld-{name}-c"


def shm_prefix(name: str) -> str:
    """Every file the instance keeps in /dev/shm starts with this."""
    return f"wheeld-{name}-"


def lock_path(name: str) -> str:
    """The instance lock (:mod:`wheeld.protocol.instance_lock`): ``/dev/shm/wheeld-<name>-lock``."""
    return os.path.join(SHM_DIR, f"{shm_prefix(name)}lock")


def shm_path(segment_name: str) -> str:
    """The file behind a POSIX shared-memory name (Linux keeps them in /dev/shm)."""
    return os.path.join(SHM_DIR, segment_name.lstrip("/"))
