"""Daemon configuration: one frozen value built by the CLI (or a test) and passed to ``run``."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

DEFAULT_NAME = "default"
#: ``--journal-damage``: what recovery does with damaged journal lines (daemon/journal.py, "Damage").
JOURNAL_DAMAGE_POLICIES = ("skip", "refuse")
SYSTEM_SOCKET_DIR = "/run/wheeld"


def default_socket_path(name: str = DEFAULT_NAME) -> str:
    """``$WHEELD_SOCKET``, else /run/wheeld/<name>.sock when that directory is writable
    (the systemd unit's RuntimeDirectory), else $XDG_RUNTIME_DIR/wheeld-<name>.sock,
    else ~/.cache/wheeld/<name>.sock (never /tmp: PrivateTmp= would hide it)."""
    env = os.environ.get("WHEELD_SOCKET")
    if env:
        return env
    if os.path.isdir(SYSTEM_SOCKET_DIR) and os.access(SYSTEM_SOCKET_DIR, os.W_OK | os.X_OK):
        return os.path.join(SYSTEM_SOCKET_DIR, f"{name}.sock")
    if os.path.isdir(SYSTEM_SOCKET_DIR) and os.access(SYSTEM_SOCKET_DIR, os.X_OK):
        candidate = os.path.join(SYSTEM_SOCKET_DIR, f"{name}.sock")
        if os.path.exists(candidate):  # a system daemon runs: clients use its socket
            return candidate
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime) and os.access(runtime, os.W_OK):
        return os.path.join(runtime, f"wheeld-{name}.sock")
    return os.path.join(os.path.expanduser("~"), ".cache", "wheeld", f"{name}.sock")


def default_name() -> str:
    return os.environ.get("WHEELD_NAME", DEFAULT_NAME)


def arena_name(name: str) -> str:
    """Shared-memory names carry the daemon's --name so an operator can find them."""
    return f"/wheeld-{name}-arena"


def clients_name(name: str) -> str:
    return f"/wheeld-{name}-clients"


def segment_prefix(name: str) -> str:
    return f"/wheeld-{name}-c"


@dataclass(frozen=True)
class Config:
    socket_path: str = field(default_factory=default_socket_path)
    name: str = field(default_factory=default_name)
    tick_ms: int = 1
    wheel_size: int = 256
    capacity: int = 1_000_000
    ring_capacity: int = 1 << 14
    touch_capacity: int = 1 << 17
    max_clients: int = 2047
    arena_mode: int = 0o640
    socket_mode: int = 0o660
    allowed_uids: frozenset[int] | None = None  # None: anyone who can open the socket
    allowed_gids: frozenset[int] | None = None
    metrics: str | None = None  # "ADDR:PORT"
    journal_dir: str | None = None
    fsync: str = "interval=10"
    journal_damage: str = "skip"  # "refuse": exit instead of recovering past damaged journal lines
    max_park_ms: int = 500  # longest sleep without a wake-up (bounds a missed doorbell)
    coalesce_us: int = 500  # a parked daemon wakes this long after a non-urgent doorbell (0: at once)
    delivery_batch: int = 4096
    handshake_timeout_s: float = 5.0
    log_level: str = "INFO"
