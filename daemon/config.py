"""Daemon configuration: one frozen value built by the CLI (or a test) and passed to ``run``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from wheeld.protocol import clients_layout as CL
from wheeld.protocol.naming import default_name, default_socket_path


#: the exit status of a daemon that stood down because another host took its timers over (wheeld.fleet)
EXIT_FENCED = 69

#: the largest ``--capacity`` (records of 64 bytes; the arena's int32 record numbers, with room)
MAX_CAPACITY = (1 << 31) - 100_000


@dataclass(frozen=True)
class Config:
    socket_path: str = field(default_factory=default_socket_path)
    name: str = field(default_factory=default_name)
    tick_ms: int = 1
    wheel_size: int = 256
    capacity: int = 1_000_000
    ring_capacity: int = 1 << 14
    touch_capacity: int = 1 << 17
    max_clients: int = CL.MAX_CLIENTS  # client slots (at most clients_layout.MAX_CLIENTS)
    clients_per_uid: int | None = None  # slots one uid may hold; None: a quarter of max_clients; 0: no bound
    arena_mode: int = 0o600  # 0o640 with monitor_gid: the arena is the daemon's and its monitors'
    monitor_gid: int | None = None  # --monitor-group: may read the arena (wheelctl stats/dump/check)
    socket_mode: int | None = None  # --socket-mode of a socket the daemon binds itself (None: 0660)
    socket_gid: int | None = None  # --socket-group: that socket's group (None: the daemon's)
    allowed_uids: frozenset[int] | None = None  # None: anyone who can open the socket
    allowed_gids: frozenset[int] | None = None
    #: --group-owner NAME=UID|@GROUP: (name, "uid"|"gid", id); other groups belong to their first uid
    group_owners: tuple[tuple[str, str, int], ...] = ()
    group_quota: int = 0  # pending + unacknowledged records a group may hold; 0: no limit
    max_groups: int = 1024  # group ids of a new arena
    groups_per_uid: int | None = None  # groups one uid may own; None: a quarter of the arena's ids; 0: no bound
    ack_timeout_s: float = 30.0  # an expiration unacknowledged this long is sent again (to any member)
    frame_timeout_s: float = 5.0  # a frame started must be complete within this
    resume_grace_s: float = 60.0  # after a restart, a client slot waits this long for its client
    max_handshakes_per_uid: int = 32  # connections of one uid still before their Hello
    metrics: str | None = None  # "ADDR:PORT"
    journal_dir: str | None = None
    fsync: str = "interval=10"
    journal_damage: str = "skip"  # "refuse": exit instead of recovering past damaged journal lines
    max_park_ms: int = 500  # longest sleep without a wake-up (bounds a missed doorbell)
    coalesce_us: int = 1000  # a parked daemon wakes this long after a non-urgent doorbell (0: at once)
    delivery_batch: int = 4096
    #: --replicate: the journal sent to a NATS JetStream cluster (wheeld.fleet); None: local only
    fleet: Any = None  # a wheeld.fleet.replicator.FleetConfig
    durability: str = "local"  # "replicated": a flush() returns once the stream stored what it covers
    replicate_timeout_s: float = 5.0  # a flush() the stream has not stored this long fails (ReplicationBehind)
    handshake_timeout_s: float = 5.0
